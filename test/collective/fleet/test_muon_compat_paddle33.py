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
# paddle_muon_ext: compat-only  (tests of compat_paddle_3_3; not exported)
"""The paddle 3.3.1 shims: strategy options, CPU tensor fusion, fleet integration.

The fleet path is what users call (``distributed_optimizer``): it must give a
HybridParallelOptimizer around MuonShardingOptimizer whose training equals the
single-process reference, work with AMP's GradScaler, and leave Paddle's
modules exactly as they were.
"""

from __future__ import annotations

import copy
import types

import numpy as np
import paddle
import pytest
from paddle.distributed import fleet
from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer import (
    hybrid_parallel_optimizer as hpo,
)
from paddle.distributed.fleet.utils import tensor_fusion_helper

from muon_sim_runner import SimConfig, max_abs_diff, reference_values, run_world
from muon_tiny_moe import TinyMoE, batch, make_muon

from paddle_muon_ext.compat_paddle_3_3 import (
    MuonShardingOptions,
    get_muon_sharding_options,
    register_cpu_tensor_fusion,
    set_muon_sharding_options,
)
from paddle_muon_ext.compat_paddle_3_3 import fleet_integration as fi


# --------------------------------------------------------------- options
def test_options_default_and_roundtrip_survive_deepcopy():
    strategy = fleet.DistributedStrategy()
    assert get_muon_sharding_options(strategy) == MuonShardingOptions()
    set_muon_sharding_options(strategy, use_muon_sharding=True)
    set_muon_sharding_options(strategy, comm_group_call_opt=True)
    expected = MuonShardingOptions(use_muon_sharding=True, comm_group_call_opt=True)
    assert get_muon_sharding_options(strategy) == expected, "a second call must keep the first"
    # fleet.init / distributed_optimizer deep-copy the user's strategy
    assert get_muon_sharding_options(copy.deepcopy(strategy)) == expected
    assert get_muon_sharding_options(None) == MuonShardingOptions()


@pytest.mark.parametrize(
    "kwargs, exc, fragment",
    [
        ({"comm_group_call_opt": 1}, TypeError, "must be a bool"),
        ({"partition_strategy": "random"}, ValueError, "partition_strategy='random'"),
        ({"comm_grup_call_opt": True}, TypeError, "unknown Muon sharding option"),
    ],
)
def test_options_reject_bad_values(kwargs, exc, fragment):
    with pytest.raises(exc, match=fragment):
        set_muon_sharding_options(fleet.DistributedStrategy(), **kwargs)


def test_proto_field_wins_where_paddle_has_it():
    """On a Paddle whose sharding_configs proto has the field, it is honoured."""

    class Configs:
        DESCRIPTOR = types.SimpleNamespace(fields_by_name={"comm_group_call_opt": None})
        comm_group_call_opt = False

    class Strategy:
        hybrid_configs = {"sharding_configs": Configs()}

    strategy = Strategy()
    set_muon_sharding_options(strategy, comm_group_call_opt=True)
    assert strategy.hybrid_configs["sharding_configs"].comm_group_call_opt is True
    strategy.hybrid_configs["sharding_configs"].comm_group_call_opt = False
    assert get_muon_sharding_options(strategy).comm_group_call_opt is False


# ------------------------------------------------------ CPU tensor fusion
def test_cpu_tensor_fusion_registration(monkeypatch):
    monkeypatch.setattr(tensor_fusion_helper, "__current_device_type__", None)
    monkeypatch.setattr(tensor_fusion_helper, "alignment", dict(tensor_fusion_helper.alignment))
    assert register_cpu_tensor_fusion() is True
    assert tensor_fusion_helper.get_current_device_type() == "cpu"
    assert tensor_fusion_helper.alignment["cpu"] == 256
    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    monkeypatch.setattr(tensor_fusion_helper, "__current_device_type__", None)
    assert register_cpu_tensor_fusion() is False
    assert tensor_fusion_helper.__current_device_type__ is None, "left a GPU build alone"


# -------------------------------------------------------- fleet integration
def _fleet_body(use_amp: bool):
    def body(cfg: SimConfig, strategy):
        hcg = fleet.get_hybrid_communicate_group()
        coord = hcg.get_expert_parallel_rank()
        net = TinyMoE(coord, hcg.get_moe_sharding_parallel_group())
        fleet_env = fleet.fleet
        fleet_env.worker_num = lambda: cfg.world  # the harness has no launcher env
        fleet_env._hcg = hcg
        opt = fi.distributed_optimizer(make_muon(list(net.parameters())))
        assert isinstance(opt, fi.MuonHybridParallelOptimizer)
        scaler = None
        if use_amp:
            # On CPU places Paddle disables loss scaling itself, so this checks
            # the scaler.minimize -> HybridParallelOptimizer.minimize ->
            # reduce + MuonShardingOptimizer.minimize flow, not the unscaling.
            scaler = fleet.distributed_scaler(paddle.amp.GradScaler(init_loss_scaling=1024.0))
        rank = paddle.distributed.get_rank()
        for step in range(cfg.steps):
            loss = net(paddle.to_tensor(batch(step, rank)))
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaled = scaler.scale(loss)
                scaled.backward()
                scaler.minimize(opt, scaled)
            opt.clear_grad()
        return rank, coord, net.named_values()

    return body


@pytest.mark.parametrize("use_amp", [False, True], ids=["plain", "grad_scaler_minimize_path"])
def test_distributed_optimizer_trains_like_the_reference(monkeypatch, use_amp):
    monkeypatch.setattr(fleet.fleet, "worker_num", fleet.fleet.worker_num, raising=False)
    cfg = SimConfig(ep=2, ms=2, steps=2)
    originals = (hpo.DygraphShardingOptimizer, hpo.DygraphShardingOptimizerV2)
    results, _ = run_world(cfg, body=_fleet_body(use_amp))
    expected = reference_values(cfg)
    for rank, coord, values in results:
        diff = max_abs_diff(values, expected[rank])
        assert diff <= 1e-5, f"rank {rank}: {diff:.3e} from the reference (amp={use_amp})"
    assert (hpo.DygraphShardingOptimizer, hpo.DygraphShardingOptimizerV2) == originals, (
        "the scoped patch of HybridParallelOptimizer's sharding classes leaked"
    )


def test_distributed_optimizer_defers_to_fleet_without_muon_sharding(monkeypatch):
    sentinel = object()
    calls = []
    monkeypatch.setattr(fleet, "distributed_optimizer",
                        lambda opt, strategy=None: calls.append(opt) or sentinel)
    strategy = fleet.DistributedStrategy()
    optimizer = object()
    assert fi.distributed_optimizer(optimizer, strategy) is sentinel
    assert calls == [optimizer]


def test_found_inf_skips_the_update():
    cfg = SimConfig(ep=2, ms=2, steps=1)

    def body(cfg, strategy):
        from muon_sim_runner import build_rank, sharded_core

        hcg, net, opt, coord = build_rank(cfg, strategy)
        before = net.named_values()
        net(paddle.to_tensor(batch(0, paddle.distributed.get_rank()))).backward()
        core = sharded_core(opt)
        core.reduce_gradients(list(net.parameters()), hcg)
        core._inner_opt._set_auxiliary_var("found_inf", paddle.to_tensor(True))
        core.step()
        after = net.named_values()
        return all(np.array_equal(before[k], after[k]) for k in before)

    results, _ = run_world(cfg, body=body)
    assert all(results), "an overflowing step must leave every parameter unchanged"
