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
"""Which Muon the conformance runs use as inner optimizer, and how it is reported.

With a checkout (``PADDLE_ROOT``), its ``python/paddle/optimizer/muon.py`` is
the inner optimizer where it imports and steps a Muon matrix and an AdamW
vector on this Paddle; otherwise the package's Muon runs and the report says
why in one line. Each case writes a develop-shaped temp tree whose ``muon.py``
is a small stand-in (one that works, one that fails to import, one that fails
to step, one whose step changes nothing). Also pinned: the CPU ``adamw_``
learning-rate bridge the loader gives develop's module on 3.3.1, and that
``upstream_coverage.py --json`` carries the selection.
Out of tree only: the selection is 3.3.1 compat.
"""

# paddle_muon_ext: compat-only

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
import unittest
from unittest import mock

import numpy as np
import paddle
from muon_conformance_loader_helpers import _LoaderCase, _tree

import muon_tiny_moe
from paddle_muon_ext.compat_paddle_3_3 import develop_loader as dl

_PACKAGE = "package (paddle_muon_ext.optimizer.muon.Muon)"

# A stand-in Muon: SGD on every parameter through paddle's own ops (no
# adamw_), enough for the selection's one step.
_WORKS = textwrap.dedent("""
    import paddle
    from .optimizer import Optimizer

    class Muon(Optimizer):
        def __init__(self, learning_rate=0.02, parameters=None, muon_param_info_map=None, **kw):
            super().__init__(learning_rate=learning_rate, parameters=parameters)
            self.info = muon_param_info_map

        def step(self):
            with paddle.no_grad():
                for p in self._parameter_list:
                    p.subtract_(p.grad * self._learning_rate)
""")
_IMPORT_FAILS = "from paddle.no_such_module_in_3_3 import Hyperball\nclass Muon:\n    pass\n"
_STEP_FAILS = _WORKS.replace(
    "with paddle.no_grad():",
    "raise ValueError('(InvalidArgument) learning rate dtype float64\\n  [Hint: second line]')\n"
    "        with paddle.no_grad():")
# the Muon path steps, the AdamW path raises (develop's muon.py on 3.3.1's CPU
# kernel without the loader's bridge): a matrix-only probe would select it
_ADAMW_PATH_FAILS = _WORKS.replace(
    "with paddle.no_grad():",
    "if any(not self.info[p.name].use_muon for p in self._parameter_list):\n"
    "            raise ValueError('adamw_ reads a float32 learning rate')\n"
    "        with paddle.no_grad():")
_STEP_DOES_NOTHING = _WORKS.replace("p.subtract_(p.grad * self._learning_rate)", "pass")
# develop's AdamW call, as its muon.py makes it: a float64 learning-rate tensor
_ADAMW_FLOAT64_LR = textwrap.dedent("""
    import paddle
    from paddle import _C_ops

    def adamw_step(param, grad, lr):
        t = lambda v: paddle.full([1], v, "float32")
        m1, m2 = paddle.zeros_like(param), paddle.zeros_like(param)
        _C_ops.adamw_(param, grad, paddle.to_tensor(lr, dtype=paddle.float64), m1, m2, None,
                      t(0.9), t(0.95), None, None, 0.9, 0.95, 1e-8, 1.0, 0.0, False, False,
                      1000, False, False, False)
""")


class _SelectionCase(_LoaderCase):
    def setUp(self):
        super().setUp()
        self._globals = (muon_tiny_moe.Muon, muon_tiny_moe.INNER_MUON)

    def tearDown(self):
        muon_tiny_moe.Muon, muon_tiny_moe.INNER_MUON = self._globals
        super().tearDown()


