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
"""Worker: Muon sharding written only against Paddle develop's API.

Launched by ``test_parallel_dygraph_muon.py`` through
``paddle.distributed.launch``. On paddle 3.3.x the one line
``paddle_muon_ext.patch_paddle()`` supplies develop's names (the export to
Paddle drops that block); nothing else refers to the package. For every case it trains a small model under
``MixPrecisionLayer`` + AMP O2 (bf16; on CPU Paddle keeps fp32) with
``strategy.use_muon_sharding = True`` and ``fleet.distributed_optimizer``,
and compares every parameter after each step with a single-process
``MixPrecisionOptimizer(Muon)`` run on the full batch (computed here, on
every rank).

Environment:
    MUON_CASES        comma-separated case names (default: all of CASES)
    MUON_GROUP_CALL   "1": sharding_configs.comm_group_call_opt on
    MUON_STEPS        optimizer steps per case (default 3)
Prints ``MUON_CASE_PASS case=<name> rank=<r> max_abs_diff=<d>`` per case and
``MUON_DEVELOP_OK rank=<r>`` at the end; exits 1 on the first mismatch.

Tolerances: fp32 parameters 1e-5 (the sharded run differs from the
reference only in the order of summation inside reductions, ~1e-7 per op,
and Newton-Schulz keeps that within a few ulps of O(1) updates; a routing or
option error is an O(lr) = 1e-2 change). bf16 parameters 2e-2: one bf16 ulp
at the largest weights (~2) is 7.8e-3 and the bf16 gradients of half batches
and of the full batch round differently.
"""

from __future__ import annotations

import os
import sys

import numpy as np

# paddle_muon_ext: compat-begin
import paddle_muon_ext  # noqa: E402  paddle 3.3.x: develop's Muon names

paddle_muon_ext.patch_paddle()
# paddle_muon_ext: compat-end

import paddle  # noqa: E402
import paddle.distributed as dist  # noqa: E402
from paddle.distributed import fleet  # noqa: E402
from paddle.distributed.fleet.meta_optimizers.muon_sharding_optimizer import (  # noqa: E402
    MuonShardingOptimizer,
)
from paddle.distributed.fleet.utils.mix_precision_utils import (  # noqa: E402
    MixPrecisionLayer,
    MixPrecisionOptimizer,
)
from paddle.optimizer.muon import MuonParamInfo, _default_should_use_muon  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gloo_compat import apply_emulated_local_size, install_gloo_compat  # noqa: E402

H, INNER, EXPERTS, OUT, BATCH_PER_RANK, LR = 16, 24, 2, 8, 4, 0.02
EXCLUDE = ["head"]
FP32_TOL, BF16_TOL = 1e-5, 2e-2
CUSTOM_COLOUR = "custom_experts"


def split_qkv(update, orthogonalize):
    """split_concat_func of the fused qkv weight: three blocks, each on its own."""
    blocks = paddle.split(update, 3, axis=-1)
    return paddle.concat([orthogonalize(b) for b in blocks], axis=-1)


def _no_decay_for_norm_and_bias(name: str) -> bool:
    return "norm" not in name and not name.endswith("bias")


# name -> (Muon keyword arguments, options of this worker)
CASES = {
    "simple": ({}, {}),
    "quintic": ({"ns_coeff_type": "quintic"}, {}),
    "polar_express": ({"ns_coeff_type": "polar_express"}, {}),
    "aol": ({"ns_coeff_type": "aol"}, {}),
    # Eight iterations of (3.4445, -4.7750, 2.0315) grow a perturbation along
    # small singular directions by up to 3.4445 each: the ~1e-7 summation-order
    # differences of the gradients reach 4.3e-5 (measured, 3 steps) on updates
    # of ~4e-3; 2e-4 still rejects any routing error (an O(update) change).
    "deepseekv4": ({"ns_coeff_type": "deepseekv4", "ns_steps": 10}, {"fp32_tol": 2e-4}),
    # a convergent pair (each maps singular value 1 close to 1), cycled
    "custom_coeffs": ({"ns_coeff_type": "custom",
                       "ns_coeffs": [(3.4445, -4.7750, 2.0315), (1.875, -1.25, 0.375)]}, {}),
    "custom_colour_clear_storage": ({}, {"custom_colour": True}),
    "split_concat_func": ({}, {"split_qkv": True}),
    "master_weights_bf16": ({"multi_precision": True}, {"dtype": "bfloat16"}),
    "apply_decay_param_fun": ({"weight_decay": 0.1,
                               "apply_decay_param_fun": _no_decay_for_norm_and_bias}, {}),
    "balanced_partition": ({}, {"partition": "balanced"}),
}


