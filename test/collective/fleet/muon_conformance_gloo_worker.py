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
"""Worker of ``test_muon_conformance_gloo.py``: the implementation under test on real processes.

Launched on 2 CPU processes (gloo) by ``paddle.distributed.launch``; the
implementation is the one ``muon_conformance_impl`` selects (``PADDLE_ROOT``
is inherited from the test). Plain sharding_degree = world, the tiny model of
``muon_tiny_moe`` without experts, driven through develop's surface.

Prints, per case, ``CONF case=<steps>step rank=<r> diff=<max |param - reference|>``
(the reference: single-process Muon on the full batch, computed here), and
``CONF nonroot op=<op> kept=<0|1>``: whether a non-root buffer still holds its
input after a reduce (NCCL: it does, ``recvbuff`` is only written on the root).
Ends with ``CONF done rank=<r>``.
"""

from __future__ import annotations

import os
import sys

import numpy as np

# paddle_muon_ext: compat-begin
import paddle_muon_ext  # noqa: E402  paddle 3.3.1: develop's names, gloo collectives

paddle_muon_ext.patch_paddle()
# paddle_muon_ext: compat-end

import paddle  # noqa: E402
import paddle.distributed as dist  # noqa: E402
from paddle.distributed import fleet  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from muon_conformance_impl import KIND, MuonShardingOptimizer  # noqa: E402
from muon_tiny_moe import Reference, TinyMoE, batch, make_muon  # noqa: E402
from muon_test_compat import register_cpu_tensor_fusion  # noqa: E402


def train_case(steps: int) -> float:
    """Max |param - reference| after ``steps`` steps with clear_grad between them."""
    hcg = fleet.get_hybrid_communicate_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    net = TinyMoE(None, None)
    opt = MuonShardingOptimizer(make_muon(list(net.parameters()), clip=False), hcg)
    for step in range(steps):
        net(paddle.to_tensor(batch(step, rank))).backward()
        opt.reduce_gradients(list(net.parameters()), hcg)
        opt.step()
        opt.clear_grad()
    ref = Reference({r: None for r in range(world)}, clip=False)
    for step in range(steps):
        ref.step(step)
    want = ref.values(None)
    got = net.named_values()
    return max(float(np.abs(got[k].astype("float64") - want[k]).max()) for k in want)


def nonroot_kept(op: str) -> int:
    """1 when rank 1's buffer still holds its input after a reduce to rank 0."""
    rank = dist.get_rank()
    value = float(rank + 1)
    t = paddle.full([8], value, dtype="float32")
    if op == "reduce_sum":
        dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)
    else:  # the call develop's group-call path makes
        dist.stream.reduce(t, dst=0, op=dist.ReduceOp.AVG, sync_op=True, use_calc_stream=True)
    return int(bool(np.all(t.numpy() == value)))


def main() -> None:
    register_cpu_tensor_fusion()
    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1,
                               "sharding_degree": world,
                               "sharding_configs": {"comm_buffer_size_MB": 1}}
    fleet.init(is_collective=True, strategy=strategy)
    rank = dist.get_rank()
    for op in ("reduce_sum", "stream_reduce_avg"):
        kept = nonroot_kept(op)
        if rank != 0:
            print(f"CONF nonroot op={op} kept={kept}", flush=True)
    for steps in (1, 3):
        print(f"CONF case={steps}step rank={rank} kind={KIND} diff={train_case(steps):.3e}",
              flush=True)
    print(f"CONF done rank={rank}", flush=True)


if __name__ == "__main__":
    main()
