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
"""``paddle-muon-ext hangs LOG_DIR`` (and ``tools/muon_comm.py hangs``) on dumps."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from contextlib import redirect_stdout
from unittest import mock

from tool_loader import REPO_ROOT

from paddle_muon_ext import cli
from paddle_muon_ext.distributed.fleet.meta_optimizers import muon_flight_recorder as fr
from paddle_muon_ext.tools import hangs

CULPRIT = "is the rank the others wait for"


def _entry(op, gid, ranks, group_seq, phase, finished, root=None, seq=0):
    return {"seq": seq, "group_seq": group_seq, "phase": phase, "op": op, "group_id": gid,
            "group_ranks": ranks, "root": root, "dtype": "float32", "numel": 8,
            "start": 1.0, "finish": 2.0 if finished else None}


def _two_rank_states():
    # Rank 1 waits in reduce #2 on [1, 3]; rank 3 issued only 2 there.
    key = (7, (1, 3))
    return {
        1: fr.RankState(1, "cross_node_reduce",
                        [_entry("reduce", 7, [1, 3], 2, "cross_node_reduce", False, root=3)],
                        {key: 3}),
        3: fr.RankState(3, "cross_node_reduce", [], {key: 2},
                        _entry("reduce", 5, [2, 3], 4, "intra_node_reduce", True)),
    }


class TestHangsTool(unittest.TestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="muon_hangs_")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def _write(self, rank: int, state: fr.RankState, reason: str = "SIGUSR1",
               when: float = 1000.0) -> None:
        entries = list(state.in_flight) + ([state.last_finished] if state.last_finished else [])
        data = {"format": fr.DUMP_FORMAT, "rank": rank, "world_size": 4, "pid": 1, "host": "h",
                "reason": reason, "phase": state.phase, "entries": entries, "time": when,
                "issued": [{"group_id": k[0], "group_ranks": list(k[1]), "count": n}
                           for k, n in state.issued.items()]}
        with open(fr.dump_path(self.dir, rank), "w") as f:
            json.dump(data, f)

    def _run(self, argv):
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), mock.patch("sys.stderr", err):
            code = hangs.main(argv)
        return code, out.getvalue(), err.getvalue()

    def test_reports_culprit_from_dumps(self) -> None:
        for rank, state in _two_rank_states().items():
            self._write(rank, state)
        code, out, _ = self._run([self.dir])
        self.assertEqual(code, 0)
        self.assertIn(f"rank 3 {CULPRIT}: in phase 'cross_node_reduce'", out)
        self.assertIn("rank 1 (pid 1, h): phase 'cross_node_reduce', in reduce #2", out)

    def test_dumps_from_different_jobs_are_pointed_out(self) -> None:
        states = _two_rank_states()
        self._write(1, states[1], when=1000.0)
        self._write(3, states[3], when=5000.0)
        code, out, _ = self._run([self.dir])
        self.assertEqual(code, 0)
        self.assertIn("note: the dumps were written 4000 s apart", out)

    def test_bad_inputs_are_errors(self) -> None:
        cases = {"missing": os.path.join(self.dir, "nope"), "empty": self.dir}
        for label, path in cases.items():
            code, _, err = self._run([path])
            self.assertEqual(code, 2, label)
            self.assertTrue(err.startswith("error: log dir"), (label, err))
        with open(fr.dump_path(self.dir, 0), "w") as f:
            f.write("{not json")
        code, _, err = self._run([self.dir])
        self.assertEqual(code, 2)
        self.assertIn("unreadable", err)

    def test_entry_points(self) -> None:
        for rank, state in _two_rank_states().items():
            self._write(rank, state)
        out = io.StringIO()
        with redirect_stdout(out):
            self.assertEqual(cli.main(["hangs", self.dir]), 0)
        self.assertIn(CULPRIT, out.getvalue())
        proc = subprocess.run(
            [sys.executable, os.path.join(REPO_ROOT, "tools", "muon_comm.py"), "hangs", self.dir],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                [os.path.join(REPO_ROOT, "python"), os.environ.get("PYTHONPATH", "")])})
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertIn(f"rank 3 {CULPRIT}", proc.stdout)


if __name__ == "__main__":
    unittest.main()
