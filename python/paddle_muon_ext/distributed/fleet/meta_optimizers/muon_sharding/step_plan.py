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
"""The step plan of a :class:`ShardingLayout`: its phases, collectives and sync stages,
derived alike on every rank from replicated metadata; the route, trigger, phase and op
names live here."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, Sequence

from .settings import DEVELOP_DEFAULT_BUFFER_MB, itemsize


# -------------------------------------------------------- step-plan names
class _Name(str, enum.Enum):
    """A name that prints and serialises as its value."""

    def __str__(self) -> str:
        return self.value


class Route(_Name):
    """Which group(s) a bucket's collectives (``MuonBucketSpec.route``: FLAT or
    HIERARCHICAL) or a phase's (``StepPhase.route``: the others, or FLAT) run on."""

    FLAT = "flat"
    HIERARCHICAL = "hierarchical"
    INTRA_NODE = "intra_node"
    CROSS_NODE = "cross_node"
    SLICES = "slices"
    #: The global-norm clip's all-reduces: each item names its own group.
    CLIP = "clip_groups"
    #: A phase that issues no collective (waits, update, found_inf, ...).
    LOCAL = "local"


class Trigger(_Name):
    """When an op is issued: from a backward hook (overlap), by reduce_gradients, by step."""

    BACKWARD = "backward"
    REDUCE = "reduce_gradients"
    STEP = "step"


@dataclass(frozen=True)
class SyncTrigger:
    """The sync of update stage ``stage`` (run by ``step``); ``sync[k]`` as text."""

    stage: int

    def __str__(self) -> str:
        return f"sync[{self.stage}]"


PHASE_REDUCE_SCATTER = "reduce_scatter"
PHASE_ALL_GATHER = "all_gather_slices"
PHASE_INTRA_NODE_REDUCE = "intra_node_reduce"
PHASE_CROSS_NODE_REDUCE = "cross_node_reduce"
PHASE_CROSS_NODE_BROADCAST = "cross_node_broadcast"
PHASE_INTRA_NODE_BROADCAST = "intra_node_broadcast"
#: The global-norm clip (its norm all-reduces over the sharding / pipe groups).
PHASE_CLIP = "clip_global_norm"
#: The update's label (profiler, flight recorder): ``optimizer_step[k]`` per stage.
PHASE_UPDATE = "optimizer_step"


class Op(_Name):
    """What a phase does (StepPhase.op): the collectives, then the local kinds; the
    runtime runs a phase with its method ``_<value>``."""

    REDUCE_SCATTER = "reduce_scatter"
    REDUCE = "reduce"
    BROADCAST = "broadcast"
    ALL_GATHER = "all_gather"
    ALL_REDUCE = "all_reduce"
    #: reduce_gradients: copy released 1-D gradients back into their buffers.
    COPY_GRADS_IN = "copy_grads_in"
    #: reduce_gradients: wait for and scale what the backward hooks launched.
    WAIT_HOOKED = "wait_hooked"
    #: step: give colours freed by clear_param_storage their storage back.
    RESET_STORAGE = "reset_storage"
    #: step: link slice gradients and collect this rank's (param, grad) pairs.
    COLLECT_GRADS = "collect_grads"
    #: step: skip the update when AMP found inf/nan.
    FOUND_INF = "found_inf"
    #: step: the global-norm clip (collective: its all-reduces; an alias of ALL_REDUCE).
    CLIP = "all_reduce"
    #: step: the whole update (plain) / Muon's prepare_optimize (staged).
    UPDATE = "update"
    PREPARE = "prepare"
    #: step: stage k's update (staged sync), before stage k's sync phases.
    STAGE_UPDATE = "stage_update"
    #: step: wait for every launched stage sync (staged) / unpack received buffers.
    FINISH_SYNC = "finish_sync"
    #: step: move fresh optimizer states into the fused buffers.
    FUSE_STATES = "fuse_states"


COLLECTIVE_OPS = (Op.REDUCE_SCATTER, Op.REDUCE, Op.BROADCAST, Op.ALL_GATHER, Op.ALL_REDUCE)


#: A ``layout.ShardingLayout`` (layout.py imports this module, so not imported back).
ShardingLayout = Any

#: What the global-norm clip all-reduces: one float32 squared norm per call.
CLIP_NORM_DTYPE = "float32"


# ------------------------------------------------------------- sync stages
def stage_element_limit(comm_buffer_size_MB: float) -> int:
    """Elements after which adjacent Muon groups close a stage: develop's one MB of fp32
    (``2**18``) per ``comm_buffer_size_MB``, its default size when that is <= 0."""
    mb = comm_buffer_size_MB if comm_buffer_size_MB > 0 else DEVELOP_DEFAULT_BUFFER_MB
    return int(mb * 2**18)


