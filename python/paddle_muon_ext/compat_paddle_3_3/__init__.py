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
"""Shims that let paddle_muon_ext run on the stock paddlepaddle 3.3.x wheel.

Everything paddle 3.3.1 lacks (``paddle.optimizer.Muon``, the
``muon_sharding_optimizer`` module, ``strategy.use_muon_sharding``, the
``comm_group_call_opt`` / ``muon_partition_strategy`` sharding_configs
fields, a CPU entry in the tensor-fusion device table, a
HybridParallelOptimizer that accepts a Muon sharding optimizer) lives in
this package and nowhere else, so tools/export_upstream_patch.py drops it
whole when the code is exported into Paddle itself. ``patch_paddle()``
installs all of it under develop's names, and on a launched gloo (CPU) job
also the collectives gloo lacks (``distributed/fleet/utils/gloo_compat.py``,
which is exported: Paddle's CPU tests need it too).
"""

from .strategy_options import (  # noqa: F401
    MuonShardingOptions,
    get_muon_sharding_options,
    set_muon_sharding_options,
)
from .cpu_tensor_fusion import register_cpu_tensor_fusion  # noqa: F401
from .patch import is_patched, patch_paddle, unpatch_paddle  # noqa: F401
