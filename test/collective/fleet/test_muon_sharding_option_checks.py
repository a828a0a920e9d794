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
# paddle_muon_ext: compat-only  (reads settings from a duck-typed strategy; not exported)
"""The sharding settings MuonShardingOptimizer reads are refused, in one line
naming the option, the value and what is valid, when their type is wrong or a
size is not finite -- after the existing checks, whose errors are unchanged,
and without refusing what develop gives a meaning (``comm_buffer_size_MB <=
0``: no fused buffers)."""

from __future__ import annotations

import os
import types
import unittest
from unittest import mock

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding import settings as mss
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.settings import (
    ShardingAssertionError,
    ShardingSettings,
)
from paddle_muon_ext.distributed.fleet.utils import gloo_compat as gc
from paddle_muon_ext.distributed.fleet.utils import gloo_compat_groups as groups


def _strategy(sharding=None, pp=None, **hybrid):
    """A duck-typed strategy: what from_strategy reads, nothing else."""
    configs = {"sharding_configs": types.SimpleNamespace(**(sharding or {})),
               "pp_configs": types.SimpleNamespace(**(pp or {})),
               "enable_optimizer_timer": False, "pp_degree": 1}
    configs.update(hybrid)
    return types.SimpleNamespace(hybrid_configs=configs)


class TestShardingSettingValues(unittest.TestCase):
    def test_bad_values_are_refused_naming_the_option(self):
        nan, inf = float("nan"), float("inf")
        cases = [
            (dict(comm_buffer_size_MB=nan), ValueError,
             "sharding_configs.comm_buffer_size_MB=nan is not finite"),
            (dict(comm_buffer_size_MB=inf), ValueError,
             "sharding_configs.comm_buffer_size_MB=inf is not finite"),
            (dict(comm_buffer_size_MB="256"), TypeError,
             "sharding_configs.comm_buffer_size_MB='256' (str) must be a number"),
            (dict(comm_buffer_size_MB=True), TypeError, "comm_buffer_size_MB=True (bool)"),
            (dict(accumulate_steps=True), TypeError,
             "sharding_configs.accumulate_steps=True (bool) must be an int"),
            (dict(accumulate_steps=2.0), TypeError, "accumulate_steps=2.0 (float)"),
            (dict(comm_overlap=1), TypeError,
             "sharding_configs.comm_overlap=1 (int) must be True or False"),
            (dict(tensor_fusion="yes"), TypeError, "sharding_configs.tensor_fusion='yes'"),
            (dict(pp_release_gradients=None), TypeError,
             "pp_configs.release_gradients=None (NoneType) must be True or False"),
            (dict(pp_degree="2"), TypeError, "hybrid_configs.pp_degree='2' (str) must be an int"),
            (dict(enable_optimizer_timer=0), TypeError,
             "hybrid_configs.enable_optimizer_timer=0 (int) must be True or False"),
            (dict(pp_sharding_comm_overlap=0), TypeError,
             "pp_configs.sharding_comm_overlap=0 (int) must be True or False"),
            # the overlap hooks count micro-batches: at least one per step
            (dict(comm_overlap=True, accumulate_steps=0), ShardingAssertionError,
             "sharding_configs.comm_overlap=True needs accumulate_steps >= 1 (got 0)"),
            (dict(comm_overlap=True, accumulate_steps=-1), ShardingAssertionError,
             "needs accumulate_steps >= 1 (got -1)"),
        ]
        for kwargs, exc, fragment in cases:
            with self.subTest(kwargs=kwargs):
                with self.assertRaises(exc) as ctx:
                    ShardingSettings(**kwargs).check(pp_world_size=1)
                self.assertIn(fragment, str(ctx.exception))
                self.assertNotIn("\n", str(ctx.exception))

    def test_values_with_a_meaning_are_accepted(self):
        for kwargs in (dict(), dict(comm_buffer_size_MB=0), dict(comm_buffer_size_MB=-1),
                       dict(comm_buffer_size_MB=0.5), dict(accumulate_steps=0),
                       dict(accumulate_steps=4, comm_overlap=True),
                       dict(accumulate_steps=1, comm_overlap=True)):
            with self.subTest(kwargs=kwargs):
                ShardingSettings(**kwargs).check(pp_world_size=1)  # no error
                self.assertEqual(ShardingSettings(**kwargs).fused,
                                 ShardingSettings(**kwargs).comm_buffer_size_MB > 0)

    def test_the_existing_checks_come_first(self):
        with self.assertRaisesRegex(ShardingAssertionError, "sharding_comm_overlap=True"):
            ShardingSettings(pp_sharding_comm_overlap=True, accumulate_steps="x").check(1)
        with self.assertRaisesRegex(ValueError, "is not supported; use one of"):
            ShardingSettings(muon_partition_strategy="fast", comm_overlap=1).check(1)

    def test_values_read_from_a_strategy_are_checked(self):
        strategy = _strategy(sharding={"comm_buffer_size_MB": float("nan"),
                                       "accumulate_steps": 1})
        settings = ShardingSettings.from_strategy(strategy)
        with self.assertRaisesRegex(ValueError, "comm_buffer_size_MB=nan is not finite"):
            settings.check(pp_world_size=1)
        strategy = _strategy(pp={"release_gradients": "no"})
        with self.assertRaisesRegex(TypeError, "pp_configs.release_gradients='no'"):
            ShardingSettings.from_strategy(strategy).check(pp_world_size=1)



