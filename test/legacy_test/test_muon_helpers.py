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
# paddle_muon_ext: compat-only  (tests of package-only Muon code; not exported)
"""The package's Muon helpers (paddle_muon_ext.optimizer.muon_helpers) and
the private ``Muon`` members develop's class lacks (``_fro``, the low-precision
AdamW dispatch).

Develop's ``paddle.optimizer.muon`` has none of these names, so neither the
module nor this test travels with the export; the exported Muon suite
(test_muon_optimizer.py) uses develop's names only.
"""

from __future__ import annotations

import math
import os
import sys
import unittest
from unittest import mock

import numpy as np
import paddle
from paddle.utils import unique_name

import paddle_muon_ext.optimizer as muon_optimizer
from paddle_muon_ext.optimizer import muon as muon_module
from paddle_muon_ext.optimizer.muon import Muon, MuonParamInfo
from paddle_muon_ext.optimizer.muon_helpers import (
    NS_COEFFS_PRESETS,
    build_muon_param_info_map,
    keep_whole,
    muon_update_scale,
    newton_schulz,
    resolve_ns_coeffs,
)

# The reference (develop's tables typed in again, float64 Newton-Schulz, the
# tolerance) is the exported Muon suite's; one copy of the specification.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from muon_optimizer_reference import REF_PRESETS, RTOL, SIMPLE, max_rel, ns_ref  # noqa: E402


def param(name, shape, original_shape=None):
    with unique_name.guard():
        p = paddle.create_parameter(list(shape), "float32", name=name)
    if original_shape is not None:
        p.original_shape = list(original_shape)
    return p


