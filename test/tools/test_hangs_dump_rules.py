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
"""``paddle-muon-ext hangs`` on synthetic dumps, as behaviour tables.

* which dumps are refused (a rank, group member or root at or past the world size);
* what the verdict says of each blamed rank (its last finished collective) and
  of each exception text (a timeout is a hang's symptom, an error a crash);
* a peer that already left the collective the others wait in is named;
* the first dump of a rank is the evidence, its later dumps are listed;
* the report prints under an ASCII locale.
"""

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

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_flight import recorder as fr
from paddle_muon_ext.tools import hangs

CULPRIT = "is the rank the others wait for"
KEY = (7, (0, 1))


def _entry(group_seq: int, finished: bool, op: str = "reduce", gid: int = 7,
           ranks: tuple = (0, 1), root: int | None = 0, phase: str = "cross_node_reduce",
           seq: int = 0) -> dict:
    return {"seq": seq, "group_seq": group_seq, "phase": phase, "op": op, "group_id": gid,
            "group_ranks": list(ranks), "root": root, "dtype": "float32", "numel": 8,
            "start": 1.0, "finish": 2.0 if finished else None}


def _dump(rank: int, entries: list, issued: dict, reason: str = "SIGUSR1", world: int = 2,
          phase: str | None = "cross_node_reduce", when: float = 1000.0, pid: int = 1,
          stacks: list | None = None) -> dict:
    data = {"format": fr.DUMP_FORMAT, "rank": rank, "world_size": world, "pid": pid,
            "host": "h", "time": when, "reason": reason, "phase": phase, "entries": entries,
            "issued": [{"group_id": k[0], "group_ranks": list(k[1]), "count": n}
                       for k, n in issued.items()]}
    if stacks is not None:
        data["stacks"] = stacks
    return data


class _DumpDir(unittest.TestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="muon_hangs_rules_")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def _clear(self) -> None:
        for name in os.listdir(self.dir):
            os.remove(os.path.join(self.dir, name))

    def _write(self, data: dict, name: str | None = None) -> str:
        path = os.path.join(self.dir, name) if name else fr.dump_path(self.dir, data["rank"])
        with open(path, "w") as f:
            json.dump(data, f)
        return path

    def _run(self, *flags: str) -> tuple:
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), mock.patch("sys.stderr", err):
            code = hangs.main([self.dir, *flags])
        return code, out.getvalue(), err.getvalue()


class TestRanksAtTheWorldSizeAreRefused(_DumpDir):
    def test_a_rank_member_or_root_equal_to_the_world_size_is_refused(self) -> None:
        """Ranks are 0..world_size-1: a dump naming rank == world_size (as its own
        rank, a group member or a root) is refused naming the field, so no
        nonexistent rank is ever blamed; world_size - 1 is accepted."""
        rows = [
            # (label, rank, entry edits, issued ranks, refused with)
            ("root == world", 1, {"root": 2}, (0, 1), "field 'entries[0].root' is 2, "
             "outside world_size 2"),
            ("group member == world", 1, {"group_ranks": [1, 2]}, (0, 1),
             "field 'entries[0].group_ranks' names rank 2, outside world_size 2"),
            ("issued member == world", 1, {}, (1, 2),
             "field 'issued[0].group_ranks' names rank 2, outside world_size 2"),
            ("rank == world", 2, {}, (0, 1), "field 'rank' is 2, expected < world_size 2"),
            ("root == world - 1", 1, {"root": 1}, (0, 1), None),
        ]
        for label, rank, edits, issued_ranks, refused in rows:
            with self.subTest(label):
                self._clear()
                entry = {**_entry(0, False), **edits}
                self._write(_dump(rank, [entry], {(7, issued_ranks): 1}),
                            name=f"{fr.DUMP_PREFIX}{rank}.json")
                code, out, err = self._run()
                if refused is None:
                    self.assertEqual((code, err), (0, ""), err)
                    continue
                self.assertEqual((code, out), (2, ""), err)
                self.assertIn(refused, err)
                self.assertEqual(len(err.splitlines()), 1, err)


