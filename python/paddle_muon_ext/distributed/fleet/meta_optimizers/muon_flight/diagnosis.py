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
"""Reading flight-recorder dumps: who waits for whom (:func:`diagnose`).

The dump format the recorder (``recorder``) writes and the
``paddle-muon-ext hangs`` tool reads: :data:`DUMP_FORMAT`, the file prefix,
the fields of one collective (:data:`FIELDS`), and the analysis that names
the rank the others wait for. Standard library only: ``hangs`` reads dumps
where paddle is not installed.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Mapping, Sequence

__all__ = [
    "DUMP_FORMAT",
    "DUMP_PREFIX",
    "FIELDS",
    "RankState",
    "describe_collective",
    "diagnose",
    "phase_text",
]

DUMP_PREFIX = "muon_flight_rank"
DUMP_FORMAT = "paddle_muon_ext.flight_recorder/1"
# Field order of one ring-buffer entry (a list: cheapest to build per collective).
FIELDS = (
    "seq", "group_seq", "phase", "op", "group_id", "group_ranks", "root",
    "dtype", "numel", "start", "finish",
)


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

    A rank that waits for nobody (every peer issued its collective) may wait
    for a peer that has left that collective: the peer finished it (or gave
    up on it) and is in no collective or in a later one. Such a peer is named
    in the words ``rank R has left the collective the others wait in``.

    Returns:
        Report lines; the first says who is stuck, in the words
        ``rank R is the rank the others wait for`` or ``rank R has left the
        collective the others wait in`` (or that none is waiting).
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
    lines.extend(_left_lines(states, waits))
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


def _where_now(state: RankState) -> str:
    if state.in_flight:
        return f"waiting in {describe_collective(state.in_flight[0])}"
    return "in no collective, " + ("outside any phase" if state.phase is None
                                   else f"in {phase_text(state.phase)}")


def _left_lines(states: Mapping[int, RankState],
                waits: Mapping[int, tuple[dict, list[int]]]) -> list[str]:
    """Lines naming the peers that left a collective a rank still waits in.

    Only ranks that wait for nobody are looked at (the others' waits are
    explained by the ranks they wait for): a peer that issued the collective
    and holds no unfinished entry of it has left it.
    """
    alone = [(rank, e) for rank, (e, behind) in sorted(waits.items()) if not behind]
    if not alone:
        return []
    # (group id, ranks, group_seq) -> ranks still inside that collective
    inside: dict[tuple, set[int]] = {}
    for rank, state in states.items():
        for f in state.in_flight:
            inside.setdefault((f["group_id"], tuple(f["group_ranks"]), f["group_seq"]),
                              set()).add(rank)
    left: dict[tuple, tuple[dict, list[int], list[int]]] = {}
    for rank, e in alone:
        k = (e["group_id"], tuple(e["group_ranks"]), e["group_seq"])
        peers = [p for p in k[1] if p != rank and p in states and p not in inside.get(k, ())]
        if peers:
            left.setdefault(k, (e, peers, []))[2].append(rank)
    lines = []
    for e, peers, waiters in left.values():
        one = len(peers) == 1
        lines.append(f"{_ranks(peers)} {'has' if one else 'have'} left the collective the "
                     f"others wait in: {_ranks(waiters)} {'waits' if len(waiters) == 1 else 'wait'}"
                     f" in {describe_collective(e)}, which {'it' if one else 'they'} issued "
                     f"and {'is' if one else 'are'} no longer in")
        for p in peers[:_LIST_SHOWN]:
            state = states[p]
            last = (describe_collective(state.last_finished) if state.last_finished
                    else "none recorded")
            lines.append(f"  rank {p} is now {_where_now(state)}; its last finished "
                         f"collective: {last}")
        if len(peers) > _LIST_SHOWN:
            lines.append(f"  ... and {len(peers) - _LIST_SHOWN} more ranks that left it")
    return lines
