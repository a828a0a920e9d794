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
"""Owner partition of Muon matrices: determinism, accounting, balance,
upstream baseline, minority-dtype rule, rank_order, validation, benchmark."""

import json
import math
import os
import random

import pytest

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_partition import (
    MatrixSpec,
    OwnerPartition,
    balance_floor,
    balanced_partition,
    newton_schulz_cost,
    optimizer_state_bytes,
    upstream_partition,
)

def _load_bench():
    from tool_loader import REPO_ROOT, load_tool

    if not os.path.isfile(os.path.join(REPO_ROOT, "tools", "bench", "bench_partition.py")):
        # Exported into Paddle, tools/bench/ does not travel with the tests.
        pytest.skip("tools/bench/bench_partition.py is not in this tree")
    return load_tool(os.path.join("bench", "bench_partition.py"), "_bench_partition_under_test")


@pytest.fixture(scope="module")
def bench_mod():
    return _load_bench()


@pytest.fixture(scope="module")
def presets(bench_mod):
    return bench_mod.moe_presets


# ---------------------------------------------------------------- helpers
def _ns(shape):
    """Independent recomputation of the NS cost from a shape."""
    *lead, m, n = shape
    e = 1
    for d in lead:
        e *= d
    return e * max(m, n) * min(m, n) ** 2


def _state(shape, dtype, mp=True):
    numel = 1
    for d in shape:
        numel *= d
    low = dtype in ("bfloat16", "float16")
    return numel * 4 + (numel * 4 if (low and mp) else 0)


def _random_specs(seed, count=60):
    rng = random.Random(seed)
    out = []
    for i in range(count):
        m = rng.choice([16, 32, 48, 64, 96, 128])
        n = rng.choice([16, 32, 48, 64, 96, 128])
        shape = (m, n) if rng.random() < 0.8 else (rng.choice([2, 4]), m, n)
        dtype = "bfloat16" if rng.random() < 0.8 else "float32"
        out.append(MatrixSpec(f"p{i:03d}", shape, dtype))
    return out


# ---------------------------------------------------------------- cost model
@pytest.mark.parametrize(
    "shape,expected",
    [
        ((4, 8), 8 * 4 * 4),
        ((8, 4), 8 * 4 * 4),  # both orientations cost the same
        ((5, 5), 125),
        ((1024, 256), 1024 * 256 * 256),
        ((256, 1024), 1024 * 256 * 256),
        ((3, 4, 8), 3 * 8 * 16),  # 3-D: summed over experts
        ((3, 8, 4), 3 * 8 * 16),
        ((2, 3, 4, 8), 6 * 8 * 16),
    ],
)
def test_newton_schulz_cost_hand_values(shape, expected):
    assert newton_schulz_cost(shape) == expected
    assert isinstance(newton_schulz_cost(shape), float)


def test_newton_schulz_cost_rejects_1d():
    with pytest.raises(ValueError, match="at least 2 dims"):
        newton_schulz_cost((16,))


def test_optimizer_state_bytes():
    assert optimizer_state_bytes(MatrixSpec("a", (4, 8), "float32")) == 128
    assert optimizer_state_bytes(MatrixSpec("a", (4, 8), "bfloat16")) == 256
    assert optimizer_state_bytes(MatrixSpec("a", (4, 8), "float16")) == 256
    assert optimizer_state_bytes(MatrixSpec("a", (4, 8), "bfloat16"), multi_precision=False) == 128
    assert optimizer_state_bytes(MatrixSpec("a", (2, 4, 8), "bfloat16")) == 512


