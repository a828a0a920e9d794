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
"""Sharding optimizer for Muon: whole-matrix owners, element-wise 1-D shards.

Each Muon parameter is owned whole by one rank of its colour's group (reduce to
the owner, Newton-Schulz there, broadcast back); every other parameter is split
element-wise (reduce-scatter, AdamW on the slice, all-gather). The work lives in
``muon_sharding``; develop's attribute and method names in its ``develop_surface``.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from paddle import framework
from paddle.base.framework import EagerParamBase  # noqa: F401  (develop imports it)
from paddle.distributed import fleet
from paddle.distributed.fleet.utils.log_util import logger  # noqa: F401  (develop's name)

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.develop_surface import (
    DevelopSurface,
    run_staged_update,  # noqa: F401  (develop's module name)
)
from .muon_sharding import optimizer_state
from .muon_sharding.build import build_runtime
from .muon_sharding.comm_plan import HierarchicalCommPlan, resolve_gpus_per_node
from .muon_sharding.layout import ShardingLayout, assign_muon_owners
from .muon_sharding.runtime import MuonBucket  # noqa: F401  (re-exported)
from .muon_sharding.layout import is_trainable as _is_trainable  # noqa: F401  (develop's name)

__all__ = ["MuonShardingOptimizer", "assign_muon_owners"]

# Read once at import, as develop does: the update is skipped, the parameter
# sync still runs (owners broadcast unchanged values).
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

    Gradient contract (as develop): when ``step()`` runs, each parameter's gradient
    (``main_grad`` under MixPrecisionLayer, else ``grad``) is the gradient of this rank's
    own loss; it is averaged over the parameter's colour group: the sharding group
    without a colour, the colour's ``group`` (for experts the moe_sharding group) with
    one. A dispatch over the EP group gives an expert's owner the sum over that group,
    so expert gradients must be scaled by ``1/ep`` before ``step()`` (docs/USAGE.md,
    "The gradient contract"). ``no_sync`` does not change the reduction.

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
        self._inner_opt = optimizer      # the wrapped optimizer (applies the update)
        self._hcg = hcg if hcg is not None else fleet.get_hybrid_communicate_group()
        if strategy is None:
            strategy = getattr(fleet.fleet, "_user_defined_strategy", None)
        # the model's parameters (the build points the inner optimizer at this rank's)
        params = getattr(optimizer, "_parameter_list", None)
        # every buffer, group, owner map and the step loop
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
        """Flattened ``(begin, end)`` of parameter ``name`` this rank updates: padding
        excluded; the whole parameter when owned, ``(0, 0)`` when this rank holds none of it.
        """
        try:
            return self._runtime.layout.local_range(name)
        except KeyError:
            raise KeyError(f"{name} is not a trainable parameter of this optimizer") from None

    def filter_parameters(self, parameter_list, hcg) -> list:
        """Of the model's ``parameter_list``, those whose gradients this rank holds after
        reduction (each counted once by a global-norm clip): owned matrices and this
        rank's initialised slices. ``hcg`` is Paddle's interface (unused)."""
        rt, result = self._runtime, []
        for p in parameter_list:
            if rt.layout.owners.get(p.name) == rt.rank:
                result.append(p)
            elif p.name in rt.slice_params and rt.slice_params[p.name]._is_initialized():
                result.append(rt.slice_params[p.name])
        return result

    @framework.no_grad()
    def reduce_gradients(self, parameter_list, hcg) -> None:
        """Reduce Muon gradients onto their owners and reduce-scatter the rest.

        With ``comm_overlap`` the hooks launched the reduces; this waits and
        reduces the no-hook colours synchronously. The arguments are Paddle's
        interface (the optimizer knows its parameters and groups).
        """
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
            set_to_zero (bool): True zeroes gradients in place. False frees what is not
                linked to a fused buffer (per-parameter Muon gradients, ``main_grad`` of
                unfused parameters); fused buffers (the gradients are views into them)
                are zeroed, unless ``release_gradients`` releases the 1-D buffers.
        """
        self._runtime.clear_grad(set_to_zero)

    @framework.no_grad()
    def clear_param_storage(self, color) -> None:
        """Free the parameter storage of colour ``color`` (None: the default sharding
        group) until the next step: every element-wise parameter of the colour (this
        rank's slice is kept aside) and every matrix of it this rank does not own (the
        owner's broadcast refills it). :meth:`step` restores the storage first.
        """
        self._runtime.clear_param_storage(color)

    @framework.no_grad()
    def reset_param_storage(self) -> None:
        """Give every colour freed by :meth:`clear_param_storage` its storage back."""
        self._runtime.reset_param_storage()

    def state_dict(self) -> dict:
        """This rank's optimizer state (owned matrices and local slices)."""
        return self._inner_opt.state_dict()

    def set_state_dict(self, state_dict: dict) -> None:
        """Load this rank's part of a full (all ranks merged) state dict: ``<param
        name>_<state>`` keys, ``master_weights`` (param name -> tensor), ``LR_Scheduler``.
        """
        optimizer_state.set_state_dict(self._runtime, state_dict)

    def sharded_state_dict(self, model_sharded_state_dict: dict) -> dict:
        """This rank's optimizer state for ``paddle.distributed.flex_checkpoint``:
        structured key -> ShardedWeight, placed by ``model_sharded_state_dict`` (the
        model's). Keys as develop (``<structured name>.<state>``, master ``.w_0``); shapes
        and offsets come from the model's weight, so a checkpoint loads on another layout
        (owned matrices whole, slices ``is_flattened``). Missing states are created, so a
        fresh optimizer can load.
        """
        return optimizer_state.sharded_state_dict(self._runtime, model_sharded_state_dict)

    def _state_owner(self, state_key: str) -> tuple[str, str] | None:
        """(parameter name, develop's state name) of an optimizer state key, or None."""
        return optimizer_state.state_owner(self._runtime, state_key)

    def __getattr__(self, item: str) -> Any:
        # develop's forwarding (minimize, get_lr, ... of the inner optimizer);
        # only reached for names this class does not define.
        if item in ("_inner_opt", "_runtime"):
            raise AttributeError(item)
        return getattr(self._inner_opt, item)
