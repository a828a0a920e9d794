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
"""Checkpoint inputs that must be refused before they corrupt a run (seconds).

The in-process part of the checkpoint fault matrix, per call:

* ``TestLoadRefusals``: a checkpoint of another dtype, a ``checkpoint_<id>``
  that is a symlink to (or a copy of) another id, grown / truncated shards,
  markers nested too deep or of the wrong shape.
* ``TestSaveHygiene``: what killed saves left is reclaimed by the next save
  (never a live save's directory); the loser of two saves of one id raises
  ``CheckpointSaveError`` even when the winner already swept its directory.
* ``TestArguments``: ids are non-negative ints, timeouts finite and > 0,
  refused with one line before anything is written.
* ``TestRanksAgree`` (ranks as threads): a rank that finds no checkpoint,
  passes another save path or a bad argument makes every rank fail at once,
  naming the rank and the paths.
* ``TestCpuResharding``: on a build without a GPU the load path's
  ``Tensor.cuda`` stand-in exists only during the package's own load call.
The same faults on real gloo ranks: ``test_muon_checkpoint_faults.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import unittest
from unittest import mock

import numpy as np

import paddle
from paddle.distributed.fleet.utils.log_util import logger

from muon_checkpoint_helpers import ThreadRanks, _Dir, arrays, numpy_of, whole

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_checkpoint import (
    commit,
    common,
    listing,
    load as load_mod,
    reshard,
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

#: Well under any timeout in play (gloo's 30 s, the tests' 15 s heartbeat):
#: an agreed failure takes milliseconds, a waited-out one takes the timeout.
AT_ONCE_S = 8.0


def zeros(dtype: str = "float32") -> dict:
    """A target of the saved keys and shapes, in ``dtype``."""
    state = whole({k: np.zeros_like(v) for k, v in arrays(0).items()})
    for sw in state.values():
        sw.local_tensor = sw.local_tensor.astype(dtype)
    return state


class TestLoadRefusals(_Dir):
    def test_a_float32_checkpoint_is_not_read_into_other_dtypes(self):
        save_sharded_checkpoint(whole(arrays(1)), self.root)
        for dtype in ("float64", "float16", "bfloat16"):
            target = zeros(dtype)
            with mock.patch.object(load_mod, "_read_shards") as read, \
                    self.assertRaises(CheckpointMismatchError) as info:
                load_sharded_checkpoint(target, self.root)
            read.assert_not_called()
            for key in ("w", "b"):
                self.assertIn(f"{key}: checkpoint dtype float32, here {dtype}",
                              str(info.exception))
        mixed = zeros()
        mixed["b"] = whole({"b": arrays(0)["b"].astype("float64")})["b"]
        with self.assertRaisesRegex(CheckpointMismatchError, r"rank 0: b: checkpoint dtype "
                                    r"float32, here float64") as info:
            load_sharded_checkpoint(mixed, self.root)
        self.assertNotIn("w: checkpoint dtype", str(info.exception))
        target = zeros()  # the saved dtype loads, bit-exact
        load_sharded_checkpoint(target, self.root)
        for key, value in arrays(1).items():
            np.testing.assert_array_equal(numpy_of(target)[key], value, err_msg=key)

    def test_plain_flex_checkpoint_dtypes_are_checked_too(self):
        paddle.distributed.save_state_dict(whole(arrays(1)), self.root)
        with self.assertRaisesRegex(CheckpointMismatchError,
                                    "w: checkpoint dtype float32, here float64"):
            load_sharded_checkpoint(zeros("float64"), self.root)

    def test_a_symlink_to_another_id_is_never_loaded_under_this_id(self):
        save_sharded_checkpoint(whole(arrays(1)), self.root)  # checkpoint_0
        link = os.path.join(self.root, "checkpoint_8")
        os.symlink(os.path.join(self.root, "checkpoint_0"), link)
        for call in (lambda t: load_sharded_checkpoint(t, self.root, unique_id=8),
                     lambda t: load_sharded_checkpoint(t, link)):
            target = zeros()
            with mock.patch.object(load_mod, "_read_shards") as read, \
                    self.assertRaises(CheckpointCorruptError) as info:
                call(target)
            read.assert_not_called()
            self.assertIn(f"{link}: holds checkpoint 0 (its marker's unique_id), not 8 "
                          "(a symlink to", str(info.exception))
        with self.assertLogs(logger, "WARNING") as logs:
            latest = latest_complete_checkpoint(self.root)
        self.assertEqual(latest, os.path.join(self.root, "checkpoint_0"),
                         "the newest name is a link to id 0: skipped, not returned")
        self.assertIn("checkpoint_8: holds checkpoint 0", "\n".join(logs.output))
        with self.assertLogs(logger, "WARNING"):
            self.assertEqual(load_sharded_checkpoint(zeros(), self.root),
                             os.path.join(self.root, "checkpoint_0"))

    def test_a_copy_under_another_id_is_refused(self):
        save_sharded_checkpoint(whole(arrays(1)), self.root)
        shutil.copytree(os.path.join(self.root, "checkpoint_0"),
                        os.path.join(self.root, "checkpoint_5"))
        with self.assertRaisesRegex(CheckpointCorruptError, r"checkpoint_5: holds checkpoint 0 "
                                    r".*not 5 \(a copy or a rename\?\)"):
            load_sharded_checkpoint(zeros(), self.root, unique_id=5)

    def test_a_grown_shard_fails_the_size_check(self):
        save_sharded_checkpoint(whole(arrays(1)), self.root)
        grown = save_sharded_checkpoint(whole(arrays(2)), self.root)
        shard = os.path.join(grown, "0_1.distcp")
        size = os.path.getsize(shard)
        with open(shard, "ab") as f:
            f.write(b"\0" * 16)
        with self.assertLogs(logger, "WARNING") as logs:
            self.assertEqual(latest_complete_checkpoint(self.root),
                             os.path.join(self.root, "checkpoint_0"))
        self.assertIn(f"{shard}: {size + 16} bytes, the marker says {size}",
                      "\n".join(logs.output))
        with self.assertRaisesRegex(CheckpointCorruptError, rf"{shard} \(written by rank 0\): "
                                    rf"{size + 16} bytes, the marker says {size} \(grown"):
            load_sharded_checkpoint(zeros(), self.root, unique_id=1)

    def test_the_only_checkpoint_truncated_names_the_file(self):
        directory = save_sharded_checkpoint(whole(arrays(1)), self.root)
        shard = os.path.join(directory, "0_0.distcp")
        with open(shard, "r+b") as f:
            f.truncate(10)
        with self.assertRaises(FileNotFoundError) as info:
            load_sharded_checkpoint(zeros(), self.root)
        self.assertIn(f"{shard}: 10 bytes, the marker says", str(info.exception))
        self.assertNotIn("see the warning", str(info.exception))

    def test_a_deeply_nested_marker_is_incomplete_not_a_crash(self):
        directory = save_sharded_checkpoint(whole(arrays(1)), self.root)
        with open(os.path.join(directory, commit.MARKER), "w") as f:
            f.write("[" * 200000 + "]" * 200000)
        with self.assertLogs(logger, "WARNING") as logs:
            self.assertIsNone(latest_complete_checkpoint(self.root))
        self.assertIn("completion marker unreadable (RecursionError", "\n".join(logs.output))
        with self.assertRaisesRegex(CheckpointCorruptError, "unreadable .RecursionError"):
            load_sharded_checkpoint(zeros(), directory)
        self.assertIsNone(commit._read_json(os.path.join(directory, commit.MARKER)))

    def test_markers_of_the_wrong_shape_are_refused_naming_the_field(self):
        directory = save_sharded_checkpoint(whole(arrays(1)), self.root)
        marker_path = os.path.join(directory, commit.MARKER)
        with open(marker_path) as f:
            good = json.load(f)
        cases = [
            (dict(good, unique_id=True), "unique_id True is not a non-negative int"),
            (dict(good, unique_id=-1), "unique_id -1 is not a non-negative int"),
            (dict(good, files=[]), "'files' and 'tensors' must be objects"),
            (dict(good, files=dict(good["files"], **{"../x": {"size": 1, "sha256": ""}})),
             "file entry '../x'"),
            (dict(good, files={k: dict(v, size="9") for k, v in good["files"].items()}),
             "file entry"),
            (dict(good, metadata_file="9.metadata"), "metadata_file '9.metadata' is not"),
            (dict(good, tensors={"w": [4, 6]}), "tensor entry 'w'"),
        ]
        for data, expected in cases:
            with open(marker_path, "w") as f:
                json.dump(data, f)
            with self.assertLogs(logger, "WARNING") as logs:
                self.assertIsNone(latest_complete_checkpoint(self.root), expected)
            self.assertIn(f"completion marker malformed: {expected}", "\n".join(logs.output))
            with self.assertRaisesRegex(CheckpointCorruptError, "marker malformed"):
                load_sharded_checkpoint(zeros(), directory)


    def test_unreadable_files_are_named_not_raised(self):
        directory = save_sharded_checkpoint(whole(arrays(1)), self.root)

        def denied(path):
            raise PermissionError(13, "Permission denied", path)

        with mock.patch.object(listing, "file_digest", denied), \
                self.assertLogs(logger, "WARNING") as logs:
            self.assertIsNone(latest_complete_checkpoint(self.root, verify=True))
        self.assertIn(f"skipping incomplete {directory}: could not be read (PermissionError: "
                      f"[Errno 13] Permission denied: '{directory}", "\n".join(logs.output))
        with mock.patch.object(verify_mod, "_resolve", side_effect=PermissionError(13, "denied")), \
                self.assertRaisesRegex(CheckpointCorruptError, rf"rank 0: {self.root}: could "
                                       r"not be read \(PermissionError"):
            load_sharded_checkpoint(zeros(), self.root)
        with self.assertRaisesRegex(TypeError, "^state_dict must be a dict, got list$"):
            load_sharded_checkpoint([], self.root)
        with self.assertRaisesRegex(TypeError, r"^state_dict\['m'\] is a int"):
            load_sharded_checkpoint({"m": 3}, self.root)

    def test_nested_state_dicts_load_under_dotted_keys(self):
        save_sharded_checkpoint({"model": whole(arrays(1))}, self.root)
        target = {"model": zeros()}
        load_sharded_checkpoint(target, self.root)
        for key, value in arrays(1).items():
            np.testing.assert_array_equal(numpy_of(target["model"])[key], value, err_msg=key)
        with self.assertRaisesRegex(CheckpointMismatchError, r"not in the checkpoint: other\.b, other\.w"):
            load_sharded_checkpoint({"other": zeros()}, self.root)


class TestSaveHygiene(_Dir):
    def leftover(self, uid: int, token: str, age_s: float, heartbeat_age_s: float) -> str:
        """A killed save's directory: a complete shard, a heartbeat."""
        tmp = os.path.join(self.root, commit.tmp_name(uid, token))
        os.makedirs(os.path.join(tmp, commit.STATUS_DIR))
        with open(os.path.join(tmp, f"0_{uid}.distcp"), "wb") as f:
            f.write(b"\0" * 64)
        beat = os.path.join(tmp, commit.STATUS_DIR, "alive_0")
        open(beat, "wb").close()
        now = time.time()
        for path in (os.path.join(tmp, f"0_{uid}.distcp"), tmp):
            os.utime(path, (now - age_s, now - age_s))
        for path in (beat, os.path.join(tmp, commit.STATUS_DIR)):
            os.utime(path, (now - heartbeat_age_s, now - heartbeat_age_s))
        return tmp

    def test_the_next_save_reclaims_what_killed_saves_left(self):
        old = save_mod.STALE_SAVE_S + 60
        dead = self.leftover(3, "dead", old, old)
        alive = self.leftover(4, "alive", old, 0.0)  # its ranks still beat
        starting = self.leftover(5, "starting", 1.0, 1.0)
        with self.assertLogs(logger, "WARNING") as logs:
            saved = save_sharded_checkpoint(whole(arrays(1)), self.root)
        self.assertFalse(os.path.exists(dead), "a killed save's directory stays forever")
        self.assertIn(f"removing {dead}: a save that never committed", "\n".join(logs.output))
        self.assertTrue(os.path.exists(alive), "a live save's directory was removed")
        self.assertTrue(os.path.exists(starting), "a save just starting was removed")
        # ids 4 and 5 are still claimed by those saves; id 3 is free again
        self.assertEqual(os.path.basename(saved), "checkpoint_6")
        self.assertEqual(os.path.basename(save_sharded_checkpoint(
            whole(arrays(2)), self.root, unique_id=3)), "checkpoint_3")

    def test_reclaiming_never_removes_a_committed_checkpoint_however_old(self):
        # an hourly save: every committed checkpoint is older than the
        # reclaim horizon, and only uncommitted temporary directories may go
        old = save_mod.STALE_SAVE_S + 3600
        first = save_sharded_checkpoint(whole(arrays(1)), self.root)
        now = time.time()
        for directory, _, names in os.walk(first):
            for name in names:
                os.utime(os.path.join(directory, name), (now - old, now - old))
            os.utime(directory, (now - old, now - old))
        dead = self.leftover(7, "dead", old, old)
        save_sharded_checkpoint(whole(arrays(2)), self.root)
        self.assertFalse(os.path.exists(dead), "the reclaim pass did not run")
        self.assertTrue(os.path.isdir(first), f"{first} was reclaimed as a dead save")
        target = zeros()
        load_sharded_checkpoint(target, self.root, unique_id=0)
        for key, value in arrays(1).items():
            self.assertTrue(np.array_equal(numpy_of(target)[key], value), key)

    def test_activity_of_a_save_directory(self):
        tmp = os.path.join(self.root, commit.tmp_name(1, "t"))
        self.assertIsNone(commit.last_activity(tmp), "a directory that is gone")
        os.makedirs(tmp)
        os.utime(tmp, (1000.0, 1000.0))
        self.assertEqual(commit.last_activity(tmp), 1000.0, "no status directory yet")
        os.makedirs(os.path.join(tmp, commit.STATUS_DIR))
        beat = os.path.join(tmp, commit.STATUS_DIR, "alive_1")
        open(beat, "wb").close()
        for path, stamp in ((beat, 5000.0), (os.path.join(tmp, commit.STATUS_DIR), 3000.0),
                            (tmp, 1000.0)):
            os.utime(path, (stamp, stamp))
        self.assertEqual(commit.last_activity(tmp), 5000.0, "the newest heartbeat counts")

    def test_a_longer_timeout_waits_longer_before_reclaiming(self):
        age = save_mod.STALE_SAVE_S + 60
        tmp = self.leftover(3, "slow", age, age)
        save_sharded_checkpoint(whole(arrays(1)), self.root, timeout_s=age)
        self.assertTrue(os.path.exists(tmp), "reclaimed before 2 x timeout_s")

    def test_a_reclaimed_save_fails_cleanly_instead_of_recreating_its_directory(self):
        real_start = commit.SaveHandshake.start

        def reclaimed_first(handshake):
            shutil.rmtree(handshake.directory)
            real_start(handshake)

        with mock.patch.object(commit.SaveHandshake, "start", reclaimed_first), \
                self.assertRaisesRegex(CheckpointSaveError, r"rank 0 \(coordinator\): \S+ was "
                                       r"removed before the save started"):
            save_sharded_checkpoint(whole(arrays(1)), self.root)
        self.assertEqual(os.listdir(self.root), [])

    def test_the_loser_of_one_id_raises_save_error_after_the_winners_sweep(self):
        # the winner committed checkpoint_3 and swept the loser's decided
        # directory before the loser freed its shards
        real_rename, real_decide = os.rename, commit.SaveHandshake.decide_failure

        def winner_first(src, dst):
            os.makedirs(os.path.join(dst, "0_3.distcp"))  # not empty: the rename fails
            real_rename(src, dst)

        def decide_then_swept(handshake, message, readers=None):
            real_decide(handshake, message, readers)
            save_mod._sweep_failed(self.root)

        with mock.patch.object(save_mod.os, "rename", winner_first), \
                mock.patch.object(commit.SaveHandshake, "decide_failure", decide_then_swept), \
                self.assertRaisesRegex(CheckpointSaveError, "could not commit: .*checkpoint_3 "
                                       "appeared meanwhile"):
            save_sharded_checkpoint(whole(arrays(1)), self.root, unique_id=3)
        self.assertEqual(os.listdir(self.root), ["checkpoint_3"])


    def test_a_failure_is_swept_only_once_its_ranks_read_it(self):
        # a save of another job committing must not remove a failed save's
        # decision its ranks are still to read (they would then report a
        # silent coordinator after timeout_s instead of the real failure)
        tmp = os.path.join(self.root, commit.tmp_name(7, "lost"))
        handshake = commit.SaveHandshake(tmp, 0, [0, 1, 2], 15.0)
        os.makedirs(tmp)
        handshake.start()
        handshake.stop()
        handshake.decide_failure("rank 2 could not write 2_7.distcp", readers=[1, 2])
        open(os.path.join(handshake.status_dir, "ack_1"), "wb").close()
        save_sharded_checkpoint(whole(arrays(1)), self.root)
        self.assertTrue(os.path.exists(tmp), "swept before rank 2 read the failure")
        open(os.path.join(handshake.status_dir, "ack_2"), "wb").close()
        save_sharded_checkpoint(whole(arrays(1)), self.root)
        self.assertFalse(os.path.exists(tmp), "read by every rank: swept by the next commit")
        # a reader that never acknowledges (died after the decision): swept
        # once the decision is older than twice the coordinator's ack wait
        os.makedirs(tmp)
        handshake.start()
        handshake.stop()
        handshake.decide_failure("rank 1 died", readers=[1])
        save_sharded_checkpoint(whole(arrays(1)), self.root)
        self.assertTrue(os.path.exists(tmp))
        decision = os.path.join(handshake.status_dir, "decision.json")
        old = time.time() - 2 * commit.ACK_WAIT_S - 1
        os.utime(decision, (old, old))
        save_sharded_checkpoint(whole(arrays(1)), self.root)
        self.assertFalse(os.path.exists(tmp))