def _init_values(seed: int = 7) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "linear1.weight": rng.normal(0, 0.3, (H, INNER)),
        "linear1.bias": rng.normal(0, 0.1, (INNER,)),
        "qkv.weight": rng.normal(0, 0.3, (INNER, 3 * H)),
        "norm.weight": 1 + rng.normal(0, 0.1, (3 * H,)),
        "experts.weight": rng.normal(0, 0.3, (EXPERTS, 3 * H, H)),
        "head.weight": rng.normal(0, 0.3, (H, OUT)),
    }


class SimpleNet(paddle.nn.Layer):
    """qkv-style fused matrix, a 3-D expert weight, 1-D params and an excluded head."""

    def __init__(self, prefix: str, dtype: str = "float32", expert_color=None) -> None:
        super().__init__()
        self.params = {}
        for name, value in _init_values().items():
            p = self.create_parameter(
                list(value.shape), dtype=dtype,
                default_initializer=paddle.nn.initializer.Assign(value.astype("float32")))
            # every rank (and every case) needs the same names, as processes do
            p.name = prefix + name
            self.add_parameter(name.replace(".", "_"), p)
            self.params[name] = p
        if expert_color is not None:
            self.params["experts.weight"].color = expert_color

    def forward(self, x):
        w = {k: (p if p.dtype == paddle.float32 else p.astype("float32"))
             for k, p in self.params.items()}
        h = paddle.tanh(paddle.matmul(x, w["linear1.weight"]) + w["linear1.bias"])
        h = paddle.matmul(h, w["qkv.weight"]) * w["norm.weight"]
        y = sum(paddle.tanh(paddle.matmul(h, w["experts.weight"][e])) for e in range(EXPERTS))
        return (paddle.matmul(y, w["head.weight"]) ** 2).mean()


def batch(step: int, rank: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * step + rank)
    return rng.normal(0, 1, (BATCH_PER_RANK, H)).astype("float32")


def build(prefix: str, muon_kwargs: dict, options: dict, expert_color=None):
    model = SimpleNet(prefix, options.get("dtype", "float32"), expert_color)
    info = {
        p.name: MuonParamInfo(use_muon=_default_should_use_muon(p.name, p.shape, EXCLUDE))
        for p in model.parameters()
    }
    if options.get("split_qkv"):
        qkv = model.params["qkv.weight"].name
        info[qkv] = MuonParamInfo(use_muon=True, split_concat_func=split_qkv)
    model = paddle.amp.decorate(models=model, level="O2", dtype="bfloat16")
    model = MixPrecisionLayer(model, dtype="bfloat16")
    muon = paddle.optimizer.Muon(
        learning_rate=LR, parameters=model.parameters(),
        grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0),
        muon_param_info_map=info, **muon_kwargs)
    return model, MixPrecisionOptimizer(muon)


