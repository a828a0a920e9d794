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
"""Worker: MuonShardingOptimizer's rank agreement on real gloo processes.

Launched with 2 processes (sharding_degree=2), or 4 (dp_degree=2 x
sharding_degree=2: two sharding groups). ``AGREE_MODE``:

* ``order``: the last rank passes its parameters in reverse order; every
  rank prints ``AGREE_RESULT`` with the error it got at construction (on 4
  ranks only the last sharding group disagrees: the other one must refuse
  too instead of going on).
* ``settings``: 2 processes; constructs once per row of :data:`SETTING_CASES`
  (rank 1 differs from rank 0 in one setting that changes numbers, or in
  none) and prints ``AGREE_CASE`` with each rank's outcome; then trains
  :data:`NO_GRAD_STEPS` steps of a model that leaves ``agree.w_out`` and
  ``agree.norm`` out of the forward and prints ``AGREE_NO_GRAD`` with the
  initial and final values of every parameter.
* ``bench``: constructs ``AGREE_REPS`` times with the check and as often
  with it replaced by a no-op, alternating, and prints ``AGREE_BENCH`` with
  the median milliseconds of each (``tools/bench/bench_rank_agreement.py``).
"""

import json
import os
import statistics
import time

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.distributed import fleet

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import build as _build
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_optimizer import (
    MuonShardingOptimizer,
)
from paddle_muon_ext.distributed.fleet.utils.gloo_compat import install_gloo_compat

from muon_test_compat import register_cpu_tensor_fusion
from paddle_muon_ext.optimizer.muon import Muon, MuonParamInfo

SHAPES = {"w_in": [16, 16], "b_in": [16], "w_out": [16, 8], "norm": [8]}


def params(reverse: bool) -> list:
    out = []
    for i, (name, shape) in enumerate(SHAPES.items()):
        init = paddle.nn.initializer.Assign(np.full(shape, 0.1 * (i + 1), dtype="float32"))
        p = paddle.create_parameter(shape, "float32", default_initializer=init)
        p.name = f"agree.{name}"  # the same names on every rank
        out.append(p)
    return out[::-1] if reverse else out


def construct(strategy, hcg, reverse: bool = False, edit=None,
              **muon_kwargs) -> MuonShardingOptimizer:
    ps = params(reverse)
    if edit is not None:
        edit(ps)
    muon_kwargs.setdefault("learning_rate", 0.02)
    muon = Muon(parameters=ps, muon_param_info_map={
        p.name: MuonParamInfo(use_muon=len(p.shape) == 2) for p in ps}, **muon_kwargs)
    return MuonShardingOptimizer(muon, hcg, strategy)


def _stepped(scheduler):
    scheduler.step()
    return scheduler


def _set(name: str, attr: str, value):
    def edit(ps):
        for p in ps:
            if p.name == f"agree.{name}":
                setattr(p, attr, value)
    return edit


StepDecay = paddle.optimizer.lr.StepDecay
GlobalNorm = paddle.nn.ClipGradByGlobalNorm

#: row -> (rank 0's Muon keyword arguments, rank 1's); "edit" edits the
#: parameters before Muon is built (ParamAttr-like settings)
SETTING_CASES = {
    "scheduler parameter": (dict(learning_rate=StepDecay(0.02, 1, gamma=0.1)),
                            dict(learning_rate=StepDecay(0.02, 1, gamma=0.9))),
    "scheduler state": (dict(learning_rate=StepDecay(0.02, 1, gamma=0.5)),
                        dict(learning_rate=_stepped(StepDecay(0.02, 1, gamma=0.5)))),
    "scheduler class": (dict(learning_rate=StepDecay(0.02, 1)),
                        dict(learning_rate=paddle.optimizer.lr.ExponentialDecay(0.02, 0.1))),
    "clip threshold": (dict(grad_clip=GlobalNorm(1e-4)), dict(grad_clip=GlobalNorm(100.0))),
    "clip class": (dict(grad_clip=GlobalNorm(1.0)), dict(grad_clip=paddle.nn.ClipGradByNorm(1.0))),
    "lr_ratio": (dict(lr_ratio=lambda p: 1.0),
                 dict(lr_ratio=lambda p: 0.5 if p.name == "agree.w_out" else 1.0)),
    "apply_decay_param_fun": (dict(), dict(apply_decay_param_fun=lambda n: n != "agree.norm")),
    "optimize_attr learning_rate": (dict(), dict(edit=_set("b_in", "optimize_attr",
                                                           {"learning_rate": 2.0}))),
    "regularizer": (dict(edit=_set("w_in", "regularizer", paddle.regularizer.L2Decay(0.01))),
                    dict(edit=_set("w_in", "regularizer", paddle.regularizer.L2Decay(0.1)))),
    "need_clip": (dict(), dict(edit=_set("w_out", "need_clip", False))),
    # other objects, the same values on every parameter: nothing to refuse
    "equal settings": (dict(learning_rate=StepDecay(0.02, 1), grad_clip=GlobalNorm(1.0)),
                       dict(learning_rate=StepDecay(0.02, 1), grad_clip=GlobalNorm(1.0),
                            lr_ratio=lambda p: 1.0, apply_decay_param_fun=lambda n: True)),
}

