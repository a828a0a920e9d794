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
"""Develop's MuonShardingOptimizer surface, rule by rule.

Spec (develop's behaviour, written from its tests and the fork source it
descends from): the shared no-hook colours and the sync-only / overlap buffer
split; the config mirrors callers read on the sharding optimizer itself; the
group-call groups; the owner-sorted 2-D lists; ``overlap_optimize_and_sync``
(env flag, default on, forced off under ``comm_group_call_opt`` or without
Muon's staged API) whose stages are identical on every rank, never split a
Muon group key, and give bit-identical parameters to the plain path.

The overlapped and the plain path run the same kernels on the same inputs in
the same order per parameter, so their results are compared with
``np.array_equal`` (no tolerance): any difference is a routing or ordering bug.
"""

from __future__ import annotations

import dataclasses
import os
import types
import unittest
from contextlib import contextmanager
from unittest import mock

import numpy as np
import paddle

from muon_sim_runner import SimConfig, run_world
from muon_test_compat import fleet_optimizer, set_muon_sharding_options, sharded_core
from muon_tiny_moe import TinyMoE, _has_staged_api, _param, batch, make_muon

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import runtime as comm
from paddle_muon_ext.distributed.fleet.meta_optimizers import (
    muon_sharding_optimizer as mso,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_optimizer import (
    MuonShardingOptimizer,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.step_plan import (
    build_sync_stages,
    stage_element_limit,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import settings as job_log

FLAG = "FLAGS_muon_sharding_overlap_optimize_and_sync"
NO_HOOK = "dense_weight_no_hook"


@contextmanager
def overlap_flag(value: str | None):
    """``FLAGS_muon_sharding_overlap_optimize_and_sync`` as the optimizer reads it."""
    saved = os.environ.pop(FLAG, None)
    if value is not None:
        os.environ[FLAG] = value
    try:
        yield
    finally:
        os.environ.pop(FLAG, None)
        if saved is not None:
            os.environ[FLAG] = saved


def _fake_param(name, color="absent", shape=(4, 4)):
    p = types.SimpleNamespace(name=name, shape=list(shape))
    if color != "absent":
        p.color = color
    return p


def _fake_buffer(*params):
    return types.SimpleNamespace(params=list(params))


class TestSharedColours(unittest.TestCase):
    """§8.5: the helpers look at the first parameter only and keep order."""

    def test_no_hook_colours_are_develops(self):
        self.assertEqual(MuonShardingOptimizer._NO_HOOK_COLORS,
                         frozenset({"dense_weight_no_hook", "moe_weight_no_hook"}))

    def test_buffer_color_reads_the_first_parameter(self):
        colour_of = MuonShardingOptimizer._buffer_color
        cases = {
            "dict colour": (_fake_buffer(_fake_param("a", {"color": "x", "group": None}),
                                         _fake_param("b", {"color": "y"})), "x"),
            "dict without colour": (_fake_buffer(_fake_param("a", {"group": None})), None),
            "dict with -1": (_fake_buffer(_fake_param("a", {"color": -1})), -1),
            "plain string": (_fake_buffer(_fake_param("a", "dense_weight_no_hook")),
                             "dense_weight_no_hook"),
            "plain -1": (_fake_buffer(_fake_param("a", -1)), None),
            "plain None": (_fake_buffer(_fake_param("a", None)), None),
            "no colour attribute": (_fake_buffer(_fake_param("a")), None),
            "empty buffer": (_fake_buffer(), None),
        }
        for label, (buffer, want) in cases.items():
            with self.subTest(label):
                self.assertEqual(colour_of(buffer), want,
                                 f"{label}: _buffer_color gave {colour_of(buffer)!r}")

    def test_shared_colours_are_dict_colours_in_the_no_hook_set(self):
        params = [
            _fake_param("a", {"color": NO_HOOK, "group": None}),
            _fake_param("b", {"color": "moe_expert", "group": None}),
            _fake_param("c", "moe_weight_no_hook"),  # not a dict: ignored
            _fake_param("d", {"group": None}),
            _fake_param("e"),
        ]
        self.assertEqual(MuonShardingOptimizer._compute_shared_colors(params), {NO_HOOK})
        self.assertEqual(MuonShardingOptimizer._compute_shared_colors(params[1:]), set(),
                         "no dict no-hook colour: MTP sharing is off, nothing is shared")

    def test_select_sync_only_keeps_order(self):
        shared = {NO_HOOK, "moe_weight_no_hook"}
        bufs = [
            _fake_buffer(_fake_param("a", {"color": "moe_weight_no_hook"})),
            _fake_buffer(_fake_param("b", {"color": "other"})),
            _fake_buffer(_fake_param("c", {"color": NO_HOOK})),
            _fake_buffer(),
        ]
        got = MuonShardingOptimizer._select_sync_only_buffers(bufs, shared)
        self.assertEqual([id(b) for b in got], [id(bufs[0]), id(bufs[2])])

    def test_overlap_split_is_develops_with_or_without_comm_overlap(self):
        # §8.5: sync-only = 2-D then 1-D buffers of a shared colour, built
        # whether or not comm_overlap is on; overlap = the other fused 2-D
        # buffers (only without group call or with comm_overlap), then the
        # other 1-D buffers; one-rank groups are not dropped.
        from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.runtime import (
            ShardingRuntime,
        )

        m_default, m_shared, r_default, r_shared = (types.SimpleNamespace(n=n) for n in "abcd")
        state = ShardingRuntime(rank=0)
        state.muon_buckets = [types.SimpleNamespace(colour=None, buffers=[m_default]),
                              types.SimpleNamespace(colour=NO_HOOK, buffers=[m_shared])]
        state.rs_buffers = [r_shared, r_default]
        state.rs_colour = {id(r_shared): NO_HOOK, id(r_default): None}
        for overlap, group_call, want_overlap in (
                (False, False, "ac"), (True, False, "ac"), (False, True, "c"), (True, True, "ac")):
            with self.subTest(comm_overlap=overlap, group_call=group_call):
                surface = types.SimpleNamespace(_runtime=state, comm_overlap=overlap,
                                                use_group_call_opt=group_call)
                sync_only, over = MuonShardingOptimizer._overlap_split(surface)
                self.assertEqual([b.n for b in sync_only], ["b", "d"])
                self.assertEqual("".join(b.n for b in over), want_overlap)

    def test_colour_group_info_from_params(self):
        default = types.SimpleNamespace(ranks=[0, 1, 2, 3], rank=2)
        moe = types.SimpleNamespace(ranks=[1, 3], rank=-1)
        params = [_fake_param("a", {"color": "moe", "group": moe}),
                  _fake_param("b", {"color": "moe", "group": default}),
                  _fake_param("c", {"color": "nogroup"}),
                  _fake_param("d", {"color": -1, "group": moe}),
                  _fake_param("e", -1)]
        info = MuonShardingOptimizer._build_color_to_group_info_from_params(params, default)
        self.assertEqual(list(info), [None, "moe", "nogroup"],
                         "None first, then dict colours in first-seen order")
        self.assertIs(info["moe"]["group"], moe, "the first parameter of a colour names its group")
        self.assertEqual((info["moe"]["world_size"], info["moe"]["rank"]), (2, -1))
        self.assertIs(info["nogroup"]["group"], default)
        self.assertEqual((info[None]["world_size"], info[None]["rank"]), (4, 2))


class TestModuleHelpers(unittest.TestCase):
    def test_trainer_and_same_card_ranks(self):
        self.assertEqual(mso.get_trainer_ranks(5, 4), (1, range(4, 8)))
        self.assertEqual(mso.get_same_card_rank([1, 6, 7], 5, 4), 6,
                         "first rank of rank 5's machine (4..7) that is in the group")
        self.assertEqual(mso.get_same_card_rank([0, 1], 5, 4), -1)

    def test_gpus_per_node_reads_the_launcher(self):
        with mock.patch.dict(os.environ, {"PADDLE_LOCAL_SIZE": "4"}):
            self.assertEqual(mso.get_gpus_per_node(), 4)


class TestSyncStageBuilding(unittest.TestCase):
    """develop's _build_sync_stages on plain objects (every rank, same input)."""

    @staticmethod
    def _world():
        ps = {n: _fake_param(n, shape=s) for n, s in [
            ("a1", (16, 16)), ("a2", (16, 16)), ("b1", (8, 32)), ("c1", (32, 32)),
            ("e1", (16, 16)), ("e2", (4, 4))]}
        params_by_colour = {None: [ps["a1"], ps["b1"], ps["a2"], ps["c1"]],
                            "moe": [ps["e1"], ps["e2"]]}
        rank2params = {None: {0: [ps["a1"], ps["b1"]], 1: [ps["a2"]], 2: [ps["c1"]], 3: []},
                       "moe": {0: [ps["e1"], ps["e2"]]}}
        return ps, params_by_colour, rank2params

    def _build(self, rank, limit):
        ps, by_colour, rank2params = self._world()
        info = {None: {"group": "G", "world_size": 4, "rank": rank},
                "moe": {"group": "M", "world_size": 1, "rank": -1}}
        stages = build_sync_stages(by_colour, rank2params, info, lambda p: tuple(p.shape),
                                   limit)
        return ps, stages

    def test_limit_is_develops(self):
        self.assertEqual(stage_element_limit(1), 2**18)
        self.assertEqual(stage_element_limit(0), 256 * 2**18)
        self.assertEqual(stage_element_limit(-1), 256 * 2**18)

    def test_keys_merge_until_the_limit_and_are_never_split(self):
        ps, stages = self._build(rank=0, limit=600)
        self.assertEqual([s["kind"] for s in stages], ["2d", "2d", "2d"])
        # key (16,16): a1+a2 = 512 < 600, + (8,32) = 768 >= 600 closes stage 0
        self.assertEqual(stages[0]["keys"], [(16, 16), (8, 32)])
        self.assertEqual(stages[1]["keys"], [(32, 32)])
        self.assertEqual({r: [p.name for p in v] for r, v in stages[0]["rank2params"].items()},
                         {0: ["a1", "b1"], 1: ["a2"]}, "ranks without params are omitted")
        # key (16,16) spans both colours: rank 0 updates its e1 in the first
        # stage listing the key (stage 0), once; e2 in the moe stage
        self.assertEqual([p.name for p in stages[0]["local_params"]], ["a1", "e1", "b1"])
        self.assertEqual(stages[2]["keys"], [(16, 16), (4, 4)])
        self.assertEqual([p.name for p in stages[2]["local_params"]], ["e2"])

    def test_a_stage_closes_when_it_reaches_the_limit_exactly(self):
        # develop: merge keys until the accumulated numel >= limit. a1 + a2
        # (key (16, 16)) are 512 elements: with limit 512 that key closes
        # stage 0 alone; (8, 32) then starts the next stage.
        _, stages = self._build(rank=0, limit=512)
        dense = [s["keys"] for s in stages if s["color"] is None]
        self.assertEqual(dense[0], [(16, 16)],
                         f"a stage of exactly the limit (512) did not close: {dense}")
        self.assertEqual(dense[1][0], (8, 32))

    def test_stages_are_identical_on_every_rank_but_local_params(self):
        def shape(stages):
            return [(s["kind"], s.get("color"), s.get("keys"),
                     {r: [p.name for p in v] for r, v in s.get("rank2params", {}).items()})
                    for s in stages]

        per_rank = [self._build(rank, limit=600)[1] for rank in range(4)]
        for rank in range(1, 4):
            self.assertEqual(shape(per_rank[rank]), shape(per_rank[0]),
                             f"rank {rank} built other stages than rank 0")
        updated = [p.name for stages in per_rank for s in stages[:2] for p in s["local_params"]]
        self.assertEqual(sorted(updated), ["a1", "a2", "b1", "c1"] + ["e1"] * 4,
                         "every dense matrix is updated by exactly one rank; e1 (one-rank "
                         "moe group per rank) by every rank, in the stage of its key")

    def test_a_stage_whose_owners_are_empty_is_skipped(self):
        ps, by_colour, rank2params = self._world()
        rank2params[None] = {0: [], 1: [], 2: [], 3: []}
        info = {None: {"group": "G", "world_size": 4, "rank": 0},
                "moe": {"group": "M", "world_size": 1, "rank": -1}}
        stages = build_sync_stages(by_colour, rank2params, info, lambda p: tuple(p.shape),
                                   10**9)
        self.assertEqual([s["color"] for s in stages], ["moe"])


class _Pending:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self):
        self.log.append(("wait", self.name))


class TestStagedStepRefusesUnstagedParameters(unittest.TestCase):
    def test_the_public_step_names_owned_matrices_left_out_of_every_sync_stage(self):
        """The overlapped staged step raises, naming them, when a parameter with a
        gradient is in no sync stage (here: the layout's stages, from which develop's
        read-only _sync_stages is derived, lose the matrices after the first step),
        instead of leaving it silently un-updated."""
        cfg = SimConfig(ep=1, ms=2, via_fleet=False, clip=False)

        def body(cfg, strategy):
            hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
            rank = paddle.distributed.get_rank()
            net = TinyMoE(None, None)
            opt = MuonShardingOptimizer(make_muon(list(net.parameters()), clip=False), hcg,
                                        strategy)

            def train(step):
                net(paddle.to_tensor(batch(step, rank))).backward()
                opt.reduce_gradients(list(net.parameters()), hcg)
                opt.step()
                opt.clear_grad()

            train(0)
            staged = opt.overlap_optimize_and_sync
            layout = opt.sharding_layout
            shape_of = {p.name: p.shape for p in net.parameters()}
            layout._stages = tuple(
                dataclasses.replace(s, local_params=tuple(
                    n for n in s.local_params if s.kind == "1d" or len(shape_of[n]) != 2))
                for s in layout.sync_stages())
            owned = sorted(n for n, r in opt.owner_map.items() if r == rank)
            try:
                train(1)
            except AssertionError as error:
                return staged, owned, str(error)
            return staged, owned, None

        outcomes, _ = run_world(cfg, body=body, deadlock_timeout=20)
        for rank, (staged, owned, message) in enumerate(outcomes):
            self.assertTrue(staged, "the case needs the overlapped staged step")
            self.assertTrue(owned, f"rank {rank} owns a matrix")
            self.assertIsNotNone(message, f"rank {rank} stepped past parameters in no stage")
            self.assertIn(f"parameters {owned} have gradients but belong to no sync stage",
                          message)


class _FailingTask:
    def wait(self):
        raise RuntimeError("peer vanished")


class TestPendingCollective(unittest.TestCase):
    def test_wait_once_then_copies_back(self):
        calls = []
        pending = comm.PendingCollective([_Pending(calls, "t")], [None], "broadcast",
                                         lambda: calls.append("copy back"))
        pending.wait()
        pending.wait()
        self.assertEqual(calls, [("wait", "t"), "copy back"],
                         "the second wait must neither wait nor copy again")

    def test_failed_wait_dumps_the_recorder_and_raises(self):
        recorder = comm.get_flight_recorder()
        with mock.patch.object(recorder, "dump") as dump:
            with self.assertRaisesRegex(RuntimeError, "peer vanished"):
                comm.PendingCollective([_FailingTask()], [], "broadcast on group [0, 1]").wait()
        self.assertIn("broadcast on group [0, 1] raised RuntimeError: peer vanished",
                      dump.call_args[0][0])

    def test_failed_launch_dumps_the_recorder_and_raises(self):
        group = types.SimpleNamespace(nranks=2, ranks=[0, 1])

        recorder = comm.get_flight_recorder()
        with mock.patch.object(recorder, "dump") as dump, \
                mock.patch.object(comm._batch_isend_irecv, "_coalescing_manager",
                                  lambda g, tasks: contextmanager(lambda: (yield))()), \
                mock.patch.object(recorder, "start", return_value=None), \
                mock.patch.object(comm.dist, "broadcast",
                                  side_effect=RuntimeError("bad root")):
            with self.assertRaisesRegex(RuntimeError, "bad root"):
                comm.launch_coalesced("broadcast", [(paddle.zeros([2]), 0)], group)
        self.assertIn("raised RuntimeError: bad root", dump.call_args[0][0])


# --------------------------------------------------------------------------
# The real optimizer in the simulated world
# --------------------------------------------------------------------------
# A T-OV-like model: Linear widths cycling 512 -> 384 -> 640 (three Muon
# keys) plus two 300,000-element 1-D parameters, so that with 1 MB buffers the
# step has several 2-D and several 1-D stages.
WIDTHS = (64, 512, 384, 640, 64)


def _overlap_model_params():
    rng = np.random.RandomState(7)
    params = []
    for i, (fan_in, fan_out) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:])):
        params.append(_param(f"fc{i}.w", rng.uniform(-1, 1, (fan_in, fan_out)).astype("float32")
                             / np.sqrt(fan_in)))
        params.append(_param(f"fc{i}.b", np.zeros(fan_out, "float32")))
    for i in range(2):
        params.append(_param(f"extra{i}", rng.uniform(-0.1, 0.1, 300_000).astype("float32")))
    return params


