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
"""Where every byte of the Muon sharding optimizer goes, as plain data: :class:`ShardingLayout`
(owners, buckets, element-wise ranges, routes, step plan of one rank), no process group or
tensor; the optimizer, ``plan`` and ``verify`` read the same object."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Hashable, Mapping, Sequence

from . import step_plan as _step_plan
from .owners import (MatrixSpec, OwnerPartition, balanced_partition, partition_from_owners,
                     rail_partition, rail_positions, upstream_partition)
from .settings import (DEFAULT_ALIGNMENT_BYTES, DEVELOP_DEFAULT_BUFFER_MB, PARTITION_BALANCED,
                       PARTITION_DEVELOP, PARTITION_RAIL, PARTITION_STRATEGIES,
                       canonical_dtype, itemsize, option_default)
from .step_plan import Route

if TYPE_CHECKING:
    from .comm_plan import HierarchicalCommPlan

__all__ = ["ParamMeta", "LayoutSettings", "MuonBucketSpec", "SliceBufferSpec",
           "ShardingLayout", "assign_muon_owners"]


# ----------------------------------------------------------------- colours
DEFAULT_COLOUR = None  # the colour key of the default sharding group
DEFAULT_RAW_COLOUR = -1  # develop's (keys ``_color_to_comm_buffer_list``)
#: Colours never reduced from overlap hooks (develop's shared MTP weights:
#: complete only after the pipeline's shared-weight sync).
NO_HOOK_COLOURS: tuple = ("dense_weight_no_hook", "moe_weight_no_hook")


@dataclass(frozen=True)
class ParsedColour:
    """What a ``param.color`` value means, by develop's rules: the colour ``key``, a dict's
    ``group`` (else None), ``from_dict`` (develop's ``{'color', 'group'}``) and ``declared``
    (a dict's ``'color'`` as written, else the value: develop's ``_buffer_color``)."""

    key: Hashable
    group: Any
    from_dict: bool
    declared: Any


def parse_colour(value: Any, default_group: Any = None) -> ParsedColour:
    """Read a ``param.color`` value: absent/None/-1, a dict, or (develop's buffers) a bare key.

    Args:
        value: ``getattr(param, "color", None)``.
        default_group: the group of a dict colour without ``'group'``.

    Returns:
        ParsedColour: None, -1 and a dict without ``'color'`` or with None/-1 are the
        default colour; anything else is its own key (a string ``"-1"`` too).
    """
    from_dict = isinstance(value, dict)
    declared = value.get("color") if from_dict else value
    default = declared is None or (isinstance(declared, int) and declared == DEFAULT_RAW_COLOUR)
    return ParsedColour(DEFAULT_COLOUR if default else declared,
                        value.get("group", default_group) if from_dict else None,
                        from_dict, declared)


def is_hooked(comm_overlap: bool, colour: Hashable) -> bool:
    """Whether a buffer of ``colour`` is reduced from the backward hooks (not a no-hook colour)."""
    return bool(comm_overlap) and colour not in NO_HOOK_COLOURS


def is_trainable(param: Any) -> bool:
    """A parameter the optimizer reduces and updates (a zero-size one stays out of every
    buffer, where an empty fused buffer would read as released, and keeps its value)."""
    return not param.stop_gradient and 0 not in tuple(param.shape)


# ------------------------------------------------------------------ specs
@dataclass(frozen=True)
class ParamMeta:
    """What the layout needs to know about one trainable parameter; ``group_key``: Muon's
    ``muon_group_key`` (None: ``(None, shape)``), which sync stages never split."""

    name: str
    shape: tuple
    dtype: str
    colour: Hashable = None
    use_muon: bool = False
    group_key: Hashable = None
    numel: int = field(init=False, compare=False)
    nbytes: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        # Frozen: sizes computed once; a tuple of ints is kept (a bool converts).
        d = self.__dict__
        shape = self.shape
        if type(shape) is not tuple or not all(type(x) is int for x in shape):
            shape = d["shape"] = tuple(int(x) for x in shape)
        d["dtype"] = canonical_dtype(self.dtype)
        d["numel"] = math.prod(shape)
        d["nbytes"] = d["numel"] * itemsize(d["dtype"])


@dataclass(frozen=True)
class LayoutSettings:
    """The options that change placement or schedule (read once by the optimizer).

    Attributes:
        comm_buffer_size_MB: fused gradient buffer size; ``<= 0``: per-parameter reduces.
        comm_overlap: backward hooks launch each buffer's first reduce.
        partition_strategy: ``"upstream_greedy"`` (develop's rule, the default),
            ``"balanced"`` or ``"rail"`` (``"balanced"`` without a plan or on one node).
        alignment_bytes: per-parameter padding of fused buffers.
        overlap_sync: develop's ``overlap_optimize_and_sync`` (on by default): update and
            sync stage by stage (off under ``comm_group_call_opt`` unless the next is set).
        overlap_sync_group_call: keep the staged sync on the hierarchical route.
    """

    comm_buffer_size_MB: float = float(DEVELOP_DEFAULT_BUFFER_MB)
    comm_overlap: bool = False
    partition_strategy: str = option_default("muon_partition_strategy")
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES
    overlap_sync: bool = True
    overlap_sync_group_call: bool = False

    @property
    def fused(self) -> bool:
        return self.comm_buffer_size_MB > 0


@dataclass(frozen=True)
class MuonBucketSpec:
    """Muon matrices of one (colour, owner, dtype): one broadcast buffer. ``group``: the
    colour group's ranks; ``chunks``: the fused gradient buffers (empty when unfused: one
    reduce per parameter); ``overlap``: launched from hooks; ``numel``, ``chunk_bytes``:
    unpadded, ``chunk_numels``: padded."""

    colour: Hashable
    group: tuple
    owner: int
    dtype: str
    params: tuple
    chunks: tuple
    route: Route
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
        """``(begin, end)`` of ``name``, flattened and without padding, in the shard of
        ``group_index``; ``(0, 0)`` when the shard holds none of it."""
        i = self.params.index(name)
        shard = self.shard_numel
        numel = self.param_numels[i]
        lo = min(max(0, group_index * shard - self.offsets[i]), numel)
        hi = min((group_index + 1) * shard - self.offsets[i], self.padded[i], numel)
        return (lo, hi) if hi > lo else (0, 0)

    def holds_slice(self, name: str, group_index: int) -> bool:
        """Whether the shard overlaps the parameter's padded range (FusedCommBuffer's rule)."""
        i = self.params.index(name)
        begin = group_index * self.shard_numel
        return max(self.offsets[i], begin) < min(self.offsets[i] + self.padded[i],
                                                 begin + self.shard_numel)


# -------------------------------------------------------------- placement
def chunk_by_size(nbytes: Sequence[int], limit_MB: float) -> list:
    """Item indices per chunk of consecutive items of at most ``limit_MB`` together (an item
    never splits; one chunk per item when ``limit_MB <= 0``)."""
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


def _group_by(items, key) -> dict:
    """``key(item) -> [items]`` in first-seen order of keys, items in order."""
    out: dict = {}
    for x in items:
        out.setdefault(key(x), []).append(x)
    return out


def padded_numel(numel: int, dtype: str, settings: LayoutSettings, multiple: int) -> int:
    align = max(1, settings.alignment_bytes // itemsize(dtype)) * multiple
    return (numel + align - 1) // align * align


def owner_rule_inputs(ranks: tuple, plan: HierarchicalCommPlan | None, strategy: str) -> tuple:
    """``(strategy, rank_order, positions)`` the rule runs with on group ``ranks``: ``rail``
    where no rail crosses nodes is ``balanced``; with a plan, balanced and rail prefer among
    equally loaded ranks the order alternating cards and nodes (group-local indices)."""
    rank_order = positions = None
    if strategy == PARTITION_RAIL:
        positions = rail_positions(plan, ranks)
        if positions is None:
            strategy = PARTITION_BALANCED
    if plan is not None and strategy in (PARTITION_BALANCED, PARTITION_RAIL):
        index = {r: i for i, r in enumerate(ranks)}
        rank_order = tuple(index[r] for r in plan.spread_rank_order(plan.stage_of(ranks[0])))
    return strategy, rank_order, positions


def partition_by_rule(specs: Sequence[MatrixSpec], nranks: int, rank_order: tuple | None,
                      strategy: str, buffer_MB: float, positions: tuple | None) -> OwnerPartition:
    """The owner partition (group-local indices) by :func:`owner_rule_inputs`' results;
    only develop's rule reads ``buffer_MB``."""
    order = None if rank_order is None else list(rank_order)
    if strategy == PARTITION_RAIL:
        return rail_partition(specs, positions, rank_order=order)
    if strategy == PARTITION_DEVELOP:
        return upstream_partition(specs, nranks, buffer_MB)
    if strategy == PARTITION_BALANCED:
        return balanced_partition(specs, nranks, rank_order=order)
    raise ValueError(
        f"partition_strategy={strategy!r} is not known; use one of {PARTITION_STRATEGIES}.")


def assign_muon_owners(specs: Sequence[MatrixSpec], group_ranks: Sequence[int],
                       plan: HierarchicalCommPlan | None = None,
                       partition_strategy: str = option_default("muon_partition_strategy"),
                       buffer_size_MB: float = 256):
    """Choose the owning global rank of every Muon matrix of one colour group.

    Args:
        specs: the group's Muon matrices.
        group_ranks: the colour group's global ranks, in group order.
        plan: hierarchical plan (see :func:`owner_rule_inputs`).
        partition_strategy: ``"upstream_greedy"``, ``"balanced"`` or ``"rail"``.
        buffer_size_MB: buffer size of the upstream rule.

    Returns:
        tuple[dict[str, int], OwnerPartition]: owners (global ranks), the partition (local).
    """
    ranks = tuple(int(r) for r in group_ranks)
    strategy, rank_order, positions = owner_rule_inputs(ranks, plan, partition_strategy)
    partition = partition_by_rule(specs, len(ranks), rank_order, strategy,
                                  float(buffer_size_MB), positions)
    return {name: ranks[idx] for name, idx in partition.owners.items()}, partition


def muon_bucket_specs(colour, group, params, owner_of, hierarchical, settings) -> tuple:
    """The Muon buckets of one colour group: one per (owner, dtype), in that order."""
    by_owner = _group_by(params, lambda p: (owner_of[p.name], p.dtype))
    out = []
    fused = settings.fused
    route = Route.HIERARCHICAL if hierarchical else Route.FLAT
    overlap = fused and is_hooked(settings.comm_overlap, colour)
    for (owner, dtype), bparams in sorted(by_owner.items()):  # keys are unique
        chunks = chunk_numels = chunk_bytes = ()
        nbytes = tuple(p.nbytes for p in bparams)
        if fused:
            pad = [padded_numel(p.numel, dtype, settings, 1) for p in bparams]
            parts = chunk_by_size(nbytes, settings.comm_buffer_size_MB)
            chunks = tuple(tuple(bparams[i].name for i in c) for c in parts)
            chunk_numels = tuple(sum(pad[i] for i in c) for c in parts)
            chunk_bytes = tuple(sum(nbytes[i] for i in c) for c in parts)
        numels = tuple(p.numel for p in bparams)
        out.append(MuonBucketSpec(
            colour=colour, group=group, owner=owner, dtype=dtype,
            params=tuple(p.name for p in bparams), chunks=chunks, route=route,
            overlap=overlap, numel=sum(numels), chunk_numels=chunk_numels,
            param_numels=numels, chunk_bytes=chunk_bytes, param_bytes=nbytes,
        ))
    return tuple(out)


def slice_buffer_specs(colour, group, params, settings) -> tuple:
    """The element-wise buffers of one colour group: per dtype, chunked by size when fused."""
    out = []
    for dtype, dparams in _group_by(params, lambda p: p.dtype).items():
        if settings.fused:
            chunks = chunk_by_size([p.nbytes for p in dparams], settings.comm_buffer_size_MB)
        else:
            chunks = [list(range(len(dparams)))]
        for c in chunks:
            members = [dparams[i] for i in c]
            padded = tuple(padded_numel(p.numel, dtype, settings, len(group))
                           for p in members)
            out.append(SliceBufferSpec(
                colour=colour, group=group, dtype=dtype,
                params=tuple(p.name for p in members),
                offsets=tuple(sum(padded[:i]) for i in range(len(padded))),
                padded=padded, param_numels=tuple(p.numel for p in members),
                overlap=is_hooked(settings.comm_overlap, colour),
                payload=sum(p.nbytes for p in members),
            ))
    return tuple(out)


def _fixed_owners_of(colour, group: tuple, params: Sequence[ParamMeta],
                     owners: Mapping[str, int]) -> tuple:
    """``((name, group index), ...)`` of owners chosen beforehand, checked."""
    out = []
    for p in params:
        if p.name not in owners:
            raise ValueError(
                f"fixed_owners has no entry for Muon parameter {p.name} (colour "
                f"{colour!r}); pass an owner for every keep-whole parameter, or None.")
        owner = int(owners[p.name])
        if owner not in group:
            raise ValueError(
                f"fixed_owners gives parameter {p.name} to rank {owner}, outside its colour "
                f"group {list(group)} (colour {colour!r}); an owner must be a member.")
        out.append((p.name, group.index(owner)))
    return tuple(out)


def colour_muon_layout(colour, group: tuple, params: tuple, plan, settings: LayoutSettings,
                       fixed: tuple | None = None) -> tuple:
    """``(owner_of, partition, buckets)`` of one colour group's Muon matrices; ``fixed``:
    ``((name, group index), ...)`` chosen beforehand, None: ``settings.partition_strategy``."""
    specs = tuple(MatrixSpec(p.name, p.shape, p.dtype) for p in params)
    if fixed is None:
        owner_of, partition = assign_muon_owners(
            specs, group, plan, settings.partition_strategy, settings.comm_buffer_size_MB)
    else:
        partition = partition_from_owners(specs, len(group), dict(fixed),
                                          method="machine_balanced")
        owner_of = {name: group[idx] for name, idx in fixed}
    buckets = muon_bucket_specs(colour, group, params, owner_of, plan is not None, settings)
    return owner_of, partition, buckets


def split_params(params: Sequence[ParamMeta]) -> tuple:
    """``(colours, muon, other, by_name)``: the set of colours, ``(colour, its Muon
    parameters)`` and the same of the element-wise ones in first-seen order, name -> meta."""
    by = _group_by(params, lambda p: (p.use_muon, p.colour))
    return (frozenset(c for _, c in by),
            tuple((c, tuple(ps)) for (muon, c), ps in by.items() if muon),
            tuple((c, tuple(ps)) for (muon, c), ps in by.items() if not muon),
            {p.name: p for p in params})


class Placement:
    """The functions :meth:`ShardingLayout.build` and the step plan compute with, uncached;
    the plan tool's subclass memoises them and must return what these return."""

    split_params = staticmethod(split_params)
    muon_layout = staticmethod(colour_muon_layout)
    slice_layout = staticmethod(slice_buffer_specs)
    sync_stages = staticmethod(_step_plan.plain_sync_stages)
    reduce_ops = staticmethod(_step_plan.reduce_ops)


PLAIN_PLACEMENT = Placement()


# ----------------------------------------------------------------- layout
@dataclass
class ShardingLayout:
    """Owners, buckets, element-wise ranges and the step schedule of one rank (plain data).

    Attributes:
        rank: the global rank the layout is for.
        groups: colour key -> global ranks of the colour group (group order).
        plan: the routing plan, ``HierarchicalCommPlan`` (None: flat routing everywhere).
        owners: Muon parameter name -> owning global rank.
        partitions: colour key -> OwnerPartition (load figures for tools).
        muon_buckets, slice_buffers: the buffers in issue order.
        params: name -> :class:`ParamMeta`.
        clip_groups: the groups the global-norm clip all-reduces its norm over, in issue
            order (see ``build.clip_groups``); empty: the step has no such clip.
        placement: how the layout and its step plan were computed.
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
    clip_groups: tuple = ()
    placement: Placement = field(default=PLAIN_PLACEMENT, repr=False, compare=False)
    # memos of what the fields above determine, never compared
    _stages: tuple | None = field(default=None, init=False, repr=False, compare=False)
    _phases: tuple | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def build(cls, params: Sequence[ParamMeta], groups: Mapping[Hashable, Sequence[int]],
              rank: int, settings: LayoutSettings = LayoutSettings(),
              plan: HierarchicalCommPlan | None = None,
              fixed_owners: Mapping[str, int] | None = None,
              clip_groups: Sequence[Sequence[int]] = (),
              placement: Placement = PLAIN_PLACEMENT) -> ShardingLayout:
        """Compute the layout of ``rank``.

        Args:
            params: the rank's trainable parameters in model order.
            groups: colour key -> global ranks of its group, each containing ``rank``.
            rank: this global rank; settings: placement options.
            plan: the routing plan; with it, default-colour Muon buckets route hierarchically.
            fixed_owners: Muon parameter name -> owning global rank, decided for the whole
                job (develop's machine-balanced rule); None: ``settings.partition_strategy``.
            clip_groups: the global-norm clip's all-reduce groups (see the attribute).
            placement: the functions computing the placement and step plan.

        Raises:
            ValueError: a colour without a group, a group without ``rank``, a bad ``fixed_owners``.
        """
        groups = {k: tuple(int(r) for r in v) for k, v in groups.items()}
        colours, muon_by_colour, other_by_colour, by_name = placement.split_params(params)
        for p in (() if colours <= groups.keys() else params):
            if p.colour not in groups:
                raise ValueError(
                    f"parameter {p.name} has colour {p.colour!r} but no group was "
                    f"given for it (known colours: {list(groups)}).")
        for key, ranks in groups.items():
            if rank not in ranks:
                raise ValueError(
                    f"rank {rank} is not in the group of colour {key!r} "
                    f"({list(ranks)}); every rank must hold the parameters of the "
                    "colour groups it belongs to.")
        owners: dict = {}
        partitions: dict = {}
        buckets: list = []
        for colour, cparams in muon_by_colour:
            fixed = None if fixed_owners is None else _fixed_owners_of(
                colour, groups[colour], cparams, fixed_owners)
            owner_of, partitions[colour], cbuckets = placement.muon_layout(
                colour, groups[colour], cparams, plan if colour is None else None,
                settings, fixed)
            owners.update(owner_of)
            buckets.extend(cbuckets)
        slices = [s for colour, cparams in other_by_colour
                  for s in placement.slice_layout(colour, groups[colour], cparams, settings)]
        return cls(rank=rank, groups=groups, settings=settings, plan=plan, owners=owners,
                   partitions=partitions, muon_buckets=buckets, slice_buffers=slices,
                   params=by_name, placement=placement,
                   clip_groups=tuple(tuple(int(r) for r in g) for g in clip_groups))

    def group_index(self, colour: Hashable) -> int:
        """This rank's index in the colour's group."""
        return self.groups[colour].index(self.rank)

    def slice_buffer_of(self, name: str) -> SliceBufferSpec:
        """The element-wise buffer holding parameter ``name``."""
        for buf in self.slice_buffers:
            if name in buf.params:
                return buf
        raise KeyError(f"{name} is not an element-wise (non-Muon) parameter")

    def local_range(self, name: str) -> tuple:
        """Flattened range of ``name`` this rank updates (see the optimizer's ``local_range``)."""
        if name in self.owners:
            return (0, self.params[name].numel) if self.owners[name] == self.rank else (0, 0)
        if name not in self.params:
            raise KeyError(f"{name} is not a trainable parameter of this layout")
        buf = self.slice_buffer_of(name)
        return buf.range_in_param(name, self.group_index(buf.colour))

    @property
    def staged_sync(self) -> bool:
        """Whether the step syncs stage by stage (``overlap_sync`` in effect)."""
        s = self.settings
        return s.overlap_sync and (self.plan is None or s.overlap_sync_group_call)

    def sync_stages(self) -> tuple:
        """The stages of the overlapped update (:class:`SyncStageSpec` s, develop's
        ``_build_sync_stages``), identical on every rank but ``local_params``."""
        if self._stages is None:
            self._stages = self.placement.sync_stages(self)
        return self._stages

    def step_plan(self) -> list:
        """The step as data: ordered ``StepPhase`` list (see ``build_step_plan``)."""
        if self._phases is None:
            self._phases = tuple(_step_plan.build_step_plan(self))
        return list(self._phases)

    def phases_of(self, trigger: _step_plan.Trigger | _step_plan.SyncTrigger) -> list:
        """The phases of one trigger, in step-plan order."""
        return [ph for ph in self.step_plan() if ph.trigger == trigger]

    def schedule(self) -> list:
        """Ordered collectives (``CommOp``) this rank issues in one step, hook-launched ones in
        model order (really in backward's); none on one-rank groups (the result is in place)."""
        return [op for ph in self.step_plan() for op in ph.ops if len(op.group) > 1]
