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
"""``tools/cluster.py``'s ``--ep`` / ``--moe-sharding`` limits are inclusive:
the largest world the tool builds passes, one above is refused naming the
flag and the limit (no Paddle, no namespaces)."""

from __future__ import annotations

import unittest

from paddle_muon_ext.tools import cluster, cluster_netns as netns, cluster_run as crun


class TestRankFlagLimits(unittest.TestCase):
    def test_ep_and_moe_sharding_accept_the_largest_world_and_refuse_one_more(self):
        top = netns.MAX_NODES * crun.MAX_PROCS
        base = dict(nodes=netns.MAX_NODES, procs_per_node=crun.MAX_PROCS, group_call="0")
        for field, flag, other in (("ep", "--ep", "moe_sharding"),
                                   ("moe_sharding", "--moe-sharding", "ep")):
            with self.subTest(flag=flag):
                cluster.ClusterConfig(**base, **{field: top, other: 1}).validate_values()
                with self.assertRaisesRegex(ValueError,
                                            f"^{flag} {top + 1}: above the limit {top} "):
                    cluster.ClusterConfig(**base, **{field: top + 1, other: 1}).validate_values()


if __name__ == "__main__":
    unittest.main()
