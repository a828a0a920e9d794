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
"""Export paddle_muon_ext as a patch for a Paddle source tree.

Usage (a Paddle develop checkout in ~/Paddle)::

    python tools/export_upstream_patch.py --paddle-root ~/Paddle -o muon.patch
    cd ~/Paddle && git apply --check muon.patch && git am -3 muon.patch

Writes ``muon.patch`` (git format: a file the target lacks is added, a file it
has is a modification diff against the target's current text, read at export
time, with blob ids so ``git apply --3way`` works) and ``muon.NOTES.md`` beside
it (``--notes``).  Any unresolved conflict: exit 1, one ``CONFLICT: <file>:
<reason>`` line each, and no patch written.  Without ``--paddle-root`` the
target is the installed paddle package (``python/paddle/...`` only); Paddle's
registry files (proto, strategy docs, testslist.csv) are then not edited, the
notes list what a source checkout gets.

Rules, applied to every file of this repository in this order:

1. Path map (``PATH_MAP``; more with ``--map SRC=DST``):
   ``python/paddle_muon_ext/X`` -> ``python/paddle/X``; the mock harness
   ``test/mock/X`` -> ``test/collective/fleet/muon_mock/X`` and its self-tests
   ``test/mock/test_mock_X.py`` -> ``test/collective/fleet/test_muon_mock_X.py``
   (Paddle's runner finds tests of that directory through its
   ``testslist.csv``, and ``muon_mock`` does not shadow PyPI's ``mock``);
   ``test/X`` -> ``test/X``.  Other paths are not exported.
2. Dropped: ``DROPPED_PATHS``, ``DROPPED_PREFIXES`` (the 3.3.1 compat package,
   the installed tools package, tests of the tools), pytest's ``conftest.py``,
   files with ``# paddle_muon_ext: compat-only`` in their first 30 lines,
   binaries.
3. Text: ``# paddle_muon_ext: compat-begin`` ... ``compat-end`` blocks removed;
   ``paddle_muon_ext`` imports (and dotted names in strings) -> ``paddle``;
   harness imports ``mock.X`` -> ``muon_mock.X``.
4. Develop-owned (``UPSTREAM_OWNED``): files whose behaviour develop already
   has.  Exported only when the target lacks them, else left out untouched;
   then every exported file may use only names the target's version defines
   (``from paddle.optimizer.muon import X``, relative imports, ``muon.X``,
   ``mock.patch`` targets), else ``CONFLICT: <file>: imports X which
   develop's paddle/optimizer/muon.py does not define``; members read on its
   classes (``Muon._x``, inherited ones count where the target has the base)
   likewise (``uses Muon._x which ...``).
5. Develop's tests are kept: a test-tree file the target already has is
   exported beside it as ``<name>_extended.<ext>`` (``RENAMED_TEST_SUFFIX``);
   references to it in our test files follow the rename.
6. ``__init__.py`` of a package the target has is not touched; the imports /
   ``__all__`` names it lacks are listed in the notes.
7. Everything else is added, or, where the target has the file, a
   modification diff.  A modified module keeps every public top-level name,
   class method and class attribute of the target's version (else conflict;
   ``KEEP_EVERY_NAME`` modules keep private ones too -- develop's tests read
   them); imported names and members inherited from a class of the same
   module count as kept. The names kept are listed in the notes.
8. Registry edits (``--paddle-root`` only): each ``STRATEGY_OPTIONS`` entry
   (the package's option table, ``OPTION_TABLE_PATH``, less the options
   develop's proto has) becomes a field of its proto message in ``PROTO_PATH``
   (default = develop's behaviour, so nothing changes unless a user opts in) and a line in the
   ``hybrid_configs`` docs of ``STRATEGY_DOC_PATH``; every exported test module
   of ``TESTSLIST_DIRS`` gets a ``testslist.csv`` row (timeout and labels from
   this repository's ``CMakeLists.txt``: label ``DIST`` -> launcher
   ``dist_test.sh``, else ``test_runner.py``; ``GPU`` without ``CPU`` -> arch
   GPU); ``GLOB_TEST_DIRS`` register ``test_*.py`` themselves.

Tests only (``--tests-only``, needs ``--paddle-root``): the patch holds only
the test modules marked ``# paddle_muon_ext: upstream-tests`` (first 30 lines;
``UPSTREAM_TESTS_MARKER``), the test-tree files they import or name as
``*.py`` worker scripts (transitively), and their ``testslist.csv`` rows --
no product file, no proto or docs edit.  Every ``paddle`` module such a file
imports outside a ``try`` must exist in the target with the names taken
from it (else ``CONFLICT``); a marked file that rule 2 would drop is a
conflict too.  So the tests import develop's own code.  Both modes print the
patch's size: files, and lines added / removed per file.

Checks: exported Python must compile; leftover ``paddle_muon_ext`` or dropped
package references are warnings (``--strict``: exit 1); a test module without
unittest test methods (Paddle's runner would load 0 tests) is a warning
(``--require-unittest``: exit 1).

Verification: ``--verify-against-installed-paddle DIR`` mirrors the installed
paddle into DIR, applies the patch and imports the exported modules there;
``--verify-in-copy DIR`` copies ``--paddle-root`` into DIR and applies it there
instead.  ``--verify-pytest ARGS`` then runs pytest in DIR,
``--verify-unittest-load`` loads every exported test module with unittest and
``--verify-unittest-run`` runs them (expected failures pass), all with this
repository's package hidden.  Exit: 0 ok, 1 conflicts / verification failure, 2 usage or
export errors.
"""

from __future__ import annotations

import argparse
import ast
import csv
import dataclasses
import datetime
import difflib
import fnmatch
import hashlib
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import time
import tokenize

_PYTHON_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")
if _PYTHON_DIR not in sys.path:  # fallback when PYTHONPATH is unset
    sys.path.append(_PYTHON_DIR)
# the output-path rules of every tool (no paddle import)
from paddle_muon_ext.tools.limits import (  # noqa: E402
    STDOUT,
    InputError,
    check_writable,
    write_output,
)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import upstream_fixes  # noqa: E402  (--fixes: the UB-n fixes of develop's file)
import upstream_modes  # noqa: E402  (each mode's tree; the text Paddle receives)

# source prefix -> Paddle prefix (first match wins)
PATH_MAP = (
    ("python/paddle_muon_ext/", "python/paddle/"),
    ("test/mock/test_mock_", "test/collective/fleet/test_muon_mock_"),
    ("test/mock/", "test/collective/fleet/muon_mock/"),
    ("test/", "test/"),
)
# the harness package: imported as `mock` here, `muon_mock` in Paddle
HARNESS_RENAME = ("mock", "muon_mock")
DROPPED_PATHS = (
    "python/paddle_muon_ext/__init__.py",
    "python/paddle_muon_ext/cli.py",
)
DROPPED_PREFIXES = (
    "python/paddle_muon_ext/compat_paddle_3_3/",
    "python/paddle_muon_ext/tools/",
    "test/tools/",
)
DROPPED_BASENAMES = ("conftest.py",)  # pytest only; Paddle runs unittest
# Paddle modules of the dropped packages: exported code must not import them
DROPPED_MODULES = ("paddle.compat_paddle_3_3", "paddle.tools", "compat_paddle_3_3")
# Develop-owned files: exported only when the target lacks them.
UPSTREAM_OWNED = {
    "python/paddle/optimizer/muon.py":
        "develop's Muon; ours has the same interface and numbers "
        "(test/legacy_test/test_muon_optimizer.py), so develop's text stays",
}
RENAMED_TEST_SUFFIX = "_extended"
COMPAT_ONLY_MARKER = "# paddle_muon_ext: compat-only"
COMPAT_BEGIN = "# paddle_muon_ext: compat-begin"
COMPAT_END = "# paddle_muon_ext: compat-end"
MARKER_SCAN_LINES = 30
# --tests-only: the test modules that go upstream carry this line in their
# first MARKER_SCAN_LINES lines; the test-tree files they import (harness,
# helpers, worker scripts named by file) travel with them.
UPSTREAM_TESTS_MARKER = "# paddle_muon_ext: upstream-tests"

# Paddle's registries
PROTO_PATH = "paddle/fluid/framework/distributed_strategy.proto"
STRATEGY_DOC_PATH = "python/paddle/distributed/fleet/base/distributed_strategy.py"
TESTSLIST_NAME = "testslist.csv"
TESTSLIST_HEADER = ("name,os,arch,timeout,run_type,launcher,num_port,run_serial,"
                    "envs,conditions")
TESTSLIST_DIRS = ("test/collective/fleet",)
GLOB_TEST_DIRS = ("test/legacy_test",)
SINGLE_LAUNCHER = "test_runner.py"
DIST_LAUNCHER = "../../legacy_test/dist_test.sh"
TEST_ENVS = "http_proxy=;https_proxy=;PYTHONPATH=../.."
# this repository's ctest registration: the source of test timeouts/labels
TEST_REGISTRY = "CMakeLists.txt"
DEFAULT_TEST_TIMEOUT = 120


@dataclasses.dataclass(frozen=True)
class StrategyOption:
    """An option this package adds to Paddle's DistributedStrategy.

    Attributes:
        message: proto message that gets the field.
        config_key: where users set it, e.g. hybrid_configs["sharding_configs"].
        name: field name.
        proto_type: proto scalar type.
        default: proto default literal: develop's behaviour.
        doc: one-line description for distributed_strategy.py.
    """

    message: str
    config_key: str
    name: str
    proto_type: str
    default: str
    doc: str


# The package's option table (name, default, choices, proto message/type,
# doc): the one place options are defined. Loaded by path: the exporter runs
# before (and without) an importable package.
OPTION_TABLE_PATH = ("python/paddle_muon_ext/distributed/fleet/meta_optimizers/"
                     "muon_sharding/settings.py")


