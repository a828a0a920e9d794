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
"""The gloo bytes model against what the namespace cluster measured.

Reference figures: node-link TX bytes per node of one collective of S bytes
(probe mode of ``cluster_muon_worker.py``, 4 nodes, 1000 Mbit/s links),
rounded to 1/8 S; measured values were within 0.5 % of these (headers).
"""

from __future__ import annotations

import unittest

from tool_loader import load_tool

from paddle_muon_ext.tools import gloo_model

mc = load_tool("muon_comm.py", "_muon_comm_tool")

S = 4 << 20


def node_tx(edges, gpn: int, nodes: int) -> list[float]:
    """Inter-node bytes each node sends, in units of S."""
    out = [0.0] * nodes
    for a, b, n in edges:
        if a // gpn != b // gpn:
            out[a // gpn] += n / S
    return out


class TestGlooCollectivesAsMeasured(unittest.TestCase):
    """8 ranks on 4 nodes x 2 (the world group), 4 ranks one per node (card 0)."""

    WORLD = list(range(8))
    CARD0 = [0, 2, 4, 6]

    def check(self, what, group, measured, root=None):
        got = node_tx(gloo_model.collective_edges(what, group, S, root), 2, 4)
        for node, (g, m) in enumerate(zip(got, measured)):
            self.assertAlmostEqual(g, m, places=6, msg=f"{what} root {root} node {node}: {got}")

    def test_reduce_is_ring_reduce_scatter_then_gather(self) -> None:
        self.check("reduce", self.WORLD, [0.875, 1.125, 1.125, 1.125], root=0)
        self.check("reduce", self.WORLD, [1.125, 1.125, 1.125, 0.875], root=7)
        self.check("reduce", self.CARD0, [0.75, 1.0, 1.0, 1.0], root=0)
        self.check("reduce", [0, 2], [0.5, 1.0, 0, 0], root=0)

    def test_broadcast_is_a_binomial_tree_from_the_root(self) -> None:
        self.check("broadcast", self.WORLD, [4, 2, 0, 0], root=0)
        self.check("broadcast", self.WORLD, [3, 1, 0, 3], root=7)
        self.check("broadcast", self.CARD0, [2, 1, 0, 0], root=0)
        self.check("broadcast", self.CARD0, [1, 0, 0, 2], root=6)

    def test_ring_all_reduce_all_gather_and_compat_reduce_scatter(self) -> None:
        self.check("all_reduce", self.WORLD, [1.75] * 4)
        self.check("reduce_scatter", self.WORLD, [1.75] * 4)  # compat: all_reduce + slice
        self.check("all_reduce", self.CARD0, [1.5] * 4)
        self.check("all_gather", self.WORLD, [0.875] * 4)
        self.check("all_gather", self.CARD0, [0.75] * 4)

    def test_one_rank_and_bad_input(self) -> None:
        for what in ("reduce", "broadcast", "all_reduce", "all_gather"):
            self.assertEqual(gloo_model.collective_edges(what, [3], S, 3), [])
            self.assertEqual(gloo_model.rounds(what, 1), 0)
        self.assertEqual([gloo_model.rounds(w, 8) for w in
                          ("reduce", "broadcast", "all_reduce", "all_gather")], [8, 3, 14, 7])
        with self.assertRaisesRegex(ValueError, "root 5 is not in group"):
            gloo_model.collective_edges("reduce", [0, 1], S, 5)
        with self.assertRaisesRegex(ValueError, "unknown collective 'alltoall'"):
            gloo_model.collective_edges("alltoall", [0, 1], S)


class TestPlanToolBackends(unittest.TestCase):
    def setUp(self) -> None:
        self.cfg = mc.MuonCommConfig(ep=4, moe_sharding=2, pp=1, gpus_per_node=2, model="tiny")

    def test_nccl_stays_the_default(self) -> None:
        default = mc.compute_plan(self.cfg)
        nccl = mc.compute_plan(self.cfg, backend="nccl")
        for path in ("flat", "hierarchical"):
            self.assertEqual(default[path], nccl[path])
        self.assertEqual(nccl["config"]["backend"], "nccl")

    def test_gloo_dense_bytes_follow_its_algorithms(self) -> None:
        """One dense 16x16 fp32 matrix, 8 ranks on 4 nodes: flat reduce + broadcast
        in the sharding group vs node-group + same-card-group (4 ranks)."""
        spec = mc.moe_presets.ParamSpec("w", (16, 16), "float32", False, True)
        res = mc.compute_plan(self.cfg, params=[spec], backend="gloo")
        size = 16 * 16 * 4
        owner = res["buckets"]["flat"][0]["owner"]
        flat = node_tx(gloo_model.reduce_edges(list(range(8)), owner, size)
                       + gloo_model.broadcast_edges(list(range(8)), owner, size), 2, 4)
        self.assertAlmostEqual(res["flat"]["inter_node_bytes"], sum(flat) * S)
        # hierarchical: intra-node hops never cross; cross-node = 4 ranks, one per node
        self.assertAlmostEqual(res["hierarchical"]["inter_node_bytes"],
                               (3 * (1 + 1 / 4) + 3) * size)
        with self.assertRaisesRegex(ValueError, "unknown backend 'mpi'"):
            mc.compute_plan(self.cfg, backend="mpi")

    def test_cluster_prediction(self) -> None:
        """The cluster's model through the gloo backend: the option saves dense
        bytes only; MoE-colour bytes are the same on and off."""
        from paddle_muon_ext.tools import cluster

        pred = mc.predict_cluster(cluster.ClusterConfig(
            nodes=4, procs_per_node=2, ep=4, moe_sharding=2, hidden=16, inner=24))
        off, on = pred["off"], pred["on"]
        self.assertLess(on["dense_muon_bytes"], off["dense_muon_bytes"])
        self.assertEqual(on["moe_muon_bytes"], off["moe_muon_bytes"])
        self.assertAlmostEqual(off["inter_node_bytes"] - on["inter_node_bytes"],
                               off["dense_muon_bytes"] - on["dense_muon_bytes"])

    def test_cli_backend_flag(self) -> None:
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = mc.main(["plan", "--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "2",
                            "--model", "tiny", "--backend", "gloo", "--json"])
        self.assertEqual(code, 0)
        self.assertIn('"backend": "gloo"', out.getvalue())


if __name__ == "__main__":
    unittest.main()
