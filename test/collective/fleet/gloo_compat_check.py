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
"""Worker script: self-test of gloo_compat under paddle.distributed.launch.

Run (what test_gloo_compat.py does)::

    GLOO_COMPAT_LOCAL_SIZE=2 python -m paddle.distributed.launch \
        --nproc_per_node 8 test/collective/fleet/gloo_compat_check.py

Modes (env ``GLOO_COMPAT_CHECK_MODE``):
  * ``ep`` (default, 8 ranks): sharding 8 = moe_sharding 2 x ep 4, order
    [dp, moe_sharding, pp, sharding, sep, cp, ep, mp]; also builds 2-rank
    "node" groups and "same-card" groups from the emulated gpus-per-node
    (``PADDLE_LOCAL_SIZE``, restored from ``GLOO_COMPAT_LOCAL_SIZE``).
  * ``sharding`` (any world >= 2): plain sharding_degree = world.

Every group gets the collective checks and the all-to-all checks (which
the layer emulates); at the end the layer is uninstalled and Paddle's own
gloo all-to-all error is expected back.

Every check compares against numpy. Value mismatches are collected (they
do not desynchronise the ranks) and reported together with rank, group
ranks, op, expected and got; the script then exits 1. An exception inside a
collective exits at once (the launcher then stops the other ranks).
Prints ``GLOO_COMPAT_OK rank=R`` on success and a ``GLOO_COMPAT_TIMING``
line with the phase durations.
"""

from __future__ import annotations

import os
import sys
import time

_T0 = time.perf_counter()

import numpy as np  # noqa: E402

import paddle  # noqa: E402
import paddle.distributed as dist  # noqa: E402
from paddle.distributed import fleet  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gloo_compat import install_gloo_compat  # noqa: E402

_T_IMPORT = time.perf_counter() - _T0

# Divisible by every group size used (2, 4, 8) so reduce_scatter slices evenly.
NUMEL = 48
FAILURES: list[str] = []


def data_for(global_rank: int, salt: int = 0) -> np.ndarray:
    """Distinct, exactly representable float32 data per (rank, check)."""
    base = np.arange(NUMEL, dtype=np.float32)
    return (base * (global_rank + 1) + 0.5 * global_rank + 3.0 * salt).astype(np.float32)


def expect(ok_cond: bool, group, op: str, expected, got) -> None:
    """Record a readable mismatch instead of exiting (keeps ranks in step)."""
    if not ok_cond:
        FAILURES.append(
            f"MISMATCH rank={dist.get_rank()} group={list(group.ranks)} op={op}\n"
            f"  expected={np.asarray(expected).ravel()[:12].tolist()}...\n"
            f"  got     ={np.asarray(got).ravel()[:12].tolist()}..."
        )


def close(got: paddle.Tensor | np.ndarray, expected: np.ndarray) -> bool:
    g = got.numpy() if isinstance(got, paddle.Tensor) else np.asarray(got)
    return g.shape == expected.shape and np.allclose(g, expected, rtol=1e-5, atol=1e-5)


