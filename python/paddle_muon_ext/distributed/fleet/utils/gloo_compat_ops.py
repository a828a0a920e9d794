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
"""The gloo layer's wrappers of the ops gloo lacks or gets wrong.

Part of the gloo layer (see ``gloo_compat``, which installs them; items 2-5
of its docstring): ``use_calc_stream=True`` becomes the plain synchronous
op, ``reduce_scatter`` an ``all_reduce`` of a copy plus this rank's slice,
``ReduceOp.AVG`` a pre-scale by 1/n and SUM, and a non-root ``reduce``
buffer keeps its input as under NCCL. Every wrapper checks the group it is
given and passes non-gloo groups through unchanged.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import paddle
import paddle.distributed as dist

from .gloo_compat_groups import bind_call, is_gloo_group, resolve_group

# installed by gloo_compat.install_gloo_compat
__all__ = [
    "emulated_reduce_scatter",
    "nonroot_keeps_input",
    "reduce_scatter_compat",
    "stream_avg_prescale",
    "stream_generic",
    "top_all_reduce",
]


def _is_avg(op: Any) -> bool:
    return op == dist.ReduceOp.AVG


def _scale_inplace(t: paddle.Tensor, factor: float) -> None:
    with paddle.no_grad():
        t.scale_(factor)


def emulated_reduce_scatter(
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
    g = resolve_group(group)
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


def stream_generic(original: Callable[..., Any]) -> Callable[..., Any]:
    """use_calc_stream=True -> plain sync op, for gloo groups only."""
    sig = inspect.signature(original)

    def compat(*args: Any, **kwargs: Any) -> Any:
        a = bind_call(sig, args, kwargs)
        if a.get("use_calc_stream") and is_gloo_group(a.get("group")):
            a["use_calc_stream"] = False
            a["sync_op"] = True
        return original(**a)

    compat.__wrapped__ = original  # type: ignore[attr-defined]
    compat.__name__ = getattr(original, "__name__", "stream_op")
    return compat


def stream_avg_prescale(original: Callable[..., Any]) -> Callable[..., Any]:
    """stream.all_reduce / stream.reduce: calc-stream mapping + AVG emulation."""
    sig = inspect.signature(original)

    def compat(*args: Any, **kwargs: Any) -> Any:
        a = bind_call(sig, args, kwargs)
        if is_gloo_group(a.get("group")):
            if a.get("use_calc_stream"):
                a["use_calc_stream"] = False
                a["sync_op"] = True
            if _is_avg(a.get("op")):
                _scale_inplace(a["tensor"], 1.0 / resolve_group(a.get("group")).nranks)
                a["op"] = dist.ReduceOp.SUM
        return original(**a)

    compat.__wrapped__ = original  # type: ignore[attr-defined]
    compat.__name__ = getattr(original, "__name__", "stream_op")
    return compat


def nonroot_keeps_input(original: Callable[..., Any]) -> Callable[..., Any]:
    """stream.reduce on gloo: non-root buffers end as they began (NCCL's semantics)."""
    sig = inspect.signature(original)

    def compat(*args: Any, **kwargs: Any) -> Any:
        a = bind_call(sig, args, kwargs)
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


def reduce_scatter_compat(original: Callable[..., Any], get_all_reduce: Callable[[], Any],
                           out_arg: str, in_arg: str):
    """A reduce_scatter entry point whose gloo groups use the emulation.

    The three entry points (``stream.reduce_scatter``, ``_reduce_scatter_base``
    and ``dist.reduce_scatter``) differ only in their argument names.
    """
    sig = inspect.signature(original)

    def compat(*args: Any, **kwargs: Any) -> Any:
        a = bind_call(sig, args, kwargs)
        if not is_gloo_group(a.get("group")):
            return original(**a)
        return emulated_reduce_scatter(
            a[out_arg], a[in_arg], a.get("op"), a.get("group"), get_all_reduce()
        )

    compat.__wrapped__ = original  # type: ignore[attr-defined]
    return compat


def top_all_reduce(original: Callable[..., Any], get_stream_all_reduce: Callable[[], Any]):
    """dist.all_reduce: on the CPU wheel AVG crashes on core.nccl_version."""
    sig = inspect.signature(original)

    def compat(*args: Any, **kwargs: Any) -> Any:
        a = bind_call(sig, args, kwargs)
        if not is_gloo_group(a.get("group")):
            return original(**a)
        return get_stream_all_reduce()(
            a["tensor"], op=a["op"], group=a.get("group"), sync_op=a["sync_op"], use_calc_stream=False
        )

    compat.__wrapped__ = original  # type: ignore[attr-defined]
    return compat
