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
"""Validated environment variables: one parser, one message.

A leaf module (standard library only) that the gloo layer
(``fleet/utils/gloo_compat*``) and the Muon flight recorder
(``fleet/meta_optimizers/muon_flight/recorder``) share, so that a bad value
of any of their variables is refused the same way: one line naming the
variable, the value and what is accepted, instead of a silent fallback (a
NaN timeout would never fire) or a traceback from ``int()``.
"""

from __future__ import annotations

import math
import os

__all__ = ["env_positive"]

_KIND_WORDS = {int: "integer", float: "finite number"}


def env_positive(name: str, default: int | float, kind: type = int,
                 unset_means: str | None = None) -> int | float:
    """``os.environ[name]`` as a positive ``kind`` (``int`` or ``float``).

    Unset or blank: ``default`` (as given, e.g. 0 for "off"). Otherwise the
    value must parse as ``kind`` and be > 0 and finite.

    Args:
        name (str): the variable.
        default (int|float): returned when the variable is unset or blank.
        kind (type): ``int`` (``"1e3"`` and ``"2.5"`` are refused) or ``float``.
        unset_means (str|None): what unsetting it does, for the message
            (default: ``"the default <default>"``).

    Returns:
        int|float: the value.

    Raises:
        ValueError: one line, e.g. ``PADDLE_MUON_FLIGHT_TIMEOUT='nan': must be a
            positive finite number; unset it for the default 600.0``.
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    # not (value > 0): NaN compares false; inf would never time out
    if value is None or not (value > 0 and math.isfinite(value)):
        raise ValueError(
            f"{name}={raw!r}: must be a positive {_KIND_WORDS.get(kind, kind.__name__)}; "
            f"unset it for {unset_means or f'the default {default}'}"
        )
    return value
