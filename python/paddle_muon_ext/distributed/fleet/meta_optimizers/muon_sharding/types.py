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
"""The small facts the Muon sharding modules share, each written down once.

Dtype sizes and spellings, develop's colour rules (what ``param.color`` means,
which colours are never reduced from a backward hook), the overlap rule, the
step plan's route / trigger / phase names and develop's 256 MB buffer default.
A leaf: it imports nothing from this package and no paddle, so the optimizer,
the layout, the partitioner and the offline tools all read the same table.
"""

from __future__ import annotations

import functools
import operator
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, Hashable, Tuple

__all__ = [
    "FLOAT_DTYPE_SIZES",
    "HashedTuple",
    "IdentityMemo",
    "NON_FLOAT_DTYPE_SIZES",
    "DTYPE_ALIASES",
    "canonical_dtype",
    "canonical_float_dtype",
    "dtype_itemsize",
    "itemsize",
    "DEFAULT_COLOUR",
    "DEFAULT_RAW_COLOUR",
    "NO_HOOK_COLOURS",
    "ParsedColour",
    "parse_colour",
    "is_hooked",
    "is_trainable",
    "STAGED_API",
    "DEVELOP_DEFAULT_BUFFER_MB",
    "DEFAULT_ALIGNMENT_BYTES",
    "ROUTE_FLAT",
    "ROUTE_HIERARCHICAL",
    "ROUTE_INTRA_NODE",
    "ROUTE_CROSS_NODE",
    "ROUTE_SLICES",
    "ROUTE_CLIP",
    "ROUTE_LOCAL",
    "TRIGGER_BACKWARD",
    "TRIGGER_REDUCE",
    "TRIGGER_STEP",
    "TRIGGER_SYNC",
    "PHASE_REDUCE_SCATTER",
    "PHASE_ALL_GATHER",
    "PHASE_INTRA_NODE_REDUCE",
    "PHASE_CROSS_NODE_REDUCE",
    "PHASE_CROSS_NODE_BROADCAST",
    "PHASE_CLIP",
    "PHASE_UPDATE",
    "COLLECTIVE_OPS",
    "PHASE_INTRA_NODE_BROADCAST",
]

