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
# paddle_muon_ext: compat-only  (checks patch_paddle itself; not exported)
"""Worker: plain AdamW trains the same with and without ``patch_paddle()``.

Launched with 2 processes by test_muon_compat_paddle33.py. ``NOOP_MODE`` is
``dp`` (dp_degree=2) or ``sharding`` (sharding_degree=2, Paddle's stage-1
DygraphShardingOptimizer). The job trains a model with Paddle's own
``fleet.distributed_optimizer``, then calls ``patch_paddle()`` and trains a
second copy through the patched name; it prints ``NOOP_RESULT`` with the
optimizer types and the largest parameter difference between the runs.
"""

import json
import os

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.distributed import fleet

from paddle_muon_ext.compat_paddle_3_3 import patch_paddle, register_cpu_tensor_fusion

STEPS = 3


def build():
    paddle.seed(7)
    model = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.Tanh(),
                                 paddle.nn.Linear(16, 4))
    opt = paddle.optimizer.AdamW(learning_rate=0.01, parameters=model.parameters())
    return model, opt


def train(distributed_optimizer):
    model, opt = build()
    opt = distributed_optimizer(opt)
    rank = dist.get_rank()
    for step in range(STEPS):
        x = np.random.default_rng(step * 10 + rank).standard_normal((4, 8)).astype("float32")
        model(paddle.to_tensor(x)).square().mean().backward()
        opt.step()
        opt.clear_grad()
    inner = getattr(opt, "_inner_opt", None)
    kinds = [type(opt).__name__, type(inner).__name__ if inner is not None else None]
    return kinds, {k: v.numpy() for k, v in model.state_dict().items()}


def main():
    mode = os.environ["NOOP_MODE"]
    strategy = fleet.DistributedStrategy()
    degrees = {"dp_degree": 2, "sharding_degree": 1} if mode == "dp" \
        else {"dp_degree": 1, "sharding_degree": 2}
    strategy.hybrid_configs = {"mp_degree": 1, "pp_degree": 1, **degrees}
    fleet.init(is_collective=True, strategy=strategy)
    # Paddle's own sharding buffers refuse CPU places; both runs get the same help.
    register_cpu_tensor_fusion()
    kinds_before, before = train(fleet.distributed_optimizer)
    patch_paddle()
    kinds_after, after = train(fleet.distributed_optimizer)
    diff = max(float(np.max(np.abs(before[k] - after[k]))) for k in before)
    print("NOOP_RESULT " + json.dumps({
        "rank": dist.get_rank(), "before": kinds_before, "after": kinds_after,
        "max_diff": diff, "trained": any(
            float(np.max(np.abs(before[k] - build()[0].state_dict()[k].numpy()))) > 0
            for k in before),
    }), flush=True)


if __name__ == "__main__":
    main()
    from worker_exit import exit_after_verdict

    exit_after_verdict()
