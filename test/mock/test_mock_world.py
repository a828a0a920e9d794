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
"""Self-tests: simulated world behaviour (rendezvous, failures, deadlocks,
patch restoration, thread-local rank view) and its scale targets."""

from __future__ import annotations

import threading
import time

import numpy as np
import paddle
import paddle.distributed as dist
import unittest
from paddle.distributed import fleet

from mock.fake_comm import DeadlockError, NonMemberCollectiveError
from mock.fake_hcg import make_hcg_factory, make_hybrid_strategy
from mock.patching import fake_distributed, patch_points
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.runtime import comm_phase
from mock.schedule_checker import check_schedule
from mock.simulated_world import RankFailedError, SimulatedWorld

_MISSING = object()


def _snapshot() -> list[object]:
    """What each patch point holds right now (its own attribute, not inherited)."""
    return [vars(owner).get(attr, _MISSING) for owner, attr in patch_points()]


def _assert_restored(before: list[object], when: str) -> None:
    after = _snapshot()
    changed = [f"{getattr(o, '__name__', type(o).__name__)}.{a}"
               for (o, a), x, y in zip(patch_points(), before, after) if x is not y]
    assert not changed, f"{when}: not restored: {changed}"


# ----------------------------------------------------------------- patching
N_MATRICES = 8


def _mini_sharding_step(rank: int, lr: float = 0.5) -> dict[str, np.ndarray]:
    """A stand-in for the Muon sharding step: whole 2-D params reduced to an
    owner in the sharding group (coalesced), updated there, broadcast back;
    1-D params reduce-scattered into a fused buffer's ``_slice`` and
    all-gathered with ``process_group.all_gather(slice, full)``; an expert
    weight reduced in the moe_sharding group."""
    hcg = fleet.get_hybrid_communicate_group()
    sharding = hcg.get_sharding_parallel_group()
    moe = hcg.get_moe_sharding_parallel_group()
    params = {f"w{i}": paddle.full([64, 64], float(i)) for i in range(N_MATRICES)}
    grads = {name: paddle.full([64, 64], float(rank + i)) for i, name in enumerate(params)}
    owners = {name: sharding.ranks[i % sharding.nranks] for i, name in enumerate(params)}

    tasks: list = []
    with dist.communication.batch_isend_irecv._coalescing_manager(sharding, tasks):
        for name, grad in grads.items():
            tasks.append(dist.reduce(grad, dst=owners[name], op=dist.ReduceOp.AVG,
                                     group=sharding, sync_op=False))
    for task in tasks:
        task.wait()
    for name, param in params.items():
        if owners[name] == rank:
            param.set_value(param - lr * grads[name])
        dist.broadcast(param, src=owners[name], group=sharding)

    expert = paddle.full([2, 64, 64], float(rank))
    dist.reduce(expert, dst=moe.ranks[0], op=dist.ReduceOp.AVG, group=moe)

    n = sharding.nranks
    flat = paddle.zeros([n * 8])  # two 1-D params fused, padded to n*8
    grad_buf = paddle.full([n * 8], float(rank))
    shard = grad_buf._slice(sharding.rank * 8, (sharding.rank + 1) * 8)
    dist.reduce_scatter(shard, grad_buf, op=dist.ReduceOp.AVG, group=sharding, sync_op=False).wait()
    mine = flat._slice(sharding.rank * 8, (sharding.rank + 1) * 8)
    mine.set_value(mine - lr * shard)
    sharding.process_group.all_gather(mine, flat).wait()
    out = {name: p.numpy() for name, p in params.items()}
    out["flat"] = flat.numpy()
    out["expert"] = expert.numpy() if moe.ranks[0] == rank else None
    return out


def fleet_rank_layout(rank: int, ep: int, ms: int, pp: int) -> dict[str, list[int]]:
    """Default order (moe_sharding, pipe, expert): rank = s*pp*ep + p*ep + e."""
    s, rem = divmod(rank, pp * ep)
    p, e = divmod(rem, ep)
    return {
        "stage": sorted(si * pp * ep + p * ep + ei for si in range(ms) for ei in range(ep)),
        "moe": [si * pp * ep + p * ep + e for si in range(ms)],
    }


