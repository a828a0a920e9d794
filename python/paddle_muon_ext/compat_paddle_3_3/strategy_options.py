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
"""Sharding options that paddle 3.3.1's DygraphShardingConfig proto lacks.

Upstream Paddle carries comm_group_call_opt, machine_balanced_2d_partition
and use_muon_sharding as proto fields; this project adds
muon_partition_strategy and overlap_sync_group_call (the option table,
``muon_sharding_options.SHARDING_OPTIONS``, says which and their defaults).
The 3.3.1 proto has none of them and DistributedStrategy rejects unknown
attributes, so the values are kept beside the strategy object. Where a Paddle
build does have the proto field, the field is read (and written) instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..distributed.fleet.meta_optimizers.muon_sharding.settings import (
    PARTITION_STRATEGIES,
    SHARDING_OPTIONS,
    check_option_value,
    option_default,
    set_kept_options_reader,
)

__all__ = [
    "MuonShardingOptions",
    "get_muon_sharding_options",
    "set_muon_sharding_options",
]

# Kept as an instance attribute (bypassing DistributedStrategy.__setattr__,
# which rejects unknown names) so the options survive the deepcopy that
# fleet.init / fleet.distributed_optimizer make of the user's strategy.
_ATTR = "_paddle_muon_ext_sharding_options"


@dataclasses.dataclass
class MuonShardingOptions:
    """Muon-sharding switches that paddle 3.3.1's strategy cannot hold.

    One field per entry of the option table (``SHARDING_OPTIONS``: default,
    choices and a one-line doc each); defaults are read from it.

    Attributes:
        use_muon_sharding (bool): build MuonShardingOptimizer instead of
            Paddle's DygraphShardingOptimizer in distributed_optimizer.
        comm_group_call_opt (bool): hierarchical Muon reduces/broadcasts.
        machine_balanced_2d_partition (bool): develop's machine-balanced owners.
        muon_partition_strategy (str): ``"upstream_greedy"`` (develop's rule,
            the default), ``"balanced"`` (recommended) or ``"rail"`` (the
            hierarchical path's rail spread; elsewhere ``"balanced"``).
        overlap_sync_group_call (bool): overlapped stage sync over the
            hierarchical route.
    """

    use_muon_sharding: bool = option_default("use_muon_sharding")
    comm_group_call_opt: bool = option_default("comm_group_call_opt")
    machine_balanced_2d_partition: bool = option_default("machine_balanced_2d_partition")
    muon_partition_strategy: str = option_default("muon_partition_strategy")
    overlap_sync_group_call: bool = option_default("overlap_sync_group_call")

    def __post_init__(self) -> None:
        for opt in SHARDING_OPTIONS:
            check_option_value(opt.name, getattr(self, opt.name))


def _sharding_configs(strategy: Any) -> Any:
    if strategy is None:
        return None
    try:
        return strategy.hybrid_configs["sharding_configs"]
    except (AttributeError, KeyError, TypeError):
        return None


def _proto_has(configs: Any, field: str) -> bool:
    descriptor = getattr(configs, "DESCRIPTOR", None)
    return descriptor is not None and field in descriptor.fields_by_name


def set_muon_sharding_options(strategy: Any, **options: Any) -> MuonShardingOptions:
    """Set Muon-sharding options on a fleet.DistributedStrategy.

    Call it after assigning strategy.hybrid_configs and before
    fleet.init / distributed_optimizer.

    Args:
        strategy (fleet.DistributedStrategy): the strategy handed to fleet.
        **options: any field of ``MuonShardingOptions``.

    Returns:
        MuonShardingOptions: the options now in effect for strategy.

    Examples:
        .. code-block:: python

            >>> strategy = fleet.DistributedStrategy()
            >>> set_muon_sharding_options(
            ...     strategy, use_muon_sharding=True, comm_group_call_opt=True)
    """
    known = {f.name for f in dataclasses.fields(MuonShardingOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(
            f"unknown Muon sharding option(s) {unknown}; valid: {sorted(known)}."
        )
    current = dataclasses.asdict(get_muon_sharding_options(strategy))
    current.update(options)
    opts = MuonShardingOptions(**current)
    object.__setattr__(strategy, _ATTR, opts)
    configs = _sharding_configs(strategy)
    for opt in SHARDING_OPTIONS:
        if configs is not None and _proto_has(configs, opt.name):
            setattr(configs, opt.name, getattr(opts, opt.name))
    return opts


def get_muon_sharding_options(strategy: Any) -> MuonShardingOptions:
    """Read the Muon-sharding options of strategy.

    A proto field, where the installed Paddle has one, wins over the value kept
    by ``set_muon_sharding_options``.

    Args:
        strategy (fleet.DistributedStrategy|None): the user strategy.

    Returns:
        MuonShardingOptions: defaults when nothing was set.
    """
    opts = getattr(strategy, _ATTR, None) if strategy is not None else None
    opts = dataclasses.replace(opts) if opts else MuonShardingOptions()
    configs = _sharding_configs(strategy)
    for opt in SHARDING_OPTIONS:
        if configs is not None and _proto_has(configs, opt.name):
            setattr(opts, opt.name, getattr(configs, opt.name))
    return opts


# The core's settings read the values kept here through this hook (the core
# never imports this package; whoever kept an option imported it).
set_kept_options_reader(get_muon_sharding_options)
