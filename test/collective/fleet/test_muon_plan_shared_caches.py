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
"""The work ``plan --recommend`` shares across buffer sizes and rules never
hands one configuration another's result.

The placement keys develop's rule on its active-rank caps rather than the
buffer size, reuses a bucket's grouping and prefix sums for every buffer
size, and the step plan reuses the sync stages' grouping for layouts of the
same parameters and owners (the stages once per runs of keys). Each test
holds a cached result to the rule or chunking computed directly.
"""

from __future__ import annotations

import random
import unittest

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import layout as placement
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import step_plan
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.layout import (
    LayoutSettings,
    ParamMeta,
    ShardingLayout,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.settings import (
    PARTITION_BALANCED,
    PARTITION_DEVELOP,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.owners import MatrixSpec
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.owners import (
    upstream_partition,
)


def _specs(count: int) -> tuple:
    # 1 MiB of fp32-estimated elements each: develop's caps change with the buffer
    return tuple(MatrixSpec(f"w{i:03d}", (512, 512), "bfloat16" if i % 3 else "float32")
                 for i in range(count))


class TestDevelopOwnersPerBufferSize(unittest.TestCase):
    def test_each_buffer_size_gets_the_rule_run_at_that_size(self):
        specs = _specs(40)
        group = tuple(range(100, 116))
        for buffer_mb in (1.0, 2.0, 4.0, 64.0, 0.5, 1.0, 256.0, 3.0):
            with self.subTest(buffer_mb=buffer_mb):
                owners, part = placement.assign_muon_owners(
                    specs, group, None, PARTITION_DEVELOP, buffer_mb)
                want = upstream_partition(list(specs), len(group), buffer_mb)
                self.assertEqual(owners, {n: group[i] for n, i in want.owners.items()})
                self.assertEqual(part.method, want.method)
                self.assertEqual(part.state_bytes, want.state_bytes)

    def test_sizes_with_different_caps_give_different_owners(self):
        specs = _specs(40)
        group = tuple(range(16))
        small, _ = placement.assign_muon_owners(specs, group, None, PARTITION_DEVELOP, 1.0)
        large, _ = placement.assign_muon_owners(specs, group, None, PARTITION_DEVELOP, 256.0)
        self.assertEqual(len(set(large.values())), 1)  # one active rank: each class fits
        self.assertGreater(len(set(small.values())), 2)


def _metas(count: int) -> list:
    rng = random.Random(count)
    out = []
    for i in range(count):
        shape = (rng.choice([256, 512, 1024]), rng.choice([256, 512]))
        out.append(ParamMeta(f"m{i:03d}", shape, rng.choice(["bfloat16", "float32"]),
                             use_muon=True))
        if i % 4 == 0:
            out.append(ParamMeta(f"b{i:03d}", (shape[1],), "float32"))
    return out


class TestSyncStagesAcrossLayouts(unittest.TestCase):
    def _fresh(self, metas, group, rank, settings):
        # a copy of the list and an empty memo: computed from scratch
        step_plan._stage_memo.clear()
        placement.colour_muon_layout.cache_clear()
        lay = ShardingLayout.build([ParamMeta(m.name, m.shape, m.dtype, m.colour, m.use_muon)
                                    for m in metas], {None: group}, rank, settings)
        return lay.owners, lay.sync_stages()

    def test_rules_and_buffer_sizes_never_share_stages(self):
        metas = _metas(60)
        group = tuple(range(8))
        configs = [LayoutSettings(comm_buffer_size_MB=mb, partition_strategy=rule)
                   for rule in (PARTITION_DEVELOP, PARTITION_BALANCED)
                   for mb in (0.25, 1.0, 4.0, 256.0)]
        for rank in (0, 5):
            shared = []
            step_plan._stage_memo.clear()
            for settings in configs:  # one parameter list: every memo hits what it can
                lay = ShardingLayout.build(metas, {None: group}, rank, settings)
                shared.append((lay.owners, lay.sync_stages()))
            for settings, got in zip(configs, shared):
                with self.subTest(rank=rank, settings=settings):
                    self.assertEqual(got, self._fresh(metas, group, rank, settings))
        # the configurations differ: a stale entry would have shown above
        stages = {s for _, s in shared}
        self.assertGreater(len(stages), 2)


class TestFusedChunksAgainstChunkBySize(unittest.TestCase):
    def test_random_buckets(self):
        rng = random.Random(7)
        for trial in range(500):
            n = rng.randint(0, 30)
            metas = [ParamMeta(f"p{i}", (rng.choice([0, 1, 64, 1000, 2**18]),
                                         rng.choice([1, 3, 64])), "bfloat16") for i in range(n)]
            numels = [m.numel for m in metas]
            nbytes = [m.nbytes for m in metas]
            align = rng.choice([1, 8, 64])
            limit_mb = rng.choice([1e-6, 0.01, 0.5, 1.0, 64.0])
            chunks, chunk_numels, chunk_bytes = placement._fused_chunks(
                placement._BucketSums(metas, numels, nbytes), align, limit_mb)
            want = placement.chunk_by_size(nbytes, limit_mb)
            with self.subTest(trial=trial):
                self.assertEqual(chunks, tuple(tuple(metas[i].name for i in c) for c in want))
                self.assertEqual(chunk_bytes, tuple(sum(nbytes[i] for i in c) for c in want))
                self.assertEqual(chunk_numels, tuple(
                    sum(-(-numels[i] // align) * align for i in c) for c in want))


if __name__ == "__main__":
    unittest.main()
