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
"""Package notices once per job, not once per rank and construction.

Every rank of a job runs the same code, so a notice logged where it is found
appears once per rank (and again each time an optimizer is built, e.g. on a
resume). :func:`log_once_per_job` logs it at its level on global rank 0 the
first time this process sees it, and at debug otherwise: one line per job
start in the logs, every occurrence still there at debug level.
"""

from __future__ import annotations

from typing import Any

import paddle.distributed as dist
from paddle.distributed.fleet.utils.log_util import logger

__all__ = ["log_once_per_job"]

_SEEN: set = set()


def log_once_per_job(level: str, key: str, message: str, *args: Any) -> bool:
    """Log ``message % args`` at ``level`` once per job, else at debug.

    Args:
        level: ``"info"`` or ``"warning"``: the level on global rank 0 the
            first time ``key`` is seen in this process.
        key: what makes two notices the same (e.g. the notice's name, plus
            the values it prints where another value is news).
        message: the ``logger`` format string; ``args`` its values.

    Returns:
        bool: whether it was logged at ``level``.
    """
    # get_rank() reads the launcher's PADDLE_TRAINER_ID before fleet.init too;
    # only rank 0 marks a key seen (a process may simulate several ranks)
    loud = dist.get_rank() == 0 and key not in _SEEN
    if loud:
        _SEEN.add(key)
    getattr(logger, level if loud else "debug")(message, *args)
    return loud
