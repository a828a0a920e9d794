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
"""Sharding optimizer for Muon: whole-matrix owners, element-wise 1-D shards.

Each Muon parameter is owned whole by one rank of its colour's group (reduce to
the owner, Newton-Schulz there, broadcast back); every other parameter is split
element-wise (reduce-scatter, AdamW on the slice, all-gather). ``ShardingLayout``
decides what moves when (data) and its step plan is the program:
``reduce_gradients`` and ``step`` run its phases (``muon_sharding_executor``);
the groups, buffers and slices live in one ``ShardingState``
(``muon_sharding_buffers``). The class body holds construction,
the step loop (``reduce_gradients``, ``step``, ``clear_grad``) and the state
API; the build/runtime/sync/state modules hold the bodies.

Develop's surface -- kept for develop's callers; do not build on it (new code
reads ``sharding_layout``, ``owner_map``, ``comm_plan``, ``partitions``,
``muon_buckets``, ``local_range``, ``fused_states_buffers``). It is defined in
two marked mixins of this module, so the exporter's keep-every-name rule is
met by inheritance (it counts members inherited from a class of the same
module): ``_DevelopStateSurface`` (develop's attribute names as views of the
state: ``comm_buffer_2d``, ``_comm_buffer_list``, ``param2bucket``,
``_local_2d``, ``_color_to_comm_buffer_list`` ...; of the settings: the
config mirrors ``comm_overlap``, ``accumulate_steps``, ``use_group_call_opt``
...; of the hcg: ``_default_group``, ``_sharding_rank`` ...) and
``_DevelopMethodSurface`` (develop's method names bound to the one body each:
``_buffer_color``, ``_reduce_2d_grads``, ``_launch_stage_sync``,
``reorder_params``, ``_step_with_sync_overlap``, ...). Also develop's: the
module names ``g_shard_bypass_dygraph_optimizer``, ``_is_trainable``,
``get_gpus_per_node``, ``get_trainer_ranks``, ``get_same_card_rank``, and the
data attributes the build fills (``_params_2d_by_color``, ``_params_1d``,
``_sync_stages``, ``trainer_comms``, ``timers``, ...).

Constructing the optimizer installs nothing process-wide: on a CPU-only build
Paddle's tensor-fusion table needs a CPU entry first, which the caller (the
test harness; out of tree, ``patch_paddle()``) adds.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections import OrderedDict
from typing import Any, Callable

import paddle
import paddle.distributed as dist
from paddle import framework
from paddle.base.framework import EagerParamBase  # noqa: F401  (develop imports it)
from paddle.distributed import fleet
from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (
    HybridParallelClipGrad,
)
from paddle.distributed.fleet.utils import tensor_fusion_helper, timer_helper
from paddle.distributed.fleet.utils.log_util import logger

from .muon_sharding.fused_buffer import MuonBucket  # noqa: F401  (re-exported)
from .muon_sharding import collectives as comm
from .muon_sharding import build as _build
from .muon_sharding import executor as _executor
from .muon_sharding import runtime as _runtime
from .muon_sharding import optimizer_state as _opt_state
from .muon_sharding import sync as _sync
from .muon_sharding.comm_plan import HierarchicalCommPlan, resolve_gpus_per_node
from .muon_sharding.buffers import ShardingState, create_slice_param
from .muon_sharding.owners import partition_2d_parameters
from .muon_sharding.layout import ShardingLayout
from .muon_sharding.placement import assign_muon_owners
from .muon_sharding.runtime import get_param_grad as _get_param_grad
from .muon_sharding.stages import run_staged_update  # noqa: F401  (develop's module name)
from .muon_sharding.types import (
    DEFAULT_COLOUR,
    DEFAULT_RAW_COLOUR,
    NO_HOOK_COLOURS,
    STAGED_API,
    is_hooked,
    is_trainable as _is_trainable,
    parse_colour,
)

__all__ = ["MuonShardingOptimizer", "assign_muon_owners"]

# Develop's key for the default sharding group (no colour, -1 or None), and
# its raw colour (keys _color_to_comm_buffer_list).
_DEFAULT_COLOUR = DEFAULT_COLOUR
_DEFAULT_RAW_COLOUR = DEFAULT_RAW_COLOUR

# Read once at import, as develop does: the update is skipped, the parameter
# sync still runs (owners broadcast unchanged values).
g_shard_bypass_dygraph_optimizer = int(os.environ.get("FLAGS_shard_bypass_dygraph_optimizer", 0))

# What the overlapped update needs from the inner optimizer (Muon's staged API).
_STAGED_API = STAGED_API


def get_gpus_per_node() -> int:
    """GPUs per node (``PADDLE_LOCAL_SIZE``, else the visible device count), validated."""
    return resolve_gpus_per_node()


def get_trainer_ranks(rank: int, gpus_per_node: int) -> tuple[int, range]:
    """(machine index, global ranks of that machine) of ``rank``, develop's block layout."""
    machine = rank // gpus_per_node
    return machine, range(machine * gpus_per_node, (machine + 1) * gpus_per_node)


