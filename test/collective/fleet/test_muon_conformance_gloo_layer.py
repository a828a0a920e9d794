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
"""The gloo layer's reduce keeps a non-root buffer's input, as NCCL does.

``ncclReduce`` writes ``recvbuff`` only on the root (in place, a non-root
buffer keeps its input); native gloo leaves partial sums there. In process,
with a fake reduce that scribbles over its buffer.
"""

from __future__ import annotations

import unittest
from unittest import mock

import numpy as np
import paddle
import paddle.distributed as dist

from paddle_muon_ext.distributed.fleet.utils import gloo_compat_ops as ops


class TestGlooReduceKeepsNonRootInput(unittest.TestCase):
    """gloo_compat's reduce wrapper, in process (a fake reduce that scribbles)."""

    def _wrapped(self, log):
        class Task:
            def wait(self):
                log.append("wait")

        def scribbling_reduce(tensor, dst=0, op=dist.ReduceOp.SUM, group=None, sync_op=True,
                              use_calc_stream=False):
            log.append("reduce")
            paddle.assign(paddle.full(tensor.shape, 7.0, tensor.dtype), tensor)
            return Task()

        return ops.nonroot_keeps_input(scribbling_reduce)

    def test_a_non_root_buffer_keeps_its_input(self):
        for sync_op, calls in ((False, ["reduce", "wait"]), (True, ["reduce"])):
            log = []
            t = paddle.full([4], 2.0)
            with mock.patch.object(ops, "is_gloo_group", return_value=True), \
                    mock.patch.object(dist, "get_rank", return_value=1):
                self._wrapped(log)(t, dst=0, sync_op=sync_op)
            np.testing.assert_array_equal(t.numpy(), 2.0, err_msg=f"sync_op={sync_op}")
            # an async reduce is waited for before the input is put back
            self.assertEqual(log, calls)

    def test_the_root_and_non_gloo_groups_get_the_reduce_unchanged(self):
        for gloo, rank in ((True, 0), (False, 1)):
            log = []
            t = paddle.full([4], 2.0)
            with mock.patch.object(ops, "is_gloo_group", return_value=gloo), \
                    mock.patch.object(dist, "get_rank", return_value=rank):
                self._wrapped(log)(t, dst=0)
            np.testing.assert_array_equal(t.numpy(), 7.0, err_msg=f"gloo={gloo} rank={rank}")
            self.assertEqual(log, ["reduce"])


if __name__ == "__main__":
    unittest.main()
