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
"""Tests for paddle_muon_ext.optimizer.Muon against an independent float64
NumPy reference (Newton-Schulz, update scale, Muon step, AdamW step)."""

import math

import numpy as np
import paddle
import pytest
from paddle.utils import unique_name

from paddle_muon_ext.optimizer.muon import (
    Muon,
    MuonParamInfo,
    NS_COEFFS_PRESETS,
    muon_update_scale,
    newton_schulz,
)

SIMPLE = [(3.4445, -4.7750, 2.0315)]
LR = 0.02


# --------------------------------------------------------------------------
# NumPy float64 reference
# --------------------------------------------------------------------------
def ns_ref(x, coeffs, steps):
    """Newton-Schulz on one matrix, or a Python loop over the experts of a
    3-D stack (deliberately not batched, unlike the implementation)."""
    x = np.asarray(x, np.float64)
    if x.ndim == 3:
        return np.stack([ns_ref(e, coeffs, steps) for e in x])
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / (np.sqrt(np.sum(x * x)) + 1e-7)
    for i in range(steps):
        a, b, c = coeffs[i % len(coeffs)]
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if transposed else x


def scale_ref(shape, version, extra=0.2):
    din, dout = shape[-2], shape[-1]
    if version == 1:
        return math.sqrt(max(1.0, dout / din))
    if version == 2:
        return math.sqrt(dout / din)
    return extra * math.sqrt(max(din, dout))


class RefOptimizer:
    """Float64 Muon/AdamW reference keeping its own state per param name."""

    def __init__(self, lr=LR, momentum=0.95, nesterov=True, coeffs=SIMPLE,
                 ns_steps=5, version=1, extra=0.2, beta1=0.9, beta2=0.95,
                 eps=1e-8, wd=0.01, decay=lambda n: True):
        self.__dict__.update(locals())
        self.state = {}

    def step(self, name, w, g, use_muon, lr=None):
        lr = self.lr if lr is None else lr
        w = np.asarray(w, np.float64)
        g = np.asarray(g, np.float64)
        st = self.state.setdefault(name, {"m": np.zeros_like(w), "v": np.zeros_like(w), "t": 0})
        if self.decay(name):
            w = w * (1.0 - lr * self.wd)
        if use_muon:
            st["m"] = self.momentum * st["m"] + (1 - self.momentum) * g
            u = (1 - self.momentum) * g + self.momentum * st["m"] if self.nesterov else st["m"]
            o = ns_ref(u, self.coeffs, self.ns_steps)
            return w - lr * scale_ref(w.shape, self.version, self.extra) * o
        st["t"] += 1
        t = st["t"]
        st["m"] = self.beta1 * st["m"] + (1 - self.beta1) * g
        st["v"] = self.beta2 * st["v"] + (1 - self.beta2) * g * g
        mhat = st["m"] / (1 - self.beta1**t)
        vhat = st["v"] / (1 - self.beta2**t)
        return w - lr * mhat / (np.sqrt(vhat) + self.eps)


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
    """sum(C*W) + 0.5*sum(W*W): its gradient C + W is easy to mirror in NumPy
    and changes with W, so multi-step trajectories are meaningful."""
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
        values = [
            ref.step(n, w, c + w, um, lr=lr)
            for n, w, c, um in zip(names, values, consts, use_muon)
        ]
    return values


def max_rel(a, b):
    """max |a - b| / max |b|: relative to the tensor's scale, so that entries
    near zero do not blow the ratio up."""
    b = np.asarray(b, np.float64)
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def rng_arrays(seed, *shapes, scale=1.0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(s) * scale).astype(np.float32) for s in shapes]


# --------------------------------------------------------------------------
# Newton-Schulz and scale
# --------------------------------------------------------------------------
# fp32 NS vs float64: 5 iterations of products of normalised matrices with
# <= 64-term dot products; measured ~1e-6, 1e-5 leaves a margin.
NS_RTOL = 1e-5


