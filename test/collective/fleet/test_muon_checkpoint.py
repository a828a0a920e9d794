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
"""Checkpoints of MuonShardingOptimizer that survive a change of cluster.

* ``TestShardedStateDict`` (simulated world, seconds): the optimizer's
  ``sharded_state_dict`` uses Paddle develop's keys, takes shapes and offsets
  from the model's sharded weights, includes master weights, and - assembled
  over all ranks - equals the optimizer state of a single-process run.
* ``TestCheckpointMismatch`` (one process): a checkpoint of another model is
  refused with an error naming the keys.
* ``TestReshardingMatrix`` (gloo processes, three launches): save with
  ``paddle.distributed.flex_checkpoint`` on one layout, load on another,
  continue training; the result equals an uninterrupted run on the new layout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import unittest

import numpy as np

import paddle
from paddle.distributed import fleet

from mock.fake_hcg import make_hcg_factory
from mock.simulated_world import SimulatedWorld
from muon_checkpoint_model import (
    H,
    INNER,
    TOTAL_EXPERTS,
    CheckpointNet,
    Layout,
    build_rank,
    checkpoint_state,
    dense_init,
    expert_init,
    follows_dense_dtype,
    make_optimizer,
    reference_states,
    train,
)
from muon_test_compat import register_cpu_tensor_fusion

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_checkpoint import (
    CheckpointMismatchError,
    load_sharded_checkpoint,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding.optimizer_state import (
    state_owner,
)

register_cpu_tensor_fusion()

#: Assembled fp32 optimizer states vs the single-process run: the sharded run
#: differs only in the order of summation inside gradient reductions
#: (a few ulps of O(1) values after two steps).
STATE_ATOL = 1e-6
#: bf16 parameters have bf16 gradients: the sharded run averages them in a
#: bf16 buffer, the reference differentiates the full batch in bf16, so the
#: two gradients differ by up to ~2 bf16 ulps (2**-7 relative) and so do the
#: states they feed.
BF16_RTOL = 2.0**-7
#: Resumed vs uninterrupted run on the target layout (the issue's bound).
RESUME_ATOL = 1e-6

# Develop names Muon's momentum like AdamW's first moment.
MUON_STATE = "moment1_0"
ADAMW_STATES = ("moment1_0", "moment2_0", "beta1_pow_acc_0", "beta2_pow_acc_0")
SCALAR_STATES = ("beta1_pow_acc_0", "beta2_pow_acc_0")


def expected_keys(layout: Layout) -> set[str]:
    """Develop's checkpoint keys for the whole model under ``layout``."""
    shapes = {k: v.shape for k, v in dense_init().items()}
    if layout.ep > 1:
        shapes.update({k: v.shape for k, v in expert_init().items()})
    keys = set(shapes)
    for key, shape in shapes.items():
        muon = len(shape) in (2, 3) and not key.endswith(("bias", "scale", "table"))
        keys.update(f"{key}.{s}" for s in ((MUON_STATE,) if muon else ADAMW_STATES))
        if layout.dense_dtype != "float32" and follows_dense_dtype(key):
            keys.add(f"{key}.w_0")
    return keys


def state_tolerance(key: str, layout: Layout, reference: np.ndarray) -> float:
    """How far an assembled state may be from the single-process one."""
    if layout.dense_dtype != "float32" and follows_dense_dtype(key.rsplit(".", 1)[0]):
        return STATE_ATOL + BF16_RTOL * float(np.abs(reference).max())
    return STATE_ATOL


def run_layout(layout: Layout, body, deadlock_timeout: float = 30.0) -> list:
    """Run ``body(hcg)`` on every rank of ``layout`` in the simulated world."""
    world = SimulatedWorld(
        layout.world, hcg_factory=make_hcg_factory(layout.ep, layout.ms),
        strategy=layout.strategy(), deadlock_timeout=deadlock_timeout,
    )
    return world.run(lambda rank: body(fleet.get_hybrid_communicate_group()))


