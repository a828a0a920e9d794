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
"""Owner partition of Muon matrices over the ranks of one sharding group.

Muon parameters (2-D ``[m, n]`` or 3-D ``[experts, m, n]``) are owned *whole*
by one rank of their group; the owner keeps the optimizer state and runs
Newton-Schulz (NS) on them. This module holds the rules that decide the owner of every matrix;
the matrices, their costs and the partition record are in
:mod:`.muon_sharding_owner_meta`, the balanced rule's refinement search in
:mod:`.muon_sharding_refine`. Pure Python (no paddle import), so a plan tool
can use it offline.

Balanced rule (:func:`balanced_partition`)
------------------------------------------
Every rank ``r`` carries two loads, state bytes ``S_r`` and NS cost ``C_r``.
Both are normalised by their per-rank mean (``S/nranks``, ``C/nranks``) and a
rank's *score* is ``max(S_r / mean_S, C_r / mean_C)`` -- the max of the two
normalised loads, so driving the score down balances memory and compute at
the same time. All arithmetic is done on exact Python integers (the ratios
are compared by cross-multiplication), so every rank of a job derives the
identical map on any machine.

1. Matrices are grouped into dtype classes (each ``(owner, dtype)`` pair
   becomes one fused buffer and one collective, see below).
2. Classes are placed smallest first (ties by dtype name), carrying the rank
   loads from class to class. A class may use at most
   ``k = ceil(class_load / one_rank_share)`` owners (``class_load`` = the
   larger of its normalised byte / NS totals, a rank's share being 1.0);
   it is placed onto the ``k`` currently least-loaded ranks. The dominant
   class normally gets ``k = nranks`` and, placed last, fills around the
   minority classes.
3. Inside a class: largest first (size = normalised bytes + normalised NS,
   ties by name -- the input order never matters) onto the allowed rank whose
   score after the placement is lowest; ties by the sum of the two normalised
   loads, then by the position of the rank in ``rank_order``.
4. Refinement: while it lowers the score of the most-loaded rank, move one of
   its matrices to another rank, or swap one of its matrices with a smaller
   one elsewhere (the best such move/swap, ties by name and ``rank_order``).
   Moves never take a matrix of a capped class outside that class's owners,
   so the per-dtype owner cap holds after refinement.

Minority-dtype rule: a dtype class whose total is smaller than one rank's
mean share is owned by a single rank; in general a class is spread over no
more owners than ``ceil(class_load)`` -- so a handful of fp32 router weights
in a bf16 model gives one or two extra fused buffers, not ``nranks`` tiny
reduces/broadcasts.

``rank_order`` gives the preference among equally loaded ranks (callers pass
an order interleaving nodes and card indices so the owners spread across
nodes and NIC rails); it defaults to ``0..nranks-1``.

Develop's rules (:func:`upstream_partition`, the default)
----------------------------------------------------------
Paddle develop's legacy rule, per dtype (#79740): dtype classes in
``sorted(key=str)`` order; in each, matrices stably sorted largest first, each
onto the first least-loaded (numel) of the class's first ``active`` ranks,
``active = min(int(total_fp32_MB / buffer_MB) + 1, nranks)`` (buffer_MB = 256
when ``comm_buffer_size_MB <= 0``). :func:`machine_balanced_owner_indices` is
develop's ``machine_balanced_2d_partition`` (#79763): the same per-class rank
budget, placed over the whole job so machines carry equal bytes.
"""

from __future__ import annotations

import bisect
import heapq
import math
from typing import Dict, List, Optional, Sequence, Tuple

from .owner_meta import (
    MatrixSpec,
    OwnerPartition,
    _check_nranks,
    _check_rank_order,
    _check_specs,
    _ns_cost_int,
    optimizer_state_bytes,
)
from .refine import refine

# dtype sizes and develop's buffer default have one home (a leaf, no paddle).
from .types import DEVELOP_DEFAULT_BUFFER_MB
from .types import FLOAT_DTYPE_SIZES as _DTYPE_SIZES

