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
"""The layout functions ``plan`` builds its layouts with: the core's, with memos.

``plan --recommend`` builds a layout per route, rule, buffer size and class
of rank from one parameter list (100,000 matrices at scale). One
:class:`FastPlacement` per run shares what those layouts have in common;
each of its methods returns what the core's plain :class:`Placement` does.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import OrderedDict
from typing import Hashable

from ..distributed.fleet.meta_optimizers.muon_sharding.layout import (
    LayoutSettings,
    ParamMeta,
    Placement,
    muon_bucket_specs,
    owner_rule_inputs,
    partition_by_rule,
    split_params,
)
from ..distributed.fleet.meta_optimizers.muon_sharding.owners import (
    MatrixSpec,
    OwnerPartition,
    develop_active_ranks,
    partition_from_owners,
    upstream_partition,
)
from ..distributed.fleet.meta_optimizers.muon_sharding.settings import (
    PARTITION_BALANCED,
    PARTITION_DEVELOP,
    PARTITION_RAIL,
)
from ..distributed.fleet.meta_optimizers.muon_sharding.step_plan import (
    CommOp,
    Route,
    plain_sync_stages,
    stage_element_limit,
    stage_group_key,
    stage_inputs,
    stage_runs,
)

__all__ = ["FastPlacement", "HashedTuple", "IdentityMemo", "count_buffers"]


class HashedTuple(tuple):
    """A tuple that hashes its items once (one 100,000-matrix tuple keys the
    placement memos once per path). Equal to, and hashing as, the plain tuple
    of the same (immutable) items."""

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = tuple.__hash__(self)
        return h


class IdentityMemo:
    """Results keyed by the identity of the objects they were computed from
    (each entry holds its objects, so their ids stay unique while it lives),
    plus an optional hashable ``extra`` compared by value; oldest out first."""

    MISSING = object()

    def __init__(self, maxsize: int) -> None:
        self._entries: OrderedDict = OrderedDict()
        self._maxsize = maxsize

    def get(self, objs: tuple, extra: Hashable = ()):
        """The stored result, or ``IdentityMemo.MISSING``."""
        hit = self._entries.get((tuple(map(id, objs)), extra))
        if hit is not None and all(map(operator.is_, hit[0], objs)):
            return hit[1]
        return self.MISSING

    def put(self, objs: tuple, value, extra: Hashable = ()) -> None:
        if len(self._entries) >= self._maxsize:
            self._entries.popitem(last=False)
        self._entries[(tuple(map(id, objs)), extra)] = (objs, value)


def count_buffers(part: OwnerPartition) -> int:
    """Number of (owner, dtype) fused buffers the owner map of ``part`` implies."""
    return len({(r, part.dtypes.get(k, "float32")) for k, r in part.owners.items()})


def _relabel(partition: OwnerPartition, rank_order: tuple) -> OwnerPartition:
    """The partition with group index ``p`` renamed ``rank_order[p]``."""
    n = partition.nranks
    state, ns = [0] * n, [0.0] * n
    for p, r in enumerate(rank_order):
        state[r] = partition.state_bytes[p]
        ns[r] = partition.ns_cost[p]
    return dataclasses.replace(
        partition, owners={k: rank_order[v] for k, v in partition.owners.items()},
        state_bytes=state, ns_cost=ns, dtypes=dict(partition.dtypes))


def _key_numels(metas) -> list:
    """Elements of each Muon group key of ``metas``, keys in first-seen order: what
    :func:`stage_runs` splits."""
    numels: dict = {}
    for m in metas:
        k = stage_group_key(m)
        numels[k] = numels.get(k, 0) + m.numel
    return list(numels.values())


class FastPlacement(Placement):
    """:class:`Placement` with the memos of one tool run (results are shared: do not mutate).

    What the layouts of one run share: the parameter list's split and specs
    (reused while the same frozen metas come in the same order); each colour
    group's placement per (group, parameters, plan, settings); the owner
    partitions (the balanced rule's for a rank order is the identity order's
    renamed; develop's is run once per set of active-rank caps, which is how
    the buffer size reaches its owners); the hierarchical route's buckets as
    the flat route's renamed onto their owners where the owners are a
    renaming; the sync stages' grouping per parameters and owners (the stages
    once per runs of keys); reduce ops copied from a template.
    """

    def __init__(self) -> None:
        self._last_split: list = [(), None]
        self._last_specs: list = [(), HashedTuple()]
        self._muon: dict = {}
        self._slices: dict = {}
        self._partitions: dict = {}
        self._develop_runs: dict = {}  # (specs, nranks, caps) -> first buffer size run
        self._global_owners = IdentityMemo(64)
        self._renamings = IdentityMemo(16)
        self._num_buffers = IdentityMemo(64)
        self._stages: list = []  # the last 4 layouts' stage inputs

    # ------------------------------------------------------------ placement
    def split_params(self, params) -> tuple:
        last, split = self._last_split
        if split is not None and len(last) == len(params) \
                and all(map(operator.is_, last, params)):
            return split
        colours, muon, other, by_name = split_params(params)
        split = (colours, tuple((c, HashedTuple(ps)) for c, ps in muon),
                 tuple((c, HashedTuple(ps)) for c, ps in other), by_name)
        if all(type(p) is ParamMeta for p in params):  # frozen: cannot change behind it
            self._last_split[:] = [tuple(params), split]
        return split

    def _matrix_specs(self, params: tuple) -> HashedTuple:
        last, specs = self._last_specs
        if last is params or len(last) == len(params) and all(map(operator.is_, last, params)):
            return specs
        specs = HashedTuple(MatrixSpec(p.name, p.shape, p.dtype) for p in params)
        self._last_specs[:] = [params, specs]
        return specs

    def slice_layout(self, colour, group: tuple, params: tuple, settings: LayoutSettings):
        key = (colour, group, params, settings)
        if key not in self._slices:
            self._slices[key] = Placement.slice_layout(colour, group, params, settings)
        return self._slices[key]

    def muon_layout(self, colour, group: tuple, params: tuple, plan, settings: LayoutSettings,
                    fixed: tuple | None = None):
        if plan is None and settings.partition_strategy == PARTITION_RAIL:
            # without a plan the rail rule is the balanced one: one entry for both
            settings = dataclasses.replace(settings, partition_strategy=PARTITION_BALANCED)
        key = (colour, group, params, plan, settings, fixed)
        hit = self._muon.get(key)
        if hit is None:
            hit = self._muon[key] = self._muon_layout(colour, group, params, plan, settings,
                                                      fixed)
        return hit

    def _muon_layout(self, colour, group, params, plan, settings, fixed):
        specs = self._matrix_specs(params)
        if fixed is None:
            owner_of, partition = self._assign(specs, group, plan, settings.partition_strategy,
                                               float(settings.comm_buffer_size_MB))
        else:
            partition = partition_from_owners(specs, len(group), dict(fixed),
                                              method="machine_balanced")
            owner_of = {name: group[idx] for name, idx in fixed}
        buckets = None
        if plan is not None:
            flat_owner_of, _, flat_buckets = self.muon_layout(colour, group, params, None,
                                                              settings, fixed)
            buckets = self._renamed_buckets(flat_owner_of, flat_buckets, owner_of)
        if buckets is None:
            buckets = muon_bucket_specs(colour, group, params, owner_of, plan is not None,
                                        settings)
        return owner_of, partition, buckets

    def _assign(self, specs: HashedTuple, group: tuple, plan, strategy: str, buffer_MB: float):
        ranks = tuple(int(r) for r in group)
        strategy, rank_order, positions = owner_rule_inputs(ranks, plan, strategy)
        if strategy == PARTITION_DEVELOP:
            partition = self._develop_partition(specs, len(ranks), buffer_MB)
        else:  # only develop's rule reads the buffer size
            partition = self._partition(specs, len(ranks), rank_order, strategy, 0.0, positions)
        owners = self._global_owners.get((partition.owners,), ranks)
        if owners is IdentityMemo.MISSING:
            owners = {name: ranks[idx] for name, idx in partition.owners.items()}
            self._global_owners.put((partition.owners,), owners, ranks)
        return owners, partition

    def _partition(self, specs, nranks, rank_order, strategy, buffer_MB, positions):
        key = (specs, nranks, rank_order, strategy, buffer_MB, positions)
        hit = self._partitions.get(key)
        if hit is not None:
            return hit
        if strategy == PARTITION_BALANCED and rank_order is not None \
                and sorted(rank_order) == list(range(nranks)):
            # the balanced rule sees a rank only through its rank_order
            # position (every tie-break): the identity order's result renamed
            hit = _relabel(self._partition(specs, nranks, None, strategy, buffer_MB, None),
                           rank_order)
        else:
            hit = partition_by_rule(specs, nranks, rank_order, strategy, buffer_MB, positions)
        self._partitions[key] = hit
        return hit

    def _develop_partition(self, specs: HashedTuple, nranks: int, buffer_MB: float):
        # develop's active ranks of each dtype class are the one way the buffer
        # size reaches its owners: sizes with the same caps share one run, and
        # only the method label (which names the buffer size) differs
        key = (specs, nranks, self._develop_caps(specs, nranks, buffer_MB))
        first = self._develop_runs.setdefault(key, buffer_MB)
        partition = self._partition(specs, nranks, None, PARTITION_DEVELOP, first, None)
        if first == buffer_MB:
            return partition
        return dataclasses.replace(partition, method=upstream_partition(
            (), nranks, buffer_MB).method)

    @staticmethod
    def _develop_caps(specs: HashedTuple, nranks: int, buffer_MB: float) -> tuple:
        totals = specs.__dict__.get("_class_numels")
        if totals is None:
            by_dtype: dict = {}
            for s in specs:
                by_dtype[s.dtype] = by_dtype.get(s.dtype, 0) + s.numel
            totals = specs.__dict__["_class_numels"] = tuple(sorted(by_dtype.items()))
        return tuple((key, develop_active_ranks([total], nranks, buffer_MB))
                     for key, total in totals)

    def _renamed_buckets(self, flat_owner_of: dict, flat_buckets: tuple, owner_of: dict):
        """``flat_buckets`` on the hierarchical route with each owner renamed
        as ``flat_owner_of`` -> ``owner_of`` renames it, in bucket order; None
        when that is no one-to-one renaming of owners (the buckets then differ)."""
        rename = self._renamings.get((flat_owner_of, owner_of))
        if rename is IdentityMemo.MISSING:
            rename = {}
            for name, owner in flat_owner_of.items():
                if rename.setdefault(owner, owner_of[name]) != owner_of[name]:
                    rename = None
                    break
            if rename is not None and len(set(rename.values())) != len(rename):
                rename = None
            self._renamings.put((flat_owner_of, owner_of), rename)
        if rename is None:
            return None
        out = [dataclasses.replace(b, owner=rename[b.owner], route=Route.HIERARCHICAL)
               for b in flat_buckets]
        out.sort(key=lambda b: (b.owner, b.dtype))  # muon_bucket_specs' order
        return tuple(out)

    # ------------------------------------------------------------ step plan
    def sync_stages(self, layout) -> tuple:
        # matched by the params dict's identity (shared by the layouts of one
        # parameter list, never mutated; held so its id stays unique) and
        # equal owners, groups and rank
        for entry in self._stages:
            if entry[0] is layout.params and entry[3] == layout.rank \
                    and entry[2] == layout.groups and entry[1] == layout.owners:
                break
        else:
            inputs = stage_inputs(layout)
            numels = {c: _key_numels(ms) for c, ms in inputs[0].items()}
            entry = (layout.params, dict(layout.owners), dict(layout.groups), layout.rank,
                     inputs, numels, {})
            if len(self._stages) >= 4:
                del self._stages[0]
            self._stages.append(entry)
        limit = stage_element_limit(layout.settings.comm_buffer_size_MB)
        # the buffer size reaches the stages only through the runs of keys
        key = (tuple((c, tuple(stage_runs(ns, limit))) for c, ns in entry[5].items()),
               tuple(layout.slice_buffers))
        if key not in entry[6]:
            entry[6][key] = plain_sync_stages(layout, entry[4])
        return entry[6][key]

    @staticmethod
    def reduce_ops(template: CommOp, parts) -> list:
        # what CommOp(..., numel, ..., payload) builds, without the frozen
        # dataclass __init__ (a plan makes hundreds of thousands)
        fields = template.__dict__
        out = []
        for numel, payload in parts:
            op = object.__new__(CommOp)
            d = op.__dict__
            d.update(fields)
            d["numel"] = numel
            d["payload"] = payload
            out.append(op)
        return out

    # ---------------------------------------------------------------- plan
    def num_buffers(self, part: OwnerPartition) -> int:
        """:func:`count_buffers`, once per (owners, dtypes) maps of the run's partitions."""
        n = self._num_buffers.get((part.owners, part.dtypes))
        if n is IdentityMemo.MISSING:
            n = count_buffers(part)
            self._num_buffers.put((part.owners, part.dtypes), n)
        return n

