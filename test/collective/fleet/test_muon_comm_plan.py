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
"""Spec tests for the hierarchical (comm_group_call_opt) routing plan.

Each test names the configuration, the property and, on failure, what went
wrong in terms of ranks, nodes, stages and groups.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import math
import os
import sys
import unittest
from collections import defaultdict
from unittest import mock

import numpy as np
from mock.fake_hcg import DEFAULT_MOE_ORDER, PIPE_FIRST_MOE_ORDER
from muon_sim_runner import raises

import paddle
from paddle.distributed.fleet.base.topology import CommunicateTopology

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import comm_plan as mcp
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.comm_plan import (
    GroupSpec,
    HierarchicalCommPlan,
    HierarchicalGroups,
    resolve_gpus_per_node,
)

MS_FIRST, PIPE_FIRST = DEFAULT_MOE_ORDER, PIPE_FIRST_MOE_ORDER


@functools.lru_cache(maxsize=None)
def make_topo(order: tuple[str, ...], ms: int, pp: int, ep: int) -> CommunicateTopology:
    dims = {"moe_sharding": ms, "pipe": pp, "expert": ep}
    return CommunicateTopology(list(order), [dims[n] for n in order])


def oracle(topo: CommunicateTopology, gpn: int) -> str | None:
    """Independent expectation: None if valid, else the expected message fragment."""
    world = topo.world_size()
    stage = [topo.get_coord(r).pipe for r in range(world)]
    for node in range(world // gpn):
        if len({stage[r] for r in range(node * gpn, (node + 1) * gpn)}) > 1:
            return "mixes pipeline stages"
    for p in range(topo.get_dim("pipe")):
        if len({r // gpn for r in topo.get_axis_list("pipe", p)}) < 2:
            return "lies on a single node"
    return None


GRID = [
    (order, ep, gpn, ms, pp)
    for order in (MS_FIRST, PIPE_FIRST)
    for ep in (4, 8, 12, 16, 32)
    for gpn in (2, 4, 8)
    for ms in (2, 4)
    for pp in (1, 2)
]


def grid_id(case) -> str:
    order, ep, gpn, ms, pp = case
    first = "msfirst" if order == MS_FIRST else "pipefirst"
    return f"{first}-ep{ep}-gpn{gpn}-ms{ms}-pp{pp}"


def check_valid_plan(plan: HierarchicalCommPlan, topo: CommunicateTopology, gpn: int):
    world = topo.world_size()
    pp = topo.get_dim("pipe")
    ms, ep = topo.get_dim("moe_sharding"), topo.get_dim("expert")
    assert plan.world_size == world, f"world_size {plan.world_size}, topology has {world}"
    assert plan.num_nodes == world // gpn, f"num_nodes {plan.num_nodes} for {world} ranks / {gpn}"

    # Node groups partition the world.
    node_members = [r for n in range(plan.num_nodes) for r in plan.node_ranks(n)]
    assert sorted(node_members) == list(range(world)), "node groups must partition the world"

    for p in range(pp):
        # Sharding groups come from the topology, not from a formula.
        topo_group = topo.get_axis_list("pipe", p)
        assert list(plan.sharding_group_ranks(p)) == topo_group, (
            f"stage {p}: plan sharding group {plan.sharding_group_ranks(p)} differs "
            f"from the topology's {topo_group}"
        )
        for lst in topo.get_comm_list("moe_sharding") + topo.get_comm_list("expert"):
            assert set(lst) <= set(topo_group) or not set(lst) & set(topo_group), (
                f"comm list {lst} straddles stage {p}'s sharding group"
            )
        nodes = {r // gpn for r in topo_group}
        # Same-card groups partition the sharding group, one rank per node.
        members = []
        for c in range(gpn):
            group = plan.same_card_ranks(p, c)
            assert len(group) == ms * ep // gpn, (
                f"same-card group (stage {p}, card {c}) has {len(group)} ranks, "
                f"expected moe_sharding*ep/gpn = {ms * ep // gpn}"
            )
            assert {r // gpn for r in group} == nodes and len(group) == len(nodes), (
                f"same-card group (stage {p}, card {c}) = {group} must hold one rank "
                f"on each of the stage's nodes {sorted(nodes)}"
            )
            assert all(r % gpn == c for r in group), f"group {group} mixes cards"
            assert list(group) == sorted(group)
            members.extend(group)
        assert sorted(members) == topo_group, (
            f"same-card groups of stage {p} do not partition its sharding group"
        )

    rng = np.random.default_rng(world * 131 + gpn)
    values = rng.standard_normal(world)
    for p in range(pp):
        group = topo.get_axis_list("pipe", p)
        flat = float(np.mean(values[group]))
        for o in group:
            assert plan.stage_of(o) == p
            partial = defaultdict(list)
            participants = []
            for r in group:
                root = plan.intra_node_root(o, r)
                assert root // gpn == r // gpn, (
                    f"owner {o}: rank {r}'s intra-node root {root} is not on its node"
                )
                assert root % gpn == o % gpn, (
                    f"owner {o}: rank {r}'s intra-node root {root} has card "
                    f"{root % gpn}, expected the owner's card {o % gpn}"
                )
                assert plan.stage_of(root) == p, f"root {root} left stage {p}"
                partial[root].append(values[r])
                crosses = plan.in_cross_node_step(o, r)
                assert crosses == (r % gpn == o % gpn), (
                    f"owner {o}: rank {r} cross-node participation is {crosses}"
                )
                if crosses:
                    participants.append(r)
            key = (plan.stage_of(o), plan.card_of(o))
            assert key == (p, o % gpn)
            assert participants == list(plan.same_card_ranks(*key)) == sorted(partial), (
                f"owner {o}: cross-node participants {participants} are not the "
                f"intra-node roots {sorted(partial)}"
            )
            assert o in participants, f"owner {o} missing from its own cross-node group"
            two_level = float(np.mean([np.mean(partial[r]) for r in participants]))
            assert math.isclose(two_level, flat, rel_tol=1e-12, abs_tol=1e-14), (
                f"owner {o}: mean of node means {two_level} != global mean {flat}"
            )


def _grid_plan_is_valid_or_rejected(case):
    order, ep, gpn, ms, pp = case
    topo = make_topo(order, ms, pp, ep)
    expected_error = oracle(topo, gpn)
    if expected_error is not None:
        with raises(ValueError, match=expected_error):
            HierarchicalCommPlan.from_topology(topo, gpn)
        return
    plan = HierarchicalCommPlan.from_topology(topo, gpn)
    check_valid_plan(plan, topo, gpn)


def hard_coded_rank(s: int, p: int, e: int, pp: int, ep: int) -> int:
    return s * pp * ep + p * ep + e


# ----------------------------------------------------------------- gpus per node
BAD_LOCAL_SIZES = ["abc", "0", "-3", "", "  ", "4.5", "0x8", "8 cards", "1_000", "\uff18"]


def _resolve_rejects_bad_local_size(raw):
    with raises(ValueError, match="PADDLE_LOCAL_SIZE") as info:
        resolve_gpus_per_node({"PADDLE_LOCAL_SIZE": raw}, device_count=lambda: 8)
    assert repr(raw) in str(info.value), "message should show the offending value"


BAD_DEVICE_COUNTS = [
    (0, ValueError, "PADDLE_LOCAL_SIZE is not set"),
    (-1, ValueError, "no accelerator is visible"),
    ("8", TypeError, "must return an int"),
    (True, TypeError, "must return an int"),
]


def _resolve_rejects_bad_device_count(count, exc, fragment):
    with raises(exc, match=fragment):
        resolve_gpus_per_node({}, lambda: count)


# ------------------------------------------------------------------ invalid table
class BadExpertListTopology(CommunicateTopology):
    """A topology whose expert comm lists straddle pipeline stages."""

    def get_comm_list(self, axis_name):
        lists = super().get_comm_list(axis_name)
        if axis_name == "expert":
            return [sorted(r for lst in lists for r in lst)]
        return lists


class BadPipeListTopology(CommunicateTopology):
    """A topology whose pipe comm lists are reversed w.r.t. get_coord."""

    def get_comm_list(self, axis_name):
        lists = super().get_comm_list(axis_name)
        if axis_name == "pipe":
            return [list(reversed(lst)) for lst in lists]
        return lists


class FakeHcg:
    def __init__(self, moe_topo, mp=1, nranks=None):
        if moe_topo is not None:
            self._moe_topo = moe_topo
        self._mp = mp
        if nranks is not None:
            self.nranks = nranks

    def get_model_parallel_world_size(self):
        return self._mp


def plan_for(order=MS_FIRST, ms=2, pp=1, ep=8, gpn=4, mp=1):
    return HierarchicalCommPlan.from_topology(make_topo(order, ms, pp, ep), gpn, mp)


GOOD = plan_for(MS_FIRST, ms=2, pp=2, ep=8, gpn=4)  # world 32, 8 nodes, 2 stages

INVALID = [
    # (id, thunk, error type, message fragment)
    ("env-abc", lambda: resolve_gpus_per_node({"PADDLE_LOCAL_SIZE": "abc"}), ValueError, "PADDLE_LOCAL_SIZE='abc' is not an integer"),
    ("env-zero", lambda: resolve_gpus_per_node({"PADDLE_LOCAL_SIZE": "0"}), ValueError, "must be a positive integer"),
    ("env-negative", lambda: resolve_gpus_per_node({"PADDLE_LOCAL_SIZE": "-3"}), ValueError, "PADDLE_LOCAL_SIZE='-3'"),
    ("env-empty", lambda: resolve_gpus_per_node({"PADDLE_LOCAL_SIZE": ""}), ValueError, "PADDLE_LOCAL_SIZE=''"),
    ("env-float", lambda: resolve_gpus_per_node({"PADDLE_LOCAL_SIZE": "2.5"}), ValueError, "not an integer"),
    ("no-devices", lambda: resolve_gpus_per_node({}, lambda: 0), ValueError, "set PADDLE_LOCAL_SIZE|PADDLE_LOCAL_SIZE is not set"),
    ("gpn-1", lambda: plan_for(gpn=1), ValueError, "turn comm_group_call_opt off"),
    ("gpn-0", lambda: plan_for(gpn=0), ValueError, "must be >= 2"),
    ("gpn-negative", lambda: plan_for(gpn=-8), ValueError, "must be >= 2"),
    ("gpn-str", lambda: plan_for(gpn="8"), TypeError, "gpus_per_node must be an int"),
    ("gpn-float", lambda: plan_for(gpn=8.0), TypeError, "gpus_per_node must be an int"),
    ("gpn-bool", lambda: plan_for(gpn=True), TypeError, "gpus_per_node must be an int"),
    ("mp-2", lambda: plan_for(mp=2), ValueError, "does not support tensor parallel: mp_degree=2"),
    ("mp-0", lambda: plan_for(mp=0), ValueError, "mp_degree must be >= 1, got 0"),
    ("mp-str", lambda: plan_for(mp="1"), TypeError, "mp_degree must be an int"),
    ("world-not-multiple", lambda: plan_for(ms=1, ep=6, gpn=4), ValueError, "world size 6 .* not a multiple of gpus_per_node=4"),
    ("world-not-multiple-pp", lambda: plan_for(PIPE_FIRST, ms=3, pp=1, ep=4, gpn=8), ValueError, "not a multiple"),
    ("node-spans-stages-ep12", lambda: plan_for(MS_FIRST, ms=2, pp=2, ep=12, gpn=8), ValueError, r"node 1 \(ranks 8-15\) mixes pipeline stages \[0, 0, 0, 0, 1, 1, 1, 1\] \(and 1 more node\) "),
    ("node-spans-stages-many", lambda: plan_for(MS_FIRST, ms=4, pp=2, ep=12, gpn=8), ValueError, r"\(and 3 more nodes\)"),
    ("node-spans-stages-ep4", lambda: plan_for(MS_FIRST, ms=2, pp=2, ep=4, gpn=8), ValueError, "expert degree that is a multiple of gpus_per_node=8"),
    ("node-spans-stages-pipefirst", lambda: plan_for(PIPE_FIRST, ms=1, pp=2, ep=12, gpn=8), ValueError, "order pipe->moe_sharding->expert"),
    ("single-node-group", lambda: plan_for(ms=2, ep=4, gpn=8), ValueError, "lies on a single node .* turn comm_group_call_opt off"),
    ("single-node-group-pp2", lambda: plan_for(PIPE_FIRST, ms=2, pp=2, ep=4, gpn=8), ValueError, "stage 0 .* single node"),
    ("unknown-axis", lambda: HierarchicalCommPlan.from_topology(CommunicateTopology(["data", "moe_sharding", "expert"], [1, 2, 8]), 4), ValueError, r"unknown axis names \['data'\]"),
    ("dense-topology", lambda: HierarchicalCommPlan.from_topology(CommunicateTopology(), 4), ValueError, "not the dense topology"),
    ("no-expert-axis", lambda: HierarchicalCommPlan.from_topology(CommunicateTopology(["pipe", "moe_sharding"], [1, 8]), 4), ValueError, r"no \['expert'\] axis"),
    ("no-moe-sharding-axis", lambda: HierarchicalCommPlan.from_topology(CommunicateTopology(["pipe", "expert"], [1, 8]), 4), ValueError, r"no \['moe_sharding'\] axis"),
    ("not-a-topology", lambda: HierarchicalCommPlan.from_topology(object(), 4), TypeError, "must be a CommunicateTopology"),
    ("inconsistent-expert-lists", lambda: HierarchicalCommPlan.from_topology(BadExpertListTopology(list(MS_FIRST), [2, 2, 8]), 4), ValueError, "topology is inconsistent"),
    ("inconsistent-pipe-lists", lambda: HierarchicalCommPlan.from_topology(BadPipeListTopology(list(MS_FIRST), [2, 2, 8]), 4), ValueError, "topology is inconsistent"),
    ("hcg-without-moe-topo", lambda: HierarchicalCommPlan.from_hcg(FakeHcg(None), 4), ValueError, "ep_degree > 1"),
    ("hcg-mp-2", lambda: HierarchicalCommPlan.from_hcg(FakeHcg(make_topo(MS_FIRST, 2, 1, 8), mp=2), 4), ValueError, "tensor parallel"),
    ("hcg-world-mismatch", lambda: HierarchicalCommPlan.from_hcg(FakeHcg(make_topo(MS_FIRST, 2, 1, 8), nranks=32), 4), ValueError, "covers 16 ranks but the job has 32"),
    ("rank-negative", lambda: GOOD.node_of(-1), ValueError, r"rank -1 is out of range: .* 0\.\.31"),
    ("rank-too-big", lambda: GOOD.card_of(32), ValueError, "rank 32 is out of range"),
    ("owner-out-of-range", lambda: GOOD.intra_node_root(99, 0), ValueError, "owner 99 is out of range"),
    ("owner-other-stage", lambda: GOOD.in_cross_node_step(0, 8), ValueError, r"owner 0 \(pipeline stage 0\) and rank 8 \(stage 1\)"),
    ("node-out-of-range", lambda: GOOD.node_ranks(8), ValueError, r"node 8 is out of range: valid nodes are 0\.\.7"),
    ("stage-out-of-range", lambda: GOOD.sharding_group_ranks(2), ValueError, "stage 2 is out of range"),
    ("card-out-of-range", lambda: GOOD.same_card_ranks(0, 4), ValueError, "card 4 is out of range"),
    ("spread-stage-out-of-range", lambda: GOOD.spread_rank_order(-1), ValueError, "stage -1 is out of range"),
    ("create-groups-bad-rank", lambda: GOOD.create_groups(32, new_group=list), ValueError, "rank 32 is out of range"),
]


def _invalid_settings_raise_clear_errors(thunk, exc, fragment):
    with raises(exc, match=fragment):
        thunk()


# ------------------------------------------------------------------ groups
# ------------------------------------------------------------------ spread order
SPREAD_CASES = [
    (MS_FIRST, 2, 1, 12, 8),  # 3 nodes x 8 cards (gcd 1)
    (MS_FIRST, 2, 2, 8, 4),  # 4 nodes x 4 cards per stage (gcd 4)
    (PIPE_FIRST, 4, 2, 4, 8),  # 2 nodes x 8 cards per stage
    (PIPE_FIRST, 2, 1, 32, 2),  # 32 nodes x 2 cards
    (MS_FIRST, 4, 2, 16, 8),  # 8 nodes x 8 cards per stage
    (MS_FIRST, 2, 1, 12, 4),  # 6 nodes x 4 cards (gcd 2)
    (MS_FIRST, 1, 1, 4, 2),  # 2 nodes x 2 cards: strict alternation impossible
]


def _spread_rank_order_interleaves_cards_and_nodes(order, ms, pp, ep, gpn):
    plan = plan_for(order, ms=ms, pp=pp, ep=ep, gpn=gpn)
    for p in range(pp):
        spread = plan.spread_rank_order(p)
        nodes = plan.nodes_of_stage(p)
        assert sorted(spread) == list(plan.sharding_group_ranks(p)), (
            f"stage {p}: spread order does not cover the sharding group exactly"
        )
        assert len({r % gpn for r in spread[:gpn]}) == gpn, (
            f"stage {p}: the first {gpn} owners {spread[:gpn]} repeat a card"
        )
        for start in range(0, len(spread), gpn):
            chunk = spread[start:start + gpn]
            assert sorted(r % gpn for r in chunk) == list(range(gpn)), (
                f"stage {p}: entries {start}..{start + gpn - 1} {chunk} repeat a card"
            )
        card_count = dict.fromkeys(range(gpn), 0)
        node_count = dict.fromkeys(nodes, 0)
        for i, r in enumerate(spread):
            card_count[r % gpn] += 1
            node_count[r // gpn] += 1
            assert max(card_count.values()) - min(card_count.values()) <= 1, (
                f"stage {p}: first {i + 1} owners load the rails unevenly {card_count}"
            )
            assert max(node_count.values()) - min(node_count.values()) <= 1, (
                f"stage {p}: first {i + 1} owners load the nodes unevenly {node_count}"
            )
        strict = not (gpn == 2 and len(nodes) == 2)
        for a, b in itertools.pairwise(spread):
            differs = (a % gpn != b % gpn, a // gpn != b // gpn)
            assert all(differs) if strict else any(differs), (
                f"stage {p}: consecutive ranks {a}, {b} share a card or a node"
            )


class TestHierarchicalCommPlan(unittest.TestCase):
    """Each case of the tables above runs as a subtest."""

    def test_grid_plan_is_valid_or_rejected(self):
        for case in GRID:
            with self.subTest(case=grid_id(case)):
                _grid_plan_is_valid_or_rejected(case)

    def test_grid_has_both_valid_and_invalid_cases_in_each_order(self):
        outcomes = defaultdict(set)
        for order, ep, gpn, ms, pp in GRID:
            outcomes[order].add(oracle(make_topo(order, ms, pp, ep), gpn))
        for order in (MS_FIRST, PIPE_FIRST):
            assert None in outcomes[order], f"{order}: no valid layout in the grid"
            assert "lies on a single node" in outcomes[order], (
                f"{order}: no single-node refusal in the grid: {outcomes[order]}")
        assert "mixes pipeline stages" in outcomes[MS_FIRST]
        # pipe-first stages are contiguous blocks of ms*ep ranks: never mixed here.
        assert "mixes pipeline stages" not in outcomes[PIPE_FIRST]

    def test_ep12_on_8_card_nodes_covers_every_rank(self):
        """Upstream bug 1: ranks beyond floor(ep/8)*8 were in no same-card group."""
        topo = make_topo(MS_FIRST, 2, 1, 12)
        plan = HierarchicalCommPlan.from_topology(topo, 8)
        self.assertEqual((plan.world_size, plan.num_nodes), (24, 3), "ep=12 x ms=2 on 8-card nodes")
        count = defaultdict(int)
        for spec in plan.group_specs():
            if spec.kind == "same_card":
                for r in spec.ranks:
                    count[r] += 1
        assert all(count[r] == 1 for r in range(24)), (
            f"ranks not in exactly one same-card group: "
            f"{[r for r in range(24) if count[r] != 1]}"
        )
        upstream_dropped = [r for r in range(24) if topo.get_coord(r).expert >= 8]
        assert upstream_dropped, "case must contain ranks upstream left out"
        for r in upstream_dropped:
            group = plan.same_card_ranks(0, r % 8)
            self.assertIn(r, group, f"rank {r} is not in its own same-card group")
            self.assertEqual(len(group), 3, f"rank {r}: same-card group {group}, one per node")
        check_valid_plan(plan, topo, 8)

    def test_topology_order_changes_groups_and_formula_is_wrong(self):
        """Upstream bug 2: a hard-coded rank formula silently builds wrong groups."""
        ms, pp, ep, gpn = 2, 2, 8, 4
        pipe_first = make_topo(PIPE_FIRST, ms, pp, ep)
        ms_first = make_topo(MS_FIRST, ms, pp, ep)
        plan_pf = HierarchicalCommPlan.from_topology(pipe_first, gpn)
        plan_mf = HierarchicalCommPlan.from_topology(ms_first, gpn)

        formula_stage0 = sorted(
            hard_coded_rank(s, 0, e, pp, ep) for s in range(ms) for e in range(ep)
        )
        topo_pf_stage0 = sorted(
            pipe_first.get_rank(pipe=0, moe_sharding=s, expert=e)
            for s in range(ms)
            for e in range(ep)
        )
        # The formula matches the moe_sharding-first layout ...
        assert list(plan_mf.sharding_group_ranks(0)) == formula_stage0
        # ... but not pipe-first: it would mix stages, the plan does not.
        assert formula_stage0 != topo_pf_stage0
        assert list(plan_pf.sharding_group_ranks(0)) == topo_pf_stage0 == list(range(16))
        assert {pipe_first.get_coord(r).pipe for r in formula_stage0} == {0, 1}, (
            "the formula's 'stage 0' group should contain ranks of both stages"
        )
        assert plan_pf.same_card_ranks(0, 1) != plan_mf.same_card_ranks(0, 1)
        assert plan_pf.same_card_ranks(0, 1) == (1, 5, 9, 13)
        assert plan_mf.same_card_ranks(0, 1) == (1, 5, 17, 21)
        check_valid_plan(plan_pf, pipe_first, gpn)
        check_valid_plan(plan_mf, ms_first, gpn)

    def test_topology_without_pipe_axis_is_one_stage(self):
        topo = CommunicateTopology(["moe_sharding", "expert"], [2, 8])
        plan = HierarchicalCommPlan.from_topology(topo, 4)
        self.assertEqual(plan.pp_degree, 1, "no pipe axis: one stage")
        self.assertEqual(plan.sharding_group_ranks(0), tuple(range(16)), "the stage holds every rank")
        assert plan.same_card_ranks(0, 3) == (3, 7, 11, 15)
        assert plan.moe_sharding_ranks(9) == (1, 9)

    def test_moe_sharding_groups_come_from_comm_lists(self):
        topo = make_topo(PIPE_FIRST, 2, 2, 8)
        plan = HierarchicalCommPlan.from_topology(topo, 4)
        for lst in topo.get_comm_list("moe_sharding"):
            for r in lst:
                assert list(plan.moe_sharding_ranks(r)) == lst, f"rank {r}: wrong moe_sharding group"

    def test_resolve_rejects_bad_local_size(self):
        for raw in BAD_LOCAL_SIZES:
            with self.subTest(case=repr(raw)):
                _resolve_rejects_bad_local_size(raw)

    def test_resolve_reads_local_size_before_device_count(self):
        def must_not_run():
            raise AssertionError("device_count used although PADDLE_LOCAL_SIZE is set")

        assert resolve_gpus_per_node({"PADDLE_LOCAL_SIZE": "4"}, must_not_run) == 4
        assert resolve_gpus_per_node({"PADDLE_LOCAL_SIZE": " 16 "}, must_not_run) == 16
        assert resolve_gpus_per_node({"PADDLE_LOCAL_SIZE": "+2"}, must_not_run) == 2

    def test_resolve_defaults_to_os_environ(self):
        with mock.patch.dict(os.environ, {"PADDLE_LOCAL_SIZE": "4"}):
            assert resolve_gpus_per_node() == 4
            del os.environ["PADDLE_LOCAL_SIZE"]
            assert resolve_gpus_per_node(device_count=lambda: 2) == 2

    def test_resolve_uses_device_count_when_unset(self):
        calls = []
        assert resolve_gpus_per_node({}, lambda: calls.append(1) or 8) == 8
        assert calls == [1]
        assert resolve_gpus_per_node({}, lambda: np.int64(4)) == 4

    def test_resolve_rejects_bad_device_count(self):
        for count, exc, fragment in BAD_DEVICE_COUNTS:
            with self.subTest(case=repr(count)):
                _resolve_rejects_bad_device_count(count, exc, fragment)

    def test_resolve_default_device_count_is_paddle_cuda(self):
        with mock.patch.object(paddle.device.cuda, "device_count", lambda: 8):
            assert resolve_gpus_per_node({}) == 8

        def no_cuda():
            raise RuntimeError("no CUDA in this build")

        with mock.patch.object(paddle.device.cuda, "device_count", no_cuda), raises(ValueError, match="set PADDLE_LOCAL_SIZE|PADDLE_LOCAL_SIZE is not set"):
            resolve_gpus_per_node({})

    def test_import_and_construction_resolve_nothing(self):
        """Upstream bug 3: GPUs per node resolved with the option off."""
        calls = []

        def exploding_device_count():
            calls.append(1)
            raise RuntimeError("CUDA touched")

        env = {k: v for k, v in os.environ.items() if k != "PADDLE_LOCAL_SIZE"}
        # Fresh copy of the module under another name (leaves sys.modules' copy alone).
        spec = importlib.util.spec_from_file_location("_muon_comm_plan_fresh", mcp.__file__)
        fresh = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = fresh
        try:
            with mock.patch.dict(os.environ, env, clear=True), mock.patch.object(
                    paddle.device.cuda, "device_count", exploding_device_count):
                spec.loader.exec_module(fresh)
                plan = fresh.HierarchicalCommPlan.from_topology(make_topo(MS_FIRST, 2, 1, 8), 4)
                plan.create_groups(0, new_group=lambda ranks: tuple(ranks))
                plan.describe()
        finally:
            del sys.modules[spec.name]
        assert calls == [], "import/construction must not query the device count"

    def test_invalid_table_is_large_enough(self):
        assert len(INVALID) >= 20

    def test_invalid_settings_raise_clear_errors(self):
        for case_id, thunk, exc, fragment in INVALID:
            with self.subTest(case=case_id):
                _invalid_settings_raise_clear_errors(thunk, exc, fragment)

    def test_from_hcg_reads_moe_topo_and_mp(self):
        topo = make_topo(PIPE_FIRST, 2, 2, 8)
        plan = HierarchicalCommPlan.from_hcg(FakeHcg(topo, nranks=32), 4)
        assert plan.sharding_group_ranks(1) == tuple(range(16, 32))
        plan = HierarchicalCommPlan.from_hcg(FakeHcg(topo), 4)  # no nranks attribute
        assert plan.world_size == 32

    def test_group_specs_order_is_rank_independent_and_deterministic(self):
        topo = make_topo(PIPE_FIRST, 2, 2, 8)
        specs = [HierarchicalCommPlan.from_topology(topo, 4).group_specs() for _ in range(3)]
        assert specs[0] == specs[1] == specs[2]
        kinds = [s.kind for s in specs[0]]
        assert kinds == ["node"] * 8 + ["same_card"] * 8, "node groups first, then same-card"
        assert [s.key for s in specs[0][8:]] == [(p, c) for p in range(2) for c in range(4)]
        assert all(isinstance(s, GroupSpec) and list(s.ranks) == sorted(s.ranks) for s in specs[0])

    def test_create_groups_calls_new_group_for_every_spec_in_order(self):
        plan = GOOD
        specs = plan.group_specs()
        per_rank_calls = {}
        for rank in range(plan.world_size):
            calls = []

            def recorder(ranks, _calls=calls):
                assert isinstance(ranks, list), "new_group must get a list of ranks"
                _calls.append(tuple(ranks))
                return ("group", tuple(ranks))

            groups = plan.create_groups(rank, new_group=recorder)
            per_rank_calls[rank] = calls
            assert calls == [s.ranks for s in specs], f"rank {rank} created groups out of order"
            assert isinstance(groups, HierarchicalGroups)
            assert rank in groups.node_group[1], f"rank {rank} not in its node group"
            stage = plan.stage_of(rank)
            assert groups.same_card_group == ("group", plan.same_card_ranks(stage, rank % 4))
            assert rank in groups.same_card_group[1], f"rank {rank} not in its same-card group"
            for owner in plan.sharding_group_ranks(stage):
                if plan.in_cross_node_step(owner, rank):
                    assert owner in groups.same_card_group[1], (
                        f"rank {rank} would join owner {owner}'s cross-node step on "
                        f"group {groups.same_card_group[1]} that lacks the owner"
                    )
        assert len({tuple(c) for c in per_rank_calls.values()}) == 1

    def test_create_groups_defaults_to_paddle_new_group(self):
        calls = []
        with mock.patch.object(paddle.distributed, "new_group",
                               lambda ranks: calls.append(ranks) or len(calls)):
            groups = plan_for(ms=2, ep=8, gpn=4).create_groups(5)
        assert calls == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15],
                         [0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
        self.assertEqual((groups.node_group, groups.same_card_group), (2, 6),
                         "create_groups must hand back the node and same-card groups of this rank")

    def test_spread_rank_order_interleaves_cards_and_nodes(self):
        for case in SPREAD_CASES:
            with self.subTest(case=repr(case[1:])):
                _spread_rank_order_interleaves_cards_and_nodes(*case)

    def test_describe_names_nodes_stages_and_groups(self):
        text = plan_for(MS_FIRST, ms=2, pp=1, ep=12, gpn=8).describe()
        assert "world 24 = 3 nodes x 8 cards" in text
        assert "node 2: ranks 16-23, stage 0" in text
        assert "same-card group (stage 0, card 7): [7, 15, 23]" in text
        assert "order [moe_sharding=2, pipe=1, expert=12]" in text
        assert "HierarchicalCommPlan(world_size=32" in repr(GOOD)
        assert "stage 1: sharding group [8, 9, 10" in GOOD.describe()


if __name__ == "__main__":
    unittest.main()
