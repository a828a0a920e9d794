# Copyright (c) 2026 paddle_muon_ext Authors. All Rights Reserved.
# Licensed under the Apache License, Version 2.0.
"""Make test/ importable so every suite can `import mock...` (the harness
under test/mock/), as Paddle's own test tree does with its helpers."""

import os
import sys

_TEST_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "test")
if _TEST_DIR not in sys.path:
    sys.path.insert(0, _TEST_DIR)
