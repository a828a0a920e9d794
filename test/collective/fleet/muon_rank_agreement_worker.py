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
"""Worker: MuonShardingOptimizer's rank agreement on real gloo processes.

Launched with 2 processes (sharding_degree=2), or 4 (dp_degree=2 x
sharding_degree=2: two sharding groups). ``AGREE_MODE``:

* ``order``: the last rank passes its parameters in reverse order; every
  rank prints ``AGREE_RESULT`` with the error it got at construction (on 4
  ranks only the last sharding group disagrees: the other one must refuse
  too instead of going on).
* ``bench``: constructs ``AGREE_REPS`` times with the check and as often
  with it replaced by a no-op, alternating, and prints ``AGREE_BENCH`` with
  the median milliseconds of each (``tools/bench/bench_rank_agreement.py``).
"""

import json
import os
import statistics
import time

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.distributed import fleet

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import build as _build
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_optimizer import (
    MuonShardingOptimizer,
)
from paddle_muon_ext.distributed.fleet.utils.gloo_compat import install_gloo_compat

from muon_test_compat import register_cpu_tensor_fusion
from paddle_muon_ext.optimizer.muon import Muon, MuonParamInfo

SHAPES = {"w_in": [16, 16], "b_in": [16], "w_out": [16, 8], "norm": [8]}


def params(reverse: bool) -> list:
    out = []
    for i, (name, shape) in enumerate(SHAPES.items()):
        init = paddle.nn.initializer.Assign(np.full(shape, 0.1 * (i + 1), dtype="float32"))
        p = paddle.create_parameter(shape, "float32", default_initializer=init)
        p.name = f"agree.{name}"  # the same names on every rank
        out.append(p)
    return out[::-1] if reverse else out


def construct(strategy, hcg, reverse: bool = False) -> MuonShardingOptimizer:
    ps = params(reverse)
    muon = Muon(learning_rate=0.02, parameters=ps, muon_param_info_map={
        p.name: MuonParamInfo(use_muon=len(p.shape) == 2) for p in ps})
    return MuonShardingOptimizer(muon, hcg, strategy)


def main() -> None:
    install_gloo_compat()
    register_cpu_tensor_fusion()  # the optimizer's fused buffers on CPU: an explicit opt-in
    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    strategy = fleet.DistributedStrategy()
    dp = 2 if world == 4 else 1
    strategy.hybrid_configs = {"dp_degree": dp, "mp_degree": 1, "pp_degree": 1,
                               "sharding_degree": world // dp}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    rank = dist.get_rank()
    mode = os.environ.get("AGREE_MODE", "order")
    if mode == "order":
        try:
            construct(strategy, hcg, reverse=rank == world - 1)
            outcome = {"rank": rank, "error": None, "message": ""}
        except Exception as error:  # noqa: BLE001 - reported to the test
            outcome = {"rank": rank, "error": type(error).__name__, "message": str(error)}
        outcome["sharding_group"] = list(hcg.get_sharding_parallel_group().ranks)
        print("AGREE_RESULT " + json.dumps(outcome), flush=True)
        return
    reps = int(os.environ.get("AGREE_REPS", "20"))
    real = _build.check_ranks_agree
    times: dict = {"with": [], "without": []}
    for i in range(2 * reps + 2):
        label = "with" if i % 2 == 0 else "without"
        _build.check_ranks_agree = real if label == "with" else (lambda *args: None)
        dist.barrier()
        start = time.perf_counter()
        construct(strategy, hcg)
        if i >= 2:  # the first pair warms caches up
            times[label].append((time.perf_counter() - start) * 1e3)
    _build.check_ranks_agree = real
    print("AGREE_BENCH " + json.dumps({"rank": rank, **{
        k: statistics.median(v) for k, v in times.items()}}), flush=True)


if __name__ == "__main__":
    main()
    from worker_exit import exit_after_verdict

    exit_after_verdict()
