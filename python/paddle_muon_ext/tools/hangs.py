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
"""``paddle-muon-ext hangs LOG_DIR``: whom a hung job waits for, or what a crashed job raised.

Reads every ``muon_flight_rank<R>.json`` the Muon sharding optimizer's flight
recorder dumped into LOG_DIR (the launcher's ``--log_dir``, or
``PADDLE_MUON_FLIGHT_DIR``), checks each dump field by field, prints one line
per rank (why it dumped, its phase, the collective it is in) and then the
verdict:

* a crash - ranks dumped because an exception was raised (in a collective,
  or uncaught): ``not a hang: every rank raised X in op Y`` (or which ranks
  raised and who waits for them);
* a hang - no rank raised: the rank(s) the others wait for and the
  collective they are stuck before (:func:`diagnose`).

A rank may leave several dumps of one stall: the first
(``muon_flight_rank<R>.json``, taken when the stall was noticed) is the
evidence the verdict reads; the later ones of the same process
(``muon_flight_rank<R>.<n>.json``: the gloo timeout, the exception hook, a
peer's request) are listed under the rank, and what they say the rank
raised counts too. Later dumps of another process (an earlier job) are
ignored, with a note.

When the dumps hold Python stacks (``stacks``, written by recorders since
they had them; older dumps have none), the report ends with the stack of
each rank named above (the thread in a collective, else the main thread)
and the innermost frames of each rank waiting in a collective.

Exit 0 with a report, 2 on bad input (one ``error: ...`` line naming the file
and the field). ``--json`` prints the report as JSON.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import sys
from typing import Any, Optional, Sequence

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_flight.diagnosis import (
    DUMP_FORMAT,
    DUMP_PREFIX,
    FIELDS,
    RankState,
    describe_collective,
    diagnose,
    phase_text,
)

from . import limits
from .guard import ArgumentParser, emit_json, guarded, printable

__all__ = ["DumpError", "classify", "load_dumps", "main", "report", "stack_of",
           "validate_dump"]

#: Dumps of one hang are written within seconds of each other (a timed-out
#: rank asks the others); a wider spread means files from another job.
STALE_SPREAD_S = 300.0
#: Largest world a dump may name (the report lists the ranks without a dump).
MAX_RANKS = 1 << 20
#: Largest dump read (a ring buffer of the default 2048 entries on small
#: groups is < 1 MB; on 1,024-rank groups about 10 MB).
MAX_DUMP_BYTES = 64 << 20
#: Largest sum of the dumps read: keeps a run within seconds and its memory
#: within a few GB (the report is linear in the bytes read).
MAX_TOTAL_BYTES = 512 << 20

# "<op> on group [..] (phase ..) raised <Type>: msg" (a collective raised) and
# "uncaught <Type>: msg" (the process died of it); a peer's request quotes them.
_RAISED_RE = re.compile(r"^(?P<op>\w+) on group \[[^\]]*\] \(phase [^)]*\) raised "
                        r"(?P<exc>[\w.]+)(?::|$)")
_UNCAUGHT_RE = re.compile(r"^uncaught (?P<exc>[\w.]+)(?::|$)")
# diagnose()'s line for a culprit that left a dump ("it left no dump" has no stack),
# or for a peer that left the collective the others wait in
# the later dumps of one stall: muon_flight_rank<R>.<n>.json
_NUMBERED_RE = re.compile(re.escape(DUMP_PREFIX) + r"\d+\.(\d+)\.json")
_CULPRIT_RE = re.compile(r"^rank (\d+) (?:is the rank the others wait for: (?!it left no dump)"
                         r"|has left the collective the others wait in)")
_FRAME_RE = re.compile(r'File "(?P<file>[^"]*)", line (?P<line>\d+), in (?P<fn>\S+)')
#: Innermost frames shown of a blamed rank's stack, and of a waiting rank's.
CULPRIT_FRAMES = 12
WAITING_FRAMES = 4
#: Waiting ranks whose top frames are listed (the rest are in --json).
WAITING_SHOWN = 16


class DumpError(ValueError):
    """A dump directory or file that cannot be used; the message is the error line."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(float(v)))


def _ranks_ok(v: Any) -> bool:
    return isinstance(v, list) and all(_is_int(r) and r >= 0 for r in v)


def _opt(check):
    return lambda v: v is None or check(v)


