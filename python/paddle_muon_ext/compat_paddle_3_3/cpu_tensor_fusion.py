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
"""Let Paddle's FusedCommBuffer build its buffers on CPU (paddle 3.3.1).

tensor_fusion_helper.get_current_device_type() only knows gpu/npu/xpu and
asserts on a CPU place. Registering a CPU alignment and pinning the module's
device type to "cpu" before the first buffer is built is enough for REDUCE and
REDUCE_SCATTER buffers; pretending to be "gpu" is not (it allocates on a CUDA
place). Used by the CPU simulated world, the gloo tests and the CPU demo.
"""

from __future__ import annotations

import paddle
from paddle.distributed.fleet.utils import tensor_fusion_helper

from ..distributed.fleet.meta_optimizers.muon_sharding.settings import (
    DEFAULT_ALIGNMENT_BYTES as CPU_ALIGNMENT_BYTES,
)


def register_cpu_tensor_fusion() -> bool:
    """Register CPU with the tensor-fusion helper when running without accelerators.

    Returns:
        bool: True when CPU was (or already is) registered, False when an
        accelerator build is in use and nothing was changed.
    """
    if paddle.is_compiled_with_cuda() or paddle.is_compiled_with_xpu():
        return False
    tensor_fusion_helper.alignment.setdefault("cpu", CPU_ALIGNMENT_BYTES)
    tensor_fusion_helper.__current_device_type__ = "cpu"
    return True