def _overlap_loss(params, x):
    h = x
    for i in range(len(WIDTHS) - 1):
        h = paddle.tanh(paddle.matmul(h, params[2 * i]) + params[2 * i + 1])
    extra = (params[-2] * params[-1]).sum() * 1e-3
    return (h * h).mean() + extra


def _overlap_body(steps=3, group_call_opt_in=False):
    def body(cfg, strategy):
        hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
        params = _overlap_model_params()
        opt = MuonShardingOptimizer(make_muon(params), hcg, strategy)
        rank = paddle.distributed.get_rank()
        stages_after_first = None
        for step in range(steps):
            x = paddle.to_tensor(np.random.RandomState(100 * step + rank)
                                 .uniform(-1, 1, (4, WIDTHS[0])).astype("float32"))
            _overlap_loss(params, x).backward()
            opt.reduce_gradients(params, hcg)
            opt.step()
            opt.clear_grad()
            if step == 0:
                stages_after_first = opt._sync_stages
        return {"values": {p.name: p.numpy() for p in params},
                "flag": opt.overlap_optimize_and_sync, "stages": stages_after_first}

    return body


def _assert_bit_identical(test, off, on, label):
    for a, b in zip(off, on):
        for name, value in a["values"].items():
            test.assertTrue(np.array_equal(value, b["values"][name]),
                            f"[{label}] {name} differs between the overlapped and the plain "
                            f"step: max |d| = {np.abs(value - b['values'][name]).max():.3e}")