def describe(state: dict) -> dict:
    """Plain data of a sharded state dict: key -> metadata and fp32 values."""
    out = {}
    for key, sw in state.items():
        out[key] = dict(
            local_shape=tuple(sw.local_shape), global_shape=tuple(sw.global_shape),
            global_offset=tuple(sw.global_offset), is_flattened=sw.is_flattened,
            flattened_range=(None if sw.flattened_range is None else
                             (sw.flattened_range.start, sw.flattened_range.stop)),
            value=sw.local_tensor.astype("float32").numpy().copy(),
        )
    return out


def assemble(per_rank: list[dict]) -> tuple[dict, dict]:
    """Global arrays from every rank's shards, and how often each element was written."""
    arrays, counts = {}, {}
    for shards in per_rank:
        for key, d in shards.items():
            shape = d["global_shape"]
            if key not in arrays:
                arrays[key] = np.zeros(shape, "float64")
                counts[key] = np.zeros(shape, "int64")
            elif arrays[key].shape != tuple(shape):
                raise AssertionError(f"{key}: ranks disagree on the global shape")
            region = tuple(slice(o, o + n) for o, n in zip(d["global_offset"], d["local_shape"]))
            if d["is_flattened"]:
                begin, end = d["flattened_range"]
                block = arrays[key][region].copy().reshape(-1)
                hits = counts[key][region].copy().reshape(-1)
                block[begin:end] = d["value"].reshape(-1)
                hits[begin:end] += 1
                arrays[key][region] = block.reshape(d["local_shape"])
                counts[key][region] = hits.reshape(d["local_shape"])
            elif key.endswith(SCALAR_STATES):
                arrays[key][...] = d["value"].reshape(shape)
                counts[key][...] = 1  # replicated on every rank holding a slice
            else:
                arrays[key][region] = d["value"].reshape(d["local_shape"])
                counts[key][region] += 1
    return arrays, counts


