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
"""The gloo layer's all-to-all: two all_gathers instead of a missing op.

Part of the gloo layer (see ``gloo_compat``, which installs it; item 6 of
its docstring). Replaces Paddle's ``_*all_to_all*_in_dygraph`` helpers for
gloo groups only, so Paddle's own argument checks still run first.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import paddle

from .gloo_compat_groups import bind_call, is_gloo_group

# installed by gloo_compat.install_gloo_compat
__all__ = [
    "a2a_dygraph_compat",
    "emulated_all_to_all_list",
    "emulated_all_to_all_single",
    "emulated_all_to_all_tensor",
]

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


def emulated_all_to_all_list(
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


def emulated_all_to_all_single(
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


def a2a_dygraph_compat(original: Callable[..., Any], emulation: Callable[..., Any]):
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
        *tensors, group, _sync_op, _use_calc_stream = bind_call(sig, args, kwargs).values()
        if not is_gloo_group(group):
            return original(*args, **kwargs)
        return emulation(*tensors, group)

    compat.__wrapped__ = original  # type: ignore[attr-defined]
    compat.__name__ = getattr(original, "__name__", "all_to_all")
    return compat


def emulated_all_to_all_tensor(out_tensor: paddle.Tensor, in_tensor: paddle.Tensor,
                                group: Any) -> Any:
    return emulated_all_to_all_single(out_tensor, in_tensor, None, None, group, "alltoall")
