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
# paddle_muon_ext: upstream-tests
"""Conformance: any MuonShardingOptimizer against independent expectations.

Runs the implementation ``muon_conformance_impl`` selects (this repository's
by default, a Paddle checkout's with ``--paddle-root`` / ``PADDLE_ROOT``, or
Paddle's own in tree) through develop's surface only, in the simulated world
(threads moving real data; a reduce leaves NaN in non-root buffers, stricter
than NCCL, which leaves an in-place non-root buffer as it was).

Expectations are independent of the code under test:

* parameters after training: the single-process Muon reference on the full
  batch (``muon_tiny_moe.Reference``). Tolerance 1e-5: the sharded run
  differs only in the order of summation inside the reductions (~1e-7 per
  value, kept within a few ulps by Newton-Schulz); a routing error moves a
  parameter by O(lr) = 2e-2.
* collectives of ``comm_group_call_opt``: derived from rank coordinates
  (``node = rank // gpus_per_node``, ``card = rank % gpus_per_node``) by
  ``muon_sim_runner.LayoutOracle``, never from the optimizer's groups.
* helper functions: brute-force enumeration.
"""

from __future__ import annotations

import os
import unittest
from unittest import mock

import numpy as np
import paddle

from mock.fake_hcg import PIPE_FIRST_MOE_ORDER
from mock.patching import active_comm
from muon_conformance_impl import (
    GROUP_CALL_MISSING,
    HAS_GROUP_CALL,
    KIND,
    LOCAL_2D_MISSING,
    MODULE,
    MuonShardingOptimizer,
    Layout,
    build_rank,
    owned_matrix_names,
    run_world,
    upstream_bug,
)
from muon_sim_runner import LayoutOracle, max_diff, reference_values, train_steps
from muon_test_compat import local_size
from muon_tiny_moe import EXPERT_COLOUR, H, Reference, TinyMoE, batch, make_muon

TOL = 1e-5
# develop's switch for the staged update (default on where the inner
# optimizer has the staged API); "0" takes the update-then-sync path
OVERLAP_SYNC_FLAG = "FLAGS_muon_sharding_overlap_optimize_and_sync"
GROUP_CALL = dict(ep=4, ms=2, gpn=2)  # 4 emulated nodes of 2 cards


def _train_body(steps: int):
    def body(layout):
        hcg, net, opt = build_rank(layout)
        train_steps(layout, hcg, net, opt, steps=steps)
        return net.named_values()
    return body


class _ReferenceCase(unittest.TestCase):
    def assert_trains_like_reference(self, cfg: Layout, steps: int, body=None) -> None:
        """``body`` (default: build + train): runs on each rank, returns its values."""
        results, world = run_world(cfg, body or _train_body(steps))
        world.check_schedule()
        expected = reference_values(cfg, steps)
        for rank, values in enumerate(results):
            diff, name = max_diff(values, expected[rank])
            self.assertLess(diff, TOL, f"[{KIND}] {cfg}: rank {rank} {name} is {diff:.3g} "
                                       f"from the single-process reference after {steps} steps")