# ---------------------------------------------------------------- accounting
@pytest.mark.parametrize("nranks", [1, 3, 8])
@pytest.mark.parametrize("mp", [True, False])
def test_every_spec_owned_once_and_loads_match(nranks, mp):
    specs = _random_specs(7)
    part = balanced_partition(specs, nranks, multi_precision=mp)
    assert isinstance(part, OwnerPartition)
    assert part.nranks == nranks
    assert sorted(part.owners) == sorted(s.name for s in specs)
    seen = []
    for r in range(nranks):
        seen += part.params_of(r)
    assert sorted(seen) == sorted(s.name for s in specs)  # each exactly once
    by_name = {s.name: s for s in specs}
    for r in range(nranks):
        mine = [by_name[k] for k in part.params_of(r)]
        assert part.state_bytes[r] == sum(_state(s.shape, s.dtype, mp) for s in mine)
        assert part.ns_cost[r] == pytest.approx(sum(_ns(s.shape) for s in mine), rel=0, abs=0)
    assert all(0 <= o < nranks for o in part.owners.values())


def test_params_of_keeps_input_order():
    specs = [MatrixSpec(n, (8, 8)) for n in ["z", "b", "y", "a", "x", "c"]]
    part = balanced_partition(specs, 1)
    assert part.params_of(0) == ["z", "b", "y", "a", "x", "c"]
    with pytest.raises(ValueError):
        part.params_of(1)


# ---------------------------------------------------------------- determinism
@pytest.mark.parametrize("nranks", [2, 5, 8])
def test_same_map_for_shuffled_input(nranks):
    specs = _random_specs(11, count=80)
    ref = balanced_partition(specs, nranks)
    for seed in range(5):
        shuffled = list(specs)
        random.Random(seed).shuffle(shuffled)
        got = balanced_partition(shuffled, nranks)
        assert got.owners == ref.owners
        assert got.state_bytes == ref.state_bytes
        assert got.ns_cost == ref.ns_cost


def test_repeated_calls_identical():
    specs = _random_specs(3)
    maps = [balanced_partition(specs, 6).owners for _ in range(3)]
    assert maps[0] == maps[1] == maps[2]


def test_ties_broken_by_name():
    names = ["d", "a", "c", "b"]
    specs = [MatrixSpec(n, (16, 16)) for n in names]
    for order in (names, sorted(names), list(reversed(names))):
        part = balanced_partition([s for n in order for s in specs if s.name == n], 4)
        assert part.owners == {"a": 0, "b": 1, "c": 2, "d": 3}


def test_rank_order_tie_breaking_honoured():
    specs = [MatrixSpec(n, (16, 16)) for n in "abcd"]
    part = balanced_partition(specs, 4, rank_order=[2, 0, 3, 1])
    assert part.owners == {"a": 2, "b": 0, "c": 3, "d": 1}
    # fewer matrices than ranks: the preferred ranks own, the rest stay empty
    part = balanced_partition(specs[:2], 4, rank_order=[3, 1, 0, 2])
    assert part.owners == {"a": 3, "b": 1}
    assert part.empty_ranks() == [0, 2]


