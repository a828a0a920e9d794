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
# paddle_muon_ext: test-timeout=300
"""The checkpoint fault matrix on 2 real gloo ranks (one launch).

Faults: an injected ENOSPC on one rank and the previous checkpoint reloaded
resharded afterwards (no test-side patch of Paddle), a real full disk (a 256
KiB tmpfs, where root may mount one), a rank finding no checkpoint, ranks
saving into different paths, other dtypes, a symlink to another id, a
different model into the same directory, a truncated and a grown shard,
flipped bytes in a shard and in the metadata, a rank killed mid-save. Each fault must leave the previous checkpoint byte-for-byte intact and
loadable bit-exact, commit nothing partial, and raise the same error on
every rank naming the file - never hang (a killed rank is noticed within the
heartbeat timeout). See ``muon_checkpoint_fault_worker.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "muon_checkpoint_fault_worker.py")
_REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
#: Seconds between the heartbeat timeout and rank 0's error at most: the
#: coordinator polls every 50 ms; the rest is slack for a loaded machine.
KILL_SLACK_S = 10.0
#: An agreed failure takes milliseconds; a waited-out one gloo's 30 s.
AT_ONCE_S = 10.0


class TestCheckpointFaultMatrix(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from launch_utils import run_paddle_launch

        cls.tmp = tempfile.mkdtemp(prefix="muon_ckpt_faults_")
        cls.disk = os.path.join(cls.tmp, "small_disk")
        os.makedirs(cls.disk)
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs",
                                  cls.disk], capture_output=True, text=True)
        cls.mount_error = mounted.stderr.strip() if mounted.returncode else None
        env = {"PYTHONPATH": os.pathsep.join([
            os.path.join(_REPO, "python"), HERE, os.path.join(_REPO, "test"),
            os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        cls.result = run_paddle_launch(WORKER, 2, env, timeout_s=240,
                                       args=[os.path.join(cls.tmp, "ckpt"),
                                             "" if cls.mount_error else cls.disk])
        cls.outcomes: dict[str, dict[int, dict]] = {}
        for rank, log in cls.result.worker_logs.items():
            for line in log.splitlines():
                if line.startswith("FAULT "):
                    data = json.loads(line[len("FAULT "):])
                    cls.outcomes.setdefault(data["fault"], {})[data["rank"]] = data

    @classmethod
    def tearDownClass(cls):
        if cls.mount_error is None:
            subprocess.run(["umount", cls.disk], capture_output=True)
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def outcome(self, fault: str, ranks=(0, 1)) -> dict[int, dict]:
        got = self.outcomes.get(fault, {})
        if sorted(got) != sorted(ranks):
            self.fail(f"{fault}: outcomes from ranks {sorted(got)}, expected {list(ranks)}\n"
                      + self.result.failure_message())
        return got

    def assert_previous_intact(self, fault: str, per_rank: dict) -> None:
        for rank, data in per_rank.items():
            self.assertTrue(data["same_bytes"],
                            f"{fault}: rank {rank}: checkpoint_0's files changed")
            if "bit_exact" in data:
                self.assertTrue(data["bit_exact"],
                                f"{fault}: rank {rank}: checkpoint_0 no longer loads bit-exact")

    def assert_same_error(self, fault: str, per_rank: dict, error: str, names: str) -> None:
        for rank, data in per_rank.items():
            self.assertEqual(data["error"], error, f"{fault}: rank {rank} raised "
                             f"{data['error']}: {data['message']}")
            self.assertIn(names, data["message"],
                          f"{fault}: rank {rank}'s error does not name {names}")
        messages = {data["message"] for data in per_rank.values()}
        self.assertEqual(len(messages), 1, f"{fault}: the ranks report different errors: "
                                           f"{messages}")

    def test_full_disk_on_one_rank(self):
        per_rank = self.outcome("enospc")
        self.assert_same_error("enospc", per_rank, "CheckpointSaveError", "1_1.distcp")
        self.assertIn("No space left on device", per_rank[0]["message"])
        self.assert_previous_intact("enospc", per_rank)
        listing = per_rank[0]["listing"]
        self.assertEqual([n for n in listing if not n.startswith(".")], ["checkpoint_0"],
                         "a failed save must commit nothing")
        self.assertEqual(per_rank[0]["left"], [], "a failed save must free its shards")
        self.assertEqual(per_rank[0]["latest"], "checkpoint_0")

    def test_previous_checkpoint_reloads_resharded_after_a_failed_save(self):
        # each rank needs the other's shard: Paddle's resharding, which calls
        # Tensor.cuda(); the worker patches nothing, like a user's script
        per_rank = self.outcome("reload_resharded")
        for rank, data in per_rank.items():
            self.assertIsNone(data["error"], f"rank {rank}: {data['message']}")
            self.assertTrue(data["bit_exact"], f"rank {rank}: the other rank's rows differ")
            self.assertTrue(data["cuda_restored"], f"rank {rank}: Tensor.cuda left replaced")

    def test_a_rank_finding_no_checkpoint_fails_every_rank_at_once(self):
        per_rank = self.outcome("missing_on_one_rank")
        self.assert_same_error("missing_on_one_rank", per_rank, "FileNotFoundError",
                               f"rank 1: no checkpoint at {per_rank[1]['path']}")
        for rank, data in per_rank.items():
            self.assertLess(data["seconds"], AT_ONCE_S, f"rank {rank} waited for a timeout")

    def test_ranks_saving_into_different_paths_are_refused_naming_both(self):
        per_rank = self.outcome("different_save_paths")
        self.assert_same_error("different_save_paths", per_rank, "CheckpointSaveError",
                               f"created under path {per_rank[0]['path']!r}; rank 1 passed "
                               f"path {per_rank[1]['path']!r}")
        for rank, data in per_rank.items():
            self.assertNotIn("killed or hung", data["message"])
            self.assertLess(data["seconds"], AT_ONCE_S, f"rank {rank} waited for a timeout")
            self.assertTrue(data["root_unchanged"], "a refused save left something")
            self.assertFalse(data["elsewhere_created"], "rank 1 made a save directory")

    def test_other_dtypes_are_refused_naming_key_and_dtypes(self):
        for dtype in ("float64", "float16"):
            per_rank = self.outcome(f"{dtype}_target")
            self.assert_same_error(f"{dtype}_target", per_rank, "CheckpointMismatchError",
                                   f"w: checkpoint dtype float32, here {dtype}")
            for rank in (0, 1):
                self.assertIn(f"rank {rank}: b: checkpoint dtype float32, here {dtype}",
                              per_rank[0]["message"])

    def test_a_symlink_to_another_id_is_refused(self):
        per_rank = self.outcome("symlink_to_another_id")
        self.assert_same_error("symlink_to_another_id", per_rank, "CheckpointCorruptError",
                               f"{per_rank[0]['link']}: holds checkpoint 0 (its marker's "
                               "unique_id), not 99 (a symlink to")

    def test_grown_shard(self):
        per_rank = self.outcome("grown_shard")
        self.assert_same_error("grown_shard", per_rank, "CheckpointCorruptError",
                               f"{per_rank[0]['file']} (written by rank 0)")
        self.assertIn("(grown", per_rank[0]["message"])
        self.assert_previous_intact("grown_shard", per_rank)

    def test_other_model_into_the_same_directory(self):
        per_rank = self.outcome("other_model")
        for rank, data in per_rank.items():
            # id 1 was claimed by the failed save: the next automatic id is 2
            self.assertEqual(data["saved"], "checkpoint_2", f"rank {rank}")
            self.assertTrue(data["b_exact"], f"rank {rank}: model B does not load back")
            self.assertEqual(data["listing"], ["checkpoint_0", "checkpoint_2"],
                             "the next commit sweeps what the failed save left")
        self.assert_same_error("other_model", per_rank, "CheckpointMismatchError",
                               "not in the checkpoint: b")
        self.assert_previous_intact("other_model", per_rank)

    def test_truncated_shard(self):
        per_rank = self.outcome("truncated_shard")
        name = per_rank[0]["file"]
        self.assert_same_error("truncated_shard", per_rank, "CheckpointCorruptError",
                               f"{name} (written by rank 1)")
        self.assertIn("truncated", per_rank[0]["message"])
        self.assert_previous_intact("truncated_shard", per_rank)

    def test_flipped_byte_in_a_shard(self):
        per_rank = self.outcome("flipped_shard_byte")
        self.assert_same_error("flipped_shard_byte", per_rank, "CheckpointCorruptError",
                               per_rank[0]["file"])
        self.assertIn("SHA-256", per_rank[0]["message"])
        self.assert_previous_intact("flipped_shard_byte", per_rank)

    def test_flipped_byte_in_the_metadata(self):
        per_rank = self.outcome("flipped_metadata_byte")
        self.assert_same_error("flipped_metadata_byte", per_rank, "CheckpointCorruptError",
                               per_rank[0]["file"])
        self.assert_previous_intact("flipped_metadata_byte", per_rank)

    def test_real_full_disk(self):
        if self.mount_error is not None:
            self.skipTest(f"cannot mount a small tmpfs here: {self.mount_error}")
        per_rank = self.outcome("real_full_disk")
        self.assert_same_error("real_full_disk", per_rank, "CheckpointSaveError",
                               "No space left on device")
        self.assertRegex(per_rank[0]["message"], r"rank \d could not write \S+",
                         "the error must name the rank and the file")
        self.assert_previous_intact("real_full_disk", per_rank)
        self.assertEqual(per_rank[0]["left"], [], "a failed save must free its shards")

    def test_previous_checkpoint_reloads_while_the_disk_stays_full(self):
        if self.mount_error is not None:
            self.skipTest(f"cannot mount a small tmpfs here: {self.mount_error}")
        per_rank = self.outcome("reload_on_full_disk")
        for rank in (0, 1):
            self.assertIsNone(per_rank[rank]["error"], per_rank[rank]["message"])
            self.assertTrue(per_rank[rank]["bit_exact"], f"rank {rank} loaded other values")
            self.assertLess(per_rank[rank]["seconds"], 10, "no rank may wait for a heartbeat")
        self.assertEqual(per_rank[0]["left"], [], "the load's guard files must be removed")

    def test_rank_killed_mid_save(self):
        data = self.outcome("killed_rank", ranks=(0,))[0]
        self.assertEqual(data["error"], "CheckpointSaveError", data["message"])
        self.assertIn("rank 1 stopped responding while writing 1_", data["message"])
        self.assertLess(data["seconds"], data["timeout_s"] + KILL_SLACK_S,
                        "rank 0 must fail soon after the heartbeat timeout, not hang")
        self.assertTrue(data["same_bytes"], "checkpoint_0's files changed")
        self.assertEqual(data["new_complete"], [],
                         "a save with a dead rank must not commit a checkpoint")


if __name__ == "__main__":
    unittest.main()
