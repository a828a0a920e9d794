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
"""Offline communication plan of the sharded Muon optimizer (flat vs hierarchical).

Usage::

    python tools/muon_comm.py plan --ep 16 --moe-sharding 2 --pp 1 --gpus-per-node 8 \\
        [--order moe_sharding,pp,ep] [--model ernie-moe-small|file.json] [--nodes N] \\
        [--alpha-nvlink S --beta-nvlink S/B --alpha-net S --beta-net S/B] \\
        [--buffer-size-MB 256] [--backend nccl|gloo] [--json] [--png FILE]
    python tools/muon_comm.py cluster --nodes 4 --procs-per-node 2 --ep 4 --moe-sharding 2 \\
        [--steps 3] [--link-mbit 100] [--json]     (root; paddle_muon_ext.tools.cluster)

``plan`` builds the MoE topology (``CommunicateTopology`` over ``pipe``,
``moe_sharding``, ``expert`` in the given order), the
:class:`HierarchicalCommPlan` and the owner maps with
:func:`assign_muon_owners` -- exactly what ``MuonShardingOptimizer`` builds at
construction -- and counts, for one training step, the collectives and bytes of
the flat path (``comm_group_call_opt`` off) and of the hierarchical path (on).
Invalid layouts print ``error: <reason>`` on stderr and exit with status 2.

What one step communicates (both paths)
---------------------------------------
* Muon parameters of one (colour group, owner, dtype) form a *bucket*. The
  dense colour's group is the sharding group of the pipeline stage; the MoE
  colour's group is a moe_sharding group. Every EP rank holds its own copy of
  every expert matrix of its stage and each moe_sharding group partitions
  them independently.
* Gradients: each bucket is reduced onto its owner. With fused buffers
  (``--buffer-size-MB`` > 0, the optimizer default 256) a bucket's gradients
  are chunked like ``MuonShardingOptimizer._chunk_by_size`` and each chunk is
  one reduce; with 0 each parameter is one reduce. Parameters: each bucket is
  broadcast from its owner as one flat buffer.
* Flat path: the reduce / broadcast runs in the colour group. Hierarchical
  path: dense buckets reduce inside each node onto the rank with
  ``card(owner)`` (node group), then across nodes in the same-card group
  ``(stage, card(owner))``; broadcast in reverse. MoE-colour buckets stay flat.
* Non-Muon parameters (1-D, excluded names): per (colour, dtype, 256 MB chunk)
  one reduce-scatter and one all-gather in the colour group, same in both
  paths.
* With pp > 1 the parameter list is split over the stages in model order,
  contiguously, at equal cumulative parameter bytes (a stand-in for the
  layer split of the pipeline).

Bytes model (egress bytes of the sending rank; DESIGN.md section 6)
-------------------------------------------------------------------
* Node of rank ``r`` is ``r // gpn``, card ``r % gpn``. A byte is
  *inter-node* when sender and receiver sit on different nodes, else
  intra-node (NVLink). Inter-node bytes are charged to the sender's card
  index (its NIC / rail).
* A collective over a group runs NCCL-style rings. The group's ranks are
  ordered node by node (ascending), cards ascending inside a node; a group
  with ``k`` ranks on its fullest node uses ``C = k`` channels, each carrying
  ``S / C`` bytes; in channel ``j`` each node's ``(j mod k_node)``-th rank is
  the node's *exit* (last in the node's segment, the rank whose NIC sends to
  the next node), so the channels use every rail.
* Reduce of ``S`` bytes onto a root (NCCL's reduce is ring-only): per channel
  a chain along the ring that starts after the root and ends at the root --
  the ring without the edge root -> successor; each of its ``p - 1`` edges
  carries ``S / C``. Broadcast from a root: the chain root -> ... ->
  predecessor (the ring without the edge predecessor -> root). With ``n``
  nodes a channel's ring crosses ``n`` node boundaries, so a flat reduce moves
  ``(n - 1/k) * S`` across nodes on average; one rank per node (``k = 1``)
  gives exactly ``(n - 1) * S``.
* Hierarchical path, exactly: intra-node reduce -- each node's ``gpn - 1``
  non-root ranks send ``S`` over NVLink; cross-node reduce -- one rank per
  node, chain of ``n - 1`` inter-node edges, each node forwards one partial:
  ``(n - 1) * S``. Broadcast mirrors it.
* Reduce-scatter / all-gather of ``S`` bytes over ``p`` ranks: per channel
  every edge of the ring carries ``(p - 1)/p * S / C``.
* Bound (DESIGN section 6): the Muon-parameter traffic of a step needs at
  least ``sum over buffers of 2 * (n_group_nodes - 1) * bytes`` across nodes;
  ``inter_node_ratio_to_bound`` is the Muon-parameter inter-node bytes divided
  by it. Reduce-scatter / all-gather bytes are reported separately
  (``inter_node_bytes_all``) because both paths move them identically.
* Rail imbalance: Muon-parameter inter-node bytes per card index, busiest ÷
  mean over the ``gpn`` card indices (1.0 without inter-node traffic).

Time model (alpha-beta; report ratios, not absolute seconds)
------------------------------------------------------------
Defaults: ``alpha_nvlink = 5e-6 s``, ``beta_nvlink = 1/150e9 s/B`` (150 GB/s
per GPU, NVLink), ``alpha_net = 2e-5 s``, ``beta_net = 1/25e9 s/B`` (one
200 Gb/s NIC per card). A step runs these phases one after another:
reduce-scatter, the Muon reduces (flat: colour groups; hierarchical:
intra-node, cross-node, then the flat MoE groups), the Muon broadcasts
(mirror order), all-gather. Groups of one phase run concurrently. A phase
takes ``max over its groups of the latency`` + ``max over ranks of
(inter-node egress * beta_net + intra-node egress * beta_nvlink)``
(pipelined rings: bandwidth is bounded by the busiest sender). Latency of
an uncoalesced op is the alpha of each edge of its chain (p - 1 hops),
paid buffer after buffer (flat reduce / broadcast, reduce-scatter,
all-gather); a coalesced hierarchical phase pays it once:
``(gpn - 1) * alpha_nvlink`` intra-node, ``(n - 1) * alpha_net`` across.

Collectives per step are counted once per group they run in (a reduce in a
group of 16 ranks is one collective), per kind of group: ``sharding``,
``moe_sharding``, ``node``, ``same_card``. ``coalesced_launches_per_step``
counts the ``_coalescing_manager`` blocks instead (one per group and phase;
reduce-scatter / all-gather buffers are one launch each).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
if os.path.join(_HERE, "bench") not in sys.path:
    sys.path.insert(0, os.path.join(_HERE, "bench"))
if os.path.join(_REPO, "python") not in sys.path:  # fallback when PYTHONPATH is unset
    sys.path.append(os.path.join(_REPO, "python"))

import moe_presets  # noqa: E402  (tools/bench)

# importing paddle warns about a missing ccache on every run; not our concern
warnings.filterwarnings("ignore", message="No ccache found")

__all__ = [
    "MuonCommConfig",
    "add_config_args",
    "build_config",
    "AlphaBeta",
    "compute_plan",
    "format_table",
    "draw_png",
    "main",
    "TARGET_HIER_RATIO",
    "TARGET_RAIL_IMBALANCE",
]

#: Targets of the hierarchical path (checked on every run, printed with the table).
TARGET_HIER_RATIO = 1.01
TARGET_RAIL_IMBALANCE = 1.05

DEFAULT_MODEL = "ernie-moe-small"
DEFAULT_ORDER = ("moe_sharding", "pipe", "expert")
DEFAULT_BUFFER_MB = 256.0
#: Collective algorithms the bytes model knows (``--backend``).
BACKENDS = ("nccl", "gloo")

_AXIS_ALIASES = {
    "moe_sharding": "moe_sharding",
    "ms": "moe_sharding",
    "pp": "pipe",
    "pipe": "pipe",
    "ep": "expert",
    "expert": "expert",
}
_KINDS = ("sharding", "moe_sharding", "node", "same_card")


# --------------------------------------------------------------------------
# configuration (shared by the subcommands)
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class MuonCommConfig:
    """A parallel layout and model, as given on the command line.

    Attributes:
        ep: expert-parallel degree.
        moe_sharding: moe_sharding degree.
        pp: pipeline degree.
        gpus_per_node: cards per node.
        order: topology axis names (``"moe_sharding"``, ``"pipe"``,
            ``"expert"``) in hybrid order, outermost first.
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

    def build_topology(self):
        """The MoE ``CommunicateTopology`` (what ``hcg._moe_topo`` would be)."""
        from paddle.distributed.fleet.base.topology import CommunicateTopology

        deg = self.degrees()
        return CommunicateTopology(list(self.order), [deg[n] for n in self.order])

    def build_plan(self):
        """The validated :class:`HierarchicalCommPlan` (raises ValueError)."""
        from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_comm_plan import (
            HierarchicalCommPlan,
        )

        return HierarchicalCommPlan.from_topology(self.build_topology(), self.gpus_per_node)

    def load_params(self) -> List[moe_presets.ParamSpec]:
        """The model's parameter list (preset or JSON file)."""
        return load_model(self.model)


