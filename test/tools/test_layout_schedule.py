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
"""The plan tool's schedule comparison against the real optimizer: the
layout built from parameter metadata (as ``tools/muon_comm.py`` builds it)
equals the optimizer's, and ``compare_schedule`` finds the collectives the
simulated world recorded. A test of the tool: not exported with the
optimizer's suites (test/collective/fleet/test_muon_group_call.py).
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "collective", "fleet"))
from mock.fake_hcg import PIPE_FIRST_MOE_ORDER  # noqa: E402
from muon_sim_runner import SimConfig, run_world  # noqa: E402

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.comm_plan import (  # noqa: E402
    HierarchicalCommPlan,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.layout import (  # noqa: E402
    ParamMeta,
    ShardingLayout,
)
from paddle_muon_ext.tools.verify import compare_schedule, layout_summary  # noqa: E402

ORDERS = {"pp_ms_ep": PIPE_FIRST_MOE_ORDER}


# --------------------------------------------------------------------------
# the layout predicts the schedule the real optimizer issues
# --------------------------------------------------------------------------
def _layout_grid():
    layouts = [
        ("ep4-ms2-gpn2", dict(ep=4, ms=2)),
        ("ep8-ms2-gpn4", dict(ep=8, ms=2)),
        ("ep4-ms1-gpn2", dict(ep=4, ms=1)),
        ("ep2-ms2-pp2-gpn2-pipefirst", dict(ep=2, ms=2, pp=2, order=ORDERS["pp_ms_ep"])),
    ]
    gpn = {"ep4-ms2-gpn2": 2, "ep8-ms2-gpn4": 4, "ep4-ms1-gpn2": 2,
           "ep2-ms2-pp2-gpn2-pipefirst": 2}
    for name, kw in layouts:
        for fused, overlap in ((True, False), (False, False), (True, True)):
            if overlap and kw.get("pp", 1) > 1:
                continue  # the optimizer refuses comm_overlap with pipeline parallel
            for option in (True, False):
                mode = f"{'fused' if fused else 'unfused'}-{'overlap' if overlap else 'sync'}"
                yield (f"{name}-{mode}-{'on' if option else 'off'}",
                       SimConfig(**kw, gpn=gpn[name] if option else None, fused=fused,
                                 overlap=overlap, steps=2, clip=False, via_fleet=False))


LAYOUT_GRID = dict(_layout_grid())


def _independent_layout(cfg: SimConfig, res) -> ShardingLayout:
    """The layout built from metadata alone, as the plan tool builds it."""
    opt = res.optimizer
    hcg = opt._hcg
    info = opt._inner_opt._muon_param_info_map
    metas, groups = [], {None: list(hcg.get_sharding_parallel_group().ranks)}
    for p in res.net.parameters():
        color = getattr(p, "color", None)
        colour = color["color"] if isinstance(color, dict) else None
        if colour is not None:
            groups[colour] = list(color["group"].ranks)
        metas.append(ParamMeta(p.name, tuple(p.shape), str(p.dtype), colour,
                               info[p.name].use_muon))
    plan = HierarchicalCommPlan.from_topology(cfg.topology(), cfg.gpn) if cfg.gpn else None
    return ShardingLayout.build(metas, groups, res.rank, opt.sharding_layout.settings, plan)


@pytest.mark.parametrize("name", sorted(LAYOUT_GRID))
def test_layout_predicts_recorded_schedule(name):
    cfg = LAYOUT_GRID[name]
    results, world = run_world(cfg, mode="record")
    assert world.check_schedule().ok, name
    phases = set()
    for res in results:
        layout = res.optimizer.sharding_layout
        assert layout_summary(_independent_layout(cfg, res)) == layout_summary(layout), (
            f"[{name}] rank {res.rank}: the optimizer's layout differs from the one "
            "built from parameter metadata"
        )
        problems = compare_schedule(layout, world.traces[res.rank], cfg.steps)
        assert not problems, f"[{name}] " + "\n".join(problems)
        phases |= {op.phase for op in layout.schedule()}
    hier = {"intra_node_reduce", "cross_node_reduce"}
    assert hier <= phases if cfg.gpn else not hier & phases, (name, sorted(phases))


# --------------------------------------------------------------------------
# compare_schedule reports each kind of divergence (verify must FAIL on them)
# --------------------------------------------------------------------------
def _optimizer_records(layout, records):
    return [r for r in records if r.group_seq is not None and r.op != "all_reduce"]


def test_compare_schedule_names_each_divergence():
    import dataclasses

    cfg = LAYOUT_GRID["ep4-ms2-gpn2-fused-overlap-on"]
    results, world = run_world(cfg, mode="record")
    res = results[0]
    layout = res.optimizer.sharding_layout
    records = list(world.traces[res.rank])
    assert compare_schedule(layout, records, cfg.steps) == []

    ops = _optimizer_records(layout, records)
    # The per-step count disagrees: one collective missing, or one more than predicted.
    for label, trace, count in (
            ("one missing", [r for r in records if r is not ops[-1]], len(ops) - 1),
            ("one extra", records + [ops[-1]], len(ops) + 1)):
        problems = compare_schedule(layout, trace, cfg.steps)
        assert problems == [f"rank {layout.rank}: recorded {count} collectives in {cfg.steps} "
                            f"steps, the layout predicts {len(ops) // cfg.steps} per step"], \
            (label, problems)

    hooks = sum(1 for op in layout.schedule() if op.trigger == "backward")
    assert hooks > 0, "an overlap layout launches collectives from backward hooks"
    # A hook-launched collective on the wrong root.
    bad_hook = dataclasses.replace(ops[0], root=-1)
    problems = compare_schedule(layout, [bad_hook if r is ops[0] else r for r in records],
                                cfg.steps)
    assert any("step 0: hook-launched collectives" in p for p in problems), problems
    # A synchronous collective with another element count.
    target = ops[hooks]
    bad_sync = dataclasses.replace(target, numel=target.numel + 1)
    problems = compare_schedule(layout, [bad_sync if r is target else r for r in records],
                                cfg.steps)
    assert any(f"step 0 op {hooks}: recorded" in p for p in problems), problems


def test_layout_of_unwraps_fleet_wrappers():
    from paddle_muon_ext.tools.verify import _layout_of

    cfg = LAYOUT_GRID["ep4-ms2-gpn2-fused-sync-off"]
    results, _ = run_world(cfg, mode="record")
    opt = results[0].optimizer

    class Wrapper:
        def __init__(self, inner):
            self._inner_opt = inner

    assert _layout_of(Wrapper(Wrapper(opt))) is opt.sharding_layout
    assert _layout_of(Wrapper(object())) is None
    assert _layout_of(object()) is None
