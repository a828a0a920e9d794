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
"""The exporter's rules, each over a table of cases with the expected result.

Every table row is an input and what the rule says it becomes, written from
the rule as ``tools/export_upstream_patch.py`` and docs/DEVELOPING.md state
it ("Export to Paddle"), not from the tool's output: where a file goes in
Paddle's tree, how imports are renamed (and what must not be), compat
blocks, which imports name a dropped package, marker lines near the top,
the testslist.csv row a test's labels give, the ctest registry's timeouts
and directory entries, and the proto field number a new option gets
(reserved ranges, reserved names, protobuf's own range, ``to max``).
"""

from __future__ import annotations

import os
import tempfile
import unittest

from tool_loader import load_tool

ep = load_tool("export_upstream_patch.py", "_muon_export_tool")

ENVS = "http_proxy=;https_proxy=;PYTHONPATH=../.."


class TestWhereFilesGo(unittest.TestCase):
    def test_map_path(self) -> None:
        table = [
            ("python/paddle_muon_ext/optimizer/muon.py", "python/paddle/optimizer/muon.py"),
            ("python/paddle_muon_ext/distributed/fleet/utils/x.py",
             "python/paddle/distributed/fleet/utils/x.py"),
            ("test/mock/test_mock_world.py", "test/collective/fleet/test_muon_mock_world.py"),
            ("test/mock/fake_comm.py", "test/collective/fleet/muon_mock/fake_comm.py"),
            ("test/mock/__init__.py", "test/collective/fleet/muon_mock/__init__.py"),
            ("test/legacy_test/test_muon_optimizer.py", "test/legacy_test/test_muon_optimizer.py"),
            ("test/collective/fleet/a.py", "test/collective/fleet/a.py"),
            ("tools/export_upstream_patch.py", None),
            ("README.md", None),
            ("python/paddle_muon_extras/a.py", None),
            ("pytest/x.py", None),
        ]
        for src, want in table:
            self.assertEqual(ep.map_path(src), want, src)

    def test_an_extra_map_entry_wins_over_the_default_map(self) -> None:
        extra = [("test/mock/", "test/legacy_test/harness/")]
        self.assertEqual(ep.map_path("test/mock/test_mock_world.py", extra),
                         "test/legacy_test/harness/test_mock_world.py")
        self.assertEqual(ep.map_path("test/legacy_test/t.py", extra), "test/legacy_test/t.py")

    def test_renamed_test_path(self) -> None:
        for dst, want in (("test/legacy_test/test_muon_optimizer.py",
                           "test/legacy_test/test_muon_optimizer_extended.py"),
                          ("a/b.c/test_x.py", "a/b.c/test_x_extended.py"),
                          ("test/x", "test/x_extended")):
            self.assertEqual(ep.renamed_test_path(dst), want, dst)


class TestImportRewrites(unittest.TestCase):
    def test_package_imports_become_paddle_and_lookalikes_stay(self) -> None:
        table = [
            ("import paddle_muon_ext\n", "import paddle\n"),
            ("import paddle_muon_ext as pm\n", "import paddle as pm\n"),
            ("from paddle_muon_ext import optimizer\n", "from paddle import optimizer\n"),
            ("from paddle_muon_ext.optimizer.muon import Muon\n",
             "from paddle.optimizer.muon import Muon\n"),
            ("import paddle_muon_ext.optimizer.muon\n", "import paddle.optimizer.muon\n"),
            ("x = paddle_muon_ext.optimizer.Muon\n", "x = paddle.optimizer.Muon\n"),
            ("t = 'paddle_muon_ext.optimizer.muon'\n", "t = 'paddle.optimizer.muon'\n"),
            ("my_paddle_muon_ext = 1\n", "my_paddle_muon_ext = 1\n"),
            ("paddle_muon_ext_version = 2\n", "paddle_muon_ext_version = 2\n"),
            ("y = obj.paddle_muon_ext.attr\n", "y = obj.paddle_muon_ext.attr\n"),
        ]
        for text, want in table:
            self.assertEqual(ep.rewrite_imports(text), want, text)

    def test_harness_imports_become_muon_mock_and_unittest_mock_stays(self) -> None:
        table = [
            ("from mock.fake_comm import FakeGroup\n", "from muon_mock.fake_comm import FakeGroup\n"),
            ("from mock import fake_comm\n", "from muon_mock import fake_comm\n"),
            ("import mock.fake_comm\n", "import muon_mock.fake_comm\n"),
            ("    from mock.world import run\n", "    from muon_mock.world import run\n"),
            ("from unittest import mock\n", "from unittest import mock\n"),
            ("import mock\n", "import mock\n"),
            ("from mockery import x\n", "from mockery import x\n"),
            ("with mock.patch('a'):\n", "with mock.patch('a'):\n"),
            ("x = 1  # from mock.fake import y\n", "x = 1  # from mock.fake import y\n"),
        ]
        for text, want in table:
            self.assertEqual(ep.rewrite_harness_imports(text), want, text)


