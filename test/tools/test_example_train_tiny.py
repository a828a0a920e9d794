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
"""examples/train_tiny.py and the README's develop-style script.

It must train on 2 CPU (gloo) processes with nothing but ``patch_paddle()``
and pass its own check against a single-process run; and that check must
report FAIL (exit 1) when the two runs differ.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_REPO, "test", "collective", "fleet"))

from launch_utils import run_paddle_launch  # noqa: E402

EXAMPLE = os.path.join(_REPO, "examples", "train_tiny.py")
README = os.path.join(_REPO, "README.md")


def readme_script() -> str:
    """The first Python block of the README's "Using it" section."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    section = text.split("\n## Using it\n", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


class TestTrainTinyExample(unittest.TestCase):
    def _launch(self, nproc: int, args=()):
        # A user's environment: no test-side switches, only the launcher's.
        env = {"CUDA_VISIBLE_DEVICES": "", "GLOO_COMPAT": "", "GLOO_COMPAT_LOCAL_SIZE": ""}
        result = run_paddle_launch(EXAMPLE, nproc, env=env, timeout_s=240, args=args)
        print(f"train_tiny on {nproc} processes {list(args)}: {result.wall_s:.1f}s")
        result.check()
        passed = result.workers_printing("PASS: rank")
        self.assertEqual(passed, list(range(nproc)), "PASS missing from some rank\n"
                         + result.failure_message())
        self.assertIn("MuonHybridParallelOptimizer", result.worker_logs[0],
                      "the example did not train through Muon sharding")

    def test_two_cpu_processes_pass_the_self_check(self):
        self._launch(2)

    def test_data_parallel_replicas_of_a_sharding_group_pass(self):
        # dp=2 x sharding=2: the 1-D slices must reach the data-parallel
        # all-reduce (they trained 0.13 away from the reference before).
        self._launch(4, ("--dp", "2"))

    def test_the_self_check_reports_a_difference(self):
        # One process; the distributed run (first call of train) skips its
        # last step, so the parameters differ from the reference.
        script = textwrap.dedent(f"""
            import importlib.util, sys
            spec = importlib.util.spec_from_file_location("train_tiny", {EXAMPLE!r})
            example = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(example)
            real_train, calls = example.train, []
            def train(model, opt, rank, world):
                calls.append(1)
                steps = example.STEPS
                if len(calls) == 1:
                    example.STEPS = steps - 1
                try:
                    real_train(model, opt, rank, world)
                finally:
                    example.STEPS = steps
            example.train = train
            sys.exit(example.main())
        """)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PADDLE_TRAINER", "PADDLE_DISTRI"))}
        proc = subprocess.run([sys.executable, "-c", script], env=env, timeout=180,
                              capture_output=True, text=True)
        self.assertEqual(proc.returncode, 1, proc.stdout[-2000:] + proc.stderr[-2000:])
        self.assertRegex(proc.stdout, r"FAIL: rank 0 of 1 \(dp 1\) .* max \|parameter - "
                         r"single-process\| = \S+ \(tolerance 0.0001\)")

    def test_the_readme_script_runs_as_written(self):
        script = readme_script()
        self.assertIn("paddle_muon_ext.patch_paddle()", script)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "train.py")
            with open(path, "w", encoding="utf-8") as f:
                f.write(script)
            result = run_paddle_launch(path, 2, timeout_s=240, env={
                "CUDA_VISIBLE_DEVICES": "", "GLOO_COMPAT": "", "GLOO_COMPAT_LOCAL_SIZE": ""})
        result.check()
        for rank in range(2):
            losses = [float(line.rsplit(" ", 1)[1])
                      for line in result.worker_logs[rank].splitlines()
                      if line.startswith(f"rank {rank} step ")]
            self.assertEqual(len(losses), 5, result.failure_message())
            self.assertTrue(all(0.0 < loss < 10.0 for loss in losses), losses)

if __name__ == "__main__":
    unittest.main()
