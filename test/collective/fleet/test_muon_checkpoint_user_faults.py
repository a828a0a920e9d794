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
"""Checkpoint faults a user's MoE script meets: each is refused or survived on every rank.

Ranks as threads (``ThreadRanks``), seconds in all:

* ``TestDifferentReplicas``: an expert-parallel model whose
  ``sharded_state_dict()`` describes each rank's experts as the whole tensor
  gave every rank the same expert after a reload (flex_checkpoint writes a
  piece several ranks hold once). Such saves are refused on every rank,
  naming the key and the ranks, before a byte is written; real replicas and
  properly offset shards still save.
* ``TestLoadOnAFullDisk``: a rank that cannot reserve its load-guard files
  (a disk a failed save filled) made every rank wait 20 s and fail with
  "stopped responding"; now the ranks agree to load unsupervised at once.
* ``TestCommitFailures``: the marker on a full disk, a rename the file
  system refuses (was reported as "appeared meanwhile (another save of the
  same id?)" whatever the errno); the previous checkpoint stays the newest.
* ``TestCommitRace``: a failed commit rename with something at the final
  path (or EEXIST / ENOTEMPTY) is a lost race, whatever the errno.
* ``TestVerifiedListing``: ``latest_complete_checkpoint(verify=True)``
  returned a checkpoint whose marker was altered, which the load refuses.
* ``TestMalformedArguments``: a ``ShardedWeight`` whose local tensor does
  not match its ``local_shape`` or that reaches past its global shape was
  saved as given (a checkpoint that loads wrong values); a
  ``process_group`` that is no group raised ``AttributeError: 'str' object
  has no attribute 'ranks'``.
* ``TestSameCheckpointSpelledDifferently``: ``ckpt`` and ``ckpt/../ckpt``
  on two ranks were refused as "a save committed meanwhile".

The same full disk on real gloo ranks: ``test_muon_checkpoint_faults.py``
(``reload_on_full_disk``).
"""

from __future__ import annotations

import errno
import os
import time
import unittest
from unittest import mock

import numpy as np

import paddle
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

