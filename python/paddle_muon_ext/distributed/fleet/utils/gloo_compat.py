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

Where it lives: this module (detection, install / uninstall, the public
names); ``gloo_compat_groups`` (which groups are gloo, sub-group stores),
``gloo_compat_ops`` (items 2-5), ``gloo_compat_alltoall`` (item 6), and
``env_util`` for its environment variables.

Emulated-node helper: the launcher overwrites ``PADDLE_LOCAL_SIZE`` with
``--nproc_per_node``, so a test that wants "4 nodes x 2 cards" on one box
passes ``GLOO_COMPAT_LOCAL_SIZE=2``; :func:`apply_emulated_local_size` (called
by :func:`install_gloo_compat`) copies it into ``PADDLE_LOCAL_SIZE``.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
from typing import Any

import paddle
import paddle.distributed as dist

from .env_util import env_positive
from .gloo_compat_alltoall import (
    a2a_dygraph_compat,
    emulated_all_to_all_list,
    emulated_all_to_all_single,
    emulated_all_to_all_tensor,
)
from .gloo_compat_groups import (
    STORE_TIMEOUT_ENV,
    make_new_pg_impl,
    create_subgroup_store,
    is_gloo_group,
    pick_free_port,
    rendezvous_key,
)
from .gloo_compat_ops import (
    nonroot_keeps_input,
    reduce_scatter_compat,
    stream_avg_prescale,
    stream_generic,
    top_all_reduce,
)

#: Env var honoured by :func:`apply_emulated_local_size`.
EMULATED_LOCAL_SIZE_ENV = "GLOO_COMPAT_LOCAL_SIZE"
#: Force the compat layer on ("1") or off ("0"); unset = auto-detect.
FORCE_ENV = "GLOO_COMPAT"

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
    value = env_positive(EMULATED_LOCAL_SIZE_ENV, 0, int,
                         unset_means="cards per node from the launcher")
    if _saved_local_size is None:
        _saved_local_size = (
            "PADDLE_LOCAL_SIZE" in os.environ,
            os.environ.get("PADDLE_LOCAL_SIZE"),
        )
    os.environ["PADDLE_LOCAL_SIZE"] = str(value)
    return value


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

        _patch(collective, "_new_process_group_impl", make_new_pg_impl(collective._new_process_group_impl))

        for name in ("all_gather", "alltoall", "alltoall_single", "broadcast", "gather", "recv", "scatter", "send"):
            fn = getattr(stream, name, None)
            if fn is not None and "use_calc_stream" in inspect.signature(fn).parameters:
                _patch(stream, name, stream_generic(fn))
        _patch(stream, "all_reduce", stream_avg_prescale(stream.all_reduce))
        _patch(stream, "reduce", nonroot_keeps_input(stream_avg_prescale(stream.reduce)))
        compat_rs = reduce_scatter_compat(stream.reduce_scatter, get_orig_stream_all_reduce,
                                           "tensor", "tensor_or_tensor_list")
        _patch(stream, "reduce_scatter", compat_rs)
        compat_rs_base = reduce_scatter_compat(stream_rs_mod._reduce_scatter_base,
                                                get_orig_stream_all_reduce, "out_tensor", "in_tensor")
        _patch(stream_rs_mod, "_reduce_scatter_base", compat_rs_base)
        if hasattr(rs_mod, "_reduce_scatter_base_stream"):
            _patch(rs_mod, "_reduce_scatter_base_stream", compat_rs_base)
        # all-to-all: dist.alltoall(_single) call stream.alltoall(_single),
        # which call these helpers by module-global name.
        a2a_mod = sys.modules["paddle.distributed.communication.stream.all_to_all"]
        for name, emulation in (("_all_to_all_in_dygraph", emulated_all_to_all_list),
                                ("_all_to_all_tensor_in_dygraph", emulated_all_to_all_tensor),
                                ("_alltoall_single_in_dygraph", emulated_all_to_all_single)):
            if hasattr(a2a_mod, name):  # absent in a Paddle that reorganised them: stay native
                _patch(a2a_mod, name, a2a_dygraph_compat(getattr(a2a_mod, name), emulation))

        top_ar = top_all_reduce(dist.all_reduce, get_compat_stream_all_reduce)
        top_rs = reduce_scatter_compat(dist.reduce_scatter, get_orig_stream_all_reduce,
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
    "STORE_TIMEOUT_ENV",
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
