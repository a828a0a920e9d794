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
"""Tests for ``tools/muon_comm.py plan`` against hand-computed byte counts."""

import argparse
import json
import os
import subprocess
import sys

import pytest
from tool_loader import load_tool

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "muon_comm.py")

mc = load_tool("muon_comm.py", "_muon_comm_tool")

# Hand model: 3 dense Muon matrices, 1 expert matrix, 1 non-Muon vector.
#   a [4, 8]  fp32 = 128 B, b [8, 8] fp32 = 256 B, c [8, 16] bf16 = 256 B
#   experts.0.w [8, 4] fp32 = 128 B (every EP rank holds a copy)
#   norm.weight [16] fp32 = 64 B (reduce-scatter / all-gather)
HAND_MODEL = [
    {"name": "a.weight", "shape": [4, 8], "dtype": "float32"},
    {"name": "b.weight", "shape": [8, 8], "dtype": "float32"},
    {"name": "c.weight", "shape": [8, 16], "dtype": "bfloat16"},
    {"name": "experts.0.w", "shape": [8, 4], "dtype": "float32", "is_expert": True},
    {"name": "norm.weight", "shape": [16], "dtype": "float32"},
]
DENSE = 128 + 256 + 256
EXPERT = 128
NORM = 64
# ep=4, ms=2, gpn=2, pp=1, order moe_sharding,pp,ep: rank = 4*s + e, world 8,
# 4 nodes (node = r // 2). Sharding group 0..7 spans 4 nodes; moe_sharding
# groups {e, e+4} span 2 nodes ({0,4},{1,5} on nodes 0/2; {2,6},{3,7} on 1/3).
# The hand figures are for the balanced (recommended) rule; the default is
# develop's, as the optimizer's (test_plan_default_rule_is_the_optimizers).
HAND_ARGS = ["--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "2",
             "--partition", "balanced"]


@pytest.fixture(scope="module")
def hand_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "hand.json"
    path.write_text(json.dumps(HAND_MODEL))
    return str(path)


def run_main(argv, capsys):
    rc = mc.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def plan_json(argv, capsys):
    rc, out, err = run_main(["plan", *argv, "--json"], capsys)
    assert rc == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def hand_result(hand_json):
    cfg = mc.MuonCommConfig(ep=4, moe_sharding=2, pp=1, gpus_per_node=2, model=hand_json)
    return mc.compute_plan(cfg, partition_strategy="balanced")


def test_plan_default_rule_is_the_optimizers(hand_json, capsys):
    from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.settings import (
        ShardingSettings,
    )

    res = plan_json(["--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "2",
                     "--model", hand_json], capsys)
    optimizer_default = ShardingSettings().muon_partition_strategy
    assert res["config"]["partition_strategy"] == optimizer_default == "upstream_greedy", (
        "plan must describe the optimizer's default owner rule")
    assert res["partition_rules"]["upstream_greedy"]["empty_ranks"] == 4


# --------------------------------------------------------------------------
# hand-computed bytes
# --------------------------------------------------------------------------
def test_hand_buckets(hand_result):
    buckets = hand_result["buckets"]["hierarchical"]
    dense = [b for b in buckets if b["colour"] == "dense"]
    moe = [b for b in buckets if b["colour"] == "moe"]
    # a and b (fp32) get different owners, c (bf16) its own bucket: 3 buckets.
    assert sorted(b["bytes"] for b in dense) == [128, 256, 256]
    assert all(b["group_nodes"] == 4 for b in dense)
    # one expert bucket in each of the 4 moe_sharding groups, 2 nodes each
    assert [b["bytes"] for b in moe] == [EXPERT] * 4
    assert all(b["group_nodes"] == 2 for b in moe)
    assert hand_result["world_size"] == 8 and hand_result["num_nodes"] == 4