from muon_checkpoint_helpers import ThreadRanks, _Dir, arrays, whole

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_checkpoint import (
    load_guard as guard_mod,
    replicas,
    save as save_mod,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_checkpoint import (
    CheckpointSaveError,
    latest_complete_checkpoint,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)

AT_ONCE_S = 8.0


def committed(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("checkpoint_"))


def rows_of(values: dict, rank: int, world: int = 2) -> dict:
    """Rank ``rank``'s rows of every tensor, with their global offsets."""
    out = {}
    for key, full in values.items():
        rows = full.shape[0] // world
        local = full[rank * rows:(rank + 1) * rows].copy()
        out[key] = ShardedWeight(key, paddle.to_tensor(local), local.shape, full.shape,
                                 (rank * rows,) + (0,) * (full.ndim - 1))
    return out


class TestDifferentReplicas(_Dir):
    def save(self, state_of, **kwargs) -> dict:
        """Both ranks save ``state_of(rank)`` through the real ``_write_shards``
        (its replica check), with Paddle's writer replaced by the fake one."""
        ranks = ThreadRanks(2, self.root)
        fake = ranks.write
        ranks.write = save_mod._write_shards
        writer = lambda sd, d, process_group=None, unique_id=None: fake(  # noqa: E731
            sd, d, process_group, unique_id)
        with mock.patch.object(save_mod.dist, "save_state_dict", writer):
            return ranks.run(lambda r: save_sharded_checkpoint(
                state_of(r), self.root, timeout_s=15.0, **kwargs))

    def test_saves_of_different_replicas_are_refused_or_kept(self):
        base = arrays(0)
        one_off = {k: v.copy() for k, v in base.items()}
        one_off["b"][3] += 1e-6  # one element of a small tensor: compared whole
        cases = [
            # (name, state of rank r, refused keys or None for a commit)
            ("experts described whole on every rank", lambda r: whole(arrays(r)),
             ["b (offset [0], shape [6])", "w (offset [0, 0], shape [4, 6])"]),
            ("one element differs", lambda r: whole(one_off if r else base),
             ["b (offset [0], shape [6])"]),
            ("nested keys", lambda r: {"opt": whole(arrays(r))},
             ["opt.b (offset [0]", "opt.w (offset [0, 0]"]),
            ("true replicas", lambda r: whole(base), None),
            ("each rank its rows", lambda r: rows_of(arrays(r), r), None),
        ]
        for name, state_of, refused in cases:
            with self.subTest(name):
                before = committed(self.root)
                t0 = time.monotonic()
                results = self.save(state_of)
                self.assertLess(time.monotonic() - t0, AT_ONCE_S, "waited for a timeout")
                if refused is None:
                    for rank in (0, 1):
                        self.assertIsInstance(results[rank], str, f"rank {rank}: {results[rank]!r}")
                    self.assertEqual(len(committed(self.root)), len(before) + 1)
                    continue
                for rank in (0, 1):
                    error = results[rank]
                    self.assertIsInstance(error, CheckpointSaveError, f"rank {rank}: {error!r}")
                    for key in refused:
                        self.assertIn(key, str(error))
                    self.assertIn("held with different values by ranks [0]; ranks [1]",
                                  str(error))
                self.assertEqual(committed(self.root), before, "nothing may be committed")

    def test_a_rank_that_cannot_fingerprint_does_not_fail_the_save(self):
        real = replicas.fingerprints
        ranks_seen = []

        def broken_on_rank_1(state_dict, prefix=""):
            rank = save_mod.common.ranks_of(None)[0]
            ranks_seen.append(rank)
            if rank == 1:
                raise RuntimeError("no sample here")
            return real(state_dict, prefix)

        with mock.patch.object(replicas, "fingerprints", broken_on_rank_1):
            results = self.save(lambda r: whole(arrays(0)))
        for rank in (0, 1):
            self.assertIsInstance(results[rank], str, f"rank {rank}: {results[rank]!r}")
        self.assertEqual(sorted(ranks_seen), [0, 1])

    def test_a_large_tensor_is_compared_by_a_strided_sample(self):
        big = np.arange(3 * replicas.SAMPLE, dtype="float32")
        other = big.copy()
        other[::3] += 1.0  # every sampled element differs (stride 3)
        same_sample = big.copy()
        same_sample[1] += 1.0  # between two sampled elements
        fp = lambda a: replicas.fingerprints({"x": paddle.to_tensor(a)})  # noqa: E731
        self.assertNotEqual(list(fp(big).values())[0][0], list(fp(other).values())[0][0])
        self.assertEqual(list(fp(big).values())[0][0], list(fp(same_sample).values())[0][0],
                         "the sample is strided: a documented blind spot, not a full hash")
        # a tensor the device-side sample fails on is sampled on the host
        with mock.patch.object(replicas.paddle, "gather", side_effect=RuntimeError("place")):
            self.assertEqual(list(fp(big).values())[0][0], list(fp(same_sample).values())[0][0])
            self.assertNotEqual(list(fp(big).values())[0][0], list(fp(other).values())[0][0])
        zero = replicas.fingerprints({"z": paddle.zeros([0, 3])})
        self.assertEqual(list(zero.values())[0][1], ("z", (0, 0), (0, 3), ()))


class TestLoadOnAFullDisk(_Dir):
    def test_ranks_load_unsupervised_when_one_cannot_reserve_its_guard_files(self):
        save_sharded_checkpoint(whole(arrays(0)), self.root)
        real_start = guard_mod.LoadGuard.start
        ranks = ThreadRanks(2, self.root)

        def start(guard):
            if ranks.local.rank == 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_start(guard)

        read = []
        ranks.read = lambda *args, **kwargs: read.append("read")  # any thread
        t0 = time.monotonic()
        with mock.patch.object(guard_mod.LoadGuard, "start", start):
            results = ranks.run(lambda r: load_sharded_checkpoint(
                whole({k: np.zeros_like(v) for k, v in arrays(0).items()}), self.root))
        self.assertLess(time.monotonic() - t0, AT_ONCE_S, "a rank waited for a heartbeat")
        for rank in (0, 1):
            self.assertEqual(results[rank], os.path.join(self.root, "checkpoint_0"),
                             f"rank {rank}: {results[rank]!r}")
        self.assertEqual(read, ["read", "read"], "every rank reads")
        self.assertEqual([n for n in os.listdir(self.root) if n.startswith(".muon_load")], [],
                         "rank 0's reserved guard files are removed")

    def test_the_outcome_is_written_into_the_reserved_room(self):
        save_sharded_checkpoint(whole(arrays(0)), self.root)
        ranks = ThreadRanks(2, self.root)
        written = []
        real_open = open

        def no_new_files(path, mode="r", *args, **kwargs):
            # after the reservation every write goes into an existing file
            if "outcome" in str(path) or "slot" in str(path):
                written.append((os.path.basename(path), mode))
            return real_open(path, mode, *args, **kwargs)

        with mock.patch.object(guard_mod, "open", no_new_files, create=True):
            results = ranks.run(lambda r: load_sharded_checkpoint(
                whole({k: np.zeros_like(v) for k, v in arrays(0).items()}), self.root))
        for rank in (0, 1):
            self.assertIsInstance(results[rank], str, f"rank {rank}: {results[rank]!r}")
        writes = [(name, mode) for name, mode in written if "w" in mode or "+" in mode]
        self.assertEqual(sorted(writes), [("slot_0", "r+b"), ("slot_0", "wb"),
                                          ("slot_1", "r+b"), ("slot_1", "wb")],
                         "only the reservation may create a file")


class TestSameCheckpointSpelledDifferently(_Dir):
    def test_a_path_with_dot_dot_loads_the_same_checkpoint(self):
        save_sharded_checkpoint(whole(arrays(0)), self.root)
        alias = os.path.join(self.root, "..", os.path.basename(self.root))
        results = ThreadRanks(2, self.root).run(lambda r: load_sharded_checkpoint(
            whole({k: np.zeros_like(v) for k, v in arrays(0).items()}),
            alias if r else self.root, unique_id=0))
        for rank in (0, 1):
            self.assertIsInstance(results[rank], str, f"rank {rank}: {results[rank]!r}")


class TestCommitFailures(_Dir):
    def test_a_failing_commit_names_its_cause_and_keeps_the_previous_checkpoint(self):
        first = save_sharded_checkpoint(whole(arrays(0)), self.root)
        cases = [
            # (name, patcher, fragments, fragment that must not appear)
            ("marker on a full disk",
             mock.patch.object(save_mod, "write_json_atomic",
                               side_effect=OSError(errno.ENOSPC, "No space left on device",
                                                   "checkpoint.complete.json")),
             ["rank 0 (coordinator) could not commit", "No space left on device",
              "checkpoint.complete.json"], None),
            ("rename refused by the file system",
             mock.patch.object(save_mod.os, "rename",
                               side_effect=OSError(errno.EIO, "Input/output error")),
             ["could not commit: renaming", "failed: OSError: [Errno 5] Input/output error"],
             "appeared meanwhile"),
        ]
        for name, patcher, fragments, absent in cases:
            with self.subTest(name):
                with patcher:
                    results = ThreadRanks(2, self.root).run(lambda r: save_sharded_checkpoint(
                        whole(arrays(0)), self.root, timeout_s=15.0))
                for rank in (0, 1):
                    error = results[rank]
                    self.assertIsInstance(error, CheckpointSaveError, f"rank {rank}: {error!r}")
                    for fragment in fragments:
                        self.assertIn(fragment, str(error))
                    if absent:
                        self.assertNotIn(absent, str(error), "a refused rename is no race")
                self.assertEqual(committed(self.root), ["checkpoint_0"])
                self.assertEqual(latest_complete_checkpoint(self.root), first)


class TestCommitRace(_Dir):
    def test_something_at_the_final_path_reads_as_a_race_whatever_the_errno(self):
        """A failed commit rename is a lost race when the errno says the target
        exists or something is at the final path (either suffices); only
        otherwise did the file system refuse the rename."""
        real_rename = os.rename
        race = "appeared meanwhile (another save of the same id?)"
        refused = "could not commit: renaming"
        # (row, errno, something at the final path, expected, not expected)
        table = [
            ("EIO, a directory appeared at the final path", errno.EIO, True, race, refused),
            ("EEXIST, nothing at the final path", errno.EEXIST, False, race, refused),
            ("ENOTEMPTY, a directory at the final path", errno.ENOTEMPTY, True, race, refused),
            ("EIO, nothing at the final path", errno.EIO, False, refused, race),
            ("EXDEV, nothing at the final path", errno.EXDEV, False, refused, race),
        ]
        for row, code, appeared, expected, unexpected in table:
            with self.subTest(row):
                root = os.path.join(self.root, str(code) + ("_appeared" if appeared else ""))

                def rename(src, dst, code=code, appeared=appeared):
                    if os.path.basename(dst).startswith("checkpoint_"):
                        if appeared:
                            os.makedirs(dst)
                        raise OSError(code, os.strerror(code))
                    return real_rename(src, dst)

                with mock.patch.object(save_mod.os, "rename", side_effect=rename):
                    with self.assertRaises(CheckpointSaveError) as ctx:
                        save_sharded_checkpoint(whole(arrays(0)), root)
                text = str(ctx.exception)
                self.assertIn(expected, text)
                self.assertIn(f"[Errno {code}] {os.strerror(code)}", text)
                self.assertNotIn(unexpected, text)
                self.assertEqual(os.path.isdir(os.path.join(root, "checkpoint_0")), appeared)
                self.assertIsNone(latest_complete_checkpoint(root), "nothing was committed")


class TestVerifiedListing(_Dir):
    def test_an_altered_marker_is_skipped_as_the_load_refuses_it(self):
        first = save_sharded_checkpoint(whole(arrays(0)), self.root)
        second = save_sharded_checkpoint(whole(arrays(1)), self.root)
        marker = os.path.join(second, "checkpoint.complete.json")
        with open(marker, encoding="utf-8") as f:
            text = f.read()
        self.assertIn('"float32"', text)
        with open(marker, "w", encoding="utf-8") as f:
            f.write(text.replace('"float32"', '"float64"', 1))  # one dtype in the summary
        with self.assertRaisesRegex(Exception, "layout summary differs"):
            load_sharded_checkpoint(whole({k: np.zeros_like(v) for k, v in arrays(0).items()}),
                                    self.root, unique_id=1)
        self.assertEqual(latest_complete_checkpoint(self.root, verify=True), first,
                         "verify=True must skip what the load refuses")
        self.assertEqual(latest_complete_checkpoint(self.root), second,
                         "without verify only marker, ids and sizes are checked (documented)")


class TestMalformedArguments(_Dir):
    def test_sharded_weights_that_describe_no_piece_are_refused_naming_the_key(self):
        ones = paddle.ones([4])
        cases = [
            ("local tensor of another size", ShardedWeight("q", ones, (5,), (5,), (0,)),
             "state_dict['q']: the local tensor holds 4 elements (shape [4]), local_shape [5]"),
            ("past the global shape", ShardedWeight("q", ones, (4,), (4,), (3,)),
             "dimension 0: offset 3 + local size 4 lies outside the global size 4"),
            ("negative offset", ShardedWeight("q", ones, (4,), (8,), (-1,)),
             "offset -1 + local size 4 lies outside the global size 8"),
            ("ranks of the shapes differ", ShardedWeight("q", ones, (4,), (2, 4), (0, 0)),
             "must have one entry per dimension"),
            ("flattened range longer than the tensor",
             ShardedWeight("q", ones, (2, 3), (2, 3), (0, 0), True, slice(0, 5)),
             "the local tensor holds 4 elements, flattened_range slice(0, 5, None) names 5"),
            ("flattened range past the local shape",
             ShardedWeight("q", ones, (2, 3), (2, 3), (0, 0), True, slice(4, 8)),
             "flattened_range slice(4, 8, None) must lie within the 6 local elements"),
        ]
        for name, value, fragment in cases:
            with self.subTest(name):
                with self.assertRaises(CheckpointSaveError) as ctx:
                    save_sharded_checkpoint({"q": value}, self.root)
                self.assertIn(fragment, str(ctx.exception))
                self.assertEqual(os.listdir(self.root), [], "nothing may be written")
        # what the package's own states look like stays accepted: stored 2-D,
        # described 3-D; a flattened slice; a 0-d and an empty tensor
        fine = {
            "experts": ShardedWeight("experts", paddle.ones([4, 3]), (2, 2, 3), (4, 2, 3),
                                     (2, 0, 0)),
            "slice": ShardedWeight("slice", paddle.ones([2]), (2, 3), (2, 3), (0, 0), True,
                                   slice(4, 6)),
            "scalar": paddle.to_tensor(1.0),
            "empty": paddle.zeros([0, 3]),
        }
        self.assertTrue(save_sharded_checkpoint(fine, self.root).endswith("checkpoint_0"))

    def test_a_process_group_that_is_no_group_is_named(self):
        for bad in ("x", 3, object()):
            with self.subTest(bad=bad):
                with self.assertRaisesRegex(TypeError, r"process_group=.*: must be a "
                                            r"paddle.distributed Group"):
                    save_sharded_checkpoint(whole(arrays(0)), self.root, process_group=bad)
                with self.assertRaisesRegex(TypeError, r"process_group=.*: must be a "
                                            r"paddle.distributed Group"):
                    load_sharded_checkpoint(whole(arrays(0)), self.root, process_group=bad)


if __name__ == "__main__":
    unittest.main()