@dataclasses.dataclass(frozen=True)
class _OptInConfig(SimConfig):
    """comm_group_call_opt with our opt-in: staged sync over the hierarchical route."""

    def strategy(self):
        strategy = super().strategy()
        set_muon_sharding_options(strategy, overlap_sync_group_call=True)
        return strategy


@unittest.skipUnless(_has_staged_api(), "the inner Muon lacks the staged API")
class TestOverlapOptimizeAndSync(unittest.TestCase):
    """T-OV: overlapped stage sync is bit-identical to update-then-sync."""

    def _run(self, cfg, flag, body=None):
        with overlap_flag(flag):
            results, world = run_world(cfg, body=body or _overlap_body())
        return results, world

    def _check_pair(self, cfg, label):
        off, _ = self._run(cfg, "0")
        on, world = self._run(cfg, None)  # default: on
        self.assertTrue(all(r["flag"] is False for r in off))
        self.assertTrue(all(r["flag"] is True for r in on),
                        f"[{label}] overlap_optimize_and_sync is on by default")
        self.assertTrue(all(r["stages"] is None for r in off), "no stages without the overlap")
        stages = on[0]["stages"]
        kinds = [s["kind"] for s in stages]
        self.assertGreaterEqual(kinds.count("2d"), 2, f"[{label}] stages {kinds}")
        self.assertGreaterEqual(kinds.count("1d"), 2, f"[{label}] stages {kinds}")
        self.assertTrue(any(len(s["rank2params"]) > 1 for s in stages if s["kind"] == "2d"),
                        f"[{label}] some 2-D stage should have more than one owner")
        _assert_bit_identical(self, off, on, label)
        start = {p.name: p.numpy() for p in _overlap_model_params()}
        self.assertFalse(np.array_equal(on[0]["values"]["fc1.w"], start["fc1.w"]),
                         "the run must actually train")
        # the sync of a stage is launched right after its update: broadcasts
        # of the first 2-D stage precede the second stage's update phase
        trace = world.traces[0]
        phases = [r.phase for r in trace]
        first_bcast = next(i for i, r in enumerate(trace) if r.op == "broadcast")
        self.assertTrue(any(p and p.startswith("reduce") for p in phases[:first_bcast]))
        return on

    def test_two_ranks_bit_identical(self):
        self._check_pair(SimConfig(ep=1, ms=2, steps=3), "2 ranks")

    def test_eight_ranks_bit_identical(self):
        self._check_pair(SimConfig(ep=1, ms=8, steps=2), "8 ranks")

    def test_group_call_forces_it_off_like_develop(self):
        cfg = SimConfig(ep=1, ms=4, gpn=2, steps=2)
        # a job's first construction warns (once per job: job_log)
        with mock.patch.object(job_log, "_SEEN", set()), \
                self.assertLogs(mso.logger.name, level="WARNING") as logs:
            results, _ = self._run(cfg, "1")
        self.assertTrue(all(r["flag"] is False for r in results),
                        "develop turns the overlap off under comm_group_call_opt")
        self.assertTrue(any("overlap_sync_group_call" in line for line in logs.output),
                        "the warning names the opt-in")

    def test_the_group_call_warning_is_once_per_job(self):
        # 4 ranks, each building its optimizer twice (a resume): one warning
        # line, from the first construction; the rest go to debug
        cfg = SimConfig(ep=1, ms=4, gpn=2, steps=1)
        with mock.patch.object(job_log, "_SEEN", set()), \
                self.assertLogs(mso.logger.name, level="DEBUG") as logs:
            self._run(cfg, "1")
            self._run(cfg, "1")
        lines = [r for r in logs.records if "overlap_sync_group_call=True" in r.getMessage()]
        self.assertEqual([r.levelname for r in lines].count("WARNING"), 1)
        self.assertEqual(len(lines), 8, "every construction still logs it at debug")

    def test_group_call_opt_in_runs_staged_sync_hierarchically(self):
        cfg = _OptInConfig(ep=1, ms=4, gpn=2, steps=2)
        off, _ = self._run(cfg, "0", _overlap_body(steps=2))
        on, world = self._run(cfg, "1", _overlap_body(steps=2))
        self.assertTrue(all(r["flag"] is True for r in on), "the opt-in keeps it on")
        _assert_bit_identical(self, off, on, "group call + opt-in")
        phases = {r.phase for trace in world.traces for r in trace if r.op == "broadcast"}
        self.assertIn("cross_node_broadcast", phases)
        self.assertIn("intra_node_broadcast", phases)

    def test_without_staged_api_it_is_off_with_a_warning(self):
        cfg = SimConfig(ep=1, ms=2, steps=1)

        def body(cfg, strategy):
            hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
            params = _overlap_model_params()
            muon = make_muon(params)
            muon.update_params = None  # not callable: the staged API is incomplete
            return MuonShardingOptimizer(muon, hcg, strategy).overlap_optimize_and_sync

        with overlap_flag("1"), mock.patch.object(job_log, "_SEEN", set()), \
                self.assertLogs(mso.logger.name, level="WARNING") as logs:
            results, _ = run_world(cfg, body=body)
        self.assertEqual(results, [False, False])
        self.assertTrue(any("update_params" in line for line in logs.output))

    def test_bad_flag_value_is_named(self):
        cfg = SimConfig(ep=1, ms=2, steps=1)
        with overlap_flag("yes"), self.assertRaisesRegex(Exception, FLAG):
            run_world(cfg, body=_overlap_body(steps=1), reraise_original=True)

    def test_bypass_flag_skips_the_update_but_still_syncs(self):
        cfg = SimConfig(ep=1, ms=2, steps=1)
        with mock.patch.object(mso, "g_shard_bypass_dygraph_optimizer", 1), \
                mock.patch("paddle_muon_ext.optimizer.muon.g_shard_bypass_dygraph_optimizer", 1):
            results, world = self._run(cfg, "1")
        start = {p.name: p.numpy() for p in _overlap_model_params()}
        for r in results:
            self.assertIsNone(r["stages"], "the overlapped path is skipped under bypass")
            for name, value in r["values"].items():
                self.assertTrue(np.array_equal(value, start[name]),
                                f"{name} changed although the update is bypassed")
        self.assertTrue(any(rec.op == "broadcast" for rec in world.traces[0]),
                        "the parameter sync still runs under bypass")


