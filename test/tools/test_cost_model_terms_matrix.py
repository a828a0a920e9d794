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
"""The cost model's every term over a matrix of groups, against a brute-force model.

``_Reference`` below re-derives the model from the rules in
``paddle_muon_ext.tools.cost_model``'s docstring by listing everything the
model avoids listing: every channel ring of a group (ranks node by node,
channel ``j`` visiting each node's ranks rotated by ``j mod k + 1``), every
edge of a rooted chain (its ring minus the root's outgoing edge for a
reduce, minus the edge into the root for a broadcast), every byte of every
edge charged to its sender at its link's beta, and channel 0's hops for the
latency; gloo's collectives as ``gloo_model``'s docstrings describe them
(ring reduce-scatter then slices to the root; binomial-tree broadcast; ring
all-gather and all-reduce). Each case of the matrix (one or two nodes,
uneven nodes, one rank per node, three nodes of three; every root; both
rooted ops, both ring collectives, both backends) is compared term by term
through the public :class:`CostPath` summary: times per phase, busiest and
mean bytes per rank on each link, inter-node bytes per rail, Muon and
element-wise byte totals, collective and launch counts. The constants are
distinct powers of ten so a swapped beta or alpha, an edge taken from the
wrong side of the root or a missing ``(p - 1) / p`` moves a term far beyond
the tolerance.
"""

from __future__ import annotations

import math
import unittest
from collections import defaultdict
from types import SimpleNamespace

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.step_plan import CommOp
from paddle_muon_ext.tools import cost_bound as cb
from paddle_muon_ext.tools.cost_model import (
    AlphaBeta,
    CostPath,
    Rings,
    cost_phase,
    max_over_mean,
    ratio,
)

AV, AN, BV, BN = 1.0, 100.0, 1e-3, 1.0
AB = AlphaBeta(alpha_nvlink=AV, beta_nvlink=BV, alpha_net=AN, beta_net=BN)
S = 36.0  # divisible by every group size and channel count below

# (ranks, gpus per node): one node; two nodes of one; two of two; uneven (2 + 1);
# uneven (4 + 2); three nodes of one card each (card 1); three of three.
GROUPS = (
    ((0, 1), 2),
    ((0, 2), 2),
    ((0, 1, 2, 3), 2),
    ((0, 1, 2), 2),
    ((0, 1, 2, 3, 4, 5), 4),
    ((1, 3, 5), 2),
    (tuple(range(9)), 3),
)


