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
"""A model whose training does not depend on the cluster layout.

Checkpoint tests save on one layout, load on another and compare with an
uninterrupted run on the second layout, so the same global computation must
result whatever the sharding / expert-parallel degrees:

* dense loss: each rank takes an equal share of a fixed global batch; the
  sharding group averages the gradients, which gives the full-batch gradient
  on any number of ranks;
* expert loss: every rank holding expert ``e`` evaluates it on the whole
  global batch, so the moe_sharding average of expert gradients is exact
  (identical addends) on any moe_sharding degree; expert weights are global
  tensors ``[E, ...]`` split along the expert axis, as the model's sharded
  state dict says.

Parameters (names chosen for what checkpoints must get right):

* ``head.table`` [257]: element-wise sharded; on 2 ranks with bf16 ``mlp``
  weights (fp32 buffer: table + out.bias) its second slice is
  one element (a one-element slice is not a scalar);
* ``mlp.weight`` [H, H] (Muon) and ``mlp.weight_scale`` [H] (AdamW): one name
  is the other plus ``_...``;
* ``out.weight`` [H, 2H] (Muon), ``out.bias`` [2H];
* experts: ``experts.w_up`` [E_local, H, I] (3-D Muon, batched per expert),
  ``experts.w_down`` stored 2-D [E_local*I, H] and described 3-D [E, I, H]
  (Muon per expert through ``split_concat_func``), ``experts.bias`` [E_local, H]
  (AdamW).
"""

from __future__ import annotations

import dataclasses

import numpy as np

import paddle
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

from mock.fake_hcg import make_hybrid_strategy
from muon_sim_runner import local_size
from muon_test_compat import set_muon_sharding_options

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_optimizer import (
    MuonShardingOptimizer,
)
from paddle_muon_ext.optimizer.muon import Muon, MuonParamInfo

H, INNER, TOTAL_EXPERTS, GLOBAL_BATCH, TABLE = 16, 8, 8, 8, 257
LR = 0.02
EXPERT_COLOUR = "moe_expert"
#: AdamW (element-wise) parameters; every other 2-D/3-D weight uses Muon.
EXCLUDE = ("table", "scale", "bias")


def _rng_array(seed: int, shape: tuple, std: float) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, std, shape).astype("float32")


def dense_init() -> dict[str, np.ndarray]:
    """Initial dense parameters, keyed by structured name (registration order)."""
    return {
        "head.table": _rng_array(1, (TABLE,), 0.1),
        "mlp.weight": _rng_array(2, (H, H), 0.3),
        "mlp.weight_scale": (1 + _rng_array(3, (H,), 0.1)).astype("float32"),
        "out.weight": _rng_array(4, (H, 2 * H), 0.3),
        "out.bias": _rng_array(5, (2 * H,), 0.1),
    }


def expert_init() -> dict[str, np.ndarray]:
    """All experts' initial weights, global shapes ``[E, ...]``."""
    return {
        "experts.w_up": _rng_array(6, (TOTAL_EXPERTS, H, INNER), 0.3),
        "experts.w_down": _rng_array(7, (TOTAL_EXPERTS, INNER, H), 0.3),
        "experts.bias": _rng_array(8, (TOTAL_EXPERTS, H), 0.1),
    }


def follows_dense_dtype(key: str) -> bool:
    """Parameters stored in ``dense_dtype`` (the rest stay fp32)."""
    return key.startswith("mlp.") or key == "out.weight"


def global_batch(step: int) -> np.ndarray:
    """The whole batch of ``step`` (every layout trains on the same data)."""
    return _rng_array(1000 + step, (GLOBAL_BATCH, H), 1.0)


def _param(name: str, value: np.ndarray, dtype: str):
    p = paddle.create_parameter(
        list(value.shape), dtype,
        default_initializer=paddle.nn.initializer.Assign(value.astype("float32")),
    )
    # Fixed names: every rank (thread or process) and every layout must key
    # optimizer states identically.
    p.name = name
    return p


class _Holder(paddle.nn.Layer):
    pass