class TestVerdictDetails(_DumpDir):
    def test_each_blamed_rank_is_reported_with_its_last_finished_collective(self) -> None:
        """A blamed rank's line names its most recent finished collective (the
        last of several in its ring buffer), or 'none recorded' when it has none."""
        finished = [_entry(g, True, op=op, gid=5, ranks=(1, 2), root=None, seq=g)
                    for g, op in enumerate(("all_gather", "broadcast", "reduce_scatter"))]
        rows = [
            ("three finished, the last named", finished,
             "its last finished collective: reduce_scatter #2 on group 5 [1, 2] ("),
            ("one finished", finished[:1],
             "its last finished collective: all_gather #0 on group 5 [1, 2] ("),
            ("none finished", [], "its last finished collective: none recorded"),
        ]
        for label, entries, expected in rows:
            with self.subTest(label):
                self._clear()
                # rank 0 waits in reduce #3 on [0, 1]; rank 1 issued 3 there
                self._write(_dump(0, [_entry(3, False)], {KEY: 4}, world=3))
                self._write(_dump(1, entries, {KEY: 3, (5, (1, 2)): len(entries)}, world=3))
                code, out, _ = self._run()
                self.assertEqual(code, 0, out)
                culprit = [ln for ln in out.splitlines() if CULPRIT in ln]
                self.assertEqual(len(culprit), 1, out)
                self.assertTrue(culprit[0].startswith(f"rank 1 {CULPRIT}"), out)
                # one collective named: the clause runs to the end of the line
                self.assertEqual(culprit[0].count("its last finished collective: "), 1)
                self.assertIn(expected, culprit[0].split("; ")[-1])

    def test_what_an_exception_text_says_decides_hang_or_crash(self) -> None:
        """Rank 0 raised in the reduce it waits in, rank 1 never issued it: an
        exception text that says the wait timed out is a hang (rank 1 blamed,
        rank 0's timeout a symptom); one that says a peer went away is a death;
        anything else a crash naming rank 0."""
        rows = [
            ("gloo TIMEOUT", "[unbound_buffer.cc:81] TIMEOUT self_rank = 0", "hang", "timeout"),
            ("Timed out", "Timed out waiting 1800000ms for recv operation", "hang", "timeout"),
            ("timed out lower", "socket timed out after 30 s", "hang", "timeout"),
            ("time out", "wait time out on peer 1", "hang", "timeout"),
            ("deadline", "Deadline Exceeded", "hang", "timeout"),
            ("closed by peer", "Connection closed by peer [127.0.0.1]:4021", "crash",
             "peer_lost"),
            ("reset", "connection reset", "crash", "peer_lost"),
            ("error", "simulated transport failure", "crash", "error"),
        ]
        for label, message, verdict, kind in rows:
            with self.subTest(label):
                reason = ("reduce on group [0, 1] (phase 'cross_node_reduce') raised "
                          f"RuntimeError: {message}")
                dumps = {0: _dump(0, [_entry(3, False)], {KEY: 4}, reason=reason),
                         1: _dump(1, [], {KEY: 3})}
                res = hangs.classify(dumps)
                self.assertEqual((res["kind"], res["raised"][0]["kind"]), (verdict, kind),
                                 res["lines"])
                if verdict == "hang":
                    self.assertEqual(res["culprits"], [1], res["lines"])
                    self.assertIn("  rank 0 raised when a collective timed out: a symptom "
                                  "of the hang, not its cause", res["lines"])
                elif kind == "error":
                    self.assertEqual(res["culprits"], [0], res["lines"])
                    self.assertTrue(res["lines"][0].startswith(
                        "not a hang: a crash: rank 0 raised RuntimeError in op reduce"),
                        res["lines"])


class TestPeerThatLeftTheCollective(_DumpDir):
    def test_a_peer_that_left_the_collective_is_named(self) -> None:
        """Rank 0 waits in reduce #3 on [0, 1], which every peer issued: a peer
        that is no longer in it (in no collective, or already in a later one)
        is named as having left it, with where it is now; only when every
        peer is still inside do the ranks wait on each other."""
        waiting = _entry(3, False)
        later = _entry(4, False, seq=9)
        gather = _entry(0, False, op="all_gather", gid=8, ranks=(0, 1, 2), root=None)
        key3 = (8, (0, 1, 2))
        rows = [
            # (label, dumps, first verdict line, a detail line or None)
            ("peer in no collective",
             [_dump(0, [waiting], {KEY: 4}), _dump(1, [_entry(3, True)], {KEY: 4},
                                                   phase="optimizer_step")],
             "rank 1 has left the collective the others wait in: rank 0 waits in reduce #3 "
             "on group 7 [0, 1] (root 0, float32, numel 8, phase 'cross_node_reduce'), "
             "which it issued and is no longer in",
             "  rank 1 is now in no collective, in phase 'optimizer_step'; its last "
             "finished collective: reduce #3 on group 7 [0, 1]"),
            ("peer in a later collective",
             [_dump(0, [waiting], {KEY: 4}), _dump(1, [later], {KEY: 5})],
             "rank 1 has left the collective the others wait in: rank 0 waits in reduce #3",
             "  rank 1 is now waiting in reduce #4 on group 7 [0, 1]"),
            ("two wait, the third left",
             [_dump(0, [gather], {key3: 1}, world=3), _dump(1, [gather], {key3: 1}, world=3),
              _dump(2, [], {key3: 1}, world=3, phase=None)],
             "rank 2 has left the collective the others wait in: ranks 0, 1 wait in "
             "all_gather #0 on group 8 [0, 1, 2]",
             "  rank 2 is now in no collective, outside any phase; its last finished "
             "collective: none recorded"),
            ("both still inside",
             [_dump(0, [waiting], {KEY: 4}), _dump(1, [waiting], {KEY: 4})],
             "no rank is outside a collective: ranks 0, 1 wait on each other", None),
        ]
        for label, dumps, first, detail in rows:
            with self.subTest(label):
                self._clear()
                for data in dumps:
                    self._write(data)
                code, out, _ = self._run()
                self.assertEqual(code, 0, out)
                lines = out.splitlines()
                verdict = [ln for ln in lines if not ln.startswith(" ")][1:]
                self.assertEqual(len(verdict), 1, out)
                self.assertTrue(verdict[0].startswith(first), out)
                if detail is None:
                    continue
                self.assertNotIn("wait on each other", out)
                self.assertTrue(any(ln.startswith(detail) for ln in lines), out)
                res = hangs.classify(hangs.load_dumps(self.dir))
                self.assertEqual((res["kind"], res["culprits"]),
                                 ("hang", [int(first.split()[1])]), res["lines"])