def get_same_card_rank(group_ranks, rank: int, gpus_per_node: int) -> int:
    """The first rank of ``rank``'s machine that is in ``group_ranks``; -1 when none is."""
    members = set(group_ranks)
    for r in get_trainer_ranks(rank, gpus_per_node)[1]:
        if r in members:
            return r
    return -1


def _state_attr(name: str) -> property:
    return property(lambda self: getattr(self._state, name),
                    doc=f"develop's name for ``ShardingState.{name}``.")


def _derived_attr(getter: Callable[[Any], Any], develop_name: str, source: str,
                  fix: str = "change the strategy and build a new optimizer") -> property:
    """A read-only develop name over the build's own objects. develop stores a
    copy; here the buffers, hooks and step plan were built from the value, so
    a later write would be silently ignored: it is refused, naming the source."""
    def refuse(self, value):
        raise AttributeError(
            f"{type(self).__name__}.{develop_name} is read-only (got {value!r}): it is "
            f"{source}, fixed when the optimizer was built; {fix}")
    return property(getter, refuse, doc=f"develop's name for {source}.")


def _settings_attr(name: str, develop_name: str | None = None) -> property:
    return _derived_attr(lambda self: getattr(self._settings, name), develop_name or name,
                         f"the strategy's {name} option")


def _hcg_attr(getter: str, develop_name: str) -> property:
    return _derived_attr(lambda self: getattr(self._hcg, getter)(), develop_name,
                         f"hcg.{getter}()")


def _state_method(name: str):
    def method(self, *args, **kwargs):
        return getattr(self._state, name)(*args, **kwargs)

    method.__name__, method.__doc__ = name, getattr(ShardingState, name).__doc__
    return method


