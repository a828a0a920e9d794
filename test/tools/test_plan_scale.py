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
"""The plan tool by class of rank gives the per-rank method's figures.

``plan`` builds layouts for the first node of each stage and one
moe_sharding group per class and charges the other nodes and groups as
copies (``WorldByClass``, ``CostPath.replay_class``). The reference is the
per-rank method the tool used before (``plan_per_rank``: every rank's layout,
every group collective charged one by one). Floats are compared to a relative
1e-9: the two methods add the same byte counts in a different order (and a
copy's bytes as one product), which changes only the last bits.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys
import unittest
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import plan_per_rank  # noqa: E402

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.step_plan import (  # noqa: E402
    CommOp,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.step_plan import (
    PHASE_INTRA_NODE_REDUCE,
)
from paddle_muon_ext.tools import plan as plan_mod  # noqa: E402
from paddle_muon_ext.tools.args import MuonCommConfig  # noqa: E402
from paddle_muon_ext.tools.plan_world import group_class_key  # noqa: E402
from paddle_muon_ext.tools import cost_model  # noqa: E402
from paddle_muon_ext.tools.cost_model import AlphaBeta, CostPath  # noqa: E402
from paddle_muon_ext.tools.cost_rings import Rings  # noqa: E402
from tool_loader import load_tool  # noqa: E402

bench = load_tool(os.path.join("bench", "bench_plan_scale.py"), "_bench_plan_scale")

PIPE_FIRST = ("pipe", "moe_sharding", "expert")
EXPERT_FIRST = ("expert", "moe_sharding", "pipe")

# (layout, options): several classes per stage (cards, node patterns of the
# moe_sharding groups), pp > 1, each topology order, one-rank moe groups, and
# the options that change the schedule.
CASES = [
    (dict(ep=4, moe_sharding=2, pp=1, gpus_per_node=2), {}),
    (dict(ep=8, moe_sharding=4, pp=2, gpus_per_node=4), {}),
    (dict(ep=6, moe_sharding=4, pp=1, gpus_per_node=4), {"backend": "gloo"}),
    (dict(ep=6, moe_sharding=4, pp=1, gpus_per_node=4), {"comm_overlap": True}),
    (dict(ep=2, moe_sharding=8, pp=2, gpus_per_node=4, order=PIPE_FIRST), {"buffer_size_MB": 0}),
    (dict(ep=3, moe_sharding=4, pp=1, gpus_per_node=4, order=EXPERT_FIRST), {}),
    (dict(ep=4, moe_sharding=1, pp=1, gpus_per_node=2), {}),
    (dict(ep=16, moe_sharding=4, pp=2, gpus_per_node=8),
     {"partition_strategy": "upstream_greedy", "buffer_size_MB": 1}),
]


def assert_close(test: unittest.TestCase, got, want, path: str = "plan") -> None:
    """Same structure, equal ints and strings, floats equal to a relative 1e-9."""
    if isinstance(want, dict):
        test.assertIsInstance(got, dict, f"{path}: not a dict")
        test.assertEqual(sorted(got), sorted(want), f"{path}: keys differ")
        for key in want:
            assert_close(test, got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        test.assertIsInstance(got, list, f"{path}: not a list")
        test.assertEqual(len(got), len(want), f"{path}: {len(got)} entries, per-rank "
                         f"method has {len(want)}")
        for i, (a, b) in enumerate(zip(got, want)):
            assert_close(test, a, b, f"{path}[{i}]")
    elif isinstance(want, float) or isinstance(got, float):
        test.assertTrue(math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9),
                        f"{path}: by class {got!r}, per rank {want!r}")
    else:
        test.assertEqual(got, want, f"{path}: by class {got!r}, per rank {want!r}")


class TestPlanByClass(unittest.TestCase):
    def test_same_figures_as_the_per_rank_method(self) -> None:
        for layout, options in CASES:
            with self.subTest(**layout, **options):
                cfg = MuonCommConfig(model="tiny", **layout)
                got = plan_mod.json_ready(plan_mod.compute_plan(cfg, **options))
                with mock.patch.object(plan_mod, "_path", plan_per_rank.per_rank_path):
                    want = plan_mod.json_ready(plan_mod.compute_plan(cfg, **options))
                self.assertGreater(want["flat"]["collectives_total"], 0,
                                   "the reference charged no collective: nothing compared")
                assert_close(self, got, want)

    def test_same_figures_on_the_default_model(self) -> None:
        cfg = MuonCommConfig(ep=8, moe_sharding=4, pp=2, gpus_per_node=8)
        got = plan_mod.json_ready(plan_mod.compute_plan(cfg, compare_rules=False))
        with mock.patch.object(plan_mod, "_path", plan_per_rank.per_rank_path):
            want = plan_mod.json_ready(plan_mod.compute_plan(cfg, compare_rules=False))
        assert_close(self, got, want)

    def test_class_key_is_the_node_pattern(self) -> None:
        key = group_class_key
        # a shift by whole nodes, or onto other cards, keeps the pattern
        self.assertEqual(key((1, 5, 9), 4), key((13, 17, 21), 4),
                         "groups one node apart on every entry must share a class")
        self.assertEqual(key((0, 4, 8), 4), key((1, 5, 9), 4),
                         "groups on other cards, one rank per node, must share a class")
        # two entries share a node in one group only
        self.assertNotEqual(key((3, 4), 8), key((7, 8), 8),
                            "a group inside one node and one across two must differ")
        # same nodes, but the order of the entries within a node differs
        self.assertNotEqual(key((1, 2, 5), 4), key((2, 1, 5), 4),
                            "entries swapped within a node must not share a class")
        self.assertEqual(key((2, 10, 3), 8), ((0, 0), (1, 0), (0, 1)),
                         "key: (node number within the group, place on that node) per entry")


def _intra_reduce(node: int, gpn: int, root_card: int, numel: int) -> CommOp:
    ranks = tuple(range(node * gpn, (node + 1) * gpn))
    return CommOp("reduce_gradients", PHASE_INTRA_NODE_REDUCE, "reduce", ranks,
                  ranks[root_card], "float32", numel, None, False, numel * 4)


def _moe_reduce(group: tuple, root_index: int, numel: int) -> CommOp:
    return CommOp("reduce_gradients", "reduce_to_owner", "reduce", group, group[root_index],
                  "float32", numel, "moe_expert", True, numel * 4)


class TestReplayClass(unittest.TestCase):
    """``replay_class`` against replaying every member's ops one by one."""

    def _both(self, members, make_op, backend="nccl", world=16):
        gpn = 4
        ab = AlphaBeta()
        each = CostPath("each", world, gpn, ab, backend)
        each.replay((op, op.payload) for m in members for op in make_op(m))
        once = CostPath("once", world, gpn, ab, backend)
        once.replay_class([(op, op.payload) for op in make_op(members[0])], members)
        return each.summary(), once.summary()

    def test_nodes_charged_as_copies(self) -> None:
        gpn = 4
        members = [tuple(range(n * gpn, (n + 1) * gpn)) for n in range(4)]

        def ops(m):
            node = m[0] // gpn
            return [_intra_reduce(node, gpn, 1, 1000), _intra_reduce(node, gpn, 3, 250)]

        for backend in ("nccl", "gloo"):
            with self.subTest(backend=backend):
                want, got = self._both(members, ops, backend)
                self.assertGreater(want["intra_node_bytes"], 0, "nothing charged")
                assert_close(self, got, want, f"summary[{backend}]")

    def test_groups_across_nodes_charged_as_copies(self) -> None:
        # one rank per node: card 1, four nodes further, and card 2
        members = [(1, 5, 9, 13), (17, 21, 25, 29), (2, 6, 10, 14)]

        def ops(m):
            return [_moe_reduce(m, 2, 4096), _moe_reduce(m, 0, 100)]

        want, got = self._both(members, ops, world=32)
        self.assertGreater(want["inter_node_bytes"], 0, "nothing charged across nodes")
        assert_close(self, got, want, "summary")
        self.assertEqual(got["collectives_per_step"]["moe_sharding"], 6,
                         "two ops for each of three members")
        self.assertGreater(got["rail_bytes"][2], 0, "the card-2 copy's bytes left its own rail")

    def test_groups_with_uneven_nodes_charged_as_copies(self) -> None:
        # two ranks on one node, one on the next: two channels, and the lone
        # rank leaves its node in both (the rings' per-rank hop counts matter)
        members = [(0, 1, 4), (8, 9, 12), (2, 3, 6)]

        def ops(m):
            return [_moe_reduce(m, 1, 3000), _moe_reduce(m, 2, 500)]

        want, got = self._both(members, ops, world=16)
        self.assertGreater(want["bytes_per_rank"]["inter_node"]["max"], 0, "nothing crossed")
        assert_close(self, got, want, "summary")

    def test_a_one_rank_group_costs_nothing_and_ratios_of_zero_are_one(self) -> None:
        # a one-rank group holds its result already: no bytes, no latency
        path = CostPath("x", 8, 2, AlphaBeta())
        for what in ("reduce", "broadcast"):
            path.rooted(path.phase(what), "sharding", what, (3,), 3, 1000.0, "dense")
        summary = path.summary()
        self.assertEqual((summary["inter_node_bytes_all"], summary["intra_node_bytes_all"],
                          summary["estimated_time_s"]), (0.0, 0.0, 0.0), summary)
        # "x over nothing" reads as no change (1.0), as the docstring says
        self.assertEqual((cost_model.ratio(5.0, 0.0), cost_model.ratio(6.0, 3.0)), (1.0, 2.0))

    def test_members_of_unequal_size_are_refused(self) -> None:
        path = CostPath("x", 8, 2, AlphaBeta())
        with self.assertRaisesRegex(ValueError, "unequal size"):
            path.replay_class([], [(0, 1), (2, 3, 4)])


