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
"""Construction of a :class:`ShardingRuntime`: checks, colour groups, rank agreement,
the layout (data first), then groups, buffers and hooks exactly as the layout says.
"""

from __future__ import annotations

import importlib
import math
from collections import OrderedDict
from typing import Any, Callable

import paddle
import paddle.distributed as dist
from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (
    HybridParallelClipGrad,
)
from paddle.distributed.fleet.utils import tensor_fusion_helper, timer_helper
from paddle.distributed.fleet.utils.log_util import logger

from . import agreement
from .comm_plan import HierarchicalCommPlan
from .layout import (
    DEFAULT_COLOUR,
    LayoutSettings,
    ParamMeta,
    ShardingLayout,
    is_trainable,
    parse_colour,
)
from .owners import machine_balanced_owner_indices
from .runtime import ShardingRuntime, missing_staged_api, optimizer_chain
from .settings import (
    ShardingAssertionError,
    ShardingSettings,
    ShardingTypeError,
    _user_set_sharding_config,
    dtype_itemsize,
    log_once_per_job,
    read_overlap_optimize_and_sync,
)

# The module itself: the package exports the reduce function under the module's name.
_reduce_module = importlib.import_module("paddle.distributed.communication.reduce")


def build_runtime(optimizer, hcg, strategy, gpus_per_node: Callable[[], int],
                  bypass_update: bool) -> ShardingRuntime:
    """Check, place and allocate everything one rank's optimizer needs.

    Args:
        optimizer: the inner optimizer (Muon, optionally in MixPrecisionOptimizer).
        hcg: the hybrid communicate group.
        strategy: fleet's strategy (None: defaults).
        gpus_per_node: how the node size is found (group call, machine-balanced owners).
        bypass_update: develop's ``FLAGS_shard_bypass_dygraph_optimizer``.

    Returns:
        ShardingRuntime: built completely; nothing is built later inside a step.
    """
    check_supported_config(optimizer, hcg)
    settings = ShardingSettings.from_strategy(strategy)
    settings.check(hcg.get_pipe_parallel_world_size())
    rt = ShardingRuntime(rank=dist.get_rank(), inner=optimizer, hcg=hcg, settings=settings)
    params = list(optimizer._parameter_list)
    rt.use_avg = settings.use_reduce_avg and _reduce_module.is_avg_reduce_op_supported()
    # As develop: whether the parameters had main_grad when the optimizer was built.
    rt.use_main_grad = hasattr(params[0], "main_grad")
    if (settings.use_reduce_avg and not rt.use_avg
            and _user_set_sharding_config(strategy, "use_reduce_avg")):
        log_once_per_job(
            "warning", "reduce_avg",
            "MuonShardingOptimizer: use_reduce_avg=True but this build has no AVG reduce "
            "(it needs CUDA and NCCL >= 2.10); reducing with SUM, each addend divided by "
            "nranks first.")
    if settings.enable_optimizer_timer:  # Paddle's process-wide timers: installed here only
        if not timer_helper.is_timer_initialized():
            timer_helper.set_timers()
        rt.timers = timer_helper.get_timers()

    # 1. data: colours, groups, routing plan and the layout; nothing allocated yet
    default_group = hcg.get_sharding_parallel_group()
    trainable = [p for p in params if is_trainable(p)]
    keys = {p.name: colour_key(p, default_group, rt.rank) for p in trainable}
    rt.colour_groups = collect_colour_groups(keys)
    # The first collective, before any error one rank alone could raise while others wait.
    check_ranks_agree(rt, trainable, keys, default_group)
    whole = {p.name: uses_muon(p, optimizer._muon_param_info_map) for p in trainable}
    if settings.comm_group_call_opt:
        rt.plan = HierarchicalCommPlan.from_hcg(hcg, gpus_per_node())
        check_plan_matches_sharding_group(rt.plan, rt.rank, default_group)
    rt.overlap_optimize_and_sync = resolve_overlap_optimize_and_sync(optimizer, settings)
    rt.staged = rt.overlap_optimize_and_sync and not bypass_update
    rt.separate_clip = not missing_staged_api(optimizer) and not bypass_update
    key_of = optimizer.muon_group_key if rt.staged else None
    metas = [ParamMeta(p.name, tuple(p.shape), str(p.dtype), keys[p.name][0], whole[p.name],
                       key_of(p) if key_of and whole[p.name] else None) for p in trainable]
    layout_settings = LayoutSettings(
        comm_buffer_size_MB=settings.comm_buffer_size_MB,
        comm_overlap=settings.comm_overlap,
        partition_strategy=settings.muon_partition_strategy,
        alignment_bytes=tensor_fusion_helper.alignment[
            tensor_fusion_helper.get_current_device_type()],
        overlap_sync=rt.staged,
        overlap_sync_group_call=settings.overlap_sync_group_call,
    )
    fixed = (machine_balanced_owners(trainable, keys, whole, rt.rank, gpus_per_node(),
                                     settings.comm_buffer_size_MB)
             if settings.machine_balanced_2d_partition else None)
    rt.layout = ShardingLayout.build(
        metas, {k: list(g.ranks) for k, g in rt.colour_groups.items()}, rt.rank,
        layout_settings, rt.plan, fixed_owners=fixed,
        clip_groups=clip_groups(rt.base_opt, hcg) if rt.separate_clip else [])

    # 2. allocation: groups and buffers, exactly as the layout says
    if rt.plan is not None:
        create_group_call_groups(rt)
        # Once per job is enough to see the layout (a rebuild of the same one: debug).
        describe = rt.plan.describe()
        log_once_per_job("info", "group_call_plan\n" + describe,
                         "MuonShardingOptimizer: comm_group_call_opt on\n%s", describe)
    rt.param_by_name = {p.name: p for p in trainable}
    rt.build_muon_buckets()
    rt.build_slice_buffers()
    rt.plan_phases()
    if settings.comm_overlap and not settings.pp_sharding_comm_overlap:
        rt.register_hooks()
    # The inner optimizer sees only what this rank updates: its whole matrices and 1-D slices.
    rt.local_params = rt.owned_muon_params() + rt.local_slice_params()
    set_inner_opt_attr(optimizer, "_parameter_list", rt.local_params)
    logger.debug("MuonShardingOptimizer rank %d owns %d of %d Muon params; %d Muon buckets, "
                 "%d reduce-scatter buffers", rt.rank,
                 sum(1 for o in rt.layout.owners.values() if o == rt.rank),
                 len(rt.layout.owners), len(rt.muon_buckets), len(rt.rs_buffers))
    return rt


