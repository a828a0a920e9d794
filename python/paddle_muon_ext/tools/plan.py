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

import dataclasses
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from ..distributed.fleet.meta_optimizers.muon_comm_plan import HierarchicalCommPlan
from ..distributed.fleet.meta_optimizers.muon_sharding_layout import (
    LayoutSettings,
    ShardingLayout,
)
from ..distributed.fleet.meta_optimizers.muon_sharding_types import (
    PHASE_INTRA_NODE_BROADCAST,
    PHASE_INTRA_NODE_REDUCE,
    canonical_dtype,
    itemsize,
)
from ..distributed.fleet.meta_optimizers.muon_sharding_options import (
    PARTITION_STRATEGIES,
    option_default,
)
from ..distributed.fleet.meta_optimizers.muon_sharding_owner_meta import (
    MatrixSpec,
)
from ..distributed.fleet.meta_optimizers.muon_sharding_partition import (
    balance_floor,
)
from . import presets
from .args import DEFAULT_BUFFER_MB, MuonCommConfig
from .cost_model import BACKENDS, AlphaBeta, CostPath, max_over_mean, ratio

__all__ = [
    "EXPERT_COLOUR",
    "PARTITION_RULES",
    "TARGET_HIER_RATIO",
    "TARGET_RAIL_IMBALANCE",
    "WorldByClass",
    "compute_plan",
    "group_class_key",
    "predict_cluster",
    "split_stages",
]

#: Targets of the hierarchical path (checked on every run, printed with the table).
TARGET_HIER_RATIO = 1.01
TARGET_RAIL_IMBALANCE = 1.05
#: Colour key of expert parameters (the MoE models' convention).
EXPERT_COLOUR = "moe_expert"
#: Partition rules reported side by side (the option table's choices; the
#: default, as the optimizer's, is the option table's: develop's rule).
PARTITION_RULES = PARTITION_STRATEGIES


class FlatPathPlan(HierarchicalCommPlan):
    """The layout's groups without ``comm_group_call_opt``'s node preconditions.

    The flat path reduces straight to each owner, so a single node or one
    card per node is a valid layout for it; only the hierarchical path needs
    several nodes of equal stages.
    """

    @staticmethod
    def _check_gpus_per_node(gpus_per_node: Any) -> int:
        # one card per node is a valid flat layout (the tools checked >= 1)
        return int(gpus_per_node)

    @staticmethod
    def _check_nodes(*_args: Any) -> None:
        return None


def build_layout_plan(cfg: MuonCommConfig, group_call: bool = True) -> HierarchicalCommPlan:
    """The plan of ``cfg``: validated for the hierarchical path, or flat-only.

    Raises:
        ValueError: the layout cannot be placed (the message says why and what works).
    """
    if group_call:
        return cfg.build_plan()
    if cfg.world_size % cfg.gpus_per_node:
        raise ValueError(
            f"world size {cfg.world_size} (pp x moe_sharding x ep = {cfg.pp} x "
            f"{cfg.moe_sharding} x {cfg.ep}) is not a multiple of --gpus-per-node "
            f"{cfg.gpus_per_node}, so the ranks do not fill whole nodes; pass the cards of "
            "one node")
    return FlatPathPlan.from_topology(cfg.build_topology(), cfg.gpus_per_node)


def _pbytes(p: presets.ParamSpec) -> int:
    # the layout's ParamMeta.nbytes, without building a ParamMeta (100,000 of them)
    return p.numel * itemsize(canonical_dtype(p.dtype))


