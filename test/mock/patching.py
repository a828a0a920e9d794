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
"""One context manager that routes Paddle's collective entry points to a FakeComm.

Everything is patched with ``unittest.mock.patch.object`` inside one
``ExitStack``, so all originals are restored on exit, including when the
body raised. Code under test must look the entry points up at call time
(``paddle.distributed.reduce(...)``), which is what the Muon sharding
optimizer does; names bound by ``from paddle.distributed import reduce`` at
import time are not affected.

Thread-local views: ``get_rank()``, ``fleet.get_hybrid_communicate_group()``
and ``fleet.fleet._hcg`` answer for the rank bound to the calling thread.
Module globals cannot be thread-local: ``topology._HYBRID_PARALLEL_GROUP`` is
last-writer-wins while the patch is active (and restored afterwards).
"""

from __future__ import annotations

import contextlib
import logging
import pickle
from typing import Any, Callable, Iterator, Optional
from unittest import mock

import numpy as np

import paddle
import paddle.distributed as dist
import paddle.distributed.collective as dist_collective
import paddle.distributed.communication.batch_isend_irecv as dist_batch
import paddle.distributed.communication.group as dist_group
import paddle.distributed.communication.stream as dist_stream
from paddle.distributed import fleet
from paddle.base import unique_name
from paddle.distributed.fleet.base import topology as fleet_topology

from .comm_record import format_ranks
from .fake_comm import _DEFAULT, FakeComm, FakeCommError

_ACTIVE: list[FakeComm] = []

# A silent logger for Paddle's topology module: building a real
# EPHybridCommunicateGroup logs every group list (megabytes at 512 ranks).
_QUIET_LOGGER = logging.getLogger("paddle_muon_ext.test.mock.quiet_topology")
_QUIET_LOGGER.setLevel(logging.CRITICAL)
_QUIET_LOGGER.propagate = False
_QUIET_LOGGER.addHandler(logging.NullHandler())


def active_comm() -> FakeComm:
    """Returns: the FakeComm whose patches are installed.

    Raises:
        FakeCommError: when no fake layer is active.
    """
    if not _ACTIVE:
        raise FakeCommError("no fake distributed layer is active (use fake_distributed / SimulatedWorld)")
    return _ACTIVE[-1]


def patch_points() -> list[tuple[Any, str]]:
    """Every ``(owner, attribute)`` the fake layer replaces.

    Returns:
        The list, for tests that check the originals are restored.
    """
    points: list[tuple[Any, str]] = []
    for name in ("reduce", "broadcast", "all_reduce", "all_gather", "reduce_scatter",
                 "new_group", "get_rank", "get_world_size", "is_initialized",
                 "all_gather_object"):
        points.append((dist, name))
    for name in ("reduce", "broadcast", "all_reduce", "all_gather", "reduce_scatter"):
        points.append((dist_stream, name))
    points += [
        (dist_collective, "new_group"),
        (dist_collective, "_get_default_group"),
        (dist_group, "_get_global_group"),
        (dist_batch, "_coalescing_manager"),
        (fleet, "get_hybrid_communicate_group"),
        (type(fleet.fleet), "_hcg"),
        (fleet.fleet, "_user_defined_strategy"),
        (fleet_topology, "_HYBRID_PARALLEL_GROUP"),
        (fleet_topology, "logger"),
        (fleet_topology, "check_nccl_version_for_p2p"),
        (fleet_topology.CommunicateTopology, "get_comm_list"),
        (unique_name, "generator"),
        (unique_name, "dygraph_parameter_name_checker"),
    ]
    return points


class _PerRank:
    """Dispatch to one instance of ``factory()`` per simulated rank."""

    def __init__(self, comm: FakeComm, fallback: Any, factory: Callable[[], Any]) -> None:
        self._comm, self._fallback, self._factory = comm, fallback, factory
        self._per_rank: dict[int, Any] = {}

    def _target(self) -> Any:
        ctx = getattr(self._comm._tls, "ctx", None) or self._comm._default_ctx
        if ctx is None:
            return self._fallback
        target = self._per_rank.get(ctx.rank)
        if target is None:
            target = self._per_rank.setdefault(ctx.rank, self._factory())
        return target

    def __call__(self, *args: Any) -> Any:
        return self._target()(*args)

    def __getattr__(self, item: str) -> Any:
        return getattr(self._target(), item)


