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
"""Interrupted tools leave nothing behind: ``demo`` and ``verify`` started as a
user would (a subprocess), signalled mid-run with SIGINT / SIGTERM, must exit
128 + signal with no descendant process alive and no temporary directory left
(each run gets its own ``TMPDIR``, which must be empty afterwards).

``cluster``'s run is tested the same way in
``test/collective/fleet/test_muon_cluster.py`` (it needs root and namespaces).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

from tool_loader import REPO_ROOT


def _children_map() -> dict:
    kids: dict = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        kids.setdefault(int(fields[1]), []).append((int(entry), fields[0]))
    return kids


def descendants(pid: int) -> list:
    """Live (not zombie) descendants of ``pid``, through every generation."""
    kids, out, todo = _children_map(), [], [pid]
    while todo:
        for child, state in kids.get(todo.pop(), []):
            if state != "Z":
                out.append(child)
            todo.append(child)
    return out


def alive(pids) -> list:
    """The ``pids`` still running (a zombie waiting for its reaper is dead)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(pid)
        except OSError:
            pass
    return out


@unittest.skipUnless(os.path.isdir("/proc"), "needs /proc to see the process tree")
class TestInterruptedToolsLeaveNothing(unittest.TestCase):
    def _start(self, argv, tmp: str) -> subprocess.Popen:
        env = dict(os.environ, TMPDIR=tmp, PYTHONPATH=os.pathsep.join(
            [os.path.join(REPO_ROOT, "python"), os.environ.get("PYTHONPATH", "")]))
        return subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, cwd=tmp)

    def _interrupt(self, argv, sig: int, ready) -> tuple:
        """Start ``argv``, wait until ``ready(proc, seen_pids)``, send ``sig``;
        returns (exit status, output, every descendant seen, those still alive
        after the tool exited, TMPDIR entries)."""
        tmp = tempfile.mkdtemp(prefix="muon_sig_")
        self.addCleanup(shutil.rmtree, tmp, True)
        proc = self._start(argv, tmp)
        seen: set = set()
        leaked: list = []
        try:
            deadline = time.monotonic() + 240
            while not ready(proc, seen):
                self.assertIsNone(proc.poll(), "the tool ended before it could be interrupted")
                self.assertLess(time.monotonic(), deadline, "the tool never got going")
                seen.update(descendants(proc.pid))
                time.sleep(0.2)
            seen.update(descendants(proc.pid))
            proc.send_signal(sig)
            out, _ = proc.communicate(timeout=90)
            time.sleep(0.3)
            leaked = alive(seen)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
            for pid in alive(seen):  # do not leak them into the rest of the suite
                os.kill(pid, signal.SIGKILL)
        return proc.returncode, out, seen, leaked, os.listdir(tmp)

    def assert_clean(self, sig: int, code: int, out: str, seen, leaked, left,
                     need: int) -> None:
        name = signal.Signals(sig).name
        self.assertGreaterEqual(len(seen), need, f"{name}: the processes never appeared")
        self.assertEqual(code, 128 + sig, f"{name}: exit status\n{out[-2000:]}")
        self.assertEqual(leaked, [], f"{name}: processes outlived the tool")
        self.assertEqual(left, [], f"{name}: temporary files left behind")
        self.assertIn(f"interrupted by signal {name}", out)
        self.assertNotIn("Traceback", out)

    def test_demo_ends_its_launcher_and_workers(self) -> None:
        demo = os.path.join(REPO_ROOT, "tools", "demo.py")
        # the launcher and its 8 workers are running (importing paddle)
        for sig in (signal.SIGINT, signal.SIGTERM):
            with self.subTest(signal=signal.Signals(sig).name):
                def running(proc, seen: set) -> bool:
                    # count what this look saw into `seen`: a short-lived
                    # child (one of the launcher's) counted here may be gone
                    # by the next look
                    now = descendants(proc.pid)
                    seen.update(now)
                    return len(now) >= 9

                code, out, seen, leaked, left = self._interrupt(
                    [demo, "--steps", "50"], sig, running)
                self.assert_clean(sig, code, out, seen, leaked, left, need=9)
                self.assertIn("the launcher, its workers and the log dir were removed", out)

    def test_verify_ends_mid_run(self) -> None:
        tool = os.path.join(REPO_ROOT, "tools", "muon_comm.py")
        lines: list = []

        def running(proc, _seen) -> bool:
            # the first progress line: paddle is imported, the world is running
            lines.append(proc.stdout.readline())
            return lines[-1].startswith("[verify]")

        for sig in (signal.SIGINT, signal.SIGTERM):
            with self.subTest(signal=signal.Signals(sig).name):
                lines.clear()
                start = time.monotonic()
                code, out, seen, leaked, left = self._interrupt(
                    [tool, "verify", "--ep", "8", "--moe-sharding", "2", "--gpus-per-node",
                     "4", "--steps", "10"], sig, running)
                out = "".join(lines) + out
                self.assert_clean(sig, code, out, seen, leaked, left, need=0)
                self.assertNotIn("PASS ranks=", out, "the run went on to its verdict")
                self.assertLess(time.monotonic() - start, 120)


