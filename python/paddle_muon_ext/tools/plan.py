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
"""``plan``: one step's collectives and bytes, read from the optimizer's own layout.

For every rank the tool builds the :class:`ShardingLayout` the optimizer would
build (from parameter specs instead of parameters) for the flat path
(``comm_group_call_opt`` off) and the hierarchical path (on), takes each
group collective of the layouts' schedules once, and charges it to the
:mod:`cost_model`. With pp > 1 the parameter list is split over the stages in
model order at equal cumulative bytes (a stand-in for the pipeline's layer
split); expert parameters take the MoE colour (their moe_sharding group).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

from ..distributed.fleet.meta_optimizers.muon_sharding_layout import (
    LayoutSettings,
    ShardingLayout,
)
from ..distributed.fleet.meta_optimizers.muon_sharding_partition import balance_floor
from . import presets
from .args import DEFAULT_BUFFER_MB, MuonCommConfig
from .cost_model import BACKENDS, AlphaBeta, CostPath, max_over_mean, ratio

__all__ = [
    "EXPERT_COLOUR",
    "PARTITION_RULES",
    "TARGET_HIER_RATIO",
    "TARGET_RAIL_IMBALANCE",
    "compute_plan",
    "predict_cluster",
    "split_stages",
    "world_layouts",
    "world_ops",
]

#: Targets of the hierarchical path (checked on every run, printed with the table).
TARGET_HIER_RATIO = 1.01
TARGET_RAIL_IMBALANCE = 1.05
#: Colour key of expert parameters (the MoE models' convention).
EXPERT_COLOUR = "moe_expert"
#: Partition rules reported side by side: the plan's own, then develop's.
PARTITION_RULES = ("balanced", "upstream_greedy")


def _pbytes(p: presets.ParamSpec) -> int:
    return p.to_meta().nbytes


def split_stages(params: Sequence[presets.ParamSpec], pp: int) -> List[List[presets.ParamSpec]]:
    """Contiguous split in model order at equal cumulative parameter bytes."""
    stages: List[List[presets.ParamSpec]] = [[] for _ in range(pp)]
    total = sum(_pbytes(p) for p in params) or 1
    before = 0
    for p in params:
        b = _pbytes(p)
        mid = before + b / 2.0
        stages[min(pp - 1, int(mid * pp // total))].append(p)
        before += b
    return stages


def world_layouts(plan, stages: Sequence[Sequence[presets.ParamSpec]],
                  settings: LayoutSettings, hierarchical: bool) -> Dict[int, ShardingLayout]:
    """The layout of every rank of the world.

    Ranks sharing every colour group share the layout (only ``rank`` differs),
    so it is built once per moe_sharding group.
    """
    layouts: Dict[int, ShardingLayout] = {}
    metas = [[p.to_meta(EXPERT_COLOUR) for p in sparams] for sparams in stages]
    for stage in range(plan.pp_degree):
        dense = plan.sharding_group_ranks(stage)
        for rank in dense:
            if rank in layouts:
                continue
            moe = plan.moe_sharding_ranks(rank)
            first = ShardingLayout.build(
                metas[stage], {None: dense, EXPERT_COLOUR: moe}, rank, settings,
                plan if hierarchical else None,
            )
            for r in moe:
                layouts[r] = first if r == rank else dataclasses.replace(first, rank=r)
    return layouts


def world_ops(layouts: Dict[int, ShardingLayout]) -> list:
    """Every group collective of one step once (as issued by the group's first rank)."""
    ops = []
    for rank in sorted(layouts):
        lay = layouts[rank]
        if all(rank != min(g) for g in lay.comm_groups()):
            continue  # leads no group: its ops are counted by the group leaders
        ops.extend(op for op in lay.schedule() if rank == min(op.group))
    return ops


def _unique_buckets(layouts: Dict[int, ShardingLayout]) -> list:
    seen, out = set(), []
    for rank in sorted(layouts):
        for b in layouts[rank].muon_buckets:
            key = (b.colour, b.group, b.owner, b.dtype)
            if key not in seen:
                seen.add(key)
                out.append((layouts[rank], b))
    return out


def _unique_partitions(layouts: Dict[int, ShardingLayout]) -> list:
    seen, out = set(), []
    for rank in sorted(layouts):
        lay = layouts[rank]
        for colour, part in lay.partitions.items():
            key = (colour, lay.groups[colour])
            if key not in seen:
                seen.add(key)
                out.append((colour, lay.groups[colour], part))
    return out


def _path(plan, stages, ab: AlphaBeta, settings: LayoutSettings, hierarchical: bool,
          backend: str = "nccl") -> Dict[str, Any]:
    gpn, world = plan.gpus_per_node, plan.world_size
    layouts = world_layouts(plan, stages, settings, hierarchical)
    path = CostPath("hierarchical" if hierarchical else "flat", world, gpn, ab, backend)
    buckets = _unique_buckets(layouts)
    for lay, b in buckets:
        colour = "dense" if b.colour is None else "moe"
        path.add_bound(colour, len({r // gpn for r in b.group}),
                       sum(b.param_bytes))
    path.replay((op, op.payload) for op in world_ops(layouts))
    summary = path.summary()

    state = [0] * world
    owned = [0] * world
    owned_dense = [0] * world
    dense_bytes = [0] * world
    rows = []
    for colour, group, part in _unique_partitions(layouts):
        for idx, r in enumerate(group):
            state[r] += part.state_bytes[idx]
    for lay, b in buckets:
        owned[b.owner] += len(b.params)
        if b.colour is None:
            owned_dense[b.owner] += len(b.params)
            dense_bytes[b.owner] += sum(b.param_bytes)
    for stage, sparams in enumerate(stages):
        lay = layouts[plan.sharding_group_ranks(stage)[0]]
        for colour, label in ((None, "dense"), (EXPERT_COLOUR, "moe")):
            part = lay.partitions.get(colour)
            if part is None:
                continue
            specs = [p.to_matrix_spec() for p in sparams
                     if p.use_muon and p.is_expert == (colour is not None)]
            row = {
                "colour": label, "stage": stage, "nranks": part.nranks,
                "num_params": len(part.owners), "num_buckets": part.num_buffers(),
                "state_bytes_max_over_mean": part.state_bytes_max_over_mean(),
                "state_floor": balance_floor(specs, part.nranks)[0],
            }
            if colour is not None:
                row = {**row, "groups": len({plan.moe_sharding_ranks(r)
                                             for r in plan.sharding_group_ranks(stage)})}
            rows.append(row)
    summary["optimizer_state_max_over_mean"] = max_over_mean(state)
    summary["num_buckets"] = {
        "dense": sum(1 for _, b in buckets if b.colour is None),
        "moe": sum(1 for _, b in buckets if b.colour is not None),
    }
    summary["num_other_buffers"] = len({
        (s.colour, s.group, s.dtype, s.params)
        for lay in layouts.values() for s in lay.slice_buffers
    })
    return {
        "summary": summary,
        "owned": owned,
        "owned_detail": {"dense": owned_dense,
                         "moe": [a - b for a, b in zip(owned, owned_dense)],
                         "dense_param_bytes": dense_bytes},
        "buckets": [
            {"colour": "dense" if b.colour is None else "moe",
             "stage": plan.stage_of(b.owner), "owner": b.owner, "dtype": b.dtype,
             "bytes": sum(b.param_bytes),
             "grad_chunks": len(b.reduce_numels()),
             "group_nodes": len({r // gpn for r in b.group}), "route": b.route_kind}
            for lay, b in buckets
        ],
        "partitions": rows,
        "layouts": layouts,
    }


def _group_facts(plan) -> Dict[str, Any]:
    gpn = plan.gpus_per_node
    moe = sorted({plan.moe_sharding_ranks(r) for r in range(plan.world_size)})
    specs = plan.group_specs()
    node = [s for s in specs if s.kind == "node"]
    same = [s for s in specs if s.kind == "same_card"]
    sharding = [plan.sharding_group_ranks(p) for p in range(plan.pp_degree)]
    return {
        "sharding": {"count": len(sharding), "size": len(sharding[0]),
                     "nodes_spanned": len({r // gpn for r in sharding[0]})},
        "moe_sharding": {"count": len(moe), "size": len(moe[0]),
                         "nodes_spanned": max(len({r // gpn for r in g}) for g in moe)},
        "node": {"count": len(node), "size": len(node[0].ranks)},
        "same_card": {"count": len(same), "size": len(same[0].ranks)},
    }


def _rule_figures(flat: Dict[str, Any], hier: Dict[str, Any]) -> Dict[str, Any]:
    h, f = hier["summary"], flat["summary"]
    return {
        "optimizer_state_max_over_mean": h["optimizer_state_max_over_mean"],
        "empty_ranks": sum(1 for n in hier["owned"] if n == 0),
        "hierarchical_inter_node_ratio_to_bound": h["inter_node_ratio_to_bound"],
        "hierarchical_rail_imbalance": h["rail_imbalance"],
        "hierarchical_estimated_time_s": h["estimated_time_s"],
        "flat_estimated_time_s": f["estimated_time_s"],
        "num_buckets": h["num_buckets"],
    }


def compute_plan(
    cfg: MuonCommConfig,
    ab: AlphaBeta = AlphaBeta(),
    buffer_size_MB: float = DEFAULT_BUFFER_MB,
    params: Optional[Sequence[presets.ParamSpec]] = None,
    comm_overlap: bool = False,
    partition_strategy: str = "balanced",
    compare_rules: bool = True,
    backend: str = "nccl",
) -> Dict[str, Any]:
    """Build every rank's layout of ``cfg`` and count one step of both paths.

    Args:
        cfg: the layout and model.
        ab: alpha-beta constants.
        buffer_size_MB: ``sharding_configs.comm_buffer_size_MB`` (0: unfused).
        params: parameter specs (default: ``cfg``'s model).
        comm_overlap: hooks launch the first reduce of each buffer (needs fused buffers).
        partition_strategy: the owner rule the figures use.
        compare_rules: also report the other rule's key figures (``partition_rules``).
        backend: collective algorithms, ``"nccl"`` rings or ``"gloo"`` as measured
            (:mod:`paddle_muon_ext.tools.gloo_model`).

    Returns:
        dict: JSON-ready apart from keys starting with ``_``.

    Raises:
        ValueError: invalid layout (the plan's message), model or options.
    """
    if comm_overlap and buffer_size_MB <= 0:
        raise ValueError(
            "--comm-overlap needs fused gradient buffers; --buffer-size-MB "
            f"{buffer_size_MB:g} turns them off (the optimizer refuses it too)."
        )
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    plan = cfg.build_plan()
    if params is None:
        params = cfg.load_params()
    stages = split_stages(params, cfg.pp)
    settings = LayoutSettings(comm_buffer_size_MB=buffer_size_MB, comm_overlap=comm_overlap,
                              partition_strategy=partition_strategy)
    flat = _path(plan, stages, ab, settings, False, backend)
    hier = _path(plan, stages, ab, settings, True, backend)
    f, h = flat["summary"], hier["summary"]
    muon = [p for p in params if p.use_muon]
    res: Dict[str, Any] = {
        "config": {
            "ep": cfg.ep, "moe_sharding": cfg.moe_sharding, "pp": cfg.pp,
            "gpus_per_node": plan.gpus_per_node, "order": list(cfg.order), "model": cfg.model,
            "buffer_size_MB": buffer_size_MB, "comm_overlap": comm_overlap,
            "partition_strategy": partition_strategy, "backend": backend,
        },
        "world_size": plan.world_size,
        "num_nodes": plan.num_nodes,
        "model_summary": {
            "params": len(params),
            "muon_params": len(muon),
            "muon_dense": sum(1 for p in muon if not p.is_expert),
            "muon_expert": sum(1 for p in muon if p.is_expert),
            "other_params": len(params) - len(muon),
        },
        "groups": _group_facts(plan),
        "alpha_beta": {
            "alpha_nvlink_s": ab.alpha_nvlink, "beta_nvlink_s_per_B": ab.beta_nvlink,
            "alpha_net_s": ab.alpha_net, "beta_net_s_per_B": ab.beta_net,
        },
        "flat": f,
        "hierarchical": h,
        "optimizer_state_max_over_mean": h["optimizer_state_max_over_mean"],
        "partitions": hier["partitions"],
        "owners_per_rank": {"flat": flat["owned"], "hierarchical": hier["owned"]},
        "owned_by_colour": {"flat": flat["owned_detail"], "hierarchical": hier["owned_detail"]},
        "buckets": {"flat": flat["buckets"], "hierarchical": hier["buckets"]},
        "hierarchical_over_flat": {
            "inter_node_bytes": ratio(h["inter_node_bytes"], f["inter_node_bytes"]),
            "estimated_time_s": ratio(h["estimated_time_s"], f["estimated_time_s"]),
            "estimated_muon_time_s": ratio(h["estimated_muon_time_s"],
                                           f["estimated_muon_time_s"]),
        },
    }
    targets = {
        "hierarchical_ratio_to_bound_max": TARGET_HIER_RATIO,
        "rail_imbalance_max": TARGET_RAIL_IMBALANCE,
        "hierarchical_ratio_to_bound": h["inter_node_ratio_to_bound"],
        "rail_imbalance": h["rail_imbalance"],
        "ratio_met": h["inter_node_ratio_to_bound"] <= TARGET_HIER_RATIO,
        "rail_met": h["rail_imbalance"] <= TARGET_RAIL_IMBALANCE,
    }
    targets["met"] = targets["ratio_met"] and targets["rail_met"]
    # Not part of the target (which covers all Muon-parameter traffic): the
    # dense cross-node phase alone, whose rails follow the dense owners' cards.
    dense_rail = h["by_colour"]["dense"]["rail_imbalance"]
    targets["dense_rail_imbalance"] = dense_rail
    targets["dense_rail_within"] = dense_rail <= TARGET_RAIL_IMBALANCE
    res["targets"] = targets
    rules = {partition_strategy: _rule_figures(flat, hier)}
    if compare_rules:
        for other in PARTITION_RULES:
            if other not in rules:
                o_settings = dataclasses.replace(settings, partition_strategy=other)
                rules[other] = _rule_figures(
                    _path(plan, stages, ab, o_settings, False, backend),
                    _path(plan, stages, ab, o_settings, True, backend),
                )
    res["partition_rules"] = rules
    res["plan_description"] = plan.describe()
    res["_plan"] = plan  # dropped before JSON output
    res["_layouts"] = {"flat": flat["layouts"], "hierarchical": hier["layouts"]}
    return res


def json_ready(res: Dict[str, Any]) -> Dict[str, Any]:
    """The result without its in-memory objects."""
    return {k: v for k, v in res.items() if not k.startswith("_")}


def predict_cluster(ccfg) -> Dict[str, Any]:
    """The gloo prediction for a ``cluster`` run's layout and model.

    Returns:
        dict: ``{"off": {...}, "on": {...}}`` with ``inter_node_bytes`` (every
        collective of a step) and the Muon bytes per path.
    """
    from . import cluster

    cfg = MuonCommConfig(ep=ccfg.ep, moe_sharding=ccfg.moe_sharding, pp=1,
                         gpus_per_node=ccfg.procs_per_node, model="cluster tiny MoE")
    params = [presets.ParamSpec(p["name"], tuple(p["shape"]), "float32", p["is_expert"],
                                p["use_muon"])
              for p in cluster.tiny_moe_params(ccfg.hidden, ccfg.inner)]
    res = compute_plan(cfg, AlphaBeta(), buffer_size_MB=cluster.WORKER_BUFFER_MB,
                       params=params, backend="gloo", compare_rules=False)
    return {
        tag: {"inter_node_bytes": res[path]["inter_node_bytes_all"],
              "muon_bytes": res[path]["inter_node_bytes"],
              "dense_muon_bytes": res[path]["by_colour"]["dense"]["inter_node_bytes"],
              "moe_muon_bytes": res[path]["by_colour"]["moe"]["inter_node_bytes"]}
        for tag, path in (("off", "flat"), ("on", "hierarchical"))
    }
