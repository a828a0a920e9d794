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
"""The gloo layer's collectives on real gloo, op x dtype x group, against NumPy.

Three processes (started here, no launcher: each builds its gloo groups on
its own TCPStores, which takes a few seconds instead of a launch's ten or
more) run ``gloo_ops_matrix_worker.py``: every case of its matrix
(``all_reduce`` and ``stream.all_reduce`` with SUM / MAX / AVG,
``stream.reduce`` onto every rank of the group with SUM / AVG, list and tensor
``reduce_scatter`` with SUM / AVG (and MAX once), a reduce-scatter whose
output is a view of its input, list / split / even all-to-all) for float32,
float64 and int64, on a group of all three ranks and on the sub-group {0, 2}
whose group ranks differ from its global ranks. Expected values are NumPy
over the inputs every rank drew, written from NCCL's semantics: a reduce
writes only the root (the others keep their input), AVG is the mean, a
reduce-scatter gives group rank ``i`` the ``i``-th slice and leaves the
input as it was, an all-to-all hands ``in[d]`` of rank ``s`` to ``out[s]``
of rank ``d``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import gloo_ops_matrix_worker as worker  # noqa: E402

WORLD = 3
TIMEOUT_S = 150


def _free_ports(count: int) -> list:
    import socket
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _run_world() -> dict:
    """{global rank: {case: what that rank's tensors held}}."""
    script = os.path.join(_HERE, "gloo_ops_matrix_worker.py")
    with tempfile.TemporaryDirectory() as tmp:
        ports = ",".join(str(p) for p in _free_ports(2))
        procs, outs = [], []
        for rank in range(WORLD):
            out = os.path.join(tmp, f"rank{rank}.json")
            env = dict(os.environ, PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM=str(WORLD),
                       GLOO_MATRIX_PORTS=ports, GLOO_MATRIX_OUT=out, GLOG_v="0")
            for key in ("PADDLE_DISTRI_BACKEND", "GLOO_COMPAT", "GLOO_COMPAT_LOCAL_SIZE",
                        "PADDLE_CURRENT_ENDPOINT"):
                env.pop(key, None)
            procs.append(subprocess.Popen([sys.executable, script], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
            outs.append(out)
        logs = []
        try:
            for p in procs:
                logs.append(p.communicate(timeout=TIMEOUT_S)[0])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        results = {}
        for rank, (p, out) in enumerate(zip(procs, outs)):
            if p.returncode != 0 or not os.path.exists(out):
                raise AssertionError(f"rank {rank} exited {p.returncode}:\n{logs[rank][-3000:]}")
            with open(out) as f:
                results[rank] = json.load(f)
        return results


def _reduce(arrays, red: str, dtype: str) -> np.ndarray:
    stacked = np.stack([a.astype(np.float64) for a in arrays])
    value = {"SUM": stacked.sum(0), "MAX": stacked.max(0), "AVG": stacked.mean(0)}[red]
    return value.astype(dtype)


class TestGlooOpsMatrix(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        try:
            cls.results = _run_world()
        except AssertionError:
            # the two ports are probed free, then bound by the workers: another
            # process may take one in between (a real failure repeats)
            cls.results = _run_world()

    def _got(self, rank: int, case: str):
        got = self.results[rank].get(case)
        self.assertIsNotNone(got, f"rank {rank}: no result for {case}")
        self.assertFalse(isinstance(got, str), f"rank {rank}, {case}: {got}")
        return got

    def _close(self, got, want, label: str) -> None:
        got = np.asarray(got, dtype=np.float64)
        self.assertEqual(got.shape, np.shape(want), label)
        np.testing.assert_allclose(got, np.asarray(want, dtype=np.float64), rtol=1e-6, atol=1e-6,
                                   err_msg=label)

    def test_every_case_ran_on_every_member(self) -> None:
        for case, gname, op, *_ in worker.matrix_cases():
            if op == "alltoall_uneven_rows":
                continue
            for rank in worker.GROUP_RANKS[gname]:
                self._got(rank, case)
        self.assertEqual(sum(len(r) for r in self.results.values()),
                         sum(len(worker.GROUP_RANKS[c[1]]) for c in worker.matrix_cases()))

    def test_all_reduce(self) -> None:
        for case, gname, op, dtype, red, _ in worker.matrix_cases():
            if op not in ("all_reduce", "stream_all_reduce"):
                continue
            members = worker.GROUP_RANKS[gname]
            want = _reduce([worker.rank_input(case, r, [3, 2], dtype) for r in members], red, dtype)
            for rank in members:
                self._close(self._got(rank, case), want, f"{case} rank {rank}")

    def test_reduce_writes_the_root_and_leaves_the_others_their_input(self) -> None:
        for case, gname, op, dtype, red, dst in worker.matrix_cases():
            if op != "reduce":
                continue
            members = worker.GROUP_RANKS[gname]
            inputs = {r: worker.rank_input(case, r, [5], dtype) for r in members}
            for rank in members:
                want = _reduce(list(inputs.values()), red, dtype) if rank == dst else inputs[rank]
                self._close(self._got(rank, case), want, f"{case} rank {rank}")

    def test_reduce_scatter_gives_each_group_rank_its_slice(self) -> None:
        for case, gname, op, dtype, red, _ in worker.matrix_cases():
            members = worker.GROUP_RANKS[gname]
            n = len(members)
            if op == "reduce_scatter":
                full = _reduce([worker.rank_input(case, r, [n * 2, 3], dtype) for r in members],
                               red, dtype)
                for i, rank in enumerate(members):
                    self._close(self._got(rank, case), full[2 * i: 2 * i + 2],
                                f"{case} group rank {i}")
            elif op == "stream_reduce_scatter":
                inputs = {r: worker.rank_input(case, r, [n * 4], dtype) for r in members}
                full = _reduce(list(inputs.values()), red, dtype)
                for i, rank in enumerate(members):
                    out, kept = self._got(rank, case)
                    self._close(out, full[4 * i: 4 * i + 4], f"{case} group rank {i}")
                    self._close(kept, inputs[rank], f"{case} rank {rank}: the input changed")
            elif op == "aliased_reduce_scatter":
                inputs = {r: worker.rank_input(case, r, [n * 4], dtype) for r in members}
                full = _reduce(list(inputs.values()), red, dtype)
                for i, rank in enumerate(members):
                    want = inputs[rank].copy()
                    want[4 * i: 4 * i + 4] = full[4 * i: 4 * i + 4]
                    self._close(self._got(rank, case), want, f"{case} rank {rank}")

    def test_rows_that_do_not_split_over_the_group_are_refused_on_every_rank(self) -> None:
        for case, gname, op, *_ in worker.matrix_cases():
            if op != "alltoall_uneven_rows":
                continue
            n = len(worker.GROUP_RANKS[gname])
            rows = n - 1 if n > 2 else n + 1
            for rank in worker.GROUP_RANKS[gname]:
                got = self.results[rank].get(case)
                self.assertIsInstance(got, str, f"{case} rank {rank}: not refused: {got}")
                self.assertIn(f"ValueError: gloo_compat alltoall: in_tensor has {rows} rows, "
                              f"not divisible by the group size {n}", got)

    def test_all_to_all_hands_each_piece_to_its_destination(self) -> None:
        rows, width = worker.a2a_rows, worker.WIDTH
        for case, gname, op, dtype, _, _ in worker.matrix_cases():
            members = worker.GROUP_RANKS[gname]
            n = len(members)
            if op == "alltoall":
                for d in members:
                    got = self._got(d, case)
                    for j, s in enumerate(members):
                        want = worker.rank_input(f"{case}/{d}", s, [rows(s, d), width], dtype)
                        self._close(np.asarray(got[j]).reshape(rows(s, d), width), want,
                                    f"{case}: rank {d}, piece from {s}")
            elif op == "alltoall_single":
                for d in members:
                    want = np.concatenate([worker.rank_input(f"{case}/{d}", s, [rows(s, d), width],
                                                             dtype) for s in members])
                    self._close(self._got(d, case), want, f"{case}: rank {d}")
            elif op == "alltoall_even":
                for j, d in enumerate(members):
                    want = np.concatenate([worker.rank_input(case, s, [2 * n, width], dtype)
                                           [2 * j: 2 * j + 2] for s in members])
                    self._close(self._got(d, case), want, f"{case}: rank {d}")


if __name__ == "__main__":
    unittest.main()