def check_group(name: str, g) -> int:
    """Run every op on group ``g`` (members only). Returns #checks."""
    from paddle.distributed.communication import stream
    from paddle.distributed.communication.batch_isend_irecv import _coalescing_manager

    me = dist.get_rank()
    ranks = list(g.ranks)
    n = len(ranks)
    gr = ranks.index(me)
    root = ranks[-1]          # non-zero root (global rank)
    root2 = ranks[1]          # another non-zero root
    all_data = lambda salt: np.stack([data_for(r, salt) for r in ranks])  # noqa: E731
    tag = f"{name}:"
    checks = 0

    # reduce SUM / AVG onto a non-zero root; only the root's buffer is read
    # (gloo leaves garbage in non-root buffers).
    for salt, (op, opname, dst) in enumerate(
        [(dist.ReduceOp.SUM, "SUM", root), (dist.ReduceOp.AVG, "AVG", root2)], start=1
    ):
        t = paddle.to_tensor(data_for(me, salt))
        dist.reduce(t, dst=dst, op=op, group=g)
        exp = all_data(salt).sum(0) if opname == "SUM" else all_data(salt).mean(0)
        if me == dst:
            expect(close(t, exp), g, f"{tag}reduce {opname} dst={dst}", exp, t.numpy())
        checks += 1

    # broadcast from a non-zero root
    t = paddle.to_tensor(data_for(me, 3))
    dist.broadcast(t, src=root, group=g)
    expect(close(t, data_for(root, 3)), g, f"{tag}broadcast src={root}", data_for(root, 3), t.numpy())
    checks += 1

    # all_gather (list form)
    out: list[paddle.Tensor] = []
    dist.all_gather(out, paddle.to_tensor(data_for(me, 4)), group=g)
    got = np.stack([o.numpy() for o in out]) if len(out) == n else np.zeros(0)
    expect(close(got, all_data(4)), g, f"{tag}all_gather(list)", all_data(4), got)
    checks += 1

    # all_gather through the process group: (in=slice, out=full)
    full = paddle.zeros([n * NUMEL], dtype="float32")
    g.process_group.all_gather(paddle.to_tensor(data_for(me, 5)), full).wait()
    expect(close(full, all_data(5).ravel()), g, f"{tag}process_group.all_gather", all_data(5).ravel(), full.numpy())
    checks += 1

    # emulated reduce_scatter: list input (dist.*), tensor input (stream.*,
    # async), and output aliasing the input the way FusedCommBuffer does it.
    shard = NUMEL // n
    for salt, (op, opname) in enumerate([(dist.ReduceOp.SUM, "SUM"), (dist.ReduceOp.AVG, "AVG")], start=6):
        red = all_data(salt).sum(0) if opname == "SUM" else all_data(salt).mean(0)
        exp = red[gr * shard : (gr + 1) * shard]

        src = paddle.to_tensor(data_for(me, salt))
        o = paddle.zeros([shard], dtype="float32")
        dist.reduce_scatter(o, list(src.split(n)), op=op, group=g)
        expect(close(o, exp), g, f"{tag}reduce_scatter(list) {opname}", exp, o.numpy())

        src = paddle.to_tensor(data_for(me, salt))
        o = paddle.zeros([shard], dtype="float32")
        stream.reduce_scatter(o, src, op=op, group=g, sync_op=False).wait()
        expect(close(o, exp), g, f"{tag}stream.reduce_scatter(tensor, async) {opname}", exp, o.numpy())
        expect(close(src, data_for(me, salt)), g, f"{tag}stream.reduce_scatter input untouched",
               data_for(me, salt), src.numpy())

        buf = paddle.to_tensor(data_for(me, salt))
        view = buf._slice(gr * shard, (gr + 1) * shard)
        dist.reduce_scatter(view, buf, op=op, group=g, sync_op=False).wait()
        got = buf.numpy()[gr * shard : (gr + 1) * shard]
        expect(close(got, exp), g, f"{tag}reduce_scatter(aliased view) {opname}", exp, got)
        checks += 3

    # all_reduce AVG (gloo has no AVG; CPU wheel's dist.all_reduce AVG would
    # crash on core.nccl_version) and SUM via the calc-stream path.
    t = paddle.to_tensor(data_for(me, 8))
    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=g)
    expect(close(t, all_data(8).mean(0)), g, f"{tag}all_reduce AVG", all_data(8).mean(0), t.numpy())
    t = paddle.to_tensor(data_for(me, 9))
    stream.all_reduce(t, op=dist.ReduceOp.SUM, group=g, sync_op=True, use_calc_stream=True)
    expect(close(t, all_data(9).sum(0)), g, f"{tag}stream.all_reduce SUM calc_stream", all_data(9).sum(0), t.numpy())
    checks += 2

    # stream ops with use_calc_stream=True
    for salt, (op, opname) in enumerate([(dist.ReduceOp.SUM, "SUM"), (dist.ReduceOp.AVG, "AVG")], start=10):
        t = paddle.to_tensor(data_for(me, salt))
        stream.reduce(t, dst=root, op=op, group=g, sync_op=True, use_calc_stream=True)
        exp = all_data(salt).sum(0) if opname == "SUM" else all_data(salt).mean(0)
        if me == root:
            expect(close(t, exp), g, f"{tag}stream.reduce {opname} calc_stream dst={root}", exp, t.numpy())
        checks += 1
    t = paddle.to_tensor(data_for(me, 12))
    stream.broadcast(t, src=root2, group=g, sync_op=True, use_calc_stream=True)
    expect(close(t, data_for(root2, 12)), g, f"{tag}stream.broadcast calc_stream", data_for(root2, 12), t.numpy())
    checks += 1

    # ops inside _coalescing_manager, async, then wait (the hierarchical
    # Muon path batches each phase like this).
    tasks: list = []
    a = paddle.to_tensor(data_for(me, 13))
    b = paddle.to_tensor(data_for(me, 14))
    c = paddle.to_tensor(data_for(me, 15))
    with _coalescing_manager(g, tasks):
        tasks.append(dist.reduce(a, dst=root2, op=dist.ReduceOp.AVG, group=g, sync_op=False))
        tasks.append(dist.reduce(b, dst=root, op=dist.ReduceOp.SUM, group=g, sync_op=False))
        tasks.append(dist.broadcast(c, src=root, group=g, sync_op=False))
    for task in tasks:
        task.wait()
    if me == root2:
        expect(close(a, all_data(13).mean(0)), g, f"{tag}coalesced reduce AVG dst={root2}", all_data(13).mean(0), a.numpy())
    if me == root:
        expect(close(b, all_data(14).sum(0)), g, f"{tag}coalesced reduce SUM dst={root}", all_data(14).sum(0), b.numpy())
    expect(close(c, data_for(root, 15)), g, f"{tag}coalesced broadcast src={root}", data_for(root, 15), c.numpy())
    checks += 3
    return checks


