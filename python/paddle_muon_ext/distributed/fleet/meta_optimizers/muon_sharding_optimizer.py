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

Structure: *what* is communicated is data built in ``__init__`` (owner map,
buckets, routing plan); *how* lives in ``muon_sharding_collectives``;
``reduce_gradients`` / ``step`` / ``_sharding_sync_parameters`` only walk the
buckets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import re
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

from . import muon_sharding_collectives as comm
from .muon_comm_plan import HierarchicalCommPlan, resolve_gpus_per_node
from .muon_sharding_layout import (
    NO_HOOK_COLOURS,
    ROUTE_HIERARCHICAL,
    LayoutSettings,
    ParamMeta,
    ShardingLayout,
    assign_muon_owners,
    flat_broadcast_phase,
    flat_reduce_phase,
)

# paddle_muon_ext: compat-begin
from paddle_muon_ext.compat_paddle_3_3 import (
    get_muon_sharding_options,
    register_cpu_tensor_fusion,
)

# paddle_muon_ext: compat-end

__all__ = ["MuonShardingOptimizer", "assign_muon_owners"]

# The package re-exports the reduce *function* under the module's name; the
# module itself holds is_avg_reduce_op_supported.
_reduce_module = importlib.import_module("paddle.distributed.communication.reduce")

# Develop's key for the default sharding group (no colour, -1 or None).
_DEFAULT_COLOUR = None

PARTITION_STRATEGIES = ("upstream_greedy", "balanced")

# The sharding_configs / pp_configs fields this optimizer reads, as develop's
# MuonShardingOptimizer does (muon_partition_strategy is ours).
SHARDING_CONFIG_FIELDS = (
    "tensor_fusion",
    "accumulate_steps",
    "comm_overlap",
    "comm_buffer_size_MB",
    "use_reduce_avg",
    "enable_fuse_optimizer_states",
    "release_gradients",
    "comm_group_call_opt",
    "muon_partition_strategy",
)
PP_CONFIG_FIELDS = ("sharding_comm_overlap", "release_gradients")

# Checkpoint naming shared with Paddle develop's optimizers.
_SCALAR_STATES = frozenset({"beta1_pow_acc_0", "beta2_pow_acc_0"})
_MASTER_WEIGHT_STATE = "w_0"
_MASTER_PREFIX = re.compile(r"^fp32_master_\d+_")


