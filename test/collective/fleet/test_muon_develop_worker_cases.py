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
"""Launcher: develop's mixed-dtype, no-hook and overlap-sync expectations on
2 gloo processes (``muon_develop_cases_worker.py``).

CI runs the overlap-sync case on 6 of develop's 18 Linears (still three
shapes, so three Muon group keys) for 2 steps; ``MUON_DEVELOP_FULL=1`` runs
develop's sizes (18 Linears, 5 steps; about a minute on a 2-core machine).
"""

from __future__ import annotations

import os
import re
import sys
import unittest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from launch_utils import run_paddle_launch  # noqa: E402

_REPO = os.path.abspath(os.path.join(_HERE, "..", "..", ".."))
WORKER = os.path.join(_HERE, "muon_develop_cases_worker.py")
_OK_RE = re.compile(r"MUON_DEVELOP_CASE_OK rank=(\d+) case=(\w+) (.*)")


class TestDevelopWorkerExpectations(unittest.TestCase):
    def test_mixed_dtype_no_hook_and_overlap_sync_on_two_gloo_ranks(self):
        full = os.environ.get("MUON_DEVELOP_FULL") == "1"
        env = {"PYTHONPATH": os.pathsep.join(
            [os.path.join(_REPO, "python"), _HERE, os.environ.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep),
            "MUON_DEVELOP_OVERLAP_BLOCKS": "6" if full else "2",
            "MUON_DEVELOP_OVERLAP_STEPS": "5" if full else "2"}
        result = run_paddle_launch(WORKER, 2, env, timeout_s=400 if full else 240)
        result.check()
        for rank in range(2):
            log = result.worker_logs.get(rank, "")
            self.assertNotIn("MUON_CHECK_FAILED", log, f"rank {rank}:\n{log[-3000:]}")
            facts = {m.group(2): m.group(3) for m in _OK_RE.finditer(log)
                     if int(m.group(1)) == rank}
            self.assertEqual(sorted(facts), ["mixed_dtype", "no_hook", "overlap_sync"],
                             f"rank {rank}:\n{result.failure_message()}")
            # develop's T-MD expectation: bf16 on both ranks, fp32 on rank 0 only
            self.assertIn("bf16_owners=[0, 1] fp32_owners=[0] fp32_buffers=1",
                          facts["mixed_dtype"])
            self.assertIn("linears=%d steps=%d" % ((18, 5) if full else (6, 2)),
                          facts["overlap_sync"])
        print(f"\n[develop worker cases] wall {result.wall_s:.1f}s")


if __name__ == "__main__":
    unittest.main()