def a2a_value(src: int, dst: int, rows: int, width: int, salt: int) -> np.ndarray:
    """What global rank ``src`` sends global rank ``dst``: every element distinct."""
    r = np.arange(rows, dtype=np.float64)[:, None]
    c = np.arange(width, dtype=np.float64)[None, :]
    return (1000.0 * src + 100.0 * dst + 10.0 * r + c + 0.25 * salt).astype(np.float32)


def a2a_rows(s: int, d: int, n: int) -> int:
    """Unequal row counts from group rank s to group rank d (0 included)."""
    return (s + 2 * d) % (n + 1)


def check_alltoall(name: str, g) -> int:
    """All-to-all on ``g`` (emulated on gloo) against NumPy. Returns #checks."""
    from paddle.autograd import PyLayer
    from paddle.distributed.communication import stream

    me = dist.get_rank()
    ranks = list(g.ranks)
    n = len(ranks)
    gr = ranks.index(me)
    tag = f"{name}:"
    checks = 0

    # list form, equal shapes: sync, async (task.wait()), calc stream, empty out list
    for salt, how in enumerate(("sync", "async", "calc_stream", "empty_out"), start=1):
        ins = [paddle.to_tensor(a2a_value(me, d, 2, 3, salt)) for d in ranks]
        outs = [] if how == "empty_out" else [paddle.full([2, 3], -1.0) for _ in ranks]
        if how == "calc_stream":
            stream.alltoall(outs, ins, group=g, sync_op=True, use_calc_stream=True)
        else:
            task = dist.alltoall(outs, ins, group=g, sync_op=how != "async")
            task.wait()
        exp = np.stack([a2a_value(s, me, 2, 3, salt) for s in ranks])
        got = np.stack([o.numpy() for o in outs]) if len(outs) == n else np.zeros(0)
        expect(close(got, exp), g, f"{tag}alltoall(list) {how}", exp, got)
        checks += 1

    # list form, unequal chunk shapes (some empty), int64 and bfloat16
    for salt, dtype in enumerate(("float32", "int64", "bfloat16"), start=5):
        ins = [paddle.to_tensor(a2a_value(me, d, a2a_rows(gr, j, n), 2, 0)).astype(dtype)
               for j, d in enumerate(ranks)]
        outs = [paddle.zeros([a2a_rows(j, gr, n), 2], dtype=dtype) for j in range(n)]
        dist.alltoall(outs, ins, group=g)
        for j, s in enumerate(ranks):
            # bfloat16 keeps 8 bits: the expectation is the sent value rounded the same way
            exp = paddle.to_tensor(a2a_value(s, me, a2a_rows(j, gr, n), 2, 0)).astype(
                dtype).astype("float32").numpy()
            got = outs[j].astype("float32").numpy()
            expect(outs[j].dtype == ins[0].dtype and close(got, exp), g,
                   f"{tag}alltoall(list, unequal shapes) {dtype} from {s}", exp, got)
        checks += 1

    # alltoall_single, equal split (sync / async) and stream tensor form
    for salt, how in enumerate(("single", "single_async", "stream_tensor"), start=8):
        x = paddle.to_tensor(np.concatenate([a2a_value(me, d, 2, 3, salt) for d in ranks]))
        out = paddle.full([2 * n, 3], -1.0)
        if how == "stream_tensor":
            stream.alltoall(out, x, group=g, sync_op=True, use_calc_stream=True)
        else:
            dist.alltoall_single(out, x, group=g, sync_op=how == "single").wait()
        exp = np.concatenate([a2a_value(s, me, 2, 3, salt) for s in ranks])
        expect(close(out, exp), g, f"{tag}{how}", exp, out.numpy())
        checks += 1

    # alltoall_single with in/out split sizes (unequal, some 0)
    in_split = [a2a_rows(gr, j, n) for j in range(n)]
    out_split = [a2a_rows(j, gr, n) for j in range(n)]
    x = paddle.to_tensor(np.concatenate([a2a_value(me, d, in_split[j], 3, 11)
                                         for j, d in enumerate(ranks)]))
    out = paddle.full([sum(out_split), 3], -1.0)
    task = dist.alltoall_single(out, x, in_split, out_split, group=g, sync_op=False)
    task.wait()
    exp = np.concatenate([a2a_value(s, me, out_split[j], 3, 11) for j, s in enumerate(ranks)])
    expect(close(out, exp), g, f"{tag}alltoall_single(split sizes)", exp, out.numpy())
    # the stream form takes the output's split sizes first
    out = paddle.full([sum(out_split), 3], -1.0)
    stream.alltoall_single(out, x, out_split, in_split, group=g, sync_op=True,
                           use_calc_stream=True)
    expect(close(out, exp), g, f"{tag}stream.alltoall_single(split sizes)", exp, out.numpy())
    checks += 2

    # Gradient through a PyLayer dispatch (forward all-to-all, backward the
    # reverse), loss = sum(y * w): dx is w of each destination rank, routed
    # back. Outside a PyLayer the call records no gradient (as Paddle's own).
    class Dispatch(PyLayer):
        @staticmethod
        def forward(ctx, t):
            y = paddle.empty([sum(out_split), 3], dtype=t.dtype)
            dist.alltoall_single(y, t, in_split, out_split, group=g)
            return y

        @staticmethod
        def backward(ctx, dy):
            dx = paddle.empty([sum(in_split), 3], dtype=dy.dtype)
            dist.alltoall_single(dx, dy, out_split, in_split, group=g)
            return dx

    def weight(rank: int) -> np.ndarray:
        dr = ranks.index(rank)
        rows = sum(a2a_rows(j, dr, n) for j in range(n))
        return np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) * 0.5 + rank

    x.stop_gradient = False
    y = Dispatch.apply(x)
    (y * paddle.to_tensor(weight(me))).sum().backward()
    parts = []
    for j, d in enumerate(ranks):  # my rows inside destination d's output
        start = sum(a2a_rows(k, j, n) for k in range(gr))
        parts.append(weight(d)[start : start + a2a_rows(gr, j, n)])
    exp = np.concatenate(parts)
    got = x.grad.numpy() if x.grad is not None else np.zeros(0)
    expect(close(got, exp), g, f"{tag}PyLayer dispatch gradient", exp, got)
    plain = paddle.empty([sum(out_split), 3])
    dist.alltoall_single(plain, x, in_split, out_split, group=g)
    expect(plain.stop_gradient, g, f"{tag}plain alltoall_single records no gradient", True,
           plain.stop_gradient)
    checks += 2

    # A count mismatch on one rank is refused on every rank (no hang), as is
    # one rank's own bad argument; the group stays usable afterwards.
    bad_out = list(out_split)
    if gr == 0:
        bad_out[0] += 1
    errors = []
    for case in ("mismatch", "local"):
        try:
            if case == "mismatch":
                dist.alltoall_single(paddle.empty([sum(bad_out), 3]), x.detach(), in_split,
                                     bad_out, group=g)
            else:
                ins = [paddle.ones([1])] * (n + 1 if gr == n - 1 else n)
                dist.alltoall([paddle.ones([1]) for _ in ins], ins, group=g)
            errors.append(f"{case}: no error")
        except ValueError as e:
            errors.append(f"{case}: {e}")
    want = ["which expects", "input and" if gr == n - 1 else "refused their own arguments"]
    ok = len(errors) == 2 and all(w in e for w, e in zip(want, errors))
    expect(ok, g, f"{tag}alltoall errors on every rank", want, errors)
    checks += 1
    return checks