_ENTRY_CHECKS = {
    "seq": (_opt(_is_int), "an integer or null"),
    "group_seq": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "phase": (_opt(lambda v: isinstance(v, str)), "a string or null"),
    "op": (lambda v: isinstance(v, str) and bool(v), "a non-empty string"),
    "group_id": (lambda v: _is_int(v) or isinstance(v, str), "an integer"),
    "group_ranks": (lambda v: _ranks_ok(v) and bool(v), "a non-empty list of ranks"),
    "root": (_opt(lambda v: _is_int(v) and v >= 0), "a rank or null"),
    "dtype": (_opt(lambda v: isinstance(v, str)), "a string or null"),
    "numel": (_opt(lambda v: _is_int(v) and v >= 0), "an integer >= 0 or null"),
    "start": (_opt(_is_num), "a number or null"),
    "finish": (_opt(_is_num), "a number or null"),
}
_TOP_CHECKS = {
    "rank": (lambda v: _is_int(v) and 0 <= v < MAX_RANKS, f"an integer in 0..{MAX_RANKS - 1}",
             True),
    "world_size": (lambda v: _is_int(v) and 0 <= v <= MAX_RANKS, f"an integer in 0..{MAX_RANKS}",
                   False),
    "pid": (_opt(_is_int), "an integer", False),
    "host": (_opt(lambda v: isinstance(v, str)), "a string", False),
    "time": (_opt(_is_num), "a number", False),
    "reason": (lambda v: isinstance(v, str), "a string", True),
    "phase": (_opt(lambda v: isinstance(v, str)), "a string or null", False),
    "entries": (lambda v: isinstance(v, list), "a list", True),
    "issued": (lambda v: isinstance(v, list), "a list", True),
    # optional: dumps written before the recorder took stacks have none
    "stacks": (lambda v: isinstance(v, list), "a list", False),
}


def _stacks_problem(stacks: list) -> Optional[str]:
    """The first malformed field of the optional ``stacks`` list, or None."""
    for i, item in enumerate(stacks):
        if not isinstance(item, dict):
            return f"field 'stacks[{i}]' is {_show(item)}, expected an object"
        for key, ok, want in (
                ("thread", _opt(lambda v: isinstance(v, str)), "a string or null"),
                ("main", lambda v: isinstance(v, bool), "true or false"),
                ("in_collective", lambda v: isinstance(v, bool), "true or false"),
                ("frames", lambda v: isinstance(v, list) and all(isinstance(f, str) for f in v),
                 "a list of strings")):
            if key in item and not ok(item[key]):
                return f"field 'stacks[{i}].{key}' is {_show(item[key])}, expected {want}"
        if "frames" not in item:
            return f"field 'stacks[{i}].frames' is missing, expected a list of strings"
    return None


def _show(v: Any) -> str:
    try:
        text = json.dumps(v)
    except (TypeError, ValueError, RecursionError):
        text = "<unprintable>"
    return text if len(text) <= 60 else text[:57] + "..."


def validate_dump(data: Any) -> Optional[str]:
    """The first malformed field of a dump, as ``field 'x' is V, expected ...``; None if sound."""
    if not isinstance(data, dict):
        return f"is {type(data).__name__} JSON, expected an object"
    if data.get("format") != DUMP_FORMAT:
        return f"field 'format' is {_show(data.get('format'))}, expected {DUMP_FORMAT!r}"
    for key, (ok, want, required) in _TOP_CHECKS.items():
        if key not in data:
            if required:
                return f"field {key!r} is missing, expected {want}"
            continue
        if not ok(data[key]):
            return f"field {key!r} is {_show(data[key])}, expected {want}"
    for i, e in enumerate(data["entries"]):
        if not isinstance(e, dict):
            return f"field 'entries[{i}]' is {_show(e)}, expected an object"
        for key in FIELDS:
            ok, want = _ENTRY_CHECKS[key]
            if key not in e:
                if key in ("group_seq", "op", "group_id", "group_ranks"):
                    return f"field 'entries[{i}].{key}' is missing, expected {want}"
                continue
            if not ok(e[key]):
                return f"field 'entries[{i}].{key}' is {_show(e[key])}, expected {want}"
    for i, item in enumerate(data["issued"]):
        if not isinstance(item, dict):
            return f"field 'issued[{i}]' is {_show(item)}, expected an object"
        for key, ok, want in (("group_id", lambda v: _is_int(v) or isinstance(v, str),
                               "an integer"),
                              ("group_ranks", _ranks_ok, "a list of ranks"),
                              ("count", lambda v: _is_int(v) and v >= 0, "an integer >= 0")):
            if key not in item or not ok(item[key]):
                return (f"field 'issued[{i}].{key}' is "
                        f"{_show(item.get(key)) if key in item else 'missing'}, "
                        f"expected {want}")
    problem = _stacks_problem(data.get("stacks", []))
    if problem:
        return problem
    world = data.get("world_size") or 0
    if world and data["rank"] >= world:
        return f"field 'rank' is {data['rank']}, expected < world_size {world}"
    if world:
        # a group naming a rank outside the world would make that rank "the one
        # the others wait for"
        for name, items in (("entries", data["entries"]), ("issued", data["issued"])):
            for i, item in enumerate(items):
                outside = next((r for r in item["group_ranks"] if r >= world), None)
                if outside is not None:
                    return (f"field '{name}[{i}].group_ranks' names rank {outside}, "
                            f"outside world_size {world}")
                root = item.get("root")
                if root is not None and root >= world:
                    return f"field '{name}[{i}].root' is {root}, outside world_size {world}"
    return None


