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
"""Self-tests: each fake collective against NumPy, in a 4-rank simulated world."""

from __future__ import annotations

import numpy as np
import paddle
import paddle.distributed as dist
import unittest

from mock.fake_comm import InvalidCollectiveError
from mock.fake_groups import CompletedTask
from mock.patching import FakeDistMixin
from mock.simulated_world import RankFailedError, SimulatedWorld

WORLD = 4
DTYPES = ["float32", "float16", "bfloat16"]
# Tolerances per dtype: results are computed in float64 and cast back.
ATOL = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 2e-2}


def _inputs(rank: int, n: int = 12) -> np.ndarray:
    """Distinct, exactly representable-ish values per rank."""
    return (np.arange(n, dtype=np.float64) * 0.5 + rank * 1.25 - 3.0)


def _tensor(values: np.ndarray, dtype: str) -> paddle.Tensor:
    return paddle.cast(paddle.to_tensor(values.astype(np.float32)), dtype)


def _np(t: paddle.Tensor) -> np.ndarray:
    return paddle.cast(t, "float32").numpy().astype(np.float64)


def _expected_input(rank: int, dtype: str, n: int = 12) -> np.ndarray:
    """The input as the rank actually holds it after the cast to ``dtype``."""
    return _np(_tensor(_inputs(rank, n), dtype))