class CheckpointNet(paddle.nn.Layer):
    """One rank's model.

    Args:
        expert_coord (int|None): expert-parallel coordinate (None: no experts).
        ep (int): expert-parallel degree (experts per rank = TOTAL_EXPERTS // ep).
        moe_group (Group|None): the experts' colour group.
        dense_dtype (str): dtype of ``mlp.*`` and ``out.weight`` (bfloat16:
            master weights; ``out.weight`` changes owner between the balanced
            and the upstream partition on two ranks).
    """

    def __init__(self, expert_coord: int | None, ep: int, moe_group=None,
                 dense_dtype: str = "float32") -> None:
        super().__init__()
        for key, value in dense_init().items():
            dtype = dense_dtype if follows_dense_dtype(key) else "float32"
            self._register(key, _param(key, value, dtype))
        self.expert_coord = expert_coord
        self.local_experts = TOTAL_EXPERTS // ep
        if expert_coord is not None:
            lo = expert_coord * self.local_experts
            hi = lo + self.local_experts
            full = expert_init()
            local = {
                "experts.w_up": full["experts.w_up"][lo:hi],
                # stored 2-D: [E_local * INNER, H]
                "experts.w_down": full["experts.w_down"][lo:hi].reshape(-1, H),
                "experts.bias": full["experts.bias"][lo:hi],
            }
            for key, value in local.items():
                p = _param(key, value, "float32")
                p.color = {"color": EXPERT_COLOUR, "group": moe_group}
                p.no_sync = True
                self._register(key, p)

    def _register(self, key: str, param) -> None:
        layer_name, attr = key.split(".")
        if layer_name not in self._sub_layers:
            self.add_sublayer(layer_name, _Holder())
        self._sub_layers[layer_name].add_parameter(attr, param)

    def param(self, key: str):
        layer_name, attr = key.split(".")
        return getattr(self._sub_layers[layer_name], attr)

    def sharded_state_dict(self, structured_name_prefix: str = "") -> dict:
        """Dense weights replicated; expert weights split along the expert axis."""
        out = super().sharded_state_dict(structured_name_prefix)
        if self.expert_coord is None:
            return out
        offset = self.expert_coord * self.local_experts
        for key in ("experts.w_up", "experts.w_down", "experts.bias"):
            p = self.param(key)
            full_shape = expert_init()[key].shape
            local_shape = (self.local_experts, *full_shape[1:])
            out[structured_name_prefix + key] = ShardedWeight(
                key=structured_name_prefix + key,
                local_tensor=p.reshape(local_shape) if tuple(p.shape) != local_shape else p,
                local_shape=local_shape,
                global_shape=(TOTAL_EXPERTS, *full_shape[1:]),
                global_offset=(offset,) + (0,) * (len(full_shape) - 1),
            )
            # the reshaped view must keep the parameter's name (the optimizer
            # maps its states to model keys by name)
            out[structured_name_prefix + key].local_tensor.name = p.name
        return out

    def loss(self, step: int, shard: int, shards: int):
        """This rank's loss: its share ``shard`` of ``shards`` of the dense batch,
        plus its experts on the whole batch."""
        x_all = global_batch(step)
        rows = GLOBAL_BATCH // shards
        x = paddle.to_tensor(x_all[shard * rows:(shard + 1) * rows])

        def f32(key):
            p = self.param(key)
            return p if p.dtype == paddle.float32 else p.astype("float32")

        h = paddle.tanh(paddle.matmul(x, f32("mlp.weight"))) * f32("mlp.weight_scale")
        y = paddle.matmul(h, f32("out.weight")) + f32("out.bias")
        table = f32("head.table")
        loss = (y**2).mean() + 0.01 * (table * table).sum() * (1.0 + x.mean())
        if self.expert_coord is not None:
            xe = paddle.to_tensor(x_all).unsqueeze(0)  # [1, B, H]
            up = paddle.tanh(paddle.matmul(xe, self.param("experts.w_up")))  # [E, B, I]
            down = self.param("experts.w_down").reshape([self.local_experts, INNER, H])
            ye = paddle.matmul(up, down) + self.param("experts.bias").unsqueeze(1)
            loss = loss + (ye**2).mean(axis=[1, 2]).sum() / TOTAL_EXPERTS
        return loss

    def values(self) -> dict[str, np.ndarray]:
        """Parameters as fp32 numpy; experts as their global-index rows."""
        out = {}
        for name, p in self.named_parameters():
            out[name] = p.astype("float32").numpy()
        if self.expert_coord is not None:
            out["experts.w_down"] = out["experts.w_down"].reshape(self.local_experts, INNER, H)
        return out


def per_expert_orthogonalize(update, orthogonalize):
    """``split_concat_func`` of ``experts.w_down``: one block per expert."""
    experts = update.shape[0] // INNER
    blocks = update.reshape([experts, INNER, H])
    return orthogonalize(blocks).reshape(update.shape)


