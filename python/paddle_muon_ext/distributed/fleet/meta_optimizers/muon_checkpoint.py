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
"""Checkpoints that never lose a run: atomic saves, verified loads.

``paddle.distributed.save_state_dict`` writes shards in place (into a
directory that already holds a checkpoint too, keeping the old metadata) and
``load_state_dict`` reads whatever overlaps; a failed or partial save is
indistinguishable from a good one. Here:

* :func:`save_sharded_checkpoint` writes a new ``checkpoint_<id>`` beside the
  previous ones, all-or-nothing: every rank writes into a fresh temporary
  directory, the completion marker (per-file sizes and SHA-256, layout
  summary) is written only after every rank reported success, and one rename
  commits. A failure on any rank (exception, full disk, a killed rank) leaves
  every previous checkpoint untouched and raises the same
  :class:`CheckpointSaveError` on every rank (after at most ``timeout_s``
  when a rank died). ``keep_last`` removes older checkpoints after a commit.
* :func:`load_sharded_checkpoint` verifies the marker, the sizes, the
  checksums (spread over the ranks) and the layout before any tensor is read,
  and refuses a checkpoint of another model (:class:`CheckpointMismatchError`);
  a problem is one error on every rank, naming the file.
* :func:`latest_complete_checkpoint` finds the newest committed checkpoint.

Both calls exchange what each rank found before any rank raises, so a
problem on one rank (no checkpoint at its path, another path, a bad
argument) is one error on every rank at once, never a wait for a timeout.
The next save removes what killed saves left (:data:`STALE_SAVE_S`).

``path`` must be on a file system every rank of the save sees: once the
shards are being written the ranks agree through files there, so a rank that
dies while writing cannot hang the others. Before that, two small all_gathers
and Paddle's metadata exchange are ordinary collectives (a rank dead there
is noticed after the process group's timeout, as anywhere else).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import numbers
import os
import random
import re
import shutil
import threading
import time
import uuid
from typing import Any

import paddle
import paddle.distributed as dist
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight
from paddle.distributed.flex_checkpoint.dcp.utils import flatten_state_dict
from paddle.distributed.fleet.utils.log_util import logger

from .muon_checkpoint_commit import (
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
    read_marker,
    tmp_name,
    write_json_atomic,
)

__all__ = [
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "latest_complete_checkpoint",
    "load_sharded_checkpoint",
    "save_sharded_checkpoint",
]

_METADATA = re.compile(r"^(\d+)\.metadata$")
_TMP = re.compile(r"^\.checkpoint_(\d+)\.tmp-(\w+)$")
_LISTED = 8
#: Seconds without a heartbeat after which a rank of a save counts as dead.
DEFAULT_TIMEOUT_S = 20.0
#: A save's temporary directory unchanged this long (or twice the new save's
#: ``timeout_s``, if longer) belongs to a save that is over - killed, since a
#: live save's ranks touch their heartbeats every ``HEARTBEAT_S`` - and the
#: next save removes it. Generous: file times come from the file server's
#: clock, and another job's save may run with a longer timeout.
STALE_SAVE_S = 120.0


class CheckpointMismatchError(ValueError):
    """The checkpoint does not describe the state dict being loaded."""


class CheckpointCorruptError(ValueError):
    """A checkpoint file is missing, truncated or altered; nothing was loaded."""


class CheckpointSaveError(RuntimeError):
    """A save failed on some rank; nothing was committed."""


# Communication, looked up at call time (tests run ranks as threads).
def _ranks(process_group) -> tuple[int, list[int]]:
    if process_group is not None:
        return dist.get_rank(), list(process_group.ranks)
    return dist.get_rank(), list(range(max(dist.get_world_size(), 1)))


def _gather(obj: Any, process_group, ranks: list[int]) -> list:
    if len(ranks) == 1:
        return [obj]
    out: list = []
    dist.all_gather_object(out, obj, process_group)
    return out


def _is_id(value: Any) -> bool:
    # numpy integers count (a step counter); bools do not, although they are
    # ints (numpy's bool_ is no Integral)
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def _id_problem(unique_id: Any) -> str | None:
    if unique_id is None or _is_id(unique_id):
        return None
    return (f"unique_id={unique_id!r}: must be a non-negative int (e.g. the step) or None "
            "(the newest)")


def _path_problem(path: Any) -> str | None:
    if isinstance(path, (str, os.PathLike)) and os.fspath(path) not in ("", b""):
        return None
    return f"path={path!r}: must be a directory path (a non-empty str or os.PathLike)"


def _save_arg_problem(unique_id: Any, keep_last: Any, timeout_s: Any) -> str | None:
    """The first bad argument of a save, as one line, or None."""
    problem = _id_problem(unique_id)
    if problem:
        return problem
    if keep_last is not None and (not _is_id(keep_last) or keep_last < 1):
        return f"keep_last={keep_last!r}: must be a positive int or None (keep all)"
    if (isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real)
            or not math.isfinite(timeout_s) or timeout_s <= 0):
        return (f"timeout_s={timeout_s!r}: must be a finite number of seconds > 0 "
                f"(default {DEFAULT_TIMEOUT_S:g})")
    return None


def _per_rank(lines: list[tuple[int, str]]) -> str:
    """One message for every rank: the message itself when all ranks agree."""
    if len({m for _, m in lines}) == 1:
        rank_list = [r for r, _ in lines]
        return lines[0][1] if len(rank_list) == 1 else f"{lines[0][1]} (ranks {rank_list})"
    return "; ".join(f"rank {r}: {m}" for r, m in lines)


_cuda_lock = threading.Lock()
_cuda_users = 0
_cuda_saved: list = []


def _stay_on_cpu(self, *args: Any, **kwargs: Any):
    return self


def _needs_cpu_resharding() -> bool:
    if not paddle.is_compiled_with_cuda():
        return True
    try:
        return paddle.device.cuda.device_count() == 0
    except Exception:  # noqa: BLE001 - no driver: no GPU either
        return True


@contextlib.contextmanager
def _cpu_resharding():
    """Let flex_checkpoint's resharding run where there is no GPU.

    Paddle 3.3's resharding communicators copy every tensor they send or
    receive with ``Tensor.cuda()``, which raises on a CPU-only build; gloo
    communicates CPU tensors, so there the copy is the tensor itself. Only
    for the duration of this package's own load call, and only without a
    GPU, ``Tensor.cuda`` returns the tensor unchanged (the original is put
    back afterwards, also when the load raises). Elsewhere nothing changes.
    """
    global _cuda_users
    if not _needs_cpu_resharding():
        yield
        return
    with _cuda_lock:
        if _cuda_users == 0:
            _cuda_saved[:] = [paddle.Tensor.__dict__.get("cuda", None)]
            paddle.Tensor.cuda = _stay_on_cpu
        _cuda_users += 1
    try:
        yield
    finally:
        with _cuda_lock:
            _cuda_users -= 1
            if _cuda_users == 0:
                original = _cuda_saved.pop()
                if original is None:
                    del paddle.Tensor.cuda
                else:
                    paddle.Tensor.cuda = original


def _write_shards(state_dict: dict, directory: str, process_group, unique_id: int) -> None:
    dist.save_state_dict(state_dict, directory, process_group=process_group,
                         unique_id=unique_id)


def _read_shards(state_dict: dict, directory: str, process_group, unique_id: int,
                 **load_kwargs: Any) -> None:
    with _cpu_resharding():
        dist.load_state_dict(state_dict, directory, process_group=process_group,
                             unique_id=unique_id, **load_kwargs)


def _data_file(rank: int, unique_id: int) -> str:
    return f"{rank}_{unique_id}.distcp"


# ---------------------------------------------------------------- listing
def _committed(path: str) -> list[tuple[int, str]]:
    """``(id, directory)`` of every ``checkpoint_<id>`` under ``path``, newest first."""
    try:
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = [(checkpoint_id(n), os.path.join(path, n)) for n in names]
    return sorted(((i, d) for i, d in found if i is not None), reverse=True)


def _id_mismatch(directory: str, marker: dict, expected: int | None) -> str | None:
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


def _incomplete_reason(directory: str, verify: bool = False) -> str | None:
    """Why ``directory`` is not a complete checkpoint, or None (marker, id,
    sizes; with ``verify`` also checksums)."""
    try:
        marker = read_marker(directory)
    except ValueError as exc:
        return str(exc)
    mismatch = _id_mismatch(directory, marker, None)
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
    return None


def _newest_complete(path: str, verify: bool) -> tuple[str | None, list[str]]:
    """(newest complete checkpoint or None, why each newer one was skipped)."""
    skipped = []
    for _, directory in _committed(path):
        try:
            reason = _incomplete_reason(directory, verify)
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
    a file missing or of the wrong size, is skipped with a warning saying
    why, and so are saves that never committed. Checksums are checked on
    load, or here with ``verify=True`` (this process reads every file it
    considers).

    Args:
        path (str): the directory :func:`save_sharded_checkpoint` saved into.
        verify (bool): also skip checkpoints whose files fail their SHA-256.

    Returns:
        str|None: e.g. ``"<path>/checkpoint_7"``.
    """
    problem = _path_problem(path)
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
    latest, skipped = _newest_complete(path, verify)
    for line in skipped:
        logger.warning(f"checkpoint: {line}")
    return latest


