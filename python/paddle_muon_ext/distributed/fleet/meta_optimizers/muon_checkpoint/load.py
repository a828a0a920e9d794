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
"""Loading a checkpoint after every rank checked it: :func:`load_sharded_checkpoint`.

Users import it from ``muon_checkpoint``. Every rank checks its arguments
and the checkpoint (:func:`~.verify.inspect_checkpoint`),
the ranks exchange what they found, and any problem on any rank is the
same error on every rank before a tensor is read. Only then does Paddle's
``load_state_dict`` run (on CPU-only builds under
:func:`~.reshard.cpu_resharding`), supervised by
:class:`~.load_guard.LoadGuard` so that a failure inside it
is one error on every rank too.
"""

from __future__ import annotations

import inspect
import os
import uuid
from collections.abc import Callable
from typing import Any

import paddle.distributed as dist
from paddle.distributed.fleet.utils.log_util import logger
from paddle.distributed.flex_checkpoint.dcp.utils import flatten_state_dict

from . import common
from .common import (
    DEFAULT_TIMEOUT_S,
    CheckpointCorruptError,
    CheckpointLoadError,
    CheckpointMismatchError,
    check_values,
    id_problem,
    listed,
    one_line,
    path_problem,
    per_rank,
)
from .load_guard import LoadGuard
from .reshard import cpu_resharding
from .verify import inspect_checkpoint

__all__ = ["load_sharded_checkpoint"]


def _flat_state(state_dict: Any) -> dict:
    """``state_dict`` with nested dicts flattened as flex_checkpoint names
    them (``{"model": {"w": t}}`` -> ``{"model.w": t}``).

    Raises:
        TypeError: a value that is no Tensor / ShardedWeight, a key no str.
    """
    check_values(state_dict)
    return flatten_state_dict(state_dict)[0]


def _load_kwargs_problem(load_kwargs: dict) -> str | None:
    params = inspect.signature(dist.load_state_dict).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    unknown = sorted(k for k in load_kwargs if k not in params)
    if not unknown:
        return None
    valid = sorted(k for k in params if k not in ("state_dict", "path", "process_group",
                                                  "unique_id"))
    return (f"{', '.join(unknown)}: not an argument of paddle.distributed.load_state_dict "
            f"(the others it takes: {', '.join(valid)})")


def _load_refusal(state_dict: Any, path: Any, unique_id: Any, strict: Any,
                  load_kwargs: dict) -> tuple[str, str] | tuple[None, None]:
    """(exception type name, one line) for the first bad argument of a load."""
    problem = path_problem(path)
    if problem:
        return "TypeError", problem
    problem = id_problem(unique_id) or (
        None if isinstance(strict, bool) else f"strict={strict!r}: must be True or False")
    if problem:
        return "ValueError", problem
    problem = _load_kwargs_problem(load_kwargs)
    if problem:
        return "TypeError", problem
    try:
        _flat_state(state_dict)
    except (TypeError, ValueError, AssertionError) as exc:
        return "TypeError", str(exc)
    return None, None


def _read_shards(state_dict: dict, directory: str, process_group, unique_id: int,
                 **load_kwargs: Any) -> None:
    dist.load_state_dict(state_dict, directory, process_group=process_group,
                         unique_id=unique_id, **load_kwargs)


def _guard_of(directory: str) -> tuple[str, bool]:
    """(where the load's guard files go, whether this rank may write there)."""
    root = os.path.dirname(os.path.abspath(directory))
    return root, os.access(root, os.W_OK | os.X_OK)


