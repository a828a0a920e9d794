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
"""Shared pieces of the develop-loader suites: ``_tree`` writes a small
develop-shaped Paddle tree with stand-in optimizer files, ``_LoaderCase``
leaves the process as it found it (loader cache, modules, paddle patch).
Out of tree only, like the loader."""

# paddle_muon_ext: compat-only

from __future__ import annotations

import os
import sys
import tempfile
import textwrap
import unittest

from paddle_muon_ext.compat_paddle_3_3 import develop_loader as dl
from paddle_muon_ext.compat_paddle_3_3 import is_patched, unpatch_paddle

_OPTIMIZER = textwrap.dedent("""
    import os
    import paddle
    from paddle.distributed.fleet.utils import tensor_fusion_helper
    EXECUTIONS = int(os.environ.get("_LOADER_TEST_EXECUTIONS", "0")) + 1
    os.environ["_LOADER_TEST_EXECUTIONS"] = str(EXECUTIONS)
    CPU_REGISTERED = "cpu" in tensor_fusion_helper.alignment
    class MuonShardingOptimizer:
        TREE = {tree!r}
""")


def _tree(parent: str, name: str, optimizer: str | None = None,
          muon: str | None = None) -> str:
    root = os.path.join(parent, name)
    path = os.path.join(root, *dl.OPTIMIZER_RELPATH.split("/"))
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write(_OPTIMIZER.format(tree=name) if optimizer is None else optimizer)
    if muon is not None:
        muon_path = os.path.join(root, *dl.MUON_RELPATH.split("/"))
        os.makedirs(os.path.dirname(muon_path), exist_ok=True)
        with open(muon_path, "w") as f:
            f.write(muon)
    return root


class _LoaderCase(unittest.TestCase):
    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory()
        self.tmp = self._tmp.name
        self._was_patched = is_patched()
        self._loaded = dict(dl._LOADED)
        self._modules = set(sys.modules)
        os.environ.pop("_LOADER_TEST_EXECUTIONS", None)

    def tearDown(self):
        # leave the process as it was: the loader patches paddle and caches modules
        dl._LOADED.clear()
        dl._LOADED.update(self._loaded)
        for name in set(sys.modules) - self._modules:
            if name.startswith(("_paddle_develop", "paddle.optimizer._develop")):
                del sys.modules[name]
        if not self._was_patched and is_patched():
            unpatch_paddle()
        os.environ.pop("_LOADER_TEST_EXECUTIONS", None)
        self._tmp.cleanup()
