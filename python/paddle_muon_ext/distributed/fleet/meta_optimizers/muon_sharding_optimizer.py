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

Every Muon parameter (2-D, or 3-D ``[experts, H, I]``) is owned whole by one
rank of its colour's group: gradients are reduced onto the owner, the owner
runs Newton-Schulz, and the updated weights are broadcast back. Every other
parameter is split element-wise (reduce-scatter, AdamW on the local slice,
all-gather). With ``comm_group_call_opt`` the dense Muon traffic is routed
hierarchically (inside each node, then across nodes among same-card ranks),
following a :class:`HierarchicalCommPlan` built once at construction.

Structure: *what* is communicated, and when, is data built once by
``ShardingLayout`` (owners, buckets, routes, and the step plan: ordered
phases per trigger); *how* lives in ``muon_sharding_collectives``. The
backward hooks, ``reduce_gradients``, the (overlapped) update and the
parameter sync only walk the plan's phases of their trigger.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
from collections import OrderedDict
from typing import Any, Iterator

import paddle
import paddle.distributed as dist
from paddle import framework
from paddle.base.framework import EagerParamBase
from paddle.distributed import fleet
from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (
    HybridParallelClipGrad,
)
from paddle.distributed.fleet.utils import tensor_fusion_helper, timer_helper
from paddle.distributed.fleet.utils.log_util import logger

from . import muon_fused_buffer as fused
from . import muon_sharding_collectives as comm
from . import muon_sharding_state as _state
from . import muon_sharding_sync as _sync
from .muon_comm_plan import HierarchicalCommPlan, resolve_gpus_per_node
from .muon_sharding_partition import (
    dtype_itemsize,
    machine_balanced_owner_indices,
    partition_2d_parameters,
)
from .muon_sharding_layout import (
    NO_HOOK_COLOURS,
    ROUTE_HIERARCHICAL,
    TRIGGER_BACKWARD,
    TRIGGER_REDUCE,
    LayoutSettings,
    ParamMeta,
    ShardingLayout,
    assign_muon_owners,
)

from .muon_sharding_stages import run_staged_update
from .muon_sharding_settings import (  # noqa: F401  (re-exported: callers import them here)
    PARTITION_STRATEGIES,
    PP_CONFIG_FIELDS,
    SHARDING_CONFIG_FIELDS,
    ShardingAssertionError,
    ShardingSettings,
    ShardingTypeError,
    read_overlap_optimize_and_sync,
)

# paddle_muon_ext: compat-begin
from paddle_muon_ext.compat_paddle_3_3 import register_cpu_tensor_fusion

# paddle_muon_ext: compat-end

__all__ = ["MuonShardingOptimizer", "assign_muon_owners"]

# The package re-exports the reduce *function* under the module's name; the
# module itself holds is_avg_reduce_op_supported.
_reduce_module = importlib.import_module("paddle.distributed.communication.reduce")

# Develop's key for the default sharding group (no colour, -1 or None).
_DEFAULT_COLOUR = None
# develop's raw colour of the default group (keys _color_to_comm_buffer_list)
_DEFAULT_RAW_COLOUR = -1

# Read once at import, as develop does: the update is skipped, the parameter
# sync still runs (owners broadcast unchanged values).
g_shard_bypass_dygraph_optimizer = int(os.environ.get("FLAGS_shard_bypass_dygraph_optimizer", 0))

# What the overlapped update needs from the inner optimizer (Muon's staged API).
_STAGED_API = ("apply_grad_clip", "prepare_optimize", "update_params", "muon_group_key")
# Elements per sync stage when comm_buffer_size_MB <= 0 (develop: 256 MB of fp32).
_DEFAULT_STAGE_MB = 256



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


_WARNED: set = set()


def _warn_once(key: str) -> bool:
    """True the first time ``key`` is seen in this process (one warning per job)."""
    if key in _WARNED:
        return False
    _WARNED.add(key)
    return True


def _user_set_sharding_config(strategy: Any, field: str) -> bool:
    """Whether the user assigned ``sharding_configs.<field>`` (not just its default).

    The fallback from a default the user never chose is not worth a warning on
    every CPU run; a strategy that cannot tell counts as set.
    """
    try:
        return bool(strategy.hybrid_configs["sharding_configs"].HasField(field))
    except (AttributeError, KeyError, TypeError, ValueError):
        return True


def _is_trainable(param) -> bool:
    return not param.stop_gradient


def _get_param_grad(param):
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


def _clear_gradient_of(param, set_to_zero: bool) -> None:
    if not hasattr(param, "main_grad"):
        param.clear_gradient(set_to_zero)
    elif param.main_grad is not None:
        if set_to_zero:
            param.main_grad.zero_()
        else:
            param.main_grad._clear()
            param.main_grad = None