def _read_agreed(read: Callable[[], None], reports: list, rank: int, ranks: list[int],
                 directory: str, process_group=None) -> None:
    """Run Paddle's load under a :class:`LoadGuard` when every rank could
    prepare its guard files, so that a failure inside it is one error on every
    rank; where any rank could not (a full disk, a read-only directory), every
    rank loads unsupervised: reading needs no room."""
    root, _ = _guard_of(directory)
    guard = None
    if len(ranks) > 1 and all(r.get("guard_writable") for r in reports):
        guard = LoadGuard(root, reports[0]["token"], rank, ranks, directory, DEFAULT_TIMEOUT_S)
        try:
            guard.start()
            problem = None
        except OSError as exc:
            problem = f"rank {rank} could not prepare {guard.path}: {type(exc).__name__}: {exc}"
        try:
            # every rank is here (Paddle's collectives come next anyway)
            problems = [p for p in common.gather(problem, process_group, ranks) if p]
        except Exception as exc:  # noqa: BLE001 - e.g. gloo's timeout: a rank is gone
            guard.abandon()
            raise CheckpointLoadError(
                f"loading {directory}: the ranks {ranks} could not agree before reading "
                f"({type(exc).__name__}: {one_line(exc)}); nothing was read") from exc
        if problems:
            guard.abandon()
            guard = None
            logger.warning(f"checkpoint: loading {directory} unsupervised (a failure inside "
                           f"Paddle's load fails only its rank): {problems[0]}")
    with cpu_resharding():
        if guard is not None:
            guard.run(read)
            return
        try:
            read()
        except Exception as exc:  # noqa: BLE001 - named: which rank, which checkpoint
            raise CheckpointLoadError(
                f"loading {directory} failed inside paddle.distributed.load_state_dict on "
                f"rank {rank}: {type(exc).__name__}: {one_line(exc, 1000)}") from exc


