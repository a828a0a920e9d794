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
"""Train a tiny top-2 mixture-of-experts model with sharded Muon, written as for Paddle develop.

Launch (4 processes: sharding 4 = ep 2 x moe_sharding 2)::

    # CPU (gloo), 2 emulated nodes x 2 cards, with comm_group_call_opt
    GLOO_COMPAT_LOCAL_SIZE=2 python -m paddle.distributed.launch \\
        --log_dir "$(mktemp -d)" --nproc_per_node 4 examples/train_moe.py --group-call
    # 4 GPUs (NCCL), one node: the flat path (the hierarchical one needs >= 2 nodes)
    python -m paddle.distributed.launch --nproc_per_node 4 examples/train_moe.py

Only the ``patch_paddle()`` line names paddle_muon_ext; on a Paddle that has
Muon sharding itself, drop those two lines. The model: an embedding, a
LayerNorm, a top-2 router over 4 experts held as 3-D weights
``[local experts, in, out]`` (plus a 2-D expert bias) split over the EP group,
a shared dense MLP beside them, and a head. Tokens reach their experts through
an all-gather dispatch over the EP group (it needs no routing metadata; an
``alltoall`` dispatch, which ``patch_paddle()`` makes run on gloo too, follows
the same gradient contract). The expert weights carry the
``moe_expert`` colour with the moe_sharding group; everything else is sharded
over the whole sharding group. Global-norm clip, AMP O2 bf16 through
``paddle.amp`` with ``MixPrecisionLayer`` / ``MixPrecisionOptimizer`` (on CPU
Paddle's AMP does nothing, so the run is fp32 and says so).

The gradient contract (docs/USAGE.md, "The gradient contract"): when ``step()`` runs
every parameter holds the gradient of *this rank's* loss; the optimizer
averages dense gradients over the sharding group and expert gradients over
the moe_sharding group. The dispatch hands an expert's owner the *sum* over
its EP group, so the experts scale their gradient by ``1/ep`` in the graph
(``_ScaleGrad``; ``param.register_hook`` is refused under MixPrecisionLayer).
``--wrong-expert-scale`` leaves the scale out, to see what that costs.

``--checkpoint DIR`` saves model and optimizer after ``--resume-at`` steps
(every expert once, at its offset among all experts:
``Experts.sharded_state_dict``, one ``paddle_muon_ext.expert_sharded_state_dict``
call), builds both again as a new job would, loads
the checkpoint and trains the remaining steps, so the check below covers the
resumed run.

Every rank then repeats the steps in one process on the whole batch (all
experts local, no dispatch) and compares its parameters; rank 0 prints one
``PASS``/``FAIL`` line per rank (exit code 1 on any FAIL).
"""

from __future__ import annotations

import argparse
import os
import sys

import paddle_muon_ext

paddle_muon_ext.patch_paddle()

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import paddle.distributed as dist  # noqa: E402
import paddle.nn.functional as F  # noqa: E402
from paddle.autograd import PyLayer  # noqa: E402
from paddle.distributed import fleet  # noqa: E402
from paddle.distributed.fleet.utils.mix_precision_utils import (  # noqa: E402
    MixPrecisionLayer,
    MixPrecisionOptimizer,
)
from paddle.optimizer.muon import MuonParamInfo, _default_should_use_muon  # noqa: E402

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_checkpoint import (  # noqa: E402
    latest_complete_checkpoint_and_id,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)

