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
"""Human-readable report and nodes x cards picture of :func:`plan.compute_plan`'s result."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from ..distributed.fleet.meta_optimizers.muon_sharding_options import option_default
from .cost_model import KINDS

__all__ = ["format_table", "draw_png"]


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _fmt_time(t: float) -> str:
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.2f} ms"
    return f"{t * 1e6:.1f} us"


def format_table(res: Dict[str, Any]) -> str:
    """Human-readable report of :func:`compute_plan`'s result."""
    c = res["config"]
    f, h = res["flat"], res["hierarchical"]
    ms = res["model_summary"]
    order = ", ".join(
        f"{n}={ {'pipe': c['pp'], 'moe_sharding': c['moe_sharding'], 'expert': c['ep']}[n] }"
        for n in c["order"]
    )
    lines = [
        f"Muon comm plan: world {res['world_size']} = {res['num_nodes']} nodes x "
        f"{c['gpus_per_node']} cards; order [{order}]",
        f"model {c['model']}: {ms['params']} params, {ms['muon_params']} Muon "
        f"({ms['muon_dense']} dense, {ms['muon_expert']} expert per EP rank), "
        f"{ms['other_params']} other; grad buffers {c['buffer_size_MB']:g} MB; "
        f"comm_overlap {'on' if c.get('comm_overlap') else 'off'}; owners by "
        f"{c.get('partition_strategy', option_default('muon_partition_strategy'))} partition",
    ]
    g = res["groups"]
    lines.append(
        "groups: " + "; ".join(
            f"{k} {g[k]['count']} x {g[k]['size']} ranks" for k in KINDS
        )
    )
    lines.append("")
    rows: List[Tuple[str, str, str]] = []

    def row(label, fv, hv):
        rows.append((label, fv, hv))

    row("Muon buckets (dense / moe)",
        f"{f['num_buckets']['dense']} / {f['num_buckets']['moe']}",
        f"{h['num_buckets']['dense']} / {h['num_buckets']['moe']}")
    for k in KINDS:
        row(f"collectives/step: {k}", str(f["collectives_per_step"][k]),
            str(h["collectives_per_step"][k]))
    row("collectives/step: total", str(f["collectives_total"]), str(h["collectives_total"]))
    row("coalesced launches/step", str(sum(f["coalesced_launches_per_step"].values())),
        str(sum(h["coalesced_launches_per_step"].values())))
    for link, label in (("intra_node", "intra-node"), ("inter_node", "inter-node")):
        row(f"bytes/rank {label} max / mean",
            f"{_fmt_bytes(f['bytes_per_rank'][link]['max'])} / "
            f"{_fmt_bytes(f['bytes_per_rank'][link]['mean'])}",
            f"{_fmt_bytes(h['bytes_per_rank'][link]['max'])} / "
            f"{_fmt_bytes(h['bytes_per_rank'][link]['mean'])}")
    row("inter-node bytes, Muon params", _fmt_bytes(f["inter_node_bytes"]),
        _fmt_bytes(h["inter_node_bytes"]))
    row("  lower bound (DESIGN 6)", _fmt_bytes(f["inter_node_bytes_bound"]),
        _fmt_bytes(h["inter_node_bytes_bound"]))
    row("  ratio to bound", f"{f['inter_node_ratio_to_bound']:.4f}",
        f"{h['inter_node_ratio_to_bound']:.4f}")
    row("inter-node bytes, all (+RS/AG)", _fmt_bytes(f["inter_node_bytes_all"]),
        _fmt_bytes(h["inter_node_bytes_all"]))
    row("rail imbalance (busiest/mean)", f"{f['rail_imbalance']:.4f}",
        f"{h['rail_imbalance']:.4f}")
    for colour, label in (("dense", "dense colour"), ("moe", "MoE colour")):
        fc, hc = f["by_colour"][colour], h["by_colour"][colour]
        row(f"  {label}: ratio / rail imbalance",
            f"{fc['inter_node_ratio_to_bound']:.4f} / {fc['rail_imbalance']:.4f}",
            f"{hc['inter_node_ratio_to_bound']:.4f} / {hc['rail_imbalance']:.4f}")
    row("optimizer state max/mean", f"{f['optimizer_state_max_over_mean']:.4f}",
        f"{h['optimizer_state_max_over_mean']:.4f}")
    row("est. time Muon comm (a-b)", _fmt_time(f["estimated_muon_time_s"]),
        _fmt_time(h["estimated_muon_time_s"]))
    row("est. time step comm (a-b)", _fmt_time(f["estimated_time_s"]),
        _fmt_time(h["estimated_time_s"]))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(max(len(r[1]) for r in rows), len("flat"))
    lines.append(f"{'':<{w0}}  {'flat':>{w1}}  hierarchical")
    for label, fv, hv in rows:
        lines.append(f"{label:<{w0}}  {fv:>{w1}}  {hv}")
    r = res["hierarchical_over_flat"]
    lines.append("")
    lines.append(
        f"hierarchical / flat: Muon inter-node bytes {r['inter_node_bytes']:.3f}, "
        f"Muon comm time {r['estimated_muon_time_s']:.3f}, step comm time "
        f"{r['estimated_time_s']:.3f}"
    )
    for p in res["partitions"]:
        lines.append(
            f"partition {p['colour']} stage {p['stage']}: {p['num_params']} matrices over "
            f"{p['nranks']} ranks, {p['num_buckets']} buckets, state max/mean "
            f"{p['state_bytes_max_over_mean']:.3f} (floor {p['state_floor']:.3f})"
        )
    for rule, fig in res.get("partition_rules", {}).items():
        lines.append(
            f"partition rule {rule}: state max/mean "
            f"{fig['optimizer_state_max_over_mean']:.3f}, {fig['empty_ranks']} ranks own "
            f"nothing, hierarchical ratio to bound "
            f"{fig['hierarchical_inter_node_ratio_to_bound']:.4f}, rail imbalance "
            f"{fig['hierarchical_rail_imbalance']:.4f}, step comm time flat "
            f"{_fmt_time(fig['flat_estimated_time_s'])} / hierarchical "
            f"{_fmt_time(fig['hierarchical_estimated_time_s'])}"
        )
    ab = res["alpha_beta"]
    lines.append(
        f"alpha-beta: NVLink alpha {ab['alpha_nvlink_s']:g} s, beta {ab['beta_nvlink_s_per_B']:.3g} "
        f"s/B ({1 / ab['beta_nvlink_s_per_B'] / 1e9:.0f} GB/s); network alpha "
        f"{ab['alpha_net_s']:g} s, beta {ab['beta_net_s_per_B']:.3g} s/B "
        f"({1 / ab['beta_net_s_per_B'] / 1e9:.0f} GB/s)"
    )
    t = res["targets"]
    lines.append(
        f"target hierarchical ratio to bound <= {t['hierarchical_ratio_to_bound_max']}: "
        f"{t['hierarchical_ratio_to_bound']:.4f} {'met' if t['ratio_met'] else 'MISSED'}"
    )
    lines.append(
        f"target rail imbalance <= {t['rail_imbalance_max']}: {t['rail_imbalance']:.4f} "
        f"{'met' if t['rail_met'] else 'MISSED'}"
    )
    lines.append(
        f"info (not a target): dense cross-node phase alone, rail imbalance "
        f"{t['dense_rail_imbalance']:.4f} "
        f"({'within' if t['dense_rail_within'] else 'above'} {t['rail_imbalance_max']})"
    )
    return "\n".join(lines)