def case_strategy(world: int, group_call: bool, partition: str | None):
    strategy = fleet.DistributedStrategy()
    strategy.use_muon_sharding = True
    sharding_configs = {"comm_buffer_size_MB": 1, "comm_group_call_opt": group_call}
    if partition is not None:
        sharding_configs["muon_partition_strategy"] = partition
    hybrid_configs = {
        "dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": world,
        "sharding_configs": sharding_configs,
    }
    if group_call:
        # the hierarchical path reads the MoE topology; every parameter here
        # stays in the default sharding group (all ranks), routed across nodes
        hybrid_configs.update({
            "ep_degree": world // 2, "moe_sharding_degree": 2,
            "order": ["dp", "moe_sharding", "pp", "sharding", "sep", "cp", "ep", "mp"],
        })
    strategy.hybrid_configs = hybrid_configs
    return strategy


def run_case(name: str, steps: int, world: int, group_call: bool) -> float:
    muon_kwargs, options = CASES[name]
    rank = dist.get_rank()
    colour = None
    if options.get("custom_colour"):
        colour = {"color": CUSTOM_COLOUR, "group": CUSTOM_GROUP}
    model, opt = build("", muon_kwargs, options, colour)
    opt = fleet.distributed_optimizer(
        opt, strategy=case_strategy(world, group_call, options.get("partition")))
    if not isinstance(opt._inner_opt, MuonShardingOptimizer):
        fail(f"case {name}: fleet.distributed_optimizer did not build MuonShardingOptimizer")
    ref_model, ref_opt = build("ref.", muon_kwargs, options)
    worst = 0.0
    for step in range(steps):
        with paddle.amp.auto_cast(level="O2", dtype="bfloat16"):
            loss = model(paddle.to_tensor(batch(step, rank)))
        loss.backward()
        if colour is not None:
            # FP8-style training frees the colour's storage before step()
            opt.clear_param_storage(CUSTOM_COLOUR)
        opt.step()
        opt.clear_grad()

        full = np.concatenate([batch(step, r) for r in range(world)])
        with paddle.amp.auto_cast(level="O2", dtype="bfloat16"):
            ref_loss = ref_model(paddle.to_tensor(full))
        ref_loss.backward()
        ref_opt.step()
        ref_opt.clear_grad()
        worst = max(worst, compare(name, step, model, ref_model,
                                   options.get("fp32_tol", FP32_TOL)))
    return worst


def compare(name: str, step: int, model, ref_model, fp32_tol: float) -> float:
    worst = 0.0
    ref = dict(ref_model.named_parameters())
    for key, p in model.named_parameters():
        tol = fp32_tol if p.dtype == paddle.float32 else BF16_TOL
        got = p.astype("float32").numpy()
        want = ref[key].astype("float32").numpy()
        diff = float(np.abs(got - want).max())
        worst = max(worst, diff)
        if not diff <= tol:
            fail(f"case {name} rank {dist.get_rank()} step {step + 1}: parameter {key} "
                 f"differs from single-process MixPrecisionOptimizer(Muon) by max |d|="
                 f"{diff:.3e} > {tol}")
    return worst


def fail(message: str) -> None:
    print(f"MUON_CHECK_FAILED {message}", flush=True)
    sys.exit(1)


CUSTOM_GROUP = None


def main() -> None:
    global CUSTOM_GROUP
    apply_emulated_local_size()
    install_gloo_compat()
    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    group_call = os.environ.get("MUON_GROUP_CALL", "0") == "1"
    steps = int(os.environ.get("MUON_STEPS", "3"))
    names = [c for c in os.environ.get("MUON_CASES", ",".join(CASES)).split(",") if c]
    fleet.init(is_collective=True, strategy=case_strategy(world, group_call, None))
    CUSTOM_GROUP = dist.new_group(list(range(world)))
    for name in names:
        diff = run_case(name, steps, world, group_call)
        print(f"MUON_CASE_PASS case={name} rank={dist.get_rank()} "
              f"max_abs_diff={diff:.3e}", flush=True)
    print(f"MUON_DEVELOP_OK rank={dist.get_rank()}", flush=True)


if __name__ == "__main__":
    main()
    from worker_exit import exit_after_verdict

    exit_after_verdict()
