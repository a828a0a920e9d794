# Copyright (c) 2026 paddle_muon_ext Authors. All Rights Reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Owner-partition balance and speed: ours (balanced_partition) vs develop's
rule (upstream_partition) and develop's machine-balanced rule.

    python tools/bench/bench_partition.py [--preset ernie-moe-small]
        [--nranks 8 16 64] [--buffer-mb 256] [--colour all|dense|expert]
        [--json FILE] [--no-fused]
    python tools/bench/bench_partition.py --scale [--sizes 2000x8 200000x1024]
        [--previous-up-to 2000] [--against REV] [--json-out]

``--scale`` times each rule on synthetic MoE models (N matrices over R ranks;
the machine-balanced rule sees the R ranks as R/8 machines), side by side with
the balanced rule's previous implementation (the frozen copy the partition
tests compare owners with) on the sizes it can still do, and checks that both
give the same owners; ``--against REV`` also times the balanced rule as
committed at git revision REV (e.g. ``main``) in the same run, for a
before/after ratio on a loaded machine. Target: 200,000 matrices over 1,024 ranks <= 5 s each.

Prints, per group size, max/mean optimizer-state bytes, max/mean Newton-Schulz
cost, ranks owning nothing and (owner, dtype) buffers, for both rules. The
figures are a deterministic property of the partition (no timing). Targets for
ours: state max/mean <= 1.05, NS max/mean <= 1.10. ``floor`` is the best any
whole-matrix partition can reach (largest matrix / mean share); where the floor
exceeds a target the case is flagged as physically impossible.

