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
"""Shared pieces of the one-process checkpoint suites: small state dicts, a
temp-directory test case with world size 1, and ``ThreadRanks`` (ranks run as
threads, with the rank lookup, gather and shard writer replaced by in-process
fakes)."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import unittest
from unittest import mock

import numpy as np

import paddle
from paddle.distributed.flex_checkpoint.dcp.metadata import (
    LocalTensorIndex,
    LocalTensorMetadata,
    Metadata,
)
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_checkpoint import (
    commit,
    common,
    load as load_mod,
    save as save_mod,
)

ROWS, COLS = 4, 6


def arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(size=(ROWS, COLS)).astype("float32"),
            "b": rng.normal(size=(COLS,)).astype("float32")}


def whole(values: dict[str, np.ndarray]) -> dict:
    """A one-rank sharded state dict holding ``values``."""
    return {k: ShardedWeight(k, paddle.to_tensor(v.copy()), v.shape, v.shape, (0,) * v.ndim)
            for k, v in values.items()}


def numpy_of(state: dict) -> dict[str, np.ndarray]:
    return {k: v.local_tensor.numpy() for k, v in state.items()}


class _Dir(unittest.TestCase):
    def setUp(self) -> None:
        self.root = tempfile.mkdtemp(prefix="muon_ckpt_atomic_")
        self.addCleanup(shutil.rmtree, self.root, True)
        # one process, world size 1, whatever an earlier suite cached
        env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_TRAINER")}
        for patcher in (mock.patch.dict(os.environ, env, clear=True),
                        mock.patch.object(paddle.distributed.parallel,
                                          "_global_parallel_env", None)):
            patcher.start()
            self.addCleanup(patcher.stop)


class _Killed(BaseException):
    """A rank's thread ends here, like a process killed mid-save."""


class ThreadRanks:
    """``n`` ranks as threads: fake rank lookup, gather and shard writer."""

    def __init__(self, n: int, root: str) -> None:
        self.n, self.root = n, root
        self.local = threading.local()
        self.barrier = threading.Barrier(n)
        self.slots: list = [None] * n
        self.faults: dict[int, object] = {}
        #: stands for Paddle's load_state_dict (replace it to plant a fault there)
        self.read = lambda *args, **kwargs: None

    def ranks(self, process_group):
        return self.local.rank, list(range(self.n))

    def gather(self, obj, process_group, ranks):
        self.slots[self.local.rank] = obj
        self.barrier.wait(timeout=30)
        out = list(self.slots)
        self.barrier.wait(timeout=30)
        return out

    def write(self, state_dict, directory, process_group, uid):
        rank = self.local.rank
        fault = self.faults.get(rank)
        if isinstance(fault, BaseException):
            raise fault
        paddle.save({k: v.local_tensor for k, v in state_dict.items()},
                    os.path.join(directory, f"{rank}_{uid}.distcp"))
        if rank == 0:
            state_meta, storage = {}, {}
            for key, sw in state_dict.items():
                state_meta[key] = [LocalTensorMetadata(sw.global_offset, sw.local_shape,
                                                       "float32", sw.global_shape)]
                for r in range(self.n):
                    storage[LocalTensorIndex(key, (r,))] = f"{r}_{uid}.distcp"
            paddle.save(Metadata(state_meta, storage, {}),
                        os.path.join(directory, f"{uid}.metadata"))

    def run(self, body) -> dict:
        results: dict[int, object] = {}

        def main(rank: int) -> None:
            self.local.rank = rank
            try:
                results[rank] = body(rank)
            except _Killed:
                results[rank] = "killed"
            except Exception as exc:  # noqa: BLE001 - the outcome under test
                results[rank] = exc

        with mock.patch.object(common, "ranks_of", self.ranks), \
                mock.patch.object(common, "gather", self.gather), \
                mock.patch.object(save_mod, "_write_shards", self.write), \
                mock.patch.object(load_mod, "_read_shards", self.read), \
                mock.patch.object(commit, "HEARTBEAT_S", 0.05), \
                mock.patch.object(commit, "ACK_WAIT_S", 1.0):
            threads = [threading.Thread(target=main, args=(r,)) for r in range(self.n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        return results
