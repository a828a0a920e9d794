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
"""``verify``: prove one layout on one CPU box (needs the source checkout's test harness).

Runs the real optimizer in the simulated world (``test/mock``) with
``comm_group_call_opt`` on and off: the schedule checker over every rank's
collectives, each rank's recorded collectives against the schedule its
:class:`ShardingLayout` predicts, then real data against a single-process
Muon reference.

Schedule-only worlds (above ``--data-max-ranks``) are checked by class: the
real optimizer runs on one rank per class (ranks whose predicted schedules
are the same up to renaming groups, with the same role as root, the same
owned matrices and element-wise slices), each against its layout; every
rank's layout is built as the optimizer builds it, and all of them are
checked against each other (every member of a group issues the same
collectives on it in the same order). That is what the recorded check
proves, at the cost of a handful of ranks instead of the world.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections import Counter
from typing import Any, Callable, Dict, List, Sequence, Tuple

from ..distributed.fleet.meta_optimizers.muon_sharding.settings import (
    PARTITION_STRATEGIES,
    option_default,
)
from . import limits
from .args import DEFAULT_BUFFER_MB, DEFAULT_MODEL, MuonCommConfig, add_config_args, build_config

__all__ = [
    "VERIFY_MODEL",
    "DATA_MAX_RANKS",
    "CheckoutMissing",
    "add_verify_parser",
    "checkout_root",
    "compare_schedule",
    "layout_summary",
    "owned_params",
    "recommended_config",
    "run_verify",
    "cmd_verify",
]

VERIFY_MODEL = "tiny-moe"
#: Largest world the data-moving simulated world runs by default; larger
#: worlds are verified schedule-only (every rank, every collective).
DATA_MAX_RANKS = 64


def _step_records(records: Sequence) -> list:
    """The collectives of training steps: every one of them carries its plan phase's label.

    Construction's collectives (group creation, the rank agreement's
    all-reduces) carry none.
    """
    return [r for r in records if r.group_seq is not None and r.phase is not None]


class CheckoutMissing(RuntimeError):
    """The test harness (``test/mock``) is not next to the package."""


def checkout_root() -> str:
    """The source checkout holding this package (``python/paddle_muon_ext``)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.dirname(os.path.dirname(os.path.dirname(here)))


def _test_paths() -> None:
    root = checkout_root()
    if not os.path.isdir(os.path.join(root, "test", "mock")):
        raise CheckoutMissing(
            "verify needs the source checkout's test harness (test/mock); install "
            "with 'pip install -e .' from a checkout and run it there"
        )
    for sub in ("test", os.path.join("test", "collective", "fleet")):
        path = os.path.join(root, sub)
        if path not in sys.path:
            sys.path.insert(0, path)


def add_verify_parser(sub) -> None:
    """Register the ``verify`` subcommand."""
    v = sub.add_parser(
        "verify",
        help="run the schedule checker and the simulated world on one layout",
        description="Build the layout, check every rank's collective schedule with "
        "comm_group_call_opt on and off (and against the schedule the layout predicts), "
        "train the tiny MoE test model in the simulated world (real data, one thread per "
        "rank) with the option on and off, and compare against a single-process Muon "
        "reference. Needs the source checkout. Exit 0 PASS, 1 FAIL, 2 invalid layout.",
    )
    add_config_args(v, model_help=f"the model trained: only the built-in test model "
                    f"{VERIFY_MODEL!r} (default; plan takes presets and JSON files)")
    v.set_defaults(model=VERIFY_MODEL)
    v.add_argument("--steps", type=int, default=3,
                   help=f"training steps, 1..{limits.LIMITS.verify_steps} (default 3)")
    v.add_argument("--data-max-ranks", type=int, default=DATA_MAX_RANKS,
                   help=f"largest world that moves data, 0..{limits.LIMITS.verify_data_world} "
                   f"(default {DATA_MAX_RANKS}; 0: schedule-only); larger ones run schedule-only")
    v.add_argument("--comm-overlap", action="store_true",
                   help="sharding_configs.comm_overlap: backward hooks launch the reduces")
    v.add_argument("--unfused", action="store_true",
                   help="comm_buffer_size_MB <= 0: one reduce per parameter (--buffer-size-MB 0)")
    v.add_argument("--partition", choices=PARTITION_STRATEGIES, default=None,
                   help="owner rule (sharding_configs.muon_partition_strategy; default "
                   f"{option_default('muon_partition_strategy')}, the optimizer's, as plan's)")
    v.add_argument("--buffer-size-MB", type=float, default=None,
                   help="fused gradient buffer size (sharding_configs.comm_buffer_size_MB, a "
                   f"whole number; 0 = one reduce per parameter; default {DEFAULT_BUFFER_MB:g}, "
                   "as plan's)")
    v.add_argument("--recommended", action="store_true",
                   help="verify the owner rule and buffer size plan --recommend picks for this "
                   f"layout ({DEFAULT_MODEL}, nccl; with --comm-overlap as given); not with "
                   "--partition / --buffer-size-MB / --unfused")
    v.add_argument("--json", action="store_true",
                   help="print only a JSON summary on stdout (progress and verdict go to stderr)")


