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
"""``muon_partition_strategy="rail"``: the hierarchical path's owner rule.

* Rail spread: on hierarchical layouts (2 x 8, 4 x 8, 2 x 4 with experts,
  two pipeline stages) the bytes each card index (rail) carries across nodes
  stay within the LPT bound ``mean + largest matrix``, each rank within its
  rail's mean per node plus the largest matrix, each node within
  ``total / nodes + cards * largest``; bounds and bytes are computed here
  from shapes and dtypes (``numel * itemsize``), not by the code under test.
* Owners sit in their colour group, every rank derives the same map, and the
  input order does not matter.
* Where the rule does not apply (no plan, a group on one node, the MoE
  colour) the owners are the ``balanced`` rule's.
* The real optimizer with ``"rail"`` on the simulated world matches the
  single-process reference (1e-5 on fp32, 1e-2 with a bf16 matrix, the
  tolerances of the group-call and layout-case suites) and records exactly
  the collectives its layout schedules.
* The option table takes ``"rail"`` and refuses an unknown value naming it.
"""

from __future__ import annotations

import math
import random
import unittest

from muon_layout_helpers import oracle_layout
from muon_sim_runner import (
    LayoutOracle,
    SimConfig,
    max_abs_diff,
    reference_values,
    run_world,
    sharded_core,
)

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import layout as placement
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.layout import (
    LayoutSettings,
    ParamMeta,
    ShardingLayout,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.settings import (
    PARTITION_STRATEGIES,
    check_option_value,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.owners import MatrixSpec
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.owners import (
    balanced_partition,
    partition_from_owners,
)
from paddle_muon_ext.tools.args import MuonCommConfig
from paddle_muon_ext.tools.plan_world import build_layout_plan
from paddle_muon_ext.tools.recommend import rail_applies
from paddle_muon_ext.tools.presets import get_preset

RAIL = "rail"
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
FP32_TOL = 1e-5
BF16_TOL = 1e-2
# (name, ep, moe_sharding, pp, cards per node): nodes = ep * ms * pp / cards
LAYOUTS = [
    ("2x8", 8, 2, 1, 8),
    ("4x8", 16, 2, 1, 8),
    ("2x4-ep4", 4, 2, 1, 4),
    ("4x4-pp2", 4, 4, 2, 4),  # two stages of two nodes each
]


def _nbytes(spec: MatrixSpec) -> int:
    return math.prod(spec.shape) * ITEMSIZE[spec.dtype]


def _random_specs(seed: int, count: int, dtypes=("bfloat16",)) -> list:
    rng = random.Random(seed)
    shapes = [(rng.choice([64, 256, 1024]), rng.choice([128, 512, 2048])) for _ in range(6)]
    out = []
    for i in range(count):
        shape = rng.choice(shapes) if rng.random() < 0.85 else (
            rng.choice([2, 4]), 128, rng.choice([256, 512]))
        out.append(MatrixSpec(f"m{i:04d}", shape, rng.choice(dtypes)))
    return out


def _preset_dense_specs(model: str) -> list:
    return [MatrixSpec(p.name, tuple(p.shape), p.dtype) for p in get_preset(model)
            if p.use_muon and not p.is_expert]


class TestRailSpread(unittest.TestCase):
    def _check_spread(self, what: str, specs: list, group: list, owners: dict, gpn: int):
        self.assertEqual(set(owners), {s.name for s in specs}, what)
        self.assertTrue(set(owners.values()) <= set(group), f"{what}: owner outside the group")
        nodes = sorted({r // gpn for r in group})
        rail = dict.fromkeys(range(gpn), 0)
        node = dict.fromkeys(nodes, 0)
        rank = dict.fromkeys(group, 0)
        for s in specs:
            r = owners[s.name]
            b = _nbytes(s)
            rail[r % gpn] += b
            node[r // gpn] += b
            rank[r] += b
        total = sum(rail.values())
        largest = max(_nbytes(s) for s in specs)
        # LPT: the busiest rail got its last matrix while it was the least loaded
        self.assertLessEqual(max(rail.values()), total / gpn + largest, f"{what}: rails {rail}")
        for r, b in rank.items():
            self.assertLessEqual(b, rail[r % gpn] / len(nodes) + largest,
                                 f"{what}: rank {r} on rail {r % gpn}")
        self.assertLessEqual(max(node.values()), total / len(nodes) + gpn * largest,
                             f"{what}: nodes {node}")
        return rail

    def test_rails_carry_even_bytes_on_hierarchical_layouts(self):
        cases = [("random", _random_specs(3, 300)), ("few", _random_specs(4, 40)),
                 ("ernie-moe-small", _preset_dense_specs("ernie-moe-small"))]
        for name, ep, ms, pp, gpn in LAYOUTS:
            plan = MuonCommConfig(ep=ep, moe_sharding=ms, pp=pp, gpus_per_node=gpn).build_plan()
            for stage in range(pp):
                group = list(plan.sharding_group_ranks(stage))
                for label, specs in cases:
                    # one dtype class: every rank is allowed, so LPT's bound holds
                    specs = [MatrixSpec(s.name, s.shape, "bfloat16") for s in specs]
                    with self.subTest(layout=name, stage=stage, specs=label):
                        owners, part = placement.assign_muon_owners(specs, group, plan, RAIL)
                        self.assertEqual(part.method, RAIL)
                        self._check_spread(f"{name} stage {stage} {label}", specs, group,
                                           owners, gpn)

    def test_rail_spread_beats_balanced_on_the_small_moe_dense_matrices(self):
        # 4 nodes x 8 cards, ernie-moe-small's dense matrices (one dtype):
        # the rail rule targets the busiest rail, so it is never worse there
        plan = MuonCommConfig(ep=16, moe_sharding=2, pp=1, gpus_per_node=8).build_plan()
        group = list(plan.sharding_group_ranks(0))
        specs = _preset_dense_specs("ernie-moe-small")

        def busiest(rule):
            owners, _ = placement.assign_muon_owners(specs, group, plan, rule)
            rail = [0] * 8
            for s in specs:
                rail[owners[s.name] % 8] += _nbytes(s)
            return max(rail) / (sum(rail) / 8)

        self.assertLessEqual(busiest(RAIL), busiest("balanced"))
        self.assertLess(busiest(RAIL), 1.01)

    def test_mixed_dtypes_keep_owners_in_group_and_minority_buffers_few(self):
        plan = MuonCommConfig(ep=8, moe_sharding=2, pp=1, gpus_per_node=8).build_plan()
        group = list(plan.sharding_group_ranks(0))
        specs = _random_specs(5, 200)
        # a minority class well under one rank's share: one owner (one buffer)
        specs += [MatrixSpec(f"gate{i}", (64, 8), "float32") for i in range(6)]
        owners, part = placement.assign_muon_owners(specs, group, plan, RAIL)
        self.assertTrue(set(owners.values()) <= set(group))
        self.assertEqual(len({owners[f"gate{i}"] for i in range(6)}), 1)
        self.assertEqual(set(part.owners), {s.name for s in specs})
        # the loads it reports are those of its owners
        index = {r: i for i, r in enumerate(group)}
        again = partition_from_owners(specs, len(group),
                                      {k: index[v] for k, v in owners.items()}, "check")
        self.assertEqual((part.state_bytes, part.ns_cost), (again.state_bytes, again.ns_cost))

    def test_within_a_rail_the_owner_is_on_the_least_loaded_node(self):
        """Ranks of one rail with equal loads: the matrix goes to the node
        carrying fewer bytes over all rails, so nodes end even, not only rails.
        Rows: (name, matrices' shapes (bf16, largest placed first)); 2 nodes x
        4 cards, every matrix on its own rail, equal node bytes by hand."""
        plan = MuonCommConfig(ep=4, moe_sharding=2, pp=1, gpus_per_node=4).build_plan()
        group = list(plan.sharding_group_ranks(0))
        settings = LayoutSettings(partition_strategy=RAIL)
        rows = [("4096 + 2 x 2048", [(16, 64), (16, 64), (32, 64)]),
                ("8192 + 2 x 4096", [(32, 64), (64, 64), (32, 64)])]
        for label, shapes in rows:
            with self.subTest(matrices=label):
                params = [ParamMeta(f"m{i}", s, "bfloat16", None, True)
                          for i, s in enumerate(shapes)]
                owners = ShardingLayout.build(params, {None: group}, group[0], settings,
                                              plan).owners
                rails = [plan.card_of(owners[p.name]) for p in params]
                self.assertEqual(len(set(rails)), min(len(params), 4), f"rails {rails}")
                node_bytes = dict.fromkeys({plan.node_of(r) for r in group}, 0)
                for p in params:
                    node_bytes[plan.node_of(owners[p.name])] += p.nbytes
                total = sum(node_bytes.values())
                self.assertEqual(sorted(node_bytes.values()),
                                 [total // 2, total // 2], f"{label}: nodes {node_bytes}")

    def test_a_minority_dtype_gets_owners_for_its_byte_share_rounded_up(self):
        """A dtype class may use ceil(class bytes x ranks / all bytes) owners
        (at least one): 8 ranks, ten 128 KiB bf16 matrices and n 64 KiB fp32
        ones; enough fp32 matrices to fill that many owners."""
        from fractions import Fraction

        plan = MuonCommConfig(ep=4, moe_sharding=2, pp=1, gpus_per_node=4).build_plan()
        group = list(plan.sharding_group_ranks(0))
        settings = LayoutSettings(partition_strategy=RAIL)
        for n_fp32 in (1, 3, 6, 10):
            with self.subTest(fp32_matrices=n_fp32):
                params = [ParamMeta(f"big{i}", (256, 256), "bfloat16", None, True)
                          for i in range(10)]
                params += [ParamMeta(f"gate{i}", (128, 128), "float32", None, True)
                           for i in range(n_fp32)]
                owners = ShardingLayout.build(params, {None: group}, group[0], settings,
                                              plan).owners
                fp32_bytes = n_fp32 * 128 * 128 * 4
                all_bytes = fp32_bytes + 10 * 256 * 256 * 2
                cap = max(1, math.ceil(Fraction(fp32_bytes * len(group), all_bytes)))
                got = {owners[f"gate{i}"] for i in range(n_fp32)}
                self.assertEqual(len(got), min(cap, n_fp32), f"fp32 owners {sorted(got)}")

    def test_every_rank_and_any_input_order_give_one_owner_map(self):
        plan = MuonCommConfig(ep=4, moe_sharding=2, pp=1, gpus_per_node=4).build_plan()
        group = list(plan.sharding_group_ranks(0))
        specs = _random_specs(9, 120, dtypes=("bfloat16", "float32"))
        params = [ParamMeta(s.name, s.shape, s.dtype, None, True) for s in specs]
        settings = LayoutSettings(partition_strategy=RAIL)
        maps = {tuple(sorted(ShardingLayout.build(params, {None: group}, r, settings,
                                                  plan).owners.items()))
                for r in group}
        self.assertEqual(len(maps), 1)
        shuffled = list(specs)
        random.Random(1).shuffle(shuffled)
        a, _ = placement.assign_muon_owners(specs, group, plan, RAIL)
        b, _ = placement.assign_muon_owners(shuffled, group, plan, RAIL)
        self.assertEqual(a, b)
        self.assertEqual(dict(next(iter(maps))), a)


class TestRailBuckets(unittest.TestCase):
    def test_hierarchical_buckets_are_placed_from_the_rail_owners(self):
        plan = MuonCommConfig(ep=4, moe_sharding=4, pp=1, gpus_per_node=4).build_plan()
        group = tuple(plan.sharding_group_ranks(0))
        params = tuple(ParamMeta(s.name, s.shape, s.dtype, None, True)
                       for s in _random_specs(21, 150, dtypes=("bfloat16", "float32")))
        for buffer_MB in (0.0, 0.05, 256.0):
            settings = LayoutSettings(comm_buffer_size_MB=buffer_MB, partition_strategy=RAIL)
            owner_of, part, got = placement.colour_muon_layout(None, group, params, plan,
                                                               settings)
            with self.subTest(buffer_MB=buffer_MB):
                self.assertEqual(part.method, RAIL)
                self.assertEqual(got, placement.muon_bucket_specs(None, group, params,
                                                                  owner_of, True, settings))
                self.assertTrue(all(b.route == "hierarchical" for b in got))


class TestRailFallsBackToBalanced(unittest.TestCase):
    def test_without_a_plan_the_owners_are_balanced(self):
        specs = _random_specs(11, 90, dtypes=("bfloat16", "float32"))
        group = list(range(8))
        owners, part = placement.assign_muon_owners(specs, group, None, RAIL)
        want = balanced_partition(specs, 8)
        self.assertEqual(owners, {k: group[v] for k, v in want.owners.items()})
        self.assertEqual(part.method, "balanced")

    def test_a_group_on_one_node_gets_balanced_owners(self):
        # ms_pp_ep, ms=1, pp=2, ep=8, 8 cards: stage p is node p. The
        # hierarchical plan refuses such a layout; the tools' flat-path plan
        # (no node preconditions) holds it, so the rule's own guard is tested.
        plan = build_layout_plan(MuonCommConfig(ep=8, moe_sharding=1, pp=2, gpus_per_node=8),
                                 group_call=False)
        self.assertFalse(rail_applies(plan))
        specs = _random_specs(12, 50)
        for stage in range(2):
            group = list(plan.sharding_group_ranks(stage))
            self.assertEqual(len({r // 8 for r in group}), 1)
            got, _ = placement.assign_muon_owners(specs, group, plan, RAIL)
            want, _ = placement.assign_muon_owners(specs, group, plan, "balanced")
            self.assertEqual(got, want, f"stage {stage}")

    def test_the_moe_colour_keeps_balanced_owners(self):
        plan = MuonCommConfig(ep=4, moe_sharding=2, pp=1, gpus_per_node=4).build_plan()
        dense = list(plan.sharding_group_ranks(0))
        moe = list(plan.moe_sharding_ranks(0))
        params = [ParamMeta(s.name, s.shape, s.dtype, "moe", True)
                  for s in _random_specs(13, 30)]
        params.append(ParamMeta("dense0", (128, 128), "bfloat16", None, True))
        layouts = {rule: ShardingLayout.build(params, {None: dense, "moe": moe}, 0,
                                              LayoutSettings(partition_strategy=rule), plan)
                   for rule in (RAIL, "balanced")}
        self.assertEqual(layouts[RAIL].partitions["moe"].owners,
                         layouts["balanced"].partitions["moe"].owners)
        self.assertEqual(layouts[RAIL].partitions[None].method, RAIL)


class TestRailOption(unittest.TestCase):
    def test_the_table_accepts_rail_and_names_it_when_refusing(self):
        self.assertIn(RAIL, PARTITION_STRATEGIES)
        check_option_value("muon_partition_strategy", RAIL)
        with self.assertRaisesRegex(ValueError, "'rail'"):
            check_option_value("muon_partition_strategy", "rails")


class TestRailOptimizerOnSimulatedWorld(unittest.TestCase):
    """The real optimizer with the rail rule: the single-process numbers and
    the layout's schedule."""

    def _numerics(self, cfg: SimConfig, tol: float) -> None:
        results, world = run_world(cfg)
        report = world.check_schedule()
        self.assertTrue(report.ok, report.summary())
        expected = reference_values(cfg)
        for res in results:
            d = max_abs_diff(res.values, expected[res.rank])
            self.assertLessEqual(d, tol, f"rank {res.rank}: max |d| {d:.3e} vs the reference")
            self.assertEqual(sharded_core(res.optimizer).sharding_layout.partitions[None].method,
                             RAIL)

    def test_fp32_two_nodes_of_two_matches_the_reference(self):
        self._numerics(SimConfig(ep=4, ms=2, gpn=2, steps=3, partition=RAIL), FP32_TOL)

    def test_bf16_matrix_two_nodes_of_four_matches_the_reference(self):
        self._numerics(SimConfig(ep=4, ms=2, gpn=4, steps=2, clip=False,
                                 matrix_dtype="bfloat16", partition=RAIL), BF16_TOL)

    def test_recorded_collectives_are_the_layouts_schedule(self):
        # as the group-call suite's schedule runs: the optimizer's own
        # collectives (no fleet wrapper, no clip), one step, every rank
        for ep, ms, pp, gpn in ((4, 2, 1, 2), (4, 2, 1, 4), (4, 2, 2, 4)):
            cfg = SimConfig(ep=ep, ms=ms, pp=pp, gpn=gpn, steps=1, clip=False,
                            via_fleet=False, partition=RAIL)
            with self.subTest(ep=ep, ms=ms, pp=pp, gpn=gpn):
                results, world = run_world(cfg, mode="record")
                report = world.check_schedule()
                self.assertTrue(report.ok, report.summary())
                oracle = LayoutOracle(cfg)
                for res in results:
                    core = sharded_core(res.optimizer)
                    layout = oracle_layout(cfg, oracle, core.comm_plan, res.rank)
                    self.assertEqual(core.sharding_layout.owners, layout.owners)
                    recorded = [(r.phase, r.op, tuple(sorted(r.group_ranks)), r.root, r.dtype,
                                 r.numel) for r in world.traces[res.rank]
                                if r.group_seq is not None and r.phase is not None]
                    self.assertEqual(recorded, [op.key() for op in layout.schedule()],
                                     f"rank {res.rank}: recorded collectives vs the layout's")

if __name__ == "__main__":
    unittest.main()
