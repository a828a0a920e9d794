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
"""The flight recorder's dump files and what their stacks show.

* The first dump of a stall keeps its file; later dumps of the same stall go
  beside it (``muon_flight_rank<R>.<n>.json``), a new stall replaces it.
* A dump taken for an exception (the exception hook, a collective that
  raised) shows where the exception was raised, not the recorder's frames.
* Dumps are written under an ASCII locale with non-ASCII text and paths.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import unittest
from unittest import mock

import paddle
import paddle.distributed as dist

import paddle_muon_ext
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_flight import recorder as fr
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import runtime as comm

RECORDER_FRAMES = ("in excepthook", "in dump", "in snapshot", "in thread_stacks")
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(paddle_muon_ext.__file__)))


class _Group:
    def __init__(self, gid: int, ranks: list[int]) -> None:
        self.id, self.ranks, self.nranks = gid, ranks, len(ranks)


class _DumpDirCase(unittest.TestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="muon_flight_dumps_")
        self.addCleanup(shutil.rmtree, self.dir, True)
        env = {fr.ENV_DIR: self.dir, "PADDLE_TRAINER_ID": "0", "PADDLE_TRAINERS_NUM": "2"}
        patcher = mock.patch.dict(os.environ, env)
        patcher.start()
        self.addCleanup(patcher.stop)

    def _files(self) -> dict:
        """file name -> the reason of the dump in it."""
        out = {}
        for name in sorted(os.listdir(self.dir)):
            if name.startswith(fr.DUMP_PREFIX):
                with open(os.path.join(self.dir, name)) as f:
                    out[name] = json.load(f)["reason"]
        return out


class TestFirstDumpOfAStallIsKept(_DumpDirCase):
    def test_later_dumps_of_a_stall_go_beside_the_first(self) -> None:
        """Steps of one process's life, each with the dump files it leaves:
        the watchdog's timeout dump is kept while the collective stays in
        flight (the gloo timeout and the exception hook go to .2 and .3); a
        new stall replaces it and removes the old later dumps; with nothing
        in flight the stall lasts until a collective is issued; past
        MAX_DUMPS_PER_STALL the last file holds the newest dump."""
        rec = fr.FlightRecorder(capacity=8)
        rec.timeout_s = 3.0
        group = _Group(7, [0, 1])
        base, second, third = (f"{fr.DUMP_PREFIX}0{n}.json" for n in ("", ".2", ".3"))
        entry = rec.start("reduce", group, 0, paddle.ones([4]), "cross_node_reduce")
        timeout = rec.check_once(entry[fr.FIELDS.index("start")] + 4.0)
        self.assertTrue(timeout.startswith("collective timeout: reduce #0 on group 7"), timeout)
        steps = [
            ("gloo timeout", lambda: rec.dump("reduce raised RuntimeError: Timed out"),
             {base: timeout, second: "reduce raised RuntimeError: Timed out"}),
            ("exception hook", lambda: rec.dump("uncaught RuntimeError: Timed out"),
             {base: timeout, second: "reduce raised RuntimeError: Timed out",
              third: "uncaught RuntimeError: Timed out"}),
            ("a new stall", lambda: (rec.finish([entry]),
                                     rec.start("broadcast", group, 1, paddle.ones([2]), "p"),
                                     rec.dump("SIGUSR1 in the next stall")),
             {base: "SIGUSR1 in the next stall"}),
            ("again, in flight", lambda: rec.dump("requested by rank 1: x"),
             {base: "SIGUSR1 in the next stall", second: "requested by rank 1: x"}),
        ]
        for label, act, files in steps:
            with self.subTest(label):
                act()
                self.assertEqual(self._files(), files)
        # nothing in flight: the same stall until a collective is issued
        rec.finish(list(rec._in_flight.values()))
        idle = [("idle", "requested by rank 1: a", {base: "requested by rank 1: a"}),
                ("still idle", "requested by rank 1: b",
                 {base: "requested by rank 1: a", second: "requested by rank 1: b"})]
        for label, reason, files in idle:
            with self.subTest(label):
                rec.dump(reason)
                self.assertEqual(self._files(), files)
        with self.subTest("issued since"):
            rec.finish([rec.start("all_gather", group, None, paddle.ones([2]), "p")])
            rec.dump("requested by rank 1: c")
            self.assertEqual(self._files(), {base: "requested by rank 1: c"})
        with self.subTest("past the cap"):
            for n in range(2, getattr(fr, "MAX_DUMPS_PER_STALL", 9) + 3):
                rec.dump(f"SIGUSR1 #{n}")
            files = self._files()
            cap = getattr(fr, "MAX_DUMPS_PER_STALL", 9)
            self.assertEqual(sorted(files), sorted(
                [base] + [f"{fr.DUMP_PREFIX}0.{n}.json" for n in range(2, cap + 1)]))
            self.assertEqual(files[f"{fr.DUMP_PREFIX}0.{cap}.json"], f"SIGUSR1 #{cap + 2}")


def _load_batch_that_raises() -> None:
    raise ValueError("bad batch")


class TestExceptionStacks(_DumpDirCase):
    def _stack(self) -> list:
        with open(fr.dump_path(self.dir, 0)) as f:
            stacks = json.load(f)["stacks"]
        main = [s for s in stacks if s["main"]]
        self.assertEqual(len(main), 1, stacks)
        return main[0]["frames"]

    def test_exception_hook_dump_shows_where_the_exception_was_raised(self) -> None:
        """The armed exception hook's dump: the main thread's stack ends in the
        function that raised, with its caller above it, and holds none of the
        recorder's own frames (excepthook -> dump -> snapshot -> thread_stacks)."""
        rec = fr.FlightRecorder()
        previous, hook = signal.getsignal(signal.SIGUSR1), sys.excepthook
        try:
            rec.arm()
            try:
                _load_batch_that_raises()
            except ValueError as exc:
                error = exc
            with mock.patch.object(sys, "stderr"):
                sys.excepthook(ValueError, error, error.__traceback__)
        finally:
            rec.disarm()
            signal.signal(signal.SIGUSR1, previous)
            sys.excepthook = hook
        frames = self._stack()
        self.assertIn("in _load_batch_that_raises", frames[-1])
        self.assertIn('raise ValueError("bad batch")', frames[-1])
        self.assertIn("in test_exception_hook_dump_shows_where", frames[-2])
        self.assertFalse([f for f in frames if any(r in f for r in RECORDER_FRAMES)], frames)

    def test_collective_that_raised_dumps_where_it_raised(self) -> None:
        """A collective whose call raises: the dump's stack runs from the
        caller through the optimizer's collective into the raising call."""
        def _transport_fails(*_a, **_k):
            raise RuntimeError("gloo TIMEOUT")

        rec = fr.FlightRecorder()
        with mock.patch.object(comm, "get_flight_recorder", return_value=rec), \
                mock.patch.object(comm._batch_isend_irecv, "_coalescing_manager"), \
                mock.patch.object(dist, "reduce", _transport_fails):
            with self.assertRaisesRegex(RuntimeError, "gloo TIMEOUT"):
                comm.launch_coalesced("reduce", [(paddle.ones([3]), 0)], _Group(9, [0, 1]),
                                      dist.ReduceOp.SUM).wait()
        frames = self._stack()
        self.assertIn("in _transport_fails", frames[-1])
        self.assertTrue(any("in test_collective_that_raised_dumps" in f for f in frames), frames)
        self.assertFalse([f for f in frames if any(r in f for r in RECORDER_FRAMES)], frames)


