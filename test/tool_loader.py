# Copyright (c) 2026 paddle_muon_ext Authors. All Rights Reserved.
# Licensed under the Apache License, Version 2.0.
"""Import a script under tools/ as a module, once per test session."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_tool(relpath: str, name: str) -> ModuleType:
    """Load ``tools/<relpath>`` as module ``name`` (cached in sys.modules).

    Args:
        relpath (str): path under ``tools/``, e.g. ``"muon_comm.py"``.
        name (str): module name to register.

    Returns:
        ModuleType: the loaded module.
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO_ROOT, "tools", relpath))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while decorating
    spec.loader.exec_module(module)
    return module
