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
"""Bodies of :class:`MuonShardingOptimizer`'s construction methods.

Groups, layout, owners, the clip's groups and develop's descriptive
attributes; the buffers and slice parameters are built by the state object
(``muon_sharding_buffers.ShardingState``) the construction fills. Split from
``muon_sharding_optimizer`` so that file stays readable: each function takes
the optimizer (``opt``) first, and that file binds it under develop's method
name (``_DevelopMethodSurface``), so there is one body per method. This module never imports the optimizer's module (the
imports run one way); what both need lives in ``muon_sharding_types``.
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from typing import Any
from typing import Callable
from typing import TYPE_CHECKING

import paddle
from paddle.distributed import fleet
from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (
    HybridParallelClipGrad,
)
from paddle.distributed.fleet.utils import tensor_fusion_helper
from paddle.distributed.fleet.utils import timer_helper
from paddle.distributed.fleet.utils.log_util import logger
import paddle.distributed as dist

from ..utils.job_log import log_once_per_job
from . import muon_sharding_agreement as agreement
from .muon_comm_plan import HierarchicalCommPlan, resolve_gpus_per_node
from .muon_sharding_layout import LayoutSettings
from .muon_sharding_layout import ParamMeta
from .muon_sharding_layout import ShardingLayout
from .muon_sharding_partition import machine_balanced_owner_indices
from .muon_sharding_settings import ShardingAssertionError
from .muon_sharding_settings import ShardingSettings
from .muon_sharding_settings import ShardingTypeError
from .muon_sharding_settings import _user_set_sharding_config
from .muon_sharding_settings import _warn_once
from .muon_sharding_settings import read_overlap_optimize_and_sync
from .muon_sharding_types import DEFAULT_COLOUR
from .muon_sharding_types import STAGED_API
from .muon_sharding_types import dtype_itemsize
from .muon_sharding_types import is_trainable
from .muon_sharding_types import parse_colour
from .muon_sharding_buffers import ShardingState
from .muon_sharding_executor import has_staged_api

if TYPE_CHECKING:
    from .muon_sharding_optimizer import MuonShardingOptimizer

# The package re-exports the reduce *function* under the module's name; the
# module itself holds is_avg_reduce_op_supported.
_reduce_module = importlib.import_module("paddle.distributed.communication.reduce")


def init_optimizer(opt: MuonShardingOptimizer, optimizer, hcg=None, strategy=None,
                   gpus_per_node: Callable[[], int] | None = None) -> None:
    """Build ``opt`` (``MuonShardingOptimizer.__init__``; its Args)."""
    opt._inner_opt = optimizer
    # read only where the node size matters (group call, machine-balanced owners)
    opt._resolve_gpus_per_node = gpus_per_node or resolve_gpus_per_node
    opt._hcg = hcg if hcg is not None else fleet.get_hybrid_communicate_group()
    if strategy is None:
        strategy = getattr(fleet.fleet, "_user_defined_strategy", None)
    opt._settings = ShardingSettings.from_strategy(strategy)
    opt._rank = dist.get_rank()
    opt._check_supported_config(optimizer)
    opt._settings.check(opt._hcg.get_pipe_parallel_world_size())
    # the one runtime state (groups, buffers, slices), filled as the build goes
    opt._state = ShardingState(rank=opt._rank)

    # develop's config mirrors and sharding-group facts are not set here:
    # they are views of _settings / _hcg (_DevelopStateSurface), one home each.
    opt._parameter_list = list(optimizer._parameter_list)
    opt._muon_param_info_map = optimizer._muon_param_info_map
    # Asks the build once (develop's use_reduce_avg reads this).
    opt._use_avg = opt._settings.use_reduce_avg and (
        _reduce_module.is_avg_reduce_op_supported()
    )
    # As develop: whether the parameters had main_grad when the optimizer was
    # built (a snapshot; the parameters are the caller's and may change).
    opt._use_main_grad = hasattr(opt._parameter_list[0], "main_grad")
    if (opt._settings.use_reduce_avg and not opt._use_avg
            and _user_set_sharding_config(strategy, "use_reduce_avg")
            and _warn_once("reduce_avg")):
        logger.warning(
            "MuonShardingOptimizer: use_reduce_avg=True but this build has no "
            "AVG reduce (it needs CUDA and NCCL >= 2.10); reducing with SUM "
            "with each addend divided by nranks first instead."
        )
    # Installs Paddle's process-wide timers when on: set once, here.
    opt.timers = None
    if opt._enable_timer:
        if not timer_helper.is_timer_initialized():
            timer_helper.set_timers()
        opt.timers = timer_helper.get_timers()

    # 1. data: colours, groups, routing plan and the layout; nothing allocated yet
    opt._state.colour_groups = opt._collect_colour_groups()
    # Before any other collective, and before the per-parameter errors below
    # that one rank alone could raise while the others wait.
    check_ranks_agree(opt)
    muon_by_colour: dict[str | None, list] = OrderedDict()
    other_by_colour: dict[str | None, list] = OrderedDict()
    for param in opt._parameter_list:
        if is_trainable(param):
            target = muon_by_colour if opt._uses_muon(param) else other_by_colour
            target.setdefault(opt._colour_key(param)[0], []).append(param)
    # Resolved only with the option on: upstream resolved the node size
    # unconditionally and crashed on hosts without a launcher or CUDA.
    opt.trainer_comms: list = []
    opt.trainer_same_card_comms: list = []
    if opt._settings.comm_group_call_opt:
        opt._state.plan = HierarchicalCommPlan.from_hcg(opt._hcg, opt._resolve_gpus_per_node())
        opt._check_plan_matches_sharding_group()
    opt.overlap_optimize_and_sync = opt._resolve_overlap_optimize_and_sync(optimizer)
    opt._has_staged_api = has_staged_api(optimizer)
    opt._state.layout = opt._build_layout()

    # 2. allocation: groups and buffers, exactly as the layout says
    if opt._plan is not None:
        opt._create_group_call_groups()
        # Once per job is enough to see the layout (a rebuild of the same one:
        # debug); other ranks log at debug.
        describe = opt._plan.describe()
        log_once_per_job("info", "group_call_plan\n" + describe,
                         "MuonShardingOptimizer: comm_group_call_opt on\n%s", describe)
    by_name = {p.name: p for p in opt._parameter_list if is_trainable(p)}
    opt._state.param_by_name = by_name
    opt._build_2d_comm_buffers(by_name)
    opt._build_1d_comm_buffers(by_name)
    opt._names_longest_first: list[str] | None = None
    opt._numel_of: dict[str, int] | None = None

    opt._describe_like_develop(muon_by_colour, other_by_colour)
    opt._sync_stages: list | None = None

    if opt.comm_overlap and not opt.pp_overlap:
        opt._register_reduce_overlap_hook()
    opt._set_inner_parameter_list()
    logger.debug(
        "MuonShardingOptimizer rank %d owns %d of %d Muon params; "
        "%d Muon buckets, %d reduce-scatter buffers",
        opt._rank,
        sum(1 for o in opt._owner_of.values() if o == opt._rank),
        len(opt._owner_of),
        len(opt._muon_buckets),
        len(opt._rs_buffers),
    )


def check_ranks_agree(opt: MuonShardingOptimizer) -> None:
    """Refuse ranks of one group that built different parameters or options.

    Collective over the sharding group and each colour group
    (``muon_sharding_agreement``); raises ``RankDisagreementError``.
    """
    options = agreement.sharding_options(
        opt._settings,
        overlap_optimize_and_sync=read_overlap_optimize_and_sync(),
        inner_optimizer=" > ".join(type(o).__name__ for o in opt._optimizer_chain()),
        **agreement.optimizer_options(opt._base_opt),
    )
    records = [(opt._colour_key(p)[0], agreement.param_record(p, opt._muon_param_info_map.get(p.name)))
               for p in opt._parameter_list if is_trainable(p)]
    colour_ranks = {k: list(g.ranks) for k, g in opt._colour_groups.items()}
    colour_ranks[None] = list(opt._default_group.ranks)
    digests = agreement.group_digests(records, colour_ranks, options)
    agreement.check_ranks_agree(digests, lambda d: (
        opt._default_group if d.colour is None else opt._colour_groups[d.colour]))


def resolve_overlap_optimize_and_sync(opt: MuonShardingOptimizer, optimizer) -> bool:
    # develop: env flag, on by default; off (with a warning) under
    # comm_group_call_opt or without Muon's staged API. Ours: the
    # overlap_sync_group_call option keeps it on under group call.
    if not read_overlap_optimize_and_sync():
        return False
    missing = [n for n in STAGED_API if not callable(getattr(optimizer, n, None))]
    if missing:
        log_once_per_job(
            "warning", "overlap_sync_no_staged_api",
            "MuonShardingOptimizer: overlap_optimize_and_sync disabled: the inner "
            "optimizer %s lacks %s (Muon's staged update API).",
            type(optimizer).__name__, ", ".join(missing))
        return False
    if opt.use_group_call_opt and not opt._settings.overlap_sync_group_call:
        log_once_per_job(
            "warning", "overlap_sync_group_call",
            "MuonShardingOptimizer: overlap_optimize_and_sync disabled under "
            "comm_group_call_opt (as in develop); set sharding option "
            "overlap_sync_group_call=True to overlap the hierarchical sync.")
        return False
    return True


def create_group_call_groups(opt: MuonShardingOptimizer) -> None:
    """Create every node / same-card group (collective, one order on all ranks)."""
    created: list = []

    def new_group(ranks):
        group = dist.new_group(ranks)
        created.append(group)
        return group

    opt._state.plan_groups = opt._plan.create_groups(opt._rank, new_group)
    # develop's names: trainer_comms[machine], trainer_same_card_comms[stage][card]
    n_nodes = opt._plan.num_nodes
    opt.trainer_comms = created[:n_nodes]
    gpn = opt._plan.gpus_per_node
    same_card = created[n_nodes:]
    opt.trainer_same_card_comms = [
        same_card[i:i + gpn] for i in range(0, len(same_card), gpn)
    ]


def describe_like_develop(
    opt: MuonShardingOptimizer, muon_by_colour: dict, other_by_colour: dict
) -> None:
    """Fill the attributes develop's callers and tests read (data only).

    Rank numbers are positions inside the colour's group, as in develop.
    """
    opt._color_to_group_info = opt._build_color_to_group_info_from_params(
        opt._parameter_list, opt._default_group)
    opt._params_2d_by_color = OrderedDict()
    opt._params_1d = [p for params in other_by_colour.values() for p in params]
    opt._rank2params_2d_by_color = OrderedDict()
    opt._param2rank_2d_by_color = OrderedDict()
    for colour, params in muon_by_colour.items():
        ranks = list(opt._colour_groups[colour].ranks)
        by_rank = OrderedDict((i, []) for i in range(len(ranks)))
        to_rank = OrderedDict()
        for p in params:
            local = ranks.index(opt._owner_of[p.name])
            by_rank[local].append(p)
            to_rank[p.name] = local
        opt._rank2params_2d_by_color[colour] = by_rank
        opt._param2rank_2d_by_color[colour] = to_rank
        # develop keeps each colour's list sorted (stably) by owner
        opt._params_2d_by_color[colour] = sorted(params, key=lambda p: to_rank[p.name])
    # the buffer views (comm_buffer_2d, _comm_buffer_list, param2bucket, ...)
    # are properties over the state (_DevelopStateSurface)


def check_plan_matches_sharding_group(opt: MuonShardingOptimizer) -> None:
    stage_ranks = list(opt._plan.sharding_group_ranks(opt._plan.stage_of(opt._rank)))
    group_ranks = list(opt._default_group.ranks)
    if sorted(stage_ranks) != sorted(group_ranks):
        raise ValueError(
            f"comm_group_call_opt: the default sharding group of rank "
            f"{opt._rank} is {group_ranks}, but the routing plan's stage "
            f"group for it is {stage_ranks}. The hcg and its topology "
            "(hcg._moe_topo) disagree; build both from the same "
            "hybrid_configs, or set comm_group_call_opt=False."
        )


def check_supported_config(opt: MuonShardingOptimizer, optimizer) -> None:
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
    mp = opt._hcg.get_model_parallel_world_size()
    if mp > 1:
        raise ShardingAssertionError(
            f"MuonShardingOptimizer does not support tensor parallel "
            f"(mp_degree={mp}): Newton-Schulz needs whole matrices. Set "
            f"mp_degree=1."
        )


def colour_key(opt: MuonShardingOptimizer, param) -> tuple[str | None, Any]:
    """(colour key, group) of a parameter; checks it, registers nothing."""
    color = getattr(param, "color", None)
    parsed = parse_colour(color, opt._default_group)
    if not parsed.from_dict and parsed.key is not DEFAULT_COLOUR:
        raise ValueError(
            f"parameter {param.name} has color={color!r}; expected None, -1 or "
            "a dict {'color': key, 'group': paddle.distributed.Group}."
        )
    # develop: a dict without 'color' (or with -1/None) is the default
    # colour; a dict without 'group' uses the sharding group
    if parsed.key is DEFAULT_COLOUR:
        return DEFAULT_COLOUR, opt._default_group
    key, group = parsed.key, parsed.group
    if not hasattr(group, "ranks") or not hasattr(group, "nranks"):
        raise TypeError(
            f"parameter {param.name}: color group {group!r} is not a "
            "paddle.distributed Group (it needs .ranks and .nranks)."
        )
    if opt._rank not in group.ranks:
        raise ValueError(
            f"parameter {param.name}: rank {opt._rank} is not in its colour "
            f"group {list(group.ranks)}; every rank must hold the parameters "
            "of the colour groups it belongs to."
        )
    return key, group


def collect_colour_groups(opt: MuonShardingOptimizer) -> dict[str | None, Any]:
    """Colour key -> group, in first-seen order; one group per key."""
    groups: dict[str | None, Any] = OrderedDict()
    for param in opt._parameter_list:
        if not is_trainable(param):
            continue
        key, group = opt._colour_key(param)
        known = groups.get(key)
        if known is not None and list(known.ranks) != list(group.ranks):
            raise ValueError(
                f"colour {key!r} is used with two different groups "
                f"({list(known.ranks)} and {list(group.ranks)})."
            )
        groups.setdefault(key, group)
    return groups


def build_layout(opt: MuonShardingOptimizer) -> ShardingLayout:
    """Where every parameter goes: the one placement decision, as data."""
    # Sync stages group matrices by Muon's own key, so the layout asks for it.
    key_of = opt._inner_opt.muon_group_key if opt._stages_in_use() else None
    metas = []
    for p in opt._parameter_list:
        if not is_trainable(p):
            continue
        whole = opt._uses_muon(p)
        metas.append(ParamMeta(p.name, tuple(p.shape), str(p.dtype), opt._colour_key(p)[0],
                               whole, key_of(p) if key_of and whole else None))
    s = opt._settings
    settings = LayoutSettings(
        comm_buffer_size_MB=s.comm_buffer_size_MB,
        comm_overlap=s.comm_overlap,
        partition_strategy=s.muon_partition_strategy,
        alignment_bytes=tensor_fusion_helper.alignment[
            tensor_fusion_helper.get_current_device_type()],
        overlap_sync=opt._stages_in_use(),
        overlap_sync_group_call=s.overlap_sync_group_call,
    )
    groups = {k: list(g.ranks) for k, g in opt._colour_groups.items()}
    return ShardingLayout.build(metas, groups, opt._rank, settings, opt._plan,
                                fixed_owners=opt._machine_balanced_owners(),
                                clip_groups=clip_groups(opt))


def clip_groups(opt: MuonShardingOptimizer) -> list:
    """The groups the global-norm clip all-reduces its norm over, in issue order.

    Paddle's ``HybridParallelClipGrad`` (swapped in for a
    ``ClipGradByGlobalNorm``): the sharding group twice (distributed and
    replicated norms), then the pipe group. Empty when the clip is not its own
    step phase (no global-norm clip, no staged API, or the update bypassed).
    """
    if opt._bypass_update or not opt._has_staged_api:
        return []
    clip = opt._base_opt._grad_clip
    if not isinstance(clip, (paddle.nn.ClipGradByGlobalNorm, HybridParallelClipGrad)):
        return []
    hcg, groups = opt._hcg, []
    if hcg.get_sharding_parallel_world_size() > 1:
        ranks = list(hcg.get_sharding_parallel_group().ranks)
        groups += [ranks, ranks]
    if hcg.get_pipe_parallel_world_size() > 1:
        groups.append(list(hcg.get_pipe_parallel_group().ranks))
    return groups


def machine_balanced_owners(opt: MuonShardingOptimizer) -> dict[str, int] | None:
    """Owners from develop's machine-balanced rule (None with the option off).

    Every rank gathers every rank's machine and keep-whole parameters over
    the global group (PP/EP give colours several groups a rank cannot see),
    then applies the rule to the same job-wide input, so owners agree on
    every rank. Collective when on.
    """
    if not opt._settings.machine_balanced_2d_partition:
        return None
    mine: dict = OrderedDict()
    for p in opt._parameter_list:
        if not (is_trainable(p) and opt._uses_muon(p)):
            continue
        colour, group = opt._colour_key(p)
        numel = 1
        for d in p.shape:
            numel *= int(d)
        mine.setdefault((colour, tuple(int(r) for r in group.ranks)), []).append(
            (p.name, numel, str(p.dtype), dtype_itemsize(p.dtype)))
    # develop's node numbering: global rank // GPUs per node
    machine = opt._rank // opt._resolve_gpus_per_node()
    gathered: list = []
    if dist.get_world_size() > 1:
        dist.all_gather_object(gathered, (opt._rank, machine, mine))
    else:
        gathered.append((opt._rank, machine, mine))
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
    placed = opt._partition_2d_parameters_machine_balanced(info, rank_to_machine)
    # Only this rank's own groups: parameter names repeat across groups.
    return {name: key[1][index] for key in mine
            for index, names in placed[key].items() for name in names}


def partition_2d_parameters_machine_balanced(
    opt: MuonShardingOptimizer, color_group_info: dict, rank_to_machine: dict
) -> dict:
    """Develop's machine-balanced owner rule over every colour group of the job.

    Args:
        color_group_info: ``(colour key, tuple(group global ranks))`` ->
            ``[(name, numel, dtype_str, itemsize), ...]``.
        rank_to_machine: global rank -> machine id.

    Returns:
        dict: the same keys -> ``{group index: [names]}`` (every index present).
    """
    result, machines = machine_balanced_owner_indices(
        color_group_info, rank_to_machine, opt.comm_buffer_size_MB)
    if opt._global_rank == 0:
        logger.info(
            "Muon machine-balanced 2D partition: "
            + ", ".join(f"machine {m}: {b / 2**20:.1f} MB in {n} matrices"
                        for m, (b, n) in machines.items())
        )
    return result


def uses_muon(opt: MuonShardingOptimizer, param) -> bool:
    info = opt._muon_param_info_map.get(param.name)
    if info is None:
        raise ShardingAssertionError(
            f"parameter {param.name} (shape {list(param.shape)}) has no entry "
            "in the Muon optimizer's muon_param_info_map; build Muon with "
            "these parameters, or add MuonParamInfo(use_muon=...) for it."
        )
    # develop's keep_whole: hyperball parameters are owned whole too
    return bool(info.use_muon or getattr(info, "use_hyperball", False))


def filter_parameters(opt: MuonShardingOptimizer, parameter_list, hcg) -> list:
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
        if opt._owner_of.get(p.name) == opt._rank:
            result.append(p)
        elif p.name in opt._slice_params:
            sp = opt._slice_params[p.name]
            if sp._is_initialized():
                result.append(sp)
    return result


def colour_to_group_info_from_params(params, sharding_group) -> OrderedDict:
    """Colour key -> ``{'group', 'world_size', 'rank'}``: None first, dict colours as seen."""
    def entry(group) -> dict:
        return {"group": group, "world_size": len(group.ranks), "rank": group.rank}

    info = OrderedDict([(DEFAULT_COLOUR, entry(sharding_group))])
    for param in params:
        parsed = parse_colour(getattr(param, "color", None), sharding_group)
        if not parsed.from_dict or parsed.key is DEFAULT_COLOUR or parsed.key in info:
            continue
        info[parsed.key] = entry(parsed.group)
    return info


def buffer_colour(buffer):
    """The colour of a buffer, read from its first parameter as develop does."""
    # develop's rule: a dict colour gives its 'color' as written (None when
    # absent, -1 stays -1); any other colour gives its key (None for -1/None).
    params = buffer.params
    if not params:
        return None
    parsed = parse_colour(getattr(params[0], "color", None))
    return parsed.declared if parsed.from_dict else parsed.key
