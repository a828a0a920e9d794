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
"""The collective patterns of the Muon sharding optimizer, as plain functions.

Each function takes tensors, destinations and groups and issues one
communication phase, batched in ``_coalescing_manager`` on its group. The
optimizer decides *what* to send (owner map, routing plan); these functions
are *how*. Every entry point of ``paddle.distributed`` is looked up at call
time so a test harness can substitute the process-group layer.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, Tuple

import paddle
import paddle.distributed as dist
from paddle.profiler import RecordEvent

from . import muon_fused_buffer as fused
from .muon_flight_recorder import (
    enter_phase,
    exit_phase,
    get_flight_recorder,
    phase_of_thread,
)

# The package re-exports the batch_isend_irecv *function* under the module's
# name; _coalescing_manager lives in the module.
_batch_isend_irecv = importlib.import_module(
    "paddle.distributed.communication.batch_isend_irecv"
)
from .muon_sharding_types import (
    PHASE_ALL_GATHER,
    PHASE_CROSS_NODE_REDUCE,
    PHASE_INTRA_NODE_REDUCE,
    PHASE_REDUCE_SCATTER,
)

if TYPE_CHECKING:
    from paddle import Tensor


__all__ = [
    "comm_phase",
    "current_comm_phase",
    "reduce_onto",
    "mean_onto",
    "sum_fallback_factors",
    "fused_buffer_scaling",
    "broadcast_from",
    "launch_broadcast",
    "launch_all_gather",
    "PendingCollective",
    "reduce_scatter_slices",
    "all_gather_slices",
    "PHASE_REDUCE_SCATTER",
    "PHASE_ALL_GATHER",
    "PHASE_INTRA_NODE_REDUCE",
    "PHASE_CROSS_NODE_REDUCE",
]

# (tensor, global rank): the destination of a reduce / the source of a broadcast.
Route = Tuple["Tensor", int]


@contextlib.contextmanager
def comm_phase(label: str) -> Iterator[None]:
    """Label the collectives issued inside the block.

    The block is a ``paddle.profiler.RecordEvent`` of the same name, so each
    phase shows in Paddle's profiler timeline; the flight recorder and the
    test recorder read the label through :func:`current_comm_phase`.

    Args:
        label (str): e.g. ``"intra_node_reduce"``.
    """
    previous = enter_phase(label)
    event = RecordEvent(label)
    event.begin()
    try:
        yield
    finally:
        event.end()
        exit_phase(previous)


def current_comm_phase() -> str | None:
    """Return the label set by the calling thread's innermost :func:`comm_phase`."""
    return phase_of_thread()


class PendingCollective:
    """A launched coalesced block; :meth:`wait` completes it (once).

    ``then`` runs after the wait (e.g. copying a received buffer back into
    the parameters), so the caller can hold the block while computing.
    """

    def __init__(self, tasks: list, entries: list, describe: str,
                 then: Callable[[], None] | None = None) -> None:
        self._tasks, self._entries, self._describe = tasks, entries, describe
        self._then = then
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        self._done = True
        recorder = get_flight_recorder()
        try:
            for task in self._tasks:
                task.wait()
        except Exception as exc:
            recorder.dump(f"{self._describe} raised {type(exc).__name__}: {exc}",
                          request_peers=True, error=exc)
            raise
        recorder.finish(self._entries)
        if self._then is not None:
            self._then()


def _launch_coalesced(group, issue, routes: Sequence[Route], op: str,
                      then: Callable[[], None] | None = None) -> PendingCollective:
    # A one-rank group (e.g. moe_sharding_degree=1) already holds the result;
    # Paddle gives it no process group to coalesce on.
    if not routes or group.nranks <= 1:
        return PendingCollective([], [], op, then)
    recorder = get_flight_recorder()
    phase = phase_of_thread()
    describe = f"{op} on group {list(group.ranks)} (phase {phase!r})"
    tasks: list = []
    entries: list = []
    try:
        with _batch_isend_irecv._coalescing_manager(group, tasks):
            for tensor, peer in routes:
                entries.append(recorder.start(op, group, peer, tensor, phase))
                task = issue(tensor, peer)
                if task is not None:
                    tasks.append(task)
    except Exception as exc:
        recorder.dump(f"{describe} raised {type(exc).__name__}: {exc}", request_peers=True,
                      error=exc)
        raise
    return PendingCollective(tasks, entries, describe, then)