class TestArguments(_Dir):
    def test_ids_are_non_negative_ints(self):
        for bad in (True, False, np.bool_(True), 1.5, -1, "3", np.float64(2.0), np.int64(-1)):
            with self.assertRaises(ValueError) as info:
                save_sharded_checkpoint(whole(arrays(1)), self.root, unique_id=bad)
            message = str(info.exception)
            self.assertEqual(message, f"unique_id={bad!r}: must be a non-negative int (e.g. "
                             "the step) or None (the newest)")
            with self.assertRaises(ValueError) as info:
                load_sharded_checkpoint(zeros(), self.root, unique_id=bad)
            self.assertEqual(str(info.exception), message)
        self.assertEqual(os.listdir(self.root), [], "a refused save wrote something")
        with self.assertRaisesRegex(ValueError, r"^strict='yes': must be True or False$"):
            load_sharded_checkpoint(zeros(), self.root, strict="yes")

    def test_timeouts_are_finite_and_positive(self):
        for bad in (float("inf"), float("nan"), 0, -1.0, True, "20"):
            with self.assertRaises(ValueError) as info:
                save_sharded_checkpoint(whole(arrays(1)), self.root, timeout_s=bad)
            self.assertEqual(str(info.exception), f"timeout_s={bad!r}: must be a finite "
                             "number of seconds > 0 (default 20)")
        with self.assertRaisesRegex(ValueError, "^keep_last=True: must be a positive int"):
            save_sharded_checkpoint(whole(arrays(1)), self.root, keep_last=True)
        self.assertEqual(os.listdir(self.root), [])
        self.assertEqual(os.path.basename(save_sharded_checkpoint(
            whole(arrays(1)), self.root, timeout_s=np.float32(5.0), unique_id=np.int64(0))),
            "checkpoint_0", "numpy numbers are numbers")


    def test_paths_and_load_keywords_are_checked_first(self):
        for bad in (None, "", 3):
            message = (f"path={bad!r}: must be a directory path (a non-empty str or "
                       "os.PathLike)")
            for call in (lambda: save_sharded_checkpoint(whole(arrays(1)), bad),
                         lambda: load_sharded_checkpoint(zeros(), bad),
                         lambda: latest_complete_checkpoint(bad)):
                with self.assertRaises(TypeError) as info:
                    call()
                self.assertEqual(str(info.exception), message)
        save_sharded_checkpoint(whole(arrays(1)), self.root)
        with mock.patch.object(load_mod, "_read_shards") as read, \
                self.assertRaisesRegex(TypeError, r"^bogus: not an argument of paddle\."
                                       r"distributed\.load_state_dict \(the others it "
                                       r"takes: .*offload"):
            load_sharded_checkpoint(zeros(), self.root, bogus=1)
        read.assert_not_called()
        target = zeros()
        load_sharded_checkpoint(target, self.root, offload=False)  # a real keyword passes
        np.testing.assert_array_equal(numpy_of(target)["w"], arrays(1)["w"])


