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
"""Tests of the gloo layer (paddle_muon_ext.distributed.fleet.utils.gloo_compat,
imported here as ``gloo_compat``) and launch_utils.py.

(a) in-process unit tests: rendezvous keys / ports, sub-group store
    rendezvous across threads, install/uninstall, no-op detection, the op
    emulations on a real 1-rank ProcessGroupGloo;
(a') the all-to-all emulation on 3 ranks simulated by threads (only the
    all_gather is stood in for), against NumPy;
(b) 8-process launch of gloo_compat_check.py (ep=4 x moe_sharding=2, 4
    emulated nodes x 2 cards) - ~25 s on 2 cores;
(c) 2-process launch in plain sharding=2 mode - ~6 s;
(d) 3-process launch (odd size, 3-rank sub-group) - ~10-14 s.
Every launch also checks all-to-all (list / single / stream forms, unequal
chunks, split sizes, async, a PyLayer gradient, errors on every rank) on each
of its groups, and Paddle's own gloo error once the layer is uninstalled.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import types
import unittest
from unittest import mock

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import paddle  # noqa: E402
import paddle.distributed as dist  # noqa: E402
from paddle.base import core  # noqa: E402

import gloo_compat as gc  # noqa: E402
from launch_utils import LaunchResult, run_paddle_launch  # noqa: E402
from paddle_muon_ext.distributed.fleet.utils import (  # noqa: E402
    gloo_compat_alltoall as a2a,
    gloo_compat_groups as groups,
    gloo_compat_ops as gc_ops,
)

CHECK_SCRIPT = os.path.join(_HERE, "gloo_compat_check.py")


def _patched_targets():
    """(owner, name) pairs install_gloo_compat is expected to replace."""
    import paddle.distributed.collective as collective
    import paddle.distributed.communication as comm

    stream = comm.stream
    rs_stream_mod = sys.modules["paddle.distributed.communication.stream.reduce_scatter"]
    a2a_mod = sys.modules["paddle.distributed.communication.stream.all_to_all"]
    return [
        (collective, "_new_process_group_impl"),
        (dist, "all_reduce"), (dist, "reduce_scatter"),
        (comm, "all_reduce"), (comm, "reduce_scatter"),
        (stream, "all_reduce"), (stream, "reduce"), (stream, "reduce_scatter"),
        (stream, "broadcast"), (stream, "all_gather"),
        (rs_stream_mod, "_reduce_scatter_base"),
        (a2a_mod, "_all_to_all_in_dygraph"), (a2a_mod, "_all_to_all_tensor_in_dygraph"),
        (a2a_mod, "_alltoall_single_in_dygraph"),
    ]


class _EnvGuard:
    """Set/unset environment variables for a block, then restore them."""

    def __init__(self, **values):
        self._values, self._saved = values, {}

    def __enter__(self):
        for key, value in self._values.items():
            self._saved[key] = os.environ.get(key)
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        return self

    def __exit__(self, *exc):
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# ----------------------------------------------------------------- (a) unit
class TestGlooCompatUnits(unittest.TestCase):
    def setUp(self):
        gc.uninstall_gloo_compat()

    def tearDown(self):
        gc.uninstall_gloo_compat()

    def test_rendezvous_key_deterministic_and_unique(self):
        self.assertEqual(gc.rendezvous_key(5, "_default_pg5"),
                         gc.rendezvous_key(5, "_default_pg5"))
        keys = {gc.rendezvous_key(gid, f"_default_pg{gid}") for gid in range(1, 200)}
        self.assertEqual(len(keys), 199)
        self.assertNotEqual(gc.rendezvous_key(3, "a"), gc.rendezvous_key(3, "b"))

    def test_free_ports_distinct_while_held(self):
        """Ports handed to concurrently living stores never repeat."""
        stores, ports = [], []
        for _ in range(4):
            p = gc.pick_free_port()
            stores.append(core.TCPStore("127.0.0.1", p, True, 1, 30))
            ports.append(p)
        self.assertEqual(len(set(ports)), len(ports))
        # a held port is never handed out again
        self.assertNotIn(gc.pick_free_port(), ports)

    def test_subgroup_store_rendezvous_three_ranks(self):
        """Master publishes its endpoint before binding; members find it.

        Threads stand in for ranks (each needs its own default-store client: the
        store client is not thread-safe). ProcessGroupGloo itself cannot be
        tested this way - paddle registers comm contexts per process by gid.
        """
        n = 3

        def rendezvous(gid: int) -> tuple:
            port = gc.pick_free_port()
            master = core.TCPStore("127.0.0.1", port, True, 1, 30)
            got, errors = {}, []

            def rank_fn(r: int) -> None:
                try:
                    default = master if r == 0 else core.TCPStore("127.0.0.1", port, False, 1, 30)
                    sub = gc.create_subgroup_store(default, r, n, gid, "unit_pg")
                    sub.set(f"from{r}", str(r * 10))
                    got[r] = sorted(int(sub.get(f"from{q}")) for q in range(n))
                except Exception as e:  # surfaced below
                    errors.append(f"rank {r}: {e!r}")

            threads = [threading.Thread(target=rank_fn, args=(r,), daemon=True)
                       for r in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            return got, errors

        got, errors = rendezvous(4242)
        if errors:
            # Threads are not processes: once in a CI run under heavy load a
            # member's store client saw "connection reset by peer" (EAGAIN).
            # A second rendezvous on fresh ports must then succeed; launched
            # multi-process jobs test the real thing.
            sys.stderr.write(f"sub-group store rendezvous retried after {errors}\n")
            got, errors = rendezvous(4243)
        self.assertFalse(errors, errors)
        self.assertEqual(got, {r: [0, 10, 20] for r in range(n)})

    def test_install_uninstall_restores_originals(self):
        with _EnvGuard(**{gc.EMULATED_LOCAL_SIZE_ENV: "2", "PADDLE_LOCAL_SIZE": "8"}):
            targets = _patched_targets()
            before = [getattr(o, n) for o, n in targets]
            self.assertIs(gc.install_gloo_compat(force=True), True)
            after = [getattr(o, n) for o, n in targets]
            self.assertTrue(all(a is not b for a, b in zip(after, before)),
                            "every target patched")
            self.assertEqual(os.environ["PADDLE_LOCAL_SIZE"], "2")
            self.assertIs(gc.install_gloo_compat(force=True), True)  # idempotent
            self.assertEqual([getattr(o, n) for o, n in targets], after)
            gc.uninstall_gloo_compat()
            self.assertTrue(all(getattr(o, n) is b for (o, n), b in zip(targets, before)))
            self.assertEqual(os.environ["PADDLE_LOCAL_SIZE"], "8")
            self.assertFalse(gc.is_installed())
            gc.uninstall_gloo_compat()  # idempotent

    def test_backend_detection(self):
        cases = [({"GLOO_COMPAT": "0"}, False), ({"PADDLE_DISTRI_BACKEND": "nccl"}, False),
                 ({"PADDLE_DISTRI_BACKEND": "gloo"}, True),
                 ({"GLOO_COMPAT": "1", "PADDLE_DISTRI_BACKEND": "nccl"}, True)]
        for env, expected in cases:
            with self.subTest(env=env), \
                    _EnvGuard(**{"GLOO_COMPAT": None, "PADDLE_DISTRI_BACKEND": None, **env}):
                gc.uninstall_gloo_compat()
                self.assertIs(gc.gloo_expected(), expected)
                targets = _patched_targets()
                before = [getattr(o, n) for o, n in targets]
                self.assertIs(gc.install_gloo_compat(), expected)
                if not expected:  # a true no-op
                    self.assertEqual([getattr(o, n) for o, n in targets], before)
                gc.uninstall_gloo_compat()

    def test_backend_guess_from_the_build(self):
        with _EnvGuard(GLOO_COMPAT=None, PADDLE_DISTRI_BACKEND=None):
            cuda = mock.patch.object(paddle, "is_compiled_with_cuda", return_value=True)
            cases = [
                (mock.patch.object(paddle, "is_compiled_with_cuda", return_value=False), True),
                (mock.patch.object(paddle.device.cuda, "device_count", return_value=0), True),
                (mock.patch.object(paddle.device.cuda, "device_count", return_value=2), False),
                (mock.patch.object(paddle.device.cuda, "device_count",
                                   side_effect=RuntimeError("no driver")), True),
            ]
            for number, (patch, expected) in enumerate(cases):
                with self.subTest(case=number):
                    with (contextlib.nullcontext() if number == 0 else cuda), patch:
                        self.assertIs(gc.gloo_expected(), expected)
                    # the launcher's choice, never the build, decides for patch_paddle()
                    self.assertFalse(gc.gloo_backend_selected())

    def test_forced_off_spellings_and_store_defaults(self):
        for value in ("0", "false", "off", "no", "OFF"):
            with self.subTest(GLOO_COMPAT=value), \
                    _EnvGuard(GLOO_COMPAT=value, PADDLE_DISTRI_BACKEND="gloo"):
                self.assertFalse(gc.gloo_expected(), f"GLOO_COMPAT={value} must force it off")
                self.assertFalse(gc.gloo_backend_selected())
        for value in ("1", "true", "on", "yes", "ON", "True", " Yes "):
            with self.subTest(GLOO_COMPAT=value), \
                    _EnvGuard(GLOO_COMPAT=value, PADDLE_DISTRI_BACKEND="nccl"):
                self.assertTrue(gc.gloo_expected(), f"GLOO_COMPAT={value!r} must force it on")
        with _EnvGuard(**{gc.STORE_TIMEOUT_ENV: None}):
            self.assertEqual(groups._store_timeout(), 300, "sub-group store timeout default")
        with _EnvGuard(PADDLE_CURRENT_ENDPOINT="10.1.2.3:6170"):
            self.assertEqual(groups._my_host(), "10.1.2.3", "the master publishes its own host")
        with _EnvGuard(PADDLE_CURRENT_ENDPOINT=None):
            self.assertEqual(groups._my_host(), "127.0.0.1")

    def test_emulated_reduce_scatter_on_four_ranks(self):
        # Rank 2 of 4 whose peers hold the same input: the all_reduce (SUM
        # for AVG) gives 4x; AVG keeps the input's slice, SUM four times it,
        # another op goes through unchanged; the input is never modified.
        class Group:
            nranks, rank = 4, 2

        ops = []

        def all_reduce(t, op, group, sync_op, use_calc_stream):
            ops.append(op)
            t.scale_(4.0)
            return "task"

        x = np.arange(16, dtype=np.float32)
        for op, factor in ((dist.ReduceOp.AVG, 1.0), (dist.ReduceOp.SUM, 4.0),
                           (dist.ReduceOp.MAX, 4.0)):
            with self.subTest(op=op):
                ops.clear()
                inp, out = paddle.to_tensor(x), paddle.zeros([4])
                task = gc_ops.emulated_reduce_scatter(out, inp, op, Group(), all_reduce)
                self.assertEqual(task, "task")
                want_op = dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op
                self.assertEqual(ops, [want_op], "the all_reduce ran with the wrong op")
                np.testing.assert_allclose(out.numpy(), x[8:12] * factor,
                                           err_msg=f"{op}: rank 2's slice")
                self.assertTrue(np.array_equal(inp.numpy(), x), "the input was modified")

    def test_bad_emulated_local_size_is_refused(self):
        with _EnvGuard(**{gc.EMULATED_LOCAL_SIZE_ENV: "0"}):
            with self.assertRaisesRegex(ValueError, "GLOO_COMPAT_LOCAL_SIZE='0': must be a positive integer"):
                gc.apply_emulated_local_size()

    def test_uninstall_unsets_a_local_size_that_was_not_there(self):
        with _EnvGuard(**{gc.EMULATED_LOCAL_SIZE_ENV: "2", "PADDLE_LOCAL_SIZE": None}):
            gc.install_gloo_compat(force=True)
            self.assertEqual(os.environ["PADDLE_LOCAL_SIZE"], "2")
            gc.uninstall_gloo_compat()
            self.assertNotIn("PADDLE_LOCAL_SIZE", os.environ)

    def test_no_global_group_is_not_gloo(self):
        with mock.patch.object(dist.collective, "_get_global_group",
                               side_effect=RuntimeError("not initialised")):
            self.assertFalse(gc.is_gloo_group(None))

    def test_master_store_that_cannot_bind_names_the_group(self):
        class Store:
            def set(self, key, value):
                self.published = (key, value)

        fake_core = types.SimpleNamespace(TCPStore=mock.Mock(side_effect=OSError("in use")))
        default = Store()
        with mock.patch.object(groups, "core", fake_core):
            with self.assertRaisesRegex(RuntimeError, r"sub-group pg7 \(gid 7\) store could "
                                        r"not bind .*in use"):
                gc.create_subgroup_store(default, 0, 3, 7, "pg7")
        self.assertEqual(default.published[0], gc.rendezvous_key(7, "pg7"))

    def test_new_process_group_gets_its_own_store_only_for_gloo_sub_groups(self):
        calls = []

        def original(backend, store, rank, world_size, group_name, pg_options=None,
                     group_id=0):
            calls.append((backend, group_id))
            return "original"

        fake_core = types.SimpleNamespace(ProcessGroupGloo=types.SimpleNamespace(
            create=lambda store, rank, size, gid: ("gloo", store, rank, size, gid)))
        impl = groups.make_new_pg_impl(original)
        with mock.patch.object(groups, "core", fake_core), \
                mock.patch.object(groups, "create_subgroup_store", return_value="own store") as own:
            self.assertEqual(impl("nccl", "default", 0, 2, "pg3", group_id=3), "original")
            self.assertEqual(impl("gloo", "default", 0, 4, "pg0", group_id=0), "original")
            self.assertEqual(impl("gloo", "default", 1, 4, "pg5", group_id=5),
                             ("gloo", "own store", 1, 4, 5))
        own.assert_called_once_with("default", 1, 4, 5, "pg5")
        self.assertEqual(calls, [("nccl", 3), ("gloo", 0)])

    def test_calc_stream_ops_become_sync_ops_on_gloo(self):
        calls = []

        def fake_broadcast(tensor, src=0, group=None, sync_op=True, use_calc_stream=False):
            calls.append((sync_op, use_calc_stream))

        wrapped = gc_ops.stream_generic(fake_broadcast)
        with mock.patch.object(gc_ops, "is_gloo_group", return_value=True):
            wrapped(paddle.ones([1]), src=0, sync_op=False, use_calc_stream=True)
        with mock.patch.object(gc_ops, "is_gloo_group", return_value=False):
            wrapped(paddle.ones([1]), src=0, sync_op=False, use_calc_stream=True)
        self.assertEqual(calls, [(True, False), (False, True)])

    def test_wrappers_pass_through_for_non_gloo_groups(self):
        calls = []

        def fake_reduce(tensor, dst=0, op=dist.ReduceOp.SUM, group=None, sync_op=True,
                        use_calc_stream=False):
            calls.append((op, sync_op, use_calc_stream))

        class FakeGroup:  # e.g. an NCCL group: process_group is not gloo
            process_group = object()
            nranks, rank, ranks = 2, 0, [0, 1]

        wrapped = gc_ops.stream_avg_prescale(fake_reduce)
        t = paddle.ones([2])
        wrapped(t, dst=1, op=dist.ReduceOp.AVG, group=FakeGroup(), sync_op=True,
                use_calc_stream=True)
        self.assertEqual(calls, [(dist.ReduceOp.AVG, True, True)])
        self.assertTrue(np.allclose(t.numpy(), 1.0))  # not pre-scaled

        def fake_reduce_scatter(tensor, tensor_list, op=dist.ReduceOp.SUM, group=None,
                                sync_op=True):
            calls.append(("reduce_scatter", op))

        def fake_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, sync_op=True):
            calls.append(("all_reduce", op))

        gc_ops.reduce_scatter_compat(fake_reduce_scatter, lambda: None, "tensor", "tensor_list")(
            t, [t, t], op=dist.ReduceOp.AVG, group=FakeGroup())
        gc_ops.top_all_reduce(fake_all_reduce, lambda: None)(
            t, op=dist.ReduceOp.AVG, group=FakeGroup())
        self.assertEqual(calls[1:], [("reduce_scatter", dist.ReduceOp.AVG),
                                     ("all_reduce", dist.ReduceOp.AVG)])

    def test_emulations_on_one_rank_gloo_group(self):
        """The op emulations on a real ProcessGroupGloo of size 1.

        Created once per process (paddle keeps comm contexts by gid for the
        life of the process, so the same gid cannot be created twice).
        """
        from paddle.distributed.collective import Group

        # ProcessGroup's C++ ctor reads the global rank from the environment.
        with _EnvGuard(PADDLE_TRAINER_ID="0", PADDLE_TRAINERS_NUM="1"):
            store = core.TCPStore("127.0.0.1", gc.pick_free_port(), True, 1, 30)
            pg = core.ProcessGroupGloo.create(store, 0, 1, 9901)

        class OneRankGroup(Group):
            # Group.is_member() is False for nranks < 2, which turns every op
            # into a silent no-op; force membership so the ops really run.
            def is_member(self) -> bool:
                return True

        g = OneRankGroup(0, 9901, [0], pg=pg, name="unit_gloo_1")
        self.assertTrue(gc.is_gloo_group(g))
        # Without the layer the CPU wheel's AVG path dies on core.nccl_version,
        # and gloo's all-to-all error stays Paddle's own.
        with self.assertRaisesRegex(AttributeError, "nccl_version"):
            dist.all_reduce(paddle.ones([2]), op=dist.ReduceOp.AVG, group=g)
        for call in (lambda: dist.alltoall([], [paddle.ones([2])], group=g),
                     lambda: dist.alltoall_single(paddle.empty([2]), paddle.ones([2]), group=g)):
            with self.assertRaisesRegex(NotImplementedError, "does not support all_to_all"):
                call()
        gc.install_gloo_compat(force=True)
        out = []
        dist.alltoall(out, [paddle.to_tensor([[1.0, 2.0]])], group=g, sync_op=False).wait()
        self.assertEqual([o.numpy().tolist() for o in out], [[[1.0, 2.0]]])
        single = paddle.zeros([3])
        dist.alltoall_single(single, paddle.to_tensor([4.0, 5.0, 6.0]), [3], [3], group=g)
        self.assertEqual(single.numpy().tolist(), [4.0, 5.0, 6.0])
        stream = dist.communication.stream
        x = np.arange(8, dtype=np.float32)

        t = paddle.to_tensor(x)
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=g)  # CPU wheel: would raise
        self.assertTrue(np.allclose(t.numpy(), x))

        buf = paddle.to_tensor(x)
        view = buf._slice(0, 8)  # output aliases input, as in FusedCommBuffer
        dist.reduce_scatter(view, buf, op=dist.ReduceOp.AVG, group=g, sync_op=False).wait()
        self.assertTrue(np.allclose(buf.numpy(), x))

        out = paddle.zeros([8])
        stream.reduce_scatter(out, [paddle.to_tensor(x)], op=dist.ReduceOp.SUM, group=g,
                              sync_op=True, use_calc_stream=True)
        self.assertTrue(np.allclose(out.numpy(), x))

        t = paddle.to_tensor(x)
        stream.reduce(t, dst=0, op=dist.ReduceOp.AVG, group=g, sync_op=True,
                      use_calc_stream=True)
        self.assertTrue(np.allclose(t.numpy(), x))

        with self.assertRaisesRegex(ValueError, "numel"):
            dist.reduce_scatter(paddle.zeros([3]), paddle.to_tensor(x), group=g)


# ------------------------------------------------- (a') all-to-all emulation
class _ThreadWorld:
    """n ranks as threads; all_gather meets at a barrier (a stand-in for gloo).

    Only the exchange is simulated: the emulation's own code (counts table,
    padding, picking the pieces, writing the outputs) runs as on real ranks.
    """

    def __init__(self, n: int):
        self.n, self.slots = n, [None] * n
        self.barrier = threading.Barrier(n, timeout=30)
        self.gathers = 0

    def group(self, rank: int):
        world = self

        class ProcessGroup:
            def all_gather(self, mine, out):
                world.slots[rank] = mine.numpy().copy()
                world.barrier.wait()
                full = np.concatenate(world.slots)
                if rank == 0:
                    world.gathers += 1
                world.barrier.wait()
                paddle.assign(paddle.to_tensor(full), out)
                return types.SimpleNamespace(wait=lambda: None)

        return types.SimpleNamespace(nranks=self.n, rank=rank, process_group=ProcessGroup())

    def run(self, fn):
        """fn(rank, group) on every rank; returns ({rank: result}, {rank: error text})."""
        results, errors = {}, {}

        def body(r):
            try:
                results[r] = fn(r, self.group(r))
            except Exception as e:  # surfaced by the caller
                errors[r] = f"{type(e).__name__}: {e}"

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return results, errors


def _sent(src: int, dst: int, rows: int, width: int = 2) -> np.ndarray:
    """What rank src sends rank dst (distinct, exact in float32)."""
    return (100.0 * src + 10.0 * dst + np.arange(rows * width).reshape(rows, width)).astype(
        np.float32)


def _rows(src: int, dst: int) -> int:
    return (src + 2 * dst) % 4  # unequal, 0 included


class TestGlooAllToAllEmulation(unittest.TestCase):
    """The all-to-all emulation on 3 simulated ranks, against NumPy."""

    def test_list_form_unequal_and_empty_chunks(self):
        n = 3

        def fn(r, g):
            ins = [paddle.to_tensor(_sent(r, d, _rows(r, d))) for d in range(n)]
            outs = [paddle.full([_rows(s, r), 2], -1.0) for s in range(n)]
            a2a.emulated_all_to_all_list(outs, ins, g)
            return [o.numpy() for o in outs]

        results, errors = _ThreadWorld(n).run(fn)
        self.assertFalse(errors, errors)
        for r in range(n):
            for s in range(n):
                np.testing.assert_array_equal(results[r][s], _sent(s, r, _rows(s, r)),
                                              err_msg=f"rank {r}, piece from {s}")

    def test_list_form_empty_out_list_is_filled_like_the_inputs(self):
        def fn(r, g):
            outs = []
            a2a.emulated_all_to_all_list(outs, [paddle.to_tensor(_sent(r, d, 1)) for d in range(2)], g)
            return [o.numpy() for o in outs]

        results, errors = _ThreadWorld(2).run(fn)
        self.assertFalse(errors, errors)
        for r in range(2):
            np.testing.assert_array_equal(np.stack(results[r]), np.stack([_sent(s, r, 1) for s in range(2)]))

    def test_single_with_and_without_split_sizes(self):
        n = 3

        def fn(r, g):
            in_split = [_rows(r, d) for d in range(n)]
            out_split = [_rows(s, r) for s in range(n)]
            x = paddle.to_tensor(np.concatenate([_sent(r, d, in_split[d]) for d in range(n)]))
            split = paddle.full([sum(out_split), 2], -1.0)
            a2a.emulated_all_to_all_single(split, x, out_split, in_split, g)
            even = paddle.full([2 * n, 2], -1.0)
            x2 = paddle.to_tensor(np.concatenate([_sent(r, d, 2) for d in range(n)]))
            a2a.emulated_all_to_all_tensor(even, x2, g)
            return split.numpy(), even.numpy()

        results, errors = _ThreadWorld(n).run(fn)
        self.assertFalse(errors, errors)
        for r in range(n):
            np.testing.assert_array_equal(
                results[r][0], np.concatenate([_sent(s, r, _rows(s, r)) for s in range(n)]))
            np.testing.assert_array_equal(
                results[r][1], np.concatenate([_sent(s, r, 2) for s in range(n)]))

    def test_nothing_to_send_skips_the_data_exchange(self):
        world = _ThreadWorld(2)

        def fn(r, g):
            out = paddle.zeros([0, 2])
            return a2a.emulated_all_to_all_single(out, paddle.zeros([0, 2]), None, None, g)

        results, errors = world.run(fn)
        self.assertFalse(errors, errors)
        self.assertEqual(world.gathers, 1, "only the counts were exchanged")
        self.assertTrue(all(hasattr(t, "wait") for t in results.values()), "a task per rank")

    def test_count_mismatch_is_refused_on_every_rank(self):
        def fn(r, g):
            out_split = [2, 2] if r else [3, 1]  # rank 0 expects 3 rows from itself
            out = paddle.zeros([4, 2])
            a2a.emulated_all_to_all_single(out, paddle.ones([4, 2]), out_split, None, g)

        _, errors = _ThreadWorld(2).run(fn)
        self.assertEqual(sorted(errors), [0, 1], "every rank raises (no rank left waiting)")
        for r in (0, 1):
            self.assertIn("group rank 0 sends 4 elements to group rank 0, which expects 6",
                          errors[r])

    def test_one_ranks_bad_arguments_are_refused_on_every_rank(self):
        cases = {
            "list length": (lambda r, g: a2a.emulated_all_to_all_list(
                [paddle.ones([1])] * 2, [paddle.ones([1])] * (3 if r == 1 else 2), g),
                "3 input and 2 output tensors for a group of 2"),
            "dtype": (lambda r, g: a2a.emulated_all_to_all_list(
                [paddle.ones([1], dtype="int64" if r == 1 else "float32"), paddle.ones([1])],
                [paddle.ones([1])] * 2, g), r"out_tensor_list\[0\] has dtype paddle.int64, the input has paddle.float32"),
            "split sum": (lambda r, g: a2a.emulated_all_to_all_single(
                paddle.ones([4]), paddle.ones([4]), None, [1, 2] if r == 1 else None, g),
                r"in_tensor split sizes \[1, 2\] must be 2 non-negative numbers summing to its 4"),
            "negative split": (lambda r, g: a2a.emulated_all_to_all_single(
                paddle.ones([4]), paddle.ones([4]), None, [-1, 5] if r == 1 else None, g),
                r"in_tensor split sizes \[-1, 5\] must be 2 non-negative numbers"),
            "out dtype": (lambda r, g: a2a.emulated_all_to_all_single(
                paddle.ones([2], dtype="int64" if r == 1 else "float32"), paddle.ones([2]), None,
                None, g), "out_tensor has dtype paddle.int64"),
            "indivisible": (lambda r, g: a2a.emulated_all_to_all_single(
                paddle.ones([4]), paddle.ones([3 if r == 1 else 4]), None, None, g),
                "in_tensor has 3 rows, not divisible by the group size 2"),
            "0-D": (lambda r, g: a2a.emulated_all_to_all_single(
                paddle.ones([2]), paddle.ones([]) if r == 1 else paddle.ones([2]), None, None, g),
                "in_tensor is 0-D"),
            "output list length": (lambda r, g: a2a.emulated_all_to_all_list(
                [paddle.ones([1])] * (3 if r == 1 else 2), [paddle.ones([1])] * 2, g),
                "2 input and 3 output tensors for a group of 2"),
            "output split sum": (lambda r, g: a2a.emulated_all_to_all_single(
                paddle.ones([4]), paddle.ones([4]), [1, 2] if r == 1 else None, None, g),
                r"out_tensor split sizes \[1, 2\] must be 2 non-negative numbers summing to "
                r"its 4"),
            "output indivisible": (lambda r, g: a2a.emulated_all_to_all_single(
                paddle.ones([3 if r == 1 else 4]), paddle.ones([4]), None, None, g),
                "out_tensor has 3 rows, not divisible by the group size 2"),
        }
        for case, (fn, message) in cases.items():
            with self.subTest(case=case):
                _, errors = _ThreadWorld(2).run(fn)
                self.assertEqual(sorted(errors), [0, 1], errors)
                self.assertRegex(errors[1], message)
                self.assertIn("group rank(s) [1] refused their own arguments", errors[0])

    def test_empty_input_list_is_refused(self):
        g = types.SimpleNamespace(nranks=2, rank=0)
        with self.assertRaisesRegex(RuntimeError, "in_tensor_list is empty"):
            a2a.emulated_all_to_all_list([], [], g)

    def test_non_gloo_groups_reach_paddles_helper(self):
        calls = []

        def original(out, inp, group, sync_op, use_calc_stream):
            calls.append((sync_op, use_calc_stream))
            return "native"

        def emulation(out, inp, group):
            calls.append("emulated")
            return "emulated"

        wrapped = a2a.a2a_dygraph_compat(original, emulation)
        with mock.patch.object(a2a, "is_gloo_group", return_value=False):
            self.assertEqual(wrapped("o", "i", "nccl group", False, True), "native")
        with mock.patch.object(a2a, "is_gloo_group", return_value=True):
            self.assertEqual(wrapped("o", "i", group="gloo group", sync_op=False,
                                     use_calc_stream=True), "emulated")
        self.assertEqual(calls, [(False, True), "emulated"])


# --------------------------------------------------------------- launches
class TestGlooCompatLaunch(unittest.TestCase):
    def _assert_all_ok(self, result: LaunchResult, nproc: int) -> None:
        result.check()
        ok = result.workers_printing("GLOO_COMPAT_OK")
        self.assertEqual(ok, list(range(nproc)),
                         f"GLOO_COMPAT_OK only from ranks {ok}\n" + result.failure_message())

    def test_launch_8_ranks_ep4_moe_sharding2(self):
        result = run_paddle_launch(
            CHECK_SCRIPT, 8,
            env={"PADDLE_LOCAL_SIZE": "2", "CUDA_VISIBLE_DEVICES": "",
                 "GLOO_COMPAT_CHECK_MODE": "ep"},
            timeout_s=240,
        )
        print(f"8-rank gloo_compat_check wall {result.wall_s:.1f}s")
        self._assert_all_ok(result, 8)
        info = [ln for ln in result.worker_logs[0].splitlines()
                if ln.startswith("GLOO_COMPAT_INFO")]
        self.assertTrue(info and "hcg=EPHybridCommunicateGroup" in info[0]
                        and "gpn=2" in info[0], info)

    def test_launch_2_ranks_plain_sharding(self):
        result = run_paddle_launch(
            CHECK_SCRIPT, 2,
            env={"CUDA_VISIBLE_DEVICES": "", "GLOO_COMPAT_CHECK_MODE": "sharding"},
            timeout_s=120,
        )
        print(f"2-rank gloo_compat_check wall {result.wall_s:.1f}s")
        self._assert_all_ok(result, 2)

    def test_launch_3_ranks_alltoall_and_odd_sub_group(self):
        # Every launch here also runs the all-to-all checks on each of its
        # groups (2, 4 and 8 ranks above); 3 ranks add an odd size, the global
        # group and a 3-rank sub-group, and Paddle's own error without the layer.
        result = run_paddle_launch(
            CHECK_SCRIPT, 3,
            env={"CUDA_VISIBLE_DEVICES": "", "GLOO_COMPAT_CHECK_MODE": "sharding"},
            timeout_s=120,
        )
        print(f"3-rank gloo_compat_check wall {result.wall_s:.1f}s")
        self._assert_all_ok(result, 3)
        info = [ln for ln in result.worker_logs[0].splitlines()
                if ln.startswith("GLOO_COMPAT_INFO")]
        self.assertTrue(info and "('node[0, 1, 2]', [0, 1, 2])" in info[0], info)


if __name__ == "__main__":
    unittest.main()