def compare_schedule(layout, records: Sequence, steps: int) -> List[str]:
    """Differences between a rank's recorded collectives and its layout's schedule.

    Hook-launched ops are compared as a multiset per step (their order
    follows the backward pass); the rest in order.

    Args:
        layout: the rank's ShardingLayout.
        records: the rank's CommRecords (markers and construction's unlabelled
            collectives are skipped; the clip's all-reduces are plan phases).
        steps: optimizer steps the records cover.

    Returns:
        list[str]: readable differences (empty when identical).
    """
    from ..distributed.fleet.meta_optimizers.muon_sharding.step_plan import Trigger

    got = [(r.phase, r.op, tuple(sorted(r.group_ranks)), r.root, r.dtype, r.numel)
           for r in _step_records(records)]
    expected = layout.schedule()
    per_step = len(expected)
    if len(got) != per_step * steps:
        return [f"rank {layout.rank}: recorded {len(got)} collectives in {steps} steps, "
                f"the layout predicts {per_step} per step"]
    hooks = sum(1 for op in expected if op.trigger == Trigger.BACKWARD)
    want_hooks = sorted(op.key() for op in expected[:hooks])
    want_rest = [op.key() for op in expected[hooks:]]
    problems = []
    for step in range(steps):
        chunk = got[step * per_step:(step + 1) * per_step]
        if sorted(chunk[:hooks]) != want_hooks:
            problems.append(f"rank {layout.rank} step {step}: hook-launched collectives "
                            f"{sorted(chunk[:hooks])} != layout {want_hooks}")
        for i, (a, b) in enumerate(zip(chunk[hooks:], want_rest)):
            if a != b:
                problems.append(f"rank {layout.rank} step {step} op {hooks + i}: recorded "
                                f"{a}, layout predicts {b}")
                break
    return problems


def _layout_of(opt):
    """The ShardingLayout of a (possibly fleet-wrapped) Muon sharding optimizer, or None."""
    for _ in range(4):
        # the class's own property, never a name a wrapper forwards by __getattr__
        if isinstance(getattr(type(opt), "sharding_layout", None), property):
            return opt.sharding_layout
        opt = getattr(opt, "__dict__", {}).get("_inner_opt")
        if opt is None:
            return None
    return None


def _phase_counts(world) -> Dict[str, int]:
    counts: Counter = Counter()
    for trace in world.traces:
        for rec in _step_records(trace):
            counts[str(rec.phase)] += 1
    return dict(sorted(counts.items()))


def _phase_kind(phase: str) -> str:
    # flat phases name their group ("reduce_to_owner[[0, 1, ...]]"): keep the kind
    return phase.split("[", 1)[0]


def owned_params(layout) -> tuple:
    """Names of the Muon matrices ``layout``'s rank owns, in bucket order."""
    return tuple(n for b in layout.muon_buckets if b.owner == layout.rank for n in b.params)


