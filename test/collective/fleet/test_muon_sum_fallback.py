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
"""The SUM fallback of the gradient mean (no AVG reduce: gloo, CPU) never
overflows where the single-process run does not.

Every rank's loss is ``sum(w * C_r)``, so its gradient is exactly ``C_r``,
with entries near the fp32 maximum; the sharding group's mean of those
gradients is finite. After one step, Muon's momentum of the owned matrix
equals the reduced gradient and every parameter must equal the single-process
step on the mean gradient (NumPy float64 mean rounded to fp32).
"""

from __future__ import annotations

import unittest

import numpy as np

import paddle
from paddle.distributed import fleet

from mock.fake_hcg import make_hcg_factory, make_hybrid_strategy
from mock.simulated_world import SimulatedWorld
from muon_param_map import build_muon_param_info_map
from muon_sim_runner import local_size
from muon_test_compat import register_cpu_tensor_fusion, set_muon_sharding_options

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import runtime as comm
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_optimizer import (
    MuonShardingOptimizer,
)
from paddle_muon_ext.optimizer.muon import Muon

register_cpu_tensor_fusion()

FP32_MAX = float(np.finfo(np.float32).max)
SHAPES = {"w": (8, 8), "v": (4, 8), "b": (16,)}
#: Rank r's gradient entries are +-(0.55 .. 0.88) * fp32 max: any two of them
#: of one sign sum past the maximum, their mean never does.
LOW, HIGH = 0.55, 0.88
#: Summation order: 4 addends pre-divided by 4 (exact) are summed in fp32 in
#: the reduce's order, the reference rounds the float64 mean once: within
#: 2 ulps (2**-22 relative) of each other.
GRAD_RTOL = 2.0**-22
#: Parameters after one step from gradients that agree to 2 ulps.
PARAM_ATOL = 1e-6


def rank_gradient(rank: int, name: str) -> np.ndarray:
    """Rank ``rank``'s gradient of parameter ``name`` (fp32, near the maximum)."""
    rng = np.random.default_rng(100 * rank + len(name) + sum(map(ord, name)))
    magnitude = rng.uniform(LOW, HIGH, SHAPES[name]) * FP32_MAX
    sign = np.where(np.random.default_rng(7 + len(name)).random(SHAPES[name]) < 0.5, -1, 1)
    return (sign * magnitude).astype("float32")


def mean_gradient(world: int, name: str) -> np.ndarray:
    return np.mean([rank_gradient(r, name).astype("float64") for r in range(world)],
                   axis=0).astype("float32")


def initial(name: str) -> np.ndarray:
    return np.random.default_rng(len(name)).normal(0, 0.3, SHAPES[name]).astype("float32")


