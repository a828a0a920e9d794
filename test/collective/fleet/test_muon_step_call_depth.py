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
# paddle_muon_ext: compat-only  (measures this package's own call depth; not exported)
"""A step reaches its collectives through few package modules and frames, and
the optimizer instance holds only what it owns (the runtime holds the rest).

Measured while an 8-rank comm_group_call_opt world trains one step through
fleet's optimizer (simulated world, record mode): the package's frames on the
stack when each collective is issued.
"""

from __future__ import annotations

import inspect
import os
import statistics
import unittest
from unittest import mock

from mock import fake_comm
from muon_sim_runner import SimConfig, build_rank, run_world, train_steps
from muon_test_compat import sharded_core

_PACKAGE_DIR = os.sep + "paddle_muon_ext" + os.sep


class TestStepCallDepth(unittest.TestCase):
    def test_collectives_are_few_modules_deep_and_the_instance_is_small(self):
        stacks, attributes = [], []
        issue = fake_comm.FakeComm._issue

        def recording_issue(self, *args, **kwargs):
            frames = [f for f in inspect.stack(0)[1:] if _PACKAGE_DIR in f.filename]
            stacks.append((len({f.filename for f in frames}), len(frames)))
            return issue(self, *args, **kwargs)

        def body(cfg, strategy):
            hcg, net, opt, _ = build_rank(cfg, strategy)
            attributes.append(sorted(vars(sharded_core(opt))))
            train_steps(cfg, hcg, net, opt)

        cfg = SimConfig(ep=4, ms=2, gpn=4, steps=1)
        with mock.patch.object(fake_comm.FakeComm, "_issue", recording_issue):
            run_world(cfg, body, mode="record")
        self.assertGreater(len(stacks), 100, "the world issued the step's collectives")
        self.assertLessEqual(statistics.median(m for m, _ in stacks), 3,
                             "package modules on the stack at a collective (median)")
        self.assertLessEqual(statistics.median(f for _, f in stacks), 6,
                             "package frames on the stack at a collective (median)")
        self.assertLessEqual(max(f for _, f in stacks), 8, "the deepest collective")
        for attrs in attributes:
            self.assertLessEqual(len(attrs), 10, f"optimizer instance attributes: {attrs}")


if __name__ == "__main__":
    unittest.main()