def layout_summary(layout) -> dict:
    """JSON-ready summary of a ShardingLayout (owners, buckets, slice ranges, schedule)."""
    return {
        "rank": layout.rank,
        "groups": {str(k): list(v) for k, v in layout.groups.items()},
        "owners": dict(sorted(layout.owners.items())),
        "muon_buckets": [
            {"colour": str(b.colour), "group": list(b.group), "owner": b.owner,
             "dtype": b.dtype, "params": list(b.params),
             "chunks": [list(c) for c in b.chunks], "route": b.route_kind,
             "numel": b.numel}
            for b in layout.muon_buckets
        ],
        "slice_buffers": [
            {"colour": str(s.colour), "dtype": s.dtype, "params": list(s.params),
             "offsets": list(s.offsets), "padded": list(s.padded),
             "local": [list(s.range_in_param(n, layout.group_index(s.colour)))
                       for n in s.params]}
            for s in layout.slice_buffers
        ],
        "schedule": [[op.trigger, *op.key()] for op in layout.schedule()],
    }


def rank_signature(layout) -> tuple:
    """What a rank's code path depends on, with groups and roots renamed away.

    Per predicted collective: trigger, phase kind, op, dtype, size, coalesced,
    group size and whether the rank is the root; plus the stage's matrices it
    owns (Newton-Schulz) and which element-wise parameters its slices hold.
    Ranks with equal signatures run the same code on renamed groups.
    """
    rank = layout.rank
    ops = tuple((op.trigger, _phase_kind(op.phase), op.op, op.dtype, op.numel, op.coalesced,
                 len(op.group), op.root == rank) for op in layout.schedule())
    slices = tuple(tuple(buf.holds_slice(n, layout.group_index(buf.colour)) for n in buf.params)
                   for buf in layout.slice_buffers)
    return owned_params(layout), slices, ops


def world_layouts(rep, plan) -> Dict[int, Any]:
    """Every rank's layout, built as the optimizer builds ``rep``'s.

    Same parameters and settings as ``rep`` (every rank of the simulated
    model holds the same names and shapes); groups from the topology: the
    stage's sharding group for the default colour, the rank's moe_sharding
    group for the others; the clip's all-reduces (if ``rep`` has them) on the
    rank's sharding / pipe group. Ranks sharing a moe_sharding group share the build.

    Raises:
        ValueError: ``rep``'s own groups are not the topology's (the rebuilt
            layouts would not be the optimizer's).
    """
    params = list(rep.params.values())
    # sharding_layout keeps the key None for the default colour
    def groups_of(rank: int) -> dict:
        return {k: plan.sharding_group_ranks(plan.stage_of(rank)) if k is None
                else plan.moe_sharding_ranks(rank) for k in rep.groups}

    want = {k: tuple(v) for k, v in groups_of(rep.rank).items()}
    if {k: tuple(v) for k, v in rep.groups.items()} != want:
        raise ValueError(f"rank {rep.rank}: the optimizer's groups "
                         f"{ {str(k): list(v)[:8] for k, v in rep.groups.items()} } are not the "
                         "topology's sharding / moe_sharding groups")
    from ..distributed.fleet.meta_optimizers.muon_sharding.layout import ShardingLayout
    from .fast_layout import FastPlacement

    stages = sorted({plan.stage_of(r) for r in range(plan.world_size)})

    def clip_groups_of(rank: int) -> list:
        # rep's clip all-reduces, on this rank's sharding group / pipe group
        stage = sorted(plan.sharding_group_ranks(plan.stage_of(rank)))
        mine = sorted(plan.sharding_group_ranks(plan.stage_of(rep.rank)))
        pipe = tuple(sorted(sorted(plan.sharding_group_ranks(s))[stage.index(rank)]
                            for s in stages))
        return [tuple(stage) if sorted(g) == mine else pipe for g in rep.clip_groups]

    layouts: Dict[int, Any] = {}
    placement = FastPlacement()  # groups of one shape and parameters share their placement
    for rank in range(plan.world_size):
        if rank in layouts:
            continue
        first = ShardingLayout.build(params, groups_of(rank), rank, rep.settings, rep.plan,
                                     clip_groups=clip_groups_of(rank), placement=placement)
        # the ranks that share every group of ``rank`` share its layout
        sharers = (plan.moe_sharding_ranks(rank) if any(k is not None for k in rep.groups)
                   else plan.sharding_group_ranks(plan.stage_of(rank)))
        for r in sharers:
            layouts[r] = first if r == rank else dataclasses.replace(
                first, rank=r, clip_groups=tuple(clip_groups_of(r)))
    return layouts


