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

try:
    import paddle  # noqa: F401
except ImportError:  # pragma: no cover - exercised only without paddle
    raise ImportError(
        "paddle_muon_ext needs PaddlePaddle 3.3.x: install 'paddlepaddle-gpu' on GPU "
        "nodes, or 'pip install paddle_muon_ext[cpu]' for the CPU wheel."
    ) from None

from .compat_paddle_3_3 import (  # noqa: E402
    get_muon_sharding_options,
    patch_paddle,
    set_muon_sharding_options,
    unpatch_paddle,
)
from .compat_paddle_3_3.fleet_integration import distributed_optimizer  # noqa: E402
from .distributed.fleet.meta_optimizers.muon_sharding_optimizer import (  # noqa: E402
    MuonShardingOptimizer,
)
from .optimizer import Muon, MuonParamInfo  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "Muon",
    "MuonParamInfo",
    "MuonShardingOptimizer",
    "distributed_optimizer",
    "get_muon_sharding_options",
    "patch_paddle",
    "set_muon_sharding_options",
    "unpatch_paddle",
]