def _numel(param) -> int:
    numel = getattr(param, "numel", None)
    if type(numel) is int:  # the layout's ParamMeta: counted once at construction
        return numel
    return math.prod(int(d) for d in param.shape)


def stage_runs(key_numels: Sequence[int], limit: int) -> list:
    """Keys per stage (the one home of the rule): adjacent Muon groups' elements
    ``key_numels`` form a run until they reach ``limit``; the last run holds the rest."""
    runs, run, size = [], 0, 0
    for n in key_numels:
        run += 1
        size += n
        if size >= limit:
            runs.append(run)
            run, size = 0, 0
    if run:
        runs.append(run)
    return runs


def build_sync_stages(
    params_2d_by_color: Mapping,
    rank2params_by_color: Mapping,
    group_info: Mapping,
    group_key: Callable[[Any], Any],
    limit: int,
) -> list:
    """Develop's 2-D sync stages, per colour (the 1-D ones follow, one per buffer).

    Args:
        params_2d_by_color: colour -> Muon params (develop's owner-sorted order).
        rank2params_by_color: colour -> {group rank -> params it owns}.
        group_info: colour -> ``{'group', 'world_size', 'rank'}``.
        group_key: the inner optimizer's ``muon_group_key``.
        limit: elements after which adjacent keys close a stage.

    Returns:
        list[dict]: ``{'kind': '2d', 'color', 'group', 'world_size', 'rank2params', 'keys',
        'local_params'}``; a key spanning colours is updated once, in its first stage.
    """
    stages: list = []
    local_by_key: dict = OrderedDict()
    for colour, params in params_2d_by_color.items():
        info = group_info[colour]
        world_size = info["world_size"]
        rank2params = rank2params_by_color[colour]
        me = info["rank"] if world_size > 1 else 0
        local_ids = {id(p) for p in rank2params.get(me, ())}
        by_key: dict = OrderedDict()
        for p in params:
            by_key.setdefault(group_key(p), []).append(p)
        for key, members in by_key.items():
            local_by_key.setdefault(key, []).extend(p for p in members if id(p) in local_ids)
        keys_in_order, start = list(by_key), 0
        for n in stage_runs([sum(map(_numel, members)) for members in by_key.values()], limit):
            keys = keys_in_order[start:start + n]
            start += n
            wanted = {id(p) for k in keys for p in by_key[k]}
            picked = ((r, [p for p in ps if id(p) in wanted]) for r, ps in rank2params.items())
            owned = OrderedDict((r, ps) for r, ps in picked if ps)
            if owned:
                stages.append({"kind": "2d", "color": colour, "group": info["group"],
                               "world_size": world_size, "rank2params": owned,
                               "keys": keys, "local_params": []})
    for stage in stages:
        for key in stage["keys"]:
            stage["local_params"].extend(local_by_key.pop(key, ()))
    return stages


# --------------------------------------------------------- item references
@dataclass(frozen=True, order=True)
class _IndexRef:
    index: int


class MuonRef(_IndexRef):
    """An item on ``layout.muon_buckets[index]``."""


class SliceRef(_IndexRef):
    """An item on ``layout.slice_buffers[index]``."""


class ClipRef(_IndexRef):
    """An item on ``layout.clip_groups[index]``."""


@dataclass(frozen=True, order=True)
class StageRef:
    """Sync stage ``stage``: its update (``owner`` None) or its ``owner``-th owner buffer."""

    stage: int
    owner: int | None = None


def flat_reduce_phase(group: tuple) -> str:
    """Phase label of a flat reduce onto owners in ``group``."""
    return f"reduce_to_owner[{list(group)}]"


def flat_broadcast_phase(group: tuple) -> str:
    """Phase label of a flat broadcast from owners in ``group``."""
    return f"broadcast_from_owner[{list(group)}]"


