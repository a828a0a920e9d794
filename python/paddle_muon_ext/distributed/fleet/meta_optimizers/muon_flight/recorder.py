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
"""Flight recorder for the collectives of the Muon sharding optimizer.

Every rank keeps its last N collectives (sequence number, per-group sequence
number, phase, op, group, root, dtype, numel, start/finish time) in a ring
buffer. When a job hangs, the dumps of all ranks say who waits for whom:
``paddle-muon-ext hangs LOG_DIR`` names the rank the others wait for and the
collective they are stuck before or in (:func:`diagnose`).

Recording is on by default and costs a list append per collective; it
installs nothing. The dump triggers below that need process-wide hooks (an
``sys.excepthook``, a SIGUSR1 handler, the watchdog thread) are installed only
when the user arms them: ``PADDLE_MUON_FLIGHT_RECORDER_ARM=1`` (armed at the
first collective the main thread records) or :func:`arm` (at once); :func:`disarm` restores
the previous hooks. A collective that raises dumps whether armed or not.

A dump (JSON, ``muon_flight_rank<R>.json``) is written to
``PADDLE_MUON_FLIGHT_DIR``, else to the launcher's ``PADDLE_LOG_DIR``. The
first dump of a stall is kept: while the collective that was oldest in flight
at that dump has not finished (or, with none in flight, while no collective
was issued since), later dumps of the process (the gloo timeout, the
exception hook, a peer's request) go beside it as ``muon_flight_rank<R>.<n>.json``
(n = 2 .. :data:`MAX_DUMPS_PER_STALL`; past it the last one is rewritten).
A dump of a new stall replaces the first and removes the process's later
ones. Dumps are written:

* when a collective raises (gloo's timeout, a broken peer);
* armed: when an uncaught exception ends the process;
* armed: when a collective stays in flight longer than
  ``PADDLE_MUON_FLIGHT_TIMEOUT`` seconds (watchdog thread, default 600);
* armed: on ``SIGUSR1``, also while the main thread is blocked in a
  collective (the watchdog reads Python's signal wake-up fd, when no one else
  owns it);
* armed: when a peer asks for it: a rank that dumps for a timeout or an
  exception leaves ``muon_flight.request`` in the directory and every rank's
  watchdog dumps too, so the rank that is *not* in a collective is recorded
  as well.

Every dump also holds the Python stacks of the process's threads (``stacks``:
the thread in the oldest unfinished collective first, then the main thread;
at most :data:`~.stacks.STACK_FRAMES` innermost frames each), read with
``sys._current_frames()`` when the dump is written: nothing is installed for
it, and ``hangs`` shows the stuck rank's stack. A dump taken for an
exception (the exception hook, a collective that raised) holds, for the
thread that handles it, where the exception was raised.

``PADDLE_MUON_FLIGHT_RECORDER=0`` turns recording off;
``PADDLE_MUON_FLIGHT_ENTRIES`` sets N (default 2048). The same approach as
PyTorch's NCCL flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``).

This module records and dumps; the dump format and :func:`diagnose` live in
``diagnosis`` (no paddle needed: the ``hangs`` tool reads dumps
anywhere), the stacks in ``stacks``, the checks of the
environment variables in ``fleet/utils/env_util``.
"""

from __future__ import annotations

import collections
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Any, Iterable, Mapping

from ...utils.env_util import env_positive
from .diagnosis import DUMP_FORMAT, DUMP_PREFIX, FIELDS, RankState, diagnose
from .stacks import thread_stacks


def _logger():
    # Imported when first needed: the ``hangs`` tool reads dumps without paddle.
    from paddle.distributed.fleet.utils.log_util import logger

    return logger

__all__ = [
    "FlightRecorder",
    "RankState",
    "arm",
    "disarm",
    "diagnose",
    "dump_path",
    "get_flight_recorder",
    "phase_of_thread",
    "thread_stacks",
]

