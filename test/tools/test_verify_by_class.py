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
"""``verify`` of schedule-only worlds by class of rank.

The real optimizer runs on one rank per class; every rank's layout is
rebuilt and the predicted schedules are checked against each other. The
reference is the per-rank method: every rank of the same world recorded by
the simulated world.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import unittest
from unittest import mock

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for _p in (os.path.join(REPO, "test"), os.path.join(REPO, "test", "collective", "fleet")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from mock.simulated_world import SimulatedWorld  # noqa: E402
from muon_sim_runner import SimConfig, run_world  # noqa: E402

from paddle.distributed.fleet.utils.log_util import logger  # noqa: E402

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.layout import (  # noqa: E402
    ShardingLayout,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.step_plan import (  # noqa: E402
    CommOp,
)
from paddle_muon_ext.tools import verify  # noqa: E402
from paddle_muon_ext.tools.args import MuonCommConfig  # noqa: E402

# 16 ranks on 4 nodes of 4 cards: classes of several sizes, both paths.
LAYOUT = dict(ep=4, moe_sharding=4, pp=1, gpus_per_node=4)
STEPS = 2


def _quiet(*_args) -> None:
    pass


class _Layouts:
    """Every rank's layout of LAYOUT (hierarchical), from a recorded rank 0."""

    _cache = None

    @classmethod
    def get(cls):
        if cls._cache is None:
            cfg = MuonCommConfig(model=verify.VERIFY_MODEL, **LAYOUT)
            plan = cfg.build_plan()
            sim = SimConfig(ep=4, ms=4, pp=1, gpn=4, steps=STEPS, clip=True)
            results, world = run_world(sim, mode="record", ranks=[0])
            rep = verify._layout_of(results[0].optimizer)
            cls._cache = plan, verify.world_layouts(rep, plan), world.traces[0]
        return cls._cache