class TestCompatBlocks(unittest.TestCase):
    B, E = ep.COMPAT_BEGIN, ep.COMPAT_END

    def test_blocks_are_cut_and_the_rest_kept(self) -> None:
        text = f"a\n{self.B}\nb\n{self.E}\nc\n    {self.B} (why)\n    d\n    {self.E}\ne\n"
        self.assertEqual(ep.strip_compat_blocks(text), "a\nc\ne\n")
        self.assertEqual(ep.strip_compat_blocks("a\nb\n"), "a\nb\n")

    def test_malformed_blocks_are_refused_naming_the_line(self) -> None:
        table = [
            (f"a\n{self.B}\n{self.B}\n{self.E}\n", r"f\.py:3: nested .* \(open at line 2\)"),
            (f"a\nb\n{self.E}\n", r"f\.py:3: .* without"),
            (f"a\n{self.B}\nb\n", r"f\.py:2: unterminated"),
        ]
        for text, pattern in table:
            with self.assertRaisesRegex(ep.ExportError, pattern):
                ep.strip_compat_blocks(text, "f.py")


class TestWhatCountsAsAReference(unittest.TestCase):
    def test_leftover_reference_lines(self) -> None:
        table = [
            ("import paddle_muon_ext\n", {1}),
            ("x = 1\ny = paddle_muon_ext.a\n", {2}),
            ("x = obj.paddle_muon_ext\n", set()),          # an attribute, not the package
            ("m = 'paddle_muon_ext.optimizer'\n", {1}),    # a module name in a string
            ("m = 'paddle_muon_ext'\n", {1}),
            ("m = 'see paddle_muon_ext docs'\n", set()),   # prose in a string
            ("# paddle_muon_ext here\n", set()),           # a comment
            ("my_paddle_muon_ext = 1\n", set()),
            ("def f(:\n  paddle_muon_ext\n", {2}),         # does not tokenize: line scan
        ]
        for text, want in table:
            self.assertEqual(ep.leftover_reference_lines(text), want, text)

    def test_dropped_module_lines(self) -> None:
        table = [
            ("from paddle.tools import cli\n", [(1, "paddle.tools")]),
            ("x = 1\nimport paddle.compat_paddle_3_3.patch\n",
             [(2, "paddle.compat_paddle_3_3.patch")]),
            ("import compat_paddle_3_3\n", [(1, "compat_paddle_3_3")]),
            ("from paddle.toolsx import y\n", []),
            ("from paddle import tools\n", []),
            ("from .tools import x\n", []),                # relative: the package's own
            ("from ..compat_paddle_3_3 import x\n", []),
            ("import paddle.distributed\n", []),
            ("def f(:\n", []),
        ]
        for text, want in table:
            self.assertEqual(ep.dropped_module_lines(text), want, text)

    def test_markers_count_only_in_the_first_lines(self) -> None:
        n = ep.MARKER_SCAN_LINES
        for marker, check in ((ep.COMPAT_ONLY_MARKER, ep.is_compat_only),
                              (ep.UPSTREAM_TESTS_MARKER, ep.is_upstream_test)):
            last = "\n" * (n - 1) + marker + "\n"
            past = "\n" * n + marker + "\n"
            self.assertTrue(check(marker + "\n"), marker)
            self.assertTrue(check(last), f"{marker} on line {n}")
            self.assertFalse(check(past), f"{marker} on line {n + 1}")
            self.assertFalse(check("x = 1\n"), marker)


