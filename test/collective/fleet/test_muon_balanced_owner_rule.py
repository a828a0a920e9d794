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
"""The balanced owner rule as documented, on hand-sized inputs (pure functions).

A minority dtype class is spread over ``ceil`` of its share of ranks, and
equal matrices are placed by name, then by ``rank_order``, whatever the
input order.
"""

from __future__ import annotations

import math
import unittest
from fractions import Fraction

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.owners import (
    MatrixSpec,
    newton_schulz_cost,
    optimizer_state_bytes,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.owners import (
    balanced_partition,
)


class TestBalancedPartitionRule(unittest.TestCase):
    """The documented rule of the balanced partition, on hand-sized inputs."""

    def test_minority_class_owner_cap_is_the_ceil_of_its_share(self):
        # Bug: floor instead of ceil (or one owner too many). 13 bf16 and 3 fp32
        # equal matrices over 8 ranks: fp32 holds 3/16 of the Newton-Schulz cost,
        # i.e. 1.5 ranks' share, so exactly 2 ranks may own fp32 matrices.
        specs = [MatrixSpec(f"bf16.{i:02d}", (64, 64), "bfloat16") for i in range(13)]
        specs += [MatrixSpec(f"fp32.{i}", (64, 64), "float32") for i in range(3)]
        nranks = 8

        def share(names_of, weight):
            total = sum(weight(s) for s in specs)
            return Fraction(sum(weight(s) for s in specs if names_of(s)) * nranks, total)

        fp32 = lambda s: s.dtype == "float32"  # noqa: E731
        load = max(share(fp32, optimizer_state_bytes),
                   share(fp32, lambda s: Fraction(newton_schulz_cost(s.shape))))
        self.assertEqual(load, Fraction(3, 2), "the fp32 class should be 1.5 ranks' share")
        owners = balanced_partition(specs, nranks).owners
        fp32_owners = {owners[s.name] for s in specs if fp32(s)}
        self.assertEqual(len(fp32_owners), math.ceil(load),
                         f"fp32 matrices on ranks {sorted(fp32_owners)}; the cap is "
                         f"ceil({load}) = {math.ceil(load)}")

    def test_equal_loads_tie_break_by_name_then_rank_order(self):
        # Bug: ties broken by input order, or rank_order ignored / reversed.
        names = ["m.a", "m.b", "m.c", "m.d"]
        rank_order = [2, 0, 3, 1]
        for specs in ([MatrixSpec(n, (32, 32), "float32") for n in names],
                      [MatrixSpec(n, (32, 32), "float32") for n in reversed(names)]):
            owners = balanced_partition(specs, 4, rank_order=rank_order).owners
            self.assertEqual([owners[n] for n in names], rank_order,
                             "equal matrices in name order go to the ranks in rank_order")
        default = balanced_partition([MatrixSpec(n, (32, 32), "float32") for n in names], 4)
        self.assertEqual([default.owners[n] for n in names], [0, 1, 2, 3])


if __name__ == "__main__":
    unittest.main()