@dataclasses.dataclass
class ShardingSettings:
    """The sharding options the optimizer reads, resolved once.

    Attributes mirror ``strategy.hybrid_configs['sharding_configs']`` fields
    of the same name; ``pp_sharding_comm_overlap`` / ``pp_release_gradients``
    are ``pp_configs.sharding_comm_overlap`` / ``pp_configs.release_gradients``;
    ``enable_optimizer_timer`` and ``pp_degree`` come from ``hybrid_configs``.
    ``muon_partition_strategy``: ``"upstream_greedy"`` (develop's owner rule,
    the default) or ``"balanced"``.
    """

    accumulate_steps: int = 1
    comm_overlap: bool = False
    comm_buffer_size_MB: float = 256
    use_reduce_avg: bool = True
    release_gradients: bool = False
    tensor_fusion: bool = False
    enable_fuse_optimizer_states: bool = False
    comm_group_call_opt: bool = False
    muon_partition_strategy: str = "upstream_greedy"
    pp_sharding_comm_overlap: bool = False
    pp_release_gradients: bool = False
    enable_optimizer_timer: bool = False
    pp_degree: int = 1

    @property
    def release_grads(self) -> bool:
        """Either place develop reads ``release_gradients`` from turns it on."""
        return bool(self.release_gradients or self.pp_release_gradients)

    @property
    def fused(self) -> bool:
        """Gradients go through fused buffers (``comm_buffer_size_MB > 0``)."""
        return self.comm_buffer_size_MB > 0

    @classmethod
    def from_strategy(cls, strategy: Any) -> ShardingSettings:
        """Read settings from a ``fleet.DistributedStrategy`` (None: defaults)."""
        settings = cls()
        if strategy is None:
            return settings
        hybrid = strategy.hybrid_configs
        configs = hybrid["sharding_configs"]
        for field in SHARDING_CONFIG_FIELDS:
            # comm_group_call_opt / muon_partition_strategy are proto fields
            # upstream; absent on 3.3.1 unless patch_paddle() added them.
            if hasattr(configs, field):
                setattr(settings, field, getattr(configs, field))
        pp_configs = hybrid["pp_configs"]
        for field in PP_CONFIG_FIELDS:
            if hasattr(pp_configs, field):
                setattr(settings, f"pp_{field}", getattr(pp_configs, field))
        settings.enable_optimizer_timer = bool(hybrid["enable_optimizer_timer"])
        settings.pp_degree = int(hybrid["pp_degree"])
        # paddle_muon_ext: compat-begin
        options = get_muon_sharding_options(strategy)
        settings.comm_group_call_opt = options.comm_group_call_opt
        settings.muon_partition_strategy = options.muon_partition_strategy
        # paddle_muon_ext: compat-end
        return settings

    def check(self, pp_world_size: int) -> None:
        """Refuse, naming the option and the fix, what this optimizer cannot honour.

        Args:
            pp_world_size (int): the pipeline degree of the job.
        """
        if self.muon_partition_strategy not in PARTITION_STRATEGIES:
            raise ValueError(
                f"sharding_configs.muon_partition_strategy="
                f"{self.muon_partition_strategy!r} is not supported; use one of "
                f"{PARTITION_STRATEGIES}."
            )
        if self.pp_sharding_comm_overlap:
            raise ValueError(
                "pp_configs.sharding_comm_overlap=True is not supported by "
                "MuonShardingOptimizer: Muon gradients are reduced onto whole-"
                "matrix owners, not by the pipeline's sharding overlap. Set it "
                "False (with pp_degree=1, sharding_configs.comm_overlap overlaps "
                "the reduces with backward)."
            )
        if self.comm_overlap and pp_world_size > 1:
            raise ValueError(
                "sharding_configs.comm_overlap=True cannot be combined with "
                f"pipeline parallel (pp_degree={pp_world_size}); set "
                "comm_overlap=False."
            )
        if self.comm_overlap and not self.fused:
            raise ValueError(
                "sharding_configs.comm_overlap=True needs fused gradient buffers; "
                f"comm_buffer_size_MB={self.comm_buffer_size_MB} turns them off. "
                "Set comm_buffer_size_MB > 0 or comm_overlap=False."
            )
        if self.comm_overlap and self.accumulate_steps <= 0:
            raise ValueError(
                "sharding_configs.comm_overlap=True needs accumulate_steps >= 1 "
                f"(got {self.accumulate_steps}): the hooks count micro-batches."
            )
        if self.tensor_fusion and not self.fused:
            raise ValueError(
                "sharding_configs.tensor_fusion=True fuses gradients into "
                f"buffers of comm_buffer_size_MB, but comm_buffer_size_MB="
                f"{self.comm_buffer_size_MB}. Set comm_buffer_size_MB > 0 or "
                "tensor_fusion=False."
            )
        if self.enable_optimizer_timer and not paddle.is_compiled_with_cuda():
            raise ValueError(
                "hybrid_configs.enable_optimizer_timer=True needs a CUDA build: "
                "Paddle's optimizer timers synchronize the CUDA device. Set it "
                "False (or profile with paddle.profiler)."
            )


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
    phase: str = ""


_WARNED: set = set()


def _warn_once(key: str) -> bool:
    """True the first time ``key`` is seen in this process (one warning per job)."""
    if key in _WARNED:
        return False
    _WARNED.add(key)
    return True


def _is_trainable(param) -> bool:
    return not param.stop_gradient