Importable: ``bench(...)`` returns the figures as a dict.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
for _p in (_HERE, os.path.join(_REPO, "python")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import moe_presets  # noqa: E402
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.owners import (  # noqa: E402
    MatrixSpec,
    optimizer_state_bytes,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.owners import (  # noqa: E402
    balanced_partition,
    machine_balanced_owner_indices,
    upstream_partition,
)
from paddle_muon_ext.tools.cost_model import max_over_mean  # noqa: E402
from paddle_muon_ext.tools.fast_layout import count_buffers  # noqa: E402
from paddle_muon_ext.tools.plan_world import balance_floor  # noqa: E402

TARGET_STATE = 1.05
TARGET_NS = 1.10
DEFAULT_NRANKS = (8, 16, 64)
# --scale: target seconds per rule at 200,000 matrices over 1,024 ranks
TARGET_SCALE_S = 5.0
DEFAULT_SIZES = ((2000, 8), (2000, 64), (20000, 1024), (200000, 1024))
DEFAULT_PREVIOUS_UP_TO = 2000
GPUS_PER_MACHINE = 8
# The partition tests hold the balanced rule's previous implementation (the
# oracle its owners are compared with); the benchmark times that same copy.
_PARTITION_TEST = os.path.join(_REPO, "test", "collective", "fleet",
                               "test_muon_sharding_partition.py")


def bench(
    preset: str = "ernie-moe-small",
    nranks_list: Sequence[int] = DEFAULT_NRANKS,
    buffer_size_MB: float = 256,
    colour: str = "all",
    json_path: Optional[str] = None,
) -> Dict:
    """Figures for ours and upstream on every group size in ``nranks_list``.

    ``colour``: ``"all"`` partitions every Muon matrix in one group (no MoE
    colour), ``"dense"`` / ``"expert"`` only the non-expert / expert ones (the
    default resp. moe_sharding group when colours are used).
    """
    params = moe_presets.load_json(json_path) if json_path else moe_presets.get_preset(preset)
    expert = {"all": None, "dense": False, "expert": True}[colour]
    specs = moe_presets.muon_specs(params, expert=expert)
    out: Dict = {
        "preset": json_path or preset,
        "colour": colour,
        "num_matrices": len(specs),
        "buffer_size_MB": buffer_size_MB,
        "targets": {"state_max_over_mean": TARGET_STATE, "ns_max_over_mean": TARGET_NS},
        "cases": {},
    }
    for n in nranks_list:
        ours = balanced_partition(specs, n)
        up = upstream_partition(specs, n, buffer_size_MB=buffer_size_MB)
        fb, fc = balance_floor(specs, n)
        achievable = fb <= TARGET_STATE and fc <= TARGET_NS
        so, no = max_over_mean(ours.state_bytes), max_over_mean(ours.ns_cost)
        out["cases"][n] = {
            "ours": {
                "state_max_over_mean": so,
                "ns_max_over_mean": no,
                "empty_ranks": len(ours.empty_ranks()),
                "buffers": count_buffers(ours),
            },
            "upstream": {
                "state_max_over_mean": max_over_mean(up.state_bytes),
                "ns_max_over_mean": max_over_mean(up.ns_cost),
                "empty_ranks": len(up.empty_ranks()),
                "buffers": count_buffers(up),
            },
            "floor": {"state": fb, "ns": fc},
            "achievable": achievable,
            "meets_targets": so <= TARGET_STATE and no <= TARGET_NS,
            "mean_state_MB": sum(ours.state_bytes) / n / 2**20,
        }
    return out


def format_table(fig: Dict) -> str:
    lines = [
        f"preset={fig['preset']} colour={fig['colour']} matrices={fig['num_matrices']} "
        f"develop buffer={fig['buffer_size_MB']:g} MB  "
        f"targets: state<={TARGET_STATE} ns<={TARGET_NS}",
        f"{'nranks':>6} | {'ours state':>10} {'ours NS':>8} {'empty':>5} {'bufs':>5} | "
        f"{'dev state':>8} {'dev NS':>8} {'empty':>5} {'bufs':>5} | "
        f"{'floor st/NS':>11} | verdict",
        "-" * 104,
    ]
    for n, c in fig["cases"].items():
        o, u, f = c["ours"], c["upstream"], c["floor"]
        if c["meets_targets"]:
            verdict = "OK"
        elif not c["achievable"]:
            verdict = "IMPOSSIBLE (floor > target: matrices too coarse for this group)"
        else:
            verdict = "MISSED"
        lines.append(
            f"{n:>6} | {o['state_max_over_mean']:>10.4f} {o['ns_max_over_mean']:>8.4f} "
            f"{o['empty_ranks']:>5} {o['buffers']:>5} | "
            f"{u['state_max_over_mean']:>8.3f} {u['ns_max_over_mean']:>8.3f} "
            f"{u['empty_ranks']:>5} {u['buffers']:>5} | "
            f"{f['state']:>5.2f}/{f['ns']:<5.2f} | {verdict}"
        )
    return "\n".join(lines)


def moe_model(num_matrices: int) -> List[MatrixSpec]:
    """Synthetic MoE model: per 200 matrices attention [4096, 4096] / [4096, 1024],
    one fp32 router gate [4096, 64], a shared expert [4096, 3072] / [3072, 4096]
    and routed experts [4096, 1536] / [1536, 4096], some fused 3-D [8, 4096, 1536]."""
    out = []
    for i in range(num_matrices):
        layer, j = divmod(i, 200)
        if j < 4:
            shape, dtype = ((4096, 4096) if j % 2 else (4096, 1024)), "bfloat16"
        elif j == 4:
            shape, dtype = (4096, 64), "float32"
        elif j < 7:
            shape, dtype = ((4096, 3072) if j % 2 else (3072, 4096)), "bfloat16"
        elif j % 25 == 0:
            shape, dtype = (8, 4096, 1536), "bfloat16"
        else:
            shape, dtype = ((4096, 1536) if j % 2 else (1536, 4096)), "bfloat16"
        out.append(MatrixSpec(f"l{layer}.m{j}", shape, dtype))
    return out


def random_model(num_matrices: int, seed: int = 0) -> List[MatrixSpec]:
    """Seeded mix of many shapes ({256..2048} x {256..4096}, a fifth 3-D, a tenth
    fp32): the case where the balanced rule's refinement works hardest."""
    rng = random.Random(seed)
    out = []
    for i in range(num_matrices):
        m, n = rng.choice([256, 512, 1024, 2048]), rng.choice([256, 512, 1024, 4096])
        shape = (m, n) if rng.random() < 0.8 else (rng.choice([4, 8]), m, n)
        out.append(MatrixSpec(f"p{i}", shape, "bfloat16" if rng.random() < 0.9 else "float32"))
    return out


MODELS = {"moe": moe_model, "random": random_model}


def _previous_balanced():
    spec = importlib.util.spec_from_file_location("_partition_test_oracle", _PARTITION_TEST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._frozen_balanced_owners


_MODULE_PATH = "python/paddle_muon_ext/distributed/fleet/meta_optimizers/muon_sharding/owners.py"


def load_revision(rev: str):
    """The partition module as committed at git revision ``rev`` (imported
    from a temporary copy), or ValueError naming the revision.

    Only the owner rules' module is taken from ``rev``: its relative imports
    (the dtype table) resolve against this checkout.
    """
    import subprocess
    import tempfile

    try:
        text = subprocess.run(["git", "-C", _REPO, "show", f"{rev}:{_MODULE_PATH}"],
                              capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise ValueError(f"cannot read the partition module at revision {rev!r} "
                         f"({(getattr(exc, 'stderr', '') or str(exc)).strip()}); pass a git revision "
                         "of this repository, e.g. main") from None
    # Named inside the package so its relative imports (the dtype table in
    # types.py) resolve against this checkout.
    name = ("paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding._owners_at_"
            + "".join(c if c.isalnum() else "_" for c in rev))
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(text)
    try:
        spec = importlib.util.spec_from_file_location(name, f.name)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    finally:
        os.unlink(f.name)
    return module


def _timed(fn) -> Tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def scale(sizes: Sequence[Tuple[int, int]] = DEFAULT_SIZES,
          previous_up_to: int = DEFAULT_PREVIOUS_UP_TO, models: Sequence[str] = ("moe",),
          against: Optional[str] = None) -> Dict:
    """Seconds per rule on each model of ``MODELS`` for each (matrices, ranks);
    with ``against``, also the balanced rule at that git revision."""
    previous = _previous_balanced() if previous_up_to > 0 else None
    other = load_revision(against) if against else None
    cases = []
    for model, (num, nranks) in ((m, size) for m in models for size in sizes):
        specs = MODELS[model](num)
        row: Dict = {"model": model, "matrices": num, "ranks": nranks}
        row["balanced_s"], part = _timed(lambda: balanced_partition(specs, nranks))
        row["balanced_state_max_over_mean"] = max_over_mean(part.state_bytes)
        if previous is not None and num <= previous_up_to:
            items = [(s.name, optimizer_state_bytes(s), _ns(s.shape), s.dtype) for s in specs]
            row["previous_balanced_s"], old = _timed(
                lambda: previous(items, nranks, list(range(nranks))))
            row["same_owners"] = old == part.owners
        if other is not None:
            row["against_s"], old_part = _timed(lambda: other.balanced_partition(specs, nranks))
            row["against_same_owners"] = old_part.owners == part.owners
            row["speedup_vs_against"] = row["against_s"] / max(row["balanced_s"], 1e-9)
        row["develop_s"], _ = _timed(lambda: upstream_partition(specs, nranks))
        info = {(None, tuple(range(nranks))): [
            (s.name, s.numel, s.dtype, 4 if s.dtype == "float32" else 2) for s in specs]}
        machines = {r: r // GPUS_PER_MACHINE for r in range(nranks)}
        row["machine_balanced_s"], _ = _timed(
            lambda: machine_balanced_owner_indices(info, machines, 256))
        cases.append(row)
    return {"target_s": TARGET_SCALE_S, "against": against, "cases": cases}


def _ns(shape) -> int:
    *lead, m, n = shape
    e = 1
    for d in lead:
        e *= d
    return e * max(m, n) * min(m, n) ** 2


def format_scale(fig: Dict) -> str:
    lines = [f"seconds per owner rule (synthetic MoE model; target <= {fig['target_s']:g} s "
             "at 200,000 x 1,024)",
             f"{'model':>6} {'matrices':>9} {'ranks':>6} | {'balanced':>9} {'previous':>9} {'same':>5} | "
             f"{'develop':>8} {'machine-bal':>11} | {'state max/mean':>14}",
             "-" * 93]
    for c in fig["cases"]:
        prev = f"{c['previous_balanced_s']:9.2f}" if "previous_balanced_s" in c else f"{'-':>9}"
        same = {True: "yes", False: "NO"}.get(c.get("same_owners"), "-")
        lines.append(
            f"{c['model']:>6} {c['matrices']:>9} {c['ranks']:>6} | {c['balanced_s']:9.2f} {prev} {same:>5} | "
            f"{c['develop_s']:8.2f} {c['machine_balanced_s']:11.2f} | "
            f"{c['balanced_state_max_over_mean']:14.4f}")
    if fig.get("against"):
        lines += ["", f"balanced rule now vs at revision {fig['against']} (same run)",
                  f"{'model':>6} {'matrices':>9} {'ranks':>6} | {'now':>9} {'then':>9} "
                  f"{'then/now':>8} {'same':>5}"]
        for c in fig["cases"]:
            same = "yes" if c["against_same_owners"] else "NO"
            lines.append(f"{c['model']:>6} {c['matrices']:>9} {c['ranks']:>6} | "
                         f"{c['balanced_s']:9.2f} {c['against_s']:9.2f} "
                         f"{c['speedup_vs_against']:8.1f} {same:>5}")
    return "\n".join(lines)


def _size(text: str) -> Tuple[int, int]:
    try:
        num, nranks = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not MATRICESxRANKS (e.g. 2000x8)")
    if num < 1 or nranks < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: both numbers must be >= 1")
    return num, nranks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="ernie-moe-small", choices=moe_presets.list_presets())
    ap.add_argument("--json", default=None, help="parameter list JSON instead of a preset")
    ap.add_argument("--nranks", type=int, nargs="+", default=list(DEFAULT_NRANKS))
    ap.add_argument("--buffer-mb", type=float, default=256)
    ap.add_argument("--colour", default="all", choices=["all", "dense", "expert"])
    ap.add_argument(
        "--no-fused", action="store_true", help="skip the fused-3D illustration table"
    )
    ap.add_argument("--scale", action="store_true",
                    help="time the rules on synthetic models instead (see --sizes)")
    ap.add_argument("--sizes", type=_size, nargs="+", default=list(DEFAULT_SIZES),
                    help="MATRICESxRANKS cases of --scale (default %s)"
                    % " ".join(f"{n}x{r}" for n, r in DEFAULT_SIZES))
    ap.add_argument("--previous-up-to", type=int, default=DEFAULT_PREVIOUS_UP_TO,
                    help="time the previous balanced implementation up to this many "
                    "matrices (0: never)")
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["moe", "random"],
                    help="--scale: synthetic models (default: both)")
    ap.add_argument("--against", default=None, metavar="REV",
                    help="--scale: also time the balanced rule as committed at this git "
                    "revision (e.g. main) and check it gives the same owners")
    ap.add_argument("--json-out", action="store_true", help="--scale: print JSON only")
    args = ap.parse_args(argv)
    if args.scale:
        try:
            fig = scale(args.sizes, args.previous_up_to, args.models, args.against)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(fig) if args.json_out else format_scale(fig))
        same = all(c.get("same_owners", True) and c.get("against_same_owners", True)
                   for c in fig["cases"])
        return 0 if same else 1
    fig = bench(args.preset, args.nranks, args.buffer_mb, args.colour, args.json)
    print(format_table(fig))
    if not args.no_fused and args.json is None and args.preset == "ernie-moe-small":
        print()
        print("illustration: experts fused into 3-D [E, H, I] weights (one owner per fused weight)")
        fused = bench("ernie-moe-small-fused", args.nranks, args.buffer_mb, args.colour)
        print(format_table(fused))
    bad = [n for n, c in fig["cases"].items() if c["achievable"] and not c["meets_targets"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