def set_inner_opt_attr(optimizer, name: str, value: Any) -> None:
    """Set ``name`` on every level of the optimizer chain (a wrapper's setattr stops at it)."""
    for opt in optimizer_chain(optimizer):
        setattr(opt, name, value)


def check_ranks_agree(rt: ShardingRuntime, trainable: list, keys: dict, default_group) -> None:
    """Refuse ranks of one group that built different parameters, options or per-parameter
    settings (collective over the sharding and colour groups; RankDisagreementError on all)."""
    options = agreement.sharding_options(
        rt.settings,
        overlap_optimize_and_sync=read_overlap_optimize_and_sync(),
        inner_optimizer=" > ".join(type(o).__name__ for o in optimizer_chain(rt.inner)),
        **agreement.optimizer_options(rt.base_opt),
    )
    info_map, base = rt.inner._muon_param_info_map, rt.base_opt
    records = [(keys[p.name][0], agreement.param_record(p, info_map.get(p.name)),
                agreement.param_settings(p, base)) for p in trainable]
    groups = {**rt.colour_groups, None: default_group}
    digests = agreement.group_digests(
        records, {k: list(g.ranks) for k, g in groups.items()}, options)
    agreement.check_ranks_agree(digests, lambda d: groups[d.colour])


def resolve_overlap_optimize_and_sync(optimizer, settings: ShardingSettings) -> bool:
    """develop's flag: env, on by default; off without Muon's staged API, and off under
    ``comm_group_call_opt`` unless ``overlap_sync_group_call`` (ours) keeps it on."""
    if not read_overlap_optimize_and_sync():
        return False
    missing = missing_staged_api(optimizer)
    if missing:
        log_once_per_job(
            "warning", "overlap_sync_no_staged_api",
            "MuonShardingOptimizer: overlap_optimize_and_sync disabled: the inner optimizer "
            "%s lacks %s (Muon's staged update API).", type(optimizer).__name__,
            ", ".join(missing))
        return False
    if settings.comm_group_call_opt and not settings.overlap_sync_group_call:
        log_once_per_job(
            "warning", "overlap_sync_group_call",
            "MuonShardingOptimizer: overlap_optimize_and_sync disabled under "
            "comm_group_call_opt (as in develop); set sharding option "
            "overlap_sync_group_call=True to overlap the hierarchical sync.")
        return False
    return True


