# Copyright (c) 2026 paddle_muon_ext Authors. All Rights Reserved.
# Licensed under the Apache License, Version 2.0.
"""Packaging promises: no hard paddle dependency, a one-line error without paddle."""

from __future__ import annotations

import os
import subprocess
import sys

from tool_loader import REPO_ROOT


def test_import_without_paddle_names_what_to_install():
    # The package itself imports (so `paddle-muon-ext --help` works anywhere);
    # the first name that needs Paddle raises the one-line ImportError.
    code = ("import sys; sys.modules['paddle'] = None; import paddle_muon_ext; "
            "paddle_muon_ext.patch_paddle")
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO_ROOT, "python"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: paddle_muon_ext needs PaddlePaddle"), proc.stderr
    assert "paddlepaddle-gpu" in last and "[cpu]" in last, last


def test_cpu_wheel_is_an_extra_not_a_requirement():
    setup_py = open(os.path.join(REPO_ROOT, "setup.py")).read()
    requires = setup_py.split("install_requires=")[1].split("]")[0]
    assert "paddlepaddle" not in requires, "a GPU node must not get the CPU wheel pulled in"
    assert '"cpu": ["paddlepaddle' in setup_py


def test_every_top_level_name_resolves_to_its_module():
    # each name of paddle_muon_ext.__all__ loads lazily from the module _LAZY
    # names (a wrong module path would raise only when a user first asks)
    import importlib

    import paddle_muon_ext

    for name in paddle_muon_ext.__all__:
        module = importlib.import_module(paddle_muon_ext._LAZY[name], "paddle_muon_ext")
        assert getattr(paddle_muon_ext, name) is getattr(module, name), name
    assert "expert_sharded_state_dict" in paddle_muon_ext.__all__