class TestRanksAgree(_Dir):
    def test_a_rank_finding_no_checkpoint_fails_every_rank_at_once(self):
        save_sharded_checkpoint(whole(arrays(1)), self.root)
        empty = os.path.join(self.root, "nothing_here")
        os.makedirs(empty)
        ranks = ThreadRanks(2, self.root)
        t0 = time.monotonic()
        results = ranks.run(lambda r: load_sharded_checkpoint(
            zeros(), empty if r else self.root))
        self.assertLess(time.monotonic() - t0, AT_ONCE_S)
        for rank in (0, 1):
            self.assertIsInstance(results[rank], FileNotFoundError, f"rank {rank}")
            self.assertIn(f"rank 1: no checkpoint in {empty}", str(results[rank]))
            self.assertIn("rank(s) [1] found no checkpoint", str(results[rank]))

    def test_a_rank_whose_path_does_not_exist_names_it(self):
        save_sharded_checkpoint(whole(arrays(1)), self.root)
        absent = os.path.join(self.root, "absent")
        results = ThreadRanks(2, self.root).run(lambda r: load_sharded_checkpoint(
            zeros(), absent if r else self.root))
        for rank in (0, 1):
            self.assertIsInstance(results[rank], FileNotFoundError, f"rank {rank}")
            self.assertIn(f"rank 1: no checkpoint at {absent}: No such file",
                          str(results[rank]))

    def test_ranks_saving_into_different_paths_fail_at_once_naming_both(self):
        other = os.path.join(self.root, "other")
        ranks = ThreadRanks(2, self.root)
        t0 = time.monotonic()
        with mock.patch.object(ranks, "write", side_effect=AssertionError("wrote")):
            results = ranks.run(lambda r: save_sharded_checkpoint(
                whole(arrays(r)), other if r else self.root, timeout_s=15.0))
        self.assertLess(time.monotonic() - t0, AT_ONCE_S, "waited for a heartbeat timeout")
        for rank in (0, 1):
            error = results[rank]
            self.assertIsInstance(error, CheckpointSaveError, f"rank {rank}: {error!r}")
            self.assertIn(f"created under path {self.root!r}; rank 1 passed path {other!r}",
                          str(error))
            self.assertNotIn("killed or hung", str(error))
        self.assertEqual(os.listdir(self.root), [], "the coordinator removes the attempt")
        self.assertFalse(os.path.exists(other), "rank 1 created a save directory of its own")

    def test_one_rank_with_a_bad_argument_stops_every_rank(self):
        save_sharded_checkpoint(whole(arrays(1)), self.root)
        for call in (
            lambda r: save_sharded_checkpoint(whole(arrays(r)), self.root,
                                              unique_id=-2 if r else None),
            lambda r: load_sharded_checkpoint(zeros(), self.root, unique_id=-2 if r else 0),
        ):
            t0 = time.monotonic()
            results = ThreadRanks(2, self.root).run(call)
            self.assertLess(time.monotonic() - t0, AT_ONCE_S)
            for rank in (0, 1):
                self.assertIsInstance(results[rank], ValueError, f"rank {rank}")
                self.assertEqual(str(results[rank]), "unique_id=-2: must be a non-negative "
                                 "int (e.g. the step) or None (the newest)")
        self.assertEqual(sorted(os.listdir(self.root)), ["checkpoint_0"])

    def test_ranks_with_different_bad_arguments_are_each_named(self):
        bad = {0: -1, 1: True}
        results = ThreadRanks(2, self.root).run(lambda r: save_sharded_checkpoint(
            whole(arrays(r)), self.root, unique_id=bad[r]))
        for rank in (0, 1):
            self.assertIsInstance(results[rank], ValueError, f"rank {rank}")
            self.assertEqual(str(results[rank]), "rank 0: unique_id=-1: must be a non-negative "
                             "int (e.g. the step) or None (the newest); rank 1: unique_id=True: "
                             "must be a non-negative int (e.g. the step) or None (the newest)")
        self.assertEqual(os.listdir(self.root), [])

    def test_a_rank_missing_from_the_load_is_one_clean_error(self):
        save_sharded_checkpoint(whole(arrays(1)), self.root)

        def gloo_timeout(obj, process_group, ranks):
            raise RuntimeError("[gloo] Timed out waiting 30000ms for recv operation\n" * 50)

        with mock.patch.object(common, "ranks_of", lambda g: (0, [0, 1])), \
                mock.patch.object(common, "gather", gloo_timeout), \
                mock.patch.object(load_mod, "_read_shards") as read, \
                self.assertRaisesRegex(RuntimeError, r"^loading \S+: the ranks \[0, 1\] could "
                                       r"not exchange their checks \(RuntimeError: \[gloo\] "
                                       r"Timed out") as info:
            load_sharded_checkpoint(zeros(), self.root)
        read.assert_not_called()
        self.assertLess(len(str(info.exception)), 600, "gloo's text is cut, not repeated")
        self.assertNotIn("\n", str(info.exception), "one line")

    def test_a_dtype_mismatch_on_one_rank_is_refused_on_every_rank(self):
        save_sharded_checkpoint(whole(arrays(1)), self.root)
        results = ThreadRanks(2, self.root).run(lambda r: load_sharded_checkpoint(
            zeros("float64" if r else "float32"), self.root))
        for rank in (0, 1):
            self.assertIsInstance(results[rank], CheckpointMismatchError, f"rank {rank}")
            self.assertIn("rank 1: b: checkpoint dtype float32, here float64",
                          str(results[rank]))
            self.assertNotIn("rank 0:", str(results[rank]))


