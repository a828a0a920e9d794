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
"""The tools' layout flags and ``cluster``'s flags, each rule over a table.

Expected outcomes follow the rules the tools document (``--help`` and
docs/TOOLS.md): ``--order`` names each of moe_sharding (ms), pp (pipe), ep
(expert) exactly once, in any case; ``--ep`` / ``--moe-sharding`` / ``--pp``
are integers from 1 to the tool's world limit and so is their product;
``--gpus-per-node`` from 1 to its limit; ``--nodes``, when given, is
``>= 1`` and times ``--gpus-per-node`` is the world size. ``cluster``'s
integer flags are ``1 .. limit`` (bools refused), ``--link-mbit`` and
``--timeout`` finite, positive and at most their limit, ``--ep x
--moe-sharding`` the ranks ``--nodes x --procs-per-node`` start (training
needs ``--ep`` 2 or more, the link probe does not), ``--group-call`` 0, 1 or both (the passes run: flat, option, both); its
per-pass figures average the steps after the first when there are more.
"""

from __future__ import annotations

import argparse
import itertools
import math
import unittest

from paddle_muon_ext.tools import cluster, cluster_netns, cluster_run
from paddle_muon_ext.tools.args import DEFAULT_ORDER, MuonCommConfig, build_config, parse_order
from paddle_muon_ext.tools.limits import LIMITS


class TestOrder(unittest.TestCase):
    def test_every_spelling_of_every_permutation(self) -> None:
        spellings = {"moe_sharding": ("moe_sharding", "ms", "MS", " Moe_Sharding "),
                     "pipe": ("pp", "pipe", "PP", "Pipe"),
                     "expert": ("ep", "expert", "EP", " expert")}
        for perm in itertools.permutations(DEFAULT_ORDER):
            for choice in range(4):
                text = ",".join(spellings[axis][choice] for axis in perm)
                self.assertEqual(parse_order(text), perm, text)
                self.assertEqual(parse_order(text + ","), perm, text + ",")

    def test_refusals(self) -> None:
        table = [
            ("ms,pp", "exactly once"),
            ("ms,ms,pp,ep", "exactly once"),
            ("ms,pp,pp", "exactly once"),
            ("ms,pipe,pp", "exactly once"),
            ("", "exactly once"),
            ("ms,pp,ep,ep", "exactly once"),
            ("ms,pp,dp", "unknown axis 'dp'"),
            ("ms;pp;ep", "unknown axis 'ms;pp;ep'"),
        ]
        for text, fragment in table:
            with self.assertRaisesRegex(ValueError, fragment, msg=text):
                parse_order(text)


def _args(ep=2, ms=2, pp=1, gpn=2, nodes=None, order="moe_sharding,pp,ep", model="m"):
    return argparse.Namespace(ep=ep, moe_sharding=ms, pp=pp, gpus_per_node=gpn, nodes=nodes,
                              order=order, model=model)


