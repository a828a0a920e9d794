#!/usr/bin/env python
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
"""Coverage of a Paddle checkout's MuonShardingOptimizer by the conformance suite.

Runs ``test/collective/fleet/test_muon_conformance*.py`` against the
``muon_sharding_optimizer.py`` of the checkout at ``--paddle-root`` (loaded
into the test process by the package's 3.3.1 compat layer, unedited) under
coverage.py with branch measurement, and reports line and branch coverage of
the selected lines of that file, the way Paddle's coverage gate measures a
PR's lines.

Selection (one of):
  default     develop's group-call code, found by parsing the file (AST):
              get_gpus_per_node / get_same_card_rank / get_trainer_ranks,
              every ``if`` of ``MuonShardingOptimizer.__init__`` that tests
              ``use_group_call_opt``, and reduce_gradients, _reduce_2d_grads,
              _broadcast_2d_params, reorder_params, _sharding_sync_parameters.
  --base REV  the lines ``git diff REV`` adds to the file in the checkout.
  --lines S   explicit lines of the file, e.g. ``120-180,200``.
Only executable lines count (coverage.py's statements); a branch counts when
it starts on a selected line.

Tests: ``passed`` / ``failed`` / ``expected_failures`` (the tests marked with
``muon_conformance_impl.upstream_bug`` whose bug the file still has; each is
a divergence explained in docs/UPSTREAM_BUGS.md; on a file where the bug is
fixed its tests count as passed). ``inner_optimizer``: the Muon the run used,
``develop (PATH)`` -- the checkout's ``python/paddle/optimizer/muon.py`` where
it imports and one step changes a Muon matrix and an AdamW vector on this
Paddle -- else ``package (...): REASON`` (one line). ``divergences`` lists every expected failure with
its bug id and every failure (unexplained). Exit status: 0 when no test
failed, 1 when one did, 2 on usage errors (before any test runs).

Usage::

    python tools/coverage/upstream_coverage.py --paddle-root ~/Paddle
    python tools/coverage/upstream_coverage.py --paddle-root ~/Paddle \
        --base upstream/develop~1 --json
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(_HERE))
sys.path.insert(0, _HERE)
import diff_coverage as dc  # noqa: E402  (git, diff parsing, coverage loading)

sys.path.insert(0, os.path.dirname(_HERE))
import export_upstream_patch as exporter  # noqa: E402  (the upstream-tests marker's home)
# the tools' output-path rules (the exporter put the package's python/ on the path)
from paddle_muon_ext.tools.limits import InputError, check_writable  # noqa: E402

SUITE_DIR = os.path.join("test", "collective", "fleet")
SUITE_GLOB = re.compile(r"^test_muon_conformance.*\.py$")
BUGS_DOC = "docs/UPSTREAM_BUGS.md"
GROUP_CALL_FUNCTIONS = ("get_gpus_per_node", "get_same_card_rank", "get_trainer_ranks")
GROUP_CALL_METHODS = ("reduce_gradients", "_reduce_2d_grads", "_broadcast_2d_params",
                      "reorder_params", "_sharding_sync_parameters")
CLASS_NAME = "MuonShardingOptimizer"


def optimizer_relpath() -> str:
    """Develop's file inside a checkout, read from its one home (develop_loader).

    Parsed, not imported: importing the package imports paddle (seconds), and
    a bad --paddle-root must be refused before any slow work.
    """
    path = os.path.join(REPO_ROOT, "python", "paddle_muon_ext", "compat_paddle_3_3",
                        "develop_loader.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        targets = ([node.target] if isinstance(node, ast.AnnAssign)
                   else node.targets if isinstance(node, ast.Assign) else [])
        if any(getattr(t, "id", "") == "OPTIMIZER_RELPATH" for t in targets):
            return ast.literal_eval(node.value)
    raise RuntimeError(f"{path} defines no OPTIMIZER_RELPATH")  # pragma: no cover


# ----------------------------------------------------------------- selection
def _lines(node: ast.AST) -> set[int]:
    return set(range(node.lineno, node.end_lineno + 1))


def _mentions(node: ast.AST, attr: str) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == attr for n in ast.walk(node))


def group_call_lines(source: str) -> tuple[set[int], list[str]]:
    """develop's group-call code in ``source`` (see the module docstring).

    Returns:
        (line numbers, the names of the pieces found, for the report).

    Raises:
        dc.UsageError: the file has no MuonShardingOptimizer class or none of
            the group-call pieces (not a file carrying PR #79448's code).
    """
    tree = ast.parse(source)
    lines: set[int] = set()
    found: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in GROUP_CALL_FUNCTIONS:
            lines |= _lines(node)
            found.append(node.name)
        if isinstance(node, ast.ClassDef) and node.name == CLASS_NAME:
            for item in node.body:
                if not isinstance(item, ast.FunctionDef):
                    continue
                if item.name in GROUP_CALL_METHODS:
                    lines |= _lines(item)
                    found.append(item.name)
                elif item.name == "__init__":
                    # outermost ifs only: a nested one is inside its parent's lines
                    ifs = [n for n in ast.walk(item) if isinstance(n, ast.If)
                           and _mentions(n.test, "use_group_call_opt")]
                    for n in ifs:
                        lines |= _lines(n)
                    if ifs:
                        found.append(f"__init__ ({len(ifs)} use_group_call_opt branches)")
    if not found:
        raise dc.UsageError(
            f"no group-call code found (none of {', '.join(GROUP_CALL_FUNCTIONS)} or "
            f"{CLASS_NAME}.{', '.join(GROUP_CALL_METHODS)}); select lines with --lines or --base")
    return lines, found


def parse_lines_spec(spec: str) -> set[int]:
    """``"120-180,200"`` -> the line numbers.

    Raises:
        dc.UsageError: a part is not N or N-M with 1 <= N <= M.
    """
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        lo, hi = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, -1)
        if not m or lo < 1 or hi < lo:
            raise dc.UsageError(f"--lines {spec!r}: {part!r} is not N or N-M with 1 <= N <= M; "
                                "write e.g. --lines 120-180,200")
        out |= set(range(lo, hi + 1))
    if not out:
        raise dc.UsageError(f"--lines {spec!r} selects no line; write e.g. --lines 120-180,200")
    return out


def base_lines(root: str, rev: str, relpath: str) -> set[int]:
    """Lines of ``relpath`` that ``git diff REV`` adds in the checkout at ``root``."""
    try:
        dc.git(root, "rev-parse", "--verify", "--quiet", rev + "^{commit}")
    except dc.UsageError:
        raise dc.UsageError(f"--base {rev!r} is not a commit of the git checkout {root}; pass a "
                            "revision it has (e.g. --base upstream/develop)") from None
    added = dc.added_lines(root, rev)
    return set(added.get(relpath, ()))


# ----------------------------------------------------------------- the run
def suite_files() -> list[str]:
    """The conformance test files, repo-relative.

    Those that go upstream (the exporter's ``upstream-tests`` marker): they run
    develop's code; the package's own loader and gloo-layer tests, named alike,
    run none.
    """
    names = []
    for name in sorted(os.listdir(os.path.join(REPO_ROOT, SUITE_DIR))):
        if SUITE_GLOB.match(name):
            with open(os.path.join(REPO_ROOT, SUITE_DIR, name), encoding="utf-8") as f:
                if exporter.is_upstream_test(f.read()):
                    names.append(name)
    return [os.path.join(SUITE_DIR, n) for n in names]


def expected_failure_bugs(files: list[str]) -> dict[tuple[str, str], str]:
    """(class, test) -> bug id, from the ``@upstream_bug("...")`` decorators."""
    out = {}
    for rel in files:
        with open(os.path.join(REPO_ROOT, rel)) as f:
            tree = ast.parse(f.read())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
                for dec in fn.decorator_list:
                    if (isinstance(dec, ast.Call) and getattr(dec.func, "id", "") == "upstream_bug"
                            and dec.args and isinstance(dec.args[0], ast.Constant)):
                        out[(cls.name, fn.name)] = dec.args[0].value
    return out


def run_suite(root: str, source: str, files: list[str], workdir: str,
              log: Any, pytest_args: list[str]) -> tuple[str, str]:
    """Run the suite under coverage in a child; returns (data file, junit xml)."""
    data_file = os.path.join(workdir, "coverage.data")
    junit = os.path.join(workdir, "junit.xml")
    cmd = [sys.executable, "-m", "coverage", "run", "--branch", f"--data-file={data_file}",
           f"--include={source}", "-m", "pytest", "-q", "-p", "no:cacheprovider",
           f"--junitxml={junit}", "--paddle-root", root, *pytest_args, *files]
    env = dict(os.environ, PADDLE_ROOT=root,
               MUON_CONFORMANCE_INNER_FILE=os.path.join(workdir, "inner.json"))
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        proc.wait()
    except BaseException:
        # interrupted: stop the whole child session, leave nothing behind
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        raise
    if not os.path.isfile(junit):
        raise RuntimeError(f"the test run wrote no report (exit {proc.returncode})")
    return data_file, junit


def read_results(junit: str, bugs: dict[tuple[str, str], str]) -> tuple[dict, list]:
    """Outcome counts and divergences from pytest's junit xml."""
    counts = {"passed": 0, "failed": 0, "expected_failures": 0, "skipped": 0}
    divergences = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        test_id = f"{case.get('classname')}::{case.get('name')}"
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        skipped = case.find("skipped")
        if failure is not None:
            counts["failed"] += 1
            divergences.append({"test": test_id, "bug": bugs.get((cls, case.get("name"))),
                                "explained": False,
                                "message": (failure.get("message") or "").splitlines()[0][:300]})
        elif skipped is not None and skipped.get("type") == "pytest.xfail":
            counts["expected_failures"] += 1
            bug = bugs.get((cls, case.get("name")))
            divergences.append({"test": test_id, "bug": bug, "explained": bug is not None,
                                "doc": f"{BUGS_DOC}#{(bug or '').lower()}"})
        elif skipped is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts, divergences


def read_inner(workdir: str) -> str:
    """Which Muon the run used (muon_tiny_moe writes it), "unknown" when not said."""
    try:
        with open(os.path.join(workdir, "inner.json")) as f:
            return str(json.load(f)["inner_optimizer"])
    except (OSError, ValueError, KeyError):
        return "unknown (the suite did not report it)"


def measure(data_file: str, source: str, selected: set[int]) -> tuple[dict, dict]:
    """Line and branch coverage of ``selected`` lines of ``source``."""
    cov = dc.load_coverage(data_file)
    ana = cov._analyze(source)  # pylint: disable=protected-access
    statements = set(ana.statements) & selected
    covered = statements & set(ana.executed)
    missing_arcs = ana.missing_branch_arcs()
    # pylint: disable-next=protected-access
    branch_lines = [ln for ln in ana._branch_lines() if ln in selected]
    total = sum(ana.exit_counts[ln] for ln in branch_lines)
    missed = [(ln, d) for ln in branch_lines for d in missing_arcs.get(ln, ())]
    lines = {"selected": len(statements), "covered": len(covered),
             "percent": round(100.0 * len(covered) / len(statements), 2) if statements else 100.0,
             "missing": dc.compress_ranges(statements - covered)}
    branches = {"selected": total, "covered": total - len(missed),
                "percent": round(100.0 * (total - len(missed)) / total, 2) if total else 100.0,
                "missing": [dc.format_arc(a, b) for a, b in sorted(missed)]}
    return lines, branches


# ----------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="upstream_coverage.py",
        description="Run the Muon conformance suite against a Paddle checkout's "
                    "MuonShardingOptimizer under coverage; report coverage of its "
                    "group-call lines (default), of the lines a git range added "
                    "(--base), or of explicit lines (--lines).")
    parser.add_argument("--paddle-root", required=True, metavar="DIR",
                        help="root of the Paddle source checkout (holds python/paddle/)")
    sel = parser.add_mutually_exclusive_group()
    sel.add_argument("--base", metavar="REV",
                     help="select the lines `git diff REV` adds to the optimizer file")
    sel.add_argument("--lines", metavar="SPEC", help="select lines, e.g. 120-180,200")
    parser.add_argument("--json", action="store_true",
                        help="print only a JSON report on stdout")
    parser.add_argument("-k", metavar="EXPR", default=None,
                        help="pytest -k expression (run part of the suite)")
    parser.add_argument("--log", metavar="FILE", default=None,
                        help="keep the test run's output in FILE (default: shown on failure); a "
                             "directory, device, FIFO, link or read-only file is refused")
    return parser


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _fail(message: str) -> int:
    sys.stderr.write(f"error: {message}\n")
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (see the module docstring)."""
    args = build_parser().parse_args(argv)
    relpath = optimizer_relpath()
    root = os.path.abspath(os.path.expanduser(args.paddle_root))
    source = os.path.realpath(os.path.join(root, *relpath.split("/")))
    if not os.path.isdir(root):
        return _fail(f"--paddle-root {args.paddle_root!r} is not a directory; pass the root of "
                     "a Paddle source checkout (the directory holding python/paddle/)")
    if not os.path.isfile(source):
        return _fail(f"--paddle-root {args.paddle_root!r} has no {relpath}; pass the root of a "
                     "Paddle source checkout whose tree holds MuonShardingOptimizer")
    if args.log is not None:
        try:
            check_writable("--log", args.log)
        except InputError as error:
            return _fail(str(error))
    try:
        with open(source) as f:
            text = f.read()
        if args.lines:
            selected, what = parse_lines_spec(args.lines), f"--lines {args.lines}"
        elif args.base:
            selected, what = base_lines(root, args.base, relpath), f"added since {args.base}"
        else:
            selected, pieces = group_call_lines(text)
            what = "group-call code: " + ", ".join(pieces)
    except (dc.UsageError, SyntaxError) as error:
        return _fail(str(error).splitlines()[0])

    files = suite_files()
    bugs = expected_failure_bugs(files)
    # SIGTERM takes the interrupt path too: the child is stopped, the temp dir removed
    signal.signal(signal.SIGTERM, _interrupt)
    workdir = tempfile.mkdtemp(prefix="upstream_coverage_")
    try:
        log_path = args.log or os.path.join(workdir, "pytest.log")
        with open(log_path, "w") as log:
            pytest_args = ["-k", args.k] if args.k else []
            data_file, junit = run_suite(root, source, files, workdir, log, pytest_args)
        counts, divergences = read_results(junit, bugs)
        inner = read_inner(workdir)
        lines, branches = measure(data_file, source, selected)
        if counts["failed"] and not args.log:
            with open(log_path) as f:
                sys.stderr.write(f.read()[-6000:])
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted; nothing was kept\n")
        return 130
    except (RuntimeError, dc.UsageError) as error:
        return _fail(str(error).splitlines()[0])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    report = {"file": source, "inner_optimizer": inner, "selection": what,
              "lines": lines, "branches": branches,
              "tests": {k: counts[k] for k in ("passed", "failed", "expected_failures")},
              "skipped": counts["skipped"], "divergences": divergences}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{source}\n  selected: {what}\n  inner optimizer: {inner}")
        print(f"  lines    {lines['covered']}/{lines['selected']} = {lines['percent']}%"
              + (f"  missing: {lines['missing']}" if lines["missing"] else ""))
        print(f"  branches {branches['covered']}/{branches['selected']} = {branches['percent']}%"
              + (f"  missing: {', '.join(branches['missing'])}" if branches["missing"] else ""))
        print(f"  tests    {counts['passed']} passed, {counts['failed']} failed, "
              f"{counts['expected_failures']} expected failures, {counts['skipped']} skipped")
        for d in divergences:
            tag = f"{d['bug']} ({BUGS_DOC})" if d["explained"] else "UNEXPLAINED"
            print(f"  divergence {tag}: {d['test']}")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