@unittest.skipUnless(HAS_GROUP_CALL, GROUP_CALL_MISSING)
class TestGroupCallHelpers(unittest.TestCase):
    """develop's module-level helpers, against enumeration."""

    def test_trainer_ranks_are_the_consecutive_block_of_the_node(self):
        for gpn in (2, 4, 8):
            for rank in range(4 * gpn):
                node = next(k for k in range(4) if k * gpn <= rank < (k + 1) * gpn)
                trainer, ranks = MODULE.get_trainer_ranks(rank, gpn)
                self.assertEqual(trainer, node, f"rank {rank}, {gpn} per node")
                self.assertEqual(list(ranks), [node * gpn + c for c in range(gpn)])

    def test_same_card_rank_is_the_group_member_on_my_node(self):
        gpn = 4
        for group in ([1, 5, 9], [2, 14], [0], [3, 7, 11, 15]):
            for rank in range(16):
                on_my_node = [q for q in group if q // gpn == rank // gpn]
                want = on_my_node[0] if on_my_node else -1
                self.assertEqual(MODULE.get_same_card_rank(group, rank, gpn), want,
                                 f"group {group}, rank {rank}")

    def test_gpus_per_node_is_the_launchers_local_size(self):
        for value in ("2", "8"):
            with local_size(int(value)):
                self.assertEqual(MODULE.get_gpus_per_node(), int(value))

    def test_gpus_per_node_without_local_size_or_devices_is_refused(self):
        if paddle.device.cuda.device_count() > 0:
            self.skipTest("devices visible: the count is the answer")
        with local_size(None), self.assertRaises((AssertionError, ValueError)):
            MODULE.get_gpus_per_node()


class TestOneStepMatchesReference(_ReferenceCase):
    """Every path of reduce + step + parameter sync, one step."""

    def test_plain_sharding_fused_buffers(self):
        self.assert_trains_like_reference(Layout(ep=1, ms=2), 1)

    def test_plain_sharding_unfused(self):
        self.assert_trains_like_reference(Layout(ep=1, ms=2, fused=False), 1)

    def test_moe_experts_on_their_colour_group(self):
        self.assert_trains_like_reference(Layout(ep=4, ms=2), 1)

    def test_update_then_sync_without_the_staged_overlap(self):
        for cfg in (Layout(ep=1, ms=2), Layout(ep=4, ms=2)):
            with mock.patch.dict(os.environ, {OVERLAP_SYNC_FLAG: "0"}):
                self.assert_trains_like_reference(cfg, 1)

    def test_group_call_hierarchical_reduce_and_broadcast(self):
        self.assert_trains_like_reference(Layout(**GROUP_CALL), 1)

    def test_group_call_unfused_gradients(self):
        self.assert_trains_like_reference(Layout(**GROUP_CALL, fused=False), 1)

    def test_group_call_with_comm_overlap_hooks(self):
        self.assert_trains_like_reference(Layout(**GROUP_CALL, overlap=True), 1)

    def test_released_gradient_buffers(self):
        self.assert_trains_like_reference(Layout(ep=1, ms=2, release_grads=True), 1)

    def test_group_call_released_gradient_buffers(self):
        self.assert_trains_like_reference(Layout(**GROUP_CALL, release_grads=True), 1)

    def test_group_call_two_pipeline_stages(self):
        # develop's rank formula needs moe_sharding before pipe (the default here)
        self.assert_trains_like_reference(Layout(ep=2, ms=2, pp=2, gpn=2), 1)


class TestUnfusedEdgeCasesMatchReference(_ReferenceCase):
    """The unfused reduce (comm_buffer_size_MB <= 0) on its edge cases."""

    def test_colour_groups_of_one_rank(self):
        # moe_sharding degree 1: each expert colour group is one rank (nothing
        # to reduce or broadcast there); the dense group still spans the EP ranks
        self.assert_trains_like_reference(Layout(ep=4, ms=1, fused=False), 1)

    def test_matrix_without_gradient_steps_as_a_zero_gradient(self):
        """A Muon matrix the loss never uses: the other parameters train like
        the reference, and it takes the step a single process gives a zero
        gradient (develop zero-fills it before the reduce)."""
        cfg = Layout(ep=1, ms=2, fused=False)
        unused = np.random.default_rng(7).normal(0, 0.3, (H, H)).astype("float32")

        def make_unused():
            p = paddle.create_parameter(
                list(unused.shape), "float32",
                default_initializer=paddle.nn.initializer.Assign(unused))
            p.name = "dense.unused"  # the same name on every simulated rank
            return p

        def body(cfg):
            hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
            net = TinyMoE(None, None)
            net.add_parameter("dense_unused", make_unused())
            opt = MuonShardingOptimizer(make_muon(list(net.parameters()), clip=False), hcg)
            train_steps(cfg, hcg, net, opt, steps=1)
            return net.named_values(), net.dense_unused.numpy().copy()

        results, world = run_world(cfg, body)
        world.check_schedule()
        expected = reference_values(cfg, 1)
        alone = make_unused()
        single = make_muon([alone], clip=False)
        alone._copy_gradient_from(paddle.zeros_like(alone))
        single.step()
        for rank, (values, got) in enumerate(results):
            diff, name = max_diff(values, expected[rank])
            self.assertLess(diff, TOL, f"[{KIND}] rank {rank} {name} is {diff:.3g} from the "
                                       "reference beside a matrix without gradient")
            diff = float(np.abs(got - alone.numpy()).max())
            self.assertLess(diff, TOL, f"[{KIND}] rank {rank}: the matrix without gradient is "
                                       f"{diff:.3g} from a zero-gradient Muon step")


class TestGroupCallColourOfOneMatrix(_ReferenceCase):
    """A second dense colour on the sharding group (e.g. a separately coloured
    output layer): each colour then holds a single matrix (develop
    broadcasts it as it is, not packed into a flat buffer)."""

    def test_trains_like_reference(self):
        cfg = Layout(**GROUP_CALL)

        def body(cfg):
            hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
            net = TinyMoE(hcg.get_expert_parallel_rank(), hcg.get_moe_sharding_parallel_group())
            net.dense["w_out"].color = {"color": "dense_out",
                                        "group": hcg.get_sharding_parallel_group()}
            opt = MuonShardingOptimizer(make_muon(list(net.parameters()), clip=False), hcg)
            train_steps(cfg, hcg, net, opt, steps=1)
            return net.named_values()

        self.assert_trains_like_reference(cfg, 1, body)


class TestOwnerGradientIsTheGroupMean(unittest.TestCase):
    """After reduce_gradients, each owner's matrix gradient is its group's mean.

    The parameter checks cannot see a wrongly scaled gradient (Muon's
    orthogonalisation and Adam's first step are scale invariant), so the
    reduced gradient itself is compared: dense matrices with the mean over the
    stage, expert matrices with the mean over their moe_sharding group.
    """

    def _check(self, layout: Layout) -> None:
        def body(cfg):
            hcg, net, opt = build_rank(cfg)
            rank = paddle.distributed.get_rank()
            net(paddle.to_tensor(batch(0, rank))).backward()
            opt.reduce_gradients(list(net.parameters()), hcg)
            owned = owned_matrix_names(opt)
            if owned is None:
                return None
            params = {f"dense.{k}": p for k, p in net.dense.items()}
            params.update({f"expert.{k}": p for k, p in (net.experts or {}).items()})
            return {k: p.grad.numpy().copy() for k, p in params.items()
                    if p.name in owned and p.grad is not None}

        results, _ = run_world(layout, body)
        if None in results:
            self.skipTest(LOCAL_2D_MISSING)
        oracle = LayoutOracle(layout)
        means = {}
        for stage in sorted({oracle.sharding_group(r) for r in range(layout.world)}):
            expert = {r: (oracle.coords[r]["expert"] if layout.ep > 1 else None) for r in stage}
            means[stage] = Reference(expert, clip=False).mean_grads(0)
        checked = 0
        for rank, grads in enumerate(results):
            coord = oracle.coords[rank]["expert"] if layout.ep > 1 else None
            mean = means[oracle.sharding_group(rank)]
            for key, grad in grads.items():
                want = mean[(None if key.startswith("dense.") else coord, key)]
                diff = float(np.abs(grad - want).max())
                self.assertLess(diff, 1e-6, f"[{KIND}] {layout}: rank {rank} owns {key}; its "
                                            f"reduced gradient is {diff:.3g} from the group mean")
                checked += 1
        self.assertGreater(checked, 0, "no rank owns a matrix")

    def test_plain_sharding(self):
        for fused in (True, False):
            self._check(Layout(ep=1, ms=2, fused=fused))

    def test_moe_experts(self):
        self._check(Layout(ep=4, ms=2))

    def test_group_call(self):
        for kw in ({}, {"fused": False}, {"overlap": True}):
            self._check(Layout(**GROUP_CALL, **kw))

    def test_group_call_two_pipeline_stages(self):
        self._check(Layout(ep=2, ms=2, pp=2, gpn=2))


class TestGroupCallCollectivesFollowRankCoordinates(unittest.TestCase):
    """comm_group_call_opt: who reduces/broadcasts where, from coordinates alone."""

    def _check(self, cfg: Layout) -> None:
        def body(cfg):
            hcg, net, opt = build_rank(cfg)
            rank = paddle.distributed.get_rank()
            start = len(active_comm().traces[rank])
            train_steps(cfg, hcg, net, opt, steps=1)
            owners = {colour: dict(by_name)
                      for colour, by_name in opt._param2rank_2d_by_color.items()}
            return start, owners

        results, world = run_world(cfg, body)
        world.check_schedule()
        oracle = LayoutOracle(cfg)
        gpn = cfg.gpn
        for rank, (start, owners) in enumerate(results):
            groups = {None: oracle.sharding_group(rank), EXPERT_COLOUR: oracle.moe_group(rank)}
            # owners are group-local indices (develop's attribute); globalise them
            owner_ranks = {colour: {sorted(groups[colour])[i] for i in by_name.values()}
                           for colour, by_name in owners.items()}
            self.assertTrue(owner_ranks.get(None), f"rank {rank}: no dense owner")
            want = set()
            for op in ("reduce", "broadcast"):
                for o in owner_ranks.get(None, ()):
                    want.add((op, oracle.node(rank), oracle.node(rank)[0] + o % gpn))
                    if rank % gpn == o % gpn:
                        want.add((op, oracle.same_card(rank), o))
                for o in owner_ranks.get(EXPERT_COLOUR, ()):
                    want.add((op, tuple(sorted(groups[EXPERT_COLOUR])), o))
            got = {(r.op, tuple(r.group_ranks), r.root) for r in world.traces[rank][start:]
                   if r.op in ("reduce", "broadcast")}
            self.assertEqual(got, want, f"[{KIND}] rank {rank} (node {rank // gpn}, card "
                                        f"{rank % gpn}): 2-D collectives {sorted(got)}, "
                                        f"coordinates give {sorted(want)}")

    def test_one_pipeline_stage(self):
        self._check(Layout(**GROUP_CALL))

    def test_two_pipeline_stages(self):
        self._check(Layout(ep=2, ms=2, pp=2, gpn=2))


class TestLayoutsDevelopRefuses(_ReferenceCase):
    """Layouts develop's group-call rank formula cannot hold: refuse or train right.

    Either answer conforms: an error at construction naming the condition, or
    training that matches the reference. Silent wrong groups do not.
    """

    def _refused_or_correct(self, cfg: Layout, words: tuple) -> str:
        try:
            run_world(cfg, lambda c: build_rank(c) and None, reraise_original=True)
        except (AssertionError, ValueError) as error:
            text = str(error).lower()
            self.assertTrue(any(w in text for w in words),
                            f"[{KIND}] refused {cfg} without naming {words}: {error}")
            return "refused"
        self.assert_trains_like_reference(cfg, 1)
        return "trained"

    def test_pipe_first_order(self):
        self._refused_or_correct(Layout(ep=2, ms=2, pp=2, gpn=2, order=PIPE_FIRST_MOE_ORDER),
                                 ("order", "moe_sharding"))

    def test_ep_not_a_multiple_of_the_node_size(self):
        self._refused_or_correct(Layout(ep=2, ms=4, gpn=4), ("gpus_per_node", "multiple"))


class TestMultiStepMatchesReference(_ReferenceCase):
    """Training over several steps with clear_grad() between them."""

    @upstream_bug("UB-1")
    def test_plain_sharding_three_steps(self):
        self.assert_trains_like_reference(Layout(ep=1, ms=2), 3)

    @upstream_bug("UB-1")
    def test_group_call_three_steps(self):
        self.assert_trains_like_reference(Layout(**GROUP_CALL), 3)

    @upstream_bug("UB-2")
    def test_released_gradient_buffers_three_steps(self):
        self.assert_trains_like_reference(Layout(ep=1, ms=2, release_grads=True), 3)


class TestStateDictResumesTraining(_ReferenceCase):
    """state_dict() after step 1, set_state_dict() into a fresh job, step 2 = 2 steps."""

    def _check(self, layout: Layout) -> None:
        def first(cfg):
            hcg, net, opt = build_rank(cfg)
            train_steps(cfg, hcg, net, opt, steps=1, clear=False)
            state = {k: (v.numpy().copy() if hasattr(v, "numpy") else v)
                     for k, v in opt.state_dict().items()}
            return {k: p.numpy().copy() for k, p in net.named_parameters()}, state

        saved, _ = run_world(layout, first)

        def resumed(cfg):
            hcg, net, opt = build_rank(cfg)
            values, state = saved[paddle.distributed.get_rank()]
            for k, p in net.named_parameters():
                p.set_value(values[k])
            opt.set_state_dict({k: (paddle.to_tensor(v) if isinstance(v, np.ndarray) else v)
                                for k, v in state.items()})
            train_steps(cfg, hcg, net, opt, first_step=1, steps=1)
            return net.named_values()

        results, _ = run_world(layout, resumed)
        expected = reference_values(layout, 2)
        for rank, values in enumerate(results):
            diff, name = max_diff(values, expected[rank])
            self.assertLess(diff, TOL, f"[{KIND}] {layout}: rank {rank} {name} is {diff:.3g} "
                                       "from the reference after a resumed second step")

    def test_plain_sharding(self):
        self._check(Layout(ep=1, ms=2))

    def test_group_call(self):
        self._check(Layout(**GROUP_CALL))


class TestGradientAfterClearGradReachesTheOwner(unittest.TestCase):
    """UB-1 at its cause: the second step's reduced gradient on the owner."""

    @upstream_bug("UB-1")
    def test_second_step_owner_gradient_is_the_group_mean(self):
        cfg = Layout(ep=1, ms=2)

        def body(cfg):
            hcg, net, opt = build_rank(cfg)
            train_steps(cfg, hcg, net, opt, steps=1)  # step 0, then clear_grad
            rank = paddle.distributed.get_rank()
            net(paddle.to_tensor(batch(1, rank))).backward()
            opt.reduce_gradients(list(net.parameters()), hcg)
            owned = owned_matrix_names(opt)
            if owned is None:
                return None
            return {k: p.grad.numpy().copy() for k, p in net.dense.items()
                    if p.name in owned and p.grad is not None}

        results, _ = run_world(cfg, body)
        if None in results:
            self.skipTest(LOCAL_2D_MISSING)
        ref = Reference({0: None, 1: None}, clip=False)
        ref.step(0)
        mean = ref.mean_grads(1)
        checked = 0
        for rank, grads in enumerate(results):
            for key, grad in grads.items():
                want = mean[(None, f"dense.{key}")]
                self.assertLess(float(np.abs(grad - want).max()), TOL,
                                f"[{KIND}] rank {rank} owns dense.{key}: its step-2 gradient "
                                f"is not the group mean")
                checked += 1
        self.assertGreater(checked, 0, "no rank owns a dense matrix")


if __name__ == "__main__":
    unittest.main()
