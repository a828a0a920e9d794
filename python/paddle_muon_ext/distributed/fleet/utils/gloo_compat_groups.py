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
"""The gloo layer's view of process groups, and gloo sub-groups that work.

Part of the gloo layer (see ``gloo_compat``, which installs it):

* :func:`is_gloo_group` / :func:`resolve_group`: every wrapper asks per call
  whether the group it is given is backed by ``ProcessGroupGloo``, so NCCL
  and other groups pass through untouched;
* sub-groups: in paddle 3.3.1 gloo sub-groups of >= 3 ranks created on the
  default TCPStore fail, so every gloo sub-group gets its own
  ``core.TCPStore`` on a port the OS picked (:func:`create_subgroup_store`,
  published under :func:`rendezvous_key`; ``gloo_compat``'s docstring has
  the full story);
* :func:`bind_call`: a call's arguments by name, for the wrappers.
"""

from __future__ import annotations

import inspect
import os
import socket
from collections.abc import Callable
from contextlib import closing
from typing import Any

import paddle.distributed as dist
from paddle.base import core

from .env_util import env_positive

__all__ = [
    "STORE_TIMEOUT_ENV",
    "bind_call",
    "create_subgroup_store",
    "is_gloo_group",
    "make_new_pg_impl",
    "pick_free_port",
    "rendezvous_key",
    "resolve_group",
]

#: TCPStore timeout (seconds) for sub-group stores.
STORE_TIMEOUT_ENV = "GLOO_COMPAT_STORE_TIMEOUT"
# Keep sub-group stores alive for the life of the process (the gloo context
# talks to them during rendezvous; dropping them early is asking for trouble).
_stores: dict[int, Any] = {}


def resolve_group(group: Any) -> Any:
    if group is None:
        return dist.collective._get_global_group()
    return group


def is_gloo_group(group: Any) -> bool:
    """Whether ``group`` (None = global) is backed by ``ProcessGroupGloo``.

    Checked per call so a mixed world (or NCCL) is never touched.
    """
    try:
        g = resolve_group(group)
    except Exception:
        return False
    pg = getattr(g, "process_group", None)
    return isinstance(pg, core.ProcessGroupGloo)


def bind_call(sig: inspect.Signature, args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


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
    return env_positive(STORE_TIMEOUT_ENV, 300, int)


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


def make_new_pg_impl(original: Callable[..., Any]) -> Callable[..., Any]:
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