class TestTestRegistration(unittest.TestCase):
    def test_testslist_row_per_label_set(self) -> None:
        single = ["", "test_runner.py", "", ""]
        dist = ["DIST", "../../legacy_test/dist_test.sh", "2", "1"]
        table = [
            # labels: (arch, run_type/launcher/ports/serial, conditions)
            (frozenset(), ("", single, "")),
            (frozenset({"CPU"}), ("", single, "")),
            (frozenset({"GPU"}), ("GPU", single, "WITH_NCCL")),
            (frozenset({"CPU", "GPU"}), ("", single, "")),
            (frozenset({"CPU", "DIST"}), ("", dist, "WITH_GLOO")),
            (frozenset({"GPU", "DIST"}), ("GPU", dist, "WITH_NCCL")),
            (frozenset({"CPU", "GPU", "DIST"}), ("", dist, "WITH_GLOO")),
        ]
        for labels, (arch, run, conditions) in table:
            for timeout in (60, 300):
                row = ep.testslist_row("test_x", ep.TestMeta(timeout, labels, True))
                self.assertEqual(row, ["test_x", "", arch, str(timeout)] + run
                                 + [ENVS, conditions], sorted(labels))

    def test_registry_timeouts_labels_and_directory_entries(self) -> None:
        cmake = (
            'muon_py_test(t_a FILES test/legacy_test/test_a.py TIMEOUT 60 LABELS "CPU")\n'
            "muon_py_test(t_b\n"
            '             FILES test/collective/fleet/test_b.py::TestB TIMEOUT 200 LABELS "CPU;DIST")\n'
            'muon_py_test(t_c FILES test/mock/ TIMEOUT 300 LABELS "CPU")\n'
            'muon_py_test(t_a2 FILES test/legacy_test/test_a.py TIMEOUT 30 LABELS "GPU")\n'
            "muon_py_test(t_d FILES test/legacy_test/test_d.py)\n"
        )
        with tempfile.TemporaryDirectory() as root:
            with open(os.path.join(root, ep.TEST_REGISTRY), "w") as f:
                f.write(cmake)
            registry = ep.read_test_registry(root)
        table = [
            # registered twice: the larger timeout, both label sets
            ("test/legacy_test/test_a.py", (60, {"CPU", "GPU"}, True)),
            ("test/collective/fleet/test_b.py", (200, {"CPU", "DIST"}, True)),
            ("test/mock/test_mock_world.py", (300, {"CPU"}, True)),   # inside a listed dir
            ("test/mock/sub/x.py", (300, {"CPU"}, True)),
            ("test/mockery/test_x.py", (ep.DEFAULT_TEST_TIMEOUT, set(), False)),
            ("test/legacy_test/test_d.py", (ep.DEFAULT_TEST_TIMEOUT, set(), True)),
            ("test/legacy_test/test_unlisted.py", (ep.DEFAULT_TEST_TIMEOUT, set(), False)),
        ]
        for src, (timeout, labels, registered) in table:
            meta = ep.test_meta(registry, src)
            self.assertEqual((meta.timeout, set(meta.labels), meta.registered),
                             (timeout, labels, registered), src)
        self.assertEqual(ep.read_test_registry(tempfile.gettempdir() + "/no-such-dir-x"), {})

    def test_add_testslist_rows(self) -> None:
        header = ep.TESTSLIST_HEADER
        row = ep.testslist_row("test_b", ep.TestMeta(120, frozenset({"CPU"}), True))
        line_b = ",".join(row)
        table = [
            # (existing text, rows, new text, added, present)
            (header + "\n", [row], header + "\n" + line_b + "\n", ["test_b"], []),
            (header, [row], header + "\n" + line_b + "\n", ["test_b"], []),
            (header + "\ntest_b,,,9\n", [row], header + "\ntest_b,,,9\n", [], ["test_b"]),
            (header + "\ntest_a,,,1\ntest_b,,,9\n", [row, ["test_a"] + row[1:]],
             header + "\ntest_a,,,1\ntest_b,,,9\n", [], ["test_b", "test_a"]),
            (header + "\n test_b ,,,9\n\n", [row], header + "\n test_b ,,,9\n\n", [], ["test_b"]),
        ]
        for text, rows, want, added, present in table:
            self.assertEqual(ep.add_testslist_rows(text, rows), (want, added, present), text)
        for bad in ("", "name,os\n", "x\n" + header + "\n"):
            with self.assertRaisesRegex(ep.EditConflict, "header is"):
                ep.add_testslist_rows(bad, [row])


