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
"""paddle_muon_ext.optimizer.Muon against Paddle develop's Muon as specified
(constructor, numbers, names), checked with an independent float64 NumPy
reference written from the specification, not from the implementation."""

import dataclasses
import functools
import inspect
import logging
import math
import os
import sys
import tempfile
import types
import unittest
from unittest import mock

import numpy as np
import paddle
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight
from paddle.utils import unique_name

from paddle_muon_ext.optimizer import muon as muon_module
# develop's names only: exported, this file runs against develop's muon.py
from paddle_muon_ext.optimizer.muon import (
    Muon,
    MuonParamInfo,
    _default_should_use_muon,
    _to_hashable,
    logger,
)

# the float64 reference (develop's tables typed in again, Newton-Schulz, tolerance)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from muon_optimizer_reference import REF_PRESETS, RTOL, SIMPLE, max_rel, ns_ref  # noqa: E402

# --------------------------------------------------------------------------
# The specification (Paddle develop), typed in again for the reference
# --------------------------------------------------------------------------
DEVELOP_SIGNATURE = [
    ("learning_rate", 0.02), ("parameters", None), ("momentum", 0.95),
    ("adam_beta1", 0.9), ("adam_beta2", 0.95), ("weight_decay", 0.01),
    ("ns_steps", 5), ("ns_coeff_type", "simple"), ("ns_coeffs", None),
    ("nesterov", True), ("adam_epsilon", 1e-9), ("grad_clip", None),
    ("lr_ratio", None), ("apply_decay_param_fun", None), ("muon_version", 1),
    ("muon_exclude_patterns", None), ("muon_extra_scale_factor", 0.2),
    ("muon_param_info_map", None), ("ns_matmul_dtype", None),
    ("multi_precision", False), ("name", None),
    ("muon_max_group_bytes", 2 * 1024**3), ("use_symmetric_gemm", False),
    ("symmetric_gemm_min_short_edge", 1024), ("symmetric_gemm_min_step_flops", 2e11),
    ("muon_epsilon", None),
]
LR = 0.1

MEASURED = {}


def scale_ref(shape, version, extra=0.2):
    din, dout = shape[-2], shape[-1]
    if version == 1:
        s = math.sqrt(max(1.0, dout / din))
    elif version == 2:
        s = math.sqrt(dout / din)
    else:
        s = math.sqrt(max(dout, din))
    return s * extra


class RefMuon:
    """Float64 Muon + AdamW as specified, state kept per parameter name."""

    def __init__(self, lr=LR, momentum=0.95, nesterov=True, coeffs=SIMPLE, ns_steps=5,
                 version=1, extra=0.2, beta1=0.9, beta2=0.95, eps=1e-9, wd=0.01,
                 decay=lambda n: True, lr_ratio=None, split=None, original_shape=None):
        self.__dict__.update(locals())
        self.split = split or {}
        self.original_shape = original_shape or {}
        self.state = {}

    def ortho(self, u):
        return ns_ref(u, self.coeffs, self.ns_steps, self.eps) * scale_ref(
            u.shape, self.version, self.extra)

    def step(self, name, w, g, use_muon, lr=None):
        lr = self.lr if lr is None else lr
        w, g = np.asarray(w, np.float64), np.asarray(g, np.float64)
        st = self.state.setdefault(name, {"m": np.zeros_like(w), "v": np.zeros_like(w), "t": 0})
        wd = self.wd if self.decay(name) else 0.0
        if use_muon:
            st["m"] = st["m"] + (1 - self.momentum) * (g - st["m"])
            u = g + self.momentum * (st["m"] - g) if self.nesterov else st["m"]
            u = u.reshape(self.original_shape.get(name, u.shape))
            o = self.split[name](u, self.ortho) if name in self.split else self.ortho(u)
            return w * (1 - lr * wd) - lr * o.reshape(w.shape)
        if self.lr_ratio is not None:
            lr = lr * self.lr_ratio(name)
        st["t"] += 1
        t = st["t"]
        st["m"] = self.beta1 * st["m"] + (1 - self.beta1) * g
        st["v"] = self.beta2 * st["v"] + (1 - self.beta2) * g * g
        mhat = st["m"] / (1 - self.beta1**t)
        vhat = st["v"] / (1 - self.beta2**t)
        return w * (1 - lr * wd) - lr * mhat / (np.sqrt(vhat) + self.eps)


def tearDownModule():
    # The measured errors the tolerance comment quotes (pytest: run with -s).
    for label, (p, u) in sorted(MEASURED.items()):
        print(f"[muon vs float64 numpy] {label:38s} params {p:.2e}  updates {u:.2e}")


def bf16_round(x):
    """Round-to-nearest-even float32 -> bfloat16, returned as float32."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    b = (b + (((b >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32)


# --------------------------------------------------------------------------
# Paddle helpers
# --------------------------------------------------------------------------
def make_param(name, value, dtype="float32"):
    value = np.asarray(value, np.float32)
    p = paddle.create_parameter(
        list(value.shape), dtype, attr=paddle.ParamAttr(name=name),
        default_initializer=paddle.nn.initializer.Constant(0.0),
    )
    with paddle.no_grad():
        p.set_value(paddle.to_tensor(value).astype(dtype))
    return p


def to_np(t):
    return t.astype("float32").numpy() if t.dtype != paddle.float32 else t.numpy()


def quad_loss(params, consts):
    """sum(C*W) + 0.5*sum(W*W): gradient C + W, which changes with W, so
    multi-step trajectories are meaningful."""
    loss = 0.0
    for p, c in zip(params, consts):
        w = p.astype("float32") if p.dtype != paddle.float32 else p
        loss = loss + paddle.sum(paddle.to_tensor(c) * w) + 0.5 * paddle.sum(w * w)
    return loss


def train(opt, params, consts, steps, sched=None):
    for _ in range(steps):
        quad_loss(params, consts).backward()
        opt.step()
        opt.clear_grad()
        if sched is not None:
            sched.step()


def ref_train(ref, names, values, consts, use_muon, steps, lrs=None):
    values = [np.asarray(v, np.float64) for v in values]
    for s in range(steps):
        lr = None if lrs is None else lrs[s]
        values = [ref.step(n, w, c + w, um, lr=lr)
                  for n, w, c, um in zip(names, values, consts, use_muon)]
    return values


def rng_arrays(seed, *shapes, scale=1.0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(s) * scale).astype(np.float32) for s in shapes]


def ns_fp32(x, coeffs, steps, eps=1e-9):
    """Develop's Newton-Schulz with float32 matmuls (float32 result)."""
    return Muon._zeropower_via_newtonschulz5(x, steps, eps, coeffs, paddle.float32)


SHAPES = {"tall": (40, 24), "wide": (24, 40), "3d tall": (3, 20, 12), "3d wide": (2, 12, 20)}


def split3_paddle(update, ortho_fn):
    return paddle.concat([ortho_fn(b) for b in paddle.split(update, 3, axis=-1)], axis=-1)


def split3_ref(u, ortho):
    return np.concatenate([ortho(b) for b in np.split(u, 3, axis=-1)], axis=-1)


class _Case(unittest.TestCase):
    def run_case(self, label, shapes, opt_kwargs, ref_kwargs, use_muon, steps=3, seed=0,
                 names=None, prepare=None):
        """Train Muon and the reference ``steps`` steps from the same start;
        assert parameters and accumulated updates agree within RTOL."""
        names = names or [f"p{i}" for i in range(len(shapes))]
        values = rng_arrays(seed, *shapes, scale=0.05)
        consts = rng_arrays(seed + 100, *shapes)
        with unique_name.guard():
            params = [make_param(n, v) for n, v in zip(names, values)]
            if prepare is not None:
                prepare(params)
            opt = Muon(LR, params, **{"muon_exclude_patterns": [], **opt_kwargs})
            train(opt, params, consts, steps)
        ref = ref_train(RefMuon(**ref_kwargs), names, values, consts, use_muon, steps)
        errs = [max_rel(to_np(p), r) for p, r in zip(params, ref)]
        upd = [max_rel(to_np(p) - v, r - v) for p, r, v in zip(params, ref, values)]
        MEASURED[label] = (max(errs), max(upd))
        self.assertLessEqual(max(errs), RTOL, f"{label}: params differ from the reference")
        self.assertLessEqual(max(upd), RTOL, f"{label}: updates differ from the reference")
        return opt, params


# --------------------------------------------------------------------------
# Newton-Schulz and scale
# --------------------------------------------------------------------------
class TestNewtonSchulz(unittest.TestCase):
    def test_every_preset_and_orientation_matches_reference(self):
        for kind, table in REF_PRESETS.items():
            steps = 10 if kind == "deepseekv4" else 5
            for label, shape in SHAPES.items():
                with self.subTest(kind=kind, shape=label):
                    (x,) = rng_arrays(1, shape)
                    out = Muon._zeropower_via_newtonschulz5(
                        paddle.to_tensor(x), steps, 1e-9, table, paddle.float32)
                    self.assertEqual(out.dtype, paddle.float32)
                    self.assertEqual(list(out.shape), list(shape))
                    err = max_rel(out.numpy(), ns_ref(x, table, steps))
                    MEASURED[f"ns {kind} {label}"] = (err, err)
                    self.assertLessEqual(err, RTOL)

    def test_3d_normalises_each_expert(self):
        (x,) = rng_arrays(2, (4, 12, 20))
        x[1] *= 100.0  # a big expert must not shrink the others
        batched = ns_fp32(paddle.to_tensor(x), SIMPLE, 5).numpy()
        self.assertLessEqual(max_rel(batched, ns_ref(x, SIMPLE, 5)), RTOL)
        for e in range(4):
            self.assertLessEqual(max_rel(batched[e], ns_ref(x[e], SIMPLE, 5)), RTOL)

    def test_norm_floor_is_eps(self):
        # norm 1e-6 < eps 1e-3: divided by eps, not by the norm
        x = np.full((4, 6), 1e-6 / math.sqrt(24), np.float32)
        out = ns_fp32(paddle.to_tensor(x), SIMPLE, 1, eps=1e-3).numpy()
        self.assertLessEqual(max_rel(out, ns_ref(x, SIMPLE, 1, eps=1e-3)), RTOL)
        zero = ns_fp32(paddle.zeros([4, 6]), SIMPLE, 5).numpy()
        self.assertTrue(np.array_equal(zero, np.zeros((4, 6), np.float32)))

    def test_custom_table_cycles_in_order(self):
        coeffs = [SIMPLE[0], (1.0, 0.5, 0.0), (0.5, 0.0, 0.0)]
        (x,) = rng_arrays(3, (20, 12))
        out = ns_fp32(paddle.to_tensor(x), coeffs, 7).numpy()
        self.assertLessEqual(max_rel(out, ns_ref(x, coeffs, 7)), RTOL)
        self.assertGreater(max_rel(out, ns_ref(x, coeffs[:1], 7)), 1e-2)
        self.assertGreater(max_rel(out, ns_ref(x, coeffs[::-1], 7)), 1e-2)

    @unittest.skipUnless(paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0,
                         "bf16 matmul kernels exist only on accelerators")
    def test_bf16_matmuls_stay_close(self):
        # bf16 matmuls (ns_matmul_dtype="bfloat16"): 8-bit mantissa, ~1e-2.
        (x,) = rng_arrays(4, (16, 24))
        out = Muon._zeropower_via_newtonschulz5(paddle.to_tensor(x), 5, 1e-9, SIMPLE,
                                                paddle.bfloat16)
        self.assertEqual(out.dtype, paddle.bfloat16, "develop returns the matmul dtype")
        out = paddle.cast(out, "float32")
        self.assertLess(max_rel(out.numpy(), ns_ref(x, SIMPLE, 5)), 5e-2)

    def test_scale_every_version_includes_extra_factor(self):
        for shape in [(64, 32), (32, 64), (4, 48, 16), (4, 16, 48)]:
            for version in (1, 2, 3, 7):
                with self.subTest(shape=shape, version=version):
                    u = paddle.ones(list(shape))
                    out = Muon._scaling_fn(u, version, 0.3).numpy()
                    np.testing.assert_allclose(out, scale_ref(shape, version, 0.3), rtol=1e-6)
        # default extra_scale_factor 1.0: version 1 of a square matrix is 1
        np.testing.assert_allclose(Muon._scaling_fn(paddle.ones([8, 8]), 1).numpy(), 1.0,
                                   rtol=1e-7, err_msg="default extra_scale_factor is not 1.0")

    def test_bad_inputs(self):
        for shape in ([4], [2, 2, 2, 2]):
            with self.assertRaises(ValueError, msg=f"{len(shape)}-D input accepted"):
                Muon._zeropower_via_newtonschulz5(paddle.ones(shape), 5, 1e-9, SIMPLE,
                                                  paddle.float32)


