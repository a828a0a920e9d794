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
"""The step-time lower bound (``tools.cost_bound``) by hand, and below every estimate.

The by-hand figures follow the derivation in ``cost_model``'s docstring
("Lower bound"): a group of ``p`` ranks on ``n`` nodes (at most ``k`` on one)
moving ``S`` bytes sends at least ``(n - 1) S`` across nodes and ``(p - n) S``
more, spread over the stage's ranks, and pays one launch of ``(n - 1)
alpha_net + (k - 1) min(alpha)``. The constants are distinct powers of ten,
so a swapped beta or alpha, a missing ``- 1`` or a mean over the wrong set
of ranks moves the result far beyond the tolerance.
"""

from __future__ import annotations

import unittest
from types import SimpleNamespace

from paddle_muon_ext.tools import cost_bound as cb
from paddle_muon_ext.tools import recommend
from paddle_muon_ext.tools.args import MuonCommConfig
from paddle_muon_ext.tools.cost_model import AlphaBeta
from paddle_muon_ext.tools.plan import compute_plan
from paddle_muon_ext.tools.presets import ParamSpec, get_preset

AV, AN, BV, BN = 1.0, 100.0, 1e-3, 1.0
AB = AlphaBeta(alpha_nvlink=AV, beta_nvlink=BV, alpha_net=AN, beta_net=BN)


class _TwoByTwo:
    """Two nodes of two cards, one stage; moe_sharding groups {0, 2} and {1, 3}."""

    gpus_per_node = 2

    @staticmethod
    def sharding_group_ranks(stage):
        assert stage == 0
        return (0, 1, 2, 3)

    @staticmethod
    def moe_sharding_ranks(rank):
        return (0, 2) if rank % 2 == 0 else (1, 3)


def _meta(nbytes, use_muon, expert):
    return SimpleNamespace(nbytes=nbytes, use_muon=use_muon,
                           colour="moe_expert" if expert else None)


# dense Muon 10 B, expert Muon 6 B, other dense 4 B, other expert 2 B
METAS = [_meta(7, True, False), _meta(3, True, False), _meta(6, True, True),
         _meta(4, False, False), _meta(2, False, True)]


