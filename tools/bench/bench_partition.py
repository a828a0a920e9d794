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
"""Owner-partition balance: ours (balanced_partition) vs develop's rule (upstream_partition).

    python tools/bench/bench_partition.py [--preset ernie-moe-small]
        [--nranks 8 16 64] [--buffer-mb 256] [--colour all|dense|expert]
        [--json FILE] [--no-fused]

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
import os
import sys
from typing import Dict, Optional, Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
for _p in (_HERE, os.path.join(_REPO, "python")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import moe_presets  # noqa: E402
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_partition import (  # noqa: E402
    balance_floor,
    balanced_partition,
    upstream_partition,
)

TARGET_STATE = 1.05
TARGET_NS = 1.10
DEFAULT_NRANKS = (8, 16, 64)


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
        so, no = ours.state_bytes_max_over_mean(), ours.ns_cost_max_over_mean()
        out["cases"][n] = {
            "ours": {
                "state_max_over_mean": so,
                "ns_max_over_mean": no,
                "empty_ranks": len(ours.empty_ranks()),
                "buffers": ours.num_buffers(),
            },
            "upstream": {
                "state_max_over_mean": up.state_bytes_max_over_mean(),
                "ns_max_over_mean": up.ns_cost_max_over_mean(),
                "empty_ranks": len(up.empty_ranks()),
                "buffers": up.num_buffers(),
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
    args = ap.parse_args(argv)
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
