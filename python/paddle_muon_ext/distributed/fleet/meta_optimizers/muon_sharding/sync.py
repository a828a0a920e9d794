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
"""The parameter sync of MuonShardingOptimizer: the step plan's sync phases, executed.

Plain functions of the optimizer (``opt``), bound as its methods
``_build_sync_stages``, ``_launch_stage_sync``, ``_broadcast_2d_params``,
``reorder_params`` ... (``_DevelopMethodSurface``). Every broadcast and all-gather comes from a
phase of ``ShardingLayout.step_plan()`` (trigger ``step``, or ``sync[k]`` for
the overlapped update's stage k); a develop-style stage dict built by hand
(no ``'phases'``), and develop's ``_broadcast_2d_params``, become one such
phase over their own buffers (:func:`hand_built_phase`) and run through the
same :func:`run_sync_phase`: there is one sync path.
"""

from __future__ import annotations

from collections import OrderedDict

import paddle

from . import collectives as comm
from .step_plan import StepPhase, flat_broadcast_phase
from .types import (
    OP_ALL_GATHER,
    OP_BROADCAST,
    PHASE_ALL_GATHER,
    ROUTE_FLAT,
    ROUTE_SLICES,
    TRIGGER_SYNC,
)

__all__ = [
    "build_stage_dicts",
    "launch_stage_sync",
    "hand_built_phase",
    "broadcast_2d_params",
    "reorder_params",
    "owner_dtype_buffers",
    "sync_buffer",
    "run_sync_phase",
]


def build_stage_dicts(opt) -> list:
    by_name = {p.name: p for p in opt._parameter_list}
    stages = []
    for spec in opt._layout.sync_stages():
        if spec.kind == "1d":
            buffer = opt._rs_buffers[spec.buffer_index]
            stages.append({"kind": "1d", "buffer": buffer, "spec": spec,
                           "local_params": [opt._slice_params[n] for n in spec.local_params]})
            continue
        info = opt._color_to_group_info[spec.colour]
        ranks = list(spec.group)
        rank2params: dict = OrderedDict()
        for owner, _, names, _ in spec.owners:
            rank2params.setdefault(ranks.index(owner), []).extend(by_name[n] for n in names)
        stages.append({"kind": "2d", "color": spec.colour, "group": info["group"],
                       "world_size": info["world_size"], "rank2params": rank2params,
                       "keys": list(spec.keys), "spec": spec,
                       "local_params": [by_name[n] for n in spec.local_params]})
    for k, stage in enumerate(stages):
        stage["phases"] = opt._layout.phases_of(f"{TRIGGER_SYNC}[{k}]")
    return stages


def launch_stage_sync(opt, stage: dict) -> list:
    cache, unpack, group = {}, [], None
    phases = stage.get("phases")
    if phases is None:
        # develop-style dict built by hand: its own buffers as one phase
        phase = hand_built_phase(opt, stage, cache, unpack)
        if phase is None:
            return []
        phases, group = [phase], stage.get("group")
    pending = []
    for i, phase in enumerate(phases):
        pending += opt._run_sync_phase(phase, cache, unpack, launch=i == len(phases) - 1,
                                       group=group)

    def copy_back():
        for buffer, params in unpack:
            comm.unflatten_from(buffer, params)

    # waited after the stage's collectives: the received values land then
    return pending + [comm.PendingCollective([], [], "copy back", copy_back)]


