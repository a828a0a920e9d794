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
"""Tests for tools/coverage/diff_coverage.py and check_coverage.py.

A throw-away git repo gets a base commit and a feature commit (modified,
added, deleted, renamed, non-Python and out-of-scope files); a tiny driver
runs under ``coverage run --branch`` to produce real data; the expected
numbers below are computed by hand from the sources in this file.
"""

import json
import os
import subprocess
import sys

import pytest
from tool_loader import load_tool

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(REPO, "tools", "coverage")


def _load(name):
    return load_tool(os.path.join("coverage", name + ".py"), "_muon_tools_" + name)


dc = _load("diff_coverage")
cc = _load("check_coverage")

MOD_BASE = """\
def f(x):
    return x + 1
"""
# lines 3-14 are added; executable among them: 5 7 8 9 12 13 14
MOD_HEAD = """\
def f(x):
    return x + 1


def g(x):
    # a comment
    if x > 0:
        return 1
    return 2


def h():
    y = 1
    return y
"""
REN_BASE = "A = 1\nB = 2\nC = 3\nD = 4\nE = 5\nG = 7\nH = 8\n"
REN_HEAD = "A = 1\nB = 2\nC = 3\nD = 4\nE = 5\nF = 6\nG = 7\nH = 8\n"  # +line 6
NEVER = "# never imported\nX = 1\nY = 2\n"  # executable: 2, 3
COMMENTS = "# only\n# comments\n"
DRIVER = """\
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "python"))
from pkg import mod, renamed
mod.f(1)
mod.g(1)
"""


def _git(cwd, *args):
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@e",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@e")
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True,
                          stdout=subprocess.PIPE, text=True).stdout


def _write(root, rel, text):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _run_coverage(root, data_file, rcfile=None):
    cmd = [sys.executable, "-m", "coverage", "run", "--branch",
           "--data-file=" + data_file]
    if rcfile:
        cmd.append("--rcfile=" + rcfile)
    env = {k: v for k, v in os.environ.items() if not k.startswith("COV")}
    subprocess.run(cmd + ["driver.py"], cwd=root, check=True, env=env)


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("diffcov") / "repo")
    os.makedirs(root)
    _git(root, "init", "-q", "-b", "main")
    _write(root, "python/pkg/__init__.py", "")
    _write(root, "python/pkg/mod.py", MOD_BASE)
    _write(root, "python/pkg/old.py", "Z = 1\n")
    _write(root, "python/pkg/ren.py", REN_BASE)
    _write(root, "README.md", "base\n")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "base")
    _git(root, "checkout", "-q", "-b", "feature")
    _write(root, "python/pkg/mod.py", MOD_HEAD)
    _git(root, "rm", "-q", "python/pkg/old.py")
    _git(root, "mv", "python/pkg/ren.py", "python/pkg/renamed.py")
    _write(root, "python/pkg/renamed.py", REN_HEAD)
    _write(root, "python/pkg/never.py", NEVER)
    _write(root, "python/pkg/comments.py", COMMENTS)
    _write(root, "python/pkg/notes.md", "not python\n")
    _write(root, "tools/out_of_scope.py", "Q = 1\n")
    _write(root, "driver.py", DRIVER)
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "feature")
    _run_coverage(root, os.path.join(root, ".coverage"))
    return root


def _main(mod, argv, capsys):
    rc = mod.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _json_report(repo, capsys, *extra):
    rc, out, _ = _main(dc, ["--repo-root", repo, "--data-file",
                            os.path.join(repo, ".coverage"), "--json", *extra],
                       capsys)
    return rc, json.loads(out)


def test_parse_added_lines(repo):
    base = dc.default_base(repo)
    assert base == _git(repo, "rev-parse", "main").strip()
    added = dc.added_lines(repo, base, "HEAD")
    assert added["python/pkg/mod.py"] == list(range(3, 15))
    assert added["python/pkg/renamed.py"] == [6]  # rename: only the edit
    assert added["python/pkg/never.py"] == [1, 2, 3]
    assert "python/pkg/old.py" not in added  # deleted
    assert "python/pkg/ren.py" not in added


