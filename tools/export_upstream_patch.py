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
"""Export paddle_muon_ext as a patch against a Paddle source tree.

Writes a git-format patch (mbox header + ``diff --git`` sections, new files
only: ``--- /dev/null``, mode 100644) that ``git apply`` (or ``git am``)
accepts at the root of a Paddle checkout.

Path mapping (``PATH_MAP``; more with ``--map SRC=DST``)::

    python/paddle_muon_ext/<X>  ->  python/paddle/<X>
    test/<X>                    ->  test/<X>      (test/mock/ included)
    tools/...                   ->  not exported unless mapped with --map

Rewrites in exported files:

* imports: ``paddle_muon_ext.<mod>`` -> ``paddle.<mod>`` (also inside
  strings such as ``mock.patch("paddle_muon_ext.x.y")``),
  ``from paddle_muon_ext import`` -> ``from paddle import`` and
  ``import paddle_muon_ext`` -> ``import paddle``.  Identifiers that merely
  contain the name (``my_paddle_muon_ext``, ``paddle_muon_ext_version``,
  ``obj.paddle_muon_ext``) and path strings are left alone.
* compat blocks: lines from ``# paddle_muon_ext: compat-begin`` through
  ``# paddle_muon_ext: compat-end`` (inclusive; markers may be indented, no
  nesting) are deleted.  The code outside the block must be the upstream
  form; the block only adds what paddle 3.3.1 lacks, e.g.::

      # paddle_muon_ext: compat-begin
      from paddle_muon_ext.compat_paddle_3_3 import install_shims
      install_shims()
      # paddle_muon_ext: compat-end
      from paddle_muon_ext.distributed.fleet.utils import helper

Dropped (never exported):

* ``DROPPED_PATHS``: the package's own top-level ``__init__.py``/``cli.py``;
* ``DROPPED_PREFIXES``: ``python/paddle_muon_ext/compat_paddle_3_3/`` and
  ``test/tools/`` (tests of the non-exported tools);
* COMPAT-ONLY MARKER: any file whose first 30 lines contain the comment
  ``# paddle_muon_ext: compat-only`` (put it right under the license
  header of modules that exist only to run on paddle 3.3.1);
* ``__pycache__``, ``*.pyc`` and binary files.

``__init__.py`` of a directory that already exists in Paddle (e.g.
``python/paddle/optimizer/__init__.py``) is NOT overwritten: the new
modules are emitted alone and the imports / ``__all__`` names that must be
added by hand are printed and written to ``NOTES_PATH``
(``python/paddle/distributed/fleet/meta_optimizers/MUON_EXPORT_NOTES.md``)
inside the patch.  Whether a Paddle directory exists is looked up in
``--paddle-root`` (a Paddle checkout) when given, else in the installed
``paddle`` package for ``python/paddle/...`` and in
``KNOWN_PADDLE_TEST_DIRS`` for ``test/...``.  A non-``__init__`` file that
already exists in Paddle is a conflict (exit 1).

Tests: for every exported test directory with ``test_*.py`` files, a new
``<dir>/muon_tests.cmake`` registers them with ``py_test_modules(... ENVS
...)`` / ``set_tests_properties(... TIMEOUT ... LABELS ...)``; add the
printed ``include(muon_tests.cmake)`` line to that directory's
CMakeLists.txt.  A test can override its timeout with
``# paddle_muon_ext: test-timeout=300`` in its first 30 lines.

Usage::

    python tools/export_upstream_patch.py -o muon.patch
    python tools/export_upstream_patch.py -o muon.patch --repo-root . \\
        --include-untracked --paddle-root ~/Paddle
    python tools/export_upstream_patch.py -o muon.patch \\
        --map tools/bench/=tools/muon_bench/ --exclude 'test/mock/big_*'
    cd ~/Paddle && git apply --check /path/muon.patch && git am /path/muon.patch
    # prove it: copy installed paddle into DIR, apply, import the modules
    python tools/export_upstream_patch.py -o muon.patch \\
        --verify-against-installed-paddle /tmp/paddle_verify
    # ... and run test suites there, without paddle_muon_ext importable
    python tools/export_upstream_patch.py -o muon.patch --include-untracked \\
        --verify-against-installed-paddle /tmp/paddle_verify \\
        --verify-pytest "-q test/mock test/legacy_test/test_muon_optimizer.py"

Options: ``--include GLOB``/``--exclude GLOB`` (fnmatch on source paths,
repeatable) filter the file list; ``--strict`` turns warnings (leftover
``paddle_muon_ext`` / compat references) into exit 1; ``--verify-module
NAME`` picks the modules imported by the verification (default: every
exported non-test module); ``--verify-pytest ARGS`` then runs pytest in
the copy (``run_pytest_in_tree``: PYTHONPATH ``IN_TREE_PYTHONPATH``, the
out-of-tree package hidden, module origins checked).  Exit: 0 ok, 1 conflicts/verification failure
(or warnings with --strict), 2 usage errors.
"""

