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
# paddle_muon_ext: compat-only  (tests of compat_paddle_3_3; not exported)
"""The paddle 3.3.1 shims: patch_paddle, strategy options, CPU tensor fusion,
fleet integration.

``patch_paddle()`` must give develop's names (``paddle.optimizer.Muon``,
``strategy.use_muon_sharding``, the extra sharding_configs fields,
``fleet.distributed_optimizer``) and take them all back; the fleet path must
give a HybridParallelOptimizer around MuonShardingOptimizer whose training
equals the single-process reference, work with AMP's GradScaler, and leave
Paddle's modules exactly as they were.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import sys
import threading
import types
import unittest
from unittest import mock

import numpy as np
import paddle
from paddle.distributed import fleet
from paddle.distributed.fleet import optimizer as paddle_fleet_optimizer
from paddle.distributed.fleet.base import distributed_strategy as ds
from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer import (
    hybrid_parallel_optimizer as hpo,
)
from paddle.distributed.fleet.utils import tensor_fusion_helper

from muon_sim_runner import SimConfig, build_rank, max_abs_diff, reference_values, run_world
from muon_sim_runner import sharded_core, train_steps
from muon_test_compat import env_vars
from muon_tiny_moe import CLIP_NORM, LR, TinyMoE, batch, make_muon

import paddle_muon_ext
from paddle_muon_ext.compat_paddle_3_3 import (
    MuonShardingOptions,
    get_muon_sharding_options,
    is_patched,
    patch_paddle,
    register_cpu_tensor_fusion,
    set_muon_sharding_options,
    unpatch_paddle,
)
from paddle_muon_ext.compat_paddle_3_3 import fleet_integration
from paddle_muon_ext.compat_paddle_3_3 import fleet_integration as fi
from paddle_muon_ext.compat_paddle_3_3 import patch as patch_module
from paddle_muon_ext.distributed.fleet.meta_optimizers import muon_sharding_optimizer as mso
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import (
    settings as options_module,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import settings as mss
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.settings import (
    ShardingSettings,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_optimizer import (
    MuonShardingOptimizer,
)
from paddle_muon_ext.distributed.fleet.utils import gloo_compat

from launch_utils import run_paddle_launch

_HERE = os.path.dirname(os.path.abspath(__file__))
NOOP_WORKER = os.path.join(_HERE, "muon_patch_noop_worker.py")


@contextlib.contextmanager
def _replaced(target, name, value):
    """Set ``target.name`` for the block, then put the original back."""
    missing = object()
    saved = target.__dict__.get(name, missing) if isinstance(target, type) \
        else getattr(target, name, missing)
    setattr(target, name, value)
    try:
        yield
    finally:
        if saved is missing:
            delattr(target, name)
        else:
            setattr(target, name, saved)




@contextlib.contextmanager
def _captured(logger):
    """Every record ``logger`` emits in the block (any level)."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


@contextlib.contextmanager
def _patched():
    patch_paddle()
    try:
        yield
    finally:
        unpatch_paddle()


class TestStrategyOptions(unittest.TestCase):
    def test_default_and_roundtrip_survive_deepcopy(self):
        strategy = fleet.DistributedStrategy()
        self.assertEqual(get_muon_sharding_options(strategy), MuonShardingOptions())
        self.assertEqual(MuonShardingOptions().muon_partition_strategy, "upstream_greedy",
                         "develop's owner rule is the default")
        set_muon_sharding_options(strategy, use_muon_sharding=True)
        set_muon_sharding_options(strategy, comm_group_call_opt=True)
        expected = MuonShardingOptions(use_muon_sharding=True, comm_group_call_opt=True)
        self.assertEqual(get_muon_sharding_options(strategy), expected,
                         "a second call must keep the first")
        # fleet.init / distributed_optimizer deep-copy the user's strategy
        self.assertEqual(get_muon_sharding_options(copy.deepcopy(strategy)), expected)
        self.assertEqual(get_muon_sharding_options(None), MuonShardingOptions())

    def test_bad_values_are_rejected(self):
        cases = [
            ({"comm_group_call_opt": 1}, TypeError, "must be a bool"),
            ({"muon_partition_strategy": "random"}, ValueError,
             "muon_partition_strategy='random'"),
            ({"comm_grup_call_opt": True}, TypeError, "unknown Muon sharding option"),
        ]
        for kwargs, exc, fragment in cases:
            with self.subTest(kwargs=kwargs):
                with self.assertRaisesRegex(exc, fragment):
                    set_muon_sharding_options(fleet.DistributedStrategy(), **kwargs)

    def test_proto_field_wins_where_paddle_has_it(self):
        class Configs:
            DESCRIPTOR = types.SimpleNamespace(fields_by_name={"comm_group_call_opt": None})
            comm_group_call_opt = False

        class Strategy:
            hybrid_configs = {"sharding_configs": Configs()}

        strategy = Strategy()
        set_muon_sharding_options(strategy, comm_group_call_opt=True)
        self.assertIs(strategy.hybrid_configs["sharding_configs"].comm_group_call_opt, True)
        strategy.hybrid_configs["sharding_configs"].comm_group_call_opt = False
        self.assertIs(get_muon_sharding_options(strategy).comm_group_call_opt, False)


    def test_settings_read_kept_options_only_through_the_registered_reader(self):
        # The core's settings never import this package: the values kept
        # beside the strategy reach them through the hook strategy_options
        # fills in; without it (an exported tree) only the proto is read.
        strategy = fleet.DistributedStrategy()
        set_muon_sharding_options(strategy, muon_partition_strategy="balanced",
                                  overlap_sync_group_call=True)
        settings = ShardingSettings.from_strategy(strategy)
        self.assertEqual((settings.muon_partition_strategy, settings.overlap_sync_group_call),
                         ("balanced", True))
        with _replaced(options_module, "_kept_options_reader", None):
            settings = ShardingSettings.from_strategy(strategy)
        self.assertEqual((settings.muon_partition_strategy, settings.overlap_sync_group_call),
                         ("upstream_greedy", False))


