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
"""Muon optimizer (dygraph).

Matrix parameters (2-D, or 3-D ``[experts, H, I]`` stacks of expert matrices)
are updated with momentum followed by Newton-Schulz orthogonalisation; every
other parameter is updated with AdamW. Same constructor, numbers, accumulator
names and checkpoint keys as ``paddle.optimizer.Muon`` in Paddle develop,
including the grouped (batched) Newton-Schulz update, the staged API
(``apply_grad_clip`` / ``prepare_optimize`` / ``update_params``), symmetric
GEMM, hyperball (MuonH / AdamH) and ``muon_epsilon``.
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np
import paddle
from paddle import _C_ops
from paddle.base import framework
from paddle.base.dygraph import base as imperative_base
from paddle.optimizer.lr import LRScheduler
from paddle.optimizer.optimizer import Optimizer

if TYPE_CHECKING:
    from paddle import Tensor
    from paddle.nn.clip import GradientClipBase

# Only develop's names live here: the exported tests and modules import from
# develop's paddle.optimizer.muon. The package's extra helpers
# (build_muon_param_info_map, keep_whole, newton_schulz, ...) are in
# muon_helpers.py.
__all__ = [
    "Muon",
    "MuonParamInfo",
    "MuonParamInfoMap",
]

# The module logger under develop's module path (this module is
# paddle.optimizer.muon after patch_paddle() and in the exported patch), set
# up like Paddle's get_logger, once.
logger = logging.getLogger("paddle.optimizer.muon")
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(asctime)s-%(levelname)s: %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _int_env(name: str, default: int) -> int:
    # develop's int(); a malformed value says which variable and what is valid
    raw = os.environ.get(name, default)
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"{name}={raw!r} is not an integer; set it to 1 (skip the optimizer "
            "update) or 0 (the default), or unset it."
        ) from None


# Read once at import, as develop does.
MUON_DEBUG = os.environ.get("MUON_DEBUG", "0") == "1"
g_shard_bypass_dygraph_optimizer = _int_env("FLAGS_shard_bypass_dygraph_optimizer", 0)

NSCoeff = tuple[float, float, float]

_SIMPLE = (3.4445, -4.7750, 2.0315)

# (a, b, c) of X <- a*X + (b*A + c*A*A)*X with A = X*X^T; step i uses
# table[i % len(table)]. Develop's tables, keys in develop's order.
_NS_COEFFICIENT_SETS: dict[str, list[NSCoeff]] = {
    "simple": [_SIMPLE],
    "quintic": [
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ],
    "polar_express": [
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ],
    "aol": [
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ],
    # Meant for ns_steps=10: eight fast steps, then two that converge.
    "deepseekv4": [_SIMPLE] * 8 + [(2.0, -1.5, 0.5)] * 2,
}
# Muon's default adam_epsilon, also the floor of the Newton-Schulz norm.
_DEFAULT_EPSILON = 1e-9
# Develop's default muon_max_group_bytes: 2 GiB per batched Newton-Schulz.
_DEFAULT_MAX_GROUP_BYTES = 2 * 1024 * 1024 * 1024
# Develop sizes a group as if every element were fp32, whatever the dtype.
_GROUP_BYTES_PER_ELEMENT = 4
# Package addition: on a CPU place a batched Newton-Schulz is cut into chunks
# of at most this many bytes (same 4 bytes/element count), so one step's
# working set stays in a core's L2 (figures: docs/PERFORMANCE.md,
# bench_newton_schulz --grouped). Accelerators keep develop's grouping.
_CPU_NS_CHUNK_BYTES = 1024 * 1024
# Symmetric GEMM: develop's default thresholds, and the compute capability
# majors quack-kernels ships kernels for.
_SYRK_DEFAULT_MIN_SHORT_EDGE = 1024
_SYRK_DEFAULT_MIN_STEP_FLOPS = 2e11
_SYRK_CAPABILITY_MAJORS = (9, 10, 11)
# Read at call time (develop's tests patch it).
_SYRK_SUPPORTED_DTYPES = (paddle.bfloat16, paddle.float16)
# Floor of the norms the hyperball update divides by (UNCONFIRMED in
# develop: value and max-vs-add form; max keeps a zero update exactly w).
_HYPERBALL_EPS = 1e-12

# Optimizer state names as they appear in state_dict keys
# ("<param>_moment1_0"; "<param>_fp32_master_0_moment1_0" in checkpoints
# written by earlier versions of this package, which keyed on the master).
_STATE_KEY = re.compile(
    r"^(?P<param>.+?)(?:_fp32_master_0)?_(?P<state>(?:moment1|moment2|beta1_pow_acc|beta2_pow_acc)_\d+)$"
)
_LEGACY_MASTER_STATE_KEY = re.compile(
    r"^(?P<param>.+?)_fp32_master_0_(?P<state>(?:moment1|moment2|beta1_pow_acc|beta2_pow_acc)_\d+)$"
)


def _runs_of_at_most(params_grads: list, limit_bytes: float) -> Iterator[list]:
    """Consecutive runs of ``(param, grad)`` pairs of at most ``limit_bytes``
    (counted at ``_GROUP_BYTES_PER_ELEMENT``); a larger parameter runs alone.
    The one rule behind both ``muon_max_group_bytes`` and ``ns_cpu_chunk_bytes``."""
    current, size = [], 0
    for pg in params_grads:
        nbytes = math.prod(pg[0].shape) * _GROUP_BYTES_PER_ELEMENT
        if current and size + nbytes > limit_bytes:
            yield current
            current, size = [], 0
        current.append(pg)
        size += nbytes
    if current:
        yield current


@dataclass
class MuonParamInfo:
    """How Muon treats one parameter.

    ``use_muon`` / ``use_hyperball`` select one of four updates: Muon
    (True, False), MuonH (True, True), AdamH (False, True), AdamW (False,
    False). The hyperball variants keep each matrix's Frobenius norm (per
    expert for 3-D) and apply no weight decay.

    Args:
        use_muon (bool): Orthogonalised (Muon) direction, else Adam's.
        split_concat_func (Callable|None): For fused matrices (e.g. a QKV
            weight) whose blocks are orthogonalised separately. Called as
            ``split_concat_func(update, ortho_fn)``; ``update`` is the
            (possibly batched, 3-D) momentum update of the parameter's group.
        use_hyperball (bool): Hyperball (norm-preserving) update.
    """

    use_muon: bool = True
    split_concat_func: Callable[..., Any] | None = None
    use_hyperball: bool = False


MuonParamInfoMap = dict[str, MuonParamInfo]


def _default_should_use_muon(
    name: str, shape: Sequence[int], exclude_patterns: Sequence[str] | None
) -> bool:
    """Develop's routing rule: a 2-D/3-D parameter not matched by a pattern.

    Args:
        name (str): Parameter name.
        shape (Sequence[int]): Its (original) shape.
        exclude_patterns (Sequence[str]): Case-insensitive name substrings
            that route a matrix to AdamW.

    Returns:
        bool: True when the parameter should use Muon.
    """
    if exclude_patterns is None:
        raise ValueError(
            f"exclude_patterns is None for parameter {name!r}, which has no "
            "muon_param_info_map entry; pass Muon(muon_exclude_patterns=[...]) "
            "with the name substrings to keep on AdamW (e.g. ['embedding', "
            "'lm_head'], or [] to route every 2-D/3-D parameter to Muon), or a "
            "muon_param_info_map with an entry per parameter."
        )
    if len(shape) not in (2, 3):
        return False
    lowered = name.lower()
    return not any(str(pattern).lower() in lowered for pattern in exclude_patterns)


def _to_hashable(value: Any) -> Any:
    """Lists/tuples -> tuples and dicts -> sorted (key, value) tuples, recursively."""
    if isinstance(value, (list, tuple)):
        return tuple(_to_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _to_hashable(v)) for k, v in sorted(value.items()))
    return value


def _muon_shape(param: Tensor) -> list[int]:
    # Expert stacks may be stored 2-D; Muon sees the shape they had.
    original = getattr(param, "original_shape", None)
    return list(original) if original else list(param.shape)


def _resolve_ns_coeffs(
    ns_coeff_type: str, ns_coeffs: Sequence[Sequence[float]] | None = None
) -> list[NSCoeff]:
    """The Newton-Schulz table of a preset, or ``ns_coeffs`` for ``"custom"``.

    Raises AssertionError, as develop's constructor does, for ``"custom"``
    without ``ns_coeffs`` and for an unknown type.

    Args:
        ns_coeff_type (str): A key of ``_NS_COEFFICIENT_SETS`` or ``"custom"``.
        ns_coeffs (Sequence|None): ``[(a, b, c), ...]`` for ``"custom"``.

    Returns:
        list: ``ns_coeffs`` itself for ``"custom"``, else the preset table.
    """
    if ns_coeff_type == "custom":
        if ns_coeffs is None:
            raise AssertionError(
                "ns_coeff_type='custom' needs ns_coeffs, a list of (a, b, c) tuples."
            )
        return ns_coeffs
    if ns_coeff_type not in _NS_COEFFICIENT_SETS:
        raise AssertionError(
            f"Invalid ns_coeff_type {ns_coeff_type!r}; valid types: "
            f"{[*_NS_COEFFICIENT_SETS, 'custom']}."
        )
    return _NS_COEFFICIENT_SETS[ns_coeff_type]


def _device_capability() -> tuple[int, int]:
    # Looked up at call time: tests patch these paddle attributes.
    if paddle.is_compiled_with_cuda():
        major, minor = paddle.device.cuda.get_device_capability()
        return int(major), int(minor)
    return 0, 0


def _auto_ns_matmul_dtype() -> paddle.dtype:
    # bf16 tensor cores start at compute capability 8 (Ampere).
    try:
        major, _ = _device_capability()
    except (RuntimeError, ValueError, OSError):
        major = 0
    return paddle.bfloat16 if major >= 8 else paddle.float32


_NAMED_DTYPES = {
    "float32": paddle.float32,
    "bfloat16": paddle.bfloat16,
    "float16": paddle.float16,
    "float64": paddle.float64,
}


def _resolve_ns_matmul_dtype(value: str | paddle.dtype | None) -> paddle.dtype:
    if value is None:
        return _auto_ns_matmul_dtype()
    if isinstance(value, str):
        if value not in _NAMED_DTYPES:
            raise ValueError(
                f"Unknown ns_matmul_dtype {value!r}; use one of {list(_NAMED_DTYPES)} "
                "or None (bfloat16 on CUDA devices of compute capability >= 8, "
                "else float32)."
            )
        return _NAMED_DTYPES[value]
    if value not in _NAMED_DTYPES.values():
        raise ValueError(
            f"Unknown ns_matmul_dtype {value!r}; use one of {list(_NAMED_DTYPES)} or None."
        )
    return value


@functools.cache
def _load_symmetric_gemm() -> Callable[..., Any]:
    """quack-kernels' ``gemm_symmetric``, imported once (cached after success).

    Returns:
        Callable: ``gemm_symmetric(A, B, C=None, alpha=1.0, beta=1.0)`` with
        ``out = beta * C + alpha * (A @ B)``, exactly symmetric.
    """
    try:
        from quack.gemm_interface import gemm_symmetric
    except ImportError as err:
        raise RuntimeError(
            "use_symmetric_gemm=True needs the quack-kernels package "
            "(pip install quack-kernels, CUDA compute capability 9.x-11.x); "
            "or pass use_symmetric_gemm=False."
        ) from err
    return gemm_symmetric


def _symmetric_gemm_is_profitable(
    shape: Sequence[int],
    dtype: paddle.dtype,
    min_short_edge: int,
    min_step_flops: float,
) -> bool:
    """Whether one Newton-Schulz step on ``shape`` should use symmetric GEMM.

    Args:
        shape (Sequence[int]): ``[m, n]`` or ``[B, m, n]`` (either orientation).
        dtype (paddle.dtype): The matmul dtype.
        min_short_edge (int): Smallest ``min(m, n)`` worth it.
        min_step_flops (float): Smallest ``B * (4 m^2 n + 2 m^3)`` worth it.

    Returns:
        bool: True when the dtype is supported, both edges are multiples of
        8 (the kernel's alignment) and both thresholds are met.
    """
    if dtype not in _SYRK_SUPPORTED_DTYPES:
        return False
    m, n = sorted((int(shape[-2]), int(shape[-1])))
    if m < min_short_edge or m % 8 or n % 8:
        return False
    batch = int(shape[0]) if len(shape) == 3 else 1
    return batch * (4 * m * m * n + 2 * m**3) >= min_step_flops


def _call_symmetric_gemm(gemm, A, B, C=None, alpha=1.0, beta=1.0):
    # quack works on torch tensors: hand paddle's memory over by DLPack.
    if getattr(gemm, "__module__", "").startswith("quack"):  # pragma: no cover - CUDA + quack only
        import torch

        def to_torch(t):
            return torch.utils.dlpack.from_dlpack(paddle.utils.dlpack.to_dlpack(t.contiguous()))

        out = gemm(to_torch(A), to_torch(B), C=None if C is None else to_torch(C),
                   alpha=alpha, beta=beta)
        return paddle.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(out))
    if C is None:
        return gemm(A, B)
    # C positionally: quack's third parameter, whatever a substitute names it
    return gemm(A, B, C, alpha=alpha, beta=beta)


def _swap_last_two(x: Tensor) -> Tensor:
    perm = list(range(x.ndim))
    perm[-2], perm[-1] = perm[-1], perm[-2]
    return paddle.transpose(x, perm)


def _fro(x: Tensor) -> Tensor:
    """Frobenius norm over the last two axes, keepdim (per expert for 3-D)."""
    return paddle.sqrt(paddle.sum(x * x, axis=[-2, -1], keepdim=True))


def _version_scale(shape: Sequence[int], version: int) -> float:
    din, dout = int(shape[-2]), int(shape[-1])
    if version == 1:
        return math.sqrt(max(1.0, dout / din))
    if version == 2:
        return math.sqrt(dout / din)
    return math.sqrt(max(dout, din))


# --------------------------------------------------------- argument checks
# Checks develop's constructor does not make, run after develop's own (whose
# error types and order are kept). Each error is one line naming the
# argument, the value given and the valid range.


_FLOAT_DTYPES = (paddle.float16, paddle.bfloat16, paddle.float32, paddle.float64)


def _is_real(value: Any) -> bool:
    """A real number: Python/NumPy ints and floats, or a one-element float Tensor.

    bool is an int to Python, never a meaningful rate or count here.
    """
    if isinstance(value, (bool, np.bool_)):
        return False
    if isinstance(value, numbers.Real):
        return True
    return isinstance(value, paddle.Tensor) and value.size == 1 and value.dtype in _FLOAT_DTYPES


def _check_real(label: str, value: Any, low: float = 0.0, hint: str = "",
                positive: bool = False) -> None:
    """Refuse anything but a finite real number ``>= low`` (``> 0`` if ``positive``)."""
    bound = "> 0" if positive else f">= {low:g}"
    # a Tensor's repr spans lines; the error stays one line
    shown = " ".join(repr(value).split())
    if not _is_real(value):
        raise TypeError(
            f"Muon: {label}={shown} ({type(value).__name__}) is not a number; "
            f"pass a finite float {bound}{hint}."
        )
    number = float(value)
    if not math.isfinite(number) or number < low or (positive and number <= 0):
        raise ValueError(
            f"Muon: {label}={shown} is out of range; pass a finite float {bound}{hint}."
        )


def _check_flag(label: str, value: Any) -> None:
    """Refuse anything but True/False (0/1 ints are develop's truthiness too)."""
    if isinstance(value, (bool, np.bool_)) or (type(value) is int and value in (0, 1)):
        return
    raise TypeError(f"Muon: {label}={value!r} must be True or False.")


def _check_ns_coeffs(ns_coeffs: Any) -> None:
    """``ns_coeffs`` for ``"custom"``: a non-empty list of finite ``(a, b, c)``."""
    if isinstance(ns_coeffs, (str, bytes)) or not isinstance(ns_coeffs, Sequence):
        raise TypeError(
            f"Muon: ns_coeffs={ns_coeffs!r} must be a list of (a, b, c) tuples of "
            "finite floats, e.g. [(3.4445, -4.7750, 2.0315)]."
        )
    if len(ns_coeffs) == 0:
        raise ValueError(
            "Muon: ns_coeffs=[] has no coefficients; pass at least one (a, b, c) "
            "tuple of finite floats, e.g. [(3.4445, -4.7750, 2.0315)]."
        )
    for i, entry in enumerate(ns_coeffs):
        ok = (isinstance(entry, Sequence) and not isinstance(entry, (str, bytes))
              and len(entry) == 3
              and all(_is_real(v) and math.isfinite(float(v)) for v in entry))
        if not ok:
            raise ValueError(
                f"Muon: ns_coeffs[{i}]={entry!r} is not 3 finite numbers (a, b, c); "
                "every entry must be a tuple (a, b, c) of finite floats."
            )


def _check_parameter_list(parameters: Sequence[Any]) -> None:
    """Every entry a Tensor, each parameter (by name) at most once."""
    seen: set = set()
    for i, p in enumerate(parameters):
        if not isinstance(p, paddle.Tensor):
            raise TypeError(
                f"Muon: parameters[{i}] is a {type(p).__name__}, not a parameter; "
                "pass parameters=model.parameters()."
            )
        if not p.stop_gradient and p.dtype not in _FLOAT_DTYPES:
            raise TypeError(
                f"Muon: parameter {p.name!r} has dtype {p.dtype} and is trainable; Muon "
                "updates float16/bfloat16/float32/float64 parameters (set "
                "stop_gradient=True on it or leave it out)."
            )
        if p.name in seen:
            raise ValueError(
                f"Muon: parameter {p.name!r} is listed more than once in parameters "
                "(it would be updated once per listing); pass each parameter once, "
                "e.g. parameters=list(dict.fromkeys(params))."
            )
        seen.add(p.name)


def _check_arguments(learning_rate: Any, parameters: Sequence[Any], args: dict) -> None:
    """The package's checks of every constructor argument (after develop's).

    Args:
        learning_rate (Any): As given to the constructor.
        parameters (Sequence): The (already type-checked) parameter list.
        args (dict): The other constructor arguments by name.
    """
    if not isinstance(learning_rate, LRScheduler):
        _check_real("learning_rate", learning_rate, hint=" or an LRScheduler")
    _check_parameter_list(parameters)
    _check_real("weight_decay", args["weight_decay"])
    # Develop accepts 0 (its own check is ``adam_epsilon >= 0``), so 0 stays
    # accepted; it turns an exactly-zero gradient into 0 / 0 = NaN, so say so.
    _check_real("adam_epsilon", args["adam_epsilon"])
    if args["muon_epsilon"] is not None:
        _check_real("muon_epsilon", args["muon_epsilon"], hint=" or None (= adam_epsilon)")
    for label in ("adam_epsilon", "muon_epsilon"):
        if args[label] is not None and float(args[label]) == 0.0:
            logger.warning(
                "Muon: %s=0 turns an exactly-zero gradient into NaN (0 / 0); "
                "a small positive value such as 1e-9 avoids it.", label)
    _check_real("muon_extra_scale_factor", args["muon_extra_scale_factor"])
    if not isinstance(args["ns_steps"], int) or isinstance(args["ns_steps"], bool):
        raise TypeError(
            f"Muon: ns_steps={args['ns_steps']!r} must be an int >= 0 (not a bool)."
        )
    if args["ns_coeff_type"] == "custom":
        _check_ns_coeffs(args["ns_coeffs"])
    version = args["muon_version"]
    if not isinstance(version, int) or isinstance(version, bool):
        raise TypeError(
            f"Muon: muon_version={version!r} must be an int (1, 2, or any other "
            "for sqrt(max(dout, din)))."
        )
    max_bytes = args["muon_max_group_bytes"]
    if max_bytes is not None:
        _check_real("muon_max_group_bytes", max_bytes, hint=" (None or 0: no limit)")
    patterns = args["muon_exclude_patterns"]
    if patterns is not None and (isinstance(patterns, (str, bytes))
                                 or not isinstance(patterns, (list, tuple, set, frozenset))):
        raise TypeError(
            f"Muon: muon_exclude_patterns={patterns!r} must be a list of name "
            "substrings (e.g. ['embedding', 'lm_head']) or None."
        )
    info_map = args["muon_param_info_map"]
    if info_map is not None and not isinstance(info_map, dict):
        raise TypeError(
            f"Muon: muon_param_info_map must be a dict name -> MuonParamInfo or None, "
            f"got {type(info_map).__name__}."
        )
    fun = args["apply_decay_param_fun"]
    if fun is not None and not callable(fun):
        raise TypeError(
            f"Muon: apply_decay_param_fun={fun!r} must be a callable name -> bool or None."
        )
    for label in ("nesterov", "multi_precision", "use_symmetric_gemm"):
        _check_flag(label, args[label])
    if args["name"] is not None and not isinstance(args["name"], str):
        raise TypeError(f"Muon: name={args['name']!r} must be a str or None.")


class Muon(Optimizer):
    r"""
    Muon (MomentUm Orthogonalized by Newton-Schulz) with an AdamW fallback.

    Each parameter takes one of four updates, from its ``muon_param_info_map``
    entry (``use_muon``, ``use_hyperball``) or, without one, from the default
    rule (2-D, or 3-D ``[E, H, I]`` expert stacks, whose name matches none of
    ``muon_exclude_patterns``; a warning names the parameter each step). For
    a Muon parameter with gradient ``g`` and fp32 momentum ``m``
    (accumulator ``moment1``):

    .. math::

        m &= m + (1 - \beta)(g - m) \\
        u &= g + \beta (m - g) \ \text{(nesterov) or } u = m \\
        p &= p (1 - lr \cdot wd) - lr \cdot s \cdot NS(u)

    with ``s`` from :meth:`_scaling_fn`. Matrices with the same
    :meth:`muon_group_key` are orthogonalised together in one batched
    Newton-Schulz (at most ``muon_max_group_bytes`` per batch). AdamW
    parameters use Paddle's fused AdamW kernel. MuonH / AdamH (hyperball)
    move along the Muon / Adam direction on the sphere of the matrix's
    current Frobenius norm, without weight decay.

    Args:
        learning_rate (float|LRScheduler, optional): Default 0.02.
        parameters (list[Tensor]): Flat list of parameters (no groups).
        momentum (float, optional): Muon momentum ``beta``. Default 0.95.
        adam_beta1 (float, optional): Default 0.9.
        adam_beta2 (float, optional): Default 0.95.
        weight_decay (float, optional): Decoupled weight decay, Muon and
            AdamW paths. Default 0.01.
        ns_steps (int, optional): Newton-Schulz iterations. Default 5.
        ns_coeff_type (str, optional): A key of ``_NS_COEFFICIENT_SETS`` or
            ``"custom"``. Default ``"simple"``.
        ns_coeffs (list[tuple]|None, optional): ``[(a, b, c), ...]`` for
            ``"custom"``.
        nesterov (bool, optional): Default True.
        adam_epsilon (float, optional): AdamW/AdamH epsilon; also the
            Newton-Schulz norm floor when ``muon_epsilon`` is None. Default 1e-9.
        grad_clip (GradientClipBase|None, optional): Gradient clipping.
        lr_ratio (Callable|None, optional): ``param -> float`` multiplying the
            learning rate of that parameter (every update).
        apply_decay_param_fun (Callable|None, optional): ``name -> bool``;
            False turns weight decay off for that parameter.
        muon_version (int, optional): Scale rule, see
            :meth:`_scaling_fn`. Default 1.
        muon_exclude_patterns (list[str]|None, optional): Case-insensitive
            name substrings kept on AdamW by the default rule. None: every
            parameter needs a ``muon_param_info_map`` entry.
        muon_extra_scale_factor (float, optional): Default 0.2.
        muon_param_info_map (dict[str, MuonParamInfo]|None, optional): Per
            parameter routing.
        ns_matmul_dtype (paddle.dtype|str|None, optional): Dtype of the
            Newton-Schulz matmuls (and of its result); None: bfloat16 on CUDA
            devices of compute capability >= 8, else float32.
        multi_precision (bool, optional): fp32 master weights for fp16/bf16
            parameters. Default False.
        name (str|None, optional): Prefix of the accumulator names.
        muon_max_group_bytes (int|None, optional): Largest batched
            Newton-Schulz, counted as 4 bytes per element; None or 0: no
            limit. Default 2 GiB. On a CPU place each batch is further cut
            into chunks of at most ``ns_cpu_chunk_bytes`` (keyword, package
            addition, default 1 MiB; None or 0: no cut), which measured
            faster there than one large batch.
        use_symmetric_gemm (bool, optional): Symmetric GEMM (quack-kernels)
            for the two symmetric products of each step where
            profitable; needs bf16/fp16 matmuls on a CUDA device of compute
            capability 9.x-11.x. Default False.
        symmetric_gemm_min_short_edge (int, optional): Default 1024.
        symmetric_gemm_min_step_flops (float, optional): Default 2e11.
        muon_epsilon (float|None, optional): Newton-Schulz norm floor; None:
            ``adam_epsilon``.

    Examples:
        .. code-block:: python

            >>> import paddle
            >>> from paddle_muon_ext.optimizer import Muon
            >>> linear = paddle.nn.Linear(16, 8)
            >>> opt = Muon(parameters=linear.parameters(), muon_exclude_patterns=[])
            >>> loss = linear(paddle.rand([4, 16])).mean()
            >>> loss.backward()
            >>> opt.step()
            >>> opt.clear_grad()
    """

    type = "muon"
    _moment_acc_str = "moment1"
    _moment2_acc_str = "moment2"
    _beta1_pow_acc_str = "beta1_pow_acc"
    _beta2_pow_acc_str = "beta2_pow_acc"

    def __init__(
        self,
        learning_rate: float | LRScheduler = 0.02,
        parameters: Sequence[Tensor] | None = None,
        momentum: float = 0.95,
        adam_beta1: float = 0.9,
        adam_beta2: float = 0.95,
        weight_decay: float = 0.01,
        ns_steps: int = 5,
        ns_coeff_type: str = "simple",
        ns_coeffs: Sequence[Sequence[float]] | None = None,
        nesterov: bool = True,
        adam_epsilon: float = _DEFAULT_EPSILON,
        grad_clip: GradientClipBase | None = None,
        lr_ratio: Callable[[Tensor], float] | None = None,
        apply_decay_param_fun: Callable[[str], bool] | None = None,
        muon_version: int = 1,
        muon_exclude_patterns: Sequence[str] | None = None,
        muon_extra_scale_factor: float = 0.2,
        muon_param_info_map: MuonParamInfoMap | None = None,
        ns_matmul_dtype: str | paddle.dtype | None = None,
        multi_precision: bool = False,
        name: str | None = None,
        muon_max_group_bytes: int | None = _DEFAULT_MAX_GROUP_BYTES,
        use_symmetric_gemm: bool = False,
        symmetric_gemm_min_short_edge: int = _SYRK_DEFAULT_MIN_SHORT_EDGE,
        symmetric_gemm_min_step_flops: float = _SYRK_DEFAULT_MIN_STEP_FLOPS,
        muon_epsilon: float | None = None,
        **kwargs: Any,
    ) -> None:
        self._check_parameters(parameters, grad_clip)
        ns_table = _resolve_ns_coeffs(ns_coeff_type, ns_coeffs)
        ns_dtype = _resolve_ns_matmul_dtype(ns_matmul_dtype)
        if use_symmetric_gemm:
            self._check_symmetric_gemm(
                ns_dtype, symmetric_gemm_min_short_edge, symmetric_gemm_min_step_flops
            )
        self._check_values(momentum, adam_beta1, adam_beta2, adam_epsilon,
                           weight_decay, ns_steps, lr_ratio)
        _check_arguments(learning_rate, parameters, {
            "momentum": momentum, "adam_beta1": adam_beta1, "adam_beta2": adam_beta2,
            "weight_decay": weight_decay, "adam_epsilon": adam_epsilon,
            "muon_epsilon": muon_epsilon, "ns_steps": ns_steps,
            "ns_coeff_type": ns_coeff_type, "ns_coeffs": ns_coeffs,
            "muon_extra_scale_factor": muon_extra_scale_factor,
            "muon_version": muon_version, "muon_max_group_bytes": muon_max_group_bytes,
            "muon_exclude_patterns": muon_exclude_patterns,
            "muon_param_info_map": muon_param_info_map,
            "apply_decay_param_fun": apply_decay_param_fun, "nesterov": nesterov,
            "multi_precision": multi_precision, "use_symmetric_gemm": use_symmetric_gemm,
            "name": name,
        })
        # An option of develop's FSDP Muon (PR #79781); anything else unknown
        # is named, never dropped silently.
        self._ns_per_matrix = bool(kwargs.pop("ns_per_matrix", False))
        # Package option (not develop's): the CPU chunk of a batched
        # Newton-Schulz in bytes; None or 0: develop's grouping on CPU too.
        self._ns_cpu_chunk_bytes = kwargs.pop("ns_cpu_chunk_bytes", _CPU_NS_CHUNK_BYTES)
        if self._ns_cpu_chunk_bytes is not None and (
            isinstance(self._ns_cpu_chunk_bytes, bool)
            or not isinstance(self._ns_cpu_chunk_bytes, int)
            or self._ns_cpu_chunk_bytes < 0
        ):
            raise ValueError(
                f"Muon ns_cpu_chunk_bytes must be an int >= 0 or None (0/None: one "
                f"batch per group on CPU as well), got {self._ns_cpu_chunk_bytes!r}."
            )
        if kwargs:
            logger.warning(f"Muon ignores the keyword arguments {sorted(kwargs)}.")
        if isinstance(learning_rate, int):
            learning_rate = float(learning_rate)
        # weight_decay=None: decay is decoupled and applied in the update
        # itself, so the base class must not add L2 regularisation to grads.
        super().__init__(
            learning_rate=learning_rate,
            parameters=parameters,
            weight_decay=None,
            grad_clip=grad_clip,
            name=name,
        )
        self.type = "muon"
        self._multi_precision = multi_precision
        self._master_weights = {}
        self._lr_ratio = lr_ratio
        self._apply_decay_param_fun = apply_decay_param_fun
        self._muon_split_logged = False
        self._muon_exclude_patterns = muon_exclude_patterns
        self._muon_extra_scale_factor = muon_extra_scale_factor
        self._ns_coeff_type = ns_coeff_type
        self._ns_coeffs = ns_table
        self._muon_param_info_map = self._check_param_info_map(muon_param_info_map)
        self._muon_max_group_bytes = muon_max_group_bytes
        self._ns_matmul_dtype = ns_dtype
        self._use_symmetric_gemm = bool(use_symmetric_gemm)
        self._symmetric_gemm_min_short_edge = symmetric_gemm_min_short_edge
        self._symmetric_gemm_min_step_flops = symmetric_gemm_min_step_flops
        muon_eps = adam_epsilon if muon_epsilon is None else muon_epsilon
        self._default_dict.update(
            {
                "momentum": momentum,
                "adam_beta1": adam_beta1,
                "adam_beta2": adam_beta2,
                "weight_decay": weight_decay,
                "ns_steps": ns_steps,
                "nesterov": nesterov,
                "epsilon": adam_epsilon,
                "muon_version": muon_version,
                "ns_coeff_type": ns_coeff_type,
                "muon_epsilon": muon_eps,
            }
        )
        # Short names this package's wrappers and tests read.
        self._momentum = float(momentum)
        self._beta1 = float(adam_beta1)
        self._beta2 = float(adam_beta2)
        self._weight_decay = float(weight_decay)
        self._ns_steps = ns_steps
        self._nesterov = bool(nesterov)
        self._epsilon = float(adam_epsilon)
        self._muon_epsilon = float(muon_eps)
        self._muon_version = muon_version

    def set_lr(self, value: float) -> None:
        """Set a float learning rate (Paddle's ``Optimizer.set_lr``).

        Paddle's own checks come first (its TypeError, its RuntimeError when
        an LRScheduler is in use); then a NaN, infinite or negative rate is
        refused as in the constructor.

        Args:
            value (float): The new learning rate, finite and >= 0.
        """
        if isinstance(value, (int, float)) and not isinstance(self._learning_rate, LRScheduler):
            _check_real("learning_rate", value)
        super().set_lr(value)

    # ------------------------------------------------------------ validation
    @staticmethod
    def _check_parameters(parameters, grad_clip) -> None:
        if parameters is None:
            raise ValueError(
                "Muon needs parameters, got None; pass parameters=model.parameters()."
            )
        if not isinstance(parameters, list):
            raise TypeError(
                f"Muon needs parameters as a list, got {type(parameters).__name__}; "
                "pass parameters=list(...) or model.parameters()."
            )
        if parameters and isinstance(parameters[0], dict):
            raise TypeError(
                "Muon does not support parameter groups (a list of dicts); "
                "pass a flat list of parameters and use muon_param_info_map / "
                "apply_decay_param_fun / lr_ratio for per-parameter options."
            )
        if grad_clip is not None and not isinstance(
            grad_clip, paddle.nn.clip.GradientClipBase
        ):
            raise TypeError(
                f"grad_clip must be a paddle.nn.clip.GradientClipBase (e.g. "
                f"paddle.nn.ClipGradByGlobalNorm(1.0)) or None, got "
                f"{type(grad_clip).__name__}."
            )

    @staticmethod
    def _check_symmetric_gemm(ns_dtype, min_short_edge, min_step_flops) -> None:
        if ns_dtype not in _SYRK_SUPPORTED_DTYPES:
            raise ValueError(
                f"use_symmetric_gemm=True needs ns_matmul_dtype bfloat16 or float16, "
                f"got {ns_dtype}; set ns_matmul_dtype=paddle.bfloat16 or "
                "use_symmetric_gemm=False."
            )
        major, minor = _device_capability()
        if major not in _SYRK_CAPABILITY_MAJORS:
            raise ValueError(
                "use_symmetric_gemm=True needs a CUDA device of compute capability "
                f"9.x, 10.x or 11.x; this one reports \"{major}.{minor}\". "
                "Set use_symmetric_gemm=False."
            )
        # not (x > 0): NaN is not positive either
        if not (min_short_edge > 0 and min_step_flops > 0):
            raise ValueError(
                "symmetric_gemm_min_short_edge and symmetric_gemm_min_step_flops "
                f"must be positive, got {min_short_edge} and {min_step_flops}."
            )
        _load_symmetric_gemm()

    @staticmethod
    def _check_values(momentum, adam_beta1, adam_beta2, adam_epsilon, weight_decay,
                      ns_steps, lr_ratio) -> None:
        for label, value in (
            ("momentum", momentum), ("adam_beta1", adam_beta1), ("adam_beta2", adam_beta2),
            ("adam_epsilon", adam_epsilon),
        ):
            # a one-line error, not Python's "'<=' not supported" from below
            if not _is_real(value):
                raise TypeError(
                    f"Muon: {label}={value!r} ({type(value).__name__}) is not a number; "
                    "pass a float."
                )
        for label, value in (
            ("momentum", momentum), ("adam_beta1", adam_beta1), ("adam_beta2", adam_beta2)
        ):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{label} must be in [0, 1), got {value}.")
        if adam_epsilon < 0.0:
            raise ValueError(f"adam_epsilon must be >= 0, got {adam_epsilon}.")
        if not isinstance(weight_decay, (int, float)):
            raise TypeError(
                f"weight_decay must be a float, got {type(weight_decay).__name__}."
            )
        if not isinstance(ns_steps, int) or ns_steps < 0:
            raise ValueError(f"ns_steps must be an int >= 0, got {ns_steps!r}.")
        if lr_ratio is not None and not callable(lr_ratio):
            raise TypeError(
                f"lr_ratio must be a callable param -> float, got {type(lr_ratio).__name__}."
            )

    def _check_param_info_map(self, user_map: MuonParamInfoMap | None) -> MuonParamInfoMap:
        if user_map is None:
            return {}
        by_name = {p.name: p for p in self._parameter_list}
        for key, info in user_map.items():
            if not isinstance(info, MuonParamInfo):
                raise TypeError(
                    f"muon_param_info_map[{key!r}] must be a MuonParamInfo, "
                    f"got {type(info).__name__}."
                )
            for flag in ("use_muon", "use_hyperball"):
                if not isinstance(getattr(info, flag), (bool, np.bool_)):
                    raise TypeError(
                        f"muon_param_info_map[{key!r}].{flag}={getattr(info, flag)!r} "
                        "must be True or False."
                    )
            if info.split_concat_func is not None and not callable(info.split_concat_func):
                raise TypeError(
                    f"muon_param_info_map[{key!r}].split_concat_func="
                    f"{info.split_concat_func!r} must be a callable (update, ortho_fn) -> "
                    "update or None."
                )
            param = by_name.get(key)
            if info.use_muon and param is not None and len(_muon_shape(param)) not in (2, 3):
                raise ValueError(
                    f"muon_param_info_map marks {key!r} as a Muon parameter, but "
                    f"Muon needs a 2-D or 3-D parameter (shape {_muon_shape(param)}); "
                    "set MuonParamInfo(use_muon=False) for it."
                )
        return user_map

    # --------------------------------------------------------------- routing
    def _should_use_muon(self, param: Tensor) -> bool:
        """The parameter's ``use_muon``: its map entry, else the default rule (warned)."""
        info = self._muon_param_info_map.get(param.name)
        if info is not None:
            return bool(info.use_muon)
        use_muon = _default_should_use_muon(
            param.name, _muon_shape(param), self._muon_exclude_patterns
        )
        logger.warning(
            f"Muon: muon_param_info_map has no entry for {param.name!r}; the default "
            f"rule (shape {_muon_shape(param)}, muon_exclude_patterns) chose "
            f"use_muon={use_muon}."
        )
        return use_muon

    def _uses_hyperball(self, param: Tensor) -> bool:
        # A parameter without a map entry takes the plain update (UNCONFIRMED).
        info = self._muon_param_info_map.get(param.name)
        return bool(info is not None and info.use_hyperball)

    def _decays(self, param: Tensor) -> bool:
        return self._apply_decay_param_fun is None or bool(
            self._apply_decay_param_fun(param.name)
        )

    def _lr_ratio_of(self, param: Tensor) -> float:
        if self._lr_ratio is None:
            return 1.0
        ratio = self._lr_ratio(param)
        # a NaN / negative ratio would corrupt the parameter without a word
        if not _is_real(ratio) or not 0.0 <= float(ratio) < math.inf:
            raise ValueError(
                f"Muon: lr_ratio({param.name!r}) returned {ratio!r}; it must return a "
                "finite float >= 0."
            )
        return float(ratio)

    def _master_weight(self, param: Tensor) -> Tensor | None:
        if self._multi_precision and self._is_dtype_fp16_or_bf16(param.dtype):
            return self._master_weights[param.name]
        return None

    # ---------------------------------------------------------- accumulators
    def _update_param_group(self, parameters):
        return parameters.get("params")

    def _create_accumulators(self, block, parameters):
        if isinstance(parameters, dict):
            parameters = self._update_param_group(parameters)
        for p in parameters:
            if p.name in self._already_create_accumulator:
                continue
            info = self._muon_param_info_map.get(p.name)
            use_muon = (
                info.use_muon
                if info is not None
                else _default_should_use_muon(
                    p.name, _muon_shape(p), self._muon_exclude_patterns
                )
            )
            hyperball = bool(info is not None and info.use_hyperball)
            if self._multi_precision and self._is_dtype_fp16_or_bf16(p.dtype):
                self._create_master_weight(p)
            # Keyed on the parameter, master weight or not (develop's keys):
            # "<param>_moment1_0". fp32 moments for low-precision params.
            acc_dtype = paddle.float32 if self._is_dtype_fp16_or_bf16(p.dtype) else p.dtype
            self._add_accumulator(self._moment_acc_str, p, dtype=acc_dtype)
            if not use_muon:
                self._add_accumulator(self._moment2_acc_str, p, dtype=acc_dtype)
                # The fused adamw kernel reads beta pows of shape [1] on the
                # CPU (as paddle.optimizer.AdamW keeps them); AdamH computes
                # with them on the parameter's device.
                device = None if hyperball else "cpu"
                for acc, beta in (
                    (self._beta1_pow_acc_str, self._default_dict["adam_beta1"]),
                    (self._beta2_pow_acc_str, self._default_dict["adam_beta2"]),
                ):
                    self._add_accumulator(
                        acc, p, dtype=acc_dtype, fill_value=beta, shape=[1], device=device,
                    )
            self._already_create_accumulator.add(p.name)

    def _ensure_accumulators(self, params: Sequence[Tensor]) -> None:
        todo = [p for p in params if p.name not in self._already_create_accumulator]
        if todo:
            self._create_accumulators(
                framework.default_main_program().global_block(), todo
            )

    # ------------------------------------------------------------ staged API
    def apply_grad_clip(self, params_grads: list) -> list:
        """Apply ``grad_clip`` (if any) to ``(param, grad)`` pairs.

        Args:
            params_grads (list[tuple[Tensor, Tensor]]): Pairs to clip.

        Returns:
            list: The clipped pairs.
        """
        if self._grad_clip is not None:
            params_grads = self._grad_clip(params_grads)
        return list(params_grads)

    def prepare_optimize(self, params_grads: list) -> tuple[list, list]:
        """Route pairs to Muon or AdamW and create their state (no clip, no update).

        MuonH parameters travel in the Muon list, AdamH in the AdamW list.

        Args:
            params_grads (list[tuple[Tensor, Tensor]]): Pairs; ``None`` grads
                are skipped.

        Returns:
            tuple[list, list]: ``(muon_params_grads, adamw_params_grads)``,
            each in input order.
        """
        self._maybe_refuse()
        muon, adamw = [], []
        for param, grad in params_grads:
            if grad is None:
                continue
            (muon if self._should_use_muon(param) else adamw).append((param, grad))
        self._ensure_accumulators([p for p, _ in muon] + [p for p, _ in adamw])
        return muon, adamw

    def update_params(self, muon_params_grads: list, adamw_params_grads: list) -> None:
        """Update prepared pairs: every Muon group first, then AdamW.

        No clipping and no state creation (see :meth:`prepare_optimize`);
        wrappers may call it several times per step with disjoint subsets
        that never split a :meth:`muon_group_key`.

        Args:
            muon_params_grads (list[tuple[Tensor, Tensor]]): Muon/MuonH pairs.
            adamw_params_grads (list[tuple[Tensor, Tensor]]): AdamW/AdamH pairs.
        """
        lr = float(self.get_lr())
        if not 0.0 <= lr < math.inf:
            # e.g. an LRScheduler that produced NaN: refuse before any update
            raise ValueError(
                f"Muon: the learning rate is {lr} at this step; it must be a finite "
                "float >= 0 (check the LRScheduler)."
            )
        dd = self._default_dict
        weight_decay = dd["weight_decay"]
        groups: dict[Any, list] = {}
        for param, grad in muon_params_grads:
            if len(param.shape) not in (2, 3):
                raise AssertionError(
                    f"Muon parameter {param.name} has shape {list(param.shape)}; the "
                    "Muon update needs the whole 2-D or 3-D matrix (a slice of it "
                    "means a wrapper routed it wrongly)."
                )
            if math.prod(_muon_shape(param)) == 0:
                # A zero-size matrix has nothing to update (and no norm or
                # aspect ratio for Newton-Schulz and the scale rule).
                continue
            groups.setdefault(self.muon_group_key(param), []).append((param, grad))
        for group in groups.values():
            subgroups = [[pg] for pg in group] if self._ns_per_matrix else \
                self._split_group_by_bytes(group)
            for sub in subgroups:
                for chunk in self._cpu_ns_chunks(sub):
                    self._muon_update_group(
                        chunk, lr, dd["momentum"], dd["ns_steps"], dd["nesterov"],
                        dd["muon_epsilon"], weight_decay, dd.get("muon_version", 3),
                    )
        if not adamw_params_grads:
            return
        # A 0-D fp64 tensor, as develop passes it (no host copy per param).
        lr_tensor = paddle.full([], lr, "float64")
        for param, grad in adamw_params_grads:
            if self._uses_hyperball(param):
                self._adamw_hyperball_update(param, grad, lr)
            else:
                wd = weight_decay if self._decays(param) else 0.0
                self._adamw_update(param, grad, lr_tensor, wd)

    def muon_group_key(self, param: Tensor) -> tuple:
        """Parameters with equal keys are orthogonalised in one batch.

        Args:
            param (Tensor): A Muon parameter.

        Returns:
            tuple: ``(split function key, Muon shape)``; a
            ``functools.partial`` is keyed by its function and (hashable)
            arguments, so equal partials share a batch.
        """
        info = self._muon_param_info_map.get(param.name)
        fn = info.split_concat_func if info is not None else None
        if fn is None:
            func_key = None
        elif hasattr(fn, "func"):
            keywords = getattr(fn, "keywords", None) or {}
            func_key = (
                fn.func,
                tuple(_to_hashable(a) for a in getattr(fn, "args", ())),
                tuple((k, _to_hashable(v)) for k, v in sorted(keywords.items())),
            )
        else:
            func_key = fn
        return (func_key, tuple(_muon_shape(param)))

    def _split_group_by_bytes(self, group_params_grads: list) -> Iterator[list]:
        """Consecutive sub-groups of at most ``muon_max_group_bytes`` (4 bytes/element).

        A parameter larger than the limit forms a sub-group alone.
        """
        max_bytes = self._muon_max_group_bytes
        if not max_bytes:
            yield group_params_grads
            return
        yield from _runs_of_at_most(group_params_grads, max_bytes)

    def _cpu_ns_chunks(self, group_params_grads: list) -> Iterator[list]:
        """A sub-group as develop batches it, cut for a CPU place (package addition).

        On a CPU place, consecutive chunks of at most ``ns_cpu_chunk_bytes``
        (4 bytes/element, as :meth:`_split_group_by_bytes` counts; a larger
        matrix forms a chunk alone); elsewhere, or with the option 0/None,
        the sub-group itself. Every matrix gets the same Newton-Schulz either
        way (a batch is independent matrices), so only the batch size changes.

        Args:
            group_params_grads (list[tuple[Tensor, Tensor]]): One sub-group of
                :meth:`_split_group_by_bytes`.

        Returns:
            Iterator[list]: The chunks, in order, covering every pair once.
        """
        limit = self._ns_cpu_chunk_bytes
        if (not limit or len(group_params_grads) < 2
                or not group_params_grads[0][0].place.is_cpu_place()):
            yield group_params_grads
            return
        yield from _runs_of_at_most(group_params_grads, limit)

    @imperative_base.no_grad()
    def _muon_update_group(
        self,
        group_params_grads: list,
        lr: float,
        momentum_beta: float,
        ns_steps: int,
        nesterov: bool,
        epsilon: float,
        weight_decay: float,
        version: int,
    ) -> None:
        """Momentum, one batched Newton-Schulz and the update of same-key params.

        Args:
            group_params_grads (list[tuple[Tensor, Tensor]]): Pairs sharing a
                :meth:`muon_group_key`.
            lr (float): Learning rate (times ``lr_ratio(param)`` per param).
            momentum_beta (float): Momentum coefficient.
            ns_steps (int): Newton-Schulz iterations.
            nesterov (bool): Nesterov momentum.
            epsilon (float): Newton-Schulz norm floor.
            weight_decay (float): Decoupled decay (not for hyperball params).
            version (int): Scale rule of :meth:`_scaling_fn`.
        """
        first = group_params_grads[0][0]
        param_shape = _muon_shape(first)
        info = self._muon_param_info_map.get(first.name)
        split_fn = info.split_concat_func if info is not None else None

        updates = []
        for param, grad in group_params_grads:
            moment = self._get_accumulator(self._moment_acc_str, param)
            g = grad if grad.dtype == moment.dtype else paddle.cast(grad, moment.dtype)
            paddle.assign(paddle.lerp(moment, g, 1.0 - momentum_beta), output=moment)
            update = paddle.lerp(g, moment, momentum_beta) if nesterov else moment
            if list(update.shape) != param_shape:
                update = update.reshape(param_shape)
            updates.append(update)

        count = len(updates)
        is_3d = len(param_shape) == 3
        if count == 1:
            batched = updates[0]
        else:
            batched = paddle.concat(updates, axis=0) if is_3d else paddle.stack(updates, axis=0)

        def ortho(x: Tensor) -> Tensor:
            o = self._zeropower_via_newtonschulz5(
                x, ns_steps, epsilon, self._ns_coeffs, self._ns_matmul_dtype,
                use_symmetric_gemm=self._use_symmetric_gemm,
                symmetric_gemm_min_short_edge=self._symmetric_gemm_min_short_edge,
                symmetric_gemm_min_step_flops=self._symmetric_gemm_min_step_flops,
            )
            return self._scaling_fn(o, version, self._muon_extra_scale_factor)

        if split_fn is not None:
            if MUON_DEBUG and paddle.distributed.get_rank() == 0:
                logger.info(
                    f"Muon: {[p.name for p, _ in group_params_grads]} {param_shape} "
                    f"orthogonalised by split_concat_func "
                    f"{getattr(getattr(split_fn, 'func', split_fn), '__name__', split_fn)} "
                    f"args={getattr(split_fn, 'args', ())} "
                    f"keywords={getattr(split_fn, 'keywords', {})}"
                )
            out = split_fn(batched, ortho)
            if list(out.shape) != list(batched.shape):
                raise ValueError(
                    f"split_concat_func of {first.name} returned shape "
                    f"{list(out.shape)}, expected {list(batched.shape)}."
                )
        else:
            out = ortho(batched)
        if count == 1:
            pieces = [out]
        elif is_3d:
            pieces = paddle.split(out, count, axis=0)
        else:
            pieces = paddle.unbind(out, axis=0)

        for (param, _), o in zip(group_params_grads, pieces):
            self._apply_muon_direction(param, o, lr * self._lr_ratio_of(param),
                                       weight_decay, param_shape)

    def _apply_muon_direction(self, param, ortho, lr, weight_decay, param_shape) -> None:
        master = self._master_weight(param)
        if self._uses_hyperball(param):
            self._hyperball_into(param, master, ortho, lr, param_shape)
            return
        if list(ortho.shape) != list(param.shape):
            ortho = ortho.reshape(param.shape)
        target = param if master is None else master
        if self._decays(param) and weight_decay > 0.0:
            target.scale_(1.0 - lr * weight_decay)
        # The step is taken in the Newton-Schulz dtype (bf16 on GPUs by
        # default), as develop does, then applied in the target's dtype.
        step = ortho * lr
        if step.dtype != target.dtype:
            step = paddle.cast(step, target.dtype)
        paddle.assign(target - step, output=target)
        if master is not None:
            paddle.assign(paddle.cast(master, param.dtype), output=param)

    def _hyperball_into(self, param, master, direction, lr, shape) -> None:
        # Norms per matrix: the Muon shape (per expert for 3-D); a 1-D AdamH
        # parameter is one row.
        shape = list(shape) if len(shape) >= 2 else [1, int(math.prod(shape))]
        target = param if master is None else master
        new = self._hyperball_apply(target.reshape(shape), direction.reshape(shape), lr)
        paddle.assign(paddle.cast(new.reshape(target.shape), target.dtype), output=target)
        if master is not None:
            paddle.assign(paddle.cast(master, param.dtype), output=param)

    # --------------------------------------------------------- Newton-Schulz
    @staticmethod
    def _zeropower_via_newtonschulz5(
        X: Tensor,
        steps: int = 5,
        eps: float = _DEFAULT_EPSILON,
        ns_coeffs: Sequence[Sequence[float]] | None = None,
        ns_matmul_dtype: paddle.dtype = paddle.bfloat16,
        use_symmetric_gemm: bool = False,
        symmetric_gemm_min_short_edge: int = _SYRK_DEFAULT_MIN_SHORT_EDGE,
        symmetric_gemm_min_step_flops: float = _SYRK_DEFAULT_MIN_STEP_FLOPS,
    ) -> Tensor:
        """Approximately orthogonalise a matrix, or a batch ``[B, m, n]`` of them.

        Each matrix is divided by ``max(||X||_F, eps)`` in the input dtype,
        cast to ``ns_matmul_dtype`` and iterated ``steps`` times.

        Returns:
            Tensor: The result in ``ns_matmul_dtype``, shape of ``X``.
        """
        if X.ndim not in (2, 3):
            raise ValueError(
                f"Newton-Schulz expects a 2-D or 3-D (batched) tensor, got shape "
                f"{list(X.shape)}."
            )
        coeffs = ns_coeffs if ns_coeffs is not None else _NS_COEFFICIENT_SETS["simple"]
        # Iterating on the wide orientation keeps A = X X^T at min(m, n)^2.
        transposed = X.shape[-2] > X.shape[-1]
        if transposed:
            X = _swap_last_two(X)
        shape = list(X.shape)
        flat = X.reshape([-1]) if X.ndim == 2 else X.reshape([shape[0], -1])
        # The iteration converges for singular values <= 1; the Frobenius
        # norm bounds the spectral norm.
        X = paddle.nn.functional.normalize(flat, p=2, axis=-1, epsilon=eps).reshape(shape)
        if X.dtype != ns_matmul_dtype:
            X = paddle.cast(X, ns_matmul_dtype)
        symmetric = use_symmetric_gemm and _symmetric_gemm_is_profitable(
            shape, ns_matmul_dtype, symmetric_gemm_min_short_edge,
            symmetric_gemm_min_step_flops,
        )
        if X.ndim == 3:
            step = (Muon._batched_newton_schulz_step_symmetric if symmetric
                    else Muon._batched_newton_schulz_step)
        else:
            step = Muon._newton_schulz_step_symmetric if symmetric else Muon._newton_schulz_step
        for i in range(steps):
            a, b, c = coeffs[i % len(coeffs)]
            X = step(X, a, b, c)
        return _swap_last_two(X) if transposed else X

    @staticmethod
    def _newton_schulz_step(X: Tensor, a: float, b: float, c: float) -> Tensor:
        """``a X + (b A + c A A) X`` with ``A = X X^T`` (addmm folds the scalars)."""
        A = paddle.matmul(X, X, transpose_y=True)
        B = paddle.addmm(A, A, A, beta=b, alpha=c)
        return paddle.addmm(X, B, X, beta=a, alpha=1.0)

    @staticmethod
    def _batched_newton_schulz_step(X: Tensor, a: float, b: float, c: float) -> Tensor:
        """:meth:`_newton_schulz_step` over a ``[B, m, n]`` batch (baddbmm)."""
        A = paddle.matmul(X, X, transpose_y=True)
        B = paddle.baddbmm(A, A, A, beta=b, alpha=c)
        return paddle.baddbmm(X, B, X, beta=a, alpha=1.0)

    @staticmethod
    def _newton_schulz_step_symmetric(X: Tensor, a: float, b: float, c: float) -> Tensor:
        """:meth:`_newton_schulz_step` with ``A`` and ``B`` from the symmetric GEMM kernel."""
        gemm = _load_symmetric_gemm()
        A = _call_symmetric_gemm(gemm, X, paddle.transpose(X, [1, 0]))
        B = _call_symmetric_gemm(gemm, A, A, C=A, alpha=c, beta=b)
        return paddle.addmm(X, B, X, beta=a, alpha=1.0)

    @staticmethod
    def _batched_newton_schulz_step_symmetric(
        X: Tensor, a: float, b: float, c: float
    ) -> Tensor:
        """Batched :meth:`_newton_schulz_step_symmetric`."""
        gemm = _load_symmetric_gemm()
        A = _call_symmetric_gemm(gemm, X, paddle.transpose(X, [0, 2, 1]))
        B = _call_symmetric_gemm(gemm, A, A, C=A, alpha=c, beta=b)
        return paddle.baddbmm(X, B, X, beta=a, alpha=1.0)

    @staticmethod
    def _scaling_fn(
        orthogonal_update: Tensor, version: int, extra_scale_factor: float = 1.0
    ) -> Tensor:
        """``orthogonal_update`` times the version scale, then times ``extra_scale_factor``.

        Two multiplies in the update's dtype, as develop rounds them.
        """
        scale = _version_scale(orthogonal_update.shape, version)
        return orthogonal_update * scale * extra_scale_factor

    @staticmethod
    def _fro(x: Tensor) -> Tensor:
        """Frobenius norm over the last two axes (keepdim)."""
        return _fro(x)

    @staticmethod
    def _hyperball_apply(w: Tensor, u: Tensor, lr: float) -> Tensor:
        """One step on the sphere of radius ``||w||_F`` (per matrix of the last two axes).

        ``trial = w - lr * R * u / ||u||``; result ``R * trial / ||trial||``
        with ``R = ||w||_F``; computed in fp32, ``w`` is left unchanged.

        Returns:
            Tensor: The new weight (fp32).
        """
        w32 = w if w.dtype == paddle.float32 else paddle.cast(w, "float32")
        u32 = u if u.dtype == paddle.float32 else paddle.cast(u, "float32")
        radius = _fro(w32)
        direction = u32 / paddle.clip(_fro(u32), min=_HYPERBALL_EPS)
        trial = w32 - lr * radius * direction
        return radius * trial / paddle.clip(_fro(trial), min=_HYPERBALL_EPS)

    # ------------------------------------------------------------------ AdamW
    def _adamw_kernel(self, param, grad, lr, accs, master, weight_decay):
        moment1, moment2, beta1_pow, beta2_pow = accs
        _C_ops.adamw_(
            param,
            grad,
            lr,
            moment1,
            moment2,
            None,  # moment2_max (amsgrad off)
            beta1_pow,
            beta2_pow,
            master,
            None,  # skip_update
            self._default_dict["adam_beta1"],
            self._default_dict["adam_beta2"],
            self._default_dict["epsilon"],
            1.0,  # lr_ratio: already folded into lr (the CPU kernel ignores it)
            weight_decay,
            weight_decay != 0.0,
            False,  # lazy_mode
            1000,  # min_row_size_to_use_multithread, as in AdamW
            master is not None,
            False,  # use_global_beta_pow
            False,  # amsgrad
        )

    @staticmethod
    def _has_low_precision_adamw_kernel(param: Tensor) -> bool:
        # Only the GPU/XPU adamw kernels are registered for fp16/bf16 params.
        place = param.place
        return place.is_gpu_place() or place.is_xpu_place()

    def _adamw_accumulators(self, param: Tensor) -> list:
        return [
            self._get_accumulator(name, param)
            for name in (
                self._moment_acc_str,
                self._moment2_acc_str,
                self._beta1_pow_acc_str,
                self._beta2_pow_acc_str,
            )
        ]

    def _adamw_update(self, param: Tensor, grad: Tensor, lr: Tensor, weight_decay: float) -> None:
        accs = self._adamw_accumulators(param)
        if self._lr_ratio is not None:
            lr = lr * self._lr_ratio_of(param)
        accelerated = self._has_low_precision_adamw_kernel(param)
        if not accelerated and lr.dtype != paddle.float32:
            # The CPU kernel reads the learning rate as fp32 only.
            lr = paddle.cast(lr, "float32")
        master = self._master_weight(param)
        if master is None:
            self._adamw_kernel(param, grad, lr, accs, None, weight_decay)
            return
        if accelerated:
            # The fused kernel updates master and param in one launch.
            self._adamw_kernel(param, grad, lr, accs, master, weight_decay)
            return
        # The CPU adamw kernel has no fp16/bf16 registration: run the fp32
        # kernel on the master weight (the same arithmetic the fused
        # multi-precision kernel does) and cast the result back.
        g32 = grad if grad.dtype == paddle.float32 else paddle.cast(grad, "float32")
        self._adamw_kernel(master, g32, lr, accs, None, weight_decay)
        paddle.assign(paddle.cast(master, param.dtype), output=param)

    def _adamw_hyperball_update(self, param: Tensor, grad: Tensor, lr: float) -> None:
        """AdamH: the bias-corrected Adam direction, applied on the hyperball."""
        moment1, moment2, beta1_pow, beta2_pow = self._adamw_accumulators(param)
        beta1 = self._default_dict["adam_beta1"]
        beta2 = self._default_dict["adam_beta2"]
        g = grad if grad.dtype == moment1.dtype else paddle.cast(grad, moment1.dtype)
        paddle.assign(moment1 * beta1 + (1.0 - beta1) * g, output=moment1)
        paddle.assign(moment2 * beta2 + (1.0 - beta2) * g * g, output=moment2)
        m_hat = moment1 / (1.0 - beta1_pow)
        v_hat = moment2 / (1.0 - beta2_pow)
        direction = m_hat / (paddle.sqrt(v_hat) + self._default_dict["epsilon"])
        paddle.assign(beta1_pow * beta1, output=beta1_pow)
        paddle.assign(beta2_pow * beta2, output=beta2_pow)
        self._hyperball_into(param, self._master_weight(param), direction,
                             lr * self._lr_ratio_of(param), _muon_shape(param))

    # ----------------------------------------------------------- entry points
    @imperative_base.no_grad()
    def _apply_optimize(self, loss, startup_program, params_grads, param_group_idx=0):
        """Clip, prepare, update: the staged API in one call.

        Wrappers call this with their own subset of ``(param, grad)`` pairs.
        With ``FLAGS_shard_bypass_dygraph_optimizer`` set (at import) it does
        nothing.

        Args:
            loss (Tensor|None): Unused in dygraph.
            startup_program (Program|None): Unused in dygraph.
            params_grads (list[tuple[Tensor, Tensor]]): Pairs to update.
            param_group_idx (int): Unused (no parameter groups).
        """
        if not framework.in_dygraph_mode():
            raise NotImplementedError(
                "Muon supports dygraph mode only; call paddle.disable_static()."
            )
        if g_shard_bypass_dygraph_optimizer:
            return None
        if isinstance(params_grads, dict):
            raise TypeError(
                "Muon does not support parameter groups; pass params_grads as "
                "a flat list of (param, grad) pairs."
            )
        params_grads = self.apply_grad_clip(params_grads)
        muon, adamw = self.prepare_optimize(params_grads)
        self.update_params(muon, adamw)
        return None

    @imperative_base.no_grad()
    @framework.non_static_only
    def step(self) -> None:
        """Update every trainable parameter of ``self._parameter_list`` that has a grad."""
        params_grads = []
        for param in self._parameter_list:
            if param.stop_gradient:
                continue
            grad = param._grad_ivar()
            if grad is not None:
                params_grads.append((param, grad))
        self._apply_optimize(loss=None, startup_program=None, params_grads=params_grads)

    def set_state_dict(self, state_dict: dict) -> None:
        """Load optimizer state (develop's keys, ``<param>_moment1_0``).

        Keys of earlier versions of this package
        (``<param>_fp32_master_0_moment1_0``) are read as develop's.
        """
        renamed = {}
        for key, value in state_dict.items():
            match = _LEGACY_MASTER_STATE_KEY.match(key) if isinstance(key, str) else None
            if match is not None:
                key = f"{match['param']}_{match['state']}"
                if key in state_dict:
                    continue
            renamed[key] = value
        return super().set_state_dict(renamed)

    def sharded_state_dict(self, model_sharded_state_dict: dict) -> dict:
        """Describe the optimizer state for ``paddle.distributed.flex_checkpoint``.

        Keys are ``"<structured name>.<state>"`` (``moment1_0``, ``moment2_0``,
        ``beta1_pow_acc_0``, ``beta2_pow_acc_0``) and ``"<structured name>.w_0"``
        for master weights. Tensor states take the parameter's local shape and
        global offset; scalars are shape ``(1,)``.

        States a fresh optimizer has not created yet (no step taken) are
        created first, with the values its first step would give them, so that
        a checkpoint loads into it: e.g. a job resumed on one process, where
        ``fleet.distributed_optimizer`` returns this optimizer itself.

        Args:
            model_sharded_state_dict (dict): The model's sharded state dict
                (structured name -> ShardedWeight).

        Returns:
            dict: key -> ShardedWeight.
        """
        from paddle.distributed.flex_checkpoint.dcp.sharded_weight import (
            ShardedWeight,
        )

        struct_of: dict[str, str] = {}
        # Shared weights: only the first structured name (sorted) holds state.
        for key in sorted(model_sharded_state_dict):
            struct_of.setdefault(model_sharded_state_dict[key].local_tensor.name, key)

        def model_weight(pname: str, state_key: str):
            if pname not in struct_of:
                raise KeyError(
                    f"optimizer state {state_key!r} belongs to parameter {pname!r}, "
                    "which model_sharded_state_dict does not describe; pass the "
                    "sharded state dict of the model this optimizer trains."
                )
            return struct_of[pname], model_sharded_state_dict[struct_of[pname]]

        def like_param(key: str, tensor: Tensor, weight) -> ShardedWeight:
            local_shape = tuple(weight.local_shape)
            if tuple(tensor.shape) != local_shape:
                if int(tensor.numel()) != math.prod(local_shape):
                    raise ValueError(
                        f"optimizer state {key!r} has shape {list(tensor.shape)}, "
                        f"which cannot be viewed as the parameter's local shape "
                        f"{list(local_shape)}."
                    )
                # e.g. 3-D expert weights whose model tensor is stored 2-D
                tensor = tensor.reshape(local_shape)
            return ShardedWeight(
                key=key,
                local_tensor=tensor,
                local_shape=local_shape,
                global_shape=tuple(weight.global_shape),
                global_offset=tuple(weight.global_offset),
            )

        # the sharded optimizer does the same: a load needs its targets
        self._ensure_accumulators([p for p in self._parameter_list if not p.stop_gradient])
        state = dict(self.state_dict())
        master_weights = state.pop("master_weights", None) or {}
        state.pop("LR_Scheduler", None)
        result = {}
        for state_key, tensor in state.items():
            match = _STATE_KEY.match(state_key)
            if match is None:
                raise ValueError(
                    f"Cannot tell which parameter optimizer state {state_key!r} belongs to."
                )
            struct, weight = model_weight(match["param"], state_key)
            key = f"{struct}.{match['state']}"
            if "pow_acc" in match["state"]:
                result[key] = ShardedWeight(
                    key=key, local_tensor=tensor, local_shape=(1,),
                    global_shape=(1,), global_offset=(0,),
                )
            else:
                result[key] = like_param(key, tensor, weight)
        for pname, tensor in master_weights.items():
            struct, weight = model_weight(pname, pname)
            key = f"{struct}.w_0"
            result[key] = like_param(key, tensor, weight)
        return result