import argparse
import ast
import datetime
import fnmatch
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import shlex
import subprocess
import sys
import time
import tokenize

# source prefix -> Paddle prefix (first match wins)
PATH_MAP = (
    ("python/paddle_muon_ext/", "python/paddle/"),
    ("test/", "test/"),
)
# exact source paths that have no Paddle counterpart
DROPPED_PATHS = (
    "python/paddle_muon_ext/__init__.py",
    "python/paddle_muon_ext/cli.py",
)
DROPPED_PREFIXES = (
    "python/paddle_muon_ext/compat_paddle_3_3/",
    "test/tools/",
)
COMPAT_ONLY_MARKER = "# paddle_muon_ext: compat-only"
COMPAT_BEGIN = "# paddle_muon_ext: compat-begin"
COMPAT_END = "# paddle_muon_ext: compat-end"
TEST_TIMEOUT_MARKER = "# paddle_muon_ext: test-timeout="
MARKER_SCAN_LINES = 30
NOTES_PATH = "python/paddle/distributed/fleet/meta_optimizers/MUON_EXPORT_NOTES.md"
CMAKE_NAME = "muon_tests.cmake"
DEFAULT_TEST_TIMEOUT = 120
# Paddle test dirs that exist upstream (used without --paddle-root)
KNOWN_PADDLE_TEST_DIRS = (
    "test",
    "test/collective",
    "test/collective/fleet",
    "test/legacy_test",
    "test/auto_parallel",
    "test/distributed_passes",
)

_IMPORT_RULES = (
    # from paddle_muon_ext import x  ->  from paddle import x
    (re.compile(r"(?<![\w.])(from\s+)paddle_muon_ext(\s+import\b)"), r"\1paddle\2"),
    # import paddle_muon_ext [as y]  ->  import paddle [as y]
    (re.compile(r"(?<![\w.])(import\s+)paddle_muon_ext(?![\w.])"), r"\1paddle"),
    # paddle_muon_ext.a.b (imports, attribute access, dotted strings)
    (re.compile(r"(?<![\w.])paddle_muon_ext(?=\.[A-Za-z_])"), "paddle"),
)
_LEFTOVER_RE = re.compile(r"(?<![\w/])paddle_muon_ext(?![\w/:])")
_MODULE_NAME_RE = re.compile(r"^paddle_muon_ext(\.[A-Za-z_]\w*)*$")


class ExportError(Exception):
    pass


# ------------------------------------------------------------ text helpers
def rewrite_imports(text):
    for pattern, repl in _IMPORT_RULES:
        text = pattern.sub(repl, text)
    return text


def strip_compat_blocks(text, path="<text>"):
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


