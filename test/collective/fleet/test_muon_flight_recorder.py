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
"""The collective flight recorder, the ``hangs`` analyzer and the profiler phases.

* A ring buffer of the optimizer's collectives, dumped on a timeout, an
  exception, SIGUSR1 or a peer's request.
* ``diagnose`` (what ``paddle-muon-ext hangs`` prints) names the rank the others wait for; the same words come from
  real dumps (a 4-process gloo job with one rank stalled inside a phase)
  and from the simulated world's deadlock detector.
* Each communication phase is a ``paddle.profiler.RecordEvent`` named like
  the labels the test recorder reads.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import unittest
from unittest import mock

import paddle
import paddle.distributed as dist
from paddle import profiler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from launch_utils import run_paddle_launch  # noqa: E402
from muon_sim_runner import SimConfig, run_world  # noqa: E402

from mock.fake_comm import DeadlockError  # noqa: E402
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_flight import (  # noqa: E402
    diagnosis as diag,
    recorder as fr,
    stacks as fstacks,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import runtime as comm

HERE = os.path.dirname(os.path.abspath(__file__))
STUCK_WORKER = os.path.join(HERE, "muon_flight_stuck_worker.py")
CULPRIT = "is the rank the others wait for"


class _Group:
    def __init__(self, gid: int, ranks: list[int]) -> None:
        self.id, self.ranks, self.nranks = gid, ranks, len(ranks)


def _entry(op, gid, ranks, group_seq, phase, finished, root=None, seq=0):
    return {"seq": seq, "group_seq": group_seq, "phase": phase, "op": op, "group_id": gid,
            "group_ranks": ranks, "root": root, "dtype": "float32", "numel": 8,
            "start": 1.0, "finish": 2.0 if finished else None}


class TestRecorder(unittest.TestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="muon_flight_")
        env = {fr.ENV_DIR: self.dir, "PADDLE_TRAINER_ID": "5", "PADDLE_TRAINERS_NUM": "8"}
        # Paddle caches its parallel env (world size 8 here) at first use:
        # leave no cache behind for the suites after this one
        for patcher in (mock.patch.dict(os.environ, env),
                        mock.patch.object(paddle.distributed.parallel,
                                          "_global_parallel_env", None)):
            patcher.start()
            self.addCleanup(patcher.stop)
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.rec = fr.FlightRecorder(capacity=4)
        self.rec._armed = True  # no watchdog thread / signal handler in unit tests

    def test_ring_keeps_last_n_and_per_group_counts(self) -> None:
        group, other = _Group(3, [1, 5]), _Group(4, [4, 5, 6, 7])
        t = paddle.ones([2, 3], dtype="float32")
        entries = [self.rec.start("reduce", group if i % 2 else other, 5, t, f"p{i}")
                   for i in range(6)]
        self.rec.finish(entries[:5])
        snap = self.rec.snapshot("test")
        self.assertEqual([e["seq"] for e in snap["entries"]], [2, 3, 4, 5])
        last = snap["entries"][-1]
        self.assertEqual((last["op"], last["group_id"], last["group_ranks"], last["root"],
                          last["dtype"], last["numel"], last["phase"], last["finish"]),
                         ("reduce", 3, [1, 5], 5, "float32", 6, "p5", None))
        self.assertEqual(last["group_seq"], 2)  # third collective on group 3
        self.assertEqual({(i["group_id"], i["count"]) for i in snap["issued"]}, {(3, 3), (4, 3)})
        self.assertEqual((snap["rank"], snap["world_size"], snap["reason"]), (5, 8, "test"))
        # a malformed launcher value must not make the dump itself fail
        for raw in ("abc", "", "-2"):
            with mock.patch.dict(os.environ, {"PADDLE_TRAINERS_NUM": raw}):
                self.assertEqual(self.rec.snapshot("test")["world_size"], 0, raw)

    def test_disabled_records_nothing(self) -> None:
        rec = fr.FlightRecorder(enabled=False)
        self.assertIsNone(rec.start("reduce", _Group(1, [0, 1]), 0, paddle.ones([1]), None))
        self.assertEqual(rec.snapshot("x")["entries"], [])

    def test_documented_defaults_and_env_overrides(self) -> None:
        # docs/USAGE.md: the last 2048 collectives, a 600 s timeout, recording on
        unset = {k: v for k, v in os.environ.items()
                 if k not in (fr.ENV_ENTRIES, fr.ENV_TIMEOUT, fr.ENV_ENABLE)}
        with mock.patch.dict(os.environ, unset, clear=True):
            rec = fr.FlightRecorder()
            self.assertEqual((rec.capacity, rec.timeout_s, rec.enabled), (2048, 600.0, True))
        with mock.patch.dict(os.environ, {fr.ENV_ENTRIES: "16", fr.ENV_TIMEOUT: "2.5",
                                          fr.ENV_ENABLE: "0"}):
            rec = fr.FlightRecorder()
            self.assertEqual((rec.capacity, rec.timeout_s, rec.enabled), (16, 2.5, False))

    def test_env_values_are_checked(self) -> None:
        # nan / inf: the watchdog would never fire (bug: silently accepted)
        for name, value in ((fr.ENV_ENTRIES, "0"), (fr.ENV_ENTRIES, "x"), (fr.ENV_TIMEOUT, "-1"),
                            (fr.ENV_TIMEOUT, "nan"), (fr.ENV_TIMEOUT, "inf"),
                            (fr.ENV_TIMEOUT, "-inf"), (fr.ENV_ENTRIES, "1e3")):
            with mock.patch.dict(os.environ, {name: value}):
                with self.assertRaisesRegex(ValueError, f"{name}='{value}': must be a positive "
                                            "(integer|finite number); unset it") as ctx:
                    fr.FlightRecorder()
                self.assertNotIn("\n", str(ctx.exception))

    def test_env_switches_take_only_0_or_1(self) -> None:
        # Bug: "off" / "false" read as on (anything but "0"), "yes" as armed.
        for name in (fr.ENV_ENABLE, fr.ENV_ARM):
            for value in ("off", "false", "yes", "2"):
                with self.subTest(name=name, value=value), \
                        mock.patch.dict(os.environ, {name: value}):
                    with self.assertRaisesRegex(ValueError, f"{name}='{value}': must be 1 "
                                                r"\(on\) or 0 \(off\)"):
                        fr.FlightRecorder()
        for enable, arm, expected in (("1", "0", (True, False)), ("0", "1", (False, True)),
                                      ("", "", (True, False))):
            with mock.patch.dict(os.environ, {fr.ENV_ENABLE: enable, fr.ENV_ARM: arm}):
                rec = fr.FlightRecorder()
                self.assertEqual((rec.enabled, rec._arm_from_env), expected)

    def test_nested_phases_restore_the_outer_one(self) -> None:
        outer = fr.enter_phase("outer")
        inner = fr.enter_phase("inner")
        self.assertEqual(fr.phase_of_thread(), "inner")
        fr.exit_phase(inner)
        self.assertEqual(fr.phase_of_thread(), "outer")
        fr.exit_phase(outer)
        self.assertIsNone(fr.phase_of_thread())

    def test_rank_falls_back_to_the_process_group(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PADDLE_TRAINER_ID"}
        with mock.patch.dict(os.environ, env, clear=True):
            self.assertEqual(fr._own_rank(), dist.get_rank())
            with mock.patch.object(dist, "get_rank", side_effect=RuntimeError("no group")):
                self.assertEqual(fr._own_rank(), -1)
        # a launcher's id wins; one that is not a number is ignored, not fatal
        with mock.patch.dict(os.environ, {"PADDLE_TRAINER_ID": "3"}):
            self.assertEqual(fr._own_rank(), 3)
        with mock.patch.dict(os.environ, {"PADDLE_TRAINER_ID": "worker-3"}):
            self.assertEqual(fr._own_rank(), dist.get_rank())

    def test_clear_forgets_entries_and_counters(self) -> None:
        self.rec.start("reduce", _Group(3, [1, 5]), 5, paddle.ones([2]), "p")
        self.rec.clear()
        snap = self.rec.snapshot("after clear")
        self.assertEqual((snap["entries"], snap["issued"]), ([], []))
        entry = self.rec.start("reduce", _Group(3, [1, 5]), 5, paddle.ones([2]), "p")
        self.assertEqual(entry[fr.FIELDS.index("seq")], 0)

    def test_unwritable_dump_dir_is_a_warning_not_a_crash(self) -> None:
        blocker = os.path.join(self.dir, "a_file")
        with open(blocker, "w") as f:
            f.write("x")
        self.assertIsNone(self.rec.dump("x", directory=os.path.join(blocker, "sub")))
        self.assertEqual(self.rec.dumps, 0)

    def test_unreadable_peer_request_still_dumps(self) -> None:
        with open(os.path.join(self.dir, fr.REQUEST_FILE), "w") as f:
            f.write("{not json")
        self.rec._request_seen = 0.0
        self.assertEqual(self.rec.check_once(time.time()), "requested by rank ?: ?")
        self.assertTrue(os.path.exists(fr.dump_path(self.dir, 5)))
        # the same request is answered once, not on every watchdog round
        self.assertIsNone(self.rec.check_once(time.time()))
        self.assertEqual(self.rec.dumps, 1)

    def test_watchdog_dumps_timed_out_collective_and_asks_peers(self) -> None:
        self.rec.timeout_s = 5.0
        entry = self.rec.start("broadcast", _Group(2, [0, 5]), 0, paddle.ones([4]), "p")
        self.assertIsNone(self.rec.check_once(entry[fr.FIELDS.index("start")] + 1.0))
        reason = self.rec.check_once(entry[fr.FIELDS.index("start")] + 6.0)
        self.assertIn("collective timeout: broadcast #0 on group 2 [0, 5]", reason)
        with open(fr.dump_path(self.dir, 5)) as f:
            self.assertEqual(json.load(f)["reason"], reason)
        with open(os.path.join(self.dir, fr.REQUEST_FILE)) as f:
            self.assertEqual(json.load(f)["rank"], 5)
        # Once per collective; a peer's later request is answered.
        self.assertIsNone(self.rec.check_once(entry[fr.FIELDS.index("start")] + 9.0))
        peer = fr.FlightRecorder()
        peer._request_seen = 0.0
        self.assertIn("requested by rank 5", peer.check_once(time.time()))

    def test_exception_in_collective_dumps_and_reraises(self) -> None:
        def broken(*_a, **_k):
            raise RuntimeError("gloo TIMEOUT")

        group = _Group(9, [0, 5])
        with mock.patch.object(comm, "get_flight_recorder", return_value=self.rec), \
                mock.patch.object(comm._batch_isend_irecv, "_coalescing_manager"), \
                mock.patch.object(dist, "reduce", broken):
            with comm.comm_phase("cross_node_reduce"):
                with self.assertRaisesRegex(RuntimeError, "gloo TIMEOUT"):
                    comm.launch_coalesced("reduce", [(paddle.ones([3]), 0)], group,
                                          dist.ReduceOp.SUM).wait()
        with open(fr.dump_path(self.dir, 5)) as f:
            data = json.load(f)
        self.assertIn("reduce on group [0, 5] (phase 'cross_node_reduce') raised RuntimeError",
                      data["reason"])
        self.assertEqual(data["entries"][-1]["finish"], None)

    def test_sigusr1_dumps(self) -> None:
        rec = fr.FlightRecorder()
        previous = signal.getsignal(signal.SIGUSR1)
        hook = sys.excepthook
        try:
            signal.signal(signal.SIGUSR1, signal.SIG_DFL)
            with mock.patch.dict(os.environ, {fr.LAUNCHER_LOG_DIR_ENV: "", fr.ENV_DIR: ""}):
                rec.arm()  # no directory: no watchdog
            self.assertIsNone(rec._watchdog)
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.05)
            with open(fr.dump_path(self.dir, 5)) as f:
                self.assertEqual(json.load(f)["reason"], "SIGUSR1")
        finally:
            signal.signal(signal.SIGUSR1, previous)
            sys.excepthook = hook

    def test_armed_watchdog_answers_sigusr1_and_peer_requests(self) -> None:
        rec = fr.FlightRecorder()
        previous, hook = signal.getsignal(signal.SIGUSR1), sys.excepthook
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        try:
            rec.arm()
            self.assertIsNotNone(rec._wakeup)  # pytest owns no wake-up fd
            os.kill(os.getpid(), signal.SIGUSR1)
            path = fr.dump_path(self.dir, 5)
            deadline = time.time() + 10
            while not os.path.exists(path) and time.time() < deadline:
                time.sleep(0.05)
            with open(path) as f:
                self.assertEqual(json.load(f)["reason"], "SIGUSR1")
            # An uncaught exception dumps and asks the peers.
            sys.excepthook(ValueError, ValueError("boom"), None)
            with open(os.path.join(self.dir, fr.REQUEST_FILE)) as f:
                self.assertEqual(json.load(f)["reason"], "uncaught ValueError: boom")
        finally:
            with mock.patch.object(sys, "stderr"):
                rec.disarm()
            signal.signal(signal.SIGUSR1, previous)
        self.assertIs(sys.excepthook, hook)
        self.assertIsNone(rec._watchdog)

    def test_dump_holds_the_stack_of_the_thread_blocked_in_a_collective(self) -> None:
        import threading

        released = threading.Event()
        issued = threading.Event()

        def _fake_allreduce_that_blocks() -> None:
            entry = self.rec.start("all_reduce", _Group(2, [0, 5]), None, paddle.ones([2]), "p")
            issued.set()
            released.wait(30)
            self.rec.finish([entry])

        worker = threading.Thread(target=_fake_allreduce_that_blocks, name="rank5-train")
        worker.start()
        try:
            self.assertTrue(issued.wait(30))
            path = self.rec.dump("test")
        finally:
            released.set()
            worker.join(30)
        with open(path) as f:
            stacks = json.load(f)["stacks"]
        # the blocked thread comes first, its innermost frame in the blocking function
        first = stacks[0]
        self.assertEqual((first["thread"], first["in_collective"], first["main"]),
                         ("rank5-train", True, False))
        self.assertIn("in _fake_allreduce_that_blocks", "".join(first["frames"][-3:]))
        self.assertTrue(all(isinstance(f, str) for s in stacks for f in s["frames"]))
        main = [s for s in stacks if s["main"]]
        self.assertEqual(len(main), 1)
        self.assertIn("in test_dump_holds_the_stack", "".join(main[0]["frames"]))
        # nothing in flight: no thread is called blocked
        self.assertFalse(any(s["in_collective"] for s in self.rec.snapshot("x")["stacks"]))
        # a stack that cannot be read costs the stacks, not the dump
        with mock.patch.object(fstacks.traceback, "format_stack", side_effect=RuntimeError("x")):
            snap = self.rec.snapshot("still dumps")
        self.assertEqual((snap["reason"], snap["stacks"]), ("still dumps", []))

    def test_dump_stacks_are_bounded_and_leave_the_watchdog_out(self) -> None:
        import threading

        # two functions in turn: format_stack folds repeats of one frame
        def _ping(n: int):
            return _pong(n - 1) if n else fr.thread_stacks()

        def _pong(n: int):
            return _ping(n - 1)

        main = next(s for s in _ping(3 * fstacks.STACK_FRAMES) if s["main"])
        self.assertEqual(len(main["frames"]), fstacks.STACK_FRAMES)
        # the innermost frames are the ones kept
        self.assertIn("in thread_stacks", main["frames"][-1])
        self.assertTrue(all(re.search(r"in _p[io]ng\n", f) for f in main["frames"][:-2]))
        with mock.patch.object(fstacks, "STACK_FRAME_CHARS", 40):
            main = next(s for s in _ping(8) if s["main"])
        self.assertTrue(all(len(f) <= 40 for f in main["frames"]))
        self.assertTrue(main["frames"][-1].endswith("..."))
        box = []
        watchdog = threading.Thread(target=lambda: box.append(fr.thread_stacks()),
                                    name="muon-flight-watchdog")
        watchdog.start()
        watchdog.join(30)
        self.assertNotIn("muon-flight-watchdog", [s["thread"] for s in box[0]])
        self.assertIn(threading.current_thread().name, [s["thread"] for s in box[0]])

    def test_no_directory_warns_instead_of_writing(self) -> None:
        with mock.patch.dict(os.environ, {fr.LAUNCHER_LOG_DIR_ENV: "", fr.ENV_DIR: ""}):
            self.assertIsNone(self.rec.dump("x"))


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


class TestDiagnose(unittest.TestCase):
    def test_names_the_rank_outside_the_collective_and_its_phase(self) -> None:
        lines = fr.diagnose(_two_rank_states(), world_size=4)
        self.assertTrue(lines[0].startswith(f"rank 3 {CULPRIT}: in phase 'cross_node_reduce'"),
                        lines)
        self.assertIn("has not issued reduce #2 on group 7 [1, 3]", lines[0])
        self.assertIn("rank 1 waits in reduce #2 on group 7 [1, 3]", "\n".join(lines))
        self.assertIn("no dump from ranks 0, 2", lines[-1])

    def test_rank_without_dump_is_named(self) -> None:
        states = _two_rank_states()
        del states[3]
        self.assertTrue(fr.diagnose(states)[0].startswith(f"rank 3 {CULPRIT}: it left no dump"))

    def test_ranks_waiting_on_each_other(self) -> None:
        a, b = (1, (0, 1)), (2, (0, 1))
        states = {
            0: fr.RankState(0, None, [_entry("reduce", 1, [0, 1], 0, "x", False)], {a: 1}),
            1: fr.RankState(1, None, [_entry("broadcast", 2, [0, 1], 0, "y", False)], {b: 1}),
        }
        self.assertIn("wait on each other", fr.diagnose(states)[0])

    def test_the_collective_waiting_for_the_culprit_alone_describes_it(self) -> None:
        # rank 0 waits for ranks 1 and 2 in an all_reduce, rank 3 for rank 1
        # alone in a broadcast: rank 1's line names the broadcast (it is the
        # one rank 1 alone holds up), rank 2's the all_reduce
        a, b = (4, (0, 1, 2)), (6, (1, 3))
        states = {
            0: fr.RankState(0, None, [_entry("all_reduce", 4, [0, 1, 2], 0, "x", False)],
                            {a: 1}),
            1: fr.RankState(1, "y", [], {}),
            2: fr.RankState(2, "y", [], {}),
            3: fr.RankState(3, None, [_entry("broadcast", 6, [1, 3], 0, "z", False, root=1,
                                             seq=5)], {b: 1}),
        }
        lines = fr.diagnose(states, world_size=4)
        self.assertTrue(lines[0].startswith(f"rank 1 {CULPRIT}"), lines)
        self.assertIn("has not issued broadcast #0 on group 6 [1, 3]", lines[0])
        self.assertTrue(lines[1].startswith(f"rank 2 {CULPRIT}"), lines)
        self.assertIn("has not issued all_reduce #0 on group 4 [0, 1, 2]", lines[1])

    def test_every_rank_without_a_dump_is_listed_the_last_too(self) -> None:
        states = _two_rank_states()
        del states[3]
        self.assertEqual(fr.diagnose(states, world_size=4)[-1], "  no dump from ranks 0, 2, 3")

    def test_up_to_sixteen_silent_ranks_get_a_line_each(self) -> None:
        # rank 0 waits on a group whose other members left no dump
        def silent_lines(n):
            key = (9, tuple(range(n + 1)))
            states = {0: fr.RankState(0, None, [_entry("all_reduce", 9, list(key[1]), 0, "x",
                                                       False)], {key: 1})}
            return [l for l in fr.diagnose(states) if "the others wait for" in l]

        lines = silent_lines(16)
        self.assertEqual([l.split(" ")[1] for l in lines], [str(p) for p in range(1, 17)])
        lines = silent_lines(17)
        self.assertEqual(len(lines), 1, lines)
        self.assertTrue(lines[0].startswith("ranks 1, 2, 3, 4, 5, 6, 7, 8, ..., 14, 15, 16, 17 "
                                            "(17 ranks) are the ranks the others wait for"),
                        lines[0])

    def test_many_silent_ranks_are_not_also_called_a_wait_cycle(self) -> None:
        # 17 silent ranks give one summary line; with no dumped culprit left
        # the verdict must not add "wait on each other" (a lost node is not
        # a cycle of collectives issued in different orders)
        key = (9, tuple(range(18)))
        states = {0: fr.RankState(0, None, [_entry("all_reduce", 9, list(key[1]), 0, "x",
                                                   False)], {key: 1})}
        lines = fr.diagnose(states)
        self.assertTrue(any("are the ranks the others wait for" in l for l in lines), lines)
        self.assertFalse(any("wait on each other" in l for l in lines), lines)

    def test_rank_lists_up_to_sixteen_are_shown_whole(self) -> None:
        # the documented rule: lists longer than 16 keep their first 8 and
        # last 4 members and say how many there are
        whole = diag.describe_collective(_entry("reduce", 3, list(range(16)), 0, None, False))
        self.assertIn("[" + ", ".join(map(str, range(16))) + "]", whole)
        short = diag.describe_collective(_entry("reduce", 3, list(range(17)), 0, None, False))
        self.assertIn("[0, 1, 2, 3, 4, 5, 6, 7, ..., 13, 14, 15, 16 (17 ranks)]", short)

    def test_nobody_waiting(self) -> None:
        self.assertEqual(fr.diagnose({0: fr.RankState(0)}),
                         ["no rank is waiting in a collective of the optimizer"])


def _stall(rank: int, phase: str, step: int, sleep_s: float):
    """Patch the collectives so ``rank`` sleeps on entering ``phase`` at ``step``."""
    calls = {}
    originals = {n: getattr(comm, n) for n in ("launch_coalesced",)}

    def make(original):
        def stalled(*args, **kwargs):
            me = dist.get_rank()
            if fr.phase_of_thread() == phase:
                calls[me] = calls.get(me, 0) + 1
                if me == rank and calls[me] == step + 1:
                    time.sleep(sleep_s)
            return original(*args, **kwargs)
        return stalled

    return mock.patch.multiple(comm, **{n: make(o) for n, o in originals.items()})


#: Runs in a fresh interpreter: import, optimizer construction and two steps
#: in the simulated world (rank threads), then one collective recorded on the
#: main thread; prints which process-wide hooks changed.
_HOOK_PROBE = r"""
import json, signal, sys, threading
before = (sys.excepthook, signal.getsignal(signal.SIGUSR1))
import paddle_muon_ext
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_flight import recorder as fr
from muon_sim_runner import SimConfig, run_world
import paddle
run_world(SimConfig(ep=2, ms=2, steps=2))
class G:
    id, ranks, nranks = 9, (0, 1), 2
