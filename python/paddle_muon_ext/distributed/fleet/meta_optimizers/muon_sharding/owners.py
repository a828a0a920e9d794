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
"""The owner rules: which rank of a sharding group owns each whole Muon matrix (state, NS):
develop's rule and machine-balanced rule, ``balanced`` and ``rail``; pure Python, no paddle."""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .settings import (
    DEVELOP_DEFAULT_BUFFER_MB, FLOAT_DTYPE_SIZES, PARTITION_BALANCED, PARTITION_RAIL,
    canonical_float_dtype, dtype_itemsize,
)

__all__ = [
    "MatrixSpec", "OwnerPartition", "newton_schulz_cost", "optimizer_state_bytes",
    "balanced_partition", "upstream_partition", "develop_active_ranks",
    "develop_owner_indices", "partition_2d_parameters", "machine_balanced_owner_indices",
    "partition_from_owners", "rail_positions", "rail_partition",
]


@dataclass(frozen=True)
class MatrixSpec:
    """A Muon matrix as the partitioner sees it."""

    name: str
    shape: Tuple[int, ...]
    dtype: str = "float32"

    @property
    def numel(self) -> int:
        return math.prod(int(d) for d in self.shape)


def _check_shape(shape) -> Tuple[int, ...]:
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"shape must be a sequence of ints, got {shape!r}") from None
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) and not hasattr(d, "__index__"):
            raise TypeError(f"shape must be a sequence of ints, got {shape!r}")
    dims = tuple(map(int, dims))
    if any(d < 0 for d in dims):
        raise ValueError(f"shape has a negative dim: {shape!r}")
    if len(dims) < 2:
        raise ValueError(
            f"a Muon matrix needs at least 2 dims (got shape {shape!r}); "
            "1-D parameters are handled by AdamW, not by the owner partition"
        )
    return dims


def _ns_cost_int(dims: Tuple[int, ...]) -> int:
    *lead, m, n = dims
    lo, hi = (m, n) if m <= n else (n, m)
    return math.prod(lead) * hi * lo * lo


def newton_schulz_cost(shape) -> float:
    """Relative Newton-Schulz cost of one matrix: ``max(m,n)*min(m,n)**2``
    over the last two dims, times the product of the leading (expert) dims."""
    return float(_ns_cost_int(_check_shape(shape)))


def optimizer_state_bytes(spec: MatrixSpec, multi_precision: bool = True) -> int:
    """fp32 momentum (``numel*4``), plus an fp32 master weight (``numel*4``)
    for sub-32-bit dtypes when ``multi_precision``."""
    numel = math.prod(_check_shape(spec.shape))
    return numel * (8 if multi_precision and dtype_itemsize(spec.dtype) < 4 else 4)


def _costs(items: Sequence[MatrixSpec], multi_precision: bool) -> Tuple[List[int], List[int]]:
    """State bytes and NS cost of each validated spec."""
    return ([math.prod(s.shape) * (8 if multi_precision and FLOAT_DTYPE_SIZES[s.dtype] < 4 else 4)
             for s in items], [_ns_cost_int(s.shape) for s in items])


@dataclass
class OwnerPartition:
    """Owner map of one group plus the per-rank loads it implies."""

    nranks: int
    owners: Dict[str, int]
    state_bytes: List[int]
    ns_cost: List[float]
    dtypes: Dict[str, str] = field(default_factory=dict)
    method: str = PARTITION_BALANCED

    def params_of(self, rank: int) -> List[str]:
        """Names owned by ``rank``, in the order the specs were given."""
        if not 0 <= rank < self.nranks:
            raise ValueError(f"rank {rank} out of range for nranks={self.nranks}")
        return [name for name, owner in self.owners.items() if owner == rank]

    def empty_ranks(self) -> List[int]:
        used = set(self.owners.values())
        return [r for r in range(self.nranks) if r not in used]

    def owners_by_dtype(self) -> Dict[str, List[int]]:
        """dtype -> sorted list of ranks owning at least one matrix of it."""
        out: Dict[str, set] = {}
        for name, owner in self.owners.items():
            out.setdefault(self.dtypes.get(name, "float32"), set()).add(owner)
        return {k: sorted(out[k]) for k in sorted(out)}


def _check_nranks(nranks) -> int:
    if isinstance(nranks, bool) or not isinstance(nranks, int):
        raise TypeError(f"nranks must be an int, got {type(nranks).__name__}")
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks}")
    return nranks