# develop's config mirrors, sharding-group facts and shared colours: derived
# from the settings / hcg / parameters, so read-only
_DERIVED_MIRRORS = (
    "tensor_fusion", "accumulate_steps", "comm_overlap", "comm_buffer_size_MB", "use_reduce_avg",
    "enable_fuse_optimizer_states", "use_group_call_opt", "pp_overlap", "_use_pipeline_parallel",
    "sd_release_grads", "_use_fuse_gradients", "machine_balanced_2d_partition", "_enable_timer",
    "_default_group", "_sharding_world_size", "_sharding_rank", "_origin_parameter_list",
    "_shared_colors")


class TestDevelopAttributes(unittest.TestCase):
    """Config mirrors and develop's attributes live on the sharding optimizer."""

    def test_mirrors_and_attributes(self):
        cfg = SimConfig(ep=2, ms=2, steps=1, overlap=True, acc_steps=2)

        def body(cfg, strategy):
            hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
            net = TinyMoE(hcg.get_expert_parallel_rank(), hcg.get_moe_sharding_parallel_group())
            opt = MuonShardingOptimizer(make_muon(list(net.parameters())), hcg, strategy)
            # the optimizer's own: set on it, or a view its class defines
            # over its state (develop's buffer names), never the inner Muon's
            own = set(vars(opt)) | {n for n in dir(type(opt))
                                    if isinstance(getattr(type(opt), n), property)}

            def refuses_write(name):
                try:
                    setattr(opt, name, getattr(opt, name))
                except AttributeError:
                    return True
                return False

            def refusal(name):
                try:
                    setattr(opt, name, False)
                except AttributeError as exc:
                    return str(exc)
                return "(the write was accepted)"

            return {
                # one home per value: views of the settings / hcg, never a
                # copy on the instance that a write could make disagree
                "copied_or_writable": [n for n in _DERIVED_MIRRORS
                                       if n in vars(opt) or not refuses_write(n)],
                "not_forwarded": [n for n in (
                    "tensor_fusion", "accumulate_steps", "comm_overlap", "comm_buffer_size_MB",
                    "use_reduce_avg", "enable_fuse_optimizer_states", "use_group_call_opt",
                    "pp_overlap", "sd_release_grads", "_use_fuse_gradients",
                    "machine_balanced_2d_partition", "trainer_comms",
                    "trainer_same_card_comms", "overlap_optimize_and_sync", "_sync_stages",
                    "_shared_colors", "_sync_only_buffers", "_sync_only_buffer_ids",
                    "_overlap_comm_buffers", "_color_to_comm_buffer_list",
                    "_local_parameter_list_1d", "_origin_parameter_list",
                    "_muon_param_info_map", "_sharding_world_size", "_sharding_rank",
                    "_global_rank", "_use_pipeline_parallel", "_use_main_grad",
                    "_enable_timer") if n not in own],
                "values": (opt.comm_overlap, opt.accumulate_steps, opt.comm_buffer_size_MB,
                           opt.use_group_call_opt, opt._use_fuse_gradients,
                           opt.machine_balanced_2d_partition, opt.pp_overlap,
                           opt._use_pipeline_parallel, opt.trainer_comms),
                "write_errors": {n: refusal(n) for n in _DERIVED_MIRRORS},
                "world": (opt._sharding_world_size, opt._sharding_rank, opt._global_rank),
                "rank": paddle.distributed.get_rank(),
                "sharding_rank": hcg.get_sharding_parallel_rank(),
                "buffers_1d": {k: len(v) for k, v in opt._color_to_comm_buffer_list.items()},
                "slices": [p.name for p in opt._local_parameter_list_1d],
                "owner_sorted": all(
                    [opt._param2rank_2d_by_color[c][p.name] for p in ps]
                    == sorted(opt._param2rank_2d_by_color[c][p.name] for p in ps)
                    for c, ps in opt._params_2d_by_color.items()),
                "collect": opt._collect_comm_buffers() is opt._comm_buffer_list,
                # hooks go on the plan's backward phases: develop's overlap
                # buffers less one-rank groups
                "hooked": {id(b) for b, _ in opt._runtime.hooked_buffers()}
                == {id(b) for b in opt._overlap_comm_buffers if b._comm_group.nranks > 1},
                "n_hooked": len(opt._runtime.hooked_buffers()),
                "clear_color": opt.clear_color,
            }

        results, _ = run_world(cfg, body=body, mode="record")
        for out in results:
            # a write would be ignored (buffers, hooks and plan are built):
            # the refusal names the attribute, its source and the fix
            errors = out["write_errors"]
            self.assertIn("MuonShardingOptimizer.comm_overlap is read-only (got False): it is "
                          "the strategy's comm_overlap option", errors["comm_overlap"])
            self.assertIn("the strategy's comm_group_call_opt option",
                          errors["use_group_call_opt"])
            self.assertIn("hcg.get_sharding_parallel_rank()", errors["_sharding_rank"])
            self.assertIn("it is the parameter list it was built with, fixed when the optimizer "
                          "was built; build a new optimizer", errors["_origin_parameter_list"])
            for name, message in errors.items():
                # every derived name, not Python's bare "has no setter"
                self.assertIn(f"MuonShardingOptimizer.{name} is read-only", message)
                self.assertIn("build a new optimizer", message)
            self.assertEqual(out["not_forwarded"], [],
                             "these attributes must be the sharding optimizer's own, not "
                             "forwarded to Muon by __getattr__")
            self.assertEqual(out["copied_or_writable"], [],
                             "develop's config mirrors must be read-only views of the settings")
            self.assertEqual(out["values"], (True, 2, 1, False, True, False, False, False, []))
            self.assertEqual(out["world"], (4, out["sharding_rank"], out["rank"]))
            self.assertEqual(set(out["buffers_1d"]), {-1, "moe_expert"},
                             "1-D buffers are keyed by the raw colour (-1 for the default)")
            self.assertTrue(out["owner_sorted"], "develop sorts each colour's 2-D list by owner")
            self.assertTrue(out["collect"])
            self.assertTrue(out["hooked"] and out["n_hooked"] > 0,
                            "hooked buffers must be develop's overlap buffers")
            self.assertEqual(out["clear_color"], set())

    def test_trainer_comms_are_the_group_call_groups(self):
        cfg = SimConfig(ep=2, ms=2, gpn=2, steps=1)

        def body(cfg, strategy):
            hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
            net = TinyMoE(hcg.get_expert_parallel_rank(), hcg.get_moe_sharding_parallel_group())
            opt = MuonShardingOptimizer(make_muon(list(net.parameters())), hcg, strategy)
            return ([list(g.ranks) for g in opt.trainer_comms],
                    [[list(g.ranks) for g in row] for row in opt.trainer_same_card_comms])

        results, _ = run_world(cfg, body=body, mode="record")
        nodes, same_card = results[0]
        self.assertEqual(nodes, [[0, 1], [2, 3]], "trainer_comms[machine]: its gpn ranks")
        self.assertEqual(same_card, [[[0, 2], [1, 3]]],
                         "trainer_same_card_comms[stage][card]: that card on every node")
        self.assertTrue(all(r == results[0] for r in results), "identical on every rank")

    def test_missing_info_entry_is_an_assertion_error_naming_the_parameter(self):
        cfg = SimConfig(ep=1, ms=2, steps=1)

        def body(cfg, strategy):
            hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
            params = _overlap_model_params()
            muon = make_muon(params)
            del muon._muon_param_info_map["fc1.w"]
            MuonShardingOptimizer(muon, hcg, strategy)

        with self.assertRaisesRegex(AssertionError, r"fc1\.w \(shape \[512, 384\]\)"):
            run_world(cfg, body=body, reraise_original=True)

    def test_dict_colours_default_like_develop(self):
        cfg = SimConfig(ep=1, ms=2, steps=1)

        def body(cfg, strategy):
            hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
            params = _overlap_model_params()
            params[0].color = {"color": NO_HOOK}  # no group: the sharding group
            params[2].color = {"group": hcg.get_sharding_parallel_group()}  # no colour: default
            params[4].color = {"color": -1}
            params[5].color = -1  # develop: a plain -1 is the default colour too
            opt = MuonShardingOptimizer(make_muon(params), hcg, strategy)
            return (list(opt._params_2d_by_color),
                    [p.name for p in opt._params_2d_by_color[NO_HOOK]],
                    list(opt._color_to_group_info[NO_HOOK]["group"].ranks))

        results, _ = run_world(cfg, body=body, mode="record")
        for colours, shared, ranks in results:
            self.assertEqual(colours, [NO_HOOK, None])
            self.assertEqual(shared, ["fc0.w"])
            self.assertEqual(ranks, [0, 1])

    def test_hyperball_parameters_are_kept_whole(self):
        cfg = SimConfig(ep=1, ms=2, steps=1)

        def body(cfg, strategy):
            hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
            params = _overlap_model_params()
            muon = make_muon(params)
            # develop's keep_whole = use_muon or use_hyperball
            muon._muon_param_info_map["fc0.w"] = types.SimpleNamespace(
                use_muon=False, use_hyperball=True, split_concat_func=None)
            opt = MuonShardingOptimizer(muon, hcg, strategy)
            return "fc0.w" in opt.owner_map, [p.name for p in opt._params_1d]

        results, _ = run_world(cfg, body=body, mode="record")
        for whole, params_1d in results:
            self.assertTrue(whole, "a hyperball matrix is owned whole")
            self.assertNotIn("fc0.w", params_1d)


