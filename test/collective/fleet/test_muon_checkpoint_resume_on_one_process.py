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
"""A checkpoint of 2 gloo ranks resumes on one process as docs/USAGE.md shows.

On one process ``fleet.distributed_optimizer`` hands back the ``Muon``
itself; a fresh one has taken no step, so its ``sharded_state_dict`` must
still describe every state (creating them as its first step would), or the
checkpoint's optimizer states would be "loaded by no rank". After the load
every parameter, master weight and optimizer state equals the saved one
bit for bit (``muon_checkpoint_resume_worker.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "muon_checkpoint_resume_worker.py")
_REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))


class TestResumeOnOneProcess(unittest.TestCase):
    def test_a_two_rank_checkpoint_loads_into_a_fresh_single_process_muon(self):
        from launch_utils import run_paddle_launch

        tmp = tempfile.mkdtemp(prefix="muon_ckpt_resume_1p_")
        self.addCleanup(shutil.rmtree, tmp, True)
        ckpt, npz, out = (os.path.join(tmp, n) for n in ("ckpt", "saved.npz", "out.json"))
        env = {"PYTHONPATH": os.pathsep.join([
            os.path.join(_REPO, "python"), HERE, os.path.join(_REPO, "test"),
            os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        saved = run_paddle_launch(WORKER, 2, env, timeout_s=150,
                                  args=["save", ckpt, npz]).check()
        self.assertEqual(saved.workers_printing("type=MuonShardingOptimizer"), [0, 1])
        one = {k: v for k, v in os.environ.items()
               if not k.startswith(("PADDLE_", "FLAGS_START_PORT", "POD_"))}
        one.update(env)
        done = subprocess.run([sys.executable, WORKER, "resume", ckpt, npz, out], env=one,
                              capture_output=True, text=True, timeout=120)
        self.assertEqual(done.returncode, 0, done.stderr[-3000:])
        with open(out) as f:
            result = json.load(f)
        self.assertEqual(result["optimizer"], "Muon", "fleet hands back the Muon itself")
        self.assertIsNone(result["error"])
        self.assertEqual(result["nan_keys"], [], "the saved pieces did not cover a tensor")
        self.assertEqual(sorted(result["diff"]), result["saved_keys"])
        # optimizer states too: moments, beta pows, master weights
        for suffix in (".moment1_0", ".moment2_0", ".beta1_pow_acc_0", ".w_0"):
            self.assertTrue(any(k.endswith(suffix) for k in result["diff"]), suffix)
        for key, diff in sorted(result["diff"].items()):
            self.assertEqual(diff, 0.0, f"{key}: loaded value differs from the saved one")
        # a saved state that differs from a fresh one: the load wrote it
        with np.load(npz) as data:
            self.assertTrue(np.abs(data["mlp.weight.moment1_0"]).max() > 0)


if __name__ == "__main__":
    unittest.main()
