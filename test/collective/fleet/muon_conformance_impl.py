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
"""The MuonShardingOptimizer the conformance suite tests, chosen in one place.

* Default (CI): this repository's optimizer.
* ``PADDLE_ROOT=DIR`` (or ``pytest --paddle-root DIR``, which sets it): the
  ``muon_sharding_optimizer.py`` of the Paddle checkout at DIR, loaded by the
  3.3.1 compat layer (``compat_paddle_3_3.develop_loader``) without editing it.
* Exported into a Paddle tree (the compat block below is dropped and
  ``paddle_muon_ext`` becomes ``paddle``): Paddle's own module, in place.

``KIND`` is ``"package"`` for this repository's optimizer and ``"develop"``
for any other; :func:`upstream_bug` marks a test as an expected failure on
``"develop"`` (each such test names its entry in docs/UPSTREAM_BUGS.md;
``MUON_CONFORMANCE_SHOW_BUGS=1`` runs them unmarked, to see the failure).

The helpers below drive an optimizer through develop's surface only: the
constructor ``(optimizer, hcg)``, ``reduce_gradients``, ``step``,
``clear_grad`` and the attributes develop's own tests read.
"""

from __future__ import annotations

import os
import unittest
from typing import Any, Callable

import numpy as np
import paddle
from paddle.distributed import fleet

from muon_tiny_moe import TinyMoE, batch, make_muon

#: Environment variable naming the Paddle checkout under test.
PADDLE_ROOT_ENV = "PADDLE_ROOT"


def _select_module() -> Any:
    module = None
    # paddle_muon_ext: compat-begin
    root = os.environ.get(PADDLE_ROOT_ENV) or None
    if root:
        from paddle_muon_ext.compat_paddle_3_3 import develop_loader

        module = develop_loader.load_develop_optimizer(root)
    # paddle_muon_ext: compat-end
    if module is None:
        from paddle_muon_ext.distributed.fleet.meta_optimizers import (
            muon_sharding_optimizer as module,
        )
    return module


#: The module under test (``MuonShardingOptimizer``, ``get_gpus_per_node``, ...).
MODULE = _select_module()
MuonShardingOptimizer = MODULE.MuonShardingOptimizer
#: "package": this repository's optimizer (it alone exports assign_muon_owners).
KIND = "package" if hasattr(MODULE, "assign_muon_owners") else "develop"
#: The file the tests run (what upstream_coverage.py measures).
SOURCE = os.path.realpath(MODULE.__file__)

#: Set to "1" to run the upstream-bug tests unmarked (their failures shown).
SHOW_BUGS_ENV = "MUON_CONFORMANCE_SHOW_BUGS"

#: Known upstream bugs: id -> one line (details in docs/UPSTREAM_BUGS.md).
UPSTREAM_BUGS = {
    "UB-1": "clear_grad() detaches parameter gradients from the fused comm "
            "buffers: from the second step on, stale buffers are reduced",
    "UB-2": "release_gradients without main_grad: the second step asserts in "
            "FusedCommBuffer.assign_slice_grad (slice params keep the freed gradient)",
}


def upstream_bug(bug_id: str) -> Callable:
    """Mark a test that fails on develop's file because of ``bug_id``.

    On ``KIND == "develop"`` the test becomes ``unittest.expectedFailure``;
    on this repository's optimizer it must pass.
    """
    if bug_id not in UPSTREAM_BUGS:
        raise KeyError(f"unknown upstream bug {bug_id!r}; known: {sorted(UPSTREAM_BUGS)}")

    def mark(fn: Callable) -> Callable:
        fn.upstream_bug = bug_id
        # MUON_CONFORMANCE_SHOW_BUGS=1: run unmarked, to see the failure itself
        if KIND == "develop" and os.environ.get(SHOW_BUGS_ENV) != "1":
            return unittest.expectedFailure(fn)
        return fn

    return mark


def build_rank(cfg: Any) -> tuple[Any, Any, Any]:
    """This simulated rank's tiny MoE and the optimizer under test on it.

    Returns:
        (hcg, net, optimizer).
    """
    hcg = fleet.get_hybrid_communicate_group()
    coord = hcg.get_expert_parallel_rank() if cfg.ep > 1 else None
    moe_group = hcg.get_moe_sharding_parallel_group() if cfg.ep > 1 else None
    net = TinyMoE(coord, moe_group, cfg.matrix_dtype)
    # no grad clip: a bare sharding optimizer clips its local gradients only
    # (the fleet wrapper makes the norm global), so the reference would differ
    muon = make_muon(list(net.parameters()), clip=False)
    return hcg, net, MuonShardingOptimizer(muon, hcg)


def train(cfg: Any, hcg: Any, net: Any, opt: Any, steps: int,
          clear: bool = True, first_step: int = 0) -> None:
    """``steps`` optimizer steps through develop's surface, clear_grad between them."""
    rank = paddle.distributed.get_rank()
    for step in range(first_step, first_step + steps):
        loss = net(paddle.to_tensor(batch(step, rank)))
        loss.backward()
        opt.reduce_gradients(list(net.parameters()), hcg)
        opt.step()
        if clear:
            opt.clear_grad()


def max_diff(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> tuple[float, str]:
    """Largest |got - want| over the parameters and the parameter it occurs in."""
    assert got.keys() == want.keys(), f"parameter sets differ: {sorted(got)} vs {sorted(want)}"
    worst = max(got, key=lambda k: float(np.abs(got[k].astype("float64") - want[k]).max()))
    return float(np.abs(got[worst].astype("float64") - want[worst]).max()), worst
