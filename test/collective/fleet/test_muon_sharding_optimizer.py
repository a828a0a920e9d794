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
"""MuonShardingOptimizer on the simulated world (real data, real optimizer code).

Spec: N sharded ranks, each on 1/N of the batch, end with the parameters of a
single-process Muon run on the full batch; owners hold the group mean of the
gradients; checkpoints resume bit-exactly; misconfigurations fail at
construction with a message naming the value and the fix.

Tolerances: fp32 runs differ from the reference only by summation order
inside reductions (float64 in the simulated world vs the reference's float64
mean, then one fp32 rounding) and by fp32 rounding in clip/Newton-Schulz;
measured max |d| is ~3e-7 on O(1) weights, so 1e-5 is a 30x margin that a
real routing error (an O(lr) = 2e-2 change) cannot hide in. bf16 matrices are
compared at 1e-2: one bf16 ulp at O(1) is 7.8e-3.
"""

from __future__ import annotations

import dataclasses
import types
import unittest

import numpy as np
import paddle
from paddle.distributed.fleet.utils import timer_helper
from paddle.distributed.fleet.utils.mix_precision_utils import (
    MixPrecisionLayer,
    MixPrecisionOptimizer,
)

from muon_sim_runner import (
    TensorParallelHcg,
    RankState,
    SimConfig,
    build_rank,
    max_abs_diff,
    reference_values,
    run_world,
    sharded_core,
    train_steps,
)
from muon_param_map import build_muon_param_info_map
from muon_tiny_moe import CLIP_NORM, Reference, TinyMoE, batch, init_dense, make_muon

