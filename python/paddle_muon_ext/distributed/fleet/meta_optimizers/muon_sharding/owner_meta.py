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
"""The owner partition's records: Muon matrices, their costs and the partition.

What the owner rules (:mod:`.muon_sharding_partition`) read and return:
:class:`MatrixSpec` (a matrix as the partitioner sees it), its optimizer-state
bytes and Newton-Schulz cost, :class:`OwnerPartition` (an owner map with the
per-rank loads it implies) and the input checks every rule runs. Pure Python
(no paddle import).

Cost model
----------
* optimizer-state bytes of a matrix: fp32 momentum (``numel * 4``) plus an
  fp32 master weight (``numel * 4``) when the parameter is stored in a
  sub-32-bit float (bf16/fp16/fp8) and ``multi_precision`` is on.
* NS cost of a matrix: ``max(m, n) * min(m, n) ** 2`` over the last two dims,
  summed over the leading (expert) dims, i.e. multiplied by their product.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

# dtype sizes have one home (a leaf, no paddle).
from .types import FLOAT_DTYPE_SIZES as _DTYPE_SIZES
from .types import canonical_float_dtype as _canonical_dtype
from .types import HashedTuple, dtype_itemsize

__all__ = [
    "MatrixSpec",
    "OwnerPartition",
    "newton_schulz_cost",
    "optimizer_state_bytes",
    "param_bytes",
]

@dataclass(frozen=True)
class MatrixSpec:
    """A Muon matrix as the partitioner sees it."""

    name: str
    shape: Tuple[int, ...]
    dtype: str = "float32"

    @property
    def numel(self) -> int:
        return math.prod(int(d) for d in self.shape)


def _check_shape(shape) -> Tuple[int, ...]:
    if type(shape) is tuple:
        # the common case (a MatrixSpec's shape), checked fast: a plan of
        # 100,000 matrices checks each shape a dozen times
        if len(shape) == 2:
            m, n = shape
            if type(m) is int and type(n) is int and m >= 0 and n >= 0:
                return shape
        elif len(shape) > 2 and all(type(d) is int and d >= 0 for d in shape):
            return shape
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"shape must be a sequence of ints, got {shape!r}") from None
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) and not hasattr(d, "__index__"):
            raise TypeError(f"shape must be a sequence of ints, got {shape!r}")
    dims = tuple(int(d) for d in dims)
    if any(d < 0 for d in dims):
        raise ValueError(f"shape has a negative dim: {shape!r}")
    if len(dims) < 2:
        raise ValueError(
            f"a Muon matrix needs at least 2 dims (got shape {shape!r}); "
            "1-D parameters are handled by AdamW, not by the owner partition"
        )
    return dims


def _ns_cost_int(shape) -> int:
    dims = _check_shape(shape)
    m, n = dims[-2], dims[-1]
    lead = math.prod(dims[:-2])
    lo, hi = min(m, n), max(m, n)
    return lead * hi * lo * lo


def newton_schulz_cost(shape) -> float:
    """Relative Newton-Schulz cost of one matrix: ``max(m,n)*min(m,n)**2``
    over the last two dims, times the product of the leading (expert) dims."""
    return float(_ns_cost_int(shape))


def optimizer_state_bytes(spec: MatrixSpec, multi_precision: bool = True) -> int:
    """fp32 momentum (``numel*4``), plus an fp32 master weight (``numel*4``)
    for sub-32-bit dtypes when ``multi_precision``."""
    numel = math.prod(_check_shape(spec.shape))
    nbytes = numel * 4
    if multi_precision and dtype_itemsize(spec.dtype) < 4:
        nbytes += numel * 4
    return nbytes


def param_bytes(spec: MatrixSpec) -> int:
    """Bytes of the parameter itself (what upstream's buffer size counts)."""
    return math.prod(_check_shape(spec.shape)) * dtype_itemsize(spec.dtype)


def _ratio_max_over_mean(values: Sequence[float]) -> float:
    if not values:
        return 1.0
    total = sum(values)
    if total <= 0:
        return 1.0
    return max(values) * len(values) / total


@dataclass
class OwnerPartition:
    """Owner map of one group plus the per-rank loads it implies."""

    nranks: int
    owners: Dict[str, int]
    state_bytes: List[int]
    ns_cost: List[float]
    dtypes: Dict[str, str] = field(default_factory=dict)
    method: str = "balanced"
    notes: List[str] = field(default_factory=list)

    def params_of(self, rank: int) -> List[str]:
        """Names owned by ``rank``, in the order the specs were given."""
        if not 0 <= rank < self.nranks:
            raise ValueError(f"rank {rank} out of range for nranks={self.nranks}")
        return [name for name, owner in self.owners.items() if owner == rank]

    def owner_of(self, name: str) -> int:
        return self.owners[name]

    def empty_ranks(self) -> List[int]:
        used = set(self.owners.values())
        return [r for r in range(self.nranks) if r not in used]

    def owners_by_dtype(self) -> Dict[str, List[int]]:
        """dtype -> sorted list of ranks owning at least one matrix of it."""
        out: Dict[str, set] = {}
        for name, owner in self.owners.items():
            out.setdefault(self.dtypes.get(name, "float32"), set()).add(owner)
        return {k: sorted(out[k]) for k in sorted(out)}

    def num_buffers(self) -> int:
        """Number of (owner, dtype) fused buffers the map implies."""
        return sum(len(v) for v in self.owners_by_dtype().values())

    def state_bytes_max_over_mean(self) -> float:
        return _ratio_max_over_mean(self.state_bytes)

    def ns_cost_max_over_mean(self) -> float:
        return _ratio_max_over_mean(self.ns_cost)

    def summary(self) -> dict:
        total_b = sum(self.state_bytes)
        return {
            "method": self.method,
            "nranks": self.nranks,
            "num_params": len(self.owners),
            "total_state_MB": total_b / 2**20,
            "max_state_MB": (max(self.state_bytes) if self.state_bytes else 0) / 2**20,
            "state_bytes_max_over_mean": self.state_bytes_max_over_mean(),
            "ns_cost_max_over_mean": self.ns_cost_max_over_mean(),
            "empty_ranks": len(self.empty_ranks()),
            "num_buffers": self.num_buffers(),
            "owners_by_dtype": {k: len(v) for k, v in self.owners_by_dtype().items()},
            "notes": list(self.notes),
        }


# --------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------
def _check_nranks(nranks) -> int:
    if isinstance(nranks, bool) or not isinstance(nranks, int):
        raise TypeError(f"nranks must be an int, got {type(nranks).__name__}")
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks}")
    return nranks