class TestCpuTensorFusion(unittest.TestCase):
    def test_registration(self):
        with _replaced(tensor_fusion_helper, "__current_device_type__", None), \
                _replaced(tensor_fusion_helper, "alignment",
                          dict(tensor_fusion_helper.alignment)):
            self.assertTrue(register_cpu_tensor_fusion())
            self.assertEqual(tensor_fusion_helper.get_current_device_type(), "cpu")
            self.assertEqual(tensor_fusion_helper.alignment["cpu"], 256)
            tensor_fusion_helper.__current_device_type__ = None
            with _replaced(paddle, "is_compiled_with_cuda", lambda: True):
                self.assertFalse(register_cpu_tensor_fusion())
            self.assertIsNone(tensor_fusion_helper.__current_device_type__,
                              "left a GPU build alone")
        register_cpu_tensor_fusion()  # the suites run on CPU


def _fleet_body(use_amp: bool, develop_style: bool = False, distributed_optimizer=None,
                pass_strategy: bool = False):
    def body(cfg: SimConfig, strategy):
        hcg = fleet.get_hybrid_communicate_group()
        coord = hcg.get_expert_parallel_rank()
        net = TinyMoE(coord, hcg.get_moe_sharding_parallel_group())
        fleet.fleet._hcg = hcg
        if develop_style:
            # exactly what a develop script writes, after patch_paddle()
            from paddle.distributed.fleet.meta_optimizers.muon_sharding_optimizer import (
                MuonShardingOptimizer as Develop,
            )

            from paddle.optimizer.muon import MuonParamInfo

            # develop's sharding optimizer needs an entry for every parameter
            info = {p.name: MuonParamInfo(use_muon=p.ndim in (2, 3))
                    for p in net.parameters()}
            muon = paddle.optimizer.Muon(
                learning_rate=LR, parameters=list(net.parameters()),
                grad_clip=paddle.nn.ClipGradByGlobalNorm(CLIP_NORM),
                muon_param_info_map=info)
            opt = fleet.distributed_optimizer(muon)
            assert isinstance(opt._inner_opt, Develop)
        else:
            muon = make_muon(list(net.parameters()))
            dist_opt = distributed_optimizer or fi.distributed_optimizer
            opt = dist_opt(muon, strategy) if pass_strategy else dist_opt(muon)
        assert isinstance(opt, hpo.HybridParallelOptimizer)
        assert isinstance(opt._inner_opt, MuonShardingOptimizer)
        scaler = None
        if use_amp:
            # On CPU places Paddle disables loss scaling itself, so this checks
            # the scaler.minimize -> HybridParallelOptimizer.minimize ->
            # reduce + MuonShardingOptimizer.minimize flow, not the unscaling.
            scaler = fleet.distributed_scaler(paddle.amp.GradScaler(init_loss_scaling=1024.0))
        rank = paddle.distributed.get_rank()
        for step in range(cfg.steps):
            loss = net(paddle.to_tensor(batch(step, rank)))
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaled = scaler.scale(loss)
                scaled.backward()
                scaler.minimize(opt, scaled)
            opt.clear_grad()
        return rank, coord, net.named_values()

    return body