rec = fr.get_flight_recorder()
rec.finish([rec.start("reduce", G(), 0, paddle.ones([2]), None)])
wakeup = signal.set_wakeup_fd(-1)
changed = {
    "recorded": len(rec.snapshot("probe")["entries"]) > 0,
    "excepthook": sys.excepthook is not before[0],
    "sigusr1": signal.getsignal(signal.SIGUSR1) is not before[1],
    "wakeup_fd": wakeup != -1,
    "watchdog": any(t.name == "muon-flight-watchdog" for t in threading.enumerate()),
}
if "--disarm" in sys.argv:
    fr.disarm()
    wakeup = signal.set_wakeup_fd(-1)
    changed["after_disarm"] = [sys.excepthook is not before[0],
        signal.getsignal(signal.SIGUSR1) is not before[1], wakeup != -1,
        any(t.name == "muon-flight-watchdog" and t.is_alive() for t in threading.enumerate())]
print("PROBE " + json.dumps(changed))
"""


def _probe_hooks(env: dict, *args: str) -> dict:
    import subprocess

    full = dict(os.environ)
    full.pop(fr.ENV_ARM, None)
    full.update(env)
    full["PYTHONPATH"] = os.pathsep.join(
        [HERE, os.path.dirname(os.path.dirname(HERE))] + sys.path)
    out = subprocess.run([sys.executable, "-c", _HOOK_PROBE, *args], env=full, cwd=HERE,
                         capture_output=True, text=True, timeout=240)
    line = [x for x in out.stdout.splitlines() if x.startswith("PROBE ")]
    if not line:
        raise AssertionError(f"hook probe failed:\n{out.stdout}\n{out.stderr[-3000:]}")
    return json.loads(line[-1][len("PROBE "):])


class TestArmedOnlyOnRequest(unittest.TestCase):
    """Library manners: no process-wide hook unless the user arms the recorder."""

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="muon_flight_arm_")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def test_import_construction_and_steps_install_nothing(self) -> None:
        changed = _probe_hooks({fr.ENV_DIR: self.dir})
        self.assertTrue(changed.pop("recorded"), "recording must stay on by default")
        self.assertEqual(changed, dict.fromkeys(changed, False),
                         f"unarmed, these process-wide hooks were changed: {changed}")

    def test_env_var_arms_and_disarm_restores_everything(self) -> None:
        changed = _probe_hooks({fr.ENV_DIR: self.dir, fr.ENV_ARM: "1"}, "--disarm")
        self.assertEqual(
            {k: changed[k] for k in ("excepthook", "sigusr1", "wakeup_fd", "watchdog")},
            {"excepthook": True, "sigusr1": True, "wakeup_fd": True, "watchdog": True},
            f"{fr.ENV_ARM}=1 must install every trigger: {changed}")
        self.assertEqual(changed["after_disarm"], [False] * 4,
                         "disarm must restore excepthook, SIGUSR1, the wake-up fd and stop "
                         "the watchdog (in that order)")

    def test_arm_twice_then_disarm_restores_a_later_hook_untouched(self) -> None:
        rec = fr.FlightRecorder()
        previous, hook = signal.getsignal(signal.SIGUSR1), sys.excepthook
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        seen = []
        try:
            with mock.patch.dict(os.environ, {fr.ENV_DIR: "", fr.LAUNCHER_LOG_DIR_ENV: ""}), \
                    mock.patch.object(fr, "_RECORDER", rec):
                self.assertIs(fr.arm(), rec)
                ours = sys.excepthook
                rec.arm()  # idempotent: no second wrapper
                self.assertIs(sys.excepthook, ours, "a second arm() wrapped the hook again")
                self.assertTrue(rec.armed)
                sys.excepthook = lambda *a: (seen.append(a[0]), ours(*a))  # user's, later
                later = sys.excepthook
                fr.disarm()
                self.assertFalse(rec.armed)
                self.assertIs(sys.excepthook, later, "disarm replaced a hook installed later")
                self.assertEqual(signal.getsignal(signal.SIGUSR1), signal.SIG_DFL)
                with mock.patch.object(rec, "dump") as dump, mock.patch.object(sys, "stderr"):
                    sys.excepthook(ValueError, ValueError("x"), None)
                dump.assert_not_called()  # disarmed: passes through
                self.assertEqual(seen, [ValueError])
        finally:
            sys.excepthook = hook
            signal.signal(signal.SIGUSR1, previous)

    def test_env_arm_happens_once_on_the_main_thread(self) -> None:
        import threading

        with mock.patch.dict(os.environ, {fr.ENV_ARM: "1", fr.ENV_DIR: self.dir}):
            rec = fr.FlightRecorder()
        group = _Group(3, [0, 1])
        with mock.patch.object(rec, "arm") as arm:
            side = threading.Thread(
                target=lambda: rec.start("reduce", group, 0, paddle.ones([1]), None))
            side.start()
            side.join()
            self.assertEqual(arm.call_count, 0, "armed from a thread that cannot take signals")
            rec.start("reduce", group, 0, paddle.ones([1]), None)
            rec.start("reduce", group, 0, paddle.ones([1]), None)
        self.assertEqual(arm.call_count, 1, "the env var arms at the first collective only")
        with mock.patch.dict(os.environ, {fr.ENV_ARM: "0"}):
            self.assertFalse(fr.FlightRecorder()._arm_from_env)


class TestSimulatedWorldSpeaksTheSameWords(unittest.TestCase):
    def test_deadlock_report_names_stalled_rank_and_phase(self) -> None:
        cfg = SimConfig(ep=2, ms=2, gpn=2, steps=2)
        with _stall(3, "cross_node_reduce", 1, sleep_s=4.0):
            with self.assertRaises(DeadlockError) as info:
                run_world(cfg, deadlock_timeout=1.0)
        message = str(info.exception)
        self.assertIn(f"rank 3 {CULPRIT}: in phase 'cross_node_reduce'", message)
        self.assertIn("waits in reduce", message)


class TestProfilerPhases(unittest.TestCase):
    def test_every_recorded_phase_is_a_profiler_event(self) -> None:
        trace_dir = tempfile.mkdtemp(prefix="muon_prof_")
        self.addCleanup(shutil.rmtree, trace_dir, True)
        prof = profiler.Profiler(targets=[profiler.ProfilerTarget.CPU],
                                 on_trace_ready=profiler.export_chrome_tracing(trace_dir))
        prof.start()
        try:
            _, world = run_world(SimConfig(ep=2, ms=2, gpn=2, steps=1), mode="record")
        finally:
            prof.stop()
        recorded = {rec.phase for trace in world.traces for rec in trace if rec.phase}
        self.assertTrue({"intra_node_reduce", "cross_node_reduce", "cross_node_broadcast",
                         "intra_node_broadcast", "reduce_scatter",
                         "all_gather_slices"} <= recorded, recorded)
        names = set()
        for path in glob.glob(os.path.join(trace_dir, "*.json")):
            with open(path) as f:
                # Paddle appends the duration: "intra_node_reduce[12.3 us]".
                names |= {re.sub(r"\[[0-9.]+ [a-z]*s\]$", "", str(e.get("name", "")))
                          for e in json.load(f)["traceEvents"]}
        self.assertEqual(recorded - names, set(), "phases the profiler did not see")


class TestStuckRankInRealGlooJob(unittest.TestCase):
    """4 gloo processes; rank 3 stalls in 'cross_node_reduce' of step 2."""

    @staticmethod
    def _states(log_dir: str, newest: bool = False) -> dict:
        """rank -> (state, dump) of each rank's first dump of the stall
        (``muon_flight_rank<R>.json``), or with ``newest`` its latest one
        (the highest ``muon_flight_rank<R>.<n>.json``)."""
        def number(path: str) -> int:
            m = re.search(r"\.(\d+)\.json$", path)
            return int(m.group(1)) if m else 1

        states, numbers = {}, {}
        for path in glob.glob(os.path.join(log_dir, f"{fr.DUMP_PREFIX}*.json")):
            with open(path) as f:
                data = json.load(f)
            rank, n = data["rank"], number(path)
            if rank not in numbers or (n > numbers[rank]) == newest:
                states[rank], numbers[rank] = (fr.RankState.from_dump(data), data), n
        return states

    def test_hangs_names_stuck_rank_and_phase(self) -> None:
        log_dir = tempfile.mkdtemp(prefix="muon_flight_job_")
        self.addCleanup(shutil.rmtree, log_dir, True)
        rounds: dict[str, dict] = {}

        def two_rounds(d: str) -> bool:
            """Round 1: the watchdog's timeout dumps (and the peers it asks).
            Round 2: ``kill -USR1`` every rank, blocked ones included."""
            states = self._states(d, newest="watchdog" in rounds)
            if len(states) < 4:
                return False
            if "watchdog" not in rounds:
                time.sleep(0.5)  # a dump still being renamed into place
                rounds["watchdog"] = self._states(d)
                for path in glob.glob(os.path.join(d, f"{fr.DUMP_PREFIX}*.json")):
                    os.remove(path)
                for _, data in rounds["watchdog"].values():
                    os.kill(data["pid"], signal.SIGUSR1)
                return False
            if all(data["reason"] == "SIGUSR1" for _, data in states.values()):
                rounds["sigusr1"] = states
                return True
            return False

        env = {"PADDLE_LOCAL_SIZE": "2", fr.ENV_TIMEOUT: "3", fr.ENV_ARM: "1",
               "MUON_FLIGHT_STUCK_RANK": "3", "MUON_FLIGHT_STUCK_PHASE": "cross_node_reduce",
               "MUON_FLIGHT_STUCK_STEP": "1", "MUON_FLIGHT_STUCK_S": "120"}
        result = run_paddle_launch(STUCK_WORKER, 4, env=env, timeout_s=150,
                                   log_dir=log_dir, stop_when=two_rounds)
        self.assertTrue(result.stopped, result.failure_message())
        for label, states in rounds.items():
            reasons = {rank: data["reason"] for rank, (_, data) in states.items()}
            # What `paddle-muon-ext hangs LOG_DIR` prints after its per-rank lines.
            lines = fr.diagnose({rank: st for rank, (st, _) in states.items()}, world_size=4)
            text = "\n".join(lines) + f"\nreasons: {reasons}"
            culprit = [line for line in lines if CULPRIT in line]
            self.assertEqual(len(culprit), 1, f"[{label}] {text}")
            self.assertTrue(
                culprit[0].startswith(f"rank 3 {CULPRIT}: in phase 'cross_node_reduce'"),
                f"[{label}] {text}")
            self.assertIn("waits in reduce", text)
            # the stuck rank's dump holds its main thread's stack, asleep in
            # the worker's stalled(); a waiting rank's names its blocked thread
            main = [st for st in states[3][1]["stacks"] if st["main"]]
            self.assertEqual(len(main), 1, f"[{label}]")
            self.assertRegex("".join(main[0]["frames"]), r"in stalled\n", f"[{label}]")
            waiting = [data for st, data in states.values() if st.in_flight]
            self.assertTrue(waiting and all(data["stacks"][0]["in_collective"]
                                            for data in waiting), f"[{label}]")
        self.assertTrue(any(r.startswith("collective timeout") for r in (
            data["reason"] for _, data in rounds["watchdog"].values())), rounds["watchdog"])


if __name__ == "__main__":
    unittest.main()
