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
"""The cost model's groups and rings: what :class:`.cost_model.CostPath` derives
from a group once (its NCCL channel rings, their latencies) and the per-rank
traffic of one phase.

Rings (the cost model's docstring): ranks node by node, ``C`` channels, channel
``j`` leaving each node through its ``(j mod k)``-th rank; listed and counted
arithmetically, so a group costs O(p), not O(p x C).
"""

from __future__ import annotations

import functools
from typing import Dict, List, Optional, Tuple

__all__ = ["Group", "Phase", "Rings", "ring_structure"]


class Phase:
    """Traffic of one phase: per-rank egress and per-group latency."""

    def __init__(self, name: str, world: int) -> None:
        self.name = name
        self.intra = [0.0] * world
        self.inter = [0.0] * world
        self.latency: Dict[Tuple[int, ...], float] = {}

    def time(self, ab) -> float:
        """Largest group latency plus the busiest rank's ``inter * beta_net + intra * beta_nvlink``."""
        bw = max(
            (e * ab.beta_net + i * ab.beta_nvlink for e, i in zip(self.inter, self.intra)),
            default=0.0,
        )
        return max(self.latency.values(), default=0.0) + bw


class Rings:
    """The channel rings of one group (module docstring), without listing them.

    Ranks are taken node by node (ascending); channel ``j`` visits each node's
    ranks rotated by ``j mod k + 1`` (``k`` ranks on that node), so a group of
    ``p`` ranks on nodes of ``C`` ranks has ``C`` rings of ``p`` entries. Only
    channel 0 is listed (latency); neighbours and how often each rank sends
    are arithmetic, so a group costs O(p), not O(p x C) (16,384 ranks on
    1,024-card nodes would otherwise list 16 M entries).
    """

    def __init__(self, ranks: Tuple[int, ...], gpn: int) -> None:
        by_node: Dict[int, List[int]] = {}
        for r in ranks:  # ascending = node by node, card by card
            by_node.setdefault(r // gpn, []).append(r)
        self.blocks: List[List[int]] = [by_node[n] for n in sorted(by_node)]
        self.channels = max(len(m) for m in self.blocks)
        self.where: Dict[int, Tuple[int, int]] = {
            r: (b, j) for b, mem in enumerate(self.blocks) for j, r in enumerate(mem)}
        self.ring0 = [r for mem in self.blocks for r in mem[1:] + mem[:1]]
        self.index0 = {r: i for i, r in enumerate(self.ring0)}
        n_blocks = len(self.blocks)
        senders = []
        cards = [0] * gpn
        channels = self.channels
        for mem in self.blocks:
            k = len(mem)
            for j, r in enumerate(mem):
                # r ends its node's run in channel ch iff ch mod k == j; that hop
                # leaves the node when the group spans more than one node.
                last = channels // k + (1 if j < channels % k else 0)
                inter = last if n_blocks > 1 else 0
                senders.append((r, channels - inter, inter))
                cards[r % gpn] += inter
        self.senders = (senders, cards, sum(cards), sum(s[1] for s in senders))

    def next(self, channel: int, rank: int) -> int:
        """The rank after ``rank`` in ring ``channel``."""
        b, j = self.where[rank]
        mem = self.blocks[b]
        k = len(mem)
        if j != channel % k:  # not the last of its node's run
            return mem[(j + 1) % k]
        nxt = self.blocks[(b + 1) % len(self.blocks)]
        return nxt[(channel % len(nxt) + 1) % len(nxt)]

    def prev(self, channel: int, rank: int) -> int:
        """The rank before ``rank`` in ring ``channel``."""
        b, j = self.where[rank]
        mem = self.blocks[b]
        k = len(mem)
        if j != (channel % k + 1) % k:  # not the first of its node's run
            return mem[(j - 1) % k]
        before = self.blocks[b - 1]
        return before[channel % len(before)]

    def ring(self, channel: int) -> List[int]:
        """Ring ``channel`` listed (for tests and small groups)."""
        out: List[int] = []
        for mem in self.blocks:
            cut = channel % len(mem) + 1
            out.extend(mem[cut:] + mem[:cut])
        return out


@functools.lru_cache(maxsize=512)
def ring_structure(ranks: Tuple[int, ...], gpn: int) -> Rings:
    # Cached: the flat and hierarchical paths of both partition rules share groups.
    return Rings(ranks, gpn)


class Group:
    """One group's ranks (ascending) and what the model derives from them, once.

    Hashed by identity: a 16k-rank tuple as a dict key would be hashed at
    every look-up.
    """

    __slots__ = ("ranks", "rings", "latency")

    def __init__(self, ranks: Tuple[int, ...]) -> None:
        self.ranks = ranks
        self.rings: Optional[Rings] = None
        self.latency: Optional[Tuple[float, List[float]]] = None