class TestFleetIntegration(unittest.TestCase):
    def _train(self, body):
        cfg = SimConfig(ep=2, ms=2, steps=2)
        originals = (hpo.DygraphShardingOptimizer, hpo.DygraphShardingOptimizerV2)
        # the harness has no launcher environment
        with _replaced(fleet.fleet, "worker_num", lambda: cfg.world):
            results, _ = run_world(cfg, body=body)
        expected = reference_values(cfg)
        for rank, coord, values in results:
            diff = max_abs_diff(values, expected[rank])
            self.assertLessEqual(diff, 1e-5, f"rank {rank}: {diff:.3e} from the reference")
        self.assertEqual((hpo.DygraphShardingOptimizer, hpo.DygraphShardingOptimizerV2),
                         originals,
                         "the scoped patch of HybridParallelOptimizer's sharding classes leaked")

    def test_distributed_optimizer_trains_like_the_reference(self):
        for use_amp in (False, True):
            with self.subTest(use_amp=use_amp):
                self._train(_fleet_body(use_amp))

    def test_develop_style_code_after_patch_paddle_trains_like_the_reference(self):
        with _patched():
            self._train(_fleet_body(use_amp=False, develop_style=True))

    def test_distributed_optimizer_defers_to_paddle_without_muon_sharding(self):
        sentinel = object()
        calls = []
        early_bound = paddle_fleet_optimizer.distributed_optimizer  # bound before the patch
        with _replaced(fi, "PADDLE_DYGRAPH_DISTRIBUTED_OPTIMIZER",
                       lambda opt, strategy=None: calls.append(opt) or sentinel), \
                _replaced(fleet.fleet, "_user_defined_strategy",
                          getattr(fleet.fleet, "_user_defined_strategy", None)):
            optimizer = object()
            self.assertIs(fi.distributed_optimizer(optimizer, fleet.DistributedStrategy()),
                          sentinel)
            with _patched():  # the patched names and one bound before: same path
                self.assertIs(fleet.distributed_optimizer(optimizer), sentinel)
                self.assertIs(early_bound(optimizer), sentinel)
        self.assertEqual(calls, [optimizer] * 3)

    def test_strategy_given_to_distributed_optimizer_is_used(self):
        self._train(_fleet_body(use_amp=False, pass_strategy=True))

    def test_one_process_muon_is_returned_as_is(self):
        muon = make_muon(list(paddle.nn.Linear(4, 4).parameters()))
        strategy = fleet.DistributedStrategy()
        set_muon_sharding_options(strategy, use_muon_sharding=True)
        with _replaced(fleet.fleet, "worker_num", lambda: 1), \
                _replaced(fleet.fleet, "_user_defined_strategy", strategy):
            self.assertIs(fi.distributed_optimizer(muon), muon,
                          "one process: develop returns the optimizer itself")

    def test_muon_under_paddles_sharding_is_warned_about(self):
        net = paddle.nn.Linear(4, 4)
        muon = make_muon(list(net.parameters()))
        adamw = paddle.optimizer.AdamW(parameters=net.parameters())

        def strategy(sharding_degree):
            s = fleet.DistributedStrategy()
            s.hybrid_configs = {"sharding_degree": sharding_degree}
            return s

        cases = [
            # (optimizer, strategy, workers, warned)
            (muon, strategy(2), 2, True),
            (types.SimpleNamespace(_inner_opt=muon), strategy(2), 2, True),  # AMP wrapper
            (adamw, strategy(2), 2, False),
            (muon, strategy(1), 2, False),       # no sharding
            (muon, strategy(2), 1, False),       # one process: Paddle returns Muon itself
            (muon, object(), 2, False),          # a strategy without hybrid_configs
        ]
        for number, (optimizer, given, workers, warned) in enumerate(cases):
            with self.subTest(case=number), \
                    _replaced(fi, "PADDLE_DYGRAPH_DISTRIBUTED_OPTIMIZER",
                              lambda opt, strategy=None: opt), \
                    _replaced(fleet.fleet, "worker_num", lambda: workers), \
                    _replaced(fleet.fleet, "_user_defined_strategy", given), \
                    _captured(fi.logger) as records:
                self.assertIs(fi.distributed_optimizer(optimizer), optimizer)
                messages = [r.getMessage() for r in records]
                self.assertEqual(any("use_muon_sharding is off" in m for m in messages),
                                 warned, messages)

    def test_slices_get_their_gradient_before_the_dp_or_sep_all_reduce(self):
        # Bug: only dp assigns the slice gradients, so under sep parallel the
        # sep all-reduce skips every element-wise slice.
        for dp, sep, expected in (
            (False, True, ["reduce", "slices", "filter", ("all_reduce", ["mine"])]),
            (True, False, ["reduce", "slices", "filter", ("all_reduce", ["mine"])]),
            (False, False, ["reduce", "filter"]),
        ):
            calls = []
            inner = types.SimpleNamespace(
                reduce_gradients=lambda params, hcg: calls.append("reduce"),
                _assign_slice_grad=lambda: calls.append("slices"),
                filter_parameters=lambda params, hcg: calls.append("filter") or ["mine"],
            )
            wrapper = types.SimpleNamespace(_sharding_enable=True, _dp_enable=dp,
                                            _sep_enable=sep, _inner_opt=inner, _hcg=None)
            with self.subTest(dp=dp, sep=sep), _replaced(
                    fi, "fused_allreduce_gradients",
                    lambda params, hcg: calls.append(("all_reduce", params))):
                fi.MuonHybridParallelOptimizer._hybrid_sync_grad(wrapper, ["a", "b"])
                self.assertEqual(calls, expected)

    def test_the_given_strategy_is_copied_so_later_edits_do_not_reach_fleet(self):
        # Bug: fleet keeps the user's object; editing it after
        # distributed_optimizer() changes the running job's strategy.
        strategy = fleet.DistributedStrategy()
        strategy.hybrid_configs = {"sharding_degree": 2}
        set_muon_sharding_options(strategy, use_muon_sharding=True)
        built = []
        with _replaced(fleet.fleet, "worker_num", lambda: 2), \
                _replaced(fleet.fleet, "_user_defined_strategy", None), \
                _replaced(fleet.fleet, "user_defined_optimizer",
                          getattr(fleet.fleet, "user_defined_optimizer", None)), \
                _replaced(fleet.fleet, "_context", getattr(fleet.fleet, "_context", {})), \
                _replaced(fleet.fleet, "_hcg", None), \
                _replaced(fi, "MuonHybridParallelOptimizer",
                          lambda opt, hcg, s: built.append(s) or opt):
            optimizer = object()
            self.assertIs(fi.distributed_optimizer(optimizer, strategy), optimizer)
            kept = fleet.fleet._user_defined_strategy
            strategy.hybrid_configs = {"sharding_degree": 4}
            set_muon_sharding_options(strategy, muon_partition_strategy="balanced")
            self.assertIs(built[0], kept)
            self.assertEqual(kept.hybrid_configs["sharding_degree"], 2)
            self.assertEqual(get_muon_sharding_options(kept).muon_partition_strategy,
                             "upstream_greedy")
            self.assertTrue(get_muon_sharding_options(kept).use_muon_sharding)

    def test_static_graph_goes_to_fleets_method(self):
        sentinel = object()
        with _replaced(fleet.fleet, "distributed_optimizer",
                       lambda opt, strategy=None: sentinel), \
                _replaced(fi, "in_dynamic_mode", lambda: False):
            self.assertIs(fi.distributed_optimizer(object()), sentinel)

    def test_one_process_adamw_is_untouched_by_the_patch(self):
        def run(patched: bool):
            paddle.seed(3)
            model = paddle.nn.Linear(4, 3)
            adamw = paddle.optimizer.AdamW(learning_rate=0.1, parameters=model.parameters())
            strategy = fleet.DistributedStrategy()
            with _replaced(fleet.fleet, "worker_num", lambda: 1), \
                    _replaced(fleet.fleet, "_user_defined_strategy", strategy), \
                    (_patched() if patched else contextlib.nullcontext()):
                opt = fleet.distributed_optimizer(adamw)
            self.assertIs(opt, adamw, f"patched={patched}: one process gets its own optimizer")
            for step in range(3):
                x = paddle.to_tensor(np.full((2, 4), step + 1.0, "float32"))
                model(x).sum().backward()
                opt.step()
                opt.clear_grad()
            return model.weight.numpy()

        np.testing.assert_array_equal(run(True), run(False),
                                      "AdamW trained differently after patch_paddle()")

    def test_muon_through_a_name_bound_before_the_patch_is_muon_sharded(self):
        early_bound = paddle_fleet_optimizer.distributed_optimizer
        with _patched():
            self._train(_fleet_body(use_amp=False, distributed_optimizer=early_bound))

    def test_found_inf_skips_the_update(self):
        cfg = SimConfig(ep=2, ms=2, steps=1)

        def body(cfg, strategy):
            hcg, net, opt, coord = build_rank(cfg, strategy)
            before = net.named_values()
            net(paddle.to_tensor(batch(0, paddle.distributed.get_rank()))).backward()
            core = sharded_core(opt)
            core.reduce_gradients(list(net.parameters()), hcg)
            core._inner_opt._set_auxiliary_var("found_inf", paddle.to_tensor(True))
            core.step()
            after = net.named_values()
            return all(np.array_equal(before[k], after[k]) for k in before)

        results, _ = run_world(cfg, body=body)
        self.assertTrue(all(results), "an overflowing step must leave every parameter unchanged")