def _check_specs(specs) -> List[MatrixSpec]:
    if specs is None:
        raise TypeError("specs must be a sequence of MatrixSpec, got None")
    out: List[MatrixSpec] = []
    seen = set()
    for s in specs:
        if not all(hasattr(s, attr) for attr in ("name", "shape", "dtype")):
            raise TypeError(
                f"specs must hold MatrixSpec-like objects (name, shape, dtype); got {s!r}"
            )
        if not isinstance(s.name, str) or not s.name:
            raise TypeError(f"spec name must be a non-empty str, got {s.name!r}")
        if s.name in seen:
            raise ValueError(f"duplicate parameter name in specs: {s.name!r}")
        seen.add(s.name)
        out.append(MatrixSpec(s.name, _check_shape(s.shape), canonical_float_dtype(s.dtype)))
    return out


def _rank_positions(rank_order, nranks: int) -> List[int]:
    """Position of every rank in ``rank_order`` (a permutation of ``0..nranks-1``, None: that)."""
    if rank_order is None:
        return list(range(nranks))
    order = [int(r) for r in rank_order]
    if sorted(order) != list(range(nranks)):
        raise ValueError(
            f"rank_order must be a permutation of 0..{nranks - 1}, got {list(rank_order)!r}"
        )
    pref = [0] * nranks
    for pos, r in enumerate(order):
        pref[r] = pos
    return pref


