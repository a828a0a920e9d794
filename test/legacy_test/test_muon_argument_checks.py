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
# paddle_muon_ext: compat-only  (checks develop's Muon does not make; not exported)
"""Muon refuses bad constructor arguments with one line naming the argument,
the value and the valid range, after develop's own checks (whose types and
order stay develop's), accepts every value develop uses meaningfully, and
updates zero-size parameters as the no-ops they are.

Develop's ``paddle.optimizer.Muon`` makes none of these checks (a NaN rate
turns every parameter NaN after one step, a listed-twice parameter is updated
twice), so this module tests the package only.
"""

from __future__ import annotations

import os
import unittest
from unittest import mock

import numpy as np
import paddle
from paddle.utils import unique_name

from paddle_muon_ext.optimizer import Muon, MuonParamInfo

NAN, INF = float("nan"), float("inf")


def _param(name, shape, value=0.5):
    return paddle.create_parameter(
        shape, "float32", name=name,
        default_initializer=paddle.nn.initializer.Constant(value),
    )


def _params():
    with unique_name.guard():
        return [_param("chk.w", [4, 6]), _param("chk.b", [6])]


def _step(opt, params, consts):
    """One step on loss = sum(c * p) (gradient c), clear grads."""
    loss = sum((p * paddle.to_tensor(c)).sum() for p, c in zip(params, consts))
    loss.backward()
    opt.step()
    opt.clear_grad()


