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
"""Saving a checkpoint all-or-nothing: :func:`save_sharded_checkpoint`.

Users import it from ``muon_checkpoint``. A save writes a new
``checkpoint_<id>`` beside the previous ones: the ranks first agree on the
id and on their arguments (two small exchanges, before Paddle's own
collectives), every rank writes its shard into a fresh temporary directory,
and the coordinator (the group's first rank) commits with one rename once
every rank reported success through the files of
:class:`~.commit.SaveHandshake` - or publishes the failure
that every rank then raises as :class:`CheckpointSaveError`. The coordinator
also removes what killed or failed saves left, and with ``keep_last`` older
checkpoints.
"""

from __future__ import annotations

import errno
import math
import numbers
import os
import random
import re
import shutil
import time
import uuid
from typing import Any

import paddle
import paddle.distributed as dist
from paddle.distributed.fleet.utils.log_util import logger

from . import common
from .commit import (
    ACK_WAIT_S,
    CHECKPOINT_PREFIX,
    MARKER,
    MARKER_FORMAT,
    STATUS_DIR,
    SaveHandshake,
    checkpoint_id,
    checkpoint_name,
    decision_read,
    failed_save,
    file_digest,
    fsync_path,
    last_activity,
    tmp_name,
    write_json_atomic,
)
from .common import (
    DEFAULT_TIMEOUT_S,
    CheckpointMismatchError,
    CheckpointSaveError,
    check_values,
    data_file,
    id_problem,
    is_id,
    layout_summary,
    one_line,
    path_problem,
    per_rank,
)
from .listing import committed_checkpoints, incomplete_reason
from .replicas import replica_conflicts

__all__ = ["DEFAULT_TIMEOUT_S", "STALE_SAVE_S", "save_sharded_checkpoint"]

_TMP = re.compile(r"^\.checkpoint_(\d+)\.tmp-(\w+)$")
#: A save's temporary directory unchanged this long (or twice the new save's
#: ``timeout_s``, if longer) belongs to a save that is over - killed, since a
#: live save's ranks touch their heartbeats every ``HEARTBEAT_S`` - and the
#: next save removes it. Generous: file times come from the file server's
#: clock, and another job's save may run with a longer timeout.
STALE_SAVE_S = 120.0


def _save_arg_problem(unique_id: Any, keep_last: Any, timeout_s: Any) -> str | None:
    """The first bad argument of a save, as one line, or None."""
    problem = id_problem(unique_id)
    if problem:
        return problem
    if keep_last is not None and (not is_id(keep_last) or keep_last < 1):
        return f"keep_last={keep_last!r}: must be a positive int or None (keep all)"
    if (isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real)
            or not math.isfinite(timeout_s) or timeout_s <= 0):
        return (f"timeout_s={timeout_s!r}: must be a finite number of seconds > 0 "
                f"(default {DEFAULT_TIMEOUT_S:g})")
    return None


def _ids_in_use(path: str) -> tuple[set, dict]:
    """(ids of ``checkpoint_<id>`` entries, id -> tokens of saves in progress or left)."""
    committed, saving = set(), {}
    for name in os.listdir(path):
        uid = checkpoint_id(name)
        if uid is not None:
            committed.add(uid)
            continue
        match = _TMP.match(name)
        if match:
            saving.setdefault(int(match.group(1)), set()).add(match.group(2))
    return committed, saving


def _propose(path: str, unique_id: int | None) -> dict:
    """The coordinator's choice of id (or the error); creates the save's directory.

    With ``unique_id=None`` concurrent saves into ``path`` claim distinct ids:
    each creates its temporary directory, then yields the id (and tries the
    next) if it sees another save's directory for the same id. Of two saves
    the one that looks second always sees the first, so both never keep it.
    """
    token = uuid.uuid4().hex
    for attempt in range(1000):
        committed, saving = _ids_in_use(path)
        uid = unique_id
        if uid is None:
            uid = max(committed | set(saving), default=-1) + 1
        target = os.path.join(path, checkpoint_name(uid))
        if os.path.lexists(target):
            nxt = max(committed | set(saving), default=-1) + 1
            return {"id": uid, "token": token, "error": (
                f"{target} exists; a save never overwrites a checkpoint: pass another "
                f"unique_id (None takes the next, {nxt}) or remove it first")}
        tmp = os.path.join(path, tmp_name(uid, token))
        os.mkdir(tmp)
        if unique_id is not None or not _ids_in_use(path)[1].get(uid, set()) - {token}:
            return {"id": uid, "token": token, "error": None}
        os.rmdir(tmp)
        time.sleep(random.uniform(0.0, 0.01) * min(attempt + 1, 10))
    raise RuntimeError(f"could not claim a checkpoint id under {path} (1000 attempts)")