def check_native_alltoall_unchanged(g) -> int:
    """Without the layer, Paddle's own gloo error stays as it is (rule 2)."""
    from gloo_compat import install_gloo_compat as _install, uninstall_gloo_compat

    uninstall_gloo_compat()
    n = g.nranks
    got = []
    calls = (
        lambda: dist.alltoall([], [paddle.ones([2]) for _ in range(n)], group=g),
        lambda: dist.alltoall_single(paddle.empty([n]), paddle.ones([n]), group=g),
        lambda: dist.stream.alltoall(paddle.empty([n]), paddle.ones([n]), group=g),
        lambda: dist.stream.alltoall_single(paddle.empty([n]), paddle.ones([n]), group=g),
    )
    for call in calls:
        try:
            call()
            got.append("no error")
        except NotImplementedError as e:
            got.append("NotImplementedError" if "does not support all_to_all" in str(e) else str(e))
    expect(got == ["NotImplementedError"] * 4, g, "native alltoall without the layer",
           ["NotImplementedError"] * 4, got)
    _install()
    return 1


def gloo_check_strategy(mode: str, world: int) -> fleet.DistributedStrategy:
    strategy = fleet.DistributedStrategy()
    if mode == "ep":
        if world != 8:
            raise SystemExit(f"ep mode needs 8 ranks, got {world}")
        strategy.hybrid_configs = {
            "dp_degree": 1, "mp_degree": 1, "pp_degree": 1,
            "sharding_degree": 8, "ep_degree": 4, "moe_sharding_degree": 2,
            "order": ["dp", "moe_sharding", "pp", "sharding", "sep", "cp", "ep", "mp"],
        }
    elif mode == "sharding":
        strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": world}
    else:
        raise SystemExit(f"unknown GLOO_COMPAT_CHECK_MODE={mode!r}")
    return strategy


