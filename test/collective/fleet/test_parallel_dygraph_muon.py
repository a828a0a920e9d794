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
"""Real-collective tests of MuonShardingOptimizer (launchers, one per worker run).

Develop's pair: ``hybrid_parallel_sharding_muon_model.py`` is written only
against Paddle develop's API (on 3.3.x its one ``patch_paddle()`` line is the
only package name). ``TestParallelDygraphMuon`` launches it:
    * 2 processes, ``sharding_degree=2``, every case of its matrix (all NS
      presets, custom coefficients, a custom colour group with
      ``clear_param_storage``, ``split_concat_func``, bf16 master weights,
      ``apply_decay_param_fun``, the balanced partition) in one launch;
    * 4 processes, 2 emulated nodes x 2 cards, ``comm_group_call_opt`` on.
Every parameter is compared after each step with a single-process
``MixPrecisionOptimizer(Muon)`` run (tolerances in the worker).

``TestMuonMoEGloo`` launches ``hybrid_parallel_sharding_muon_moe_model.py``
(a tiny MoE model checked each step against a single-process Muon run, 1e-5):
    (a)  2 procs, sharding=2, no EP; (a2) comm_overlap; (a3) unfused buffers
    (b)  8 procs, 4 emulated nodes x 2 cards, ep=4, moe_sharding=2,
         comm_group_call_opt off and on in one launch.

``TestMuonNccl`` (skipped unless >= 8 GPUs are visible): 8 GPUs ep=4,
moe_sharding=2, PADDLE_LOCAL_SIZE=4; 16+ GPUs: ep=8, PADDLE_LOCAL_SIZE=8.
On CPU the package's ``gloo_compat`` layer is active; on GPU it is off
(``GLOO_COMPAT=0``). Run with ``-s`` to see wall times and max |d|.
"""

from __future__ import annotations

import os
import re
import sys
import unittest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from launch_utils import LaunchResult, run_paddle_launch  # noqa: E402

_REPO = os.path.abspath(os.path.join(_HERE, "..", "..", ".."))
DEVELOP_WORKER = os.path.join(_HERE, "hybrid_parallel_sharding_muon_model.py")
MOE_WORKER = os.path.join(_HERE, "hybrid_parallel_sharding_muon_moe_model.py")
ATOL = 1e-5  # the MoE worker's tolerance
STEPS = "5"