# --------------------------------------------------------------------------
# The optimizer against the reference
# --------------------------------------------------------------------------
    def test_iterates_on_the_wide_orientation(self):
        # A = X X^T is min(m, n)^2: a tall matrix is transposed before the
        # iteration and back after it (same values either way, less memory).
        seen = []
        step = Muon._newton_schulz_step

        def spy(X, a, b, c):
            seen.append(tuple(X.shape))
            return step(X, a, b, c)

        for shape in ((40, 24), (24, 40)):
            (x,) = rng_arrays(5, shape)
            seen.clear()
            with mock.patch.object(Muon, "_newton_schulz_step", staticmethod(spy)):
                out = ns_fp32(paddle.to_tensor(x), SIMPLE, 2)
            self.assertEqual(tuple(out.shape), shape)
            self.assertEqual(set(seen), {(min(shape), max(shape))},
                             f"{shape}: the iteration ran on {set(seen)}, not the wide side")


class TestMuonMatchesReference(_Case):
    def test_every_preset_on_tall_wide_and_3d(self):
        shapes = list(SHAPES.values())
        custom = [(2.0, -1.5, 0.5), SIMPLE[0]]
        for kind in [*REF_PRESETS, "custom"]:
            steps = 10 if kind == "deepseekv4" else 5
            table = custom if kind == "custom" else REF_PRESETS[kind]
            kw = dict(ns_coeff_type=kind, ns_steps=steps)
            if kind == "custom":
                kw["ns_coeffs"] = custom
            with self.subTest(kind=kind):
                self.run_case(f"{kind} tall/wide/3d", shapes, kw,
                              dict(coeffs=table, ns_steps=steps), [True] * len(shapes))

    def test_versions(self):
        shapes = list(SHAPES.values())
        for version in (1, 2, 3):
            with self.subTest(version=version):
                self.run_case(f"version {version} extra 0.3", shapes,
                              dict(muon_version=version, muon_extra_scale_factor=0.3),
                              dict(version=version, extra=0.3), [True] * len(shapes))

    def test_nesterov_on_off(self):
        for nesterov in (True, False):
            with self.subTest(nesterov=nesterov):
                self.run_case(f"nesterov {nesterov}", list(SHAPES.values()),
                              dict(nesterov=nesterov, momentum=0.9),
                              dict(nesterov=nesterov, momentum=0.9), [True] * len(SHAPES))

    def test_decay_on_off_both_paths(self):
        decay = lambda n: n.startswith("decay")  # noqa: E731
        names = ["decay_w", "nodecay_w", "decay_b", "nodecay_b"]
        shapes = [(16, 24), (16, 24), (24,), (24,)]
        # wd=0.5 makes the decay term far larger than the tolerance
        self.run_case("decay per apply_decay_param_fun", shapes,
                      dict(weight_decay=0.5, apply_decay_param_fun=decay),
                      dict(wd=0.5, decay=decay), [True, True, False, False], names=names)
        self.run_case("weight_decay 0", shapes, dict(weight_decay=0.0), dict(wd=0.0),
                      [True, True, False, False], names=names)

    def test_lr_ratio_scales_adamw_params(self):
        ratio = lambda name: 0.25 if name.endswith("b") else 1.0  # noqa: E731
        self.run_case("lr_ratio", [(16, 24), (24,), (10,)],
                      dict(lr_ratio=lambda p: ratio(p.name)),
                      dict(lr_ratio=ratio), [True, False, False], names=["w", "b", "c"])

    def test_split_concat_func(self):
        info = {"qkv": MuonParamInfo(True, split3_paddle)}
        self.run_case("split_concat_func", [(16, 48), (2, 12, 30)],
                      dict(muon_param_info_map=info, momentum=0.9),
                      dict(momentum=0.9, split={"qkv": split3_ref}), [True, True],
                      names=["qkv", "experts"])

    def test_original_shape(self):
        def prepare(params):
            params[0].original_shape = [2, 12, 20]  # experts stored 2-D

        self.run_case("original_shape [2,12,20] as [24,20]", [(24, 20)], {},
                      dict(original_shape={"experts": (2, 12, 20)}), [True],
                      names=["experts"], prepare=prepare)

    def test_exclude_patterns_case_insensitive(self):
        names = ["Embedding_table", "LM_Head.w", "proj.w", "proj.b"]
        opt, _ = self.run_case("exclude patterns", [(30, 16), (16, 30), (16, 16), (16,)],
                               dict(muon_exclude_patterns=["embedding", "lm_HEAD"]), {},
                               [False, False, True, False], names=names)
        self.assertEqual({p.name: opt._should_use_muon(p) for p in opt._parameter_list},
                         {"Embedding_table": False, "LM_Head.w": False,
                          "proj.w": True, "proj.b": False})
        self.assertEqual(opt._muon_param_info_map, {}, "develop keeps the map as given")

    def test_param_info_map_overrides_rule_and_fills_missing(self):
        info = {"w_adam": MuonParamInfo(use_muon=False), "emb_muon": MuonParamInfo(use_muon=True)}
        opt, _ = self.run_case("muon_param_info_map", [(16, 24), (24, 16), (16, 16)],
                               dict(muon_exclude_patterns=["emb"], muon_param_info_map=info),
                               {}, [False, True, True], names=["w_adam", "emb_muon", "w"])
        self.assertEqual(set(opt._muon_param_info_map), {"w_adam", "emb_muon"})
        self.assertTrue(opt._should_use_muon(opt._parameter_list[2]))

    def test_lr_scheduler_and_per_param_lr(self):
        shapes = [(16, 24), (24,)]
        values = rng_arrays(15, *shapes, scale=0.05)
        consts = rng_arrays(16, *shapes)
        with unique_name.guard():
            params = [make_param("w", values[0]), make_param("b", values[1])]
            params[0].optimize_attr["learning_rate"] = 0.5
            sched = paddle.optimizer.lr.StepDecay(learning_rate=0.2, step_size=1, gamma=0.5)
            opt = Muon(sched, params, muon_exclude_patterns=[])
            train(opt, params, consts, 3, sched=sched)
        self.assertAlmostEqual(opt.get_lr(), 0.2 * 0.5**3)
        ref = RefMuon()
        w, b = (np.asarray(v, np.float64) for v in values)
        # develop never applies ParamAttr(learning_rate=...) (no _create_param_lr)
        for lr in (0.2, 0.1, 0.05):
            w, b = (ref.step("w", w, consts[0] + w, True, lr=lr),
                    ref.step("b", b, consts[1] + b, False, lr=lr))
        self.assertLessEqual(max_rel(params[0].numpy(), w), RTOL)
        self.assertLessEqual(max_rel(params[1].numpy(), b), RTOL)

    def test_adamw_path_matches_paddle_adamw(self):
        shapes = [(32,), (20, 12)]
        names = ["layer.bias", "token_EMB.w"]
        values = rng_arrays(13, *shapes, scale=0.5)
        consts = rng_arrays(14, *shapes)
        decay = lambda n: "bias" not in n  # noqa: E731
        kw = dict(weight_decay=0.1, apply_decay_param_fun=decay)
        with unique_name.guard():
            ours = [make_param(n, v) for n, v in zip(names, values)]
            opt = Muon(LR, ours, adam_beta1=0.85, adam_beta2=0.97, adam_epsilon=1e-6,
                       muon_exclude_patterns=["emb"], **kw)
            train(opt, ours, consts, 3)
        with unique_name.guard():
            theirs = [make_param(n, v) for n, v in zip(names, values)]
            adamw = paddle.optimizer.AdamW(learning_rate=LR, parameters=theirs, beta1=0.85,
                                           beta2=0.97, epsilon=1e-6, **kw)
            train(adamw, theirs, consts, 3)
        for a, b in zip(ours, theirs):  # same kernel, same inputs
            self.assertTrue(np.array_equal(a.numpy(), b.numpy()), a.name)
        ref = ref_train(RefMuon(beta1=0.85, beta2=0.97, eps=1e-6, wd=0.1, decay=decay),
                        names, values, consts, [False, False], 3)
        for p, r in zip(ours, ref):
            self.assertLessEqual(max_rel(p.numpy(), r), RTOL)

    def test_master_weights_bf16(self):
        shapes = [(24, 16), (2, 12, 20), (16,)]
        names = ["w", "experts", "b"]
        values = [bf16_round(v) for v in rng_arrays(17, *shapes, scale=0.5)]
        consts = rng_arrays(18, *shapes)
        with unique_name.guard():
            params = [make_param(n, v, "bfloat16") for n, v in zip(names, values)]
            opt = Muon(LR, params, multi_precision=True, muon_exclude_patterns=[])
            train(opt, params, consts, 3)
        self.assertEqual(set(opt._master_weights), set(names))
        # The reference trains the fp32 master and is fed the gradient the
        # bf16 model really produces: C + W from the bf16 weights, rounded
        # to bf16. The remaining gap is fp32 vs float64 arithmetic.
        ref = RefMuon()
        masters = [np.asarray(v, np.float64) for v in values]
        for _ in range(3):
            grads = [bf16_round((c + bf16_round(w)).astype(np.float32))
                     for c, w in zip(consts, masters)]
            masters = [ref.step(n, w, g, um) for n, w, g, um in
                       zip(names, masters, grads, [True, True, False])]
        for p, r, v in zip(params, masters, values):
            master = opt._master_weights[p.name]
            self.assertEqual(master.dtype, paddle.float32)
            self.assertEqual(p.dtype, paddle.bfloat16)
            err = max_rel(master.numpy(), r)
            MEASURED[f"master weight bf16 {p.name}"] = (err, max_rel(master.numpy() - v, r - v))
            self.assertLessEqual(err, RTOL)
            # the bf16 param is exactly the cast of its master weight
            self.assertTrue(np.array_equal(to_np(p), bf16_round(master.numpy())))
        # a plain bf16 trajectory would have lost the sub-bf16 part of the updates
        self.assertTrue(any(not np.array_equal(m.numpy(), bf16_round(m.numpy()))
                            for m in opt._master_weights.values()))


# --------------------------------------------------------------------------
# Constructor and names
# --------------------------------------------------------------------------
def _params():
    with unique_name.guard():
        return [make_param("bad.w", np.ones((4, 4), np.float32))]


