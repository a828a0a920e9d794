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
"""The gloo layer's stream all_reduce / reduce turn AVG into SUM of the input
divided by the group size (gloo has no AVG), in process with a fake
collective that sums four equal ranks."""

from __future__ import annotations

import unittest
from unittest import mock

import numpy as np
import paddle
import paddle.distributed as dist

from paddle_muon_ext.distributed.fleet.utils import gloo_compat_ops as ops


class TestStreamAvgOnGloo(unittest.TestCase):
    def _run(self, op, gloo):
        seen = {}

        def four_equal_ranks(tensor, op=dist.ReduceOp.SUM, group=None, sync_op=True,
                             use_calc_stream=False):
            seen.update(op=op, sync_op=sync_op, use_calc_stream=use_calc_stream)
            if op == dist.ReduceOp.SUM:
                tensor.scale_(4.0)  # what a SUM over four ranks holding it gives
            return "task"

        class Group:
            nranks = 4

        t = paddle.to_tensor(np.array([2.0, -6.0, 10.0], dtype="float32"))
        with mock.patch.object(ops, "is_gloo_group", return_value=gloo):
            task = ops.stream_avg_prescale(four_equal_ranks)(
                t, op=op, group=Group(), sync_op=False, use_calc_stream=True)
        self.assertEqual(task, "task")
        return t.numpy(), seen

    def test_avg_on_a_gloo_group_is_the_mean_through_a_sum(self):
        got, seen = self._run(dist.ReduceOp.AVG, gloo=True)
        np.testing.assert_allclose(got, [2.0, -6.0, 10.0], rtol=0, atol=1e-6,
                                   err_msg="the mean of four equal ranks is the input")
        self.assertEqual(seen, {"op": dist.ReduceOp.SUM, "sync_op": True,
                                "use_calc_stream": False})

    def test_sum_on_gloo_and_any_op_elsewhere_pass_through(self):
        got, seen = self._run(dist.ReduceOp.SUM, gloo=True)
        np.testing.assert_allclose(got, [8.0, -24.0, 40.0], rtol=0, atol=1e-6)
        self.assertEqual(seen["op"], dist.ReduceOp.SUM)
        got, seen = self._run(dist.ReduceOp.AVG, gloo=False)
        np.testing.assert_allclose(got, [2.0, -6.0, 10.0], rtol=0, atol=1e-6)
        self.assertEqual(seen, {"op": dist.ReduceOp.AVG, "sync_op": False,
                                "use_calc_stream": True}, "a non-gloo group was rewritten")


if __name__ == "__main__":
    unittest.main()
