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
"""Routing plan of ``comm_group_call_opt``: node and same-card groups from the MoE topology;
nothing here touches CUDA or ``paddle.distributed`` until :func:`resolve_gpus_per_node` or
:meth:`HierarchicalCommPlan.create_groups`."""

from __future__ import annotations

import math
import numbers
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["LOCAL_SIZE_ENV", "GroupSpec", "HierarchicalCommPlan", "HierarchicalGroups",
           "resolve_gpus_per_node"]

#: Environment variable set by ``paddle.distributed.launch`` (cards per node).
LOCAL_SIZE_ENV = "PADDLE_LOCAL_SIZE"

_INT_TEXT = re.compile(r"[+-]?[0-9]+")


def _default_device_count() -> int:
    """``paddle.device.cuda.device_count()``; 0 on a build without CUDA (on a CUDA
    build a failing query raises: a broken install must not read as "no GPU")."""
    import paddle  # lazy: importing this module must not touch CUDA

    try:
        return int(paddle.device.cuda.device_count())
    except Exception:
        if not paddle.is_compiled_with_cuda():
            return 0  # CPU/XPU builds: there is no CUDA runtime to ask
        raise


def resolve_gpus_per_node(environ: Mapping[str, str] | None = None,
                          device_count: Callable[[], int] | None = None) -> int:
    """Cards per node; only for ``comm_group_call_opt`` (nothing else needs the value,
    and CPU/XPU machines without a launcher cannot resolve it).

    Args:
        environ: the environment to read (``os.environ`` when None).
        device_count: the number of visible accelerators, asked when
            ``PADDLE_LOCAL_SIZE`` is unset (``paddle.device.cuda.device_count``).

    Returns:
        int: cards per node (> 0); :class:`HierarchicalCommPlan` checks >= 2.

    Raises:
        ValueError: a bad ``PADDLE_LOCAL_SIZE``, no visible accelerator, or a
            failed device query (its exception is the ``__cause__``).
        TypeError: ``device_count`` returned something that is not an integer.
    """
    env = os.environ if environ is None else environ
    raw = env.get(LOCAL_SIZE_ENV)
    if raw is not None:
        text = str(raw).strip()
        if _INT_TEXT.fullmatch(text) is None:
            raise ValueError(
                f"{LOCAL_SIZE_ENV}={raw!r} is not an integer; it must be the "
                "number of GPUs per node as a positive integer (e.g. "
                f"{LOCAL_SIZE_ENV}=8; paddle.distributed.launch sets it to "
                "--nproc_per_node).")
        value = int(text)
        if value <= 0:
            raise ValueError(
                f"{LOCAL_SIZE_ENV}={raw!r} must be a positive integer number of "
                f"GPUs per node (got {value}); set e.g. {LOCAL_SIZE_ENV}=8 or "
                "unset it to use the visible device count.")
        return value

    counter = _default_device_count if device_count is None else device_count
    try:
        count = counter()
    except Exception as error:
        raise ValueError(
            f"cannot determine GPUs per node: {LOCAL_SIZE_ENV} is not set and "
            f"querying the visible devices failed ({type(error).__name__}: "
            f"{error}). Fix the accelerator runtime, set {LOCAL_SIZE_ENV} to the "
            "number of cards per node, or turn comm_group_call_opt off.") from error
    if not _is_int(count):
        raise TypeError(
            "device_count() must return an int number of visible accelerators, "
            f"got {count!r} ({type(count).__name__}).")
    if count <= 0:
        raise ValueError(
            f"cannot determine GPUs per node: {LOCAL_SIZE_ENV} is not set and "
            f"no accelerator is visible (device_count() = {int(count)}). Launch "
            f"with paddle.distributed.launch, set {LOCAL_SIZE_ENV} to the number "
            "of cards per node, or turn comm_group_call_opt off.")
    return int(count)


