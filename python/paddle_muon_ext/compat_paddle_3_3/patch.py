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
"""``patch_paddle()``: give paddle 3.3.1 the Muon names Paddle develop has.

After one call, code written against Paddle develop runs unchanged:

* ``paddle.optimizer.Muon`` and the module ``paddle.optimizer.muon``
  (``MuonParamInfo``, ``_default_should_use_muon``, ...);
* the module ``paddle.distributed.fleet.meta_optimizers.muon_sharding_optimizer``
  (``MuonShardingOptimizer``);
* ``strategy.use_muon_sharding = True`` and
  ``strategy.hybrid_configs = {..., "sharding_configs": {"comm_group_call_opt":
  True, "muon_partition_strategy": "balanced", ...}}`` (every sharding_configs
  option of the option table, ``muon_sharding_options.SHARDING_OPTIONS``) -- accepted, read back
  from ``strategy.hybrid_configs["sharding_configs"]`` and kept through the
  deepcopy fleet makes (3.3.1 rejects both, and even a nested
  ``sharding_configs`` dict of known fields);
* ``fleet.distributed_optimizer(muon)`` -> a ``HybridParallelOptimizer`` around
  ``MuonShardingOptimizer`` when ``use_muon_sharding`` is on (also through a
  ``distributed_optimizer`` name imported before the patch); every other
  optimizer gets exactly what Paddle's own function returns;
* on a build without CUDA/XPU: a CPU entry in Paddle's tensor-fusion device
  table (:func:`.cpu_tensor_fusion.register_cpu_tensor_fusion`), which the
  optimizer's fused buffers need there -- constructing the optimizer never
  installs it, this opt-in does;
* on a gloo (CPU) job started by ``paddle.distributed.launch``: the
  collectives gloo lacks (:mod:`..distributed.fleet.utils.gloo_compat`);
* ``strategy.hybrid_configs = {...}`` checks the degrees against each other
  and the launched world size, naming the formula (Paddle's AssertionError).

Every change is recorded and :func:`unpatch_paddle` undoes it. Names the
installed Paddle already has are left alone (and logged). Nothing under the
installed paddle directory is written.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import sys
import threading
from typing import Any, Callable

import paddle
from paddle.distributed import fleet
from paddle.distributed.fleet.base import distributed_strategy as _ds
from paddle.distributed.fleet.utils import tensor_fusion_helper
from paddle.distributed.fleet.utils.log_util import logger

from ..distributed.fleet.meta_optimizers.muon_sharding.settings import SHARDING_OPTIONS
from ..distributed.fleet.meta_optimizers.muon_sharding.settings import log_once_per_job
from . import strategy_options as _strategy_options
from .cpu_tensor_fusion import register_cpu_tensor_fusion
from .strategy_options import (
    get_muon_sharding_options,
    set_muon_sharding_options,
)

__all__ = ["is_patched", "patch_paddle", "unpatch_paddle"]

MUON_MODULE = "paddle.optimizer.muon"
SHARDING_MODULE = "paddle.distributed.fleet.meta_optimizers.muon_sharding_optimizer"
# sharding_configs fields 3.3.1's proto lacks: the option table's (the exported
# patch adds this project's ones to develop's proto).
EXTRA_SHARDING_FIELDS = tuple(o.name for o in SHARDING_OPTIONS
                              if o.config_key == "sharding_configs")
_MISSING = object()


@dataclasses.dataclass
class _Change:
    """One reversible change: ``target.name`` (or ``sys.modules[name]``) was ``before``."""

    target: Any
    name: str
    before: Any

    def undo(self) -> None:
        if self.target is sys.modules:
            if self.before is _MISSING:
                sys.modules.pop(self.name, None)
            else:
                sys.modules[self.name] = self.before
        elif self.before is _MISSING:
            delattr(self.target, self.name)
        else:
            setattr(self.target, self.name, self.before)


@dataclasses.dataclass
class _Undo:
    """A change undone by a call (the gloo layer restores its own attributes)."""

    undo: Callable[[], None]


_LOCK = threading.Lock()
_CHANGES: list[_Change | _Undo] = []
_PATCHED = False


def _set(target: Any, name: str, value: Any) -> None:
    if target is sys.modules:
        before = sys.modules.get(name, _MISSING)
        sys.modules[name] = value
    else:
        before = target.__dict__.get(name, _MISSING) if isinstance(target, type) \
            else getattr(target, name, _MISSING)
        setattr(target, name, value)
    _CHANGES.append(_Change(target, name, before))


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _proto_fields() -> frozenset:
    configs = _ds.distributed_strategy_pb2.DygraphShardingConfig
    return frozenset(configs.DESCRIPTOR.fields_by_name)


# ---------------------------------------------------------------- strategy
class ShardingConfigsView:
    """``strategy.hybrid_configs["sharding_configs"]`` with develop's extra fields.

    Reads and writes of proto fields go to the proto message; the extra
    fields live in the strategy's Muon sharding options.
    """

    __slots__ = ("_proto", "_strategy")

    def __init__(self, proto: Any, strategy: Any) -> None:
        object.__setattr__(self, "_proto", proto)
        object.__setattr__(self, "_strategy", strategy)

    def __getattr__(self, name: str) -> Any:
        if name in EXTRA_SHARDING_FIELDS:
            return getattr(get_muon_sharding_options(self._strategy), name)
        return getattr(self._proto, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in EXTRA_SHARDING_FIELDS:
            set_muon_sharding_options(self._strategy, **{name: value})
        else:
            setattr(self._proto, name, value)

    def __dir__(self) -> list:
        return sorted(set(dir(self._proto)) | set(EXTRA_SHARDING_FIELDS))

    def __repr__(self) -> str:
        extras = {f: getattr(self, f) for f in EXTRA_SHARDING_FIELDS}
        return f"{self._proto!r}{extras}"


_DENSE_DEGREES = ("dp_degree", "mp_degree", "pp_degree", "sharding_degree", "sep_degree")
_MOE_DEGREES = ("pp_degree", "moe_sharding_degree", "ep_degree")


def _launched_world_size() -> int | None:
    """World size the launcher announced (None outside a launched job)."""
    raw = os.environ.get("PADDLE_TRAINERS_NUM", "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


def _product(configs: dict, names: tuple) -> tuple[int, str]:
    values = [max(int(configs[n]), 1) for n in names]
    formula = " x ".join(f"{n}({v})" for n, v in zip(names, values))
    return math.prod(values), formula


def check_hybrid_degrees(configs: dict, world_size: int | None) -> None:
    """Refuse degrees that cannot tile the job, with the formula that failed.

    Paddle finds the same mistakes later, in ``fleet.init``, as a bare
    ``Mismatch world_size`` assert; the exception type stays AssertionError.

    Args:
        configs (dict): ``strategy.hybrid_configs`` after the assignment.
        world_size (int|None): ranks of the job (None: not launched, skip that check).
    """
    dense, dense_formula = _product(configs, _DENSE_DEGREES)
    if int(configs["ep_degree"]) > 1:
        moe, moe_formula = _product(configs, _MOE_DEGREES)
        if moe != dense:
            raise AssertionError(
                f"hybrid_configs: the dense layout {dense_formula} = {dense} ranks but "
                f"the expert layout {moe_formula} = {moe} ranks; with ep_degree > 1 both "
                "must cover the same ranks (usually sharding_degree = "
                "moe_sharding_degree x ep_degree)."
            )
    if world_size is not None and int(configs["dp_degree"]) > 0 and dense != world_size:
        raise AssertionError(
            f"hybrid_configs: {dense_formula} = {dense} ranks, but the job has "
            f"{world_size} (PADDLE_TRAINERS_NUM); change the degrees or launch "
            f"--nproc_per_node x nnodes = {dense} processes."
        )


# Degrees fleet.init asserts on (>= 0), and the one it accepts at 0 but then
# fails on with a bare assert (sharding: no max(., 1) there). Other degrees
# (dp < 0 = inferred, ep / moe_sharding <= 0 = 1) are left as Paddle has them.
_NON_NEGATIVE_DEGREES = ("mp_degree", "pp_degree", "sep_degree", "cp_degree")
_POSITIVE_DEGREES = ("sharding_degree",)


class HybridConfigsError(AssertionError, ValueError):
    """A refused ``hybrid_configs`` value: Paddle's AssertionError, also a ValueError."""


