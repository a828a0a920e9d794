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
"""The load guard's rarer paths, each forced in one process, not raced.

``test_muon_checkpoint_load_agreement.py`` runs the guard with ranks as
threads; which of its branches a run takes there depends on timing (a peer's
report can land before its heartbeat goes stale), so CI's coverage of the
module moved between 88.6 % and 94 %. Here one ``LoadGuard`` meets each case
on purpose: a peer that never beats, an error too long for its reserved slot,
a report or decision after the directory went, a heartbeat whose file went,
and the sweep of what a killed load left. A peer that dies is the rank named,
also when this rank's own read failed with it (``TestDeadPeerIsNamed``), and
a guard directory whose recorded processes are all gone from this host is
reclaimed at once (``TestSweep``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from unittest import mock

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_checkpoint import (
    load_guard as guard_mod,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_checkpoint import (
    CheckpointLoadError,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_checkpoint.load_guard import (
    GUARD_PREFIX,
    LoadGuard,
)


def dead_pid() -> int:
    """The pid of a process of this host that has exited (and was reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def elsewhere(pid: int) -> dict:
    """An owner record of a process on another host (its pid means nothing here)."""
    return {"host": "other-host|boot|pid:[1]", "pid": pid, "start": "1"}


class _GuardCase(unittest.TestCase):
    def setUp(self) -> None:
        self.root = tempfile.mkdtemp(prefix="muon_load_guard_")
        self.addCleanup(shutil.rmtree, self.root, True)

    def guard(self, rank: int = 0, ranks=(0, 1), timeout_s: float = 0.3) -> LoadGuard:
        return LoadGuard(self.root, "t", rank, list(ranks), "ckpt/checkpoint_3", timeout_s)

    def outcome(self, g: LoadGuard, rank: int) -> dict:
        with open(g._file("outcome", rank), encoding="utf-8") as f:
            return json.load(f)


class TestPeerThatNeverBeats(_GuardCase):
    def test_a_peer_without_a_heartbeat_file_fails_the_load_after_the_timeout(self):
        g = self.guard(timeout_s=0.3)
        g.start()
        t0 = time.monotonic()
        with self.assertRaises(CheckpointLoadError) as cm:
            g.run(lambda: None)  # this rank's own load succeeds; rank 1 never appears
        waited = time.monotonic() - t0
        message = str(cm.exception)
        self.assertIn("loading ckpt/checkpoint_3 failed", message)
        self.assertIn("rank 1: stopped responding (no heartbeat for 0.3 s", message)
        self.assertGreaterEqual(waited, 0.3)
        self.assertLess(waited, 10.0)
        # the last live rank to decide removed the guard (rank 1 counts as dead)
        self.assertFalse(os.path.exists(g.path))


class TestReportEdges(_GuardCase):
    def test_an_error_longer_than_its_slot_is_cut_and_still_published(self):
        g = self.guard()
        g.start()
        self.addCleanup(g._stop.set)
        g._report("E" * (3 * guard_mod._RESERVED))
        got = self.outcome(g, 0)
        self.assertEqual(got["blame"], 0)
        self.assertTrue(got["error"].endswith(" ..."), got["error"][-20:])
        self.assertEqual(len(got["error"]), guard_mod._RESERVED // 8 + 4)
        # written in place into the reserved slot, which was then renamed
        self.assertEqual(os.path.getsize(g._file("outcome", 0)), guard_mod._RESERVED)
        self.assertFalse(os.path.exists(g._file("slot", 0)))

    def test_a_report_after_the_directory_went_stops_the_heartbeat_and_logs(self):
        g = self.guard()
        g.start()
        self.addCleanup(g._stop.set)
        shutil.rmtree(g.path)
        with mock.patch.object(guard_mod.logger, "error") as log:
            g._report("ValueError: boom")
        self.assertTrue(g._stop.is_set(), "the peers must see this rank's heartbeat stop")
        self.assertIn("rank 0 could not report its load to", log.call_args[0][0])
        self.assertFalse(os.path.exists(g.path), "the report recreated the directory")

    def test_deciding_after_another_rank_removed_the_directory_creates_nothing(self):
        g = self.guard()
        g.start()
        g._stop.set()
        shutil.rmtree(g.path)
        g._done(wait=True)  # returns at once: the removal is complete
        self.assertFalse(os.path.exists(g.path))
        self.assertEqual(os.listdir(self.root), [])


class TestHeartbeat(_GuardCase):
    def test_the_heartbeat_outlives_the_removal_of_its_file(self):
        with mock.patch.object(guard_mod, "HEARTBEAT_S", 0.01):
            g = self.guard()
            g.start()
            os.remove(g._file("alive", 0))
            time.sleep(0.1)  # several beats on a missing file
            self.assertTrue(g._beat.is_alive())
            g._stop.set()
            g._beat.join(5)
        self.assertFalse(g._beat.is_alive())


class TestDeadPeerIsNamed(_GuardCase):
    """Rank 0's guard with a stand-in for rank 1: its ``alive`` file holds an
    owner record, touched every 50 ms while it "beats"."""

    def peer(self, g: LoadGuard, record: dict, beats: bool) -> None:
        path = g._file("alive", 1)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(record, f)
        stop = threading.Event()
        self.addCleanup(stop.set)

        def beat() -> None:
            while not stop.wait(0.05):
                try:
                    os.utime(path)
                except OSError:
                    return

        if beats:
            threading.Thread(target=beat, daemon=True).start()

    def test_the_dead_rank_is_named_not_the_rank_whose_read_failed_with_it(self):
        release = threading.Event()
        self.addCleanup(release.set)

        def ok():
            return None

        def fails():
            raise RuntimeError("planted: gloo connection closed by peer pair_rank = 1")

        def blocked():
            release.wait(60)

        dead_here = {"host": guard_mod.host_key(), "pid": dead_pid(), "start": "1"}
        alive_here = guard_mod.owner_record()
        gone = "rank 1: killed: its process (pid {pid}, this host) is gone"
        silent = "rank 1: stopped responding (no heartbeat for {timeout:g} s"
        own = "(rank 0's own read failed with it: RuntimeError: planted"
        # (row, rank 0's read, rank 1's record, rank 1 beats, timeout, named
        #  ranks, fragments, fragments that must be absent, at least seconds)
        table = [
            ("peer process gone, own read fine", ok, dead_here, False, 20.0, [1],
             [gone], [own], 0.0),
            # its own error follows when it raised before the peer was found gone
            ("peer process gone, own read failed with it", fails, dead_here, False, 20.0,
             [1], [gone], ["rank 0: RuntimeError"], 0.0),
            ("peer process gone, own read still blocked", blocked, dead_here, False, 20.0,
             [1], [gone, "Rank 0's own read is still blocked"], [own], 0.0),
            ("peer on another host silent, own read failed", fails, elsewhere(dead_pid()),
             False, 0.6, [1], [silent, own], [], 0.6),
            ("peer on another host beating, own read failed", fails, elsewhere(dead_pid()),
             True, 20.0, [0], ["rank 0: RuntimeError: planted"], ["stopped responding",
                                                                  "killed"], 0.0),
            ("peer alive on this host, own read failed", fails, alive_here, True, 20.0, [0],
             ["rank 0: RuntimeError: planted"], ["stopped responding", "killed"], 0.0),
        ]
        for row, read, record, beats, timeout, named, present, absent, least in table:
            with self.subTest(row):
                root = tempfile.mkdtemp(dir=self.root)
                g = LoadGuard(root, "t", 0, [0, 1], "ckpt/checkpoint_3", timeout)
                g.start()
                self.peer(g, record, beats)
                t0 = time.monotonic()
                with self.assertRaises(guard_mod.CheckpointLoadError) as cm:
                    g.run(read)
                took = time.monotonic() - t0
                message = str(cm.exception)
                self.assertIn(f"load_state_dict on rank(s) {named}", message)
                for fragment in present:
                    self.assertIn(fragment.format(pid=record["pid"], timeout=timeout),
                                  message)
                for fragment in absent:
                    self.assertNotIn(fragment, message)
                self.assertGreaterEqual(took, least)
                self.assertLess(took, 10.0, "a dead peer on this host is found at once")


class TestSweep(_GuardCase):
    def test_a_killed_loads_directory_goes_once_stale_and_a_live_one_stays(self):
        stale = os.path.join(self.root, f"{GUARD_PREFIX}old")
        live = os.path.join(self.root, f"{GUARD_PREFIX}new")
        for d in (stale, live):
            os.makedirs(d)
            open(os.path.join(d, "alive_0"), "wb").close()
        past = time.time() - guard_mod.STALE_S - 60
        for path in (os.path.join(stale, "alive_0"), stale):
            os.utime(path, (past, past))
        other = os.path.join(self.root, "checkpoint_3")
        os.makedirs(other)
        os.utime(other, (past, past))
        guard_mod._sweep_stale(self.root)
        self.assertEqual(sorted(os.listdir(self.root)),
                         sorted(["checkpoint_3", f"{GUARD_PREFIX}new"]))

    def test_a_guard_whose_processes_are_gone_from_this_host_goes_at_once(self):
        here = guard_mod.host_key()
        dead = {"host": here, "pid": dead_pid(), "start": "1"}
        reused = dict(guard_mod.owner_record(), start="0")  # a live pid, another start
        # (row, {file: content or None for an empty file}, reclaimed at once)
        table = [
            ("one rank, process gone", {"alive_0": dead}, True),
            ("two ranks, both gone", {"alive_0": dead, "alive_1": dead}, True),
            ("pid reused by another process", {"alive_0": reused}, True),
            ("one rank still running here", {"alive_0": dead,
                                             "alive_1": guard_mod.owner_record()}, False),
            ("a rank on another host", {"alive_0": dead, "alive_1": elsewhere(1)}, False),
            ("an empty alive file", {"alive_0": dead, "alive_1": None}, False),
            ("no alive file yet", {"slot_0": None}, False),
            ("a record of the wrong shape", {"alive_0": {"host": here, "pid": "7"}}, False),
        ]
        for row, files, reclaimed in table:
            with self.subTest(row):
                path = os.path.join(self.root, f"{GUARD_PREFIX}{abs(hash(row))}")
                os.makedirs(path)
                for name, content in files.items():
                    with open(os.path.join(path, name), "w", encoding="utf-8") as f:
                        if content is not None:
                            json.dump(content, f)
                guard_mod._sweep_stale(self.root)
                self.assertEqual(os.path.exists(path), not reclaimed)
                shutil.rmtree(path, ignore_errors=True)

    def test_a_killed_loaders_directory_is_reclaimed_by_the_next_load(self):
        # a real loader process: it starts its guard and is SIGKILLed
        script = (
            "import sys, time\n"
            "from paddle_muon_ext.distributed.fleet.meta_optimizers."
            "muon_checkpoint.load_guard import LoadGuard\n"
            "g = LoadGuard(sys.argv[1], 'killed', 0, [0, 1], 'ckpt', 30.0)\n"
            "g.start()\nprint('started', flush=True)\ntime.sleep(60)\n")
        child = subprocess.Popen([sys.executable, "-c", script, self.root],
                                 stdout=subprocess.PIPE, text=True)
        self.addCleanup(child.kill)
        self.assertEqual(child.stdout.readline().strip(), "started")
        left = os.path.join(self.root, f"{GUARD_PREFIX}killed")
        self.assertTrue(os.path.isdir(left))
        child.kill()
        child.wait()
        g = self.guard()
        g.start()  # the next load
        self.addCleanup(g._stop.set)
        self.assertFalse(os.path.exists(left), "the killed load's guard is still there")
        self.assertTrue(os.path.isdir(g.path))

    def test_missing_roots_are_no_error(self):
        missing = os.path.join(self.root, "gone")
        guard_mod._sweep_stale(missing)
        self.assertFalse(guard_mod._removal_pending(os.path.join(missing, f"{GUARD_PREFIX}t")))
        self.assertFalse(os.path.exists(missing))

    def test_a_renamed_away_copy_counts_as_removal_pending(self):
        path = os.path.join(self.root, f"{GUARD_PREFIX}t")
        self.assertFalse(guard_mod._removal_pending(path))
        os.makedirs(f"{path}.gone-1-2-3")
        self.assertTrue(guard_mod._removal_pending(path))


class TestEveryRankLoaded(_GuardCase):
    def test_two_guards_in_threads_both_return_and_leave_nothing(self):
        guards = [self.guard(r, timeout_s=5.0) for r in (0, 1)]
        errors = []

        def rank(g):
            try:
                g.start()
                g.run(lambda: None)
            except BaseException as exc:  # noqa: BLE001 - asserted below
                errors.append(exc)

        threads = [threading.Thread(target=rank, args=(g,)) for g in guards]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        self.assertEqual(errors, [])
        self.assertEqual(os.listdir(self.root), [])


if __name__ == "__main__":
    unittest.main()