class TestInterruptsRaise(unittest.TestCase):
    """The handler the tools install in their main only, in this process."""

    def _signal_self(self, sig: int) -> None:
        os.kill(os.getpid(), sig)
        for _ in range(200):  # the handler runs between bytecodes of the main thread
            time.sleep(0.01)

    def test_a_signal_ends_the_block_and_the_handlers_come_back(self) -> None:
        from paddle_muon_ext.tools import guard

        before = {s: signal.getsignal(s) for s in guard.INTERRUPT_SIGNALS}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            with self.subTest(signal=signal.Signals(sig).name):
                with self.assertRaises(guard.Interrupted) as info:
                    with guard.interrupts_raise():
                        self._signal_self(sig)
                self.assertEqual(info.exception.signum, sig)
                self.assertIsInstance(info.exception, KeyboardInterrupt)
                self.assertEqual({s: signal.getsignal(s) for s in guard.INTERRUPT_SIGNALS},
                                 before, "the previous handlers are restored")

    def test_an_interrupt_wrapped_or_swallowed_still_ends_as_the_interrupt(self) -> None:
        from paddle_muon_ext.tools import guard

        with self.assertRaises(guard.Interrupted) as info:
            with guard.interrupts_raise():
                try:
                    self._signal_self(signal.SIGTERM)
                except BaseException as exc:  # a simulated rank reports it as its failure
                    raise RuntimeError("rank 0 raised") from exc
        self.assertEqual(info.exception.signum, signal.SIGTERM)
        with self.assertRaises(guard.Interrupted):
            with guard.interrupts_raise():
                try:
                    self._signal_self(signal.SIGINT)
                except BaseException:  # noqa: BLE001 - a broad except that goes on
                    pass
        with self.assertRaisesRegex(ValueError, "unrelated"):  # no signal: errors unchanged
            with guard.interrupts_raise():
                raise ValueError("unrelated")

    def test_off_the_main_thread_it_installs_nothing(self) -> None:
        import threading

        from paddle_muon_ext.tools import guard

        seen = []

        def body() -> None:
            with guard.interrupts_raise():
                seen.append(signal.getsignal(signal.SIGTERM))

        before = signal.getsignal(signal.SIGTERM)
        t = threading.Thread(target=body)
        t.start()
        t.join()
        self.assertEqual(seen, [before])

    def test_the_exit_status_is_128_plus_the_signal(self) -> None:
        import io
        from contextlib import redirect_stderr

        from paddle_muon_ext.tools import guard

        def interrupted():
            raise guard.Interrupted(signal.SIGTERM)

        err = io.StringIO()
        with redirect_stderr(err):
            self.assertEqual(guard.guarded(interrupted), 143)
            self.assertEqual(guard.guarded(lambda: (_ for _ in ()).throw(KeyboardInterrupt())),
                             130)
        self.assertEqual(err.getvalue().splitlines(),
                         ["error: interrupted by signal SIGTERM",
                          "error: interrupted by signal SIGINT"])


if __name__ == "__main__":
    unittest.main()
