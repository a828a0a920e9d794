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
"""Simulated world: N ranks of real code in one process.

``SimulatedWorld(world_size, ...).run(fn)`` calls ``fn(rank)`` once per rank
with the fake collective layer patched in and ``get_rank()`` answering that
rank. In "data" mode every rank runs in its own thread and collectives move
real data (see ``fake_comm``); in "record" mode ranks run one after another
in the calling thread and collectives only log, which scales to 512+ ranks.
Afterwards ``world.traces`` holds every rank's records for the schedule
checker. Failures never hang: an exception in a rank aborts the others and
is re-raised naming the rank; a deadlock is reported naming who waits on what.
"""

from __future__ import annotations

import threading
import time
import traceback
from typing import Any, Callable, Optional, Sequence, TypeVar

from .comm_record import CommRecord, format_ranks
from .fake_comm import _DEFAULT, DeadlockError, FakeComm, RankAborted
from .patching import install_fake_distributed
from .schedule_checker import ScheduleReport, check_schedule

T = TypeVar("T")


class RankFailedError(RuntimeError):
    """An exception raised inside a simulated rank, re-raised in the caller.

    Attributes:
        rank: the global rank that raised first.
        original: the exception it raised (also ``__cause__``).
        failed_ranks: every rank that raised on its own (not aborted).
    """

    def __init__(self, rank: int, original: BaseException, tb: str, failed_ranks: list[int],
                 world_size: int) -> None:
        others = [r for r in failed_ranks if r != rank]
        also = f" (ranks {format_ranks(others)} raised as well)" if others else ""
        super().__init__(
            f"rank {rank} of {world_size} raised {type(original).__name__}: {original}{also}\n"
            f"--- traceback in rank {rank} ---\n{tb}"
        )
        self.rank = rank
        self.original = original
        self.failed_ranks = failed_ranks