class TestLaterDumpsOfAStall(_DumpDir):
    TIMEOUT = ("collective timeout: reduce #3 on group 7 [0, 1] (phase 'cross_node_reduce') "
               "in flight for 3.1 s > PADDLE_MUON_FLIGHT_TIMEOUT=3")
    GLOO = ("reduce on group [0, 1] (phase 'cross_node_reduce') raised RuntimeError: "
            "[unbound_buffer.cc:81] Timed out waiting for recv")

    def _stall(self) -> None:
        """Rank 0 timed out in reduce #3 that rank 1 never issued; 25 s later
        gloo's timeout and the exception hook dumped rank 0 again and asked
        rank 1 again."""
        waiting = [_entry(3, False)]
        self._write(_dump(0, waiting, {KEY: 4}, reason=self.TIMEOUT, when=1000.0))
        self._write(_dump(0, waiting, {KEY: 4}, reason=self.GLOO, when=1025.0),
                    name=f"{fr.DUMP_PREFIX}0.2.json")
        self._write(_dump(0, waiting, {KEY: 4}, reason="uncaught RuntimeError: Timed out",
                          when=1025.5, phase=None), name=f"{fr.DUMP_PREFIX}0.3.json")
        self._write(_dump(1, [], {KEY: 3}, reason=f"requested by rank 0: {self.TIMEOUT}",
                          when=1001.0, phase="data_loader"))
        self._write(_dump(1, [], {KEY: 3}, when=1026.0, phase="data_loader",
                          reason="requested by rank 0: uncaught RuntimeError: Timed out"),
                    name=f"{fr.DUMP_PREFIX}1.2.json")

    def test_the_first_dump_is_the_evidence_and_later_ones_are_listed(self) -> None:
        """The verdict reads each rank's first dump; its later dumps of the same
        process are listed under it in order, and a timeout they report
        counts as the hang's symptom."""
        self._stall()
        code, out, err = self._run()
        self.assertEqual((code, err), (0, ""), err)
        lines = out.splitlines()
        self.assertEqual(lines[0], "flight recorder dumps: 2 rank(s) of 2")
        self.assertTrue(lines[1].startswith("  rank 0 (pid 1, h): waits in reduce #3")
                        and lines[1].endswith(f"dumped on: {self.TIMEOUT}"), lines[1])
        self.assertEqual(lines[2:4], [
            f"    then {fr.DUMP_PREFIX}0.2.json (+25 s): {self.GLOO}",
            f"    then {fr.DUMP_PREFIX}0.3.json (+26 s): uncaught RuntimeError: Timed out"])
        self.assertTrue(lines[4].startswith("  rank 1 (pid 1, h): in no collective, in "
                                            "phase 'data_loader'"), lines[4])
        self.assertEqual(lines[5], f"    then {fr.DUMP_PREFIX}1.2.json (+25 s): requested "
                                   "by rank 0: uncaught RuntimeError: Timed out")
        self.assertTrue(lines[6].startswith(f"rank 1 {CULPRIT}: in phase 'data_loader'"),
                        out)
        self.assertIn("  rank 0 raised when a collective timed out: a symptom of the hang, "
                      "not its cause", lines)
        code, out, _ = self._run("--json")
        res = json.loads(out)
        self.assertEqual((res["verdict"], res["raised"]["0"]["kind"]), ("hang", "timeout"))
        self.assertEqual(res["ranks"]["0"]["reason"], self.TIMEOUT)
        self.assertEqual([(d["file"], d["time"]) for d in res["ranks"]["0"]["later_dumps"]],
                         [(f"{fr.DUMP_PREFIX}0.2.json", 1025.0),
                          (f"{fr.DUMP_PREFIX}0.3.json", 1025.5)])

    def test_which_dumps_of_a_rank_are_read(self) -> None:
        """Rows: later dumps of another process are ignored with a note; later
        dumps without a first one make the lowest number the evidence; a
        rank's error in a later dump still makes the verdict a crash; two
        dumps of one rank with one number are refused."""
        rows = ["another process", "no first dump", "error in a later dump",
                "one number twice"]
        for label in rows:
            with self.subTest(label):
                self._clear()
                self._stall()
                if label == "another process":
                    self._write(_dump(1, [], {KEY: 3}, reason="SIGUSR1", pid=99),
                                name=f"{fr.DUMP_PREFIX}1.2.json")
                    code, out, _ = self._run()
                    self.assertIn(f"    note: ignored {fr.DUMP_PREFIX}1.2.json: written by "
                                  f"another process than {fr.DUMP_PREFIX}1.json (an earlier "
                                  "job); remove them", out.splitlines())
                    self.assertNotIn(f"then {fr.DUMP_PREFIX}1.2.json", out)
                elif label == "no first dump":
                    os.remove(fr.dump_path(self.dir, 0))
                    code, out, _ = self._run()
                    self.assertIn(f"dumped on: {self.GLOO}", out.splitlines()[1])
                    self.assertEqual(out.splitlines()[2], f"    then {fr.DUMP_PREFIX}0.3.json "
                                     "(+0 s): uncaught RuntimeError: Timed out")
                elif label == "error in a later dump":
                    self._write(_dump(1, [], {KEY: 3}, when=1026.0,
                                      reason="uncaught ValueError: bad batch"),
                                name=f"{fr.DUMP_PREFIX}1.2.json")
                    code, out, _ = self._run()
                    self.assertTrue(out.splitlines()[6].startswith(
                        "not a hang: a crash: rank 1 raised ValueError outside any "
                        "collective"), out)
                    self.assertIn("  rank 1 raised ValueError; its dump: uncaught ValueError: "
                                  "bad batch", out.splitlines())
                else:
                    self._write(_dump(0, [], {}), name=f"{fr.DUMP_PREFIX}0.02.json")
                    code, out, err = self._run()
                    self.assertEqual((code, out), (2, ""))
                    self.assertIn("rank 0 again", err)
                    continue
                self.assertEqual(code, 0, out)


