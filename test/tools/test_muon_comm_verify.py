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
"""``tools/muon_comm.py verify`` and the ``paddle-muon-ext`` alias."""

from __future__ import annotations

import json
import os
import re

import pytest
from tool_loader import load_tool

tool = load_tool("muon_comm.py", "_muon_comm_tool")
PASS_LINE = re.compile(
    r"^PASS ranks=(\d+)( mode=schedule-only)? max_abs_diff_hier_vs_flat=(\S+) "
    r"max_abs_diff_vs_reference=(\S+) steps=(\d+) collectives_checked=(\d+) "
    r"values_compared=(\d+)$"
)


def _last_line(capsys) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_verify_passes_ep8_gpn4_ms2(capsys):
    rc = tool.main(["verify", "--ep", "8", "--moe-sharding", "2", "--pp", "1",
                    "--gpus-per-node", "4"])
    line = _last_line(capsys)
    match = PASS_LINE.match(line)
    assert rc == 0 and match, line
    assert match.group(1) == "16" and match.group(2) is None
    assert float(match.group(3)) <= 1e-5 and float(match.group(4)) <= 1e-5
    # No verdict without work: the line says what was compared.
    assert match.group(5) == "3" and int(match.group(6)) > 0 and int(match.group(7)) > 0


def test_verify_32_ranks_moves_data():
    summary = tool.run_verify(
        tool.MuonCommConfig(ep=16, moe_sharding=2, pp=1, gpus_per_node=8,
                            model=tool.VERIFY_MODEL),
        steps=2, progress=lambda *_: None,
    )
    assert summary["status"] == "PASS", summary["problems"]
    assert summary["ranks"] == 32 and summary["mode"] == "data"
    assert summary["max_abs_diff_vs_reference"] <= 1e-5


