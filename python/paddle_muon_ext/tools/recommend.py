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
"""``plan``'s comparison with the default and the bound, and ``plan --recommend``.

Every ``plan`` result gets ``vs_default`` (:func:`annotate`): the default
configuration -- ``comm_group_call_opt`` off, the optimizer's owner rule
(develop's), ``comm_buffer_size_MB`` 256 -- with its estimated step time,
the bound (:mod:`cost_bound`) and every configuration the run estimated as a
ratio to both. ``--recommend`` (:func:`recommend`) estimates option on/off x
every owner rule x :data:`BUFFER_SIZES_MB` on the layout and stages the run
already built, and names the fastest; the default is a candidate, so nothing
slower than it is ever recommended.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

from ..distributed.fleet.meta_optimizers.muon_sharding.layout import LayoutSettings
from ..distributed.fleet.meta_optimizers.muon_sharding.settings import option_default
from ..distributed.fleet.meta_optimizers.muon_sharding.owners import (
    develop_active_ranks,
    rail_positions,
)
from ..distributed.fleet.meta_optimizers.muon_sharding.settings import itemsize
from . import cost_bound, limits
from .args import DEFAULT_BUFFER_MB
from .cost_model import AlphaBeta, ratio
from .plan_world import build_layout_plan

__all__ = ["BUFFER_SIZES_MB", "DEFAULT_CONFIG", "MAX_BUFFER_MB", "ONE_BUFFER_MIN_GAIN",
           "annotate", "config", "develop_fit_mb", "figure_input",
           "one_buffer_mb", "rail_applies", "recommend", "sharding_configs", "why_line"]

#: Buffer sizes ``--recommend`` tries (MB), besides the run's own and
#: :func:`one_buffer_mb`'s.
BUFFER_SIZES_MB = (64.0, 256.0, 1024.0)
#: Largest buffer ``--recommend`` proposes (the tool's ``--buffer-size-MB`` limit).
MAX_BUFFER_MB = 65536.0
#: A buffer above every listed size (and the run's) costs memory the model does
#: not weigh: it is picked only when this much faster than every other candidate.
ONE_BUFFER_MIN_GAIN = 0.01
#: What a user gets without touching the three knobs (one table holds each default).
DEFAULT_CONFIG = {
    "comm_group_call_opt": False,
    "muon_partition_strategy": option_default("muon_partition_strategy"),
    "comm_buffer_size_MB": float(DEFAULT_BUFFER_MB),
}

Key = Tuple[bool, str, float]


def config(group_call: bool, rule: str, buffer_mb: float) -> Dict[str, Any]:
    """The ``config`` object of a candidate (the optimizer's option names).

    Args:
        group_call: ``comm_group_call_opt``.
        rule: ``muon_partition_strategy``.
        buffer_mb: ``comm_buffer_size_MB``.

    Returns:
        dict: the three options by name.
    """
    return {"comm_group_call_opt": bool(group_call), "muon_partition_strategy": rule,
            "comm_buffer_size_MB": float(buffer_mb)}


def _key(cfg: Dict[str, Any]) -> Key:
    return (cfg["comm_group_call_opt"], cfg["muon_partition_strategy"],
            float(cfg["comm_buffer_size_MB"]))


def rail_applies(plan: Any) -> bool:
    """Whether the rail rule differs from ``balanced`` anywhere on ``plan``:
    some stage's sharding group spans two or more nodes (the dense colour is
    the one routed hierarchically).

    Args:
        plan: a hierarchical plan, or None (the flat path: never).
    """
    if plan is None:
        return False
    return any(rail_positions(plan, plan.sharding_group_ranks(s)) is not None
               for s in range(plan.pp_degree))


class _Estimates:
    """Step-time estimates of one layout and model, each configuration once.

    Seeded with what ``compute_plan`` already counted (its rule's two paths
    and the other rules' times), so no path is built twice.
    """

    def __init__(self, res: Dict[str, Any], ab: AlphaBeta) -> None:
        self.res = res
        self.ab = ab
        c = res["config"]
        self.buffer = float(c["buffer_size_MB"])
        self.settings = LayoutSettings(comm_buffer_size_MB=self.buffer,
                                       comm_overlap=c["comm_overlap"],
                                       partition_strategy=c["partition_strategy"])
        self.backend = c["backend"]
        self.pp = res["_cfg"].pp  # what the optimizer's rule reads with comm_overlap
        self.stages = res["_stages"]
        self.placement = res.get("_placement")  # the run's layout memos (None: fresh ones)
        self.flat_plan = res["_plan"]
        self.hier_plan = res["_plan"] if c["group_call"] else None
        if self.hier_plan is None:
            try:  # the option's preconditions: several nodes of equal stages
                self.hier_plan = build_layout_plan(res["_cfg"], True)
            except ValueError:
                self.hier_plan = None
        from .plan import FLAT_RULES

        # where rail applies it is a candidate of the hierarchical path only
        # (on the flat path it is balanced)
        self.rail_possible = self.hier_plan is not None and rail_applies(self.hier_plan)
        self.times: Dict[Key, float] = {}
        for rule, fig in res["partition_rules"].items():
            if rule in FLAT_RULES or rule == c["partition_strategy"]:
                self.times[(False, rule, self.buffer)] = fig["flat_estimated_time_s"]
            if "hierarchical_estimated_time_s" in fig:
                self.times[(True, rule, self.buffer)] = fig["hierarchical_estimated_time_s"]
        rule = c["partition_strategy"]
        self.times[(False, rule, self.buffer)] = res["flat"]["estimated_time_s"]
        if res.get("hierarchical") is not None:
            self.times[(True, rule, self.buffer)] = res["hierarchical"]["estimated_time_s"]

    @property
    def group_call_possible(self) -> bool:
        return self.hier_plan is not None

    def time(self, key: Key) -> float:
        """The estimated step communication time of ``key`` (counted once)."""
        if key not in self.times:
            from . import plan as plan_mod

            group_call, rule, buffer_mb = key
            settings = dataclasses.replace(self.settings, comm_buffer_size_MB=buffer_mb,
                                           partition_strategy=rule)
            layout_plan = self.hier_plan if group_call else self.flat_plan
            self.times[key] = plan_mod._path(layout_plan, self.stages, self.ab, settings,
                                             group_call, self.backend, self.placement)[
                                                 "summary"]["estimated_time_s"]
        return self.times[key]


def _class_totals(stage, muon: bool, in_bytes: bool = False) -> Dict[Tuple[Any, Any], int]:
    """Elements (or bytes) of one stage's Muon matrices (``muon``) or
    element-wise parameters by class, ``(colour, dtype)``: what one buffer
    per colour and dtype must hold (:func:`one_buffer_mb`,
    :func:`develop_fit_mb`) and what develop's rule counts owners by.

    Args:
        stage: a stage (``metas()``: ``shape``, ``dtype``, ``colour``, ``use_muon``).
        muon: the Muon matrices, else the element-wise parameters.
        in_bytes: bytes (the dtype's item size) instead of elements.

    Returns:
        dict: ``(colour, dtype)`` -> total, in first-seen order.
    """
    totals: Dict[Tuple[Any, Any], int] = {}
    for m in stage.metas():
        if bool(m.use_muon) != muon:
            continue
        dtype = getattr(m, "dtype", None)
        n = itemsize(dtype) if in_bytes else 1
        for d in m.shape:
            n *= int(d)
        key = (m.colour, dtype)
        totals[key] = totals.get(key, 0) + n
    return totals


def one_buffer_mb(stages, muon: bool = False) -> Optional[float]:
    """The smallest power-of-two buffer size (MB) holding each stage's
    element-wise (non-Muon) parameters of one colour and dtype in one buffer,
    when above every size of :data:`BUFFER_SIZES_MB` (else None); with
    ``muon``, its Muon matrices of one colour and dtype instead.

    Every buffer is a launch of each element-wise ring; where latency
    dominates (a large alpha, gloo's per-round latency) fewer buffers are the
    faster step, and the bound counts one per dtype. A Muon buffer has one
    owner, and each owner is one more flat chain (NCCL) or gloo reduce /
    broadcast: the owner rules fill a buffer before opening the next, so
    one buffer per colour and dtype is the one-launch configuration the
    bound's flat Muon floor counts (e.g. ernie-moe-small at 8 x 8, ep 8,
    alpha 1 ms: 1.229x the bound at 1,024 MB, 1.066x at 4,096 MB).

    Args:
        stages: the run's stages (``metas()``: ``shape``, ``dtype``, ``colour``,
            ``use_muon``).
        muon: size the Muon matrices' buffers instead of the element-wise ones.

    Returns:
        float or None: MB (``comm_buffer_size_MB``: 2**18 elements a MB).
    """
    most = max((n for stage in stages for n in _class_totals(stage, muon).values()), default=0)
    mb = 1.0
    while mb * 2 ** 18 < most * 1.05 and mb < MAX_BUFFER_MB:  # 5 %: alignment padding
        mb *= 2
    return mb if mb > max(BUFFER_SIZES_MB) else None


def develop_fit_mb(stages) -> Optional[float]:
    """The smallest whole-MB buffer size holding each stage's element-wise
    (non-Muon) parameters of one colour and dtype in one buffer, by their
    bytes as the slice buffers are chunked (None without such parameters).

    Develop's owner rule gives a dtype class ``int(fp32 MB / buffer MB) + 1``
    owners, so the buffer size that takes the element-wise rings down to one
    launch per colour and dtype also sets how many owners share the Muon
    bytes: the smallest such size keeps the most owners. A power-of-two size
    above it has the same rings and fewer owners, which costs where one
    owner's rail carries its whole share across nodes (ernie-moe-small at 8 x
    8, ep 64, ``comm_overlap``, alpha 1 ms / 100 us: 1.157x the bound at 1,024
    MB, where each dtype class has one owner, both the group's first rank;
    1.052x at this size, 405 MB, where the bf16 class has two).

    Args:
        stages: the run's stages (``metas()``: ``shape``, ``dtype``,
            ``colour``, ``use_muon``).

    Returns:
        float or None: MB (``comm_buffer_size_MB``: ``2**20`` bytes a MB for
        the element-wise buffers).
    """
    most = max((n for stage in stages
                for n in _class_totals(stage, muon=False, in_bytes=True).values()), default=0)
    if most <= 0:
        return None
    return float(min(-(-most // 2 ** 20), MAX_BUFFER_MB))


def _develop_owners(stages, buffer_mb: float) -> Tuple[int, ...]:
    """Develop's owner count of each stage's Muon class (colour, dtype) at
    ``buffer_mb``, before the group size caps it."""
    out = []
    for stage in stages:
        numel = _class_totals(stage, muon=True)
        out += [develop_active_ranks([numel[k]], 1 << 62, buffer_mb)
                for k in sorted(numel, key=str)]
    return tuple(out)


def _bound(res: Dict[str, Any], ab: AlphaBeta) -> Dict[str, Any]:
    families = cost_bound.layout_families(res["_plan"], [s.metas() for s in res["_stages"]])
    c = res["config"]
    return cost_bound.step_bound(families, ab, c["backend"], c["comm_overlap"])


def _entry(cfg: Dict[str, Any], t: float, t0: float, b: float) -> Dict[str, Any]:
    return {"config": cfg, "estimated_time_s": t, "ratio_to_default": ratio(t, t0),
            "ratio_to_bound": ratio(t, b)}


def annotate(res: Dict[str, Any], ab: AlphaBeta) -> _Estimates:
    """Add ``vs_default`` to a ``compute_plan`` result (in place).

    ``vs_default``: ``default`` (config, estimated_time_s), ``bound_s``,
    ``bound_families_s`` and ``configurations``: every configuration the run
    estimated, with its ratio to the default and to the bound.

    Args:
        res: ``compute_plan``'s result (with ``_plan``, ``_stages``, ``_cfg``).
        ab: the run's alpha-beta constants.

    Returns:
        the estimates, for :func:`recommend` to extend.
    """
    est = _Estimates(res, ab)
    bound = _bound(res, ab)
    b = bound["bound_s"]
    t0 = est.time(_key(DEFAULT_CONFIG))
    rows = [_entry(config(*k), t, t0, b) for k, t in sorted(
        est.times.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0]))]
    res["vs_default"] = {
        "default": {"config": dict(DEFAULT_CONFIG), "estimated_time_s": t0},
        "bound_s": b,
        "bound_families_s": bound["families_s"],
        "bound_inter_node_bytes": bound["inter_node_bytes"],
        "configurations": rows,
    }
    return est


def why_line(best: Dict[str, Any], default: Dict[str, Any], runner_up: Optional[Dict[str, Any]],
             bound: Dict[str, float]) -> str:
    """One line on why ``best`` was picked (or why nothing beats the default).

    Args:
        best: the picked candidate (``config``, ``estimated_time_s``, ratios).
        default: the default candidate.
        runner_up: the fastest candidate other than the default, or None.
        bound: ``bound_s`` and ``families_s`` (:func:`cost_bound.step_bound`).

    Returns:
        str: the sentence.
    """
    t0, t, b = default["estimated_time_s"], best["estimated_time_s"], bound["bound_s"]
    fam = bound["families_s"]
    # what comm_group_call_opt can act on: the dense colour's Muon reduce/broadcast
    dense = ratio(fam.get("dense_reduce", 0.0) + fam.get("dense_broadcast", 0.0), b)
    scope = f"dense Muon reduce/broadcast, all the option reroutes, are {dense:.0%} of the bound"
    if best["config"] == default["config"]:
        if runner_up is None:
            return f"the default is the only candidate for this layout; {scope}"
        return (f"nothing beats the default: the fastest other choice "
                f"({_describe(runner_up['config'])}) is "
                f"{ratio(runner_up['estimated_time_s'], t0):.3f}x of it; {scope}")
    return (f"{_describe(best['config'])} is {ratio(t, t0):.3f}x of the default and "
            f"{ratio(t, b):.3f}x of the bound; {scope}")


def _describe(cfg: Dict[str, Any]) -> str:
    return (f"comm_group_call_opt {'on' if cfg['comm_group_call_opt'] else 'off'}, "
            f"{cfg['muon_partition_strategy']} owners, {cfg['comm_buffer_size_MB']:g} MB buffers")


def recommend(res: Dict[str, Any], est: _Estimates) -> Dict[str, Any]:
    """Estimate every candidate and add the ``recommend`` object to ``res``.

    Candidates: ``comm_group_call_opt`` off / on (on only where the layout
    allows it) x every owner rule (``rail`` only with the option on and a
    sharding group over two or more nodes) x :data:`BUFFER_SIZES_MB`, the run's own
    buffer size and one buffer per colour and dtype of the element-wise
    parameters and (develop's rule only) of the Muon matrices
    (:func:`one_buffer_mb`; picked only when :data:`ONE_BUFFER_MIN_GAIN`
    faster than the rest), and (develop's rule only) the smallest size
    holding the element-wise ones in one buffer (:func:`develop_fit_mb`).
    The default is a candidate and wins ties, so the pick is never slower
    than it.

    Args:
        res: an annotated result (:func:`annotate`).
        est: :func:`annotate`'s estimates.

    Returns:
        dict: ``{"default", "best", "bound_s", "candidates", "why"}``.
    """
    from .plan import FLAT_RULES, PARTITION_RULES

    vs = res["vs_default"]
    b, t0 = vs["bound_s"], vs["default"]["estimated_time_s"]
    fit = one_buffer_mb(est.stages)
    muon_fit = one_buffer_mb(est.stages, muon=True)
    develop_fit = develop_fit_mb(est.stages)
    if develop_fit is not None:
        # (not ``b``: that name is the bound here)
        above = [size for size in set(BUFFER_SIZES_MB) | ({est.buffer, fit, muon_fit} - {None})
                 if size >= develop_fit]
        if above and _develop_owners(est.stages, develop_fit) == _develop_owners(
                est.stages, min(above)):
            # the next size up has the same rings and owners, and no more
            # Muon chunks: nothing to gain
            develop_fit = None
    buffers = sorted(set(BUFFER_SIZES_MB) | {est.buffer}
                     | ({fit, muon_fit, develop_fit} - {None}))
    # only develop's rule sizes its owner count by the buffer: the Muon size
    # and the smallest one-ring size are tried with it alone (the time budget
    # at 100,000 matrices; under the other rules a larger size has the same
    # rings and owners, and no more Muon chunks)
    muon_only = {muon_fit, develop_fit} - {None} - set(BUFFER_SIZES_MB) - {est.buffer, fit}
    keys: List[Key] = [_key(DEFAULT_CONFIG)]
    for group_call in ((False, True) if est.group_call_possible else (False,)):
        rules = PARTITION_RULES if group_call and est.rail_possible else FLAT_RULES
        for rule in rules:
            for buffer_mb in buffers:
                if buffer_mb in muon_only and rule != DEFAULT_CONFIG["muon_partition_strategy"]:
                    continue
                k = (group_call, rule, buffer_mb)
                # never a candidate the optimizer refuses (its own rule)
                if k not in keys and limits.optimizer_refusal(
                        est.pp, est.settings.comm_overlap, buffer_mb, rule,
                        group_call) is None:
                    keys.append(k)
    candidates = [_entry(config(*k), est.time(k), t0, b) for k in keys]
    big = max(max(BUFFER_SIZES_MB), est.buffer)
    best = candidates[0]
    for c in candidates[1:]:
        if c["estimated_time_s"] < best["estimated_time_s"] \
                and c["config"]["comm_buffer_size_MB"] <= big:
            best = c
    for c in candidates[1:]:  # the one-buffer size: only for a clear gain
        if c["config"]["comm_buffer_size_MB"] > big and c["estimated_time_s"] < min(
                best["estimated_time_s"] * (1 - ONE_BUFFER_MIN_GAIN), t0):
            best = c
    others = candidates[1:]
    runner_up = min(others, key=lambda c: c["estimated_time_s"]) if others else None
    out = {
        "default": {"config": candidates[0]["config"], "estimated_time_s": t0},
        "best": best,
        "sharding_configs": sharding_configs(best["config"],
                                             res.get("config", {}).get("comm_overlap", False)),
        "bound_s": b,
        "candidates": candidates,
        "why": why_line(best, candidates[0], runner_up,
                        {"bound_s": b, "families_s": vs["bound_families_s"]}),
    }
    res["recommend"] = out
    return out


def sharding_configs(cfg: Dict[str, Any], comm_overlap: bool = False) -> Dict[str, Any]:
    """A candidate as the ``strategy.hybrid_configs["sharding_configs"]`` keys
    that select it (``comm_buffer_size_MB`` is an integer field there).

    Args:
        cfg: the candidate's ``config`` (:func:`config`).
        comm_overlap: the run's ``--comm-overlap`` (estimated with it on).

    Returns:
        dict: key -> value, ready to paste.
    """
    mb = float(cfg["comm_buffer_size_MB"])
    out = {"comm_group_call_opt": bool(cfg["comm_group_call_opt"]),
           "muon_partition_strategy": cfg["muon_partition_strategy"],
           "comm_buffer_size_MB": int(mb) if mb.is_integer() else mb}
    if comm_overlap:
        out["comm_overlap"] = True
    return out


def _paste_lines(configs: Dict[str, Any]) -> List[str]:
    import json

    lines = ['  to use it, after paddle_muon_ext.patch_paddle(), in strategy.hybrid_configs'
             '["sharding_configs"]:']
    for key, value in configs.items():
        text = repr(value) if isinstance(value, bool) else json.dumps(value)
        lines.append(f'    "{key}": {text},')
    return lines


def figure_input(res: Dict[str, Any], est: _Estimates) -> Dict[str, Any]:
    """``res`` for ``plan --recommend --png``: two panels, the default
    configuration and the pick, each laid out as its options say.

    Args:
        res: a result :func:`recommend` added its pick to.
        est: the estimates (their plans and stages).

    Returns:
        dict: ``res`` with ``figure_panels`` (key, title, comm_group_call_opt)
        and each panel's path figures under its key.
    """
    from . import plan as plan_mod

    rec = res["recommend"]
    out = dict(res)
    owned = dict(res["owned_by_colour"])
    panels = []
    group_call_plan = None
    for key, label, cfg, t in (
            ("default", "default", rec["default"]["config"],
             rec["default"]["estimated_time_s"]),
            ("recommended", "recommended", rec["best"]["config"],
             rec["best"]["estimated_time_s"])):
        group_call = cfg["comm_group_call_opt"]
        layout_plan = est.hier_plan if group_call else est.flat_plan
        if group_call:
            group_call_plan = layout_plan
        settings = dataclasses.replace(est.settings, comm_buffer_size_MB=cfg["comm_buffer_size_MB"],
                                       partition_strategy=cfg["muon_partition_strategy"])
        path = plan_mod._path(layout_plan, est.stages, est.ab, settings, group_call, est.backend,
                              est.placement)
        out[key] = path["summary"]
        owned[key] = path["owned_detail"]
        panels.append((key, f"{label}: {_describe(cfg)}", group_call))
    out["owned_by_colour"] = owned
    out["figure_panels"] = panels
    if group_call_plan is not None:  # the same-card lines need the hierarchical plan
        out["_plan"] = group_call_plan
    return out


def format_lines(res: Dict[str, Any]) -> List[str]:
    """The text report's lines on the default, the bound and the pick."""
    from .report import _fmt_time

    vs = res["vs_default"]
    d = vs["default"]
    lines = [f"default ({_describe(d['config'])}): step comm {_fmt_time(d['estimated_time_s'])}; "
             f"bound {_fmt_time(vs['bound_s'])} (no configuration can be faster in this model)"]
    for row in vs["configurations"]:
        lines.append(f"  {_describe(row['config'])}: {_fmt_time(row['estimated_time_s'])} = "
                     f"{row['ratio_to_default']:.3f}x default, {row['ratio_to_bound']:.3f}x bound")
    rec = res.get("recommend")
    if rec is not None:
        best = rec["best"]
        lines.append(f"recommended: {_describe(best['config'])}: "
                     f"{_fmt_time(best['estimated_time_s'])} = {best['ratio_to_default']:.3f}x "
                     f"default, {best['ratio_to_bound']:.3f}x bound "
                     f"({len(rec['candidates'])} candidates)")
        lines.append(f"  why: {rec['why']}")
        lines += _paste_lines(rec["sharding_configs"])
    return lines
