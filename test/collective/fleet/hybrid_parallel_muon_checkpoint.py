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
"""Worker: the jobs of one launch of the checkpoint resharding matrix.

Launched by ``test_muon_checkpoint.py`` with ``paddle.distributed.launch``;
argv[1] is a JSON plan ``{"out": dir, "jobs": [...]}``, run in order by every
rank. A job trains ``CheckpointNet`` with ``MuonShardingOptimizer`` on a
layout (its own ``EPHybridCommunicateGroup``, so one launch hosts several
layouts of the same world size) and is one of:

* ``save``: steps ``[0, first + steps)``... i.e. ``first`` = 0, then
  ``save_sharded_checkpoint`` of model + optimizer into ``ckpt``;
* ``resume``: load ``ckpt`` (``load_sharded_checkpoint``), train on;
* ``train``: an uninterrupted run;
* ``mismatch``: loading ``ckpt`` must raise ``CheckpointMismatchError``.

Each rank writes its parameter values to ``<out>/<job>.rank<r>.npz`` and
prints ``CKPT_JOB name=... rank=... seconds=...``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import paddle
import paddle.distributed as dist
from paddle.distributed.fleet.base.topology import EPHybridCommunicateGroup

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.abspath(os.path.join(_HERE, "..", "..")))  # test/: mock

from gloo_compat import install_gloo_compat  # noqa: E402
from muon_test_compat import register_cpu_tensor_fusion  # noqa: E402
from mock.fake_hcg import hybrid_names_and_dims  # noqa: E402
from muon_checkpoint_model import Layout, build_rank, checkpoint_state, train  # noqa: E402

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_checkpoint import (  # noqa: E402
    CheckpointMismatchError,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)


def fail(message: str) -> None:
    print(f"CKPT_FAILED rank={dist.get_rank()} {message}", flush=True)
    sys.exit(1)


def run_job(job: dict, hcg, out: str) -> None:
    rank = dist.get_rank()
    layout = Layout(**job["layout"])
    with paddle.utils.unique_name.guard():  # state keys as in a fresh process
        net, opt = build_rank(layout, hcg)
        if job["kind"] in ("resume", "mismatch"):
            state = checkpoint_state(net, opt)
            try:
                load_sharded_checkpoint(state, job["ckpt"])
            except CheckpointMismatchError as error:
                if job["kind"] != "mismatch":
                    raise
                print(f"CKPT_MISMATCH rank={rank} "
                      f"{json.dumps(str(error))}", flush=True)
                return
            if job["kind"] == "mismatch":
                fail(f"job {job['name']}: loading {job['ckpt']} into "
                     f"{layout.describe()} was not refused")
        train(net, opt, hcg, job["first"], job["steps"])
        if job["kind"] == "save":
            save_sharded_checkpoint(checkpoint_state(net, opt), job["ckpt"])
        np.savez(os.path.join(out, f"{job['name']}.rank{rank}.npz"), **net.values())


def main() -> None:
    install_gloo_compat()
    register_cpu_tensor_fusion()  # the optimizer's fused buffers on CPU: an explicit opt-in
    dist.init_parallel_env()
    # no patch of Paddle here: load_sharded_checkpoint must reshard on a CPU
    # build by itself, as in a user's script
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    world, rank = dist.get_world_size(), dist.get_rank()
    hcgs: dict[tuple, EPHybridCommunicateGroup] = {}
    for job in plan["jobs"]:
        t0 = time.time()
        ep, ms = job["layout"].get("ep", 1), job["layout"]["ms"]
        if ep * ms != world:
            fail(f"job {job['name']}: ep {ep} x ms {ms} != world size {world}")
        if (ep, ms) not in hcgs:
            hcgs[(ep, ms)] = EPHybridCommunicateGroup(*hybrid_names_and_dims(ep, ms))
        run_job(job, hcgs[(ep, ms)], plan["out"])
        print(f"CKPT_JOB name={job['name']} rank={rank} seconds={time.time() - t0:.2f}",
              flush=True)


if __name__ == "__main__":
    main()
    from worker_exit import exit_after_verdict

    exit_after_verdict()
