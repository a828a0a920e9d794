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
"""A real multi-node cluster on one box: one network namespace per node.

``muon_comm.py cluster --nodes N --procs-per-node G --ep E --moe-sharding M``

Topology: a bridge in its own namespace; each node is a namespace with one
veth into that bridge, an address from 198.18.0.0/15 (the benchmarking range)
and a ``tbf`` rate limit on both ends of its link. Ranks of one node talk over
loopback (gloo connects to the node's own address), so a node link's byte
counters are exactly the node's inter-node traffic.

Every node runs its own ``python -m paddle.distributed.launch --master
<node 0>:<port> --nnodes N --nproc_per_node G --rank k --host <own ip>`` with
``GLOO_SOCKET_IFNAME`` set to its veth; the launcher, not this tool, numbers the
ranks and sets ``PADDLE_LOCAL_SIZE``. The workers
(``test/collective/fleet/cluster_muon_worker.py``) train the tiny MoE with
``comm_group_call_opt`` off, then on, check every step against the
single-process reference, and report per step the node-link bytes and the step
time; this tool checks that each rank's namespace is the node the optimizer's
plan puts it on, and sets the measured bytes beside the plan tool's gloo
prediction.

Cleanup: every name carries a per-run prefix (``pmc-<pid>-``); namespaces,
links and every process inside them are removed on success, failure, timeout,
SIGINT / SIGTERM / SIGHUP. Namespaces of an earlier run whose pid is gone
(SIGKILL) are swept at the next start.

``--recommended`` asks the plan tool which configuration to use on the
cluster's own layout, model and links (``cluster_compare``) and trains the
default configuration, then the recommended one, instead of the option off /
on: measured beside predicted inter-node bytes and step time per
configuration, and the recommended / default ratios.

This module is the command line (``add_parser``, ``main``, the summary and
the comparison table); ``cluster_run`` runs the cluster, ``cluster_netns``
builds and removes its network.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Callable, Dict, List, Optional

from .cluster_netns import ClusterUnavailable
from .cluster_run import (
    DEFAULT_HIDDEN,
    DEFAULT_INNER,
    DEFAULT_LINK_MBIT,
    ClusterConfig,
    ClusterInterrupted,
    ClusterResult,
    fmt_bytes,
    run_cluster,
)

#: Exit status when the box cannot build a cluster (not root, no netns / tbf).
EXIT_UNAVAILABLE = 2


def add_parser(sub) -> argparse.ArgumentParser:
    """Register the ``cluster`` subcommand on an argparse subparsers object."""
    c = sub.add_parser(
        "cluster", help="run a real multi-node gloo cluster in network namespaces",
        description="Build one network namespace per node (veth into a bridge, tbf rate "
        "limit), start one paddle.distributed.launch per node, train the tiny MoE with "
        "comm_group_call_opt off and on, check every step against the single-process "
        "reference and report measured inter-node bytes and step time beside the gloo "
        "prediction of the plan tool. Exit 0 PASS, 1 FAIL, 2 unavailable / invalid.")
    c.add_argument("--nodes", type=int, required=True, help="nodes (namespaces)")
    c.add_argument("--procs-per-node", type=int, required=True, help="processes per node")
    c.add_argument("--ep", type=int, required=True, help="expert-parallel degree")
    c.add_argument("--moe-sharding", type=int, required=True, help="moe_sharding degree")
    c.add_argument("--steps", type=int, default=3, help="training steps per pass (default 3)")
    c.add_argument("--link-mbit", type=float, default=DEFAULT_LINK_MBIT,
                   help=f"rate limit of each node link, Mbit/s (default {DEFAULT_LINK_MBIT:g})")
    c.add_argument("--hidden", type=int, default=DEFAULT_HIDDEN,
                   help=f"hidden size of the tiny MoE (default {DEFAULT_HIDDEN})")
    c.add_argument("--inner", type=int, default=DEFAULT_INNER,
                   help=f"expert inner size of the tiny MoE (default {DEFAULT_INNER})")
    c.add_argument("--group-call", default=None, choices=("0", "1", "both"),
                   help="comm_group_call_opt passes (default both: off, then on; 0 alone "
                   "where the option cannot run, e.g. --procs-per-node 1)")
    c.add_argument("--recommended", action="store_true",
                   help="ask the plan tool (plan --recommend: gloo, this layout, the tiny "
                   "MoE, the links' rate) for the fastest configuration (comm_group_call_opt, "
                   "muon_partition_strategy, comm_buffer_size_MB), then train the default "
                   "configuration and the recommended one (each against the reference) and "
                   "print per configuration inter-node bytes/step and step time, measured / "
                   "predicted, and the recommended/default ratios; the default alone when "
                   "it is the recommendation. Not with --group-call")
    c.add_argument("--timeout", type=float, default=900.0,
                   help="seconds, > 0 (default 900)")
    c.add_argument("--keep-logs", action="store_true", help="keep the worker logs")
    c.add_argument("--json", action="store_true",
                   help="print only a JSON summary on stdout (progress and verdict go to stderr)")
    return c


def config_from_args(args: argparse.Namespace) -> ClusterConfig:
    """The checked configuration (ValueError naming the flag).

    Without ``--group-call``, a layout the option cannot run on (one node,
    one process per node) trains the flat path alone, with a note.
    """
    cfg = ClusterConfig(nodes=args.nodes, procs_per_node=args.procs_per_node, ep=args.ep,
                        moe_sharding=args.moe_sharding, steps=args.steps,
                        link_mbit=args.link_mbit, hidden=args.hidden, inner=args.inner,
                        group_call=args.group_call or "both", timeout_s=args.timeout)
    cfg.validate_values()
    if getattr(args, "recommended", False):
        if args.group_call is not None:
            raise ValueError("--recommended trains the default and the recommended "
                             "configuration; drop --group-call")
        return cfg
    if args.group_call is None:
        why = cfg.group_call_refusal()
        if why:
            print(f"note: comm_group_call_opt cannot run on this layout ({why}); training "
                  "the flat path alone (--group-call 0)", file=sys.stderr)
            cfg = ClusterConfig(**{**cfg.__dict__, "group_call": "0"})
    cfg.validate()
    return cfg


class _SignalsToException:
    """SIGINT / SIGTERM / SIGHUP raise ClusterInterrupted (once) so ``finally``
    blocks clean up; further signals during the cleanup are ignored."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __enter__(self) -> _SignalsToException:
        self.saved = {s: signal.getsignal(s) for s in self.SIGNALS}
        self.fired = False

        def handler(signum, _frame):
            if self.fired:
                return
            self.fired = True
            raise ClusterInterrupted(f"interrupted by signal {signal.Signals(signum).name}",
                                     signum)

        for s in self.SIGNALS:
            signal.signal(s, handler)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self.saved.items():
            signal.signal(s, h)