def _option(name="muon_new", default="false", message="M", proto_type="bool"):
    return ep.StrategyOption(message, "sharding_configs", name, proto_type, default, "doc")


class TestProtoFieldNumbers(unittest.TestCase):
    def test_next_field_number(self) -> None:
        table = [
            ("optional int32 a = 1;", 2),
            ("optional int32 a = 1; optional bool b = 5 [default = false];", 6),
            ("optional int32 a = 7 [default = 3];", 8),
            ("optional int32 a = 1; reserved 2 to 4;", 5),
            ("optional int32 a = 1; reserved 2, 9 to 11;", 12),
            ("optional int32 a = 3; reserved 10;", 11),
            ('optional int32 a = 1; reserved "f7", "g80";', 2),       # names are not numbers
            ("optional int32 a = 1; reserved 'x9';", 2),
            ("optional int32 a = 1; extensions 100 to 199;", 200),
            ("optional int32 a = 18999;", 20000),                      # protobuf's own range
            ("optional int32 a = 1; reserved 10 to max;", 2),
            ("optional int32 a = 9; reserved 10 to max;", 8),          # highest free below
            ("optional int32 a = 9; optional int32 b = 8; reserved 10 to max;", 7),
            # protoc refuses the overlap, but the rule still names the highest free number
            ("optional int32 a = 1; reserved 10 to max; reserved 12 to 15;", 9),
            ("", 1),
        ]
        for body, want in table:
            self.assertEqual(ep.next_field_number(body, "M"), want, body)
        with self.assertRaisesRegex(ep.EditConflict, r"message M has no free field number"
                                                     r".*reserved 3 to max"):
            ep.next_field_number("optional int32 a = 1; optional int32 b = 2; "
                                 "reserved 3 to max;", "M")

    def test_used_field_ranges(self) -> None:
        ranges = ep.used_field_ranges('optional int32 a = 4; reserved 6, 8 to 9, "n1"; '
                                      "extensions 20 to max;")
        self.assertEqual(sorted(ranges), sorted([(4, 4), (6, 6), (8, 9), (20, ep.PROTO_MAX_FIELD),
                                                 ep.PROTO_IMPL_RANGE]))

    def test_add_proto_fields(self) -> None:
        proto = ("syntax = \"proto2\";\n"
                 "message M {\n"
                 "    optional int32 a = 1;\n"
                 "    // optional int32 commented = 40;\n"
                 "    message Inner { optional int32 deep = 30; }\n"
                 "    optional bool b = 3 [ default = true ];\n"
                 "}\n")
        text, added, present = ep.add_proto_fields(proto, [_option()])
        self.assertEqual((added, present), (["muon_new"], []))
        self.assertIn("    optional bool b = 3 [ default = true ];\n"
                      "    optional bool muon_new = 4 [ default = false ];\n}\n", text)
        # already there with the same default: present, text unchanged
        self.assertEqual(ep.add_proto_fields(text, [_option()]), (text, [], ["muon_new"]))
        self.assertEqual(ep.add_proto_fields(proto, [_option("b", "true")]),
                         (proto, [], ["b"]))
        conflicts = [
            (proto, _option("b", "false"), "M.b exists with default true, the export needs false"),
            (proto.replace("optional bool b = 3 [ default = true ]", "optional bool b = 3"),
             _option("b", "false"), r"M\.b exists with default \(none\)"),
            (proto, _option(message="Other"), "no `message Other {` to add field muon_new"),
            (proto.replace("];\n}", "]; }"), _option(), "closing brace of message M is not on"),
        ]
        for text_in, opt, pattern in conflicts:
            with self.assertRaisesRegex(ep.EditConflict, pattern):
                ep.add_proto_fields(text_in, [opt])