@pytest.mark.parametrize("shape", [(16, 40), (40, 16), (3, 24, 10), (3, 10, 24)])
def test_newton_schulz_matches_reference(shape):
    (x,) = rng_arrays(1, shape)
    out = newton_schulz(paddle.to_tensor(x), SIMPLE, 5)
    assert out.dtype == paddle.float32 and list(out.shape) == list(shape)
    assert max_rel(out.numpy(), ns_ref(x, SIMPLE, 5)) < NS_RTOL


def test_newton_schulz_3d_is_per_expert_and_casts_bf16():
    (x,) = rng_arrays(2, (4, 12, 20))
    x[1] *= 100.0  # per-expert normalisation: a big expert must not shrink the others
    batched = newton_schulz(paddle.to_tensor(x), SIMPLE, 5).numpy()
    for e in range(4):
        single = newton_schulz(paddle.to_tensor(x[e]), SIMPLE, 5).numpy()
        # same fp32 arithmetic per matrix; only BLAS blocking may differ
        np.testing.assert_allclose(batched[e], single, rtol=0, atol=1e-6)
    xb = paddle.to_tensor(x[0]).astype("bfloat16")
    out = newton_schulz(xb, SIMPLE, 5)
    assert out.dtype == paddle.float32
    ref = ns_ref(bf16_round(x[0]), SIMPLE, 5)
    assert max_rel(out.numpy(), ref) < NS_RTOL


def test_newton_schulz_custom_coeffs_cycle():
    # deliberately non-convergent mixes, so the order of use shows in the output
    coeffs = [SIMPLE[0], (1.0, 0.5, 0.0), (0.5, 0.0, 0.0)]
    (x,) = rng_arrays(3, (20, 12))
    out = newton_schulz(paddle.to_tensor(x), coeffs, 7).numpy()
    assert max_rel(out, ns_ref(x, coeffs, 7)) < NS_RTOL
    # first-coefficient-only, or a different order, is measurably different
    assert max_rel(out, ns_ref(x, coeffs[:1], 7)) > 1e-2
    assert max_rel(out, ns_ref(x, coeffs[::-1], 7)) > 1e-2


def test_quintic_preset_orthogonalises():
    (x,) = rng_arrays(4, (16, 48))  # Gaussian 16x48: well conditioned
    out = newton_schulz(paddle.to_tensor(x), NS_COEFFS_PRESETS["quintic"], 25).numpy()
    # the classical iteration converges to the polar factor: O O^T = I up to fp32
    np.testing.assert_allclose(out @ out.T, np.eye(16), atol=1e-4)
    u, _, vt = np.linalg.svd(x.astype(np.float64), full_matrices=False)
    np.testing.assert_allclose(out, u @ vt, atol=1e-4)


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (4, 48, 16), (4, 16, 48)])
@pytest.mark.parametrize("version", [1, 2, 3])
def test_update_scale(shape, version):
    assert muon_update_scale(shape, version, 0.3) == pytest.approx(
        scale_ref(shape, version, 0.3), rel=1e-12
    )


# --------------------------------------------------------------------------
# One step of every branch
# --------------------------------------------------------------------------
# One fp32 step against float64: NS error (~1e-6 of |O|) times lr*scale is
# far below fp32 rounding of |W| ~ 1, so 1e-5 of the tensor scale is ample.
STEP_RTOL = 1e-5


def run_one_config(shapes, names, opt_kwargs, ref_kwargs, use_muon, steps=1, seed=0):
    values = rng_arrays(seed, *shapes, scale=0.5)
    consts = rng_arrays(seed + 100, *shapes)
    with unique_name.guard():
        params = [make_param(n, v) for n, v in zip(names, values)]
        opt = Muon(learning_rate=LR, parameters=params, **opt_kwargs)
        train(opt, params, consts, steps)
    ref = ref_train(RefOptimizer(**ref_kwargs), names, values, consts, use_muon, steps)
    for p, r in zip(params, ref):
        assert max_rel(to_np(p), r) < STEP_RTOL, p.name
    return opt, params


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (3, 20, 12)])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_step_orientation_and_nesterov(shape, nesterov):
    run_one_config([shape], ["w"], dict(nesterov=nesterov),
                   dict(nesterov=nesterov), [True], steps=2)


