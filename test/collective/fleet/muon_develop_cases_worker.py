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
"""Worker: the scenarios of develop's mixed-dtype, no-hook and overlap-sync
workers, with their expectations, on 2 ranks and develop's public names.

Launched by ``test_muon_develop_worker_cases.py``. Written as a user's
script: ``paddle.distributed``/``paddle.optimizer.muon`` imports, the model
wrapped by ``MixPrecisionLayer`` / ``MixPrecisionOptimizer``, ``fleet.init``
once, the sharding options changed between runs on the user strategy (as
develop's workers toggle ``comm_overlap``).

* ``mixed_dtype`` (develop's T-MD): 4 x [512, 512] low precision + 2 x
  [256, 256] fp32 Muon matrices in the default colour,
  ``comm_buffer_size_MB=1``: low-precision owners {0, 1}, fp32 owners {0},
  the same owner map on every rank, one fp32 2-D buffer, finite losses and
  bit-identical parameters on every rank after 3 steps. On a CPU place
  ``paddle.amp.decorate`` casts nothing (it returns the model untouched off
  GPU/XPU/custom places, in 3.3.1 and in develop), so develop's worker would
  see six fp32 matrices there; the low branch is cast to bf16 here, as
  ``decorate(level="O2")`` does on a GPU.
* ``no_hook`` (develop's T-NH, 2-card form): fc2 coloured
  ``dense_weight_no_hook`` and reused in a detached second graph;
  ``clear_param_storage`` every step; sync-only buffers present, overlap
  buffers present with ``comm_overlap`` on; 4 steps with ``comm_overlap`` on
  and off give bit-identical parameters.
* ``overlap_sync`` (develop's overlap-sync worker, 2 ranks instead of 8):
  18 Linears cycling widths 512 -> 384 -> 640 (``MUON_DEVELOP_OVERLAP_BLOCKS``
  x 3; 6 as develop) plus 4 x 300,000 1-D
  parameters, ``comm_buffer_size_MB=1``, ``ClipGradByGlobalNorm(1e-3)``;
  ``overlap_optimize_and_sync`` follows the flag; after step 1 at least two
  '2d' and two '1d' stages and a 2-D stage with more than one owner; losses
  and parameters bit-identical to the flag-off run after
  ``MUON_DEVELOP_OVERLAP_STEPS`` steps (5 as develop).

Prints ``MUON_DEVELOP_CASE_OK rank=<r> case=<name> <facts>`` per case; exit 1
with ``MUON_CHECK_FAILED`` on a broken expectation.
"""

from __future__ import annotations

import os
import sys

import numpy as np

# paddle_muon_ext: compat-begin
import paddle_muon_ext

paddle_muon_ext.patch_paddle()
# paddle_muon_ext: compat-end

import paddle  # noqa: E402
from paddle.distributed import fleet  # noqa: E402
from paddle.distributed.fleet.meta_optimizers.muon_sharding_optimizer import (  # noqa: E402
    MuonShardingOptimizer,
)
from paddle.distributed.fleet.utils import mix_precision_utils  # noqa: E402
from paddle.optimizer.muon import MuonParamInfo, _default_should_use_muon  # noqa: E402

DEGREE = 2
NO_HOOK = "dense_weight_no_hook"
OVERLAP_FLAG = "FLAGS_muon_sharding_overlap_optimize_and_sync"


def fail(message: str) -> None:
    print(f"MUON_CHECK_FAILED {message}", flush=True)
    sys.exit(1)


def expect(cond: bool, message: str) -> None:
    if not cond:
        fail(message)


def _short(dtype) -> str:
    return str(dtype).split(".")[-1]


def _linear(n_in, n_out, weight, bias=None):
    init = paddle.nn.initializer.Assign
    return paddle.nn.Linear(
        n_in, n_out, weight_attr=paddle.framework.ParamAttr(initializer=init(weight)),
        bias_attr=False if bias is None else paddle.framework.ParamAttr(
            initializer=paddle.nn.initializer.Constant(bias)))


