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
"""The runtime of a built :class:`MuonShardingOptimizer`: its mutable state, its
buffers with their communication, and the one loop that runs the layout's step plan."""

from __future__ import annotations

import contextlib
import importlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import paddle
import paddle.distributed as dist
from paddle.base.framework import EagerParamBase
from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (
    HybridParallelClipGrad,
)
from paddle.distributed.fleet.utils import tensor_fusion_helper
from paddle.distributed.fleet.utils.log_util import logger
from paddle.profiler import RecordEvent

from ..muon_flight.recorder import enter_phase, exit_phase, get_flight_recorder, phase_of_thread
from .layout import is_hooked
from .step_plan import (
    PHASE_ALL_GATHER,
    PHASE_REDUCE_SCATTER,
    MuonRef,
    Op,
    Route,
    SliceRef,
    StageRef,
    SyncTrigger,
    Trigger,
)


#: What the overlapped update needs from the inner optimizer (Muon's staged API).
STAGED_API: tuple = ("apply_grad_clip", "prepare_optimize", "update_params", "muon_group_key")

# The package re-exports the batch_isend_irecv *function* under the module's
# name; _coalescing_manager lives in the module.
_batch_isend_irecv = importlib.import_module("paddle.distributed.communication.batch_isend_irecv")

_SYNC_OPS = (Op.BROADCAST, Op.ALL_GATHER)
# What an AMP overflow skips (the sync still runs when storage was freed).
_UPDATE_OPS = (Op.CLIP, Op.PREPARE, Op.STAGE_UPDATE, Op.UPDATE, Op.FUSE_STATES)
# develop's timer of each phase kind (sync phases: see ShardingRuntime.run).
_TIMER_OF = {Op.CLIP: "apply-optimize", Op.PREPARE: "apply-optimize",
             Op.STAGE_UPDATE: "apply-optimize", Op.UPDATE: "apply-optimize",
             Op.FINISH_SYNC: "sync-parameters"}


# ------------------------------------------------------------ collectives
@contextlib.contextmanager
def comm_phase(label: str) -> Iterator[None]:
    """Label the collectives issued inside the block ``label`` (profiler, flight recorder)."""
    previous = enter_phase(label)
    try:
        with RecordEvent(label):
            yield
    finally:
        exit_phase(previous)


def _describe(op: str, group, phase) -> str:
    return f"{op} on group {list(group.ranks)} (phase {phase!r})"


def _dump_raised(recorder, describe: str, exc: Exception) -> None:
    recorder.dump(f"{describe} raised {type(exc).__name__}: {exc}", request_peers=True,
                  error=exc)


def _start_entry(op: str, group, tensor, phase):
    """The recorder's entry of a collective (None on a one-rank group or without storage)."""
    if group.nranks > 1 and tensor is not None:
        return get_flight_recorder().start(op, group, None, tensor, phase)
    return None


class PendingCollective:
    """A launched coalesced block; :meth:`wait` completes it once, then runs ``then``."""

    def __init__(self, tasks: list, entries: list, describe: str,
                 then: Callable[[], None] | None = None) -> None:
        self._tasks, self._entries, self._describe, self._then = tasks, entries, describe, then
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
            _dump_raised(recorder, self._describe, exc)
            raise
        recorder.finish(self._entries)
        if self._then is not None:
            self._then()


def launch_coalesced(op: str, routes: Sequence[tuple], group, reduce_op=None,
                     mean: bool = False) -> PendingCollective:
    """Issue a reduce (onto each route's rank) or broadcast (from it) per route, one block.

    Args:
        op (str): ``"reduce"`` or ``"broadcast"``.
        routes (Sequence[tuple[Tensor, int]]): tensor and root global rank.
        group (Group): every rank of it issues the same routes.
        reduce_op (ReduceOp|None): the reduce's op.
        mean (bool): the reduce is the mean over ``group``: with SUM (no AVG
            reduce) each addend is divided by ``group.nranks`` first.

    Returns:
        PendingCollective: wait on it before reading the tensors.
    """
    # A one-rank group holds the result already; Paddle gives it no process
    # group to coalesce on.
    if not routes or group.nranks <= 1:
        return PendingCollective([], [], op)
    if mean and reduce_op == dist.ReduceOp.SUM:
        # Divide before the sum: a sum of x_i / n is bounded by max |x_i|, so it
        # stays finite wherever the single-process run does (summing first
        # overflows near the fp32 maximum).
        for tensor, _ in routes:
            tensor.scale_(1.0 / group.nranks)
    recorder = get_flight_recorder()
    phase = phase_of_thread()
    describe = _describe(op, group, phase)
    tasks, entries = [], []
    try:
        with _batch_isend_irecv._coalescing_manager(group, tasks):
            for tensor, root in routes:
                entries.append(recorder.start(op, group, root, tensor, phase))
                if op == Op.REDUCE:
                    task = dist.reduce(tensor, dst=root, op=reduce_op, group=group,
                                       sync_op=False)
                else:
                    task = dist.broadcast(tensor, src=root, group=group, sync_op=False)
                if task is not None:
                    tasks.append(task)
    except Exception as exc:
        _dump_raised(recorder, describe, exc)
        raise
    return PendingCollective(tasks, entries, describe)