__all__ = [
    "balanced_partition",
    "upstream_partition",
    "balance_floor",
    "develop_active_ranks",
    "develop_owner_indices",
    "partition_2d_parameters",
    "machine_balanced_owner_indices",
    "partition_from_owners",
]

# --------------------------------------------------------------------------
# balanced rule
# --------------------------------------------------------------------------
class _Loads:
    """Exact-integer rank loads. A rank's normalised byte load is
    ``S_r * n / SB`` and NS load ``C_r * n / SC``; scaling both by
    ``SB * SC / n`` gives integers ``S_r * SC`` and ``C_r * SB``.

    ``by_score`` keeps ``(score, -rank_order position, rank)`` sorted, so its
    last entry is the worst rank (ties: the earliest in rank_order).
    """

    def __init__(self, nranks: int, total_b: int, total_c: int, pref: List[int]):
        self.n = nranks
        self.tb = max(total_b, 1)
        self.tc = max(total_c, 1)
        self.b = [0] * nranks
        self.c = [0] * nranks
        self.pref = pref  # pref[r] = position of rank r in rank_order
        self.settle()

    def settle(self) -> None:
        """Scores and ``by_score`` from ``b``/``c`` (after bulk changes)."""
        self.cur = [self.score(r) for r in range(self.n)]
        self.by_score = sorted((v, -self.pref[r], r) for r, v in enumerate(self.cur))

    def key(self, r: int, db: int = 0, dc: int = 0) -> Tuple[int, int, int]:
        xb = (self.b[r] + db) * self.tc
        xc = (self.c[r] + dc) * self.tb
        return (max(xb, xc), xb + xc, self.pref[r])

    def score(self, r: int, db: int = 0, dc: int = 0) -> int:
        return max((self.b[r] + db) * self.tc, (self.c[r] + dc) * self.tb)

    def add(self, r: int, db: int, dc: int) -> None:
        self.b[r] += db
        self.c[r] += dc
        new = self.score(r)
        old = self.cur[r]
        if new != old:
            p = -self.pref[r]
            del self.by_score[bisect.bisect_left(self.by_score, (old, p, r))]
            bisect.insort(self.by_score, (new, p, r))
            self.cur[r] = new

    def worst_rank(self) -> int:
        """Highest score; among equals the earliest in rank_order."""
        return self.by_score[-1][2]