ENV_ENABLE = "PADDLE_MUON_FLIGHT_RECORDER"
ENV_ARM = "PADDLE_MUON_FLIGHT_RECORDER_ARM"
ENV_ENTRIES = "PADDLE_MUON_FLIGHT_ENTRIES"
ENV_DIR = "PADDLE_MUON_FLIGHT_DIR"
ENV_TIMEOUT = "PADDLE_MUON_FLIGHT_TIMEOUT"
LAUNCHER_LOG_DIR_ENV = "PADDLE_LOG_DIR"
REQUEST_FILE = "muon_flight.request"
DEFAULT_ENTRIES = 2048
DEFAULT_TIMEOUT_S = 600.0
#: Dump files one stall may have per rank: the first, then ``.2`` up to this.
MAX_DUMPS_PER_STALL = 9
_POLL_S = 1.0
_SEQ, _GSEQ, _PHASE, _OP, _GID, _RANKS, _ROOT, _DTYPE, _NUMEL, _START, _FINISH = range(11)
# After FIELDS (not dumped as a field): the thread that issued the collective,
# so a dump's stacks can name the thread blocked in it.
_THREAD = 11

# Phase per thread, readable from the watchdog thread (a thread-local is not).
_PHASES: dict[int, str] = {}


def enter_phase(label: str) -> str | None:
    """Make ``label`` the calling thread's phase; returns the previous one."""
    ident = threading.get_ident()
    previous = _PHASES.get(ident)
    _PHASES[ident] = label
    return previous


def exit_phase(previous: str | None) -> None:
    """Restore the phase :func:`enter_phase` returned."""
    ident = threading.get_ident()
    if previous is None:
        _PHASES.pop(ident, None)
    else:
        _PHASES[ident] = previous


def phase_of_thread(ident: int | None = None) -> str | None:
    """The phase thread ``ident`` (default: the calling thread) is in, or None."""
    return _PHASES.get(threading.get_ident() if ident is None else ident)


def _env_flag(name: str, default: str) -> bool:
    """A 0/1 switch; anything else is refused rather than read as on or off."""
    raw = os.environ.get(name, default).strip()
    if raw not in ("", "0", "1"):
        raise ValueError(
            f"{name}={raw!r}: must be 1 (on) or 0 (off); unset it for the default {default}"
        )
    return raw == "1" if raw else default == "1"


def _launcher_count(name: str) -> int:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw.isdigit() else 0


def dump_dir() -> str | None:
    """Where dumps go: ``PADDLE_MUON_FLIGHT_DIR``, else the launcher's log dir."""
    return os.environ.get(ENV_DIR) or os.environ.get(LAUNCHER_LOG_DIR_ENV) or None


def dump_path(directory: str, rank: int, number: int = 1) -> str:
    """File name of ``rank``'s dump inside ``directory``: the first dump of a
    stall (``number`` 1), or its ``number``-th (``muon_flight_rank<R>.<n>.json``)."""
    suffix = "" if number == 1 else f".{number}"
    return os.path.join(directory, f"{DUMP_PREFIX}{rank}{suffix}.json")


def _own_rank() -> int:
    env = os.environ.get("PADDLE_TRAINER_ID")
    if env is not None and env.isdigit():
        return int(env)
    try:
        import paddle.distributed as dist

        return int(dist.get_rank())
    except Exception:  # noqa: BLE001 - a dump must not fail for want of a rank
        return -1


