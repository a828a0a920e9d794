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
"""The files of a committed checkpoint and the handshake that commits one.

A save writes into ``<path>/.checkpoint_<id>.tmp-<token>/``; the ranks agree
through small files in its ``.status/`` directory, not through collectives,
so a rank that dies mid-save cannot hang the others:

* every rank touches ``alive_<rank>`` while it works (heartbeat) and writes
  its outcome into ``rank_<rank>.json``, a file reserved *before* the shards
  are written so that a full disk still leaves room to report the failure;
* the coordinator (the group's first rank) waits for every outcome - a rank
  whose heartbeat stops for ``timeout_s`` counts as failed - then either
  writes the completion marker and renames the directory to
  ``checkpoint_<id>`` (one rename commits), or writes ``decision.json`` with
  the failure every rank then raises, and removes the shards (the decision
  stays for late readers until the next successful save sweeps it).

The completion marker ``checkpoint.complete.json`` lists every file with its
size and SHA-256 and the layout summary (key -> global shape, dtype); a
directory without a valid marker is never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from typing import Any

__all__ = [
    "CHECKPOINT_PREFIX",
    "MARKER",
    "MARKER_FORMAT",
    "STATUS_DIR",
    "SaveHandshake",
    "checkpoint_id",
    "checkpoint_name",
    "decision_read",
    "failed_save",
    "file_digest",
    "last_activity",
    "fsync_path",
    "read_marker",
    "tmp_name",
    "unlisted_problems",
    "write_json_atomic",
]

CHECKPOINT_PREFIX = "checkpoint_"
MARKER = "checkpoint.complete.json"
MARKER_FORMAT = "paddle_muon_ext.checkpoint/1"
STATUS_DIR = ".status"
DECISION = "decision.json"
#: Room reserved for a rank's outcome (a failure message is cut to fit).
RESERVED_BYTES = 16384
_MESSAGE_LIMIT = 4000
HEARTBEAT_S = 0.5
POLL_S = 0.05
#: How long the coordinator waits for live ranks to read a failure before
#: removing the temporary directory.
ACK_WAIT_S = 5.0
_CHUNK = 4 << 20
_NAME = re.compile(r"^checkpoint_(\d+)$")


def checkpoint_name(unique_id: int) -> str:
    """Directory name of committed checkpoint ``unique_id``."""
    return f"{CHECKPOINT_PREFIX}{unique_id}"


def checkpoint_id(name: str) -> int | None:
    """The id in a ``checkpoint_<id>`` directory name, else None."""
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def tmp_name(unique_id: int, token: str) -> str:
    """Directory name a save of ``unique_id`` writes into before committing."""
    return f".{CHECKPOINT_PREFIX}{unique_id}.tmp-{token}"


def file_digest(path: str) -> tuple[int, str]:
    """``(size, sha256 hex)`` of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            size += len(chunk)
            digest.update(chunk)
    return size, digest.hexdigest()


def fsync_path(path: str) -> None:
    """Flush a file or directory to stable storage (a commit must survive a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: str, data: Any) -> None:
    """Write JSON through a temporary file and a rename, then fsync it."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_marker(directory: str) -> dict:
    """The completion marker of ``directory``.

    Raises:
        ValueError: the marker is missing, unreadable or not a marker; the
            message names the file.
    """
    path = os.path.join(directory, MARKER)
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: no completion marker - the save never committed "
                         "(interrupted or failed)") from None
    except (OSError, ValueError, RecursionError) as exc:
        # RecursionError: JSON nested deeper than the parser's stack
        raise ValueError(f"{path}: completion marker unreadable ({type(exc).__name__}: "
                         f"{str(exc)[:200]})") from None
    if not isinstance(data, dict) or data.get("format") != MARKER_FORMAT:
        raise ValueError(f"{path}: not a completion marker of format {MARKER_FORMAT!r}")
    for field in ("unique_id", "files", "metadata_file", "tensors"):
        if field not in data:
            raise ValueError(f"{path}: completion marker lacks {field!r}")
    problem = _marker_shape_problem(data)
    if problem:
        raise ValueError(f"{path}: completion marker malformed: {problem}")
    return data


#: The suffixes by which Paddle's ``load_state_dict`` picks a checkpoint's
#: files for id ``<id>``: every name ending in ``<id>`` plus one of these.
PADDLE_READS = (".metadata", ".distcp", ".safetensors")


