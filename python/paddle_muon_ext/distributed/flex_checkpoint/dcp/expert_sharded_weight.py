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
"""Expert parameters in a flex_checkpoint sharded state dict, one call per layer.

Paddle keeps the helpers that describe a parallel layer's weights for a
checkpoint in ``paddle/distributed/flex_checkpoint/dcp/sharded_weight.py``
(``shard_weight``, ``make_tp_sharded_weight_for_checkpoint`` for tensor
parallel, ``build_sharded_state_dict``); the expert-parallel counterpart
belongs beside them, so this module sits at that path, in a file of its own
(it adds to ``dcp`` and leaves Paddle's ``sharded_weight.py`` as it is).

An expert-parallel layer stacks its local experts on the leading axis of
each parameter (``[local experts, in, out]``, ``[local experts, out]``) and
each rank of the expert-parallel group holds other experts. Paddle's
``Layer.sharded_state_dict`` describes every parameter whole at offset 0, so
the ranks' different experts would claim one piece of one tensor (the save
refuses that, or a plain flex_checkpoint save keeps one rank's copy).
:func:`expert_sharded_state_dict` describes each of them at its global shape
``[all experts, ...]`` and offset ``[first expert of this rank, 0, ...]``:
the checkpoint holds every expert once and loads on another expert-parallel
degree too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import paddle
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

if TYPE_CHECKING:
    from paddle.distributed.communication.group import Group

__all__ = ["expert_sharded_state_dict"]


def _group_position(expert_group: Group | None) -> tuple[int, int]:
    """(this rank's index in ``expert_group``, the group's size); ValueError
    when this process is not one of its members."""
    if expert_group is None:
        return 0, 1
    nranks, rank = int(expert_group.nranks), int(expert_group.rank)
    if nranks < 1 or not 0 <= rank < nranks:
        ranks = list(getattr(expert_group, "ranks", []))
        raise ValueError(
            f"expert_sharded_state_dict: this process (global rank "
            f"{paddle.distributed.get_rank()}) has rank {rank} in expert_group of "
            f"{nranks} ranks {ranks}, i.e. it is not a member; pass the expert-parallel "
            "group this rank belongs to (fleet.get_hybrid_communicate_group()"
            ".get_expert_parallel_group())")
    return rank, nranks


def expert_sharded_state_dict(
    layer: paddle.nn.Layer,
    structured_name_prefix: str = "",
    expert_group: Group | None = None,
    *,
    num_experts: int | None = None,
) -> dict[str, Any]:
    """``layer``'s sharded state dict with its experts at their global shape and offset.

    Every parameter that ``layer`` holds itself (not its sub-layers') stacks
    this rank's experts on axis 0, the same count in each, split evenly over
    ``expert_group``: the rank with index ``i`` in the group holds experts
    ``i * local .. (i + 1) * local - 1``. Each such parameter is described as
    Paddle's ``ShardedWeight`` with global shape ``[local * nranks, ...]``
    and global offset ``[i * local, 0, ...]``. Everything else is described
    as Paddle's ``Layer.sharded_state_dict`` does: sub-layers by their own
    ``sharded_state_dict`` (a plain layer: each tensor whole at offset 0, the
    same on every rank; a tensor-parallel layer: its own rule) and the
    layer's buffers whole at offset 0. Put a layer's non-expert parameters
    (a router, a shared MLP) in sub-layers.

    Use it as the layer's ``sharded_state_dict``::

        def sharded_state_dict(self, structured_name_prefix=""):
            return paddle_muon_ext.expert_sharded_state_dict(
                self, structured_name_prefix, self.ep_group)

    The optimizer's ``sharded_state_dict(model_state)`` gives its states the
    same global shapes and offsets.

    Args:
        layer: the layer holding the stacked expert parameters.
        structured_name_prefix: prefix of every key (Paddle passes
            ``"<parent>.<name>."`` when it walks the model).
        expert_group: the expert-parallel group (``hcg.get_expert_parallel_group()``);
            None: one rank holds every expert.
        num_experts: the number of experts over the whole group, when known:
            checked against ``local * nranks``.

    Returns:
        dict: structured name -> ``ShardedWeight``.

    Raises:
        ValueError: this process is not in ``expert_group``; ``layer`` holds
            no parameter, a 0-D one, or parameters with different expert
            counts; ``num_experts`` is not ``nranks`` times the local count.
    """
    rank, nranks = _group_position(expert_group)
    own = list(layer.named_parameters(include_sublayers=False))
    if not own:
        raise ValueError(
            f"expert_sharded_state_dict: {type(layer).__name__} (prefix "
            f"{structured_name_prefix!r}) holds no parameter of its own; call it on the "
            "layer whose parameters stack the experts")
    counts = {}
    for name, p in own:
        if len(p.shape) == 0:
            raise ValueError(
                f"expert_sharded_state_dict: {structured_name_prefix}{name} is 0-D; every "
                f"parameter {type(layer).__name__} holds itself must stack its experts on "
                "axis 0 (move other parameters into a sub-layer)")
        counts[name] = int(p.shape[0])
    local = next(iter(counts.values()))
    if any(c != local for c in counts.values()):
        listed = ", ".join(f"{structured_name_prefix}{n} {c}" for n, c in counts.items())
        raise ValueError(
            f"expert_sharded_state_dict: the parameters of {type(layer).__name__} hold "
            f"different expert counts on axis 0 ({listed}); each must stack this rank's "
            "experts, the same count (move other parameters into a sub-layer)")
    if num_experts is not None and num_experts != local * nranks:
        raise ValueError(
            f"expert_sharded_state_dict: num_experts {num_experts} is not split evenly "
            f"over expert_group's {nranks} ranks: this rank (index {rank}) holds {local} "
            f"(axis 0 of {structured_name_prefix}{own[0][0]}), {local} x {nranks} = "
            f"{local * nranks}; give every expert-parallel rank num_experts / nranks experts")
    # Paddle's own description of the whole layer (sub-layers by their own
    # method), then this layer's parameters replaced by their expert slice
    out = paddle.nn.Layer.sharded_state_dict(layer, structured_name_prefix)
    for name, p in own:
        key = structured_name_prefix + name
        rest = tuple(int(d) for d in p.shape[1:])
        out[key] = ShardedWeight(
            key=key, local_tensor=p, local_shape=(local, *rest),
            global_shape=(local * nranks, *rest),
            global_offset=(rank * local,) + (0,) * len(rest))
    return out
