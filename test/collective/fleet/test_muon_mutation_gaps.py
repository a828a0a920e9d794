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
"""Behaviours a mutation audit found unpinned: each test failed on its
planted bug (noted per test) and passes on the real code.

Small worlds (4 simulated ranks) and pure functions only: seconds in all.
"""

from __future__ import annotations

import math
import os
import tempfile
import unittest
from fractions import Fraction
from unittest import mock

import numpy as np
import paddle

from muon_checkpoint_model import CheckpointNet
from muon_param_map import build_muon_param_info_map
from muon_sim_runner import (
    SimConfig,
    build_rank,
    raises,
    reference_values,
    max_abs_diff,
    run_world,
    sharded_core,
    train_steps,
)
from muon_tiny_moe import TinyMoE, make_muon

from paddle_muon_ext.distributed.fleet.meta_optimizers import (
    muon_flight_recorder as fr,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_checkpoint import (
    load_sharded_checkpoint,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_layout import (
    NO_HOOK_COLOURS,
    LayoutSettings,
    ParamMeta,
    ShardingLayout,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_optimizer import (
    MuonShardingOptimizer,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_partition import (
    MatrixSpec,
    balanced_partition,
    newton_schulz_cost,
    optimizer_state_bytes,
)
from paddle_muon_ext.optimizer.muon import Muon


def _rank() -> int:
    return paddle.distributed.get_rank()


class TestNoHookColoursInTheLayout(unittest.TestCase):
    """Bug: the layout forgets NO_HOOK_COLOURS (route ``+overlap``, hook trigger)."""

    def test_no_hook_colours_reduce_in_reduce_gradients(self):
        metas = [ParamMeta("w", (16, 16), "float32", None, True),
                 ParamMeta("b", (16,), "float32", None, False)]
        for colour in NO_HOOK_COLOURS:
            metas += [ParamMeta(f"{colour}.w", (16, 16), "float32", colour, True),
                      ParamMeta(f"{colour}.b", (16,), "float32", colour, False)]
        groups = {key: (0, 1) for key in (None, *NO_HOOK_COLOURS)}
        layout = ShardingLayout.build(metas, groups, 0, LayoutSettings(comm_overlap=True))
        for bucket in layout.muon_buckets:
            hooked = bucket.colour not in NO_HOOK_COLOURS
            self.assertEqual(bucket.route_kind, "flat+overlap" if hooked else "flat",
                             f"colour {bucket.colour!r}: route {bucket.route_kind}")
        for buf in layout.slice_buffers:
            self.assertEqual(buf.overlap, buf.colour not in NO_HOOK_COLOURS,
                             f"colour {buf.colour!r}: 1-D buffer overlap={buf.overlap}")
        triggers = {}
        for op in layout.schedule():
            if op.op in ("reduce", "reduce_scatter"):
                triggers.setdefault(op.colour, set()).add(op.trigger)
        self.assertEqual(triggers[None], {"backward"}, "the default colour reduces from hooks")
        for colour in NO_HOOK_COLOURS:
            self.assertEqual(triggers[colour], {"reduce_gradients"},
                             f"{colour} must be reduced by reduce_gradients only")


class TestBalancedPartitionRule(unittest.TestCase):
    """The documented rule of the balanced partition, on hand-sized inputs."""

    def test_minority_class_owner_cap_is_the_ceil_of_its_share(self):
        # Bug: floor instead of ceil (or one owner too many). 13 bf16 and 3 fp32
        # equal matrices over 8 ranks: fp32 holds 3/16 of the Newton-Schulz cost,
        # i.e. 1.5 ranks' share, so exactly 2 ranks may own fp32 matrices.
        specs = [MatrixSpec(f"bf16.{i:02d}", (64, 64), "bfloat16") for i in range(13)]
        specs += [MatrixSpec(f"fp32.{i}", (64, 64), "float32") for i in range(3)]
        nranks = 8

        def share(names_of, weight):
            total = sum(weight(s) for s in specs)
            return Fraction(sum(weight(s) for s in specs if names_of(s)) * nranks, total)

        fp32 = lambda s: s.dtype == "float32"  # noqa: E731
        load = max(share(fp32, optimizer_state_bytes),
                   share(fp32, lambda s: Fraction(newton_schulz_cost(s.shape))))
        self.assertEqual(load, Fraction(3, 2), "the fp32 class should be 1.5 ranks' share")
        owners = balanced_partition(specs, nranks).owners
        fp32_owners = {owners[s.name] for s in specs if fp32(s)}
        self.assertEqual(len(fp32_owners), math.ceil(load),
                         f"fp32 matrices on ranks {sorted(fp32_owners)}; the cap is "
                         f"ceil({load}) = {math.ceil(load)}")

    def test_equal_loads_tie_break_by_name_then_rank_order(self):
        # Bug: ties broken by input order, or rank_order ignored / reversed.
        names = ["m.a", "m.b", "m.c", "m.d"]
        rank_order = [2, 0, 3, 1]
        for specs in ([MatrixSpec(n, (32, 32), "float32") for n in names],
                      [MatrixSpec(n, (32, 32), "float32") for n in reversed(names)]):
            owners = balanced_partition(specs, 4, rank_order=rank_order).owners
            self.assertEqual([owners[n] for n in names], rank_order,
                             "equal matrices in name order go to the ranks in rank_order")
        default = balanced_partition([MatrixSpec(n, (32, 32), "float32") for n in names], 4)
        self.assertEqual([default.owners[n] for n in names], [0, 1, 2, 3])


class TestSlicesKeepNeedClip(unittest.TestCase):
    def test_need_clip_false_survives_onto_the_slice(self):
        # Bug: the 1-D slice parameter drops need_clip, so the global-norm clip
        # (clip_norm 1e-12: every clipped gradient falls below AdamW's epsilon)
        # freezes a parameter the user excluded from clipping.
        cfg = SimConfig(ep=2, ms=2, steps=1, via_fleet=False)

        def body(cfg, strategy):
            hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
            coord = hcg.get_expert_parallel_rank()
            net = TinyMoE(coord, hcg.get_moe_sharding_parallel_group())
            net.dense["b_in"].need_clip = False
            params = list(net.parameters())
            muon = Muon(learning_rate=0.02, parameters=params,
                        grad_clip=paddle.nn.ClipGradByGlobalNorm(1e-12),
                        muon_param_info_map=build_muon_param_info_map(params))
            before = net.named_values()
            opt = MuonShardingOptimizer(muon, hcg, strategy)
            train_steps(cfg, hcg, net, opt)
            after = net.named_values()
            return {k: float(np.abs(after[k] - before[k]).max()) for k in before}

        results, _ = run_world(cfg, body=body)
        for rank, moved in enumerate(results):
            # AdamW's first step moves every element by ~lr = 0.02
            self.assertGreater(moved["dense.b_in"], 0.01,
                               f"rank {rank}: the need_clip=False bias did not move "
                               f"({moved['dense.b_in']:.2e}): it was clipped")
            self.assertLess(moved["dense.norm_w"], 1e-3,
                            f"rank {rank}: a clipped 1-D parameter moved "
                            f"{moved['dense.norm_w']:.2e}")


class TestAdamEpsilonIsTheNewtonSchulzFloor(unittest.TestCase):
    def test_custom_epsilon_reaches_newton_schulz(self):
        # Bug: Newton-Schulz divides by max(norm, default epsilon) whatever
        # adam_epsilon says. A gradient of Frobenius norm 1e-4: with the
        # default floor it is scaled to norm 1 first (an O(lr) update); with
        # adam_epsilon = 1 it stays tiny, and so does the update.
        rng = np.random.default_rng(3)
        g = rng.normal(0, 1, (8, 12))
        g *= 1e-4 / np.linalg.norm(g)
        moved = {}
        for eps in (None, 1.0):
            w = paddle.create_parameter([8, 12], "float32",
                                        default_initializer=paddle.nn.initializer.Constant(0.0))
            kwargs = {} if eps is None else {"adam_epsilon": eps}
            opt = Muon(learning_rate=0.02, parameters=[w], weight_decay=0.0,
                       muon_param_info_map=build_muon_param_info_map([w]), **kwargs)
            (w * paddle.to_tensor(g.astype("float32"))).sum().backward()
            opt.step()
            moved[eps] = float(np.linalg.norm(w.numpy()))
        self.assertGreater(moved[None], 1e-3, f"default floor: update norm {moved[None]:.2e}")
        self.assertLess(moved[1.0], moved[None] * 1e-2,
                        f"adam_epsilon=1.0 must floor the Newton-Schulz norm: update norm "
                        f"{moved[1.0]:.2e} vs {moved[None]:.2e} with the default")


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


class TestPipelineReleaseGradientsWithOverlap(unittest.TestCase):
    def test_pp_release_gradients_releases_hooked_buffers(self):
        # Bug: under comm_overlap only sharding_configs.release_gradients is
        # honoured; pp_configs.release_gradients keeps the 1-D buffers.
        cfg = SimConfig(ep=2, ms=2, overlap=True, steps=2)

        def body(cfg, strategy):
            strategy.hybrid_configs["pp_configs"].release_gradients = True
            hcg, net, opt, coord = build_rank(cfg, strategy)
            train_steps(cfg, hcg, net, opt)
            core = sharded_core(opt)
            return (net.named_values(), [b.grad_storage is None for b in core._rs_buffers])

        results, _ = run_world(cfg, body=body)
        expected = reference_values(cfg)
        for rank, (values, released) in enumerate(results):
            self.assertTrue(released and all(released),
                            f"rank {rank}: 1-D gradient buffers kept: {released}")
            diff = max_abs_diff(values, expected[rank])
            self.assertLessEqual(diff, 1e-5, f"rank {rank}: {diff:.3e} from the reference")


class TestNewestCheckpointLoads(unittest.TestCase):
    def test_two_checkpoints_in_one_directory(self):
        # Bug: the oldest id (or the string-sorted largest, "2" > "10") is checked
        # and loaded. Id 2 was saved from a model without experts, id 10 from
        # the one loading: only the newest matches.
        with tempfile.TemporaryDirectory() as tmp:
            for uid, coord, value in ((2, None, 3.0), (10, 0, 5.0)):
                net = CheckpointNet(coord, 1)
                with paddle.no_grad():
                    bias = net.param("out.bias")
                    bias.set_value(paddle.full(bias.shape, value))
                paddle.distributed.save_state_dict(net.sharded_state_dict(), tmp,
                                                   unique_id=uid)
            fresh = CheckpointNet(0, 1)
            load_sharded_checkpoint(fresh.sharded_state_dict(), tmp)
            got = np.unique(fresh.values()["out.bias"]).tolist()
            self.assertEqual(got, [5.0], f"loaded out.bias {got}: not the newest checkpoint")


class _Buffer:
    """A fused 1-D buffer under main_grad: fp32 gradients, bf16 parameters."""

    class _Group:
        id, ranks, nranks = 5, [0, 1], 2

    def __init__(self) -> None:
        self._comm_group = self._Group()
        self.grad_storage = paddle.zeros([24], dtype="float32")
        self.param_storage = paddle.zeros([16], dtype="bfloat16")
        self.calls = []

    def sync_params(self) -> None:
        self.calls.append("all_gather")

    def _comm_grads(self) -> None:
        self.calls.append("reduce_scatter")

    def scale_grads(self) -> None:
        pass


class TestRecordedBuffersUnderMainGrad(unittest.TestCase):
    def test_all_gather_records_the_parameter_buffer(self):
        # Bug: the all-gather is recorded with the gradient buffer, which under
        # main_grad is fp32 while the parameters (what is gathered) are bf16.
        from paddle_muon_ext.distributed.fleet.meta_optimizers import (
            muon_sharding_collectives as comm,
        )

        with mock.patch.dict(os.environ, {fr.ENV_ARM: "0"}):  # no handlers, no watchdog
            recorder = fr.FlightRecorder(enabled=True)
        buf = _Buffer()
        with mock.patch.object(comm, "get_flight_recorder", lambda: recorder):
            comm.reduce_scatter_slices([buf], launched_by_hook=lambda b: False)
            comm.all_gather_slices([buf])
        self.assertEqual(buf.calls, ["reduce_scatter", "all_gather"])
        entries = {e["op"]: e for e in recorder.snapshot("test")["entries"]}
        self.assertEqual((entries["reduce_scatter"]["dtype"], entries["reduce_scatter"]["numel"]),
                         ("float32", 24), "reduce_scatter moves the fp32 gradient buffer")
        self.assertEqual((entries["all_gather"]["dtype"], entries["all_gather"]["numel"]),
                         ("bfloat16", 16), "all_gather moves the bf16 parameter buffer")


class TestConcurrentDumps(unittest.TestCase):
    def test_two_threads_writing_one_dump_both_succeed(self):
        # Bug (seen as a flaky CI failure under load): both threads wrote the
        # same temporary file, the second os.replace found it gone and the
        # dump with its peer request was lost. Each writer here waits inside
        # json.dump until the other one has opened its temporary file.
        import json
        import threading

        opened = threading.Barrier(2, timeout=60)
        real_dump = json.dump

        def slow_dump(data, f):
            opened.wait()
            real_dump(data, f)

        errors = []

        def write(n):
            try:
                fr._write_json(path, {"writer": n})
            except OSError as exc:
                errors.append(exc)

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "muon_flight.rank0.json")
            with mock.patch.object(fr.json, "dump", slow_dump):
                threads = [threading.Thread(target=write, args=(n,)) for n in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(120)
            self.assertEqual(errors, [], "a concurrent dump failed")
            with open(path) as f:
                self.assertIn(json.load(f)["writer"], (0, 1))
            self.assertEqual(os.listdir(tmp), ["muon_flight.rank0.json"],
                             "temporary files left behind")


class TestFlightRecorderDirectory(unittest.TestCase):
    def test_explicit_directory_wins_over_the_launcher_log_dir(self):
        # Bug: PADDLE_LOG_DIR read first when both are set.
        with mock.patch.dict(os.environ, {fr.ENV_DIR: "/explicit",
                                          fr.LAUNCHER_LOG_DIR_ENV: "/launcher"}):
            self.assertEqual(fr.dump_dir(), "/explicit")
        with mock.patch.dict(os.environ, {fr.ENV_DIR: "", fr.LAUNCHER_LOG_DIR_ENV: "/launcher"}):
            self.assertEqual(fr.dump_dir(), "/launcher")
        with mock.patch.dict(os.environ, {fr.ENV_DIR: "", fr.LAUNCHER_LOG_DIR_ENV: ""}):
            self.assertIsNone(fr.dump_dir())


if __name__ == "__main__":
    unittest.main()