def unlisted_problems(directory: str, marker: dict) -> list[str]:
    """A line for each file of ``directory`` that Paddle's ``load_state_dict``
    of the marker's id would read but the marker does not list.

    Paddle selects the files by suffix (every name ending in ``<id>.metadata``,
    ``<id>.distcp`` or ``<id>.safetensors``, so ``10.metadata`` for id 0 too),
    not by the marker: a file whose entry was removed, or one copied in, would
    be read without a size or checksum check.
    """
    uid = marker["unique_id"]
    try:
        names = sorted(os.listdir(directory))
    except OSError as exc:
        return [f"{directory}: cannot be listed ({type(exc).__name__}: {exc})"]
    return [f"{os.path.join(directory, name)}: not listed in {MARKER}, yet "
            f"paddle.distributed.load_state_dict would read it (its name ends in "
            f"'{uid}{suffix}'), unverified: remove it if it does not belong to checkpoint "
            f"{uid}; if it does, the marker was edited: load an earlier checkpoint"
            for name in names for suffix in PADDLE_READS
            if name.endswith(f"{uid}{suffix}") and name not in marker["files"]]


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _marker_shape_problem(data: dict) -> str | None:
    """What in a parsed marker has the wrong type (the readers index it freely)."""
    if not _is_id(data["unique_id"]):
        return f"unique_id {data['unique_id']!r} is not a non-negative int"
    files, tensors = data["files"], data["tensors"]
    if not isinstance(files, dict) or not isinstance(tensors, dict):
        return "'files' and 'tensors' must be objects"
    for name, entry in files.items():
        if (os.path.basename(name) != name or name in ("", ".", "..")
                or not isinstance(entry, dict) or not _is_id(entry.get("size"))
                or not isinstance(entry.get("sha256"), str)):
            return f"file entry {name!r} is not {{size, sha256}} of a file in the directory"
    if data["metadata_file"] not in files:
        return f"metadata_file {data['metadata_file']!r} is not among the files"
    for key, entry in tensors.items():
        if (not isinstance(entry, dict) or not isinstance(entry.get("global_shape"), list)
                or not isinstance(entry.get("dtype"), str)):
            return f"tensor entry {key!r} is not {{global_shape, dtype}}"
    return None


def _read_json(path: str) -> dict | None:
    # None while the file is absent, reserved (blank) or half written
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def last_activity(directory: str) -> float | None:
    """Newest modification time (epoch seconds) of a save's temporary
    ``directory``, its entries and its status files; None once it is gone.

    A live save changes one of them at least every ``HEARTBEAT_S`` (each
    rank's heartbeat), so a long-unchanged directory is a save that is over.
    """
    try:
        newest = os.stat(directory).st_mtime
    except FileNotFoundError:
        return None
    for folder in (directory, os.path.join(directory, STATUS_DIR)):
        try:
            names = os.listdir(folder)
        except OSError:
            continue  # no status directory yet, or removed meanwhile
        for name in names:
            try:
                newest = max(newest, os.stat(os.path.join(folder, name),
                                             follow_symlinks=False).st_mtime)
            except OSError:
                continue  # removed meanwhile
    return newest


def decision_read(directory: str, max_age_s: float) -> bool:
    """Whether every reader named in ``directory``'s failure decision has
    acknowledged it, or the decision is older than ``max_age_s`` (a reader
    that has not read it by then is gone: live ranks poll every ``POLL_S``)."""
    status_dir = os.path.join(directory, STATUS_DIR)
    decision = _read_json(os.path.join(status_dir, DECISION)) or {}
    readers = decision.get("readers") or []
    if not isinstance(readers, list) or all(
            os.path.exists(os.path.join(status_dir, f"ack_{r}")) for r in readers):
        return True
    try:
        age = time.time() - os.stat(os.path.join(status_dir, DECISION)).st_mtime
    except OSError:
        return True  # gone meanwhile
    return age > max_age_s


def failed_save(directory: str) -> bool:
    """Whether the temporary ``directory`` holds a save's published failure."""
    decision = _read_json(os.path.join(directory, STATUS_DIR, DECISION))
    return decision is not None and decision.get("ok") is False


