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
"""The cost model's times against the alpha-beta formulas worked out by hand.

Every expected figure below is derived in the comments from the rules in
``paddle_muon_ext.tools.cost_model``'s docstring (rings node by node, a
rooted chain is its ring minus one edge, a phase takes its largest group
latency plus the busiest rank's ``inter * beta_net + intra * beta_nvlink``)
and ``gloo_model``'s (reduce: ring reduce-scatter then slices to the root,
``p`` rounds; broadcast: binomial tree, ``ceil(log2 p)`` rounds) - not read
from the code's output. The four constants differ by orders of magnitude, so
a swapped beta, a hop taken from the wrong side of the root or the wrong
alpha changes the result by far more than the tolerance.
"""

from __future__ import annotations

import unittest

from paddle_muon_ext.tools.cost_model import AlphaBeta, CostPath

# alpha_nvlink, alpha_net, beta_nvlink, beta_net: distinct powers of ten
AV, AN, BV, BN = 1.0, 100.0, 1e-3, 1.0
AB = AlphaBeta(alpha_nvlink=AV, beta_nvlink=BV, alpha_net=AN, beta_net=BN)
S = 8.0  # bytes of the buffer


def _path(backend: str = "nccl", world: int = 4, gpn: int = 2) -> CostPath:
    return CostPath("by_hand", world, gpn, AB, backend=backend)


def _charge(path: CostPath, phase: str, kind: str, what: str, group, root: int) -> dict:
    path.rooted(path.phase(phase), kind, what, group, root, S, "dense")
    return path.summary()


class TestPhaseTimeByHand(unittest.TestCase):
    def test_intra_node_bytes_cost_nvlink_beta_and_inter_node_network_beta(self) -> None:
        # Reduce onto 0 inside node 0 ({0, 1}, gpn 2): two channels of S/2, each
        # the chain 1 -> 0, so rank 1 sends S over NVLink; channel 0's ring
        # [1, 0] minus the root's outgoing hop leaves one NVLink hop.
        res = _charge(_path(), "intra_node_reduce", "node", "reduce", (0, 1), 0)
        self.assertAlmostEqual(res["estimated_time_s"], AV + S * BV, places=9)
        # Reduce onto 2 across nodes ({0, 2}): one channel, the chain 0 -> 2
        # carries S over the network; one network hop.
        res = _charge(_path(), "cross_node_reduce", "same_card", "reduce", (0, 2), 2)
        self.assertAlmostEqual(res["estimated_time_s"], AN + S * BN, places=9)

    def test_the_busiest_rank_pays_each_link_at_its_own_beta(self) -> None:
        # One phase, rank 0 sending 2 B across and 1 B within its node: 2 * BN + 1 * BV
        # (swapped betas would give 2 * BV + 1 * BN).
        path = _path()
        ph = path.phase("p")
        ph.inter[0], ph.intra[0] = 2.0, 1.0
        ph.intra[1] = 3.0  # 3 * BV, far below rank 0
        self.assertAlmostEqual(ph.time(AB), 2 * BN + 1 * BV, places=12)


