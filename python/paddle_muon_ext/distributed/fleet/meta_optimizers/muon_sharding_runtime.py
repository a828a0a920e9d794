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
"""Bodies of :class:`MuonShardingOptimizer`'s per-step methods.

Gradient reduction, ``step`` (plain and overlapped update) and gradient /
parameter storage clearing. Split from ``muon_sharding_optimizer`` the same
way as ``muon_sharding_build``: the thin develop methods stay there, the
bodies live here (``opt`` is the optimizer); like the build module it never
imports the optimizer's module.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (
    HybridParallelClipGrad,
)
from paddle.distributed.fleet.utils.log_util import logger
import paddle
import paddle.distributed as dist

from . import muon_fused_buffer as fused
from . import muon_sharding_collectives as comm
from .muon_sharding_stages import run_staged_update
from .muon_sharding_types import TRIGGER_BACKWARD
from .muon_sharding_types import TRIGGER_REDUCE

if TYPE_CHECKING:
    from .muon_sharding_optimizer import MuonShardingOptimizer


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


def reduce_gradients(opt: MuonShardingOptimizer) -> None:
    # The plan's reduce_gradients phases; hooked buffers (the backward
    # phases) were launched during backward and are waited for first.
    op = dist.ReduceOp.AVG if opt._use_avg else dist.ReduceOp.SUM
    opt._copy_released_grads_in()
    hooked_slices = set()
    for phase in opt._layout.phases_of(TRIGGER_BACKWARD):
        for ref, _ in phase.items:
            if ref[0] == "slice":
                hooked_slices.add(ref[1])
            else:
                for buffer in opt._muon_buckets[ref[1]].buffers:
                    buffer.scale_grads()
    for phase in opt._layout.phases_of(TRIGGER_REDUCE):
        if phase.op == "reduce_scatter":
            slices = [ref[1] for ref, _ in phase.items]
            launched = {id(opt._rs_buffers[i]) for i in slices if i in hooked_slices}
            comm.reduce_scatter_slices([opt._rs_buffers[i] for i in slices],
                                       lambda b: id(b) in launched)
    opt._reduce_2d_grads(op)


def reduce_2d_grads(opt: MuonShardingOptimizer, op=None) -> None:
    """Reduce the Muon gradients onto their owners: the plan's 2-D reduce phases.

    Args:
        op (ReduceOp|None): AVG, or SUM where the build has no AVG (default:
            what this optimizer chose at construction).
    """
    if op is None:
        op = dist.ReduceOp.AVG if opt._use_avg else dist.ReduceOp.SUM
    for phase in opt._layout.phases_of(TRIGGER_REDUCE):
        if phase.op != "reduce":
            continue
        routes = [(tensor, root) for ref, root in phase.items
                  for tensor in opt._grad_tensors(opt._muon_buckets[ref[1]])]
        with comm.comm_phase(phase.label):
            comm.mean_onto(routes, opt._phase_group(phase), op)


def step(opt: MuonShardingOptimizer) -> list:
    """Update owned matrices (Muon) and local slices (AdamW), then sync.

    Colours freed by :meth:`clear_param_storage` get their storage back
    first, as in develop.

    Returns:
        list: the (param, grad) pairs this rank updated.
    """
    storage_was_cleared = bool(opt._cleared_colours)
    opt.reset_param_storage()
    opt._assign_slice_grad()
    params_grads = []
    for p in opt._local_parameter_list:
        grad = getattr(p, "main_grad", None)
        if grad is None:
            grad = p._grad_ivar()
        if grad is not None:
            params_grads.append((p, grad))
    opt._ensure_global_clip()
    # AMP: HybridParallelGradScaler reaches minimize even after an
    # overflow; found_inf is identical on all ranks (all-reduced MAX).
    found_inf = opt._inner_opt._get_auxiliary_var("found_inf")
    if found_inf is not None and bool(found_inf):
        logger.warning("MuonShardingOptimizer: found inf/nan, step skipped")
        if storage_was_cleared:
            opt._sharding_sync_parameters()  # refill the freed colours
        return params_grads
    staged = opt._stages_in_use()
    if staged:
        # develop's overlap_optimize_and_sync: the sync travels with the update
        if opt._sync_stages is None:
            opt._sync_stages = opt._build_sync_stages()
        with opt._timed("apply-optimize"):
            opt._step_with_sync_overlap(params_grads)
    else:
        # A phase too: a rank stuck in the clip's all-reduce or in
        # Newton-Schulz shows it in the profiler and the flight recorder.
        with opt._timed("apply-optimize"), comm.comm_phase("optimizer_step"):
            opt._inner_opt._apply_optimize(
                loss=None, startup_program=None, params_grads=params_grads
            )
    if opt._settings.enable_fuse_optimizer_states:
        opt._fuse_optimizer_states()
    if not staged:
        opt._sharding_sync_parameters()
    return params_grads


def step_with_sync_overlap(opt: MuonShardingOptimizer, params_grads: list) -> None:
    """Clip and prepare once; per stage update, then launch its sync; wait all."""

    def label(index, stage):
        return comm.comm_phase(f"optimizer_step[{index}]")

    def wait_all(pending):
        # what the sync still costs once the updates are done
        with opt._timed("sync-parameters"):
            for task in pending:
                task.wait()

    with comm.comm_phase("optimizer_step"):
        run_staged_update(opt._inner_opt, params_grads, opt._sync_stages,
                          opt._launch_stage_sync, label, wait_all)


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
    if color in opt._cleared_colours:
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
    opt._cleared_colours[color] = saved


def reset_param_storage(opt: MuonShardingOptimizer) -> None:
    """Give every colour freed by :meth:`clear_param_storage` its storage back.

    Element-wise parameters get this rank's slice back; other values are
    refilled by the next parameter sync.
    """
    for color, saved in opt._cleared_colours.items():
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
    opt._cleared_colours.clear()


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


def all_buffers(opt: MuonShardingOptimizer) -> list:
    return [b for bucket in opt._muon_buckets for b in bucket.buffers] + list(opt._rs_buffers)


def owned_muon_params(opt: MuonShardingOptimizer) -> list:
    return [p for bucket in opt._muon_buckets if bucket.owner == opt._rank for p in bucket.params]


def local_slice_params(opt: MuonShardingOptimizer) -> list:
    return [opt._slice_params[p.name] for buffer in opt._rs_buffers for p in buffer.params
            if fused.has_local_slice(buffer, p.name)]


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


def grad_tensors(bucket) -> list:
    if bucket.buffers:
        return [b.grad_storage for b in bucket.buffers]
    return [get_param_grad(p) for p in bucket.params]