class SaveHandshake:
    """One rank's side of the file handshake of one save.

    Args:
        directory (str): the temporary directory of the save.
        rank (int): this rank (global).
        ranks (list[int]): every rank of the save; ``ranks[0]`` coordinates.
        timeout_s (float): a rank whose heartbeat stops this long has failed.
    """

    def __init__(self, directory: str, rank: int, ranks: list[int], timeout_s: float) -> None:
        self.directory = directory
        self.status_dir = os.path.join(directory, STATUS_DIR)
        self.rank = rank
        self.ranks = list(ranks)
        self.coordinator = self.ranks[0]
        self.timeout_s = float(timeout_s)
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._reserved: list[str] = []

    def _path(self, name: str) -> str:
        return os.path.join(self.status_dir, name)

    def status_path(self, rank: int) -> str:
        return self._path(f"rank_{rank}.json")

    def heartbeat_path(self, rank: int) -> str:
        return self._path(f"alive_{rank}")

    # ------------------------------------------------------------ this rank
    def start(self) -> None:
        """Create the status directory, reserve the outcome files, start beating.

        Raises:
            FileNotFoundError: the save's directory does not exist (another
                path than the coordinator's, or reclaimed); it is never
                recreated here.
        """
        try:
            os.mkdir(self.status_dir)
        except FileExistsError:
            pass  # another rank of this save made it first
        reserved = [self.status_path(self.rank)]
        if self.rank == self.coordinator:
            reserved.append(self._path(DECISION))
        for path in reserved:
            with open(path, "wb") as f:
                f.write(b" " * RESERVED_BYTES)
                f.flush()
                os.fsync(f.fileno())
        self._reserved = reserved
        open(self.heartbeat_path(self.rank), "wb").close()
        self._beat = threading.Thread(target=self._beat_loop, daemon=True,
                                      name=f"checkpoint-heartbeat-{self.rank}")
        self._beat.start()

    def _beat_loop(self) -> None:
        path = self.heartbeat_path(self.rank)
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(path)  # needs no free block, unlike a write
            except OSError:
                pass  # committed (renamed) or removed: nothing to signal

    def stop(self) -> None:
        """Stop the heartbeat (the others see this rank as gone after timeout_s)."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None

    def _write_reserved(self, path: str, data: dict) -> None:
        payload = json.dumps(data, sort_keys=True).encode("utf-8") + b"\n"
        # in place: the reserved blocks take it even on a full disk
        with open(path, "r+b") as f:
            f.write(payload)
            f.truncate(len(payload))
            f.flush()
            os.fsync(f.fileno())

    def report(self, ok: bool, **info: Any) -> None:
        """Publish this rank's outcome (``error`` is cut to fit the reserved room)."""
        if "error" in info:
            info["error"] = str(info["error"])[:_MESSAGE_LIMIT]
        self._write_reserved(self.status_path(self.rank), dict(info, ok=ok, rank=self.rank))

    # ------------------------------------------------------------ waiting
    def _wait(self, done, watched: list[int], what: str):
        """Poll ``done()`` until it returns non-None; a watched rank whose
        heartbeat stays unchanged for ``timeout_s`` ends the wait.

        Returns:
            ``(done() result, None)`` or ``(None, stale rank)``.
        """
        seen: dict[int, tuple[Any, float]] = {}
        while True:
            result = done()
            if result is not None:
                return result, None
            now = time.monotonic()
            for rank in watched:
                try:
                    stamp = os.stat(self.heartbeat_path(rank)).st_mtime_ns
                except OSError:
                    stamp = None
                if rank not in seen or seen[rank][0] != stamp:
                    seen[rank] = (stamp, now)
                elif now - seen[rank][1] > self.timeout_s:
                    result = done()  # it may have finished just before stopping
                    return (result, None) if result is not None else (None, rank)
            time.sleep(POLL_S)

    def collect(self, expected_file, own: dict) -> dict[int, dict]:
        """Every rank's outcome (coordinator; ``own`` is its own). A rank that
        stopped beating gets a failure naming ``expected_file(rank)``, the
        file it was writing."""
        statuses: dict[int, dict] = {self.rank: own}
        while True:
            pending = [r for r in self.ranks if r not in statuses]
            if not pending:
                return statuses

            def ready(pending=pending):
                for r in pending:
                    status = _read_json(self.status_path(r))
                    if status is not None:
                        statuses[r] = status
                return True if all(r in statuses for r in pending) else None

            _, stale = self._wait(ready, pending, "outcomes")
            if stale is not None:
                statuses[stale] = {
                    "ok": False, "rank": stale, "dead": True,
                    "error": (f"rank {stale} stopped responding while writing "
                              f"{expected_file(stale)} (no heartbeat for "
                              f"{self.timeout_s:g} s: killed or hung)"),
                }

    def decide_failure(self, message: str, readers: list[int] | None = None) -> None:
        """Coordinator: publish the failure every rank raises; ``readers`` are
        the live ranks still to read it (their acks let a sweep remove it)."""
        self._write_reserved(self._path(DECISION), {"ok": False, "message": message,
                                                    "readers": list(readers or [])})

    def wait_acks(self, ranks: list[int]) -> None:
        """Coordinator: give live ranks a moment to read the failure."""
        deadline = time.monotonic() + min(ACK_WAIT_S, self.timeout_s)
        while time.monotonic() < deadline:
            if all(os.path.exists(self._path(f"ack_{r}")) for r in ranks):
                return
            time.sleep(POLL_S)

    def wait_decision(self, final_dir: str, token: str) -> str | None:
        """Non-coordinator: None once ``final_dir`` holds this save's marker,
        else the failure message to raise."""
        decision_path = self._path(DECISION)

        def decided():
            marker = _read_json(os.path.join(final_dir, MARKER))
            if marker is not None and marker.get("token") == token:
                return ("committed",)
            decision = _read_json(decision_path)
            if decision is not None:
                return ("failed", str(decision.get("message")))
            return None

        result, _ = self._wait(decided, [self.coordinator], "the commit")
        if result is None:
            return (f"the coordinator, rank {self.coordinator}, stopped responding before "
                    f"committing {final_dir} (no heartbeat for {self.timeout_s:g} s: "
                    "killed or hung)")
        if result[0] == "committed":
            return None
        try:
            open(self._path(f"ack_{self.rank}"), "wb").close()
        except OSError:
            pass  # the coordinator stops waiting for acks on its own
        return result[1]
