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
"""Run NCCL-style collective code on gloo (CPU) process groups.

On a CPU box ``python -m paddle.distributed.launch`` uses gloo, which lacks
what the sharded Muon optimizer and ``FusedCommBuffer`` call. On paddle
3.3.x ``patch_paddle()`` calls :func:`install_gloo_compat` itself when the
launcher selected gloo (``PADDLE_DISTRI_BACKEND=gloo``), so a user's script
needs nothing else; NCCL and other backends are never touched (each wrapper
checks the group it is given). Install it *before* ``fleet.init`` (sub-groups
are created inside ``fleet.init``); :func:`uninstall_gloo_compat` undoes it.

What it changes (only for gloo process groups; NCCL/other groups pass through):

1. **Sub-groups.** In paddle 3.3.1, gloo sub-groups of >= 3 ranks created on
   the default TCPStore fail ("address size mismatch" / "connection
   refused"). Every gloo sub-group (gid != 0) instead gets its own
   ``core.TCPStore``. The group's master is its first rank (group rank 0).

   *Ports.* Rather than deriving a port arithmetically from the launcher's
   env (which can collide with another launch whose random port window
   overlaps, or with an unrelated process), the group master asks the OS for
   a free port (bind to port 0), starts its TCPStore there (the store then
   holds the port), and publishes ``host:port`` on the launcher-provided
   *default* store under the deterministic key :func:`rendezvous_key`
   (unique per group id and name), then binds its store there; the other
   members block on that key. (The master's TCPStore constructor waits for
   all members, hence publish-then-bind.) Consequences: ports never collide
   with each other, with the launcher's master / store ports (bound, so the
   OS never hands them out) or with a concurrently running launch; and it
   also works across hosts because the master publishes its own host (from
   ``PADDLE_CURRENT_ENDPOINT``). The only window left is the millisecond
   between probing a port and the store binding it (a loss raises a clear
   error instead of hanging).

2. ``use_calc_stream=True`` on ``paddle.distributed.stream.*`` ops -> the
   plain synchronous op (gloo has no ``*_on_calc_stream``).
3. ``reduce_scatter`` (``paddle.distributed.reduce_scatter``,
   ``stream.reduce_scatter``, ``_reduce_scatter_base``) -> ``all_reduce`` of a
   copy of the input (SUM for AVG) + take this rank's slice (+ scale for
   AVG). The input is never modified (the output may alias it, as in
   ``FusedCommBuffer``). Moves n x more bytes than NCCL: fine for developing on CPU.
4. ``ReduceOp.AVG`` where gloo lacks it: ``all_reduce``/``stream.all_reduce``
   and ``stream.reduce`` -> pre-scale by 1/n then SUM (exactly what paddle's
   own ``dist.reduce`` fallback does). ``dist.all_reduce(AVG)`` on the CPU
   wheel otherwise dies with ``AttributeError: ... nccl_version``.

5. ``reduce`` (``stream.reduce``, hence ``dist.reduce``): a non-root rank's
   buffer keeps its input, as under NCCL (``ncclReduce`` writes ``recvbuff``
   only on the root; in place, a non-root buffer is left as it was). Native
   gloo leaves partial sums there (2 ranks, inputs 1 and 2: rank 1 ends with
   ``[2 2 2 2 3 3 3 3]``) and the AVG pre-scale above scales it.

6. **All-to-all** (``alltoall``, ``alltoall_single``, ``stream.alltoall`` in
   list and tensor form, ``stream.alltoall_single``; equal or unequal chunks,
   with or without split sizes, sync or async) -> an ``all_gather`` of the
   send/receive counts, then an ``all_gather`` of every rank's flattened input
   padded to the longest; each rank keeps the pieces addressed to it. A count
   mismatch (or one rank's bad arguments) is refused on every rank in one
   line instead of a hang; Paddle's own argument checks run first, unchanged.
   Autograd: like Paddle's own, these calls record no gradient; inside a
   ``PyLayer`` (forward all-to-all, backward the reverse all-to-all of the
   gradient, as MoE dispatch layers do) the gradients are exact. Not
   covered: calls made straight on ``group.process_group`` (``paddle.incubate``
   MoE's ``_alltoall``) and ``global_scatter`` / ``global_gather`` (no CPU
   kernel in 3.3.1), so ``paddle.incubate``'s ``MoELayer`` stays GPU-only.

broadcast / all_gather / coalescing stay native.

Patched attributes (looked up at call time by paddle itself and by code that
writes ``paddle.distributed.xxx(...)`` / ``dist.stream.xxx(...)``): see
:data:`_PATCH_TARGETS_DOC`. Code that did ``from paddle.distributed import
reduce_scatter`` at import time keeps the original - call through the module.

Emulated-node helper: the launcher overwrites ``PADDLE_LOCAL_SIZE`` with
``--nproc_per_node``, so a test that wants "4 nodes x 2 cards" on one box
passes ``GLOO_COMPAT_LOCAL_SIZE=2``; :func:`apply_emulated_local_size` (called
by :func:`install_gloo_compat`) copies it into ``PADDLE_LOCAL_SIZE``.
"""

