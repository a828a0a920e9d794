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
"""Worker of test_gloo_ops_matrix.py: one rank of a 3-process gloo world.

Started by the test (not by ``paddle.distributed.launch``) with
``PADDLE_TRAINER_ID`` / ``PADDLE_TRAINERS_NUM`` set and two ports in
``GLOO_MATRIX_PORTS``. It builds two real ``ProcessGroupGloo`` groups on
their own stores: all three ranks, and ranks {0, 2} (a sub-group whose
group ranks differ from the global ones), installs the gloo layer, runs
every case of :func:`matrix_cases` through Paddle's public collectives
(``paddle.distributed.*`` and ``paddle.distributed.stream.*``) and writes
what each call left in its tensors to ``GLOO_MATRIX_OUT`` as JSON. The test
computes the expectations with NumPy; nothing is checked here.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import numpy as np


def rank_input(case: str, rank: int, shape, dtype: str) -> np.ndarray:
    """A rank's input for a case: distinct per rank and case, exact in every dtype."""
    seed = sum(ord(c) for c in case) * 7 + rank
    values = np.random.RandomState(seed).randint(-8, 9, size=shape)
    return values.astype(dtype)


def matrix_cases():
    """(case name, group name, op, dtype, reduce op name or None, extra) for every case."""
    cases = []
    for group in ("world", "pair"):
        for dtype in ("float32", "float64", "int64"):
            ops = ("SUM", "MAX", "AVG") if dtype != "int64" else ("SUM", "MAX")
            for red in ops:
                cases.append((f"all_reduce/{group}/{dtype}/{red}", group, "all_reduce", dtype, red, None))
                cases.append((f"stream_all_reduce/{group}/{dtype}/{red}", group,
                              "stream_all_reduce", dtype, red, None))
                if red != "MAX" or dtype == "float32":
                    cases.append((f"reduce_scatter/{group}/{dtype}/{red}", group,
                                  "reduce_scatter", dtype, red, None))
                    cases.append((f"stream_reduce_scatter/{group}/{dtype}/{red}", group,
                                  "stream_reduce_scatter", dtype, red, None))
                for dst in ((0, 1, 2) if group == "world" else (0, 2)):
                    if red != "MAX":
                        cases.append((f"reduce/{group}/{dtype}/{red}/{dst}", group, "reduce",
                                      dtype, red, dst))
            cases.append((f"alltoall/{group}/{dtype}", group, "alltoall", dtype, None, None))
            cases.append((f"alltoall_single/{group}/{dtype}", group, "alltoall_single", dtype,
                          None, None))
            cases.append((f"alltoall_even/{group}/{dtype}", group, "alltoall_even", dtype,
                          None, None))
        cases.append((f"aliased_reduce_scatter/{group}", group, "aliased_reduce_scatter",
                      "float32", "AVG", None))
        # rows not divisible by the group size: refused on every rank, no hang
        cases.append((f"alltoall_uneven_rows/{group}", group, "alltoall_uneven_rows", "float32",
                      None, None))
    return cases


GROUP_RANKS = {"world": [0, 1, 2], "pair": [0, 2]}
WIDTH = 2


def a2a_rows(src: int, dst: int) -> int:
    """Rows global rank ``src`` sends global rank ``dst`` (unequal, 0 included)."""
    return (src + 2 * dst + 1) % 4


