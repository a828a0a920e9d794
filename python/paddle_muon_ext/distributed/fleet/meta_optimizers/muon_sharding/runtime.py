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
"""Bodies of :class:`MuonShardingOptimizer`'s per-step helpers.

Gradient / parameter storage clearing and the small helpers the step plan's
executors call (``muon_sharding_executor`` runs the step itself). Split from
``muon_sharding_optimizer`` the same way as ``muon_sharding_build``: that
file binds these functions (``opt`` first) as its methods; like the build
module this one never imports the optimizer's module.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (
    HybridParallelClipGrad,
)
import paddle

from . import fused_buffer as fused
from . import collectives as comm

if TYPE_CHECKING:
    from ..muon_sharding_optimizer import MuonShardingOptimizer


def get_param_grad(param):
    """The gradient to reduce: ``main_grad`` under MixPrecisionLayer, else ``grad``.

    A parameter without one this step (an unused branch) still takes part in
    the collective, with zeros: other ranks may have a gradient.
    """
    if hasattr(param, "main_grad"):
        if param.main_grad is None:
            param.main_grad = paddle.zeros(param.shape, dtype="float32")
        return param.main_grad
    if param.grad is None:
        param._copy_gradient_from(paddle.zeros_like(param))
    return param.grad


def clear_grad(opt: MuonShardingOptimizer, set_to_zero: bool = True) -> None:
    """Clear every gradient this optimizer manages.

    Args:
        set_to_zero (bool): True zeroes gradients in place. False frees
            what is not linked to a fused buffer (per-parameter Muon
            gradients, ``main_grad`` of unfused parameters); fused buffers
            stay allocated and are zeroed, since the parameters' gradients
            are views into them, unless ``release_gradients`` releases the
            1-D buffers.
    """
    for buffer in opt._all_buffers():
        if buffer.grad_storage is not None:
            buffer.grad_storage.zero_()
    for bucket in opt._muon_buckets:
        if not bucket.buffers:
            for p in bucket.params:
                _clear_gradient_of(p, set_to_zero)
    release = opt._settings.release_grads
    for sp in opt._slice_params.values():
        if sp._is_initialized() and sp.grad is not None:
            # A slice's gradient is a view into its 1-D buffer (nothing to
            # free); a released buffer is rebuilt, so the slice must re-link.
            sp.clear_gradient(not release)
    if release:
        # Released buffers are rebuilt from the parameters' own grads at
        # the next reduce_gradients, so unlink those grads first.
        for buffer in opt._rs_buffers:
            if buffer.grad_storage is not None:
                for p in buffer.params:
                    p.clear_gradient(False)
                fused.release_grad_storage(buffer)


def clear_param_storage(opt: MuonShardingOptimizer, color) -> None:
    """Free the parameter storage of colour ``color`` until the next step.

    Freed: every element-wise parameter of the colour (this rank's slice
    is kept aside) and every Muon matrix of the colour this rank does not
    own (the owner's broadcast refills it). Owned matrices are kept: the
    owner updates them whole. :meth:`step` restores the storage first,
    then the update and the parameter sync make every value exact again.

    Args:
        color: the colour key (None for the default sharding group).
    """
    if color in opt._state.cleared_colours:
        return
    saved = {}
    for buffer in opt._rs_buffers:
        if opt._rs_colour[id(buffer)] != color:
            continue
        for p in buffer.params:
            kept = fused.save_local_slice(buffer, p.name)
            if kept is not None:
                saved[p.name] = kept
            slice_param = opt._slice_params[p.name]
            if slice_param._is_initialized():
                slice_param._clear_dataptr()
        fused.release_param_storage(buffer)
    for bucket in opt._muon_buckets:
        if bucket.colour == color and bucket.owner != opt._rank:
            for p in bucket.params:
                p._clear_to_zero_allocation()
    opt._state.cleared_colours[color] = saved


def reset_param_storage(opt: MuonShardingOptimizer) -> None:
    """Give every colour freed by :meth:`clear_param_storage` its storage back.

    Element-wise parameters get this rank's slice back; other values are
    refilled by the next parameter sync.
    """
    for color, saved in opt._state.cleared_colours.items():
        for buffer in opt._rs_buffers:
            if opt._rs_colour[id(buffer)] != color:
                continue
            fused.restore_param_storage(buffer)
            for p in buffer.params:
                if p.name in saved:
                    fused.restore_local_slice(buffer, p.name, saved[p.name])
        for bucket in opt._muon_buckets:
            if bucket.colour == color and bucket.owner != opt._rank:
                for p in bucket.params:
                    paddle.empty(p.shape, dtype=p.dtype)._share_buffer_to(p)
    opt._state.cleared_colours.clear()


def _clear_gradient_of(param, set_to_zero: bool) -> None:
    if not hasattr(param, "main_grad"):
        param.clear_gradient(set_to_zero)
    elif param.main_grad is not None:
        if set_to_zero:
            param.main_grad.zero_()
        else:
            param.main_grad._clear()
            param.main_grad = None


def ensure_global_clip(opt: MuonShardingOptimizer) -> None:
    # Each rank holds only its owned matrices and slices: a plain global norm
    # clip would clip by a per-rank norm. HybridParallelOptimizer swaps in its
    # sharding-aware clip; used bare, swap it in here (on the optimizer that
    # applies it, below any MixPrecisionOptimizer).
    base = opt._base_opt
    clip = base._grad_clip
    if isinstance(clip, paddle.nn.ClipGradByGlobalNorm):
        base._grad_clip = HybridParallelClipGrad(clip, opt._hcg)


@contextlib.contextmanager
def timed(opt: MuonShardingOptimizer, name: str) -> Iterator[None]:
    # develop's timer names, so timers.log() reads the same
    if opt.timers is None:
        yield
        return
    opt.timers(name).start()
    try:
        yield
    finally:
        opt.timers(name).stop()


def copy_released_grads_in(opt: MuonShardingOptimizer) -> None:
    if not opt._settings.release_grads:
        return
    for buffer in opt._rs_buffers:
        if buffer.grad_storage is None and buffer.need_reduce_scale_sync():
            fused.copy_grads_in(buffer)
