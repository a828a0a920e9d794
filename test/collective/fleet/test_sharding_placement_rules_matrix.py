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
"""The sharding core's placement and stage rules over tables, against brute force.

* fused-buffer chunking: consecutive parameters, a chunk closes before the
  one that would take it past ``comm_buffer_size_MB`` (an exact fit stays),
  a parameter is never split, ``<= 0`` means one reduce per parameter;
* element-wise buffer padding: each parameter rounds up to ``alignment /
  itemsize x multiple`` elements;
* which elements of each parameter a rank of a reduce-scatter buffer holds:
  checked element by element (set intersection of the rank's shard with the
  parameter's real and padded ranges) for group sizes 1-4;
* develop's sync stages: Muon keys of one colour accumulate until their
  elements reach the limit (``>=`` closes), each stage lists the owners of
  its keys, this rank's parameters of a key are updated in the first stage
  that lists the key (the element-wise stages that follow them are pinned
  in ``test_muon_sharding_step_plan``);
* develop's ``reorder_params``: one entry per (owner, dtype), a lone
  parameter of its dtype sent as is, several packed into one buffer the owner
  fills in order (run on a simulated 2-rank world).
"""

from __future__ import annotations

import itertools
import math
import unittest
from collections import OrderedDict
from types import SimpleNamespace

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.layout import (
    LayoutSettings,
    ParamMeta,
    ShardingLayout,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.layout import (
    SliceBufferSpec,
    chunk_by_size,
    padded_numel,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.step_plan import (
    build_sync_stages,
    stage_element_limit,
)

MB = 1024 * 1024


class TestChunkBySize(unittest.TestCase):
    def test_table(self) -> None:
        table = [
            ([MB, MB], 2, [[0, 1]]),                 # an exact fit stays in the chunk
            ([MB, MB, 1], 2, [[0, 1], [2]]),
            ([3 * MB], 1, [[0]]),                    # a parameter is never split
            ([3 * MB, 1], 1, [[0], [1]]),
            ([1, 3 * MB, 1], 1, [[0], [1], [2]]),
            ([MB // 2] * 5, 1, [[0, 1], [2, 3], [4]]),
            ([MB // 2] * 3, 0.75, [[0], [1], [2]]),
            ([1, 2, 3], 0, [[0], [1], [2]]),         # <= 0: one reduce per parameter
            ([1, 2], -1, [[0], [1]]),
            ([], 1, []),
            ([], 0, []),
        ]
        for nbytes, limit, want in table:
            self.assertEqual(chunk_by_size(nbytes, limit), want, (nbytes, limit))


class TestPaddedNumel(unittest.TestCase):
    def test_table(self) -> None:
        for alignment, dtype, size in itertools.product((256, 64, 2), ("float32", "bfloat16",
                                                                       "float64"), (1, 2, 3, 4)):
            itemsize = {"float32": 4, "bfloat16": 2, "float64": 8}[dtype]
            settings = LayoutSettings(alignment_bytes=alignment)
            unit = max(1, alignment // itemsize) * size
            for numel in (0, 1, unit - 1, unit, unit + 1, 3 * unit + 2):
                if numel < 0:
                    continue
                want = math.ceil(numel / unit) * unit
                self.assertEqual(padded_numel(numel, dtype, settings, size), want,
                                 (alignment, dtype, size, numel))


def _spec(numels, pads, n):
    offsets = tuple(itertools.accumulate([0] + list(pads)))[:-1]
    return SliceBufferSpec(colour=None, group=tuple(range(n)), dtype="float32",
                           params=tuple(f"p{i}" for i in range(len(numels))), offsets=offsets,
                           padded=tuple(pads), param_numels=tuple(numels), overlap=False)


class TestSliceRanges(unittest.TestCase):
    LAYOUTS = [
        ([5], [8]),
        ([8], [8]),
        ([3, 5], [4, 8]),
        ([1, 9, 2], [4, 12, 8]),
        ([7, 1], [12, 12]),
        ([0, 4], [0, 12]),
        ([12, 11, 13], [12, 12, 24]),
    ]

    def test_each_rank_holds_exactly_its_shard_of_each_parameter(self) -> None:
        for (numels, pads), n in itertools.product(self.LAYOUTS, (1, 2, 3, 4)):
            if sum(pads) % n:
                continue
            spec = _spec(numels, pads, n)
            shard = sum(pads) // n
            self.assertEqual(spec.shard_numel, shard)
            self.assertEqual(spec.total, sum(pads))
            for i in range(n):
                mine = set(range(i * shard, (i + 1) * shard))
                for j, name in enumerate(spec.params):
                    off = spec.offsets[j]
                    real = sorted(e - off for e in mine & set(range(off, off + numels[j])))
                    want = (real[0], real[-1] + 1) if real else (0, 0)
                    label = f"numels {numels} pads {pads} n {n}: rank {i}, {name}"
                    self.assertEqual(spec.range_in_param(name, i), want, label)
                    padded = mine & set(range(off, off + pads[j]))
                    self.assertEqual(spec.holds_slice(name, i), bool(padded), label)


class TestLayoutSchedule(unittest.TestCase):
    """Which collectives a layout schedules, and which elements each rank updates."""

    PARAMS = (ParamMeta("w0", (8, 4), "float32", None, True),
              ParamMeta("w1", (4, 4), "float32", None, True),
              ParamMeta("b0", (4,), "float32", None, False),
              ParamMeta("e0", (2, 4, 4), "float32", "moe_expert", True),
              ParamMeta("eb", (6,), "float32", "moe_expert", False))

    def test_group_sizes(self) -> None:
        for dense, expert in (((0,), (0,)), ((0, 1), (0,)), ((0, 1, 2, 3), (0, 2)),
                              ((0,), (0, 1))):
            for rank in sorted(set(dense) & set(expert)):
                for mb in (0, 1):
                    label = f"dense {dense} expert {expert} rank {rank} buffer {mb} MB"
                    layout = ShardingLayout.build(self.PARAMS, {None: dense, "moe_expert": expert},
                                                  rank, LayoutSettings(comm_buffer_size_MB=mb))
                    ops = layout.schedule()
                    self.assertTrue(all(len(op.group) > 1 for op in ops),
                                    f"{label}: a one-rank group moves nothing")
                    for colour, ranks in ((None, dense), ("moe_expert", expert)):
                        kinds = {op.op for op in ops if op.colour == colour}
                        want = {"reduce", "broadcast", "reduce_scatter", "all_gather"} \
                            if len(ranks) > 1 else set()
                        self.assertEqual(kinds, want, f"{label}: colour {colour}")
                    for p in self.PARAMS:
                        got = layout.local_range(p.name)
                        if p.use_muon:
                            mine = layout.owners[p.name] == rank
                            self.assertEqual(got, (0, p.numel) if mine else (0, 0), label)
                        else:
                            buf = layout.slice_buffer_of(p.name)
                            index = buf.group.index(rank)
                            self.assertEqual(got, buf.range_in_param(p.name, index), label)
                            if len(buf.group) == 1:
                                self.assertEqual(got, (0, p.numel), f"{label}: one rank holds all")


class TestSyncStages(unittest.TestCase):
    """develop's stages over colours, key sizes, limits and owners, by brute force."""

    @staticmethod
    def _expected(by_colour, rank2params, info, key_of, limit):
        stages, local_by_key = [], OrderedDict()
        for colour, params in by_colour.items():
            me = info[colour]["rank"] if info[colour]["world_size"] > 1 else 0
            mine = {id(p) for p in rank2params[colour].get(me, ())}
            keys = list(OrderedDict.fromkeys(key_of(p) for p in params))
            members = {k: [p for p in params if key_of(p) == k] for k in keys}
            for k in keys:
                local_by_key.setdefault(k, []).extend(p for p in members[k] if id(p) in mine)
            runs, run, size = [], [], 0
            for k in keys:
                run.append(k)
                size += sum(math.prod(p.shape) for p in members[k])
                if size >= limit:
                    runs.append(run)
                    run, size = [], 0
            if run:
                runs.append(run)
            for run in runs:
                wanted = {id(p) for k in run for p in members[k]}
                owned = OrderedDict((r, [p for p in ps if id(p) in wanted])
                                    for r, ps in rank2params[colour].items())
                owned = OrderedDict((r, ps) for r, ps in owned.items() if ps)
                if owned:
                    stages.append(["2d", colour, run, owned])
        out = []
        for kind, colour, run, owned in stages:
            local = [p for k in run for p in local_by_key.pop(k, [])]
            out.append((kind, colour, tuple(run), {r: [p.name for p in ps]
                                                   for r, ps in owned.items()},
                        [p.name for p in local]))
        return out

    def test_matrix(self) -> None:
        def param(name, shape, key):
            return SimpleNamespace(name=name, shape=shape, key=key)

        dense = [param("d0", (4, 4), "a"), param("d1", (4, 4), "a"), param("d2", (2, 8), "b"),
                 param("d3", (8, 8), "c"), param("d4", (1, 4), "d")]
        expert = [param("e0", (4, 4), "x"), param("e1", (4, 4), "a"), param("e2", (2, 2), "y")]
        owners = {"dense": {0: [dense[0], dense[3]], 1: [dense[1], dense[2], dense[4]]},
                  "moe": {0: [expert[0]], 1: [expert[1], expert[2]]}}
        for limit, me, world in itertools.product((1, 16, 32, 48, 100, 10**6), (0, 1), (1, 2)):
            by_colour = OrderedDict([("dense", dense), ("moe", expert)])
            rank2params = {"dense": owners["dense"], "moe": owners["moe"]}
            if world == 1:
                rank2params = {c: {0: [p for ps in o.values() for p in ps]}
                               for c, o in owners.items()}
            info = {c: {"group": f"g_{c}", "world_size": world, "rank": me} for c in by_colour}
            stages = build_sync_stages(by_colour, rank2params, info, lambda p: p.key, limit)
            got = []
            for s in stages:
                self.assertEqual(s["group"], f"g_{s['color']}")
                self.assertEqual(s["world_size"], world)
                got.append(("2d", s["color"], tuple(s["keys"]),
                            {r: [p.name for p in ps] for r, ps in s["rank2params"].items()},
                            [p.name for p in s["local_params"]]))
            want = self._expected(by_colour, rank2params, info, lambda p: p.key, limit)
            self.assertEqual(got, want, f"limit {limit}, rank {me}, world {world}")
            updated = [n for s in got for n in s[4]]
            self.assertEqual(len(updated), len(set(updated)), "a parameter updated twice")

    def test_stage_element_limit(self) -> None:
        for mb, want in ((1, 2**18), (0.5, 2**17), (3, 3 * 2**18)):
            self.assertEqual(stage_element_limit(mb), want, mb)
        # develop's default buffer when the size is not positive
        self.assertEqual(stage_element_limit(0), stage_element_limit(256))
        self.assertEqual(stage_element_limit(-2), stage_element_limit(256))


class TestReorderParams(unittest.TestCase):
    """develop's ``reorder_params``: one entry per (owner, dtype); a lone parameter
    of its dtype travels as is, several are packed into one flat buffer that the
    owner fills with their values in order."""

    # group index -> the parameters it owns ("h" is float16, the rest float32)
    CASES = ({0: ["a", "b"]}, {0: ["a"], 1: ["b", "c"]}, {1: ["a", "h", "c"]},
             {0: ["h"], 1: ["b"]})

    def test_packing_table(self) -> None:
        import numpy as np
        import paddle
        from muon_sim_runner import SimConfig, run_world
        from muon_tiny_moe import TinyMoE, make_muon

        from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_optimizer import (
            MuonShardingOptimizer,
        )

        cfg = SimConfig(ep=1, ms=2, steps=1, clip=False)
        shapes = {"a": (2, 3), "b": (4,), "c": (3, 2), "h": (2, 2)}

        def body(cfg, strategy):
            hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
            net = TinyMoE(None, None)
            opt = MuonShardingOptimizer(make_muon(list(net.parameters()), clip=False), hcg,
                                        strategy)
            rank = paddle.distributed.get_rank()
            group = hcg.get_sharding_parallel_group()
            t = {k: paddle.to_tensor((np.arange(int(np.prod(s))) + 100 * rank + 10 * i)
                                     .reshape(s).astype("float16" if k == "h" else "float32"))
                 for i, (k, s) in enumerate(sorted(shapes.items()))}
            out = []
            for case in self.CASES:
                packed = opt.reorder_params([({i: [t[k] for k in ks] for i, ks in case.items()},
                                              group)])
                out.append([(d["src_rank"], [next(k for k in t if t[k] is p) for p in d["params"]],
                             any(d["param_buffer"] is v for v in t.values()),
                             int(np.prod(d["param_buffer"].shape)), str(d["param_buffer"].dtype),
                             d["param_buffer"].numpy().ravel().tolist() if d["src_rank"] == rank else None)
                            for d in packed])
            return rank, list(group.ranks), {k: v.numpy() for k, v in t.items()}, out

        results, _ = run_world(cfg, body=body)
        self.assertEqual(len(results), 2)
        for rank, ranks, values, out in results:
            for case, got in zip(self.CASES, out):
                want = []
                for index, names in case.items():
                    by_dtype = {}
                    for k in names:
                        by_dtype.setdefault(str(values[k].dtype), []).append(k)
                    for members in by_dtype.values():
                        alone = len(members) == 1
                        flat = np.concatenate([values[k].ravel() for k in members])
                        dtype = "paddle.float16" if values[members[0]].dtype == np.float16 \
                            else "paddle.float32"
                        want.append((ranks[index], members, alone, flat.size, dtype,
                                     flat.tolist() if ranks[index] == rank else None))
                self.assertEqual(got, want, f"rank {rank}, owners {case}")


if __name__ == "__main__":
    unittest.main()
