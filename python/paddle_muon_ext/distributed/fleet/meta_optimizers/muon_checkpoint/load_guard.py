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
"""The ranks agree on the outcome of Paddle's own load, through files.

Every check of ``load_sharded_checkpoint`` runs before Paddle's
``load_state_dict``; what fails inside it (a shard this rank cannot read, a
memory error, Paddle's resharding refusing a layout) fails on one rank only,
while the others wait in Paddle's collectives for a peer that will never
come - or, when it failed after the last collective, go on with a job in
which one rank holds nothing. So while Paddle's load runs, each rank's main
thread supervises it: the load itself runs in a helper thread, and the ranks
exchange their outcomes as small files in ``<root>/.muon_load-<token>/``
(``<root>``: the directory holding the checkpoint, which saves write to
anyway), never through a collective that could be blocked:

* a rank whose load raised writes its error; every rank - also one still
  blocked in Paddle's collectives - raises the same
  :class:`~.common.CheckpointLoadError` naming that rank, the
  checkpoint and the error, within a poll (``POLL_S``);
* a rank returns only once every rank reported success, so nobody trains on
  with a rank that loaded nothing;
* a rank that stops beating for ``timeout_s`` (killed, or frozen) fails the
  load on every other rank, naming it (and the verdict is published, so the
  rank fails too should it only have been frozen); a rank whose process is
  gone from this host (each rank records its host and pid in its ``alive``
  file) is named at once;
* a rank whose own load raised while a peer has not reported yet first makes
  sure that peer is alive (its heartbeat moves): a peer killed inside Paddle's
  collectives makes the survivor's collectives fail too, and the dead peer,
  not the survivor, is the one named (the survivor's own error follows).

A rank still blocked in Paddle's collectives when the error is raised leaves
its helper thread there (it ends when the peers' processes do): the process
group cannot be used again, and the message says to end the job. The files
are removed once every rank decided; what a killed load left is removed by the
next load at once when every rank it records ran on this host and its process
is gone, else (a rank on another host, whose pid cannot be checked from here)
after ``STALE_S``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable

from paddle.distributed.fleet.utils.log_util import logger

from .commit import last_activity
from .common import CheckpointLoadError, one_line

__all__ = ["GUARD_PREFIX", "LoadGuard", "host_key", "owner_gone", "owner_record"]

GUARD_PREFIX = ".muon_load-"
HEARTBEAT_S = 0.5
POLL_S = 0.05
#: A guard directory unchanged this long belongs to a load that is over.
STALE_S = 120.0
#: bytes reserved per rank for its outcome (an error is cut to fit)
_RESERVED = 8192


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def host_key() -> str:
    """Where a recorded pid means this process table: the host name, its boot
    and this PID namespace (containers sharing a host name and a file system
    but not their processes get different keys)."""
    parts = [socket.gethostname(), _read_text("/proc/sys/kernel/random/boot_id") or ""]
    try:
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        parts.append("")
    return "|".join(parts)


def _proc_start(pid: int) -> str | None:
    """Start time (clock ticks since boot) of ``pid``, None when it is gone
    or a zombie (killed, not yet reaped), "" where there is no ``/proc``."""
    stat = _read_text(f"/proc/{pid}/stat")
    if stat is None:
        return "" if not os.path.isdir("/proc/self") else None
    fields = stat[stat.rfind(")") + 2:].split()
    if not fields or fields[0] in ("Z", "X"):
        return None
    return fields[19] if len(fields) > 19 else ""


def owner_record() -> dict:
    """This process, as a guard file records it."""
    return {"host": host_key(), "pid": os.getpid(), "start": _proc_start(os.getpid())}


def owner_gone(record: object) -> bool:
    """Whether the process ``record`` names is certainly gone: recorded on this
    host and no longer running (also when its pid now belongs to another
    process: the start time differs). False when unsure (another host, a
    malformed record)."""
    if not isinstance(record, dict) or record.get("host") != host_key():
        return False
    pid, start = record.get("pid"), record.get("start")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    now = _proc_start(pid)
    if now == "":  # no /proc: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False
    return now is None or (bool(start) and now != start)


def _pad(encoded: bytes) -> bytes:
    """``encoded`` padded with spaces to the reserved size (JSON ignores them)."""
    return encoded + b" " * max(0, _RESERVED - len(encoded))


class LoadGuard:
    """One rank's side of the outcome exchange of one load.

    Args:
        root (str): where the guard directory goes (every rank sees it).
        token (str): names this load; the same on every rank.
        rank (int): this rank (global).
        ranks (list[int]): every rank of the load.
        directory (str): the checkpoint being loaded (for messages).
        timeout_s (float): a rank whose heartbeat stops this long has failed.
    """

    def __init__(self, root: str, token: str, rank: int, ranks: list[int], directory: str,
                 timeout_s: float) -> None:
        self.path = os.path.join(root, f"{GUARD_PREFIX}{token}")
        self.rank = rank
        self.ranks = list(ranks)
        self.directory = directory
        self.timeout_s = float(timeout_s)
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        #: ranks this rank found dead: they never decide, the files go without them
        self._dead: set[int] = set()
        #: rank -> its ``alive`` file's owner record, once read
        self._owners: dict[int, object] = {}

    def _file(self, kind: str, rank: int) -> str:
        return os.path.join(self.path, f"{kind}_{rank}")

    def start(self) -> None:
        """Create the guard directory, reserve this rank's files, start the heartbeat.

        Everything this rank will write later is allocated here: the outcome
        is written in place into a reserved ``slot_<rank>`` and renamed, and
        ``pending_<rank>`` is renamed to ``decided_<rank>``; neither needs a
        new block, so a load still agrees on a disk that a failed save (or
        anything else) filled meanwhile.

        Raises:
            OSError: the directory or the reservation cannot be made (the
                ranks then agree to load unsupervised).
        """
        _sweep_stale(os.path.dirname(self.path))
        os.makedirs(self.path, exist_ok=True)
        with open(self._file("slot", self.rank), "wb") as f:
            f.write(_pad(json.dumps({"pending": True}).encode()))
        open(self._file("pending", self.rank), "wb").close()
        with open(self._file("alive", self.rank), "w", encoding="utf-8") as f:
            json.dump(owner_record(), f)  # a later load reclaims it once this process is gone
        self._beat = threading.Thread(target=self._beat_loop, daemon=True,
                                      name=f"checkpoint-load-heartbeat-{self.rank}")
        self._beat.start()

    def abandon(self) -> None:
        """Remove this rank's reserved files (the ranks load unsupervised)."""
        self._stop.set()
        for kind in ("slot", "pending", "alive"):
            try:
                os.remove(self._file(kind, self.rank))
            except OSError:
                pass
        try:
            os.rmdir(self.path)  # the last rank to leave removes the directory
        except OSError:
            pass

    def _beat_loop(self) -> None:
        path = self._file("alive", self.rank)
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(path)
            except OSError:
                pass  # removed: the load is decided

    def run(self, load: Callable[[], None]) -> None:
        """Run ``load`` in a helper thread; return once every rank loaded.

        Raises:
            CheckpointLoadError: on every rank, when any rank's load raised or
                a rank stopped responding; names the ranks and the checkpoint.
        """
        box: dict = {}
        finished = threading.Event()

        def target() -> None:
            try:
                load()
            except BaseException as exc:  # noqa: BLE001 - reported to every rank
                box["error"] = exc
            finally:
                finished.set()

        helper = threading.Thread(target=target, daemon=True,
                                  name=f"checkpoint-load-{self.rank}")
        helper.start()
        message = None
        try:
            message = self._decide(finished, box)
        finally:
            self._stop.set()
            self._done(wait=message is None and finished.is_set())
        if message is not None:
            blocked = not finished.is_set()
            raise CheckpointLoadError(message + (
                f"\nRank {self.rank}'s own read is still blocked in Paddle's collectives: "
                "the process group cannot be used again; end the job and restart it."
                if blocked else "")) from box.get("error")

    def _decide(self, finished: threading.Event, box: dict) -> str | None:
        reported = False
        seen: dict[int, tuple] = {}
        #: this rank's own error, held back until every pending peer is known alive
        own: str | None = None
        #: peers whose heartbeat moved since this rank's own load raised
        moved: set[int] = set()
        while True:
            outcomes = {r: self._read(r) for r in self.ranks}
            failed = sorted({(o.get("blame", r), o["error"]) for r, o in outcomes.items()
                             if o is not None and o.get("error")})
            if failed:
                return self._message(failed)
            if all(o is not None for o in outcomes.values()):
                return None
            now = time.monotonic()
            pending = [r for r in self.ranks if outcomes[r] is None and r != self.rank]
            done = finished.is_set()  # once, so that the two uses below agree
            if own is None and done and box.get("error") is not None:
                # A peer killed inside Paddle's collectives fails this rank's
                # read as well: reported only once every pending peer showed
                # it is alive, so that a dead peer, not this rank, is named.
                error = box["error"]
                own = f"{type(error).__name__}: {one_line(error, 1000)}"
            for r in pending:
                if owner_gone(self._owner(r)):
                    record = self._owners[r]
                    return self._found_dead(r, f"killed: its process (pid {record['pid']}, "
                                               "this host) is gone", own)
                try:
                    stamp = os.stat(self._file("alive", r)).st_mtime_ns
                except OSError:
                    stamp = None
                if r not in seen or seen[r][0] != stamp:
                    if r in seen and own is not None:
                        moved.add(r)
                    seen[r] = (stamp, now)
                elif now - seen[r][1] > self.timeout_s:
                    return self._found_dead(r, f"stopped responding (no heartbeat for "
                                               f"{self.timeout_s:g} s: killed or hung)", own)
            if done and not reported:
                if own is None:
                    self._report(None)
                    reported = True
                elif all(r in moved for r in pending):
                    self._report(own)
                    reported = True
            time.sleep(POLL_S)

    def _owner(self, rank: int) -> object:
        """``rank``'s owner record (None until its ``alive`` file holds one)."""
        if self._owners.get(rank) is None:
            try:
                with open(self._file("alive", rank), encoding="utf-8") as f:
                    self._owners[rank] = json.load(f)
            except (OSError, ValueError):
                return None
        return self._owners[rank]

    def _found_dead(self, rank: int, error: str, own: str | None) -> str:
        """Publish that ``rank`` is dead (so that a rank only frozen for a while
        fails too) and return the message naming it."""
        self._report(error, blame=rank)
        self._dead.add(rank)
        message = self._message([(rank, error)])
        if own is not None:
            message += f"\n  (rank {self.rank}'s own read failed with it: {own})"
        return message

    def _message(self, failed: list[tuple[int, str]]) -> str:
        ranks = [r for r, _ in failed]
        return (f"loading {self.directory} failed inside paddle.distributed.load_state_dict "
                f"on rank(s) {ranks}; every rank stops here, and the tensors being "
                "loaded may hold part of the checkpoint: load again:\n  " + "\n  ".join(f"rank {r}: {m}" for r, m in failed))

    def _report(self, error: str | None, blame: int | None = None) -> None:
        """Write the outcome into the reserved slot (in place: no new block
        on a full disk), then publish it with a rename."""
        blame = self.rank if blame is None else blame
        data = {"rank": self.rank, "error": error, "blame": blame}
        encoded = json.dumps(data).encode()
        if error is not None and len(encoded) > _RESERVED:
            data["error"] = error[:_RESERVED // 8] + " ..."
            encoded = json.dumps(data).encode()
        slot, outcome = self._file("slot", self.rank), self._file("outcome", self.rank)
        try:
            target = slot if os.path.exists(slot) else outcome
            with open(target, "r+b") as f:
                f.write(_pad(encoded))
            if target == slot:
                os.replace(slot, outcome)
        except OSError as exc:  # the others see this rank's heartbeat stop
            self._stop.set()
            logger.error(f"checkpoint: rank {self.rank} could not report its load to "
                         f"{self.path}: {exc}")

    def _read(self, rank: int) -> dict | None:
        try:
            with open(self._file("outcome", rank), encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) and not data.get("pending") else None

    def _done(self, wait: bool) -> None:
        """Mark this rank decided; the files go once every rank decided.

        After a success (``wait``) every rank waits for the others to decide
        and removes the directory itself, so that none returns while it is
        still there; after a failure the last rank to decide removes it, not
        waiting for ranks it found dead (what is left: a later load, once stale).
        """
        deadline = time.monotonic() + self.timeout_s
        try:
            try:
                os.replace(self._file("pending", self.rank), self._file("decided", self.rank))
            except FileNotFoundError:
                open(self._file("decided", self.rank), "wb").close()
        except OSError:
            pass  # the directory is gone: another rank removed it
        while os.path.isdir(self.path):
            if all(r in self._dead or os.path.exists(self._file("decided", r))
                   for r in self.ranks):
                _remove_guard_dir(self.path, self.rank)
                return
            if not wait or time.monotonic() > deadline:
                return
            time.sleep(POLL_S)
        # Another rank renamed it away; after a success return only once its
        # removal is complete, so no rank sees guard files after its load.
        while wait and _removal_pending(self.path) and time.monotonic() < deadline:
            time.sleep(POLL_S)


def _remove_guard_dir(path: str, rank: int) -> None:
    """Remove a guard directory in one step for every other rank.

    ``rmtree`` alone lists, deletes, then removes the directory: a rank still
    writing its ``decided`` file in between (one found dead, or slow) made the
    last step fail and left the directory behind. Renamed away first, the
    directory is gone at once; a late write then fails (the rank is done), and
    an interrupted clean-up keeps the prefix, so a later load sweeps it.
    """
    gone = f"{path}.gone-{rank}-{os.getpid()}-{threading.get_ident()}"
    try:
        os.rename(path, gone)
    except OSError:
        return  # another rank removed it first
    shutil.rmtree(gone, ignore_errors=True)


def _removal_pending(path: str) -> bool:
    """Whether a renamed-away copy of the guard ``path`` is still being removed."""
    root, base = os.path.split(path)
    try:
        return any(n.startswith(f"{base}.gone-") for n in os.listdir(root))
    except OSError:
        return False


def _owners_gone(path: str) -> bool:
    """Whether the guard directory ``path`` records at least one rank and every
    rank it records ran on this host and its process is gone."""
    try:
        names = [n for n in os.listdir(path) if n.startswith("alive_")]
    except OSError:
        return False
    records = []
    for name in names:
        try:
            with open(os.path.join(path, name), encoding="utf-8") as f:
                records.append(json.load(f))
        except (OSError, ValueError):
            return False  # being written, or not a record: leave it to the lease
    return bool(records) and all(owner_gone(r) for r in records)


def _sweep_stale(root: str) -> None:
    try:
        names = [n for n in os.listdir(root) if n.startswith(GUARD_PREFIX)]
    except OSError:
        return
    for name in names:
        path = os.path.join(root, name)
        if _owners_gone(path):
            shutil.rmtree(path, ignore_errors=True)
            continue
        newest = last_activity(path)
        if newest is not None and time.time() - newest > STALE_S:
            shutil.rmtree(path, ignore_errors=True)
