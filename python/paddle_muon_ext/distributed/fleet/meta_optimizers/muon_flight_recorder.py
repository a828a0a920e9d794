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
``PADDLE_MUON_FLIGHT_DIR``, else to the launcher's ``PADDLE_LOG_DIR``:

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
at most :data:`STACK_FRAMES` innermost frames each), read with
``sys._current_frames()`` when the dump is written: nothing is installed for
it, and ``hangs`` shows the stuck rank's stack.

``PADDLE_MUON_FLIGHT_RECORDER=0`` turns recording off;
``PADDLE_MUON_FLIGHT_ENTRIES`` sets N (default 2048). The same approach as
PyTorch's NCCL flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``).
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
import traceback
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence


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
DUMP_PREFIX = "muon_flight_rank"
REQUEST_FILE = "muon_flight.request"
DUMP_FORMAT = "paddle_muon_ext.flight_recorder/1"
DEFAULT_ENTRIES = 2048
DEFAULT_TIMEOUT_S = 600.0
_POLL_S = 1.0
#: Bounds of the Python stacks in a dump: innermost frames kept per thread,
#: threads kept, characters per frame (a dump stays small and a frame whose
#: source line is huge cannot bloat it).
STACK_FRAMES = 32
STACK_THREADS = 16
STACK_FRAME_CHARS = 400

# Field order of one ring-buffer entry (a list: cheapest to build per collective).
FIELDS = (
    "seq", "group_seq", "phase", "op", "group_id", "group_ranks", "root",
    "dtype", "numel", "start", "finish",
)
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


def _env_positive(name: str, default: float, kind: type) -> Any:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return kind(default)
    try:
        value = kind(raw)
    except ValueError:
        value = None
    # not (value > 0): NaN compares false; inf would never time out
    if value is None or not (0 < value < float("inf")):
        raise ValueError(
            f"{name}={raw!r}: must be a positive finite {kind.__name__}; unset it for "
            f"the default {default}"
        )
    return value


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