class MuonShardingOptimizer:
    """Shard a :class:`~paddle.optimizer.Muon` optimizer across ranks.

    Develop's surface: built as ``MuonShardingOptimizer(optimizer, hcg)``
    (``fleet.distributed_optimizer`` does it when ``strategy.use_muon_sharding``
    is on), options read from fleet's strategy (``ShardingSettings``), and the
    attributes develop's callers read (``_params_2d_by_color``,
    ``_rank2params_2d_by_color``, ``_param2rank_2d_by_color``, ``_local_2d``,
    ``_color_to_group_info``, ``comm_buffer_2d``, ``_comm_buffer_list``,
    ``_slice_params``, ``param2bucket``, ``_local_parameter_list``; colour key
    None for the default group, ranks counted inside each colour's group).

    Args:
        optimizer (Muon): the inner optimizer (optionally inside
            ``MixPrecisionOptimizer``); it must expose ``_muon_param_info_map``
            (name -> MuonParamInfo) and ``_apply_optimize``.
        hcg (HybridCommunicateGroup|None): hybrid communicate group; defaults
            to ``fleet.get_hybrid_communicate_group()``.
        strategy (DistributedStrategy|None): defaults to fleet's user-defined
            strategy, the one develop reads (a keyword for tools and tests).

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

    # develop's shared (MTP) colours: complete only after the pipeline's
    # shared-weight sync, so never reduced from a backward hook.
    _NO_HOOK_COLORS = frozenset(NO_HOOK_COLOURS)

    def __init__(self, optimizer, hcg=None, strategy=None) -> None:
        self._inner_opt = optimizer
        self._hcg = hcg if hcg is not None else fleet.get_hybrid_communicate_group()
        if strategy is None:
            strategy = getattr(fleet.fleet, "_user_defined_strategy", None)
        self._settings = ShardingSettings.from_strategy(strategy)
        self._rank = dist.get_rank()
        self._check_supported_config(optimizer)
        self._settings.check(self._hcg.get_pipe_parallel_world_size())

        # paddle_muon_ext: compat-begin
        register_cpu_tensor_fusion()
        # paddle_muon_ext: compat-end

        self._parameter_list = list(optimizer._parameter_list)
        self._origin_parameter_list = self._parameter_list
        self._muon_info = optimizer._muon_param_info_map
        self._muon_param_info_map = self._muon_info
        self._default_group = self._hcg.get_sharding_parallel_group()
        self._global_rank = self._rank
        self._sharding_world_size = self._hcg.get_sharding_parallel_world_size()
        self._sharding_rank = self._hcg.get_sharding_parallel_rank()
        self._use_avg = self._settings.use_reduce_avg and (
            _reduce_module.is_avg_reduce_op_supported()
        )
        self._mirror_config()
        if (self._settings.use_reduce_avg and not self._use_avg
                and _user_set_sharding_config(strategy, "use_reduce_avg")
                and _warn_once("reduce_avg")):
            logger.warning(
                "MuonShardingOptimizer: use_reduce_avg=True but this build has no "
                "AVG reduce (it needs CUDA and NCCL >= 2.10); reducing with SUM "
                "with each addend divided by nranks first instead."
            )
        self.timers = None
        self._enable_timer = self._settings.enable_optimizer_timer
        if self._enable_timer:
            if not timer_helper.is_timer_initialized():
                timer_helper.set_timers()
            self.timers = timer_helper.get_timers()

        # 1. data: colours, groups, plan and the layout; nothing allocated yet
        self._colour_groups: dict[str | None, Any] = self._collect_colour_groups()
        muon_by_colour: dict[str | None, list] = OrderedDict()
        other_by_colour: dict[str | None, list] = OrderedDict()
        for param in self._parameter_list:
            if _is_trainable(param):
                target = muon_by_colour if self._uses_muon(param) else other_by_colour
                target.setdefault(self._colour_key(param)[0], []).append(param)
        # Resolved only with the option on: upstream resolved the node size
        # unconditionally and crashed on hosts without a launcher or CUDA.
        self._plan = None
        self._plan_groups = None
        self.trainer_comms: list = []
        self.trainer_same_card_comms: list = []
        if self._settings.comm_group_call_opt:
            self._plan = HierarchicalCommPlan.from_hcg(
                self._hcg, resolve_gpus_per_node()
            )
            self._check_plan_matches_sharding_group()
        self.overlap_optimize_and_sync = self._resolve_overlap_optimize_and_sync(optimizer)
        self._layout = self._build_layout()
        self._owner_of: dict[str, int] = dict(self._layout.owners)
        self._partitions: dict[str | None, Any] = dict(self._layout.partitions)

        # 2. allocation: groups and buffers, exactly as the layout says
        if self._plan is not None:
            self._create_group_call_groups()
            # Once per job is enough to see the layout; other ranks log at debug.
            log = logger.info if self._rank == 0 else logger.debug
            log("MuonShardingOptimizer: comm_group_call_opt on\n%s", self._plan.describe())
        by_name = {p.name: p for p in self._parameter_list if _is_trainable(p)}
        self._param_by_name = by_name
        self._group_of_ranks = {tuple(g.ranks): g for g in self._colour_groups.values()}
        self._build_2d_comm_buffers(by_name)
        self._build_1d_comm_buffers(by_name)
        self._names_longest_first: list[str] | None = None
        self._numel_of: dict[str, int] | None = None

        self._describe_like_develop(muon_by_colour, other_by_colour)
        self._select_overlap_buffers()
        # clear_param_storage(color): colour -> this rank's saved 1-D slices
        self._cleared_colours: dict[str | None, dict[str, Any]] = OrderedDict()
        self._fused_state_buffers: dict[str, Any] = {}
        self._sync_stages: list | None = None

        if self.comm_overlap and not self.pp_overlap:
            self._register_reduce_overlap_hook()
        self._set_inner_parameter_list()
        logger.debug(
            "MuonShardingOptimizer rank %d owns %d of %d Muon params; "
            "%d Muon buckets, %d reduce-scatter buffers",
            self._rank,
            sum(1 for o in self._owner_of.values() if o == self._rank),
            len(self._owner_of),
            len(self._muon_buckets),
            len(self._rs_buffers),
        )

    def _mirror_config(self) -> None:
        """develop's config attributes, so callers read them here, not from Muon."""
        s = self._settings
        self.tensor_fusion = s.tensor_fusion
        self.accumulate_steps = s.accumulate_steps
        self.comm_overlap = s.comm_overlap
        self.comm_buffer_size_MB = s.comm_buffer_size_MB
        self.use_reduce_avg = self._use_avg
        self.enable_fuse_optimizer_states = s.enable_fuse_optimizer_states
        self.use_group_call_opt = s.comm_group_call_opt
        self.pp_overlap = s.pp_sharding_comm_overlap
        self._use_pipeline_parallel = s.pp_degree > 1
        self.sd_release_grads = s.release_grads
        self._use_main_grad = hasattr(self._parameter_list[0], "main_grad")
        self._use_fuse_gradients = s.fused
        self.machine_balanced_2d_partition = s.machine_balanced_2d_partition

    def _resolve_overlap_optimize_and_sync(self, optimizer) -> bool:
        # develop: env flag, on by default; off (with a warning) under
        # comm_group_call_opt or without Muon's staged API. Ours: the
        # overlap_sync_group_call option keeps it on under group call.
        if not read_overlap_optimize_and_sync():
            return False
        missing = [n for n in _STAGED_API if not callable(getattr(optimizer, n, None))]
        if missing:
            logger.warning(
                "MuonShardingOptimizer: overlap_optimize_and_sync disabled: the inner "
                "optimizer %s lacks %s (Muon's staged update API).",
                type(optimizer).__name__, ", ".join(missing))
            return False
        if self.use_group_call_opt and not self._settings.overlap_sync_group_call:
            logger.warning(
                "MuonShardingOptimizer: overlap_optimize_and_sync disabled under "
                "comm_group_call_opt (as in develop); set sharding option "
                "overlap_sync_group_call=True to overlap the hierarchical sync.")
            return False
        return True

    def _create_group_call_groups(self) -> None:
        """Create every node / same-card group (collective, one order on all ranks)."""
        created: list = []

        def new_group(ranks):
            group = dist.new_group(ranks)
            created.append(group)
            return group

        self._plan_groups = self._plan.create_groups(self._rank, new_group)
        # develop's names: trainer_comms[machine], trainer_same_card_comms[stage][card]
        n_nodes = self._plan.num_nodes
        self.trainer_comms = created[:n_nodes]
        gpn = self._plan.gpus_per_node
        same_card = created[n_nodes:]
        self.trainer_same_card_comms = [
            same_card[i:i + gpn] for i in range(0, len(same_card), gpn)
        ]

    def _describe_like_develop(self, muon_by_colour: dict, other_by_colour: dict) -> None:
        """Fill the attributes develop's callers and tests read (data only).

        Rank numbers are positions inside the colour's group, as in develop.
        """
        self._color_to_group_info = self._build_color_to_group_info_from_params(
            self._parameter_list, self._default_group)
        self._params_2d_by_color = OrderedDict()
        self._params_1d = [p for params in other_by_colour.values() for p in params]
        self._rank2params_2d_by_color = OrderedDict()
        self._param2rank_2d_by_color = OrderedDict()
        for colour, params in muon_by_colour.items():
            ranks = list(self._colour_groups[colour].ranks)
            by_rank = OrderedDict((i, []) for i in range(len(ranks)))
            to_rank = OrderedDict()
            for p in params:
                local = ranks.index(self._owner_of[p.name])
                by_rank[local].append(p)
                to_rank[p.name] = local
            self._rank2params_2d_by_color[colour] = by_rank
            self._param2rank_2d_by_color[colour] = to_rank
            # develop keeps each colour's list sorted (stably) by owner
            self._params_2d_by_color[colour] = sorted(params, key=lambda p: to_rank[p.name])
        self._local_2d = self._owned_muon_params()
        self.comm_buffer_2d = [b for bucket in self._muon_buckets for b in bucket.buffers]
        # develop's name for the element-wise (reduce-scatter) buffers
        self._comm_buffer_list = self._rs_buffers
        self._color_to_comm_buffer_list: dict = OrderedDict()
        for buffer in self._rs_buffers:
            colour = self._rs_colour[id(buffer)]
            raw = _DEFAULT_RAW_COLOUR if colour is _DEFAULT_COLOUR else colour
            self._color_to_comm_buffer_list.setdefault(raw, []).append(buffer)
        self.param2bucket: dict[str, list] = OrderedDict()
        for buffer in self.comm_buffer_2d + self._rs_buffers:
            for p in buffer.params:
                self.param2bucket.setdefault(p.name, []).append(buffer)

    @staticmethod
    def _build_color_to_group_info_from_params(params, sharding_group) -> OrderedDict:
        """Colour key -> ``{'group', 'world_size', 'rank'}``: None first, dict colours as seen.

        Args:
            params (list): the parameters (their ``color`` attributes are read).
            sharding_group (Group): the default sharding group (key None, and
                the group of a dict colour that names none).
        """

        def entry(group) -> dict:
            return {"group": group, "world_size": len(group.ranks), "rank": group.rank}

        info = OrderedDict([(_DEFAULT_COLOUR, entry(sharding_group))])
        for param in params:
            color = getattr(param, "color", None)
            if not isinstance(color, dict):
                continue
            key = color.get("color", _DEFAULT_RAW_COLOUR)
            if key is None or key == _DEFAULT_RAW_COLOUR or key in info:
                continue
            info[key] = entry(color.get("group", sharding_group))
        return info

    @staticmethod
    def _buffer_color(buffer):
        """The colour of a buffer, read from its first parameter as develop does.

        A dict colour gives its ``'color'`` value (None when absent, the raw
        value otherwise); any other colour gives None for -1/None, else itself.
        """
        params = buffer.params
        if not params:
            return None
        color = getattr(params[0], "color", None)
        if isinstance(color, dict):
            return color.get("color")
        if color is None or (isinstance(color, int) and color == _DEFAULT_RAW_COLOUR):
            return None
        return color

    @classmethod
    def _compute_shared_colors(cls, params) -> set:
        """The no-hook colours among the dict colours of ``params``."""
        colours = set()
        for param in params:
            color = getattr(param, "color", None)
            if isinstance(color, dict) and "color" in color:
                colours.add(color["color"])
        return colours & cls._NO_HOOK_COLORS

    @classmethod
    def _select_sync_only_buffers(cls, buffers, shared_colors) -> list:
        """The buffers of a shared colour, in order (reduced only by reduce_gradients)."""
        return [b for b in buffers if cls._buffer_color(b) in shared_colors]

    def _select_overlap_buffers(self) -> None:
        """Split buffers into sync-only (shared colours) and hook-launched, as develop."""
        self._shared_colors = self._compute_shared_colors(self._parameter_list)
        fused_2d = self.comm_buffer_2d if self._use_fuse_gradients else []
        self._sync_only_buffers = self._select_sync_only_buffers(
            fused_2d, self._shared_colors
        ) + self._select_sync_only_buffers(self._comm_buffer_list, self._shared_colors)
        self._sync_only_buffer_ids = {id(b) for b in self._sync_only_buffers}
        overlap_2d = []
        if self._use_fuse_gradients and (not self.use_group_call_opt or self.comm_overlap):
            overlap_2d = [b for b in fused_2d if id(b) not in self._sync_only_buffer_ids]
        self._overlap_comm_buffers = overlap_2d + [
            b for b in self._comm_buffer_list if id(b) not in self._sync_only_buffer_ids
        ]

    def _build_2d_comm_buffers(self, by_name: dict) -> None:
        self._muon_buckets: list[MuonBucket] = [
            self._build_muon_bucket(spec, by_name) for spec in self._layout.muon_buckets
        ]

    def _build_1d_comm_buffers(self, by_name: dict) -> None:
        self._rs_buffers: list = []
        self._rs_colour: dict[int, str | None] = {}
        self._slice_params: dict[str, EagerParamBase] = {}
        for spec in self._layout.slice_buffers:
            self._build_reduce_scatter_buffer(spec, by_name)

    def _check_plan_matches_sharding_group(self) -> None:
        stage_ranks = list(self._plan.sharding_group_ranks(self._plan.stage_of(self._rank)))
        group_ranks = list(self._default_group.ranks)
        if sorted(stage_ranks) != sorted(group_ranks):
            raise ValueError(
                f"comm_group_call_opt: the default sharding group of rank "
                f"{self._rank} is {group_ranks}, but the routing plan's stage "
                f"group for it is {stage_ranks}. The hcg and its topology "
                "(hcg._moe_topo) disagree; build both from the same "
                "hybrid_configs, or set comm_group_call_opt=False."
            )

    # ------------------------------------------------------------------
    # construction
    # ------------------------------------------------------------------
    def _check_supported_config(self, optimizer) -> None:
        params = getattr(optimizer, "_parameter_list", None)
        if not params:
            raise ValueError(
                "MuonShardingOptimizer needs an optimizer built with "
                "parameters=model.parameters(); got none."
            )
        if isinstance(params[0], dict):
            raise TypeError(
                "MuonShardingOptimizer does not support parameter groups; pass a "
                "flat list (parameters=model.parameters())."
            )
        if not hasattr(optimizer, "_muon_param_info_map"):
            raise TypeError(
                f"MuonShardingOptimizer wraps a Muon optimizer; got "
                f"{type(optimizer).__name__}, which has no _muon_param_info_map."
            )
        if not callable(getattr(optimizer, "_apply_optimize", None)):
            raise ShardingTypeError(
                f"MuonShardingOptimizer needs an inner optimizer with "
                f"_apply_optimize (paddle.optimizer.Muon, optionally inside "
                f"MixPrecisionOptimizer); {type(optimizer).__name__} has none."
            )
        mp = self._hcg.get_model_parallel_world_size()
        if mp > 1:
            raise ShardingAssertionError(
                f"MuonShardingOptimizer does not support tensor parallel "
                f"(mp_degree={mp}): Newton-Schulz needs whole matrices. Set "
                f"mp_degree=1."
            )

    def _colour_key(self, param) -> tuple[str | None, Any]:
        """(colour key, group) of a parameter; checks it, registers nothing."""
        color = getattr(param, "color", None)
        if color is None or (isinstance(color, int) and color == -1):
            return _DEFAULT_COLOUR, self._default_group
        if not isinstance(color, dict):
            raise ValueError(
                f"parameter {param.name} has color={color!r}; expected None, -1 or "
                "a dict {'color': key, 'group': paddle.distributed.Group}."
            )
        # develop: a dict without 'color' (or with -1/None) is the default
        # colour; a dict without 'group' uses the sharding group
        key = color.get("color", _DEFAULT_RAW_COLOUR)
        if key is None or (isinstance(key, int) and key == _DEFAULT_RAW_COLOUR):
            return _DEFAULT_COLOUR, self._default_group
        group = color.get("group", self._default_group)
        if not hasattr(group, "ranks") or not hasattr(group, "nranks"):
            raise TypeError(
                f"parameter {param.name}: color group {group!r} is not a "
                "paddle.distributed Group (it needs .ranks and .nranks)."
            )
        if self._rank not in group.ranks:
            raise ValueError(
                f"parameter {param.name}: rank {self._rank} is not in its colour "
                f"group {list(group.ranks)}; every rank must hold the parameters "
                "of the colour groups it belongs to."
            )
        return key, group

    def _collect_colour_groups(self) -> dict[str | None, Any]:
        """Colour key -> group, in first-seen order; one group per key."""
        groups: dict[str | None, Any] = OrderedDict()
        for param in self._parameter_list:
            if not _is_trainable(param):
                continue
            key, group = self._colour_key(param)
            known = groups.get(key)
            if known is not None and list(known.ranks) != list(group.ranks):
                raise ValueError(
                    f"colour {key!r} is used with two different groups "
                    f"({list(known.ranks)} and {list(group.ranks)})."
                )
            groups.setdefault(key, group)
        return groups

    def _build_layout(self) -> ShardingLayout:
        """Where every parameter goes: the one placement decision, as data."""
        # Sync stages group matrices by Muon's own key, so the layout asks for it.
        key_of = self._inner_opt.muon_group_key if self._stages_in_use() else None
        metas = []
        for p in self._parameter_list:
            if not _is_trainable(p):
                continue
            whole = self._uses_muon(p)
            metas.append(ParamMeta(p.name, tuple(p.shape), str(p.dtype), self._colour_key(p)[0],
                                   whole, key_of(p) if key_of and whole else None))
        s = self._settings
        settings = LayoutSettings(
            comm_buffer_size_MB=s.comm_buffer_size_MB,
            comm_overlap=s.comm_overlap,
            partition_strategy=s.muon_partition_strategy,
            alignment_bytes=tensor_fusion_helper.alignment[
                tensor_fusion_helper.get_current_device_type()],
            overlap_sync=self._stages_in_use(),
            overlap_sync_group_call=s.overlap_sync_group_call,
        )
        groups = {k: list(g.ranks) for k, g in self._colour_groups.items()}
        return ShardingLayout.build(metas, groups, self._rank, settings, self._plan,
                                    fixed_owners=self._machine_balanced_owners())

    def _machine_balanced_owners(self) -> dict[str, int] | None:
        """Owners from develop's machine-balanced rule (None with the option off).

        Every rank gathers every rank's machine and keep-whole parameters over
        the global group (PP/EP give colours several groups a rank cannot see),
        then applies the rule to the same job-wide input, so owners agree on
        every rank. Collective when on.
        """
        if not self._settings.machine_balanced_2d_partition:
            return None
        mine: dict = OrderedDict()
        for p in self._parameter_list:
            if not (_is_trainable(p) and self._uses_muon(p)):
                continue
            colour, group = self._colour_key(p)
            numel = 1
            for d in p.shape:
                numel *= int(d)
            mine.setdefault((colour, tuple(int(r) for r in group.ranks)), []).append(
                (p.name, numel, str(p.dtype), dtype_itemsize(p.dtype)))
        # develop's node numbering: global rank // GPUs per node
        machine = self._rank // resolve_gpus_per_node()
        gathered: list = []
        if dist.get_world_size() > 1:
            dist.all_gather_object(gathered, (self._rank, machine, mine))
        else:
            gathered.append((self._rank, machine, mine))
        rank_to_machine: dict[int, int] = {}
        info: dict = {}
        for rank, rank_machine, groups in gathered:
            rank_to_machine[int(rank)] = int(rank_machine)
            for key, entries in groups.items():
                seen = info.setdefault(key, entries)
                if seen != entries:
                    raise ValueError(
                        f"machine_balanced_2d_partition: ranks of colour group {key[1]} "
                        f"(colour {key[0]!r}) hold different keep-whole parameters "
                        f"({[e[0] for e in seen]} vs {[e[0] for e in entries]}); every "
                        "member must build the same parameters for its colour groups."
                    )
        placed = self._partition_2d_parameters_machine_balanced(info, rank_to_machine)
        # Only this rank's own groups: parameter names repeat across groups.
        return {name: key[1][index] for key in mine
                for index, names in placed[key].items() for name in names}

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

    def _partition_2d_parameters_machine_balanced(
            self, color_group_info: dict, rank_to_machine: dict) -> dict:
        """Develop's machine-balanced owner rule over every colour group of the job.

        Args:
            color_group_info: ``(colour key, tuple(group global ranks))`` ->
                ``[(name, numel, dtype_str, itemsize), ...]``.
            rank_to_machine: global rank -> machine id.

        Returns:
            dict: the same keys -> ``{group index: [names]}`` (every index present).
        """
        result, machines = machine_balanced_owner_indices(
            color_group_info, rank_to_machine, self.comm_buffer_size_MB)
        if self._global_rank == 0:
            logger.info(
                "Muon machine-balanced 2D partition: "
                + ", ".join(f"machine {m}: {b / 2**20:.1f} MB in {n} matrices"
                            for m, (b, n) in machines.items())
            )
        return result

    @property
    def sharding_layout(self) -> ShardingLayout:
        """The placement this optimizer was built from (owners, buckets, ranges, schedule)."""
        return self._layout

    def _uses_muon(self, param) -> bool:
        info = self._muon_info.get(param.name)
        if info is None:
            raise ShardingAssertionError(
                f"parameter {param.name} (shape {list(param.shape)}) has no entry "
                "in the Muon optimizer's muon_param_info_map; build Muon with "
                "these parameters, or add MuonParamInfo(use_muon=...) for it."
            )
        # develop's keep_whole: hyperball parameters are owned whole too
        return bool(info.use_muon or getattr(info, "use_hyperball", False))

    def _build_muon_bucket(self, spec, by_name: dict) -> MuonBucket:
        group = self._colour_groups[spec.colour]
        params = [by_name[n] for n in spec.params]
        hierarchical = spec.route == ROUTE_HIERARCHICAL
        bucket = MuonBucket(colour=spec.colour, group=group, owner=spec.owner,
                            dtype=params[0].dtype, params=params, hierarchical=hierarchical)
        # A hierarchical buffer's own reduce (launched by the overlap hooks) is
        # its first hop: inside the node, onto the rank with the owner's card.
        if hierarchical:
            buf_group = self._plan_groups.node_group
            buf_dst = self._plan.intra_node_root(spec.owner, self._rank)
        else:
            buf_group, buf_dst = group, spec.owner
        bucket.buffers = [
            tensor_fusion_helper.FusedCommBuffer(
                f"muon_{spec.colour}_{spec.owner}_{spec.dtype}_{i}",
                [by_name[n] for n in chunk],
                buf_group,
                acc_steps=self._buffer_acc_steps(spec.colour),
                act=tensor_fusion_helper.HOOK_ACTION.REDUCE,
                dst=buf_dst,
                release_grads=False,
                **comm.fused_buffer_scaling(self._use_avg),
            )
            for i, chunk in enumerate(spec.chunks)
        ]
        return bucket

    def _buffer_acc_steps(self, colour) -> int:
        # Without hooks the buffers never count check-ins: grads accumulate
        # in place and reduce_gradients runs once per optimizer step.
        hooked = self._settings.comm_overlap and colour not in NO_HOOK_COLOURS
        return self._settings.accumulate_steps if hooked else 1

    def _build_reduce_scatter_buffer(self, spec, by_name: dict) -> None:
        chunk = [by_name[n] for n in spec.params]
        buffer = tensor_fusion_helper.FusedCommBuffer(
            f"slice_{spec.colour}_{spec.dtype}_{len(self._rs_buffers)}",
            chunk,
            self._colour_groups[spec.colour],
            acc_steps=self._buffer_acc_steps(spec.colour),
            act=tensor_fusion_helper.HOOK_ACTION.REDUCE_SCATTER,
            release_grads=self._settings.release_grads,
            **comm.fused_buffer_scaling(self._use_avg),
        )
        # FusedCommBuffer leaves a weakref for Paddle's own sharding
        # optimizer to collect; this optimizer keeps its buffers.
        if hasattr(chunk[0], "comm_buffer_ref"):
            del chunk[0].comm_buffer_ref
        self._rs_buffers.append(buffer)
        self._rs_colour[id(buffer)] = spec.colour
        for p in chunk:
            self._slice_params[p.name] = self._create_slice_param(p)

    @staticmethod
    def _create_slice_param(param) -> EagerParamBase:
        # Carries the parameter's name so optimizer state, the Muon info map and
        # checkpoints key the slice exactly like the whole parameter.
        slice_param = EagerParamBase(shape=[1], dtype=param.dtype)
        slice_param.name = param.name
        for attr in ("is_distributed", "optimize_attr", "need_clip", "no_sync"):
            if hasattr(param, attr):
                setattr(slice_param, attr, getattr(param, attr))
        return slice_param

    def _hooked_buffers(self) -> list:
        """(buffer, phase label) of the plan's backward phases.

        The same buffers as develop's ``_overlap_comm_buffers``, less those of
        one-rank groups (nothing to send).
        """
        out = []
        for phase in self._layout.phases_of(TRIGGER_BACKWARD):
            if len(phase.group) <= 1:
                continue  # a one-rank group holds its result already
            for ref, _ in phase.items:
                buffers = ([self._rs_buffers[ref[1]]] if ref[0] == "slice"
                           else self._muon_buckets[ref[1]].buffers)
                out.extend((b, phase.label) for b in buffers)
        return out

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

    def _all_buffers(self) -> list:
        return [b for bucket in self._muon_buckets for b in bucket.buffers] + list(
            self._rs_buffers
        )

    def _owned_muon_params(self) -> list:
        return [
            p
            for bucket in self._muon_buckets
            if bucket.owner == self._rank
            for p in bucket.params
        ]

    def _local_slice_params(self) -> list:
        result = []
        for buffer in self._rs_buffers:
            for p in buffer.params:
                if fused.has_local_slice(buffer, p.name):
                    result.append(self._slice_params[p.name])
        return result

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

    @property
    def clear_color(self) -> set:
        """develop's set of colours :meth:`clear_param_storage` freed (until the next step)."""
        return set(self._cleared_colours)

    @property
    def _base_opt(self):
        """The innermost optimizer (the Muon that owns the state)."""
        return self._optimizer_chain()[-1]

    # ------------------------------------------------------------------
    # public surface
    # ------------------------------------------------------------------
    @property
    def owner_map(self) -> dict[str, int]:
        """Parameter name -> owning global rank, for every Muon parameter."""
        return dict(self._owner_of)

    @property
    def comm_plan(self) -> HierarchicalCommPlan | None:
        """The hierarchical routing plan (None with comm_group_call_opt off)."""
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
        """Flattened element range of parameter ``name`` that this rank updates.

        Args:
            name (str): parameter name.

        Returns:
            tuple[int, int]: ``(begin, end)`` within the flattened parameter,
            alignment padding excluded; the whole parameter for owned Muon
            matrices, ``(0, 0)`` when this rank holds none of it.
        """
        try:
            return self._layout.local_range(name)
        except KeyError:
            raise KeyError(f"{name} is not a trainable parameter of this optimizer") from None

    def filter_parameters(self, parameter_list, hcg) -> list:
        """Return the parameters whose gradients this rank holds after reduction.

        A global-norm clip sums these locally, then across the sharding group,
        so every parameter is counted exactly once.

        Args:
            parameter_list (list): the model parameters.
            hcg: hybrid communicate group (unused; kept for Paddle's interface).

        Returns:
            list: owned Muon parameters and this rank's initialized 1-D slices.
        """
        result = []
        for p in parameter_list:
            if self._owner_of.get(p.name) == self._rank:
                result.append(p)
            elif p.name in self._slice_params:
                sp = self._slice_params[p.name]
                if sp._is_initialized():
                    result.append(sp)
        return result

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        # develop's timer names, so timers.log() reads the same
        if self.timers is None:
            yield
            return
        self.timers(name).start()
        try:
            yield
        finally:
            self.timers(name).stop()

    @framework.no_grad()
    def reduce_gradients(self, parameter_list, hcg) -> None:
        """Reduce Muon gradients onto their owners and reduce-scatter the rest.

        With ``comm_overlap`` the backward hooks have launched the reduces;
        this waits for them and reduces the no-hook colours
        (``dense_weight_no_hook`` / ``moe_weight_no_hook``) synchronously.

        Args:
            parameter_list (list): the model parameters (Paddle's interface).
            hcg: hybrid communicate group (Paddle's interface).
        """
        with self._timed("reduce-gradients"):
            self._reduce_gradients()

    def _reduce_gradients(self) -> None:
        # The plan's reduce_gradients phases; hooked buffers (the backward
        # phases) were launched during backward and are waited for first.
        op = dist.ReduceOp.AVG if self._use_avg else dist.ReduceOp.SUM
        self._copy_released_grads_in()
        hooked_slices = set()
        for phase in self._layout.phases_of(TRIGGER_BACKWARD):
            for ref, _ in phase.items:
                if ref[0] == "slice":
                    hooked_slices.add(ref[1])
                else:
                    for buffer in self._muon_buckets[ref[1]].buffers:
                        buffer.scale_grads()
        for phase in self._layout.phases_of(TRIGGER_REDUCE):
            if phase.op == "reduce_scatter":
                slices = [ref[1] for ref, _ in phase.items]
                launched = {id(self._rs_buffers[i]) for i in slices if i in hooked_slices}
                comm.reduce_scatter_slices([self._rs_buffers[i] for i in slices],
                                           lambda b: id(b) in launched)
        self._reduce_2d_grads(op)

    @framework.no_grad()
    def _reduce_2d_grads(self, op=None) -> None:
        """Reduce the Muon gradients onto their owners: the plan's 2-D reduce phases.

        Args:
            op (ReduceOp|None): AVG, or SUM where the build has no AVG (default:
                what this optimizer chose at construction).
        """
        if op is None:
            op = dist.ReduceOp.AVG if self._use_avg else dist.ReduceOp.SUM
        for phase in self._layout.phases_of(TRIGGER_REDUCE):
            if phase.op != "reduce":
                continue
            routes = [(tensor, root) for ref, root in phase.items
                      for tensor in self._grad_tensors(self._muon_buckets[ref[1]])]
            with comm.comm_phase(phase.label):
                comm.mean_onto(routes, self._phase_group(phase), op)

    _get_param_grad = staticmethod(_get_param_grad)

    def _collect_comm_buffers(self) -> list:
        """develop's name: the element-wise buffers (built in ``__init__`` here)."""
        return self._comm_buffer_list

    def _copy_released_grads_in(self) -> None:
        if not self._settings.release_grads:
            return
        for buffer in self._rs_buffers:
            if buffer.grad_storage is None and buffer.need_reduce_scale_sync():
                fused.copy_grads_in(buffer)

    @staticmethod
    def _grad_tensors(bucket: MuonBucket) -> list:
        if bucket.buffers:
            return [b.grad_storage for b in bucket.buffers]
        return [_get_param_grad(p) for p in bucket.params]

    @framework.no_grad()
    def step(self) -> list:
        """Update owned matrices (Muon) and local slices (AdamW), then sync.

        Colours freed by :meth:`clear_param_storage` get their storage back
        first, as in develop.

        Returns:
            list: the (param, grad) pairs this rank updated.
        """
        storage_was_cleared = bool(self._cleared_colours)
        self.reset_param_storage()
        self._assign_slice_grad()
        params_grads = []
        for p in self._local_parameter_list:
            grad = getattr(p, "main_grad", None)
            if grad is None:
                grad = p._grad_ivar()
            if grad is not None:
                params_grads.append((p, grad))
        self._ensure_global_clip()
        # AMP: HybridParallelGradScaler reaches minimize even after an
        # overflow; found_inf is identical on all ranks (all-reduced MAX).
        found_inf = self._inner_opt._get_auxiliary_var("found_inf")
        if found_inf is not None and bool(found_inf):
            logger.warning("MuonShardingOptimizer: found inf/nan, step skipped")
            if storage_was_cleared:
                self._sharding_sync_parameters()  # refill the freed colours
            return params_grads
        staged = self._stages_in_use()
        if staged:
            # develop's overlap_optimize_and_sync: the sync travels with the update
            if self._sync_stages is None:
                self._sync_stages = self._build_sync_stages()
            with self._timed("apply-optimize"):
                self._step_with_sync_overlap(params_grads)
        else:
            # A phase too: a rank stuck in the clip's all-reduce or in
            # Newton-Schulz shows it in the profiler and the flight recorder.
            with self._timed("apply-optimize"), comm.comm_phase("optimizer_step"):
                self._inner_opt._apply_optimize(
                    loss=None, startup_program=None, params_grads=params_grads
                )
        if self._settings.enable_fuse_optimizer_states:
            self._fuse_optimizer_states()
        if not staged:
            self._sharding_sync_parameters()
        return params_grads

    # ------------------------------------------------------------------
    # overlapped update: stage k's sync travels while stage k+1 computes
    # ------------------------------------------------------------------
    def _stages_in_use(self) -> bool:
        return bool(self.overlap_optimize_and_sync and not g_shard_bypass_dygraph_optimizer)

    def _build_sync_stages(self) -> list:
        """develop's ``_sync_stages``, from the layout's stages (identical on every rank).

        Returns:
            list[dict]: ``{'kind': '2d', 'color', 'group', 'world_size',
            'rank2params', 'keys', 'local_params'}`` then ``{'kind': '1d',
            'buffer', 'local_params'}``; each also carries its ``'spec'``.
        """
        return _sync.build_stage_dicts(self)

    def _launch_stage_sync(self, stage: dict) -> list:
        """Launch one stage's parameter sync; returns what to wait on.

        A stage of :meth:`_build_sync_stages` walks its plan phases: every
        phase but the last completes (the hierarchical route's cross-node hop
        feeds the intra-node one), the last stays in flight. A stage dict
        built by hand (develop's form, no ``'phases'``) is synced as develop does.
        """
        return _sync.launch_stage_sync(self, stage)

    def _step_with_sync_overlap(self, params_grads: list) -> None:
        """Clip and prepare once; per stage update, then launch its sync; wait all."""

        def label(index, stage):
            return comm.comm_phase(f"optimizer_step[{index}]")

        def wait_all(pending):
            # what the sync still costs once the updates are done
            with self._timed("sync-parameters"):
                for task in pending:
                    task.wait()

        with comm.comm_phase("optimizer_step"):
            run_staged_update(self._inner_opt, params_grads, self._sync_stages,
                              self._launch_stage_sync, label, wait_all)

    def _broadcast_2d_params(self, rank2params: dict, group) -> list:
        """Launch each owner's broadcast, one flat buffer per (owner, dtype) (#79687).

        Args:
            rank2params (dict): group rank -> the matrices it owns.
            group (Group): the colour group.

        Returns:
            list: pending broadcasts; waiting on one also copies the received
            values into the non-owners' parameters.
        """
        return _sync.broadcast_2d_params(self, rank2params, group)

    def reorder_params(self, comm_list) -> list:
        """develop's group-call packing: per (rank2params, group) and owner and dtype.

        Args:
            comm_list: ``[(rank2params, group)]``.

        Returns:
            list[dict]: ``{'param_buffer', 'src_rank', 'params'}``; an owner's
            only parameter of a dtype is sent as is, others in one flat buffer.
        """
        return _sync.reorder_params(self, comm_list)

    def _owner_dtype_buffers(self, rank2params: dict, group, single_as_is: bool):
        """Yield (owner global rank, {'param_buffer', 'params'}) per owner and dtype.

        The owner's buffer holds its parameters back to back; elsewhere it is
        empty until the broadcast lands.
        """
        yield from _sync.owner_dtype_buffers(self, rank2params, group, single_as_is)

    def _ensure_global_clip(self) -> None:
        # Each rank holds only its owned matrices and slices: a plain global
        # norm clip would clip by a per-rank norm. HybridParallelOptimizer
        # swaps in its sharding-aware clip; used bare, swap it in here (on
        # the optimizer that applies it, below any MixPrecisionOptimizer).
        base = self._base_opt
        clip = base._grad_clip
        if isinstance(clip, paddle.nn.ClipGradByGlobalNorm):
            base._grad_clip = HybridParallelClipGrad(clip, self._hcg)

    def _assign_slice_grad(self) -> None:
        for buffer in self._rs_buffers:
            for p in buffer.params:
                buffer.assign_slice_grad(p, self._slice_params[p.name])

    def minimize(
        self, loss, startup_program=None, parameters=None, no_grad_set=None
    ):
        """Step after :meth:`reduce_gradients`, like Paddle's sharding optimizers.

        ``HybridParallelOptimizer.minimize`` reduces gradients first, then
        calls this.

        Returns:
            tuple: ``(None, params_grads)`` as ``Optimizer.minimize`` does.
        """
        params_grads = self.step()
        return None, params_grads

    @framework.no_grad()
    def _sharding_sync_parameters(self) -> None:
        """Broadcast updated matrices from their owners; all-gather 1-D shards."""
        with self._timed("sync-parameters"):
            self._sync_parameters()

    def _sync_parameters(self) -> None:
        # The plan's sync phases: the step's, or every stage's one after another.
        _sync.sync_parameters(self)

    def _phase_group(self, phase):
        """The process group a plan phase runs on."""
        return _sync.phase_group(self, phase)

    def _sync_buffer(self, ref: tuple, cache: dict, unpack: list):
        """The flat broadcast buffer of a plan item; the owner fills it, others unpack it."""
        return _sync.sync_buffer(self, ref, cache, unpack)

    def _run_sync_phase(self, phase, cache: dict, unpack: list, launch: bool) -> list:
        """Issue one sync phase of the plan; with ``launch`` leave it in flight."""
        return _sync.run_sync_phase(self, phase, cache, unpack, launch)

    def clear_grad(self, set_to_zero: bool = True) -> None:
        """Clear every gradient this optimizer manages.

        Args:
            set_to_zero (bool): True zeroes gradients in place. False frees
                what is not linked to a fused buffer (per-parameter Muon
                gradients, ``main_grad`` of unfused parameters); fused buffers
                stay allocated and are zeroed, since the parameters' gradients
                are views into them, unless ``release_gradients`` releases the
                1-D buffers.
        """
        for buffer in self._all_buffers():
            if buffer.grad_storage is not None:
                buffer.grad_storage.zero_()
        for bucket in self._muon_buckets:
            if not bucket.buffers:
                for p in bucket.params:
                    _clear_gradient_of(p, set_to_zero)
        release = self._settings.release_grads
        for sp in self._slice_params.values():
            if sp._is_initialized() and sp.grad is not None:
                # A slice's gradient is a view into its 1-D buffer (nothing to
                # free); a released buffer is rebuilt, so the slice must re-link.
                sp.clear_gradient(not release)
        if release:
            # Released buffers are rebuilt from the parameters' own grads at
            # the next reduce_gradients, so unlink those grads first.
            for buffer in self._rs_buffers:
                if buffer.grad_storage is not None:
                    for p in buffer.params:
                        p.clear_gradient(False)
                    fused.release_grad_storage(buffer)

    # ------------------------------------------------------------------
    # parameter storage (FP8 paths free a colour between steps)
    # ------------------------------------------------------------------
    @framework.no_grad()
    def clear_param_storage(self, color) -> None:
        """Free the parameter storage of colour ``color`` until the next step.

        Freed: every element-wise parameter of the colour (this rank's slice
        is kept aside) and every Muon matrix of the colour this rank does not
        own (the owner's broadcast refills it). Owned matrices are kept: the
        owner updates them whole. :meth:`step` restores the storage first,
        then the update and the parameter sync make every value exact again.

        Args:
            color: the colour key (None for the default sharding group).
        """
        if color in self._cleared_colours:
            return
        saved = {}
        for buffer in self._rs_buffers:
            if self._rs_colour[id(buffer)] != color:
                continue
            for p in buffer.params:
                kept = fused.save_local_slice(buffer, p.name)
                if kept is not None:
                    saved[p.name] = kept
                slice_param = self._slice_params[p.name]
                if slice_param._is_initialized():
                    slice_param._clear_dataptr()
            fused.release_param_storage(buffer)
        for bucket in self._muon_buckets:
            if bucket.colour == color and bucket.owner != self._rank:
                for p in bucket.params:
                    p._clear_to_zero_allocation()
        self._cleared_colours[color] = saved

    @framework.no_grad()
    def reset_param_storage(self) -> None:
        """Give every colour freed by :meth:`clear_param_storage` its storage back.

        Element-wise parameters get this rank's slice back; other values are
        refilled by the next parameter sync.
        """
        for color, saved in self._cleared_colours.items():
            for buffer in self._rs_buffers:
                if self._rs_colour[id(buffer)] != color:
                    continue
                fused.restore_param_storage(buffer)
                for p in buffer.params:
                    if p.name in saved:
                        fused.restore_local_slice(buffer, p.name, saved[p.name])
            for bucket in self._muon_buckets:
                if bucket.colour == color and bucket.owner != self._rank:
                    for p in bucket.params:
                        paddle.empty(p.shape, dtype=p.dtype)._share_buffer_to(p)
        self._cleared_colours.clear()

    # ------------------------------------------------------------------
    # optimizer state
    # ------------------------------------------------------------------
    @framework.no_grad()
    def _fuse_optimizer_states(self) -> None:
        """Keep the optimizer states of this rank in one buffer per dtype.

        Runs after each update: states created by that update (the first
        step, a resumed checkpoint) are moved into a fresh buffer; when every
        state already lives in one, nothing happens.
        """
        _state.fuse_optimizer_states(self)

    @property
    def fused_states_buffers(self) -> dict[str, Any]:
        """dtype name -> the buffer holding this rank's optimizer states
        (``enable_fuse_optimizer_states``; empty before the first step)."""
        return dict(self._fused_state_buffers)

    def state_dict(self) -> dict:
        """This rank's optimizer state (owned matrices and local slices)."""
        return self._inner_opt.state_dict()

    def set_state_dict(self, state_dict: dict) -> None:
        """Load this rank's part of a state dict.

        Accepts a full state dict (every rank's keys merged, as develop's
        callers pass it): keeps the states and master weights of what this
        rank updates (owned matrices, its slices) and names each master
        weight as this optimizer would have.

        Args:
            state_dict (dict): ``<param name>_<state>`` keys,
                ``master_weights`` (param name -> tensor), ``LR_Scheduler``.
        """
        _state.set_state_dict(self, state_dict)

    def sharded_state_dict(self, model_sharded_state_dict: dict) -> dict:
        """Describe this rank's optimizer state for ``paddle.distributed.flex_checkpoint``.

        Keys follow Paddle develop: ``<structured name>.<state>`` (e.g.
        ``mlp.weight.moment1_0``), master weights ``<structured name>.w_0``.
        Shapes and offsets come from the model's sharded weight, so a
        checkpoint saved on one layout loads on another: owned matrices are
        whole local tensors (reshaped to the sharded weight's local shape when
        only the shape differs, e.g. 3-D expert weights stored 2-D), element-wise
        slices are flattened ranges of it (``is_flattened=True``); only the
        beta-pow accumulators are scalars of shape ``(1,)``. States not created
        yet (before the first step) are created here, so that a fresh optimizer
        can be the target of ``load_state_dict``.

        Args:
            model_sharded_state_dict (dict): the model's sharded state dict
                (structured key -> ShardedWeight), e.g. ``model.sharded_state_dict()``.

        Returns:
            dict: structured key -> ShardedWeight, for the states this rank holds.
        """
        return _state.sharded_state_dict(self, model_sharded_state_dict)

    def _param_numel(self, name: str) -> int:
        return _state.param_numel(self, name)

    @framework.no_grad()
    def _create_local_states(self) -> None:
        # Slice parameters get their storage at the first step; accumulators
        # and master weights are created lazily by the inner optimizer.
        _state.create_local_states(self)

    def _state_owner(self, state_key: str) -> tuple[str, str] | None:
        """Split a state key into (parameter name, develop's state name).

        ``mlp.weight_scale_moment1_0`` -> ``("mlp.weight_scale", "moment1_0")``
        even when ``mlp.weight`` is also a parameter: names are tried longest
        first. States kept on a master weight (``<name>_fp32_master_0_moment1_0``)
        belong to ``<name>``.

        Returns:
            tuple|None: None when no trainable parameter's name prefixes the key.
        """
        return _state.state_owner(self, state_key)

    def __getattr__(self, item: str) -> Any:
        # Only reached for attributes this wrapper does not define.
        if item == "_inner_opt":
            raise AttributeError(item)
        return getattr(self._inner_opt, item)