def check_world_schedules(layouts: Dict[int, Any]) -> Tuple[List[str], int, Dict[str, int]]:
    """Every member of each group issues the same collectives on it, in order.

    The checker's rule applied to the predicted schedules: a rank missing from
    a group's collectives, one issuing on a group it is not in, or a different
    op, root, dtype or size at some position would hang or corrupt a job.

    Returns:
        (problems, collectives per step over all ranks, collectives per phase per step).
    """
    canon: Dict[int, Tuple[Any, tuple, frozenset]] = {}  # id(group) -> (group, sorted, set)
    seqs: Dict[tuple, Dict[int, list]] = {}
    problems: List[str] = []
    phases: Counter = Counter()
    total = 0
    for rank in sorted(layouts):
        for op in layouts[rank].schedule():
            entry = canon.get(id(op.group))
            if entry is None or entry[0] is not op.group:
                ranks = tuple(sorted(op.group))
                entry = canon[id(op.group)] = (op.group, ranks, frozenset(ranks))
            if rank not in entry[2]:
                problems.append(f"rank {rank} issues {op.op} ({op.phase}) on group "
                                f"{list(entry[1])[:8]} it is not in")
                continue
            seqs.setdefault(entry[1], {}).setdefault(rank, []).append(
                (op.phase, op.op, op.root, op.dtype, op.numel))
            phases[op.phase] += 1
            total += 1
    for group, by_rank in seqs.items():
        absent = [r for r in group if r not in by_rank]
        if absent:
            problems.append(f"group {list(group)[:8]}{'...' if len(group) > 8 else ''}: ranks "
                            f"{absent[:8]} issue nothing while rank {min(by_rank)} issues "
                            f"{len(by_rank[min(by_rank)])} collectives (a hang)")
            continue
        ref_rank = group[0]
        ref = by_rank[ref_rank]
        for r in group[1:]:
            mine = by_rank[r]
            if mine != ref:
                at = next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b),
                          min(len(mine), len(ref)))
                problems.append(f"group {list(group)[:8]}: rank {r} collective #{at} "
                                f"{mine[at] if at < len(mine) else 'none'} != rank {ref_rank}'s "
                                f"{ref[at] if at < len(ref) else 'none'}")
                break
    return problems, total, dict(phases)


def _record_by_class(sim, plan, steps: int, label: str, progress: Callable) -> Tuple[Dict, List]:
    """Schedule check of a schedule-only world by class (see the module docstring)."""
    from mock.comm_record import OP_NEW_GROUP
    from mock.schedule_checker import find_divergences
    from muon_sim_runner import run_world

    first, world = run_world(sim, mode="record", ranks=[0])
    traces = {0: world.traces[0]}
    rep0 = _layout_of(first[0].optimizer)
    if rep0 is None:
        return {"ok": False, "layout_ok": None}, [f"{label}: rank 0's optimizer has no layout"]
    layouts = world_layouts(rep0, plan)
    classes: Dict[tuple, List[int]] = {}
    for rank, lay in sorted(layouts.items()):
        classes.setdefault(rank_signature(lay), []).append(rank)
    reps = sorted(members[0] for members in classes.values())
    results = {0: first[0]}
    rest = [r for r in reps if r != 0]
    if rest:
        ran, world = run_world(sim, mode="record", ranks=rest)
        for r in rest:
            results[r] = ran[r]
            traces[r] = world.traces[r]
    problems, per_step, phases = check_world_schedules(layouts)
    creations = find_divergences({r: [rec for rec in t if rec.op == OP_NEW_GROUP]
                                  for r, t in traces.items()})
    if not creations.ok:
        problems.append(creations.summary())
    mismatches = []
    compared = 0
    for r in reps:
        if not traces.get(r):
            mismatches.append(f"rank {r}: represents a class but recorded nothing")
            continue
        compared += 1
        lay = _layout_of(results[r].optimizer)
        if lay is None or layout_summary(lay) != layout_summary(layouts[r]):
            mismatches.append(f"rank {r}: the optimizer's layout differs from the one "
                              "rebuilt from rank 0's parameters and the topology's groups")
            continue
        mismatches.extend(compare_schedule(lay, traces[r], steps))
    progress(f"[verify] {label}: {len(layouts)} ranks in {len(classes)} classes, real "
             f"optimizer on {len(reps)} of them")
    return ({"ok": not problems, "layout_ok": not mismatches, "collectives": per_step * steps,
             "phases": {k: v * steps for k, v in sorted(phases.items())},
             "classes": len(classes), "compared": compared},
            problems + mismatches)


