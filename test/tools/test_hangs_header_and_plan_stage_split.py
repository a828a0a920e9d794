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
"""``hangs``' header counts the dumps of the world and names the ranks without one;
``plan`` splits parameters into pipeline stages contiguously by cumulative bytes."""

from __future__ import annotations

import unittest

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_flight import recorder as fr
from paddle_muon_ext.tools import hangs, presets
from paddle_muon_ext.tools.plan_world import split_stages


def _dump(rank: int, in_flight: bool) -> dict:
    entry = {"seq": 0, "group_seq": 0, "phase": "cross_node_reduce", "op": "reduce",
             "group_id": 7, "group_ranks": [0, 1, 2, 3], "root": 0, "dtype": "float32",
             "numel": 8, "start": 1.0, "finish": None if in_flight else 2.0}
    return {"format": fr.DUMP_FORMAT, "rank": rank, "world_size": 4, "pid": 10 + rank,
            "host": "h", "time": 100.0, "reason": "SIGUSR1", "phase": "cross_node_reduce",
            "entries": [entry],
            "issued": [{"group_id": 7, "group_ranks": [0, 1, 2, 3], "count": 1}]}


class TestHangsReportLines(unittest.TestCase):
    def test_header_counts_dumps_of_the_world_and_names_missing_ranks(self):
        # Bugs: the header counts the world instead of the dumps (or drops
        # "of N"); ranks without a dump are not listed.
        lines = hangs.report({1: _dump(1, True), 3: _dump(3, True)})
        self.assertEqual(lines[0], "flight recorder dumps: 2 rank(s) of 4", lines)
        self.assertIn("  no dump from ranks 0, 2", lines, "\n".join(lines))
        one_missing = hangs.report({r: _dump(r, True) for r in (0, 1, 2)})
        self.assertEqual(one_missing[0], "flight recorder dumps: 3 rank(s) of 4")
        self.assertIn("  no dump from rank 3", one_missing, "\n".join(one_missing))
        complete = hangs.report({r: _dump(r, False) for r in range(4)})
        self.assertFalse([l for l in complete if "no dump from" in l], complete)


class TestPlanStageSplit(unittest.TestCase):
    def _split(self, sizes, pp):
        params = [presets.ParamSpec(f"p{i}", (n,), "float32") for i, n in enumerate(sizes)]
        return [[p.name for p in stage] for stage in split_stages(params, pp)]

    def test_contiguous_in_model_order_at_equal_cumulative_bytes(self):
        # Bugs: a parameter placed by where it starts instead of its middle,
        # sorted by size, or the last stage left empty. Worked by hand: a
        # parameter goes to stage floor(pp * (bytes before + half its own) / total).
        self.assertEqual(self._split([3, 3, 2], 2), [["p0"], ["p1", "p2"]])
        self.assertEqual(self._split([1, 1, 1, 1, 4], 2), [["p0", "p1", "p2", "p3"], ["p4"]])
        self.assertEqual(self._split([2] * 6, 3), [["p0", "p1"], ["p2", "p3"], ["p4", "p5"]])
        self.assertEqual(self._split([4, 1, 1, 1, 1], 2), [["p0"], ["p1", "p2", "p3", "p4"]])
        self.assertEqual(self._split([5, 1], 1), [["p0", "p1"]])


if __name__ == "__main__":
    unittest.main()
