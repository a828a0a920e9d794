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
"""Self-tests: the fake hcg is Paddle's EPHybridCommunicateGroup with Paddle's layout."""

from __future__ import annotations

import itertools
from unittest import mock

import paddle.distributed as dist
import unittest
from paddle.distributed import fleet
from paddle.distributed.communication.group import Group
from paddle.distributed.fleet.base import topology as fleet_topology

from mock.fake_hcg import (
    DEFAULT_MOE_ORDER,
    PIPE_FIRST_MOE_ORDER,
    hcg_layout,
    hybrid_names_and_dims,
    make_hcg_factory,
    make_hybrid_strategy,
    merge_inner_comm_list_by_coords,
)
from mock.patching import FakeDistMixin
from mock.schedule_checker import check_schedule
from mock.simulated_world import SimulatedWorld

DEFAULT, PIPE_FIRST = DEFAULT_MOE_ORDER, PIPE_FIRST_MOE_ORDER

CONFIGS = [
    # (ep, moe_sharding, pp, order)
    (4, 2, 1, DEFAULT),
    (4, 2, 2, DEFAULT),
    (4, 2, 2, PIPE_FIRST),
    (2, 4, 2, PIPE_FIRST),
]


def _expected_layout(rank: int, ep: int, ms: int, pp: int, order: tuple) -> dict:
    """Independent expectation from a bare CommunicateTopology over the MoE axes."""
    degree = {"pipe": pp, "moe_sharding": ms, "expert": ep}
    topo = fleet_topology.CommunicateTopology(list(order), [degree[a] for a in order])
    me = topo.get_coord(rank)._asdict()

    def ranks_varying(*axes: str) -> list[int]:
        out = []
        for r in range(topo.world_size()):
            c = topo.get_coord(r)._asdict()
            if all(c[a] == me[a] for a in degree if a not in axes):
                out.append(r)
        return sorted(out)

    sharding = ranks_varying("moe_sharding", "expert")
    return {
        "global_rank": rank,
        "sharding": sharding,
        "sharding_world_size": ms * ep,
        "moe_sharding": ranks_varying("moe_sharding"),
        "moe_sharding_rank": me["moe_sharding"],
        "expert": ranks_varying("expert"),
        "expert_rank": me["expert"],
        "pipe": ranks_varying("pipe"),
        "stage_id": me["pipe"],
    }


# Configs where Paddle 3.3.1's own constructor works (pipe-first needs pp == 1).
PADDLE_OK = [(4, 2, 2, 1, DEFAULT), (4, 2, 1, 1, PIPE_FIRST), (4, 2, 2, 2, DEFAULT), (8, 2, 2, 1, DEFAULT)]