def resolve_configuration(args: argparse.Namespace) -> Tuple[str, int]:
    """The owner rule and buffer size (MB) ``verify`` checks, from its flags.

    ``--recommended`` is resolved later (:func:`recommended_config`); here it
    only excludes the flags that would contradict it.

    Raises:
        InputError / ValueError: a contradiction or a bad size, naming the flags.
    """
    if args.recommended:
        given = [flag for flag, value in (("--partition", args.partition),
                                          ("--buffer-size-MB", args.buffer_size_MB),
                                          ("--unfused", args.unfused or None))
                 if value is not None]
        if given:
            raise ValueError(f"--recommended picks the owner rule and buffer size itself; drop "
                             f"{' and '.join(given)} (or --recommended)")
    partition = args.partition or option_default("muon_partition_strategy")
    if args.buffer_size_MB is None:
        return partition, 0 if args.unfused else int(DEFAULT_BUFFER_MB)
    limits.check_float("--buffer-size-MB", args.buffer_size_MB,
                       f"pass 0..{limits.LIMITS.buffer_mb:g} (0: one reduce per parameter)",
                       positive=False, high=limits.LIMITS.buffer_mb)
    if args.buffer_size_MB != int(args.buffer_size_MB):
        raise limits.InputError("--buffer-size-MB", f"{args.buffer_size_MB:g}",
                                "is not a whole number (sharding_configs.comm_buffer_size_MB "
                                "is an integer field)", f"pass e.g. {round(args.buffer_size_MB)}")
    if args.unfused and args.buffer_size_MB > 0:
        raise ValueError(f"--unfused means --buffer-size-MB 0; drop --unfused or "
                         f"--buffer-size-MB {args.buffer_size_MB:g}")
    return partition, int(args.buffer_size_MB)


def recommended_config(cfg: MuonCommConfig, comm_overlap: bool = False) -> Dict[str, Any]:
    """What ``plan --recommend`` picks for ``cfg``'s layout (plan's default model, nccl).

    Returns:
        dict: the pick's ``config`` (``comm_group_call_opt``,
        ``muon_partition_strategy``, ``comm_buffer_size_MB``), the ``model``
        and ``backend`` it was picked for, and its ``ratio_to_default``.
    """
    from . import recommend
    from .cost_model import AlphaBeta
    from .plan import compute_plan

    plan_cfg = dataclasses.replace(cfg, model=DEFAULT_MODEL)
    ab = AlphaBeta()
    try:
        res = compute_plan(plan_cfg, ab, buffer_size_MB=DEFAULT_BUFFER_MB,
                           comm_overlap=comm_overlap, group_call=True)
    except ValueError:  # the option cannot run here: plan recommends among flat paths
        res = compute_plan(plan_cfg, ab, buffer_size_MB=DEFAULT_BUFFER_MB,
                           comm_overlap=comm_overlap, group_call=False)
    best = recommend.recommend(res, recommend.annotate(res, ab))["best"]
    return {"config": dict(best["config"]), "model": DEFAULT_MODEL, "backend": "nccl",
            "ratio_to_default": best["ratio_to_default"]}


def check_verify_args(cfg: MuonCommConfig, steps: int, data_max_ranks: int) -> None:
    """Every ``verify`` input checked before any work (InputError on the first bad one)."""
    if cfg.model != VERIFY_MODEL:
        raise limits.InputError("--model", repr(cfg.model), f"verify trains only the built-in "
                                f"{VERIFY_MODEL!r} test model", "drop --model (presets and "
                                "JSON files are for plan)")
    limits.check_int("--steps", steps, 1, limits.LIMITS.verify_steps,
                     "pass e.g. --steps 3 (a run of no step checks nothing)")
    limits.check_int("--data-max-ranks", data_max_ranks, 0, limits.LIMITS.verify_data_world,
                     f"pass 0..{limits.LIMITS.verify_data_world} (0: schedule-only)")