VOCAB, HIDDEN, INNER, CLASSES = 64, 16, 32, 8
EXPERTS, TOP_K = 4, 2
TOKENS_PER_RANK = 8
# The global gradient norm is 1.2 to 1.5: the clip is active in every step.
LR, CLIP_NORM = 0.02, 0.5
# Matrices on Muon; the embedding, the head, the router and every bias on AdamW.
# The patterns match the structured names of named_parameters() ("head.weight"),
# not p.name ("linear_3.w_0"), which names no layer.
ADAMW_PATTERNS = ["embed", "head", "gate", "bias"]
EXPERT_COLOUR = "moe_expert"
# fp32 (CPU): the sharded run differs from the single-process one only in the
# order of float32 sums (reductions, a mean of per-rank means); Muon and Adam
# normalise their updates, so the parameters stay within a few 1e-7 (measured
# on 4 processes: 1.3e-7 to 1.6e-7 after 3 steps, comm_group_call_opt on and
# off). Adam's normalisation also magnifies the rounding of a gradient that
# nearly cancels: on 2 processes one expert-bias element ends 3.5e-6 away.
# 1e-5 covers that and still catches a wrong expert gradient scale
# (--wrong-expert-scale: 2.4e-4). bf16 (GPU): parameters are rounded to bf16 (8 bits of mantissa,
# ~4e-3 at |w| ~ 1) after every step, and another summation order may round
# the other way.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


class _ScaleGrad(PyLayer):
    """Identity forward; the gradient times ``scale`` on the way back.

    The supported way to scale a parameter's gradient under
    ``MixPrecisionLayer`` (which refuses ``param.register_hook``): it acts on
    the weight *as used*, so MixPrecisionLayer's own hook accumulates the
    scaled gradient into ``main_grad``.
    """

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale


class _AllGather(PyLayer):
    """Every EP rank's rows, concatenated; backward: this rank's rows of the summed gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = []
        dist.all_gather(parts, x, group=group)
        return paddle.concat(parts, axis=0)

    @staticmethod
    def backward(ctx, grad):
        out = paddle.empty([grad.shape[0] // ctx.group.nranks] + grad.shape[1:], grad.dtype)
        dist.reduce_scatter(out, list(grad.split(ctx.group.nranks, axis=0)), group=ctx.group)
        return out


class _ReduceScatter(PyLayer):
    """Sum the EP ranks' partial outputs and keep this rank's rows (forward); all-gather back."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = paddle.empty([x.shape[0] // group.nranks] + x.shape[1:], x.dtype)
        dist.reduce_scatter(out, list(x.split(group.nranks, axis=0)), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        parts = []
        dist.all_gather(parts, grad, group=ctx.group)
        return paddle.concat(parts, axis=0)


def initial_experts(name: str, shape: list) -> np.ndarray:
    """The weights of all EXPERTS experts (one seed per tensor, so both runs agree)."""
    rng = np.random.default_rng(sum(map(ord, name)))
    return rng.normal(0, shape[0] ** -0.5, [EXPERTS] + shape).astype("float32")


class Experts(paddle.nn.Layer):
    """This EP rank's experts: ``EXPERTS // ep`` GELU MLPs as 3-D weights.

    Args:
        ep_group (Group|None): the expert-parallel group (None: all experts here).
        moe_group (Group|None): the moe_sharding group, the experts' colour group.
        grad_scale (float): applied to the expert weights' gradient (1/ep).
    """

    def __init__(self, ep_group, moe_group, grad_scale: float) -> None:
        super().__init__()
        ep = ep_group.nranks if ep_group is not None else 1
        ep_rank = ep_group.rank if ep_group is not None else 0
        self.ep_group, self.grad_scale = ep_group, grad_scale
        self.local = EXPERTS // ep
        self.first = ep_rank * self.local  # global id of this rank's first expert
        rows = slice(self.first, self.first + self.local)
        for name, shape in (("up_weight", [HIDDEN, INNER]), ("down_weight", [INNER, HIDDEN]),
                            ("bias", [HIDDEN])):
            value = initial_experts(name, shape)[rows]
            p = self.create_parameter(
                list(value.shape), default_initializer=paddle.nn.initializer.Assign(value))
            if moe_group is not None:
                p.color = {"color": EXPERT_COLOUR, "group": moe_group}
            p.no_sync = True  # experts differ across EP ranks: never broadcast at init
            setattr(self, name, p)

    def sharded_state_dict(self, structured_name_prefix: str = "") -> dict:
        """Each expert once, at its offset among all experts (global shape ``[EXPERTS, ...]``)."""
        return paddle_muon_ext.expert_sharded_state_dict(
            self, structured_name_prefix, self.ep_group, num_experts=EXPERTS)

    def forward(self, h, top_idx, top_w):
        group = self.ep_group
        if group is not None and group.nranks > 1:
            # the dispatch: every EP rank sees the tokens (and routes) of the group
            h = _AllGather.apply(h, group)
            top_w = _AllGather.apply(top_w, group)
            parts = []
            dist.all_gather(parts, top_idx, group=group)
            top_idx = paddle.concat(parts, axis=0)
        up, down, bias = (_ScaleGrad.apply(p, self.grad_scale) if self.grad_scale != 1.0 else p
                          for p in (self.up_weight, self.down_weight, self.bias))
        out = paddle.zeros_like(h)
        for j in range(self.local):
            chosen = top_idx == self.first + j  # [tokens, k]
            rows = paddle.nonzero(chosen.any(axis=-1)).flatten()
            if rows.shape[0] == 0:
                continue
            weight = (top_w * chosen.astype(top_w.dtype)).sum(axis=-1).index_select(rows)
            x = h.index_select(rows)
            y = paddle.matmul(F.gelu(paddle.matmul(x, up[j])), down[j]) + bias[j]
            out = paddle.index_add(out, rows, 0, y * weight.unsqueeze(-1))
        if group is not None and group.nranks > 1:
            out = _ReduceScatter.apply(out, group)  # back to the tokens' own rank
        return out


class TinyMoE(paddle.nn.Layer):
    """Embedding -> LayerNorm -> (top-2 experts + shared MLP) -> head."""

    def __init__(self, ep_group=None, moe_group=None, grad_scale: float = 1.0) -> None:
        super().__init__()
        paddle.seed(2026)  # the same dense weights on every rank and in the reference
        self.embed = paddle.nn.Embedding(VOCAB, HIDDEN)
        self.norm = paddle.nn.LayerNorm(HIDDEN)
        self.gate = paddle.nn.Linear(HIDDEN, EXPERTS, bias_attr=False)
        self.shared_up = paddle.nn.Linear(HIDDEN, INNER)
        self.shared_down = paddle.nn.Linear(INNER, HIDDEN)
        self.head = paddle.nn.Linear(HIDDEN, CLASSES)
        self.experts = Experts(ep_group, moe_group, grad_scale)

    def forward(self, ids, labels):
        h = self.norm(self.embed(ids))
        probs = F.softmax(self.gate(h).astype("float32"), axis=-1)
        top_w, top_idx = paddle.topk(probs, TOP_K, axis=-1)
        top_w = (top_w / top_w.sum(axis=-1, keepdim=True)).astype(h.dtype)
        h = h + self.experts(h, top_idx, top_w) + self.shared_down(F.gelu(self.shared_up(h)))
        logits = self.head(paddle.tanh(h)).astype("float32")
        return F.cross_entropy(logits, labels)


def global_batch(step: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    ids = rng.integers(0, VOCAB, size=(world * TOKENS_PER_RANK,)).astype("int64")
    labels = rng.integers(0, CLASSES, size=(world * TOKENS_PER_RANK, 1)).astype("int64")
    return ids, labels


def build(net: TinyMoE):
    """AMP O2 + MixPrecisionLayer, and Muon with the global-norm clip (for MixPrecisionOptimizer)."""
    # routing by the structured names; the map itself is keyed by p.name
    info = {p.name: MuonParamInfo(use_muon=_default_should_use_muon(name, p.shape, ADAMW_PATTERNS))
            for name, p in net.named_parameters()}
    model = paddle.amp.decorate(models=net, level="O2", dtype="bfloat16")
    model = MixPrecisionLayer(model, dtype="bfloat16")
    muon = paddle.optimizer.Muon(learning_rate=LR, parameters=model.parameters(),
                                 grad_clip=paddle.nn.ClipGradByGlobalNorm(CLIP_NORM),
                                 muon_param_info_map=info)
    return model, muon


def train(model, opt, steps: int, world: int, rows: slice, first: int = 0) -> list:
    """Steps ``first .. steps - 1`` on the tokens ``rows`` of each global batch
    of ``world`` ranks."""
    losses = []
    for step in range(first, steps):
        ids, labels = global_batch(step, world)
        with paddle.amp.auto_cast(level="O2", dtype="bfloat16"):
            loss = model(paddle.to_tensor(ids[rows]), paddle.to_tensor(labels[rows]))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses


def values(net: TinyMoE, experts=slice(None)) -> dict:
    """Parameters by structured name as float64; expert tensors cut to ``experts``."""
    out = {}
    for name, p in net.named_parameters():
        v = p.astype("float32").numpy().astype("float64")
        out[name] = v[experts] if name.startswith("experts.") else v
    return out


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n", 1)[0],
        epilog="CPU: GLOO_COMPAT_LOCAL_SIZE=2 emulates 2 cards per node for --group-call.")
    parser.add_argument("--ep", type=int, default=None,
                        help="expert-parallel degree (default 2, or 1 on one process); "
                             f"must divide the process count and the {EXPERTS} experts")
    parser.add_argument("--group-call", action="store_true",
                        help="comm_group_call_opt: the hierarchical path (needs >= 2 nodes)")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    parser.add_argument("--wrong-expert-scale", action="store_true",
                        help="leave out the 1/ep expert gradient scale (shows what it costs)")
    parser.add_argument("--checkpoint", metavar="DIR", default=None,
                        help="after --resume-at steps save model + optimizer into DIR (a "
                             "directory every rank sees), build both again, load the "
                             "checkpoint and train the remaining steps")
    parser.add_argument("--resume-at", type=int, default=None, metavar="K",
                        help="with --checkpoint: the step count to save and resume at "
                             "(default: --steps - 1)")
    args = parser.parse_args(argv)
    world = dist.get_world_size()
    ep = args.ep if args.ep is not None else (2 if world > 1 else 1)
    if ep < 1 or world % ep or EXPERTS % ep:
        parser.error(f"--ep {ep} must be >= 1 and divide both the {world} processes "
                     f"and the {EXPERTS} experts")
    if args.steps < 1:
        parser.error(f"--steps {args.steps} must be >= 1")
    if args.resume_at is not None and args.checkpoint is None:
        parser.error("--resume-at needs --checkpoint DIR")
    resume_at = args.steps
    if args.checkpoint is not None:
        if args.steps < 2:
            parser.error(f"--checkpoint needs --steps >= 2 (got {args.steps}): it saves after "
                         "one step or more and resumes for the rest")
        resume_at = args.steps - 1 if args.resume_at is None else args.resume_at
        if not 1 <= resume_at < args.steps:
            parser.error(f"--resume-at {resume_at} must be between 1 and --steps - 1 "
                         f"({args.steps - 1}): a checkpoint is saved after it and the rest "
                         "of the steps run after the load")

    strategy = fleet.DistributedStrategy()
    configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": world}
    if ep > 1:
        configs.update({
            "ep_degree": ep, "moe_sharding_degree": world // ep,
            "order": ["dp", "moe_sharding", "pp", "sharding", "sep", "cp", "ep", "mp"],
            "sharding_configs": {"comm_group_call_opt": args.group_call},
        })
    strategy.hybrid_configs = configs
    strategy.use_muon_sharding = True
    fleet.init(is_collective=True, strategy=strategy)
    rank = dist.get_rank()
    hcg = fleet.get_hybrid_communicate_group()

    ep_group = hcg.get_expert_parallel_group() if ep > 1 else None
    moe_group = hcg.get_moe_sharding_parallel_group() if ep > 1 else None
    scale = 1.0 if args.wrong_expert_scale else 1.0 / ep

    def make():
        """The model (net and its wrappers) and the sharded optimizer, as a new job builds them."""
        net = TinyMoE(ep_group, moe_group, grad_scale=scale)
        model, muon = build(net)
        if world > 1:
            model = fleet.distributed_model(model)
        opt = fleet.distributed_optimizer(MixPrecisionOptimizer(muon))
        return net, model, opt

    def checkpoint_state(net, opt) -> dict:
        # by the inner net's structured names (the wrappers would prefix them)
        state = net.sharded_state_dict()
        state.update(opt.sharded_state_dict(state))  # creates a fresh optimizer's states
        return state

    net, model, opt = make()
    dtype = str(net.head.weight.dtype).replace("paddle.", "")
    if rank == 0:
        amp = ("bf16 (AMP O2)" if dtype == "bfloat16" else
               "off: Paddle's AMP does nothing on this device (CPU), the run is float32")
        print(f"train_moe: {world} processes, ep {ep} x moe_sharding {world // ep}, "
              f"comm_group_call_opt {args.group_call}, expert gradient scale {scale:g}, "
              f"amp {amp}", flush=True)
    rows = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    losses = train(model, opt, resume_at, world, rows)
    if args.checkpoint is not None:
        # A job that stops after resume_at steps and a new one that goes on:
        # every rank saves its piece (each expert once, at its global offset),
        # then a fresh model and optimizer load them and train the rest.
        save_sharded_checkpoint(checkpoint_state(net, opt), args.checkpoint,
                                unique_id=resume_at, keep_last=3)
        net, model, opt = make()
        # the new job: the newest checkpoint and its id, the steps it was saved after
        saved, step = latest_complete_checkpoint_and_id(args.checkpoint)
        load_sharded_checkpoint(checkpoint_state(net, opt), args.checkpoint, unique_id=step)
        if rank == 0:
            print(f"checkpoint: saved after step {step} as {saved}, loaded into a new "
                  f"model and optimizer, {args.steps - step} more step(s)", flush=True)
        losses += train(model, opt, args.steps, world, rows, first=step)

    # The same steps in this process alone, on the whole batch, every expert here.
    ref_net = TinyMoE()
    ref_model, ref_muon = build(ref_net)
    train(ref_model, MixPrecisionOptimizer(ref_muon), args.steps, world, slice(None))

    mine = slice(net.experts.first, net.experts.first + net.experts.local)
    got, want = values(net), values(ref_net, mine)
    diff = max(float(np.max(np.abs(got[k] - want[k]))) for k in want)
    tolerance = TOLERANCE.get(dtype, TOLERANCE["bfloat16"])
    ok = bool(np.isfinite(diff) and diff <= tolerance)

    # Rank 0 prints every rank's verdict (the launcher shows rank 0 alone;
    # each rank's own output is in the --log_dir's workerlog.N).
    verdicts = [paddle.to_tensor([diff, float(ok)], dtype="float64")]
    if world > 1:
        gathered = []
        dist.all_gather(gathered, verdicts[0])
        verdicts = gathered
    if rank == 0:
        for r, v in enumerate(verdicts):
            d, passed = float(v[0]), bool(v[1])
            print(f"{'PASS' if passed else 'FAIL'}: rank {r} of {world} ({type(opt).__name__}), "
                  f"{args.steps} steps, max |parameter - single-process| = {d:.2e} "
                  f"(tolerance {tolerance:g})", flush=True)
        print(f"losses (rank 0): {' '.join(f'{x:.4f}' for x in losses)}", flush=True)
    code = 0 if all(bool(v[1]) for v in verdicts) else 1
    if world > 1:
        # a rank that exits 1 first makes the launcher stop the others: wait
        # until rank 0 has printed every verdict
        dist.barrier()
        # paddle 3.3.1's CPU wheel can abort (exit -6, no message) in its C++
        # teardown after a gloo job with this many process groups has finished
        # (rank 0, about 1 run in 20 here): everything is printed, so leave
        # without that teardown. A GPU (NCCL) job does not need this.
        if paddle.device.get_device() == "cpu":
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