class TestTestsOnlySelection(unittest.TestCase):
    """What a marked test pulls in: test-tree modules it imports, transitively."""

    def test_table(self) -> None:
        m = ep.UPSTREAM_TESTS_MARKER
        fleet = "test/collective/fleet/"
        files = {
            fleet + "test_a.py": f"{m}\nimport helper_x\nSCRIPT = 'worker_w.py'\n",
            fleet + "helper_x.py": "from muon_mock.fake_comm import F\n",
            fleet + "muon_mock/__init__.py": "",
            fleet + "muon_mock/fake_comm.py": "F = 1\n",
            fleet + "muon_mock/world.py": "W = 1\n",
            fleet + "muon_mock/unused.py": "U = 1\n",
            fleet + "worker_w.py": "import os\n",
            fleet + "test_b.py": "import helper_y\n",               # not marked
            fleet + "helper_y.py": "Y = 1\n",
            "test/legacy_test/test_c.py": f"{m}\nimport helper_z\nimport muon_mock.world\n",
            fleet + "helper_z.py": "Z = 1\n",                        # found through a root
            fleet + "pkg/__init__.py": "",
            fleet + "pkg/test_d.py": f"{m}\nfrom . import sib\nfrom .. import up\n",
            fleet + "pkg/sib.py": "S = 1\n",
            fleet + "up.py": "",
            "test/collective/up.py": "",                             # one level too far
            fleet + "late.py": "\n" * ep.MARKER_SCAN_LINES + m + "\n",  # marker too late
            "python/paddle/x.py": f"{m}\n",                          # not under test/
        }
        candidates = [("src/" + dst, dst, text) for dst, text in files.items()]
        selected, left = ep.select_upstream_tests(candidates)
        want = {fleet + p for p in ("test_a.py", "helper_x.py", "muon_mock/__init__.py",
                                    "muon_mock/fake_comm.py", "muon_mock/world.py",
                                    "worker_w.py", "helper_z.py", "pkg/__init__.py",
                                    "pkg/test_d.py", "pkg/sib.py", "up.py")}
        want.add("test/legacy_test/test_c.py")
        self.assertEqual({c[1] for c in selected}, want)
        self.assertEqual([c[1] for c in selected], [d for d in files if d in want],
                         "selected in input order")
        self.assertEqual({src for src, _ in left}, {"src/" + d for d in files if d not in want})
        for _, reason in left:
            self.assertIn(m, reason)


class TestModuleNames(unittest.TestCase):
    def test_init_exports_and_imported_names(self) -> None:
        text = ("from .a import A\nimport os.path\nimport numpy as np\n"
                "__all__ = ['A', 'B']\n__all__ += ['C']\nOTHER = ['D']\n"
                "def f():\n    import sys\n")
        imports, names = ep.init_exports(text)
        self.assertEqual(imports, ["from .a import A", "import os.path", "import numpy as np"])
        self.assertEqual(names, ["A", "B", "C"])
        self.assertEqual(ep.imported_names(text), {"A", "os", "np"})
        self.assertEqual(ep.init_exports("def f(:\n"), ([], []))
        self.assertEqual(ep.imported_names("def f(:\n"), set())


if __name__ == "__main__":
    unittest.main()
