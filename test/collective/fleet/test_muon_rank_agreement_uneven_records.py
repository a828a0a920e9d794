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
"""The rank-agreement message when the other rank's record is the shorter or
carries a field rank 0 lacks (plain data, no world)."""

from __future__ import annotations

import unittest

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import agreement
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.agreement import GroupDigest


def _rec(name, shape=(4, 4), dtype="float32", route="muon"):
    return (name, tuple(shape), dtype, route)


def _digest(params, fields=()):
    return GroupDigest("the sharding group", (0, 1), tuple(fields), tuple(params))


class TestUnevenRecords(unittest.TestCase):
    def test_a_rank_missing_the_last_parameter_names_it(self):
        ref = _digest([_rec("a"), _rec("b", (3, 2))])
        fewer = _digest([_rec("a")])
        msg = agreement.first_difference([ref, fewer])
        self.assertIn("ranks [1] differ from rank 0", msg)
        self.assertIn("parameter #1 (b) is b [3, 2] float32 muon on rank 0 but "
                      "no parameter on rank 1 (2 vs 1 parameters)", msg)

    def test_a_field_only_the_other_rank_has_is_named_unset_on_rank_0(self):
        ref = _digest([_rec("a")])
        extra = _digest([_rec("a")], fields=[("option comm_overlap", True)])
        msg = agreement.first_difference([ref, extra])
        self.assertIn("option comm_overlap is '<unset>' on rank 0 but True on rank 1", msg)


if __name__ == "__main__":
    unittest.main()