class TestRefusedArguments(unittest.TestCase):
    # (kwargs, exception, fragments the one-line message must contain)
    CASES = [
        (dict(learning_rate=NAN), ValueError, ["learning_rate=nan", ">= 0"]),
        (dict(learning_rate=INF), ValueError, ["learning_rate=inf", "finite"]),
        (dict(learning_rate=-0.1), ValueError, ["learning_rate=-0.1", ">= 0"]),
        (dict(learning_rate=True), TypeError, ["learning_rate=True", "LRScheduler"]),
        (dict(learning_rate="0.1"), TypeError, ["learning_rate='0.1'"]),
        # a Tensor rate must hold one number (Paddle would assert deep inside)
        (dict(learning_rate=paddle.to_tensor([0.1, 0.2])), TypeError,
         ["learning_rate=Tensor(shape=[2]", "not a number"]),
        (dict(momentum="0.9"), TypeError, ["momentum='0.9'", "not a number"]),
        (dict(momentum=NAN), ValueError, ["momentum", "[0, 1)"]),
        (dict(adam_beta2=-0.1), ValueError, ["adam_beta2", "[0, 1)"]),
        # develop's range is half-open: 1.0 is refused like -0.1
        (dict(momentum=1.0), ValueError, ["momentum", "[0, 1)", "1.0"]),
        (dict(adam_beta1=1.0), ValueError, ["adam_beta1", "[0, 1)", "1.0"]),
        (dict(adam_beta2=1.0), ValueError, ["adam_beta2", "[0, 1)", "1.0"]),
        (dict(adam_epsilon=NAN), ValueError, ["adam_epsilon=nan", ">= 0"]),
        (dict(adam_epsilon=INF), ValueError, ["adam_epsilon=inf", "finite"]),
        (dict(adam_epsilon=None), TypeError, ["adam_epsilon=None"]),
        (dict(adam_epsilon=-1e-9), ValueError, ["adam_epsilon", ">= 0"]),
        (dict(muon_epsilon=-1.0), ValueError, ["muon_epsilon=-1.0", ">= 0", "None"]),
        (dict(muon_epsilon=NAN), ValueError, ["muon_epsilon=nan"]),
        (dict(muon_epsilon="1e-7"), TypeError, ["muon_epsilon='1e-7'"]),
        # a bool is no epsilon, even a falsy one
        (dict(muon_epsilon=False), TypeError, ["muon_epsilon=False", "not a number"]),
        (dict(weight_decay=NAN), ValueError, ["weight_decay=nan", ">= 0"]),
        (dict(weight_decay=-5), ValueError, ["weight_decay=-5 is out of range", ">= 0"]),
        (dict(weight_decay=INF), ValueError, ["weight_decay=inf"]),
        (dict(weight_decay=True), TypeError, ["weight_decay=True"]),
        # develop's own check: a float, not a NumPy float32 or a Tensor
        (dict(weight_decay=np.float32(0.01)), TypeError, ["weight_decay must be a float",
                                                          "float32"]),
        (dict(muon_extra_scale_factor=NAN), ValueError, ["muon_extra_scale_factor=nan"]),
        (dict(muon_extra_scale_factor=-0.2), ValueError, ["muon_extra_scale_factor=-0.2"]),
        (dict(muon_extra_scale_factor=None), TypeError, ["muon_extra_scale_factor=None"]),
        (dict(ns_steps=True), TypeError, ["ns_steps=True", "int >= 0"]),
        (dict(ns_steps=2.0), ValueError, ["ns_steps", "int >= 0"]),
        (dict(ns_coeff_type="custom", ns_coeffs=[(1.0, 2.0)]), ValueError,
         ["ns_coeffs[0]=(1.0, 2.0)", "3 finite numbers"]),
        (dict(ns_coeff_type="custom", ns_coeffs=[(3.0, -4.0, 2.0), (1.0, NAN, 0.0)]),
         ValueError, ["ns_coeffs[1]=(1.0, nan, 0.0)", "finite"]),
        (dict(ns_coeff_type="custom", ns_coeffs=[(3.0, -4.0, INF)]), ValueError,
         ["ns_coeffs[0]", "finite"]),
        (dict(ns_coeff_type="custom", ns_coeffs=[]), ValueError, ["ns_coeffs=[]"]),
        (dict(ns_coeff_type="custom", ns_coeffs=[(3.0, -4.0, 2.0, 1.0)]), ValueError,
         ["ns_coeffs[0]=(3.0, -4.0, 2.0, 1.0)", "3 finite numbers"]),
        (dict(ns_coeff_type="custom", ns_coeffs=(3.0, -4.0, 2.0)), ValueError,
         ["ns_coeffs[0]=3.0"]),
        (dict(ns_coeff_type="custom", ns_coeffs="abc"), TypeError, ["ns_coeffs='abc'"]),
        # bytes are a sequence of ints, not a coefficient tuple
        (dict(ns_coeff_type="custom", ns_coeffs=[b"abc"]), ValueError,
         ["ns_coeffs[0]=b'abc'", "3 finite numbers"]),
        (dict(grad_clip=1.0), TypeError, ["grad_clip must be a paddle.nn.clip.GradientClipBase",
                                          "got float"]),
        (dict(muon_version="1"), TypeError, ["muon_version='1'"]),
        (dict(muon_version=True), TypeError, ["muon_version=True"]),
        (dict(muon_max_group_bytes=-5), ValueError, ["muon_max_group_bytes=-5", "no limit"]),
        (dict(muon_max_group_bytes=NAN), ValueError, ["muon_max_group_bytes=nan"]),
        (dict(muon_max_group_bytes=True), TypeError, ["muon_max_group_bytes=True"]),
        (dict(muon_exclude_patterns="embedding"), TypeError,
         ["muon_exclude_patterns='embedding'", "list"]),
        (dict(muon_param_info_map=[("chk.w", MuonParamInfo())]), TypeError,
         ["muon_param_info_map", "dict"]),
        (dict(apply_decay_param_fun=True), TypeError, ["apply_decay_param_fun=True"]),
        (dict(muon_param_info_map={"chk.w": MuonParamInfo(use_muon="no")}), TypeError,
         ["muon_param_info_map['chk.w'].use_muon='no' must be True or False"]),
        (dict(muon_param_info_map={"chk.w": MuonParamInfo(use_hyperball=1)}), TypeError,
         ["muon_param_info_map['chk.w'].use_hyperball=1"]),
        (dict(muon_param_info_map={"chk.w": MuonParamInfo(split_concat_func="qkv")}), TypeError,
         ["split_concat_func='qkv' must be a callable"]),
        (dict(nesterov="no"), TypeError, ["nesterov='no'", "True or False"]),
        (dict(multi_precision=2), TypeError, ["multi_precision=2"]),
        (dict(use_symmetric_gemm=0.0), TypeError, ["use_symmetric_gemm=0.0"]),
        (dict(name=3), TypeError, ["name=3"]),
    ]

    def test_each_bad_value_is_refused_in_one_line_naming_value_and_range(self):
        for kwargs, exc, fragments in self.CASES:
            with self.subTest(kwargs=kwargs):
                with self.assertRaises(exc) as ctx:
                    Muon(parameters=_params(), **{"muon_exclude_patterns": [], **kwargs})
                message = str(ctx.exception)
                self.assertNotIn("\n", message)
                for fragment in fragments:
                    self.assertIn(fragment, message)

    def test_set_lr_refuses_what_the_constructor_refuses_after_paddles_checks(self):
        opt = Muon(parameters=_params(), muon_exclude_patterns=[])
        for bad in (NAN, INF, -1.0, True):
            with self.subTest(bad=bad):
                with self.assertRaisesRegex((ValueError, TypeError), f"learning_rate={bad!r}"):
                    opt.set_lr(bad)
                self.assertEqual(opt.get_lr(), 0.02, "a refused rate was kept")
        opt.set_lr(0.5)
        self.assertEqual(opt.get_lr(), 0.5)
        with self.assertRaises(TypeError):  # Paddle's own check
            opt.set_lr("0.1")
        sched = Muon(learning_rate=paddle.optimizer.lr.StepDecay(0.1, 1), parameters=_params(),
                     muon_exclude_patterns=[])
        with self.assertRaises(RuntimeError):  # Paddle's: a scheduler is in use
            sched.set_lr(NAN)

    def test_a_parameter_listed_twice_is_refused_by_name(self):
        with unique_name.guard():
            w = _param("twice.w", [4, 4])
        with self.assertRaisesRegex(ValueError, r"'twice\.w' is listed more than once"):
            Muon(parameters=[w, w], muon_exclude_patterns=[])

    def test_a_trainable_non_float_parameter_is_refused_a_frozen_one_kept(self):
        with unique_name.guard():
            const = paddle.nn.initializer.Constant(1)
            ints = paddle.create_parameter([4, 4], "int32", name="ints.w",
                                           default_initializer=const)
            frozen = paddle.create_parameter([4], "int64", name="frozen.w",
                                             default_initializer=const)
        frozen.stop_gradient = True
        with self.assertRaisesRegex(TypeError, r"parameter 'ints\.w' has dtype paddle.int32 "
                                    "and is trainable"):
            Muon(parameters=[ints], muon_exclude_patterns=[])
        params = _params()
        opt = Muon(parameters=params + [frozen], muon_exclude_patterns=[])
        _step(opt, params, [np.ones([4, 6], "float32"), np.ones([6], "float32")])
        self.assertFalse(np.allclose(params[0].numpy(), 0.5), "the float matrix was not updated")

    def test_a_non_finite_rate_at_step_time_is_refused_before_any_update(self):
        class NanAfterOne(paddle.optimizer.lr.LRScheduler):
            def get_lr(self):
                return 0.1 if self.last_epoch < 1 else NAN

        params = _params()
        sched = NanAfterOne(learning_rate=0.1)
        opt = Muon(learning_rate=sched, parameters=params, muon_exclude_patterns=[])
        consts = [np.ones([4, 6], "float32"), np.ones([6], "float32")]
        _step(opt, params, consts)
        sched.step()
        before = [p.numpy().copy() for p in params]
        with self.assertRaisesRegex(ValueError, "the learning rate is nan at this step"):
            _step(opt, params, consts)
        for p, b in zip(params, before):
            np.testing.assert_array_equal(p.numpy(), b)

    def test_an_lr_ratio_returning_nan_or_negative_is_refused_naming_the_parameter(self):
        for bad in (NAN, -1.0, "x"):
            with self.subTest(bad=bad):
                params = _params()
                opt = Muon(parameters=params, muon_exclude_patterns=[],
                           lr_ratio=lambda p, bad=bad: bad)
                with self.assertRaisesRegex(ValueError, r"lr_ratio\('chk\.(w|b)'\) returned "
                                            + repr(bad).replace(".", r"\.")):
                    _step(opt, params, [np.ones([4, 6], "float32"), np.ones([6], "float32")])

    def test_a_non_tensor_parameter_is_refused(self):
        with self.assertRaisesRegex(TypeError, r"parameters\[1\] is a float"):
            Muon(parameters=[_params()[0], 1.0], muon_exclude_patterns=[])

    def test_develops_checks_come_first_with_develops_types(self):
        # develop asserts on the coefficient table before anything of ours
        with self.assertRaisesRegex(AssertionError, "valid types"):
            Muon(learning_rate=NAN, parameters=_params(), ns_coeff_type="cubic")
        with self.assertRaisesRegex(AssertionError, "needs ns_coeffs"):
            Muon(parameters=[_params()[0]] * 2, ns_coeff_type="custom")
        with self.assertRaisesRegex(TypeError, "parameter groups"):
            Muon(learning_rate=NAN, parameters=[{"params": _params()}])

    def test_symmetric_gemm_nan_threshold_is_refused_as_not_positive(self):
        with self.assertRaisesRegex(ValueError, "must be positive, got nan"):
            _symmetric_check(NAN)


