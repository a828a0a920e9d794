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

The tool builds the :class:`ShardingLayout` the optimizer would build (from
parameter specs instead of parameters) for the flat path
(``comm_group_call_opt`` off) and the hierarchical path (on), takes each
group collective of the layouts' schedules once, and charges it to the
:mod:`cost_model`. Ranks are symmetric, so layouts are built per class
(:class:`WorldByClass`: the first node of each stage, one moe_sharding group
per class) and the other nodes and groups are charged as copies: the cost
grows with the world size, not its square. With pp > 1 the parameter list is split over the stages in
model order at equal cumulative bytes (a stand-in for the pipeline's layer
split); expert parameters take the MoE colour (their moe_sharding group).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import operator
from typing import Any, Dict, Optional, Sequence, Tuple

from ..distributed.fleet.meta_optimizers.muon_sharding.layout import LayoutSettings
from ..distributed.fleet.meta_optimizers.muon_sharding.settings import (
    PARTITION_BALANCED,
    PARTITION_RAIL,
    PARTITION_STRATEGIES,
    option_default,
)
from . import limits, presets
from .args import DEFAULT_BUFFER_MB, MuonCommConfig
from .cost_model import BACKENDS, AlphaBeta, CostPath, max_over_mean, ratio
from .fast_layout import FastPlacement
from .plan_world import (
    EXPERT_COLOUR,
    Stage,
    WorldByClass,
    build_layout_plan,
    split_stages,
    stage_floor,
)

__all__ = [
    "FLAT_RULES",
    "PARTITION_RULES",
    "TARGET_HIER_RATIO",
    "TARGET_RAIL_IMBALANCE",
    "compute_plan",
    "json_ready",
    "paused_gc",
    "predict_cluster",
]

#: Targets of the hierarchical path (checked on every run, printed with the table).
TARGET_HIER_RATIO = 1.01
TARGET_RAIL_IMBALANCE = 1.05
#: Partition rules reported side by side (the option table's choices; the
#: default, as the optimizer's, is the option table's: develop's rule).
PARTITION_RULES = PARTITION_STRATEGIES
#: The rules every ``plan`` reports side by side: develop's and ``balanced``.
#: ``rail`` is ``balanced`` on the flat path and costs one more hierarchical
#: path on large models (``plan`` on 100,000 matrices x 1,024 ranks: 6.8 ->
#: 9.5 s), so it is reported where asked for: ``--partition rail`` and
#: ``--recommend`` (a candidate wherever it applies).
FLAT_RULES = tuple(r for r in PARTITION_RULES if r != PARTITION_RAIL)


