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
"""The flight recorder's records and dump files, in one process.

What a recorded collective says it moved (the parameter buffer for an
all-gather under ``main_grad``), dumps written by two threads at once, and
where dumps go (the explicit directory before the launcher's log dir).
"""

from __future__ import annotations

import os
import tempfile
import unittest
from unittest import mock

import paddle

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_flight import recorder as fr


class _Buffer:
    """A fused 1-D buffer under main_grad: fp32 gradients, bf16 parameters."""

    class _Group:
        id, ranks, nranks = 5, [0, 1], 2

    def __init__(self) -> None:
        self._comm_group = self._Group()
        self.grad_storage = paddle.zeros([24], dtype="float32")
        self.param_storage = paddle.zeros([16], dtype="bfloat16")
        self.calls = []

    def sync_params(self) -> None:
        self.calls.append("all_gather")

    def _comm_grads(self) -> None:
        self.calls.append("reduce_scatter")

    def scale_grads(self) -> None:
        pass


class TestRecordedBuffersUnderMainGrad(unittest.TestCase):
    def test_all_gather_records_the_parameter_buffer(self):
        # Bug: the all-gather is recorded with the gradient buffer, which under
        # main_grad is fp32 while the parameters (what is gathered) are bf16.
        from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import (
            runtime as comm,
        )

        with mock.patch.dict(os.environ, {fr.ENV_ARM: "0"}):  # no handlers, no watchdog
            recorder = fr.FlightRecorder(enabled=True)
        buf = _Buffer()
        with mock.patch.object(comm, "get_flight_recorder", lambda: recorder):
            comm.reduce_scatter_slices([buf], launched_by_hook=False)
            comm.all_gather_slices([buf])
        self.assertEqual(buf.calls, ["reduce_scatter", "all_gather"])
        entries = {e["op"]: e for e in recorder.snapshot("test")["entries"]}
        self.assertEqual((entries["reduce_scatter"]["dtype"], entries["reduce_scatter"]["numel"]),
                         ("float32", 24), "reduce_scatter moves the fp32 gradient buffer")
        self.assertEqual((entries["all_gather"]["dtype"], entries["all_gather"]["numel"]),
                         ("bfloat16", 16), "all_gather moves the bf16 parameter buffer")


class TestConcurrentDumps(unittest.TestCase):
    def test_two_threads_writing_one_dump_both_succeed(self):
        # Bug (seen as a flaky CI failure under load): both threads wrote the
        # same temporary file, the second os.replace found it gone and the
        # dump with its peer request was lost. Each writer here waits inside
        # json.dump until the other one has opened its temporary file.
        import json
        import threading

        opened = threading.Barrier(2, timeout=60)
        real_dump = json.dump

        def slow_dump(data, f):
            opened.wait()
            real_dump(data, f)

        errors = []

        def write(n):
            try:
                fr._write_json(path, {"writer": n})
            except OSError as exc:
                errors.append(exc)

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "muon_flight.rank0.json")
            with mock.patch.object(fr.json, "dump", slow_dump):
                threads = [threading.Thread(target=write, args=(n,)) for n in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(120)
            self.assertEqual(errors, [], "a concurrent dump failed")
            with open(path) as f:
                self.assertIn(json.load(f)["writer"], (0, 1))
            self.assertEqual(os.listdir(tmp), ["muon_flight.rank0.json"],
                             "temporary files left behind")


class TestFlightRecorderDirectory(unittest.TestCase):
    def test_explicit_directory_wins_over_the_launcher_log_dir(self):
        # Bug: PADDLE_LOG_DIR read first when both are set.
        with mock.patch.dict(os.environ, {fr.ENV_DIR: "/explicit",
                                          fr.LAUNCHER_LOG_DIR_ENV: "/launcher"}):
            self.assertEqual(fr.dump_dir(), "/explicit")
        with mock.patch.dict(os.environ, {fr.ENV_DIR: "", fr.LAUNCHER_LOG_DIR_ENV: "/launcher"}):
            self.assertEqual(fr.dump_dir(), "/launcher")
        with mock.patch.dict(os.environ, {fr.ENV_DIR: "", fr.LAUNCHER_LOG_DIR_ENV: ""}):
            self.assertIsNone(fr.dump_dir())


if __name__ == "__main__":
    unittest.main()
