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
"""Checkout entry point of the plan / verify tools (``paddle-muon-ext`` when installed).

    python tools/muon_comm.py plan --ep 16 --moe-sharding 2 --gpus-per-node 8 [--json] [--png F]
    python tools/muon_comm.py verify --ep 8 --moe-sharding 2 --gpus-per-node 4 [--comm-overlap]
    python tools/muon_comm.py cluster --nodes 4 --procs-per-node 2 --ep 4 --moe-sharding 2
    python tools/muon_comm.py hangs LOG_DIR

The tools live in ``paddle_muon_ext.tools`` (args, plan, cost_model, report,
verify, cli); this file only makes them runnable from a checkout without an
install and re-exports their names for scripts written against it.
"""

from __future__ import annotations

import os
import sys
import warnings

# importing paddle (through the package) warns about a missing ccache on every
# run; not our concern, and it would be the first line of every tool's output
warnings.filterwarnings("ignore", message="No ccache found")

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.join(_REPO, "python") not in sys.path:  # fallback when PYTHONPATH is unset
    sys.path.append(os.path.join(_REPO, "python"))

from paddle_muon_ext.tools.args import (  # noqa: E402,F401
    DEFAULT_BUFFER_MB,
    DEFAULT_MODEL,
    DEFAULT_ORDER,
    MuonCommConfig,
    add_config_args,
    build_config,
    load_model,
)
from paddle_muon_ext.tools.cli import build_parser  # noqa: E402,F401
from paddle_muon_ext.tools.cli import main as _main  # noqa: E402
from paddle_muon_ext.tools import presets as moe_presets  # noqa: E402,F401
from paddle_muon_ext.tools.cost_model import BACKENDS, AlphaBeta  # noqa: E402,F401
from paddle_muon_ext.tools.plan import (  # noqa: E402,F401
    TARGET_HIER_RATIO,
    TARGET_RAIL_IMBALANCE,
    compute_plan,
    predict_cluster,
    split_stages,
)
from paddle_muon_ext.tools.report import draw_png, format_table  # noqa: E402,F401
from paddle_muon_ext.tools.verify import (  # noqa: E402,F401
    DATA_MAX_RANKS,
    VERIFY_MODEL,
    run_verify,
)


def main(argv=None) -> int:
    """``python tools/muon_comm.py plan|verify ...``"""
    return _main(argv, prog="muon_comm.py")


if __name__ == "__main__":
    sys.exit(main())
