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
                # probe mode: the MoE training refuses --ep 1 (tested below)
                cluster.ClusterConfig(**base, **{field: top, other: 1},
                                      mode="probe").validate_values()
                with self.assertRaisesRegex(ValueError,
                                            f"^{flag} {top + 1}: above the limit {top} "):
                    cluster.ClusterConfig(**base, **{field: top + 1, other: 1},
                                          mode="probe").validate_values()

    def test_training_refuses_ep_1_naming_the_flag_before_any_worker_starts(self):
        # ep=1 once crashed every worker on hcg._moe_topo (Paddle builds it for ep > 1 only)
        with self.assertRaisesRegex(ValueError, r"^--ep 1: .*--ep 2 or more"):
            cluster.ClusterConfig(nodes=2, procs_per_node=2, ep=1,
                                  moe_sharding=4).validate_values()
        cluster.ClusterConfig(nodes=2, procs_per_node=2, ep=2, moe_sharding=2).validate_values()
        cluster.ClusterConfig(nodes=2, procs_per_node=2, ep=1, moe_sharding=4,
                              mode="probe").validate_values()


if __name__ == "__main__":
    unittest.main()
