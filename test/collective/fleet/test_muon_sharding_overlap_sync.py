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
"""Launcher: overlap_optimize_and_sync on vs off on real collectives (gloo on CPU).

2 processes (sharding_degree=2) run ``hybrid_parallel_sharding_muon_overlap_sync_model.py``,
which trains with the overlapped stage sync and with update-then-sync and
requires bit-identical parameters on every rank. The 8-process variant
(ep=4, moe_sharding=2) runs when ``MUON_GLOO_8=1`` (about a minute on a
2-core machine; the simulated world covers 8 ranks in CI).
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
WORKER = os.path.join(_HERE, "hybrid_parallel_sharding_muon_overlap_sync_model.py")
_OK_RE = re.compile(r"MUON_OVERLAP_SYNC_OK rank=(\d+) overlap=(\d) stages=(\d+)")


def _staged_api_available() -> bool:
    from muon_tiny_moe import _param, make_muon

    import numpy as np

    muon = make_muon([_param("probe.w", np.zeros((2, 2), "float32"))])
    return callable(getattr(muon, "update_params", None))


class TestMuonShardingOverlapSync(unittest.TestCase):
    def _run(self, nproc: int, env: dict, timeout_s: float) -> None:
        full_env = {"PYTHONPATH": os.pathsep.join(
            [os.path.join(_REPO, "python"), _HERE, os.environ.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep), **env}
        result = run_paddle_launch(WORKER, nproc, full_env, timeout_s=timeout_s)
        result.check()
        want_overlap = "1" if _staged_api_available() else "0"
        for rank in range(nproc):
            log = result.worker_logs.get(rank, "")
            self.assertNotIn("MUON_CHECK_FAILED", log, f"rank {rank}:\n{log[-2000:]}")
            found = [m for m in _OK_RE.finditer(log) if int(m.group(1)) == rank]
            self.assertTrue(found, f"rank {rank} printed no MUON_OVERLAP_SYNC_OK:\n"
                                   f"{result.failure_message()}")
            self.assertEqual(found[-1].group(2), want_overlap,
                             f"rank {rank}: overlap_optimize_and_sync should be "
                             f"{want_overlap} by default with this Muon")
            if want_overlap == "1":
                self.assertGreater(int(found[-1].group(3)), 0, "the stages were built")
        print(f"\n[overlap sync {nproc} procs] wall {result.wall_s:.1f}s")

    def test_two_processes_bit_identical(self):
        self._run(2, {"MUON_STEPS": "3"}, timeout_s=180)

    @unittest.skipUnless(os.environ.get("MUON_GLOO_8") == "1",
                         "8-process gloo run: set MUON_GLOO_8=1")
    def test_eight_processes_bit_identical(self):
        self._run(8, {"MUON_EP": "4", "MUON_MS": "2", "MUON_STEPS": "2"}, timeout_s=400)


if __name__ == "__main__":
    unittest.main()
