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
"""Load a Paddle checkout's own MuonShardingOptimizer into a paddle 3.3.1 process.

The conformance suite (``test/collective/fleet/test_muon_conformance*.py``)
and ``tools/coverage/upstream_coverage.py`` test the optimizer file of a
Paddle source tree (``--paddle-root DIR`` / ``PADDLE_ROOT``) against the same
expectations as this package's optimizer. Develop's file imports only modules
the 3.3.1 wheel has; what it needs at run time is what develop's Paddle has
and 3.3.1 lacks: the ``sharding_configs`` fields it reads
(``comm_group_call_opt``, ...), given by :func:`~.patch.patch_paddle`, and on
a CPU box the CPU entry of the tensor-fusion table
(:func:`register_cpu_tensor_fusion`). :func:`load_develop_optimizer` supplies
both (asking for develop's file is asking for develop's names). The file is
executed from the checkout as it is, under a private module name, so it
neither shadows nor is shadowed by the package's modules that ``patch_paddle()``
installs under ``paddle.*``; no file of the checkout or of the wheel is written.

``python/paddle/optimizer/muon.py`` of the checkout is loaded the same way by
:func:`load_develop_muon` when it exists; a version that does not import on
3.3.1 is reported (``None`` and the reason in one line), never edited. One
kernel difference is bridged for that module only: develop's CPU ``adamw_``
reads the learning rate as float64 (PR #78830) and develop's Muon passes it
so, while 3.3.1's CPU kernel reads float32 only; where this Paddle's kernel
refuses float64, the loaded module's ``_C_ops`` is a view of Paddle's whose
``adamw_`` casts the learning rate to float32 for a non-float64 parameter on
CPU (develop's CPU kernel casts it to float itself, so the update is the
same). Nothing outside that module changes.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

from paddle.distributed.fleet.utils.log_util import logger

from .cpu_tensor_fusion import register_cpu_tensor_fusion
from .patch import is_patched, patch_paddle

__all__ = [
    "CPU_ADAMW_LR_SHIM",
    "MUON_RELPATH",
    "OPTIMIZER_RELPATH",
    "DevelopTreeError",
    "LoadedMuon",
    "cpu_adamw_takes_float64_lr",
    "develop_optimizer_path",
    "load_develop_muon",
    "load_develop_optimizer",
    "one_line",
]

#: Develop's optimizer, relative to the root of a Paddle source checkout.
OPTIMIZER_RELPATH = "python/paddle/distributed/fleet/meta_optimizers/muon_sharding_optimizer.py"
#: Develop's Muon optimizer, relative to the same root.
MUON_RELPATH = "python/paddle/optimizer/muon.py"

# Private module names: develop's code must not shadow (or be shadowed by) the
# package's modules that patch_paddle() may install under paddle.* names.
_OPTIMIZER_MODULE = "_paddle_develop_muon_sharding_optimizer"
# muon.py imports relatively (``from .optimizer import Optimizer``, ``from
# ..nn.clip import ...``), so it runs as a private submodule of paddle.optimizer
# (registered in sys.modules only; the package gets no attribute).
_MUON_MODULE = "paddle.optimizer._develop_muon"

# resolved file path -> loaded module (a checkout is loaded once per process)
_LOADED: dict[str, ModuleType] = {}


class DevelopTreeError(ValueError):
    """The directory given as a Paddle checkout does not hold develop's file."""


def develop_optimizer_path(root: str) -> str:
    """Where a Paddle checkout keeps MuonShardingOptimizer.

    Args:
        root: the checkout's root directory (the one holding ``python/``).

    Returns:
        The absolute path of its ``muon_sharding_optimizer.py``.

    Raises:
        DevelopTreeError: ``root`` is not a directory or lacks the file; the
            message names the path, what is expected there and the fix.
    """
    root = os.path.abspath(os.path.expanduser(root))
    if not os.path.isdir(root):
        raise DevelopTreeError(
            f"paddle root {root!r} is not a directory; pass the root of a Paddle "
            "source checkout (the directory holding python/paddle/)")
    path = os.path.join(root, *OPTIMIZER_RELPATH.split("/"))
    if not os.path.isfile(path):
        raise DevelopTreeError(
            f"paddle root {root!r} has no {OPTIMIZER_RELPATH}; pass the root of a "
            "Paddle source checkout whose tree holds MuonShardingOptimizer")
    return path