def draw_png(res: Dict[str, Any], path: str) -> None:
    """Nodes x cards grid of the hierarchical path: colour = dense Muon parameter
    bytes owned by the rank (what crosses the rank's rail), text = rank and owned
    matrices (dense ``D``, MoE colour ``E``); same-card groups as coloured lines,
    pipeline stages as dashed outlines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plan = res["_plan"]
    gpn, nodes = plan.gpus_per_node, plan.num_nodes
    detail = res["owned_by_colour"]["hierarchical"]
    mb = [b / 2**20 for b in detail["dense_param_bytes"]]
    grid = [[mb[n * gpn + c] for c in range(gpn)] for n in range(nodes)]
    top = max(max(mb), 1e-9)
    fig, ax = plt.subplots(figsize=(max(6.5, 1.5 + 0.95 * gpn), max(3.5, 1.6 + 0.55 * nodes)))
    img = ax.imshow(grid, cmap="Blues", aspect="auto", vmin=0, vmax=top)
    for n in range(nodes):
        for c in range(gpn):
            r = n * gpn + c
            ax.text(c - 0.08, n, f"r{r}\nD{detail['dense'][r]} E{detail['moe'][r]}",
                    ha="center", va="center", fontsize=6.5,
                    color="white" if mb[r] > 0.6 * top else "black")
    cmap = plt.get_cmap("tab10" if gpn <= 10 else "tab20")
    for stage in range(plan.pp_degree):
        for c in range(gpn):
            ranks = plan.same_card_ranks(stage, c)
            ys = [r // gpn for r in ranks]
            ax.plot([c + 0.36] * len(ys), ys, "-o", color=cmap(c % cmap.N), lw=1.5, ms=3,
                    alpha=0.85)
        stage_nodes = plan.nodes_of_stage(stage)
        ax.add_patch(plt.Rectangle((-0.5, min(stage_nodes) - 0.5), gpn, len(stage_nodes),
                                   fill=False, ec="red", lw=1.2, ls="--"))
    ax.set_xticks(range(gpn))
    ax.set_xticklabels([f"card {c}" for c in range(gpn)], fontsize=7)
    ax.set_yticks(range(nodes))
    ax.set_yticklabels([f"node {n}" for n in range(nodes)], fontsize=7)
    h = res["hierarchical"]
    c = res["config"]
    ax.set_title(
        f"ep={c['ep']} ms={c['moe_sharding']} pp={c['pp']} gpn={gpn} (hierarchical path)\n"
        f"ratio to bound {h['inter_node_ratio_to_bound']:.3f}, rail imbalance "
        f"{h['rail_imbalance']:.3f} (dense {h['by_colour']['dense']['rail_imbalance']:.3f}); "
        "lines: same-card groups",
        fontsize=8,
    )
    fig.colorbar(img, ax=ax, fraction=0.04, label="dense Muon MiB owned")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