class Net(paddle.nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        for name in SHAPES:
            p = paddle.create_parameter(
                list(SHAPES[name]), "float32",
                default_initializer=paddle.nn.initializer.Assign(initial(name)))
            p.name = f"fallback_{name}"  # same state keys on every rank
            self.add_parameter(name, p)

    def loss(self, grads: dict[str, np.ndarray]):
        # d/dp sum(p * C) == C exactly: the gradient is chosen, not computed
        return sum((getattr(self, n) * paddle.to_tensor(g)).sum() for n, g in grads.items())


def muon_for(net: Net) -> Muon:
    params = list(net.parameters())
    # w, v: Muon (2-D); b: AdamW
    return Muon(learning_rate=0.02, parameters=params,
                muon_param_info_map=build_muon_param_info_map(params))


def reference(world: int) -> tuple[dict, np.ndarray]:
    """Single process: one step on the mean gradient; (params, w's momentum)."""
    with paddle.utils.unique_name.guard():
        net = Net()
        opt = muon_for(net)
        net.loss({n: mean_gradient(world, n) for n in SHAPES}).backward()
        opt.step()
        momentum = opt._accumulators["moment1"][net.w.name].numpy()
        return {n: getattr(net, n).numpy() for n in SHAPES}, momentum


def sharded_step(ms: int, gpn: int | None = None, overlap: bool = False) -> list:
    strategy = make_hybrid_strategy(1, ms, comm_buffer_size_MB=1, comm_overlap=overlap)
    set_muon_sharding_options(strategy, use_muon_sharding=True,
                              comm_group_call_opt=gpn is not None)

    def body(rank: int):
        hcg = fleet.get_hybrid_communicate_group()
        net = Net()
        opt = MuonShardingOptimizer(muon_for(net), hcg, strategy)
        net.loss({n: rank_gradient(rank, n) for n in SHAPES}).backward()
        opt.reduce_gradients(list(net.parameters()), hcg)
        opt.step()
        momentum = opt._inner_opt._accumulators.get("moment1", {}).get(net.w.name)
        owner = next(b.owner for b in opt.muon_buckets for p in b.params if p is net.w)
        return ({n: getattr(net, n).numpy() for n in SHAPES},
                momentum.numpy() if owner == rank else None)

    world = SimulatedWorld(ms, hcg_factory=make_hcg_factory(1, ms), strategy=strategy,
                           deadlock_timeout=30.0)
    with local_size(gpn):
        return world.run(body)


class TestSumFallbackNearFp32Max(unittest.TestCase):
    """Gradients near 3e38 on 2 and 4 ranks: finite, equal to one process."""

    def check(self, ms: int, **options) -> None:
        what = f"{ms} ranks {options or ''}"
        # precondition: summing before dividing overflows these gradients
        with np.errstate(over="ignore"):
            summed = rank_gradient(0, "w") + rank_gradient(1, "w")
        self.assertFalse(np.isfinite(summed).all(), "precondition: the plain SUM overflows")
        params, momentum = reference(ms)
        self.assertTrue(np.isfinite(momentum).all(), "precondition: the reference is finite")
        results = sharded_step(ms, **options)
        owned = [m for _, m in results if m is not None]
        self.assertEqual(len(owned), 1, f"{what}: one owner of w")
        self.assertTrue(np.isfinite(owned[0]).all(),
                        f"{what}: the reduced gradient of w overflowed")
        np.testing.assert_allclose(
            owned[0], momentum, rtol=GRAD_RTOL, atol=0,
            err_msg=f"{what}: reduced gradient of w (its momentum after one step) "
                    f"differs from the single-process mean gradient")
        for rank, (values, _) in enumerate(results):
            for name in SHAPES:
                self.assertTrue(np.isfinite(values[name]).all(),
                                f"{what}: rank {rank}: {name} is not finite after the step")
                np.testing.assert_allclose(
                    values[name], params[name], rtol=0, atol=PARAM_ATOL,
                    err_msg=f"{what}: rank {rank}: {name} differs from one process")

    def test_two_ranks(self):
        self.check(2)

    def test_four_ranks(self):
        self.check(4)

    def test_four_ranks_hierarchical(self):
        self.check(4, gpn=2)

    def test_four_ranks_overlap_hooks(self):
        self.check(4, overlap=True)


class TestDivideBeforeTheSum(unittest.TestCase):
    def test_fused_buffers_scale_before_the_comm(self):
        # a FusedCommBuffer scaling after the SUM would overflow these gradients
        def body(rank: int):
            net = Net()
            opt = MuonShardingOptimizer(muon_for(net), fleet.get_hybrid_communicate_group(),
                                        strategy)
            return [(b._scale_after_comm, b._use_reduce_avg) for b in opt._runtime.all_buffers()]

        strategy = make_hybrid_strategy(1, 2, comm_buffer_size_MB=1)
        set_muon_sharding_options(strategy, use_muon_sharding=True)
        world = SimulatedWorld(2, hcg_factory=make_hcg_factory(1, 2), strategy=strategy)
        for flags in world.run(body):
            self.assertTrue(flags, "no fused buffer was built")
            self.assertEqual(set(flags), {(False, False)})

    def test_mean_onto_gives_the_root_the_mean(self):
        def body(rank: int):
            group = paddle.distributed.new_group([0, 1])
            t = paddle.to_tensor(np.full([3], 2.0 * (rank + 1), "float32"))
            comm.mean_onto([(t, 1)], group, paddle.distributed.ReduceOp.SUM)
            return t.numpy()

        world = SimulatedWorld(2, hcg_factory=make_hcg_factory(1, 2),
                               strategy=make_hybrid_strategy(1, 2))
        results = world.run(body)
        np.testing.assert_array_equal(results[1], np.full([3], 3.0, "float32"),
                                      "root 1 must hold the mean (2 + 4) / 2")


if __name__ == "__main__":
    unittest.main()
