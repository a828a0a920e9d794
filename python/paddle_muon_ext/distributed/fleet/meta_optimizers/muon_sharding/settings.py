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
"""The Muon sharding options (the table develop's proto may lack), dtype sizes, and
``ShardingSettings``: the options resolved once from fleet's strategy and checked. No paddle
import at module level: the tools load it before paddle, the exporter on its own.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

__all__ = ["ShardingOption", "SHARDING_OPTIONS", "PARTITION_DEVELOP", "PARTITION_BALANCED",
           "PARTITION_RAIL", "PARTITION_STRATEGIES", "option", "option_default",
           "check_option_value", "set_kept_options_reader", "ShardingSettings",
           "ShardingAssertionError", "ShardingTypeError", "SHARDING_CONFIG_FIELDS",
           "OVERLAP_SYNC_ENV", "read_overlap_optimize_and_sync"]

# ------------------------------------------------------------------ dtypes
# Bytes per element of the float dtypes a Muon matrix (or a fused buffer) may hold.
FLOAT_DTYPE_SIZES: Dict[str, int] = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2,
                                     "float8_e4m3fn": 1, "float8_e5m2": 1}
# The other dtypes Paddle's fusion helper knows (element-wise parameters only).
NON_FLOAT_DTYPE_SIZES: Dict[str, int] = {"int64": 8, "int32": 4, "int16": 2, "int8": 1,
                                         "uint8": 1, "bool": 1}
DTYPE_ALIASES: Dict[str, str] = {"fp64": "float64", "double": "float64", "fp32": "float32",
                                 "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                                 "half": "float16"}
_DTYPE_PREFIXES = ("paddle.", "vartype.", "datatype.")


def canonical_dtype(dtype: Any) -> str:
    """The name of a dtype or dtype name, any case, prefixed or an alias (``"fp32"`` ->
    ``"float32"``); an unknown one lower-cased and unprefixed (:func:`itemsize` refuses it)."""
    if type(dtype) is str and (dtype in FLOAT_DTYPE_SIZES or dtype in NON_FLOAT_DTYPE_SIZES):
        return dtype
    text = str(dtype).strip().lower()
    for prefix in _DTYPE_PREFIXES:
        if text.startswith(prefix):
            text = text[len(prefix):]
    return DTYPE_ALIASES.get(text, text)


def canonical_float_dtype(dtype: Any) -> str:
    """:func:`canonical_dtype` of a Muon matrix's dtype; ValueError for a non-float one."""
    text = canonical_dtype(dtype)
    if text not in FLOAT_DTYPE_SIZES:
        raise ValueError(f"unsupported dtype {dtype!r} for a Muon matrix; "
                         f"expected one of {sorted(FLOAT_DTYPE_SIZES)}")
    return text


def dtype_itemsize(dtype: Any) -> int:
    """Bytes per element of a Muon matrix's (float) ``dtype``; ValueError for any other."""
    return FLOAT_DTYPE_SIZES[canonical_float_dtype(dtype)]


@functools.lru_cache(maxsize=None)
def itemsize(dtype: Any) -> int:
    """Bytes per element of any dtype a fused buffer may hold (floats, ints, bool);
    ValueError for an unknown one: a guessed size would misplace every later parameter."""
    text = canonical_dtype(dtype)
    size = FLOAT_DTYPE_SIZES.get(text, NON_FLOAT_DTYPE_SIZES.get(text))
    if size is None:
        raise ValueError(f"unknown dtype {dtype!r}: its element size is not known; use one of "
                         f"{sorted(FLOAT_DTYPE_SIZES) + sorted(NON_FLOAT_DTYPE_SIZES)}")
    return size


#: develop's ``comm_buffer_size_MB`` default; its owner rule and sync stages use it at <= 0.
DEVELOP_DEFAULT_BUFFER_MB = 256
#: Bytes FusedCommBuffer pads each parameter to (tensor_fusion_helper's gpu/npu/xpu value).
DEFAULT_ALIGNMENT_BYTES = 256

# ------------------------------------------------------------------ options
# Owner rules of muon_partition_strategy (see its entry below).
PARTITION_DEVELOP = "upstream_greedy"
PARTITION_BALANCED = "balanced"
PARTITION_RAIL = "rail"
PARTITION_STRATEGIES: Tuple[str, ...] = (PARTITION_DEVELOP, PARTITION_BALANCED, PARTITION_RAIL)