# In separate processes every rank numbers its names (parameters,
# optimizer accumulators such as ``w_moment1_0``) from zero and checks
# parameter-name clashes on its own; threads sharing the process-global
# counter would get different, racy names and break checkpoints keyed by them.
def _per_rank_name_generator(comm: FakeComm) -> _PerRank:
    return _PerRank(comm, unique_name.generator, unique_name.UniqueNameGenerator)


def _per_rank_name_checker(comm: FakeComm) -> _PerRank:
    return _PerRank(comm, unique_name.dygraph_parameter_name_checker,
                    unique_name.DygraphParameterNameChecker)


def _replacements(comm: FakeComm, strategy: Any) -> dict[tuple[int, str], Any]:
    """Build the fake for every patch point (keyed by (id(owner), attr))."""

    def d_reduce(tensor, dst, op=dist.ReduceOp.SUM, group=None, sync_op=True):
        return comm.reduce(tensor, dst, op, group, sync_op, api="dist.reduce")

    def d_broadcast(tensor, src, group=None, sync_op=True):
        return comm.broadcast(tensor, src, group, sync_op, api="dist.broadcast")

    def d_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, sync_op=True):
        return comm.all_reduce(tensor, op, group, sync_op, api="dist.all_reduce")

    def d_all_gather(tensor_list, tensor, group=None, sync_op=True):
        return comm.all_gather(tensor_list, tensor, group, sync_op, api="dist.all_gather")

    def d_all_gather_object(object_list, obj, group=None):
        # Paddle's own calls the module-level all_gather, which this layer
        # does not patch; the same two steps here: lengths, then padded pickles.
        if comm.mode != "data":
            raise FakeCommError(
                "dist.all_gather_object needs real data movement; run the world in "
                "mode='data' (record mode moves nothing)"
            )
        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        lengths: list = []
        comm.all_gather(lengths, paddle.to_tensor([data.size], dtype="int64"), group, True,
                        api="dist.all_gather_object")
        sizes = [int(t.item()) for t in lengths]
        padded = np.zeros(max(sizes), dtype=np.uint8)
        padded[:data.size] = data
        parts: list = []
        comm.all_gather(parts, paddle.to_tensor(padded), group, True,
                        api="dist.all_gather_object")
        for part, size in zip(parts, sizes):
            object_list.append(pickle.loads(part.numpy().astype(np.uint8)[:size].tobytes()))

    def d_reduce_scatter(tensor, tensor_list, op=dist.ReduceOp.SUM, group=None, sync_op=True):
        return comm.reduce_scatter(tensor, tensor_list, op, group, sync_op, api="dist.reduce_scatter")

    def s_reduce(tensor, dst=0, op=dist.ReduceOp.SUM, group=None, sync_op=True, use_calc_stream=False):
        return comm.reduce(tensor, dst, op, group, sync_op, use_calc_stream, api="stream.reduce")

    def s_broadcast(tensor, src, group=None, sync_op=True, use_calc_stream=False):
        return comm.broadcast(tensor, src, group, sync_op, use_calc_stream, api="stream.broadcast")

    def s_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, sync_op=True, use_calc_stream=False):
        return comm.all_reduce(tensor, op, group, sync_op, use_calc_stream, api="stream.all_reduce")

    def s_all_gather(tensor_or_tensor_list, tensor, group=None, sync_op=True, use_calc_stream=False):
        return comm.all_gather(tensor_or_tensor_list, tensor, group, sync_op, use_calc_stream,
                               api="stream.all_gather")

    def s_reduce_scatter(tensor, tensor_or_tensor_list, op=dist.ReduceOp.SUM, group=None,
                         sync_op=True, use_calc_stream=False):
        return comm.reduce_scatter(tensor, tensor_or_tensor_list, op, group, sync_op,
                                   use_calc_stream, api="stream.reduce_scatter")

    @contextlib.contextmanager
    def coalescing_manager(group=None, tasks=None):
        # Same shape as Paddle's: start on the group's process group, always end.
        group = comm.default_group() if group is None else group
        pg = group.process_group
        if pg is None:
            raise AttributeError(
                f"rank {comm.current_rank()}: _coalescing_manager on group {group.id} "
                f"{format_ranks(group.ranks)} but this rank has no process group for it "
                f"(not a member, or a single-rank group: Paddle gives those none)"
            )
        pg._start_coalescing()
        try:
            yield
        finally:
            if tasks:
                pg._end_coalescing(tasks)
            else:
                pg._end_coalescing()

    def get_hcg():
        hcg = comm.current().hcg
        if hcg is None:
            raise FakeCommError(
                f"rank {comm.current_rank()} has no hybrid communicate group: pass "
                f"hcg_factory= to SimulatedWorld / fake_distributed"
            )
        return hcg

    def hcg_get(_self):
        return comm.current().hcg

    def hcg_set(_self, value):
        comm.current().hcg = value

    fakes = {
        (dist, "reduce"): d_reduce,
        (dist, "broadcast"): d_broadcast,
        (dist, "all_reduce"): d_all_reduce,
        (dist, "all_gather"): d_all_gather,
        (dist, "all_gather_object"): d_all_gather_object,
        (dist, "reduce_scatter"): d_reduce_scatter,
        (dist, "new_group"): comm.new_group,
        (dist, "get_rank"): comm.get_rank,
        (dist, "get_world_size"): comm.get_world_size,
        (dist, "is_initialized"): lambda: True,
        (dist_stream, "reduce"): s_reduce,
        (dist_stream, "broadcast"): s_broadcast,
        (dist_stream, "all_reduce"): s_all_reduce,
        (dist_stream, "all_gather"): s_all_gather,
        (dist_stream, "reduce_scatter"): s_reduce_scatter,
        (dist_collective, "new_group"): comm.new_group,
        (dist_collective, "_get_default_group"): comm.default_group,
        (dist_group, "_get_global_group"): comm.default_group,
        (dist_batch, "_coalescing_manager"): coalescing_manager,
        (fleet, "get_hybrid_communicate_group"): get_hcg,
        # A data descriptor on the class wins over the instance attribute,
        # which makes fleet.fleet._hcg per-rank.
        (type(fleet.fleet), "_hcg"): property(hcg_get, hcg_set),
        (fleet.fleet, "_user_defined_strategy"): strategy,
        (fleet_topology, "_HYBRID_PARALLEL_GROUP"): getattr(fleet_topology, "_HYBRID_PARALLEL_GROUP", None),
        (fleet_topology, "logger"): _QUIET_LOGGER,
        (fleet_topology, "check_nccl_version_for_p2p"): lambda *a, **k: None,
        (fleet_topology.CommunicateTopology, "get_comm_list"): _cached_get_comm_list(),
        (unique_name, "generator"): _per_rank_name_generator(comm),
        (unique_name, "dygraph_parameter_name_checker"): _per_rank_name_checker(comm),
    }
    return {(id(owner), attr): fake for (owner, attr), fake in fakes.items()}


