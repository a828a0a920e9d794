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
"""The flat gloo Muon reduce and broadcast share their owners: few owners
save launches but load the binomial trees' roots. The pair's floor
(``gloo_flat_pair_floor_s``) by hand on four ranks over two nodes."""

from __future__ import annotations

import unittest

from paddle_muon_ext.tools import cost_bound as cb
from paddle_muon_ext.tools.cost_model import AlphaBeta

# a 1 TB/s network, 100 GB/s NVLink, 1 ms a network round; 1 GB of Muon bytes
AB = AlphaBeta(alpha_nvlink=1e-5, beta_nvlink=1e-11, alpha_net=1e-3, beta_net=1e-12)
S = 1e9
# ranks 0, 1 on node 0 and 2, 3 on node 1
G = cb.GroupLoad(4, 2, 2, S, 1, (0, 1, 2, 3), 2)


class TestGlooFlatPairByHand(unittest.TestCase):
    # Reduce (any root, e.g. 0): ring 0->1 (in), 1->2 (net), 2->3 (in), 3->0 (net)
    # of 3/4 S each, slices of S/4 to the root from 1 (in), 2 and 3 (net):
    # (1.5 + 0.25) beta_nvlink + (1.5 + 0.5) beta_net = 19.5e-12 s a byte, over
    # 4 ranks: 4.875 ms; but the ring is the same whatever the root, and its
    # in-node senders 0 and 2 send 3/4 S at beta_nvlink each: 7.5 ms.
    # Broadcast: the cheapest tree is rooted at 1 or 3
    # (1->2, 1->3, 2->0: all across) 3e-12 s a byte, over 4 ranks 0.75 ms;
    # the cheapest root's own sends (1->2, 1->3) 2e-12 s a byte: 2 ms for S.
    # Rounds: 4 a reduce, 2 a broadcast, at 1 ms.
    def test_the_pair_floor_by_hand(self) -> None:
        # m = 1: 6 ms + 7.5 + max(0.75, 2) = 15.5 ms;
        # m = 2: 12 ms + 7.5 + max(0.75, 1) = 20.5 ms (more owners cost more)
        self.assertAlmostEqual(cb.gloo_flat_pair_floor_s(G, AB), 15.5e-3, places=12)

    def test_two_dtypes_pay_two_launches_at_least(self) -> None:
        g = cb.GroupLoad(4, 2, 2, S, 2, (0, 1, 2, 3), 2)
        # m = 1 or 2: 12 ms of rounds; m = 2 halves the roots' 2 ms
        self.assertAlmostEqual(cb.gloo_flat_pair_floor_s(g, AB), 20.5e-3, places=12)

    def test_the_step_bound_takes_the_pair_over_the_separate_floors(self) -> None:
        fam = {"moe_reduce": [(4, [G])], "moe_broadcast": [(4, [G])]}
        out = cb.step_bound(fam, AB, "gloo")
        # separately: reduce 4 ms + 7.5 (its ring's busiest rank), broadcast
        # 2 ms + 0.75 (its p roots spread the bytes): 14.25 ms; one owner is 15.5 ms
        self.assertAlmostEqual(out["families_s"]["moe_reduce"], 11.5e-3, places=12)
        self.assertAlmostEqual(out["bound_s"], 15.5e-3, places=12)

    def test_nccl_is_not_charged_the_gloo_pair(self) -> None:
        fam = {"moe_reduce": [(4, [G])], "moe_broadcast": [(4, [G])]}
        self.assertLess(cb.step_bound(fam, AB, "nccl")["bound_s"], 12.875e-3)

    def test_one_rank_or_no_bytes_costs_nothing(self) -> None:
        self.assertEqual(cb.gloo_flat_pair_floor_s(cb.GroupLoad(1, 1, 1, S), AB), 0.0)
        self.assertEqual(cb.gloo_flat_pair_floor_s(cb.GroupLoad(4, 2, 2, 0.0), AB), 0.0)


if __name__ == "__main__":
    unittest.main()
