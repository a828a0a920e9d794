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
"""The rail owner rule (``muon_partition_strategy="rail"``) of the hierarchical path.

With ``comm_group_call_opt`` a dense Muon buffer crosses nodes only among the
ranks of its owner's card index: the owner's card is the NIC rail that
carries it. The rail rule places owners so every rail, and every node on it,
carries an even share of those bytes:

1. Matrices are grouped into dtype classes (each ``(owner, dtype)`` pair is
   one fused buffer), placed smallest class first; a class may use at most
   ``ceil(class bytes / one rank's share)`` owners -- the least-loaded ranks
   (ties: rail load, node load, the spread order) -- so a handful of fp32
   router weights in a bf16 model stays one or two buffers.
2. Inside a class, largest first (ties by name): the matrix goes to the
   least-loaded rail (LPT over bytes; ties by the rail's first position in
   the spread order), then on that rail to the least-loaded rank, i.e. the
   least-loaded node of the rail (ties: node load, spread order).

Bytes are the parameter's own (``numel * itemsize``): what its gradient
reduce and parameter broadcast send across nodes. For a class allowed every
rank this is LPT, so the busiest rail carries at most the mean plus the
largest matrix, and the busiest rank of a rail at most its mean plus the
largest matrix. Newton-Schulz cost is not weighed (the ``balanced`` rule
does weigh it).

The result is a pure function of the matrices, their (node, card) positions
and the rank order (all exact integers), so every rank derives the same
owners. Where the rule cannot apply -- no hierarchical plan
(``comm_group_call_opt`` off), or a group on a single node -- the caller uses
the ``balanced`` rule instead (:func:`rail_positions` returns None).
Pure Python (no paddle import).
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .owner_meta import (
    MatrixSpec,
    OwnerPartition,
    _check_rank_order,
    _check_specs,
    _ns_cost_int,
    optimizer_state_bytes,
)
from .types import FLOAT_DTYPE_SIZES as _DTYPE_SIZES

__all__ = ["RAIL_METHOD", "rail_applies", "rail_positions", "rail_partition"]

#: ``OwnerPartition.method`` of the rail rule.
RAIL_METHOD = "rail"


def rail_positions(plan: Any, group_ranks: Sequence[int]) -> Optional[Tuple[Tuple[int, int], ...]]:
    """``(node position, card)`` of every group index, or None where the rail rule does not apply.

    Args:
        plan: the hierarchical plan (``node_of`` / ``card_of``), or None.
        group_ranks: the colour group's global ranks, in group order.

    Returns:
        tuple or None: per group index, the position of its node among the
        group's nodes (ascending) and its card index; None without a plan or
        when the group sits on one node (no rail carries anything across
        nodes: the ``balanced`` rule applies instead).
    """
    if plan is None:
        return None
    ranks = [int(r) for r in group_ranks]
    node_of = [plan.node_of(r) for r in ranks]
    nodes = sorted(set(node_of))
    if len(nodes) < 2:
        return None
    pos = {n: i for i, n in enumerate(nodes)}
    # node positions, not node ids: groups of equal shape (pipeline stages)
    # share one cached result
    return tuple((pos[n], plan.card_of(r)) for n, r in zip(node_of, ranks))


def rail_partition(
    specs: Sequence[MatrixSpec],
    positions: Sequence[Tuple[int, int]],
    rank_order: Optional[Sequence[int]] = None,
    multi_precision: bool = True,
) -> OwnerPartition:
    """Assign every matrix to one owner so rails and nodes carry even bytes.

    Args:
        specs: the group's Muon matrices.
        positions: ``(node, card)`` of every group index (:func:`rail_positions`).
        rank_order: preference among equal loads (group indices; the plan's
            spread order); default ``0..n-1``.
        multi_precision: count fp32 master weights in the reported state bytes.

    Returns:
        OwnerPartition: group-local owners, ``method="rail"``.
    """
    positions = [(int(n), int(c)) for n, c in positions]
    nranks = len(positions)
    if nranks < 1:
        raise ValueError("rail_partition needs at least one rank position")
    items = _check_specs(specs)
    order = _check_rank_order(rank_order, nranks)
    pref = [0] * nranks
    for p, r in enumerate(order):
        pref[r] = p
    node = [n for n, _ in positions]
    card = [c for _, c in positions]

    size: Dict[str, int] = {}
    classes: Dict[str, List[str]] = {}
    for s in items:
        size[s.name] = math.prod(s.shape) * _DTYPE_SIZES[s.dtype]
        classes.setdefault(s.dtype, []).append(s.name)
    total = max(sum(size.values()), 1)
    class_b = {d: sum(size[k] for k in names) for d, names in classes.items()}

    rank_load = [0] * nranks
    rail_load = dict.fromkeys(card, 0)
    node_load = dict.fromkeys(node, 0)
    owner: Dict[str, int] = {}
    for d in sorted(classes, key=lambda d: (class_b[d], d)):
        cap = max(1, min(nranks, -(-class_b[d] * nranks // total)))
        allowed = sorted(range(nranks), key=lambda r: (
            rank_load[r], rail_load[card[r]], node_load[node[r]], pref[r]))[:cap]
        _place_class(sorted(sorted(classes[d]), key=size.__getitem__, reverse=True),
                     allowed, size, node, card, pref, rank_load, rail_load, node_load, owner)
    state = [0] * nranks
    ns = [0] * nranks
    costs: Dict[tuple, Tuple[int, int]] = {}  # (shape, dtype) -> its loads: few kinds
    for s in items:
        cost = costs.get((s.shape, s.dtype))
        if cost is None:
            cost = costs[(s.shape, s.dtype)] = (
                optimizer_state_bytes(s, multi_precision), _ns_cost_int(s.shape))
        r = owner[s.name]
        state[r] += cost[0]
        ns[r] += cost[1]
    return OwnerPartition(nranks=nranks, owners={s.name: owner[s.name] for s in items},
                          state_bytes=state, ns_cost=[float(c) for c in ns],
                          dtypes={s.name: s.dtype for s in items}, method=RAIL_METHOD)


def _place_class(names, allowed, size, node, card, pref, rank_load, rail_load, node_load,
                 owner) -> None:
    """Place one dtype class (names largest first) onto ``allowed`` ranks.

    Loads only grow, so a rank's heap entry made stale (its node grew
    through another rail) is a lower bound of its current key: a top whose
    key is current is the exact minimum.
    """
    on_rail: Dict[int, List[int]] = {}
    for r in allowed:
        on_rail.setdefault(card[r], []).append(r)
    first = {c: min(pref[r] for r in rs) for c, rs in on_rail.items()}
    rails = [(rail_load[c], first[c], c) for c in on_rail]
    heapq.heapify(rails)

    def rank_key(r: int) -> tuple:
        return (rank_load[r], node_load[node[r]], pref[r], r)

    ranks = {c: [rank_key(r) for r in rs] for c, rs in on_rail.items()}
    for heap in ranks.values():
        heapq.heapify(heap)
    for k in names:
        c = rails[0][2]  # rail loads change only here: the top is current
        heap = ranks[c]
        while heap[0] != rank_key(heap[0][3]):  # a node grew through another rail
            heapq.heapreplace(heap, rank_key(heap[0][3]))
        r = heap[0][3]
        b = size[k]
        owner[k] = r
        rank_load[r] += b
        rail_load[c] += b
        node_load[node[r]] += b
        heapq.heapreplace(heap, rank_key(r))
        heapq.heapreplace(rails, (rail_load[c], first[c], c))


def rail_applies(plan: Any) -> bool:
    """Whether the rail rule differs from ``balanced`` anywhere on ``plan``:
    some stage's sharding group spans two or more nodes (the dense colour is
    the one routed hierarchically).

    Args:
        plan: a hierarchical plan, or None (the flat path: never).
    """
    if plan is None:
        return False
    return any(rail_positions(plan, plan.sharding_group_ranks(s)) is not None
               for s in range(plan.pp_degree))