class TestAsciiLocale(_DumpDir):
    def test_report_prints_under_an_ascii_locale(self) -> None:
        """Non-ASCII text in a dump (an exception message, a frame's file name)
        and a non-ASCII log dir name print escaped under LC_ALL=C without
        UTF-8 mode, exit 0, never 'UnicodeEncodeError ... this is a bug'."""
        log_dir = os.path.join(self.dir, "d\u00efr")
        os.mkdir(log_dir)
        frames = ['  File "/tmp/caf\u00e9/train.py", line 3, in step\n    loss = f()\n']
        stacks = [{"thread": "MainThread", "main": True, "in_collective": False,
                   "frames": frames}]
        for rank, reason in ((0, "uncaught ValueError: caf\u00e9 \u2713"),
                             (1, "requested by rank 0: uncaught ValueError: caf\u00e9")):
            with open(fr.dump_path(log_dir, rank), "w") as f:
                json.dump(_dump(rank, [], {}, reason=reason, stacks=stacks), f)
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONIOENCODING", "LANG", "LC_CTYPE")}
        env.update(LC_ALL="C", PYTHONUTF8="0")
        for flags in ((), ("--json",)):
            with self.subTest(flags=flags):
                proc = subprocess.run(
                    [sys.executable, "-m", "paddle_muon_ext.cli", "hangs", log_dir, *flags],
                    capture_output=True, timeout=120, env=env)
                self.assertEqual(proc.returncode, 0, proc.stderr)
                self.assertEqual(proc.stderr, b"")
                out = proc.stdout.decode("ascii")
                if flags:
                    self.assertEqual(json.loads(out)["ranks"]["0"]["reason"],
                                     "uncaught ValueError: caf\u00e9 \u2713")
                else:
                    self.assertIn("not a hang: a crash: rank 0 raised ValueError outside any "
                                  "collective", out)
                    self.assertIn("dumped on: uncaught ValueError: caf\\xe9 \\u2713", out)
                    self.assertIn('File "/tmp/caf\\xe9/train.py", line 3, in step', out)


if __name__ == "__main__":
    unittest.main()
