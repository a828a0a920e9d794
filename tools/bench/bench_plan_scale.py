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
"""Time and peak memory of ``plan`` from 256 to 16,384 ranks, by class vs per rank.

    python tools/bench/bench_plan_scale.py [--sizes 256 1024 4096 16384] [--ep 64]
        [--pp 1] [--gpus-per-node 8] [--model ernie-moe-small] [--per-rank-max 2048]
        [--json] [--in-process]

Each size is ``pp x moe_sharding x ep`` ranks with ``moe_sharding = size / (pp x ep)``.
Every (size, method) runs in a fresh process (unless ``--in-process``), which
imports Paddle first, so the time is ``compute_plan`` alone (both paths, both
partition rules): wall seconds and the process's CPU seconds (on a shared
machine the wall time mostly measures the other jobs); the peak is the
process's maximum resident set. The
per-rank method (``test/tools/plan_per_rank.py``, the tool's method before it
went by class) runs up to ``--per-rank-max`` ranks. The growth exponent is the
least-squares slope of log(CPU time) over log(ranks); target <= 1.2. Timings on a
shared machine are noisy: read the ratio and the exponent.

The command line at its stated scale, side by side with a git revision:

    python tools/bench/bench_plan_scale.py --matrices 100000 [--shape 8192 8192]
        --sizes 1024 [--ep 8] [--recommend] [--against REV] [--json]

writes a model file of ``--matrices`` dense bf16 ``--shape`` matrices (a
temporary directory), and runs ``paddle-muon-ext plan`` on it (and ``plan
--recommend`` with ``--recommend``) in a fresh process per run, this tree
and, with ``--against``, the package as committed at ``REV`` (``git
archive``): the child's CPU seconds (user + system: on a shared box the
honest figure), wall seconds and peak RSS, and each revision's CPU over
this tree's. Targets: ``plan`` <= 10 s, ``plan --recommend`` <= 30 s at
100,000 matrices over 1,024 ranks (one process, idle box).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
for _p in (os.path.join(_REPO, "python"), os.path.join(_REPO, "test", "tools")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

DEFAULT_SIZES = (256, 512, 1024, 2048, 4096, 8192, 16384)
TARGET_EXPONENT = 1.2
METHODS = ("by_class", "per_rank")


def growth_exponent(sizes: Sequence[int], seconds: Sequence[float]) -> Optional[float]:
    """Least-squares slope of log(seconds) over log(sizes); None with < 2 points."""
    pts = [(math.log(n), math.log(t)) for n, t in zip(sizes, seconds) if t > 0]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else None


def _config(size: int, args: argparse.Namespace):
    from paddle_muon_ext.tools.args import MuonCommConfig

    return MuonCommConfig(ep=args.ep, moe_sharding=size // (args.ep * args.pp), pp=args.pp,
                          gpus_per_node=args.gpus_per_node, model=args.model)


def measure(size: int, method: str, args: argparse.Namespace) -> Dict:
    """Run ``compute_plan`` once in this process; seconds and peak RSS (MiB)."""
    from unittest import mock

    import paddle  # noqa: F401  - imported before timing: not part of the plan's cost
    from paddle_muon_ext.tools import plan as plan_mod

    cfg = _config(size, args)
    patch = mock.patch.object(plan_mod, "_path", _per_rank_path()) if method == "per_rank" \
        else mock.patch.object(plan_mod, "_path", plan_mod._path)
    with patch:
        start, cpu = time.perf_counter(), time.process_time()
        res = plan_mod.compute_plan(cfg)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"ranks": size, "method": method, "seconds": seconds, "cpu_seconds": cpu,
            "peak_rss_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "collectives": res["hierarchical"]["collectives_total"]}


def _per_rank_path():
    import plan_per_rank  # test/tools: the reference, not part of the package

    return plan_per_rank.per_rank_path


def _child(size: int, method: str, args: argparse.Namespace) -> Dict:
    argv = [sys.executable, os.path.abspath(__file__), "--child", method, "--sizes", str(size),
            "--ep", str(args.ep), "--pp", str(args.pp), "--gpus-per-node",
            str(args.gpus_per_node), "--model", args.model]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"ranks": size, "method": method, "seconds": None, "cpu_seconds": None,
                "peak_rss_MiB": None, "note": f"killed after {args.timeout:g} s"}
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return {"ranks": size, "method": method, "seconds": None, "cpu_seconds": None,
                "peak_rss_MiB": None, "note": f"failed: {tail}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench(args: argparse.Namespace) -> Dict:
    """Every size by class, the small ones per rank too; rows plus fitted exponents."""
    rows: List[Dict] = []
    for size in args.sizes:
        row: Dict = {"ranks": size}
        for method in METHODS:
            if method == "per_rank" and size > args.per_rank_max:
                row[method] = None
                continue
            row[method] = (measure(size, method, args) if args.in_process
                           else _child(size, method, args))
            print(f"[bench] {size} ranks {method}: {_fmt_s(row[method]['seconds'])} wall, "
                  f"{_fmt_s(row[method]['cpu_seconds'])} CPU", file=sys.stderr)
        by, per = row["by_class"], row["per_rank"]
        row["per_rank_over_by_class"] = (per["cpu_seconds"] / by["cpu_seconds"]
                                         if per and per["cpu_seconds"] and by["cpu_seconds"]
                                         else None)
        rows.append(row)

    def fit(method: str) -> Optional[float]:
        done = [(r["ranks"], r[method]["cpu_seconds"]) for r in rows
                if r[method] and r[method]["cpu_seconds"]]
        return growth_exponent([n for n, _ in done], [t for _, t in done])

    exponent = fit("by_class")

    def top(method: str) -> Optional[float]:
        # the two largest sizes: fixed costs (topology, tables) weigh least there
        done = [(r["ranks"], r[method]["cpu_seconds"]) for r in rows
                if r[method] and r[method]["cpu_seconds"]][-2:]
        return growth_exponent([n for n, _ in done], [t for _, t in done])

    return {"layout": {"ep": args.ep, "pp": args.pp, "gpus_per_node": args.gpus_per_node,
                       "model": args.model},
            "rows": rows, "exponent_by_class": exponent, "exponent_per_rank": fit("per_rank"),
            "exponent_by_class_top": top("by_class"), "exponent_per_rank_top": top("per_rank"),
            "target_exponent": TARGET_EXPONENT,
            "exponent_met": exponent is not None and exponent <= TARGET_EXPONENT}


def _fmt_s(t: Optional[float]) -> str:
    return "-" if t is None else f"{t:.2f} s"


def _fmt_mb(m: Optional[float]) -> str:
    return "-" if m is None else f"{m:.0f} MiB"


def format_table(fig: Dict) -> str:
    lay = fig["layout"]
    lines = [f"plan scale: ep={lay['ep']} pp={lay['pp']} gpus_per_node={lay['gpus_per_node']} "
             f"model={lay['model']} (moe_sharding = ranks / (pp x ep))",
             f"{'ranks':>6} | {'by class':>9} {'CPU':>9} {'peak':>9} | {'per rank':>9} "
             f"{'CPU':>9} {'peak':>9} | per rank / by class (CPU)"]
    for r in fig["rows"]:
        by, per = r["by_class"], r["per_rank"] or {}
        ratio = r["per_rank_over_by_class"]
        note = by.get("note") or per.get("note") or ""
        lines.append(f"{r['ranks']:>6} | {_fmt_s(by['seconds']):>9} "
                     f"{_fmt_s(by['cpu_seconds']):>9} {_fmt_mb(by['peak_rss_MiB']):>9} | "
                     f"{_fmt_s(per.get('seconds')):>9} {_fmt_s(per.get('cpu_seconds')):>9} "
                     f"{_fmt_mb(per.get('peak_rss_MiB')):>9} | "
                     f"{'-' if ratio is None else f'{ratio:.1f}x'} {note}".rstrip())

    def exp(x: Optional[float]) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    lines.append(f"growth exponent (log CPU time / log ranks): by class "
                 f"{exp(fig['exponent_by_class'])} (target <= {TARGET_EXPONENT}: "
                 f"{'met' if fig['exponent_met'] else 'MISSED'}), per rank "
                 f"{exp(fig['exponent_per_rank'])}; between the two largest sizes: by class "
                 f"{exp(fig['exponent_by_class_top'])}, per rank "
                 f"{exp(fig['exponent_per_rank_top'])}")
    return "\n".join(lines)


#: Targets of the command line at its stated scale (seconds, one process).
CLI_TARGETS_S = {"plan": 10.0, "plan --recommend": 30.0}


def write_matrix_model(path: str, matrices: int, shape: Sequence[int]) -> None:
    """A model file of ``matrices`` dense bf16 matrices of ``shape`` (plan's --model format)."""
    dims = [int(d) for d in shape]
    with open(path, "w") as f:
        json.dump([{"name": f"w{i}", "shape": dims, "dtype": "bfloat16"}
                   for i in range(matrices)], f)


def _tree_at(rev: str, into: str) -> str:
    """The package as committed at ``rev``, extracted under ``into``; its python/ dir."""
    try:
        archive = subprocess.run(["git", "-C", _REPO, "archive", rev, "python"],
                                 capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise ValueError(f"--against {rev}: not a revision of this repository "
                         f"({(getattr(exc, 'stderr', b'') or b'').decode().strip() or exc}); "
                         "pass one such as main or HEAD~3") from None
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return os.path.join(into, "python")


def run_cli(python_dir: str, argv: Sequence[str], timeout: float) -> Dict:
    """Run ``paddle-muon-ext`` from ``python_dir`` in a fresh process: its CPU
    seconds (user + system), wall seconds and peak RSS (MiB)."""
    import tempfile
    import threading

    env = dict(os.environ, PYTHONPATH=python_dir)
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "paddle_muon_ext.cli", *argv],
                                stdout=subprocess.DEVNULL, stderr=err, env=env)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            err.seek(0)
            tail = (err.read().decode(errors="replace").strip().splitlines() or ["no output"])
            note = (f"killed after {timeout:g} s" if proc.returncode < 0
                    else f"failed: {tail[-1]}")
            return {"cpu_seconds": None, "seconds": None, "peak_rss_MiB": None, "note": note}
    return {"cpu_seconds": usage.ru_utime + usage.ru_stime, "seconds": wall,
            "peak_rss_MiB": usage.ru_maxrss / 1024}