def leftover_reference_lines(text):
    """Line numbers where exported Python code still names paddle_muon_ext.

    Code only: the bare name (``import os, paddle_muon_ext``,
    ``sys.modules[...]`` aside) and string literals that are exactly a
    ``paddle_muon_ext[.x]`` module name (``import_module("paddle_muon_ext")``).
    Comments and prose in docstrings ("paddle_muon_ext's harness") are not
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


def is_compat_only(text):
    head = text.splitlines()[:MARKER_SCAN_LINES]
    return any(COMPAT_ONLY_MARKER in line for line in head)


def map_path(src, extra_map=()):
    for s, d in tuple(extra_map) + PATH_MAP:
        if src.startswith(s):
            return d + src[len(s):]
    return None


def init_exports(text):
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


# ------------------------------------------------------------- file list
def list_source_files(repo_root, include_untracked=False):
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
    """Answers 'does this Paddle path exist?'."""

    def __init__(self, paddle_root=None):
        self.paddle_root = paddle_root
        self.pkg_dir = None
        if paddle_root is None:
            spec = importlib.util.find_spec("paddle")  # does not import paddle
            if spec is not None and spec.origin:
                self.pkg_dir = os.path.dirname(spec.origin)

    def exists(self, rel):
        """True / False, or None when unknown."""
        if self.paddle_root:
            return os.path.exists(os.path.join(self.paddle_root, rel))
        if rel.startswith("python/paddle/") or rel == "python/paddle":
            if self.pkg_dir is None:
                return None
            return os.path.exists(
                os.path.join(self.pkg_dir, rel[len("python/paddle"):].lstrip("/")))
        if rel in KNOWN_PADDLE_TEST_DIRS:
            return True
        return None

    def describe(self):
        if self.paddle_root:
            return "Paddle checkout %s" % self.paddle_root
        return "installed paddle %s + KNOWN_PADDLE_TEST_DIRS" % (self.pkg_dir or "(none)")


# ----------------------------------------------------------------- export
class Export:
    def __init__(self):
        self.files = {}       # dst path -> text
        self.sources = {}     # dst path -> src path
        self.dropped = []     # (src, reason)
        self.init_notes = []  # (dst, imports, names)
        self.warnings = []
        self.conflicts = []
        self.cmake = {}       # test dir -> [(name, timeout, labels)]


def build_export(repo_root, files=None, include=(), exclude=(), extra_map=(),
                 paddle_tree=None, include_untracked=False, cmake=True):
    repo_root = os.path.abspath(repo_root)
    paddle_tree = paddle_tree or PaddleTree()
    if files is None:
        files = list_source_files(repo_root, include_untracked)
    ex = Export()
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
            ex.dropped.append((src, "DROPPED_PATHS (no Paddle counterpart)"))
            continue
        if src.startswith(DROPPED_PREFIXES):
            ex.dropped.append((src, "DROPPED_PREFIXES (compat package / tools tests)"))
            continue
        with open(os.path.join(repo_root, src), "rb") as f:
            raw = f.read()
        if b"\0" in raw:
            ex.dropped.append((src, "binary"))
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            ex.dropped.append((src, "binary (not UTF-8)"))
            continue
        if is_compat_only(text):
            ex.dropped.append((src, "compat-only marker"))
            continue
        text = strip_compat_blocks(text, src)
        if src.endswith(".py"):
            text = rewrite_imports(text)
            try:
                compile(text, dst, "exec", dont_inherit=True)
            except SyntaxError as exc:
                raise ExportError("%s: exported text does not compile "
                                  "(compat block removal?): %s" % (src, exc))
            leftover = leftover_reference_lines(text)
            for no, line in enumerate(text.splitlines(), 1):
                if "compat_paddle_3_3" in line:
                    ex.warnings.append("%s:%d: still references the dropped "
                                       "compat package: %s" % (dst, no, line.strip()))
                elif no in leftover:
                    ex.warnings.append("%s:%d: leftover 'paddle_muon_ext': %s"
                                       % (dst, no, line.strip()))
        exists = paddle_tree.exists(dst)
        if os.path.basename(dst) == "__init__.py":
            dir_exists = paddle_tree.exists(os.path.dirname(dst))
            if dir_exists is None:
                # unknown: never overwrite a python/paddle package __init__;
                # test dirs outside KNOWN_PADDLE_TEST_DIRS are taken as new
                dir_exists = not dst.startswith("test/")
            if dir_exists:
                imports, names = init_exports(text)
                if imports or names:
                    ex.init_notes.append((dst, imports, names))
                ex.dropped.append((src, "existing Paddle package __init__"))
                continue
        elif exists:
            ex.conflicts.append(dst)
            continue
        ex.files[dst] = text
        ex.sources[dst] = src
        base = os.path.basename(dst)
        if cmake and dst.startswith("test/") and base.startswith("test_") \
                and base.endswith(".py"):
            timeout = DEFAULT_TEST_TIMEOUT
            for line in text.splitlines()[:MARKER_SCAN_LINES]:
                if line.strip().startswith(TEST_TIMEOUT_MARKER):
                    timeout = int(line.strip()[len(TEST_TIMEOUT_MARKER):])
            labels = "RUN_TYPE=DIST" if dst.startswith("test/collective/") else ""
            ex.cmake.setdefault(os.path.dirname(dst), []).append(
                (base[:-3], timeout, labels))
    for tdir, tests in sorted(ex.cmake.items()):
        path = tdir + "/" + CMAKE_NAME
        if paddle_tree.exists(path):
            ex.conflicts.append(path)
            continue
        ex.files[path] = render_cmake(tests)
    ex.files[NOTES_PATH] = render_notes(ex, paddle_tree)
    return ex


def render_cmake(tests):
    out = ["# Generated by paddle_muon_ext tools/export_upstream_patch.py.",
           "# Add `include(%s)` to this directory's CMakeLists.txt." % CMAKE_NAME,
           ""]
    for name, timeout, labels in sorted(tests):
        out += [
            "py_test_modules(",
            "  %s MODULES %s ENVS" % (name, name),
            '  "http_proxy=;https_proxy=;PYTHONPATH=${PADDLE_BINARY_DIR}/python:'
            '${PADDLE_SOURCE_DIR}/test")',
        ]
        props = 'TIMEOUT "%d"' % timeout + (' LABELS "%s"' % labels if labels else "")
        out += ["set_tests_properties(%s PROPERTIES %s)" % (name, props), ""]
    return "\n".join(out)


def render_notes(ex, paddle_tree):
    out = ["# Muon export notes", "",
           "Generated by paddle_muon_ext `tools/export_upstream_patch.py`; "
           "existence checked against %s." % paddle_tree.describe(), ""]
    out += ["## Exports to add by hand", ""]
    if not ex.init_notes:
        out.append("None.")
    for dst, imports, names in ex.init_notes:
        out.append("### `%s`" % dst)
        out.append("")
        out.append("```python")
        out.extend(imports)
        if names:
            out.append("__all__ += %r" % (names,))
        out.append("```")
        out.append("")
    out += ["", "## CMake", ""]
    if not ex.cmake:
        out.append("No test directories.")
    for tdir in sorted(ex.cmake):
        out.append("- `%s/CMakeLists.txt`: add `include(%s)`" % (tdir, CMAKE_NAME))
    out += ["", "## Not exported", ""]
    out += ["- `%s`: %s" % d for d in ex.dropped] or ["Nothing."]
    if ex.warnings:
        out += ["", "## Warnings", ""] + ["- " + w for w in ex.warnings]
    return "\n".join(out) + "\n"


def _blob_sha(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def render_patch(files, subject="Add Muon optimizer (exported from paddle_muon_ext)",
                 author="paddle_muon_ext export <paddle_muon_ext@localhost>"):
    now = datetime.datetime.now(datetime.timezone.utc)
    out = ["From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001",
           "From: %s" % author,
           "Date: %s" % now.strftime("%a, %d %b %Y %H:%M:%S +0000"),
           "Subject: [PATCH] %s" % subject,
           "",
           "New files only; see %s for manual follow-ups." % NOTES_PATH,
           "---"]
    for path in sorted(files):
        out.append(" %s | %d +" % (path, len(files[path].splitlines())))
    out.append(" %d files changed" % len(files))
    out.append("")
    for path in sorted(files):
        text = files[path]
        data = text.encode("utf-8")
        lines = text.splitlines()
        out += ["diff --git a/%s b/%s" % (path, path),
                "new file mode 100644",
                "index 0000000000000000000000000000000000000000..%s" % _blob_sha(data)]
        if not lines:
            continue
        out += ["--- /dev/null", "+++ b/%s" % path, "@@ -0,0 +1,%d @@" % len(lines)
                if len(lines) != 1 else "@@ -0,0 +1 @@"]
        out += ["+" + l for l in lines]
        if not text.endswith("\n"):
            out.append("\\ No newline at end of file")
    out += ["-- ", "2.39.0", ""]
    return "\n".join(out)


# ---------------------------------------------------------------- verify
def mirror_installed_paddle(dest_python_dir):
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
    for dirpath, dirnames, filenames in os.walk(src_root):
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


def verify_against_installed_paddle(patch_path, work_dir, modules):
    """Mirror installed paddle into work_dir, git-apply, import modules."""
    t0 = time.time()
    if os.path.exists(work_dir) and os.listdir(work_dir):
        raise ExportError("%s exists and is not empty" % work_dir)
    os.makedirs(os.path.join(work_dir, "python"), exist_ok=True)
    info = mirror_installed_paddle(os.path.join(work_dir, "python"))
    info["mirror_s"] = round(time.time() - t0, 2)
    t1 = time.time()
    for cmd in (["git", "init", "-q"],
                ["git", "apply", "--check", os.path.abspath(patch_path)],
                ["git", "apply", os.path.abspath(patch_path)]):
        proc = subprocess.run(cmd, cwd=work_dir, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        if proc.returncode:
            raise ExportError("%s failed: %s" % (" ".join(cmd), proc.stdout))
    info["apply_s"] = round(time.time() - t1, 2)
    t2 = time.time()
    probe = ("import importlib, json, sys, paddle\n"
             "mods = {m: importlib.import_module(m).__file__ for m in sys.argv[1:]}\n"
             "print(json.dumps({'paddle': paddle.__file__, 'modules': mods}))\n")
    env = dict(os.environ, PYTHONPATH=os.path.join(work_dir, "python"))
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
    info["import_s"] = round(time.time() - t2, 2)
    info["total_s"] = round(time.time() - t0, 2)
    info.update(result)
    return info


# PYTHONPATH of an in-tree test run (relative to the patched copy); the
# fleet test dir is there because its tests import sibling helpers by name.
IN_TREE_PYTHONPATH = ("python", "test", "test/collective/fleet")
# modules whose __file__ the in-tree run reports (and must lie in the copy)
IN_TREE_PROBE_MODULES = (
    "paddle",
    "paddle.optimizer.muon",
    "paddle.distributed.fleet.meta_optimizers.muon_sharding_optimizer",
)
IN_TREE_MARK = "MUON_IN_TREE_RESULT "
# Runs inside the pytest subprocess: hide the out-of-tree package (editable
# installs add a sys.path entry via .pth, or a meta path finder), prove it is
# gone, run pytest, report which files the Muon modules came from.
_IN_TREE_BOOTSTRAP = r"""
import importlib.util, json, os, sys
hidden = set(json.loads(os.environ["MUON_EXPORT_HIDDEN_PATHS"]))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) not in hidden]
sys.meta_path[:] = [f for f in sys.meta_path
                    if "paddle_muon_ext" not in repr(f)
                    and "__editable__" not in getattr(type(f), "__module__", "")]
