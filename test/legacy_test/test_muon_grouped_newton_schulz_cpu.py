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
# paddle_muon_ext: compat-only  (package-only Muon code: develop's muon.py stays; not exported)
"""Grouped Newton-Schulz on a CPU place: develop's batches cut into chunks.

``Muon.update_params`` stacks same-key matrices into one batched
Newton-Schulz (develop); on a CPU place this package cuts each batch into
consecutive chunks of at most ``ns_cpu_chunk_bytes`` (4 bytes/element),
which measured faster there (docs/PERFORMANCE.md). The chunks must change
nothing but the batch sizes: every matrix's update equals a float64 NumPy
Newton-Schulz reference, the per-matrix path and develop's one batch within
fp32 rounding.
"""

from __future__ import annotations

import math
import unittest
from unittest import mock

import numpy as np
import paddle
from paddle.utils import unique_name

from paddle_muon_ext.optimizer.muon import Muon, MuonParamInfo

SIMPLE = (3.4445, -4.7750, 2.0315)  # develop's "simple" (a, b, c)
NS_STEPS = 5
EXTRA_SCALE = 0.2  # muon_extra_scale_factor default
# Three Muon keys: 2-D wide [24, 40] (3,840 bytes at 4 bytes/element), 2-D
# tall [40, 24] (same bytes) and 3-D expert stacks [2, 12, 20] (1,920 bytes).
SHAPES = [(24, 40)] * 7 + [(40, 24)] * 4 + [(2, 12, 20)] * 5
CHUNK = 8000  # two 2-D matrices or four 3-D stacks per chunk


def ns_reference(g: np.ndarray) -> np.ndarray:
    """Newton-Schulz of one matrix in float64 (wide orientation, Frobenius-normalised)."""
    x = g.astype(np.float64)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / max(np.linalg.norm(x), 1e-9)
    a, b, c = SIMPLE
    for _ in range(NS_STEPS):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


def expected_update(g: np.ndarray) -> np.ndarray:
    """Muon's first-step direction for gradient ``g``: Newton-Schulz of the
    Nesterov momentum ((1 - beta)(1 + beta) g: a scalar multiple, which the
    normalisation removes) times develop's version-1 scale
    sqrt(max(1, dout / din)) and muon_extra_scale_factor."""
    din, dout = g.shape[-2], g.shape[-1]
    scale = math.sqrt(max(1.0, dout / din)) * EXTRA_SCALE
    if g.ndim == 3:
        return np.stack([ns_reference(m) for m in g]) * scale
    return ns_reference(g) * scale


def grads() -> list:
    rng = np.random.default_rng(29)
    return [rng.normal(0, 1, shape).astype("float32") for shape in SHAPES]


def one_step(**kwargs) -> tuple[list, list]:
    """One update_params of zero-initialised parameters, lr 1, no decay.

    A zero parameter after one step holds exactly ``-direction`` (fp32), so
    the result is the orthogonalised update itself.

    Returns:
        (parameter values after the step, the group sizes of every
        batched Newton-Schulz call).
    """
    sizes = []
    original = Muon._muon_update_group

    def spy(self, group_params_grads, *args, **kw):
        sizes.append((tuple(group_params_grads[0][0].shape), len(group_params_grads)))
        return original(self, group_params_grads, *args, **kw)

    with unique_name.guard(), mock.patch.object(Muon, "_muon_update_group", spy):
        params = [
            paddle.create_parameter(list(shape), "float32", name=f"w{i}",
                                    default_initializer=paddle.nn.initializer.Constant(0.0))
            for i, shape in enumerate(SHAPES)
        ]
        opt = Muon(learning_rate=1.0, parameters=params, weight_decay=0.0,
                   ns_matmul_dtype="float32",
                   muon_param_info_map={p.name: MuonParamInfo(use_muon=True) for p in params},
                   **kwargs)
        muon, adamw = opt.prepare_optimize(
            [(p, paddle.to_tensor(g)) for p, g in zip(params, grads())])
        opt.update_params(muon, adamw)
    return [p.numpy() for p in params], sizes