def dump_path(directory: str, rank: int) -> str:
    """File name of ``rank``'s dump inside ``directory``."""
    return os.path.join(directory, f"{DUMP_PREFIX}{rank}.json")


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
        self.capacity = capacity or _env_positive(ENV_ENTRIES, DEFAULT_ENTRIES, int)
        self.timeout_s = _env_positive(ENV_TIMEOUT, DEFAULT_TIMEOUT_S, float)
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
    def snapshot(self, reason: str) -> dict:
        """Everything a dump holds, as JSON-ready data.

        Args:
            reason (str): why the dump is taken.

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
            stacks = thread_stacks(blocked)
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

    def dump(self, reason: str, directory: str | None = None,
             request_peers: bool = False) -> str | None:
        """Write this rank's dump; returns its path (None without a directory).

        Args:
            reason (str): why, e.g. ``"SIGUSR1"``.
            directory (str|None): default :func:`dump_dir`.
            request_peers (bool): also ask every rank's watchdog to dump.
        """
        directory = directory or dump_dir()
        if directory is None:
            _logger().warning(
                f"muon flight recorder: {reason}; no dump written: set {ENV_DIR} "
                f"(or launch with paddle.distributed.launch --log_dir)"
            )
            return None
        data = self.snapshot(reason)
        path = dump_path(directory, data["rank"])
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
                    self.dump(f"uncaught {exc_type.__name__}: {exc}", request_peers=True)
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
                with open(request) as f:
                    asked = json.load(f)
            except (OSError, ValueError):
                asked = {}
            reason = f"requested by rank {asked.get('rank', '?')}: {asked.get('reason', '?')}"
            self.dump(reason)
            return reason
        return None


def thread_stacks(in_collective: int | None = None) -> list[dict]:
    """The Python stacks of this process's threads, bounded, as JSON-ready data.

    Read from ``sys._current_frames()`` (a snapshot; installs nothing). The
    thread in a collective comes first, then the main thread, then the rest;
    the watchdog's own thread is left out (its stack is this dump).

    Args:
        in_collective (int|None): ident of the thread blocked in a collective.

    Returns:
        list[dict]: per thread ``thread`` (name), ``ident``, ``main``,
        ``in_collective`` and ``frames`` (``traceback.format_stack`` strings,
        outermost first, the innermost :data:`STACK_FRAMES` at most).
    """
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    here = threading.get_ident()
    stacks = []
    for ident, frame in sys._current_frames().items():
        if ident == here and names.get(ident) == "muon-flight-watchdog":
            continue
        # limit > 0 keeps the innermost frames (outermost first, as printed)
        frames = traceback.format_stack(frame, limit=STACK_FRAMES)
        stacks.append({
            "thread": names.get(ident),
            "ident": ident,
            "main": ident == main,
            "in_collective": ident == in_collective,
            "frames": [f if len(f) <= STACK_FRAME_CHARS else f[:STACK_FRAME_CHARS - 3] + "..."
                       for f in frames],
        })
    stacks.sort(key=lambda s: (not s["in_collective"], not s["main"]))
    return stacks[:STACK_THREADS]


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
    with open(tmp, "w") as f:
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


# ------------------------------------------------------------------ analysis
@dataclass
class RankState:
    """What one rank's dump (or the simulated world) says about that rank.

    Attributes:
        rank: global rank.
        phase: the phase its main thread is in (None: outside any phase).
        in_flight: collectives issued and not finished, oldest first, as
            dicts with the keys of :data:`FIELDS`.
        issued: per ``(group_id, group_ranks)``, collectives issued on it.
        last_finished: its most recent finished collective (a dict) or None.
        note: e.g. ``"already returned"``.
    """

    rank: int
    phase: str | None = None
    in_flight: list = field(default_factory=list)
    issued: dict = field(default_factory=dict)
    last_finished: dict | None = None
    note: str = ""

    @classmethod
    def from_dump(cls, data: Mapping) -> RankState:
        """Build from a dump written by :meth:`FlightRecorder.dump`."""
        entries = data.get("entries", [])
        return cls(
            rank=int(data["rank"]),
            phase=data.get("phase"),
            in_flight=[e for e in entries if e.get("finish") is None],
            issued={(i["group_id"], tuple(i["group_ranks"])): int(i["count"])
                    for i in data.get("issued", [])},
            last_finished=next((e for e in reversed(entries) if e.get("finish") is not None), None),
        )


def phase_text(phase: str | None) -> str:
    """``phase 'x'``, or ``outside any phase`` for None."""
    return "outside any phase" if phase is None else f"phase {phase!r}"


def describe_collective(e: Mapping) -> str:
    """``reduce #3 on group 7 [1, 3] (root 3, float32, numel 4096, phase 'x')``."""
    extra = [f"root {e['root']}"] if e.get("root") is not None else []
    extra += [str(e.get("dtype")), f"numel {e.get('numel')}", phase_text(e.get("phase"))]
    return (f"{e['op']} #{e['group_seq']} on group {e['group_id']} "
            f"[{_rank_list(e['group_ranks'])}] ({', '.join(extra)})")


#: Rank lists longer than this are shown by their first and last members and
#: their length, so a report stays linear in the world size.
_LIST_SHOWN = 16


def _rank_list(ranks: Sequence[int]) -> str:
    ranks = list(ranks)
    if len(ranks) <= _LIST_SHOWN:
        return ", ".join(map(str, ranks))
    return (", ".join(map(str, ranks[:8])) + ", ..., " + ", ".join(map(str, ranks[-4:]))
            + f" ({len(ranks)} ranks)")


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + _rank_list(ranks)


