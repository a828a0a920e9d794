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
"""The 3.3.1 loader of a Paddle checkout's optimizer, on develop-shaped temp trees.

CI has no Paddle checkout, so each test writes a small tree whose
``muon_sharding_optimizer.py`` / ``optimizer/muon.py`` are stand-ins with
observable behaviour (a counter of executions, a deliberate import error).
Out of tree only: the loader is 3.3.1 compat and is not exported.
"""

# paddle_muon_ext: compat-only

from __future__ import annotations

import os
import sys
import unittest

from muon_conformance_loader_helpers import _LoaderCase, _tree

from paddle_muon_ext.compat_paddle_3_3 import develop_loader as dl
from paddle_muon_ext.compat_paddle_3_3 import is_patched


class TestDevelopOptimizerPath(_LoaderCase):
    def test_the_file_under_a_checkout_is_found(self):
        root = _tree(self.tmp, "paddle")
        self.assertEqual(dl.develop_optimizer_path(root),
                         os.path.join(root, *dl.OPTIMIZER_RELPATH.split("/")))

    def test_a_missing_directory_is_named_with_the_fix(self):
        missing = os.path.join(self.tmp, "nope")
        with self.assertRaises(dl.DevelopTreeError) as ctx:
            dl.develop_optimizer_path(missing)
        self.assertIn(missing, str(ctx.exception))
        self.assertIn("not a directory", str(ctx.exception))
        self.assertIsInstance(ctx.exception, ValueError)

    def test_a_directory_without_the_optimizer_is_named_with_the_relative_path(self):
        with self.assertRaises(dl.DevelopTreeError) as ctx:
            dl.develop_optimizer_path(self.tmp)
        self.assertIn(dl.OPTIMIZER_RELPATH, str(ctx.exception))
        self.assertEqual(len(str(ctx.exception).splitlines()), 1)


class TestLoadDevelopOptimizer(_LoaderCase):
    def test_loads_once_per_file_with_develops_names_and_cpu_fusion(self):
        root = _tree(self.tmp, "paddle")
        first = dl.load_develop_optimizer(root)
        again = dl.load_develop_optimizer(os.path.join(root, "."))
        self.assertIs(first, again)
        self.assertEqual(first.EXECUTIONS, 1, "the checkout's file ran twice")
        self.assertEqual(first.MuonShardingOptimizer.TREE, "paddle")
        self.assertTrue(first.CPU_REGISTERED, "CPU tensor fusion was not registered first")
        self.assertTrue(is_patched(), "develop's sharding_configs fields need patch_paddle()")
        # private name: nothing lands under paddle.*
        self.assertFalse(first.__name__.startswith("paddle"))
        self.assertIs(sys.modules[first.__name__], first)

    def test_a_symlink_to_a_loaded_checkout_reuses_its_module(self):
        # one file, two spellings of its root: the file runs once
        root = _tree(self.tmp, "paddle")
        link = os.path.join(self.tmp, "paddle-link")
        os.symlink(root, link)
        first = dl.load_develop_optimizer(root)
        self.assertIs(dl.load_develop_optimizer(link), first)
        self.assertEqual(first.EXECUTIONS, 1, "the checkout's file ran twice")

    def test_two_checkouts_keep_their_own_modules(self):
        one = dl.load_develop_optimizer(_tree(self.tmp, "one"))
        two = dl.load_develop_optimizer(_tree(self.tmp, "two"))
        self.assertIsNot(one, two)
        self.assertNotEqual(one.__name__, two.__name__)
        self.assertEqual((one.MuonShardingOptimizer.TREE, two.MuonShardingOptimizer.TREE),
                         ("one", "two"))

    def test_an_import_error_propagates_and_leaves_no_half_module(self):
        root = _tree(self.tmp, "broken", optimizer="raise ImportError('needs develop paddle')\n")
        before = set(sys.modules)
        with self.assertRaisesRegex(ImportError, "needs develop paddle"):
            dl.load_develop_optimizer(root)
        self.assertEqual({n for n in set(sys.modules) - before if n.startswith("_paddle")}, set())
        self.assertEqual(dl._LOADED, self._loaded)


class TestLoadDevelopMuon(_LoaderCase):
    def test_absent_file_is_reported(self):
        got = dl.load_develop_muon(_tree(self.tmp, "paddle"))
        self.assertIsNone(got.module)
        self.assertIn(dl.MUON_RELPATH, got.reason)

    def test_a_file_that_runs_on_this_paddle_is_loaded_with_its_relative_imports(self):
        muon = "from .optimizer import Optimizer\nclass Muon(Optimizer):\n    pass\n"
        got = dl.load_develop_muon(_tree(self.tmp, "paddle", muon=muon))
        self.assertEqual(got.reason, "")
        import paddle

        self.assertTrue(issubclass(got.module.Muon, paddle.optimizer.Optimizer))
        self.assertFalse(hasattr(paddle.optimizer, got.module.__name__.rsplit(".", 1)[-1]),
                         "the package must not get an attribute")

    def test_a_file_needing_a_newer_paddle_is_reported_not_patched(self):
        muon = "from paddle.no_such_module_in_3_3 import x\n"
        got = dl.load_develop_muon(_tree(self.tmp, "paddle", muon=muon))
        self.assertIsNone(got.module)
        self.assertIn("does not import on paddle 3.3.1", got.reason)
        self.assertIn("ModuleNotFoundError", got.reason)

    def test_a_file_using_a_name_this_paddle_lacks_is_reported_not_raised(self):
        # a newer muon.py fails at import with whatever its first missing name
        # raises (here an AttributeError, not an ImportError)
        muon = "import paddle\nBASE = paddle.optimizer.NoSuchOptimizerIn33\n"
        got = dl.load_develop_muon(_tree(self.tmp, "paddle", muon=muon))
        self.assertIsNone(got.module)
        self.assertIn("does not import on paddle 3.3.1: AttributeError", got.reason)
        self.assertIn("NoSuchOptimizerIn33", got.reason)

    def test_a_bad_root_is_refused_like_the_optimizer(self):
        with self.assertRaises(dl.DevelopTreeError):
            dl.load_develop_muon(os.path.join(self.tmp, "nope"))


if __name__ == "__main__":
    unittest.main()