from __future__ import annotations

import inspect
import math
import os
import socket
import sys
import threading
from collections.abc import Callable
from contextlib import closing
from typing import Any

import paddle
import paddle.distributed as dist
from paddle.base import core

#: Env var honoured by :func:`apply_emulated_local_size`.
EMULATED_LOCAL_SIZE_ENV = "GLOO_COMPAT_LOCAL_SIZE"
#: Force the compat layer on ("1") or off ("0"); unset = auto-detect.
FORCE_ENV = "GLOO_COMPAT"
#: TCPStore timeout (seconds) for sub-group stores.
STORE_TIMEOUT_ENV = "GLOO_COMPAT_STORE_TIMEOUT"

_PATCH_TARGETS_DOC = (
    "paddle.distributed.collective._new_process_group_impl",
    "paddle.distributed.{all_reduce,reduce_scatter}",
    "paddle.distributed.communication.{all_reduce,reduce_scatter}",
    "paddle.distributed.stream.<every op with use_calc_stream>",
    "paddle.distributed.communication.reduce_scatter._reduce_scatter_base_stream",
    "paddle.distributed.communication.stream.reduce_scatter._reduce_scatter_base",
    "paddle.distributed.communication.stream.all_to_all."
    "{_all_to_all_in_dygraph,_all_to_all_tensor_in_dygraph,_alltoall_single_in_dygraph}",
)

_lock = threading.RLock()
# (owner object, attribute name, original value), in install order.
_saved: list[tuple[Any, str, Any]] = []
_installed = False
# Keep sub-group stores alive for the life of the process (the gloo context
# talks to them during rendezvous; dropping them early is asking for trouble).
_stores: dict[int, Any] = {}
# Remembered so uninstall can restore the environment too.
_saved_local_size: tuple[bool, str | None] | None = None


# ----------------------------------------------------------------- detection
_OFF_WORDS = ("0", "false", "off", "no")
_ON_WORDS = ("1", "true", "on", "yes")


def _forced_switch() -> bool | None:
    """``GLOO_COMPAT`` as on/off, None when unset; another word is refused."""
    raw = os.environ.get(FORCE_ENV, "").strip()
    if not raw:
        return None
    if raw.lower() not in _OFF_WORDS + _ON_WORDS:
        raise ValueError(
            f"{FORCE_ENV}={raw!r}: must be one of {_ON_WORDS} (force the gloo layer on) "
            f"or {_OFF_WORDS} (off); unset it to decide from PADDLE_DISTRI_BACKEND"
        )
    return raw.lower() in _ON_WORDS