def main() -> int:
    rank = int(os.environ["PADDLE_TRAINER_ID"])
    out_path = os.environ["GLOO_MATRIX_OUT"]
    ports = [int(p) for p in os.environ["GLOO_MATRIX_PORTS"].split(",")]
    import paddle
    import paddle.distributed as dist
    from paddle.base import core
    from paddle.distributed.collective import Group

    from paddle_muon_ext.distributed.fleet.utils import gloo_compat

    groups = {}
    for gid, (name, members) in enumerate(GROUP_RANKS.items(), start=7001):
        if rank not in members:
            continue
        me = members.index(rank)
        store = core.TCPStore("127.0.0.1", ports[gid - 7001], me == 0, len(members), 60)
        pg = core.ProcessGroupGloo.create(store, me, len(members), gid)
        groups[name] = (Group(me, gid, members, pg=pg, name=f"matrix_{name}"), store)
    if not gloo_compat.install_gloo_compat(force=True):
        raise SystemExit("the gloo layer did not install")
    stream = dist.stream
    results = {}
    for case, gname, op, dtype, red, extra in matrix_cases():
        if gname not in groups:
            continue
        g = groups[gname][0]
        members = GROUP_RANKS[gname]
        n = len(members)
        red_op = getattr(dist.ReduceOp, red) if red else None
        try:
            if op in ("all_reduce", "stream_all_reduce"):
                t = paddle.to_tensor(rank_input(case, rank, [3, 2], dtype))
                if op == "all_reduce":
                    dist.all_reduce(t, op=red_op, group=g)
                else:
                    stream.all_reduce(t, op=red_op, group=g, sync_op=True, use_calc_stream=True)
                results[case] = t.numpy().tolist()
            elif op == "reduce":
                t = paddle.to_tensor(rank_input(case, rank, [5], dtype))
                stream.reduce(t, dst=extra, op=red_op, group=g, sync_op=True,
                              use_calc_stream=True)
                results[case] = t.numpy().tolist()
            elif op == "reduce_scatter":
                pieces = [paddle.to_tensor(x) for x in
                          np.split(rank_input(case, rank, [n * 2, 3], dtype), n)]
                out = paddle.zeros([2, 3], dtype=dtype)
                dist.reduce_scatter(out, pieces, op=red_op, group=g)
                results[case] = out.numpy().tolist()
            elif op == "stream_reduce_scatter":
                x = paddle.to_tensor(rank_input(case, rank, [n * 4], dtype))
                out = paddle.zeros([4], dtype=dtype)
                stream.reduce_scatter(out, x, op=red_op, group=g, sync_op=True,
                                      use_calc_stream=True)
                results[case] = [out.numpy().tolist(), x.numpy().tolist()]
            elif op == "aliased_reduce_scatter":
                # the output is a view of the input, as in FusedCommBuffer
                buf = paddle.to_tensor(rank_input(case, rank, [n * 4], dtype))
                me = members.index(rank)
                view = buf._slice(me * 4, (me + 1) * 4)
                dist.reduce_scatter(view, buf, op=red_op, group=g)
                results[case] = buf.numpy().tolist()
            elif op == "alltoall":
                ins = [paddle.to_tensor(rank_input(f"{case}/{d}", rank, [a2a_rows(rank, d), WIDTH],
                                                   dtype)) for d in members]
                outs = [paddle.full([a2a_rows(s, rank), WIDTH], -1, dtype=dtype) for s in members]
                dist.alltoall(outs, ins, group=g)
                results[case] = [o.numpy().tolist() for o in outs]
            elif op == "alltoall_single":
                in_split = [a2a_rows(rank, d) for d in members]
                out_split = [a2a_rows(s, rank) for s in members]
                x = paddle.to_tensor(np.concatenate(
                    [rank_input(f"{case}/{d}", rank, [a2a_rows(rank, d), WIDTH], dtype)
                     for d in members]))
                out = paddle.full([sum(out_split), WIDTH], -1, dtype=dtype)
                dist.alltoall_single(out, x, in_split, out_split, group=g)
                results[case] = out.numpy().tolist()
            elif op == "alltoall_uneven_rows":
                rows = n - 1 if n > 2 else n + 1
                x = paddle.to_tensor(rank_input(case, rank, [rows, WIDTH], dtype))
                out = paddle.full([rows, WIDTH], -1, dtype=dtype)
                stream.alltoall(out, x, group=g, sync_op=True, use_calc_stream=True)
                results[case] = out.numpy().tolist()
            elif op == "alltoall_even":
                x = paddle.to_tensor(rank_input(case, rank, [2 * n, WIDTH], dtype))
                out = paddle.full([2 * n, WIDTH], -1, dtype=dtype)
                stream.alltoall(out, x, group=g, sync_op=True, use_calc_stream=True)
                results[case] = out.numpy().tolist()
        except Exception:  # reported, then the other cases still run in step
            results[case] = "error: " + traceback.format_exc(limit=3).splitlines()[-1]
    with open(out_path, "w") as f:
        json.dump(results, f)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (see worker_exit.py)


if __name__ == "__main__":
    sys.exit(main())
