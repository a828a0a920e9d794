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
upstream baseline, minority-dtype rule, rank_order, validation.

The model presets and the benchmark targets are tools and are tested with
them (test/tools/test_bench_partition.py).
"""

import json
import math
import random
import unittest

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_partition import (
    MatrixSpec,
    OwnerPartition,
    balance_floor,
    balanced_partition,
    newton_schulz_cost,
    optimizer_state_bytes,
    upstream_partition,
)


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


class TestCostModel(unittest.TestCase):
    def test_newton_schulz_cost_hand_values(self):
        cases = [
            ((4, 8), 8 * 4 * 4),
            ((8, 4), 8 * 4 * 4),  # both orientations cost the same
            ((5, 5), 125),
            ((1024, 256), 1024 * 256 * 256),
            ((256, 1024), 1024 * 256 * 256),
            ((3, 4, 8), 3 * 8 * 16),  # 3-D: summed over experts
            ((3, 8, 4), 3 * 8 * 16),
            ((2, 3, 4, 8), 6 * 8 * 16),
        ]
        for shape, expected in cases:
            with self.subTest(shape=shape):
                self.assertEqual(newton_schulz_cost(shape), expected)
                self.assertIsInstance(newton_schulz_cost(shape), float)

    def test_newton_schulz_cost_rejects_1d(self):
        with self.assertRaisesRegex(ValueError, "at least 2 dims"):
            newton_schulz_cost((16,))

    def test_optimizer_state_bytes(self):
        self.assertEqual(optimizer_state_bytes(MatrixSpec("a", (4, 8), "float32")), 128)
        self.assertEqual(optimizer_state_bytes(MatrixSpec("a", (4, 8), "bfloat16")), 256)
        self.assertEqual(optimizer_state_bytes(MatrixSpec("a", (4, 8), "float16")), 256)
        self.assertEqual(optimizer_state_bytes(MatrixSpec("a", (4, 8), "bfloat16"),
                                               multi_precision=False), 128)
        self.assertEqual(optimizer_state_bytes(MatrixSpec("a", (2, 4, 8), "bfloat16")), 512)


class TestAccounting(unittest.TestCase):
    def test_every_spec_owned_once_and_loads_match(self):
        for nranks in (1, 3, 8):
            for mp in (True, False):
                with self.subTest(nranks=nranks, mp=mp):
                    self._check_owned_once(nranks, mp)

    def _check_owned_once(self, nranks, mp):
        specs = _random_specs(7)
        part = balanced_partition(specs, nranks, multi_precision=mp)
        self.assertIsInstance(part, OwnerPartition)
        self.assertEqual(part.nranks, nranks)
        self.assertEqual(sorted(part.owners), sorted(s.name for s in specs))
        seen = []
        for r in range(nranks):
            seen += part.params_of(r)
        self.assertEqual(sorted(seen), sorted(s.name for s in specs))  # each exactly once
        by_name = {s.name: s for s in specs}
        for r in range(nranks):
            mine = [by_name[k] for k in part.params_of(r)]
            self.assertEqual(part.state_bytes[r],
                             sum(_state(s.shape, s.dtype, mp) for s in mine))
            self.assertEqual(part.ns_cost[r], sum(_ns(s.shape) for s in mine))
        self.assertTrue(all(0 <= o < nranks for o in part.owners.values()))

    def test_params_of_keeps_input_order(self):
        specs = [MatrixSpec(n, (8, 8)) for n in ["z", "b", "y", "a", "x", "c"]]
        part = balanced_partition(specs, 1)
        self.assertEqual(part.params_of(0), ["z", "b", "y", "a", "x", "c"])
        with self.assertRaises(ValueError):
            part.params_of(1)


class TestDeterminism(unittest.TestCase):
    def test_same_map_for_shuffled_input(self):
        for nranks in (2, 5, 8):
            specs = _random_specs(11, count=80)
            ref = balanced_partition(specs, nranks)
            for seed in range(5):
                with self.subTest(nranks=nranks, seed=seed):
                    shuffled = list(specs)
                    random.Random(seed).shuffle(shuffled)
                    got = balanced_partition(shuffled, nranks)
                    self.assertEqual(got.owners, ref.owners)
                    self.assertEqual(got.state_bytes, ref.state_bytes)
                    self.assertEqual(got.ns_cost, ref.ns_cost)

    def test_repeated_calls_identical(self):
        specs = _random_specs(3)
        maps = [balanced_partition(specs, 6).owners for _ in range(3)]
        self.assertEqual(maps[0], maps[1])
        self.assertEqual(maps[1], maps[2])

    def test_ties_broken_by_name(self):
        names = ["d", "a", "c", "b"]
        specs = [MatrixSpec(n, (16, 16)) for n in names]
        for order in (names, sorted(names), list(reversed(names))):
            part = balanced_partition([s for n in order for s in specs if s.name == n], 4)
            self.assertEqual(part.owners, {"a": 0, "b": 1, "c": 2, "d": 3})

    def test_rank_order_tie_breaking_honoured(self):
        specs = [MatrixSpec(n, (16, 16)) for n in "abcd"]
        part = balanced_partition(specs, 4, rank_order=[2, 0, 3, 1])
        self.assertEqual(part.owners, {"a": 2, "b": 0, "c": 3, "d": 1})
        # fewer matrices than ranks: the preferred ranks own, the rest stay empty
        part = balanced_partition(specs[:2], 4, rank_order=[3, 1, 0, 2])
        self.assertEqual(part.owners, {"a": 3, "b": 1})
        self.assertEqual(part.empty_ranks(), [0, 2])

    def test_rank_order_interleaving_spreads_over_nodes(self):
        # 2 nodes x 4 cards; interleave node then card: 0,4,1,5,2,6,3,7
        order = [0, 4, 1, 5, 2, 6, 3, 7]
        specs = [MatrixSpec(f"m{i}", (32, 32)) for i in range(4)]
        part = balanced_partition(specs, 8, rank_order=order)
        owners = sorted(part.owners.values())
        self.assertEqual(owners, [0, 1, 4, 5])
        self.assertEqual({o // 4 for o in owners}, {0, 1})  # both nodes
        self.assertEqual(len({o % 4 for o in owners}), 2)


class TestBalance(unittest.TestCase):
    def test_equal_matrices_split_evenly(self):
        specs = [MatrixSpec(f"w{i}", (64, 32), "bfloat16") for i in range(8)]
        part = balanced_partition(specs, 4)
        self.assertEqual([len(part.params_of(r)) for r in range(4)], [2, 2, 2, 2])
        self.assertEqual(part.state_bytes_max_over_mean(), 1.0)
        self.assertEqual(part.ns_cost_max_over_mean(), 1.0)

    def test_one_big_many_small_optimum(self):
        # same min dim (32) so bytes and NS agree; optimum: big alone, 4 small per rank
        big = MatrixSpec("big", (32, 128))
        small = [MatrixSpec(f"s{i:02d}", (32, 32)) for i in range(12)]
        specs = small[:5] + [big] + small[5:]
        part = balanced_partition(specs, 4)
        self.assertEqual(part.params_of(part.owners["big"]), ["big"])
        self.assertEqual(sorted(len(part.params_of(r)) for r in range(4)), [1, 4, 4, 4])
        self.assertEqual(part.state_bytes_max_over_mean(), 1.0)
        self.assertEqual(part.ns_cost_max_over_mean(), 1.0)

    def test_balance_weighs_ns_cost_not_only_bytes(self):
        # same numel, very different NS cost: square vs skinny
        specs = [MatrixSpec(f"sq{i}", (64, 64)) for i in range(4)] + [
            MatrixSpec(f"sk{i}", (256, 16)) for i in range(4)
        ]
        part = balanced_partition(specs, 4)
        # each rank gets one square + one skinny: bytes and NS both exact
        for r in range(4):
            self.assertEqual(sorted(k[:2] for k in part.params_of(r)), ["sk", "sq"])
        self.assertEqual(part.ns_cost_max_over_mean(), 1.0)
        self.assertEqual(part.state_bytes_max_over_mean(), 1.0)

    def test_more_ranks_than_matrices(self):
        specs = [MatrixSpec(f"m{i}", (8, 8)) for i in range(3)]
        part = balanced_partition(specs, 5)
        self.assertEqual(sorted(part.owners.values()), [0, 1, 2])
        self.assertEqual(part.empty_ranks(), [3, 4])

    def test_3d_expert_weight_owned_whole(self):
        specs = [MatrixSpec("experts", (8, 64, 32), "bfloat16")] + [
            MatrixSpec(f"a{i}", (64, 32), "bfloat16") for i in range(8)
        ]
        part = balanced_partition(specs, 2)
        # the 3-D weight equals the 8 matrices: it sits alone
        self.assertEqual(part.params_of(part.owners["experts"]), ["experts"])
        self.assertEqual(part.state_bytes_max_over_mean(), 1.0)

    def test_balance_floor(self):
        specs = [MatrixSpec(f"m{i}", (32, 32)) for i in range(9)]
        fb, fc = balance_floor(specs, 4)  # 3 of 9 equal on one rank: 3 / 2.25
        self.assertAlmostEqual(fb, 3 / 2.25, places=12)
        self.assertAlmostEqual(fc, 3 / 2.25, places=12)
        part = balanced_partition(specs, 4)
        self.assertAlmostEqual(part.state_bytes_max_over_mean(), fb, places=12)
        self.assertEqual(balance_floor([], 4), (1.0, 1.0))


class TestUpstreamRule(unittest.TestCase):
    def test_upstream_fills_only_first_ranks(self):
        # 10 x 1 MiB fp32 matrices, 3 MiB buffer: ceil(10/3) = 4 ranks own everything
        specs = [MatrixSpec(f"w{i}", (512, 512), "float32") for i in range(10)]
        part = upstream_partition(specs, 8, buffer_size_MB=3)
        used = sorted(set(part.owners.values()))
        self.assertEqual(used, [0, 1, 2, 3])
        self.assertEqual(used, list(range(math.ceil(10 / 3))))
        self.assertEqual([len(part.params_of(r)) for r in range(8)],
                         [3, 3, 3, 1, 0, 0, 0, 0])
        self.assertEqual(part.empty_ranks(), [4, 5, 6, 7])
        # ours on the same case: every rank owns something
        self.assertEqual(balanced_partition(specs, 8).empty_ranks(), [])

    def test_upstream_last_rank_takes_remainder(self):
        specs = [MatrixSpec(f"w{i}", (512, 512), "float32") for i in range(10)]
        part = upstream_partition(specs, 2, buffer_size_MB=3)
        self.assertEqual([len(part.params_of(r)) for r in range(2)], [3, 7])

    def test_upstream_rejects_empty_buffer(self):
        with self.assertRaisesRegex(ValueError, "buffer_size_MB"):
            upstream_partition([MatrixSpec("a", (4, 4))], 4, buffer_size_MB=0)


class TestMinorityDtype(unittest.TestCase):
    def test_small_minority_dtype_gets_one_owner(self):
        specs = [MatrixSpec(f"w{i:02d}", (64, 64), "bfloat16") for i in range(64)]
        specs += [MatrixSpec(f"gate{i}", (64, 16), "float32") for i in range(6)]
        part = balanced_partition(specs, 8)
        self.assertEqual(len(part.owners_by_dtype()["float32"]), 1)
        self.assertEqual(len(part.owners_by_dtype()["bfloat16"]), 8)
        self.assertEqual(part.num_buffers(), 9)
        # best possible with whole matrices: 8 bf16 + all gates on one rank
        mean = sum(part.state_bytes) / 8
        self.assertEqual(max(part.state_bytes), 8 * 64 * 64 * 8 + 6 * 64 * 16 * 4)
        self.assertLess(max(part.state_bytes) / mean, 1.09)

    def test_minority_dtype_owner_count_capped_by_its_size(self):
        # fp32 class ~1.85 rank shares of NS cost -> at most 2 owners
        specs = [MatrixSpec(f"b{i:02d}", (64, 64), "bfloat16") for i in range(40)]
        specs += [MatrixSpec(f"f{i:02d}", (64, 64), "float32") for i in range(12)]
        part = balanced_partition(specs, 8)
        fp32_owners = part.owners_by_dtype()["float32"]
        self.assertTrue(1 <= len(fp32_owners) <= 2, fp32_owners)
        # its owners hold whole fp32 loads; the majority class fills around them
        self.assertLessEqual(part.ns_cost_max_over_mean(), 1.10)


class TestValidation(unittest.TestCase):
    def test_validation_errors(self):
        specs = [MatrixSpec("a", (4, 4))]
        dup = [MatrixSpec("a", (4, 4)), MatrixSpec("b", (4, 4)), MatrixSpec("a", (8, 8))]
        cases = [
            (ValueError, "nranks must be >= 1", lambda: balanced_partition(specs, 0)),
            (ValueError, "nranks must be >= 1", lambda: upstream_partition(specs, -1)),
            (TypeError, "nranks must be an int", lambda: balanced_partition(specs, 2.0)),
            (ValueError, "duplicate parameter name.*'a'", lambda: balanced_partition(dup, 2)),
            (ValueError, "duplicate parameter name.*'a'",
             lambda: upstream_partition([MatrixSpec("a", (4, 4)), MatrixSpec("a", (4, 4))], 2)),
            (ValueError, "at least 2 dims",
             lambda: balanced_partition([MatrixSpec("v", (4,))], 2)),
            (ValueError, "unsupported dtype",
             lambda: balanced_partition([MatrixSpec("a", (4, 4), "int7")], 2)),
            (ValueError, "rank_order must be a permutation",
             lambda: balanced_partition(specs, 3, rank_order=[0, 1, 1])),
            (ValueError, "rank_order must be a permutation",
             lambda: balanced_partition(specs, 3, rank_order=[0, 1])),
        ]
        for exc, fragment, thunk in cases:
            with self.subTest(fragment=fragment):
                with self.assertRaisesRegex(exc, fragment):
                    thunk()

    def test_empty_specs_all_ranks_empty(self):
        for fn in (balanced_partition, upstream_partition):
            with self.subTest(rule=fn.__name__):
                part = fn([], 4)
                self.assertEqual(part.owners, {})
                self.assertEqual(part.state_bytes, [0, 0, 0, 0])
                self.assertEqual(part.ns_cost, [0.0] * 4)
                self.assertTrue(all(part.params_of(r) == [] for r in range(4)))
                self.assertEqual(part.empty_ranks(), [0, 1, 2, 3])
                self.assertEqual(part.state_bytes_max_over_mean(), 1.0)
                self.assertEqual(part.ns_cost_max_over_mean(), 1.0)

    def test_dtype_aliases_normalised(self):
        a = balanced_partition([MatrixSpec("a", (4, 4), "paddle.bfloat16")], 1)
        self.assertEqual(a.dtypes, {"a": "bfloat16"})
        self.assertEqual(a.state_bytes, [4 * 4 * 8])

    def test_summary_fields(self):
        part = balanced_partition(_random_specs(5), 4)
        s = part.summary()
        for key in ("nranks", "num_params", "state_bytes_max_over_mean",
                    "ns_cost_max_over_mean", "empty_ranks", "num_buffers",
                    "owners_by_dtype"):
            self.assertIn(key, s)
        json.dumps(s)  # printable / serialisable


if __name__ == "__main__":
    unittest.main()
