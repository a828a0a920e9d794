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
"""The float64 NumPy reference the Muon suites check against: develop's
Newton-Schulz coefficient tables typed in again from the specification, one
Newton-Schulz step loop, and the relative-error measure with its tolerance."""

import numpy as np

SIMPLE = [(3.4445, -4.7750, 2.0315)]
REF_PRESETS = {
    "simple": SIMPLE,
    "quintic": [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377),
                (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046),
                (2.8366, -3.0525, 1.2012)],
    "polar_express": [(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184),
                      (3.9096, -2.8234, 0.5250), (3.2856, -2.4153, 0.4853),
                      (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)],
    "aol": [(4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959),
            (2.7573, -3.2939, 1.4254), (2.7215, -3.0494, 1.3169)],
    "deepseekv4": [(3.4445, -4.7750, 2.0315)] * 8 + [(2.0, -1.5, 0.5)] * 2,
}

# Tolerance of every fp32-vs-float64 comparison, relative to the largest
# entry of the reference (the bound). Newton-Schulz runs <= 10 steps
# of products of normalised matrices (entries <= 1, dot products of <= 40
# terms), each adding ~1e-7 relative error that the large coefficients of
# the first steps (aol, polar_express: |b| up to 23) amplify: measured
# 1e-7..7e-6 (aol, printed at the end of the run), while a wrong
# coefficient, scale or formula moves results by >= 1e-3.
RTOL = 1e-5


def ns_ref(x, coeffs, steps, eps=1e-9):
    """Newton-Schulz, one matrix at a time (3-D: a loop over experts)."""
    x = np.asarray(x, np.float64)
    if x.ndim == 3:
        return np.stack([ns_ref(e, coeffs, steps, eps) for e in x])
    swap = x.shape[0] > x.shape[1]
    if swap:
        x = x.T
    x = x / max(np.sqrt(np.sum(x * x)), eps)
    for i in range(steps):
        a, b, c = coeffs[i % len(coeffs)]
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if swap else x


def max_rel(a, b):
    """max |a - b| / max |b|: relative to the tensor's scale."""
    b = np.asarray(b, np.float64)
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))
