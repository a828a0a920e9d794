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
"""Mutation-audit gaps in the Paddle 3.3.1 fleet integration (not exported:
develop's HybridParallelOptimizer does this itself). Each test failed on the
bug noted in it."""

from __future__ import annotations

import threading
import unittest
from unittest import mock

import paddle
from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer import (
    hybrid_parallel_optimizer as hpo,
)

from muon_sim_runner import SimConfig, build_rank, run_world, sharded_core, train_steps
from muon_tiny_moe import batch

from paddle_muon_ext.compat_paddle_3_3 import fleet_integration


class TestDataParallelAllReduce(unittest.TestCase):
    def test_dp_all_reduce_covers_exactly_owned_matrices_and_local_slices(self):
        # Bug: the dp all-reduce gets every parameter (or only the owned
        # matrices). With dp_degree > 1 each rank must all-reduce, after the
        # sharding reduce, what it updates: its owned Muon matrices and its
        # initialised 1-D slices - nothing else, nothing twice. (A slice is
        # initialised by the first step's slice-gradient assignment, as with
        # Paddle's own sharding V2: the check runs at the second step.)
        cfg = SimConfig(ep=2, ms=2, steps=1)
        seen: dict = {}
        lock = threading.Lock()

        def record(params, hcg):
            with lock:
                seen[paddle.distributed.get_rank()] = list(params)

        def body(cfg, strategy):
            hcg, net, opt, coord = build_rank(cfg, strategy)
            self.assertIsInstance(opt, fleet_integration.MuonHybridParallelOptimizer)
            train_steps(cfg, hcg, net, opt)
            opt._dp_enable = True  # what dp_degree > 1 turns on
            net(paddle.to_tensor(batch(1, paddle.distributed.get_rank()))).backward()
            opt._hybrid_sync_grad(list(net.parameters()))
            core = sharded_core(opt)
            layout = core.sharding_layout
            owned = {n for n, r in core.owner_map.items() if r == paddle.distributed.get_rank()}
            # FusedCommBuffer's rule: a rank holds a slice where its shard
            # overlaps the parameter's padded range (padding alone counts).
            slices = set()
            for p in net.parameters():
                if p.name not in core.owner_map:
                    buf = layout.slice_buffer_of(p.name)
                    if buf.holds_slice(p.name, layout.group_index(buf.colour)):
                        slices.add(p.name)
            return owned, slices

        with mock.patch.object(fleet_integration, "fused_allreduce_gradients", record):
            results, _ = run_world(cfg, body=body)
        for rank, (owned, slices) in enumerate(results):
            names = [p.name for p in seen[rank]]
            self.assertEqual(len(names), len(set(names)), f"rank {rank}: {names} repeats")
            self.assertEqual(set(names), owned | slices, (
                f"rank {rank}: dp all-reduce of {sorted(names)}; it owns {sorted(owned)} "
                f"and holds slices of {sorted(slices)}"))
            self.assertTrue(owned or slices, f"rank {rank} updates nothing")


class TestShardingClassesRestored(unittest.TestCase):
    def test_restored_after_an_odd_number_of_constructions(self):
        # Bug: the scoped patch swaps V1/V2 back crosswise (or toggles), which
        # an even number of constructions hides.
        originals = (hpo.DygraphShardingOptimizer, hpo.DygraphShardingOptimizerV2)
        for count in (1, 3):
            for _ in range(count):
                with fleet_integration._sharding_classes_pass_through():
                    self.assertIsNot(hpo.DygraphShardingOptimizer, originals[0])
                    self.assertIsNot(hpo.DygraphShardingOptimizerV2, originals[1])
            self.assertIs(hpo.DygraphShardingOptimizer, originals[0],
                          f"after {count} construction(s) V1 is not Paddle's class")
            self.assertIs(hpo.DygraphShardingOptimizerV2, originals[1],
                          f"after {count} construction(s) V2 is not Paddle's class")
        with self.assertRaises(RuntimeError), fleet_integration._sharding_classes_pass_through():
            raise RuntimeError("construction failed")
        self.assertEqual((hpo.DygraphShardingOptimizer, hpo.DygraphShardingOptimizerV2),
                         originals, "a failed construction leaked the patch")


if __name__ == "__main__":
    unittest.main()