def split_stages(params: Sequence[presets.ParamSpec], pp: int) -> List[List[presets.ParamSpec]]:
    """Contiguous split in model order at equal cumulative parameter bytes."""
    stages: List[List[presets.ParamSpec]] = [[] for _ in range(pp)]
    sizes = [_pbytes(p) for p in params]  # once each: 200,000 entries are read twice
    total = sum(sizes) or 1
    before = 0
    for p, b in zip(params, sizes):
        mid = before + b / 2.0
        stages[min(pp - 1, int(mid * pp // total))].append(p)
        before += b
    return stages


class _Stage(list):
    """One pipeline stage's parameters, with what every path derives from them
    computed once: ``compute_plan`` builds four paths (two rules, flat and
    hierarchical) of the same stages, and on 200,000 parameters these views
    and the balance floors were a third of its time."""

    def __init__(self, params: Sequence[presets.ParamSpec]) -> None:
        super().__init__(params)
        self._metas: Optional[list] = None
        self._specs: Dict[bool, list] = {}
        self._floors: Dict[Tuple[bool, int], Any] = {}

    def metas(self) -> list:
        """The layout's view of every parameter (:meth:`ParamSpec.to_meta`)."""
        if self._metas is None:
            self._metas = [p.to_meta(EXPERT_COLOUR) for p in self]
        return self._metas

    def floor(self, expert: bool, nranks: int):
        """:func:`balance_floor` of the stage's Muon matrices of one colour."""
        key = (expert, nranks)
        if key not in self._floors:
            if expert not in self._specs:
                # from the metas (built once): the same name, shape and dtype
                # as ParamSpec.to_matrix_spec, without a second conversion
                colour = EXPERT_COLOUR if expert else None
                self._specs[expert] = [MatrixSpec(m.name, m.shape, m.dtype)
                                       for m in self.metas()
                                       if m.use_muon and m.colour == colour]
            self._floors[key] = balance_floor(self._specs[expert], nranks)
        return self._floors[key]


def _metas(sparams: Sequence[presets.ParamSpec]) -> list:
    return (sparams.metas() if isinstance(sparams, _Stage)
            else [p.to_meta(EXPERT_COLOUR) for p in sparams])


def _floor(sparams: Sequence[presets.ParamSpec], expert: bool, nranks: int):
    if isinstance(sparams, _Stage):
        return sparams.floor(expert, nranks)
    return balance_floor([p.to_matrix_spec() for p in sparams
                          if p.use_muon and p.is_expert == expert], nranks)


class _Bucket(NamedTuple):
    """What the report needs of one Muon bucket of the world."""

    colour: Any
    group: Tuple[int, ...]
    owner: int
    dtype: str
    num_params: int
    nbytes: int
    grad_chunks: int
    route: str


def _bucket(b, group=None, owner=None) -> _Bucket:
    """``b``'s figures; ``group``/``owner`` rename it onto another group of its class."""
    return _Bucket(b.colour, b.group if group is None else group,
                   b.owner if owner is None else owner, b.dtype, len(b.params),
                   sum(b.param_bytes), len(b.reduce_numels()), b.route_kind)


def group_class_key(group: Sequence[int], gpn: int) -> tuple:
    """Which entries share a node (nodes numbered in order) and each entry's
    place among its node's entries.

    Two groups with the same key issue the same collectives up to renaming
    entry ``i`` onto entry ``i``, and the renaming keeps whether each byte
    crosses nodes and the order of the cost model's rings; the rail of a byte
    is the sender's own card (:meth:`CostPath.replay_class` charges each copy
    to its own ranks' rails).
    """
    nodes: Dict[int, List[int]] = {}
    for r in sorted(group):
        nodes.setdefault(r // gpn, []).append(r)
    order = {n: i for i, n in enumerate(sorted(nodes))}
    place = {r: j for members in nodes.values() for j, r in enumerate(members)}
    return tuple((order[r // gpn], place[r]) for r in group)


@dataclasses.dataclass
class WorldByClass:
    """One path's collectives and owners, computed per class of rank.

    The layout of a rank depends only on its stage, its moe_sharding group
    and its card; the group collectives of a step are those issued by each
    group's lowest rank. So only the first node of each stage (which leads
    the stage's sharding group, its same-card groups and, as the template of
    all the stage's nodes, the intra-node ones) and the lowest rank of one
    moe_sharding group per class (:func:`group_class_key`) get a layout;
    every other node and moe_sharding group is charged as a copy of its
    class's template.

    Attributes:
        buckets: every Muon bucket once, in the order the ranks meet them.
        ops: ``(leader, index, op)`` of ops charged once, ``index`` in the
            leader's schedule.
        classes: ``(members, [(leader, index, op)])``: ops of the template
            ``members[0]``, charged for every member.
        partitions: ``(group, OwnerPartition)`` of every colour group.
        stage_partitions: per stage, colour -> the partition of the stage's
            groups of that colour.
        num_other_buffers: distinct element-wise buffers of the world.
    """

    buckets: List[_Bucket]
    ops: List[tuple]
    classes: List[tuple]
    partitions: List[tuple]
    stage_partitions: List[dict]
    num_other_buffers: int

    @classmethod
    def build(cls, plan, stages: Sequence[Sequence[presets.ParamSpec]],
              settings: LayoutSettings, hierarchical: bool) -> "WorldByClass":
        gpn = plan.gpus_per_node
        world = cls([], [], [], [], [], 0)
        entities = []  # (first rank, colour position, buckets)
        for stage, sparams in enumerate(stages):
            metas = _metas(sparams)
            dense = plan.sharding_group_ranks(stage)
            node0 = plan.node_ranks(min(dense) // gpn)
            moe_groups: Dict[int, Tuple[int, ...]] = {}
            for r in sorted(dense):
                group = plan.moe_sharding_ranks(r)
                moe_groups.setdefault(group[0], group)
            members: Dict[tuple, List[Tuple[int, ...]]] = {}
            for group in moe_groups.values():
                members.setdefault(group_class_key(group, gpn), []).append(group)
            templates = {m[0][0]: m for m in members.values()}  # leader -> members
            node_class: List[tuple] = []
            moe_class: Dict[int, List[tuple]] = {t: [] for t in templates}
            # Full layouts where a stage's sharding group or a moe_sharding class is
            # led; the other ranks of the first node only lead their same-card
            # group, whose collectives the default colour alone decides: they
            # take the stage's default-colour layout renamed (ranks of one group
            # share it, as the optimizer's layouts do). The sharding group's leader
            # is its lowest rank: on the flat path a node may hold several stages
            # (--no-group-call), so not node0[0].
            full = {min(dense)} | {min(m[0]) for m in members.values()}
            dense_only = sorted(set(node0) - full) if hierarchical else []
            dense_layout = None
            lay0 = None
            # id(group tuple) -> (the tuple, kept alive so its id stays unique; its lowest rank)
            lowest: Dict[int, Tuple[tuple, int]] = {}
            for rank in sorted(full | set(dense_only)):
                moe = plan.moe_sharding_ranks(rank)
                if rank in full:
                    lay = ShardingLayout.build(metas, {None: dense, EXPERT_COLOUR: moe}, rank,
                                               settings, plan if hierarchical else None)
                    lay0 = lay0 or lay
                else:
                    if dense_layout is None:
                        if lay0 is not None and not lay0.staged_sync:
                            # the lowest rank's layout holds the same default-colour
                            # buckets (one cached placement); without a staged sync
                            # the schedule reads nothing else of it
                            dense_layout = dataclasses.replace(
                                lay0, groups={None: dense}, muon_buckets=[
                                    b for b in lay0.muon_buckets if b.colour is None])
                        else:
                            dense_layout = ShardingLayout.build(
                                [m for m in metas if m.colour is None], {None: dense},
                                min(dense), settings, plan)
                    # This rank leads only its same-card group, whose ops are the
                    # cross-node steps of the buckets owned on its card: keep those
                    # buckets (their order, so their ops' order) and drop the rest,
                    # which this rank would schedule only to skip.
                    card = rank % gpn
                    lay = dataclasses.replace(
                        dense_layout, rank=rank, slice_buffers=[],
                        muon_buckets=[b for b in dense_layout.muon_buckets
                                      if b.owner % gpn == card])
                for idx, op in enumerate(lay.schedule()):
                    seen = lowest.get(id(op.group))
                    if seen is None:
                        seen = lowest[id(op.group)] = (op.group, min(op.group))
                    if rank != seen[1]:
                        continue  # another rank leads this group
                    item = (rank, idx, op)
                    if op.phase in (PHASE_INTRA_NODE_REDUCE, PHASE_INTRA_NODE_BROADCAST):
                        if rank == node0[0]:
                            node_class.append(item)
                    elif op.colour is None:
                        world.ops.append(item)  # the sharding group or a same-card group
                    elif moe[0] in moe_class:
                        moe_class[moe[0]].append(item)
                if rank in full and moe[0] in templates and rank == min(moe):
                    t_index = {r: i for i, r in enumerate(moe)}
                    t_buckets = [b for b in lay.muon_buckets if b.colour is not None]
                    for group in templates[moe[0]]:
                        entities.append((min(group), list(lay.partitions).index(EXPERT_COLOUR)
                                         if t_buckets else 0, sorted(
                            _bucket(b, group, group[t_index[b.owner]]) for b in t_buckets)))
            if node_class:
                world.classes.append(
                    ([plan.node_ranks(n) for n in plan.nodes_of_stage(stage)], node_class))
            world.classes.extend((templates[t], ops) for t, ops in moe_class.items() if ops)
            colours = list(lay0.partitions)
            if None in lay0.partitions:
                entities.append((min(dense), colours.index(None),
                                 [_bucket(b) for b in lay0.muon_buckets if b.colour is None]))
                world.partitions.append((dense, lay0.partitions[None]))
            if EXPERT_COLOUR in lay0.partitions:
                part = lay0.partitions[EXPERT_COLOUR]
                world.partitions.extend((g, part) for g in moe_groups.values())
            world.stage_partitions.append(dict(lay0.partitions))
            world.num_other_buffers += sum(1 for s in lay0.slice_buffers if s.colour is None)
            world.num_other_buffers += len(moe_groups) * sum(
                1 for s in lay0.slice_buffers if s.colour is not None)
        entities.sort(key=lambda e: e[:2])
        world.buckets = [b for e in entities for b in e[2]]
        return world


def _path(plan, stages, ab: AlphaBeta, settings: LayoutSettings, hierarchical: bool,
          backend: str = "nccl") -> Dict[str, Any]:
    gpn, world = plan.gpus_per_node, plan.world_size
    by_class = WorldByClass.build(plan, stages, settings, hierarchical)
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
        key=lambda item: item[:2]))
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
                "num_params": len(part.owners), "num_buckets": part.num_buffers(),
                "state_bytes_max_over_mean": part.state_bytes_max_over_mean(),
                "state_floor": _floor(sparams, colour is not None, part.nranks)[0],
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
    moe = plan.moe_sharding_groups()
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
    if comm_overlap and buffer_size_MB <= 0:
        raise ValueError(
            "--comm-overlap needs fused gradient buffers; --buffer-size-MB "
            f"{buffer_size_MB:g} turns them off (the optimizer refuses it too)."
        )
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    plan = build_layout_plan(cfg, group_call)
    if params is None:
        params = cfg.load_params()
    stages = [_Stage(s) for s in split_stages(params, cfg.pp)]
    settings = LayoutSettings(comm_buffer_size_MB=buffer_size_MB, comm_overlap=comm_overlap,
                              partition_strategy=partition_strategy)
    flat = _path(plan, stages, ab, settings, False, backend)
    if not group_call:
        return _flat_only(cfg, plan, params, stages, ab, settings, backend, flat,
                          compare_rules)
    hier = _path(plan, stages, ab, settings, True, backend)
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
    rules = _compare_rules(plan, stages, ab, settings, backend, flat, hier, compare_rules)
    res["partition_rules"] = rules
    res["plan_description"] = plan.describe()
    res["_plan"] = plan  # dropped before JSON output
    res["_stages"], res["_cfg"] = stages, cfg  # shared with tools.recommend: built once
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
                   compare_rules: bool) -> Dict[str, Any]:
    """Figures of the chosen partition rule, and of every other rule if asked."""
    rules = {settings.partition_strategy: _rule_figures(flat, hier)}
    if compare_rules:
        for other in PARTITION_RULES:
            if other not in rules:
                o_settings = dataclasses.replace(settings, partition_strategy=other)
                rules[other] = _rule_figures(
                    _path(plan, stages, ab, o_settings, False, backend),
                    None if hier is None else _path(plan, stages, ab, o_settings, True, backend),
                )
    return rules


def _flat_only(cfg: MuonCommConfig, plan, params, stages, ab: AlphaBeta,
               settings: LayoutSettings, backend: str, flat: Dict[str, Any],
               compare_rules: bool) -> Dict[str, Any]:
    """compute_plan's result for the flat path alone (``group_call=False``)."""
    f = flat["summary"]
    rules = _compare_rules(plan, stages, ab, settings, backend, flat, None, compare_rules)
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
    from . import cluster

    cfg = MuonCommConfig(ep=ccfg.ep, moe_sharding=ccfg.moe_sharding, pp=1,
                         gpus_per_node=ccfg.procs_per_node, model="cluster tiny MoE")
    params = [presets.ParamSpec(p["name"], tuple(p["shape"]), "float32", p["is_expert"],
                                p["use_muon"])
              for p in cluster.tiny_moe_params(ccfg.hidden, ccfg.inner)]
    group_call = getattr(ccfg, "group_call", "both") != "0"
    res = compute_plan(cfg, AlphaBeta(), buffer_size_MB=cluster.WORKER_BUFFER_MB,
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
