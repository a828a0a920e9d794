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
"""``tools/demo.py``: bad arguments are refused before any process starts, and
no PASS without work (the verdict says how many steps, ranks and values)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
import unittest
from contextlib import redirect_stderr, redirect_stdout
from unittest import mock

from tool_loader import REPO_ROOT, load_tool

demo = load_tool("demo.py", "muon_demo_tool")


class _Result:
    def __init__(self, logs: dict) -> None:
        self.worker_logs, self.ok, self.timed_out, self.returncode, self.wall_s = (
            logs, True, False, 0, 1.0)

    def workers_printing(self, marker: str) -> list:
        return sorted(r for r, log in self.worker_logs.items() if marker in log)

    def failure_message(self) -> str:
        return "(logs)"


_MKDTEMP = tempfile.mkdtemp


def _run(argv: list, result: _Result | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    launch = mock.MagicMock(return_value=result)
    # A FAIL verdict keeps its log directory for the user; the faked runs'
    # directories live in one the test removes.
    with tempfile.TemporaryDirectory(prefix="muon_demo_test_") as logs, \
            redirect_stdout(out), redirect_stderr(err), \
            mock.patch.object(demo, "run_paddle_launch", launch), \
            mock.patch.object(demo, "follow", lambda *a, **k: None), \
            mock.patch.object(demo.tempfile, "mkdtemp",
                              lambda prefix="": _MKDTEMP(prefix=prefix, dir=logs)):
        code = demo.main(argv)
    return code, out.getvalue(), err.getvalue()


class TestDemoArguments(unittest.TestCase):
    def test_bad_arguments_exit_2_before_launching(self) -> None:
        cases = {
            ("--steps", "0"): "error: --steps 0: must be in 1..",
            ("--steps", "-1"): "error: --steps -1: must be in 1..",
            ("--steps", "1000000000"): "error: --steps 1000000000: must be in 1..",
            ("--timeout", "0"): "error: --timeout 0: must be in (0, 3600] seconds",
            ("--timeout", "-3"): "error: --timeout -3: must be in (0, 3600] seconds",
            ("--timeout", "nan"): "error: --timeout nan: must be in (0, 3600] seconds",
        }
        for argv, message in cases.items():
            code, out, err = _run(list(argv))
            self.assertEqual(code, 2, argv)
            self.assertTrue(err.startswith(message), (argv, err))
            self.assertNotIn("PASS", out)

    def test_steps_zero_from_the_command_line(self) -> None:
        proc = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "demo.py"),
                               "--steps", "0"], capture_output=True, text=True, timeout=120)
        self.assertEqual(proc.returncode, 2)
        self.assertTrue(proc.stderr.startswith("error: --steps 0:"), proc.stderr)
        self.assertNotIn("VERDICT", proc.stdout)

    def test_pass_line_counts_steps_ranks_and_values(self) -> None:
        logs = {r: f"MUON_OK rank={r} max_abs_diff_hier_vs_flat=0.0 steps=3 values=100\n"
                for r in range(demo.NPROC)}
        code, out, _ = _run(["--steps", "3"], _Result(logs))
        self.assertEqual(code, 0)
        self.assertIn(f"3 steps x 2 passes, {demo.NPROC} ranks, {100 * demo.NPROC} parameter "
                      "values compared", out)

    def test_json_is_the_only_stdout(self) -> None:
        logs = {r: f"MUON_OK rank={r} max_abs_diff_hier_vs_flat=0.0 steps=3 values=100\n"
                for r in range(demo.NPROC)}
        code, out, err = _run(["--steps", "3", "--json"], _Result(logs))
        self.assertEqual(code, 0, err)
        verdict = json.loads(out)
        self.assertEqual((verdict["status"], verdict["values_compared"]),
                         ("PASS", 100 * demo.NPROC))
        self.assertIn("VERDICT: PASS", err, "the human verdict goes to stderr")
        code, out, err = _run(["--steps", "3", "--json"], _Result({0: "nothing"}))
        self.assertEqual((code, json.loads(out)["status"]), (1, "FAIL"))
        err = io.StringIO()
        with redirect_stderr(err), self.assertRaises(SystemExit) as done:
            demo.main(["--stepz", "3"], prog="demo")
        self.assertEqual(done.exception.code, 2)
        self.assertEqual(err.getvalue().splitlines(), [
            "error: demo: unrecognized arguments: --stepz 3 (see demo --help)"])

    def test_no_pass_without_values(self) -> None:
        logs = {r: f"MUON_OK rank={r} max_abs_diff_hier_vs_flat=0.0\n" for r in range(demo.NPROC)}
        code, out, _ = _run(["--steps", "3"], _Result(logs))
        self.assertEqual(code, 1)
        self.assertIn("VERDICT: FAIL - only 0 steps / 0 values were checked", out)


if __name__ == "__main__":
    unittest.main()
