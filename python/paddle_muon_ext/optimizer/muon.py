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
names and checkpoint keys as ``paddle.optimizer.Muon`` in Paddle develop.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import paddle
from paddle import _C_ops
from paddle.base import framework
from paddle.base.dygraph import base as imperative_base
from paddle.optimizer.lr import LRScheduler
from paddle.optimizer.optimizer import Optimizer

if TYPE_CHECKING:
    from paddle import Tensor
    from paddle.nn.clip import GradientClipBase

__all__ = [
    "Muon",
    "MuonParamInfo",
    "MuonParamInfoMap",
    "NS_COEFFS_PRESETS",
    "muon_update_scale",
    "newton_schulz",
    "resolve_ns_coeffs",
]

NSCoeff = tuple[float, float, float]

_SIMPLE = (3.4445, -4.7750, 2.0315)

# (a, b, c) of X <- a*X + (b*A + c*A*A)*X with A = X*X^T; step i uses
# table[i % len(table)]. The tables are Paddle develop's, so a preset gives
# the same update here as there.
NS_COEFFS_PRESETS: dict[str, list[NSCoeff]] = {
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

# Optimizer state names as they appear in state_dict keys
# ("<param>_moment1_0", "<param>_fp32_master_0_moment1_0", ...).
_STATE_KEY = re.compile(
    r"^(?P<param>.+?)(?:_fp32_master_0)?_(?P<state>(?:moment1|moment2|beta1_pow_acc|beta2_pow_acc)_\d+)$"
)


@dataclass
class MuonParamInfo:
    """How Muon treats one parameter.

    Args:
        use_muon (bool): Update the parameter with Muon (True) or AdamW (False).
        split_concat_func (Callable|None): For fused matrices (e.g. a QKV
            weight) whose blocks are orthogonalised separately. Called as
            ``split_concat_func(update, ortho_fn)``; it splits the fp32
            momentum update into blocks, applies ``ortho_fn`` (Newton-Schulz
            then scaling) to each and returns them concatenated back to the
            update's shape. None orthogonalises the whole matrix.
    """

    use_muon: bool = True
    split_concat_func: Callable[..., Any] | None = None


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
            f"exclude_patterns is None for parameter {name!r}; pass a list of "
            "name substrings to keep on AdamW (e.g. ['embedding', 'lm_head']), "
            "or [] to route every 2-D/3-D parameter to Muon."
        )
    if len(shape) not in (2, 3):
        return False
    lowered = name.lower()
    return not any(str(pattern).lower() in lowered for pattern in exclude_patterns)


def _muon_shape(param: Tensor) -> list[int]:
    # Expert stacks may be stored 2-D; Muon sees the shape they had.
    original = getattr(param, "original_shape", None)
    return list(original) if original else list(param.shape)


def resolve_ns_coeffs(
    ns_coeff_type: str, ns_coeffs: Sequence[Sequence[float]] | None = None
) -> list[NSCoeff]:
    """Return the Newton-Schulz coefficient table for a preset or custom list.

    Args:
        ns_coeff_type (str): A key of ``NS_COEFFS_PRESETS`` or ``"custom"``.
        ns_coeffs (Sequence|None): ``[(a, b, c), ...]``, required (non-empty)
            when ``ns_coeff_type == "custom"``.

    Returns:
        list[tuple[float, float, float]]: The table.
    """
    if ns_coeff_type == "custom":
        if not ns_coeffs:
            raise ValueError(
                f"ns_coeff_type='custom' needs a non-empty ns_coeffs list of "
                f"(a, b, c) tuples, got ns_coeffs={ns_coeffs!r}."
            )
        table = []
        for coeff in ns_coeffs:
            if len(coeff) != 3:
                raise ValueError(
                    f"Each Newton-Schulz coefficient must be (a, b, c), got {coeff!r}."
                )
            table.append(tuple(float(v) for v in coeff))
        return table
    if ns_coeff_type not in NS_COEFFS_PRESETS:
        valid = [*NS_COEFFS_PRESETS, "custom"]
        raise ValueError(
            f"Unknown ns_coeff_type {ns_coeff_type!r}; valid types: {valid}."
        )
    return list(NS_COEFFS_PRESETS[ns_coeff_type])


