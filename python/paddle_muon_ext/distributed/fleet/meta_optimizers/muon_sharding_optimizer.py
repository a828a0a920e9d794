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
"""Sharding optimizer for Muon: each Muon matrix is owned whole by one rank of its colour's
group (reduce, Newton-Schulz, broadcast); every other parameter is split element-wise
(reduce-scatter, AdamW, all-gather). The work lives in ``muon_sharding``."""

from __future__ import annotations

import os
from typing import Any, Callable

from paddle import framework
from paddle.base.framework import EagerParamBase  # noqa: F401  (develop imports it)
from paddle.distributed import fleet
from paddle.distributed.fleet.utils.log_util import logger  # noqa: F401  (develop's name)

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.develop_surface import (
    DevelopSurface,  # absolute: the exporter follows the base's members only through this form
)
from .muon_sharding import optimizer_state
from .muon_sharding.build import build_runtime
from .muon_sharding.comm_plan import HierarchicalCommPlan, resolve_gpus_per_node
from .muon_sharding.layout import ShardingLayout, assign_muon_owners
from .muon_sharding.runtime import MuonBucket  # noqa: F401  (re-exported)
from .muon_sharding.layout import is_trainable as _is_trainable  # noqa: F401  (develop's name)

__all__ = ["MuonShardingOptimizer", "assign_muon_owners"]

# Read once at import, as develop: the update is skipped, the sync still runs (unchanged values).
g_shard_bypass_dygraph_optimizer = int(os.environ.get("FLAGS_shard_bypass_dygraph_optimizer", 0))


def get_gpus_per_node() -> int:
    """GPUs per node (``PADDLE_LOCAL_SIZE``, else the visible device count), validated."""
    return resolve_gpus_per_node()


def get_trainer_ranks(rank: int, gpus_per_node: int) -> tuple[int, range]:
    """(machine index, global ranks of that machine) of ``rank``, develop's block layout."""
    machine = rank // gpus_per_node
    return machine, range(machine * gpus_per_node, (machine + 1) * gpus_per_node)


def get_same_card_rank(group_ranks, rank: int, gpus_per_node: int) -> int:
    """The first rank of ``rank``'s machine that is in ``group_ranks``; -1 when none is."""
    members = set(group_ranks)
    return next((r for r in get_trainer_ranks(rank, gpus_per_node)[1] if r in members), -1)