class TestRootedChainByHand(unittest.TestCase):
    """Group {0, 1, 2, 3} on 2 nodes of 2 (gpn 2): two channels of S/2.

    Channel 0 visits each node's ranks rotated by 1: 1 -> 0 -> 3 -> 2 -> 1
    (hops NVLink, net, NVLink, net); channel 1 rotated by 2: 0 -> 1 -> 2 -> 3 -> 0
    (NVLink, net, NVLink, net). Latency is charged on channel 0.
    """

    group = (0, 1, 2, 3)

    def test_reduce_drops_the_roots_outgoing_hop(self) -> None:
        # Reduce onto 0 ends at 0: ring minus 0 -> next.
        #   ch0 minus 0 -> 3: 3 -> 2 (NVLink), 2 -> 1 (net), 1 -> 0 (NVLink)
        #   ch1 minus 0 -> 1: 1 -> 2 (net), 2 -> 3 (NVLink), 3 -> 0 (net)
        # per rank (S/2 each): 0 sends nothing; 1, 2, 3 send S/2 across and S/2 within.
        # latency: ch0's hops 3->2, 2->1, 1->0 = AV + AN + AV.
        path = _path()
        res = _charge(path, "dense_reduce", "sharding", "reduce", self.group, 0)
        ph = path.phases["dense_reduce"]
        half = S / 2
        self.assertEqual(ph.inter, [0.0, half, half, half])
        self.assertEqual(ph.intra, [0.0, half, half, half])
        self.assertAlmostEqual(res["estimated_time_s"],
                               (2 * AV + AN) + half * BN + half * BV, places=9)
        self.assertEqual(res["inter_node_bytes"], 3 * half)

    def test_broadcast_drops_the_hop_into_the_root(self) -> None:
        # Broadcast from 0 starts at 0: ring minus prev -> 0.
        #   ch0 minus 1 -> 0: 0 -> 3 (net), 3 -> 2 (NVLink), 2 -> 1 (net)
        #   ch1 minus 3 -> 0: 0 -> 1 (NVLink), 1 -> 2 (net), 2 -> 3 (NVLink)
        # per rank: 0: S/2 across + S/2 within; 1: S/2 across; 2: both; 3: S/2 within.
        # latency: ch0's hops 0->3, 3->2, 2->1 = AN + AV + AN.
        path = _path()
        res = _charge(path, "dense_broadcast", "sharding", "broadcast", self.group, 0)
        ph = path.phases["dense_broadcast"]
        half = S / 2
        self.assertEqual(ph.inter, [half, half, half, 0.0])
        self.assertEqual(ph.intra, [half, 0.0, half, half])
        self.assertAlmostEqual(res["estimated_time_s"],
                               (AV + 2 * AN) + half * BN + half * BV, places=9)

    def test_a_root_on_the_second_node(self) -> None:
        # Reduce onto 3: ch0 minus 3 -> 2 (NVLink): 2 -> 1 (net), 1 -> 0 (NVLink),
        # 0 -> 3 (net); latency AN + AV + AN. ch1 minus 3 -> 0 (net): 0 -> 1, 1 -> 2,
        # 2 -> 3. Rank 0: S/2 across (ch0) + S/2 within (ch1); rank 1: S/2 within
        # (ch0) + S/2 across (ch1); rank 2: S/2 across (ch0) + S/2 within (ch1).
        path = _path()
        res = _charge(path, "dense_reduce", "sharding", "reduce", self.group, 3)
        ph = path.phases["dense_reduce"]
        half = S / 2
        self.assertEqual(ph.inter, [half, half, half, 0.0])
        self.assertEqual(ph.intra, [half, half, half, 0.0])
        self.assertAlmostEqual(res["estimated_time_s"],
                               (AV + 2 * AN) + half * BN + half * BV, places=9)


class TestGlooByHand(unittest.TestCase):
    def test_gloo_latency_is_the_network_alpha_across_nodes(self) -> None:
        # gloo reduce onto 0 over {0, 2} (two nodes): ring reduce-scatter, each
        # edge (0 -> 2, 2 -> 0) S/2, then 2 sends its S/2 slice to 0: rank 2
        # sends S, rank 0 S/2, all across; p = 2 rounds of the network alpha.
        path = _path("gloo")
        res = _charge(path, "cross_node_reduce", "same_card", "reduce", (0, 2), 0)
        self.assertEqual(path.phases["cross_node_reduce"].inter, [S / 2, 0.0, S, 0.0])
        self.assertAlmostEqual(res["estimated_time_s"], 2 * AN + S * BN, places=9)

    def test_gloo_latency_is_the_nvlink_alpha_inside_a_node(self) -> None:
        # the same on {0, 1} (one node): 2 rounds of the NVLink alpha, rank 1 sends S
        path = _path("gloo")
        res = _charge(path, "intra_node_reduce", "node", "reduce", (0, 1), 0)
        self.assertEqual(path.phases["intra_node_reduce"].intra, [S / 2, S, 0.0, 0.0])
        self.assertAlmostEqual(res["estimated_time_s"], 2 * AV + S * BV, places=9)

    def test_gloo_broadcast_over_both_nodes(self) -> None:
        # binomial tree from 0 over [0, 1, 2, 3]: round 1 0 -> 1 (NVLink), round 2
        # 0 -> 2 and 1 -> 3 (net): 2 rounds, messages cross nodes -> network alpha;
        # rank 0 sends S within and S across: S * (BV + BN).
        path = _path("gloo")
        res = _charge(path, "dense_broadcast", "sharding", "broadcast", (0, 1, 2, 3), 0)
        ph = path.phases["dense_broadcast"]
        self.assertEqual(ph.inter, [S, S, 0.0, 0.0])
        self.assertEqual(ph.intra, [S, 0.0, 0.0, 0.0])
        self.assertAlmostEqual(res["estimated_time_s"], 2 * AN + S * (BV + BN), places=9)


