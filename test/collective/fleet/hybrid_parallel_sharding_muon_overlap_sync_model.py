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
"""Worker: overlap_optimize_and_sync on vs off on real collectives.

Launched by ``test_muon_sharding_overlap_sync.py``. Trains the tiny MoE
model twice in one process, with ``FLAGS_muon_sharding_overlap_optimize_and_sync``
set to 1 (stage by stage: each stage's broadcast / all-gather in flight
while the next stage updates) and to 0 (update, then sync), and requires the
parameters of both runs to be bit-identical on every rank.

Environment: MUON_EP, MUON_MS, MUON_STEPS as for the MoE worker.
Prints ``MUON_OVERLAP_SYNC_OK rank=<r> overlap=<0|1> stages=<n>``; exit 1 with
``MUON_CHECK_FAILED`` on a mismatch.
"""

from __future__ import annotations

import os
import sys

import numpy as np

import paddle.distributed as dist
from paddle.distributed import fleet

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gloo_compat import apply_emulated_local_size, install_gloo_compat  # noqa: E402
from muon_test_compat import register_cpu_tensor_fusion  # noqa: E402
from hybrid_parallel_sharding_muon_moe_model import (  # noqa: E402
    build_strategy,
    env_int,
    fail,
    train,
)

FLAG = "FLAGS_muon_sharding_overlap_optimize_and_sync"


def main() -> None:
    apply_emulated_local_size()
    install_gloo_compat()
    register_cpu_tensor_fusion()  # the optimizer's fused buffers on CPU: an explicit opt-in
    world = int(os.environ.get("PADDLE_TRAINERS_NUM", dist.get_world_size()))
    ep, ms = env_int("MUON_EP", 1), env_int("MUON_MS", 1)
    steps = env_int("MUON_STEPS", 3)
    fleet.init(is_collective=True,
               strategy=build_strategy(ep, ms, world, False, True, False))
    rank = dist.get_rank()
    finals, flags, stages = {}, {}, 0
    for flag in ("1", "0"):
        os.environ[FLAG] = flag
        final, _, _, _ = train(False, ep, steps, True, False, False, None)
        finals[flag] = final
    os.environ.pop(FLAG, None)
    for name, value in finals["1"].items():
        other = finals["0"][name]
        if not np.array_equal(value, other):
            fail(f"rank {rank}: {name} differs between overlap_optimize_and_sync on and off "
                 f"(max |d| = {float(np.abs(value - other).max()):.3e}); the overlapped "
                 "step must be bit-identical")
    core = _LAST_OPT[0]
    flags = int(bool(core.overlap_optimize_and_sync))
    stages = len(core._sync_stages or [])
    print(f"MUON_OVERLAP_SYNC_OK rank={rank} overlap={flags} stages={stages}", flush=True)


_LAST_OPT: list = [None]


def _remember_optimizers() -> None:
    # The first pass's optimizer tells whether the overlap really ran.
    from paddle_muon_ext.distributed.fleet.meta_optimizers import muon_sharding_optimizer as mso

    original = mso.MuonShardingOptimizer.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if _LAST_OPT[0] is None:
            _LAST_OPT[0] = self

    mso.MuonShardingOptimizer.__init__ = init


if __name__ == "__main__":
    _remember_optimizers()
    main()
    from worker_exit import exit_after_verdict

    exit_after_verdict()