def mean_onto(routes: Sequence[tuple], group, op) -> None:
    """Reduce each tensor onto its rank as the mean over ``group`` (AVG, or SUM pre-divided)."""
    launch_coalesced(Op.REDUCE, routes, group, op, mean=True).wait()


def flatten_into(tensors: Sequence, out) -> None:
    """Copy ``tensors`` back to back into the 1-D tensor ``out`` (in place)."""
    paddle.assign(paddle.concat([t.reshape([-1]) for t in tensors]), output=out)


def unpack_all(unpack: list) -> None:
    """Copy each received ``(buffer, params)`` into ``params`` (:func:`flatten_into`'s inverse)."""
    for buffer, params in unpack:
        offset = 0
        for t in params:
            numel = int(t.numel())
            paddle.assign(buffer[offset: offset + numel].reshape(t.shape), output=t)
            offset += numel


# ------------------------------------- FusedCommBuffer internals, read here only
def has_local_slice(buffer, name: str) -> bool:
    """Whether this rank's shard of the buffer holds part of parameter ``name``."""
    return buffer._sharding_param_grad_view[name].has_effective_slice_param


def fill_local_slice(buffer, name: str, slice_param) -> None:
    """Point ``slice_param`` at this rank's part of parameter ``name``."""
    buffer._sharding_param_grad_view[name].fill_slice_param(slice_param)


@contextlib.contextmanager
def _recorded(buffer, op: str) -> Iterator[None]:
    """The block's collective on ``buffer``, recorded by the flight recorder as ``op``."""
    phase = phase_of_thread()
    group = buffer._comm_group
    tensor = buffer.grad_storage if op == Op.REDUCE_SCATTER else buffer.param_storage
    entry = _start_entry(op, group, tensor, phase)
    try:
        yield
    except Exception as exc:
        _dump_raised(get_flight_recorder(), _describe(op, group, phase), exc)
        raise
    get_flight_recorder().finish((entry,))


def reduce_scatter_slices(buffers: Sequence, launched_by_hook: bool) -> None:
    """Reduce-scatter (or, ``launched_by_hook``, only wait for) each 1-D buffer, and scale it."""
    with comm_phase(PHASE_REDUCE_SCATTER):
        for buffer in buffers:
            with _recorded(buffer, Op.REDUCE_SCATTER):
                if not launched_by_hook and buffer._comm_group.nranks > 1:
                    buffer._comm_grads()
                buffer.scale_grads()


def all_gather_slices(buffers: Sequence) -> None:
    """All-gather each 1-D parameter buffer from the ranks' slices."""
    with comm_phase(PHASE_ALL_GATHER):
        for buffer in buffers:
            with _recorded(buffer, Op.ALL_GATHER):
                buffer.sync_params()


def launch_all_gather(buffer) -> PendingCollective:
    """Launch one 1-D buffer's all-gather (develop's ``sync_params(sync=False)``)."""
    group = buffer._comm_group
    with comm_phase(PHASE_ALL_GATHER):
        entry = _start_entry(Op.ALL_GATHER, group, buffer.param_storage, PHASE_ALL_GATHER)
        buffer.sync_param_task = None
        buffer.sync_params(sync=False, param2task={})
        task, buffer.sync_param_task = buffer.sync_param_task, None
    return PendingCollective([task] if task is not None else [], [entry],
                             _describe(Op.ALL_GATHER, group, PHASE_ALL_GATHER))


