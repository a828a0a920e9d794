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
"""A failure inside Paddle's own load is one error on every rank.

Spec: after every check of ``load_sharded_checkpoint`` passed, a rank whose
``paddle.distributed.load_state_dict`` raises makes every rank raise
``CheckpointLoadError`` naming that rank, the checkpoint and the error -
promptly, also a rank still blocked in Paddle's collectives waiting for the
failed one, and also a rank whose own load had already finished (nobody
trains on with a rank that loaded nothing). A rank returns only once every
rank loaded; a rank that stops responding fails the others after the
timeout. The guard's files are gone afterwards.

In process, ranks are threads and ``ThreadRanks.read`` stands for Paddle's
load (a rank "blocked in a collective" waits on an event); the last case is a
real 2-rank gloo job (``muon_checkpoint_fault_worker.py``) whose rank 1
cannot read its shard inside Paddle's load and stays alive meanwhile, and one
whose rank 1 is SIGKILLed there: the surviving rank names rank 1, not itself.
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

from muon_checkpoint_helpers import ThreadRanks, _Dir, arrays, whole

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_checkpoint import load as load_mod
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_checkpoint import (
    CheckpointLoadError,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_checkpoint.load_guard import (
    GUARD_PREFIX,
    LoadGuard,
)

HERE = os.path.dirname(os.path.abspath(__file__))
#: Far below any collective timeout: "promptly".
PROMPT_S = 10.0


def reader_rank(ranks: ThreadRanks) -> int:
    """The rank a stand-in for Paddle's load runs for: the guard's helper
    thread carries it in its name (thread-local state stays with the caller)."""
    name = threading.current_thread().name
    if name.startswith("checkpoint-load-"):
        return int(name.rsplit("-", 1)[1])
    return ranks.local.rank


class TestLoadAgreement(_Dir):
    def setUp(self):
        super().setUp()
        self.directory = save_sharded_checkpoint(whole(arrays(1)), self.root)
        self.release = threading.Event()
        self.addCleanup(self.release.set)  # never leave a "blocked" rank behind

    def _load_all(self, ranks: ThreadRanks) -> tuple[dict, dict]:
        took: dict[int, float] = {}
        self.ended: dict[int, float] = {}

        self.left_at_return: dict[int, list] = {}

        def body(rank):
            start = time.monotonic()
            try:
                loaded = load_sharded_checkpoint(whole(arrays(1)), self.root)
                self.left_at_return[rank] = self._guard_left()
                return loaded
            finally:
                self.ended[rank] = time.monotonic()
                took[rank] = self.ended[rank] - start

        return ranks.run(body), took

    def _guard_left(self) -> list[str]:
        return [n for n in os.listdir(self.root) if n.startswith(GUARD_PREFIX)]

    def test_a_rank_failing_inside_paddles_load_fails_a_blocked_peer_promptly(self):
        ranks = ThreadRanks(2, self.root)

        def read(*args, **kwargs):
            if reader_rank(ranks) == 1:
                raise PermissionError(13, "Permission denied", "1_0.distcp")
            self.release.wait(60)  # rank 0 waits in a "collective" for rank 1

        ranks.read = read
        results, took = self._load_all(ranks)
        for rank in (0, 1):
            error = results[rank]
            self.assertIsInstance(error, CheckpointLoadError, f"rank {rank}: {error!r}")
            self.assertIn(f"loading {self.directory} failed inside "
                          "paddle.distributed.load_state_dict on rank(s) [1]", str(error))
            self.assertIn("rank 1: PermissionError: [Errno 13] Permission denied",
                          str(error))
            self.assertLess(took[rank], PROMPT_S, f"rank {rank} waited for the failed rank")
        self.assertIn("Rank 0's own read is still blocked", str(results[0]))
        self.assertNotIn("still blocked", str(results[1]))
        self.assertIsInstance(results[1].__cause__, PermissionError)
        self.assertEqual(self._guard_left(), [], "the guard's files must be removed")

    def test_a_rank_failing_after_the_others_finished_still_fails_every_rank(self):
        ranks = ThreadRanks(2, self.root)

        def read(*args, **kwargs):
            if reader_rank(ranks) == 1:
                time.sleep(0.3)  # rank 0 has returned from Paddle's load by now
                raise MemoryError("planted: out of memory copying the last tensor")

        ranks.read = read
        results, _ = self._load_all(ranks)
        for rank in (0, 1):
            self.assertIsInstance(results[rank], CheckpointLoadError, f"rank {rank}")
            self.assertIn("rank 1: MemoryError: planted", str(results[rank]))
        self.assertEqual(str(results[0]), str(results[1]), "one message on every rank")

    def test_every_rank_returns_only_once_all_loaded(self):
        ranks = ThreadRanks(3, self.root)
        finished: dict[int, float] = {}

        def read(*args, **kwargs):
            time.sleep(0.4 if reader_rank(ranks) == 2 else 0.0)
            finished[reader_rank(ranks)] = time.monotonic()

        ranks.read = read
        results, _ = self._load_all(ranks)
        self.assertEqual(results, {r: self.directory for r in range(3)})
        for rank in (0, 1):
            self.assertGreaterEqual(self.ended[rank], finished[2],
                                    f"rank {rank} returned before rank 2 had loaded")
        # a rank that lists the directory right after its load sees no guard files
        self.assertEqual(self.left_at_return, {0: [], 1: [], 2: []})

    def test_a_rank_that_stops_responding_fails_the_others(self):
        ranks = ThreadRanks(2, self.root)
        real_start = load_mod.LoadGuard.start

        def start(guard):
            real_start(guard)
            if guard.rank == 1:  # "killed": its heartbeat stops at once
                guard._stop.set()

        def read(*args, **kwargs):
            if reader_rank(ranks) == 1:
                self.release.wait(60)

        ranks.read = read
        with mock.patch.object(load_mod, "DEFAULT_TIMEOUT_S", 1.0), \
                mock.patch.object(load_mod.LoadGuard, "start", start):
            timer = threading.Timer(6.0, self.release.set)  # lets rank 1's thread end
            timer.start()
            results, took = self._load_all(ranks)
            timer.cancel()
        self.assertIsInstance(results[0], CheckpointLoadError)
        self.assertIn("rank 1: stopped responding (no heartbeat for 1 s", str(results[0]))
        self.assertLess(took[0], 5.0)
        # rank 1 only looked dead: it fails as well instead of training on alone
        self.assertIsInstance(results[1], CheckpointLoadError)
        self.assertEqual(self._guard_left(), [], "nothing left for the dead rank")

    def test_unwritable_root_loads_unsupervised_and_still_names_the_rank(self):
        ranks = ThreadRanks(2, self.root)

        def read(*args, **kwargs):
            if reader_rank(ranks) == 1:
                raise OSError("planted")

        ranks.read = read
        with mock.patch.object(load_mod, "_guard_of", lambda d: (self.root, False)):
            results, _ = self._load_all(ranks)
        self.assertEqual(results[0], self.directory)  # nothing to tell rank 0 with
        self.assertIsInstance(results[1], CheckpointLoadError)
        self.assertIn("on rank 1: OSError: planted", str(results[1]))



def _launch_fault_case(test: unittest.TestCase, case: str):
    """Two gloo ranks of muon_checkpoint_fault_worker.py running ``case``;
    returns (the launch result, the checkpoint root it used)."""
    from launch_utils import run_paddle_launch

    repo = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
    tmp = tempfile.mkdtemp(prefix="muon_ckpt_load_fault_")
    test.addCleanup(shutil.rmtree, tmp, True)
    root = os.path.join(tmp, "ckpt")
    env = {"FAULT_CASE": case, "PYTHONPATH": os.pathsep.join(
        [os.path.join(repo, "python"), HERE, os.path.join(repo, "test"),
         os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    result = run_paddle_launch(os.path.join(HERE, "muon_checkpoint_fault_worker.py"), 2,
                               env, timeout_s=180, args=[root]).check()
    return result, root


class TestLoadFailsInsidePaddleOnGloo(unittest.TestCase):
    """Two gloo ranks: rank 1 cannot read its shard inside Paddle's load."""

    def test_every_rank_fails_promptly_naming_rank_and_checkpoint(self):
        result, root = _launch_fault_case(self, "load_fails_inside_paddle")
        outcomes = {}
        for log in result.worker_logs.values():
            for line in log.splitlines():
                if line.startswith("FAULT "):
                    data = json.loads(line[len("FAULT "):])
                    outcomes[data["rank"]] = data
        self.assertEqual(sorted(outcomes), [0, 1], result.failure_message())
        for rank, data in outcomes.items():
            self.assertEqual(data["error"], "CheckpointLoadError", f"rank {rank}: {data}")
            self.assertIn(f"loading {data['directory']} failed inside "
                          "paddle.distributed.load_state_dict on rank(s) [1]", data["message"])
            self.assertIn("1_0.distcp", data["message"])
            self.assertLess(data["seconds"], PROMPT_S, f"rank {rank} was not prompt")
        self.assertEqual([n for n in os.listdir(root) if n.startswith(GUARD_PREFIX)], [])


