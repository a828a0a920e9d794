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
other parameter is updated with AdamW. Mirrors ``python/paddle/optimizer/muon.py``.
"""

from __future__ import annotations

import math
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
    "NS_COEFFS_PRESETS",
    "muon_update_scale",
    "newton_schulz",
    "resolve_ns_coeffs",
]

NSCoeff = tuple[float, float, float]

# (a, b, c) of the quintic X <- a*X + (b*A + c*A*A)*X with A = X*X^T.
NS_COEFFS_PRESETS: dict[str, list[NSCoeff]] = {
    # Keller Jordan's tuned coefficients: they push singular values into
    # roughly [0.7, 1.2] within ~5 steps instead of converging exactly.
    "simple": [(3.4445, -4.7750, 2.0315)],
    # The classical degree-5 Newton-Schulz iteration for the polar factor
    # (Taylor expansion of (X^T X)^{-1/2}): converges to an exactly
    # orthogonal matrix, but needs more steps than "simple".
    "quintic": [(15.0 / 8.0, -10.0 / 8.0, 3.0 / 8.0)],
}

_SUPPORTED_MUON_VERSIONS = (1, 2, 3)
# Added to the Frobenius norm so an all-zero update does not divide by zero.
_NS_NORM_EPS = 1e-7


@dataclass
class MuonParamInfo:
    """How Muon treats one parameter.

    Args:
        use_muon (bool): Update the parameter with Muon (True) or AdamW (False).
        split_concat_func (Callable|None): For fused matrices (e.g. a QKV
            weight) whose blocks should be orthogonalised separately. Called as
            ``split_concat_func(update, orthogonalize)`` where ``update`` is the
            fp32 momentum update with the parameter's shape and
            ``orthogonalize(block)`` returns ``muon_update_scale(block.shape) *
            newton_schulz(block)``; it must split ``update`` into blocks, apply
            ``orthogonalize`` to each and return the blocks concatenated back to
            the parameter's shape. None orthogonalises the whole matrix.
    """

    use_muon: bool = True
    split_concat_func: Callable[..., Any] | None = None


def resolve_ns_coeffs(
    ns_coeff_type: str, ns_coeffs: Sequence[Sequence[float]] | None = None
) -> list[NSCoeff]:
    """Return the Newton-Schulz coefficient list for a preset or custom list.

    Args:
        ns_coeff_type (str): One of ``NS_COEFFS_PRESETS`` (``"simple"``,
            ``"quintic"``) or ``"custom"``.
        ns_coeffs (Sequence|None): ``[(a, b, c), ...]``, required (non-empty)
            when ``ns_coeff_type == "custom"``; cycled over the iterations.

    Returns:
        list[tuple[float, float, float]]: The coefficients.
    """
    if ns_coeff_type == "custom":
        if not ns_coeffs:
            raise ValueError(
                "ns_coeff_type='custom' needs a non-empty ns_coeffs list of "
                "(a, b, c) tuples."
            )
        result = []
        for coeff in ns_coeffs:
            if len(coeff) != 3:
                raise ValueError(
                    f"Each Newton-Schulz coefficient must be (a, b, c), got {coeff!r}."
                )
            result.append(tuple(float(v) for v in coeff))
        return result
    if ns_coeff_type not in NS_COEFFS_PRESETS:
        valid = sorted([*NS_COEFFS_PRESETS, "custom"])
        raise ValueError(
            f"Unknown ns_coeff_type {ns_coeff_type!r}; valid types: {valid}."
        )
    return list(NS_COEFFS_PRESETS[ns_coeff_type])


def _swap_last_two(x: Tensor) -> Tensor:
    perm = list(range(x.ndim))
    perm[-2], perm[-1] = perm[-1], perm[-2]
    return paddle.transpose(x, perm)


def newton_schulz(
    x: Tensor, coeffs: Sequence[Sequence[float]], steps: int
) -> Tensor:
    """Approximately orthogonalise a matrix (or a batch of matrices).

    Computes in float32. A 3-D input ``[E, H, I]`` is treated as ``E``
    independent matrices, processed in one batched computation.

    Args:
        x (Tensor): 2-D or 3-D tensor, any float dtype.
        coeffs (Sequence): ``[(a, b, c), ...]``; iteration ``i`` uses
            ``coeffs[i % len(coeffs)]``.
        steps (int): Number of iterations (>= 0).

    Returns:
        Tensor: float32 tensor with the shape of ``x``.
    """
    if x.ndim not in (2, 3):
        raise ValueError(
            f"newton_schulz expects a 2-D or 3-D tensor, got shape {list(x.shape)}."
        )
    if not coeffs:
        raise ValueError("newton_schulz needs at least one (a, b, c) coefficient.")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}.")
    X = x if x.dtype == paddle.float32 else paddle.cast(x, "float32")
    # Iterating on the wide orientation keeps A = X X^T at min(m, n)^2, the
    # cheaper of the two Gram matrices.
    transposed = X.shape[-2] > X.shape[-1]
    if transposed:
        X = _swap_last_two(X)
    # Newton-Schulz only converges when all singular values are <= 1; the
    # Frobenius norm bounds the spectral norm.
    norm = paddle.linalg.norm(X, p="fro", axis=[-2, -1], keepdim=True)
    X = X / (norm + _NS_NORM_EPS)
    # addmm/baddbmm fold the scalar multiply-adds into the GEMMs: separate
    # element-wise passes cost up to 50% on top of the matmuls
    # (tools/bench/bench_newton_schulz.py).
    gemm = paddle.addmm if X.ndim == 2 else paddle.baddbmm
    for i in range(steps):
        a, b, c = coeffs[i % len(coeffs)]
        A = paddle.matmul(X, X, transpose_y=True)
        B = gemm(A, A, A, beta=b, alpha=c)  # b*A + c*A@A
        X = gemm(X, B, X, beta=a, alpha=1.0)  # a*X + B@X
    if transposed:
        X = _swap_last_two(X)
    return X


def muon_update_scale(
    shape: Sequence[int], version: int = 1, extra_scale_factor: float = 0.2
) -> float:
    """Scale applied to the orthogonalised update of a matrix.

    ``din, dout = shape[-2], shape[-1]`` (Paddle stores Linear weights as
    ``[in, out]``).

    Args:
        shape (Sequence[int]): Parameter shape (2-D or 3-D).
        version (int): 1: ``sqrt(max(1, dout/din))``; 2: ``sqrt(dout/din)``;
            3: ``extra_scale_factor * sqrt(max(din, dout))`` (matches AdamW's
            update RMS so AdamW hyper-parameters transfer).
        extra_scale_factor (float): Factor used by version 3.

    Returns:
        float: The scale.
    """
    if len(shape) < 2:
        raise ValueError(f"muon_update_scale needs a matrix shape, got {list(shape)}.")
    din, dout = int(shape[-2]), int(shape[-1])
    if version == 1:
        return math.sqrt(max(1.0, dout / din))
    if version == 2:
        return math.sqrt(dout / din)
    if version == 3:
        return float(extra_scale_factor) * math.sqrt(max(din, dout))
    raise ValueError(
        f"Unknown muon_version {version!r}; valid versions: {list(_SUPPORTED_MUON_VERSIONS)}."
    )


class Muon(Optimizer):
    r"""
    Muon (MomentUm Orthogonalized by Newton-Schulz) with an AdamW fallback.

    A parameter uses Muon when it is 2-D, or 3-D ``[E, H, I]`` (E expert
    matrices, orthogonalised independently), and its name matches none of
    ``muon_exclude_patterns``, unless ``muon_param_info_map`` says otherwise.
    For such a parameter ``p`` with gradient ``g`` and momentum ``m``:

    .. math::

        m &= \beta m + (1 - \beta) g \\
        u &= (1 - \beta) g + \beta m \ \text{(nesterov) or } u = m \\
        p &= p (1 - lr \cdot wd) - lr \cdot scale \cdot NS(u)

    Every other parameter is updated exactly like ``paddle.optimizer.AdamW``
    with ``adam_beta1``, ``adam_beta2``, ``adam_epsilon`` and ``weight_decay``.
    Weight decay (both branches) is applied only where
    ``apply_decay_param_fun(param.name)`` is True (or it is None).

    Args:
        learning_rate (float|LRScheduler): Learning rate (both branches).
        parameters (list[Tensor]): Flat list of parameters; parameter groups
            (lists of dicts) are not supported.
        momentum (float, optional): Muon momentum ``beta``. Default 0.95.
        nesterov (bool, optional): Nesterov momentum. Default True.
        ns_steps (int, optional): Newton-Schulz iterations. Default 5.
        ns_coeff_type (str, optional): ``"simple"``, ``"quintic"`` or
            ``"custom"``. Default ``"simple"``.
        ns_coeffs (list[tuple]|None, optional): ``[(a, b, c), ...]`` for
            ``"custom"``, cycled over the iterations.
        adam_beta1 (float, optional): AdamW beta1. Default 0.9.
        adam_beta2 (float, optional): AdamW beta2. Default 0.95.
        adam_epsilon (float, optional): AdamW epsilon. Default 1e-8.
        weight_decay (float, optional): Decoupled weight decay coefficient for
            both branches. Default 0.01.
        muon_version (int, optional): Update scale rule, see
            :func:`muon_update_scale`. Default 1.
        muon_extra_scale_factor (float, optional): Factor of version 3.
            Default 0.2.
        muon_exclude_patterns (list[str]|None, optional): Case-insensitive
            name substrings; matching parameters use AdamW. Default None.
        muon_param_info_map (dict[str, MuonParamInfo]|None, optional): Per
            parameter name routing. Entries override the shape/pattern rule;
            parameters missing from it get the rule. Default None.
        apply_decay_param_fun (Callable|None, optional): ``name -> bool``
            selecting the parameters that get weight decay. Default None (all).
        grad_clip (GradientClipBase|None, optional): Gradient clipping.
        multi_precision (bool, optional): Keep fp32 master weights for
            fp16/bf16 parameters. Default False.
        name (str|None, optional): Prefix of the accumulator names.

    Examples:
        .. code-block:: python

            >>> import paddle
            >>> from paddle_muon_ext.optimizer import Muon
            >>> linear = paddle.nn.Linear(16, 8)
            >>> opt = Muon(
            ...     learning_rate=0.02,
            ...     parameters=linear.parameters(),
            ...     muon_exclude_patterns=["embedding"],
            ... )
            >>> loss = linear(paddle.rand([4, 16])).mean()
            >>> loss.backward()
            >>> opt.step()
            >>> opt.clear_grad()
    """

    type = "muon"
    _momentum_acc_str = "muon_momentum"
    _moment1_acc_str = "moment1"
    _moment2_acc_str = "moment2"
    _beta1_pow_acc_str = "beta1_pow_acc"
    _beta2_pow_acc_str = "beta2_pow_acc"

    def __init__(
        self,
        learning_rate: float | LRScheduler,
        parameters: Sequence[Tensor] | None = None,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_coeff_type: str = "simple",
        ns_coeffs: Sequence[Sequence[float]] | None = None,
        adam_beta1: float = 0.9,
        adam_beta2: float = 0.95,
        adam_epsilon: float = 1e-8,
        weight_decay: float = 0.01,
        muon_version: int = 1,
        muon_extra_scale_factor: float = 0.2,
        muon_exclude_patterns: Sequence[str] | None = None,
        muon_param_info_map: dict[str, MuonParamInfo] | None = None,
        apply_decay_param_fun: Callable[[str], bool] | None = None,
        grad_clip: GradientClipBase | None = None,
        multi_precision: bool = False,
        name: str | None = None,
    ) -> None:
        if parameters is not None and not isinstance(parameters, paddle.Tensor):
            parameters = list(parameters)
            if any(isinstance(p, dict) for p in parameters):
                raise TypeError(
                    "Muon does not support parameter groups (a list of dicts); "
                    "pass a flat list of parameters and use "
                    "muon_param_info_map / apply_decay_param_fun / "
                    "param.optimize_attr['learning_rate'] for per-parameter options."
                )
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}.")
        if not 0.0 <= adam_beta1 < 1.0:
            raise ValueError(f"adam_beta1 must be in [0, 1), got {adam_beta1}.")
        if not 0.0 <= adam_beta2 < 1.0:
            raise ValueError(f"adam_beta2 must be in [0, 1), got {adam_beta2}.")
        if adam_epsilon < 0.0:
            raise ValueError(f"adam_epsilon must be >= 0, got {adam_epsilon}.")
        if not isinstance(weight_decay, (int, float)):
            raise TypeError(
                f"weight_decay must be a float, got {type(weight_decay).__name__}."
            )
        if not isinstance(ns_steps, int) or ns_steps < 1:
            raise ValueError(f"ns_steps must be a positive int, got {ns_steps!r}.")
        if muon_version not in _SUPPORTED_MUON_VERSIONS:
            raise ValueError(
                f"Unknown muon_version {muon_version!r}; valid versions: "
                f"{list(_SUPPORTED_MUON_VERSIONS)}."
            )
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
        self._nesterov = bool(nesterov)
        self._ns_steps = ns_steps
        self._ns_coeff_type = ns_coeff_type
        self._ns_coeffs = resolve_ns_coeffs(ns_coeff_type, ns_coeffs)
        self._beta1 = float(adam_beta1)
        self._beta2 = float(adam_beta2)
        self._epsilon = float(adam_epsilon)
        self._weight_decay = float(weight_decay)
        self._muon_version = muon_version
        self._muon_extra_scale_factor = float(muon_extra_scale_factor)
        self._muon_exclude_patterns = [
            str(p).lower() for p in (muon_exclude_patterns or [])
        ]
        self._apply_decay_param_fun = apply_decay_param_fun
        self._multi_precision = multi_precision
        self._muon_param_info_map = self._build_param_info_map(
            self._parameter_list or [], muon_param_info_map
        )
        self._warned_fallback: set[str] = set()

    # ------------------------------------------------------------------ routing
    def _matches_exclude_pattern(self, name: str) -> bool:
        lowered = name.lower()
        return any(pat in lowered for pat in self._muon_exclude_patterns)

    def _default_use_muon(self, param: Tensor) -> bool:
        return len(param.shape) in (2, 3) and not self._matches_exclude_pattern(
            param.name
        )

    def _build_param_info_map(
        self,
        params: Sequence[Tensor],
        user_map: dict[str, MuonParamInfo] | None,
    ) -> dict[str, MuonParamInfo]:
        info_map = {p.name: MuonParamInfo(use_muon=self._default_use_muon(p)) for p in params}
        if user_map:
            for key, info in user_map.items():
                if not isinstance(info, MuonParamInfo):
                    raise TypeError(
                        f"muon_param_info_map[{key!r}] must be a MuonParamInfo, "
                        f"got {type(info).__name__}."
                    )
            by_name = {p.name: p for p in params}
            for key, info in user_map.items():
                param = by_name.get(key)
                if info.use_muon and param is not None and len(param.shape) not in (2, 3):
                    raise ValueError(
                        f"muon_param_info_map marks {key!r} as a Muon parameter, "
                        f"but Muon needs a 2-D or 3-D parameter (shape {list(param.shape)})."
                    )
            info_map.update(user_map)
        return info_map

    def _param_info(self, param: Tensor) -> MuonParamInfo:
        """Routing for ``param``; names unknown to the map use the shape rule."""
        info = self._muon_param_info_map.get(param.name)
        if info is None:
            info = MuonParamInfo(use_muon=self._default_use_muon(param))
            if param.name not in self._warned_fallback:
                # Imported here: paddle.optimizer is imported while paddle
                # itself initialises, before paddle.distributed can be.
                from paddle.distributed.fleet.utils.log_util import logger

                self._warned_fallback.add(param.name)
                logger.info(
                    f"Muon: parameter {param.name} (shape {list(param.shape)}) is "
                    f"not in muon_param_info_map; use_muon={info.use_muon} from its shape."
                )
        elif info.use_muon and len(param.shape) not in (2, 3):
            # Silently switching algorithm would hide a sharding bug (a Muon
            # matrix must be owned whole, never sliced).
            raise ValueError(
                f"Parameter {param.name} is marked use_muon=True but has shape "
                f"{list(param.shape)}; Muon needs the whole 2-D or 3-D matrix."
            )
        return info

    def _use_muon(self, param: Tensor) -> bool:
        return self._param_info(param).use_muon

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
            target = p
            if self._multi_precision and self._is_dtype_fp16_or_bf16(p.dtype):
                target = self._create_master_weight(p)
            # Moments stay fp32 for low-precision params: bf16 moments lose
            # most of the (1 - beta) * g contribution each step.
            acc_dtype = paddle.float32 if self._is_dtype_fp16_or_bf16(p.dtype) else p.dtype
            if self._use_muon(p):
                self._add_accumulator(self._momentum_acc_str, target, dtype=acc_dtype)
            else:
                self._add_accumulator(self._moment1_acc_str, target, dtype=acc_dtype)
                self._add_accumulator(self._moment2_acc_str, target, dtype=acc_dtype)
                # On CPU and shape [1], as paddle.optimizer.AdamW keeps them,
                # so the adamw kernel reads them the same way.
                self._add_accumulator(
                    self._beta1_pow_acc_str,
                    target,
                    dtype=acc_dtype,
                    fill_value=self._beta1,
                    shape=[1],
                    device="cpu",
                )
                self._add_accumulator(
                    self._beta2_pow_acc_str,
                    target,
                    dtype=acc_dtype,
                    fill_value=self._beta2,
                    shape=[1],
                    device="cpu",
                )
            self._already_create_accumulator.add(p.name)

    # ------------------------------------------------------------------ updates
    def _with_decay(self, param: Tensor) -> bool:
        if self._weight_decay == 0.0:
            return False
        return self._apply_decay_param_fun is None or bool(
            self._apply_decay_param_fun(param.name)
        )

    def _append_optimize_op(self, block, param_and_grad):
        param, grad = param_and_grad
        lr = self._create_param_lr(param_and_grad)
        info = self._param_info(param)
        if info.use_muon:
            self._muon_update(param, grad, lr, info)
        else:
            self._adamw_update(param, grad, lr)
        return None

    def _orthogonalized_update(self, update: Tensor, info: MuonParamInfo, shape) -> Tensor:
        def orthogonalize(block: Tensor) -> Tensor:
            scale = muon_update_scale(
                block.shape, self._muon_version, self._muon_extra_scale_factor
            )
            return newton_schulz(block, self._ns_coeffs, self._ns_steps) * scale

        if info.split_concat_func is not None:
            out = info.split_concat_func(update, orthogonalize)
            if list(out.shape) != list(shape):
                raise ValueError(
                    f"split_concat_func returned shape {list(out.shape)}, "
                    f"expected {list(shape)}."
                )
            return out
        return orthogonalize(update)

    def _muon_update(self, param: Tensor, grad: Tensor, lr: Tensor, info: MuonParamInfo) -> None:
        find_master = self._multi_precision and self._is_dtype_fp16_or_bf16(param.dtype)
        master = self._master_weights[param.name] if find_master else None
        momentum = self._get_accumulator_master(self._momentum_acc_str, param)
        beta = self._momentum

        g = grad if grad.dtype == momentum.dtype else paddle.cast(grad, momentum.dtype)
        new_m = beta * momentum + (1.0 - beta) * g
        paddle.assign(new_m, output=momentum)
        update = (1.0 - beta) * g + beta * new_m if self._nesterov else new_m

        ortho = self._orthogonalized_update(update, info, param.shape)

        target = master if find_master else param
        w = target if target.dtype == paddle.float32 else paddle.cast(target, "float32")
        lr32 = lr if lr.dtype == paddle.float32 else paddle.cast(lr, "float32")
        if self._with_decay(param):
            w = w * (1.0 - lr32 * self._weight_decay)
        w = w - lr32 * ortho
        if find_master:
            paddle.assign(w, output=master)
        # assign(output=...) writes into the existing allocation, so params
        # that are views into fused buffers stay views.
        paddle.assign(
            w if param.dtype == paddle.float32 else paddle.cast(w, param.dtype),
            output=param,
        )

    def _adamw_kernel(self, param, grad, lr, accs, master, find_master, with_decay):
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
            1.0,  # lr_ratio
            self._weight_decay,
            with_decay,
            False,  # lazy_mode
            1000,  # min_row_size_to_use_multithread, as in AdamW
            find_master,
            False,  # use_global_beta_pow
            False,  # amsgrad
        )

    @staticmethod
    def _has_low_precision_adamw_kernel(param: Tensor) -> bool:
        # Only the GPU/XPU adamw kernels are registered for fp16/bf16 params.
        place = param.place
        return place.is_gpu_place() or place.is_xpu_place()

    def _adamw_update(self, param: Tensor, grad: Tensor, lr: Tensor) -> None:
        find_master = self._multi_precision and self._is_dtype_fp16_or_bf16(param.dtype)
        accs = [
            self._get_accumulator_master(name, param)
            for name in (
                self._moment1_acc_str,
                self._moment2_acc_str,
                self._beta1_pow_acc_str,
                self._beta2_pow_acc_str,
            )
        ]
        with_decay = self._with_decay(param)
        if not find_master:
            self._adamw_kernel(param, grad, lr, accs, None, False, with_decay)
            return
        master = self._master_weights[param.name]
        if self._has_low_precision_adamw_kernel(param):
            # The fused kernel updates master and param in one launch.
            self._adamw_kernel(param, grad, lr, accs, master, True, with_decay)
            return
        # The CPU adamw kernel has no fp16/bf16 registration: run the fp32
        # kernel on the master weight (the same arithmetic the fused
        # multi-precision kernel does) and cast the result back.
        g32 = grad if grad.dtype == paddle.float32 else paddle.cast(grad, "float32")
        self._adamw_kernel(master, g32, lr, accs, None, False, with_decay)
        paddle.assign(paddle.cast(master, param.dtype), output=param)

    # --------------------------------------------------------------- entry points
    @imperative_base.no_grad()
    def _apply_optimize(self, loss, startup_program, params_grads, param_group_idx=0):
        """Clip (``self._grad_clip``), then update each ``(param, grad)``.

        Wrappers call this with their own subset of ``(param, grad)`` pairs.

        Args:
            loss (Tensor|None): Unused in dygraph.
            startup_program (Program|None): Unused in dygraph.
            params_grads (list[tuple[Tensor, Tensor]]): Pairs to update.
            param_group_idx (int): Must be 0.

        Returns:
            list|None: What the base class returns (None in dygraph).
        """
        return super()._apply_optimize(
            loss, startup_program, params_grads, param_group_idx=param_group_idx
        )

    @imperative_base.no_grad()
    @framework.non_static_only
    def step(self) -> None:
        """Update every parameter of ``self._parameter_list`` that has a grad.

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
