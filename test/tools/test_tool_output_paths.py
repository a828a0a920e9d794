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
"""The tools write only their own files: every output path (``plan --png``,
``export_upstream_patch.py -o`` / ``--notes``) that is not a plain file of
the tool's own -- a device, a FIFO, a directory, a link, a read-only file, a
missing directory, a directory that refuses new files, a name too long -- is
one ``error:`` line and exit 2 before any work, with nothing written and
nothing left; an existing file keeps its mode, a new one gets the umask's."""

from __future__ import annotations

import errno
import io
import os
import shutil
import stat
import subprocess
import tempfile
import unittest
from contextlib import redirect_stderr, redirect_stdout
from unittest import mock

from tool_loader import load_tool

from paddle_muon_ext.tools import cli, limits

ep = load_tool("export_upstream_patch.py", "_muon_export_tool")

LAYOUT = ["--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "2", "--model", "tiny"]
# the longest name most file systems allow (NAME_MAX 255) and one byte more
LONGEST, TOO_LONG = "a" * 251 + ".png", "a" * 252 + ".png"


def _git(cwd: str, *args: str) -> None:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@e",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@e")
    subprocess.run(["git", *args], cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL)


class _Dir(unittest.TestCase):
    """A scratch directory holding each kind of thing an output path can name."""

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="muon_outpaths_")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.sub = os.path.join(self.dir, "sub")
        os.mkdir(self.sub)
        self.fifo = os.path.join(self.dir, "pipe.png")
        os.mkfifo(self.fifo)
        self.ro = self._file("ro.png", 0o444)
        self.link = os.path.join(self.dir, "link.png")
        os.symlink(self._file("target.png", 0o644), self.link)
        self.plain = self._file("plain.txt", 0o644)
        self.before = self._listing()

    def _file(self, name: str, mode: int) -> str:
        path = os.path.join(self.dir, name)
        with open(path, "wb") as f:
            f.write(b"old")
        os.chmod(path, mode)
        return path

    def _listing(self) -> dict:
        out = {}
        for base, _dirs, files in os.walk(self.dir):
            for name in files + _dirs:
                st = os.lstat(os.path.join(base, name))
                out[os.path.relpath(os.path.join(base, name), self.dir)] = (st.st_mode,
                                                                           st.st_size)
        return out

    def refused_rows(self, flag: str) -> list:
        """(path, the words of its one-line refusal) of every unusable path."""
        return [
            ("/dev/null", f"{flag} /dev/null: is a character device, not a regular file"),
            ("/dev/full", f"{flag} /dev/full: is a character device, not a regular file"),
            ("/dev/stdout", f"{flag} /dev/stdout: is a symbolic link"),
            (self.sub, f"{flag} {self.sub}: is a directory"),
            (self.fifo, f"{flag} {self.fifo}: is a FIFO, not a regular file"),
            (self.link, f"{flag} {self.link}: is a symbolic link"),
            (self.ro, f"{flag} {self.ro}: is read-only (mode 0444)"),
            (os.path.join(self.dir, "missing", "x.png"), "missing does not exist"),
            (os.path.join(self.plain, "x.png"), "a part of its directory is a file"),
            (os.path.join(self.dir, TOO_LONG), "has a 256-byte file name, above the 255"),
            ("", f"{flag} '': is an empty file name"),
            ("/proc/x.png", f"{flag} /proc/x.png: cannot write in /proc"),
        ]

    def assert_nothing_changed(self, what) -> None:
        self.assertEqual(self._listing(), self.before, f"{what}: something was written or left")
        for dev in ("/dev/null", "/dev/full"):
            self.assertTrue(stat.S_ISCHR(os.lstat(dev).st_mode), f"{what}: {dev} replaced")
        self.assertFalse(os.path.lexists("/dev/null.NOTES.md"), what)
        self.assertFalse(os.path.lexists("/dev/stdout.png"), what)