class TestPatchPaddle(unittest.TestCase):
    """patch_paddle(): develop's names on 3.3.1; unpatch_paddle() restores all."""

    def tearDown(self):
        unpatch_paddle()

    def _snapshot(self):
        return {
            "Muon": getattr(paddle.optimizer, "Muon", None),
            "muon": getattr(paddle.optimizer, "muon", None),
            "modules": {m: sys.modules.get(m) for m in (patch_module.MUON_MODULE,
                                                        patch_module.SHARDING_MODULE)},
            "hybrid_configs": ds.DistributedStrategy.__dict__["hybrid_configs"],
            "use_muon_sharding": ds.DistributedStrategy.__dict__.get("use_muon_sharding"),
            "distributed_optimizer": fleet.distributed_optimizer,
            "dygraph_distributed_optimizer":
                paddle_fleet_optimizer._dygraph_distributed_optimizer,
            "gloo_installed": gloo_compat.is_installed(),
        }

    def test_names_appear_idempotently_and_unpatch_restores_everything(self):
        before = self._snapshot()
        self.assertIsNone(before["Muon"], "paddle 3.3.1 has no Muon; the test assumes it")
        added = patch_paddle()
        self.assertTrue(is_patched())
        self.assertEqual(patch_paddle(), [], "a second call changes nothing")
        self.assertEqual(len(added), 4, added)
        from paddle.optimizer.muon import MuonParamInfo
        from paddle.distributed.fleet.meta_optimizers.muon_sharding_optimizer import (
            MuonShardingOptimizer as Develop,
        )

        self.assertIs(paddle.optimizer.Muon, paddle_muon_ext.Muon)
        self.assertIs(MuonParamInfo, paddle_muon_ext.MuonParamInfo)
        self.assertIs(Develop, MuonShardingOptimizer)
        self.assertIs(fleet.distributed_optimizer, fi.distributed_optimizer)
        unpatch_paddle()
        self.assertFalse(is_patched())
        self.assertEqual(self._snapshot(), before)
        with self.assertRaises(ImportError):
            __import__(patch_module.MUON_MODULE)

    def test_patch_registers_cpu_tensor_fusion_and_unpatch_takes_it_back(self):
        # Constructing the optimizer installs nothing process-wide, so the
        # CPU entry of Paddle's tensor-fusion table is patch_paddle()'s opt-in.
        table = {"gpu": 256, "npu": 256, "xpu": 256}
        with _replaced(tensor_fusion_helper, "__current_device_type__", None), \
                _replaced(tensor_fusion_helper, "alignment", dict(table)):
            added = patch_paddle()
            self.assertIn("CPU tensor fusion (FusedCommBuffer on CPU places)", added)
            self.assertEqual(tensor_fusion_helper.get_current_device_type(), "cpu")
            self.assertEqual(tensor_fusion_helper.alignment["cpu"], 256)
            unpatch_paddle()
            self.assertIsNone(tensor_fusion_helper.__current_device_type__)
            self.assertEqual(tensor_fusion_helper.alignment, table)
            with _replaced(paddle, "is_compiled_with_cuda", lambda: True):
                self.assertNotIn("CPU tensor fusion (FusedCommBuffer on CPU places)",
                                 patch_paddle(), "an accelerator build keeps its table")
            self.assertIsNone(tensor_fusion_helper.__current_device_type__)

    def test_patch_sets_the_paddle_optimizer_muon_attribute(self):
        # Bug: only sys.modules gets the module; `paddle.optimizer.muon.X`
        # (attribute access, no import statement) then fails.
        patch_paddle()
        self.assertIs(getattr(paddle.optimizer, "muon", None),
                      sys.modules[patch_module.MUON_MODULE])
        self.assertIs(paddle.optimizer.muon.MuonParamInfo, paddle_muon_ext.MuonParamInfo)

    def test_strategy_accepts_develops_fields_and_keeps_them_through_deepcopy(self):
        patch_paddle()
        strategy = fleet.DistributedStrategy()
        strategy.use_muon_sharding = True
        strategy.hybrid_configs = {
            "dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 2,
            "sharding_configs": {"comm_group_call_opt": True,
                                 "muon_partition_strategy": "balanced",
                                 "comm_buffer_size_MB": 8, "comm_overlap": True},
            "pp_configs": {"release_gradients": True},
        }
        copied = copy.deepcopy(strategy)
        configs = copied.hybrid_configs["sharding_configs"]
        self.assertTrue(copied.use_muon_sharding)
        self.assertTrue(configs.comm_group_call_opt)
        self.assertEqual(configs.muon_partition_strategy, "balanced")
        self.assertEqual(configs.comm_buffer_size_MB, 8)
        self.assertTrue(configs.comm_overlap)
        self.assertTrue(copied.hybrid_configs["pp_configs"].release_gradients)
        self.assertEqual(copied.hybrid_configs["sharding_degree"], 2)
        configs.comm_group_call_opt = False  # attribute writes reach the same storage
        configs.accumulate_steps = 4
        self.assertFalse(get_muon_sharding_options(copied).comm_group_call_opt)
        self.assertEqual(copied.hybrid_configs["sharding_configs"].accumulate_steps, 4)
        self.assertIn("comm_group_call_opt", dir(configs))
        self.assertIn("muon_partition_strategy", repr(configs))
        with self.assertRaisesRegex(ValueError, r"unknown field\(s\) \['comm_grup_call_opt'\]"):
            strategy.hybrid_configs = {"sharding_configs": {"comm_grup_call_opt": True}}
        unpatch_paddle()
        with self.assertRaises(TypeError):
            fleet.DistributedStrategy().use_muon_sharding = True

    def test_a_paddle_that_has_the_names_is_left_alone(self):
        fake_muon = type("Muon", (), {})
        fake_module = types.ModuleType(patch_module.SHARDING_MODULE)
        fake_module.__spec__ = types.SimpleNamespace(name=patch_module.SHARDING_MODULE)
        prop = property(lambda self: False, lambda self, v: None)
        with _replaced(paddle.optimizer, "Muon", fake_muon), \
                _replaced(ds.DistributedStrategy, "use_muon_sharding", prop):
            sys.modules[patch_module.SHARDING_MODULE] = fake_module
            try:
                before = self._snapshot()
                with self.assertLogs(patch_module.logger, level="INFO") as logs:
                    self.assertEqual(patch_paddle(), [])
                self.assertEqual(self._snapshot(), before, "patch_paddle changed a Paddle "
                                 "that already has develop's names")
                self.assertTrue(any("already has" in line for line in logs.output))
                unpatch_paddle()
                self.assertEqual(self._snapshot(), before)
            finally:
                sys.modules.pop(patch_module.SHARDING_MODULE, None)

    def test_a_failing_step_rolls_back(self):
        before = self._snapshot()

        def boom(done, skipped):
            raise RuntimeError("boom")

        with _replaced(patch_module, "_STEPS", patch_module._STEPS + (boom,)):
            with self.assertRaisesRegex(RuntimeError, "boom"):
                patch_paddle()
        self.assertFalse(is_patched())
        self.assertEqual(self._snapshot(), before)

    def test_set_muon_sharding_options_is_the_same_storage(self):
        patch_paddle()
        strategy = fleet.DistributedStrategy()
        paddle_muon_ext.set_muon_sharding_options(strategy, use_muon_sharding=True,
                                                  muon_partition_strategy="balanced")
        self.assertTrue(strategy.use_muon_sharding)
        self.assertEqual(strategy.hybrid_configs["sharding_configs"].muon_partition_strategy,
                         "balanced")


