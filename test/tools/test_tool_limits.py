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
"""``paddle_muon_ext.tools.limits``: every input bounded, every error one line
``<what> <value>: <why>, <what to do>`` naming the file and entry."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import unittest

from paddle_muon_ext.tools import limits as L


class TestModelFile(unittest.TestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="muon_limits_")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def _file(self, name: str, content, binary: bool = False) -> str:
        path = os.path.join(self.dir, name)
        with open(path, "wb" if binary else "w") as f:
            f.write(content if binary or isinstance(content, str) else json.dumps(content))
        return path

    def _error(self, path: str) -> str:
        with self.assertRaises(L.InputError) as info:
            L.read_model_file(path)
        return str(info.exception)

    def test_bad_files_name_the_file_and_why(self) -> None:
        cases = {
            self.dir: "is a directory",
            os.devnull: "is not a regular file",
            os.path.join(self.dir, "missing.json"): "no such file or directory",
            self._file("bin.json", b"\x89PNG\x00\xff\xfe", binary=True): "is not UTF-8 text",
            self._file("broken.json", "{nope"): "is not valid JSON (line 1",
            self._file("empty.json", []): "holds no parameter list",
        }
        for path, why in cases.items():
            message = self._error(path)
            self.assertTrue(message.startswith(f"model file {path}: {why}"), message)

    def test_an_integer_too_long_to_read_names_the_file_and_its_place(self) -> None:
        """An integer with more digits than Python converts (4300 by default)
        is one InputError naming the file, the integer's length and its line
        and column, never Python's bare 'Exceeds the limit'; through the CLI,
        one error line and exit 2. The same digits inside a string are text."""
        import io
        import sys
        from contextlib import redirect_stdout
        from unittest import mock

        from paddle_muon_ext import cli

        limit = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 4300
        huge = "7" * (limit + 700)
        rows = [
            ("in a shape", '[{"name": "w", "shape": [' + huge + ', 4]}]', 1, 26),
            ("negative, line 3", '[\n {"name": "w", "shape": [4, 4],\n  "x": -' + huge + "}]",
             3, 8),
            ("after the digits in a string",
             '[{"name": "' + huge + '", "shape": [4, 4]},\n {"name": "v", "shape": [' + huge
             + "]}]", 2, 26),
        ]
        for label, text, line, column in rows:
            with self.subTest(label):
                path = self._file(f"{label.replace(' ', '_')}.json", text)
                message = self._error(path)
                self.assertTrue(message.startswith(
                    f"model file {path}: holds an integer of {len(huge)} digits at line "
                    f"{line}, column {column} (Python reads at most {limit})"), message)
                self.assertNotIn("Exceeds the limit", message)
        err = io.StringIO()
        with redirect_stdout(io.StringIO()), mock.patch("sys.stderr", err):
            code = cli.main(["plan", "--ep", "2", "--moe-sharding", "2", "--gpus-per-node",
                             "4", "--model", path])
        self.assertEqual(code, 2, err.getvalue())
        self.assertEqual(len(err.getvalue().splitlines()), 1, err.getvalue())
        self.assertTrue(err.getvalue().startswith(f"error: model file {path}: holds an "
                                                  "integer of"), err.getvalue())

    def test_only_whole_regular_files_are_read(self) -> None:
        from unittest import mock

        path = self._file("m.json", [{"name": "w", "shape": [4, 4]}])
        size = os.path.getsize(path)
        self.assertEqual(len(L.read_regular_file("f", path, size, "fix")), size)
        with self.assertRaisesRegex(L.InputError, f"is {size} bytes, above the limit {size - 1}"):
            L.read_regular_file("f", path, size - 1, "fix")
        # a file that grows after its size was taken is cut at the limit + 1 and refused
        real_fstat = os.fstat

        def small_fstat(fd):
            st = real_fstat(fd)
            return os.stat_result((st.st_mode, *st[1:6], 1, *st[7:]))

        with mock.patch.object(L.os, "fstat", small_fstat):
            with self.assertRaisesRegex(L.InputError, "grew above the limit 5 bytes"):
                L.read_regular_file("f", path, 5, "fix")
        with mock.patch.object(L.os, "read", side_effect=OSError(5, "Input/output error")):
            with self.assertRaisesRegex(L.InputError,
                                        r"f .*m.json: cannot be read \(Input/output error\), fix"):
                L.read_regular_file("f", path, size, "fix")
        fifo = os.path.join(self.dir, "fifo")
        os.mkfifo(fifo)  # opened non-blocking and refused: no writer would block a read
        with self.assertRaisesRegex(L.InputError, "is not a regular file"):
            L.read_regular_file("f", fifo, size, "fix")

    def test_bad_entries_name_file_entry_and_value(self) -> None:
        cases = [
            ({"name": "w", "shape": [128.7, 4]}, "shape [128.7, 4]: dimension 128.7 is not an integer"),
            ({"name": "w", "shape": "abc"}, 'shape "abc": is not a list'),
            ({"name": "w", "shape": []}, "shape []: has 0 dims"),
            ({"name": "w", "shape": [0, 4]}, "shape [0, 4]: dimension 0 is outside 1.."),
            ({"name": "w", "shape": [2, 2, 2, 2]}, "shape [2, 2, 2, 2]: has 4 dims"),
            ({"name": "w", "shape": [True, 2]}, "dimension True is not an integer"),
            ({"name": "w", "shape": [8], "use_muon": True}, "is 1-D but use_muon is true"),
            ({"name": "w", "shape": [8], "use_muon": "yes"}, 'use_muon "yes": is not true/false'),
            ({"name": "w", "shape": [8, 8], "dtype": "int8"}, "dtype 'int8': is not a known dtype"),
        ]
        for entry, why in cases:
            path = self._file("m.json", [{"name": "ok", "shape": [4, 4]}, entry])
            message = self._error(path)
            self.assertTrue(message.startswith(f"model file {path} entry 1 ('w')"), message)
            self.assertIn(why, message)
        path = self._file("m.json", [{"shape": [4]}])
        self.assertIn("entry 0", self._error(path))
        self.assertIn("needs a non-empty string 'name'", self._error(path))

    def test_valid_file_is_read(self) -> None:
        path = self._file("ok.json", {"params": [
            {"name": "w", "shape": [4, 8], "dtype": "bfloat16", "is_expert": True},
            {"name": "b", "shape": [8]}]})
        entries = L.read_model_file(path)
        self.assertEqual([(e["name"], e["shape"], e["dtype"], e["is_expert"], e["use_muon"])
                          for e in entries],
                         [("w", (4, 8), "bfloat16", True, None), ("b", (8,), "float32", False, None)])


class TestValues(unittest.TestCase):
    def test_int_bounds(self) -> None:
        self.assertEqual(L.check_int("--ep", 4, 1, 8, "fix"), 4)
        for value, why in ((0, "must be >= 1"), (9, "above the limit 8"), (2.5, "must be an integer")):
            with self.assertRaises(L.InputError) as info:
                L.check_int("--ep", value, 1, 8, "pass a smaller one")
            self.assertEqual(str(info.exception).split(":")[0], f"--ep {value}")
            self.assertIn(why, str(info.exception))
            self.assertTrue(str(info.exception).endswith(", pass a smaller one"))

    def test_float_bounds(self) -> None:
        for value, why in ((0.0, "must be > 0"), (float("nan"), "finite"), (float("inf"), "finite"),
                           (-1.0, "must be > 0")):
            with self.assertRaisesRegex(L.InputError, why):
                L.check_float("--beta-net", value, "fix")
        self.assertEqual(L.check_float("--x", 0.0, "fix", positive=False), 0.0)
        with self.assertRaisesRegex(L.InputError, "must be >= 0"):
            L.check_float("--x", -1.0, "fix", positive=False)
        with self.assertRaisesRegex(L.InputError, "above the limit 4"):
            L.check_float("--x", 5.0, "fix", high=4.0)

    def test_writable(self) -> None:
        d = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, d, True)
        self.assertEqual(L.check_writable("--png", os.path.join(d, "x.png")),
                         os.path.join(d, "x.png"))
        for path, why in ((os.path.join(d, "no", "x.png"), "does not exist"), (d, "is a directory"),
                          ("/proc/x.png", "cannot write in /proc")):
            with self.assertRaisesRegex(L.InputError, why):
                L.check_writable("--png", path)

    def test_png_path_and_local_size(self) -> None:
        self.assertEqual((L.png_path("out"), L.png_path("a/b.png")), ("out.png", "a/b.png"))
        self.assertIsNone(L.check_local_size(8, {"PADDLE_LOCAL_SIZE": "8"}))
        self.assertIsNone(L.check_local_size(8, {}))
        # unset, set but empty or blank, or equal: no note (a launcher may export it empty)
        for env in ({}, {"PADDLE_LOCAL_SIZE": ""}, {"PADDLE_LOCAL_SIZE": "  "},
                    {"PADDLE_LOCAL_SIZE": "8"}, {"PADDLE_LOCAL_SIZE": " 8 "}):
            with self.subTest(env=env):
                self.assertIsNone(L.check_local_size(8, env))
        note = L.check_local_size(8, {"PADDLE_LOCAL_SIZE": "4"})
        self.assertIn("PADDLE_LOCAL_SIZE=4", note)
        self.assertIn("--gpus-per-node 8", note)
        self.assertEqual(len(note.splitlines()), 1)


class TestWorldLimit(unittest.TestCase):
    def test_the_world_limit_is_inclusive(self) -> None:
        import argparse

        from paddle_muon_ext.tools.args import build_config

        def args(ep, ms):
            return argparse.Namespace(ep=ep, moe_sharding=ms, pp=1, gpus_per_node=1,
                                      order="ms,pp,ep", model="tiny", nodes=None)

        self.assertEqual(build_config(args(5, 3), max_world=15).world_size, 15)
        with self.assertRaises(L.InputError) as info:
            build_config(args(4, 4), max_world=15)
        self.assertIn("4 x 4 = 16", str(info.exception))


if __name__ == "__main__":
    unittest.main()
