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
"""What atomic saves and verified loads cost, side by side with raw flex_checkpoint.

    PYTHONPATH=python python3 tools/bench/bench_checkpoint.py [--mb 64 256] [--repeat 3]
        [--dir DIR] [--json]

One process: a state dict of ``MB`` megabytes of fp32 tensors (16 of them) is
saved and loaded with ``paddle.distributed.save_state_dict`` /
``load_state_dict`` into a fresh directory, then with
``save_sharded_checkpoint`` / ``load_sharded_checkpoint`` (marker, SHA-256 of
every file, one rename; checksums verified before loading). Prints the best
of ``--repeat`` seconds of each and the ratios ours / raw. The extra cost is
hashing what was written (a read of the page cache right after the write)
and hashing what is about to be read; multi-rank jobs spread the load-side
hashing over the ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
if os.path.join(_REPO, "python") not in sys.path:
    sys.path.insert(0, os.path.join(_REPO, "python"))

TENSORS = 16


def _state(mb: int):
    import numpy as np
    import paddle

    n = mb * (1 << 20) // 4 // TENSORS
    rng = np.random.default_rng(0)
    return {f"t{i}": paddle.to_tensor(rng.standard_normal(n).astype("float32"))
            for i in range(TENSORS)}


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(mb: int, repeat: int, root: str) -> dict:
    """Seconds of raw and atomic save/load of ``mb`` MB."""
    import paddle

    from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_checkpoint import (
        load_sharded_checkpoint,
        save_sharded_checkpoint,
    )

    state = _state(mb)
    target = {k: paddle.zeros_like(v) for k, v in state.items()}
    counter = [0]

    def fresh() -> str:
        counter[0] += 1
        path = os.path.join(root, f"{mb}_{counter[0]}")
        shutil.rmtree(path, ignore_errors=True)
        return path

    raw_dir, ours_dir = fresh(), fresh()
    row = {
        "mb": mb,
        "raw_save_s": _best(lambda: paddle.distributed.save_state_dict(state, fresh()), repeat),
        "ours_save_s": _best(lambda: save_sharded_checkpoint(state, fresh()), repeat),
    }
    paddle.distributed.save_state_dict(state, raw_dir)
    save_sharded_checkpoint(state, ours_dir)
    row["raw_load_s"] = _best(lambda: paddle.distributed.load_state_dict(target, raw_dir),
                              repeat)
    row["ours_load_s"] = _best(lambda: load_sharded_checkpoint(target, ours_dir), repeat)
    row["save_ratio"] = row["ours_save_s"] / row["raw_save_s"]
    row["load_ratio"] = row["ours_load_s"] / row["raw_load_s"]
    return row


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Atomic save / verified load vs raw flex_checkpoint, one process.")
    parser.add_argument("--mb", type=int, nargs="+", default=[64, 256],
                        help="state dict sizes in MB (default 64 256)")
    parser.add_argument("--repeat", type=int, default=3, help="best of N (default 3)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print only JSON")
    args = parser.parse_args(argv)
    if any(mb < 1 for mb in args.mb) or args.repeat < 1:
        print("error: --mb and --repeat must be positive", file=sys.stderr)
        return 2
    root = tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir)
    try:
        rows = [measure(mb, args.repeat, root) for mb in args.mb]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'MB':>6} {'raw save s':>11} {'ours save s':>12} {'ratio':>6} "
          f"{'raw load s':>11} {'ours load s':>12} {'ratio':>6}")
    for r in rows:
        print(f"{r['mb']:>6} {r['raw_save_s']:>11.3f} {r['ours_save_s']:>12.3f} "
              f"{r['save_ratio']:>6.2f} {r['raw_load_s']:>11.3f} {r['ours_load_s']:>12.3f} "
              f"{r['load_ratio']:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