# ---------------------------------------------------------------- saving
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


def _layout_summary(metadata) -> dict:
    summary = {}
    for key, entries in sorted(metadata.state_dict_metadata.items()):
        first = entries[0]
        summary[key] = {"global_shape": list(first.global_shape or first.local_shape),
                        "dtype": str(first.dtype)}
    return summary


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
        "metadata_file": metadata_file, "tensors": _layout_summary(metadata),
    }
    write_json_atomic(os.path.join(tmp, MARKER), marker)
    fsync_path(tmp)
    try:
        os.rename(tmp, final)
    except OSError as exc:
        raise RuntimeError(f"could not commit: {final} appeared meanwhile (another save of "
                           f"the same id?): {exc}") from None
    # committed: what follows must not turn the commit into a reported failure
    try:
        fsync_path(os.path.dirname(final))
    except OSError as exc:
        logger.warning(f"checkpoint: could not flush {os.path.dirname(final)}: {exc}")
    shutil.rmtree(os.path.join(final, STATUS_DIR), ignore_errors=True)


def _retain(path: str, keep_last: int, just_saved: str) -> None:
    complete = [(i, d) for i, d in _committed(path) if _incomplete_reason(d) is None]
    # never the one just committed: the other ranks may still be looking for it
    # (a concurrent save may have committed a newer id meanwhile)
    for _, directory in complete[keep_last:]:
        if directory == just_saved:
            continue
        logger.info(f"checkpoint: removing {directory} (keep_last={keep_last})")
        shutil.rmtree(directory, ignore_errors=True)


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """A backend's error text as one bounded line (gloo's can span many)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + " ..."


def _agree(obj: Any, process_group, ranks: list[int], what: str) -> list:
    try:
        return _gather(obj, process_group, ranks)
    except Exception as exc:  # noqa: BLE001 - e.g. gloo's timeout: a rank is gone
        raise CheckpointSaveError(
            f"saving {what}: the ranks {ranks} could not agree before writing "
            f"({type(exc).__name__}: {_one_line(exc)}); is a rank missing or not calling "
            "save_sharded_checkpoint? Nothing was committed.") from exc


def _check_values(state_dict: dict) -> None:
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    for key, value in state_dict.items():
        if not isinstance(key, str):
            raise TypeError(f"state_dict key {key!r} is a {type(key).__name__}; keys are str")
        if isinstance(value, dict):
            _check_values(value)
        elif not isinstance(value, (paddle.Tensor, ShardedWeight)):
            raise TypeError(f"state_dict[{key!r}] is a {type(value).__name__}; save "
                            "Tensors or ShardedWeights (sharded_state_dict())")


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
    rank, ranks = _ranks(process_group)
    coordinator = ranks[0]
    bad_argument = (("TypeError", _path_problem(path)) if _path_problem(path) else
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
            _check_values(state_dict)
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
            raise error(_per_rank([(r, m) for r, (_, m) in bad]))
        raise CheckpointSaveError(f"saving under {path} refused; nothing was written:\n  "
                                  + "\n  ".join(errors))
    proposal = agreed[0][0]
    if proposal["error"]:
        raise FileExistsError(proposal["error"])
    uid, token = proposal["id"], proposal["token"]
    final = os.path.join(path, checkpoint_name(uid))
    tmp = os.path.join(path, tmp_name(uid, token))
    own_file = _data_file(rank, uid)
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
    logger.info(f"checkpoint: rank {rank} saved {final}")
    return final


def _coordinate(handshake: SaveHandshake, tmp: str, final: str, uid: int,
                token: str, own: dict) -> str | None:
    """Coordinator: collect outcomes, commit or publish the failure."""
    statuses = handshake.collect(lambda r: _data_file(r, uid), own)
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


# ---------------------------------------------------------------- loading
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
    committed = _committed(path)
    if committed:
        if unique_id is not None:
            directory = os.path.join(path, checkpoint_name(unique_id))
            if not os.path.isdir(directory):
                raise FileNotFoundError(
                    f"{directory} does not exist (ids there: {sorted(i for i, _ in committed)})")
            return directory, True
        latest, skipped = _newest_complete(path, verify=False)
        if latest is None:
            more = (f"\n  ... and {len(skipped) - _LISTED} more" if len(skipped) > _LISTED
                    else "")
            raise FileNotFoundError(
                f"no complete checkpoint under {path}; every checkpoint_<id> there was "
                "skipped:\n  " + "\n  ".join(skipped[:_LISTED]) + more)
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


def _listed(keys) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - _LISTED} more" if len(keys) > _LISTED else ""
    return ", ".join(keys[:_LISTED]) + more


def _local_problems(state_dict: dict, saved: dict) -> list[str]:
    """Keys, global shapes and dtypes of this rank's ``state_dict`` against
    the checkpoint's ``saved`` (key -> (global shape, dtype)). Values are
    never converted: a float32 checkpoint read into float64 tensors would
    not be the saved numbers."""
    problems = []
    missing = [k for k in state_dict if k not in saved]
    if missing:
        problems.append(f"not in the checkpoint: {_listed(missing)}")
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
    mismatch = _id_mismatch(directory, marker, expected_id)
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
    if not problems:
        # the marker's layout summary must describe the metadata it vouches for
        meta_path = os.path.join(directory, marker["metadata_file"])
        summary = _layout_summary(paddle.load(meta_path))
        if summary != marker["tensors"]:
            changed = sorted(k for k in set(summary) | set(marker["tensors"])
                             if summary.get(k) != marker["tensors"].get(k))
            problems.append(f"{os.path.join(directory, MARKER)}: layout summary differs from "
                            f"{meta_path} for {_listed(changed)}")
    return marker, problems


def _flat_state(state_dict: Any) -> dict:
    """``state_dict`` with nested dicts flattened as flex_checkpoint names
    them (``{"model": {"w": t}}`` -> ``{"model.w": t}``).

    Raises:
        TypeError: a value that is no Tensor / ShardedWeight, a key no str.
    """
    _check_values(state_dict)
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
    problem = _path_problem(path)
    if problem:
        return "TypeError", problem
    problem = _id_problem(unique_id) or (
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


def _inspect(state_dict: dict, path: str, unique_id: Any, rank: int,
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
    :func:`_cpu_resharding`).

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
    """
    rank, ranks = _ranks(process_group)
    index = ranks.index(rank) if rank in ranks else 0
    kind, refusal = _load_refusal(state_dict, path, unique_id, strict, load_kwargs)
    if refusal is None:
        flat = _flat_state(state_dict)
        mine = _inspect(flat, os.fspath(path), unique_id, rank, index, len(ranks))
    else:
        mine = {"rank": rank, "refused": (kind, refusal)}
    try:
        reports = _gather(mine, process_group, ranks)
    except Exception as exc:  # noqa: BLE001 - e.g. gloo's timeout: a rank is gone
        raise RuntimeError(
            f"loading {path}: the ranks {ranks} could not exchange their checks "
            f"({type(exc).__name__}: {_one_line(exc)}); is a rank missing or not calling "
            "load_sharded_checkpoint? Nothing was read.") from exc
    refused = [(r["rank"], r["refused"]) for r in reports if r["refused"]]
    if refused:
        error = TypeError if any(k == "TypeError" for _, (k, _) in refused) else ValueError
        raise error(_per_rank([(r, m) for r, (_, m) in refused]))
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
    if len({r["identity"] for r in reports}) > 1 or len({r["directory"] for r in reports}) > 1:
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
            problems.append(f"in the checkpoint but loaded by no rank: {_listed(unexpected)}")
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {directory} (id {uid}) does not match the state dict being "
            "loaded - was it saved from another model or optimizer "
            "configuration?\n  " + "\n  ".join(problems) + "\nLoad it into the "
            "model and optimizer that saved it (same parameters, dtypes, master weights "
            "on or off alike); strict=False ignores checkpoint keys nobody loads."
        )
    # flat: the checks' keys are the keys loaded (in place, nested or not)
    _read_shards(flat, directory, process_group, uid, **load_kwargs)
    return directory