def _load_option_table():
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        OPTION_TABLE_PATH)
    spec = importlib.util.spec_from_file_location("_muon_sharding_option_table", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


_OPTION_TABLE = _load_option_table()
# Only the options develop's proto lacks become new fields.
STRATEGY_OPTIONS = tuple(
    StrategyOption(o.message, o.config_key, o.name, o.proto_type, json.dumps(o.default),
                   "%s Default %s." % (o.doc, json.dumps(o.default)))
    for o in _OPTION_TABLE.SHARDING_OPTIONS if not o.in_develop
)
# Modules whose every develop name (private ones and class attributes too:
# develop's tests read them) the export must keep.
KEEP_EVERY_NAME = frozenset({
    "python/paddle/distributed/fleet/meta_optimizers/muon_sharding_optimizer.py",
})
_PY_TYPE = {"string": "str", "bool": "bool", "int32": "int", "int64": "int",
            "float": "float", "double": "float"}

_IMPORT_RULES = (
    # from paddle_muon_ext import x  ->  from paddle import x
    (re.compile(r"(?<![\w.])(from\s+)paddle_muon_ext(\s+import\b)"), r"\1paddle\2"),
    # import paddle_muon_ext [as y]  ->  import paddle [as y]
    (re.compile(r"(?<![\w.])(import\s+)paddle_muon_ext(?![\w.])"), r"\1paddle"),
    # paddle_muon_ext.a.b (imports, attribute access, dotted strings)
    (re.compile(r"(?<![\w.])paddle_muon_ext(?=\.[A-Za-z_])"), "paddle"),
)
_HARNESS_RULES = (
    # from mock.x import y / from mock import x  (never `from unittest import mock`)
    re.compile(r"(?m)^(\s*from\s+)%s(?=\.\w|\s+import\b)" % HARNESS_RENAME[0]),
    # import mock.x
    re.compile(r"(?m)^(\s*import\s+)%s(?=\.\w)" % HARNESS_RENAME[0]),
)
_LEFTOVER_RE = re.compile(r"(?<![\w/])paddle_muon_ext(?![\w/:])")
_MODULE_NAME_RE = re.compile(r"^paddle_muon_ext(\.[A-Za-z_]\w*)*$")


class ExportError(Exception):
    pass


# ------------------------------------------------------------ text helpers
def rewrite_imports(text: str) -> str:
    for pattern, repl in _IMPORT_RULES:
        text = pattern.sub(repl, text)
    return text


def rewrite_harness_imports(text: str) -> str:
    for pattern in _HARNESS_RULES:
        text = pattern.sub(r"\g<1>" + HARNESS_RENAME[1], text)
    return text


def strip_compat_blocks(text: str, path: str = "<text>") -> str:
    out = []
    begin_line = None
    for no, line in enumerate(text.splitlines(keepends=True), 1):
        stripped = line.strip()
        if stripped.startswith(COMPAT_BEGIN):
            if begin_line is not None:
                raise ExportError("%s:%d: nested %r (open at line %d)"
                                  % (path, no, COMPAT_BEGIN, begin_line))
            begin_line = no
            continue
        if stripped.startswith(COMPAT_END):
            if begin_line is None:
                raise ExportError("%s:%d: %r without %r"
                                  % (path, no, COMPAT_END, COMPAT_BEGIN))
            begin_line = None
            continue
        if begin_line is None:
            out.append(line)
    if begin_line is not None:
        raise ExportError("%s:%d: unterminated %r" % (path, begin_line, COMPAT_BEGIN))
    return "".join(out)


def leftover_reference_lines(text: str) -> set:
    """Line numbers where exported Python code still names paddle_muon_ext.

    Code only: the bare name and string literals that are exactly a
    ``paddle_muon_ext[.x]`` module name.  Comments and prose are not
    references.  Falls back to a line scan when the text does not tokenize.
    """
    lines = set()
    try:
        prev = None
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.NAME and tok.string == "paddle_muon_ext":
                if not (prev is not None and prev.type == tokenize.OP
                        and prev.string == "."):
                    lines.add(tok.start[0])
            elif tok.type == tokenize.STRING and "paddle_muon_ext" in tok.string:
                try:
                    value = ast.literal_eval(tok.string)
                except (ValueError, SyntaxError):
                    value = None
                if isinstance(value, str) and _MODULE_NAME_RE.match(value.strip()):
                    lines.add(tok.start[0])
            if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
                prev = tok
    except (tokenize.TokenError, IndentationError, SyntaxError):
        for no, line in enumerate(text.splitlines(), 1):
            if _LEFTOVER_RE.search(line) and not line.lstrip().startswith("#"):
                lines.add(no)
    return lines


def dropped_module_lines(text: str) -> list:
    """(line, module) for imports of a dropped package in exported code."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if any(name == m or name.startswith(m + ".") for m in DROPPED_MODULES):
                found.append((node.lineno, name))
    return found


def is_compat_only(text: str) -> bool:
    head = text.splitlines()[:MARKER_SCAN_LINES]
    return any(COMPAT_ONLY_MARKER in line for line in head)


def is_upstream_test(text: str) -> bool:
    """Whether a file carries :data:`UPSTREAM_TESTS_MARKER` near its top."""
    head = text.splitlines()[:MARKER_SCAN_LINES]
    return any(line.strip() == UPSTREAM_TESTS_MARKER for line in head)


def _import_targets(text: str, dst: str) -> tuple:
    """What a file at ``dst`` imports: (absolute dotted modules, paths its
    relative imports may name, string literals naming ``*.py`` files)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return [], [], []
    modules, relative, scripts = [], [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules.append(node.module)
            modules.extend("%s.%s" % (node.module, a.name) for a in node.names
                           if a.name != "*")
        elif isinstance(node, ast.ImportFrom):  # from . import x / from .m import y
            base = os.path.dirname(dst)
            for _ in range(node.level - 1):
                base = os.path.dirname(base)
            stem = base + ("/" + node.module.replace(".", "/") if node.module else "")
            relative += [base + "/__init__.py", stem + ".py", stem + "/__init__.py"]
            for a in node.names:
                relative += [stem + "/" + a.name + ".py", stem + "/" + a.name + "/__init__.py"]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.endswith(".py") and "\n" not in node.value:
            scripts.append(os.path.basename(node.value))
    return modules, relative, scripts


def select_upstream_tests(candidates) -> tuple:
    """The tests-only selection: marked files plus the test-tree files they need.

    Args:
        candidates: ``(src, dst, text)`` of every exportable file.

    Returns:
        (selected candidates in input order, [(src, reason)] of the test-tree
        files left out).  A marked file pulls in, transitively, the test-tree
        modules it imports (looked up from its own directory and from
        :data:`IN_TREE_PYTHONPATH`'s test directories, packages with their
        ``__init__.py``; relative imports from the importing file's package)
        and the ``*.py`` files of its directory it names in a string (worker
        scripts a launcher starts).
    """
    by_dst = {c[1]: c for c in candidates if c[1].startswith("test/")}
    roots = [d for d in IN_TREE_PYTHONPATH if d.startswith("test")]

    def resolve(dst, module):
        found = []
        parts = module.split(".")
        for base in [os.path.dirname(dst)] + roots:
            for i in range(1, len(parts) + 1):
                stem = "/".join([base] + parts[:i])
                for path in (stem + ".py", stem + "/__init__.py"):
                    if path in by_dst:
                        found.append(path)
        return found

    todo = [c[1] for c in candidates if c[1] in by_dst and is_upstream_test(c[2])]
    chosen = set()
    while todo:
        dst = todo.pop()
        if dst in chosen:
            continue
        chosen.add(dst)
        modules, relative, scripts = _import_targets(by_dst[dst][2], dst) \
            if dst.endswith(".py") else ([], [], [])
        for module in modules:
            todo.extend(resolve(dst, module))
        todo.extend(path for path in relative if path in by_dst)
        folder = os.path.dirname(dst)
        todo.extend(folder + "/" + name for name in scripts
                    if folder + "/" + name in by_dst)
    selected = [c for c in candidates if c[1] in chosen]
    left = [(c[0], "not an upstream test (no `%s` line) nor a file one imports"
             % UPSTREAM_TESTS_MARKER) for c in candidates if c[1] not in chosen]
    return selected, left


def map_path(src: str, extra_map=()) -> str | None:
    for s, d in tuple(extra_map) + PATH_MAP:
        if src.startswith(s):
            return d + src[len(s):]
    return None


def renamed_test_path(dst: str) -> str:
    stem, ext = os.path.splitext(dst)
    return stem + RENAMED_TEST_SUFFIX + ext


def init_exports(text: str) -> tuple:
    """Top-level import statements and __all__ names of an __init__.py."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return [], []
    imports, names = [], []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append(ast.get_source_segment(text, node))
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                try:
                    names.extend(ast.literal_eval(node.value))
                except ValueError:
                    pass
    return imports, names


def imported_names(text: str) -> set:
    """Names bound by top-level imports of a module."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return set()
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _assigned_names(node) -> list:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return [t.id for t in targets if isinstance(t, ast.Name)]


def _class_members(node: ast.ClassDef) -> set:
    members = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            members.add(item.name)
        elif isinstance(item, (ast.Assign, ast.AnnAssign)):
            members.update(_assigned_names(item))
    return members


def module_surface(text: str) -> set:
    """Top-level names and ``Class.member`` names (methods and class
    attributes) a module defines (not imports)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return set()
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            names.update("%s.%s" % (node.name, m) for m in _class_members(node))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            names.update(_assigned_names(node))
    return names


def module_namespace(text: str, target=None) -> set:
    """What a module offers under each name: :func:`module_surface`, names
    its top-level imports bind, and members classes inherit from classes of
    the same module (with ``target``, also from bases imported from a module
    ``target`` holds: :func:`class_member_names`)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return set()
    names = module_surface(text) | imported_names(text)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}

    def members(name, seen):
        node = classes.get(name)
        if node is None or name in seen:
            return set()
        seen.add(name)
        out = set(_class_members(node))
        for base in node.bases:
            if isinstance(base, ast.Name):
                out |= members(base.id, seen)
        return out

    for name in classes:
        names.update("%s.%s" % (name, m) for m in members(name, set()))
        inherited = class_member_names(text, name, target) if target is not None else None
        names.update("%s.%s" % (name, m) for m in inherited or ())
    return names


class _Overlay:
    """The target as the patch leaves it: the exported files over the tree."""

    def __init__(self, target, files: dict) -> None:
        self._target, self._files = target, files

    def read(self, rel: str) -> str | None:
        return self._files[rel] if rel in self._files else self._target.read(rel)


def _is_public(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return not last.startswith("_") or (last.startswith("__") and last.endswith("__"))


def unittest_method_count(text: str) -> int:
    """test* methods of classes with a base (what unittest's loader can find)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return 0
    return sum(1 for node in tree.body if isinstance(node, ast.ClassDef) and node.bases
               for item in node.body
               if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
               and item.name.startswith("test"))


# ------------------------------------------------------------- file list
def list_source_files(repo_root: str, include_untracked: bool = False) -> list:
    def ls(*extra):
        proc = subprocess.run(["git", "-C", repo_root, "ls-files", "-z", *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if proc.returncode:
            raise ExportError("git ls-files failed in %s: %s"
                              % (repo_root, proc.stderr.decode().strip()))
        return [p.decode() for p in proc.stdout.split(b"\0") if p]

    files = set(ls())
    if include_untracked:
        files.update(ls("--others", "--exclude-standard"))
    return sorted(f for f in files if os.path.isfile(os.path.join(repo_root, f)))


class PaddleTree:
    """The export target: a Paddle source checkout, or the installed package."""

    def __init__(self, paddle_root: str | None = None):
        self.paddle_root = os.path.abspath(paddle_root) if paddle_root else None
        self.pkg_dir = None
        if paddle_root is None:
            spec = importlib.util.find_spec("paddle")  # does not import paddle
            if spec is not None and spec.origin:
                self.pkg_dir = os.path.dirname(spec.origin)

    @property
    def is_checkout(self) -> bool:
        return self.paddle_root is not None

    def _local(self, rel: str) -> str | None:
        if self.paddle_root:
            return os.path.join(self.paddle_root, rel)
        if self.pkg_dir and (rel == "python/paddle" or rel.startswith("python/paddle/")):
            return os.path.join(self.pkg_dir, rel[len("python/paddle"):].lstrip("/"))
        return None

    def exists(self, rel: str) -> bool:
        path = self._local(rel)
        return path is not None and os.path.exists(path)

    def read(self, rel: str) -> str | None:
        """The target's text of rel, None when it has no such file."""
        path = self._local(rel)
        if path is None or not os.path.isfile(path):
            return None
        with open(path, "rb") as f:
            return f.read().decode("utf-8")

    def mode(self, rel: str) -> str:
        path = self._local(rel)
        if path and os.path.isfile(path) and os.stat(path).st_mode & stat.S_IXUSR:
            return "100755"
        return "100644"

    def describe(self) -> str:
        if self.paddle_root:
            return "Paddle checkout"
        return "installed paddle package"


# ------------------------------------------------------ test registration
@dataclasses.dataclass
class TestMeta:
    timeout: int = DEFAULT_TEST_TIMEOUT
    labels: frozenset = frozenset()
    registered: bool = False


def read_test_registry(repo_root: str) -> dict:
    """{source path or directory: TestMeta} from ``muon_py_test(...)`` calls."""
    path = os.path.join(repo_root, TEST_REGISTRY)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        text = f.read()
    registry = {}
    for body in re.findall(r"^\s*muon_py_test\(([^)]*)\)", text, re.M | re.S):
        tokens = shlex.split(body, comments=True)
        fields, key = {}, None
        for tok in tokens[1:]:
            if tok in ("FILES", "TIMEOUT", "LABELS", "ENVS"):
                key = tok
                fields.setdefault(key, [])
            elif key:
                fields[key].extend(t for t in tok.split(";") if t)
        timeout = int(fields.get("TIMEOUT", [DEFAULT_TEST_TIMEOUT])[0])
        labels = frozenset(fields.get("LABELS", ()))
        for item in fields.get("FILES", ()):
            src = item.split("::", 1)[0].rstrip("/")
            old = registry.get(src)
            if old:
                timeout, labels = max(timeout, old.timeout), labels | old.labels
            registry[src] = TestMeta(timeout, labels, True)
    return registry


def test_meta(registry: dict, src: str) -> TestMeta:
    if src in registry:
        return registry[src]
    for key, meta in registry.items():
        if src.startswith(key + "/"):
            return meta
    return TestMeta()


def testslist_row(name: str, meta: TestMeta) -> list:
    dist = "DIST" in meta.labels
    gpu_only = "GPU" in meta.labels and "CPU" not in meta.labels
    conditions = "WITH_NCCL" if gpu_only else ("WITH_GLOO" if dist else "")
    return [name, "", "GPU" if gpu_only else "", str(meta.timeout),
            "DIST" if dist else "", DIST_LAUNCHER if dist else SINGLE_LAUNCHER,
            "2" if dist else "", "1" if dist else "", TEST_ENVS, conditions]


def render_rows(rows: list) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    return buf.getvalue()


# ----------------------------------------------------------- registry edits
class EditConflict(Exception):
    """A registry file of the target cannot take the edit."""


def _matching_brace(text: str, open_idx: int) -> int:
    depth, i, n = 0, open_idx, len(text)
    while i < n:
        if text.startswith("//", i):
            i = text.find("\n", i)
            i = n if i < 0 else i
            continue
        if text.startswith("/*", i):
            i = text.find("*/", i)
            i = n if i < 0 else i + 2
            continue
        ch = text[i]
        if ch == '"':
            i = text.find('"', i + 1)
            i = n if i < 0 else i
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise EditConflict("unbalanced braces")


def _top_level_body(body: str) -> str:
    """The message body without nested messages/enums (depth-1 text only)."""
    out, depth = [], 0
    for ch in body:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


# proto2 field numbers: 1 .. 2**29 - 1; 19000-19999 belong to protobuf itself
PROTO_MAX_FIELD = 2**29 - 1
PROTO_IMPL_RANGE = (19000, 19999)


def used_field_ranges(body: str) -> list:
    """Inclusive ``(lo, hi)`` number ranges a message body already takes.

    Args:
        body: the message's top-level text, comments removed.

    Returns:
        list: one range per field number, per ``reserved``/``extensions``
        item (``N``, ``N to M``, ``N to max``), and protobuf's own range.
    """
    ranges = [(int(n), int(n)) for n in re.findall(r"=\s*(\d+)\s*[;\[]", body)]
    for stmt in re.findall(r"\b(?:reserved|extensions)\b([^;]*);", body):
        stmt = re.sub(r'"[^"]*"|\'[^\']*\'', "", stmt)  # reserved field names
        for lo, hi in re.findall(r"(\d+)(?:\s+to\s+(\d+|max))?", stmt):
            top = PROTO_MAX_FIELD if hi == "max" else int(hi or lo)
            ranges.append((int(lo), top))
    return ranges + [PROTO_IMPL_RANGE]


def next_field_number(body: str, message: str = "message") -> int:
    """The number a new field of the message gets.

    One past the highest number in use, skipping reserved ranges; where that
    runs into a ``reserved N to max`` (nothing free above), the highest free
    number below it -- protoc refuses a field inside a reserved range.

    Raises:
        EditConflict: the message has no free number left.
    """
    ranges = used_field_ranges(body)

    def taken(n):
        return any(lo <= n <= hi for lo, hi in ranges)

    finite = [hi for lo, hi in ranges if hi != PROTO_MAX_FIELD and (lo, hi) != PROTO_IMPL_RANGE]
    number = max(finite, default=0) + 1
    while number <= PROTO_MAX_FIELD and taken(number):
        number = max(hi for lo, hi in ranges if lo <= number <= hi) + 1
    if number <= PROTO_MAX_FIELD:
        return number
    # open-ended reservation above: the highest free number below it
    below = min(lo for lo, hi in ranges if hi == PROTO_MAX_FIELD)
    for number in range(below - 1, 0, -1):
        if not taken(number):
            return number
    raise EditConflict("message %s has no free field number (every number below "
                       "its `reserved %d to max` is taken)" % (message, below))


def add_proto_fields(text: str, options) -> tuple:
    """Insert the option fields into their proto messages.

    Returns:
        (new text, [field names added], [field names already there]).
    """
    added, present = [], []
    for opt in options:
        m = re.search(r"(?m)^[ \t]*message[ \t]+%s[ \t]*\{" % re.escape(opt.message), text)
        if not m:
            raise EditConflict("no `message %s {` to add field %s to"
                               % (opt.message, opt.name))
        open_idx = m.end() - 1
        close_idx = _matching_brace(text, open_idx)
        body = _top_level_body(re.sub(r"//[^\n]*|/\*.*?\*/", "", text[open_idx + 1:close_idx],
                                      flags=re.S))
        existing = re.search(r"\b%s\s*=\s*\d+\s*(\[[^\]]*\])?" % re.escape(opt.name), body)
        if existing:
            default = re.search(r"default\s*=\s*([^\],]+)", existing.group(1) or "")
            if (default.group(1).strip() if default else None) != opt.default:
                raise EditConflict("%s.%s exists with default %s, the export needs %s"
                                   % (opt.message, opt.name,
                                      default.group(1).strip() if default else "(none)",
                                      opt.default))
            present.append(opt.name)
            continue
        number = next_field_number(body, opt.message)
        line_start = text.rfind("\n", 0, close_idx) + 1
        if text[line_start:close_idx].strip():
            raise EditConflict("closing brace of message %s is not on its own line"
                               % opt.message)
        indent = re.search(r"(?m)^([ \t]+)\S", text[open_idx + 1:close_idx])
        indent = indent.group(1) if indent else "  "
        line = "%soptional %s %s = %d [ default = %s ];\n" % (
            indent, opt.proto_type, opt.name, number, opt.default)
        text = text[:line_start] + line + text[line_start:]
        added.append(opt.name)
    return text, added, present


def add_strategy_docs(text: str, options) -> tuple:
    """Document the options in DistributedStrategy.hybrid_configs' docstring.

    Returns:
        (new text, [option names documented now]).
    """
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        raise EditConflict("does not parse: %s" % exc)
    prop = None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "DistributedStrategy":
            for item in node.body:
                if (isinstance(item, ast.FunctionDef) and item.name == "hybrid_configs"
                        and any(isinstance(d, ast.Name) and d.id == "property"
                                for d in item.decorator_list)):
                    prop = item
                    break
    if prop is None:
        raise EditConflict("no DistributedStrategy.hybrid_configs property")
    doc = prop.body[0] if prop.body else None
    if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)):
        raise EditConflict("DistributedStrategy.hybrid_configs has no docstring")
    lines = text.splitlines(keepends=True)
    first, last = doc.lineno - 1, doc.end_lineno - 1
    todo = [o for o in options if o.name not in doc.value.value]
    if not todo:
        return text, []
    anchor = next((i for i in range(first + 1, last + 1)
                   if lines[i].strip() == "Examples:"), None)
    if anchor is None:
        if lines[last].strip() not in ('"""', "'''"):
            raise EditConflict("hybrid_configs docstring has neither an `Examples:` "
                               "line nor closing quotes on their own line")
        anchor = last
    insert_at = anchor
    while insert_at - 1 > first and not lines[insert_at - 1].strip():
        insert_at -= 1
    items = [l for l in lines[first:insert_at] if l.lstrip().startswith("**")]
    ref = items[-1] if items else lines[anchor]
    indent = ref[: len(ref) - len(ref.lstrip())]
    new = ["%s**%s.%s(%s)**: %s\n" % (indent, o.config_key, o.name,
                                       _PY_TYPE.get(o.proto_type, o.proto_type), o.doc)
           for o in todo]
    return "".join(lines[:insert_at] + new + lines[insert_at:]), [o.name for o in todo]


