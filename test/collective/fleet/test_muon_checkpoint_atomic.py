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
"""Atomic saves and verified loads, in one process (seconds).

* ``TestSingleProcess``: real flex_checkpoint files, world size 1 - round
  trips, ids, retention, ``latest_complete_checkpoint``, corrupt markers and
  files, concurrent saves of the same id.
* ``TestRanksAsThreads``: the commit handshake with 2-3 ranks run as threads
  (communication and shard writing replaced by in-process fakes): a rank
  failing, a rank or the coordinator dying, a commit that loses a race; every
  live rank must raise the same error and nothing may be committed.
The same faults on real gloo processes: ``test_muon_checkpoint_faults.py``.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import threading
import time
import types
import unittest
from unittest import mock

import numpy as np

import paddle
from paddle.distributed.fleet.utils.log_util import logger
from paddle.distributed.flex_checkpoint.dcp.metadata import LocalTensorIndex

from muon_checkpoint_helpers import COLS, ROWS, ThreadRanks, _Dir, _Killed, arrays, numpy_of, whole
from muon_checkpoint_model import CheckpointNet

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_checkpoint import (
    commit,
    common,
    load as load_mod,
    save as save_mod,
    verify as verify_mod,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_checkpoint import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointSaveError,
    latest_complete_checkpoint,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)



def mount_small_tmpfs(test: unittest.TestCase, size: str) -> str:
    """A tmpfs of ``size`` for the test (skipped where mounting is not allowed)."""
    import subprocess

    path = tempfile.mkdtemp(prefix="muon_ckpt_tmpfs_")
    test.addCleanup(shutil.rmtree, path, True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        test.skipTest(f"cannot mount a tmpfs here (not root?): {mounted.stderr.strip()}")
    test.addCleanup(subprocess.run, ["umount", path], capture_output=True)
    return path


class TestSingleProcess(_Dir):
    def load(self, seed_shape_of: int = 0, **kwargs) -> dict:
        target = whole({k: np.zeros_like(v) for k, v in arrays(seed_shape_of).items()})
        load_sharded_checkpoint(target, self.root, **kwargs)
        return numpy_of(target)

    def assert_values(self, got: dict, seed: int, what: str) -> None:
        for key, value in arrays(seed).items():
            self.assertTrue(np.array_equal(got[key], value), f"{what}: {key} differs")

    def test_round_trip_ids_and_the_newest_complete(self):
        first = save_sharded_checkpoint(whole(arrays(1)), self.root)
        second = save_sharded_checkpoint(whole(arrays(2)), self.root)
        self.assertEqual([os.path.basename(first), os.path.basename(second)],
                         ["checkpoint_0", "checkpoint_1"])
        self.assertEqual(sorted(os.listdir(self.root)), ["checkpoint_0", "checkpoint_1"],
                         "no temporary directory may remain after a commit")
        self.assertFalse(os.path.exists(os.path.join(second, ".status")))
        marker = commit.read_marker(second)
        self.assertEqual(sorted(marker["files"]), ["0_1.distcp", "1.metadata"])
        self.assertEqual(marker["tensors"]["w"], {"global_shape": [ROWS, COLS],
                                                  "dtype": "float32"})
        for name, entry in marker["files"].items():
            self.assertEqual(commit.file_digest(os.path.join(second, name)),
                             (entry["size"], entry["sha256"]), name)
        self.assert_values(self.load(), 2, "newest")
        self.assert_values(self.load(unique_id=0), 1, "unique_id=0")
        target = whole({k: np.zeros_like(v) for k, v in arrays(0).items()})
        self.assertEqual(load_sharded_checkpoint(target, first), first)  # the dir itself
        self.assert_values(numpy_of(target), 1, "checkpoint directory")
        self.assertEqual(latest_complete_checkpoint(self.root), second)

    def test_explicit_id_is_never_overwritten(self):
        save_sharded_checkpoint(whole(arrays(1)), self.root, unique_id=5)
        before = commit.file_digest(os.path.join(self.root, "checkpoint_5", "0_5.distcp"))
        with self.assertRaisesRegex(FileExistsError, r"checkpoint_5 exists; a save never "
                                    r"overwrites .*None takes the next, 6"):
            save_sharded_checkpoint(whole(arrays(2)), self.root, unique_id=5)
        self.assertEqual(commit.file_digest(os.path.join(self.root, "checkpoint_5",
                                                         "0_5.distcp")), before)
        self.assertEqual(os.path.basename(save_sharded_checkpoint(whole(arrays(3)), self.root)),
                         "checkpoint_6")

    def test_keep_last(self):
        for seed in range(4):
            save_sharded_checkpoint(whole(arrays(seed)), self.root, keep_last=2)
        os.makedirs(os.path.join(self.root, "checkpoint_0"))  # incomplete: not counted
        self.assertEqual(sorted(os.listdir(self.root)),
                         ["checkpoint_0", "checkpoint_2", "checkpoint_3"])
        # an explicit older id: kept although two newer ones exist
        save_sharded_checkpoint(whole(arrays(5)), self.root, unique_id=1, keep_last=1)
        self.assertEqual(sorted(os.listdir(self.root)),
                         ["checkpoint_0", "checkpoint_1", "checkpoint_3"])
        for bad in (0, -1, 1.5, "2"):
            with self.assertRaisesRegex(ValueError, "keep_last"):
                save_sharded_checkpoint(whole(arrays(0)), self.root, keep_last=bad)
        with self.assertRaisesRegex(ValueError, "timeout_s"):
            save_sharded_checkpoint(whole(arrays(0)), self.root, timeout_s=0)

    def test_latest_complete_skips_and_says_why(self):
        self.assertIsNone(latest_complete_checkpoint(os.path.join(self.root, "none")))
        good = save_sharded_checkpoint(whole(arrays(1)), self.root)
        truncated = save_sharded_checkpoint(whole(arrays(2)), self.root)
        with open(os.path.join(truncated, "0_1.distcp"), "r+b") as f:
            f.truncate(10)
        missing = save_sharded_checkpoint(whole(arrays(3)), self.root)
        os.remove(os.path.join(missing, "2.metadata"))
        os.makedirs(os.path.join(self.root, "checkpoint_3"))  # no marker
        os.makedirs(os.path.join(self.root, commit.tmp_name(4, "abc")))
        with self.assertLogs(logger, "WARNING") as logs:
            self.assertEqual(latest_complete_checkpoint(self.root), good)
        text = "\n".join(logs.output)
        self.assertIn(".checkpoint_4.tmp-abc: a save that never committed", text)
        self.assertIn("checkpoint_3/checkpoint.complete.json: no completion marker", text)
        self.assertIn("2.metadata: missing", text)
        self.assertIn("0_1.distcp: 10 bytes, the marker says", text)
        self.assert_values(self.load(), 1, "newest complete")
        with self.assertRaisesRegex(CheckpointCorruptError, r"0_1.distcp \(written by rank 0\)"
                                    r": 10 bytes"):
            self.load(unique_id=1)
        with self.assertRaisesRegex(CheckpointCorruptError, r"2.metadata: missing"):
            self.load(unique_id=2)
        with self.assertRaisesRegex(FileNotFoundError, r"checkpoint_9 does not exist .*"
                                    r"\[0, 1, 2, 3\]"):
            self.load(unique_id=9)
        shutil.rmtree(good)
        with self.assertRaisesRegex(FileNotFoundError, "no complete checkpoint under"):
            self.load()

    def test_latest_verified_skips_a_flipped_byte(self):
        good = save_sharded_checkpoint(whole(arrays(1)), self.root)
        flipped = save_sharded_checkpoint(whole(arrays(2)), self.root)
        victim = os.path.join(flipped, "0_1.distcp")
        with open(victim, "r+b") as f:
            f.seek(30)
            byte = f.read(1)
            f.seek(30)
            f.write(bytes([byte[0] ^ 4]))
        self.assertEqual(latest_complete_checkpoint(self.root), flipped, "sizes alone pass")
        with self.assertLogs(logger, "WARNING") as logs:
            self.assertEqual(latest_complete_checkpoint(self.root, verify=True), good)
        self.assertIn(f"{victim}: SHA-256 differs", "\n".join(logs.output))

    def test_marker_problems_name_the_marker(self):
        directory = save_sharded_checkpoint(whole(arrays(1)), self.root)
        marker = os.path.join(directory, commit.MARKER)
        with open(marker) as f:
            good = json.load(f)
        cases = [
            (b"\xff\xfe not json", "completion marker unreadable"),
            (json.dumps({"format": "other"}).encode(), "not a completion marker"),
        ] + [(json.dumps({k: v for k, v in good.items() if k != field}).encode(),
              f"completion marker lacks {field!r}")
             for field in ("unique_id", "files", "metadata_file", "tensors")]
        for raw, expected in cases:
            with open(marker, "wb") as f:
                f.write(raw)
            with self.assertRaises(CheckpointCorruptError) as info:
                self.load(unique_id=0)
            self.assertIn(f"{marker}: {expected}", str(info.exception))

    def test_only_whole_checkpoint_names_carry_an_id(self):
        for name, uid in (("checkpoint_12", 12), ("checkpoint_0", 0), ("checkpoint_12_old", None),
                          ("checkpoint_3.bak", None), (".checkpoint_3.tmp-ab", None),
                          ("checkpoint_", None), ("xcheckpoint_3", None)):
            self.assertEqual(commit.checkpoint_id(name), uid, name)

    def test_a_marker_of_another_save_is_not_this_saves_commit(self):
        # a rank waiting for the coordinator's commit: a marker with another
        # save's token in the final directory does not end the wait; the
        # coordinator's silence does
        final = os.path.join(self.root, "checkpoint_0")
        os.makedirs(final)
        with open(os.path.join(final, commit.MARKER), "w") as f:
            json.dump({"format": commit.MARKER_FORMAT, "token": "theirs"}, f)
        handshake = commit.SaveHandshake(os.path.join(self.root, ".tmp"), 1, [0, 1], 0.3)
        clock = types.SimpleNamespace(now=0.0)
        fake_time = types.SimpleNamespace(
            monotonic=lambda: clock.now,
            sleep=lambda s: setattr(clock, "now", clock.now + s))
        with mock.patch.object(commit, "time", fake_time):
            message = handshake.wait_decision(final, "mine")
        self.assertIsNotNone(message, "another save's marker was taken as this save's commit")
        self.assertIn("the coordinator, rank 0, stopped responding", message)
        # on a simulated clock: given up right after timeout_s of silence
        self.assertGreater(clock.now, 0.3)
        self.assertLessEqual(clock.now, 0.3 + 2 * commit.POLL_S,
                             f"a silent coordinator was noticed after {clock.now:.2f} s, "
                             "timeout_s is 0.3")

    def test_marker_layout_must_match_the_metadata(self):
        directory = save_sharded_checkpoint(whole(arrays(1)), self.root)
        marker = os.path.join(directory, commit.MARKER)
        with open(marker) as f:
            data = json.load(f)
        data["tensors"]["w"]["global_shape"] = [ROWS, COLS + 1]  # a flipped digit
        with open(marker, "w") as f:
            json.dump(data, f)
        with self.assertRaisesRegex(CheckpointCorruptError, r"checkpoint.complete.json: layout "
                                    r"summary differs from .*0.metadata for w"):
            self.load()

    def test_other_model_is_refused_before_reading(self):
        save_sharded_checkpoint(whole(arrays(1)), self.root)
        other = whole({"w": np.zeros((2, 2), "float32")})
        with mock.patch.object(load_mod, "_read_shards") as read:
            with self.assertRaises(CheckpointMismatchError) as info:
                load_sharded_checkpoint(other, self.root)
        read.assert_not_called()
        self.assertIn("w: checkpoint global shape [4, 6], here [2, 2]", str(info.exception))
        self.assertIn("in the checkpoint but loaded by no rank: b", str(info.exception))

    def test_unreadable_plain_flex_checkpoint_names_its_metadata(self):
        paddle.distributed.save_state_dict(whole(arrays(1)), self.root)
        with open(os.path.join(self.root, "0.metadata"), "wb") as f:
            f.write(b"garbage")
        with self.assertRaisesRegex(CheckpointCorruptError, r"0\.metadata: unreadable"):
            self.load()

    def test_plain_flex_checkpoint_loads_its_newest_id(self):
        # a plain flex_checkpoint directory (no checkpoint_<id>): the highest
        # <id>.metadata is loaded
        for uid, seed in ((0, 1), (1, 2)):
            paddle.distributed.save_state_dict(whole(arrays(seed)), self.root, unique_id=uid)
        self.assert_values(self.load(), 2, "plain directory, newest id")

    def test_values_that_cannot_be_saved_are_refused_before_writing(self):
        for bad, expected in (({"w": np.zeros(3)}, r"state_dict\['w'\] is a ndarray"),
                              ({1: whole(arrays(1))["w"]}, "state_dict key 1 is a int"),
                              ([1], "state_dict must be a dict")):
            with self.assertRaisesRegex(CheckpointSaveError, expected):
                save_sharded_checkpoint(bad, self.root)
        nested = {"model": whole(arrays(1))}
        directory = save_sharded_checkpoint(nested, self.root)
        self.assertIn("model.w", commit.read_marker(directory)["tensors"])
        self.assertEqual(os.listdir(self.root), ["checkpoint_0"])

    def test_a_real_full_disk(self):
        # a 256 KiB tmpfs (root only): the second save does not fit
        disk = mount_small_tmpfs(self, "256k")
        save_sharded_checkpoint(whole(arrays(1)), disk)
        before = {n: commit.file_digest(os.path.join(disk, "checkpoint_0", n))
                  for n in os.listdir(os.path.join(disk, "checkpoint_0"))}
        big = whole({"w": np.ones((400, 400), "float32")})  # 640 KB
        with self.assertRaisesRegex(CheckpointSaveError, r"(?s)saving .*checkpoint_1 failed; "
                                    r"nothing was committed.*rank 0 could not write "
                                    r"\S+: OSError: .*No space left on device"):
            save_sharded_checkpoint(big, disk)
        self.assertEqual({n: commit.file_digest(os.path.join(disk, "checkpoint_0", n))
                          for n in os.listdir(os.path.join(disk, "checkpoint_0"))}, before,
                         "the full disk changed the previous checkpoint")
        (left,) = [n for n in os.listdir(disk) if n.startswith(".")]
        self.assertEqual(os.listdir(os.path.join(disk, left)), [".status"],
                         "the failed save's shards must be freed")
        filler = os.path.join(disk, "filler")
        with open(filler, "wb") as f:  # no room left even to prepare
            try:
                f.write(b"\0" * (1 << 20))
            except OSError:
                pass
        with self.assertRaisesRegex(CheckpointSaveError, r"rank 0 could not prepare .*"
                                    r"No space left on device"):
            save_sharded_checkpoint(whole(arrays(3)), disk)
        os.remove(filler)
        target = whole({k: np.zeros_like(v) for k, v in arrays(1).items()})
        self.assertEqual(os.path.basename(load_sharded_checkpoint(target, disk)), "checkpoint_0")
        self.assert_values(numpy_of(target), 1, "after a full disk")
        # id 1 stays claimed by the failed save's record until this commit sweeps it
        self.assertEqual(os.path.basename(save_sharded_checkpoint(whole(arrays(2)), disk)),
                         "checkpoint_2", "space freed: the next save fits")
        self.assertEqual(sorted(os.listdir(disk)), ["checkpoint_0", "checkpoint_2"])

    def test_concurrent_saves_with_automatic_ids_both_commit(self):
        # two jobs saving into one directory at the same moment claim distinct ids
        start = threading.Barrier(4)
        real_propose = save_mod._propose

        def propose_together(path, unique_id):
            start.wait(timeout=30)
            return real_propose(path, unique_id)

        outcomes: dict = {}

        def run(seed: int) -> None:
            try:
                outcomes[seed] = save_sharded_checkpoint(whole(arrays(seed)), self.root)
            except Exception as exc:  # noqa: BLE001 - the outcome under test
                outcomes[seed] = exc

        with mock.patch.object(save_mod, "_propose", propose_together):
            threads = [threading.Thread(target=run, args=(s,)) for s in (1, 2, 3, 4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        names = {os.path.basename(str(o)) for o in outcomes.values()}
        # two saves that see each other both yield an id: ids may skip
        self.assertEqual(len(names), 4, f"every concurrent save must commit its own id: "
                                        f"{outcomes}")
        self.assertTrue(all(commit.checkpoint_id(n) is not None for n in names), outcomes)
        for seed, directory in outcomes.items():
            target = whole({k: np.zeros_like(v) for k, v in arrays(0).items()})
            load_sharded_checkpoint(target, directory)
            self.assert_values(numpy_of(target), seed, f"{directory} (save {seed})")

    def test_a_save_seeing_a_rival_for_its_id_takes_the_next(self):
        real_mkdir = os.mkdir
        rival = os.path.join(self.root, commit.tmp_name(0, "rival"))

        def mkdir_with_rival(path, *args, **kwargs):
            real_mkdir(path, *args, **kwargs)
            if not os.path.exists(rival):  # another job claims id 0 at the same moment
                real_mkdir(rival)

        with mock.patch.object(save_mod.os, "mkdir", mkdir_with_rival):
            directory = save_sharded_checkpoint(whole(arrays(1)), self.root)
        self.assertEqual(os.path.basename(directory), "checkpoint_1")
        self.assertEqual(sorted(os.listdir(self.root)), [os.path.basename(rival),
                                                         "checkpoint_1"])

    def test_concurrent_saves_of_one_id_never_corrupt(self):
        # both write at once into their own temporary directories; one rename wins
        both_writing = threading.Barrier(2)
        real = save_mod._write_shards

        def write_together(*args, **kwargs):
            # generous: on a loaded box one thread may reach here long after the other
            both_writing.wait(timeout=120)
            real(*args, **kwargs)

        outcomes = {}

        def run(seed: int) -> None:
            try:
                save_sharded_checkpoint(whole(arrays(seed)), self.root, unique_id=3)
                outcomes[seed] = "saved"
            except (CheckpointSaveError, FileExistsError) as exc:
                outcomes[seed] = str(exc)
            except Exception as exc:  # noqa: BLE001  shown in the failure message
                outcomes[seed] = f"unexpected {type(exc).__name__}: {exc}"

        with mock.patch.object(save_mod, "_write_shards", write_together):
            threads = [threading.Thread(target=run, args=(s,)) for s in (1, 2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(240)
        winners = [s for s, o in outcomes.items() if o == "saved"]
        self.assertEqual(len(winners), 1, f"exactly one save may commit: {outcomes}")
        loser = outcomes[3 - winners[0]]
        self.assertRegex(loser, r"could not commit: .*checkpoint_3 appeared meanwhile")
        # The loser keeps only its decision file (hidden, no data, no marker) for a
        # rank still to read it; whether the winner's sweep already removed it
        # depends on which save finished first.
        leftovers = sorted(set(os.listdir(self.root)) - {"checkpoint_3"})
        self.assertIn("checkpoint_3", os.listdir(self.root))
        for name in leftovers:
            self.assertTrue(name.startswith("."), f"{name} looks like a checkpoint")
            inside = os.listdir(os.path.join(self.root, name))
            self.assertEqual(inside, [commit.STATUS_DIR],
                             f"the failed save {name} kept more than its decision: {inside}")
        self.assert_values(self.load(unique_id=3), winners[0], "the committed save")


class TestRanksAsThreads(_Dir):
    #: Paths that never wait for a silent rank: generous, so a starved
    #: heartbeat thread on a loaded machine cannot fake a death.
    TIMEOUT_S = 15.0
    #: Paths that must wait for a silent rank.
    DEATH_TIMEOUT_S = 2.0

    def save(self, world: int, faults: dict | None = None, **kwargs) -> dict:
        ranks = ThreadRanks(world, self.root)
        ranks.faults = faults or {}
        kwargs.setdefault("timeout_s", self.TIMEOUT_S)
        return ranks.run(lambda rank: save_sharded_checkpoint(
            whole(arrays(rank)), self.root, **kwargs))

    def assert_one_failure(self, results: dict, ranks, *expected: str) -> str:
        messages = set()
        for rank in ranks:
            error = results[rank]
            self.assertIsInstance(error, CheckpointSaveError, f"rank {rank}: {error!r}")
            for text in expected:
                self.assertIn(text, str(error), f"rank {rank}")
            messages.add(str(error))
        self.assertEqual(len(messages), 1, f"ranks report different failures: {messages}")
        self.assertFalse([n for n in os.listdir(self.root) if not n.startswith(".")],
                         "a failed save committed something")
        return messages.pop()

    def test_every_rank_commits_the_same_checkpoint(self):
        results = self.save(3)
        final = os.path.join(self.root, "checkpoint_0")
        self.assertEqual(results, {0: final, 1: final, 2: final})
        marker = commit.read_marker(final)
        self.assertEqual(sorted(marker["files"]),
                         ["0.metadata", "0_0.distcp", "1_0.distcp", "2_0.distcp"])
        self.assertEqual(marker["files"]["2_0.distcp"]["rank"], 2)
        self.assertEqual(os.listdir(self.root), ["checkpoint_0"])
        # verified load, checksums spread over the ranks: a flip only rank 1
        # checks is reported by every rank
        ranks = ThreadRanks(3, self.root)
        self.assertEqual(ranks.run(lambda r: load_sharded_checkpoint(
            whole(arrays(0)), self.root)), {0: final, 1: final, 2: final})
        victim = os.path.join(final, "0_0.distcp")  # sorted index 1 -> rank 1 hashes it
        with open(victim, "r+b") as f:
            f.seek(40)
            byte = f.read(1)
            f.seek(40)
            f.write(bytes([byte[0] ^ 1]))
        results = ThreadRanks(3, self.root).run(lambda r: load_sharded_checkpoint(
            whole(arrays(0)), self.root))
        for rank in range(3):
            self.assertIsInstance(results[rank], CheckpointCorruptError, f"rank {rank}")
            self.assertIn(f"rank 1: {victim} (written by rank 0): SHA-256 differs",
                          str(results[rank]))

    def test_a_failing_rank_fails_every_rank(self):
        full = OSError(errno.ENOSPC, "No space left on device", "/x/2_0.distcp")
        results = self.save(3, {2: full})
        self.assert_one_failure(results, range(3), "rank 2 could not write 2_0.distcp",
                                "No space left on device")
        (left,) = os.listdir(self.root)
        self.assertEqual(os.listdir(os.path.join(self.root, left)), [".status"],
                         "a failed save must free its shards at once")
        with self.assertLogs(logger, "WARNING") as logs:
            self.assertIsNone(latest_complete_checkpoint(self.root))
        self.assertIn(f"{left}: a save that never committed (failed)", "\n".join(logs.output))
        self.save(3)
        self.assertEqual(os.listdir(self.root), ["checkpoint_1"],
                         "the next commit (past the id the failed save claimed) sweeps "
                         "what the failed save left")

    def test_a_dead_rank_is_noticed_within_the_timeout(self):
        t0 = time.monotonic()
        results = self.save(3, {1: _Killed()}, timeout_s=self.DEATH_TIMEOUT_S)
        self.assertEqual(results[1], "killed")
        self.assert_one_failure(results, (0, 2), "rank 1 stopped responding while writing "
                                "1_0.distcp (no heartbeat for 2 s")
        self.assertLess(time.monotonic() - t0, 30, "hang guard")

    def test_a_dead_coordinator_is_noticed_by_the_others(self):
        results = self.save(3, {0: _Killed()}, timeout_s=self.DEATH_TIMEOUT_S)
        self.assertEqual(results[0], "killed")
        self.assert_one_failure(results, (1, 2), "the coordinator, rank 0, stopped "
                                "responding before committing")

    def test_a_rank_that_cannot_prepare_fails_every_rank_at_once(self):
        real_start = commit.SaveHandshake.start

        for failing, error in ((1, OSError(errno.ENOSPC, "No space left on device", "/d/r")),
                               (0, OSError(errno.EACCES, "Permission denied"))):
            def start(self, failing=failing, error=error):
                if self.rank == failing:
                    raise error
                real_start(self)

            with mock.patch.object(commit.SaveHandshake, "start", start):
                t0 = time.monotonic()
                results = self.save(3, timeout_s=60)
            self.assert_one_failure(results, range(3), f"rank {failing} could not prepare",
                                    error.strerror)
            self.assertLess(time.monotonic() - t0, 30, "agreed at once, not after a timeout")
            self.assertEqual(os.listdir(self.root), [], "the coordinator removes the attempt")

    def test_a_rank_that_cannot_report(self):
        real_report = commit.SaveHandshake.report

        def report(self, ok, **info):
            if self.rank == 1:
                raise OSError(errno.EIO, "Input/output error")
            real_report(self, ok, **info)

        with mock.patch.object(commit.SaveHandshake, "report", report):
            results = self.save(2, timeout_s=self.DEATH_TIMEOUT_S)
        self.assert_one_failure(results, (0, 1), "rank 1 stopped responding while writing")

    def test_after_the_rename_the_save_counts_as_committed(self):
        real_fsync = commit.fsync_path

        def parent_fails(path):
            if os.path.basename(path) == os.path.basename(self.root):
                raise OSError(errno.EIO, "Input/output error")
            real_fsync(path)

        with mock.patch.object(save_mod, "fsync_path", parent_fails):
            results = self.save(2)
        final = os.path.join(self.root, "checkpoint_0")
        self.assertEqual(results, {0: final, 1: final})

    def test_a_coordinator_that_cannot_publish_the_failure(self):
        def no_room(self, message, readers=None):
            raise OSError(errno.ENOSPC, "No space left on device")

        with mock.patch.object(commit.SaveHandshake, "decide_failure", no_room):
            results = self.save(2, {1: OSError(errno.EIO, "Input/output error")},
                                timeout_s=self.DEATH_TIMEOUT_S)
        self.assertIn("rank 1 could not write", str(results[0]))
        self.assertIn("the coordinator, rank 0, stopped responding", str(results[1]))

    def test_a_lost_commit_race_fails_every_rank(self):
        real_rename = os.rename

        def someone_else_first(src, dst):
            os.makedirs(os.path.join(dst, "x"))
            real_rename(src, dst)

        with mock.patch.object(save_mod.os, "rename", someone_else_first):
            results = self.save(2)
        for rank in (0, 1):
            self.assertIsInstance(results[rank], CheckpointSaveError)
            self.assertIn("rank 0 (coordinator) could not commit", str(results[rank]))
        self.assertEqual(os.listdir(os.path.join(self.root, "checkpoint_0")), ["x"])

    def test_metadata_naming_a_file_nobody_wrote_is_not_committed(self):
        real_load = paddle.load

        def with_ghost(path, *args, **kwargs):
            meta = real_load(path, *args, **kwargs)
            if path.endswith(".metadata"):
                meta.storage_metadata[LocalTensorIndex("ghost", (0,))] = "9_0.distcp"
            return meta

        with mock.patch.object(save_mod.paddle, "load", with_ghost):
            results = self.save(2)
        self.assert_one_failure(results, (0, 1), "data files no rank reported: ['9_0.distcp']")

    def test_a_rank_refusing_before_the_collectives_stops_every_rank(self):
        ranks = ThreadRanks(2, self.root)

        def body(rank):
            state = whole(arrays(rank))
            if rank == 1:
                state["bad"] = 3
            return save_sharded_checkpoint(state, self.root)

        results = ranks.run(body)
        for rank in (0, 1):
            self.assertIsInstance(results[rank], CheckpointSaveError, f"rank {rank}")
            self.assertIn("rank 1: TypeError: state_dict['bad'] is a int", str(results[rank]))
        self.assertEqual(os.listdir(self.root), [])

    def test_a_rank_missing_at_the_start_is_an_error_not_a_hang(self):
        def gloo_timeout(obj, process_group, ranks):
            raise RuntimeError("[gloo] Timed out waiting 30000ms for recv operation")

        with mock.patch.object(common, "ranks_of", lambda g: (0, [0, 1])), \
                mock.patch.object(common, "gather", gloo_timeout):
            with self.assertRaisesRegex(CheckpointSaveError, r"the ranks \[0, 1\] could not "
                                        r"agree before writing \(RuntimeError: \[gloo\] Timed"):
                save_sharded_checkpoint(whole(arrays(1)), self.root)
        self.assertEqual(os.listdir(self.root), [], "the claimed directory must be removed")

    def test_a_file_one_rank_cannot_read_is_reported_by_every_rank(self):
        save_sharded_checkpoint(whole(arrays(0)), self.root)
        real_digest = verify_mod.file_digest
        ranks = ThreadRanks(2, self.root)

        def digest(path):
            if ranks.local.rank == 1:
                raise PermissionError(errno.EACCES, "Permission denied", path)
            return real_digest(path)

        with mock.patch.object(verify_mod, "file_digest", digest):
            results = ranks.run(lambda r: load_sharded_checkpoint(whole(arrays(0)), self.root))
        for rank in (0, 1):
            self.assertIsInstance(results[rank], CheckpointCorruptError, f"rank {rank}")
            self.assertIn("rank 1: ", str(results[rank]))
            self.assertIn("could not be checked (PermissionError", str(results[rank]))

    def test_every_rank_checks_the_metadata_checksum(self):
        # data files' checksums are spread over the ranks, the metadata's is
        # checked by all (each rank reads it): an altered byte is named by every rank
        save_sharded_checkpoint(whole(arrays(0)), self.root)
        meta = os.path.join(self.root, "checkpoint_0", "0.metadata")
        with open(meta, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
        results = ThreadRanks(3, self.root).run(
            lambda r: load_sharded_checkpoint(whole(arrays(0)), self.root))
        for rank in range(3):
            self.assertIsInstance(results[rank], CheckpointCorruptError, f"rank {rank}")
            for checker in range(3):
                self.assertIn(f"rank {checker}: {meta}: SHA-256 differs", str(results[rank]),
                              f"rank {rank}'s error lacks rank {checker}'s metadata check")

    def test_ranks_passing_different_paths_are_refused_naming_both(self):
        save_sharded_checkpoint(whole(arrays(0)), self.root)
        other = os.path.join(self.root, "elsewhere")
        shutil.copytree(os.path.join(self.root, "checkpoint_0"), other)
        ranks = ThreadRanks(2, self.root)
        with mock.patch.object(load_mod, "_read_shards") as read:
            results = ranks.run(lambda r: load_sharded_checkpoint(
                whole(arrays(0)), other if r else self.root))
        read.assert_not_called()
        for rank in (0, 1):
            self.assertIsInstance(results[rank], CheckpointMismatchError, f"rank {rank}")
            self.assertIn("the ranks passed different checkpoint paths", str(results[rank]))
            self.assertIn(f"rank 0: path {self.root!r}", str(results[rank]))
            self.assertIn(f"rank 1: path {other!r}", str(results[rank]))

    def test_ranks_that_resolve_different_checkpoints_refuse(self):
        # one path, but a save committed between two ranks' lookups
        for seed in (0, 1):
            save_sharded_checkpoint(whole(arrays(seed)), self.root)
        ranks = ThreadRanks(2, self.root)
        real = verify_mod.newest_complete

        def late(path, verify):
            if ranks.local.rank == 1:
                return real(path, verify)
            return os.path.join(path, "checkpoint_0"), []

        with mock.patch.object(verify_mod, "newest_complete", late):
            results = ranks.run(lambda r: load_sharded_checkpoint(whole(arrays(0)), self.root))
        for rank in (0, 1):
            self.assertIsInstance(results[rank], CheckpointCorruptError, f"rank {rank}")
            self.assertIn("the ranks resolved different checkpoints", str(results[rank]))
            self.assertIn("checkpoint_1", str(results[rank]))

    def test_wait_for_acks_gives_up(self):
        hs = commit.SaveHandshake(os.path.join(self.root, "t"), 0, [0, 1], 0.2)
        os.makedirs(hs.status_dir)
        t0 = time.monotonic()
        hs.wait_acks([1])
        self.assertLess(time.monotonic() - t0, 5, "hang guard")
        open(os.path.join(hs.status_dir, "ack_1"), "wb").close()
        hs.wait_acks([1])
        hs.stop()  # never started: nothing to join


class TestNewestCheckpointLoads(unittest.TestCase):
    def test_two_checkpoints_in_one_directory(self):
        # Bug: the oldest id (or the string-sorted largest, "2" > "10") is checked
        # and loaded. Id 2 was saved from a model without experts, id 10 from
        # the one loading: only the newest matches.
        with tempfile.TemporaryDirectory() as tmp:
            for uid, coord, value in ((2, None, 3.0), (10, 0, 5.0)):
                net = CheckpointNet(coord, 1)
                with paddle.no_grad():
                    bias = net.param("out.bias")
                    bias.set_value(paddle.full(bias.shape, value))
                paddle.distributed.save_state_dict(net.sharded_state_dict(), tmp,
                                                   unique_id=uid)
            fresh = CheckpointNet(0, 1)
            load_sharded_checkpoint(fresh.sharded_state_dict(), tmp)
            got = np.unique(fresh.values()["out.bias"]).tolist()
            self.assertEqual(got, [5.0], f"loaded out.bias {got}: not the newest checkpoint")


if __name__ == "__main__":
    unittest.main()
