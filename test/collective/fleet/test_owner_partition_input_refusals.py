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
"""The owner rules refuse malformed matrix specs naming the bad value, and
the per-matrix cost helpers count what their docstrings say.

Both rules (develop's ``upstream_partition`` and ``balanced_partition``) share
one input check; each row below is refused the same way by both, before any
owner is chosen. Sizes are worked out by hand from the shapes.
"""

from __future__ import annotations

import unittest
from types import SimpleNamespace

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.owners import (
    MatrixSpec,
    OwnerPartition,
    newton_schulz_cost,
    optimizer_state_bytes,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.owners import (
    balanced_partition,
    upstream_partition,
)
from paddle_muon_ext.tools.cost_model import max_over_mean

RULES = (("balanced", lambda specs: balanced_partition(specs, 2)),
         ("upstream_greedy", lambda specs: upstream_partition(specs, 2)))


class TestSpecRefusals(unittest.TestCase):
    def test_each_malformed_spec_is_refused_by_both_rules_naming_the_value(self):
        good = MatrixSpec("w0", (4, 8))
        rows = [
            # (specs, error type, message pattern)
            (None, TypeError, r"specs must be a sequence of MatrixSpec, got None"),
            ([good, SimpleNamespace(name="x", shape=(2, 2))], TypeError,
             r"MatrixSpec-like objects \(name, shape, dtype\)"),
            ([SimpleNamespace(name="", shape=(2, 2), dtype="float32")], TypeError,
             r"spec name must be a non-empty str, got ''"),
            ([SimpleNamespace(name=7, shape=(2, 2), dtype="float32")], TypeError,
             r"spec name must be a non-empty str, got 7"),
            ([good, SimpleNamespace(name="w0", shape=(2, 2), dtype="float32")], ValueError,
             r"duplicate parameter name in specs: 'w0'"),
            ([SimpleNamespace(name="s", shape=5, dtype="float32")], TypeError,
             r"shape must be a sequence of ints, got 5"),
            ([SimpleNamespace(name="s", shape=(2, True), dtype="float32")], TypeError,
             r"shape must be a sequence of ints, got \(2, True\)"),
            ([SimpleNamespace(name="s", shape=(2, "3"), dtype="float32")], TypeError,
             r"shape must be a sequence of ints"),
            ([SimpleNamespace(name="s", shape=[2, -3], dtype="float32")], ValueError,
             r"shape has a negative dim: \[2, -3\]"),
            ([SimpleNamespace(name="s", shape=[6], dtype="float32")], ValueError,
             r"needs at least 2 dims \(got shape \[6\]\).*AdamW"),
        ]
        for specs, error, pattern in rows:
            for rule, run in RULES:
                with self.subTest(rule=rule, specs=repr(specs)[:60]):
                    with self.assertRaisesRegex(error, pattern):
                        run(specs)

    def test_spec_like_objects_with_list_shapes_are_accepted_as_tuples(self):
        # a list shape and a non-MatrixSpec object are canonicalised, not refused
        specs = [SimpleNamespace(name="a", shape=[3, 5], dtype="float32"),
                 SimpleNamespace(name="b", shape=[2, 3, 4], dtype="float32")]
        for rule, run in RULES:
            with self.subTest(rule=rule):
                part = run(specs)
                self.assertEqual(sorted(part.owners), ["a", "b"])
                self.assertTrue(all(0 <= r < 2 for r in part.owners.values()))


class TestCostHelpers(unittest.TestCase):
    def test_sizes_and_costs_match_hand_counts(self):
        # [3, 5] bf16: state fp32 momentum 60 B + master 60 B
        bf16 = MatrixSpec("a", (3, 5), "bfloat16")
        self.assertEqual(optimizer_state_bytes(bf16), 120)
        self.assertEqual(optimizer_state_bytes(bf16, multi_precision=False), 60)
        # fp32 keeps no master weight
        self.assertEqual(optimizer_state_bytes(MatrixSpec("b", (3, 5))), 60)
        # max(m, n) * min(m, n)^2, times the leading (expert) dims
        self.assertEqual(newton_schulz_cost((3, 5)), 5 * 3 * 3)
        self.assertEqual(newton_schulz_cost((5, 3)), 5 * 3 * 3)
        self.assertEqual(newton_schulz_cost((2, 3, 4)), 2 * 4 * 3 * 3)
        with self.assertRaisesRegex(ValueError, "needs at least 2 dims"):
            newton_schulz_cost((7,))

    def test_owner_partition_ratios_and_rank_range(self):
        part = OwnerPartition(nranks=3, owners={"a": 0, "b": 0, "c": 2},
                              state_bytes=[30, 0, 30], ns_cost=[2.0, 0.0, 1.0])
        self.assertEqual(part.params_of(0), ["a", "b"])
        self.assertEqual(part.params_of(1), [])
        self.assertEqual(part.empty_ranks(), [1])
        # max * n / total: 30 * 3 / 60 and 2 * 3 / 3
        self.assertAlmostEqual(max_over_mean(part.state_bytes), 1.5)
        self.assertAlmostEqual(max_over_mean(part.ns_cost), 2.0)
        for bad in (-1, 3):
            with self.assertRaisesRegex(ValueError, f"rank {bad} out of range for nranks=3"):
                part.params_of(bad)
        # nothing to balance reads as perfectly even, not as a division by zero
        idle = OwnerPartition(nranks=2, owners={}, state_bytes=[0, 0], ns_cost=[])
        self.assertEqual(max_over_mean(idle.state_bytes), 1.0)
        self.assertEqual(max_over_mean(idle.ns_cost), 1.0)


if __name__ == "__main__":
    unittest.main()