@pytest.mark.parametrize("version", [1, 2, 3])
def test_muon_step_scale_versions(version):
    shapes = [(20, 40), (40, 20), (2, 12, 30)]
    run_one_config(shapes, ["a", "b", "c"],
                   dict(muon_version=version, muon_extra_scale_factor=0.3),
                   dict(version=version, extra=0.3), [True] * 3)


def test_decay_selection_both_branches():
    decay = lambda n: n.startswith("decay")  # noqa: E731
    names = ["decay_w", "nodecay_w", "decay_b", "nodecay_b"]
    shapes = [(16, 24), (16, 24), (24,), (24,)]
    # wd=0.5 makes the decay term visible above the tolerance
    run_one_config(shapes, names, dict(weight_decay=0.5, apply_decay_param_fun=decay),
                   dict(wd=0.5, decay=decay), [True, True, False, False], steps=2)


def test_exclude_patterns_route_to_adamw_case_insensitive():
    names = ["Embedding_table", "LM_Head.w", "proj.w", "proj.b"]
    shapes = [(30, 16), (16, 30), (16, 16), (16,)]
    opt, _ = run_one_config(shapes, names,
                            dict(muon_exclude_patterns=["embedding", "lm_HEAD"]),
                            {}, [False, False, True, False], steps=2)
    assert {k: v.use_muon for k, v in opt._muon_param_info_map.items()} == {
        "Embedding_table": False, "LM_Head.w": False, "proj.w": True, "proj.b": False}
    sd = opt.state_dict()
    assert "proj.w_muon_momentum_0" in sd and "Embedding_table_moment1_0" in sd
    assert "Embedding_table_muon_momentum_0" not in sd


def test_explicit_param_info_map_overrides_rule():
    info = {"w_adam": MuonParamInfo(use_muon=False),
            "emb_muon": MuonParamInfo(use_muon=True)}
    opt, _ = run_one_config([(16, 24), (24, 16), (16, 16)], ["w_adam", "emb_muon", "w"],
                            dict(muon_exclude_patterns=["emb"], muon_param_info_map=info),
                            {}, [False, True, True], steps=2)
    assert opt._muon_param_info_map["w"].use_muon is True


def test_per_param_lr_and_replaced_grad_clip():
    values = rng_arrays(5, (16, 24), (24,), scale=0.5)
    consts = rng_arrays(6, (16, 24), (24,))
    seen = []

    class NegateClip(paddle.nn.ClipGradByGlobalNorm):
        # A wrapper (e.g. HybridParallelClipGrad) swaps _grad_clip after
        # construction; negating grads makes its use visible in the result.
        def __call__(self, params_grads):
            seen.append([p.name for p, _ in params_grads])
            return [(p, -g) for p, g in params_grads]

    with unique_name.guard():
        params = [make_param("w", values[0]), make_param("b", values[1])]
        params[0].optimize_attr["learning_rate"] = 0.5
        opt = Muon(learning_rate=LR, parameters=params)
        opt._grad_clip = NegateClip(1.0)
        quad_loss(params, consts).backward()
        opt.step()
    ref = RefOptimizer()
    r_w = ref.step("w", values[0], -(consts[0] + values[0]), True, lr=LR * 0.5)
    r_b = ref.step("b", values[1], -(consts[1] + values[1]), False)
    assert sorted(seen[0]) == ["b", "w"]
    assert max_rel(params[0].numpy(), r_w) < STEP_RTOL
    assert max_rel(params[1].numpy(), r_b) < STEP_RTOL


def test_minimize_matches_step():
    values = rng_arrays(7, (16, 24), (24,), scale=0.5)
    consts = rng_arrays(8, (16, 24), (24,))
    results = []
    for use_minimize in (False, True):
        with unique_name.guard():
            params = [make_param("w", values[0]), make_param("b", values[1])]
            opt = Muon(learning_rate=LR, parameters=params)
            loss = quad_loss(params, consts)
            loss.backward()
            if use_minimize:
                opt.minimize(loss)
            else:
                opt.step()
            opt.clear_grad()
            assert all(p.grad is None or not np.any(p.grad.numpy()) for p in params)
            results.append([p.numpy() for p in params])
    for a, b in zip(*results):
        assert np.array_equal(a, b)