def load_model(model: str) -> List[moe_presets.ParamSpec]:
    """Parameters of a preset name or a JSON file (ValueError if neither)."""
    if model in moe_presets.list_presets():
        return moe_presets.get_preset(model)
    if model.endswith(".json") or os.path.exists(model):
        if not os.path.isfile(model):
            raise ValueError(f"model file {model!r} does not exist")
        try:
            return moe_presets.load_json(model)
        except (OSError, json.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"cannot read model file {model!r}: {exc}") from None
    raise ValueError(
        f"unknown model {model!r}: use a preset ({', '.join(moe_presets.list_presets())}) "
        "or a .json parameter list"
    )


def add_config_args(parser: argparse.ArgumentParser) -> None:
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
        help=f"preset ({', '.join(moe_presets.list_presets())}) or a JSON parameter "
        f"list (default {DEFAULT_MODEL})",
    )
    g.add_argument(
        "--nodes", type=int, default=None, help="expected node count (checked vs world size)"
    )


def _parse_order(text: str) -> Tuple[str, ...]:
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


def build_config(args: argparse.Namespace) -> MuonCommConfig:
    """Validate the shared flags; raises ValueError with a readable reason."""
    for flag, value in (
        ("--ep", args.ep),
        ("--moe-sharding", args.moe_sharding),
        ("--pp", args.pp),
        ("--gpus-per-node", args.gpus_per_node),
    ):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    cfg = MuonCommConfig(
        ep=args.ep,
        moe_sharding=args.moe_sharding,
        pp=args.pp,
        gpus_per_node=args.gpus_per_node,
        order=_parse_order(args.order),
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


# --------------------------------------------------------------------------
# cost model
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class AlphaBeta:
    """Latency (s) and inverse bandwidth (s/B) of NVLink and the network."""

    alpha_nvlink: float = 5e-6
    beta_nvlink: float = 1.0 / 150e9
    alpha_net: float = 2e-5
    beta_net: float = 1.0 / 25e9


@dataclass
class _Buffer:
    """One communication buffer of a step."""

    colour: str  # "dense" | "moe"
    stage: int
    group: Tuple[int, ...]
    owner: Optional[int]  # None for reduce-scatter / all-gather buffers
    dtype: str
    nbytes: int
    grad_chunks: List[int]  # bytes of each gradient reduce
    names: List[str] = field(default_factory=list)


class _Phase:
    """Traffic of one phase: per-rank egress and per-group latency."""

    def __init__(self, name: str, world: int) -> None:
        self.name = name
        self.intra = [0.0] * world
        self.inter = [0.0] * world
        self.latency: Dict[Tuple[int, ...], float] = {}

    def time(self, ab: AlphaBeta) -> float:
        bw = max(
            (e * ab.beta_net + i * ab.beta_nvlink for e, i in zip(self.inter, self.intra)),
            default=0.0,
        )
        return max(self.latency.values(), default=0.0) + bw


class _Path:
    """Accumulates one path's collectives and bytes."""

    def __init__(self, name: str, world: int, gpn: int, ab: AlphaBeta,
                 backend: str = "nccl") -> None:
        self.name = name
        self.backend = backend
        self.world = world
        self.gpn = gpn
        self.ab = ab
        self.phases: "OrderedDict[str, _Phase]" = OrderedDict()
        self.calls: Counter = Counter()
        self.launches: Counter = Counter()
        self.detail: Dict[str, Counter] = {k: Counter() for k in _KINDS}
        self.muon_inter = 0.0
        self.muon_intra = 0.0
        self.other_inter = 0.0
        self.other_intra = 0.0
        self.rail_muon = [0.0] * gpn
        self.rail_all = [0.0] * gpn
        self.bound = 0.0
        # per Muon colour ("dense" / "moe"): inter-node bytes, bound, rails
        self.colour_inter: Counter = Counter()
        self.colour_bound: Counter = Counter()
        self.colour_rail: Dict[str, List[float]] = {
            "dense": [0.0] * gpn, "moe": [0.0] * gpn
        }
        self._rings: Dict[Tuple[int, ...], List[List[int]]] = {}

    def phase(self, name: str) -> _Phase:
        if name not in self.phases:
            self.phases[name] = _Phase(name, self.world)
        return self.phases[name]

    # rings --------------------------------------------------------------
    def rings(self, group: Tuple[int, ...]) -> List[List[int]]:
        """One ring per channel (see the module docstring)."""
        rings = self._rings.get(group)
        if rings is None:
            gpn = self.gpn
            by_node: Dict[int, List[int]] = {}
            for r in sorted(group, key=lambda r: (r // gpn, r % gpn)):
                by_node.setdefault(r // gpn, []).append(r)
            members = [by_node[n] for n in sorted(by_node)]
            channels = max(len(m) for m in members)
            rings = []
            for j in range(channels):
                ring = []
                for mem in members:
                    cut = j % len(mem) + 1
                    ring.extend(mem[cut:] + mem[:cut])
                rings.append(ring)
            self._rings[group] = rings
        return rings

    def _send(self, ph: _Phase, src: int, dst: int, nbytes: float, muon: Optional[str]) -> bool:
        gpn = self.gpn
        if src // gpn != dst // gpn:
            ph.inter[src] += nbytes
            self.rail_all[src % gpn] += nbytes
            if muon:
                self.muon_inter += nbytes
                self.rail_muon[src % gpn] += nbytes
                self.colour_inter[muon] += nbytes
                self.colour_rail[muon][src % gpn] += nbytes
            else:
                self.other_inter += nbytes
            return True
        ph.intra[src] += nbytes
        if muon:
            self.muon_intra += nbytes
        else:
            self.other_intra += nbytes
        return False

    def _alpha(self, inter: bool) -> float:
        return self.ab.alpha_net if inter else self.ab.alpha_nvlink

    # ops ----------------------------------------------------------------
    def rooted(self, ph: _Phase, kind: str, what: str, group, root: int, nbytes: int,
               colour: str, coalesced: bool = False) -> None:
        """A reduce (``what='reduce'``) onto / broadcast from ``root`` in ``group``
        of a Muon buffer of ``colour`` (``"dense"`` / ``"moe"``)."""
        group = tuple(group)
        self.calls[kind] += 1
        self.detail[kind][what] += 1
        if len(group) < 2:
            return
        if self.backend == "gloo":
            self._gloo(ph, what, group, nbytes, colour, root, coalesced)
            return
        rings = self.rings(group)
        share = nbytes / len(rings)
        latency = 0.0
        for ch, ring in enumerate(rings):
            i = ring.index(root)
            chain = ring[i + 1:] + ring[: i + 1] if what == "reduce" else ring[i:] + ring[:i]
            for a, b in zip(chain, chain[1:]):
                inter = self._send(ph, a, b, share, colour)
                if ch == 0:
                    latency += self._alpha(inter)
        if not coalesced:
            ph.latency[group] = ph.latency.get(group, 0.0) + latency

    def ring_collective(self, ph: _Phase, kind: str, what: str, group, nbytes: int) -> None:
        """A reduce-scatter or all-gather of ``nbytes`` (whole buffer) in ``group``."""
        group = tuple(group)
        self.calls[kind] += 1
        self.launches[kind] += 1
        self.detail[kind][what] += 1
        p = len(group)
        if p < 2:
            return
        if self.backend == "gloo":
            self._gloo(ph, what, group, nbytes, None, None, False)
            return
        rings = self.rings(group)
        share = nbytes * (p - 1) / p / len(rings)
        latency = 0.0
        for ch, ring in enumerate(rings):
            for a, b in zip(ring, ring[1:] + ring[:1]):
                inter = self._send(ph, a, b, share, None)
                if ch == 0 and b != ring[0]:
                    latency += self._alpha(inter)
        ph.latency[group] = ph.latency.get(group, 0.0) + latency

    def _gloo(self, ph: _Phase, what: str, group, nbytes: int, colour: Optional[str],
              root: Optional[int], coalesced: bool) -> None:
        """One collective as gloo runs it (``paddle_muon_ext.tools.gloo_model``)."""
        from paddle_muon_ext.tools import gloo_model

        inter = False
        for a, b, size in gloo_model.collective_edges(what, group, nbytes, root):
            inter = self._send(ph, a, b, size, colour) or inter
        if not coalesced:
            ph.latency[group] = ph.latency.get(group, 0.0) + (
                gloo_model.rounds(what, len(group)) * self._alpha(inter))

    # results -------------------------------------------------------------
    def summary(self) -> Dict[str, Any]:
        intra = [0.0] * self.world
        inter = [0.0] * self.world
        for ph in self.phases.values():
            for r in range(self.world):
                intra[r] += ph.intra[r]
                inter[r] += ph.inter[r]
        phase_times = OrderedDict((n, ph.time(self.ab)) for n, ph in self.phases.items())
        muon_time = sum(t for n, t in phase_times.items() if n not in _OTHER_PHASES)
        return {
            "collectives_per_step": {k: self.calls[k] for k in _KINDS},
            "collectives_total": sum(self.calls[k] for k in _KINDS),
            "collectives_detail": {k: dict(self.detail[k]) for k in _KINDS},
            "coalesced_launches_per_step": {k: self.launches[k] for k in _KINDS},
            "inter_node_bytes": self.muon_inter,
            "inter_node_bytes_bound": self.bound,
            "inter_node_ratio_to_bound": (self.muon_inter / self.bound) if self.bound else 1.0,
            "intra_node_bytes": self.muon_intra,
            "inter_node_bytes_all": self.muon_inter + self.other_inter,
            "intra_node_bytes_all": self.muon_intra + self.other_intra,
            "bytes_per_rank": {
                "intra_node": {"max": max(intra), "mean": sum(intra) / self.world},
                "inter_node": {"max": max(inter), "mean": sum(inter) / self.world},
            },
            "rail_bytes": list(self.rail_muon),
            "rail_imbalance": _max_over_mean(self.rail_muon),
            "rail_imbalance_all": _max_over_mean(self.rail_all),
            "by_colour": {
                colour: {
                    "inter_node_bytes": self.colour_inter[colour],
                    "inter_node_bytes_bound": self.colour_bound[colour],
                    "inter_node_ratio_to_bound": _ratio(self.colour_inter[colour],
                                                        self.colour_bound[colour]),
                    "rail_bytes": list(self.colour_rail[colour]),
                    "rail_imbalance": _max_over_mean(self.colour_rail[colour]),
                }
                for colour in ("dense", "moe")
            },
            "estimated_time_s": sum(phase_times.values()),
            "estimated_muon_time_s": muon_time,
            "estimated_time_phases_s": dict(phase_times),
        }


_OTHER_PHASES = ("reduce_scatter", "all_gather")


def _max_over_mean(values: Sequence[float]) -> float:
    total = sum(values)
    if total <= 0:
        return 1.0
    return max(values) * len(values) / total


# --------------------------------------------------------------------------
# the plan
# --------------------------------------------------------------------------
def _itemsize(dtype: str) -> int:
    from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_partition import (
        dtype_itemsize,
    )

    return dtype_itemsize(dtype)


def _pbytes(p: moe_presets.ParamSpec) -> int:
    try:
        size = _itemsize(p.dtype)
    except ValueError:
        size = {"int64": 8, "int32": 4, "int8": 1, "uint8": 1, "bool": 1}.get(p.dtype, 4)
    return p.numel * size


def split_stages(params: Sequence[moe_presets.ParamSpec], pp: int) -> List[List[moe_presets.ParamSpec]]:
    """Contiguous split in model order at equal cumulative parameter bytes."""
    stages: List[List[moe_presets.ParamSpec]] = [[] for _ in range(pp)]
    total = sum(_pbytes(p) for p in params) or 1
    before = 0
    for p in params:
        b = _pbytes(p)
        mid = before + b / 2.0
        stages[min(pp - 1, int(mid * pp // total))].append(p)
        before += b
    return stages


def _chunks(sizes: Sequence[int], limit_mb: float) -> List[int]:
    """Byte size of each fused buffer, as ``MuonShardingOptimizer._chunk_by_size``."""
    if limit_mb <= 0:
        return list(sizes)
    limit = limit_mb * 1024 * 1024
    out: List[int] = []
    size = 0
    for b in sizes:
        if out and size + b > limit:
            out.append(0)
            size = 0
        if not out:
            out.append(0)
        out[-1] += b
        size += b
    return out


def _muon_buckets(colour, stage, group, params, owners) -> List[_Buffer]:
    grouped: "OrderedDict[Tuple[int, str], List[moe_presets.ParamSpec]]" = OrderedDict()
    for p in params:
        grouped.setdefault((owners[p.name], p.dtype), []).append(p)
    return [
        _Buffer(colour, stage, tuple(group), owner, dtype,
                sum(_pbytes(p) for p in ps), [_pbytes(p) for p in ps], [p.name for p in ps])
        for (owner, dtype), ps in sorted(grouped.items())
    ]


def _other_buffers(colour, stage, group, params, limit_mb) -> List[_Buffer]:
    by_dtype: "OrderedDict[str, List[moe_presets.ParamSpec]]" = OrderedDict()
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    out = []
    for dtype, ps in by_dtype.items():
        sizes = [_pbytes(p) for p in ps]
        chunks = _chunks(sizes, limit_mb) if limit_mb > 0 else [sum(sizes)]
        for c in chunks:
            out.append(_Buffer(colour, stage, tuple(group), None, dtype, c, [c]))
    return out


def compute_plan(
    cfg: MuonCommConfig,
    ab: AlphaBeta = AlphaBeta(),
    buffer_size_MB: float = DEFAULT_BUFFER_MB,
    params: Optional[Sequence[moe_presets.ParamSpec]] = None,
    backend: str = "nccl",
) -> Dict[str, Any]:
    """Build the plan of ``cfg`` and count one step of both paths.

    ``backend`` picks the collective algorithms: ``"nccl"`` (rings, the GPU
    model of the module docstring) or ``"gloo"`` (CPU clusters, as measured:
    :mod:`paddle_muon_ext.tools.gloo_model`, with the test compat layer's
    reduce_scatter = all_reduce).

    Returns:
        dict: JSON-ready; keys ``flat``, ``hierarchical`` (see :meth:`_Path.summary`),
        ``optimizer_state_max_over_mean`` and layout / model facts.

    Raises:
        ValueError: invalid layout (the plan's message) or model.
    """
    from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_optimizer import (
        assign_muon_owners,
    )
    from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_partition import (
        balance_floor,
    )

    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    plan = cfg.build_plan()
    if params is None:
        params = cfg.load_params()
    world, gpn = plan.world_size, plan.gpus_per_node
    stages = split_stages(params, cfg.pp)

    result_paths: Dict[str, Any] = {}
    owners_per_rank: Dict[str, List[int]] = {}
    state_ratio: Dict[str, float] = {}
    buckets_info: Dict[str, Any] = {}
    partitions_info: Dict[str, Any] = {}
    owned_detail: Dict[str, Any] = {}
    for path_name, hierarchical in (("flat", False), ("hierarchical", True)):
        dense_b: List[_Buffer] = []
        moe_b: List[_Buffer] = []
        other_b: List[_Buffer] = []
        state = [0] * world
        owned = [0] * world
        owned_dense = [0] * world
        dense_bytes = [0] * world
        part_rows = []
        moe_cache: Dict[Tuple[int, int], Any] = {}
        for stage, sparams in enumerate(stages):
            sgroup = plan.sharding_group_ranks(stage)
            dense = [p for p in sparams if p.use_muon and not p.is_expert]
            expert = [p for p in sparams if p.use_muon and p.is_expert]
            if dense:
                owners, part = assign_muon_owners(
                    [p.to_matrix_spec() for p in dense], list(sgroup),
                    plan=plan if hierarchical else None,
                )
                for idx, r in enumerate(sgroup):
                    state[r] += part.state_bytes[idx]
                for p in dense:
                    r = owners[p.name]
                    owned[r] += 1
                    owned_dense[r] += 1
                    dense_bytes[r] += _pbytes(p)
                dense_b += _muon_buckets("dense", stage, sgroup, dense, owners)
                part_rows.append({
                    "colour": "dense", "stage": stage, "nranks": len(sgroup),
                    "num_params": len(dense), "num_buckets": part.num_buffers(),
                    "state_bytes_max_over_mean": part.state_bytes_max_over_mean(),
                    "state_floor": balance_floor([p.to_matrix_spec() for p in dense],
                                                 len(sgroup))[0],
                })
            mgroups = sorted({plan.moe_sharding_ranks(r) for r in sgroup})
            for mgroup in mgroups:
                if expert:
                    # Same specs, same group size and no plan: every moe_sharding
                    # group of the stage derives the same group-local partition;
                    # call assign_muon_owners once per stage and map the indices.
                    key = (stage, len(mgroup))
                    if key not in moe_cache:
                        moe_cache[key] = assign_muon_owners(
                            [p.to_matrix_spec() for p in expert], list(range(len(mgroup)))
                        )
                    local, part = moe_cache[key]
                    owners = {k: mgroup[v] for k, v in local.items()}
                    for idx, r in enumerate(mgroup):
                        state[r] += part.state_bytes[idx]
                    for r in owners.values():
                        owned[r] += 1
                    moe_b += _muon_buckets("moe", stage, mgroup, expert, owners)
                other_b += _other_buffers(
                    "moe", stage, mgroup,
                    [p for p in sparams if p.is_expert and not p.use_muon], buffer_size_MB,
                )
            if expert:
                part = moe_cache[(stage, len(mgroups[0]))][1]
                part_rows.append({
                    "colour": "moe", "stage": stage, "nranks": len(mgroups[0]),
                    "groups": len(mgroups), "num_params": len(expert),
                    "num_buckets": part.num_buffers(),
                    "state_bytes_max_over_mean": part.state_bytes_max_over_mean(),
                    "state_floor": balance_floor([p.to_matrix_spec() for p in expert],
                                                 len(mgroups[0]))[0],
                })
            other_b = _other_buffers(
                "dense", stage, sgroup,
                [p for p in sparams if not p.is_expert and not p.use_muon], buffer_size_MB,
            ) + other_b

        path = _Path(path_name, world, gpn, ab, backend)
        _walk(path, plan, hierarchical, dense_b, moe_b, other_b, buffer_size_MB)
        result_paths[path_name] = path.summary()
        result_paths[path_name]["optimizer_state_max_over_mean"] = _max_over_mean(state)
        result_paths[path_name]["num_buckets"] = {"dense": len(dense_b), "moe": len(moe_b)}
        result_paths[path_name]["num_other_buffers"] = len(other_b)
        owners_per_rank[path_name] = owned
        owned_detail[path_name] = {
            "dense": owned_dense,
            "moe": [a - b for a, b in zip(owned, owned_dense)],
            "dense_param_bytes": dense_bytes,
        }
        state_ratio[path_name] = _max_over_mean(state)
        buckets_info[path_name] = [
            {"colour": b.colour, "stage": b.stage, "owner": b.owner, "dtype": b.dtype,
             "bytes": b.nbytes, "grad_chunks": len(b.grad_chunks),
             "group_nodes": len({r // gpn for r in b.group})}
            for b in dense_b + moe_b
        ]
        partitions_info[path_name] = part_rows

    flat, hier = result_paths["flat"], result_paths["hierarchical"]
    muon = [p for p in params if p.use_muon]
    res = {
        "config": {
            "ep": cfg.ep, "moe_sharding": cfg.moe_sharding, "pp": cfg.pp,
            "gpus_per_node": gpn, "order": list(cfg.order), "model": cfg.model,
            "buffer_size_MB": buffer_size_MB, "backend": backend,
        },
        "world_size": world,
        "num_nodes": plan.num_nodes,
        "model_summary": {
            "params": len(params),
            "muon_params": len(muon),
            "muon_dense": sum(1 for p in muon if not p.is_expert),
            "muon_expert": sum(1 for p in muon if p.is_expert),
            "other_params": len(params) - len(muon),
        },
        "groups": _group_facts(plan),
        "alpha_beta": {
            "alpha_nvlink_s": ab.alpha_nvlink, "beta_nvlink_s_per_B": ab.beta_nvlink,
            "alpha_net_s": ab.alpha_net, "beta_net_s_per_B": ab.beta_net,
        },
        "flat": flat,
        "hierarchical": hier,
        "optimizer_state_max_over_mean": state_ratio["hierarchical"],
        "partitions": partitions_info["hierarchical"],
        "owners_per_rank": owners_per_rank,
        "owned_by_colour": owned_detail,
        "buckets": buckets_info,
        "hierarchical_over_flat": {
            "inter_node_bytes": _ratio(hier["inter_node_bytes"], flat["inter_node_bytes"]),
            "estimated_time_s": _ratio(hier["estimated_time_s"], flat["estimated_time_s"]),
            "estimated_muon_time_s": _ratio(hier["estimated_muon_time_s"],
                                            flat["estimated_muon_time_s"]),
        },
    }
    res["targets"] = {
        "hierarchical_ratio_to_bound_max": TARGET_HIER_RATIO,
        "rail_imbalance_max": TARGET_RAIL_IMBALANCE,
        "hierarchical_ratio_to_bound": hier["inter_node_ratio_to_bound"],
        "rail_imbalance": hier["rail_imbalance"],
        "ratio_met": hier["inter_node_ratio_to_bound"] <= TARGET_HIER_RATIO,
        "rail_met": hier["rail_imbalance"] <= TARGET_RAIL_IMBALANCE,
    }
    res["targets"]["met"] = res["targets"]["ratio_met"] and res["targets"]["rail_met"]
    # Not part of the target (which covers all Muon-parameter traffic): the
    # dense cross-node phase alone, whose rails follow the dense owners' cards.
    dense_rail = hier["by_colour"]["dense"]["rail_imbalance"]
    res["targets"]["dense_rail_imbalance"] = dense_rail
    res["targets"]["dense_rail_within"] = dense_rail <= TARGET_RAIL_IMBALANCE
    res["plan_description"] = plan.describe()
    res["_plan"] = plan  # dropped before JSON output
    return res


def _ratio(a: float, b: float) -> float:
    return a / b if b else 1.0


def _group_facts(plan) -> Dict[str, Any]:
    gpn = plan.gpus_per_node
    moe = sorted({plan.moe_sharding_ranks(r) for r in range(plan.world_size)})
    specs = plan.group_specs()
    node = [s for s in specs if s.kind == "node"]
    same = [s for s in specs if s.kind == "same_card"]
    sharding = [plan.sharding_group_ranks(p) for p in range(plan.pp_degree)]
    return {
        "sharding": {"count": len(sharding), "size": len(sharding[0]),
                     "nodes_spanned": len({r // gpn for r in sharding[0]})},
        "moe_sharding": {"count": len(moe), "size": len(moe[0]),
                         "nodes_spanned": max(len({r // gpn for r in g}) for g in moe)},
        "node": {"count": len(node), "size": len(node[0].ranks)},
        "same_card": {"count": len(same), "size": len(same[0].ranks)},
    }


def _walk(path: _Path, plan, hierarchical: bool, dense_b, moe_b, other_b, buffer_mb) -> None:
    """Issue one step's collectives of one path (order of the optimizer)."""
    gpn = plan.gpus_per_node
    kind_of = {"dense": "sharding", "moe": "moe_sharding"}

    # Bound: 2 * (nodes of the group - 1) * bytes per Muon buffer.
    for b in dense_b + moe_b:
        n = len({r // gpn for r in b.group})
        path.bound += 2 * (n - 1) * b.nbytes
        path.colour_bound[b.colour] += 2 * (n - 1) * b.nbytes

    def grads(b: _Buffer) -> List[int]:
        return _chunks(b.grad_chunks, buffer_mb)

    ph = path.phase("reduce_scatter")
    for b in other_b:
        path.ring_collective(ph, kind_of[b.colour], "reduce_scatter", b.group, b.nbytes)

    def flat_ops(buffers, what, phase_name):
        ph = path.phase(phase_name)
        launched = set()
        for b in buffers:
            kind = kind_of[b.colour]
            if b.group not in launched:
                launched.add(b.group)
                path.launches[kind] += 1
            for size in (grads(b) if what == "reduce" else [b.nbytes]):
                path.rooted(ph, kind, what, b.group, b.owner, size, b.colour)

    def node_phase(what):
        ph = path.phase(f"intra_node_{what}")
        nodes = sorted({r // gpn for b in dense_b for r in b.group})
        for node in nodes:
            ranks = plan.node_ranks(node)
            used = False
            for b in dense_b:
                if node * gpn not in b.group:
                    continue
                root = plan.intra_node_root(b.owner, ranks[0])
                for size in (grads(b) if what == "reduce" else [b.nbytes]):
                    path.rooted(ph, "node", what, ranks, root, size, "dense",
                                coalesced=True)
                used = True
            if used:
                path.launches["node"] += 1
                ph.latency[ranks] = (gpn - 1) * path.ab.alpha_nvlink

    def cross_phase(what):
        ph = path.phase(f"cross_node_{what}")
        used = set()
        for b in dense_b:
            key = plan.cross_node_key(b.owner)
            ranks = plan.same_card_ranks(*key)
            for size in (grads(b) if what == "reduce" else [b.nbytes]):
                path.rooted(ph, "same_card", what, ranks, b.owner, size, "dense",
                            coalesced=True)
            if ranks not in used:
                used.add(ranks)
                path.launches["same_card"] += 1
                ph.latency[ranks] = (len(ranks) - 1) * path.ab.alpha_net

    if hierarchical:
        node_phase("reduce")
        cross_phase("reduce")
        flat_ops(moe_b, "reduce", "moe_reduce")
        cross_phase("broadcast")
        node_phase("broadcast")
        flat_ops(moe_b, "broadcast", "moe_broadcast")
    else:
        flat_ops(dense_b, "reduce", "dense_reduce")
        flat_ops(moe_b, "reduce", "moe_reduce")
        flat_ops(dense_b, "broadcast", "dense_broadcast")
        flat_ops(moe_b, "broadcast", "moe_broadcast")

    ph = path.phase("all_gather")
    for b in other_b:
        path.ring_collective(ph, kind_of[b.colour], "all_gather", b.group, b.nbytes)


# --------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------
def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _fmt_time(t: float) -> str:
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.2f} ms"
    return f"{t * 1e6:.1f} us"


def format_table(res: Dict[str, Any]) -> str:
    """Human-readable report of :func:`compute_plan`'s result."""
    c = res["config"]
    f, h = res["flat"], res["hierarchical"]
    ms = res["model_summary"]
    order = ", ".join(
        f"{n}={ {'pipe': c['pp'], 'moe_sharding': c['moe_sharding'], 'expert': c['ep']}[n] }"
        for n in c["order"]
    )
    lines = [
        f"Muon comm plan: world {res['world_size']} = {res['num_nodes']} nodes x "
        f"{c['gpus_per_node']} cards; order [{order}]",
        f"model {c['model']}: {ms['params']} params, {ms['muon_params']} Muon "
        f"({ms['muon_dense']} dense, {ms['muon_expert']} expert per EP rank), "
        f"{ms['other_params']} other; grad buffers {c['buffer_size_MB']:g} MB",
    ]
    g = res["groups"]
    lines.append(
        "groups: " + "; ".join(
            f"{k} {g[k]['count']} x {g[k]['size']} ranks" for k in _KINDS
        )
    )
    lines.append("")
    rows: List[Tuple[str, str, str]] = []

    def row(label, fv, hv):
        rows.append((label, fv, hv))

    row("Muon buckets (dense / moe)",
        f"{f['num_buckets']['dense']} / {f['num_buckets']['moe']}",
        f"{h['num_buckets']['dense']} / {h['num_buckets']['moe']}")
    for k in _KINDS:
        row(f"collectives/step: {k}", str(f["collectives_per_step"][k]),
            str(h["collectives_per_step"][k]))
    row("collectives/step: total", str(f["collectives_total"]), str(h["collectives_total"]))
    row("coalesced launches/step", str(sum(f["coalesced_launches_per_step"].values())),
        str(sum(h["coalesced_launches_per_step"].values())))
    for link, label in (("intra_node", "intra-node"), ("inter_node", "inter-node")):
        row(f"bytes/rank {label} max / mean",
            f"{_fmt_bytes(f['bytes_per_rank'][link]['max'])} / "
            f"{_fmt_bytes(f['bytes_per_rank'][link]['mean'])}",
            f"{_fmt_bytes(h['bytes_per_rank'][link]['max'])} / "
            f"{_fmt_bytes(h['bytes_per_rank'][link]['mean'])}")
    row("inter-node bytes, Muon params", _fmt_bytes(f["inter_node_bytes"]),
        _fmt_bytes(h["inter_node_bytes"]))
    row("  lower bound (DESIGN 6)", _fmt_bytes(f["inter_node_bytes_bound"]),
        _fmt_bytes(h["inter_node_bytes_bound"]))
    row("  ratio to bound", f"{f['inter_node_ratio_to_bound']:.4f}",
        f"{h['inter_node_ratio_to_bound']:.4f}")
    row("inter-node bytes, all (+RS/AG)", _fmt_bytes(f["inter_node_bytes_all"]),
        _fmt_bytes(h["inter_node_bytes_all"]))
    row("rail imbalance (busiest/mean)", f"{f['rail_imbalance']:.4f}",
        f"{h['rail_imbalance']:.4f}")
    for colour, label in (("dense", "dense colour"), ("moe", "MoE colour")):
        fc, hc = f["by_colour"][colour], h["by_colour"][colour]
        row(f"  {label}: ratio / rail imbalance",
            f"{fc['inter_node_ratio_to_bound']:.4f} / {fc['rail_imbalance']:.4f}",
            f"{hc['inter_node_ratio_to_bound']:.4f} / {hc['rail_imbalance']:.4f}")
    row("optimizer state max/mean", f"{f['optimizer_state_max_over_mean']:.4f}",
        f"{h['optimizer_state_max_over_mean']:.4f}")
    row("est. time Muon comm (a-b)", _fmt_time(f["estimated_muon_time_s"]),
        _fmt_time(h["estimated_muon_time_s"]))
    row("est. time step comm (a-b)", _fmt_time(f["estimated_time_s"]),
        _fmt_time(h["estimated_time_s"]))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(max(len(r[1]) for r in rows), len("flat"))
    lines.append(f"{'':<{w0}}  {'flat':>{w1}}  hierarchical")
    for label, fv, hv in rows:
        lines.append(f"{label:<{w0}}  {fv:>{w1}}  {hv}")
    r = res["hierarchical_over_flat"]
    lines.append("")
    lines.append(
        f"hierarchical / flat: Muon inter-node bytes {r['inter_node_bytes']:.3f}, "
        f"Muon comm time {r['estimated_muon_time_s']:.3f}, step comm time "
        f"{r['estimated_time_s']:.3f}"
    )
    for p in res["partitions"]:
        lines.append(
            f"partition {p['colour']} stage {p['stage']}: {p['num_params']} matrices over "
            f"{p['nranks']} ranks, {p['num_buckets']} buckets, state max/mean "
            f"{p['state_bytes_max_over_mean']:.3f} (floor {p['state_floor']:.3f})"
        )
    ab = res["alpha_beta"]
    lines.append(
        f"alpha-beta: NVLink alpha {ab['alpha_nvlink_s']:g} s, beta {ab['beta_nvlink_s_per_B']:.3g} "
        f"s/B ({1 / ab['beta_nvlink_s_per_B'] / 1e9:.0f} GB/s); network alpha "
        f"{ab['alpha_net_s']:g} s, beta {ab['beta_net_s_per_B']:.3g} s/B "
        f"({1 / ab['beta_net_s_per_B'] / 1e9:.0f} GB/s)"
    )
    t = res["targets"]
    lines.append(
        f"target hierarchical ratio to bound <= {t['hierarchical_ratio_to_bound_max']}: "
        f"{t['hierarchical_ratio_to_bound']:.4f} {'met' if t['ratio_met'] else 'MISSED'}"
    )
    lines.append(
        f"target rail imbalance <= {t['rail_imbalance_max']}: {t['rail_imbalance']:.4f} "
        f"{'met' if t['rail_met'] else 'MISSED'}"
    )
    lines.append(
        f"info (not a target): dense cross-node phase alone, rail imbalance "
        f"{t['dense_rail_imbalance']:.4f} "
        f"({'within' if t['dense_rail_within'] else 'above'} {t['rail_imbalance_max']})"
    )
    return "\n".join(lines)


def draw_png(res: Dict[str, Any], path: str) -> None:
    """Nodes x cards grid of the hierarchical path: colour = dense Muon parameter
    bytes owned by the rank (what crosses the rank's rail), text = rank and owned
    matrices (dense ``D``, MoE colour ``E``); same-card groups as coloured lines,
    pipeline stages as dashed outlines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plan = res["_plan"]
    gpn, nodes = plan.gpus_per_node, plan.num_nodes
    detail = res["owned_by_colour"]["hierarchical"]
    mb = [b / 2**20 for b in detail["dense_param_bytes"]]
    grid = [[mb[n * gpn + c] for c in range(gpn)] for n in range(nodes)]
    top = max(max(mb), 1e-9)
    fig, ax = plt.subplots(figsize=(max(6.5, 1.5 + 0.95 * gpn), max(3.5, 1.6 + 0.55 * nodes)))
    img = ax.imshow(grid, cmap="Blues", aspect="auto", vmin=0, vmax=top)
    for n in range(nodes):
        for c in range(gpn):
            r = n * gpn + c
            ax.text(c - 0.08, n, f"r{r}\nD{detail['dense'][r]} E{detail['moe'][r]}",
                    ha="center", va="center", fontsize=6.5,
                    color="white" if mb[r] > 0.6 * top else "black")
    cmap = plt.get_cmap("tab10" if gpn <= 10 else "tab20")
    for stage in range(plan.pp_degree):
        for c in range(gpn):
            ranks = plan.same_card_ranks(stage, c)
            ys = [r // gpn for r in ranks]
            ax.plot([c + 0.36] * len(ys), ys, "-o", color=cmap(c % cmap.N), lw=1.5, ms=3,
                    alpha=0.85)
        stage_nodes = plan.nodes_of_stage(stage)
        ax.add_patch(plt.Rectangle((-0.5, min(stage_nodes) - 0.5), gpn, len(stage_nodes),
                                   fill=False, ec="red", lw=1.2, ls="--"))
    ax.set_xticks(range(gpn))
    ax.set_xticklabels([f"card {c}" for c in range(gpn)], fontsize=7)
    ax.set_yticks(range(nodes))
    ax.set_yticklabels([f"node {n}" for n in range(nodes)], fontsize=7)
    h = res["hierarchical"]
    c = res["config"]
    ax.set_title(
        f"ep={c['ep']} ms={c['moe_sharding']} pp={c['pp']} gpn={gpn} (hierarchical path)\n"
        f"ratio to bound {h['inter_node_ratio_to_bound']:.3f}, rail imbalance "
        f"{h['rail_imbalance']:.3f} (dense {h['by_colour']['dense']['rail_imbalance']:.3f}); "
        "lines: same-card groups",
        fontsize=8,
    )
    fig.colorbar(img, ax=ax, fraction=0.04, label="dense Muon MiB owned")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _json_ready(res: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in res.items() if not k.startswith("_")}


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------
def _nonneg_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="muon_comm.py", description="Communication plan of the sharded Muon optimizer."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "plan", help="count collectives / bytes of the flat and hierarchical paths",
        description="Count one step's collectives and bytes of the flat and the "
        "hierarchical (comm_group_call_opt) path; see the module docstring for the model.",
    )
    add_config_args(p)
    d = AlphaBeta()
    cost = p.add_argument_group("alpha-beta model")
    cost.add_argument("--alpha-nvlink", type=_nonneg_float, default=d.alpha_nvlink,
                      help=f"NVLink latency per hop, s (default {d.alpha_nvlink:g})")
    cost.add_argument("--beta-nvlink", type=_nonneg_float, default=d.beta_nvlink,
                      help=f"NVLink s/B (default {d.beta_nvlink:.3g} = 150 GB/s)")
    cost.add_argument("--alpha-net", type=_nonneg_float, default=d.alpha_net,
                      help=f"network latency per hop, s (default {d.alpha_net:g})")
    cost.add_argument("--beta-net", type=_nonneg_float, default=d.beta_net,
                      help=f"network s/B per NIC (default {d.beta_net:.3g} = 25 GB/s)")
    p.add_argument("--buffer-size-MB", type=_nonneg_float, default=DEFAULT_BUFFER_MB,
                   help="fused gradient buffer size (sharding_configs.comm_buffer_size_MB; "
                   "0 = one reduce per parameter; default 256)")
    p.add_argument("--backend", choices=BACKENDS, default="nccl",
                   help="collective algorithms: nccl rings (GPU, default) or gloo as "
                   "measured on the namespace cluster (CPU)")
    p.add_argument("--json", action="store_true", help="print a JSON dict instead of the table")
    p.add_argument("--png", metavar="FILE", help="draw nodes x cards with owners and rails")
    add_verify_parser(sub)
    _cluster_tool().add_parser(sub)
    return parser


def _cmd_plan(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    ab = AlphaBeta(args.alpha_nvlink, args.beta_nvlink, args.alpha_net, args.beta_net)
    res = compute_plan(cfg, ab, buffer_size_MB=args.buffer_size_MB, backend=args.backend)
    if args.png:
        draw_png(res, args.png)
    if args.json:
        print(json.dumps(_json_ready(res), indent=1))
    else:
        print(format_table(res))
        if args.png:
            print(f"wrote {args.png}")
    return 0


# ---------------------------------------------------------------------------
# verify: the schedule checker and the simulated world on one layout
# ---------------------------------------------------------------------------
VERIFY_MODEL = "tiny-moe"
#: Largest world the data-moving simulated world runs by default; larger
#: worlds are verified schedule-only (every rank, every collective).
DATA_MAX_RANKS = 64


def add_verify_parser(sub) -> None:
    v = sub.add_parser(
        "verify",
        help="run the schedule checker and the simulated world on one layout",
        description="Build the layout, check every rank's collective schedule with "
        "comm_group_call_opt on and off, train the tiny MoE test model in the simulated "
        "world (real data, one thread per rank) with the option on and off, and compare "
        "against a single-process Muon reference. Exit 0 PASS, 1 FAIL, 2 invalid layout.",
    )
    add_config_args(v)
    v.set_defaults(model=VERIFY_MODEL)
    v.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    v.add_argument("--data-max-ranks", type=int, default=DATA_MAX_RANKS,
                   help=f"largest world that moves data (default {DATA_MAX_RANKS}); "
                   "larger ones run schedule-only")
    v.add_argument("--json", action="store_true", help="also print a JSON summary")


def _test_paths() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for sub in ("test", os.path.join("test", "collective", "fleet")):
        path = os.path.join(root, sub)
        if path not in sys.path:
            sys.path.insert(0, path)


def run_verify(cfg: MuonCommConfig, steps: int = 3, data_max_ranks: int = DATA_MAX_RANKS,
               progress=print) -> Dict:
    """Verify one layout; returns the summary dict (``status`` PASS/FAIL).

    Raises:
        ValueError: the layout is invalid for comm_group_call_opt.
    """
    if cfg.model != VERIFY_MODEL:
        raise ValueError(
            f"verify trains the built-in {VERIFY_MODEL!r} test model; --model {cfg.model!r} "
            "is for the plan command"
        )
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    cfg.build_plan()  # the optimizer would raise the same message at construction
    _test_paths()
    import time

    from muon_sim_runner import SimConfig, max_abs_diff, reference_values, run_world

    base = SimConfig(ep=cfg.ep, ms=cfg.moe_sharding, pp=cfg.pp, order=cfg.order,
                     gpn=cfg.gpus_per_node, steps=steps, clip=cfg.pp == 1)
    off = SimConfig(**{**base.__dict__, "gpn": None})
    summary: Dict = {"ranks": base.world, "steps": steps, "mode": "data"}
    problems: List[str] = []
    for label, sim in (("hierarchical", base), ("flat", off)):
        t0 = time.perf_counter()
        _, world = run_world(sim, mode="record")
        report = world.check_schedule()
        summary[f"schedule_{label}_ok"] = bool(report.ok)
        progress(f"[verify] schedule {label}: {base.world} ranks, "
                 f"{sum(len(t) for t in world.traces)} events, "
                 f"{'consistent' if report.ok else 'MISMATCH'} ({time.perf_counter() - t0:.1f}s)")
        if not report.ok:
            problems.append(f"{label} schedule: {report.summary()}")
    if base.world > data_max_ranks:
        summary["mode"] = "schedule-only"
        progress(f"[verify] {base.world} ranks > --data-max-ranks {data_max_ranks}: "
                 "schedule-only, no data moved")
        summary["max_abs_diff_hier_vs_flat"] = None
        summary["max_abs_diff_vs_reference"] = None
    else:
        t0 = time.perf_counter()
        hier, _ = run_world(base)
        flat, _ = run_world(off)
        expected = reference_values(base)
        d_hf = max(max_abs_diff(a.values, b.values) for a, b in zip(hier, flat))
        d_ref = max(max(max_abs_diff(a.values, expected[a.rank]) for a in res)
                    for res in (hier, flat))
        summary["max_abs_diff_hier_vs_flat"] = d_hf
        summary["max_abs_diff_vs_reference"] = d_ref
        progress(f"[verify] simulated world: {base.world} ranks x {steps} steps, option on "
                 f"and off ({time.perf_counter() - t0:.1f}s)")
        # fp32, differing only in reduction order: see test_muon_group_call.py.
        if not (d_hf <= 1e-5 and d_ref <= 1e-5):
            problems.append(f"parameters differ: hier vs flat {d_hf:.3e}, vs reference "
                            f"{d_ref:.3e} (tolerance 1e-5)")
    summary["status"] = "FAIL" if problems else "PASS"
    summary["problems"] = problems
    return summary


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3e}"


def _cmd_verify(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    import logging

    from paddle.distributed.fleet.utils.log_util import logger as fleet_logger

    # Every simulated rank would log its construction; keep the output to
    # verify's own progress lines.
    fleet_logger.setLevel(logging.ERROR)
    summary = run_verify(cfg, steps=args.steps, data_max_ranks=args.data_max_ranks)
    if args.json:
        print(json.dumps(summary, indent=1))
    for problem in summary["problems"]:
        print(f"  {problem}")
    mode = "" if summary["mode"] == "data" else " mode=schedule-only"
    print(f"{summary['status']} ranks={summary['ranks']}{mode} "
          f"max_abs_diff_hier_vs_flat={_fmt(summary['max_abs_diff_hier_vs_flat'])} "
          f"max_abs_diff_vs_reference={_fmt(summary['max_abs_diff_vs_reference'])}")
    return 0 if summary["status"] == "PASS" else 1


# ---------------------------------------------------------------------------
# cluster: a real multi-node run in network namespaces, measured vs predicted
# ---------------------------------------------------------------------------
def _cluster_tool():
    from paddle_muon_ext.tools import cluster

    return cluster


def predict_cluster(ccfg) -> Dict[str, Any]:
    """The plan tool's gloo prediction for a cluster run's layout and model.

    Returns:
        dict: ``{"off": {...}, "on": {...}}`` with ``inter_node_bytes`` (every
        collective of a step) and ``dense_muon_bytes`` per path.
    """
    cfg = MuonCommConfig(ep=ccfg.ep, moe_sharding=ccfg.moe_sharding, pp=1,
                         gpus_per_node=ccfg.procs_per_node, model="cluster tiny MoE")
    params = [moe_presets.ParamSpec(p["name"], tuple(p["shape"]), "float32", p["is_expert"],
                                    p["use_muon"])
              for p in _cluster_tool().tiny_moe_params(ccfg.hidden, ccfg.inner)]
    res = compute_plan(cfg, AlphaBeta(), buffer_size_MB=_cluster_tool().WORKER_BUFFER_MB,
                       params=params, backend="gloo")
    return {
        tag: {"inter_node_bytes": res[path]["inter_node_bytes_all"],
              "muon_bytes": res[path]["inter_node_bytes"],
              "dense_muon_bytes": res[path]["by_colour"]["dense"]["inter_node_bytes"],
              "moe_muon_bytes": res[path]["by_colour"]["moe"]["inter_node_bytes"]}
        for tag, path in (("off", "flat"), ("on", "hierarchical"))
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "plan":
            return _cmd_plan(args)
        if args.command == "verify":
            return _cmd_verify(args)
        if args.command == "cluster":
            return _cluster_tool().main(args, predict=predict_cluster)
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