class TestAsciiLocale(unittest.TestCase):
    def test_dump_with_non_ascii_text_and_paths_under_an_ascii_locale(self) -> None:
        """LC_ALL=C without UTF-8 mode: a script in a non-ASCII directory,
        dumping into a non-ASCII directory for an exception with non-ASCII
        text, writes its dump (the text intact) and logs no encoding error."""
        root = tempfile.mkdtemp(prefix="muon_flight_ascii_")
        self.addCleanup(shutil.rmtree, root, True)
        script_dir, dump_dir = os.path.join(root, "caf\u00e9"), os.path.join(root, "d\u00efr")
        os.mkdir(script_dir)
        script = os.path.join(script_dir, "train.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(textwrap.dedent("""\
                from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_flight import (
                    recorder as fr)
                fr.arm()
                def step():
                    raise ValueError("caf\\u00e9 \\u2713")
                step()
                """))
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONIOENCODING", "LANG", "LC_CTYPE")}
        env.update({"LC_ALL": "C", "PYTHONUTF8": "0", "PADDLE_TRAINER_ID": "0",
                    fr.ENV_DIR: dump_dir,
                    "PYTHONPATH": os.pathsep.join([PACKAGE_ROOT, env.get("PYTHONPATH", "")])})
        proc = subprocess.run([sys.executable, script], capture_output=True, timeout=120,
                              env=env)
        err = proc.stderr.decode("ascii", "replace")
        self.assertEqual(proc.returncode, 1, err)
        self.assertNotIn("UnicodeEncodeError", err)
        self.assertNotIn("Logging error", err)
        self.assertIn("muon flight recorder: rank 0 dumped", err)
        with open(fr.dump_path(dump_dir, 0), encoding="utf-8") as f:
            data = json.load(f)
        self.assertEqual(data["reason"], "uncaught ValueError: caf\u00e9 \u2713")
        main = next(s for s in data["stacks"] if s["main"])
        # the script's path as the child decoded it (ASCII, bytes escaped)
        self.assertIn(f'{os.sep}train.py", line 5, in step', main["frames"][-1])


if __name__ == "__main__":
    unittest.main()
