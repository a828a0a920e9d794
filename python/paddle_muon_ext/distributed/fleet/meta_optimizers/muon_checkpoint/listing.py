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
"""Finding committed checkpoints: which ``checkpoint_<id>`` directories are complete.

:func:`latest_complete_checkpoint` (public; users import it from
``muon_checkpoint``) and the checks behind it, which saving (``keep_last``)
and loading (the newest complete checkpoint) share: a directory counts when
its completion marker is valid, names the id the directory's name says, and
every file it lists has the listed size (and, when asked, SHA-256), and it
lists every file Paddle's load would read.
"""

from __future__ import annotations

import os

import paddle
from paddle.distributed.fleet.utils.log_util import logger

from .commit import (
    CHECKPOINT_PREFIX,
    MARKER,
    checkpoint_id,
    failed_save,
    file_digest,
    read_marker,
    unlisted_problems,
)
from .common import layout_summary, path_problem

__all__ = [
    "committed_checkpoints",
    "id_mismatch",
    "incomplete_reason",
    "latest_complete_checkpoint",
    "latest_complete_checkpoint_and_id",
    "newest_complete",
]


def committed_checkpoints(path: str) -> list[tuple[int, str]]:
    """``(id, directory)`` of every ``checkpoint_<id>`` under ``path``, newest first."""
    try:
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = [(checkpoint_id(n), os.path.join(path, n)) for n in names]
    return sorted(((i, d) for i, d in found if i is not None), reverse=True)


def id_mismatch(directory: str, marker: dict, expected: int | None) -> str | None:
    """Why ``directory``'s marker is not checkpoint ``expected`` (None: the id
    in the directory's name, if it has one), or None."""
    if expected is None:
        expected = checkpoint_id(os.path.basename(os.path.normpath(directory)))
    if expected is None or marker["unique_id"] == expected:
        return None
    link = (f" (a symlink to {os.path.realpath(directory)})" if os.path.islink(directory)
            else " (a copy or a rename?)")
    return (f"{directory}: holds checkpoint {marker['unique_id']} (its marker's unique_id), "
            f"not {expected}{link}; load it under its own id")


def incomplete_reason(directory: str, verify: bool = False) -> str | None:
    """Why ``directory`` is not a complete checkpoint, or None (marker, id,
    sizes, no unlisted file Paddle would read; with ``verify`` also checksums)."""
    try:
        marker = read_marker(directory)
    except ValueError as exc:
        return str(exc)
    mismatch = id_mismatch(directory, marker, None)
    if mismatch:
        return mismatch
    for name, entry in sorted(marker["files"].items()):
        path = os.path.join(directory, name)
        try:
            size = os.path.getsize(path)
        except OSError:
            return f"{path}: missing"
        if size != entry["size"]:
            return f"{path}: {size} bytes, the marker says {entry['size']}"
        if verify and file_digest(path)[1] != entry["sha256"]:
            return f"{path}: SHA-256 differs from the marker's"
    unlisted = unlisted_problems(directory, marker)
    if unlisted:
        return unlisted[0]
    if verify:
        # the marker itself carries no checksum: its layout summary must
        # describe the (verified) metadata, as the load checks
        try:
            summary = layout_summary(paddle.load(os.path.join(directory,
                                                              marker["metadata_file"])))
        except Exception as exc:  # noqa: BLE001 - unpickling fails in many ways
            return f"{marker['metadata_file']}: unreadable ({type(exc).__name__}: {exc})"
        if summary != marker["tensors"]:
            return (f"{os.path.join(directory, MARKER)}: layout summary "
                    f"differs from {marker['metadata_file']} (the marker was altered)")
    return None


def newest_complete(path: str, verify: bool) -> tuple[str | None, list[str]]:
    """(newest complete checkpoint or None, why each newer one was skipped)."""
    skipped = []
    for _, directory in committed_checkpoints(path):
        try:
            reason = incomplete_reason(directory, verify)
        except OSError as exc:  # e.g. a file that cannot be read for its checksum
            reason = f"could not be read ({type(exc).__name__}: {exc})"
        if reason is None:
            return directory, skipped
        skipped.append(f"skipping incomplete {directory}: {reason}")
    return None, skipped


def latest_complete_checkpoint(path: str, verify: bool = False) -> str | None:
    """The newest committed checkpoint under ``path``, or None.

    A ``checkpoint_<id>`` without a valid completion marker, holding another
    id than its name says (a symlink or copy of another checkpoint), or with
    a file missing or of the wrong size, or holding a file Paddle's load would
    read that the marker does not list, is skipped with a warning saying
    why, and so are saves that never committed. Checksums are checked on
    load, or here with ``verify=True`` (this process reads every file it
    considers).

    Args:
        path (str): the directory :func:`save_sharded_checkpoint` saved into.
        verify (bool): also skip checkpoints whose files fail their SHA-256.

    Returns:
        str|None: e.g. ``"<path>/checkpoint_7"``.
    """
    problem = path_problem(path)
    if problem:
        raise TypeError(problem)
    try:
        leftovers = sorted(n for n in os.listdir(path) if n.startswith(f".{CHECKPOINT_PREFIX}"))
    except (FileNotFoundError, NotADirectoryError):
        return None
    for name in leftovers:
        what = ("failed" if failed_save(os.path.join(path, name))
                else "killed, or still running")
        logger.warning(f"checkpoint: skipping {os.path.join(path, name)}: a save that never "
                       f"committed ({what})")
    latest, skipped = newest_complete(path, verify)
    for line in skipped:
        logger.warning(f"checkpoint: {line}")
    return latest


def latest_complete_checkpoint_and_id(path: str,
                                      verify: bool = False) -> tuple[str | None, int | None]:
    """The newest committed checkpoint under ``path`` and its id, or ``(None, None)``.

    The id is the ``unique_id`` the checkpoint was saved with: save with
    ``unique_id=step`` (the steps done) and it is the step to resume from.
    Which checkpoint counts, and the warnings: :func:`latest_complete_checkpoint`.

    Args:
        path (str): the directory :func:`save_sharded_checkpoint` saved into.
        verify (bool): also skip checkpoints whose files fail their SHA-256.

    Returns:
        tuple: e.g. ``("<path>/checkpoint_7", 7)``; ``(None, None)`` before the first save.
    """
    latest = latest_complete_checkpoint(path, verify)
    if latest is None:
        return None, None
    return latest, checkpoint_id(os.path.basename(os.path.normpath(latest)))
