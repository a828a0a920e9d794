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
"""Per-file coverage floors for CI (whole files, line + branch).

Every file matching a ``--min PCT GLOB`` floor must reach PCT percent
coverage, computed like coverage.py's own total with branch data:
``(executed statements + taken branches) / (statements + branches)``
(statements only when the data has no arcs).  When several floors match a
file the strictest (highest) one applies.  Globs are fnmatch patterns on
repo-relative paths (``*`` also matches ``/``).

Candidate files are the measured files inside the repo plus, unless
``--measured-only``, every git-tracked ``.py`` file: a matching file that
never ran is reported as 0% ("not measured").  A floor whose glob matches
no file at all is a failure too (a renamed/removed module must not make
its floor silently vacuous).

Usage::

    coverage run --branch -m pytest test/
    python tools/coverage/check_coverage.py \\
        --min 90 'python/paddle_muon_ext/*' \\
        --min 95 '*/muon_sharding_optimizer.py' \\
        --min 95 '*/muon_comm_plan.py' \\
        --exclude 'python/paddle_muon_ext/compat_paddle_3_3/*'

Options:
  --data-file FILE   coverage data file (default .coverage)
  --repo-root DIR    repository root (default: git toplevel of cwd)
  --min PCT GLOB     floor, repeatable (at least one required)
  --exclude GLOB     ignore matching files, repeatable
  --measured-only    do not add unmeasured tracked files
  --json             JSON instead of the table

Exit status: 0 all floors met, 1 some file below its floor or a floor
matching nothing (named on stderr), 2 usage error / missing data file.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import diff_coverage as dc  # noqa: E402


def tracked_py_files(repo_root):
    try:
        out = dc.git(repo_root, "ls-files", "-z", "--", "*.py")
    except dc.UsageError:
        return []
    return [
        p for p in out.split("\0")
        if p and os.path.isfile(os.path.join(repo_root, p))
    ]


def file_percent(ana):
    n_stmt = len(ana.statements)
    n_exec = len(ana.statements & ana.executed)
    if ana.numbers is not None and ana.has_arcs:
        num = ana.numbers
        n_br, n_br_exec = num.n_branches, num.n_executed_branches
    else:
        n_br = n_br_exec = 0
    den = n_stmt + n_br
    return {
        "statements": n_stmt,
        "executed": n_exec,
        "branches": n_br,
        "executed_branches": n_br_exec,
        "percent": dc._pct(n_exec + n_br_exec, den),
    }


def check(cov, repo_root, data_file, floors, exclude=(), measured_only=False):
    mapper = dc.PathMapper(
        cov.get_data().measured_files(),
        repo_root,
        os.path.dirname(os.path.abspath(data_file)),
    )
    measured = mapper.measured_repo_files()
    candidates = set(measured)
    if not measured_only:
        candidates.update(tracked_py_files(repo_root))
    rows = []
    glob_hits = {g: 0 for _, g in floors}
    for rel in sorted(candidates):
        if dc.matches_any(rel, exclude):
            continue
        matching = [(pct, g) for pct, g in floors if dc.matches_any(rel, [g])]
        if not matching:
            continue
        for _, g in matching:
            glob_hits[g] += 1
        floor, glob = max(matching)
        name = measured.get(rel) or mapper.lookup(rel)
        source = os.path.join(repo_root, rel)
        if not os.path.isfile(source):
            rows.append({"file": rel, "floor": floor, "glob": glob,
                         "percent": 0.0, "ok": False, "note": "source missing"})
            continue
        stats = file_percent(dc.analyze(cov, name, source))
        note = "" if name is not None else "not measured"
        ok = stats["percent"] >= floor
        rows.append(dict(stats, file=rel, floor=floor, glob=glob,
                         ok=ok, note=note))
    unmatched = [g for g, n in glob_hits.items() if n == 0]
    return rows, unmatched


def main(argv=None):
    p = argparse.ArgumentParser(description="Enforce per-file coverage floors.")
    p.add_argument("--data-file", default=".coverage")
    p.add_argument("--repo-root", default=None)
    p.add_argument("--min", nargs=2, action="append", metavar=("PCT", "GLOB"),
                   required=True)
    p.add_argument("--exclude", action="append", default=[])
    p.add_argument("--measured-only", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        floors = [(float(pct), glob) for pct, glob in args.min]
    except ValueError:
        print("check_coverage: error: --min takes PCT GLOB", file=sys.stderr)
        return dc.EXIT_ERROR
    try:
        repo_root = dc.repo_toplevel(args.repo_root or os.getcwd())
        cov = dc.load_coverage(args.data_file)
        rows, unmatched = check(cov, repo_root, args.data_file, floors,
                                args.exclude, args.measured_only)
    except dc.UsageError as exc:
        print("check_coverage: error: %s" % exc, file=sys.stderr)
        return dc.EXIT_ERROR
    failed = [r for r in rows if not r["ok"]]
    if args.json:
        print(json.dumps({"files": rows, "unmatched_globs": unmatched,
                          "passed": not failed and not unmatched},
                         indent=2, sort_keys=True))
    else:
        table = [
            [r["file"], r.get("statements", ""), r.get("branches", ""),
             "%.1f%%" % r["percent"], "%.1f%%" % r["floor"],
             "ok" if r["ok"] else "FAIL", r["note"]]
            for r in rows
        ]
        table.append(["TOTAL %d files" % len(rows), "", "", "", "",
                      "%d failed" % len(failed), ""])
        print(dc.format_table(
            table, ["File", "Stmts", "Branches", "Cover", "Floor", "Status", "Note"],
            "<>>>><<"))
    for r in failed:
        print("check_coverage: %s: %.2f%% < floor %.2f%% (%s)%s"
              % (r["file"], r["percent"], r["floor"], r["glob"],
                 " [%s]" % r["note"] if r["note"] else ""), file=sys.stderr)
    for g in unmatched:
        print("check_coverage: floor glob %r matches no file (missing or "
              "renamed?)" % g, file=sys.stderr)
    return dc.EXIT_BELOW if failed or unmatched else dc.EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
