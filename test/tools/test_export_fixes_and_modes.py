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
"""export_upstream_patch.py --fixes, each mode's tree, and the text Paddle receives.

The trees are synthetic and develop-shaped: a minimal MuonShardingOptimizer
written here with the shape of develop's clear_grad / _assign_slice_grad
(no Paddle source is stored), Paddle's testslist.csv header, a git repo.
"""

import os
import re
import subprocess
import sys
import textwrap
import unittest

from tool_loader import load_tool

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "export_upstream_patch.py")
ep = load_tool("export_upstream_patch.py", "_muon_export_tool_fixes")
uf = sys.modules["upstream_fixes"]
um = sys.modules["upstream_modes"]

# A stand-in with develop's shape: the tensor_fusion branch of clear_grad
# falls back to clear_gradient(); the release block frees the storages.
BUGGY = textwrap.dedent('''\
    import paddle


    class MuonShardingOptimizer:
        def clear_grad(self, set_to_zero=True):
            def clear_one(q):
                if hasattr(q, "main_grad") and q.main_grad is not None:
                    q.main_grad.zero_()
                elif not hasattr(q, "main_grad"):
                    if self.tensor_fusion:
                        if set_to_zero:
                            q.grad.zero_()
                        else:
                            q.grad = None
                    else:
                        q.clear_gradient(set_to_zero)

            for q in self._parameter_list:
                clear_one(q)

            if self.sd_release_grads and not self.pp_overlap:
                for comm_buffer in self._comm_buffer_list:
                    if comm_buffer.need_reduce_scale_sync():
                        comm_buffer._clear_grad_storage()

        def _assign_slice_grad(self):
            for comm_buffer in self._comm_buffer_list:
                for param in comm_buffer.params:
                    comm_buffer.assign_slice_grad(param, self._slice_params[param.name])

        def __getattr__(self, item):
            return getattr(self._inner_opt, item)
    ''')
OPT = um.OPTIMIZER
RUNNER = textwrap.dedent('''\
    import importlib.util, sys, unittest
    spec = importlib.util.spec_from_file_location("dev_opt", sys.argv[1])
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    sys.modules["%s"] = mod
    spec = importlib.util.spec_from_file_location("fix_tests", sys.argv[2])
    tests = importlib.util.module_from_spec(spec); spec.loader.exec_module(tests)
    res = unittest.TextTestRunner().run(unittest.defaultTestLoader.loadTestsFromModule(tests))
    print("RESULT", res.testsRun, len(res.failures) + len(res.errors))
    ''' % uf.OPTIMIZER_MODULE)


def _tree(root, files):
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    git = ["git", "-c", "user.name=T", "-c", "user.email=t@example.com"]
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    subprocess.run(git + ["commit", "-qm", "develop"], cwd=root, check=True)
    return root