# --------------------------------------------------------------------------
# Done criterion: 3-step runs
# --------------------------------------------------------------------------
def test_three_step_muon_matches_numpy(capsys):
    shapes = [(64, 32), (4, 48, 16)]
    values = rng_arrays(11, *shapes, scale=0.2)
    consts = rng_arrays(12, *shapes)
    with unique_name.guard():
        params = [make_param("dense.w", values[0]), make_param("experts.w", values[1])]
        opt = Muon(learning_rate=LR, parameters=params)
        train(opt, params, consts, 3)
    ref = ref_train(RefOptimizer(), ["dense.w", "experts.w"], values, consts, [True, True], 3)
    errs = [max_rel(to_np(p), r) for p, r in zip(params, ref)]
    # the same error measured on the accumulated update alone (stricter: the
    # update is ~10x smaller than the weights)
    upd_errs = [max_rel(to_np(p) - v, r - v) for p, r, v in zip(params, ref, values)]
    with capsys.disabled():
        print(f"\n[muon 3-step] max rel err vs numpy: params {max(errs):.3e}, "
              f"updates {max(upd_errs):.3e}")
    assert max(errs) <= 1e-5
    # fp32 rounding of W (|W|~0.5, eps 6e-8) is ~3e-8 absolute per step vs an
    # update of ~lr*scale*|O|~4e-3: ~1e-5 relative, plus NS error.
    assert max(upd_errs) <= 5e-5


def test_three_step_adamw_branch_matches_paddle_adamw(capsys):
    shapes = [(32,), (20, 12)]
    names = ["layer.bias", "token_EMB.w"]
    values = rng_arrays(13, *shapes, scale=0.5)
    consts = rng_arrays(14, *shapes)
    decay = lambda n: "bias" not in n  # noqa: E731
    kw = dict(weight_decay=0.1, apply_decay_param_fun=decay)
    with unique_name.guard():
        ours = [make_param(n, v) for n, v in zip(names, values)]
        opt = Muon(learning_rate=LR, parameters=ours, adam_beta1=0.85, adam_beta2=0.97,
                   adam_epsilon=1e-6, muon_exclude_patterns=["emb"], **kw)
        train(opt, ours, consts, 3)
    with unique_name.guard():
        theirs = [make_param(n, v) for n, v in zip(names, values)]
        adamw = paddle.optimizer.AdamW(learning_rate=LR, parameters=theirs, beta1=0.85,
                                       beta2=0.97, epsilon=1e-6, **kw)
        train(adamw, theirs, consts, 3)
    err = max(float(np.max(np.abs(a.numpy() - b.numpy()))) for a, b in zip(ours, theirs))
    ref = ref_train(RefOptimizer(beta1=0.85, beta2=0.97, eps=1e-6, wd=0.1, decay=decay),
                    names, values, consts, [False, False], 3)
    ref_err = max(max_rel(p.numpy(), r) for p, r in zip(ours, ref))
    with capsys.disabled():
        print(f"\n[adamw 3-step] max abs err vs paddle AdamW: {err:.3e}; "
              f"max rel err vs numpy: {ref_err:.3e}")
    assert err <= 1e-6  # same kernel, same inputs: expected exactly 0
    assert ref_err < STEP_RTOL


def test_lr_scheduler():
    shapes = [(16, 24), (24,)]
    values = rng_arrays(15, *shapes, scale=0.5)
    consts = rng_arrays(16, *shapes)
    with unique_name.guard():
        params = [make_param("w", values[0]), make_param("b", values[1])]
        sched = paddle.optimizer.lr.StepDecay(learning_rate=0.05, step_size=1, gamma=0.5)
        opt = Muon(learning_rate=sched, parameters=params)
        train(opt, params, consts, 3, sched=sched)
    assert opt.get_lr() == pytest.approx(0.05 * 0.5**3)
    ref = ref_train(RefOptimizer(), ["w", "b"], values, consts, [True, False], 3,
                    lrs=[0.05, 0.025, 0.0125])
    for p, r in zip(params, ref):
        assert max_rel(p.numpy(), r) < STEP_RTOL