def _env_int(name: str, default: int, low: int) -> int:
    """An integer environment variable ``>= low`` (one-line error otherwise)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < low:
        raise ValueError(f"{name} must be >= {low}, got {raw!r}; pass an integer or unset it")
    return value


def gloo_expected() -> bool:
    """True when this process will (or does) use the gloo backend.

    Decided before ``fleet.init`` so install can happen early:
    ``GLOO_COMPAT=1/0`` forces; ``PADDLE_DISTRI_BACKEND`` (set to ``gloo`` by
    the launcher on CPU) decides next; otherwise gloo iff no CUDA device.
    """
    forced = _forced_switch()
    if forced is not None:
        return forced
    backend = os.environ.get("PADDLE_DISTRI_BACKEND", "").strip().lower()
    if backend:
        return backend == "gloo"
    if not paddle.is_compiled_with_cuda():
        return True
    try:
        return paddle.device.cuda.device_count() == 0
    except Exception:  # broken driver -> behave like CPU
        return True


def gloo_backend_selected() -> bool:
    """True when the launcher chose gloo for this process (or ``GLOO_COMPAT=1``).

    Unlike :func:`gloo_expected` this never guesses from the build: a plain
    single-process run on the CPU wheel is not a gloo job, so ``patch_paddle()``
    leaves ``paddle.distributed`` alone there.
    """
    forced = _forced_switch()
    if forced is not None:
        return forced
    return os.environ.get("PADDLE_DISTRI_BACKEND", "").strip().lower() == "gloo"


def _resolve_group(group: Any) -> Any:
    if group is None:
        return dist.collective._get_global_group()
    return group


def is_gloo_group(group: Any) -> bool:
    """Whether ``group`` (None = global) is backed by ``ProcessGroupGloo``.

    Checked per call so a mixed world (or NCCL) is never touched.
    """
    try:
        g = _resolve_group(group)
    except Exception:
        return False
    pg = getattr(g, "process_group", None)
    return isinstance(pg, core.ProcessGroupGloo)


def apply_emulated_local_size() -> int | None:
    """Copy ``GLOO_COMPAT_LOCAL_SIZE`` into ``PADDLE_LOCAL_SIZE``.

    Why: ``paddle.distributed.launch`` sets ``PADDLE_LOCAL_SIZE`` to
    ``--nproc_per_node`` in every worker, overriding the caller's env, so
    "gpus per node = 2" cannot be passed directly on a single box.
    Returns the applied value, or None when the variable is unset.
    """
    global _saved_local_size
    if not os.environ.get(EMULATED_LOCAL_SIZE_ENV, "").strip():
        return None
    value = _env_int(EMULATED_LOCAL_SIZE_ENV, 0, 1)
    if _saved_local_size is None:
        _saved_local_size = (
            "PADDLE_LOCAL_SIZE" in os.environ,
            os.environ.get("PADDLE_LOCAL_SIZE"),
        )
    os.environ["PADDLE_LOCAL_SIZE"] = str(value)
    return value


# ------------------------------------------------------- sub-group creation
def rendezvous_key(group_id: int, group_name: str) -> str:
    """Default-store key under which a sub-group master publishes host:port.

    Deterministic (same on every member) and unique per group: gids are
    handed out in the same order on every rank by ``new_group``.
    """
    return f"gloo_compat/subgroup/{group_name}/{int(group_id)}/endpoint"


def pick_free_port(host: str = "") -> int:
    """Ask the OS for a currently free TCP port (bind to port 0)."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _my_host() -> str:
    """Host other ranks can reach this process on (single box: 127.0.0.1)."""
    ep = os.environ.get("PADDLE_CURRENT_ENDPOINT", "")
    host = ep.rsplit(":", 1)[0] if ":" in ep else ""
    return host or "127.0.0.1"


def _store_timeout() -> int:
    return _env_int(STORE_TIMEOUT_ENV, 300, 1)


def create_subgroup_store(
    default_store: Any, rank: int, world_size: int, group_id: int, group_name: str
) -> Any:
    """Create (master) or join (others) the dedicated TCPStore of a sub-group.

    The master (group rank 0) binds an OS-chosen free port and publishes
    ``host:port`` on ``default_store``; the others block on that key.
    """
    key = rendezvous_key(group_id, group_name)
    timeout = _store_timeout()
    if rank == 0:
        # The master's TCPStore constructor blocks until all `world_size`
        # members connected, so the endpoint must be published *before* it
        # is built. Members retry connecting until the server listens.
        host = _my_host()
        port = pick_free_port()
        default_store.set(key, f"{host}:{port}")
        try:
            return core.TCPStore(host, port, True, world_size, timeout)
        except Exception as e:
            raise RuntimeError(
                f"gloo_compat: sub-group {group_name} (gid {group_id}) store could not "
                f"bind {host}:{port} (taken between probe and bind?): {e}"
            ) from e
    raw = default_store.get(key)  # blocks until the master published
    endpoint = raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw)
    host, port = endpoint.rsplit(":", 1)
    return core.TCPStore(host, int(port), False, world_size, timeout)