class TestNoHookColours(unittest.TestCase):
    """T-NH: shared colours are sync-only in both runs; overlap on/off bit-identical."""

    def test_sync_only_buffers_and_bit_identical_overlap(self):
        def run(overlap):
            cfg = SimConfig(ep=2, ms=2, steps=2, overlap=overlap, clip=False)

            def body(cfg, strategy):
                hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
                coord = hcg.get_expert_parallel_rank()
                net = TinyMoE(coord, hcg.get_moe_sharding_parallel_group())
                for key in ("w_in", "b_in"):
                    net.dense[key].color = {"color": NO_HOOK,
                                            "group": hcg.get_sharding_parallel_group()}
                opt = fleet_optimizer(make_muon(list(net.parameters()), clip=False), hcg,
                                      strategy)
                core = sharded_core(opt)
                rank = paddle.distributed.get_rank()
                for step in range(cfg.steps):
                    net(paddle.to_tensor(batch(step, rank))).backward()
                    core.clear_param_storage(NO_HOOK)  # as develop's worker, before step
                    if opt is core:
                        core.reduce_gradients(list(net.parameters()), hcg)
                    opt.step()
                    opt.clear_grad()
                sync_only = {id(b) for b in core._sync_only_buffers}
                return {
                    "values": net.named_values(),
                    "shared": core._shared_colors,
                    "sync_only_colours": {MuonShardingOptimizer._buffer_color(b)
                                          for b in core._sync_only_buffers},
                    "n_sync_only": len(core._sync_only_buffers),
                    "disjoint": all(id(b) not in sync_only for b in core._overlap_comm_buffers),
                    "n_overlap": len(core._overlap_comm_buffers),
                    "comm_overlap": core.comm_overlap,
                }

            results, _ = run_world(cfg, body=body)
            return results

        base, over = run(False), run(True)
        for label, results, overlap in (("baseline", base, False), ("overlap", over, True)):
            for out in results:
                self.assertEqual(out["shared"], {NO_HOOK})
                self.assertEqual(out["sync_only_colours"], {NO_HOOK}, label)
                self.assertEqual(out["n_sync_only"], 2,
                                 f"[{label}] the 2-D and the 1-D buffer of the shared colour")
                self.assertTrue(out["disjoint"] and out["n_overlap"] > 0, label)
                self.assertIs(out["comm_overlap"], overlap)
        _assert_bit_identical(self, base, over, "no-hook colour, comm_overlap on vs off")