class _DevelopStateSurface:
    """develop's attribute surface over the objects the build owns.

    The single place develop's names for groups, buffers and slices (views
    of the one :class:`ShardingState`, ``self._state``), for its config
    mirrors (views of ``self._settings``, a ``ShardingSettings``) and for the
    sharding group's facts (views of ``self._hcg``) are defined: read-only,
    so nothing keeps a second copy; the step's executors read the owners.
    """

    _colour_groups = _state_attr("colour_groups")
    _plan_groups = _state_attr("plan_groups")
    _param_by_name = _state_attr("param_by_name")
    _group_of_ranks = _state_attr("group_of_ranks")
    _muon_buckets = _state_attr("muon_buckets")
    _rs_buffers = _state_attr("rs_buffers")
    _rs_colour = _state_attr("rs_colour")
    _slice_params = _state_attr("slice_params")
    _all_buffers = _state_method("all_buffers")
    _owned_muon_params = _state_method("owned_muon_params")
    _local_slice_params = _state_method("local_slice_params")
    _hooked_buffers = _state_method("hooked_buffers")
    _phase_group = _state_method("phase_group")
    # develop's views of the same buffers, derived (never a second copy)
    _comm_buffer_list = _state_attr("rs_buffers")
    comm_buffer_2d = property(lambda self: self._state.fused_2d_buffers())
    _color_to_comm_buffer_list = property(lambda self: self._state.rs_buffers_by_raw_colour())
    param2bucket = property(lambda self: self._state.buffers_of_params())
    _local_2d = property(lambda self: self._state.owned_muon_params())
    # develop's shared colours (of the parameters) and its sync-only / overlap
    # split, derived next to the step plan's hook rule
    _shared_colors = _derived_attr(
        lambda self: self._compute_shared_colors(self._parameter_list), "_shared_colors",
        "the colours of the parameters it was built with", "build a new optimizer")
    _sync_only_buffers = property(lambda self: self._overlap_split()[0])
    _overlap_comm_buffers = property(lambda self: self._overlap_split()[1])
    _sync_only_buffer_ids = property(lambda self: {id(b) for b in self._sync_only_buffers})
    # develop's config mirrors, derived from the settings; read-only because
    # the buffers and hooks were built from these values, so a write could
    # only make the mirror disagree with what the optimizer does
    tensor_fusion = _settings_attr("tensor_fusion")
    accumulate_steps = _settings_attr("accumulate_steps")
    comm_overlap = _settings_attr("comm_overlap")
    comm_buffer_size_MB = _settings_attr("comm_buffer_size_MB")
    enable_fuse_optimizer_states = _settings_attr("enable_fuse_optimizer_states")
    use_group_call_opt = _settings_attr("comm_group_call_opt", "use_group_call_opt")
    pp_overlap = _settings_attr("pp_sharding_comm_overlap", "pp_overlap")
    sd_release_grads = _settings_attr("release_grads", "sd_release_grads")
    _use_fuse_gradients = _settings_attr("fused", "_use_fuse_gradients")
    machine_balanced_2d_partition = _settings_attr("machine_balanced_2d_partition")
    _enable_timer = _settings_attr("enable_optimizer_timer", "_enable_timer")
    _use_pipeline_parallel = _derived_attr(lambda self: self._settings.pp_degree > 1,
                                           "_use_pipeline_parallel", "the strategy's pp_degree > 1")
    # the sharding group's facts, as the hcg reports them
    _default_group = _hcg_attr("get_sharding_parallel_group", "_default_group")
    _sharding_world_size = _hcg_attr("get_sharding_parallel_world_size",
                                    "_sharding_world_size")
    _sharding_rank = _hcg_attr("get_sharding_parallel_rank", "_sharding_rank")
    # develop's aliases of this optimizer's own names
    _global_rank = property(lambda self: self._rank)
    # the option as honoured: False where the build has no AVG reduce
    use_reduce_avg = _derived_attr(lambda self: self._use_avg, "use_reduce_avg",
                                   "the strategy's use_reduce_avg option as this build honours it")
    _origin_parameter_list = _derived_attr(lambda self: self._parameter_list,
                                           "_origin_parameter_list", "the parameter list it "
                                           "was built with", "build a new optimizer")
    _grad_tensors = staticmethod(ShardingState.grad_tensors)
    _create_slice_param = staticmethod(create_slice_param)

    def _overlap_split(self) -> tuple[list, list]:
        return self._state.develop_overlap_split(self.comm_overlap, self.use_group_call_opt)

    def _build_muon_bucket(self, spec, by_name: dict) -> MuonBucket:
        return self._state._muon_bucket(spec, self._buffer_acc_steps, self._use_avg)

    def _build_reduce_scatter_buffer(self, spec, by_name: dict) -> None:
        self._state.add_slice_buffer(spec, self._buffer_acc_steps, self._use_avg,
                                     self._settings.release_grads)