class TestRankKilledInsideLoadOnGloo(unittest.TestCase):
    """Two gloo ranks: rank 1 is SIGKILLed while Paddle's load reads its shard."""

    def test_the_surviving_rank_names_the_killed_rank_at_once(self):
        result, root = _launch_fault_case(self, "rank_killed_inside_load")
        self.assertIn("FAULT_CHILD_EXIT -9", result.worker_logs[1], "rank 1 was not SIGKILLed")
        killed = [line.split("pid=")[1] for line in result.worker_logs[1].splitlines()
                  if line.startswith("FAULT_KILLING pid=")]
        lines = [json.loads(line[len("FAULT "):]) for line in result.worker_logs[0].splitlines()
                 if line.startswith("FAULT ")]
        self.assertEqual(len(lines), 1, result.failure_message())
        data = lines[0]
        self.assertEqual(data["error"], "CheckpointLoadError", data["message"])
        self.assertIn(f"loading {data['directory']} failed inside "
                      "paddle.distributed.load_state_dict on rank(s) [1]", data["message"])
        self.assertIn(f"rank 1: killed: its process (pid {killed[0]}, this host) is gone",
                      data["message"])
        self.assertNotIn("rank 0:", data["message"], "the surviving rank named itself")
        self.assertLess(data["seconds"], PROMPT_S, "the dead rank is found at once, not "
                        "after the heartbeat timeout")
        self.assertEqual(data["left"], [], "the surviving rank removes the guard directory")


