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
"""The gloo layer's environment rules, each over a table, through its public functions.

From the module's documentation: ``GLOO_COMPAT`` forces the layer on (1,
true, on, yes, any case, surrounding blanks ignored) or off (0, false, off,
no), refuses any other word, and unset leaves the choice to
``PADDLE_DISTRI_BACKEND`` (``gloo`` in any case = on, any other backend =
off; unset: :func:`gloo_expected` guesses from the build, a CPU wheel
being gloo, while :func:`gloo_backend_selected` says no).
``GLOO_COMPAT_LOCAL_SIZE`` and ``GLOO_COMPAT_STORE_TIMEOUT`` take integers
``>= 1`` (blanks ignored, anything else refused in one line); uninstalling
puts ``PADDLE_LOCAL_SIZE`` back as it was, however often the local size was
applied. A sub-group master publishes ``host:port`` of the store it binds
under the group's rendezvous key (unique per group id and name).
"""

from __future__ import annotations

import os
import re
import unittest

import paddle

from paddle_muon_ext.distributed.fleet.utils import gloo_compat as gc

from muon_test_compat import env_vars

ON = ("1", "true", "on", "yes", "ON", "True", " Yes ", "YES")
OFF = ("0", "false", "off", "no", "OFF", "False", " No ")
BAD = ("2", "maybe", "enable", "y", "n")




def _refusal(name: str, raw: str) -> str:
    """The one-line refusal names the variable and the value given."""
    return f"^{name}.*{re.escape(repr(raw))}[^\n]*$"


class TestBackendSwitchMatrix(unittest.TestCase):
    def test_gloo_expected_and_gloo_backend_selected(self) -> None:
        cpu_build = not paddle.is_compiled_with_cuda()
        backends = (None, "", "gloo", "GLOO", " gloo ", "nccl", "xccl", "bkcl", "mpi")
        for force in (None, "") + ON + OFF:
            for backend in backends:
                with self.subTest(force=force, backend=backend), \
                        env_vars(GLOO_COMPAT=force, PADDLE_DISTRI_BACKEND=backend):
                    if force and force.strip().lower() in ("1", "true", "on", "yes"):
                        expected = selected = True
                    elif force and force.strip():
                        expected = selected = False
                    elif backend and backend.strip():
                        expected = selected = backend.strip().lower() == "gloo"
                    else:
                        expected, selected = cpu_build, False
                    if not cpu_build and expected is cpu_build and not (backend or force):
                        continue  # a CUDA build guesses from its devices
                    self.assertIs(gc.gloo_expected(), expected)
                    self.assertIs(gc.gloo_backend_selected(), selected)

    def test_other_words_are_refused_naming_the_variable(self) -> None:
        for word in BAD:
            for backend in (None, "gloo", "nccl"):
                with self.subTest(word=word, backend=backend), \
                        env_vars(GLOO_COMPAT=word, PADDLE_DISTRI_BACKEND=backend):
                    for check in (gc.gloo_expected, gc.gloo_backend_selected):
                        with self.assertRaisesRegex(ValueError, f"GLOO_COMPAT={word!r}"):
                            check()

    def test_install_follows_the_switch(self) -> None:
        for force, backend, active in (("0", "gloo", False), ("1", "nccl", True),
                                       (None, "nccl", False), (None, "Gloo", True)):
            with self.subTest(force=force, backend=backend), \
                    env_vars(GLOO_COMPAT=force, PADDLE_DISTRI_BACKEND=backend,
                         GLOO_COMPAT_LOCAL_SIZE=None):
                gc.uninstall_gloo_compat()
                try:
                    self.assertIs(gc.install_gloo_compat(), active)
                    self.assertIs(gc.is_installed(), active)
                finally:
                    gc.uninstall_gloo_compat()
                self.assertFalse(gc.is_installed())


class TestIntegerVariables(unittest.TestCase):
    TABLE = (("1", 1), ("2", 2), (" 3 ", 3), ("16", 16), ("0", None), ("-1", None),
             ("x", None), ("2.5", None), ("1e2", None))

    def test_emulated_local_size(self) -> None:
        for raw, value in self.TABLE + (("", "unset"),):
            with self.subTest(raw=raw), \
                    env_vars(GLOO_COMPAT_LOCAL_SIZE=raw, PADDLE_LOCAL_SIZE="8"):
                try:
                    if value is None:
                        with self.assertRaisesRegex(ValueError, _refusal("GLOO_COMPAT_LOCAL_SIZE",
                                                                         raw)):
                            gc.apply_emulated_local_size()
                        self.assertEqual(os.environ["PADDLE_LOCAL_SIZE"], "8")
                    elif value == "unset":
                        self.assertIsNone(gc.apply_emulated_local_size())
                        self.assertEqual(os.environ["PADDLE_LOCAL_SIZE"], "8")
                    else:
                        self.assertEqual(gc.apply_emulated_local_size(), value)
                        self.assertEqual(os.environ["PADDLE_LOCAL_SIZE"], str(value))
                finally:
                    gc.uninstall_gloo_compat()
                self.assertEqual(os.environ["PADDLE_LOCAL_SIZE"], "8", "restored on uninstall")

    def test_uninstall_restores_the_first_value_after_repeated_applies(self) -> None:
        for before in ("8", None):
            with self.subTest(before=before), env_vars(PADDLE_LOCAL_SIZE=before,
                                                   GLOO_COMPAT_LOCAL_SIZE="2"):
                gc.apply_emulated_local_size()
                os.environ["GLOO_COMPAT_LOCAL_SIZE"] = "4"
                gc.apply_emulated_local_size()
                self.assertEqual(os.environ["PADDLE_LOCAL_SIZE"], "4")
                gc.uninstall_gloo_compat()
                self.assertEqual(os.environ.get("PADDLE_LOCAL_SIZE"), before)

    def test_store_timeout(self) -> None:
        class Default:
            def set(self, key, value):
                self.published = (key, value)

        for raw, value in self.TABLE + (("", 300),):
            with self.subTest(raw=raw), env_vars(GLOO_COMPAT_STORE_TIMEOUT=raw,
                                             PADDLE_CURRENT_ENDPOINT=None):
                default = Default()
                if value is None:
                    with self.assertRaisesRegex(ValueError, _refusal("GLOO_COMPAT_STORE_TIMEOUT",
                                                                     raw)):
                        gc.create_subgroup_store(default, 0, 1, 91, "t")
                    self.assertFalse(hasattr(default, "published"), "refused before publishing")
                    continue
                # a one-member group: the master's store does not wait for anyone
                store = gc.create_subgroup_store(default, 0, 1, 91, "t")
                key, endpoint = default.published
                self.assertEqual(key, gc.rendezvous_key(91, "t"))
                host, port = endpoint.rsplit(":", 1)
                self.assertEqual(host, "127.0.0.1")
                store.set("k", "v")
                self.assertEqual(bytes(store.get("k")), b"v")


class TestRendezvousKeys(unittest.TestCase):
    def test_unique_per_group_id_and_name(self) -> None:
        keys = {gc.rendezvous_key(gid, name) for gid in (1, 2, 12) for name in ("a", "b", "a1")}
        self.assertEqual(len(keys), 9)
        self.assertEqual(gc.rendezvous_key(3, "x"), gc.rendezvous_key("3", "x"))


if __name__ == "__main__":
    unittest.main()