class TestBoundByHand(unittest.TestCase):
    def test_one_group_floors(self) -> None:
        g = cb.GroupLoad(ranks=4, nodes=2, per_node=2, nbytes=8.0)
        # (n - 1) S = 8 across nodes, (p - n) S = 16 inside them
        self.assertEqual(cb.link_floor_bytes(g), (8.0, 16.0))
        # 8 B at beta_net 1 + 16 B at beta_nvlink 1e-3
        self.assertAlmostEqual(cb.bandwidth_floor_s(g, AB), 8.016, places=12)
        # one node cut (100) and one hop inside a node (1)
        self.assertAlmostEqual(cb.latency_floor_s(g, AB), 101.0, places=12)
        # gloo: one round at the cheaper alpha
        self.assertAlmostEqual(cb.latency_floor_s(g, AB, "gloo"), 1.0, places=12)

    def test_intra_node_bytes_pay_the_cheaper_beta(self) -> None:
        slow_nvlink = AlphaBeta(alpha_nvlink=AV, beta_nvlink=10.0, alpha_net=AN, beta_net=BN)
        g = cb.GroupLoad(4, 2, 2, 8.0)
        # 8 B at 1 + 16 B at min(1, 10) = 1
        self.assertAlmostEqual(cb.bandwidth_floor_s(g, slow_nvlink), 24.0, places=12)

    def test_a_lone_rank_or_no_bytes_costs_nothing(self) -> None:
        for g in (cb.GroupLoad(1, 1, 1, 8.0), cb.GroupLoad(4, 2, 2, 0.0)):
            self.assertEqual(cb.link_floor_bytes(g), (0.0, 0.0))
            self.assertEqual(cb.bandwidth_floor_s(g, AB), 0.0)
            self.assertEqual(cb.latency_floor_s(g, AB), 0.0)

    def test_unknown_backend_is_refused(self) -> None:
        with self.assertRaisesRegex(ValueError, "unknown backend 'mpi'"):
            cb.latency_floor_s(cb.GroupLoad(2, 2, 1, 1.0), AB, "mpi")

    def test_family_takes_the_largest_latency_and_the_busiest_stage_mean(self) -> None:
        stage_a = (4, [cb.GroupLoad(4, 2, 2, 8.0)])  # 8.016 / 4 ranks = 2.004
        stage_b = (2, [cb.GroupLoad(2, 2, 1, 8.0)])  # 8 * 1 / 2 ranks = 4
        lat, bw = cb.family_floor_s([stage_a, stage_b], AB)
        self.assertAlmostEqual(lat, 101.0, places=12)  # stage a's 100 + 1 beats b's 100
        self.assertAlmostEqual(bw, 4.0, places=12)
        self.assertEqual(cb.family_floor_s([], AB), (0.0, 0.0))

    def test_groups_sharing_a_stage_add_up_over_its_ranks(self) -> None:
        # the sharding group (8.016) and two moe groups of 2 ranks on 2 nodes
        # (4 B each, all across nodes: 4 each), all sent by the same 4 ranks
        stage = (4, [cb.GroupLoad(4, 2, 2, 8.0), cb.GroupLoad(2, 2, 1, 4.0),
                     cb.GroupLoad(2, 2, 1, 4.0)])
        self.assertAlmostEqual(cb.family_floor_s([stage], AB)[1], 16.016 / 4, places=12)

    def test_layout_families_of_two_by_two(self) -> None:
        fam = cb.layout_families(_TwoByTwo(), [METAS])
        self.assertEqual(set(fam), set(cb.FAMILIES))
        dense, moe = cb.GroupLoad(4, 2, 2, 10.0), cb.GroupLoad(2, 2, 1, 6.0)
        for name in ("dense_reduce", "dense_broadcast"):
            self.assertEqual(fam[name], [(4, [dense])])
        for name in ("moe_reduce", "moe_broadcast"):
            self.assertEqual(fam[name], [(4, [moe, moe])])
        other = [cb.GroupLoad(4, 2, 2, 4.0), cb.GroupLoad(2, 2, 1, 2.0),
                 cb.GroupLoad(2, 2, 1, 2.0)]
        for name in ("reduce_scatter", "all_gather"):
            self.assertEqual(fam[name], [(4, other)])

    def test_step_bound_of_two_by_two(self) -> None:
        res = cb.step_bound(cb.layout_families(_TwoByTwo(), [METAS]), AB)
        # dense: 101 + (10 * 1 + 20 * 1e-3) / 4 = 103.505
        # (the flat route with one root: 102 + 10 * (1 + 1e-3) / 2 = 107.005 is dearer)
        # moe (flat only): one root, and the other rank sends all 6 B across:
        # 100 + 6 = 106; two roots, two chains: 200 + 6 / 2 = 203
        # reduce-scatter as NCCL rings: the sharding group's 4 B cross 2 node
        # boundaries at 3/4 * 4 = 3 B each (6 B) and 2 NVLink edges (6 B); each
        # moe group's 2 B cross 2 boundaries at 1/2 * 2 = 1 B (2 B); latency:
        # the sharding group's ring hops but the closing one, 1 node cut (100)
        # and 2 in-node hops (1 each): 102 + (6 + 6e-3 + 2 + 2) / 4 = 104.5015
        for name, want in (("dense_reduce", 103.505), ("moe_reduce", 106.0),
                           ("moe_broadcast", 106.0), ("reduce_scatter", 104.5015)):
            self.assertAlmostEqual(res["families_s"][name], want, places=9)
        self.assertAlmostEqual(res["bound_s"], 2 * (103.505 + 106.0 + 104.5015), places=9)
        # inter-node bytes: dense 10, moe 6 + 6, rings 6 + 2 + 2; each twice
        self.assertAlmostEqual(res["inter_node_bytes"], 64.0, places=9)

    def test_gloo_reduce_scatter_is_its_ring_all_reduce(self) -> None:
        res = cb.step_bound(cb.layout_families(_TwoByTwo(), [METAS]), AB, "gloo")
        # gloo's reduce-scatter is a ring all-reduce in rank order: twice round
        # the ring. The sharding group's 4 B: 4 edges of 2 * 3/4 * 4 = 6 B, 2 of
        # them across nodes (1 -> 2 and 3 -> 0); each moe group's 2 B: 2 edges of
        # 2 * 1/2 * 2 = 2 B, both across. The ring is fixed, so the busiest rank
        # exactly: rank 1 (or 3) sends 6 B + 2 B across at beta_net 1 = 8 (the
        # mean over the stage would be (12.012 + 8) / 4 = 5.003); latency
        # 2 (p - 1) rounds across nodes: 6 * 100 = 600
        self.assertAlmostEqual(res["families_s"]["reduce_scatter"], 600 + 8.0, places=9)
        # the all-gather once round: 3 rounds (300) + rank 1's 3 B + 1 B across
        self.assertAlmostEqual(res["families_s"]["all_gather"], 300 + 4.0, places=9)
        # inter-node bytes: Muon floors 10 + 10 + 12 + 12, rings 12 + 4 + 4 and 6 + 2 + 2
        self.assertAlmostEqual(res["inter_node_bytes"], 74.0, places=9)

    def test_ring_bytes_inside_one_node(self) -> None:
        # 4 ranks on one node: 4 edges of 3/4 * 8 = 6 B, none across nodes
        self.assertEqual(cb.ring_link_bytes(cb.GroupLoad(4, 1, 4, 8.0)), (0.0, 24.0))
        self.assertEqual(cb.ring_link_bytes(cb.GroupLoad(1, 1, 1, 8.0)), (0.0, 0.0))