class TestLayoutFlags(unittest.TestCase):
    def test_degrees_nodes_and_limits(self) -> None:
        top = 64
        table = [
            # (flags, refused fragment or None)
            (dict(), None),
            (dict(ep=1, ms=1, pp=1, gpn=1), None),
            (dict(ep=top, ms=1, pp=1), None),                     # the largest world
            (dict(ep=8, ms=4, pp=2, gpn=8), None),
            (dict(ep=top + 1, ms=1), f"--ep {top + 1}: above the limit {top}"),
            (dict(ep=0), "--ep 0: must be >= 1"),
            (dict(ms=0), "--moe-sharding 0: must be >= 1"),
            (dict(pp=0), "--pp 0: must be >= 1"),
            (dict(pp=-1), "--pp -1: must be >= 1"),
            (dict(ep=True), "--ep True: must be an integer"),
            (dict(ms=2.0), "--moe-sharding 2.0: must be an integer"),
            (dict(ep=8, ms=8, pp=2), f"world size 2 x 8 x 8 = 128: above the {top} ranks"),
            (dict(ep=8, ms=4, pp=2), None),                       # exactly 64
            (dict(gpn=0), "--gpus-per-node 0: must be >= 1"),
            (dict(gpn=LIMITS.gpus_per_node), None),
            (dict(gpn=LIMITS.gpus_per_node + 1), "--gpus-per-node"),
            (dict(nodes=2, gpn=2), None),                         # 2 x 2 = 4 ranks
            (dict(nodes=1, gpn=4), None),
            (dict(nodes=1, gpn=2), "--nodes 1 x --gpus-per-node 2 = 2 ranks, but"),  # too few
            (dict(nodes=4, gpn=2), "--nodes 4 x --gpus-per-node 2 = 8 ranks, but"),  # too many
            (dict(nodes=0, gpn=2), "--nodes must be >= 1, got 0"),
            (dict(nodes=-2, gpn=2), "--nodes must be >= 1, got -2"),
            (dict(order="ms,ms,ep"), "exactly once"),
        ]
        for flags, refused in table:
            args = _args(**flags)
            if refused is None:
                cfg = build_config(args, max_world=top)
                self.assertEqual(cfg.world_size, args.pp * args.moe_sharding * args.ep, flags)
                self.assertEqual(cfg.num_nodes, cfg.world_size // args.gpus_per_node, flags)
                self.assertEqual(cfg.degrees(), {"pipe": args.pp, "moe_sharding": args.moe_sharding,
                                                 "expert": args.ep})
                continue
            with self.assertRaises(ValueError, msg=str(flags)) as ctx:
                build_config(args, max_world=top)
            self.assertIn(refused, str(ctx.exception), flags)

    def test_the_config_keeps_the_order_as_parsed(self) -> None:
        cfg = build_config(_args(order="EP,pipe,ms"), max_world=64)
        self.assertEqual(cfg.order, ("expert", "pipe", "moe_sharding"))
        self.assertEqual(MuonCommConfig(ep=4, moe_sharding=2, pp=3, gpus_per_node=4).world_size, 24)


def _cluster(**overrides):
    values = dict(nodes=2, procs_per_node=2, ep=2, moe_sharding=2)
    values.update(overrides)
    return cluster.ClusterConfig(**values)


class TestClusterFlags(unittest.TestCase):
    INT_FLAGS = (("nodes", "--nodes", cluster_netns.MAX_NODES),
                 ("procs_per_node", "--procs-per-node", cluster_run.MAX_PROCS),
                 ("steps", "--steps", cluster_run.MAX_STEPS),
                 ("hidden", "--hidden", cluster_run.MAX_DIM),
                 ("inner", "--inner", cluster_run.MAX_DIM))

    def test_integer_flags(self) -> None:
        for field, flag, high in self.INT_FLAGS:
            for value in (True, 2.0, "2", None, 0, -1, 1, high, high + 1):
                overrides = {field: value}
                if field in ("nodes", "procs_per_node") and isinstance(value, int) \
                        and not isinstance(value, bool) and 1 <= value <= high:
                    overrides.update(ep=2, moe_sharding=value)        # keep the world consistent
                cfg = _cluster(**overrides)
                label = f"{flag} {value!r}"
                if isinstance(value, bool) or not isinstance(value, int):
                    fragment = f"{flag} must be an integer, got {value!r}"
                elif value < 1:
                    fragment = f"{flag} must be >= 1, got {value}"
                elif value > high:
                    fragment = f"{flag} {value}: above the limit {high}"
                else:
                    cfg.validate_values()
                    continue
                with self.assertRaises(ValueError, msg=label) as ctx:
                    cfg.validate_values()
                self.assertIn(fragment, str(ctx.exception), label)

    def test_float_flags(self) -> None:
        for field, flag, high in (("link_mbit", "--link-mbit", 1e5),
                                  ("timeout_s", "--timeout", 86400.0)):
            for value in (0, 0.0, -1.0, math.nan, math.inf, -math.inf, "1", None, 1e-9, 1,
                          high, high * 1.5):
                cfg = _cluster(**{field: value})
                label = f"{flag} {value!r}"
                ok_number = isinstance(value, (int, float)) and math.isfinite(value) and value > 0
                if not ok_number:
                    fragment = f"{flag} must be a finite number > 0"
                elif value > high:
                    fragment = f"{flag} {value:g}: above the limit {high:g}"
                else:
                    cfg.validate_values()
                    continue
                with self.assertRaises(ValueError, msg=label) as ctx:
                    cfg.validate_values()
                self.assertIn(fragment, str(ctx.exception), label)

    def test_ranks_must_match_the_processes(self) -> None:
        for nodes, procs, ep, ms in itertools.product((1, 2, 3), (1, 2, 4), (2, 3, 4), (1, 2, 3)):
            cfg = _cluster(nodes=nodes, procs_per_node=procs, ep=ep, moe_sharding=ms)
            if ep * ms == nodes * procs:
                cfg.validate_values()
                continue
            with self.assertRaisesRegex(ValueError, f"--ep {ep} x --moe-sharding {ms} = {ep * ms} "
                                        f"ranks, but --nodes {nodes} x --procs-per-node {procs} "
                                        f"= {nodes * procs}"):
                cfg.validate_values()

    def test_training_needs_an_expert_group_and_the_link_probe_does_not(self) -> None:
        for nodes, procs in ((1, 2), (2, 2), (4, 1)):
            world = nodes * procs
            train = _cluster(nodes=nodes, procs_per_node=procs, ep=1, moe_sharding=world,
                             group_call="0")
            with self.assertRaisesRegex(ValueError, "^--ep 1: .*--ep 2 or more"):
                train.validate_values()
            _cluster(nodes=nodes, procs_per_node=procs, ep=1, moe_sharding=world,
                     group_call="0", mode="probe").validate_values()

    def test_group_call_values_and_passes(self) -> None:
        for value, passes in (("0", [0]), ("1", [1]), ("both", [0, 1])):
            cfg = _cluster(group_call=value)
            cfg.validate_values()
            self.assertEqual(cfg.passes(), passes, value)
        for value in ("2", "", "Both", None, 1):
            with self.assertRaisesRegex(ValueError, "--group-call must be 0, 1 or both"):
                _cluster(group_call=value).validate_values()

    def test_the_option_pass_is_refused_only_where_it_is_asked_for(self) -> None:
        # one node, or one process per node: comm_group_call_opt has no hierarchy
        for nodes, procs, ep, ms, runnable in ((1, 4, 2, 2, False), (4, 1, 2, 2, False),
                                               (2, 2, 2, 2, True), (4, 2, 4, 2, True)):
            for group_call in ("0", "1", "both"):
                cfg = _cluster(nodes=nodes, procs_per_node=procs, ep=ep, moe_sharding=ms,
                               group_call=group_call)
                label = f"{nodes} x {procs}, --group-call {group_call}"
                if runnable or group_call == "0":
                    cfg.validate()
                    continue
                with self.assertRaisesRegex(ValueError, "pass --group-call 0 to train the flat "
                                            "path alone", msg=label):
                    cfg.validate()
                # the link probe trains nothing: no pass to refuse
                probe = _cluster(nodes=nodes, procs_per_node=procs, ep=ep, moe_sharding=ms,
                                 group_call=group_call, mode="probe")
                self.assertIsNone(probe.group_call_refusal(), label)
                probe.validate()

    def test_per_pass_averages_the_steps_after_the_first(self) -> None:
        def result(group_call, steps):
            r = cluster.ClusterResult(config=_cluster(group_call=group_call))
            r.steps = {key: {"tx": tx, "rx": tx / 2, "seconds": tx / 100}
                       for key, tx in steps.items()}
            return r

        per = result("both", {(0, 1): 1000.0, (0, 2): 10.0, (0, 3): 30.0,
                              (1, 1): 500.0}).per_pass()
        self.assertEqual(per[0], {"timed_steps": 2, "inter_node_bytes_per_step": 20.0,
                                  "inter_node_rx_bytes_per_step": 10.0, "step_time_s": 0.2,
                                  "first_step_bytes": 1000.0})
        # one step only: it is the timed one
        self.assertEqual(per[1], {"timed_steps": 1, "inter_node_bytes_per_step": 500.0,
                                  "inter_node_rx_bytes_per_step": 250.0, "step_time_s": 5.0,
                                  "first_step_bytes": 500.0})
        # a pass with no steps is absent; steps of a pass not asked for are ignored
        self.assertEqual(result("1", {(0, 1): 4.0, (0, 2): 6.0}).per_pass(), {})


if __name__ == "__main__":
    unittest.main()