importable = importlib.util.find_spec("paddle_muon_ext") is not None
if importable:
    rc = 99
else:
    import pytest
    rc = int(pytest.main(sys.argv[1:]))
probe = json.loads(os.environ["MUON_EXPORT_PROBE_MODULES"])
print("\n%s%s" % (os.environ["MUON_EXPORT_MARK"], json.dumps({
    "rc": rc,
    "paddle_muon_ext_importable": importable,
    "paddle_muon_ext_loaded": sorted(m for m in sys.modules
                                     if m.split(".")[0] == "paddle_muon_ext"),
    "modules": {m: getattr(sys.modules.get(m), "__file__", None) for m in probe},
})))
sys.exit(rc)
"""


def _out_of_tree_paths(repo_root=None):
    """Directories the in-tree run must not see (the package's source root)."""
    paths = set()
    spec = importlib.util.find_spec("paddle_muon_ext")
    if spec is not None and spec.origin:
        paths.add(os.path.dirname(os.path.dirname(os.path.realpath(spec.origin))))
    if repo_root:
        paths.add(os.path.realpath(os.path.join(repo_root, "python")))
    return sorted(paths)


def run_pytest_in_tree(work_dir, pytest_args, repo_root=None, timeout=None):
    """Run pytest on the patched copy with only the copy on the path.

    ``PYTHONPATH`` is ``IN_TREE_PYTHONPATH`` under work_dir; the out-of-tree
    package's source root is removed from ``sys.path`` (and editable-install
    finders from ``sys.meta_path``) before pytest starts, and the run fails
    (rc 99) if ``paddle_muon_ext`` is still importable.  Returns a dict: rc,
    the probe report (which file each of ``IN_TREE_PROBE_MODULES`` came
    from), pytest's summary line, wall seconds and the output tail.
    """
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
    })
    args = ["-p", "no:cacheprovider", "--rootdir", work_dir,
            "--confcutdir", work_dir, *pytest_args]
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
    info["output_tail"] = out[-6000:]
    problems = []
    report = info["report"]
    if report is None:
        problems.append("no probe report (pytest subprocess crashed?)")
    else:
        if report["paddle_muon_ext_importable"] or report["paddle_muon_ext_loaded"]:
            problems.append("paddle_muon_ext was importable/loaded in the in-tree run")
        for name, path in report["modules"].items():
            if path is not None and not os.path.realpath(path).startswith(
                    work_dir + os.sep):
                problems.append("%s came from %s, not the copy" % (name, path))
    if rc != 0:
        problems.append("pytest exited %d" % rc)
    info["problems"] = problems
    return info