def _make_new_pg_impl(original: Callable[..., Any]) -> Callable[..., Any]:
    sig = inspect.signature(original)

    def _new_process_group_impl_compat(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        gid = int(a.get("group_id", 0) or 0)
        # gid 0 is the global group, which works on the default store.
        if a["backend"] != "gloo" or gid == 0:
            return original(*args, **kwargs)
        store = create_subgroup_store(
            a["store"], int(a["rank"]), int(a["world_size"]), gid, str(a["group_name"])
        )
        _stores[gid] = store
        return core.ProcessGroupGloo.create(store, int(a["rank"]), int(a["world_size"]), gid)

    _new_process_group_impl_compat.__wrapped__ = original  # type: ignore[attr-defined]
    return _new_process_group_impl_compat


# ------------------------------------------------------------ op emulation
def _is_avg(op: Any) -> bool:
    return op == dist.ReduceOp.AVG


def _scale_inplace(t: paddle.Tensor, factor: float) -> None:
    with paddle.no_grad():
        t.scale_(factor)


def _emulated_reduce_scatter(
    out: paddle.Tensor,
    inp: paddle.Tensor | list[paddle.Tensor] | tuple[paddle.Tensor, ...],
    op: Any,
    group: Any,
    stream_all_reduce: Callable[..., Any],
) -> Any:
    """reduce_scatter via all_reduce on a private copy + my slice.

    Runs synchronously: gloo executes collectives inline anyway, and the
    output slice must be written after the reduction finished. Returns the
    (finished) all_reduce task so ``task.wait()`` and ``_end_coalescing``
    still get a real task object.
    """
    g = _resolve_group(group)
    n, r = int(g.nranks), int(g.rank)
    with paddle.no_grad():
        if isinstance(inp, (list, tuple)):
            full = paddle.concat([t.reshape([-1]) for t in inp])
        else:
            # clone: the output may alias the input (FusedCommBuffer does that)
            full = inp.reshape([-1]).clone()
        numel = int(full.shape[0])
        shard = math.prod(out.shape)
        if shard * n != numel:
            raise ValueError(
                f"gloo_compat reduce_scatter: input numel {numel} != "
                f"nranks {n} x output numel {shard}"
            )
        red_op = dist.ReduceOp.SUM if _is_avg(op) else op
        task = stream_all_reduce(full, op=red_op, group=g, sync_op=True, use_calc_stream=False)
        mine = full[r * shard : (r + 1) * shard]
        if _is_avg(op):
            mine = mine.scale(1.0 / n)
        paddle.assign(mine.reshape(out.shape).astype(out.dtype), out)
    return task


def _bind(sig: inspect.Signature, args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _stream_generic(original: Callable[..., Any]) -> Callable[..., Any]:
    """use_calc_stream=True -> plain sync op, for gloo groups only."""
    sig = inspect.signature(original)

    def compat(*args: Any, **kwargs: Any) -> Any:
        a = _bind(sig, args, kwargs)
        if a.get("use_calc_stream") and is_gloo_group(a.get("group")):
            a["use_calc_stream"] = False
            a["sync_op"] = True
        return original(**a)

    compat.__wrapped__ = original  # type: ignore[attr-defined]
    compat.__name__ = getattr(original, "__name__", "stream_op")
    return compat


def _stream_avg_prescale(original: Callable[..., Any]) -> Callable[..., Any]:
    """stream.all_reduce / stream.reduce: calc-stream mapping + AVG emulation."""
    sig = inspect.signature(original)

    def compat(*args: Any, **kwargs: Any) -> Any:
        a = _bind(sig, args, kwargs)
        if is_gloo_group(a.get("group")):
            if a.get("use_calc_stream"):
                a["use_calc_stream"] = False
                a["sync_op"] = True
            if _is_avg(a.get("op")):
                _scale_inplace(a["tensor"], 1.0 / _resolve_group(a.get("group")).nranks)
                a["op"] = dist.ReduceOp.SUM
        return original(**a)

    compat.__wrapped__ = original  # type: ignore[attr-defined]
    compat.__name__ = getattr(original, "__name__", "stream_op")
    return compat


def _nonroot_keeps_input(original: Callable[..., Any]) -> Callable[..., Any]:
    """stream.reduce on gloo: non-root buffers end as they began (NCCL's semantics)."""
    sig = inspect.signature(original)

    def compat(*args: Any, **kwargs: Any) -> Any:
        a = _bind(sig, args, kwargs)
        if not is_gloo_group(a.get("group")) or dist.get_rank() == a["dst"]:
            return original(**a)
        tensor = a["tensor"]
        with paddle.no_grad():
            kept = tensor.clone()
            task = original(**a)
            if task is not None and not a.get("sync_op", True):
                task.wait()  # gloo has already run it; the restore must come after
            paddle.assign(kept, tensor)
        return task

    compat.__wrapped__ = original  # type: ignore[attr-defined]
    compat.__name__ = getattr(original, "__name__", "reduce")
    return compat


def _reduce_scatter_compat(original: Callable[..., Any], get_all_reduce: Callable[[], Any],
                           out_arg: str, in_arg: str):
    """A reduce_scatter entry point whose gloo groups use the emulation.

    The three entry points (``stream.reduce_scatter``, ``_reduce_scatter_base``
    and ``dist.reduce_scatter``) differ only in their argument names.
    """
    sig = inspect.signature(original)

    def compat(*args: Any, **kwargs: Any) -> Any:
        a = _bind(sig, args, kwargs)
        if not is_gloo_group(a.get("group")):
            return original(**a)
        return _emulated_reduce_scatter(
            a[out_arg], a[in_arg], a.get("op"), a.get("group"), get_all_reduce()
        )

    compat.__wrapped__ = original  # type: ignore[attr-defined]
    return compat


def _top_all_reduce(original: Callable[..., Any], get_stream_all_reduce: Callable[[], Any]):
    """dist.all_reduce: on the CPU wheel AVG crashes on core.nccl_version."""
    sig = inspect.signature(original)

    def compat(*args: Any, **kwargs: Any) -> Any:
        a = _bind(sig, args, kwargs)
        if not is_gloo_group(a.get("group")):
            return original(**a)
        return get_stream_all_reduce()(
            a["tensor"], op=a["op"], group=a.get("group"), sync_op=a["sync_op"], use_calc_stream=False
        )

    compat.__wrapped__ = original  # type: ignore[attr-defined]
    return compat


# ------------------------------------------------------ all-to-all emulation
# Gloo on paddle 3.3.x has no all-to-all ("ProcessGroupGLOO does not support
# all_to_all"). Measured on 2-3 CPU processes: blocking send/recv work, but
# concurrent isend/irecv (batch_isend_irecv) time out and leave the pair
# broken, so pairwise exchange would have to be n^2 ordered steps. Instead two
# all_gathers: the send/receive counts (so every rank checks the whole
# exchange and refuses a mismatch on *every* rank, instead of one rank raising
# while its peers hang), then each rank's flattened input padded to the
# longest one; every rank keeps the pieces addressed to it. Moves n x the
# bytes of a real all-to-all: fine for developing on CPU.
_A2A_BAD = -1  # count sent by a rank whose own arguments were refused


def _numel(t: paddle.Tensor) -> int:
    return int(math.prod(t.shape))


def _a2a_exchange(
    flat_in: paddle.Tensor | None,
    send_counts: list[int] | None,
    recv_counts: list[int] | None,
    group: Any,
    what: str,
    local_error: str | None = None,
) -> tuple[paddle.Tensor | None, Any]:
    """Exchange ``flat_in[sum(send_counts[:d]):...]`` with every group rank d.

    Args:
        flat_in: this rank's 1-D input, pieces in destination order.
        send_counts: elements sent to each group rank.
        recv_counts: elements expected from each group rank.
        group: the (resolved, gloo) group.
        what: the user-facing op name, for errors.
        local_error: this rank's own argument error; it is raised here after
            the peers were told, so no rank is left waiting.

    Returns:
        (the received pieces concatenated in source order as a 1-D tensor, or
        None when this rank receives nothing; the last all_gather task).
    """
    pg = group.process_group
    n = int(group.nranks)
    with paddle.no_grad():
        counts = [_A2A_BAD] * (2 * n) if local_error else list(send_counts) + list(recv_counts)
        mine = paddle.to_tensor(counts, dtype="int64")
        table = paddle.empty([n * 2 * n], dtype="int64")
        task = pg.all_gather(mine, table)
        task.wait()
        if local_error:
            raise ValueError(local_error)
        rows = table.numpy().reshape(n, 2 * n)
        bad = [int(s) for s in range(n) if rows[s, 0] == _A2A_BAD]
        if bad:
            raise ValueError(
                f"gloo_compat {what}: group rank(s) {bad} refused their own arguments "
                "(see their log); fix them there"
            )
        sends, recvs = rows[:, :n], rows[:, n:]
        for s in range(n):
            for d in range(n):
                if sends[s, d] != recvs[d, s]:
                    raise ValueError(
                        f"gloo_compat {what}: group rank {s} sends {int(sends[s, d])} elements "
                        f"to group rank {d}, which expects {int(recvs[d, s])}; make the output "
                        "shapes / split sizes match what each rank sends"
                    )
        longest = int(sends.sum(axis=1).max())
        r = int(group.rank)
        if longest == 0:
            return None, task
        padding = longest - int(flat_in.shape[0])
        if padding:
            flat_in = paddle.concat([flat_in, paddle.zeros([padding], dtype=flat_in.dtype)])
        gathered = paddle.empty([n * longest], dtype=flat_in.dtype)
        task = pg.all_gather(flat_in, gathered)
        task.wait()
        pieces = []
        for s in range(n):
            count = int(sends[s, r])
            if count:
                start = s * longest + int(sends[s, :r].sum())
                pieces.append(gathered[start : start + count])
        received = paddle.concat(pieces) if pieces else None
    return received, task


def _a2a_check_dtypes(what: str, named: list[tuple[str, paddle.Tensor]], dtype: Any) -> str | None:
    """An error naming the first tensor whose dtype is not ``dtype``, else None."""
    for label, t in named:
        if t.dtype != dtype:
            return (f"gloo_compat {what}: {label} has dtype {t.dtype}, the input has "
                    f"{dtype}; give every input and output tensor the same dtype")
    return None


def _write(out: paddle.Tensor, flat: paddle.Tensor) -> None:
    """Fill ``out`` in place (views and aliases of it see the result)."""
    with paddle.no_grad():
        paddle.assign(flat.reshape(out.shape), out)


def _emulated_all_to_all_list(
    out_tensor_list: list[paddle.Tensor], in_tensor_list: list[paddle.Tensor], group: Any
) -> Any:
    """``stream.alltoall`` list form: in[d] goes to rank d, out[s] comes from rank s.

    Chunks may differ in shape (as Paddle's NCCL path allows) as long as
    each ``out[s]`` has the element count rank s sends here. An empty
    ``out_tensor_list`` is filled with tensors shaped like the inputs, as
    Paddle does.
    """
    n = int(group.nranks)
    what = "alltoall"
    if len(in_tensor_list) == 0:
        raise RuntimeError(f"gloo_compat {what}: in_tensor_list is empty; pass one tensor "
                           f"per rank of the group ({n})")
    if len(out_tensor_list) == 0:
        out_tensor_list.extend(paddle.empty_like(t) for t in in_tensor_list)
    error = None
    if len(in_tensor_list) != n or len(out_tensor_list) != n:
        error = (f"gloo_compat {what}: {len(in_tensor_list)} input and "
                 f"{len(out_tensor_list)} output tensors for a group of {n}; pass {n} of each")
    else:
        dtype = in_tensor_list[0].dtype
        error = _a2a_check_dtypes(
            what, [(f"in_tensor_list[{i}]", t) for i, t in enumerate(in_tensor_list)]
            + [(f"out_tensor_list[{i}]", t) for i, t in enumerate(out_tensor_list)], dtype)
    if error:
        _a2a_exchange(None, None, None, group, what, error)
    with paddle.no_grad():
        flat = paddle.concat([t.reshape([-1]) for t in in_tensor_list])
    received, task = _a2a_exchange(
        flat, [_numel(t) for t in in_tensor_list], [_numel(t) for t in out_tensor_list],
        group, what,
    )
    offset = 0
    for out in out_tensor_list:
        count = _numel(out)
        if count:
            _write(out, received[offset : offset + count])
            offset += count
    return task


def _split_counts(
    what: str, name: str, t: paddle.Tensor, sizes: list[int] | None, n: int
) -> tuple[list[int] | None, str | None]:
    """Element counts per rank for splitting ``t`` along dim 0 (or an error)."""
    if len(t.shape) == 0:
        return None, f"gloo_compat {what}: {name} is 0-D; give it a first dimension to split"
    rows, row = int(t.shape[0]), int(math.prod(t.shape[1:]))
    if not sizes:
        if rows % n:
            return None, (f"gloo_compat {what}: {name} has {rows} rows, not divisible by the "
                          f"group size {n}; pass split sizes or pad it")
        return [rows // n * row] * n, None
    sizes = [int(s) for s in sizes]
    if len(sizes) != n or min(sizes) < 0 or sum(sizes) != rows:
        return None, (f"gloo_compat {what}: {name} split sizes {sizes} must be {n} "
                      f"non-negative numbers summing to its {rows} rows")
    return [s * row for s in sizes], None


def _emulated_all_to_all_single(
    out_tensor: paddle.Tensor,
    in_tensor: paddle.Tensor,
    out_split_sizes: list[int] | None,
    in_split_sizes: list[int] | None,
    group: Any,
    what: str = "alltoall_single",
) -> Any:
    """``alltoall_single`` / tensor-form ``stream.alltoall`` along dim 0."""
    n = int(group.nranks)
    send, error = _split_counts(what, "in_tensor", in_tensor, in_split_sizes, n)
    recv, out_error = _split_counts(what, "out_tensor", out_tensor, out_split_sizes, n)
    error = error or out_error or _a2a_check_dtypes(what, [("out_tensor", out_tensor)],
                                                          in_tensor.dtype)
    if error:
        _a2a_exchange(None, None, None, group, what, error)
    with paddle.no_grad():
        # clone: out_tensor may alias in_tensor
        flat = in_tensor.reshape([-1]).clone()
    received, task = _a2a_exchange(flat, send, recv, group, what)
    if received is not None:
        _write(out_tensor, received)
    return task


def _a2a_dygraph_compat(original: Callable[..., Any], emulation: Callable[..., Any]):
    """Wrap one of Paddle's ``_*all_to_all*_in_dygraph`` helpers.

    Paddle's public ``alltoall`` / ``alltoall_single`` (and their ``stream``
    forms) resolve the group, check membership and sync/calc-stream
    arguments, then call these helpers by module-global name; replacing the
    helpers keeps all of that Paddle's own. gloo runs collectives inline, so
    ``sync_op`` / ``use_calc_stream`` need no mapping: the returned task is
    already finished and ``wait()`` returns at once.
    """

    sig = inspect.signature(original)

    def compat(*args: Any, **kwargs: Any) -> Any:
        # every helper's parameters end with (group, sync_op, use_calc_stream)
        *tensors, group, _sync_op, _use_calc_stream = _bind(sig, args, kwargs).values()
        if not is_gloo_group(group):
            return original(*args, **kwargs)
        return emulation(*tensors, group)

    compat.__wrapped__ = original  # type: ignore[attr-defined]
    compat.__name__ = getattr(original, "__name__", "all_to_all")
    return compat


def _emulated_all_to_all_tensor(out_tensor: paddle.Tensor, in_tensor: paddle.Tensor,
                                group: Any) -> Any:
    return _emulated_all_to_all_single(out_tensor, in_tensor, None, None, group, "alltoall")


# --------------------------------------------------------- install/uninstall
def _patch(owner: Any, name: str, value: Any) -> None:
    _saved.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def install_gloo_compat(force: bool | None = None) -> bool:
    """Install the compat layer; idempotent. Returns True when active.

    ``force=None`` auto-detects (see :func:`gloo_expected`); a no-op (False)
    when the backend will not be gloo. Call before ``fleet.init`` /
    ``init_parallel_env`` so sub-groups are created through the patch.
    """
    global _installed
    with _lock:
        if _installed:
            return True
        active = gloo_expected() if force is None else bool(force)
        if not active:
            return False
        apply_emulated_local_size()

        import paddle.distributed.collective as collective
        import paddle.distributed.communication as comm
        stream = comm.stream
        rs_mod = sys.modules["paddle.distributed.communication.reduce_scatter"]
        stream_rs_mod = sys.modules["paddle.distributed.communication.stream.reduce_scatter"]

        # Originals captured now; helpers resolve "the original stream
        # all_reduce" lazily so the emulation never re-enters a wrapper.
        orig_stream_all_reduce = stream.all_reduce

        def get_orig_stream_all_reduce() -> Any:
            return orig_stream_all_reduce

        def get_compat_stream_all_reduce() -> Any:
            return stream.all_reduce

        _patch(collective, "_new_process_group_impl", _make_new_pg_impl(collective._new_process_group_impl))

        for name in ("all_gather", "alltoall", "alltoall_single", "broadcast", "gather", "recv", "scatter", "send"):
            fn = getattr(stream, name, None)
            if fn is not None and "use_calc_stream" in inspect.signature(fn).parameters:
                _patch(stream, name, _stream_generic(fn))
        _patch(stream, "all_reduce", _stream_avg_prescale(stream.all_reduce))
        _patch(stream, "reduce", _nonroot_keeps_input(_stream_avg_prescale(stream.reduce)))
        compat_rs = _reduce_scatter_compat(stream.reduce_scatter, get_orig_stream_all_reduce,
                                           "tensor", "tensor_or_tensor_list")
        _patch(stream, "reduce_scatter", compat_rs)
        compat_rs_base = _reduce_scatter_compat(stream_rs_mod._reduce_scatter_base,
                                                get_orig_stream_all_reduce, "out_tensor", "in_tensor")
        _patch(stream_rs_mod, "_reduce_scatter_base", compat_rs_base)
        if hasattr(rs_mod, "_reduce_scatter_base_stream"):
            _patch(rs_mod, "_reduce_scatter_base_stream", compat_rs_base)
        # all-to-all: dist.alltoall(_single) call stream.alltoall(_single),
        # which call these helpers by module-global name.
        a2a_mod = sys.modules["paddle.distributed.communication.stream.all_to_all"]
        for name, emulation in (("_all_to_all_in_dygraph", _emulated_all_to_all_list),
                                ("_all_to_all_tensor_in_dygraph", _emulated_all_to_all_tensor),
                                ("_alltoall_single_in_dygraph", _emulated_all_to_all_single)):
            if hasattr(a2a_mod, name):  # absent in a Paddle that reorganised them: stay native
                _patch(a2a_mod, name, _a2a_dygraph_compat(getattr(a2a_mod, name), emulation))

        top_ar = _top_all_reduce(dist.all_reduce, get_compat_stream_all_reduce)
        top_rs = _reduce_scatter_compat(dist.reduce_scatter, get_orig_stream_all_reduce,
                                        "tensor", "tensor_list")
        for owner in (dist, comm):
            _patch(owner, "all_reduce", top_ar)
            _patch(owner, "reduce_scatter", top_rs)
        _installed = True
        return True


def uninstall_gloo_compat() -> None:
    """Restore every patched attribute (and PADDLE_LOCAL_SIZE). Idempotent.

    Process groups already created through the patch keep working.
    """
    global _installed, _saved_local_size
    with _lock:
        while _saved:
            owner, name, original = _saved.pop()
            setattr(owner, name, original)
        if _saved_local_size is not None:
            had, value = _saved_local_size
            if had and value is not None:
                os.environ["PADDLE_LOCAL_SIZE"] = value
            else:
                os.environ.pop("PADDLE_LOCAL_SIZE", None)
            _saved_local_size = None
        _installed = False


def is_installed() -> bool:
    return _installed


__all__ = [
    "EMULATED_LOCAL_SIZE_ENV",
    "FORCE_ENV",
    "apply_emulated_local_size",
    "create_subgroup_store",
    "gloo_backend_selected",
    "gloo_expected",
    "install_gloo_compat",
    "is_gloo_group",
    "is_installed",
    "pick_free_port",
    "rendezvous_key",
    "uninstall_gloo_compat",
]
