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
"""Ranks agree on every setting that changes numbers; parameters without a
gradient are decayed.

Spec: two ranks of one sharding group that differ in the learning-rate
scheduler (class, parameters or state), the grad clip (class or threshold),
``lr_ratio`` or ``apply_decay_param_fun`` (evaluated on each parameter) or a
parameter's ``optimize_attr`` learning rate, ``regularizer`` or
``need_clip`` are refused at construction on both ranks by one line naming
the setting, both values and the ranks; settings that are other objects but
the same values are accepted. A parameter that never receives a gradient is
weight-decayed by the sharded optimizer, as by develop's (its gradient is a
view into a fused buffer: zeros, never None), the way single-process Muon
decays a parameter whose gradient holds zeros; single-process Muon skips a
None gradient.
"""

from __future__ import annotations

import json
import os
import types
import unittest

import numpy as np
import paddle

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import agreement
from paddle_muon_ext.optimizer.muon import Muon, MuonParamInfo

_HERE = os.path.dirname(os.path.abspath(__file__))

#: row of the worker's SETTING_CASES -> what both ranks' error must say
REFUSED = {
    "scheduler parameter": ["option muon learning_rate is 'StepDecay(", "gamma=0.1",
                            "on rank 0 but 'StepDecay(", "gamma=0.9"],
    "scheduler state": ["option muon learning_rate is 'StepDecay(", "last_epoch=0",
                        "last_epoch=1", "last_lr=0.01"],
    "scheduler class": ["option muon learning_rate is 'StepDecay(",
                        "on rank 0 but 'ExponentialDecay("],
    "clip threshold": ["option muon grad_clip is \"ClipGradByGlobalNorm(", "clip_norm=0.0001",
                       "clip_norm=100.0"],
    "clip class": ["option muon grad_clip is \"ClipGradByGlobalNorm(",
                   "but 'ClipGradByNorm(clip_norm=1.0)' on rank 1"],
    "lr_ratio": ["parameter #2 (agree.w_out) has lr_ratio 1.0 on rank 0 but 0.5 on rank 1"],
    "apply_decay_param_fun": ["parameter #3 (agree.norm) has apply_decay_param_fun True on "
                              "rank 0 but False on rank 1"],
    "optimize_attr learning_rate": ["parameter #1 (agree.b_in) has optimize_attr "
                                    "learning_rate 1.0 on rank 0 but 2.0 on rank 1"],
    "regularizer": ["parameter #0 (agree.w_in) has regularizer 'L2Decay(coeff=0.01)' on "
                    "rank 0 but 'L2Decay(coeff=0.1)' on rank 1"],
    "need_clip": ["parameter #2 (agree.w_out) has need_clip True on rank 0 but False on "
                  "rank 1"],
}

#: as in the worker: lr 0.1, weight decay 0.5, two steps, these never used
NO_GRAD_LR, NO_GRAD_WD, NO_GRAD_STEPS = 0.1, 0.5, 2
NO_GRAD_UNUSED = ("agree.w_out", "agree.norm")


def _decayed(value: np.ndarray, steps: int) -> np.ndarray:
    """Decoupled weight decay alone, in float32: p <- p * (1 - lr * wd)."""
    out = value.astype("float32")
    for _ in range(steps):
        out = out * np.float32(1.0 - NO_GRAD_LR * NO_GRAD_WD)
    return out


