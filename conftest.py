# Copyright (c) 2026 paddle_muon_ext Authors. All Rights Reserved.
# Licensed under the Apache License, Version 2.0.
"""Make test/ importable so every suite can `import mock...` (the harness
under test/mock/), as Paddle's own test tree does with its helpers."""

import os
import sys

_TEST_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "test")
if _TEST_DIR not in sys.path:
    sys.path.insert(0, _TEST_DIR)


def pytest_addoption(parser):
    """``--paddle-root DIR``: the conformance suite tests that checkout's optimizer."""
    parser.addoption(
        "--paddle-root", default=None, metavar="DIR",
        help="root of a Paddle source checkout: test/collective/fleet/test_muon_conformance*.py "
             "then run its python/paddle/distributed/fleet/meta_optimizers/"
             "muon_sharding_optimizer.py instead of this package's (same as PADDLE_ROOT=DIR)")


def pytest_configure(config):
    # One place decides the implementation (muon_conformance_impl reads
    # PADDLE_ROOT at import); a bad directory stops the run before collection.
    root = config.getoption("--paddle-root")
    if root is None:
        return
    from paddle_muon_ext.compat_paddle_3_3.develop_loader import (
        DevelopTreeError,
        develop_optimizer_path,
    )

    import pytest

    try:
        develop_optimizer_path(root)
    except DevelopTreeError as error:
        raise pytest.UsageError(f"--paddle-root: {error}") from None
    os.environ["PADDLE_ROOT"] = os.path.abspath(root)
