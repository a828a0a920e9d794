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
"""``plan`` builds its layouts without importing Paddle, on Paddle's rank grid.

The tools' :class:`GridTopology` stands in for Paddle's
``CommunicateTopology`` (importing Paddle was a seventh of ``plan``'s time
at 100,000 matrices): it must number ranks and list comm groups exactly as
Paddle's does, for every axis order, and ``plan`` must then not import Paddle.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import unittest

from paddle.distributed.fleet.base.topology import CommunicateTopology

from paddle_muon_ext.tools.args import GridTopology, MuonCommConfig

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_AXES = ("moe_sharding", "pipe", "expert")


class TestGridTopologyIsPaddlesGrid(unittest.TestCase):
    def test_comm_lists_coords_and_sizes_match_communicate_topology(self):
        for names in itertools.permutations(_AXES):
            for dims in ((2, 3, 4), (1, 4, 2), (8, 1, 1), (3, 2, 1)):
                ours = GridTopology(list(names), list(dims))
                paddles = CommunicateTopology(list(names), list(dims))
                with self.subTest(names=names, dims=dims):
                    self.assertEqual(ours.world_size(), paddles.world_size())
                    self.assertEqual(list(ours.get_hybrid_group_names()),
                                     list(paddles.get_hybrid_group_names()))
                    for axis in names:
                        self.assertEqual(ours.get_dim(axis), paddles.get_dim(axis))
                        self.assertEqual(ours.get_comm_list(axis),
                                         paddles.get_comm_list(axis))
                    for r in range(ours.world_size()):
                        self.assertEqual(ours.get_coord(r)._asdict(),
                                         paddles.get_coord(r)._asdict())

    def test_plan_from_grid_equals_plan_from_communicate_topology(self):
        from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.comm_plan import (
            HierarchicalCommPlan,
        )

        cfg = MuonCommConfig(ep=4, moe_sharding=4, pp=2, gpus_per_node=8,
                             order=("pipe", "moe_sharding", "expert"))
        deg = cfg.degrees()
        ref = HierarchicalCommPlan.from_topology(
            CommunicateTopology(list(cfg.order), [deg[n] for n in cfg.order]), 8)
        ours = cfg.build_plan()
        self.assertGreater(len(vars(ref)), 5)  # plain data: every field compared
        self.assertEqual(vars(ours), vars(ref))

    def test_rank_outside_the_grid_is_refused(self):
        with self.assertRaises(ValueError):
            GridTopology(list(_AXES), [2, 2, 2]).get_coord(8)


class TestPlanImportsNoPaddle(unittest.TestCase):
    def test_plan_with_recommend_runs_with_paddle_not_installed(self):
        code = (
            "import contextlib, io, json, sys\n"
            "sys.modules['paddle'] = None  # as when Paddle is not installed\n"
            "from paddle_muon_ext.tools.cli import main\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            "    rc = main(['plan', '--ep', '4', '--moe-sharding', '2', '--pp', '2',\n"
            "               '--gpus-per-node', '4', '--recommend', '--json'])\n"
            "print(rc, sys.modules['paddle'] is None, 'recommend' in json.loads(out.getvalue()))\n"
        )
        env = dict(os.environ, PYTHONPATH=os.path.join(_REPO, "python"))
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, timeout=120)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertEqual(done.stdout.split(), ["0", "True", "True"])


if __name__ == "__main__":
    unittest.main()