def test_rank_order_interleaving_spreads_over_nodes():
    # 2 nodes x 4 cards; interleave node then card: 0,4,1,5,2,6,3,7
    order = [0, 4, 1, 5, 2, 6, 3, 7]
    specs = [MatrixSpec(f"m{i}", (32, 32)) for i in range(4)]
    part = balanced_partition(specs, 8, rank_order=order)
    owners = sorted(part.owners.values())
    assert owners == [0, 1, 4, 5]
    assert {o // 4 for o in owners} == {0, 1}  # both nodes
    assert len({o % 4 for o in owners}) == 2


# ---------------------------------------------------------------- balance
def test_equal_matrices_split_evenly():
    specs = [MatrixSpec(f"w{i}", (64, 32), "bfloat16") for i in range(8)]
    part = balanced_partition(specs, 4)
    assert [len(part.params_of(r)) for r in range(4)] == [2, 2, 2, 2]
    assert part.state_bytes_max_over_mean() == 1.0
    assert part.ns_cost_max_over_mean() == 1.0


def test_one_big_many_small_optimum():
    # same min dim (32) so bytes and NS agree; optimum: big alone, 4 small per rank
    big = MatrixSpec("big", (32, 128))
    small = [MatrixSpec(f"s{i:02d}", (32, 32)) for i in range(12)]
    specs = small[:5] + [big] + small[5:]
    part = balanced_partition(specs, 4)
    assert part.params_of(part.owners["big"]) == ["big"]
    assert sorted(len(part.params_of(r)) for r in range(4)) == [1, 4, 4, 4]
    assert part.state_bytes_max_over_mean() == 1.0
    assert part.ns_cost_max_over_mean() == 1.0


def test_balance_weighs_ns_cost_not_only_bytes():
    # same numel, very different NS cost: square vs skinny
    specs = [MatrixSpec(f"sq{i}", (64, 64)) for i in range(4)] + [
        MatrixSpec(f"sk{i}", (256, 16)) for i in range(4)
    ]
    part = balanced_partition(specs, 4)
    # each rank gets one square + one skinny: bytes and NS both exact
    for r in range(4):
        kinds = sorted(k[:2] for k in part.params_of(r))
        assert kinds == ["sk", "sq"]
    assert part.ns_cost_max_over_mean() == 1.0
    assert part.state_bytes_max_over_mean() == 1.0


def test_more_ranks_than_matrices():
    specs = [MatrixSpec(f"m{i}", (8, 8)) for i in range(3)]
    part = balanced_partition(specs, 5)
    assert sorted(part.owners.values()) == [0, 1, 2]
    assert part.empty_ranks() == [3, 4]


def test_3d_expert_weight_owned_whole():
    specs = [MatrixSpec("experts", (8, 64, 32), "bfloat16")] + [
        MatrixSpec(f"a{i}", (64, 32), "bfloat16") for i in range(8)
    ]
    part = balanced_partition(specs, 2)
    # the 3-D weight equals the 8 matrices: it sits alone
    assert part.params_of(part.owners["experts"]) == ["experts"]
    assert part.state_bytes_max_over_mean() == 1.0


def test_balance_floor():
    specs = [MatrixSpec(f"m{i}", (32, 32)) for i in range(9)]
    fb, fc = balance_floor(specs, 4)  # 3 of 9 equal on one rank: 3 / 2.25
    assert fb == pytest.approx(3 / 2.25)
    assert fc == pytest.approx(3 / 2.25)
    part = balanced_partition(specs, 4)
    assert part.state_bytes_max_over_mean() == pytest.approx(fb)
    assert balance_floor([], 4) == (1.0, 1.0)


# ---------------------------------------------------------------- upstream
def test_upstream_fills_only_first_ranks():
    # 10 x 1 MiB fp32 matrices, 3 MiB buffer: ceil(10/3) = 4 ranks own everything
    specs = [MatrixSpec(f"w{i}", (512, 512), "float32") for i in range(10)]
    part = upstream_partition(specs, 8, buffer_size_MB=3)
    used = sorted(set(part.owners.values()))
    assert used == [0, 1, 2, 3] == list(range(math.ceil(10 / 3)))
    assert [len(part.params_of(r)) for r in range(8)] == [3, 3, 3, 1, 0, 0, 0, 0]
    assert part.empty_ranks() == [4, 5, 6, 7]
    # ours on the same case: every rank owns something
    assert balanced_partition(specs, 8).empty_ranks() == []


def test_upstream_last_rank_takes_remainder():
    specs = [MatrixSpec(f"w{i}", (512, 512), "float32") for i in range(10)]
    part = upstream_partition(specs, 2, buffer_size_MB=3)
    assert [len(part.params_of(r)) for r in range(2)] == [3, 7]


def test_upstream_on_preset_uses_at_most_ceil_total_over_buffer(presets):
    params = presets.get_preset("ernie-moe-small")
    specs = presets.muon_specs(params)
    nbytes = sum(p.numel * (2 if p.dtype == "bfloat16" else 4) for p in params if p.use_muon)
    total_mb = nbytes / 2**20
    part = upstream_partition(specs, 64, buffer_size_MB=256)
    used = set(part.owners.values())
    assert used <= set(range(math.ceil(total_mb / 256)))
    assert len(part.empty_ranks()) >= 64 - math.ceil(total_mb / 256)
    with pytest.raises(ValueError, match="buffer_size_MB"):
        upstream_partition(specs, 4, buffer_size_MB=0)


# ---------------------------------------------------------------- minority dtype
def test_small_minority_dtype_gets_one_owner():
    specs = [MatrixSpec(f"w{i:02d}", (64, 64), "bfloat16") for i in range(64)]
    specs += [MatrixSpec(f"gate{i}", (64, 16), "float32") for i in range(6)]
    part = balanced_partition(specs, 8)
    assert len(part.owners_by_dtype()["float32"]) == 1
    assert len(part.owners_by_dtype()["bfloat16"]) == 8
    assert part.num_buffers() == 9
    # best possible with whole matrices: 8 bf16 + all gates on one rank
    mean = sum(part.state_bytes) / 8
    assert max(part.state_bytes) == 8 * 64 * 64 * 8 + 6 * 64 * 16 * 4
    assert max(part.state_bytes) / mean < 1.09


def test_minority_dtype_owner_count_capped_by_its_size():
    # fp32 class ~1.85 rank shares of NS cost -> at most 2 owners
    specs = [MatrixSpec(f"b{i:02d}", (64, 64), "bfloat16") for i in range(40)]
    specs += [MatrixSpec(f"f{i:02d}", (64, 64), "float32") for i in range(12)]
    part = balanced_partition(specs, 8)
    fp32_owners = part.owners_by_dtype()["float32"]
    assert 1 <= len(fp32_owners) <= 2
    # its owners hold whole fp32 loads; the majority class fills around them
    assert part.ns_cost_max_over_mean() <= 1.10


@pytest.mark.parametrize("nranks", [8, 16, 64])
def test_minority_dtype_rule_on_preset(presets, nranks):
    specs = presets.muon_specs(presets.get_preset("ernie-moe-small"))
    part = balanced_partition(specs, nranks)
    by = part.owners_by_dtype()
    assert len(by["float32"]) == 1  # the fp32 router gates: one buffer
    assert len(by["bfloat16"]) == nranks


# ---------------------------------------------------------------- validation
def test_validation_errors():
    specs = [MatrixSpec("a", (4, 4))]
    with pytest.raises(ValueError, match="nranks must be >= 1"):
        balanced_partition(specs, 0)
    with pytest.raises(ValueError, match="nranks must be >= 1"):
        upstream_partition(specs, -1)
    with pytest.raises(TypeError, match="nranks must be an int"):
        balanced_partition(specs, 2.0)
    with pytest.raises(ValueError, match="duplicate parameter name.*'a'"):
        dup = [MatrixSpec("a", (4, 4)), MatrixSpec("b", (4, 4)), MatrixSpec("a", (8, 8))]
        balanced_partition(dup, 2)
    with pytest.raises(ValueError, match="duplicate parameter name.*'a'"):
        upstream_partition([MatrixSpec("a", (4, 4)), MatrixSpec("a", (4, 4))], 2)
    with pytest.raises(ValueError, match="at least 2 dims"):
        balanced_partition([MatrixSpec("v", (4,))], 2)
    with pytest.raises(ValueError, match="unsupported dtype"):
        balanced_partition([MatrixSpec("a", (4, 4), "int7")], 2)
    with pytest.raises(ValueError, match="rank_order must be a permutation"):
        balanced_partition(specs, 3, rank_order=[0, 1, 1])
    with pytest.raises(ValueError, match="rank_order must be a permutation"):
        balanced_partition(specs, 3, rank_order=[0, 1])


def test_empty_specs_all_ranks_empty():
    for fn in (balanced_partition, upstream_partition):
        part = fn([], 4)
        assert part.owners == {}
        assert part.state_bytes == [0, 0, 0, 0]
        assert part.ns_cost == [0.0] * 4
        assert all(part.params_of(r) == [] for r in range(4))
        assert part.empty_ranks() == [0, 1, 2, 3]
        assert part.state_bytes_max_over_mean() == 1.0
        assert part.ns_cost_max_over_mean() == 1.0


def test_dtype_aliases_normalised():
    a = balanced_partition([MatrixSpec("a", (4, 4), "paddle.bfloat16")], 1)
    assert a.dtypes == {"a": "bfloat16"}
    assert a.state_bytes == [4 * 4 * 8]


def test_summary_fields():
    part = balanced_partition(_random_specs(5), 4)
    s = part.summary()
    for key in (
        "nranks",
        "num_params",
        "state_bytes_max_over_mean",
        "ns_cost_max_over_mean",
        "empty_ranks",
        "num_buffers",
        "owners_by_dtype",
    ):
        assert key in s
    json.dumps(s)  # printable / serialisable


# ---------------------------------------------------------------- presets
def test_presets(presets, tmp_path):
    assert {"ernie-moe-small", "tiny"} <= set(presets.list_presets())
    params = presets.get_preset("ernie-moe-small")
    muon = [p for p in params if p.use_muon]
    assert len(muon) >= 200
    assert any(p.is_expert for p in muon) and any(not p.is_expert for p in muon)
    assert {p.dtype for p in params} == {"bfloat16", "float32"}
    for p in params:
        if "embed" in p.name or "lm_head" in p.name or len(p.shape) < 2:
            assert not p.use_muon, p.name
    fused = presets.get_preset("ernie-moe-small-fused")
    assert any(len(p.shape) == 3 and p.is_expert and p.use_muon for p in fused)
    tiny = presets.get_preset("tiny")
    assert 3 <= sum(p.use_muon for p in tiny) <= 10
    with pytest.raises(ValueError, match="unknown preset"):
        presets.get_preset("nope")
    # JSON round trip; use_muon / is_expert / dtype optional on load
    path = tmp_path / "params.json"
    presets.dump_json(tiny, str(path))
    assert presets.load_json(str(path)) == tiny
    path2 = tmp_path / "min.json"
    entries = [{"name": "x.weight", "shape": [4, 4]}, {"name": "x.bias", "shape": [4]}]
    path2.write_text(json.dumps(entries))
    loaded = presets.load_json(str(path2))
    assert [(p.use_muon, p.dtype, p.is_expert) for p in loaded] == [
        (True, "float32", False),
        (False, "float32", False),
    ]


# ---------------------------------------------------------------- benchmark targets
def test_benchmark_meets_targets(bench_mod):
    fig = bench_mod.bench("ernie-moe-small", (8, 16, 64))
    assert fig["num_matrices"] >= 200
    for n in (8, 16, 64):
        c = fig["cases"][n]
        assert c["ours"]["state_max_over_mean"] <= 1.05, (n, c)
        assert c["ours"]["ns_max_over_mean"] <= 1.10, (n, c)
        assert c["ours"]["empty_ranks"] == 0
        assert c["meets_targets"]
        # upstream is clearly worse from 16 ranks on
        if n >= 16:
            assert c["upstream"]["empty_ranks"] > 0
            assert c["upstream"]["state_max_over_mean"] > 1.5
    text = bench_mod.format_table(fig)
    assert "upstream buffer=256 MB" in text and "OK" in text


def test_benchmark_flags_impossible_case(bench_mod):
    fig = bench_mod.bench("ernie-moe-small-fused", (64,))
    c = fig["cases"][64]
    assert not c["achievable"]
    assert "IMPOSSIBLE" in bench_mod.format_table(fig)
