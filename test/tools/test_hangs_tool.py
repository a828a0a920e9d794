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

import glob
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
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_flight import recorder as fr
from paddle_muon_ext.tools import hangs

CULPRIT = "is the rank the others wait for"
HERE = os.path.dirname(os.path.abspath(__file__))
JOB_WORKER = os.path.join(HERE, "hangs_job_worker.py")
STALL_MARKER = "hangs_job.stalled"  # hangs_job_worker.STALL_MARKER (it imports paddle)
RAISED = "reduce on group [0, 1] (phase 'cross_node_reduce') raised RuntimeError: boom"


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
               when: float = 1000.0, world: int = 4, stacks: list | None = None) -> None:
        entries = list(state.in_flight) + ([state.last_finished] if state.last_finished else [])
        data = {"format": fr.DUMP_FORMAT, "rank": rank, "world_size": world, "pid": 1,
                "host": "h",
                "reason": reason, "phase": state.phase, "entries": entries, "time": when,
                "issued": [{"group_id": k[0], "group_ranks": list(k[1]), "count": n}
                           for k, n in state.issued.items()]}
        if stacks is not None:
            data["stacks"] = stacks
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
        self.assertIn("rank 1 (pid 1, h): waits in reduce #2", out)
        self.assertIn("rank 3 (pid 1, h): in no collective, in phase 'cross_node_reduce'", out)

    def test_dumps_from_different_jobs_are_pointed_out(self) -> None:
        states = _two_rank_states()
        self._write(1, states[1], when=1000.0)
        self._write(3, states[3], when=5000.0)
        code, out, _ = self._run([self.dir])
        self.assertEqual(code, 0)
        self.assertIn("note: the dumps were written 4000 s apart", out)

    def test_the_stale_note_starts_past_300_seconds(self) -> None:
        states = _two_rank_states()
        for spread, noted in ((299.0, False), (301.0, True)):
            self._write(1, states[1], when=1000.0)
            self._write(3, states[3], when=1000.0 + spread)
            code, out, _ = self._run([self.dir])
            self.assertEqual(code, 0)
            self.assertEqual("note: the dumps were written" in out, noted,
                             f"dumps {spread:g} s apart: note expected={noted}\n{out}")

    def test_malformed_dumps_name_the_problem(self) -> None:
        state = _two_rank_states()[1]

        def error_of(edit) -> str:
            for name in os.listdir(self.dir):
                os.remove(os.path.join(self.dir, name))
            self._write(1, state)
            edit()
            code, out, err = self._run([self.dir])
            self.assertEqual((code, out), (2, ""), err)
            return err

        def rewrite(change):
            path = fr.dump_path(self.dir, 1)
            with open(path) as f:
                data = json.load(f)
            change(data)
            with open(path, "w") as f:
                json.dump(data, f)

        def copy():
            shutil.copy(fr.dump_path(self.dir, 1),
                        os.path.join(self.dir, f"{fr.DUMP_PREFIX}1_copy.json"))

        self.assertIn("field 'rank' is 4, expected < world_size 4",
                      error_of(lambda: rewrite(lambda d: d.update(rank=4))))
        self.assertIn("field 'entries[0].numel' is -1",
                      error_of(lambda: rewrite(lambda d: d["entries"][0].update(numel=-1))))
        self.assertIn("rank 1 again", error_of(copy))
        with mock.patch.object(hangs, "MAX_DUMP_BYTES", 64):
            self.assertIn("bytes, above the limit 64", error_of(lambda: None))
        with mock.patch.object(hangs, "MAX_TOTAL_BYTES", 100):
            self.assertIn("the dumps hold more than 100 bytes", error_of(lambda: None))

    def test_the_same_error_with_a_rank_missing_is_not_every_rank(self) -> None:
        for rank in (0, 1):
            self._write(rank, fr.RankState(rank, None, [], {}),
                        reason="uncaught RuntimeError: boom", world=3)
        code, out, _ = self._run([self.dir])
        self.assertEqual(code, 0)
        self.assertIn("not a hang: a crash: ranks 0, 1 raised RuntimeError outside any "
                      "collective", out)
        self.assertNotIn("every rank raised", out)
        self.assertIn("no dump from rank 2", out)

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

    def test_every_rank_raised_is_a_crash_not_a_deadlock(self) -> None:
        # Both ranks sit in the same reduce, which every peer issued: the old
        # verdict called this "ranks wait on each other".
        e = _entry("reduce", 1, [0, 1], 3, "cross_node_reduce", False, root=0)
        for rank in (0, 1):
            self._write(rank, fr.RankState(rank, None, [dict(e)], {(1, (0, 1)): 4}),
                        reason="uncaught RuntimeError: boom", world=2)
        code, out, _ = self._run([self.dir])
        self.assertEqual(code, 0)
        self.assertIn("not a hang: every rank raised RuntimeError in op reduce "
                      "(phase 'cross_node_reduce')", out)
        self.assertNotIn("wait on each other", out)
        self.assertNotIn("phase None", out)
        # one sentence per rank: the collective it waits in names its phase; no
        # "outside any phase" beside a collective issued in a phase
        self.assertIn("rank 0 (pid 1, h): waits in reduce #3", out)
        self.assertNotIn("outside any phase", out)
        code, out, _ = self._run([self.dir, "--json"])
        res = json.loads(out)
        self.assertEqual(res["verdict"], "crash")
        self.assertEqual(res["raised"]["1"]["exception"], "RuntimeError")
        self.assertEqual(res["raised"]["1"]["op"], "reduce")

    def test_one_rank_raised_the_others_wait(self) -> None:
        e = _entry("reduce", 1, [0, 1], 3, "cross_node_reduce", False, root=0)
        self._write(0, fr.RankState(0, "cross_node_reduce", [dict(e)], {(1, (0, 1)): 4}),
                    reason=RAISED)
        self._write(1, fr.RankState(1, "cross_node_reduce", [dict(e)], {(1, (0, 1)): 4}),
                    reason=f"requested by rank 0: {RAISED}")
        self._write(2, fr.RankState(2, None, [], {}), reason="uncaught ValueError: bad")
        code, out, _ = self._run([self.dir])
        self.assertEqual(code, 0)
        self.assertIn("not a hang: a crash: rank 0 raised RuntimeError in op reduce "
                      "(phase 'cross_node_reduce'); rank 2 raised ValueError outside any "
                      "collective", out)
        self.assertIn("rank 1 then wait(s) in a collective", out)
        self.assertIn("no dump from rank 3", out)

    def test_every_rank_raised_different_things(self) -> None:
        for rank, reason in ((0, "uncaught KeyError: 'x'"), (1, "uncaught OSError: gone")):
            self._write(rank, fr.RankState(rank, None, [], {}), reason=reason, world=2)
        with mock.patch.object(hangs, "STALE_SPREAD_S", 1e9):
            out = "\n".join(hangs.report(hangs.load_dumps(self.dir)))
        self.assertIn("not a hang: every rank raised: rank 0 raised KeyError outside any "
                      "collective; rank 1 raised OSError outside any collective", out)

    def test_gloo_timeouts_are_a_hang_and_lost_peers_a_death(self) -> None:
        # What a real 2-process gloo job dumped when rank 1 stalled and rank
        # 0's reduce hit gloo's timeout before the flight recorder's.
        timeout = ("uncaught RuntimeError: [/paddle/third_party/gloo/gloo/transport/tcp/"
                   "unbound_buffer.cc:80] TIMEOUT self_rank = none pair_rank = -1")
        e = _entry("reduce", 21, [0, 1], 5, "reduce_to_owner", False, root=0)
        last = _entry("reduce_scatter", 21, [0, 1], 4, "reduce_scatter", True)
        self._write(0, fr.RankState(0, None, [dict(e)], {(21, (0, 1)): 6}), reason=timeout,
                    world=2)
        self._write(1, fr.RankState(1, "reduce_to_owner", [], {(21, (0, 1)): 5}, last),
                    reason=f"requested by rank 0: {timeout}", world=2)
        code, out, _ = self._run([self.dir, "--json"])
        res = json.loads(out)
        self.assertEqual((code, res["verdict"]), (0, "hang"), res["report"])
        self.assertTrue(res["report"][3].startswith(f"rank 1 {CULPRIT}: in phase "
                                                    "'reduce_to_owner'"), res["report"])
        self.assertEqual(res["raised"]["0"]["kind"], "timeout")
        self.assertIn("  rank 0 raised when a collective timed out: a symptom of the hang, "
                      "not its cause", res["report"])
        # The peer is gone instead (its process died without a dump).
        os.remove(fr.dump_path(self.dir, 1))
        self._write(0, fr.RankState(0, None, [dict(e)], {(21, (0, 1)): 6}), world=2,
                    reason="reduce on group [0, 1] (phase 'reduce_to_owner') raised "
                    "RuntimeError: [pair.cc:598] Connection closed by peer [127.0.0.1]:4021")
        code, out, _ = self._run([self.dir])
        self.assertIn("not a hang: a rank died: rank 0 lost a peer (RuntimeError in op reduce "
                      "(phase 'reduce_to_owner')); rank 1 left no dump", out)

    def test_nobody_waiting_and_hang_json(self) -> None:
        self._write(0, fr.RankState(0, None, [], {}))
        code, out, _ = self._run([self.dir, "--json"])
        self.assertEqual((code, json.loads(out)["verdict"]), (0, "none"))
        for rank, state in _two_rank_states().items():
            self._write(rank, state)
        os.remove(fr.dump_path(self.dir, 0))
        code, out, _ = self._run([self.dir, "--json"])
        res = json.loads(out)
        self.assertEqual((res["verdict"], res["raised"]), ("hang", {}))
        self.assertTrue(any(CULPRIT in line for line in res["report"]), res["report"])

    def test_stacks_of_the_stuck_rank_and_of_the_waiting_ranks_are_shown(self) -> None:
        import threading
        import traceback

        # rank 1: a thread blocked in a fake collective, dumped by a real recorder
        rec = fr.FlightRecorder(capacity=8, enabled=True)
        released, issued = threading.Event(), threading.Event()

        class _Group:
            id, ranks = 7, [1, 3]

        class _Tensor:
            dtype = "float32"

            @staticmethod
            def _numel() -> int:
                return 8

        def _fake_reduce_that_blocks() -> None:
            entry = rec.start("reduce", _Group, 3, _Tensor, "cross_node_reduce")
            issued.set()
            released.wait(30)
            rec.finish([entry])

        worker = threading.Thread(target=_fake_reduce_that_blocks, name="rank1-train")
        worker.start()
        try:
            self.assertTrue(issued.wait(30))
            waiting_stacks = rec.snapshot("SIGUSR1")["stacks"]
        finally:
            released.set()
            worker.join(30)

        # rank 3: its main thread in a slow data loader, not in a collective
        def _slow_data_loader() -> list:
            return traceback.format_stack()

        frames = _slow_data_loader() + ['  File "evil.py", line 1, in f\n    x = "\x1b[31m"\n']
        stuck = [{"thread": "MainThread", "ident": 1, "main": True, "in_collective": False,
                  "frames": frames}]
        states = _two_rank_states()
        self._write(1, states[1], stacks=waiting_stacks)
        self._write(3, states[3], stacks=stuck)
        code, out, _ = self._run([self.dir])
        self.assertEqual(code, 0)
        lines = out.splitlines()
        head = next(i for i, line in enumerate(lines)
                    if line.startswith("  rank 3's main thread, Python stack (innermost last"))
        self.assertLess(next(i for i, line in enumerate(lines) if CULPRIT in line), head)
        shown = lines[head + 1:head + 1 + hangs.CULPRIT_FRAMES]
        self.assertTrue(any("in _slow_data_loader: return traceback.format_stack()" in line
                            for line in shown), shown)
        # the frame text is escaped: no terminal escape reaches the output
        self.assertNotIn("\x1b", out)
        self.assertIn('x = "\\x1b[31m"', out)
        waits = [line for line in lines if line.startswith("  rank 1's thread 'rank1-train'")]
        self.assertEqual(len(waits), 1, out)
        # innermost first: the Event.wait it blocks in, then the fake collective
        self.assertRegex(waits[0], r"waits in: wait \(threading\.py:\d+\) < .*"
                                   r"_fake_reduce_that_blocks \(test_hangs_tool\.py:\d+\)")
        code, out, _ = self._run([self.dir, "--json"])
        ranks = json.loads(out)["ranks"]
        self.assertEqual(ranks["3"]["stack"], frames)
        self.assertEqual(ranks["1"]["stack_thread"], "rank1-train")
        self.assertTrue(any("in _fake_reduce_that_blocks" in f for f in ranks["1"]["stack"]))
        # an old dump without stacks reads as before
        self._write(3, states[3])
        code, out, _ = self._run([self.dir, "--json"])
        res = json.loads(out)
        self.assertEqual((code, res["ranks"]["3"]["stack"]), (0, None))
        self.assertFalse(any("rank 3's" in line for line in res["report"]), res["report"])

    def test_stack_of_the_rank_that_raised_long_stacks_and_many_waiting_ranks(self) -> None:
        frames = [f'  File "m{i}.py", line {i}, in f{i}\n    step({i})\n' for i in range(20)]
        main = [{"thread": "MainThread", "main": True, "in_collective": False,
                 "frames": frames}]
        states = _two_rank_states()
        self._write(3, states[3], reason="uncaught ValueError: bad batch", stacks=main)
        self._write(1, states[1], stacks=[{**main[0], "frames": ["garbage"]}])
        code, out, _ = self._run([self.dir])
        self.assertIn("rank 3's main thread, Python stack (innermost last; "
                      f"{20 - hangs.CULPRIT_FRAMES} outer frames not shown):", out)
        self.assertIn('    File "m19.py", line 19, in f19: step(19)', out)
        self.assertNotIn("m7.py", out)
        self.assertIn("rank 1's main thread waits in: garbage", out)
        with mock.patch.object(hangs, "WAITING_SHOWN", 0):
            code, out, _ = self._run([self.dir])
        self.assertIn("... and 1 more waiting ranks (their stacks are in --json)", out)
        self.assertNotIn("rank 1's main thread waits in", out)

    def test_malformed_stacks_name_the_field(self) -> None:
        states = _two_rank_states()
        self._write(1, states[1])
        for stacks, problem in (
                ({"a": 1}, "field 'stacks' is {\"a\": 1}, expected a list"),
                ([3], "field 'stacks[0]' is 3, expected an object"),
                ([{"main": True}], "field 'stacks[0].frames' is missing"),
                ([{"frames": ["a", 2]}], "field 'stacks[0].frames' is [\"a\", 2], expected a list"
                                         " of strings"),
                ([{"frames": [], "main": "yes"}], "field 'stacks[0].main' is \"yes\", expected "
                                                  "true or false"),
                ([{"frames": [], "thread": 5}],
                 "field 'stacks[0].thread' is 5, expected a string")):
            self._write(3, states[3], stacks=stacks)
            code, out, err = self._run([self.dir])
            self.assertEqual((code, out), (2, ""), stacks)
            self.assertIn(problem, err)
            self.assertEqual(len(err.splitlines()), 1, err)

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


