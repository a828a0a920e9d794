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
"""Worker: the checkpoint fault matrix on 2 gloo ranks, one launch.

Launched by ``test_muon_checkpoint_faults.py``; argv[1] is the checkpoint
directory. A good checkpoint ``checkpoint_0`` of model A is saved first;
then each fault runs in turn, and after each one every rank records what it
raised and whether ``checkpoint_0`` still loads bit-exact. Every outcome is
printed as ``FAULT {json}``; the test asserts on them.

Faults: a full disk on rank 1 (an injected ``OSError(ENOSPC)`` after half the
shard is written), then the previous checkpoint reloaded where each rank
needs the other's shard (Paddle's resharding; no test-side patch of Paddle:
this is what a user's script does), a rank that finds no checkpoint, ranks
saving into different paths, float64 / float16 targets of a float32
checkpoint, a different model B saved into the same directory, a truncated,
a grown shard, a flipped byte in a shard and in the metadata, a symlink to
another id, a real full disk (argv[2]: a small tmpfs, when the test could
mount one; then the previous checkpoint reloaded while that disk stays
full), and last a rank killed while writing its shard (rank 1 exits;
rank 0 must fail within the heartbeat timeout).

With ``FAULT_CASE=rank_killed_inside_load`` it runs only that case, in a
launch of its own: rank 1 is SIGKILLed while Paddle's ``load_state_dict``
reads its shard (it runs as a child of the launched process, which exits 0:
the launcher would stop rank 0 on a non-zero exit); rank 0 must name rank 1.

With ``FAULT_CASE=load_fails_inside_paddle`` it runs only that case, in a
launch of its own (it leaves rank 0's read blocked in Paddle's collectives, so
nothing can follow it): rank 1 cannot read its shard inside Paddle's
``load_state_dict`` (after every check passed) and stays alive until rank 0
reported, so rank 0's error cannot come from rank 1's exit.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import sys
import time

if (os.environ.get("FAULT_CASE") == "rank_killed_inside_load"
        and os.environ.get("PADDLE_TRAINER_ID") == "1"
        and not os.environ.get("FAULT_KILLED_CHILD")):
    # before Paddle is imported: this launched process only waits for the rank
    # it starts (the one that is killed) and exits 0
    import subprocess

    _code = subprocess.call([sys.executable, *sys.argv],
                            env=dict(os.environ, FAULT_KILLED_CHILD="1"))
    print(f"FAULT_CHILD_EXIT {_code}", flush=True)
    os._exit(0)

import numpy as np

import paddle
import paddle.distributed as dist
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

from gloo_compat import install_gloo_compat  # noqa: E402
from muon_test_compat import register_cpu_tensor_fusion  # noqa: E402

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_checkpoint import (  # noqa: E402
    CheckpointCorruptError,
    CheckpointLoadError,
    CheckpointMismatchError,
    CheckpointSaveError,
    latest_complete_checkpoint,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)

ROWS, COLS = 8, 16
#: Heartbeat timeout of the killed-rank save (the default is 30 s).
KILL_TIMEOUT_S = 4.0


def values(model: str, version: int) -> dict[str, np.ndarray]:
    """Global arrays of ``model`` ("A" or "B") at ``version``."""
    rng = np.random.default_rng(1000 * version + ord(model))
    if model == "A":
        return {"w": rng.normal(size=(ROWS, COLS)).astype("float32"),
                "b": rng.normal(size=(COLS,)).astype("float32")}
    return {"w": rng.normal(size=(ROWS, 2 * COLS)).astype("float32"),
            "other": rng.normal(size=(3,)).astype("float32")}


def state(arrays: dict[str, np.ndarray]) -> dict:
    """This rank's sharded state dict: ``w`` split by rows, the rest replicated."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for key, full in arrays.items():
        if key == "w":
            rows = full.shape[0] // world
            local = paddle.to_tensor(full[rank * rows:(rank + 1) * rows].copy())
            out[key] = ShardedWeight(key, local, tuple(local.shape), full.shape,
                                     (rank * rows, 0))
        else:
            local = paddle.to_tensor(full.copy())
            out[key] = ShardedWeight(key, local, full.shape, full.shape, (0,) * full.ndim)
    return out


def read_back(sd: dict) -> dict[str, np.ndarray]:
    return {k: v.local_tensor.numpy() for k, v in sd.items()}