def test_compress_ranges():
    assert dc.compress_ranges([9, 13, 14]) == "9, 13-14"
    assert dc.compress_ranges([1, 2, 3, 5, 7, 8]) == "1-3, 5, 7-8"
    assert dc.compress_ranges([]) == ""


def test_report_values_and_exit_codes(repo, capsys):
    rc, rep = _json_report(repo, capsys)
    assert rc == 1  # 50% < 90
    files = {f["file"]: f for f in rep["files"]}
    assert set(files) == {"python/pkg/mod.py", "python/pkg/renamed.py",
                          "python/pkg/never.py", "python/pkg/comments.py"}
    m = files["python/pkg/mod.py"]
    assert (m["added_lines"], m["executable"], m["covered"]) == (12, 7, 4)
    assert m["percent"] == 57.14
    assert m["missing"] == [9, 13, 14] and m["missing_ranges"] == "9, 13-14"
    assert m["partial_branches"] == ["7->9"]
    r = files["python/pkg/renamed.py"]
    assert (r["executable"], r["covered"], r["percent"]) == (1, 1, 100.0)
    n = files["python/pkg/never.py"]
    assert (n["executable"], n["covered"], n["missing_ranges"]) == (2, 0, "2-3")
    assert n["measured_as"] is None
    assert files["python/pkg/comments.py"]["executable"] == 0
    assert rep["total"] == {"executable": 10, "covered": 5, "percent": 50.0}
    assert _json_report(repo, capsys, "--threshold", "50")[0] == 0
    assert _json_report(repo, capsys, "--threshold", "50.01")[0] == 1


def test_text_table_and_include(repo, capsys):
    rc, out, _ = _main(dc, ["--repo-root", repo, "--data-file",
                            os.path.join(repo, ".coverage"),
                            "--include", "*/mod.py"], capsys)
    assert rc == 1
    lines = out.splitlines()
    row = [l for l in lines if l.startswith("python/pkg/mod.py")][0].split()
    assert row[:4] == ["python/pkg/mod.py", "7", "4", "57.1%"]
    assert " ".join(row[4:]) == "9, 13-14"
    assert "never.py" not in out
    assert "python/pkg/mod.py: 7->9" in out
    assert "FAIL: total diff coverage 57.14%" in out
    # out-of-scope tools/ file only appears when included; it never ran
    rc, rep = _json_report(repo, capsys, "--include", "tools/*")
    assert [f["file"] for f in rep["files"]] == ["tools/out_of_scope.py"]
    assert rep["total"]["percent"] == 0.0 and rc == 1
    # nothing executable selected -> 100%, pass
    rc, rep = _json_report(repo, capsys, "--include", "*/comments.py")
    assert rc == 0 and rep["total"]["percent"] == 100.0


def test_working_tree_head_and_untracked(repo, capsys):
    # default head = working tree, which equals HEAD here
    assert _json_report(repo, capsys)[1]["total"]["executable"] == 10
    _write(repo, "python/pkg/untracked_new.py", "U = 1\n")
    try:
        rep = _json_report(repo, capsys)[1]
        assert "python/pkg/untracked_new.py" not in {f["file"] for f in rep["files"]}
        rep = _json_report(repo, capsys, "--include-untracked")[1]
        assert rep["total"] == {"executable": 11, "covered": 5, "percent": 45.45}
    finally:
        os.remove(os.path.join(repo, "python/pkg/untracked_new.py"))


