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
"""``paddle-muon-ext demo`` killed with SIGKILL (the OOM killer's signal)
leaves nothing behind: within seconds no launcher, worker or helper process
of it runs and its ``muon_demo_*`` temporary directory is gone."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest
import uuid

from tool_loader import REPO_ROOT

MARK = "MUON_DEMO_TEST_MARK"
WORKER = "hybrid_parallel_sharding_muon_moe_model.py"
#: from the SIGKILL until everything is gone: the launcher's SIGTERM, the
#: watchdog's grace of 3 s and its SIGKILL, on a loaded 2-core machine
GONE_WITHIN_S = 20.0


def marked(mark: str) -> dict[int, str]:
    """pid -> command line of every live (not zombie) process carrying ``mark``."""
    needle = f"{MARK}={mark}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return found


@unittest.skipUnless(sys.platform.startswith("linux"), "reads /proc")
class TestDemoKilled(unittest.TestCase):
    def test_sigkill_leaves_no_process_and_no_temporary_directory(self):
        mark = uuid.uuid4().hex
        tmp = tempfile.mkdtemp(prefix="muon_demo_killed_")
        self.addCleanup(shutil.rmtree, tmp, True)
        env = dict(os.environ, **{MARK: mark, "TMPDIR": tmp, "PYTHONPATH": os.pathsep.join(
            p for p in (os.path.join(REPO_ROOT, "python"), os.environ.get("PYTHONPATH")) if p)})
        demo = subprocess.Popen(
            [sys.executable, "-m", "paddle_muon_ext.cli", "demo", "--steps", "200",
             "--timeout", "600"], env=env, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)

        def leftovers() -> None:  # never leave the test's own processes running
            for pid in marked(mark):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            demo.kill()
            demo.wait()

        self.addCleanup(leftovers)
        deadline = time.monotonic() + 120
        while sum(WORKER in c for c in marked(mark).values()) < 8:
            self.assertIsNone(demo.poll(), "the demo ended before its 8 workers started")
            self.assertLess(time.monotonic(), deadline, "the 8 workers never started")
            time.sleep(0.2)
        self.assertEqual(len([n for n in os.listdir(tmp) if n.startswith("muon_demo_")]), 1)
        demo.send_signal(signal.SIGKILL)
        demo.wait()
        t0 = time.monotonic()
        while time.monotonic() - t0 < GONE_WITHIN_S:
            if not marked(mark) and not os.listdir(tmp):
                break
            time.sleep(0.2)
        self.assertEqual(marked(mark), {}, "processes of the killed demo still run")
        self.assertEqual(os.listdir(tmp), [], "the killed demo's temporary directory is left")


if __name__ == "__main__":
    unittest.main()