def check_degree_values(configs: dict) -> None:
    """Refuse a degree that is not an int or that fleet.init would assert on.

    Keys HybridConfig lacks are left to Paddle's own unknown-key assert.

    Args:
        configs (dict): the ``hybrid_configs`` being assigned.
    """
    known = _ds.distributed_strategy_pb2.HybridConfig.DESCRIPTOR.fields_by_name
    for key, value in configs.items():
        if not key.endswith("_degree") or key not in known:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                f"hybrid_configs[{key!r}]={value!r} ({type(value).__name__}) is not "
                "an int; pass an int degree (e.g. 2)."
            )
        if key in _POSITIVE_DEGREES and value < 1:
            raise HybridConfigsError(
                f"hybrid_configs[{key!r}]={value} is out of range; use an int >= 1 "
                "(1 = no sharding)."
            )
        if key in _NON_NEGATIVE_DEGREES and value < 0:
            raise HybridConfigsError(
                f"hybrid_configs[{key!r}]={value} is out of range; use an int >= 1 "
                "(0 and 1 both mean not split)."
            )


def _snapshot_strategy(strategy: Any) -> Callable[[], None]:
    """A function that puts back what a ``hybrid_configs`` assignment may change."""
    proto = strategy.strategy.hybrid_configs
    saved_proto = type(proto)()
    saved_proto.CopyFrom(proto)
    attrs = {name: strategy.__dict__.get(name, _MISSING)
             for name in ("hybrid_parallel_order", "sync_param_name",
                          _strategy_options._ATTR)}

    def restore() -> None:
        proto.CopyFrom(saved_proto)
        for name, value in attrs.items():
            if value is _MISSING:
                strategy.__dict__.pop(name, None)
            else:
                object.__setattr__(strategy, name, value)

    return restore