def _run_coalesced(group, issue, routes: Sequence[Route], op: str) -> None:
    _launch_coalesced(group, issue, routes, op).wait()


def reduce_onto(routes: Sequence[Route], group, op) -> None:
    """Reduce each tensor onto its destination rank, one coalesced block.

    Only the destination's tensor holds the result afterwards; the other
    ranks' tensors must be treated as garbage (gloo overwrites them).

    Args:
        routes (Sequence[tuple[Tensor, int]]): tensor and destination global rank.
        group (Group): the group every rank of which issues the same routes.
        op (ReduceOp): ``ReduceOp.AVG`` or ``ReduceOp.SUM``.
    """
    _run_coalesced(
        group,
        lambda t, dst: dist.reduce(t, dst=dst, op=op, group=group, sync_op=False),
        routes,
        "reduce",
    )


def sum_fallback_factors(nranks: int) -> tuple[float, float]:
    """Divide factors ``(pre, post)`` of a mean taken as SUM (no AVG reduce).

    Each rank divides its addend by ``pre`` before the SUM and the root
    divides the result by ``post`` (``pre * post == nranks``), as FSDP's
    gradient divide factors do. The whole factor goes before the sum: the sum
    of ``x_i / n`` is bounded by ``max |x_i|``, so every gradient the
    single-process run can hold stays finite (summing first overflows near the
    fp32 maximum). The price is underflow of addends below ``n`` times the
    smallest subnormal, which no gradient that matters reaches.

    Args:
        nranks (int): ranks taking part in the reduce.

    Returns:
        tuple[float, float]: ``(pre, post)``.
    """
    return float(nranks), 1.0


def fused_buffer_scaling(use_avg: bool) -> dict[str, bool]:
    """``FusedCommBuffer`` keyword arguments that scale like :func:`mean_onto`.

    A fused buffer can scale either before or after its SUM; it follows
    :func:`sum_fallback_factors` (pre-divide) when there is no AVG reduce.

    Args:
        use_avg (bool): the build reduces with ``ReduceOp.AVG``.
    """
    _, post = sum_fallback_factors(2)
    return {"use_reduce_avg": use_avg, "scale_after_comm": post != 1.0}


def mean_onto(routes: Sequence[Route], group, op) -> None:
    """Reduce each tensor onto its destination as the mean over ``group``.

    ``op`` is ``ReduceOp.AVG`` where the build has it; with ``ReduceOp.SUM``
    (gloo, CPU) the addends are scaled by :func:`sum_fallback_factors`.
    Non-destination tensors are garbage afterwards either way.

    Args:
        routes (Sequence[tuple[Tensor, int]]): tensor and destination global rank.
        group (Group): the group every rank of which issues the same routes.
        op (ReduceOp): ``ReduceOp.AVG`` or ``ReduceOp.SUM``.
    """
    scaled = op == dist.ReduceOp.SUM and group.nranks > 1 and bool(routes)
    pre, post = sum_fallback_factors(group.nranks)
    if scaled and pre != 1.0:
        for tensor, _ in routes:
            tensor.scale_(1.0 / pre)
    reduce_onto(routes, group, op)
    if scaled and post != 1.0:
        me = dist.get_rank()
        for tensor, dst in routes:
            if dst == me:
                tensor.scale_(1.0 / post)


def broadcast_from(routes: Sequence[Route], group) -> None:
    """Broadcast each tensor from its source rank, one coalesced block.

    Args:
        routes (Sequence[tuple[Tensor, int]]): tensor and source global rank.
        group (Group): the group every rank of which issues the same routes.
    """
    _run_coalesced(
        group,
        lambda t, src: dist.broadcast(t, src=src, group=group, sync_op=False),
        routes,
        "broadcast",
    )