def make_optimizer(net: CheckpointNet, multi_precision: bool = False) -> Muon:
    """The Muon configuration of every checkpoint run."""
    params = list(net.parameters())
    info = {}
    for p in params:
        use_muon = len(p.shape) in (2, 3) and not any(x in p.name for x in EXCLUDE)
        split = per_expert_orthogonalize if p.name == "experts.w_down" else None
        info[p.name] = MuonParamInfo(use_muon=use_muon, split_concat_func=split)
    return Muon(learning_rate=LR, parameters=params, muon_param_info_map=info,
                multi_precision=multi_precision)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A cluster layout and the optimizer options of one run.

    Attributes:
        ep, ms: expert-parallel and moe_sharding degrees (ep == 1: no experts,
            plain sharding over ``ms`` ranks).
        gpn: GPUs per node; set -> comm_group_call_opt on.
        partition: owner partition rule (``"balanced"`` or ``"upstream_greedy"``).
        dense_dtype: dtype of the ``mlp`` parameters (bfloat16: master weights).
    """

    ep: int = 1
    ms: int = 2
    gpn: int | None = None
    partition: str = "balanced"
    dense_dtype: str = "float32"

    @property
    def world(self) -> int:
        return self.ep * self.ms

    def describe(self) -> str:
        extra = [f"gpn={self.gpn}"] if self.gpn else []
        extra += [self.partition, self.dense_dtype]
        return f"ep{self.ep}/ms{self.ms}(" + ",".join(extra) + ")"

    def strategy(self):
        strategy = make_hybrid_strategy(self.ep, self.ms, comm_buffer_size_MB=1)
        set_muon_sharding_options(
            strategy, use_muon_sharding=True, comm_group_call_opt=self.gpn is not None,
            partition_strategy=self.partition,
        )
        return strategy


def build_rank(layout: Layout, hcg) -> tuple[CheckpointNet, MuonShardingOptimizer]:
    """This rank's model and sharded optimizer for ``layout``."""
    coord = hcg.get_expert_parallel_rank() if layout.ep > 1 else None
    moe_group = hcg.get_moe_sharding_parallel_group() if layout.ep > 1 else None
    net = CheckpointNet(coord, layout.ep, moe_group, layout.dense_dtype)
    muon = make_optimizer(net, multi_precision=layout.dense_dtype != "float32")
    with local_size(layout.gpn):
        opt = MuonShardingOptimizer(muon, hcg, layout.strategy())
    return net, opt


def train(net: CheckpointNet, opt: MuonShardingOptimizer, hcg, first_step: int,
          steps: int) -> None:
    """Optimizer steps ``first_step ..`` on this rank's share of the batch."""
    shard = hcg.get_sharding_parallel_rank()
    shards = hcg.get_sharding_parallel_world_size()
    for step in range(first_step, first_step + steps):
        net.loss(step, shard, shards).backward()
        opt.reduce_gradients(list(net.parameters()), hcg)
        opt.step()
        opt.clear_grad()


def checkpoint_state(net: CheckpointNet, opt: MuonShardingOptimizer) -> dict:
    """What a training job saves and loads: model plus optimizer, one dict."""
    model = net.sharded_state_dict()
    state = dict(model)
    state.update(opt.sharded_state_dict(model))
    return state


def reference_states(dense_dtype: str, steps: int, with_experts: bool) -> tuple[dict, dict]:
    """Single-process full-batch run: (parameter values, optimizer states).

    Optimizer states are keyed like a sharded checkpoint (``<key>.<state>``),
    global shapes, fp32 numpy.
    """
    # fresh names: state keys end in _0 as in a new process
    with paddle.utils.unique_name.guard():
        net = CheckpointNet(0 if with_experts else None, 1, None, dense_dtype)
        opt = make_optimizer(net, multi_precision=dense_dtype != "float32")
        for step in range(steps):
            net.loss(step, 0, 1).backward()
            opt.step()
            opt.clear_grad()
        return net.values(), dict(opt_state_entries(net, opt))


def opt_state_entries(net: CheckpointNet, opt: Muon):
    """(checkpoint key, fp32 numpy) of every state of a plain Muon optimizer."""
    masters = opt._master_weights
    # accumulators are keyed on the parameter, master weight or not (develop)
    by_target = {p.name: (name, p) for name, p in net.named_parameters()}
    for acc_name, per_target in opt._accumulators.items():
        for target_name, var in per_target.items():
            key, p = by_target[target_name]
            state = var.name[len(target_name) + 1:]
            value = var.numpy().astype("float32")
            if state not in ("beta1_pow_acc_0", "beta2_pow_acc_0"):
                value = value.reshape(expert_shape(key, p.shape))
            yield f"{key}.{state}", value
    for name, p in net.named_parameters():
        if p.name in masters:
            yield f"{name}.w_0", masters[p.name].numpy().reshape(expert_shape(name, p.shape))


def expert_shape(key: str, shape) -> tuple:
    """The shape a checkpoint gives parameter ``key`` (w_down: 3-D)."""
    if key == "experts.w_down":
        return (int(np.prod(shape)) // (INNER * H), INNER, H)
    return tuple(shape)
