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
"""Replicas that differ: refused before a save drops one of them.

flex_checkpoint writes a piece of a tensor (key, global offset, local shape)
that several ranks hold only once, from one of them: it takes the copies to
be replicas. When they are not - an expert weight of an expert-parallel
rank described by the model's ``sharded_state_dict()`` as the whole tensor
(offset 0 on every rank), or a per-rank optimizer state under one key - the
other ranks' values are silently lost and a reload gives every rank the
same one. :func:`replica_conflicts` compares a fingerprint of every piece
across the ranks before Paddle writes.

The fingerprint is a CRC-32 of at most :data:`SAMPLE` evenly strided
elements (and the element count and dtype): copies that are replicas are
bit-identical, and copies that are not (other experts, other moments)
differ nearly everywhere, so a sample finds them at the cost of a few small
device reads per key instead of a pass over the model.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Any

import numpy as np

import paddle
from paddle.distributed.fleet.utils.log_util import logger
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

from . import common

__all__ = ["SAMPLE", "fingerprints", "replica_conflicts"]

SAMPLE = 4096


def _tensor_fingerprint(tensor: paddle.Tensor) -> int:
    count = int(np.prod(tensor.shape)) if tensor.shape else 1
    head = f"{tensor.dtype}:{count}".encode()
    if count == 0:
        return zlib.crc32(head)
    step = max(1, count // SAMPLE)
    with paddle.no_grad():
        flat = tensor.reshape([-1])
        try:
            # gathered, not a strided view: numpy() of a view copies the whole base
            index = paddle.arange(0, count, step, dtype="int64")[:SAMPLE]
            sample = paddle.gather(flat, index) if step > 1 else flat
            data = np.ascontiguousarray(sample.numpy()).tobytes()
        except Exception:  # noqa: BLE001 - e.g. a tensor on another place than the index
            data = np.ascontiguousarray(flat.numpy()[::step][:SAMPLE]).tobytes()
    return zlib.crc32(data, zlib.crc32(head))


def _piece(key: str, value: Any) -> tuple[str, tuple, tuple, tuple]:
    if isinstance(value, ShardedWeight):
        flat = value.flattened_range
        span = (flat.start, flat.stop) if value.is_flattened and flat is not None else ()
        return key, tuple(value.global_offset), tuple(value.local_shape), span
    return key, (0,) * len(value.shape), tuple(value.shape), ()


def fingerprints(state_dict: dict, prefix: str = "") -> dict[int, tuple[int, tuple]]:
    """This rank's pieces: 64-bit piece id -> (fingerprint, (key, offset, shape, range)).

    Nested dicts are walked under dotted keys, as flex_checkpoint flattens them.
    """
    out: dict[int, tuple[int, tuple]] = {}
    for key, value in state_dict.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(fingerprints(value, name + "."))
            continue
        piece = _piece(name, value)
        tensor = value.local_tensor if isinstance(value, ShardedWeight) else value
        pid = int.from_bytes(hashlib.blake2b(repr(piece).encode(), digest_size=8).digest(),
                             "little")
        out[pid] = (_tensor_fingerprint(tensor), piece)
    return out


def replica_conflicts(state_dict: dict, process_group, ranks: list[int]) -> list[str]:
    """Pieces that several ranks hold with different values, one line each.

    Every rank calls it (two small all_gathers: the fingerprints, then the
    names of the conflicting pieces only when there are some); every rank
    returns the same lines.
    """
    if len(ranks) == 1:
        return []  # one rank: nothing to compare with
    try:
        mine = fingerprints(state_dict)
    except Exception as exc:  # noqa: BLE001 - the rank still takes part in the gather
        # the check must never fail a save by itself: this rank's pieces go unchecked
        logger.warning(f"checkpoint: rank {common.ranks_of(process_group)[0]} could not "
                       f"fingerprint its tensors, replicas unchecked: "
                       f"{type(exc).__name__}: {common.one_line(exc)}")
        mine = {}
    compact = {pid: fp for pid, (fp, _) in mine.items()}
    gathered = common.gather(compact, process_group, ranks)
    seen: dict[int, dict[int, list[int]]] = {}
    for rank, prints in zip(ranks, gathered):
        for pid, fp in prints.items():
            seen.setdefault(pid, {}).setdefault(fp, []).append(rank)
    clashing = sorted(pid for pid, by_fp in seen.items() if len(by_fp) > 1)
    if not clashing:
        return []
    names = common.gather({pid: mine[pid][1] for pid in clashing if pid in mine},
                          process_group, ranks)
    pieces = {}
    for part in names:
        pieces.update(part)
    lines = []
    for pid in clashing[:common.LISTED]:
        key, offset, shape, span = pieces[pid]
        groups = "; ".join(f"ranks {rs}" for rs in sorted(seen[pid].values()))
        where = f"offset {list(offset)}, shape {list(shape)}" + (
            f", flat range {list(span)}" if span else "")
        lines.append(f"{key} ({where}): held with different values by {groups}")
    if len(clashing) > common.LISTED:
        lines.append(f"... and {len(clashing) - common.LISTED} more")
    return lines