class TestInnerOptimizerSelection(_SelectionCase):
    def test_a_muon_py_that_imports_and_steps_is_the_inner_optimizer(self):
        root = _tree(self.tmp, "paddle", muon=_WORKS)
        cls, name = muon_tiny_moe.select_inner_muon(root)
        self.assertEqual(cls.__module__, "paddle.optimizer._develop_muon")
        self.assertEqual(name, f"develop ({os.path.join(root, dl.MUON_RELPATH)})")

    def test_the_suites_staged_api_names_are_the_runtimes(self):
        # The suite spells the names (it travels to develop's tree, which has
        # no runtime module); the two lists must not drift apart.
        from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import runtime

        self.assertEqual(muon_tiny_moe.STAGED_API, runtime.STAGED_API)

    def test_the_package_muon_without_a_checkout(self):
        cls, name = muon_tiny_moe.select_inner_muon(None)
        self.assertIs(cls, muon_tiny_moe.PACKAGE_MUON)
        self.assertEqual(name, _PACKAGE)

    def test_fallbacks_say_why_in_one_line(self):
        version = paddle.__version__
        rows = {
            "no muon.py": (None, f"no {dl.MUON_RELPATH} in the checkout"),
            "import fails": (_IMPORT_FAILS, f"{dl.MUON_RELPATH} does not import on paddle 3.3.1: "
                             "ModuleNotFoundError: No module named 'paddle.no_such_module_in_3_3'"),
            "step fails": (_STEP_FAILS, f"{dl.MUON_RELPATH} does not run on paddle {version}: "
                           "ValueError: (InvalidArgument) learning rate dtype float64"),
            "adamw path fails": (_ADAMW_PATH_FAILS, f"{dl.MUON_RELPATH} does not run on paddle "
                                 f"{version}: ValueError: adamw_ reads a float32 learning rate"),
        }
        for case, (muon, reason) in rows.items():
            with self.subTest(case):
                root = _tree(self.tmp, case.replace(" ", "_"), muon=muon)
                cls, name = muon_tiny_moe.select_inner_muon(root)
                self.assertIs(cls, muon_tiny_moe.PACKAGE_MUON)
                self.assertEqual(name, f"{_PACKAGE}: {reason}")
                self.assertEqual(len(name.splitlines()), 1)

    def test_a_step_that_changes_no_parameter_is_not_selected(self):
        root = _tree(self.tmp, "paddle", muon=_STEP_DOES_NOTHING)
        cls, name = muon_tiny_moe.select_inner_muon(root)
        self.assertIs(cls, muon_tiny_moe.PACKAGE_MUON)
        self.assertEqual(name, f"{_PACKAGE}: {dl.MUON_RELPATH} does not run on paddle "
                               f"{paddle.__version__}: its step left the Muon matrix and "
                               "the AdamW vector unchanged")

    def test_the_selection_is_what_the_runs_use_and_what_the_report_file_says(self):
        root = _tree(self.tmp, "paddle", muon=_WORKS)
        report = os.path.join(self.tmp, "inner.json")
        env = {"PADDLE_ROOT": root, "MUON_CONFORMANCE_INNER_FILE": report}
        with mock.patch.dict(os.environ, env):
            muon_tiny_moe._select_muon()
        self.assertEqual(muon_tiny_moe.Muon.__module__, "paddle.optimizer._develop_muon")
        p = paddle.create_parameter([4, 4], "float32")
        self.assertIsInstance(muon_tiny_moe.make_muon([p]), muon_tiny_moe.Muon)
        with open(report) as f:
            self.assertEqual(json.load(f),
                             {"inner_optimizer": f"develop ({os.path.join(root, dl.MUON_RELPATH)})"})


class TestCpuAdamwLearningRateBridge(_LoaderCase):
    """develop's muon.py passes adamw_ a float64 learning rate; 3.3.1's CPU kernel reads float32."""

    def test_develops_module_steps_like_a_float32_rate_and_paddle_is_left_alone(self):
        root = _tree(self.tmp, "paddle", muon=_ADAMW_FLOAT64_LR)
        loaded = dl.load_develop_muon(root)
        takes_float64 = dl.cpu_adamw_takes_float64_lr()
        self.assertEqual(loaded.shims, () if takes_float64 else (dl.CPU_ADAMW_LR_SHIM,))
        param = paddle.to_tensor([1.0, 2.0, 3.0]).cpu()
        grad = paddle.to_tensor([0.5, -1.0, 2.0]).cpu()
        loaded.module.adamw_step(param, grad, 0.1)
        # Adam's first step moves each element by lr * sign(grad) (bias-corrected)
        np.testing.assert_allclose(param.numpy(), [0.9, 2.1, 2.9], rtol=1e-6)
        # only develop's module sees the bridge: Paddle's own kernel answers as before
        self.assertIsInstance(paddle._C_ops, types.ModuleType)
        dl.cpu_adamw_takes_float64_lr.cache_clear()
        self.assertEqual(dl.cpu_adamw_takes_float64_lr(), takes_float64)

    def test_this_paddles_cpu_kernel_answer_matches_a_direct_call(self):
        from paddle import _C_ops

        def t(value):
            return paddle.full([1], value, "float32").cpu()

        try:
            _C_ops.adamw_(t(1.0), t(1.0), paddle.full([1], 0.1, "float64").cpu(), t(0.0),
                          t(0.0), None, t(0.9), t(0.95), None, None, 0.9, 0.95, 1e-8, 1.0,
                          0.0, False, False, 1000, False, False, False)
            direct = True
        except ValueError:
            direct = False
        self.assertEqual(dl.cpu_adamw_takes_float64_lr(), direct)


class TestUpstreamCoverageReportsTheInnerOptimizer(unittest.TestCase):
    """``upstream_coverage.py --json`` names the inner optimizer its child's suite used."""

    def test_json_carries_the_fallback_and_its_reason(self):
        import tempfile

        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__)))))
        with tempfile.TemporaryDirectory() as tmp:
            root = _tree(tmp, "paddle", muon=_IMPORT_FAILS)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                filter(None, [os.path.join(repo, "python"), os.environ.get("PYTHONPATH")])))
            env.pop("PADDLE_ROOT", None)
            # -k deselects every test: the suite's modules are still collected
            # (that is where the selection runs), and the report is under test
            out = subprocess.run(
                [sys.executable, os.path.join(repo, "tools", "coverage", "upstream_coverage.py"),
                 "--paddle-root", root, "--lines", "1", "--json",
                 "-k", "no_conformance_test_has_this_name"],
                capture_output=True, text=True, timeout=300, env=env, cwd=tmp)
        report = json.loads(out.stdout)
        self.assertEqual(report["tests"], {"passed": 0, "failed": 0, "expected_failures": 0})
        self.assertEqual(
            report["inner_optimizer"],
            f"{_PACKAGE}: {dl.MUON_RELPATH} does not import on paddle 3.3.1: "
            "ModuleNotFoundError: No module named 'paddle.no_such_module_in_3_3'")


if __name__ == "__main__":
    unittest.main()
