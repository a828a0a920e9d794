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
"""The conformance loader takes a ``~/...`` checkout root as the shell would
(``--paddle-root ~/Paddle``), for the optimizer file and for ``muon.py``, and
says a checkout has no ``muon.py`` in those words (not as an import error)."""

from __future__ import annotations

import os
import unittest
from unittest import mock

from muon_conformance_loader_helpers import _LoaderCase, _tree

from paddle_muon_ext.compat_paddle_3_3 import develop_loader as dl


class TestHomeRelativeRoot(_LoaderCase):
    def test_a_tilde_root_is_the_checkout_under_home(self):
        root = _tree(self.tmp, "Paddle", muon="VALUE = 3\n")
        with mock.patch.dict(os.environ, {"HOME": self.tmp}):
            self.assertEqual(dl.develop_optimizer_path("~/Paddle"),
                             os.path.join(root, *dl.OPTIMIZER_RELPATH.split("/")))
            loaded = dl.load_develop_muon("~/Paddle")
        self.assertEqual(loaded.reason, "")
        self.assertEqual(loaded.module.VALUE, 3)


class TestAbsentMuonReason(_LoaderCase):
    def test_a_checkout_without_muon_py_says_so(self):
        got = dl.load_develop_muon(_tree(self.tmp, "paddle"))
        self.assertIsNone(got.module)
        self.assertEqual(got.reason, f"no {dl.MUON_RELPATH} in the checkout")


class TestOwnedMatrixNamesOnOlderDevelopFiles(unittest.TestCase):
    """The owner-gradient checks skip (not fail) on a develop file without ``_local_2d``."""

    def test_owned_names_come_from_local_2d(self):
        from muon_conformance_impl import owned_matrix_names

        class _Param:
            def __init__(self, name):
                self.name = name

        opt = mock.Mock(spec=["_local_2d"], _local_2d=[_Param("w_0"), _Param("w_2")])
        self.assertEqual(owned_matrix_names(opt), {"w_0", "w_2"})

    def test_an_optimizer_forwarding_unknown_names_to_its_inner_one_gives_none(self):
        from muon_conformance_impl import owned_matrix_names

        class _OlderDevelop:  # develop's __getattr__: unknown names go to the inner Muon
            def __getattr__(self, item):
                raise AttributeError(f"'Muon' object has no attribute {item!r}")

        self.assertIsNone(owned_matrix_names(_OlderDevelop()))


if __name__ == "__main__":
    unittest.main()
