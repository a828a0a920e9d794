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
# paddle_muon_ext: compat-only  (tests the paddle 3.3.1 compat layer; not exported)
"""The 3.3.1 compat layer's degree rules over a matrix of degrees and job sizes.

Expected outcomes are derived here from the rules as documented in
``compat_paddle_3_3/patch.py`` and Paddle's ``fleet.init``: the dense layout
covers ``dp x mp x pp x sharding x sep`` ranks (a degree below 1 counts as
1); with ``ep_degree > 1`` the expert layout ``pp x moe_sharding x ep`` must
cover the same ranks; a launched job (``PADDLE_TRAINERS_NUM``, a positive
integer) must have exactly the dense layout's ranks unless ``dp_degree`` is
left to Paddle to infer (``<= 0``) -- too many, too few and equal each
appear for every degree. Value checks: every ``*_degree`` of Paddle's
HybridConfig must be an int (not a bool); ``sharding_degree >= 1``; ``mp``,
``pp``, ``sep``, ``cp >= 0``; the rest are Paddle's. Each case runs through
the public ``strategy.hybrid_configs`` setter after ``patch_paddle()``, and
the view of ``sharding_configs`` reads and writes develop's extra fields.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import unittest
from types import SimpleNamespace
from unittest import mock

from paddle.distributed import fleet
from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer import (
    hybrid_parallel_optimizer as hpo,
)

from paddle_muon_ext.compat_paddle_3_3 import (
    get_muon_sharding_options,
    patch_paddle,
    unpatch_paddle,
)
from paddle_muon_ext.compat_paddle_3_3 import fleet_integration as fi
from paddle_muon_ext.compat_paddle_3_3 import patch as patch_module

DENSE = ("dp_degree", "mp_degree", "pp_degree", "sharding_degree", "sep_degree")
EXPERT = ("pp_degree", "moe_sharding_degree", "ep_degree")
# Paddle 3.3.1's HybridConfig degrees and the least value each may take here
# (None: any int is left to Paddle).
LEAST = {"dp_degree": None, "mp_degree": 0, "pp_degree": 0, "sharding_degree": 1,
         "sep_degree": 0, "ep_degree": None, "moe_sharding_degree": None, "cp_degree": 0,
         "cp_sharding_degree": None}


@contextlib.contextmanager
def _trainers(value):
    saved = os.environ.get("PADDLE_TRAINERS_NUM")
    if value is None:
        os.environ.pop("PADDLE_TRAINERS_NUM", None)
    else:
        os.environ["PADDLE_TRAINERS_NUM"] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PADDLE_TRAINERS_NUM", None)
        else:
            os.environ["PADDLE_TRAINERS_NUM"] = saved


def _expected_error(configs: dict, world) -> str | None:
    """'expert', 'world' or None, from the documented rules."""
    def ranks(names):
        return math.prod(max(configs[n], 1) for n in names)

    dense = ranks(DENSE)
    if configs["ep_degree"] > 1 and ranks(EXPERT) != dense:
        return "expert"
    if world is not None and configs["dp_degree"] > 0 and dense != world:
        return "world"
    return None


def _full(**degrees) -> dict:
    configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 1,
               "sep_degree": 1, "ep_degree": 1, "moe_sharding_degree": 1}
    configs.update(degrees)
    return configs


class TestDegreeTilingMatrix(unittest.TestCase):
    def tearDown(self) -> None:
        unpatch_paddle()

    def _cases(self):
        grid = itertools.product((-1, 0, 1, 2), (0, 1, 2), (0, 1, 2), (1, 2, 4), (0, 1, 2),
                                 (0, 1, 2, 4), (0, 1, 2))
        for dp, mp, pp, sharding, sep, ep, moe in grid:
            yield _full(dp_degree=dp, mp_degree=mp, pp_degree=pp, sharding_degree=sharding,
                        sep_degree=sep, ep_degree=ep, moe_sharding_degree=moe)

    def test_check_hybrid_degrees_over_the_grid_and_job_sizes(self) -> None:
        seen = {"expert": 0, "world": 0, None: 0}
        for configs in self._cases():
            for world in (None, 1, 2, 4, 8):
                want = _expected_error(configs, world)
                seen[want] += 1
                if want is None:
                    patch_module.check_hybrid_degrees(configs, world)
                    continue
                with self.assertRaises(AssertionError, msg=f"{configs} world {world}") as ctx:
                    patch_module.check_hybrid_degrees(configs, world)
                text = str(ctx.exception)
                dense = math.prod(max(configs[n], 1) for n in DENSE)
                formula = " x ".join(f"{n}({max(configs[n], 1)})" for n in DENSE)
                self.assertIn(f"{formula} = {dense} ranks", text)
                if want == "expert":
                    moe = " x ".join(f"{n}({max(configs[n], 1)})" for n in EXPERT)
                    self.assertIn(f"the expert layout {moe} = "
                                  f"{math.prod(max(configs[n], 1) for n in EXPERT)} ranks", text)
                else:
                    self.assertIn(f"the job has {world} (PADDLE_TRAINERS_NUM)", text)
        self.assertTrue(all(seen.values()), seen)

    def test_the_setter_checks_what_it_is_given_against_the_launched_world(self) -> None:
        patch_paddle()
        picked = [c for i, c in enumerate(self._cases()) if i % 23 == 0]
        for configs in picked:
            for world in (None, "2", "4"):
                with self.subTest(configs=configs, world=world), _trainers(world):
                    strategy = fleet.DistributedStrategy()
                    want = _expected_error(configs, None if world is None else int(world))
                    if want is None:
                        strategy.hybrid_configs = configs
                        for key, value in configs.items():
                            self.assertEqual(strategy.hybrid_configs[key], value, key)
                    else:
                        with self.assertRaisesRegex(AssertionError,
                                                    "expert layout" if want == "expert"
                                                    else "but the job has"):
                            strategy.hybrid_configs = configs

    def test_an_assignment_naming_any_one_degree_is_checked(self) -> None:
        # A strategy whose stored degrees do not tile 4 launched ranks (sharding 2,
        # dp 1): assigning any single degree re-checks the whole layout.
        patch_paddle()
        for key in DENSE + EXPERT:
            with self.subTest(key=key), _trainers(None):
                strategy = fleet.DistributedStrategy()
                strategy.hybrid_configs = {"dp_degree": 1, "sharding_degree": 2}
            with self.subTest(key=key), _trainers("4"):
                value = strategy.hybrid_configs[key]
                with self.assertRaisesRegex(AssertionError, "but the job has 4"):
                    strategy.hybrid_configs = {key: value}

    def test_what_counts_as_a_launched_world(self) -> None:
        patch_paddle()
        configs = {"dp_degree": 1, "sharding_degree": 2}
        for raw, refused in (("4", True), (" 4 ", True), ("2", False), ("0", False),
                             ("-4", False), ("four", False), ("", False)):
            with self.subTest(raw=raw), _trainers(raw):
                strategy = fleet.DistributedStrategy()
                if refused:
                    with self.assertRaisesRegex(AssertionError, "but the job has 4"):
                        strategy.hybrid_configs = configs
                else:
                    strategy.hybrid_configs = configs
                    self.assertEqual(strategy.hybrid_configs["sharding_degree"], 2)


class TestDegreeValueMatrix(unittest.TestCase):
    def tearDown(self) -> None:
        unpatch_paddle()

    def test_every_degree_against_every_kind_of_value(self) -> None:
        patch_paddle()
        for key, least in LEAST.items():
            for value in (True, False, 2.0, "2", None, -2, -1, 0, 1, 2):
                with self.subTest(key=key, value=value), _trainers(None):
                    if isinstance(value, bool) or not isinstance(value, int):
                        want = TypeError
                        fragment = f"hybrid_configs[{key!r}]={value!r} ({type(value).__name__})"
                    elif least is not None and value < least:
                        want = (AssertionError, ValueError)
                        fragment = f"hybrid_configs[{key!r}]={value} is out of range"
                    else:
                        want = None
                    if want is None:
                        patch_module.check_degree_values({key: value})
                        continue
                    for check in (lambda: patch_module.check_degree_values({key: value}),
                                  lambda: setattr(fleet.DistributedStrategy(), "hybrid_configs",
                                                  {key: value})):
                        with self.assertRaises(want) as ctx:
                            check()
                        self.assertIn(fragment, str(ctx.exception))
                        if want != TypeError:
                            # Paddle's AssertionError and a ValueError at once
                            self.assertIsInstance(ctx.exception, AssertionError)
                            self.assertIsInstance(ctx.exception, ValueError)

    def test_keys_that_are_not_paddles_degrees_are_left_to_paddle(self) -> None:
        for configs in ({"bogus_degree": "x"}, {"order": ["dp", "pp"]},
                        {"sharding_configs": {"comm_overlap": True}}):
            patch_module.check_degree_values(configs)


class TestShardingConfigsView(unittest.TestCase):
    def tearDown(self) -> None:
        unpatch_paddle()

    def test_extra_fields_read_and_write_the_muon_options_and_proto_fields_the_proto(self):
        patch_paddle()
        strategy = fleet.DistributedStrategy()
        view = strategy.hybrid_configs["sharding_configs"]
        self.assertFalse(view.comm_group_call_opt)
        self.assertEqual(view.muon_partition_strategy, "upstream_greedy")
        view.comm_group_call_opt = True
        view.muon_partition_strategy = "balanced"
        view.comm_buffer_size_MB = 32
        options = get_muon_sharding_options(strategy)
        self.assertTrue(options.comm_group_call_opt)
        self.assertEqual(options.muon_partition_strategy, "balanced")
        self.assertEqual(strategy.strategy.hybrid_configs.sharding_configs.comm_buffer_size_MB, 32)
        again = strategy.hybrid_configs["sharding_configs"]
        self.assertTrue(again.comm_group_call_opt)
        self.assertEqual(again.comm_buffer_size_MB, 32)
        for name in patch_module.EXTRA_SHARDING_FIELDS + ("comm_buffer_size_MB",):
            self.assertIn(name, dir(again))
        self.assertIn("'muon_partition_strategy': 'balanced'", repr(again))
        # the use_muon_sharding switch is the same storage
        strategy.use_muon_sharding = True
        self.assertTrue(get_muon_sharding_options(strategy).use_muon_sharding)
        with self.assertRaises(ValueError):
            view.muon_partition_strategy = "fastest"
        with self.assertRaises(AttributeError):
            view.no_such_field = 1


class TestMuonShardingOnlyWhereShardingIsSplit(unittest.TestCase):
    def test_the_sharding_optimizer_is_built_for_a_sharding_degree_above_one(self) -> None:
        # Paddle's parent constructor is replaced by a recorder: what it is
        # handed, and what Paddle's sharding class names give during the call.
        seen = {}

        def parent_init(self, optimizer, hcg, strategy):
            seen["optimizer"] = optimizer
            seen["class_passes_through"] = hpo.DygraphShardingOptimizer(optimizer, hcg) is optimizer
            seen["v2_passes_through"] = hpo.DygraphShardingOptimizerV2(optimizer, hcg) is optimizer

        muon = object()
        originals = (hpo.DygraphShardingOptimizer, hpo.DygraphShardingOptimizerV2)
        for degree, sharded in ((1, False), (2, True), (4, True)):
            seen.clear()
            hcg = SimpleNamespace(get_sharding_parallel_world_size=lambda d=degree: d)
            with self.subTest(degree=degree), \
                    mock.patch.object(hpo.HybridParallelOptimizer, "__init__", parent_init), \
                    mock.patch.object(fi, "MuonShardingOptimizer",
                                      lambda opt, hcg, strategy: ("sharded", opt)):
                fi.MuonHybridParallelOptimizer(muon, hcg, "strategy")
                want = ("sharded", muon) if sharded else muon
                self.assertEqual(seen["optimizer"], want)
                self.assertTrue(seen["class_passes_through"] and seen["v2_passes_through"])
            self.assertEqual((hpo.DygraphShardingOptimizer, hpo.DygraphShardingOptimizerV2),
                             originals, "the sharding classes were not restored")


if __name__ == "__main__":
    unittest.main()
