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
"""The step plan, executed: ``for phase in plan: run(phase)``.

``ShardingLayout.step_plan()`` lists every phase of a step (waits, reduces,
found_inf, the clip, the updates, fused states, the syncs); this module has
one executor per phase kind (``StepPhase.op``) and runs the phases of a
trigger in step-plan order. The order lives in the step plan only: ``reduce_gradients``
runs the ``reduce_gradients`` phases and ``step`` the ``step`` / ``sync[k]``
ones, and every collective an executor issues is one of the items its
phase's ``ops`` were derived from (``muon_sharding_step_plan.phase_ops``), so
what the tools predict is what runs.

Plain functions of the optimizer (``opt``); it never imports the
optimizer's module.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Iterable

import paddle.distributed as dist
from paddle.distributed.fleet.utils.log_util import logger

from . import collectives as comm
from .types import (
    OP_ALL_GATHER,
    OP_BROADCAST,
    OP_CLIP,
    OP_COLLECT_GRADS,
    OP_COPY_GRADS_IN,
    OP_FINISH_SYNC,
    OP_FOUND_INF,
    OP_FUSE_STATES,
    OP_PREPARE,
    OP_REDUCE,
    OP_REDUCE_SCATTER,
    OP_RESET_STORAGE,
    OP_STAGE_UPDATE,
    OP_UPDATE,
    OP_WAIT_HOOKED,
    STAGED_API,
    TRIGGER_REDUCE,
    TRIGGER_STEP,
    TRIGGER_SYNC,
)

if TYPE_CHECKING:
    from ..muon_sharding_optimizer import MuonShardingOptimizer

__all__ = ["StepRun", "EXECUTORS", "run_phases", "reduce_gradients", "reduce_2d_grads",
           "step", "staged_update", "sync_parameters", "is_step_phase", "separate_clip",
           "has_staged_api"]

_SYNC_OPS = (OP_BROADCAST, OP_ALL_GATHER)
_NO_TIMER = contextlib.nullcontext()
# Kinds an AMP overflow skips (the sync still runs when storage was freed).
_UPDATE_KINDS = (OP_CLIP, OP_PREPARE, OP_STAGE_UPDATE, OP_UPDATE, OP_FUSE_STATES)


class StepRun:
    """What the phases of one ``reduce_gradients`` / ``step`` call hand each other.

    Attributes:
        state: the optimizer's :class:`ShardingState` (buffers, groups, slices).
        reduce_op: AVG, or SUM where the build has none.
        params_grads: this rank's (param, grad) pairs (``collect_grads``).
        skipped: AMP found inf/nan: no clip, no update.
        storage_was_cleared: colours were freed (the sync refills them even when skipped).
        staged: the syncs are launched per stage, waited in ``finish_sync``.
        cache / unpack: sync buffers by item ref / (received buffer, params) to copy back.
        pending: launched stage syncs.
        muon_by_id / adamw_by_id: prepared pairs not yet updated by a stage.
    """

    def __init__(self, opt: MuonShardingOptimizer, staged: bool = False) -> None:
        self.state = opt._state
        self.reduce_op = dist.ReduceOp.AVG if opt._use_avg else dist.ReduceOp.SUM
        self.params_grads: list = []
        self.skipped = False
        self.storage_was_cleared = False
        self.staged = staged
        self.cache: dict = {}
        self.unpack: list = []
        self.pending: list = []
        self.muon_by_id: OrderedDict = OrderedDict()
        self.adamw_by_id: OrderedDict = OrderedDict()

    @property
    def launching(self) -> bool:
        """Stage syncs stay in flight (the staged update, not skipped)."""
        return self.staged and not self.skipped


def is_step_phase(phase) -> bool:
    """A phase ``step`` runs (its own or a stage's sync)."""
    return phase.trigger == TRIGGER_STEP or phase.trigger.startswith(TRIGGER_SYNC)


def run_phases(opt: MuonShardingOptimizer, phases: Iterable, run: StepRun) -> StepRun:
    """Run each phase with the executor of its kind, in the given (step-plan) order.

    Args:
        opt: the optimizer (buffers, groups, inner optimizer).
        phases: step-plan phases, in step-plan order.
        run: the call's shared state.

    Returns:
        StepRun: ``run``.
    """
    phases = list(phases)
    for i, phase in enumerate(phases):
        if run.skipped and phase.op in _UPDATE_KINDS:
            continue
        if run.skipped and phase.op in _SYNC_OPS and not run.storage_was_cleared:
            continue
        # a stage's last sync phase stays in flight; earlier ones complete
        last_of_trigger = i + 1 == len(phases) or phases[i + 1].trigger != phase.trigger
        with _timed_phase(opt, phase, run):
            EXECUTORS[phase.op](opt, phase, run, last_of_trigger)
    return run


def _timed_phase(opt, phase, run: StepRun) -> contextlib.AbstractContextManager:
    # develop's timer names: the update (and, staged, the launches) is
    # apply-optimize; what the sync costs past the update is sync-parameters
    if opt.timers is None:
        return _NO_TIMER
    if phase.op in (OP_CLIP, OP_PREPARE, OP_STAGE_UPDATE, OP_UPDATE):
        return opt._timed("apply-optimize")
    if phase.op in _SYNC_OPS:
        return opt._timed("apply-optimize" if run.launching else "sync-parameters")
    if phase.op == OP_FINISH_SYNC:
        return opt._timed("sync-parameters")
    return contextlib.nullcontext()


# ------------------------------------------------------------ entry points
def reduce_gradients(opt: MuonShardingOptimizer) -> None:
    """The step plan's ``reduce_gradients`` phases (the hooks launched the ``backward`` ones)."""
    run_phases(opt, opt._layout.phases_of(TRIGGER_REDUCE), StepRun(opt))


def reduce_2d_grads(opt: MuonShardingOptimizer, op=None) -> None:
    """Only the step plan's 2-D reduce phases (develop's ``_reduce_2d_grads``).

    Args:
        op (ReduceOp|None): AVG, or SUM where the build has no AVG (default:
            what this optimizer chose at construction).
    """
    run = StepRun(opt)
    if op is not None:
        run.reduce_op = op
    run_phases(opt, [ph for ph in opt._layout.phases_of(TRIGGER_REDUCE) if ph.op == OP_REDUCE],
               run)


def step(opt: MuonShardingOptimizer) -> list:
    """The step plan's ``step`` phases: update owned matrices and local slices, then sync.

    Returns:
        list: the (param, grad) pairs this rank updated.
    """
    layout = opt._layout
    run = StepRun(opt, staged=layout.staged_sync)
    run_phases(opt, _step_phases(layout), run)
    return run.params_grads


def _step_phases(layout) -> tuple:
    # the step's phases of the (cached, immutable) step plan, filtered once
    cached = layout.__dict__.get("_executor_step_phases")
    if cached is None:
        cached = tuple(ph for ph in layout.step_plan() if is_step_phase(ph))
        layout.__dict__["_executor_step_phases"] = cached
    return cached


def staged_update(opt: MuonShardingOptimizer, params_grads: list) -> None:
    """The staged part of the step plan on given pairs: clip, per stage update and sync, wait.

    develop's ``_step_with_sync_overlap`` (``step`` runs the same phases).
    """
    run = StepRun(opt, staged=True)
    run.params_grads = list(params_grads)
    kinds = (OP_CLIP, OP_PREPARE, OP_STAGE_UPDATE, OP_FINISH_SYNC) + _SYNC_OPS
    run_phases(opt, [ph for ph in opt._layout.step_plan()
                     if is_step_phase(ph) and ph.op in kinds], run)


def sync_parameters(opt: MuonShardingOptimizer) -> None:
    """Only the step plan's sync phases, each completed.

    develop's ``_sharding_sync_parameters``.
    """
    run_phases(opt, [ph for ph in opt._layout.step_plan()
                     if is_step_phase(ph) and ph.op in _SYNC_OPS + (OP_FINISH_SYNC,)],
               StepRun(opt))


# --------------------------------------------------------------- executors
def _copy_grads_in(opt, phase, run: StepRun, last: bool) -> None:
    opt._copy_released_grads_in()


def _wait_hooked(opt, phase, run: StepRun, last: bool) -> None:
    slices = []
    for ref, _ in phase.items:
        if ref[0] == "slice":
            slices.append(run.state.rs_buffers[ref[1]])
        else:
            for buffer in run.state.muon_buckets[ref[1]].buffers:
                buffer.scale_grads()
    if slices:
        comm.reduce_scatter_slices(slices, lambda b: True)


def _reduce_scatter(opt, phase, run: StepRun, last: bool) -> None:
    comm.reduce_scatter_slices([run.state.rs_buffers[ref[1]] for ref, _ in phase.items],
                               lambda b: False)


def _reduce(opt, phase, run: StepRun, last: bool) -> None:
    state = run.state
    routes = [(tensor, root) for ref, root in phase.items
              for tensor in state.grad_tensors(state.muon_buckets[ref[1]])]
    with comm.comm_phase(phase.label):
        comm.mean_onto(routes, state.phase_group(phase), run.reduce_op)


def _reset_storage(opt, phase, run: StepRun, last: bool) -> None:
    # Colours freed by clear_param_storage get their storage back first, as in develop.
    run.storage_was_cleared = bool(opt._state.cleared_colours)
    opt.reset_param_storage()


def _collect_grads(opt, phase, run: StepRun, last: bool) -> None:
    opt._assign_slice_grad()
    for p in opt._local_parameter_list:
        grad = getattr(p, "main_grad", None)
        if grad is None:
            grad = p._grad_ivar()
        if grad is not None:
            run.params_grads.append((p, grad))
    opt._ensure_global_clip()


def _found_inf(opt, phase, run: StepRun, last: bool) -> None:
    # AMP: HybridParallelGradScaler reaches minimize even after an
    # overflow; found_inf is identical on all ranks (all-reduced MAX).
    found_inf = opt._inner_opt._get_auxiliary_var("found_inf")
    if found_inf is not None and bool(found_inf):
        logger.warning("MuonShardingOptimizer: found inf/nan, step skipped")
        run.skipped = True


def separate_clip(opt) -> bool:
    """The clip runs as its own phase: Muon's staged API, and the update not bypassed."""
    return opt._has_staged_api and not opt._bypass_update


def _clip(opt, phase, run: StepRun, last: bool) -> None:
    # The clip's norm all-reduces (the phase's items) carry its label.
    if separate_clip(opt):
        with comm.comm_phase(phase.label):
            run.params_grads = opt._inner_opt.apply_grad_clip(run.params_grads)


def _update(opt, phase, run: StepRun, last: bool) -> None:
    # A phase too: a rank stuck in Newton-Schulz shows it in the profiler
    # and the flight recorder.
    inner = opt._inner_opt
    with comm.comm_phase(phase.label):
        if separate_clip(opt):
            inner.update_params(*inner.prepare_optimize(run.params_grads))
        else:
            # no staged API (or bypassed): the inner optimizer clips itself
            inner._apply_optimize(loss=None, startup_program=None,
                                  params_grads=run.params_grads)


def _prepare(opt, phase, run: StepRun, last: bool) -> None:
    if opt._sync_stages is None:
        opt._sync_stages = opt._build_sync_stages()
    muon, adamw = opt._inner_opt.prepare_optimize(run.params_grads)
    run.muon_by_id = OrderedDict((id(p), (p, g)) for p, g in muon)
    run.adamw_by_id = OrderedDict((id(p), (p, g)) for p, g in adamw)


def _stage_update(opt, phase, run: StepRun, last: bool) -> None:
    # develop's overlap_optimize_and_sync: update stage k, its sync follows
    stage = opt._sync_stages[phase.items[0][0][1]]
    stage_muon, stage_adamw = [], []
    for p in stage["local_params"]:
        if id(p) in run.muon_by_id:
            stage_muon.append(run.muon_by_id.pop(id(p)))
        elif id(p) in run.adamw_by_id:
            stage_adamw.append(run.adamw_by_id.pop(id(p)))
    if stage_muon or stage_adamw:
        with comm.comm_phase(phase.label):
            opt._inner_opt.update_params(stage_muon, stage_adamw)


def _sync(opt, phase, run: StepRun, last: bool) -> None:
    launch = run.launching and last
    pending = opt._run_sync_phase(phase, run.cache, run.unpack, launch=launch)
    if not run.launching:
        return
    run.pending += pending
    if last:
        unpack, run.unpack = run.unpack, []

        def copy_back():
            for buffer, params in unpack:
                comm.unflatten_from(buffer, params)

        # waited after the stage's collectives: the received values land then
        run.pending.append(comm.PendingCollective([], [], "copy back", copy_back))


def _finish_sync(opt, phase, run: StepRun, last: bool) -> None:
    for task in run.pending:
        task.wait()
    run.pending = []
    for buffer, params in run.unpack:
        comm.unflatten_from(buffer, params)
    run.unpack = []
    if run.launching:
        leftover = [p.name for p, _ in list(run.muon_by_id.values())
                    + list(run.adamw_by_id.values())]
        if leftover:
            raise AssertionError(
                f"overlap_optimize_and_sync: parameters {leftover} have gradients but "
                "belong to no sync stage; the stages were built for another parameter set."
            )


def _fuse_states(opt, phase, run: StepRun, last: bool) -> None:
    if opt._settings.enable_fuse_optimizer_states:
        opt._fuse_optimizer_states()


#: phase kind (``StepPhase.op``) -> executor ``(opt, phase, run, last_of_trigger)``.
EXECUTORS: dict[str, Callable] = {
    OP_COPY_GRADS_IN: _copy_grads_in,
    OP_WAIT_HOOKED: _wait_hooked,
    OP_REDUCE_SCATTER: _reduce_scatter,
    OP_REDUCE: _reduce,
    OP_RESET_STORAGE: _reset_storage,
    OP_COLLECT_GRADS: _collect_grads,
    OP_FOUND_INF: _found_inf,
    OP_CLIP: _clip,
    OP_UPDATE: _update,
    OP_PREPARE: _prepare,
    OP_STAGE_UPDATE: _stage_update,
    OP_BROADCAST: _sync,
    OP_ALL_GATHER: _sync,
    OP_FINISH_SYNC: _finish_sync,
    OP_FUSE_STATES: _fuse_states,
}


def has_staged_api(optimizer) -> bool:
    """Whether ``optimizer`` has Muon's staged update API (clip / prepare / update apart)."""
    return all(callable(getattr(optimizer, n, None)) for n in STAGED_API)