def _check_specs(specs) -> List[MatrixSpec]:
    if specs is None:
        raise TypeError("specs must be a sequence of MatrixSpec, got None")
    if type(specs) is HashedTuple and specs.__dict__.get("_canonical_specs"):
        # validated before (every rule of plan --recommend gets the same
        # tuple): immutable, and its frozen specs were all kept as they are
        return list(specs)
    out: List[MatrixSpec] = []
    seen = set()
    kept = True
    for s in specs:
        if type(s) is MatrixSpec and type(s.name) is str and s.name \
                and s.name not in seen and _check_shape(s.shape) is s.shape \
                and type(s.dtype) is str and s.dtype in _DTYPE_SIZES:
            seen.add(s.name)  # already canonical: kept as is
            out.append(s)
            continue
        kept = False
        for attr in ("name", "shape", "dtype"):
            if not hasattr(s, attr):
                raise TypeError(
                    f"specs must hold MatrixSpec-like objects (name, shape, dtype); "
                    f"got {s!r}"
                )
        if not isinstance(s.name, str) or not s.name:
            raise TypeError(f"spec name must be a non-empty str, got {s.name!r}")
        if s.name in seen:
            raise ValueError(f"duplicate parameter name in specs: {s.name!r}")
        seen.add(s.name)
        dims = _check_shape(s.shape)
        out.append(MatrixSpec(s.name, dims, _canonical_dtype(s.dtype)))
    if kept and type(specs) is HashedTuple:
        specs.__dict__["_canonical_specs"] = True
    return out


def _check_rank_order(rank_order, nranks: int) -> List[int]:
    if rank_order is None:
        return list(range(nranks))
    order = [int(r) for r in rank_order]
    if sorted(order) != list(range(nranks)):
        raise ValueError(
            f"rank_order must be a permutation of 0..{nranks - 1}, got {list(rank_order)!r}"
        )
    return order
