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
"""Load a ``flex_checkpoint`` only when it fits what is being loaded.

``paddle.distributed.load_state_dict`` logs a warning for keys it cannot
find and reads whatever overlaps when global shapes differ, so a checkpoint
of another model (or of the model without its optimizer's master weights)
loads "successfully" and training continues from partly initial state.
:func:`load_sharded_checkpoint` compares the checkpoint's metadata with the
sharded state dict of every rank first and raises on all ranks alike.
"""

from __future__ import annotations

import os
import re
from typing import Any

import paddle
import paddle.distributed as dist

__all__ = ["CheckpointMismatchError", "load_sharded_checkpoint"]

_METADATA = re.compile(r"^(\d+)\.metadata$")
_LISTED = 8


class CheckpointMismatchError(ValueError):
    """The checkpoint does not describe the state dict being loaded."""


def _metadata_path(path: str, unique_id: int | None) -> tuple[str, int]:
    ids = sorted(
        int(m.group(1)) for m in map(_METADATA.match, os.listdir(path)) if m
    )
    if not ids:
        raise FileNotFoundError(
            f"no flex_checkpoint metadata (<id>.metadata) in {path}; save with "
            "paddle.distributed.save_state_dict first."
        )
    uid = ids[-1] if unique_id is None else unique_id
    if uid not in ids:
        raise FileNotFoundError(
            f"checkpoint id {uid} not in {path} (ids there: {ids})."
        )
    return os.path.join(path, f"{uid}.metadata"), uid


def _global_shape(value: Any) -> tuple[int, ...]:
    if isinstance(value, paddle.Tensor):
        return tuple(value.shape)
    return tuple(value.global_shape)


def _listed(keys) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - _LISTED} more" if len(keys) > _LISTED else ""
    return ", ".join(keys[:_LISTED]) + more


def _local_problems(state_dict: dict, saved: dict) -> list[str]:
    problems = []
    missing = [k for k in state_dict if k not in saved]
    if missing:
        problems.append(f"not in the checkpoint: {_listed(missing)}")
    for key, value in sorted(state_dict.items()):
        if key in saved and saved[key] != _global_shape(value):
            problems.append(
                f"{key}: checkpoint global shape {list(saved[key])}, here "
                f"{list(_global_shape(value))}"
            )
    return problems


def load_sharded_checkpoint(
    state_dict: dict,
    path: str,
    process_group: Any = None,
    unique_id: int | None = None,
    strict: bool = True,
    **load_kwargs: Any,
) -> None:
    """Check a flex checkpoint against ``state_dict``, then load it in place.

    Call it on every rank, like ``paddle.distributed.load_state_dict``.

    Args:
        state_dict (dict): key -> ShardedWeight or Tensor, e.g. the model's
            ``sharded_state_dict()`` updated with the optimizer's
            ``sharded_state_dict(model_sharded_state_dict)``.
        path (str): the checkpoint directory.
        process_group (Group|None): the ranks loading together (default: all).
        unique_id (int|None): checkpoint id; the newest when None.
        strict (bool): also refuse checkpoint keys that no rank loads.
        **load_kwargs: passed on to ``paddle.distributed.load_state_dict``.

    Raises:
        CheckpointMismatchError: on every rank, when any rank's keys or global
            shapes differ from the checkpoint's; the message lists them per rank.
    """
    metadata_file, uid = _metadata_path(path, unique_id)
    metadata = paddle.load(metadata_file)
    saved = {
        key: tuple(entries[0].global_shape)
        for key, entries in metadata.state_dict_metadata.items()
    }
    mine = (dist.get_rank(), sorted(state_dict), _local_problems(state_dict, saved))
    reports = [mine]
    if dist.get_world_size() > 1:
        reports = []
        dist.all_gather_object(reports, mine, process_group)
    problems = [f"rank {rank}: {p}" for rank, _, found in reports for p in found]
    if strict:
        loaded = set().union(*(keys for _, keys, _ in reports))
        unexpected = set(saved) - loaded
        if unexpected:
            problems.append(f"in the checkpoint but loaded by no rank: {_listed(unexpected)}")
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {path} (id {uid}) does not match the state dict being "
            "loaded - was it saved from another model or optimizer "
            "configuration?\n  " + "\n  ".join(problems) + "\nLoad it into the "
            "model and optimizer that saved it (same parameters, master weights "
            "on or off alike); strict=False ignores checkpoint keys nobody loads."
        )
    dist.load_state_dict(
        state_dict, path, process_group=process_group, unique_id=uid, **load_kwargs
    )
