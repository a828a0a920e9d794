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
"""Ranks agree at construction.

Spec: ranks of one group that pass their parameters in another order, with
another shape/dtype/Muon routing, or with other sharding options are refused
at construction by one error naming the first differing parameter (index and
name), each side's value and the ranks; what legitimately differs (experts
across EP ranks) is accepted; a healthy construction costs one small
all_reduce per group and gathers nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import unittest

import numpy as np
import paddle

from muon_sim_runner import SimConfig, run_world
from muon_tiny_moe import TinyMoE, _param, make_muon

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import agreement
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.agreement import (
    GroupDigest,
    RankDisagreementError,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_optimizer import (
    MuonShardingOptimizer,
)
from paddle_muon_ext.optimizer.muon import MuonParamInfo


def _rec(name, shape=(4, 4), dtype="float32", route="muon"):
    return (name, tuple(shape), dtype, route)


def _digest(params, ranks=(0, 1), fields=()):
    return GroupDigest("the sharding group", tuple(ranks), tuple(fields), tuple(params))


class TestPureDigest(unittest.TestCase):
    """The digest helpers on plain data (no world)."""

    def test_route_names_each_muon_param_info_combination(self):
        cases = {(True, False): "muon", (True, True): "muon+hyperball",
                 (False, True): "hyperball", (False, False): "adamw"}
        for (muon, ball), want in cases.items():
            self.assertEqual(agreement.route_of(MuonParamInfo(use_muon=muon, use_hyperball=ball)),
                             want)
        self.assertEqual(agreement.route_of(None), "no muon_param_info_map entry")

    def test_param_record_is_plain_values(self):
        p = types.SimpleNamespace(name="w", shape=[3, 5], dtype=paddle.bfloat16)
        self.assertEqual(agreement.param_record(p, MuonParamInfo(use_muon=False)),
                         ("w", (3, 5), "bfloat16", "adamw"))

    def test_hash_words_follow_content_not_label(self):
        a = _digest([_rec("a"), _rec("b")])
        words = agreement.digest_words(a)
        self.assertEqual(len(words), 4)
        self.assertTrue(all(0 <= w < 2**31 for w in words), words)
        relabelled = GroupDigest("other words", (5, 6), a.fields, a.params)
        self.assertEqual(agreement.digest_words(relabelled), words)
        swapped = _digest([_rec("b"), _rec("a")])
        self.assertNotEqual(agreement.digest_words(swapped), words)
        reshaped = _digest([_rec("a"), _rec("b", (4, 5))])
        self.assertNotEqual(agreement.digest_words(reshaped), words)

    def test_agreeing_digests_have_no_difference(self):
        d = _digest([_rec("a")], ranks=(0, 2, 4))
        self.assertIsNone(agreement.first_difference([d, d, d]))

    def test_swapped_order_names_first_index_both_values_and_ranks(self):
        ref = _digest([_rec("x"), _rec("a"), _rec("b", (8,), route="adamw")], ranks=(0, 2, 4))
        bad = _digest([_rec("x"), _rec("b", (8,), route="adamw"), _rec("a")], ranks=(0, 2, 4))
        msg = agreement.first_difference([ref, ref, bad])
        self.assertEqual(msg.count("\n"), 0)
        self.assertIn("ranks [4] differ from rank 0", msg)
        self.assertIn("parameter #1 (a) is a [4, 4] float32 muon on rank 0 but "
                      "b [8] float32 adamw on rank 4", msg)
        self.assertIn("[0, 2, 4]", msg)

    def test_several_differing_ranks_are_described_by_the_lowest(self):
        # ranks 2 and 4 differ from rank 0 in different ways: the message
        # lists both and shows the values of the first of them (rank 2)
        ref = _digest([_rec("a"), _rec("b")], ranks=(0, 2, 4))
        shape = _digest([_rec("a", (4, 5)), _rec("b")], ranks=(0, 2, 4))
        order = _digest([_rec("b"), _rec("a")], ranks=(0, 2, 4))
        msg = agreement.first_difference([ref, shape, order])
        self.assertIn("ranks [2, 4] differ from rank 0", msg)
        self.assertIn("parameter #0 (a) is a [4, 4] float32 muon on rank 0 but "
                      "a [4, 5] float32 muon on rank 2", msg)
        self.assertNotIn("on rank 4", msg)

    def test_extra_parameter_on_one_rank_names_it(self):
        ref = _digest([_rec("a")])
        more = _digest([_rec("a"), _rec("extra", (2, 2))])
        msg = agreement.first_difference([ref, more])
        self.assertIn("parameter #1 (extra) is no parameter on rank 0 but "
                      "extra [2, 2] float32 muon on rank 1 (1 vs 2 parameters)", msg)

    def test_option_difference_is_named_before_parameters(self):
        ref = _digest([_rec("a")], fields=[("option comm_buffer_size_MB", 256)])
        bad = _digest([_rec("b")], fields=[("option comm_buffer_size_MB", 1)])
        msg = agreement.first_difference([ref, bad])
        self.assertIn("option comm_buffer_size_MB is 256 on rank 0 but 1 on rank 1", msg)

    def test_group_digests_split_colours_and_carry_options_on_the_sharding_group(self):
        params = [(None, _rec("d0")), ("moe", _rec("e0")), (None, _rec("d1")),
                  ("moe", _rec("e1"))]
        out = agreement.group_digests(params, {None: [0, 1, 2, 3], "moe": [0, 2]},
                                      {"comm_overlap": False})
        self.assertEqual([d.colour for d in out], [None, "moe"])
        self.assertEqual([r[0] for r in out[0].params], ["d0", "d1"])
        self.assertEqual([r[0] for r in out[1].params], ["e0", "e1"])
        self.assertEqual(out[1].ranks, (0, 2))
        self.assertEqual(dict(out[0].fields), {"option comm_overlap": False,
                                               "colour order": ("'moe'",)})
        self.assertEqual(out[1].fields, ())

    def test_an_int_and_an_equal_float_option_agree(self):
        a = agreement.group_digests([], {None: [0, 1]}, {"comm_buffer_size_MB": 256, "on": True})
        b = agreement.group_digests([], {None: [0, 1]}, {"comm_buffer_size_MB": 256.0,
                                                         "on": True})
        self.assertEqual(agreement.digest_words(a[0]), agreement.digest_words(b[0]))
        c = agreement.group_digests([], {None: [0, 1]}, {"comm_buffer_size_MB": 256, "on": 1})
        self.assertNotEqual(agreement.digest_words(a[0]), agreement.digest_words(c[0]))
        self.assertIn("option on is True on rank 0 but 1.0 on rank 1",
                      agreement.first_difference([a[0], c[0]]))

    def test_sharding_options_leave_local_only_ones_out(self):
        @dataclasses.dataclass
        class S:
            comm_overlap: bool = True
            enable_optimizer_timer: bool = True
            enable_fuse_optimizer_states: bool = True

        self.assertEqual(agreement.sharding_options(S(), extra=3),
                         {"comm_overlap": True, "extra": 3})


# ----------------------------------------------------------------------------
# In the simulated world: the optimizer's construction
# ----------------------------------------------------------------------------
_DENSE = {"w_in": (8, 8), "b_in": (8,), "w_out": (8, 4)}


def _dense_params(order=None, shapes=None):
    shapes = dict(_DENSE, **(shapes or {}))
    names = order or list(_DENSE)
    return [_param(f"dense.{n}", np.zeros(shapes[n], "float32") + 0.1) for n in names]


def _construct(make_params, info_of=None, strategy_of=None):
    """A body: build ``make_params(rank)`` and construct the bare optimizer."""

    def body(cfg, strategy):
        rank = paddle.distributed.get_rank()
        hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
        params = make_params(rank, hcg)
        kwargs = {}
        if info_of is not None:
            kwargs["muon_param_info_map"] = info_of(rank, params)
        muon = make_muon(params, clip=False, **kwargs)
        s = strategy_of(rank, cfg) if strategy_of else strategy
        MuonShardingOptimizer(muon, hcg, s)
        return rank

    return body


def _disagreement(test, cfg, body) -> str:
    with test.assertRaises(RankDisagreementError) as ctx:
        run_world(cfg, body=body, reraise_original=True)
    msg = str(ctx.exception).split("\n")[0]
    return msg


class TestRanksAgreeAtConstruction(unittest.TestCase):
    """MuonShardingOptimizer refuses ranks that disagree, before any step."""

    def test_parameters_in_another_order_are_refused_naming_the_parameter(self):
        cfg = SimConfig(ep=1, ms=4, via_fleet=False)
        body = _construct(lambda rank, hcg: _dense_params(
            ["w_out", "w_in", "b_in"] if rank == 2 else None))
        msg = _disagreement(self, cfg, body)
        self.assertIn("the sharding group [0, 1, 2, 3]", msg)
        self.assertIn("ranks [2] differ from rank 0", msg)
        self.assertIn("parameter #0 (dense.w_in) is dense.w_in [8, 8] float32 muon on rank 0 "
                      "but dense.w_out [8, 4] float32 muon on rank 2", msg)

    def test_a_shape_that_differs_on_one_rank_is_refused(self):
        cfg = SimConfig(ep=1, ms=2, via_fleet=False)
        body = _construct(lambda rank, hcg: _dense_params(
            shapes={"w_out": (8, 6)} if rank == 1 else None))
        msg = _disagreement(self, cfg, body)
        self.assertIn("parameter #2 (dense.w_out) is dense.w_out [8, 4] float32 muon on "
                      "rank 0 but dense.w_out [8, 6] float32 muon on rank 1", msg)

    def test_a_muon_param_info_map_that_differs_is_refused(self):
        cfg = SimConfig(ep=1, ms=2, via_fleet=False)

        def info_of(rank, params):
            return {p.name: MuonParamInfo(use_muon=len(p.shape) == 2 and not (
                rank == 1 and p.name == "dense.w_in")) for p in params}

        msg = _disagreement(self, cfg, _construct(
            lambda rank, hcg: _dense_params(), info_of=info_of))
        self.assertIn("parameter #0 (dense.w_in) is dense.w_in [8, 8] float32 muon on rank 0 "
                      "but dense.w_in [8, 8] float32 adamw on rank 1", msg)

    def test_a_map_entry_missing_on_one_rank_is_a_disagreement_not_a_lone_error(self):
        # One rank alone raising would leave the others waiting in a collective.
        cfg = SimConfig(ep=1, ms=2, via_fleet=False)

        def info_of(rank, params):
            return {p.name: MuonParamInfo(use_muon=len(p.shape) == 2) for p in params
                    if not (rank == 0 and p.name == "dense.b_in")}

        msg = _disagreement(self, cfg, _construct(
            lambda rank, hcg: _dense_params(), info_of=info_of))
        self.assertIn("parameter #1 (dense.b_in) is dense.b_in [8] float32 no "
                      "muon_param_info_map entry on rank 0 but dense.b_in [8] float32 adamw "
                      "on rank 1", msg)

    def test_a_sharding_option_that_differs_is_refused(self):
        cfg = SimConfig(ep=1, ms=2, via_fleet=False)

        def strategy_of(rank, cfg):
            s = cfg.strategy()
            if rank == 1:
                s.hybrid_configs["sharding_configs"].comm_buffer_size_MB = 2
            return s

        msg = _disagreement(self, cfg, _construct(lambda rank, hcg: _dense_params(),
                                                  strategy_of=strategy_of))
        self.assertIn("option comm_buffer_size_MB is 1", msg)
        self.assertIn("on rank 0 but 2", msg)

    def test_a_learning_rate_that_differs_is_refused(self):
        # Each owner updates its matrices with its own lr: a silent mix otherwise.
        cfg = SimConfig(ep=1, ms=2, via_fleet=False)

        def body(cfg, strategy):
            rank = paddle.distributed.get_rank()
            hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
            params = _dense_params()
            muon = make_muon(params, clip=False)
            if rank == 1:
                muon._learning_rate = 0.05
            MuonShardingOptimizer(muon, hcg, strategy)

        msg = _disagreement(self, cfg, body)
        self.assertIn("option muon learning_rate is 0.02 on rank 0 but 0.05 on rank 1", msg)

    def test_optimizer_options_compare_scalars_schedulers_by_value_and_name_other_values(self):
        sched = paddle.optimizer.lr.StepDecay(learning_rate=0.1, step_size=1)
        opt = types.SimpleNamespace(_learning_rate=sched,
                                    _default_dict={"momentum": 0.9, "ns_steps": 5,
                                                   "reg": object()})
        self.assertEqual(agreement.optimizer_options(opt), {
            "muon learning_rate": "StepDecay(base_lr=0.1, gamma=0.1, last_epoch=0, "
                                  "last_lr=0.1, step_size=1)",
            "muon momentum": 0.9, "muon ns_steps": 5, "muon reg": "object"})

    def test_experts_that_differ_across_ep_ranks_are_accepted(self):
        # ep2 ms2: the EP ranks hold different experts (here: other names and
        # shapes); only the members of one expert's moe_sharding group compare.
        cfg = SimConfig(ep=2, ms=2, via_fleet=False)

        def params(rank, hcg):
            coord = hcg.get_expert_parallel_rank()
            experts = [_param(f"expert{coord}.w", np.zeros((8, 4 + coord), "float32"))]
            if coord == 1:
                experts.append(_param("expert1.b", np.zeros((4,), "float32")))
            for p in experts:
                p.color = {"color": "moe_expert", "group": hcg.get_moe_sharding_parallel_group()}
            return _dense_params() + experts

        self.assertEqual(run_world(cfg, body=_construct(params), reraise_original=True)[0],
                         [0, 1, 2, 3])

    def test_an_expert_differing_inside_its_moe_group_is_refused_naming_the_colour(self):
        cfg = SimConfig(ep=2, ms=2, via_fleet=False)
        topo = cfg.topology()
        odd_one = max(r for r in range(cfg.world) if topo.get_coord(r).expert == 1)

        def params(rank, hcg):
            shape = (8, 5) if rank == odd_one else (8, 4)
            p = _param("expert.w", np.zeros(shape, "float32"))
            p.color = {"color": "moe_expert", "group": hcg.get_moe_sharding_parallel_group()}
            return _dense_params() + [p]

        msg = _disagreement(self, cfg, _construct(params))
        self.assertIn("colour 'moe_expert'", msg)
        self.assertIn(f"ranks [{odd_one}] differ", msg)
        self.assertIn("expert.w [8, 4] float32 muon on rank", msg)
        self.assertIn(f"expert.w [8, 5] float32 muon on rank {odd_one}", msg)

    def test_healthy_construction_reduces_once_per_group_and_once_over_the_job(self):
        cfg = SimConfig(ep=2, ms=2, via_fleet=False)

        def body(cfg, strategy):
            hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
            coord = hcg.get_expert_parallel_rank()
            net = TinyMoE(coord, hcg.get_moe_sharding_parallel_group())
            MuonShardingOptimizer(make_muon(list(net.parameters()), clip=False), hcg, strategy)
            return list(hcg.get_moe_sharding_parallel_group().ranks)

        moe_groups, world = run_world(cfg, body=body)
        for rank, trace in enumerate(world.traces):
            # (the hcg's own one-rank check all_reduce is not the optimizer's)
            ops = [(r.op, tuple(r.group_ranks), r.numel) for r in trace
                   if r.group_seq is not None and len(r.group_ranks) > 1]
            # per group [hash, -hash]; then the job's verdict: one flag per rank
            self.assertEqual(ops, [("all_reduce", (0, 1, 2, 3), 8),
                                   ("all_reduce", tuple(moe_groups[rank]), 8),
                                   ("all_reduce", (0, 1, 2, 3), 4)],
                             f"rank {rank}: construction collectives")


    def test_a_group_disagreeing_makes_every_rank_of_the_job_refuse(self):
        # Before: only the moe group of the odd rank raised; the other moe
        # group went on into collectives the raised ranks never joined.
        cfg = SimConfig(ep=2, ms=2, via_fleet=False)
        topo = cfg.topology()
        odd_one = max(r for r in range(cfg.world) if topo.get_coord(r).expert == 1)

        def body(cfg, strategy):
            rank = paddle.distributed.get_rank()
            hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
            p = _param("expert.w", np.zeros((8, 5) if rank == odd_one else (8, 4), "float32"))
            moe = hcg.get_moe_sharding_parallel_group()
            p.color = {"color": "moe_expert", "group": moe}
            try:
                MuonShardingOptimizer(make_muon(_dense_params() + [p], clip=False), hcg,
                                      strategy)
            except RankDisagreementError as error:
                return list(moe.ranks), str(error)
            return list(moe.ranks), None

        outcomes, _ = run_world(cfg, body=body)
        odd_group = next(g for g, _ in outcomes if odd_one in g)
        self.assertLess(len(odd_group), cfg.world, "the case needs a rank outside the group")
        for rank, (group, message) in enumerate(outcomes):
            self.assertIsNotNone(message, f"rank {rank} went on past construction")
            self.assertIn(f"expert.w [8, 5] float32 muon on rank {odd_one}", message)
            if rank in odd_group:
                self.assertTrue(message.startswith("MuonShardingOptimizer: the ranks of "
                                                   "colour 'moe_expert'"), message)
            else:
                self.assertIn(f"rank {rank} refuses too: rank(s) {sorted(odd_group)} found "
                              "their group disagreeing", message)


_HERE = os.path.dirname(os.path.abspath(__file__))


class TestRanksAgreeOnGloo(unittest.TestCase):
    """Four real gloo processes, two sharding groups: the last group's order
    mismatch is refused there, naming the parameter, and every rank of the
    other group refuses too instead of going on."""

    def test_reversed_parameter_order_is_refused_on_every_rank_of_the_job(self):
        from launch_utils import run_paddle_launch

        repo = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
        env = {"AGREE_MODE": "order", "PYTHONPATH": os.pathsep.join(
            [os.path.join(repo, "python"), _HERE, os.environ.get("PYTHONPATH", "")])}
        result = run_paddle_launch(os.path.join(_HERE, "muon_rank_agreement_worker.py"), 4,
                                   env, timeout_s=240).check()
        outcomes = {}
        for log in result.worker_logs.values():
            for line in log.splitlines():
                if line.startswith("AGREE_RESULT "):
                    data = json.loads(line[len("AGREE_RESULT "):])
                    outcomes[data["rank"]] = data
        self.assertEqual(sorted(outcomes), [0, 1, 2, 3], f"verdicts: {outcomes}")
        last_group = outcomes[3]["sharding_group"]
        self.assertEqual(len(last_group), 2, f"two sharding groups of 2: {outcomes}")
        first, other = last_group
        detail = (f"parameter #0 (agree.w_in) is agree.w_in [16, 16] float32 muon on rank "
                  f"{first} but agree.norm [8] float32 adamw on rank {other}")
        for rank, data in outcomes.items():
            self.assertEqual(data["error"], "RankDisagreementError", f"rank {rank}: {data}")
            self.assertIn(detail, data["message"])
            if rank in last_group:
                self.assertIn(f"ranks [{other}] differ from rank {first}", data["message"])
            else:
                self.assertIn(f"rank {rank} refuses too: rank(s) {last_group}",
                              data["message"])


if __name__ == "__main__":
    unittest.main()
