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
"""Schedule checker: do all ranks' traces describe a collective schedule that
a real backend would run without hanging or mixing up buffers?

Checks, per group, that every member issues the same sequence of
``(op, root, reduce op, dtype, numel, coalescing block)``; that no rank
issues on a group it is not in; that all ranks create the same groups in the
same order (Paddle's group ids come from a per-process counter); and that
members open the same number of coalescing blocks. Reports the FIRST
divergence (earliest in the issuing ranks' own order) in domain words.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence, Union

from .comm_record import (
    COLLECTIVE_OPS,
    OP_COALESCE_BEGIN,
    OP_COALESCE_END,
    OP_NEW_GROUP,
    CommRecord,
    describe_signature,
    format_ranks,
)

Traces = Union[Sequence[Sequence[CommRecord]], Mapping[int, Sequence[CommRecord]]]

# Kinds, in the order they are preferred when two divergences tie.
KIND_GROUP_CREATION = "group_creation"
KIND_NON_MEMBER = "non_member"
KIND_MISMATCH = "mismatch"
KIND_MISSING = "missing_participant"
KIND_COALESCING = "coalescing"
_KIND_RANK = {k: i for i, k in enumerate(
    (KIND_GROUP_CREATION, KIND_NON_MEMBER, KIND_MISMATCH, KIND_MISSING, KIND_COALESCING))}


class ScheduleMismatchError(AssertionError):
    """The traces do not form a consistent collective schedule."""


@dataclass
class Divergence:
    """One inconsistency between ranks' traces.

    Attributes:
        kind: "group_creation", "non_member", "mismatch",
            "missing_participant" or "coalescing".
        message: readable multi-line explanation.
        group_id: the group concerned (None for group-creation order).
        group_ranks: its ranks.
        group_seq: per-group sequence number of the divergent collective.
        ranks: the ranks at fault or disagreeing.
        order_key: earliest rank seq involved; smaller = happened first.
    """

    kind: str
    message: str
    group_id: Optional[int] = None
    group_ranks: tuple = ()
    group_seq: Optional[int] = None
    ranks: tuple = ()
    order_key: int = 0

    def sort_key(self) -> tuple:
        """Returns: ordering key, earliest divergence (then kind priority) first."""
        return (self.order_key, _KIND_RANK[self.kind], self.group_id or 0)


@dataclass
class ScheduleReport:
    """Result of ``find_divergences``.

    Attributes:
        divergences: all divergences found, first one first.
        num_ranks: ranks checked.
        num_groups: groups used by collectives.
        num_collectives: collective records checked.
    """

    divergences: list[Divergence] = field(default_factory=list)
    num_ranks: int = 0
    num_groups: int = 0
    num_collectives: int = 0

    @property
    def ok(self) -> bool:
        """Whether no divergence was found."""
        return not self.divergences

    @property
    def first(self) -> Optional[Divergence]:
        """The earliest divergence, or None."""
        return self.divergences[0] if self.divergences else None

    def summary(self, max_others: int = 5) -> str:
        """Readable report: the first divergence in full, then one line each.

        Args:
            max_others: how many further divergences to list.

        Returns:
            The text.
        """
        if self.ok:
            return (f"schedule consistent: {self.num_ranks} ranks, {self.num_groups} groups, "
                    f"{self.num_collectives} collectives")
        lines = [f"Collective schedule diverges ({len(self.divergences)} divergence(s) over "
                 f"{self.num_ranks} ranks). First divergence [{self.first.kind}]:",
                 self.first.message]
        others = self.divergences[1:1 + max_others]
        if others:
            lines.append("Further divergences:")
            lines += [f"  [{d.kind}] " + d.message.splitlines()[0] for d in others]
            if len(self.divergences) > 1 + max_others:
                lines.append(f"  ... and {len(self.divergences) - 1 - max_others} more")
        return "\n".join(lines)


def _as_mapping(traces: Traces) -> dict[int, Sequence[CommRecord]]:
    if isinstance(traces, Mapping):
        return dict(traces)
    return dict(enumerate(traces))


def _bucket(items: dict[int, object]) -> list[tuple[object, list[int]]]:
    """Group ranks by value, biggest bucket first (the 'majority' view)."""
    buckets: dict[object, list[int]] = {}
    for rank, value in items.items():
        buckets.setdefault(value, []).append(rank)
    return sorted(buckets.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))


def _check_group_creation(by_rank: dict[int, Sequence[CommRecord]]) -> list[Divergence]:
    creations = {r: [rec for rec in trace if rec.op == OP_NEW_GROUP] for r, trace in by_rank.items()}
    if not creations:
        return []
    ref_rank = min(creations)
    ref = creations[ref_rank]
    first_bad: Optional[int] = None
    for mine in creations.values():
        n = min(len(mine), len(ref))
        i = 0
        while i < n:
            a, b = mine[i], ref[i]
            # Ranks tuples are interned by FakeComm: identity is the fast path.
            if a.group_id != b.group_id or (a.group_ranks is not b.group_ranks
                                            and a.group_ranks != b.group_ranks):
                break
            i += 1
        if i == n and len(mine) == len(ref):
            continue
        first_bad = i if first_bad is None else min(first_bad, i)
    if first_bad is None:
        return []

    def at(rank: int) -> object:
        recs = creations[rank]
        if first_bad < len(recs):
            return (recs[first_bad].group_id, recs[first_bad].group_ranks)
        return None

    views = _bucket({r: at(r) for r in creations})
    lines = [f"Ranks disagree on their group creations at creation #{first_bad} (all ranks must "
             f"call new_group for the same groups in the same order; group ids are per-process "
             f"counters):"]
    for value, ranks in views:
        if value is None:
            lines.append(f"  ranks {format_ranks(ranks)} created only "
                         f"{len(creations[ranks[0]])} group(s) in total")
        else:
            gid, members = value
            lines.append(f"  ranks {format_ranks(ranks)} created group id {gid} with ranks "
                         f"{format_ranks(members)}")
    minority = [r for _, ranks in views[1:] for r in ranks]
    key = min((creations[r][first_bad].rank_seq for r in creations if first_bad < len(creations[r])),
              default=0)
    return [Divergence(KIND_GROUP_CREATION, "\n".join(lines), ranks=tuple(minority), order_key=key)]


def find_divergences(traces: Traces, *, check_group_creation: bool = True) -> ScheduleReport:
    """Compare all ranks' traces without raising.

    Args:
        traces: per-rank record lists (list indexed by rank, or rank->list).
        check_group_creation: also compare new_group order across ranks.

    Returns:
        A ``ScheduleReport``; ``report.first`` is the earliest divergence.
    """
    by_rank = _as_mapping(traces)
    report = ScheduleReport(num_ranks=len(by_rank))
    divs: list[Divergence] = []
    if check_group_creation:
        divs += _check_group_creation(by_rank)

    # gid -> rank -> collective records (list index == group seq).
    per_group: dict[int, dict[int, list[CommRecord]]] = {}
    group_ranks: dict[int, tuple] = {}
    blocks: dict[int, dict[int, list[CommRecord]]] = {}
    open_blocks: dict[int, dict[tuple, CommRecord]] = {}
    for rank, trace in by_rank.items():
        for rec in trace:
            op = rec.op
            if op == OP_NEW_GROUP:
                continue
            if op == OP_COALESCE_BEGIN:
                blocks.setdefault(rec.group_id, {}).setdefault(rank, []).append(rec)
                group_ranks.setdefault(rec.group_id, rec.group_ranks)
                open_blocks.setdefault(rank, {})[rec.block] = rec
                continue
            if op == OP_COALESCE_END:
                open_blocks.get(rank, {}).pop(rec.block, None)
                continue
            if op not in COLLECTIVE_OPS:
                continue
            report.num_collectives += 1
            group_ranks.setdefault(rec.group_id, rec.group_ranks)
            if not rec.member:
                divs.append(Divergence(
                    KIND_NON_MEMBER,
                    f"Rank {rank} issued {rec.describe()} on group {rec.group_id} "
                    f"{format_ranks(rec.group_ranks)}, which it is not a member of (a real "
                    f"backend errors or hangs)",
                    rec.group_id, rec.group_ranks, rec.group_seq, (rank,), rec.rank_seq))
                continue
            per_group.setdefault(rec.group_id, {}).setdefault(rank, []).append(rec)
    report.num_groups = len(per_group)

    for gid, recs_by_rank in per_group.items():
        members = group_ranks[gid]
        if len(members) < 2:
            continue
        seqs = {r: recs_by_rank.get(r, []) for r in members if r in by_rank}
        longest = max(len(v) for v in seqs.values())
        for i in range(longest):
            sig_at = {r: (v[i].signature() if i < len(v) else None) for r, v in seqs.items()}
            if len(set(sig_at.values())) == 1:
                continue
            divs.append(_group_divergence(gid, members, i, seqs, sig_at))
            break  # later entries of this group only echo the first divergence

    for gid, by_member in blocks.items():
        members = group_ranks[gid]
        counts = {r: len(by_member.get(r, [])) for r in members if r in by_rank}
        if len(set(counts.values())) > 1:
            views = _bucket(counts)
            lines = [f"Coalescing blocks on group {gid} {format_ranks(members)} differ "
                     f"between members:"]
            lines += [f"  ranks {format_ranks(ranks)} opened {n} block(s)" for n, ranks in views]
            low = min(counts.values())
            key = min((recs[low].rank_seq for recs in by_member.values() if len(recs) > low),
                      default=0)
            divs.append(Divergence(KIND_COALESCING, "\n".join(lines), gid, members, None,
                                   tuple(r for _, rs in views[1:] for r in rs), key))
    for rank, still_open in open_blocks.items():
        for block, rec in still_open.items():
            divs.append(Divergence(
                KIND_COALESCING,
                f"Rank {rank} never closed coalescing block (group {block[0]}, #{block[1]}) "
                f"opened at rank seq {rec.rank_seq}",
                block[0], rec.group_ranks, None, (rank,), rec.rank_seq))

    report.divergences = sorted(divs, key=Divergence.sort_key)
    return report


def _group_divergence(gid: int, members: tuple, i: int, seqs: dict[int, list[CommRecord]],
                      sig_at: dict[int, Optional[tuple]]) -> Divergence:
    views = _bucket(sig_at)
    missing = [r for r, s in sig_at.items() if s is None]
    present = [r for r, s in sig_at.items() if s is not None]
    kind = KIND_MISSING if len({sig_at[r] for r in present}) == 1 else KIND_MISMATCH
    lines = [f"Group {gid} (ranks {format_ranks(members)}) diverges at per-group seq {i}:"]
    for sig, ranks in views:
        if sig is None:
            continue
        example = seqs[ranks[0]][i]
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"
        lines.append(f"  {who} issued {describe_signature(sig)}"
                     f"  (e.g. rank {ranks[0]}: rank seq {example.rank_seq}"
                     + (f", phase {example.phase!r}" if example.phase else "") + ")")
    for r in missing:
        done = seqs[r]
        last = (f"; its last op here was seq {len(done) - 1}: {done[-1].describe()}"
                if done else "; it issued nothing on this group")
        lines.append(f"  rank {r} never issued it: missing participant (issued {len(done)} "
                     f"collective(s) on this group{last})")
    order_key = min(seqs[r][i].rank_seq for r in present)
    at_fault = tuple(missing) if kind == KIND_MISSING else tuple(
        r for _, ranks in views[1:] for r in ranks)
    return Divergence(kind, "\n".join(lines), gid, members, i, at_fault, order_key)


def check_schedule(traces: Traces, *, check_group_creation: bool = True) -> ScheduleReport:
    """Assert the traces form a consistent schedule.

    Args:
        traces: per-rank record lists (e.g. ``SimulatedWorld.traces``).
        check_group_creation: also compare new_group order across ranks.

    Returns:
        The (clean) report.

    Raises:
        ScheduleMismatchError: with the first divergence in domain words.
    """
    report = find_divergences(traces, check_group_creation=check_group_creation)
    if not report.ok:
        raise ScheduleMismatchError(report.summary())
    return report
