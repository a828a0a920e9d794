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

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..distributed.fleet.meta_optimizers.muon_sharding.settings import option_default
from .cost_model import KINDS, ratio

__all__ = ["format_table", "draw_png", "label_colour", "luminance", "plan_figure", "render_png"]

#: Largest picture whose cells carry their rank / matrix labels.
MAX_LABELLED_CELLS = 512
#: Most node / card ticks on an axis (every k-th beyond it).
MAX_TICKS = 32


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
    """Human-readable report of :func:`compute_plan`'s result (one column per path)."""
    c = res["config"]
    paths = [("flat", res["flat"])]
    if res.get("hierarchical") is not None:
        paths.append(("hierarchical", res["hierarchical"]))
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
    if len(paths) == 1:
        lines.append("flat path only (--no-group-call: comm_group_call_opt off)")
    g = res["groups"]
    lines.append(
        "groups: " + "; ".join(
            f"{k} {g[k]['count']} x {g[k]['size']} ranks" for k in KINDS if k in g
        )
    )
    lines.append("")
    rows: List[Tuple[str, ...]] = []

    def row(label: str, fn) -> None:
        rows.append((label, *(fn(p) for _, p in paths)))

    row("Muon buckets (dense / moe)",
        lambda p: f"{p['num_buckets']['dense']} / {p['num_buckets']['moe']}")
    for k in KINDS:
        if k in g:
            row(f"collectives/step: {k}", lambda p, k=k: str(p["collectives_per_step"][k]))
    row("collectives/step: total", lambda p: str(p["collectives_total"]))
    row("coalesced launches/step", lambda p: str(sum(p["coalesced_launches_per_step"].values())))
    for link, label in (("intra_node", "intra-node"), ("inter_node", "inter-node")):
        row(f"bytes/rank {label} max / mean",
            lambda p, link=link: f"{_fmt_bytes(p['bytes_per_rank'][link]['max'])} / "
            f"{_fmt_bytes(p['bytes_per_rank'][link]['mean'])}")
    row("inter-node bytes, Muon params", lambda p: _fmt_bytes(p["inter_node_bytes"]))
    row("  lower bound", lambda p: _fmt_bytes(p["inter_node_bytes_bound"]))
    row("  ratio to bound", lambda p: f"{p['inter_node_ratio_to_bound']:.4f}")
    row("inter-node bytes, all (+RS/AG)", lambda p: _fmt_bytes(p["inter_node_bytes_all"]))
    row("rail imbalance (busiest/mean)", lambda p: f"{p['rail_imbalance']:.4f}")
    for colour, label in (("dense", "dense colour"), ("moe", "MoE colour")):
        row(f"  {label}: ratio / rail imbalance",
            lambda p, colour=colour: f"{p['by_colour'][colour]['inter_node_ratio_to_bound']:.4f}"
            f" / {p['by_colour'][colour]['rail_imbalance']:.4f}")
    row("optimizer state max/mean", lambda p: f"{p['optimizer_state_max_over_mean']:.4f}")
    row("est. time Muon comm (a-b)", lambda p: _fmt_time(p["estimated_muon_time_s"]))
    row("est. time step comm (a-b)", lambda p: _fmt_time(p["estimated_time_s"]))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(max(len(r[1]) for r in rows), len("flat"))
    lines.append(f"{'':<{w0}}  {'flat':>{w1}}" + ("  hierarchical" if len(paths) > 1 else ""))
    for r in rows:
        lines.append(f"{r[0]:<{w0}}  {r[1]:>{w1}}" + (f"  {r[2]}" if len(r) > 2 else ""))
    r = res.get("hierarchical_over_flat")
    lines.append("")
    if r is not None:
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
        text = (f"partition rule {rule}: state max/mean "
                f"{fig['optimizer_state_max_over_mean']:.3f}, {fig['empty_ranks']} ranks own "
                "nothing, ")
        if "hierarchical_estimated_time_s" in fig:
            text += (f"hierarchical ratio to bound "
                     f"{fig['hierarchical_inter_node_ratio_to_bound']:.4f}, rail imbalance "
                     f"{fig['hierarchical_rail_imbalance']:.4f}, step comm time flat "
                     f"{_fmt_time(fig['flat_estimated_time_s'])} / hierarchical "
                     f"{_fmt_time(fig['hierarchical_estimated_time_s'])}")
        else:
            text += f"step comm time flat {_fmt_time(fig['flat_estimated_time_s'])}"
        lines.append(text)
    ab = res["alpha_beta"]
    lines.append(
        f"alpha-beta: NVLink alpha {ab['alpha_nvlink_s']:g} s, beta {ab['beta_nvlink_s_per_B']:.3g} "
        f"s/B ({1 / ab['beta_nvlink_s_per_B'] / 1e9:.0f} GB/s); network alpha "
        f"{ab['alpha_net_s']:g} s, beta {ab['beta_net_s_per_B']:.3g} s/B "
        f"({1 / ab['beta_net_s_per_B'] / 1e9:.0f} GB/s)"
    )
    # The project's benchmark targets (res["targets"]) are not printed: "MISSED"
    # beside a user's layout would read as a fault of that layout.
    return "\n".join(lines)