class TestShardedStateDict(unittest.TestCase):
    """``sharded_state_dict`` of the optimizer, over all ranks of a layout."""

    def check_layout(self, layout: Layout, steps: int = 2) -> list[dict]:
        def body(hcg):
            net, opt = build_rank(layout, hcg)
            train(net, opt, hcg, 0, steps)
            model = net.sharded_state_dict()
            return describe(opt.sharded_state_dict(model)), describe(model)

        results = run_layout(layout, body)
        opt_shards = [r[0] for r in results]
        model_keys = set().union(*(r[1] for r in results))
        keys = set().union(*opt_shards) | model_keys
        self.assertEqual(
            keys, expected_keys(layout),
            f"{layout.describe()}: checkpoint keys differ from Paddle develop's naming "
            f"(missing {sorted(expected_keys(layout) - keys)}, "
            f"unexpected {sorted(keys - expected_keys(layout))})")
        arrays, counts = assemble(opt_shards)
        _, reference = reference_states(layout.dense_dtype, steps, layout.ep > 1)
        self.assertEqual(set(arrays), set(reference))
        for key, ref in reference.items():
            self.assertEqual(
                arrays[key].shape, ref.shape,
                f"{layout.describe()}: {key} global shape {arrays[key].shape}, the model "
                f"says {ref.shape}")
            self.assertTrue(
                (counts[key] == 1).all(),
                f"{layout.describe()}: {key}: every element must be described by exactly "
                f"one rank; counts range {counts[key].min()}..{counts[key].max()}")
            diff = float(np.abs(arrays[key] - ref).max())
            self.assertLessEqual(
                diff, state_tolerance(key, layout, ref),
                f"{layout.describe()}: {key} assembled over the ranks differs from the "
                f"single-process optimizer state by {diff:.3e}")
        for shards in opt_shards:
            for key, d in shards.items():
                if d["is_flattened"]:
                    begin, end = d["flattened_range"]
                    self.assertLess(begin, end, f"{key}: a rank whose share is padding "
                                                "only must not describe an empty slice")
                if key.endswith(SCALAR_STATES):
                    self.assertEqual((d["local_shape"], d["global_shape"]), ((1,), (1,)))
                else:
                    self.assertNotEqual(
                        d["global_shape"], (1,),
                        f"{key}: only beta-pow accumulators are scalars")
        return opt_shards

    def test_sharding_two_ranks_bf16_master_weights_and_one_element_slice(self):
        # one step: afterwards the bf16 weights themselves differ by bf16
        # rounding, which would reach every state through the forward pass
        shards = self.check_layout(Layout(ep=1, ms=2, dense_dtype="bfloat16"), steps=1)
        table = [d[f"head.table.{s}"] for d in shards for s in ("moment1_0",)
                 if f"head.table.{s}" in d]
        lengths = sorted(d["flattened_range"][1] - d["flattened_range"][0] for d in table)
        # precondition of this layout: head.table [257] splits 256 + 1
        self.assertEqual(lengths, [1, 256], f"head.table slices: {lengths}")
        one = next(d for d in table if d["flattened_range"][1] - d["flattened_range"][0] == 1)
        self.assertEqual((one["global_shape"], one["local_shape"], one["global_offset"]),
                         ((257,), (257,), (0,)))
        self.assertEqual(one["flattened_range"], (256, 257))
        self.assertTrue(one["is_flattened"])

    def test_experts_regrouped_by_model_sharded_weights(self):
        shards = self.check_layout(Layout(ep=2, ms=2))
        offsets = {tuple(d["experts.w_down." + MUON_STATE]["global_offset"])
                   for d in shards if "experts.w_down." + MUON_STATE in d}
        half = TOTAL_EXPERTS // 2
        self.assertEqual(offsets, {(0, 0, 0), (half, 0, 0)},
                         "w_down states must sit at their experts' global offsets")
        down = next(d["experts.w_down." + MUON_STATE] for d in shards
                    if "experts.w_down." + MUON_STATE in d)
        self.assertEqual(down["local_shape"], (half, INNER, H),
                         "a 2-D stored expert weight's state takes the model's 3-D shape")

    def test_a_shared_weight_keeps_its_state_under_the_first_name(self):
        # a tensor the model describes under two names (tied weights): its
        # states go under the first name in sorted order, once
        def body(hcg):
            net, opt = build_rank(Layout(ep=1, ms=2), hcg)
            train(net, opt, hcg, 0, 1)
            model = net.sharded_state_dict()
            model["a_tied.table"] = model["head.table"]
            return sorted(opt.sharded_state_dict(model))

        per_rank = run_layout(Layout(ep=1, ms=2), body)
        for keys in per_rank:
            self.assertFalse([k for k in keys if k.startswith("head.table.")],
                             f"head.table's states must go under a_tied.table: {keys}")
        self.assertTrue(any("a_tied.table.moment1_0" in keys for keys in per_rank),
                        "no rank describes a_tied.table.moment1_0")

    def test_prefix_names_map_to_their_own_parameter(self):
        # mlp.weight_scale's states start with "mlp.weight_": a shortest-prefix
        # match would file them under mlp.weight as "scale_moment1_0"
        def body(hcg):
            net, opt = build_rank(Layout(ep=1, ms=2, dense_dtype="bfloat16"), hcg)
            train(net, opt, hcg, 0, 1)
            owners = {k: state_owner(opt._runtime, k) for k in opt._inner_opt.state_dict()
                      if k.startswith("mlp.")}
            return owners, sorted(opt.sharded_state_dict(net.sharded_state_dict()))

        for owners, keys in run_layout(Layout(ep=1, ms=2, dense_dtype="bfloat16"), body):
            for key, (name, state) in owners.items():
                expected = "mlp.weight_scale" if key.startswith("mlp.weight_scale") else "mlp.weight"
                self.assertEqual(name, expected, f"state {key} filed under {name}")
                self.assertIn(state, ADAMW_STATES + (MUON_STATE,))
            self.assertFalse([k for k in keys if ".scale_" in k], keys)

    def test_state_dict_round_trip_with_prefix_names_is_bit_exact(self):
        layout = Layout(ep=1, ms=2, dense_dtype="bfloat16")
        saved = {}

        def to_numpy(value):
            if isinstance(value, dict):
                return {k: to_numpy(v) for k, v in value.items()}
            if isinstance(value, paddle.Tensor):  # keep the name, as paddle.save does
                return (value.name, value.numpy())
            return value

        def to_paddle(value):
            if isinstance(value, dict):
                return {k: to_paddle(v) for k, v in value.items()}
            if isinstance(value, tuple):
                tensor = paddle.to_tensor(value[1])
                tensor.name = value[0]
                return tensor
            return value

        def first(hcg):
            net, opt = build_rank(layout, hcg)
            train(net, opt, hcg, 0, 2)
            saved[paddle.distributed.get_rank()] = (
                to_numpy(net.state_dict()), to_numpy(opt.state_dict()))

        def resume(hcg):
            net, opt = build_rank(layout, hcg)
            params, state = saved[paddle.distributed.get_rank()]
            net.set_state_dict(to_paddle(params))
            opt.set_state_dict(to_paddle(state))
            train(net, opt, hcg, 2, 1)
            return net.values()

        def uninterrupted(hcg):
            net, opt = build_rank(layout, hcg)
            train(net, opt, hcg, 0, 3)
            return net.values()

        run_layout(layout, first)
        self.assertTrue(any("mlp.weight_scale_moment1_0" in s
                            for _, s in saved.values()), "precondition: prefix names saved")
        resumed = run_layout(layout, resume)
        straight = run_layout(layout, uninterrupted)
        for rank, (a, b) in enumerate(zip(resumed, straight)):
            for key in b:
                self.assertTrue(np.array_equal(a[key], b[key]),
                                f"rank {rank}: {key} after state_dict round trip differs")

    def test_errors_name_the_parameter(self):
        layout = Layout(ep=1, ms=2)

        def attempt(call) -> str:
            try:
                call()
            except (KeyError, ValueError) as error:
                return f"{type(error).__name__}: {error}"
            return ""

        def body(hcg):
            net, opt = build_rank(layout, hcg)
            model = net.sharded_state_dict()
            errors = {"missing": attempt(lambda: opt.sharded_state_dict({}))}
            wrong = {}
            for key, sw in model.items():  # every weight described as 3 x 3
                wrong[key] = type(sw)(key, sw.local_tensor, (3, 3), (3, 3), (0, 0))
            errors["numel"] = attempt(lambda: opt.sharded_state_dict(wrong))
            ghost = paddle.zeros([2])
            ghost.name = "ghost_stray_0"
            opt._inner_opt._accumulators.setdefault("stray", {})["ghost"] = ghost
            errors["stray"] = attempt(lambda: opt.sharded_state_dict(model))
            return errors

        for rank, errors in enumerate(run_layout(layout, body)):
            self.assertRegex(errors["missing"], r"^KeyError: .*parameter \S+ has optimizer "
                             r"state .* no entry in model_sharded_state_dict", f"rank {rank}")
            self.assertRegex(errors["numel"], r"^ValueError: model sharded weight '\S+' has "
                             r"local shape \[3, 3\] but parameter \S+ has \d+ elements")
            self.assertIn("'ghost_stray_0' belongs to no trainable parameter", errors["stray"])

    def test_fresh_optimizer_describes_every_state(self):
        # load targets exist before the first step
        layout = Layout(ep=2, ms=2, dense_dtype="bfloat16")

        def body(hcg):
            net, opt = build_rank(layout, hcg)
            return set(opt.sharded_state_dict(net.sharded_state_dict()))

        keys = set().union(*run_layout(layout, body))
        self.assertEqual(keys | set(dense_init()) | set(expert_init()), expected_keys(layout))