class TestBroadcastHelpers(unittest.TestCase):
    """_broadcast_2d_params / reorder_params: one buffer per (owner, dtype) (#79687)."""

    def test_mixed_dtype_owner_buffers(self):
        cfg = SimConfig(ep=1, ms=2, steps=1, matrix_dtype="bfloat16", clip=False)

        def body(cfg, strategy):
            hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
            net = TinyMoE(None, None, "bfloat16")
            opt = MuonShardingOptimizer(make_muon(list(net.parameters()), clip=False,
                                                  multi_precision=True), hcg, strategy)
            rank = paddle.distributed.get_rank()
            group = opt._color_to_group_info[None]["group"]
            rank2params = {0: [net.dense["w_in"], net.dense["w_out"]]}
            if rank == 0:
                net.dense["w_in"].set_value(paddle.full(net.dense["w_in"].shape, 3.0, "bfloat16"))
                net.dense["w_out"].set_value(paddle.full(net.dense["w_out"].shape, 5.0))
            for task in opt._broadcast_2d_params(rank2params, group):
                task.wait()
            first = (float(net.dense["w_in"].astype("float32").numpy().max()),
                     float(net.dense["w_out"].numpy().min()))
            packed = opt.reorder_params([(rank2params, group)])
            # develop-style stage dicts (no plan phases) sync as develop does
            net.dense["w_out"].set_value(paddle.full(net.dense["w_out"].shape, 7.0)
                                         if rank == 0 else paddle.zeros(net.dense["w_out"].shape))
            hand = {"kind": "2d", "world_size": 2, "group": group,
                    "rank2params": {0: [net.dense["w_out"]]}}
            for task in opt._launch_stage_sync(hand):
                task.wait()
            one_rank = opt._launch_stage_sync(dict(hand, world_size=1))
            for task in opt._launch_stage_sync({"kind": "1d", "buffer": opt._comm_buffer_list[0]}):
                task.wait()
            return (*first,
                    [(str(d["param_buffer"].dtype), d["src_rank"], d["param_buffer"] is p)
                     for d, p in zip(packed, (net.dense["w_in"], net.dense["w_out"]))],
                    float(net.dense["w_out"].numpy().max()), one_rank)

        results, _ = run_world(cfg, body=body)
        for w_in, w_out, packed, *_ in results:
            self.assertEqual((w_in, w_out), (3.0, 5.0),
                             "owner 0's bf16 and fp32 matrices both arrive intact")
            self.assertEqual(packed, [("paddle.bfloat16", 0, True), ("paddle.float32", 0, True)],
                             "one buffer per dtype; an owner's only param of a dtype is sent as is")
        for out in results:
            self.assertEqual(out[3], 7.0, "a develop-style 2-D stage broadcasts from its owner")
            self.assertEqual(out[4], [], "a one-rank stage syncs nothing")