class TestVerifyByClass(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls._level = logger.level
        logger.setLevel(logging.ERROR)

    @classmethod
    def tearDownClass(cls) -> None:
        logger.setLevel(cls._level)

    def test_by_class_counts_what_every_rank_records(self) -> None:
        # LAYOUT; and ep=1 (no expert colour: a stage's ranks share one layout)
        for layout in (LAYOUT, dict(ep=1, moe_sharding=8, pp=1, gpus_per_node=4)):
            cfg = MuonCommConfig(model=verify.VERIFY_MODEL, **layout)
            summary = verify.run_verify(cfg, steps=STEPS, data_max_ranks=0, progress=_quiet)
            self.assertEqual(summary["status"], "PASS", f"{layout}: {summary['problems']}")
            self.assertEqual(summary["mode"], "schedule-only")
            for label, gpn in (("hierarchical", cfg.gpus_per_node), ("flat", None)):
                checked = summary["configuration"]  # the optimizer's defaults: verify's
                sim = SimConfig(ep=cfg.ep, ms=cfg.moe_sharding, pp=1, gpn=gpn, steps=STEPS,
                                clip=True, partition=checked["muon_partition_strategy"],
                                buffer_mb=checked["comm_buffer_size_MB"])
                _, world = run_world(sim, mode="record")
                recorded = verify._phase_counts(world)
                self.assertEqual(summary["phase_counts"][label], recorded,
                                 f"{layout} {label}: collectives per phase checked by class "
                                 "differ from those every rank records")
                self.assertLess(summary["rank_classes"][label], cfg.world_size,
                                f"{layout} {label}: every rank is its own class: nothing saved")
                self.assertEqual(summary["ranks_recorded"][label],
                                 summary["rank_classes"][label],
                                 f"{layout} {label}: not every class had its representative's "
                                 "recording compared with its layout")

    def test_world_layouts_are_the_optimizers(self) -> None:
        plan, layouts, _ = _Layouts.get()
        sim = SimConfig(ep=4, ms=4, pp=1, gpn=4, steps=1, clip=True)
        results, _ = run_world(sim, mode="record", ranks=[5, 14])
        for rank in (5, 14):
            own = verify._layout_of(results[rank].optimizer)
            self.assertEqual(verify.layout_summary(layouts[rank]), verify.layout_summary(own),
                             f"rank {rank}: rebuilt layout differs from its optimizer's")

    def test_signature_separates_owned_matrices_and_merges_renamed_ranks(self) -> None:
        _, layouts, _ = _Layouts.get()
        owned = {r: verify.owned_params(lay) for r, lay in layouts.items()}
        self.assertGreater(len(set(owned.values())), 1, "the layout needs different owners")
        sig = {r: verify.rank_signature(lay) for r, lay in layouts.items()}
        for a in sig:
            for b in sig:
                if owned[a] != owned[b]:
                    self.assertNotEqual(sig[a], sig[b], f"ranks {a} and {b} own different "
                                        "matrices but share a class")
        self.assertLess(len(set(sig.values())), len(sig), "no two ranks share a class")

    def test_signature_separates_the_root_of_a_collective(self) -> None:
        def fake(rank: int, root: int):
            op = CommOp("step", "broadcast_from_owner[[0, 1]]", "broadcast", (0, 1) if rank < 2
                        else (2, 3), root, "float32", 8)

            class Fake:
                slice_buffers = []
                muon_buckets = []

                def schedule(self):
                    return [op]

            lay = Fake()
            lay.rank = rank
            return lay

        self.assertNotEqual(verify.rank_signature(fake(0, 0)), verify.rank_signature(fake(1, 0)),
                            "the root of a broadcast and a receiver must be different classes")
        self.assertEqual(verify.rank_signature(fake(1, 0)), verify.rank_signature(fake(3, 2)),
                         "receivers of renamed groups must share a class")

    def test_a_rank_that_issues_nothing_on_its_group_is_named(self) -> None:
        _, layouts, _ = _Layouts.get()
        broken = dict(layouts)
        victim = 7
        lay = layouts[victim]
        schedule = lay.schedule()
        dropped = schedule[-1]

        class Short:
            rank = victim

            def schedule(self):
                return [op for op in schedule if op.group != dropped.group]

        broken[victim] = Short()
        problems, _, _ = verify.check_world_schedules(broken)
        self.assertTrue(any("[7]" in p and "issue nothing" in p for p in problems), problems)
        ok, total, _ = verify.check_world_schedules(layouts)
        self.assertEqual(ok, [], "the unbroken world must be consistent")
        self.assertGreater(total, 0, "nothing was checked")

    def test_a_different_root_or_a_foreign_group_is_named(self) -> None:
        _, layouts, _ = _Layouts.get()
        victim = 9
        schedule = layouts[victim].schedule()
        i = next(i for i, op in enumerate(schedule) if op.root is not None and len(op.group) > 2)
        other_root = next(r for r in schedule[i].group if r != schedule[i].root)
        changed = list(schedule)
        changed[i] = dataclasses.replace(schedule[i], root=other_root)
        foreign = CommOp("step", "x", "broadcast", (0, 1), 0, "float32", 4)

        class Wrong:
            rank = victim

            def __init__(self, ops):
                self.ops = ops

            def schedule(self):
                return self.ops

        for ops, fragment in ((changed, f"rank {victim} collective #"),
                              ([*schedule, foreign], f"rank {victim} issues broadcast (x) on "
                               "group [0, 1] it is not in")):
            problems, _, _ = verify.check_world_schedules({**layouts, victim: Wrong(ops)})
            self.assertTrue(any(fragment in p for p in problems), problems)

    def test_optimizer_that_strays_from_its_layout_fails(self) -> None:
        # The optimizer runs the real schedule; predictions gain one collective
        # it does not issue, so every representative's recording differs.
        real = ShardingLayout.schedule

        def one_more(self):
            ops = real(self)
            return ops + [dataclasses.replace(ops[-1])] if ops else ops

        cfg = MuonCommConfig(model=verify.VERIFY_MODEL, **LAYOUT)
        with mock.patch.object(ShardingLayout, "schedule", one_more):
            summary = verify.run_verify(cfg, steps=1, data_max_ranks=0, progress=_quiet)
        self.assertEqual(summary["status"], "FAIL", "a recording unlike the layout passed")
        self.assertFalse(summary["layout_schedule_hierarchical_ok"])
        self.assertTrue(any("the layout predicts" in p for p in summary["problems"]),
                        summary["problems"])

    def test_representative_groups_must_be_the_topologys(self) -> None:
        plan, layouts, _ = _Layouts.get()
        rep = layouts[0]
        odd = dataclasses.replace(rep, groups={**rep.groups, None: tuple(range(8))})
        with self.assertRaisesRegex(ValueError, "not the topology's"):
            verify.world_layouts(odd, plan)

    def test_ranks_subset_needs_record_mode(self) -> None:
        world = SimulatedWorld(2, mode="data")
        with self.assertRaisesRegex(ValueError, "needs mode='record'"):
            world.run(lambda rank: rank, ranks=[0])
        world = SimulatedWorld(4, mode="record")
        self.assertEqual(world.run(lambda rank: rank * 10, ranks=[3, 1]), [None, 10, None, 30],
                         "only the given ranks run")


if __name__ == "__main__":
    unittest.main()