def test_hand_bound_and_hierarchical_bytes(hand_result):
    h = hand_result["hierarchical"]
    # bound: dense 2*(4-1)*640, MoE 4 groups * 2*(2-1)*128
    bound = 2 * 3 * DENSE + 4 * 2 * 1 * EXPERT
    assert bound == 4864
    assert h["inter_node_bytes_bound"] == bound
    # hierarchical: each node forwards one partial -> exactly the bound
    assert h["inter_node_bytes"] == pytest.approx(bound)
    assert h["inter_node_ratio_to_bound"] == pytest.approx(1.0)
    # intra-node: per dense buffer and node one NVLink send of S (gpn = 2),
    # 4 nodes, reduce + broadcast; experts never share a node.
    assert h["intra_node_bytes"] == pytest.approx(2 * 4 * DENSE)  # 5120
    # norm: ring RS + AG over 8 ranks, 2 channels of 32 B, each ring edge
    # carries 7/8 * 32 B; 4 of 8 edges cross nodes.
    rs_inter = 2 * 4 * (7 / 8) * (NORM / 2)  # per op: 224
    assert h["inter_node_bytes_all"] == pytest.approx(bound + 2 * rs_inter)  # 5312
    assert h["intra_node_bytes_all"] == pytest.approx(5120 + 2 * rs_inter)
    assert h["by_colour"]["dense"]["inter_node_bytes"] == pytest.approx(6 * DENSE)
    assert h["by_colour"]["moe"]["inter_node_bytes"] == pytest.approx(8 * EXPERT)


def test_hand_flat_bytes(hand_result):
    f = hand_result["flat"]
    # ring model: 2 ranks per node -> 2 channels of S/2; each channel ring
    # crosses 4 node boundaries; a reduce drops the edge root->successor,
    # which crosses nodes in exactly one channel: (4 - 1/2) * S per op, and
    # the same for a broadcast -> 7 * S per dense buffer.
    assert f["inter_node_bytes"] == pytest.approx(7 * DENSE + 8 * EXPERT)  # 5504
    assert f["inter_node_bytes_bound"] == 4864
    assert f["inter_node_ratio_to_bound"] == pytest.approx(5504 / 4864)
    assert f["intra_node_bytes"] == pytest.approx(7 * DENSE)  # (3 + 4)/2 * S * 2 ops
    assert f["by_colour"]["dense"]["inter_node_ratio_to_bound"] == pytest.approx(7 / 6)


def test_hand_collectives(hand_result):
    f, h = hand_result["flat"], hand_result["hierarchical"]
    # flat: 3 dense reduces + 3 broadcasts + RS + AG in the sharding group;
    # 4 groups x (1 reduce + 1 broadcast) in moe_sharding groups.
    assert f["collectives_per_step"] == {
        "sharding": 8, "moe_sharding": 8, "node": 0, "same_card": 0,
    }
    # hierarchical: each dense buffer -> one reduce in each of 4 node groups
    # and one in its same-card group, mirrored for the broadcast.
    assert h["collectives_per_step"] == {
        "sharding": 2, "moe_sharding": 8, "node": 3 * 4 * 2, "same_card": 3 * 2,
    }
    assert f["collectives_detail"]["sharding"] == {
        "reduce": 3, "broadcast": 3, "reduce_scatter": 1, "all_gather": 1,
    }
    # coalesced launches: flat sharding = reduce block + broadcast block + RS + AG
    assert f["coalesced_launches_per_step"]["sharding"] == 4
    assert h["coalesced_launches_per_step"]["node"] == 4 * 2
    cards = {b["owner"] % 2 for b in hand_result["buckets"]["hierarchical"]
             if b["colour"] == "dense"}
    assert h["coalesced_launches_per_step"]["same_card"] == 2 * len(cards)