class TestCheckpointMismatch(unittest.TestCase):
    """A checkpoint that cannot apply is refused, naming what differs."""

    def save(self, path: str, net: CheckpointNet) -> None:
        paddle.distributed.save_state_dict(net.sharded_state_dict(), path)

    def test_different_model_is_refused(self):
        with tempfile.TemporaryDirectory() as tmp:
            saved = CheckpointNet(0, 1)
            self.save(tmp, saved)
            other = CheckpointNet(None, 1)  # no experts
            target = other.sharded_state_dict()
            with self.assertRaises(CheckpointMismatchError) as info:
                load_sharded_checkpoint(target, tmp)
            self.assertIn("experts.w_up", str(info.exception))
            load_sharded_checkpoint(target, tmp, strict=False)  # a subset is fine

    def test_missing_keys_and_shapes(self):
        with tempfile.TemporaryDirectory() as tmp:
            self.save(tmp, CheckpointNet(None, 1))
            net = CheckpointNet(None, 1, dense_dtype="bfloat16")
            target = net.sharded_state_dict()
            wrong = dict(target)
            sw = target["out.bias"]
            wrong["out.bias"] = type(sw)("out.bias", paddle.zeros([5]), (5,), (5,), (0,))
            wrong["mlp.weight.w_0"] = type(sw)("mlp.weight.w_0", paddle.zeros([H, H]),
                                               (H, H), (H, H), (0, 0))
            wrong["head.table"] = paddle.zeros([7])  # plain tensors load too
            with self.assertRaises(CheckpointMismatchError) as info:
                load_sharded_checkpoint(wrong, tmp)
            message = str(info.exception)
            self.assertIn("not in the checkpoint: mlp.weight.w_0", message)
            self.assertIn("out.bias: checkpoint global shape [32], here [5]", message)
            self.assertIn("head.table: checkpoint global shape [257], here [7]", message)

    def test_no_checkpoint(self):
        with tempfile.TemporaryDirectory() as tmp:
            target = CheckpointNet(None, 1).sharded_state_dict()
            with self.assertRaisesRegex(FileNotFoundError, r"no checkpoint in .*no "
                                        r"checkpoint_<id> directory .*no flex_checkpoint"):
                load_sharded_checkpoint(target, tmp)
            self.save(tmp, CheckpointNet(None, 1))
            with self.assertRaisesRegex(FileNotFoundError, r"checkpoint id 7 not in .*\[0\]"):
                load_sharded_checkpoint(target, tmp, unique_id=7)

    def test_matching_checkpoint_loads(self):
        with tempfile.TemporaryDirectory() as tmp:
            saved = CheckpointNet(0, 1)
            with paddle.no_grad():
                saved.param("out.bias").set_value(paddle.full([2 * H], 3.0))
            self.save(tmp, saved)
            fresh = CheckpointNet(0, 1)
            load_sharded_checkpoint(fresh.sharded_state_dict(), tmp)
            for key, value in saved.values().items():
                np.testing.assert_array_equal(fresh.values()[key], value, err_msg=key)


