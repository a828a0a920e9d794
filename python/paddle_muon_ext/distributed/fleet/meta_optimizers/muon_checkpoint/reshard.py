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
"""A runtime shim for loading checkpoints without a GPU: :func:`cpu_resharding`.

Paddle 3.3's flex_checkpoint resharding copies every tensor it sends or
receives with ``Tensor.cuda()``, which raises on a CPU-only build, so a
gloo job could not load a checkpoint saved under another layout. While
``load_sharded_checkpoint`` reads the shards - and only then, and only on a
build without a usable GPU - ``paddle.Tensor.cuda`` returns the tensor
itself. It is process-wide for that time (Paddle looks the method up on the
class), so it is reference-counted under a lock: concurrent or nested loads
install it once and the last one out puts back whatever ``Tensor.cuda`` was
before the first one came in (Paddle's method, or a user's own
replacement), also when the load raises. A GPU build is never touched.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import paddle

__all__ = ["cpu_resharding"]

_cuda_lock = threading.Lock()
_cuda_users = 0
_cuda_saved: list = []


def _stay_on_cpu(self, *args: Any, **kwargs: Any):
    return self


def _needs_cpu_resharding() -> bool:
    if not paddle.is_compiled_with_cuda():
        return True
    try:
        return paddle.device.cuda.device_count() == 0
    except Exception:  # noqa: BLE001 - no driver: no GPU either
        return True


@contextlib.contextmanager
def cpu_resharding():
    """Let flex_checkpoint's resharding run where there is no GPU.

    Paddle 3.3's resharding communicators copy every tensor they send or
    receive with ``Tensor.cuda()``, which raises on a CPU-only build; gloo
    communicates CPU tensors, so there the copy is the tensor itself. Only
    for the duration of this package's own load call, and only without a
    GPU, ``Tensor.cuda`` returns the tensor unchanged (the original is put
    back afterwards, also when the load raises). Elsewhere nothing changes.
    """
    global _cuda_users
    if not _needs_cpu_resharding():
        yield
        return
    with _cuda_lock:
        if _cuda_users == 0:
            _cuda_saved[:] = [paddle.Tensor.__dict__.get("cuda", None)]
            paddle.Tensor.cuda = _stay_on_cpu
        _cuda_users += 1
    try:
        yield
    finally:
        with _cuda_lock:
            _cuda_users -= 1
            if _cuda_users == 0:
                original = _cuda_saved.pop()
                if original is None:
                    del paddle.Tensor.cuda
                else:
                    paddle.Tensor.cuda = original
