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
"""``paddle-muon-ext`` console script.

    paddle-muon-ext plan    ...  installed tool (no checkout needed)
    paddle-muon-ext cluster ...  installed tool (needs root; its worker lives in the checkout)
    paddle-muon-ext verify  ...  needs the source checkout's test harness
    paddle-muon-ext demo   ...   runs tools/demo.py of the source checkout
    paddle-muon-ext hangs LOG_DIR  installed tool (flight-recorder dumps of a hung job)
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Sequence

_COMMANDS = ("plan", "verify", "cluster", "hangs", "demo")


def _checkout_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to the subcommand; returns its exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in _COMMANDS:
        print(f"usage: paddle-muon-ext {{{','.join(_COMMANDS)}}} [options]", file=sys.stderr)
        return 2
    if args[0] == "verify" and not os.path.isdir(os.path.join(_checkout_root(), "test", "mock")):
        print("error: paddle-muon-ext verify needs a source checkout (its test/mock harness); "
              "install with 'pip install -e .' from a checkout", file=sys.stderr)
        return 2
    if args[0] != "demo":
        from .tools.cli import main as tools_main

        return tools_main(args)
    script = os.path.join(_checkout_root(), "tools", "demo.py")
    if not os.path.isfile(script):
        print("error: paddle-muon-ext demo needs a source checkout (tools/demo.py); "
              "install with 'pip install -e .' from a checkout", file=sys.stderr)
        return 2
    sys.argv = [script, *args[1:]]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        return int(done.code or 0)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