def load_sharded_checkpoint(
    state_dict: dict,
    path: str,
    process_group: Any = None,
    unique_id: int | None = None,
    strict: bool = True,
    **load_kwargs: Any,
) -> str:
    """Verify a checkpoint and check it fits ``state_dict``, then load it in place.

    Call it on every rank, like ``paddle.distributed.load_state_dict``, with
    the same ``path`` (on a file system every rank sees). Every rank checks
    first and the ranks exchange what they found, so any problem on any rank
    is the same error on every rank, before a tensor is read. On a build
    without a GPU (gloo) Paddle's resharding runs on CPU tensors (see
    :func:`~.reshard.cpu_resharding`).

    Args:
        state_dict (dict): key -> ShardedWeight or Tensor (or nested dicts of
            them, checked under flex_checkpoint's dotted keys), e.g. the model's
            ``sharded_state_dict()`` updated with the optimizer's
            ``sharded_state_dict(model_sharded_state_dict)``.
        path (str): a directory :func:`save_sharded_checkpoint` saved into
            (the newest complete checkpoint is loaded, or ``unique_id``'s),
            one ``checkpoint_<id>`` directory, or a plain flex_checkpoint
            directory (not verifiable: no marker).
        process_group (Group|None): the ranks loading together (default: all).
        unique_id (int|None): checkpoint id; the newest complete when None.
        strict (bool): also refuse checkpoint keys that no rank loads.
        **load_kwargs: passed on to ``paddle.distributed.load_state_dict``.

    Returns:
        str: the directory loaded.

    Raises:
        RuntimeError: when the ranks could not exchange their checks (a rank
            missing: after the process group's timeout); nothing was read.
        ValueError: on every rank, when a rank passed a bad ``unique_id`` or
            ``strict``.
        TypeError: on every rank, when a rank passed a ``path`` that is no
            path, a value that is no Tensor / ShardedWeight, or a keyword
            ``paddle.distributed.load_state_dict`` does not take.
        FileNotFoundError: on every rank, when a rank finds no checkpoint
            (the message names the rank and its path).
        CheckpointCorruptError: on every rank, when a file is missing,
            truncated, grown or altered, the marker is invalid or holds
            another id than requested; names the file.
        CheckpointMismatchError: on every rank, when any rank's keys, global
            shapes or dtypes differ from the checkpoint's (listed per rank),
            or the ranks passed paths naming different checkpoints.
        CheckpointLoadError: on every rank, when Paddle's ``load_state_dict``
            raised on a rank after every check passed, or a rank stopped
            responding during it (:mod:`.load_guard`); names
            the ranks, the checkpoint and the error.
    """
    rank, ranks = common.ranks_of(process_group)
    index = ranks.index(rank) if rank in ranks else 0
    kind, refusal = _load_refusal(state_dict, path, unique_id, strict, load_kwargs)
    if refusal is None:
        flat = _flat_state(state_dict)
        mine = inspect_checkpoint(flat, os.fspath(path), unique_id, rank, index, len(ranks))
        mine["token"] = uuid.uuid4().hex
        mine["guard_writable"] = (mine["directory"] is not None
                                  and _guard_of(mine["directory"])[1])
    else:
        mine = {"rank": rank, "refused": (kind, refusal)}
    try:
        reports = common.gather(mine, process_group, ranks)
    except Exception as exc:  # noqa: BLE001 - e.g. gloo's timeout: a rank is gone
        raise RuntimeError(
            f"loading {path}: the ranks {ranks} could not exchange their checks "
            f"({type(exc).__name__}: {one_line(exc)}); is a rank missing or not calling "
            "load_sharded_checkpoint? Nothing was read.") from exc
    refused = [(r["rank"], r["refused"]) for r in reports if r["refused"]]
    if refused:
        error = TypeError if any(k == "TypeError" for _, (k, _) in refused) else ValueError
        raise error(per_rank([(r, m) for r, (_, m) in refused]))
    missing = [(r["rank"], r["missing"]) for r in reports if r["missing"]]
    if missing:
        if len(ranks) == 1:
            raise FileNotFoundError(missing[0][1])
        raise FileNotFoundError(
            f"rank(s) {[r for r, _ in missing]} found no checkpoint, so no rank loads "
            "(pass the same path, on a file system every rank sees):\n  "
            + "\n  ".join(f"rank {r}: {m}" for r, m in missing))
    corrupt_lines = [f"rank {r['rank']}: {p}" for r in reports for p in r["corrupt"]]
    if corrupt_lines:
        directory = mine["directory"] or path
        raise CheckpointCorruptError(
            f"checkpoint {directory} cannot be loaded; nothing was read:\n  "
            + "\n  ".join(corrupt_lines) + "\nLoad an earlier checkpoint (unique_id=...) or "
            "save again.")
    directory, uid, saved = mine["directory"], mine["uid"], mine["saved"]
    # the same checkpoint spelled differently (``a/../a``, a symlinked parent) is
    # one checkpoint: compared by identity and real path
    if (len({r["identity"] for r in reports}) > 1
            or len({os.path.realpath(r["directory"]) for r in reports}) > 1):
        where = ", ".join(f"rank {r['rank']}: path {r['path']!r} -> {r['directory']}"
                          for r in reports)
        if len({r["path"] for r in reports}) > 1:
            raise CheckpointMismatchError(
                f"the ranks passed different checkpoint paths ({where}): pass the same "
                "path on every rank, on a file system every rank sees; nothing was read")
        raise CheckpointCorruptError(
            f"the ranks resolved different checkpoints under {path} ({where}): a save "
            "committed meanwhile; pass unique_id; nothing was read")
    problems = [f"rank {r['rank']}: {p}" for r in reports for p in r["problems"]]
    if strict:
        loaded = set().union(*(r["keys"] for r in reports))
        unexpected = set(saved) - loaded
        if unexpected:
            problems.append(f"in the checkpoint but loaded by no rank: {listed(unexpected)}")
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {directory} (id {uid}) does not match the state dict being "
            "loaded - was it saved from another model or optimizer "
            "configuration?\n  " + "\n  ".join(problems) + "\nLoad it into the "
            "model and optimizer that saved it (same parameters, dtypes, master weights "
            "on or off alike); strict=False ignores checkpoint keys nobody loads."
        )
    # flat: the checks' keys are the keys loaded (in place, nested or not)
    _read_agreed(lambda: _read_shards(flat, directory, process_group, uid, **load_kwargs),
                 reports, rank, ranks, directory, process_group)
    return directory
