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
# paddle_muon_ext: compat-only
# (package-only: Paddle develop's paddle.optimizer.muon has none of these
# names, so this module is not exported; exported code must not import it.)
"""Muon helpers of this package that Paddle develop does not have.

``paddle.optimizer.muon`` (``muon.py``) holds develop's names only, so that
code exported into a Paddle tree keeps working against develop's own
``muon.py``. These conveniences sit on top of develop's names
(``_NS_COEFFICIENT_SETS``, ``_default_should_use_muon``, ``MuonParamInfo``,
``Muon._zeropower_via_newtonschulz5``, ``Muon._scaling_fn``) and are
re-exported by ``paddle_muon_ext.optimizer``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

import paddle

from .muon import (
    _NS_COEFFICIENT_SETS,
    Muon,
    MuonParamInfo,
    MuonParamInfoMap,
    _check_ns_coeffs,
    _default_should_use_muon,
    _resolve_ns_coeffs,
)

if TYPE_CHECKING:
    from paddle import Tensor

__all__ = [
    "NS_COEFFS_PRESETS",
    "build_muon_param_info_map",
    "keep_whole",
    "muon_update_scale",
    "newton_schulz",
    "resolve_ns_coeffs",
]

# The name this package used before develop's; the same object.
NS_COEFFS_PRESETS = _NS_COEFFICIENT_SETS


def keep_whole(info: MuonParamInfo) -> bool:
    """Whether a sharded optimizer must keep the parameter whole on one rank.

    Muon and both hyperball updates need the whole matrix (orthogonalisation,
    the matrix norm); only plain AdamW is element-wise.

    Args:
        info (MuonParamInfo): The parameter's routing.

    Returns:
        bool: ``use_muon or use_hyperball``.
    """
    return bool(info.use_muon or getattr(info, "use_hyperball", False))


def build_muon_param_info_map(
    parameters: Sequence[Tensor], exclude_patterns: Sequence[str] = ()
) -> MuonParamInfoMap:
    """A ``muon_param_info_map`` entry for every parameter, by the default rule.

    ``MuonShardingOptimizer`` (like develop's) needs an entry for every
    trainable parameter; ``Muon`` alone falls back to the default rule.

    Args:
        parameters (Sequence[Tensor]): The parameters.
        exclude_patterns (Sequence[str]): As ``muon_exclude_patterns``.

    Returns:
        dict[str, MuonParamInfo]: name -> ``MuonParamInfo(use_muon=...)``.
    """
    patterns = list(exclude_patterns)
    out = {}
    for p in parameters:
        # expert stacks may be stored 2-D; the rule sees the shape they had
        shape = list(getattr(p, "original_shape", None) or p.shape)
        out[p.name] = MuonParamInfo(use_muon=_default_should_use_muon(p.name, shape, patterns))
    return out


# The package's old public name for the constructor's own table lookup (one
# implementation: the constructor's, with its AssertionErrors).
resolve_ns_coeffs = _resolve_ns_coeffs


def newton_schulz(
    x: Tensor,
    coeffs: Sequence[Sequence[float]],
    steps: int,
    eps: float = 1e-9,
    matmul_dtype: paddle.dtype = paddle.float32,
) -> Tensor:
    """Newton-Schulz orthogonalisation as a float32 result.

    ``Muon._zeropower_via_newtonschulz5`` (develop's; it returns the matmul
    dtype) followed by a cast to float32. A 3-D input ``[E, H, I]`` is ``E``
    independent matrices, processed in one batched computation.

    Args:
        x (Tensor): 2-D or 3-D tensor.
        coeffs (Sequence): ``[(a, b, c), ...]``; step ``i`` uses
            ``coeffs[i % len(coeffs)]``.
        steps (int): Number of iterations (>= 0).
        eps (float): Floor of the norm ``x`` is divided by (Muon's default
            ``adam_epsilon``).
        matmul_dtype (paddle.dtype): Dtype of the iteration's matmuls.

    Returns:
        Tensor: float32 tensor with the shape of ``x``.
    """
    if not coeffs:
        raise ValueError(
            "newton_schulz needs at least one (a, b, c) coefficient; pass e.g. "
            "NS_COEFFS_PRESETS['simple']."
        )
    _check_ns_coeffs(coeffs)
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"newton_schulz steps must be an int >= 0, got {steps!r}.")
    if steps < 0:
        raise ValueError(f"newton_schulz steps must be >= 0, got {steps}.")
    out = Muon._zeropower_via_newtonschulz5(x, steps, eps, coeffs, matmul_dtype)
    return out if out.dtype == paddle.float32 else paddle.cast(out, "float32")


def muon_update_scale(
    shape: Sequence[int], version: int = 1, extra_scale_factor: float = 0.2
) -> float:
    """Scale ``Muon._scaling_fn`` applies to the orthogonalised update of ``shape``.

    ``din, dout = shape[-2], shape[-1]``: version 1 ``sqrt(max(1, dout/din))``,
    version 2 ``sqrt(dout/din)``, any other ``sqrt(max(din, dout))``; times
    ``extra_scale_factor``.

    Args:
        shape (Sequence[int]): Matrix shape (2-D or 3-D).
        version (int): ``muon_version``.
        extra_scale_factor (float): ``muon_extra_scale_factor``.

    Returns:
        float: The scale.
    """
    if len(shape) < 2:
        raise ValueError(
            f"muon_update_scale needs a matrix shape (2-D or 3-D), got {list(shape)}."
        )
    din, dout = int(shape[-2]), int(shape[-1])
    if version == 1:
        scale = math.sqrt(max(1.0, dout / din))
    elif version == 2:
        scale = math.sqrt(dout / din)
    else:
        scale = math.sqrt(max(dout, din))
    return scale * float(extra_scale_factor)
