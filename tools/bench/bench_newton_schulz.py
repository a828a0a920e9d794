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
"""Newton-Schulz time against the time of its matmuls alone.

    PYTHONPATH=python:test python3 tools/bench/bench_newton_schulz.py
        [--shapes 1024x1024 1024x4096 16x512x1408] [--steps 5] [--reps 5]
        [--warmup 1] [--coeffs simple|quintic] [--no-profile]

For every shape, in the same run and alternating repetitions:

* ``ns``: ``newton_schulz(x, coeffs, steps)`` from ``paddle_muon_ext``.
* ``mm``: the ``3 * steps`` matmuls it must do and nothing else: with X in
  the wide orientation (``[.., m, n]``, m <= n) and precomputed inputs
  X, A = X X^T and B, the loop runs ``matmul(X, X, transpose_y=True)``
  ([m, n] x [n, m]), ``matmul(A, A)`` ([m, m]^2) and ``matmul(B, X)``
  ([m, m] x [m, n]) ``steps`` times, the same calls newton_schulz makes.

``ratio = median(ns) / median(mm)`` per shape; ``overall`` is
``sum(median ns) / sum(median mm)``. Target: <= 1.10.

The profile (on by default) times each non-matmul piece of newton_schulz in
isolation on the same shapes (cast check / transposes, Frobenius norm and
scaling, the per-step ``b*A + c*AA`` and ``a*X + BX`` element-wise ops) and
one alternative formulation (the element-wise ops folded into
``paddle.addmm`` / ``paddle.baddbmm``, i.e. GEMM with beta/alpha), checked
numerically against newton_schulz, so the report says where the non-matmul
time goes and what a change would buy.

Grouped mode (``--grouped [COUNTxMxN ...]``): one MoE owner's Muon update,
``Muon.update_params`` on the same matrices, three ways, alternating
repetitions in one run: per matrix (``ns_per_matrix=True``), develop's
grouping (same-key matrices stacked into one batched Newton-Schulz, split at
``--max-group-bytes``; ``ns_cpu_chunk_bytes=0``) and this package's default
(develop's batches cut into ``ns_cpu_chunk_bytes`` chunks on a CPU place).
Prints per case ``speedup = per_matrix_ms / ms`` of both grouped variants,
the batch sizes each makes and the largest difference from the per-matrix
result; ``RESULT grouped_speedup`` is ours on the main case. The main case
is the owner of every spec together; with several specs each also runs
alone, then every ``--grouped-cases`` spec (``--grouped`` with no spec: the
default owner 64 x [512, 1408] plus 4 x [2048, 2048], then 256 x [512, 1024],
256 x [128, 256] (small matrices) and 16 x [1024, 2816]). Edges are divided by ``--scale``
(default 4) so a run finishes in about a minute on a CPU; ``--scale 1`` is
the real size (GPU).

Importable: ``bench(...)`` returns a dict with ``overall_ratio`` and per
shape ``ratio``; ``bench_grouped(...)`` the grouped figures; ``main(argv)``
prints and returns one of them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
_PY = os.path.join(_REPO, "python")
if _PY not in sys.path:
    sys.path.insert(0, _PY)

import numpy as np  # noqa: E402
import paddle  # noqa: E402

from paddle_muon_ext.optimizer import muon as muon_module  # noqa: E402
from paddle_muon_ext.optimizer import (  # noqa: E402
    Muon,
    build_muon_param_info_map,
    newton_schulz,
    resolve_ns_coeffs,
)

TARGET = 1.10
DEFAULT_SHAPES = ("1024x1024", "1024x4096", "16x512x1408")
# A MoE owner: 64 expert matrices [512, 1408] and 4 dense [2048, 2048].
DEFAULT_GROUPED = ("64x512x1408", "4x2048x2048")
DEFAULT_GROUPED_SCALE = 4
# More cases of ``--grouped`` alone: small matrices (launch-bound) and a key
# of large ones (one batch far beyond a core's L2).
DEFAULT_GROUPED_CASES = ("256x512x1024", "256x128x256", "16x1024x2816")


def parse_shape(text: str) -> List[int]:
    shape = [int(v) for v in text.lower().split("x")]
    if len(shape) not in (2, 3) or min(shape) < 1:
        raise ValueError(f"shape must be MxN or ExMxN, got {text!r}")
    return shape


def _sync() -> None:
    # GPU kernels run asynchronously: time them to completion.
    if paddle.is_compiled_with_cuda():
        paddle.device.synchronize()


def _time(fn: Callable[[], object]) -> float:
    _sync()
    t0 = time.perf_counter()
    out = fn()
    # Touch the result so lazily scheduled work (none on CPU today) is done.
    if isinstance(out, paddle.Tensor):
        out._is_initialized()
    _sync()
    return time.perf_counter() - t0


def _swap(x: paddle.Tensor) -> paddle.Tensor:
    perm = list(range(x.ndim))
    perm[-2], perm[-1] = perm[-1], perm[-2]
    return paddle.transpose(x, perm)


def _wide(x: paddle.Tensor) -> paddle.Tensor:
    return _swap(x) if x.shape[-2] > x.shape[-1] else x


def ns_addmm(x: paddle.Tensor, coeffs, steps: int) -> paddle.Tensor:
    """Candidate: newton_schulz with element-wise ops folded into GEMM beta/alpha."""
    X = x if x.dtype == paddle.float32 else paddle.cast(x, "float32")
    transposed = X.shape[-2] > X.shape[-1]
    X = _wide(X)
    norm = paddle.linalg.norm(X, p="fro", axis=[-2, -1], keepdim=True)
    X = X / (norm + 1e-7)
    gemm = paddle.addmm if X.ndim == 2 else paddle.baddbmm
    for i in range(steps):
        a, b, c = coeffs[i % len(coeffs)]
        A = paddle.matmul(X, X, transpose_y=True)
        B = gemm(A, A, A, beta=b, alpha=c)
        X = gemm(X, B, X, beta=a, alpha=1.0)
    return _swap(X) if transposed else X


def _profile(x: paddle.Tensor, coeffs, steps: int, reps: int) -> Dict[str, float]:
    """Median ms of each non-matmul piece of newton_schulz (per call totals)."""
    a, b, c = coeffs[0]
    X = _wide(x)
    A = paddle.matmul(X, X, transpose_y=True)
    AA = paddle.matmul(A, A)
    B = b * A + c * AA
    BX = paddle.matmul(B, X)
    tall = x.shape[-2] > x.shape[-1]

    pieces = {
        "transpose_in_out": (lambda: (_swap(x), _swap(X)) if tall else None, 1),
        "norm_and_scale": (
            lambda: X / (paddle.sqrt(paddle.sum(X * X, axis=[-2, -1], keepdim=True)) + 1e-7), 1),
        "alt: linalg.norm fro": (
            lambda: X / (paddle.linalg.norm(X, p="fro", axis=[-2, -1], keepdim=True) + 1e-7), 1),
        "b*A+c*AA (per step)": (lambda: b * A + c * AA, steps),
        "a*X+BX (per step)": (lambda: a * X + BX, steps),
    }
    out = {}
    for name, (fn, times) in pieces.items():
        samples = [_time(fn) for _ in range(reps + 1)][1:]
        out[name] = 1000.0 * statistics.median(samples) * times
    return out


def bench_shape(shape: Sequence[int], steps: int = 5, coeffs=None, reps: int = 5,
                warmup: int = 1, profile: bool = True) -> Dict:
    """ns vs matmul-only time for one shape (median of ``reps``)."""
    coeffs = coeffs or resolve_ns_coeffs("simple")
    rng = np.random.default_rng(0)
    x = paddle.to_tensor(rng.normal(0, 1, list(shape)).astype("float32"))
    b, c = coeffs[0][1], coeffs[0][2]
    X = _wide(x)
    X = X / paddle.sqrt(paddle.sum(X * X, axis=[-2, -1], keepdim=True))
    A = paddle.matmul(X, X, transpose_y=True)
    B = b * A + c * paddle.matmul(A, A)

    def run_ns():
        return newton_schulz(x, coeffs, steps)

    def run_mm():
        out = None
        for _ in range(steps):
            paddle.matmul(X, X, transpose_y=True)
            paddle.matmul(A, A)
            out = paddle.matmul(B, X)
        return out

    def run_addmm():
        return ns_addmm(x, coeffs, steps)

    ns_t, mm_t, alt_t = [], [], []
    for i in range(warmup + reps):
        t_ns, t_mm = _time(run_ns), _time(run_mm)
        t_alt = _time(run_addmm) if profile else 0.0
        if i >= warmup:
            ns_t.append(t_ns)
            mm_t.append(t_mm)
            alt_t.append(t_alt)
    res = {
        "shape": list(shape),
        "wide_shape": list(X.shape),
        "steps": steps,
        "ns_ms": 1000.0 * statistics.median(ns_t),
        "mm_ms": 1000.0 * statistics.median(mm_t),
    }
    res["ratio"] = res["ns_ms"] / res["mm_ms"]
    if profile:
        ref = newton_schulz(x, coeffs, steps).numpy()
        alt = run_addmm().numpy()
        res["addmm_ms"] = 1000.0 * statistics.median(alt_t)
        res["addmm_ratio"] = res["addmm_ms"] / res["mm_ms"]
        res["addmm_max_abs_diff"] = float(np.max(np.abs(ref - alt)))
        res["profile_ms"] = _profile(x, coeffs, steps, max(3, reps))
    return res


def bench(shapes: Sequence[str] = DEFAULT_SHAPES, steps: int = 5, coeff_type: str = "simple",
          reps: int = 5, warmup: int = 1, profile: bool = True) -> Dict:
    """Every shape; ``overall_ratio = sum(ns) / sum(mm)``."""
    coeffs = resolve_ns_coeffs(coeff_type)
    results = [bench_shape(parse_shape(s), steps, coeffs, reps, warmup, profile) for s in shapes]
    out = {
        "coeff_type": coeff_type,
        "coeffs": coeffs,
        "steps": steps,
        "shapes": results,
        "overall_ratio": sum(r["ns_ms"] for r in results) / sum(r["mm_ms"] for r in results),
        "target": TARGET,
    }
    if profile:
        out["overall_addmm_ratio"] = (sum(r["addmm_ms"] for r in results)
                                      / sum(r["mm_ms"] for r in results))
    return out


def parse_group(text: str, scale: int = 1) -> List[int]:
    """``COUNTxMxN`` -> ``[count, M // scale, N // scale]``."""
    parts = [int(v) for v in text.lower().split("x")]
    if len(parts) != 3 or min(parts) < 1 or scale < 1:
        raise ValueError(f"grouped spec must be COUNTxMxN, got {text!r}")
    return [parts[0], max(1, parts[1] // scale), max(1, parts[2] // scale)]


def _owner(spec: Sequence[List[int]], seed: int):
    rng = np.random.default_rng(seed)
    params, grads = [], []
    with paddle.utils.unique_name.guard():
        for i, (count, m, n) in enumerate(spec):
            for j in range(count):
                value = rng.normal(0, 0.02, (m, n)).astype("float32")
                p = paddle.create_parameter(
                    [m, n], "float32", name=f"owner{i}_{j}",
                    default_initializer=paddle.nn.initializer.Assign(value))
                params.append(p)
                grads.append(paddle.to_tensor(rng.normal(0, 1, (m, n)).astype("float32")))
    return params, grads


def _update_runs(spec: Sequence[List[int]], steps: int, variants: Dict[str, Dict]) -> Dict:
    runs = {}
    for label, kwargs in variants.items():
        params, grads = _owner(spec, seed=0)
        opt = Muon(learning_rate=0.02, parameters=params, ns_steps=steps,
                   ns_matmul_dtype=paddle.float32 if not paddle.is_compiled_with_cuda()
                   else None,
                   muon_param_info_map=build_muon_param_info_map(params), **kwargs)
        muon, _ = opt.prepare_optimize(list(zip(params, grads)))
        runs[label] = (opt, params, muon)
    return runs


def _batches(opt, muon) -> Dict[str, List[int]]:
    """Per Muon shape, the sizes of the batched Newton-Schulz calls update_params makes."""
    by_key: Dict = {}
    for pg in muon:
        by_key.setdefault(opt.muon_group_key(pg[0]), []).append(pg)
    out = {}
    for key, group in by_key.items():
        subs = [[pg] for pg in group] if opt._ns_per_matrix else opt._split_group_by_bytes(group)
        out["x".join(map(str, key[1]))] = [len(chunk) for sub in subs
                                           for chunk in opt._cpu_ns_chunks(sub)]
    return out


def bench_grouped_case(spec: Sequence[List[int]], steps: int = 5, reps: int = 3,
                       warmup: int = 1, max_group_bytes: Optional[int] = 2 * 1024**3) -> Dict:
    """One owner's ``update_params``, three ways, alternating repetitions in one run.

    * ``per_matrix``: ``ns_per_matrix=True`` (one Newton-Schulz per matrix).
    * ``develop``: develop's grouping, one batch per key up to
      ``muon_max_group_bytes`` (``ns_cpu_chunk_bytes=0``).
    * ``grouped``: this package's default (develop's batches, cut into
      ``ns_cpu_chunk_bytes`` chunks on a CPU place).
    """
    variants = {
        "per_matrix": {"ns_per_matrix": True},
        "develop": {"muon_max_group_bytes": max_group_bytes, "ns_cpu_chunk_bytes": 0},
        "grouped": {"muon_max_group_bytes": max_group_bytes},
    }
    runs = _update_runs(spec, steps, variants)

    def update(label):
        opt, _, muon = runs[label]
        return lambda: opt.update_params(muon, [])

    samples = {label: [] for label in variants}
    for i in range(warmup + reps):
        # alternate the order: every variant sees the same machine load
        order = list(samples) if i % 2 == 0 else list(reversed(list(samples)))
        for label in order:
            t = _time(update(label))
            if i >= warmup:
                samples[label].append(t)

    def diff(label):
        return max(float(np.max(np.abs(a.numpy().astype("float64") - b.numpy())))
                   for a, b in zip(runs["per_matrix"][1], runs[label][1]))

    res = {
        "groups": [f"{c}x{m}x{n}" for c, m, n in spec],
        "per_matrix_ms": 1000.0 * statistics.median(samples["per_matrix"]),
        "develop_ms": 1000.0 * statistics.median(samples["develop"]),
        "grouped_ms": 1000.0 * statistics.median(samples["grouped"]),
        "splits": _batches(runs["develop"][0], runs["develop"][2]),
        "chunks": _batches(runs["grouped"][0], runs["grouped"][2]),
        "max_abs_diff": diff("grouped"),
        "develop_max_abs_diff": diff("develop"),
    }
    # Speedups: median over repetitions of per-matrix / variant within the
    # same repetition (run back to back, so load drifting between
    # repetitions cancels); the medians of the times are printed beside.
    for label, key in (("grouped", "grouped_speedup"), ("develop", "develop_grouped_speedup")):
        res[key] = statistics.median(
            p / g for p, g in zip(samples["per_matrix"], samples[label]))
    return res


def bench_grouped(groups: Sequence[str] = DEFAULT_GROUPED, scale: int = DEFAULT_GROUPED_SCALE,
                  steps: int = 5, reps: int = 3, warmup: int = 1,
                  max_group_bytes: Optional[int] = 2 * 1024**3,
                  cases: Sequence[str] = ()) -> Dict:
    """Per-matrix vs grouped ``update_params``: the owner ``groups``, then more cases.

    The main case is the owner made of every ``groups`` spec; with more than
    one spec each also runs alone, then each of ``cases`` (one spec each).
    Top-level keys are the main case's (:func:`bench_grouped_case`); ``cases``
    lists every case.
    """
    main_spec = [parse_group(g, scale) for g in groups]
    specs = [main_spec]
    if len(main_spec) > 1:
        specs += [[one] for one in main_spec]
    specs += [[parse_group(c, scale)] for c in cases]
    results = [bench_grouped_case(spec, steps, reps, warmup, max_group_bytes) for spec in specs]
    res = dict(results[0])
    res.update({
        "scale": scale,
        "steps": steps,
        "max_group_bytes": max_group_bytes,
        "chunk_bytes": muon_module._CPU_NS_CHUNK_BYTES,
        "device": paddle.device.get_device(),
        "cases": results,
    })
    return res


def _main_grouped(args, argv) -> Dict:
    print("# bench_newton_schulz --grouped: Muon.update_params of one owner, per matrix "
          "(ns_per_matrix=True) vs develop's batched Newton-Schulz (ns_cpu_chunk_bytes=0) vs "
          "ours (develop's batches cut into CPU chunks)")
    print(f"# command: python3 tools/bench/bench_newton_schulz.py "
          f"{' '.join(argv) if argv is not None else ' '.join(sys.argv[1:])}".rstrip())
    groups = args.grouped or list(DEFAULT_GROUPED)
    cases = args.grouped_cases if args.grouped_cases is not None else (
        [] if args.grouped else list(DEFAULT_GROUPED_CASES))
    res = bench_grouped(groups, args.scale, args.steps, args.reps, args.warmup,
                        args.max_group_bytes or None, cases)
    print(f"# paddle {paddle.__version__}, device {res['device']}, steps={args.steps}, "
          f"reps={args.reps} (median, alternating), warmup={args.warmup}, edges / {args.scale}"
          f"{' (scaled down for a CPU)' if args.scale > 1 else ''}, "
          f"muon_max_group_bytes={res['max_group_bytes']}, ns_cpu_chunk_bytes={res['chunk_bytes']}")
    print(f"{'case':<28} {'per-matrix ms':>13} {'develop ms':>10} {'ratio':>6} {'ours ms':>8} "
          f"{'ratio':>6} {'max|diff|':>9}  batches develop -> ours")
    for case in res["cases"]:
        print(f"{'+'.join(case['groups']):<28} {case['per_matrix_ms']:>13.1f} "
              f"{case['develop_ms']:>10.1f} {case['develop_grouped_speedup']:>6.3f} "
              f"{case['grouped_ms']:>8.1f} {case['grouped_speedup']:>6.3f} "
              f"{max(case['max_abs_diff'], case['develop_max_abs_diff']):>9.1e}  "
              f"{case['splits']} -> {case['chunks']}")
    print("# ratio = median over repetitions of per-matrix time / that column's time in the "
          "same repetition (> 1: faster than one matrix at a time); ms are medians")
    for case in res["cases"][1:]:
        print(f"RESULT grouped_speedup[{'+'.join(case['groups'])}]={case['grouped_speedup']:.3f} "
              f"develop={case['develop_grouped_speedup']:.3f}")
    print(f"RESULT develop_grouped_speedup={res['develop_grouped_speedup']:.3f}")
    print(f"RESULT grouped_speedup={res['grouped_speedup']:.3f}")
    return res


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--coeffs", default="simple", choices=["simple", "quintic"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--grouped", nargs="*", metavar="COUNTxMxN",
                    help=f"grouped vs per-matrix update of one owner (alone: "
                         f"{' '.join(DEFAULT_GROUPED)}, then each of those and "
                         f"{' '.join(DEFAULT_GROUPED_CASES)})")
    ap.add_argument("--grouped-cases", nargs="*", metavar="COUNTxMxN",
                    help="more --grouped cases, one key each (default with --grouped "
                         "alone: " + " ".join(DEFAULT_GROUPED_CASES) + ")")
    ap.add_argument("--scale", type=int, default=DEFAULT_GROUPED_SCALE,
                    help="divide every --grouped edge by this (default %(default)s; 1 on a GPU)")
    ap.add_argument("--max-group-bytes", type=int, default=2 * 1024**3,
                    help="muon_max_group_bytes of the grouped run (0: no limit)")
    args = ap.parse_args(argv)
    if args.grouped is not None:
        try:
            return _main_grouped(args, argv)
        except ValueError as err:
            ap.error(str(err))

    coeffs = resolve_ns_coeffs(args.coeffs)
    print("# bench_newton_schulz: newton_schulz(x, coeffs, steps) vs its 3*steps matmuls alone")
    print(f"# command: python3 tools/bench/bench_newton_schulz.py "
          f"{' '.join(argv) if argv is not None else ' '.join(sys.argv[1:])}".rstrip())
    print(f"# paddle {paddle.__version__}, device {paddle.device.get_device()}, "
          f"coeffs={args.coeffs} (a, b, c)={coeffs}, steps={args.steps}, "
          f"reps={args.reps} (median), warmup={args.warmup}")
    res = bench(args.shapes, args.steps, args.coeffs, args.reps, args.warmup,
                not args.no_profile)
    print(f"{'shape':<14} {'wide':<14} {'ns ms':>9} {'mm ms':>9} {'ratio':>6}"
          + ("" if args.no_profile else f" {'addmm ms':>9} {'ratio':>6} {'maxdiff':>8}"))
    for r in res["shapes"]:
        line = (f"{'x'.join(map(str, r['shape'])):<14} {'x'.join(map(str, r['wide_shape'])):<14} "
                f"{r['ns_ms']:>9.2f} {r['mm_ms']:>9.2f} {r['ratio']:>6.3f}")
        if not args.no_profile:
            line += f" {r['addmm_ms']:>9.2f} {r['addmm_ratio']:>6.3f} {r['addmm_max_abs_diff']:>8.1e}"
        print(line)
    if not args.no_profile:
        print("# profile: non-matmul pieces of newton_schulz, ms per call (isolated), "
              "% of the matmul-only time")
        for r in res["shapes"]:
            parts = ", ".join(f"{k} {v:.2f} ({100 * v / r['mm_ms']:.1f}%)"
                              for k, v in r["profile_ms"].items())
            print(f"  {'x'.join(map(str, r['shape']))}: {parts}")
        print(f"# candidate (addmm/baddbmm fused element-wise ops) overall ratio "
              f"{res['overall_addmm_ratio']:.3f}")
    for r in res["shapes"]:
        print(f"RESULT ns_ratio[{'x'.join(map(str, r['shape']))}]={r['ratio']:.3f}")
    ok = res["overall_ratio"] <= TARGET
    print(f"RESULT ns_overall_ratio={res['overall_ratio']:.3f} target<={TARGET} "
          f"{'OK' if ok else 'MISS'}")
    return res


if __name__ == "__main__":
    main()