def _exec_file(path: str, name: str) -> ModuleType:
    """Execute ``path`` as module ``name`` (registered while it runs, as import does)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def load_develop_optimizer(root: str) -> ModuleType:
    """Develop's ``muon_sharding_optimizer`` module from the checkout at ``root``.

    Calls ``patch_paddle()`` first (develop reads ``sharding_configs`` fields
    3.3.1 lacks) and registers CPU with Paddle's tensor fusion (a no-op on
    accelerator builds; develop's FusedCommBuffers are otherwise refused on a
    CPU place).

    Args:
        root: the checkout's root directory.

    Returns:
        The executed module (``MuonShardingOptimizer``, ``get_gpus_per_node``,
        ...); the same object for the same file on later calls.

    Raises:
        DevelopTreeError: see :func:`develop_optimizer_path`.
    """
    path = os.path.realpath(develop_optimizer_path(root))
    if path in _LOADED:
        return _LOADED[path]
    if not is_patched():
        patch_paddle()
    register_cpu_tensor_fusion()
    # one name per file: two checkouts in one process keep their own modules
    name = _OPTIMIZER_MODULE if not _LOADED else f"{_OPTIMIZER_MODULE}_{len(_LOADED)}"
    module = _exec_file(path, name)
    _LOADED[path] = module
    logger.info(f"loaded develop's MuonShardingOptimizer from {path}")
    return module


@dataclasses.dataclass(frozen=True)
class LoadedMuon:
    """The outcome of loading a checkout's ``muon.py``.

    Attributes:
        module: the executed module, or None when absent or not runnable.
        reason: why ``module`` is None, one line ("" when it loaded).
        shims: what the loader supplied that this Paddle lacks (names, e.g.
            :data:`CPU_ADAMW_LR_SHIM`); empty when the file runs as it is.
    """

    module: ModuleType | None
    reason: str
    shims: tuple[str, ...] = ()


#: How the report names the adamw_ learning-rate bridge (see the module docstring).
CPU_ADAMW_LR_SHIM = "CPU adamw_ float64 learning rate cast to float32"


def one_line(error: BaseException) -> str:
    """``Type: first line of the message`` (Paddle's errors span many lines)."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


@functools.lru_cache(maxsize=None)
def cpu_adamw_takes_float64_lr() -> bool:
    """Whether this Paddle's CPU ``adamw_`` kernel reads a float64 learning rate.

    Develop's does (PR #78830); 3.3.1's reads float32 only and raises on a
    float64 tensor. Asked of the kernel itself, on a 1-element parameter.
    """
    import paddle
    from paddle import _C_ops

    with paddle.no_grad():
        def t(value: float) -> Any:
            return paddle.full([1], value, "float32").cpu()

        try:
            _C_ops.adamw_(t(1.0), t(1.0), paddle.full([1], 0.1, "float64").cpu(), t(0.0),
                          t(0.0), None, t(0.9), t(0.95), None, None, 0.9, 0.95, 1e-8, 1.0,
                          0.0, False, False, 1000, False, False, False)
        except (ValueError, RuntimeError, TypeError):
            return False
    return True


class _Float32LrOnCpuOps:
    """``paddle._C_ops`` as develop's ``muon.py`` sees it on a Paddle whose CPU
    ``adamw_`` reads a float32 learning rate; every other name is Paddle's."""

    def __init__(self, ops: ModuleType) -> None:
        self._ops = ops

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ops, name)

    def adamw_(self, param: Any, grad: Any, learning_rate: Any, *args: Any, **kwargs: Any) -> Any:
        import paddle

        if (learning_rate.dtype == paddle.float64 and param.dtype != paddle.float64
                and param.place.is_cpu_place()):
            # develop's CPU kernel (float and double only) reads the float64
            # rate and casts it to float for a float32 parameter: the same value
            learning_rate = paddle.cast(learning_rate, "float32")
        return self._ops.adamw_(param, grad, learning_rate, *args, **kwargs)


def load_develop_muon(root: str) -> LoadedMuon:
    """Develop's ``paddle/optimizer/muon.py`` from ``root``, where it runs on 3.3.1.

    Args:
        root: the checkout's root directory (validated like
            :func:`develop_optimizer_path`).

    Returns:
        :class:`LoadedMuon`: the module (with the shims it was given), or
        None and the reason in one line (absent file, or the exception its
        import raised on this Paddle).
    """
    develop_optimizer_path(root)
    path = os.path.join(os.path.abspath(os.path.expanduser(root)), *MUON_RELPATH.split("/"))
    if not os.path.isfile(path):
        return LoadedMuon(None, f"no {MUON_RELPATH} in the checkout")
    try:
        module = _exec_file(path, _MUON_MODULE)
    except Exception as error:  # a newer file needing names 3.3.1 lacks
        reason = f"{MUON_RELPATH} does not import on paddle 3.3.1: {one_line(error)}"
        logger.info(reason)
        return LoadedMuon(None, reason)
    shims = []
    ops = getattr(module, "_C_ops", None)
    if isinstance(ops, ModuleType) and not cpu_adamw_takes_float64_lr():
        module._C_ops = _Float32LrOnCpuOps(ops)
        shims.append(CPU_ADAMW_LR_SHIM)
    return LoadedMuon(module, "", tuple(shims))