def _commit(handshake: SaveHandshake, statuses: dict, tmp: str, final: str,
            unique_id: int, token: str) -> None:
    """Coordinator: marker last, then the one rename."""
    metadata_file = f"{unique_id}.metadata"
    files = {}
    for rank in handshake.ranks:
        status = statuses[rank]
        files[status["file"]] = {"size": status["size"], "sha256": status["sha256"],
                                 "rank": rank}
    meta_path = os.path.join(tmp, metadata_file)
    size, digest = file_digest(meta_path)
    files[metadata_file] = {"size": size, "sha256": digest, "rank": None}
    metadata = paddle.load(meta_path)
    missing = sorted(set(metadata.storage_metadata.values()) - set(files))
    if missing:
        raise RuntimeError(f"the metadata names data files no rank reported: {missing}")
    marker = {
        "format": MARKER_FORMAT, "unique_id": unique_id, "token": token,
        "ranks": handshake.ranks, "created": time.time(), "files": files,
        "metadata_file": metadata_file, "tensors": layout_summary(metadata),
    }
    write_json_atomic(os.path.join(tmp, MARKER), marker)
    fsync_path(tmp)
    try:
        os.rename(tmp, final)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY) or os.path.lexists(final):
            raise RuntimeError(f"could not commit: {final} appeared meanwhile (another save "
                               f"of the same id?): {exc}") from None
        # not a race: the file system refused the rename (EIO, EXDEV, ...)
        raise RuntimeError(f"could not commit: renaming {tmp} to {final} failed: "
                           f"{type(exc).__name__}: {exc}") from None
    # committed: what follows must not turn the commit into a reported failure
    try:
        fsync_path(os.path.dirname(final))
    except OSError as exc:
        logger.warning(f"checkpoint: could not flush {os.path.dirname(final)}: {exc}")
    shutil.rmtree(os.path.join(final, STATUS_DIR), ignore_errors=True)


def _retain(path: str, keep_last: int, just_saved: str) -> None:
    complete = [(i, d) for i, d in committed_checkpoints(path) if incomplete_reason(d) is None]
    # never the one just committed: the other ranks may still be looking for it
    # (a concurrent save may have committed a newer id meanwhile)
    for _, directory in complete[keep_last:]:
        if directory == just_saved:
            continue
        logger.info(f"checkpoint: removing {directory} (keep_last={keep_last})")
        shutil.rmtree(directory, ignore_errors=True)


def _agree(obj: Any, process_group, ranks: list[int], what: str) -> list:
    try:
        return common.gather(obj, process_group, ranks)
    except Exception as exc:  # noqa: BLE001 - e.g. gloo's timeout: a rank is gone
        raise CheckpointSaveError(
            f"saving {what}: the ranks {ranks} could not agree before writing "
            f"({type(exc).__name__}: {one_line(exc)}); is a rank missing or not calling "
            "save_sharded_checkpoint? Nothing was committed.") from exc


def _failure_message(final: str, statuses: dict) -> str:
    failed = [s for _, s in sorted(statuses.items()) if not s.get("ok")]
    lines = [f"saving {final} failed; nothing was committed and the previous checkpoints "
             f"are untouched:"] + [f"  {s['error']}" for s in failed]
    return "\n".join(lines)