# --------------------------------------------------------------------------
# multi_precision (bf16)
# --------------------------------------------------------------------------
def test_multi_precision_bf16_master_weights():
    shapes = [(24, 16), (2, 12, 20), (16,)]
    names = ["w", "experts", "b"]
    values = [bf16_round(v) for v in rng_arrays(17, *shapes, scale=0.5)]
    consts = rng_arrays(18, *shapes)
    with unique_name.guard():
        params = [make_param(n, v, "bfloat16") for n, v in zip(names, values)]
        opt = Muon(learning_rate=LR, parameters=params, multi_precision=True)
        train(opt, params, consts, 3)
    assert set(opt._master_weights) == set(names)
    # Reference: the fp32 master trajectory, fed the gradient the bf16 model
    # really produces, i.e. C + W computed from the bf16 weights and rounded
    # to bf16. With the quantisation mirrored, the only gap left is fp32 vs
    # float64 arithmetic (plus rare double-rounding of a grad element).
    ref = RefOptimizer()
    masters = [np.asarray(v, np.float64) for v in values]
    for _ in range(3):
        grads = [bf16_round((c + bf16_round(w)).astype(np.float32))
                 for c, w in zip(consts, masters)]
        masters = [ref.step(n, w, g, um) for n, w, g, um in
                   zip(names, masters, grads, [True, True, False])]
    for p, r in zip(params, masters):
        master = opt._master_weights[p.name]
        assert master.dtype == paddle.float32 and p.dtype == paddle.bfloat16
        assert max_rel(master.numpy(), r) < STEP_RTOL  # measured ~1.5e-7
        # the bf16 param is exactly the cast of its master weight
        assert np.array_equal(to_np(p), to_np(paddle.cast(master, "bfloat16")))
        assert np.array_equal(to_np(p), bf16_round(master.numpy()))
    # a plain bf16 trajectory would have lost the sub-bf16 part of the updates
    assert any(not np.array_equal(m.numpy(), bf16_round(m.numpy()))
               for m in opt._master_weights.values())


# --------------------------------------------------------------------------
# state_dict round trip
# --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_state_dict_round_trip_bit_exact(tmp_path, dtype):
    shapes = [(24, 16), (2, 12, 20), (16,), (10, 8)]
    names = ["w", "experts", "b", "emb.w"]
    values = [bf16_round(v) for v in rng_arrays(19, *shapes, scale=0.5)]
    consts = rng_arrays(20, *shapes)
    mp = dtype == "bfloat16"

    def build():
        params = [make_param(n, v, dtype) for n, v in zip(names, values)]
        sched = paddle.optimizer.lr.StepDecay(learning_rate=0.03, step_size=2, gamma=0.7)
        opt = Muon(learning_rate=sched, parameters=params, multi_precision=mp,
                   muon_exclude_patterns=["emb"])
        return params, opt, sched

    with unique_name.guard():
        params, opt, sched = build()
        train(opt, params, consts, 5, sched)
        full = [to_np(p) for p in params]
        full_master = {k: v.numpy() for k, v in opt._master_weights.items()}

    with unique_name.guard():
        params, opt, sched = build()
        train(opt, params, consts, 3, sched)
        paddle.save(opt.state_dict(), str(tmp_path / "opt.pdopt"))
        paddle.save({p.name: p for p in params}, str(tmp_path / "model.pdparams"))
        # keep training the old copy: the saved state must not alias it
        train(opt, params, consts, 1, sched)

    with unique_name.guard():
        params, opt, sched = build()
        model_sd = paddle.load(str(tmp_path / "model.pdparams"))
        for p in params:
            p.set_value(model_sd[p.name])
        opt.set_state_dict(paddle.load(str(tmp_path / "opt.pdopt")))
        assert sched.last_epoch == 3
        train(opt, params, consts, 2, sched)
        resumed = [to_np(p) for p in params]
        resumed_master = {k: v.numpy() for k, v in opt._master_weights.items()}

    for a, b in zip(full, resumed):
        assert np.array_equal(a, b)
    assert set(full_master) == set(resumed_master) == (set(names) if mp else set())
    for k in full_master:
        assert np.array_equal(full_master[k], resumed_master[k])