def _symmetric_check(edge):
    # The capability check precedes the threshold check; pretend a 9.0 device.
    from unittest import mock

    from paddle_muon_ext.optimizer import muon as muon_module

    with mock.patch.object(muon_module, "_device_capability", lambda: (9, 0)):
        Muon._check_symmetric_gemm(paddle.bfloat16, edge, 2e11)


class TestAcceptedArguments(unittest.TestCase):
    def test_values_develop_uses_are_accepted_and_kept(self):
        sched = paddle.optimizer.lr.StepDecay(0.1, step_size=1)
        cases = [
            (dict(learning_rate=sched), lambda o: o.get_lr() == 0.1),
            (dict(learning_rate=1), lambda o: o.get_lr() == 1.0),
            (dict(learning_rate=0.0), lambda o: o.get_lr() == 0.0),
            (dict(momentum=np.float32(0.5)), lambda o: o._momentum == 0.5),
            (dict(momentum=paddle.to_tensor(0.5)), lambda o: o._momentum == 0.5),
            (dict(weight_decay=0), lambda o: o._weight_decay == 0.0),
            (dict(adam_epsilon=1e-30), lambda o: o._epsilon == 1e-30),
            (dict(muon_epsilon=None, adam_epsilon=1e-7), lambda o: o._muon_epsilon == 1e-7),
            (dict(muon_epsilon=1e-12), lambda o: o._muon_epsilon == 1e-12),
            (dict(ns_steps=0), lambda o: o._ns_steps == 0),
            (dict(ns_coeff_type="custom", ns_coeffs=[[3, -4, 2]]),
             lambda o: o._ns_coeffs == [[3, -4, 2]]),
            # develop ignores ns_coeffs unless the type is "custom"
            (dict(ns_coeff_type="aol", ns_coeffs="ignored"), lambda o: o._ns_coeff_type == "aol"),
            (dict(muon_version=3), lambda o: o._muon_version == 3),
            (dict(muon_max_group_bytes=None), lambda o: o._muon_max_group_bytes is None),
            (dict(muon_max_group_bytes=0), lambda o: o._muon_max_group_bytes == 0),
            (dict(muon_max_group_bytes=4e6), lambda o: o._muon_max_group_bytes == 4e6),
            (dict(muon_exclude_patterns=("emb",)), lambda o: o._muon_exclude_patterns == ("emb",)),
            (dict(nesterov=0), lambda o: o._nesterov is False),
            (dict(nesterov=np.bool_(True)), lambda o: o._nesterov is True),
            (dict(muon_extra_scale_factor=0.0), lambda o: o._muon_extra_scale_factor == 0.0),
            (dict(name="m"), lambda o: True),
        ]
        for kwargs, check in cases:
            with self.subTest(kwargs=kwargs):
                kwargs.setdefault("muon_exclude_patterns", [])
                opt = Muon(parameters=_params(), **kwargs)
                self.assertTrue(check(opt), kwargs)

    def test_zero_epsilons_are_accepted_as_in_develop_with_a_warning(self):
        # develop's own check is `adam_epsilon >= 0`: 0 must keep working
        for kwargs, attr in ((dict(adam_epsilon=0.0), "_epsilon"),
                             (dict(muon_epsilon=0.0), "_muon_epsilon")):
            with self.subTest(kwargs=kwargs):
                with self.assertLogs("paddle.optimizer.muon", level="WARNING") as logs:
                    opt = Muon(parameters=_params(), muon_exclude_patterns=[], **kwargs)
                self.assertEqual(getattr(opt, attr), 0.0)
                name = next(iter(kwargs))
                self.assertTrue(any(f"{name}=0" in line and "NaN" in line
                                    for line in logs.output), logs.output)