_PIPE, _MOE_SHARDING, _EXPERT = "pipe", "moe_sharding", "expert"
_KNOWN_AXES = (_PIPE, _MOE_SHARDING, _EXPERT)
_TOPOLOGY_METHODS = ("get_hybrid_group_names", "get_dim", "world_size", "get_coord",
                     "get_comm_list")
_NODE, _SAME_CARD = "node", "same_card"


@dataclass(frozen=True)
class GroupSpec:
    """One communication group of the hierarchical path: ``kind`` ``"node"`` (the ranks of
    one node, ``key`` ``(node,)``) or ``"same_card"`` (one stage's ranks on one card index,
    one per node, ``key`` ``(stage, card)``); ``ranks`` ascending."""

    kind: str
    key: tuple[int, ...]
    ranks: tuple[int, ...]


@dataclass
class HierarchicalGroups:
    """A rank's two process groups: its node's (intra-node phases) and its ``(stage, card)``
    group (cross-node phases: a rank only joins owners with its own card)."""

    node_group: Any
    same_card_group: Any


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(value: Any, name: str, tail: str = ".") -> int:
    if not _is_int(value):
        raise TypeError(
            f"{name} must be an int, got {value!r} ({type(value).__name__}){tail}")
    return int(value)


def _fmt_ranks(ranks: Sequence[int]) -> str:
    ranks = list(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return "[" + ", ".join(str(r) for r in ranks) + "]"


def _layout_text(names: Sequence[str], degrees: Mapping[str, int], gpn: int) -> str:
    axes = ", ".join(f"{n}={degrees[n]}" for n in names)
    return f"order [{axes}], gpus_per_node={gpn}"


class HierarchicalCommPlan:
    """The routing plan of ``comm_group_call_opt``: node groups, same-card groups, routes.

    A dense Muon buffer owned by ``owner`` travels in two hops: an intra-node reduce onto
    each node's rank with ``owner``'s card (``card(r) = r % gpus_per_node``), then a
    cross-node reduce among those same-card ranks onto the owner (broadcast in reverse).
    Build with :meth:`from_topology` or :meth:`from_hcg`, which validate; queries are
    table look-ups that do not re-validate.

    Attributes:
        gpus_per_node, world_size, num_nodes: the physical layout.
        axis_names, pp_degree, moe_sharding_degree, ep_degree: the topology.
    """

    def __init__(self, *, gpus_per_node: int, axis_names: tuple[str, ...],
                 degrees: dict[str, int], stage_of_rank: tuple[int, ...],
                 sharding_groups: tuple[tuple[int, ...], ...],
                 moe_sharding_lists: tuple[tuple[int, ...], ...]) -> None:
        gpn = gpus_per_node
        self.gpus_per_node: int = gpn
        self.axis_names: tuple[str, ...] = axis_names
        self._degrees = degrees
        self.pp_degree: int = degrees.get(_PIPE, 1)
        self.moe_sharding_degree: int = degrees[_MOE_SHARDING]
        self.ep_degree: int = degrees[_EXPERT]
        self.world_size: int = len(stage_of_rank)
        self.num_nodes: int = self.world_size // gpn
        self._stage_of_rank = stage_of_rank
        self._sharding_groups = sharding_groups
        self._moe_group_of_rank = {r: ranks for ranks in moe_sharding_lists for r in ranks}
        self._nodes_of_stage = tuple(tuple(sorted({r // gpn for r in ranks}))
                                     for ranks in sharding_groups)
        # one pass over the ranks (not one per card): O(world) for any gpus_per_node
        same_card: dict[tuple[int, int], list[int]] = {
            (stage, card): [] for stage in range(len(sharding_groups)) for card in range(gpn)}
        for stage, ranks in enumerate(sharding_groups):
            for r in ranks:
                same_card[(stage, r % gpn)].append(r)
        self._same_card = {key: tuple(members) for key, members in same_card.items()}

    # ---------------------------------------------------------------- build
    @classmethod
    def from_topology(cls, moe_topo: Any, gpus_per_node: int,
                      mp_degree: int = 1) -> HierarchicalCommPlan:
        """Build and validate the routing plan from the MoE topology.

        Args:
            moe_topo: a ``CommunicateTopology`` over the axes ``"pipe"`` (optional),
                ``"moe_sharding"`` and ``"expert"`` (``hcg._moe_topo`` in Paddle).
            gpus_per_node: cards per node (see :func:`resolve_gpus_per_node`).
            mp_degree: tensor-parallel degree; must be 1.

        Raises:
            TypeError: a degree is not an int, or ``moe_topo`` is not a topology.
            ValueError: a precondition of the hierarchical path fails (the message
                says which, with the values and what would work).
        """
        gpn = cls._check_gpus_per_node(gpus_per_node)
        cls._check_mp_degree(mp_degree)
        names, degrees = cls._read_axes(moe_topo)
        world = int(moe_topo.world_size())
        layout = _layout_text(names, degrees, gpn)
        if world % gpn != 0:
            raise ValueError(
                f"comm_group_call_opt: world size {world} ({layout}) is not a "
                f"multiple of gpus_per_node={gpn}, so ranks cannot be placed on "
                "whole nodes. Use a world size (pp x moe_sharding x ep) that is a "
                f"multiple of {gpn}, fix {LOCAL_SIZE_ENV}, or turn "
                "comm_group_call_opt off.")
        has_pipe = _PIPE in names
        stage_of_rank = tuple(int(getattr(moe_topo.get_coord(r), _PIPE)) if has_pipe else 0
                              for r in range(world))
        if has_pipe:  # the sharding group of stage p: entry p of every "pipe" comm list
            pipe_lists = [list(x) for x in moe_topo.get_comm_list(_PIPE)]
            sharding_groups = tuple(tuple(sorted(lst[p] for lst in pipe_lists))
                                    for p in range(degrees[_PIPE]))
        else:
            sharding_groups = (tuple(range(world)),)
        moe_lists, expert_lists = (tuple(tuple(int(r) for r in x)
                                         for x in moe_topo.get_comm_list(axis))
                                   for axis in (_MOE_SHARDING, _EXPERT))
        plan = cls(gpus_per_node=gpn, axis_names=names, degrees=degrees,
                   stage_of_rank=stage_of_rank, sharding_groups=sharding_groups,
                   moe_sharding_lists=moe_lists)
        plan._check_consistent(moe_lists + expert_lists, layout)
        plan._check_nodes(layout)
        return plan

    @classmethod
    def from_hcg(cls, hcg: Any, gpus_per_node: int) -> HierarchicalCommPlan:
        """Build and validate the routing plan from a hybrid communicate group.

        Args:
            hcg: an ``EPHybridCommunicateGroup`` (its ``_moe_topo``, mp degree and, when
                present, ``nranks`` are read).
            gpus_per_node: cards per node.

        Raises:
            ValueError: no MoE topology (ep_degree must be > 1), a world size mismatch,
                or any condition of :meth:`from_topology`.
        """
        moe_topo = getattr(hcg, "_moe_topo", None)
        if moe_topo is None:
            raise ValueError(
                "comm_group_call_opt needs the MoE topology (hcg._moe_topo), but "
                f"{type(hcg).__name__} has none: it is built by "
                "EPHybridCommunicateGroup when ep_degree > 1. Set ep_degree > 1 "
                "and moe_sharding_degree in hybrid_configs, or turn "
                "comm_group_call_opt off.")
        mp_degree = hcg.get_model_parallel_world_size()
        plan = cls.from_topology(moe_topo, gpus_per_node, mp_degree=mp_degree)
        nranks = getattr(hcg, "nranks", None)
        if nranks is not None and int(nranks) != plan.world_size:
            raise ValueError(
                f"comm_group_call_opt: the MoE topology covers {plan.world_size} "
                f"ranks but the job has {nranks} (data parallel or another axis "
                "outside pipe x moe_sharding x expert?); MoE global ranks would not "
                "match topology ranks. Use dp_degree=1 with "
                "sharding_degree = moe_sharding_degree x ep_degree, or turn "
                "comm_group_call_opt off.")
        return plan

    @staticmethod
    def _check_gpus_per_node(gpus_per_node: Any) -> int:
        gpn = _check_int(gpus_per_node, "gpus_per_node", "; pass resolve_gpus_per_node().")
        if gpn == 1:
            raise ValueError(
                "comm_group_call_opt with gpus_per_node=1: every node group and "
                "same-card step would be a single-rank group, so the hierarchical "
                "path gains nothing; turn comm_group_call_opt off (or fix "
                f"{LOCAL_SIZE_ENV} if the nodes have more cards).")
        if gpn < 1:
            raise ValueError(
                f"gpus_per_node must be >= 2 for comm_group_call_opt, got {gpn}; "
                f"set {LOCAL_SIZE_ENV} to the number of cards per node.")
        return gpn

    @staticmethod
    def _check_mp_degree(mp_degree: Any) -> None:
        mp = _check_int(mp_degree, "mp_degree")
        if mp < 1:
            raise ValueError(f"mp_degree must be >= 1, got {mp}.")
        if mp != 1:
            raise ValueError(
                f"comm_group_call_opt does not support tensor parallel: "
                f"mp_degree={mp}, it must be 1. Set mp_degree=1 or "
                "turn comm_group_call_opt off.")

    @staticmethod
    def _read_axes(moe_topo: Any) -> tuple[tuple[str, ...], dict[str, int]]:
        missing = [m for m in _TOPOLOGY_METHODS if not hasattr(moe_topo, m)]
        if missing:
            raise TypeError(
                "moe_topo must be a CommunicateTopology (hcg._moe_topo); "
                f"{type(moe_topo).__name__} lacks {missing}.")
        names = tuple(moe_topo.get_hybrid_group_names())
        unknown = [n for n in names if n not in _KNOWN_AXES]
        if unknown:
            raise ValueError(
                f"comm_group_call_opt: unknown axis names {unknown} in the MoE "
                f"topology {list(names)}; expected only {list(_KNOWN_AXES)} "
                "(pass hcg._moe_topo, not the dense topology).")
        absent = [n for n in (_MOE_SHARDING, _EXPERT) if n not in names]
        if absent:
            raise ValueError(
                f"comm_group_call_opt: the MoE topology {list(names)} has no "
                f"{absent} axis; it needs 'moe_sharding' and 'expert' "
                "(set ep_degree > 1 and moe_sharding_degree in hybrid_configs).")
        return names, {n: int(moe_topo.get_dim(n)) for n in names}

    def _check_consistent(self, sub_lists: tuple, layout: str) -> None:
        """The comm lists must agree with the coordinates (no silent bad group)."""
        stage = self._stage_of_rank
        covered = sorted(r for ranks in self._sharding_groups for r in ranks)
        if (covered != list(range(self.world_size))
                or any(stage[r] != p for p, ranks in enumerate(self._sharding_groups)
                       for r in ranks)
                or any(len({stage[r] for r in ranks}) != 1 for ranks in sub_lists)):
            raise ValueError(
                "comm_group_call_opt: the MoE topology is inconsistent: its pipe / "
                "moe_sharding / expert comm lists do not agree with get_coord() "
                f"({layout}). Pass the CommunicateTopology built by Paddle "
                "(hcg._moe_topo).")

    def _check_nodes(self, layout: str) -> None:
        """Every node inside one sharding group, each group on >= 2 nodes (so the mean
        of the per-node means is the sharding group's mean)."""
        gpn, stage_of = self.gpus_per_node, self._stage_of_rank
        mixed = [node for node in range(self.num_nodes)
                 if len({stage_of[r] for r in self.node_ranks(node)}) > 1]
        if mixed:
            node, more = mixed[0], len(mixed) - 1
            ranks = self.node_ranks(node)
            stages = [stage_of[r] for r in ranks]
            others = f" (and {more} more node{'s' if more > 1 else ''})" if more else ""
            raise ValueError(
                f"comm_group_call_opt needs every node's ranks inside one sharding "
                f"group (one pipeline stage), but node {node} (ranks "
                f"{_fmt_ranks(ranks)}) mixes pipeline stages {stages}{others} "
                f"({layout}). What works: pp_degree=1; or an expert degree that is "
                f"a multiple of gpus_per_node={gpn} with order "
                "moe_sharding->pipe->expert; or order pipe->moe_sharding->expert "
                f"with moe_sharding x ep a multiple of {gpn}; or turn "
                "comm_group_call_opt off.")
        for stage, nodes in enumerate(self._nodes_of_stage):
            if len(nodes) < 2:
                raise ValueError(
                    f"comm_group_call_opt: the sharding group of pipeline stage "
                    f"{stage} (ranks {_fmt_ranks(self._sharding_groups[stage])}, "
                    f"moe_sharding x ep = {self.moe_sharding_degree} x {self.ep_degree}) "
                    f"lies on a single node (node {nodes[0]}, gpus_per_node={gpn}): the "
                    "cross-node step would use single-rank groups and there is "
                    "nothing to gain; turn comm_group_call_opt off.")

    # -------------------------------------------------------------- queries
    def _rank(self, rank: int, what: str = "rank") -> int:
        # the one check per query: a bad rank would index another's entry or fail obscurely
        if not 0 <= rank < self.world_size:
            raise ValueError(
                f"{what} {rank} is out of range: the MoE topology has world size "
                f"{self.world_size} (valid ranks 0..{self.world_size - 1}).")
        return rank

    @staticmethod
    def _index(value: int, what: str, limit: int) -> int:
        if not 0 <= value < limit:
            raise ValueError(
                f"{what} {value!r} is out of range: valid {what}s are 0..{limit - 1}.")
        return value

    def node_of(self, rank: int) -> int:
        """Node of a global rank (``rank // gpus_per_node``)."""
        return self._rank(rank) // self.gpus_per_node

    def card_of(self, rank: int) -> int:
        """Card index of a global rank (``rank % gpus_per_node``)."""
        return self._rank(rank) % self.gpus_per_node

    def stage_of(self, rank: int) -> int:
        """Pipeline stage (sharding group index) of a global rank."""
        return self._stage_of_rank[self._rank(rank)]

    def node_ranks(self, node: int) -> tuple[int, ...]:
        """Global ranks of one node, ascending."""
        node = self._index(node, "node", self.num_nodes)
        return tuple(range(node * self.gpus_per_node, (node + 1) * self.gpus_per_node))

    def sharding_group_ranks(self, stage: int) -> tuple[int, ...]:
        """Global ranks of one stage's sharding group, ascending."""
        return self._sharding_groups[self._index(stage, "stage", self.pp_degree)]

    def nodes_of_stage(self, stage: int) -> tuple[int, ...]:
        """Nodes holding one stage's sharding group, ascending."""
        return self._nodes_of_stage[self._index(stage, "stage", self.pp_degree)]

    def same_card_ranks(self, stage: int, card: int) -> tuple[int, ...]:
        """The same-card group ``(stage, card)``: one rank per node of the stage."""
        self._index(stage, "stage", self.pp_degree)
        return self._same_card[(stage, self._index(card, "card", self.gpus_per_node))]

    def moe_sharding_ranks(self, rank: int) -> tuple[int, ...]:
        """The moe_sharding group containing ``rank``, in topology order."""
        return self._moe_group_of_rank[self._rank(rank)]

    def intra_node_root(self, owner: int, rank: int) -> int:
        """The rank of ``rank``'s node with ``owner``'s card: where its intra-node reduce goes."""
        self._same_stage(owner, rank)
        gpn = self.gpus_per_node
        return rank - rank % gpn + owner % gpn

    def in_cross_node_step(self, owner: int, rank: int) -> bool:
        """Whether ``rank`` joins the cross-node step of ``owner`` (same card)."""
        self._same_stage(owner, rank)
        return rank % self.gpus_per_node == owner % self.gpus_per_node

    def _same_stage(self, owner: int, rank: int) -> None:
        # a rank of another stage would be routed onto a node of the wrong group
        stage = self._stage_of_rank
        if stage[self._rank(owner, "owner")] != stage[self._rank(rank)]:
            raise ValueError(
                f"owner {owner} (pipeline stage {stage[owner]}) and "
                f"rank {rank} (stage {stage[rank]}) are not in the "
                "same sharding group; a dense buffer is only routed inside its "
                "owner's sharding group.")

    # --------------------------------------------------------------- groups
    def group_specs(self) -> list[GroupSpec]:
        """All groups, node groups by node then same-card groups by (stage, card): Paddle
        numbers groups by creation order, so every rank creates all of them in this order."""
        specs = [GroupSpec(_NODE, (node,), self.node_ranks(node))
                 for node in range(self.num_nodes)]
        specs.extend(GroupSpec(_SAME_CARD, key, self._same_card[key])
                     for key in sorted(self._same_card))
        return specs

    def create_groups(self, rank: int,
                      new_group: Callable[[list[int]], Any] | None = None) -> HierarchicalGroups:
        """Create every group of :meth:`group_specs` in order; return ``rank``'s two
        (its :class:`HierarchicalGroups`).

        Args:
            rank: this process's global rank.
            new_group: ``new_group(ranks_list)`` (``paddle.distributed.new_group`` when None).
        """
        rank = self._rank(rank)
        if new_group is None:
            import paddle.distributed  # lazy: only when groups are needed

            new_group = paddle.distributed.new_group
        created = {(spec.kind, spec.key): new_group(list(spec.ranks))
                   for spec in self.group_specs()}
        stage, gpn = self._stage_of_rank[rank], self.gpus_per_node
        return HierarchicalGroups(node_group=created[(_NODE, (rank // gpn,))],
                                  same_card_group=created[(_SAME_CARD, (stage, rank % gpn))])

    def spread_rank_order(self, stage: int) -> list[int]:
        """A stage's ranks ordered so owners spread evenly over cards (rails) and nodes.

        Entry ``k`` takes card ``k mod gpn`` on node ``k mod n_nodes``, each block of
        ``lcm(gpn, n_nodes)`` shifting the card (with 2 cards, the node) by one: every
        prefix is balanced to within one; each aligned run of ``gpn`` holds every card.
        """
        nodes = self.nodes_of_stage(stage)
        gpn = self.gpus_per_node
        n = len(nodes)
        block = gpn * n // math.gcd(gpn, n)
        order = []
        for k in range(gpn * n):
            shift = k // block
            if gpn > 2:
                card, node = (k + shift) % gpn, k % n
            else:
                card, node = k % gpn, (k + shift) % n
            order.append(nodes[node] * gpn + card)
        return order

    def describe(self) -> str:
        """Multi-line summary (nodes, stages, sharding and same-card groups) for logs."""
        gpn = self.gpus_per_node
        lines = ["HierarchicalCommPlan (comm_group_call_opt): world "
                 f"{self.world_size} = {self.num_nodes} nodes x {gpn} cards; "
                 + _layout_text(self.axis_names, self._degrees, gpn)]
        for node in range(self.num_nodes):
            ranks = self.node_ranks(node)
            lines.append(f"  node {node}: ranks {_fmt_ranks(ranks)}, stage "
                         f"{self._stage_of_rank[ranks[0]]}")
        for stage in range(self.pp_degree):
            lines.append(f"  stage {stage}: sharding group "
                         f"{_fmt_ranks(self._sharding_groups[stage])} "
                         f"on nodes {list(self._nodes_of_stage[stage])}")
            lines.extend(f"    same-card group (stage {stage}, card {card}): "
                         f"{list(self._same_card[(stage, card)])}" for card in range(gpn))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"HierarchicalCommPlan(world_size={self.world_size}, "
                f"gpus_per_node={self.gpus_per_node}, axes={list(self.axis_names)}, "
                f"pp={self.pp_degree}, moe_sharding={self.moe_sharding_degree}, "
                f"ep={self.ep_degree})")