def _moe_configs(**degrees):
    configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 8,
               "ep_degree": 4, "moe_sharding_degree": 2}
    configs.update(degrees)
    return configs


class TestDegreeCheck(unittest.TestCase):
    """The patched hybrid_configs setter names the formula that does not add up."""

    def tearDown(self):
        unpatch_paddle()

    def test_degrees_that_do_not_tile_the_job_are_refused_with_the_formula(self):
        patch_paddle()
        cases = [
            # (configs, PADDLE_TRAINERS_NUM, message fragment)
            (_moe_configs(sharding_degree=4), None,
             r"dense layout .*sharding_degree\(4\).* = 4 ranks but the expert layout "
             r"pp_degree\(1\) x moe_sharding_degree\(2\) x ep_degree\(4\) = 8"),
            (_moe_configs(), "4", r"= 8 ranks, but the job has 4 \(PADDLE_TRAINERS_NUM\)"),
            ({"dp_degree": 2, "sharding_degree": 2}, "2",
             r"dp_degree\(2\) x mp_degree\(1\) x pp_degree\(1\) x sharding_degree\(2\)"
             r" x sep_degree\(1\) = 4 ranks, but the job has 2"),
            # fewer ranks than launched (bug: only "too many" refused)
            ({"dp_degree": 1, "sharding_degree": 2}, "4",
             r"sharding_degree\(2\) x sep_degree\(1\) = 2 ranks, but the job has 4"),
        ]
        for configs, world, fragment in cases:
            with self.subTest(configs=configs, world=world), env_vars(PADDLE_TRAINERS_NUM=world):
                with self.assertRaisesRegex(AssertionError, fragment):
                    fleet.DistributedStrategy().hybrid_configs = configs

    def test_degrees_that_tile_the_job_are_accepted(self):
        patch_paddle()
        cases = [
            (_moe_configs(), "8"),
            (_moe_configs(), None),                       # not launched: no world to check
            ({"dp_degree": -1, "sharding_degree": 2}, "2"),  # dp inferred by Paddle
            ({"sharding_configs": {"comm_overlap": True}}, "3"),  # no degree assigned
        ]
        for configs, world in cases:
            with self.subTest(configs=configs, world=world), env_vars(PADDLE_TRAINERS_NUM=world):
                strategy = fleet.DistributedStrategy()
                strategy.hybrid_configs = configs
                for key, value in configs.items():
                    if key.endswith("_degree"):
                        self.assertEqual(strategy.hybrid_configs[key], value)

    def test_an_expert_only_assignment_is_checked_too(self):
        # Bug: only assignments naming a dense degree are checked.
        patch_paddle()
        strategy = fleet.DistributedStrategy()
        strategy.hybrid_configs = {"sharding_degree": 2}
        with self.assertRaisesRegex(AssertionError, r"expert layout .*ep_degree\(4\) = 4 ranks"):
            strategy.hybrid_configs = {"ep_degree": 4}
        with self.assertRaisesRegex(AssertionError, r"moe_sharding_degree\(4\)"):
            strategy.hybrid_configs = {"ep_degree": 2, "moe_sharding_degree": 4}

    def test_bad_degree_values_are_refused_in_one_line_before_fleet_init(self):
        patch_paddle()
        cases = [
            ({"sharding_degree": 0}, AssertionError,
             "'sharding_degree'\\]=0 is out of range; use an int >= 1"),
            ({"sharding_degree": -2}, ValueError, "'sharding_degree'\\]=-2"),
            ({"mp_degree": -1}, AssertionError, "'mp_degree'\\]=-1 is out of range"),
            ({"pp_degree": True}, TypeError, "'pp_degree'\\]=True \\(bool\\) is not an int"),
            ({"dp_degree": 2.0}, TypeError, "'dp_degree'\\]=2.0 \\(float\\)"),
            ({"sep_degree": "2"}, TypeError, "'sep_degree'\\]='2'"),
        ]
        for configs, exc, fragment in cases:
            with self.subTest(configs=configs), env_vars(PADDLE_TRAINERS_NUM=None):
                with self.assertRaisesRegex(exc, fragment) as ctx:
                    fleet.DistributedStrategy().hybrid_configs = configs
                self.assertNotIn("\n", str(ctx.exception))
        # an unknown key stays Paddle's own error
        with self.assertRaisesRegex(AssertionError, "key:bogus_degree not in hybrid_configs"):
            fleet.DistributedStrategy().hybrid_configs = {"bogus_degree": "x"}
        # what Paddle accepts and means stays accepted: inferred dp, 0 = not split
        with env_vars(PADDLE_TRAINERS_NUM=None):
            strategy = fleet.DistributedStrategy()
            strategy.hybrid_configs = {"dp_degree": -1, "mp_degree": 0, "ep_degree": 1}
            self.assertEqual(strategy.hybrid_configs["mp_degree"], 0)

    def test_a_refused_assignment_leaves_the_strategy_unchanged(self):
        # Bug: Paddle's setter writes field by field; the refused values stayed.
        patch_paddle()
        strategy = fleet.DistributedStrategy()
        strategy.hybrid_configs = {
            "sharding_degree": 2, "order": ["dp", "pp", "sharding", "sep", "mp"],
            "sharding_configs": {"comm_buffer_size_MB": 8, "muon_partition_strategy": "balanced"},
            "mp_configs": {"sync_param_name": ["emb"]},
        }
        before = copy.deepcopy(strategy)
        refused = [
            {"sharding_degree": 4, "ep_degree": 3, "order": ["pp", "dp", "sharding", "sep", "mp"],
             "sharding_configs": {"comm_buffer_size_MB": 16,
                                  "muon_partition_strategy": "upstream_greedy"},
             "mp_configs": {"sync_param_name": ["other"]}},
            {"sharding_configs": {"comm_buffer_size_MB": 16, "no_such_field": 1}},
            {"pp_configs": {"release_gradients": True}, "sharding_degree": 0},
            {"sharding_configs": {"muon_partition_strategy": "fastest"}},
        ]
        for configs in refused:
            with self.subTest(configs=configs), env_vars(PADDLE_TRAINERS_NUM=None):
                with self.assertRaises((AssertionError, ValueError, TypeError)):
                    strategy.hybrid_configs = configs
                got, want = strategy.hybrid_configs, before.hybrid_configs
                for key in ("sharding_degree", "ep_degree"):
                    self.assertEqual(got[key], want[key], key)
                self.assertEqual(got["sharding_configs"].comm_buffer_size_MB, 8)
                self.assertEqual(got["sharding_configs"].muon_partition_strategy, "balanced")
                self.assertFalse(got["pp_configs"].release_gradients)
                self.assertEqual(strategy.hybrid_parallel_order, before.hybrid_parallel_order)
                self.assertEqual(strategy.sync_param_name, ["emb"])

    def test_unpatched_paddle_is_unchanged(self):
        with env_vars(PADDLE_TRAINERS_NUM="4"):
            strategy = fleet.DistributedStrategy()
            strategy.hybrid_configs = _moe_configs(sharding_degree=4)  # Paddle accepts it
        self.assertEqual(strategy.hybrid_configs["sharding_degree"], 4)