def _export(*args):
    proc = subprocess.run([sys.executable, TOOL, "--repo-root", REPO,
                           "--author", "A Dev <a.dev@example.com>", *args],
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def _run_fix_tests(tmp, optimizer_file, test_file):
    runner = os.path.join(tmp, "runner.py")
    with open(runner, "w") as f:
        f.write(RUNNER)
    out = subprocess.run([sys.executable, runner, optimizer_file, test_file],
                         capture_output=True, text=True, timeout=120).stdout
    ran, bad = re.search(r"RESULT (\d+) (\d+)", out).groups()
    return int(ran), int(bad)


TESTSLIST = {um.TESTSLIST: um.TESTSLIST_HEADER + "\n"}


class TestFixesPatch(unittest.TestCase):
    def setUp(self):
        import tempfile
        self.tmp = tempfile.mkdtemp(prefix="fixes_")
        self.addCleanup(subprocess.run, ["rm", "-rf", self.tmp])

    def test_patch_applies_with_git_am_and_its_tests_fail_before_pass_after(self):
        """Both bugs fixed within the line budget; the added tests fail on the
        unfixed file and pass on the fixed one; sizes printed per file."""
        tree = _tree(os.path.join(self.tmp, "Paddle"), dict(TESTSLIST, **{OPT: BUGGY}))
        out = os.path.join(self.tmp, "fixes.patch")
        rc, stdout, stderr = _export("--fixes", "--paddle-root", tree, "-o", out)
        self.assertEqual(rc, 0, stderr)
        self.assertIn("Patch size: 3 files", stdout)
        self.assertRegex(stdout, r"M\s+\+\d+\s+-\d+\s+%s" % re.escape(OPT))
        self.assertRegex(stdout, r"A\s+\+\d+\s+-0\s+%s" % re.escape(uf.TEST_PATH))
        with open(out) as f:
            patch = f.read()
        self.assertNotIn("paddle_muon_ext", patch)
        git = ["git", "-c", "user.name=T", "-c", "user.email=t@example.com"]
        subprocess.run(git + ["am", "-q", out], cwd=tree, check=True)
        log = subprocess.run(["git", "log", "-1", "--format=%an <%ae>|%s"], cwd=tree,
                             capture_output=True, text=True, check=True).stdout.strip()
        self.assertEqual(log.split("|")[0], "A Dev <a.dev@example.com>")
        stat = subprocess.run(["git", "diff", "--numstat", "HEAD~1"], cwd=tree,
                              capture_output=True, text=True, check=True).stdout
        changed = {line.split("\t")[2]: int(line.split("\t")[0]) + int(line.split("\t")[1])
                   for line in stat.splitlines()}
        self.assertEqual(set(changed), {OPT, uf.TEST_PATH, um.TESTSLIST})
        self.assertLessEqual(changed[OPT], uf.MAX_PRODUCT_LINES)
        with open(os.path.join(tree, um.TESTSLIST)) as f:
            self.assertIn("\ntest_muon_sharding_clear_grad,", f.read())
        with open(os.path.join(tree, uf.TEST_PATH)) as f:
            self.assertTrue(f.readline().startswith("# Copyright (c) 20"))
        before = os.path.join(self.tmp, "before.py")
        with open(before, "w") as f:
            f.write(BUGGY)
        test_file = os.path.join(tree, uf.TEST_PATH)
        ran, bad = _run_fix_tests(self.tmp, before, test_file)
        self.assertEqual((ran, bad), (2, 3))  # UB-1's two subTest rows, UB-2's test
        ran, bad = _run_fix_tests(self.tmp, os.path.join(tree, OPT), test_file)
        self.assertEqual((ran, bad), (2, 0))
        # the fixed file has nothing left to fix: each bug says why
        rc, _, stderr = _export("--fixes", "--paddle-root", tree, "-o",
                                os.path.join(self.tmp, "again.patch"))
        self.assertEqual(rc, 1)
        self.assertIn("UB-1: left out: clear_grad's `if self.tensor_fusion:` test has changed",
                      stderr)
        self.assertIn("UB-2: left out: clear_grad already drops", stderr)
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "again.patch")))

    def test_a_bug_whose_code_moved_is_left_out_and_the_others_fixed(self):
        """UB-1's branch reads differently: UB-1 left out with the reason, UB-2 fixed."""
        moved = BUGGY.replace("if self.tensor_fusion:", "if self.tensor_fusion or q.fused:")
        tree = _tree(os.path.join(self.tmp, "Paddle"), dict(TESTSLIST, **{OPT: moved}))
        out = os.path.join(self.tmp, "fixes.patch")
        rc, stdout, stderr = _export("--fixes", "--paddle-root", tree, "-o", out)
        self.assertEqual(rc, 0, stderr)
        self.assertIn("UB-1: left out: develop's text no longer matches", stderr)
        self.assertIn("(fixes: UB-2)", stdout)
        with open(out) as f:
            patch = f.read()
        self.assertIn("class TestReleasedGradientsRebindSliceGradients", patch)
        self.assertNotIn("class TestClearGradKeepsBufferGradients", patch)