SAVE_STEPS, RESUME_STEPS = 2, 2
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "hybrid_parallel_muon_checkpoint.py")
_REPO = os.path.abspath(os.path.join(os.path.dirname(WORKER), "..", "..", ".."))

#: bf16 gradients are averaged in bf16 buffers; over 4 ranks and over 2 ranks
#: they round differently (2**-8 relative per addition), which moves the
#: Muon/AdamW updates of the saved steps by a few percent of lr * 0.2 = 4e-3
#: (2.1e-4 measured). A lost or misplaced state moves them by O(1e-2) and more.
BF16_ACROSS_SIZES_ATOL = 1e-3

#: case -> (source layout, target layout, tolerance); the source saves after
#: SAVE_STEPS, the target loads and trains RESUME_STEPS more, and is compared
#: with an uninterrupted run of SAVE_STEPS + RESUME_STEPS on the target layout.
#: Tolerance 0: both layouts reduce over the same two ranks (a + b is
#: commutative), so the numbers must be bit-identical.
CASES = {
    "sharding_4_to_2": (Layout(ms=4), Layout(ms=2), RESUME_ATOL),
    "ep4_ms2_to_ep2_ms2": (Layout(ep=4, ms=2), Layout(ep=2, ms=2), RESUME_ATOL),
    "group_call_on_to_off": (Layout(ep=2, ms=2, gpn=2), Layout(ep=2, ms=2), RESUME_ATOL),
    "balanced_to_upstream": (Layout(ms=4), Layout(ms=4, partition="upstream_greedy"),
                             RESUME_ATOL),
    "bf16_master_weights_balanced_to_upstream": (
        Layout(ms=2, dense_dtype="bfloat16"),
        Layout(ms=2, partition="upstream_greedy", dense_dtype="bfloat16"), 0.0),
    "bf16_master_weights_4_to_2": (Layout(ms=4, dense_dtype="bfloat16"),
                                   Layout(ms=2, dense_dtype="bfloat16"),
                                   BF16_ACROSS_SIZES_ATOL),
}
#: a checkpoint loaded into another model: (checkpoint of case, target layout)
MISMATCHES = {
    "experts_into_dense_model": ("ep4_ms2_to_ep2_ms2", Layout(ms=2)),
    "fp32_into_bf16_master_weights": ("sharding_4_to_2", Layout(ms=2, dense_dtype="bfloat16")),
}


