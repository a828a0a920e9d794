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
"""tools/bench/bench_vs_develop.py without a develop checkout.

The bench's core runs ours against ours on a tiny layout (identical
implementations: every schedule ratio is exactly 1.0); its trace pricing is
checked against alpha-beta sums worked out by hand; its arguments are
refused with one ``error:`` line and exit 2 before paddle is imported.
Timings are never asserted.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import unittest

from tool_loader import REPO_ROOT, load_tool

from mock.comm_record import CommRecord

BENCH = os.path.join(REPO_ROOT, "tools", "bench", "bench_vs_develop.py")


def _bench():
    return load_tool(os.path.join("bench", "bench_vs_develop.py"), "_bench_vs_develop")


def _rec(rank, seq, op, ranks, root=None, numel=1000, block=None, gid=None):
    return CommRecord(rank_seq=seq, group_seq=seq, rank=rank, op=op,
                      group_id=gid if gid is not None else hash(ranks) % 1000 + 1,
                      group_ranks=tuple(ranks), root=root, dtype="float32", numel=numel,
                      block=block)


class TestPriceTraceByHand(unittest.TestCase):
    """4 ranks, 2 per node; S = 4,000 bytes (1,000 float32)."""

    S = 4000.0

    def setUp(self) -> None:
        from paddle_muon_ext.tools.cost_model import AlphaBeta

        self.ab = AlphaBeta()

    def test_cross_node_reduce_then_node_broadcast(self) -> None:
        # ranks 0 and 2 (two nodes) reduce onto 0, then 0 broadcasts to 1 (its
        # node); rank 3 idles. 2 -> 0 is one network hop, 0 -> 1 one NVLink hop,
        # and the broadcast waits for rank 0's reduce.
        trace = [[_rec(0, 0, "reduce", (0, 2), root=0), _rec(0, 1, "broadcast", (0, 1), root=0)],
                 [_rec(1, 1, "broadcast", (0, 1), root=0)],
                 [_rec(2, 0, "reduce", (0, 2), root=0)],
                 []]
        got = _bench().price_trace(trace, world=4, gpn=2, ab=self.ab)
        ab, S = self.ab, self.S
        self.assertEqual((got["collectives"], got["launches"]), (2, 2))
        self.assertEqual(got["by_op"], {"broadcast": 1, "reduce": 1})
        self.assertEqual((got["inter_bytes"], got["intra_bytes"]), (S, S))
        want = ab.alpha_net + S * ab.beta_net + ab.alpha_nvlink + S * ab.beta_nvlink
        self.assertTrue(math.isclose(got["time_s"], want, rel_tol=1e-12), (got, want))

    def test_disjoint_groups_run_concurrently(self) -> None:
        # (0, 2) and (1, 3) reduce at the same time: one op's time, twice the bytes
        trace = [[_rec(0, 0, "reduce", (0, 2), root=0)], [_rec(1, 0, "reduce", (1, 3), root=1)],
                 [_rec(2, 0, "reduce", (0, 2), root=0)], [_rec(3, 0, "reduce", (1, 3), root=1)]]
        got = _bench().price_trace(trace, world=4, gpn=2, ab=self.ab)
        self.assertEqual(got["inter_bytes"], 2 * self.S)
        self.assertTrue(math.isclose(got["time_s"], self.ab.alpha_net + self.S * self.ab.beta_net,
                                     rel_tol=1e-12))

    def test_a_coalescing_block_pays_one_latency(self) -> None:
        def trace(block):
            return [[_rec(r, k, "reduce", (0, 2), root=0, block=block) for k in range(2)]
                    if r in (0, 2) else [] for r in range(4)]

        ab, S = self.ab, self.S
        apart = _bench().price_trace(trace(None), world=4, gpn=2, ab=ab)
        together = _bench().price_trace(trace((7, 0)), world=4, gpn=2, ab=ab)
        self.assertEqual((apart["launches"], together["launches"]), (2, 1))
        self.assertTrue(math.isclose(apart["time_s"], 2 * (ab.alpha_net + S * ab.beta_net),
                                     rel_tol=1e-12))
        self.assertTrue(math.isclose(together["time_s"], ab.alpha_net + 2 * S * ab.beta_net,
                                     rel_tol=1e-12))

    def test_sharded_collectives_price_the_whole_buffer(self) -> None:
        # a reduce-scatter record holds one rank's shard: over 2 ranks on 2
        # nodes a ring moves (p - 1) / p of the 2 x 1,000-element buffer
        trace = [[_rec(r, 0, "reduce_scatter", (0, 2), numel=1000)] if r in (0, 2) else []
                 for r in range(4)]
        got = _bench().price_trace(trace, world=4, gpn=2, ab=self.ab)
        self.assertEqual(got["inter_bytes"], 2 * self.S)  # each rank sends S across

    def test_traces_that_disagree_are_refused(self) -> None:
        trace = [[_rec(0, 0, "reduce", (0, 2), root=0)], [], [], []]
        with self.assertRaisesRegex(ValueError, "do not agree"):
            _bench().price_trace(trace, world=4, gpn=2, ab=self.ab)


class TestOursAgainstOurs(unittest.TestCase):
    def test_identical_implementations_give_ratio_one(self) -> None:
        bench = _bench()
        import importlib

        self.reduce_module = importlib.import_module("paddle.distributed.communication.reduce")
        self.avg_before = self.reduce_module.is_avg_reduce_op_supported
        self.local_size_before = os.environ.get("PADDLE_LOCAL_SIZE")
        label, cls = bench.load_implementation(bench.SELF)
        res = bench.compare([bench.TINY], (label, cls), ("ours(b)", cls), hidden=16, inner=24,
                            reps=1, warmup=0, ns_steps=1)
        self.assertEqual(res["impls"], ["ours", "ours(b)"])
        (row,) = res["layouts"]
        self.assertEqual(row["layout"]["name"], bench.TINY.name)
        a, b = (side["schedule"] for side in row["sides"])
        self.assertEqual(a, b)
        # a 2-node layout with Muon matrices moves bytes both ways and takes time
        self.assertGreater(a["collectives"], 0)
        self.assertGreater(a["inter_bytes"], 0)
        self.assertGreater(a["intra_bytes"], 0)
        self.assertGreater(a["time_s"], 0)
        for key in ("comm_time", "collectives", "launches", "intra_bytes", "inter_bytes"):
            self.assertEqual(row["ratios"][key], 1.0, key)
        for key in ("host_sum", "host_max", "host_paired"):
            self.assertTrue(math.isfinite(row["ratios"][key]) and row["ratios"][key] > 0, key)
        for side in row["sides"]:
            self.assertEqual(len(side["host_per_rank_ms"]), bench.TINY.world)
        self.assertEqual(res["worst"]["comm_time"], 1.0)
        self.assertTrue(res["comm_ok"])
        # the run's AVG answer and PADDLE_LOCAL_SIZE are its own: both restored
        self.assertIs(self.reduce_module.is_avg_reduce_op_supported, self.avg_before)
        self.assertEqual(os.environ.get("PADDLE_LOCAL_SIZE"), self.local_size_before)

    def test_json_prints_only_json(self) -> None:
        from paddle.distributed.fleet.utils.log_util import logger as fleet_logger

        level = fleet_logger.level
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            res = _bench().main(["--paddle-root", "self", "--layouts", _bench().TINY.name,
                                 "--hidden", "16", "--inner", "24", "--reps", "1",
                                 "--warmup", "0", "--ns-steps", "1", "--json"])
        printed = json.loads(out.getvalue())
        self.assertEqual(printed["worst"]["comm_time"], res["worst"]["comm_time"])
        self.assertEqual(len(printed["layouts"]), 1)
        self.assertEqual(fleet_logger.level, level, "the bench left Paddle's fleet logger quieter")


def _run_fresh(argv: list) -> subprocess.CompletedProcess:
    """The bench's __main__ in a new interpreter; stdout ends with its exit
    code and whether paddle was imported."""
    code = ("import runpy, sys\n"
            f"sys.argv = [{BENCH!r}, *{argv!r}]\n"
            "try:\n"
            f"    runpy.run_path({BENCH!r}, run_name='__main__')\n"
            "    rc = 0\n"
            "except SystemExit as e:\n"
            "    rc = e.code\n"
            "print('RC', rc, 'paddle' in sys.modules)\n")
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO_ROOT, "python")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)


class TestArguments(unittest.TestCase):
    def assert_refused(self, argv: list, words: str) -> None:
        proc = _run_fresh(argv)
        self.assertEqual(proc.stdout.split()[-3:], ["RC", "2", "False"], proc.stderr)
        lines = proc.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, proc.stderr)
        self.assertTrue(lines[0].startswith("error: "), lines[0])
        self.assertIn(words, lines[0])

    def test_bad_inputs_are_refused_before_importing_paddle(self) -> None:
        with tempfile.TemporaryDirectory() as empty:
            cases = [
                (["--paddle-root", os.path.join(empty, "nope")], "is not a directory"),
                (["--paddle-root", empty], "has no python/paddle/distributed/fleet/"),
                (["--paddle-root", "self", "--layouts", "4r-nope"], "unknown layout '4r-nope'"),
                (["--paddle-root", "self", "--reps", "0"], "--reps must be in [1, 100000]"),
                (["--paddle-root", "self", "--hidden", "x"], "--hidden must be an integer"),
                ([], "--paddle-root"),
            ]
            for argv, words in cases:
                with self.subTest(argv=argv):
                    self.assert_refused(argv, words)

    def test_help_works_anywhere(self) -> None:
        proc = subprocess.run([sys.executable, BENCH, "--help"], capture_output=True, text=True,
                              timeout=120, cwd=tempfile.gettempdir())
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertIn("--paddle-root", proc.stdout)
        self.assertIn("16r-ep8-ms2-2x8-gc-buf1MB", proc.stdout)


if __name__ == "__main__":
    unittest.main()
