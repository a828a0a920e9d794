# Copyright (c) 2026 paddle_muon_ext Authors. All Rights Reserved.
# Licensed under the Apache License, Version 2.0.
"""Suites here import their helpers (muon_tiny_moe, muon_sim_runner,
launch_utils, gloo_compat) by module name, as Paddle's fleet tests do."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
