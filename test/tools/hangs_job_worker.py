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
"""Test-only worker: a real gloo job that crashes or hangs in step 1 (0-based).

Launched by ``test_hangs_tool.py`` on 2 or 4 processes (ep=2, moe_sharding =
world / 2; with 4, 2 emulated nodes x 2 cards and ``comm_group_call_opt``
on). ``HANGS_JOB_MODE``:

* ``crash``: every rank's ``paddle.distributed.reduce`` raises RuntimeError
  in step 1, as a failing device or transport would;
* ``hang``: the last rank sleeps before its reduces of step 1 (a stuck
  kernel or host thread) while the others block in theirs;
* ``crash_one``: the last rank raises ValueError before its reduces of
  step 1 (a bug on one rank) while the others block in theirs.
"""

from __future__ import annotations

import os
import sys
import time

import paddle
import paddle.distributed as dist
from paddle.distributed import fleet

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "collective", "fleet"))

from gloo_compat import apply_emulated_local_size, install_gloo_compat  # noqa: E402
from muon_test_compat import (  # noqa: E402
    distributed_optimizer,
    register_cpu_tensor_fusion,
    set_muon_sharding_options,
)
from muon_tiny_moe import TinyMoE, batch, make_muon  # noqa: E402

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_flight import (  # noqa: E402
    recorder as fr,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import (  # noqa: E402
    runtime as comm,
)

FAIL_STEP = 1
# Written into the dump directory when the last rank stalls: dumps older than
# it were taken on a slow step 0 (a loaded CI box), not on the hang.
STALL_MARKER = "hangs_job.stalled"


def main() -> None:
    apply_emulated_local_size()
    install_gloo_compat()
    register_cpu_tensor_fusion()  # the optimizer's fused buffers on CPU: an explicit opt-in
    world = int(os.environ["PADDLE_TRAINERS_NUM"])
    group_call = world >= 4
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {
        "dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": world,
        "ep_degree": 2, "moe_sharding_degree": world // 2,
        "order": ["dp", "moe_sharding", "pp", "sharding", "sep", "cp", "ep", "mp"],
    }
    strategy.hybrid_configs["sharding_configs"].comm_buffer_size_MB = 1
    set_muon_sharding_options(strategy, use_muon_sharding=True, comm_group_call_opt=group_call)
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    rank = dist.get_rank()
    step_box = [0]
    mode = os.environ["HANGS_JOB_MODE"]
    if mode == "crash":
        real_reduce = dist.reduce

        def failing_reduce(*args, **kwargs):
            if step_box[0] == FAIL_STEP:
                raise RuntimeError("simulated transport failure")
            return real_reduce(*args, **kwargs)

        dist.reduce = failing_reduce
    else:
        real_launch = comm.launch_coalesced  # every reduce and broadcast of a step

        def stalled(op, *args, **kwargs):
            if op == "reduce" and rank == world - 1 and step_box[0] == FAIL_STEP:
                if mode == "crash_one":
                    raise ValueError("simulated bug on one rank")
                print(f"[hangs job] rank {rank} stalls", flush=True)
                with open(os.path.join(fr.dump_dir(), STALL_MARKER), "w"):
                    pass
                time.sleep(300)
            return real_launch(op, *args, **kwargs)

        comm.launch_coalesced = stalled
    net = TinyMoE(hcg.get_expert_parallel_rank(), hcg.get_moe_sharding_parallel_group())
    model = fleet.distributed_model(net)
    opt = distributed_optimizer(make_muon(list(net.parameters())))
    for step in range(FAIL_STEP + 1):
        step_box[0] = step
        loss = model(paddle.to_tensor(batch(step, rank)))
        loss.backward()
        opt.step()
        opt.clear_grad()
        print(f"[hangs job] rank {rank} finished step {step}", flush=True)


if __name__ == "__main__":
    main()