class _DevelopMethodSurface:
    """develop's method names, each bound to the one body that does the work.

    Kept for develop's callers and tests (and the exporter's keep-every-name
    rule, which counts members inherited from a class of this module); do not
    build on them. A plain function of the build / runtime / sync / state
    modules taking the optimizer first is assigned as the method, so there is
    no second body to keep in step.
    """

    # develop's shared (MTP) colours: complete only after the pipeline's
    # shared-weight sync, so never reduced from a backward hook.
    _NO_HOOK_COLORS = frozenset(NO_HOOK_COLOURS)

    # construction (muon_sharding_build)
    _resolve_overlap_optimize_and_sync = _build.resolve_overlap_optimize_and_sync
    _create_group_call_groups = _build.create_group_call_groups
    _describe_like_develop = _build.describe_like_develop
    _check_plan_matches_sharding_group = _build.check_plan_matches_sharding_group
    _check_supported_config = _build.check_supported_config
    _colour_key = _build.colour_key
    _collect_colour_groups = _build.collect_colour_groups
    _build_layout = _build.build_layout
    _machine_balanced_owners = _build.machine_balanced_owners
    _partition_2d_parameters_machine_balanced = _build.partition_2d_parameters_machine_balanced
    _uses_muon = _build.uses_muon
    _build_color_to_group_info_from_params = staticmethod(_build.colour_to_group_info_from_params)
    _buffer_color = staticmethod(_build.buffer_colour)

    @classmethod
    def _compute_shared_colors(cls, params) -> set:
        """The no-hook colours among the dict colours of ``params``."""
        colours = set()
        for param in params:
            parsed = parse_colour(getattr(param, "color", None))
            if parsed.from_dict:
                colours.add(parsed.declared)
        return colours & cls._NO_HOOK_COLORS

    @classmethod
    def _select_sync_only_buffers(cls, buffers, shared_colors) -> list:
        """The buffers of a shared colour, in order (reduced only by reduce_gradients)."""
        return [b for b in buffers if cls._buffer_color(b) in shared_colors]

    def _build_2d_comm_buffers(self, by_name: dict) -> None:
        self._state.build_muon_buckets(self._buffer_acc_steps, self._use_avg)

    def _build_1d_comm_buffers(self, by_name: dict) -> None:
        self._state.build_slice_buffers(self._buffer_acc_steps, self._use_avg,
                                        self._settings.release_grads)

    def _partition_2d_parameters(self, params: list, world_size: int,
                                 label: str = "") -> dict[int, list]:
        """Develop's owner rule, per dtype: rank -> its whole-matrix parameters.

        Reads only ``comm_buffer_size_MB`` and ``_global_rank`` (develop's tests
        call it on a stub carrying those two).
        """
        mapping = partition_2d_parameters(params, world_size, self.comm_buffer_size_MB)
        if self._global_rank == 0:
            logger.debug(
                f"Muon 2D partition{' ' + label if label else ''}: "
                + ", ".join(f"rank {r}: {len(ps)}" for r, ps in mapping.items())
            )
        return mapping

    # gradients and the step (muon_sharding_executor / _runtime)
    _reduce_2d_grads = framework.no_grad()(_executor.reduce_2d_grads)
    _get_param_grad = staticmethod(_get_param_grad)
    _step_with_sync_overlap = _executor.staged_update

    def _collect_comm_buffers(self) -> list:
        """develop's name: the element-wise buffers (built in ``__init__`` here)."""
        return self._comm_buffer_list

    def _assign_slice_grad(self) -> None:
        for buffer in self._rs_buffers:
            for p in buffer.params:
                buffer.assign_slice_grad(p, self._slice_params[p.name])

    # the parameter sync (muon_sharding_sync)
    _build_sync_stages = _sync.build_stage_dicts
    _launch_stage_sync = _sync.launch_stage_sync
    _broadcast_2d_params = _sync.broadcast_2d_params
    reorder_params = _sync.reorder_params
    _owner_dtype_buffers = _sync.owner_dtype_buffers

    @framework.no_grad()
    def _sharding_sync_parameters(self) -> None:
        """Broadcast updated matrices from their owners; all-gather 1-D shards."""
        with self._timed("sync-parameters"):
            self._sync_parameters()