class TestLaunchesByHand(unittest.TestCase):
    """Latency floors that count launches (one buffer per dtype at the least)."""

    def test_rings_pay_every_hop_but_the_closing_one_per_dtype(self) -> None:
        # 4 ranks on 2 nodes: channel 0 crosses 2 node cuts (one closes the
        # ring) and makes 2 in-node hops: 100 + 2 * 1 = 102 a launch; 2 dtypes
        self.assertAlmostEqual(cb.ring_latency_s(cb.GroupLoad(4, 2, 2, 8.0, 2), AB), 204.0,
                               places=9)
        # one node: 3 in-node hops
        self.assertAlmostEqual(cb.ring_latency_s(cb.GroupLoad(4, 1, 4, 8.0), AB), 3.0, places=9)
        self.assertEqual(cb.ring_latency_s(cb.GroupLoad(4, 2, 2, 0.0, 3), AB), 0.0)

    def test_a_flat_chain_leaves_out_its_dearest_hop(self) -> None:
        # ring of 2 node cuts and 2 in-node hops (202) less one node cut
        self.assertAlmostEqual(cb.chain_latency_s(cb.GroupLoad(4, 2, 2, 8.0), AB), 102.0,
                               places=9)
        # one rank per node: only node cuts
        self.assertAlmostEqual(cb.chain_latency_s(cb.GroupLoad(2, 2, 1, 8.0), AB), 100.0,
                               places=9)
        self.assertAlmostEqual(cb.chain_latency_s(cb.GroupLoad(4, 1, 4, 8.0), AB), 3.0, places=9)

    def test_muon_family_takes_the_cheaper_route(self) -> None:
        g = cb.GroupLoad(4, 2, 2, 8.0, 2)
        # flat: 2 chains of 102; hierarchical: 1 node cut + 1 in-node hop, once
        self.assertAlmostEqual(cb.muon_latency_s(g, AB, hierarchical=False), 204.0, places=9)
        self.assertAlmostEqual(cb.muon_latency_s(g, AB, hierarchical=True), 101.0, places=9)
        # the hooks launch each dtype's intra-node reduce alone
        self.assertAlmostEqual(cb.muon_latency_s(g, AB, hierarchical=True, hooked=True), 102.0,
                               places=9)

    def test_hooked_hierarchical_reduce_weighs_launches_against_rails(self) -> None:
        # 4 ranks on 2 nodes of 2, S = 8: 1 node cut (100). B buffers: B
        # launches (B); inside a node the rank of a card without owners sends
        # all 8 B (8e-3, B = 1), else half (4e-3); across, the busiest rank
        # sends 8 / cap(B): one owner, its card's other rank sends all 8 (cap
        # 1); two owners: two cards with one each, or one card with both
        # (cap 2); three: one card owned on both nodes (2) + one (1) = 3;
        # four: both cards on both nodes = 4.
        # B = 1: 1 + 8e-3 + 8; B = 2: 2 + 4e-3 + 4; B = 3: 3 + 4e-3 + 8/3;
        # B = 4: 4 + 4e-3 + 2
        g = cb.GroupLoad(4, 2, 2, 8.0)
        self.assertAlmostEqual(cb.hooked_hierarchical_reduce_s(g, AB), 103.004 + 8 / 3,
                               places=9)
        # dear launches (alpha_nvlink 10): one buffer is cheaper, 10 + 8e-3 + 8
        dear = AlphaBeta(alpha_nvlink=10.0, beta_nvlink=BV, alpha_net=AN, beta_net=BN)
        self.assertAlmostEqual(cb.hooked_hierarchical_reduce_s(g, dear), 118.008, places=9)
        # two dtypes: two buffers at least, 20 + 4e-3 + 4
        two = cb.GroupLoad(4, 2, 2, 8.0, 2)
        self.assertAlmostEqual(cb.hooked_hierarchical_reduce_s(two, dear), 124.004, places=9)

    def test_comm_overlap_raises_the_dense_reduce_to_the_cheaper_hooked_route(self) -> None:
        fam = cb.layout_families(_TwoByTwo(), [METAS])
        plain = cb.step_bound(fam, AB)["families_s"]["dense_reduce"]
        hooked = cb.step_bound(fam, AB, comm_overlap=True)["families_s"]["dense_reduce"]
        # S = 10, one dtype: hierarchical 100 + min over B of B launches + the
        # intra-node bytes (10e-3 for B = 1, else 5e-3) + 10 / cap(B) (cap 1, 2,
        # 3, 4 for B = 1 .. 4; see above): B = 3, 103.005 + 10 / 3 (the flat
        # route's floor is 107.005); without overlap 101 + 2.505
        self.assertAlmostEqual(plain, 103.505, places=9)
        self.assertAlmostEqual(hooked, 103.005 + 10 / 3, places=9)

    def test_layout_families_count_dtypes_with_bytes(self) -> None:
        metas = [SimpleNamespace(nbytes=4, use_muon=False, colour=None, dtype="bfloat16"),
                 SimpleNamespace(nbytes=2, use_muon=False, colour=None, dtype="float32"),
                 SimpleNamespace(nbytes=0, use_muon=False, colour=None, dtype="float16"),
                 SimpleNamespace(nbytes=6, use_muon=True, colour=None, dtype="bfloat16"),
                 SimpleNamespace(nbytes=2, use_muon=True, colour=None, dtype="float32")]
        fam = cb.layout_families(_TwoByTwo(), [metas])
        self.assertEqual(fam["reduce_scatter"][0][1][0], cb.GroupLoad(4, 2, 2, 6.0, 2))
        self.assertEqual(fam["dense_reduce"][0][1][0], cb.GroupLoad(4, 2, 2, 8.0, 2))
        # comm_overlap: the 2 dtypes' hooked intra-node reduces pay the in-node
        # hop per buffer and the owners' cards carry the cross-node bytes:
        # 100 + 3 + 4e-3 + 8 / 3 (3 buffers) against 101 + (8 + 16e-3) / 4
        # coalesced; the broadcast from the same owners: both phases 2 * 100 +
        # 1 (coalesced broadcast) + B + 2 (4e-3 + 8 / cap(B)), least at B = 4
        # (both cards owned on both nodes): 209.008
        plain = cb.step_bound(fam, AB)["families_s"]
        hooked = cb.step_bound(fam, AB, comm_overlap=True)["families_s"]
        self.assertAlmostEqual(plain["dense_broadcast"], 103.004, places=9)
        self.assertAlmostEqual(hooked["dense_reduce"], 103.004 + 8 / 3, places=9)
        self.assertAlmostEqual(plain["dense_reduce"], 103.004, places=9)
        self.assertAlmostEqual(hooked["dense_reduce"] + hooked["dense_broadcast"], 209.008,
                               places=9)
        self.assertAlmostEqual(cb.hooked_hierarchical_pair_s(fam["dense_reduce"][0][1][0], AB),
                               209.008, places=9)
        # rings: 2 launches of 102; the sharding group's 6 B cross 2 node cuts at
        # 3/4 * 6 = 4.5 B each (9) and 2 NVLink edges (9e-3), over 4 ranks
        self.assertAlmostEqual(plain["reduce_scatter"], 204.0 + (9.0 + 9e-3) / 4, places=9)


