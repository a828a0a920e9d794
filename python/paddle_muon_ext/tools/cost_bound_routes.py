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
"""Floors of the routes the cost model takes (:mod:`cost_bound`'s per-route
arithmetic): the bytes a flat NCCL chain, the hierarchical route or gloo's
reduce / broadcast send at the least, the exact busiest rank of the
element-wise rings, and the latency each route pays. The derivation is in
:mod:`paddle_muon_ext.tools.cost_model`'s docstring ("Lower bound");
:mod:`cost_bound` combines these into the step's bound. Functions take
:class:`GroupLoad` records (defined here, re-exported by :mod:`cost_bound`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

from .cost_model import AlphaBeta

__all__ = ["GLOO_EXACT_RANKS", "GroupLoad", "chain_latency_s", "flat_roots_floor_s",
           "gloo_flat_pair_floor_s", "gloo_muon_latency_s", "gloo_reduce_ring_s", "ring_rank_seconds", "route_floor_s",
           "route_link_bytes"]


@dataclass(frozen=True)
class GroupLoad:
    """One group's share of a phase family.

    Attributes:
        ranks: ranks in the group (``p``).
        nodes: nodes the group spans (``n``).
        per_node: most of its ranks on one node (``k``).
        nbytes: payload bytes the family moves in the group (``S``).
        launches: collectives every configuration launches at least (the
            element-wise families: one buffer per dtype at the least, whatever
            the buffer size; 1 elsewhere).
        members: the group's ranks (empty: unknown; the ring families then
            fall back to the mean over the rank set).
        gpus_per_node: ranks per node, for ``members`` (0: unknown).
    """

    ranks: int
    nodes: int
    per_node: int
    nbytes: float
    launches: int = 1
    # where the group sits, for the exact ring floor (not part of its identity)
    members: Tuple[int, ...] = field(default=(), compare=False, repr=False)
    gpus_per_node: int = field(default=0, compare=False, repr=False)


def chain_latency_s(g: GroupLoad, ab: AlphaBeta) -> float:
    """Latency the model charges one flat reduce / broadcast of ``g``, at the least.

    A flat op pays every hop of its channel-0 chain: the ring's ``n`` node
    cuts (``alpha_net``) and ``p - n`` in-node hops (``alpha_nvlink``; one node:
    ``p`` in-node hops) less the one edge the root's chain leaves out, at most
    the dearest of them.

    Args:
        g: the group.
        ab: alpha-beta constants.

    Returns:
        float: seconds (0 for a group of one rank or no bytes).
    """
    if g.ranks < 2 or g.nbytes <= 0:
        return 0.0
    if g.nodes <= 1:
        return (g.ranks - 1) * ab.alpha_nvlink
    full = g.nodes * ab.alpha_net + (g.ranks - g.nodes) * ab.alpha_nvlink
    dearest = max(ab.alpha_net, ab.alpha_nvlink) if g.ranks > g.nodes else ab.alpha_net
    return full - dearest


def route_link_bytes(g: GroupLoad, what: str, backend: str = "nccl",
                     hierarchical: bool = False) -> Tuple[float, float, float]:
    """Fewest bytes of a Muon reduce / broadcast of ``g`` as the model routes it.

    ``(inter, intra, either)``: bytes that cross nodes, bytes that stay inside
    one, and bytes that may do either (each at the cheaper beta). NCCL flat: a
    chain is its ring less one edge per channel, and a ring crosses each of
    the ``n`` node cuts once per channel: ``(n - 1) S`` across, ``S`` more on
    the cut or inside (the left-out edge), the rest of ``(p - 1) S`` inside
    (a group with one rank per node: all ``(n - 1) S`` across). NCCL
    hierarchical (the dense colour): each node's non-roots send ``S`` inside,
    the same-card chains ``(n - 1) S`` across. gloo reduce flat: its
    rank-order ring (``n`` cuts of ``(p - 1) / p S``, the other ``p - n``
    edges inside) and ``p - 1`` slices of ``S / p`` to the root, ``p - k`` of
    them at least from other nodes; hierarchical: the same inside each node
    (``k_N - 1 / k_N`` times ``S`` per node; ``p - n`` at the least, ``p -
    n / k`` when every node holds ``k``) and across each same-card group
    (``(n - 1)(1 + 1 / n) S``). gloo broadcast (a binomial tree, either
    route): ``(p - 1) S``, ``(n - 1) S`` of it across at the least.

    Args:
        g: the group.
        what: ``"reduce"`` or ``"broadcast"``.
        backend: ``"nccl"`` or ``"gloo"``.
        hierarchical: the hierarchical route (else flat).

    Returns:
        tuple: inter-node, intra-node and either-link bytes.
    """
    p, n, k, S = g.ranks, g.nodes, g.per_node, g.nbytes
    if p < 2 or S <= 0:
        return 0.0, 0.0, 0.0
    if backend == "gloo" and what == "reduce":
        if hierarchical:
            inside = p - n / k if p == n * k else p - n
            return (n - 1) * (1 + 1 / n) * S if n > 1 else 0.0, inside * S, 0.0
        ring_inter = n if n > 1 else 0
        share = (p - 1) / p * S
        return (ring_inter * share + (p - k) / p * S, (p - ring_inter) * share,
                (k - 1) / p * S)
    if backend == "gloo" or hierarchical:
        if backend == "gloo" and not hierarchical:
            return (n - 1) * S, 0.0, (p - n) * S
        return (n - 1) * S, (p - n) * S, 0.0
    if n <= 1:
        return 0.0, (p - 1) * S, 0.0
    if p == n:
        return (n - 1) * S, 0.0, 0.0
    return (n - 1) * S, (p - n - 1) * S, S


def route_floor_s(g: GroupLoad, ab: AlphaBeta, what: str, backend: str = "nccl",
                  hierarchical: bool = False) -> float:
    """Link-seconds of :func:`route_link_bytes`, summed over ``g``'s senders.

    Args:
        g: the group.
        ab: alpha-beta constants.
        what: ``"reduce"`` or ``"broadcast"``.
        backend: ``"nccl"`` or ``"gloo"``.
        hierarchical: the hierarchical route.

    Returns:
        float: seconds.
    """
    if backend == "gloo" and not hierarchical and g.members and g.gpus_per_node > 0 \
            and 1 < g.ranks <= GLOO_EXACT_RANKS and g.nbytes > 0:
        return g.nbytes * _gloo_rooted_rate(tuple(sorted(g.members)), g.gpus_per_node, what,
                                            ab.beta_net, ab.beta_nvlink)
    inter, intra, either = route_link_bytes(g, what, backend, hierarchical)
    return inter * ab.beta_net + intra * ab.beta_nvlink + either * min(ab.beta_net,
                                                                       ab.beta_nvlink)


def ring_rank_seconds(groups: Sequence[GroupLoad], ab: AlphaBeta, backend: str = "nccl",
                      passes: int = 1) -> Optional[float]:
    """The busiest rank's link-seconds in ring collectives of ``groups``, exactly.

    The element-wise families are rings whatever the options, and a group's
    bytes are split over its buffers in proportion, so each rank sends what
    its ring position gives it: NCCL, the model's channel rings
    (:func:`.cost_rings.ring_structure`, ``(p - 1) / p S / C`` an edge); gloo,
    one ring in rank order (``passes`` times ``(p - 1) / p S`` to the next
    rank). A rank in several groups adds them up.

    Args:
        groups: the family's groups, with ``members`` and ``gpus_per_node``.
        ab: alpha-beta constants.
        backend: ``"nccl"`` or ``"gloo"``.
        passes: times the ring carries the bytes.

    Returns:
        float or None: seconds; None when a group's members are unknown.
    """
    from .cost_rings import ring_structure

    per: Dict[int, float] = {}
    for g in groups:
        if g.ranks < 2 or g.nbytes <= 0:
            continue
        if not g.members or g.gpus_per_node <= 0:
            return None
        gpn, ranks, p = g.gpus_per_node, tuple(sorted(g.members)), g.ranks
        if backend == "gloo":
            size = passes * (p - 1) / p * g.nbytes
            for i, r in enumerate(ranks):
                beta = ab.beta_net if r // gpn != ranks[(i + 1) % p] // gpn else ab.beta_nvlink
                per[r] = per.get(r, 0.0) + size * beta
            continue
        rings = ring_structure(ranks, gpn)
        share = passes * (p - 1) / p * g.nbytes / rings.channels
        for r, k_intra, k_inter in rings.senders[0]:
            per[r] = per.get(r, 0.0) + share * (k_intra * ab.beta_nvlink
                                                + k_inter * ab.beta_net)
    return max(per.values(), default=0.0)


def flat_roots_floor_s(g: GroupLoad, ab: AlphaBeta, what: str) -> float:
    """The least time of ``g``'s flat NCCL reduce / broadcast family, its
    launches and its busiest rank weighed together.

    Every op has one root and pays its chain (:func:`chain_latency_s`), so
    ``B`` roots take ``max(B, d)`` ops. A reduce's chain leaves out only the
    root's own edge: a rank that roots nothing sends every byte, ``S`` at its
    channels' betas (the cheapest rank's, not knowing which). A broadcast's
    chain leaves out the edge into the root, one sender a channel: ``B`` roots
    spare at most ``B C`` ranks (``C`` channels), so with ``B C < p`` some rank
    sends all of ``S``. Else the busiest rank sends the mean of the route's
    bytes (:func:`route_floor_s`). Needs ``members``; 0 without them.

    Args:
        g: the group (``launches``: its dtypes, ``d``).
        ab: alpha-beta constants.
        what: ``"reduce"`` or ``"broadcast"``.

    Returns:
        float: seconds.
    """
    from .cost_rings import ring_structure

    if g.ranks < 2 or g.nbytes <= 0 or not g.members or g.gpus_per_node <= 0:
        return 0.0
    p, d = g.ranks, g.launches
    rings = ring_structure(tuple(sorted(g.members)), g.gpus_per_node)
    c = rings.channels
    rate = min((k_intra * ab.beta_nvlink + k_inter * ab.beta_net) / c
               for _, k_intra, k_inter in rings.senders[0])
    chain = chain_latency_s(g, ab)
    spread = p if what == "reduce" else -(-p // c)  # fewest roots sparing every rank
    out = max(d, spread) * chain + route_floor_s(g, ab, what) / p
    if d < spread:
        out = min(out, d * chain + g.nbytes * rate)
    return out


def gloo_muon_latency_s(g: GroupLoad, ab: AlphaBeta, what: str, hierarchical: bool) -> float:
    """The least latency of one Muon reduce / broadcast family of ``g`` on gloo.

    Flat, every op pays its rounds (:func:`.gloo_model.rounds`: ``p`` for a
    reduce, ``ceil(log2 p)`` for a broadcast) at ``alpha_net`` once the group
    crosses nodes (its ring or tree has a cross-node edge), one op per dtype
    at least (``launches``). The hierarchical route's coalesced launches pay
    ``(k - 1) alpha_nvlink`` inside and ``(n - 1) alpha_net`` across, and an
    uncoalesced op there pays at least as much. The cheaper route.

    Args:
        g: the group.
        ab: alpha-beta constants.
        what: ``"reduce"`` or ``"broadcast"``.
        hierarchical: the family may route hierarchically (default colour).

    Returns:
        float: seconds (0 for a group of one rank or no bytes).
    """
    from .gloo_model import rounds

    if g.ranks < 2 or g.nbytes <= 0:
        return 0.0
    alpha = ab.alpha_net if g.nodes > 1 else ab.alpha_nvlink
    flat = g.launches * rounds(what, g.ranks) * alpha
    if not hierarchical:
        return flat
    return min(flat, (g.nodes - 1) * ab.alpha_net + (g.per_node - 1) * ab.alpha_nvlink)


def gloo_reduce_ring_s(groups: Sequence[GroupLoad], ab: AlphaBeta) -> float:
    """The busiest rank's link-seconds in the rings of flat gloo reduces of ``groups``.

    A flat gloo reduce runs a ring reduce-scatter in the group's rank order
    whatever its root (:func:`.gloo_model.reduce_edges`), so every rank sends
    ``(p - 1) / p`` of each op's bytes to its successor: over the family,
    ``(p - 1) / p S`` of each group at that edge's beta, exactly
    (:func:`ring_rank_seconds`, one pass). The mean over the ranks
    (:func:`route_floor_s`) lets the ranks whose edge leaves the node share
    the dearer beta of the in-node edges (a network faster than NVLink: the
    in-node senders are the busiest); the root's slices come on top.

    Args:
        groups: the family's groups, with ``members`` and ``gpus_per_node``.
        ab: alpha-beta constants.

    Returns:
        float: seconds (0 when a group's members are unknown).
    """
    out = ring_rank_seconds(groups, ab, "gloo")
    return 0.0 if out is None else out


def gloo_flat_pair_floor_s(g: GroupLoad, ab: AlphaBeta) -> float:
    """The least time of ``g``'s flat gloo Muon reduce and broadcast together,
    their owners weighed against their launches.

    Each Muon buffer has one owner: it is reduced onto it and broadcast from
    it, one op at the least each (``d`` dtypes: ``d`` buffers at the least).
    With ``m`` distinct owners, both phases issue ``max(m, d)`` ops, each
    paying :func:`.gloo_model.rounds` rounds (``p`` a reduce, ``ceil(log2
    p)`` a broadcast) at ``alpha_net`` once ``g`` crosses nodes. A broadcast
    is a binomial tree whose root sends the whole op to each of its children,
    so the ``m`` owners together send at least ``S c`` (``c``: the cheapest
    root's link-seconds a byte to its own children) and the busiest of them
    ``S c / m``; the busiest rank also sends at least the mean of the
    broadcast's bytes (:func:`route_floor_s` over ``p``). The reduce's
    busiest rank sends at least its mean. A rank's load in a phase is at
    least its load from ``g``, and the phase takes ``g``'s latency at the
    least, so the two phases take at least, for some ``m`` in ``1 .. p``:
    ``max(m, d) (R_reduce + R_broadcast) alpha + reduce mean + max(broadcast
    mean, S c / m)``; the floor is the least over ``m``. (Few owners save
    launches and load the roots; the separate floors take one launch for the
    reduce and ``p`` roots for the broadcast.)

    Args:
        g: the group (``launches``: its dtypes, ``d``; ``members`` for the
            exact roots, else ``c`` counts every child at the cheaper beta).
        ab: alpha-beta constants.

    Returns:
        float: seconds (0 for a group of one rank or no bytes).
    """
    from .gloo_model import rounds

    p, S = g.ranks, g.nbytes
    if p < 2 or S <= 0:
        return 0.0
    alpha = ab.alpha_net if g.nodes > 1 else ab.alpha_nvlink
    per_op = (rounds("reduce", p) + rounds("broadcast", p)) * alpha
    reduce_mean = max(route_floor_s(g, ab, "reduce", "gloo") / p,
                      gloo_reduce_ring_s([g], ab))
    bcast_mean = route_floor_s(g, ab, "broadcast", "gloo") / p
    if g.members and g.gpus_per_node > 0 and p <= GLOO_EXACT_RANKS:
        root = _gloo_root_rate(tuple(sorted(g.members)), g.gpus_per_node, ab.beta_net,
                               ab.beta_nvlink)
    else:
        root = rounds("broadcast", p) * min(ab.beta_net, ab.beta_nvlink)
    return min(max(m, g.launches) * per_op + reduce_mean + max(bcast_mean, S * root / m)
               for m in range(1, p + 1))


#: Largest gloo group whose every root is tried (:func:`route_floor_s`).
GLOO_EXACT_RANKS = 512


@functools.lru_cache(maxsize=256)
def _gloo_rooted_rate(ranks: Tuple[int, ...], gpn: int, what: str, beta_net: float,
                      beta_nvlink: float) -> float:
    """The cheapest root's link-seconds per byte of a flat gloo reduce / broadcast."""
    from .gloo_model import collective_edges

    best = None
    for root in ranks:
        t = sum(size * (beta_net if a // gpn != b // gpn else beta_nvlink)
                for a, b, size in collective_edges(what, ranks, 1.0, root))
        best = t if best is None else min(best, t)
    return best or 0.0


@functools.lru_cache(maxsize=256)
def _gloo_root_rate(ranks: Tuple[int, ...], gpn: int, beta_net: float,
                    beta_nvlink: float) -> float:
    """The cheapest root's own link-seconds per byte in a gloo broadcast: the
    binomial tree's root sends to the relative indices 1, 2, 4, ... below ``p``
    (:func:`.gloo_model.broadcast_edges`)."""
    p = len(ranks)
    offsets = [1 << j for j in range((p - 1).bit_length())]
    return min(sum(beta_net if a // gpn != ranks[(i + o) % p] // gpn else beta_nvlink
                   for o in offsets)
               for i, a in enumerate(ranks))
