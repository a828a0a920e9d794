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
"""``cluster --recommended``: the default configuration against the plan tool's pick.

Spec:

==========================  ==================================================
case                        property
==========================  ==================================================
flags                       ``--recommended`` with ``--group-call`` is one
                            ``error:`` line, exit 2, before anything runs
pick != default             the run trains two passes, the default then the
                            pick, with their three options; the table and the
                            JSON give measured / predicted bytes and step time
                            and recommended / default ratios
pick == default             one pass, a note saying so, no ratio column
comparison                  ratios are measured / predicted of the faked
                            figures; the 15 % bar on bytes holds or fails
links                       beta_net is a node's link shared by its ranks
predictions                 the recommended pass's predicted time is the
                            estimate the recommendation was made on
applied options             a rank whose optimizer read another configuration
                            than its pass asked for fails the run
real run (root only)        2 nodes x 2: both passes match the reference and
                            inter-node bytes are within 15 % of the prediction
==========================  ==================================================
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import unittest
from unittest import mock

from paddle_muon_ext.tools import cluster, cluster_compare as cc, cluster_netns as netns
from paddle_muon_ext.tools import cluster_run as crun

_UNAVAILABLE = netns.probe_capability()

DEFAULT = {"comm_group_call_opt": False, "muon_partition_strategy": "upstream_greedy",
           "comm_buffer_size_MB": 256.0}
PICK = {"comm_group_call_opt": True, "muon_partition_strategy": "balanced",
        "comm_buffer_size_MB": 64.0}


def _args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cluster.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["cluster", "--nodes", "2", "--procs-per-node", "2", "--ep", "2",
                              "--moe-sharding", "2", "--steps", "3", *extra])


def _rec(best: dict) -> dict:
    return {"default": {"config": dict(DEFAULT), "estimated_time_s": 0.4},
            "best": {"config": dict(best), "estimated_time_s": 0.25},
            "bound_s": 0.1, "candidates": [], "why": "faked"}


def _faked_result(cfg: crun.ClusterConfig, figures: dict) -> crun.ClusterResult:
    """Pass label -> (tx bytes of a timed step, seconds); step 1 is different
    on purpose: it is left out of the per-step figures."""
    result = crun.ClusterResult(cfg, status="PASS")
    for g, (tx, sec) in figures.items():
        result.steps[(g, 1)] = {"seconds": 9.0, "tx": 1.0, "rx": 0, "loss": 1.0}
        for s in (2, 3):
            result.steps[(g, s)] = {"seconds": sec, "tx": tx, "rx": 0, "loss": 1.0}
    return result


class TestRecommendedMode(unittest.TestCase):
    """The command line with the run and the recommendation faked."""

    def _main(self, rec: dict, figures: dict, predictions: dict, *extra: str):
        seen = {}

        def fake_run(cfg, keep_logs=False):
            seen["cfg"] = cfg
            return _faked_result(cfg, figures)

        out, err = io.StringIO(), io.StringIO()
        with mock.patch.object(cc, "recommend_for_cluster", return_value=rec), \
                mock.patch.object(cc, "predict", side_effect=lambda cfg, c: predictions[
                    "default" if c == DEFAULT else "recommended"]), \
                mock.patch.object(cluster, "run_cluster", side_effect=fake_run), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cluster.main(_args("--recommended", *extra))
        return code, seen.get("cfg"), out.getvalue(), err.getvalue()

    def test_recommended_with_group_call_is_one_error_line(self) -> None:
        err = io.StringIO()
        with mock.patch.object(cluster, "run_cluster") as run, \
                mock.patch.object(cc, "recommend_for_cluster") as rec, \
                contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            self.assertEqual(cluster.main(_args("--recommended", "--group-call", "1")), 2)
        run.assert_not_called()
        rec.assert_not_called()
        lines = err.getvalue().splitlines()
        self.assertEqual(len(lines), 1, lines)
        self.assertTrue(lines[0].startswith("error: --recommended"), lines)

    def test_pick_trains_default_then_pick_and_reports_ratios(self) -> None:
        predictions = {"default": {"inter_node_bytes": 5.0e6, "step_comm_time_s": 0.40},
                       "recommended": {"inter_node_bytes": 4.0e6, "step_comm_time_s": 0.25}}
        code, cfg, out, _ = self._main(_rec(PICK), {0: (5.2e6, 0.50), 1: (3.9e6, 0.30)},
                                       predictions, "--json")
        self.assertEqual(code, 0, out)
        self.assertEqual(cfg.pass_configs, ((False, "upstream_greedy", 256.0),
                                            (True, "balanced", 64.0)))
        # the workers get the same three options per pass
        self.assertEqual(json.loads(cfg.worker_pass_configs()), [DEFAULT, PICK])
        doc = json.loads(out[out.index("{"):out.rindex("}") + 1])
        comp = doc["recommended"]
        d, r = comp["passes"]["default"], comp["passes"]["recommended"]
        self.assertAlmostEqual(d["inter_node_bytes_per_step"]["measured_over_predicted"], 1.04)
        self.assertAlmostEqual(r["inter_node_bytes_per_step"]["measured_over_predicted"], 0.975)
        self.assertAlmostEqual(d["step_time_s"]["measured_over_predicted"], 1.25)
        over = comp["recommended_over_default"]
        self.assertAlmostEqual(over["inter_node_bytes_per_step"]["measured"], 3.9 / 5.2)
        self.assertAlmostEqual(over["inter_node_bytes_per_step"]["predicted"], 0.8)
        self.assertAlmostEqual(over["step_time_s"]["measured"], 0.6)
        self.assertAlmostEqual(over["step_time_s"]["predicted_comm"], 0.625)
        self.assertTrue(comp["bytes_within_tolerance"])
        self.assertEqual(set(doc["measured"]), {"default", "recommended"})

    def test_table_without_json(self) -> None:
        predictions = {"default": {"inter_node_bytes": 5.0e6, "step_comm_time_s": 0.40},
                       "recommended": {"inter_node_bytes": 4.0e6, "step_comm_time_s": 0.25}}
        code, _, out, _ = self._main(_rec(PICK), {0: (5.2e6, 0.50), 1: (3.9e6, 0.30)},
                                     predictions)
        self.assertEqual(code, 0)
        self.assertIn("recommended/default", out)
        row = next(ln for ln in out.splitlines() if ln.startswith("inter-node bytes/step"))
        self.assertEqual(row.split()[-1], "0.750", row)  # 3.9 MB / 5.2 MB
        self.assertIn("within 15%", out)
        self.assertTrue(out.rstrip().splitlines()[-1].startswith("PASS"), out)
        self.assertIn("recommended: inter_node_bytes/step=3900000", out)

    def test_pick_equal_to_default_runs_once(self) -> None:
        predictions = {"default": {"inter_node_bytes": 5.0e6, "step_comm_time_s": 0.40}}
        code, cfg, out, err = self._main(_rec(DEFAULT), {0: (6.0e6, 0.5)}, predictions,
                                         "--json")
        self.assertEqual(code, 0)
        self.assertEqual(cfg.passes(), [0])
        self.assertFalse(cfg.uses_group_call())
        self.assertIn("the recommendation is the default configuration", err)
        comp = json.loads(out[out.index("{"):out.rindex("}") + 1])["recommended"]
        self.assertTrue(comp["recommendation_is_default"])
        self.assertIsNone(comp["recommended_over_default"])
        # 6.0 / 5.0 = 1.2: outside the 15 % bar, said so, not hidden
        self.assertFalse(comp["bytes_within_tolerance"])


class TestComparisonHelpers(unittest.TestCase):
    def test_one_node_zero_bytes_measured_and_predicted_holds(self) -> None:
        cfg = crun.ClusterConfig(nodes=1, procs_per_node=4, ep=2, moe_sharding=2,
                                 pass_configs=((False, "upstream_greedy", 256.0),))
        result = _faked_result(cfg, {0: (0.0, 0.1)})
        result.steps[(0, 1)]["tx"] = 0.0
        pred = {"default": {"inter_node_bytes": 0.0, "step_comm_time_s": 0.002}}
        comp = cc.comparison(result, _rec(DEFAULT), pred)
        self.assertIsNone(comp["passes"]["default"]["inter_node_bytes_per_step"][
            "measured_over_predicted"])
        self.assertTrue(comp["bytes_within_tolerance"])
        # bytes where none were predicted do not hold
        result = _faked_result(cfg, {0: (100.0, 0.1)})
        self.assertFalse(cc.comparison(result, _rec(DEFAULT), pred)["bytes_within_tolerance"])

    def test_beta_net_is_a_shared_node_link(self) -> None:
        cfg = crun.ClusterConfig(nodes=2, procs_per_node=4, ep=2, moe_sharding=4,
                                 link_mbit=50.0)
        ab = cc.cluster_alpha_beta(cfg)
        # 50 Mbit/s = 6.25e6 B/s, shared by 4 ranks: 6.4e-7 s per byte per rank
        self.assertAlmostEqual(ab.beta_net, 6.4e-7, delta=1e-15)
        self.assertLess(ab.beta_nvlink, ab.beta_net / 100)

    def test_pass_configs_drop_a_pick_equal_to_the_default(self) -> None:
        self.assertEqual(cc.pass_configs(_rec(PICK)),
                         ((False, "upstream_greedy", 256.0), (True, "balanced", 64.0)))
        self.assertEqual(cc.pass_configs(_rec({**DEFAULT, "comm_buffer_size_MB": 256})),
                         ((False, "upstream_greedy", 256.0),))

    def test_predicted_time_is_the_estimate_the_pick_was_made_on(self) -> None:
        cfg = crun.ClusterConfig(nodes=2, procs_per_node=2, ep=2, moe_sharding=2)
        rec = cc.recommend_for_cluster(cfg)
        for entry in (rec["default"], rec["best"]):
            p = cc.predict(cfg, entry["config"])
            self.assertAlmostEqual(p["step_comm_time_s"], entry["estimated_time_s"],
                                   delta=1e-12 + 1e-9 * entry["estimated_time_s"])
            self.assertGreater(p["inter_node_bytes"], 0)
            # 2 node links of 100 Mbit/s = 12.5e6 B/s each
            self.assertAlmostEqual(p["link_floor_s"], p["inter_node_bytes"] / 2 / 12.5e6)

    def test_compute_times_are_the_slowest_rank_averaged_over_timed_steps(self) -> None:
        cfg = crun.ClusterConfig(nodes=1, procs_per_node=2, ep=1, moe_sharding=2, steps=3,
                                 pass_configs=((False, "upstream_greedy", 256.0),))
        result = crun.ClusterResult(cfg)
        progress = crun._Progress(cfg, result, lambda line: None)
        for step, (fb, ref) in enumerate(((9.0, 9.0), (0.1, 0.4), (0.3, 0.6)), start=1):
            for rank in (0, 1):
                progress.feed("CLUSTER_STEP " + json.dumps(dict(
                    rank=rank, group_call=0, pass_label=0, step=step, steps=3,
                    seconds=1.0, tx=0, rx=0, leader=rank == 0, loss=0.5, applied=DEFAULT,
                    fwd_bwd_s=fb * (rank + 1), reference_step_s=ref + rank)))
        m = result.per_pass()[0]
        # slowest rank (rank 1: 2x / +1) of steps 2 and 3; step 1 left out
        self.assertAlmostEqual(m["fwd_bwd_s"], (0.2 + 0.6) / 2)
        self.assertAlmostEqual(m["reference_step_s"], (1.4 + 1.6) / 2)
        self.assertEqual(result.problems, [])

    def test_an_option_the_optimizer_did_not_read_fails_the_run(self) -> None:
        cfg = crun.ClusterConfig(nodes=1, procs_per_node=2, ep=1, moe_sharding=2, steps=1,
                                 pass_configs=((False, "upstream_greedy", 256.0),))
        result = crun.ClusterResult(cfg)
        progress = crun._Progress(cfg, result, lambda line: None)
        good = dict(DEFAULT)
        for rank, applied in ((0, good), (1, {**good, "muon_partition_strategy": "balanced"})):
            progress.feed("CLUSTER_STEP " + json.dumps(dict(
                rank=rank, group_call=0, pass_label=0, step=1, steps=1, seconds=0.1, tx=0,
                rx=0, leader=rank == 0, loss=0.5, applied=applied)))
        self.assertEqual(len(result.problems), 1, result.problems)
        self.assertIn("rank 1 pass default: the optimizer read", result.problems[0])


@unittest.skipIf(_UNAVAILABLE is not None, f"cluster unavailable: {_UNAVAILABLE}")
class TestRecommendedRealRun(unittest.TestCase):
    """One real run (about 30 s on a loaded 2-core box)."""

    def test_2_nodes_x_2_default_and_pick_match_reference_and_bytes(self) -> None:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            code = cluster.main(_args("--recommended", "--link-mbit", "1000", "--json"))
        text = out.getvalue()
        self.assertEqual(code, 0, text)
        doc = json.loads(text[text.index("{"):text.rindex("}") + 1])
        self.assertEqual(doc["status"], "PASS", doc["problems"])
        comp = doc["recommended"]
        self.assertEqual(len(comp["passes"]), 2, comp)
        for name, v in comp["passes"].items():
            ratio = v["inter_node_bytes_per_step"]["measured_over_predicted"]
            self.assertLess(abs(ratio - 1.0), cc.BYTES_TOLERANCE, f"{name}: {ratio}")


if __name__ == "__main__":
    unittest.main()