def _floor_ratio(values: List[int], nranks: int) -> float:
    """Lower bound of max/mean over any assignment of whole items: for every
    m, some rank receives at least ceil(m/nranks) of the m largest items, so
    its load is at least the sum of the ceil(m/nranks) smallest of them."""
    total = sum(values)
    if total <= 0:
        return 1.0
    vals = sorted(values, reverse=True)
    prefix = [0]
    for v in vals:
        prefix.append(prefix[-1] + v)
    best = 0
    for m in range(1, len(vals) + 1):
        q = -(-m // nranks)
        best = max(best, prefix[m] - prefix[m - q])
    return max(1.0, best * nranks / total)


def balance_floor(specs: Sequence[MatrixSpec], nranks: int, multi_precision: bool = True):
    """Lower bounds on (state max/mean, NS max/mean) that *any* whole-matrix
    partition must reach (largest matrices against the mean share, including
    the granularity of many equal matrices); the figures a target can be
    checked against before calling it missed."""
    items = _check_specs(specs)
    nranks = _check_nranks(nranks)
    if not items:
        return 1.0, 1.0
    # specs are validated: sizes straight from the dims (as balanced_partition)
    bs, cs = [], []
    for s in items:
        *lead, m, n = s.shape
        numel = math.prod(s.shape)
        bs.append(numel * (8 if multi_precision and _DTYPE_SIZES[s.dtype] < 4 else 4))
        lo, hi = (m, n) if m <= n else (n, m)
        cs.append(math.prod(lead) * hi * lo * lo)
    return _floor_ratio(bs, nranks), _floor_ratio(cs, nranks)


def balanced_partition(
    specs: Sequence[MatrixSpec],
    nranks: int,
    rank_order: Optional[Sequence[int]] = None,
    multi_precision: bool = True,
) -> OwnerPartition:
    """Assign every matrix to one owner, balancing optimizer-state bytes and
    Newton-Schulz cost (see the module docstring for the exact rule)."""
    nranks = _check_nranks(nranks)
    items = _check_specs(specs)
    order = _check_rank_order(rank_order, nranks)
    pref = [0] * nranks
    for pos, r in enumerate(order):
        pref[r] = pos

    if not items:
        return OwnerPartition(nranks, {}, [0] * nranks, [0.0] * nranks, {}, "balanced")

    # specs are validated: sizes straight from the dims
    bts = {}
    nss = {}
    classes: Dict[str, List[str]] = {}
    for s in items:
        *lead, m, n = s.shape
        numel = math.prod(s.shape)
        wide = multi_precision and _DTYPE_SIZES[s.dtype] < 4
        bts[s.name] = numel * (8 if wide else 4)
        lo, hi = (m, n) if m <= n else (n, m)
        nss[s.name] = math.prod(lead) * hi * lo * lo
        classes.setdefault(s.dtype, []).append(s.name)
    # exact integer sums: the same on every rank whatever the input order
    loads = _Loads(nranks, sum(bts.values()), sum(nss.values()), pref)
    tb, tc = loads.tb, loads.tc
    # normalised bytes + normalised NS, scaled by tb*tc
    size = {k: bts[k] * tc + nss[k] * tb for k in bts}
    class_b = {d: sum(bts[k] for k in names) for d, names in classes.items()}
    class_c = {d: sum(nss[k] for k in names) for d, names in classes.items()}

    # class load in units of one rank's share (exact ceil on integers)
    def class_cap(d: str) -> int:
        kb = -(-class_b[d] * nranks // tb)
        kc = -(-class_c[d] * nranks // tc)
        return max(1, min(nranks, max(kb, kc)))

    cls_order = sorted(classes, key=lambda d: (max(class_b[d] * tc, class_c[d] * tb), d))

    owner: Dict[str, int] = {}
    allowed_of: Dict[str, Optional[frozenset]] = {}
    version = [0] * nranks  # bumped whenever a rank's load grows
    b, c = loads.b, loads.c  # raw loads: scores are settled after placing
    for d in cls_order:
        # largest first, ties by name (a stable sort on the name-sorted list)
        names = sorted(sorted(classes[d]), key=size.__getitem__, reverse=True)
        cap = class_cap(d)
        if cap >= nranks:
            allowed = list(range(nranks))
            allowed_of[d] = None
        else:
            allowed = sorted(range(nranks), key=lambda r: loads.key(r))[:cap]
            allowed_of[d] = frozenset(allowed)
        # One heap of (key, rank, version) per matrix size: loads only grow
        # while placing, so a stale entry's key is a lower bound of its
        # current key; a fresh top is the exact argmin. Equal matrices (a
        # model's experts) then cost O(log nranks) each.
        heaps: Dict[Tuple[int, int], list] = {}
        for k in names:
            bk, ck = item = (bts[k], nss[k])
            heap = heaps.get(item)
            if heap is None:
                heap = [(loads.key(r, bk, ck), r, version[r]) for r in allowed]
                heapq.heapify(heap)
                heaps[item] = heap
            while heap[0][2] != version[heap[0][1]]:
                r = heap[0][1]
                heapq.heapreplace(heap, (loads.key(r, bk, ck), r, version[r]))
            r = heap[0][1]
            owner[k] = r
            b[r] += bk
            c[r] += ck
            version[r] += 1
            # the rank's key for its next matrix of this size (loads.key inlined)
            xb = (b[r] + bk) * tc
            xc = (c[r] + ck) * tb
            heapq.heapreplace(heap, ((xb if xb > xc else xc, xb + xc, pref[r]), r, version[r]))
    loads.settle()

    refine(owner, loads, bts, nss, classes, allowed_of, order)

    dtype_of = {s.name: s.dtype for s in items}
    return OwnerPartition(
        nranks=nranks,
        owners={s.name: owner[s.name] for s in items},
        state_bytes=list(loads.b),
        ns_cost=[float(c) for c in loads.c],
        dtypes=dtype_of,
        method="balanced",
    )


# --------------------------------------------------------------------------
# develop's rules (the default, and develop's machine-balanced switch)
# --------------------------------------------------------------------------
# The buffer size develop falls back to when comm_buffer_size_MB <= 0:
# DEVELOP_DEFAULT_BUFFER_MB (muon_sharding_types).


def develop_active_ranks(numels: Sequence[int], world_size: int, buffer_size_MB: float) -> int:
    """How many ranks develop lets one dtype class use: its fp32-estimated
    size over the buffer size, plus one, at most ``world_size``."""
    buffer_MB = buffer_size_MB if buffer_size_MB > 0 else DEVELOP_DEFAULT_BUFFER_MB
    total_MB = sum(int(n) for n in numels) * 4 / 2**20
    cap = 1 if total_MB == 0 else max(1, int(total_MB / buffer_MB) + 1)
    return min(cap, world_size)


def develop_owner_indices(
    numels: Sequence[int],
    dtype_keys: Sequence[str],
    world_size: int,
    buffer_size_MB: float,
) -> List[List[int]]:
    """Develop's legacy owner rule, per dtype (Paddle #79740).

    Dtype classes are visited in ``sorted(key=str)`` order; inside a class the
    matrices are stably sorted by numel (largest first) and each goes to the
    first least-loaded of the class's first ``active`` ranks (fresh loads per
    class, see :func:`develop_active_ranks`).

    Returns:
        list[list[int]]: for every rank ``0..world_size-1``, the input indices
        it owns in assignment order.
    """
    world_size = _check_nranks(world_size)
    by_dtype: Dict[str, List[int]] = {}
    for i, key in enumerate(dtype_keys):
        by_dtype.setdefault(str(key), []).append(i)
    out: List[List[int]] = [[] for _ in range(world_size)]
    for key in sorted(by_dtype):
        idx = sorted(by_dtype[key], key=lambda i: -int(numels[i]))
        active = develop_active_ranks([numels[i] for i in idx], world_size, buffer_size_MB)
        # (load, rank) heap: the first index of the minimum load is the
        # smallest (load, rank) pair, so a heap finds it in O(log active).
        heap = [(0, r) for r in range(active)]
        for i in idx:
            load, r = heap[0]
            out[r].append(i)
            heapq.heapreplace(heap, (load + int(numels[i]), r))
    return out


def partition_2d_parameters(params: Sequence, world_size: int,
                            buffer_size_MB: float) -> Dict[int, list]:
    """Develop's ``_partition_2d_parameters`` on parameter objects.

    Args:
        params: objects with ``shape`` and ``dtype`` (paddle parameters).
        world_size: ranks of the colour group.
        buffer_size_MB: ``comm_buffer_size_MB`` (``<= 0``: 256).

    Returns:
        dict[int, list]: every rank ``0..world_size-1`` -> its parameters in
        assignment order; ``params`` itself is not modified.
    """
    params = list(params)
    numels = [math.prod(int(d) for d in p.shape) for p in params]
    per_rank = develop_owner_indices(numels, [str(p.dtype) for p in params], world_size,
                                     buffer_size_MB)
    return {r: [params[i] for i in idx] for r, idx in enumerate(per_rank)}


def upstream_partition(
    specs: Sequence[MatrixSpec],
    nranks: int,
    buffer_size_MB: float = DEVELOP_DEFAULT_BUFFER_MB,
    multi_precision: bool = True,
) -> OwnerPartition:
    """Develop's owner rule (:func:`develop_owner_indices`) on specs.

    ``buffer_size_MB <= 0`` means develop's fallback of 256 MB.
    """
    nranks = _check_nranks(nranks)
    items = _check_specs(specs)
    per_rank = develop_owner_indices(
        [s.numel for s in items], [s.dtype for s in items], nranks, buffer_size_MB
    )
    owners: Dict[str, int] = {}
    state = [0] * nranks
    ns = [0] * nranks
    costs: Dict[tuple, Tuple[int, int]] = {}  # (shape, dtype) -> its loads: few kinds
    for r, idx in enumerate(per_rank):
        for i in idx:
            s = items[i]
            cost = costs.get((s.shape, s.dtype))
            if cost is None:
                cost = costs[(s.shape, s.dtype)] = (
                    optimizer_state_bytes(s, multi_precision), _ns_cost_int(s.shape))
            state[r] += cost[0]
            ns[r] += cost[1]
    owner_of = {i: r for r, idx in enumerate(per_rank) for i in idx}
    owners = {s.name: owner_of[i] for i, s in enumerate(items)}
    return OwnerPartition(
        nranks=nranks,
        owners=owners,
        state_bytes=state,
        ns_cost=[float(c) for c in ns],
        dtypes={s.name: s.dtype for s in items},
        method=f"upstream(buffer={buffer_size_MB:g}MB)",
    )


def partition_from_owners(
    specs: Sequence[MatrixSpec],
    nranks: int,
    owners: Dict[str, int],
    method: str,
    multi_precision: bool = True,
) -> OwnerPartition:
    """The :class:`OwnerPartition` (loads included) of owners chosen elsewhere.

    Args:
        specs: the group's Muon matrices.
        nranks: ranks of the group.
        owners: name -> group index, for every spec.
        method: the rule that chose them (reported by ``summary``).
        multi_precision: count fp32 master weights of sub-32-bit dtypes.
    """
    nranks = _check_nranks(nranks)
    items = _check_specs(specs)
    state = [0] * nranks
    ns = [0] * nranks
    for s in items:
        r = owners[s.name]
        state[r] += optimizer_state_bytes(s, multi_precision)
        ns[r] += _ns_cost_int(s.shape)
    return OwnerPartition(
        nranks=nranks,
        owners={s.name: owners[s.name] for s in items},
        state_bytes=state,
        ns_cost=[float(c) for c in ns],
        dtypes={s.name: s.dtype for s in items},
        method=method,
    )


def _colour_sort_key(colour) -> Tuple[int, str]:
    # None (the default group) first; other colours by their text, so keys of
    # mixed types still sort the same way on every rank.
    return (0, "") if colour is None else (1, str(colour))


def machine_balanced_owner_indices(
    color_group_info: Dict[Tuple, Sequence[Tuple]],
    rank_to_machine: Dict[int, int],
    buffer_size_MB: float,
) -> Tuple[Dict[Tuple, Dict[int, List[str]]], Dict[int, Tuple[int, int]]]:
    """Develop's machine-balanced owner rule (Paddle #79763), whole job at once.

    Args:
        color_group_info: ``(colour key, tuple(group global ranks))`` -> list of
            ``(name, numel, dtype_str, itemsize)`` for every colour group of the
            job (PP/EP give several groups per colour).
        rank_to_machine: global rank -> machine id.
        buffer_size_MB: ``comm_buffer_size_MB`` (``<= 0``: 256, as develop).

    Every (group, dtype) class is a bucket that may use develop's ``active``
    number of its group's ranks. Buckets are placed largest first (ties by
    colour, dtype, group ranks: the result ignores dict and dtype order); in
    a bucket matrices go largest first (stable) onto (a) the least-loaded
    machine (bytes, whole job), (b) then the one owning fewest matrices,
    (c) then its least-loaded rank within the bucket, lowest group index
    first. A bucket opens ranks until it uses ``min(active, matrices)`` of
    them. On one machine this is exactly :func:`develop_owner_indices` per
    dtype.

    Returns:
        tuple: ``key -> {group index: [names]}`` (every index present, names
        in assignment order), and ``machine -> (bytes, matrices)`` it implies.
    """
    buckets = []
    for key, entries in color_group_info.items():
        colour, ranks = key
        ranks = tuple(int(r) for r in ranks)
        for r in ranks:
            if r not in rank_to_machine:
                raise ValueError(
                    f"rank {r} of colour group {key!r} has no machine in rank_to_machine; "
                    "gather every rank's machine before partitioning"
                )
        by_dtype: Dict[str, List[Tuple]] = {}
        for entry in entries:
            by_dtype.setdefault(str(entry[2]), []).append(entry)
        for dtype, items in by_dtype.items():
            volume = sum(int(e[1]) * int(e[3]) for e in items)
            order = (-volume, _colour_sort_key(colour), dtype, ranks)
            buckets.append((order, key, ranks, items))
    buckets.sort(key=lambda b: b[0])

    result: Dict[Tuple, Dict[int, List[str]]] = {
        key: {i: [] for i in range(len(key[1]))} for key in color_group_info
    }
    machine_bytes: Dict[int, int] = {m: 0 for m in set(rank_to_machine.values())}
    machine_count: Dict[int, int] = dict.fromkeys(machine_bytes, 0)
    for _, key, ranks, items in buckets:
        items = sorted(items, key=lambda e: -int(e[1]))
        active = develop_active_ranks([e[1] for e in items], len(ranks), buffer_size_MB)
        placed = _place_bucket(items, ranks, active, rank_to_machine, machine_bytes,
                               machine_count)
        for (name, _, _, _), i in zip(items, placed):
            result[key][i].append(name)
    summary = {m: (machine_bytes[m], machine_count[m]) for m in sorted(machine_bytes)}
    return result, summary


def _place_bucket(items, ranks, active, rank_to_machine, machine_bytes, machine_count):
    """Group index of every item of one bucket (items largest first).

    Machines are kept in a heap keyed by ``(machine bytes, machine matrices,
    best rank's bucket load, best rank's index)`` -- exactly the order of the
    rule -- so a placement costs O(log machines + log ranks per machine).
    """
    machine_of = [rank_to_machine[r] for r in ranks]
    unopened: Dict[int, List[int]] = {}  # machine -> group indices, ascending
    for i, m in enumerate(machine_of):
        unopened.setdefault(m, []).append(i)
    for lst in unopened.values():
        lst.reverse()  # pop() yields the lowest index
    opened: Dict[int, List[Tuple[int, int]]] = {}  # machine -> heap (bucket load, index)
    local_load = [0] * len(ranks)
    n_open = 0
    zero_open: List[int] = []  # opened ranks still at load 0 (numel-0 matrices)
    placed: List[int] = []

    def top(m: int, opening: bool) -> Tuple[int, int]:
        if opening:
            return (0, unopened[m][-1])
        return opened[m][0]

    def key_of(m: int, opening: bool) -> Tuple:
        return (machine_bytes[m], machine_count[m]) + top(m, opening)

    def build_heap(opening: bool) -> List[Tuple]:
        pool = unopened if opening else opened
        heap = [key_of(m, opening) + (m,) for m, lst in pool.items() if lst]
        heapq.heapify(heap)
        return heap

    opening = active > 0
    heap = build_heap(opening)
    for _, numel, _, itemsize in items:
        numel = int(numel)
        if zero_open:  # develop's first-minimum reuses an opened rank still empty
            i = min(zero_open, key=lambda j: (machine_bytes[machine_of[j]],
                                               machine_count[machine_of[j]], j))
            m = machine_of[i]
        else:
            while True:  # drop entries made stale by earlier placements
                entry = heap[0]
                m = entry[-1]
                pool = unopened if opening else opened
                if pool.get(m) and entry[:-1] == key_of(m, opening):
                    break
                heapq.heappop(heap)
            if opening:
                i = unopened[m].pop()
                n_open += 1
            else:
                _, i = heapq.heappop(opened[m])
        machine_bytes[m] += numel * int(itemsize)
        machine_count[m] += 1
        local_load[i] += numel
        placed.append(i)
        if opening and not zero_open:
            if local_load[i] == 0:
                zero_open.append(i)
            heapq.heappush(opened.setdefault(m, []), (local_load[i], i))
        elif zero_open:
            pass  # load unchanged (numel 0); its heap entry stays valid
        else:
            heapq.heappush(opened[m], (local_load[i], i))
        if opening and n_open == active:
            opening = False
            heap = build_heap(False)
        elif not zero_open:
            pool = unopened if opening else opened
            if pool.get(m):
                heapq.heappush(heap, key_of(m, opening) + (m,))
    return placed