class TestSimulatedWorld(unittest.TestCase):
    def test_patches_are_restored_after_normal_exit_and_after_exceptions(self) -> None:
        before = _snapshot()
        with fake_distributed(8, rank=3) as comm:
            active = _snapshot()
            # _HYBRID_PARALLEL_GROUP is only saved/restored (Paddle's hcg constructor writes it).
            unpatched = [a for (o, a), x, y in zip(patch_points(), before, active)
                         if x is y and a != "_HYBRID_PARALLEL_GROUP"]
            assert not unpatched, f"patch points not replaced while active: {unpatched}"
            seen = (dist.get_rank(), dist.get_world_size(), comm.current_rank())
            assert seen == (3, 8, 3), f"(rank, world size, bound rank) {seen} inside rank 3"
        _assert_restored(before, "after normal exit")

        with self.assertRaises(KeyError):
            with fake_distributed(8, rank=1):
                raise KeyError("body failed")
        _assert_restored(before, "after the body raised")

        def boom(rank: int) -> None:
            raise ValueError(f"rank {rank} exploded")

        with self.assertRaises(RankFailedError):
            SimulatedWorld(4).run(boom)
        _assert_restored(before, "after SimulatedWorld with a failing rank")

    def test_every_rank_thread_sees_its_own_rank_and_hcg(self) -> None:
        strategy = make_hybrid_strategy(ep=4, moe_sharding=2)

        def body(rank: int) -> tuple:
            hcg = fleet.get_hybrid_communicate_group()
            return (dist.get_rank(), hcg.get_global_rank(), fleet.fleet._hcg is hcg,
                    threading.current_thread().name,
                    fleet.fleet._user_defined_strategy.hybrid_configs["ep_degree"])

        world = SimulatedWorld(8, hcg_factory=make_hcg_factory(ep=4, moe_sharding=2), strategy=strategy)
        for rank, (seen, hcg_rank, same, thread, ep) in enumerate(world.run(body)):
            assert seen == rank and hcg_rank == rank, f"rank {rank} saw get_rank()={seen}, hcg rank {hcg_rank}"
            assert same, f"rank {rank}: fleet.fleet._hcg is not its hcg"
            assert thread == f"sim-rank-{rank}" and ep == 4

    def test_phase_labels_come_from_the_provider_in_the_issuing_thread(self) -> None:
        local = threading.local()

        def body(rank: int) -> None:
            local.phase = "grad_reduce"
            dist.reduce(paddle.ones([4]), dst=0, op=dist.ReduceOp.AVG)
            local.phase = "param_sync"
            dist.broadcast(paddle.ones([4]), src=0)

        world = SimulatedWorld(4, phase_provider=lambda: getattr(local, "phase", None))
        world.run(body)
        for rank, trace in enumerate(world.traces):
            assert [(r.op, r.phase) for r in trace] == [("reduce", "grad_reduce"), ("broadcast", "param_sync")], (
                f"rank {rank}: {trace}")


    # --------------------------------------------------------- failure surfacing

    def test_deadlock_is_reported_fast_naming_waiting_and_missing_ranks(self) -> None:
        def body(rank: int) -> None:
            dist.all_reduce(paddle.ones([4]))
            if rank != 2:  # rank 2 skips the reduce and returns
                dist.reduce(paddle.ones([4]), dst=0, op=dist.ReduceOp.AVG)

        start = time.perf_counter()
        with self.assertRaises(DeadlockError) as info:
            SimulatedWorld(4, deadlock_timeout=10).run(body)
        elapsed = time.perf_counter() - start
        text = str(info.exception)
        assert elapsed < 10, f"deadlock took {elapsed:.1f} s to report"
        assert "group 0 [0..3], per-group seq 1, reduce(root=0, op=AVG" in text, text
        assert "ranks [0, 1, 3] are waiting" in text and "rank 2 (already returned)" in text, text
        # The flight recorder's words (paddle-muon-ext hangs) for the same state.
        assert "rank 2 is the rank the others wait for: outside any phase, already returned, it " \
            "has not issued reduce #1 on group 0 [0, 1, 2, 3]" in text, text

    def test_stalled_rank_triggers_the_timeout_with_a_report(self) -> None:
        def body(rank: int) -> None:
            if rank == 1:
                with comm_phase("cross_node_reduce"):
                    time.sleep(1.5)  # stuck outside any collective
            dist.all_reduce(paddle.ones([2]))

        start = time.perf_counter()
        with self.assertRaises(DeadlockError) as info:
            SimulatedWorld(3, deadlock_timeout=0.5).run(body)
        text = str(info.exception)
        assert time.perf_counter() - start < 5
        assert "no collective progressed" in text and "ranks [0, 2] are waiting" in text, text
        assert "rank 1 (running)" in text, text
        assert "rank 1 is the rank the others wait for: in phase 'cross_node_reduce', it has " \
            "not issued all_reduce #0 on group 0 [0, 1, 2]" in text, text
        assert "ranks 0, 2 wait in all_reduce #0 on group 0 [0, 1, 2]" in text, text

    def test_exception_in_one_rank_surfaces_with_its_rank_and_unblocks_the_rest(self) -> None:
        def body(rank: int) -> None:
            dist.all_reduce(paddle.ones([2]))
            if rank == 3:
                raise ValueError("owner map differs")
            dist.all_reduce(paddle.ones([2]))  # the others would wait forever for rank 3

        start = time.perf_counter()
        with self.assertRaises(RankFailedError) as info:
            SimulatedWorld(4).run(body)
        err = info.exception
        assert time.perf_counter() - start < 5, "other ranks were not unblocked promptly"
        assert err.rank == 3 and isinstance(err.original, ValueError), err
        assert "rank 3 of 4 raised ValueError: owner map differs" in str(err)
        assert "traceback in rank 3" in str(err)

    def test_reraise_original_keeps_the_exception_type(self) -> None:
        def body(rank: int) -> None:
            if rank == 1:
                raise ValueError("bad gpn")

        with self.assertRaisesRegex(ValueError, "bad gpn") as info:
            SimulatedWorld(2, reraise_original=True).run(body)
        assert any("rank 1 of 2" in note for note in info.exception.__notes__)

    def test_non_member_collective_fails_at_once_in_data_mode(self) -> None:
        def body(rank: int) -> None:
            pair = dist.new_group([0, 1])
            dist.broadcast(paddle.ones([2]), src=0, group=pair)

        with self.assertRaises(RankFailedError) as info:
            SimulatedWorld(3).run(body)
        assert info.exception.rank == 2 and isinstance(info.exception.original, NonMemberCollectiveError)
        assert "not a member" in str(info.exception)

    def test_group_creation_mismatch_fails_at_once_in_data_mode(self) -> None:
        def body(rank: int) -> None:
            dist.new_group([0, 1] if rank else [1, 2])

        with self.assertRaisesRegex(RankFailedError, "group id 10"):
            SimulatedWorld(3).run(body)


    # ----------------------------------------------------------------- scale

    def test_32_rank_data_world_runs_a_sharding_step_correctly(self) -> None:
        ep, ms, pp, lr = 4, 4, 2, 0.5
        world = SimulatedWorld(32, hcg_factory=make_hcg_factory(ep=ep, moe_sharding=ms, pp=pp))
        results = world.run(_mini_sharding_step)
        print(f"\n32-rank data-moving world: {world.wall_time:.2f} s wall")
        report = world.check_schedule()
        layout = [fleet_rank_layout(r, ep, ms, pp) for r in range(32)]
        for rank, out in enumerate(results):
            stage_ranks = layout[rank]["stage"]
            mean_rank = float(np.mean(stage_ranks))
            for i in range(N_MATRICES):
                expect = i - lr * (mean_rank + i)
                np.testing.assert_allclose(out[f"w{i}"], expect, err_msg=f"rank {rank} param w{i}")
            np.testing.assert_allclose(out["flat"], -lr * mean_rank, err_msg=f"rank {rank} fused 1-D params")
            if out["expert"] is not None:
                np.testing.assert_allclose(out["expert"], np.mean(layout[rank]["moe"]),
                                           err_msg=f"rank {rank} expert grad owner")
        assert report.num_collectives >= 32 * 20, report.summary()

    def test_record_mode_handles_512_ranks(self) -> None:
        ep, ms, pp = 8, 8, 8
        world = SimulatedWorld(512, hcg_factory=make_hcg_factory(ep=ep, moe_sharding=ms, pp=pp),
                               mode="record")
        world.run(_mini_sharding_step)
        start = time.perf_counter()
        report = check_schedule(world.traces)
        check_time = time.perf_counter() - start
        print(f"\n512-rank record-only world: run {world.wall_time:.2f} s, check {check_time:.2f} s, "
              f"{report.num_collectives} collectives")
        assert report.num_ranks == 512 and report.num_collectives >= 512 * 10, report.summary()


if __name__ == "__main__":
    unittest.main()
