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
"""Real-collective tests of MuonShardingOptimizer through the fleet integration.

Each test launches ``hybrid_parallel_sharding_muon_model.py`` with
``paddle.distributed.launch`` (via ``launch_utils.run_paddle_launch``); every
worker trains a tiny MoE model and checks its parameters each step against a
single-process Muon reference (tolerance 1e-5, see the worker's ``ATOL``).

CPU (gloo, with the test-side ``gloo_compat`` layer):
    (a)  ``test_cpu_sharding2_no_ep``       2 procs, sharding=2, no EP
    (a2) ``test_cpu_sharding2_overlap``     same, comm_overlap on
    (a3) ``test_cpu_sharding2_unfused``     same, per-parameter grads (no fused buffers)
    (b)  ``test_cpu_ep4_ms2_emulated_nodes`` 8 procs, 4 emulated nodes x 2 cards
         (PADDLE_LOCAL_SIZE=2), ep=4, moe_sharding=2, comm_group_call_opt off
         and on in one launch

GPU (NCCL; skipped unless >= 8 GPUs are visible):
    (c)  ``test_gpu_nccl``  8 GPUs: ep=4, moe_sharding=2, PADDLE_LOCAL_SIZE=4;
         16+ GPUs: 16 procs, ep=8, moe_sharding=2, PADDLE_LOCAL_SIZE=8.
    Run on an 8-GPU node with::

        python -m pytest -s test/collective/fleet/test_parallel_dygraph_muon.py -k gpu

    The gloo compat layer is not installed there (``gloo_expected()`` is
    False with CUDA devices; the test also sets ``GLOO_COMPAT=0``). The node
    emulation (``GLOO_COMPAT_LOCAL_SIZE`` -> ``PADDLE_LOCAL_SIZE``) is applied
    by the worker itself, so NCCL runs see 2 emulated nodes as well.

Run with ``-s`` to see the per-launch wall time and max |d| report lines.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from launch_utils import LaunchResult, run_paddle_launch  # noqa: E402

_REPO = os.path.abspath(os.path.join(_HERE, "..", "..", ".."))
WORKER = os.path.join(_HERE, "hybrid_parallel_sharding_muon_model.py")
ATOL = 1e-5  # the worker's tolerance
STEPS = "5"

_PASS_RE = re.compile(r"MUON_PASS rank=(\d+) group_call=(\d) max_abs_diff_vs_reference=(\S+)")
_OK_RE = re.compile(r"MUON_OK rank=(\d+) max_abs_diff_hier_vs_flat=(\S+)")


def _launch(nproc: int, env: dict[str, str], timeout_s: float) -> LaunchResult:
    full = {"PYTHONPATH": os.pathsep.join(
        [os.path.join(_REPO, "python"), _HERE, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "MUON_STEPS": STEPS}
    full.update(env)
    return run_paddle_launch(WORKER, nproc, full, timeout_s=timeout_s)


def _verify(result: LaunchResult, nproc: int, group_calls: tuple[int, ...], label: str) -> dict:
    """Assert every rank passed every pass and MUON_OK; return the max |d| values."""
    result.check()  # on failure: the tail of every workerlog
    assert sorted(result.worker_logs) == list(range(nproc)), (
        f"expected worker logs 0..{nproc - 1}, got {sorted(result.worker_logs)}\n"
        + result.failure_message())
    vs_ref = {g: 0.0 for g in group_calls}
    hier_vs_flat = 0.0
    problems = []
    for rank, log in sorted(result.worker_logs.items()):
        if "MUON_CHECK_FAILED" in log:
            problems.append(f"rank {rank}: " + next(
                line for line in log.splitlines() if "MUON_CHECK_FAILED" in line))
        seen = {int(m.group(2)): float(m.group(3))
                for m in _PASS_RE.finditer(log) if int(m.group(1)) == rank}
        for g in group_calls:
            if g not in seen:
                problems.append(f"rank {rank}: no MUON_PASS for group_call={g}")
            else:
                vs_ref[g] = max(vs_ref[g], seen[g])
        oks = [float(m.group(2)) for m in _OK_RE.finditer(log) if int(m.group(1)) == rank]
        if not oks:
            problems.append(f"rank {rank}: no MUON_OK")
        else:
            hier_vs_flat = max(hier_vs_flat, oks[-1])
    if problems:
        raise AssertionError("\n".join(problems) + "\n" + result.failure_message())
    summary = ", ".join(f"group_call={g}: max|param - reference|={v:.3e}" for g, v in vs_ref.items())
    print(f"\n[{label}] {nproc} procs, wall {result.wall_s:.1f}s; {summary}; "
          f"max|on - off|={hier_vs_flat:.3e}")
    for g, v in vs_ref.items():
        assert v <= ATOL, f"[{label}] group_call={g}: max |d| vs reference {v:.3e} > {ATOL}"
    assert hier_vs_flat <= ATOL, f"[{label}] comm_group_call_opt on vs off: {hier_vs_flat:.3e} > {ATOL}"
    return {"vs_reference": vs_ref, "hier_vs_flat": hier_vs_flat, "wall_s": result.wall_s}


def _cpu_sharding2(label: str, **extra: str) -> dict:
    env = {"MUON_EP": "1", "MUON_MS": "1", "MUON_GROUP_CALL": "0", **extra}
    return _verify(_launch(2, env, timeout_s=120), 2, (0,), label)


@pytest.mark.slow
def test_cpu_sharding2_no_ep():
    _cpu_sharding2("cpu sharding=2")


@pytest.mark.slow
def test_cpu_sharding2_overlap():
    _cpu_sharding2("cpu sharding=2 comm_overlap", MUON_OVERLAP="1")


@pytest.mark.slow
def test_cpu_sharding2_unfused():
    _cpu_sharding2("cpu sharding=2 unfused", MUON_FUSED="0")


@pytest.mark.slow
def test_cpu_ep4_ms2_emulated_nodes():
    env = {"MUON_EP": "4", "MUON_MS": "2", "MUON_GROUP_CALL": "both", "PADDLE_LOCAL_SIZE": "2"}
    _verify(_launch(8, env, timeout_s=300), 8, (0, 1), "cpu 4 nodes x 2 cards ep=4 ms=2")


def _gpu_count() -> int:
    import paddle

    if not paddle.is_compiled_with_cuda():
        return 0
    try:
        return int(paddle.device.cuda.device_count())
    except Exception:
        return 0


@pytest.mark.slow
def test_gpu_nccl(monkeypatch):
    n = _gpu_count()
    if n < 8:
        pytest.skip(f"needs >= 8 visible GPUs, found {n}")
    import gloo_compat

    monkeypatch.delenv(gloo_compat.FORCE_ENV, raising=False)
    monkeypatch.delenv("PADDLE_DISTRI_BACKEND", raising=False)
    assert not gloo_compat.gloo_expected(), "gloo compat would be installed on a CUDA host"
    if n >= 16:
        nproc, env = 16, {"MUON_EP": "8", "MUON_MS": "2", "PADDLE_LOCAL_SIZE": "8"}
    else:
        nproc, env = 8, {"MUON_EP": "4", "MUON_MS": "2", "PADDLE_LOCAL_SIZE": "4"}
    env.update({"MUON_GROUP_CALL": "both", gloo_compat.FORCE_ENV: "0"})
    _verify(_launch(nproc, env, timeout_s=300), nproc, (0, 1),
            f"gpu nccl {nproc} procs ep={env['MUON_EP']} ms={env['MUON_MS']}")