def _muon(model, grad_clip=None):
    info = {p.name: MuonParamInfo(use_muon=_default_should_use_muon(n, p.shape, []),
                                  split_concat_func=None)
            for n, p in model.named_parameters()}
    return paddle.optimizer.Muon(
        parameters=model.parameters(), learning_rate=0.001, weight_decay=0.00001,
        muon_param_info_map=info, ns_steps=5, ns_coeff_type="simple",
        multi_precision=True, grad_clip=grad_clip)


def _wrap(model, optimizer):
    optimizer = mix_precision_utils.MixPrecisionOptimizer(optimizer)
    model = fleet.distributed_model(model)
    optimizer = fleet.distributed_optimizer(optimizer)
    inner = optimizer._inner_opt
    expect(isinstance(inner, MuonShardingOptimizer),
           f"fleet built {type(inner).__name__}, not develop's MuonShardingOptimizer")
    return model, optimizer, inner


def _sharding_configs():
    return fleet.fleet._user_defined_strategy.hybrid_configs["sharding_configs"]


def _same_on_every_rank(name: str, value: np.ndarray) -> None:
    gathered = []
    paddle.distributed.all_gather(gathered, paddle.to_tensor(value))
    for rank, other in enumerate(gathered):
        expect(np.array_equal(other.numpy(), value),
               f"{name} differs between rank {rank} and rank "
               f"{paddle.distributed.get_rank()}")


# ----------------------------------------------------------- mixed dtype
class MixedDtypeNet(paddle.nn.Layer):
    def __init__(self, low, fp32):
        super().__init__()
        self.low_layers = paddle.nn.LayerList([_linear(512, 512, w) for w in low])
        self.fp32_layers = paddle.nn.LayerList([_linear(256, 256, w) for w in fp32])

    def forward(self, x):
        # the bf16 weights enter the product as fp32 (3.3.1's CPU kernels have
        # no bf16 matmul); their gradients arrive in bf16, as on a GPU
        h = x
        for fc in self.low_layers:
            h = paddle.matmul(h, fc.weight.astype("float32"))
        g = x[:, :256]
        for fc in self.fp32_layers:
            g = fc(g)
        return h.mean() + g.mean()


def mixed_dtype(rank: int) -> str:
    rng = np.random.RandomState(2024)
    low = [(rng.randn(512, 512) / np.sqrt(512)).astype("float32") for _ in range(4)]
    fp32 = [(rng.randn(256, 256) / np.sqrt(256)).astype("float32") for _ in range(2)]
    data = [rng.random_sample((16, 512)).astype("float32") for _ in range(3)]
    _sharding_configs().comm_buffer_size_MB = 1
    _sharding_configs().comm_overlap = False
    model = mix_precision_utils.MixPrecisionLayer(MixedDtypeNet(low, fp32), dtype="bfloat16")
    for layer in model._layers.low_layers:
        layer.to(dtype="bfloat16")  # what decorate(level="O2") does on a GPU
    model, optimizer, inner = _wrap(model, _muon(model))
    dtype_of = {p.name: _short(p.dtype) for ps in inner._params_2d_by_color.values()
                for p in ps}
    owners = {}
    for name2rank in inner._param2rank_2d_by_color.values():
        for name, owner in name2rank.items():
            owners.setdefault(dtype_of[name], set()).add(owner)
    expect(set(owners) == {"bfloat16", "float32"}, f"regime: 2-D dtypes {owners}")
    expect(owners["bfloat16"] == {0, 1}, f"bf16 owners {owners['bfloat16']}, want {{0, 1}}")
    expect(owners["float32"] == {0}, f"fp32 owners {owners['float32']}, want {{0}}")
    maps = []
    paddle.distributed.all_gather_object(
        maps, {str(c): dict(m) for c, m in inner._param2rank_2d_by_color.items()})
    expect(all(m == maps[0] for m in maps), f"owner maps differ between ranks: {maps}")
    n_fp32 = sum(1 for b in inner.comm_buffer_2d if _short(b._params[0].dtype) == "float32")
    expect(n_fp32 == 1, f"{n_fp32} fp32 2-D buffers, want 1")
    for step, x in enumerate(data):
        loss = model(paddle.to_tensor(x[rank * 8:(rank + 1) * 8]))
        expect(bool(np.isfinite(float(loss))), f"step {step} loss {float(loss)}")
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
    initial = low + fp32
    for i, (name, p) in enumerate(model.named_parameters()):
        value = p.cast("float32").numpy()
        expect(bool(np.isfinite(value).all()), f"{name} is not finite")
        # trained: 3 steps of lr 1e-3 move every matrix (a bf16 ulp at these
        # magnitudes is ~4e-3 of the value, so compare with its rounding)
        start = paddle.to_tensor(initial[i]).astype(p.dtype).astype("float32").numpy()
        expect(not np.array_equal(value, start), f"{name} did not change in 3 steps")
        _same_on_every_rank(name, value)
    return (f"bf16_owners={sorted(owners['bfloat16'])} fp32_owners={sorted(owners['float32'])} "
            f"fp32_buffers={n_fp32}")


