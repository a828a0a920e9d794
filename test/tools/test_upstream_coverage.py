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
"""tools/coverage/upstream_coverage.py without running the suite (CI has no checkout).

The selection, the input checks and the result reading, on synthetic inputs
whose answers are known by construction; the CLI's refusals in a child
process (one ``error:`` line, exit 2, before any test runs).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
import unittest

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(_REPO, "tools", "coverage", "upstream_coverage.py")
sys.path.insert(0, os.path.dirname(TOOL))
import upstream_coverage as uc  # noqa: E402

# line numbers below are those of this text (first line = 1)
_DEVELOP_LIKE = textwrap.dedent("""\
    import os
    def get_gpus_per_node():
        return int(os.getenv("PADDLE_LOCAL_SIZE", "1"))
    def unrelated():
        return 0
    class MuonShardingOptimizer:
        def __init__(self):
            self.use_group_call_opt = True
            if self.use_group_call_opt:
                self.a = 1
            if self.other:
                self.b = 2
        def reduce_gradients(self):
            return 1
        def step(self):
            return 2
    """)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True,
                          timeout=60, cwd=tempfile.gettempdir())


class TestSelection(unittest.TestCase):
    def test_group_call_pieces_and_nothing_else(self):
        lines, found = uc.group_call_lines(_DEVELOP_LIKE)
        self.assertEqual(lines, {2, 3, 9, 10, 13, 14})
        self.assertEqual(found, ["get_gpus_per_node", "__init__ (1 use_group_call_opt branches)",
                                 "reduce_gradients"])

    def test_a_file_without_group_call_code_is_refused(self):
        with self.assertRaisesRegex(uc.dc.UsageError, "--lines or --base"):
            uc.group_call_lines("def f():\n    return 1\n")

    def test_lines_spec(self):
        self.assertEqual(uc.parse_lines_spec("3-5, 9,9"), {3, 4, 5, 9})
        for bad in ("5-3", "0", "a", "1-", ","):
            with self.assertRaises(uc.dc.UsageError, msg=bad):
                uc.parse_lines_spec(bad)

    def test_optimizer_path_is_the_loaders(self):
        self.assertEqual(uc.optimizer_relpath(), "python/paddle/distributed/fleet/"
                                                 "meta_optimizers/muon_sharding_optimizer.py")

    def test_suite_is_the_conformance_files_that_run_develop_code(self):
        # the two files docs/DEVELOPING.md names as the suite; the loader's
        # tests (test_muon_conformance_loader*.py) and the gloo layer's run no
        # develop code and once inflated the counted tests (28 for 26)
        files = [os.path.basename(f) for f in uc.suite_files()]
        self.assertEqual(files, ["test_muon_conformance.py", "test_muon_conformance_gloo.py"])


class TestResults(unittest.TestCase):
    def test_expected_failures_are_mapped_to_their_bug(self):
        bugs = uc.expected_failure_bugs(uc.suite_files())
        self.assertEqual(bugs[("TestMultiStepMatchesReference", "test_plain_sharding_three_steps")],
                         "UB-1")
        self.assertEqual(set(bugs.values()) - {"UB-1", "UB-2"}, set())

    def test_junit_outcomes(self):
        """Each junit outcome lands in one count; failures, setUp/tearDown
        errors and expected failures are divergences, an expected failure
        explained only with ``@upstream_bug``."""
        bugs = {("TestA", "test_bug"): "UB-1"}
        # (testcase body, count bumped, divergence (bug, explained, message) or None)
        rows = [
            ("", "passed", None),
            ('<skipped type="pytest.xfail" message="x"/>', "expected_failures",
             ("UB-1", True, None)),
            ('<failure message="boom&#10;more"/>', "failed", (None, False, "boom")),
            ('<error message="error in setUp&#10;trace"/>', "failed",
             (None, False, "error in setUp")),
            ('<error message="error in tearDown"/>', "failed", (None, False, "error in tearDown")),
            ('<skipped type="pytest.skip" message="s"/>', "skipped", None),
        ]
        for body, bucket, divergence in rows:
            for name in (("test_bug",) if "xfail" in body else ("test_x",)) + (
                    ("test_unmarked",) if "xfail" in body else ()):
                xml = (f'<testsuites><testsuite><testcase classname="t.TestA" name="{name}">'
                       f"{body}</testcase></testsuite></testsuites>")
                with tempfile.NamedTemporaryFile("w", suffix=".xml", delete=False) as f:
                    f.write(xml)
                try:
                    counts, div = uc.read_results(f.name, bugs)
                finally:
                    os.unlink(f.name)
                want = divergence
                if name == "test_unmarked":  # an expected failure without @upstream_bug
                    want = (None, False, None)
                with self.subTest(body=body, test=name):
                    self.assertEqual(counts, {k: int(k == bucket) for k in counts})
                    if want is None:
                        self.assertEqual(div, [])
                        continue
                    self.assertEqual(len(div), 1)
                    self.assertEqual((div[0]["test"], div[0]["bug"], div[0]["explained"]),
                                     (f"t.TestA::{name}", want[0], want[1]))
                    if want[2] is not None:
                        self.assertEqual(div[0]["message"], want[2])


class TestCommandLine(unittest.TestCase):
    def test_help_works_anywhere(self):
        out = _run("--help")
        self.assertEqual(out.returncode, 0)
        self.assertIn("--paddle-root", out.stdout)

    def test_bad_input_is_one_error_line_and_exit_2_before_slow_work(self):
        with tempfile.TemporaryDirectory() as tmp:
            tree = os.path.join(tmp, *uc.optimizer_relpath().split("/"))
            os.makedirs(os.path.dirname(tree))
            with open(tree, "w") as f:
                f.write(_DEVELOP_LIKE)
            cases = {
                (os.path.join(tmp, "nope"),): "is not a directory",
                (tmp + "/python",): "has no python/paddle",
                (tmp, "--lines", "9-1"): "--lines '9-1'",
                (tmp, "--base", "HEAD~0"): "--base 'HEAD~0' is not a commit",
                (tmp, "--log", "/dev/null"): "--log /dev/null: is a character device",
                (tmp, "--log", tmp): f"--log {tmp}: is a directory",
            }
            for args, words in cases.items():
                start = time.perf_counter()
                out = _run("--paddle-root", *args, "--json")
                self.assertEqual(out.returncode, 2, args)
                self.assertEqual(out.stdout, "", "--json stdout must hold only JSON")
                self.assertEqual(len(out.stderr.strip().splitlines()), 1, out.stderr)
                self.assertTrue(out.stderr.startswith("error: "), out.stderr)
                self.assertIn(words, out.stderr)
                self.assertLess(time.perf_counter() - start, 20, "refused after slow work")


if __name__ == "__main__":
    unittest.main()
