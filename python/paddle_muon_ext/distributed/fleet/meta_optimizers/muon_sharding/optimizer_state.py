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
"""MuonShardingOptimizer's optimizer state: checkpoint keys, local filtering, fused storage.

Plain functions of the optimizer (``opt``): its methods ``set_state_dict``,
``sharded_state_dict`` call them and ``_state_owner``,
``_fuse_optimizer_states`` ... are bound to them, so each has one body.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict

import paddle

from . import fused_buffer as fused

__all__ = [
    "fuse_optimizer_states",
    "set_state_dict",
    "sharded_state_dict",
    "create_local_states",
    "state_owner",
    "param_numel",
]

# Checkpoint naming shared with Paddle develop's optimizers.
_SCALAR_STATES = frozenset({"beta1_pow_acc_0", "beta2_pow_acc_0"})
_MASTER_WEIGHT_STATE = "w_0"
_MASTER_PREFIX = re.compile(r"^fp32_master_\d+_")


def _is_trainable(param) -> bool:
    return not param.stop_gradient


def fuse_optimizer_states(opt) -> None:
    base = opt._base_opt
    states = [
        t
        for per_param in base._accumulators.values()
        for t in per_param.values()
        if int(t._numel()) > 1
    ] + list(base._master_weights.values())
    by_dtype: dict[str, list] = OrderedDict()
    for t in states:
        by_dtype.setdefault(str(t.dtype), []).append(t)
    for dtype, tensors in by_dtype.items():
        fused = opt._state.fused_state_buffers.get(dtype)
        if fused is not None and all(t._is_shared_buffer_with(fused) for t in tensors):
            continue
        total = sum(int(t._numel()) for t in tensors)
        fused = paddle.empty([total], dtype=tensors[0].dtype)
        offset = 0
        for t in tensors:
            numel, shape = int(t._numel()), list(t.shape)
            view = fused._slice(offset, offset + numel)
            paddle.assign(t.reshape([-1]), output=view)
            view._share_buffer_to(t)
            t.get_tensor()._set_dims(shape)
            offset += numel
        opt._state.fused_state_buffers[dtype] = fused


def set_state_dict(opt, state_dict: dict) -> None:
    local = {p.name: p for p in opt._local_parameter_list}
    inner_state = {}
    for key, value in state_dict.items():
        if key == "master_weights":
            base = opt._base_opt
            kept = {}
            for name, weight in value.items():
                if name in local:
                    weight.name = base._gen_master_weight_var_name(local[name])
                    kept[name] = weight
            inner_state[key] = kept
        elif key == "LR_Scheduler":
            inner_state[key] = value
        else:
            owner = opt._state_owner(key)
            if owner is not None and owner[0] in local:
                inner_state[key] = value
    opt._inner_opt.set_state_dict(inner_state)


def sharded_state_dict(opt, model_sharded_state_dict: dict) -> dict:
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import (
        ShardedWeight,
    )

    opt._create_local_states()
    # Shared weights appear under several keys; like develop, the first
    # key in sorted order carries the optimizer state.
    model_key_of: dict[str, str] = {}
    for key in sorted(model_sharded_state_dict):
        name = model_sharded_state_dict[key].local_tensor.name
        model_key_of.setdefault(name, key)

    states = opt._inner_opt.state_dict()
    master_weights = states.pop("master_weights", None) or {}
    entries = []
    for state_key, tensor in states.items():
        if not isinstance(tensor, paddle.Tensor):
            continue  # LR_Scheduler and other plain values
        owner = opt._state_owner(state_key)
        if owner is None:
            raise ValueError(
                f"optimizer state {state_key!r} belongs to no trainable "
                "parameter of this optimizer; cannot place it in a checkpoint."
            )
        entries.append((*owner, tensor))
    entries.extend(
        (name, _MASTER_WEIGHT_STATE, tensor) for name, tensor in master_weights.items()
    )

    result = {}
    for name, state, tensor in entries:
        model_key = model_key_of.get(name)
        if model_key is None:
            raise KeyError(
                f"parameter {name} has optimizer state {state!r} but no entry "
                "in model_sharded_state_dict (matched by local_tensor.name); "
                "pass the sharded state dict of the model this optimizer trains."
            )
        weight = model_sharded_state_dict[model_key]
        key = f"{model_key}.{state}"
        if state in _SCALAR_STATES:
            result[key] = ShardedWeight(key, tensor, (1,), (1,), (0,))
            continue
        local_shape = tuple(weight.local_shape)
        if math.prod(local_shape) != int(opt._param_numel(name)):
            raise ValueError(
                f"model sharded weight {model_key!r} has local shape "
                f"{list(local_shape)} but parameter {name} has "
                f"{opt._param_numel(name)} elements; the model's sharded "
                "state dict must describe the parameter this rank holds."
            )
        if name in opt._slice_params:
            begin, end = (int(i) for i in opt.local_range(name))
            if end <= begin:
                continue  # this rank's share is alignment padding only
            result[key] = ShardedWeight(
                key,
                tensor[: end - begin],  # a view: loading writes the state
                local_shape,
                tuple(weight.global_shape),
                tuple(weight.global_offset),
                is_flattened=True,
                flattened_range=slice(begin, end),
            )
        else:
            local = tensor if tuple(tensor.shape) == local_shape else tensor.reshape(local_shape)
            result[key] = ShardedWeight(
                key, local, local_shape, tuple(weight.global_shape),
                tuple(weight.global_offset),
            )
    return result


def param_numel(opt, name: str) -> int:
    if opt._numel_of is None:
        opt._numel_of = {
            p.name: int(p.numel()) for p in opt._parameter_list if _is_trainable(p)
        }
    return opt._numel_of[name]


def create_local_states(opt) -> None:
    for buffer in opt._rs_buffers:
        for p in buffer.params:
            if fused.has_local_slice(buffer, p.name):
                fused.fill_local_slice(buffer, p.name, opt._slice_params[p.name])
    block = paddle.static.default_main_program().global_block()
    opt._inner_opt._create_accumulators(block, opt._inner_opt._parameter_list)


def state_owner(opt, state_key: str) -> tuple[str, str] | None:
    """(parameter name, develop's state name) of a state key, names tried
    longest first; None when no trainable parameter prefixes it."""
    if opt._names_longest_first is None:
        opt._names_longest_first = sorted(
            set(opt._owner_of) | set(opt._slice_params), key=len, reverse=True
        )
    for name in opt._names_longest_first:
        if state_key.startswith(name + "_"):
            state = state_key[len(name) + 1 :]
            return name, _MASTER_PREFIX.sub("", state, count=1)
    return None
