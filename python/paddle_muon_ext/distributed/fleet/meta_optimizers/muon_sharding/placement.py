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
"""Placement of the Muon sharding layout, one colour group at a time.

What it reads (:class:`ParamMeta`, :class:`LayoutSettings`) and what it decides: the owner of every
Muon matrix, their buckets and fused chunks, and the element-wise buffers (pure data, no paddle).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Mapping, Sequence

from .options import (
    PARTITION_BALANCED,
    PARTITION_DEVELOP,
    PARTITION_RAIL,
    PARTITION_STRATEGIES,
    option_default,
)
from .owners import (
    MatrixSpec,
    OwnerPartition,
    _check_specs,
    balanced_partition,
    develop_active_ranks,
    partition_from_owners,
    rail_partition,
    rail_positions,
    upstream_partition,
)
from .types import (
    DEFAULT_ALIGNMENT_BYTES,
    DEVELOP_DEFAULT_BUFFER_MB,
    ROUTE_FLAT,
    ROUTE_HIERARCHICAL,
    HashedTuple,
    IdentityMemo,
    canonical_dtype,
    is_hooked,
    itemsize,
)

if TYPE_CHECKING:
    from .comm_plan import HierarchicalCommPlan


@dataclass(frozen=True)
class ParamMeta:
    """What the layout needs to know about one trainable parameter.

    ``colour`` is the colour key (None: the default sharding group); ``dtype``
    is normalised to a name like ``"float32"``. ``group_key`` is Muon's
    ``muon_group_key`` of the parameter (None: ``(None, shape)``, the key of
    a matrix without a ``split_concat_func``); sync stages never split a key.
    """

    name: str
    shape: tuple
    dtype: str
    colour: Hashable = None
    use_muon: bool = False
    group_key: Hashable = None
    numel: int = field(init=False, compare=False)
    nbytes: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        # Frozen: derived sizes are computed once, the schedule reads them often.
        shape = self.shape
        # a tuple of ints (the tools' specs) is kept as is: a plan builds
        # 100,000 of these (bool is not an int here: it converts, as before)
        if type(shape) is not tuple or not all(type(d) is int for d in shape):
            shape = tuple(int(d) for d in shape)
            object.__setattr__(self, "shape", shape)
        dtype = canonical_dtype(self.dtype)
        numel = math.prod(shape)
        d = self.__dict__
        d["dtype"] = dtype
        d["numel"] = numel
        d["nbytes"] = numel * itemsize(dtype)


@dataclass(frozen=True)
class LayoutSettings:
    """The options that change placement or schedule (read once by the optimizer).

    Attributes:
        comm_buffer_size_MB: fused gradient buffer size; ``<= 0``: per-parameter reduces.
        comm_overlap: backward hooks launch each buffer's first reduce.
        partition_strategy: ``"upstream_greedy"`` (develop's rule, the default),
            ``"balanced"`` or ``"rail"`` (hierarchical groups over >= 2 nodes;
            elsewhere ``"balanced"``).
        alignment_bytes: per-parameter padding of fused buffers.
        overlap_sync: develop's ``overlap_optimize_and_sync``: the step
            updates stage by stage and syncs each stage while the next one
            computes (off under ``comm_group_call_opt`` unless
            ``overlap_sync_group_call``).
        overlap_sync_group_call: keep the staged sync on the hierarchical route.
    """

    comm_buffer_size_MB: float = float(DEVELOP_DEFAULT_BUFFER_MB)
    comm_overlap: bool = False
    partition_strategy: str = option_default("muon_partition_strategy")
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES
    # develop's default (FLAGS_muon_sharding_overlap_optimize_and_sync=1)
    overlap_sync: bool = True
    overlap_sync_group_call: bool = False

    @property
    def fused(self) -> bool:
        return self.comm_buffer_size_MB > 0

@dataclass(frozen=True)
class MuonBucketSpec:
    """Muon matrices of one (colour, owner, dtype): one broadcast buffer.

    Attributes:
        colour: colour key; group: the colour group's global ranks (group order).
        owner: owning global rank; dtype: canonical dtype name.
        params: names in model order; chunks: the fused gradient buffers
            (empty when unfused: one reduce per parameter).
        route: ``"flat"`` or ``"hierarchical"``; overlap: launched from hooks.
        numel: elements of the broadcast buffer (unpadded).
        chunk_numels: padded elements of each fused gradient buffer.
        param_numels: elements of each parameter.
    """

    colour: Hashable
    group: tuple
    owner: int
    dtype: str
    params: tuple
    chunks: tuple
    route: str
    overlap: bool
    numel: int
    chunk_numels: tuple
    param_numels: tuple
    chunk_bytes: tuple = ()
    param_bytes: tuple = ()

    @property
    def route_kind(self) -> str:
        """``flat`` / ``hierarchical``, with ``+overlap`` when hooks launch it."""
        return self.route + ("+overlap" if self.overlap else "")

    def reduce_numels(self) -> tuple:
        """Elements of each gradient reduce (per chunk, or per parameter)."""
        return self.chunk_numels if self.chunks else self.param_numels

    def reduce_parts(self) -> tuple:
        """(padded numel, unpadded bytes) of each gradient reduce."""
        if self.chunks:
            return tuple(zip(self.chunk_numels, self.chunk_bytes))
        return tuple(zip(self.param_numels, self.param_bytes))


@dataclass(frozen=True)
class SliceBufferSpec:
    """One REDUCE_SCATTER buffer of element-wise parameters (FusedCommBuffer's layout).

    Every parameter is padded to a multiple of ``alignment / itemsize * nranks``
    elements, so the buffer splits into ``nranks`` equal shards; rank ``i``
    (group index) updates elements ``[i * shard, (i + 1) * shard)``.
    """

    colour: Hashable
    group: tuple
    dtype: str
    params: tuple
    offsets: tuple
    padded: tuple
    param_numels: tuple
    overlap: bool
    payload: int = 0

    @property
    def total(self) -> int:
        return sum(self.padded)

    @property
    def shard_numel(self) -> int:
        return self.total // len(self.group)

    def range_in_param(self, name: str, group_index: int) -> tuple:
        """``(begin, end)`` within the flattened parameter held by group index ``i``.

        Padding excluded; ``(0, 0)`` when the rank's shard holds none of it.
        """
        i = self.params.index(name)
        shard = self.shard_numel
        rank_begin = group_index * shard
        begin = max(self.offsets[i], rank_begin)
        end = min(self.offsets[i] + self.padded[i], rank_begin + shard)
        if begin >= end:
            return 0, 0
        numel = self.param_numels[i]
        lo = min(begin - self.offsets[i], numel)
        hi = min(end - self.offsets[i], numel)
        return (lo, hi) if hi > lo else (0, 0)

    def holds_slice(self, name: str, group_index: int) -> bool:
        """Whether the shard overlaps the parameter's padded range (FusedCommBuffer's rule)."""
        i = self.params.index(name)
        shard = self.shard_numel
        rank_begin = group_index * shard
        return max(self.offsets[i], rank_begin) < min(
            self.offsets[i] + self.padded[i], rank_begin + shard
        )


def chunk_by_size(nbytes: Sequence[int], limit_MB: float) -> list:
    """Split consecutive items into chunks of at most ``limit_MB`` (an item never splits).

    Returns:
        list[list[int]]: item indices per chunk; one chunk per item when
        ``limit_MB <= 0``.
    """
    if limit_MB <= 0:
        return [[i] for i in range(len(nbytes))]
    limit = limit_MB * 1024 * 1024
    chunks: list = [[]]
    size = 0
    for i, b in enumerate(nbytes):
        if chunks[-1] and size + b > limit:
            chunks.append([])
            size = 0
        chunks[-1].append(i)
        size += b
    return chunks if chunks[0] else []


def _relabel(partition: OwnerPartition, rank_order: tuple) -> OwnerPartition:
    """The partition with group index ``p`` renamed ``rank_order[p]``."""
    n = partition.nranks
    state, ns = [0] * n, [0.0] * n
    for p, r in enumerate(rank_order):
        state[r] = partition.state_bytes[p]
        ns[r] = partition.ns_cost[p]
    return dataclasses.replace(
        partition, owners={k: rank_order[v] for k, v in partition.owners.items()},
        state_bytes=state, ns_cost=ns, dtypes=dict(partition.dtypes),
        notes=list(partition.notes))


@functools.lru_cache(maxsize=256)
def _partition_cached(specs: tuple, nranks: int, rank_order: tuple | None, strategy: str,
                      buffer_MB: float, positions: tuple | None):
    # Group-local: every group of the same size and specs shares one result.
    # Every argument is required: lru_cache keys a call that omits a default
    # apart from one that passes it, and the flat and hierarchical owners of a
    # group must share one entry.
    # the rules take the tuple itself: a HashedTuple is validated once (_check_specs)
    if strategy == PARTITION_RAIL:
        return rail_partition(specs, positions,
                              rank_order=None if rank_order is None else list(rank_order))
    if strategy == PARTITION_DEVELOP:
        return upstream_partition(specs, nranks, buffer_MB)
    if strategy == PARTITION_BALANCED:
        if rank_order is not None and sorted(rank_order) == list(range(nranks)):
            # The balanced rule sees a rank only through its rank_order
            # position (every tie-break), so its result for an order is the
            # identity order's with position p renamed rank_order[p]: the
            # flat path (no order) and the hierarchical one (the spread
            # order) share one computation, a second of a 100,000-matrix plan.
            return _relabel(_partition_cached(specs, nranks, None, strategy, buffer_MB, None),
                            rank_order)
        return balanced_partition(specs, nranks,
                                  rank_order=None if rank_order is None else list(rank_order))
    raise ValueError(
        f"partition_strategy={strategy!r} is not known; use one of {PARTITION_STRATEGIES}."
    )


# (specs, nranks, caps) -> the first buffer size develop's rule ran with for
# those caps; bounded as _partition_cached is.
_develop_runs: OrderedDict = OrderedDict()


def _develop_caps(specs: HashedTuple, nranks: int, buffer_MB: float) -> tuple:
    """Develop's active ranks of each dtype class at ``buffer_MB``: the one
    way the buffer size reaches develop's owners (:func:`develop_owner_indices`)."""
    totals = specs.__dict__.get("_develop_class_numels")
    if totals is None:
        by_dtype: dict = {}
        for s in _check_specs(specs):  # classes by canonical dtype, as the rule's
            key = str(s.dtype)
            by_dtype[key] = by_dtype.get(key, 0) + int(s.numel)
        totals = specs.__dict__["_develop_class_numels"] = tuple(sorted(by_dtype.items()))
    return tuple((key, develop_active_ranks([total], nranks, buffer_MB))
                 for key, total in totals)


@functools.lru_cache(maxsize=256)
def _develop_partition(specs: HashedTuple, nranks: int, buffer_MB: float) -> OwnerPartition:
    # plan --recommend tries four buffer sizes; on a large model every dtype
    # class already uses the whole group at the smallest, so the owners are
    # the same: computed once per caps, then only the method label (which
    # names the buffer size) differs.
    key = (specs, nranks, _develop_caps(specs, nranks, buffer_MB))
    first = _develop_runs.get(key)
    if first is None:
        if len(_develop_runs) >= 256:
            _develop_runs.popitem(last=False)
        first = _develop_runs[key] = buffer_MB
    partition = _partition_cached(specs, nranks, None, PARTITION_DEVELOP, first, None)
    if first == buffer_MB:
        return partition
    return dataclasses.replace(partition, method=upstream_partition(
        (), nranks, buffer_MB).method)


# owner map -> name -> global rank, per group ranks: the buffer sizes
# plan --recommend tries share one owner map per rule.
_global_owners = IdentityMemo(64)


def _owners_global(owners: dict, ranks: tuple) -> dict:
    out = _global_owners.get((owners,), ranks)
    if out is IdentityMemo.MISSING:
        out = {name: ranks[idx] for name, idx in owners.items()}
        _global_owners.put((owners,), out, ranks)
    return out


def assign_muon_owners(
    specs: Sequence[MatrixSpec],
    group_ranks: Sequence[int],
    plan: HierarchicalCommPlan | None = None,
    partition_strategy: str = option_default("muon_partition_strategy"),
    buffer_size_MB: float = 256,
):
    """Choose the owning global rank of every Muon matrix of one colour group.

    Args:
        specs: the group's Muon matrices.
        group_ranks: the colour group's global ranks, in group order.
        plan: hierarchical plan; with it, equally loaded ranks are preferred in
            an order alternating cards and nodes so owners spread over rails.
        partition_strategy: ``"upstream_greedy"`` (develop's rule), ``"balanced"``
            or ``"rail"`` (:mod:`.muon_sharding_rail`; without ``plan`` or on a
            group of one node it is ``"balanced"``).
        buffer_size_MB: buffer size of the upstream rule.

    Returns:
        tuple[dict[str, int], OwnerPartition]: name -> owner global rank, and
        the partition (group-local indices). Cached: identical inputs give the
        identical (shared, do not mutate) result.
    """
    ranks = tuple(int(r) for r in group_ranks)
    specs = specs if type(specs) is HashedTuple else HashedTuple(specs)
    rank_order = positions = None
    if partition_strategy == PARTITION_RAIL:
        positions = rail_positions(plan, ranks)
        if positions is None:  # no rail crosses nodes: the balanced rule's owners
            partition_strategy = PARTITION_BALANCED
    if plan is not None and partition_strategy in (PARTITION_BALANCED, PARTITION_RAIL):
        index = {r: i for i, r in enumerate(ranks)}
        rank_order = tuple(index[r] for r in plan.spread_rank_order(plan.stage_of(ranks[0])))
    # Only develop's rule reads the buffer size: keying the balanced rule on it
    # would recompute the same owners for every buffer size plan --recommend tries.
    if partition_strategy == PARTITION_DEVELOP:
        partition = _develop_partition(specs, len(ranks), float(buffer_size_MB))
    else:
        partition = _partition_cached(specs, len(ranks), rank_order, partition_strategy,
                                      0.0, positions)
    return _owners_global(partition.owners, ranks), partition


def padded_numel(numel: int, dtype: str, settings: LayoutSettings, multiple: int) -> int:
    align = max(1, settings.alignment_bytes // itemsize(dtype)) * multiple
    return (numel + align - 1) // align * align


class _BucketSums:
    """Prefix sums of one bucket's parameters, shared by every buffer size.

    ``names``; ``nbytes_before[k]``: bytes of parameters ``0..k-1``;
    ``padded_before(align)[k]``: their elements padded to ``align``.
    """

    def __init__(self, params, numels, nbytes) -> None:
        self.names = [p.name for p in params]
        self.numels = numels
        self.nbytes_before = [0, *itertools.accumulate(nbytes)]
        self._padded: dict = {}

    def padded_before(self, align: int) -> list:
        if align not in self._padded:
            self._padded[align] = [0, *itertools.accumulate(
                (n + align - 1) // align * align for n in self.numels)]
        return self._padded[align]


def _fused_chunks(sums: _BucketSums, align: int, limit_MB: float) -> tuple:
    """:func:`chunk_by_size` of one bucket with each chunk's names, padded
    elements and bytes (a 100,000-matrix plan chunks every bucket once per
    path): a chunk takes the next parameter while its bytes stay within the
    limit (at least one), found by a galloping search on the prefix sums
    (a chunk of k parameters costs O(log k))."""
    limit = limit_MB * 1024 * 1024
    before = sums.nbytes_before
    padded = sums.padded_before(align)
    names = sums.names
    n = len(names)
    chunks, chunk_numels, chunk_bytes = [], [], []
    start = 0
    while start < n:
        base = before[start]
        # the first prefix end >= start + 2 whose bytes from start exceed the
        # limit (n + 1: none); the parameter ending there opens the next chunk
        lo, hi, step = start + 2, n + 1, 1
        while True:  # gallop: every end below lo stays within the limit
            probe = lo + step - 1
            if probe >= hi:
                break
            if before[probe] - base > limit:
                hi = probe + 1
                break
            lo, step = probe + 1, step * 2
        while lo < hi:  # bisect [lo, hi); exact integer differences vs the limit
            mid = (lo + hi) // 2
            if before[mid] - base > limit:
                hi = mid
            else:
                lo = mid + 1
        end = lo - 1
        chunks.append(tuple(names[start:end]))
        chunk_numels.append(padded[end] - padded[start])
        chunk_bytes.append(before[end] - base)
        start = end
    return tuple(chunks), tuple(chunk_numels), tuple(chunk_bytes)


# (parameters, owner map) -> their buckets' parameters: the buffer sizes
# plan --recommend tries share one owner map per rule (assign_muon_owners)
# and group its matrices once.
_grouped_seen = IdentityMemo(16)


def _group_by_owner(params, owner_of) -> list:
    """``[((owner, dtype), params, numels, nbytes, sums)]`` sorted by (owner, dtype)."""
    out = _grouped_seen.get((params, owner_of))
    if out is not IdentityMemo.MISSING:
        return out
    grouped: dict = OrderedDict()
    for p in params:
        grouped.setdefault((owner_of[p.name], p.dtype), []).append(p)
    out = []
    for k, bparams in sorted(grouped.items()):
        numels, nbytes = [p.numel for p in bparams], [p.nbytes for p in bparams]
        out.append((k, bparams, numels, nbytes, _BucketSums(bparams, numels, nbytes)))
    if type(params) is HashedTuple:  # immutable: safe to reuse by identity
        _grouped_seen.put((params, owner_of), out)
    return out


def muon_bucket_specs(colour, group, params, owner_of, hierarchical, settings) -> tuple:
    out = []
    fused = settings.fused
    route = ROUTE_HIERARCHICAL if hierarchical else ROUTE_FLAT
    overlap = fused and is_hooked(settings.comm_overlap, colour)
    for (owner, dtype), bparams, numels, nbytes, sums in _group_by_owner(params, owner_of):
        chunks = chunk_numels = chunk_bytes = ()
        if fused:
            # padded_numel(numel, dtype, settings, 1) of each parameter, inline:
            # a 100,000-matrix plan pads every parameter once per path
            align = max(1, settings.alignment_bytes // itemsize(dtype))
            chunks, chunk_numels, chunk_bytes = _fused_chunks(
                sums, align, settings.comm_buffer_size_MB)
        out.append(MuonBucketSpec(
            colour=colour, group=group, owner=owner, dtype=dtype,
            params=tuple(sums.names), chunks=chunks,
            route=route, overlap=overlap,
            numel=sum(numels), chunk_numels=chunk_numels,
            param_numels=tuple(numels), chunk_bytes=chunk_bytes,
            param_bytes=tuple(nbytes),
        ))
    return tuple(out)


def slice_buffer_specs(colour, group, params, settings) -> tuple:
    by_dtype: dict = OrderedDict()
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    out = []
    for dtype, dparams in by_dtype.items():
        if settings.fused:
            chunks = chunk_by_size([p.nbytes for p in dparams], settings.comm_buffer_size_MB)
        else:
            chunks = [list(range(len(dparams)))]
        for c in chunks:
            members = [dparams[i] for i in c]
            padded = tuple(padded_numel(p.numel, dtype, settings, len(group))
                           for p in members)
            offsets = tuple(sum(padded[:i]) for i in range(len(padded)))
            out.append(SliceBufferSpec(
                colour=colour, group=group, dtype=dtype,
                params=tuple(p.name for p in members), offsets=offsets,
                padded=padded, param_numels=tuple(p.numel for p in members),
                overlap=is_hooked(settings.comm_overlap, colour),
                payload=sum(p.nbytes for p in members),
            ))
    return tuple(out)


# Ranks sharing a colour group and its parameters share its layout: computed
# once per (group, parameters, settings), so a 512-rank plan stays fast.
def fixed_owners(colour, group: tuple, params: Sequence[ParamMeta],
                  owners: Mapping[str, int]) -> tuple:
    """``((name, group index), ...)`` of owners chosen beforehand, checked."""
    out = []
    for p in params:
        if p.name not in owners:
            raise ValueError(
                f"fixed_owners has no entry for Muon parameter {p.name} (colour "
                f"{colour!r}); pass an owner for every keep-whole parameter, or None."
            )
        owner = int(owners[p.name])
        if owner not in group:
            raise ValueError(
                f"fixed_owners gives parameter {p.name} to rank {owner}, outside its colour "
                f"group {list(group)} (colour {colour!r}); an owner must be a member."
            )
        out.append((p.name, group.index(owner)))
    return tuple(out)


# The last parameter tuple's MatrixSpecs: the paths plan --recommend builds
# (two routes x two rules x three buffer sizes) hand the same ParamMeta objects
# in fresh tuples; checked by identity, so any other list is converted anew.
_last_specs: list = [(), HashedTuple()]


def _matrix_specs(params: tuple) -> HashedTuple:
    last, specs = _last_specs
    if last is params or len(last) == len(params) and all(map(operator.is_, last, params)):
        return specs
    specs = HashedTuple(MatrixSpec(p.name, p.shape, p.dtype) for p in params)
    _last_specs[:] = [params, specs]
    return specs


@functools.lru_cache(maxsize=1024)
def colour_muon_layout(colour, group: tuple, params: tuple, plan, settings: LayoutSettings,
                        fixed: tuple | None = None):
    if plan is None and settings.partition_strategy == PARTITION_RAIL:
        # without a plan the rail rule is the balanced one (assign_muon_owners):
        # the flat placement under it (which its hierarchical one renames) is
        # balanced's, one cache entry for both (6 positional arguments, as
        # every call passes them)
        return colour_muon_layout(colour, group, params, None, dataclasses.replace(
            settings, partition_strategy=PARTITION_BALANCED), fixed)
    specs = _matrix_specs(params)
    if fixed is None:
        owner_of, partition = assign_muon_owners(
            specs, group, plan, settings.partition_strategy, settings.comm_buffer_size_MB)
    else:
        partition = partition_from_owners(specs, len(group), dict(fixed),
                                          method="machine_balanced")
        owner_of = {name: group[idx] for name, idx in fixed}
    buckets = None
    if plan is not None:
        # The hierarchical route's buckets are the flat route's (cached: the
        # tools build both) renamed onto their owners, when the owners are a
        # renaming of the flat ones (the same for develop's rule and fixed
        # owners, a rank-order relabelling for the balanced rule).
        flat_owner_of, _, flat_buckets = colour_muon_layout(colour, group, params, None,
                                                            settings, fixed)
        buckets = _renamed_buckets(flat_owner_of, flat_buckets, owner_of)
    if buckets is None:
        buckets = muon_bucket_specs(colour, group, params, owner_of, plan is not None,
                                    settings)
    return owner_of, partition, buckets


# (flat owner map, hierarchical owner map) -> the renaming or None: the owner
# maps are shared by the buffer sizes plan --recommend tries
# (assign_muon_owners), so each pair is compared once.
_renamings = IdentityMemo(16)


def _owner_renaming(flat_owner_of: dict, owner_of: dict):
    rename = _renamings.get((flat_owner_of, owner_of))
    if rename is not IdentityMemo.MISSING:
        return rename
    rename = {}
    for name, owner in flat_owner_of.items():
        if rename.setdefault(owner, owner_of[name]) != owner_of[name]:
            rename = None
            break
    if rename is not None and len(set(rename.values())) != len(rename):
        rename = None
    _renamings.put((flat_owner_of, owner_of), rename)
    return rename


def _renamed_buckets(flat_owner_of: dict, flat_buckets: tuple, owner_of: dict):
    """``flat_buckets`` on the hierarchical route with each owner renamed as
    ``flat_owner_of`` -> ``owner_of`` renames it, in bucket order; None when
    that is no one-to-one renaming of owners (the buckets then differ)."""
    rename = _owner_renaming(flat_owner_of, owner_of)
    if rename is None:
        return None
    out = [dataclasses.replace(b, owner=rename[b.owner], route=ROUTE_HIERARCHICAL)
           for b in flat_buckets]
    # muon_bucket_specs' order: by (owner, dtype)
    out.sort(key=lambda b: (b.owner, b.dtype))
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def colour_slice_layout(colour, group: tuple, params: tuple, settings: LayoutSettings):
    return slice_buffer_specs(colour, group, params, settings)
