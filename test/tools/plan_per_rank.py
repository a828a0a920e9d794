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
"""The plan tool's per-rank method, kept as the reference for the by-class one.

Every rank of the world gets its full :class:`ShardingLayout` (both colours);
every group collective is taken from the schedule of the group's lowest rank
and charged one by one. Quadratic in the world size, so only for the sizes it
can still do: ``test_plan_scale`` compares the plan tool's figures with it and
``tools/bench/bench_plan_scale.py`` times both side by side.

Use it by replacing ``paddle_muon_ext.tools.plan._path`` with :func:`per_rank_path`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.layout import (
    LayoutSettings,
    ShardingLayout,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.step_plan import hier_groups
from paddle_muon_ext.tools.cost_model import AlphaBeta, CostPath, max_over_mean
from paddle_muon_ext.tools.fast_layout import count_buffers
from paddle_muon_ext.tools.plan_world import balance_floor

EXPERT_COLOUR = "moe_expert"


def world_layouts(plan, stages, settings: LayoutSettings, hierarchical: bool) -> Dict[int, Any]:
    """The layout of every rank (one build per moe_sharding group, copied per rank)."""
    layouts: Dict[int, ShardingLayout] = {}
    metas = [[p.to_meta(EXPERT_COLOUR) for p in sparams] for sparams in stages]
    for stage in range(plan.pp_degree):
        dense = plan.sharding_group_ranks(stage)
        for rank in dense:
            if rank in layouts:
                continue
            moe = plan.moe_sharding_ranks(rank)
            first = ShardingLayout.build(metas[stage], {None: dense, EXPERT_COLOUR: moe},
                                         rank, settings, plan if hierarchical else None)
            for r in moe:
                layouts[r] = first if r == rank else dataclasses.replace(first, rank=r)
    return layouts


def world_ops(layouts) -> list:
    """Every group collective once, as issued by the group's lowest rank."""
    ops = []
    for rank in sorted(layouts):
        lay = layouts[rank]
        groups = [*lay.groups.values(), *(hier_groups(lay) if lay.plan is not None else ())]
        if all(rank != min(g) for g in groups):
            continue
        ops.extend(op for op in lay.schedule() if rank == min(op.group))
    return ops


def _unique_buckets(layouts) -> list:
    seen, out = set(), []
    for rank in sorted(layouts):
        for b in layouts[rank].muon_buckets:
            key = (b.colour, b.group, b.owner, b.dtype)
            if key not in seen:
                seen.add(key)
                out.append(b)
    return out


def _unique_partitions(layouts) -> list:
    seen, out = set(), []
    for rank in sorted(layouts):
        lay = layouts[rank]
        for colour, part in lay.partitions.items():
            key = (colour, lay.groups[colour])
            if key not in seen:
                seen.add(key)
                out.append((lay.groups[colour], part))
    return out


def per_rank_path(plan, stages, ab: AlphaBeta, settings: LayoutSettings, hierarchical: bool,
                  backend: str = "nccl", placement: Any = None) -> Dict[str, Any]:
    """One path's figures from every rank's layout (the plan tool's ``_path`` contract).

    ``placement`` (the plan run's memos) is not used: every layout is the
    core's plain computation, the reference the memoised one is held to.
    """
    gpn, world = plan.gpus_per_node, plan.world_size
    layouts = world_layouts(plan, stages, settings, hierarchical)
    path = CostPath("hierarchical" if hierarchical else "flat", world, gpn, ab, backend)
    buckets = _unique_buckets(layouts)
    for b in buckets:
        path.add_bound("dense" if b.colour is None else "moe",
                       len({r // gpn for r in b.group}), sum(b.param_bytes))
    path.replay((op, op.payload) for op in world_ops(layouts))
    summary = path.summary()
    state, owned, owned_dense, dense_bytes = ([0] * world for _ in range(4))
    for group, part in _unique_partitions(layouts):
        for idx, r in enumerate(group):
            state[r] += part.state_bytes[idx]
    for b in buckets:
        owned[b.owner] += len(b.params)
        if b.colour is None:
            owned_dense[b.owner] += len(b.params)
            dense_bytes[b.owner] += sum(b.param_bytes)
    rows = []
    for stage, sparams in enumerate(stages):
        lay = layouts[plan.sharding_group_ranks(stage)[0]]
        for colour, label in ((None, "dense"), (EXPERT_COLOUR, "moe")):
            part = lay.partitions.get(colour)
            if part is None:
                continue
            specs = [p.to_matrix_spec() for p in sparams
                     if p.use_muon and p.is_expert == (colour is not None)]
            row = {"colour": label, "stage": stage, "nranks": part.nranks,
                   "num_params": len(part.owners), "num_buckets": count_buffers(part),
                   "state_bytes_max_over_mean": max_over_mean(part.state_bytes),
                   "state_floor": balance_floor(specs, part.nranks)[0]}
            if colour is not None:
                row = {**row, "groups": len({plan.moe_sharding_ranks(r)
                                             for r in plan.sharding_group_ranks(stage)})}
            rows.append(row)
    summary["optimizer_state_max_over_mean"] = max_over_mean(state)
    summary["num_buckets"] = {"dense": sum(1 for b in buckets if b.colour is None),
                              "moe": sum(1 for b in buckets if b.colour is not None)}
    summary["num_other_buffers"] = len({(s.colour, s.group, s.dtype, s.params)
                                        for lay in layouts.values() for s in lay.slice_buffers})
    return {
        "summary": summary,
        "owned": owned,
        "owned_detail": {"dense": owned_dense,
                         "moe": [a - b for a, b in zip(owned, owned_dense)],
                         "dense_param_bytes": dense_bytes},
        "buckets": [
            {"colour": "dense" if b.colour is None else "moe",
             "stage": plan.stage_of(b.owner), "owner": b.owner, "dtype": b.dtype,
             "bytes": sum(b.param_bytes), "grad_chunks": len(b.chunks or b.params),
             "group_nodes": len({r // gpn for r in b.group}), "route": b.route_kind}
            for b in buckets
        ],
        "partitions": rows,
    }
