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
"""``expert_sharded_state_dict``: expert parameters at their global shape and offset.

Pins, on one process (the expert group is a stand-in exposing what the
function reads of Paddle's ``Group``: ``nranks``, ``rank``, ``ranks``):
each expert parameter's key, local and global shape and offset per rank
index, the layer's other tensors described as Paddle describes them
(sub-layers, buffers), the same entries under MixPrecisionLayer's ``_layers.`` prefix, the
refusals (uneven split, a rank outside the group, mixed expert counts, 0-D
parameters) with the values in the message, and
``latest_complete_checkpoint_and_id``'s ``(path, id)``. The 4-process run
that saves, reloads and resumes through it: ``test/tools/test_example_train_moe.py``.
"""

from __future__ import annotations

import os
import unittest

import numpy as np
import paddle
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

from muon_checkpoint_helpers import _Dir
from paddle_muon_ext.distributed.flex_checkpoint.dcp.expert_sharded_weight import (
    expert_sharded_state_dict,
)
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_checkpoint import (
    latest_complete_checkpoint_and_id,
    save_sharded_checkpoint,
)

LOCAL, HIDDEN, INNER = 2, 4, 6


class _Group:
    """What ``expert_sharded_state_dict`` reads of a Paddle ``Group``."""

    def __init__(self, ranks: list, rank: int) -> None:
        self.ranks, self.nranks, self.rank = ranks, len(ranks), rank


class _Experts(paddle.nn.Layer):
    """``LOCAL`` stacked experts (3-D weight, 2-D bias), a router sub-layer and a buffer."""

    def __init__(self, group=None, local: int = LOCAL, bias_local: int | None = None) -> None:
        super().__init__()
        self.group = group
        self.up_weight = self.create_parameter([local, HIDDEN, INNER])
        self.bias = self.create_parameter([local if bias_local is None else bias_local, INNER])
        self.gate = paddle.nn.Linear(HIDDEN, 8, bias_attr=False)
        self.register_buffer("steps_seen", paddle.zeros([3]))

    def sharded_state_dict(self, structured_name_prefix: str = "") -> dict:
        return expert_sharded_state_dict(self, structured_name_prefix, self.group)


def _described(entry: ShardedWeight) -> tuple:
    return (tuple(entry.local_shape), tuple(entry.global_shape), tuple(entry.global_offset))


class TestExpertShardedStateDict(unittest.TestCase):
    def test_experts_at_global_shape_and_offset_per_rank_index(self):
        # (group size, this rank's index) -> the expert parameters' description
        for nranks, index in ((None, 0), (2, 0), (2, 1), (4, 3)):
            with self.subTest(nranks=nranks, index=index):
                group = None if nranks is None else _Group(list(range(10, 10 + nranks)), index)
                total = LOCAL * (nranks or 1)
                state = _Experts(group).sharded_state_dict("moe.")
                self.assertEqual(_described(state["moe.up_weight"]),
                                 ((LOCAL, HIDDEN, INNER), (total, HIDDEN, INNER),
                                  (index * LOCAL, 0, 0)))
                self.assertEqual(_described(state["moe.bias"]),
                                 ((LOCAL, INNER), (total, INNER), (index * LOCAL, 0)))
                self.assertEqual(state["moe.up_weight"].key, "moe.up_weight")

    def test_other_tensors_are_described_whole_at_offset_zero(self):
        layer = _Experts(_Group([0, 1], 1))
        state = layer.sharded_state_dict("moe.")
        self.assertEqual(sorted(state), ["moe.bias", "moe.gate.weight", "moe.steps_seen",
                                         "moe.up_weight"])
        self.assertEqual(_described(state["moe.gate.weight"]),
                         ((HIDDEN, 8), (HIDDEN, 8), (0, 0)))
        self.assertEqual(_described(state["moe.steps_seen"]), ((3,), (3,), (0,)))
        # the entries hold the layer's own tensors: a load writes into them
        self.assertIs(state["moe.up_weight"].local_tensor, layer.up_weight)

    def test_a_wrapper_prefixes_the_keys_and_keeps_the_description(self):
        # MixPrecisionLayer (as fleet.distributed_model's MetaParallelBase
        # wrappers) holds the model as ``_layers``: Paddle's walk reaches the
        # layer's own method, under keys that name the wrapper
        from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

        class _Net(paddle.nn.Layer):
            def __init__(self) -> None:
                super().__init__()
                self.experts = _Experts(_Group([0, 1], 1))

        net = _Net()
        wrapped = MixPrecisionLayer(net, dtype="bfloat16")
        state = wrapped.sharded_state_dict()
        self.assertEqual(_described(state["_layers.experts.up_weight"]),
                         ((LOCAL, HIDDEN, INNER), (2 * LOCAL, HIDDEN, INNER), (LOCAL, 0, 0)))
        self.assertEqual(sorted(net.sharded_state_dict()),
                         sorted(k[len("_layers."):] for k in state))

    def test_refusals_name_the_values(self):
        cases = [
            ("an uneven split", dict(group=_Group([0, 1], 0)), {"num_experts": 5},
             ["num_experts 5", "2 ranks", "holds 2", "2 x 2 = 4"]),
            ("a rank outside the group", dict(group=_Group([4, 5], -1)), {},
             ["rank -1 in expert_group of 2 ranks [4, 5]", "not a member",
              "get_expert_parallel_group()"]),
            ("mixed expert counts", dict(group=None, bias_local=3), {},
             ["moe.up_weight 2", "moe.bias 3"]),
        ]
        for what, build, kwargs, pieces in cases:
            with self.subTest(what):
                layer = _Experts(**build)
                with self.assertRaises(ValueError) as ctx:
                    expert_sharded_state_dict(layer, "moe.", layer.group, **kwargs)
                for piece in pieces:
                    self.assertIn(piece, str(ctx.exception))
        layer = paddle.nn.Layer()
        layer.scale = layer.create_parameter([])
        with self.assertRaisesRegex(ValueError, r"x\.scale is 0-D"):
            expert_sharded_state_dict(layer, "x.")
        with self.assertRaisesRegex(ValueError, "holds no parameter of its own"):
            expert_sharded_state_dict(paddle.nn.Layer())

    def test_an_even_split_with_num_experts_is_accepted(self):
        state = expert_sharded_state_dict(
            _Experts(), "", _Group([0, 1, 2], 2), num_experts=3 * LOCAL)
        self.assertEqual(tuple(state["bias"].global_offset), (2 * LOCAL, 0))


class TestLatestCheckpointAndId(_Dir):  # a fresh root, one process
    def test_returns_the_newest_complete_checkpoint_and_its_id(self):
        self.assertEqual(latest_complete_checkpoint_and_id(self.root), (None, None))
        value = np.arange(6, dtype="float32")
        for step in (3, 7):
            state = {"w": ShardedWeight("w", paddle.to_tensor(value), (6,), (6,), (0,))}
            save_sharded_checkpoint(state, self.root, unique_id=step)
        newest = os.path.join(self.root, "checkpoint_7")
        self.assertEqual(latest_complete_checkpoint_and_id(self.root), (newest, 7))
        # an incomplete newest checkpoint is skipped: the id follows the path
        os.remove(os.path.join(newest, "checkpoint.complete.json"))
        self.assertEqual(latest_complete_checkpoint_and_id(self.root),
                         (os.path.join(self.root, "checkpoint_3"), 3))


if __name__ == "__main__":
    unittest.main()
