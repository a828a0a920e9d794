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
"""Our MuonShardingOptimizer side by side with a Paddle checkout's own.

    python3 tools/bench/bench_vs_develop.py --paddle-root DIR
        [--layouts NAME ...] [--hidden 128] [--inner 256] [--reps 5]
        [--warmup 1] [--ns-steps 5] [--no-avg-reduce] [--json]

``DIR`` is the root of a Paddle source checkout holding
``python/paddle/distributed/fleet/meta_optimizers/muon_sharding_optimizer.py``
(loaded by ``paddle_muon_ext.compat_paddle_3_3.develop_loader``, unedited).

For every layout of the sweep (all accepted by both implementations: pp=1,
the MoE topology order develop's group-call rank formula assumes, ep a
multiple of the node size where ``comm_group_call_opt`` is on), one simulated
world (``test/mock``, ``mode="record"``: ranks run one after another, every
collective is logged and returns at once) builds on every rank the same
model twice, one copy under each optimizer, with the same inner ``Muon``
(this package's, so the comparison is the sharding layer alone) and the same
strategy object, and steps them alternately (A B, B A, ...):

* schedule: the collectives each implementation records for one step
  (``reduce_gradients`` + ``step``) on every rank, checked for agreement
  across ranks (``check_schedule``), then priced from the trace itself
  (:func:`price_trace`): the number of group-level collectives and of
  launches (a coalescing block is one launch), bytes sent inside a node and
  across nodes (node of rank r is ``r // gpus_per_node``; the ring / chain
  algorithms and the alpha-beta constants of
  ``paddle_muon_ext.tools.cost_model``), and the alpha-beta time of the
  step: a replay of the trace in which a collective starts when every member
  has finished its previous one and lasts its slowest member's
  ``latency + inter * beta_net + intra * beta_nvlink``.
* host time: per rank the median of ``reps`` timed steps (after
  ``warmup``) of ``reduce_gradients + step + clear_grad``; each rank runs
  alone on the machine (record mode), so that is the host work of one rank.
  ``host_sum`` is the sum over ranks (all host work of the world),
  ``host_max`` the busiest rank (the step's critical path), and
  ``host_paired`` the median over ranks and repetitions of ours / develop's
  time in the same repetition (back to back on the same rank, so load from
  other processes drifting between repetitions cancels).

Both are built as on a CUDA build with NCCL >= 2.10 (``ReduceOp.AVG``
available; the simulated layer averages), the setting the comparison is
for; ``--no-avg-reduce`` keeps the CPU build's answer, under which ours
scales gradients around a SUM reduce (gloo has no AVG) while develop's 2-D
buffers ask for AVG whatever the build.

Ratios are ours / develop's. Targets: comm time ratio <= 1.0 on every layout,
host_paired ratio <= 1.05.

``--paddle-root`` may name this repository's own optimizer with the value
``self`` (ours against ours: every comm ratio is exactly 1.0), which is what
the tests run where no develop checkout exists.

Importable: ``compare(layouts, impl_a, impl_b, ...)`` returns the per-layout
figures; ``price_trace(records_by_rank, world, gpn)`` prices any recorded
trace; ``main(argv)`` prints and returns the result (``--json``: JSON only).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple
from unittest import mock

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
#: Where develop keeps the optimizer in a checkout (develop_loader's
#: OPTIMIZER_RELPATH; repeated here so a bad root is refused before paddle
#: is imported).
OPTIMIZER_RELPATH = "python/paddle/distributed/fleet/meta_optimizers/muon_sharding_optimizer.py"
#: --paddle-root value selecting this repository's optimizer for both sides.
SELF = "self"
COMM_TARGET = 1.0
HOST_TARGET = 1.05

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8,
                "int32": 4, "uint8": 1, "int8": 1, "bool": 1}
_MARKERS = ("new_group", "coalescing_begin", "coalescing_end")


@dataclasses.dataclass(frozen=True)
class BenchLayout:
    """One layout of the sweep.

    Attributes:
        world, ep, ms: ranks, expert and moe_sharding degrees (pp = 1).
        gpn: GPUs per node (``PADDLE_LOCAL_SIZE``; nodes for the link classes).
        group_call: ``comm_group_call_opt``.
        buffer_mb: ``comm_buffer_size_MB`` (-1: unfused gradients).
    """

    world: int
    ep: int
    ms: int
    gpn: int
    group_call: bool
    buffer_mb: int

    @property
    def name(self) -> str:
        buf = "unfused" if self.buffer_mb <= 0 else f"buf{self.buffer_mb}MB"
        return (f"{self.world}r-ep{self.ep}-ms{self.ms}-{self.world // self.gpn}x{self.gpn}"
                f"-{'gc' if self.group_call else 'flat'}-{buf}")


#: The sweep: 8 ranks (ep4 x ms2, 2 nodes x 4) and 16 ranks (ep8 x ms2,
#: 2 nodes x 8), comm_group_call_opt on and off, three buffer sizes.
LAYOUTS = {lay.name: lay for lay in (
    BenchLayout(8, 4, 2, 4, False, 1),
    BenchLayout(8, 4, 2, 4, True, 1),
    BenchLayout(8, 4, 2, 4, True, 4),
    BenchLayout(8, 4, 2, 4, False, -1),
    BenchLayout(16, 8, 2, 8, False, 1),
    BenchLayout(16, 8, 2, 8, True, 1),
    BenchLayout(16, 8, 2, 8, True, 16),
)}
#: A small layout (4 ranks, 2 nodes x 2), for tests and quick looks; not
#: in the default sweep.
TINY = BenchLayout(4, 2, 2, 2, True, 1)
#: Every layout --layouts accepts.
KNOWN_LAYOUTS = {**LAYOUTS, TINY.name: TINY}


# --------------------------------------------------------------------------
# Pricing a recorded trace
# --------------------------------------------------------------------------
def _payload_bytes(rec: Any) -> float:
    """Bytes of the whole buffer a group-level collective moves (cost model's input)."""
    size = rec.numel * _DTYPE_BYTES.get(rec.dtype or "float32", 4)
    if rec.op in ("all_gather", "reduce_scatter"):
        # the record holds one rank's shard; the model takes the whole buffer
        size *= len(rec.group_ranks)
    return float(size)


def price_trace(records_by_rank: Sequence[Sequence[Any]], world: int, gpn: int,
                ab: Any = None) -> Dict[str, Any]:
    """Collectives, bytes per link class and alpha-beta time of a recorded step.

    Args:
        records_by_rank: per global rank, the ``CommRecord`` s of the step
            (markers and non-member records are skipped).
        world: ranks in the world.
        gpn: GPUs per node: rank r sits on node ``r // gpn``.
        ab: ``cost_model.AlphaBeta`` (default constants when None).

    Returns:
        dict: ``collectives`` (group-level ops), ``by_op`` (their count per
        op), ``launches`` (events: a coalescing block is one), ``intra_bytes``
        and ``inter_bytes`` (bytes sent, summed over ranks), ``time_s`` (the
        replay's finish time of the last rank).
    """
    from paddle_muon_ext.tools import cost_model

    ab = ab or cost_model.AlphaBeta()
    path = cost_model.CostPath("trace", world, gpn, ab)
    ops: Dict[tuple, Any] = {}
    event_ops: Dict[tuple, List[tuple]] = {}
    queues: List[List[tuple]] = []
    for recs in records_by_rank:
        queue: List[tuple] = []
        for rec in recs:
            if rec.op in _MARKERS or rec.group_seq is None or not rec.member:
                continue
            key = (rec.group_id, rec.group_seq)
            ops.setdefault(key, rec)
            event = ("block", rec.block) if rec.block is not None else ("op", key)
            if not queue or queue[-1] != event:
                queue.append(event)
            ops_of_event = event_ops.setdefault(event, [])
            if key not in ops_of_event:
                ops_of_event.append(key)
        queues.append(queue)

    by_op: Dict[str, int] = {}
    for i, (key, rec) in enumerate(ops.items()):
        by_op[rec.op] = by_op.get(rec.op, 0) + 1
        ph = path.phase(f"op{i}")
        nbytes = _payload_bytes(rec)
        ranks = tuple(rec.group_ranks)
        if rec.op in ("reduce", "broadcast"):
            path.rooted(ph, "sharding", rec.op, ranks, rec.root, nbytes, "dense")
        elif rec.op in ("reduce_scatter", "all_gather"):
            path.ring_collective(ph, "sharding", rec.op, ranks, nbytes)
        elif rec.op == "all_reduce":  # ring all-reduce: reduce-scatter + all-gather
            path.ring_collective(ph, "sharding", "reduce_scatter", ranks, nbytes)
            path.ring_collective(ph, "sharding", "all_gather", ranks, nbytes)
        else:
            raise ValueError(f"price_trace: no cost rule for collective {rec.op!r}")
    path.summary()  # flushes the deferred ring charges into the phases
    phase_of = {key: path.phases[f"op{i}"] for i, key in enumerate(ops)}

    intra = sum(sum(ph.intra) for ph in phase_of.values())
    inter = sum(sum(ph.inter) for ph in phase_of.values())

    def duration(event: tuple) -> Tuple[float, set]:
        keys = event_ops[event]
        latency = max((max(phase_of[k].latency.values(), default=0.0) for k in keys),
                      default=0.0)
        members = set()
        per_rank: Dict[int, float] = {}
        for k in keys:
            members.update(ops[k].group_ranks)
            ph = phase_of[k]
            for r in ops[k].group_ranks:
                per_rank[r] = (per_rank.get(r, 0.0) + ph.inter[r] * ab.beta_net
                               + ph.intra[r] * ab.beta_nvlink)
        return latency + max(per_rank.values(), default=0.0), members

    # Replay: an event starts once every member has finished its previous one.
    finish = [0.0] * world
    heads = [0] * world
    remaining = sum(len(q) for q in queues)
    while remaining:
        progressed = False
        for rank, queue in enumerate(queues):
            if heads[rank] >= len(queue):
                continue
            event = queue[heads[rank]]
            took, members = duration(event)
            ready = [m for m in members if m < len(queues)]
            if any(heads[m] >= len(queues[m]) or queues[m][heads[m]] != event for m in ready):
                continue
            start = max(finish[m] for m in ready)
            for m in ready:
                finish[m] = start + took
                heads[m] += 1
            remaining -= len(ready)
            progressed = True
        if not progressed:
            raise ValueError("price_trace: the ranks' traces do not agree (no event can start); "
                             "run check_schedule on them first")
    return {
        "collectives": len(ops),
        "by_op": dict(sorted(by_op.items())),
        "launches": len(event_ops),
        "intra_bytes": intra,
        "inter_bytes": inter,
        "time_s": max(finish, default=0.0),
    }


# --------------------------------------------------------------------------
# The world: both implementations on every rank, alternating steps
# --------------------------------------------------------------------------
def model_spec(hidden: int, inner: int, world: int) -> Dict[str, Dict[str, tuple]]:
    """Parameter shapes: per rank of the sharding group a dense [hidden, hidden]
    and [hidden, inner] matrix and two [hidden] vectors; per EP coordinate two
    expert matrices up [hidden, inner] / down [inner, hidden], one fused
    [2, hidden, inner] stack and a bias (the moe_sharding colour)."""
    dense: Dict[str, tuple] = {}
    for i in range(world):
        dense[f"dense.sq{i}"] = (hidden, hidden)
        dense[f"dense.rect{i}"] = (hidden, inner)
        dense[f"dense.bias{i}"] = (hidden,)
        dense[f"dense.norm{i}"] = (hidden,)
    experts = {"expert.up0": (hidden, inner), "expert.down0": (inner, hidden),
               "expert.up1": (hidden, inner), "expert.down1": (inner, hidden),
               "expert.fused": (2, hidden, inner), "expert.bias": (hidden,)}
    return {"dense": dense, "experts": experts}


def _runtime() -> Dict[str, Any]:
    """Import paddle, the harness and the package (after the arguments are checked)."""
    for p in (os.path.join(_REPO, "python"), os.path.join(_REPO, "test")):
        if p not in sys.path:
            sys.path.insert(0, p)
    import numpy as np
    import paddle

    from mock.fake_hcg import DEFAULT_MOE_ORDER, make_hcg_factory, make_hybrid_strategy
    from mock.patching import active_comm
    from mock.simulated_world import SimulatedWorld
    from paddle_muon_ext.compat_paddle_3_3 import (
        register_cpu_tensor_fusion,
        set_muon_sharding_options,
    )
    from paddle_muon_ext.optimizer import Muon, build_muon_param_info_map

    return dict(np=np, paddle=paddle, DEFAULT_MOE_ORDER=DEFAULT_MOE_ORDER,
                make_hcg_factory=make_hcg_factory, make_hybrid_strategy=make_hybrid_strategy,
                active_comm=active_comm, SimulatedWorld=SimulatedWorld,
                register_cpu_tensor_fusion=register_cpu_tensor_fusion,
                set_muon_sharding_options=set_muon_sharding_options, Muon=Muon,
                build_muon_param_info_map=build_muon_param_info_map)


def load_implementation(root: str) -> Tuple[str, Any]:
    """(label, MuonShardingOptimizer class) of ``root`` (``"self"``: ours)."""
    _runtime()
    if root == SELF:
        from paddle_muon_ext.distributed.fleet.meta_optimizers import muon_sharding_optimizer

        return "ours", muon_sharding_optimizer.MuonShardingOptimizer
    from paddle_muon_ext.compat_paddle_3_3 import develop_loader

    return "develop", develop_loader.load_develop_optimizer(root).MuonShardingOptimizer


def _rank_body(rt: Dict[str, Any], spec: Dict, impls: Sequence[Tuple[str, Any]], reps: int,
               warmup: int, ns_steps: int) -> Callable[[int], Dict]:
    np, paddle = rt["np"], rt["paddle"]

    def build(rank: int, hcg: Any, cls: Any) -> Tuple[list, Any, list]:
        rng = np.random.default_rng(7 + rank)
        moe_group = hcg.get_moe_sharding_parallel_group()
        params, coeffs = [], []
        for colour, shapes in (("dense", spec["dense"]), ("experts", spec["experts"])):
            for name, shape in shapes.items():
                value = rng.normal(0, 0.05, shape).astype("float32")
                p = paddle.create_parameter(
                    list(shape), "float32",
                    default_initializer=paddle.nn.initializer.Assign(value))
                # renamed after creation: every rank (and both copies) use the
                # same names, as separate processes would
                p.name = name
                if colour == "experts":
                    p.color = {"color": "moe_expert", "group": moe_group}
                    p.no_sync = True
                params.append(p)
                coeffs.append(paddle.to_tensor(rng.normal(0, 1, shape).astype("float32")))
        muon = rt["Muon"](learning_rate=0.02, parameters=params, ns_steps=ns_steps,
                          weight_decay=0.01,
                          muon_param_info_map=rt["build_muon_param_info_map"](params))
        return params, cls(muon, hcg), coeffs

    def body(rank: int) -> Dict:
        paddle.seed(1234 + rank)
        hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
        trace = rt["active_comm"]().current().trace
        built = [build(rank, hcg, cls) for _, cls in impls]
        times: List[List[float]] = [[] for _ in impls]
        spans: List[Tuple[int, int]] = [(0, 0) for _ in impls]
        for i in range(warmup + reps):
            order = range(len(impls)) if i % 2 == 0 else reversed(range(len(impls)))
            for k in order:
                params, opt, coeffs = built[k]
                # gradient = the fixed coefficients (backward writes p.grad the
                # way a model's backward does, fused buffers included)
                loss = paddle.add_n([paddle.sum(p * c) for p, c in zip(params, coeffs)])
                loss.backward()
                start = len(trace)
                t0 = time.perf_counter()
                opt.reduce_gradients(params, hcg)
                opt.step()
                opt.clear_grad()
                took = time.perf_counter() - t0
                spans[k] = (start, len(trace))  # the last step's records
                if i >= warmup:
                    times[k].append(took)
        return {"times": times, "spans": spans}

    return body


def run_layout(layout: BenchLayout, impls: Sequence[Tuple[str, Any]], hidden: int = 128,
               inner: int = 256, reps: int = 5, warmup: int = 1, ns_steps: int = 5,
               avg_reduce: bool = True) -> Dict:
    """Both implementations on ``layout``: schedule figures and host times.

    ``avg_reduce``: both optimizers are built as on a CUDA build with NCCL >=
    2.10 (``is_avg_reduce_op_supported()`` answers True; the simulated layer
    averages); False keeps this build's answer (CPU: no AVG, so ours
    pre-scales gradients for a SUM reduce, while develop's 2-D buffers
    reduce with AVG whatever the build: costs the two do not share on a GPU).

    Returns:
        dict: ``layout``, per implementation (in ``impls`` order) ``sides``
        with ``schedule`` (:func:`price_trace`), ``host_sum_ms``,
        ``host_max_ms``; and ``ratios`` of the first over the second.
    """
    rt = _runtime()
    strategy = rt["make_hybrid_strategy"](layout.ep, layout.ms, 1,
                                          order=rt["DEFAULT_MOE_ORDER"],
                                          comm_buffer_size_MB=layout.buffer_mb,
                                          comm_overlap=False)
    rt["set_muon_sharding_options"](strategy, comm_group_call_opt=layout.group_call)
    rt["register_cpu_tensor_fusion"]()
    world = rt["SimulatedWorld"](layout.world,
                                 hcg_factory=rt["make_hcg_factory"](
                                     layout.ep, layout.ms, 1, order=rt["DEFAULT_MOE_ORDER"]),
                                 strategy=strategy, mode="record")
    spec = model_spec(hidden, inner, layout.world)
    saved = os.environ.pop("PADDLE_LOCAL_SIZE", None)
    os.environ["PADDLE_LOCAL_SIZE"] = str(layout.gpn)
    reduce_module = importlib.import_module("paddle.distributed.communication.reduce")
    avg = (mock.patch.object(reduce_module, "is_avg_reduce_op_supported", lambda: True)
           if avg_reduce else contextlib.nullcontext())
    try:
        with avg:
            results = world.run(_rank_body(rt, spec, impls, reps, warmup, ns_steps))
    finally:
        os.environ.pop("PADDLE_LOCAL_SIZE", None)
        if saved is not None:
            os.environ["PADDLE_LOCAL_SIZE"] = saved
    world.check_schedule()
    sides = []
    for k, (label, _) in enumerate(impls):
        records = [world.traces[r][slice(*results[r]["spans"][k])] for r in range(layout.world)]
        per_rank_ms = [1000.0 * statistics.median(results[r]["times"][k])
                       for r in range(layout.world)]
        sides.append({
            "impl": label,
            "schedule": price_trace(records, layout.world, layout.gpn),
            "host_sum_ms": sum(per_rank_ms),
            "host_max_ms": max(per_rank_ms),
            "host_per_rank_ms": per_rank_ms,
        })
    a, b = sides[0], sides[1]
    # each repetition steps both implementations back to back on the same
    # rank: their ratio cancels load drifting between repetitions
    paired = [ta / tb for r in range(layout.world)
              for ta, tb in zip(results[r]["times"][0], results[r]["times"][1])]

    def ratio(x: float, y: float) -> float:
        return x / y if y else (1.0 if x == 0 else float("inf"))

    sa, sb = a["schedule"], b["schedule"]
    return {
        "layout": dataclasses.asdict(layout) | {"name": layout.name},
        "sides": sides,
        "ratios": {
            "comm_time": ratio(sa["time_s"], sb["time_s"]),
            "collectives": ratio(sa["collectives"], sb["collectives"]),
            "launches": ratio(sa["launches"], sb["launches"]),
            "intra_bytes": ratio(sa["intra_bytes"], sb["intra_bytes"]),
            "inter_bytes": ratio(sa["inter_bytes"], sb["inter_bytes"]),
            "host_sum": ratio(a["host_sum_ms"], b["host_sum_ms"]),
            "host_max": ratio(a["host_max_ms"], b["host_max_ms"]),
            "host_paired": statistics.median(paired),
        },
    }


def compare(layouts: Sequence[BenchLayout], impl_a: Tuple[str, Any], impl_b: Tuple[str, Any],
            hidden: int = 128, inner: int = 256, reps: int = 5, warmup: int = 1,
            ns_steps: int = 5, progress: Optional[Callable[[str], None]] = None,
            avg_reduce: bool = True) -> Dict:
    """:func:`run_layout` over ``layouts``; worst ratios over the sweep."""
    rows = []
    for layout in layouts:
        if progress:
            progress(f"# running {layout.name} ...")
        rows.append(run_layout(layout, (impl_a, impl_b), hidden, inner, reps, warmup, ns_steps,
                               avg_reduce))
    worst = {key: max(r["ratios"][key] for r in rows) for key in rows[0]["ratios"]}
    return {
        "impls": [impl_a[0], impl_b[0]],
        "hidden": hidden, "inner": inner, "reps": reps, "warmup": warmup,
        "ns_steps": ns_steps,
        "avg_reduce": avg_reduce,
        "layouts": rows,
        "worst": worst,
        "comm_ok": worst["comm_time"] <= COMM_TARGET,
        "host_ok": worst["host_paired"] <= HOST_TARGET,
    }


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, no usage dump
        sys.stderr.write(f"error: {message}\n")
        sys.exit(2)


def _positive(name: str, low: int = 1) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < low or value > 100000:
            raise argparse.ArgumentTypeError(f"{name} must be in [{low}, 100000], got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="bench_vs_develop.py", description=__doc__.split("\n")[0],
                 epilog="Layouts (default: all but the last): " + ", ".join(KNOWN_LAYOUTS))
    ap.add_argument("--paddle-root", required=True, metavar="DIR",
                    help=f"root of a Paddle checkout holding {OPTIMIZER_RELPATH} "
                         f"('{SELF}': this repository's optimizer on both sides)")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), metavar="NAME",
                    help="layouts of the sweep (default: all)")
    ap.add_argument("--hidden", type=_positive("--hidden", 2), default=128)
    ap.add_argument("--inner", type=_positive("--inner", 2), default=256)
    ap.add_argument("--reps", type=_positive("--reps"), default=5)
    ap.add_argument("--warmup", type=_positive("--warmup", 0), default=1)
    ap.add_argument("--ns-steps", type=_positive("--ns-steps"), default=5)
    ap.add_argument("--no-avg-reduce", action="store_true",
                    help="keep this build's is_avg_reduce_op_supported() (CPU: False, so ours "
                         "scales gradients for a SUM reduce; develop's 2-D buffers reduce with "
                         "AVG regardless). Default: both built as with NCCL AVG (a GPU run)")
    ap.add_argument("--json", action="store_true", help="print only the result as JSON")
    return ap