# ---------------------------------------------------------------- buffers
@dataclass
class MuonBucket:
    """The Muon parameters of one (colour group, owner, dtype) and their reduce buffers."""

    colour: str | None      # colour key (None for the default sharding group)
    group: Any              # the colour's Group
    owner: int              # global rank that owns and updates these parameters
    dtype: Any
    params: list            # in model order
    hierarchical: bool      # routed through the node / same-card groups
    buffers: list = field(default_factory=list)  # fused grad buffers (empty: per-param reduces)

    def grad_tensors(self) -> list:
        """What the bucket reduces: its fused buffers, else each parameter's gradient."""
        if self.buffers:
            return [b.grad_storage for b in self.buffers]
        return [get_param_grad(p) for p in self.params]


def get_param_grad(param):
    """The gradient to reduce (``main_grad`` under MixPrecisionLayer, else ``grad``);
    zeros when missing this step, since other ranks may have one."""
    if hasattr(param, "main_grad"):
        if param.main_grad is None:
            param.main_grad = paddle.zeros(param.shape, dtype="float32")
        return param.main_grad
    if param.grad is None:
        param._copy_gradient_from(paddle.zeros_like(param))
    return param.grad


def create_slice_param(param) -> EagerParamBase:
    """The 1-D slice parameter standing for ``param`` in the inner optimizer (same name)."""
    slice_param = EagerParamBase(shape=[1], dtype=param.dtype)
    slice_param.name = param.name
    for attr in ("is_distributed", "optimize_attr", "need_clip", "no_sync"):
        if hasattr(param, attr):
            setattr(slice_param, attr, getattr(param, attr))
    return slice_param


def missing_staged_api(optimizer) -> list:
    """The names of Muon's staged update API (:data:`STAGED_API`) ``optimizer`` lacks."""
    return [n for n in STAGED_API if not callable(getattr(optimizer, n, None))]


# ---------------------------------------------------------- staged update
def prepare_by_id(inner_opt, params_grads: list) -> tuple:
    """Muon's ``prepare_optimize``: its (muon, adamw) pairs, each keyed by ``id(param)``."""
    return tuple(OrderedDict((id(p), (p, g)) for p, g in pairs)
                 for pairs in inner_opt.prepare_optimize(params_grads))


def take_stage(muon_by_id: dict, adamw_by_id: dict, params: list) -> tuple[list, list]:
    """Pop the prepared (muon, adamw) pairs of ``params``, in their order."""
    return ([muon_by_id.pop(id(p)) for p in params if id(p) in muon_by_id],
            [adamw_by_id.pop(id(p)) for p in params if id(p) in adamw_by_id])


def check_no_leftover(muon_by_id: dict, adamw_by_id: dict) -> None:
    """Refuse prepared pairs no sync stage took (AssertionError)."""
    leftover = [p.name for p, _ in list(muon_by_id.values()) + list(adamw_by_id.values())]
    if leftover:
        raise AssertionError(
            f"overlap_optimize_and_sync: parameters {leftover} have gradients but belong "
            "to no sync stage; the stages were built for another parameter set.")


@dataclass
class _Call:
    """What the phases of one ``reduce_gradients`` / ``step`` call hand each other."""

    reduce_op: Any
    staged: bool = False        # the update runs stage by stage
    params_grads: list = field(default_factory=list)
    skipped: bool = False       # AMP found inf/nan: no clip, no update
    storage_was_cleared: bool = False
    cache: dict = field(default_factory=dict)     # sync buffers by item ref
    unpack: list = field(default_factory=list)    # (received buffer, params) to copy back
    pending: list = field(default_factory=list)   # launched stage syncs
    muon_by_id: dict = field(default_factory=OrderedDict)   # prepared, not yet updated
    adamw_by_id: dict = field(default_factory=OrderedDict)

    @property
    def launching(self) -> bool:
        """Stage syncs stay in flight until finish_sync (staged, not skipped)."""
        return self.staged and not self.skipped