class TestSettingsAgreementOnGloo(unittest.TestCase):
    """Two real gloo ranks (one launch, every row): a per-rank setting is
    refused on both ranks; parameters without a gradient are decayed."""

    @classmethod
    def setUpClass(cls):
        from launch_utils import run_paddle_launch

        repo = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
        env = {"AGREE_MODE": "settings", "PYTHONPATH": os.pathsep.join(
            [os.path.join(repo, "python"), _HERE, os.environ.get("PYTHONPATH", "")])}
        result = run_paddle_launch(os.path.join(_HERE, "muon_rank_agreement_worker.py"), 2,
                                   env, timeout_s=240).check()
        cls.cases: dict = {}
        cls.no_grad: dict = {}
        for log in result.worker_logs.values():
            for line in log.splitlines():
                if line.startswith("AGREE_CASE "):
                    data = json.loads(line[len("AGREE_CASE "):])
                    cls.cases.setdefault(data["case"], {})[data["rank"]] = data
                elif line.startswith("AGREE_NO_GRAD "):
                    data = json.loads(line[len("AGREE_NO_GRAD "):])
                    cls.no_grad[data["rank"]] = data

    def test_a_setting_that_changes_numbers_is_refused_on_both_ranks_naming_it(self):
        for case, wanted in REFUSED.items():
            with self.subTest(setting=case):
                outcomes = self.cases.get(case, {})
                self.assertEqual(sorted(outcomes), [0, 1], f"verdicts: {outcomes}")
                for rank, data in outcomes.items():
                    self.assertEqual(data["error"], "RankDisagreementError",
                                     f"rank {rank}: {data}")
                    message = data["message"]
                    self.assertNotIn("\n", message)
                    self.assertIn("the sharding group [0, 1] disagree (ranks [1] differ "
                                  "from rank 0)", message)
                    for text in wanted:
                        self.assertIn(text, message)

    def test_other_objects_with_equal_values_are_accepted(self):
        # rank 1 passes lr_ratio / apply_decay_param_fun functions that give
        # the defaults' values, and its own scheduler and clip objects
        outcomes = self.cases.get("equal settings", {})
        self.assertEqual(sorted(outcomes), [0, 1], f"verdicts: {outcomes}")
        for rank, data in outcomes.items():
            self.assertIsNone(data["error"], f"rank {rank}: {data}")

    def test_a_parameter_without_gradient_is_decayed_as_with_a_zero_gradient(self):
        self.assertEqual(sorted(self.no_grad), [0, 1], "both ranks report their values")
        for rank, data in self.no_grad.items():
            for name in NO_GRAD_UNUSED:
                with self.subTest(rank=rank, parameter=name):
                    initial = np.asarray(data["initial"][name], "float32")
                    final = np.asarray(data["final"][name], "float32")
                    np.testing.assert_allclose(final, _decayed(initial, NO_GRAD_STEPS),
                                               rtol=1e-6, atol=0)
            # the parameters in the forward are trained, not only decayed
            w_in = np.asarray(data["final"]["agree.w_in"], "float32")
            initial = np.asarray(data["initial"]["agree.w_in"], "float32")
            self.assertGreater(float(np.abs(w_in - _decayed(initial, NO_GRAD_STEPS)).max()),
                               1e-3)
        self.assertEqual(self.no_grad[0]["final"], self.no_grad[1]["final"],
                         "replicated parameters end equal on both ranks")


def _single_process_params() -> list:
    out = []
    for name, shape, fill in (("sp.w_in", [16, 16], 0.1), ("sp.b_in", [16], 0.2),
                              ("sp.w_out", [16, 8], 0.3), ("sp.norm", [8], 0.4)):
        p = paddle.create_parameter(shape, "float32", default_initializer=(
            paddle.nn.initializer.Constant(fill)))
        p.name = name
        out.append(p)
    return out


def _single_process_muon(ps: list) -> Muon:
    return Muon(learning_rate=NO_GRAD_LR, weight_decay=NO_GRAD_WD, parameters=ps,
                muon_param_info_map={p.name: MuonParamInfo(use_muon=len(p.shape) == 2)
                                     for p in ps})


def _forward_without_unused(ps: list) -> None:
    x = paddle.to_tensor(np.random.default_rng(0).normal(0, 1, (4, 16)).astype("float32"))
    (paddle.tanh(paddle.matmul(x, ps[0]) + ps[1]) ** 2).mean().backward()


