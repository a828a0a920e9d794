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
# paddle_muon_ext: compat-only  (walks this package's own layout; not exported)
"""The package's imports run one way (static: the sources are parsed, nothing is imported).

* No import cycle among the modules of ``python/paddle_muon_ext``, counting
  imports inside functions too (a lazy import that closes a circle is still a
  circle); only ``if TYPE_CHECKING:`` blocks are left out, they never run.
* The core (everything outside ``compat_paddle_3_3/``, ``tools/`` and
  ``cli.py``) never imports ``compat_paddle_3_3``: the compat layer depends
  on the core, so what the exporter ships is the program the tests run.
* No module is over :data:`MAX_MODULE_LINES` lines: a module holds
  one concern; develop's ``optimizer/muon.py`` mirrors develop and is exempt.
"""

from __future__ import annotations

import ast
import os
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SRC = os.path.join(REPO, "python")
PACKAGE = "paddle_muon_ext"
COMPAT = PACKAGE + ".compat_paddle_3_3"
# Outside the core: the 3.3.1 compat layer, the CLI tools and the entry point.
NOT_CORE = (COMPAT, PACKAGE + ".tools", PACKAGE + ".cli")
#: Issue 28's bar for one module.
#: The sharding core is at most 12 modules (issue 34), so a module holds one
#: concern whole (owners.py: every owner rule; runtime.py: the state, the
#: buffers' collectives and the step loop); past this a module mixes concerns.
MAX_MODULE_LINES = 1100
#: Mirrors develop's file line for line, so it keeps develop's size.
SIZE_EXEMPT = {PACKAGE + ".optimizer.muon"}
#: Modules allowed over the bar for now (empty: every module was split under it;
#: a new module never goes here).
SIZE_PENDING: set = set()


def package_modules(src: str = SRC, package: str = PACKAGE) -> dict[str, tuple[str, bool]]:
    """Dotted module name -> (file, is a package ``__init__``) of every module of ``package``."""
    modules = {}
    for folder, _, files in os.walk(os.path.join(src, package)):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, src)[:-3].split(os.sep)
            is_package = parts[-1] == "__init__"
            modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                skipped.update(id(n) for n in ast.walk(stmt))
    return skipped


def imported_modules(module: str, path: str, is_package: bool, known) -> dict[str, int]:
    """Package modules ``module`` imports -> line of the first such import.

    ``from pkg import name`` counts as importing ``pkg.name`` where that is a
    module, else ``pkg`` itself; relative imports are resolved.
    """
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    skipped = _type_checking_nodes(tree)
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                if node.module:
                    base.append(node.module)
                origin = ".".join(base)
            else:
                origin = node.module or ""
            subs = [f"{origin}.{a.name}" for a in node.names if f"{origin}.{a.name}" in known]
            targets = subs if len(subs) == len(node.names) else subs + [origin]
        for target in targets:
            # `import a.b.c` also runs a and a.b; a parent package is not a cycle
            # of its own, so only the named module counts.
            if target in known and target != module:
                found.setdefault(target, node.lineno)
    return found


def import_graph(src: str = SRC, package: str = PACKAGE) -> dict[str, dict[str, int]]:
    """Module -> {imported package module: line} for every module of ``package``."""
    modules = package_modules(src, package)
    return {m: imported_modules(m, path, is_pkg, modules) for m, (path, is_pkg) in modules.items()}


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def _is_core(module: str) -> bool:
    return not any(module == n or module.startswith(n + ".") for n in NOT_CORE)


class TestPackageImportGraph(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.graph = import_graph()

    def test_walk_sees_the_package(self):
        # Guards the walk itself: a wrong root or resolver would pass vacuously.
        mo = PACKAGE + ".distributed.fleet.meta_optimizers."
        self.assertIn(mo + "muon_sharding_optimizer", self.graph)
        self.assertIn(mo + "muon_sharding.build", self.graph[mo + "muon_sharding_optimizer"])
        self.assertIn(PACKAGE + ".distributed.fleet.meta_optimizers.muon_sharding.settings",
                      self.graph[COMPAT + ".strategy_options"])
        # `from ..utils.env_util import` (a sibling package) and `from . import x as y`
        self.assertIn(PACKAGE + ".distributed.fleet.utils.env_util",
                      self.graph[mo + "muon_flight.recorder"])
        self.assertIn(mo + "muon_checkpoint.common", self.graph[mo + "muon_checkpoint.save"])

    def test_no_import_cycle(self):
        cycles = import_cycles(self.graph)
        self.assertEqual(cycles, [], "modules importing each other (directly or "
                         "around a circle): " + "; ".join(" <-> ".join(c) for c in cycles))

    def test_core_never_imports_the_compat_layer(self):
        bad = [f"{m} (line {line}) imports {t}"
               for m, targets in sorted(self.graph.items()) if _is_core(m)
               for t, line in sorted(targets.items()) if not _is_core(t)]
        self.assertEqual(bad, [], "the core must not depend on compat_paddle_3_3 / tools / "
                         "cli (the compat layer fills the core's hooks instead)")


def module_lines(src: str = SRC, package: str = PACKAGE) -> dict[str, int]:
    """Dotted module name -> number of lines of its file."""
    lines = {}
    for module, (path, _) in package_modules(src, package).items():
        with open(path, encoding="utf-8") as f:
            lines[module] = sum(1 for _ in f)
    return lines


class TestModuleSize(unittest.TestCase):
    def test_no_module_over_the_bar(self):
        lines = module_lines()
        self.assertGreater(len(lines), 50, "the walk must see the package")
        over = sorted(f"{m} ({n} lines)" for m, n in lines.items()
                      if n > MAX_MODULE_LINES and m not in SIZE_EXEMPT | SIZE_PENDING)
        self.assertEqual(over, [], f"modules over {MAX_MODULE_LINES} lines: split them by "
                         "concern (one file per concern, a docstring saying which)")


class TestImportGraphWalker(unittest.TestCase):
    """The walker on a throw-away package: what counts as an edge and a cycle."""

    def _graph(self, files: dict[str, str]) -> dict:
        import tempfile

        with tempfile.TemporaryDirectory() as root:
            for rel, text in files.items():
                path = os.path.join(root, "pkg", rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text)
            return import_graph(root, "pkg")

    def test_lazy_relative_import_closes_a_cycle_type_checking_does_not(self):
        graph = self._graph({
            "__init__.py": "",
            "a.py": "from . import b\n",
            "b.py": "def f():\n    from .a import x\n",
            "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import y\n",
            "sub/__init__.py": "",
            "sub/d.py": "from ..c import z\nimport pkg.sub\n",
        })
        self.assertEqual(import_cycles(graph), [["pkg.a", "pkg.b"]])
        self.assertEqual(graph["pkg.c"], {})
        self.assertEqual(set(graph["pkg.sub.d"]), {"pkg.c", "pkg.sub"})


if __name__ == "__main__":
    unittest.main()