@unittest.skipIf(paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0,
                 "a GPU is present: Paddle's own path")
class TestCpuResharding(_Dir):
    def test_tensor_cuda_is_left_as_paddle_has_it(self):
        save_sharded_checkpoint(whole(arrays(1)), self.root)
        original = paddle.Tensor.cuda
        seen = {}

        def paddle_load(state_dict, path, **kwargs):
            probe = paddle.zeros([1])
            seen["same"] = probe.cuda() is probe
            raise RuntimeError("planted failure inside Paddle's load")

        with mock.patch.object(load_mod.dist, "load_state_dict", paddle_load), \
                self.assertRaisesRegex(RuntimeError, "planted failure"):
            load_sharded_checkpoint(zeros(), self.root)
        self.assertTrue(seen["same"], "during the load, .cuda() must keep CPU tensors")
        self.assertIs(paddle.Tensor.cuda, original, "the load left Tensor.cuda replaced")
        with self.assertRaises(ValueError):  # Paddle's own answer on a CPU build
            paddle.zeros([1]).cuda()
        target = zeros()
        load_sharded_checkpoint(target, self.root)
        self.assertIs(paddle.Tensor.cuda, original)
        np.testing.assert_array_equal(numpy_of(target)["w"], arrays(1)["w"])

    def test_a_users_own_tensor_cuda_is_put_back_after_the_load(self):
        # The shim is process-wide while the load runs; what was there before
        # (here a user's replacement, not Paddle's method) must come back.
        save_sharded_checkpoint(whole(arrays(1)), self.root)
        had = "cuda" in paddle.Tensor.__dict__
        before = paddle.Tensor.__dict__.get("cuda")

        def restore():
            if had:
                paddle.Tensor.cuda = before
            else:
                del paddle.Tensor.cuda

        def users_cuda(tensor, *args, **kwargs):
            return tensor

        paddle.Tensor.cuda = users_cuda
        self.addCleanup(restore)
        seen = []

        def paddle_load(state_dict, path, **kwargs):
            seen.append(paddle.Tensor.cuda)
            if len(seen) == 2:
                raise RuntimeError("planted failure inside Paddle's load")

        with mock.patch.object(load_mod.dist, "load_state_dict", paddle_load):
            load_sharded_checkpoint(zeros(), self.root)
            self.assertIs(paddle.Tensor.__dict__.get("cuda"), users_cuda)
            with self.assertRaisesRegex(RuntimeError, "planted failure"):
                load_sharded_checkpoint(zeros(), self.root)
        self.assertEqual(seen, [reshard._stay_on_cpu] * 2, "the shim is in place during the load")
        self.assertIs(paddle.Tensor.__dict__.get("cuda"), users_cuda,
                      "the user's Tensor.cuda must be back after a failed load too")

    def test_nested_loads_restore_only_at_the_end(self):
        original = paddle.Tensor.cuda
        with reshard.cpu_resharding():
            with reshard.cpu_resharding():
                self.assertIs(paddle.Tensor.cuda, reshard._stay_on_cpu)
            self.assertIs(paddle.Tensor.cuda, reshard._stay_on_cpu)
        self.assertIs(paddle.Tensor.cuda, original)

    def test_a_gpu_build_is_left_alone(self):
        original = paddle.Tensor.cuda
        with mock.patch.object(reshard, "_needs_cpu_resharding", lambda: False):
            with reshard.cpu_resharding():
                self.assertIs(paddle.Tensor.cuda, original)

    def test_which_builds_need_it(self):
        with mock.patch.object(reshard.paddle, "is_compiled_with_cuda", lambda: False):
            self.assertTrue(reshard._needs_cpu_resharding())
        with mock.patch.object(reshard.paddle, "is_compiled_with_cuda", lambda: True):
            for count, expected in ((0, True), (2, False)):
                with mock.patch.object(reshard.paddle.device.cuda, "device_count",
                                       lambda count=count: count):
                    self.assertEqual(reshard._needs_cpu_resharding(), expected)

            def no_driver():
                raise RuntimeError("no CUDA driver")

            with mock.patch.object(reshard.paddle.device.cuda, "device_count", no_driver):
                self.assertTrue(reshard._needs_cpu_resharding())


if __name__ == "__main__":
    unittest.main()