_PASS_RE = re.compile(r"MUON_PASS rank=(\d+) group_call=(\d) max_abs_diff_vs_reference=(\S+)")
_OK_RE = re.compile(r"MUON_OK rank=(\d+) max_abs_diff_hier_vs_flat=(\S+)")
# the worker's CASES (not imported: importing it would patch this process)
DEVELOP_CASES = (
    "simple", "quintic", "polar_express", "aol", "deepseekv4", "custom_coeffs",
    "custom_colour_clear_storage", "split_concat_func", "master_weights_bf16",
    "apply_decay_param_fun", "balanced_partition",
)
_CASE_RE = re.compile(r"MUON_CASE_PASS case=(\S+) rank=(\d+) max_abs_diff=(\S+)")


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {"PYTHONPATH": os.pathsep.join(
        [os.path.join(_REPO, "python"), _HERE, os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep)}
    env.update(extra)
    return env


def _problems_of(result: LaunchResult, nproc: int) -> list[str]:
    result.check()  # on failure: the tail of every workerlog
    problems = []
    if sorted(result.worker_logs) != list(range(nproc)):
        problems.append(f"expected worker logs 0..{nproc - 1}, got {sorted(result.worker_logs)}")
    for rank, log in sorted(result.worker_logs.items()):
        problems += [f"rank {rank}: {line}" for line in log.splitlines()
                     if "MUON_CHECK_FAILED" in line]
    return problems


class TestParallelDygraphMuon(unittest.TestCase):
    """Develop's launcher: develop-style code, 2 processes, sharding_degree=2."""

    def _run(self, nproc: int, env: dict[str, str], timeout_s: float) -> dict[str, float]:
        result = run_paddle_launch(DEVELOP_WORKER, nproc, _env(env), timeout_s=timeout_s)
        problems = _problems_of(result, nproc)
        worst: dict[str, float] = {}
        for rank, log in sorted(result.worker_logs.items()):
            seen = {m.group(1): float(m.group(3)) for m in _CASE_RE.finditer(log)
                    if int(m.group(2)) == rank}
            for case, diff in seen.items():
                worst[case] = max(worst.get(case, 0.0), diff)
            if f"MUON_DEVELOP_OK rank={rank}" not in log:
                problems.append(f"rank {rank}: no MUON_DEVELOP_OK")
        if problems:
            raise AssertionError("\n".join(problems) + "\n" + result.failure_message())
        print(f"\n[develop-style {nproc} procs] wall {result.wall_s:.1f}s; max |d| per case: "
              + ", ".join(f"{k}={v:.2e}" for k, v in sorted(worst.items())))
        return worst

    def test_hybrid_parallel_sharding_muon(self):
        worst = self._run(2, {}, timeout_s=240)
        self.assertEqual(sorted(worst), sorted(DEVELOP_CASES),
                         "every case of the worker's matrix must report")

    def test_develop_script_with_comm_group_call_opt(self):
        # 2 emulated nodes x 2 cards: the cross-node phase really runs
        worst = self._run(4, {"GLOO_COMPAT_LOCAL_SIZE": "2", "MUON_GROUP_CALL": "1",
                              "MUON_CASES": "balanced_partition,custom_colour_clear_storage"},
                          timeout_s=240)
        self.assertEqual(sorted(worst), ["balanced_partition", "custom_colour_clear_storage"])


def _launch_moe(nproc: int, env: dict[str, str], timeout_s: float) -> LaunchResult:
    return run_paddle_launch(MOE_WORKER, nproc, _env({"MUON_STEPS": STEPS, **env}),
                             timeout_s=timeout_s)


def _verify_moe(test: unittest.TestCase, result: LaunchResult, nproc: int,
                group_calls: tuple[int, ...], label: str) -> dict:
    """Assert every rank passed every pass and MUON_OK; return the max |d| values."""
    problems = _problems_of(result, nproc)
    vs_ref = {g: 0.0 for g in group_calls}
    hier_vs_flat = 0.0
    for rank, log in sorted(result.worker_logs.items()):
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
    summary = ", ".join(f"group_call={g}: max|param - reference|={v:.3e}"
                        for g, v in vs_ref.items())
    print(f"\n[{label}] {nproc} procs, wall {result.wall_s:.1f}s; {summary}; "
          f"max|on - off|={hier_vs_flat:.3e}")
    for g, v in vs_ref.items():
        test.assertLessEqual(v, ATOL, f"[{label}] group_call={g}: max |d| vs reference")
    test.assertLessEqual(hier_vs_flat, ATOL, f"[{label}] comm_group_call_opt on vs off")
    return {"vs_reference": vs_ref, "hier_vs_flat": hier_vs_flat, "wall_s": result.wall_s}


class TestMuonMoEGloo(unittest.TestCase):
    """The MoE worker on CPU processes (gloo)."""

    def _sharding2(self, label: str, **extra: str) -> dict:
        env = {"MUON_EP": "1", "MUON_MS": "1", "MUON_GROUP_CALL": "0", **extra}
        return _verify_moe(self, _launch_moe(2, env, timeout_s=120), 2, (0,), label)

    def test_cpu_sharding2_no_ep(self):
        self._sharding2("cpu sharding=2")

    def test_cpu_sharding2_overlap(self):
        self._sharding2("cpu sharding=2 comm_overlap", MUON_OVERLAP="1")

    def test_cpu_sharding2_unfused(self):
        self._sharding2("cpu sharding=2 unfused", MUON_FUSED="0")

    def test_cpu_ep4_ms2_emulated_nodes(self):
        env = {"MUON_EP": "4", "MUON_MS": "2", "MUON_GROUP_CALL": "both",
               "PADDLE_LOCAL_SIZE": "2"}
        _verify_moe(self, _launch_moe(8, env, timeout_s=300), 8, (0, 1),
                    "cpu 4 nodes x 2 cards ep=4 ms=2")


def _gpu_count() -> int:
    import paddle

    if not paddle.is_compiled_with_cuda():
        return 0
    try:
        return int(paddle.device.cuda.device_count())
    except Exception:
        return 0


@unittest.skipUnless(_gpu_count() >= 8, "needs >= 8 visible GPUs")
class TestMuonNccl(unittest.TestCase):
    def test_gpu_nccl(self):
        import gloo_compat

        n = _gpu_count()
        saved = {k: os.environ.pop(k, None)
                 for k in (gloo_compat.FORCE_ENV, "PADDLE_DISTRI_BACKEND")}
        try:
            self.assertFalse(gloo_compat.gloo_expected(),
                             "gloo compat would be installed on a CUDA host")
        finally:
            os.environ.update({k: v for k, v in saved.items() if v is not None})
        if n >= 16:
            nproc, env = 16, {"MUON_EP": "8", "MUON_MS": "2", "PADDLE_LOCAL_SIZE": "8"}
        else:
            nproc, env = 8, {"MUON_EP": "4", "MUON_MS": "2", "PADDLE_LOCAL_SIZE": "4"}
        env.update({"MUON_GROUP_CALL": "both", gloo_compat.FORCE_ENV: "0"})
        _verify_moe(self, _launch_moe(nproc, env, timeout_s=300), nproc, (0, 1),
                    f"gpu nccl {nproc} procs ep={env['MUON_EP']} ms={env['MUON_MS']}")


if __name__ == "__main__":
    unittest.main()
