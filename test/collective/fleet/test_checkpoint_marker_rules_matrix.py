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
"""The checkpoint commit rules, each over a table, through the commit module's public names.

From docs/DEVELOPING.md ("Checkpoint guarantees") and the module's
docstrings: a committed checkpoint is the directory ``checkpoint_<id>``
(exactly that: no suffix, a non-negative integer id); its completion marker
is a JSON object of the marker format naming ``unique_id`` (an int >= 0,
not a bool), ``files`` (plain names in the directory, each ``{size: int >=
0, sha256: str}``), ``metadata_file`` (one of those files) and ``tensors``
(each ``{global_shape: list, dtype: str}``); anything else is refused naming
the marker file. A failed save's decision is read when every named reader
has acknowledged it (or it is older than the wait), a save has failed only
when its decision says ``ok: false``, and a save's last activity is the
newest time of its directory, its entries and its status files.

A load reads only what the marker vouches for: every file Paddle's
``load_state_dict`` would read (picked by name: ``<id>.metadata``,
``<id>.distcp``, ``<id>.safetensors`` endings) must be listed with its size
and SHA-256, and every listed file must be there; an edited marker is
refused naming the file (``TestEditedMarkersOnLoad``).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
import time
import unittest

import numpy as np

import paddle
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

from muon_checkpoint_helpers import _Dir
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_checkpoint import (
    CheckpointCorruptError,
    latest_complete_checkpoint,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_checkpoint.commit import (
    MARKER,
    MARKER_FORMAT,
    STATUS_DIR,
    checkpoint_id,
    checkpoint_name,
    decision_read,
    failed_save,
    last_activity,
    read_marker,
    tmp_name,
)

GOOD = {
    "format": MARKER_FORMAT,
    "unique_id": 0,
    "files": {"0.metadata": {"size": 10, "sha256": "ab"}, "r0.distcp": {"size": 0, "sha256": ""}},
    "metadata_file": "0.metadata",
    "tensors": {"w": {"global_shape": [2, 3], "dtype": "float32"}},
}


def _with(path, value):
    data = copy.deepcopy(GOOD)
    *parents, last = path
    target = data
    for key in parents:
        target = target[key]
    if value is KeyError:
        del target[last]
    else:
        target[last] = value
    return data


class TestNames(unittest.TestCase):
    def test_checkpoint_ids(self) -> None:
        for uid in (0, 1, 7, 12345):
            self.assertEqual(checkpoint_id(checkpoint_name(uid)), uid)
            self.assertIsNone(checkpoint_id(tmp_name(uid, "abc")), "a save's temporary directory")
        for name in ("checkpoint_", "checkpoint_x", "checkpoint_3.tmp", "checkpoint_3/",
                     "xcheckpoint_3", "checkpoint_-1", "Checkpoint_3", ".checkpoint_3", "",
                     "checkpoint_3 "):
            self.assertIsNone(checkpoint_id(name), repr(name))


class TestMarkerMatrix(unittest.TestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.dir = self._tmp.name

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def _write(self, data, raw=None) -> None:
        with open(os.path.join(self.dir, MARKER), "w") as f:
            f.write(raw if raw is not None else json.dumps(data))

    def test_good_markers_are_read_back(self) -> None:
        for data in (GOOD, _with(("unique_id",), 5), _with(("tensors",), {}),
                     _with(("tensors", "w", "global_shape"), []),
                     _with(("files", "0.metadata", "size"), 0)):
            self._write(data)
            self.assertEqual(read_marker(self.dir), data)

    def test_every_malformed_marker_is_refused_naming_the_file(self) -> None:
        deep = "[" * 100000 + "]" * 100000
        table = [
            (None, "no completion marker"),
            ("raw:{not json", "completion marker unreadable"),
            ("raw:" + deep, "completion marker unreadable"),
            ("raw:[1, 2]", "not a completion marker of format"),
            (_with(("format",), "other/1"), "not a completion marker of format"),
            (_with(("format",), KeyError), "not a completion marker of format"),
            (_with(("unique_id",), KeyError), "lacks 'unique_id'"),
            (_with(("files",), KeyError), "lacks 'files'"),
            (_with(("metadata_file",), KeyError), "lacks 'metadata_file'"),
            (_with(("tensors",), KeyError), "lacks 'tensors'"),
            (_with(("unique_id",), -1), "unique_id -1 is not a non-negative int"),
            (_with(("unique_id",), True), "unique_id True is not a non-negative int"),
            (_with(("unique_id",), "3"), "unique_id '3' is not"),
            (_with(("unique_id",), 2.0), "unique_id 2.0 is not"),
            (_with(("files",), []), "'files' and 'tensors' must be objects"),
            (_with(("tensors",), []), "'files' and 'tensors' must be objects"),
            (_with(("files", "../x"), {"size": 1, "sha256": "a"}), "file entry '../x'"),
            (_with(("files", "."), {"size": 1, "sha256": "a"}), "file entry '.'"),
            (_with(("files", ".."), {"size": 1, "sha256": "a"}), "file entry '..'"),
            (_with(("files", ""), {"size": 1, "sha256": "a"}), "file entry ''"),
            (_with(("files", "r0.distcp", "size"), -1), "file entry 'r0.distcp'"),
            (_with(("files", "r0.distcp", "size"), False), "file entry 'r0.distcp'"),
            (_with(("files", "r0.distcp", "sha256"), 5), "file entry 'r0.distcp'"),
            (_with(("files", "r0.distcp", "sha256"), KeyError), "file entry 'r0.distcp'"),
            (_with(("files", "r0.distcp"), "x"), "file entry 'r0.distcp'"),
            (_with(("metadata_file",), "missing.metadata"),
             "metadata_file 'missing.metadata' is not among the files"),
            (_with(("tensors", "w", "global_shape"), "2,3"), "tensor entry 'w'"),
            (_with(("tensors", "w", "dtype"), 5), "tensor entry 'w'"),
            (_with(("tensors", "w", "dtype"), KeyError), "tensor entry 'w'"),
            (_with(("tensors", "w"), [2, 3]), "tensor entry 'w'"),
        ]
        path = os.path.join(self.dir, MARKER)
        for data, fragment in table:
            if os.path.exists(path):
                os.remove(path)
            if data is not None:
                self._write(None, data[4:]) if isinstance(data, str) else self._write(data)
            with self.assertRaises(ValueError, msg=fragment) as ctx:
                read_marker(self.dir)
            text = str(ctx.exception)
            self.assertIn(path, text)
            self.assertIn(fragment, text)
            self.assertNotIn("\n", text)


class TestSaveStatus(unittest.TestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.dir = self._tmp.name
        self.status = os.path.join(self.dir, STATUS_DIR)

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def _decision(self, data, age_s=0.0, raw=None) -> None:
        os.makedirs(self.status, exist_ok=True)
        path = os.path.join(self.status, "decision.json")
        with open(path, "w") as f:
            f.write(raw if raw is not None else json.dumps(data))
        stamp = time.time() - age_s
        os.utime(path, (stamp, stamp))

    def _ack(self, *ranks) -> None:
        for r in ranks:
            open(os.path.join(self.status, f"ack_{r}"), "w").close()

    def test_failed_save(self) -> None:
        self.assertFalse(failed_save(self.dir), "no decision yet")
        for data, raw, failed in (({"ok": False}, None, True), ({"ok": True}, None, False),
                                  ({"ok": None}, None, False), ({"ok": 0}, None, False),
                                  ({}, None, False), (None, "", False), (None, "[false]", False),
                                  (None, '{"ok": fal', False)):
            self._decision(data, raw=raw)
            self.assertIs(failed_save(self.dir), failed, (data, raw))

    def test_decision_read(self) -> None:
        table = [
            # (decision, age, acks, max age, read)
            ({"ok": False, "readers": [1, 2]}, 0.0, (), 60.0, False),
            ({"ok": False, "readers": [1, 2]}, 0.0, (1,), 60.0, False),
            ({"ok": False, "readers": [1, 2]}, 0.0, (1, 2), 60.0, True),
            ({"ok": False, "readers": [1, 2]}, 120.0, (1,), 60.0, True),   # a reader is gone
            ({"ok": False, "readers": [3]}, 10.0, (), 60.0, False),
            ({"ok": False, "readers": []}, 0.0, (), 60.0, True),
            ({"ok": False}, 0.0, (), 60.0, True),
            ({"ok": False, "readers": "12"}, 0.0, (), 60.0, True),         # not a list
            ({"ok": False, "readers": 7}, 0.0, (), 60.0, True),
        ]
        for decision, age, acks, max_age, read in table:
            if os.path.isdir(self.status):
                for name in os.listdir(self.status):
                    os.remove(os.path.join(self.status, name))
            self._decision(decision, age)
            self._ack(*acks)
            self.assertIs(decision_read(self.dir, max_age), read, (decision, age, acks))
        # no decision at all: nothing to wait for
        os.remove(os.path.join(self.status, "decision.json"))
        self.assertTrue(decision_read(self.dir, 60.0))

    def test_last_activity_is_the_newest_of_directory_entries_and_status_files(self) -> None:
        old = time.time() - 1000
        entry = os.path.join(self.dir, "r0.distcp")
        open(entry, "w").close()
        os.makedirs(self.status)
        beat = os.path.join(self.status, "heartbeat_1")
        open(beat, "w").close()
        for path in (entry, beat, self.status, self.dir):
            os.utime(path, (old, old))
        self.assertAlmostEqual(last_activity(self.dir), old, delta=1e-3)
        for path, stamp in ((entry, old + 10), (beat, old + 20)):
            os.utime(path, (stamp, stamp))
            for folder in (self.status, self.dir):
                os.utime(folder, (old, old))
            self.assertAlmostEqual(last_activity(self.dir), stamp, delta=1e-3, msg=path)
        self.assertIsNone(last_activity(os.path.join(self.dir, "gone")))


def _state(seed: int | None) -> dict:
    """A one-rank state dict: ``w`` (4 x 6) and ``b`` (6,), zeros for None."""
    rng = np.random.default_rng(seed)
    values = {"w": rng.normal(size=(4, 6)), "b": rng.normal(size=(6,))}
    if seed is None:
        values = {k: np.zeros_like(v) for k, v in values.items()}
    return {k: ShardedWeight(k, paddle.to_tensor(v.astype("float32")), v.shape, v.shape,
                             (0,) * v.ndim) for k, v in values.items()}


def _flip_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))


class TestEditedMarkersOnLoad(_Dir):  # a fresh root, one process
    """Each row edits a freshly saved checkpoint_0 (one process): the load is
    refused naming the file, or loads the saved values; ``verify=True``
    listing agrees with the load."""

    @staticmethod
    def _edit_marker(directory: str, change) -> None:
        path = os.path.join(directory, MARKER)
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        change(data["files"])
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)

    def test_the_marker_vouches_for_every_file_paddle_reads(self) -> None:
        shard, other = "0_0.distcp", "1_0.distcp"

        def drop_entry(d):
            self._edit_marker(d, lambda files: files.pop(shard))

        def drop_entry_then_corrupt(d):
            drop_entry(d)
            _flip_byte(os.path.join(d, shard))

        def add_missing(d):
            self._edit_marker(d, lambda files: files.__setitem__(
                other, {"size": 10, "sha256": "0" * 64, "rank": 1}))

        def add_missing_unread(d):
            self._edit_marker(d, lambda files: files.__setitem__(
                "notes.txt", {"size": 3, "sha256": "0" * 64, "rank": None}))

        def grow_size(d):
            self._edit_marker(d, lambda files: files[shard].__setitem__(
                "size", files[shard]["size"] + 1))

        def edit_checksum(d):
            self._edit_marker(d, lambda files: files[shard].__setitem__("sha256", "0" * 64))

        def copy_in(name):
            return lambda d: shutil.copyfile(os.path.join(d, shard), os.path.join(d, name))

        def unread_files(d):
            for name in ("notes.txt", "0_1.distcp", "1.metadata", "0.metadata.bak"):
                with open(os.path.join(d, name), "wb") as f:
                    f.write(b"not read by Paddle")

        # (row, edit, None: loads the saved values | fragments of the error)
        table = [
            ("unedited", lambda d: None, None),
            ("entry removed", drop_entry, (shard, "not listed in checkpoint.complete.json",
                                           "would read it", "ends in '0.distcp'")),
            ("entry removed, shard corrupted", drop_entry_then_corrupt,
             (shard, "not listed in checkpoint.complete.json")),
            ("entry added for a missing file", add_missing,
             (other, "(written by rank 1): missing")),
            ("entry added for a missing file Paddle would not read", add_missing_unread,
             ("notes.txt: missing",)),
            ("size edited", grow_size, (shard, "bytes, the marker says")),
            ("checksum edited", edit_checksum, (shard, "SHA-256 differs from the marker's")),
            ("unlisted data file", copy_in(other), (other, "not listed")),
            ("unlisted metadata of an id ending in the same digits", copy_in("10.metadata"),
             ("10.metadata", "not listed", "ends in '0.metadata'")),
            ("unlisted safetensors file", copy_in("model_0.safetensors"),
             ("model_0.safetensors", "not listed")),
            ("files Paddle does not read for id 0", unread_files, None),
        ]
        for row, edit, fragments in table:
            with self.subTest(row):
                root = tempfile.mkdtemp(dir=self.root)
                directory = save_sharded_checkpoint(_state(1), root)
                edit(directory)
                target = _state(None)
                if fragments is None:
                    self.assertEqual(load_sharded_checkpoint(target, directory), directory)
                    for key, value in _state(1).items():
                        np.testing.assert_array_equal(target[key].local_tensor.numpy(),
                                                      value.local_tensor.numpy())
                    self.assertEqual(latest_complete_checkpoint(root, verify=True), directory)
                    continue
                with self.assertRaises(CheckpointCorruptError) as ctx:
                    load_sharded_checkpoint(target, directory)
                text = str(ctx.exception)
                for fragment in fragments:
                    self.assertIn(fragment, text)
                self.assertIn("nothing was read", text)
                for key, value in target.items():
                    self.assertFalse(value.local_tensor.numpy().any(), f"{key} was read")
                self.assertIsNone(latest_complete_checkpoint(root, verify=True),
                                  "the listing must skip what the load refuses")


if __name__ == "__main__":
    unittest.main()
