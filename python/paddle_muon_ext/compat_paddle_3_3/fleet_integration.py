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
"""``fleet.distributed_optimizer`` for Muon sharding on paddle 3.3.1.

Upstream Paddle's ``HybridParallelOptimizer`` builds a Muon sharding optimizer
when ``strategy.use_muon_sharding`` is on. Paddle 3.3.1 only knows its
DygraphShardingOptimizer V1/V2 and asserts that type in ``_hybrid_sync_grad``.
:class:`MuonHybridParallelOptimizer` subclasses it: the sharding optimizer is
built first, the parent constructor runs with its sharding-class names
pointing at a pass-through for the duration of the call only (restored in a
``finally``), and ``_hybrid_sync_grad`` accepts the Muon sharding optimizer.
The installed paddle is never edited.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from typing import Any, Iterator

from paddle.distributed import fleet
from paddle.distributed.fleet import optimizer as _fleet_optimizer
from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer import (
    hybrid_parallel_optimizer as _hpo,
)
from paddle.distributed.fleet.utils.hybrid_parallel_util import (
    fused_allreduce_gradients,
)
from paddle.distributed.fleet.utils.log_util import logger
from paddle.framework import in_dynamic_mode

from ..distributed.fleet.meta_optimizers.muon_sharding_optimizer import (
    MuonShardingOptimizer,
)
from .strategy_options import get_muon_sharding_options

__all__ = [
    "MuonHybridParallelOptimizer",
    "distributed_optimizer",
    "dygraph_distributed_optimizer",
]

# Paddle's own dygraph function, captured before patch_paddle() replaces the
# module attribute: the non-Muon path must reach it, never this module again.
PADDLE_DYGRAPH_DISTRIBUTED_OPTIMIZER = _fleet_optimizer._dygraph_distributed_optimizer


class _AlreadyShardedMeta(type):
    # isinstance() checks in the parent constructor (unwrap_optimizer) must see
    # through the Muon sharding optimizer to reach the inner Muon.
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, MuonShardingOptimizer)


class _AlreadySharded(metaclass=_AlreadyShardedMeta):
    """Stands in for Paddle's sharding classes: returns the optimizer it is given."""

    def __new__(cls, optimizer, hcg=None):
        return optimizer


# Serialises the scoped patch: two constructions interleaving (e.g. ranks
# simulated as threads) would otherwise save each other's patched names as
# "originals" and leave Paddle's module patched.
_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _sharding_classes_pass_through() -> Iterator[None]:
    with _PATCH_LOCK:
        saved = (_hpo.DygraphShardingOptimizer, _hpo.DygraphShardingOptimizerV2)
        _hpo.DygraphShardingOptimizer = _AlreadySharded
        _hpo.DygraphShardingOptimizerV2 = _AlreadySharded
        try:
            yield
        finally:
            _hpo.DygraphShardingOptimizer, _hpo.DygraphShardingOptimizerV2 = saved


class MuonHybridParallelOptimizer(_hpo.HybridParallelOptimizer):
    """``HybridParallelOptimizer`` whose sharding optimizer is Muon sharding.

    Global-norm clipping, AMP (``fleet.distributed_scaler``) and the step /
    minimize flow are Paddle's own; only the sharding optimizer differs.

    Args:
        optimizer (Muon): the inner Muon optimizer.
        hcg: the hybrid communicate group.
        strategy (DistributedStrategy): the fleet strategy.
    """

    def __init__(self, optimizer, hcg, strategy) -> None:
        if hcg.get_sharding_parallel_world_size() > 1:
            optimizer = MuonShardingOptimizer(optimizer, hcg, strategy)
        with _sharding_classes_pass_through():
            super().__init__(optimizer, hcg, strategy)

    def _hybrid_sync_grad(self, parameter_list) -> None:
        dp_parameter_list = parameter_list
        if self._sharding_enable:
            self._inner_opt.reduce_gradients(parameter_list, self._hcg)
            if self._dp_enable or self._sep_enable:
                # The element-wise slices get their gradient (a view into the
                # reduce-scatter buffer) only in step(); without it now the
                # data-parallel all-reduce below skips every 1-D slice.
                self._inner_opt._assign_slice_grad()
            dp_parameter_list = self._inner_opt.filter_parameters(
                parameter_list, self._hcg
            )
        if self._dp_enable or self._sep_enable:
            fused_allreduce_gradients(dp_parameter_list, self._hcg)


