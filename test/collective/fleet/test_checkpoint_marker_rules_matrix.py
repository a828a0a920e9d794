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
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import time
import unittest

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


if __name__ == "__main__":
    unittest.main()