class TestCpuChunkedGroupedNewtonSchulz(unittest.TestCase):
    def setUp(self) -> None:
        paddle.set_device("cpu")

    def test_batches_are_cut_at_the_cpu_chunk_bytes(self) -> None:
        _, sizes = one_step(ns_cpu_chunk_bytes=CHUNK)
        self.assertEqual(sizes, [((24, 40), 2)] * 3 + [((24, 40), 1)]
                         + [((40, 24), 2)] * 2 + [((2, 12, 20), 4), ((2, 12, 20), 1)])

    def test_without_a_chunk_develops_batches_are_kept(self) -> None:
        for value in (0, None):
            with self.subTest(ns_cpu_chunk_bytes=value):
                _, sizes = one_step(ns_cpu_chunk_bytes=value)
                self.assertEqual(sizes, [((24, 40), 7), ((40, 24), 4), ((2, 12, 20), 5)])

    def test_default_chunk_keeps_small_matrices_in_one_batch(self) -> None:
        # 1 MiB holds every group here: the default changes nothing for them
        _, sizes = one_step()
        self.assertEqual(sizes, [((24, 40), 7), ((40, 24), 4), ((2, 12, 20), 5)])

    def test_matrix_larger_than_the_chunk_runs_alone(self) -> None:
        _, sizes = one_step(ns_cpu_chunk_bytes=100)
        self.assertEqual(sizes, [((24, 40), 1)] * 7 + [((40, 24), 1)] * 4
                         + [((2, 12, 20), 1)] * 5)

    def test_chunked_update_matches_the_float64_reference(self) -> None:
        values, _ = one_step(ns_cpu_chunk_bytes=CHUNK)
        for i, (got, g) in enumerate(zip(values, grads())):
            want = -expected_update(g)
            # fp32 bound: each of the 15 matmuls rounds at ~sqrt(40) * 6e-8
            # relative, and 5 steps amplify a perturbation by at most
            # max |p'(s)| ~ a = 3.4445 per step (3.4445**5 ~ 490): ~2e-4 of
            # the largest entry. Swapped or missing matrices are off by O(1).
            tol = 2e-4 * float(np.abs(want).max())
            err = float(np.abs(got.astype(np.float64) - want).max())
            self.assertLessEqual(err, tol, f"matrix {i} {SHAPES[i]}: {err:.2e} > {tol:.2e}")

    def test_chunked_equals_per_matrix_and_one_batch(self) -> None:
        chunked, _ = one_step(ns_cpu_chunk_bytes=CHUNK)
        for other in ({"ns_per_matrix": True}, {"ns_cpu_chunk_bytes": 0}):
            with self.subTest(**other):
                values, _ = one_step(**other)
                for i, (a, b) in enumerate(zip(chunked, values)):
                    # same fp32 Newton-Schulz per matrix; batched and 2-D
                    # GEMM kernels may sum in another order: a dot product
                    # of length <= 40 then differs by <= 40 * 6e-8 ~ 2.4e-6
                    # relative per matmul (1.0e-6 seen); 1e-5 leaves room
                    # for the 5 steps' gain and still sees any wrong matrix
                    rel = float(np.abs(a - b).max() / np.abs(b).max())
                    self.assertLessEqual(rel, 1e-5, f"matrix {i} {SHAPES[i]}: {rel:.2e}")

    def test_bad_chunk_bytes_are_refused(self) -> None:
        for value in (-1, 1.5, "1024", True):
            with self.subTest(value=value):
                with self.assertRaisesRegex(ValueError, "ns_cpu_chunk_bytes"):
                    Muon(parameters=[paddle.create_parameter([4, 4], "float32")],
                         muon_param_info_map={}, ns_cpu_chunk_bytes=value)


if __name__ == "__main__":
    unittest.main()
