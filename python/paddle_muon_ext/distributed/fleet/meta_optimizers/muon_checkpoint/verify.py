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
"""What one rank checks before a checkpoint is loaded: :func:`inspect_checkpoint`.

Resolves the directory to load (a ``save_sharded_checkpoint`` root, one
``checkpoint_<id>``, or a plain flex_checkpoint directory), verifies the
completion marker, every file's size and this rank's share of the SHA-256
checksums, that the marker lists every file Paddle's load would read, and compares the checkpoint's keys, global shapes and dtypes with
the state dict. The result is plain data that ``load_sharded_checkpoint``
exchanges between the ranks before any of them raises; nothing here raises
(a rank that raised alone would leave the others waiting in a collective).
"""

from __future__ import annotations

import os
import re
from typing import Any

import paddle
from paddle.distributed.fleet.utils.log_util import logger

from .commit import (
    MARKER,
    checkpoint_name,
    file_digest,
    read_marker,
    unlisted_problems,
)
from .common import LISTED, layout_summary, listed
from .listing import committed_checkpoints, id_mismatch, newest_complete

__all__ = ["inspect_checkpoint"]

_METADATA = re.compile(r"^(\d+)\.metadata$")


def _metadata_path(path: str, unique_id: int | None) -> tuple[str, int]:
    try:
        names = os.listdir(path)
    except OSError as exc:
        raise FileNotFoundError(f"no checkpoint at {path}: {exc.strerror or exc} (pass the "
                                "directory save_sharded_checkpoint saved into)") from None
    ids = sorted(int(m.group(1)) for m in map(_METADATA.match, names) if m)
    if not ids:
        raise FileNotFoundError(
            f"no checkpoint in {path}: no checkpoint_<id> directory (save with "
            "save_sharded_checkpoint) and no flex_checkpoint metadata (<id>.metadata)."
        )
    uid = ids[-1] if unique_id is None else unique_id
    if uid not in ids:
        raise FileNotFoundError(
            f"checkpoint id {uid} not in {path} (ids there: {ids})."
        )
    return os.path.join(path, f"{uid}.metadata"), uid


def _resolve(path: str, unique_id: int | None) -> tuple[str, bool]:
    """(directory to load, whether it was committed by save_sharded_checkpoint)."""
    if os.path.isfile(os.path.join(path, MARKER)):
        return path, True
    committed = committed_checkpoints(path)
    if committed:
        if unique_id is not None:
            directory = os.path.join(path, checkpoint_name(unique_id))
            if not os.path.isdir(directory):
                raise FileNotFoundError(
                    f"{directory} does not exist (ids there: {sorted(i for i, _ in committed)})")
            return directory, True
        latest, skipped = newest_complete(path, verify=False)
        if latest is None:
            more = (f"\n  ... and {len(skipped) - LISTED} more" if len(skipped) > LISTED
                    else "")
            raise FileNotFoundError(
                f"no complete checkpoint under {path}; every checkpoint_<id> there was "
                "skipped:\n  " + "\n  ".join(skipped[:LISTED]) + more)
        for line in skipped:
            logger.warning(f"checkpoint: {line}")
        return latest, True
    return path, False


def _global_shape(value: Any) -> tuple[int, ...]:
    if isinstance(value, paddle.Tensor):
        return tuple(value.shape)
    return tuple(value.global_shape)


def _dtype_name(value: Any) -> str:
    tensor = value if isinstance(value, paddle.Tensor) else value.local_tensor
    return str(tensor.dtype).replace("paddle.", "")


def _local_problems(state_dict: dict, saved: dict) -> list[str]:
    """Keys, global shapes and dtypes of this rank's ``state_dict`` against
    the checkpoint's ``saved`` (key -> (global shape, dtype)). Values are
    never converted: a float32 checkpoint read into float64 tensors would
    not be the saved numbers."""
    problems = []
    missing = [k for k in state_dict if k not in saved]
    if missing:
        problems.append(f"not in the checkpoint: {listed(missing)}")
    for key, value in sorted(state_dict.items()):
        if key not in saved:
            continue
        shape, dtype = saved[key]
        if shape != _global_shape(value):
            problems.append(
                f"{key}: checkpoint global shape {list(shape)}, here "
                f"{list(_global_shape(value))}"
            )
        elif dtype != _dtype_name(value):
            problems.append(f"{key}: checkpoint dtype {dtype}, here {_dtype_name(value)} "
                            "(cast after loading into tensors of the saved dtype)")
    return problems


