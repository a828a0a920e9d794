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
"""``pip install .`` (not editable) gives a working ``paddle-muon-ext plan`` outside the checkout.

Installs a copy of the package with the running interpreter's pip into a
temporary ``--target`` directory (``--no-deps``, no build isolation: no
network needed; the build uses this interpreter's setuptools and ``wheel``,
which the ``[test]`` extra installs) and runs its console script from an
unrelated directory with only that directory on ``PYTHONPATH``. No nested
virtual environment: one created inside a venv sees the base interpreter's
packages, not the ones ``.ci/run`` installed, and its bundled setuptools
cannot build a wheel without ``wheel``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class TestInstalledPlan(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="pme_install_")
        src = os.path.join(cls.tmp, "src")
        os.makedirs(src)
        # A copy, so the build leaves no build/ or egg-info in the checkout.
        shutil.copy(os.path.join(REPO, "setup.py"), src)
        shutil.copytree(os.path.join(REPO, "python"), os.path.join(src, "python"),
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        target = os.path.join(cls.tmp, "site")
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
             "--no-compile", "--target", target, src],
            capture_output=True, text=True, timeout=600, env=cls._env())
        if proc.returncode != 0:
            raise AssertionError(f"pip install failed:\n{proc.stderr[-3000:]}")
        cls.target = target
        cls.python = sys.executable
        cls.script = os.path.join(cls.target, "bin", "paddle-muon-ext")
        cls.cwd = os.path.join(cls.tmp, "elsewhere")
        os.makedirs(cls.cwd)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    @classmethod
    def _env(cls):
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env["PIP_NO_INDEX"] = "1"
        if hasattr(cls, "target"):
            # The installed copy only: the checkout is neither cwd nor on the path.
            env["PYTHONPATH"] = cls.target
        return env

    def _run(self, *argv):
        return subprocess.run([self.script, *argv], capture_output=True, text=True,
                              cwd=self.cwd, env=self._env(), timeout=600)

    def test_plan_runs_from_the_installed_copy(self):
        # the targets are the recommended (balanced) rule's; the default is develop's
        proc = self._run("plan", "--ep", "16", "--moe-sharding", "2", "--gpus-per-node", "8",
                         "--partition", "balanced", "--json")
        self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
        res = json.loads(proc.stdout)
        self.assertEqual((res["world_size"], res["num_nodes"]), (32, 4))
        # the layout's figures (the benches' targets are not in user output)
        self.assertNotIn("targets", res)
        self.assertLessEqual(res["hierarchical"]["inter_node_ratio_to_bound"], 1.01)
        self.assertLessEqual(res["hierarchical"]["rail_imbalance"], 1.05)
        self.assertEqual(set(res["partition_rules"]), {"balanced", "upstream_greedy"})
        where = subprocess.run(
            [self.python, "-c", "import paddle_muon_ext.tools.plan as m; print(m.__file__)"],
            capture_output=True, text=True, cwd=self.cwd, env=self._env(), timeout=300)
        self.assertTrue(where.stdout.strip().startswith(self.tmp), where.stdout)

    def test_verify_and_demo_say_they_need_the_checkout(self):
        for command in ("verify", "demo"):
            proc = self._run(command, "--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "2")
            self.assertEqual(proc.returncode, 2, proc.stderr)
            lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
            self.assertEqual(len(lines), 1, proc.stderr)
            self.assertIn("needs a source checkout", lines[0])


if __name__ == "__main__":
    unittest.main()