def _cached_get_comm_list() -> Callable[..., list[list[int]]]:
    """Memoised ``CommunicateTopology.get_comm_list`` (same result, fresh lists).

    Every simulated rank builds its own topology objects and Paddle calls
    ``get_comm_list`` ~18 times per hcg; at 512 ranks that was 60% of the
    run time. Keyed by (axis names, dims, axis); callers get copies, so
    mutating a result cannot leak into another rank.
    """
    original = fleet_topology.CommunicateTopology.get_comm_list
    cache: dict[tuple, list[list[int]]] = {}

    def get_comm_list(self, axis_name: str) -> list[list[int]]:
        key = (tuple(self._parallel_names), tuple(self._dims), axis_name)
        lists = cache.get(key)
        if lists is None:
            lists = original(self, axis_name)
            cache[key] = [list(g) for g in lists]
        return [list(g) for g in lists]

    return get_comm_list


@contextlib.contextmanager
def install_fake_distributed(comm: FakeComm, strategy: Any = None) -> Iterator[FakeComm]:
    """Patch every entry point in ``patch_points()`` to use ``comm``.

    Args:
        comm: the fake layer to route calls to.
        strategy: value of ``fleet.fleet._user_defined_strategy`` (a
            ``fleet.DistributedStrategy``); a fresh default one when None.

    Yields:
        ``comm``.
    """
    if _ACTIVE:
        raise FakeCommError("a fake distributed layer is already active; nesting is not supported")
    if strategy is None:
        strategy = fleet.DistributedStrategy()
    fakes = _replacements(comm, strategy)
    with contextlib.ExitStack() as stack:
        for owner, attr in patch_points():
            stack.enter_context(mock.patch.object(owner, attr, fakes[(id(owner), attr)], create=True))
        _ACTIVE.append(comm)
        stack.callback(_ACTIVE.pop)
        yield comm


