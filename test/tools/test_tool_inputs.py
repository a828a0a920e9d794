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
"""Hostile inputs to ``plan`` / ``verify``: each is one
``error: <what> <value>: <why>, <fix>`` line on stderr and exit 2, before any
work (the tool process never imports paddle for them), nothing on stdout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

from tool_loader import REPO_ROOT

from paddle_muon_ext.tools import limits

TOOL = os.path.join(REPO_ROOT, "tools", "muon_comm.py")
LAYOUT = ["--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "2"]


def run_tool(*argv: str, cwd: str | None = None, env: dict | None = None):
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(REPO_ROOT, "python"), full_env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, TOOL, *argv], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=full_env)


class TestRefusedBeforeWork(unittest.TestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="muon_inputs_")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def assert_refused(self, argv, expected: str) -> None:
        proc = run_tool(*argv)
        self.assertEqual(proc.returncode, 2, (argv, proc.stderr))
        self.assertEqual(proc.stdout, "", argv)
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        self.assertTrue(lines[-1].startswith(f"error: {expected}"), (argv, lines))

    def _model(self, name: str, content, binary: bool = False) -> str:
        path = os.path.join(self.dir, name)
        with open(path, "wb" if binary else "w") as f:
            f.write(content if binary or isinstance(content, str) else json.dumps(content))
        return path

    def test_plan_bounds(self) -> None:
        L = limits.LIMITS
        cases = [
            (["--ep", "1000000000", "--moe-sharding", "2", "--gpus-per-node", "8"],
             f"--ep 1000000000: above the limit {L.plan_world}"),
            (["--ep", "50000", "--moe-sharding", "2", "--gpus-per-node", "50000"],
             f"--ep 50000: above the limit {L.plan_world}"),
            (["--ep", str(L.plan_world // 2), "--moe-sharding", "4", "--gpus-per-node", "8"],
             f"world size 1 x 4 x {L.plan_world // 2} = {2 * L.plan_world}: above the "
             f"{L.plan_world} ranks plan handles"),
            (["--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "50000"],
             f"--gpus-per-node 50000: above the limit {L.gpus_per_node}"),
            ([*LAYOUT, "--beta-net", "0", "--beta-nvlink", "0"], "--beta-nvlink 0: must be > 0"),
            ([*LAYOUT, "--alpha-net", "-1"], "--alpha-net -1: must be > 0"),
            ([*LAYOUT, "--alpha-net", "nan"], "--alpha-net nan: must be a finite number"),
            ([*LAYOUT, "--buffer-size-MB", "1e12"], "--buffer-size-MB 1e+12: above the limit"),
            ([*LAYOUT, "--png", "/nonexistent_dir/x.png"],
             "--png /nonexistent_dir/x.png: directory /nonexistent_dir does not exist"),
            ([*LAYOUT, "--png", "/proc/x.png"], "--png /proc/x.png: cannot write in /proc"),
        ]
        for argv, expected in cases:
            with self.subTest(argv=argv):
                self.assert_refused(["plan", *argv], expected)

    def test_model_files(self) -> None:
        entry = "entry 0 ('w') shape"
        cases = [
            (self._model("frac.json", [{"name": "w", "shape": [128.7, 64]}]),
             f"{entry} [128.7, 64]: dimension 128.7 is not an integer"),
            (self._model("abc.json", [{"name": "w", "shape": "abc"}]), f'{entry} "abc": is not a list'),
            (self._model("0d.json", [{"name": "w", "shape": []}]), f"{entry} []: has 0 dims"),
            (self._model("zero.json", [{"name": "w", "shape": [0, 64]}]),
             f"{entry} [0, 64]: dimension 0 is outside"),
        ]
        for path, why in cases:
            with self.subTest(path=path):
                self.assert_refused(["plan", *LAYOUT, "--model", path], f"model file {path} {why}")
        for path, why in ((self.dir, "is a directory"), (os.devnull, "is not a regular file"),
                          (self._model("bin.json", b"\x89PNG\x00\xff", binary=True),
                           "is not UTF-8 text")):
            with self.subTest(path=path):
                self.assert_refused(["plan", *LAYOUT, "--model", path], f"model file {path}: {why}")

    def test_verify_bounds(self) -> None:
        L = limits.LIMITS
        cases = [
            (["--ep", str(2 * L.verify_world), "--moe-sharding", "2", "--gpus-per-node", "8"],
             f"--ep {2 * L.verify_world}: above the limit {L.verify_world}"),
            ([*LAYOUT, "--steps", "1000000000"], f"--steps 1000000000: above the limit {L.verify_steps}"),
            ([*LAYOUT, "--steps", "0"], "--steps 0: must be >= 1"),
            ([*LAYOUT, "--data-max-ranks", "-1"], "--data-max-ranks -1: must be >= 0"),
            ([*LAYOUT, "--model", "ernie-moe-small"], "--model 'ernie-moe-small': verify trains only"),
        ]
        for argv, expected in cases:
            with self.subTest(argv=argv):
                self.assert_refused(["verify", *argv], expected)

    def test_verify_help_names_the_model_it_takes(self) -> None:
        out = " ".join(run_tool("verify", "--help").stdout.split())
        self.assertIn("only the built-in test model 'tiny- moe'".replace("- ", "-"),
                      out.replace("tiny- moe", "tiny-moe"))
        self.assertNotIn("ernie-moe-small-fused", out)


def _main_in_fresh_interpreter(argv: list) -> subprocess.CompletedProcess:
    """Run ``cli.main(argv)`` in a new interpreter; stdout: its exit code and
    whether paddle was imported."""
    code = ("import sys\n"
            "from paddle_muon_ext.tools.cli import main\n"
            f"rc = main({argv!r})\n"
            "print(rc, 'paddle' in sys.modules)\n")
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO_ROOT, "python")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env)


class TestNoWorkBeforeTheCheck(unittest.TestCase):
    def test_refusal_does_not_import_paddle(self) -> None:
        proc = _main_in_fresh_interpreter(
            ["plan", "--ep", "1000000000", "--moe-sharding", "2", "--gpus-per-node", "8"])
        self.assertEqual(proc.stdout.split(), ["2", "False"], proc.stderr)

    def test_cluster_refuses_bad_flags_before_importing_paddle(self) -> None:
        # a layout comm_group_call_opt can run: its check imports paddle, so
        # every other flag must be checked before it
        proc = _main_in_fresh_interpreter(
            ["cluster", "--nodes", "2", "--procs-per-node", "2", "--ep", "2",
             "--moe-sharding", "2", "--steps", "0"])
        self.assertEqual(proc.stdout.split(), ["2", "False"], proc.stderr)
        self.assertIn("error: --steps must be >= 1, got 0", proc.stderr)

    def test_package_names_load_on_first_use(self) -> None:
        import paddle_muon_ext

        self.assertIn("MuonShardingOptimizer", dir(paddle_muon_ext))
        self.assertTrue(callable(paddle_muon_ext.set_muon_sharding_options))
        with self.assertRaisesRegex(AttributeError, "no attribute 'nope'"):
            paddle_muon_ext.nope  # noqa: B018


class TestOutputsAndDisagreements(unittest.TestCase):
    def test_png_without_suffix_reports_the_file_written(self) -> None:
        d = tempfile.mkdtemp(prefix="muon_png_")
        self.addCleanup(shutil.rmtree, d, True)
        proc = run_tool("plan", *LAYOUT, "--model", "tiny", "--png", "out", cwd=d)
        if proc.returncode != 0 and "matplotlib" in proc.stderr:
            self.skipTest("matplotlib not installed")
        self.assertEqual(proc.returncode, 0, proc.stderr)
        written = os.path.join(d, "out.png")
        self.assertTrue(os.path.isfile(written))
        self.assertIn(f"wrote {written}", proc.stdout)

    def test_local_size_disagreement_is_one_line(self) -> None:
        proc = run_tool("plan", *LAYOUT, "--model", "tiny", "--json",
                        env={"PADDLE_LOCAL_SIZE": "8"})
        self.assertEqual(proc.returncode, 0, proc.stderr)
        notes = [ln for ln in proc.stderr.splitlines() if "PADDLE_LOCAL_SIZE" in ln]
        self.assertEqual(len(notes), 1, proc.stderr)
        self.assertIn("PADDLE_LOCAL_SIZE=8", notes[0])
        self.assertIn("--gpus-per-node 2", notes[0])
        json.loads(proc.stdout)  # stdout stays machine-readable


if __name__ == "__main__":
    unittest.main()
