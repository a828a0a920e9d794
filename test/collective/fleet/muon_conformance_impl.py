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
  package's 3.3.1 compat layer (its develop loader) without editing it.
* Exported into a Paddle tree (the compat block below is dropped and
  ``paddle_muon_ext`` becomes ``paddle``): Paddle's own module, in place.

``KIND`` is ``"package"`` for this repository's optimizer and ``"develop"``
for any other; :func:`upstream_bug` marks a test as an expected failure on
``"develop"`` while the bug's probe finds it (each such test names its entry
in docs/UPSTREAM_BUGS.md; ``MUON_CONFORMANCE_SHOW_BUGS=1`` runs them
unmarked, to see the failure); on a file where the bug is fixed the test is
a plain test.

The suite runs in the one simulated-world harness (``muon_sim_runner``),
driving the optimizer through develop's surface only: the constructor
``(optimizer, hcg)``, ``reduce_gradients``, ``step``, ``clear_grad`` and the
attributes develop's own tests read. These files must run unchanged in a
Paddle tree that has develop's code only.
"""

from __future__ import annotations

import dataclasses
import os
import unittest
from typing import Any, Callable

import numpy as np
import paddle

import muon_sim_runner
from mock.simulated_world import SimulatedWorld
from muon_sim_runner import SimConfig
from muon_test_compat import HAS_GROUP_CALL_OPTION

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
#: The implementation has comm_group_call_opt (PR #79448; older develop files do not).
HAS_GROUP_CALL = all(hasattr(MODULE, name) for name in
                     ("get_gpus_per_node", "get_same_card_rank", "get_trainer_ranks"))
GROUP_CALL_MISSING = "this MuonShardingOptimizer predates comm_group_call_opt (PR #79448)"
STRATEGY_FIELD_MISSING = (
    "the installed Paddle's DistributedStrategy has no sharding_configs.comm_group_call_opt "
    "(PR #79448's proto field), which this MuonShardingOptimizer reads: build Paddle from "
    "the checkout under test")

LOCAL_2D_MISSING = (
    "this MuonShardingOptimizer has no _local_2d (the Muon matrices a rank owns), which the "
    "owner-gradient checks read")


def owned_matrix_names(opt: Any) -> set | None:
    """Names of the Muon matrices this rank owns (develop's ``_local_2d``).

    Returns:
        The names, or None where the optimizer has no ``_local_2d`` (older
        develop files): the caller skips with :data:`LOCAL_2D_MISSING`.
    """
    local = getattr(opt, "_local_2d", None)  # develop's __getattr__ raises AttributeError
    return None if local is None else {p.name for p in local}


#: Set to "1" to run the upstream-bug tests unmarked (their failures shown).
SHOW_BUGS_ENV = "MUON_CONFORMANCE_SHOW_BUGS"

#: Known upstream bugs: id -> one line (details in docs/UPSTREAM_BUGS.md).
UPSTREAM_BUGS = {
    "UB-1": "clear_grad() detaches parameter gradients from the fused comm "
            "buffers: from the second step on, stale buffers are reduced",
    "UB-2": "release_gradients without main_grad: the second step asserts in "
            "FusedCommBuffer.assign_slice_grad (slice params keep the freed gradient)",
}


def _bare_optimizer(**attrs: Any) -> Any:
    """The optimizer under test without its constructor: only the state
    ``clear_grad`` / ``_assign_slice_grad`` read (develop's names), no groups."""
    opt = MuonShardingOptimizer.__new__(MuonShardingOptimizer)
    opt.__dict__.update({"_inner_opt": object(), "_parameter_list": [], "tensor_fusion": False,
                         "sd_release_grads": False, "pp_overlap": False,
                         "_use_fuse_gradients": True, "_slice_params": {},
                         "_comm_buffer_list": [], "comm_buffer_2d": []}, **attrs)
    return opt


def _ub1_present() -> bool:
    """A gradient that is a view into a comm buffer still reaches the buffer
    after clear_grad() and the next backward (2-D fused and 1-D sliced)."""
    for fused, sliced in ((True, False), (False, True)):
        param = paddle.create_parameter([4], "float32")
        buffer = paddle.zeros([4])
        param._copy_gradient_from(buffer)
        opt = _bare_optimizer(_parameter_list=[param], _use_fuse_gradients=fused,
                              _slice_params={param.name: None} if sliced else {})
        (2 * param).sum().backward()
        opt.clear_grad()
        (3 * param).sum().backward()
        if not np.array_equal(buffer.numpy(), np.full([4], 3.0, "float32")):
            return True
    return False


def _ub2_present() -> bool:
    """With released buffers, the next step's assign_slice_grad binds the new
    slice gradient (the fake buffer asserts what FusedCommBuffer asserts)."""
    param = paddle.create_parameter([4], "float32")
    slice_param = paddle.create_parameter([1], "float32")
    slice_param._copy_gradient_from(paddle.ones([2]))  # the freed storage's view
    new_grad = paddle.zeros([2])

    class Buffer:
        params = [param]

        def need_reduce_scale_sync(self) -> bool:
            return True

        def _clear_grad_storage(self) -> None:
            pass

        def assign_slice_grad(self, p: Any, sp: Any) -> None:
            if sp.grad is None:
                sp._copy_gradient_from(new_grad)
            assert sp.grad._is_shared_buffer_with(new_grad)

    opt = _bare_optimizer(sd_release_grads=True, _slice_params={param.name: slice_param},
                          _comm_buffer_list=[Buffer()])
    opt.clear_grad()
    try:
        opt._assign_slice_grad()
    except AssertionError:
        return True
    return False


#: bug id -> probe: True while the optimizer under test still has the bug.
BUG_PROBES = {"UB-1": _ub1_present, "UB-2": _ub2_present}
_PROBED: dict[str, bool] = {}


def bug_present(bug_id: str) -> bool:
    """Whether the optimizer under test still has ``bug_id`` (probed once).

    A probe that cannot run on this file (develop renamed what it drives)
    counts as present: the test stays an expected failure, and passing
    would show as an unexpected success.
    """
    if bug_id not in _PROBED:
        try:
            _PROBED[bug_id] = bool(BUG_PROBES[bug_id]())
        except Exception:  # noqa: BLE001  (any error: cannot tell it is fixed)
            _PROBED[bug_id] = True
    return _PROBED[bug_id]


def upstream_bug(bug_id: str) -> Callable:
    """Mark a test that fails on develop's file because of ``bug_id``.

    On ``KIND == "develop"`` the test becomes ``unittest.expectedFailure``
    while the bug's probe (:data:`BUG_PROBES`) finds the bug; on a file
    where it is fixed the test is a plain test again (passes, reported as
    passed). On this repository's optimizer it must pass.
    """
    if bug_id not in UPSTREAM_BUGS:
        raise KeyError(f"unknown upstream bug {bug_id!r}; known: {sorted(UPSTREAM_BUGS)}")

    def mark(fn: Callable) -> Callable:
        fn.upstream_bug = bug_id
        # MUON_CONFORMANCE_SHOW_BUGS=1: run unmarked, to see the failure itself
        if KIND == "develop" and os.environ.get(SHOW_BUGS_ENV) != "1" \
                and bug_present(bug_id):
            return unittest.expectedFailure(fn)
        return fn

    return mark


@dataclasses.dataclass(frozen=True)
class Layout(SimConfig):
    """A layout as develop's users run it: the bare optimizer under test, no
    gradient clip (a bare sharding optimizer clips its local gradients only,
    so the reference would differ), develop's own owner rule, and AVG
    support as the build reports it."""

    clip: bool = False
    via_fleet: bool = False
    partition: str | None = None
    use_reduce_avg: bool | None = None


def build_rank(cfg: Layout) -> tuple[Any, Any, Any]:
    """This simulated rank's tiny MoE and the optimizer under test on it.

    Returns:
        (hcg, net, optimizer).
    """
    hcg, net, opt, _ = muon_sim_runner.build_rank(cfg, None, MuonShardingOptimizer)
    return hcg, net, opt


def run_world(layout: Layout, body: Callable[[Layout], Any],
              reraise_original: bool = False) -> tuple[list, SimulatedWorld]:
    """``body(layout)`` on every rank of ``layout`` (threads, real data),
    skipped where the optimizer under test or the build lacks group calls.

    Returns:
        (per-rank results, the world with its traces).
    """
    if layout.gpn is not None and not HAS_GROUP_CALL:
        raise unittest.SkipTest(GROUP_CALL_MISSING)
    if HAS_GROUP_CALL and not HAS_GROUP_CALL_OPTION:
        # develop's constructor reads sharding_configs.comm_group_call_opt on
        # every layout: a Paddle build older than the checkout lacks the field
        raise unittest.SkipTest(STRATEGY_FIELD_MISSING)
    return muon_sim_runner.run_world(layout, lambda cfg, _strategy: body(cfg),
                                     reraise_original=reraise_original)
