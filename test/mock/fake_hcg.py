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
"""Fake hybrid communicate group: Paddle's real EPHybridCommunicateGroup, built
for one simulated rank on top of the fake collective layer.

The layout is not re-derived here: the object is a (thin subclass of)
``paddle.distributed.fleet.base.topology.EPHybridCommunicateGroup``, built
by Paddle's own constructor with ``get_rank``/``get_world_size``/
``new_group``/``all_reduce`` patched (~10 ms per rank at 512 ranks). So
``_moe_topo``, ``_topo``, the sharding / moe_sharding / expert / pipe
groups, ``get_stage_id()`` and every other getter are Paddle's, and all
groups are created through the fake ``new_group`` in Paddle's order.

One override: Paddle 3.3.1's ``merge_inner_comm_list`` (which forms the
sharding group = moe_sharding x dense_sharding ranks of a stage) assumes the
pipe axis comes after moe_sharding. With MoE order (pipe, moe_sharding,
expert) and pp > 1 it mixes stages and the constructor fails with a bare
AssertionError on some ranks. ``_MergeFixedEPHCG`` computes the same
merge from coordinates; ``test_mock_hcg`` proves it returns exactly Paddle's
lists wherever Paddle's own version works, and pins the upstream failure.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from paddle.distributed import fleet
from paddle.distributed.fleet.base import topology as fleet_topology

from .patching import active_comm

MOE_AXES = ("pipe", "moe_sharding", "expert")
DEFAULT_MOE_ORDER = ("moe_sharding", "pipe", "expert")
#: The other order the MoE suites exercise (stages are contiguous rank blocks).
PIPE_FIRST_MOE_ORDER = ("pipe", "moe_sharding", "expert")
# Paddle's short names in strategy.hybrid_configs["order"].
_SHORT = {"pipe": "pp", "moe_sharding": "moe_sharding", "expert": "ep"}
_LONG = {"dp": "data", "pp": "pipe", "sharding": "sharding", "mp": "model", "sep": "sep",
         "cp": "context", "ep": "expert", "moe_sharding": "moe_sharding"}


def _moe_order(order: Sequence[str]) -> tuple[str, ...]:
    """Normalise ``order`` to the three MoE axis names in topology order.

    Accepts ``("moe_sharding", "pipe", "expert")``-style names or a full
    Paddle ``hybrid_configs["order"]`` list of short names.
    """
    names = [_LONG.get(n, n) for n in order]
    moe = tuple(n for n in names if n in MOE_AXES)
    if sorted(moe) != sorted(MOE_AXES):
        raise ValueError(f"order must contain exactly {MOE_AXES} (or pp/moe_sharding/ep), got {order}")
    return moe


def hybrid_names_and_dims(ep: int, moe_sharding: int, pp: int = 1, mp: int = 1,
                          order: Sequence[str] = DEFAULT_MOE_ORDER) -> tuple[list[str], list[int]]:
    """What ``fleet._init_hybrid_parallel_env`` passes to EPHybridCommunicateGroup.

    dp = sep = cp = 1. ``sharding_degree = moe_sharding * ep / mp`` so that
    the dense and MoE topologies cover the same world (Paddle asserts it).

    Args:
        ep: expert-parallel degree.
        moe_sharding: MoE sharding degree.
        pp: pipeline degree.
        mp: tensor-parallel degree (must divide ep).
        order: MoE axes in topology order.

    Returns:
        ``(hybrid_group_names, dims)``.
    """
    for name, value in (("ep", ep), ("moe_sharding", moe_sharding), ("pp", pp), ("mp", mp)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if ep % mp:
        raise ValueError(f"mp={mp} must divide ep={ep} (sharding_degree = moe_sharding*ep/mp)")
    degree = {"pipe": pp, "moe_sharding": moe_sharding, "expert": ep}
    moe = _moe_order(order)
    names = ["data", *moe, "sharding", "sep", "context", "model"]
    dims = [1, *(degree[n] for n in moe), moe_sharding * ep // mp, 1, 1, mp]
    return names, dims


def world_size_of(ep: int, moe_sharding: int, pp: int = 1) -> int:
    """Returns: the world size of a MoE hybrid config (``moe_sharding*pp*ep``)."""
    return ep * moe_sharding * pp


_MERGE_CACHE: dict[tuple, list[list[int]]] = {}


def merge_inner_comm_list_by_coords(topo: Any, outer_name: str, inner_name: str) -> list[list[int]]:
    """Order-independent version of Paddle's ``merge_inner_comm_list``.

    One merged group per combination of the other axes (in topology order);
    inside it, ranks ordered by (outer coord, inner coord), i.e. the inner
    comm lists concatenated for outer = 0, 1, ... as Paddle does.

    Args:
        topo: a ``CommunicateTopology``.
        outer_name: e.g. "moe_sharding".
        inner_name: e.g. "dense_sharding".

    Returns:
        Fresh lists of global ranks.
    """
    names = tuple(topo._parallel_names)
    key = (names, tuple(topo._dims), outer_name, inner_name)
    merged = _MERGE_CACHE.get(key)
    if merged is None:
        others = [i for i, n in enumerate(names) if n not in (outer_name, inner_name)]
        outer, inner = names.index(outer_name), names.index(inner_name)
        groups: dict[tuple, list[tuple[int, int, int]]] = {}
        for rank in range(topo.world_size()):
            coord = topo.get_coord(rank)
            groups.setdefault(tuple(coord[i] for i in others), []).append(
                (coord[outer], coord[inner], rank))
        merged = [[r for _, _, r in sorted(members)] for _, members in sorted(groups.items())]
        _MERGE_CACHE[key] = merged
    return [list(g) for g in merged]


class _MergeFixedEPHCG(fleet_topology.EPHybridCommunicateGroup):
    """Paddle's EPHybridCommunicateGroup with an order-independent sharding merge."""

    def merge_inner_comm_list(self, topo: Any, outer_name: str, inner_name: str) -> list[list[int]]:
        return merge_inner_comm_list_by_coords(topo, outer_name, inner_name)