def test_hand_rails_and_per_rank(hand_result):
    h = hand_result["hierarchical"]
    rails = [0.0, 0.0]
    for b in hand_result["buckets"]["hierarchical"]:
        if b["colour"] == "dense":
            rails[b["owner"] % 2] += 2 * 3 * b["bytes"]  # cross-node on card(owner)
    # MoE groups {0,4},{2,6} sit on card 0, {1,5},{3,7} on card 1: 2 * 128 each
    rails[0] += 2 * 2 * EXPERT
    rails[1] += 2 * 2 * EXPERT
    assert h["rail_bytes"] == pytest.approx(rails)
    assert h["rail_imbalance"] == pytest.approx(max(rails) * 2 / sum(rails))
    per_rank = h["bytes_per_rank"]
    assert per_rank["inter_node"]["mean"] == pytest.approx(h["inter_node_bytes_all"] / 8)
    assert per_rank["intra_node"]["mean"] == pytest.approx(h["intra_node_bytes_all"] / 8)
    assert per_rank["inter_node"]["max"] >= per_rank["inter_node"]["mean"]


def test_hand_alpha_latency(hand_json, capsys):
    # beta ~ 0 (the tool refuses 0): only latency. alpha_nvlink = 1, alpha_net = 10;
    # a few kB at 1e-20 s/B add < 1e-15 s, far inside approx's 1e-6 relative.
    res = plan_json(
        [*HAND_ARGS, "--model", hand_json, "--alpha-nvlink", "1", "--alpha-net", "10",
         "--beta-nvlink", "1e-20", "--beta-net", "1e-20"], capsys)
    # RS / AG: ring 1,0,3,2,5,4,7,6 (channel 0), 7 hops: 4 NVLink + 3 network = 34
    # hierarchical Muon: coalesced (gpn-1)*1 + (n-1)*10, MoE chain 1 network hop,
    # both for reduce and broadcast: 2 * (1 + 30 + 10) = 82
    assert res["hierarchical"]["estimated_time_s"] == pytest.approx(34 * 2 + 82)
    # flat: every dense buffer's reduce + broadcast chains use 7 network and
    # 7 NVLink hops in total (whichever root), 3 buffers; MoE 2 * 10.
    assert res["flat"]["estimated_time_s"] == pytest.approx(34 * 2 + 3 * 77 + 20)
    assert res["alpha_beta"]["alpha_net_s"] == 10


def test_optimizer_state_from_partitions(hand_result):
    # state per matrix: fp32 -> momentum 4 B/elem; bf16 -> momentum + fp32
    # master 8 B/elem. Bucket bytes -> state: fp32 x1, bf16 x4.
    state = [0] * 8
    for b in hand_result["buckets"]["hierarchical"]:
        state[b["owner"]] += b["bytes"] * (4 if b["dtype"] == "bfloat16" else 1)
    total = 128 + 256 + 1024 + 4 * 128
    assert sum(state) == total
    assert hand_result["optimizer_state_max_over_mean"] == pytest.approx(
        max(state) * 8 / total
    )
    owned = hand_result["owned_by_colour"]["hierarchical"]
    assert sum(owned["dense"]) == 3 and sum(owned["moe"]) == 4


# --------------------------------------------------------------------------
# CLI contract
# --------------------------------------------------------------------------
def test_json_keys_and_table_consistent(hand_json, capsys):
    res = plan_json([*HAND_ARGS, "--model", hand_json], capsys)
    for key in ("flat", "hierarchical", "optimizer_state_max_over_mean", "world_size",
                "num_nodes", "alpha_beta", "groups"):
        assert key in res
    # the benches' targets are no verdict on a user's layout: not in user output
    assert "targets" not in res
    for path in ("flat", "hierarchical"):
        for key in ("inter_node_bytes", "inter_node_ratio_to_bound", "rail_imbalance",
                    "collectives_per_step", "estimated_time_s", "bytes_per_rank"):
            assert key in res[path]
    rc, table, _ = run_main(["plan", *HAND_ARGS, "--model", hand_json], capsys)
    assert rc == 0

    def cells(label):
        line = next(ln for ln in table.splitlines() if ln.startswith(label))
        return line[len(label):].split()

    assert cells("  ratio to bound") == [
        f"{res['flat']['inter_node_ratio_to_bound']:.4f}",
        f"{res['hierarchical']['inter_node_ratio_to_bound']:.4f}",
    ]
    assert cells("rail imbalance (busiest/mean)") == [
        f"{res['flat']['rail_imbalance']:.4f}", f"{res['hierarchical']['rail_imbalance']:.4f}",
    ]
    for kind in ("sharding", "moe_sharding", "node", "same_card"):
        assert cells(f"collectives/step: {kind}") == [
            str(res["flat"]["collectives_per_step"][kind]),
            str(res["hierarchical"]["collectives_per_step"][kind]),
        ]
    assert cells("optimizer state max/mean") == [
        f"{res['flat']['optimizer_state_max_over_mean']:.4f}",
        f"{res['optimizer_state_max_over_mean']:.4f}",
    ]
    assert "target" not in table and "MISSED" not in table