# --------------------------------------------------------------------------
# What the sharding wrapper relies on
# --------------------------------------------------------------------------
def test_apply_optimize_subset_updates_only_subset():
    shapes = [(16, 24), (24,), (8, 8)]
    names = ["w", "b", "other"]
    values = rng_arrays(21, *shapes, scale=0.5)
    consts = rng_arrays(22, *shapes)
    with unique_name.guard():
        params = [make_param(n, v) for n, v in zip(names, values)]
        opt = Muon(learning_rate=LR, parameters=params)
        grads = [paddle.to_tensor(c + v) for c, v in zip(consts, values)]
        opt._apply_optimize(None, None, [(params[0], grads[0]), (params[1], grads[1])])
    ref = RefOptimizer()
    r_w = ref.step("w", values[0], consts[0] + values[0], True)
    r_b = ref.step("b", values[1], consts[1] + values[1], False)
    assert max_rel(params[0].numpy(), r_w) < STEP_RTOL
    assert max_rel(params[1].numpy(), r_b) < STEP_RTOL
    assert np.array_equal(params[2].numpy(), values[2])
    assert not any(k.startswith("other") for k in opt.state_dict())


@pytest.mark.parametrize("via_step", [False, True])
def test_slice_param_with_original_name_matches_full_update(via_step):
    full_val, row_val = rng_arrays(23, (12, 10), (7, 6), scale=0.5)
    g_full, g_row = rng_arrays(24, (12, 10), (7, 6))
    lo, hi = 17, 83  # a slice that straddles rows, as a flat shard does
    decay = lambda n: True  # noqa: E731

    def make_opt(params):
        return Muon(learning_rate=LR, parameters=params, weight_decay=0.1,
                    muon_exclude_patterns=["EMBED"], apply_decay_param_fun=decay)

    with unique_name.guard():
        full = make_param("embed.w", full_val)
        opt_full = make_opt([full])
        for _ in range(2):
            opt_full._apply_optimize(None, None, [(full, paddle.to_tensor(g_full))])

    with unique_name.guard():
        owner_view = make_param("embed.w", full_val)
        opt = make_opt([owner_view])  # the map is built from the whole param
        assert opt._muon_param_info_map["embed.w"].use_muon is False
        # a flat shard of the excluded matrix, carrying the matrix's name
        piece = make_param("embed.w.shard", full_val.reshape(-1)[lo:hi])
        piece.name = "embed.w"
        fresh_2d = make_param("fresh.w", row_val)  # not in the map: shape rule -> Muon
        fresh_1d = make_param("fresh.b", row_val[0])  # not in the map: shape rule -> AdamW
        opt._parameter_list = [piece, fresh_2d, fresh_1d]
        gs = [g_full.reshape(-1)[lo:hi], g_row, g_row[0]]
        for _ in range(2):
            if via_step:
                loss = sum(paddle.sum(paddle.to_tensor(g) * p)
                           for g, p in zip(gs, opt._parameter_list))
                loss.backward()
                opt.step()
                opt.clear_grad()
            else:
                opt._apply_optimize(None, None, [(p, paddle.to_tensor(g)) for p, g
                                                 in zip(opt._parameter_list, gs)])
    # element-wise kernel on the same values: bit-identical
    assert np.array_equal(piece.numpy(), full.numpy().reshape(-1)[lo:hi])
    assert np.array_equal(owner_view.numpy(), full_val)  # dropped from the list
    ref = RefOptimizer(wd=0.1)
    r2, r1 = row_val.astype(np.float64), row_val[0].astype(np.float64)
    for _ in range(2):
        r2 = ref.step("fresh.w", r2, g_row, True)
        r1 = ref.step("fresh.b", r1, g_row[0], False)
    assert max_rel(fresh_2d.numpy(), r2) < STEP_RTOL
    assert max_rel(fresh_1d.numpy(), r1) < STEP_RTOL
    assert "fresh.w_muon_momentum_0" in opt.state_dict()


