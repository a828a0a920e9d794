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
"""Who sends how many bytes to whom in gloo's collectives (paddle 3.3.1, CPU).

The plan tool's default model is NCCL's rings; a cluster of CPU processes runs
gloo, whose algorithms differ. Measured on the network-namespace cluster
(``muon_comm.py cluster``, probe mode: one collective of S = 4 MiB at a time,
node-link byte counters, 8 ranks on 4 nodes and 4 ranks on 4 nodes; every
figure below matched to within 0.5 %, the rest is TCP/IP and gloo headers).
A group's ranks form a ring in the group's rank order (index i sends to i+1):

* ``reduce(S, root)``: ring reduce-scatter (every ring edge carries
  ``(p-1)/p * S``), then every other rank sends its reduced ``S/p`` slice
  straight to the root -- ``(p-1) * S * (1 + 1/p)`` in total, not a chain's
  ``(p-1) * S``. Two ranks: 1.5 S.
* ``broadcast(S, root)``: binomial tree over indices relative to the root;
  in round k every relative index ``i < 2**k`` sends ``S`` to ``i + 2**k``.
* ``all_reduce(S)``: ring, every edge carries ``2 (p-1)/p * S``.
* ``all_gather`` (``S`` = gathered size): ring, every edge ``(p-1)/p * S``.

Emulations of the gloo layer (``distributed/fleet/utils/gloo_compat.py``,
installed by ``patch_paddle()`` on gloo jobs), which the cluster workers run: ``reduce_scatter`` is an ``all_reduce`` of the whole
buffer, then a local slice; ``ReduceOp.AVG`` is a local pre-scale then SUM
(no extra bytes).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

#: (sender, receiver, bytes) of one collective.
Edge = Tuple[int, int, float]

__all__ = [
    "Edge",
    "all_gather_edges",
    "all_reduce_edges",
    "broadcast_edges",
    "collective_edges",
    "reduce_edges",
    "rounds",
]


def _ring(group: Sequence[int]) -> List[Tuple[int, int]]:
    p = len(group)
    return [(group[i], group[(i + 1) % p]) for i in range(p)] if p > 1 else []


def reduce_edges(group: Sequence[int], root: int, nbytes: float) -> List[Edge]:
    """gloo ``reduce``: ring reduce-scatter, then each slice straight to the root."""
    p = len(group)
    if p < 2:
        return []
    edges = [(a, b, nbytes * (p - 1) / p) for a, b in _ring(group)]
    edges += [(r, root, nbytes / p) for r in group if r != root]
    return edges


def broadcast_edges(group: Sequence[int], root: int, nbytes: float) -> List[Edge]:
    """gloo ``broadcast``: binomial tree over indices relative to ``root``."""
    p = len(group)
    if p < 2:
        return []
    start = list(group).index(root)
    rel = [group[(start + i) % p] for i in range(p)]
    edges = []
    span = 1
    while span < p:
        edges += [(rel[i], rel[i + span], nbytes) for i in range(span) if i + span < p]
        span *= 2
    return edges


def all_reduce_edges(group: Sequence[int], nbytes: float) -> List[Edge]:
    """gloo ring ``all_reduce`` of ``nbytes``."""
    p = len(group)
    return [(a, b, 2 * nbytes * (p - 1) / p) for a, b in _ring(group)]


def all_gather_edges(group: Sequence[int], nbytes: float) -> List[Edge]:
    """gloo ring ``all_gather``; ``nbytes`` is the gathered (whole) size."""
    p = len(group)
    return [(a, b, nbytes * (p - 1) / p) for a, b in _ring(group)]


def collective_edges(what: str, group: Sequence[int], nbytes: float,
                     root: int | None = None) -> List[Edge]:
    """Edges of ``what`` (reduce, broadcast, all_reduce, all_gather, or the
    compat layer's reduce_scatter) over ``group`` in its rank order.

    Raises:
        ValueError: unknown ``what``, or a rooted collective without a root in the group.
    """
    group = list(group)
    if what in ("reduce", "broadcast"):
        if root not in group:
            raise ValueError(f"gloo {what}: root {root} is not in group {group}")
        fn = reduce_edges if what == "reduce" else broadcast_edges
        return fn(group, root, nbytes)
    if what in ("all_reduce", "reduce_scatter"):
        return all_reduce_edges(group, nbytes)
    if what == "all_gather":
        return all_gather_edges(group, nbytes)
    raise ValueError(f"gloo model: unknown collective {what!r}; use reduce, broadcast, "
                     "all_reduce, reduce_scatter or all_gather")


def rounds(what: str, p: int) -> int:
    """Sequential message rounds of ``what`` over ``p`` ranks (latency term)."""
    if p < 2:
        return 0
    if what == "reduce":
        return p
    if what == "broadcast":
        return (p - 1).bit_length()
    if what in ("all_reduce", "reduce_scatter"):
        return 2 * (p - 1)
    return p - 1