def _gradient_of(param):
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
        self._muon_info = optimizer._muon_param_info_map
        self._default_group = self._hcg.get_sharding_parallel_group()
        self._use_avg = self._settings.use_reduce_avg and (
            _reduce_module.is_avg_reduce_op_supported()
        )
        if self._settings.use_reduce_avg and not self._use_avg and _warn_once("reduce_avg"):
            logger.warning(
                "MuonShardingOptimizer: use_reduce_avg=True but this build has no "
                "AVG reduce (it needs CUDA and NCCL >= 2.10); reducing with SUM "
                "and scaling by 1/nranks instead."
            )
        self.timers = None
        if self._settings.enable_optimizer_timer:
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
        if self._settings.comm_group_call_opt:
            self._plan = HierarchicalCommPlan.from_hcg(
                self._hcg, resolve_gpus_per_node()
            )
            self._check_plan_matches_sharding_group()
        self._layout = self._build_layout()
        self._owner_of: dict[str, int] = dict(self._layout.owners)
        self._partitions: dict[str | None, Any] = dict(self._layout.partitions)

        # 2. allocation: groups and buffers, exactly as the layout says
        if self._plan is not None:
            self._plan_groups = self._plan.create_groups(self._rank)
            # Once per job is enough to see the layout; other ranks log at debug.
            log = logger.info if self._rank == 0 else logger.debug
            log("MuonShardingOptimizer: comm_group_call_opt on\n%s", self._plan.describe())
        by_name = {p.name: p for p in self._parameter_list if _is_trainable(p)}
        self._muon_buckets: list[MuonBucket] = [
            self._build_muon_bucket(spec, by_name) for spec in self._layout.muon_buckets
        ]
        self._rs_buffers: list = []
        self._rs_colour: dict[int, str | None] = {}
        self._slice_params: dict[str, EagerParamBase] = {}
        self._names_longest_first: list[str] | None = None
        self._numel_of: dict[str, int] | None = None
        for spec in self._layout.slice_buffers:
            self._build_reduce_scatter_buffer(spec, by_name)

        self._describe_like_develop(muon_by_colour, other_by_colour)
        self._no_hook_buffer_ids = {
            id(b)
            for bucket in self._muon_buckets
            if bucket.colour in NO_HOOK_COLOURS
            for b in bucket.buffers
        } | {id(b) for b in self._rs_buffers if self._rs_colour[id(b)] in NO_HOOK_COLOURS}
        # clear_param_storage(color): colour -> this rank's saved 1-D slices
        self._cleared_colours: dict[str | None, dict[str, Any]] = OrderedDict()
        self._fused_state_buffers: dict[str, Any] = {}

        if self._settings.comm_overlap:
            self._register_overlap_hooks()
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

    def _describe_like_develop(self, muon_by_colour: dict, other_by_colour: dict) -> None:
        """Fill the attributes develop's callers and tests read (data only).

        Rank numbers are positions inside the colour's group, as in develop.
        """
        self._color_to_group_info = OrderedDict(
            (colour, {"group": g, "world_size": g.nranks, "rank": list(g.ranks).index(self._rank)})
            for colour, g in self._colour_groups.items()
        )
        self._params_2d_by_color = OrderedDict(
            (colour, list(params)) for colour, params in muon_by_colour.items()
        )
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
        self._local_2d = self._owned_muon_params()
        self.comm_buffer_2d = [b for bucket in self._muon_buckets for b in bucket.buffers]
        # develop's name for the element-wise (reduce-scatter) buffers
        self._comm_buffer_list = self._rs_buffers
        self.param2bucket: dict[str, list] = OrderedDict()
        for buffer in self.comm_buffer_2d + self._rs_buffers:
            for p in buffer.params:
                self.param2bucket.setdefault(p.name, []).append(buffer)

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
            raise TypeError(
                f"MuonShardingOptimizer needs an inner optimizer with "
                f"_apply_optimize (paddle.optimizer.Muon, optionally inside "
                f"MixPrecisionOptimizer); {type(optimizer).__name__} has none."
            )
        mp = self._hcg.get_model_parallel_world_size()
        if mp > 1:
            raise ValueError(
                f"MuonShardingOptimizer does not support tensor parallel "
                f"(mp_degree={mp}): Newton-Schulz needs whole matrices. Set "
                f"mp_degree=1."
            )

    def _colour_key(self, param) -> tuple[str | None, Any]:
        """(colour key, group) of a parameter; checks it, registers nothing."""
        color = getattr(param, "color", None)
        if color is None or (isinstance(color, int) and color == -1):
            return _DEFAULT_COLOUR, self._default_group
        if not isinstance(color, dict) or "color" not in color or "group" not in color:
            raise ValueError(
                f"parameter {param.name} has color={color!r}; expected None, -1 or "
                "a dict {'color': key, 'group': paddle.distributed.Group}."
            )
        group = color["group"]
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
        return color["color"], group

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
        metas = [
            ParamMeta(p.name, tuple(p.shape), str(p.dtype), self._colour_key(p)[0],
                      self._uses_muon(p))
            for p in self._parameter_list
            if _is_trainable(p)
        ]
        s = self._settings
        settings = LayoutSettings(
            comm_buffer_size_MB=s.comm_buffer_size_MB,
            comm_overlap=s.comm_overlap,
            partition_strategy=s.muon_partition_strategy,
            alignment_bytes=tensor_fusion_helper.alignment[
                tensor_fusion_helper.get_current_device_type()],
        )
        groups = {k: list(g.ranks) for k, g in self._colour_groups.items()}
        return ShardingLayout.build(metas, groups, self._rank, settings, self._plan)

    @property
    def sharding_layout(self) -> ShardingLayout:
        """The placement this optimizer was built from (owners, buckets, ranges, schedule)."""
        return self._layout

    def _uses_muon(self, param) -> bool:
        info = self._muon_info.get(param.name)
        if info is None:
            raise ValueError(
                f"parameter {param.name} (shape {list(param.shape)}) has no entry "
                "in the Muon optimizer's muon_param_info_map; build Muon with "
                "these parameters, or add MuonParamInfo(use_muon=...) for it."
            )
        return bool(info.use_muon)

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
            bucket.phase = comm.PHASE_INTRA_NODE_REDUCE
        else:
            buf_group, buf_dst = group, spec.owner
            bucket.phase = flat_reduce_phase(tuple(group.ranks))
        bucket.buffers = [
            tensor_fusion_helper.FusedCommBuffer(
                f"muon_{spec.colour}_{spec.owner}_{spec.dtype}_{i}",
                [by_name[n] for n in chunk],
                buf_group,
                acc_steps=self._buffer_acc_steps(spec.colour),
                act=tensor_fusion_helper.HOOK_ACTION.REDUCE,
                dst=buf_dst,
                release_grads=False,
                use_reduce_avg=self._use_avg,
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
            use_reduce_avg=self._use_avg,
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
        """(buffer, phase) whose first hop the overlap hooks launch.

        Not the no-hook colours, and not one-rank groups (nothing to send).
        """
        labelled = [(b, bucket.phase) for bucket in self._muon_buckets for b in bucket.buffers]
        labelled += [(b, comm.PHASE_REDUCE_SCATTER) for b in self._rs_buffers]
        return [(b, phase) for b, phase in labelled
                if id(b) not in self._no_hook_buffer_ids and b._comm_group.nranks > 1]

    def _register_overlap_hooks(self) -> None:
        for buffer, phase in self._hooked_buffers():
            for param in buffer.params:
                param._register_backward_hook(self._make_overlap_hook(buffer, param, phase))

    @staticmethod
    def _make_overlap_hook(buffer, param, phase: str):
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
                if buffer._sharding_param_grad_view[p.name].has_effective_slice_param:
                    result.append(self._slice_params[p.name])
        return result

    def _set_inner_parameter_list(self) -> None:
        # The inner optimizer only ever sees what this rank updates: whole
        # matrices it owns and its 1-D slices (filled at the first step).
        self._local_parameter_list = self._owned_muon_params() + self._local_slice_params()
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
        overlap = self._settings.comm_overlap
        op = dist.ReduceOp.AVG if self._use_avg else dist.ReduceOp.SUM
        self._copy_released_grads_in()
        # No-hook buffers are reduced here even under overlap.
        comm.reduce_scatter_slices(
            self._rs_buffers,
            lambda b: overlap and id(b) not in self._no_hook_buffer_ids,
        )
        buckets = self._muon_buckets
        if overlap:
            self._finish_overlapped_reduce(op)
            buckets = [b for b in buckets if b.colour in NO_HOOK_COLOURS]
        hierarchical, flat = self._split_routes(
            (bucket, tensor) for bucket in buckets for tensor in self._grad_tensors(bucket)
        )
        if hierarchical:
            comm.hierarchical_reduce(
                hierarchical, self._plan, self._plan_groups, self._rank, op
            )
        for group, routes in flat:
            with comm.comm_phase(flat_reduce_phase(tuple(group.ranks))):
                comm.reduce_onto(routes, group, op)
        if not self._use_avg:
            for bucket in buckets:
                if bucket.owner == self._rank:
                    for tensor in self._grad_tensors(bucket):
                        tensor.scale_(1.0 / bucket.group.nranks)

    def _finish_overlapped_reduce(self, op) -> None:
        # The hooks launched every hooked buffer's first hop: flat ones are
        # done after the wait; hierarchical ones now hold node means on the
        # ranks with the owner's card, which reduce them across nodes.
        hierarchical = []
        for bucket in self._muon_buckets:
            if bucket.colour in NO_HOOK_COLOURS:
                continue
            for buffer in bucket.buffers:
                buffer.scale_grads()
                if bucket.hierarchical:
                    hierarchical.append((buffer.grad_storage, bucket.owner))
        if not hierarchical:
            return
        comm.cross_node_reduce(hierarchical, self._plan, self._plan_groups, self._rank, op)
        if not self._use_avg:
            # scale_grads averaged inside the node; finish the mean over nodes
            nodes = self._plan_groups.same_card_group.nranks
            for tensor, owner in hierarchical:
                if owner == self._rank:
                    tensor.scale_(1.0 / nodes)

    @staticmethod
    def _split_routes(pairs) -> tuple[list, list]:
        """Route (bucket, tensor) pairs: hierarchical ones, and flat ones per group.

        Returns:
            tuple: ``[(tensor, owner)]`` for the hierarchical path and
            ``[(group, [(tensor, owner)])]`` for flat collectives, one entry
            per colour group in first-seen order (identical on every rank).
        """
        hierarchical, flat = [], OrderedDict()
        for bucket, tensor in pairs:
            if bucket.hierarchical:
                hierarchical.append((tensor, bucket.owner))
            else:
                flat.setdefault(id(bucket.group), (bucket.group, []))[1].append(
                    (tensor, bucket.owner)
                )
        return hierarchical, list(flat.values())

    def _copy_released_grads_in(self) -> None:
        if not self._settings.release_grads:
            return
        for buffer in self._rs_buffers:
            if buffer.grad_storage is None and buffer.need_reduce_scale_sync():
                for param in buffer.params:
                    buffer._copy_grad_to_buffer(param)

    @staticmethod
    def _grad_tensors(bucket: MuonBucket) -> list:
        if bucket.buffers:
            return [b.grad_storage for b in bucket.buffers]
        return [_gradient_of(p) for p in bucket.params]

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
        self._assign_slice_grads()
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
        # A phase too: a rank stuck in the clip's all-reduce or in
        # Newton-Schulz shows it in the profiler and the flight recorder.
        with self._timed("apply-optimize"), comm.comm_phase("optimizer_step"):
            self._inner_opt._apply_optimize(
                loss=None, startup_program=None, params_grads=params_grads
            )
        if self._settings.enable_fuse_optimizer_states:
            self._fuse_optimizer_states()
        self._sharding_sync_parameters()
        return params_grads

    def _ensure_global_clip(self) -> None:
        # Each rank holds only its owned matrices and slices: a plain global
        # norm clip would clip by a per-rank norm. HybridParallelOptimizer
        # swaps in its sharding-aware clip; used bare, swap it in here (on
        # the optimizer that applies it, below any MixPrecisionOptimizer).
        base = self._base_opt
        clip = base._grad_clip
        if isinstance(clip, paddle.nn.ClipGradByGlobalNorm):
            base._grad_clip = HybridParallelClipGrad(clip, self._hcg)

    def _assign_slice_grads(self) -> None:
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
        pairs, unpack = [], []
        for bucket in self._muon_buckets:
            numel = sum(int(p.numel()) for p in bucket.params)
            buffer = paddle.empty([numel], dtype=bucket.dtype)
            if bucket.owner == self._rank:
                comm.flatten_into(bucket.params, buffer)
            else:
                unpack.append((buffer, bucket.params))
            pairs.append((bucket, buffer))
        hierarchical, flat = self._split_routes(pairs)
        if hierarchical:
            comm.hierarchical_broadcast(
                hierarchical, self._plan, self._plan_groups, self._rank
            )
        for group, routes in flat:
            with comm.comm_phase(flat_broadcast_phase(tuple(group.ranks))):
                comm.broadcast_from(routes, group)
        for buffer, params in unpack:
            comm.unflatten_from(buffer, params)
        comm.all_gather_slices(self._rs_buffers)

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
                    buffer._clear_grad_storage()

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
                view = buffer._sharding_param_grad_view[p.name]
                if view._param_begin < view._param_end:
                    saved[p.name] = view._param_buffer._slice(
                        view._param_begin, view._param_end
                    ).clone()
                slice_param = self._slice_params[p.name]
                if slice_param._is_initialized():
                    slice_param._clear_dataptr()
            buffer._clear_param_storage()
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
                buffer._reset_param_storage()
                for p in buffer.params:
                    if p.name in saved:
                        view = buffer._sharding_param_grad_view[p.name]
                        paddle.assign(
                            saved[p.name],
                            output=buffer.param_storage._slice(
                                view._param_begin, view._param_end
                            ),
                        )
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
        base = self._base_opt
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
            fused = self._fused_state_buffers.get(dtype)
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
            self._fused_state_buffers[dtype] = fused

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
        local = {p.name: p for p in self._local_parameter_list}
        inner_state = {}
        for key, value in state_dict.items():
            if key == "master_weights":
                base = self._base_opt
                kept = {}
                for name, weight in value.items():
                    if name in local:
                        weight.name = base._gen_master_weight_var_name(local[name])
                        kept[name] = weight
                inner_state[key] = kept
            elif key == "LR_Scheduler":
                inner_state[key] = value
            else:
                owner = self._state_owner(key)
                if owner is not None and owner[0] in local:
                    inner_state[key] = value
        self._inner_opt.set_state_dict(inner_state)

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
        from paddle.distributed.flex_checkpoint.dcp.sharded_weight import (
            ShardedWeight,
        )

        self._create_local_states()
        # Shared weights appear under several keys; like develop, the first
        # key in sorted order carries the optimizer state.
        model_key_of: dict[str, str] = {}
        for key in sorted(model_sharded_state_dict):
            name = model_sharded_state_dict[key].local_tensor.name
            model_key_of.setdefault(name, key)

        states = self._inner_opt.state_dict()
        master_weights = states.pop("master_weights", None) or {}
        entries = []
        for state_key, tensor in states.items():
            if not isinstance(tensor, paddle.Tensor):
                continue  # LR_Scheduler and other plain values
            owner = self._state_owner(state_key)
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
            if math.prod(local_shape) != int(self._param_numel(name)):
                raise ValueError(
                    f"model sharded weight {model_key!r} has local shape "
                    f"{list(local_shape)} but parameter {name} has "
                    f"{self._param_numel(name)} elements; the model's sharded "
                    "state dict must describe the parameter this rank holds."
                )
            if name in self._slice_params:
                begin, end = (int(i) for i in self.local_range(name))
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

    def _param_numel(self, name: str) -> int:
        if self._numel_of is None:
            self._numel_of = {
                p.name: int(p.numel()) for p in self._parameter_list if _is_trainable(p)
            }
        return self._numel_of[name]

    @framework.no_grad()
    def _create_local_states(self) -> None:
        # Slice parameters get their storage at the first step; accumulators
        # and master weights are created lazily by the inner optimizer.
        for buffer in self._rs_buffers:
            for p in buffer.params:
                view = buffer._sharding_param_grad_view[p.name]
                if view.has_effective_slice_param:
                    view.fill_slice_param(self._slice_params[p.name])
        block = paddle.static.default_main_program().global_block()
        self._inner_opt._create_accumulators(block, self._inner_opt._parameter_list)

    def _state_owner(self, state_key: str) -> tuple[str, str] | None:
        """Split a state key into (parameter name, develop's state name).

        ``mlp.weight_scale_moment1_0`` -> ``("mlp.weight_scale", "moment1_0")``
        even when ``mlp.weight`` is also a parameter: names are tried longest
        first. States kept on a master weight (``<name>_fp32_master_0_moment1_0``)
        belong to ``<name>``.

        Returns:
            tuple|None: None when no trainable parameter's name prefixes the key.
        """
        if self._names_longest_first is None:
            self._names_longest_first = sorted(
                set(self._owner_of) | set(self._slice_params), key=len, reverse=True
            )
        for name in self._names_longest_first:
            if state_key.startswith(name + "_"):
                state = state_key[len(name) + 1 :]
                return name, _MASTER_PREFIX.sub("", state, count=1)
        return None

    def __getattr__(self, item: str) -> Any:
        # Only reached for attributes this wrapper does not define.
        if item == "_inner_opt":
            raise AttributeError(item)
        return getattr(self._inner_opt, item)
