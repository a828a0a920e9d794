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

* the owner of every Muon matrix (``muon_sharding_placement``),
* the Muon buckets per (colour, owner, dtype) and their fused chunks,
* the element-wise buffers of the other parameters and each rank's range,
* the route of every bucket (flat or hierarchical, launched from the
  backward hooks or from ``reduce_gradients``),
* the ordered collectives of one training step.

Nothing here needs a process group or a Paddle tensor, so the optimizer, the
``plan`` tool (``tools/plan``), ``verify`` and the benchmarks all read the same object: the
optimizer allocates buffers and groups from it and nothing else.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Hashable, Mapping, Sequence

from . import step_plan as _step_plan
from .placement import (
    LayoutSettings,
    MuonBucketSpec,
    ParamMeta,
    SliceBufferSpec,
    colour_muon_layout,
    colour_slice_layout,
    fixed_owners as _fixed_owners_of,
)
from .step_plan import CommOp, StepPhase
from .types import ROUTE_HIERARCHICAL, HashedTuple

if TYPE_CHECKING:
    from .comm_plan import HierarchicalCommPlan

__all__ = ["ParamMeta", "LayoutSettings", "ShardingLayout"]


# The last parameter list's split by colour (see _split_params).
_last_split: list = [(), None]


def _split_params(params: Sequence[ParamMeta]) -> tuple:
    """``(colours, muon, other, by_name)`` of ``params``: the set of colours,
    ``(colour, HashedTuple of its Muon parameters)`` and the same of the
    element-wise ones in first-seen order, and name -> meta.

    The tools build a layout per path and class of rank from one list of
    100,000 parameters (20 paths under ``plan --recommend``): the last
    list's split is reused when it holds the same (frozen) metas in the
    same order, and its tuples hash once in the placement caches.
    """
    last, split = _last_split
    if split is not None and len(last) == len(params) and all(map(operator.is_, last, params)):
        return split
    muon_by_colour: dict = OrderedDict()
    other_by_colour: dict = OrderedDict()
    frozen = True
    for p in params:
        frozen = frozen and type(p) is ParamMeta
        target = muon_by_colour if p.use_muon else other_by_colour
        target.setdefault(p.colour, []).append(p)
    split = (frozenset(muon_by_colour) | frozenset(other_by_colour),
             tuple((c, HashedTuple(ps)) for c, ps in muon_by_colour.items()),
             tuple((c, HashedTuple(ps)) for c, ps in other_by_colour.items()),
             {p.name: p for p in params})
    if frozen:  # only frozen metas cannot change behind the cache
        _last_split[:] = [tuple(params), split]
    return split


@dataclass
class ShardingLayout:
    """Owners, buckets, element-wise ranges and the step schedule of one rank.

    Build with :meth:`build`; all fields are plain data.

    Attributes:
        rank: the global rank the layout is for.
        groups: colour key -> global ranks of the colour group (group order).
        settings: the :class:`LayoutSettings`.
        plan: the hierarchical routing plan, ``muon_comm_plan`` (None: flat routing everywhere).
        owners: Muon parameter name -> owning global rank.
        partitions: colour key -> OwnerPartition (load figures for tools).
        muon_buckets: :class:`MuonBucketSpec` in issue order.
        slice_buffers: :class:`SliceBufferSpec` in issue order.
        params: name -> :class:`ParamMeta`.
        clip_groups: global ranks of each group the global-norm clip
            all-reduces its norm over, in issue order (Paddle's
            ``HybridParallelClipGrad``: the sharding group twice, then the
            pipe group); empty: the step has no such clip.
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

    @classmethod
    def build(
        cls,
        params: Sequence[ParamMeta],
        groups: Mapping[Hashable, Sequence[int]],
        rank: int,
        settings: LayoutSettings = LayoutSettings(),
        plan: HierarchicalCommPlan | None = None,
        fixed_owners: Mapping[str, int] | None = None,
        clip_groups: Sequence[Sequence[int]] = (),
    ) -> ShardingLayout:
        """Compute the layout of ``rank``.

        Args:
            params: the rank's trainable parameters in model order.
            groups: colour key -> global ranks of its group; every colour
                used by ``params`` needs an entry containing ``rank``.
            rank: this global rank.
            settings: placement options.
            plan: the routing plan; with it, default-colour (``None``) Muon buckets route
                hierarchically.
            fixed_owners: Muon parameter name -> owning global rank, decided
                beforehand for the whole job (develop's machine-balanced
                rule); None: ``settings.partition_strategy`` per colour group.
            clip_groups: the global-norm clip's all-reduce groups (see the
                attribute); the default: no clip collective in the step.

        Returns:
            ShardingLayout: the layout.

        Raises:
            ValueError: a colour without a group, a group without ``rank``, or
                ``fixed_owners`` lacking a Muon parameter or naming a rank outside
                its colour group.
        """
        groups = {k: tuple(int(r) for r in v) for k, v in groups.items()}
        colours, muon_by_colour, other_by_colour, by_name = _split_params(params)
        for p in (() if colours <= groups.keys() else params):
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

        owners: dict = {}
        partitions: dict = {}
        buckets: list = []
        for colour, cparams in muon_by_colour:
            hier_plan = plan if colour is None else None
            fixed = None if fixed_owners is None else _fixed_owners_of(
                colour, groups[colour], cparams, fixed_owners)
            owner_of, partition, cbuckets = colour_muon_layout(
                colour, groups[colour], cparams, hier_plan, settings, fixed)
            owners.update(owner_of)
            partitions[colour] = partition
            buckets.extend(cbuckets)
        slices: list = []
        for colour, cparams in other_by_colour:
            slices.extend(colour_slice_layout(colour, groups[colour], cparams, settings))
        return cls(rank=rank, groups=groups, settings=settings, plan=plan, owners=owners,
                   partitions=partitions, muon_buckets=buckets, slice_buffers=slices,
                   params=by_name,
                   clip_groups=tuple(tuple(int(r) for r in g) for g in clip_groups))

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
        """The stages of the overlapped update (see ``muon_sharding_step_plan``)."""
        return _step_plan.sync_stages(self)

    # ----------------------------------------------------------- schedule
    def comm_groups(self) -> list:
        """Global ranks of every group this rank's schedule uses."""
        groups = list(self.groups.values())
        if self.plan is not None and any(b.route == ROUTE_HIERARCHICAL
                                         for b in self.muon_buckets):
            groups.extend(self._hier_groups())
        return groups

    def _hier_groups(self) -> tuple:
        return _step_plan.hier_groups(self)

    def step_plan(self) -> list:
        """The step as data: ordered :class:`StepPhase` list (see ``build_step_plan``)."""
        return _step_plan.build_step_plan(self)

    def phases_of(self, trigger: str) -> list:
        """The phases of one trigger, in step-plan order."""
        # read every step by the executors: filter the cached step plan once per trigger
        cache = self.__dict__.setdefault("_phases_of_cache", {})
        if trigger not in cache:
            cache[trigger] = tuple(ph for ph in self.step_plan() if ph.trigger == trigger)
        return list(cache[trigger])

    def schedule(self) -> list:
        """Ordered collectives this rank issues in one step (the step plan's ops).

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