class SimulatedWorld:
    """Run a per-rank function on every rank of a fake world.

    Args:
        world_size: number of global ranks.
        hcg_factory: ``hcg_factory(rank)`` builds the rank's hybrid
            communicate group before ``fn`` runs (e.g.
            ``make_hcg_factory(ep=4, moe_sharding=2)``); it is then returned
            by ``fleet.get_hybrid_communicate_group()`` in that rank.
        strategy: ``fleet.fleet._user_defined_strategy`` during the run.
        mode: "data" (threads, real data movement) or "record" (sequential,
            log only).
        deadlock_timeout: seconds without progress before waiting ranks fail
            (a certain deadlock, every running rank waiting, fails at once).
        poison_value: written into non-root buffers after a reduce; None
            disables poisoning.
        phase_provider: phase label getter; default: the optimizer's
            ``phase_of_thread`` when importable.
        strict_membership: raise at once on a collective issued on a group
            the rank is not in (data mode).
        reraise_original: re-raise a failing rank's own exception (with a
            note naming the rank) instead of ``RankFailedError``.
        abort_grace: seconds to let ranks unwind after an abort before
            giving up on them (they are daemon threads).

    Attributes:
        traces: per-rank ``CommRecord`` lists of the last run.
        comm: the ``FakeComm`` of the last run.
        wall_time: seconds the last run took.
    """

    def __init__(
        self,
        world_size: int,
        hcg_factory: Optional[Callable[[int], Any]] = None,
        strategy: Any = None,
        mode: str = "data",
        deadlock_timeout: float = 10.0,
        *,
        poison_value: Optional[float] = float("nan"),
        phase_provider: Any = _DEFAULT,
        strict_membership: bool = True,
        reraise_original: bool = False,
        abort_grace: float = 5.0,
    ) -> None:
        self.world_size = world_size
        self.hcg_factory = hcg_factory
        self.strategy = strategy
        self.mode = mode
        self.deadlock_timeout = deadlock_timeout
        self.poison_value = poison_value
        self.phase_provider = phase_provider
        self.strict_membership = strict_membership
        self.reraise_original = reraise_original
        self.abort_grace = abort_grace
        self.comm: Optional[FakeComm] = None
        self.traces: list[list[CommRecord]] = []
        self.wall_time = 0.0
        self.unwaited: dict[int, int] = {}
        self._ranks: Sequence[int] = range(world_size)

    def run(self, fn: Callable[[int], T], ranks: Optional[Sequence[int]] = None) -> list[T]:
        """Run ``fn(rank)`` on every rank.

        Args:
            fn: per-rank body; runs with the fake layer active and the rank
                bound to its thread (its hcg, if any, already built).
            ranks: "record" mode only: run just these ranks, in this order
                (the others' results are None and their traces empty), e.g.
                one rank per class of a large world.

        Returns:
            ``fn``'s return values indexed by rank.

        Raises:
            RankFailedError: a rank raised (other ranks were aborted).
            DeadlockError: ranks waited on collectives that cannot complete.
        """
        if ranks is not None and self.mode != "record":
            raise ValueError("run(ranks=...) needs mode='record': in data mode every rank "
                             "of a collective must run")
        self._ranks = range(self.world_size) if ranks is None else list(ranks)
        comm = FakeComm(
            self.world_size, self.mode, hcg_factory=self.hcg_factory,
            phase_provider=self.phase_provider, poison_value=self.poison_value,
            strict_membership=self.strict_membership, deadlock_timeout=self.deadlock_timeout,
        )
        self.comm = comm
        self.unwaited = {}
        results: list[Any] = [None] * self.world_size
        start = time.perf_counter()
        try:
            with install_fake_distributed(comm, self.strategy):
                if self.mode == "record":
                    self._run_sequential(comm, fn, results)
                else:
                    self._run_threads(comm, fn, results)
        finally:
            self.traces = comm.traces
            self.wall_time = time.perf_counter() - start
        self._raise_failures(comm)
        return results

    def check_schedule(self) -> ScheduleReport:
        """Run the schedule checker on the last run's traces.

        Returns:
            The report.

        Raises:
            ScheduleMismatchError: with the first divergence.
        """
        return check_schedule(self.traces)

    # ------------------------------------------------------------ internals
    def _rank_body(self, comm: FakeComm, fn: Callable[[int], Any], rank: int,
                   results: list[Any]) -> None:
        try:
            ctx = comm.bind(rank)
            results[rank] = fn(rank)
            if self.mode == "data":
                left = comm.flush(rank)
                if left:
                    self.unwaited[rank] = left
            if self.mode == "record":
                ctx.hcg = None  # 512 hcgs with full topologies would pile up
        except (RankAborted, DeadlockError):
            if comm.abort is None:  # not collateral damage: a genuine error
                comm.fail(rank, *_exc_and_tb())
        except BaseException:  # noqa: BLE001 - re-raised in the main thread
            comm.fail(rank, *_exc_and_tb())
        finally:
            comm.unbind()
            comm.finish(rank)

    def _run_sequential(self, comm: FakeComm, fn: Callable[[int], Any], results: list[Any]) -> None:
        for rank in self._ranks:
            self._rank_body(comm, fn, rank, results)
            if comm.failures:
                return

    def _run_threads(self, comm: FakeComm, fn: Callable[[int], Any], results: list[Any]) -> None:
        comm.expect_ranks(range(self.world_size))
        threads = [
            threading.Thread(target=self._rank_body, args=(comm, fn, r, results),
                             name=f"sim-rank-{r}", daemon=True)
            for r in range(self.world_size)
        ]
        for t in threads:
            t.start()
        aborted_at: Optional[float] = None
        while True:
            alive = [t for t in threads if t.is_alive()]
            if not alive:
                break
            if comm.abort is not None:
                aborted_at = aborted_at or time.monotonic()
                if time.monotonic() - aborted_at > self.abort_grace:
                    break  # ranks stuck outside collectives: give up on them
            else:
                comm.check_stall()
            alive[0].join(timeout=0.05)

    def _raise_failures(self, comm: FakeComm) -> None:
        if comm.failures:
            rank, exc, tb = comm.failures[0]
            failed = sorted({r for r, _, _ in comm.failures})
            if self.reraise_original:
                exc.add_note(f"[simulated world] raised on rank {rank} of {self.world_size}; "
                             f"other ranks were aborted")
                raise exc
            raise RankFailedError(rank, exc, tb, failed, self.world_size) from exc
        if comm.abort is not None:
            kind, message = comm.abort
            if kind == "deadlock":
                raise DeadlockError(message)
            raise RankAborted(message)


def _exc_and_tb() -> tuple[BaseException, str]:
    import sys

    exc = sys.exc_info()[1]
    return exc, traceback.format_exc()
