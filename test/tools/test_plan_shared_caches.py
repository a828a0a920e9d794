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
"""The memos ``plan`` shares across paths, rules and buffer sizes
(``tools.fast_layout.FastPlacement``) never hand one configuration another's
result: every layout and step plan equals the core's plain computation.

The memo keys develop's rule on its active-rank caps rather than the buffer
size, computes the balanced rule once per group and renames it for a rank
order, takes the hierarchical buckets from the flat ones renamed onto their
owners, and reuses the sync stages' grouping for layouts of the same
parameters and owners. Each test holds a memoised result to the rule or the
plain placement computed directly, on inputs full of ties.
"""

from __future__ import annotations

import random
import unittest
from unittest import mock

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.layout import (
    LayoutSettings,
    ParamMeta,
    ShardingLayout,
    colour_muon_layout,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.owners import (
    MatrixSpec,
    balanced_partition,
    upstream_partition,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.settings import (
    PARTITION_BALANCED,
    PARTITION_DEVELOP,
    PARTITION_RAIL,
)
from paddle_muon_ext.tools import fast_layout
from paddle_muon_ext.tools.args import MuonCommConfig
from paddle_muon_ext.tools.fast_layout import FastPlacement

RULES = (PARTITION_DEVELOP, PARTITION_BALANCED, PARTITION_RAIL)


def _metas(count: int, seed: int = 0) -> list:
    rng = random.Random(seed or count)
    out = []
    for i in range(count):
        shape = (rng.choice([256, 512, 1024]), rng.choice([256, 512]))
        out.append(ParamMeta(f"m{i:03d}", shape, rng.choice(["bfloat16", "float32"]),
                             use_muon=True))
        if i % 4 == 0:
            out.append(ParamMeta(f"b{i:03d}", (shape[1],), "float32"))
    return out


def _specs(rng: random.Random, count: int) -> tuple:
    shapes = [(rng.choice([64, 128, 256]), rng.choice([64, 256, 1024])) for _ in range(4)]
    dtypes = rng.choice([["bfloat16"], ["bfloat16", "float32"],
                         ["float16", "bfloat16", "float32"]])
    specs = []
    for i in range(count):
        shape = (rng.choice(shapes) if rng.random() < 0.8
                 else (rng.choice([2, 4]), 64, rng.choice([64, 128])))
        specs.append(MatrixSpec(f"p{i:03d}", shape, rng.choice(dtypes)))
    rng.shuffle(specs)
    return tuple(specs)


def _plain(metas, groups, rank, settings, plan=None):
    lay = ShardingLayout.build(list(metas), groups, rank, settings, plan)
    return lay, lay.step_plan()


class TestSharedLayoutsEqualPlainOnes(unittest.TestCase):
    def test_rules_buffer_sizes_and_routes_of_one_run(self):
        """One placement across rules, buffer sizes, routes and ranks, as
        ``plan --recommend`` uses it: each layout and step plan is the plain one."""
        plan = MuonCommConfig(ep=4, moe_sharding=4, pp=1, gpus_per_node=4).build_plan()
        group = tuple(plan.sharding_group_ranks(0))
        metas = _metas(60)
        shared = FastPlacement()
        seen = set()
        for rule in RULES:
            for mb in (0.25, 1.0, 4.0, 256.0, 0.0):
                for hier in (None, plan):
                    for rank in (group[0], group[5]):
                        settings = LayoutSettings(comm_buffer_size_MB=mb, partition_strategy=rule,
                                                  overlap_sync=rank == group[0])
                        lay = ShardingLayout.build(metas, {None: group}, rank, settings, hier,
                                                   placement=shared)
                        want, want_plan = _plain(metas, {None: group}, rank, settings, hier)
                        with self.subTest(rule=rule, mb=mb, hier=hier is not None, rank=rank):
                            self.assertEqual(lay, want)
                            self.assertEqual(lay.step_plan(), want_plan)
                            self.assertEqual(lay.sync_stages(), want.sync_stages())
                        seen.add(tuple(b.owner for b in lay.muon_buckets))
        self.assertGreater(len(seen), 2)  # the configurations differ: a stale hit shows

    def test_rules_and_buffer_sizes_never_share_stages(self):
        metas = _metas(60)
        group = tuple(range(8))
        configs = [LayoutSettings(comm_buffer_size_MB=mb, partition_strategy=rule)
                   for rule in (PARTITION_DEVELOP, PARTITION_BALANCED)
                   for mb in (0.25, 1.0, 4.0, 256.0)]
        for rank in (0, 5):
            shared = FastPlacement()
            got = [ShardingLayout.build(metas, {None: group}, rank, s, placement=shared)
                   for s in configs]
            for settings, lay in zip(configs, got):
                want, _ = _plain(metas, {None: group}, rank, settings)
                with self.subTest(rank=rank, settings=settings):
                    self.assertEqual((lay.owners, lay.sync_stages()),
                                     (want.owners, want.sync_stages()))
            self.assertGreater(len({lay.sync_stages() for lay in got}), 2)


class TestDevelopOwnersPerBufferSize(unittest.TestCase):
    def _owners(self, shared, params, group, mb):
        owner_of, part, _ = shared.muon_layout(
            None, group, params, None,
            LayoutSettings(comm_buffer_size_MB=mb, partition_strategy=PARTITION_DEVELOP))
        return owner_of, part

    def test_each_buffer_size_gets_the_rule_run_at_that_size(self):
        params = tuple(ParamMeta(f"w{i:03d}", (512, 512), "bfloat16" if i % 3 else "float32",
                                 use_muon=True) for i in range(40))
        specs = [MatrixSpec(p.name, p.shape, p.dtype) for p in params]
        group = tuple(range(100, 116))
        shared = FastPlacement()
        for buffer_mb in (1.0, 2.0, 4.0, 64.0, 0.5, 1.0, 256.0, 3.0):
            with self.subTest(buffer_mb=buffer_mb):
                owners, part = self._owners(shared, params, group, buffer_mb)
                want = upstream_partition(specs, len(group), buffer_mb)
                self.assertEqual(owners, {n: group[i] for n, i in want.owners.items()})
                self.assertEqual(part.method, want.method)
                self.assertEqual(part.state_bytes, want.state_bytes)

    def test_sizes_with_the_same_caps_run_the_rule_once(self):
        params = tuple(ParamMeta(f"w{i}", (64 + 8 * i, 32), "float32", use_muon=True)
                       for i in range(12))
        shared = FastPlacement()
        with mock.patch.object(fast_layout, "partition_by_rule",
                               wraps=fast_layout.partition_by_rule) as rule:
            small = self._owners(shared, params, (0, 1, 2, 3), 0.001)[0]
            large = [self._owners(shared, params, (0, 1, 2, 3), mb)[0] for mb in (64, 256)]
        self.assertEqual(rule.call_count, 2)  # one active rank at 64 and 256 MB
        self.assertEqual(large[0], large[1])
        self.assertEqual(len(set(large[0].values())), 1)
        self.assertGreater(len(set(small.values())), 1)

    def test_the_balanced_rule_runs_once_across_buffer_sizes(self):
        params = tuple(ParamMeta(f"w{i}", (64 + 8 * i, 32), "float32", use_muon=True)
                       for i in range(12))
        shared = FastPlacement()
        with mock.patch.object(fast_layout, "partition_by_rule",
                               wraps=fast_layout.partition_by_rule) as rule:
            got = [shared.muon_layout(None, (0, 1, 2, 3), params, None, LayoutSettings(
                comm_buffer_size_MB=mb, partition_strategy=PARTITION_BALANCED))[0]
                for mb in (64, 256, 1024)]
        self.assertEqual(rule.call_count, 1)
        self.assertEqual(got, [got[0]] * 3)
        self.assertEqual(got[0], colour_muon_layout(
            None, (0, 1, 2, 3), params, None, LayoutSettings(
                partition_strategy=PARTITION_BALANCED))[0])


class TestBalancedOwnersUnderRankOrder(unittest.TestCase):
    def test_owners_and_loads_equal_the_rule_run_with_the_order(self):
        """The balanced rule for a rank order is the identity order's result renamed."""
        rng = random.Random(2026)
        shared = FastPlacement()
        for trial in range(60):
            nranks = rng.choice([2, 3, 5, 8, 16, 64])
            specs = fast_layout.HashedTuple(_specs(rng, rng.choice([3, 20, 150])))
            order = list(range(nranks))
            rng.shuffle(order)
            got = shared._partition(specs, nranks, tuple(order), PARTITION_BALANCED, 0.0, None)
            want = balanced_partition(list(specs), nranks, rank_order=order)
            with self.subTest(trial=trial, nranks=nranks, params=len(specs)):
                self.assertEqual(got.owners, want.owners)
                self.assertEqual(got.state_bytes, want.state_bytes)
                self.assertEqual(got.ns_cost, want.ns_cost)
                self.assertEqual(got, want)  # dtypes and method too

    def test_the_flat_and_hierarchical_owners_of_a_group_run_the_rule_once(self):
        params = tuple(ParamMeta(s.name, s.shape, s.dtype, None, True)
                       for s in _specs(random.Random(9), 40))
        plan = MuonCommConfig(ep=2, moe_sharding=4, pp=1, gpus_per_node=4).build_plan()
        group = tuple(plan.sharding_group_ranks(0))
        settings = LayoutSettings(partition_strategy=PARTITION_BALANCED)
        shared = FastPlacement()
        with mock.patch.object(fast_layout, "partition_by_rule",
                               wraps=fast_layout.partition_by_rule) as rule:
            flat = shared.muon_layout(None, group, params, None, settings)[0]
            hier = shared.muon_layout(None, group, params, plan, settings)[0]
        self.assertEqual(rule.call_count, 1)
        self.assertEqual(hier, colour_muon_layout(None, group, params, plan, settings)[0])
        self.assertEqual(set(flat), set(hier))

    def test_an_order_that_is_no_permutation_is_still_refused(self):
        with self.assertRaises(ValueError):
            FastPlacement()._partition(fast_layout.HashedTuple(_specs(random.Random(1), 5)), 4,
                                       (0, 1, 1, 2), PARTITION_BALANCED, 0.0, None)


class TestHierarchicalBucketsFromTheirOwners(unittest.TestCase):
    def test_buckets_equal_the_placement_run_on_the_hierarchical_owners(self):
        plan = MuonCommConfig(ep=4, moe_sharding=4, pp=1, gpus_per_node=4).build_plan()
        group = tuple(plan.sharding_group_ranks(0))
        params = tuple(ParamMeta(s.name, s.shape, s.dtype, None, True)
                       for s in _specs(random.Random(11), 120))
        shared = FastPlacement()
        for rule in RULES:
            for buffer_MB in (0.0, 0.05, 256.0):
                settings = LayoutSettings(comm_buffer_size_MB=buffer_MB, partition_strategy=rule)
                shared.muon_layout(None, group, params, None, settings)  # the flat one first
                got = shared.muon_layout(None, group, params, plan, settings)
                with self.subTest(rule=rule, buffer_MB=buffer_MB):
                    self.assertEqual(got, colour_muon_layout(None, group, params, plan, settings))
                    self.assertTrue(all(b.route == "hierarchical" for b in got[2]))

    def test_owners_that_are_no_renaming_of_the_flat_ones_are_placed_afresh(self):
        group = (0, 1, 2, 3)
        params = tuple(ParamMeta(s.name, s.shape, s.dtype, None, True)
                       for s in _specs(random.Random(11), 120))
        shared = FastPlacement()
        flat_owner_of, _, flat = shared.muon_layout(
            None, group, params, None, LayoutSettings(partition_strategy=PARTITION_BALANCED))
        self.assertEqual(set(flat_owner_of.values()), set(group))
        merged = {k: min(v, 1) for k, v in flat_owner_of.items()}  # two owners onto rank 1
        self.assertIsNone(shared._renamed_buckets(flat_owner_of, flat, merged))


if __name__ == "__main__":
    unittest.main()