class FlightRecorder:
    """Ring buffer of this process's optimizer collectives, plus dump triggers.

    Args:
        capacity (int|None): entries kept (default ``PADDLE_MUON_FLIGHT_ENTRIES``
            or 2048).
        enabled (bool|None): record at all (default: unless
            ``PADDLE_MUON_FLIGHT_RECORDER=0``).
    """

    def __init__(self, capacity: int | None = None, enabled: bool | None = None) -> None:
        self.enabled = (
            _env_flag(ENV_ENABLE, "1") if enabled is None else enabled
        )
        self.capacity = capacity or env_positive(ENV_ENTRIES, DEFAULT_ENTRIES, int)
        self.timeout_s = env_positive(ENV_TIMEOUT, DEFAULT_TIMEOUT_S, float)
        self._entries: collections.deque = collections.deque(maxlen=self.capacity)
        self._in_flight: dict[int, list] = {}
        self._issued: dict[tuple, int] = {}
        self._seq = 0
        self._lock = threading.Lock()
        self._armed = False
        # the env var arms once, at the first collective; disarm() sticks
        self._arm_from_env = _env_flag(ENV_ARM, "0")
        self._watchdog: threading.Thread | None = None
        self._timed_out_seq = -1
        self._request_seen = 0.0
        self._wakeup: tuple[int, int] | None = None
        self._stop = threading.Event()
        self._previous_hook = None
        self._excepthook = None
        self._sigusr1_dumped = 0.0
        self.dumps = 0
        # The stall the first dump file holds: (directory, rank, oldest seq in
        # flight or None, collectives issued); the paths of its later dumps.
        # Reentrant: a SIGUSR1 handler may dump while the main thread dumps.
        self._stall: tuple | None = None
        self._later: list[str] = []
        self._name_lock = threading.RLock()

    # ------------------------------------------------------------ recording
    @staticmethod
    def _group_key(group) -> tuple:
        # Not cached by id(group): simulated worlds free groups and ids recur.
        return getattr(group, "id", None), tuple(group.ranks)

    def start(self, op: str, group, root: int | None, tensor, phase: str | None) -> list | None:
        """Record that this rank issues ``op`` on ``group`` now.

        Args:
            op (str): ``"reduce"``, ``"broadcast"``, ``"reduce_scatter"``, ...
            group (Group): the process group (``id`` and ``ranks`` are read).
            root (int|None): global rank of the reduce destination / broadcast source.
            tensor (Tensor): the communicated tensor (dtype and numel are read).
            phase (str|None): the communication phase label.

        Returns:
            The entry to pass to :meth:`finish`, or None when disabled.
        """
        if not self.enabled:
            return None
        # signal handlers can only be installed from the main thread
        if self._arm_from_env and threading.current_thread() is threading.main_thread():
            self._arm_from_env = False
            self.arm()
        gid, ranks = key = self._group_key(group)
        with self._lock:
            seq = self._seq
            self._seq = seq + 1
            group_seq = self._issued.get(key, 0)
            self._issued[key] = group_seq + 1
            entry = [seq, group_seq, phase, op, gid, ranks, root, tensor.dtype,
                     tensor._numel(), time.time(), None, threading.get_ident()]
            self._entries.append(entry)
            self._in_flight[seq] = entry
        return entry

    def finish(self, entries: Iterable[list | None]) -> None:
        """Mark entries returned by :meth:`start` complete (their tasks waited)."""
        now = time.time()
        with self._lock:
            for entry in entries:
                if entry is not None:
                    entry[_FINISH] = now
                    self._in_flight.pop(entry[_SEQ], None)

    def clear(self) -> None:
        """Forget every entry and counter (tests; a new job in the same process)."""
        with self._lock:
            self._entries.clear()
            self._in_flight.clear()
            self._issued.clear()
            self._seq = 0

    # ------------------------------------------------------------ dumping
    def snapshot(self, reason: str, error: BaseException | None = None) -> dict:
        """Everything a dump holds, as JSON-ready data.

        Args:
            reason (str): why the dump is taken.
            error (BaseException|None): the exception the calling thread
                handles; its stack is then where ``error`` was raised.

        Returns:
            dict: rank, pid, host, reason, the main thread's phase, per-group
            issue counts, the ring buffer's entries (oldest first) and the
            threads' Python stacks (:func:`thread_stacks`).
        """
        with self._lock:
            entries = [list(e) for e in self._entries]
            issued = dict(self._issued)
            oldest = next(iter(self._in_flight.values()), None)
        blocked = oldest[_THREAD] if oldest is not None else None
        try:
            stacks = thread_stacks(blocked, error)
        except Exception:  # noqa: BLE001 - a dump must not fail for want of its stacks
            stacks = []
        rows = []
        for e in entries:
            e[_DTYPE] = str(e[_DTYPE]).replace("paddle.", "")
            e[_RANKS] = list(e[_RANKS])
            rows.append(dict(zip(FIELDS, e)))
        return {
            "format": DUMP_FORMAT,
            "rank": _own_rank(),
            # the launcher's; a dump must not fail on a malformed value (0: unknown)
            "world_size": _launcher_count("PADDLE_TRAINERS_NUM"),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "time": time.time(),
            "reason": reason,
            "phase": phase_of_thread(threading.main_thread().ident),
            "capacity": self.capacity,
            "issued": [
                {"group_id": gid, "group_ranks": list(ranks), "count": n}
                for (gid, ranks), n in issued.items()
            ],
            "entries": rows,
            "stacks": stacks,
        }

    def _dump_number(self, directory: str, rank: int) -> int:
        """1 for the first dump of a stall, else the next later number."""
        with self._lock:
            oldest = next(iter(self._in_flight.values()), None)
            seq = oldest[_SEQ] if oldest is not None else None
            issued = self._seq
            if self._stall is not None:
                s_dir, s_rank, s_seq, s_issued = self._stall
                same = (s_dir, s_rank) == (directory, rank) and (
                    s_seq in self._in_flight if s_seq is not None else s_issued == issued)
            else:
                same = False
        with self._name_lock:
            if same:
                number = min(len(self._later) + 2, MAX_DUMPS_PER_STALL)
                path = dump_path(directory, rank, number)
                if path not in self._later:
                    self._later.append(path)
                return number
            # a new stall: the later dumps of the previous one no longer
            # belong beside the first (this process wrote them)
            for path in self._later:
                try:
                    os.remove(path)
                except OSError:
                    pass
            self._stall, self._later = (directory, rank, seq, issued), []
            return 1

    def dump(self, reason: str, directory: str | None = None,
             request_peers: bool = False, error: BaseException | None = None) -> str | None:
        """Write this rank's dump; returns its path (None without a directory).

        The first dump of a stall is ``muon_flight_rank<R>.json``; later dumps
        of the same stall go beside it (see the module docstring).

        Args:
            reason (str): why, e.g. ``"SIGUSR1"``.
            directory (str|None): default :func:`dump_dir`.
            request_peers (bool): also ask every rank's watchdog to dump.
            error (BaseException|None): the exception the calling thread
                handles (the dump's stack for it is where it was raised).
        """
        directory = directory or dump_dir()
        if directory is None:
            _logger().warning(
                f"muon flight recorder: {reason}; no dump written: set {ENV_DIR} "
                f"(or launch with paddle.distributed.launch --log_dir)"
            )
            return None
        data = self.snapshot(reason, error)
        path = dump_path(directory, data["rank"], self._dump_number(directory, data["rank"]))
        try:
            os.makedirs(directory, exist_ok=True)
            _write_json(path, data)
            if request_peers:
                _write_json(os.path.join(directory, REQUEST_FILE),
                            {"rank": data["rank"], "reason": reason, "time": data["time"]})
                self._request_seen = time.time()
        except OSError as exc:
            _logger().warning(f"muon flight recorder: could not write {path}: {exc}")
            return None
        self.dumps += 1
        _logger().warning(f"muon flight recorder: rank {data['rank']} dumped its last "
                       f"{len(data['entries'])} collectives to {path} ({reason})")
        return path

    # ------------------------------------------------------------ triggers
    @property
    def armed(self) -> bool:
        """Whether :meth:`arm` installed the process-wide triggers."""
        return self._armed

    def arm(self) -> None:
        """Install the SIGUSR1 / uncaught-exception dumps and the watchdog.

        Only on request (:func:`arm` or ``PADDLE_MUON_FLIGHT_RECORDER_ARM=1``);
        a second call does nothing. Nothing is replaced that someone else
        installed: SIGUSR1 only when it still has its default action, the
        watchdog only with a dump directory.
        """
        if self._armed:
            return
        self._armed = True
        on_main = threading.current_thread() is threading.main_thread()
        if on_main:
            if signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
                signal.signal(signal.SIGUSR1, self._on_sigusr1)
            previous_hook = self._previous_hook = sys.excepthook

            def excepthook(exc_type, exc, tb):
                if self._armed:
                    self.dump(f"uncaught {exc_type.__name__}: {exc}", request_peers=True,
                              error=exc if isinstance(exc, BaseException) else None)
                previous_hook(exc_type, exc, tb)

            self._excepthook = sys.excepthook = excepthook
        if dump_dir() is not None and self._watchdog is None:
            self._request_seen = time.time()
            if on_main and signal.getsignal(signal.SIGUSR1) == self._on_sigusr1:
                self._wakeup = _signal_pipe()
            self._stop.clear()
            self._watchdog = threading.Thread(
                target=self._watch, name="muon-flight-watchdog", daemon=True)
            self._watchdog.start()

    def disarm(self) -> None:
        """Undo :meth:`arm`: stop the watchdog, restore SIGUSR1 and the hooks."""
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout=5 * _POLL_S)
            self._watchdog = None
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGUSR1) == self._on_sigusr1:
                signal.signal(signal.SIGUSR1, signal.SIG_DFL)
            if self._wakeup is not None:
                os.close(self._wakeup[1])
                signal.set_wakeup_fd(-1)
                os.close(self._wakeup[0])
                self._wakeup = None
            if self._previous_hook is not None:
                # a hook installed after ours stays; it chains to ours, which
                # now only passes through
                if sys.excepthook is self._excepthook:
                    sys.excepthook = self._previous_hook
                self._previous_hook = None
        self._armed = False
        self._arm_from_env = False

    def _on_sigusr1(self, *_: Any) -> None:
        # Runs when the main thread next executes Python; skip it when the
        # watchdog already answered this signal from the wake-up pipe.
        if time.time() - self._sigusr1_dumped > 5.0:
            self.dump("SIGUSR1")

    def _watch(self) -> None:
        while not self._stop.is_set():
            if self._wakeup is None:
                self._stop.wait(_POLL_S)
            elif select.select([self._wakeup[0]], [], [], _POLL_S)[0]:
                # A rank blocked inside a collective (C++ holding the main
                # thread) still answers SIGUSR1: Python's C-level handler
                # writes the signal number to the wake-up pipe at once.
                if signal.SIGUSR1 in os.read(self._wakeup[0], 64):
                    self._sigusr1_dumped = time.time()
                    self.dump("SIGUSR1")
            try:
                self.check_once(time.time())
            except Exception as exc:  # noqa: BLE001 - a watchdog must not die
                _logger().warning(f"muon flight recorder watchdog: {exc}")

    def check_once(self, now: float) -> str | None:
        """One watchdog round: dump on a timed-out collective or a peer's request.

        Returns:
            The reason a dump was taken, or None.
        """
        with self._lock:
            oldest = next(iter(self._in_flight.values()), None)
        if oldest is not None and oldest[_SEQ] != self._timed_out_seq:
            age = now - oldest[_START]
            if age > self.timeout_s:
                self._timed_out_seq = oldest[_SEQ]
                reason = (f"collective timeout: {oldest[_OP]} #{oldest[_GSEQ]} on group "
                          f"{oldest[_GID]} {list(oldest[_RANKS])} (phase {oldest[_PHASE]!r}) "
                          f"in flight for {age:.1f} s > {ENV_TIMEOUT}={self.timeout_s:g}")
                self.dump(reason, request_peers=True)
                return reason
        directory = dump_dir()
        request = os.path.join(directory, REQUEST_FILE) if directory else None
        try:
            mtime = os.stat(request).st_mtime if request else 0.0
        except OSError:
            return None
        if mtime > self._request_seen:
            self._request_seen = mtime
            try:
                with open(request, encoding="utf-8") as f:
                    asked = json.load(f)
            except (OSError, ValueError):
                asked = {}
            reason = f"requested by rank {asked.get('rank', '?')}: {asked.get('reason', '?')}"
            self.dump(reason)
            return reason
        return None


