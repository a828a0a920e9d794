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
"""The simulated-world harness: the tiny MoE model with a Muon sharding optimizer.

One configuration object describes a layout (ep, moe_sharding, pp, order,
GPUs per node for comm_group_call_opt) and the optimizer options; the runner
trains every rank of it in one process (threads, real data) or records the
schedule only, and compares against the single-process reference. Used by
the suites (the conformance suite too: this module travels with its export,
so it imports only what develop has) and by ``tools/muon_comm.py verify``.
"""

from __future__ import annotations

import dataclasses
import re
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import numpy as np

import paddle
from paddle.distributed import fleet
from paddle.distributed.fleet.base.topology import CommunicateTopology

from mock.fake_hcg import DEFAULT_MOE_ORDER, make_hcg_factory, make_hybrid_strategy
from mock.simulated_world import SimulatedWorld
from muon_test_compat import (
    fleet_optimizer,
    is_fleet_wrapper,
    local_size,
    register_cpu_tensor_fusion,
    set_muon_sharding_options,
    sharded_core,
)
from muon_tiny_moe import Reference, TinyMoE, batch, make_muon

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_optimizer import (
    MuonShardingOptimizer,
)

# In tree MuonShardingOptimizer no longer registers CPU with Paddle's tensor
# fusion itself (that is 3.3.1 compat); the simulated world runs on CPU.
register_cpu_tensor_fusion()

DEFAULT_ORDER = DEFAULT_MOE_ORDER


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """A layout plus optimizer options.

    Attributes:
        ep, ms, pp: expert, moe_sharding and pipeline degrees (ep == 1: no
            experts; the sharding group is then the ms ranks of a stage).
        order: the MoE axes in topology order.
        gpn: GPUs per node; set -> comm_group_call_opt on (PADDLE_LOCAL_SIZE).
        fused: fused gradient buffers (comm_buffer_size_MB > 0).
        overlap: sharding comm_overlap (backward hooks launch the reduces).
        acc_steps: micro-batches accumulated per optimizer step.
        matrix_dtype: dtype of the dense ``w_in`` matrix (bf16: mixed dtypes).
        steps: optimizer steps.
        clip: global-norm clip (only with pp == 1: the reference is per stage).
        via_fleet: through the fleet optimizer (``muon_test_compat.fleet_optimizer``:
            the 3.3.1 compat subclass out of tree; in tree on a build whose
            HybridParallelOptimizer cannot build Muon sharding, the bare
            optimizer, see ``FLEET_WRAPPER_NOTE``), else the bare optimizer.
        use_reduce_avg: make AVG available (the CPU build reports it missing,
            which exercises SUM + scale); None: as the build reports it.
        partition: ``muon_partition_strategy``; the suites assert the
            balanced owner spread, so they ask for it (develop's rule is the
            optimizer's default).
        machine_balanced: ``machine_balanced_2d_partition`` (develop's
            machine-balanced owners; needs a data-mode world: it gathers).
        local_size: ``PADDLE_LOCAL_SIZE`` without comm_group_call_opt (the
            machine count the machine-balanced rule sees); ``gpn`` wins.
        overlap_sync_group_call: the option of that name.
        buffer_mb: ``comm_buffer_size_MB`` (None: 1 when ``fused``, else -1).
        release_grads: ``sharding_configs.release_gradients``.
    """

    ep: int = 4
    ms: int = 2
    pp: int = 1
    order: tuple = DEFAULT_ORDER
    gpn: int | None = None
    fused: bool = True
    overlap: bool = False
    acc_steps: int = 1
    matrix_dtype: str = "float32"
    steps: int = 3
    clip: bool = True
    via_fleet: bool = True
    use_reduce_avg: bool | None = False
    partition: str = "balanced"
    machine_balanced: bool = False
    local_size: int | None = None
    overlap_sync_group_call: bool = False
    buffer_mb: int | None = None
    release_grads: bool = False

    @property
    def comm_buffer_size_MB(self) -> int:
        if self.buffer_mb is not None:
            return self.buffer_mb
        return 1 if self.fused else -1

    @property
    def world(self) -> int:
        return self.ep * self.ms * self.pp

    def topology(self) -> CommunicateTopology:
        dims = {"moe_sharding": self.ms, "pipe": self.pp, "expert": self.ep}
        return CommunicateTopology(list(self.order), [dims[n] for n in self.order])

    def expert_of_rank(self) -> dict[int, int | None]:
        topo = self.topology()
        return {
            r: (topo.get_coord(r).expert if self.ep > 1 else None)
            for r in range(self.world)
        }

    def stage_ranks(self) -> list[list[int]]:
        topo = self.topology()
        stages: dict[int, list[int]] = {}
        for r in range(self.world):
            stages.setdefault(topo.get_coord(r).pipe, []).append(r)
        return [stages[p] for p in sorted(stages)]

    def strategy(self):
        strategy = make_hybrid_strategy(
            self.ep, self.ms, self.pp, order=self.order,
            comm_buffer_size_MB=self.comm_buffer_size_MB,
            comm_overlap=self.overlap,
            accumulate_steps=self.acc_steps,
        )
        if self.release_grads:
            strategy.hybrid_configs["sharding_configs"].release_gradients = True
        set_muon_sharding_options(
            strategy, use_muon_sharding=True, comm_group_call_opt=self.gpn is not None,
            partition_strategy=self.partition,
            overlap_sync_group_call=self.overlap_sync_group_call or None,
            machine_balanced_2d_partition=self.machine_balanced or None,
        )
        return strategy