class TestGlooLayerFromPatch(unittest.TestCase):
    """patch_paddle() installs the gloo layer only for a launched gloo job."""

    def tearDown(self):
        unpatch_paddle()
        gloo_compat.uninstall_gloo_compat()

    def test_installed_for_gloo_and_removed_by_unpatch(self):
        cases = [
            # (PADDLE_DISTRI_BACKEND, GLOO_COMPAT, installed)
            ("gloo", None, True),
            (None, None, False),          # a single process on the CPU wheel
            ("nccl", None, False),
            ("gloo", "0", False),         # the user turned it off
            (None, "1", True),            # ... or on
        ]
        for backend, force, expected in cases:
            with self.subTest(backend=backend, force=force), \
                    env_vars(PADDLE_DISTRI_BACKEND=backend, GLOO_COMPAT=force):
                added = patch_paddle()
                self.assertIs(gloo_compat.is_installed(), expected, added)
                self.assertEqual(any("gloo" in item for item in added), expected, added)
                unpatch_paddle()
                self.assertFalse(gloo_compat.is_installed(),
                                 "unpatch_paddle left the gloo layer installed")

    def test_a_layer_installed_by_the_user_is_left_to_the_user(self):
        gloo_compat.install_gloo_compat(force=True)
        with env_vars(PADDLE_DISTRI_BACKEND="gloo"):
            self.assertFalse(any("gloo" in item for item in patch_paddle()))
            unpatch_paddle()
        self.assertTrue(gloo_compat.is_installed(), "unpatch removed the user's own install")