def add_testslist_rows(text: str, rows: list) -> tuple:
    """Append rows whose name is not listed yet.

    Returns:
        (new text, [names added], [names already listed]).
    """
    lines = text.splitlines()
    if not lines or lines[0].strip() != TESTSLIST_HEADER:
        raise EditConflict("header is %r, expected %r"
                           % (lines[0] if lines else "", TESTSLIST_HEADER))
    listed = {l.split(",", 1)[0].strip() for l in lines[1:] if l.strip()}
    new_rows = [r for r in rows if r[0] not in listed]
    present = [r[0] for r in rows if r[0] in listed]
    if not new_rows:
        return text, [], present
    if text and not text.endswith("\n"):
        text += "\n"
    return text + render_rows(new_rows), [r[0] for r in new_rows], present


# ----------------------------------------------------------------- export
@dataclasses.dataclass
class Change:
    dst: str
    new: str
    old: str | None = None  # target's text; None = new file
    src: str | None = None
    mode: str = "100644"


@dataclasses.dataclass
class Export:
    changes: dict = dataclasses.field(default_factory=dict)   # dst -> Change
    dropped: list = dataclasses.field(default_factory=list)   # (src, reason)
    left_out: list = dataclasses.field(default_factory=list)  # (dst, reason)
    renamed: dict = dataclasses.field(default_factory=dict)   # develop dst -> ours
    unchanged: list = dataclasses.field(default_factory=list)  # target has our text
    kept_names: dict = dataclasses.field(default_factory=dict)  # dst -> [names]
    init_notes: list = dataclasses.field(default_factory=list)  # (dst, imports, names)
    options: list = dataclasses.field(default_factory=list)   # (option, state)
    test_rows: list = dataclasses.field(default_factory=list)  # testslist rows
    rows_present: list = dataclasses.field(default_factory=list)
    glob_tests: list = dataclasses.field(default_factory=list)
    zero_test_modules: list = dataclasses.field(default_factory=list)
    unregistered: list = dataclasses.field(default_factory=list)  # no TEST_REGISTRY entry
    warnings: list = dataclasses.field(default_factory=list)
    conflicts: list = dataclasses.field(default_factory=list)  # (file, reason)
    target: str = ""
    tests_only: bool = False
    not_selected: int = 0  # tests-only: exportable files outside the selection

    def test_modules(self) -> list:
        return sorted(d for d in self.changes if _is_test_module(d))