def create_group_call_groups(rt: ShardingRuntime) -> None:
    """Create every node / same-card group (collective, one order on all ranks)."""
    created: list = []

    def new_group(ranks):
        created.append(dist.new_group(ranks))
        return created[-1]

    rt.plan_groups = rt.plan.create_groups(rt.rank, new_group)
    # develop's names: trainer_comms[machine], trainer_same_card_comms[stage][card]
    n_nodes, gpn = rt.plan.num_nodes, rt.plan.gpus_per_node
    rt.trainer_comms = created[:n_nodes]
    rt.trainer_same_card_comms = [created[i:i + gpn] for i in range(n_nodes, len(created), gpn)]


def check_plan_matches_sharding_group(plan, rank: int, default_group) -> None:
    stage_ranks = list(plan.sharding_group_ranks(plan.stage_of(rank)))
    group_ranks = list(default_group.ranks)
    if sorted(stage_ranks) != sorted(group_ranks):
        raise ValueError(
            f"comm_group_call_opt: the default sharding group of rank {rank} is "
            f"{group_ranks}, but the routing plan's stage group for it is {stage_ranks}. "
            "The hcg and its topology (hcg._moe_topo) disagree; build both from the same "
            "hybrid_configs, or set comm_group_call_opt=False.")


def check_supported_config(optimizer, hcg) -> None:
    """Refuse an inner optimizer or topology this optimizer cannot shard."""
    params = getattr(optimizer, "_parameter_list", None)
    if not params:
        raise ValueError("MuonShardingOptimizer needs an optimizer built with "
                         "parameters=model.parameters(); got none.")
    if isinstance(params[0], dict):
        raise TypeError("MuonShardingOptimizer does not support parameter groups; pass a "
                        "flat list (parameters=model.parameters()).")
    if not hasattr(optimizer, "_muon_param_info_map"):
        raise TypeError(f"MuonShardingOptimizer wraps a Muon optimizer; got "
                        f"{type(optimizer).__name__}, which has no _muon_param_info_map.")
    if not callable(getattr(optimizer, "_apply_optimize", None)):
        raise ShardingTypeError(
            f"MuonShardingOptimizer needs an inner optimizer with _apply_optimize "
            f"(paddle.optimizer.Muon, optionally inside MixPrecisionOptimizer); "
            f"{type(optimizer).__name__} has none.")
    mp = hcg.get_model_parallel_world_size()
    if mp > 1:
        raise ShardingAssertionError(
            f"MuonShardingOptimizer does not support tensor parallel (mp_degree={mp}): "
            "Newton-Schulz needs whole matrices. Set mp_degree=1.")


def colour_key(param, default_group, rank: int) -> tuple[Any, Any]:
    """(colour key, group) of a parameter, checked."""
    color = getattr(param, "color", None)
    parsed = parse_colour(color, default_group)
    if not parsed.from_dict and parsed.key is not DEFAULT_COLOUR:
        raise ValueError(
            f"parameter {param.name} has color={color!r}; expected None, -1 or "
            "a dict {'color': key, 'group': paddle.distributed.Group}.")
    if parsed.key is DEFAULT_COLOUR:
        return DEFAULT_COLOUR, default_group
    group = parsed.group
    if not hasattr(group, "ranks") or not hasattr(group, "nranks"):
        raise TypeError(f"parameter {param.name}: color group {group!r} is not a "
                        "paddle.distributed Group (it needs .ranks and .nranks).")
    if rank not in group.ranks:
        raise ValueError(
            f"parameter {param.name}: rank {rank} is not in its colour group "
            f"{list(group.ranks)}; every rank must hold the parameters of the colour "
            "groups it belongs to.")
    return parsed.key, group


