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
"""The one place that reads ``FusedCommBuffer`` internals.

Paddle's ``tensor_fusion_helper.FusedCommBuffer`` keeps its group, its
per-parameter slice views and its storage management in private fields. The
sharding optimizer, its state functions and the collectives go through these
functions, so a change of those fields in Paddle is fixed here alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import paddle

__all__ = [
    "comm_group",
    "comm_grads",
    "has_local_slice",
    "fill_local_slice",
    "save_local_slice",
    "restore_local_slice",
    "copy_grads_in",
    "release_grad_storage",
    "release_param_storage",
    "restore_param_storage",
    "MuonBucket",
]


@dataclasses.dataclass
class MuonBucket:
    """The Muon parameters of one (colour group, owner, dtype).

    Attributes:
        colour (str|None): colour key (None for the default sharding group).
        group (Group): the colour's communication group.
        owner (int): global rank that owns and updates these parameters.
        dtype: parameter dtype (one flat broadcast buffer per owner and dtype).
        params (list): parameters, in model order.
        hierarchical (bool): routed through the node / same-card groups.
        buffers (list): fused gradient buffers (empty: per-parameter reduces).
    """

    colour: str | None
    group: Any
    owner: int
    dtype: Any
    params: list
    hierarchical: bool
    buffers: list = dataclasses.field(default_factory=list)


def comm_group(buffer) -> Any:
    """The group the buffer's collective runs on."""
    return buffer._comm_group


def comm_grads(buffer) -> None:
    """Launch the buffer's gradient collective (reduce or reduce-scatter)."""
    buffer._comm_grads()


def _view(buffer, name: str):
    return buffer._sharding_param_grad_view[name]


def has_local_slice(buffer, name: str) -> bool:
    """Whether this rank's shard of the buffer holds part of parameter ``name``."""
    return _view(buffer, name).has_effective_slice_param


def fill_local_slice(buffer, name: str, slice_param) -> None:
    """Point ``slice_param`` at this rank's part of parameter ``name``."""
    _view(buffer, name).fill_slice_param(slice_param)


def save_local_slice(buffer, name: str):
    """A copy of this rank's part of parameter ``name`` (None when it holds none)."""
    view = _view(buffer, name)
    if view._param_begin >= view._param_end:
        return None
    return view._param_buffer._slice(view._param_begin, view._param_end).clone()


def restore_local_slice(buffer, name: str, value) -> None:
    """Write ``value`` (from :func:`save_local_slice`) back into the parameter storage."""
    view = _view(buffer, name)
    paddle.assign(value, output=buffer.param_storage._slice(view._param_begin, view._param_end))


def copy_grads_in(buffer) -> None:
    """Copy each parameter's gradient into a released gradient storage (rebuilt)."""
    for param in buffer.params:
        buffer._copy_grad_to_buffer(param)


def release_grad_storage(buffer) -> None:
    """Free the fused gradient storage (``release_gradients``)."""
    buffer._clear_grad_storage()


def release_param_storage(buffer) -> None:
    """Free the fused parameter storage (``clear_param_storage``)."""
    buffer._clear_param_storage()


def restore_param_storage(buffer) -> None:
    """Allocate the fused parameter storage again (values are written by the caller)."""
    buffer._reset_param_storage()
