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
"""Worker of the network-namespace cluster (``paddle_muon_ext.tools.cluster``).

One ``paddle.distributed.launch`` per emulated node starts it; nothing here
emulates the node layout: ``PADDLE_LOCAL_SIZE`` is whatever that node's
launcher set. Every rank prints one-line JSON records (prefix ``CLUSTER_``)
that the cluster launcher parses:

* ``CLUSTER_RANK``  once per rank: its network namespace (inode of
  ``/proc/self/ns/net``), host, ``PADDLE_LOCAL_SIZE`` and what the
  optimizer's plan says its node and card are.
* ``CLUSTER_STEP``  once per rank and step: step time, its forward + backward
  time, the single-process reference step's time, the pass's options as the
  optimizer read them (``applied``), and on the node's
  local rank 0 the bytes its node link sent / received during the step
  (``/sys/class/net/<GLOO_SOCKET_IFNAME>/statistics``; inter-node traffic
  only, since same-node ranks talk over loopback).
* ``CLUSTER_PROBE`` (``MUON_CLUSTER_MODE=probe``): link bytes of single
  collectives, to see which algorithm gloo runs.

``MUON_PASS_CONFIGS`` (``cluster --recommended``): a JSON list of configurations
(``comm_group_call_opt``, ``muon_partition_strategy``, ``comm_buffer_size_MB``),
one training pass each, its index the ``pass`` of every record; without it the
passes are ``MUON_GROUP_CALL``'s (option off / on, 1 MB buffers, the default
owner rule) and ``pass`` is the option's value.

The model is the tiny MoE of ``muon_tiny_moe`` resized by ``MUON_HIDDEN`` /
``MUON_INNER`` so messages are large against per-packet headers. Every step
is checked against the single-process Muon reference (``ATOL`` of the gloo
worker). Exit 0 on success, 1 with ``MUON_CHECK_FAILED`` on a mismatch.
"""

from __future__ import annotations

import json
import os
import sys
import time

import paddle
import paddle.distributed as dist
from paddle.distributed import fleet

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import muon_tiny_moe  # noqa: E402
from gloo_compat import install_gloo_compat  # noqa: E402
from hybrid_parallel_sharding_muon_moe_model import build_strategy, compare, fail  # noqa: E402
from muon_test_compat import (  # noqa: E402
    distributed_optimizer,
    register_cpu_tensor_fusion,
    set_muon_sharding_options,
    sharded_core,
)


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _emit(kind: str, **record) -> None:
    print(f"CLUSTER_{kind} " + json.dumps(record, sort_keys=True), flush=True)


