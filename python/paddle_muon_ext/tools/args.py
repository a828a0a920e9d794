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
"""Command-line flags shared by the tools, and the layout they describe.

One small module so every subcommand (``plan``, ``verify``, ``cluster``, ...)
parses and validates a layout the same way.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
from collections import namedtuple
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from . import limits, presets

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_ORDER",
    "DEFAULT_BUFFER_MB",
    "GridTopology",
    "MuonCommConfig",
    "add_config_args",
    "build_config",
    "load_model",
    "parse_order",
]

DEFAULT_MODEL = "ernie-moe-small"
DEFAULT_ORDER = ("moe_sharding", "pipe", "expert")
DEFAULT_BUFFER_MB = 256.0

_AXIS_ALIASES = {
    "moe_sharding": "moe_sharding",
    "ms": "moe_sharding",
    "pp": "pipe",
    "pipe": "pipe",
    "ep": "expert",
    "expert": "expert",
}


class GridTopology:
    """The rank grid of Paddle's ``CommunicateTopology``, without importing Paddle.

    Ranks number the coordinates of ``names`` (outermost first) in row-major
    order, as ``CommunicateTopology`` does; the methods are the ones
    ``HierarchicalCommPlan.from_topology`` reads, with the same results.
    The tools build layouts from this (importing Paddle was a seventh of
    ``plan``'s time on 100,000 matrices); the optimizer reads Paddle's own.

    Args:
        names: axis names, outermost first.
        dims: the degree of each axis.
    """

    def __init__(self, names: Sequence[str], dims: Sequence[int]) -> None:
        self._names = list(names)
        self._dims = [int(d) for d in dims]
        self._coordinate = namedtuple("Coordinate", self._names)
        self._world_size = math.prod(self._dims)

    def get_hybrid_group_names(self) -> List[str]:
        return self._names

    def get_dim(self, axis_name: str) -> int:
        return self._dims[self._names.index(axis_name)]

    def world_size(self) -> int:
        return self._world_size

    def get_coord(self, rank: int):
        """The coordinate namedtuple of ``rank`` (row-major, last axis fastest)."""
        if not 0 <= rank < self._world_size:
            raise ValueError(f"rank {rank} is outside the topology of {self._world_size} ranks")
        coord = []
        for d in reversed(self._dims):
            rank, c = divmod(rank, d)
            coord.append(c)
        return self._coordinate(*reversed(coord))

    def get_comm_list(self, axis_name: str) -> List[List[int]]:
        """Ranks along ``axis_name`` for every coordinate of the other axes
        (those in row-major order of the other axes)."""
        axis = self._names.index(axis_name)
        stride = math.prod(self._dims[axis + 1:])
        others = [range(d) for i, d in enumerate(self._dims) if i != axis]
        strides = [math.prod(self._dims[i + 1:]) for i in range(len(self._dims)) if i != axis]
        out = []
        for coord in itertools.product(*others):
            base = sum(c * s for c, s in zip(coord, strides))
            out.append([base + i * stride for i in range(self._dims[axis])])
        return out


@dataclass(frozen=True)
class MuonCommConfig:
    """A parallel layout and model, as given on the command line.

    Attributes:
        ep, moe_sharding, pp: expert, moe_sharding and pipeline degrees.
        gpus_per_node: cards per node.
        order: topology axis names in hybrid order, outermost first.
        model: preset name or path of a JSON parameter list.
        nodes: expected number of nodes (checked against the world size), or None.
    """

    ep: int
    moe_sharding: int
    pp: int
    gpus_per_node: int
    order: Tuple[str, ...] = DEFAULT_ORDER
    model: str = DEFAULT_MODEL
    nodes: Optional[int] = None

    @property
    def world_size(self) -> int:
        return self.pp * self.moe_sharding * self.ep

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.gpus_per_node

    def degrees(self) -> Dict[str, int]:
        """Axis name -> degree."""
        return {"pipe": self.pp, "moe_sharding": self.moe_sharding, "expert": self.ep}

    def build_topology(self) -> GridTopology:
        """The MoE topology's rank grid (what ``hcg._moe_topo`` would be), without Paddle."""
        deg = self.degrees()
        return GridTopology(list(self.order), [deg[n] for n in self.order])

    def build_plan(self):
        """The validated ``HierarchicalCommPlan`` (raises ValueError)."""
        from ..distributed.fleet.meta_optimizers.muon_sharding.comm_plan import HierarchicalCommPlan

        return HierarchicalCommPlan.from_topology(self.build_topology(), self.gpus_per_node)

    def load_params(self) -> List[presets.ParamSpec]:
        """The model's parameter list (preset or JSON file)."""
        return load_model(self.model)


def load_model(model: str) -> List[presets.ParamSpec]:
    """Parameters of a preset name or a JSON file.

    Raises:
        InputError: unknown name, unreadable file, or a bad entry (naming the
            file, the entry index and name, and the value).
    """
    if model in presets.list_presets():
        return presets.get_preset(model)
    if model.endswith(".json") or os.path.lexists(model):
        return [
            presets.ParamSpec(
                e["name"], e["shape"], e["dtype"], e["is_expert"],
                presets.muon_applies(e["name"], e["shape"])
                if e["use_muon"] is None else e["use_muon"],
            )
            for e in limits.read_model_file(model)
        ]
    raise limits.InputError(
        "--model", repr(model), "is neither a preset nor a file",
        f"use a preset ({', '.join(presets.list_presets())}) or a .json parameter list")


def add_config_args(parser: argparse.ArgumentParser, model_help: str | None = None) -> None:
    """Add the layout / model flags shared by every subcommand."""
    g = parser.add_argument_group("layout")
    g.add_argument("--ep", type=int, required=True, help="expert-parallel degree")
    g.add_argument("--moe-sharding", type=int, required=True, help="moe_sharding degree")
    g.add_argument("--pp", type=int, default=1, help="pipeline degree (default 1)")
    g.add_argument("--gpus-per-node", type=int, required=True, help="cards per node")
    g.add_argument(
        "--order",
        default="moe_sharding,pp,ep",
        help="MoE axes in topology order, outermost first; names moe_sharding, "
        "pp|pipe, ep|expert (default moe_sharding,pp,ep)",
    )
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=model_help or f"preset ({', '.join(presets.list_presets())}) or a JSON "
        f"parameter list (default {DEFAULT_MODEL})",
    )
    g.add_argument(
        "--nodes", type=int, default=None, help="expected node count (checked vs world size)"
    )