from paddle_muon_ext.distributed.fleet.meta_optimizers import (
    muon_sharding_optimizer as mso,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import settings as mss
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.optimizer_state import (
    state_owner,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_optimizer import (
    MuonShardingOptimizer,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.settings import (
    ShardingSettings,
)
from paddle_muon_ext.optimizer.muon import Muon, MuonParamInfo

FP32_TOL = 1e-5
BF16_TOL = 1e-2

EQUIVALENCE = {
    "plain_sharding_4": SimConfig(ep=1, ms=4),
    "ep4_ms2_fused": SimConfig(),
    "ep4_ms2_per_param": SimConfig(fused=False),
    "ep4_ms2_overlap": SimConfig(overlap=True),
    "ep4_ms2_acc2": SimConfig(acc_steps=2),
    "ep4_ms2_acc2_overlap": SimConfig(acc_steps=2, overlap=True),
    # clip off: paddle 3.3.1 has no CPU bf16 squared_l2_norm kernel.
    "ep4_ms2_bf16_matrix": SimConfig(matrix_dtype="bfloat16", clip=False),
    "ep4_ms2_bare_optimizer": SimConfig(via_fleet=False),
    "ep4_ms2_reduce_avg": SimConfig(use_reduce_avg=True),
    "ep2_ms2_pp2": SimConfig(ep=2, ms=2, pp=2, clip=False),
    # one-rank expert colour groups: nothing to communicate for experts
    "ep4_ms1": SimConfig(ep=4, ms=1),
    # develop's owner rule (the default): every matrix on the first rank
    "ep4_ms2_upstream_partition": SimConfig(partition="upstream_greedy"),
}


def _keyed_params(net: TinyMoE) -> dict:
    out = {f"dense.{k}": p for k, p in net.dense.items()}
    out.update({f"expert.{k}": p for k, p in (net.experts or {}).items()})
    return out


def _muon_for(net, **kw):
    return make_muon(list(net.parameters()), **kw)


def _net(cfg):
    hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
    coord = hcg.get_expert_parallel_rank()
    return hcg, TinyMoE(coord, hcg.get_moe_sharding_parallel_group())


def _rank() -> int:
    return paddle.distributed.get_rank()


def _assert_matches_reference(test, cfg, results, label, tol=FP32_TOL):
    expected = reference_values(cfg)
    for state in results:
        diff = max_abs_diff(state.values, expected[state.rank])
        test.assertLessEqual(
            diff, tol,
            f"[{label}] rank {state.rank} (expert coord {state.expert_coord}) ends "
            f"{diff:.3e} away from single-process Muon on the full batch (tol {tol})",
        )


def _with_sharding_configs(pp_configs=None, **fields):
    """A body that sets sharding_configs (and pp_configs) fields, then trains."""

    def body(cfg, strategy):
        configs = strategy.hybrid_configs["sharding_configs"]
        for key, value in fields.items():
            setattr(configs, key, value)
        for key, value in (pp_configs or {}).items():
            setattr(strategy.hybrid_configs["pp_configs"], key, value)
        hcg, net, opt, coord = build_rank(cfg, strategy)
        train_steps(cfg, hcg, net, opt)
        return RankState(_rank(), coord, net.named_values(), opt, net)

    return body


class TestEquivalence(unittest.TestCase):
    """Sharded training ends where single-process Muon on the full batch ends."""

    def test_sharded_equals_single_process_reference(self):
        for name in sorted(EQUIVALENCE):
            with self.subTest(name):
                cfg = EQUIVALENCE[name]
                results, world = run_world(cfg)
                tol = BF16_TOL if cfg.matrix_dtype == "bfloat16" else FP32_TOL
                _assert_matches_reference(self, cfg, results, name, tol)
                report = world.check_schedule()
                self.assertTrue(report.ok, report.summary())

    def test_owner_holds_group_mean_and_non_owners_are_not_trusted(self):
        def body(cfg, strategy):
            hcg, net, opt, coord = build_rank(cfg, strategy)
            core = sharded_core(opt)
            rank = _rank()
            net(paddle.to_tensor(batch(0, rank))).backward()
            core.reduce_gradients(list(net.parameters()), hcg)
            names = {p.name: key for key, p in _keyed_params(net).items()}
            owned = {names[p.name]: p.grad.numpy() for p in core._runtime.owned_muon_params()}
            others = {
                names[p.name]: p.grad.numpy()
                for p in net.parameters()
                if p.name in core.owner_map and core.owner_map[p.name] != rank
            }
            return RankState(rank, coord, owned, core, net, extra=others)

        for fused in (True, False):
            with self.subTest(fused=fused):
                cfg = SimConfig(fused=fused)
                results, _ = run_world(cfg, body=body)
                means = Reference(cfg.expert_of_rank()).mean_grads(0)
                seen = set()
                for state in results:
                    for key, grad in state.values.items():
                        slot = (None, key) if key.startswith("dense.") else (state.expert_coord, key)
                        np.testing.assert_allclose(
                            grad, means[slot], rtol=0, atol=1e-6,
                            err_msg=f"owner rank {state.rank}: reduced gradient of {key} is "
                                    f"not the mean over its group")
                        seen.add(slot)
                    # Real backends leave garbage on non-roots; the harness poisons them.
                    for key, grad in state.extra.items():
                        self.assertTrue(np.isnan(grad).all(), (
                            f"rank {state.rank} is not the owner of {key} but its buffer "
                            f"was not poisoned: the reduce did not target the owner"))
                self.assertEqual(seen, {s for s in means if np.asarray(means[s]).ndim >= 2},
                                 "every Muon matrix must have exactly one owner holding "
                                 "its mean gradient")

    def test_global_norm_clip_counts_every_parameter_once(self):
        cfg = SimConfig()

        def body(cfg, strategy):
            hcg, net, opt, coord = build_rank(cfg, strategy)
            core = sharded_core(opt)
            net(paddle.to_tensor(batch(0, _rank()))).backward()
            core.reduce_gradients(list(net.parameters()), hcg)
            core._assign_slice_grad()
            local = core.filter_parameters(list(net.parameters()), hcg)
            core._runtime.ensure_global_clip()
            clip = core._inner_opt._grad_clip
            before = [float(np.abs(p.grad.numpy()).sum()) for p in local]
            clipped = clip([(p, p.grad) for p in local])  # scales in place
            # A slice holding only alignment padding has an all-zero gradient.
            return [float(np.abs(g.numpy()).sum()) / b
                    for (p, g), b in zip(clipped, before) if b > 0]

        results, _ = run_world(cfg, body=body)
        grads = Reference(cfg.expert_of_rank()).mean_grads(0)
        norm = float(np.sqrt(sum(float((g**2).sum()) for g in grads.values())))
        expected_scale = min(1.0, CLIP_NORM / norm)
        self.assertLess(expected_scale, 0.9, "the test needs an active clip")
        for rank, scales in enumerate(results):
            self.assertTrue(scales, f"rank {rank} holds no gradient to clip")
            np.testing.assert_allclose(
                scales, expected_scale, rtol=1e-5,
                err_msg=f"rank {rank}: clip scale differs from the reference global norm "
                        f"{norm:.6f} (a parameter counted twice or not at all)")

    def test_filter_parameters_partition_each_group_exactly_once(self):
        cfg = SimConfig()

        def body(cfg, strategy):
            hcg, net, opt, coord = build_rank(cfg, strategy)
            core = sharded_core(opt)
            core._assign_slice_grad()
            out = []
            for p in core.filter_parameters(list(net.parameters()), hcg):
                begin, end = core.local_range(p.name)
                out.append((p.name, end - begin))
            return coord, out

        results, _ = run_world(cfg, body=body)
        full = {f"dense.{k}": int(v.size) for k, v in init_dense().items()}
        dense_count: dict[str, int] = {}
        for coord, kept in results:
            for name, numel in kept:
                if name.startswith("dense."):
                    dense_count[name] = dense_count.get(name, 0) + numel
        self.assertEqual(dense_count, full, (
            "summed over the sharding group, each dense parameter's elements must be "
            "kept exactly once"))


class TestMixPrecision(unittest.TestCase):
    """MixPrecisionLayer + MixPrecisionOptimizer: gradients live in main_grad."""

    def test_main_grad_fused_and_unfused_match_reference(self):
        def body(cfg, strategy):
            hcg, net = _net(cfg)
            layer = MixPrecisionLayer(net, dtype="bfloat16")  # params stay fp32 on CPU
            opt = MuonShardingOptimizer(MixPrecisionOptimizer(_muon_for(net)), hcg, strategy)
            for step in range(cfg.steps):
                layer(paddle.to_tensor(batch(step, _rank()))).backward()
                grads_in_main = all(p.grad is None for p in net.parameters())
                opt.reduce_gradients(list(net.parameters()), hcg)
                opt.step()
                opt.clear_grad()
            return RankState(_rank(), hcg.get_expert_parallel_rank(), net.named_values(),
                             opt, net, extra=grads_in_main)

        for fused in (True, False):
            with self.subTest(fused=fused):
                cfg = SimConfig(ep=2, ms=2, fused=fused, via_fleet=False)
                results, _ = run_world(cfg, body=body)
                self.assertTrue(all(r.extra for r in results),
                                "MixPrecisionLayer must leave p.grad empty (main_grad only)")
                _assert_matches_reference(self, cfg, results, f"main_grad fused={fused}")

    def test_unfused_main_grad_missing_and_freed(self):
        cfg = SimConfig(ep=2, ms=2, fused=False, via_fleet=False, clip=False)

        def body(cfg, strategy):
            hcg, net = _net(cfg)
            layer = MixPrecisionLayer(net, dtype="bfloat16")
            opt = MuonShardingOptimizer(MixPrecisionOptimizer(_muon_for(net, clip=False)),
                                        hcg, strategy)
            layer(paddle.to_tensor(batch(0, _rank()))).backward()
            w = net.dense["w_out"]
            w.main_grad = None  # unused this step on this rank
            opt.reduce_gradients(list(net.parameters()), hcg)
            owner_zero = (float(np.abs(w.main_grad.numpy()).max())
                          if opt.owner_map[w.name] == _rank() else None)
            opt.step()
            opt.clear_grad(set_to_zero=False)
            freed = all(p.main_grad is None for b in opt.muon_buckets for p in b.params)
            opt.clear_grad(set_to_zero=False)  # nothing left to free: no error
            return owner_zero, freed

        results, _ = run_world(cfg, body=body)
        self.assertEqual([z for z, _ in results if z is not None], [0.0],
                         "the owner must receive the zero mean of a missing main_grad")
        self.assertTrue(all(f for _, f in results),
                        "clear_grad(set_to_zero=False) must free unfused main_grads")


class TestCheckpoint(unittest.TestCase):
    def test_resume_is_bit_exact(self):
        cfg = SimConfig(ep=2, ms=2, steps=3)
        saved: dict[int, tuple] = {}

        def first_two_steps(cfg, strategy):
            hcg, net, opt, coord = build_rank(cfg, strategy)
            train_steps(cfg, hcg, net, opt, first_step=0, steps=2)
            state = {k: (v.numpy() if isinstance(v, paddle.Tensor) else v)
                     for k, v in opt.state_dict().items()}
            saved[_rank()] = ({p.name: p.numpy() for p in net.parameters()}, state)

        def resume(cfg, strategy):
            hcg, net, opt, coord = build_rank(cfg, strategy)
            params, state = saved[_rank()]
            for p in net.parameters():
                p.set_value(params[p.name])
            opt.set_state_dict({k: (paddle.to_tensor(v) if isinstance(v, np.ndarray) else v)
                                for k, v in state.items()})
            train_steps(cfg, hcg, net, opt, first_step=2, steps=1)
            return net.named_values()

        uninterrupted, _ = run_world(cfg)
        run_world(cfg, body=first_two_steps)
        resumed, _ = run_world(cfg, body=resume)
        for rank, (a, b) in enumerate(zip(uninterrupted, resumed)):
            for key in a.values:
                self.assertTrue(np.array_equal(a.values[key], b[key]), (
                    f"rank {rank}: {key} after save at step 2 + resume differs from the "
                    f"uninterrupted run (max |d| {np.abs(a.values[key] - b[key]).max():.3e})"))

    def test_set_state_dict_takes_the_full_dict_keeps_local_renames_masters(self):
        # bf16 matrix + multi_precision: master weights are part of the state.
        cfg = SimConfig(ep=2, ms=2, steps=3, matrix_dtype="bfloat16", clip=False,
                        via_fleet=False)
        saved: dict[int, dict] = {}

        def first_two_steps(cfg, strategy):
            hcg, net, opt, coord = build_rank(cfg, strategy)
            train_steps(cfg, hcg, net, opt, first_step=0, steps=2)
            state = opt.state_dict()
            masters = {k: v.numpy() for k, v in state.pop("master_weights", {}).items()}
            saved[_rank()] = {
                "params": {p.name: p.numpy() for p in net.parameters()},
                "state": {k: v.numpy() for k, v in state.items() if isinstance(v, paddle.Tensor)},
                "masters": masters,
            }

        def resume(cfg, strategy):
            hcg, net, opt, coord = build_rank(cfg, strategy)
            rank = _rank()
            full, masters = {}, {}
            for other in sorted(saved):  # every rank's keys; this rank's slices win
                if other != rank:
                    full.update(saved[other]["state"])
                    masters.update(saved[other]["masters"])
            full.update(saved[rank]["state"])
            masters.update(saved[rank]["masters"])
            full = {k: paddle.to_tensor(v) for k, v in full.items()}
            full["master_weights"] = {k: paddle.to_tensor(v) for k, v in masters.items()}
            full["LR_Scheduler"] = {"last_epoch": 2, "last_lr": 0.02}
            for p in net.parameters():
                p.set_value(saved[rank]["params"][p.name])
            seen = {}
            inner_set = opt._inner_opt.set_state_dict

            def spy(state):
                seen.update(state)
                inner_set(state)

            opt._inner_opt.set_state_dict = spy
            opt.set_state_dict(full)
            local = {p.name for p in opt._local_parameter_list}
            kept = [k for k in seen if k not in ("master_weights", "LR_Scheduler")]
            lr_kept = "LR_Scheduler" in seen
            owners = [state_owner(opt._runtime, k)[0] for k in kept]
            master_names = {k: v.name for k, v in seen.get("master_weights", {}).items()}
            train_steps(cfg, hcg, net, opt, first_step=2, steps=1)
            return net.named_values(), local, owners, len(full) - 2, master_names, lr_kept

        uninterrupted, _ = run_world(cfg)
        run_world(cfg, body=first_two_steps)
        resumed, _ = run_world(cfg, body=resume)
        for rank, (a, (values, local, owners, n_full, masters, lr_kept)) in enumerate(
                zip(uninterrupted, resumed)):
            self.assertTrue(lr_kept, "LR_Scheduler must reach the inner optimizer")
            self.assertTrue(set(owners) <= local and owners, (
                f"rank {rank}: set_state_dict passed states of parameters it does not "
                f"update: {sorted(set(owners) - local)}"))
            self.assertLess(len(owners), n_full, "the full dict must be filtered")
            self.assertTrue(set(masters) <= local)
            for name, var_name in masters.items():
                self.assertTrue(var_name.startswith(name + "_fp32_master"), (
                    f"rank {rank}: master weight of {name} named {var_name!r}, not as "
                    f"this optimizer names it"))
            for key in a.values:
                self.assertTrue(np.array_equal(a.values[key], values[key]), (
                    f"rank {rank}: {key} resumed from the full state dict differs from "
                    f"the uninterrupted run"))


def _expect_error(test, cfg, make, exc, fragment):
    def body(cfg, strategy):
        make(cfg, strategy)

    with test.assertRaises(exc) as info:
        run_world(cfg, body=body, mode="record", reraise_original=True)
    test.assertIn(fragment, str(info.exception))


def _param_groups(cfg, strategy):
    hcg, net = _net(cfg)
    muon = _muon_for(net)
    muon._parameter_list = [{"params": list(net.parameters())}]
    MuonShardingOptimizer(muon, hcg, strategy)


def _missing_map_entry(cfg, strategy):
    hcg, net = _net(cfg)
    muon = _muon_for(net)
    del muon._muon_param_info_map[net.dense["w_in"].name]
    MuonShardingOptimizer(muon, hcg, strategy)


def _bad_colour_value(cfg, strategy):
    hcg, net = _net(cfg)
    net.dense["w_in"].color = "moe"
    MuonShardingOptimizer(_muon_for(net), hcg, strategy)


def _colour_group_not_a_group(cfg, strategy):
    hcg, net = _net(cfg)
    net.dense["w_in"].color = {"color": "x", "group": [0, 1]}
    MuonShardingOptimizer(_muon_for(net), hcg, strategy)


def _not_muon(cfg, strategy):
    hcg, net = _net(cfg)
    MuonShardingOptimizer(paddle.optimizer.AdamW(parameters=list(net.parameters())),
                          hcg, strategy)


def _no_apply_optimize(cfg, strategy):
    hcg, net = _net(cfg)
    muon = _muon_for(net)
    fake = types.SimpleNamespace(_parameter_list=list(net.parameters()),
                                 _muon_param_info_map=muon._muon_param_info_map)
    MuonShardingOptimizer(fake, hcg, strategy)


def _plain(cfg, strategy):
    hcg, net = _net(cfg)
    MuonShardingOptimizer(_muon_for(net), hcg, strategy)


def _with_fields(pp=None, hybrid=None, **sharding):
    def make(cfg, strategy):
        for k, v in sharding.items():
            setattr(strategy.hybrid_configs["sharding_configs"], k, v)
        for k, v in (pp or {}).items():
            setattr(strategy.hybrid_configs["pp_configs"], k, v)
        _plain(cfg, strategy)

    return make


def _with_strategy_copy(**hybrid):
    """Run ``_plain`` with hybrid_configs top-level fields changed on a copy."""

    def make(cfg, strategy):
        import copy

        copied = copy.deepcopy(strategy)
        copied.strategy.hybrid_configs.MergeFrom(type(copied.strategy.hybrid_configs)(**hybrid))
        hcg, net = _net(cfg)
        MuonShardingOptimizer(_muon_for(net), hcg, copied)

    return make


# (cfg, make, exception, fragment of the message): every construction-time
# error; docs/USAGE.md "Errors" lists the same table.
CONSTRUCTION_ERRORS = {
    "param_groups": (SimConfig(ep=2, ms=2), _param_groups, TypeError, "parameter groups"),
    "missing_map_entry": (SimConfig(ep=2, ms=2), _missing_map_entry, ValueError,
                          "muon_param_info_map"),
    "bad_colour": (SimConfig(ep=2, ms=2), _bad_colour_value, ValueError, "color='moe'"),
    "colour_group_type": (SimConfig(ep=2, ms=2), _colour_group_not_a_group, TypeError,
                          "not a paddle.distributed Group"),
    "not_muon": (SimConfig(ep=2, ms=2), _not_muon, TypeError, "_muon_param_info_map"),
    "no_apply_optimize": (SimConfig(ep=2, ms=2), _no_apply_optimize, TypeError,
                          "_apply_optimize"),
    # develop asserts these: an AssertionError (ours is a ValueError too)
    "pp_with_overlap": (SimConfig(ep=2, ms=2, pp=2, overlap=True), _plain, AssertionError,
                        "comm_overlap=True cannot be combined"),
    "overlap_without_fusion": (SimConfig(ep=2, ms=2, fused=False, overlap=True), _plain,
                               ValueError, "needs fused gradient buffers"),
    "overlap_acc_steps_0": (SimConfig(ep=2, ms=2, overlap=True),
                            _with_fields(accumulate_steps=0), AssertionError,
                            "accumulate_steps >= 1"),
    "pp_sharding_comm_overlap": (SimConfig(ep=2, ms=2),
                                 _with_fields(pp={"sharding_comm_overlap": True}),
                                 AssertionError, "pp_configs.sharding_comm_overlap=True"),
    "tensor_fusion_without_buffers": (SimConfig(ep=2, ms=2, fused=False),
                                      _with_fields(tensor_fusion=True), ValueError,
                                      "tensor_fusion=True"),
    "optimizer_timer_on_cpu": (SimConfig(ep=2, ms=2),
                               _with_strategy_copy(enable_optimizer_timer=True), ValueError,
                               "enable_optimizer_timer=True needs a CUDA build"),
}


class TestConstructionErrors(unittest.TestCase):
    def test_misconfiguration_raises_at_construction(self):
        for name, (cfg, make, exc, fragment) in CONSTRUCTION_ERRORS.items():
            with self.subTest(name):
                _expect_error(self, cfg, make, exc, fragment)

    def test_bad_partition_strategy_names_the_option(self):
        settings = ShardingSettings(muon_partition_strategy="random")
        with self.assertRaisesRegex(ValueError, "muon_partition_strategy='random'"):
            settings.check(pp_world_size=1)

    def test_tensor_parallel_is_rejected(self):
        def make(cfg, strategy):
            hcg, net = _net(cfg)
            MuonShardingOptimizer(_muon_for(net), TensorParallelHcg(hcg), strategy)

        _expect_error(self, SimConfig(ep=2, ms=2), make, ValueError, "mp_degree=2")

    def test_colour_group_membership_and_consistency_errors(self):
        def not_member(cfg, strategy):
            hcg, net = _net(cfg)
            other = [r for r in range(cfg.world) if r != _rank()][:1]
            group = paddle.distributed.new_group(sorted(set(other)))
            net.dense["w_in"].color = {"color": "x", "group": group}
            MuonShardingOptimizer(_muon_for(net), hcg, strategy)

        def two_groups(cfg, strategy):
            hcg, net = _net(cfg)
            net.dense["w_in"].color = {"color": "moe_expert",
                                       "group": hcg.get_sharding_parallel_group()}
            MuonShardingOptimizer(_muon_for(net), hcg, strategy)

        def equal_size_groups(cfg, strategy):
            # one colour key on two groups of the same size, other ranks
            hcg, net = _net(cfg)
            net.dense["w_in"].color = {"color": "x",
                                       "group": hcg.get_moe_sharding_parallel_group()}
            net.dense["w_out"].color = {"color": "x", "group": hcg.get_expert_parallel_group()}
            MuonShardingOptimizer(_muon_for(net), hcg, strategy)

        def no_params(cfg, strategy):
            hcg, net = _net(cfg)
            muon = _muon_for(net)
            muon._parameter_list = []
            MuonShardingOptimizer(muon, hcg, strategy)

        _expect_error(self, SimConfig(ep=2, ms=2), not_member, ValueError,
                      "is not in its colour group")
        _expect_error(self, SimConfig(ep=2, ms=2), two_groups, ValueError,
                      "used with two different groups")
        _expect_error(self, SimConfig(ep=2, ms=2), equal_size_groups, ValueError,
                      "used with two different groups")
        _expect_error(self, SimConfig(ep=2, ms=2), no_params, ValueError,
                      "needs an optimizer built with")

    def test_device_count_failure_keeps_the_cause(self):
        from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import comm_plan as mcp

        broken = RuntimeError("CUDA driver version is insufficient")

        def device_count():
            raise broken

        with self.assertRaises(ValueError) as info:
            mcp.resolve_gpus_per_node({}, device_count)
        self.assertIs(info.exception.__cause__, broken)
        self.assertIn("CUDA driver version is insufficient", str(info.exception))
        # the default query: a CUDA build whose runtime fails is not "no device"
        saved = (paddle.is_compiled_with_cuda, paddle.device.cuda.device_count)
        paddle.is_compiled_with_cuda = lambda: True
        paddle.device.cuda.device_count = device_count
        try:
            with self.assertRaises(ValueError) as info:
                mcp.resolve_gpus_per_node({})
            self.assertIs(info.exception.__cause__, broken)
            paddle.is_compiled_with_cuda = lambda: False
            self.assertEqual(mcp._default_device_count(), 0, "CPU builds: no device")
        finally:
            paddle.is_compiled_with_cuda, paddle.device.cuda.device_count = saved

    def test_plan_stage_group_mismatch_names_both_groups(self):
        class OtherShardingGroup:
            def __init__(self, inner, group):
                self._inner, self._group = inner, group

            def get_sharding_parallel_group(self):
                return self._group

            def __getattr__(self, item):
                return getattr(self._inner, item)

        def make(cfg, strategy):
            hcg, net = _net(cfg)
            moe = hcg.get_moe_sharding_parallel_group()  # not the stage group
            MuonShardingOptimizer(_muon_for(net), OtherShardingGroup(hcg, moe), strategy)

        cfg = SimConfig(ep=2, ms=2, gpn=2)

        def body(cfg, strategy):
            make(cfg, strategy)

        with self.assertRaises(ValueError) as info:
            run_world(cfg, body=body, mode="record", reraise_original=True)
        message = str(info.exception)
        self.assertIn("default sharding group", message)
        self.assertIn("stage group", message)
        self.assertIn("[0, 1, 2, 3]", message)  # the plan's stage group, named


class TestDevelopSurface(unittest.TestCase):
    """The attributes and methods develop's callers read, with develop's meaning."""

    def test_attributes_use_group_local_ranks_and_none_for_default(self):
        cfg = SimConfig(ep=2, ms=2, steps=1, via_fleet=False)

        def body(cfg, strategy):
            hcg, net, opt, coord = build_rank(cfg, strategy)
            rank = _rank()
            out = {}
            for colour, info in opt._color_to_group_info.items():
                ranks = list(info["group"].ranks)
                out[colour] = {
                    "rank_ok": ranks[info["rank"]] == rank and info["world_size"] == len(ranks),
                    "owners_ok": all(
                        ranks[local] == opt.owner_map[name]
                        for name, local in opt._param2rank_2d_by_color[colour].items()),
                    "by_rank_ok": all(
                        opt._param2rank_2d_by_color[colour][p.name] == local
                        for local, ps in opt._rank2params_2d_by_color[colour].items()
                        for p in ps),
                    "n2d": len(opt._params_2d_by_color[colour]),
                }
            local_2d = {p.name for p in opt._local_2d}
            out["local_2d_ok"] = local_2d == {n for n, o in opt.owner_map.items() if o == rank}
            out["params_1d"] = sorted(p.name for p in opt._params_1d)
            out["buffers_ok"] = (
                set(map(id, opt.comm_buffer_2d)) == {id(b) for bk in opt.muon_buckets
                                                     for b in bk.buffers}
                and opt._comm_buffer_list is opt._runtime.rs_buffers
                and all(opt.param2bucket[p.name] for p in opt._params_1d)
                and set(opt._slice_params) == {p.name for p in opt._params_1d})
            out["inner_sees_local"] = (
                opt._inner_opt._parameter_list is opt._local_parameter_list)
            return out

        results, _ = run_world(cfg, body=body, mode="record")
        for rank, out in enumerate(results):
            self.assertEqual(set(out) - {"local_2d_ok", "params_1d", "buffers_ok",
                                         "inner_sees_local"}, {None, "moe_expert"},
                             "colour keys: None for the default group, the key otherwise")
            for colour in (None, "moe_expert"):
                self.assertTrue(out[colour]["rank_ok"] and out[colour]["owners_ok"]
                                and out[colour]["by_rank_ok"], (rank, colour, out[colour]))
            self.assertEqual(out[None]["n2d"], 2)
            self.assertEqual(out["moe_expert"]["n2d"], 5)
            self.assertTrue(out["local_2d_ok"] and out["buffers_ok"] and out["inner_sees_local"])
            self.assertEqual(out["params_1d"], ["dense.b_in", "dense.norm_w", "expert.bias"])

    def test_inspection_surface_and_minimize(self):
        cfg = SimConfig(ep=2, ms=2, steps=1, via_fleet=False, clip=False)

        def body(cfg, strategy):
            hcg, net, opt, coord = build_rank(cfg, strategy)
            rank = _rank()
            out = {"plan": opt.comm_plan, "colours": set(opt.partitions)}
            owned_by_buckets = {p.name: b.owner for b in opt.muon_buckets for p in b.params}
            out["buckets_match_owner_map"] = owned_by_buckets == opt.owner_map
            foreign = next(n for n, o in opt.owner_map.items() if o != rank)
            out["foreign_range"] = opt.local_range(foreign)
            try:
                opt.local_range("no.such.param")
                out["missing_raises"] = False
            except KeyError as error:
                out["missing_raises"] = "not a trainable parameter" in str(error)
            out["foreign_state_key"] = state_owner(opt._runtime, "unrelated_state")
            before = net.named_values()
            net(paddle.to_tensor(batch(0, rank))).backward()
            opt.reduce_gradients(list(net.parameters()), hcg)
            _, params_grads = opt.minimize(None)
            out["updated"] = len(params_grads) > 0 and any(
                not np.array_equal(before[k], v) for k, v in net.named_values().items())
            # __getattr__ reaches the inner Muon, but never recurses on _inner_opt
            out["delegates"] = abs(opt.get_lr() - 0.02) < 1e-12
            bare = MuonShardingOptimizer.__new__(MuonShardingOptimizer)
            try:
                bare._inner_opt
                out["no_recursion"] = False
            except AttributeError:
                out["no_recursion"] = True
            return out

        results, _ = run_world(cfg, body=body)
        for rank, out in enumerate(results):
            self.assertIsNone(out["plan"], "no routing plan with comm_group_call_opt off")
            self.assertEqual(out["colours"], {None, "moe_expert"})
            self.assertTrue(out["buckets_match_owner_map"],
                            f"rank {rank}: buckets disagree with owner_map")
            self.assertEqual(out["foreign_range"], (0, 0))
            self.assertTrue(out["missing_raises"] and out["no_recursion"])
            self.assertIsNone(out["foreign_state_key"])
            self.assertTrue(out["updated"] and out["delegates"])

    def test_owner_map_is_rank_independent_and_balanced(self):
        cfg = SimConfig()

        def body(cfg, strategy):
            hcg, net, opt, coord = build_rank(cfg, strategy)
            return sharded_core(opt).owner_map

        results, _ = run_world(cfg, body=body, mode="record")
        sharding = {k: v for k, v in results[0].items() if k.startswith("dense.")}
        for rank, owners in enumerate(results):
            self.assertEqual({k: v for k, v in owners.items() if k.startswith("dense.")},
                             sharding,
                             f"rank {rank} derived a different owner map for the dense matrices")
        self.assertEqual(len(set(sharding.values())), len(sharding),
                         f"the dense matrices should land on distinct owners, got {sharding}")

    def test_upstream_partition_is_the_default_and_concentrates_owners(self):
        cfg = SimConfig(ep=1, ms=4, steps=2, partition="upstream_greedy")
        self.assertEqual(ShardingSettings().muon_partition_strategy, "upstream_greedy")
        results, _ = run_world(cfg)
        _assert_matches_reference(self, cfg, results, "upstream partition")
        owners = set(sharded_core(results[0].optimizer).owner_map.values())
        self.assertEqual(owners, {0},
                         f"develop's rule fills the first rank first, got owners {owners}")

    def test_muon_param_info_map_overrides_shape_rule(self):
        cfg = SimConfig(ep=2, ms=2)

        def body(cfg, strategy):
            hcg, net = _net(cfg)
            info = {p.name: MuonParamInfo(use_muon=p.ndim >= 2) for p in net.parameters()}
            info[net.dense["w_out"].name] = MuonParamInfo(use_muon=False)
            muon = make_muon(list(net.parameters()), muon_param_info_map=info)
            core = MuonShardingOptimizer(muon, hcg, strategy)
            name = net.dense["w_out"].name
            return name in core.owner_map, name in core._slice_params

        results, _ = run_world(cfg, body=body, mode="record")
        self.assertTrue(all(r == (False, True) for r in results), (
            "a matrix mapped to use_muon=False must be element-wise sharded, not owned"))

    def test_settings_default_strategy(self):
        self.assertEqual(ShardingSettings.from_strategy(None), ShardingSettings())
        cfg = SimConfig(ep=2, ms=2, steps=1, fused=False, overlap=False)

        def body(cfg, strategy):
            hcg, net = _net(cfg)
            # strategy omitted: read from fleet's user strategy (the harness sets it)
            return MuonShardingOptimizer(_muon_for(net), hcg)._settings.comm_buffer_size_MB

        results, _ = run_world(cfg, body=body, mode="record")
        self.assertEqual(results, [-1] * cfg.world)

    def test_frozen_parameter_is_neither_owned_nor_sliced(self):
        cfg = SimConfig(ep=2, ms=2, steps=2, via_fleet=False, clip=False)

        def body(cfg, strategy):
            hcg, net = _net(cfg)
            frozen = net.dense["w_out"]
            frozen.stop_gradient = True
            before = frozen.numpy()
            core = MuonShardingOptimizer(_muon_for(net, clip=False), hcg, strategy)
            for step in range(2):
                net(paddle.to_tensor(batch(step, _rank()))).backward()
                core.reduce_gradients(list(net.parameters()), hcg)
                core.step()
                core.clear_grad()
            return (frozen.name in core.owner_map, frozen.name in core._slice_params,
                    np.array_equal(before, frozen.numpy()))

        results, _ = run_world(cfg, body=body)
        self.assertTrue(all(r == (False, False, True) for r in results), results)

    def test_missing_gradient_takes_part_as_zeros(self):
        cfg = SimConfig(ep=2, ms=2, fused=False, via_fleet=False, clip=False)

        def body(cfg, strategy):
            hcg, net, opt, coord = build_rank(cfg, strategy)
            net(paddle.to_tensor(batch(0, _rank()))).backward()
            w = net.dense["w_out"]
            w.clear_gradient(False)  # e.g. an unused branch this step
            opt.reduce_gradients(list(net.parameters()), hcg)
            if opt.owner_map[w.name] == _rank():
                return float(np.abs(w.grad.numpy()).max())
            return None

        results, _ = run_world(cfg, body=body)
        owners = [r for r in results if r is not None]
        self.assertEqual(owners, [0.0], f"the owner must receive the zero mean, got {owners}")

    def test_small_buffer_limit_splits_buckets(self):
        cfg = SimConfig(ep=2, ms=2)

        def body(cfg, strategy):
            from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.layout import (
                ShardingLayout,
            )

            hcg, net, opt, coord = build_rank(cfg, strategy)
            core = sharded_core(opt)
            layout = core.sharding_layout
            built = [[[p.name for p in buf.params] for buf in b.buffers]
                     for b in core.muon_buckets]
            planned = [[list(c) for c in spec.chunks] for spec in layout.muon_buckets]
            small = ShardingLayout.build(
                list(layout.params.values()), layout.groups, layout.rank,
                dataclasses.replace(layout.settings, comm_buffer_size_MB=1024 / (1024 * 1024)))
            chunks = [[sum(small.params[n].nbytes for n in c) for c in spec.chunks]
                      for spec in small.muon_buckets]
            return built == planned, chunks, [len(c) for b in small.muon_buckets for c in b.chunks]

        results, _ = run_world(cfg, body=body, mode="record")
        same, sizes, lens = results[0]
        self.assertTrue(same, "the optimizer's fused buffers differ from the layout's chunks")
        flat_sizes = [s for bucket in sizes for s in bucket]
        self.assertGreater(len(flat_sizes), len(sizes), "a 1 KiB limit must split some bucket")
        self.assertTrue(all(s <= 1024 or n == 1 for s, n in zip(flat_sizes, lens)), (
            f"a chunk of several params exceeds the limit: {list(zip(flat_sizes, lens))}"))


class TestParamStorage(unittest.TestCase):
    """clear_param_storage(color) frees a colour; step restores it exactly."""

    def test_clear_frees_and_step_restores_exactly(self):
        cfg = SimConfig(ep=2, ms=2, steps=3, via_fleet=False)

        def body(clear):
            def run(cfg, strategy):
                hcg, net, opt, coord = build_rank(cfg, strategy)
                rank, freed, kept = _rank(), [], []
                for step in range(cfg.steps):
                    net(paddle.to_tensor(batch(step, rank))).backward()
                    opt.reduce_gradients(list(net.parameters()), hcg)
                    if clear:
                        for colour in (None, "moe_expert"):
                            opt.clear_param_storage(colour)
                        opt.clear_param_storage(None)  # twice: no-op
                        for p in net.parameters():
                            owned = opt.owner_map.get(p.name) == rank
                            (kept if owned else freed).append(p._is_initialized())
                    opt.step()
                    opt.clear_grad()
                return RankState(rank, coord, net.named_values(), opt, net,
                                 extra=(freed, kept))
            return run

        plain, _ = run_world(cfg, body=body(False))
        cleared, _ = run_world(cfg, body=body(True))
        for a, b in zip(plain, cleared):
            freed, kept = b.extra
            self.assertTrue(freed and not any(freed), (
                f"rank {b.rank}: clear_param_storage left storage of parameters it does "
                f"not own allocated"))
            self.assertTrue(all(kept), f"rank {b.rank}: an owned matrix lost its storage")
            for key in a.values:
                self.assertTrue(np.array_equal(a.values[key], b.values[key]), (
                    f"rank {b.rank}: {key} after clear_param_storage + step differs from "
                    f"the run that never freed it"))

    def test_found_inf_after_clear_restores_values(self):
        cfg = SimConfig(ep=2, ms=2, steps=1, via_fleet=False, clip=False)

        def body(cfg, strategy):
            hcg, net, opt, coord = build_rank(cfg, strategy)
            before = net.named_values()
            net(paddle.to_tensor(batch(0, _rank()))).backward()
            opt.reduce_gradients(list(net.parameters()), hcg)
            opt.clear_param_storage(None)
            opt._inner_opt._set_auxiliary_var("found_inf", paddle.to_tensor(True))
            opt.step()
            after = net.named_values()
            return all(np.array_equal(before[k], after[k]) for k in before)

        results, _ = run_world(cfg, body=body)
        self.assertTrue(all(results), "a skipped step must give back every value")


    def test_clear_then_step_keeps_low_precision_matrices_in_their_dtype(self):
        # reset_param_storage refills freed matrices this rank does not own;
        # a bf16 matrix must come back bf16 (an fp32 buffer would change the
        # parameter's dtype under the user's model).
        cfg = SimConfig(ep=2, ms=2, steps=2, via_fleet=False, matrix_dtype="bfloat16",
                        clip=False)

        def body(clear):
            def run(cfg, strategy):
                hcg, net, opt, coord = build_rank(cfg, strategy)
                rank = _rank()
                for step in range(cfg.steps):
                    net(paddle.to_tensor(batch(step, rank))).backward()
                    opt.reduce_gradients(list(net.parameters()), hcg)
                    if clear:
                        opt.clear_param_storage(None)
                    opt.step()
                    opt.clear_grad()
                w = net.dense["w_in"]
                return RankState(rank, coord, net.named_values(), opt, net,
                                 extra=(str(w.dtype), opt.owner_map[w.name] == rank))
            return run

        plain, _ = run_world(cfg, body=body(False))
        cleared, _ = run_world(cfg, body=body(True))
        self.assertTrue(any(not owned for _, owned in (r.extra for r in cleared)),
                        "some rank must not own w_in (else nothing was freed)")
        for a, b in zip(plain, cleared):
            self.assertEqual(b.extra[0], "paddle.bfloat16",
                             f"rank {b.rank}: w_in after clear_param_storage + step")
            for key in a.values:
                self.assertTrue(np.array_equal(a.values[key], b.values[key]), (
                    f"rank {b.rank}: {key} differs from the run that never freed it"))


class TestEdgeParameters(unittest.TestCase):
    """Parameters the sharding core must carry exactly: bf16 main_grad, per-parameter
    learning rates on slices, zero-size parameters."""

    def test_missing_main_grad_of_a_bf16_parameter_is_created_in_fp32(self):
        p = paddle.create_parameter([3, 4], "bfloat16",
                                    default_initializer=paddle.nn.initializer.Constant(0.5))
        p.main_grad = None
        grad = MuonShardingOptimizer._get_param_grad(p)
        self.assertEqual(grad.dtype, paddle.float32, "main_grad holds fp32 (MixPrecisionLayer)")
        self.assertEqual(list(grad.shape), [3, 4])
        self.assertEqual(float(np.abs(grad.numpy()).max()), 0.0)
        self.assertIs(p.main_grad, grad)

    def test_slices_keep_the_parameters_optimize_attr(self):
        # lr_ratio reading ParamAttr's learning rate: the AdamW update runs on
        # the slice, so the slice must carry the parameter's optimize_attr.
        cfg = SimConfig(ep=1, ms=2, steps=2, via_fleet=False, clip=False)

        def body(cfg, strategy):
            hcg, net = _net(cfg)
            net.dense["b_in"].optimize_attr = {"learning_rate": 0.0}
            before = net.named_values()
            muon = _muon_for(net, clip=False,
                             lr_ratio=lambda p: p.optimize_attr["learning_rate"])
            opt = MuonShardingOptimizer(muon, hcg, strategy)
            for step in range(cfg.steps):
                net(paddle.to_tensor(batch(step, _rank()))).backward()
                opt.reduce_gradients(list(net.parameters()), hcg)
                opt.step()
                opt.clear_grad()
            return before, net.named_values()

        for rank, (before, after) in enumerate(run_world(cfg, body=body)[0]):
            self.assertTrue(np.array_equal(before["dense.b_in"], after["dense.b_in"]), (
                f"rank {rank}: dense.b_in has learning_rate 0 in its optimize_attr but moved"))
            self.assertFalse(np.array_equal(before["dense.norm_w"], after["dense.norm_w"]),
                             f"rank {rank}: dense.norm_w (learning_rate 1) must move")

    def test_zero_size_parameters_are_left_out_and_unchanged(self):
        # A [0, 4] parameter routed to Muon or to AdamW: the others train as
        # in a run without it (bit-exact), it keeps its shape and owns nothing.
        cfg = SimConfig(ep=1, ms=2, steps=2, via_fleet=False, clip=False)

        def body(with_zero, use_muon):
            def run(cfg, strategy):
                hcg, net = _net(cfg)
                params = list(net.parameters())
                zero = None
                if with_zero:
                    zero = paddle.create_parameter([0, 4], "float32")
                    zero.name = "dense.zero"
                    params.insert(1, zero)
                info = {p.name: MuonParamInfo(use_muon=len(p.shape) == 2) for p in params}
                if zero is not None:
                    info[zero.name] = MuonParamInfo(use_muon=use_muon)
                opt = MuonShardingOptimizer(
                    make_muon(params, clip=False, muon_param_info_map=info), hcg, strategy)
                for step in range(cfg.steps):
                    loss = net(paddle.to_tensor(batch(step, _rank())))
                    if zero is not None:
                        loss = loss + zero.sum()
                    loss.backward()
                    opt.reduce_gradients(params, hcg)
                    opt.step()
                    opt.clear_grad()
                shape = None if zero is None else list(zero.shape)
                owned = zero is not None and zero.name in opt.owner_map
                return net.named_values(), shape, owned
            return run

        plain = run_world(cfg, body=body(False, False))[0]
        for use_muon in (True, False):
            with self.subTest(use_muon=use_muon):
                got = run_world(cfg, body=body(True, use_muon))[0]
                for rank, ((want, _, _), (values, shape, owned)) in enumerate(zip(plain, got)):
                    self.assertEqual(shape, [0, 4], f"rank {rank}")
                    self.assertFalse(owned, f"rank {rank}: a zero-size matrix got an owner")
                    for key in want:
                        self.assertTrue(np.array_equal(want[key], values[key]), (
                            f"rank {rank}: {key} differs from the run without the "
                            "zero-size parameter"))


class TestOptionsHonoured(unittest.TestCase):
    """Each sharding/pp option develop reads has an observable effect here."""

    def test_release_gradients_from_sharding_or_pp_configs(self):
        cases = {
            "sharding_configs": dict(release_gradients=True),
            "sharding_configs_per_param": dict(release_gradients=True, comm_buffer_size_MB=-1),
            "pp_configs": dict(pp_configs={"release_gradients": True}),
        }
        for name, fields in cases.items():
            with self.subTest(name):
                cfg = SimConfig(ep=2, ms=2, steps=3)

                def body(cfg, strategy, fields=fields):
                    state = _with_sharding_configs(**fields)(cfg, strategy)
                    core = sharded_core(state.optimizer)
                    released = all(b.grad_storage is None for b in core._runtime.rs_buffers)
                    return state, released

                results, _ = run_world(cfg, body=body)
                self.assertTrue(all(r[1] for r in results),
                                f"[{name}] the 1-D gradient buffers were not released")
                _assert_matches_reference(self, cfg, [r[0] for r in results], name)

    def test_tensor_fusion_fuses_gradients(self):
        # One fused gradient buffer, and one reduce per step, per (colour
        # group, owner, dtype) of the Muon matrices: fewer than the matrices.
        cfg = SimConfig(ep=2, ms=2, steps=2)

        def body(cfg, strategy):
            state = _with_sharding_configs(tensor_fusion=True)(cfg, strategy)
            core = sharded_core(state.optimizer)
            muon = {p.name: p for p in state.net.parameters()
                    if core.owner_map.get(p.name) is not None}
            colour = {n: (p.color["color"] if isinstance(getattr(p, "color", None), dict)
                          else None) for n, p in muon.items()}
            keys = {(colour[n], core.owner_map[n], str(p.dtype)) for n, p in muon.items()}
            return state, len(core.comm_buffer_2d), len(keys), len(muon)

        results, world = run_world(cfg, body=body)
        for state, n_buffers, n_keys, n_muon in results:
            self.assertEqual(n_buffers, n_keys, (
                f"rank {state.rank}: {n_buffers} fused 2-D gradient buffers for {n_keys} "
                "(colour, owner, dtype) groups of Muon matrices"))
            self.assertLess(n_keys, n_muon, "the model should have matrices to fuse")
            reduces = [r for r in world.traces[state.rank]
                       if r.op == "reduce" and r.group_seq is not None]
            self.assertEqual(len(reduces), n_keys * cfg.steps, (
                f"rank {state.rank}: {len(reduces)} reduces in {cfg.steps} steps, expected "
                f"one per fused buffer ({n_keys}) per step"))
        _assert_matches_reference(self, cfg, [r[0] for r in results], "tensor_fusion")

    def test_enable_fuse_optimizer_states_keeps_states_in_one_buffer(self):
        cfg = SimConfig(ep=2, ms=2, steps=3, matrix_dtype="bfloat16", clip=False)

        def body(cfg, strategy):
            state = _with_sharding_configs(enable_fuse_optimizer_states=True)(cfg, strategy)
            core = sharded_core(state.optimizer)
            base = core._runtime.base_opt
            buffers = core.fused_states_buffers
            states = [t for per in base._accumulators.values() for t in per.values()
                      if int(t._numel()) > 1] + list(base._master_weights.values())
            shared = all(any(t._is_shared_buffer_with(b) for b in buffers.values())
                         for t in states)
            # develop fuses tensors of more than one element: the beta powers
            # (shape [1], kept on the CPU for the adamw kernel) stay apart
            scalars = [t for per in base._accumulators.values() for t in per.values()
                       if int(t._numel()) == 1]
            apart = not any(t._is_shared_buffer_with(b) for t in scalars
                            for b in buffers.values())
            return state, shared and bool(states), len(buffers), apart and bool(scalars)

        results, _ = run_world(cfg, body=body)
        for state, shared, n_buffers, apart in results:
            self.assertTrue(shared, f"rank {state.rank}: a state lives outside the fused buffer")
            self.assertTrue(apart, f"rank {state.rank}: a beta power was fused")
            self.assertEqual(n_buffers, 1, "fp32 states (moments, masters): one buffer")
        _assert_matches_reference(self, cfg, [r[0] for r in results], "fused states", BF16_TOL)
        plain, _ = run_world(cfg)
        for a, b in zip(plain, results):
            for key in a.values:
                self.assertTrue(np.array_equal(a.values[key], b[0].values[key]),
                                f"fused optimizer states changed the numbers of {key}")

    def test_enable_optimizer_timer_times_develops_phases(self):
        started = []

        class FakeTimer:
            def __init__(self, name):
                self.name = name

            def start(self):
                started.append(self.name)

            def stop(self):
                pass

        saved = (paddle.is_compiled_with_cuda, timer_helper.is_timer_initialized,
                 timer_helper.get_timers, timer_helper.set_timers)
        set_calls = []
        paddle.is_compiled_with_cuda = lambda: True
        timer_helper.is_timer_initialized = lambda: bool(set_calls)
        timer_helper.set_timers = lambda: set_calls.append(1)
        timer_helper.get_timers = lambda: FakeTimer
        try:
            settings = ShardingSettings(enable_optimizer_timer=True)
            settings.check(pp_world_size=1)  # accepted on a CUDA build
            cfg = SimConfig(ep=2, ms=2, steps=1, via_fleet=False, clip=False)

            def body(cfg, strategy):
                import copy

                copied = copy.deepcopy(strategy)
                copied.strategy.hybrid_configs.enable_optimizer_timer = True
                hcg, net = _net(cfg)
                opt = MuonShardingOptimizer(_muon_for(net, clip=False), hcg, copied)
                train_steps(cfg, hcg, net, opt)

            # register_cpu_tensor_fusion keeps "cpu" once set, whatever the build says
            run_world(cfg, body=body)
        finally:
            (paddle.is_compiled_with_cuda, timer_helper.is_timer_initialized,
             timer_helper.get_timers, timer_helper.set_timers) = saved
        self.assertEqual(set(started), {"reduce-gradients", "apply-optimize", "sync-parameters"})
        self.assertEqual(len(set_calls), 1, "Paddle's timers are set up once per process")

    def test_group_call_matches_reference(self):
        cfg = SimConfig(ep=2, ms=2, gpn=2, steps=2)
        results, world = run_world(cfg)
        self.assertIsNotNone(sharded_core(results[0].optimizer).comm_plan)
        _assert_matches_reference(self, cfg, results, "comm_group_call_opt")
        phases = {r.phase for trace in world.traces for r in trace}
        self.assertIn("cross_node_reduce", phases)

    def test_use_reduce_avg_falls_back_to_sum_with_a_warning(self):
        @dataclasses.dataclass(frozen=True)
        class AsksForAvg(SimConfig):
            # the warning is for a user who set use_reduce_avg, not its default
            def strategy(self):
                strategy = super().strategy()
                strategy.hybrid_configs["sharding_configs"].use_reduce_avg = True
                return strategy

        cfg = AsksForAvg(ep=2, ms=2, steps=1)
        mss._SEEN.discard("reduce_avg")
        with self.assertLogs(mso.logger, level="WARNING") as logs:
            results, _ = run_world(cfg)
        self.assertTrue(any("use_reduce_avg=True" in line for line in logs.output))
        self.assertFalse(sharded_core(results[0].optimizer)._runtime.use_avg)
        _assert_matches_reference(self, cfg, results, "SUM fallback")

    def test_clear_grad_set_to_zero_false_frees_unfused_gradients(self):
        cfg = SimConfig(ep=2, ms=2, steps=1, fused=False, via_fleet=False, clip=False)

        def body(cfg, strategy):
            hcg, net, opt, coord = build_rank(cfg, strategy)
            net(paddle.to_tensor(batch(0, _rank()))).backward()
            opt.reduce_gradients(list(net.parameters()), hcg)
            opt.step()
            opt.clear_grad(set_to_zero=False)
            muon_freed = all(p.grad is None for b in opt.muon_buckets for p in b.params)
            train_steps(cfg, hcg, net, opt, first_step=1, steps=1)  # still trains
            return RankState(_rank(), coord, net.named_values(), opt, net, extra=muon_freed)

        results, _ = run_world(cfg, body=body)
        self.assertTrue(all(r.extra for r in results),
                        "per-parameter Muon gradients must be freed")
        _assert_matches_reference(self, SimConfig(ep=2, ms=2, steps=2, fused=False, clip=False),
                                  results, "after clear_grad(False)")

    def test_no_hook_colours_are_reduced_in_reduce_gradients_only(self):
        cfg = SimConfig(ep=2, ms=2, steps=2, overlap=True)

        def body(cfg, strategy):
            hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
            coord = hcg.get_expert_parallel_rank()
            net = TinyMoE(coord, hcg.get_moe_sharding_parallel_group())
            for p in net.dense.values():
                p.color = {"color": "dense_weight_no_hook",
                           "group": hcg.get_sharding_parallel_group()}
            from muon_sim_runner import fleet_optimizer

            opt = fleet_optimizer(make_muon(list(net.parameters())), hcg, strategy)
            train_steps(cfg, hcg, net, opt)
            return RankState(_rank(), coord, net.named_values(), opt, net)

        results, world = run_world(cfg, body=body)
        _assert_matches_reference(self, cfg, results, "no-hook colour under overlap")
        sharding_groups = {(0, 1, 2, 3)}
        for rank, trace in enumerate(world.traces):
            dense = [r for r in trace if r.op in ("reduce", "reduce_scatter")
                     and r.group_ranks in sharding_groups]
            self.assertTrue(dense)
            # reduce_gradients reduces in coalesced blocks; a hook launches one
            # buffer's reduce on its own (no block)
            self.assertTrue(all(r.block is not None for r in dense if r.op == "reduce"), (
                f"rank {rank}: a dense_weight_no_hook reduce was launched from a backward "
                f"hook"))
            moe = [r for r in trace if r.op == "reduce" and r.group_ranks not in sharding_groups]
            self.assertTrue(moe and all(r.block is None for r in moe),
                            f"rank {rank}: expert buffers should still reduce from the hooks")


class _RecordingConfig:
    """A config object that records which fields are read."""

    def __init__(self, section, reads, values):
        self._section, self._reads, self._values = section, reads, values

    def __getattr__(self, name):
        if name.startswith("_") or name == "DESCRIPTOR":
            raise AttributeError(name)
        self._reads.add(f"{self._section}.{name}")
        if name in self._values:
            return self._values[name]
        raise AttributeError(name)


class _RecordingHybrid(dict):
    def __init__(self, reads, values):
        super().__init__(values)
        self._reads = reads

    def __getitem__(self, key):
        self._reads.add(f"hybrid_configs.{key}")
        return super().__getitem__(key)


def _option_outcomes(cfg: SimConfig, sharding=None, pp=None, want=None) -> dict:
    """Observable outcomes of a build + backward (and, unless ``want`` is one
    of those, of a whole step) on rank 0 of a recorded world.

    ``sharding`` / ``pp``: fields set on sharding_configs / pp_configs first.
    """

    def body(cfg, strategy):
        for key, value in (sharding or {}).items():
            setattr(strategy.hybrid_configs["sharding_configs"], key, value)
        for key, value in (pp or {}).items():
            setattr(strategy.hybrid_configs["pp_configs"], key, value)
        hcg, net, opt, coord = build_rank(cfg, strategy)
        net(paddle.to_tensor(batch(0, _rank()))).backward()
        return sharded_core(opt), net

    # the machine-balanced rule gathers every rank's groups: only a data-mode
    # world moves that
    results, world = run_world(cfg, mode="data" if cfg.machine_balanced else "record",
                               body=body)
    core, net = results[0]
    hook_launched = [r for r in world.traces[0] if r.op in ("reduce", "reduce_scatter")]
    outcomes = {
        "reduces launched by one backward": len(hook_launched),
        "fused 2-D gradient buffers": len(core.comm_buffer_2d),
        "owners": tuple(sorted(core.owner_map.items())),
        "owners on every rank": tuple(tuple(sorted(c.owner_map.items())) for c, _ in results),
        "tensor_fusion mirror": core.tensor_fusion,
        "pipeline mirror": core._use_pipeline_parallel,
        "overlapped update": core.overlap_optimize_and_sync,
    }

    if want in outcomes:
        return outcomes

    # the rest needs a whole step: a second world
    def stepping(cfg, strategy):
        for key, value in (sharding or {}).items():
            setattr(strategy.hybrid_configs["sharding_configs"], key, value)
        for key, value in (pp or {}).items():
            setattr(strategy.hybrid_configs["pp_configs"], key, value)
        hcg, net, opt, coord = build_rank(cfg, strategy)
        train_steps(cfg, hcg, net, opt, steps=1)
        core = sharded_core(opt)
        return (len(core.fused_states_buffers),
                all(b.grad_storage is None for b in core._runtime.rs_buffers))

    results, world = run_world(cfg, mode="record", body=stepping)
    ops = [r for r in world.traces[0] if r.op == "reduce" and r.group_seq is not None]
    outcomes.update({
        "fused optimizer-state buffers": results[0][0],
        "1-D gradient buffers released": results[0][1],
        "reduce ops": tuple(sorted({r.reduce_op for r in ops})),
        "phases": tuple(sorted({str(r.phase) for r in ops})),
    })
    return outcomes


_PROBE = SimConfig(ep=2, ms=2, steps=1, clip=False, via_fleet=False)


def _probe(outcome, on=None, off=None, cfg_on=_PROBE, cfg_off=_PROBE, pp_on=None):
    """The option set (``on``/``cfg_on``) and unset (``off``/``cfg_off``) must
    differ in ``outcome`` (a key of :func:`_option_outcomes`)."""
    return ("honoured", outcome, (cfg_on, on or {}, pp_on or {}), (cfg_off, off or {}, {}))


# Every option the optimizer reads: "honoured" gives the observable outcome
# that differs with the option set and unset (both runs are done here);
# "refused" gives the value that must raise and the message fragment.
OPTION_DISPOSITION = {
    "sharding_configs.tensor_fusion": _probe(
        "tensor_fusion mirror", {"tensor_fusion": True}, {"tensor_fusion": False}),
    "sharding_configs.accumulate_steps": _probe(
        "reduces launched by one backward", {"comm_overlap": True, "accumulate_steps": 1},
        {"comm_overlap": True, "accumulate_steps": 2}),
    "sharding_configs.comm_overlap": _probe(
        "reduces launched by one backward", {"comm_overlap": True}, {"comm_overlap": False}),
    "sharding_configs.comm_buffer_size_MB": _probe(
        "fused 2-D gradient buffers", {"comm_buffer_size_MB": 256},
        {"comm_buffer_size_MB": -1}),
    "sharding_configs.use_reduce_avg": _probe(
        "reduce ops", {"use_reduce_avg": True}, {"use_reduce_avg": False},
        cfg_on=SimConfig(**{**_PROBE.__dict__, "use_reduce_avg": True}),
        cfg_off=SimConfig(**{**_PROBE.__dict__, "use_reduce_avg": True})),
    "sharding_configs.enable_fuse_optimizer_states": _probe(
        "fused optimizer-state buffers", {"enable_fuse_optimizer_states": True},
        {"enable_fuse_optimizer_states": False}),
    "sharding_configs.release_gradients": _probe(
        "1-D gradient buffers released", {"release_gradients": True},
        {"release_gradients": False}),
    "sharding_configs.comm_group_call_opt": _probe(
        "phases", cfg_on=SimConfig(**{**_PROBE.__dict__, "gpn": 2})),
    "sharding_configs.muon_partition_strategy": _probe(
        "owners", cfg_on=SimConfig(**{**_PROBE.__dict__, "ep": 1, "ms": 4,
                                      "partition": "balanced"}),
        cfg_off=SimConfig(**{**_PROBE.__dict__, "ep": 1, "ms": 4,
                             "partition": "upstream_greedy"})),
    # 4 ranks on 2 emulated machines: develop's rule fills one machine first
    "sharding_configs.machine_balanced_2d_partition": _probe(
        "owners on every rank", cfg_on=SimConfig(**{**_PROBE.__dict__, "partition": "upstream_greedy",
                                      "local_size": 2, "machine_balanced": True}),
        cfg_off=SimConfig(**{**_PROBE.__dict__, "partition": "upstream_greedy",
                             "local_size": 2})),
    "sharding_configs.overlap_sync_group_call": _probe(
        "overlapped update", cfg_on=SimConfig(**{**_PROBE.__dict__, "gpn": 2,
                                                 "overlap_sync_group_call": True}),
        cfg_off=SimConfig(**{**_PROBE.__dict__, "gpn": 2})),
    "pp_configs.release_gradients": _probe(
        "1-D gradient buffers released", pp_on={"release_gradients": True}),
    "pp_configs.sharding_comm_overlap": ("refused", {"sharding_comm_overlap": True},
                                        "pp_configs.sharding_comm_overlap=True"),
    "hybrid_configs.enable_optimizer_timer": (
        "refused_on_cpu", {"enable_optimizer_timer": True}, "needs a CUDA build"),
    "hybrid_configs.pp_degree": _probe(
        "pipeline mirror", cfg_on=SimConfig(**{**_PROBE.__dict__, "pp": 2})),
    "hybrid_configs.sharding_configs": ("section", None),
    "hybrid_configs.pp_configs": ("section", None),
}


class TestEveryOptionHonouredOrRefused(unittest.TestCase):
    def _read(self, sharding=None, pp=None, hybrid=None):
        reads: set = set()
        defaults = ShardingSettings()
        sharding_values = {f: getattr(defaults, f) for f in mss.SHARDING_CONFIG_FIELDS}
        sharding_values.update(sharding or {})
        pp_values = {"sharding_comm_overlap": False, "release_gradients": False}
        pp_values.update(pp or {})
        strategy = types.SimpleNamespace(hybrid_configs=_RecordingHybrid(reads, {
            "sharding_configs": _RecordingConfig("sharding_configs", reads, sharding_values),
            "pp_configs": _RecordingConfig("pp_configs", reads, pp_values),
            "enable_optimizer_timer": False,
            "pp_degree": 1,
            **(hybrid or {}),
        }))
        return reads, ShardingSettings.from_strategy(strategy)

    def test_every_read_option_is_honoured_or_refused(self):
        reads, settings = self._read()
        settings.check(pp_world_size=1)
        unknown = sorted(reads - set(OPTION_DISPOSITION))
        self.assertFalse(unknown, (
            f"the optimizer reads {unknown} but no test shows them honoured or refused; "
            f"add them to OPTION_DISPOSITION with their test"))
        for option in sorted(reads):
            kind, what, *rest = OPTION_DISPOSITION[option]
            with self.subTest(option):
                if kind == "honoured":
                    (cfg_on, on, pp_on), (cfg_off, off, pp_off) = rest
                    got_on = _option_outcomes(cfg_on, on, pp_on, what)[what]
                    got_off = _option_outcomes(cfg_off, off, pp_off, what)[what]
                    self.assertNotEqual(got_on, got_off, (
                        f"{option}: '{what}' is {got_on!r} with the option set and unset"))
                elif kind == "refused_on_cpu":
                    if paddle.is_compiled_with_cuda():
                        continue  # honoured there: test_enable_optimizer_timer_...
                    _, bad = self._read(hybrid=what)
                    with self.assertRaisesRegex(ValueError, rest[0]):
                        bad.check(pp_world_size=1)
                elif kind == "refused":
                    section = option.split(".")[0]
                    kwargs = {"pp": what} if section == "pp_configs" else {"sharding": what}
                    _, bad = self._read(**kwargs)
                    with self.assertRaisesRegex(ValueError, rest[0].replace("(", r"\(")):
                        bad.check(pp_world_size=1)

    def test_fields_a_build_lacks_keep_their_defaults(self):
        reads: set = set()
        strategy = types.SimpleNamespace(hybrid_configs=_RecordingHybrid(reads, {
            "sharding_configs": _RecordingConfig("sharding_configs", reads, {}),
            "pp_configs": _RecordingConfig("pp_configs", reads, {}),
            "enable_optimizer_timer": False, "pp_degree": 1,
        }))
        settings = ShardingSettings.from_strategy(strategy)
        self.assertEqual(dataclasses.replace(settings, muon_partition_strategy="upstream_greedy"),
                         ShardingSettings())

    def test_reads_cover_develops_fields(self):
        reads, _ = self._read()
        for field in ("tensor_fusion", "accumulate_steps", "comm_overlap", "comm_buffer_size_MB",
                      "use_reduce_avg", "enable_fuse_optimizer_states", "release_gradients",
                      "comm_group_call_opt"):
            self.assertIn(f"sharding_configs.{field}", reads)
        for field in ("sharding_comm_overlap", "release_gradients"):
            self.assertIn(f"pp_configs.{field}", reads)
        self.assertIn("hybrid_configs.enable_optimizer_timer", reads)


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
            return (net.named_values(), [b.grad_storage is None for b in core._runtime.rs_buffers])

        results, _ = run_world(cfg, body=body)
        expected = reference_values(cfg)
        for rank, (values, released) in enumerate(results):
            self.assertTrue(released and all(released),
                            f"rank {rank}: 1-D gradient buffers kept: {released}")
            diff = max_abs_diff(values, expected[rank])
            self.assertLessEqual(diff, 1e-5, f"rank {rank}: {diff:.3e} from the reference")


if __name__ == "__main__":
    unittest.main()