def collect_colour_groups(keys: dict) -> dict:
    """Colour key -> group of ``keys`` (name -> (key, group)), first-seen order; one per key."""
    groups: dict = OrderedDict()
    for key, group in keys.values():
        known = groups.get(key)
        if known is not None and list(known.ranks) != list(group.ranks):
            raise ValueError(f"colour {key!r} is used with two different groups "
                             f"({list(known.ranks)} and {list(group.ranks)}).")
        groups.setdefault(key, group)
    return groups


def uses_muon(param, info_map: dict) -> bool:
    """develop's keep_whole: Muon (or hyperball) parameters are owned whole."""
    info = info_map.get(param.name)
    if info is None:
        raise ShardingAssertionError(
            f"parameter {param.name} (shape {list(param.shape)}) has no entry in the Muon "
            "optimizer's muon_param_info_map; build Muon with these parameters, or add "
            "MuonParamInfo(use_muon=...) for it.")
    return bool(info.use_muon or getattr(info, "use_hyperball", False))


def clip_groups(base_opt, hcg) -> list:
    """The groups the global-norm clip all-reduces its norm over, in issue order.

    Paddle's ``HybridParallelClipGrad``: the sharding group twice (distributed
    and replicated norms), then the pipe group; empty without a global-norm clip.
    """
    if not isinstance(base_opt._grad_clip, (paddle.nn.ClipGradByGlobalNorm,
                                            HybridParallelClipGrad)):
        return []
    groups = []
    if hcg.get_sharding_parallel_world_size() > 1:
        ranks = list(hcg.get_sharding_parallel_group().ranks)
        groups += [ranks, ranks]
    if hcg.get_pipe_parallel_world_size() > 1:
        groups.append(list(hcg.get_pipe_parallel_group().ranks))
    return groups


def machine_balanced_owners(params: list, keys: dict, whole: dict, rank: int,
                            gpus_per_node: int, buffer_MB: float) -> dict[str, int]:
    """Owners from develop's machine-balanced rule (collective over the global group).

    Every rank gathers every rank's machine and keep-whole parameters (PP/EP
    give colours groups a rank cannot see), then applies the rule to the same
    job-wide input, so owners agree on every rank.
    """
    mine: dict = OrderedDict()
    for p in params:
        if not whole[p.name]:
            continue
        colour, group = keys[p.name]
        numel = math.prod(int(d) for d in p.shape)
        mine.setdefault((colour, tuple(int(r) for r in group.ranks)), []).append(
            (p.name, numel, str(p.dtype), dtype_itemsize(p.dtype)))
    gathered: list = []
    # develop's node numbering: global rank // GPUs per node
    entry = (rank, rank // gpus_per_node, mine)
    if dist.get_world_size() > 1:
        dist.all_gather_object(gathered, entry)
    else:
        gathered.append(entry)
    rank_to_machine: dict[int, int] = {}
    info: dict = {}
    for other, machine, groups in gathered:
        rank_to_machine[int(other)] = int(machine)
        for key, entries in groups.items():
            seen = info.setdefault(key, entries)
            if seen != entries:
                raise ValueError(
                    f"machine_balanced_2d_partition: ranks of colour group {key[1]} (colour "
                    f"{key[0]!r}) hold different keep-whole parameters "
                    f"({[e[0] for e in seen]} vs {[e[0] for e in entries]}); every member "
                    "must build the same parameters for its colour groups.")
    placed = machine_balanced_partition(info, rank_to_machine, buffer_MB, rank)
    # Only this rank's own groups: parameter names repeat across groups.
    return {name: key[1][index] for key in mine
            for index, names in placed[key].items() for name in names}


def machine_balanced_partition(color_group_info: dict, rank_to_machine: dict,
                               buffer_MB: float, rank: int) -> dict:
    """develop's machine-balanced owner rule over every colour group of the job
    (``owners.machine_balanced_owner_indices``); rank 0 logs the machine loads.

    Returns:
        dict: ``color_group_info``'s keys -> ``{group index: [names]}`` (every index).
    """
    result, machines = machine_balanced_owner_indices(color_group_info, rank_to_machine,
                                                      buffer_MB)
    if rank == 0:
        logger.info("Muon machine-balanced 2D partition: " + ", ".join(
            f"machine {m}: {b / 2**20:.1f} MB in {n} matrices"
            for m, (b, n) in machines.items()))
    return result
