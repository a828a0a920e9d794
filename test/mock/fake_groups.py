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
"""Fake groups, process groups and tasks with Paddle's observable semantics.

``FakeGroup`` subclasses Paddle's own ``Group`` so attribute semantics
(``rank``, ``nranks``, ``world_size``, ``is_member()``, ``get_group_rank``)
are Paddle's, and ``isinstance(g, Group)`` holds. Like Paddle's ``new_group``,
a rank outside the group, or the only rank of a single-rank group, gets
``rank == -1`` and no process group; Paddle's collectives silently return
None on such groups, and so do the fakes (the recorder still logs the call).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from paddle.distributed.communication.group import Group

if TYPE_CHECKING:
    from .fake_comm import FakeComm

# Paddle's first dynamic group id is 10 (``_new_ring_id`` adds max(nrings, 9)
# to a counter starting at 1); the global group is 0. Mirrored so ids in
# traces look like the ones in real logs.
FIRST_GROUP_ID = 10
GLOBAL_GROUP_ID = 0


class CompletedTask:
    """A task that is already done (record-only mode, or a finished op).

    Mirrors the methods of ``paddle.base.core.task``.
    """

    __slots__ = ("_sync",)

    def __init__(self, sync: bool = True) -> None:
        self._sync = sync

    def wait(self, timeout: Any = None) -> bool:
        """Return immediately.

        Args:
            timeout: ignored (Paddle accepts one).

        Returns:
            True.
        """
        return True

    def is_completed(self) -> bool:
        """Returns: True."""
        return True

    def is_sync(self) -> bool:
        """Returns: whether the op was issued with ``sync_op=True``."""
        return self._sync

    def synchronize(self) -> None:
        """No-op."""


class FakeProcessGroup:
    """Stand-in for ``group.process_group`` of a member rank.

    Only what the Muon sharding code and Paddle's FusedCommBuffer use:
    ``all_gather(in, out)`` (the ``sync_params`` path), coalescing begin/end,
    and the introspection getters.

    Args:
        comm: the fake communication layer that executes the ops.
        group: the group this process group belongs to.
    """

    def __init__(self, comm: "FakeComm", group: "FakeGroup") -> None:
        self._comm = comm
        self._group = group

    def all_gather(self, in_tensor: Any, out_tensor: Any, sync_op: bool = False) -> Any:
        """Gather ``in_tensor`` of every member into ``out_tensor`` (group order).

        Args:
            in_tensor: this rank's shard (may be a ``_slice`` of ``out_tensor``).
            out_tensor: receives nranks x numel(in_tensor) elements.
            sync_op: Paddle's default here is False (caller waits the task).

        Returns:
            A task with ``wait()`` / ``is_completed()``.
        """
        return self._comm.all_gather_into_tensor(
            out_tensor, in_tensor, self._group, sync_op, api="pg.all_gather"
        )

    def _start_coalescing(self) -> None:
        """Open a coalescing block on this group (recorded as a marker)."""
        self._comm.start_coalescing(self._group)

    def _end_coalescing(self, tasks: Optional[list] = None) -> None:
        """Close the innermost coalescing block (recorded as a marker).

        Args:
            tasks: the tasks issued in the block; waited by the caller, as
                with Paddle.
        """
        self._comm.end_coalescing(self._group, tasks)

    def rank(self) -> int:
        """Returns: this rank's index in the group."""
        return self._group.rank

    def size(self) -> int:
        """Returns: the number of ranks in the group."""
        return self._group.nranks

    def name(self) -> str:
        """Returns: the backend name shown by ``group.backend``."""
        return "MOCK"

    def __repr__(self) -> str:
        return f"FakeProcessGroup(group_id={self._group.id}, ranks={self._group.ranks})"


class FakeGroup(Group):
    """Paddle ``Group`` created by the fake ``new_group`` (or the global group).

    Args:
        rank_in_group: index of the creating rank in ``ranks``; -1 when it is
            not a member or the group has a single rank (Paddle's rule).
        gid: group id (identical on all ranks if all create groups in the
            same order).
        ranks: sorted global ranks.
        comm: the fake layer; a process group is attached when
            ``rank_in_group >= 0``.
        owner_rank: the global rank that created this object.
    """

    def __init__(
        self,
        rank_in_group: int,
        gid: int,
        ranks: tuple,
        comm: "FakeComm",
        owner_rank: int,
    ) -> None:
        pg = None
        super().__init__(rank_in_group, gid, list(ranks), pg=None, name=f"_default_pg{gid}")
        if rank_in_group >= 0:
            pg = FakeProcessGroup(comm, self)
            self._pg = pg
        # Kept as a tuple: records reference it (interned across ranks).
        self.ranks_tuple = ranks
        self.owner_rank = owner_rank

    def __repr__(self) -> str:
        return (
            f"FakeGroup(id={self.id}, ranks={list(self.ranks_tuple)}, "
            f"rank={self.rank}, created_by={self.owner_rank})"
        )
