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
"""ShardingLayout: placement as data, equal to what Paddle's buffers do.

* element-wise ranges equal FusedCommBuffer's REDUCE_SCATTER views and the
  Muon chunks' sizes equal its REDUCE buffers, built for real on CPU;
* buckets stay per (colour, owner, dtype) and chunk like the size limit says;
* owners, buckets and schedules are identical in processes with different
  PYTHONHASHSEED (threads of one interpreter cannot see hash-order bugs).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import unittest

import paddle
from paddle.distributed.fleet.utils import tensor_fusion_helper as tfh

from muon_layout_helpers import _hier, _muon
from muon_test_compat import register_cpu_tensor_fusion
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import settings as mst
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.layout import (
    LayoutSettings,
    ParamMeta,
    ShardingLayout,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.layout import chunk_by_size
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.layout import NO_HOOK_COLOURS


class _Group:
    """What FusedCommBuffer reads of a group at construction."""

    def __init__(self, ranks, rank):
        self.ranks = list(ranks)
        self.nranks = len(ranks)
        self.rank = self.ranks.index(rank)
        self.id = 0


def _param(name, shape, dtype):
    p = paddle.create_parameter(list(shape), dtype,
                                default_initializer=paddle.nn.initializer.Constant(0.5))
    p.name = name
    return p


# Sizes chosen around the 256-byte alignment: exact multiples, one element
# over, a parameter smaller than one alignment unit, odd numels.
SHAPES = [(7,), (64,), (65,), (3, 5), (128,), (1,), (33, 9)]


class TestRangesMatchFusedCommBuffer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        register_cpu_tensor_fusion()

    def _check(self, dtype, nranks):
        params = [_param(f"p{i}", s, dtype) for i, s in enumerate(SHAPES)]
        metas = [ParamMeta(p.name, tuple(p.shape), str(p.dtype)) for p in params]
        ranks = list(range(10, 10 + nranks))
        for rank in ranks:
            layout = ShardingLayout.build(metas, {None: ranks}, rank,
                                          LayoutSettings(comm_buffer_size_MB=-1))
            [spec] = layout.slice_buffers
            buf = tfh.FusedCommBuffer("t", params, _Group(ranks, rank),
                                      act=tfh.HOOK_ACTION.REDUCE_SCATTER)
            if hasattr(params[0], "comm_buffer_ref"):
                del params[0].comm_buffer_ref
            self.assertEqual(spec.total, buf.buffer_size, (dtype, nranks))
            for p in params:
                view = buf._sharding_param_grad_view[p.name]
                numel = int(p.numel())
                begin = min(view._param_begin - view._index, numel)
                end = max(begin, min(view._param_end - view._index, numel))
                real = (begin, end) if view.has_effective_slice_param and end > begin else (0, 0)
                self.assertEqual(layout.local_range(p.name), real,
                                 f"{p.name} {dtype} rank {rank} of {nranks}")
                self.assertEqual(spec.holds_slice(p.name, ranks.index(rank)),
                                 view.has_effective_slice_param)

    def test_float32_and_bfloat16_over_group_sizes(self):
        for dtype in ("float32", "bfloat16"):
            for nranks in (1, 2, 3, 8):
                self._check(dtype, nranks)

    def test_muon_chunk_numel_is_reduce_buffer_size(self):
        params = [_param(f"m{i}", s, "float32") for i, s in enumerate([(3, 5), (8, 8), (9, 7)])]
        metas = [ParamMeta(p.name, tuple(p.shape), "float32", None, True) for p in params]
        layout = ShardingLayout.build(metas, {None: [0]}, 0)
        [bucket] = layout.muon_buckets
        buf = tfh.FusedCommBuffer("m", params, _Group([0], 0), act=tfh.HOOK_ACTION.REDUCE,
                                  dst=0)
        self.assertEqual(bucket.chunk_numels, (int(buf.grad_storage.numel()),))
        self.assertEqual(bucket.numel, sum(int(p.numel()) for p in params))


class TestBucketsAndRoutes(unittest.TestCase):
    def test_buckets_per_owner_and_dtype_in_group_order(self):
        metas = [_muon("a", (64, 64)), _muon("b", (64, 64), "bfloat16"),
                 _muon("c", (64, 64)), _muon("d", (64, 64), "bfloat16"),
                 ParamMeta("n", (64,), "float32")]
        layout = ShardingLayout.build(metas, {None: [0, 1]}, 1,
                                      LayoutSettings(partition_strategy="upstream_greedy"))
        # develop's rule puts all four on rank 0 (24 kB < one 256 MB buffer):
        # one bucket per dtype, never a mixed-dtype buffer
        self.assertEqual(set(layout.owners.values()), {0})
        self.assertEqual([(b.owner, b.dtype, b.params) for b in layout.muon_buckets],
                         [(0, "bfloat16", ("b", "d")), (0, "float32", ("a", "c"))])
        self.assertEqual([len(b.chunks) for b in layout.muon_buckets], [1, 1])
        small = ShardingLayout.build(metas, {None: [0, 1]}, 1,
                                     LayoutSettings(partition_strategy="upstream_greedy",
                                                    comm_buffer_size_MB=1e-3))
        # 1 kB limit: every matrix (8 or 16 kB) is its own chunk
        self.assertEqual(sum(len(b.chunks) for b in small.muon_buckets), 4)
        self.assertEqual(layout.local_range("a"), (0, 0))
        # 64 fp32 elements pad to 2 x 64 (alignment 64 elements x 2 ranks): rank
        # 0's shard holds all of it, rank 1's only padding
        self.assertEqual(layout.local_range("n"), (0, 0))
        self.assertEqual(dataclasses.replace(layout, rank=0).local_range("n"), (0, 64))

    def test_chunks_close_at_the_size_limit_and_never_split_an_item(self):
        mb = 1024 * 1024
        self.assertEqual(chunk_by_size([mb, mb, 3 * mb, mb], 2), [[0, 1], [2], [3]])
        self.assertEqual(chunk_by_size([5, 6], 0), [[0], [1]])
        self.assertEqual(chunk_by_size([], 1), [])

    def test_errors_name_the_colour_and_rank(self):
        with self.assertRaisesRegex(ValueError, "colour 'x' but no group"):
            ShardingLayout.build([_muon("a", (4, 4), colour="x")], {None: [0]}, 0)
        with self.assertRaisesRegex(ValueError, "rank 3 is not in the group of colour None"):
            ShardingLayout.build([_muon("a", (4, 4))], {None: [0, 1]}, 3)
        with self.assertRaisesRegex(ValueError, "partition_strategy='bogus'"):
            ShardingLayout.build([_muon("a", (4, 4))], {None: [0, 1]}, 0,
                                 LayoutSettings(partition_strategy="bogus"))
        with self.assertRaises(KeyError):
            ShardingLayout.build([_muon("a", (4, 4))], {None: [0]}, 0).local_range("zz")

    def test_unknown_dtype_is_refused_by_name_not_sized_as_four_bytes(self):
        # A guessed element size would misplace every later parameter of its
        # fused buffer; the error names the dtype and the ones that work.
        with self.assertRaisesRegex(ValueError, r"unknown dtype 'complex64'.*int64"):
            ParamMeta("z", (8,), "complex64")
        self.assertEqual(ParamMeta("i", (8,), "paddle.INT64").nbytes, 64)
        self.assertEqual(ParamMeta("h", (8,), "half").nbytes, 16)
        with self.assertRaisesRegex(ValueError, r"unsupported dtype 'int64' for a Muon matrix"):
            mst.dtype_itemsize("int64")

    def test_dtype_names_and_layout_queries(self):
        for given, want in [("paddle.float32", "float32"), ("FP32", "float32"),
                            ("bf16", "bfloat16"), ("half", "float16"),
                            ("paddle.int64", "int64"), ("complex64", "complex64")]:
            self.assertEqual(mst.canonical_dtype(given), want,
                             f"canonical_dtype({given!r}) should be {want!r}")
        layout = ShardingLayout.build(
            [_muon("a", (4, 4)), _muon("c", (4, 4)), ParamMeta("b", (8,), "float32")],
            {None: [0, 1]}, 0, fixed_owners={"a": 1, "c": 0})
        self.assertEqual(layout.local_range("a"), (0, 0), "rank 0 updates none of rank 1's matrix")
        self.assertEqual(layout.local_range("c"), (0, 16), "an owned matrix is updated whole")
        with self.assertRaisesRegex(KeyError, "element-wise"):
            layout.slice_buffer_of("a")
        self.assertEqual({tuple(op.group) for op in layout.schedule()}, {(0, 1)},
                         "a flat layout uses only its colour groups")
        plan, hier = _hier(overlap=False)
        self.assertEqual(
            {tuple(op.group) for op in hier.schedule()},
            {tuple(range(8)), tuple(plan.moe_sharding_ranks(5)),
             tuple(plan.node_ranks(plan.node_of(5))),
             tuple(plan.same_card_ranks(0, plan.card_of(5)))},
            "a hierarchical layout adds rank 5's node and same-card groups")

    def test_broadcast_payload_counts_the_dtype_size(self):
        # payload feeds the plan's byte figures: bf16 is 2 bytes an element,
        # on the staged sync (develop's default) and on the plain sync alike
        metas = [_muon("a", (16, 8), "bfloat16"), _muon("b", (8, 8), "bfloat16"),
                 _muon("c", (4, 4))]
        for staged in (True, False):
            layout = ShardingLayout.build(metas, {None: [0, 1]}, 0,
                                          LayoutSettings(overlap_sync=staged))
            bcasts = [op for op in layout.schedule() if op.op == "broadcast"]
            self.assertTrue(bcasts, "no broadcast in the schedule")
            for op in bcasts:
                want = op.numel * {"bfloat16": 2, "float32": 4}[op.dtype]
                self.assertEqual(op.payload, want,
                                 f"staged={staged}: {op.dtype} broadcast of {op.numel} "
                                 f"elements carries {op.payload} bytes, not {want}")


_DETERMINISM_SCRIPT = r"""
import dataclasses, json, sys
from paddle.distributed.fleet.base.topology import CommunicateTopology
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.comm_plan import (
    HierarchicalCommPlan,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.layout import (
    LayoutSettings, ParamMeta, ShardingLayout)

out = {}
# Equal-size matrices (ties everywhere), two dtypes, experts and vectors.
metas = []
for i in range(12):
    metas.append(ParamMeta(f"layer{i}.w", (64, 64), "bfloat16", None, True))
    metas.append(ParamMeta(f"layer{i}.gate", (64, 8), "float32", None, True))
    metas.append(ParamMeta(f"layer{i}.norm", (64,), "float32"))
    for e in range(3):
        metas.append(ParamMeta(f"layer{i}.expert{e}", (64, 32), "bfloat16", "moe_expert", True))
for ms, ep, gpn in ((2, 4, 2), (2, 8, 4), (4, 4, 8)):
    topo = CommunicateTopology(["moe_sharding", "pipe", "expert"], [ms, 1, ep])
    plan = HierarchicalCommPlan.from_topology(topo, gpn)
    for rule in ("balanced", "upstream_greedy"):
        for overlap in (False, True):
            settings = LayoutSettings(comm_buffer_size_MB=0.01, comm_overlap=overlap,
                                      partition_strategy=rule)
            for rank in range(plan.world_size):
                groups = {None: plan.sharding_group_ranks(0),
                          "moe_expert": plan.moe_sharding_ranks(rank)}
                layout = ShardingLayout.build(metas, groups, rank, settings, plan)
                out[f"ms{ms}-ep{ep}-gpn{gpn}-{rule}-{overlap}-r{rank}"] = {
                    "owners": layout.owners,
                    "muon_buckets": [dataclasses.astuple(b) for b in layout.muon_buckets],
                    "slice_buffers": [dataclasses.astuple(s) for s in layout.slice_buffers],
                    "schedule": [[op.trigger, *op.key()] for op in layout.schedule()]}
json.dump(out, sys.stdout, sort_keys=True)
"""


class TestCrossProcessDeterminism(unittest.TestCase):
    def test_identical_under_different_hash_seeds(self):
        env = dict(os.environ)
        results = []
        for seed in ("0", "1", "4242"):
            env["PYTHONHASHSEED"] = seed
            proc = subprocess.run([sys.executable, "-c", _DETERMINISM_SCRIPT], env=env,
                                  capture_output=True, text=True, timeout=600)
            self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
            results.append(proc.stdout)
        data = json.loads(results[0])
        self.assertGreater(len(data), 100)
        self.assertTrue(any(d["schedule"] for d in data.values()))
        for seed, text in zip(("1", "4242"), results[1:]):
            if text != results[0]:
                other = json.loads(text)
                bad = next(k for k in data if data[k] != other.get(k))
                self.fail(f"layout {bad} differs between PYTHONHASHSEED=0 and {seed}")


class TestNoHookColoursInTheLayout(unittest.TestCase):
    """Bug: the layout forgets NO_HOOK_COLOURS (route ``+overlap``, hook trigger)."""

    def test_no_hook_colours_reduce_in_reduce_gradients(self):
        metas = [ParamMeta("w", (16, 16), "float32", None, True),
                 ParamMeta("b", (16,), "float32", None, False)]
        for colour in NO_HOOK_COLOURS:
            metas += [ParamMeta(f"{colour}.w", (16, 16), "float32", colour, True),
                      ParamMeta(f"{colour}.b", (16,), "float32", colour, False)]
        groups = {key: (0, 1) for key in (None, *NO_HOOK_COLOURS)}
        layout = ShardingLayout.build(metas, groups, 0, LayoutSettings(comm_overlap=True))
        for bucket in layout.muon_buckets:
            hooked = bucket.colour not in NO_HOOK_COLOURS
            self.assertEqual(bucket.route_kind, "flat+overlap" if hooked else "flat",
                             f"colour {bucket.colour!r}: route {bucket.route_kind}")
        for buf in layout.slice_buffers:
            self.assertEqual(buf.overlap, buf.colour not in NO_HOOK_COLOURS,
                             f"colour {buf.colour!r}: 1-D buffer overlap={buf.overlap}")
        triggers = {}
        for op in layout.schedule():
            if op.op in ("reduce", "reduce_scatter"):
                triggers.setdefault(op.colour, set()).add(op.trigger)
        self.assertEqual(triggers[None], {"backward"}, "the default colour reduces from hooks")
        for colour in NO_HOOK_COLOURS:
            self.assertEqual(triggers[colour], {"reduce_gradients"},
                             f"{colour} must be reduced by reduce_gradients only")


if __name__ == "__main__":
    unittest.main()
