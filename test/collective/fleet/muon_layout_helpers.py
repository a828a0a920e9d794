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
"""Layouts the layout and step-plan suites share: a Muon ``ParamMeta`` shorthand
and rank 5 of a two-node hierarchical layout."""

from __future__ import annotations

from paddle.distributed.fleet.base.topology import CommunicateTopology

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