def build_fake_hcg(ep: int, moe_sharding: int, pp: int = 1, mp: int = 1,
                   order: Sequence[str] = DEFAULT_MOE_ORDER) -> Any:
    """Build the calling rank's real ``EPHybridCommunicateGroup``.

    Must run with the fake layer active and a rank bound (inside
    ``SimulatedWorld.run`` / ``fake_distributed``); the rank's group
    creations (and Paddle's pipe-group all_reduce) land in its trace.

    Args:
        ep: expert-parallel degree.
        moe_sharding: MoE sharding degree.
        pp: pipeline degree.
        mp: tensor-parallel degree.
        order: MoE axes in topology order, e.g. ``("pipe", "moe_sharding",
            "expert")``.

    Returns:
        The hcg; ``get_sharding_parallel_group()`` is my stage's
        moe_sharding x ep/mp ranks, ``_moe_topo`` names "pipe",
        "moe_sharding", "expert" in ``order``.
    """
    comm = active_comm()
    names, dims = hybrid_names_and_dims(ep, moe_sharding, pp, mp, order)
    expected = world_size_of(ep, moe_sharding, pp)
    if comm.world_size != expected:
        raise ValueError(
            f"world_size {comm.world_size} does not match ep={ep} x moe_sharding={moe_sharding} "
            f"x pp={pp} = {expected}"
        )
    return _MergeFixedEPHCG(names, dims)


def make_hcg_factory(ep: int, moe_sharding: int, pp: int = 1, mp: int = 1,
                     order: Sequence[str] = DEFAULT_MOE_ORDER) -> Callable[[int], Any]:
    """A ``hcg_factory`` for ``SimulatedWorld`` / ``fake_distributed``.

    Args:
        ep, moe_sharding, pp, mp, order: as for ``build_fake_hcg``.

    Returns:
        ``factory(rank) -> hcg`` (the rank is taken from the bound thread).
    """
    _moe_order(order)  # validate early, in the caller's thread

    def factory(rank: int) -> Any:
        return build_fake_hcg(ep, moe_sharding, pp, mp, order)

    factory.config = dict(ep=ep, moe_sharding=moe_sharding, pp=pp, mp=mp, order=tuple(order))
    return factory


def make_hybrid_strategy(ep: int, moe_sharding: int, pp: int = 1, mp: int = 1,
                         order: Sequence[str] = DEFAULT_MOE_ORDER,
                         **sharding_configs: Any) -> Any:
    """A ``fleet.DistributedStrategy`` whose hybrid_configs match the fake hcg.

    Args:
        ep, moe_sharding, pp, mp, order: as for ``build_fake_hcg``.
        **sharding_configs: keys set on ``strategy.hybrid_configs
            ["sharding_configs"]`` (only ones Paddle 3.3.1 knows).

    Returns:
        The strategy (order: dp, MoE axes, sharding, sep, cp, mp).
    """
    names, dims = hybrid_names_and_dims(ep, moe_sharding, pp, mp, order)
    short_order = ["dp", *(_SHORT[n] for n in _moe_order(order)), "sharding", "sep", "cp", "mp"]
    strategy = fleet.DistributedStrategy()
    configs = {
        "dp_degree": 1,
        "mp_degree": mp,
        "pp_degree": pp,
        "sharding_degree": dims[names.index("sharding")],
        "ep_degree": ep,
        "moe_sharding_degree": moe_sharding,
        "order": short_order,
    }
    strategy.hybrid_configs = configs
    # The proto refuses a nested dict assignment; set the fields one by one.
    sharding = strategy.hybrid_configs["sharding_configs"]
    for key, value in sharding_configs.items():
        setattr(sharding, key, value)
    return strategy


def hcg_layout(hcg: Any) -> dict[str, Any]:
    """Plain-data view of the groups a sharding optimizer reads.

    Args:
        hcg: a (fake or real) EPHybridCommunicateGroup.

    Returns:
        Dict of group rank lists, ranks-in-group, world sizes and stage id.
    """
    return {
        "global_rank": hcg.get_global_rank(),
        "sharding": list(hcg.get_sharding_parallel_group().ranks),
        "sharding_rank": hcg.get_sharding_parallel_rank(),
        "sharding_world_size": hcg.get_sharding_parallel_world_size(),
        "moe_sharding": list(hcg.get_moe_sharding_parallel_group().ranks),
        "moe_sharding_rank": hcg.get_moe_sharding_parallel_rank(),
        "expert": list(hcg.get_expert_parallel_group().ranks),
        "expert_rank": hcg.get_expert_parallel_rank(),
        "pipe": list(hcg.get_pipe_parallel_group().ranks),
        "stage_id": hcg.get_stage_id(),
    }