def exported_modules(files):
    mods = []
    for path in sorted(files):
        if path.startswith("python/paddle/") and path.endswith(".py"):
            mod = path[len("python/"):-3].replace("/", ".")
            if mod.endswith(".__init__"):
                mod = mod[: -len(".__init__")]
            mods.append(mod)
    return mods


# ------------------------------------------------------------------ main
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-o", "--output", required=True, help="patch file to write")
    p.add_argument("--repo-root", default=".")
    p.add_argument("--paddle-root", default=None,
                   help="Paddle checkout used to detect existing files")
    p.add_argument("--include-untracked", action="store_true")
    p.add_argument("--include", action="append", default=[])
    p.add_argument("--exclude", action="append", default=[])
    p.add_argument("--map", action="append", default=[], metavar="SRC=DST")
    p.add_argument("--no-cmake", action="store_true")
    p.add_argument("--strict", action="store_true")
    p.add_argument("--verify-against-installed-paddle", metavar="DIR")
    p.add_argument("--verify-module", action="append", default=[])
    p.add_argument("--verify-pytest", metavar="ARGS", default=None,
                   help="after --verify-against-installed-paddle, run pytest "
                        "with these (shell-quoted) arguments in the patched "
                        "copy, without the out-of-tree package on the path")
    args = p.parse_args(argv)
    if args.verify_pytest is not None and not args.verify_against_installed_paddle:
        p.error("--verify-pytest needs --verify-against-installed-paddle DIR")
    extra_map = []
    for item in args.map:
        if "=" not in item:
            p.error("--map takes SRC=DST")
        extra_map.append(tuple(item.split("=", 1)))
    try:
        ex = build_export(
            args.repo_root, include=args.include, exclude=args.exclude,
            extra_map=extra_map, paddle_tree=PaddleTree(args.paddle_root),
            include_untracked=args.include_untracked, cmake=not args.no_cmake)
    except ExportError as exc:
        print("export_upstream_patch: error: %s" % exc, file=sys.stderr)
        return 2
    with open(args.output, "w") as f:
        f.write(render_patch(ex.files))
    print("Wrote %s: %d new files" % (args.output, len(ex.files)))
    for dst in sorted(ex.files):
        print("  + %s%s" % (dst, "  <- " + ex.sources[dst] if dst in ex.sources else ""))
    print()
    print(ex.files[NOTES_PATH])
    for tdir in sorted(ex.cmake):
        print("ADD TO %s/CMakeLists.txt:  include(%s)" % (tdir, CMAKE_NAME))
    for w in ex.warnings:
        print("WARNING: " + w, file=sys.stderr)
    if ex.conflicts:
        for c in ex.conflicts:
            print("CONFLICT: %s already exists in Paddle" % c, file=sys.stderr)
        return 1
    if args.strict and ex.warnings:
        return 1
    if args.verify_against_installed_paddle:
        mods = args.verify_module or exported_modules(ex.files)
        try:
            info = verify_against_installed_paddle(
                args.output, args.verify_against_installed_paddle, mods)
        except ExportError as exc:
            print("VERIFY FAILED: %s" % exc, file=sys.stderr)
            return 1
        print("VERIFY OK: " + json.dumps(info, indent=2, sort_keys=True))
        if args.verify_pytest is not None:
            res = run_pytest_in_tree(args.verify_against_installed_paddle,
                                     shlex.split(args.verify_pytest),
                                     repo_root=args.repo_root)
            print(res["output_tail"])
            print("IN-TREE PYTEST %s (%.1fs): %s"
                  % ("FAILED" if res["problems"] else "OK", res["wall_s"],
                     res["summary"]))
            print("IN-TREE PROBE: " + json.dumps(res["report"], sort_keys=True))
            if res["problems"]:
                for problem in res["problems"]:
                    print("IN-TREE PYTEST FAILED: " + problem, file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
