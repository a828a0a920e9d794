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
"""The exporter's tests-only selection takes a file as an upstream test only
when the marker is a line of its own near the top: a file that merely quotes
the marker (a docstring, a later line) is left out; a marked file's
``from . import helper`` brings ``helper.py`` along; only files under
``test/`` are selected, whatever they carry."""

from __future__ import annotations

from tool_loader import load_tool

ep = load_tool("export_upstream_patch.py", "_muon_export_tool_marker")
MARKER = ep.UPSTREAM_TESTS_MARKER


def test_the_marker_as_a_header_line_marks_the_file():
    assert ep.is_upstream_test('"""doc"""\n  %s  \nimport os\n' % MARKER)


def test_a_quoted_or_late_marker_does_not():
    assert not ep.is_upstream_test('"""Files carrying %r are exported."""\n' % MARKER)
    late = "\n" * ep.MARKER_SCAN_LINES + MARKER + "\n"
    assert not ep.is_upstream_test(late)
    assert ep.is_upstream_test(MARKER + "\n" + late)


def test_a_module_named_by_from_dot_import_travels_with_the_marked_test():
    d = "test/collective/fleet/"
    candidates = [
        ("t/test_a.py", d + "test_a.py", MARKER + "\nfrom . import helper_x\n"),
        ("t/helper_x.py", d + "helper_x.py", "VALUE = 1\n"),
        ("t/unrelated.py", d + "unrelated.py", "VALUE = 2\n"),
    ]
    selected, left = ep.select_upstream_tests(candidates)
    assert [c[1] for c in selected] == [d + "test_a.py", d + "helper_x.py"]
    assert [src for src, _ in left] == ["t/unrelated.py"]


def test_a_marked_file_outside_the_test_tree_is_not_a_test():
    candidates = [("python/paddle_muon_ext/x.py", "python/paddle/x.py", MARKER + "\n")]
    selected, left = ep.select_upstream_tests(candidates)
    assert selected == []
    assert [src for src, _ in left] == ["python/paddle_muon_ext/x.py"]