def check_args(args: argparse.Namespace) -> Optional[str]:
    """The reason the arguments are refused, or None (no paddle import)."""
    if args.paddle_root != SELF:
        root = os.path.abspath(os.path.expanduser(args.paddle_root))
        if not os.path.isdir(root):
            return (f"--paddle-root {args.paddle_root!r} is not a directory; pass the root "
                    "of a Paddle source checkout")
        if not os.path.isfile(os.path.join(root, *OPTIMIZER_RELPATH.split("/"))):
            return f"--paddle-root {args.paddle_root!r} has no {OPTIMIZER_RELPATH}"
    unknown = [name for name in args.layouts if name not in KNOWN_LAYOUTS]
    if unknown:
        return f"unknown layout {unknown[0]!r}; known: {', '.join(KNOWN_LAYOUTS)}"
    return None


def format_table(res: Dict) -> List[str]:
    a, b = res["impls"]
    lines = [f"{'layout':<30} {'coll ' + a:>9} {b:>5} {'launch':>7} {'intra KB':>17} "
             f"{'inter KB':>17} {'comm us':>15} {'ratio':>6} {'host ms (sum)':>15} {'ratio':>6} "
             f"{'max':>6} {'paired':>6}"]
    for row in res["layouts"]:
        sa, sb = (s["schedule"] for s in row["sides"])
        ha, hb = row["sides"]
        r = row["ratios"]
        lines.append(
            f"{row['layout']['name']:<30} {sa['collectives']:>9} {sb['collectives']:>5} "
            f"{sa['launches']:>3}/{sb['launches']:<3} "
            f"{sa['intra_bytes'] / 1024:>8.0f}/{sb['intra_bytes'] / 1024:<8.0f} "
            f"{sa['inter_bytes'] / 1024:>8.0f}/{sb['inter_bytes'] / 1024:<8.0f} "
            f"{1e6 * sa['time_s']:>7.1f}/{1e6 * sb['time_s']:<7.1f} {r['comm_time']:>6.3f} "
            f"{ha['host_sum_ms']:>7.1f}/{hb['host_sum_ms']:<7.1f} {r['host_sum']:>6.3f} "
            f"{r['host_max']:>6.3f} {r['host_paired']:>6.3f}")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    args = build_parser().parse_args(argv)
    reason = check_args(args)
    if reason:
        sys.stderr.write(f"error: {reason}\n")
        raise SystemExit(2)
    say = (lambda _line: None) if args.json else print
    say("# bench_vs_develop: MuonShardingOptimizer, ours vs the checkout's, side by side")
    say(f"# command: python3 tools/bench/bench_vs_develop.py "
        f"{' '.join(argv) if argv is not None else ' '.join(sys.argv[1:])}".rstrip())
    ours = load_implementation(SELF)
    # Paddle's fleet logger prints every buffer and group both optimizers
    # build (per rank, per layout): keep its warnings, drop the info lines
    # while the bench runs (restored after, for callers in the same process).
    from paddle.distributed.fleet.utils.log_util import logger as fleet_logger

    level = fleet_logger.level
    fleet_logger.setLevel(max(level, 30))
    try:
        return _run(args, argv, ours, say)
    finally:
        fleet_logger.setLevel(level)


