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
# paddle_muon_ext: compat-only  (tests the paddle 3.3.1 compat layer's strategy setter; not exported)
"""Paddle's own ``sharding_configs`` fields refused naming the field and value.

``strategy.hybrid_configs = {"sharding_configs": {"comm_buffer_size_MB":
float("inf")}}`` is refused naming the field and the value (not protobuf's
bare ``TypeError: 'float' object cannot be interpreted as an integer``).
Values Paddle accepts stay accepted
(``comm_buffer_size_MB <= 0`` means no fused buffers, as in develop), and a
refused assignment leaves the strategy as it was.
"""

from __future__ import annotations

import unittest

from paddle.distributed import fleet

from paddle_muon_ext import patch_paddle, unpatch_paddle


class TestShardingConfigsValuesNamed(unittest.TestCase):
    def setUp(self) -> None:
        patch_paddle()
        self.addCleanup(unpatch_paddle)

    def test_values_that_do_not_fit_a_field_name_it(self):
        cases = [
            ("comm_buffer_size_MB", float("inf"), "=inf (float) does not fit the field (int)"),
            ("comm_buffer_size_MB", float("nan"), "=nan (float) does not fit the field (int)"),
            ("comm_buffer_size_MB", "256", "='256' (str) does not fit the field (int)"),
            ("comm_buffer_size_MB", 2 ** 70, "=1180591620717411303424 (int) does not fit"),
        ]
        for field, value, fragment in cases:
            with self.subTest(field=field, value=value):
                strategy = fleet.DistributedStrategy()
                before = str(strategy.hybrid_configs)
                with self.assertRaises(TypeError) as ctx:
                    strategy.hybrid_configs = {"sharding_configs": {field: value}}
                message = str(ctx.exception)
                self.assertIn(f"hybrid_configs['sharding_configs'][{field!r}]", message)
                self.assertIn(fragment, message)
                self.assertNotIn("\n", message)
                self.assertEqual(str(strategy.hybrid_configs), before,
                                 "a refused assignment must leave the strategy unchanged")

    def test_values_paddle_accepts_stay_accepted(self):
        strategy = fleet.DistributedStrategy()
        for value in (0, -5, 1024):
            strategy.hybrid_configs = {"sharding_configs": {"comm_buffer_size_MB": value}}
            self.assertEqual(strategy.hybrid_configs["sharding_configs"].comm_buffer_size_MB,
                             value)


if __name__ == "__main__":
    unittest.main()
