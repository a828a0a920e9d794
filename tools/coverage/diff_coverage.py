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
"""Paddle-style diff coverage for Python: coverage of the lines ADDED in a
git range.

Lines added between ``--base`` and ``--head`` (``git diff --unified=0 -M``)
are intersected with coverage.py data (line and branch).  An added line is
*covered* when it was executed; added lines that are not executable
(comments, blank lines, docstring continuation, excluded code) are ignored.
Branches that start on an added line and were only partially taken are
listed per file.  Exit status: 0 when the total is >= ``--threshold``
(or there is nothing executable to cover), 1 when it is below, 2 on usage
errors (no coverage data file, bad git ref, ...).

Usage::

    # run the tests with line+branch coverage first
    coverage run --branch -m pytest test/
    # diff against merge-base(HEAD, main|origin/main|master), working tree
    python tools/coverage/diff_coverage.py
    # explicit range, stricter threshold, only some files, JSON output
    python tools/coverage/diff_coverage.py --base origin/main --head HEAD \\
        --threshold 95 --include 'python/paddle_muon_ext/*' --json
    # data produced elsewhere (CI), repo not in cwd
    python tools/coverage/diff_coverage.py --repo-root /src/ext \\
        --data-file /tmp/cov/.coverage

Options:
  --repo-root DIR     git work tree (default: cwd's toplevel)
  --base REF          default: merge-base of HEAD with main / origin/main /
                      master (first that exists)
  --head REF          default: the working tree (uncommitted edits count)
  --data-file FILE    coverage.py data file (default: .coverage in cwd)
  --include GLOB      fnmatch glob on repo-relative paths, repeatable
                      (default: python/*); ``*`` also matches ``/``
  --exclude GLOB      drop matching files, repeatable
  --threshold PCT     minimum total percentage (default 90)
  --include-untracked with the working tree as head, count every line of
                      untracked (not ignored) .py files as added
  --json              print a JSON report instead of the table

Paths in the coverage data may be absolute (default coverage.py) or
relative (``relative_files = true``, resolved against the data file's
directory, then the repo root); data recorded in another checkout is
matched by the longest unique path suffix.  Executable lines are taken from
the source on disk, so with ``--head REF`` check out REF first.
A changed file that never ran at all counts all its executable added lines
as missing.  Renamed files are reported under their new name with only the
lines that changed; deleted files and non-.py files are skipped.

``tools/coverage/check_coverage.py`` (same directory) enforces per-file
floors on whole files; it reuses the helpers below.
"""

import argparse
import fnmatch
import json
import os
import re
import subprocess
import sys

EXIT_OK = 0
EXIT_BELOW = 1
EXIT_ERROR = 2

DEFAULT_INCLUDE = ("python/*",)
MAIN_BRANCH_CANDIDATES = ("main", "origin/main", "master")

_HUNK_RE = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@")


class UsageError(Exception):
    """Raised for conditions that end the tool with exit status 2."""