def load_dumps(log_dir: str) -> dict[int, dict]:
    """Read and check every rank's dump in ``log_dir``.

    Args:
        log_dir (str): the directory the ranks dumped into.

    Returns:
        dict: rank -> the data of the rank's first dump (the evidence), with
        two keys added: ``later_dumps``, the data of its later dumps of the
        same process (oldest first; each with ``file``, its name), and
        ``ignored_dumps``, the names of its later dumps written by another
        process.

    Raises:
        DumpError: missing directory, no dumps, an unreadable or malformed
            dump (naming the file and the field), or two dumps of one rank
            with one number.
    """
    if not os.path.isdir(log_dir):
        raise DumpError(f"log dir {log_dir!r}: not a directory, pass the launcher's --log_dir "
                        "(or PADDLE_MUON_FLIGHT_DIR) of the hung job")
    paths = sorted(glob.glob(os.path.join(glob.escape(log_dir), f"{DUMP_PREFIX}*.json")))
    if not paths:
        raise DumpError(
            f"log dir {log_dir!r}: no {DUMP_PREFIX}<R>.json dumps; ranks dump when a collective "
            "raises and, once armed (launch with PADDLE_MUON_FLIGHT_RECORDER_ARM=1), on a "
            "collective timeout, an uncaught exception or SIGUSR1 (kill -USR1 <pid> on every rank)")
    # rank -> number -> (path, data); number 1 is muon_flight_rank<R>.json
    found: dict[int, dict[int, tuple[str, dict]]] = {}
    fix = "remove it or re-dump that rank with SIGUSR1"
    total = 0
    for path in paths:
        try:
            # refused before reading unless a non-empty regular file: a FIFO or
            # a link to /proc/kmsg would block the read forever
            raw = limits.read_regular_file("dump", path, MAX_DUMP_BYTES, fix)
        except limits.InputError as exc:
            raise DumpError(f"dump {path!r}: {exc.why}, {fix}") from None
        total += len(raw)
        if total > MAX_TOTAL_BYTES:
            raise DumpError(f"log dir {log_dir!r}: the dumps hold more than {MAX_TOTAL_BYTES} "
                            f"bytes (at {os.path.basename(path)}); move the dumps of the ranks "
                            "to inspect into a directory of their own")
        try:
            data = json.loads(raw.decode("utf-8"))
        except RecursionError:
            raise DumpError(f"dump {path!r}: nested too deeply to be a dump, {fix}") from None
        except (OSError, ValueError) as exc:  # UnicodeDecodeError, JSONDecodeError included
            raise DumpError(f"dump {path!r}: unreadable ({exc}), {fix}") from None
        problem = validate_dump(data)
        if problem:
            raise DumpError(f"dump {path!r}: {problem}; {fix}")
        rank = data["rank"]
        numbered = _NUMBERED_RE.fullmatch(os.path.basename(path))
        number = int(numbered.group(1)) if numbered else 1
        if number in found.get(rank, {}):
            raise DumpError(f"dump {path!r}: rank {rank} again (also in "
                            f"{found[rank][number][0]!r}); remove the dump of the other job")
        # Only the unfinished collectives and the last finished one are read
        # later: drop the rest of the ring buffer now, so memory holds one dump
        # at a time, not the whole log dir.
        entries = data["entries"]
        last = next((i for i in range(len(entries) - 1, -1, -1)
                     if entries[i].get("finish") is not None), None)
        data["entries"] = [e for i, e in enumerate(entries)
                           if e.get("finish") is None or i == last]
        found.setdefault(rank, {})[number] = (path, data)
    dumps: dict[int, dict] = {}
    where: dict[int, str] = {}
    for rank, by_number in found.items():
        (path, data), *rest = [by_number[n] for n in sorted(by_number)]
        data["file"], data["later_dumps"], data["ignored_dumps"] = os.path.basename(path), [], []
        for later_path, later in rest:
            same = (later.get("pid"), later.get("host")) == (data.get("pid"), data.get("host"))
            if same:
                later["file"] = os.path.basename(later_path)
                data["later_dumps"].append(later)
            else:
                data["ignored_dumps"].append(os.path.basename(later_path))
        dumps[rank], where[rank] = data, path
    worlds = {d.get("world_size") or 0 for d in dumps.values()} - {0}
    if len(worlds) > 1:
        by = {w: next(where[r] for r, d in sorted(dumps.items()) if d.get("world_size") == w)
              for w in sorted(worlds)}
        raise DumpError(f"log dir {log_dir!r}: the dumps name different world sizes ("
                        + ", ".join(f"{w} in {p!r}" for w, p in by.items())
                        + "); remove the dumps of the other job")
    return dumps