def save_sharded_checkpoint(
    state_dict: dict,
    path: str,
    process_group: Any = None,
    unique_id: int | None = None,
    keep_last: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> str:
    """Save ``state_dict`` as a new checkpoint under ``path``, all-or-nothing.

    Call it on every rank, like ``paddle.distributed.save_state_dict``; the
    files are flex_checkpoint's, in ``<path>/checkpoint_<id>/``.

    Args:
        state_dict (dict): key -> ShardedWeight or Tensor, e.g. the model's
            ``sharded_state_dict()`` updated with the optimizer's
            ``sharded_state_dict(model_sharded_state_dict)``.
        path (str): directory holding the checkpoints (created if needed).
        process_group (Group|None): the ranks saving together (default: all).
        unique_id (int|None): the checkpoint's id, a non-negative int such as
            the step; None takes the newest id under ``path`` plus one. An
            existing id is refused.
        keep_last (int|None): after the commit, keep only the newest
            ``keep_last`` complete checkpoints.
        timeout_s (float): finite, > 0: a rank that shows no sign of life this
            long during the save counts as failed (default 20: a killed rank fails the
            save on every other rank within about 21 s). Raise it where the
            file system shows other hosts' changes later (NFS attribute cache).

    Returns:
        str: the committed checkpoint directory (the same on every rank).

    Raises:
        CheckpointSaveError: on every rank, when any rank failed; the message
            names the rank and the file.
        FileExistsError: on every rank, when ``checkpoint_<unique_id>`` exists.
        ValueError: on every rank, when a rank passed a bad ``unique_id``,
            ``keep_last`` or ``timeout_s``; nothing was written.
        TypeError: on every rank, when a rank's ``path`` is no path.
    """
    rank, ranks = common.ranks_of(process_group)
    coordinator = ranks[0]
    bad_argument = (("TypeError", path_problem(path)) if path_problem(path) else
                    ("ValueError", _save_arg_problem(unique_id, keep_last, timeout_s)))
    if bad_argument[1] is None:
        bad_argument = None
    if bad_argument is None and unique_id is not None:
        unique_id = int(unique_id)  # e.g. numpy's: the marker is JSON
    # Everything that can fail before Paddle's collectives is agreed on first:
    # a rank that left early would leave the others blocked in them.
    proposal = None
    try:
        if bad_argument is None:
            check_values(state_dict)
            if rank == coordinator:
                os.makedirs(path, exist_ok=True)
                _reclaim_stale(path, timeout_s)
                proposal = _propose(path, unique_id)
                proposal["path"] = os.path.abspath(path)
        local_error = None
    except Exception as exc:  # noqa: BLE001 - reported on every rank below
        local_error = f"rank {rank}: {type(exc).__name__}: {exc}"
    failure = None
    try:
        agreed = _agree((proposal, local_error, bad_argument), process_group, ranks, path)
        errors = [e for _, e, _ in agreed if e]
        bad = [(r, b) for r, (_, _, b) in zip(ranks, agreed) if b]
    except CheckpointSaveError as exc:
        failure, errors, bad = exc, [], []
    if failure is not None or errors or bad:
        if proposal is not None and not proposal["error"]:
            shutil.rmtree(os.path.join(path, tmp_name(proposal["id"], proposal["token"])),
                          ignore_errors=True)
        if failure is not None:
            raise failure
        if bad:
            error = TypeError if any(k == "TypeError" for _, (k, _) in bad) else ValueError
            raise error(per_rank([(r, m) for r, (_, m) in bad]))
        raise CheckpointSaveError(f"saving under {path} refused; nothing was written:\n  "
                                  + "\n  ".join(errors))
    proposal = agreed[0][0]
    if proposal["error"]:
        raise FileExistsError(proposal["error"])
    uid, token = proposal["id"], proposal["token"]
    final = os.path.join(path, checkpoint_name(uid))
    tmp = os.path.join(path, tmp_name(uid, token))
    own_file = data_file(rank, uid)
    handshake = SaveHandshake(tmp, rank, ranks, timeout_s)
    try:
        try:
            handshake.start()
            start_error = None
        except FileNotFoundError:
            # the coordinator made ``tmp`` before the agreement: this rank
            # looks elsewhere (another path, a file system it does not share)
            start_error = (f"rank {rank} does not see {tmp}, which the coordinator (rank "
                           f"{coordinator}) created under path {proposal['path']!r}; rank "
                           f"{rank} passed path {os.path.abspath(path)!r}: pass the same "
                           "path on every rank, on a file system every rank sees")
            if rank == coordinator:
                start_error = (f"rank {rank} (coordinator): {tmp} was removed before the "
                               "save started (by hand, or as a stale save by another job)")
        except OSError as exc:
            start_error = (f"rank {rank} could not prepare {exc.filename or tmp}: "
                           f"{type(exc).__name__}: {exc}")
        # Every rank is still here (Paddle's collectives come next anyway): a
        # rank that cannot even reserve room for its report fails the save now.
        start_errors = [e for e in _agree(start_error, process_group, ranks, final) if e]
        if start_errors:
            if rank == coordinator:
                shutil.rmtree(tmp, ignore_errors=True)
            # the coordinator's spelling: one message on every rank
            raise CheckpointSaveError(
                f"saving {os.path.join(proposal['path'], checkpoint_name(uid))} failed; "
                "nothing was committed and the previous checkpoints are untouched:\n  "
                + "\n  ".join(start_errors))
        try:
            # every rank takes part in Paddle's collectives inside, whatever happened
            _write_shards(state_dict, tmp, process_group, uid)
            size, digest = file_digest(os.path.join(tmp, own_file))
            fsync_path(os.path.join(tmp, own_file))
        except Exception as exc:  # noqa: BLE001 - every failure is reported to all ranks
            where = os.path.basename(getattr(exc, "filename", None) or own_file)
            outcome = dict(ok=False, error=f"rank {rank} could not write {where}: "
                                           f"{type(exc).__name__}: {exc}")
        else:
            outcome = dict(ok=True, file=own_file, size=size, sha256=digest)
        try:
            handshake.report(**outcome)
        except OSError as exc:
            # the reserved room is gone (removed by hand?): the others see
            # this rank's heartbeat stop and fail the save
            handshake.stop()
            logger.error(f"checkpoint: rank {rank} could not report to {tmp}: {exc}")
        if rank == coordinator:
            message = _coordinate(handshake, tmp, final, uid, token,
                                  dict(outcome, rank=rank))
        else:
            message = handshake.wait_decision(final, token)
    finally:
        handshake.stop()
    if message is not None:
        raise CheckpointSaveError(message)
    if rank == coordinator:
        _sweep_failed(path)
        if keep_last is not None:
            _retain(path, keep_last, final)
    # committed for every rank: the coordinator says so, the others at debug
    (logger.info if rank == coordinator else logger.debug)(
        f"checkpoint: rank {rank} saved {final}")
    return final


def _coordinate(handshake: SaveHandshake, tmp: str, final: str, uid: int,
                token: str, own: dict) -> str | None:
    """Coordinator: collect outcomes, commit or publish the failure."""
    statuses = handshake.collect(lambda r: data_file(r, uid), own)
    message = None
    if all(s.get("ok") for s in statuses.values()):
        try:
            _commit(handshake, statuses, tmp, final, uid, token)
            return None
        except Exception as exc:  # noqa: BLE001
            message = (f"saving {final} failed; nothing was committed and the previous "
                       f"checkpoints are untouched:\n  rank {handshake.rank} (coordinator) "
                       f"could not commit: {type(exc).__name__}: {exc}")
    if message is None:
        message = _failure_message(final, statuses)
    readers = [r for r, s in statuses.items() if r != handshake.rank and not s.get("dead")]
    try:
        handshake.decide_failure(message, readers)
    except OSError as exc:  # the others then see this rank's heartbeat stop
        handshake.stop()
        logger.error(f"checkpoint: could not publish the failure in {tmp}: {exc}")
        return message
    handshake.wait_acks(readers)
    # Free the space now; the decision stays for a rank still to read it
    # (the next successful save sweeps it once read - maybe already, if a
    # save of another job committed meanwhile: then listing may fail).
    try:
        names = os.listdir(tmp)
    except OSError:
        names = []
    for name in names:
        if name != STATUS_DIR:
            _remove(os.path.join(tmp, name))
    return message


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.remove(path)
        except OSError:
            pass


def _reclaim_stale(path: str, timeout_s: float) -> None:
    """Coordinator, before proposing: remove temporary directories of saves
    that are over - killed without a decision (every rank, or the
    coordinator), or failed long ago."""
    horizon = max(STALE_SAVE_S, 2.0 * timeout_s)
    for name in os.listdir(path):
        if not _TMP.match(name):
            continue
        directory = os.path.join(path, name)
        newest = last_activity(directory)
        if newest is None:
            continue  # gone meanwhile
        idle = time.time() - newest
        if idle > horizon:
            logger.warning(f"checkpoint: removing {directory}: a save that never committed "
                           f"and changed nothing for {idle:.0f} s")
            shutil.rmtree(directory, ignore_errors=True)


def _sweep_failed(path: str) -> None:
    """Remove what failed saves left: a decided failure is final, once every
    live rank of that save read it (or had ``ACK_WAIT_S`` twice over to)."""
    for name in os.listdir(path):
        directory = os.path.join(path, name)
        if (name.startswith(f".{CHECKPOINT_PREFIX}") and failed_save(directory)
                and decision_read(directory, 2 * ACK_WAIT_S)):
            shutil.rmtree(directory, ignore_errors=True)


def _write_shards(state_dict: dict, directory: str, process_group, unique_id: int) -> None:
    # flex_checkpoint writes a piece several ranks hold once: copies that
    # differ would lose all but one silently (e.g. expert weights described as
    # the whole tensor on every expert-parallel rank)
    conflicts = replica_conflicts(state_dict, process_group, common.ranks_of(process_group)[1])
    if conflicts:
        raise CheckpointMismatchError(
            "refused before writing: ranks hold different values for the same checkpoint "
            "piece, and flex_checkpoint would keep one copy: " + "; ".join(conflicts)
            + " (describe each rank's part in sharded_state_dict() with its global offset, "
            "e.g. expert weights along the expert axis)")
    dist.save_state_dict(state_dict, directory, process_group=process_group,
                         unique_id=unique_id)