def summary_line(result: ClusterResult) -> str:
    """The last line of a run: ``PASS nodes=4 ranks=8 ...``."""
    cfg = result.config
    parts = [result.status, f"nodes={cfg.nodes}", f"ranks={cfg.world_size}",
             f"ep={cfg.ep}", f"moe_sharding={cfg.moe_sharding}"]
    for g, v in result.per_pass().items():
        tag = cfg.pass_name(g)
        parts.append(f"{tag}: inter_node_bytes/step={v['inter_node_bytes_per_step']:.0f} "
                     f"step_time={v['step_time_s']:.3f}s")
    if result.prediction:
        for g in cfg.passes():
            tag = cfg.pass_name(g)
            pred = result.prediction.get(tag)
            if pred is not None:
                parts.append(f"{tag}_predicted={pred['inter_node_bytes']:.0f}")
    return " ".join(parts)


def main(args: argparse.Namespace, predict: Optional[Callable[[ClusterConfig], Dict]] = None,
         ) -> int:
    """Run the ``cluster`` subcommand; returns the exit status.

    Every accepted layout ends with a ``PASS`` / ``FAIL`` line (exit 0 / 1);
    a bad value or a box that cannot build namespaces is one ``error:`` line
    (exit 2). With ``--json`` the JSON is the only thing on stdout.
    """
    from .guard import emit_json

    rec = None
    try:
        cfg = config_from_args(args)
        if getattr(args, "recommended", False):
            cfg, rec = _recommended_config(cfg)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with _SignalsToException():
        try:
            result = run_cluster(cfg, keep_logs=args.keep_logs)
        except ClusterUnavailable as exc:
            print(f"error: cluster unavailable: {exc}", file=sys.stderr)
            if args.json:
                emit_json({"status": "UNAVAILABLE", "reason": str(exc),
                           "config": cfg.__dict__})
            return EXIT_UNAVAILABLE
        except ClusterInterrupted as exc:
            print(f"[cluster] {exc}; namespaces, links and processes removed", file=sys.stderr)
            return 128 + exc.signum
    comp = None
    if rec is not None and result.status == "PASS":
        comp = _compare_recommended(result, rec)
    elif predict is not None and result.status == "PASS":
        try:
            result.prediction = predict(cfg)
        except ValueError as exc:  # the run passed; a missing prediction does not fail it
            print(f"note: no plan-tool prediction for this layout ({exc})", file=sys.stderr)
        else:
            for line in comparison_lines(result):
                print(line)
    if args.json:
        out = result.to_json()
        if rec is not None:
            out["recommended"] = comp
        emit_json(out)
    for problem in result.problems:
        print(f"  {problem}")
    print(summary_line(result))
    return 0 if result.status == "PASS" else 1