def parse_order(text: str) -> Tuple[str, ...]:
    """``"ms,pp,ep"`` -> ``("moe_sharding", "pipe", "expert")`` (ValueError if malformed)."""
    parts = [p.strip().lower() for p in str(text).split(",") if p.strip()]
    names = []
    for p in parts:
        if p not in _AXIS_ALIASES:
            raise ValueError(
                f"--order: unknown axis {p!r}; use moe_sharding, pp (or pipe), ep (or expert)"
            )
        names.append(_AXIS_ALIASES[p])
    if sorted(names) != sorted(DEFAULT_ORDER):
        raise ValueError(
            f"--order {text!r} must name each of moe_sharding, pp, ep exactly once"
        )
    return tuple(names)


def build_config(args: argparse.Namespace, max_world: int = limits.LIMITS.plan_world,
                 tool: str = "plan") -> MuonCommConfig:
    """Validate the shared flags before any work; raises InputError / ValueError.

    Args:
        args: the parsed flags.
        max_world: the largest pp x moe_sharding x ep the tool handles in
            < 60 s and < 2 GB (:data:`limits.LIMITS`).
        tool: the subcommand, named in the error.
    """
    world = 1
    for flag, value in (
        ("--ep", args.ep),
        ("--moe-sharding", args.moe_sharding),
        ("--pp", args.pp),
    ):
        limits.check_int(flag, value, 1, max_world, f"{tool} handles worlds of up to "
                         f"{max_world} ranks")
        world *= value
    limits.check_int("--gpus-per-node", args.gpus_per_node, 1, limits.LIMITS.gpus_per_node,
                     "pass the cards of one node, e.g. 8")
    if world > max_world:
        raise limits.InputError(
            "world size", f"{args.pp} x {args.moe_sharding} x {args.ep} = {world}",
            f"above the {max_world} ranks {tool} handles in < 60 s and < 2 GB",
            "model a smaller layout (the ratios repeat with the node count)")
    cfg = MuonCommConfig(
        ep=args.ep,
        moe_sharding=args.moe_sharding,
        pp=args.pp,
        gpus_per_node=args.gpus_per_node,
        order=parse_order(args.order),
        model=args.model,
        nodes=args.nodes,
    )
    if cfg.nodes is not None:
        if cfg.nodes < 1:
            raise ValueError(f"--nodes must be >= 1, got {cfg.nodes}")
        if cfg.nodes * cfg.gpus_per_node != cfg.world_size:
            raise ValueError(
                f"--nodes {cfg.nodes} x --gpus-per-node {cfg.gpus_per_node} = "
                f"{cfg.nodes * cfg.gpus_per_node} ranks, but pp x moe_sharding x ep = "
                f"{cfg.pp} x {cfg.moe_sharding} x {cfg.ep} = {cfg.world_size}"
            )
    return cfg

