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
"""Checkpoint path types, id listings, marker field types and shared refusals (seconds).

* A ``pathlib.Path`` is a path like its ``str`` (the argument check says
  "a non-empty str or os.PathLike").
* A plain flex_checkpoint directory refuses an id it lacks, naming the ids
  there; a list of a few skipped checkpoints has no "... and N more" line.
* A completion marker whose ``tensors``, a file's ``sha256`` or a tensor's
  ``dtype`` has the wrong type is malformed, naming the field.
* Ranks refusing the same argument get one message naming the ranks, not
  the same line once per rank.
"""

from __future__ import annotations

import json
import os
import pathlib
import unittest

import numpy as np
import paddle
from paddle.distributed.fleet.utils.log_util import logger
from muon_checkpoint_helpers import ThreadRanks, _Dir, arrays, numpy_of, whole

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_checkpoint import commit
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_checkpoint import (
    CheckpointCorruptError,
    latest_complete_checkpoint,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)

class TestPathTypes(_Dir):
    def test_a_pathlib_path_saves_and_loads_like_its_str(self):
        saved = save_sharded_checkpoint(whole(arrays(3)), pathlib.Path(self.root), unique_id=4)
        self.assertEqual(os.path.basename(saved), "checkpoint_4")
        self.assertEqual(os.path.dirname(os.fspath(saved)), self.root)
        self.assertEqual(os.path.basename(latest_complete_checkpoint(pathlib.Path(self.root))),
                         "checkpoint_4")
        target = whole({k: np.zeros_like(v) for k, v in arrays(3).items()})
        load_sharded_checkpoint(target, pathlib.Path(self.root))
        for key, value in arrays(3).items():
            np.testing.assert_array_equal(numpy_of(target)[key], value)


class TestPlainFlexCheckpointIds(_Dir):
    def test_an_id_missing_from_a_plain_flex_checkpoint_names_the_ids_there(self):
        paddle.distributed.save_state_dict(whole(arrays(1)), self.root, unique_id=2)
        target = whole({k: np.zeros_like(v) for k, v in arrays(1).items()})
        with self.assertRaises(FileNotFoundError) as info:
            load_sharded_checkpoint(target, self.root, unique_id=5)
        self.assertEqual(str(info.exception),
                         f"checkpoint id 5 not in {self.root} (ids there: [2]).")
        load_sharded_checkpoint(target, self.root, unique_id=2)
        np.testing.assert_array_equal(numpy_of(target)["w"], arrays(1)["w"])


class TestSkippedList(_Dir):
    def test_a_few_skipped_checkpoints_are_listed_without_a_more_line(self):
        shards = []
        for uid in (0, 1):
            directory = save_sharded_checkpoint(whole(arrays(uid)), self.root, unique_id=uid)
            shards.append(os.path.join(directory, f"0_{uid}.distcp"))
            with open(shards[-1], "r+b") as f:
                f.truncate(10)
        target = whole({k: np.zeros_like(v) for k, v in arrays(0).items()})
        with self.assertRaises(FileNotFoundError) as info:
            load_sharded_checkpoint(target, self.root)
        message = str(info.exception)
        for shard in shards:
            self.assertIn(f"{shard}: 10 bytes", message)
        self.assertNotIn("more", message, "two skipped checkpoints need no '... and N more'")


class TestMarkerFieldTypes(_Dir):
    def test_each_field_of_the_wrong_type_is_named(self):
        directory = save_sharded_checkpoint(whole(arrays(1)), self.root)
        marker_path = os.path.join(directory, commit.MARKER)
        with open(marker_path) as f:
            good = json.load(f)
        some_file = sorted(good["files"])[0]
        cases = [
            (dict(good, tensors=[]), "'files' and 'tensors' must be objects"),
            (dict(good, files=dict(good["files"], **{some_file: dict(
                good["files"][some_file], sha256=7)})), f"file entry {some_file!r}"),
            (dict(good, tensors={k: dict(v, dtype=None) for k, v in good["tensors"].items()}),
             "tensor entry"),
        ]
        for data, expected in cases:
            with self.subTest(expected=expected):
                with open(marker_path, "w") as f:
                    json.dump(data, f)
                with self.assertLogs(logger, "WARNING") as logs:
                    self.assertIsNone(latest_complete_checkpoint(self.root))
                self.assertIn(f"completion marker malformed: {expected}",
                              "\n".join(logs.output))
                with self.assertRaisesRegex(CheckpointCorruptError, "marker malformed"):
                    load_sharded_checkpoint(whole(arrays(1)), directory)


class TestSharedMessages(_Dir):
    def test_ranks_refusing_the_same_argument_get_one_line_naming_them(self):
        results = ThreadRanks(2, self.root).run(lambda r: save_sharded_checkpoint(
            whole(arrays(r)), self.root, unique_id=-1))
        for rank in (0, 1):
            self.assertIsInstance(results[rank], ValueError, f"rank {rank}")
            self.assertEqual(str(results[rank]), "unique_id=-1: must be a non-negative int "
                             "(e.g. the step) or None (the newest) (ranks [0, 1])")
        self.assertEqual(os.listdir(self.root), [])


if __name__ == "__main__":
    unittest.main()