def _run(args: argparse.Namespace, argv: Optional[Sequence[str]], ours: Tuple[str, Any],
         say: Callable[[str], None]) -> Dict:
    other = load_implementation(args.paddle_root)
    if other[0] == "ours":
        other = ("ours(b)", other[1])
    import paddle

    say(f"# paddle {paddle.__version__}; simulated world mode=record; model hidden={args.hidden} "
        f"inner={args.inner}; inner optimizer: this package's Muon (ns_steps={args.ns_steps}) "
        f"on both sides; reps={args.reps} (median, alternating), warmup={args.warmup}; "
        f"AVG reduce {'as this build has it' if args.no_avg_reduce else 'available (as on GPU)'}")
    from paddle_muon_ext.tools import cost_model

    ab = cost_model.AlphaBeta()
    say(f"# alpha-beta: nvlink {ab.alpha_nvlink * 1e6:.0f} us + 1/{1 / ab.beta_nvlink / 1e9:.0f} "
        f"GB/s, net {ab.alpha_net * 1e6:.0f} us + 1/{1 / ab.beta_net / 1e9:.0f} GB/s; "
        f"columns ours/{other[0]}")
    res = compare([KNOWN_LAYOUTS[name] for name in args.layouts], ours, other, args.hidden,
                  args.inner, args.reps, args.warmup, args.ns_steps,
                  progress=None if args.json else say, avg_reduce=not args.no_avg_reduce)
    res["paddle_root"] = args.paddle_root if args.paddle_root == SELF else "given"
    if args.json:
        print(json.dumps(res, indent=1, sort_keys=True))
        return res
    for line in format_table(res):
        print(line)
    for row in res["layouts"]:
        sa, sb = (side["schedule"] for side in row["sides"])
        if sa["by_op"] != sb["by_op"]:
            print(f"# {row['layout']['name']}: collectives by op {res['impls'][0]} {sa['by_op']}, "
                  f"{res['impls'][1]} {sb['by_op']}")
    w = res["worst"]
    print(f"RESULT worst comm_time_ratio={w['comm_time']:.3f} target<={COMM_TARGET} "
          f"{'OK' if res['comm_ok'] else 'MISS'}")
    print(f"RESULT worst host_paired_ratio={w['host_paired']:.3f} target<={HOST_TARGET} "
          f"{'OK' if res['host_ok'] else 'MISS'} (sum of medians {w['host_sum']:.3f}, "
          f"busiest rank {w['host_max']:.3f})")
    return res


if __name__ == "__main__":
    main()
