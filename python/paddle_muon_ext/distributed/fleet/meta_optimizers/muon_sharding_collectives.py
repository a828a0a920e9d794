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
import threading
from typing import TYPE_CHECKING, Iterator, Sequence, Tuple

import paddle
import paddle.distributed as dist

# The package re-exports the batch_isend_irecv *function* under the module's
# name; _coalescing_manager lives in the module.
_batch_isend_irecv = importlib.import_module(
    "paddle.distributed.communication.batch_isend_irecv"
)
if TYPE_CHECKING:
    from paddle import Tensor

    from .muon_comm_plan import HierarchicalCommPlan

__all__ = [
    "comm_phase",
    "current_comm_phase",
    "reduce_onto",
    "broadcast_from",
    "hierarchical_reduce",
    "hierarchical_broadcast",
]

# (tensor, global rank): the destination of a reduce / the source of a broadcast.
Route = Tuple["Tensor", int]

_PHASE = threading.local()


@contextlib.contextmanager
def comm_phase(label: str) -> Iterator[None]:
    """Label the collectives issued inside the block (for traces and tests).

    Args:
        label (str): e.g. ``"intra_node_reduce"``.
    """
    previous = getattr(_PHASE, "label", None)
    _PHASE.label = label
    try:
        yield
    finally:
        _PHASE.label = previous


def current_comm_phase() -> str | None:
    """Return the label set by the innermost active :func:`comm_phase`."""
    return getattr(_PHASE, "label", None)


def _run_coalesced(group, issue, routes: Sequence[Route]) -> None:
    # A one-rank group (e.g. moe_sharding_degree=1) already holds the result;
    # Paddle gives it no process group to coalesce on.
    if not routes or group.nranks <= 1:
        return
    tasks: list = []
    with _batch_isend_irecv._coalescing_manager(group, tasks):
        for tensor, peer in routes:
            task = issue(tensor, peer)
            if task is not None:
                tasks.append(task)
    for task in tasks:
        task.wait()


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
    )


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
    )


def hierarchical_reduce(
    routes: Sequence[Route], plan: HierarchicalCommPlan, groups, rank: int, op
) -> None:
    """Two-phase reduce of dense buffers onto their owners.

    Phase 1 reduces inside ``rank``'s node onto the card that matches the
    owner's card; phase 2 reduces across nodes among that card's ranks only.
    With ``ReduceOp.AVG`` the mean of per-node means is the group mean because
    every node holds the same number of the sharding group's ranks (checked
    when the plan was built).

    Args:
        routes (Sequence[tuple[Tensor, int]]): buffer and owner global rank.
        plan (HierarchicalCommPlan): the routing plan.
        groups: the groups created from ``plan`` for ``rank``.
        rank (int): this process's global rank.
        op (ReduceOp): ``ReduceOp.AVG`` or ``ReduceOp.SUM``.
    """
    with comm_phase("intra_node_reduce"):
        reduce_onto(
            [(t, plan.intra_node_root(owner, rank)) for t, owner in routes],
            groups.node_group,
            op,
        )
    with comm_phase("cross_node_reduce"):
        reduce_onto(
            [(t, o) for t, o in routes if plan.in_cross_node_step(o, rank)],
            groups.same_card_group,
            op,
        )


def hierarchical_broadcast(
    routes: Sequence[Route], plan: HierarchicalCommPlan, groups, rank: int
) -> None:
    """Reverse of :func:`hierarchical_reduce`: across nodes, then inside nodes.

    Args:
        routes (Sequence[tuple[Tensor, int]]): buffer and owner global rank.
        plan (HierarchicalCommPlan): the routing plan.
        groups: the groups created from ``plan`` for ``rank``.
        rank (int): this process's global rank.
    """
    with comm_phase("cross_node_broadcast"):
        broadcast_from(
            [(t, o) for t, o in routes if plan.in_cross_node_step(o, rank)],
            groups.same_card_group,
        )
    with comm_phase("intra_node_broadcast"):
        broadcast_from(
            [(t, plan.intra_node_root(owner, rank)) for t, owner in routes],
            groups.node_group,
        )


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