class TestReduceAvgWarning(unittest.TestCase):
    """The SUM fallback warns only a user who asked for use_reduce_avg."""

    def _warnings(self, strategy_hook):
        cfg = SimConfig(ep=2, ms=2, steps=1)

        def body(cfg, strategy):
            strategy_hook(strategy)
            build_rank(cfg, strategy)

        mss._SEEN.discard("reduce_avg")
        with _captured(mso.logger) as records:
            run_world(cfg, body=body)
        return [r.getMessage() for r in records if "use_reduce_avg" in r.getMessage()]

    def test_default_is_silent_and_an_explicit_setting_warns(self):
        self.assertEqual(self._warnings(lambda strategy: None), [],
                         "warned about use_reduce_avg the user never set")

        def ask(strategy):
            strategy.hybrid_configs["sharding_configs"].use_reduce_avg = True

        self.assertEqual(len(self._warnings(ask)), 1, "no (or repeated) warning for "
                         "an explicit use_reduce_avg=True on a build without AVG")

    def test_a_strategy_that_cannot_tell_counts_as_set(self):
        self.assertTrue(mss._user_set_sharding_config(None, "use_reduce_avg"))


class TestPatchLeavesOtherOptimizersAlone(unittest.TestCase):
    """2 gloo processes: AdamW trains bit-identically before and after patch_paddle()."""

    def test_adamw_dp2_and_sharding_stage1(self):
        for mode, inner in (("dp", "AdamW"), ("sharding", "DygraphShardingOptimizer")):
            with self.subTest(mode=mode):
                result = run_paddle_launch(NOOP_WORKER, 2, timeout_s=180,
                                           env={"NOOP_MODE": mode, "CUDA_VISIBLE_DEVICES": ""})
                result.check()
                for rank in range(2):
                    lines = [ln for ln in result.worker_logs[rank].splitlines()
                             if ln.startswith("NOOP_RESULT ")]
                    self.assertEqual(len(lines), 1, result.failure_message())
                    got = json.loads(lines[0].split(" ", 1)[1])
                    self.assertEqual(got["before"], ["HybridParallelOptimizer", inner])
                    self.assertEqual(got["after"], got["before"],
                                     f"rank {rank}: the patch changed the wrapper")
                    self.assertTrue(got["trained"], f"rank {rank}: parameters never moved")
                    self.assertEqual(got["max_diff"], 0.0,
                                     f"rank {rank}: AdamW ({mode}) trained differently "
                                     "after patch_paddle()")


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
