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
"""Smoke tests for tools/bench/bench_overhead.py and bench_newton_schulz.py.

Each benchmark's ``main`` runs on a tiny config; only the shape of the
result is checked (ratio keys present, finite, positive). Timings are never
asserted: they belong to the benchmark's printed report.
"""

import math
import os

import pytest
from tool_loader import load_tool

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "tools", "bench")


def _load(name):
    return load_tool(os.path.join("bench", f"{name}.py"), f"_bench_{name}")


def _finite_positive(value):
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_bench_overhead_smoke(capsys):
    bench = _load("bench_overhead")
    res = bench.main(["--config", "moe8", "dense2", "--hidden", "32", "--inner", "16",
                      "--reps", "1", "--warmup", "1", "--ns-steps", "2"])
    assert _finite_positive(res["overhead_ratio"])
    assert _finite_positive(res["worst_rank_ratio"])
    assert _finite_positive(res["paired_ratio"])
    assert _finite_positive(res["recorder_ratio"])
    assert [c["config"] for c in res["configs"]] == ["moe8", "dense2"]
    for config in res["configs"]:
        assert len(config["ranks"]) == config["world"]
        assert _finite_positive(config["overhead_ratio"])
        for rank in config["ranks"]:
            assert rank["muon_owned"], f"rank {rank['rank']} owns no Muon matrix"
            for key in ("sharded_ms", "plain_ms", "reduce_ms", "sync_ms", "paired_ratio",
                        "sharded_no_recorder_ms", "recorder_paired_ratio"):
                assert _finite_positive(rank[key]), (key, rank)
    out = capsys.readouterr().out
    assert "RESULT overhead_ratio=" in out
    assert "RESULT recorder_ratio=" in out
    assert "# command:" in out


def test_bench_newton_schulz_smoke(capsys):
    bench = _load("bench_newton_schulz")
    res = bench.main(["--shapes", "32x32", "48x16", "2x16x24", "--steps", "2",
                      "--reps", "1", "--warmup", "0"])
    assert _finite_positive(res["overall_ratio"])
    assert _finite_positive(res["overall_addmm_ratio"])
    assert [r["shape"] for r in res["shapes"]] == [[32, 32], [48, 16], [2, 16, 24]]
    for r in res["shapes"]:
        for key in ("ns_ms", "mm_ms", "ratio", "addmm_ms", "addmm_ratio"):
            assert _finite_positive(r[key]), (key, r)
        # The candidate formulation must compute the same thing.
        assert r["addmm_max_abs_diff"] < 1e-4
    out = capsys.readouterr().out
    assert "RESULT ns_overall_ratio=" in out
    assert "RESULT ns_ratio[48x16]=" in out


def test_bench_newton_schulz_grouped_smoke(capsys):
    bench = _load("bench_newton_schulz")
    res = bench.main(["--grouped", "3x16x24", "2x8x8", "--scale", "1", "--steps", "2",
                      "--reps", "1", "--warmup", "0", "--max-group-bytes", "3100"])
    # 16*24*4 = 1,536 bytes: two per 3,100-byte batch; the 8x8 pair fits once
    assert res["splits"] == {"16x24": [2, 1], "8x8": [2]}, res["splits"]
    assert _finite_positive(res["grouped_speedup"])
    assert res["max_abs_diff"] < 1e-5, "grouped and per-matrix updates must agree"
    assert "RESULT grouped_speedup=" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--grouped", "3x16"])
    assert exit_info.value.code == 2