def run_verify(cfg: MuonCommConfig, steps: int = 3, data_max_ranks: int = DATA_MAX_RANKS,
               progress: Callable = print, comm_overlap: bool = False,
               unfused: bool = False, partition: str | None = None,
               buffer_mb: int | None = None) -> Dict:
    """Verify one layout; returns the summary dict (``status`` PASS/FAIL).

    ``partition`` (None: the optimizer's default) and ``buffer_mb``
    (``comm_buffer_size_MB``; None: 256, or 0 with ``unfused``) are the
    configuration checked, with ``comm_group_call_opt`` on and off; the
    summary's ``configuration`` names all of it.

    Raises:
        ValueError: the layout or the options are invalid.
        CheckoutMissing: no test harness next to the package.
    """
    check_verify_args(cfg, steps, data_max_ranks)
    partition = partition or option_default("muon_partition_strategy")
    if buffer_mb is None:
        buffer_mb = 0 if unfused else int(DEFAULT_BUFFER_MB)
    unfused = buffer_mb <= 0
    # what the optimizer refuses is not verified (its own rule)
    limits.check_optimizer_accepts(cfg.pp, comm_overlap, buffer_mb, partition,
                                   unfused_flag="--unfused" if unfused else None)
    plan = cfg.build_plan()  # the optimizer would raise the same message at construction
    _test_paths()
    from muon_sim_runner import SimConfig, max_abs_diff, reference_values, run_world

    base = SimConfig(ep=cfg.ep, ms=cfg.moe_sharding, pp=cfg.pp, order=cfg.order,
                     gpn=cfg.gpus_per_node, steps=steps, clip=cfg.pp == 1,
                     overlap=comm_overlap, fused=not unfused, partition=partition,
                     buffer_mb=buffer_mb)
    off = SimConfig(**{**base.__dict__, "gpn": None})
    summary: Dict = {"ranks": base.world, "steps": steps, "mode": "data", "values_compared": 0,
                     "comm_overlap": comm_overlap, "fused": not unfused, "phase_counts": {},
                     # what was checked, by the sharding_configs names
                     "configuration": {"comm_group_call_opt": [True, False],
                                       "muon_partition_strategy": partition,
                                       "comm_buffer_size_MB": buffer_mb,
                                       "comm_overlap": comm_overlap}}
    problems: List[str] = []
    by_class = base.world > data_max_ranks
    for label, sim in (("hierarchical", base), ("flat", off)):
        t0 = time.perf_counter()
        if by_class:
            got, found = _record_by_class(sim, plan, steps, label, progress)
            summary[f"schedule_{label}_ok"] = got["ok"]
            summary[f"layout_schedule_{label}_ok"] = got["layout_ok"]
            summary["collectives_checked"] = (summary.get("collectives_checked", 0)
                                              + got.get("collectives", 0))
            summary["phase_counts"][label] = got.get("phases", {})
            summary.setdefault("rank_classes", {})[label] = got.get("classes", 0)
            summary.setdefault("ranks_recorded", {})[label] = got.get("compared", 0)
            ok = got["ok"] and got["layout_ok"]
            progress(f"[verify] schedule {label}: {base.world} ranks, "
                     f"{'consistent and as the layout predicts' if ok else 'MISMATCH'} "
                     f"({time.perf_counter() - t0:.1f}s)")
            problems.extend(f"{label} schedule: {p}" for p in found[:5])
            continue
        results, world = run_world(sim, mode="record")
        report = world.check_schedule()
        summary[f"schedule_{label}_ok"] = bool(report.ok)
        summary["collectives_checked"] = summary.get("collectives_checked", 0) + sum(
            1 for t in world.traces for r in t if r.group_seq is not None)
        layouts = [_layout_of(res.optimizer) for res in results]
        mismatches = [p for res, lay in zip(results, layouts) if lay is not None
                      for p in compare_schedule(lay, world.traces[res.rank], steps)]
        summary[f"layout_schedule_{label}_ok"] = (
            not mismatches if all(lay is not None for lay in layouts) else None)
        summary["phase_counts"][label] = _phase_counts(world)
        progress(f"[verify] schedule {label}: {base.world} ranks, "
                 f"{sum(len(t) for t in world.traces)} events, "
                 f"{'consistent' if report.ok else 'MISMATCH'}, "
                 f"{'as the layout predicts' if not mismatches else 'NOT as the layout predicts'}"
                 f" ({time.perf_counter() - t0:.1f}s)")
        if not report.ok:
            problems.append(f"{label} schedule: {report.summary()}")
        problems.extend(f"{label} layout: {m}" for m in mismatches[:5])
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
        # Each rank's final values, compared hier vs flat and both vs reference.
        summary["values_compared"] = 3 * sum(int(v.size) for r in hier for v in r.values.values())
        progress(f"[verify] simulated world: {base.world} ranks x {steps} steps, option on "
                 f"and off ({time.perf_counter() - t0:.1f}s)")
        # fp32, differing only in reduction order: see test_muon_group_call.py.
        if not (d_hf <= 1e-5 and d_ref <= 1e-5):
            problems.append(f"parameters differ: hier vs flat {d_hf:.3e}, vs reference "
                            f"{d_ref:.3e} (tolerance 1e-5)")
    if not summary.get("collectives_checked"):
        problems.append("no collective was recorded: nothing was checked")
    summary["status"] = "FAIL" if problems else "PASS"
    summary["problems"] = problems
    return summary


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3e}"


