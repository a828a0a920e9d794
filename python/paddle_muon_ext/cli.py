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
"""``paddle-muon-ext`` console script: an alias for the repository tools.

    paddle-muon-ext plan   ...   ->  python tools/muon_comm.py plan ...
    paddle-muon-ext verify ...   ->  python tools/muon_comm.py verify ...
    paddle-muon-ext cluster ...  ->  python tools/muon_comm.py cluster ...
    paddle-muon-ext demo   ...   ->  python tools/demo.py ...

The tools and the test harness they drive live in the source checkout (an
editable install, ``pip install -e .``), not in the installed package.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Sequence

_TOOLS = {"plan": "muon_comm.py", "verify": "muon_comm.py", "cluster": "muon_comm.py",
          "demo": "demo.py"}


def _checkout_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to the tool script; returns its exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in _TOOLS:
        print(f"usage: paddle-muon-ext {{{','.join(_TOOLS)}}} [options]", file=sys.stderr)
        return 2
    script = os.path.join(_checkout_root(), "tools", _TOOLS[args[0]])
    if not os.path.isfile(script):
        print(
            f"error: {script} not found; paddle-muon-ext needs a source checkout "
            "installed with 'pip install -e .'",
            file=sys.stderr,
        )
        return 2
    tool_args = args if _TOOLS[args[0]] == "muon_comm.py" else args[1:]
    sys.argv = [script, *tool_args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        return int(done.code or 0)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