def _is_test_module(dst: str) -> bool:
    base = os.path.basename(dst)
    return dst.startswith("test/") and base.startswith("test_") and base.endswith(".py")


def _candidates(repo_root, files, include, exclude, extra_map, ex):
    """(src, dst, text) of every exported file, rules 1-3 applied."""
    out = []
    for src in files:
        dst = map_path(src, extra_map)
        if dst is None:
            continue
        if include and not any(fnmatch.fnmatchcase(src, g) for g in include):
            continue
        if any(fnmatch.fnmatchcase(src, g) for g in exclude):
            ex.dropped.append((src, "--exclude"))
            continue
        if "__pycache__/" in src or src.endswith((".pyc", ".pyo")):
            continue
        if src in DROPPED_PATHS:
            ex.dropped.append((src, "no Paddle counterpart (DROPPED_PATHS)"))
            continue
        if src.startswith(DROPPED_PREFIXES):
            ex.dropped.append((src, "compat / tools package (DROPPED_PREFIXES)"))
            continue
        if os.path.basename(src) in DROPPED_BASENAMES:
            ex.dropped.append((src, "pytest-only (Paddle runs unittest)"))
            continue
        with open(os.path.join(repo_root, src), "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if text is None or "\0" in text:
            ex.dropped.append((src, "binary"))
            continue
        if is_compat_only(text):
            ex.dropped.append((src, "compat-only marker"))
            continue
        text = strip_compat_blocks(text, src)
        if src.endswith(".py"):
            text = rewrite_imports(text)
        if dst.startswith("test/") and src.endswith((".py", ".md")):
            text = rewrite_harness_imports(text)
        out.append((src, dst, text))
    return out


def _drop_tool_tests(candidates, ex):
    """Drop test-tree modules that import a dropped package, then helpers only they used.

    Tests of this package's tools (e.g. the cluster emulator) do not travel:
    the tools stay here.
    """
    keep = []
    for cand in candidates:
        src, dst, text = cand
        found = dropped_module_lines(text) if dst.startswith("test/") and \
            dst.endswith(".py") else []
        if found:
            ex.dropped.append((src, "test of a tool that is not exported (imports %s)"
                               % found[0][1]))
        else:
            keep.append(cand)
    dropped_any = len(keep) != len(candidates)
    while dropped_any:
        dropped_any = False
        for cand in list(keep):
            src, dst, _ = cand
            name = os.path.basename(dst)[:-3]
            if not (dst.endswith(".py") and not name.startswith(("test_", "__"))
                    and os.path.dirname(dst) in TESTSLIST_DIRS + GLOB_TEST_DIRS + ("test",)):
                continue
            used = re.compile(r"\b%s\b" % re.escape(name))
            if not any(used.search(t) for s2, d2, t in keep if d2 != dst):
                keep.remove(cand)
                ex.dropped.append((src, "helper used only by tests that are not exported"))
                dropped_any = True
    return keep


# ------------------------------------------- names of develop-owned modules
def _dotted(node) -> str | None:
    """``a.b.c`` of a Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _absolute_module(dst: str, node: ast.ImportFrom) -> str | None:
    """The module an ImportFrom names, relative ones resolved for python/ files."""
    if not node.level:
        return node.module
    if not dst.startswith("python/"):
        return None
    package = os.path.dirname(dst[len("python/"):]).split("/")
    if node.level - 1 >= len(package):
        return None
    base = package[:len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def module_names_used(text: str, dst: str, module: str) -> list:
    """(line, name) for each name of ``module`` the exported file relies on.

    ``from module import X`` (relative too), ``alias.X`` where alias is the
    module (``from pkg import mod [as alias]``, ``import module as alias``,
    or the full dotted ``module.X``), ``getattr``/``setattr``/
    ``mock.patch.object(alias, "X")`` and ``"module.X[...]"`` strings
    (``mock.patch`` targets).  A member read from such a name the same ways
    (``X.m``, ``alias.X.m``, ``mock.patch.object(X, "m")``,
    ``"module.X.m"``) is reported as ``"X.m"``.  Dunder names are not
    reported.
    """
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    parent, leaf = module.rpartition(".")[::2]
    aliases, names_of, used = set(), {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _absolute_module(dst, node)
            for a in node.names:
                if source == module and a.name != "*":
                    used.append((node.lineno, a.name))
                    names_of[a.asname or a.name] = a.name
                elif source == parent and a.name == leaf:
                    aliases.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            aliases.update(a.asname for a in node.names if a.name == module and a.asname)

    def is_module(node):
        return _dotted(node) == module or (isinstance(node, ast.Name)
                                           and node.id in aliases)

    def name_of(node):
        """The module-level name ``node`` refers to, else None."""
        if isinstance(node, ast.Name) and node.id in names_of:
            return names_of[node.id]
        if isinstance(node, ast.Attribute) and is_module(node.value):
            return node.attr
        return None

    string_re = re.compile(r"^%s\.([A-Za-z_]\w*)(?:\.(\w+))?(\.\w+)*$" % re.escape(module))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if is_module(node.value):
                used.append((node.lineno, node.attr))
            elif name_of(node.value):
                used.append((node.lineno, "%s.%s" % (name_of(node.value), node.attr)))
        elif isinstance(node, ast.Call) and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) \
                and (_dotted(node.func) in ("getattr", "setattr")
                     or (isinstance(node.func, ast.Attribute)
                         and node.func.attr == "object")):
            if is_module(node.args[0]):
                used.append((node.lineno, node.args[1].value))
            elif name_of(node.args[0]):
                used.append((node.lineno, "%s.%s" % (name_of(node.args[0]),
                                                     node.args[1].value)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = string_re.match(node.value)
            if m:
                used.append((node.lineno, m.group(1)))
                if m.group(2):
                    used.append((node.lineno, "%s.%s" % m.group(1, 2)))
    return sorted((no, name) for no, name in set(used)
                  if not (name.rsplit(".", 1)[-1].startswith("__")
                          and name.endswith("__")))


def _module_file(target, module: str) -> str | None:
    """The target's text of a dotted module (``python/`` tree), None if absent."""
    rel = "python/" + module.replace(".", "/")
    return target.read(rel + ".py") or target.read(rel + "/__init__.py")


def class_member_names(text: str, cls: str, target=None, _seen=None) -> set | None:
    """Members of class ``cls`` of a module, inherited ones included.

    Bases defined in the same module, or imported (``from m import Base``)
    from a module the target has, are followed; ``object`` adds nothing.
    None when ``cls`` is not a class of the module or a base cannot be
    followed (its members are then unknown).
    """
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    if cls not in classes:
        return None
    seen = _seen if _seen is not None else set()
    if (id(text), cls) in seen:
        return set()
    seen.add((id(text), cls))
    imported = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                imported[a.asname or a.name] = (node.module, a.name)
    members = set(_class_members(classes[cls]))
    for base in classes[cls].bases:
        if isinstance(base, ast.Name) and base.id == "object":
            continue
        if isinstance(base, ast.Name) and base.id in classes:
            inherited = class_member_names(text, base.id, target, seen)
        elif isinstance(base, ast.Name) and base.id in imported and target is not None:
            base_module, base_name = imported[base.id]
            base_text = _module_file(target, base_module)
            inherited = None if base_text is None else class_member_names(
                base_text, base_name, target, seen)
        else:
            inherited = None
        if inherited is None:
            return None
        members |= inherited
    return members


def module_defined_names(text: str) -> set:
    """Every name a module binds at top level, inside if/try/with blocks too."""
    names = module_namespace(text)
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return names
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            for field in ("body", "orelse", "finalbody"):
                todo.extend(getattr(node, field, []))
            for handler in getattr(node, "handlers", []):
                todo.extend(handler.body)
    return names


def _check_owned_module_names(ex, candidates, target) -> None:
    """Exported files may use only names a develop-owned module the target
    keeps (left out of the patch) defines; any other is a conflict.  So are
    members of its classes read on the class (``Muon._x``), where the
    class's bases can be followed in the target."""
    for owned in sorted(UPSTREAM_OWNED):
        text = target.read(owned) if owned.endswith(".py") else None
        if text is None:
            continue
        module = owned[len("python/"):-len(".py")].replace("/", ".")
        defined = module_defined_names(text)
        for _src, dst, body in candidates:
            if not dst.endswith(".py"):
                continue
            missing, members = [], {}
            for _no, name in module_names_used(body, dst, module):
                top, _, member = name.partition(".")
                if member and top in defined:
                    if top not in members:
                        members[top] = class_member_names(text, top, target)
                    if members[top] is None or member in members[top]:
                        continue
                elif member or name in defined:
                    continue
                if name not in missing:
                    missing.append(name)
            for name in missing:
                ex.conflicts.append((dst, "%s %s which develop's %s does not define"
                                     % ("uses" if "." in name else "imports", name,
                                        owned[len("python/"):])))


def _guarded_import_lines(tree) -> set:
    """Lines of imports inside ``try`` bodies (optional imports)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and node.handlers:
            for stmt in node.body:
                lines.update(n.lineno for n in ast.walk(stmt)
                             if isinstance(n, (ast.Import, ast.ImportFrom)))
    return lines


def _check_target_imports(ex, candidates, target) -> None:
    """Tests-only: every ``paddle`` module an exported file imports must be in
    the target, with the names it takes from it (the patch adds no product
    file to supply them).  Imports inside ``try`` are optional and skipped.

    A module counts as missing only where the target holds one of its
    packages (that package's ``__init__.py``) but not the next level below it
    (neither ``<name>.py`` nor ``<name>/``): a sparse tree (develop's optimizer
    and the test registries only) judges just the packages it has."""
    cache = {}

    def module_text(module):
        if module not in cache:
            cache[module] = _module_file(target, module)
        return cache[module]

    def is_missing(module):
        # Walk down from the top package: the first level whose package the
        # tree holds (an __init__.py) but whose child it lacks is missing, so
        # a whole missing subpackage (a.b.pkg.mod with no pkg/) is caught too.
        parts = module.split(".")
        for depth in range(1, len(parts)):
            base = "python/" + "/".join(parts[:depth])
            leaf = parts[depth]
            if (target.exists(base + "/__init__.py")
                    and not target.exists(base + "/" + leaf + ".py")
                    and not target.exists(base + "/" + leaf)):
                return True
        return False

    def is_package_member(module, name):
        rel = "python/" + module.replace(".", "/") + "/" + name
        return target.exists(rel + ".py") or target.exists(rel + "/__init__.py")

    for _src, dst, body in candidates:
        if not dst.endswith(".py"):
            continue
        try:
            tree = ast.parse(body)
        except SyntaxError:
            continue
        optional = _guarded_import_lines(tree)
        problems = []
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in optional:
                continue
            if isinstance(node, ast.Import):
                wanted = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                wanted = [(node.module, a.name) for a in node.names]
            else:
                continue
            for module, name in wanted:
                if module.split(".")[0] != "paddle":
                    continue
                text = module_text(module)
                if text is None:
                    if not is_missing(module):
                        continue
                    problem = "imports %s, which the target lacks" % module
                elif name in (None, "*") or name in module_defined_names(text) \
                        or is_package_member(module, name) \
                        or re.search(r"(?m)^\s*from\s+\S+\s+import\s+\*", text):
                    continue
                else:
                    problem = "imports %s from %s, which the target's %s does not define" % (
                        name, module, module)
                if problem not in problems:
                    problems.append(problem)
        for problem in problems:
            ex.conflicts.append((dst, problem + " (a tests-only patch adds no product file)"))


def _check_python(ex, dst, text):
    try:
        compile(text, dst, "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise ExportError("%s: exported text does not compile: %s" % (dst, exc))
    leftover = leftover_reference_lines(text)
    dropped = dict(dropped_module_lines(text))
    for no, line in enumerate(text.splitlines(), 1):
        if no in dropped or "compat_paddle_3_3" in line:
            ex.warnings.append("%s:%d: imports a dropped package: %s"
                               % (dst, no, line.strip()))
        elif no in leftover:
            ex.warnings.append("%s:%d: leftover 'paddle_muon_ext': %s"
                               % (dst, no, line.strip()))


def build_export(repo_root: str, files=None, include=(), exclude=(), extra_map=(),
                 paddle_tree: PaddleTree | None = None,
                 include_untracked: bool = False, tests_only: bool = False) -> Export:
    """Decide every file of the patch (data only; nothing is written).

    Args:
        repo_root: this repository's checkout.
        files: source paths (default: git ls-files).
        paddle_tree: the target (default: the installed paddle package).
        include_untracked: also export files git does not track yet.
        tests_only: only the upstream tests (:func:`select_upstream_tests`)
            and their ``testslist.csv`` rows; no product file, no proto or
            docs edit; every ``paddle`` import must resolve in the target.

    Returns:
        Export: changes, what was left out and why, conflicts.
    """
    repo_root = os.path.abspath(repo_root)
    target = paddle_tree or PaddleTree()
    if files is None:
        files = list_source_files(repo_root, include_untracked)
    unmatched = [g for g in include if not any(fnmatch.fnmatchcase(f, g) for f in files)]
    if unmatched:  # a typo would otherwise give an empty (or partial) patch
        raise ExportError("--include %s matches no file of the checkout; pass a glob of "
                          "paths relative to the repository root, e.g. "
                          "'python/paddle_muon_ext/optimizer/*'"
                          % ", ".join(repr(g) for g in unmatched))
    ex = Export(target=target.describe(), tests_only=tests_only)
    found = _candidates(repo_root, files, include, exclude, extra_map, ex)
    if tests_only:
        found, left = select_upstream_tests(found)
        ex.not_selected = len(left)
        if not found:
            raise ExportError("--tests-only: no file carries the `%s` line (in its first %d "
                              "lines); mark the test modules that go upstream"
                              % (UPSTREAM_TESTS_MARKER, MARKER_SCAN_LINES))
    candidates = []
    for src, dst, text in found:
        if dst in UPSTREAM_OWNED and target.exists(dst):
            ex.left_out.append((dst, UPSTREAM_OWNED[dst]))
            continue
        candidates.append([src, dst, text])
    kept = _drop_tool_tests(candidates, ex)
    if tests_only:  # a marked test must travel, not vanish from the patch
        kept_src = {c[0] for c in kept}
        for src, dst, text in candidates:
            if src not in kept_src and is_upstream_test(text):
                reason = next(r for s2, r in ex.dropped if s2 == src)
                ex.conflicts.append((dst, "marked `%s` but left out: %s"
                                     % (UPSTREAM_TESTS_MARKER, reason)))
    candidates = kept
    # rule 5: our test files never replace develop's
    module_renames = {}
    for cand in candidates:
        dst = cand[1]
        if dst.startswith("test/") and os.path.basename(dst) != "__init__.py" \
                and target.exists(dst):
            ours = renamed_test_path(dst)
            ex.renamed[dst] = ours
            cand[1] = ours
            if dst.endswith(".py"):
                module_renames[os.path.basename(dst)[:-3]] = os.path.basename(ours)[:-3]
    if module_renames:
        pattern = re.compile(r"\b(%s)\b" % "|".join(map(re.escape, module_renames)))
        for cand in candidates:
            if cand[1].startswith("test/"):
                cand[2] = pattern.sub(lambda m: module_renames[m.group(1)], cand[2])
    _check_owned_module_names(ex, candidates, target)
    if tests_only:
        _check_target_imports(ex, candidates, target)
    registry = read_test_registry(repo_root)
    # a kept name may be inherited from a base the patch itself adds
    patched = _Overlay(target, {dst: upstream_modes.scrub(text) for _s, dst, text in candidates})
    for src, dst, text in candidates:
        if dst.endswith(".py"):
            _check_python(ex, dst, text)
        if os.path.basename(dst) == "__init__.py" and dst.startswith("python/") \
                and target.exists(os.path.dirname(dst)):
            _note_init(ex, src, dst, text, target)
            continue
        text = upstream_modes.scrub(text)  # what Paddle receives reads as its own
        old = target.read(dst)
        if old == text:
            ex.unchanged.append(dst)
            continue
        if old is not None and dst.endswith(".py") and not dst.startswith("test/"):
            theirs, ours = module_surface(old), module_namespace(text, patched)
            ex.kept_names[dst] = sorted(theirs & ours)
            for name in sorted(theirs - ours):
                if _is_public(name):
                    ex.conflicts.append((dst, "would remove develop's public name %s" % name))
                elif dst in KEEP_EVERY_NAME:
                    ex.conflicts.append((dst, "would remove develop's name %s (develop's "
                                              "tests read private names too)" % name))
                else:
                    ex.warnings.append("%s: develop's private name %s is gone" % (dst, name))
        ex.changes[dst] = Change(dst, text, old, src, target.mode(dst))
        if _is_test_module(dst):
            if not unittest_method_count(text):
                ex.zero_test_modules.append(dst)
            _register_test(ex, src, dst, registry, target)
    _registry_edits(ex, target)
    if tests_only:
        product = sorted(d for d in ex.changes if not d.startswith("test/"))
        if product:  # the selection only takes test/ files: a bug if reached
            raise ExportError("tests-only patch would change product file(s) %s"
                              % ", ".join(product))
    return ex


def _note_init(ex, src, dst, text, target):
    imports, names = init_exports(text)
    theirs = target.read(dst) or ""
    have_imports, (_, have_all) = imported_names(theirs), init_exports(theirs)
    missing_imports = [i for i in imports if not imported_names(i) <= have_imports]
    missing_names = [n for n in names if n not in have_all]
    if missing_imports or missing_names:
        ex.init_notes.append((dst, missing_imports, missing_names))
    ex.dropped.append((src, "existing Paddle package __init__ (not touched)"))


def _register_test(ex, src, dst, registry, target):
    tdir, name = os.path.dirname(dst), os.path.basename(dst)[:-3]
    if tdir in GLOB_TEST_DIRS:
        ex.glob_tests.append(dst)
        return
    if tdir not in TESTSLIST_DIRS:
        reason = ("test module in %s: Paddle registers tests only in %s (testslist.csv) "
                  "and %s (glob); map it there" % (tdir, ", ".join(TESTSLIST_DIRS),
                                                   ", ".join(GLOB_TEST_DIRS)))
        (ex.conflicts.append((dst, reason)) if target.is_checkout
         else ex.warnings.append("%s: %s" % (dst, reason)))
        return
    meta = test_meta(registry, src)
    if not meta.registered:
        ex.unregistered.append(src)
    ex.test_rows.append((tdir, testslist_row(name, meta)))


def _registry_edits(ex, target):
    if not target.is_checkout:
        ex.options = [(o, "not added: no --paddle-root (proto source needed)")
                      for o in STRATEGY_OPTIONS]
        return
    edits = []  # (path, function(text) -> (text, summary))
    state = {}
    if ex.tests_only:
        ex.options = [(o, "not added: tests-only patch (no product file)")
                      for o in STRATEGY_OPTIONS]

    def proto(text):
        text, added, present = add_proto_fields(text, STRATEGY_OPTIONS)
        state.update({n: "proto field added" for n in added})
        state.update({n: "proto field already in the target" for n in present})
        return text

    def docs(text):
        text, added = add_strategy_docs(text, STRATEGY_OPTIONS)
        for n in added:
            state[n] = state.get(n, "") + "; documented in hybrid_configs"
        return text

    if STRATEGY_OPTIONS and not ex.tests_only:
        edits += [(PROTO_PATH, proto), (STRATEGY_DOC_PATH, docs)]
    by_dir = {}
    for tdir, row in ex.test_rows:
        by_dir.setdefault(tdir, []).append(row)
    for tdir, rows in sorted(by_dir.items()):
        def rows_edit(text, rows=rows):
            text, _, present = add_testslist_rows(text, rows)
            ex.rows_present.extend(present)
            return text
        edits.append((tdir + "/" + TESTSLIST_NAME, rows_edit))
    for path, edit in edits:
        old = target.read(path)
        if old is None:
            ex.conflicts.append((path, "missing in the target (needed for the %s edit)"
                                 % os.path.basename(path)))
            continue
        base = ex.changes[path].new if path in ex.changes else old
        try:
            new = edit(base)
        except EditConflict as exc:
            ex.conflicts.append((path, str(exc)))
            continue
        if new != old:
            ex.changes[path] = Change(path, new, old, None, target.mode(path))
    if not ex.tests_only:
        ex.options = [(o, state.get(o.name, "not added")) for o in STRATEGY_OPTIONS]


# ------------------------------------------------------------------ render
def render_notes(ex: Export) -> str:
    """What the patch does to the target, and what stays as develop has it."""
    out = ["# Muon export notes", "",
           "Exported from paddle_muon_ext by tools/export_upstream_patch.py against "
           "a %s." % ex.target, "",
           "Nothing changes for existing users unless they opt in: new options "
           "default to develop's behaviour, develop's modules and tests keep their "
           "names.", ""]
    if ex.tests_only:
        out += ["## Tests only", "",
                "This patch changes no product file: only files under `test/` and rows "
                "of `testslist.csv`. Its tests import develop's own modules, so they "
                "test develop's code in place. Selected: the modules marked `%s` and "
                "the test-tree files they import; %d other exportable files of the "
                "package are not in it (the full export carries them). After `git "
                "apply`, regenerate each touched directory's CMakeLists.txt from its "
                "testslist.csv (`python tools/gen_ut_cmakelists.py -f "
                "<dir>/testslist.csv`)." % (UPSTREAM_TESTS_MARKER, ex.not_selected), ""]
    out += ["## Develop names kept", ""]
    if not (ex.left_out or ex.kept_names or ex.renamed):
        out.append("- None of this package's files exist in the target.")
    for dst, reason in ex.left_out:
        out.append("- `%s`: left out, %s." % (dst, reason))
    for dst, names in sorted(ex.kept_names.items()):
        out.append("- `%s`: modified; keeps develop's %d names (%s)."
                   % (dst, len(names), ", ".join(names)))
    for dst, ours in sorted(ex.renamed.items()):
        out.append("- `%s`: develop's, kept as is; our cases are in `%s`." % (dst, ours))
    out += ["", "## New options", ""]
    for opt, state in ex.options:
        out.append("- `%s[\"%s\"].%s` (%s, default %s): %s."
                   % ("hybrid_configs", opt.config_key, opt.name, opt.proto_type,
                      opt.default, state))
    out += ["", "## Tests", ""]
    for tdir, row in ex.test_rows:
        out.append("- `%s/%s.py`: %s row: `%s`" % (tdir, row[0], TESTSLIST_NAME,
                                                   render_rows([row]).strip()))
    for dst in ex.glob_tests:
        out.append("- `%s`: registered by the directory's test_*.py glob." % dst)
    for src in ex.unregistered:
        out.append("- `%s` has no entry in %s: default timeout %ds, single process."
                   % (src, TEST_REGISTRY, DEFAULT_TEST_TIMEOUT))
    for name in ex.rows_present:
        out.append("- `%s`: the target's %s already lists it." % (name, TESTSLIST_NAME))
    if any(os.path.basename(d).startswith("test_muon_mock_") for d in ex.changes):
        out += ["", "Mock harness: `test/collective/fleet/muon_mock/` (imported as "
                "`muon_mock`, no clash with PyPI's `mock`); its self-tests "
                "`test_muon_mock_*.py` sit beside the fleet tests, so the rows in "
                "testslist.csv run them with the rest."]
    if ex.zero_test_modules:
        out += ["", "Test modules without unittest test methods (0 tests in Paddle):"]
        out += ["- `%s`" % d for d in ex.zero_test_modules]
    out += ["", "## Files", ""]
    for dst in sorted(ex.changes):
        c = ex.changes[dst]
        out.append("- `%s`: %s%s" % (dst, "modified" if c.old is not None else "added",
                                      " <- `%s`" % c.src if c.src else ""))
    for dst in ex.unchanged:
        out.append("- `%s`: the target already has this text." % dst)
    out += ["", "## Exports to add by hand", ""]
    if not ex.init_notes:
        out.append("None.")
    for dst, imports, names in ex.init_notes:
        out += ["`%s`:" % dst, "", "```python"] + imports
        if names:
            out.append("__all__ += %r" % (names,))
        out += ["```", ""]
    out += ["", "## Not exported", ""]
    out += ["- `%s`: %s" % d for d in ex.dropped] or ["Nothing."]
    if ex.warnings:
        out += ["", "## Warnings", ""] + ["- " + w for w in ex.warnings]
    return "\n".join(out) + "\n"


def _blob_sha(text: str) -> str:
    data = text.encode("utf-8")
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def render_file_diff(change: Change) -> list:
    path, new, old = change.dst, change.new, change.old
    if old is None:
        out = ["diff --git a/%s b/%s" % (path, path), "new file mode 100644",
               "index 0000000000000000000000000000000000000000..%s" % _blob_sha(new)]
        lines = new.splitlines()
        if lines:
            out += ["--- /dev/null", "+++ b/%s" % path,
                    "@@ -0,0 +1,%d @@" % len(lines) if len(lines) != 1 else "@@ -0,0 +1 @@"]
            out += ["+" + line for line in lines]
            if not new.endswith("\n"):
                out.append("\\ No newline at end of file")
        return out
    out = ["diff --git a/%s b/%s" % (path, path),
           "index %s..%s %s" % (_blob_sha(old), _blob_sha(new), change.mode),
           "--- a/%s" % path, "+++ b/%s" % path]
    diff = difflib.unified_diff(old.splitlines(True), new.splitlines(True), n=3)
    for i, line in enumerate(diff):
        if i < 2:  # difflib's own ---/+++ lines
            continue
        if line.endswith("\n"):
            out.append(line[:-1])
        else:
            out += [line, "\\ No newline at end of file"]
    return out


def render_patch(ex: Export,
                 subject: str = "Extend MuonShardingOptimizer",
                 author: str | None = None) -> str:
    author = author or upstream_modes.git_author(os.getcwd()) or "unknown <unknown@invalid>"
    now = datetime.datetime.now(datetime.timezone.utc)
    added = sum(1 for c in ex.changes.values() if c.old is None)
    out = ["From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001",
           "From: %s" % author,
           "Date: %s" % now.strftime("%a, %d %b %Y %H:%M:%S +0000"),
           "Subject: [PATCH] %s" % subject, ""]
    if ex.tests_only:
        out += ["Tests only: no product file changes; test/ files and testslist.csv "
                "rows."]
    out += ["%d files added, %d modified. Develop names kept:" %
            (added, len(ex.changes) - added)]
    for dst, reason in ex.left_out:
        out.append("* %s left out: %s." % (dst, reason))
    for dst, names in sorted(ex.kept_names.items()):
        out.append("* %s modified, keeps develop's %d names." % (dst, len(names)))
    for dst, ours in sorted(ex.renamed.items()):
        out.append("* %s kept; our cases in %s." % (dst, os.path.basename(ours)))
    for opt, state in ex.options:
        out.append("* opt-in option %s.%s, default %s (develop's behaviour): %s."
                   % (opt.config_key, opt.name, opt.default, state))
    out += ["", "---"]
    for path in sorted(ex.changes):
        out.append(" %s" % path)
    out += [" %d files changed" % len(ex.changes), ""]
    for path in sorted(ex.changes):
        out += render_file_diff(ex.changes[path])
    out += ["-- ", "2.39.0", ""]
    return "\n".join(out)


def patch_stats(ex: Export) -> list:
    """``(path, "A"|"M", lines added, lines removed)`` of every file of the patch."""
    out = []
    for path in sorted(ex.changes):
        change = ex.changes[path]
        body = render_file_diff(change)
        added = sum(1 for l in body if l.startswith("+") and not l.startswith("+++ "))
        removed = sum(1 for l in body if l.startswith("-") and not l.startswith("--- "))
        out.append((path, "M" if change.old is not None else "A", added, removed))
    return out


def render_patch_size(stats) -> str:
    """The size lines the exporter prints for a patch (one per file, then a total)."""
    lines = ["Patch size: %d files, +%d / -%d lines"
             % (len(stats), sum(s[2] for s in stats), sum(s[3] for s in stats))]
    lines += ["  %s %+7d %7s  %s" % (st, a, "-%d" % r, path) for path, st, a, r in stats]
    return "\n".join(lines)


def notes_path_for(output: str) -> str:
    stem = output[:-len(".patch")] if output.endswith(".patch") else output
    return stem + ".NOTES.md"


# ---------------------------------------------------------------- verify
def mirror_installed_paddle(dest_python_dir: str) -> dict:
    """Copy the installed paddle's .py files, symlink everything else.

    Directories are real (so ``git apply`` never writes through a link into
    site-packages); ``.py`` files are copied with their mtimes, so the
    symlinked ``__pycache__/*.pyc`` stay valid and import is fast.
    """
    spec = importlib.util.find_spec("paddle")
    if spec is None or not spec.origin:
        raise ExportError("paddle is not installed")
    src_root = os.path.dirname(spec.origin)
    dst_root = os.path.join(dest_python_dir, "paddle")
    n_copied = n_linked = copied_bytes = 0
    for dirpath, _dirnames, filenames in os.walk(src_root):
        rel = os.path.relpath(dirpath, src_root)
        target = os.path.normpath(os.path.join(dst_root, rel))
        os.makedirs(target, exist_ok=True)
        for name in filenames:
            s = os.path.join(dirpath, name)
            d = os.path.join(target, name)
            if name.endswith(".py"):
                shutil.copy2(s, d)
                n_copied += 1
                copied_bytes += os.path.getsize(d)
            else:
                os.symlink(s, d)
                n_linked += 1
    return {"paddle_src": src_root, "py_files_copied": n_copied,
            "other_files_symlinked": n_linked, "copied_bytes": copied_bytes}


def git_apply(work_dir: str, patch_path: str, *flags: str) -> None:
    for extra in (("--check",), ()):
        cmd = ["git", "apply", *flags, *extra, os.path.abspath(patch_path)]
        proc = subprocess.run(cmd, cwd=work_dir, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        if proc.returncode:
            raise ExportError("%s failed: %s" % (" ".join(cmd), proc.stdout))


def import_in_tree(work_dir: str, modules) -> dict:
    """Import modules with only ``<work_dir>/python`` on the path."""
    probe = ("import importlib, json, sys, paddle\n"
             "mods = {m: importlib.import_module(m).__file__ for m in sys.argv[1:]}\n"
             "print(json.dumps({'paddle': paddle.__file__, 'modules': mods}))\n")
    env = dict(os.environ, PYTHONPATH=os.path.join(work_dir, "python"),
               PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, "-c", probe, *modules], cwd=work_dir,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
    if proc.returncode:
        raise ExportError("import in patched tree failed:\n" + proc.stderr[-4000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    root = os.path.realpath(work_dir)
    for name, path in [("paddle", result["paddle"])] + list(result["modules"].items()):
        if not os.path.realpath(path).startswith(root + os.sep):
            raise ExportError("%s was imported from %s, not from %s"
                              % (name, path, work_dir))
    return result


def verify_against_installed_paddle(patch_path: str, work_dir: str, modules) -> dict:
    """Mirror installed paddle into work_dir, git-apply, import modules."""
    t0 = time.time()
    if os.path.exists(work_dir) and os.listdir(work_dir):
        raise ExportError("%s exists and is not empty" % work_dir)
    os.makedirs(os.path.join(work_dir, "python"), exist_ok=True)
    info = mirror_installed_paddle(os.path.join(work_dir, "python"))
    info["mirror_s"] = round(time.time() - t0, 2)
    t1 = time.time()
    proc = subprocess.run(["git", "init", "-q"], cwd=work_dir)
    if proc.returncode:
        raise ExportError("git init failed in %s" % work_dir)
    git_apply(work_dir, patch_path)
    info["apply_s"] = round(time.time() - t1, 2)
    t2 = time.time()
    info.update(import_in_tree(work_dir, modules))
    info["import_s"] = round(time.time() - t2, 2)
    info["total_s"] = round(time.time() - t0, 2)
    return info


# PYTHONPATH of an in-tree run (relative to the patched tree): the test
# directories, because Paddle runs each test with its directory as cwd and
# the tests import sibling helpers by name.
IN_TREE_PYTHONPATH = ("python", "test/collective/fleet", "test/legacy_test", "test")
# modules whose __file__ the in-tree run reports (and must lie in the tree)
IN_TREE_PROBE_MODULES = (
    "paddle",
    "paddle.optimizer.muon",
    "paddle.distributed.fleet.meta_optimizers.muon_sharding_optimizer",
)
IN_TREE_MARK = "MUON_IN_TREE_RESULT "
# Runs in the subprocess: hide the out-of-tree package (editable installs add
# a sys.path entry via .pth, or a meta path finder), prove it is gone, then
# run pytest or load test modules with unittest, and report which files the
# Muon modules came from.
_IN_TREE_BOOTSTRAP = r"""
import importlib, importlib.util, json, os, sys, unittest
hidden = set(json.loads(os.environ["MUON_EXPORT_HIDDEN_PATHS"]))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) not in hidden
               and not os.path.isdir(os.path.join(p or os.curdir, "paddle_muon_ext"))]
sys.meta_path[:] = [f for f in sys.meta_path
                    if "paddle_muon_ext" not in repr(f)
                    and "__editable__" not in getattr(type(f), "__module__", "")]
importable = importlib.util.find_spec("paddle_muon_ext") is not None
loaded, ran = {}, {}
if importable:
    rc = 99
elif os.environ["MUON_EXPORT_ACTION"] == "pytest":
    import pytest
    rc = int(pytest.main(sys.argv[1:]))
else:
    for path in sys.argv[1:]:
        folder, name = os.path.split(os.path.abspath(path))
        if folder not in sys.path:
            sys.path.insert(0, folder)
        try:
            module = importlib.import_module(name[:-3])
            suite = unittest.defaultTestLoader.loadTestsFromModule(module)
            loaded[path] = suite.countTestCases()
        except Exception as exc:  # report every module, not the first failure
            loaded[path] = "%s: %s" % (type(exc).__name__, exc)
            continue
        if os.environ["MUON_EXPORT_ACTION"] == "unittest-run" and loaded[path]:
            res = unittest.TextTestRunner(stream=sys.stdout, verbosity=1).run(suite)
            ran[path] = {"run": res.testsRun, "failures": len(res.failures),
                         "errors": len(res.errors), "skipped": len(res.skipped),
                         "expected_failures": len(res.expectedFailures),
                         "unexpected_successes": len(res.unexpectedSuccesses)}
    rc = 0 if all(isinstance(n, int) and n > 0 for n in loaded.values()) else 1
    if any(r["failures"] or r["errors"] or r["unexpected_successes"] for r in ran.values()):
        rc = 1
probe = json.loads(os.environ["MUON_EXPORT_PROBE_MODULES"])
print("\n%s%s" % (os.environ["MUON_EXPORT_MARK"], json.dumps({
    "rc": rc,
    "paddle_muon_ext_importable": importable,
    "paddle_muon_ext_loaded": sorted(m for m in sys.modules
                                     if m.split(".")[0] == "paddle_muon_ext"),
    "modules": {m: getattr(sys.modules.get(m), "__file__", None) for m in probe},
    "unittest_counts": loaded,
    "unittest_results": ran,
})))
sys.exit(rc)
"""


def _out_of_tree_paths(repo_root: str | None = None) -> list:
    """Directories the in-tree run must not see (the package's source root)."""
    paths = set()
    spec = importlib.util.find_spec("paddle_muon_ext")
    if spec is not None and spec.origin:
        paths.add(os.path.dirname(os.path.dirname(os.path.realpath(spec.origin))))
    if repo_root:
        paths.add(os.path.realpath(os.path.join(repo_root, "python")))
    return sorted(paths)


def _run_in_tree(work_dir, action, args, repo_root=None, timeout=None):
    work_dir = os.path.realpath(work_dir)
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": os.pathsep.join(os.path.join(work_dir, p)
                                      for p in IN_TREE_PYTHONPATH),
        "PYTHONNOUSERSITE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",  # never write through mirrored links
        "MUON_EXPORT_HIDDEN_PATHS": json.dumps(_out_of_tree_paths(repo_root)),
        "MUON_EXPORT_PROBE_MODULES": json.dumps(IN_TREE_PROBE_MODULES),
        "MUON_EXPORT_MARK": IN_TREE_MARK,
        "MUON_EXPORT_ACTION": action,
    })
    t0 = time.time()
    try:
        proc = subprocess.run([sys.executable, "-c", _IN_TREE_BOOTSTRAP, *args],
                              cwd=work_dir, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)
        out, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        rc = 124
    info = {"rc": rc, "wall_s": round(time.time() - t0, 2), "args": args,
            "report": None, "summary": None}
    for line in out.splitlines():
        if line.startswith(IN_TREE_MARK):
            info["report"] = json.loads(line[len(IN_TREE_MARK):])
        elif re.match(r"^=*\s*\d+ (passed|failed|skipped|error|deselected)", line) \
                or re.match(r"^=+ .*(passed|failed|error).* in [\d.]+s", line):
            info["summary"] = line.strip("= ").strip()
    info["output_tail"] = out[-30000:]
    problems = []
    report = info["report"]
    if report is None:
        problems.append("no probe report (subprocess crashed?)")
    else:
        if report["paddle_muon_ext_importable"] or report["paddle_muon_ext_loaded"]:
            problems.append("paddle_muon_ext was importable/loaded in the in-tree run")
        for name, path in report["modules"].items():
            if path is not None and not os.path.realpath(path).startswith(
                    work_dir + os.sep):
                problems.append("%s came from %s, not the tree" % (name, path))
        for path, count in sorted(report["unittest_counts"].items()):
            if not (isinstance(count, int) and count > 0):
                problems.append("%s: unittest loads %s" % (path, count))
        for path, res in sorted(report.get("unittest_results", {}).items()):
            if res["failures"] or res["errors"] or res["unexpected_successes"]:
                problems.append("%s: %d failed, %d errors, %d unexpected successes of %d"
                                % (path, res["failures"], res["errors"],
                                   res["unexpected_successes"], res["run"]))
    if rc != 0:
        problems.append("%s exited %d" % (action, rc))
    if report and info["summary"] is None and action != "pytest":
        counts = [c for c in report["unittest_counts"].values() if isinstance(c, int)]
        runs = list(report.get("unittest_results", {}).values())
        info["summary"] = "%d modules, %d tests loaded" % (len(report["unittest_counts"]),
                                                            sum(counts))
        if runs:
            info["summary"] += "; ran %d: %d failed, %d errors, %d skipped, %d expected " \
                "failures" % tuple(sum(r[k] for r in runs) for k in (
                    "run", "failures", "errors", "skipped", "expected_failures"))
    info["problems"] = problems
    return info


def run_pytest_in_tree(work_dir: str, pytest_args, repo_root: str | None = None,
                       timeout: float | None = None) -> dict:
    """Run pytest on the patched tree with only the tree on the path.

    The out-of-tree package's source root is removed from ``sys.path`` (and
    editable-install finders from ``sys.meta_path``) first; the run fails
    (rc 99) if ``paddle_muon_ext`` is still importable.  Returns a dict: rc,
    the probe report, pytest's summary line, wall seconds, output tail,
    problems.
    """
    args = ["-p", "no:cacheprovider", "--rootdir", os.path.realpath(work_dir),
            "--confcutdir", os.path.realpath(work_dir), *pytest_args]
    return _run_in_tree(work_dir, "pytest", args, repo_root, timeout)


def load_unittest_in_tree(work_dir: str, test_files, repo_root: str | None = None,
                          timeout: float | None = None) -> dict:
    """Load each test module of the patched tree with unittest's loader.

    Returns:
        dict: as ``run_pytest_in_tree``; ``report["unittest_counts"]`` maps
        each file to its test count (or the import error); a module with 0
        tests is a problem.
    """
    return _run_in_tree(work_dir, "unittest", list(test_files), repo_root, timeout)


def run_unittest_in_tree(work_dir: str, test_files, repo_root: str | None = None,
                         timeout: float | None = None) -> dict:
    """Load and run each test module of the patched tree with unittest.

    Returns:
        dict: as ``load_unittest_in_tree``; ``report["unittest_results"]``
        maps each file to its run, failure, error, skip and expected-failure
        counts; a failure, error or unexpected success is a problem.
    """
    return _run_in_tree(work_dir, "unittest-run", list(test_files), repo_root, timeout)


def copy_and_apply(paddle_root: str, work_dir: str, patch_path: str) -> dict:
    """Copy a Paddle checkout (links kept as links) into an empty work_dir and
    ``git apply`` the patch there; the checkout itself is not touched."""
    t0 = time.time()
    if os.path.exists(work_dir) and os.listdir(work_dir):
        raise ExportError("%s exists and is not empty" % work_dir)
    if os.path.exists(work_dir):
        os.rmdir(work_dir)
    shutil.copytree(paddle_root, work_dir, symlinks=True)
    if not os.path.isdir(os.path.join(work_dir, ".git")):
        subprocess.run(["git", "init", "-q"], cwd=work_dir, check=True)
    git_apply(work_dir, patch_path)
    return {"copy_and_apply_s": round(time.time() - t0, 2)}


def exported_modules(files) -> list:
    mods = []
    for path in sorted(files):
        if path.startswith("python/paddle/") and path.endswith(".py"):
            mod = path[len("python/"):-3].replace("/", ".")
            if mod.endswith(".__init__"):
                mod = mod[: -len(".__init__")]
            mods.append(mod)
    return mods


# ------------------------------------------------------------------ main
def _write(flag: str, path: str, text: str) -> None:
    write_output(flag, path, text.encode("utf-8"))


def _check_outputs(args) -> str | None:
    """The notes path (None: no notes file), after checking both output
    paths before any work (:func:`check_writable`).

    Raises:
        InputError: an unusable path, or both naming one file.
    """
    output = check_writable("-o", args.output, stdout_ok=True)
    if args.notes is None and output == STDOUT:
        return None  # ``-o -``: the notes are printed (to stderr), no file
    notes_arg = args.notes if args.notes is not None else notes_path_for(args.output)
    notes = check_writable("--notes", notes_arg)
    if notes == output:
        raise InputError("--notes", args.notes, "is the -o file",
                         "pass another file for the notes")
    return notes


def _refuse(message: str) -> int:
    print("error: %s" % message, file=sys.stderr)
    return 2


def _main_fixes(args, author: str, notes_path: str | None) -> int:
    """--fixes: one fix per UB-n develop's file still has (see upstream_fixes)."""
    try:
        ex, outcome = upstream_fixes.build_fixes_export(sys.modules[__name__],
                                                        args.paddle_root)
    except ExportError as exc:
        for fix, why in upstream_fixes.apply_fixes(
                PaddleTree(args.paddle_root).read(upstream_modes.OPTIMIZER) or "").skipped:
            print("%s: left out: %s" % (fix.bug, why), file=sys.stderr)
        print("export_upstream_patch: error: %s" % exc, file=sys.stderr)
        return 1
    for fix, why in outcome.skipped:
        print("%s: left out: develop's text no longer matches: %s" % (fix.bug, why),
              file=sys.stderr)
    sizes = render_patch_size(patch_stats(ex))
    notes = upstream_fixes.render_notes(outcome, sizes)
    try:
        _write("-o", args.output, upstream_fixes.render_fixes_patch(
            sys.modules[__name__], ex, outcome, author))
        if notes_path is not None:
            _write("--notes", notes_path, notes)
    except InputError as exc:
        print("export_upstream_patch: error: %s" % exc, file=sys.stderr)
        return 2
    # with -o - stdout is the patch: the report goes to stderr
    report = sys.stderr if args.output == STDOUT else sys.stdout
    print("Wrote %s (fixes: %s)%s" % (
        "the patch to standard output" if args.output == STDOUT else args.output,
        ", ".join(f.bug for f in outcome.applied),
        " and %s" % notes_path if notes_path else ""), file=report)
    print(sizes, file=report)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-o", "--output", required=True,
                   help="patch file to write; - writes the patch to standard output "
                        "(the summary and the notes then go to stderr). An existing "
                        "file keeps its mode; a read-only file, a directory, a "
                        "device, a FIFO or a symbolic link is refused")
    p.add_argument("--notes", default=None,
                   help="notes file (default: <output stem>.NOTES.md; none with -o - "
                        "unless given); the same rules as -o, without -")
    p.add_argument("--repo-root", default=".")
    p.add_argument("--paddle-root", default=None,
                   help="Paddle source checkout to export against")
    p.add_argument("--tests-only", action="store_true",
                   help="export only the upstream tests (files marked `%s` and the "
                        "test-tree files they import) and their testslist.csv rows; "
                        "no product file; needs --paddle-root" % UPSTREAM_TESTS_MARKER)
    p.add_argument("--fixes", action="store_true",
                   help="export the fix of every bug of docs/UPSTREAM_BUGS.md that "
                        "develop's muon_sharding_optimizer.py still has, plus a test per "
                        "bug and its testslist.csv row; needs --paddle-root")
    p.add_argument("--author", metavar="'NAME <EMAIL>'", default=None,
                   help="patch author (default: git's author identity here)")
    p.add_argument("--include-untracked", action="store_true")
    p.add_argument("--include", action="append", default=[])
    p.add_argument("--exclude", action="append", default=[])
    p.add_argument("--map", action="append", default=[], metavar="SRC=DST")
    p.add_argument("--strict", action="store_true",
                   help="warnings (leftover/dropped references) are errors")
    p.add_argument("--require-unittest", action="store_true",
                   help="a test module without unittest test methods is an error")
    p.add_argument("--verify-against-installed-paddle", metavar="DIR")
    p.add_argument("--verify-in-copy", metavar="DIR",
                   help="copy --paddle-root into DIR (empty or absent), git apply the "
                        "patch there; then --verify-unittest-load/--verify-unittest-run/"
                        "--verify-pytest run in DIR")
    p.add_argument("--verify-unittest-run", action="store_true",
                   help="after --verify-in-copy or --verify-against-installed-paddle, "
                        "run every exported test module with unittest (failures, "
                        "errors and unexpected successes fail; expected failures pass)")
    p.add_argument("--verify-module", action="append", default=[])
    p.add_argument("--verify-pytest", metavar="ARGS", default=None,
                   help="after --verify-against-installed-paddle, run pytest "
                        "with these (shell-quoted) arguments in the patched "
                        "copy, without the out-of-tree package on the path")
    p.add_argument("--verify-unittest-load", action="store_true",
                   help="after --verify-against-installed-paddle, load every "
                        "exported test module with unittest (each must have > 0 tests)")
    args = p.parse_args(argv)
    if (args.verify_pytest is not None or args.verify_unittest_load
            or args.verify_unittest_run) \
            and not (args.verify_against_installed_paddle or args.verify_in_copy):
        p.error("--verify-pytest/--verify-unittest-load/--verify-unittest-run need "
                "--verify-against-installed-paddle DIR or --verify-in-copy DIR")
    if args.paddle_root and not os.path.isdir(args.paddle_root):
        p.error("--paddle-root %r is not a directory; pass a Paddle checkout" % args.paddle_root)
    for flag, path in (("--verify-in-copy", args.verify_in_copy),
                       ("--verify-against-installed-paddle",
                        args.verify_against_installed_paddle)):
        if path and os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
            p.error("%s %r exists and is not an empty directory; pass a new or empty one"
                    % (flag, path))
    if args.verify_in_copy and not args.paddle_root:
        p.error("--verify-in-copy needs --paddle-root DIR (the tree it copies)")
    if args.verify_in_copy and args.verify_against_installed_paddle:
        p.error("--verify-in-copy and --verify-against-installed-paddle are exclusive")
    if args.tests_only and not args.paddle_root:
        p.error("--tests-only needs --paddle-root DIR (the develop checkout whose "
                "testslist.csv gets the rows)")
    mode = "fixes" if args.fixes else "tests-only" if args.tests_only else "full"
    if args.fixes and (args.tests_only or not args.paddle_root):
        return _refuse("--fixes needs --paddle-root DIR (a tree holding develop's %s) and "
                       "excludes --tests-only" % upstream_modes.OPTIMIZER)
    if args.paddle_root:
        missing = upstream_modes.missing_for(mode, args.paddle_root)
        if missing:
            return _refuse(missing)
    author = args.author or upstream_modes.git_author(args.repo_root)
    if not author or not re.fullmatch(r"[^<>]+ <[^<>@\s]+@[^<>\s]+>", author):
        return _refuse("patch author %r is not 'Name <email>'; set git config user.name / "
                       "user.email or pass --author 'Name <email>'" % author)
    if args.output == STDOUT and (args.verify_against_installed_paddle
                                  or args.verify_in_copy):
        p.error("--verify-in-copy/--verify-against-installed-paddle apply the patch "
                "file; pass -o FILE, not -o -")
    try:
        notes_path = _check_outputs(args)
    except InputError as exc:
        print("export_upstream_patch: error: %s" % exc, file=sys.stderr)
        return 2
    if args.fixes:
        return _main_fixes(args, author, notes_path)
    note = args.paddle_root and upstream_modes.unchecked_imports_note(mode, args.paddle_root)
    if note:
        print(note, file=sys.stderr)
    extra_map = []
    for item in args.map:
        if "=" not in item:
            p.error("--map takes SRC=DST")
        extra_map.append(tuple(item.split("=", 1)))
    try:
        ex = build_export(
            args.repo_root, include=args.include, exclude=args.exclude,
            extra_map=extra_map, paddle_tree=PaddleTree(args.paddle_root),
            include_untracked=args.include_untracked, tests_only=args.tests_only)
    except ExportError as exc:
        print("export_upstream_patch: error: %s" % exc, file=sys.stderr)
        return 2
    for w in ex.warnings:
        print("WARNING: " + w, file=sys.stderr)
    for dst in ex.zero_test_modules:
        print("WARNING: %s: no unittest test methods (Paddle's runner would load 0 "
              "tests)" % dst, file=sys.stderr)
    errors = ["CONFLICT: %s: %s" % c for c in ex.conflicts]
    if args.strict:
        errors += ["STRICT: %s" % w for w in ex.warnings]
    if args.require_unittest:
        errors += ["NO UNITTEST TESTS: %s" % d for d in ex.zero_test_modules]
    if errors:
        for e in errors:
            print(e, file=sys.stderr)
        print("export_upstream_patch: %d problem(s); no patch written" % len(errors),
              file=sys.stderr)
        return 1
    notes = render_notes(ex)
    try:
        _write("-o", args.output, render_patch(ex, author=author, subject=(
            "Add conformance tests for MuonShardingOptimizer"
            if ex.tests_only else "Extend MuonShardingOptimizer")))
        if notes_path is not None:
            _write("--notes", notes_path, notes)
    except InputError as exc:
        print("export_upstream_patch: error: %s" % exc, file=sys.stderr)
        return 2
    added = sum(1 for c in ex.changes.values() if c.old is None)
    # with -o - stdout is the patch: the report goes to stderr
    report = sys.stderr if args.output == STDOUT else sys.stdout
    print("Wrote %s (%s%d added, %d modified)%s"
          % ("the patch to standard output" if args.output == STDOUT else args.output,
             "tests only: " if ex.tests_only else "", added, len(ex.changes) - added,
             " and %s" % notes_path if notes_path else ""), file=report)
    print(render_patch_size(patch_stats(ex)), file=report)
    print(file=report)
    print(notes, file=report)
    if args.verify_against_installed_paddle or args.verify_in_copy:
        work = args.verify_against_installed_paddle or args.verify_in_copy
        mods = args.verify_module or exported_modules(ex.changes)
        try:
            if args.verify_in_copy:
                info = copy_and_apply(args.paddle_root, work, args.output)
                if mods:
                    info.update(import_in_tree(work, mods))
            else:
                info = verify_against_installed_paddle(args.output, work, mods)
        except (ExportError, OSError, subprocess.CalledProcessError) as exc:
            print("VERIFY FAILED: %s" % exc, file=sys.stderr)
            return 1
        print("VERIFY OK: " + json.dumps(info, indent=2, sort_keys=True))
        runs = []
        if args.verify_unittest_run:
            runs.append(("IN-TREE UNITTEST RUN", run_unittest_in_tree(
                work, ex.test_modules(), repo_root=args.repo_root)))
        elif args.verify_unittest_load:
            runs.append(("IN-TREE UNITTEST LOAD", load_unittest_in_tree(
                work, ex.test_modules(), repo_root=args.repo_root)))
        if args.verify_pytest is not None:
            runs.append(("IN-TREE PYTEST", run_pytest_in_tree(
                work, shlex.split(args.verify_pytest), repo_root=args.repo_root)))
        failed = False
        for label, res in runs:
            print(res["output_tail"])
            print("%s %s (%.1fs): %s" % (label, "FAILED" if res["problems"] else "OK",
                                        res["wall_s"], res["summary"]))
            print("%s PROBE: %s" % (label, json.dumps(res["report"], sort_keys=True)))
            for problem in res["problems"]:
                print("%s FAILED: %s" % (label, problem), file=sys.stderr)
            failed = failed or bool(res["problems"])
        if failed:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