class TestFakeCollectives(FakeDistMixin, unittest.TestCase):
    def test_reduce_reaches_root_and_poisons_others(self) -> None:
        for dtype in DTYPES:
            for op_name in ["SUM", "AVG", "MAX", "MIN"]:
                with self.subTest(dtype=dtype, op_name=op_name):
                    self._reduce_reaches_root_and_poisons_others(dtype, op_name)

    def _reduce_reaches_root_and_poisons_others(self, dtype: str, op_name: str) -> None:
        root = 2
        op = getattr(dist.ReduceOp, op_name)

        def body(rank: int) -> np.ndarray:
            t = _tensor(_inputs(rank), dtype)
            dist.reduce(t, dst=root, op=op, group=None)
            return _np(t)

        out = SimulatedWorld(WORLD).run(body)
        stack = np.stack([_expected_input(r, dtype) for r in range(WORLD)])
        ref = {"SUM": stack.sum(0), "AVG": stack.mean(0), "MAX": stack.max(0), "MIN": stack.min(0)}[op_name]
        np.testing.assert_allclose(out[root], ref, atol=ATOL[dtype] * 10, rtol=ATOL[dtype],
                                   err_msg=f"root {root} holds a wrong {op_name} for {dtype}")
        for r in range(WORLD):
            if r != root:
                assert np.isnan(out[r]).all(), f"non-root rank {r} buffer was not poisoned after reduce"

    def test_reduce_poisoning_can_be_disabled(self) -> None:
        def body(rank: int) -> np.ndarray:
            t = paddle.to_tensor(_inputs(rank).astype(np.float32))
            dist.reduce(t, dst=0)
            return t.numpy()

        out = SimulatedWorld(WORLD, poison_value=None).run(body)
        np.testing.assert_allclose(out[3], _inputs(3), err_msg="rank 3 buffer changed with poison off")

    def test_broadcast_and_all_reduce(self) -> None:
        for dtype in DTYPES:
            with self.subTest(dtype=dtype):
                self._broadcast_and_all_reduce(dtype)

    def _broadcast_and_all_reduce(self, dtype: str) -> None:
        def body(rank: int) -> tuple[np.ndarray, np.ndarray]:
            b = _tensor(_inputs(rank), dtype)
            dist.broadcast(b, src=1)
            a = _tensor(_inputs(rank), dtype)
            dist.all_reduce(a, op=dist.ReduceOp.SUM)
            return _np(b), _np(a)

        out = SimulatedWorld(WORLD).run(body)
        total = np.stack([_expected_input(r, dtype) for r in range(WORLD)]).sum(0)
        expect_total = _np(_tensor(total, dtype))
        for r, (b, a) in enumerate(out):
            np.testing.assert_array_equal(b, _expected_input(1, dtype), err_msg=f"rank {r} broadcast")
            np.testing.assert_allclose(a, expect_total, atol=ATOL[dtype] * 10, rtol=ATOL[dtype],
                                       err_msg=f"rank {r} all_reduce SUM")

    def test_all_gather_list_forms(self) -> None:
        for dtype in DTYPES:
            with self.subTest(dtype=dtype):
                self._all_gather_list_forms(dtype)

    def _all_gather_list_forms(self, dtype: str) -> None:
        def body(rank: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
            mine = _tensor(_inputs(rank), dtype)
            empty: list = []
            dist.all_gather(empty, mine)
            presized = [paddle.zeros([12], dtype=dtype) for _ in range(WORLD)]
            task = dist.stream.all_gather(presized, mine, sync_op=False)
            task.wait()
            return [_np(t) for t in empty], [_np(t) for t in presized]

        out = SimulatedWorld(WORLD).run(body)
        for r, (a, b) in enumerate(out):
            assert len(a) == WORLD, f"rank {r}: empty list was not filled with {WORLD} tensors"
            for src in range(WORLD):
                np.testing.assert_array_equal(a[src], _expected_input(src, dtype),
                                              err_msg=f"rank {r} slot {src} (empty-list form)")
                np.testing.assert_array_equal(b[src], _expected_input(src, dtype),
                                              err_msg=f"rank {r} slot {src} (pre-sized form)")

    def test_process_group_all_gather_into_slice_view(self) -> None:
        for dtype in DTYPES:
            with self.subTest(dtype=dtype):
                self._process_group_all_gather_into_slice_view(dtype)

    def _process_group_all_gather_into_slice_view(self, dtype: str) -> None:
        """FusedCommBuffer.sync_params: ``pg.all_gather(full._slice(b, e), full)``."""
        shard = 3

        def body(rank: int) -> np.ndarray:
            full = paddle.zeros([shard * WORLD], dtype=dtype)
            mine = full._slice(rank * shard, (rank + 1) * shard)
            mine.set_value(_tensor(np.full(shard, rank + 0.5), dtype))
            group = dist.collective._get_default_group()
            group.process_group.all_gather(mine, full).wait()
            return _np(full)

        out = SimulatedWorld(WORLD).run(body)
        expect = np.repeat(np.arange(WORLD) + 0.5, shard)
        for r in range(WORLD):
            np.testing.assert_array_equal(out[r], expect, err_msg=f"rank {r} full buffer after pg.all_gather")

    def test_reduce_scatter_into_slice_of_its_own_input(self) -> None:
        for dtype in DTYPES:
            with self.subTest(dtype=dtype):
                self._reduce_scatter_into_slice_of_its_own_input(dtype)

    def _reduce_scatter_into_slice_of_its_own_input(self, dtype: str) -> None:
        """FusedCommBuffer's 1-D path: the output is a ``_slice`` of the input buffer."""
        shard = 3

        def body(rank: int) -> tuple[np.ndarray, np.ndarray]:
            big = paddle.zeros([2 + shard * WORLD], dtype=dtype)  # offset: the slice is interior
            grad = big._slice(2, 2 + shard * WORLD)
            grad.set_value(_tensor(_inputs(rank, shard * WORLD), dtype))
            out = grad._slice(rank * shard, (rank + 1) * shard)
            task = dist.reduce_scatter(out, grad, op=dist.ReduceOp.AVG, sync_op=False)
            task.wait()
            return _np(big), _np(out)

        out = SimulatedWorld(WORLD).run(body)
        mean = np.stack([_expected_input(r, dtype, shard * WORLD) for r in range(WORLD)]).mean(0)
        for r, (big, shard_out) in enumerate(out):
            expect = mean[r * shard:(r + 1) * shard]
            np.testing.assert_allclose(shard_out, expect, atol=ATOL[dtype] * 10, rtol=ATOL[dtype],
                                       err_msg=f"rank {r} shard")
            np.testing.assert_allclose(big[2 + r * shard: 2 + (r + 1) * shard], expect,
                                       atol=ATOL[dtype] * 10, rtol=ATOL[dtype],
                                       err_msg=f"rank {r}: write did not land in the shared storage")

    def test_reduce_scatter_list_input_and_stream_calc_stream(self) -> None:
        def body(rank: int) -> np.ndarray:
            parts = [paddle.full([2], float(rank * 10 + i)) for i in range(WORLD)]
            out = paddle.zeros([2])
            dist.stream.reduce_scatter(out, parts, op=dist.ReduceOp.SUM, use_calc_stream=True)
            return out.numpy()

        out = SimulatedWorld(WORLD).run(body)
        for r in range(WORLD):
            expect = sum(q * 10 + r for q in range(WORLD))
            np.testing.assert_allclose(out[r], [expect, expect], err_msg=f"rank {r} reduce_scatter list")

    def test_subgroup_reduce_uses_global_root_and_async_tasks(self) -> None:
        def body(rank: int) -> tuple[bool, np.ndarray]:
            odd = dist.new_group([1, 3])
            even = dist.new_group([0, 2])
            group = odd if rank % 2 else even
            t = paddle.full([4], float(rank))
            task = dist.reduce(t, dst=group.ranks[-1], op=dist.ReduceOp.AVG, group=group, sync_op=False)
            task.wait()
            return task.is_completed(), t.numpy()

        out = SimulatedWorld(WORLD).run(body)
        assert all(done for done, _ in out), "is_completed() false after wait()"
        np.testing.assert_allclose(out[3][1], 2.0, err_msg="root 3 should hold mean(1, 3)")
        np.testing.assert_allclose(out[2][1], 1.0, err_msg="root 2 should hold mean(0, 2)")

    def test_parameters_receive_broadcast_without_autograd_history(self) -> None:
        def body(rank: int) -> tuple[np.ndarray, bool]:
            param = paddle.create_parameter([3, 3], "float32")
            param.set_value(np.full((3, 3), rank, dtype=np.float32))
            dist.broadcast(param, src=0)
            return param.numpy(), param.stop_gradient

        out = SimulatedWorld(WORLD).run(body)
        for r, (value, stop_gradient) in enumerate(out):
            np.testing.assert_array_equal(value, 0.0, err_msg=f"rank {r} param after broadcast from 0")
            assert stop_gradient is False, f"rank {r}: param flags changed by the write"

    def test_single_rank_group_and_non_member_return_none_like_paddle(self) -> None:
        fake_dist = self.fake_dist
        comm = fake_dist(4, rank=1)
        solo = dist.new_group([1])
        other = dist.new_group([2, 3])
        assert (solo.rank, solo.is_member(), solo.process_group) == (-1, False, None), (
            f"a one-rank group is no group in Paddle: rank {solo.rank}, member "
            f"{solo.is_member()}, process group {solo.process_group}")
        assert (other.rank, other.process_group) == (-1, None), (
            f"a non-member sees rank {other.rank}, process group {other.process_group}")
        t = paddle.ones([2])
        assert dist.reduce(t, dst=1, group=solo) is None
        assert dist.all_reduce(t, group=other) is None
        recs = [r for r in comm.current().trace if r.op != "new_group"]
        assert [(r.op, r.member) for r in recs] == [("reduce", True), ("all_reduce", False)], recs

    def test_record_mode_returns_completed_tasks_and_moves_no_data(self) -> None:
        fake_dist = self.fake_dist
        comm = fake_dist(4, rank=3)
        t = paddle.full([5], 3.0)
        task = dist.reduce(t, dst=0, op=dist.ReduceOp.AVG, sync_op=False)
        assert isinstance(task, CompletedTask), f"sync_op=True returned {task!r}"
        assert task.is_completed() and task.wait(), "a completed task must report completion"
        gathered: list = []
        dist.all_gather(gathered, t)
        assert len(gathered) == 4
        np.testing.assert_array_equal(t.numpy(), 3.0, err_msg="record mode must not touch data")
        rec = comm.current().trace[-2]
        assert (rec.op, rec.root, rec.reduce_op, rec.dtype, rec.numel, rec.sync_op) == (
            "reduce", 0, "AVG", "float32", 5, False), rec

    def test_all_gather_object_moves_objects_of_different_sizes(self) -> None:
        def body(rank: int):
            gathered: list = []
            dist.all_gather_object(gathered, {"rank": rank, "names": ["w"] * (rank * 7)})
            return gathered

        world = SimulatedWorld(WORLD, mode="data")
        results = world.run(body)
        want = [{"rank": r, "names": ["w"] * (r * 7)} for r in range(WORLD)]
        for rank, got in enumerate(results):
            assert got == want, f"rank {rank} gathered {got}, expected {want}"

    def test_all_gather_object_refuses_record_mode(self) -> None:
        self.fake_dist(4, rank=0)
        with self.assertRaisesRegex(Exception, "needs real data movement"):
            dist.all_gather_object([], {"a": 1})

    def test_invalid_arguments_fail_like_paddle(self) -> None:
        fake_dist = self.fake_dist
        fake_dist(4, rank=0)
        group = dist.new_group([0, 1])
        with self.assertRaisesRegex(InvalidCollectiveError, "dst=3 is not a member"):
            dist.reduce(paddle.ones([2]), dst=3, group=group)
        with self.assertRaisesRegex(RuntimeError, "use_calc_stream"):
            dist.stream.all_reduce(paddle.ones([2]), sync_op=False, use_calc_stream=True)
        with self.assertRaisesRegex(InvalidCollectiveError, "expected 2 x 3"):
            dist.reduce_scatter(paddle.ones([3]), paddle.ones([5]), group=group)

    def test_mismatched_numel_inside_a_collective_fails_every_member(self) -> None:
        def body(rank: int) -> None:
            dist.all_reduce(paddle.ones([4 + (rank == 2)]))

        with self.assertRaises(RankFailedError) as info:
            SimulatedWorld(WORLD).run(body)
        text = str(info.exception)
        assert "per-group seq 0" in text and "numel=5" in text and "numel=4" in text, text

    def test_records_carry_sequence_numbers_blocks_and_roots(self) -> None:
        fake_dist = self.fake_dist
        comm = fake_dist(4, rank=2, phase_provider=lambda: "sync")
        group = dist.new_group([0, 2])
        tasks: list = []
        with dist.communication.batch_isend_irecv._coalescing_manager(group, tasks):
            tasks.append(dist.broadcast(paddle.ones([3], dtype="float16"), src=0, group=group, sync_op=False))
            tasks.append(dist.reduce(paddle.ones([5]), dst=2, op=dist.ReduceOp.AVG, group=group, sync_op=False))
        dist.all_reduce(paddle.ones([7]))
        rows = [(r.rank_seq, r.group_seq, r.op, r.group_id, r.root, r.reduce_op, r.dtype, r.numel, r.block,
                 r.phase) for r in comm.current().trace]
        assert rows == [
            (0, None, "new_group", 10, None, None, None, 2, None, None),
            (1, None, "coalescing_begin", 10, None, None, None, 0, (10, 0), "sync"),
            (2, 0, "broadcast", 10, 0, None, "float16", 3, (10, 0), "sync"),
            (3, 1, "reduce", 10, 2, "AVG", "float32", 5, (10, 0), "sync"),
            (4, None, "coalescing_end", 10, None, None, None, 0, (10, 0), "sync"),
            (5, 0, "all_reduce", 0, None, "SUM", "float32", 7, None, "sync"),
        ], rows


if __name__ == "__main__":
    unittest.main()
