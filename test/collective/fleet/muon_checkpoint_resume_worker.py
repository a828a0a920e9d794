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
"""Worker: a 2-rank checkpoint resumed on one process, as docs/USAGE.md says.

``save CKPT NPZ`` (under ``paddle.distributed.launch``, 2 gloo ranks):
``CheckpointNet`` (bf16 ``mlp`` weights: master weights) with the sharded
Muon optimizer trains 2 steps and ``save_sharded_checkpoint`` saves model
and optimizer; rank 0 then writes every saved value, assembled from both
ranks' pieces into global fp32 arrays, to ``NPZ``.

``resume CKPT NPZ OUT`` (one plain process): ``fleet.init`` and
``fleet.distributed_optimizer`` (which hands back the ``Muon`` itself on one
process), a fresh model and optimizer, the state dict built as USAGE shows,
``load_sharded_checkpoint``; writes ``OUT`` (JSON): the optimizer's class,
the error if any, and each key's largest difference from ``NPZ``.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import paddle
import paddle.distributed as dist

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.abspath(os.path.join(_HERE, "..", "..")))  # test/: mock

from muon_checkpoint_model import (  # noqa: E402
    CheckpointNet,
    Layout,
    checkpoint_state,
    make_optimizer,
)

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_checkpoint import (  # noqa: E402
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)

LAYOUT = Layout(ms=2, dense_dtype="bfloat16")
SAVE_STEPS = 2


def pieces(state: dict) -> dict:
    """key -> (global shape, offset, local shape, flat range or None, fp32 values)."""
    out = {}
    for key, sw in state.items():
        flat = ((sw.flattened_range.start, sw.flattened_range.stop)
                if sw.is_flattened else None)
        out[key] = (tuple(sw.global_shape), tuple(sw.global_offset), tuple(sw.local_shape),
                    flat, sw.local_tensor.astype("float32").numpy().copy())
    return out


def assemble(per_rank: list[dict]) -> dict[str, np.ndarray]:
    """Global arrays from every rank's pieces; NaN where no rank wrote."""
    arrays: dict[str, np.ndarray] = {}
    for ranks_pieces in per_rank:
        for key, (global_shape, offset, local_shape, flat, value) in ranks_pieces.items():
            full = arrays.setdefault(key, np.full(global_shape, np.nan, "float32"))
            region = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
            if flat is None:
                full[region] = value.reshape(local_shape)
            else:
                block = full[region].reshape(-1).copy()
                block[flat[0]:flat[1]] = value.reshape(-1)
                full[region] = block.reshape(local_shape)
    return arrays


def save(ckpt: str, npz: str) -> None:
    from gloo_compat import install_gloo_compat
    from mock.fake_hcg import hybrid_names_and_dims
    from muon_checkpoint_model import build_rank, train
    from muon_test_compat import register_cpu_tensor_fusion
    from paddle.distributed.fleet.base.topology import EPHybridCommunicateGroup

    install_gloo_compat()
    register_cpu_tensor_fusion()  # the optimizer's fused buffers on CPU: an explicit opt-in
    dist.init_parallel_env()
    hcg = EPHybridCommunicateGroup(*hybrid_names_and_dims(LAYOUT.ep, LAYOUT.ms))
    net, opt = build_rank(LAYOUT, hcg)
    train(net, opt, hcg, 0, SAVE_STEPS)
    state = checkpoint_state(net, opt)
    save_sharded_checkpoint(state, ckpt)
    gathered: list = []
    dist.all_gather_object(gathered, pieces(state))
    if dist.get_rank() == 0:
        np.savez(npz, **assemble(gathered))
    print(f"RESUME_SAVED rank={dist.get_rank()} type={type(opt).__name__}", flush=True)


def resume(ckpt: str, npz: str, out: str) -> None:
    from paddle.distributed import fleet

    fleet.init(is_collective=True)
    net = CheckpointNet(None, 1, dense_dtype=LAYOUT.dense_dtype)
    opt = fleet.distributed_optimizer(make_optimizer(net, multi_precision=True))
    result = {"optimizer": type(opt).__name__, "error": None, "diff": {}}
    state = net.sharded_state_dict()
    state.update(opt.sharded_state_dict(state))  # as docs/USAGE.md shows
    try:
        load_sharded_checkpoint(state, ckpt)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(exc).__name__}: {exc}"
    else:
        with np.load(npz) as saved:
            result["saved_keys"] = sorted(saved.files)
            result["nan_keys"] = sorted(k for k in saved.files if np.isnan(saved[k]).any())
            for key, sw in state.items():
                got = sw.local_tensor.astype("float32").numpy().reshape(sw.global_shape)
                want = saved[key] if key in saved.files else None
                result["diff"][key] = (None if want is None or want.shape != got.shape
                                       else float(np.abs(got - want).max()))
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    if sys.argv[1] == "save":
        save(sys.argv[2], sys.argv[3])
        from worker_exit import exit_after_verdict

        exit_after_verdict()
    else:
        resume(sys.argv[2], sys.argv[3], sys.argv[4])
