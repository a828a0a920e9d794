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
"""What the Muon tests need from Paddle, out of tree (3.3.1 wheel) and in tree.

Out of tree, paddle 3.3.1 lacks the ``use_muon_sharding`` strategy field,
the ``comm_group_call_opt`` / ``muon_partition_strategy`` fields of
``sharding_configs``, a fleet optimizer that builds MuonShardingOptimizer and
a CPU entry in the tensor-fusion device table; the package's 3.3.1 compat
layer supplies them and this module hands them on. The export
(tools/export_upstream_patch.py) strips the compat block below, so in tree
(``test/collective/fleet`` of a patched Paddle) the same names use what the
build's ``paddle.distributed.fleet.proto.distributed_strategy_pb2`` offers:

* ``set_muon_sharding_options``: the proto fields when the build has them
  (``use_muon_sharding`` on the strategy itself, the others in
  ``sharding_configs``); an option the build cannot hold (other than its
  default behaviour, e.g. develop's partition rule) raises
  ``MuonCapabilityMissing``, a ``unittest.SkipTest`` (the test is skipped, a
  launched worker stops with the reason).
* ``fleet_optimizer``: Paddle's ``HybridParallelOptimizer`` when the build
  knows ``use_muon_sharding``; else the bare ``MuonShardingOptimizer`` (see
  ``FLEET_WRAPPER_NOTE``: the caller then runs ``reduce_gradients`` itself).
* ``register_cpu_tensor_fusion``: the compat helper, else the in-tree
  fallback copy below.
"""

from __future__ import annotations

import contextlib
import os
import unittest
from typing import Any, Iterator

import paddle
from paddle.distributed import fleet
from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (
    HybridParallelOptimizer,
)
from paddle.distributed.fleet.utils import tensor_fusion_helper

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_optimizer import (
    MuonShardingOptimizer,
)

_compat: Any = None
_compat_fleet: Any = None
# paddle_muon_ext: compat-begin
from paddle_muon_ext import compat_paddle_3_3 as _compat  # noqa: E402
from paddle_muon_ext.compat_paddle_3_3 import fleet_integration as _compat_fleet  # noqa: E402

# paddle_muon_ext: compat-end

__all__ = [
    "FLEET_WRAPPER_NOTE",
    "HAS_COMPAT_LAYER",
    "HAS_FLEET_WRAPPER",
    "HAS_GROUP_CALL_OPTION",
    "MuonCapabilityMissing",
    "distributed_optimizer",
    "fleet_optimizer",
    "is_fleet_wrapper",
    "register_cpu_tensor_fusion",
    "set_muon_sharding_options",
    "sharded_core",
]


class MuonCapabilityMissing(unittest.SkipTest):
    """The Paddle build lacks what a Muon test needs.

    A ``unittest.SkipTest``: unittest and pytest report the test as skipped
    with the reason; in a launched worker it ends the process with it.
    """


def _proto_fields(message: str) -> frozenset:
    """Field names of a DistributedStrategy proto message in this build."""
    try:
        from paddle.distributed.fleet.proto import distributed_strategy_pb2

        descriptor = getattr(distributed_strategy_pb2, message).DESCRIPTOR
    except (ImportError, AttributeError):  # pragma: no cover - other builds
        return frozenset()
    return frozenset(descriptor.fields_by_name)


# use_muon_sharding is a top-level strategy field; the rest live in
# hybrid_configs["sharding_configs"] (DygraphShardingConfig).
_STRATEGY_FIELDS = _proto_fields("DistributedStrategy")
_SHARDING_FIELDS = _proto_fields("DygraphShardingConfig")
# option name used by the tests -> DygraphShardingConfig field
_SHARDING_FIELD_OF = {
    "comm_group_call_opt": "comm_group_call_opt",
    "partition_strategy": "muon_partition_strategy",
    "overlap_sync_group_call": "overlap_sync_group_call",
    "machine_balanced_2d_partition": "machine_balanced_2d_partition",
}
# develop's owner rule: what MuonShardingOptimizer uses where the build has no
# muon_partition_strategy field, so asking for it needs no field
_DEVELOP_PARTITION_STRATEGY = "upstream_greedy"

#: True out of tree (the 3.3.1 compat layer is importable).
HAS_COMPAT_LAYER = _compat is not None
#: comm_group_call_opt can be switched on.
HAS_GROUP_CALL_OPTION = HAS_COMPAT_LAYER or "comm_group_call_opt" in _SHARDING_FIELDS
#: A fleet optimizer (HybridParallelOptimizer or the compat subclass) builds
#: MuonShardingOptimizer.
HAS_FLEET_WRAPPER = HAS_COMPAT_LAYER or "use_muon_sharding" in _STRATEGY_FIELDS

FLEET_WRAPPER_NOTE = (
    "this Paddle build's HybridParallelOptimizer cannot build MuonShardingOptimizer "
    "(the strategy has no use_muon_sharding field) and the 3.3.1 compat layer is "
    "absent (in-tree run): fleet_optimizer() returns the bare MuonShardingOptimizer"
)


def _missing(reason: str) -> None:
    raise MuonCapabilityMissing(reason)