class TestPlanPng(_Dir):
    def _plan(self, *png: str):
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            code = cli.main(["plan", *LAYOUT, "--png", *png])
        return code, out.getvalue(), [ln for ln in err.getvalue().splitlines() if ln.strip()]

    def test_an_unusable_path_is_one_error_line_and_nothing_is_written(self) -> None:
        rows = self.refused_rows("--png") + [
            (os.path.join(self.dir, "plan.pdf"), "plan.pdf: does not end in .png"),
            (os.path.join(self.dir, "plan.png.txt"), "does not end in .png"),
            ("-", "--png -: standard output is not supported here"),
        ]
        for path, words in rows:
            with self.subTest(path=path[:60]):
                code, out, err = self._plan(path)
                self.assertEqual((code, out), (2, ""), err)
                self.assertEqual(len(err), 1, err)
                self.assertTrue(err[0].startswith("error: "), err)
                self.assertIn(words, err[0])
                self.assert_nothing_changed(path)

    def test_a_file_system_that_refuses_new_files_is_refused_up_front(self) -> None:
        png = os.path.join(self.dir, "p.png")
        with mock.patch.object(limits, "_create_beside",
                               side_effect=OSError(errno.EROFS, "Read-only file system")):
            code, out, err = self._plan(png)
        self.assertEqual((code, out, len(err)), (2, "", 1), err)
        self.assertIn(f"--png {png}: cannot write in {self.dir} (Read-only file system)", err[0])
        self.assert_nothing_changed("read-only file system")

    def test_modes_of_the_written_picture(self) -> None:
        # (existing mode or None for a new file, umask, the mode after)
        rows = [(0o644, 0o022, 0o644), (0o600, 0o022, 0o600), (0o664, 0o077, 0o664),
                (None, 0o022, 0o644), (None, 0o077, 0o600), (None, 0o002, 0o664)]
        for old, umask, want in rows:
            with self.subTest(old=old, umask=oct(umask)):
                png = os.path.join(self.dir, "m.png")
                if old is not None:
                    self._file("m.png", old)
                elif os.path.exists(png):
                    os.remove(png)
                saved = os.umask(umask)
                try:
                    code, _out, err = self._plan(png)
                finally:
                    os.umask(saved)
                self.assertEqual(code, 0, err)
                self.assertEqual(stat.S_IMODE(os.stat(png).st_mode), want)
                with open(png, "rb") as f:
                    self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")

    def test_the_longest_legal_name_is_written_with_nothing_left_beside(self) -> None:
        png = os.path.join(self.dir, LONGEST)
        code, out, err = self._plan(png)
        self.assertEqual(code, 0, err)
        self.assertIn(f"wrote {png}", out)
        self.assertEqual(set(self._listing()) - set(self.before), {LONGEST})


class TestExporterOutputs(_Dir):
    @classmethod
    def setUpClass(cls) -> None:
        cls.repo = tempfile.mkdtemp(prefix="muon_outpaths_repo_")
        path = os.path.join(cls.repo, "python", "paddle_muon_ext", "optimizer", "muon_x.py")
        os.makedirs(os.path.dirname(path))
        with open(path, "w") as f:
            f.write("X = 1\n")
        _git(cls.repo, "init", "-q")
        _git(cls.repo, "add", "-A")
        _git(cls.repo, "commit", "-q", "-m", "x")

    @classmethod
    def tearDownClass(cls) -> None:
        shutil.rmtree(cls.repo, True)

    def _export(self, *argv: str):
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err), \
                mock.patch.object(ep, "build_export", wraps=ep.build_export) as work:
            code = ep.main(["--repo-root", self.repo, *argv])
        return code, out.getvalue(), [ln for ln in err.getvalue().splitlines() if ln.strip()], \
            work.called

    def test_an_unusable_path_is_one_error_line_before_any_work(self) -> None:
        good = os.path.join(self.dir, "m.patch")
        rows = [(["-o", p], w) for p, w in self.refused_rows("-o")] + [
            (["-o", os.path.join(self.dir, "a" * 248 + ".patch")],
             ".NOTES.md: has a 257-byte file name"),
            (["-o", good, "--notes", "/dev/null"], "--notes /dev/null: is a character device"),
            (["-o", good, "--notes", "-"], "--notes -: standard output is not supported"),
            (["-o", good, "--notes", good], f"--notes {good}: is the -o file"),
            (["-o", good, "--include", "["], "--include '[' matches no file of the checkout"),
            (["-o", good, "--include", "python/nothing/*"], "matches no file"),
        ]
        for argv, words in rows:
            with self.subTest(argv=[a[:60] for a in argv]):
                code, out, err, worked = self._export(*argv)
                self.assertEqual((code, out), (2, ""), err)
                self.assertEqual(len(err), 1, err)
                self.assertTrue(err[0].startswith("export_upstream_patch: error: "), err)
                self.assertIn(words, err[0])
                if "--include" not in argv:
                    self.assertFalse(worked, "the path is checked before the export")
                self.assert_nothing_changed(argv)

    def test_the_patch_to_standard_output_and_modes_kept(self) -> None:
        code, out, err, _ = self._export("-o", "-")
        self.assertEqual(code, 0, err)
        self.assertTrue(out.startswith("From "), out[:200])
        self.assertIn("+X = 1", out)
        self.assertIn("Wrote the patch to standard output", "\n".join(err))
        self.assertEqual(self._listing(), self.before, "-o - writes no file")
        # the longest names: 252 bytes for the patch, 255 for its notes
        code, _out, err, _ = self._export("-o", os.path.join(self.dir, "a" * 246 + ".patch"))
        self.assertEqual(code, 0, err)
        self.assertEqual(set(self._listing()) - set(self.before),
                         {"a" * 246 + ".patch", "a" * 246 + ".NOTES.md"})
        patch = self._file("m.patch", 0o640)
        code, _out, err, _ = self._export("-o", patch, "--include", "python/*")
        self.assertEqual(code, 0, err)
        notes = os.path.join(self.dir, "m.NOTES.md")
        self.assertEqual((stat.S_IMODE(os.stat(patch).st_mode), os.path.isfile(notes)),
                         (0o640, True))
        with open(patch) as f:
            self.assertIn("+X = 1", f.read())


