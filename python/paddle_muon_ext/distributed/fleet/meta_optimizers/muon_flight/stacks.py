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
"""The Python stacks in a flight-recorder dump: :func:`thread_stacks`.

Read with ``sys._current_frames()`` when a dump is written (nothing is
installed for it), bounded so that a dump stays small: the thread blocked in
a collective first, then the main thread, at most :data:`STACK_THREADS`
threads of :data:`STACK_FRAMES` innermost frames each.
"""

from __future__ import annotations

import sys
import threading
import traceback

__all__ = ["STACK_FRAMES", "STACK_FRAME_CHARS", "STACK_THREADS", "thread_stacks"]

#: Bounds of the Python stacks in a dump: innermost frames kept per thread,
#: threads kept, characters per frame (a dump stays small and a frame whose
#: source line is huge cannot bloat it).
STACK_FRAMES = 32
STACK_THREADS = 16
STACK_FRAME_CHARS = 400


def _raised_frames(error: BaseException) -> list[str] | None:
    """Where ``error`` was raised: the frames above the one that caught it,
    then its traceback down to the raise, outermost first; None without one."""
    tb = error.__traceback__
    if tb is None:
        return None
    outer = tb.tb_frame.f_back
    frames = traceback.format_stack(outer) if outer is not None else []
    return frames + traceback.format_tb(tb)


def thread_stacks(in_collective: int | None = None,
                  error: BaseException | None = None) -> list[dict]:
    """The Python stacks of this process's threads, bounded, as JSON-ready data.

    Read from ``sys._current_frames()`` (a snapshot; installs nothing). The
    thread in a collective comes first, then the main thread, then the rest;
    the watchdog's own thread is left out (its stack is this dump).

    Args:
        in_collective (int|None): ident of the thread blocked in a collective.
        error (BaseException|None): an exception the calling thread is
            handling (an exception hook, an ``except`` block): that thread's
            stack is where ``error`` was raised, not the dump's own frames.

    Returns:
        list[dict]: per thread ``thread`` (name), ``ident``, ``main``,
        ``in_collective`` and ``frames`` (``traceback.format_stack`` strings,
        outermost first, the innermost :data:`STACK_FRAMES` at most).
    """
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    here = threading.get_ident()
    stacks = []
    for ident, frame in sys._current_frames().items():
        if ident == here and names.get(ident) == "muon-flight-watchdog":
            continue
        raised = _raised_frames(error) if error is not None and ident == here else None
        # limit > 0 keeps the innermost frames (outermost first, as printed)
        frames = (raised[-STACK_FRAMES:] if raised is not None
                  else traceback.format_stack(frame, limit=STACK_FRAMES))
        stacks.append({
            "thread": names.get(ident),
            "ident": ident,
            "main": ident == main,
            "in_collective": ident == in_collective,
            "frames": [f if len(f) <= STACK_FRAME_CHARS else f[:STACK_FRAME_CHARS - 3] + "..."
                       for f in frames],
        })
    stacks.sort(key=lambda s: (not s["in_collective"], not s["main"]))
    return stacks[:STACK_THREADS]
