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
"""Self-tests: the schedule checker flags each class of inconsistency, first one first."""

from __future__ import annotations

from typing import Callable

import paddle
import paddle.distributed as dist
import unittest

from mock.comm_record import CommRecord
from mock.schedule_checker import (
    KIND_COALESCING,
    KIND_GROUP_CREATION,
    KIND_MISMATCH,
    KIND_MISSING,
    KIND_NON_MEMBER,
    ScheduleMismatchError,
    check_schedule,
    find_divergences,
)
from mock.simulated_world import SimulatedWorld

WORLD = 4


def _record(body: Callable[[int], None], world: int = WORLD) -> list[list[CommRecord]]:
    """Run ``body`` on every rank in record-only mode and return the traces."""
    sim = SimulatedWorld(world, mode="record")
    sim.run(body)
    return sim.traces


def _rec(rank: int, seq: int, op: str, gid: int = 10, ranks: tuple = (0, 1), root=None,
         numel: int = 8, rank_seq: int = 0) -> CommRecord:
    return CommRecord(rank_seq, seq, rank, op, gid, ranks, root, "SUM" if op != "broadcast" else None,
                      "float32", numel)


class TestScheduleChecker(unittest.TestCase):
    def test_consistent_schedule_passes(self) -> None:
        def body(rank: int) -> None:
            group = dist.new_group([0, 1, 2, 3])
            pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates all
            pair = pairs[rank // 2]
            dist.reduce(paddle.ones([8]), dst=3, op=dist.ReduceOp.AVG, group=group)
            dist.broadcast(paddle.ones([8]), src=pair.ranks[0], group=pair)
            tasks: list = []
            with dist.communication.batch_isend_irecv._coalescing_manager(group, tasks):
                tasks.append(dist.all_reduce(paddle.ones([2]), group=group, sync_op=False))
            for t in tasks:
                t.wait()

        report = check_schedule(_record(body))
        assert report.ok and report.num_collectives == 12, report.summary()

    def test_hand_made_numel_mismatch_is_reported_in_domain_words(self) -> None:
        traces = [
            [_rec(0, 0, "reduce", root=0, numel=8, rank_seq=3)],
            [_rec(1, 0, "reduce", root=0, numel=6, rank_seq=3)],
        ]
        report = find_divergences(traces, check_group_creation=False)
        first = report.first
        assert first is not None and first.kind == KIND_MISMATCH, report.summary()
        assert (first.group_id, first.group_seq) == (10, 0)
        assert "Group 10 (ranks [0, 1]) diverges at per-group seq 0" in first.message, first.message
        assert "numel=8" in first.message and "numel=6" in first.message, first.message

    def test_rank_deviating_in_numel_root_or_op_order_is_flagged(self) -> None:
        cases = [
            ("numel", lambda t: dist.reduce(paddle.ones([9]), dst=0), "numel=9"),
            ("root", lambda t: dist.reduce(paddle.ones([8]), dst=1), "root=1"),
            ("op", lambda t: dist.broadcast(paddle.ones([8]), src=0), "broadcast(root=0"),
        ]
        for what, deviant, needle in cases:
            with self.subTest(what=what):
                self._rank_deviating_is_flagged(what, deviant, needle)

    def _rank_deviating_is_flagged(self, what, deviant, needle) -> None:
        def body(rank: int) -> None:
            dist.all_reduce(paddle.ones([4]))
            if rank == 2:
                deviant(None)
            else:
                dist.reduce(paddle.ones([8]), dst=0)
            dist.all_reduce(paddle.ones([4]))

        report = find_divergences(_record(body))
        first = report.first
        assert first is not None and first.kind == KIND_MISMATCH, f"{what}: {report.summary()}"
        assert first.group_seq == 1 and first.ranks == (2,), f"{what}: blamed {first.ranks}\n{first.message}"
        assert needle in first.message and "ranks [0, 1, 3] issued reduce(root=0" in first.message, first.message
        with self.assertRaisesRegex(ScheduleMismatchError, "per-group seq 1"):
            check_schedule(_record(body))

    def test_collective_by_a_non_member_is_flagged(self) -> None:
        def body(rank: int) -> None:
            pair = dist.new_group([0, 1])
            if rank in (0, 1, 3):  # rank 3 is not in the pair
                dist.broadcast(paddle.ones([4]), src=0, group=pair)

        first = find_divergences(_record(body)).first
        assert first is not None and first.kind == KIND_NON_MEMBER, first
        assert first.ranks == (3,) and "Rank 3 issued broadcast" in first.message, first.message
        assert "not a member" in first.message

    def test_missing_participant_is_named(self) -> None:
        def body(rank: int) -> None:
            group = dist.new_group([0, 1, 2, 3])
            dist.all_reduce(paddle.ones([4]), group=group)
            if rank != 1:
                dist.reduce(paddle.ones([4]), dst=0, op=dist.ReduceOp.AVG, group=group)

        first = find_divergences(_record(body)).first
        assert first is not None and first.kind == KIND_MISSING, first
        assert first.ranks == (1,) and first.group_seq == 1, first.message
        assert "rank 1 never issued it: missing participant" in first.message, first.message
        assert "its last op here was seq 0: all_reduce" in first.message, first.message

    def test_op_inside_vs_outside_a_coalescing_block_is_flagged(self) -> None:
        def body(rank: int) -> None:
            group = dist.collective._get_default_group()
            tasks: list = []
            if rank == 0:
                tasks.append(dist.reduce(paddle.ones([4]), dst=0, group=group, sync_op=False))
            else:
                with dist.communication.batch_isend_irecv._coalescing_manager(group, tasks):
                    tasks.append(dist.reduce(paddle.ones([4]), dst=0, group=group, sync_op=False))

        report = find_divergences(_record(body))
        kinds = {d.kind for d in report.divergences}
        assert report.first.kind == KIND_MISMATCH and KIND_COALESCING in kinds, report.summary()
        assert "in coalescing block (group 0, #0)" in report.first.message, report.first.message

    def test_different_number_of_coalescing_blocks_is_flagged(self) -> None:
        def body(rank: int) -> None:
            group = dist.collective._get_default_group()
            for _ in range(2 if rank == 3 else 1):
                with dist.communication.batch_isend_irecv._coalescing_manager(group):
                    pass

        first = find_divergences(_record(body)).first
        assert first is not None and first.kind == KIND_COALESCING, first
        assert "ranks [0, 1, 2] opened 1 block(s)" in first.message, first.message
        assert first.ranks == (3,), first.message

    def test_group_creation_order_mismatch_is_reported_first(self) -> None:
        def body(rank: int) -> None:
            first, second = ([0, 1], [2, 3]) if rank != 2 else ([2, 3], [0, 1])
            dist.new_group(first)
            dist.new_group(second)
            dist.all_reduce(paddle.ones([4]))

        report = find_divergences(_record(body))
        first = report.first
        assert first is not None and first.kind == KIND_GROUP_CREATION, report.summary()
        assert "creation #0" in first.message and first.ranks == (2,), first.message
        assert "ranks [0, 1, 3] created group id 10 with ranks [0, 1]" in first.message, first.message


if __name__ == "__main__":
    unittest.main()