def expected_local(arrays: dict) -> dict[str, np.ndarray]:
    return read_back(state(arrays))


def zeros_like(arrays: dict, dtype: str | None = None) -> dict:
    return state({k: np.zeros_like(v, dtype=dtype) for k, v in arrays.items()})


def swapped(arrays: dict) -> dict:
    """Rank r's target holds the rows rank 1 - r saved (2 ranks): loading it
    needs the other rank's shard, i.e. flex_checkpoint's resharding."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = ROWS // world
    other = world - 1 - rank
    out = {}
    for key, full in arrays.items():
        if key == "w":
            local = paddle.to_tensor(np.zeros((rows, full.shape[1]), full.dtype))
            out[key] = ShardedWeight(key, local, tuple(local.shape), full.shape,
                                     (other * rows, 0))
        else:
            local = paddle.to_tensor(np.zeros_like(full))
            out[key] = ShardedWeight(key, local, full.shape, full.shape, (0,) * full.ndim)
    return out


def tree_hash(directory: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def leftover_files(root: str) -> list[str]:
    """Files under uncommitted (hidden) directories, outside their ``.status``."""
    out = []
    for name in os.listdir(root):
        if name.startswith("."):
            for sub in os.listdir(os.path.join(root, name)):
                if sub != ".status":
                    out.append(f"{name}/{sub}")
    return sorted(out)


def report(fault: str, **fields) -> None:
    print("FAULT " + json.dumps(dict(fault=fault, rank=dist.get_rank(), **fields)), flush=True)


def attempt(call) -> dict:
    t0 = time.time()
    try:
        call()
    except (CheckpointSaveError, CheckpointCorruptError, CheckpointMismatchError,
            CheckpointLoadError, FileExistsError, FileNotFoundError, ValueError) as exc:
        return {"error": type(exc).__name__, "message": str(exc),
                "seconds": time.time() - t0}
    return {"error": None, "message": "", "seconds": time.time() - t0}


def previous_intact(root: str, good_hash: dict) -> dict:
    """Does checkpoint_0 hold the same bytes and load bit-exact?"""
    first = os.path.join(root, "checkpoint_0")
    same_bytes = tree_hash(first) == good_hash
    target = zeros_like(values("A", 0))
    load_sharded_checkpoint(target, root, unique_id=0)
    got, want = read_back(target), expected_local(values("A", 0))
    exact = all(np.array_equal(got[k], want[k]) for k in want)
    return {"same_bytes": same_bytes, "bit_exact": exact}


def corrupt(path: str, how: str) -> None:
    with open(path, "rb") as f:
        data = bytearray(f.read())
    if how == "truncate":
        data = data[: len(data) // 2]
    elif how == "grow":
        data += b"\0" * 64
    else:
        data[len(data) // 2] ^= 0x10
    with open(path, "wb") as f:
        f.write(bytes(data))


def load_fails_inside_paddle(root: str) -> None:
    """Rank 1's shard unreadable inside Paddle's load; rank 1 lives on meanwhile."""
    rank = dist.get_rank()
    directory = save_sharded_checkpoint(state(values("A", 0)), root)
    real_load = paddle.load

    def unreadable(path, *args, **kwargs):
        if str(path).endswith(".distcp"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real_load(path, *args, **kwargs)

    if rank == 1:
        paddle.load = unreadable
    outcome = attempt(lambda: load_sharded_checkpoint(zeros_like(values("A", 0)), root))
    paddle.load = real_load
    reported = os.path.join(root, f"reported_{rank}")
    report("load_fails_inside_paddle", directory=directory, **outcome)
    open(reported, "w").close()
    if rank == 1:  # alive until rank 0 reported: its error is not rank 1's exit
        deadline = time.time() + 60
        while not os.path.exists(os.path.join(root, "reported_0")) and time.time() < deadline:
            time.sleep(0.05)
    sys.stdout.flush()
    os._exit(0)  # rank 0's read is still blocked in Paddle's collectives


def rank_killed_inside_load(root: str) -> None:
    """Rank 1 SIGKILLed while Paddle's load reads its shard; rank 0 reports."""
    rank = dist.get_rank()
    directory = save_sharded_checkpoint(state(values("A", 0)), root)
    real_load = paddle.load

    def killed(path, *args, **kwargs):
        if str(path).endswith(".distcp"):
            print(f"FAULT_KILLING pid={os.getpid()}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_load(path, *args, **kwargs)

    if rank == 1:
        paddle.load = killed
    # each rank needs the other's rows: rank 0 waits on rank 1 inside Paddle's load
    outcome = attempt(lambda: load_sharded_checkpoint(swapped(values("A", 0)), root))
    report("rank_killed_inside_load", directory=directory, **outcome,
           left=sorted(n for n in os.listdir(root) if n.startswith(".muon_load-")))
    os._exit(0)  # rank 0's read may still be blocked on the dead peer


def main() -> None:
    install_gloo_compat()
    register_cpu_tensor_fusion()  # the optimizer's fused buffers on CPU: an explicit opt-in
    dist.init_parallel_env()
    root = sys.argv[1]
    if os.environ.get("FAULT_CASE") == "load_fails_inside_paddle":
        load_fails_inside_paddle(root)
    if os.environ.get("FAULT_CASE") == "rank_killed_inside_load":
        rank_killed_inside_load(root)
    original_cuda = paddle.Tensor.cuda
    rank = dist.get_rank()
    real_save = paddle.save

    save_sharded_checkpoint(state(values("A", 0)), root)
    dist.barrier()
    good_hash = tree_hash(os.path.join(root, "checkpoint_0"))

    # 1. full disk on rank 1: half its shard written, then ENOSPC
    def full_disk(obj, path, *args, **kwargs):
        if path.endswith(".distcp"):
            with open(path, "wb") as f:
                f.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real_save(obj, path, *args, **kwargs)

    if rank == 1:
        paddle.save = full_disk
    outcome = attempt(lambda: save_sharded_checkpoint(state(values("A", 1)), root))
    paddle.save = real_save
    dist.barrier()
    report("enospc", **outcome, **previous_intact(root, good_hash),
           listing=sorted(os.listdir(root)), left=leftover_files(root),
           latest=os.path.basename(latest_complete_checkpoint(root) or ""))

    # 1b. the previous checkpoint after the failed save, each rank reading
    #     the other's rows (Paddle's resharding, on CPU tensors)
    target = swapped(values("A", 0))
    outcome = attempt(lambda: load_sharded_checkpoint(target, root, unique_id=0))
    got, full = read_back(target), values("A", 0)
    rows = ROWS // dist.get_world_size()
    other = dist.get_world_size() - 1 - rank
    want = {"w": full["w"][other * rows:(other + 1) * rows], "b": full["b"]}
    report("reload_resharded", **outcome,
           bit_exact=outcome["error"] is None and all(
               np.array_equal(got[k], want[k]) for k in want),
           cuda_restored=paddle.Tensor.cuda is original_cuda)

    # 1c. a rank that finds no checkpoint: every rank fails at once
    nowhere = os.path.join(root, "not_saved_here") if rank == 1 else root
    report("missing_on_one_rank", path=nowhere, **attempt(
        lambda: load_sharded_checkpoint(zeros_like(values("A", 0)), nowhere)))

    # 1d. ranks saving into different paths: refused at once, naming both
    elsewhere = root + "_elsewhere" if rank == 1 else root
    before = sorted(os.listdir(root))
    dist.barrier()  # both listed before the coordinator claims a directory
    outcome = attempt(lambda: save_sharded_checkpoint(state(values("A", 1)), elsewhere))
    dist.barrier()
    report("different_save_paths", path=os.path.abspath(elsewhere), **outcome,
           root_unchanged=sorted(os.listdir(root)) == before,
           elsewhere_created=os.path.exists(root + "_elsewhere"))

    # 1e. float64 / float16 targets of the float32 checkpoint
    for dtype in ("float64", "float16"):
        report(f"{dtype}_target", **attempt(lambda: load_sharded_checkpoint(
            zeros_like(values("A", 0), dtype), root, unique_id=0)))

    # 1f. checkpoint_99 a symlink to checkpoint_0
    link = os.path.join(root, "checkpoint_99")
    if rank == 0:
        os.symlink(os.path.join(root, "checkpoint_0"), link)
    dist.barrier()
    outcome = attempt(lambda: load_sharded_checkpoint(
        zeros_like(values("A", 0)), root, unique_id=99))
    dist.barrier()
    if rank == 0:
        os.remove(link)
    report("symlink_to_another_id", link=link, **outcome)

    # 2. a different model saved into the same directory
    saved_b = save_sharded_checkpoint(state(values("B", 0)), root)
    wrong = attempt(lambda: load_sharded_checkpoint(zeros_like(values("A", 0)), root))
    target_b = zeros_like(values("B", 0))
    load_sharded_checkpoint(target_b, root)
    got_b, want_b = read_back(target_b), expected_local(values("B", 0))
    report("other_model", saved=os.path.basename(saved_b), **wrong,
           listing=sorted(os.listdir(root)),
           b_exact=all(np.array_equal(got_b[k], want_b[k]) for k in want_b),
           **previous_intact(root, good_hash))

    # 3.-5. damage a fresh checkpoint of A after its commit
    for fault, victim, how in (("truncated_shard", "1_{id}.distcp", "truncate"),
                               ("grown_shard", "0_{id}.distcp", "grow"),
                               ("flipped_shard_byte", "0_{id}.distcp", "flip"),
                               ("flipped_metadata_byte", "{id}.metadata", "flip")):
        directory = save_sharded_checkpoint(state(values("A", 2)), root)
        uid = int(directory.rsplit("_", 1)[1])
        name = victim.format(id=uid)
        dist.barrier()
        if rank == 0:
            corrupt(os.path.join(directory, name), how)
        dist.barrier()
        outcome = attempt(lambda: load_sharded_checkpoint(
            zeros_like(values("A", 2)), root, unique_id=uid))
        report(fault, file=name, **outcome, **previous_intact(root, good_hash))

    # 6. a real full disk (a 256 KiB tmpfs the test mounted, where allowed)
    if len(sys.argv) > 2 and sys.argv[2]:
        disk = sys.argv[2]
        save_sharded_checkpoint(state(values("A", 0)), disk)
        dist.barrier()
        disk_hash = tree_hash(os.path.join(disk, "checkpoint_0"))
        big = state(dict(values("A", 4), w=np.ones((ROWS, 20000), "float32")))  # 640 KB
        outcome = attempt(lambda: save_sharded_checkpoint(big, disk))
        dist.barrier()
        report("real_full_disk", **outcome, **previous_intact(disk, disk_hash),
               left=leftover_files(disk))
        # 6b. the disk stays full (another writer filled it): the previous
        # checkpoint still reloads (the load's agreement needs no new block)
        filler = os.path.join(disk, "filler")
        if dist.get_rank() == 0:
            try:
                with open(filler, "wb") as f:
                    while True:
                        f.write(b"\0" * 4096)
                        f.flush()
            except OSError:
                pass
        dist.barrier()
        target = zeros_like(values("A", 0))
        outcome = attempt(lambda: load_sharded_checkpoint(target, disk, unique_id=0))
        got, want = read_back(target), expected_local(values("A", 0))
        exact = outcome["error"] is None and all(np.array_equal(got[k], want[k]) for k in want)
        dist.barrier()
        if dist.get_rank() == 0:
            os.remove(filler)
        report("reload_on_full_disk", **outcome, bit_exact=exact, left=leftover_files(disk))

    # 7. rank 1 killed while writing its shard (last: it leaves the job)
    dist.barrier()
    last_before = sorted(os.listdir(root))

    def killed(obj, path, *args, **kwargs):
        if path.endswith(".distcp"):
            with open(path, "wb") as f:
                f.write(b"\0" * 100)
            os._exit(0)  # a non-zero exit would make the launcher stop rank 0
        return real_save(obj, path, *args, **kwargs)

    if rank == 1:
        paddle.save = killed
    outcome = attempt(lambda: save_sharded_checkpoint(state(values("A", 3)), root,
                                                      timeout_s=KILL_TIMEOUT_S))
    paddle.save = real_save
    first = os.path.join(root, "checkpoint_0")
    report("killed_rank", **outcome, timeout_s=KILL_TIMEOUT_S,
           same_bytes=tree_hash(first) == good_hash,
           new_complete=sorted(set(n for n in os.listdir(root) if not n.startswith("."))
                               - set(last_before)))
    os._exit(0)  # no destroy handshake with the dead peer


if __name__ == "__main__":
    main()
