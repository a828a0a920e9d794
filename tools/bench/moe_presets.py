# Copyright (c) 2026 paddle_muon_ext Authors. All Rights Reserved.
# Licensed under the Apache License, Version 2.0.
"""Checkout shim: the presets live in the installed package (``paddle_muon_ext.tools.presets``)."""

import os
import sys

_PYTHON = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "python")
if _PYTHON not in sys.path:  # fallback when PYTHONPATH is unset
    sys.path.append(_PYTHON)

from paddle_muon_ext.tools.presets import *  # noqa: E402,F401,F403
from paddle_muon_ext.tools.presets import ParamSpec, ernie_moe, get_preset  # noqa: E402,F401