@contextlib.contextmanager
def fake_distributed(
    world_size: int = 1,
    rank: int = 0,
    *,
    mode: str = "record",
    hcg_factory: Optional[Callable[[int], Any]] = None,
    strategy: Any = None,
    phase_provider: Any = _DEFAULT,
    **comm_kwargs: Any,
) -> Iterator[FakeComm]:
    """Act as one rank of a fake world in the current test (single thread).

    The calling thread (and any thread that binds no rank) is ``rank``. In
    record mode every collective returns at once; in data mode a collective
    needing peers fails fast with ``DeadlockError`` (use ``SimulatedWorld``
    to run several ranks).

    Args:
        world_size: number of global ranks.
        rank: the rank this test plays.
        mode: "record" or "data".
        hcg_factory: builds the rank's hcg on entry (e.g.
            ``make_hcg_factory(ep=4, moe_sharding=2)``).
        strategy: ``fleet.fleet._user_defined_strategy`` value.
        phase_provider: phase label getter; default: the optimizer's.
        **comm_kwargs: passed to ``FakeComm``.

    Yields:
        The ``FakeComm``; ``comm.current()`` is this rank's context.
    """
    comm = FakeComm(world_size, mode, hcg_factory=hcg_factory, phase_provider=phase_provider,
                    **comm_kwargs)
    with install_fake_distributed(comm, strategy):
        comm.bind(rank, default=True)
        try:
            yield comm
        finally:
            comm.unbind()


class FakeDistMixin:
    """For ``unittest.TestCase`` suites: ``self.fake_dist(world_size, rank, **kw)``
    installs the layer for the current test; it is restored at cleanup."""

    def fake_dist(self, world_size: int = 1, rank: int = 0, **kwargs: Any) -> FakeComm:
        stack = contextlib.ExitStack()
        self.addCleanup(stack.close)  # type: ignore[attr-defined]
        return stack.enter_context(fake_distributed(world_size, rank, **kwargs))


try:  # the fixture for pytest suites; unittest suites use FakeDistMixin
    import pytest
except ImportError:  # pragma: no cover - Paddle's unittest runner without pytest
    pytest = None

if pytest is not None:

    @pytest.fixture
    def fake_dist() -> Iterator[Callable[..., FakeComm]]:
        """Pytest fixture: ``fake_dist(world_size, rank, **kw)`` installs the layer.

        Everything is restored at teardown. Import it into a suite with
        ``from mock.patching import fake_dist  # noqa: F401``.

        Yields:
            A function with the signature of ``fake_distributed`` returning the
            active ``FakeComm``.
        """
        stack = contextlib.ExitStack()

        def install(world_size: int = 1, rank: int = 0, **kwargs: Any) -> FakeComm:
            return stack.enter_context(fake_distributed(world_size, rank, **kwargs))

        with stack:
            yield install