def _verify(directory: str, rank: int, index: int, nranks: int,
            expected_id: int | None = None) -> tuple[dict | None, list]:
    """This rank's share of the checks: (marker or None, problems).

    Every rank checks the marker, its id, every size and the metadata's
    checksum (it reads the metadata anyway); data files' checksums are
    spread over the ranks.
    """
    try:
        marker = read_marker(directory)
    except ValueError as exc:
        return None, [str(exc)]
    mismatch = id_mismatch(directory, marker, expected_id)
    if mismatch:
        return marker, [mismatch]
    problems = []
    names = sorted(marker["files"])
    for i, name in enumerate(names):
        entry = marker["files"][name]
        file_path = os.path.join(directory, name)
        writer = "" if entry.get("rank") is None else f" (written by rank {entry['rank']})"
        try:
            size = os.path.getsize(file_path)
        except OSError:
            problems.append(f"{file_path}{writer}: missing")
            continue
        if size != entry["size"]:
            what = "truncated" if size < entry["size"] else "grown: appended to or overwritten"
            problems.append(f"{file_path}{writer}: {size} bytes, the marker says "
                            f"{entry['size']} ({what})")
            continue
        if name == marker["metadata_file"] or i % nranks == index:
            _, digest = file_digest(file_path)
            if digest != entry["sha256"]:
                problems.append(f"{file_path}{writer}: SHA-256 differs from the marker's "
                                "(the file was altered after the save)")
    # Paddle picks its files by name, not from the marker: one it would read
    # unlisted would skip every check above
    problems.extend(unlisted_problems(directory, marker))
    if not problems:
        # the marker's layout summary must describe the metadata it vouches for
        meta_path = os.path.join(directory, marker["metadata_file"])
        summary = layout_summary(paddle.load(meta_path))
        if summary != marker["tensors"]:
            changed = sorted(k for k in set(summary) | set(marker["tensors"])
                             if summary.get(k) != marker["tensors"].get(k))
            problems.append(f"{os.path.join(directory, MARKER)}: layout summary differs from "
                            f"{meta_path} for {listed(changed)}")
    return marker, problems


def inspect_checkpoint(state_dict: dict, path: str, unique_id: Any, rank: int,
             index: int, nranks: int) -> dict:
    """Everything this rank finds before reading a tensor, as plain data for
    the other ranks; never raises (a rank that raised alone would leave the
    others waiting in the collectives). ``state_dict`` is flat."""
    mine = {"rank": rank, "path": os.path.abspath(path), "directory": None,
            "identity": None, "uid": None, "refused": None, "missing": None,
            "corrupt": [], "keys": [], "problems": [], "saved": {}}
    if unique_id is not None:
        unique_id = int(unique_id)
    mine["keys"] = sorted(state_dict)
    try:
        directory, verified = _resolve(path, unique_id)
        mine["directory"] = directory
        if verified:
            try:
                marker, corrupt = _verify(directory, rank, index, nranks, unique_id)
            except Exception as exc:  # noqa: BLE001 - reported on every rank, never a hang
                marker, corrupt = None, [f"{directory}: could not be checked "
                                         f"({type(exc).__name__}: {exc})"]
            mine["corrupt"] = corrupt
            if marker is not None:
                mine["uid"] = marker["unique_id"]
                mine["identity"] = (marker.get("token"), marker["unique_id"])
                if not corrupt:
                    mine["saved"] = {k: (tuple(v["global_shape"]), v["dtype"])
                                     for k, v in marker["tensors"].items()}
        else:
            metadata_file, mine["uid"] = _metadata_path(directory, unique_id)
            mine["identity"] = (os.path.realpath(metadata_file), mine["uid"])
            try:
                metadata = paddle.load(metadata_file)
                mine["saved"] = {key: (tuple(entries[0].global_shape), str(entries[0].dtype))
                                 for key, entries in metadata.state_dict_metadata.items()}
            except Exception as exc:  # noqa: BLE001 - unpickling fails in many ways
                mine["corrupt"] = [f"{metadata_file}: unreadable ({type(exc).__name__}: {exc})"]
        if not mine["corrupt"]:
            mine["problems"] = _local_problems(state_dict, mine["saved"])
    except FileNotFoundError as exc:
        mine["missing"] = str(exc)
    except Exception as exc:  # noqa: BLE001 - e.g. a permission error listing ``path``
        mine["corrupt"] = [f"{path}: could not be read ({type(exc).__name__}: {exc})"]
    return mine
