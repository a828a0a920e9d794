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
"""``export_upstream_patch.py --tests-only``: a marked test module travels
with the test-tree modules it imports, packages with their ``__init__.py``."""

from __future__ import annotations

import os

from tool_loader import load_tool

ep = load_tool("export_upstream_patch.py", "_muon_export_tool")

FLEET = "test/collective/fleet/"
BODY = "\n\nclass TestX(unittest.TestCase):\n    def test_a(self):\n        self.assertTrue(True)\n"


def _write_tree(root: str, files: dict) -> None:
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


def test_a_helper_package_travels_with_its_init(tmp_path):
    # ``from helperpkg.numbers import N`` needs test/helperpkg/__init__.py in
    # the patch too, or the import fails in Paddle's tree
    ours = {
        FLEET + "test_muon_uses_pkg.py": (ep.UPSTREAM_TESTS_MARKER + "\nimport unittest\n"
                                          "from helperpkg.numbers import N" + BODY),
        "test/helperpkg/__init__.py": "",
        "test/helperpkg/numbers.py": "N = 2\n",
        "test/helperpkg/unused.py": "M = 3\n",
    }
    repo, tree = str(tmp_path / "ext"), str(tmp_path / "Paddle")
    _write_tree(repo, ours)
    _write_tree(tree, {"README": "x\n"})
    ex = ep.build_export(repo, files=sorted(ours), paddle_tree=ep.PaddleTree(tree),
                         tests_only=True)
    assert {FLEET + "test_muon_uses_pkg.py", "test/helperpkg/__init__.py",
            "test/helperpkg/numbers.py"} <= set(ex.changes), sorted(ex.changes)
    assert "test/helperpkg/unused.py" not in ex.changes


def test_a_worker_script_named_with_a_directory_part_travels():
    # a launcher names its worker as a bare file name or with a directory part;
    # either way the worker beside the marked test goes into the patch
    for spelling in ("muon_w.py", "./muon_w.py", "test/collective/fleet/muon_w.py",
                     "/abs/path/muon_w.py"):
        ours = {
            FLEET + "test_muon_launches.py": (ep.UPSTREAM_TESTS_MARKER + "\nimport unittest\n"
                                              "WORKER = %r" % spelling + BODY),
            FLEET + "muon_w.py": "print('worker')\n",
            FLEET + "muon_other.py": "print('other')\n",
        }
        candidates = [(src, src, text) for src, text in ours.items()]
        selected, _left = ep.select_upstream_tests(candidates)
        assert sorted(c[1] for c in selected) == [FLEET + "muon_w.py",
                                                  FLEET + "test_muon_launches.py"], spelling