class TestConstructor(unittest.TestCase):
    def test_signature_is_develops(self):
        sig = inspect.signature(Muon.__init__)
        named = [(n, p.default) for n, p in sig.parameters.items()
                 if n != "self" and p.kind is not p.VAR_KEYWORD]
        self.assertEqual(named, DEVELOP_SIGNATURE)
        self.assertEqual(list(sig.parameters.values())[-1].kind, inspect.Parameter.VAR_KEYWORD)

    def test_positional_order(self):
        p = _params()
        opt = Muon(0.03, p, 0.8, 0.7, 0.6, 0.05, 3, "aol", None, False, 1e-6)
        self.assertEqual((opt._momentum, opt._beta1, opt._beta2, opt._weight_decay),
                         (0.8, 0.7, 0.6, 0.05))
        self.assertEqual((opt._ns_steps, opt._nesterov, opt._epsilon), (3, False, 1e-6))
        self.assertEqual(opt._ns_coeffs, REF_PRESETS["aol"])

    def test_class_attribute_names(self):
        self.assertEqual((Muon._moment_acc_str, Muon._moment2_acc_str, Muon._beta1_pow_acc_str,
                          Muon._beta2_pow_acc_str),
                         ("moment1", "moment2", "beta1_pow_acc", "beta2_pow_acc"))
        params = list(inspect.signature(Muon._muon_update_group).parameters)
        self.assertEqual(params, ["self", "group_params_grads", "lr", "momentum_beta",
                                  "ns_steps", "nesterov", "epsilon", "weight_decay",
                                  "version"])
        ns = inspect.signature(Muon._zeropower_via_newtonschulz5).parameters
        self.assertEqual([(n, p.default) for n, p in ns.items()][:6],
                         [("X", inspect.Parameter.empty), ("steps", 5), ("eps", 1e-9),
                          ("ns_coeffs", None), ("ns_matmul_dtype", paddle.bfloat16),
                          ("use_symmetric_gemm", False)])
        self.assertEqual(list(ns)[6:], ["symmetric_gemm_min_short_edge",
                                        "symmetric_gemm_min_step_flops"])
        sc = inspect.signature(Muon._scaling_fn).parameters
        self.assertEqual([(n, p.default) for n, p in sc.items()],
                         [("orthogonal_update", inspect.Parameter.empty),
                          ("version", inspect.Parameter.empty), ("extra_scale_factor", 1.0)])

    def test_errors(self):
        p = _params()
        cases = [
            (dict(parameters=None), ValueError, "got None"),
            (dict(parameters=tuple(p)), TypeError, "as a list"),
            (dict(parameters=[{"params": p}]), TypeError, "parameter groups"),
            (dict(grad_clip=1.0), TypeError, "GradientClipBase"),
            # develop's plain asserts: AssertionError
            (dict(ns_coeff_type="cubic"), AssertionError, "valid types"),
            (dict(ns_coeff_type="custom"), AssertionError, "needs ns_coeffs"),
            (dict(ns_matmul_dtype="int8"), ValueError, "ns_matmul_dtype"),
            (dict(ns_matmul_dtype=paddle.int8), ValueError, "ns_matmul_dtype"),
            (dict(momentum=1.0), ValueError, "momentum"),
            (dict(adam_epsilon=-1.0), ValueError, "adam_epsilon"),
            (dict(weight_decay="0.1"), TypeError, "weight_decay"),
            (dict(ns_steps=-1), ValueError, "ns_steps"),
            (dict(lr_ratio=0.5), TypeError, "lr_ratio"),
            (dict(muon_param_info_map={"bad.w": True}), TypeError, "MuonParamInfo"),
        ]
        for kwargs, exc, fragment in cases:
            with self.subTest(kwargs=kwargs):
                kwargs.setdefault("parameters", p)
                with self.assertRaises(exc) as ctx:
                    Muon(**kwargs)
                self.assertIn(fragment, str(ctx.exception))
        with unique_name.guard():
            b = make_param("bad.bias", np.ones((4,), np.float32))
        with self.assertRaisesRegex(ValueError, "2-D or 3-D"):
            Muon(parameters=[b], muon_param_info_map={"bad.bias": MuonParamInfo(use_muon=True)})

    def test_defaults_and_dtype_rule(self):
        opt = Muon(parameters=_params(), unknown_option=1)
        self.assertEqual(opt.get_lr(), 0.02)
        self.assertEqual(opt._ns_coeffs, SIMPLE)
        expected = paddle.float32
        if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
            if paddle.device.cuda.get_device_capability()[0] >= 8:
                expected = paddle.bfloat16
        self.assertEqual(opt._ns_matmul_dtype, expected)
        self.assertEqual(Muon(parameters=_params(), ns_matmul_dtype="float32")._ns_matmul_dtype,
                         paddle.float32)
        # stored as given, like develop (a CPU build fails in the matmul)
        self.assertEqual(Muon(parameters=_params(), ns_matmul_dtype=paddle.bfloat16)
                         ._ns_matmul_dtype, paddle.bfloat16)
        self.assertEqual(Muon(1, _params()).get_lr(), 1.0)


class TestDefaultShouldUseMuon(unittest.TestCase):
    def test_rule(self):
        with self.assertRaisesRegex(ValueError, "exclude_patterns is None"):
            _default_should_use_muon("w", [4, 4], None)
        self.assertTrue(_default_should_use_muon("w", [4, 4], []))
        self.assertTrue(_default_should_use_muon("w", [2, 4, 4], []))
        self.assertFalse(_default_should_use_muon("w", [4], []))
        self.assertFalse(_default_should_use_muon("w", [2, 2, 4, 4], []))
        self.assertFalse(_default_should_use_muon("Model.EMBEDDING.w", [4, 4], ["embedding"]))
        self.assertFalse(_default_should_use_muon("lm_head.w", [4, 4], ["LM_HEAD"]))
        self.assertTrue(_default_should_use_muon("proj.w", [4, 4], ["embedding"]))


# --------------------------------------------------------------------------
# state_dict, sharded_state_dict, checkpoints
# --------------------------------------------------------------------------
class TestStateDict(unittest.TestCase):
    def _trained(self, dtype="float32", steps=2):
        shapes = [(24, 16), (16,)]
        values = [bf16_round(v) for v in rng_arrays(19, *shapes, scale=0.5)]
        consts = rng_arrays(20, *shapes)
        params = [make_param(n, v, dtype) for n, v in zip(["w", "b"], values)]
        opt = Muon(LR, params, multi_precision=dtype != "float32", muon_exclude_patterns=[])
        train(opt, params, consts, steps)
        return params, opt

    def test_keys_and_accumulators(self):
        with unique_name.guard():
            _, opt = self._trained(steps=2)
        sd = opt.state_dict()
        self.assertEqual(set(sd), {"w_moment1_0", "b_moment1_0", "b_moment2_0",
                                   "b_beta1_pow_acc_0", "b_beta2_pow_acc_0"})
        self.assertEqual(sd["w_moment1_0"].dtype, paddle.float32)
        self.assertEqual(list(sd["w_moment1_0"].shape), [24, 16])
        self.assertEqual(list(sd["b_beta1_pow_acc_0"].shape), [1])
        # start at beta, multiplied once per step
        np.testing.assert_allclose(sd["b_beta1_pow_acc_0"].numpy(), [0.9**3], rtol=1e-6)
        np.testing.assert_allclose(sd["b_beta2_pow_acc_0"].numpy(), [0.95**3], rtol=1e-6)

    def test_master_weight_keys(self):
        # develop keys the accumulators on the parameter, never the master
        with unique_name.guard():
            _, opt = self._trained("bfloat16", steps=1)
        sd = opt.state_dict()
        self.assertEqual(set(sd["master_weights"]), {"w", "b"})
        self.assertEqual(sd["master_weights"]["w"].name, "w_fp32_master_0")
        self.assertEqual(set(sd) - {"master_weights"},
                         {"w_moment1_0", "b_moment1_0", "b_moment2_0",
                          "b_beta1_pow_acc_0", "b_beta2_pow_acc_0"})
        self.assertEqual(sd["w_moment1_0"].dtype, paddle.float32)
        self.assertEqual(list(sd["w_moment1_0"].shape), [24, 16])

    def test_sharded_state_dict(self):
        with unique_name.guard():
            w = make_param("w", np.ones((4, 6), np.float32), "bfloat16")
            b = make_param("b", np.ones((6,), np.float32), "bfloat16")
            e = make_param("e", np.ones((2, 3, 4), np.float32), "bfloat16")
            opt = Muon(LR, [w, b, e], multi_precision=True, muon_exclude_patterns=[])
            train(opt, [w, b, e], rng_arrays(1, (4, 6), (6,), (2, 3, 4)), 1)
        model = {
            # a tensor-parallel-like slice: global (8, 6), this rank rows 4..8
            "layer.weight": ShardedWeight("layer.weight", w, (4, 6), (8, 6), (4, 0)),
            "layer.bias": ShardedWeight("layer.bias", b, (6,), (6,), (0,)),
            "shared.bias": ShardedWeight("shared.bias", b, (6,), (6,), (0,)),
            # 3-D experts stored 2-D in the model's checkpoint
            "experts.weight": ShardedWeight("experts.weight", e, (6, 4), (6, 4), (0, 0)),
        }
        sd = opt.sharded_state_dict(model)
        expect = {
            "layer.weight.moment1_0": ((4, 6), (8, 6), (4, 0)),
            "layer.weight.w_0": ((4, 6), (8, 6), (4, 0)),
            "experts.weight.moment1_0": ((6, 4), (6, 4), (0, 0)),
            "experts.weight.w_0": ((6, 4), (6, 4), (0, 0)),
            "layer.bias.moment1_0": ((6,), (6,), (0,)),
            "layer.bias.moment2_0": ((6,), (6,), (0,)),
            "layer.bias.beta1_pow_acc_0": ((1,), (1,), (0,)),
            "layer.bias.beta2_pow_acc_0": ((1,), (1,), (0,)),
            "layer.bias.w_0": ((6,), (6,), (0,)),
        }
        got = {k: (tuple(v.local_shape), tuple(v.global_shape), tuple(v.global_offset))
               for k, v in sd.items()}
        self.assertEqual(got, expect)
        for k, v in sd.items():
            self.assertEqual(v.key, k)
            self.assertEqual(tuple(v.local_tensor.shape), tuple(v.local_shape), k)
        self.assertTrue(np.array_equal(sd["experts.weight.w_0"].local_tensor.numpy(),
                                       opt._master_weights["e"].numpy().reshape(6, 4)))
        with self.assertRaisesRegex(KeyError, "does not describe"):
            opt.sharded_state_dict({"layer.weight": model["layer.weight"]})
        wrong = dict(model, **{"layer.weight": ShardedWeight("layer.weight", w, (5, 6), (8, 6),
                                                             (3, 0))})
        with self.assertRaisesRegex(ValueError, "cannot be viewed"):
            opt.sharded_state_dict(wrong)
        with mock.patch.object(Muon, "state_dict", return_value={"w_velocity_0": w}), \
                self.assertRaisesRegex(ValueError, "w_velocity_0"):
            opt.sharded_state_dict(model)

    def test_round_trip_bit_exact(self):
        for dtype in ("float32", "bfloat16"):
            with self.subTest(dtype=dtype), tempfile.TemporaryDirectory() as tmp:
                self._round_trip(dtype, tmp)

    def _round_trip(self, dtype, tmp):
        shapes = [(24, 16), (2, 12, 20), (16,), (10, 8)]
        names = ["w", "experts", "b", "emb.w"]
        values = [bf16_round(v) for v in rng_arrays(19, *shapes, scale=0.5)]
        consts = rng_arrays(20, *shapes)
        mp = dtype == "bfloat16"

        def build():
            params = [make_param(n, v, dtype) for n, v in zip(names, values)]
            sched = paddle.optimizer.lr.StepDecay(learning_rate=0.03, step_size=2, gamma=0.7)
            opt = Muon(sched, params, multi_precision=mp, muon_exclude_patterns=["emb"])
            return params, opt, sched

        with unique_name.guard():
            params, opt, sched = build()
            train(opt, params, consts, 5, sched)
            full = [to_np(p) for p in params]
            full_master = {k: v.numpy() for k, v in opt._master_weights.items()}
        with unique_name.guard():
            params, opt, sched = build()
            train(opt, params, consts, 3, sched)
            paddle.save(opt.state_dict(), os.path.join(tmp, "opt.pdopt"))
            paddle.save({p.name: p for p in params}, os.path.join(tmp, "model.pdparams"))
            train(opt, params, consts, 1, sched)  # the saved state must not alias it
        with unique_name.guard():
            params, opt, sched = build()
            model_sd = paddle.load(os.path.join(tmp, "model.pdparams"))
            for p in params:
                p.set_value(model_sd[p.name])
            opt.set_state_dict(paddle.load(os.path.join(tmp, "opt.pdopt")))
            self.assertEqual(sched.last_epoch, 3)
            train(opt, params, consts, 2, sched)
            resumed = [to_np(p) for p in params]
            resumed_master = {k: v.numpy() for k, v in opt._master_weights.items()}
        for a, b in zip(full, resumed):
            self.assertTrue(np.array_equal(a, b))
        self.assertEqual(set(full_master), set(resumed_master))
        self.assertEqual(set(full_master), set(names) if mp else set())
        for k in full_master:
            self.assertTrue(np.array_equal(full_master[k], resumed_master[k]))