class TestZeroSizeParameters(unittest.TestCase):
    def _run(self, extra_shape, info=None):
        """Train [4, 6] and [6] with and without a zero-size neighbour."""
        rng = np.random.default_rng(0)
        consts = [rng.standard_normal(s).astype("float32") for s in ([4, 6], [6])]
        results = []
        for with_empty in (False, True):
            with unique_name.guard():
                params = [_param("z.w", [4, 6]), _param("z.b", [6])]
                if with_empty:
                    params.append(_param("z.empty", extra_shape))
            info_map = {"z.w": MuonParamInfo(True), "z.b": MuonParamInfo(False)}
            if with_empty:
                info_map["z.empty"] = info or MuonParamInfo(use_muon=len(extra_shape) in (2, 3))
            opt = Muon(learning_rate=0.1, parameters=params, muon_param_info_map=info_map,
                       ns_matmul_dtype="float32")
            cs = consts + ([np.zeros(extra_shape, "float32")] if with_empty else [])
            for _ in range(2):
                _step(opt, params, cs)
            if with_empty:
                self.assertEqual(list(params[2].shape), list(extra_shape))
                self.assertTrue(any(k.startswith("z.empty_moment1") for k in opt.state_dict()))
            results.append([p.numpy() for p in params[:2]])
        return results

    def test_zero_size_parameters_are_no_ops_and_the_rest_trains_as_without_them(self):
        cases = [([0, 4], None), ([4, 0], None), ([0, 2, 3], None), ([0], None),
                 ([0, 4], MuonParamInfo(use_muon=True, use_hyperball=True)),
                 ([0], MuonParamInfo(use_muon=False, use_hyperball=True))]
        for shape, info in cases:
            with self.subTest(shape=shape, info=info):
                without, with_empty = self._run(shape, info)
                for a, b in zip(without, with_empty):
                    np.testing.assert_array_equal(a, b)
                self.assertFalse(np.allclose(without[0], 0.5), "the [4, 6] matrix never moved")
                self.assertTrue(all(np.isfinite(a).all() for a in with_empty))



class TestEnvironment(unittest.TestCase):
    def test_bypass_flag_is_read_as_develop_reads_it_and_named_when_malformed(self):
        from paddle_muon_ext.optimizer import muon as muon_module

        name = "FLAGS_shard_bypass_dygraph_optimizer"
        for raw, expected in (("1", 1), ("0", 0), (" 2 ", 2)):
            with mock.patch.dict(os.environ, {name: raw}):
                self.assertEqual(muon_module._int_env(name, 0), expected)
        with mock.patch.dict(os.environ, {}, clear=True):
            self.assertEqual(muon_module._int_env(name, 0), 0)
        with mock.patch.dict(os.environ, {name: "yes"}):
            with self.assertRaisesRegex(ValueError, f"{name}='yes' is not an integer; set it "
                                        r"to 1 \(skip the optimizer update\) or 0"):
                muon_module._int_env(name, 0)


if __name__ == "__main__":
    unittest.main()