def listed_rings(ranks, gpn):
    """The cost model's channel rings written out: node by node, channel j
    rotating each node's ranks by j mod k + 1."""
    nodes = {}
    for r in sorted(ranks):
        nodes.setdefault(r // gpn, []).append(r)
    blocks = [nodes[n] for n in sorted(nodes)]
    rings = []
    for j in range(max(len(b) for b in blocks)):
        ring = []
        for b in blocks:
            cut = j % len(b) + 1
            ring += b[cut:] + b[:cut]
        rings.append(ring)
    return rings


class TestRings(unittest.TestCase):
    """Ring neighbours and send counts without listing the rings."""

    GROUPS = [((0, 1, 2, 3, 4, 5, 6, 7), 4), ((0, 1, 2, 5, 6, 9), 4), ((3, 4, 5, 6, 7, 8, 9), 3),
              ((0, 1, 2, 3), 4), ((2, 10, 18), 8), ((0, 1, 2, 3, 4, 6, 8, 9), 5)]

    def test_neighbours_and_sends_match_the_listed_rings(self) -> None:
        for ranks, gpn in self.GROUPS:
            rings = Rings(ranks, gpn)
            listed = listed_rings(ranks, gpn)
            self.assertEqual(rings.channels, len(listed), f"{ranks} gpn {gpn}: channel count")
            self.assertEqual(rings.ring0, listed[0], f"{ranks} gpn {gpn}: ring 0")
            sends = {r: [0, 0] for r in ranks}
            cards = [0] * gpn
            for ch, ring in enumerate(listed):
                self.assertEqual(rings.ring(ch), ring, f"{ranks} gpn {gpn}: ring {ch}")
                for i, r in enumerate(ring):
                    nxt, prv = ring[(i + 1) % len(ring)], ring[i - 1]
                    self.assertEqual(rings.next(ch, r), nxt, f"{ranks}: next of {r} in ring {ch}")
                    self.assertEqual(rings.prev(ch, r), prv, f"{ranks}: prev of {r} in ring {ch}")
                    inter = r // gpn != nxt // gpn
                    sends[r][inter] += 1
                    cards[r % gpn] += inter
            senders, by_card, n_inter, n_intra = rings.senders
            self.assertEqual({r: [a, e] for r, a, e in senders}, sends,
                             f"{ranks} gpn {gpn}: hops each rank sends (intra, inter)")
            self.assertEqual(by_card, cards, f"{ranks} gpn {gpn}: inter-node hops per card")
            self.assertEqual((n_inter, n_intra), (sum(cards), sum(a for a, _ in sends.values())))


class TestBenchPlanScale(unittest.TestCase):
    def _run(self, *argv: str):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = bench.main(list(argv))
        return rc, out.getvalue(), err.getvalue()

    def test_exponent_of_a_power_law(self) -> None:
        sizes = [256, 1024, 4096]
        self.assertAlmostEqual(bench.growth_exponent(sizes, [1e-6 * n ** 1.5 for n in sizes]),
                               1.5, places=9, msg="slope of t = c n^1.5 must be 1.5")
        self.assertIsNone(bench.growth_exponent([256], [1.0]), "one point has no slope")

    def test_json_rows_for_each_size_per_rank_only_up_to_its_max(self) -> None:
        rc, out, err = self._run("--sizes", "16", "32", "--ep", "4", "--gpus-per-node", "4",
                                 "--model", "tiny", "--per-rank-max", "16", "--in-process",
                                 "--json")
        self.assertEqual(rc, 0, err)
        fig = json.loads(out)  # stdout holds only the JSON
        self.assertEqual([r["ranks"] for r in fig["rows"]], [16, 32], "one row per size")
        self.assertIsNotNone(fig["rows"][0]["per_rank"], "16 ranks <= --per-rank-max: per rank")
        self.assertIsNone(fig["rows"][1]["per_rank"], "32 ranks > --per-rank-max: by class only")
        for row in fig["rows"]:
            by = row["by_class"]
            self.assertGreater(by["collectives"], 0, f"{row['ranks']} ranks: nothing planned")
            self.assertGreater(by["peak_rss_MiB"], 0, "peak memory not measured")

    def test_bad_sizes_are_one_error_line(self) -> None:
        rc, out, err = self._run("--sizes", "17", "--ep", "4")
        self.assertEqual(rc, 2, "a size that is not a multiple of pp x ep must exit 2")
        self.assertEqual(out, "", "nothing on stdout for an error")
        self.assertEqual(err.strip().splitlines(), [
            "error: --sizes 17: not a multiple of pp x ep = 4, pass sizes divisible by it"])

    def test_command_line_rows_time_a_child_plan_on_the_matrix_model(self) -> None:
        rc, out, err = self._run("--matrices", "24", "--shape", "64", "32", "--sizes", "16",
                                 "--ep", "8", "--gpus-per-node", "8", "--json")
        self.assertEqual(rc, 0, err)
        fig = json.loads(out)
        self.assertEqual(fig["model"], {"matrices": 24, "shape": [64, 32], "dtype": "bfloat16"})
        (row,) = fig["rows"]  # plan only: no --recommend
        self.assertEqual((row["ranks"], row["command"], row["target_s"]), (16, "plan", 10.0))
        run = row["runs"]["this tree"]
        self.assertNotIn("note", run, "the child plan failed")
        self.assertGreater(run["cpu_seconds"], 0.0, "the child's CPU time was not read")
        self.assertGreater(run["peak_rss_MiB"], 10.0, "the child's peak RSS was not read")

    def test_the_matrix_model_is_plans_model_format(self) -> None:
        import tempfile

        from paddle_muon_ext.tools.args import load_model

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "m.json")
            bench.write_matrix_model(path, 3, (8192, 8192))
            params = load_model(path)
        self.assertEqual([(p.name, p.shape, p.dtype, p.use_muon) for p in params],
                         [(f"w{i}", (8192, 8192), "bfloat16", True) for i in range(3)])

    def test_command_line_flags_need_matrices_and_a_real_revision(self) -> None:
        for argv, line in ((("--recommend",), "error: --recommend and --against time the "
                            "command line: pass --matrices N"),
                           (("--matrices", "0", "--sizes", "16", "--ep", "8"),
                            "error: --matrices 0: must be in 1..200000 (plan's model limit)")):
            rc, out, err = self._run(*argv)
            self.assertEqual((rc, out, err.strip()), (2, "", line))
        rc, out, err = self._run("--matrices", "2", "--sizes", "16", "--ep", "8", "--against",
                                 "no-such-revision")
        self.assertEqual((rc, out), (2, ""))
        self.assertTrue(err.startswith("error: --against no-such-revision: not a revision"), err)
        self.assertEqual(len(err.strip().splitlines()), 1, err)


if __name__ == "__main__":
    unittest.main()
