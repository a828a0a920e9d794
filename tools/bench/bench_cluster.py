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
"""Measured inter-node bytes and step time on the namespace cluster vs the plan tool.

    PYTHONPATH=python:test python3 tools/bench/bench_cluster.py
        [--layouts 4x2:4:2 3x2:3:2] [--link-mbit 100] [--steps 3]
        [--hidden 256] [--inner 64] [--out-dir DIR]
    PYTHONPATH=python:test python3 tools/bench/bench_cluster.py --probe

For each layout ``NODESxGPN:EP:MS`` one ``muon_comm.py cluster`` run (root,
network namespaces; see ``paddle_muon_ext.tools.cluster``) trains the resized
tiny MoE with ``comm_group_call_opt`` off, then on, in the same cluster, and
reads every node link's byte counters around each step. Reported per layout
and option: measured inter-node bytes per step (steps after the first), the
plan tool's gloo prediction (``compute_plan(..., backend="gloo")``: every
collective of the step; dense Muon share listed apart), measured / predicted,
and the mean step time; then on / off ratios of bytes and step time. Writes
``cluster.txt`` (the table), ``cluster.json`` and ``cluster.png`` to
``--out-dir``. Exit 2 when the box cannot build namespaces.

Targets (printed, not asserted): measured / predicted within 1 +- 0.10;
option on moves fewer inter-node bytes than off.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
for _p in (os.path.join(_REPO, "python"), os.path.join(_REPO, "tools")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import muon_comm  # noqa: E402  (tools/)

from paddle_muon_ext.tools import cluster  # noqa: E402

TOLERANCE = 0.10


def parse_layout(text: str) -> Dict[str, int]:
    """``4x2:4:2`` -> nodes 4, gpn 2, ep 4, moe_sharding 2."""
    try:
        nodes_gpn, ep, ms = text.split(":")
        nodes, gpn = nodes_gpn.lower().split("x")
        return {"nodes": int(nodes), "gpn": int(gpn), "ep": int(ep), "ms": int(ms)}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"layout {text!r}: expected NODESxGPN:EP:MS, e.g. 4x2:4:2") from None


def rows_of(result: cluster.ClusterResult, prediction: Dict[str, Any]) -> List[Dict[str, Any]]:
    cfg = result.config
    rows = []
    for g, m in result.per_pass().items():
        tag = "on" if g else "off"
        pred = prediction[tag]
        rows.append({
            "layout": f"{cfg.nodes}x{cfg.procs_per_node} ep={cfg.ep} ms={cfg.moe_sharding}",
            "option": tag,
            "measured_bytes": m["inter_node_bytes_per_step"],
            "predicted_bytes": pred["inter_node_bytes"],
            "ratio": m["inter_node_bytes_per_step"] / pred["inter_node_bytes"],
            "predicted_dense_bytes": pred["dense_muon_bytes"],
            "step_time_s": m["step_time_s"],
            "timed_steps": m["timed_steps"],
        })
    return rows


def format_table(rows: Sequence[Dict[str, Any]], link_mbit: float) -> str:
    head = (f"{'layout':<20} {'option':<6} {'measured B/step':>15} {'predicted':>12} "
            f"{'meas/pred':>9} {'dense pred':>11} {'step time':>10}")
    lines = [f"# inter-node bytes per step (node-link counters) vs plan tool (gloo); "
             f"links {link_mbit:g} Mbit/s", head]
    for r in rows:
        lines.append(f"{r['layout']:<20} {r['option']:<6} {r['measured_bytes']:>15.0f} "
                     f"{r['predicted_bytes']:>12.0f} {r['ratio']:>9.3f} "
                     f"{r['predicted_dense_bytes']:>11.0f} {r['step_time_s']:>9.3f}s")
    by_layout: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for r in rows:
        by_layout.setdefault(r["layout"], {})[r["option"]] = r
    for layout, pair in by_layout.items():
        if "on" in pair and "off" in pair:
            on, off = pair["on"], pair["off"]
            lines.append(
                f"RESULT {layout}: on/off inter-node bytes {on['measured_bytes'] / off['measured_bytes']:.3f} "
                f"(predicted {on['predicted_bytes'] / off['predicted_bytes']:.3f}), "
                f"step time {on['step_time_s'] / off['step_time_s']:.3f}; "
                f"measured/predicted off {off['ratio']:.3f} on {on['ratio']:.3f} "
                f"(target 1 +- {TOLERANCE})")
    return "\n".join(lines)


def draw_png(rows: Sequence[Dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['layout']}\n{r['option']}" for r in rows]
    x = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(7, 1.6 * len(rows) + 3), 3.8))
    ax1.bar([i - 0.2 for i in x], [r["measured_bytes"] / 1e6 for r in rows], 0.4,
            label="measured")
    ax1.bar([i + 0.2 for i in x], [r["predicted_bytes"] / 1e6 for r in rows], 0.4,
            label="predicted (gloo)")
    ax1.bar([i + 0.2 for i in x], [r["predicted_dense_bytes"] / 1e6 for r in rows], 0.4,
            fill=False, hatch="//", label="of which dense Muon")
    ax1.set_ylabel("inter-node MB / step")
    ax1.set_xticks(list(x))
    ax1.set_xticklabels(labels, fontsize=7)
    ax1.legend(fontsize=7)
    ax2.bar(list(x), [r["step_time_s"] for r in rows], 0.5, color="tab:gray")
    ax2.set_ylabel("step time, s")
    ax2.set_xticks(list(x))
    ax2.set_xticklabels(labels, fontsize=7)
    fig.suptitle("namespace cluster: comm_group_call_opt off vs on", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def probe_table(result: cluster.ClusterResult) -> str:
    """Per collective: each node's measured link TX in units of S next to the
    gloo model's (``paddle_muon_ext.tools.gloo_model``)."""
    from paddle_muon_ext.tools import gloo_model

    gpn, nodes = result.config.procs_per_node, result.config.nodes
    measured: Dict[tuple, List[float]] = {}
    for p in result.probes:
        key = (p["group"], tuple(p["ranks"]), p["op"], p["root"], p["nbytes"])
        measured.setdefault(key, [0.0] * nodes)
        if p["leader"]:
            measured[key][p["rank"] // gpn] += p["tx"] / p["nbytes"]
    lines = ["# node-link TX per node, units of S (measured | gloo model)"]
    worst = 0.0
    for (name, ranks, op, root, nbytes), got in measured.items():
        if op == "barrier":
            continue
        want = [0.0] * nodes
        for a, b, n in gloo_model.collective_edges(op, list(ranks), nbytes, root):
            if a // gpn != b // gpn:
                want[a // gpn] += n / nbytes
        worst = max([worst] + [abs(g - w) for g, w in zip(got, want)])
        lines.append(f"{name:<7} {op:<10} root {root:<2} "
                     + " ".join(f"{g:6.3f}|{w:5.3f}" for g, w in zip(got, want)))
    lines.append(f"RESULT probe: max |measured - model| = {worst:.4f} S per node")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--layouts", nargs="+", type=parse_layout,
                        default=[parse_layout("4x2:4:2"), parse_layout("3x2:3:2")])
    parser.add_argument("--link-mbit", type=float, default=cluster.DEFAULT_LINK_MBIT)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=cluster.DEFAULT_HIDDEN)
    parser.add_argument("--inner", type=int, default=cluster.DEFAULT_INNER)
    parser.add_argument("--out-dir", default=".")
    parser.add_argument("--probe", action="store_true",
                        help="instead: single collectives of 4 MiB on 4 nodes x 2, node-link "
                        "bytes vs the gloo model (how gloo_model was derived)")
    args = parser.parse_args(argv)
    if args.probe:
        cfg = cluster.ClusterConfig(nodes=4, procs_per_node=2, ep=4, moe_sharding=2,
                                    link_mbit=1000, mode="probe")
        try:
            result = cluster.run_cluster(cfg)
        except cluster.ClusterUnavailable as exc:
            print(f"cluster unavailable: {exc}")
            return 2
        if result.status != "PASS":
            print(f"FAIL probe: {result.problems}")
            return 1
        print(probe_table(result))
        return 0
    rows: List[Dict[str, Any]] = []
    for lay in args.layouts:
        cfg = cluster.ClusterConfig(nodes=lay["nodes"], procs_per_node=lay["gpn"], ep=lay["ep"],
                                    moe_sharding=lay["ms"], steps=args.steps,
                                    link_mbit=args.link_mbit, hidden=args.hidden,
                                    inner=args.inner)
        try:
            result = cluster.run_cluster(cfg)
        except cluster.ClusterUnavailable as exc:
            print(f"cluster unavailable: {exc}")
            return 2
        if result.status != "PASS":
            print(f"FAIL {lay}: {result.problems}")
            return 1
        rows += rows_of(result, muon_comm.predict_cluster(cfg))
    table = format_table(rows, args.link_mbit)
    print(table)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "cluster.txt"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out_dir, "cluster.json"), "w") as f:
        json.dump(rows, f, indent=1)
    png = os.path.join(args.out_dir, "cluster.png")
    draw_png(rows, png)
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
