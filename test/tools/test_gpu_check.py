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
"""tools/gpu_check.sh on a machine without CUDA: it says SKIP (exit 77),
never a result it did not measure; its parts run as a CPU dry run."""

import contextlib
import io
import os
import subprocess
import unittest
from unittest import mock

import paddle
from tool_loader import REPO_ROOT, load_tool

SCRIPT = os.path.join(REPO_ROOT, "tools", "gpu_check.sh")
NO_CUDA = not (paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0)


def _run(*args):
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=300)


class TestGpuCheckScript(unittest.TestCase):
    def test_help_and_bad_argument(self):
        out = _run("--help")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("numerics", out.stdout)
        self.assertIn("77 no CUDA", out.stdout)
        bad = _run("--fast")
        self.assertEqual(bad.returncode, 2)
        self.assertEqual(bad.stdout.strip().splitlines(), ["error: unknown argument '--fast' "
                                                           "(use --help)"])

    @unittest.skipUnless(NO_CUDA, "the SKIP path is for machines without CUDA")
    def test_without_cuda_every_part_skips(self):
        out = _run()
        self.assertEqual(out.returncode, 77, out.stdout + out.stderr)
        self.assertEqual(len(out.stdout.strip().splitlines()), 1, out.stdout)
        self.assertTrue(out.stdout.startswith("SKIP: no CUDA"), out.stdout)
        self.assertNotIn("PASS", out.stdout)


class TestGpuCheckParts(unittest.TestCase):
    def setUp(self):
        self.tool = load_tool("gpu_check.py", "_tool_gpu_check")

    def _main(self, *argv):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = self.tool.main(list(argv))
        return rc, buf.getvalue()

    @unittest.skipUnless(NO_CUDA, "the SKIP path is for machines without CUDA")
    def test_part_without_cuda_skips(self):
        rc, out = self._main("numerics")
        self.assertEqual((rc, out.splitlines()[-1][:21]), (77, "SKIP: numerics: no CU"))

    def test_numerics_dry_run_passes(self):
        rc, out = self._main("numerics", "--dry-run-cpu")
        self.assertEqual(rc, 0, out)
        self.assertEqual(out.splitlines()[-1], "PASS: DRY-RUN numerics")
        self.assertIn("3 steps bfloat16 params", out)

    def test_bench_dry_run_reports_both_figures(self):
        rc, out = self._main("bench", "--dry-run-cpu")
        self.assertEqual(rc, 0, out)
        self.assertIn("grouped vs per-matrix update", out)
        self.assertIn("NS / its matmuls alone", out)

    def test_a_broken_part_is_one_fail_line(self):
        with mock.patch.dict(self.tool.PARTS,
                             {"numerics": mock.Mock(side_effect=AssertionError("off by 1"))}):
            rc, out = self._main("numerics", "--dry-run-cpu")
        self.assertEqual((rc, out.strip()), (1, "FAIL: DRY-RUN numerics: AssertionError: off by 1"))

    def test_a_wrong_result_fails_the_numerics(self):
        # a Newton-Schulz that forgets the last step is caught by the reference
        real = self.tool.ns_ref
        with mock.patch.object(self.tool, "ns_ref", lambda x, coeffs, steps, eps=1e-9:
                               real(x, coeffs, steps + 1, eps)):
            rc, out = self._main("numerics", "--dry-run-cpu")
        self.assertEqual(rc, 1, out)
        self.assertTrue(out.startswith("FAIL: DRY-RUN numerics: AssertionError: ns"), out)


if __name__ == "__main__":
    unittest.main()