# --------------------------------------------------------------- no hook
class ThreeLayerFC(paddle.nn.Layer):
    def __init__(self, w):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = (_linear(64, 64, a) for a in w)

    def forward(self, x):
        h1 = self.fc1(x)
        out = self.fc3(self.fc2(h1))
        # fc2's weight back-propagates from a second, detached graph too
        return out.mean() + paddle.matmul(h1.detach(), self.fc2.weight).mean()


def no_hook(rank: int) -> str:
    rng = np.random.RandomState(2021)
    weights = [rng.random_sample((64, 64)).astype("float32") for _ in range(3)]
    data = [rng.random_sample((16, 64)).astype("float32") for _ in range(4)]
    _sharding_configs().comm_buffer_size_MB = 256
    group = fleet.get_hybrid_communicate_group().get_sharding_parallel_group()
    finals, n_overlap = {}, 0
    for overlap in (False, True):
        _sharding_configs().comm_overlap = overlap
        model = mix_precision_utils.MixPrecisionLayer(ThreeLayerFC(weights), dtype="bfloat16")
        model = paddle.amp.decorate(models=model, level="O2", dtype="bfloat16")
        for name, p in model.named_parameters():
            if "fc2" in name:
                p.color = {"color": NO_HOOK, "group": group}
        model, optimizer, inner = _wrap(model, _muon(model))
        expect(len(inner._sync_only_buffers) > 0, "fc2 is not in a sync-only buffer")
        expect(inner.comm_overlap is overlap, f"comm_overlap is {inner.comm_overlap}")
        if overlap:
            n_overlap = len(inner._overlap_comm_buffers)
            expect(n_overlap > 0, "no overlap buffers for fc1/fc3")
        for x in data:
            with paddle.amp.auto_cast(dtype="bfloat16"):
                loss = model(paddle.to_tensor(x[rank * 8:(rank + 1) * 8]))
            loss.backward()
            optimizer.clear_param_storage(NO_HOOK)
            optimizer.step()
            optimizer.clear_grad()
        finals[overlap] = {n: p.cast("float32").numpy() for n, p in model.named_parameters()}
    expect(set(finals[True]) == set(finals[False]), "different parameter names")
    for name, value in finals[False].items():
        expect(np.array_equal(finals[True][name], value),
               f"{name}: comm_overlap on and off differ")
    return f"params={len(finals[False])} overlap_buffers={n_overlap}"


# ---------------------------------------------------------- overlap sync
DIMS = (512, 384, 640)


class MuonMLP(paddle.nn.Layer):
    def __init__(self, weights, extras):
        super().__init__()
        self.linears = paddle.nn.LayerList(
            [_linear(w.shape[0], w.shape[1], w, 0.01 * i) for i, w in enumerate(weights)])
        self.extras = paddle.nn.ParameterList([
            self.create_parameter(shape=[e.size], dtype="float32",
                                  default_initializer=paddle.nn.initializer.Assign(e))
            for e in extras])

    def forward(self, x):
        h = x
        for linear in self.linears:
            h = paddle.tanh(linear(h))
        loss = h.mean() * 100
        for extra in self.extras:
            loss = loss + 0.01 * extra.mean()
        return loss