class TestMuonHelpers(unittest.TestCase):
    def test_package_reexports_the_helpers(self):
        for name in ("build_muon_param_info_map", "keep_whole", "newton_schulz",
                     "muon_update_scale", "resolve_ns_coeffs", "NS_COEFFS_PRESETS"):
            self.assertIn(name, muon_optimizer.__all__, name)
            self.assertFalse(hasattr(muon_module, name),
                             f"{name} is back in muon.py, which must hold develop's names only")
        self.assertIs(muon_optimizer.keep_whole, keep_whole)

    def test_presets_are_develops_tables(self):
        self.assertIs(NS_COEFFS_PRESETS, muon_module._NS_COEFFICIENT_SETS)
        self.assertEqual(list(NS_COEFFS_PRESETS), list(REF_PRESETS))
        for kind, table in REF_PRESETS.items():
            self.assertEqual([tuple(c) for c in NS_COEFFS_PRESETS[kind]], table, kind)
            self.assertEqual(resolve_ns_coeffs(kind), table, kind)

    def test_resolve_custom_and_errors(self):
        custom = [(2.0, -1.5, 0.5)]
        self.assertIs(resolve_ns_coeffs("custom", custom), custom)
        with self.assertRaisesRegex(AssertionError, "needs ns_coeffs"):
            resolve_ns_coeffs("custom")
        with self.assertRaisesRegex(AssertionError, "'cubic'.*'custom'"):
            resolve_ns_coeffs("cubic")

    def test_keep_whole(self):
        cases = {(True, False): True, (True, True): True, (False, True): True,
                 (False, False): False}
        for (use_muon, use_hyperball), expect in cases.items():
            info = MuonParamInfo(use_muon=use_muon, use_hyperball=use_hyperball)
            self.assertIs(keep_whole(info), expect, (use_muon, use_hyperball))

    def test_build_map_follows_develops_rule(self):
        ps = [param("w", (4, 6)), param("emb.w", (4, 6)), param("b", (6,)),
              param("experts", (8, 6), original_shape=(2, 4, 6)),
              param("flat", (24, 1), original_shape=(24,))]
        info = build_muon_param_info_map(ps, ["EMB"])
        self.assertEqual({k: (v.use_muon, v.use_hyperball) for k, v in info.items()},
                         {"w": (True, False), "emb.w": (False, False), "b": (False, False),
                          "experts": (True, False), "flat": (False, False)})
        # no patterns: every 2-D/3-D parameter on Muon
        self.assertTrue(build_muon_param_info_map(ps)["emb.w"].use_muon)

    def test_newton_schulz_matches_reference(self):
        rng = np.random.default_rng(5)
        for shape, coeffs, steps in (((20, 12), SIMPLE, 5), ((12, 20), REF_PRESETS["aol"], 6),
                                     ((3, 12, 8), SIMPLE, 5)):
            with self.subTest(shape=shape):
                x = rng.standard_normal(shape).astype(np.float32)
                out = newton_schulz(paddle.to_tensor(x), coeffs, steps)
                self.assertEqual(out.dtype, paddle.float32)
                self.assertLessEqual(max_rel(out.numpy(), ns_ref(x, coeffs, steps)), RTOL)
        # eps floors the norm: a tiny matrix is divided by eps, not by its norm
        x = np.full((4, 6), 1e-6 / math.sqrt(24), np.float32)
        out = newton_schulz(paddle.to_tensor(x), SIMPLE, 1, eps=1e-3).numpy()
        self.assertLessEqual(max_rel(out, ns_ref(x, SIMPLE, 1, eps=1e-3)), RTOL)

    def test_newton_schulz_casts_low_precision_back_to_float32(self):
        # steps=0 is normalise + cast: runs on CPU without bf16 matmul kernels
        x = np.arange(1.0, 13.0, dtype=np.float32).reshape(3, 4)
        out = newton_schulz(paddle.to_tensor(x), SIMPLE, 0, matmul_dtype=paddle.bfloat16)
        self.assertEqual(out.dtype, paddle.float32)
        # bf16 keeps 8 mantissa bits: relative error <= 2**-8
        np.testing.assert_allclose(out.numpy(), x / np.linalg.norm(x), rtol=2**-8)

    def test_newton_schulz_bad_inputs(self):
        x = paddle.ones([4, 4])
        with self.assertRaisesRegex(ValueError, "at least one"):
            newton_schulz(x, [], 5)
        with self.assertRaisesRegex(ValueError, "steps must be >= 0, got -1"):
            newton_schulz(x, SIMPLE, -1)
        with self.assertRaises(ValueError):
            newton_schulz(paddle.ones([4]), SIMPLE, 5)
        # bug: "not enough values to unpack" from inside the iteration
        with self.assertRaisesRegex(ValueError, r"ns_coeffs\[1\]=\(1.0, 2.0\) is not 3 finite"):
            newton_schulz(x, [SIMPLE[0], (1.0, 2.0)], 5)
        with self.assertRaisesRegex(ValueError, r"ns_coeffs\[0\]=\(nan, 0, 0\)"):
            newton_schulz(x, [(float("nan"), 0, 0)], 1)
        with self.assertRaisesRegex(TypeError, "steps must be an int >= 0, got True"):
            newton_schulz(x, SIMPLE, True)

    def test_update_scale_matches_formula_and_scaling_fn(self):
        for shape in ((64, 32), (32, 64), (4, 48, 16), (4, 16, 48)):
            din, dout = shape[-2], shape[-1]
            expect = {1: math.sqrt(max(1.0, dout / din)), 2: math.sqrt(dout / din),
                      3: math.sqrt(max(din, dout)), 7: math.sqrt(max(din, dout))}
            for version, scale in expect.items():
                with self.subTest(shape=shape, version=version):
                    got = muon_update_scale(shape, version, 0.3)
                    self.assertAlmostEqual(got, scale * 0.3, places=12)
                    applied = Muon._scaling_fn(paddle.ones(list(shape)), version, 0.3)
                    np.testing.assert_allclose(applied.numpy(), got, rtol=1e-6)
        self.assertAlmostEqual(muon_update_scale((8, 8)), 0.2, places=12,
                               msg="defaults: version 1, extra_scale_factor 0.2")
        with self.assertRaisesRegex(ValueError, r"matrix shape.*\[4\]"):
            muon_update_scale((4,), 1)

    def test_frobenius_helper_agrees_with_linalg_norm(self):
        # Muon._fro is this package's (develop's hyperball norm is inline)
        rng = np.random.default_rng(78)
        x = rng.standard_normal((3, 8, 12))
        for dtype, tol in (("float32", 1e-5), ("float64", 1e-12)):
            t = paddle.to_tensor(x.astype(dtype))
            ref = np.sqrt(np.sum(x.astype(dtype).astype(np.float64) ** 2, axis=(-2, -1),
                                 keepdims=True))
            np.testing.assert_allclose(Muon._fro(t).numpy(), ref, rtol=tol,
                                       err_msg=f"{dtype} Frobenius norm")


    def test_low_precision_adamw_dispatch_on_accelerators(self):
        # The fused fp16/bf16 adamw kernel exists only on GPU/XPU; there the
        # master weight is handed to it.
        with unique_name.guard():
            b = paddle.create_parameter([8], "bfloat16", name="b",
                                        default_initializer=paddle.nn.initializer.Constant(1.0))
            opt = Muon(0.1, [b], multi_precision=True, muon_exclude_patterns=[])
            self.assertFalse(Muon._has_low_precision_adamw_kernel(b), "CPU has no bf16 adamw")
            with mock.patch.object(Muon, "_has_low_precision_adamw_kernel", return_value=True), \
                    mock.patch.object(Muon, "_adamw_kernel") as kernel:
                opt._apply_optimize(None, None, [(b, paddle.ones([8]).astype("bfloat16"))])
        (args, _), = kernel.call_args_list
        param, _, _, _, master, weight_decay = args
        self.assertIs(param, b, "the kernel got another parameter")
        self.assertIs(master, opt._master_weights["b"], "the kernel did not get the master weight")
        self.assertEqual(weight_decay, 0.01)


if __name__ == "__main__":
    unittest.main()
