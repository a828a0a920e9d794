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
"""Train a tiny model with sharded Muon, written as for Paddle develop.

Launch (CPU or GPU; on CPU paddle.distributed.launch uses gloo)::

    python -m paddle.distributed.launch --nproc_per_node 2 examples/train_tiny.py
    python -m paddle.distributed.launch --nproc_per_node 4 examples/train_tiny.py --dp 2

``--dp N`` splits the processes into N data-parallel replicas of a
``world / N``-rank sharding group (default 1: every process shards).

Only the ``patch_paddle()`` line names paddle_muon_ext; on a Paddle that has
Muon sharding itself, drop those two lines. Every rank trains its slice of
each global batch through ``fleet.distributed_optimizer`` (Muon on the
matrices, AdamW on the biases, each matrix updated whole by one owner rank),
then repeats the same steps in one process on the whole batch and prints
``PASS`` when every parameter agrees, else ``FAIL`` (exit code 1).
"""

import argparse
import os
import sys

import paddle_muon_ext

paddle_muon_ext.patch_paddle()

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import paddle.distributed as dist  # noqa: E402
from paddle.distributed import fleet  # noqa: E402

STEPS = int(os.environ.get("TRAIN_TINY_STEPS", "5"))
GLOBAL_BATCH = 16
FEATURES, HIDDEN, CLASSES = 32, 64, 8
# float32 sums in a different order (a mean of per-rank means) differ by a
# few ulps per step; Newton-Schulz and Adam normalise the update, so the
# parameters stay within ~1e-6 of each other. 1e-4 leaves room for GPUs'
# TF32 matmuls while still catching a wrong reduction (off by >= 1e-3).
TOLERANCE = 1e-4


def muon_routing(model: paddle.nn.Layer) -> dict:
    """Develop's Muon needs a routing entry per parameter (the sharding
    optimizer asserts it): matrices on Muon, the rest on AdamW."""
    from paddle.optimizer.muon import MuonParamInfo

    return {p.name: MuonParamInfo(use_muon=p.ndim in (2, 3)) for p in model.parameters()}


def build_model() -> paddle.nn.Layer:
    paddle.seed(2026)  # the same initial weights on every rank
    return paddle.nn.Sequential(
        paddle.nn.Linear(FEATURES, HIDDEN),
        paddle.nn.GELU(),
        paddle.nn.Linear(HIDDEN, HIDDEN),
        paddle.nn.GELU(),
        paddle.nn.Linear(HIDDEN, CLASSES),
    )


def global_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    x = rng.standard_normal((GLOBAL_BATCH, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(GLOBAL_BATCH, 1)).astype("int64")
    return x, y


def train(model: paddle.nn.Layer, opt, rank: int, world: int) -> None:
    """STEPS steps; this rank takes rows rank::world of each global batch."""
    for step in range(STEPS):
        x, y = global_batch(step)
        loss = paddle.nn.functional.cross_entropy(
            model(paddle.to_tensor(x[rank::world])), paddle.to_tensor(y[rank::world])
        )
        loss.backward()
        opt.step()
        opt.clear_grad()


def values(model: paddle.nn.Layer) -> list:
    # by position: fleet.distributed_model prefixes the parameter names
    return [p.numpy().astype("float64") for p in model.parameters()]


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--dp", type=int, default=1,
                        help="data-parallel replicas (must divide the process count)")
    args = parser.parse_args(argv)
    world = dist.get_world_size()
    if args.dp < 1 or world % args.dp:
        parser.error(f"--dp {args.dp} must be >= 1 and divide the {world} processes")
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {
        "dp_degree": args.dp, "mp_degree": 1, "pp_degree": 1,
        "sharding_degree": world // args.dp,
    }
    strategy.use_muon_sharding = True
    fleet.init(is_collective=True, strategy=strategy)
    rank = dist.get_rank()

    model = build_model()
    initial = values(model)
    if world > 1:
        # Paddle's model wrapper: the data-parallel replicas start from one
        # copy (it refuses a one-process job)
        model = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(
        paddle.optimizer.Muon(learning_rate=0.02, parameters=model.parameters(),
                              muon_param_info_map=muon_routing(model))
    )
    train(model, opt, rank, world)

    # The same steps in this process alone, on the whole batch.
    reference = build_model()
    train(reference, paddle.optimizer.Muon(learning_rate=0.02,
                                           parameters=reference.parameters(),
                                           muon_param_info_map=muon_routing(reference)), 0, 1)

    got, want = values(model), values(reference)
    diff = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want))
    # a run that changed nothing would match a reference that changed nothing
    moved = min(float(np.max(np.abs(g - i))) for g, i in zip(got, initial))
    ok = diff <= TOLERANCE and np.isfinite(diff) and moved > 0
    if moved == 0:
        print(f"FAIL: rank {rank}: a parameter never changed in {STEPS} steps", flush=True)
    print(f"{'PASS' if ok else 'FAIL'}: rank {rank} of {world} (dp {args.dp}) "
          f"({type(opt).__name__}), {STEPS} steps, max |parameter - "
          f"single-process| = {diff:.2e} (tolerance {TOLERANCE:g})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
