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
"""Communication records: what one rank asked the fake collective layer to do.

A record is plain data so that traces can be printed, compared across ranks
by the schedule checker, and asserted on in tests without any Paddle object
kept alive (512-rank traces must stay cheap).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

# Paddle's ReduceOp values (paddle.distributed.ReduceOp) -> readable names.
REDUCE_OP_NAMES: dict[int, str] = {0: "SUM", 1: "MAX", 2: "MIN", 3: "PROD", 4: "AVG"}

# Op names used in records.
OP_NEW_GROUP = "new_group"
OP_COALESCE_BEGIN = "coalescing_begin"
OP_COALESCE_END = "coalescing_end"
COLLECTIVE_OPS = ("reduce", "broadcast", "all_reduce", "all_gather", "reduce_scatter")
# Ops that are markers, not collectives: they carry no per-group sequence number.
MARKER_OPS = (OP_NEW_GROUP, OP_COALESCE_BEGIN, OP_COALESCE_END)

PhaseProvider = Callable[[], Optional[str]]

_PHASE_MODULE = (
    "paddle_muon_ext.distributed.fleet.meta_optimizers.muon_flight.recorder"
)


def default_phase_provider() -> PhaseProvider | None:
    """Return the optimizer's ``phase_of_thread`` if it can be imported.

    Returns:
        The thread-local phase getter of the Muon sharding optimizer, or None
        when the package (or that module) is not importable, in which case
        records carry ``phase=None``.
    """
    try:
        import importlib

        module = importlib.import_module(_PHASE_MODULE)
    except ImportError:
        return None
    return getattr(module, "phase_of_thread", None)


def reduce_op_name(op: object) -> str:
    """Map a Paddle ReduceOp (int-like) to its name, e.g. ``4 -> "AVG"``.

    Args:
        op: the ``op`` argument a collective was called with.

    Returns:
        "SUM", "MAX", "MIN", "PROD", "AVG", or ``str(op)`` when unknown.
    """
    try:
        return REDUCE_OP_NAMES[int(op)]
    except (KeyError, TypeError, ValueError):
        return str(op)


@dataclass(slots=True)
class CommRecord:
    """One communication event issued by one rank.

    Attributes:
        rank_seq: index of this event in the issuing rank's trace.
        group_seq: index of this collective among the collectives the rank
            issued on this group (None for markers: group creation and
            coalescing begin/end).
        rank: issuing GLOBAL rank.
        op: "reduce", "broadcast", "all_reduce", "all_gather",
            "reduce_scatter", "new_group", "coalescing_begin" or
            "coalescing_end".
        group_id: id of the group (the global group is 0).
        group_ranks: sorted global ranks of the group.
        root: GLOBAL rank of the reduce destination / broadcast source.
        reduce_op: "SUM"/"AVG"/... for reducing collectives, else None.
        dtype: dtype name of the communicated tensor ("float32", ...).
        numel: element count each rank contributes (for reduce_scatter: the
            element count of the output shard).
        block: coalescing block the op was issued in, as
            ``(coalescing group id, k)`` = the k-th block this rank opened on
            that group; None outside any block. Comparable across ranks.
        phase: optimizer phase label at issue time (or None).
        sync_op: the ``sync_op`` argument (None for markers).
        api: entry point used, e.g. "dist.reduce", "stream.reduce",
            "pg.all_gather".
        member: whether ``rank`` is in ``group_ranks``.
    """

    rank_seq: int
    group_seq: Optional[int]
    rank: int
    op: str
    group_id: int
    group_ranks: tuple
    root: Optional[int] = None
    reduce_op: Optional[str] = None
    dtype: Optional[str] = None
    numel: int = 0
    block: Optional[tuple] = None
    phase: Optional[str] = None
    sync_op: Optional[bool] = None
    api: str = ""
    member: bool = True

    def signature(self) -> tuple:
        """What every member of the group must agree on for this collective.

        Returns:
            ``(op, root, reduce_op, dtype, numel, block)``.
        """
        return (self.op, self.root, self.reduce_op, self.dtype, self.numel, self.block)

    def describe(self, with_context: bool = True) -> str:
        """Readable one-liner, e.g. ``reduce(root=4, AVG, float32, numel=4096)``.

        Args:
            with_context: also append rank seq, phase and coalescing block.

        Returns:
            The description.
        """
        return describe_signature(self.signature(), self if with_context else None)


def describe_signature(sig: tuple, record: CommRecord | None = None) -> str:
    """Render a ``CommRecord.signature()`` tuple in domain words.

    Args:
        sig: ``(op, root, reduce_op, dtype, numel, block)``.
        record: when given, adds its rank seq, phase and api.

    Returns:
        e.g. ``reduce(root=4, op=AVG, float32, numel=4096) in coalescing block
        (group 12, #0) [rank seq 57, phase 'grad_reduce']``.
    """
    op, root, reduce_op, dtype, numel, block = sig
    args = []
    if root is not None:
        args.append(f"root={root}")
    if reduce_op is not None:
        args.append(f"op={reduce_op}")
    if dtype is not None:
        args.append(str(dtype))
    args.append(f"numel={numel}")
    text = f"{op}({', '.join(args)})"
    if block is not None:
        text += f" in coalescing block (group {block[0]}, #{block[1]})"
    if record is not None:
        extra = [f"rank seq {record.rank_seq}"]
        if record.phase is not None:
            extra.append(f"phase {record.phase!r}")
        if record.api:
            extra.append(f"via {record.api}")
        text += " [" + ", ".join(extra) + "]"
    return text


def format_ranks(ranks: tuple | list) -> str:
    """Compact rank list: ``[0..7]`` for contiguous runs, else ``[0, 2, 5]``.

    Args:
        ranks: global ranks.

    Returns:
        The rendered list.
    """
    ranks = list(ranks)
    if len(ranks) > 3 and ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"[{ranks[0]}..{ranks[-1]}]"
    if len(ranks) > 24:
        head = ", ".join(map(str, ranks[:20]))
        return f"[{head}, ... ({len(ranks)} ranks)]"
    return "[" + ", ".join(map(str, ranks)) + "]"


def format_trace(trace: list[CommRecord], include_groups: bool = False) -> str:
    """Multi-line dump of one rank's trace, for debugging failed tests.

    Args:
        trace: one rank's records.
        include_groups: also list ``new_group`` records (there are thousands
            of them with a real hybrid topology).

    Returns:
        One line per record.
    """
    lines = []
    for rec in trace:
        if rec.op == OP_NEW_GROUP and not include_groups:
            continue
        where = f"group {rec.group_id} {format_ranks(rec.group_ranks)}"
        seq = "" if rec.group_seq is None else f" g#{rec.group_seq}"
        lines.append(f"{rec.rank_seq:5d}{seq:>6} {where}: {rec.describe(with_context=False)}"
                     + (f" phase={rec.phase}" if rec.phase else ""))
    return "\n".join(lines)