class TestPlanAsksTheOptimizersRule(unittest.TestCase):
    """``plan`` refuses what ``ShardingSettings.check_layout`` refuses, and
    ``--recommend`` proposes nothing it refuses."""

    def test_refused_layouts_are_one_error_line_naming_the_optimizers_reason(self) -> None:
        base = ["plan", "--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "2"]
        rows = [
            (["--comm-overlap", "--pp", "2"], "--comm-overlap --pp 2 (as sharding settings): "
             "refused by MuonShardingOptimizer: sharding_configs.comm_overlap=True cannot be "
             "combined with pipeline parallel (pp_degree=2)"),
            (["--comm-overlap", "--pp", "2", "--recommend"], "cannot be combined with pipeline"),
            (["--comm-overlap", "--buffer-size-MB", "0"], "needs fused gradient buffers"),
        ]
        for extra, words in rows:
            with self.subTest(extra=extra):
                out, err = io.StringIO(), io.StringIO()
                with redirect_stdout(out), redirect_stderr(err):
                    code = cli.main([*base, *extra])
                lines = err.getvalue().splitlines()
                self.assertEqual((code, out.getvalue(), len(lines)), (2, "", 1), lines)
                self.assertIn(words, lines[0])
        for extra in (["--pp", "2", "--comm-overlap"], ["--pp", "2"], ["--comm-overlap"]):
            pp = 2 if "--pp" in extra else 1
            refused = limits.optimizer_refusal(pp, "--comm-overlap" in extra, 256.0)
            with self.subTest(rule_for=extra):
                self.assertEqual(refused is not None, pp == 2 and "--comm-overlap" in extra)

    def test_recommend_skips_every_candidate_the_optimizer_refuses(self) -> None:
        from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.settings import ShardingSettings

        real = ShardingSettings.check_layout

        def no_1024(settings, pp):  # a stand-in rule: 1,024 MB buffers refused
            if settings.comm_buffer_size_MB == 1024:
                raise ValueError("1024 refused")
            return real(settings, pp)

        argv = ["plan", "--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "2",
                "--model", "tiny", "--recommend", "--json"]
        for rule, want_1024 in ((real, True), (no_1024, False)):
            out = io.StringIO()
            with mock.patch.object(ShardingSettings, "check_layout", rule), \
                    redirect_stdout(out), redirect_stderr(io.StringIO()):
                self.assertEqual(cli.main(argv), 0)
            import json

            sizes = {c["config"]["comm_buffer_size_MB"]
                     for c in json.loads(out.getvalue())["recommend"]["candidates"]}
            with self.subTest(refuse_1024=not want_1024):
                self.assertEqual(1024.0 in sizes, want_1024, sorted(sizes))
                self.assertTrue(sizes, "other candidates stay")


if __name__ == "__main__":
    unittest.main()
