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
"""Where every byte of the Muon sharding optimizer goes, as plain data.

:class:`ShardingLayout` is the one place that decides placement: from
parameter metadata (name, shape, dtype, colour, ``use_muon``), the colour
groups' ranks, the optional :class:`HierarchicalCommPlan` and the settings it
computes, for one rank,

* the owner of every Muon matrix (via ``muon_sharding_partition``),
* the Muon buckets per (colour, owner, dtype) and their fused chunks,
* the element-wise buffers of the other parameters and each rank's range,
* the route of every bucket (flat or hierarchical, launched from the
  backward hooks or from ``reduce_gradients``),
* the ordered collectives of one training step.

Nothing here needs a process group or a Paddle tensor, so the optimizer, the
plan tool, ``verify`` and the benchmarks all read the same object: the
optimizer allocates buffers and groups from it and nothing else.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Hashable, Mapping, Sequence

from .muon_sharding_options import (
    PARTITION_BALANCED,
    PARTITION_DEVELOP,
    PARTITION_STRATEGIES,
    option_default,
)
from .muon_sharding_partition import (
    MatrixSpec,
    balanced_partition,
    partition_from_owners,
    dtype_itemsize,
    upstream_partition,
)
from .muon_sharding_stages import build_sync_stages, stage_element_limit

if TYPE_CHECKING:
    from .muon_comm_plan import HierarchicalCommPlan

__all__ = [
    "ParamMeta",
    "LayoutSettings",
    "MuonBucketSpec",
    "SliceBufferSpec",
    "SyncStageSpec",
    "StepPhase",
    "CommOp",
    "ShardingLayout",
    "assign_muon_owners",
    "chunk_by_size",
    "NO_HOOK_COLOURS",
    "ROUTE_FLAT",
    "ROUTE_HIERARCHICAL",
    "PHASE_REDUCE_SCATTER",
    "PHASE_ALL_GATHER",
    "PHASE_INTRA_NODE_REDUCE",
    "PHASE_CROSS_NODE_REDUCE",
    "PHASE_CROSS_NODE_BROADCAST",
    "PHASE_INTRA_NODE_BROADCAST",
    "flat_reduce_phase",
    "flat_broadcast_phase",
]

#: Colours whose gradients are never reduced from overlap hooks (develop's
#: shared MTP weights: complete only after the pipeline's shared-weight sync).
NO_HOOK_COLOURS = ("dense_weight_no_hook", "moe_weight_no_hook")

ROUTE_FLAT = "flat"
ROUTE_HIERARCHICAL = "hierarchical"

PHASE_REDUCE_SCATTER = "reduce_scatter"
PHASE_ALL_GATHER = "all_gather_slices"
PHASE_INTRA_NODE_REDUCE = "intra_node_reduce"
PHASE_CROSS_NODE_REDUCE = "cross_node_reduce"
PHASE_CROSS_NODE_BROADCAST = "cross_node_broadcast"
PHASE_INTRA_NODE_BROADCAST = "intra_node_broadcast"

#: When an op is issued: from a backward hook (overlap), by reduce_gradients, by step.
TRIGGER_BACKWARD = "backward"
TRIGGER_REDUCE = "reduce_gradients"
TRIGGER_STEP = "step"
TRIGGER_SYNC = "sync"

# How a phase reaches its group (StepPhase.route).
ROUTE_INTRA_NODE = "intra_node"
ROUTE_CROSS_NODE = "cross_node"
ROUTE_SLICES = "slices"

# Bytes FusedCommBuffer pads every parameter to (Paddle's tensor_fusion_helper
# uses 256 for gpu/npu/xpu; the CPU compat registers the same).
DEFAULT_ALIGNMENT_BYTES = 256
# Element sizes Paddle's fusion helper knows; other dtypes cannot be fused there.
_NON_FLOAT_SIZES = {"int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


@functools.lru_cache(maxsize=64)
def _group_index(group: tuple) -> dict:
    """Global rank -> index in ``group`` (shared by every rank's layout; do not mutate)."""
    return {r: i for i, r in enumerate(group)}


@functools.lru_cache(maxsize=4096)
def flat_reduce_phase(group: tuple) -> str:
    """Phase label of a flat reduce onto owners in ``group``."""
    return f"reduce_to_owner[{list(group)}]"


@functools.lru_cache(maxsize=4096)
def flat_broadcast_phase(group: tuple) -> str:
    """Phase label of a flat broadcast from owners in ``group``."""
    return f"broadcast_from_owner[{list(group)}]"


def canonical_dtype(dtype: Any) -> str:
    """``paddle.float32`` / ``"paddle.bfloat16"`` / ``"fp32"`` -> ``"float32"`` etc."""
    text = str(dtype).strip().lower()
    for prefix in ("paddle.", "vartype.", "datatype."):
        if text.startswith(prefix):
            text = text[len(prefix):]
    if text in _NON_FLOAT_SIZES:
        return text
    try:
        dtype_itemsize(text)
    except ValueError:
        return text
    return {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
            "half": "float16", "fp64": "float64", "double": "float64"}.get(text, text)


@functools.lru_cache(maxsize=None)
def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name (4 for names we do not know)."""
    if dtype in _NON_FLOAT_SIZES:
        return _NON_FLOAT_SIZES[dtype]
    try:
        return dtype_itemsize(dtype)
    except ValueError:
        return 4


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
        dtype = canonical_dtype(self.dtype)
        numel = math.prod(int(d) for d in self.shape)
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "numel", numel)
        object.__setattr__(self, "nbytes", numel * itemsize(dtype))


@dataclass(frozen=True)
class LayoutSettings:
    """The options that change placement or schedule (read once by the optimizer).

    Attributes:
        comm_buffer_size_MB: fused gradient buffer size; ``<= 0``: per-parameter reduces.
        comm_overlap: backward hooks launch each buffer's first reduce.
        partition_strategy: ``"upstream_greedy"`` (develop's rule, the default) or
            ``"balanced"``.
        alignment_bytes: per-parameter padding of fused buffers.
        overlap_sync: develop's ``overlap_optimize_and_sync``: the step
            updates stage by stage and syncs each stage while the next one
            computes (off under ``comm_group_call_opt`` unless
            ``overlap_sync_group_call``).
        overlap_sync_group_call: keep the staged sync on the hierarchical route.
    """

    comm_buffer_size_MB: float = 256.0
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


@dataclass(frozen=True)
class SyncStageSpec:
    """One stage of the overlapped update: update these parameters, then sync them.

    Attributes:
        kind: ``"2d"`` (owners broadcast whole matrices) or ``"1d"`` (all-gather
            of one element-wise buffer).
        colour: colour key; group: the colour group's global ranks.
        keys: the Muon group keys of the stage (2d).
        owners: ``(owner global rank, dtype, parameter names, numel)`` per
            broadcast buffer, in launch order (2d).
        local_params: names this rank updates in the stage.
        buffer_index: index into ``ShardingLayout.slice_buffers`` (1d).
    """

    kind: str
    colour: Hashable
    group: tuple
    keys: tuple = ()
    owners: tuple = ()
    local_params: tuple = ()
    buffer_index: int = -1


@dataclass(frozen=True)
class StepPhase:
    """One phase of the step plan: one collective pattern on one group.

    Attributes:
        trigger: when it runs: ``"backward"`` (a buffer's hook),
            ``"reduce_gradients"``, ``"step"`` (the parameter sync), or
            ``"sync[k]"`` (the sync of update stage k, overlapped update).
        label: the phase name (profiler, flight recorder, recorder comparison).
        op: ``reduce_scatter`` / ``reduce`` / ``broadcast`` / ``all_gather``.
        route: ``flat`` (the colour group), ``intra_node`` / ``cross_node``
            (the hierarchical groups) or ``slices`` (each element-wise
            buffer's own group).
        group: global ranks of the group (empty for ``slices``).
        items: ``(buffer ref, root global rank)``; refs are ``("muon", i)``
            (``muon_buckets[i]``: its gradient parts or broadcast buffer),
            ``("slice", i)`` (``slice_buffers[i]``), ``("stage", k, j)``
            (owner buffer j of sync stage k).
        ops: the collectives this rank issues for the phase.
    """

    trigger: str
    label: str
    op: str
    route: str
    group: tuple
    items: tuple
    ops: tuple


@dataclass(frozen=True)
class CommOp:
    """One collective a rank issues in one step.

    ``numel`` is what the rank contributes (the shard for reduce_scatter and
    all_gather); ``coalesced`` ops of one phase and group form one launch;
    ``payload`` is the unpadded parameter bytes of the whole buffer (cost models).
    """

    trigger: str
    phase: str
    op: str
    group: tuple
    root: int | None
    dtype: str
    numel: int
    colour: Hashable = None
    coalesced: bool = False
    payload: int = 0

    def key(self) -> tuple:
        """Comparable form: ``(phase, op, sorted group, root, dtype, numel)``."""
        return (self.phase, self.op, tuple(sorted(self.group)), self.root, self.dtype,
                self.numel)


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


@functools.lru_cache(maxsize=256)
def _partition_cached(specs: tuple, nranks: int, rank_order: tuple | None, strategy: str,
                      buffer_MB: float):
    # Group-local: every group of the same size and specs shares one result.
    if strategy == PARTITION_DEVELOP:
        return upstream_partition(list(specs), nranks, buffer_MB)
    if strategy == PARTITION_BALANCED:
        return balanced_partition(list(specs), nranks,
                                  rank_order=None if rank_order is None else list(rank_order))
    raise ValueError(
        f"partition_strategy={strategy!r} is not known; use one of {PARTITION_STRATEGIES}."
    )


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
        partition_strategy: ``"upstream_greedy"`` (develop's rule) or ``"balanced"``.
        buffer_size_MB: buffer size of the upstream rule.

    Returns:
        tuple[dict[str, int], OwnerPartition]: name -> owner global rank, and
        the partition (group-local indices). Cached: identical inputs give the
        identical (shared, do not mutate) result.
    """
    ranks = [int(r) for r in group_ranks]
    rank_order = None
    if plan is not None and partition_strategy == PARTITION_BALANCED:
        index = {r: i for i, r in enumerate(ranks)}
        rank_order = tuple(index[r] for r in plan.spread_rank_order(plan.stage_of(ranks[0])))
    partition = _partition_cached(tuple(specs), len(ranks), rank_order, partition_strategy,
                                  float(buffer_size_MB))
    return {name: ranks[idx] for name, idx in partition.owners.items()}, partition


@dataclass
class ShardingLayout:
    """Owners, buckets, element-wise ranges and the step schedule of one rank.

    Build with :meth:`build`; all fields are plain data.

    Attributes:
        rank: the global rank the layout is for.
        groups: colour key -> global ranks of the colour group (group order).
        settings: the :class:`LayoutSettings`.
        plan: the hierarchical plan (None: flat routing everywhere).
        owners: Muon parameter name -> owning global rank.
        partitions: colour key -> OwnerPartition (load figures for tools).
        muon_buckets: :class:`MuonBucketSpec` in issue order.
        slice_buffers: :class:`SliceBufferSpec` in issue order.
        params: name -> :class:`ParamMeta`.
    """

    rank: int
    groups: dict
    settings: LayoutSettings
    plan: Any
    owners: dict
    partitions: dict
    muon_buckets: list
    slice_buffers: list
    params: dict = field(repr=False)

    @classmethod
    def build(
        cls,
        params: Sequence[ParamMeta],
        groups: Mapping[Hashable, Sequence[int]],
        rank: int,
        settings: LayoutSettings = LayoutSettings(),
        plan: HierarchicalCommPlan | None = None,
        fixed_owners: Mapping[str, int] | None = None,
    ) -> ShardingLayout:
        """Compute the layout of ``rank``.

        Args:
            params: the rank's trainable parameters in model order.
            groups: colour key -> global ranks of its group; every colour
                used by ``params`` needs an entry containing ``rank``.
            rank: this global rank.
            settings: placement options.
            plan: with it, default-colour (``None``) Muon buckets route
                hierarchically.
            fixed_owners: Muon parameter name -> owning global rank, decided
                beforehand for the whole job (develop's machine-balanced
                rule); None: ``settings.partition_strategy`` per colour group.

        Returns:
            ShardingLayout: the layout.

        Raises:
            ValueError: a colour without a group, a group without ``rank``, or
                ``fixed_owners`` lacking a Muon parameter or naming a rank outside
                its colour group.
        """
        groups = {k: tuple(int(r) for r in v) for k, v in groups.items()}
        for p in params:
            if p.colour not in groups:
                raise ValueError(
                    f"parameter {p.name} has colour {p.colour!r} but no group was "
                    f"given for it (known colours: {list(groups)})."
                )
        for key, ranks in groups.items():
            if rank not in ranks:
                raise ValueError(
                    f"rank {rank} is not in the group of colour {key!r} "
                    f"({list(ranks)}); every rank must hold the parameters of the "
                    "colour groups it belongs to."
                )
        muon_by_colour: dict = OrderedDict()
        other_by_colour: dict = OrderedDict()
        for p in params:
            target = muon_by_colour if p.use_muon else other_by_colour
            target.setdefault(p.colour, []).append(p)

        owners: dict = {}
        partitions: dict = {}
        buckets: list = []
        for colour, cparams in muon_by_colour.items():
            hier_plan = plan if colour is None else None
            fixed = None if fixed_owners is None else _fixed_owners(
                colour, groups[colour], cparams, fixed_owners)
            owner_of, partition, cbuckets = _colour_muon_layout(
                colour, groups[colour], tuple(cparams), hier_plan, settings, fixed)
            owners.update(owner_of)
            partitions[colour] = partition
            buckets.extend(cbuckets)
        slices: list = []
        for colour, cparams in other_by_colour.items():
            slices.extend(_colour_slice_layout(colour, groups[colour], tuple(cparams), settings))
        return cls(rank=rank, groups=groups, settings=settings, plan=plan, owners=owners,
                   partitions=partitions, muon_buckets=buckets, slice_buffers=slices,
                   params={p.name: p for p in params})

    @staticmethod
    def _padded(numel: int, dtype: str, settings: LayoutSettings, multiple: int) -> int:
        align = max(1, settings.alignment_bytes // itemsize(dtype)) * multiple
        return (numel + align - 1) // align * align

    @classmethod
    def _muon_buckets(cls, colour, group, params, owner_of, hierarchical, settings) -> tuple:
        grouped: dict = OrderedDict()
        for p in params:
            grouped.setdefault((owner_of[p.name], p.dtype), []).append(p)
        out = []
        for (owner, dtype), bparams in sorted(grouped.items()):
            chunks = chunk_numels = chunk_bytes = ()
            if settings.fused:
                idx = chunk_by_size([p.nbytes for p in bparams], settings.comm_buffer_size_MB)
                chunks = tuple(tuple(bparams[i].name for i in c) for c in idx)
                chunk_numels = tuple(
                    sum(cls._padded(bparams[i].numel, dtype, settings, 1) for i in c)
                    for c in idx
                )
                chunk_bytes = tuple(sum(bparams[i].nbytes for i in c) for c in idx)
            out.append(MuonBucketSpec(
                colour=colour, group=group, owner=owner, dtype=dtype,
                params=tuple(p.name for p in bparams), chunks=chunks,
                route=ROUTE_HIERARCHICAL if hierarchical else ROUTE_FLAT,
                overlap=settings.comm_overlap and settings.fused
                and colour not in NO_HOOK_COLOURS,
                numel=sum(p.numel for p in bparams), chunk_numels=chunk_numels,
                param_numels=tuple(p.numel for p in bparams), chunk_bytes=chunk_bytes,
                param_bytes=tuple(p.nbytes for p in bparams),
            ))
        return tuple(out)

    @classmethod
    def _slice_buffers(cls, colour, group, params, settings) -> tuple:
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
                padded = tuple(cls._padded(p.numel, dtype, settings, len(group))
                               for p in members)
                offsets = tuple(sum(padded[:i]) for i in range(len(padded)))
                out.append(SliceBufferSpec(
                    colour=colour, group=group, dtype=dtype,
                    params=tuple(p.name for p in members), offsets=offsets,
                    padded=padded, param_numels=tuple(p.numel for p in members),
                    overlap=settings.comm_overlap and colour not in NO_HOOK_COLOURS,
                    payload=sum(p.nbytes for p in members),
                ))
        return tuple(out)

    # ------------------------------------------------------------ queries
    def group_index(self, colour: Hashable) -> int:
        """This rank's index in the colour's group."""
        return self.groups[colour].index(self.rank)

    def owned_params(self) -> list:
        """Names of the Muon matrices this rank owns, in bucket order."""
        return [n for b in self.muon_buckets if b.owner == self.rank for n in b.params]

    def slice_buffer_of(self, name: str) -> SliceBufferSpec:
        """The element-wise buffer holding parameter ``name``."""
        for buf in self.slice_buffers:
            if name in buf.params:
                return buf
        raise KeyError(f"{name} is not an element-wise (non-Muon) parameter")

    def local_range(self, name: str) -> tuple:
        """Flattened range of ``name`` this rank updates (see the optimizer's ``local_range``)."""
        if name in self.owners:
            if self.owners[name] != self.rank:
                return 0, 0
            return 0, self.params[name].numel
        if name not in self.params:
            raise KeyError(f"{name} is not a trainable parameter of this layout")
        buf = self.slice_buffer_of(name)
        return buf.range_in_param(name, self.group_index(buf.colour))

    # ------------------------------------------------------- sync stages
    @property
    def staged_sync(self) -> bool:
        """Whether the step syncs stage by stage (``overlap_sync`` in effect)."""
        s = self.settings
        return s.overlap_sync and (self.plan is None or s.overlap_sync_group_call)

    def sync_stages(self) -> tuple:
        """The stages of the overlapped update, identical on every rank but ``local_params``.

        Returns:
            tuple[SyncStageSpec]: 2d stages per colour, then one 1d stage per
            element-wise buffer (develop's ``_build_sync_stages``).
        """
        cached = self.__dict__.get("_sync_stage_cache")
        if cached is not None:
            return cached
        by_colour: dict = OrderedDict()
        for meta in self.params.values():
            if meta.name in self.owners:
                by_colour.setdefault(meta.colour, []).append(meta)
        sorted_by_colour, rank2params, info = OrderedDict(), OrderedDict(), OrderedDict()
        for colour, metas in by_colour.items():
            ranks = self.groups[colour]
            index = _group_index(tuple(ranks))
            # owners only, in group order: a rank owning nothing has no stage
            # entry, and a per-rank table would cost O(group) on every rank
            by_rank: dict = {}
            for m in metas:
                by_rank.setdefault(index[self.owners[m.name]], []).append(m)
            rank2params[colour] = OrderedDict(sorted(by_rank.items()))
            sorted_by_colour[colour] = sorted(metas, key=lambda m: index[self.owners[m.name]])
            info[colour] = {"group": ranks, "world_size": len(ranks),
                            "rank": index[self.rank] if len(ranks) > 1 else -1}
        raw = build_sync_stages(
            sorted_by_colour, rank2params, info, self.slice_buffers,
            lambda buf: buf.params,
            lambda m: m.group_key if m.group_key is not None else (None, m.shape),
            stage_element_limit(self.settings.comm_buffer_size_MB),
        )
        stages = []
        for stage in raw:
            if stage["kind"] == "1d":
                index = self.slice_buffers.index(stage["buffer"])
                buf = stage["buffer"]
                stages.append(SyncStageSpec("1d", buf.colour, buf.group, buffer_index=index,
                                            local_params=tuple(stage["local_params"])))
                continue
            group = stage["group"]
            owners = []
            for idx, metas in stage["rank2params"].items():
                by_dtype: dict = OrderedDict()
                for m in metas:
                    by_dtype.setdefault(m.dtype, []).append(m)
                for dtype, ms in by_dtype.items():
                    owners.append((group[idx], dtype, tuple(m.name for m in ms),
                                   sum(m.numel for m in ms)))
            stages.append(SyncStageSpec(
                "2d", stage["color"], group, tuple(stage["keys"]), tuple(owners),
                tuple(m.name for m in stage["local_params"])))
        self.__dict__["_sync_stage_cache"] = tuple(stages)
        return self.__dict__["_sync_stage_cache"]

    def _staged_sync_phases(self) -> list:
        """The sync phases of the overlapped update: stage k's, after stage k's update.

        Items of a 2-D stage are ``("stage", k, j)`` (its j-th owner buffer).
        """
        phases: list = []
        plan, rank = self.plan, self.rank
        for k, stage in enumerate(self.sync_stages()):
            trigger = f"{TRIGGER_SYNC}[{k}]"
            if stage.kind == "1d":
                buf = self.slice_buffers[stage.buffer_index]
                phases.append(StepPhase(
                    trigger, PHASE_ALL_GATHER, "all_gather", ROUTE_SLICES, buf.group,
                    ((("slice", stage.buffer_index), None),),
                    (CommOp(TRIGGER_STEP, PHASE_ALL_GATHER, "all_gather", buf.group, None,
                            buf.dtype, buf.shard_numel, buf.colour, False, buf.payload),)))
                continue

            def bcast(label, group, root, dtype, numel):
                return CommOp(TRIGGER_STEP, label, "broadcast", group, root, dtype, numel,
                              stage.colour, True, numel * itemsize(dtype))

            entries = list(enumerate(stage.owners))
            if plan is not None and stage.colour is None:
                node, same_card = self._hier_groups()
                cross = [(j, o) for j, o in entries if plan.in_cross_node_step(o[0], rank)]
                phases.append(StepPhase(
                    trigger, PHASE_CROSS_NODE_BROADCAST, "broadcast", ROUTE_CROSS_NODE,
                    same_card, tuple((("stage", k, j), o[0]) for j, o in cross),
                    tuple(bcast(PHASE_CROSS_NODE_BROADCAST, same_card, o[0], o[1], o[3])
                          for _, o in cross)))
                roots = [plan.intra_node_root(o[0], rank) for _, o in entries]
                phases.append(StepPhase(
                    trigger, PHASE_INTRA_NODE_BROADCAST, "broadcast", ROUTE_INTRA_NODE, node,
                    tuple((("stage", k, j), r) for (j, _), r in zip(entries, roots)),
                    tuple(bcast(PHASE_INTRA_NODE_BROADCAST, node, r, o[1], o[3])
                          for (_, o), r in zip(entries, roots))))
            else:
                label = flat_broadcast_phase(stage.group)
                phases.append(StepPhase(
                    trigger, label, "broadcast", ROUTE_FLAT, stage.group,
                    tuple((("stage", k, j), o[0]) for j, o in entries),
                    tuple(bcast(label, stage.group, o[0], o[1], o[3]) for _, o in entries)))
        return phases

    # ----------------------------------------------------------- schedule
    def comm_groups(self) -> list:
        """Global ranks of every group this rank's schedule uses."""
        groups = list(self.groups.values())
        if self.plan is not None and any(b.route == ROUTE_HIERARCHICAL
                                         for b in self.muon_buckets):
            groups.extend(self._hier_groups())
        return groups

    def _hier_groups(self) -> tuple:
        plan, rank = self.plan, self.rank
        node = plan.node_ranks(plan.node_of(rank))
        same_card = plan.same_card_ranks(plan.stage_of(rank), plan.card_of(rank))
        return node, same_card

    def _flat_groups(self, buckets) -> list:
        order: dict = OrderedDict()
        for b in buckets:
            order.setdefault(b.group, []).append(b)
        return list(order.items())

    def step_plan(self) -> list:
        """The step as data: ordered phases, each one collective pattern on one group.

        Every rank derives the same sequence from replicated metadata (its own
        roots and routes differ). The optimizer's hooks, ``reduce_gradients``
        and parameter sync walk the phases of their trigger; :meth:`schedule`
        lists their collectives.

        Returns:
            list[StepPhase]: backward-hook phases (model order of their
            buffers; the real order follows the backward pass), then
            ``reduce_gradients``, then the parameter sync of ``step``.
        """
        cached = self.__dict__.get("_step_plan_cache")
        if cached is not None:
            return list(cached)
        rank, plan = self.rank, self.plan
        phases: list = []
        index = {id(b): i for i, b in enumerate(self.muon_buckets)}
        hier = [b for b in self.muon_buckets if b.route == ROUTE_HIERARCHICAL]
        flat = [b for b in self.muon_buckets if b.route == ROUTE_FLAT]
        node = same_card = None
        if hier:
            node, same_card = self._hier_groups()

        def reduce_ops(trigger, label, group, b, root, coalesced):
            return tuple(CommOp(trigger, label, "reduce", group, root, b.dtype, n, b.colour,
                                coalesced, payload) for n, payload in b.reduce_parts())

        def rs_op(trigger, buf):
            return CommOp(trigger, PHASE_REDUCE_SCATTER, "reduce_scatter", buf.group, None,
                          buf.dtype, buf.shard_numel, buf.colour, False, buf.payload)

        # backward: hooks launch each hooked buffer's first hop, one op per buffer
        hooked_rs = [i for i, s in enumerate(self.slice_buffers)
                     if s.overlap and len(s.group) > 1]
        for i in hooked_rs:
            buf = self.slice_buffers[i]
            phases.append(StepPhase(TRIGGER_BACKWARD, PHASE_REDUCE_SCATTER, "reduce_scatter",
                                    ROUTE_SLICES, buf.group, ((("slice", i), None),),
                                    (rs_op(TRIGGER_BACKWARD, buf),)))
        for b in self.muon_buckets:
            if not b.overlap:
                continue
            if b.route == ROUTE_HIERARCHICAL:
                label, route, group = PHASE_INTRA_NODE_REDUCE, ROUTE_INTRA_NODE, node
                root = plan.intra_node_root(b.owner, rank)
            else:
                label, route, group, root = flat_reduce_phase(b.group), ROUTE_FLAT, b.group, \
                    b.owner
            phases.append(StepPhase(TRIGGER_BACKWARD, label, "reduce", route, group,
                                    ((("muon", index[id(b)]), root),),
                                    reduce_ops(TRIGGER_BACKWARD, label, group, b, root, False)))
        # reduce_gradients: what the hooks did not launch (and waits for what
        # they did), then the second hop
        hooked = set(hooked_rs)
        phases.append(StepPhase(
            TRIGGER_REDUCE, PHASE_REDUCE_SCATTER, "reduce_scatter", ROUTE_SLICES, (),
            tuple((("slice", i), None) for i in range(len(self.slice_buffers))),
            tuple(rs_op(TRIGGER_REDUCE, buf) for i, buf in enumerate(self.slice_buffers)
                  if i not in hooked)))
        intra = [b for b in hier if not b.overlap]
        if intra:
            items = tuple((("muon", index[id(b)]), plan.intra_node_root(b.owner, rank))
                          for b in intra)
            phases.append(StepPhase(
                TRIGGER_REDUCE, PHASE_INTRA_NODE_REDUCE, "reduce", ROUTE_INTRA_NODE, node, items,
                tuple(op for b, (_, root) in zip(intra, items)
                      for op in reduce_ops(TRIGGER_REDUCE, PHASE_INTRA_NODE_REDUCE, node, b,
                                           root, True))))
        cross = [b for b in hier if plan.in_cross_node_step(b.owner, rank)]
        if hier:
            phases.append(StepPhase(
                TRIGGER_REDUCE, PHASE_CROSS_NODE_REDUCE, "reduce", ROUTE_CROSS_NODE, same_card,
                tuple((("muon", index[id(b)]), b.owner) for b in cross),
                tuple(op for b in cross
                      for op in reduce_ops(TRIGGER_REDUCE, PHASE_CROSS_NODE_REDUCE, same_card,
                                           b, b.owner, True))))
        for group, buckets in self._flat_groups([b for b in flat if not b.overlap]):
            label = flat_reduce_phase(group)
            phases.append(StepPhase(
                TRIGGER_REDUCE, label, "reduce", ROUTE_FLAT, group,
                tuple((("muon", index[id(b)]), b.owner) for b in buckets),
                tuple(op for b in buckets
                      for op in reduce_ops(TRIGGER_REDUCE, label, group, b, b.owner, True))))
        if self.staged_sync:
            phases.extend(self._staged_sync_phases())
        else:
            phases.extend(self._sync_phases(hier, flat, node, same_card, index))
        self.__dict__["_step_plan_cache"] = tuple(phases)
        return list(phases)

    def _sync_phases(self, hier, flat, node, same_card, index) -> list:
        """step: the parameter sync, the reduce's mirror."""
        rank, plan = self.rank, self.plan
        phases: list = []

        def bcast(b, label, group, root):
            return CommOp(TRIGGER_STEP, label, "broadcast", group, root, b.dtype, b.numel,
                          b.colour, True, b.numel * itemsize(b.dtype))

        if hier:
            cross = [b for b in hier if plan.in_cross_node_step(b.owner, rank)]
            phases.append(StepPhase(
                TRIGGER_STEP, PHASE_CROSS_NODE_BROADCAST, "broadcast", ROUTE_CROSS_NODE,
                same_card, tuple((("muon", index[id(b)]), b.owner) for b in cross),
                tuple(bcast(b, PHASE_CROSS_NODE_BROADCAST, same_card, b.owner)
                      for b in cross)))
            items = tuple((("muon", index[id(b)]), plan.intra_node_root(b.owner, rank))
                          for b in hier)
            phases.append(StepPhase(
                TRIGGER_STEP, PHASE_INTRA_NODE_BROADCAST, "broadcast", ROUTE_INTRA_NODE, node,
                items, tuple(bcast(b, PHASE_INTRA_NODE_BROADCAST, node, root)
                             for b, (_, root) in zip(hier, items))))
        for group, buckets in self._flat_groups(flat):
            label = flat_broadcast_phase(group)
            phases.append(StepPhase(
                TRIGGER_STEP, label, "broadcast", ROUTE_FLAT, group,
                tuple((("muon", index[id(b)]), b.owner) for b in buckets),
                tuple(bcast(b, label, group, b.owner) for b in buckets)))
        phases.append(StepPhase(
            TRIGGER_STEP, PHASE_ALL_GATHER, "all_gather", ROUTE_SLICES, (),
            tuple((("slice", i), None) for i in range(len(self.slice_buffers))),
            tuple(CommOp(TRIGGER_STEP, PHASE_ALL_GATHER, "all_gather", buf.group, None,
                         buf.dtype, buf.shard_numel, buf.colour, False, buf.payload)
                  for buf in self.slice_buffers)))
        return phases

    def phases_of(self, trigger: str) -> list:
        """The phases of one trigger, in plan order."""
        return [ph for ph in self.step_plan() if ph.trigger == trigger]

    def schedule(self) -> list:
        """Ordered collectives this rank issues in one step (the plan's ops).

        Hook-launched ops (``trigger == "backward"``) are listed in model order
        of their buffers; their real order follows the backward pass.

        Returns:
            list[CommOp]: the step's collectives.
        """
        # One-rank groups (e.g. moe_sharding_degree=1) hold the result already.
        return [op for ph in self.step_plan() for op in ph.ops if len(op.group) > 1]

    def to_dict(self) -> dict:
        """JSON-ready summary (owners, buckets, slice ranges, schedule) for tools and tests."""
        return {
            "rank": self.rank,
            "groups": {str(k): list(v) for k, v in self.groups.items()},
            "owners": dict(sorted(self.owners.items())),
            "muon_buckets": [
                {"colour": str(b.colour), "group": list(b.group), "owner": b.owner,
                 "dtype": b.dtype, "params": list(b.params),
                 "chunks": [list(c) for c in b.chunks], "route": b.route_kind,
                 "numel": b.numel}
                for b in self.muon_buckets
            ],
            "slice_buffers": [
                {"colour": str(s.colour), "dtype": s.dtype, "params": list(s.params),
                 "offsets": list(s.offsets), "padded": list(s.padded),
                 "local": [list(s.range_in_param(n, self.group_index(s.colour)))
                           for n in s.params]}
                for s in self.slice_buffers
            ],
            "schedule": [[op.trigger, *op.key()] for op in self.schedule()],
        }


# Ranks sharing a colour group and its parameters share its layout: computed
# once per (group, parameters, settings), so a 512-rank plan stays fast.
def _fixed_owners(colour, group: tuple, params: Sequence[ParamMeta],
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


@functools.lru_cache(maxsize=1024)
def _colour_muon_layout(colour, group: tuple, params: tuple, plan, settings: LayoutSettings,
                        fixed: tuple | None = None):
    specs = [MatrixSpec(p.name, p.shape, p.dtype) for p in params]
    if fixed is None:
        owner_of, partition = assign_muon_owners(
            specs, group, plan, settings.partition_strategy, settings.comm_buffer_size_MB)
    else:
        partition = partition_from_owners(specs, len(group), dict(fixed),
                                          method="machine_balanced")
        owner_of = {name: group[idx] for name, idx in fixed}
    buckets = ShardingLayout._muon_buckets(colour, group, params, owner_of, plan is not None,
                                           settings)
    return owner_of, partition, buckets


@functools.lru_cache(maxsize=1024)
def _colour_slice_layout(colour, group: tuple, params: tuple, settings: LayoutSettings):
    return ShardingLayout._slice_buffers(colour, group, params, settings)
