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
"""What the rank-agreement check costs at MuonShardingOptimizer construction.

    PYTHONPATH=python:test python3 tools/bench/bench_rank_agreement.py [--reps 10] [--no-gloo]

Two settings, each timed with the check and with it replaced by a no-op
(alternating, medians, the first pair dropped as warm-up), printed side by
side:

* simulated: 8 ranks of the tiny MoE (ep4 x moe_sharding2: the sharding
  group plus one expert colour group per rank) in the simulated world's
  data mode (threads, real data movement); the figure is the wall time of
  one construction of every rank.
* gloo: 2 real processes (``paddle.distributed.launch``, sharding_degree=2,
  ``test/collective/fleet/muon_rank_agreement_worker.py``); the figure is
  the median over reps of one construction on each rank (worst rank shown).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Optional, Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
_FLEET_TESTS = os.path.join(_REPO, "test", "collective", "fleet")
for _p in (os.path.join(_REPO, "python"), os.path.join(_REPO, "test"), _FLEET_TESTS):
    if _p not in sys.path:
        sys.path.insert(0, _p)


def bench_simulated(reps: int) -> dict:
    """Median ms of one 8-rank construction, with and without the check."""
    import paddle
    from muon_sim_runner import SimConfig, run_world
    from muon_tiny_moe import TinyMoE, make_muon

    from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import build
    from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_optimizer import (
        MuonShardingOptimizer,
    )

    cfg = SimConfig(ep=4, ms=2, via_fleet=False)

    def body(cfg, strategy):
        hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
        net = TinyMoE(hcg.get_expert_parallel_rank(), hcg.get_moe_sharding_parallel_group())
        muon = make_muon(list(net.parameters()), clip=False)
        paddle.distributed.all_reduce(paddle.zeros([1]))  # line the ranks up (no barrier here)
        start = time.perf_counter()
        MuonShardingOptimizer(muon, hcg, strategy)
        return time.perf_counter() - start

    real = build.check_ranks_agree
    times: dict = {"with": [], "without": []}
    try:
        for i in range(2 * reps + 2):
            label = "with" if i % 2 == 0 else "without"
            build.check_ranks_agree = real if label == "with" else (lambda *args: None)
            per_rank, _ = run_world(cfg, body=body)
            if i >= 2:
                times[label].append(max(per_rank) * 1e3)
    finally:
        build.check_ranks_agree = real
    return {k: statistics.median(v) for k, v in times.items()}


def bench_gloo(reps: int) -> dict:
    """Median ms of one construction on the slower of 2 gloo ranks, with and without."""
    from launch_utils import run_paddle_launch

    env = {"AGREE_MODE": "bench", "AGREE_REPS": str(reps), "PYTHONPATH": os.pathsep.join(
        [os.path.join(_REPO, "python"), _FLEET_TESTS, os.environ.get("PYTHONPATH", "")])}
    result = run_paddle_launch(os.path.join(_FLEET_TESTS, "muon_rank_agreement_worker.py"), 2,
                               env, timeout_s=300).check()
    rows = []
    for log in result.worker_logs.values():
        rows += [json.loads(line.split(" ", 1)[1]) for line in log.splitlines()
                 if line.startswith("AGREE_BENCH ")]
    if len(rows) != 2:
        raise RuntimeError(f"expected 2 AGREE_BENCH lines, got {rows}")
    return {k: max(r[k] for r in rows) for k in ("with", "without")}


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Print both settings' figures side by side; return them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10, help="constructions per variant")
    parser.add_argument("--no-gloo", action="store_true", help="skip the 2-process gloo run")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    out = {"simulated 8 ranks": bench_simulated(args.reps)}
    if not args.no_gloo:
        out["gloo 2 ranks"] = bench_gloo(args.reps)
    print(f"{'setting':<20}{'with check ms':>15}{'without ms':>13}{'cost ms':>10}")
    for name, t in out.items():
        print(f"{name:<20}{t['with']:>15.2f}{t['without']:>13.2f}"
              f"{t['with'] - t['without']:>10.2f}")
    return out


if __name__ == "__main__":
    main()