# --------------------------------------------------------------------- git
def git(repo_root, *args):
    proc = subprocess.run(
        ["git", "-C", repo_root, "-c", "core.quotePath=false", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if proc.returncode != 0:
        raise UsageError(
            "git %s failed: %s" % (" ".join(args), proc.stderr.strip())
        )
    return proc.stdout


def repo_toplevel(path):
    return os.path.realpath(git(path, "rev-parse", "--show-toplevel").strip())


def default_base(repo_root):
    for cand in MAIN_BRANCH_CANDIDATES:
        try:
            git(repo_root, "rev-parse", "--verify", "--quiet", cand + "^{commit}")
        except UsageError:
            continue
        return git(repo_root, "merge-base", "HEAD", cand).strip()
    raise UsageError(
        "no --base given and none of %s exists" % ", ".join(MAIN_BRANCH_CANDIDATES)
    )


def _unquote_git_path(path):
    """Undo git's C-style quoting of unusual path names."""
    if len(path) >= 2 and path[0] == '"' and path[-1] == '"':
        raw = path[1:-1].encode("latin-1", "backslashreplace").decode(
            "unicode_escape"
        )
        return raw.encode("latin-1").decode("utf-8", "replace")
    return path


def parse_unified0_diff(text):
    """Map new-side path -> sorted list of added line numbers.

    Deleted files are omitted; renamed files appear under the new path with
    only the lines added by the edit (a pure rename adds nothing); files
    with no added lines (pure deletions, mode changes, binaries) map to an
    empty list.
    """
    added = {}
    current = None
    next_line = None
    for line in text.splitlines():
        if line.startswith("diff --git "):
            current = None
            next_line = None
            continue
        if line.startswith("+++ "):
            target = line[4:].rstrip("\t")
            if target == "/dev/null":
                current = None
            else:
                target = _unquote_git_path(target)
                current = target[2:] if target.startswith("b/") else target
                added.setdefault(current, [])
            continue
        if line.startswith("rename to ") and current is None:
            # header-only rename: record it so callers see the file
            added.setdefault(_unquote_git_path(line[len("rename to "):]), [])
            continue
        m = _HUNK_RE.match(line)
        if m:
            next_line = int(m.group(1))
            continue
        if current is None or next_line is None:
            continue
        if line.startswith("+"):
            added[current].append(next_line)
            next_line += 1
        elif line.startswith(" "):  # context (only with -U>0)
            next_line += 1
    return {k: sorted(set(v)) for k, v in added.items()}


def added_lines(repo_root, base, head=None, include_untracked=False):
    args = [
        "diff",
        "--unified=0",
        "-M",
        "--no-color",
        "--no-ext-diff",
        "--src-prefix=a/",
        "--dst-prefix=b/",
        base,
    ]
    if head:
        args.append(head)
    args.append("--")
    result = parse_unified0_diff(git(repo_root, *args))
    if include_untracked and not head:
        out = git(repo_root, "ls-files", "-z", "--others", "--exclude-standard")
        for rel in filter(None, out.split("\0")):
            path = os.path.join(repo_root, rel)
            try:
                with open(path, "rb") as f:
                    n = len(f.read().splitlines())
            except OSError:
                continue
            result[rel] = list(range(1, n + 1))
    return result


# ---------------------------------------------------------------- coverage
def matches_any(path, globs):
    return any(fnmatch.fnmatchcase(path, g) for g in globs)


def compress_ranges(numbers):
    """[1, 2, 3, 5, 7, 8] -> '1-3, 5, 7-8'."""
    parts = []
    nums = sorted(set(numbers))
    i = 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        parts.append(str(nums[i]) if i == j else "%d-%d" % (nums[i], nums[j]))
        i = j + 1
    return ", ".join(parts)


def format_arc(src, dst):
    return "%d->%s" % (src, "exit" if dst < 0 else dst)


def load_coverage(data_file):
    """Return a loaded ``coverage.Coverage`` or raise UsageError."""
    import coverage

    data_file = os.path.abspath(data_file)
    if not os.path.isfile(data_file):
        raise UsageError(
            "coverage data file %s not found (run e.g. "
            "'coverage run --branch -m pytest' first, or pass --data-file)"
            % data_file
        )
    cov = coverage.Coverage(data_file=data_file, config_file=False)
    cov.load()
    if not cov.get_data().measured_files():
        raise UsageError("coverage data file %s has no measured files" % data_file)
    return cov


class PathMapper:
    """Maps repo-relative paths to the file names stored in coverage data."""

    def __init__(self, measured_files, repo_root, data_dir):
        self.repo_root = os.path.realpath(repo_root)
        self.by_rel = {}
        self.outside = []
        for measured in measured_files:
            rel = self._to_repo_rel(measured, data_dir)
            if rel is not None:
                self.by_rel.setdefault(rel, measured)
            else:
                self.outside.append(measured)

    def _to_repo_rel(self, measured, data_dir):
        if os.path.isabs(measured):
            candidates = [measured]
        else:
            candidates = [
                os.path.join(data_dir, measured),
                os.path.join(self.repo_root, measured),
            ]
        for cand in candidates:
            real = os.path.realpath(cand)
            rel = os.path.relpath(real, self.repo_root)
            if not rel.startswith(os.pardir + os.sep) and rel != os.pardir:
                if os.path.exists(real) or not os.path.isabs(measured):
                    return rel.replace(os.sep, "/")
        return None

    def lookup(self, rel):
        """Measured file name for repo-relative ``rel`` (or None)."""
        if rel in self.by_rel:
            return self.by_rel[rel]
        suffix = "/" + rel
        hits = [
            m for m in self.outside if m.replace(os.sep, "/").endswith(suffix)
        ]
        return hits[0] if len(hits) == 1 else None

    def measured_repo_files(self):
        return dict(self.by_rel)


class FileAnalysis:
    """Statements / executed lines / branch arcs of one source file."""

    def __init__(self, statements, executed, missing_arcs, has_arcs, numbers):
        self.statements = set(statements)
        self.executed = set(executed)
        self.missing_arcs = missing_arcs  # {src_line: [dst, ...]}
        self.has_arcs = has_arcs
        self.numbers = numbers  # coverage.results.Numbers or None


def analyze(cov, measured, source_path):
    """Analyze ``source_path`` with the lines recorded for ``measured``.

    ``measured`` may be None (file never ran: everything is missing) or a
    name that does not exist on disk (data from another checkout); the
    source on disk is parsed in both cases.
    """
    data = cov.get_data()
    has_arcs = data.has_arcs()
    if measured is not None and os.path.exists(measured):
        target = measured
    else:
        target = source_path
    try:
        ana = cov._analyze(target)  # pylint: disable=protected-access
        statements = set(ana.statements)
        executed = set(ana.executed)
        if measured is not None and target != measured:
            executed = set(data.lines(measured) or ()) & statements
            if has_arcs:
                # recompute with the foreign arcs: fall back to line info
                return FileAnalysis(statements, executed, {}, has_arcs, None)
        missing_arcs = ana.missing_branch_arcs() if ana.has_arcs else {}
        return FileAnalysis(statements, executed, missing_arcs, has_arcs, ana.numbers)
    except AttributeError:
        # very old coverage without _analyze: public API, no branches
        _, statements, _, missing, _ = cov.analysis2(target)
        executed = set(statements) - set(missing)
        return FileAnalysis(statements, executed, {}, False, None)


# ----------------------------------------------------------------- report
def compute_diff_coverage(cov, repo_root, data_file, added, include, exclude=()):
    mapper = PathMapper(
        cov.get_data().measured_files(),
        repo_root,
        os.path.dirname(os.path.abspath(data_file)),
    )
    files = []
    skipped = []
    for rel in sorted(added):
        if not rel.endswith(".py"):
            continue
        if not matches_any(rel, include) or matches_any(rel, exclude):
            continue
        source = os.path.join(repo_root, rel)
        if not os.path.isfile(source):
            skipped.append({"file": rel, "reason": "not on disk"})
            continue
        lines = set(added[rel])
        measured = mapper.lookup(rel)
        try:
            ana = analyze(cov, measured, source)
        except Exception as exc:  # unparsable source etc.
            skipped.append({"file": rel, "reason": "cannot analyze: %s" % exc})
            continue
        executable = sorted(lines & ana.statements)
        covered = sorted(set(executable) & ana.executed)
        missing = sorted(set(executable) - set(covered))
        partial = {
            src: sorted(dsts)
            for src, dsts in sorted(ana.missing_arcs.items())
            if src in lines and src in ana.executed
        }
        files.append(
            {
                "file": rel,
                "measured_as": measured,
                "added_lines": len(lines),
                "executable": len(executable),
                "covered": len(covered),
                "percent": _pct(len(covered), len(executable)),
                "missing": missing,
                "missing_ranges": compress_ranges(missing),
                "partial_branches": [
                    format_arc(s, d) for s, dsts in partial.items() for d in dsts
                ],
            }
        )
    total_exec = sum(f["executable"] for f in files)
    total_cov = sum(f["covered"] for f in files)
    return {
        "files": files,
        "skipped": skipped,
        "total": {
            "executable": total_exec,
            "covered": total_cov,
            "percent": _pct(total_cov, total_exec),
        },
    }


def _pct(num, den):
    return 100.0 if den == 0 else round(100.0 * num / den, 2)


def format_table(rows, headers, aligns):
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(str(c))) for w, c in zip(widths, row)]
    def fmt(row):
        cells = []
        for c, w, a in zip(row, widths, aligns):
            c = str(c)
            cells.append(c.ljust(w) if a == "<" else c.rjust(w))
        return "  ".join(cells).rstrip()
    sep = "-" * len(fmt(["-" * w for w in widths]))
    lines = [fmt(headers), sep]
    lines += [fmt(r) for r in rows[:-1]] if rows else []
    if rows:
        lines += [sep, fmt(rows[-1])]
    return "\n".join(lines)


