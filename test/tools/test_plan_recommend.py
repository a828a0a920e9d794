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
"""``plan``'s default / bound ratios and ``plan --recommend`` (``tools.recommend``).

Each candidate's time is checked against a separate ``compute_plan`` run of
that configuration (not against the recommender's own cache), the pick
against the minimum taken here, and the CLI's JSON against the shape the
issue names.
"""

from __future__ import annotations

import contextlib
import io
import json
import unittest

from paddle_muon_ext.tools import cli, recommend
from paddle_muon_ext.tools.args import MuonCommConfig
from paddle_muon_ext.tools.cost_model import AlphaBeta
from paddle_muon_ext.tools.plan import FLAT_RULES, PARTITION_RULES, compute_plan
from paddle_muon_ext.tools.presets import ParamSpec, get_preset

DEFAULT_RULE = "upstream_greedy"


def _params():
    out = [ParamSpec("embed.weight", (64, 32), "float32", False, False)]
    for i in range(6):
        out.append(ParamSpec(f"l{i}.q.weight", (32, 32 + 8 * i), "float32", False, True))
        out.append(ParamSpec(f"l{i}.experts.0.up.weight", (32, 48), "float32", True, True))
    return out


def _run(cfg, params, buffer_mb=256.0, rule=DEFAULT_RULE, group_call=True):
    res = compute_plan(cfg, AlphaBeta(), buffer_size_MB=buffer_mb, params=params,
                       partition_strategy=rule, group_call=group_call)
    est = recommend.annotate(res, AlphaBeta())
    return res, est


CFG = MuonCommConfig(ep=2, moe_sharding=2, pp=1, gpus_per_node=2, model="tiny")


class TestRecommend(unittest.TestCase):
    def test_every_candidate_matches_its_own_plan_run(self) -> None:
        res, est = _run(CFG, _params(), buffer_mb=0.004)
        rec = recommend.recommend(res, est)
        seen = set()
        for c in rec["candidates"]:
            cfg = c["config"]
            key = (cfg["comm_group_call_opt"], cfg["muon_partition_strategy"],
                   cfg["comm_buffer_size_MB"])
            seen.add(key)
            alone = compute_plan(CFG, AlphaBeta(), buffer_size_MB=key[2], params=_params(),
                                 partition_strategy=key[1], compare_rules=False)
            want = alone["hierarchical" if key[0] else "flat"]["estimated_time_s"]
            self.assertAlmostEqual(c["estimated_time_s"], want, delta=want * 1e-12, msg=key)
        # on/off x every rule x 64/256/1024 MB and the run's own 0.004 MB; rail
        # (two nodes here) on the hierarchical path only: on the flat one it is balanced
        self.assertNotIn("rail", FLAT_RULES)
        self.assertIn("rail", PARTITION_RULES)
        self.assertEqual(seen, {(g, r, b) for g in (False, True)
                                for r in (PARTITION_RULES if g else FLAT_RULES)
                                for b in (0.004, 64.0, 256.0, 1024.0)})

    def test_pick_is_the_fastest_and_ratios_divide_by_default_and_bound(self) -> None:
        res, est = _run(CFG, _params(), buffer_mb=0.004)
        rec = recommend.recommend(res, est)
        default = rec["candidates"][0]
        self.assertEqual(default["config"], {"comm_group_call_opt": False,
                                             "muon_partition_strategy": DEFAULT_RULE,
                                             "comm_buffer_size_MB": 256.0})
        self.assertEqual(rec["default"]["config"], default["config"])
        t0, b = default["estimated_time_s"], rec["bound_s"]
        fastest = min(c["estimated_time_s"] for c in rec["candidates"])
        self.assertEqual(rec["best"]["estimated_time_s"], fastest)
        self.assertLessEqual(rec["best"]["estimated_time_s"], t0)
        for c in rec["candidates"]:
            self.assertAlmostEqual(c["ratio_to_default"], c["estimated_time_s"] / t0, places=12)
            self.assertAlmostEqual(c["ratio_to_bound"], c["estimated_time_s"] / b, places=12)

    def test_ties_keep_the_default(self) -> None:
        res, est = _run(CFG, _params())
        est.times = {k: 1.0 for k in est.times}
        est.time = lambda key: 1.0  # every candidate as fast as the default
        rec = recommend.recommend(res, est)
        self.assertEqual(rec["best"]["config"], rec["default"]["config"])
        self.assertIn("nothing beats the default", rec["why"])

    def test_a_single_node_layout_only_has_flat_candidates(self) -> None:
        one_node = MuonCommConfig(ep=2, moe_sharding=2, pp=1, gpus_per_node=4, model="tiny")
        res, est = _run(one_node, _params(), group_call=False)
        rec = recommend.recommend(res, est)
        self.assertEqual(len(rec["candidates"]), len(FLAT_RULES) * 3)
        self.assertFalse(any(c["config"]["comm_group_call_opt"] for c in rec["candidates"]))
        self.assertFalse(any(c["config"]["muon_partition_strategy"] == "rail"
                             for c in rec["candidates"]))

    def test_no_group_call_run_still_offers_the_option(self) -> None:
        res, est = _run(CFG, _params(), group_call=False)
        rec = recommend.recommend(res, est)
        self.assertEqual(sum(c["config"]["comm_group_call_opt"] for c in rec["candidates"]),
                         len(PARTITION_RULES) * 3)

    def test_dense_heavy_at_8x8_recommends_the_option(self) -> None:
        cfg = MuonCommConfig(ep=32, moe_sharding=2, pp=1, gpus_per_node=8, model="dense-heavy")
        res, est = _run(cfg, get_preset("dense-heavy"))
        rec = recommend.recommend(res, est)
        self.assertTrue(rec["best"]["config"]["comm_group_call_opt"])
        self.assertLessEqual(rec["best"]["ratio_to_default"], 0.85)
        self.assertLessEqual(rec["best"]["ratio_to_bound"], 1.15)

    def test_pick_within_1_15_of_the_bound_with_one_rank_moe_groups_over_16_nodes(self) -> None:
        # ep 64 leaves one-rank moe_sharding groups: the step is the dense Muon
        # traffic and the element-wise rings, whose latency (every hop of a
        # 64-rank ring, once per dtype) no option removes; the bound counts it
        cfg = MuonCommConfig(ep=64, moe_sharding=1, pp=2, gpus_per_node=8,
                             model="ernie-moe-small")
        res, est = _run(cfg, get_preset("ernie-moe-small"))
        rec = recommend.recommend(res, est)
        self.assertLessEqual(rec["best"]["estimated_time_s"],
                             rec["default"]["estimated_time_s"])
        self.assertLessEqual(rec["best"]["ratio_to_bound"], 1.15)
        for c in rec["candidates"]:
            self.assertGreaterEqual(c["ratio_to_bound"], 1.0 - 1e-12, c["config"])

    def test_large_moe_preset_is_the_21b_shape(self) -> None:
        # 28 layers: 4 attention matrices each (112); layer 0's dense MLP (3);
        # 27 MoE layers of a router gate, 64 experts x 3 and 2 shared experts
        # fused into 3 matrices (27 x 196 = 5292): 5407 Muon matrices, 5184 experts
        params = get_preset("ernie-moe-large")
        muon = [p for p in params if p.use_muon]
        self.assertEqual((len(muon), sum(p.is_expert for p in muon)), (5407, 5184))
        self.assertEqual({p.shape for p in muon if p.is_expert}, {(2560, 1536), (1536, 2560)})
        shared = [p for p in muon if "shared_experts" in p.name]
        self.assertEqual({p.shape for p in shared}, {(2560, 3072), (3072, 2560)})

    def test_default_is_reported_for_a_non_default_run(self) -> None:
        res, _ = _run(CFG, _params(), buffer_mb=1024.0, rule="balanced")
        alone = compute_plan(CFG, AlphaBeta(), params=_params(), compare_rules=False)
        vs = res["vs_default"]
        self.assertAlmostEqual(vs["default"]["estimated_time_s"],
                               alone["flat"]["estimated_time_s"], places=15)
        configs = [r["config"] for r in vs["configurations"]]
        self.assertIn(recommend.config(True, "balanced", 1024.0), configs)
        self.assertIn(recommend.config(False, DEFAULT_RULE, 256.0), configs)


