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
"""Sharded Muon for PaddlePaddle: Muon, MuonShardingOptimizer and the
hierarchical (comm_group_call_opt) communication path for EP across nodes.

On paddle 3.3.x call ``paddle_muon_ext.patch_paddle()`` once, before the
training script imports Muon; from then on code written for Paddle develop
(``paddle.optimizer.Muon``, ``strategy.use_muon_sharding``,
``fleet.distributed_optimizer``) runs unchanged."""

import importlib
import importlib.util


def _paddle_missing() -> bool:
    try:
        return importlib.util.find_spec("paddle") is None
    except (ImportError, ValueError):  # a broken or blocked paddle entry
        return True


# Without Paddle the package still imports, so that ``paddle-muon-ext --help``
# works anywhere; the first name that needs Paddle raises this message.
_NEEDS_PADDLE = ("paddle_muon_ext needs PaddlePaddle 3.3.x: install 'paddlepaddle-gpu' on GPU "
                 "nodes, or 'pip install paddle_muon_ext[cpu]' for the CPU wheel.")
_CHECKPOINT = ".distributed.fleet.meta_optimizers.muon_checkpoint"
# Importing paddle takes seconds: the names below load on first use, so the
# command-line tools answer a bad argument before paddle is imported.
_LAZY = {
    "get_muon_sharding_options": ".compat_paddle_3_3",
    "patch_paddle": ".compat_paddle_3_3",
    "set_muon_sharding_options": ".compat_paddle_3_3",
    "unpatch_paddle": ".compat_paddle_3_3",
    "distributed_optimizer": ".compat_paddle_3_3.fleet_integration",
    "MuonShardingOptimizer": ".distributed.fleet.meta_optimizers.muon_sharding_optimizer",
    "expert_sharded_state_dict": ".distributed.flex_checkpoint.dcp.expert_sharded_weight",
    "Muon": ".optimizer",
    # checkpoints (muon_checkpoint: atomic saves, verified loads)
    "CheckpointCorruptError": _CHECKPOINT,
    "CheckpointLoadError": _CHECKPOINT,
    "CheckpointMismatchError": _CHECKPOINT,
    "CheckpointSaveError": _CHECKPOINT,
    "latest_complete_checkpoint": _CHECKPOINT,
    "load_sharded_checkpoint": _CHECKPOINT,
    "save_sharded_checkpoint": _CHECKPOINT,
    "MuonParamInfo": ".optimizer",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'paddle_muon_ext' has no attribute {name!r}")
    if _paddle_missing():
        raise ImportError(_NEEDS_PADDLE, name="paddle")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))


__version__ = "0.1.0"
__all__ = [
    "CheckpointCorruptError",
    "CheckpointLoadError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "Muon",
    "MuonParamInfo",
    "MuonShardingOptimizer",
    "distributed_optimizer",
    "expert_sharded_state_dict",
    "get_muon_sharding_options",
    "latest_complete_checkpoint",
    "load_sharded_checkpoint",
    "patch_paddle",
    "save_sharded_checkpoint",
    "set_muon_sharding_options",
    "unpatch_paddle",
]