def _patched_hybrid_configs(original: property) -> property:
    def getter(self):
        configs = original.fget(self)
        configs["sharding_configs"] = ShardingConfigsView(
            self.strategy.hybrid_configs.sharding_configs, self
        )
        return configs

    def setter(self, configs):
        # A refused assignment leaves the strategy as it was (Paddle's own
        # setter writes field by field and keeps what it wrote before failing).
        restore = _snapshot_strategy(self)
        try:
            _assign_hybrid_configs(self, configs)
        except BaseException:
            restore()
            raise

    def _assign_hybrid_configs(self, configs):
        configs = dict(configs)
        check_degree_values(configs)
        sharding = configs.pop("sharding_configs", None)
        if sharding is not None:
            sharding = dict(sharding)
            extras = {k: sharding.pop(k) for k in EXTRA_SHARDING_FIELDS if k in sharding}
            known = _proto_fields()
            unknown = sorted(set(sharding) - known)
            if unknown:
                raise ValueError(
                    f"hybrid_configs['sharding_configs'] has unknown field(s) "
                    f"{unknown}; known: {sorted(known | set(EXTRA_SHARDING_FIELDS))}."
                )
            proto = self.strategy.hybrid_configs.sharding_configs
            for key, value in sharding.items():
                try:
                    setattr(proto, key, value)
                except (TypeError, ValueError) as exc:
                    # protobuf's text names neither the field nor the value
                    kind = type(getattr(proto, key)).__name__
                    raise TypeError(
                        f"hybrid_configs['sharding_configs'][{key!r}]={value!r} "
                        f"({type(value).__name__}) does not fit the field ({kind}): "
                        f"{' '.join(str(exc).split())}; pass a value of its type ({kind})."
                    ) from None
            if extras:
                set_muon_sharding_options(self, **extras)
        original.fset(self, configs)
        if any(key in configs for key in _DENSE_DEGREES + _MOE_DEGREES):
            check_hybrid_degrees(original.fget(self), _launched_world_size())

    return property(getter, setter, doc=original.__doc__)


def _use_muon_sharding_property() -> property:
    def getter(self) -> bool:
        return get_muon_sharding_options(self).use_muon_sharding

    def setter(self, value: bool) -> None:
        set_muon_sharding_options(self, use_muon_sharding=value)

    return property(
        getter,
        setter,
        doc="Build MuonShardingOptimizer in fleet.distributed_optimizer (develop's switch).",
    )


# ---------------------------------------------------------------- the patch
def _patch_optimizer_module(done: list, skipped: list) -> None:
    from ..optimizer import muon as muon_module

    if hasattr(paddle.optimizer, "Muon") or _module_exists(MUON_MODULE):
        skipped.append("paddle.optimizer.Muon")
        return
    _set(sys.modules, MUON_MODULE, muon_module)
    _set(paddle.optimizer, "muon", muon_module)
    _set(paddle.optimizer, "Muon", muon_module.Muon)
    done.append("paddle.optimizer.Muon")


def _patch_sharding_module(done: list, skipped: list) -> None:
    from ..distributed.fleet.meta_optimizers import muon_sharding_optimizer as module

    if _module_exists(SHARDING_MODULE):
        skipped.append(SHARDING_MODULE)
        return
    package = importlib.import_module("paddle.distributed.fleet.meta_optimizers")
    _set(sys.modules, SHARDING_MODULE, module)
    _set(package, "muon_sharding_optimizer", module)
    done.append(SHARDING_MODULE)


def _patch_strategy(done: list, skipped: list) -> None:
    cls = _ds.DistributedStrategy
    if "use_muon_sharding" in dir(cls) or set(EXTRA_SHARDING_FIELDS) <= _proto_fields():
        skipped.append("DistributedStrategy.use_muon_sharding / sharding_configs fields")
        return
    _set(cls, "hybrid_configs", _patched_hybrid_configs(cls.__dict__["hybrid_configs"]))
    _set(cls, "use_muon_sharding", _use_muon_sharding_property())
    done.append("DistributedStrategy.use_muon_sharding / sharding_configs fields")


