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
"""MuonShardingOptimizer's optimizer state for checkpoints: keys, local filtering, and
the states a fresh optimizer creates so that it can load."""

from __future__ import annotations

import math
import re

import paddle
from paddle import framework

from .runtime import ShardingRuntime, fill_local_slice, has_local_slice

__all__ = ["set_state_dict", "sharded_state_dict", "state_owner"]

# Checkpoint naming shared with Paddle develop's optimizers.
_SCALAR_STATES = frozenset({"beta1_pow_acc_0", "beta2_pow_acc_0"})
_MASTER_WEIGHT_STATE = "w_0"
_MASTER_PREFIX = re.compile(r"^fp32_master_\d+_")


def set_state_dict(rt: ShardingRuntime, state_dict: dict) -> None:
    """Load this rank's part of a full (all ranks merged) state dict into the inner optimizer."""
    local = {p.name: p for p in rt.local_params}
    names = _names_longest_first(rt)
    inner_state = {}
    for key, value in state_dict.items():
        if key == "master_weights":
            inner_state[key] = {name: w for name, w in value.items() if name in local}
            for name, weight in inner_state[key].items():
                weight.name = rt.base_opt._gen_master_weight_var_name(local[name])
        elif key == "LR_Scheduler":
            inner_state[key] = value
        else:
            owner = state_owner(rt, key, names)
            if owner is not None and owner[0] in local:
                inner_state[key] = value
    rt.inner.set_state_dict(inner_state)


def sharded_state_dict(rt: ShardingRuntime, model_sharded_state_dict: dict) -> dict:
    """This rank's states as ShardedWeights placed by the model's (see the optimizer's)."""
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    _create_local_states(rt)
    # Shared weights appear under several keys; like develop, the first
    # key in sorted order carries the optimizer state.
    model_key_of: dict[str, str] = {}
    for key in sorted(model_sharded_state_dict):
        model_key_of.setdefault(model_sharded_state_dict[key].local_tensor.name, key)

    states = rt.inner.state_dict()
    names = _names_longest_first(rt)
    master_weights = states.pop("master_weights", None) or {}
    entries = []
    for state_key, tensor in states.items():
        if not isinstance(tensor, paddle.Tensor):
            continue  # LR_Scheduler and other plain values
        owner = state_owner(rt, state_key, names)
        if owner is None:
            raise ValueError(f"optimizer state {state_key!r} belongs to no trainable parameter "
                             "of this optimizer; cannot place it in a checkpoint.")
        entries.append((*owner, tensor))
    entries.extend((name, _MASTER_WEIGHT_STATE, tensor)
                   for name, tensor in master_weights.items())

    result = {}
    for name, state, tensor in entries:
        model_key = model_key_of.get(name)
        if model_key is None:
            raise KeyError(f"parameter {name} has optimizer state {state!r} but no entry in "
                           "model_sharded_state_dict (matched by local_tensor.name); pass the "
                           "sharded state dict of the model this optimizer trains.")
        weight = model_sharded_state_dict[model_key]
        key = f"{model_key}.{state}"
        if state in _SCALAR_STATES:
            result[key] = ShardedWeight(key, tensor, (1,), (1,), (0,))
            continue
        local_shape = tuple(weight.local_shape)
        numel = int(rt.param_by_name[name].numel())
        if math.prod(local_shape) != numel:
            raise ValueError(f"model sharded weight {model_key!r} has local shape "
                             f"{list(local_shape)} but parameter {name} has {numel} elements; "
                             "the model's sharded state dict must describe the parameter "
                             "this rank holds.")
        flattened = {}
        if name in rt.slice_params:
            begin, end = (int(i) for i in rt.layout.local_range(name))
            if end <= begin:
                continue  # this rank's share is alignment padding only
            tensor = tensor[: end - begin]  # a view: loading writes the state
            flattened = dict(is_flattened=True, flattened_range=slice(begin, end))
        elif tuple(tensor.shape) != local_shape:
            tensor = tensor.reshape(local_shape)
        result[key] = ShardedWeight(key, tensor, local_shape, tuple(weight.global_shape),
                                    tuple(weight.global_offset), **flattened)
    return result


@framework.no_grad()
def _create_local_states(rt: ShardingRuntime) -> None:
    # Slice parameters get their storage at the first step; accumulators and
    # master weights are created lazily by the inner optimizer: create both now.
    for buffer in rt.rs_buffers:
        for p in buffer.params:
            if has_local_slice(buffer, p.name):
                fill_local_slice(buffer, p.name, rt.slice_params[p.name])
    block = paddle.static.default_main_program().global_block()
    rt.inner._create_accumulators(block, rt.inner._parameter_list)


def state_owner(rt: ShardingRuntime, state_key: str,
                names: list | None = None) -> tuple[str, str] | None:
    """(parameter name, develop's state name) of a state key; None when no trainable
    parameter prefixes it. ``names``: :func:`_names_longest_first` of ``rt`` (None: computed)."""
    for name in names if names is not None else _names_longest_first(rt):
        if state_key.startswith(name + "_"):
            return name, _MASTER_PREFIX.sub("", state_key[len(name) + 1:], count=1)
    return None


def _names_longest_first(rt: ShardingRuntime) -> list:
    return sorted(set(rt.layout.owners) | set(rt.slice_params), key=len, reverse=True)