def launch_broadcast(routes: Sequence[Route], group,
                     then: Callable[[], None] | None = None) -> PendingCollective:
    """Launch :func:`broadcast_from` without waiting; ``then`` runs after the wait.

    Args:
        routes (Sequence[tuple[Tensor, int]]): tensor and source global rank.
        group (Group): the group every rank of which issues the same routes.
        then (Callable|None): called once the broadcasts completed.

    Returns:
        PendingCollective: wait on it before reading the tensors.
    """
    return _launch_coalesced(
        group,
        lambda t, src: dist.broadcast(t, src=src, group=group, sync_op=False),
        routes,
        "broadcast",
        then,
    )


def _recorded_buffer_ops(buffers, op: str, run) -> None:
    """Run ``run(buffer)`` per fused 1-D buffer, recorded as ``op`` on its group."""
    recorder = get_flight_recorder()
    phase = phase_of_thread()
    for buffer in buffers:
        group = fused.comm_group(buffer)
        tensor = buffer.grad_storage if op == "reduce_scatter" else buffer.param_storage
        entry = (recorder.start(op, group, None, tensor, phase)
                 if group.nranks > 1 and tensor is not None else None)
        try:
            run(buffer)
        except Exception as exc:
            recorder.dump(f"{op} on group {list(group.ranks)} (phase {phase!r}) raised "
                          f"{type(exc).__name__}: {exc}", request_peers=True, error=exc)
            raise
        recorder.finish((entry,))


def reduce_scatter_slices(buffers: Sequence, launched_by_hook: Callable[[Any], bool]) -> None:
    """Reduce-scatter each fused 1-D gradient buffer and scale it.

    Args:
        buffers (Sequence[FusedCommBuffer]): ``REDUCE_SCATTER`` buffers.
        launched_by_hook (Callable): True for a buffer whose backward hook
            already launched the collective (overlap): only wait and scale.
    """

    def run(buffer) -> None:
        # a one-rank group holds the result already: no collective
        if not launched_by_hook(buffer) and fused.comm_group(buffer).nranks > 1:
            fused.comm_grads(buffer)
        buffer.scale_grads()

    with comm_phase(PHASE_REDUCE_SCATTER):
        _recorded_buffer_ops(buffers, "reduce_scatter", run)


def all_gather_slices(buffers: Sequence) -> None:
    """All-gather each fused 1-D parameter buffer from the ranks' slices.

    Args:
        buffers (Sequence[FusedCommBuffer]): ``REDUCE_SCATTER`` buffers.
    """
    with comm_phase(PHASE_ALL_GATHER):
        _recorded_buffer_ops(buffers, "all_gather", lambda b: b.sync_params())


def launch_all_gather(buffer) -> PendingCollective:
    """Launch the all-gather of one fused 1-D parameter buffer without waiting.

    Develop's ``sync_params(sync=False, param2task={})``: the buffer's task is
    taken over by the returned object (a one-rank group launches nothing).
    """
    group = fused.comm_group(buffer)
    recorder = get_flight_recorder()
    with comm_phase(PHASE_ALL_GATHER):
        phase = phase_of_thread()
        entry = None
        if group.nranks > 1 and buffer.param_storage is not None:
            entry = recorder.start("all_gather", group, None, buffer.param_storage, phase)
        buffer.sync_param_task = None
        buffer.sync_params(sync=False, param2task={})
        task, buffer.sync_param_task = buffer.sync_param_task, None
    return PendingCollective([task] if task is not None else [], [entry],
                             f"all_gather on group {list(group.ranks)} (phase {phase!r})")


def flatten_into(tensors: Sequence[Tensor], out: Tensor) -> None:
    """Copy ``tensors`` back to back into the 1-D tensor ``out`` (in place)."""
    paddle.assign(paddle.concat([t.reshape([-1]) for t in tensors]), output=out)


def unflatten_from(flat: Tensor, tensors: Sequence[Tensor]) -> None:
    """Copy consecutive pieces of the 1-D ``flat`` into ``tensors`` (in place)."""
    offset = 0
    for t in tensors:
        numel = int(t.numel())
        paddle.assign(flat[offset : offset + numel].reshape(t.shape), output=t)
        offset += numel
