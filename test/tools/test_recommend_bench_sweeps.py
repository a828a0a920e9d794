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
"""tools/bench/bench_recommend.py's sweeps: one per backend x overlap x
constants, each with its worst pick / bound, and bad sweep names refused."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tool_loader import load_tool  # noqa: E402

bench = load_tool(os.path.join("bench", "bench_recommend.py"), "_bench_recommend_sweeps")

TINY = ("--models", "tiny", "--nodes", "2", "--ep", "2", "--pp", "1", "--gpus-per-node", "2",
        "--buffers", "256", "--partition", "upstream_greedy")


def _run(*argv: str):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = bench.main(list(argv))
    return rc, out.getvalue(), err.getvalue()


class TestBenchRecommendSweeps(unittest.TestCase):
    def test_one_sweep_per_backend_overlap_and_constants(self) -> None:
        rc, out, err = _run(*TINY, "--backends", "nccl", "gloo", "--overlap", "off", "on",
                            "--constants", "default", "slow-nvlink", "--json")
        fig = json.loads(out)
        self.assertEqual((rc, fig["failures"]), (0, []), err)
        got = [(s["backend"], s["comm_overlap"], s["constants"]) for s in fig["sweeps"]]
        self.assertEqual(got, [(b, o, c) for b in ("nccl", "gloo") for o in (False, True)
                               for c in ("default", "slow-nvlink")])
        self.assertEqual(fig["runs"], 8)
        for s in fig["sweeps"]:
            self.assertEqual(s["runs"], 1)
            self.assertLessEqual(s["worst_ratio_to_bound"]["ratio_to_bound"], 1.15)
        # each sweep ran on its own backend and constants: different ratios
        rows = {(r["backend"], r["comm_overlap"], r["constants"]): r for r in fig["rows"]}
        self.assertEqual(len(rows), 8)
        ratios = {k[0::2]: r["ratio_to_default"] for k, r in rows.items() if not k[1]}
        self.assertEqual(len(set(ratios.values())), 4, ratios)

    def test_the_summary_names_each_sweeps_worst(self) -> None:
        rc, out, _ = _run(*TINY, "--backends", "gloo", "--constants", "large-alpha")
        self.assertEqual(rc, 0)
        self.assertIn("gloo, overlap off, large-alpha constants: 1 runs, worst pick / bound",
                      out)

    def test_unknown_backend_or_constants_is_one_error_line(self) -> None:
        for argv in (("--backends", "mpi"), ("--constants", "warp-speed"),
                     ("--overlap", "maybe")):
            with self.subTest(argv=argv):
                rc, out, err = _run(*TINY, *argv)
                self.assertEqual((rc, out), (2, ""))
                self.assertEqual(len(err.strip().splitlines()), 1, err)
                self.assertTrue(err.startswith("error: "), err)


if __name__ == "__main__":
    unittest.main()