def _cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


BASE = ["plan", "--ep", "2", "--moe-sharding", "2", "--gpus-per-node", "2", "--model", "tiny"]


class TestPlanCli(unittest.TestCase):
    def test_recommend_json_has_the_recommend_object(self) -> None:
        rc, out, err = _cli(BASE + ["--recommend", "--json"])
        self.assertEqual(rc, 0, err)
        res = json.loads(out)
        rec = res["recommend"]
        self.assertEqual(set(rec["best"]), {"config", "estimated_time_s", "ratio_to_default",
                                            "ratio_to_bound"})
        self.assertEqual(set(rec["best"]["config"]), {"comm_group_call_opt",
                                                      "muon_partition_strategy",
                                                      "comm_buffer_size_MB"})
        self.assertEqual(set(rec["default"]), {"config", "estimated_time_s"})
        self.assertLessEqual(rec["best"]["estimated_time_s"], rec["default"]["estimated_time_s"])
        self.assertGreater(rec["bound_s"], 0)
        # flat: upstream_greedy, balanced; hierarchical (two nodes): and rail
        self.assertEqual(len(rec["candidates"]), (len(FLAT_RULES) + len(PARTITION_RULES)) * 3)

    def test_every_plan_output_has_the_default_and_ratios(self) -> None:
        rc, out, _ = _cli(BASE + ["--json"])
        self.assertEqual(rc, 0)
        res = json.loads(out)
        self.assertNotIn("recommend", res)
        vs = res["vs_default"]
        t0 = vs["default"]["estimated_time_s"]
        self.assertAlmostEqual(t0, res["flat"]["estimated_time_s"], places=15)
        rows = {json.dumps(r["config"], sort_keys=True): r for r in vs["configurations"]}
        hier = rows[json.dumps(recommend.config(True, DEFAULT_RULE, 256.0), sort_keys=True)]
        self.assertAlmostEqual(hier["ratio_to_default"],
                               res["hierarchical"]["estimated_time_s"] / t0, places=12)
        rc, text, _ = _cli(BASE)
        self.assertEqual(rc, 0)
        self.assertIn("default (comm_group_call_opt off, upstream_greedy owners, 256 MB "
                      "buffers)", text)
        self.assertIn("x bound", text)
        self.assertNotIn("recommended:", text)

    def test_recommend_text_names_the_pick_and_why(self) -> None:
        rc, text, _ = _cli(BASE + ["--recommend"])
        self.assertEqual(rc, 0)
        self.assertRegex(text, r"recommended: comm_group_call_opt (on|off), \w+ owners, "
                         r"[\d.]+ MB buffers: .* = [\d.]+x default, [\d.]+x bound")
        self.assertIn("  why: ", text)


    def test_recommend_prints_the_sharding_configs_that_select_the_pick(self) -> None:
        import ast
        import os
        import subprocess
        import sys

        rc, out, err = _cli(BASE + ["--recommend", "--json"])
        self.assertEqual(rc, 0, err)
        rec = json.loads(out)["recommend"]
        rc, text, _ = _cli(BASE + ["--recommend"])
        self.assertEqual(rc, 0)
        lines = text.split('in strategy.hybrid_configs["sharding_configs"]:\n', 1)[1]
        pasted = ast.literal_eval("{" + lines + "}")  # the printed lines, as pasted
        self.assertEqual(pasted, rec["sharding_configs"])
        best = rec["best"]["config"]
        self.assertEqual(pasted, {"comm_group_call_opt": best["comm_group_call_opt"],
                                  "muon_partition_strategy": best["muon_partition_strategy"],
                                  "comm_buffer_size_MB": int(best["comm_buffer_size_MB"])})
        # a strategy given those lines holds the pick (a fresh process: patch_paddle)
        code = ("import json, sys, paddle_muon_ext\n"
                "paddle_muon_ext.patch_paddle()\n"
                "from paddle.distributed import fleet\n"
                "s = fleet.DistributedStrategy()\n"
                "s.hybrid_configs = {'sharding_degree': 1, 'sharding_configs': "
                "json.loads(sys.argv[1])}\n"
                "o = paddle_muon_ext.get_muon_sharding_options(s)\n"
                "print(json.dumps([o.comm_group_call_opt, o.muon_partition_strategy, "
                "s.hybrid_configs['sharding_configs'].comm_buffer_size_MB]))\n")
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(pasted)], env=env,
                              capture_output=True, text=True, timeout=300)
        self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
        self.assertEqual(json.loads(proc.stdout.strip().splitlines()[-1]),
                         [best["comm_group_call_opt"], best["muon_partition_strategy"],
                          int(best["comm_buffer_size_MB"])])