@contextmanager
def _avg_supported(flag: bool | None) -> Iterator[None]:
    if flag is None:
        yield
        return
    import importlib

    module = importlib.import_module("paddle.distributed.communication.reduce")
    saved = module.is_avg_reduce_op_supported
    module.is_avg_reduce_op_supported = lambda: flag
    try:
        yield
    finally:
        module.is_avg_reduce_op_supported = saved


@dataclasses.dataclass
class RankState:
    """What one simulated rank hands back for assertions."""

    rank: int
    expert_coord: int | None
    values: dict[str, np.ndarray]
    optimizer: Any
    net: Any
    extra: Any = None


def _precision(cfg: SimConfig) -> dict:
    """Muon's ``multi_precision`` for a low-precision matrix (else nothing: the default)."""
    return {"multi_precision": True} if cfg.matrix_dtype != "float32" else {}


def build_rank(cfg: SimConfig, strategy, optimizer_cls: type = MuonShardingOptimizer,
               **opt_kwargs) -> tuple[Any, Any, Any, int | None]:
    """Construct this thread's model and sharded optimizer.

    Args:
        strategy: handed to the optimizer; None: it reads fleet's (develop's
            constructor takes ``(optimizer, hcg)`` only).
        optimizer_cls: the optimizer class under test (not with ``cfg.via_fleet``).
        opt_kwargs: to the optimizer (its injection points, e.g.
            ``gpus_per_node``); not with ``cfg.via_fleet``.

    Returns:
        (hcg, net, optimizer, expert coordinate or None).
    """
    hcg = fleet.get_hybrid_communicate_group()
    coord = hcg.get_expert_parallel_rank() if cfg.ep > 1 else None
    moe_group = hcg.get_moe_sharding_parallel_group() if cfg.ep > 1 else None
    net = TinyMoE(coord, moe_group, cfg.matrix_dtype)
    muon = make_muon(list(net.parameters()), clip=cfg.clip, **_precision(cfg))
    if cfg.via_fleet:
        assert not opt_kwargs, "fleet's wrapper builds the optimizer itself"
        opt = fleet_optimizer(muon, hcg, strategy)
    else:
        args = (muon, hcg) if strategy is None else (muon, hcg, strategy)
        opt = optimizer_cls(*args, **opt_kwargs)
    return hcg, net, opt, coord


def train_steps(cfg: SimConfig, hcg, net, opt, first_step: int = 0,
                steps: int | None = None, clear: bool = True) -> None:
    """Run optimizer steps ``first_step ..`` on this rank's batch shards
    (``clear``: clear_grad after each)."""
    rank = paddle.distributed.get_rank()
    for step in range(first_step, first_step + (cfg.steps if steps is None else steps)):
        for micro in range(cfg.acc_steps):
            loss = net(paddle.to_tensor(batch(step * cfg.acc_steps + micro, rank)))
            loss.backward()
        if not (cfg.via_fleet and is_fleet_wrapper(opt)):
            opt.reduce_gradients(list(net.parameters()), hcg)
        opt.step()
        if clear:
            opt.clear_grad()


def run_world(cfg: SimConfig, body: Callable | None = None, mode: str = "data",
              deadlock_timeout: float = 30.0, reraise_original: bool = False,
              ranks: Sequence[int] | None = None) -> tuple[list, SimulatedWorld]:
    """Run ``body(cfg, strategy)`` (default: build + train) on every rank
    (``ranks``: only these, record mode only).

    Returns:
        (per-rank results, the world with its traces).
    """
    strategy = cfg.strategy()

    def default_body(cfg: SimConfig, strategy) -> RankState:
        hcg, net, opt, coord = build_rank(cfg, strategy)
        train_steps(cfg, hcg, net, opt)
        return RankState(paddle.distributed.get_rank(), coord, net.named_values(),
                         opt, net)

    fn = body or default_body
    world = SimulatedWorld(
        cfg.world,
        hcg_factory=make_hcg_factory(cfg.ep, cfg.ms, cfg.pp, order=cfg.order),
        strategy=strategy,
        mode=mode,
        deadlock_timeout=deadlock_timeout,
        reraise_original=reraise_original,
    )
    with local_size(cfg.gpn or cfg.local_size), _avg_supported(cfg.use_reduce_avg):
        try:
            results = world.run(lambda rank: fn(cfg, strategy), ranks=ranks)
        except Exception as error:
            error.world = world  # traces for whoever debugs the failure
            raise
    return results, world


