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
"""The step plan of a :class:`ShardingLayout`: its phases, collectives and sync stages.

Split from ``muon_sharding_layout`` so placement and scheduling read
separately; the route / trigger / phase names live in ``muon_sharding_types``.
Each function takes the layout and derives the same sequence on every rank
from replicated metadata; results are cached in the layout's ``__dict__`` (not dataclass fields, so equality and
``to_dict`` ignore them).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable

from .muon_sharding_stages import build_sync_stages, stage_element_limit
from .muon_sharding_types import (
    PHASE_ALL_GATHER,
    PHASE_CROSS_NODE_BROADCAST,
    PHASE_CROSS_NODE_REDUCE,
    PHASE_INTRA_NODE_BROADCAST,
    PHASE_INTRA_NODE_REDUCE,
    PHASE_REDUCE_SCATTER,
    ROUTE_CROSS_NODE,
    ROUTE_FLAT,
    ROUTE_HIERARCHICAL,
    ROUTE_INTRA_NODE,
    ROUTE_SLICES,
    TRIGGER_BACKWARD,
    TRIGGER_REDUCE,
    TRIGGER_STEP,
    TRIGGER_SYNC,
    itemsize,
)

if TYPE_CHECKING:
    from .muon_sharding_layout import ShardingLayout

__all__ = [
    "SyncStageSpec",
    "StepPhase",
    "CommOp",
    "flat_reduce_phase",
    "flat_broadcast_phase",
    "build_step_plan",
    "sync_stages",
]


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


def sync_stages(layout: ShardingLayout) -> tuple:
    """The stages of the overlapped update, identical on every rank but ``local_params``.

    Returns:
        tuple[SyncStageSpec]: 2d stages per colour, then one 1d stage per
        element-wise buffer (develop's ``_build_sync_stages``).
    """
    cached = layout.__dict__.get("_sync_stage_cache")
    if cached is not None:
        return cached
    by_colour: dict = OrderedDict()
    for meta in layout.params.values():
        if meta.name in layout.owners:
            by_colour.setdefault(meta.colour, []).append(meta)
    sorted_by_colour, rank2params, info = OrderedDict(), OrderedDict(), OrderedDict()
    for colour, metas in by_colour.items():
        ranks = layout.groups[colour]
        index = _group_index(tuple(ranks))
        # owners only, in group order: a rank owning nothing has no stage
        # entry, and a per-rank table would cost O(group) on every rank
        by_rank: dict = {}
        for m in metas:
            by_rank.setdefault(index[layout.owners[m.name]], []).append(m)
        rank2params[colour] = OrderedDict(sorted(by_rank.items()))
        sorted_by_colour[colour] = sorted(metas, key=lambda m: index[layout.owners[m.name]])
        info[colour] = {"group": ranks, "world_size": len(ranks),
                        "rank": index[layout.rank] if len(ranks) > 1 else -1}
    raw = build_sync_stages(
        sorted_by_colour, rank2params, info, layout.slice_buffers,
        lambda buf: buf.params,
        lambda m: m.group_key if m.group_key is not None else (None, m.shape),
        stage_element_limit(layout.settings.comm_buffer_size_MB),
    )
    stages = []
    for stage in raw:
        if stage["kind"] == "1d":
            index = layout.slice_buffers.index(stage["buffer"])
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
    layout.__dict__["_sync_stage_cache"] = tuple(stages)
    return layout.__dict__["_sync_stage_cache"]


def staged_sync_phases(layout: ShardingLayout) -> list:
    """The sync phases of the overlapped update: stage k's, after stage k's update.

    Items of a 2-D stage are ``("stage", k, j)`` (its j-th owner buffer).
    """
    phases: list = []
    plan, rank = layout.plan, layout.rank
    for k, stage in enumerate(sync_stages(layout)):
        trigger = f"{TRIGGER_SYNC}[{k}]"
        if stage.kind == "1d":
            buf = layout.slice_buffers[stage.buffer_index]
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
            node, same_card = hier_groups(layout)
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


def hier_groups(layout: ShardingLayout) -> tuple:
    plan, rank = layout.plan, layout.rank
    node = plan.node_ranks(plan.node_of(rank))
    same_card = plan.same_card_ranks(plan.stage_of(rank), plan.card_of(rank))
    return node, same_card


def flat_groups(buckets) -> list:
    order: dict = OrderedDict()
    for b in buckets:
        order.setdefault(b.group, []).append(b)
    return list(order.items())


def build_step_plan(layout: ShardingLayout) -> list:
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
    cached = layout.__dict__.get("_step_plan_cache")
    if cached is not None:
        return list(cached)
    rank, plan = layout.rank, layout.plan
    phases: list = []
    index = {id(b): i for i, b in enumerate(layout.muon_buckets)}
    hier = [b for b in layout.muon_buckets if b.route == ROUTE_HIERARCHICAL]
    flat = [b for b in layout.muon_buckets if b.route == ROUTE_FLAT]
    node = same_card = None
    if hier:
        node, same_card = hier_groups(layout)

    def reduce_ops(trigger, label, group, b, root, coalesced):
        return tuple(CommOp(trigger, label, "reduce", group, root, b.dtype, n, b.colour,
                            coalesced, payload) for n, payload in b.reduce_parts())

    def rs_op(trigger, buf):
        return CommOp(trigger, PHASE_REDUCE_SCATTER, "reduce_scatter", buf.group, None,
                      buf.dtype, buf.shard_numel, buf.colour, False, buf.payload)

    # backward: hooks launch each hooked buffer's first hop, one op per buffer
    hooked_rs = [i for i, s in enumerate(layout.slice_buffers)
                 if s.overlap and len(s.group) > 1]
    for i in hooked_rs:
        buf = layout.slice_buffers[i]
        phases.append(StepPhase(TRIGGER_BACKWARD, PHASE_REDUCE_SCATTER, "reduce_scatter",
                                ROUTE_SLICES, buf.group, ((("slice", i), None),),
                                (rs_op(TRIGGER_BACKWARD, buf),)))
    for b in layout.muon_buckets:
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
        tuple((("slice", i), None) for i in range(len(layout.slice_buffers))),
        tuple(rs_op(TRIGGER_REDUCE, buf) for i, buf in enumerate(layout.slice_buffers)
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
    for group, buckets in flat_groups([b for b in flat if not b.overlap]):
        label = flat_reduce_phase(group)
        phases.append(StepPhase(
            TRIGGER_REDUCE, label, "reduce", ROUTE_FLAT, group,
            tuple((("muon", index[id(b)]), b.owner) for b in buckets),
            tuple(op for b in buckets
                  for op in reduce_ops(TRIGGER_REDUCE, label, group, b, b.owner, True))))
    if layout.staged_sync:
        phases.extend(staged_sync_phases(layout))
    else:
        phases.extend(sync_phases(layout, hier, flat, node, same_card, index))
    layout.__dict__["_step_plan_cache"] = tuple(phases)
    return list(phases)


def sync_phases(layout: ShardingLayout, hier, flat, node, same_card, index) -> list:
    """step: the parameter sync, the reduce's mirror."""
    rank, plan = layout.rank, layout.plan
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
    for group, buckets in flat_groups(flat):
        label = flat_broadcast_phase(group)
        phases.append(StepPhase(
            TRIGGER_STEP, label, "broadcast", ROUTE_FLAT, group,
            tuple((("muon", index[id(b)]), b.owner) for b in buckets),
            tuple(bcast(b, label, group, b.owner) for b in buckets)))
    phases.append(StepPhase(
        TRIGGER_STEP, PHASE_ALL_GATHER, "all_gather", ROUTE_SLICES, (),
        tuple((("slice", i), None) for i in range(len(layout.slice_buffers))),
        tuple(CommOp(TRIGGER_STEP, PHASE_ALL_GATHER, "all_gather", buf.group, None,
                     buf.dtype, buf.shard_numel, buf.colour, False, buf.payload)
              for buf in layout.slice_buffers)))
    return phases