#: An exception that only says the rank waited too long (a symptom of a hang),
#: or that a peer went away (a symptom of another rank's death).
_TIMEOUT_RE = re.compile(r"time ?out|timed out|deadline exceeded", re.IGNORECASE)
_PEER_LOST_RE = re.compile(r"connection (closed|reset|refused|aborted)|closed by peer|"
                           r"broken pipe|end of file|socket closed", re.IGNORECASE)


def _raised(reason: str) -> Optional[dict]:
    """What the rank raised, when its own dump says it raised: ``exception``,
    ``op`` (from the text, or None) and ``kind`` - ``"error"``, ``"timeout"``
    (it waited too long: a hang's symptom) or ``"peer_lost"`` (a peer died)."""
    m = _RAISED_RE.match(reason) or _UNCAUGHT_RE.match(reason)
    if m is None:
        return None
    message = reason[m.end():]
    kind = ("timeout" if _TIMEOUT_RE.search(message) else
            "peer_lost" if _PEER_LOST_RE.search(message) else "error")
    return {"exception": m.group("exc"), "op": m.groupdict().get("op"), "kind": kind}


def classify(dumps: dict[int, dict]) -> dict:
    """Crash or hang, from every rank's dump reason and in-flight collectives.

    A rank whose own exception is an error (not a collective timing out, not
    a lost peer) crashed the job: the verdict names it (``not a hang: every
    rank raised X in op Y``). Ranks that only lost a peer say a rank died.
    Timeouts are what a hang looks like on gloo: those ranks count as
    waiting, and :func:`diagnose` names the rank they wait for.

    Returns:
        dict: ``kind`` (``"crash"`` / ``"hang"`` / ``"none"``), ``raised``
        (rank -> {"exception", "kind", "op", "phase", "collective", "reason"},
        ``reason`` that of the dump saying it raised),
        ``culprits`` (the dumped ranks the verdict blames) and ``lines``
        (the verdict).
    """
    states = {rank: RankState.from_dump(d) for rank, d in dumps.items()}
    world = max([int(d.get("world_size") or 0) for d in dumps.values()] + [0])
    raised = {}
    for rank, data in sorted(dumps.items()):
        # the first dump that says the rank raised: the evidence, else a later one
        hit, said = None, data
        for said in [data] + list(data.get("later_dumps") or []):
            hit = _raised(said["reason"])
            if hit is not None:
                break
        if hit is None:
            continue
        state = states[rank] if said is data else RankState.from_dump(said)
        first = state.in_flight[0] if state.in_flight else None
        raised[rank] = {**hit, "op": first["op"] if first else hit["op"],
                        "phase": first.get("phase") if first else None,
                        "collective": describe_collective(first) if first else None,
                        "reason": said["reason"]}
    missing = [r for r in range(world) if r not in dumps] if world else []
    errors = {r: v for r, v in raised.items() if v["kind"] == "error"}
    lost = {r: v for r, v in raised.items() if v["kind"] == "peer_lost"}
    timeouts = sorted(r for r, v in raised.items() if v["kind"] == "timeout")
    if not errors and not lost:
        lines = diagnose(states, world or None)
        kind = "none" if lines[:1] == ["no rank is waiting in a collective of the optimizer"] \
            else "hang"
        if timeouts:
            lines.append(f"  {_ranks(timeouts)} raised when a collective timed out: a "
                         "symptom of the hang, not its cause")
        culprits = [int(m.group(1)) for m in map(_CULPRIT_RE.match, lines) if m]
        return {"kind": kind, "raised": raised, "culprits": culprits, "lines": lines}
    culprits = errors or lost
    groups: dict[tuple, list[int]] = {}
    for rank, r in culprits.items():
        groups.setdefault((r["exception"], r["op"], r["phase"]), []).append(rank)

    def what(exc: str, op: Optional[str], phase: Optional[str]) -> str:
        if not op:
            return f"{exc} outside any collective"
        return f"{exc} in op {op}" + (f" ({phase_text(phase)})" if phase else "")

    everyone = len(culprits) == len(dumps) and not missing
    if errors and everyone and len(groups) == 1:
        lines = [f"not a hang: every rank raised {what(*next(iter(groups)))}"]
    elif errors:
        parts = "; ".join(f"{_ranks(ranks)} raised {what(*key)}"
                          for key, ranks in groups.items())
        lines = [f"not a hang: {'every rank raised' if everyone else 'a crash'}: {parts}"]
    else:
        parts = "; ".join(f"{_ranks(ranks)} lost a peer ({what(*key)})"
                          for key, ranks in groups.items())
        lines = [f"not a hang: a rank died: {parts}"
                 + (f"; {_ranks(missing)} left no dump" if missing else "")]
    for rank, r in culprits.items():
        lines.append(f"  rank {rank} raised {r['exception']}"
                     + (f" in {r['collective']}" if r["collective"] else "")
                     + f"; its dump: {r['reason']}")
    followers = sorted(r for r in raised if r not in culprits)
    if followers:
        lines.append(f"  {_ranks(followers)} then failed in a collective (a timeout or a "
                     "lost peer): a consequence, not the cause")
    waiting = [rank for rank, st in sorted(states.items())
               if st.in_flight and rank not in raised]
    if waiting:
        lines.append(f"  {_ranks(waiting)} then wait(s) in a collective for the rank(s) that "
                     "raised; fix the exception, the rest follows from it")
    if missing and errors:
        lines.append(f"  no dump from {_ranks(missing)}")
    return {"kind": "crash", "raised": raised, "culprits": sorted(culprits), "lines": lines}


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def report(dumps: dict[int, dict]) -> list[str]:
    """Per-rank lines followed by the verdict (:func:`classify`).

    Args:
        dumps (dict): rank -> dump data, as :func:`load_dumps` returns.

    Returns:
        list[str]: the report lines.
    """
    return _report(dumps)[0]


