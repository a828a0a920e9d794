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
"""develop's attribute and method names of ``MuonShardingOptimizer``, derived read-only
from the runtime, the settings and the hcg; kept for develop's callers and tests."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import paddle
from paddle import framework
from paddle.distributed.fleet.utils.log_util import logger

from . import build
from .layout import DEFAULT_COLOUR, DEFAULT_RAW_COLOUR, NO_HOOK_COLOURS, is_hooked, parse_colour
from .owners import partition_2d_parameters
from .runtime import (PendingCollective, ShardingRuntime, _backward_hook, _Call, comm_phase,
                      create_slice_param, flatten_into, get_param_grad, launch_all_gather,
                      launch_coalesced, unpack_all)
from .step_plan import Op, SyncTrigger, Trigger, flat_broadcast_phase

__all__ = ["DevelopSurface"]


def _derived(getter, name: str, source: str,
             fix: str = "change the strategy and build a new optimizer") -> property:
    """A read-only develop name. develop stores a copy; here the buffers, hooks and step
    plan were built from the value, so a write would be ignored: it is refused."""
    def refuse(self, value):
        raise AttributeError(
            f"{type(self).__name__}.{name} is read-only (got {value!r}): it is {source}, "
            f"fixed when the optimizer was built; {fix}")
    return property(getter, refuse, doc=f"develop's name for {source}.")


def _setting(field: str, name: str | None = None) -> property:
    return _derived(lambda self: getattr(self._settings, field), name or field,
                    f"the strategy's {field} option")


def _hcg(getter: str, name: str) -> property:
    return _derived(lambda self: getattr(self._hcg, getter)(), name, f"hcg.{getter}()")


def _rt(field: str) -> property:
    return property(lambda self: getattr(self._runtime, field),
                    doc=f"develop's name for the runtime's ``{field}``.")


class DevelopSurface:
    """develop's names over ``self._runtime`` / ``self._settings`` / ``self._hcg``."""

    _NO_HOOK_COLORS = frozenset(NO_HOOK_COLOURS)  # develop's shared (MTP) colours

    # ------------------------------------------------ config mirrors (read-only)
    tensor_fusion = _setting("tensor_fusion")
    accumulate_steps = _setting("accumulate_steps")
    comm_overlap = _setting("comm_overlap")
    comm_buffer_size_MB = _setting("comm_buffer_size_MB")
    enable_fuse_optimizer_states = _setting("enable_fuse_optimizer_states")
    use_group_call_opt = _setting("comm_group_call_opt", "use_group_call_opt")
    pp_overlap = _setting("pp_sharding_comm_overlap", "pp_overlap")
    sd_release_grads = _setting("release_grads", "sd_release_grads")
    _use_fuse_gradients = _setting("fused", "_use_fuse_gradients")
    machine_balanced_2d_partition = _setting("machine_balanced_2d_partition")
    _enable_timer = _setting("enable_optimizer_timer", "_enable_timer")
    _use_pipeline_parallel = _derived(lambda self: self._settings.pp_degree > 1,
                                      "_use_pipeline_parallel", "the strategy's pp_degree > 1")
    # the option as honoured: False where the build has no AVG reduce
    use_reduce_avg = _derived(lambda self: self._runtime.use_avg, "use_reduce_avg",
                              "the strategy's use_reduce_avg option as this build honours it")
    _default_group = _hcg("get_sharding_parallel_group", "_default_group")
    _sharding_world_size = _hcg("get_sharding_parallel_world_size", "_sharding_world_size")
    _sharding_rank = _hcg("get_sharding_parallel_rank", "_sharding_rank")
    _origin_parameter_list = _derived(lambda self: self._parameter_list, "_origin_parameter_list",
                                      "the parameter list it was built with",
                                      "build a new optimizer")
    _shared_colors = _derived(lambda self: self._compute_shared_colors(self._parameter_list),
                              "_shared_colors", "the colours of the parameters it was built with",
                              "build a new optimizer")

    # ------------------------------------------------ what the build made
    _global_rank = _rt("rank")
    trainer_comms = _rt("trainer_comms")
    trainer_same_card_comms = _rt("trainer_same_card_comms")
    overlap_optimize_and_sync = _rt("overlap_optimize_and_sync")
    timers = _rt("timers")
    _use_main_grad = _rt("use_main_grad")
    _sync_stages = property(lambda self: stage_dicts(self._runtime) if self._runtime.staged
                            else None)
    _slice_params = _rt("slice_params")
    _comm_buffer_list = _rt("rs_buffers")
    _local_parameter_list = _rt("local_params")
    comm_buffer_2d = property(lambda self: self._runtime.fused_2d_buffers())
    _local_2d = property(lambda self: self._runtime.owned_muon_params())
    _local_parameter_list_1d = property(lambda self: self._runtime.local_slice_params())
    _muon_param_info_map = property(lambda self: self._runtime.base_opt._muon_param_info_map)
    _sync_only_buffers = property(lambda self: self._overlap_split()[0])
    _overlap_comm_buffers = property(lambda self: self._overlap_split()[1])
    _sync_only_buffer_ids = property(lambda self: {id(b) for b in self._sync_only_buffers})

    @property
    def _color_to_comm_buffer_list(self) -> OrderedDict:
        """Raw colour (``-1`` for the default) -> its element-wise buffers."""
        rt, out = self._runtime, OrderedDict()
        for buffer in rt.rs_buffers:
            colour = rt.rs_colour[id(buffer)]
            out.setdefault(DEFAULT_RAW_COLOUR if colour is DEFAULT_COLOUR else colour,
                           []).append(buffer)
        return out

    @property
    def param2bucket(self) -> OrderedDict:
        """Parameter name -> the fused buffers holding it."""
        out: OrderedDict = OrderedDict()
        for buffer in self._runtime.all_buffers():
            for p in buffer.params:
                out.setdefault(p.name, []).append(buffer)
        return out

    @property
    def _color_to_group_info(self) -> OrderedDict:
        return self._build_color_to_group_info_from_params(self._parameter_list,
                                                           self._default_group)

    @property
    def _params_1d(self) -> list:
        """The element-wise parameters, colour by colour (first-seen order)."""
        rt, by_colour = self._runtime, OrderedDict()
        for name, meta in rt.layout.params.items():
            if name not in rt.layout.owners:
                by_colour.setdefault(meta.colour, []).append(rt.param_by_name[name])
        return [p for params in by_colour.values() for p in params]

    @property
    def _rank2params_2d_by_color(self) -> OrderedDict:
        """Colour -> {owner's position in the colour group -> its matrices}."""
        rt, out = self._runtime, OrderedDict()
        for name, meta in rt.layout.params.items():
            if name in rt.layout.owners:
                ranks = list(rt.colour_groups[meta.colour].ranks)
                by_rank = out.setdefault(meta.colour, OrderedDict(
                    (i, []) for i in range(len(ranks))))
                by_rank[ranks.index(rt.layout.owners[name])].append(rt.param_by_name[name])
        return out

    @property
    def _param2rank_2d_by_color(self) -> OrderedDict:
        return OrderedDict((c, OrderedDict((p.name, i) for i, ps in by_rank.items()
                                           for p in ps))
                           for c, by_rank in self._rank2params_2d_by_color.items())

    @property
    def _params_2d_by_color(self) -> OrderedDict:
        """Colour -> its matrices in model order, sorted stably by owner (as develop)."""
        return OrderedDict((c, [p for ps in by_rank.values() for p in ps])
                           for c, by_rank in self._rank2params_2d_by_color.items())

    def _overlap_split(self) -> tuple[list, list]:
        """develop's ``(_sync_only_buffers, _overlap_comm_buffers)``: split by the hook
        colour rule even with ``comm_overlap`` off, one-rank groups kept; the fused 2-D
        buffers are overlap only without group call or with ``comm_overlap``."""
        rt = self._runtime
        fused_2d = [(b, bucket.colour) for bucket in rt.muon_buckets for b in bucket.buffers]
        slices = [(b, rt.rs_colour[id(b)]) for b in rt.rs_buffers]
        sync_only = [b for b, colour in fused_2d + slices if not is_hooked(True, colour)]
        overlap_2d = fused_2d if (not self.use_group_call_opt or self.comm_overlap) else []
        return sync_only, [b for b, colour in overlap_2d + slices if is_hooked(True, colour)]

    # ------------------------------------------------ develop's methods
    _create_slice_param = staticmethod(create_slice_param)
    _get_param_grad = staticmethod(get_param_grad)

    @staticmethod
    def _build_color_to_group_info_from_params(params, sharding_group) -> OrderedDict:
        """Colour key -> ``{'group', 'world_size', 'rank'}``: None first, dict colours as seen."""
        def entry(group) -> dict:
            return {"group": group, "world_size": len(group.ranks), "rank": group.rank}

        info = OrderedDict([(DEFAULT_COLOUR, entry(sharding_group))])
        for param in params:
            parsed = parse_colour(getattr(param, "color", None), sharding_group)
            if parsed.from_dict and parsed.key is not DEFAULT_COLOUR and parsed.key not in info:
                info[parsed.key] = entry(parsed.group)
        return info

    @staticmethod
    def _buffer_color(buffer):
        """A buffer's colour, read from its first parameter as develop does."""
        if not buffer.params:
            return None
        parsed = parse_colour(getattr(buffer.params[0], "color", None))
        return parsed.declared if parsed.from_dict else parsed.key

    @classmethod
    def _compute_shared_colors(cls, params) -> set:
        """The no-hook colours among the dict colours of ``params``."""
        parsed = (parse_colour(getattr(param, "color", None)) for param in params)
        return {c.declared for c in parsed if c.from_dict} & cls._NO_HOOK_COLORS

    @classmethod
    def _select_sync_only_buffers(cls, buffers, shared_colors) -> list:
        """The buffers of a shared colour, in order."""
        return [b for b in buffers if cls._buffer_color(b) in shared_colors]

    def _partition_2d_parameters(self, params: list, world_size: int,
                                 label: str = "") -> dict[int, list]:
        """develop's owner rule, per dtype: rank -> its whole-matrix parameters. Reads only
        ``comm_buffer_size_MB`` and ``_global_rank`` (develop's tests call it on a stub)."""
        mapping = partition_2d_parameters(params, world_size, self.comm_buffer_size_MB)
        if self._global_rank == 0:
            logger.debug(f"Muon 2D partition{' ' + label if label else ''}: "
                         + ", ".join(f"rank {r}: {len(ps)}" for r, ps in mapping.items()))
        return mapping

    def _partition_2d_parameters_machine_balanced(self, color_group_info: dict,
                                                  rank_to_machine: dict) -> dict:
        """develop's machine-balanced owner rule (``build.machine_balanced_partition``)."""
        return build.machine_balanced_partition(color_group_info, rank_to_machine,
                                                self.comm_buffer_size_MB, self._global_rank)

    def _build_2d_comm_buffers(self, by_name: dict) -> None:
        self._runtime.build_muon_buckets()

    def _build_1d_comm_buffers(self, by_name: dict) -> None:
        self._runtime.build_slice_buffers()

    def _collect_comm_buffers(self) -> list:
        """develop's name: the element-wise buffers (built at construction here)."""
        return self._comm_buffer_list

    def _assign_slice_grad(self) -> None:
        self._runtime.assign_slice_grads()

    def _register_reduce_overlap_hook(self) -> None:
        self._runtime.register_hooks()

    @staticmethod
    def _create_backward_hook(buffer, param, phase: str = "reduce_scatter"):
        return _backward_hook(buffer, param, phase)

    def _set_inner_opt_attr(self, name: str, value: Any) -> None:
        build.set_inner_opt_attr(self._inner_opt, name, value)

    @framework.no_grad()
    def _reduce_2d_grads(self, op=None) -> None:
        """Only the plan's 2-D reduce phases (``op``: default this build's AVG or SUM)."""
        rt = self._runtime
        rt.run([ph for ph in rt.layout.phases_of(Trigger.REDUCE) if ph.op == Op.REDUCE],
               call=_Call(op if op is not None else rt.reduce_op))

    def _step_with_sync_overlap(self, params_grads: list) -> None:
        """The staged part of the plan on given pairs: clip, per stage update and sync, wait."""
        rt = self._runtime
        call = _Call(rt.reduce_op, staged=True, params_grads=list(params_grads))
        kinds = (Op.CLIP, Op.PREPARE, Op.STAGE_UPDATE, Op.FINISH_SYNC, Op.BROADCAST,
                 Op.ALL_GATHER)
        rt.run([ph for ph in rt.step_plan if ph.op in kinds], call=call)

    @framework.no_grad()
    def _sharding_sync_parameters(self) -> None:
        """Broadcast updated matrices from their owners; all-gather 1-D shards."""
        rt = self._runtime
        with rt.timed("sync-parameters"):
            rt.run(rt.step_phases((Op.BROADCAST, Op.ALL_GATHER, Op.FINISH_SYNC)))

    def _build_sync_stages(self) -> list:
        return stage_dicts(self._runtime)

    def _launch_stage_sync(self, stage: dict) -> list:
        """Launch one stage's sync; a develop-style dict without ``'phases'`` syncs its
        own buffers as one phase. Returns what to wait on (the copy-back last)."""
        rt, unpack, phases = self._runtime, [], stage.get("phases")
        if phases is not None:
            cache, pending = {}, []
            for i, phase in enumerate(phases):
                pending += rt.run_sync_phase(phase, cache, unpack, launch=i == len(phases) - 1)
        elif stage["kind"] == "1d":
            pending = [launch_all_gather(stage["buffer"])]
        elif stage["world_size"] <= 1:
            return []  # one rank: nothing to sync
        else:
            group, routes = stage["group"], []
            for owner, flat in self._owner_dtype_buffers(stage["rank2params"], group,
                                                         single_as_is=False):
                if owner != self._global_rank:
                    unpack.append((flat["param_buffer"], flat["params"]))
                routes.append((flat["param_buffer"], owner))
            with comm_phase(flat_broadcast_phase(tuple(group.ranks))):
                pending = [launch_coalesced(Op.BROADCAST, routes, group)]
        return pending + [PendingCollective([], [], "copy back", lambda: unpack_all(unpack))]

    def _broadcast_2d_params(self, rank2params: dict, group) -> list:
        return self._launch_stage_sync({"kind": "2d", "group": group,
                                        "rank2params": rank2params,
                                        "world_size": len(group.ranks)})

    def reorder_params(self, comm_list) -> list:
        return [dict(flat, src_rank=owner) for rank2params, group in comm_list
                for owner, flat in self._owner_dtype_buffers(rank2params, group,
                                                             single_as_is=True)]

    def _owner_dtype_buffers(self, rank2params: dict, group, single_as_is: bool):
        ranks = list(group.ranks)
        for index, params in rank2params.items():
            by_dtype: dict = OrderedDict()
            for p in params:
                by_dtype.setdefault(str(p.dtype), []).append(p)
            for members in by_dtype.values():
                if single_as_is and len(members) == 1:
                    yield ranks[index], {"param_buffer": members[0], "params": members}
                    continue
                buffer = paddle.empty([sum(int(p.numel()) for p in members)],
                                      dtype=members[0].dtype)
                if ranks[index] == self._global_rank:
                    flatten_into(members, buffer)
                yield ranks[index], {"param_buffer": buffer, "params": members}


def stage_dicts(rt: ShardingRuntime) -> list:
    """develop's ``_sync_stages``: the layout's sync stages over this rank's objects."""
    stages = []
    for k, spec in enumerate(rt.layout.sync_stages()):
        if spec.kind == "1d":
            stage = {"kind": "1d", "buffer": rt.rs_buffers[spec.buffer_index], "spec": spec,
                     "local_params": [rt.slice_params[n] for n in spec.local_params]}
        else:
            group = rt.colour_groups[spec.colour]
            ranks = list(spec.group)
            rank2params: dict = OrderedDict()
            for owner, _, names, _ in spec.owners:
                rank2params.setdefault(ranks.index(owner), []).extend(
                    rt.param_by_name[n] for n in names)
            stage = {"kind": "2d", "color": spec.colour, "group": group,
                     "world_size": len(ranks), "rank2params": rank2params,
                     "keys": list(spec.keys), "spec": spec,
                     "local_params": [rt.param_by_name[n] for n in spec.local_params]}
        stage["phases"] = rt.layout.phases_of(SyncTrigger(k))
        stages.append(stage)
    return stages