# ------------------------------------------------------------------ dtypes
# Bytes per element of the float dtypes a Muon matrix (or a fused buffer) may hold.
FLOAT_DTYPE_SIZES: Dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
# The other dtypes Paddle's fusion helper knows (element-wise parameters only).
NON_FLOAT_DTYPE_SIZES: Dict[str, int] = {
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
# Short spellings users and model files write.
DTYPE_ALIASES: Dict[str, str] = {
    "fp64": "float64",
    "double": "float64",
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}
_DTYPE_PREFIXES = ("paddle.", "vartype.", "datatype.")


def canonical_dtype(dtype: Any) -> str:
    """The dtype's name: ``paddle.float32`` / ``"paddle.bfloat16"`` / ``"fp32"`` -> ``"float32"``.

    Args:
        dtype: a Paddle dtype or a name (any case, ``paddle.`` prefix and the
            short aliases accepted).

    Returns:
        str: the canonical name; an unknown name comes back lower-cased and
        unprefixed (:func:`itemsize` refuses it where a size is needed).
    """
    if type(dtype) is str and (dtype in FLOAT_DTYPE_SIZES or dtype in NON_FLOAT_DTYPE_SIZES):
        return dtype
    text = str(dtype).strip().lower()
    for prefix in _DTYPE_PREFIXES:
        if text.startswith(prefix):
            text = text[len(prefix):]
    return DTYPE_ALIASES.get(text, text)


def canonical_float_dtype(dtype: Any) -> str:
    """:func:`canonical_dtype` of a Muon matrix's dtype; refuses any other.

    Raises:
        ValueError: not one of :data:`FLOAT_DTYPE_SIZES` (naming the dtype).
    """
    text = canonical_dtype(dtype)
    if text not in FLOAT_DTYPE_SIZES:
        raise ValueError(
            f"unsupported dtype {dtype!r} for a Muon matrix; "
            f"expected one of {sorted(FLOAT_DTYPE_SIZES)}"
        )
    return text


def dtype_itemsize(dtype: Any) -> int:
    """Bytes per element of a float ``dtype`` (a name such as ``"bfloat16"``).

    Raises:
        ValueError: not a float dtype a Muon matrix may have.
    """
    return FLOAT_DTYPE_SIZES[canonical_float_dtype(dtype)]


@functools.lru_cache(maxsize=None)
def itemsize(dtype: Any) -> int:
    """Bytes per element of any dtype a fused buffer may hold (floats, ints, bool).

    Raises:
        ValueError: an unknown dtype, named, with the known ones: a guessed
            size would misplace every later parameter of its buffer.
    """
    text = canonical_dtype(dtype)
    size = FLOAT_DTYPE_SIZES.get(text, NON_FLOAT_DTYPE_SIZES.get(text))
    if size is None:
        raise ValueError(
            f"unknown dtype {dtype!r}: its element size is not known; use one of "
            f"{sorted(FLOAT_DTYPE_SIZES) + sorted(NON_FLOAT_DTYPE_SIZES)}"
        )
    return size


# ----------------------------------------------------------------- colours
#: The colour key of the default sharding group.
DEFAULT_COLOUR = None
#: develop's raw colour of the default group (keys ``_color_to_comm_buffer_list``).
DEFAULT_RAW_COLOUR = -1
#: Colours whose gradients are never reduced from overlap hooks (develop's
#: shared MTP weights: complete only after the pipeline's shared-weight sync).
NO_HOOK_COLOURS: Tuple[str, ...] = ("dense_weight_no_hook", "moe_weight_no_hook")


def _is_default_raw(value: Any) -> bool:
    # develop's default colour: None or the int -1 (a string "-1" is a colour).
    return value is None or (isinstance(value, int) and value == DEFAULT_RAW_COLOUR)


@dataclass(frozen=True)
class ParsedColour:
    """What a ``param.color`` value means, by develop's rules.

    Attributes:
        key: the colour key (:data:`DEFAULT_COLOUR` for the default group).
        group: a dict colour's ``'group'`` (the ``default_group`` given to
            :func:`parse_colour` when the dict has none); None otherwise.
        from_dict: the value was develop's dict form ``{'color', 'group'}``.
        declared: a dict's ``'color'`` as written (None when absent), else the
            value itself -- what develop's ``_buffer_color`` reports for a dict.
    """

    key: Hashable
    group: Any
    from_dict: bool
    declared: Any


def parse_colour(value: Any, default_group: Any = None) -> ParsedColour:
    """Read a ``param.color`` value: absent/None/-1, a dict, or (develop's buffers) a bare key.

    Args:
        value: ``getattr(param, "color", None)``.
        default_group: the group of a dict colour without ``'group'``.

    Returns:
        ParsedColour: a dict without ``'color'`` or with -1/None, and None/-1
        themselves, are the default colour; anything else is its own key.
    """
    if isinstance(value, dict):
        declared = value.get("color")
        key = DEFAULT_COLOUR if _is_default_raw(value.get("color", DEFAULT_RAW_COLOUR)) \
            else declared
        return ParsedColour(key, value.get("group", default_group), True, declared)
    key = DEFAULT_COLOUR if _is_default_raw(value) else value
    return ParsedColour(key, None, False, value)


def is_hooked(comm_overlap: bool, colour: Hashable) -> bool:
    """Whether a buffer of ``colour`` is reduced from the backward hooks.

    The overlap rule: ``comm_overlap`` on and the colour not a no-hook
    (shared) colour; fused buffers are a further condition of Muon buckets.
    """
    return bool(comm_overlap) and colour not in NO_HOOK_COLOURS


def is_trainable(param: Any) -> bool:
    """A parameter the optimizer reduces and updates.

    A zero-size parameter has nothing to reduce or update: it stays out of
    every buffer (an empty fused buffer reads as released) and keeps its value.
    """
    return not param.stop_gradient and 0 not in tuple(param.shape)


# ------------------------------------------------------------------ options
#: What the overlapped update needs from the inner optimizer (Muon's staged API).
STAGED_API: Tuple[str, ...] = ("apply_grad_clip", "prepare_optimize", "update_params",
                               "muon_group_key")
#: develop's ``comm_buffer_size_MB`` default, and the size its owner rule and
#: sync stages fall back to when ``comm_buffer_size_MB <= 0``.
DEVELOP_DEFAULT_BUFFER_MB = 256
#: Bytes FusedCommBuffer pads every parameter to (Paddle's tensor_fusion_helper
#: uses 256 for gpu/npu/xpu; a CPU registration uses the same).
DEFAULT_ALIGNMENT_BYTES = 256

# -------------------------------------------------------- step-plan names
# How a bucket is routed (MuonBucketSpec.route).
ROUTE_FLAT = "flat"
ROUTE_HIERARCHICAL = "hierarchical"
# How a phase reaches its group (StepPhase.route).
ROUTE_INTRA_NODE = "intra_node"
ROUTE_CROSS_NODE = "cross_node"
ROUTE_SLICES = "slices"
#: The global-norm clip's all-reduces: each item names its own group.
ROUTE_CLIP = "clip_groups"
#: A phase that issues no collective (waits, update, found_inf, ...).
ROUTE_LOCAL = "local"

#: When an op is issued: from a backward hook (overlap), by reduce_gradients, by step.
TRIGGER_BACKWARD = "backward"
TRIGGER_REDUCE = "reduce_gradients"
TRIGGER_STEP = "step"
TRIGGER_SYNC = "sync"

PHASE_REDUCE_SCATTER = "reduce_scatter"
PHASE_ALL_GATHER = "all_gather_slices"
PHASE_INTRA_NODE_REDUCE = "intra_node_reduce"
PHASE_CROSS_NODE_REDUCE = "cross_node_reduce"
PHASE_CROSS_NODE_BROADCAST = "cross_node_broadcast"
PHASE_INTRA_NODE_BROADCAST = "intra_node_broadcast"
#: The global-norm clip (its norm all-reduces over the sharding / pipe groups).
PHASE_CLIP = "clip_global_norm"
#: The update's label (profiler, flight recorder): ``optimizer_step[k]`` per stage.
PHASE_UPDATE = "optimizer_step"

# What a phase does (StepPhase.op): the collectives, then the local kinds.
OP_REDUCE_SCATTER = "reduce_scatter"
OP_REDUCE = "reduce"
OP_BROADCAST = "broadcast"
OP_ALL_GATHER = "all_gather"
OP_ALL_REDUCE = "all_reduce"
COLLECTIVE_OPS = (OP_REDUCE_SCATTER, OP_REDUCE, OP_BROADCAST, OP_ALL_GATHER, OP_ALL_REDUCE)
#: reduce_gradients: copy released 1-D gradients back into their buffers.
OP_COPY_GRADS_IN = "copy_grads_in"
#: reduce_gradients: wait for and scale what the backward hooks launched.
OP_WAIT_HOOKED = "wait_hooked"
#: step: give colours freed by clear_param_storage their storage back.
OP_RESET_STORAGE = "reset_storage"
#: step: link slice gradients and collect this rank's (param, grad) pairs.
OP_COLLECT_GRADS = "collect_grads"
#: step: skip the update when AMP found inf/nan.
OP_FOUND_INF = "found_inf"
#: step: the global-norm clip (collective: its all-reduces).
OP_CLIP = OP_ALL_REDUCE
#: step: the whole update (plain) / Muon's prepare_optimize (staged).
OP_UPDATE = "update"
OP_PREPARE = "prepare"
#: step: stage k's update (staged sync), before stage k's sync phases.
OP_STAGE_UPDATE = "stage_update"
#: step: wait for every launched stage sync (staged) / unpack received buffers.
OP_FINISH_SYNC = "finish_sync"
#: step: move fresh optimizer states into the fused buffers.
OP_FUSE_STATES = "fuse_states"


class HashedTuple(tuple):
    """A tuple that hashes its items once.

    ``lru_cache`` hashes every argument on every call; a plan of 100,000
    matrices passes the same 100,000-item tuple of parameters to the
    placement caches once per path (20 paths under ``plan --recommend``),
    and hashing it item by item each time was a second of the run. Equal to
    (and hashing as) the plain tuple of the same items, so cache entries
    are shared with callers that pass plain tuples. Its items must be
    immutable (frozen dataclasses, ints, strings).
    """

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = tuple.__hash__(self)
        return h


class IdentityMemo:
    """Results keyed by the identity of the objects they were computed from.

    The paths ``plan --recommend`` builds share one owner map per rule and
    one parameter tuple, so work on them is looked up by ``id``; each
    entry holds its objects (their ids stay unique while it lives) and an
    optional hashable ``extra`` compared by value. Oldest first out past
    ``maxsize``.
    """

    MISSING = object()

    def __init__(self, maxsize: int) -> None:
        self._entries: OrderedDict = OrderedDict()
        self._maxsize = maxsize

    def get(self, objs: tuple, extra: Hashable = ()):
        """The stored result, or ``IdentityMemo.MISSING``."""
        hit = self._entries.get((tuple(map(id, objs)), extra))
        if hit is not None and all(map(operator.is_, hit[0], objs)):
            return hit[1]
        return self.MISSING

    def put(self, objs: tuple, value, extra: Hashable = ()) -> None:
        if len(self._entries) >= self._maxsize:
            self._entries.popitem(last=False)
        self._entries[(tuple(map(id, objs)), extra)] = (objs, value)