def _report(dumps: dict[int, dict]) -> tuple[list[str], dict]:
    world = max([int(d.get("world_size") or 0) for d in dumps.values()] + [0])
    lines = [f"flight recorder dumps: {len(dumps)} rank(s)"
             + (f" of {world}" if world else "")]
    for rank, data in sorted(dumps.items()):
        lines.append(f"  rank {rank} (pid {data.get('pid')}, {data.get('host')}): "
                     f"{_where(RankState.from_dump(data))}; dumped on: {data.get('reason')}")
        for later in data.get("later_dumps") or []:
            after = float(later.get("time") or 0.0) - float(data.get("time") or 0.0)
            lines.append(f"    then {later['file']} ({after:+.0f} s): {later.get('reason')}")
        ignored = data.get("ignored_dumps") or []
        if ignored:
            lines.append(f"    note: ignored {', '.join(ignored)}: written by another process "
                         f"than {data.get('file')} (an earlier job); remove them")
    times = [float(d.get("time") or 0.0) for d in dumps.values()]
    if max(times) - min(times) > STALE_SPREAD_S:
        lines.append(f"  note: the dumps were written {max(times) - min(times):.0f} s apart; "
                     "remove dumps left by an earlier job from the log dir")
    verdict = classify(dumps)
    lines.extend(verdict["lines"])
    lines.extend(_stack_lines(dumps, verdict["culprits"]))
    # dump text (reason, host, phase, op names) is the job's, not ours: a
    # newline or an ANSI escape in it must neither add a line nor drive the terminal
    return [printable(line) for line in lines], verdict


def stack_of(data: dict) -> Optional[dict]:
    """The stack that says where a rank is: its thread blocked in a
    collective, else its main thread; None in a dump without stacks.

    Args:
        data (dict): one rank's dump.

    Returns:
        dict|None: an item of the dump's ``stacks``.
    """
    stacks = data.get("stacks") or []
    return (next((s for s in stacks if s.get("in_collective")), None)
            or next((s for s in stacks if s.get("main")), None))