def _signal_pipe() -> tuple[int, int] | None:
    """(read, write) ends of a pipe that receives every signal's number, or None.

    Only taken when nobody else (e.g. an asyncio loop) owns the wake-up fd.
    """
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:
        previous = None
    if previous != -1:
        if previous is not None:
            signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
        return None
    return read_fd, write_fd


def _write_json(path: str, data: Mapping) -> None:
    # Per thread too: the watchdog and the main thread may dump at once (a
    # SIGUSR1 and an uncaught exception); a shared temporary name made one
    # os.replace fail and that dump (and its peer request) was lost.
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    # ASCII JSON (non-ASCII text escaped) in UTF-8: the same bytes in any locale
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


_RECORDER: FlightRecorder | None = None


def get_flight_recorder() -> FlightRecorder:
    """The process's recorder (created on first use)."""
    global _RECORDER
    if _RECORDER is None:
        _RECORDER = FlightRecorder()
    return _RECORDER


def arm() -> FlightRecorder:
    """Arm the process's recorder: dump on SIGUSR1, an uncaught exception, a
    collective in flight past ``PADDLE_MUON_FLIGHT_TIMEOUT`` or a peer's request.

    Call it from the main thread of the training script (signal handlers can
    only be installed there). Same as ``PADDLE_MUON_FLIGHT_RECORDER_ARM=1``.

    Returns:
        FlightRecorder: the armed recorder.
    """
    recorder = get_flight_recorder()
    recorder.arm()
    return recorder


def disarm() -> None:
    """Undo :func:`arm`: stop the watchdog, restore SIGUSR1 and ``sys.excepthook``."""
    get_flight_recorder().disarm()