class TestRealGlooJobs(unittest.TestCase):
    """``hangs`` on the dumps of real gloo jobs (2 and 4 processes) that crash or hang."""

    def _job(self, mode: str, nproc: int) -> tuple:
        sys.path.insert(0, os.path.join(REPO_ROOT, "test", "collective", "fleet"))
        from launch_utils import run_paddle_launch

        log_dir = tempfile.mkdtemp(prefix=f"muon_hangs_{mode}{nproc}_")
        self.addCleanup(shutil.rmtree, log_dir, True)
        env = {"HANGS_JOB_MODE": mode, fr.ENV_TIMEOUT: "3", fr.ENV_ARM: "1",
               "PYTHONPATH": os.pathsep.join([os.path.join(REPO_ROOT, "python"),
                                              os.environ.get("PYTHONPATH", "")])}
        if nproc == 4:
            env["PADDLE_LOCAL_SIZE"] = "2"  # 2 emulated nodes x 2 cards: option on

        def every_rank_dumped(d: str) -> bool:
            # Only dumps taken after the stall count: on a loaded box a slow
            # step-0 collective can pass the 3 s timeout and dump every rank
            # (CI saw it once) before anything hangs; the job goes on then and
            # each rank dumps again once the hang is real (a new stall: its
            # first dump file is rewritten).
            if mode != "hang":
                return False
            try:
                stalled = os.stat(os.path.join(d, STALL_MARKER)).st_mtime
            except OSError:
                return False
            fresh = set()
            for path in glob.glob(os.path.join(d, f"{fr.DUMP_PREFIX}*.json")):
                try:
                    if os.stat(path).st_mtime >= stalled:
                        # a rank's later dumps are muon_flight_rank<R>.<n>.json
                        fresh.add(os.path.basename(path)[len(fr.DUMP_PREFIX):].split(".")[0])
                except OSError:  # replaced between the glob and the stat
                    pass
            return len(fresh) >= nproc

        result = run_paddle_launch(JOB_WORKER, nproc, env=env, timeout_s=240, log_dir=log_dir,
                                   stop_when=every_rank_dumped, keep_log_dir=True)
        if mode == "hang":
            self.assertTrue(result.stopped, result.failure_message())
            import time

            time.sleep(0.5)  # a dump still being renamed into place
        else:
            self.assertNotEqual(result.returncode, 0, "the job must fail")
            self.assertFalse(result.timed_out, result.failure_message())
        out = io.StringIO()
        with redirect_stdout(out):
            code = hangs.main([log_dir])
        self.assertEqual(code, 0, out.getvalue())
        return out.getvalue(), result

    def test_one_rank_raising_is_named_over_the_peers_it_fails(self) -> None:
        out, result = self._job("crash_one", 2)
        self.assertIn("not a hang: a crash: rank 1 raised ValueError outside any collective",
                      out)
        self.assertIn("rank 0 then failed in a collective", out)
        self.assertNotIn(CULPRIT, out)

    def test_crash_and_hang_on_2_and_4_processes(self) -> None:
        for nproc in (2, 4):
            with self.subTest(mode="crash", nproc=nproc):
                out, result = self._job("crash", nproc)
                verdicts = [ln for ln in out.splitlines() if not ln.startswith(" ")][1:]
                self.assertEqual(len(verdicts), 1, out)
                self.assertTrue(verdicts[0].startswith(
                    "not a hang: every rank raised RuntimeError in op reduce (phase '"), out)
                self.assertNotIn(CULPRIT, out)
                self.assertNotIn("wait on each other", out)
                self.assertNotIn("phase None", out)
            with self.subTest(mode="hang", nproc=nproc):
                out, result = self._job("hang", nproc)
                self.assertNotIn("not a hang", out)
                culprit = [ln for ln in out.splitlines() if CULPRIT in ln]
                self.assertEqual(len(culprit), 1, out)
                self.assertTrue(culprit[0].startswith(f"rank {nproc - 1} {CULPRIT}"), out)
                self.assertIn(f"rank {nproc - 1} stalls", result.worker_logs[nproc - 1])


if __name__ == "__main__":
    unittest.main()
