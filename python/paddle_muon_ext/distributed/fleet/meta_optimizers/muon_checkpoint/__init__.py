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
"""Checkpoints that never lose a run: atomic saves, verified loads.

``paddle.distributed.save_state_dict`` writes shards in place (into a
directory that already holds a checkpoint too, keeping the old metadata) and
``load_state_dict`` reads whatever overlaps; a failed or partial save is
indistinguishable from a good one. Here:

* :func:`save_sharded_checkpoint` writes a new ``checkpoint_<id>`` beside the
  previous ones, all-or-nothing: every rank writes into a fresh temporary
  directory, the completion marker (per-file sizes and SHA-256, layout
  summary) is written only after every rank reported success, and one rename
  commits. A failure on any rank (exception, full disk, a killed rank) leaves
  every previous checkpoint untouched and raises the same
  :class:`CheckpointSaveError` on every rank (after at most ``timeout_s``
  when a rank died). ``keep_last`` removes older checkpoints after a commit.
* :func:`load_sharded_checkpoint` verifies the marker, the sizes, the
  checksums (spread over the ranks) and the layout before any tensor is read,
  and refuses a checkpoint of another model (:class:`CheckpointMismatchError`);
  a problem is one error on every rank, naming the file.
* :func:`latest_complete_checkpoint` finds the newest committed checkpoint;
  :func:`latest_complete_checkpoint_and_id` also returns its id (the step,
  when saved with ``unique_id=step``).

Both calls exchange what each rank found before any rank raises, so a
problem on one rank (no checkpoint at its path, another path, a bad
argument) is one error on every rank at once, never a wait for a timeout.
The next save removes what killed saves left
(:data:`~.save.STALE_SAVE_S`).

``path`` must be on a file system every rank of the save sees: once the
shards are being written the ranks agree through files there, so a rank that
dies while writing cannot hang the others. Before that, two small all_gathers
and Paddle's metadata exchange are ordinary collectives (a rank dead there
is noticed after the process group's timeout, as anywhere else).

Where the code lives (one module per concern; this one is the public API):

* ``save``: saving, the commit and the clean-up of old saves;
* ``commit``: the checkpoint's files and the file handshake
  that commits a save;
* ``load`` and ``verify``: loading, and what
  each rank checks before a tensor is read; ``load_guard``:
  the ranks agree on the outcome of Paddle's own load;
* ``listing``: which checkpoints are complete;
* ``reshard``: the CPU-only resharding shim of the load;
* ``common``: the errors, argument checks and the exchange.
"""

from __future__ import annotations

from .common import (
    CheckpointCorruptError,
    CheckpointLoadError,
    CheckpointMismatchError,
    CheckpointSaveError,
)
from .listing import latest_complete_checkpoint, latest_complete_checkpoint_and_id
from .load import load_sharded_checkpoint
from .save import save_sharded_checkpoint

__all__ = [
    "CheckpointCorruptError",
    "CheckpointLoadError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "latest_complete_checkpoint",
    "latest_complete_checkpoint_and_id",
    "load_sharded_checkpoint",
    "save_sharded_checkpoint",
]