def _params():
    # several buckets of each colour at small buffer sizes
    out = [ParamSpec("embed.weight", (64, 32), "float32", False, False)]
    for i in range(6):
        out.append(ParamSpec(f"l{i}.q.weight", (32, 32 + 8 * i), "float32", False, True))
        out.append(ParamSpec(f"l{i}.norm.weight", (32,), "float32", False, False))
        out.append(ParamSpec(f"l{i}.experts.0.up.weight", (32, 48), "float32", True, True))
        out.append(ParamSpec(f"l{i}.experts.0.bias", (48,), "float32", True, False))
    return out


class TestBoundBelowEveryEstimate(unittest.TestCase):
    def _check(self, cfg, params, ab, backend="nccl") -> float:
        res = compute_plan(cfg, ab, buffer_size_MB=0.004, params=params, backend=backend)
        est = recommend.annotate(res, ab)
        rec = recommend.recommend(res, est)
        b = rec["bound_s"]
        self.assertGreater(b, 0.0)
        for c in rec["candidates"]:
            self.assertGreaterEqual(c["estimated_time_s"], b * (1 - 1e-12),
                                    f"{cfg} {backend} {ab}: {c['config']}")
        return min(c["estimated_time_s"] for c in rec["candidates"]) / b

    def test_sweep_of_layouts_backends_and_constants(self) -> None:
        slow_nvlink = AlphaBeta(alpha_nvlink=3e-5, beta_nvlink=1 / 10e9, alpha_net=2e-5,
                                beta_net=1 / 25e9)
        for ep, ms, pp, gpn in ((2, 2, 1, 2), (4, 2, 1, 4), (2, 2, 2, 2), (1, 8, 1, 4),
                                (2, 4, 1, 2)):
            cfg = MuonCommConfig(ep=ep, moe_sharding=ms, pp=pp, gpus_per_node=gpn, model="tiny")
            for ab in (AlphaBeta(), slow_nvlink):
                for backend in ("nccl", "gloo"):
                    with self.subTest(ep=ep, ms=ms, pp=pp, gpn=gpn, ab=ab, backend=backend):
                        self._check(cfg, _params(), ab, backend)

    def test_bound_on_the_small_moe_preset_is_close_to_the_best(self) -> None:
        # 2 nodes x 8: the best configuration is within a few percent of the bound
        cfg = MuonCommConfig(ep=8, moe_sharding=2, pp=1, gpus_per_node=8,
                             model="ernie-moe-small")
        res = compute_plan(cfg, AlphaBeta(), params=get_preset("ernie-moe-small"))
        est = recommend.annotate(res, AlphaBeta())
        rec = recommend.recommend(res, est)
        for c in rec["candidates"]:
            self.assertGreaterEqual(c["ratio_to_bound"], 1.0)
        self.assertLess(rec["best"]["ratio_to_bound"], 1.15)


if __name__ == "__main__":
    unittest.main()