def _uninterrupted_name(layout: Layout) -> str:
    return "train_" + "".join(c if c.isalnum() else "_" for c in layout.describe())


def resharding_plans(tmp: str) -> dict[int, list[dict]]:
    """World size -> the jobs of its launch, in the order they must run."""
    jobs: dict[int, list[dict]] = {}
    saved: dict[Layout, str] = {}
    for case, (source, _, _) in CASES.items():
        if source not in saved:
            saved[source] = os.path.join(tmp, f"ckpt_{len(saved)}")
            jobs.setdefault(source.world, []).append(dict(
                name=f"save_{case}", kind="save", layout=dataclasses.asdict(source),
                ckpt=saved[source], first=0, steps=SAVE_STEPS))
    for case, (source, target, _) in CASES.items():
        jobs.setdefault(target.world, []).append(dict(
            name=f"resume_{case}", kind="resume", layout=dataclasses.asdict(target),
            ckpt=saved[source], first=SAVE_STEPS, steps=RESUME_STEPS))
    references = {target for _, target, _ in CASES.values()}
    for target in sorted(references, key=_uninterrupted_name):
        jobs[target.world].append(dict(
            name=_uninterrupted_name(target), kind="train", layout=dataclasses.asdict(target),
            first=0, steps=SAVE_STEPS + RESUME_STEPS))
    for label, (case, target) in MISMATCHES.items():
        jobs.setdefault(target.world, []).append(dict(
            name=f"mismatch_{label}", kind="mismatch", layout=dataclasses.asdict(target),
            ckpt=saved[CASES[case][0]], first=0, steps=0))
    return jobs


@unittest.skipIf(paddle.is_compiled_with_cuda(),
                 "the matrix runs 8 processes on the CPU wheel's gloo backend; a CUDA "
                 "build would need 8 GPUs for its NCCL launch")