@dataclass(frozen=True)
class SyncStageSpec:
    """One stage of the overlapped update: update these parameters, then sync them.

    Attributes:
        kind: ``"2d"`` (owners broadcast whole matrices) or ``"1d"`` (all-gather of
            the element-wise buffer ``ShardingLayout.slice_buffers[buffer_index]``).
        colour, group: the colour key and its group's global ranks.
        keys, owners (2d): its Muon group keys; ``(owner global rank, dtype, parameter
            names, numel)`` per broadcast buffer, in launch order.
        local_params: names this rank updates in the stage.
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
    """One phase of the step plan: a collective pattern on one group, or a local step.

    Attributes:
        trigger: a :class:`Trigger`, or the :class:`SyncTrigger` of update stage k.
        label: the phase name (profiler, flight recorder, recorder comparison).
        op, route: what it does (the executors dispatch on it); which group(s) it runs on.
        group: global ranks of the group (empty for ``slices`` / ``clip_groups`` / ``local``).
        items: ``(ref, root global rank)``, a ref being a ``MuonRef``, ``SliceRef``,
            ``StageRef`` or ``ClipRef``; ops: this rank's collectives (:func:`make_phase`).
    """

    trigger: Trigger | SyncTrigger
    label: str
    op: Op
    route: Route
    group: tuple
    items: tuple
    ops: tuple


@dataclass(frozen=True)
class CommOp:
    """One collective a rank issues in one step: ``numel`` is what the rank contributes
    (the shard for reduce_scatter and all_gather); ``coalesced`` ops of one phase and group
    form one launch; ``payload``: unpadded parameter bytes of the whole buffer (cost models).
    """

    trigger: Trigger
    phase: str
    op: Op
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


def reduce_ops(template: CommOp, parts) -> list:
    """``template`` with each ``(numel, payload)`` of ``parts``: one reduce per chunk."""
    return [dataclasses.replace(template, numel=numel, payload=payload)
            for numel, payload in parts]


def stage_group_key(m) -> Hashable:
    """The Muon group key of a :class:`ParamMeta` (``(None, shape)`` without one)."""
    return m.group_key if m.group_key is not None else (None, m.shape)


def stage_inputs(layout: ShardingLayout) -> tuple:
    """``(params by colour, rank2params, group info)`` of :func:`build_sync_stages`: Muon
    metas of each colour sorted stably by owner index; ``rank2params`` holds owners only,
    in group order (a rank owning nothing has no stage entry)."""
    by_colour: dict = OrderedDict()
    owners = layout.owners
    for meta in layout.params.values():
        if meta.name in owners:
            by_colour.setdefault(meta.colour, []).append(meta)
    sorted_by_colour, rank2params, info = OrderedDict(), OrderedDict(), OrderedDict()
    for colour, metas in by_colour.items():
        ranks = layout.groups[colour]
        index = {r: i for i, r in enumerate(ranks)}
        by_rank: dict = {}
        for m in metas:
            by_rank.setdefault(index[owners[m.name]], []).append(m)
        rank2params[colour] = OrderedDict(sorted(by_rank.items()))
        sorted_by_colour[colour] = [m for ms in rank2params[colour].values() for m in ms]
        info[colour] = {"group": ranks, "world_size": len(ranks),
                        "rank": index[layout.rank] if len(ranks) > 1 else -1}
    return sorted_by_colour, rank2params, info


def plain_sync_stages(layout: ShardingLayout, inputs: tuple | None = None) -> tuple:
    """:func:`build_sync_stages` on ``inputs`` (default :func:`stage_inputs`) as
    :class:`SyncStageSpec` s."""
    sorted_by_colour, rank2params, info = inputs or stage_inputs(layout)
    limit = stage_element_limit(layout.settings.comm_buffer_size_MB)
    stages = []
    for stage in build_sync_stages(sorted_by_colour, rank2params, info, stage_group_key, limit):
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
    stages += [SyncStageSpec("1d", b.colour, b.group, local_params=tuple(b.params),
                             buffer_index=i) for i, b in enumerate(layout.slice_buffers)]
    return tuple(stages)


def make_phase(layout: ShardingLayout, trigger: Trigger | SyncTrigger, label: str, op: Op,
               route: Route, group: tuple = (), items: tuple = ()) -> StepPhase:
    """A :class:`StepPhase` with the collectives this rank issues for it, derived from
    its items only (the one place they are), so ``schedule`` lists what executors run."""
    group, items = tuple(group), tuple(items)
    # the sync of stage k is part of step; hooks and reduce_gradients name themselves
    op_trigger = Trigger.STEP if isinstance(trigger, SyncTrigger) else trigger
    coalesced = op in (Op.REDUCE, Op.BROADCAST) and trigger != Trigger.BACKWARD
    ops: list = []
    for ref, root in items:
        if isinstance(ref, SliceRef):
            buf = layout.slice_buffers[ref.index]
            ops.append(CommOp(op_trigger, label, op, buf.group, None, buf.dtype,
                              buf.shard_numel, buf.colour, False, buf.payload))
        elif isinstance(ref, ClipRef):
            ops.append(CommOp(op_trigger, label, op, layout.clip_groups[ref.index], None,
                              CLIP_NORM_DTYPE, 1, None, False, itemsize(CLIP_NORM_DTYPE)))
        elif isinstance(ref, StageRef):
            stage = layout.sync_stages()[ref.stage]
            _, dtype, _, numel = stage.owners[ref.owner]
            ops.append(CommOp(op_trigger, label, op, group, root, dtype, numel, stage.colour,
                              coalesced, numel * itemsize(dtype)))
        else:  # a MuonRef: one reduce per chunk (or matrix), else one op on the bucket
            b = layout.muon_buckets[ref.index]
            one = CommOp(op_trigger, label, op, group, root, b.dtype, b.numel, b.colour,
                         coalesced, b.numel * itemsize(b.dtype))
            ops.extend(layout.placement.reduce_ops(one, b.reduce_parts())
                       if op == Op.REDUCE else (one,))
    return StepPhase(trigger, label, op, route, group, items, tuple(ops))


def local_phase(trigger: Trigger, op: Op, label: str | None = None,
                items: tuple = ()) -> StepPhase:
    """A phase that issues no collective (a wait, the update, found_inf, ...)."""
    return StepPhase(trigger, label or op.value, op, Route.LOCAL, (), tuple(items), ())


def hier_broadcast_phases(layout: ShardingLayout, trigger: Trigger | SyncTrigger,
                          entries: list) -> list:
    """The hierarchical sync of ``(ref, owner)`` entries: cross-node, then intra-node."""
    plan, rank = layout.plan, layout.rank
    node, same_card = hier_groups(layout)
    return [
        make_phase(layout, trigger, PHASE_CROSS_NODE_BROADCAST, Op.BROADCAST, Route.CROSS_NODE,
                   same_card, tuple((ref, owner) for ref, owner in entries
                                    if plan.in_cross_node_step(owner, rank))),
        make_phase(layout, trigger, PHASE_INTRA_NODE_BROADCAST, Op.BROADCAST, Route.INTRA_NODE,
                   node, tuple((ref, plan.intra_node_root(owner, rank))
                               for ref, owner in entries)),
    ]


def staged_sync_phases(layout: ShardingLayout) -> list:
    """Stage k's update (item ``StageRef(k)``), then stage k's sync phases (items
    ``StageRef(k, j)``, its j-th owner buffer), for every stage."""
    phases: list = []
    for k, stage in enumerate(layout.sync_stages()):
        phases.append(local_phase(Trigger.STEP, Op.STAGE_UPDATE, f"{PHASE_UPDATE}[{k}]",
                                  ((StageRef(k), None),)))
        trigger = SyncTrigger(k)
        if stage.kind == "1d":
            buf = layout.slice_buffers[stage.buffer_index]
            phases.append(make_phase(layout, trigger, PHASE_ALL_GATHER, Op.ALL_GATHER,
                                     Route.SLICES, buf.group,
                                     ((SliceRef(stage.buffer_index), None),)))
            continue
        entries = [(StageRef(k, j), o[0]) for j, o in enumerate(stage.owners)]
        if layout.plan is not None and stage.colour is None:
            phases.extend(hier_broadcast_phases(layout, trigger, entries))
        else:
            phases.append(make_phase(layout, trigger, flat_broadcast_phase(stage.group),
                                     Op.BROADCAST, Route.FLAT, stage.group, entries))
    return phases


def hier_groups(layout: ShardingLayout) -> tuple:
    plan, rank = layout.plan, layout.rank
    node = plan.node_ranks(plan.node_of(rank))
    same_card = plan.same_card_ranks(plan.stage_of(rank), plan.card_of(rank))
    return node, same_card


def flat_phases(layout: ShardingLayout, trigger: Trigger, op: Op, label: Callable,
                buckets: list) -> list:
    """One flat ``op`` phase per group of the ``(index, bucket)`` pairs, groups as seen."""
    by_group: dict = OrderedDict()
    for i, b in buckets:
        by_group.setdefault(b.group, []).append((MuonRef(i), b.owner))
    return [make_phase(layout, trigger, label(group), op, Route.FLAT, group, items)
            for group, items in by_group.items()]


def build_step_plan(layout: ShardingLayout) -> list:
    """The step as data: every :class:`StepPhase` of a step, in the order the optimizer
    runs them: the backward hooks' (model order of their buffers), ``reduce_gradients``'
    and ``step``'s (with the ``sync[k]`` ones when staged)."""
    rank, plan = layout.rank, layout.plan
    muon = list(enumerate(layout.muon_buckets))
    hier = [(i, b) for i, b in muon if b.route == Route.HIERARCHICAL]
    flat = [(i, b) for i, b in muon if b.route == Route.FLAT]
    node, same_card = hier_groups(layout) if hier else (None, None)
    phases: list = []

    # backward: hooks launch each hooked buffer's first hop, one phase per buffer
    hooked_rs = [i for i, s in enumerate(layout.slice_buffers)
                 if s.overlap and len(s.group) > 1]
    for i in hooked_rs:
        phases.append(make_phase(layout, Trigger.BACKWARD, PHASE_REDUCE_SCATTER,
                                 Op.REDUCE_SCATTER, Route.SLICES,
                                 layout.slice_buffers[i].group, ((SliceRef(i), None),)))
    hooked = set(hooked_rs)
    hooked_muon = [i for i, b in muon if b.overlap]
    for i in hooked_muon:
        b = layout.muon_buckets[i]
        if b.route == Route.HIERARCHICAL:
            label, route, group = PHASE_INTRA_NODE_REDUCE, Route.INTRA_NODE, node
            root = plan.intra_node_root(b.owner, rank)
        else:
            label, route, group, root = flat_reduce_phase(b.group), Route.FLAT, b.group, b.owner
        phases.append(make_phase(layout, Trigger.BACKWARD, label, Op.REDUCE, route, group,
                                 ((MuonRef(i), root),)))
    # reduce_gradients: gradients in, wait for the hooks, what they did not launch, hop 2
    phases.append(local_phase(Trigger.REDUCE, Op.COPY_GRADS_IN))
    phases.append(local_phase(
        Trigger.REDUCE, Op.WAIT_HOOKED, PHASE_REDUCE_SCATTER,
        tuple((MuonRef(i), None) for i in hooked_muon)
        + tuple((SliceRef(i), None) for i in hooked_rs)))
    phases.append(make_phase(
        layout, Trigger.REDUCE, PHASE_REDUCE_SCATTER, Op.REDUCE_SCATTER, Route.SLICES, (),
        tuple((SliceRef(i), None) for i in range(len(layout.slice_buffers))
              if i not in hooked)))
    intra = [(i, b) for i, b in hier if not b.overlap]
    if intra:
        phases.append(make_phase(
            layout, Trigger.REDUCE, PHASE_INTRA_NODE_REDUCE, Op.REDUCE, Route.INTRA_NODE, node,
            tuple((MuonRef(i), plan.intra_node_root(b.owner, rank)) for i, b in intra)))
    if hier:
        phases.append(make_phase(
            layout, Trigger.REDUCE, PHASE_CROSS_NODE_REDUCE, Op.REDUCE, Route.CROSS_NODE,
            same_card, tuple((MuonRef(i), b.owner) for i, b in hier
                             if plan.in_cross_node_step(b.owner, rank))))
    phases += flat_phases(layout, Trigger.REDUCE, Op.REDUCE, flat_reduce_phase,
                          [(i, b) for i, b in flat if not b.overlap])
    # step: storage, gradients, found_inf, clip, update (+ staged syncs), sync
    for op in (Op.RESET_STORAGE, Op.COLLECT_GRADS, Op.FOUND_INF):
        phases.append(local_phase(Trigger.STEP, op))
    phases.append(make_phase(layout, Trigger.STEP, PHASE_CLIP, Op.CLIP, Route.CLIP, (),
                             tuple((ClipRef(i), None) for i in range(len(layout.clip_groups)))))
    if layout.staged_sync:
        phases.append(local_phase(Trigger.STEP, Op.PREPARE, PHASE_UPDATE))
        phases += staged_sync_phases(layout)
        phases.append(local_phase(Trigger.STEP, Op.FINISH_SYNC))
        phases.append(local_phase(Trigger.STEP, Op.FUSE_STATES))
    else:
        phases.append(local_phase(Trigger.STEP, Op.UPDATE, PHASE_UPDATE))
        phases.append(local_phase(Trigger.STEP, Op.FUSE_STATES))
        # the parameter sync, the reduce's mirror
        if hier:
            phases += hier_broadcast_phases(
                layout, Trigger.STEP, [(MuonRef(i), b.owner) for i, b in hier])
        phases += flat_phases(layout, Trigger.STEP, Op.BROADCAST, flat_broadcast_phase, flat)
        phases.append(make_phase(
            layout, Trigger.STEP, PHASE_ALL_GATHER, Op.ALL_GATHER, Route.SLICES, (),
            tuple((SliceRef(i), None) for i in range(len(layout.slice_buffers)))))
        phases.append(local_phase(Trigger.STEP, Op.FINISH_SYNC))
    return phases