def test_split_concat_func_orthogonalises_blocks():
    (val,) = rng_arrays(25, (16, 48), scale=0.5)
    (c,) = rng_arrays(26, (16, 48))

    def split_concat(update, orthogonalize):
        return paddle.concat([orthogonalize(b) for b in paddle.split(update, 3, axis=1)], axis=1)

    with unique_name.guard():
        p = make_param("qkv.w", val)
        opt = Muon(learning_rate=LR, parameters=[p], momentum=0.9,
                   muon_param_info_map={"qkv.w": MuonParamInfo(True, split_concat)})
        train(opt, [p], [c], 1)
    g = (c + val).astype(np.float64)
    u = 0.1 * g + 0.9 * (0.1 * g)  # nesterov, zero initial momentum
    o = np.concatenate([scale_ref(b.shape, 1) * ns_ref(b, SIMPLE, 5)
                        for b in np.split(u, 3, axis=1)], axis=1)
    assert max_rel(p.numpy(), val * (1 - LR * 0.01) - LR * o) < STEP_RTOL


# --------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------
def _p():
    with unique_name.guard():
        return [make_param("bad.w", np.ones((4, 4), np.float32))]


@pytest.mark.parametrize(
    "kwargs, exc, fragment",
    [
        (dict(ns_coeff_type="cubic"), ValueError, "valid types"),
        (dict(ns_coeff_type="custom"), ValueError, "non-empty ns_coeffs"),
        (dict(ns_coeff_type="custom", ns_coeffs=[]), ValueError, "non-empty ns_coeffs"),
        (dict(ns_coeff_type="custom", ns_coeffs=[(1.0, 2.0)]), ValueError, "(a, b, c)"),
        (dict(muon_version=4), ValueError, "valid versions"),
        (dict(momentum=1.0), ValueError, "momentum"),
        (dict(adam_beta1=-0.1), ValueError, "adam_beta1"),
        (dict(adam_beta2=1.0), ValueError, "adam_beta2"),
        (dict(adam_epsilon=-1.0), ValueError, "adam_epsilon"),
        (dict(weight_decay="0.1"), TypeError, "weight_decay"),
        (dict(ns_steps=0), ValueError, "ns_steps"),
        (dict(muon_param_info_map={"bad.w": True}), TypeError, "MuonParamInfo"),
    ],
)
def test_bad_inputs(kwargs, exc, fragment):
    with pytest.raises(exc) as info:
        Muon(learning_rate=LR, parameters=_p(), **kwargs)
    assert fragment in str(info.value)


def test_accepted_inputs():
    # a map entry for a param that was not passed in (e.g. one a wrapper
    # creates later) is kept; an int learning rate is accepted
    opt = Muon(learning_rate=1, parameters=_p(),
               muon_param_info_map={"later.w": MuonParamInfo(False)})
    assert opt.get_lr() == 1.0
    assert opt._muon_param_info_map["later.w"].use_muon is False
    assert opt._muon_param_info_map["bad.w"].use_muon is True
    with pytest.raises(AttributeError):  # dygraph optimizers need parameters
        Muon(learning_rate=LR, parameters=None)


def test_bad_function_inputs():
    x = paddle.ones([4, 4])
    with pytest.raises(ValueError, match="2-D or 3-D"):
        newton_schulz(paddle.ones([4]), SIMPLE, 5)
    with pytest.raises(ValueError, match="at least one"):
        newton_schulz(x, [], 5)
    with pytest.raises(ValueError, match="steps"):
        newton_schulz(x, SIMPLE, -1)
    with pytest.raises(ValueError, match="matrix shape"):
        muon_update_scale((4,), 1)


