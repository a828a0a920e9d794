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
"""The docs say what is: their size limits, and figures and code kept equal to their sources.

* README.md at most 200 lines, docs/DEVELOPING.md at most 400, no line of
  README.md or docs/*.md over 400 characters;
* the README's table of ``plan --recommend`` figures is what ``plan`` prints
  for each row's layout now;
* the MoE building blocks docs/USAGE.md shows (dispatch, gradient scale) are
  runs of consecutive lines of examples/train_moe.py, so CI runs them;
* every repository path the docs name exists, and the README keeps the test
  command ``.ci/run`` runs.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import re
import textwrap
import unittest

from paddle_muon_ext.tools import cli

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(_REPO, "README.md")
USAGE = os.path.join(_REPO, "docs", "USAGE.md")
EXAMPLE = os.path.join(_REPO, "examples", "train_moe.py")
MAX_LINE = 400


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _docs() -> list:
    return [README] + sorted(glob.glob(os.path.join(_REPO, "docs", "*.md")))


def _python_blocks(text: str) -> list:
    return [block.split("```", 1)[0] for block in text.split("```python\n")[1:]]


class TestDocLimits(unittest.TestCase):
    def test_line_counts_and_line_lengths(self):
        limits = {"README.md": 200, os.path.join("docs", "DEVELOPING.md"): 400}
        for rel, most in limits.items():
            with self.subTest(doc=rel):
                lines = _read(os.path.join(_REPO, rel)).splitlines()
                self.assertLessEqual(len(lines), most, f"{rel}: {len(lines)} lines")
        for path in _docs():
            rel = os.path.relpath(path, _REPO)
            with self.subTest(doc=rel):
                long = [(i, len(line)) for i, line in enumerate(_read(path).splitlines(), 1)
                        if len(line) > MAX_LINE]
                self.assertEqual(long, [], f"{rel}: (line, characters) over {MAX_LINE}")

    def test_readme_keeps_the_command_ci_runs(self):
        ci = _read(os.path.join(_REPO, ".ci", "run"))
        self.assertIn("bash tools/run_tests.sh", ci)
        section = _read(README).split("\n## Run the tests\n", 1)[1].split("\n## ", 1)[0]
        self.assertIn("```bash\nbash tools/run_tests.sh\n```", section)


# A README row: | model | N × 8 | ep × ms | default ms | on,upstream | on,balanced | off,balanced | pick | bound | pick/bound |
_ROW = re.compile(r"^\| (\S+) \| (\d+) × 8 \| (\d+) × (\d+) \|.*\|$", re.M)


def _plan_row(model: str, nodes: int, ep: int, ms: int) -> str:
    """The README row for one layout, from ``plan --recommend --json`` run now."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(["plan", "--ep", str(ep), "--moe-sharding", str(ms), "--gpus-per-node", "8",
                       "--model", model, "--recommend", "--json"])
    assert rc == 0, rc
    rec = json.loads(out.getvalue())["recommend"]

    def ratio(on: bool, rule: str) -> str:
        (hit,) = [c["ratio_to_default"] for c in rec["candidates"]
                  if c["config"] == {"comm_group_call_opt": on, "muon_partition_strategy": rule,
                                     "comm_buffer_size_MB": 256.0}]
        return f"{hit:.3f}"

    best, default_s = rec["best"], rec["default"]["estimated_time_s"]
    cfg = best["config"]
    pick = (f'{best["ratio_to_default"]:.3f} ({"on" if cfg["comm_group_call_opt"] else "off"}, '
            f'{cfg["muon_partition_strategy"]}, {cfg["comm_buffer_size_MB"]:.0f} MB)')
    cells = [model, f"{nodes} × 8", f"{ep} × {ms}", f"{default_s * 1e3:.1f} ms",
             ratio(True, "upstream_greedy"), ratio(True, "balanced"), ratio(False, "balanced"),
             pick, f'{rec["bound_s"] / default_s:.3f}', f'{best["ratio_to_bound"]:.3f}']
    return "| " + " | ".join(cells) + " |"