def balanced_partition(specs: Sequence[MatrixSpec], nranks: int,
                       rank_order: Optional[Sequence[int]] = None,
                       multi_precision: bool = True) -> OwnerPartition:
    """Assign every matrix to one owner, balancing optimizer-state bytes and Newton-Schulz cost.

    A rank's score is ``max(S_r / mean_S, C_r / mean_C)`` (state bytes, NS
    cost), compared exactly on integers, so every rank derives the same map.

    1. Dtype classes (each ``(owner, dtype)`` is one fused buffer) are placed
       smallest first; a class uses at most ``ceil(class load / one rank's
       share)`` owners, the least-loaded ranks -- so a few fp32 router weights
       in a bf16 model give one or two buffers, not ``nranks``.
    2. In a class, largest first (size: normalised bytes + NS, ties by name)
       onto the allowed rank whose score after it is lowest; ties by the sum
       of its normalised loads, then by position in ``rank_order``.
    3. :func:`refine` then moves or swaps matrices of the worst rank.

    ``rank_order`` (default ``0..nranks-1``) orders equally loaded ranks;
    callers pass one interleaving nodes and cards so owners spread over rails.
    """
    nranks = _check_nranks(nranks)
    items = _check_specs(specs)
    pref = _rank_positions(rank_order, nranks)
    bs, cs = _costs(items, multi_precision)
    # Exact integers, the same on every rank whatever the input order: x = bytes * total NS
    # and y = NS * total bytes order ranks as S_r / mean_S and C_r / mean_C; score max(x, y).
    tb = max(sum(bs), 1)
    tc = max(sum(cs), 1)
    xs = {s.name: b * tc for s, b in zip(items, bs)}
    ys = {s.name: c * tb for s, c in zip(items, cs)}
    classes: Dict[str, List[str]] = {}
    for s in items:
        classes.setdefault(s.dtype, []).append(s.name)
    class_load = {d: max(sum(xs[k] for k in names), sum(ys[k] for k in names))
                  for d, names in classes.items()}
    x = [0] * nranks
    y = [0] * nranks

    def key(r: int, dx: int = 0, dy: int = 0) -> Tuple[int, int, int]:
        """Placement order of rank ``r`` with ``dx`` / ``dy`` more: score, sum, rank_order."""
        xr = x[r] + dx
        yr = y[r] + dy
        return (max(xr, yr), xr + yr, pref[r])

    owner: Dict[str, int] = {}
    allowed_of: Dict[str, frozenset] = {}
    for d in sorted(classes, key=lambda d: (class_load[d], d)):
        # largest first, ties by name (a stable sort on the name-sorted list)
        names = sorted(sorted(classes[d]), key=lambda k: xs[k] + ys[k], reverse=True)
        # owners: the ceil(class load / one rank's share) least loaded ranks
        cap = max(1, min(nranks, -(-class_load[d] * nranks // (tb * tc))))
        allowed = sorted(range(nranks), key=key)[:cap]
        allowed_of[d] = frozenset(allowed)
        # One heap of (key, rank) per matrix size: loads only grow, so a stale key is a lower
        # bound and a current top is the exact argmin; equal matrices cost O(log nranks) each.
        heaps: Dict[Tuple[int, int], list] = {}
        for k in names:
            xk, yk = item = (xs[k], ys[k])
            heap = heaps.get(item)
            if heap is None:
                heap = heaps[item] = [(key(r, xk, yk), r) for r in allowed]
                heapq.heapify(heap)
            r = heap[0][1]
            while heap[0][0] != key(r, xk, yk):  # stale: r grew through another size
                heapq.heapreplace(heap, (key(r, xk, yk), r))
                r = heap[0][1]
            owner[k] = r
            x[r] += xk
            y[r] += yk
            heapq.heapreplace(heap, (key(r, xk, yk), r))

    dtype_of = {k: d for d, names in classes.items() for k in names}
    refine(owner, x, y, xs, ys, dtype_of, allowed_of, pref)
    return _partition(items, nranks, [owner[s.name] for s in items], PARTITION_BALANCED,
                      multi_precision)


def refine(owner, x, y, xs, ys, dtype_of, allowed_of, pref, max_iters=10000) -> None:
    """The balanced rule's refinement of ``owner`` and its scaled loads ``x`` / ``y`` (in place).

    While it lowers the worst rank's score, each round takes the best move of one of its
    matrices or swap with a smaller one elsewhere: lowest new pair score ``B``, then moves
    before swaps, matrix name, ``rank_order``, partner name; matrices of equal (bytes, NS cost,
    dtype) are interchangeable (the smallest name stands for them). Exact, visiting only
    candidates that can reach the best ``B`` so far. A capped class's matrices stay on its owners.
    """
    n = len(x)
    load = (x, y)
    size = (xs, ys)
    # kept sorted: (score, -rank_order position, rank), the worst last; (load, rank) per dim
    score = [max(a, b) for a, b in zip(x, y)]
    by_score = sorted((v, -pref[r], r) for r, v in enumerate(score))
    by_load = tuple(sorted((v, r) for r, v in enumerate(vals)) for vals in load)
    # each rank's kinds (scaled bytes, scaled NS cost, dtype) -> names, sorted: the smallest
    # name is the one the name tie-break picks among interchangeable matrices
    gkey = {k: (xs[k], ys[k], dtype_of[k]) for k in xs}
    groups: List[Dict[tuple, List[str]]] = [{} for _ in range(n)]
    for k in sorted(owner):
        groups[owner[k]].setdefault(gkey[k], []).append(k)
    index: List[tuple] = [None] * n  # per rank and dimension: (sorted kinds, first fields)

    def reindex(r: int) -> None:
        """Rank r's kinds sorted by scaled bytes (dim 0: (x, y, dtype)) and by scaled NS cost
        (dim 1: (y, x, dtype)), each with its first fields alone (bisected on plain ints)."""
        by_dim = (sorted(groups[r]), sorted((b, a, d) for a, b, d in groups[r]))
        index[r] = tuple((lst, [t[0] for t in lst]) for lst in by_dim)

    for r in range(n):
        reindex(r)

    def relocate(k: str, src: int, dst: int) -> None:
        for r, sign in ((src, -1), (dst, 1)):
            for vals, lst, sz in zip(load, by_load, size):
                del lst[bisect.bisect_left(lst, (vals[r], r))]
                vals[r] += sign * sz[k]
                bisect.insort(lst, (vals[r], r))
            del by_score[bisect.bisect_left(by_score, (score[r], -pref[r], r))]
            score[r] = max(x[r], y[r])
            bisect.insort(by_score, (score[r], -pref[r], r))
        owner[k] = dst
        g = gkey[k]
        names = groups[src][g]
        del names[bisect.bisect_left(names, k)]
        if not names:
            del groups[src][g]
            reindex(src)
        if g not in groups[dst]:
            groups[dst][g] = []
            reindex(dst)
        bisect.insort(groups[dst][g], k)

    for _ in range(max_iters):
        worst = by_score[-1][2]
        W = score[worst]
        # dim: the dimension that decides the worst rank's score; o: the other
        dim = 0 if x[worst] == W else 1
        o = 1 - dim
        load_of, other_of, ow = load[dim], load[o], load[o][worst]
        # dtypes the worst rank may take back (capped classes keep their owners)
        host_ok = {d for d, a in allowed_of.items() if worst in a}
        # per kind on the worst rank, largest first: sizes, their sum, the rank's loads without it
        mine = []
        for k in sorted((names[0] for names in groups[worst].values()),
                        key=lambda k: (-(xs[k] + ys[k]), k)):
            sk, ok = size[dim][k], size[o][k]
            mine.append((k, sk, ok, sk + ok, W - sk, ow - ok, allowed_of[dtype_of[k]]))
        best = None  # (new pair max, 0 move / 1 swap, k, rank_order position, partner, rank)
        B = W  # best pair score so far (a candidate needs new < W, ties kept)

        for k, sk, ok, _, a_k, o_k, allowed_k in mine:  # moves k -> r
            after = max(a_k, o_k)
            if after > B:  # the worst rank alone already ends above the best
                continue
            # (r's new score is at least its score now + min(sk, ok))
            for i in range(bisect.bisect_right(by_score, (B - min(sk, ok), 1))):
                r = by_score[i][2]
                if r == worst or r not in allowed_k:
                    continue
                new = max(after, load_of[r] + sk, other_of[r] + ok)
                if new < W:
                    cand = (new, 0, k, pref[r], "", r)
                    if best is None or cand < best:
                        best, B = cand, new

        # Swaps, on ranks by ascending load. A swap keeps the pair's sum in each dimension, so
        # the new pair score is at least half of it: ranks above 2B - W (deciding) or 2B - ow
        # (other) are out of reach. Partners are bisected in the rank's sorted kinds.
        for lr, r in by_load[dim]:
            if r == worst:
                continue
            if lr > 2 * B - W:
                break
            o_r = other_of[r]
            if o_r > 2 * B - ow:
                continue
            lst, vals = index[r][dim]
            for k, sk, ok, size_k, a_k, o_k, allowed_k in mine:
                # (partners only add to the worst rank: a k leaving it above B is out)
                if a_k > B or o_k > B or r not in allowed_k:
                    continue
                # the partner's value in each dimension must keep both ranks at or below B
                lo = bisect.bisect_left(vals, sk - (B - lr))
                hi = bisect.bisect_left(vals, sk - (W - B) + 1, lo)
                q_lo = o_r + ok - B
                q_hi = B - o_k
                for i in range(lo, hi):
                    a, q, d = lst[i]
                    if q < q_lo or q > q_hi or a + q >= size_k or d not in host_ok:
                        continue
                    new = max(a_k + a, o_k + q, lr + sk - a, o_r + ok - q)
                    if new < W:
                        j = groups[r][(q, a, d) if dim else (a, q, d)][0]
                        cand = (new, 1, k, pref[r], j, r)
                        if best is None or cand < best:
                            best, B = cand, new
        if best is None:
            return
        _, kind, k, _, j, r = best
        relocate(k, worst, r)
        if kind == 1:
            relocate(j, r, worst)


def develop_active_ranks(numels: Sequence[int], world_size: int, buffer_size_MB: float) -> int:
    """Ranks develop lets one dtype class use: fp32-estimated MB / buffer MB + 1, <= world_size."""
    buffer_MB = buffer_size_MB if buffer_size_MB > 0 else DEVELOP_DEFAULT_BUFFER_MB
    total_MB = sum(int(n) for n in numels) * 4 / 2**20
    return min(max(1, int(total_MB / buffer_MB) + 1), world_size)


def develop_owner_indices(numels: Sequence[int], dtype_keys: Sequence[str], world_size: int,
                          buffer_size_MB: float) -> List[List[int]]:
    """Develop's legacy owner rule, per dtype (Paddle #79740).

    Dtype classes are visited in ``sorted(key=str)`` order; inside a class the
    matrices are stably sorted by numel (largest first) and each goes to the
    first least-loaded of the class's first ``active`` ranks (fresh loads per
    class, see :func:`develop_active_ranks`).

    Returns:
        list[list[int]]: per rank ``0..world_size-1``, the input indices it owns, in order.
    """
    world_size = _check_nranks(world_size)
    by_dtype: Dict[str, List[int]] = {}
    for i, key in enumerate(dtype_keys):
        by_dtype.setdefault(str(key), []).append(i)
    out: List[List[int]] = [[] for _ in range(world_size)]
    for key in sorted(by_dtype):
        idx = sorted(by_dtype[key], key=lambda i: -int(numels[i]))
        active = develop_active_ranks([numels[i] for i in idx], world_size, buffer_size_MB)
        # the first rank of the minimum load is the smallest (load, rank) pair: a heap's top
        heap = [(0, r) for r in range(active)]
        for i in idx:
            load, r = heap[0]
            out[r].append(i)
            heapq.heapreplace(heap, (load + int(numels[i]), r))
    return out


def partition_2d_parameters(params: Sequence, world_size: int,
                            buffer_size_MB: float) -> Dict[int, list]:
    """Develop's ``_partition_2d_parameters`` on parameter objects (``params`` is not modified).

    Args:
        params: objects with ``shape`` and ``dtype`` (paddle parameters).
        world_size: ranks of the colour group.
        buffer_size_MB: ``comm_buffer_size_MB`` (``<= 0``: 256).

    Returns:
        dict[int, list]: every rank ``0..world_size-1`` -> its parameters in assignment order.
    """
    params = list(params)
    numels = [math.prod(int(d) for d in p.shape) for p in params]
    per_rank = develop_owner_indices(numels, [str(p.dtype) for p in params], world_size,
                                     buffer_size_MB)
    return {r: [params[i] for i in idx] for r, idx in enumerate(per_rank)}


def upstream_partition(specs: Sequence[MatrixSpec], nranks: int,
                       buffer_size_MB: float = DEVELOP_DEFAULT_BUFFER_MB,
                       multi_precision: bool = True) -> OwnerPartition:
    """Develop's owner rule (:func:`develop_owner_indices`) on specs.

    ``buffer_size_MB <= 0`` means develop's fallback of 256 MB.
    """
    nranks = _check_nranks(nranks)
    items = _check_specs(specs)
    per_rank = develop_owner_indices(
        [s.numel for s in items], [s.dtype for s in items], nranks, buffer_size_MB
    )
    owner_of = {i: r for r, idx in enumerate(per_rank) for i in idx}
    return _partition(items, nranks, [owner_of[i] for i in range(len(items))],
                      f"upstream(buffer={buffer_size_MB:g}MB)", multi_precision)


def partition_from_owners(specs: Sequence[MatrixSpec], nranks: int, owners: Dict[str, int],
                          method: str, multi_precision: bool = True) -> OwnerPartition:
    """The :class:`OwnerPartition` (loads included) of owners chosen elsewhere.

    Args:
        specs: the group's Muon matrices.
        nranks: ranks of the group.
        owners: name -> group index, for every spec.
        method: the rule that chose them (``OwnerPartition.method``).
        multi_precision: count fp32 master weights of sub-32-bit dtypes.
    """
    items = _check_specs(specs)
    return _partition(items, _check_nranks(nranks), [owners[s.name] for s in items], method,
                      multi_precision)


def _partition(items: Sequence[MatrixSpec], nranks: int, owner_of: Sequence[int], method: str,
               multi_precision: bool) -> OwnerPartition:
    """The :class:`OwnerPartition` of validated specs, ``owner_of[i]`` owning ``items[i]``."""
    state = [0] * nranks
    ns = [0] * nranks
    for r, b, c in zip(owner_of, *_costs(items, multi_precision)):
        state[r] += b
        ns[r] += c
    return OwnerPartition(
        nranks=nranks,
        owners={s.name: r for s, r in zip(items, owner_of)},
        state_bytes=state,
        ns_cost=[float(c) for c in ns],
        dtypes={s.name: s.dtype for s in items},
        method=method,
    )


def machine_balanced_owner_indices(
    color_group_info: Dict[Tuple, Sequence[Tuple]], rank_to_machine: Dict[int, int],
    buffer_size_MB: float,
) -> Tuple[Dict[Tuple, Dict[int, List[str]]], Dict[int, Tuple[int, int]]]:
    """Develop's machine-balanced owner rule (Paddle #79763), whole job at once.

    Args:
        color_group_info: ``(colour key, tuple(group global ranks))`` -> list of
            ``(name, numel, dtype_str, itemsize)`` for every colour group of the
            job (PP/EP give several groups per colour).
        rank_to_machine: global rank -> machine id.
        buffer_size_MB: ``comm_buffer_size_MB`` (``<= 0``: 256, as develop).

    Every (group, dtype) bucket may use develop's ``active`` number of its group's ranks.
    Buckets go largest first (ties by colour, dtype, group ranks: dict and dtype order do not
    matter); in a bucket matrices go largest first (stable) onto the least-loaded machine
    (bytes, whole job), then the one owning fewest matrices, then its least-loaded rank in the
    bucket, lowest group index first; a bucket opens ranks until it uses ``min(active,
    matrices)``. On one machine this is :func:`develop_owner_indices` per dtype.

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
        # None (the default group) first, then by text: mixed key types sort alike on every rank
        colour_key = (0, "") if colour is None else (1, str(colour))
        by_dtype: Dict[str, List[Tuple]] = {}
        for entry in entries:
            by_dtype.setdefault(str(entry[2]), []).append(entry)
        for dtype, items in by_dtype.items():
            volume = sum(int(e[1]) * int(e[3]) for e in items)
            buckets.append(((-volume, colour_key, dtype, ranks), key, ranks, items))
    buckets.sort(key=lambda b: b[0])

    result: Dict[Tuple, Dict[int, List[str]]] = {key: {i: [] for i in range(len(key[1]))}
                                                  for key in color_group_info}
    machine_bytes: Dict[int, int] = {m: 0 for m in set(rank_to_machine.values())}
    machine_count: Dict[int, int] = dict.fromkeys(machine_bytes, 0)
    for _, key, ranks, items in buckets:
        items = sorted(items, key=lambda e: -int(e[1]))
        active = develop_active_ranks([e[1] for e in items], len(ranks), buffer_size_MB)
        placed = _place_bucket(items, ranks, active, rank_to_machine, machine_bytes,
                               machine_count)
        for entry, i in zip(items, placed):
            result[key][i].append(entry[0])
    summary = {m: (machine_bytes[m], machine_count[m]) for m in sorted(machine_bytes)}
    return result, summary


def _place_bucket(items, ranks, active, rank_to_machine, machine_bytes, machine_count):
    """Group index of every item of one bucket (items largest first).

    The first ``active`` items open a rank each, the others go to an opened one. Machines sit
    in a heap keyed by the rule's order, ``(machine bytes, machine matrices, best candidate's
    (bucket load, index))``: a placement costs O(log machines + log ranks per machine).
    """
    cands: Dict[int, List[Tuple[int, int]]] = {}  # machine -> heap of (bucket load, index)
    for i, r in enumerate(ranks):
        cands.setdefault(rank_to_machine[r], []).append((0, i))
    opened: Dict[int, List[Tuple[int, int]]] = {}  # the same, of the ranks opened so far
    placed: List[int] = []

    def key_of(m: int) -> Tuple:
        return (machine_bytes[m], machine_count[m]) + cands[m][0] + (m,)

    def build_heap() -> List[Tuple]:
        heap = [key_of(m) for m, c in cands.items() if c]
        heapq.heapify(heap)
        return heap

    heap = build_heap()
    for _, numel, _, itemsize in items:
        numel = int(numel)
        while not cands.get(heap[0][-1]) or heap[0] != key_of(heap[0][-1]):
            heapq.heappop(heap)  # stale: its machine changed since
        m = heap[0][-1]
        load, i = heapq.heappop(cands[m])
        machine_bytes[m] += numel * int(itemsize)
        machine_count[m] += 1
        placed.append(i)
        opening = len(placed) <= active
        if opening and numel == 0:
            # develop's first minimum: the rest (numel 0 too) go to this still empty rank
            rest = len(items) - len(placed)
            machine_count[m] += rest
            return placed + [i] * rest
        heapq.heappush((opened if opening else cands).setdefault(m, []), (load + numel, i))
        if len(placed) == active:
            cands = opened
            heap = build_heap()
        elif cands.get(m):
            heapq.heappush(heap, key_of(m))
    return placed


def rail_positions(plan: Any, group_ranks: Sequence[int]) -> Optional[Tuple[Tuple[int, int], ...]]:
    """``(node position, card)`` of every group index, or None where the rail rule does not apply.

    Args:
        plan: the hierarchical plan (``node_of`` / ``card_of``), or None.
        group_ranks: the colour group's global ranks, in group order.

    Returns:
        tuple or None: per group index, its node's position among the group's nodes and its
        card; None without a plan or on one node (no rail crosses nodes: ``balanced`` applies).
    """
    if plan is None:
        return None
    ranks = [int(r) for r in group_ranks]
    node_of = [plan.node_of(r) for r in ranks]
    nodes = sorted(set(node_of))
    if len(nodes) < 2:
        return None
    pos = {n: i for i, n in enumerate(nodes)}
    # node positions, not ids: groups of equal shape (pipeline stages) share one cached result
    return tuple((pos[n], plan.card_of(r)) for n, r in zip(node_of, ranks))


def rail_partition(specs: Sequence[MatrixSpec], positions: Sequence[Tuple[int, int]],
                   rank_order: Optional[Sequence[int]] = None,
                   multi_precision: bool = True) -> OwnerPartition:
    """Assign every matrix to one owner so card rails and nodes carry even bytes.

    On the hierarchical path a dense Muon buffer crosses nodes only on its owner's card (its
    NIC rail). Dtype classes go smallest first, each on at most ``ceil(class bytes / one rank's
    share)`` of the least-loaded ranks (ties: rail load, node load, ``rank_order``); in a class,
    largest first (ties by name) onto the least-loaded rail (ties: its first position in
    ``rank_order``), then that rail's least-loaded rank (ties: node load, ``rank_order``).
    Bytes are the parameter's own (what its reduce and broadcast send); NS cost is not weighed.

    Args:
        specs: the group's Muon matrices.
        positions: ``(node, card)`` of every group index (:func:`rail_positions`).
        rank_order: preference among equal loads (group indices; the plan's spread order);
            default ``0..n-1``.
        multi_precision: count fp32 master weights in the reported state bytes.

    Returns:
        OwnerPartition: group-local owners, ``method="rail"``.
    """
    positions = [(int(n), int(c)) for n, c in positions]
    nranks = len(positions)
    if nranks < 1:
        raise ValueError("rail_partition needs at least one rank position")
    items = _check_specs(specs)
    pref = _rank_positions(rank_order, nranks)
    node = [n for n, _ in positions]
    card = [c for _, c in positions]

    size: Dict[str, int] = {}
    classes: Dict[str, List[str]] = {}
    for s in items:
        size[s.name] = math.prod(s.shape) * FLOAT_DTYPE_SIZES[s.dtype]
        classes.setdefault(s.dtype, []).append(s.name)
    total = max(sum(size.values()), 1)
    class_b = {d: sum(size[k] for k in names) for d, names in classes.items()}

    rank_load = [0] * nranks
    rail_load = dict.fromkeys(card, 0)
    node_load = dict.fromkeys(node, 0)

    def rank_key(r: int) -> tuple:
        return (rank_load[r], node_load[node[r]], pref[r], r)

    owner: Dict[str, int] = {}
    for d in sorted(classes, key=lambda d: (class_b[d], d)):
        cap = max(1, min(nranks, -(-class_b[d] * nranks // total)))
        on_rail: Dict[int, List[int]] = {}  # card -> the class's allowed ranks on it
        for r in sorted(range(nranks), key=lambda r: (
                rank_load[r], rail_load[card[r]], node_load[node[r]], pref[r]))[:cap]:
            on_rail.setdefault(card[r], []).append(r)
        first = {c: min(pref[r] for r in rs) for c, rs in on_rail.items()}
        rails = [(rail_load[c], first[c], c) for c in on_rail]
        heapq.heapify(rails)
        # Loads only grow, so a stale rank entry (its node grew through another rail) is a
        # lower bound of its current key: a top whose key is current is the exact minimum.
        ranks = {c: [rank_key(r) for r in rs] for c, rs in on_rail.items()}
        for heap in ranks.values():
            heapq.heapify(heap)
        for k in sorted(sorted(classes[d]), key=size.__getitem__, reverse=True):
            c = rails[0][2]  # rail loads change only here: the top is current
            heap = ranks[c]
            while heap[0] != rank_key(heap[0][3]):  # a node grew through another rail
                heapq.heapreplace(heap, rank_key(heap[0][3]))
            r = heap[0][3]
            owner[k] = r
            rank_load[r] += size[k]
            rail_load[c] += size[k]
            node_load[node[r]] += size[k]
            heapq.heapreplace(heap, rank_key(r))
            heapq.heapreplace(rails, (rail_load[c], first[c], c))
    return _partition(items, nranks, [owner[s.name] for s in items], PARTITION_RAIL,
                      multi_precision)