class MuonShardingOptimizer(DevelopSurface):
    """Shard a :class:`~paddle.optimizer.Muon` optimizer across ranks.

    Built as ``MuonShardingOptimizer(optimizer, hcg)`` (``fleet.distributed_optimizer``
    does it when ``strategy.use_muon_sharding`` is on); options come from fleet's strategy.

    Gradient contract (as develop; docs/USAGE.md): at ``step()`` each gradient is that of
    this rank's loss, averaged over the parameter's colour group (the sharding group, or
    the colour's ``group``). Expert gradients, summed over the EP group by the dispatch,
    must be scaled by ``1/ep`` first. ``no_sync`` does not change the reduction.

    Args:
        optimizer (Muon): the inner optimizer (optionally inside ``MixPrecisionOptimizer``);
            it must expose ``_muon_param_info_map`` and ``_apply_optimize``.
        hcg (HybridCommunicateGroup|None): defaults to ``fleet.get_hybrid_communicate_group()``.
        strategy (DistributedStrategy|None): defaults to fleet's user-defined strategy.
        gpus_per_node (Callable[[], int]|None): how the GPUs per node are found (only with
            ``comm_group_call_opt`` or ``machine_balanced_2d_partition`` on); defaults to
            ``PADDLE_LOCAL_SIZE``, else the device count.

    Examples:
        .. code-block:: python

            >>> # after fleet.init(is_collective=True, strategy=strategy)
            >>> opt = MuonShardingOptimizer(paddle.optimizer.Muon(
            ...     learning_rate=0.02, parameters=model.parameters()))
            >>> loss.backward()
            >>> opt.reduce_gradients(list(model.parameters()), hcg)
            >>> opt.step()
            >>> opt.clear_grad()
    """

    def __init__(self, optimizer, hcg=None, strategy=None, *,
                 gpus_per_node: Callable[[], int] | None = None) -> None:
        self._inner_opt = optimizer
        self._hcg = hcg if hcg is not None else fleet.get_hybrid_communicate_group()
        if strategy is None:
            strategy = getattr(fleet.fleet, "_user_defined_strategy", None)
        # read first: the build points the inner optimizer at this rank's parameters
        params = getattr(optimizer, "_parameter_list", None)
        self._runtime = build_runtime(optimizer, self._hcg, strategy,
                                      gpus_per_node or resolve_gpus_per_node,
                                      bool(g_shard_bypass_dygraph_optimizer))
        self._parameter_list = list(params)

    @property
    def _settings(self):
        """The sharding options, resolved once (``muon_sharding.settings.ShardingSettings``)."""
        return self._runtime.settings

    @property
    def sharding_layout(self) -> ShardingLayout:
        """The placement this optimizer was built from (owners, buckets, ranges, schedule)."""
        return self._runtime.layout

    @property
    def owner_map(self) -> dict[str, int]:
        """Parameter name -> owning global rank, for every Muon parameter."""
        return dict(self._runtime.layout.owners)

    @property
    def comm_plan(self) -> HierarchicalCommPlan | None:
        """The hierarchical routing plan (None with comm_group_call_opt off)."""
        return self._runtime.plan

    @property
    def partitions(self) -> dict[str, Any]:
        """Colour key -> OwnerPartition (per-rank load figures for tools)."""
        return dict(self._runtime.layout.partitions)

    @property
    def muon_buckets(self) -> list:
        """The (colour, owner, dtype) buckets of Muon parameters."""
        return list(self._runtime.muon_buckets)

    @property
    def fused_states_buffers(self) -> dict[str, Any]:
        """dtype name -> this rank's fused optimizer-state buffer (empty before a step)."""
        return dict(self._runtime.fused_state_buffers)

    @property
    def clear_color(self) -> set:
        """develop's set of colours :meth:`clear_param_storage` freed (until the next step)."""
        return set(self._runtime.cleared_colours)

    def local_range(self, name: str) -> tuple[int, int]:
        """Flattened ``(begin, end)`` of ``name`` this rank updates (no padding): the whole
        parameter when owned, ``(0, 0)`` when this rank holds none of it."""
        try:
            return self._runtime.layout.local_range(name)
        except KeyError:
            raise KeyError(f"{name} is not a trainable parameter of this optimizer") from None

    def filter_parameters(self, parameter_list, hcg) -> list:
        """Of ``parameter_list``, those whose reduced gradients this rank holds (what a
        global-norm clip counts once): owned matrices and initialised slices. ``hcg`` is unused."""
        rt, result = self._runtime, []
        for p in parameter_list:
            if rt.layout.owners.get(p.name) == rt.rank:
                result.append(p)
            elif p.name in rt.slice_params and rt.slice_params[p.name]._is_initialized():
                result.append(rt.slice_params[p.name])
        return result

    @framework.no_grad()
    def reduce_gradients(self, parameter_list, hcg) -> None:
        """Reduce Muon gradients onto their owners and reduce-scatter the rest (with
        ``comm_overlap``: wait for the hooks' reduces, run the no-hook colours'). The
        arguments are Paddle's interface, unused."""
        rt = self._runtime
        with rt.timed("reduce-gradients"):
            rt.run(rt.reduce_plan)

    @framework.no_grad()
    def step(self) -> list:
        """Update owned matrices (Muon) and local slices (AdamW), then sync."""
        rt = self._runtime
        return rt.run(rt.step_plan, staged=rt.staged).params_grads

    def minimize(self, loss, startup_program=None, parameters=None, no_grad_set=None):
        """Step (``HybridParallelOptimizer.minimize`` reduced the gradients already);
        returns ``(None, params_grads)`` as ``Optimizer.minimize`` does."""
        return None, self.step()

    def clear_grad(self, set_to_zero: bool = True) -> None:
        """Clear every gradient this optimizer manages.

        Args:
            set_to_zero (bool): True zeroes gradients in place; False frees those not
                views of a fused buffer, and zeroes the fused buffers (``release_gradients``
                releases the 1-D ones).
        """
        self._runtime.clear_grad(set_to_zero)

    @framework.no_grad()
    def clear_param_storage(self, color) -> None:
        """Free colour ``color``'s (None: the default group) parameter storage until
        :meth:`step` restores it: its element-wise parameters (this rank's slice kept
        aside) and the matrices this rank does not own (the owner's broadcast refills)."""
        self._runtime.clear_param_storage(color)

    @framework.no_grad()
    def reset_param_storage(self) -> None:
        """Give every colour freed by :meth:`clear_param_storage` its storage back."""
        self._runtime.reset_param_storage()

    def state_dict(self) -> dict:
        """This rank's optimizer state (owned matrices and local slices)."""
        return self._inner_opt.state_dict()

    def set_state_dict(self, state_dict: dict) -> None:
        """Load this rank's part of a merged state dict (``<param name>_<state>`` keys,
        ``master_weights``: name -> tensor, ``LR_Scheduler``)."""
        optimizer_state.set_state_dict(self._runtime, state_dict)

    def sharded_state_dict(self, model_sharded_state_dict: dict) -> dict:
        """This rank's state for ``flex_checkpoint``: key -> ShardedWeight, keyed as develop
        (``<structured name>.<state>``, master ``.w_0``) and placed by the model's
        ``model_sharded_state_dict``, so it loads on another layout (owned matrices whole,
        slices ``is_flattened``). Missing states are created, so a fresh optimizer can load."""
        return optimizer_state.sharded_state_dict(self._runtime, model_sharded_state_dict)

    def __getattr__(self, item: str) -> Any:
        # develop's forwarding to the inner optimizer (only names this class lacks)
        if item in ("_inner_opt", "_runtime"):
            raise AttributeError(item)
        return getattr(self._inner_opt, item)