class TestReshardingMatrix(unittest.TestCase):
    """flex_checkpoint save on one layout, load on another, train on (gloo).

    One launch per world size (8, 4, 2 processes), biggest first: sources
    save before their targets load. flex_checkpoint's load needs real
    collectives (all_gather_object, barrier, broadcast) and keeps
    module-global state, so threads of one process cannot stand in for ranks.
    """

    @classmethod
    def setUpClass(cls):
        from launch_utils import run_paddle_launch

        cls.tmp = tempfile.mkdtemp(prefix="muon_ckpt_")
        cls.out = os.path.join(cls.tmp, "out")
        os.makedirs(cls.out)
        env = {"PYTHONPATH": os.pathsep.join([
            os.path.join(_REPO, "python"), os.path.dirname(WORKER),
            os.path.join(_REPO, "test"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        cls.logs, cls.seconds = {}, {}
        for world, jobs in sorted(resharding_plans(cls.tmp).items(), reverse=True):
            plan = os.path.join(cls.tmp, f"plan_{world}.json")
            with open(plan, "w") as f:
                json.dump({"out": cls.out, "jobs": jobs}, f)
            result = run_paddle_launch(WORKER, world, env, timeout_s=300, args=[plan])
            result.check()  # on failure: every worker's log tail
            cls.logs[world] = result.worker_logs
            cls.seconds[world] = result.wall_s
        sys.stderr.write("\n[muon checkpoint] launch wall seconds: %s\n" % (
            {w: round(s, 1) for w, s in cls.seconds.items()}))

    @classmethod
    def tearDownClass(cls):
        import shutil

        shutil.rmtree(cls.tmp, ignore_errors=True)

    def values(self, job: str, rank: int) -> dict:
        with np.load(os.path.join(self.out, f"{job}.rank{rank}.npz")) as data:
            return {k: data[k] for k in data.files}

    def check_case(self, case: str) -> float:
        source, target, tolerance = CASES[case]
        worst = {"fp32": 0.0, "bf16": 0.0}
        for rank in range(target.world):
            resumed = self.values(f"resume_{case}", rank)
            straight = self.values(_uninterrupted_name(target), rank)
            self.assertEqual(set(resumed), set(straight))
            for key in straight:
                diff = np.abs(resumed[key].astype("float64") - straight[key])
                allowed, kind = tolerance, "fp32"
                if target.dense_dtype != "float32" and follows_dense_dtype(key):
                    kind = "bf16"
                    if tolerance:
                        # the bf16 cast of the master weight may land one bf16
                        # ulp (<= 2**-7 relative) away
                        allowed = tolerance + 2.0**-7 * np.abs(straight[key])
                worst[kind] = max(worst[kind], float(diff.max()))
                excess = float((diff - allowed).max())
                self.assertLessEqual(
                    excess, 0.0,
                    f"{case}: rank {rank} of {target.describe()}: {key} after loading the "
                    f"{source.describe()} checkpoint and training {RESUME_STEPS} steps differs "
                    f"from the uninterrupted run by {float(diff.max()):.3e} "
                    f"(tolerance {tolerance:g})")
        sys.stderr.write(
            f"\n[muon checkpoint] {case}: max |resumed - uninterrupted| fp32 params "
            f"{worst['fp32']:.3e}" + (f", bf16 params {worst['bf16']:.3e}"
                                      if target.dense_dtype != "float32" else "") + "\n")
        return max(worst.values())

    def test_sharding_4_to_2(self):
        self.check_case("sharding_4_to_2")

    def test_ep4_ms2_to_ep2_ms2_regroups_3d_experts(self):
        self.check_case("ep4_ms2_to_ep2_ms2")

    def test_group_call_on_to_off(self):
        self.check_case("group_call_on_to_off")

    def test_balanced_to_upstream_partition(self):
        self.check_case("balanced_to_upstream")

    def test_bf16_master_weights_follow_their_owner(self):
        self.check_case("bf16_master_weights_balanced_to_upstream")

    def test_bf16_master_weights_4_to_2(self):
        self.check_case("bf16_master_weights_4_to_2")

    def test_other_model_is_refused_on_every_rank(self):
        expected = {"experts_into_dense_model": "loaded by no rank: experts.bias",
                    "fp32_into_bf16_master_weights": "not in the checkpoint: mlp.weight.w_0"}
        for label, (_, target) in MISMATCHES.items():
            logs = self.logs[target.world]
            for rank in range(target.world):
                lines = [json.loads(line.split(" ", 2)[2]) for line in logs[rank].splitlines()
                         if line.startswith(f"CKPT_MISMATCH rank={rank} ")]
                self.assertTrue(any(expected[label] in m for m in lines),
                                f"{label}: rank {rank} did not refuse with "
                                f"{expected[label]!r}: {lines}")


if __name__ == "__main__":
    unittest.main()
