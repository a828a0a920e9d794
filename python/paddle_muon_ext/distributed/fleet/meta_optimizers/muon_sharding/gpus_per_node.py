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
"""How many accelerator cards each node has, for ``comm_group_call_opt``.

Split from ``muon_comm_plan`` (which re-exports these names): the plan is
plain data, this module reads the environment (``PADDLE_LOCAL_SIZE``) and,
only when asked, the visible device count. Importing it touches no CUDA.
"""

from __future__ import annotations

import numbers
import os
import re
from collections.abc import Callable, Mapping

__all__ = ["LOCAL_SIZE_ENV", "resolve_gpus_per_node"]

#: Environment variable set by ``paddle.distributed.launch`` (cards per node).
LOCAL_SIZE_ENV = "PADDLE_LOCAL_SIZE"

_INT_TEXT = re.compile(r"[+-]?[0-9]+")


# --------------------------------------------------------------------------
# GPUs per node
# --------------------------------------------------------------------------
def _default_device_count() -> int:
    """Count visible CUDA devices; 0 when paddle has no CUDA support.

    Returns:
        int: ``paddle.device.cuda.device_count()``, or 0 on a build without
        CUDA. On a CUDA build a failing query raises (a broken CUDA install
        must not read as "no accelerator").
    """
    import paddle  # lazy: importing this module must not touch CUDA

    try:
        return int(paddle.device.cuda.device_count())
    except Exception:
        if not paddle.is_compiled_with_cuda():
            return 0  # CPU/XPU builds: there is no CUDA runtime to ask
        raise


def resolve_gpus_per_node(
    environ: Mapping[str, str] | None = None,
    device_count: Callable[[], int] | None = None,
) -> int:
    """Resolve how many accelerator cards each node has.

    Call this only when ``comm_group_call_opt`` is on: with the option off
    nothing needs the value (upstream resolved it unconditionally and crashed
    on CPU/XPU machines without a launcher).

    Args:
        environ: the environment to read; ``os.environ`` (read at call time)
            when None.
        device_count: a callable returning the number of visible accelerators,
            used when ``PADDLE_LOCAL_SIZE`` is unset; defaults to
            ``paddle.device.cuda.device_count`` (imported lazily).

    Returns:
        int: the number of cards per node (> 0). Whether the value is usable
        for the hierarchical path (>= 2) is checked by
        :class:`HierarchicalCommPlan`.

    Raises:
        ValueError: ``PADDLE_LOCAL_SIZE`` is set but not a positive integer, or
            it is unset and no accelerator is visible, or the device query
            failed (the query's exception is the ``__cause__``).
        TypeError: ``device_count`` returned something that is not an integer.
    """
    env = os.environ if environ is None else environ
    raw = env.get(LOCAL_SIZE_ENV)
    if raw is not None:
        text = str(raw).strip()
        if _INT_TEXT.fullmatch(text) is None:
            raise ValueError(
                f"{LOCAL_SIZE_ENV}={raw!r} is not an integer; it must be the "
                "number of GPUs per node as a positive integer (e.g. "
                f"{LOCAL_SIZE_ENV}=8; paddle.distributed.launch sets it to "
                "--nproc_per_node)."
            )
        value = int(text)
        if value <= 0:
            raise ValueError(
                f"{LOCAL_SIZE_ENV}={raw!r} must be a positive integer number of "
                f"GPUs per node (got {value}); set e.g. {LOCAL_SIZE_ENV}=8 or "
                "unset it to use the visible device count."
            )
        return value

    counter = _default_device_count if device_count is None else device_count
    try:
        count = counter()
    except Exception as error:
        raise ValueError(
            f"cannot determine GPUs per node: {LOCAL_SIZE_ENV} is not set and "
            f"querying the visible devices failed ({type(error).__name__}: "
            f"{error}). Fix the accelerator runtime, set {LOCAL_SIZE_ENV} to the "
            "number of cards per node, or turn comm_group_call_opt off."
        ) from error
    if isinstance(count, bool) or not isinstance(count, numbers.Integral):
        raise TypeError(
            "device_count() must return an int number of visible accelerators, "
            f"got {count!r} ({type(count).__name__})."
        )
    if count <= 0:
        raise ValueError(
            f"cannot determine GPUs per node: {LOCAL_SIZE_ENV} is not set and "
            f"no accelerator is visible (device_count() = {int(count)}). Launch "
            f"with paddle.distributed.launch, set {LOCAL_SIZE_ENV} to the number "
            "of cards per node, or turn comm_group_call_opt off."
        )
    return int(count)