def _is_muon(optimizer: Any) -> bool:
    # MixPrecisionOptimizer (and other wrappers) keep the user's optimizer in _inner_opt
    while optimizer is not None:
        if hasattr(optimizer, "_muon_param_info_map"):
            return True
        optimizer = getattr(optimizer, "_inner_opt", None)
    return False


def _warn_if_paddle_shards_muon(optimizer: Any, strategy: Any) -> None:
    """Muon under Paddle's DygraphShardingOptimizer is legal but rarely meant."""
    if not _is_muon(optimizer):
        return
    try:
        degree = int(strategy.hybrid_configs["sharding_degree"])
    except (AttributeError, KeyError, TypeError, ValueError):
        return
    if degree > 1 and fleet.fleet.worker_num() > 1:
        logger.warning(
            "fleet.distributed_optimizer: a Muon optimizer with sharding_degree=%d "
            "but strategy.use_muon_sharding is off, so Paddle's "
            "DygraphShardingOptimizer shards it, not MuonShardingOptimizer. Set "
            "strategy.use_muon_sharding = True (after paddle_muon_ext.patch_paddle()) "
            "for Muon sharding.", degree,
        )


def distributed_optimizer(optimizer, strategy=None):
    """``fleet.distributed_optimizer`` that honours ``use_muon_sharding``.

    ``patch_paddle()`` installs this function as ``fleet.distributed_optimizer``;
    called directly it is the same thing without patching. Everything that is
    not Muon sharding on more than one worker goes to Paddle's own function,
    so scripts that do not use Muon get exactly what Paddle returns.

    Args:
        optimizer (Optimizer): the user optimizer (a Muon for Muon sharding,
            optionally inside ``MixPrecisionOptimizer``).
        strategy (DistributedStrategy|None): defaults to the one given to
            ``fleet.init``.

    Returns:
        The wrapped optimizer: :class:`MuonHybridParallelOptimizer` when
        ``use_muon_sharding`` is on and more than one worker runs, else what
        Paddle's own ``fleet.distributed_optimizer`` returns.
    """
    if not in_dynamic_mode():
        return fleet.fleet.distributed_optimizer(optimizer, strategy)
    return dygraph_distributed_optimizer(optimizer, strategy)


def dygraph_distributed_optimizer(optimizer, strategy=None):
    """The dygraph half of :func:`distributed_optimizer`.

    ``patch_paddle()`` also puts it in place of Paddle's
    ``fleet.optimizer._dygraph_distributed_optimizer``, so a
    ``distributed_optimizer`` name bound before the patch (``from
    paddle.distributed.fleet import distributed_optimizer``) takes the Muon
    path too, instead of wrapping Muon in DygraphShardingOptimizer.
    """
    fleet_env = fleet.fleet
    effective = strategy if strategy is not None else fleet_env._user_defined_strategy
    if not get_muon_sharding_options(effective).use_muon_sharding:
        _warn_if_paddle_shards_muon(optimizer, effective)
        return PADDLE_DYGRAPH_DISTRIBUTED_OPTIMIZER(optimizer, strategy)
    if fleet_env.worker_num() <= 1:
        return PADDLE_DYGRAPH_DISTRIBUTED_OPTIMIZER(optimizer, strategy)
    if strategy is not None:
        # as Paddle's function: the given strategy becomes fleet's
        fleet_env._user_defined_strategy = copy.deepcopy(strategy)
    fleet_env.user_defined_optimizer = optimizer
    fleet_env._context = {}
    return MuonHybridParallelOptimizer(
        optimizer, fleet_env._hcg, fleet_env._user_defined_strategy
    )