def reference_values(cfg: SimConfig, steps: int | None = None) -> dict[int, dict]:
    """Per-rank expected values from single-process runs (one per stage)."""
    expert_of_rank = cfg.expert_of_rank()
    expected: dict[int, dict] = {}
    for ranks in cfg.stage_ranks():
        ref = Reference({r: expert_of_rank[r] for r in ranks}, cfg.matrix_dtype,
                        clip=cfg.clip, micro=cfg.acc_steps, **_precision(cfg))
        for step in range(cfg.steps if steps is None else steps):
            ref.step(step)
        for r in ranks:
            expected[r] = ref.values(expert_of_rank[r])
    return expected


def max_diff(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> tuple[float, str]:
    """Largest |got - want| over the parameters and the parameter it occurs in
    (same keys required)."""
    assert got.keys() == want.keys(), f"parameter sets differ: {sorted(got)} vs {sorted(want)}"
    worst = max(got, key=lambda k: float(np.abs(got[k].astype("float64") - want[k]).max()))
    return float(np.abs(got[worst].astype("float64") - want[worst]).max()), worst


def max_abs_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """Largest |a - b| over the parameters both dicts hold (same keys required)."""
    return max_diff(a, b)[0]


class TensorParallelHcg:
    """An hcg that reports tensor parallel degree 2 (everything else delegated)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def get_model_parallel_world_size(self) -> int:
        return 2

    def __getattr__(self, item: str) -> Any:
        return getattr(self._inner, item)


class _Raised:
    """What :func:`raises` caught (``.value``)."""

    value: BaseException | None = None


@contextmanager
def raises(exc, match=None):
    """``exc`` must be raised inside the block, its message matching ``match``."""
    info = _Raised()
    try:
        yield info
    except exc as err:
        if match is not None and not re.search(match, str(err)):
            raise AssertionError(f"{type(err).__name__}({err!s}) does not match {match!r}")
        info.value = err
    else:
        raise AssertionError(f"{exc.__name__} not raised")


# --------------------------------------------------------------------------
# The comm_group_call_opt rule (DESIGN section 3) as an independent oracle
# --------------------------------------------------------------------------
class LayoutOracle:
    """DESIGN section 3 from rank coordinates alone (no topology object, no plan).

    Ranks enumerate the MoE axes in topology order, the last axis fastest;
    ``node(r) = r // gpn``, ``card(r) = r % gpn``; the sharding group of
    stage p is every rank with pipe coordinate p.
    """

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg, self.gpn, self.world = cfg, cfg.gpn, cfg.world
        dims = {"moe_sharding": cfg.ms, "pipe": cfg.pp, "expert": cfg.ep}
        self.coords = []
        for rank in range(self.world):
            coord, rest = {}, rank
            for name in reversed(cfg.order):
                coord[name], rest = rest % dims[name], rest // dims[name]
            self.coords.append(coord)

    def stage(self, rank: int) -> int:
        return self.coords[rank]["pipe"]

    def node(self, rank: int) -> tuple:
        first = rank // self.gpn * self.gpn
        return tuple(range(first, first + self.gpn))

    def sharding_group(self, rank: int) -> tuple:
        return tuple(q for q in range(self.world) if self.stage(q) == self.stage(rank))

    def moe_group(self, rank: int) -> tuple:
        return tuple(q for q in self.sharding_group(rank)
                     if self.coords[q]["expert"] == self.coords[rank]["expert"])

    def same_card(self, rank: int) -> tuple:
        return tuple(q for q in self.sharding_group(rank) if q % self.gpn == rank % self.gpn)

    def refusal(self) -> str | None:
        """None when the hierarchical path applies, else the failed condition's words."""
        if self.gpn < 2:
            return "gpus_per_node=1"
        if self.world % self.gpn:
            return f"not a multiple of gpus_per_node={self.gpn}"
        for first in range(0, self.world, self.gpn):
            if len({self.stage(r) for r in self.node(first)}) > 1:
                return "mixes pipeline stages"
        for stage_first in {self.sharding_group(r)[0] for r in range(self.world)}:
            if len({r // self.gpn for r in self.sharding_group(stage_first)}) < 2:
                return "lies on a single node"
        return None