class TestGuardRemoval(unittest.TestCase):
    def test_a_rank_deciding_while_the_last_one_removes_the_guard_leaves_nothing(self):
        # The race seen once in CI: rank 0 found rank 1 dead and removed the
        # guard while rank 1, only slow, wrote its "decided" file into it; the
        # directory was listed, emptied, then could not be removed.
        root = tempfile.mkdtemp(prefix="muon_guard_race_")
        self.addCleanup(shutil.rmtree, root, True)
        guards = [LoadGuard(root, "race", r, [0, 1], "ckpt", timeout_s=5.0) for r in (0, 1)]
        for g in guards:
            g.start()
            self.addCleanup(g._stop.set)
        late = os.path.join(guards[1].path, "decided_1")
        real_rmdir = os.rmdir
        wrote = []

        def rmdir_after_a_late_write(path, *args, **kwargs):
            if not wrote:  # the slow rank writes between the listing and the removal
                wrote.append(True)
                try:
                    open(late, "wb").close()
                except OSError:
                    wrote.append("refused: the guard was already gone")
            return real_rmdir(path, *args, **kwargs)

        guards[0]._dead.add(1)
        with mock.patch("os.rmdir", rmdir_after_a_late_write):
            guards[0]._done(wait=False)
        self.assertTrue(wrote, "the removal never reached os.rmdir")
        self.assertEqual([n for n in os.listdir(root) if n.startswith(GUARD_PREFIX)], [],
                         "a half-removed guard directory was left")


if __name__ == "__main__":
    unittest.main()
