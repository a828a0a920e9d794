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
"""The step plan is the program: what every rank executes is ``layout.schedule()``.

* ``TestExecutedStepIsThePlan``: the optimizer runs ``for phase in plan:
  run(phase)`` and the tools read the same plan's ops, so on every rank of
  each layout (flat, hierarchical, backward hooks, staged sync flat and
  hierarchical, MoE colours, pp > 1) the labelled collectives the simulated
  world records in each step equal the schedule collective by collective
  (hook-launched ones as a multiset: they follow the backward pass), the
  global-norm clip's all-reduces included.
* ``TestPhasesPerRouteAndMode``: the plan's phases and triggers per route
  (flat, hierarchical) and mode (staged sync, backward hooks).
* ``TestLayoutStagesMatchOptimizer`` / ``TestPlanToolAndOptimizerShareThePlan``:
  the plan tool's layout and the optimizer hold the same sync stages, owners
  and phase list on every rank.
"""

from __future__ import annotations

import dataclasses
import os
import unittest
from collections import Counter
from contextlib import contextmanager

import paddle

from mock.fake_hcg import PIPE_FIRST_MOE_ORDER
from muon_layout_helpers import _hier
from muon_sim_runner import SimConfig, run_world
from muon_test_compat import set_muon_sharding_options, sharded_core
from muon_tiny_moe import TinyMoE, _has_staged_api, make_muon

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.layout import (
    LayoutSettings,
    ParamMeta,
    ShardingLayout,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_optimizer import (
    MuonShardingOptimizer,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.settings import (
    OVERLAP_SYNC_ENV,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.step_plan import (
    PHASE_CLIP,
    SliceRef,
    Trigger,
)

# name -> (config, FLAGS_muon_sharding_overlap_optimize_and_sync, staged sync expected)
CASES = {
    "flat-plain-sync": (SimConfig(ep=1, ms=4, steps=2), "0", False),
    "flat-moe-staged": (SimConfig(ep=2, ms=2, steps=2), "1", True),
    "hierarchical": (SimConfig(ep=4, ms=2, gpn=2, steps=2), "1", False),
    "hierarchical-staged": (SimConfig(ep=4, ms=2, gpn=2, steps=2,
                                      overlap_sync_group_call=True), "1", True),
    "hooks-overlap": (SimConfig(ep=4, ms=2, gpn=2, overlap=True, steps=2), "1", False),
    "pp2-moe-staged": (SimConfig(ep=2, ms=2, pp=2, order=PIPE_FIRST_MOE_ORDER, steps=2,
                                 via_fleet=False), "1", True),
}


@contextmanager
def _overlap_sync_flag(value: str):
    saved = os.environ.get(OVERLAP_SYNC_ENV)
    os.environ[OVERLAP_SYNC_ENV] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(OVERLAP_SYNC_ENV, None)
        else:
            os.environ[OVERLAP_SYNC_ENV] = saved


def _executed(trace) -> list:
    # A step's collectives carry their phase's label; construction's
    # (group creation, the rank agreement) carry none.
    return [(r.phase, r.op, tuple(sorted(r.group_ranks)), r.root, r.dtype, r.numel)
            for r in trace if r.group_seq is not None and r.phase is not None]


class TestExecutedStepIsThePlan(unittest.TestCase):
    """Every rank executes exactly its layout's schedule, in the plan's order."""

    def test_every_rank_executes_its_schedule(self):
        for name, (cfg, flag, staged) in CASES.items():
            with self.subTest(case=name):
                with _overlap_sync_flag(flag):
                    results, world = run_world(cfg, mode="record")
                self.assertTrue(world.check_schedule().ok, name)
                for res in results:
                    self._check_rank(name, cfg, staged, res.rank,
                                     sharded_core(res.optimizer).sharding_layout,
                                     world.traces[res.rank])

    def _check_rank(self, name, cfg, staged, rank, layout, trace) -> None:
        where = f"[{name}] rank {rank}"
        self.assertEqual(layout.staged_sync, staged, where)
        schedule = layout.schedule()
        clip = [op for op in schedule if op.phase == PHASE_CLIP]
        # HybridParallelClipGrad: the norm twice over the sharding group, once over pipe
        self.assertEqual([op.op for op in clip], ["all_reduce"] * (2 + (cfg.pp > 1)), where)
        got = _executed(trace)
        per_step = len(schedule)
        self.assertEqual(len(got), per_step * cfg.steps,
                         f"{where}: executed {len(got)} collectives in {cfg.steps} steps, "
                         f"the plan has {per_step} per step")
        hooks = sum(1 for op in schedule if op.trigger == Trigger.BACKWARD)
        self.assertEqual(hooks > 0, cfg.overlap, where)
        want = [op.key() for op in schedule]
        for step in range(cfg.steps):
            chunk = got[step * per_step:(step + 1) * per_step]
            self.assertEqual(Counter(chunk[:hooks]), Counter(want[:hooks]),
                             f"{where} step {step}: hook-launched collectives")
            self.assertEqual(chunk[hooks:], want[hooks:],
                             f"{where} step {step}: executed != the plan's schedule")


class TestPhasesPerRouteAndMode(unittest.TestCase):
    """The plan's phases and triggers per route (flat, hierarchical) and mode
    (staged sync, backward hooks)."""

    def test_group_call_turns_the_staged_sync_off_unless_opted_in(self):
        # develop: overlap_optimize_and_sync is off under comm_group_call_opt;
        # overlap_sync_group_call (ours) keeps it on, and a flat layout has it
        plan, hier = _hier(overlap=False)
        self.assertTrue(hier.settings.overlap_sync, "the default asks for the staged sync")
        flat = ShardingLayout.build(list(hier.params.values()), hier.groups, 5, hier.settings)
        opted = dataclasses.replace(
            hier, settings=dataclasses.replace(hier.settings, overlap_sync_group_call=True))
        for layout, staged in ((hier, False), (opted, True), (flat, True)):
            triggers = {str(ph.trigger).split("[")[0] for ph in layout.step_plan()}
            self.assertEqual(layout.staged_sync, staged)
            self.assertEqual("sync" in triggers, staged,
                             f"plan={layout.plan is not None} opted-in="
                             f"{layout.settings.overlap_sync_group_call}: triggers {triggers}")

    def test_hierarchical_schedule_phases(self):
        plan, layout = _hier(overlap=False)
        ops = layout.schedule()
        phases = [op.phase for op in ops]
        dense = [b for b in layout.muon_buckets if b.colour is None]
        crossing = [b for b in dense if plan.card_of(b.owner) == plan.card_of(5)]
        self.assertTrue(all(b.route_kind == "hierarchical" for b in dense))
        self.assertEqual(phases.count("intra_node_reduce"), len(dense))
        self.assertEqual(phases.count("cross_node_reduce"), len(crossing))
        self.assertEqual(phases.count("cross_node_broadcast"), len(crossing))
        self.assertEqual(phases[0], "reduce_scatter")
        self.assertEqual(phases[-1], "all_gather_slices")
        for op in ops:
            if op.phase == "intra_node_reduce":
                self.assertEqual(op.group, plan.node_ranks(plan.node_of(5)))
            if op.phase.startswith("cross_node"):
                self.assertEqual(op.group, plan.same_card_ranks(0, plan.card_of(5)))
        self.assertEqual({op.trigger for op in ops if "reduce" in op.phase}, {"reduce_gradients"})

    def test_overlap_launches_first_hop_from_hooks(self):
        plan, layout = _hier(overlap=True)
        ops = layout.schedule()
        by_trigger = {}
        for op in ops:
            by_trigger.setdefault(op.trigger, set()).add(op.phase.split("[")[0])
        self.assertEqual(by_trigger["backward"],
                         {"reduce_scatter", "intra_node_reduce", "reduce_to_owner"})
        self.assertEqual(by_trigger["reduce_gradients"], {"cross_node_reduce"})
        self.assertTrue(all(b.route_kind.endswith("+overlap") for b in layout.muon_buckets))


class TestLayoutStagesMatchOptimizer(unittest.TestCase):
    """The layout's stages (plan tool) are the optimizer's stages."""

    def test_layout_stages_equal_optimizer_stages(self):
        metas = [ParamMeta(f"w{i}", (64, 64 + 16 * (i % 3)), "float32", None, True)
                 for i in range(9)] + [ParamMeta("b", (64,), "float32")]
        groups = {None: (0, 1, 2, 3)}
        layouts = [ShardingLayout.build(metas, groups, r,
                                        LayoutSettings(comm_buffer_size_MB=0.02,
                                                       overlap_sync=True))
                   for r in range(4)]
        stages = [lay.sync_stages() for lay in layouts]
        strip = [[(s.kind, s.keys, s.owners) for s in st] for st in stages]
        self.assertTrue(all(s == strip[0] for s in strip), "identical on every rank")
        self.assertGreater(sum(1 for s in stages[0] if s.kind == "2d"), 1)
        local = sorted(n for st in stages for s in st if s.kind == "2d" for n in s.local_params)
        self.assertEqual(local, sorted(f"w{i}" for i in range(9)))
        bcasts = [op for op in layouts[0].schedule() if op.op == "broadcast"]
        self.assertEqual(sum(op.numel for op in bcasts), sum(m.numel for m in metas[:9]),
                         "the staged broadcasts carry every matrix exactly once")

    def test_element_wise_buffers_follow_as_one_stage_each(self):
        metas = [ParamMeta(f"w{i}", (64, 64), "float32", None, True) for i in range(4)] + [
            ParamMeta(f"b{i}", (2048,), "float32") for i in range(4)]
        lay = ShardingLayout.build(metas, {None: (0, 1)}, 0,
                                   LayoutSettings(comm_buffer_size_MB=0.02, overlap_sync=True))
        stages = lay.sync_stages()
        n2d = sum(1 for s in stages if s.kind == "2d")
        self.assertGreater(n2d, 0)
        self.assertEqual([len(b.params) for b in lay.slice_buffers], [2, 2],
                         "two 8 KB vectors per 20 KB buffer")
        self.assertEqual([s.kind for s in stages], ["2d"] * n2d + ["1d"] * 2,
                         "the element-wise stages come after every 2-D stage")
        for i, (stage, buf) in enumerate(zip(stages[n2d:], lay.slice_buffers)):
            self.assertEqual((stage.buffer_index, stage.colour, stage.group, stage.local_params),
                             (i, buf.colour, buf.group, buf.params),
                             f"stage {n2d + i} is slice buffer {i}, updating its parameters")


@dataclasses.dataclass(frozen=True)
class _DefaultsConfig(SimConfig):
    """A strategy that sets no Muon option but use_muon_sharding: every default."""

    def strategy(self):
        from mock.fake_hcg import make_hybrid_strategy

        strategy = make_hybrid_strategy(self.ep, self.ms, self.pp, order=self.order,
                                        comm_buffer_size_MB=1)
        set_muon_sharding_options(strategy, use_muon_sharding=True)
        return strategy


@unittest.skipUnless(_has_staged_api(), "the optimizer's default needs Muon's staged API")
class TestPlanToolAndOptimizerShareThePlan(unittest.TestCase):
    """The plan tool's layout (model described as ParamSpecs, LayoutSettings
    defaults) and the optimizer built from a default strategy agree on the Muon
    rule, the owners and the whole phase list of every rank."""

    def test_same_owners_and_phases(self):
        from paddle_muon_ext.tools import presets

        cfg = _DefaultsConfig(ep=2, ms=2, steps=1)

        def body(cfg, strategy):
            hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
            net = TinyMoE(hcg.get_expert_parallel_rank(), hcg.get_moe_sharding_parallel_group())
            opt = MuonShardingOptimizer(make_muon(list(net.parameters())), hcg, strategy)
            specs = [presets.ParamSpec(p.name, tuple(p.shape), "float32",
                                       isinstance(getattr(p, "color", None), dict),
                                       presets.muon_applies(p.name, p.shape))
                     for p in net.parameters()]
            groups = {None: tuple(hcg.get_sharding_parallel_group().ranks),
                      "moe_expert": tuple(hcg.get_moe_sharding_parallel_group().ranks)}
            rank = paddle.distributed.get_rank()
            # make_muon clips by global norm: Paddle's HybridParallelClipGrad
            # all-reduces the norm twice over the sharding group (pp == 1)
            tool = ShardingLayout.build([s.to_meta("moe_expert") for s in specs], groups, rank,
                                        LayoutSettings(comm_buffer_size_MB=1),
                                        clip_groups=[groups[None]] * 2)
            mine = opt.sharding_layout

            def phases(layout):
                return [(ph.trigger, ph.label, ph.op, ph.route, ph.group, ph.items)
                        for ph in layout.step_plan()]

            return {"muon_rule": {s.name: s.use_muon for s in specs}
                    == {n: m.use_muon for n, m in mine.params.items()},
                    "owners": (tool.owners, mine.owners),
                    "phases": (phases(tool), phases(mine)),
                    "n_phases": len(mine.step_plan())}

        results, _ = run_world(cfg, body=body, mode="record")
        for rank, out in enumerate(results):
            self.assertTrue(out["muon_rule"], f"rank {rank}: the plan tool's Muon rule differs")
            self.assertEqual(*out["owners"], f"rank {rank}: owners differ")
            self.assertEqual(*out["phases"], f"rank {rank}: the phase lists differ")
            self.assertGreater(out["n_phases"], 3)


if __name__ == "__main__":
    unittest.main()


class TestBackwardPhasesOfTheLayout(unittest.TestCase):
    def test_only_slice_buffers_shared_by_several_ranks_get_a_backward_reduce_scatter(self):
        """With comm_overlap the hooks reduce-scatter each element-wise buffer
        in backward; a buffer whose group is this rank alone holds its result
        already, so the plan (the data the executors and the tools read) has
        no backward phase for it."""
        from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.layout import (
            LayoutSettings,
            ParamMeta,
            ShardingLayout,
        )

        params = [ParamMeta("d.w", (8, 8), "float32", None, True),
                  ParamMeta("d.b", (8,), "float32", None, False),
                  ParamMeta("e.w", (8, 8), "float32", "moe", True),
                  ParamMeta("e.b", (8,), "float32", "moe", False)]
        settings = LayoutSettings(comm_overlap=True, comm_buffer_size_MB=1)
        # rows: the moe colour's group size (1: this rank alone)
        for moe_group in ((0,), (0, 1)):
            with self.subTest(moe_group=moe_group):
                layout = ShardingLayout.build(params, {None: (0, 1), "moe": moe_group}, 0,
                                              settings)
                slice_groups = {SliceRef(i): tuple(b.group)
                                for i, b in enumerate(layout.slice_buffers)}
                self.assertTrue(all(b.overlap for b in layout.slice_buffers))
                scattered = [ref for ph in layout.phases_of(Trigger.BACKWARD)
                             if ph.op == "reduce_scatter" for ref, _ in ph.items]
                self.assertEqual(sorted(scattered),
                                 sorted(r for r, g in slice_groups.items() if len(g) > 1))
                self.assertIn(SliceRef(0), scattered, "the shared buffer is scattered")