def set_muon_sharding_options(strategy: Any, *, use_muon_sharding: bool | None = None,
                              comm_group_call_opt: bool | None = None,
                              partition_strategy: str | None = None,
                              overlap_sync_group_call: bool | None = None,
                              machine_balanced_2d_partition: bool | None = None) -> None:
    """Set the Muon sharding switches on ``strategy`` (after its hybrid_configs).

    A switch left as None keeps its current value. Turning
    ``comm_group_call_opt`` on where the build cannot hold it skips the test.
    """
    options = {k: v for k, v in (("use_muon_sharding", use_muon_sharding),
                                 ("comm_group_call_opt", comm_group_call_opt),
                                 ("partition_strategy", partition_strategy),
                                 ("overlap_sync_group_call", overlap_sync_group_call),
                                 ("machine_balanced_2d_partition",
                                  machine_balanced_2d_partition))
               if v is not None}
    if _compat is not None:
        _compat.set_muon_sharding_options(
            strategy, **{_SHARDING_FIELD_OF.get(k, k): v for k, v in options.items()})
        return
    configs = strategy.hybrid_configs["sharding_configs"]
    for name, value in options.items():
        if name == "use_muon_sharding":
            if "use_muon_sharding" in _STRATEGY_FIELDS:
                # the proto message under DistributedStrategy: works whether or
                # not this build also has the Python property
                strategy.strategy.use_muon_sharding = value
            # without the field fleet_optimizer() picks the bare optimizer
            # (FLEET_WRAPPER_NOTE)
            continue
        field = _SHARDING_FIELD_OF[name]
        if field in _SHARDING_FIELDS:
            setattr(configs, field, value)
        elif name == "comm_group_call_opt" and value:
            _missing("comm_group_call_opt: this Paddle build's sharding_configs has no "
                     "such field and the 3.3.1 compat layer is absent (in-tree run)")
        elif name == "overlap_sync_group_call" and value:
            _missing("overlap_sync_group_call: this Paddle build's sharding_configs has no "
                     "such field and the 3.3.1 compat layer is absent (in-tree run)")
        elif name == "machine_balanced_2d_partition" and value:
            _missing("machine_balanced_2d_partition: this Paddle build's sharding_configs "
                     "has no such field and the 3.3.1 compat layer is absent (in-tree run)")
        elif name == "partition_strategy" and value != _DEVELOP_PARTITION_STRATEGY:
            _missing("partition_strategy: no such sharding_configs field "
                     f"({field}) in this Paddle build and the 3.3.1 compat layer is "
                     "absent (in-tree run)")


def fleet_optimizer(optimizer: Any, hcg: Any, strategy: Any) -> Any:
    """The fleet-integrated Muon sharding optimizer (see FLEET_WRAPPER_NOTE)."""
    if _compat_fleet is not None:
        return _compat_fleet.MuonHybridParallelOptimizer(optimizer, hcg, strategy)
    if HAS_FLEET_WRAPPER:
        return HybridParallelOptimizer(optimizer, hcg, strategy)
    return MuonShardingOptimizer(optimizer, hcg, strategy)


def is_fleet_wrapper(opt: Any) -> bool:
    """False for a bare MuonShardingOptimizer (the caller reduces gradients)."""
    return not isinstance(opt, MuonShardingOptimizer)


def sharded_core(opt: Any) -> MuonShardingOptimizer:
    """The MuonShardingOptimizer inside a fleet wrapper (or itself)."""
    return opt if isinstance(opt, MuonShardingOptimizer) else opt._inner_opt


def distributed_optimizer(optimizer: Any, strategy: Any = None) -> Any:
    """``fleet.distributed_optimizer`` that honours use_muon_sharding."""
    if _compat_fleet is not None:
        return _compat_fleet.distributed_optimizer(optimizer, strategy)
    if not HAS_FLEET_WRAPPER:
        _missing("fleet.distributed_optimizer: " + FLEET_WRAPPER_NOTE)
    return fleet.distributed_optimizer(optimizer, strategy)


def register_cpu_tensor_fusion() -> bool:
    """Let Paddle's tensor-fusion buffers live on CPU (no-op on GPU/XPU builds).

    Out of tree MuonShardingOptimizer does this itself (compat block); in
    tree that call is gone, so the simulated-world tests call this first.
    """
    if _compat is not None:
        return _compat.register_cpu_tensor_fusion()
    # In-tree fallback: same two lines as the 3.3.1 compat helper, which the
    # export drops. Tests only; not needed where Paddle registers CPU itself.
    if paddle.is_compiled_with_cuda() or paddle.is_compiled_with_xpu():
        return False
    tensor_fusion_helper.alignment.setdefault("cpu", 256)
    tensor_fusion_helper.__current_device_type__ = "cpu"
    return True


@contextlib.contextmanager
def env_vars(**values: str | None) -> Iterator[None]:
    """Set (str) or unset (None) environment variables for the block; each is
    put back as it was afterwards, also when the block raises."""
    saved = {k: os.environ.get(k) for k in values}
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def local_size(gpn: int | None) -> contextlib.AbstractContextManager:
    """``PADDLE_LOCAL_SIZE`` (GPUs per node, as the launcher sets it); None unsets it."""
    return env_vars(PADDLE_LOCAL_SIZE=None if gpn is None else str(gpn))
