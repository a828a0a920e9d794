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
"""The parts of tools/gpu_check.sh (one per call).

    python3 tools/gpu_check.py {numerics,bench,smoke} [--dry-run-cpu]

numerics: develop's GPU default path (bf16 Newton-Schulz, result kept in
  bf16 and scaled there) against an independent float64 NumPy reference:
  Newton-Schulz alone, 3 optimizer steps on fp32 parameters, 3 steps on bf16
  parameters with fp32 master weights, and (where quack-kernels and an SM
  9.x-11.x device exist) symmetric GEMM against the dense bf16 path.
bench: tools/bench/bench_newton_schulz.py, grouped vs per-matrix at full
  size (64 x [512, 1408] + 4 x [2048, 2048]) and NS vs its matmuls.
smoke: MuonShardingOptimizer on one rank (fleet.init, sharding degree 1)
  against plain Muon, 3 steps.

Each part prints ``PASS: <part> ...`` or ``FAIL: <part> ...`` as its last
line and exits 0 / 1. Without CUDA it prints ``SKIP: no CUDA ...`` and exits
77, unless ``--dry-run-cpu`` (small sizes, fp32 matmuls, lines marked
DRY-RUN: checks the script, says nothing about a GPU).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (os.path.join(_REPO, "python"), os.path.join(_REPO, "tools", "bench"),
              os.path.join(_REPO, "test", "legacy_test")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import numpy as np  # noqa: E402
import paddle  # noqa: E402

# The float64 reference is the Muon suite's (develop's coefficients, Newton-
# Schulz, scale rule, bf16 rounding): one copy of the specification.
from test_muon_optimizer import SIMPLE, bf16_round, max_rel, ns_ref, scale_ref  # noqa: E402

# bf16 keeps 8 significant bits (relative step 2^-8 = 3.9e-3); five NS steps
# and the scaling round each product, measured 1e-2..3e-2 of the largest
# entry; a wrong coefficient, scale or formula moves results by > 0.2.
BF16_RTOL = 5e-2
SKIP_EXIT = 77


def _f32(t):
    return t.astype("float32").numpy() if t.dtype != paddle.float32 else t.numpy()


def _muon_ref_steps(values, grads_of, steps, lr=0.02, wd=0.01, beta=0.95):
    """Float64 Muon (nesterov, version 1, extra 0.2) on a list of matrices."""
    ws = [np.asarray(v, np.float64) for v in values]
    ms = [np.zeros_like(w) for w in ws]
    for _ in range(steps):
        gs = grads_of(ws)
        for i, (w, g) in enumerate(zip(ws, gs)):
            ms[i] = ms[i] + (1 - beta) * (g - ms[i])
            u = g + beta * (ms[i] - g)
            ws[i] = w * (1 - lr * wd) - lr * ns_ref(u, SIMPLE, 5) * scale_ref(u.shape, 1)
    return ws


def part_numerics(dry: bool) -> list[str]:
    from paddle_muon_ext.optimizer import Muon, build_muon_param_info_map

    dtype = paddle.float32 if dry else paddle.bfloat16
    lines, rng = [], np.random.default_rng(0)
    shapes = [(64, 176), (2, 32, 88)] if dry else [(512, 1408), (4, 256, 704)]
    for shape in shapes:
        x = rng.standard_normal(shape).astype(np.float32)
        out = Muon._zeropower_via_newtonschulz5(paddle.to_tensor(x), 5, 1e-9, None, dtype)
        if out.dtype != dtype:
            raise AssertionError(f"NS returned {out.dtype}, expected {dtype} (develop)")
        err = max_rel(_f32(out), ns_ref(x, SIMPLE, 5))
        lines.append(f"ns {list(shape)} {dtype}: max rel {err:.2e}")
        if err > BF16_RTOL:
            raise AssertionError(lines[-1] + f" > {BF16_RTOL}")

    # 3 steps of the optimizer, fp32 and bf16+master parameters
    for pdtype in ("float32", "bfloat16"):
        values = [rng.normal(0, 0.5, s).astype(np.float32) for s in shapes]
        if pdtype == "bfloat16":
            values = [bf16_round(v) for v in values]
        consts = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        with paddle.utils.unique_name.guard():
            params = []
            for i, v in enumerate(values):
                p = paddle.create_parameter(list(v.shape), pdtype, name=f"chk{i}",
                                            default_initializer=paddle.nn.initializer.Assign(v))
                params.append(p)
            opt = Muon(0.02, params, muon_param_info_map=build_muon_param_info_map(params),
                       multi_precision=pdtype == "bfloat16", ns_matmul_dtype=dtype)
            for _ in range(3):
                loss = 0.0
                for p, c in zip(params, consts):
                    w = p.astype("float32")
                    loss = loss + paddle.sum(paddle.to_tensor(c) * w) + 0.5 * paddle.sum(w * w)
                loss.backward()
                opt.step()
                opt.clear_grad()

        def grads_of(ws, low=pdtype == "bfloat16"):
            if low:
                return [bf16_round((c + bf16_round(w.astype(np.float32))).astype(np.float32))
                        .astype(np.float64) for c, w in zip(consts, ws)]
            return [c + w for c, w in zip(consts, ws)]

        ref = _muon_ref_steps(values, grads_of, 3)
        for p, r, v in zip(params, ref, values):
            got = opt._master_weights[p.name].numpy() if pdtype == "bfloat16" else p.numpy()
            err = max_rel(got - v, r - v)
            lines.append(f"3 steps {pdtype} params {list(p.shape)}: update max rel {err:.2e}")
            if err > BF16_RTOL:
                raise AssertionError(lines[-1] + f" > {BF16_RTOL}")
    lines.append(_symmetric_check(dry))
    return lines


def _symmetric_check(dry: bool) -> str:
    from paddle_muon_ext.optimizer import muon as muon_module

    if dry:
        return "symmetric GEMM: not run (dry run)"
    try:
        muon_module._load_symmetric_gemm()
    except RuntimeError:
        return "symmetric GEMM: SKIP (quack-kernels not installed)"
    major, _ = paddle.device.cuda.get_device_capability()
    if major not in (9, 10, 11):
        return f"symmetric GEMM: SKIP (compute capability {major}.x)"
    x = paddle.randn([16, 2048, 2048]).astype("float32")
    Muon = muon_module.Muon
    sym = Muon._zeropower_via_newtonschulz5(x, 5, 1e-9, None, paddle.bfloat16, True, 1024, 2e11)
    dense = Muon._zeropower_via_newtonschulz5(x, 5, 1e-9, None, paddle.bfloat16)
    err = max_rel(_f32(sym), _f32(dense))
    if err > 5e-3 * 4:
        raise AssertionError(f"symmetric GEMM vs dense bf16: max rel {err:.2e}")
    return f"symmetric GEMM vs dense bf16 [16, 2048, 2048]: max rel {err:.2e}"


def part_bench(dry: bool) -> list[str]:
    import bench_newton_schulz as bench

    if dry:
        grouped = bench.bench_grouped(("4x64x176", "2x128x128"), scale=1, steps=2, reps=1,
                                      warmup=0)
        ns = bench.bench(("64x64",), steps=2, reps=1, warmup=0, profile=False)
    else:
        grouped = bench.bench_grouped(bench.DEFAULT_GROUPED, scale=1, steps=5, reps=5,
                                      warmup=2)
        ns = bench.bench(bench.DEFAULT_SHAPES, steps=5, reps=5, warmup=2, profile=False)
    lines = [
        f"grouped vs per-matrix update, owner {grouped['groups']}: per matrix "
        f"{grouped['per_matrix_ms']:.1f} ms, grouped {grouped['grouped_ms']:.1f} ms, "
        f"speedup {grouped['grouped_speedup']:.3f}, sub-groups {grouped['splits']}",
        f"NS / its matmuls alone: overall {ns['overall_ratio']:.3f} "
        + ", ".join(f"{'x'.join(map(str, r['shape']))} {r['ratio']:.3f}" for r in ns["shapes"]),
    ]
    # parameters ~0.05; the two paths differ only in GEMM batching/rounding
    if not (grouped["max_abs_diff"] <= 1e-3 and math.isfinite(grouped["grouped_speedup"])):
        raise AssertionError(f"grouped and per-matrix results differ by "
                             f"{grouped['max_abs_diff']:.2e}")
    return lines


def part_smoke(dry: bool) -> list[str]:
    from paddle.distributed import fleet

    from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_optimizer import (
        MuonShardingOptimizer,
    )
    from paddle_muon_ext.optimizer import Muon, build_muon_param_info_map

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1,
                               "sharding_degree": 1}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    dims = (32, 64, 8) if dry else (1024, 2816, 1024)
    results = []
    for sharded in (False, True):
        paddle.seed(2026)
        model = paddle.nn.Sequential(paddle.nn.Linear(dims[0], dims[1]), paddle.nn.GELU(),
                                     paddle.nn.Linear(dims[1], dims[2]))
        params = list(model.parameters())
        opt = Muon(0.02, params, muon_param_info_map=build_muon_param_info_map(params),
                   grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0),
                   ns_matmul_dtype=paddle.float32 if dry else None)
        if sharded:
            opt = MuonShardingOptimizer(opt, hcg, strategy)
        paddle.seed(7)
        for _ in range(3):
            loss = model(paddle.randn([16, dims[0]])).pow(2).mean()
            loss.backward()
            opt.step()
            opt.clear_grad()
        results.append([p.numpy() for p in model.parameters()])
    err = max(max_rel(a, b) for a, b in zip(*results))
    # fp32: summation order only; bf16 NS: a clip factor differing in the last
    # fp32 bit may flip a bf16 rounding (2^-8 of an update, ~1e-5 of a weight)
    tol = 1e-5 if dry else 1e-3
    if not err <= tol:
        raise AssertionError(f"one-rank MuonShardingOptimizer differs from Muon by {err:.2e} "
                             f"(> {tol})")
    return [f"one-rank MuonShardingOptimizer vs Muon, 3 steps, {dims}: max rel {err:.1e}"]


PARTS = {"numerics": part_numerics, "bench": part_bench, "smoke": part_smoke}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("part", choices=sorted(PARTS))
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="run small sizes on the CPU (checks the script only)")
    args = ap.parse_args(argv)
    has_cuda = paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    if not has_cuda and not args.dry_run_cpu:
        print(f"SKIP: {args.part}: no CUDA (paddle {paddle.__version__}, "
              f"compiled with CUDA: {paddle.is_compiled_with_cuda()})")
        return SKIP_EXIT
    label = "DRY-RUN " if args.dry_run_cpu else ""
    if args.dry_run_cpu:
        paddle.set_device("cpu")
    try:
        lines = PARTS[args.part](args.dry_run_cpu)
    except Exception as err:  # one line per part, whatever broke
        print(f"FAIL: {label}{args.part}: {type(err).__name__}: {err}")
        return 1
    for line in lines:
        print(f"  {line}")
    print(f"PASS: {label}{args.part}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