class TestReadmePlanTable(unittest.TestCase):
    def test_each_row_is_what_plan_recommend_prints_now(self):
        text = _read(README)
        rows = list(_ROW.finditer(text))
        self.assertGreaterEqual(len(rows), 6, "the README's plan table lost its rows")
        for m in rows:
            model, nodes, ep, ms = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))
            with self.subTest(model=model, nodes=nodes):
                self.assertEqual(ep * ms, nodes * 8, "a row's ep × ms must fill its nodes")
                self.assertEqual(m.group(0), _plan_row(model, nodes, ep, ms))


def _runs_of_example_lines(snippet: str, example_lines: list) -> list:
    """The snippet's pieces (split at ``# ...`` lines) that are not consecutive example lines."""
    pieces, piece = [], []
    for line in snippet.splitlines():
        if line.strip().startswith("# ..."):
            pieces.append(piece)
            piece = []
        else:
            piece.append(line)
    pieces.append(piece)
    missing = []
    for piece in pieces:
        while piece and not piece[-1].strip():
            piece = piece[:-1]
        if not piece:
            continue
        want = textwrap.dedent("\n".join(piece))
        n = len(piece)
        if not any(textwrap.dedent("\n".join(example_lines[i:i + n])) == want
                   for i in range(len(example_lines) - n + 1)):
            missing.append(want)
    return missing


class TestUsageMoeBuildingBlocks(unittest.TestCase):
    def test_dispatch_and_gradient_scale_are_consecutive_lines_of_the_example(self):
        blocks = [b for b in _python_blocks(_read(USAGE)) if "class _ScaleGrad(PyLayer)" in b]
        self.assertEqual(len(blocks), 1, "docs/USAGE.md shows the building blocks once")
        block = blocks[0]
        for name in ("class _AllGather(PyLayer)", "class _ReduceScatter(PyLayer)",
                     "_AllGather.apply(h, group)", "_ReduceScatter.apply(out, group)",
                     "1.0 / ep"):
            self.assertIn(name, block)
        example = _read(EXAMPLE).splitlines()
        self.assertEqual(_runs_of_example_lines(block, example), [],
                         "docs/USAGE.md building-block lines that are not examples/train_moe.py's")

    def test_a_changed_line_is_caught(self):
        example = ["class A:", "    def f(self):", "        return 1"]
        self.assertEqual(_runs_of_example_lines("class A:\n    def f(self):\n", example), [])
        self.assertEqual(_runs_of_example_lines("# ... x\n    def f(self):\n        return 1", example), [])
        self.assertNotEqual(_runs_of_example_lines("class A:\n        return 1\n", example), [])
        self.assertNotEqual(_runs_of_example_lines("    def f(self):\n        return 2", example), [])


# A repository path in backticks or a relative link: python/paddle_muon_ext/..., tools/..., test/...
# Paths of a Paddle checkout the export docs name (they are not in this repository).
_PADDLE_SIDE = {"test/collective/fleet/testslist.csv", "test/collective/fleet/CMakeLists.txt",
                "test/collective/fleet/muon_mock/",
                "test/collective/fleet/test_muon_sharding_clear_grad.py"}
_PATH = re.compile(r"(?:`|\]\((?:\.\./)?)((?:python/paddle_muon_ext|tools|test|examples|docs)/[\w./-]+?)[`)#]")


class TestDocPathsExist(unittest.TestCase):
    def test_every_named_repository_path_exists(self):
        for path in _docs():
            rel = os.path.relpath(path, _REPO)
            names = sorted({m.group(1).rstrip(".") for m in _PATH.finditer(_read(path))})
            missing = [n for n in names if "*" not in n and "<" not in n and n not in _PADDLE_SIDE
                       and not os.path.exists(os.path.join(_REPO, n))]
            with self.subTest(doc=rel):
                self.assertEqual(missing, [], f"{rel} names paths that do not exist")


if __name__ == "__main__":
    unittest.main()