# --------------------------------------------------------------------------
# What wrappers (MuonShardingOptimizer, offload optimizers) rely on
# --------------------------------------------------------------------------
class TestWrapperContract(unittest.TestCase):
    def test_apply_optimize_subset_updates_only_subset(self):
        shapes = [(16, 24), (24,), (8, 8)]
        values = rng_arrays(21, *shapes, scale=0.05)
        consts = rng_arrays(22, *shapes)
        with unique_name.guard():
            params = [make_param(n, v) for n, v in zip(["w", "b", "other"], values)]
            opt = Muon(LR, params, muon_exclude_patterns=[])
            grads = [paddle.to_tensor(c + v) for c, v in zip(consts, values)]
            opt._apply_optimize(None, None, [(params[1], grads[1]), (params[0], grads[0])])
        ref = RefMuon()
        self.assertLessEqual(max_rel(params[0].numpy(),
                                     ref.step("w", values[0], consts[0] + values[0], True)), RTOL)
        self.assertLessEqual(max_rel(params[1].numpy(),
                                     ref.step("b", values[1], consts[1] + values[1], False)), RTOL)
        self.assertTrue(np.array_equal(params[2].numpy(), values[2]))
        self.assertFalse(any(k.startswith("other") for k in opt.state_dict()))

    def test_step_leaves_a_frozen_parameter_alone(self):
        # Freezing after a step: clear_grad() zeroes the gradient but keeps it,
        # so only stop_gradient tells step() to skip the parameter (momentum
        # and weight decay would still move it).
        values = rng_arrays(23, (8, 12), (12,))
        with unique_name.guard():
            params = [make_param(n, v) for n, v in zip(["w", "b"], values)]
            opt = Muon(LR, params, muon_exclude_patterns=[])
            train(opt, params, rng_arrays(24, (8, 12), (12,)), 1)
            for p in params:
                self.assertIsNotNone(p._grad_ivar(), f"{p.name}: clear_grad dropped the grad")
                p.stop_gradient = True
            frozen = [p.numpy().copy() for p in params]
            opt.step()
        for p, before in zip(params, frozen):
            self.assertTrue(np.array_equal(p.numpy(), before),
                            f"{p.name} has stop_gradient=True but step() changed it")

    def test_muon_params_are_updated_before_adamw_params(self):
        with unique_name.guard():
            w = make_param("w", np.ones((4, 6), np.float32))
            b = make_param("b", np.ones((6,), np.float32))
            opt = Muon(LR, [b, w], muon_exclude_patterns=[])
            order = []
            with mock.patch.object(Muon, "_muon_update_group",
                                   lambda s, pg, *a: order.extend(p.name for p, _ in pg)), \
                    mock.patch.object(Muon, "_adamw_update", lambda s, p, *a: order.append(p.name)):
                opt._apply_optimize(None, None, [(b, paddle.ones([6])), (w, paddle.ones([4, 6]))])
        self.assertEqual(order, ["w", "b"])

    def test_param_without_map_entry_takes_default_rule_with_warning(self):
        # develop (section 1.6): the default rule, and a warning on every call;
        # muon_exclude_patterns=None makes the rule raise at the first step.
        with unique_name.guard():
            w = make_param("w", np.ones((4, 6), np.float32))
            stray = make_param("stray.w", np.ones((4, 6), np.float32))
            opt = Muon(LR, [w], muon_param_info_map={"w": MuonParamInfo()})
            with self.assertRaisesRegex(ValueError, "exclude_patterns is None for parameter 'stray.w'"):
                opt._apply_optimize(None, None, [(stray, paddle.ones([4, 6]))])
            opt = Muon(LR, [w], muon_param_info_map={"w": MuonParamInfo()},
                       muon_exclude_patterns=["stray"])
            for _ in range(2):
                with self.assertLogs(logger, level=logging.WARNING) as logs:
                    opt._apply_optimize(None, None, [(stray, paddle.ones([4, 6])),
                                                     (w, paddle.ones([4, 6]))])
                self.assertEqual(len(logs.output), 1, "one warning per call, for stray.w only")
                self.assertIn("'stray.w'", logs.output[0])
                self.assertIn("use_muon=False", logs.output[0])
        self.assertIn("stray.w_moment2_0", opt.state_dict(), "stray.w routed to AdamW")

    def test_slice_carrying_the_param_name_is_updated_elementwise(self):
        full_val, g_full = rng_arrays(23, (12, 10), (12, 10))
        lo, hi = 17, 83  # a slice that straddles rows, as a flat shard does
        with unique_name.guard():
            full = make_param("embed.w", full_val)
            opt_full = Muon(LR, [full], weight_decay=0.1, muon_exclude_patterns=["EMBED"])
            for _ in range(2):
                opt_full._apply_optimize(None, None, [(full, paddle.to_tensor(g_full))])
        with unique_name.guard():
            owner = make_param("embed.w", full_val)
            opt = Muon(LR, [owner], weight_decay=0.1, muon_exclude_patterns=["EMBED"])
            piece = make_param("embed.w.shard", full_val.reshape(-1)[lo:hi])
            piece.name = "embed.w"
            for _ in range(2):
                g = paddle.to_tensor(g_full.reshape(-1)[lo:hi])
                opt._apply_optimize(None, None, [(piece, g)])
        # the same element-wise kernel on the same values: bit-identical
        self.assertTrue(np.array_equal(piece.numpy(), full.numpy().reshape(-1)[lo:hi]))

    def test_replaced_grad_clip_is_applied_first(self):
        values = rng_arrays(5, (16, 24), (24,), scale=0.05)
        consts = rng_arrays(6, (16, 24), (24,))
        seen = []

        class NegateClip(paddle.nn.ClipGradByGlobalNorm):
            # A wrapper (e.g. HybridParallelClipGrad) swaps _grad_clip after
            # construction; negating grads makes its use visible.
            def __call__(self, params_grads):
                seen.append(sorted(p.name for p, _ in params_grads))
                return [(p, -g) for p, g in params_grads]

        with unique_name.guard():
            params = [make_param("w", values[0]), make_param("b", values[1])]
            opt = Muon(LR, params, muon_exclude_patterns=[])
            opt._grad_clip = NegateClip(1.0)
            quad_loss(params, consts).backward()
            opt.step()
        ref = RefMuon()
        self.assertEqual(seen, [["b", "w"]])
        self.assertLessEqual(max_rel(params[0].numpy(), ref.step(
            "w", values[0], -(consts[0] + values[0]), True)), RTOL)
        self.assertLessEqual(max_rel(params[1].numpy(), ref.step(
            "b", values[1], -(consts[1] + values[1]), False)), RTOL)

    def test_minimize_matches_step(self):
        values = rng_arrays(7, (16, 24), (24,), scale=0.5)
        consts = rng_arrays(8, (16, 24), (24,))
        results = []
        for use_minimize in (False, True):
            with unique_name.guard():
                params = [make_param("w", values[0]), make_param("b", values[1])]
                opt = Muon(LR, params, muon_exclude_patterns=[])
                loss = quad_loss(params, consts)
                loss.backward()
                opt.minimize(loss) if use_minimize else opt.step()
                opt.clear_grad()
                results.append([p.numpy() for p in params])
        for a, b in zip(*results):
            self.assertTrue(np.array_equal(a, b))

    def test_step_skips_frozen_and_gradless(self):
        # develop's step(): trainable params whose _grad_ivar() is set; a
        # main_grad alone (MixPrecisionOptimizer's business) is not a grad
        values = rng_arrays(27, (8, 12), (12,), (12,), scale=0.05)
        with unique_name.guard():
            w, b, frozen = [make_param(n, v) for n, v in zip(["w", "b", "frozen"], values)]
            frozen.stop_gradient = True
            opt = Muon(LR, [w, b, frozen], weight_decay=0.0, muon_exclude_patterns=[])
            (g,) = rng_arrays(28, (8, 12))
            paddle.sum(paddle.to_tensor(g) * w).backward()
            b.main_grad = paddle.ones([12])
            opt.step()
        self.assertLessEqual(max_rel(w.numpy(), RefMuon(wd=0.0).step("w", values[0], g, True)),
                             RTOL)
        self.assertTrue(np.array_equal(b.numpy(), values[1]))
        self.assertTrue(np.array_equal(frozen.numpy(), values[2]))
        self.assertEqual(set(opt.state_dict()), {"w_moment1_0"})

    def test_step_time_errors(self):
        with unique_name.guard():
            w = make_param("w", np.ones((4, 6), np.float32))
            opt = Muon(LR, [w], muon_exclude_patterns=[])
            # a 1-D tensor carrying a Muon matrix's name: slicing a Muon
            # param is a wrapper bug, never silently switched to AdamW
            piece = make_param("w.piece", np.ones((6,), np.float32))
            piece.name = "w"
            opt._muon_param_info_map["w"] = MuonParamInfo()
            with self.assertRaisesRegex(AssertionError, "whole 2-D or 3-D"):
                opt._apply_optimize(None, None, [(piece, paddle.ones([6]))])
            with self.assertRaisesRegex(TypeError, "parameter groups"):
                opt._apply_optimize(None, None, {"params": [(w, paddle.ones([4, 6]))]})
            # develop: a group dict goes through _update_param_group
            opt._create_accumulators(None, {"params": [w]})
            self.assertIn("w", opt._already_create_accumulator)
            paddle.enable_static()
            try:
                with self.assertRaisesRegex(NotImplementedError, "dygraph"):
                    opt._apply_optimize(None, None, [])
            finally:
                paddle.disable_static()
            bad = Muon(LR, [w], muon_param_info_map={
                "w": MuonParamInfo(True, lambda u, orth: orth(u)[:2])})
            with self.assertRaisesRegex(ValueError, "split_concat_func of w returned shape"):
                bad._apply_optimize(None, None, [(w, paddle.ones([4, 6]))])

    def test_muon_debug_logs_split_concat_func(self):
        with unique_name.guard():
            w = make_param("qkv", np.ones((4, 6), np.float32))
            opt = Muon(LR, [w], muon_param_info_map={"qkv": MuonParamInfo(True, split3_paddle)})
            # develop reads MUON_DEBUG once at import
            with mock.patch.object(muon_module, "MUON_DEBUG", True), \
                    self.assertLogs(logger, level=logging.INFO) as logs:
                opt._apply_optimize(None, None, [(w, paddle.ones([4, 6]))])
        self.assertTrue(any("qkv" in m and "split_concat_func" in m for m in logs.output))


# --------------------------------------------------------------------------
# Grouped (batched) Newton-Schulz and the staged API (develop #79482/#79537)
# --------------------------------------------------------------------------
def _group_sizes(opt):
    """Wrap _muon_update_group and record the parameter names of each call."""
    calls = []
    original = Muon._muon_update_group

    def spy(self, group, *args):
        calls.append([p.name for p, _ in group])
        return original(self, group, *args)

    return calls, mock.patch.object(Muon, "_muon_update_group", spy)