def test_relative_and_foreign_paths(repo, tmp_path, capsys):
    rc_file = tmp_path / "rc"
    rc_file.write_text("[run]\nrelative_files = True\n")
    rel_data = str(tmp_path / "rel.coverage")
    _run_coverage(repo, rel_data, str(rc_file))
    import coverage
    data = coverage.CoverageData(basename=rel_data)
    data.read()
    assert all(not os.path.isabs(f) for f in data.measured_files())
    out = _main(dc, ["--repo-root", repo, "--data-file", rel_data, "--json"],
                capsys)[1]
    rep = json.loads(out)
    assert rep["total"] == {"executable": 10, "covered": 5, "percent": 50.0}
    # data recorded in another checkout (CI path): matched by suffix
    foreign = coverage.CoverageData(basename=str(tmp_path / "foreign.coverage"))
    orig = coverage.CoverageData(basename=os.path.join(repo, ".coverage"))
    orig.read()
    arcs = {}
    for f in orig.measured_files():
        rel = os.path.relpath(os.path.realpath(f), os.path.realpath(repo))
        arcs["/ci/build/src/" + rel] = orig.arcs(f)
    foreign.add_arcs(arcs)
    foreign.write()
    rc, out = _main(dc, ["--repo-root", repo, "--data-file",
                         str(tmp_path / "foreign.coverage"), "--json"], capsys)[:2]
    rep = json.loads(out)
    files = {f["file"]: f for f in rep["files"]}
    assert files["python/pkg/mod.py"]["measured_as"] == "/ci/build/src/python/pkg/mod.py"
    assert rep["total"] == {"executable": 10, "covered": 5, "percent": 50.0}


def test_errors_exit_2(repo, tmp_path, capsys):
    rc, _, err = _main(dc, ["--repo-root", repo, "--data-file",
                            str(tmp_path / "nope")], capsys)
    assert rc == 2 and "coverage data file" in err and "not found" in err
    rc, _, err = _main(dc, ["--repo-root", repo, "--data-file",
                            os.path.join(repo, ".coverage"), "--base", "no-such-ref"],
                       capsys)
    assert rc == 2 and "git diff" in err


def test_cli_subprocess(repo):
    proc = subprocess.run(
        [sys.executable, os.path.join(TOOLS, "diff_coverage.py"),
         "--threshold", "40"], cwd=repo, stdout=subprocess.PIPE, text=True)
    assert proc.returncode == 0, proc.stdout
    assert "PASS: total diff coverage 50.00%" in proc.stdout


# ------------------------------------------------------------ check_coverage
def _check(repo, capsys, *argv):
    return _main(cc, ["--repo-root", repo, "--data-file",
                      os.path.join(repo, ".coverage"), *argv], capsys)


def test_check_coverage_floors(repo, capsys):
    # mod.py whole file: 9 stmts, 6 run; 2 branches, 1 taken -> 7/11
    rc, out, err = _check(repo, capsys, "--json", "--min", "60", "*/mod.py")
    rep = json.loads(out)
    (row,) = rep["files"]
    assert (row["statements"], row["executed"], row["branches"],
            row["executed_branches"], row["percent"]) == (9, 6, 2, 1, 63.64)
    assert rc == 0
    rc, out, err = _check(repo, capsys, "--min", "60", "python/*",
                          "--min", "70", "*/mod.py")
    assert rc == 1
    assert "python/pkg/mod.py: 63.64% < floor 70.00%" in err
    assert "python/pkg/never.py: 0.00% < floor 60.00%" in err
    assert "not measured" in err
    assert "renamed.py" not in err
    # strictest floor wins; unmeasured files can be left out
    rc, out, err = _check(repo, capsys, "--min", "60", "python/*",
                          "--min", "100", "*/renamed.py", "--measured-only")
    assert rc == 0, err
    assert "renamed.py" in out and "never.py" not in out
    rc, out, err = _check(repo, capsys, "--min", "60", "python/*",
                          "--exclude", "*/never.py", "--exclude", "*/comments.py")
    assert rc == 0, err


def test_check_coverage_missing_file_and_errors(repo, tmp_path, capsys):
    rc, out, err = _check(repo, capsys, "--min", "95", "*/muon_comm_plan.py",
                          "--min", "50", "*/mod.py")
    assert rc == 1
    assert "'*/muon_comm_plan.py' matches no file" in err
    rc, _, err = _main(cc, ["--repo-root", repo, "--data-file",
                            str(tmp_path / "nope"), "--min", "1", "*"], capsys)
    assert rc == 2 and "not found" in err
