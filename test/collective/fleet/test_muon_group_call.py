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
"""comm_group_call_opt: the layout grid against an independent oracle, and
the real optimizer on one representative layout per class.

The grid: ep in {4, 8, 12, 16, 32} x GPUs per node in {2, 4, 8} x
moe_sharding in {2, 4} x pp in {1, 2} x both MoE topology orders (120
layouts, up to 256 ranks).

* Which layouts are valid is decided by the rule of DESIGN section 3,
  written from rank coordinates (``muon_sim_runner.LayoutOracle``), not by
  the plan under test; the plan must accept exactly those and refuse the others naming the
  failed condition.
* Every valid layout: the ``ShardingLayout`` of every rank (no process group
  needed) is checked against the oracle's node / same-card groups and roots,
  and the per-group collective sequences of all members must agree (what a
  real backend needs not to hang).
* The real optimizer, in the simulated world: one layout per class (pipeline
  degree, MoE order, how expert rows fall on nodes) plus one 256-rank layout
  records its schedule, which must pass the schedule checker and equal the
  layout's prediction rank by rank; the classes' layouts of <= 32 ranks also
  train 3 steps with the option on and off against the single-process
  reference. Invalid layouts must raise at construction.

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

from muon_layout_helpers import HIER_PHASES, check_layouts_against_oracle, oracle_layout
from muon_sim_runner import (
    LayoutOracle,
    TensorParallelHcg,
    SimConfig,
    build_rank,
    max_abs_diff,
    raises,
    reference_values,
    run_world,
    sharded_core,
)
from muon_tiny_moe import Reference, TinyMoE, batch, make_muon

from paddle_muon_ext.distributed.fleet.meta_optimizers import (
    muon_sharding_optimizer as mso,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.comm_plan import (
    HierarchicalCommPlan,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_optimizer import (
    MuonShardingOptimizer,
)

TOL = 1e-5
ORDERS = {"ms_pp_ep": DEFAULT_MOE_ORDER, "pp_ms_ep": PIPE_FIRST_MOE_ORDER}
# The largest layout the real optimizer still runs (schedule only).
LARGE = "ep32-gpn8-ms4-pp2-ms_pp_ep"


def _grid():
    for ep, gpn, ms, pp, order in itertools.product(
        [4, 8, 12, 16, 32], [2, 4, 8], [2, 4], [1, 2], sorted(ORDERS)
    ):
        # The schedule runs skip the fleet wrapper and clip: they check the
        # optimizer's own collectives.
        cfg = SimConfig(ep=ep, ms=ms, pp=pp, order=ORDERS[order], gpn=gpn,
                        steps=1, clip=False, via_fleet=False)
        yield f"ep{ep}-gpn{gpn}-ms{ms}-pp{pp}-{order}", cfg


def _layout_class(cfg: SimConfig) -> tuple:
    """What changes the shape of the schedule: pp, the order (with pp > 1), rows vs nodes."""
    if cfg.ep % cfg.gpn == 0:
        rows = "node_within_row"
    elif cfg.gpn % cfg.ep == 0:
        rows = "rows_within_node"
    else:
        rows = "row_straddles_nodes"  # upstream bug 1 (ep=12 on 8-card nodes)
    return cfg.pp, cfg.order[0] if cfg.pp > 1 else "any", rows


GRID = dict(_grid())
REFUSAL = {k: LayoutOracle(c).refusal() for k, c in GRID.items()}
VALID = {k: c for k, c in GRID.items() if REFUSAL[k] is None}
INVALID = {k: c for k, c in GRID.items() if k not in VALID}
# One representative per class: the smallest world, then the name (stable).
REPRESENTATIVES: dict = {}
for _name, _cfg in sorted(VALID.items(), key=lambda kv: (kv[1].world, kv[0])):
    REPRESENTATIVES.setdefault(_layout_class(_cfg), _name)
RECORDED = sorted(set(REPRESENTATIVES.values()) | {LARGE})
# Data-moving runs: the representatives up to 32 ranks.
NUMERIC = sorted(n for n in REPRESENTATIVES.values() if VALID[n].world <= 32)


def _recorded_ops(trace) -> list:
    # The optimizer's collectives carry a phase label; Paddle's hcg all_reduce has none.
    return [(r.phase, r.op, tuple(sorted(r.group_ranks)), r.root, r.dtype, r.numel)
            for r in trace if r.group_seq is not None and r.phase is not None]


def _schedule_assertions(test: unittest.TestCase, name: str, cfg: SimConfig, world,
                         results=None) -> None:
    report = world.check_schedule()
    test.assertTrue(report.ok, f"[{name}] {report.summary()}")
    oracle = LayoutOracle(cfg)
    seen = set()
    for rank, trace in enumerate(world.traces):
        for rec in trace:
            if rec.op not in ("reduce", "broadcast") or rec.phase not in HIER_PHASES:
                continue
            seen.add(rec.phase)
            if rec.phase.startswith("intra_node"):
                test.assertEqual(tuple(rec.group_ranks), oracle.node(rank),
                                 f"[{name}] rank {rank} ran {rec.phase} outside its node")
                test.assertIn(rec.root, oracle.node(rank),
                              f"[{name}] intra-node root {rec.root} is not on rank {rank}'s node")
            else:
                test.assertEqual(tuple(rec.group_ranks), oracle.same_card(rank),
                                 f"[{name}] rank {rank} ran {rec.phase} outside its same-card "
                                 "group")
    test.assertEqual(seen, HIER_PHASES, f"[{name}] hierarchical phases recorded")
    if results is None:
        return
    plan = HierarchicalCommPlan.from_topology(cfg.topology(), cfg.gpn)
    for res in results:
        predicted = [op.key() for op in oracle_layout(cfg, oracle, plan, res.rank).schedule()]
        recorded = _recorded_ops(world.traces[res.rank])
        test.assertEqual(recorded, predicted * cfg.steps,
                         f"[{name}] rank {res.rank}: recorded collectives differ from the "
                         "layout built from the oracle's groups")


def _owner_grads(cfg, strategy):
    hcg, net, opt, coord = build_rank(cfg, strategy)
    core = sharded_core(opt)
    rank = paddle.distributed.get_rank()
    net(paddle.to_tensor(batch(0, rank))).backward()
    core.reduce_gradients(list(net.parameters()), hcg)
    by_name = {p.name: k for k, p in {**{f"dense.{k}": p for k, p in net.dense.items()},
                                      **{f"expert.{k}": p for k, p in (net.experts or {}).items()}
                                      }.items()}
    return coord, {by_name[p.name]: p.grad.numpy() for p in core._runtime.owned_muon_params()}


OWNER_GRAD_CASES = {
    "ep4-gpn2": SimConfig(ep=4, ms=2, gpn=2),
    "ep12-gpn8": SimConfig(ep=12, ms=2, gpn=8),
    "ep4-gpn2-per_param": SimConfig(ep=4, ms=2, gpn=2, fused=False),
    "ep4-gpn4-avg": SimConfig(ep=4, ms=2, gpn=4, use_reduce_avg=True),
}

MODE_CASES = {
    "overlap": SimConfig(ep=4, ms=2, gpn=2, overlap=True),
    "overlap_avg_gpn4": SimConfig(ep=8, ms=2, gpn=4, overlap=True, use_reduce_avg=True),
    "overlap_acc2": SimConfig(ep=4, ms=2, gpn=2, overlap=True, acc_steps=2),
    "bf16_and_fp32": SimConfig(ep=4, ms=2, gpn=2, matrix_dtype="bfloat16", clip=False),
    "per_param": SimConfig(ep=4, ms=2, gpn=2, fused=False),
    "pp2_pipe_first": SimConfig(ep=2, ms=2, pp=2, gpn=2, order=ORDERS["pp_ms_ep"], clip=False),
    "ms1": SimConfig(ep=4, ms=1, gpn=2),
}

BAD_ENV = [("abc", "is not an integer"), ("0", "positive integer"),
           ("-3", "positive integer"), ("", "is not an integer"), ("2.5", "is not an integer"),
           ("1", "gpus_per_node=1")]

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


class TestGroupCallGrid(unittest.TestCase):
    """The 120-layout grid; each layout runs as a subtest."""

    def test_grid_has_both_outcomes_every_class_and_a_large_world(self):
        self.assertGreaterEqual(len(VALID), 60, "the grid lost its valid layouts")
        self.assertTrue(INVALID, "the grid has no layout the oracle refuses")
        self.assertEqual(set(REFUSAL[k] for k in INVALID),
                         {"mixes pipeline stages", "lies on a single node"},
                         "the grid's refusals should cover both node conditions")
        self.assertGreaterEqual(len(REPRESENTATIVES), 7,
                                f"layout classes: {sorted(REPRESENTATIVES)}")
        self.assertEqual(VALID[LARGE].world, 256, f"{LARGE} should be the 256-rank layout")
        self.assertIn("ep12-gpn8-ms2-pp1-ms_pp_ep", VALID,
                      "upstream rejected ep=12 on 8-card nodes; we serve it")
        self.assertGreaterEqual(max(VALID[n].world for n in NUMERIC), 32)

    def test_oracle_rule_on_hand_checked_layouts(self):
        # The oracle itself, on layouts worked out by hand from DESIGN section 3.
        cases = [
            (SimConfig(ep=4, ms=2, gpn=2), None),
            (SimConfig(ep=12, ms=2, gpn=8), None),  # 24 ranks on 3 nodes, pp = 1
            (SimConfig(ep=4, ms=2, pp=2, gpn=8), "mixes pipeline stages"),  # node = ms row
            (SimConfig(ep=2, ms=2, pp=2, gpn=4, order=ORDERS["pp_ms_ep"]),
             "lies on a single node"),  # stage = 4 ranks = one node
            (SimConfig(ep=4, ms=2, gpn=3), "not a multiple of gpus_per_node=3"),
            (SimConfig(ep=4, ms=2, gpn=1), "gpus_per_node=1"),
        ]
        for cfg, expected in cases:
            with self.subTest(cfg=(cfg.ep, cfg.ms, cfg.pp, cfg.gpn, cfg.order)):
                self.assertEqual(LayoutOracle(cfg).refusal(), expected)
        oracle = LayoutOracle(SimConfig(ep=4, ms=2, pp=2, gpn=2))  # rank = s*8 + p*4 + e
        self.assertEqual(oracle.sharding_group(5), (4, 5, 6, 7, 12, 13, 14, 15))
        self.assertEqual(oracle.same_card(5), (5, 7, 13, 15))
        self.assertEqual(oracle.moe_group(5), (5, 13))

    def test_plan_accepts_exactly_the_oracle_layouts(self):
        for name, cfg in sorted(GRID.items()):
            with self.subTest(case=name):
                if REFUSAL[name] is None:
                    HierarchicalCommPlan.from_topology(cfg.topology(), cfg.gpn)
                    continue
                with raises(ValueError) as info:
                    HierarchicalCommPlan.from_topology(cfg.topology(), cfg.gpn)
                self.assertIn(REFUSAL[name], str(info.value))
                self.assertIn("comm_group_call_opt", str(info.value))

    def test_every_valid_layout_matches_the_oracle(self):
        for name in sorted(VALID):
            with self.subTest(case=name):
                check_layouts_against_oracle(self, name, VALID[name])

    def test_optimizer_records_the_layout_schedule(self):
        for name in RECORDED:
            with self.subTest(case=name):
                cfg = VALID[name]
                results, world = run_world(cfg, mode="record")
                _schedule_assertions(self, name, cfg, world, results)
                for res in results:
                    self.assertEqual(
                        tuple(sorted(sharded_core(res.optimizer).sharding_layout.owners.items())),
                        tuple(sorted(oracle_layout(cfg, LayoutOracle(cfg), sharded_core(
                            res.optimizer).comm_plan, res.rank).owners.items())),
                        f"[{name}] rank {res.rank}: owners differ from the oracle layout's")

    def test_invalid_layout_raises_at_construction(self):
        for name in sorted(INVALID):
            with self.subTest(case=name):
                with raises(ValueError, match="comm_group_call_opt") as info:
                    run_world(INVALID[name], mode="record", reraise_original=True)
                self.assertIn(REFUSAL[name], str(info.value))

    def test_three_steps_on_equal_off_and_reference(self):
        for name in NUMERIC:
            with self.subTest(case=name):
                base = VALID[name]
                on = SimConfig(**{**base.__dict__, "steps": 3, "clip": base.pp == 1,
                                  "via_fleet": True})
                off = SimConfig(**{**on.__dict__, "gpn": None})
                res_on, world = run_world(on)
                res_off, _ = run_world(off)
                expected = reference_values(on)
                for a, b in zip(res_on, res_off):
                    d_off = max_abs_diff(a.values, b.values)
                    d_ref = max_abs_diff(a.values, expected[a.rank])
                    self.assertLessEqual(d_off, TOL, f"[{name}] rank {a.rank}: option on vs "
                                                     f"off max |d|={d_off:.3e}")
                    self.assertLessEqual(d_ref, TOL, f"[{name}] rank {a.rank}: vs the "
                                                     f"single-process reference {d_ref:.3e}")
                _schedule_assertions(self, name, on, world)


class TestGroupCall(unittest.TestCase):
    """Modes, owners' gradients and refusals; each table row runs as a subtest."""

    def test_owner_gradient_is_group_mean_after_hierarchical_reduce(self):
        for name, cfg in OWNER_GRAD_CASES.items():
            with self.subTest(case=name):
                results, _ = run_world(cfg, body=_owner_grads)
                means = Reference(cfg.expert_of_rank()).mean_grads(0)
                owned = 0
                for rank, (coord, grads) in enumerate(results):
                    for key, grad in grads.items():
                        slot = (None, key) if key.startswith("dense.") else (coord, key)
                        np.testing.assert_allclose(
                            grad, means[slot], rtol=0, atol=1e-6,
                            err_msg=f"owner rank {rank}: {key} after the two-level reduce "
                                    "is not the group mean")
                        owned += 1
                self.assertGreaterEqual(owned, 4, f"[{name}] too few owned matrices checked")

    def test_overlap_keeps_the_hierarchical_reduce(self):
        # Without the fix, the hooks reduced every dense Muon buffer flat in the
        # sharding group: no intra-node / cross-node phase at all.
        cfg = SimConfig(ep=4, ms=2, gpn=2, overlap=True, steps=1, clip=False, via_fleet=False)
        results, world = run_world(cfg, mode="record")
        phases = {rec.phase for res in results for rec in world.traces[res.rank]
                  if rec.group_seq is not None}
        self.assertLessEqual({"intra_node_reduce", "cross_node_reduce"}, phases,
                             f"phases recorded under overlap: {sorted(map(str, phases))}")
        self.assertNotIn(f"reduce_to_owner[{list(range(8))}]", phases,
                         "a dense Muon buffer was reduced flat")

    def test_option_on_equals_off_across_modes(self):
        for name, base in MODE_CASES.items():
            with self.subTest(case=name):
                tol = 1e-2 if base.matrix_dtype == "bfloat16" else TOL
                res_on, world = run_world(base)
                res_off, _ = run_world(SimConfig(**{**base.__dict__, "gpn": None}))
                expected = reference_values(base)
                for a, b in zip(res_on, res_off):
                    self.assertLessEqual(max_abs_diff(a.values, b.values), tol,
                                         f"[{name}] rank {a.rank}: on != off")
                    self.assertLessEqual(max_abs_diff(a.values, expected[a.rank]), tol,
                                         f"[{name}] rank {a.rank}: != reference")
                report = world.check_schedule()
                self.assertTrue(report.ok, f"[{name}] {report.summary()}")

    def test_option_off_never_resolves_gpus_per_node(self):
        """Upstream bug 3: node size resolved with the option off crashed CPU hosts."""

        def boom(*args, **kwargs):
            raise AssertionError("gpus_per_node called with comm_group_call_opt off")

        cfg = SimConfig(ep=4, ms=2, gpn=None, via_fleet=False)
        # an unreadable PADDLE_LOCAL_SIZE too: the default resolver raises on it
        with mock.patch.dict(os.environ, {"PADDLE_LOCAL_SIZE": "abc"}):
            results, _ = run_world(cfg, mode="record", body=lambda c, s: sharded_core(
                build_rank(c, s, gpus_per_node=boom)[2]).comm_plan)
        self.assertEqual(results, [None] * cfg.world, "a plan was built with the option off")

    def test_option_on_reads_the_injected_gpus_per_node(self):
        def body(c, s):
            # after the world set PADDLE_LOCAL_SIZE from the config
            os.environ["PADDLE_LOCAL_SIZE"] = "abc"
            plan = build_rank(c, s, gpus_per_node=lambda: 2)[2].comm_plan
            return plan.gpus_per_node, plan.num_nodes

        cfg = SimConfig(ep=4, ms=2, gpn=4, via_fleet=False)
        with mock.patch.dict(os.environ):
            results, _ = run_world(cfg, mode="record", body=body)
        self.assertEqual(results, [(2, cfg.world // 2)] * cfg.world,
                         "the plan must use the injected node size, not the environment")

    def test_bad_local_size_env_raises(self):
        for value, fragment in BAD_ENV:
            with self.subTest(case=repr(value)):
                def body(c, s, value=value):
                    # after the world set PADDLE_LOCAL_SIZE from the config
                    os.environ["PADDLE_LOCAL_SIZE"] = value
                    build_rank(c, s)

                with mock.patch.dict(os.environ), raises(ValueError) as info:
                    run_world(SimConfig(ep=4, ms=2, gpn=2), mode="record", body=body,
                              reraise_original=True)
                self.assertIn(fragment, str(info.value))
                if value != "1":
                    self.assertIn("PADDLE_LOCAL_SIZE", str(info.value))

    def test_bad_layout_raises_with_actionable_message(self):
        for i, (cfg, exc, fragment) in enumerate(BAD_LAYOUTS):
            with self.subTest(case=f"bad{i}"):
                with raises(exc) as info:
                    run_world(cfg, mode="record", reraise_original=True)
                self.assertIn(fragment, str(info.value))
                self.assertIn("comm_group_call_opt", str(info.value))

    def test_tensor_parallel_with_group_call_raises(self):
        def body(cfg, strategy):
            hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
            net = TinyMoE(hcg.get_expert_parallel_rank(), hcg.get_moe_sharding_parallel_group())
            mso.MuonShardingOptimizer(make_muon(list(net.parameters())), TensorParallelHcg(hcg),
                                      strategy)

        with raises(ValueError, match="mp_degree=2"):
            run_world(SimConfig(ep=4, ms=2, gpn=2), mode="record", body=body,
                      reraise_original=True)

    def test_groups_created_identically_on_every_rank(self):
        cfg = SimConfig(ep=8, ms=2, gpn=4)
        _, world = run_world(cfg, mode="record")
        creations = [[(r.group_id, tuple(r.group_ranks)) for r in t if r.op == "new_group"]
                     for t in world.traces]
        for rank, created in enumerate(creations):
            self.assertEqual(created, creations[0],
                             f"rank {rank} created groups in another order than rank 0")
        oracle = LayoutOracle(cfg)
        created = {ranks for _, ranks in creations[0]}
        for rank in range(cfg.world):
            for group in (oracle.node(rank), oracle.same_card(rank)):
                self.assertIn(group, created, f"group {group} of rank {rank} was never created")


class _OtherTopologyHcg:
    """The hcg with another MoE topology: same stage size, different ranks."""

    def __init__(self, inner, topo) -> None:
        self._inner, self._moe_topo = inner, topo

    def __getattr__(self, item):
        return getattr(self._inner, item)


class TestShardingGroupSoundness(unittest.TestCase):
    def test_plan_stage_of_equal_size_but_other_ranks_is_refused(self):
        # Bug: the check compares group sizes, not ranks. The hcg has MoE order
        # (moe_sharding, pipe, expert): rank 0's stage is {0..3, 8..11}; the
        # plan reads a pipe-first topology whose stage 0 is {0..7} (also 8).
        cfg = SimConfig(ep=4, ms=2, pp=2, gpn=4)
        other = SimConfig(ep=4, ms=2, pp=2, order=("pipe", "moe_sharding", "expert"))

        def body(cfg, strategy):
            hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
            net = TinyMoE(hcg.get_expert_parallel_rank(), hcg.get_moe_sharding_parallel_group())
            MuonShardingOptimizer(make_muon(list(net.parameters()), clip=False),
                                  _OtherTopologyHcg(hcg, other.topology()), strategy)

        with raises(ValueError, match="the routing plan's stage group") as info:
            run_world(cfg, mode="record", body=body, reraise_original=True)
        self.assertIn("comm_group_call_opt", str(info.value))


if __name__ == "__main__":
    unittest.main()