def diagnose(states: Mapping[int, RankState], world_size: int | None = None) -> list[str]:
    """Name the rank(s) everyone waits for, from every rank's state.

    A rank waits in its oldest in-flight collective for each member of that
    group that has issued fewer collectives on the group than the one it
    waits in. Following these edges, the ranks waited for that are not
    themselves waiting in a collective (or left no dump) are the culprits.

    Args:
        states: rank -> :class:`RankState` (ranks without a dump absent).
        world_size: to list ranks that left no state at all.

    Returns:
        Report lines; the first says who is stuck, in the words
        ``rank R is the rank the others wait for`` (or that none is waiting).
    """
    waits: dict[int, tuple[dict, list[int]]] = {}
    # Each member's count on a group is looked up once per group, not once per
    # waiting rank: hashing a group's rank tuple costs its length, and a world
    # of n ranks waiting on one n-rank group would otherwise cost n**3.
    issued_on: dict[tuple, dict[int, int]] = {}
    for rank, state in sorted(states.items()):
        if not state.in_flight:
            continue
        e = state.in_flight[0]
        key = (e["group_id"], tuple(e["group_ranks"]))
        counts = issued_on.get(key)
        if counts is None:
            counts = issued_on[key] = {p: states[p].issued.get(key, 0)
                                       for p in set(key[1]) if p in states}
        behind = [p for p in key[1] if p != rank
                  and (p not in counts or counts[p] <= e["group_seq"])]
        waits[rank] = (e, behind)
    if not waits:
        return ["no rank is waiting in a collective of the optimizer"]
    # The collective whose waiters wait for p alone says most about p: one
    # pass over the wait edges keeps the best one for every rank waited for.
    best: dict[int, tuple] = {}
    for i, (e, behind) in enumerate(waits.values()):
        rank_key = (len(behind), e["seq"] if e.get("seq") is not None else 0, i)
        for p in behind:
            if p not in waits and (p not in best or rank_key < best[p][0]):
                best[p] = (rank_key, e)
    culprits = sorted(best)
    lines = []
    silent = [p for p in culprits if p not in states]
    if len(silent) > _LIST_SHOWN:
        # many ranks without a dump (a lost node): one line, not one per rank
        others = len({id(best[p][1]) for p in silent}) > 1
        lines.append(f"{_ranks(silent)} are the ranks the others wait for: they left no "
                     "dump (crashed, or on nodes whose log dirs were not collected); they "
                     f"wait in {describe_collective(best[silent[0]][1])}"
                     + (" and other collectives" if others else ""))
        culprits = [p for p in culprits if p in states]
    for p in culprits:
        state = states.get(p)
        awaited = best[p][1]
        if state is None:
            lines.append(f"rank {p} is the rank the others wait for: it left no dump "
                         f"(crashed, or on a node whose log dir was not collected); "
                         f"they wait in {describe_collective(awaited)}")
            continue
        last = (describe_collective(state.last_finished) if state.last_finished
                else "none recorded")
        note = f", {state.note}" if state.note else ""
        where = "outside any phase" if state.phase is None else f"in phase {state.phase!r}"
        lines.append(f"rank {p} is the rank the others wait for: {where}"
                     f"{note}, it has not issued {describe_collective(awaited)}; "
                     f"its last finished collective: {last}")
    if not lines:
        lines.append("no rank is outside a collective: "
                     f"{_ranks(sorted(waits))} wait on each other (collectives issued "
                     "in a different order on different ranks)")
    by_collective: dict[tuple, list[int]] = collections.OrderedDict()
    for rank, (e, behind) in sorted(waits.items()):
        k = (describe_collective(e), tuple(behind))
        by_collective.setdefault(k, []).append(rank)
    for (what, behind), ranks in by_collective.items():
        verb = "waits" if len(ranks) == 1 else "wait"
        whom = _ranks(list(behind)) if behind else "nobody (every peer issued it)"
        lines.append(f"  {_ranks(ranks)} {verb} in {what} for {whom}")
    if world_size:
        missing = [r for r in range(world_size) if r not in states]
        if missing:
            lines.append(f"  no dump from {_ranks(missing)}")
    return lines