@dataclass(frozen=True)
class ShardingOption:
    """One strategy option.

    Attributes:
        name: field name (also the attribute users set).
        default: the value when unset -- develop's behaviour.
        proto_type: proto scalar type of the field (``bool`` / ``string``).
        doc: one line for users and for DistributedStrategy's docs.
        choices: allowed values of a string option (None: any of its type).
        message: proto message holding the field.
        config_key: where users set it (None: directly on the strategy).
        in_develop: develop's proto has the field (the exporter adds only the others).
    """

    name: str
    default: Any
    proto_type: str
    doc: str
    choices: Optional[Tuple[str, ...]] = None
    message: str = "DygraphShardingConfig"
    config_key: Optional[str] = "sharding_configs"
    in_develop: bool = False


SHARDING_OPTIONS: Tuple[ShardingOption, ...] = (
    ShardingOption("use_muon_sharding", False, "bool",
                   "build MuonShardingOptimizer instead of DygraphShardingOptimizer in "
                   "fleet.distributed_optimizer.",
                   message="DistributedStrategy", config_key=None, in_develop=True),
    ShardingOption("comm_group_call_opt", False, "bool",
                   "route Muon reduces/broadcasts hierarchically: inside the node, then "
                   "across nodes among same-card ranks.", in_develop=True),
    ShardingOption("machine_balanced_2d_partition", False, "bool",
                   "place Muon (whole-matrix) owners over the whole job so every machine "
                   "carries the same bytes (develop #79763).", in_develop=True),
    ShardingOption("muon_partition_strategy", PARTITION_DEVELOP, "string",
                   'owner rule for Muon (whole-matrix) parameters: "upstream_greedy" '
                   '(develop\'s rule), "balanced" (state bytes and Newton-Schulz cost balanced '
                   'over ranks; recommended) or "rail" (with comm_group_call_opt over >= 2 '
                   'nodes: bytes spread evenly over card rails, then nodes; elsewhere '
                   '"balanced").', choices=PARTITION_STRATEGIES),
    ShardingOption("overlap_sync_group_call", False, "bool",
                   "with comm_group_call_opt, keep overlap_optimize_and_sync on and run each "
                   "stage's parameter sync over the hierarchical route (develop turns the "
                   "overlap off there)."),
)

_BY_NAME: Dict[str, ShardingOption] = {o.name: o for o in SHARDING_OPTIONS}


def option(name: str) -> ShardingOption:
    """The table entry of ``name`` (KeyError naming the known options)."""
    if name not in _BY_NAME:
        raise KeyError(f"{name!r} is not a Muon sharding option; known: {sorted(_BY_NAME)}")
    return _BY_NAME[name]


def option_default(name: str) -> Any:
    """Default of option ``name``."""
    return option(name).default


def check_option_value(name: str, value: Any, where: str = "") -> None:
    """Refuse a ``value`` of option ``name`` of the wrong type (TypeError) or outside the
    option's choices (ValueError); ``where`` prefixes the name (``"sharding_configs."``)."""
    expected = {"bool": bool, "string": str}[option(name).proto_type]
    if not isinstance(value, expected):
        raise TypeError(f"{where}{name} must be a {expected.__name__}, got {value!r}.")
    _check_choice(name, value, where)


def _check_choice(name: str, value: Any, where: str) -> None:
    choices = option(name).choices
    if choices is not None and value not in choices:
        raise ValueError(f"{where}{name}={value!r} is not supported; use one of {choices}.")


_kept_options_reader: Optional[Callable[[Any], Any]] = None


def set_kept_options_reader(reader: Optional[Callable[[Any], Any]]) -> None:
    """Register where option values the proto cannot hold are read from (None: nowhere):
    ``reader(strategy)`` returns one attribute per :data:`SHARDING_OPTIONS` entry, or None."""
    global _kept_options_reader
    _kept_options_reader = reader


class ShardingAssertionError(AssertionError, ValueError):
    """A configuration develop rejects with an assertion (also a ValueError: either catch works)."""


class ShardingTypeError(TypeError, ValueError):
    """An inner optimizer develop rejects with ValueError (ours said TypeError): both."""


# develop's switch for the staged update with overlapped parameter sync
OVERLAP_SYNC_ENV = "FLAGS_muon_sharding_overlap_optimize_and_sync"