if __name__ == "__main__":
    unittest.main()


def _op(phase: str, op: str, group, root, nbytes: float, coalesced: bool = False):
    from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.step_plan import CommOp

    return CommOp("reduce_gradients", phase, op, group, root, "float32", int(nbytes // 4), None,
                  coalesced, nbytes)


class TestRunsAndAllReduceByHand(unittest.TestCase):
    def test_a_run_of_one_buckets_chunks_costs_what_its_chunks_cost_one_by_one(self) -> None:
        # Three flat reduces onto rank 0 of {0, 1, 2, 3} (two nodes of two):
        # channel 0's ring is [1, 0, 3, 2]; each chain leaves out 0 -> 3 (a
        # network hop), so each op pays 2 AN + 2 AV - AN = 102; three: 306.
        group = (0, 1, 2, 3)
        sizes = (8.0, 16.0, 24.0)
        shared = _path(world=4)
        shared.replay((op, op.payload) for op in
                      [_op("reduce_to_owner", "reduce", group, 0, n) for n in sizes])
        # the same ops on three equal but distinct group tuples: never one run
        apart = _path(world=4)
        apart.replay((op, op.payload) for op in
                     [_op("reduce_to_owner", "reduce", tuple(list(group)), 0, n) for n in sizes])
        got, want = shared.summary(), apart.summary()
        self.assertEqual(got["collectives_per_step"]["sharding"], 3)
        self.assertEqual(got["coalesced_launches_per_step"]["sharding"], 3)
        for key in ("estimated_time_s", "inter_node_bytes", "intra_node_bytes"):
            self.assertAlmostEqual(got[key], want[key], delta=abs(want[key]) * 1e-12, msg=key)
        # latency alone (no beta): the three chains' 306
        no_beta = CostPath("latency", 4, 2, AlphaBeta(alpha_nvlink=AV, beta_nvlink=0.0,
                                                      alpha_net=AN, beta_net=0.0))
        no_beta.replay((op, op.payload) for op in
                       [_op("reduce_to_owner", "reduce", group, 0, n) for n in sizes])
        self.assertAlmostEqual(no_beta.summary()["estimated_time_s"], 306.0, places=9)

    def test_an_all_reduce_is_a_reduce_scatter_then_an_all_gather(self) -> None:
        # {0, 1, 2, 3} on two nodes of two: two channels; channel 0's ring
        # [1, 0, 3, 2] has hops AV, AN, AV and the closing AN, so one pass
        # pays AV + AN + AV = 102; each rank sends one edge per channel of
        # S * 3/4 / 2 = 3 B, one of its two across nodes: 3 BN + 3 BV per pass.
        path = _path(world=4)
        op = _op("clip_all_reduce", "all_reduce", (0, 1, 2, 3), None, S)
        path.replay([(op, op.payload)])
        res = path.summary()
        self.assertAlmostEqual(res["estimated_time_s"], 2 * (102.0 + 3 * BN + 3 * BV), places=9)
        self.assertEqual(res["collectives_per_step"]["sharding"], 1)
        self.assertEqual(list(res["estimated_time_phases_s"]), ["all_reduce"])
        # element-wise, not Muon traffic
        self.assertEqual(res["estimated_muon_time_s"], 0.0)
        self.assertEqual(res["inter_node_bytes"], 0.0)
        self.assertAlmostEqual(res["inter_node_bytes_all"], 2 * 4 * 3.0, places=9)

    def test_gloo_charges_an_all_reduce_as_its_ring(self) -> None:
        path = _path("gloo", world=4)
        op = _op("clip_all_reduce", "all_reduce", (0, 1, 2, 3), None, S)
        path.replay([(op, op.payload)])
        res = path.summary()
        # gloo's ring all-reduce: every ring edge 2 * S * 3/4 = 12 B
        self.assertAlmostEqual(res["inter_node_bytes_all"] + res["intra_node_bytes_all"],
                               4 * 12.0, places=9)
        self.assertEqual(res["collectives_per_step"]["sharding"], 1)
