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
"""Cost-bound floors worked by hand: a ring floor pays each link's own beta,
also where the in-node link is the slower one; an in-node hop pays the
cheaper alpha (the network's where that is cheaper); a group placed unevenly
over nodes pays the hops of its fullest node."""

from __future__ import annotations

import unittest

from paddle_muon_ext.tools import cost_bound as cb
from paddle_muon_ext.tools.cost_model import AlphaBeta


class TestRingBetas(unittest.TestCase):
    def test_ring_intra_node_bytes_pay_the_nvlink_beta_even_when_it_is_slower(self):
        # 4 ranks on 2 nodes, S = 1000 B: each ring edge carries 3/4 S = 750 B,
        # 2 edges cross nodes (1500 B), 2 stay inside them (1500 B)
        g = cb.GroupLoad(ranks=4, nodes=2, per_node=2, nbytes=1000.0)
        slow_nvlink = AlphaBeta(alpha_nvlink=1.0, beta_nvlink=1.0, alpha_net=1.0,
                                beta_net=1e-3)
        self.assertEqual(cb.ring_link_bytes(g), (1500.0, 1500.0))
        self.assertAlmostEqual(cb.bandwidth_floor_s(g, slow_nvlink, ring=True),
                               1500 * 1e-3 + 1500 * 1.0, places=9)
        # the non-ring floor may route in-node bytes over the cheaper link
        # (n - 1) S = 1000 B across nodes, (p - n) S = 2000 B at min(beta)
        self.assertAlmostEqual(cb.bandwidth_floor_s(g, slow_nvlink), 1000 * 1e-3 + 2000 * 1e-3,
                               places=9)


    def test_in_node_hops_pay_the_cheaper_alpha_even_when_it_is_the_network(self):
        # 4 ranks on 2 nodes (2 each): one node cut, one in-node hop at min(alpha)
        g = cb.GroupLoad(ranks=4, nodes=2, per_node=2, nbytes=1000.0)
        slow_nvlink = AlphaBeta(alpha_nvlink=10.0, beta_nvlink=1e-3, alpha_net=1.0,
                                beta_net=1.0)
        self.assertAlmostEqual(cb.latency_floor_s(g, slow_nvlink), 1.0 + 1.0, places=9)
        self.assertAlmostEqual(cb.latency_floor_s(g, slow_nvlink, "gloo"), 1.0, places=9)


class TestUnevenPlacement(unittest.TestCase):
    def test_a_group_split_two_and_one_over_nodes_has_two_on_its_fullest_node(self):
        class Plan:
            gpus_per_node = 2

            @staticmethod
            def sharding_group_ranks(stage):
                return (0, 1, 2)  # node 0 holds ranks 0 and 1, node 1 rank 2

            @staticmethod
            def moe_sharding_ranks(rank):
                return (rank,)

        meta = type("Meta", (), {"nbytes": 8.0, "use_muon": True, "colour": None})()
        families = cb.layout_families(Plan(), [[meta]])
        size, (group,) = families["dense_reduce"][0]
        self.assertEqual(size, 3)
        self.assertEqual(group, cb.GroupLoad(ranks=3, nodes=2, per_node=2, nbytes=8.0))
        ab = AlphaBeta(alpha_nvlink=1.0, beta_nvlink=1e-3, alpha_net=100.0, beta_net=1.0)
        # one node cut (alpha_net) and one hop inside the fuller node (min alpha)
        self.assertAlmostEqual(cb.latency_floor_s(group, ab), 100.0 + 1.0, places=9)


if __name__ == "__main__":
    unittest.main()