NO_GRAD_STEPS = 2
NO_GRAD_LR, NO_GRAD_WD = 0.1, 0.5  # decay factor 0.95 per step: far above float noise
#: left out of the forward on every rank: they never receive a gradient
NO_GRAD_UNUSED = ("agree.w_out", "agree.norm")


def run_settings_cases(strategy, hcg, rank: int) -> None:
    for case, per_rank in SETTING_CASES.items():
        kwargs = dict(per_rank[min(rank, 1)])
        edit = kwargs.pop("edit", None)
        try:
            construct(strategy, hcg, edit=edit, **kwargs)
            outcome = {"case": case, "rank": rank, "error": None, "message": ""}
        except Exception as error:  # noqa: BLE001 - reported to the test
            outcome = {"case": case, "rank": rank, "error": type(error).__name__,
                       "message": str(error)}
        print("AGREE_CASE " + json.dumps(outcome), flush=True)


def run_no_grad(strategy, hcg, rank: int) -> None:
    ps = params(reverse=False)
    by_name = {p.name: p for p in ps}
    initial = {p.name: p.numpy().tolist() for p in ps}
    muon = Muon(learning_rate=NO_GRAD_LR, weight_decay=NO_GRAD_WD, parameters=ps,
                muon_param_info_map={p.name: MuonParamInfo(use_muon=len(p.shape) == 2)
                                     for p in ps})
    opt = MuonShardingOptimizer(muon, hcg, strategy)
    for step in range(NO_GRAD_STEPS):
        x = paddle.to_tensor(np.random.default_rng(10 * step + rank).normal(
            0, 1, (4, 16)).astype("float32"))
        h = paddle.matmul(x, by_name["agree.w_in"]) + by_name["agree.b_in"]
        (paddle.tanh(h) ** 2).mean().backward()
        opt.reduce_gradients(ps, hcg)
        opt.step()
        opt.clear_grad()
    print("AGREE_NO_GRAD " + json.dumps({
        "rank": rank, "initial": initial,
        "final": {p.name: p.numpy().tolist() for p in ps}}), flush=True)


def main() -> None:
    install_gloo_compat()
    register_cpu_tensor_fusion()  # the optimizer's fused buffers on CPU: an explicit opt-in
    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    strategy = fleet.DistributedStrategy()
    dp = 2 if world == 4 else 1
    strategy.hybrid_configs = {"dp_degree": dp, "mp_degree": 1, "pp_degree": 1,
                               "sharding_degree": world // dp}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    rank = dist.get_rank()
    mode = os.environ.get("AGREE_MODE", "order")
    if mode == "settings":
        run_settings_cases(strategy, hcg, rank)
        run_no_grad(strategy, hcg, rank)
        return
    if mode == "order":
        try:
            construct(strategy, hcg, reverse=rank == world - 1)
            outcome = {"rank": rank, "error": None, "message": ""}
        except Exception as error:  # noqa: BLE001 - reported to the test
            outcome = {"rank": rank, "error": type(error).__name__, "message": str(error)}
        outcome["sharding_group"] = list(hcg.get_sharding_parallel_group().ranks)
        print("AGREE_RESULT " + json.dumps(outcome), flush=True)
        return
    reps = int(os.environ.get("AGREE_REPS", "20"))
    real = _build.check_ranks_agree
    times: dict = {"with": [], "without": []}
    for i in range(2 * reps + 2):
        label = "with" if i % 2 == 0 else "without"
        _build.check_ranks_agree = real if label == "with" else (lambda *args: None)
        dist.barrier()
        start = time.perf_counter()
        construct(strategy, hcg)
        if i >= 2:  # the first pair warms caches up
            times[label].append((time.perf_counter() - start) * 1e3)
    _build.check_ranks_agree = real
    print("AGREE_BENCH " + json.dumps({"rank": rank, **{
        k: statistics.median(v) for k, v in times.items()}}), flush=True)


if __name__ == "__main__":
    main()
    from worker_exit import exit_after_verdict

    exit_after_verdict()
