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
"""The one table of the Muon-sharding options that develop's proto may lack.

Every option MuonShardingOptimizer reads beyond paddle 3.3.1's
``DygraphShardingConfig`` -- develop's own (``comm_group_call_opt``,
``machine_balanced_2d_partition``) and the ones this project adds -- is one
:class:`ShardingOption` here: name, default, choices, proto message/type and a
one-line doc. The optimizer's settings, the 3.3.1 compat options and
``patch_paddle()``, the plan tool and the patch exporter read defaults and
choices from this table; none of them writes one down again.

Where a Paddle build's proto lacks some of these fields, their values are
kept elsewhere (paddle 3.3.1: beside the strategy object); whoever keeps them
registers a reader with :func:`set_kept_options_reader`, and the settings ask
:func:`kept_options`. With no reader (a Paddle whose proto has every field)
the proto alone is read.

Pure Python (no paddle import): tools load it before paddle.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

__all__ = [
    "ShardingOption",
    "SHARDING_OPTIONS",
    "PARTITION_DEVELOP",
    "PARTITION_BALANCED",
    "PARTITION_RAIL",
    "PARTITION_STRATEGIES",
    "option",
    "option_default",
    "added_options",
    "check_option_value",
    "set_kept_options_reader",
    "kept_options",
]

# Owner rules of muon_partition_strategy: develop's rule (the default) and ours
# (rail: the hierarchical path's; elsewhere it is balanced).
PARTITION_DEVELOP = "upstream_greedy"
PARTITION_BALANCED = "balanced"
PARTITION_RAIL = "rail"
PARTITION_STRATEGIES: Tuple[str, ...] = (PARTITION_DEVELOP, PARTITION_BALANCED, PARTITION_RAIL)

_PY_TYPES = {"bool": bool, "string": str}


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
        in_develop: develop's proto has the field already (the exporter adds
            only the others).
    """

    name: str
    default: Any
    proto_type: str
    doc: str
    choices: Optional[Tuple[str, ...]] = None
    message: str = "DygraphShardingConfig"
    config_key: Optional[str] = "sharding_configs"
    in_develop: bool = False

    @property
    def proto_default(self) -> str:
        """The default as a proto literal (``false``, ``"upstream_greedy"``)."""
        return json.dumps(self.default)


SHARDING_OPTIONS: Tuple[ShardingOption, ...] = (
    ShardingOption(
        "use_muon_sharding", False, "bool",
        "build MuonShardingOptimizer instead of DygraphShardingOptimizer in "
        "fleet.distributed_optimizer.",
        message="DistributedStrategy", config_key=None, in_develop=True),
    ShardingOption(
        "comm_group_call_opt", False, "bool",
        "route Muon reduces/broadcasts hierarchically: inside the node, then across "
        "nodes among same-card ranks.",
        in_develop=True),
    ShardingOption(
        "machine_balanced_2d_partition", False, "bool",
        "place Muon (whole-matrix) owners over the whole job so every machine carries "
        "the same bytes (develop #79763).",
        in_develop=True),
    ShardingOption(
        "muon_partition_strategy", PARTITION_DEVELOP, "string",
        'owner rule for Muon (whole-matrix) parameters: "upstream_greedy" (develop\'s '
        'rule), "balanced" (state bytes and Newton-Schulz cost balanced over ranks; '
        'recommended) or "rail" (with comm_group_call_opt over >= 2 nodes: bytes '
        'spread evenly over card rails, then nodes; elsewhere "balanced").',
        choices=PARTITION_STRATEGIES),
    ShardingOption(
        "overlap_sync_group_call", False, "bool",
        "with comm_group_call_opt, keep overlap_optimize_and_sync on and run each "
        "stage's parameter sync over the hierarchical route (develop turns the "
        "overlap off there).",
    ),
)

_BY_NAME: Dict[str, ShardingOption] = {o.name: o for o in SHARDING_OPTIONS}


def option(name: str) -> ShardingOption:
    """The table entry of ``name`` (KeyError naming the known options)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(
            f"{name!r} is not a Muon sharding option; known: {sorted(_BY_NAME)}"
        ) from None


def option_default(name: str) -> Any:
    """Default of option ``name``."""
    return option(name).default


def added_options() -> Tuple[ShardingOption, ...]:
    """Options develop's proto lacks (what an exported patch adds to it)."""
    return tuple(o for o in SHARDING_OPTIONS if not o.in_develop)


def check_option_value(name: str, value: Any, where: str = "") -> None:
    """Refuse a value of the wrong type or outside the option's choices.

    Args:
        name: option name.
        value: the value given.
        where: prefix naming where it was set (e.g. ``"sharding_configs."``).
    """
    opt = option(name)
    expected = _PY_TYPES[opt.proto_type]
    if not isinstance(value, expected):
        raise TypeError(
            f"{where}{name} must be a {expected.__name__}, got {value!r}."
        )
    if opt.choices is not None and value not in opt.choices:
        raise ValueError(
            f"{where}{name}={value!r} is not supported; use one of {opt.choices}."
        )


# The reader of option values kept outside the proto (None: nothing kept).
_kept_options_reader: Optional[Callable[[Any], Any]] = None


def set_kept_options_reader(reader: Optional[Callable[[Any], Any]]) -> None:
    """Register where option values the proto cannot hold are read from.

    Args:
        reader: ``reader(strategy)`` returns an object with one attribute per
            :data:`SHARDING_OPTIONS` entry (the values in effect for that
            strategy); None removes the reader.
    """
    global _kept_options_reader
    _kept_options_reader = reader


def kept_options(strategy: Any) -> Any:
    """The option values kept outside ``strategy``'s proto, or None when nothing keeps any.

    Args:
        strategy: the user's ``fleet.DistributedStrategy`` (or None).

    Returns:
        The registered reader's answer for ``strategy``; None without a reader.
    """
    if _kept_options_reader is None or strategy is None:
        return None
    return _kept_options_reader(strategy)
