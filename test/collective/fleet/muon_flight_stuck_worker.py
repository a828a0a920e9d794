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
"""Test-only worker: one rank stops inside a communication phase of a step.

Launched by ``test_muon_flight_recorder.py`` on 4 gloo processes (2 emulated
nodes x 2 cards, ep=2, moe_sharding=2, ``comm_group_call_opt`` on). Rank
``MUON_FLIGHT_STUCK_RANK`` sleeps when it enters phase
``MUON_FLIGHT_STUCK_PHASE`` in step ``MUON_FLIGHT_STUCK_STEP`` (0-based),
before issuing that phase's collectives, like a rank stuck in a slow
kernel or a hung host thread. The others block in their collectives; the
flight recorder's watchdog dumps them and asks the stuck rank to dump too.
"""

from __future__ import annotations

import os
import sys
import time

import paddle
import paddle.distributed as dist
from paddle.distributed import fleet

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gloo_compat import apply_emulated_local_size, install_gloo_compat  # noqa: E402
from hybrid_parallel_sharding_muon_moe_model import build_strategy  # noqa: E402
from muon_test_compat import distributed_optimizer, register_cpu_tensor_fusion  # noqa: E402
from muon_tiny_moe import TinyMoE, batch, make_muon  # noqa: E402

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_flight.recorder import (  # noqa: E402
    phase_of_thread,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import (  # noqa: E402
    runtime as comm,
)


def stall_in_phase(rank: int, phase: str, step_box: list, stuck_step: int, sleep_s: float) -> None:
    """Make ``rank`` sleep on entering ``phase`` in step ``stuck_step``."""
    for name in ("launch_coalesced",):
        original = getattr(comm, name)

        def stalled(*args, __original=original, **kwargs):
            if (dist.get_rank() == rank and step_box[0] == stuck_step
                    and phase_of_thread() == phase):
                print(f"[stuck worker] rank {rank} sleeps {sleep_s} s in phase {phase!r}",
                      flush=True)
                time.sleep(sleep_s)
            return __original(*args, **kwargs)

        setattr(comm, name, stalled)


def main() -> None:
    apply_emulated_local_size()
    install_gloo_compat()
    register_cpu_tensor_fusion()  # the optimizer's fused buffers on CPU: an explicit opt-in
    world = int(os.environ["PADDLE_TRAINERS_NUM"])
    fleet.init(is_collective=True,
               strategy=build_strategy(2, world // 2, world, True, True, False))
    hcg = fleet.get_hybrid_communicate_group()
    rank = dist.get_rank()
    step_box = [0]
    stall_in_phase(int(os.environ.get("MUON_FLIGHT_STUCK_RANK", "3")),
                   os.environ.get("MUON_FLIGHT_STUCK_PHASE", "cross_node_reduce"),
                   step_box, int(os.environ.get("MUON_FLIGHT_STUCK_STEP", "1")),
                   float(os.environ.get("MUON_FLIGHT_STUCK_S", "120")))
    net = TinyMoE(hcg.get_expert_parallel_rank(), hcg.get_moe_sharding_parallel_group())
    model = fleet.distributed_model(net)
    opt = distributed_optimizer(make_muon(list(net.parameters())))
    for step in range(int(os.environ.get("MUON_STEPS", "2"))):
        step_box[0] = step
        loss = model(paddle.to_tensor(batch(step, rank)))
        loss.backward()
        opt.step()
        opt.clear_grad()
        print(f"[stuck worker] rank {rank} finished step {step}", flush=True)


if __name__ == "__main__":
    main()
