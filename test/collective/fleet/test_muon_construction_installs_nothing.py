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
"""Importing and constructing MuonShardingOptimizer changes nothing process-wide.

A fresh interpreter (a subprocess: nothing another test installed can hide a
change) records what a user's process shares -- Paddle's
tensor-fusion device table, signal handlers, excepthooks, atexit callbacks,
trace/profile functions, threads, ``paddle.Tensor``'s members, the
``paddle.distributed`` / fleet functions, ``paddle.optimizer``'s names, the
environment, logging handlers and warning filters -- then builds a
single-rank MuonShardingOptimizer (Muon and element-wise parameters, fused
buffers) and compares. The process picks its own fusion device entry, as a
device plugin would, so the optimizer's buffers can be built without any
registration from this package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unittest

_SCRIPT = r'''
import atexit, faulthandler, json, logging, os, signal, sys, threading, types, warnings

import paddle
import paddle.distributed as dist
from paddle.distributed import fleet
from paddle.distributed.communication import stream
from paddle.distributed.fleet.base import distributed_strategy as ds
from paddle.distributed.fleet.utils import tensor_fusion_helper as tfh
import importlib
reduce_module = importlib.import_module("paddle.distributed.communication.reduce")

# The user's own fusion device (a plugin's entry), chosen before anything runs.
tfh.alignment["user_device"] = 512
tfh.__current_device_type__ = "user_device"

SIGNALS = [getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP",
                                        "SIGQUIT", "SIGABRT", "SIGALRM", "SIGCHLD", "SIGPIPE")
           if hasattr(signal, n)]
DIST_NAMES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_object",
              "reduce_scatter", "alltoall", "alltoall_single", "scatter", "new_group",
              "barrier", "get_rank", "get_world_size", "send", "recv", "isend", "irecv",
              "wait", "get_group", "is_initialized", "destroy_process_group")
STREAM_NAMES = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter",
                "alltoall", "alltoall_single", "send", "recv")


def ident(value):
    return "%s@%x" % (type(value).__name__, id(value))


def snapshot():
    return {
        "tensor_fusion.alignment": sorted(tfh.alignment.items()),
        "tensor_fusion.device": tfh.__dict__.get("__current_device_type__"),
        "signals": {int(s): ident(signal.getsignal(s)) for s in SIGNALS},
        "sys.excepthook": ident(sys.excepthook),
        "sys.unraisablehook": ident(sys.unraisablehook),
        "sys.displayhook": ident(sys.displayhook),
        "threading.excepthook": ident(threading.excepthook),
        "atexit callbacks": atexit._ncallbacks(),
        "faulthandler": faulthandler.is_enabled(),
        "trace/profile": [ident(sys.gettrace()), ident(sys.getprofile()),
                          ident(threading.gettrace()), ident(threading.getprofile())],
        "threads": sorted(t.name for t in threading.enumerate()),
        "paddle.Tensor": {k: ident(v) for k, v in sorted(vars(paddle.Tensor).items())},
        "paddle.distributed": {n: ident(getattr(dist, n, None)) for n in DIST_NAMES},
        "paddle.distributed.stream": {n: ident(getattr(stream, n, None))
                                      for n in STREAM_NAMES},
        "is_avg_reduce_op_supported": ident(reduce_module.is_avg_reduce_op_supported),
        "fleet": {k: ident(v) for k, v in sorted(vars(fleet).items()) if callable(v)},
        "DistributedStrategy": {k: ident(v) for k, v in sorted(vars(ds.DistributedStrategy).items())},
        "paddle.optimizer": sorted(vars(paddle.optimizer)),
        "optimizer modules": sorted(m for m in sys.modules if m.startswith("paddle.optimizer.")
                                    or m.startswith("paddle.distributed.fleet.meta_optimizers.muon")),
        "environ": sorted(os.environ.items()),
        "logging.root": [ident(h) for h in logging.root.handlers] + [logging.root.level],
        "warnings.filters": [repr(f) for f in warnings.filters],
        "sys.path": list(sys.path),
    }


before = snapshot()
from paddle_muon_ext.optimizer.muon import Muon, MuonParamInfo
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_optimizer import (
    MuonShardingOptimizer,
)

group = types.SimpleNamespace(ranks=[0], nranks=1, rank=0, id=0, world_size=1)
hcg = types.SimpleNamespace(
    get_sharding_parallel_group=lambda: group, get_sharding_parallel_world_size=lambda: 1,
    get_sharding_parallel_rank=lambda: 0, get_pipe_parallel_world_size=lambda: 1,
    get_model_parallel_world_size=lambda: 1)
params = []
for i, shape in enumerate(([8, 4], [4], [4, 4], [3])):
    p = paddle.create_parameter(shape, "float32")
    p.name = "probe.w%d" % i
    params.append(p)
muon = Muon(learning_rate=0.02, parameters=params, muon_param_info_map={
    p.name: MuonParamInfo(use_muon=len(p.shape) == 2) for p in params})
strategy = fleet.DistributedStrategy()
opt = MuonShardingOptimizer(muon, hcg, strategy)
built = {"muon_buckets": len(opt.muon_buckets), "slice_buffers": len(opt._comm_buffer_list)}
after = snapshot()
changed = {k: {"before": before[k], "after": after[k]} for k in before if before[k] != after[k]}
print("RESULT " + json.dumps({"built": built, "changed": changed}, default=str))
'''


def _run_fresh() -> dict:
    # The child inherits this environment (PYTHONPATH included), so it imports
    # the same package the suite tests.
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                          env=dict(os.environ), timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"the fresh interpreter failed (exit {proc.returncode}):\n"
                             f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


class TestConstructionInstallsNothing(unittest.TestCase):
    def test_fresh_process_is_unchanged_by_import_and_construction(self):
        result = _run_fresh()
        # The optimizer really built its fused buffers on the process's own device entry.
        self.assertGreaterEqual(result["built"]["muon_buckets"], 1, result["built"])
        self.assertGreaterEqual(result["built"]["slice_buffers"], 1, result["built"])
        self.assertEqual(result["changed"], {},
                         "constructing MuonShardingOptimizer changed process-wide state: "
                         + json.dumps(result["changed"], indent=1)[:3000])


if __name__ == "__main__":
    unittest.main()