def bench_cli(args: argparse.Namespace) -> Dict:
    """``plan`` (and ``plan --recommend``) on the matrix model at each size, this
    tree and ``--against``'s, side by side."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench_plan_scale_") as tmp:
        model = os.path.join(tmp, "model.json")
        write_matrix_model(model, args.matrices, args.shape)
        trees = [("this tree", os.path.join(_REPO, "python"))]
        if args.against:
            os.mkdir(os.path.join(tmp, "rev"))
            trees.append((args.against, _tree_at(args.against, os.path.join(tmp, "rev"))))
        commands = ["plan"] + (["plan --recommend"] if args.recommend else [])
        rows = []
        for size in args.sizes:
            layout = ["--ep", str(args.ep), "--moe-sharding", str(size // (args.ep * args.pp)),
                      "--pp", str(args.pp), "--gpus-per-node", str(args.gpus_per_node),
                      "--model", model, "--json"]
            for command in commands:
                row: Dict = {"ranks": size, "command": command,
                             "target_s": CLI_TARGETS_S[command], "runs": {}}
                for label, python_dir in trees:
                    argv = ["plan", *layout] + (["--recommend"] if "recommend" in command else [])
                    row["runs"][label] = run_cli(python_dir, argv, args.timeout)
                    print(f"[bench] {size} ranks {command} ({label}): "
                          f"{_fmt_s(row['runs'][label]['cpu_seconds'])} CPU", file=sys.stderr)
                mine = row["runs"]["this tree"]["cpu_seconds"]
                if args.against:
                    theirs = row["runs"][args.against]["cpu_seconds"]
                    row["against_over_this_tree"] = (theirs / mine if theirs and mine else None)
                row["met"] = mine is not None and mine <= row["target_s"]
                rows.append(row)
    return {"model": {"matrices": args.matrices, "shape": list(args.shape), "dtype": "bfloat16"},
            "layout": {"ep": args.ep, "pp": args.pp, "gpus_per_node": args.gpus_per_node},
            "against": args.against, "rows": rows}


def format_cli_table(fig: Dict) -> str:
    m, lay = fig["model"], fig["layout"]
    lines = [f"paddle-muon-ext plan: {m['matrices']:,} x {m['shape']} {m['dtype']}, ep={lay['ep']} "
             f"pp={lay['pp']} gpus_per_node={lay['gpus_per_node']} (CPU s = user + system of "
             "the process; peak RSS)"]
    for r in fig["rows"]:
        parts = []
        for label, run in r["runs"].items():
            parts.append(f"{label}: {_fmt_s(run['cpu_seconds'])} CPU, {_fmt_s(run['seconds'])} "
                         f"wall, {_fmt_mb(run['peak_rss_MiB'])}{' ' + run['note'] if run.get('note') else ''}")
        ratio = r.get("against_over_this_tree")
        lines.append(f"{r['ranks']:>6} ranks {r['command']:<17} | " + " | ".join(parts)
                     + (f" | {fig['against']} / this tree {ratio:.2f}x" if ratio else "")
                     + f" | target <= {r['target_s']:g} s: {'met' if r['met'] else 'MISSED'}")
    return "\n".join(lines)


def _check(args: argparse.Namespace) -> None:
    from paddle_muon_ext.tools import limits

    for flag, value in (("--ep", args.ep), ("--pp", args.pp),
                        ("--gpus-per-node", args.gpus_per_node)):
        if value < 1:
            raise ValueError(f"{flag} {value}: must be >= 1")
    if args.matrices is not None:
        from paddle_muon_ext.tools import limits as _limits

        if not 1 <= args.matrices <= _limits.LIMITS.model_entries:
            raise ValueError(f"--matrices {args.matrices}: must be in 1.."
                             f"{_limits.LIMITS.model_entries} (plan's model limit)")
        if any(not 1 <= d <= _limits.LIMITS.dim for d in args.shape):
            raise ValueError(f"--shape {args.shape}: dims must be in 1..{_limits.LIMITS.dim}")
    elif args.recommend or args.against:
        raise ValueError("--recommend and --against time the command line: pass --matrices N")
    for size in args.sizes:
        if size % (args.ep * args.pp) or size < args.ep * args.pp:
            raise ValueError(f"--sizes {size}: not a multiple of pp x ep = "
                             f"{args.pp * args.ep}, pass sizes divisible by it")
        if size > limits.LIMITS.plan_world:
            raise ValueError(f"--sizes {size}: above the plan limit "
                             f"{limits.LIMITS.plan_world}, pass smaller sizes")


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES),
                    help="world sizes (default 256 ... 16384)")
    ap.add_argument("--ep", type=int, default=64, help="expert degree (default 64)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline degree (default 1)")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="cards per node (default 8)")
    ap.add_argument("--model", default="ernie-moe-small", help="preset or JSON parameter list")
    ap.add_argument("--per-rank-max", type=int, default=2048,
                    help="largest size also run per rank (default 2048; it is quadratic)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run (default 600)")
    ap.add_argument("--in-process", action="store_true",
                    help="measure in this process (peaks then only grow)")
    ap.add_argument("--json", action="store_true", help="print only a JSON dict")
    ap.add_argument("--matrices", type=int, default=None,
                    help="time the command line on a model of this many dense bf16 matrices "
                         "(e.g. 100000 with --sizes 1024) instead of compute_plan by method")
    ap.add_argument("--shape", type=int, nargs=2, default=[8192, 8192],
                    help="each matrix's shape with --matrices (default 8192 8192)")
    ap.add_argument("--recommend", action="store_true",
                    help="with --matrices, also time plan --recommend")
    ap.add_argument("--against", default=None,
                    help="with --matrices, also time the package at this git revision")
    ap.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        _check(args)
        if args.child:
            print(json.dumps(measure(args.sizes[0], args.child, args)))
            return 0
        if args.matrices is not None:
            fig = bench_cli(args)
            print(json.dumps(fig, indent=1) if args.json else format_cli_table(fig))
            return 0
        fig = bench(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(fig, indent=1) if args.json else format_table(fig))
    return 0


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore", message="No ccache found")
    sys.exit(main())
