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
"""Layouts the suites share: a Muon ``ParamMeta`` shorthand, rank 5 of a two-node
hierarchical layout, and the comm_group_call_opt schedule the oracle predicts
(this package's layout and plan modules: these helpers do not go upstream)."""

from __future__ import annotations

import functools
import unittest

from paddle.distributed.fleet.base.topology import CommunicateTopology

from muon_sim_runner import LayoutOracle, SimConfig
from muon_tiny_moe import EXPERT_COLOUR, TinyMoE, make_muon

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.comm_plan import (
    HierarchicalCommPlan,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.layout import (
    LayoutSettings,
    ParamMeta,
    ShardingLayout,
)

MS_FIRST = ["moe_sharding", "pipe", "expert"]


def _muon(name, shape, dtype="float32", colour=None):
    return ParamMeta(name, shape, dtype, colour, True)


def _hier(overlap):
    topo = CommunicateTopology(MS_FIRST, [2, 1, 4])
    plan = HierarchicalCommPlan.from_topology(topo, 2)
    metas = [_muon(f"w{i}", (32, 32)) for i in range(4)] + [
        _muon("e", (16, 8), colour="moe_expert"), ParamMeta("bias", (32,), "float32")]
    rank = 5
    groups = {None: list(range(8)), "moe_expert": plan.moe_sharding_ranks(rank)}
    return plan, ShardingLayout.build(
        metas, groups, rank,
        # balanced: owners spread over both nodes, so rank 5 crosses nodes
        LayoutSettings(comm_overlap=overlap, partition_strategy="balanced"), plan)


HIER_PHASES = {"intra_node_reduce", "intra_node_broadcast", "cross_node_reduce",
               "cross_node_broadcast"}


@functools.lru_cache(maxsize=None)
def _tiny_moe_metas() -> tuple:
    """The tiny MoE's parameter metadata, as every rank's optimizer sees it."""
    net = TinyMoE(0, None)
    info = make_muon(list(net.parameters()), clip=False)._muon_param_info_map
    metas = []
    for p in net.parameters():
        colour = p.color["color"] if isinstance(getattr(p, "color", None), dict) else None
        metas.append(ParamMeta(p.name, tuple(p.shape), str(p.dtype), colour,
                               info[p.name].use_muon))
    return tuple(metas)


def oracle_layout(cfg: SimConfig, oracle: LayoutOracle, plan, rank: int) -> ShardingLayout:
    groups = {None: oracle.sharding_group(rank), EXPERT_COLOUR: oracle.moe_group(rank)}
    settings = LayoutSettings(comm_buffer_size_MB=cfg.comm_buffer_size_MB,
                              comm_overlap=cfg.overlap,
                              partition_strategy=cfg.partition or "upstream_greedy")
    return ShardingLayout.build(_tiny_moe_metas(), groups, rank, settings, plan)


def check_layouts_against_oracle(test: unittest.TestCase, name: str, cfg: SimConfig) -> dict:
    """Every rank's layout schedule vs the oracle; returns rank -> layout."""
    oracle = LayoutOracle(cfg)
    plan = HierarchicalCommPlan.from_topology(cfg.topology(), cfg.gpn)
    layouts = {r: oracle_layout(cfg, oracle, plan, r) for r in range(cfg.world)}
    per_group: dict = {}
    phases = set()
    for rank, layout in layouts.items():
        dense_owners = {layout.owners[p] for b in layout.muon_buckets if b.colour is None
                        for p in b.params}
        test.assertTrue(dense_owners <= set(oracle.sharding_group(rank)),
                        f"[{name}] rank {rank}: dense owners {dense_owners} outside its stage")
        cross = {b.owner for b in layout.muon_buckets
                 if b.colour is None and b.owner % cfg.gpn == rank % cfg.gpn}
        for op in layout.schedule():
            phases.add(op.phase)
            per_group.setdefault(tuple(sorted(op.group)), {}).setdefault(rank, []).append(
                (op.phase, op.op, op.root, op.dtype, op.numel))
            if op.phase.startswith("intra_node"):
                test.assertEqual(tuple(sorted(op.group)), oracle.node(rank),
                                 f"[{name}] rank {rank}: {op.phase} outside its node")
                test.assertIn(op.root, oracle.node(rank),
                              f"[{name}] rank {rank}: {op.phase} root {op.root} off-node")
            if op.phase.startswith("cross_node"):
                test.assertEqual(tuple(sorted(op.group)), oracle.same_card(rank),
                                 f"[{name}] rank {rank}: {op.phase} outside its same-card group")
                test.assertIn(op.root, cross,
                              f"[{name}] rank {rank} (card {rank % cfg.gpn}) joined the "
                              f"cross-node step of owner {op.root}")
        # DESIGN 3: the intra-node hop ends on my node's rank with the owner's card.
        expected_roots = {oracle.node(rank)[0] + b.owner % cfg.gpn
                          for b in layout.muon_buckets if b.colour is None}
        intra_roots = {op.root for op in layout.schedule() if op.phase.startswith("intra_node")}
        test.assertEqual(intra_roots, expected_roots,
                         f"[{name}] rank {rank}: intra-node roots {sorted(intra_roots)}, the "
                         f"owners' cards on its node are {sorted(expected_roots)}")
        crossing = [op for op in layout.schedule() if op.phase == "cross_node_reduce"]
        test.assertEqual(sorted({op.root for op in crossing}), sorted(cross),
                         f"[{name}] rank {rank}: cross-node reduces for owners "
                         f"{sorted({op.root for op in crossing})}, its card's owners are "
                         f"{sorted(cross)}")
    test.assertTrue(HIER_PHASES <= phases, f"[{name}] phases {sorted(phases)}")
    for group, by_rank in per_group.items():
        test.assertEqual(sorted(by_rank), list(group),
                         f"[{name}] group {group}: only ranks {sorted(by_rank)} issue on it")
        first = by_rank[group[0]]
        for rank, seq in by_rank.items():
            test.assertEqual(seq, first, f"[{name}] group {group}: rank {rank}'s collectives "
                                         f"differ from rank {group[0]}'s (a real backend hangs)")
    return layouts
