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
"""Sync stages of the overlapped update (develop's ``overlap_optimize_and_sync``).

The step updates the parameters stage by stage and launches each stage's
parameter sync right after its update, so the broadcast of stage ``k``
travels while stage ``k + 1`` runs Newton-Schulz. Stages are built only from
replicated metadata (colour lists, owner maps, Muon group keys, buffer
order), so every rank derives the same list and issues the same collectives
in the same order; a Muon group key is never split across stages, so the
batched update computes exactly what the plain path computes.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Callable, Mapping, Sequence

from .types import DEVELOP_DEFAULT_BUFFER_MB

__all__ = [
    "build_sync_stages",
    "key_numels",
    "run_staged_update",
    "stage_element_limit",
    "stage_runs",
]

# One MB of fp32 elements: develop sizes stages as comm_buffer_size_MB * 2**18.
_ELEMENTS_PER_MB = 2**18


def stage_element_limit(comm_buffer_size_MB: float) -> int:
    """Elements after which adjacent Muon groups close a stage."""
    # develop's stage size when comm_buffer_size_MB <= 0
    mb = comm_buffer_size_MB if comm_buffer_size_MB > 0 else DEVELOP_DEFAULT_BUFFER_MB
    return int(mb * _ELEMENTS_PER_MB)


def _numel(param) -> int:
    numel = getattr(param, "numel", None)
    if type(numel) is int:  # the layout's ParamMeta: counted once at construction
        return numel
    return math.prod(int(d) for d in param.shape)


def stage_runs(key_numels: Sequence[int], limit: int) -> list:
    """How adjacent Muon groups form stages: the number of keys in each run.

    A run closes once its elements reach ``limit``; the last run holds the
    rest. The one place the rule lives: :func:`build_sync_stages` splits by
    it, and the layout's cache keys stages on it (buffer sizes giving the
    same runs give the same stages).

    Args:
        key_numels: elements of each key, in stage order.
        limit: :func:`stage_element_limit`.

    Returns:
        list[int]: keys per run.
    """
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


def key_numels(params: Sequence, group_key: Callable[[Any], Any]) -> list:
    """Elements of each ``group_key`` of ``params``, keys in first-seen order:
    what :func:`stage_runs` splits (as :func:`build_sync_stages` groups them)."""
    numels: dict = OrderedDict()
    for p in params:
        k = group_key(p)
        numels[k] = numels.get(k, 0) + _numel(p)
    return list(numels.values())


def build_sync_stages(
    params_2d_by_color: Mapping,
    rank2params_by_color: Mapping,
    group_info: Mapping,
    slice_buffers: Sequence,
    slice_params_of: Callable[[Any], list],
    group_key: Callable[[Any], Any],
    limit: int,
) -> list:
    """Develop's sync stages: 2-D stages per colour, then one stage per 1-D buffer.

    Args:
        params_2d_by_color: colour -> Muon params (develop's owner-sorted order).
        rank2params_by_color: colour -> {group rank -> params it owns}.
        group_info: colour -> ``{'group', 'world_size', 'rank'}``.
        slice_buffers: the element-wise buffers, in issue order.
        slice_params_of: buffer -> what a 1-D stage updates (this rank's slices).
        group_key: the inner optimizer's ``muon_group_key``.
        limit: elements after which adjacent keys close a stage.

    Returns:
        list[dict]: ``{'kind': '2d', 'color', 'group', 'world_size',
        'rank2params', 'keys', 'local_params'}`` stages, then ``{'kind': '1d',
        'buffer', 'local_params'}`` stages. A key spanning colours is
        updated once, in the first stage that lists it.
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
        keys_in_order = list(by_key)
        runs, start = [], 0
        # the per-key sums of key_numels, from the groups already at hand
        # (key_numels would call group_key a second time per matrix, on
        # plan's 100,000-matrix path too)
        for n in stage_runs([sum(map(_numel, members)) for members in by_key.values()], limit):
            runs.append(keys_in_order[start:start + n])
            start += n
        for keys in runs:
            wanted = {id(p) for k in keys for p in by_key[k]}
            owned = OrderedDict(
                (r, [p for p in ps if id(p) in wanted]) for r, ps in rank2params.items()
            )
            owned = OrderedDict((r, ps) for r, ps in owned.items() if ps)
            if owned:
                stages.append({"kind": "2d", "color": colour, "group": info["group"],
                               "world_size": world_size, "rank2params": owned,
                               "keys": keys, "local_params": []})
    for stage in stages:
        for key in stage["keys"]:
            stage["local_params"].extend(local_by_key.pop(key, ()))
    for buffer in slice_buffers:
        stages.append({"kind": "1d", "buffer": buffer,
                       "local_params": list(slice_params_of(buffer))})
    return stages


def run_staged_update(inner_opt, params_grads: list, stages: Sequence,
                      launch_sync: Callable[[dict], list],
                      label: Callable[[int, dict], Any],
                      wait_all: Callable[[list], None] | None = None) -> None:
    """Clip and prepare once, then per stage update and launch its sync; wait all.

    Args:
        inner_opt: the optimizer with Muon's staged API.
        params_grads: this rank's (param, grad) pairs.
        stages: from :func:`build_sync_stages`.
        launch_sync: ``stage -> [pending]`` (objects with ``wait()``).
        label: ``(index, stage) -> context manager`` around each stage's update.
        wait_all: waits on every launched sync (default: one after another).

    Raises:
        AssertionError: a parameter with a gradient belongs to no stage.
    """
    params_grads = inner_opt.apply_grad_clip(params_grads)
    muon, adamw = inner_opt.prepare_optimize(params_grads)
    muon_by_id = OrderedDict((id(p), (p, g)) for p, g in muon)
    adamw_by_id = OrderedDict((id(p), (p, g)) for p, g in adamw)
    pending: list = []
    for index, stage in enumerate(stages):
        stage_muon, stage_adamw = [], []
        for p in stage["local_params"]:
            if id(p) in muon_by_id:
                stage_muon.append(muon_by_id.pop(id(p)))
            elif id(p) in adamw_by_id:
                stage_adamw.append(adamw_by_id.pop(id(p)))
        if stage_muon or stage_adamw:
            with label(index, stage):
                inner_opt.update_params(stage_muon, stage_adamw)
        pending.extend(launch_sync(stage))
    leftover = [p.name for p, _ in list(muon_by_id.values()) + list(adamw_by_id.values())]
    if wait_all is None:
        for task in pending:
            task.wait()
    else:
        wait_all(pending)
    if leftover:
        raise AssertionError(
            f"overlap_optimize_and_sync: parameters {leftover} have gradients but belong "
            "to no sync stage; the stages were built for another parameter set."
        )