def render_png(res: Dict[str, Any]) -> bytes:
    """:func:`plan_figure` as PNG bytes (written by the caller, so a full disk
    is reported by the caller as one error line)."""
    import io

    import matplotlib

    matplotlib.use("Agg")  # no display needed: the figure goes to a file
    import matplotlib.pyplot as plt

    fig = plan_figure(res)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def label_colour(luminance: float) -> str:
    """Text colour readable on a cell of this relative luminance.

    Args:
        luminance: the cell colour's relative luminance, 0 (black) .. 1 (white).

    Returns:
        str: ``"white"`` on a dark cell, ``"black"`` on a light one.
    """
    # 0.45, not 0.5: mid-blue cells (luminance ~0.45) read better with white text
    return "white" if luminance < 0.45 else "black"


def luminance(rgba: Sequence[float]) -> float:
    """Relative luminance of an sRGB colour (ITU-R BT.709 weights on linear light).

    Args:
        rgba: red, green, blue (and alpha, ignored) in 0..1.

    Returns:
        float: 0 (black) .. 1 (white).
    """
    def linear(v: float) -> float:
        return v / 12.92 if v <= 0.04045 else ((v + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(float(v)) for v in rgba[:3])
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def _panels(res: Dict[str, Any]) -> Tuple[List[str], Optional[str]]:
    """The paths drawn and, when only one is, the note that says why."""
    if res.get("figure_panels"):  # plan --recommend --png: the default and the pick
        return [key for key, _, _ in res["figure_panels"]], None
    if res.get("hierarchical") is not None:
        return ["flat", "hierarchical"], None
    if res["num_nodes"] == 1:
        why = ("one node: nothing crosses nodes, so comm_group_call_opt has nothing to "
               "reroute; flat path only")
    else:
        why = "flat path only (--no-group-call: comm_group_call_opt off)"
    return ["flat"], why


def _runs(nodes: Sequence[int]) -> List[Tuple[int, int]]:
    """(first, count) of each run of adjacent node indices, in order."""
    out: List[Tuple[int, int]] = []
    for n in sorted(nodes):
        if out and out[-1][0] + out[-1][1] == n:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((n, 1))
    return out


def _group_call_panel(res: Dict[str, Any], path: str) -> bool:
    """Whether the panel ``path`` is laid out with comm_group_call_opt on."""
    for key, _, group_call in res.get("figure_panels") or ():
        if key == path:
            return group_call
    return path == "hierarchical"


def _panel_title(res: Dict[str, Any], path: str) -> str:
    summary = res[path]
    t = summary["estimated_time_s"]
    head = {key: title for key, title, _ in res.get("figure_panels") or ()}.get(
        path, f"{path} path (comm_group_call_opt "
              f"{'on' if path == 'hierarchical' else 'off'})")
    text = f"{head}\nest. step comm {_fmt_time(t)}"
    vs = res.get("vs_default")
    if vs is not None:  # annotated by recommend.annotate (every plan run)
        text += f" = {ratio(t, vs['default']['estimated_time_s']):.3f}x default"
    text += (f"\ninter-node ratio to bound {summary['inter_node_ratio_to_bound']:.3f}, "
             f"rail imbalance {summary['rail_imbalance']:.3f}")
    return text


def plan_figure(res: Dict[str, Any]):
    """The nodes x cards picture of :func:`compute_plan`'s result (a matplotlib Figure).

    One panel per path the result holds -- flat and hierarchical side by
    side, on one colour scale so they compare; a flat-only result (one node,
    ``--no-group-call``) gets one panel and a note saying why. Each panel's
    title gives the path's estimated step comm time and its ratio to the
    default configuration (``vs_default``, when annotated).

    One cell per rank: its colour is the dense Muon parameter MiB the rank
    owns (what crosses its rail); its text is ``r<rank>`` and ``D<n> E<m>``,
    the dense and expert (MoE colour) Muon matrices it owns, in black or
    white by the cell's luminance (:func:`label_colour`). Under each card:
    the Muon bytes its rail sends across nodes per step. On the hierarchical
    panel each same-card group is a line; every pipeline stage (sharding
    group) is outlined. The legend says all of it.

    Args:
        res: :func:`compute_plan`'s result (optionally annotated).

    Returns:
        matplotlib.figure.Figure: the picture.
    """
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch, Rectangle

    plan = res["_plan"]
    gpn, nodes = plan.gpus_per_node, plan.num_nodes
    paths, note = _panels(res)
    details = {p: res["owned_by_colour"][p] for p in paths}
    top = max(max(d["dense_param_bytes"]) for d in details.values())
    unit, scale = ("MiB", 2**20) if top >= 2**20 else ("KiB", 2**10)
    mbs = {p: [b / scale for b in d["dense_param_bytes"]] for p, d in details.items()}
    # one scale for every panel, so the same colour means the same MiB in both
    low = min(min(v) for v in mbs.values())
    high = max(max(v) for v in mbs.values())
    lo, hi = (low - 0.5, high + 0.5) if high - low < 1e-9 else (low, high)
    # Beyond a few hundred cells labels cannot be read: the picture keeps a
    # bounded size and the legend says the labels are left out.
    labelled = nodes * gpn <= MAX_LABELLED_CELLS
    panel_w = min(11.0, max(5.0, 1.0 + 0.8 * gpn))  # two panels + bar <= 24 in
    # constrained layout keeps the suptitle, the shared colour bar and the
    # legend outside the panels
    fig, axes = plt.subplots(1, len(paths), squeeze=False, layout="constrained",
                             figsize=(len(paths) * panel_w + 1.5,
                                      min(24.0, max(5.0, 3.4 + 0.55 * nodes))))
    axes = list(axes[0])
    cmap = plt.get_cmap("Blues")
    norm = plt.Normalize(vmin=lo, vmax=hi)
    lines_cmap = plt.get_cmap("tab10" if gpn <= 10 else "tab20")
    for ax, path in zip(axes, paths):
        mb, detail, rails = mbs[path], details[path], res[path]["rail_bytes"]
        grid = [[mb[n * gpn + c] for c in range(gpn)] for n in range(nodes)]
        img = ax.imshow(grid, cmap=cmap, norm=norm, aspect="auto")
        for n in range(nodes if labelled else 0):
            for c in range(gpn):
                r = n * gpn + c
                ax.text(c - 0.08, n, f"r{r}\nD{detail['dense'][r]} E{detail['moe'][r]}",
                        ha="center", va="center", fontsize=6.5,
                        color=label_colour(luminance(cmap(norm(mb[r])))))
        if _group_call_panel(res, path):
            for stage in range(plan.pp_degree):
                for c in range(gpn):
                    ys = [r // gpn for r in plan.same_card_ranks(stage, c)]
                    ax.plot([c + 0.36] * len(ys), ys, "-o", color=lines_cmap(c % lines_cmap.N),
                            lw=1.8, ms=3, alpha=0.9)
        for stage in range(plan.pp_degree):
            # a stage's nodes need not be adjacent (order moe_sharding,pp,ep):
            # one outline per run of adjacent nodes
            for first, count in _runs(plan.nodes_of_stage(stage)):
                # inset so the outline is not hidden under the axes frame
                ax.add_patch(Rectangle((-0.46, first - 0.46), gpn - 0.08, count - 0.08,
                                       fill=False, ec="crimson", lw=2.2, ls="--", zorder=5))
                if plan.pp_degree > 1:  # on a white box: readable on a dark cell too
                    ax.text(-0.44, first - 0.44, f"stage {stage}", ha="left", va="top",
                            fontsize=6, color="crimson", zorder=6,
                            bbox={"facecolor": "white", "alpha": 0.85, "pad": 1, "lw": 0})
        # the rail bytes sit under the axes, horizontal: readable whatever the cells' colour
        cards = range(0, gpn, -(-gpn // MAX_TICKS))
        ax.set_xticks(list(cards))
        ax.set_xticklabels([f"card {c}\n{_fmt_bytes(rails[c])}" for c in cards], fontsize=6.5)
        ax.set_xlabel("card; below it: Muon bytes its rail sends across nodes per step",
                      fontsize=7)
        rows = range(0, nodes, -(-nodes // MAX_TICKS))
        ax.set_yticks(list(rows))
        ax.set_yticklabels([f"node {n}" for n in rows], fontsize=7)
        ax.set_title(_panel_title(res, path), fontsize=8)
    c = res["config"]
    head = (f"ep={c['ep']} ms={c['moe_sharding']} pp={c['pp']} gpn={gpn}, {nodes} "
            f"node{'s' if nodes > 1 else ''}")
    vs = res.get("vs_default")
    if vs is not None:
        head += f"; default step comm {_fmt_time(vs['default']['estimated_time_s'])}"
    if note:
        head += f"\n{note}"
    fig.suptitle(head, fontsize=9)
    fig.colorbar(img, ax=axes, fraction=0.04 / len(axes), pad=0.01,
                 label=f"dense Muon {unit} owned ("
                 f"{'one scale for both panels, ' if len(axes) > 1 else ''}"
                 f"{low:.3g}..{high:.3g})")
    handles = [Patch(facecolor="none", edgecolor="none",
                     label="cell: r<rank>, D<n> dense / E<n> expert Muon matrices owned"
                     if labelled else f"cell: one rank ({nodes * gpn} ranks: labels left out "
                     f"above {MAX_LABELLED_CELLS})")]
    if any(_group_call_panel(res, p) for p in paths):
        handles.append(Line2D([], [], color="tab:blue", marker="o", ms=3, lw=1.8,
                              label="same-card group (hierarchical cross-node step)"))
    handles.append(Line2D([], [], color="crimson", lw=2.2, ls="--",
                          label="pipeline stage (its sharding group)"))
    try:  # "outside" (matplotlib >= 3.7) makes room for the legend below the panels
        fig.legend(handles=handles, loc="outside lower center", ncol=len(handles),
                   fontsize=6.5, frameon=False)
    except ValueError:  # pragma: no cover - older matplotlib: drawn over the bottom edge
        fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=6.5,
                   frameon=False)
    return fig


def draw_png(res: Dict[str, Any], path: str) -> None:
    """Write :func:`render_png`'s picture to ``path``."""
    data = render_png(res)
    with open(path, "wb") as f:
        f.write(data)