class TestParameterWithoutGradientSingleProcess(unittest.TestCase):
    """The single-process side of the rule USAGE states."""

    def test_single_process_muon_skips_a_none_gradient(self):
        ps = _single_process_params()
        opt = _single_process_muon(ps)
        _forward_without_unused(ps)
        self.assertIsNone(ps[2].grad)
        opt.step()
        np.testing.assert_array_equal(ps[2].numpy(), np.full([16, 8], 0.3, "float32"))
        np.testing.assert_array_equal(ps[3].numpy(), np.full([8], 0.4, "float32"))

    def test_a_zero_gradient_after_clear_grad_set_to_zero_is_decayed(self):
        # a once-used parameter holds zeros after clear_grad(set_to_zero=True):
        # single-process Muon decays it as the sharded optimizer does
        ps = _single_process_params()
        opt = _single_process_muon(ps)
        x = paddle.to_tensor(np.ones((2, 16), "float32"))
        (paddle.matmul(paddle.matmul(x, ps[0]) + ps[1], ps[2]) * ps[3]).sum().backward()
        opt.clear_grad(set_to_zero=True)
        _forward_without_unused(ps)
        opt.step()
        np.testing.assert_allclose(ps[2].numpy(), _decayed(np.full([16, 8], 0.3), 1),
                                   rtol=1e-6, atol=0)
        np.testing.assert_allclose(ps[3].numpy(), _decayed(np.full([8], 0.4), 1),
                                   rtol=1e-6, atol=0)


class TestSettingsRecords(unittest.TestCase):
    """What is compared per parameter and per optimizer (plain data)."""

    def test_a_setting_function_that_raises_is_a_value_not_a_lone_error(self):
        # one rank raising alone would leave the other waiting in the comparison
        p = types.SimpleNamespace(name="w", optimize_attr={"learning_rate": 1.0},
                                  regularizer=None, need_clip=True)
        opt = types.SimpleNamespace(_lr_ratio=lambda q: 1 / 0, _apply_decay_param_fun=None)
        settings = dict(agreement.param_settings(p, opt))
        self.assertEqual(settings["lr_ratio"], "raised ZeroDivisionError: division by zero")
        self.assertIs(settings["apply_decay_param_fun"], True)

    def test_a_scheduler_is_compared_by_values_that_change_numbers_only(self):
        # verbose and the state-dict key list (set by a first state_dict()
        # call) change no number: equal; a nested scheduler's values count
        a = paddle.optimizer.lr.StepDecay(0.1, 2, gamma=0.5)
        b = paddle.optimizer.lr.StepDecay(0.1, 2, gamma=0.5, verbose=True)
        b.state_dict()
        self.assertEqual(agreement.describe(a), agreement.describe(b))
        warm = [paddle.optimizer.lr.LinearWarmup(paddle.optimizer.lr.CosineAnnealingDecay(
            0.1, t_max), 5, 0.0, 0.1) for t_max in (10, 20)]
        self.assertNotEqual(agreement.describe(warm[0]), agreement.describe(warm[1]))
        self.assertIn("T_max=20", agreement.describe(warm[1]))

    def test_settings_differing_name_the_parameter_after_equal_records(self):
        rec = ("w", (4, 4), "float32", "muon")
        one = (("lr_ratio", 1.0), ("need_clip", True))
        two = (("lr_ratio", 1.0), ("need_clip", False))
        digests = [agreement.group_digests([(None, rec, s)], {None: [0, 3]}, {})[0]
                   for s in (one, two)]
        self.assertNotEqual(agreement.digest_words(digests[0]),
                            agreement.digest_words(digests[1]))
        msg = agreement.first_difference(digests)
        self.assertIn("ranks [3] differ from rank 0", msg)
        self.assertIn("parameter #0 (w) has need_clip True on rank 0 but False on rank 3", msg)


if __name__ == "__main__":
    unittest.main()