def main() -> int:
    mode = os.environ.get("GLOO_COMPAT_CHECK_MODE", "ep")
    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    active = install_gloo_compat()
    t = time.perf_counter()
    fleet.init(is_collective=True, strategy=gloo_check_strategy(mode, world))
    t_init = time.perf_counter() - t
    me = dist.get_rank()
    hcg = fleet.get_hybrid_communicate_group()

    groups: list[tuple[str, object]] = [("sharding", hcg.get_sharding_parallel_group())]
    if mode == "ep":
        if type(hcg).__name__ != "EPHybridCommunicateGroup":
            FAILURES.append(f"rank={me}: expected EPHybridCommunicateGroup, got {type(hcg).__name__}")
        groups.append(("moe_sharding", hcg.get_moe_sharding_parallel_group()))
        groups.append(("expert", hcg.get_expert_parallel_group()))

    # Node / same-card groups from the emulated gpus-per-node. Every rank
    # calls new_group for every group in the same order (gids must match).
    t = time.perf_counter()
    gpn = int(os.environ.get("PADDLE_LOCAL_SIZE", str(world)))
    if world % gpn:
        raise SystemExit(f"world {world} not a multiple of PADDLE_LOCAL_SIZE {gpn}")
    node_groups = [list(range(s, s + gpn)) for s in range(0, world, gpn)]
    card_groups = [list(range(c, world, gpn)) for c in range(gpn)]
    for kind, ranks_list in (("node", node_groups), ("same_card", card_groups)):
        for ranks in ranks_list:
            if len(ranks) < 2:
                continue  # single-rank groups never communicate
            grp = dist.new_group(ranks)
            if me in ranks:
                groups.append((f"{kind}{ranks}", grp))
    t_groups = time.perf_counter() - t

    if me == 0:
        print(f"GLOO_COMPAT_INFO mode={mode} compat_active={active} hcg={type(hcg).__name__} "
              f"gpn={gpn} groups={[(n, list(g.ranks)) for n, g in groups]}", flush=True)

    t = time.perf_counter()
    n_checks = 0
    for name, g in groups:
        if g is None or g.nranks < 2 or me not in g.ranks:
            continue
        n_checks += check_group(name, g)
        n_checks += check_alltoall(name, g)
    n_checks += check_native_alltoall_unchanged(hcg.get_sharding_parallel_group())
    t_checks = time.perf_counter() - t

    print(f"GLOO_COMPAT_TIMING rank={me} import={_T_IMPORT:.2f}s fleet_init={t_init:.2f}s "
          f"new_groups={t_groups:.2f}s checks={t_checks:.2f}s n_checks={n_checks} "
          f"total={time.perf_counter() - _T0:.2f}s", flush=True)
    if FAILURES:
        print("\n".join(FAILURES), file=sys.stderr, flush=True)
        print(f"GLOO_COMPAT_FAILED rank={me} mismatches={len(FAILURES)}", flush=True)
        return 1
    print(f"GLOO_COMPAT_OK rank={me}", flush=True)
    return 0


if __name__ == "__main__":
    from worker_exit import exit_after_verdict

    exit_after_verdict(main())