class TestEnvironmentVariables(unittest.TestCase):
    """Each variable the package reads is refused in one line when malformed."""

    def test_bad_values_are_refused_naming_variable_value_and_range(self):
        cases = [
            (gc.FORCE_ENV, "maybe", gc.gloo_backend_selected,
             "GLOO_COMPAT='maybe': must be one of"),
            (gc.FORCE_ENV, "2", gc.gloo_expected, "GLOO_COMPAT='2'"),
            (gc.STORE_TIMEOUT_ENV, "abc", groups._store_timeout,
             "GLOO_COMPAT_STORE_TIMEOUT='abc': must be a positive integer"),
            (gc.STORE_TIMEOUT_ENV, "0", groups._store_timeout,
             "GLOO_COMPAT_STORE_TIMEOUT='0': must be a positive integer"),
            (gc.STORE_TIMEOUT_ENV, "1.5", groups._store_timeout, "GLOO_COMPAT_STORE_TIMEOUT='1.5': must be a positive integer"),
            (gc.EMULATED_LOCAL_SIZE_ENV, "two", gc.apply_emulated_local_size,
             "GLOO_COMPAT_LOCAL_SIZE='two': must be a positive integer"),
            (mss.OVERLAP_SYNC_ENV, "yes", mss.read_overlap_optimize_and_sync,
             "FLAGS_muon_sharding_overlap_optimize_and_sync='yes' is not an integer"),
        ]
        for name, value, read, fragment in cases:
            with self.subTest(name=name, value=value), mock.patch.dict(os.environ, {name: value}):
                with self.assertRaises(ValueError) as ctx:
                    read()
                self.assertIn(fragment, str(ctx.exception))
                self.assertNotIn("\n", str(ctx.exception))

    def test_good_values_keep_their_meaning(self):
        for value, expected in (("1", True), ("yes", True), ("ON", True), ("0", False),
                                ("off", False)):
            with mock.patch.dict(os.environ, {gc.FORCE_ENV: value,
                                              "PADDLE_DISTRI_BACKEND": "nccl"}):
                self.assertIs(gc.gloo_backend_selected(), expected, value)
                self.assertIs(gc.gloo_expected(), expected, value)
        with mock.patch.dict(os.environ, {gc.FORCE_ENV: " ", "PADDLE_DISTRI_BACKEND": "gloo"}):
            self.assertTrue(gc.gloo_backend_selected(), "blank: the launcher's backend decides")
        with mock.patch.dict(os.environ, {gc.STORE_TIMEOUT_ENV: "45"}):
            self.assertEqual(groups._store_timeout(), 45)
        with mock.patch.dict(os.environ, {gc.STORE_TIMEOUT_ENV: ""}):
            self.assertEqual(groups._store_timeout(), 300)


if __name__ == "__main__":
    unittest.main()
