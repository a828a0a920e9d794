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
and the sweep of what a killed load left.
"""

from __future__ import annotations

import json
import os
import shutil
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
