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
"""Worker: a small MoE-style model trained with MuonShardingOptimizer.

Launched by ``test_parallel_dygraph_muon.py`` (and the demo, tools/demo.py) through
``paddle.distributed.launch``. Every step it checks the parameters against a
single-process Muon run on the full batch; a second pass repeats training
with ``comm_group_call_opt`` flipped and checks both passes agree.

Environment:
    MUON_EP, MUON_MS           ep_degree, moe_sharding_degree (default 1, 1:
                               plain sharding over all ranks, no experts)
    MUON_STEPS                 training steps (default 5)
    MUON_GROUP_CALL            "0", "1" or "both" (default "both" when ep > 1)
    MUON_FUSED                 "1" fused gradient buffers, "0" per-param (default 1)
    MUON_OVERLAP               "1" comm_overlap (default 0)
    MUON_DEMO                  "1" prints a progress line per step and a summary
Exit status 0 on success; 1 with a readable message on mismatch.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter

import numpy as np

import paddle
import paddle.distributed as dist
from paddle.distributed import fleet

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gloo_compat import apply_emulated_local_size, install_gloo_compat  # noqa: E402

from muon_test_compat import (  # noqa: E402
    distributed_optimizer,
    register_cpu_tensor_fusion,
    set_muon_sharding_options,
)
from muon_tiny_moe import Reference, TinyMoE, batch, make_muon  # noqa: E402

# fp32 end to end; the distributed run differs from the reference only in the
# order of summation inside reductions (~1e-7 relative per op). Newton-Schulz
# is a fixed polynomial of a Frobenius-normalised matrix, so those rounding
# differences stay within a few ulps of O(1) updates: 1e-5 absolute over 5
# steps leaves a wide margin over what we measured while catching any real
# routing error (which shows up as O(lr) = 1e-2 differences).
ATOL = 1e-5


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


class CollectiveCounter:
    """Counts collectives per step by group kind (for the demo summary)."""

    NAMES = ("reduce", "broadcast", "all_gather", "reduce_scatter", "all_reduce")

    def __init__(self, kinds: dict[tuple, str]) -> None:
        self.kinds, self.counts, self._saved = kinds, Counter(), {}

    def __enter__(self):
        for name in self.NAMES:
            original = getattr(dist, name)
            self._saved[name] = original

            def wrapped(*args, __op=name, __orig=original, **kwargs):
                group = kwargs.get("group")
                ranks = tuple(group.ranks) if group is not None else ()
                self.counts[(self.kinds.get(ranks, "other"), __op)] += 1
                return __orig(*args, **kwargs)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(dist, name, original)


def build_strategy(ep: int, ms: int, world: int, group_call: bool, fused: bool,
                   overlap: bool):
    strategy = fleet.DistributedStrategy()
    configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": world}
    if ep > 1:
        configs.update({"ep_degree": ep, "moe_sharding_degree": ms,
                        "order": ["dp", "moe_sharding", "pp", "sharding", "sep", "cp", "ep", "mp"]})
    strategy.hybrid_configs = configs
    sc = strategy.hybrid_configs["sharding_configs"]
    sc.comm_buffer_size_MB = 1 if fused else -1
    sc.comm_overlap = overlap
    set_muon_sharding_options(strategy, use_muon_sharding=True,
                              comm_group_call_opt=group_call)
    return strategy


def train(group_call: bool, ep: int, steps: int, fused: bool, overlap: bool,
          demo: bool, reference: Reference | None):
    hcg = fleet.get_hybrid_communicate_group()
    strategy = fleet.fleet._user_defined_strategy
    set_muon_sharding_options(strategy, comm_group_call_opt=group_call)
    rank = dist.get_rank()
    expert_coord = hcg.get_expert_parallel_rank() if ep > 1 else None
    moe_group = hcg.get_moe_sharding_parallel_group() if ep > 1 else None
    net = TinyMoE(expert_coord, moe_group)
    model = fleet.distributed_model(net)
    opt = distributed_optimizer(make_muon(list(net.parameters())))
    kinds = {tuple(hcg.get_sharding_parallel_group().ranks): "sharding"}
    if ep > 1:
        kinds[tuple(moe_group.ranks)] = "moe_sharding"
    plan_groups = getattr(getattr(opt._inner_opt, "_runtime", None), "plan_groups", None)
    if plan_groups is not None:
        kinds[tuple(plan_groups.node_group.ranks)] = "node"
        kinds[tuple(plan_groups.same_card_group.ranks)] = "same_card"
    max_diff, compared = 0.0, 0
    counter_total = Counter()
    for step in range(steps):
        t0 = time.time()
        loss = model(paddle.to_tensor(batch(step, rank)))
        loss.backward()
        with CollectiveCounter(kinds) as counter:
            opt.step()
        opt.clear_grad()
        counter_total.update(counter.counts)
        if reference is not None:
            reference.step(step)
            max_diff = max(max_diff, compare(net, reference, expert_coord, rank, step))
            compared += sum(int(v.size) for v in net.named_values().values())
        if demo and rank == 0:
            print(f"[demo] group_call={int(group_call)} step {step + 1}/{steps} "
                  f"loss={float(loss):.6f} step_time={time.time() - t0:.3f}s", flush=True)
    final = net.named_values()
    per_step = {f"{k}/{op}": v / steps for (k, op), v in sorted(counter_total.items())}
    return final, max_diff, per_step, compared


def compare(net, reference: Reference, expert_coord, rank: int, step: int) -> float:
    expected = reference.values(expert_coord)
    worst = 0.0
    for name, value in net.named_values().items():
        diff = float(np.abs(value - expected[name]).max())
        worst = max(worst, diff)
        if not diff <= ATOL:
            fail(f"rank {rank} step {step + 1}: parameter {name} (expert coord "
                 f"{expert_coord}) differs from the single-process Muon reference "
                 f"by max |d|={diff:.3e} > {ATOL}")
    return worst


def fail(message: str) -> None:
    print(f"MUON_CHECK_FAILED {message}", flush=True)
    sys.exit(1)


def main() -> None:
    # Emulated nodes apply to NCCL runs too (e.g. 2 x 4 cards on one 8-GPU
    # node); the launcher overwrites PADDLE_LOCAL_SIZE with nproc_per_node.
    apply_emulated_local_size()
    install_gloo_compat()
    register_cpu_tensor_fusion()  # the optimizer's fused buffers on CPU: an explicit opt-in
    world = int(os.environ.get("PADDLE_TRAINERS_NUM", dist.get_world_size()))
    ep, ms = env_int("MUON_EP", 1), env_int("MUON_MS", 1)
    steps = env_int("MUON_STEPS", 5)
    if steps < 1:
        fail(f"MUON_STEPS={steps}: a run that trains no step checks nothing; set MUON_STEPS >= 1")
    fused = os.environ.get("MUON_FUSED", "1") == "1"
    overlap = os.environ.get("MUON_OVERLAP", "0") == "1"
    demo = os.environ.get("MUON_DEMO", "0") == "1"
    mode = os.environ.get("MUON_GROUP_CALL", "both" if ep > 1 else "0")
    passes = {"0": [False], "1": [True], "both": [False, True]}[mode]
    if ep > 1 and ms * ep != world:
        fail(f"world size {world} != moe_sharding {ms} x ep {ep}")
    strategy = build_strategy(ep, ms, world, passes[0], fused, overlap)
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    rank = dist.get_rank()
    expert_of_rank = {r: None for r in range(world)}
    if ep > 1:
        topo = hcg._moe_topo
        expert_of_rank = {r: topo.get_coord(r).expert for r in range(world)}

    results, total_compared = [], 0
    for group_call in passes:
        reference = Reference(expert_of_rank)
        t0 = time.time()
        final, max_diff, per_step, compared = train(group_call, ep, steps, fused, overlap,
                                                    demo, reference)
        total_compared += compared
        results.append((group_call, final, max_diff, per_step, time.time() - t0))
        print(f"MUON_PASS rank={rank} group_call={int(group_call)} "
              f"max_abs_diff_vs_reference={max_diff:.3e}", flush=True)

    hier_vs_flat = 0.0
    if len(results) == 2:
        a, b = results[0][1], results[1][1]
        hier_vs_flat = max(float(np.abs(a[k] - b[k]).max()) for k in a)
        if not hier_vs_flat <= ATOL:
            fail(f"rank {rank}: comm_group_call_opt on vs off differ by {hier_vs_flat:.3e}")
    if demo and rank == 0:
        for group_call, _, max_diff, per_step, secs in results:
            print(f"[demo] summary group_call={int(group_call)}: {secs:.1f}s, "
                  f"max|param - reference|={max_diff:.2e}, collectives/step={per_step}")
        if len(results) == 2:
            print(f"[demo] params equal with comm_group_call_opt on/off: "
                  f"max |d| = {hier_vs_flat:.2e}")
    print(f"MUON_OK rank={rank} max_abs_diff_hier_vs_flat={hier_vs_flat:.3e} "
          f"steps={steps} values={total_compared}", flush=True)


if __name__ == "__main__":
    main()
    from worker_exit import exit_after_verdict

    exit_after_verdict()
