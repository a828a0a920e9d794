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
"""Rules every file of the test tree keeps, read from its syntax tree: no
module imports a ``test_*`` module (shared helpers live in helper modules),
and no docstring names the review or the work that found a test's bug
(a docstring says what the test pins)."""

from __future__ import annotations

import ast
import os
import re
import unittest

TEST_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tree_files() -> list[str]:
    """Every ``.py`` file under ``test/``, as paths relative to it."""
    found = []
    for dirpath, dirnames, filenames in os.walk(TEST_ROOT):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__")))
        found += [os.path.relpath(os.path.join(dirpath, f), TEST_ROOT)
                  for f in sorted(filenames) if f.endswith(".py")]
    return found


def parse(relpath: str) -> ast.Module:
    with open(os.path.join(TEST_ROOT, relpath), encoding="utf-8") as f:
        return ast.parse(f.read(), relpath)


def imported_test_modules(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) of each import of a module whose last name starts ``test_``,
    including ``importlib.import_module("test_...")`` / ``__import__`` with a literal."""
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__")):
            names = [node.args[0].value]
        found += [(node.lineno, name) for name in names
                  if name.rsplit(".", 1)[-1].startswith("test_")]
    return found


# How a docstring names the work that found a bug instead of what it pins: an
# audit, a survivor or mutant list, a numbered or dated round / session.
WORK_HISTORY = re.compile(
    r"\baudit|\bsurvivors?\b|\bmutants?\b|\bmutation (check|round|test|run)"
    r"|\bhostile list|\bsession \d|\b20\d\d-\d\d-\d\d\b"
    r"|\b(first|second|third|fourth|fifth|sixth|seventh|eighth|\d+(st|nd|rd|th)) "
    r"(mutation )?(round|audit|sweep)\b|\bround of work", re.IGNORECASE)


def history_in_docstrings(tree: ast.Module) -> list[tuple[str, str]]:
    """(owner, matched text) for each docstring of the module, its classes and functions
    that names the work which found a bug."""
    found = []
    owners = [tree] + [node for node in ast.walk(tree) if isinstance(
        node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in owners:
        doc = ast.get_docstring(node, clean=False) or ""
        found += [(getattr(node, "name", "<module>"), m.group(0))
                  for m in WORK_HISTORY.finditer(doc)]
    return found


class TestImportRule(unittest.TestCase):
    def test_no_file_of_the_test_tree_imports_a_test_module(self):
        files = tree_files()
        self.assertGreater(len(files), 50, "the walk found too few files: wrong root?")
        offenders = [f"{path}:{line}: imports {name}"
                     for path in files for line, name in imported_test_modules(parse(path))]
        self.assertEqual(offenders, [], "move the shared helper into a non-test_ helper module")

    def test_the_rule_sees_each_spelling_of_an_import(self):
        rows = (
            ("from test_a import helper", [(1, "test_a")]),
            ("import test_a", [(1, "test_a")]),
            ("import pkg.test_a as a", [(1, "pkg.test_a")]),
            ("from pkg.test_a import helper", [(1, "pkg.test_a")]),
            ("importlib.import_module('test_a')", [(1, "test_a")]),
            ("__import__('test_a')", [(1, "test_a")]),
            ("from a_helpers import test_case", []),
            ("import tests_util", []),
            ("from muon_test_compat import x", []),
        )
        for source, want in rows:
            with self.subTest(source=source):
                self.assertEqual(imported_test_modules(ast.parse(source)), want)


class TestDocstringRule(unittest.TestCase):
    def test_no_docstring_names_the_work_that_found_a_bug(self):
        offenders = [f"{path}: {owner}: {text!r}" for path in tree_files()
                     for owner, text in history_in_docstrings(parse(path))]
        self.assertEqual(offenders, [], "say what the test pins, not how its bug was found")

    def test_the_rule_tells_history_from_behaviour(self):
        rows = (
            ('"""Cases the fourth mutation audit found."""', [("<module>", "fourth mutation audit")]),
            ('"""Hostile list, session 32: x."""', [("<module>", "Hostile list"),
                                                  ("<module>", "session 3")]),
            ('def f():\n    """Survivor of round 2."""', [("f", "Survivor")]),
            ('class C:\n    """Mutation check: x."""', [("C", "Mutation check")]),
            ('"""Measured 2026-12-06."""', [("<module>", "2026-12-06")]),
            ('"""Found in the third round."""', [("<module>", "third round")]),
            ('"""A state_dict round trip keeps every value."""', []),
            ('"""Round 1: the watchdog dumps; round 2: SIGUSR1."""', []),
            ('"""rank_order must be a permutation."""', []),
            ("# an audit in a comment is no docstring\nx = 1", []),
        )
        for source, want in rows:
            with self.subTest(source=source):
                self.assertEqual(history_in_docstrings(ast.parse(source)), want)


if __name__ == "__main__":
    unittest.main()