def test_png_written(hand_json, tmp_path, capsys):
    png = tmp_path / "plan.png"
    rc, out, err = run_main(["plan", *HAND_ARGS, "--model", hand_json, "--png", str(png)],
                            capsys)
    assert rc == 0, err
    data = png.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in out


def _cli(*argv):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(REPO, "python"), env.get("PYTHONPATH", "")]
    )
    return subprocess.run([sys.executable, TOOL, *argv], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120)


def test_invalid_layout_exits_2_with_plan_message():
    # ep=12 with 8 cards per node and pp=2: nodes mix pipeline stages.
    proc = _cli("plan", "--ep", "12", "--moe-sharding", "2", "--pp", "2",
                "--gpus-per-node", "8", "--model", "tiny")
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("error: comm_group_call_opt needs every node's ranks")
    assert "mixes pipeline stages" in lines[-1]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "1"], "gpus_per_node=1"),
        (["--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "3"], "not a multiple"),
        (["--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "8"], "single node"),
        (["--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "2", "--nodes", "3"],
         "--nodes 3"),
        (["--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "2", "--order", "pp,ep"],
         "exactly once"),
        (["--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "2", "--order",
          "pp,ep,bogus"], "unknown axis"),
        (["--ep", "0", "--moe-sharding", "2", "--gpus-per-node", "2"], "--ep 0: must be >= 1"),
        (["--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "2", "--model",
          "no-such-preset"], "--model 'no-such-preset': is neither a preset nor a file"),
    ],
)
def test_invalid_config_exit_2(argv, needle, capsys):
    if "--model" not in argv:
        argv = [*argv, "--model", "tiny"]
    rc, out, err = run_main(["plan", *argv], capsys)
    assert rc == 2
    assert out == ""
    assert err.startswith("error: ") and needle in err


def test_pipe_first_pp2(capsys):
    # order pipe -> moe_sharding -> expert: rank = 8*p + 4*s + e; 4 cards per
    # node -> nodes 0, 1 hold stage 0 and nodes 2, 3 stage 1.
    res = plan_json(["--ep", "4", "--moe-sharding", "2", "--pp", "2", "--gpus-per-node", "4",
                     "--order", "pipe,moe_sharding,ep", "--model", "tiny"], capsys)
    assert res["config"]["order"] == ["pipe", "moe_sharding", "expert"]
    assert res["world_size"] == 16 and res["num_nodes"] == 4
    assert res["groups"]["sharding"] == {"count": 2, "size": 8, "nodes_spanned": 2}
    assert res["groups"]["same_card"]["count"] == 2 * 4
    h = res["hierarchical"]
    assert h["inter_node_ratio_to_bound"] == pytest.approx(1.0)
    assert h["collectives_per_step"]["same_card"] > 0
    stages = {b["stage"] for b in res["buckets"]["hierarchical"]}
    assert stages == {0, 1}
    # every dense owner lies in its stage's nodes
    for b in res["buckets"]["hierarchical"]:
        assert (b["owner"] // 8) == b["stage"]


def test_config_api_shared_flags():
    parser = argparse.ArgumentParser()
    mc.add_config_args(parser)
    args = parser.parse_args(["--ep", "16", "--moe-sharding", "2", "--gpus-per-node", "8",
                              "--order", "ep,pp,moe_sharding", "--nodes", "4"])
    cfg = mc.build_config(args)
    assert isinstance(cfg, mc.MuonCommConfig)
    assert cfg.order == ("expert", "pipe", "moe_sharding")
    assert (cfg.ep, cfg.moe_sharding, cfg.pp, cfg.gpus_per_node) == (16, 2, 1, 8)
    assert cfg.model == mc.DEFAULT_MODEL and cfg.nodes == 4
    assert cfg.world_size == 32
    assert cfg.build_plan().num_nodes == 4


# --------------------------------------------------------------------------
# targets on the presets
# --------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["ernie-moe-small", "ernie-moe-small-fused"])
@pytest.mark.parametrize("ep, ms", [(16, 2), (32, 4)])
def test_preset_targets(model, ep, ms):
    cfg = mc.MuonCommConfig(ep=ep, moe_sharding=ms, pp=1, gpus_per_node=8, model=model)
    res = mc.compute_plan(cfg, partition_strategy="balanced")  # the recommended rule
    h = res["hierarchical"]
    assert h["inter_node_ratio_to_bound"] <= mc.TARGET_HIER_RATIO
    assert h["rail_imbalance"] <= mc.TARGET_RAIL_IMBALANCE
    assert res["targets"]["met"]
    # the hierarchical path never moves more Muon bytes across nodes than flat
    assert h["inter_node_bytes"] <= res["flat"]["inter_node_bytes"] + 1e-6
    assert h["by_colour"]["dense"]["inter_node_ratio_to_bound"] == pytest.approx(1.0)


def test_preset_cli_128_ranks():
    # Speed is a benchmark matter (no timed asserts): this checks the CLI end to end.
    proc = _cli("plan", "--ep", "32", "--moe-sharding", "4", "--gpus-per-node", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res["world_size"] == 128 and res["num_nodes"] == 16
    assert res["hierarchical"]["inter_node_ratio_to_bound"] <= mc.TARGET_HIER_RATIO
    assert "targets" not in res and "MISSED" not in proc.stdout


def test_overlap_mode_follows_the_layout(hand_json, capsys):
    sync = plan_json([*HAND_ARGS, "--model", hand_json], capsys)
    over = plan_json([*HAND_ARGS, "--model", hand_json, "--comm-overlap"], capsys)
    h_sync, h_over = sync["hierarchical"], over["hierarchical"]
    # same collectives and bytes; what changes is who launches them
    assert h_over["collectives_per_step"] == h_sync["collectives_per_step"]
    assert h_over["inter_node_bytes"] == pytest.approx(h_sync["inter_node_bytes"])
    assert h_over["phase_triggers"]["intra_node_reduce"] == "backward"
    assert h_over["phase_triggers"]["cross_node_reduce"] == "reduce_gradients"
    assert h_sync["phase_triggers"]["intra_node_reduce"] == "reduce_gradients"
    # hook launches: one per dense buffer and node (3 x 4), not one coalesced
    # block per node; the broadcast stays one block per node (4) in both modes
    assert h_over["coalesced_launches_per_step"]["node"] == 3 * 4 + 4
    assert h_sync["coalesced_launches_per_step"]["node"] == 4 + 4
    assert all(b["route"] == "hierarchical+overlap" for b in over["buckets"]["hierarchical"]
               if b["colour"] == "dense")
    assert over["config"]["comm_overlap"] is True


def test_overlap_needs_fused_buffers(hand_json, capsys):
    rc, out, err = run_main(["plan", *HAND_ARGS, "--model", hand_json, "--comm-overlap",
                             "--buffer-size-MB", "0"], capsys)
    assert rc == 2 and "needs fused gradient buffers" in err


def test_partition_rules_side_by_side(hand_json, capsys):
    res = plan_json([*HAND_ARGS, "--model", hand_json], capsys)
    rules = res["partition_rules"]
    # develop's rule and balanced always; rail only where asked for (it would
    # cost one more hierarchical path on every large plan)
    assert set(rules) == {"balanced", "upstream_greedy"}
    chosen = plan_json([*HAND_ARGS, "--model", hand_json, "--partition", "rail"], capsys)
    assert set(chosen["partition_rules"]) == {"balanced", "upstream_greedy", "rail"}
    assert "hierarchical_estimated_time_s" in chosen["partition_rules"]["rail"]
    assert rules["balanced"]["optimizer_state_max_over_mean"] == pytest.approx(
        res["optimizer_state_max_over_mean"])
    # develop's rule: all of a group (well under one 256 MB buffer) on its first
    # rank: dense on rank 0, each expert on its moe_sharding group's first rank
    # ({e, e + 4}: ranks 0..3), so ranks 4..7 own nothing
    assert rules["upstream_greedy"]["empty_ranks"] == 4
    assert rules["balanced"]["empty_ranks"] < 4
    up = plan_json([*HAND_ARGS, "--model", hand_json, "--partition", "upstream_greedy"], capsys)
    assert up["config"]["partition_strategy"] == "upstream_greedy"
    assert up["optimizer_state_max_over_mean"] == pytest.approx(
        rules["upstream_greedy"]["optimizer_state_max_over_mean"])
    rc, table, _ = run_main(["plan", *HAND_ARGS, "--model", hand_json], capsys)
    assert "partition rule upstream_greedy: state max/mean" in table


def test_moe_sharding_nodes_spanned_is_the_widest_group(hand_json):
    # order pipe -> moe_sharding -> expert, ms=2, pp=3, ep=1, 3 cards per node
    # (flat path only): stage p's moe_sharding group is {2p, 2p + 1}, so
    # {0, 1} sits on node 0 while {2, 3} spans nodes 0 and 1.
    cfg = mc.MuonCommConfig(ep=1, moe_sharding=2, pp=3, gpus_per_node=3,
                            order=("pipe", "moe_sharding", "expert"), model=hand_json)
    res = mc.compute_plan(cfg, group_call=False, compare_rules=False)
    assert res["groups"]["moe_sharding"]["nodes_spanned"] == 2, res["groups"]


def test_targets_are_maxima_and_both_must_hold(hand_json, monkeypatch):
    from paddle_muon_ext.tools import plan as plan_module

    cfg = mc.MuonCommConfig(ep=4, moe_sharding=2, pp=1, gpus_per_node=2, model=hand_json)
    first = mc.compute_plan(cfg, partition_strategy="balanced", compare_rules=False)["targets"]
    # a figure equal to its target meets it
    monkeypatch.setattr(plan_module, "TARGET_HIER_RATIO", first["hierarchical_ratio_to_bound"])
    monkeypatch.setattr(plan_module, "TARGET_RAIL_IMBALANCE", first["rail_imbalance"])
    equal = mc.compute_plan(cfg, partition_strategy="balanced", compare_rules=False)["targets"]
    assert (equal["ratio_met"], equal["rail_met"], equal["met"]) == (True, True, True), equal
    # a rail target below the figure fails the whole target, the ratio still holds
    monkeypatch.setattr(plan_module, "TARGET_RAIL_IMBALANCE", first["rail_imbalance"] / 2)
    rail = mc.compute_plan(cfg, partition_strategy="balanced", compare_rules=False)["targets"]
    assert (rail["ratio_met"], rail["rail_met"], rail["met"]) == (True, False, False), rail


def test_model_summary_counts(hand_result):
    # HAND_MODEL: a, b, c dense matrices, one expert matrix, one vector
    assert hand_result["model_summary"] == {
        "params": 5, "muon_params": 4, "muon_dense": 3, "muon_expert": 1, "other_params": 1,
    }