def link_bytes() -> tuple[int, int]:
    """(tx, rx) bytes of this node's link; (0, 0) without GLOO_SOCKET_IFNAME."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if not ifname:
        return 0, 0
    base = f"/sys/class/net/{ifname}/statistics"
    with open(f"{base}/tx_bytes") as f:
        tx = int(f.read())
    with open(f"{base}/rx_bytes") as f:
        rx = int(f.read())
    return tx, rx


class LinkWindow:
    """Link bytes of one synchronised window (all ranks enter and leave it).

    Two barriers in front: every node reads its counters before any rank
    starts the window's traffic; one barrier behind: all of it has arrived.
    """

    def __init__(self, leader: bool) -> None:
        self.leader = leader
        self.tx = self.rx = 0
        self.seconds = 0.0

    def __enter__(self) -> LinkWindow:
        dist.barrier()
        self._start = link_bytes() if self.leader else (0, 0)
        dist.barrier()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:
            return
        dist.barrier()
        self.seconds = time.perf_counter() - self.t0
        end = link_bytes() if self.leader else (0, 0)
        self.tx, self.rx = end[0] - self._start[0], end[1] - self._start[1]


def _local_rank() -> int:
    return _env_int("PADDLE_LOCAL_RANK", dist.get_rank() % _env_int("PADDLE_LOCAL_SIZE", 1))


def _identity(rank: int, plan) -> dict:
    return {
        "rank": rank,
        "local_rank": _local_rank(),
        "netns_inode": os.stat("/proc/self/ns/net").st_ino,
        "endpoint": os.environ.get("PADDLE_CURRENT_ENDPOINT", ""),
        "ifname": os.environ.get("GLOO_SOCKET_IFNAME", ""),
        "paddle_local_size": os.environ.get("PADDLE_LOCAL_SIZE"),
        "plan_node": None if plan is None else plan.node_of(rank),
        "plan_card": None if plan is None else plan.card_of(rank),
        "plan_gpus_per_node": None if plan is None else plan.gpus_per_node,
    }


#: The buffer size of a pass when MUON_PASS_CONFIGS does not name one (fused buffers).
LEGACY_BUFFER_MB = 1


def pass_configs() -> list[tuple[int, dict]]:
    """(pass label, configuration) of every training pass, in order."""
    raw = os.environ.get("MUON_PASS_CONFIGS")
    if raw:
        return list(enumerate(json.loads(raw)))
    group_calls = {"0": [False], "1": [True], "both": [False, True]}[
        os.environ.get("MUON_GROUP_CALL", "both")]
    # the owner rule stays whatever the optimizer defaults to
    return [(int(g), {"comm_group_call_opt": g, "muon_partition_strategy": None,
                      "comm_buffer_size_MB": LEGACY_BUFFER_MB}) for g in group_calls]


def apply_pass_config(strategy, config: dict) -> None:
    """Set one pass's three options on the fleet strategy (the optimizer reads
    them when it is built, so each pass gets its own)."""
    set_muon_sharding_options(strategy, comm_group_call_opt=bool(config["comm_group_call_opt"]),
                              partition_strategy=config.get("muon_partition_strategy"))
    # the proto field is an integer; the recommended sizes are whole MB
    strategy.hybrid_configs["sharding_configs"].comm_buffer_size_MB = int(
        round(float(config["comm_buffer_size_MB"])))


def applied_config(opt) -> dict:
    """The three options as the built optimizer read them (so the launcher can
    check each pass trained the configuration it asked for)."""
    s = sharded_core(opt)._settings
    return {"comm_group_call_opt": bool(s.comm_group_call_opt),
            "muon_partition_strategy": s.muon_partition_strategy,
            "comm_buffer_size_MB": float(s.comm_buffer_size_MB)}


def train_pass(label: int, config: dict, ep: int, steps: int, reference, expert_coord,
               leader: bool):
    """One training run; returns (max |param - reference|, the optimizer's plan)."""
    hcg = fleet.get_hybrid_communicate_group()
    group_call = bool(config["comm_group_call_opt"])
    apply_pass_config(fleet.fleet._user_defined_strategy, config)
    rank = dist.get_rank()
    moe_group = hcg.get_moe_sharding_parallel_group() if ep > 1 else None
    net = muon_tiny_moe.TinyMoE(expert_coord, moe_group)
    model = fleet.distributed_model(net)
    opt = distributed_optimizer(muon_tiny_moe.make_muon(list(net.parameters())))
    plan = getattr(opt._inner_opt, "comm_plan", None)
    applied = applied_config(opt)
    worst = 0.0
    for step in range(steps):
        x = paddle.to_tensor(muon_tiny_moe.batch(step, rank))
        with LinkWindow(leader) as window:
            loss = model(x)
            loss.backward()
            # forward + backward: local compute (no collective before opt.step
            # with comm_overlap off), so the launcher can split the step time
            fwd_bwd = time.perf_counter() - window.t0
            opt.step()
            opt.clear_grad()
        # the reference step: every rank's forward/backward and Muon on every
        # matrix in one process, no collective -- the step's compute, timed
        # under the same load (every rank runs it at once)
        t_ref = time.perf_counter()
        reference.step(step)
        ref_s = time.perf_counter() - t_ref
        _emit("STEP", rank=rank, group_call=int(group_call), step=step + 1, steps=steps,
              pass_label=label, applied=applied,
              seconds=window.seconds, fwd_bwd_s=fwd_bwd, reference_step_s=ref_s,
              tx=window.tx, rx=window.rx, leader=leader, loss=float(loss))
        worst = max(worst, compare(net, reference, expert_coord, rank, step))
    return worst, plan


def run_probe(rank: int, world: int, leader: bool) -> None:
    """Link bytes of single collectives of ``MUON_PROBE_BYTES`` on a few groups."""
    nbytes = _env_int("MUON_PROBE_BYTES", 4 << 20)
    gpn = _env_int("PADDLE_LOCAL_SIZE", 1)
    groups = {"world": list(range(world)),
              "card0": list(range(0, world, gpn)),
              "pair01": [0, 1], "pair0g": [0, gpn]}
    made = {name: dist.new_group(ranks) for name, ranks in groups.items()}
    numel = nbytes // 4
    for name, ranks in groups.items():
        group = made[name]
        for op in ("reduce", "broadcast", "all_reduce", "all_gather", "barrier"):
            for root_index in ((0, len(ranks) - 1) if op in ("reduce", "broadcast") else (0,)):
                root = ranks[root_index]
                t = paddle.ones([numel], dtype="float32")
                with LinkWindow(leader) as window:
                    if rank in ranks:
                        if op == "reduce":
                            dist.reduce(t, dst=root, group=group)
                        elif op == "broadcast":
                            dist.broadcast(t, src=root, group=group)
                        elif op == "all_reduce":
                            dist.all_reduce(t, group=group)
                        elif op == "all_gather":
                            out = []
                            dist.all_gather(out, t[: numel // len(ranks)], group=group)
                        else:
                            dist.barrier(group=group)
                _emit("PROBE", rank=rank, group=name, ranks=ranks, op=op, root=root,
                      nbytes=nbytes, tx=window.tx, rx=window.rx, leader=leader,
                      seconds=window.seconds)


def main() -> None:
    install_gloo_compat()
    register_cpu_tensor_fusion()  # the optimizer's fused buffers on CPU: an explicit opt-in
    muon_tiny_moe.H = _env_int("MUON_HIDDEN", muon_tiny_moe.H)
    muon_tiny_moe.INNER = _env_int("MUON_INNER", muon_tiny_moe.INNER)
    world = int(os.environ["PADDLE_TRAINERS_NUM"])
    ep, ms = _env_int("MUON_EP", 1), _env_int("MUON_MS", 1)
    steps = _env_int("MUON_STEPS", 3)
    passes = pass_configs()
    if ms * ep != world:
        fail(f"world size {world} != moe_sharding {ms} x ep {ep}")
    strategy = build_strategy(ep, ms, world, bool(passes[0][1]["comm_group_call_opt"]),
                              fused=True, overlap=False)
    fleet.init(is_collective=True, strategy=strategy)
    rank = dist.get_rank()
    leader = _local_rank() == 0
    if os.environ.get("MUON_CLUSTER_MODE", "train") == "probe":
        _emit("RANK", **_identity(rank, None))
        run_probe(rank, world, leader)
        print(f"MUON_OK rank={rank}", flush=True)
        return
    hcg = fleet.get_hybrid_communicate_group()
    topo = hcg._moe_topo
    expert_of_rank = {r: topo.get_coord(r).expert for r in range(world)}
    expert_coord = hcg.get_expert_parallel_rank()
    plan, diffs = None, {}
    for label, config in passes:
        reference = muon_tiny_moe.Reference(expert_of_rank)
        worst, pass_plan = train_pass(label, config, ep, steps, reference, expert_coord, leader)
        diffs[label] = worst
        plan = pass_plan if config["comm_group_call_opt"] else plan
        print(f"MUON_PASS rank={rank} pass={label} config={json.dumps(config, sort_keys=True)} "
              f"max_abs_diff_vs_reference={worst:.3e}", flush=True)
    _emit("RANK", max_abs_diff=diffs, **_identity(rank, plan))
    print(f"MUON_OK rank={rank}", flush=True)


if __name__ == "__main__":
    main()
    from worker_exit import exit_after_verdict

    exit_after_verdict()
