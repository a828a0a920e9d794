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
"""Alpha-beta cost of one step's collectives (DESIGN.md section 6).

Input: the group-level collectives of a step, as the layout schedules them
(:class:`CommOp`); nothing here decides what is sent.

Bytes (egress of the sending rank): node of rank ``r`` is ``r // gpn``,
card ``r % gpn``; a byte is inter-node when sender and receiver sit on
different nodes and is charged to the sender's card (its NIC / rail).
A collective over a group runs NCCL-style rings: ranks ordered node by node,
``C`` = ranks on the fullest node channels of ``S / C`` bytes each, channel
``j`` exits each node through its ``(j mod k_node)``-th rank. Reduce onto a
root: the chain ending at the root (ring minus root -> successor); broadcast:
the chain starting at the root. Reduce-scatter / all-gather: every ring edge
carries ``(p - 1) / p * S / C``. Hierarchical phases are exact: intra-node,
each non-root sends ``S``; cross-node, a chain of ``n - 1`` inter-node edges.

Time: phases run one after another, the groups of a phase concurrently; a
phase takes the largest group latency plus the busiest rank's
``inter * beta_net + intra * beta_nvlink``. An uncoalesced op pays alpha per
chain hop, op after op; a coalesced hierarchical phase pays it once:
``(gpn - 1) * alpha_nvlink`` intra-node, ``(n - 1) * alpha_net`` across.
Payload bytes are unpadded parameter bytes.

Lower bound (:mod:`paddle_muon_ext.tools.cost_bound`): a time no
configuration of a layout and model can beat in this model, whatever
``comm_group_call_opt``, the owner rule or the buffer size. The step splits
into phase families that share no phase: dense-colour Muon reduce, its
broadcast (flat ``dense_*`` or hierarchical ``intra_node_*`` +
``cross_node_*``: only the default colour routes hierarchically), MoE-colour
reduce and broadcast, and the element-wise reduce-scatter and all-gather
(both colours). For a group of ``p`` ranks on ``n`` nodes, at most ``k`` on
one node, moving ``S`` bytes: (bytes) a reduce needs every non-root rank to
send at least ``S`` (the root's sum depends one-to-one on each input) and
every non-root node to send ``S`` out of it, so at least ``(p - 1) S`` bytes
of which ``(n - 1) S`` cross nodes; a broadcast the same received, so sent;
a reduce-scatter / all-gather ``(p - 1) / p S`` per rank and ``(p - k) / p
S`` per node, the same totals. Cheapest: ``(n - 1) S beta_net + (p - n) S
min(beta_net, beta_nvlink)`` link-seconds. (Rail spread) only the group's
ranks send its bytes, and a sum of per-phase maxima is at least the mean
over any set of ranks of what they send in all the family's phases: per
pipeline stage, the family's link-seconds over the stage's ranks. (Launches)
buffers are per (owner, dtype), so every group issues at least one op per
dtype with bytes (``d``) in each family. A flat Muon op pays its whole
channel-0 chain: the ring's ``n`` node cuts at ``alpha_net`` and ``p - n``
in-node hops at ``alpha_nvlink`` less the one edge its root leaves out (at
most the dearest); so flat pays ``d`` chains. The hierarchical route (the
default colour only) pays its coalesced launches once, ``(n - 1) alpha_net +
(k - 1) alpha_nvlink``; when ``comm_overlap``'s hooks launch each dense
buffer's intra-node reduce alone (the run's ``comm_overlap`` holds for every
candidate), ``B >= d`` buffers pay ``B`` in-node launches and have at most
``B`` owners; a rank sends what its card owns less its own share (inside a
node: ``S`` less its card's; ``S`` when ``B < k``), and a card owned on fewer
than ``n`` nodes leaves a rank that sends all its bytes across: per stage the
least over ``B`` of ``(n - 1) alpha_net + B (k - 1) alpha_nvlink`` + the
intra-node bytes + ``S beta_net / cap(B)``, ``cap(B)`` the most of ``f n /
(n - 1) + q`` over ``f`` cards owned on every node and ``q`` others (``f n +
q <= B``, ``f + q <= k``; :func:`.cost_bound.hooked_hierarchical_reduce_s`);
the broadcast from the same owners (each buffer's chain ends at one rank)
the same bytes with the same ``B``, its launches coalesced. A Muon family's
floor is the cheaper route's (gloo: below). The element-wise reduce-scatter /
all-gather run as rings whatever the options: on nccl ``d`` launches of
``(n - 1) alpha_net + (p - n) alpha_nvlink`` each (every hop of channel 0 but
the closing one); gloo's, in rank order, ``p - 1`` rounds a pass, its
reduce-scatter (a ring all-reduce) two passes of twice the bytes. A family
takes its largest group latency. (Overlap) the
model charges every phase as exposed, ``comm_overlap`` included (it changes
which op launches a buffer, not the phase sum), so the bound hides nothing
either. (Rings) the element-wise reduce-scatter / all-gather run as rings
whatever the options, so the bound takes the rings' bytes (``n (p - 1) / p
S`` across nodes, ``(p - n) (p - 1) / p S`` inside) instead of the floor;
gloo's reduce-scatter twice that; their order is fixed and a group's bytes
split over its buffers in proportion, so the family's bandwidth floor is the
busiest rank's exactly (NCCL: its channels' edges; gloo: ``(p - 1) / p S`` a
pass to the next rank in rank order), not the stage's mean. (Routes) the
model's own routes send more than the physical floor: a flat NCCL chain is
its ring less one edge a channel, so ``(n - 1) S`` across, ``S`` on a cut or
inside (the cheaper beta), ``(p - n - 1) S`` inside at ``beta_nvlink``; the
hierarchical route ``(n - 1) S`` across and ``(p - n) S`` inside; a flat gloo
reduce its rank-order ring (``n`` cuts of ``(p - 1) / p S``, ``p - n`` edges
inside) plus ``p - 1`` slices of ``S / p``, ``p - k`` from other nodes (its
hierarchical route the same per node, ``k - 1 / k`` times ``S``, and per
same-card group across); a flat gloo reduce / broadcast at its cheapest
root's edges, every root tried (groups up to 512 ranks). gloo latency: a flat
op pays :func:`.gloo_model.rounds` rounds (``p`` reduce, ``ceil(log2 p)``
broadcast) at ``alpha_net`` once it crosses nodes; the hierarchical route
``(k - 1) alpha_nvlink + (n - 1) alpha_net`` at the least. (Roots) each flat
op has one root and pays a chain: ``B`` roots are ``max(B, d)`` chains; a
reduce's non-root sends every byte of its group, so with ``B < p`` some
rank sends ``S`` at its channels' betas (the cheapest rank's), and a
broadcast spares one sender a channel, so with ``B C < p`` (``C``
channels) the same; else the mean. Per group the least of the two.
(Owners, gloo) a buffer is reduced onto its owner and broadcast from it, so
``m`` owners are ``max(m, d)`` flat ops in each phase, and a binomial
broadcast's root sends the op to each child: the owners together send ``S
c`` (``c``: the cheapest root's own link-seconds a byte), the busiest ``S c
/ m``; the flat pair takes at least the least over ``m`` of ``max(m, d)
(R_reduce + R_broadcast) alpha`` + the reduce's mean + ``max(broadcast
mean, S c / m)`` (:func:`.cost_bound_routes.gloo_flat_pair_floor_s`).
(Reduce ring, gloo) a flat gloo reduce runs its ring reduce-scatter in
rank order whatever its root, so every rank sends ``(p - 1) / p S`` of its
group to its successor at that edge's beta: the flat route's floor and the
owner pair's reduce take the busiest rank's ring bytes exactly
(:func:`.cost_bound_routes.gloo_reduce_ring_s`; with the network faster
than NVLink the in-node senders are the busiest), not the stage's mean.
``comm_group_call_opt`` routes the dense reduce and broadcast together, so
their floors take one route. The bound is the sum over families of
latency + bandwidth floors. The gap to a configuration: owners not spread
over nodes and rails, phases that do not overlap (the hierarchical path's
intra- and cross-node steps), extra launches of small buckets.

Symmetry: ranks whose collectives are the same up to renaming (the nodes of
one pipeline stage; moe_sharding groups with the same card and node pattern)
are charged once through :meth:`CostPath.replay_class`, which multiplies the
totals and copies the per-rank bytes onto every member at summary time, so a
world of 16,384 ranks costs what its classes cost.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from ..distributed.fleet.meta_optimizers.muon_sharding import step_plan as mst
from .cost_rings import Group, Phase, Rings, ring_structure

__all__ = ["AlphaBeta", "BACKENDS", "CostPath", "KINDS", "OTHER_PHASES", "RING_OPS",
           "max_over_mean", "ratio", "cost_phase"]

KINDS = ("sharding", "moe_sharding", "node", "same_card")
#: Unrooted collectives, charged as rings: an all-reduce (e.g. the global-norm
#: clip's) is a reduce-scatter then an all-gather of the same bytes.
RING_OPS = ("reduce_scatter", "all_gather", "all_reduce")
#: Collective algorithms the bytes model knows (``--backend``): NCCL rings
#: (above) or gloo as measured (:mod:`paddle_muon_ext.tools.gloo_model`).
BACKENDS = ("nccl", "gloo")
OTHER_PHASES = ("reduce_scatter", "all_gather", "all_reduce")


@dataclass(frozen=True)
class AlphaBeta:
    """Latency (s) and inverse bandwidth (s/B) of NVLink and the network."""

    alpha_nvlink: float = 5e-6
    beta_nvlink: float = 1.0 / 150e9
    alpha_net: float = 2e-5
    beta_net: float = 1.0 / 25e9


def max_over_mean(values: Sequence[float]) -> float:
    """Busiest / mean (1.0 when everything is zero)."""
    total = sum(values)
    if total <= 0:
        return 1.0
    return max(values) * len(values) / total


def ratio(a: float, b: float) -> float:
    """``a / b`` (1.0 when ``b`` is zero)."""
    return a / b if b else 1.0


def cost_phase(op: mst.CommOp) -> Tuple[str, str]:
    """(cost-model phase, group kind) of a scheduled op."""
    colour = "dense" if op.colour is None else "moe"
    kind = "sharding" if op.colour is None else "moe_sharding"
    if op.phase == mst.PHASE_REDUCE_SCATTER:
        return "reduce_scatter", kind
    if op.phase == mst.PHASE_ALL_GATHER:
        return "all_gather", kind
    if op.op == "all_reduce":  # whatever its phase label: one unrooted ring phase
        return "all_reduce", kind
    if op.phase in (mst.PHASE_INTRA_NODE_REDUCE, mst.PHASE_INTRA_NODE_BROADCAST):
        return op.phase, "node"
    if op.phase in (mst.PHASE_CROSS_NODE_REDUCE, mst.PHASE_CROSS_NODE_BROADCAST):
        return op.phase, "same_card"
    return f"{colour}_{op.op}", kind


class CostPath:
    """Collectives and bytes of one path (flat or hierarchical) over one step."""

    def __init__(self, name: str, world: int, gpn: int, ab: AlphaBeta,
                 backend: str = "nccl") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
        self.name = name
        self.backend = backend
        self.world = world
        self.gpn = gpn
        self.ab = ab
        self.phases: "OrderedDict[str, Phase]" = OrderedDict()
        self.calls: Counter = Counter()
        self.launches: Counter = Counter()
        self.detail: Dict[str, Counter] = {k: Counter() for k in KINDS}
        self.muon_inter = 0.0
        self.muon_intra = 0.0
        self.other_inter = 0.0
        self.other_intra = 0.0
        self.rail_muon = [0.0] * gpn
        self.rail_all = [0.0] * gpn
        self.bound = 0.0
        self.colour_inter: Counter = Counter()
        self.colour_bound: Counter = Counter()
        self.colour_rail: Dict[str, List[float]] = {"dense": [0.0] * gpn, "moe": [0.0] * gpn}
        self.phase_triggers: Dict[str, str] = {}
        self._groups: Dict[Tuple[int, ...], Group] = {}
        # id(an op's group object) -> (that object, kept alive; its Group)
        self._by_id: Dict[int, Tuple[Any, Group]] = {}
        self._deferred: Dict[tuple, float] = {}
        # replay_class scope: copies of the template being charged (1 outside),
        # and where per-rank bytes go (None: the phases' world arrays).
        self._mult = 1
        self._local: Optional[Dict[str, Tuple[Dict[int, float], Dict[int, float]]]] = None
        # and inter-node bytes per (template rank, colour): a member's rail is its own card
        self._local_rails: Dict[Tuple[int, Optional[str]], float] = {}
        self._blocks: List[tuple] = []

    def phase(self, name: str) -> Phase:
        if name not in self.phases:
            self.phases[name] = Phase(name, self.world)
        return self.phases[name]

    def _group(self, group: Any) -> Group:
        """The :class:`Group` of a rank sequence (any order), or ``group`` itself."""
        if isinstance(group, Group):
            return group
        seen = self._by_id.get(id(group))
        if seen is not None and seen[0] is group:
            return seen[1]
        ranks = tuple(sorted(group))
        handle = self._groups.get(ranks)
        if handle is None:
            handle = self._groups[ranks] = Group(ranks)
        self._by_id[id(group)] = (group, handle)
        return handle

    def rings(self, group: Any) -> Rings:
        """The group's channel rings (see the module docstring)."""
        g = self._group(group)
        if g.rings is None:
            g.rings = ring_structure(g.ranks, self.gpn)
        return g.rings

    def _send(self, ph: Phase, src: int, dst: int, nbytes: float, muon: Optional[str]) -> bool:
        gpn = self.gpn
        inter = src // gpn != dst // gpn
        if self._local is None:
            (ph.inter if inter else ph.intra)[src] += nbytes
        else:
            per_rank = self._local.setdefault(ph.name, ({}, {}))[1 if inter else 0]
            per_rank[src] = per_rank.get(src, 0.0) + nbytes
        total = nbytes * self._mult
        if inter:
            if self._local is None:
                self._rail(src % gpn, nbytes, muon)
            else:
                key = (src, muon)
                self._local_rails[key] = self._local_rails.get(key, 0.0) + nbytes
            if muon:
                self.muon_inter += total
                self.colour_inter[muon] += total
            else:
                self.other_inter += total
            return True
        if muon:
            self.muon_intra += total
        else:
            self.other_intra += total
        return False

    def _rail(self, card: int, nbytes: float, muon: Optional[str]) -> None:
        self.rail_all[card] += nbytes
        if muon:
            self.rail_muon[card] += nbytes
            self.colour_rail[muon][card] += nbytes

    def _alpha(self, inter: bool) -> float:
        return self.ab.alpha_net if inter else self.ab.alpha_nvlink

    def rooted(self, ph: Phase, kind: str, what: str, group, root: int, nbytes: float,
               colour: str, coalesced: bool = False, count: int = 1) -> None:
        """A reduce onto / broadcast from ``root`` of a Muon buffer of ``colour``.

        ``count`` ops of the same phase, group, root and colour moving
        ``nbytes`` together (nccl only): their bytes are linear in the size
        and each pays the same latency, so they are charged at once.
        """
        group = self._group(group)
        self.calls[kind] += self._mult * count
        self.detail[kind][what] += self._mult * count
        if len(group.ranks) < 2:
            return
        if self.backend == "gloo":
            if count != 1:
                raise ValueError("rooted: gloo charges one op at a time (count must be 1)")
            self._gloo(ph, what, group, nbytes, colour, root, coalesced)
            return
        rings = self.rings(group)
        share = nbytes / rings.channels
        # A chain from/to the root is its ring minus one edge: charge the whole
        # ring once per (phase, group, colour) at the end and take the missing
        # edge off here, so an op costs O(channels), not O(group x channels).
        self._charge_rings(ph, group, share, colour)
        for ch in range(rings.channels):
            if what == "reduce":  # the chain ends at the root: no root -> next
                a, b = root, rings.next(ch, root)
            else:  # the chain starts at the root: no prev -> root
                a, b = rings.prev(ch, root), root
            self._send(ph, a, b, -share, colour)
        if not coalesced:
            full, alphas = self._ring_latency(group)
            i = rings.index0[root]
            missing = alphas[i] if what == "reduce" else alphas[i - 1]
            ph.latency[group] = ph.latency.get(group, 0.0) + count * (full - missing)

    def ring_collective(self, ph: Phase, kind: str, what: str, group, nbytes: float) -> None:
        """A reduce-scatter, all-gather or all-reduce of ``nbytes`` (whole buffer) in ``group``.

        An all-reduce runs as a reduce-scatter then an all-gather on the same
        rings: twice the bytes and twice the latency of either.
        """
        if what == "all_reduce" and self.backend != "gloo":
            self.calls[kind] += self._mult
            self.launches[kind] += self._mult
            self.detail[kind][what] += self._mult
            for _ in range(2):
                self._ring_pass(ph, group, nbytes)
            return
        group = self._group(group)
        self.calls[kind] += self._mult
        self.launches[kind] += self._mult
        self.detail[kind][what] += self._mult
        p = len(group.ranks)
        if p < 2:
            return
        if self.backend == "gloo":
            self._gloo(ph, what, group, nbytes, None, None, False)
            return
        self._ring_pass(ph, group, nbytes)

    def _ring_pass(self, ph: Phase, group, nbytes: float) -> None:
        """One pass round the rings: every edge carries ``(p - 1) / p`` of a channel's share."""
        group = self._group(group)
        p = len(group.ranks)
        if p < 2:
            return
        rings = self.rings(group)
        share = nbytes * (p - 1) / p / rings.channels
        self._charge_rings(ph, group, share, None)
        full, alphas = self._ring_latency(group)
        # every channel-0 hop but the one closing the ring (into ring[0])
        ph.latency[group] = ph.latency.get(group, 0.0) + full - alphas[-1]

    def _charge_rings(self, ph: Phase, group: Group, share: float,
                      colour: Optional[str]) -> None:
        key = (ph.name, group, colour)
        self._deferred[key] = self._deferred.get(key, 0.0) + share

    def _ring_senders(self, group: Group) -> tuple:
        return self.rings(group).senders

    def _flush(self) -> None:
        """Send every deferred ring charge: each edge of each channel ring once."""
        for (name, group, colour), share in self._deferred.items():
            ph = self.phases[name]
            senders, cards, n_inter, n_intra = self._ring_senders(group)
            if self._local is None:
                intra, inter = ph.intra, ph.inter
                for r, k_intra, k_inter in senders:
                    if k_intra:
                        intra[r] += k_intra * share
                    if k_inter:
                        inter[r] += k_inter * share
            else:
                intra, inter = self._local.setdefault(name, ({}, {}))
                for r, k_intra, k_inter in senders:
                    if k_intra:
                        intra[r] = intra.get(r, 0.0) + k_intra * share
                    if k_inter:
                        inter[r] = inter.get(r, 0.0) + k_inter * share
            m = self._mult
            if self._local is None:
                for card, k in enumerate(cards):
                    if k:
                        self._rail(card, k * share, colour)
            else:
                rails = self._local_rails
                for r, _, k_inter in senders:
                    if k_inter:
                        rails[(r, colour)] = rails.get((r, colour), 0.0) + k_inter * share
            if colour:
                self.muon_inter += n_inter * share * m
                self.colour_inter[colour] += n_inter * share * m
                self.muon_intra += n_intra * share * m
            else:
                self.other_inter += n_inter * share * m
                self.other_intra += n_intra * share * m
        self._deferred.clear()

    def _ring_latency(self, group: Group) -> Tuple[float, List[float]]:
        """Channel 0: the alpha of each hop ring[i] -> ring[i + 1], and their sum."""
        if group.latency is None:
            ring, gpn = self.rings(group).ring0, self.gpn
            alphas = [self._alpha(a // gpn != b // gpn) for a, b in zip(ring, ring[1:] + ring[:1])]
            group.latency = (sum(alphas), alphas)
        return group.latency

    def _gloo(self, ph: Phase, what: str, group, nbytes: float, colour: Optional[str],
              root: Optional[int], coalesced: bool) -> None:
        """One collective as gloo runs it (``paddle_muon_ext.tools.gloo_model``)."""
        from . import gloo_model

        inter = False
        for a, b, size in gloo_model.collective_edges(what, group.ranks, nbytes, root):
            inter = self._send(ph, a, b, size, colour) or inter
        if not coalesced:
            ph.latency[group] = ph.latency.get(group, 0.0) + (
                gloo_model.rounds(what, len(group.ranks)) * self._alpha(inter))

    def add_bound(self, colour: str, group_nodes: int, nbytes: float) -> None:
        """Lower bound of a Muon buffer: reduce + broadcast cross ``n - 1`` node cuts."""
        self.bound += 2 * (group_nodes - 1) * nbytes
        self.colour_bound[colour] += 2 * (group_nodes - 1) * nbytes

    def replay(self, ops: Iterable[Tuple[mst.CommOp, float]]) -> None:
        """Charge group-level ops (each once, with its payload bytes), in schedule order.

        On nccl a run of consecutive rooted ops that differ only in size (the
        chunks of one bucket: same trigger, phase, group object, root, colour
        and coalescing) is charged as one op of their summed bytes, ``count``
        times the calls, launches and latency: the model is linear in the bytes,
        and a 100,000-matrix model's 50,000 chunk reduces become one charge per
        bucket. Runs never reorder ops (a phase's first op still names its
        trigger, an uncoalesced op's latency still precedes a coalesced launch).
        """
        launched = set()
        run = None  # [key, op, summed bytes, count]
        for op, nbytes in ops:
            if self.backend != "gloo" and op.op not in RING_OPS:
                key = (id(op.group), op.trigger, op.phase, op.op, op.root, op.colour,
                       op.coalesced)
                if run is not None and run[0] == key:
                    run[2] += nbytes
                    run[3] += 1
                    continue
                if run is not None:
                    self._replay_one(run[1], run[2], run[3], launched)
                run = [key, op, nbytes, 1]
                continue
            if run is not None:
                self._replay_one(run[1], run[2], run[3], launched)
                run = None
            self._replay_one(op, nbytes, 1, launched)
        if run is not None:
            self._replay_one(run[1], run[2], run[3], launched)

    def _replay_one(self, op: mst.CommOp, nbytes: float, count: int, launched: set) -> None:
        """Charge ``count`` ops like ``op`` moving ``nbytes`` in all (see :meth:`replay`)."""
        name, kind = cost_phase(op)
        ph = self.phase(name)
        self.phase_triggers.setdefault(name, op.trigger)
        group = self._group(op.group)
        if op.op in RING_OPS:
            self.ring_collective(ph, kind, op.op, group, nbytes)
            return
        colour = "dense" if op.colour is None else "moe"
        hier = kind in ("node", "same_card")
        coalesced = op.coalesced and hier
        self.rooted(ph, kind, op.op, group, op.root, nbytes, colour, coalesced=coalesced,
                    count=count)
        if not op.coalesced:
            self.launches[kind] += self._mult * count
        elif (name, group) not in launched:
            launched.add((name, group))
            self.launches[kind] += self._mult
            if hier:
                alpha = (self.ab.alpha_nvlink if kind == "node" else self.ab.alpha_net)
                ph.latency[group] = (len(group.ranks) - 1) * alpha

    def declare(self, ops: Iterable[mst.CommOp]) -> None:
        """Create the phases of ``ops`` in this order (their first op names the trigger).

        Replays by class charge ops out of the world's issue order; declaring
        the world's order first keeps the report's phase order.
        """
        for op in ops:
            name = cost_phase(op)[0]
            self.phase(name)
            self.phase_triggers.setdefault(name, op.trigger)

    def replay_class(self, ops: Iterable[Tuple[mst.CommOp, float]],
                     members: Sequence[Sequence[int]]) -> None:
        """Charge the ops of one template group once for each of ``members``.

        Args:
            ops: group-level ops whose groups lie inside ``members[0]`` (the
                template), as for :meth:`replay`.
            members: rank tuples, the template first; entry ``i`` of every
                member plays the template's entry ``i``. The caller guarantees
                the renaming keeps each rank's card and the node pattern
                (which entries share a node, in node order) and each entry's
                order among its node's entries, so every copy moves the same
                bytes; each copy's inter-node bytes go to its own ranks' rails.
        """
        template = tuple(members[0])
        if any(len(m) != len(template) for m in members):
            raise ValueError(f"replay_class: members of unequal size for template {template}")
        saved = (self._mult, self._local, self._deferred, self._local_rails)
        self._mult, self._local, self._deferred, self._local_rails = len(members), {}, {}, {}
        try:
            self.replay(ops)
            self._flush()
            self._blocks.append((template, [tuple(m) for m in members], self._local,
                                 self._local_rails))
        finally:
            self._mult, self._local, self._deferred, self._local_rails = saved

    def _expand_blocks(self) -> None:
        """Copy each class template's per-rank bytes onto every member."""
        gpn = self.gpn
        for template, members, local, rails in self._blocks:
            index = {r: i for i, r in enumerate(template)}
            for (r, muon), nbytes in rails.items():
                i = index[r]
                for m in members:
                    self._rail(m[i] % gpn, nbytes, muon)
            for name, (intra, inter) in local.items():
                ph = self.phases[name]
                for i, r in enumerate(template):
                    a, e = intra.get(r, 0.0), inter.get(r, 0.0)
                    if a:
                        for m in members:
                            ph.intra[m[i]] += a
                    if e:
                        for m in members:
                            ph.inter[m[i]] += e
        self._blocks.clear()

    def summary(self) -> Dict[str, Any]:
        self._flush()
        self._expand_blocks()
        intra = [0.0] * self.world
        inter = [0.0] * self.world
        for ph in self.phases.values():
            intra = [x + y for x, y in zip(intra, ph.intra)]
            inter = [x + y for x, y in zip(inter, ph.inter)]
        phase_times = OrderedDict((n, ph.time(self.ab)) for n, ph in self.phases.items())
        muon_time = sum(t for n, t in phase_times.items() if n not in OTHER_PHASES)
        return {
            "collectives_per_step": {k: self.calls[k] for k in KINDS},
            "collectives_total": sum(self.calls[k] for k in KINDS),
            "collectives_detail": {k: dict(self.detail[k]) for k in KINDS},
            "coalesced_launches_per_step": {k: self.launches[k] for k in KINDS},
            "inter_node_bytes": self.muon_inter,
            "inter_node_bytes_bound": self.bound,
            "inter_node_ratio_to_bound": ratio(self.muon_inter, self.bound),
            "intra_node_bytes": self.muon_intra,
            "inter_node_bytes_all": self.muon_inter + self.other_inter,
            "intra_node_bytes_all": self.muon_intra + self.other_intra,
            "bytes_per_rank": {
                "intra_node": {"max": max(intra), "mean": sum(intra) / self.world},
                "inter_node": {"max": max(inter), "mean": sum(inter) / self.world},
            },
            "rail_bytes": list(self.rail_muon),
            "rail_imbalance": max_over_mean(self.rail_muon),
            "rail_imbalance_all": max_over_mean(self.rail_all),
            "by_colour": {
                colour: {
                    "inter_node_bytes": self.colour_inter[colour],
                    "inter_node_bytes_bound": self.colour_bound[colour],
                    "inter_node_ratio_to_bound": ratio(self.colour_inter[colour],
                                                       self.colour_bound[colour]),
                    "rail_bytes": list(self.colour_rail[colour]),
                    "rail_imbalance": max_over_mean(self.colour_rail[colour]),
                }
                for colour in ("dense", "moe")
            },
            "estimated_time_s": sum(phase_times.values()),
            "estimated_muon_time_s": muon_time,
            "estimated_time_phases_s": dict(phase_times),
            "phase_triggers": dict(self.phase_triggers),
        }