# ---------------------------------------------------------------- runtime
@dataclass
class ShardingRuntime:
    """Every piece of mutable state of one rank's built optimizer, and the step loop: built
    by ``muon_sharding.build`` from the layout; ``step`` and ``reduce_gradients`` only
    walk the plan (:meth:`run`)."""

    rank: int                                    # this global rank
    inner: Any = None                            # the inner optimizer (maybe MixPrecisionOptimizer)
    hcg: Any = None                              # the hybrid communicate group
    settings: Any = None                         # ShardingSettings of the strategy
    layout: Any = None                           # the ShardingLayout the buffers follow
    plan: Any = None                             # hierarchical routing plan (None: flat)
    colour_groups: dict = field(default_factory=dict)   # colour key -> Group
    plan_groups: Any = None                      # this rank's node / same-card groups
    trainer_comms: list = field(default_factory=list)   # develop's node groups, by node
    trainer_same_card_comms: list = field(default_factory=list)  # [stage][card] groups
    param_by_name: dict = field(default_factory=dict)   # trainable name -> parameter
    muon_buckets: list = field(default_factory=list)    # MuonBucket per layout bucket
    rs_buffers: list = field(default_factory=list)      # element-wise FusedCommBuffers
    rs_colour: dict = field(default_factory=dict)       # id(buffer) -> colour key
    slice_params: dict = field(default_factory=dict)    # name -> its slice parameter
    local_params: list = field(default_factory=list)    # what the inner optimizer updates
    use_avg: bool = False                        # AVG reduce (else SUM, pre-divided)
    use_main_grad: bool = False                  # parameters had main_grad when built
    overlap_optimize_and_sync: bool = False      # develop's resolved flag
    staged: bool = False                         # the update runs stage by stage
    separate_clip: bool = False                  # the clip is its own phase (staged API)
    timers: Any = None                           # Paddle's timers when enabled
    reduce_plan: tuple = ()                      # the phases reduce_gradients runs
    step_plan: tuple = ()                        # the phases step runs
    cleared_colours: dict = field(default_factory=OrderedDict)  # colour -> saved slices
    fused_state_buffers: dict = field(default_factory=dict)     # dtype -> fused states

    # ------------------------------------------------------------ building
    def _fused_buffer(self, name: str, params: list, group, colour, **kwargs):
        """A FusedCommBuffer of ``colour``'s; a SUM is pre-divided, as in :func:`mean_onto`."""
        # Without hooks a buffer never counts check-ins: grads accumulate in
        # place and reduce_gradients runs once per optimizer step.
        hooked = is_hooked(self.settings.comm_overlap, colour)
        return tensor_fusion_helper.FusedCommBuffer(
            name, params, group, acc_steps=self.settings.accumulate_steps if hooked else 1,
            use_reduce_avg=self.use_avg, scale_after_comm=False, **kwargs)

    def build_muon_buckets(self) -> None:
        """One :class:`MuonBucket` (and its fused reduce buffers) per layout bucket."""
        buckets = []
        for spec in self.layout.muon_buckets:
            params = [self.param_by_name[n] for n in spec.params]
            bucket = MuonBucket(spec.colour, self.colour_groups[spec.colour], spec.owner,
                                params[0].dtype, params, spec.route == Route.HIERARCHICAL)
            # A hierarchical buffer's own reduce (the overlap hooks') is its first
            # hop: inside the node, onto the rank with the owner's card.
            group, dst = bucket.group, spec.owner
            if bucket.hierarchical:
                group = self.plan_groups.node_group
                dst = self.plan.intra_node_root(spec.owner, self.rank)
            bucket.buffers = [
                self._fused_buffer(f"muon_{spec.colour}_{spec.owner}_{spec.dtype}_{i}",
                                   [self.param_by_name[n] for n in chunk], group, spec.colour,
                                   act=tensor_fusion_helper.HOOK_ACTION.REDUCE, dst=dst,
                                   release_grads=False)  # the owner reads them in step
                for i, chunk in enumerate(spec.chunks)
            ]
            buckets.append(bucket)
        self.muon_buckets[:] = buckets

    def build_slice_buffers(self) -> None:
        """The element-wise buffer of each layout slice buffer, and their slice params."""
        self.rs_buffers.clear()
        self.rs_colour.clear()
        self.slice_params.clear()
        for spec in self.layout.slice_buffers:
            chunk = [self.param_by_name[n] for n in spec.params]
            buffer = self._fused_buffer(
                f"slice_{spec.colour}_{spec.dtype}_{len(self.rs_buffers)}", chunk,
                self.colour_groups[spec.colour], spec.colour,
                act=tensor_fusion_helper.HOOK_ACTION.REDUCE_SCATTER,
                release_grads=self.settings.release_grads)
            # FusedCommBuffer leaves a weakref for Paddle's own sharding optimizer
            # to collect; this optimizer keeps its buffers.
            if hasattr(chunk[0], "comm_buffer_ref"):
                del chunk[0].comm_buffer_ref
            self.rs_buffers.append(buffer)
            self.rs_colour[id(buffer)] = spec.colour
            for p in chunk:
                self.slice_params[p.name] = create_slice_param(p)

    def register_hooks(self) -> None:
        """Backward hooks that launch each hooked buffer's first hop once its grads are in."""
        for buffer, label in self.hooked_buffers():
            for param in buffer.params:
                param._register_backward_hook(_backward_hook(buffer, param, label))

    def plan_phases(self) -> None:
        """Fix :attr:`reduce_plan` and :attr:`step_plan`, less the kinds this build never needs."""
        idle = set()
        if not self.separate_clip:
            idle.add(Op.CLIP)  # the inner optimizer clips inside its update
        if not self.settings.enable_fuse_optimizer_states:
            idle.add(Op.FUSE_STATES)
        if not self.settings.release_grads:
            idle.add(Op.COPY_GRADS_IN)
        self.reduce_plan = tuple(ph for ph in self.layout.phases_of(Trigger.REDUCE)
                                 if ph.op not in idle)
        self.step_plan = tuple(ph for ph in self.step_phases() if ph.op not in idle)

    # ------------------------------------------------------------- queries
    def all_buffers(self) -> list:
        """Every fused buffer: the Muon buckets', then the element-wise ones."""
        return self.fused_2d_buffers() + list(self.rs_buffers)

    def fused_2d_buffers(self) -> list:
        """The Muon buckets' fused gradient buffers, in bucket order."""
        return [b for bucket in self.muon_buckets for b in bucket.buffers]

    def owned_muon_params(self) -> list:
        """The whole matrices this rank owns and updates."""
        return [p for bucket in self.muon_buckets if bucket.owner == self.rank
                for p in bucket.params]

    def local_slice_params(self) -> list:
        """The slice parameters this rank holds a (non-empty) slice of."""
        return [self.slice_params[p.name] for buffer in self.rs_buffers for p in buffer.params
                if has_local_slice(buffer, p.name)]

    def hooked_buffers(self) -> list:
        """(buffer, phase label) of the step plan's backward phases (multi-rank groups)."""
        out = []
        for phase in self.layout.phases_of(Trigger.BACKWARD):
            if len(phase.group) <= 1:
                continue  # a one-rank group holds its result already
            for ref, _ in phase.items:
                buffers = ([self.rs_buffers[ref.index]] if isinstance(ref, SliceRef)
                           else self.muon_buckets[ref.index].buffers)
                out.extend((b, phase.label) for b in buffers)
        return out

    def phase_group(self, phase):
        """The process group a step-plan phase runs on."""
        if phase.route == Route.INTRA_NODE:
            return self.plan_groups.node_group
        if phase.route == Route.CROSS_NODE:
            return self.plan_groups.same_card_group
        return {tuple(g.ranks): g for g in self.colour_groups.values()}[tuple(phase.group)]

    def step_phases(self, ops: tuple | None = None) -> tuple:
        """The layout's phases ``step`` runs (only those of kind ``ops`` when given)."""
        return tuple(ph for ph in self.layout.step_plan()
                     if (ph.trigger == Trigger.STEP or isinstance(ph.trigger, SyncTrigger))
                     and (ops is None or ph.op in ops))

    @property
    def base_opt(self):
        """The innermost optimizer (the Muon that owns the state)."""
        return optimizer_chain(self.inner)[-1]

    @property
    def reduce_op(self):
        return dist.ReduceOp.AVG if self.use_avg else dist.ReduceOp.SUM

    # ---------------------------------------------------------------- loop
    def run(self, phases: Sequence, staged: bool = False, call: _Call | None = None) -> _Call:
        """Run ``phases`` (in step-plan order), each with the executor of its kind.

        Args:
            phases: phases of the plan (:attr:`reduce_plan`, :attr:`step_plan` or a part).
            staged: stage syncs stay in flight until ``finish_sync``.
            call: what earlier phases of the same call produced (a new one when None).

        Returns:
            _Call: what the phases produced (``params_grads``: the pairs updated).
        """
        call = call or _Call(self.reduce_op, staged=staged)
        for i, phase in enumerate(phases):
            if call.skipped and (phase.op in _UPDATE_OPS or (
                    phase.op in _SYNC_OPS and not call.storage_was_cleared)):
                continue
            # a stage's last sync phase stays in flight; earlier ones complete
            last = i + 1 == len(phases) or phases[i + 1].trigger != phase.trigger
            # a sync phase is timed as apply-optimize while launched in the staged update
            timer = _TIMER_OF.get(phase.op)
            if phase.op in _SYNC_OPS:
                timer = "apply-optimize" if call.launching else "sync-parameters"
            with self.timed(timer):
                # the executor of a phase kind is the method named after it
                getattr(self, "_" + phase.op.value)(phase, call, last)
        return call

    @contextlib.contextmanager
    def timed(self, name: str | None) -> Iterator[None]:
        """develop's timer ``name`` around the block (when timers are on)."""
        if self.timers is None or name is None:
            yield
            return
        self.timers(name).start()
        try:
            yield
        finally:
            self.timers(name).stop()

    # ----------------------------------------------------------- executors
    def _copy_grads_in(self, phase, call: _Call, last: bool) -> None:
        # released 1-D buffers are rebuilt from the parameters' own gradients
        for buffer in self.rs_buffers:
            if buffer.grad_storage is None and buffer.need_reduce_scale_sync():
                for param in buffer.params:
                    buffer._copy_grad_to_buffer(param)

    def _wait_hooked(self, phase, call: _Call, last: bool) -> None:
        slices = []
        for ref, _ in phase.items:
            if isinstance(ref, SliceRef):
                slices.append(self.rs_buffers[ref.index])
            else:
                for buffer in self.muon_buckets[ref.index].buffers:
                    buffer.scale_grads()
        if slices:
            reduce_scatter_slices(slices, launched_by_hook=True)

    def _reduce_scatter(self, phase, call: _Call, last: bool) -> None:
        reduce_scatter_slices([self.rs_buffers[ref.index] for ref, _ in phase.items],
                              launched_by_hook=False)

    def _reduce(self, phase, call: _Call, last: bool) -> None:
        routes = [(tensor, root) for ref, root in phase.items
                  for tensor in self.muon_buckets[ref.index].grad_tensors()]
        with comm_phase(phase.label):
            mean_onto(routes, self.phase_group(phase), call.reduce_op)

    def _reset_storage(self, phase, call: _Call, last: bool) -> None:
        call.storage_was_cleared = bool(self.cleared_colours)
        self.reset_param_storage()

    def _collect_grads(self, phase, call: _Call, last: bool) -> None:
        self.assign_slice_grads()
        for p in self.local_params:
            grad = getattr(p, "main_grad", None)
            if grad is None:
                grad = p._grad_ivar()
            if grad is not None:
                call.params_grads.append((p, grad))
        self.ensure_global_clip()

    def _found_inf(self, phase, call: _Call, last: bool) -> None:
        # AMP: HybridParallelGradScaler reaches minimize even after an overflow;
        # found_inf is identical on all ranks (all-reduced MAX).
        found_inf = self.inner._get_auxiliary_var("found_inf")
        if found_inf is not None and bool(found_inf):
            logger.warning("MuonShardingOptimizer: found inf/nan, step skipped")
            call.skipped = True

    def _all_reduce(self, phase, call: _Call, last: bool) -> None:
        # The clip (Op.CLIP): its norm all-reduces carry the phase's label.
        with comm_phase(phase.label):
            call.params_grads = self.inner.apply_grad_clip(call.params_grads)

    def _update(self, phase, call: _Call, last: bool) -> None:
        # A phase: a rank stuck in Newton-Schulz shows it in the profiler and recorder.
        with comm_phase(phase.label):
            if self.separate_clip:
                self.inner.update_params(*self.inner.prepare_optimize(call.params_grads))
            else:  # no staged API (or bypassed): the inner optimizer clips itself
                self.inner._apply_optimize(loss=None, startup_program=None,
                                           params_grads=call.params_grads)

    def _prepare(self, phase, call: _Call, last: bool) -> None:
        call.muon_by_id, call.adamw_by_id = prepare_by_id(self.inner, call.params_grads)

    def _stage_update(self, phase, call: _Call, last: bool) -> None:
        # develop's overlap_optimize_and_sync: update stage k, its sync follows
        spec = self.layout.sync_stages()[phase.items[0][0].stage]
        objects = self.slice_params if spec.kind == "1d" else self.param_by_name
        stage_muon, stage_adamw = take_stage(call.muon_by_id, call.adamw_by_id,
                                             [objects[n] for n in spec.local_params])
        if stage_muon or stage_adamw:
            with comm_phase(phase.label):
                self.inner.update_params(stage_muon, stage_adamw)

    def _broadcast(self, phase, call: _Call, last: bool) -> None:
        pending = self.run_sync_phase(phase, call.cache, call.unpack,
                                      launch=call.launching and last)
        if not call.launching:
            return
        call.pending += pending
        if last:
            unpack, call.unpack = call.unpack, []
            # waited after the stage's collectives: the received values land then
            call.pending.append(PendingCollective([], [], "copy back",
                                                  lambda: unpack_all(unpack)))

    _all_gather = _broadcast

    def _finish_sync(self, phase, call: _Call, last: bool) -> None:
        for task in call.pending:
            task.wait()
        call.pending = []
        unpack_all(call.unpack)
        call.unpack = []
        if call.launching:
            check_no_leftover(call.muon_by_id, call.adamw_by_id)

    # ---------------------------------------------------------------- sync
    def run_sync_phase(self, phase, cache: dict, unpack: list, launch: bool) -> list:
        """Issue one sync phase; with ``launch`` leave it in flight (returned to wait on).

        ``cache``: the broadcast buffers by ref, one per ref across the hops;
        ``unpack``: what to copy back once received."""
        if phase.op == Op.ALL_GATHER:
            buffers = [self.rs_buffers[ref.index] for ref, _ in phase.items]
            if launch:
                return [launch_all_gather(b) for b in buffers]
            all_gather_slices(buffers)
            return []
        routes = [(self.sync_buffer(ref, cache, unpack), root) for ref, root in phase.items]
        with comm_phase(phase.label):
            pending = launch_coalesced(Op.BROADCAST, routes, self.phase_group(phase))
            if not launch:
                pending.wait()
                return []
        return [pending]

    def sync_buffer(self, ref: MuonRef | StageRef, cache: dict, unpack: list):
        """The flat broadcast buffer of a sync item (the owner fills it; others unpack it)."""
        if ref in cache:
            return cache[ref]
        if isinstance(ref, MuonRef):
            bucket = self.muon_buckets[ref.index]
            owner, params = bucket.owner, bucket.params
        else:  # a StageRef: an owner buffer of a sync stage
            owner, _, names, _ = self.layout.sync_stages()[ref.stage].owners[ref.owner]
            params = [self.param_by_name[n] for n in names]
        buffer = paddle.empty([sum(int(p.numel()) for p in params)], dtype=params[0].dtype)
        if owner == self.rank:
            flatten_into(params, buffer)
        else:
            unpack.append((buffer, params))
        cache[ref] = buffer
        return buffer

    # ----------------------------------------- gradients, storage and states
    def assign_slice_grads(self) -> None:
        """Point each slice parameter's gradient at its part of the reduced 1-D buffer."""
        for buffer in self.rs_buffers:
            for p in buffer.params:
                buffer.assign_slice_grad(p, self.slice_params[p.name])

    def ensure_global_clip(self) -> None:
        # A rank holds only its matrices and slices: a plain global-norm clip would use a
        # per-rank norm. HybridParallelOptimizer swaps in its sharding-aware clip; used bare,
        # swap it in here (on the optimizer that applies it, below any MixPrecisionOptimizer).
        base = self.base_opt
        if isinstance(base._grad_clip, paddle.nn.ClipGradByGlobalNorm):
            base._grad_clip = HybridParallelClipGrad(base._grad_clip, self.hcg)

    def clear_grad(self, set_to_zero: bool = True) -> None:
        """Clear every gradient (fused buffers are zeroed; see the optimizer's ``clear_grad``)."""
        for buffer in self.all_buffers():
            if buffer.grad_storage is not None:
                buffer.grad_storage.zero_()
        for bucket in self.muon_buckets:
            if not bucket.buffers:
                for p in bucket.params:
                    _clear_gradient_of(p, set_to_zero)
        release = self.settings.release_grads
        for sp in self.slice_params.values():
            if sp._is_initialized() and sp.grad is not None:
                # a view into its 1-D buffer (nothing to free); re-link to a rebuilt one
                sp.clear_gradient(not release)
        if release:
            # rebuilt from the parameters' own grads at the next reduce_gradients: unlink them
            for buffer in self.rs_buffers:
                if buffer.grad_storage is not None:
                    for p in buffer.params:
                        p.clear_gradient(False)
                    buffer._clear_grad_storage()

    def _storage_of(self, color) -> tuple[list, list]:
        """Colour ``color``'s element-wise buffers, and its matrices other ranks own."""
        return ([b for b in self.rs_buffers if self.rs_colour[id(b)] == color],
                [p for bucket in self.muon_buckets
                 if bucket.colour == color and bucket.owner != self.rank for p in bucket.params])

    def clear_param_storage(self, color) -> None:
        """Free colour ``color``'s element-wise storage (own slices kept aside) and the
        matrices other ranks own, until the next step."""
        if color in self.cleared_colours:
            return
        saved = {}
        buffers, matrices = self._storage_of(color)
        for buffer in buffers:
            for p in buffer.params:
                view = buffer._sharding_param_grad_view[p.name]
                if view._param_begin < view._param_end:
                    saved[p.name] = view._param_buffer._slice(
                        view._param_begin, view._param_end).clone()
                if self.slice_params[p.name]._is_initialized():
                    self.slice_params[p.name]._clear_dataptr()
            buffer._clear_param_storage()
        for p in matrices:
            p._clear_to_zero_allocation()
        self.cleared_colours[color] = saved

    def reset_param_storage(self) -> None:
        """Give every freed colour its storage back (slices restored; the sync refills the rest)."""
        for color, saved in self.cleared_colours.items():
            buffers, matrices = self._storage_of(color)
            for buffer in buffers:
                buffer._reset_param_storage()
                for p in buffer.params:
                    if p.name in saved:
                        view = buffer._sharding_param_grad_view[p.name]
                        paddle.assign(saved[p.name], output=buffer.param_storage._slice(
                            view._param_begin, view._param_end))
            for p in matrices:
                paddle.empty(p.shape, dtype=p.dtype)._share_buffer_to(p)
        self.cleared_colours.clear()

    def _fuse_states(self, phase, call: _Call, last: bool) -> None:
        """Move this rank's optimizer states (and master weights) into one buffer per dtype."""
        base = self.base_opt
        states = [t for per_param in base._accumulators.values() for t in per_param.values()
                  if int(t._numel()) > 1] + list(base._master_weights.values())
        by_dtype: dict[str, list] = OrderedDict()
        for t in states:
            by_dtype.setdefault(str(t.dtype), []).append(t)
        for dtype, tensors in by_dtype.items():
            fused = self.fused_state_buffers.get(dtype)
            if fused is not None and all(t._is_shared_buffer_with(fused) for t in tensors):
                continue
            fused = paddle.empty([sum(int(t._numel()) for t in tensors)], dtype=tensors[0].dtype)
            offset = 0
            for t in tensors:
                numel, shape = int(t._numel()), list(t.shape)
                view = fused._slice(offset, offset + numel)
                paddle.assign(t.reshape([-1]), output=view)
                view._share_buffer_to(t)
                t.get_tensor()._set_dims(shape)
                offset += numel
            self.fused_state_buffers[dtype] = fused


def optimizer_chain(optimizer) -> list:
    """``optimizer`` and every optimizer it wraps (``MixPrecisionOptimizer._inner_opt``)."""
    chain = []
    while optimizer is not None and optimizer not in chain:
        chain.append(optimizer)
        optimizer = optimizer.__dict__.get("_inner_opt")
    return chain


def _backward_hook(buffer, param, label: str):
    """The hook launching ``buffer``'s first hop (labelled ``label``) once its grads are in."""
    @paddle.autograd.no_grad()
    def hook(*_):
        with comm_phase(label):
            buffer.add_grad(param, use_comm=True)

    return hook


def _clear_gradient_of(param, set_to_zero: bool) -> None:
    if not hasattr(param, "main_grad"):
        param.clear_gradient(set_to_zero)
    elif param.main_grad is not None:
        if set_to_zero:
            param.main_grad.zero_()
        else:
            param.main_grad._clear()
            param.main_grad = None