class TestReduce2dGrads(unittest.TestCase):
    def test_owner_gets_the_group_mean(self):
        cfg = SimConfig(ep=1, ms=2, steps=1, fused=False, clip=False)

        def body(cfg, strategy):
            hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
            net = TinyMoE(None, None)
            opt = MuonShardingOptimizer(make_muon(list(net.parameters()), clip=False), hcg,
                                        strategy)
            rank = paddle.distributed.get_rank()
            net(paddle.to_tensor(batch(0, rank))).backward()
            before = {k: p.grad.numpy().astype("float64") for k, p in net.dense.items()
                      if k.startswith("w_")}
            opt._reduce_2d_grads()
            after = {k: net.dense[k].grad.numpy() for k in before}
            return rank, before, after, {k: opt.owner_map[f"dense.{k}"] for k in before}

        results, _ = run_world(cfg, body=body)
        for rank, _, after, owners in results:
            for key, owner in owners.items():
                if owner != rank:
                    continue  # a non-owner's buffer is not trusted after a reduce
                mean = (results[0][1][key] + results[1][1][key]) / 2
                np.testing.assert_allclose(after[key], mean, rtol=1e-6, atol=1e-7,
                                           err_msg=f"owner {rank} of {key}: not the group mean")


class TestMixedDtypeOwners(unittest.TestCase):
    """T-MD: 4 x [512, 512] low precision + 2 x [256, 256] fp32, 1 MB buffers, 2 ranks."""

    def test_owners_and_buffers_per_dtype(self):
        cfg = SimConfig(ep=1, ms=2, steps=1)

        def body(cfg, strategy):
            hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
            rng = np.random.RandomState(3)
            params = [_param(f"low{i}", rng.rand(512, 512).astype("float32"), "bfloat16")
                      for i in range(4)]
            params += [_param(f"fp32_{i}", rng.rand(256, 256).astype("float32"))
                       for i in range(2)]
            opt = MuonShardingOptimizer(make_muon(params, multi_precision=True), hcg, strategy)
            owners = opt._param2rank_2d_by_color[None]
            return ({owners[f"low{i}"] for i in range(4)}, {owners["fp32_0"], owners["fp32_1"]},
                    sum(1 for b in opt.comm_buffer_2d if b._params[0].dtype == paddle.float32),
                    dict(owners))

        results, _ = run_world(cfg, body=body, mode="record")
        for low, fp32, n_fp32_buffers, owners in results:
            self.assertEqual(low, {0, 1}, "develop's per-dtype rule spreads the bf16 matrices")
            self.assertEqual(fp32, {0}, "the fp32 minority is not scattered")
            self.assertEqual(n_fp32_buffers, 1, "exactly one fp32 2-D buffer")
            self.assertEqual(owners, results[0][3], "identical owner maps on every rank")


if __name__ == "__main__":
    unittest.main()