def _auto_ns_matmul_dtype() -> paddle.dtype:
    # bf16 tensor cores start at compute capability 8 (Ampere).
    if paddle.is_compiled_with_cuda():
        try:
            major, _ = paddle.device.cuda.get_device_capability()
        except (RuntimeError, ValueError, OSError):
            major = 0
        if major >= 8:
            return paddle.bfloat16
    return paddle.float32


def _resolve_ns_matmul_dtype(value: str | paddle.dtype | None) -> paddle.dtype:
    if value is None:
        return _auto_ns_matmul_dtype()
    named = {
        "float32": paddle.float32,
        "bfloat16": paddle.bfloat16,
        "float16": paddle.float16,
        "float64": paddle.float64,
    }
    if isinstance(value, str):
        if value not in named:
            raise ValueError(
                f"Unknown ns_matmul_dtype {value!r}; use one of {list(named)} "
                "or None (bfloat16 on CUDA devices of compute capability >= 8, "
                "else float32)."
            )
        value = named[value]
    if value not in named.values():
        raise ValueError(
            f"Unknown ns_matmul_dtype {value!r}; use one of {list(named)} or None."
        )
    if value in (paddle.bfloat16, paddle.float16) and not _has_low_precision_matmul():
        raise ValueError(
            f"ns_matmul_dtype={value} needs an accelerator build of Paddle: the CPU "
            "has no fp16/bf16 matmul kernel. Use ns_matmul_dtype='float32' or None."
        )
    return value


def _has_low_precision_matmul() -> bool:
    return (
        paddle.is_compiled_with_cuda()
        or paddle.is_compiled_with_xpu()
        or bool(paddle.device.get_all_custom_device_type())
    )


def _swap_last_two(x: Tensor) -> Tensor:
    perm = list(range(x.ndim))
    perm[-2], perm[-1] = perm[-1], perm[-2]
    return paddle.transpose(x, perm)


def newton_schulz(
    x: Tensor,
    coeffs: Sequence[Sequence[float]],
    steps: int,
    eps: float = _DEFAULT_EPSILON,
    matmul_dtype: paddle.dtype = paddle.float32,
) -> Tensor:
    """Approximately orthogonalise a matrix (or a batch of matrices).

    A 3-D input ``[E, H, I]`` is ``E`` independent matrices, processed in one
    batched computation.

    Args:
        x (Tensor): 2-D or 3-D tensor, any float dtype.
        coeffs (Sequence): ``[(a, b, c), ...]``; step ``i`` uses
            ``coeffs[i % len(coeffs)]``.
        steps (int): Number of iterations (>= 0).
        eps (float): Floor of the norm ``x`` is divided by.
        matmul_dtype (paddle.dtype): Dtype of the iteration's matmuls.

    Returns:
        Tensor: float32 tensor with the shape of ``x``.
    """
    if x.ndim not in (2, 3):
        raise ValueError(
            f"Newton-Schulz expects a 2-D or 3-D tensor, got shape {list(x.shape)}."
        )
    if not coeffs:
        raise ValueError("Newton-Schulz needs at least one (a, b, c) coefficient.")
    if steps < 0:
        raise ValueError(f"Newton-Schulz steps must be >= 0, got {steps}.")
    X = x if x.dtype == paddle.float32 else paddle.cast(x, "float32")
    # Iterating on the wide orientation keeps A = X X^T at min(m, n)^2.
    transposed = X.shape[-2] > X.shape[-1]
    if transposed:
        X = _swap_last_two(X)
    # The iteration converges only for singular values <= 1; the Frobenius
    # norm bounds the spectral norm.
    norm = paddle.linalg.norm(X, p="fro", axis=[-2, -1], keepdim=True)
    X = X / paddle.clip(norm, min=eps)
    if X.dtype != matmul_dtype:
        X = paddle.cast(X, matmul_dtype)
    # addmm/baddbmm fold the scalar multiply-adds into the GEMMs (up to 50%
    # faster, tools/bench/bench_newton_schulz.py); fp32 rounding only. Low
    # precision keeps separate ops: the fused form would round differently
    # (and CPU has no bf16 baddbmm).
    fused = matmul_dtype in (paddle.float32, paddle.float64)
    gemm = paddle.addmm if X.ndim == 2 else paddle.baddbmm
    for i in range(steps):
        a, b, c = coeffs[i % len(coeffs)]
        A = paddle.matmul(X, X, transpose_y=True)
        if fused:
            B = gemm(A, A, A, beta=b, alpha=c)
            X = gemm(X, B, X, beta=a, alpha=1.0)
        else:
            B = b * A + c * paddle.matmul(A, A)
            X = a * X + paddle.matmul(B, X)
    if transposed:
        X = _swap_last_two(X)
    return X if X.dtype == paddle.float32 else paddle.cast(X, "float32")