def cmd_verify(args: argparse.Namespace) -> int:
    """Run ``verify``; prints progress, optional JSON, and the verdict line."""
    cfg = build_config(args, max_world=limits.LIMITS.verify_world, tool="verify")
    check_verify_args(cfg, args.steps, args.data_max_ranks)
    partition, buffer_mb = resolve_configuration(args)
    note = limits.check_local_size(cfg.gpus_per_node)
    if note:
        print(note, file=sys.stderr)
    import logging

    from paddle.distributed.fleet.utils.log_util import logger as fleet_logger

    # Every simulated rank would log its construction; keep the output to
    # verify's own progress lines (the caller's level comes back after).
    level = fleet_logger.level
    fleet_logger.setLevel(logging.ERROR)
    try:
        from .guard import interrupts_raise

        # after the paddle import (it takes SIGINT over): SIGINT / SIGTERM end the
        # run at once, the simulated ranks (daemon threads) with it
        with interrupts_raise():
            picked = None
            if args.recommended:
                cfg.build_plan()  # an invalid layout: its own message before plan's work
                picked = recommended_config(cfg, comm_overlap=args.comm_overlap)
                pick = picked["config"]
                partition = pick["muon_partition_strategy"]
                buffer_mb = int(pick["comm_buffer_size_MB"])
                print(f"[verify] plan --recommend ({picked['model']}, {picked['backend']}) picks "
                      f"comm_group_call_opt {'on' if pick['comm_group_call_opt'] else 'off'}, "
                      f"{partition} owners, {buffer_mb} MB buffers; verifying that owner rule and "
                      "buffer size with the option on and off")
            summary = run_verify(cfg, steps=args.steps, data_max_ranks=args.data_max_ranks,
                                 comm_overlap=args.comm_overlap, partition=partition,
                                 buffer_mb=buffer_mb)
            if picked is not None:
                summary["configuration"]["recommended_by_plan"] = picked
        if args.json:
            from .guard import emit_json

            emit_json(summary)
        for problem in summary["problems"]:
            print(f"  {problem}")
        checked = summary["configuration"]
        print(f"checked: comm_group_call_opt on and off, muon_partition_strategy="
              f"{checked['muon_partition_strategy']}, comm_buffer_size_MB="
              f"{checked['comm_buffer_size_MB']}, comm_overlap={checked['comm_overlap']}")
        mode = "" if summary["mode"] == "data" else " mode=schedule-only"
        print(f"{summary['status']} ranks={summary['ranks']}{mode} "
              f"max_abs_diff_hier_vs_flat={_fmt(summary['max_abs_diff_hier_vs_flat'])} "
              f"max_abs_diff_vs_reference={_fmt(summary['max_abs_diff_vs_reference'])} "
              f"steps={summary['steps']} collectives_checked={summary['collectives_checked']} "
              f"values_compared={summary['values_compared']}")
        return 0 if summary["status"] == "PASS" else 1
    finally:
        fleet_logger.setLevel(level)
