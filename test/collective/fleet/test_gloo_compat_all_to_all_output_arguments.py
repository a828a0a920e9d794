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
"""The all-to-all emulation refuses a bad *output* argument of one rank on
every rank, naming it, as it does a bad input (2 simulated ranks)."""

from __future__ import annotations

import unittest

import paddle
from test_gloo_compat import _ThreadWorld

import gloo_compat as gc


class TestBadOutputArguments(unittest.TestCase):
    def test_one_ranks_bad_output_is_refused_on_every_rank(self):
        cases = {
            "output list length": (lambda r, g: gc._emulated_all_to_all_list(
                [paddle.ones([1])] * (3 if r == 1 else 2), [paddle.ones([1])] * 2, g),
                "2 input and 3 output tensors for a group of 2"),
            "output split sum": (lambda r, g: gc._emulated_all_to_all_single(
                paddle.ones([4]), paddle.ones([4]), [1, 2] if r == 1 else None, None, g),
                r"out_tensor split sizes \[1, 2\] must be 2 non-negative numbers summing to "
                r"its 4"),
            "output indivisible": (lambda r, g: gc._emulated_all_to_all_single(
                paddle.ones([3 if r == 1 else 4]), paddle.ones([4]), None, None, g),
                "out_tensor has 3 rows, not divisible by the group size 2"),
        }
        for case, (fn, message) in cases.items():
            with self.subTest(case=case):
                _, errors = _ThreadWorld(2).run(fn)
                self.assertEqual(sorted(errors), [0, 1], errors)
                self.assertRegex(errors[1], message)
                self.assertIn("group rank(s) [1] refused their own arguments", errors[0])


if __name__ == "__main__":
    unittest.main()