def test_verify_large_world_is_schedule_only(capsys):
    rc = tool.main(["verify", "--ep", "8", "--moe-sharding", "2", "--gpus-per-node", "4",
                    "--data-max-ranks", "8"])
    out = capsys.readouterr().out
    assert rc == 0
    last = out.strip().splitlines()[-1]
    assert "schedule-only" in out and "max_abs_diff_vs_reference=n/a" in last, last
    match = PASS_LINE.match(last)
    assert match and int(match.group(6)) > 0 and match.group(7) == "0", last


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--ep", "12", "--moe-sharding", "2", "--pp", "2", "--gpus-per-node", "8"],
         "mixes pipeline stages"),
        (["--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "1"], "gpus_per_node=1"),
        (["--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "4", "--model",
          "ernie-moe-small"], "presets and JSON files are for plan"),
        (["--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "2", "--steps", "0"],
         "--steps 0: must be >= 1"),
        (["--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "2", "--recommended",
          "--partition", "rail"],
         "--recommended picks the owner rule and buffer size itself; drop --partition"),
        (["--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "2", "--buffer-size-MB",
          "1.5"], "--buffer-size-MB 1.5: is not a whole number"),
        (["--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "2", "--unfused",
          "--buffer-size-MB", "64"], "--unfused means --buffer-size-MB 0"),
    ],
    ids=["node_mixes_stages", "gpn1", "model_for_plan", "steps0", "recommended_and_partition",
         "fractional_buffer", "unfused_and_buffer"],
)
def test_verify_invalid_configuration_exits_2(capsys, argv, fragment):
    rc = tool.main(["verify", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: ") and fragment in err, err


def test_verify_reports_failure(monkeypatch, capsys):
    import muon_sim_runner

    real = muon_sim_runner.reference_values

    def skewed(cfg, steps=None):
        out = real(cfg, steps)
        for values in out.values():
            for key in values:
                values[key] = values[key] + 1e-3
        return out

    monkeypatch.setattr(muon_sim_runner, "reference_values", skewed)
    rc = tool.main(["verify", "--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "2",
                    "--steps", "1"])
    line = _last_line(capsys)
    assert rc == 1 and line.startswith("FAIL ranks=8"), line


def test_verify_fails_when_the_paths_disagree_though_each_is_near_the_reference(
        monkeypatch, capsys):
    # The option on and off must agree within 1e-5 by themselves: shifting
    # one path's values by +8e-6 and the other's by -8e-6 keeps each within
    # 1e-5 of the reference but puts them 1.6e-5 apart.
    from paddle_muon_ext.tools.verify import _test_paths

    _test_paths()  # verify imports the simulated world from the checkout's tests
    import muon_sim_runner

    real = muon_sim_runner.run_world

    def shifted(cfg, *args, **kwargs):
        results, world = real(cfg, *args, **kwargs)
        if kwargs.get("mode") is None:  # the data run, not the schedule record
            shift = 8e-6 if cfg.gpn else -8e-6
            for res in results:
                res.values = {k: v + shift for k, v in res.values.items()}
        return results, world

    monkeypatch.setattr(muon_sim_runner, "run_world", shifted)
    rc = tool.main(["verify", "--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "2",
                    "--steps", "1", "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert summary["max_abs_diff_vs_reference"] <= 1e-5, summary
    assert summary["max_abs_diff_hier_vs_flat"] > 1e-5, summary
    assert rc == 1 and summary["status"] == "FAIL", summary


def test_console_alias_dispatches(capsys):
    from paddle_muon_ext import cli

    assert cli.main([]) == 2
    assert "usage: paddle-muon-ext" in capsys.readouterr().err
    rc = cli.main(["plan", "--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "2",
                   "--model", "tiny", "--json"])
    out = capsys.readouterr().out
    assert rc == 0 and '"hierarchical"' in out


def test_console_alias_routes_demo_and_reports_missing_checkout(monkeypatch, tmp_path, capsys):
    from paddle_muon_ext import cli

    seen = {}

    def fake_run_path(path, run_name):
        def main(argv, prog):
            seen["argv"], seen["prog"] = argv, prog
            raise SystemExit(3)

        seen["path"] = path
        return {"main": main}

    monkeypatch.setattr(cli.runpy, "run_path", fake_run_path)
    assert cli.main(["demo", "--steps", "2"]) == 3
    assert seen["path"].endswith("demo.py") and seen["argv"] == ["--steps", "2"]
    assert seen["prog"] == "paddle-muon-ext demo"

    # A demo main that returns None is a success.
    monkeypatch.setattr(cli.runpy, "run_path", lambda path, run_name: {"main": lambda a, prog: None})
    assert cli.main(["demo"]) == 0

    monkeypatch.setattr(cli, "_checkout_root", lambda: str(tmp_path))
    assert cli.main(["verify", "--ep", "4"]) == 2
    assert "needs a source checkout" in capsys.readouterr().err
    os.makedirs(os.path.join(tmp_path, "test", "mock"))  # a checkout without tools/demo.py
    assert cli.main(["demo", "--steps", "2"]) == 2
    assert "demo needs a source checkout (tools/demo.py)" in capsys.readouterr().err


def _json_summary(out: str) -> dict:
    return json.loads(out)  # --json: stdout is the JSON alone (progress goes to stderr)


def test_verify_comm_overlap_reports_both_hops(capsys):
    rc = tool.main(["verify", "--ep", "8", "--moe-sharding", "2", "--pp", "1",
                    "--gpus-per-node", "4", "--comm-overlap", "--steps", "2", "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out[-2000:]
    summary = _json_summary(out)
    assert summary["comm_overlap"] and summary["layout_schedule_hierarchical_ok"]
    hier, flat = summary["phase_counts"]["hierarchical"], summary["phase_counts"]["flat"]
    # 16 ranks x 2 steps; every rank reduces each dense buffer inside its node
    assert hier["intra_node_reduce"] > 0 and hier["cross_node_reduce"] > 0
    assert hier["intra_node_reduce"] % (16 * 2) == 0
    assert "intra_node_reduce" not in flat and "cross_node_reduce" not in flat
    dense_flat = f"reduce_to_owner[{list(range(16))}]"
    assert dense_flat in flat and dense_flat not in hier


def test_verify_unfused_passes(capsys):
    rc = tool.main(["verify", "--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "2",
                    "--unfused", "--steps", "1", "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out[-2000:]
    summary = _json_summary(out)
    assert summary["fused"] is False and summary["layout_schedule_flat_ok"]


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--comm-overlap", "--unfused"],
         "--comm-overlap --unfused (as sharding settings): refused by MuonShardingOptimizer: "
         "sharding_configs.comm_overlap=True needs fused gradient buffers"),
        (["--comm-overlap", "--pp", "2"],
         "--comm-overlap --pp 2 (as sharding settings): refused by MuonShardingOptimizer: "
         "sharding_configs.comm_overlap=True cannot be combined with pipeline parallel "
         "(pp_degree=2)"),
    ],
    ids=["overlap_unfused", "overlap_pp2"],
)
def test_verify_refuses_what_the_optimizer_refuses(capsys, argv, fragment):
    rc = tool.main(["verify", "--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "2",
                    *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and fragment in err, err


SMALL_MULTI_NODE = ["--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "2"]  # 4 nodes


def _recording_sims(monkeypatch) -> list:
    """(partition, comm_buffer_size_MB) of every simulated world verify runs, as its
    strategy carries them to the optimizer."""
    from paddle_muon_ext.tools import verify

    verify._test_paths()  # the harness verify imports
    import muon_sim_runner

    seen, real = [], muon_sim_runner.run_world

    def run_world(sim, *args, **kwargs):
        sharding = sim.strategy().hybrid_configs["sharding_configs"]
        seen.append((sim.partition, sharding.comm_buffer_size_MB, sim.gpn is not None))
        return real(sim, *args, **kwargs)

    monkeypatch.setattr(muon_sim_runner, "run_world", run_world)
    return seen


def test_verify_recommended_checks_plans_pick(monkeypatch, capsys):
    rc = tool.main(["plan", *SMALL_MULTI_NODE, "--recommend", "--json"])
    pick = json.loads(capsys.readouterr().out)["recommend"]["best"]["config"]
    assert rc == 0
    seen = _recording_sims(monkeypatch)
    rc = tool.main(["verify", *SMALL_MULTI_NODE, "--recommended", "--steps", "1", "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out[-2000:]
    checked = _json_summary(out)["configuration"]
    assert checked["recommended_by_plan"]["config"] == pick
    assert checked["muon_partition_strategy"] == pick["muon_partition_strategy"]
    assert checked["comm_buffer_size_MB"] == pick["comm_buffer_size_MB"]
    assert checked["comm_group_call_opt"] == [True, False]
    # the simulated optimizer ran the pick, with the option on and off
    want = (pick["muon_partition_strategy"], int(pick["comm_buffer_size_MB"]))
    assert {s[:2] for s in seen} == {want} and {s[2] for s in seen} == {True, False}


def test_verify_rail_owners_and_1024_mb_buffers(monkeypatch, capsys):
    seen = _recording_sims(monkeypatch)
    rc = tool.main(["verify", *SMALL_MULTI_NODE, "--partition", "rail", "--buffer-size-MB",
                    "1024", "--steps", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out[-2000:]
    assert ("checked: comm_group_call_opt on and off, muon_partition_strategy=rail, "
            "comm_buffer_size_MB=1024, comm_overlap=False") in out
    assert PASS_LINE.match(out.strip().splitlines()[-1])
    assert {s[:2] for s in seen} == {("rail", 1024)}