def overlap_sync(rank: int) -> str:
    steps = int(os.environ.get("MUON_DEVELOP_OVERLAP_STEPS", "5"))
    blocks = int(os.environ.get("MUON_DEVELOP_OVERLAP_BLOCKS", "6"))
    rng = np.random.RandomState(2021)
    shapes = [(DIMS[i], DIMS[(i + 1) % 3]) for _ in range(blocks) for i in range(3)]
    weights = [rng.random_sample(s).astype("float32") / 32 for s in shapes]
    extras = [rng.random_sample((300000,)).astype("float32") for _ in range(4)]
    data = [rng.random_sample((16, DIMS[0])).astype("float32") for _ in range(steps)]
    _sharding_configs().comm_buffer_size_MB = 1
    _sharding_configs().comm_overlap = False
    runs, facts = {}, ""
    for overlap in (False, True):
        os.environ[OVERLAP_FLAG] = "1" if overlap else "0"
        model = mix_precision_utils.MixPrecisionLayer(MuonMLP(weights, extras),
                                                      dtype="bfloat16")
        model = paddle.amp.decorate(models=model, level="O2", dtype="bfloat16")
        model, optimizer, inner = _wrap(
            model, _muon(model, grad_clip=paddle.nn.ClipGradByGlobalNorm(1e-3)))
        expect(inner.overlap_optimize_and_sync is overlap,
               f"overlap_optimize_and_sync is {inner.overlap_optimize_and_sync} with the "
               f"flag {os.environ[OVERLAP_FLAG]}")
        losses = []
        for step, x in enumerate(data):
            with paddle.amp.auto_cast(dtype="bfloat16"):
                loss = model(paddle.to_tensor(x[rank * 8:(rank + 1) * 8]))
            loss.backward()
            optimizer.step()
            optimizer.clear_grad()
            losses.append(loss.cast("float32").numpy())
            if overlap and step == 0:
                stages = inner._sync_stages
                expect(stages is not None, "the sync stages were not built")
                s2d = [s for s in stages if s["kind"] == "2d"]
                s1d = [s for s in stages if s["kind"] == "1d"]
                expect(len(s2d) >= 2 and len(s1d) >= 2,
                       f"{len(s2d)} 2-D and {len(s1d)} 1-D stages, want >= 2 each")
                expect(any(len(s["rank2params"]) > 1 for s in s2d),
                       "no 2-D stage has more than one owner")
                facts = f"stages_2d={len(s2d)} stages_1d={len(s1d)}"
        runs[overlap] = (losses, {n: p.cast("float32").numpy()
                                  for n, p in model.named_parameters()})
    os.environ.pop(OVERLAP_FLAG, None)
    for step, (a, b) in enumerate(zip(runs[False][0], runs[True][0])):
        expect(np.array_equal(a, b), f"step {step} loss differs with the flag on")
    for name, value in runs[False][1].items():
        expect(np.array_equal(runs[True][1][name], value),
               f"{name}: overlap_optimize_and_sync on and off differ")
    return f"{facts} linears={len(shapes)} steps={steps}"


CASES = {"mixed_dtype": mixed_dtype, "no_hook": no_hook, "overlap_sync": overlap_sync}


def main() -> None:
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"sharding_degree": DEGREE, "dp_degree": 1, "mp_degree": 1,
                               "pp_degree": 1}
    strategy.use_muon_sharding = True
    strategy.hybrid_configs["sharding_configs"].accumulate_steps = 1
    fleet.init(is_collective=True, strategy=strategy)
    rank = paddle.distributed.get_rank()
    names = [c for c in os.environ.get("MUON_DEVELOP_CASES", ",".join(CASES)).split(",") if c]
    for name in names:
        paddle.seed(2024)
        facts = CASES[name](rank)
        print(f"MUON_DEVELOP_CASE_OK rank={rank} case={name} {facts}", flush=True)


if __name__ == "__main__":
    main()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from worker_exit import exit_after_verdict

    exit_after_verdict()