def render_text(report, threshold, base, head):
    out = ["Diff coverage of lines added in %s..%s" % (base, head or "working tree")]
    rows = [
        [f["file"], f["executable"], f["covered"], "%.1f%%" % f["percent"],
         f["missing_ranges"]]
        for f in report["files"]
        if f["executable"]
    ]
    t = report["total"]
    rows.append(["TOTAL", t["executable"], t["covered"], "%.1f%%" % t["percent"], ""])
    out.append(
        format_table(rows, ["File", "Added", "Covered", "Cover", "Missing"],
                     "<>>><")
    )
    no_exec = [f["file"] for f in report["files"] if not f["executable"]]
    if no_exec:
        out.append("Files with no executable added lines: " + ", ".join(no_exec))
    partial = [f for f in report["files"] if f["partial_branches"]]
    if partial:
        out.append("Partially covered branches on added lines:")
        for f in partial:
            out.append("  %s: %s" % (f["file"], ", ".join(f["partial_branches"])))
    for s in report["skipped"]:
        out.append("Skipped %s (%s)" % (s["file"], s["reason"]))
    verdict = "PASS" if t["percent"] >= threshold else "FAIL"
    out.append(
        "%s: total diff coverage %.2f%% (threshold %.2f%%)"
        % (verdict, t["percent"], threshold)
    )
    return "\n".join(out)