def read_overlap_optimize_and_sync() -> bool:
    """develop's :data:`OVERLAP_SYNC_ENV` flag (default on); ValueError if set to a non-integer."""
    raw = os.environ.get(OVERLAP_SYNC_ENV, "1")
    try:
        return bool(int(raw))
    except ValueError:
        raise ValueError(f"{OVERLAP_SYNC_ENV}={raw!r} is not an integer; set it to 1 (overlap "
                         "the parameter sync with the update, the default) or 0.") from None


# ------------------------------------------------------------------ settings
def _refuse_if(refused: Any, error: type, message: str) -> None:
    if refused:
        raise error(message)


# ShardingSettings fields not read from ``sharding_configs.<field>``: field -> (where, name).
_READ_ELSEWHERE = {
    "pp_sharding_comm_overlap": ("pp_configs", "sharding_comm_overlap"),
    "pp_release_gradients": ("pp_configs", "release_gradients"),
    "enable_optimizer_timer": ("hybrid_configs", "enable_optimizer_timer"),
    "pp_degree": ("hybrid_configs", "pp_degree"),
}

# field type -> (accepts a value, what the error asks for); str fields: the table's choices
_VALUE_TYPES: Dict[str, Tuple[Callable[[Any], bool], str]] = {
    "bool": (lambda v: isinstance(v, bool), "True or False"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an int"),
    "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "a number (MB; <= 0 turns the fused buffers off)"),
}


@dataclasses.dataclass
class ShardingSettings:
    """The sharding options the optimizer reads, resolved once: ``sharding_configs`` fields of
    the same name except ``_READ_ELSEWHERE``'s (ours: :data:`SHARDING_OPTIONS`)."""

    accumulate_steps: int = 1
    comm_overlap: bool = False
    comm_buffer_size_MB: float = DEVELOP_DEFAULT_BUFFER_MB
    use_reduce_avg: bool = True
    release_gradients: bool = False
    tensor_fusion: bool = False
    enable_fuse_optimizer_states: bool = False
    comm_group_call_opt: bool = option_default("comm_group_call_opt")
    muon_partition_strategy: str = option_default("muon_partition_strategy")
    machine_balanced_2d_partition: bool = option_default("machine_balanced_2d_partition")
    overlap_sync_group_call: bool = option_default("overlap_sync_group_call")
    pp_sharding_comm_overlap: bool = False
    pp_release_gradients: bool = False
    enable_optimizer_timer: bool = False
    pp_degree: int = 1

    @property
    def release_grads(self) -> bool:
        """Either place develop reads ``release_gradients`` from turns it on."""
        return bool(self.release_gradients or self.pp_release_gradients)

    @property
    def fused(self) -> bool:
        """Gradients go through fused buffers (``comm_buffer_size_MB > 0``)."""
        return self.comm_buffer_size_MB > 0

    @classmethod
    def from_strategy(cls, strategy: Any) -> ShardingSettings:
        """Read settings from a ``fleet.DistributedStrategy`` (None: defaults)."""
        settings = cls()
        if strategy is None:
            return settings
        hybrid = strategy.hybrid_configs
        configs, pp_configs = hybrid["sharding_configs"], hybrid["pp_configs"]
        for field in SHARDING_CONFIG_FIELDS:
            # fields develop's proto has and 3.3.1's lacks (unless patch_paddle() added them)
            if hasattr(configs, field):
                setattr(settings, field, getattr(configs, field))
        for field, (where, there) in _READ_ELSEWHERE.items():
            if where == "pp_configs" and hasattr(pp_configs, there):
                setattr(settings, field, getattr(pp_configs, there))
        settings.enable_optimizer_timer = bool(hybrid["enable_optimizer_timer"])
        settings.pp_degree = int(hybrid["pp_degree"])
        # options an older proto lacks come from where they are kept; a field read above wins
        kept = None if _kept_options_reader is None else _kept_options_reader(strategy)
        for opt in SHARDING_OPTIONS if kept is not None else ():
            if opt.config_key == "sharding_configs" and not hasattr(configs, opt.name):
                setattr(settings, opt.name, getattr(kept, opt.name))
        return settings

    def check(self, pp_world_size: int) -> None:
        """Refuse, naming the option and the fix, what cannot run at ``pp_world_size``."""
        self.check_layout(pp_world_size)
        # imported here: check_layout serves the planning tools, which run without paddle
        import paddle

        _refuse_if(self.enable_optimizer_timer and not paddle.is_compiled_with_cuda(), ValueError,
                   "hybrid_configs.enable_optimizer_timer=True needs a CUDA build: Paddle's "
                   "optimizer timers synchronize the CUDA device. Set it False (or profile with "
                   "paddle.profiler).")
        self.check_values()

    def check_layout(self, pp_world_size: int) -> None:
        """The part of :meth:`check` that needs no device (``plan`` and ``verify`` ask it too,
        so they never model what would not run)."""
        _check_choice("muon_partition_strategy", self.muon_partition_strategy, "sharding_configs.")
        overlap, size = self.comm_overlap, self.comm_buffer_size_MB
        # one at a time, in order: a later condition may not hold a comparable value
        _refuse_if(self.pp_sharding_comm_overlap, ShardingAssertionError,
                   "pp_configs.sharding_comm_overlap=True is not supported by "
                   "MuonShardingOptimizer: Muon gradients are reduced onto whole-matrix owners, "
                   "not by the pipeline's sharding overlap. Set it False (with pp_degree=1, "
                   "sharding_configs.comm_overlap overlaps the reduces with backward).")
        _refuse_if(overlap and pp_world_size > 1, ShardingAssertionError,
                   "sharding_configs.comm_overlap=True cannot be combined with pipeline "
                   f"parallel (pp_degree={pp_world_size}); set comm_overlap=False.")
        _refuse_if(overlap and not self.fused, ValueError,
                   "sharding_configs.comm_overlap=True needs fused gradient buffers; "
                   f"comm_buffer_size_MB={size} turns them off. "
                   "Set comm_buffer_size_MB > 0 or comm_overlap=False.")
        _refuse_if(overlap and self.accumulate_steps <= 0, ShardingAssertionError,
                   "sharding_configs.comm_overlap=True needs accumulate_steps >= 1 "
                   f"(got {self.accumulate_steps}): the hooks count micro-batches.")
        _refuse_if(self.tensor_fusion and not self.fused, ValueError,
                   "sharding_configs.tensor_fusion=True fuses gradients into buffers of "
                   f"comm_buffer_size_MB, but comm_buffer_size_MB={size}. "
                   "Set comm_buffer_size_MB > 0 or tensor_fusion=False.")

    def check_values(self) -> None:
        """Refuse a value of the wrong type, NaN or inf (a duck-typed strategy, settings built
        by hand); ``comm_buffer_size_MB <= 0`` keeps develop's meaning (no fused buffers)."""
        for field in dataclasses.fields(self):
            if field.type not in _VALUE_TYPES:
                continue
            value, (accepts, wanted) = getattr(self, field.name), _VALUE_TYPES[field.type]
            where = ".".join(_READ_ELSEWHERE.get(field.name, ("sharding_configs", field.name)))
            _refuse_if(not accepts(value), ShardingTypeError,
                       f"{where}={value!r} ({type(value).__name__}) must be {wanted}.")
            _refuse_if(field.type == "float" and not math.isfinite(value), ValueError,
                       f"{where}={value!r} is not finite; use a size in MB (e.g. 256) "
                       "or <= 0 for no fused buffers.")


SHARDING_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(ShardingSettings)
                               if f.name not in _READ_ELSEWHERE)

_SEEN: set = set()


def log_once_per_job(level: str, key: str, message: str, *args: Any) -> bool:
    """Log ``message % args`` at ``level`` on global rank 0 the first time this process sees
    ``key`` (a name, plus the values that make news), else at debug; True if at ``level``."""
    import paddle.distributed as dist
    from paddle.distributed.fleet.utils.log_util import logger

    # only rank 0 marks a key seen (a process may simulate several ranks)
    loud = dist.get_rank() == 0 and key not in _SEEN
    if loud:
        _SEEN.add(key)
    getattr(logger, level if loud else "debug")(message, *args)
    return loud


def _user_set_sharding_config(strategy: Any, field: str) -> bool:
    """Whether the user set ``sharding_configs.<field>`` (a strategy that cannot tell: True);
    a default the user never chose is not worth a warning on every CPU run."""
    try:
        return bool(strategy.hybrid_configs["sharding_configs"].HasField(field))
    except (AttributeError, KeyError, TypeError, ValueError):
        return True