def hand_built_phase(opt, stage: dict, cache: dict, unpack: list) -> StepPhase | None:
    """A develop-style stage dict as one sync phase over its own buffers.

    ``{'kind': '1d', 'buffer'}`` all-gathers the buffer; ``{'kind': '2d',
    'group', 'world_size', 'rank2params'}`` broadcasts one flat buffer per
    owner and dtype (the owner fills it, the others get it in ``unpack``).
    The buffers go in ``cache`` under ``("hand", j)`` refs, which
    :func:`run_sync_phase` resolves first. None: nothing to sync (one rank).
    """
    if stage["kind"] == "1d":
        cache[("hand", 0)] = stage["buffer"]
        return StepPhase(TRIGGER_SYNC, PHASE_ALL_GATHER, OP_ALL_GATHER, ROUTE_SLICES, (),
                         ((("hand", 0), None),), ())
    if stage["world_size"] <= 1:
        return None
    group, items = stage["group"], []
    flats = opt._owner_dtype_buffers(stage["rank2params"], group, single_as_is=False)
    for j, (owner, flat) in enumerate(flats):
        cache[("hand", j)] = flat["param_buffer"]
        if owner != opt._rank:
            unpack.append((flat["param_buffer"], flat["params"]))
        items.append((("hand", j), owner))
    ranks = tuple(group.ranks)
    return StepPhase(TRIGGER_SYNC, flat_broadcast_phase(ranks), OP_BROADCAST, ROUTE_FLAT,
                     ranks, tuple(items), ())


def broadcast_2d_params(opt, rank2params: dict, group) -> list:
    # develop's helper: a hand-built 2-D stage of the whole group
    return launch_stage_sync(opt, {"kind": "2d", "group": group, "rank2params": rank2params,
                                   "world_size": len(group.ranks)})


def reorder_params(opt, comm_list) -> list:
    out = []
    for rank2params, group in comm_list:
        for owner, flat in opt._owner_dtype_buffers(rank2params, group, single_as_is=True):
            out.append(dict(flat, src_rank=owner))
    return out


def owner_dtype_buffers(opt, rank2params: dict, group, single_as_is: bool):
    ranks = list(group.ranks)
    for index, params in rank2params.items():
        by_dtype: dict = OrderedDict()
        for p in params:
            by_dtype.setdefault(str(p.dtype), []).append(p)
        owner = ranks[index]
        for members in by_dtype.values():
            if single_as_is and len(members) == 1:
                yield owner, {"param_buffer": members[0], "params": members}
                continue
            buffer = paddle.empty([sum(int(p.numel()) for p in members)],
                                  dtype=members[0].dtype)
            if owner == opt._rank:
                comm.flatten_into(members, buffer)
            yield owner, {"param_buffer": buffer, "params": members}


def sync_buffer(opt, ref: tuple, cache: dict, unpack: list):
    if ref in cache:
        return cache[ref]
    if ref[0] == "muon":
        bucket = opt._muon_buckets[ref[1]]
        owner, params = bucket.owner, bucket.params
    else:  # ("stage", k, j): owner buffer j of sync stage k
        owner, _, names, _ = opt._layout.sync_stages()[ref[1]].owners[ref[2]]
        params = [opt._param_by_name[n] for n in names]
    buffer = paddle.empty([sum(int(p.numel()) for p in params)], dtype=params[0].dtype)
    if owner == opt._rank:
        comm.flatten_into(params, buffer)
    else:
        unpack.append((buffer, params))
    cache[ref] = buffer
    return buffer


def run_sync_phase(opt, phase, cache: dict, unpack: list, launch: bool, group=None) -> list:
    """Issue one sync phase; with ``launch`` leave it in flight (returned to wait on).

    Refs already in ``cache`` (a hand-built phase's buffers) are used as they
    are; ``group`` overrides the phase's group (a hand-built stage's own).
    """
    if phase.op == OP_ALL_GATHER:
        buffers = [cache[ref] if ref in cache else opt._rs_buffers[ref[1]]
                   for ref, _ in phase.items]
        if launch:
            return [comm.launch_all_gather(b) for b in buffers]
        comm.all_gather_slices(buffers)
        return []
    routes = [(opt._sync_buffer(ref, cache, unpack), root) for ref, root in phase.items]
    group = opt._phase_group(phase) if group is None else group
    with comm.comm_phase(phase.label):
        if launch:
            return [comm.launch_broadcast(routes, group)]
        comm.broadcast_from(routes, group)
    return []