def _path(plan, stages, ab: AlphaBeta, settings: LayoutSettings, hierarchical: bool,
          backend: str = "nccl", placement: Optional[FastPlacement] = None) -> Dict[str, Any]:
    # placement: the run's memos, shared by its paths (a fresh one: none shared)
    placement = FastPlacement() if placement is None else placement
    gpn, world = plan.gpus_per_node, plan.world_size
    by_class = WorldByClass.build(plan, stages, settings, hierarchical, placement)
    path = CostPath("hierarchical" if hierarchical else "flat", world, gpn, ab, backend)
    # Groups of one colour are disjoint, and a moe_sharding group as long as
    # the sharding group is the sharding group: (first rank, size) names a group.
    spans: Dict[Tuple[int, int], int] = {}

    def nodes_spanned(group) -> int:
        key = (group[0], len(group))
        if key not in spans:
            spans[key] = len({r // gpn for r in group})
        return spans[key]

    for b in by_class.buckets:
        path.add_bound("dense" if b.colour is None else "moe", nodes_spanned(b.group), b.nbytes)
    path.declare(op for _, _, op in sorted(
        by_class.ops + [item for _, items in by_class.classes for item in items],
        key=operator.itemgetter(0, 1)))
    path.replay((op, op.payload) for _, _, op in by_class.ops)
    for members, items in by_class.classes:
        path.replay_class([(op, op.payload) for _, _, op in items], members)
    summary = path.summary()

    state = [0] * world
    owned = [0] * world
    owned_dense = [0] * world
    dense_bytes = [0] * world
    rows = []
    for group, part in by_class.partitions:
        for idx, r in enumerate(group):
            state[r] += part.state_bytes[idx]
    for b in by_class.buckets:
        owned[b.owner] += b.num_params
        if b.colour is None:
            owned_dense[b.owner] += b.num_params
            dense_bytes[b.owner] += b.nbytes
    for stage, sparams in enumerate(stages):
        parts = by_class.stage_partitions[stage]
        for colour, label in ((None, "dense"), (EXPERT_COLOUR, "moe")):
            part = parts.get(colour)
            if part is None:
                continue
            row = {
                "colour": label, "stage": stage, "nranks": part.nranks,
                "num_params": len(part.owners), "num_buckets": placement.num_buffers(part),
                "state_bytes_max_over_mean": max_over_mean(part.state_bytes),
                "state_floor": stage_floor(sparams, colour is not None, part.nranks)[0],
            }
            if colour is not None:
                row = {**row, "groups": len(plan.sharding_group_ranks(stage)) // part.nranks}
            rows.append(row)
    summary["optimizer_state_max_over_mean"] = max_over_mean(state)
    summary["num_buckets"] = {
        "dense": sum(1 for b in by_class.buckets if b.colour is None),
        "moe": sum(1 for b in by_class.buckets if b.colour is not None),
    }
    summary["num_other_buffers"] = by_class.num_other_buffers
    return {
        "summary": summary,
        "owned": owned,
        "owned_detail": {"dense": owned_dense,
                         "moe": [a - b for a, b in zip(owned, owned_dense)],
                         "dense_param_bytes": dense_bytes},
        "buckets": [
            {"colour": "dense" if b.colour is None else "moe",
             "stage": plan.stage_of(b.owner), "owner": b.owner, "dtype": b.dtype,
             "bytes": b.nbytes, "grad_chunks": b.grad_chunks,
             "group_nodes": nodes_spanned(b.group), "route": b.route}
            for b in by_class.buckets
        ],
        "partitions": rows,
    }


def _group_facts(plan) -> Dict[str, Any]:
    gpn = plan.gpus_per_node
    moe = list(dict.fromkeys(plan.moe_sharding_ranks(r) for r in range(plan.world_size)))
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


def _rule_figures(flat: Dict[str, Any], hier: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    f = flat["summary"]
    if hier is None:  # --no-group-call: the flat path's figures only
        return {
            "optimizer_state_max_over_mean": f["optimizer_state_max_over_mean"],
            "empty_ranks": sum(1 for n in flat["owned"] if n == 0),
            "flat_estimated_time_s": f["estimated_time_s"],
            "num_buckets": f["num_buckets"],
        }
    h = hier["summary"]
    return {
        "optimizer_state_max_over_mean": h["optimizer_state_max_over_mean"],
        "empty_ranks": sum(1 for n in hier["owned"] if n == 0),
        "hierarchical_inter_node_ratio_to_bound": h["inter_node_ratio_to_bound"],
        "hierarchical_rail_imbalance": h["rail_imbalance"],
        "hierarchical_estimated_time_s": h["estimated_time_s"],
        "flat_estimated_time_s": f["estimated_time_s"],
        "num_buckets": h["num_buckets"],
    }


@contextlib.contextmanager
def paused_gc():
    """Run the block with Python's cyclic garbage collector off (as it was after).

    A plan allocates millions of small objects that stay alive until it ends
    (specs, buckets, the ops of every schedule: 900,000 of them under ``plan
    --recommend`` on 100,000 matrices x 1,024 ranks), so each collection
    the allocations trigger walked an ever larger heap: 40 % of that run's
    CPU (19.5 -> 11.5 s). The objects form no reference cycles worth
    collecting (reference counting frees them; the peak RSS is the same, 420
    MB). Nests: an inner block leaves a collector it found off alone.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@paused_gc()
def compute_plan(
    cfg: MuonCommConfig,
    ab: AlphaBeta = AlphaBeta(),
    buffer_size_MB: float = DEFAULT_BUFFER_MB,
    params: Optional[Sequence[presets.ParamSpec]] = None,
    comm_overlap: bool = False,
    partition_strategy: str = option_default("muon_partition_strategy"),
    compare_rules: bool = True,
    backend: str = "nccl",
    group_call: bool = True,
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
        group_call: also count the hierarchical path (``comm_group_call_opt``
            on); False counts the flat path alone, for any layout (the
            hierarchical keys are then None).

    Returns:
        dict: JSON-ready apart from keys starting with ``_``.

    Raises:
        ValueError: invalid layout (the plan's message), model or options.
    """
    # what the optimizer refuses is not planned (its own rule)
    limits.check_optimizer_accepts(cfg.pp, comm_overlap, buffer_size_MB, partition_strategy)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    plan = build_layout_plan(cfg, group_call)
    if params is None:
        params = cfg.load_params()
    stages = [Stage(s) for s in split_stages(params, cfg.pp)]
    settings = LayoutSettings(comm_buffer_size_MB=buffer_size_MB, comm_overlap=comm_overlap,
                              partition_strategy=partition_strategy)
    placement = FastPlacement()  # this run's memos: every path shares them
    flat = _path(plan, stages, ab, settings, False, backend, placement)
    if not group_call:
        return _flat_only(cfg, plan, params, stages, ab, settings, backend, flat,
                          compare_rules, placement)
    hier = _path(plan, stages, ab, settings, True, backend, placement)
    f, h = flat["summary"], hier["summary"]
    res: Dict[str, Any] = {
        **_header(cfg, plan, params, ab, settings, backend, group_call=True,
                  groups=_group_facts(plan)),
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
    rules = _compare_rules(plan, stages, ab, settings, backend, flat, hier, compare_rules,
                           placement)
    res["partition_rules"] = rules
    res["plan_description"] = plan.describe()
    res["_plan"] = plan  # dropped before JSON output
    res["_stages"], res["_cfg"] = stages, cfg  # shared with tools.recommend: built once
    res["_placement"] = placement
    return res


def _header(cfg: MuonCommConfig, plan, params, ab: AlphaBeta, settings: LayoutSettings,
            backend: str, group_call: bool, groups: Dict[str, Any]) -> Dict[str, Any]:
    """The result's config, world, model summary, groups and alpha-beta (both paths)."""
    muon = [p for p in params if p.use_muon]
    return {
        "config": {
            "ep": cfg.ep, "moe_sharding": cfg.moe_sharding, "pp": cfg.pp,
            "gpus_per_node": plan.gpus_per_node, "order": list(cfg.order), "model": cfg.model,
            "buffer_size_MB": settings.comm_buffer_size_MB,
            "comm_overlap": settings.comm_overlap,
            "partition_strategy": settings.partition_strategy, "backend": backend,
            "group_call": group_call,
        },
        "world_size": plan.world_size,
        "num_nodes": plan.num_nodes,
        "model_summary": {
            "params": len(params), "muon_params": len(muon),
            "muon_dense": sum(1 for p in muon if not p.is_expert),
            "muon_expert": sum(1 for p in muon if p.is_expert),
            "other_params": len(params) - len(muon),
        },
        "groups": groups,
        "alpha_beta": {
            "alpha_nvlink_s": ab.alpha_nvlink, "beta_nvlink_s_per_B": ab.beta_nvlink,
            "alpha_net_s": ab.alpha_net, "beta_net_s_per_B": ab.beta_net,
        },
    }


def _compare_rules(plan, stages, ab: AlphaBeta, settings: LayoutSettings, backend: str,
                   flat: Dict[str, Any], hier: Dict[str, Any] | None,
                   compare_rules: bool, placement: FastPlacement) -> Dict[str, Any]:
    """Figures of the chosen partition rule, and of every other rule if asked."""
    rules = {settings.partition_strategy: _rule_figures(flat, hier)}
    # rail's flat path is balanced's (the same owners): counted once
    flats = {_flat_rule(settings.partition_strategy): flat}
    if compare_rules:
        for other in FLAT_RULES:
            if other not in rules:
                o_settings = dataclasses.replace(settings, partition_strategy=other)
                o_flat = flats.get(_flat_rule(other))
                if o_flat is None:
                    o_flat = flats[other] = _path(plan, stages, ab, o_settings, False, backend,
                                                  placement)
                rules[other] = _rule_figures(
                    o_flat,
                    None if hier is None else _path(plan, stages, ab, o_settings, True, backend,
                                                    placement),
                )
    return rules


def _flat_rule(rule: str) -> str:
    # the rule whose owners ``rule`` gives on the flat path
    return PARTITION_BALANCED if rule == PARTITION_RAIL else rule


def _flat_only(cfg: MuonCommConfig, plan, params, stages, ab: AlphaBeta,
               settings: LayoutSettings, backend: str, flat: Dict[str, Any],
               compare_rules: bool, placement: FastPlacement) -> Dict[str, Any]:
    """compute_plan's result for the flat path alone (``group_call=False``)."""
    f = flat["summary"]
    rules = _compare_rules(plan, stages, ab, settings, backend, flat, None, compare_rules,
                           placement)
    return {
        **_header(cfg, plan, params, ab, settings, backend, group_call=False,
                  groups={k: v for k, v in _group_facts(plan).items()
                          if k in ("sharding", "moe_sharding")}),
        "flat": f,
        "hierarchical": None,
        "optimizer_state_max_over_mean": f["optimizer_state_max_over_mean"],
        "partitions": flat["partitions"],
        "owners_per_rank": {"flat": flat["owned"], "hierarchical": None},
        "owned_by_colour": {"flat": flat["owned_detail"], "hierarchical": None},
        "buckets": {"flat": flat["buckets"], "hierarchical": None},
        "hierarchical_over_flat": None,
        "targets": None,
        "partition_rules": rules,
        "plan_description": None,
        "_plan": plan,
        "_stages": stages,  # shared with tools.recommend: built once
        "_cfg": cfg,
        "_placement": placement,
    }


def json_ready(res: Dict[str, Any]) -> Dict[str, Any]:
    """The result without its in-memory objects and without the project's
    benchmark targets (``targets``: the benches' pass marks, not a verdict on
    a user's layout)."""
    return {k: v for k, v in res.items() if not k.startswith("_") and k != "targets"}


def predict_cluster(ccfg) -> Dict[str, Any]:
    """The gloo prediction for a ``cluster`` run's layout and model.

    Returns:
        dict: ``{"off": {...}, "on": {...}}`` with ``inter_node_bytes`` (every
        collective of a step) and the Muon bytes per path; no ``"on"`` when
        the run trains the flat path alone (``--group-call 0``).
    """
    from . import cluster_run

    cfg = MuonCommConfig(ep=ccfg.ep, moe_sharding=ccfg.moe_sharding, pp=1,
                         gpus_per_node=ccfg.procs_per_node, model="cluster tiny MoE")
    params = [presets.ParamSpec(p["name"], tuple(p["shape"]), "float32", p["is_expert"],
                                p["use_muon"])
              for p in cluster_run.tiny_moe_params(ccfg.hidden, ccfg.inner)]
    group_call = getattr(ccfg, "group_call", "both") != "0"
    res = compute_plan(cfg, AlphaBeta(), buffer_size_MB=cluster_run.WORKER_BUFFER_MB,
                       params=params, backend="gloo", compare_rules=False,
                       group_call=group_call)
    paths = (("off", "flat"), ("on", "hierarchical")) if group_call else (("off", "flat"),)
    return {
        tag: {"inter_node_bytes": res[path]["inter_node_bytes_all"],
              "muon_bytes": res[path]["inter_node_bytes"],
              "dense_muon_bytes": res[path]["by_colour"]["dense"]["inter_node_bytes"],
              "moe_muon_bytes": res[path]["by_colour"]["moe"]["inter_node_bytes"]}
        for tag, path in paths
    }
