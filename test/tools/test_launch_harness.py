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
"""The launch harness reruns a job only when its TCPStore port was taken, and
its failure message names a worker that died on a signal in its first line."""

from __future__ import annotations

import os
import sys
import unittest
from unittest import mock

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_REPO, "test", "collective", "fleet"))

import launch_utils  # noqa: E402
from launch_utils import LaunchResult  # noqa: E402

# the worker log paddle 3.3.1 printed when rank 0 lost the port race (CI, 2026-12-01)
_PORT_TAKEN_LOG = """I1201 14:55:02.201052 23285 tcp_store.cc:336] create libuv server at port: 45580
python: /paddle/third_party/libuv/src/unix/core.c:314: uv__finish_close: Assertion failed.
0   phi::distributed::CreateOrGetGlobalTCPStore()
1   phi::distributed::TCPStore::TCPStore(std::string, unsigned short, bool, unsigned long, int)
2   phi::distributed::detail::TCPServer::create(unsigned short, int, int, bool)
"""


def _result(returncode: int, log: str) -> LaunchResult:
    return LaunchResult(cmd=["launch"], returncode=returncode, wall_s=1.0, timed_out=False,
                        log_dir="unused", launcher_output="", worker_logs={0: log})


class TestPortRaceRetry(unittest.TestCase):
    def _run(self, *results: LaunchResult) -> tuple[LaunchResult, int]:
        with mock.patch.object(launch_utils, "_launch_once", side_effect=list(results)) as once, \
                mock.patch("sys.stderr"):
            got = launch_utils.run_paddle_launch("worker.py", 2)
        return got, once.call_count

    def test_a_taken_store_port_is_launched_again(self):
        ok = _result(0, "OK")
        got, calls = self._run(_result(250, _PORT_TAKEN_LOG), ok)
        self.assertEqual(calls, 2, "a launch that lost the port race must be run again")
        self.assertIs(got, ok, "the second launch's result must be returned")

    def test_a_real_failure_is_reported_at_once(self):
        failed = _result(1, "MUON_CHECK_FAILED parameter w differs")
        got, calls = self._run(failed)
        self.assertEqual(calls, 1, "a failing test job must not be retried")
        self.assertIs(got, failed)

    def test_at_most_one_retry(self):
        second = _result(250, _PORT_TAKEN_LOG)
        got, calls = self._run(_result(250, _PORT_TAKEN_LOG), second)
        self.assertEqual(calls, 2, "the port race is retried once, not forever")
        self.assertIs(got, second)
        self.assertFalse(got.ok)


class TestFailureMessageNamesTheDeadRank(unittest.TestCase):
    def test_a_worker_abort_is_named_in_the_first_line(self):
        aborted = ("PASS: rank 0 of 2\nFatal Python error: Aborted\n\n"
                   "Current thread 0x1 (most recent call first):\n  <no Python frame>\n")
        result = LaunchResult(cmd=["launch"], returncode=1, wall_s=1.0, timed_out=False,
                              log_dir="unused", launcher_output="",
                              worker_logs={0: "PASS\n", 1: aborted})
        first = result.failure_message().splitlines()[0]
        self.assertIn("returncode=1", first)
        self.assertIn("fatal: {1: 'Fatal Python error: Aborted'}", first)

    def test_a_plain_failure_names_no_fatal_rank(self):
        first = _result(1, "MUON_CHECK_FAILED").failure_message().splitlines()[0]
        self.assertNotIn("fatal", first)


if __name__ == "__main__":
    unittest.main()
