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
"""sharding_configs.machine_balanced_2d_partition=True in MuonShardingOptimizer.

Simulated worlds (threads, real data): emulated machines come from
PADDLE_LOCAL_SIZE (node = global rank // GPUs per node). The owners the
optimizer uses must be what develop's machine-balanced rule gives on the
job-wide input, the same on every rank, and training must still equal the
single-process reference.
"""

from __future__ import annotations

import math
import types
import unittest
from unittest import mock

import paddle
import paddle.distributed as dist
from paddle.distributed.fleet.utils.log_util import logger

from muon_sim_runner import (
    SimConfig,
    build_rank,
    max_abs_diff,
    reference_values,
    run_world,
    train_steps,
)
from muon_test_compat import sharded_core

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import build
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.layout import (
    LayoutSettings,
    ParamMeta,
    ShardingLayout,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_optimizer import (
    MuonShardingOptimizer,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.settings import dtype_itemsize
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.owners import (
    machine_balanced_owner_indices,
)

# fp32 end to end; only the reduce order differs from the reference (as in
# the optimizer suite's equivalence cases)
FP32_TOL = 1e-5
GPN = 2  # emulated GPUs per machine
BUFFER_MB = 1  # SimConfig's fused comm_buffer_size_MB


def _cfg(**kw) -> SimConfig:
    base = dict(ep=2, ms=2, local_size=GPN, machine_balanced=True,
                partition="upstream_greedy", steps=2, via_fleet=False)
    base.update(kw)
    return SimConfig(**base)


def _body(cfg, strategy):
    hcg, net, opt, coord = build_rank(cfg, strategy)
    core = sharded_core(opt)
    # this rank's view of the rule's input, collected here from the model
    groups: dict = {}
    for p in net.parameters():
        info = core._muon_param_info_map[p.name]
        if not (info.use_muon or getattr(info, "use_hyperball", False)):
            continue
        color = getattr(p, "color", None)
        if isinstance(color, dict):
            key = (color["color"], tuple(color["group"].ranks))
        else:
            key = (None, tuple(hcg.get_sharding_parallel_group().ranks))
        groups.setdefault(key, []).append(
            (p.name, math.prod(p.shape), str(p.dtype), dtype_itemsize(p.dtype)))
    train_steps(cfg, hcg, net, opt)
    return (dist.get_rank(), coord, net.named_values(), core.owner_map, groups)


class TestMachineBalancedOwners(unittest.TestCase):
    def _run(self, cfg):
        with self.assertLogs(logger, "INFO") as logs:
            results, world = run_world(cfg, body=_body)
        return results, world, logs.output

    def _check(self, cfg, label):
        results, world, logs = self._run(cfg)
        info: dict = {}
        for _, _, _, _, groups in results:
            for key, entries in groups.items():
                info.setdefault(key, entries)
        machines = {r: r // GPN for r in range(cfg.world)}
        placed, _ = machine_balanced_owner_indices(info, machines, BUFFER_MB)

        for rank, _, _, owners, groups in results:
            expected = {name: key[1][i] for key in groups
                        for i, names in placed[key].items() for name in names}
            self.assertEqual(owners, expected, (
                f"[{label}] rank {rank}: owners differ from develop's machine-balanced "
                f"rule on the job-wide input"))
        owner_machines = {owner // GPN for *_, owners, _ in results for owner in owners.values()}
        self.assertEqual(owner_machines, set(range(cfg.world // GPN)), (
            f"[{label}] owners sit on machines {sorted(owner_machines)}; the rule should "
            f"use all {cfg.world // GPN}"))

        expected_values = reference_values(cfg)
        for rank, coord, values, _, _ in results:
            diff = max_abs_diff(values, expected_values[rank])
            self.assertLessEqual(diff, FP32_TOL, (
                f"[{label}] rank {rank} (expert coord {coord}) ends {diff:.3e} away from "
                f"single-process Muon (tol {FP32_TOL})"))

        # one gather over the global group (lengths, then data) on every rank
        everyone = tuple(range(cfg.world))
        for rank, trace in enumerate(world.traces):
            gathers = [r for r in trace if r.api == "dist.all_gather_object"]
            self.assertEqual([r.group_ranks for r in gathers], [everyone, everyone], (
                f"[{label}] rank {rank}: expected one all_gather_object over the global "
                f"group, got {[(r.op, r.group_ranks) for r in gathers]}"))

        summary = [line for line in logs if "machine-balanced" in line]
        self.assertEqual(len(summary), 1, f"[{label}] global rank 0 logs one summary: {logs}")
        for m in range(cfg.world // GPN):
            self.assertIn(f"machine {m}:", summary[0])
        return results

    def test_two_machines_four_ranks(self):
        results = self._check(_cfg(), "ep2 ms2, 2 machines")
        # develop's rule without the option puts every bucket on group rank 0
        # (one active rank each here): rank 3 would own nothing
        self.assertTrue(any(o == 3 for *_, owners, _ in results for o in owners.values()),
                        "the machine-balanced rule should give rank 3 (machine 1) a matrix")

    def test_pipeline_gives_several_groups_per_colour(self):
        # pp2: each stage has its own default-colour group; 4 machines of 2
        self._check(_cfg(pp=2, clip=False), "ep2 ms2 pp2, 4 machines")

    def test_with_comm_group_call_opt(self):
        # the default colour then routes hierarchically, from any owner
        self._check(_cfg(gpn=GPN, local_size=None), "ep2 ms2 group call, 2 machines")

    def test_option_off_gathers_nothing(self):
        def body(cfg, strategy):
            build_rank(cfg, strategy)

        _, world = run_world(_cfg(machine_balanced=False), mode="record", body=body)
        for rank, trace in enumerate(world.traces):
            self.assertFalse([r for r in trace if r.api == "dist.all_gather_object"],
                             f"rank {rank} gathered with machine_balanced_2d_partition off")


def _owners(params, group_ranks, rank=0):
    """build.machine_balanced_owners on ``params`` of one colour group, one GPU per node."""
    group = types.SimpleNamespace(ranks=list(group_ranks))
    return build.machine_balanced_owners(
        params, {p.name: (None, group) for p in params},
        {p.name: len(p.shape) == 2 for p in params}, rank, 1, BUFFER_MB)


def _param(name, shape):
    p = paddle.create_parameter(shape, "float32")
    p.name = name
    return p


class TestMachineBalancedGather(unittest.TestCase):
    def test_one_rank_needs_no_gather(self):
        params = [_param("mb_a", [8, 4]), _param("mb_b", [4, 4]), _param("mb_bias", [4])]
        gather = mock.Mock(side_effect=AssertionError("gathered in a one-rank job"))
        with mock.patch.object(dist, "get_world_size", lambda *a: 1), \
                mock.patch.object(dist, "all_gather_object", gather):
            owners = _owners(params, [0])
        # one machine, one bucket of 2 tiny matrices: develop's active = 1 rank
        self.assertEqual(owners, {"mb_a": 0, "mb_b": 0})

    def test_group_members_disagreeing_is_an_error(self):
        params = [_param("mb_a", [8, 4])]

        def gather(out, obj, group=None):
            rank, machine, mine = obj
            other = {k: [("mb_other", 32, "paddle.float32", 4)] for k in mine}
            out.extend([obj, (1, 1, other)])

        with mock.patch.object(dist, "get_world_size", lambda *a: 2), \
                mock.patch.object(dist, "all_gather_object", gather):
            with self.assertRaisesRegex(ValueError, r"hold different keep-whole parameters"):
                _owners(params, [0, 1])


class TestFixedOwnersInLayout(unittest.TestCase):
    def _metas(self):
        return [ParamMeta("w0", (4, 4), "float32", None, True),
                ParamMeta("w1", (8, 4), "float32", None, True)]

    def test_fixed_owners_are_used(self):
        layout = ShardingLayout.build(self._metas(), {None: [2, 5]}, 5, LayoutSettings(),
                                      fixed_owners={"w0": 5, "w1": 2})
        self.assertEqual(layout.owners, {"w0": 5, "w1": 2})
        self.assertEqual(layout.partitions[None].method, "machine_balanced")
        # w1 (32 fp32 elements, momentum only) on group index 0, w0 on index 1
        self.assertEqual(layout.partitions[None].state_bytes, [32 * 4, 16 * 4])

    def test_missing_owner_is_an_error(self):
        with self.assertRaisesRegex(ValueError, "no entry for Muon parameter w1"):
            ShardingLayout.build(self._metas(), {None: [0, 1]}, 0, LayoutSettings(),
                                 fixed_owners={"w0": 1})

    def test_owner_outside_group_is_an_error(self):
        with self.assertRaisesRegex(ValueError, "rank 7, outside its colour group"):
            ShardingLayout.build(self._metas(), {None: [0, 1]}, 0, LayoutSettings(),
                                 fixed_owners={"w0": 1, "w1": 7})


if __name__ == "__main__":
    unittest.main()
