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
"""What the checkpoint modules share: the errors, argument checks, the exchange.

* the errors users catch (:class:`CheckpointSaveError`,
  :class:`CheckpointCorruptError`, :class:`CheckpointMismatchError`,
  :class:`CheckpointLoadError`; users import them from ``muon_checkpoint``);
* one-line checks of the arguments every rank reports before any rank raises;
* :func:`ranks_of` / :func:`gather`: the one exchange between ranks that
  saving and loading use, looked up at call time through this module (tests
  run ranks as threads by replacing these two);
* message helpers, so that every rank spells a problem the same way.

A leaf among the checkpoint modules: it imports none of them.
"""

from __future__ import annotations

import numbers
import os
from typing import Any

import paddle
import paddle.distributed as dist
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

__all__ = [
    "CheckpointCorruptError",
    "CheckpointLoadError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "DEFAULT_TIMEOUT_S",
    "LISTED",
    "check_values",
    "data_file",
    "gather",
    "id_problem",
    "is_id",
    "layout_summary",
    "listed",
    "one_line",
    "path_problem",
    "per_rank",
    "ranks_of",
]

#: How many names a message lists before "... and N more".
LISTED = 8
#: Seconds without a heartbeat after which a rank of a save or a load counts as dead.
DEFAULT_TIMEOUT_S = 20.0


class CheckpointMismatchError(ValueError):
    """The checkpoint does not describe the state dict being loaded."""


class CheckpointCorruptError(ValueError):
    """A checkpoint file is missing, truncated or altered; nothing was loaded."""


class CheckpointSaveError(RuntimeError):
    """A save failed on some rank; nothing was committed."""


class CheckpointLoadError(RuntimeError):
    """Paddle's load failed on some rank after every check passed; raised on every rank."""


# Communication, looked up at call time (tests run ranks as threads).
def ranks_of(process_group) -> tuple[int, list[int]]:
    if process_group is not None:
        ranks = getattr(process_group, "ranks", None)
        if not isinstance(ranks, (list, tuple)) or not ranks:
            raise TypeError(f"process_group={process_group!r}: must be a "
                            "paddle.distributed Group (e.g. dist.new_group(...)) or None "
                            "(every rank)")
        return dist.get_rank(), list(ranks)
    return dist.get_rank(), list(range(max(dist.get_world_size(), 1)))


def gather(obj: Any, process_group, ranks: list[int]) -> list:
    if len(ranks) == 1:
        return [obj]
    out: list = []
    dist.all_gather_object(out, obj, process_group)
    return out


def is_id(value: Any) -> bool:
    # numpy integers count (a step counter); bools do not, although they are
    # ints (numpy's bool_ is no Integral)
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def id_problem(unique_id: Any) -> str | None:
    if unique_id is None or is_id(unique_id):
        return None
    return (f"unique_id={unique_id!r}: must be a non-negative int (e.g. the step) or None "
            "(the newest)")


def path_problem(path: Any) -> str | None:
    if isinstance(path, (str, os.PathLike)) and os.fspath(path) not in ("", b""):
        return None
    return f"path={path!r}: must be a directory path (a non-empty str or os.PathLike)"


def per_rank(lines: list[tuple[int, str]]) -> str:
    """One message for every rank: the message itself when all ranks agree."""
    if len({m for _, m in lines}) == 1:
        rank_list = [r for r, _ in lines]
        return lines[0][1] if len(rank_list) == 1 else f"{lines[0][1]} (ranks {rank_list})"
    return "; ".join(f"rank {r}: {m}" for r, m in lines)


def one_line(exc: BaseException, limit: int = 300) -> str:
    """A backend's error text as one bounded line (gloo's can span many)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + " ..."


def check_values(state_dict: dict) -> None:
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    for key, value in state_dict.items():
        if not isinstance(key, str):
            raise TypeError(f"state_dict key {key!r} is a {type(key).__name__}; keys are str")
        if isinstance(value, dict):
            check_values(value)
        elif not isinstance(value, (paddle.Tensor, ShardedWeight)):
            raise TypeError(f"state_dict[{key!r}] is a {type(value).__name__}; save "
                            "Tensors or ShardedWeights (sharded_state_dict())")
        elif isinstance(value, ShardedWeight):
            problem = _sharded_weight_problem(value)
            if problem:
                raise ValueError(f"state_dict[{key!r}]: {problem}")


def _sharded_weight_problem(sw: ShardedWeight) -> str | None:
    """Why ``sw`` does not describe a piece of its global tensor, or None.

    flex_checkpoint saves what it is given: a local tensor of another size
    than its ``local_shape``, or a piece reaching past the global shape,
    makes a checkpoint that loads wrong values (a hand-written
    ``sharded_state_dict()``, e.g. expert offsets). A tensor stored 2-D and
    described 3-D is fine: the element counts are compared, not the shapes.
    """
    local, glob, offset = (tuple(sw.local_shape), tuple(sw.global_shape),
                           tuple(sw.global_offset))
    if not (len(local) == len(glob) == len(offset)):
        return (f"local_shape {list(local)}, global_shape {list(glob)} and global_offset "
                f"{list(offset)} must have one entry per dimension")
    for dim, (o, n, g) in enumerate(zip(offset, local, glob)):
        if o < 0 or n < 0 or o + n > g:
            return (f"dimension {dim}: offset {o} + local size {n} lies outside the global "
                    f"size {g} (global_offset {list(offset)}, local_shape {list(local)}, "
                    f"global_shape {list(glob)})")
    count = 1
    for n in local:
        count *= int(n)
    held = 1
    for n in sw.local_tensor.shape:
        held *= int(n)
    if sw.is_flattened:
        span = sw.flattened_range
        if span is None or not 0 <= span.start <= span.stop <= count:
            return f"flattened_range {span} must lie within the {count} local elements"
        if held != span.stop - span.start:
            return (f"the local tensor holds {held} elements, flattened_range {span} "
                    f"names {span.stop - span.start}")
    elif held != count:
        return (f"the local tensor holds {held} elements (shape {list(sw.local_tensor.shape)}), "
                f"local_shape {list(local)} names {count}")
    return None


def listed(keys) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - LISTED} more" if len(keys) > LISTED else ""
    return ", ".join(keys[:LISTED]) + more


def layout_summary(metadata) -> dict:
    summary = {}
    for key, entries in sorted(metadata.state_dict_metadata.items()):
        first = entries[0]
        summary[key] = {"global_shape": list(first.global_shape or first.local_shape),
                        "dtype": str(first.dtype)}
    return summary


def data_file(rank: int, unique_id: int) -> str:
    return f"{rank}_{unique_id}.distcp"