def test_bad_param_groups_and_1d_muon():
    with pytest.raises(TypeError, match="flat list"):
        Muon(learning_rate=LR, parameters=[{"params": _p()}])
    with unique_name.guard():
        b = make_param("bad.bias", np.ones((4,), np.float32))
    with pytest.raises(ValueError, match="2-D or 3-D"):
        Muon(learning_rate=LR, parameters=[b],
             muon_param_info_map={"bad.bias": MuonParamInfo(use_muon=True)})
    with pytest.raises(ValueError, match="valid versions"):
        muon_update_scale((4, 4), 7)


def test_step_time_errors():
    with unique_name.guard():
        w = make_param("w", np.ones((4, 6), np.float32))
        opt = Muon(learning_rate=LR, parameters=[w])
        # a 1-D tensor carrying a Muon matrix's name: slicing a Muon param is
        # a wrapper bug, never silently switched to AdamW
        piece = make_param("w.piece", np.ones((6,), np.float32))
        piece.name = "w"
        with pytest.raises(ValueError, match="whole 2-D or 3-D"):
            opt._apply_optimize(None, None, [(piece, paddle.ones([6]))])
        with pytest.raises(TypeError, match="parameter groups"):
            opt._apply_optimize(None, None, {"params": [(w, paddle.ones([4, 6]))],
                                             "grad_clip": None})
        bad = Muon(learning_rate=LR, parameters=[w], muon_param_info_map={
            "w": MuonParamInfo(True, lambda u, orth: orth(u)[:2])})
        with pytest.raises(ValueError, match="split_concat_func returned shape"):
            bad._apply_optimize(None, None, [(w, paddle.ones([4, 6]))])


def test_step_skips_frozen_and_gradless_and_uses_main_grad():
    values = rng_arrays(27, (8, 12), (12,), (12,), scale=0.5)
    with unique_name.guard():
        w, b, frozen = [make_param(n, v) for n, v in zip(["w", "b", "frozen"], values)]
        frozen.stop_gradient = True
        # no weight decay: the untouched params must stay bit-identical
        opt = Muon(learning_rate=LR, parameters=[w, b, frozen], weight_decay=0.0)
        g = rng_arrays(28, (8, 12))[0]
        w.main_grad = paddle.to_tensor(g)  # AMP-style fp32 master grad
        opt.step()
    ref = RefOptimizer(wd=0.0)
    assert max_rel(w.numpy(), ref.step("w", values[0], g, True)) < STEP_RTOL
    assert np.array_equal(b.numpy(), values[1])  # no grad: not updated
    assert np.array_equal(frozen.numpy(), values[2])
    assert set(opt.state_dict()) == {"w_muon_momentum_0"}


def test_custom_and_quintic_through_the_optimizer():
    for kind, coeffs in (("custom", [(2.0, -1.5, 0.5), SIMPLE[0]]),
                         ("quintic", NS_COEFFS_PRESETS["quintic"])):
        run_one_config([(16, 24)], ["w"],
                       dict(ns_coeff_type=kind, ns_coeffs=coeffs if kind == "custom" else None,
                            ns_steps=3),
                       dict(coeffs=coeffs, ns_steps=3), [True])


def test_low_precision_adamw_dispatch_on_accelerators(mocker):
    # The fused fp16/bf16 adamw kernel exists only on GPU/XPU; on those
    # places the master weight is handed to it with multi_precision=True.
    with unique_name.guard():
        b = make_param("b", np.ones((8,), np.float32), "bfloat16")
        opt = Muon(learning_rate=LR, parameters=[b], multi_precision=True)
        assert Muon._has_low_precision_adamw_kernel(b) is False  # CPU
        mocker.patch.object(Muon, "_has_low_precision_adamw_kernel", return_value=True)
        kernel = mocker.patch.object(Muon, "_adamw_kernel")
        opt._apply_optimize(None, None, [(b, paddle.ones([8]).astype("bfloat16"))])
    (args, _), = kernel.call_args_list
    param, _, _, _, master, find_master, with_decay = args
    assert param is b and master is opt._master_weights["b"]
    assert find_master is True and with_decay is True
