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
"""Fuzz the balanced owner rule against the module at a git revision.

    python tools/bench/fuzz_partition.py --against main [--models 200] [--seed 0]

Random models (200-4,000 matrices over 16-512 ranks by default): many or few
shapes, 3-D experts, runs of equal experts, zero-size matrices, one to three
dtypes (a small minority class is capped to few owners), shuffled
``rank_order``, ``multi_precision`` on or off. Every model's owners must be
identical to the revision's; the first difference is printed and the exit
status is 1. Prints the summed seconds of both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(_HERE, "..", "..", "python"))

from bench_partition import load_revision  # noqa: E402

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.owners import (  # noqa: E402
    MatrixSpec,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.owners import (  # noqa: E402
    balanced_partition,
)


def random_case(rng: random.Random, index: int, max_matrices: int, max_ranks: int):
    """(specs, nranks, rank_order, multi_precision) of one random model."""
    nranks = rng.randint(16, max_ranks)
    count = rng.randint(min(200, max_matrices), max_matrices)
    dims = rng.sample([0, 16, 64, 128, 256, 512, 768, 1024, 1536, 2048, 4096],
                      rng.randint(2, 8))
    dims = [d for d in dims if d] + ([0] if rng.random() < 0.2 else [])
    dtypes = rng.sample(["bfloat16", "float32", "float16"], rng.randint(1, 3))
    weights = [1.0] + [rng.choice([0.01, 0.05, 0.3, 1.0]) for _ in dtypes[1:]]
    expert = (rng.choice(dims) or 64, rng.choice(dims) or 64)
    specs = []
    for i in range(count):
        if rng.random() < 0.3:  # a run of equal experts
            shape = expert if rng.random() < 0.7 else (rng.choice([2, 4, 8]),) + expert
            dtype = dtypes[0]
        else:
            m, n = rng.choice(dims), rng.choice(dims)
            shape = (m, n) if rng.random() < 0.8 else (rng.choice([2, 4, 8]), m, n)
            dtype = rng.choices(dtypes, weights)[0]
        specs.append(MatrixSpec(f"w{index}_{i:05d}", shape, dtype))
    rng.shuffle(specs)
    order = list(range(nranks))
    if rng.random() < 0.7:
        rng.shuffle(order)
    return specs, nranks, order, rng.random() < 0.8


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", default="main", metavar="REV",
                    help="git revision whose balanced rule is the reference (default main)")
    ap.add_argument("--models", type=int, default=200, help="number of random models")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-matrices", type=int, default=4000)
    ap.add_argument("--max-ranks", type=int, default=512)
    ap.add_argument("--json", action="store_true", help="print JSON only")
    args = ap.parse_args(argv)
    if args.models < 1 or args.max_matrices < 1 or args.max_ranks < 16:
        print("error: --models and --max-matrices must be >= 1, --max-ranks >= 16",
              file=sys.stderr)
        return 2
    try:
        ref = load_revision(args.against)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    now_s = then_s = 0.0
    bad = None
    for index in range(args.models):
        specs, nranks, order, mp = random_case(rng, index, args.max_matrices, args.max_ranks)
        t0 = time.perf_counter()
        got = balanced_partition(specs, nranks, rank_order=order, multi_precision=mp).owners
        t1 = time.perf_counter()
        want = ref.balanced_partition(specs, nranks, rank_order=order,
                                      multi_precision=mp).owners
        t2 = time.perf_counter()
        now_s += t1 - t0
        then_s += t2 - t1
        if got != want:
            diff = sorted(k for k in got if got[k] != want[k])
            bad = {"model": index, "matrices": len(specs), "ranks": nranks,
                   "multi_precision": mp, "differing": len(diff),
                   "first": {k: [got[k], want[k]] for k in diff[:3]}}
            break
    out = {"against": args.against, "models": index + 1, "same_owners": bad is None,
           "now_s": round(now_s, 3), "then_s": round(then_s, 3),
           "then_over_now": round(then_s / max(now_s, 1e-9), 2), "first_difference": bad}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['models']} random models vs {args.against}: "
              f"{'same owners' if bad is None else 'DIFFERENT owners'}; "
              f"now {now_s:.2f} s, then {then_s:.2f} s (then/now {out['then_over_now']:.2f})")
        if bad is not None:
            print(f"first difference: {json.dumps(bad)}")
    return 0 if bad is None else 1


if __name__ == "__main__":
    sys.exit(main())