def build_parser():
    p = argparse.ArgumentParser(
        description="Coverage of Python lines added in a git range."
    )
    p.add_argument("--repo-root", default=None)
    p.add_argument("--base", default=None)
    p.add_argument("--head", default=None)
    p.add_argument("--data-file", default=".coverage")
    p.add_argument("--include", action="append", default=None)
    p.add_argument("--exclude", action="append", default=[])
    p.add_argument("--threshold", type=float, default=90.0)
    p.add_argument("--include-untracked", action="store_true")
    p.add_argument("--json", action="store_true")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        repo_root = repo_toplevel(args.repo_root or os.getcwd())
        cov = load_coverage(args.data_file)
        base = args.base or default_base(repo_root)
        if args.head:
            git(repo_root, "rev-parse", "--verify", args.head + "^{commit}")
        added = added_lines(repo_root, base, args.head, args.include_untracked)
        report = compute_diff_coverage(
            cov, repo_root, args.data_file, added,
            args.include or list(DEFAULT_INCLUDE), args.exclude,
        )
    except UsageError as exc:
        print("diff_coverage: error: %s" % exc, file=sys.stderr)
        return EXIT_ERROR
    passed = report["total"]["percent"] >= args.threshold
    if args.json:
        report.update(
            {"base": base, "head": args.head, "threshold": args.threshold,
             "passed": passed}
        )
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print(render_text(report, args.threshold, base, args.head))
    return EXIT_OK if passed else EXIT_BELOW


if __name__ == "__main__":
    sys.exit(main())
