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
"""``plan``'s layouts, computed once per class of rank.

:func:`build_layout_plan` builds the layout plan of a configuration (flat
only, or validated for the hierarchical path); :func:`split_stages` splits
the model over the pipeline stages; :class:`WorldByClass` builds the
:class:`ShardingLayout` of one rank per class (the first node of each stage,
one moe_sharding group per class, :func:`group_class_key`) and lists the
group collectives each class issues, for :mod:`.plan` to charge to the cost
model.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from ..distributed.fleet.meta_optimizers.muon_sharding.comm_plan import HierarchicalCommPlan
from ..distributed.fleet.meta_optimizers.muon_sharding.layout import LayoutSettings, ShardingLayout
from ..distributed.fleet.meta_optimizers.muon_sharding.owners import (
    MatrixSpec,
    newton_schulz_cost,
    optimizer_state_bytes,
)
from ..distributed.fleet.meta_optimizers.muon_sharding.step_plan import (
    PHASE_INTRA_NODE_BROADCAST,
    PHASE_INTRA_NODE_REDUCE,
)
from ..distributed.fleet.meta_optimizers.muon_sharding.settings import canonical_dtype, itemsize
from . import presets
from .args import MuonCommConfig
from .fast_layout import FastPlacement

__all__ = ["EXPERT_COLOUR", "FlatPathPlan", "Stage", "WorldByClass", "balance_floor",
           "build_layout_plan", "group_class_key", "split_stages", "stage_floor", "stage_metas"]

#: Colour key of expert parameters (the MoE models' convention).
EXPERT_COLOUR = "moe_expert"


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


class Stage(list):
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


def _floor_ratio(values: List[int], nranks: int) -> float:
    """Lower bound of max/mean over any assignment of whole items: for every
    m, some rank receives at least ceil(m/nranks) of the m largest items, so
    its load is at least the sum of the ceil(m/nranks) smallest of them."""
    total = sum(values)
    if total <= 0:
        return 1.0
    prefix = [0, *itertools.accumulate(sorted(values, reverse=True))]
    best = max(prefix[m] - prefix[m - -(-m // nranks)] for m in range(1, len(prefix)))
    return max(1.0, best * nranks / total)


def balance_floor(specs: Sequence[MatrixSpec], nranks: int, multi_precision: bool = True):
    """Lower bounds on (state max/mean, NS max/mean) that *any* whole-matrix
    partition must reach (largest matrices against the mean share, including
    the granularity of many equal matrices); the figures a target can be
    checked against before calling it missed."""
    # NS costs as ints, as the owner rules sum them (a float sum could round)
    return (_floor_ratio([optimizer_state_bytes(s, multi_precision) for s in specs], nranks),
            _floor_ratio([int(newton_schulz_cost(s.shape)) for s in specs], nranks))


def stage_metas(sparams: Sequence[presets.ParamSpec]) -> list:
    """The layout's view of a stage's parameters (built once for a :class:`Stage`)."""
    return (sparams.metas() if isinstance(sparams, Stage)
            else [p.to_meta(EXPERT_COLOUR) for p in sparams])


def stage_floor(sparams: Sequence[presets.ParamSpec], expert: bool, nranks: int):
    """:func:`balance_floor` of a stage's Muon matrices of one colour (once for a :class:`Stage`)."""
    if isinstance(sparams, Stage):
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
                   sum(b.param_bytes), len(b.chunks or b.params), b.route_kind)


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
              settings: LayoutSettings, hierarchical: bool,
              placement: Optional[FastPlacement] = None) -> "WorldByClass":
        gpn = plan.gpus_per_node
        placement = FastPlacement() if placement is None else placement
        world = cls([], [], [], [], [], 0)
        entities = []  # (first rank, colour position, buckets)
        for stage, sparams in enumerate(stages):
            metas = stage_metas(sparams)
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
                                               settings, plan if hierarchical else None,
                                               placement=placement)
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
                                min(dense), settings, plan, placement=placement)
                    # This rank leads only its same-card group, whose ops are the
                    # cross-node steps of the buckets owned on its card: keep those
                    # buckets (their order, so their ops' order) and drop the rest,
                    # which this rank would schedule only to skip.
                    card = rank % gpn
                    lay = dataclasses.replace(
                        dense_layout, rank=rank, slice_buffers=[],
                        muon_buckets=[b for b in dense_layout.muon_buckets
                                      if b.owner % gpn == card])
                prev_group, leads = None, False
                for idx, op in enumerate(lay.schedule()):
                    group = op.group
                    if group is not prev_group:
                        # a phase's ops share its group object: looked up once a run
                        seen = lowest.get(id(group))
                        if seen is None:
                            seen = lowest[id(group)] = (group, min(group))
                        prev_group, leads = group, rank == seen[1]
                    if not leads:
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
