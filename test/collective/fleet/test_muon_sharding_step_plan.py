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
"""The step plan is the program: what every rank executes is ``layout.schedule()``.

The optimizer runs ``for phase in plan: run(phase)`` and the tools read the
same plan's ops, so on every rank of each layout (flat, hierarchical, backward
hooks, staged sync flat and hierarchical, MoE colours, pp > 1) the labelled
collectives the simulated world records in each step equal the schedule
collective by collective (hook-launched ones as a multiset: they follow the
backward pass), the global-norm clip's all-reduces included.
"""

from __future__ import annotations

import os
import unittest
from collections import Counter
from contextlib import contextmanager

from mock.fake_hcg import PIPE_FIRST_MOE_ORDER
from muon_sim_runner import SimConfig, run_world
from muon_test_compat import sharded_core

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_settings import (
    OVERLAP_SYNC_ENV,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_types import (
    PHASE_CLIP,
    TRIGGER_BACKWARD,
)

# name -> (config, FLAGS_muon_sharding_overlap_optimize_and_sync, staged sync expected)
CASES = {
    "flat-plain-sync": (SimConfig(ep=1, ms=4, steps=2), "0", False),
    "flat-moe-staged": (SimConfig(ep=2, ms=2, steps=2), "1", True),
    "hierarchical": (SimConfig(ep=4, ms=2, gpn=2, steps=2), "1", False),
    "hierarchical-staged": (SimConfig(ep=4, ms=2, gpn=2, steps=2,
                                      overlap_sync_group_call=True), "1", True),
    "hooks-overlap": (SimConfig(ep=4, ms=2, gpn=2, overlap=True, steps=2), "1", False),
    "pp2-moe-staged": (SimConfig(ep=2, ms=2, pp=2, order=PIPE_FIRST_MOE_ORDER, steps=2,
                                 via_fleet=False), "1", True),
}


@contextmanager
def _overlap_sync_flag(value: str):
    saved = os.environ.get(OVERLAP_SYNC_ENV)
    os.environ[OVERLAP_SYNC_ENV] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(OVERLAP_SYNC_ENV, None)
        else:
            os.environ[OVERLAP_SYNC_ENV] = saved


def _executed(trace) -> list:
    # A step's collectives carry their phase's label; construction's
    # (group creation, the rank agreement) carry none.
    return [(r.phase, r.op, tuple(sorted(r.group_ranks)), r.root, r.dtype, r.numel)
            for r in trace if r.group_seq is not None and r.phase is not None]


class TestExecutedStepIsThePlan(unittest.TestCase):
    """Every rank executes exactly its layout's schedule, in the plan's order."""

    def test_every_rank_executes_its_schedule(self):
        for name, (cfg, flag, staged) in CASES.items():
            with self.subTest(case=name):
                with _overlap_sync_flag(flag):
                    results, world = run_world(cfg, mode="record")
                self.assertTrue(world.check_schedule().ok, name)
                for res in results:
                    self._check_rank(name, cfg, staged, res.rank,
                                     sharded_core(res.optimizer).sharding_layout,
                                     world.traces[res.rank])

    def _check_rank(self, name, cfg, staged, rank, layout, trace) -> None:
        where = f"[{name}] rank {rank}"
        self.assertEqual(layout.staged_sync, staged, where)
        schedule = layout.schedule()
        clip = [op for op in schedule if op.phase == PHASE_CLIP]
        # HybridParallelClipGrad: the norm twice over the sharding group, once over pipe
        self.assertEqual([op.op for op in clip], ["all_reduce"] * (2 + (cfg.pp > 1)), where)
        got = _executed(trace)
        per_step = len(schedule)
        self.assertEqual(len(got), per_step * cfg.steps,
                         f"{where}: executed {len(got)} collectives in {cfg.steps} steps, "
                         f"the plan has {per_step} per step")
        hooks = sum(1 for op in schedule if op.trigger == TRIGGER_BACKWARD)
        self.assertEqual(hooks > 0, cfg.overlap, where)
        want = [op.key() for op in schedule]
        for step in range(cfg.steps):
            chunk = got[step * per_step:(step + 1) * per_step]
            self.assertEqual(Counter(chunk[:hooks]), Counter(want[:hooks]),
                             f"{where} step {step}: hook-launched collectives")
            self.assertEqual(chunk[hooks:], want[hooks:],
                             f"{where} step {step}: executed != the plan's schedule")


if __name__ == "__main__":
    unittest.main()


class TestBackwardPhasesOfTheLayout(unittest.TestCase):
    def test_only_slice_buffers_shared_by_several_ranks_get_a_backward_reduce_scatter(self):
        """With comm_overlap the hooks reduce-scatter each element-wise buffer
        in backward; a buffer whose group is this rank alone holds its result
        already, so the plan (the data the executors and the tools read) has
        no backward phase for it."""
        from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_layout import (
            LayoutSettings,
            ParamMeta,
            ShardingLayout,
        )

        params = [ParamMeta("d.w", (8, 8), "float32", None, True),
                  ParamMeta("d.b", (8,), "float32", None, False),
                  ParamMeta("e.w", (8, 8), "float32", "moe", True),
                  ParamMeta("e.b", (8,), "float32", "moe", False)]
        settings = LayoutSettings(comm_overlap=True, comm_buffer_size_MB=1)
        # rows: the moe colour's group size (1: this rank alone)
        for moe_group in ((0,), (0, 1)):
            with self.subTest(moe_group=moe_group):
                layout = ShardingLayout.build(params, {None: (0, 1), "moe": moe_group}, 0,
                                              settings)
                slice_groups = {("slice", i): tuple(b.group)
                                for i, b in enumerate(layout.slice_buffers)}
                self.assertTrue(all(b.overlap for b in layout.slice_buffers))
                scattered = [ref for ph in layout.phases_of(TRIGGER_BACKWARD)
                             if ph.op == "reduce_scatter" for ref, _ in ph.items]
                self.assertEqual(sorted(scattered),
                                 sorted(r for r, g in slice_groups.items() if len(g) > 1))
                self.assertIn(("slice", 0), scattered, "the shared buffer is scattered")