def _recommended_config(cfg: ClusterConfig):
    """(the run's configuration with the default and the recommended pass,
    the plan tool's recommendation); ValueError when it cannot plan the layout."""
    import dataclasses

    from . import cluster_compare

    rec = cluster_compare.recommend_for_cluster(cfg)
    passes = cluster_compare.pass_configs(rec)
    cfg = dataclasses.replace(cfg, pass_configs=passes,
                              group_call="both" if any(p[0] for p in passes) else "0")
    cfg.validate()
    if len(passes) == 1:
        print("note: the recommendation is the default configuration; training it once",
              file=sys.stderr)
    return cfg, rec


def _compare_recommended(result: ClusterResult, rec: Dict) -> Dict:
    """Predict each pass, print the comparison table; returns its JSON."""
    from . import cluster_compare

    cfg = result.config
    predictions = {}
    for g in cfg.passes():
        gc, rule, mb = cfg.pass_configs[g]
        predictions[cfg.pass_name(g)] = cluster_compare.predict(
            cfg, {"comm_group_call_opt": gc, "muon_partition_strategy": rule,
                  "comm_buffer_size_MB": mb})
    result.prediction = predictions
    comp = cluster_compare.comparison(result, rec, predictions)
    for line in cluster_compare.comparison_lines(comp):
        print(line)
    return comp


def comparison_lines(result: ClusterResult) -> List[str]:
    """Measured vs predicted, option off and on side by side."""
    measured = result.per_pass()
    pred = result.prediction or {}
    rows = [("", "off", "on")]

    def cell(g: int, fn) -> str:
        return fn(g) if g in measured else "-"

    rows.append(("measured inter-node bytes/step",
                 *(cell(g, lambda g: fmt_bytes(measured[g]["inter_node_bytes_per_step"]))
                   for g in (0, 1))))
    rows.append(("predicted (plan tool, gloo)",
                 *(fmt_bytes(pred[t]["inter_node_bytes"]) if t in pred else "-"
                   for t in ("off", "on"))))
    rows.append(("measured / predicted",
                 *(f"{measured[g]['inter_node_bytes_per_step'] / pred[t]['inter_node_bytes']:.3f}"
                   if g in measured and t in pred and pred[t]["inter_node_bytes"] else "-"
                   for g, t in ((0, "off"), (1, "on")))))
    rows.append(("  of which dense Muon (predicted)",
                 *(fmt_bytes(pred[t]["dense_muon_bytes"]) if t in pred else "-"
                   for t in ("off", "on"))))
    if 0 in measured and 1 in measured and "off" in pred and "on" in pred:
        # MoE-colour and 1-D traffic is the same with the option on and off,
        # so the difference of the totals is the dense Muon saving.
        saved = (measured[0]["inter_node_bytes_per_step"]
                 - measured[1]["inter_node_bytes_per_step"])
        rows.append(("dense saving off - on: measured",
                     fmt_bytes(saved),
                     f"predicted {fmt_bytes(pred['off']['dense_muon_bytes'] - pred['on']['dense_muon_bytes'])}"))
    rows.append(("measured step time",
                 *(cell(g, lambda g: f"{measured[g]['step_time_s']:.3f} s") for g in (0, 1))))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    return [f"{a:<{w0}}  {b:>{w1}}  {c}" for a, b, c in rows]
