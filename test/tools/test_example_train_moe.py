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
"""examples/train_moe.py and the MoE fragment of docs/USAGE.md.

The example must train on 4 CPU (gloo) processes, 2 emulated nodes of 2
cards (ep 2 x moe_sharding 2), with nothing but ``patch_paddle()``, and pass
its own check against a single-process run with ``comm_group_call_opt`` off
(resumed from a checkpoint, every expert saved once) and on (resumed too,
each package notice once in the job's logs); a dispatch
without the documented 1/ep expert gradient scale must fail that check by
the documented amount; and the docs' MoE fragment must be
lines of the example, so that CI runs it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import unittest

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_REPO, "test", "collective", "fleet"))

from launch_utils import run_paddle_launch  # noqa: E402

EXAMPLE = os.path.join(_REPO, "examples", "train_moe.py")
USAGE = os.path.join(_REPO, "docs", "USAGE.md")
TOLERANCE = 1e-5  # the example's float32 tolerance (CPU)
VERDICT = re.compile(r"^(PASS|FAIL): rank (\d) of 4 \(MuonHybridParallelOptimizer\), 3 steps, "
                     r"max \|parameter - single-process\| = (\S+) \(tolerance 1e-05\)$", re.M)


def readme_moe_fragment(index: int = 0) -> str:
    """Python block ``index`` of docs/USAGE.md's "A MoE model" section (0: the
    model, 1: its checkpoint)."""
    with open(USAGE, encoding="utf-8") as f:
        text = f.read()
    section = text.split("\n## A MoE model\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n")[1 + index].split("```", 1)[0]


class TestTrainMoeExample(unittest.TestCase):
    def _launch(self, *args: str, log_dir: str | None = None) -> tuple:
        # A user's environment plus the emulated nodes: 2 cards per node.
        env = {"CUDA_VISIBLE_DEVICES": "", "GLOO_COMPAT": "", "GLOO_COMPAT_LOCAL_SIZE": "2"}
        result = run_paddle_launch(EXAMPLE, 4, env=env, timeout_s=240, args=args,
                                   log_dir=log_dir)
        print(f"train_moe on 4 processes {list(args)}: {result.wall_s:.1f}s")
        log = result.worker_logs.get(0, "")
        verdicts = {int(r): (word, float(d)) for word, r, d in VERDICT.findall(log)}
        self.assertEqual(sorted(verdicts), [0, 1, 2, 3],
                         "rank 0 did not print every rank's verdict\n" + result.failure_message())
        self.assertIn("ep 2 x moe_sharding 2", log)
        return result, verdicts

    def _assert_all_pass(self, result, verdicts) -> None:
        result.check()
        for rank, (word, diff) in verdicts.items():
            self.assertEqual(word, "PASS", f"rank {rank}\n" + result.failure_message())
            self.assertLessEqual(diff, TOLERANCE)

    def test_four_processes_pass_the_self_check_flat_resumed_from_a_checkpoint(self):
        # The flat run stops after 2 of its 3 steps, saves, rebuilds model and
        # optimizer, loads and takes step 3: the single-process check then
        # covers the resumed run (a load that dropped the optimizer states
        # ends 3.5e-2 away, measured).
        with tempfile.TemporaryDirectory(prefix="train_moe_ckpt_") as ckpt:
            result, verdicts = self._launch("--checkpoint", ckpt)
            with open(os.path.join(ckpt, "checkpoint_2", "checkpoint.complete.json")) as f:
                tensors = json.load(f)["tensors"]
        self._assert_all_pass(result, verdicts)
        log = result.worker_logs[0]
        self.assertNotIn("comm_group_call_opt on", log)
        self.assertIn("checkpoint: saved after step 2 as ", log)
        self.assertIn("loaded into a new model and optimizer, 1 more step(s)", log)
        self._assert_notices_once_per_job(result, {
            "paddle_muon_ext.patch_paddle: added": 1,
            "checkpoint: rank 0 saved " + os.path.join(ckpt, "checkpoint_2"): 1,
            "checkpoint: rank 1 saved": 0,
        })
        # every expert once: the 4 experts' global shapes, not one EP rank's 2
        self.assertEqual(tensors["experts.up_weight"]["global_shape"], [4, 16, 32])
        self.assertEqual(tensors["experts.down_weight.moment1_0"]["global_shape"], [4, 32, 16])
        self.assertEqual(tensors["experts.bias"]["global_shape"], [4, 16])

    def test_checkpoint_flags_refused_before_any_work(self):
        cases = {("--resume-at", "2"): "--resume-at needs --checkpoint DIR",
                 ("--checkpoint", "unused", "--resume-at", "3"):
                     "--resume-at 3 must be between 1 and --steps - 1 (2)",
                 ("--checkpoint", "unused", "--steps", "1"): "--checkpoint needs --steps >= 2"}
        for args, message in cases.items():
            with self.subTest(args=args), tempfile.TemporaryDirectory() as cwd:
                proc = subprocess.run([sys.executable, EXAMPLE, *args], cwd=cwd,
                                      capture_output=True, text=True, timeout=120,
                                      env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
                self.assertEqual(proc.returncode, 2, proc.stderr)
                self.assertIn(message, proc.stderr.strip().splitlines()[-1])
                self.assertEqual(os.listdir(cwd), [], "an argument error wrote files")

    def test_four_processes_pass_the_self_check_with_comm_group_call_opt_resumed(self):
        # Resumed too: the optimizer is built twice on each of the 4 ranks,
        # and the package's notices still appear once in the job's logs.
        with tempfile.TemporaryDirectory(prefix="train_moe_ckpt_") as ckpt:
            result, verdicts = self._launch("--group-call", "--checkpoint", ckpt)
        self._assert_all_pass(result, verdicts)
        log = result.worker_logs[0]
        self.assertIn("checkpoint: saved after step 2 as ", log)
        self.assertIn("MuonShardingOptimizer: comm_group_call_opt on", log)
        self.assertIn("2 nodes x 2 cards", log, "the emulated nodes did not reach the optimizer")
        self._assert_notices_once_per_job(result, {
            "overlap_optimize_and_sync disabled under comm_group_call_opt": 1,
            "MuonShardingOptimizer: comm_group_call_opt on": 1,
            "paddle_muon_ext.patch_paddle: added": 1,
            "saved " + os.path.join(ckpt, "checkpoint_2"): 1,
        })

    def _assert_notices_once_per_job(self, result, expected: dict) -> None:
        """Each notice's line count over every rank's log (default log level)."""
        logs = [result.worker_logs.get(rank, "") for rank in range(4)]
        self.assertEqual(len([text for text in logs if text]), 4, "a worker log is missing")
        counts = {notice: sum(line.count(notice) for text in logs for line in
                              text.splitlines()) for notice in expected}
        self.assertEqual(counts, expected)

    def test_a_dispatch_without_the_expert_scale_fails_by_the_documented_amount(self):
        # The gradient contract (docs/USAGE.md): without 1/ep the experts'
        # gradients are ep x too large; with the global-norm clip active that moves parameters
        # by ~2.4e-4 in 3 steps (documented as >= 1e-4), far above 1e-5.
        # a failed launch keeps its own log dir for debugging: this one fails
        # on purpose, so it logs into a directory the test removes
        with tempfile.TemporaryDirectory(prefix="train_moe_wrong_scale_") as log_dir:
            result, verdicts = self._launch("--wrong-expert-scale", log_dir=log_dir)
        self.assertFalse(result.ok, "a wrong expert scale exited 0\n" + result.failure_message())
        self.assertIn("expert gradient scale 1,", result.worker_logs[0])
        for rank, (word, diff) in verdicts.items():
            self.assertEqual(word, "FAIL", f"rank {rank}")
            self.assertGreaterEqual(diff, 1e-4, f"rank {rank}")

    def test_the_documented_moe_fragments_are_lines_of_the_example(self):
        # The fragments (the model, its checkpoint) are run by the launches
        # above only if every line is the example's (comments and blank lines aside).
        with open(EXAMPLE, encoding="utf-8") as f:
            example = {line.strip().split("  #", 1)[0].rstrip() for line in f}
        for index, least in ((0, 10), (1, 8)):
            with self.subTest(fragment=index):
                fragment = [line.strip() for line in readme_moe_fragment(index).splitlines()]
                code = [line for line in fragment if line and not line.startswith("#")]
                self.assertGreater(len(code), least)
                missing = [line for line in code
                           if line.split("  #", 1)[0].rstrip() not in example]
                self.assertEqual(missing, [], "docs/USAGE.md MoE fragment lines not in "
                                 "examples/train_moe.py")
        self.assertIn("for name, p in net.named_parameters()", readme_moe_fragment(0))
        self.assertIn("paddle_muon_ext.expert_sharded_state_dict(", readme_moe_fragment(1))
        self.assertIn("latest_complete_checkpoint_and_id(", readme_moe_fragment(1))


if __name__ == "__main__":
    unittest.main()
