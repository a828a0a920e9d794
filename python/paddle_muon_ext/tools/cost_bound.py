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
"""A lower bound on one step's communication time, for a layout and a model.

The bound holds for every configuration ``plan`` can estimate for that layout
and model (``comm_group_call_opt`` on or off, any owner rule, any buffer
size): every configuration's :mod:`cost_model` estimate is at least the
bound, so ``estimate / bound`` says how much any choice could still gain.
The derivation is in :mod:`paddle_muon_ext.tools.cost_model`'s docstring
("Lower bound"); this module holds the arithmetic, as pure functions of
:class:`GroupLoad` records. :func:`layout_families` reads them off a layout.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .cost_bound_routes import (GroupLoad, chain_latency_s, flat_roots_floor_s,
                                gloo_flat_pair_floor_s,
                                gloo_muon_latency_s, gloo_reduce_ring_s, ring_rank_seconds,
                                route_floor_s, route_link_bytes)
from .cost_model import BACKENDS, AlphaBeta

__all__ = ["FAMILIES", "MUON_FAMILIES", "RING_FAMILIES", "GroupLoad", "bandwidth_floor_s",
           "chain_latency_s", "family_floor_s", "flat_roots_floor_s", "gloo_flat_pair_floor_s",
           "gloo_muon_latency_s", "gloo_reduce_ring_s", "hooked_hierarchical_pair_s",
           "hooked_hierarchical_reduce_s", "latency_floor_s", "layout_families",
           "link_floor_bytes", "muon_latency_s", "ring_latency_s", "ring_link_bytes",
           "ring_rank_seconds", "route_floor_s", "route_link_bytes", "step_bound"]

#: The model's phase families: Muon reduce and broadcast of the dense colour
#: (flat ``dense_*`` or hierarchical ``intra_node_*`` + ``cross_node_*``) and of
#: the MoE colour, and the element-wise reduce-scatter / all-gather.
FAMILIES = ("dense_reduce", "dense_broadcast", "moe_reduce", "moe_broadcast",
            "reduce_scatter", "all_gather")
#: Families the model always runs as rings (no option changes them; gloo's
#: rings are in ascending rank order, node by node as NCCL's).
RING_FAMILIES = ("reduce_scatter", "all_gather")
#: The Muon families (owner reduce / broadcast); only the dense colour's may
#: route hierarchically.
MUON_FAMILIES = ("dense_reduce", "dense_broadcast", "moe_reduce", "moe_broadcast")


def link_floor_bytes(g: GroupLoad) -> Tuple[float, float]:
    """Fewest (inter-node, intra-node) bytes a reduce / broadcast / reduce-scatter /
    all-gather of ``g`` can send: ``((n - 1) S, (p - n) S)``.

    Args:
        g: the group.

    Returns:
        tuple: inter-node and intra-node bytes (0, 0 for a group of one rank).
    """
    if g.ranks < 2 or g.nbytes <= 0:
        return 0.0, 0.0
    return (g.nodes - 1) * g.nbytes, (g.ranks - g.nodes) * g.nbytes


def ring_link_bytes(g: GroupLoad) -> Tuple[float, float]:
    """(inter-node, intra-node) bytes of a ring reduce-scatter / all-gather of ``g``.

    Every channel ring crosses each of the ``n`` node boundaries once and has
    ``p`` edges of ``(p - 1) / p`` of the channel's share: ``n (p - 1) / p S``
    across nodes, ``(p - n) (p - 1) / p S`` inside them (all ``(p - 1) S``
    inside one node).

    Args:
        g: the group.

    Returns:
        tuple: inter-node and intra-node bytes (0, 0 for a group of one rank).
    """
    if g.ranks < 2 or g.nbytes <= 0:
        return 0.0, 0.0
    share = (g.ranks - 1) / g.ranks * g.nbytes
    crossings = g.nodes if g.nodes > 1 else 0
    return crossings * share, (g.ranks - crossings) * share


def bandwidth_floor_s(g: GroupLoad, ab: AlphaBeta, ring: bool = False, passes: int = 1) -> float:
    """Link-seconds ``g`` needs at least, summed over its ranks (not yet spread).

    The inter-node floor bytes pay ``beta_net``; the rest of the ``(p - 1) S``
    bytes pay the cheaper of the two betas (a byte between two cards of one
    node could not be cheaper than either link).

    Args:
        g: the group.
        ab: alpha-beta constants.
        ring: the bytes of a ring reduce-scatter / all-gather
            (:func:`ring_link_bytes`), each at its own link's beta.
        passes: times the ring carries them (gloo's reduce-scatter is its
            ring all-reduce: 2).

    Returns:
        float: seconds (sum over the group's senders).
    """
    if ring:
        inter, intra = ring_link_bytes(g)
        return passes * (inter * ab.beta_net + intra * ab.beta_nvlink)
    inter, intra = link_floor_bytes(g)
    return inter * ab.beta_net + intra * min(ab.beta_net, ab.beta_nvlink)


def latency_floor_s(g: GroupLoad, ab: AlphaBeta, backend: str = "nccl") -> float:
    """Latency of one launch of ``g``'s family, the least any path pays.

    NCCL (chains and rings): a byte from the farthest rank crosses ``n - 1``
    node cuts and ``k - 1`` hops inside its node, as the coalesced
    hierarchical launch charges; a flat chain of ``p - 1`` hops pays at
    least as much. gloo: at least one round.

    Args:
        g: the group.
        ab: alpha-beta constants.
        backend: ``"nccl"`` or ``"gloo"``.

    Returns:
        float: seconds (0 for a group of one rank or no bytes).

    Raises:
        ValueError: unknown backend.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if g.ranks < 2 or g.nbytes <= 0:
        return 0.0
    cheapest = min(ab.alpha_net, ab.alpha_nvlink)
    if backend == "gloo":
        return cheapest
    return (g.nodes - 1) * ab.alpha_net + (g.per_node - 1) * cheapest


def ring_latency_s(g: GroupLoad, ab: AlphaBeta, backend: str = "nccl", passes: int = 1) -> float:
    """Latency of ``g``'s element-wise family as rings, the least any configuration pays.

    NCCL: the model charges a ring reduce-scatter / all-gather the alpha of
    every hop of channel 0 but the one closing the ring: its ``n`` node cuts
    less the closing one at ``alpha_net``, its ``p - n`` in-node hops at
    ``alpha_nvlink`` (one node: ``p - 1`` in-node hops). gloo: ``p - 1``
    rounds a pass (``passes``: 2 for its reduce-scatter, a ring all-reduce),
    each at ``alpha_net`` once the ring crosses nodes. No option changes a
    ring, and every configuration launches one at least per buffer
    (``launches``).

    Args:
        g: the group.
        ab: alpha-beta constants.
        backend: ``"nccl"`` or ``"gloo"``.
        passes: gloo's passes round the ring.

    Returns:
        float: seconds (0 for a group of one rank or no bytes).
    """
    if g.ranks < 2 or g.nbytes <= 0:
        return 0.0
    if backend == "gloo":
        alpha = ab.alpha_net if g.nodes > 1 else ab.alpha_nvlink
        return g.launches * passes * (g.ranks - 1) * alpha
    if g.nodes > 1:
        one = (g.nodes - 1) * ab.alpha_net + (g.ranks - g.nodes) * ab.alpha_nvlink
    else:
        one = (g.ranks - 1) * ab.alpha_nvlink
    return g.launches * one


def muon_latency_s(g: GroupLoad, ab: AlphaBeta, hierarchical: bool,
                   hooked: bool = False) -> float:
    """The least latency of one Muon reduce / broadcast family of ``g`` on NCCL.

    Flat, every op (chunk or parameter) pays its chain (:func:`chain_latency_s`)
    and every configuration issues one op per dtype at least (``launches``).
    The hierarchical route (the default colour only) pays the coalesced
    launches once: ``(n - 1) alpha_net`` across nodes and ``(k - 1)
    alpha_nvlink`` inside one -- per dtype inside the node when the backward
    hooks launch each buffer's intra-node reduce (``hooked``: ``comm_overlap``).
    The family's floor is the cheaper route.

    Args:
        g: the group.
        ab: alpha-beta constants.
        hierarchical: the family may route hierarchically (default colour).
        hooked: the intra-node reduces are launched one by one (comm_overlap).

    Returns:
        float: seconds (0 for a group of one rank or no bytes).
    """
    if g.ranks < 2 or g.nbytes <= 0:
        return 0.0
    flat = g.launches * chain_latency_s(g, ab)
    if not hierarchical:
        return flat
    intra = (g.per_node - 1) * ab.alpha_nvlink * (g.launches if hooked else 1)
    return min(flat, (g.nodes - 1) * ab.alpha_net + intra)


def hooked_hierarchical_reduce_s(g: GroupLoad, ab: AlphaBeta) -> float:
    """The least time of a stage's dense reduce on the hierarchical route under
    ``comm_overlap`` (the hooks launch each buffer's intra-node reduce alone).

    With ``B`` buffers (at least one per dtype) the owners are at most ``B``
    ranks. Intra-node: ``B`` launches of ``k - 1`` NVLink hops, and in every
    node each buffer goes to the rank on its owner's card, so a rank sends
    ``S`` less what its card owns: ``S`` when ``B < k`` leaves a card without
    owners, else ``(k - 1) / k S`` at the least, at ``beta_nvlink``.
    Cross-node (coalesced): ``n - 1`` network hops, and a card's buffer
    goes down its same-card chain to the owner, so rank (node, card) sends
    the card's bytes ``S_c`` less its own: all of ``S_c`` on a card whose
    owners sit on fewer than ``n`` nodes ("partial"), ``(n - 1) / n S_c`` at the
    least on one with owners on every node ("full", ``n`` owners). With
    ``f`` full and ``q`` partial cards (``f n + q <= B``, ``f + q <= k``) the
    busiest rank sends ``X >= S / (f n / (n - 1) + q)``; ``cap(B)``, the
    largest such sum, gives ``S beta_net / cap(B)``. The least over ``B``
    (up to ``k n``, past which nothing spreads further): more buffers
    spread the rails but pay more launches.

    Args:
        g: the stage's dense Muon group (``launches``: its dtypes).
        ab: alpha-beta constants.

    Returns:
        float: seconds (0 for a group of one rank or no bytes).
    """
    return _hooked_s(g, ab, False)


def hooked_hierarchical_pair_s(g: GroupLoad, ab: AlphaBeta) -> float:
    """The least time of a stage's dense reduce and broadcast together on the
    hierarchical route under ``comm_overlap``.

    The broadcast runs from the reduce's owners, coalesced (one ``(n - 1)
    alpha_net + (k - 1) alpha_nvlink``), down the same chains the other way:
    a rank sends each buffer but those whose chain it ends, one rank a
    buffer, so the owners' count bounds its spread as the reduce's
    (:func:`hooked_hierarchical_reduce_s`: the same intra-node bytes and
    ``S beta_net / cap(B)``), with the same ``B``.

    Args:
        g: the stage's dense Muon group (``launches``: its dtypes).
        ab: alpha-beta constants.

    Returns:
        float: seconds (0 for a group of one rank or no bytes).
    """
    return _hooked_s(g, ab, True)


def _hooked_s(g: GroupLoad, ab: AlphaBeta, pair: bool) -> float:
    if g.ranks < 2 or g.nbytes <= 0:
        return 0.0
    n, k, S = g.nodes, g.per_node, g.nbytes

    def cross(b: int) -> float:
        if n < 2:
            return 0.0
        cap = max(f * n / (n - 1) + min(k - f, b - f * n) for f in range(min(k, b // n) + 1))
        return S * ab.beta_net / cap

    def intra(b: int) -> float:
        return S * ab.beta_nvlink * (1.0 if b < k else (k - 1) / k)

    phases = 2 if pair else 1
    fixed = phases * (n - 1) * ab.alpha_net + (k - 1) * ab.alpha_nvlink * (phases - 1)
    return fixed + min(b * (k - 1) * ab.alpha_nvlink + phases * (intra(b) + cross(b))
                       for b in range(g.launches, max(g.launches, k * n) + 1))


def _muon_routes_s(name: str, rank_sets: Sequence[Tuple[int, Sequence[GroupLoad]]],
                   ab: AlphaBeta, backend: str, comm_overlap: bool) -> Tuple[float, float]:
    """A Muon family's floor on the flat route and on the hierarchical one
    (each route's latency and bytes; ``inf`` where the colour has no
    hierarchical route)."""
    what = name.split("_", 1)[1]
    groups = [g for _, gs in rank_sets for g in gs]
    lat, bw = family_floor_s(rank_sets, ab, backend, False, (False, False), 1, what)
    flat = lat + bw
    if backend == "nccl":
        flat = max([flat] + [flat_roots_floor_s(g, ab, what) for g in groups])
    elif what == "reduce":
        # a flat gloo reduce's ring is in rank order whatever its root: the
        # busiest rank's ring bytes exactly, not the stage's mean
        flat = max(flat, lat + gloo_reduce_ring_s(groups, ab))
    if not name.startswith("dense_"):
        return flat, float("inf")
    hooked = comm_overlap and what == "reduce" and backend == "nccl"
    hier = max(((g.nodes - 1) * ab.alpha_net
                + (g.per_node - 1) * ab.alpha_nvlink * (g.launches if hooked else 1)
                for g in groups if g.ranks > 1 and g.nbytes > 0), default=0.0)
    hier += max((sum(route_floor_s(g, ab, what, backend, True) for g in gs) / size
                 for size, gs in rank_sets if size), default=0.0)
    if hooked:
        hier = max([hier] + [hooked_hierarchical_reduce_s(g, ab) for g in groups])
    return flat, hier


def family_floor_s(rank_sets: Sequence[Tuple[int, Sequence[GroupLoad]]], ab: AlphaBeta,
                   backend: str = "nccl", ring: bool = False,
                   muon: Optional[Tuple[bool, bool]] = None, passes: int = 1,
                   what: Optional[str] = None) -> Tuple[float, float]:
    """(latency, bandwidth) floor of one phase family.

    Args:
        rank_sets: ``(number of ranks, groups whose senders lie among them)``,
            e.g. each pipeline stage with its groups; the busiest rank of a
            set sends at least the set's mean.
        ab: alpha-beta constants.
        backend: ``"nccl"`` or ``"gloo"``.
        ring: the family runs as rings whatever the options
            (:func:`bandwidth_floor_s`, :func:`ring_latency_s`); with every
            group's ``members`` known, the busiest rank exactly
            (:func:`ring_rank_seconds`).
        muon: a Muon family, ``(hierarchical, hooked)`` for
            :func:`muon_latency_s` (NCCL) / :func:`gloo_muon_latency_s`;
            None: one launch's generic floor (:func:`latency_floor_s`).
        passes: times the ring carries the bytes (gloo's reduce-scatter: 2).
        what: with ``muon``, ``"reduce"`` or ``"broadcast"``: the bytes of the
            cheaper route the model can take (:func:`route_floor_s`) instead
            of the generic floor.

    Returns:
        tuple: the largest latency of any group (one launch; as rings, its
        rings' launches), and the largest mean link-seconds per rank of any
        rank set (rings with members: the busiest rank's).
    """
    def lat(g: GroupLoad) -> float:
        if ring:
            return ring_latency_s(g, ab, backend, passes)
        if muon is not None and backend == "nccl":
            return muon_latency_s(g, ab, *muon)
        if muon is not None and what is not None:
            return gloo_muon_latency_s(g, ab, what, muon[0])
        return latency_floor_s(g, ab, backend)

    def bw(g: GroupLoad) -> float:
        if muon is not None and what is not None:
            flat = route_floor_s(g, ab, what, backend, False)
            return min(flat, route_floor_s(g, ab, what, backend, True)) if muon[0] else flat
        return bandwidth_floor_s(g, ab, ring, passes)

    latency = max((lat(g) for _, groups in rank_sets for g in groups), default=0.0)
    bandwidth = max((sum(bw(g) for g in groups) / size
                     for size, groups in rank_sets if size), default=0.0)
    if ring:
        exact = ring_rank_seconds([g for _, groups in rank_sets for g in groups], ab, backend,
                                  passes)
        if exact is not None:
            bandwidth = max(bandwidth, exact)
    return latency, bandwidth


def step_bound(families: Mapping[str, Sequence[Tuple[int, Sequence[GroupLoad]]]],
               ab: AlphaBeta, backend: str = "nccl", comm_overlap: bool = False
               ) -> Dict[str, Any]:
    """The step's bound: the sum of every family's latency and bandwidth floor.

    Args:
        families: family name -> rank sets (:func:`family_floor_s`).
        ab: alpha-beta constants.
        backend: ``"nccl"`` or ``"gloo"``.
        comm_overlap: the run's ``comm_overlap`` (every candidate keeps it):
            the hooks launch each dense buffer's intra-node reduce alone.

    Returns:
        dict: ``bound_s`` (seconds), ``families_s`` (name -> seconds) and
        ``inter_node_bytes`` (the floor's inter-node bytes, every family).
    """
    per: Dict[str, float] = {}
    routes: Dict[str, Tuple[float, float]] = {}
    inter = 0.0
    for name, rank_sets in families.items():
        # the element-wise collectives are rings whatever the options (gloo's
        # reduce-scatter is its ring all-reduce: twice round the ring)
        ring = name in RING_FAMILIES
        passes = 2 if backend == "gloo" and name == "reduce_scatter" else 1
        muon = what = None
        if name in MUON_FAMILIES:
            muon = (name.startswith("dense_"), comm_overlap and name == "dense_reduce")
            what = name.split("_", 1)[1]
        latency, bandwidth = family_floor_s(rank_sets, ab, backend, ring, muon, passes, what)
        per[name] = latency + bandwidth
        if muon is not None:
            # each route's latency and bytes together (the hooked dense reduce:
            # its launches and rails weighed per stage)
            routes[name] = _muon_routes_s(name, rank_sets, ab, backend, comm_overlap)
            per[name] = max(per[name], min(routes[name]))
        count = ring_link_bytes if ring else link_floor_bytes
        inter += passes * sum(count(g)[0] for _, groups in rank_sets for g in groups)
    for red, bc in (("dense_reduce", "dense_broadcast"), ("moe_reduce", "moe_broadcast")):
        if red not in routes or bc not in routes:
            continue
        # comm_group_call_opt routes the dense reduce and broadcast together:
        # each route's floor holds for the configurations on it (the MoE
        # colour's are all flat, its hierarchical route inf)
        on = [max(per[red], routes[red][i]) + max(per[bc], routes[bc][i]) for i in (0, 1)]
        if comm_overlap and backend == "nccl" and red == "dense_reduce":
            # the hooked reduce's owners root the broadcast too
            on[1] = max([on[1]] + [hooked_hierarchical_pair_s(g, ab)
                                   for _, groups in families[red] for g in groups])
        if backend == "gloo":
            # the same owners root both phases (gloo_flat_pair_floor_s)
            on[0] = max([on[0]] + [gloo_flat_pair_floor_s(g, ab)
                                   for _, groups in families[red] for g in groups])
        best = min((0, 1), key=lambda i: on[i])
        if on[best] > per[red] + per[bc]:
            per[red] = max(per[red], routes[red][best])
            per[bc] = on[best] - per[red]
    return {"bound_s": sum(per.values()), "families_s": per, "inter_node_bytes": inter}


def _load(ranks: Sequence[int], gpn: int, nbytes: float, launches: int = 1) -> GroupLoad:
    per_node: Dict[int, int] = {}
    for r in ranks:
        per_node[r // gpn] = per_node.get(r // gpn, 0) + 1
    return GroupLoad(len(ranks), len(per_node), max(per_node.values()), float(nbytes),
                     max(1, launches), tuple(ranks), gpn)


def layout_families(plan, stage_metas: Sequence[Sequence[Any]]
                    ) -> Dict[str, List[Tuple[int, List[GroupLoad]]]]:
    """The phase families of a layout and model, for :func:`step_bound`.

    Args:
        plan: the layout's plan (``sharding_group_ranks(stage)``,
            ``moe_sharding_ranks(rank)``, ``gpus_per_node``).
        stage_metas: per pipeline stage, its parameters' layout views
            (``nbytes``, ``use_muon``, ``colour``: None for dense).

    Returns:
        dict: family name (:data:`FAMILIES`) -> one ``(ranks, groups)`` per stage.
    """
    gpn = plan.gpus_per_node
    out: Dict[str, List[Tuple[int, List[GroupLoad]]]] = {f: [] for f in FAMILIES}
    for stage, metas in enumerate(stage_metas):
        sums = {(muon, expert): 0 for muon in (True, False) for expert in (True, False)}
        # buffers are per dtype: each dtype with bytes is one launch at least
        dtypes: Dict[Tuple[bool, bool], set] = {k: set() for k in sums}
        for m in metas:
            key = (bool(m.use_muon), m.colour is not None)
            sums[key] += m.nbytes
            if m.nbytes > 0:
                dtypes[key].add(getattr(m, "dtype", None))
        dense = tuple(plan.sharding_group_ranks(stage))
        moe_groups = {}
        for r in dense:
            group = tuple(plan.moe_sharding_ranks(r))
            moe_groups.setdefault(min(group), group)
        size = len(dense)
        dense_muon = [_load(dense, gpn, sums[(True, False)], len(dtypes[(True, False)]))]
        moe_muon = [_load(g, gpn, sums[(True, True)], len(dtypes[(True, True)]))
                    for g in moe_groups.values()]
        other = [_load(dense, gpn, sums[(False, False)], len(dtypes[(False, False)]))] + [
            _load(g, gpn, sums[(False, True)], len(dtypes[(False, True)]))
            for g in moe_groups.values()]
        for name, groups in (("dense_reduce", dense_muon), ("dense_broadcast", dense_muon),
                             ("moe_reduce", moe_muon), ("moe_broadcast", moe_muon),
                             ("reduce_scatter", other), ("all_gather", other)):
            out[name].append((size, groups))
    return out
