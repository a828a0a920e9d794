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
"""Step time with ``overlap_optimize_and_sync`` on vs off, side by side.

Runs the one-box cluster (``paddle-muon-ext cluster``: one network namespace
per node, rate-limited links, real gloo processes; needs root) with
``FLAGS_muon_sharding_overlap_optimize_and_sync`` set to 0 and to 1,
alternating, ``--reps`` times each, and prints the median step time of each
mode (first step of each pass skipped), their ratio, and the inter-node
bytes per step measured and predicted by the plan tool (identical in both
modes: the overlap reorders the sync, it sends the same bytes).

    python tools/bench/bench_overlap_sync.py --reps 3 --hidden 512 --inner 256 --link-mbit 1000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

FLAG = "FLAGS_muon_sharding_overlap_optimize_and_sync"


def _positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=_positive(int), default=3, help="runs per mode (default 3)")
    p.add_argument("--nodes", type=_positive(int), default=2)
    p.add_argument("--procs-per-node", type=_positive(int), default=2)
    p.add_argument("--ep", type=_positive(int), default=2)
    p.add_argument("--moe-sharding", type=_positive(int), default=2)
    p.add_argument("--steps", type=_positive(int), default=6)
    p.add_argument("--hidden", type=_positive(int), default=512)
    p.add_argument("--inner", type=_positive(int), default=256)
    p.add_argument("--link-mbit", type=_positive(float), default=1000.0)
    p.add_argument("--json", action="store_true", help="print only JSON")
    return p


def _run(args, flag: str) -> dict:
    cmd = [sys.executable, "-m", "paddle_muon_ext.cli", "cluster", "--nodes", str(args.nodes),
           "--procs-per-node", str(args.procs_per_node), "--ep", str(args.ep),
           "--moe-sharding", str(args.moe_sharding), "--group-call", "0",
           "--steps", str(args.steps), "--hidden", str(args.hidden), "--inner", str(args.inner),
           "--link-mbit", str(args.link_mbit), "--json"]
    env = dict(os.environ, **{FLAG: flag})
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    try:
        result = json.loads(out.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(f"cluster run (flag {flag}) gave no JSON (exit {out.returncode}): "
                           f"{out.stderr.strip().splitlines()[-1:]}") from None
    if result.get("status") != "PASS":
        raise RuntimeError(f"cluster run (flag {flag}) did not pass: {result.get('problems')}")
    return result


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    times = {"0": [], "1": []}
    measured = {"0": [], "1": []}
    predicted = None
    try:
        for _ in range(args.reps):
            for flag in ("0", "1"):
                res = _run(args, flag)
                steps = [s["seconds"] for s in res["steps"]][1:] or [res["steps"][0]["seconds"]]
                times[flag].append(statistics.median(steps))
                measured[flag].append(res["steps"][-1]["tx"])
                predicted = res.get("prediction", {}).get("off", {}).get("inter_node_bytes")
    except (RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    off, on = statistics.median(times["0"]), statistics.median(times["1"])
    report = {"step_s_off": off, "step_s_on": on, "on_over_off": on / off,
              "runs_off": times["0"], "runs_on": times["1"],
              "inter_node_bytes_measured": {"off": statistics.median(measured["0"]),
                                            "on": statistics.median(measured["1"])},
              "inter_node_bytes_predicted": predicted}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"median step time  off {off:.3f} s   on {on:.3f} s   on/off {on / off:.3f}")
        print(f"runs off {[round(t, 3) for t in times['0']]}  on {[round(t, 3) for t in times['1']]}")
        print(f"inter-node bytes/step  measured off {report['inter_node_bytes_measured']['off']:.0f}"
              f"  on {report['inter_node_bytes_measured']['on']:.0f}  predicted {predicted}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