class TestGroupedUpdate(_Case):
    # five 2-D [12, 20] (960 bytes at 4 bytes/element), three 3-D
    # [2, 8, 12] (768 bytes), one tall [20, 12], one AdamW bias
    NAMES = ["a0", "a1", "a2", "a3", "a4", "e0", "e1", "e2", "tall", "bias"]
    SHAPES = [(12, 20)] * 5 + [(2, 8, 12)] * 3 + [(20, 12), (20,)]

    def _run(self, max_bytes, steps=3):
        calls, spy = _group_sizes(None)
        with spy:
            opt, _ = self.run_case(f"grouped, max_group_bytes={max_bytes}", self.SHAPES,
                                   dict(muon_max_group_bytes=max_bytes, momentum=0.9),
                                   dict(momentum=0.9), [True] * 9 + [False],
                                   steps=steps, names=self.NAMES)
        return opt, calls[: len(calls) // steps]

    def test_splits_by_bytes_and_matches_per_matrix_reference(self):
        # 1,920 bytes: two [12, 20] or two [2, 8, 12] per batch
        _, calls = self._run(1920)
        self.assertEqual(calls, [["a0", "a1"], ["a2", "a3"], ["a4"], ["e0", "e1"], ["e2"],
                                 ["tall"]], "groups follow muon_group_key, split greedily")

    def test_one_batch_per_key_without_limit(self):
        for max_bytes in (None, 0, 2 * 1024**3):
            with self.subTest(max_bytes=max_bytes):
                _, calls = self._run(max_bytes, steps=1)
                self.assertEqual(calls, [self.NAMES[:5], self.NAMES[5:8], ["tall"]])

    def test_param_larger_than_limit_is_alone(self):
        _, calls = self._run(100, steps=1)
        self.assertEqual(calls, [[n] for n in self.NAMES[:9]])

    def test_grouped_equals_ns_per_matrix(self):
        results = []
        for kwargs in ({}, {"ns_per_matrix": True}):
            values = rng_arrays(40, *self.SHAPES, scale=0.05)
            consts = rng_arrays(41, *self.SHAPES)
            with unique_name.guard():
                params = [make_param(n, v) for n, v in zip(self.NAMES, values)]
                opt = Muon(LR, params, muon_exclude_patterns=[], **kwargs)
                train(opt, params, consts, 2)
            results.append([p.numpy() for p in params])
        for name, a, b in zip(self.NAMES, *results):
            # batched vs per-matrix fp32 GEMMs: summation order only
            self.assertLessEqual(max_rel(a, b), 1e-6, f"{name}: grouped != per matrix")

    def test_split_concat_func_sees_the_stacked_batch(self):
        seen = []

        def halves(update, ortho_fn):
            seen.append(list(update.shape))
            return paddle.concat([ortho_fn(b) for b in paddle.split(update, 2, axis=-2)],
                                 axis=-2)

        def halves_ref(u, ortho):
            return np.concatenate([ortho(b) for b in np.split(u, 2, axis=-2)], axis=-2)

        names = ["q0", "q1", "q2"]
        info = {n: MuonParamInfo(True, functools.partial(halves)) for n in names}
        self.run_case("split_concat_func on a stacked group", [(16, 12)] * 3,
                      dict(muon_param_info_map=info),
                      dict(split={n: halves_ref for n in names}), [True] * 3, names=names)
        self.assertEqual(seen[0], [3, 16, 12], "2-D params are stacked to [n, H, I]")

    def test_muon_group_key(self):
        def f(u, o, k=1):
            return o(u)

        def g(u, o):
            return o(u)

        with unique_name.guard():
            ps = [make_param(f"p{i}", np.ones((4, 6), np.float32)) for i in range(6)]
            ps[5].original_shape = [2, 2, 6]
        info = {
            "p0": MuonParamInfo(True, functools.partial(f, k=[1, 2])),
            "p1": MuonParamInfo(True, functools.partial(f, k=[1, 2])),
            "p2": MuonParamInfo(True, functools.partial(f, k={"b": 1, "a": [2]})),
            "p3": MuonParamInfo(True, g),
        }
        opt = Muon(LR, ps, muon_param_info_map=info, muon_exclude_patterns=[])
        keys = [opt.muon_group_key(p) for p in ps]
        self.assertEqual(keys[0], keys[1], "equal partials share a batch")
        self.assertEqual(keys[0], ((f, (), (("k", (1, 2)),)), (4, 6)))
        self.assertEqual(keys[2][0][2], (("k", (("a", (2,)), ("b", 1))),))
        self.assertEqual(keys[3], (g, (4, 6)))
        self.assertEqual(keys[4], (None, (4, 6)))
        self.assertEqual(keys[5], (None, (2, 2, 6)), "original_shape keys the group")
        self.assertEqual(len({hash(k) for k in keys}), 5)
        self.assertEqual(_to_hashable([1, [2, 3], {"z": [4], "a": 5}]),
                         (1, (2, 3), (("a", 5), ("z", (4,)))))
        self.assertEqual(_to_hashable("s"), "s")

    def test_split_group_by_bytes_generator(self):
        with unique_name.guard():
            ps = [make_param(f"p{i}", np.ones(s, np.float32))
                  for i, s in enumerate([(2, 4), (2, 4), (4, 4), (2, 2)])]
        pairs = [(p, None) for p in ps]  # 32, 32, 64, 16 bytes
        for limit, expect in ((64, [[0, 1], [2], [3]]), (65, [[0, 1], [2], [3]]),
                              (96, [[0, 1], [2, 3]]), (1, [[0], [1], [2], [3]]),
                              (None, [[0, 1, 2, 3]]), (0, [[0, 1, 2, 3]])):
            with self.subTest(limit=limit):
                opt = Muon(LR, ps, muon_max_group_bytes=limit, muon_exclude_patterns=[])
                got = [[int(p.name[1:]) for p, _ in sub]
                       for sub in opt._split_group_by_bytes(pairs)]
                self.assertEqual(got, expect)
        self.assertEqual(list(opt._split_group_by_bytes([])), [[]])

    def test_patched_muon_update_group_is_used(self):
        # PaddleFormers patches Muon._muon_update_group on the class
        with unique_name.guard():
            w = make_param("w", np.ones((4, 6), np.float32))
            opt = Muon(LR, [w], muon_exclude_patterns=[])
            seen = []
            with mock.patch.object(Muon, "_muon_update_group",
                                   lambda self, group, lr, *rest: seen.append((group, lr, rest))):
                paddle.sum(w * w).backward()
                opt.step()
        (group, lr, rest), = seen
        self.assertIs(group[0][0], w)
        self.assertIsInstance(lr, float, "the Muon path gets a Python float lr")
        self.assertEqual(rest, (0.95, 5, True, 1e-9, 0.01, 1))


class TestStagedApi(unittest.TestCase):
    def _setup(self):
        shapes = [(12, 20), (12, 20), (20,), (8, 8)]
        names = ["w0", "w1", "b", "m"]
        values = rng_arrays(50, *shapes, scale=0.05)
        grads = rng_arrays(51, *shapes)
        params = [make_param(n, v) for n, v in zip(names, values)]
        return params, values, grads

    def test_prepare_routes_in_order_and_creates_state_only(self):
        with unique_name.guard():
            params, values, grads = self._setup()
            opt = Muon(LR, params, muon_exclude_patterns=[])
            pairs = [(params[2], paddle.to_tensor(grads[2])), (params[3], None),
                     (params[1], paddle.to_tensor(grads[1])),
                     (params[0], paddle.to_tensor(grads[0]))]
            muon, adamw = opt.prepare_optimize(pairs)
        self.assertEqual([p.name for p, _ in muon], ["w1", "w0"])
        self.assertEqual([p.name for p, _ in adamw], ["b"])
        self.assertEqual(set(opt.state_dict()), {"w0_moment1_0", "w1_moment1_0", "b_moment1_0",
                                                 "b_moment2_0", "b_beta1_pow_acc_0",
                                                 "b_beta2_pow_acc_0"})
        for p, v in zip(params, values):
            self.assertTrue(np.array_equal(p.numpy(), v), f"{p.name} moved in prepare")

    def test_apply_grad_clip(self):
        with unique_name.guard():
            params, _, grads = self._setup()
            pairs = [(p, paddle.to_tensor(g)) for p, g in zip(params, grads)]
            plain = Muon(LR, params, muon_exclude_patterns=[])
            self.assertEqual(plain.apply_grad_clip(pairs), pairs)
            clipped = Muon(LR, params, muon_exclude_patterns=[],
                           grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0)).apply_grad_clip(pairs)
        norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads))
        for (_, g), ref in zip(clipped, grads):
            np.testing.assert_allclose(g.numpy(), ref / norm, rtol=1e-5,
                                       err_msg="global-norm clip to 1.0")

    def test_stages_in_two_calls_equal_apply_optimize(self):
        results = []
        for staged in (False, True):
            with unique_name.guard():
                params, _, grads = self._setup()
                opt = Muon(LR, params, muon_exclude_patterns=[],
                           grad_clip=paddle.nn.ClipGradByGlobalNorm(0.5))
                for _ in range(3):
                    pairs = [(p, paddle.to_tensor(g) + p) for p, g in zip(params, grads)]
                    if staged:
                        muon, adamw = opt.prepare_optimize(opt.apply_grad_clip(pairs))
                        # the sharding overlap: disjoint stages, keys never split
                        opt.update_params(muon[:2], [])
                        opt.update_params(muon[2:], adamw)
                    else:
                        opt._apply_optimize(None, None, pairs)
            results.append([p.numpy() for p in params])
        for a, b in zip(*results):
            self.assertTrue(np.array_equal(a, b), "staged calls differ from _apply_optimize")

    def test_update_params_adamw_lr_is_0d_fp64(self):
        with unique_name.guard():
            params, _, grads = self._setup()
            opt = Muon(LR, params, muon_exclude_patterns=[])
            muon, adamw = opt.prepare_optimize([(params[2], paddle.to_tensor(grads[2]))])
            with mock.patch.object(Muon, "_adamw_update") as upd:
                opt.update_params(muon, adamw)
        (_, _, lr, wd), _ = upd.call_args
        self.assertEqual((lr.dtype, list(lr.shape)), (paddle.float64, []))
        self.assertAlmostEqual(float(lr), LR)

    def test_bypass_flag_skips_everything(self):
        with unique_name.guard():
            params, values, grads = self._setup()
            opt = Muon(LR, params, muon_exclude_patterns=[], multi_precision=True,
                       grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
            pairs = [(p, paddle.to_tensor(g)) for p, g in zip(params, grads)]
            with mock.patch.object(muon_module, "g_shard_bypass_dygraph_optimizer", 1), \
                    mock.patch.object(Muon, "apply_grad_clip") as clip:
                self.assertIsNone(opt._apply_optimize(None, None, pairs))
        clip.assert_not_called()
        self.assertEqual(opt.state_dict(), {})
        for p, v in zip(params, values):
            self.assertTrue(np.array_equal(p.numpy(), v))


# --------------------------------------------------------------------------
# Develop's constructor, names and symmetric GEMM (sections 1, 2.1, 4)
# --------------------------------------------------------------------------
def fake_gemm_symmetric(calls):
    """develop's test substitute: out = beta * C + alpha * (A @ B)."""

    def gemm(A, B, C=None, alpha=1.0, beta=1.0):
        calls.append((list(A.shape), C is not None, alpha, beta))
        out = alpha * paddle.matmul(A, B)
        return out if C is None else out + beta * C

    return gemm


class TestDevelopNames(unittest.TestCase):
    def test_coefficient_sets(self):
        sets = muon_module._NS_COEFFICIENT_SETS
        self.assertEqual(list(sets), ["simple", "quintic", "polar_express", "aol", "deepseekv4"])
        self.assertEqual({k: len(v) for k, v in sets.items()},
                         {"simple": 1, "quintic": 5, "polar_express": 8, "aol": 4,
                          "deepseekv4": 10})
        for kind, table in sets.items():
            self.assertIsInstance(table, list, kind)
            self.assertTrue(all(isinstance(c, tuple) and len(c) == 3 for c in table), kind)
            self.assertEqual(table, REF_PRESETS[kind])

    def test_module_names(self):
        self.assertEqual(logger.name, "paddle.optimizer.muon", "develop's module logger")
        self.assertEqual(muon_module._SYRK_SUPPORTED_DTYPES, (paddle.bfloat16, paddle.float16))
        self.assertIsInstance(muon_module.MUON_DEBUG, bool)
        self.assertIsInstance(muon_module.g_shard_bypass_dygraph_optimizer, int)
        self.assertEqual([f.name for f in dataclasses.fields(MuonParamInfo)],
                         ["use_muon", "split_concat_func", "use_hyperball"])
        self.assertEqual(MuonParamInfo(), MuonParamInfo(True, None, False))
        for name in ("_zeropower_via_newtonschulz5", "_newton_schulz_step",
                     "_batched_newton_schulz_step", "_newton_schulz_step_symmetric",
                     "_batched_newton_schulz_step_symmetric", "_scaling_fn",
                     "_hyperball_apply"):
            self.assertIsInstance(inspect.getattr_static(Muon, name), staticmethod, name)
        for name in ("_newton_schulz_step", "_batched_newton_schulz_step_symmetric"):
            self.assertEqual(list(inspect.signature(getattr(Muon, name)).parameters),
                             ["X", "a", "b", "c"])
        self.assertEqual(len(inspect.signature(
            muon_module._symmetric_gemm_is_profitable).parameters), 4)

    def test_default_dict_and_attributes(self):
        p = _params()
        opt = Muon(parameters=p, ns_coeff_type="custom", ns_coeffs=[(2.0, -1.5, 0.5)],
                   adam_epsilon=1e-7)
        dd = opt._default_dict
        self.assertEqual({k: dd[k] for k in ("momentum", "adam_beta1", "adam_beta2",
                                              "weight_decay", "ns_steps", "nesterov",
                                              "epsilon", "muon_version", "ns_coeff_type",
                                              "muon_epsilon")},
                         {"momentum": 0.95, "adam_beta1": 0.9, "adam_beta2": 0.95,
                          "weight_decay": 0.01, "ns_steps": 5, "nesterov": True,
                          "epsilon": 1e-7, "muon_version": 1, "ns_coeff_type": "custom",
                          "muon_epsilon": 1e-7})
        self.assertIn("grad_clip", dd)
        self.assertEqual(Muon(parameters=p, muon_epsilon=1e-4)._default_dict["muon_epsilon"],
                         1e-4)
        self.assertEqual(opt._ns_coeffs, [(2.0, -1.5, 0.5)])
        self.assertEqual((opt._muon_param_info_map, opt._master_weights,
                          opt._muon_split_logged, opt._muon_max_group_bytes),
                         ({}, {}, False, 2 * 1024**3))
        self.assertIsNone(opt._muon_exclude_patterns)
        self.assertEqual((opt._use_symmetric_gemm, opt._symmetric_gemm_min_short_edge,
                          opt._symmetric_gemm_min_step_flops), (False, 1024, 2e11))
        off = Muon(parameters=p, symmetric_gemm_min_short_edge=0,
                   symmetric_gemm_min_step_flops=-1)  # not validated when off
        self.assertEqual(off._symmetric_gemm_min_short_edge, 0)

    def test_auto_ns_dtype(self):
        cuda = mock.patch.object(paddle, "is_compiled_with_cuda", return_value=True)
        for capability, expect in (((8, 0), paddle.bfloat16), ((7, 5), paddle.float32)):
            with cuda, mock.patch.object(paddle.device.cuda, "get_device_capability",
                                         return_value=capability):
                self.assertEqual(Muon(parameters=_params())._ns_matmul_dtype, expect)
        with cuda, mock.patch.object(paddle.device.cuda, "get_device_capability",
                                     side_effect=RuntimeError("no device")):
            self.assertEqual(Muon(parameters=_params())._ns_matmul_dtype, paddle.float32)

    def test_unknown_kwargs_are_named(self):
        with self.assertLogs(logger, level=logging.WARNING) as logs:
            opt = Muon(parameters=_params(), ns_per_matrix=True, momentun=0.9)
        self.assertEqual(len(logs.output), 1)
        self.assertIn("['momentun']", logs.output[0])
        self.assertTrue(opt._ns_per_matrix)

    def test_zeropower_defaults_and_dtype(self):
        (x,) = rng_arrays(60, (12, 20))
        # steps=0: normalise + cast only; ns_coeffs None = simple
        out = Muon._zeropower_via_newtonschulz5(paddle.to_tensor(x), 0,
                                                ns_matmul_dtype=paddle.float32)
        np.testing.assert_allclose(out.numpy(), x / np.linalg.norm(x), rtol=1e-6)
        out = Muon._zeropower_via_newtonschulz5(paddle.to_tensor(x),
                                                ns_matmul_dtype=paddle.float32)
        self.assertLessEqual(max_rel(out.numpy(), ns_ref(x, SIMPLE, 5)), RTOL)
        # the result stays in the matmul dtype (develop does not cast back)
        out64 = Muon._zeropower_via_newtonschulz5(paddle.to_tensor(x), 3, 1e-9, None,
                                                  paddle.float64)
        self.assertEqual(out64.dtype, paddle.float64)
        # normalised in the input dtype (fp32) before the cast: fp32 accuracy
        self.assertLessEqual(max_rel(out64.numpy(), ns_ref(x, SIMPLE, 3)), 1e-6)
        x64 = paddle.to_tensor(x.astype(np.float64))
        out64 = Muon._zeropower_via_newtonschulz5(x64, 3, 1e-9, None, paddle.float64)
        # addmm's alpha/beta are fp32 attributes: the coefficients carry ~3e-8
        self.assertLessEqual(max_rel(out64.numpy(), ns_ref(x, SIMPLE, 3)), 2e-7)
        with self.assertRaisesRegex(ValueError, "2-D or 3-D"):
            Muon._zeropower_via_newtonschulz5(paddle.ones([2, 2, 2, 2]))

    def test_scaling_rounds_twice_in_the_update_dtype(self):
        (o,) = rng_arrays(61, (16, 48))
        ob = paddle.to_tensor(o).astype("bfloat16")
        out = Muon._scaling_fn(ob, 1, 0.2)
        self.assertEqual(out.dtype, paddle.bfloat16)
        o16 = bf16_round(o)
        # Paddle turns a Python scalar into the tensor's dtype before the
        # multiply: bf16(scale), then each product rounded to bf16
        s1, s2 = bf16_round(np.float32(math.sqrt(3.0))), bf16_round(np.float32(0.2))
        expect = bf16_round(bf16_round(o16 * s1) * s2)
        self.assertTrue(np.array_equal(to_np(out), expect),
                        "scale then extra factor, each rounded to bf16")
        self.assertTrue(np.array_equal(Muon._scaling_fn(paddle.to_tensor(o), 2).numpy(),
                                       (o * np.float32(math.sqrt(3.0))) * np.float32(1.0)))


# (shape, dtype, min_short_edge, min_step_flops) -> profitable, develop's table
GATE = [
    ([16, 2048, 2048], "bfloat16", None, True), ([16, 2048, 2048], "float16", None, True),
    ([16, 2048, 2048], "float32", None, False), ([16, 2048, 2048], "float64", None, False),
    ([16, 4096, 8192], "bfloat16", None, True), ([64, 2048, 2048], "bfloat16", None, True),
    ([16, 1024, 4096], "bfloat16", None, True), ([4096, 8192], "bfloat16", None, True),
    ([16, 8192, 2048], "bfloat16", None, True), ([4096, 4104], "bfloat16", None, True),
    ([16, 4096, 512], "bfloat16", None, False), ([111, 512, 4096], "bfloat16", None, False),
    ([16, 512, 1024], "bfloat16", None, False), ([6, 64, 1024], "bfloat16", None, False),
    ([16, 1036, 8192], "bfloat16", None, False), ([4096, 4097], "bfloat16", None, False),
    ([4096, 4100], "bfloat16", None, False), ([16, 2048, 4097], "bfloat16", None, False),
    ([1, 1024, 1024], "bfloat16", None, False), ([1024, 4096], "bfloat16", None, False),
    ([1024, 4096], "bfloat16", (512, 1), True), ([4096, 8192], "bfloat16", (8192, 2e11), False),
    ([4096, 8192], "bfloat16", (1024, 1e30), False), ([1036, 8192], "bfloat16", (8, 1), False),
    ([8, 16], "bfloat16", (8, 1), True),
]


class TestSymmetricGemm(unittest.TestCase):
    def setUp(self):
        muon_module._load_symmetric_gemm.cache_clear()
        self.addCleanup(muon_module._load_symmetric_gemm.cache_clear)

    def test_profitability_gate(self):
        for shape, dtype, thresholds, expect in GATE:
            with self.subTest(shape=shape, dtype=dtype, thresholds=thresholds):
                edge, flops = thresholds or (1024, 2e11)
                self.assertEqual(muon_module._symmetric_gemm_is_profitable(
                    shape, getattr(paddle, dtype), edge, flops), expect)

    def test_loader_caches_and_explains_a_missing_package(self):
        quack = types.ModuleType("quack")
        iface = types.ModuleType("quack.gemm_interface")
        iface.gemm_symmetric = object()
        quack.gemm_interface = iface
        with mock.patch.dict(sys.modules, {"quack": quack, "quack.gemm_interface": iface}):
            self.assertIs(muon_module._load_symmetric_gemm(), iface.gemm_symmetric)
        # served from the cache after quack left sys.modules
        self.assertIs(muon_module._load_symmetric_gemm(), iface.gemm_symmetric)
        self.assertEqual(muon_module._load_symmetric_gemm.cache_info().currsize, 1)
        muon_module._load_symmetric_gemm.cache_clear()
        with mock.patch.dict(sys.modules, {"quack": None, "quack.gemm_interface": None}):
            with self.assertRaisesRegex(RuntimeError, "quack-kernels") as ctx:
                muon_module._load_symmetric_gemm()
        self.assertIsInstance(ctx.exception.__cause__, ImportError)

    def test_constructor_checks_in_develops_order(self):
        p = _params()
        with self.assertRaisesRegex(ValueError, "bfloat16 or float16"):
            Muon(parameters=p, use_symmetric_gemm=True, ns_matmul_dtype=paddle.float32)
        if not paddle.is_compiled_with_cuda():
            with self.assertRaisesRegex(ValueError, r'compute capability.*"0\.0"'):
                Muon(parameters=p, use_symmetric_gemm=True, ns_matmul_dtype=paddle.bfloat16)
        with mock.patch.object(paddle, "is_compiled_with_cuda", return_value=True), \
                mock.patch.object(paddle.device.cuda, "get_device_capability",
                                  return_value=(8, 0)), \
                self.assertRaisesRegex(ValueError, r'"8\.0"'):
            Muon(parameters=p, use_symmetric_gemm=True, ns_matmul_dtype=paddle.bfloat16)
        loader = mock.Mock(return_value=fake_gemm_symmetric([]))
        with mock.patch.object(paddle, "is_compiled_with_cuda", return_value=True), \
                mock.patch.object(paddle.device.cuda, "get_device_capability",
                                  return_value=(9, 0)), \
                mock.patch.object(muon_module, "_load_symmetric_gemm", loader):
            for bad in (dict(symmetric_gemm_min_short_edge=0),
                        dict(symmetric_gemm_min_step_flops=-1.0)):
                with self.subTest(bad=bad), self.assertRaisesRegex(ValueError, "must be positive"):
                    Muon(parameters=p, use_symmetric_gemm=True, **bad)
            loader.assert_not_called()
            opt = Muon(parameters=p, use_symmetric_gemm=True)  # auto dtype: bf16 on SM 9
            loader.assert_called_once_with()
        self.assertEqual(opt._ns_matmul_dtype, paddle.bfloat16)
        self.assertTrue(opt._use_symmetric_gemm)
        with mock.patch.object(paddle, "is_compiled_with_cuda", return_value=True), \
                mock.patch.object(paddle.device.cuda, "get_device_capability",
                                  return_value=(10, 0)), \
                mock.patch.dict(sys.modules, {"quack": None, "quack.gemm_interface": None}), \
                self.assertRaisesRegex(RuntimeError, "quack-kernels"):
            Muon(parameters=p, use_symmetric_gemm=True)

    def test_symmetric_step_equals_dense_step_with_fake_kernel(self):
        # fp32 stands in for bf16 on this CPU: develop's tests patch the dtype list
        for shape in ([16, 24], [3, 16, 24], [24, 16]):
            with self.subTest(shape=shape):
                (x,) = rng_arrays(62, shape)
                calls = []
                kw = dict(use_symmetric_gemm=True, symmetric_gemm_min_short_edge=8,
                          symmetric_gemm_min_step_flops=1)
                with mock.patch.object(muon_module, "_SYRK_SUPPORTED_DTYPES", (paddle.float32,)), \
                        mock.patch.object(muon_module, "_load_symmetric_gemm",
                                          return_value=fake_gemm_symmetric(calls)):
                    sym = Muon._zeropower_via_newtonschulz5(paddle.to_tensor(x), 2, 1e-9, None,
                                                            paddle.float32, **kw)
                self.assertEqual(len(calls), 4, "two kernel calls per step")
                self.assertEqual([c[1:] for c in calls[:2]],
                                 [(False, 1.0, 1.0), (True, SIMPLE[0][2], SIMPLE[0][1])])
                dense = Muon._zeropower_via_newtonschulz5(paddle.to_tensor(x), 2, 1e-9, None,
                                                          paddle.float32)
                np.testing.assert_allclose(sym.numpy(), dense.numpy(), rtol=1e-5, atol=1e-6)
                self.assertLessEqual(max_rel(sym.numpy(), ns_ref(x, SIMPLE, 2)), RTOL)

    def test_dense_fallbacks_leave_the_kernel_untouched(self):
        (x,) = rng_arrays(63, (16, 24))
        for kw in (dict(use_symmetric_gemm=False, symmetric_gemm_min_short_edge=8,
                        symmetric_gemm_min_step_flops=1),
                   dict(use_symmetric_gemm=True, symmetric_gemm_min_short_edge=32,
                        symmetric_gemm_min_step_flops=1),
                   dict(use_symmetric_gemm=True, symmetric_gemm_min_short_edge=8,
                        symmetric_gemm_min_step_flops=1e30)):
            with self.subTest(kw=kw):
                calls = []
                with mock.patch.object(muon_module, "_SYRK_SUPPORTED_DTYPES", (paddle.float32,)), \
                        mock.patch.object(muon_module, "_load_symmetric_gemm",
                                          return_value=fake_gemm_symmetric(calls)):
                    Muon._zeropower_via_newtonschulz5(paddle.to_tensor(x), 2, 1e-9, None,
                                                      paddle.float32, **kw)
                self.assertEqual(calls, [])

    def test_optimizer_step_dispatches_through_the_kernel(self):
        values = rng_arrays(64, (16, 24), (2, 16, 24), scale=0.05)
        consts = rng_arrays(65, (16, 24), (2, 16, 24))
        calls = []
        with mock.patch.object(paddle, "is_compiled_with_cuda", return_value=True), \
                mock.patch.object(paddle.device.cuda, "get_device_capability",
                                  return_value=(9, 0)), \
                mock.patch.object(muon_module, "_SYRK_SUPPORTED_DTYPES", (paddle.float32,)), \
                mock.patch.object(muon_module, "_load_symmetric_gemm",
                                  return_value=fake_gemm_symmetric(calls)), \
                unique_name.guard():
            params = [make_param(n, v) for n, v in zip(["w", "e"], values)]
            opt = Muon(LR, params, muon_exclude_patterns=[], ns_matmul_dtype=paddle.float32,
                       use_symmetric_gemm=True, symmetric_gemm_min_short_edge=8,
                       symmetric_gemm_min_step_flops=1)
            train(opt, params, consts, 2)
        self.assertEqual(len(calls), 2 * 2 * 5 * 2, "2 kernels x 5 NS steps x 2 keys x 2 steps")
        ref = ref_train(RefMuon(), ["w", "e"], values, consts, [True, True], 2)
        for p, r in zip(params, ref):
            self.assertLessEqual(max_rel(p.numpy(), r), RTOL, p.name)


# --------------------------------------------------------------------------
# Hyperball (MuonH / AdamH), muon_epsilon (develop #79792)
# --------------------------------------------------------------------------
def fro_ref(x):
    return np.sqrt(np.sum(np.asarray(x, np.float64) ** 2, axis=(-2, -1), keepdims=True))


def hyperball_ref(w, u, lr, eps=1e-12):
    """R = ||w||; trial = w - lr R u/||u||; R trial/||trial|| (per matrix)."""
    w, u = np.asarray(w, np.float64), np.asarray(u, np.float64)
    radius = fro_ref(w)
    trial = w - lr * radius * u / np.maximum(fro_ref(u), eps)
    return radius * trial / np.maximum(fro_ref(trial), eps)


class RefMuonH(RefMuon):
    """RefMuon plus the hyperball modes: no weight decay, lr times lr_ratio."""

    def step_mode(self, name, w, g, use_muon, hyper, lr=None):
        if not hyper:
            return self.step(name, w, g, use_muon, lr=lr)
        lr = (self.lr if lr is None else lr) * (self.lr_ratio(name) if self.lr_ratio else 1.0)
        w, g = np.asarray(w, np.float64), np.asarray(g, np.float64)
        st = self.state.setdefault(name, {"m": np.zeros_like(w), "v": np.zeros_like(w), "t": 0})
        shape = self.original_shape.get(name, w.shape)
        shape = shape if len(shape) >= 2 else (1, w.size)
        if use_muon:
            st["m"] = st["m"] + (1 - self.momentum) * (g - st["m"])
            u = g + self.momentum * (st["m"] - g) if self.nesterov else st["m"]
            d = self.ortho(u.reshape(shape))
        else:
            st["t"] += 1
            t = st["t"]
            st["m"] = self.beta1 * st["m"] + (1 - self.beta1) * g
            st["v"] = self.beta2 * st["v"] + (1 - self.beta2) * g * g
            d = (st["m"] / (1 - self.beta1**t)) / (
                np.sqrt(st["v"] / (1 - self.beta2**t)) + self.eps)
        return hyperball_ref(w.reshape(shape), d.reshape(shape), lr).reshape(w.shape)


class TestHyperball(unittest.TestCase):
    def test_apply_matches_formula_2d_and_3d(self):
        for shape in ((16, 24), (24, 16), (3, 8, 12)):
            with self.subTest(shape=shape):
                w, u = rng_arrays(70, shape, shape)
                out = Muon._hyperball_apply(paddle.to_tensor(w), paddle.to_tensor(u), 0.3)
                ref = hyperball_ref(w, u, 0.3)
                np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(fro_ref(out.numpy()), fro_ref(w), rtol=1e-5,
                                           err_msg="norm kept per matrix")
        # w is left unchanged, a new tensor comes back
        wt = paddle.to_tensor(w)
        Muon._hyperball_apply(wt, paddle.to_tensor(u), 0.3)
        self.assertTrue(np.array_equal(wt.numpy(), w))

    def test_experts_are_independent(self):
        w, u = rng_arrays(71, (4, 8, 12), (4, 8, 12))
        u2 = u.copy()
        u2[0] *= -3.0
        w2 = w.copy()
        w2[2] *= 5.0
        a = Muon._hyperball_apply(paddle.to_tensor(w), paddle.to_tensor(u), 0.2).numpy()
        b = Muon._hyperball_apply(paddle.to_tensor(w2), paddle.to_tensor(u2), 0.2).numpy()
        for e in (1, 3):
            self.assertTrue(np.array_equal(a[e], b[e]), f"expert {e} saw another expert")
        self.assertFalse(np.allclose(a[0], b[0]))

    def test_zero_update_and_zero_lr(self):
        (w,) = rng_arrays(72, (8, 12))
        for u, lr in ((np.zeros_like(w), 0.5), (rng_arrays(73, (8, 12))[0], 0.0)):
            out = Muon._hyperball_apply(paddle.to_tensor(w), paddle.to_tensor(u), lr).numpy()
            self.assertTrue(np.all(np.isfinite(out)))
            np.testing.assert_allclose(out, w, rtol=1e-5, atol=1e-6)

    def _train_modes(self, modes, shapes, names, steps=3, wd=0.01, ratio=None,
                     original=None, eps=1e-9):
        values = rng_arrays(74, *shapes, scale=0.5)
        consts = rng_arrays(75, *shapes)
        info = {n: MuonParamInfo(use_muon=m, use_hyperball=h) for n, (m, h) in zip(names, modes)}
        with unique_name.guard():
            params = [make_param(n, v) for n, v in zip(names, values)]
            for p in params:
                if original and p.name in original:
                    p.original_shape = list(original[p.name])
            opt = Muon(LR, params, muon_param_info_map=info, weight_decay=wd,
                       lr_ratio=None if ratio is None else (lambda p: ratio(p.name)),
                       adam_epsilon=eps)
            train(opt, params, consts, steps)
        ref = RefMuonH(wd=wd, lr_ratio=ratio, original_shape=original, eps=eps)
        vals = [np.asarray(v, np.float64) for v in values]
        for _ in range(steps):
            vals = [ref.step_mode(n, w, c + w, m, h)
                    for n, w, c, (m, h) in zip(names, vals, consts, modes)]
        return opt, params, values, vals

    def test_four_modes_match_reference_three_steps(self):
        modes = [(True, True), (False, True), (True, False), (False, False),
                 (True, True), (False, True)]
        names = ["muonh", "adamh", "muon", "adamw", "muonh3d", "adamh1d"]
        shapes = [(16, 24), (24, 16), (16, 24), (24,), (3, 8, 12), (24,)]
        opt, params, values, ref = self._train_modes(modes, shapes, names,
                                                     ratio=lambda n: 0.5 if "h" in n else 1.0)
        for p, r, v, (m, h) in zip(params, ref, values, modes):
            err = max_rel(p.numpy(), r)
            MEASURED[f"hyperball mode {p.name}"] = (err, max_rel(p.numpy() - v, r - v))
            self.assertLessEqual(err, RTOL, f"{p.name}: differs from the float64 reference")
            self.assertFalse(np.allclose(p.numpy(), v), f"{p.name} did not move")
            if h:
                mat = r.shape if r.ndim >= 2 else (1, r.size)
                np.testing.assert_allclose(fro_ref(p.numpy().reshape(mat)),
                                           fro_ref(v.reshape(mat)),
                                           rtol=1e-5, err_msg=f"{p.name} left its sphere")
        sd = opt.state_dict()
        self.assertEqual({k for k in sd if k.startswith("adamh_")},
                         {"adamh_moment1_0", "adamh_moment2_0", "adamh_beta1_pow_acc_0",
                          "adamh_beta2_pow_acc_0"})
        # one power per step past the initial beta (the checkpoint resumes from them)
        np.testing.assert_allclose(sd["adamh_beta1_pow_acc_0"].numpy(), [0.9**4], rtol=1e-6)
        np.testing.assert_allclose(sd["adamh_beta2_pow_acc_0"].numpy(), [0.95**4], rtol=1e-6,
                                   err_msg="AdamH's beta2 power did not advance per step")
        self.assertEqual({k for k in sd if k.startswith("muonh_")}, {"muonh_moment1_0"})

    def test_adamh_epsilon_is_added_outside_the_square_root(self):
        # Adam's m / (sqrt(v) + eps): a large epsilon makes the direction differ
        # element-wise from m / sqrt(v + eps), which the sphere's
        # normalisation cannot hide (a uniform scale it would).
        _, params, values, ref = self._train_modes([(False, True)], [(8, 12)], ["adamh"],
                                                   steps=2, eps=0.5)
        self.assertFalse(np.allclose(params[0].numpy(), values[0]), "adamh did not move")
        self.assertLessEqual(max_rel(params[0].numpy(), ref[0]), RTOL,
                             "AdamH with adam_epsilon=0.5 differs from m/(sqrt(v)+eps)")

    def test_original_shape_norms_per_expert(self):
        names = ["experts"]
        opt, params, values, ref = self._train_modes(
            [(True, True)], [(24, 12)], names, original={"experts": (3, 8, 12)})
        self.assertLessEqual(max_rel(params[0].numpy(), ref[0]), RTOL)
        np.testing.assert_allclose(fro_ref(params[0].numpy().reshape(3, 8, 12)),
                                   fro_ref(values[0].reshape(3, 8, 12)), rtol=1e-5)

    def test_no_weight_decay_and_lr_ratio_zero_freezes(self):
        modes = [(True, True), (False, True)]
        names, shapes = ["muonh", "adamh"], [(16, 24), (8, 12)]
        _, a, _, _ = self._train_modes(modes, shapes, names, wd=0.0)
        _, b, _, _ = self._train_modes(modes, shapes, names, wd=0.9)
        for x, y in zip(a, b):
            self.assertTrue(np.array_equal(x.numpy(), y.numpy()), "weight decay leaked in")
        _, params, values, _ = self._train_modes(modes, shapes, names, ratio=lambda n: 0.0)
        for p, v in zip(params, values):
            np.testing.assert_allclose(p.numpy(), v, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{p.name}: lr_ratio 0 must freeze it")

    def test_master_weights_bf16(self):
        names, shapes = ["muonh", "adamh"], [(16, 24), (8, 12)]
        modes = [(True, True), (False, True)]
        values = [bf16_round(v) for v in rng_arrays(76, *shapes, scale=0.5)]
        consts = rng_arrays(77, *shapes)
        info = {n: MuonParamInfo(use_muon=m, use_hyperball=h) for n, (m, h) in zip(names, modes)}
        with unique_name.guard():
            params = [make_param(n, v, "bfloat16") for n, v in zip(names, values)]
            opt = Muon(LR, params, muon_param_info_map=info, multi_precision=True)
            train(opt, params, consts, 2)
        ref, masters = RefMuonH(), [np.asarray(v, np.float64) for v in values]
        for _ in range(2):
            grads = [bf16_round((c + bf16_round(w)).astype(np.float32))
                     for c, w in zip(consts, masters)]
            masters = [ref.step_mode(n, w, g, m, h)
                       for n, w, g, (m, h) in zip(names, masters, grads, modes)]
        for p, r, v in zip(params, masters, values):
            master = opt._master_weights[p.name].numpy()
            self.assertLessEqual(max_rel(master, r), RTOL, p.name)
            np.testing.assert_allclose(fro_ref(master), fro_ref(v), rtol=1e-5)
            self.assertTrue(np.array_equal(to_np(p), bf16_round(master)))


# Gradients of norm ~1e-5 (values and targets at 1e-7): after step 1 the
# gradient is dominated by the step-1 update, and the fp32 momentum / Nesterov
# sums that feed Newton-Schulz round at that much larger scale. Measured on
# an AVX-512 Xeon against the float64 reference: step 1 <= 9.4e-7, after
# steps 2-3 up to 2.0e-5 (`e`) and 1.34e-5 (`w`) with muon_epsilon=None.
# The floor this test checks moves the update by > 1e-3, 20x above this.
RTOL_TINY_GRADS = 5e-5


class TestMuonEpsilon(_Case):
    def test_ns_floor_is_muon_epsilon_and_adamw_keeps_adam_epsilon(self):
        # gradients of norm ~1e-5: the floor 1e-3 dominates the NS normalisation
        shapes, names = [(16, 24), (2, 8, 12), (24,)], ["w", "e", "b"]
        values = rng_arrays(80, *shapes, scale=1e-7)
        consts = rng_arrays(81, *shapes, scale=1e-7)
        runs = {}
        for muon_eps in (None, 1e-3):
            with unique_name.guard():
                params = [make_param(n, v) for n, v in zip(names, values)]
                opt = Muon(LR, params, muon_exclude_patterns=[], muon_epsilon=muon_eps,
                           adam_epsilon=1e-9)
                train(opt, params, consts, 3)
            runs[muon_eps] = [p.numpy() for p in params]
            ns_eps = 1e-9 if muon_eps is None else muon_eps
            ref = RefMuon(eps=1e-9)
            ref.ortho = lambda u, r=ref, e=ns_eps: ns_ref(u, r.coeffs, r.ns_steps, e) * \
                scale_ref(u.shape, r.version, r.extra)
            expect = ref_train(ref, names, values, consts, [True, True, False], 3)
            for name, got, r, v in zip(names, runs[muon_eps], expect, values):
                self.assertLessEqual(max_rel(got - v, r - v), RTOL_TINY_GRADS,
                                     f"{name}, muon_epsilon={muon_eps}: update differs")
        self.assertGreater(max_rel(runs[1e-3][0], runs[None][0]), 1e-3,
                           "muon_epsilon must change the Muon update")
        self.assertTrue(np.array_equal(runs[1e-3][2], runs[None][2]),
                        "muon_epsilon must not touch AdamW")


# --------------------------------------------------------------------------
# Rounding of the bf16 Newton-Schulz result (develop's GPU default) and
# develop-keyed checkpoints
# --------------------------------------------------------------------------
class TestNumbersAndKeys(unittest.TestCase):
    def test_bf16_ns_result_is_scaled_and_stepped_in_bf16(self):
        # The CPU has no bf16 matmul: the NS is run in fp32 and its result
        # rounded to bf16, which is what a bf16 NS hands back; everything
        # after it (scaling, step, cast) is the optimizer's own arithmetic.
        dense = Muon._zeropower_via_newtonschulz5

        def bf16_ns(X, steps=5, eps=1e-9, ns_coeffs=None, ns_matmul_dtype=None, **kw):
            return paddle.cast(dense(X, steps, eps, ns_coeffs, paddle.float32), "bfloat16")

        (g,) = rng_arrays(90, (16, 48))
        lr = 0.1
        with unique_name.guard(), mock.patch.object(Muon, "_zeropower_via_newtonschulz5",
                                                    staticmethod(bf16_ns)):
            w = make_param("w", np.zeros((16, 48), np.float32))
            opt = Muon(lr, [w], muon_exclude_patterns=[], weight_decay=0.0)
            opt._apply_optimize(None, None, [(w, paddle.to_tensor(g))])
        m = np.float32(0.05) * g  # lerp(0, g, 0.05), then nesterov lerp(g, m, 0.95)
        u = g + np.float32(0.95) * (m - g)
        o = bf16_round(dense(paddle.to_tensor(u), 5, 1e-9, None, paddle.float32).numpy())
        scale = [bf16_round(np.float32(s)) for s in (math.sqrt(3.0), 0.2, lr)]
        step = o
        for s in scale:
            step = bf16_round(step * s)
        got = -w.numpy()
        self.assertTrue(np.array_equal(bf16_round(got), got), "the step is a bf16 value")
        self.assertGreater(np.mean(got == step), 0.99,
                           "scale, extra factor and lr each rounded to bf16, as develop")
        self.assertLessEqual(max_rel(got, step), 1e-2)

    def test_bf16_param_without_master_rounds_decay_then_step(self):
        # develop (section 6): param.scale_(1 - lr*wd) rounds to bf16, then the
        # step (fp32 NS here) is cast to bf16 and subtracted in bf16. Paddle
        # turns the Python scale factor into bf16 first, as for multiplies.
        lr, wd = 0.1, 0.37
        (w0,) = rng_arrays(93, (32, 48), scale=0.5)
        (g,) = rng_arrays(94, (32, 48))
        w0 = bf16_round(w0)
        with unique_name.guard():
            w = make_param("w", w0, "bfloat16")
            opt = Muon(lr, [w], muon_exclude_patterns=[], weight_decay=wd)
            opt._apply_optimize(None, None, [(w, paddle.to_tensor(g).astype("bfloat16"))])
        g16 = bf16_round(g).astype(np.float64)
        u = g16 + 0.95 * (0.05 * g16 - g16)
        step = (ns_ref(u, SIMPLE, 5) * scale_ref(u.shape, 1) * lr).astype(np.float32)
        decayed = bf16_round(w0 * bf16_round(np.float32(1.0 - lr * wd)))
        expect = bf16_round(decayed - bf16_round(step))
        one_rounding = bf16_round((w0 * np.float32(1.0 - lr * wd) - step).astype(np.float32))
        got = to_np(w)
        exact = np.mean(got == expect)
        self.assertGreater(exact, 0.99, "decay rounded to bf16, then the bf16 step subtracted")
        self.assertGreater(exact, np.mean(got == one_rounding) + 0.05,
                           "the emulation must tell the rounding orders apart")

    def _develop_state(self, ref, names, shapes, masters, t):
        """A state_dict as develop writes it, from the float64 reference."""
        sd, mw = {}, {}
        for name in names:
            st = ref.state[name]
            sd[f"{name}_moment1_0"] = paddle.to_tensor(st["m"].astype(np.float32))
            if st["t"]:
                sd[f"{name}_moment2_0"] = paddle.to_tensor(st["v"].astype(np.float32))
                sd[f"{name}_beta1_pow_acc_0"] = paddle.to_tensor([0.9 ** (t + 1)], "float32")
                sd[f"{name}_beta2_pow_acc_0"] = paddle.to_tensor([0.95 ** (t + 1)], "float32")
            master = paddle.to_tensor(masters[name].astype(np.float32))
            master.name = f"{name}_fp32_master_0"
            mw[name] = master
        sd["master_weights"] = mw
        return sd

    def test_develop_keyed_bf16_master_checkpoint_resumes(self):
        names, shapes = ["w", "e", "b"], [(16, 24), (2, 8, 12), (24,)]
        use = [True, True, False]
        values = [bf16_round(v) for v in rng_arrays(91, *shapes, scale=0.5)]
        consts = rng_arrays(92, *shapes)
        ref, masters = RefMuon(), [np.asarray(v, np.float64) for v in values]

        def ref_steps(masters, n):
            for _ in range(n):
                grads = [bf16_round((c + bf16_round(w)).astype(np.float32))
                         for c, w in zip(consts, masters)]
                masters = [ref.step(nm, w, gr, um)
                           for nm, w, gr, um in zip(names, masters, grads, use)]
            return masters

        masters = ref_steps(masters, 2)
        for legacy in (False, True):
            with self.subTest(legacy_keys=legacy):
                sd = self._develop_state(ref, names, shapes, dict(zip(names, masters)), 2)
                if legacy:  # this package's keys before develop's
                    sd = {(k.replace("_moment", "_fp32_master_0_moment")
                           .replace("_beta", "_fp32_master_0_beta") if k != "master_weights"
                           else k): v for k, v in sd.items()}
                with unique_name.guard():
                    params = [make_param(n, bf16_round(m.astype(np.float32)), "bfloat16")
                              for n, m in zip(names, masters)]
                    opt = Muon(LR, params, multi_precision=True, muon_exclude_patterns=[])
                    opt.set_state_dict(sd)
                    train(opt, params, consts, 2)
                    self.assertEqual(set(opt.state_dict()) - {"master_weights"},
                                     {k for k in self._develop_state(
                                         ref, names, shapes, dict(zip(names, masters)), 2)
                                      if k != "master_weights"})
                    got = {n: opt._master_weights[n].numpy() for n in names}
                saved_state = {n: dict(ref.state[n]) for n in names}
                expect = ref_steps(masters, 2)
                for n in names:  # rewind the reference for the next subtest
                    ref.state[n] = saved_state[n]
                for n, e in zip(names, expect):
                    self.assertLessEqual(max_rel(got[n], e), RTOL,
                                         f"{n}: resumed run differs from the reference")


    def test_develop_key_wins_over_a_legacy_key_of_the_same_state(self):
        # A state dict holding both spellings (e.g. merged from two saves):
        # develop's key is the one loaded, the legacy copy is ignored.
        with unique_name.guard():
            w = make_param("w", np.ones((4, 6), np.float32))
            opt = Muon(LR, [w], muon_exclude_patterns=[])
            opt._create_accumulators(None, [w])
            develop = np.full((4, 6), 0.25, np.float32)
            opt.set_state_dict({"w_moment1_0": paddle.to_tensor(develop),
                                "w_fp32_master_0_moment1_0": paddle.full([4, 6], 7.0)})
            got = opt.state_dict()["w_moment1_0"].numpy()
        self.assertTrue(np.array_equal(got, develop),
                        f"the legacy key overwrote develop's moment1 (got {got.flat[0]})")


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
                       muon_param_info_map={w.name: MuonParamInfo(use_muon=True)}, **kwargs)
            (w * paddle.to_tensor(g.astype("float32"))).sum().backward()
            opt.step()
            moved[eps] = float(np.linalg.norm(w.numpy()))
        self.assertGreater(moved[None], 1e-3, f"default floor: update norm {moved[None]:.2e}")
        self.assertLess(moved[1.0], moved[None] * 1e-2,
                        f"adam_epsilon=1.0 must floor the Newton-Schulz norm: update norm "
                        f"{moved[1.0]:.2e} vs {moved[None]:.2e} with the default")


if __name__ == "__main__":
    unittest.main()
