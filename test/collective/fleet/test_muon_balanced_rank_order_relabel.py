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
"""The layout's balanced owners under a rank order are the rule's own result,
and its hierarchical buckets are the ones placed from those owners.

The placement computes the balanced rule once (identity order) and renames
group position ``p`` to ``rank_order[p]`` for the hierarchical path's spread
order. That is only right if the rule sees ranks solely through their order
position; these tests hold the placement's result to
``balanced_partition(..., rank_order=order)`` computed directly, on inputs
full of ties (equal matrices, several dtypes, capped classes, expert stacks).
"""

from __future__ import annotations

import random
import unittest
from unittest import mock

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import layout as placement
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.owners import MatrixSpec
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.owners import (
    balanced_partition,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.layout import (
    LayoutSettings,
    ParamMeta,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.settings import (
    PARTITION_BALANCED,
    PARTITION_DEVELOP,
)
from paddle_muon_ext.tools.args import MuonCommConfig


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


class TestBalancedOwnersUnderRankOrder(unittest.TestCase):
    def setUp(self):
        placement._partition_cached.cache_clear()
        self.addCleanup(placement._partition_cached.cache_clear)

    def test_owners_and_loads_equal_the_rule_run_with_the_order(self):
        rng = random.Random(2026)
        for trial in range(60):
            nranks = rng.choice([2, 3, 5, 8, 16, 64])
            specs = _specs(rng, rng.choice([3, 20, 150]))
            order = list(range(nranks))
            rng.shuffle(order)
            got = placement._partition_cached(specs, nranks, tuple(order),
                                              PARTITION_BALANCED, 0.0, None)
            want = balanced_partition(list(specs), nranks, rank_order=order)
            with self.subTest(trial=trial, nranks=nranks, params=len(specs)):
                self.assertEqual(got.owners, want.owners)
                self.assertEqual(got.state_bytes, want.state_bytes)
                self.assertEqual(got.ns_cost, want.ns_cost)
                self.assertEqual(got.summary(), want.summary())

    def test_two_orders_of_one_group_run_the_rule_once(self):
        specs = _specs(random.Random(7), 40)
        with mock.patch.object(placement, "balanced_partition",
                               wraps=placement.balanced_partition) as rule:
            flat = placement._partition_cached(specs, 8, None, PARTITION_BALANCED, 0.0, None)
            hier = placement._partition_cached(specs, 8, (0, 4, 1, 5, 2, 6, 3, 7),
                                               PARTITION_BALANCED, 0.0, None)
        self.assertEqual(rule.call_count, 1)
        self.assertEqual(sorted(flat.state_bytes), sorted(hier.state_bytes))

    def test_the_flat_and_hierarchical_owners_of_a_group_run_the_rule_once(self):
        # through the callers' entry point (the cache keys every argument as
        # passed: a call that omits a default would miss the other's entry)
        specs = _specs(random.Random(9), 40)
        plan = MuonCommConfig(ep=2, moe_sharding=4, pp=1, gpus_per_node=4).build_plan()
        group = tuple(plan.sharding_group_ranks(0))
        with mock.patch.object(placement, "balanced_partition",
                               wraps=placement.balanced_partition) as rule:
            flat, _ = placement.assign_muon_owners(specs, group, None, PARTITION_BALANCED)
            hier, _ = placement.assign_muon_owners(specs, group, plan, PARTITION_BALANCED)
        self.assertEqual(rule.call_count, 1)
        self.assertEqual(set(flat), set(hier))

    def test_an_order_that_is_no_permutation_is_still_refused(self):
        with self.assertRaises(ValueError):
            placement._partition_cached(_specs(random.Random(1), 5), 4, (0, 1, 1, 2),
                                        PARTITION_BALANCED, 0.0, None)


class TestHierarchicalBucketsFromTheirOwners(unittest.TestCase):
    def setUp(self):
        placement.colour_muon_layout.cache_clear()
        self.addCleanup(placement.colour_muon_layout.cache_clear)

    def _params(self) -> tuple:
        rng = random.Random(11)
        return tuple(ParamMeta(s.name, s.shape, s.dtype, None, True)
                     for s in _specs(rng, 120))

    def test_buckets_equal_the_placement_run_on_the_hierarchical_owners(self):
        plan = MuonCommConfig(ep=4, moe_sharding=4, pp=1, gpus_per_node=4).build_plan()
        group = tuple(plan.sharding_group_ranks(0))
        params = self._params()
        for rule in (PARTITION_DEVELOP, PARTITION_BALANCED):
            for buffer_MB in (0.0, 0.05, 256.0):
                settings = LayoutSettings(comm_buffer_size_MB=buffer_MB,
                                          partition_strategy=rule)
                owner_of, _, got = placement.colour_muon_layout(None, group, params, plan,
                                                                 settings)
                want = placement.muon_bucket_specs(None, group, params, owner_of, True,
                                                   settings)
                with self.subTest(rule=rule, buffer_MB=buffer_MB):
                    self.assertEqual(got, want)
                    self.assertTrue(all(b.route == "hierarchical" for b in got))

    def test_owners_that_are_no_renaming_of_the_flat_ones_are_placed_afresh(self):
        group = (0, 1, 2, 3)
        params = self._params()
        flat_owner_of, _, flat = placement.colour_muon_layout(
            None, group, params, None, LayoutSettings(partition_strategy=PARTITION_BALANCED))
        self.assertEqual(set(flat_owner_of.values()), set(group))
        merged = {k: min(v, 1) for k, v in flat_owner_of.items()}  # two owners onto rank 1
        self.assertIsNone(placement._renamed_buckets(flat_owner_of, flat, merged))


if __name__ == "__main__":
    unittest.main()