class TestRecommendSweepBench(unittest.TestCase):
    """tools/bench/bench_recommend.py: the sweep's checks and its exit codes."""

    @classmethod
    def setUpClass(cls) -> None:
        import os
        import sys

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from tool_loader import load_tool

        cls.bench = load_tool(os.path.join("bench", "bench_recommend.py"), "_bench_recommend")

    def _run(self, *argv: str):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = self.bench.main(list(argv))
        return rc, out.getvalue(), err.getvalue()

    def test_a_small_sweep_holds_every_check(self) -> None:
        rc, out, err = self._run("--models", "tiny", "--nodes", "2", "--ep", "2", "4",
                                 "--pp", "1", "--gpus-per-node", "2", "--buffers", "256",
                                 "--partition", "upstream_greedy", "--json")
        fig = json.loads(out)
        self.assertEqual(fig["runs"], 2, "ep 2 and ep 4 over 2 nodes of 2 cards")
        self.assertEqual((rc, fig["failures"]), (0, []), err)
        self.assertLessEqual(fig["worst_ratio_to_bound"]["ratio_to_bound"], 1.15)

    def test_a_pick_past_the_bound_target_fails_the_sweep(self) -> None:
        from unittest import mock

        with mock.patch.object(self.bench, "TARGET_RATIO_TO_BOUND", 0.5):
            rc, out, _ = self._run("--models", "tiny", "--nodes", "2", "--ep", "2",
                                   "--pp", "1", "--gpus-per-node", "2", "--buffers", "256",
                                   "--partition", "balanced")
        self.assertEqual(rc, 1)
        self.assertIn("FAIL tiny 2x2 ep 2 pp 1 buffer 256 MB balanced: the pick is", out)

    def test_bad_input_is_one_error_line(self) -> None:
        rc, out, err = self._run("--models", "no-such-model")
        self.assertEqual((rc, out), (2, ""))
        self.assertTrue(err.startswith("error: --models no-such-model: not a preset"), err)
        self.assertEqual(len(err.strip().splitlines()), 1)


if __name__ == "__main__":
    unittest.main()