class TestModesRefuseTreesLackingWhatTheyNeed(unittest.TestCase):
    def test_each_mode_names_what_is_missing(self):
        """One `error:` line naming the missing path (and testslist's header), exit 2,
        nothing written."""
        import tempfile
        tmp = tempfile.mkdtemp(prefix="modes_")
        self.addCleanup(subprocess.run, ["rm", "-rf", tmp])
        empty = os.path.join(tmp, "empty")
        os.makedirs(empty)
        only_list = _tree(os.path.join(tmp, "list"), dict(TESTSLIST))
        bad_header = _tree(os.path.join(tmp, "bad"), {um.TESTSLIST: "name,os\n"})
        rows = (
            ("tests-only, no testslist", ["--tests-only"], empty,
             [um.TESTSLIST, um.TESTSLIST_HEADER]),
            ("fixes, no optimizer", ["--fixes"], only_list, [OPT]),
            ("full, no checkout", [], only_list, ["python/paddle/", um.PROTO]),
            ("tests-only, wrong header", ["--tests-only"], bad_header,
             ["'name,os'", um.TESTSLIST_HEADER]),
        )
        for label, flags, tree, named in rows:
            with self.subTest(label):
                out = os.path.join(tmp, "x.patch")
                rc, stdout, stderr = _export(*flags, "--paddle-root", tree, "-o", out)
                self.assertEqual(rc, 2)
                self.assertEqual(len(stderr.strip().splitlines()), 1, stderr)
                self.assertTrue(stderr.startswith("error: "), stderr)
                for name in named:
                    self.assertIn(name, stderr)
                self.assertFalse(os.path.exists(out))

    def test_tests_only_on_a_testslist_only_tree(self):
        """Works, says the import checks did not run, prints sizes, no package name."""
        import tempfile
        tmp = tempfile.mkdtemp(prefix="modes_")
        self.addCleanup(subprocess.run, ["rm", "-rf", tmp])
        # a python/paddle/ without its __init__.py (a few files copied) is no package either
        sparse = _tree(os.path.join(tmp, "Sparse"),
                       {**TESTSLIST, "python/paddle/optimizer/README": "a few files\n"})
        rc, _, stderr = _export("--tests-only", "--paddle-root", sparse, "-o",
                                os.path.join(tmp, "sparse.patch"))
        self.assertEqual(rc, 0, stderr)
        self.assertIn("has no python/paddle/__init__.py: the tests' paddle imports are not "
                      "checked", stderr)
        tree = _tree(os.path.join(tmp, "Paddle"), dict(TESTSLIST))
        out = os.path.join(tmp, "tests.patch")
        rc, stdout, stderr = _export("--tests-only", "--paddle-root", tree, "-o", out)
        self.assertEqual(rc, 0, stderr)
        self.assertIn("has no python/paddle/__init__.py: the tests' paddle imports are not "
                      "checked", stderr)
        total = re.search(r"Patch size: (\d+) files, \+(\d+) / -(\d+) lines", stdout)
        per_file = re.findall(r"^\s+[AM]\s+\+(\d+)\s+-(\d+)\s+\S+$", stdout, re.M)
        self.assertEqual(int(total.group(1)), len(per_file))
        self.assertEqual(int(total.group(2)), sum(int(a) for a, _ in per_file))
        with open(out) as f:
            self.assertEqual(f.read().count("paddle_muon_ext"), 0)


class TestScrub(unittest.TestCase):
    def test_text_reads_as_paddles(self):
        """Copyright holder, marker lines and prose mentions; code-like names kept."""
        rows = (
            ("# Copyright (c) 2026 paddle_muon_ext Authors. All Rights Reserved.\n",
             "# Copyright (c) 2026 PaddlePaddle Authors. All Rights Reserved.\n"),
            ("x = 1\n# paddle_muon_ext: upstream-tests\ny = 2\n", "x = 1\ny = 2\n"),
            ('"""Harness for paddle_muon_ext\'s code."""\n', '"""Harness for code."""\n'),
            ("PATH = 'python/paddle_muon_ext/x'\nmy_paddle_muon_ext = 1\n",
             "PATH = 'python/paddle_muon_ext/x'\nmy_paddle_muon_ext = 1\n"),
        )
        for given, want in rows:
            with self.subTest(given):
                self.assertEqual(um.scrub(given), want)


if __name__ == "__main__":
    unittest.main()
