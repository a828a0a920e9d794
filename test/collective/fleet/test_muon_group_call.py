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
"""comm_group_call_opt through the real optimizer, on the simulated world.

The grid: ep in {4, 8, 12, 16, 32} x GPUs per node in {2, 4, 8} x
moe_sharding in {2, 4} x pp in {1, 2} x both MoE topology orders. Every valid
layout goes through the schedule checker (every rank, every collective,
record mode, up to 256 ranks); every valid layout of <= 32 ranks also trains
3 steps moving real data with the option on and off and against the
single-process reference. Invalid layouts must raise at construction.

Tolerance: 1e-5 absolute on O(1) fp32 weights (see the optimizer suite): the
hierarchical and flat paths differ only in the order of fp32 additions.
"""

from __future__ import annotations

import itertools
import os
import unittest
from unittest import mock

import numpy as np
import paddle
from mock.fake_hcg import DEFAULT_MOE_ORDER, PIPE_FIRST_MOE_ORDER

from muon_sim_runner import (
    TensorParallelHcg,
    SimConfig,
    build_rank,
    max_abs_diff,
    raises,
    reference_values,
    run_world,
    sharded_core,
)
from muon_tiny_moe import Reference, batch

from paddle_muon_ext.distributed.fleet.meta_optimizers import (
    muon_sharding_optimizer as mso,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_comm_plan import (
    HierarchicalCommPlan,
)

TOL = 1e-5
ORDERS = {"ms_pp_ep": DEFAULT_MOE_ORDER, "pp_ms_ep": PIPE_FIRST_MOE_ORDER}




def _grid():
    for ep, gpn, ms, pp, order in itertools.product(
        [4, 8, 12, 16, 32], [2, 4, 8], [2, 4], [1, 2], sorted(ORDERS)
    ):
        # The schedule runs skip the fleet wrapper and clip: they check the
        # optimizer's own collectives, and it halves the 256-rank runs.
        cfg = SimConfig(ep=ep, ms=ms, pp=pp, order=ORDERS[order], gpn=gpn,
                        steps=1, clip=False, via_fleet=False)
        yield f"ep{ep}-gpn{gpn}-ms{ms}-pp{pp}-{order}", cfg


def _valid(cfg: SimConfig) -> bool:
    try:
        HierarchicalCommPlan.from_topology(cfg.topology(), cfg.gpn)
        return True
    except ValueError:
        return False


GRID = dict(_grid())
VALID = {k: c for k, c in GRID.items() if _valid(c)}
INVALID = {k: c for k, c in GRID.items() if k not in VALID}
# Data-moving runs: every valid layout up to 32 ranks (the largest is 32).
# With pp = 1 both orders give the same rank layout (the pipe axis has size
# 1), so the pipe-first duplicates only go through the schedule checker.
NUMERIC = {k: c for k, c in VALID.items()
           if c.world <= 32 and not (c.pp == 1 and c.order[0] == "pipe")}


def _grid_has_both_outcomes_and_a_large_world():
    assert len(VALID) >= 60 and INVALID, (len(VALID), len(INVALID))
    assert max(c.world for c in NUMERIC.values()) >= 32
    assert max(c.world for c in VALID.values()) >= 256
    assert "ep12-gpn8-ms2-pp1-ms_pp_ep" in VALID, "upstream rejected ep=12 on 8-card nodes; we serve it"


def _schedule_assertions(name: str, cfg: SimConfig, world) -> None:
    report = world.check_schedule()
    assert report.ok, f"[{name}] {report.summary()}"
    plan = HierarchicalCommPlan.from_topology(cfg.topology(), cfg.gpn)
    seen = set()
    for trace in world.traces:
        for rec in trace:
            if rec.phase in ("intra_node_reduce", "intra_node_broadcast") and rec.op in (
                    "reduce", "broadcast"):
                seen.add(rec.phase)
                assert set(rec.group_ranks) == set(plan.node_ranks(plan.node_of(rec.rank))), (
                    f"[{name}] rank {rec.rank} ran {rec.phase} on {rec.group_ranks}, not its node"
                )
                assert plan.node_of(rec.root) == plan.node_of(rec.rank), (
                    f"[{name}] intra-node root {rec.root} is not on rank {rec.rank}'s node"
                )
            if rec.phase in ("cross_node_reduce", "cross_node_broadcast") and rec.op in (
                    "reduce", "broadcast"):
                seen.add(rec.phase)
                stage, card = plan.stage_of(rec.rank), plan.card_of(rec.rank)
                assert tuple(rec.group_ranks) == tuple(plan.same_card_ranks(stage, card)), (
                    f"[{name}] rank {rec.rank} ran {rec.phase} outside its same-card group"
                )
                assert plan.card_of(rec.root) == card, (
                    f"[{name}] rank {rec.rank} (card {card}) joined the cross-node step of "
                    f"owner {rec.root} (card {plan.card_of(rec.root)})"
                )
    assert seen == {"intra_node_reduce", "intra_node_broadcast",
                    "cross_node_reduce", "cross_node_broadcast"}, (name, seen)


def _grid_schedule_is_consistent(name):
    cfg = VALID[name]
    _, world = run_world(cfg, mode="record")
    _schedule_assertions(name, cfg, world)


def _grid_invalid_layout_raises_at_construction(name):
    cfg = INVALID[name]
    with raises(ValueError, match="comm_group_call_opt"):
        run_world(cfg, mode="record", reraise_original=True)


def _grid_three_steps_on_equal_off_and_reference(name):
    on = SimConfig(**{**NUMERIC[name].__dict__, "steps": 3, "clip": NUMERIC[name].pp == 1,
                      "via_fleet": True})
    off = SimConfig(**{**on.__dict__, "gpn": None})
    res_on, world = run_world(on)
    res_off, _ = run_world(off)
    expected = reference_values(on)
    for a, b in zip(res_on, res_off):
        d_off = max_abs_diff(a.values, b.values)
        d_ref = max_abs_diff(a.values, expected[a.rank])
        assert d_off <= TOL and d_ref <= TOL, (
            f"[{name}] rank {a.rank}: option on vs off max |d|={d_off:.3e}, "
            f"vs single-process reference {d_ref:.3e} (tol {TOL})"
        )
    _schedule_assertions(name, on, world)


def _owner_grads(cfg, strategy):
    hcg, net, opt, coord = build_rank(cfg, strategy)
    core = sharded_core(opt)
    rank = paddle.distributed.get_rank()
    net(paddle.to_tensor(batch(0, rank))).backward()
    core.reduce_gradients(list(net.parameters()), hcg)
    by_name = {p.name: k for k, p in {**{f"dense.{k}": p for k, p in net.dense.items()},
                                      **{f"expert.{k}": p for k, p in (net.experts or {}).items()}
                                      }.items()}
    return coord, {by_name[p.name]: p.grad.numpy() for p in core._owned_muon_params()}


OWNER_GRAD_CASES = dict(zip(["ep4-gpn2", "ep12-gpn8", "ep4-gpn2-per_param", "ep4-gpn4-avg"], [
    SimConfig(ep=4, ms=2, gpn=2),
    SimConfig(ep=12, ms=2, gpn=8),
    SimConfig(ep=4, ms=2, gpn=2, fused=False),
    SimConfig(ep=4, ms=2, gpn=4, use_reduce_avg=True),
]))


def _owner_gradient_is_group_mean_after_hierarchical_reduce(cfg):
    results, _ = run_world(cfg, body=_owner_grads)
    means = Reference(cfg.expert_of_rank()).mean_grads(0)
    owned = 0
    for rank, (coord, grads) in enumerate(results):
        for key, grad in grads.items():
            slot = (None, key) if key.startswith("dense.") else (coord, key)
            np.testing.assert_allclose(
                grad, means[slot], rtol=0, atol=1e-6,
                err_msg=f"owner rank {rank}: {key} after the two-level reduce is not the group mean",
            )
            owned += 1
    assert owned >= 4


def _phases_by_trigger(cfg: SimConfig) -> dict:
    results, world = run_world(cfg, mode="record")
    out: dict = {}
    for res in results:
        for rec in world.traces[res.rank]:
            if rec.group_seq is not None:
                out.setdefault(rec.phase, set()).add(rec.op)
    return out


def _overlap_keeps_the_hierarchical_reduce():
    # Without the fix, the hooks reduced every dense Muon buffer flat in the
    # sharding group: no intra-node / cross-node phase at all.
    cfg = SimConfig(ep=4, ms=2, gpn=2, overlap=True, steps=1, clip=False, via_fleet=False)
    phases = _phases_by_trigger(cfg)
    assert {"intra_node_reduce", "cross_node_reduce"} <= set(phases), sorted(phases)
    dense_flat = f"reduce_to_owner[{list(range(8))}]"
    assert dense_flat not in phases, "a dense Muon buffer was reduced flat"


MODE_CASES = dict(zip(["overlap", "overlap_avg_gpn4", "overlap_acc2", "bf16_and_fp32", "per_param",
     "pp2_pipe_first", "ms1"], [
    SimConfig(ep=4, ms=2, gpn=2, overlap=True),
    SimConfig(ep=8, ms=2, gpn=4, overlap=True, use_reduce_avg=True),
    SimConfig(ep=4, ms=2, gpn=2, overlap=True, acc_steps=2),
    SimConfig(ep=4, ms=2, gpn=2, matrix_dtype="bfloat16", clip=False),
    SimConfig(ep=4, ms=2, gpn=2, fused=False),
    SimConfig(ep=2, ms=2, pp=2, gpn=2, order=ORDERS["pp_ms_ep"], clip=False),
    SimConfig(ep=4, ms=1, gpn=2),
]))


def _option_on_equals_off_across_modes(base):
    tol = 1e-2 if base.matrix_dtype == "bfloat16" else TOL
    res_on, world = run_world(base)
    res_off, _ = run_world(SimConfig(**{**base.__dict__, "gpn": None}))
    expected = reference_values(base)
    for a, b in zip(res_on, res_off):
        assert max_abs_diff(a.values, b.values) <= tol, f"rank {a.rank}: on != off"
        assert max_abs_diff(a.values, expected[a.rank]) <= tol, f"rank {a.rank}: != reference"
    assert world.check_schedule().ok


def _option_off_never_resolves_gpus_per_node():
    """Upstream bug 3: node size resolved with the option off crashed CPU hosts."""

    def boom(*args, **kwargs):
        raise AssertionError("resolve_gpus_per_node called with comm_group_call_opt off")

    cfg = SimConfig(ep=4, ms=2, gpn=None)
    with mock.patch.dict(os.environ, {"PADDLE_LOCAL_SIZE": "abc"}), \
            mock.patch.object(mso, "resolve_gpus_per_node", boom):
        results, _ = run_world(cfg, mode="record", body=lambda c, s: sharded_core(
            build_rank(c, s)[2]).comm_plan)
    assert all(plan is None for plan in results)


BAD_ENV = [("abc", "is not an integer"), ("0", "positive integer"),
           ("-3", "positive integer"), ("", "is not an integer"), ("2.5", "is not an integer"),
           ("1", "gpus_per_node=1")]


def _bad_local_size_env_raises(value, fragment):
    cfg = SimConfig(ep=4, ms=2, gpn=2)

    def body(c, s):
        # after the world set PADDLE_LOCAL_SIZE from the config
        os.environ["PADDLE_LOCAL_SIZE"] = value
        build_rank(c, s)

    with mock.patch.dict(os.environ), raises(ValueError) as info:
        run_world(cfg, mode="record", body=body, reraise_original=True)
    assert fragment in str(info.value)
    assert value == "1" or "PADDLE_LOCAL_SIZE" in str(info.value)


BAD_LAYOUTS = [
    # (config, error type, message fragment): the layout classes upstream got wrong
    (SimConfig(ep=4, ms=2, gpn=1), ValueError, "gpus_per_node=1"),  # bug 4
    (SimConfig(ep=4, ms=2, gpn=3), ValueError, "not a multiple of gpus_per_node=3"),
    (SimConfig(ep=6, ms=2, gpn=8), ValueError, "not a multiple of gpus_per_node=8"),
    (SimConfig(ep=4, ms=2, gpn=8), ValueError, "lies on a single node"),
    (SimConfig(ep=4, ms=2, gpn=16), ValueError, "not a multiple"),
    (SimConfig(ep=12, ms=2, pp=2, gpn=8), ValueError, "mixes pipeline stages"),
    (SimConfig(ep=4, ms=2, pp=2, gpn=8), ValueError, "mixes pipeline stages"),
    (SimConfig(ep=2, ms=4, pp=2, gpn=4), ValueError, "mixes pipeline stages"),
    (SimConfig(ep=6, ms=4, pp=2, gpn=4), ValueError, "mixes pipeline stages"),
    (SimConfig(ep=2, ms=2, pp=2, gpn=8, order=ORDERS["pp_ms_ep"]), ValueError,
     "mixes pipeline stages"),
    (SimConfig(ep=2, ms=2, pp=2, gpn=4, order=ORDERS["pp_ms_ep"]), ValueError,
     "lies on a single node"),
    (SimConfig(ep=4, ms=2, pp=2, gpn=16, order=ORDERS["pp_ms_ep"]), ValueError,
     "mixes pipeline stages"),
    (SimConfig(ep=3, ms=2, gpn=4), ValueError, "not a multiple of gpus_per_node=4"),
]


def _bad_layout_raises_with_actionable_message(cfg, exc, fragment):
    with raises(exc) as info:
        run_world(cfg, mode="record", reraise_original=True)
    message = str(info.value)
    assert fragment in message, message
    assert "comm_group_call_opt" in message, message


def _tensor_parallel_with_group_call_raises():
    def body(cfg, strategy):
        from muon_tiny_moe import TinyMoE, make_muon
        hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
        net = TinyMoE(hcg.get_expert_parallel_rank(), hcg.get_moe_sharding_parallel_group())
        mso.MuonShardingOptimizer(make_muon(list(net.parameters())), TensorParallelHcg(hcg),
                                  strategy)

    with raises(ValueError, match="mp_degree=2"):
        run_world(SimConfig(ep=4, ms=2, gpn=2), mode="record", body=body,
                  reraise_original=True)


def _groups_created_identically_on_every_rank():
    cfg = SimConfig(ep=8, ms=2, gpn=4)
    _, world = run_world(cfg, mode="record")
    creations = [[(r.group_id, tuple(r.group_ranks)) for r in t if r.op == "new_group"]
                 for t in world.traces]
    assert all(c == creations[0] for c in creations), "ranks created groups in different orders"
    plan = HierarchicalCommPlan.from_topology(cfg.topology(), cfg.gpn)
    created = {ranks for _, ranks in creations[0]}
    for spec in plan.group_specs():
        assert tuple(spec.ranks) in created, f"group {spec} was never created"


class TestGroupCall(unittest.TestCase):
    """Each case of the tables above runs as a subtest."""

    def test_grid_has_both_outcomes_and_a_large_world(self):
        _grid_has_both_outcomes_and_a_large_world()

    def test_grid_schedule_is_consistent(self):
        for name in sorted(VALID):
            with self.subTest(case=name):
                _grid_schedule_is_consistent(name)

    def test_grid_invalid_layout_raises_at_construction(self):
        for name in sorted(INVALID):
            with self.subTest(case=name):
                _grid_invalid_layout_raises_at_construction(name)

    def test_grid_three_steps_on_equal_off_and_reference(self):
        for name in sorted(NUMERIC):
            with self.subTest(case=name):
                _grid_three_steps_on_equal_off_and_reference(name)

    def test_owner_gradient_is_group_mean_after_hierarchical_reduce(self):
        for name, cfg in OWNER_GRAD_CASES.items():
            with self.subTest(case=name):
                _owner_gradient_is_group_mean_after_hierarchical_reduce(cfg)

    def test_overlap_keeps_the_hierarchical_reduce(self):
        _overlap_keeps_the_hierarchical_reduce()

    def test_option_on_equals_off_across_modes(self):
        for name, base in MODE_CASES.items():
            with self.subTest(case=name):
                _option_on_equals_off_across_modes(base)

    def test_option_off_never_resolves_gpus_per_node(self):
        _option_off_never_resolves_gpus_per_node()

    def test_bad_local_size_env_raises(self):
        for value, fragment in BAD_ENV:
            with self.subTest(case=repr(value)):
                _bad_local_size_env_raises(value, fragment)

    def test_bad_layout_raises_with_actionable_message(self):
        for i, (cfg, exc, fragment) in enumerate(BAD_LAYOUTS):
            with self.subTest(case=f"bad{i}"):
                _bad_layout_raises_with_actionable_message(cfg, exc, fragment)

    def test_tensor_parallel_with_group_call_raises(self):
        _tensor_parallel_with_group_call_raises()

    def test_groups_created_identically_on_every_rank(self):
        _groups_created_identically_on_every_rank()


if __name__ == "__main__":
    unittest.main()
