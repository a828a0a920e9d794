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
:func:`load_develop_muon` when it exists; a version that does not run on 3.3.1
is reported (``None`` and the reason), never patched.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from types import ModuleType

from paddle.distributed.fleet.utils.log_util import logger

from .cpu_tensor_fusion import register_cpu_tensor_fusion
from .patch import is_patched, patch_paddle

__all__ = [
    "MUON_RELPATH",
    "OPTIMIZER_RELPATH",
    "DevelopTreeError",
    "LoadedMuon",
    "develop_optimizer_path",
    "load_develop_muon",
    "load_develop_optimizer",
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
        reason: why ``module`` is None ("" when it loaded).
    """

    module: ModuleType | None
    reason: str


def load_develop_muon(root: str) -> LoadedMuon:
    """Develop's ``paddle/optimizer/muon.py`` from ``root``, where it runs on 3.3.1.

    Args:
        root: the checkout's root directory (validated like
            :func:`develop_optimizer_path`).

    Returns:
        :class:`LoadedMuon`: the module, or None and the reason (absent file,
        or the exception its import raised on this Paddle).
    """
    develop_optimizer_path(root)
    path = os.path.join(os.path.abspath(os.path.expanduser(root)), *MUON_RELPATH.split("/"))
    if not os.path.isfile(path):
        return LoadedMuon(None, f"no {MUON_RELPATH} in the checkout")
    try:
        return LoadedMuon(_exec_file(path, _MUON_MODULE), "")
    except Exception as error:  # a newer file needing names 3.3.1 lacks
        reason = f"{MUON_RELPATH} does not import on paddle 3.3.1: {type(error).__name__}: {error}"
        logger.info(reason)
        return LoadedMuon(None, reason)