def _dense_topo(ep: int, ms: int, pp: int, mp: int, order: tuple) -> fleet_topology.CommunicateTopology:
    """The dense topology EPHybridCommunicateGroup builds (dp = sep = 1)."""
    if order.index("pipe") < order.index("moe_sharding"):
        names = ["data", "pipe", "moe_sharding", "dense_sharding", "sep", "model"]
    else:
        names = ["data", "moe_sharding", "pipe", "dense_sharding", "sep", "model"]
    dims = {"data": 1, "pipe": pp, "moe_sharding": ms, "dense_sharding": ep // mp, "sep": 1, "model": mp}
    return fleet_topology.CommunicateTopology(names, [dims[n] for n in names])


class TestFakeHcg(FakeDistMixin, unittest.TestCase):
    def test_fake_hcg_layout_matches_paddle_topology(self) -> None:
        for ep, ms, pp, order in CONFIGS:
            with self.subTest(ep=ep, ms=ms, pp=pp, order=order):
                self._fake_hcg_layout_matches_paddle_topology(ep, ms, pp, order)

    def _fake_hcg_layout_matches_paddle_topology(self, ep: int, ms: int, pp: int, order: tuple) -> None:
        world = SimulatedWorld(ep * ms * pp, hcg_factory=make_hcg_factory(ep=ep, moe_sharding=ms, pp=pp, order=order),
                               mode="record")

        def body(rank: int) -> tuple:
            hcg = fleet.get_hybrid_communicate_group()
            assert isinstance(hcg, fleet_topology.EPHybridCommunicateGroup)
            return (hcg_layout(hcg), tuple(hcg._moe_topo.get_hybrid_group_names()),
                    hcg.get_sharding_parallel_group().id, hcg.get_pipe_parallel_world_size(),
                    hcg.get_model_parallel_world_size(), hcg.get_data_parallel_world_size(), hcg.nranks)

        results = world.run(body)
        sharding_ids = set()
        for rank, (layout, moe_names, sharding_id, pp_size, mp_size, dp_size, nranks) in enumerate(results):
            expect = _expected_layout(rank, ep, ms, pp, order)
            got = {k: layout[k] for k in expect}
            assert got == expect, f"ep={ep} ms={ms} pp={pp} order={order} rank {rank}: {got} != {expect}"
            assert moe_names == order, f"rank {rank}: _moe_topo axes {moe_names}"
            assert (pp_size, mp_size, dp_size, nranks) == (pp, 1, 1, ep * ms * pp)
            sharding_ids.add((layout["stage_id"], sharding_id))
        assert len({gid for _, gid in sharding_ids}) == pp, f"sharding group ids per stage: {sharding_ids}"
        check_schedule(world.traces)  # every rank created the same groups in the same order

    def test_default_order_matches_the_design_formula(self) -> None:
        ep, ms, pp = 4, 2, 2
        for s, p, e in itertools.product(range(ms), range(pp), range(ep)):
            rank = s * pp * ep + p * ep + e
            layout = _expected_layout(rank, ep, ms, pp, DEFAULT)
            got = (layout["stage_id"], layout["moe_sharding_rank"], layout["expert_rank"])
            assert got == (p, s, e), (f"rank {rank}: (stage, moe_sharding rank, expert rank) "
                                      f"is {got}, the formula gives {(p, s, e)}")

    def test_fake_layer_does_not_change_what_paddle_builds(self) -> None:
        for ep, ms, pp, mp, order in PADDLE_OK:
            with self.subTest(ep=ep, ms=ms, pp=pp, mp=mp, order=order):
                self._fake_layer_does_not_change_what_paddle_builds(ep, ms, pp, mp, order)

    def _fake_layer_does_not_change_what_paddle_builds(self, ep: int, ms: int, pp: int, mp: int,
                                                       order: tuple) -> None:
        """Build the same rank's hcg once with bare mocks (real Group objects) and
        once through the fake layer: every group list must agree."""
        rank = ep * ms * pp - 3
        names, dims = hybrid_names_and_dims(ep, ms, pp, mp, order)
        counter = itertools.count(100)

        def plain_new_group(ranks=None, *args, **kwargs):
            ranks = sorted(ranks)
            return Group(ranks.index(rank) if rank in ranks and len(ranks) > 1 else -1, next(counter), ranks)

        with mock.patch.object(dist, "get_rank", lambda *a: rank), \
                mock.patch.object(dist, "get_world_size", lambda *a: ep * ms * pp), \
                mock.patch.object(dist, "new_group", plain_new_group), \
                mock.patch.object(dist, "all_reduce", lambda *a, **k: None), \
                mock.patch.object(fleet_topology, "_HYBRID_PARALLEL_GROUP", None), \
                mock.patch.object(fleet_topology.logger, "disabled", True):
            plain = hcg_layout(fleet_topology.EPHybridCommunicateGroup(names, dims))

        factory = make_hcg_factory(ep=ep, moe_sharding=ms, pp=pp, mp=mp, order=order)
        world = SimulatedWorld(ep * ms * pp, hcg_factory=factory, mode="record")
        faked = world.run(lambda r: hcg_layout(fleet.get_hybrid_communicate_group()))[rank]
        assert faked == plain, f"rank {rank}: fake layer {faked} != plain Paddle {plain}"

    def test_coordinate_merge_equals_paddles_merge_where_paddle_works(self) -> None:
        for ep, ms, pp, mp, order in PADDLE_OK + [(2, 4, 1, 2, PIPE_FIRST), (4, 4, 4, 1, DEFAULT)]:
            with self.subTest(ep=ep, ms=ms, pp=pp, mp=mp, order=order):
                self._coordinate_merge_equals_paddles_merge(ep, ms, pp, mp, order)

    def _coordinate_merge_equals_paddles_merge(self, ep, ms, pp, mp, order) -> None:
        topo = _dense_topo(ep, ms, pp, mp, order)
        paddle_lists = fleet_topology.EPHybridCommunicateGroup.merge_inner_comm_list(
            None, topo, "moe_sharding", "dense_sharding")
        ours = merge_inner_comm_list_by_coords(topo, "moe_sharding", "dense_sharding")
        assert ours == paddle_lists, f"ep={ep} ms={ms} pp={pp} mp={mp} {order}: {ours} != {paddle_lists}"

    def test_paddle_merge_mixes_stages_for_pipe_first_order_upstream(self) -> None:
        """Pins the Paddle 3.3.1 limitation the fake hcg works around: with MoE order
        (pipe, moe_sharding, expert) and pp > 1, Paddle's sharding group of stage 1
        contains stage-0 ranks. If this starts failing, upstream fixed it and
        ``_MergeFixedEPHCG`` can go."""
        topo = _dense_topo(4, 2, 2, 1, PIPE_FIRST)
        paddle_lists = fleet_topology.EPHybridCommunicateGroup.merge_inner_comm_list(
            None, topo, "moe_sharding", "dense_sharding")
        stages = [{topo.get_coord(r).pipe for r in group} for group in paddle_lists]
        assert any(len(s) > 1 for s in stages), f"Paddle's merge no longer mixes stages: {paddle_lists}"
        ours = merge_inner_comm_list_by_coords(topo, "moe_sharding", "dense_sharding")
        assert ours == [list(range(0, 8)), list(range(8, 16))], ours

    def test_tensor_parallel_config_and_strategy_helper(self) -> None:
        fake_dist = self.fake_dist
        strategy = make_hybrid_strategy(ep=4, moe_sharding=2, pp=1, mp=2)
        comm = fake_dist(8, rank=5, hcg_factory=make_hcg_factory(ep=4, moe_sharding=2, mp=2), strategy=strategy)
        hcg = fleet.get_hybrid_communicate_group()
        assert hcg.get_model_parallel_world_size() == 2
        assert hcg.get_sharding_parallel_world_size() == 4
        user = fleet.fleet._user_defined_strategy
        configs = user.hybrid_configs
        assert (configs["ep_degree"], configs["moe_sharding_degree"], configs["mp_degree"],
                configs["sharding_degree"]) == (4, 2, 2, 4)
        order = list(user.hybrid_parallel_order)
        assert order.index("moe_sharding") < order.index("pp") < order.index("ep"), order
        assert any(r.op == "new_group" for r in comm.current().trace)

    def test_bad_configs_are_rejected_with_a_reason(self) -> None:
        fake_dist = self.fake_dist
        fake_dist(8, rank=0)
        with self.assertRaisesRegex(ValueError, "does not match"):
            make_hcg_factory(ep=4, moe_sharding=4)(0)
        with self.assertRaisesRegex(ValueError, "must divide ep"):
            make_hcg_factory(ep=4, moe_sharding=2, mp=3)(0)
        with self.assertRaisesRegex(ValueError, "order must contain"):
            make_hcg_factory(ep=4, moe_sharding=2, order=("pipe", "expert"))


if __name__ == "__main__":
    unittest.main()