def _frame_line(frame: str) -> str:
    # 'File "x.py", line 3, in f\n    code\n' -> 'File "x.py", line 3, in f: code'
    return ": ".join(part.strip() for part in frame.splitlines() if part.strip())


def _frame_short(frame: str) -> str:
    m = _FRAME_RE.search(frame)
    if m is None:
        return _frame_line(frame)[:80]
    return f"{m['fn']} ({os.path.basename(m['file'])}:{m['line']})"


def _thread(stack: dict) -> str:
    return "main thread" if stack.get("main") else f"thread {stack.get('thread')!r}"


def _stack_lines(dumps: dict[int, dict], culprits: Sequence[int]) -> list[str]:
    """The blamed ranks' stacks, then each waiting rank's innermost frames."""
    lines = []
    for rank in culprits:
        stack = stack_of(dumps[rank])
        if not stack or not stack["frames"]:
            continue
        frames = stack["frames"][-CULPRIT_FRAMES:]
        hidden = len(stack["frames"]) - len(frames)
        lines.append(f"  rank {rank}'s {_thread(stack)}, Python stack (innermost last"
                     + (f"; {hidden} outer frames not shown" if hidden else "") + "):")
        lines.extend(f"    {_frame_line(f)}" for f in frames)
    waiting = []
    for rank, data in sorted(dumps.items()):
        stack = stack_of(data)
        if (rank not in culprits and stack and stack["frames"]
                and any(e.get("finish") is None for e in data["entries"])):
            waiting.append((rank, stack))
    for rank, stack in waiting[:WAITING_SHOWN]:
        top = " < ".join(_frame_short(f) for f in reversed(stack["frames"][-WAITING_FRAMES:]))
        lines.append(f"  rank {rank}'s {_thread(stack)} waits in: {top}")
    if len(waiting) > WAITING_SHOWN:
        lines.append(f"  ... and {len(waiting) - WAITING_SHOWN} more waiting ranks "
                     "(their stacks are in --json)")
    return lines


def _where(state: RankState) -> str:
    """Where one rank is, in one sentence that cannot contradict itself: the
    collective it waits in (which names the phase it was issued in), else the
    phase its main thread is in."""
    if not state.in_flight:
        return ("in no collective, " + ("outside any phase" if state.phase is None
                                        else f"in {phase_text(state.phase)}"))
    first = state.in_flight[0]
    text = f"waits in {describe_collective(first)}"
    if state.phase is not None and state.phase != first.get("phase"):
        text += f", its main thread now in {phase_text(state.phase)}"
    return text


def main(argv: Sequence[str] | None = None, prog: str = "paddle-muon-ext hangs") -> int:
    """Entry point of ``paddle-muon-ext hangs``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return guarded(lambda: _main(argv, prog), json_mode="--json" in argv)


def _main(argv: list, prog: str) -> int:
    parser = ArgumentParser(
        prog=prog,
        description="Name the rank(s) a hung job waits for - or, when ranks raised, the "
                    "exception that ended the job - from the Muon optimizer's "
                    "flight-recorder dumps. Exit 0 with a report, 2 on bad input.")
    parser.add_argument("log_dir", metavar="LOG_DIR",
                        help="directory the ranks dumped into (the launcher's --log_dir)")
    parser.add_argument("--json", action="store_true",
                        help="print the report as JSON on stdout")
    args = parser.parse_args(argv)
    try:
        dumps = load_dumps(args.log_dir)
    except DumpError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    lines, verdict = _report(dumps)
    if args.json:
        emit_json({
            "verdict": verdict["kind"],
            "raised": {str(r): v for r, v in verdict["raised"].items()},
            "ranks": {str(r): {"pid": d.get("pid"), "host": d.get("host"),
                               "phase": d.get("phase"), "reason": d["reason"],
                               "in_flight": [e for e in d["entries"] if e.get("finish") is None],
                               # where the rank is: see stack_of(); null without stacks
                               "stack_thread": (stack_of(d) or {}).get("thread"),
                               "stack": (stack_of(d) or {}).get("frames"),
                               "file": d.get("file"),
                               "later_dumps": [{"file": x["file"], "time": x.get("time"),
                                                "reason": x["reason"]}
                                               for x in d.get("later_dumps") or []],
                               "ignored_dumps": d.get("ignored_dumps") or []}
                      for r, d in sorted(dumps.items())},
            "world_size": max([int(d.get("world_size") or 0) for d in dumps.values()] + [0]),
            "report": lines,
        })
    else:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
