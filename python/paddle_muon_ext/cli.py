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
"""``paddle-muon-ext`` console script: one line per subcommand in ``--help``.

``plan`` and ``hangs`` work from any install; ``verify``, ``cluster`` and
``demo`` run the source checkout's harness. Every subcommand's ``--help``
works anywhere (no checkout, no Paddle).
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Sequence

from .tools.guard import guarded

__all__ = ["COMMANDS", "main"]

#: Subcommand -> its one-line summary (the top-level ``--help``).
COMMANDS = {
    "plan": "collectives, bytes and time of one step, flat vs comm_group_call_opt (any install)",
    "verify": "check a layout's schedule and values in a simulated world (source checkout)",
    "cluster": "train on a multi-node gloo cluster of network namespaces (root, checkout)",
    "hangs": "whom a hung job waits for, or what a crashed job raised (flight-recorder dumps)",
    "demo": "train the tiny MoE on 8 CPU processes, option off and on (source checkout)",
}
VERSION = "0.1.0"


def _checkout_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def top_level_help(prog: str = "paddle-muon-ext") -> str:
    """The top-level ``--help`` text."""
    width = max(len(c) for c in COMMANDS)
    lines = [f"usage: {prog} COMMAND [options]    ({prog} COMMAND --help for its options)",
             "",
             "Tools of the sharded Muon optimizer for PaddlePaddle (comm_group_call_opt).",
             "",
             "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, text in COMMANDS.items()]
    lines += ["", "options:", "  -h, --help  show this help and exit",
              "  --version   print the version and exit",
              "", "exit status: 0 success / PASS, 1 FAIL, 2 bad input or unavailable"]
    return "\n".join(lines)


def _wants_help(args: Sequence[str]) -> bool:
    return any(a in ("-h", "--help") for a in args)


def _demo_help() -> str:
    return ("usage: paddle-muon-ext demo [--steps N] [--timeout S]\n\n"
            f"{COMMANDS['demo']}.\nIt runs tools/demo.py of the source checkout; install "
            "with 'pip install -e .' from a checkout to use it.\n\noptions:\n"
            "  --steps N    training steps per pass (default 5)\n"
            "  --timeout S  launch timeout in seconds (default 170)")


def _dispatch(args: list) -> int:
    if not args or args[0] in ("-h", "--help"):
        print(top_level_help(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] == "--version":
        print(f"paddle-muon-ext {VERSION}")
        return 0
    command = args[0]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}; use one of {', '.join(COMMANDS)} "
              "(paddle-muon-ext --help)", file=sys.stderr)
        return 2
    root = _checkout_root()
    if (command == "verify" and not _wants_help(args[1:])
            and not os.path.isdir(os.path.join(root, "test", "mock"))):
        print("error: paddle-muon-ext verify needs a source checkout (its test/mock harness); "
              "install with 'pip install -e .' from a checkout", file=sys.stderr)
        return 2
    if command != "demo":
        from .tools.cli import main as tools_main

        return tools_main(args)
    script = os.path.join(root, "tools", "demo.py")
    if not os.path.isfile(script):
        if _wants_help(args[1:]):
            print(_demo_help())
            return 0
        print("error: paddle-muon-ext demo needs a source checkout (tools/demo.py); "
              "install with 'pip install -e .' from a checkout", file=sys.stderr)
        return 2
    saved = sys.argv
    sys.argv = [script, *args[1:]]
    try:
        # loaded as a module (not "__main__"), then run under the name typed
        demo = runpy.run_path(script, run_name="paddle_muon_ext_demo")
        code = demo["main"](args[1:], prog="paddle-muon-ext demo")
        return 0 if code is None else code
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    finally:
        sys.argv = saved


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to the subcommand; returns its exit status (never raises)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return guarded(lambda: _dispatch(args), json_mode="--json" in args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