def _patch_distributed_optimizer(done: list, skipped: list) -> None:
    from . import fleet_integration

    _set(fleet, "distributed_optimizer", fleet_integration.distributed_optimizer)
    # A name bound before the patch (`from paddle.distributed.fleet import
    # distributed_optimizer`) calls Paddle's module function, which looks this
    # one up at call time: without it Muon would silently get Paddle's
    # DygraphShardingOptimizer.
    _set(importlib.import_module("paddle.distributed.fleet.optimizer"),
         "_dygraph_distributed_optimizer",
         fleet_integration.dygraph_distributed_optimizer)
    done.append("fleet.distributed_optimizer")


def _patch_gloo(done: list, skipped: list) -> None:
    from ..distributed.fleet.utils import gloo_compat

    # Only a launched gloo (CPU) job: NCCL jobs and single processes keep
    # paddle.distributed exactly as it is.
    if not gloo_compat.gloo_backend_selected() or gloo_compat.is_installed():
        return
    gloo_compat.install_gloo_compat(force=True)
    _CHANGES.append(_Undo(gloo_compat.uninstall_gloo_compat))
    done.append("gloo collectives (reduce_scatter, AVG, calc-stream ops, sub-groups)")


def _patch_cpu_tensor_fusion(done: list, skipped: list) -> None:
    # A CPU-only build has no CPU entry in the tensor-fusion device table, so
    # FusedCommBuffer (the sharding optimizer's buffers) asserts on CPU places.
    device_key = "__current_device_type__"
    if tensor_fusion_helper.__dict__.get(device_key) == "cpu" \
            and "cpu" in tensor_fusion_helper.alignment:
        return  # registered already (by the caller or a harness): nothing to undo
    saved_alignment = dict(tensor_fusion_helper.alignment)
    saved_device = tensor_fusion_helper.__dict__.get(device_key, _MISSING)
    if not register_cpu_tensor_fusion():
        return  # an accelerator build: left as Paddle has it

    def undo() -> None:
        tensor_fusion_helper.alignment.clear()
        tensor_fusion_helper.alignment.update(saved_alignment)
        if saved_device is _MISSING:
            tensor_fusion_helper.__dict__.pop(device_key, None)
        else:
            setattr(tensor_fusion_helper, device_key, saved_device)

    _CHANGES.append(_Undo(undo))
    done.append("CPU tensor fusion (FusedCommBuffer on CPU places)")


_STEPS: tuple[Callable[[list, list], None], ...] = (
    _patch_optimizer_module,
    _patch_sharding_module,
    _patch_strategy,
)


def patch_paddle() -> list[str]:
    """Give the installed Paddle develop's Muon names (call once, before importing them).

    Idempotent; :func:`unpatch_paddle` restores everything. On a Paddle that
    already has a name, that name is left alone and logged.

    Returns:
        list[str]: what was patched by this call (empty when already patched
        or when Paddle has everything).

    Examples:
        .. code-block:: python

            >>> import paddle_muon_ext
            >>> paddle_muon_ext.patch_paddle()
            >>> from paddle.optimizer.muon import MuonParamInfo
    """
    global _PATCHED
    with _LOCK:
        if _PATCHED:
            return []
        done: list[str] = []
        skipped: list[str] = []
        try:
            for step in _STEPS:
                step(done, skipped)
            # Only needed where this package supplies the sharding optimizer.
            if SHARDING_MODULE not in skipped:
                _patch_distributed_optimizer(done, skipped)
                _patch_cpu_tensor_fusion(done, skipped)
            _patch_gloo(done, skipped)
        except BaseException:
            _undo_all()
            raise
        _PATCHED = True
    # every rank patches: one line per job (global rank 0), the rest at debug
    if skipped:
        text = ", ".join(skipped)
        log_once_per_job("info", "patch_paddle skipped " + text,
                         "paddle_muon_ext.patch_paddle: paddle %s already has %s; left "
                         "unchanged.", paddle.__version__, text)
    if done:
        text = ", ".join(done)
        log_once_per_job("info", "patch_paddle added " + text,
                         "paddle_muon_ext.patch_paddle: added %s.", text)
    else:
        log_once_per_job("info", "patch_paddle nothing",
                         "paddle_muon_ext.patch_paddle: nothing to add; Paddle is unchanged.")
    return done


def _undo_all() -> None:
    while _CHANGES:
        _CHANGES.pop().undo()


def unpatch_paddle() -> None:
    """Undo :func:`patch_paddle` (no-op when not patched)."""
    global _PATCHED
    with _LOCK:
        _undo_all()
        _PATCHED = False


def is_patched() -> bool:
    """True between :func:`patch_paddle` and :func:`unpatch_paddle`."""
    return _PATCHED