def _world(ranks, gpn):
    return (max(ranks) // gpn + 1) * gpn


class _Reference:
    """The model of the docstrings, brute force: every ring and edge listed."""

    def __init__(self, world: int, gpn: int) -> None:
        self.world, self.gpn = world, gpn
        self.intra = defaultdict(float)  # (phase, rank) -> bytes
        self.inter = defaultdict(float)
        self.rail = [0.0] * gpn  # Muon inter-node bytes per card
        self.rail_all = [0.0] * gpn  # every inter-node byte per card
        self.latency = defaultdict(float)  # (phase, group) -> seconds
        self.muon = [0.0, 0.0]  # inter, intra
        self.other = [0.0, 0.0]
        self.phases = []

    def crosses(self, a: int, b: int) -> bool:
        return a // self.gpn != b // self.gpn

    def alpha(self, a: int, b: int) -> float:
        return AN if self.crosses(a, b) else AV

    def rings(self, ranks):
        nodes = defaultdict(list)
        for r in sorted(ranks):
            nodes[r // self.gpn].append(r)
        blocks = [nodes[n] for n in sorted(nodes)]
        channels = max(len(b) for b in blocks)
        out = []
        for j in range(channels):
            ring = []
            for mem in blocks:
                cut = j % len(mem) + 1
                ring += mem[cut:] + mem[:cut]
            out.append(ring)
        return out

    def send(self, phase, a, b, nbytes, muon):
        if phase not in self.phases:
            self.phases.append(phase)
        inter = self.crosses(a, b)
        (self.inter if inter else self.intra)[(phase, a)] += nbytes
        totals = self.muon if muon else self.other
        totals[0 if inter else 1] += nbytes
        if inter:
            self.rail_all[a % self.gpn] += nbytes
        if inter and muon:
            self.rail[a % self.gpn] += nbytes

    def rooted(self, phase, what, ranks, root, nbytes):
        rings = self.rings(ranks)
        share = nbytes / len(rings)
        for c, ring in enumerate(rings):
            p = len(ring)
            edges = [(ring[i], ring[(i + 1) % p]) for i in range(p)]
            dropped = [e for e in edges if (e[0] == root if what == "reduce" else e[1] == root)]
            assert len(dropped) == 1
            chain = [e for e in edges if e != dropped[0]]
            for a, b in chain:
                self.send(phase, a, b, share, True)
            if c == 0:
                self.latency[(phase, tuple(sorted(ranks)))] += sum(self.alpha(a, b) for a, b in chain)

    def ring_collective(self, phase, ranks, nbytes):
        rings = self.rings(ranks)
        p = len(ranks)
        share = nbytes * (p - 1) / p / len(rings)
        for c, ring in enumerate(rings):
            edges = [(ring[i], ring[(i + 1) % p]) for i in range(p)]
            for a, b in edges:
                self.send(phase, a, b, share, False)
            if c == 0:  # every hop but the one closing the ring into ring[0]
                self.latency[(phase, tuple(sorted(ranks)))] += sum(
                    self.alpha(a, b) for a, b in edges[:-1])

    def gloo(self, phase, what, ranks, root, nbytes, muon):
        group = sorted(ranks)
        p = len(group)
        ring = [(group[i], group[(i + 1) % p]) for i in range(p)]
        if what == "reduce":
            edges = [(a, b, nbytes * (p - 1) / p) for a, b in ring]
            edges += [(r, root, nbytes / p) for r in group if r != root]
            rounds = p
        elif what == "broadcast":
            start = group.index(root)
            rel = group[start:] + group[:start]
            edges, span = [], 1
            while span < p:
                edges += [(rel[i], rel[i + span], nbytes) for i in range(span) if i + span < p]
                span *= 2
            rounds = math.ceil(math.log2(p))
        elif what == "all_gather":
            edges, rounds = [(a, b, nbytes * (p - 1) / p) for a, b in ring], p - 1
        else:  # reduce_scatter: the compat layer's all_reduce of the whole buffer
            edges, rounds = [(a, b, 2 * nbytes * (p - 1) / p) for a, b in ring], 2 * (p - 1)
        for a, b, size in edges:
            self.send(phase, a, b, size, muon)
        alpha = AN if any(self.crosses(a, b) for a, b, _ in edges) else AV
        self.latency[(phase, tuple(group))] += rounds * alpha

    def phase_time(self, phase):
        lat = max([t for (ph, _), t in self.latency.items() if ph == phase], default=0.0)
        bw = max(self.inter[(phase, r)] * BN + self.intra[(phase, r)] * BV
                 for r in range(self.world))
        return lat + bw

    def per_rank(self, table):
        return [sum(table[(ph, r)] for ph in self.phases) for r in range(self.world)]


class TestRingsAgainstTheirListing(unittest.TestCase):
    def test_next_and_prev_follow_every_listed_channel_ring(self) -> None:
        for ranks, gpn in GROUPS:
            ref = _Reference(_world(ranks, gpn), gpn).rings(ranks)
            rings = Rings(tuple(ranks), gpn)
            self.assertEqual(rings.channels, len(ref), f"{ranks}: channels = most ranks on a node")
            for ch, ring in enumerate(ref):
                p = len(ring)
                self.assertEqual(rings.ring(ch), ring, f"{ranks} gpn {gpn}: ring {ch}")
                for i, r in enumerate(ring):
                    self.assertEqual(rings.next(ch, r), ring[(i + 1) % p],
                                     f"{ranks} gpn {gpn}: next of {r} in ring {ch}")
                    self.assertEqual(rings.prev(ch, r), ring[i - 1],
                                     f"{ranks} gpn {gpn}: prev of {r} in ring {ch}")


class TestOneCollectiveMatrix(unittest.TestCase):
    """One collective per path: every term of the summary against the reference."""

    def _compare(self, label, path, ref, phase, muon_rooted) -> None:
        res = path.summary()
        self.assertAlmostEqual(res["estimated_time_s"], ref.phase_time(phase), places=9,
                               msg=f"{label}: step time")
        self.assertAlmostEqual(res["estimated_time_phases_s"][phase], ref.phase_time(phase),
                               places=9, msg=f"{label}: phase time")
        want_muon = ref.phase_time(phase) if muon_rooted else 0.0
        self.assertAlmostEqual(res["estimated_muon_time_s"], want_muon, places=9,
                               msg=f"{label}: Muon time (element-wise phases excluded)")
        inter, intra = ref.per_rank(ref.inter), ref.per_rank(ref.intra)
        for link, values in (("inter_node", inter), ("intra_node", intra)):
            got = res["bytes_per_rank"][link]
            self.assertAlmostEqual(got["max"], max(values), places=9, msg=f"{label}: {link} max")
            self.assertAlmostEqual(got["mean"], sum(values) / ref.world, places=9,
                                   msg=f"{label}: {link} mean")
        self.assertEqual(len(res["rail_bytes"]), ref.gpn)
        for card, (got, want) in enumerate(zip(res["rail_bytes"], ref.rail)):
            self.assertAlmostEqual(got, want, places=9, msg=f"{label}: rail {card}")
        self.assertAlmostEqual(res["rail_imbalance"], max_over_mean(ref.rail), places=9,
                               msg=f"{label}: rail imbalance")
        self.assertAlmostEqual(res["rail_imbalance_all"], max_over_mean(ref.rail_all), places=9,
                               msg=f"{label}: rail imbalance of every inter-node byte")
        self.assertAlmostEqual(res["inter_node_bytes"], ref.muon[0], places=9, msg=label)
        self.assertAlmostEqual(res["intra_node_bytes"], ref.muon[1], places=9, msg=label)
        self.assertAlmostEqual(res["inter_node_bytes_all"], ref.muon[0] + ref.other[0],
                               places=9, msg=label)
        self.assertAlmostEqual(res["intra_node_bytes_all"], ref.muon[1] + ref.other[1],
                               places=9, msg=label)

    def test_rooted_reduce_and_broadcast_for_every_root(self) -> None:
        for backend in ("nccl", "gloo"):
            for ranks, gpn in GROUPS:
                for what in ("reduce", "broadcast"):
                    for root in ranks:
                        label = f"{backend} {what} onto/from {root} over {ranks} gpn {gpn}"
                        world = _world(ranks, gpn)
                        path = CostPath("m", world, gpn, AB, backend=backend)
                        phase = "dense_" + what
                        path.rooted(path.phase(phase), "sharding", what, ranks, root, S, "dense")
                        ref = _Reference(world, gpn)
                        if backend == "nccl":
                            ref.rooted(phase, what, ranks, root, S)
                        else:
                            ref.gloo(phase, what, ranks, root, S, True)
                        self._compare(label, path, ref, phase, True)
                        res = path.summary()
                        self.assertEqual(res["collectives_per_step"]["sharding"], 1, label)
                        self.assertEqual(res["collectives_detail"]["sharding"], {what: 1}, label)
                        self.assertAlmostEqual(res["by_colour"]["dense"]["inter_node_bytes"],
                                               ref.muon[0], places=9, msg=label)
                        self.assertEqual(res["by_colour"]["moe"]["inter_node_bytes"], 0, label)

    def test_reduce_scatter_and_all_gather(self) -> None:
        for backend in ("nccl", "gloo"):
            for ranks, gpn in GROUPS:
                for what in ("reduce_scatter", "all_gather"):
                    label = f"{backend} {what} over {ranks} gpn {gpn}"
                    world = _world(ranks, gpn)
                    path = CostPath("m", world, gpn, AB, backend=backend)
                    path.ring_collective(path.phase(what), "sharding", what, ranks, S)
                    ref = _Reference(world, gpn)
                    if backend == "nccl":
                        ref.ring_collective(what, ranks, S)
                    else:
                        ref.gloo(what, what, ranks, None, S, False)
                    self._compare(label, path, ref, what, False)
                    res = path.summary()
                    self.assertEqual(res["coalesced_launches_per_step"]["sharding"], 1, label)
                    self.assertEqual(res["rail_bytes"], [0.0] * gpn,
                                     f"{label}: element-wise bytes are not Muon rail bytes")

    def test_a_one_rank_group_is_counted_but_moves_nothing(self) -> None:
        for backend in ("nccl", "gloo"):
            path = CostPath("m", 4, 2, AB, backend=backend)
            path.rooted(path.phase("dense_reduce"), "sharding", "reduce", (3,), 3, S, "dense")
            path.ring_collective(path.phase("all_gather"), "moe_sharding", "all_gather", (2,), S)
            res = path.summary()
            self.assertEqual(res["estimated_time_s"], 0.0, backend)
            self.assertEqual(res["collectives_per_step"],
                             {"sharding": 1, "moe_sharding": 1, "node": 0, "same_card": 0})
            self.assertEqual(res["inter_node_bytes_all"] + res["intra_node_bytes_all"], 0.0)


def _op(phase, op, group, root=None, colour=None, coalesced=False, trigger="step"):
    return CommOp(trigger, phase, op, tuple(group), root, "float32", 1, colour, coalesced, 0)


class TestScheduleReplay(unittest.TestCase):
    """Several ops: phase names, latency adding up per group and maxed over groups."""

    def test_cost_phase_names_every_phase_kind_and_colour(self) -> None:
        g = (0, 1)
        table = [
            (_op("reduce_scatter", "reduce_scatter", g), ("reduce_scatter", "sharding")),
            (_op("reduce_scatter", "reduce_scatter", g, colour="e"),
             ("reduce_scatter", "moe_sharding")),
            (_op("all_gather_slices", "all_gather", g), ("all_gather", "sharding")),
            (_op("all_gather_slices", "all_gather", g, colour="e"), ("all_gather", "moe_sharding")),
            (_op("intra_node_reduce", "reduce", g, 0), ("intra_node_reduce", "node")),
            (_op("intra_node_broadcast", "broadcast", g, 0), ("intra_node_broadcast", "node")),
            (_op("cross_node_reduce", "reduce", g, 0), ("cross_node_reduce", "same_card")),
            (_op("cross_node_broadcast", "broadcast", g, 0), ("cross_node_broadcast", "same_card")),
            (_op("reduce_to_owner", "reduce", g, 0), ("dense_reduce", "sharding")),
            (_op("reduce_to_owner", "reduce", g, 0, colour="e"), ("moe_reduce", "moe_sharding")),
            (_op("broadcast_from_owner", "broadcast", g, 1), ("dense_broadcast", "sharding")),
            (_op("broadcast_from_owner", "broadcast", g, 1, colour="e"),
             ("moe_broadcast", "moe_sharding")),
        ]
        for op, want in table:
            self.assertEqual(cost_phase(op), want, op)

    def test_ops_of_one_group_add_latency_and_groups_of_one_phase_take_the_max(self) -> None:
        # world 8, gpn 2. Phase dense_reduce: two uncoalesced reduces on {0..3}
        # (onto 0, then onto 3) and one on {4, 6}; phase all_gather: one ring
        # all-gather on {0..3}; hierarchical phases coalesced on a node group and
        # a same-card group.
        gpn, world = 2, 8
        a, b = (0, 1, 2, 3), (4, 6)
        ops = [
            (_op("reduce_to_owner", "reduce", a, 0, trigger="reduce_gradients"), 8.0),
            (_op("reduce_to_owner", "reduce", a, 3), 4.0),
            (_op("reduce_to_owner", "reduce", b, 6), 16.0),
            (_op("all_gather_slices", "all_gather", a), 12.0),
            (_op("intra_node_reduce", "reduce", (4, 5), 5, coalesced=True), 6.0),
            (_op("intra_node_reduce", "reduce", (4, 5), 5, coalesced=True), 2.0),
            (_op("cross_node_broadcast", "broadcast", (1, 3, 5), 3, coalesced=True), 9.0),
        ]
        path = CostPath("m", world, gpn, AB)
        path.replay(ops)
        res = path.summary()
        ref = _Reference(world, gpn)
        ref.rooted("dense_reduce", "reduce", a, 0, 8.0)
        ref.rooted("dense_reduce", "reduce", a, 3, 4.0)
        ref.rooted("dense_reduce", "reduce", b, 6, 16.0)
        ref.ring_collective("all_gather", a, 12.0)
        ref.rooted("intra_node_reduce", "reduce", (4, 5), 5, 6.0)
        ref.rooted("intra_node_reduce", "reduce", (4, 5), 5, 2.0)
        ref.rooted("cross_node_broadcast", "broadcast", (1, 3, 5), 3, 9.0)
        # A coalesced hierarchical launch pays its alpha once: (ranks - 1) alphas
        # of its link, whatever the number of ops in it.
        ref.latency[("intra_node_reduce", (4, 5))] = 1 * AV
        ref.latency[("cross_node_broadcast", (1, 3, 5))] = 2 * AN
        self.assertEqual(list(res["estimated_time_phases_s"]),
                         ["dense_reduce", "all_gather", "intra_node_reduce",
                          "cross_node_broadcast"])
        for phase, got in res["estimated_time_phases_s"].items():
            self.assertAlmostEqual(got, ref.phase_time(phase), places=9, msg=phase)
        self.assertAlmostEqual(res["estimated_time_s"],
                               sum(ref.phase_time(p) for p in ref.phases), places=9)
        self.assertAlmostEqual(res["estimated_muon_time_s"],
                               sum(ref.phase_time(p) for p in ref.phases if p != "all_gather"),
                               places=9)
        self.assertEqual(res["phase_triggers"]["dense_reduce"], "reduce_gradients",
                         "a phase's trigger is its first op's")
        self.assertEqual(res["collectives_per_step"],
                         {"sharding": 4, "moe_sharding": 0, "node": 2, "same_card": 1})
        self.assertEqual(res["coalesced_launches_per_step"],
                         {"sharding": 4, "moe_sharding": 0, "node": 1, "same_card": 1})
        self.assertEqual(res["collectives_detail"]["sharding"],
                         {"reduce": 3, "all_gather": 1})
        for card in range(gpn):
            self.assertAlmostEqual(res["rail_bytes"][card], ref.rail[card], places=9)

    def test_bound_is_two_node_cuts_per_buffer_and_colour(self) -> None:
        path = CostPath("m", 8, 2, AB)
        path.add_bound("dense", 3, 10.0)   # 2 * (3 - 1) * 10 = 40
        path.add_bound("moe", 1, 7.0)      # one node: nothing crosses
        path.add_bound("moe", 2, 5.0)      # 2 * 1 * 5 = 10
        path.rooted(path.phase("dense_reduce"), "sharding", "reduce", (0, 2), 0, 20.0, "dense")
        res = path.summary()
        self.assertEqual(res["inter_node_bytes_bound"], 50.0)
        self.assertEqual(res["by_colour"]["dense"]["inter_node_bytes_bound"], 40.0)
        self.assertEqual(res["by_colour"]["moe"]["inter_node_bytes_bound"], 10.0)
        # reduce onto 0 over {0, 2}: the chain 2 -> 0 carries 20 across
        self.assertEqual(res["inter_node_bytes"], 20.0)
        self.assertAlmostEqual(res["inter_node_ratio_to_bound"], 20.0 / 50.0)
        self.assertAlmostEqual(res["by_colour"]["dense"]["inter_node_ratio_to_bound"], 0.5)
        self.assertEqual(res["by_colour"]["moe"]["inter_node_ratio_to_bound"], 0.0)

    def test_a_class_replayed_once_costs_what_its_members_cost_one_by_one(self) -> None:
        # members {0, 2} and {1, 3} (gpn 2): same node pattern, card 0 and card 1
        gpn, world = 2, 4
        members = [(0, 2), (1, 3)]

        def ops(group):
            return [(_op("reduce_to_owner", "reduce", group, group[1], colour="e"), 8.0),
                    (_op("reduce_scatter", "reduce_scatter", group, colour="e"), 6.0)]

        one_by_one = CostPath("m", world, gpn, AB)
        for m in members:
            one_by_one.replay(ops(m))
        by_class = CostPath("m", world, gpn, AB)
        by_class.replay_class(ops(members[0]), members)
        want, got = one_by_one.summary(), by_class.summary()
        self.assertEqual(got["rail_bytes"], [8.0, 8.0], "each member's bytes on its own rail")
        for key in ("estimated_time_s", "inter_node_bytes", "inter_node_bytes_all",
                    "intra_node_bytes_all", "rail_bytes", "bytes_per_rank",
                    "collectives_per_step", "coalesced_launches_per_step", "by_colour",
                    "rail_imbalance_all"):
            self.assertEqual(got[key], want[key], key)
        with self.assertRaisesRegex(ValueError, "unequal size"):
            by_class.replay_class(ops(members[0]), [(0, 2), (1,)])


class TestBoundTermsByHand(unittest.TestCase):
    """The bound's per-group floors (cost_model docstring, "Lower bound") over a table."""

    # the constants as measured, and a node whose NVLink is slower than its network
    SLOW_NVLINK = AlphaBeta(alpha_nvlink=AN, beta_nvlink=BN, alpha_net=AV, beta_net=BV)

    def test_group_floors(self) -> None:
        for ab in (AB, self.SLOW_NVLINK):
            self._group_floors(ab)

    def _group_floors(self, ab: AlphaBeta) -> None:
        av, an, bv, bn = ab.alpha_nvlink, ab.alpha_net, ab.beta_nvlink, ab.beta_net
        cheap_a, cheap_b = min(av, an), min(bv, bn)
        # (p ranks, n nodes, k most on a node, S bytes)
        for p, n, k, s in ((1, 1, 1, 8.0), (2, 1, 2, 8.0), (2, 2, 1, 8.0), (4, 2, 2, 8.0),
                           (3, 2, 2, 6.0), (6, 3, 2, 12.0), (8, 1, 8, 4.0), (4, 2, 2, 0.0)):
            g = cb.GroupLoad(ranks=p, nodes=n, per_node=k, nbytes=s)
            label = f"p {p} n {n} k {k} S {s}"
            moves = p >= 2 and s > 0
            floor = ((n - 1) * s, (p - n) * s) if moves else (0.0, 0.0)
            self.assertEqual(cb.link_floor_bytes(g), floor, label)
            share = (p - 1) / p * s
            ring = ((n * share if n > 1 else 0.0), (p - (n if n > 1 else 0)) * share) \
                if moves else (0.0, 0.0)
            for got, want in zip(cb.ring_link_bytes(g), ring):
                self.assertAlmostEqual(got, want, places=12, msg=label)
            self.assertAlmostEqual(cb.bandwidth_floor_s(g, ab),
                                   floor[0] * bn + floor[1] * cheap_b, places=12, msg=label)
            # a ring's bytes inside a node pay NVLink's beta, whichever is cheaper
            self.assertAlmostEqual(cb.bandwidth_floor_s(g, ab, ring=True),
                                   ring[0] * bn + ring[1] * bv, places=12, msg=label)
            nccl = (n - 1) * an + (k - 1) * cheap_a if moves else 0.0
            self.assertAlmostEqual(cb.latency_floor_s(g, ab), nccl, places=12, msg=label)
            self.assertAlmostEqual(cb.latency_floor_s(g, ab, "gloo"), cheap_a if moves else 0.0,
                                   places=12, msg=label)

    def test_the_families_of_a_two_stage_layout(self) -> None:
        # two pipeline stages of 4 ranks (gpn 2): dense groups (0..3) and (4..7),
        # MoE groups {0, 2}, {1, 3}, {4, 6}, {5, 7}; stage 1 holds no expert
        class Plan:
            gpus_per_node = 2

            @staticmethod
            def sharding_group_ranks(stage):
                return tuple(range(4 * stage, 4 * stage + 4))

            @staticmethod
            def moe_sharding_ranks(rank):
                return (rank, rank + 2) if rank % 4 < 2 else (rank - 2, rank)

        def meta(nbytes, use_muon, expert):
            return SimpleNamespace(nbytes=nbytes, use_muon=use_muon,
                                   colour="moe_expert" if expert else None)

        stages = [[meta(8, True, False), meta(4, True, True), meta(6, False, False),
                   meta(2, False, True), meta(4, True, False)],
                  [meta(16, True, False), meta(10, False, False)]]
        families = cb.layout_families(Plan, stages)
        dense = cb.GroupLoad(4, 2, 2, 12.0)
        pair = cb.GroupLoad(2, 2, 1, 4.0)
        want = {
            "dense_reduce": [(4, [dense]), (4, [cb.GroupLoad(4, 2, 2, 16.0)])],
            "moe_reduce": [(4, [pair, pair]), (4, [cb.GroupLoad(2, 2, 1, 0.0)] * 2)],
            "reduce_scatter": [(4, [cb.GroupLoad(4, 2, 2, 6.0), cb.GroupLoad(2, 2, 1, 2.0),
                                    cb.GroupLoad(2, 2, 1, 2.0)]),
                               (4, [cb.GroupLoad(4, 2, 2, 10.0), cb.GroupLoad(2, 2, 1, 0.0),
                                    cb.GroupLoad(2, 2, 1, 0.0)])],
        }
        want["dense_broadcast"], want["moe_broadcast"] = want["dense_reduce"], want["moe_reduce"]
        want["all_gather"] = want["reduce_scatter"]
        self.assertEqual(set(families), set(cb.FAMILIES))
        for name, rank_sets in want.items():
            self.assertEqual(families[name], rank_sets, name)


class TestSmallFunctions(unittest.TestCase):
    def test_max_over_mean_and_ratio(self) -> None:
        for values, want in (([1.0, 1.0], 1.0), ([3.0, 1.0], 1.5), ([0.0, 0.0, 6.0], 3.0),
                             ([0.0, 0.0], 1.0), ([], 1.0), ([2.0], 1.0)):
            self.assertAlmostEqual(max_over_mean(values), want, msg=values)
        for a, b, want in ((3.0, 2.0, 1.5), (0.0, 5.0, 0.0), (7.0, 0.0, 1.0), (0.0, 0.0, 1.0)):
            self.assertEqual(ratio(a, b), want, (a, b))

    def test_unknown_backend_is_refused(self) -> None:
        with self.assertRaisesRegex(ValueError, "unknown backend 'mpi'"):
            CostPath("m", 2, 2, AB, backend="mpi")


if __name__ == "__main__":
    unittest.main()