def muon_update_scale(
    shape: Sequence[int], version: int = 1, extra_scale_factor: float = 0.2
) -> float:
    """Scale of the orthogonalised update of a matrix of ``shape``.

    ``din, dout = shape[-2], shape[-1]`` (Paddle stores Linear weights as
    ``[in, out]``): version 1 ``sqrt(max(1, dout/din))``, version 2
    ``sqrt(dout/din)``, any other ``sqrt(max(din, dout))``; every version is
    then multiplied by ``extra_scale_factor``.

    Args:
        shape (Sequence[int]): Matrix shape (2-D or 3-D).
        version (int): ``muon_version``.
        extra_scale_factor (float): ``muon_extra_scale_factor``.

    Returns:
        float: The scale.
    """
    if len(shape) < 2:
        raise ValueError(f"muon_update_scale needs a matrix shape, got {list(shape)}.")
    din, dout = int(shape[-2]), int(shape[-1])
    if version == 1:
        scale = math.sqrt(max(1.0, dout / din))
    elif version == 2:
        scale = math.sqrt(dout / din)
    else:
        scale = math.sqrt(max(dout, din))
    return scale * float(extra_scale_factor)


class Muon(Optimizer):
    r"""
    Muon (MomentUm Orthogonalized by Newton-Schulz) with an AdamW fallback.

    A parameter uses Muon when its ``muon_param_info_map`` entry says so;
    without a map, when it is 2-D, or 3-D ``[E, H, I]`` (E expert matrices,
    orthogonalised independently), and its name matches none of
    ``muon_exclude_patterns``. For such a parameter with gradient ``g`` and
    fp32 momentum ``m`` (accumulator ``moment1``):

    .. math::

        m &= m + (1 - \beta)(g - m) \\
        u &= g + \beta (m - g) \ \text{(nesterov) or } u = m \\
        p &= p (1 - lr \cdot wd) - lr \cdot s \cdot NS(u)

    with ``s`` from :func:`muon_update_scale`. Every other parameter is
    updated by Paddle's fused AdamW kernel with ``adam_beta1``,
    ``adam_beta2``, ``adam_epsilon`` and ``weight_decay``. Weight decay
    (both paths) applies where ``apply_decay_param_fun(param.name)`` is True
    (or it is None).

    Args:
        learning_rate (float|LRScheduler, optional): Default 0.02.
        parameters (list[Tensor]): Flat list of parameters (no groups).
        momentum (float, optional): Muon momentum ``beta``. Default 0.95.
        adam_beta1 (float, optional): Default 0.9.
        adam_beta2 (float, optional): Default 0.95.
        weight_decay (float, optional): Decoupled weight decay, both paths.
            Default 0.01.
        ns_steps (int, optional): Newton-Schulz iterations. Default 5.
        ns_coeff_type (str, optional): A key of ``NS_COEFFS_PRESETS`` or
            ``"custom"``. Default ``"simple"``.
        ns_coeffs (list[tuple]|None, optional): ``[(a, b, c), ...]`` for
            ``"custom"``.
        nesterov (bool, optional): Default True.
        adam_epsilon (float, optional): AdamW epsilon and the floor of the
            Newton-Schulz normalisation. Default 1e-9.
        grad_clip (GradientClipBase|None, optional): Gradient clipping.
        lr_ratio (Callable|None, optional): ``param -> float`` multiplying
            the learning rate of AdamW parameters.
        apply_decay_param_fun (Callable|None, optional): ``name -> bool``;
            False turns weight decay off for that parameter.
        muon_version (int, optional): Scale rule, see
            :func:`muon_update_scale`. Default 1.
        muon_exclude_patterns (list[str]|None, optional): Case-insensitive
            name substrings kept on AdamW. Default None (none).
        muon_extra_scale_factor (float, optional): Default 0.2.
        muon_param_info_map (dict[str, MuonParamInfo]|None, optional): Per
            parameter routing; parameters missing from it get the default
            rule.
        ns_matmul_dtype (str|paddle.dtype|None, optional): Dtype of the
            Newton-Schulz matmuls; None: bfloat16 on CUDA devices of compute
            capability >= 8, else float32.
        multi_precision (bool, optional): fp32 master weights for fp16/bf16
            parameters. Default False.
        name (str|None, optional): Unused, as in Paddle's optimizers.

    Examples:
        .. code-block:: python

            >>> import paddle
            >>> from paddle_muon_ext.optimizer import Muon
            >>> linear = paddle.nn.Linear(16, 8)
            >>> opt = Muon(parameters=linear.parameters())
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
        **kwargs: Any,
    ) -> None:
        self._check_arguments(
            parameters, grad_clip, momentum, adam_beta1, adam_beta2,
            adam_epsilon, weight_decay, ns_steps, lr_ratio,
        )
        if kwargs:
            from paddle.distributed.fleet.utils.log_util import logger

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
        self._momentum = float(momentum)
        self._beta1 = float(adam_beta1)
        self._beta2 = float(adam_beta2)
        self._weight_decay = float(weight_decay)
        self._ns_steps = ns_steps
        self._ns_coeff_type = ns_coeff_type
        self._ns_coeffs = resolve_ns_coeffs(ns_coeff_type, ns_coeffs)
        self._nesterov = bool(nesterov)
        self._epsilon = float(adam_epsilon)
        self._lr_ratio = lr_ratio
        self._apply_decay_param_fun = apply_decay_param_fun
        self._muon_version = muon_version
        self._muon_exclude_patterns = list(muon_exclude_patterns or [])
        self._muon_extra_scale_factor = float(muon_extra_scale_factor)
        self._ns_matmul_dtype = _resolve_ns_matmul_dtype(ns_matmul_dtype)
        self._multi_precision = multi_precision
        self._muon_param_info_map = self._build_param_info_map(
            self._parameter_list, muon_param_info_map
        )

    @staticmethod
    def _check_arguments(
        parameters, grad_clip, momentum, adam_beta1, adam_beta2, adam_epsilon,
        weight_decay, ns_steps, lr_ratio,
    ) -> None:
        if parameters is None:
            raise ValueError(
                "Muon needs parameters, got None; pass "
                "parameters=model.parameters()."
            )
        if not isinstance(parameters, list):
            raise TypeError(
                f"Muon needs parameters as a list, got {type(parameters).__name__}; "
                "pass parameters=list(...) or model.parameters()."
            )
        if any(isinstance(p, dict) for p in parameters):
            raise TypeError(
                "Muon does not support parameter groups (a list of dicts); "
                "pass a flat list of parameters and use muon_param_info_map / "
                "apply_decay_param_fun / param.optimize_attr['learning_rate'] "
                "for per-parameter options."
            )
        if grad_clip is not None and not isinstance(
            grad_clip, paddle.nn.clip.GradientClipBase
        ):
            raise TypeError(
                f"grad_clip must be a paddle.nn.clip.GradientClipBase (e.g. "
                f"paddle.nn.ClipGradByGlobalNorm(1.0)) or None, got "
                f"{type(grad_clip).__name__}."
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
        if not isinstance(ns_steps, int) or ns_steps < 1:
            raise ValueError(f"ns_steps must be a positive int, got {ns_steps!r}.")
        if lr_ratio is not None and not callable(lr_ratio):
            raise TypeError(
                f"lr_ratio must be a callable param -> float, got {type(lr_ratio).__name__}."
            )

    def _build_param_info_map(
        self, params: Sequence[Tensor], user_map: MuonParamInfoMap | None
    ) -> MuonParamInfoMap:
        # Every parameter gets an entry: MuonShardingOptimizer and the step
        # read routing only from this map.
        info_map = {
            p.name: MuonParamInfo(
                use_muon=_default_should_use_muon(
                    p.name, _muon_shape(p), self._muon_exclude_patterns
                )
            )
            for p in params
        }
        if not user_map:
            return info_map
        by_name = {p.name: p for p in params}
        for key, info in user_map.items():
            if not isinstance(info, MuonParamInfo):
                raise TypeError(
                    f"muon_param_info_map[{key!r}] must be a MuonParamInfo, "
                    f"got {type(info).__name__}."
                )
            param = by_name.get(key)
            if info.use_muon and param is not None and len(_muon_shape(param)) not in (2, 3):
                raise ValueError(
                    f"muon_param_info_map marks {key!r} as a Muon parameter, but "
                    f"Muon needs a 2-D or 3-D parameter (shape {_muon_shape(param)}); "
                    "set MuonParamInfo(use_muon=False) for it."
                )
        info_map.update(user_map)
        return info_map

    # ------------------------------------------------------------- accumulators
    def _create_accumulators(self, block, parameters):
        if isinstance(parameters, dict):
            raise TypeError(
                "Muon does not support parameter groups; pass params_grads as "
                "a flat list of (param, grad) pairs."
            )
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
            target = p
            if self._multi_precision and self._is_dtype_fp16_or_bf16(p.dtype):
                target = self._create_master_weight(p)
            # fp32 moments for low-precision params: bf16 moments lose most
            # of the (1 - beta) * g contribution each step.
            acc_dtype = paddle.float32 if self._is_dtype_fp16_or_bf16(p.dtype) else p.dtype
            self._add_accumulator(self._moment_acc_str, target, dtype=acc_dtype)
            if not use_muon:
                self._add_accumulator(self._moment2_acc_str, target, dtype=acc_dtype)
                # Shape [1] on CPU, as paddle.optimizer.AdamW keeps them, so
                # the adamw kernel reads them the same way.
                for acc, beta in (
                    (self._beta1_pow_acc_str, self._beta1),
                    (self._beta2_pow_acc_str, self._beta2),
                ):
                    self._add_accumulator(
                        acc, target, dtype=acc_dtype, fill_value=beta,
                        shape=[1], device="cpu",
                    )
            self._already_create_accumulator.add(p.name)

    # ------------------------------------------------------------------ updates
    def _decays(self, param: Tensor) -> bool:
        return self._apply_decay_param_fun is None or bool(
            self._apply_decay_param_fun(param.name)
        )

    def _master_weight(self, param: Tensor) -> Tensor | None:
        if self._multi_precision and self._is_dtype_fp16_or_bf16(param.dtype):
            return self._master_weights[param.name]
        return None

    def _append_optimize_op(self, block, param_and_grad):
        param, grad = param_and_grad
        lr = self._create_param_lr(param_and_grad)
        weight_decay = self._weight_decay if self._decays(param) else 0.0
        if not self._muon_param_info_map[param.name].use_muon:
            self._adamw_update(param, grad, lr, weight_decay)
            return None
        if len(_muon_shape(param)) not in (2, 3):
            # A Muon matrix must be owned whole: a slice means a wrapper bug,
            # and silently switching algorithm would hide it.
            raise ValueError(
                f"Parameter {param.name} is marked use_muon=True but has shape "
                f"{list(param.shape)}; Muon needs the whole 2-D or 3-D matrix."
            )
        self._muon_update(
            param,
            grad,
            lr,
            self._get_accumulator_master(self._moment_acc_str, param),
            self._momentum,
            self._ns_steps,
            self._nesterov,
            self._epsilon,
            weight_decay,
            self._muon_version,
        )
        return None

    @staticmethod
    def _zeropower_via_newtonschulz5(
        X: Tensor,
        steps: int,
        eps: float,
        ns_coeffs: Sequence[Sequence[float]],
        ns_matmul_dtype: paddle.dtype,
    ) -> Tensor:
        """Newton-Schulz orthogonalisation, see :func:`newton_schulz`."""
        return newton_schulz(X, ns_coeffs, steps, eps, ns_matmul_dtype)

    @staticmethod
    def _scaling_fn(update: Tensor, version: int, extra_scale_factor: float) -> Tensor:
        """``update`` times :func:`muon_update_scale` of its last two dims."""
        return update * muon_update_scale(update.shape, version, extra_scale_factor)

    def _muon_update(
        self,
        param: Tensor,
        grad: Tensor,
        lr: Tensor,
        momentum_buffer: Tensor,
        momentum_beta: float,
        ns_steps: int,
        nesterov: bool,
        epsilon: float,
        weight_decay: float,
        version: int,
    ) -> None:
        """One Muon step of ``param`` in place (and of its master weight).

        Args:
            param (Tensor): The parameter.
            grad (Tensor): Its gradient.
            lr (Tensor): Its learning rate.
            momentum_buffer (Tensor): Its fp32 ``moment1`` accumulator.
            momentum_beta (float): Momentum coefficient.
            ns_steps (int): Newton-Schulz iterations.
            nesterov (bool): Nesterov momentum.
            epsilon (float): Floor of the Newton-Schulz normalisation.
            weight_decay (float): Decoupled decay; 0 turns it off.
            version (int): Scale rule of :func:`muon_update_scale`.
        """
        g = grad if grad.dtype == momentum_buffer.dtype else paddle.cast(grad, momentum_buffer.dtype)
        paddle.assign(paddle.lerp(momentum_buffer, g, 1.0 - momentum_beta), output=momentum_buffer)
        update = paddle.lerp(g, momentum_buffer, momentum_beta) if nesterov else momentum_buffer
        muon_shape = _muon_shape(param)
        if list(update.shape) != muon_shape:
            update = update.reshape(muon_shape)

        def ortho_fn(block: Tensor) -> Tensor:
            ortho = self._zeropower_via_newtonschulz5(
                block, ns_steps, epsilon, self._ns_coeffs, self._ns_matmul_dtype
            )
            return self._scaling_fn(ortho, version, self._muon_extra_scale_factor)

        info = self._muon_param_info_map.get(param.name)
        if info is not None and info.split_concat_func is not None:
            if os.environ.get("MUON_DEBUG") == "1":
                from paddle.distributed.fleet.utils.log_util import logger

                logger.info(
                    f"Muon: {param.name} {muon_shape} orthogonalised by its split_concat_func"
                )
            ortho = info.split_concat_func(update, ortho_fn)
            if list(ortho.shape) != muon_shape:
                raise ValueError(
                    f"split_concat_func of {param.name} returned shape "
                    f"{list(ortho.shape)}, expected {muon_shape}."
                )
        else:
            ortho = ortho_fn(update)
        if list(ortho.shape) != list(param.shape):
            ortho = ortho.reshape(param.shape)

        master = self._master_weight(param)
        target = param if master is None else master
        w = target if target.dtype == paddle.float32 else paddle.cast(target, "float32")
        lr32 = lr if lr.dtype == paddle.float32 else paddle.cast(lr, "float32")
        if weight_decay > 0.0:
            w = w * (1.0 - lr32 * weight_decay)
        w = w - lr32 * ortho
        # assign(output=...) writes into the existing allocation, so params
        # that are views into fused buffers stay views.
        if master is not None:
            paddle.assign(w, output=master)
        paddle.assign(w if param.dtype == w.dtype else paddle.cast(w, param.dtype), output=param)

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
            None,  # skip_update: found_inf is handled by the base class
            self._beta1,
            self._beta2,
            self._epsilon,
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

    def _adamw_update(self, param: Tensor, grad: Tensor, lr: Tensor, weight_decay: float) -> None:
        accs = [
            self._get_accumulator_master(name, param)
            for name in (
                self._moment_acc_str,
                self._moment2_acc_str,
                self._beta1_pow_acc_str,
                self._beta2_pow_acc_str,
            )
        ]
        if self._lr_ratio is not None:
            # The GPU kernel multiplies lr by lr_ratio in fp32 too.
            lr = lr * float(self._lr_ratio(param))
        master = self._master_weight(param)
        if master is None:
            self._adamw_kernel(param, grad, lr, accs, None, weight_decay)
            return
        if self._has_low_precision_adamw_kernel(param):
            # The fused kernel updates master and param in one launch.
            self._adamw_kernel(param, grad, lr, accs, master, weight_decay)
            return
        # The CPU adamw kernel has no fp16/bf16 registration: run the fp32
        # kernel on the master weight (the same arithmetic the fused
        # multi-precision kernel does) and cast the result back.
        g32 = grad if grad.dtype == paddle.float32 else paddle.cast(grad, "float32")
        self._adamw_kernel(master, g32, lr, accs, None, weight_decay)
        paddle.assign(paddle.cast(master, param.dtype), output=param)

    # --------------------------------------------------------------- entry points
    @imperative_base.no_grad()
    def _apply_optimize(self, loss, startup_program, params_grads, param_group_idx=0):
        """Clip, then update Muon parameters first and AdamW parameters second.

        Wrappers call this with their own subset of ``(param, grad)`` pairs.

        Args:
            loss (Tensor|None): Unused in dygraph.
            startup_program (Program|None): Unused in dygraph.
            params_grads (list[tuple[Tensor, Tensor]]): Pairs to update.
            param_group_idx (int): Must be 0.

        Returns:
            list|None: What the base class returns (None in dygraph).
        """
        if not framework.in_dygraph_mode():
            raise NotImplementedError(
                "Muon supports dygraph mode only; call paddle.disable_static()."
            )
        if isinstance(params_grads, dict):
            raise TypeError(
                "Muon does not support parameter groups; pass params_grads as "
                "a flat list of (param, grad) pairs."
            )
        if self._grad_clip is not None:
            params_grads = self._grad_clip(params_grads)
        params_grads = [(p, g) for p, g in params_grads if g is not None]
        missing = [
            f"{p.name} {list(p.shape)}"
            for p, _ in params_grads
            if p.name not in self._muon_param_info_map
        ]
        if missing:
            raise ValueError(
                f"Parameters {missing} have gradients but no entry in "
                "muon_param_info_map; build Muon with these parameters or add "
                "MuonParamInfo(use_muon=...) entries for them."
            )
        muon = [pg for pg in params_grads if self._muon_param_info_map[pg[0].name].use_muon]
        adamw = [pg for pg in params_grads if not self._muon_param_info_map[pg[0].name].use_muon]
        return self._create_optimization_pass(muon + adamw, param_group_idx=param_group_idx)

    @imperative_base.no_grad()
    @framework.non_static_only
    def step(self) -> None:
        """Update every parameter of ``self._parameter_list`` that has a grad.

        ``main_grad`` (AMP master gradients) is preferred over ``grad``.

        Returns:
            None
        """
        params_grads = []
        for param in self._parameter_list:
            if param.stop_gradient:
                continue
            main_grad = getattr(param, "main_grad", None)
            if main_grad is not None:
                params_grads.append((param, main_grad))
                continue
            grad = param._grad_ivar()
            if grad is not None:
                params_grads.append((param, grad))
        self._apply_optimize(loss=None, startup_program=None, params_grads=params_grads)

    def sharded_state_dict(self, model_sharded_state_dict: dict) -> dict:
        """Describe the optimizer state for ``paddle.distributed.flex_checkpoint``.

        Keys are ``"<structured name>.<state>"`` (``moment1_0``, ``moment2_0``,
        ``beta1_pow_acc_0``, ``beta2_pow_acc_0``) and ``"<structured name>.w_0"``
        for master weights. Tensor states take the parameter's local shape and
        global offset; scalars are shape ``(1,)``.

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