class MuonShardingOptimizer(_DevelopStateSurface, _DevelopMethodSurface):
    """Shard a :class:`~paddle.optimizer.Muon` optimizer across ranks.

    Built as ``MuonShardingOptimizer(optimizer, hcg)`` (``fleet.distributed_optimizer``
    does it when ``strategy.use_muon_sharding`` is on); options come from fleet's
    strategy; develop's attributes (``_params_2d_by_color``, ``comm_buffer_2d``,
    ``_slice_params``, ...) are filled with colour key None for the default group.

    Gradient contract (as develop): when ``step()`` runs, each parameter's
    gradient (``main_grad`` under MixPrecisionLayer, else ``grad``) is the
    gradient of this rank's own loss; it is averaged over the parameter's
    colour group: the sharding group without a colour, the colour's
    ``group`` (for experts the moe_sharding group) with one. A dispatch over
    the EP group gives an expert's owner the sum over that group, so expert
    gradients must be scaled by ``1/ep`` before ``step()`` (docs/USAGE.md,
    "The gradient contract"; ``examples/train_moe.py``). ``no_sync`` does not
    change the reduction.

    Args:
        optimizer (Muon): the inner optimizer (optionally inside
            ``MixPrecisionOptimizer``); it must expose ``_muon_param_info_map``
            (name -> MuonParamInfo) and ``_apply_optimize``.
        hcg (HybridCommunicateGroup|None): hybrid communicate group; defaults
            to ``fleet.get_hybrid_communicate_group()``.
        strategy (DistributedStrategy|None): defaults to fleet's user-defined
            strategy, the one develop reads (a keyword for tools and tests).
        gpus_per_node (Callable[[], int]|None): how the GPUs per node are
            found, called only with ``comm_group_call_opt`` or
            ``machine_balanced_2d_partition`` on; defaults to
            ``resolve_gpus_per_node`` (``PADDLE_LOCAL_SIZE``, else the device
            count). A keyword for tools and tests.

    Examples:
        .. code-block:: python

            >>> # after fleet.init(is_collective=True, strategy=strategy)
            >>> opt = paddle.optimizer.Muon(learning_rate=0.02, parameters=model.parameters())
            >>> opt = MuonShardingOptimizer(opt)
            >>> loss.backward()
            >>> opt.reduce_gradients(list(model.parameters()), hcg)
            >>> opt.step()
            >>> opt.clear_grad()
    """

    # ------------------------------------------------------------ construction
    def __init__(self, optimizer, hcg=None, strategy=None, *,
                 gpus_per_node: Callable[[], int] | None = None) -> None:
        _build.init_optimizer(self, optimizer, hcg, strategy, gpus_per_node)

    def _buffer_acc_steps(self, colour) -> int:
        # Without hooks the buffers never count check-ins: grads accumulate
        # in place and reduce_gradients runs once per optimizer step.
        hooked = is_hooked(self._settings.comm_overlap, colour)
        return self._settings.accumulate_steps if hooked else 1

    def _register_reduce_overlap_hook(self) -> None:
        for buffer, label in self._hooked_buffers():
            for param in buffer.params:
                param._register_backward_hook(self._create_backward_hook(buffer, param, label))

    @staticmethod
    def _create_backward_hook(buffer, param, phase: str = comm.PHASE_REDUCE_SCATTER):
        # The hook launches the buffer's first hop once its last gradient is
        # in (FusedCommBuffer counts them); the phase names it for profiling.
        @paddle.autograd.no_grad()
        def hook(*_):
            with comm.comm_phase(phase):
                buffer.add_grad(param, use_comm=True)

        return hook

    def _set_inner_parameter_list(self) -> None:
        # The inner optimizer only ever sees what this rank updates: whole
        # matrices it owns and its 1-D slices (filled at the first step).
        self._local_parameter_list_1d = self._local_slice_params()
        self._local_parameter_list = self._owned_muon_params() + self._local_parameter_list_1d
        self._set_inner_opt_attr("_parameter_list", self._local_parameter_list)

    def _optimizer_chain(self) -> list:
        """The inner optimizer and every optimizer it wraps (MixPrecisionOptimizer)."""
        chain, opt = [], self._inner_opt
        while opt is not None and opt not in chain:
            chain.append(opt)
            opt = opt.__dict__.get("_inner_opt")
        return chain

    def _set_inner_opt_attr(self, name: str, value: Any) -> None:
        # A wrapper's __getattr__ reads through, but a plain setattr would
        # stop at the wrapper: set it on every level, as develop does.
        for opt in self._optimizer_chain():
            setattr(opt, name, value)

    # ------------------------------------------------------------ what it built
    # views of the one state (the build sets them there)
    _layout = _state_attr("layout")
    _plan = _state_attr("plan")
    _owner_of = property(lambda self: self._layout.owners)
    _partitions = property(lambda self: self._layout.partitions)

    @property
    def sharding_layout(self) -> ShardingLayout:
        """The placement this optimizer was built from (owners, buckets, ranges, schedule)."""
        return self._layout

    @property
    def clear_color(self) -> set:
        """develop's set of colours :meth:`clear_param_storage` freed (until the next step)."""
        return set(self._state.cleared_colours)

    @property
    def _base_opt(self):
        """The innermost optimizer (the Muon that owns the state)."""
        return self._optimizer_chain()[-1]

    @property
    def owner_map(self) -> dict[str, int]:
        """Parameter name -> owning global rank, for every Muon parameter."""
        return dict(self._owner_of)

    @property
    def comm_plan(self) -> HierarchicalCommPlan | None:
        """The hierarchical routing plan, ``muon_comm_plan`` (None with comm_group_call_opt off)."""
        return self._plan

    @property
    def partitions(self) -> dict[str, Any]:
        """Colour key -> OwnerPartition (per-rank load figures for tools)."""
        return dict(self._partitions)

    @property
    def muon_buckets(self) -> list[MuonBucket]:
        """The (colour, owner, dtype) buckets of Muon parameters."""
        return list(self._muon_buckets)

    def local_range(self, name: str) -> tuple[int, int]:
        """Flattened ``(begin, end)`` of parameter ``name`` this rank updates.

        Args:
            name (str): parameter name.

        Returns:
            tuple[int, int]: padding excluded; the whole parameter when owned,
            ``(0, 0)`` when this rank holds none of it.
        """
        try:
            return self._layout.local_range(name)
        except KeyError:
            raise KeyError(f"{name} is not a trainable parameter of this optimizer") from None

    filter_parameters = _build.filter_parameters

    # ------------------------------------------------------------ the step loop
    @framework.no_grad()
    def reduce_gradients(self, parameter_list, hcg) -> None:
        """Reduce Muon gradients onto their owners and reduce-scatter the rest.

        With ``comm_overlap`` the hooks launched the reduces; this waits and
        reduces the no-hook colours synchronously.

        Args:
            parameter_list (list): the model parameters (Paddle's interface).
            hcg: hybrid communicate group (Paddle's interface).
        """
        with self._timed("reduce-gradients"):
            self._reduce_gradients()

    @framework.no_grad()
    def step(self) -> list:
        """Update owned matrices (Muon) and local slices (AdamW), then sync."""
        return _executor.step(self)

    def minimize(
        self, loss, startup_program=None, parameters=None, no_grad_set=None
    ):
        """Step (``HybridParallelOptimizer.minimize`` reduced the gradients already).

        Returns:
            tuple: ``(None, params_grads)`` as ``Optimizer.minimize`` does.
        """
        params_grads = self.step()
        return None, params_grads

    # The step plan's phases run in muon_sharding_executor; these are the
    # bodies its phases (and the sync module) call back into.
    _timed = _runtime.timed
    _reduce_gradients = _executor.reduce_gradients
    _sync_parameters = _executor.sync_parameters
    _copy_released_grads_in = _runtime.copy_released_grads_in
    _ensure_global_clip = _runtime.ensure_global_clip
    _sync_buffer = _sync.sync_buffer
    _run_sync_phase = _sync.run_sync_phase
    _fuse_optimizer_states = framework.no_grad()(_opt_state.fuse_optimizer_states)

    def _stages_in_use(self) -> bool:
        return bool(self.overlap_optimize_and_sync and not self._bypass_update)

    @property
    def _bypass_update(self) -> bool:
        """develop's ``FLAGS_shard_bypass_dygraph_optimizer``: skip the update, still sync."""
        return bool(g_shard_bypass_dygraph_optimizer)

    def clear_grad(self, set_to_zero: bool = True) -> None:
        """Clear every gradient this optimizer manages."""
        _runtime.clear_grad(self, set_to_zero)

    @framework.no_grad()
    def clear_param_storage(self, color) -> None:
        """Free the parameter storage of colour ``color`` until the next step."""
        _runtime.clear_param_storage(self, color)

    @framework.no_grad()
    def reset_param_storage(self) -> None:
        """Give every colour freed by :meth:`clear_param_storage` its storage back."""
        _runtime.reset_param_storage(self)

    # ------------------------------------------------------------ state
    @property
    def fused_states_buffers(self) -> dict[str, Any]:
        """dtype name -> the buffer holding this rank's optimizer states
        (``enable_fuse_optimizer_states``; empty before the first step)."""
        return dict(self._state.fused_state_buffers)

    def state_dict(self) -> dict:
        """This rank's optimizer state (owned matrices and local slices)."""
        return self._inner_opt.state_dict()

    def set_state_dict(self, state_dict: dict) -> None:
        """Load this rank's part of a full (all ranks merged) state dict.

        Args:
            state_dict (dict): ``<param name>_<state>`` keys,
                ``master_weights`` (param name -> tensor), ``LR_Scheduler``.
        """
        _opt_state.set_state_dict(self, state_dict)

    def sharded_state_dict(self, model_sharded_state_dict: dict) -> dict:
        """This rank's optimizer state for ``paddle.distributed.flex_checkpoint``.

        Keys as develop (``<structured name>.<state>``, master ``.w_0``); shapes
        and offsets come from the model's sharded weight, so a checkpoint loads
        on another layout (owned matrices whole, slices ``is_flattened``).
        Missing states are created, so a fresh optimizer can load.

        Args:
            model_sharded_state_dict (dict): structured key -> ShardedWeight.

        Returns:
            dict: structured key -> ShardedWeight, for the states this rank holds.
        """
        return _opt_state.sharded_state_dict(self, model_sharded_state_dict)

    _param_numel = _opt_state.param_numel
    # Slice parameters get their storage at the first step; accumulators and
    # master weights are created lazily by the inner optimizer.
    _create_local_states = framework.no_grad()(_opt_state.create_local_states)
    _state_owner = _opt_state.state_owner

    def __getattr__(self, item: str) -> Any:
        # Only reached for attributes this wrapper does not define.
        if item == "_inner_opt":
            raise AttributeError(item)
        return getattr(self._inner_opt, item)
