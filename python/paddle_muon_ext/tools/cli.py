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
"""The ``plan`` / ``verify`` command line (``paddle-muon-ext`` and ``tools/muon_comm.py``)."""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Optional, Sequence

from . import limits
from .args import DEFAULT_BUFFER_MB, add_config_args, build_config, load_model
from .cost_model import BACKENDS, AlphaBeta
from ..distributed.fleet.meta_optimizers.muon_sharding.settings import option_default
from .guard import ArgumentParser, emit_json, guarded, printable
from .plan import PARTITION_RULES, predict_cluster
from .verify import CheckoutMissing, add_verify_parser, cmd_verify

# the optimizer's default owner rule (one table holds it)
DEFAULT_PARTITION = option_default("muon_partition_strategy")

__all__ = ["build_parser", "main"]

# importing paddle warns about a missing ccache on every run; not our concern
warnings.filterwarnings("ignore", message="No ccache found")


def build_parser(prog: str = "paddle-muon-ext") -> argparse.ArgumentParser:
    """The parser of every subcommand."""
    parser = ArgumentParser(
        prog=prog, description="Communication plan of the sharded Muon optimizer."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "plan", help="count collectives / bytes of the flat and hierarchical paths",
        description="Count one step's collectives and bytes of the flat and the "
        "hierarchical (comm_group_call_opt) path, from the layout the optimizer builds; "
        "see paddle_muon_ext.tools.cost_model for the model.",
        epilog=model_format_help(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(p)
    d = AlphaBeta()
    cost = p.add_argument_group("alpha-beta model")
    cost.add_argument("--alpha-nvlink", type=float, default=d.alpha_nvlink,
                      help=f"NVLink latency per hop, s (default {d.alpha_nvlink:g})")
    cost.add_argument("--beta-nvlink", type=float, default=d.beta_nvlink,
                      help=f"NVLink s/B (default {d.beta_nvlink:.3g} = 150 GB/s)")
    cost.add_argument("--alpha-net", type=float, default=d.alpha_net,
                      help=f"network latency per hop, s (default {d.alpha_net:g})")
    cost.add_argument("--beta-net", type=float, default=d.beta_net,
                      help=f"network s/B per NIC (default {d.beta_net:.3g} = 25 GB/s)")
    p.add_argument("--buffer-size-MB", type=float, default=DEFAULT_BUFFER_MB,
                   help="fused gradient buffer size (sharding_configs.comm_buffer_size_MB; "
                   "0 = one reduce per parameter; default 256)")
    p.add_argument("--comm-overlap", action="store_true",
                   help="sharding_configs.comm_overlap: hooks launch each buffer's reduce")
    p.add_argument("--partition", choices=PARTITION_RULES, default=DEFAULT_PARTITION,
                   help="owner rule of the main figures (sharding_configs."
                   f"muon_partition_strategy; default {DEFAULT_PARTITION}, the optimizer's; "
                   "develop's rule and balanced are reported side by side, and rail where "
                   "it is the one chosen)")
    p.add_argument("--backend", choices=BACKENDS, default="nccl",
                   help="collective algorithms: nccl rings (GPU, default) or gloo as "
                   "measured on the namespace cluster (CPU)")
    p.add_argument("--no-group-call", action="store_true",
                   help="count the flat path alone (comm_group_call_opt off); works for "
                   "every layout, a single node and --gpus-per-node 1 included")
    p.add_argument("--recommend", action="store_true",
                   help="also estimate comm_group_call_opt off/on x every owner rule x "
                   "buffers of 64/256/1024 MB (and --buffer-size-MB; with develop's rule also "
                   "the sizes giving one buffer per colour and dtype) and name the fastest, "
                   "with its ratio to the default and to the lower bound (JSON: "
                   '"recommend"); the default wins ties; about 2x plan\'s time (12-20 paths '
                   "instead of 4)")
    p.add_argument("--json", action="store_true",
                   help="print only a JSON dict on stdout (notes go to stderr)")
    p.add_argument("--png", metavar="FILE",
                   help="draw nodes x cards with owners and rails, flat and hierarchical "
                   "path side by side into FILE (.png; FILE without a suffix gets .png; "
                   "an existing FILE keeps its mode, a read-only one is refused; needs "
                   'matplotlib: pip install ".[plot]")')
    add_verify_parser(sub)
    sub.add_parser("hangs", help="name the rank(s) a hung job waits for, from the "
                   "flight-recorder dumps in LOG_DIR (hangs LOG_DIR)")
    _cluster_tool().add_parser(sub)
    return parser


def model_format_help() -> str:
    """The ``--model FILE`` format, as ``plan --help`` prints it (the rules are
    :func:`limits.read_model_file`'s and :func:`presets.muon_applies`')."""
    from . import presets

    lim = limits.LIMITS
    return "\n".join([
        "--model FILE: a JSON list of parameters (or {\"params\": [...]}), e.g.",
        '  [{"name": "layers.0.mlp.up", "shape": [1024, 4096], "dtype": "bfloat16"},',
        '   {"name": "layers.1.experts.up", "shape": [4, 1024, 1408], "is_expert": true}]',
        "  name       string, required",
        "  shape      1 to 3 positive integers, in elements (bytes = elements x dtype",
        "             size); a Muon matrix is 2-D, or 3-D [local experts, in, out]",
        f"  dtype      {', '.join(limits.DTYPES)} (default float32)",
        "  is_expert  true for an expert (MoE) parameter (default false)",
        "  use_muon   true / false (default: true for 2-D / 3-D shapes whose name",
        f"             matches none of {', '.join(presets.DEFAULT_EXCLUDE_PATTERNS)})",
        "The list is what one expert-parallel rank holds: every dense parameter of",
        "the model and only that rank's local experts (64 experts at --ep 16: list",
        "4 per layer). --pp splits the list in order at equal cumulative bytes.",
        f"Limits: {lim.model_entries} entries, {lim.model_file_bytes >> 20} MiB, each "
        f"dimension <= {lim.dim}. {lim.model_entries}",
        "entries take < 60 s (2-core box) on worlds of up to 256 ranks; larger",
        "worlds with that many entries take longer.",
    ])


def _cluster_tool():
    from . import cluster

    return cluster


def check_plan_args(args: argparse.Namespace):
    """Every ``plan`` input checked before any work.

    Returns:
        (config, PNG path or None, the model's parameters): the parameters
        read here are the ones planned (a 200,000-entry file is read once).

    Raises:
        InputError: the first bad value, as ``<what> <value>: <why>, <fix>``.
    """
    cfg = build_config(args)
    for flag, value, example, high in (
            ("--alpha-nvlink", args.alpha_nvlink, "5e-06", limits.LIMITS.alpha_s),
            ("--beta-nvlink", args.beta_nvlink, "6.7e-12", limits.LIMITS.beta_s_per_byte),
            ("--alpha-net", args.alpha_net, "2e-05", limits.LIMITS.alpha_s),
            ("--beta-net", args.beta_net, "4e-11", limits.LIMITS.beta_s_per_byte)):
        # bounded above so every time stays finite (JSON has no Infinity)
        limits.check_float(flag, value, f"pass e.g. {flag} {example}", high=high)
    limits.check_float("--buffer-size-MB", args.buffer_size_MB,
                       f"pass 0..{limits.LIMITS.buffer_mb:g} (0: one reduce per parameter)",
                       positive=False, high=limits.LIMITS.buffer_mb)
    # what the optimizer refuses is not planned (its own rule), before the model is read
    limits.check_optimizer_accepts(cfg.pp, args.comm_overlap, args.buffer_size_MB,
                                   args.partition)
    params = load_model(cfg.model)
    png = None
    if args.png is not None:
        png = limits.check_writable("--png", limits.png_path(args.png), suffix=".png")
        check_plotting()
    return cfg, png, params


def check_plotting() -> None:
    """matplotlib is importable (the ``[plot]`` extra), checked before any work.

    Raises:
        InputError: it is not, naming the extra that installs it.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise limits.InputError("--png", "", f"needs matplotlib ({exc})",
                                'install it with pip install ".[plot]" (or pip install '
                                "matplotlib), or drop --png") from None


def cmd_plan(args: argparse.Namespace) -> int:
    """Run ``plan`` (without the cyclic garbage collector: :func:`.plan.paused_gc`)."""
    from .plan import paused_gc

    with paused_gc():
        return _cmd_plan(args)


def _cmd_plan(args: argparse.Namespace) -> int:
    cfg, png, params = check_plan_args(args)
    note = limits.check_local_size(cfg.gpus_per_node)
    if note:
        print(note, file=sys.stderr)
    from .cost_model import AlphaBeta
    from .plan import compute_plan, json_ready
    from .plan_world import build_layout_plan
    from .report import format_table, render_png

    group_call = not args.no_group_call
    try:
        build_layout_plan(cfg, group_call)
    except ValueError as exc:
        if not group_call:
            raise
        raise ValueError(f"{exc} (plan --no-group-call shows the flat path of this "
                         "layout)") from None
    ab = AlphaBeta(args.alpha_nvlink, args.beta_nvlink, args.alpha_net, args.beta_net)
    res = compute_plan(cfg, ab, buffer_size_MB=args.buffer_size_MB, params=params,
                       comm_overlap=args.comm_overlap, partition_strategy=args.partition,
                       backend=args.backend, group_call=group_call)
    from . import recommend

    estimates = recommend.annotate(res, ab)  # the default and the bound: every run
    if args.recommend:
        recommend.recommend(res, estimates)
    if png:
        # with --recommend: the default configuration beside the pick
        write_png(png, render_png(recommend.figure_input(res, estimates) if args.recommend
                                  else res))
    if args.json:
        emit_json(json_ready(res))
    else:
        print("\n".join([format_table(res), *recommend.format_lines(res)]))
        if png:
            print(f"wrote {printable(png)}")
    return 0


def write_png(path: str, data: bytes) -> None:
    """Write the rendered picture whole or not at all (:func:`limits.write_output`).

    Raises:
        InputError: the write failed (full disk, device error), in one line.
    """
    limits.write_output("--png", path, data)


def main(argv: Optional[Sequence[str]] = None, prog: str = "paddle-muon-ext") -> int:
    """Parse ``argv`` and run the subcommand; exit status 0 / 1 (FAIL) / 2 (error).

    Never raises: every failure is one ``error:`` line (:func:`guard.guarded`).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    return guarded(lambda: _run(argv, prog), json_mode="--json" in argv)


def _run(argv: list, prog: str) -> int:
    if argv[:1] == ["hangs"]:
        from .hangs import main as hangs_main

        return hangs_main(argv[1:], prog=f"{prog} hangs")
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        if args.command == "plan":
            return cmd_plan(args)
        if args.command == "cluster":
            return _cluster_tool().main(args, predict=predict_cluster)
        return cmd_verify(args)
    except (ValueError, TypeError, CheckoutMissing) as exc:
        print(f"error: {printable(str(exc))}", file=sys.stderr)
        return 2
