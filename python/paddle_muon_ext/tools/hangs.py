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
"""``paddle-muon-ext hangs LOG_DIR``: who the ranks of a hung job wait for.

Reads every ``muon_flight_rank<R>.json`` the Muon sharding optimizer's flight
recorder dumped into LOG_DIR (the launcher's ``--log_dir``, or
``PADDLE_MUON_FLIGHT_DIR``), prints one line per rank (why it dumped, its
phase, the collective it is in) and then names the rank(s) the others wait
for and the collective they are stuck before. Exit 0 with a report, 2 on bad
input (``error: ...``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Sequence

from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_flight_recorder import (
    DUMP_FORMAT,
    DUMP_PREFIX,
    RankState,
    describe_collective,
    diagnose,
)

__all__ = ["load_dumps", "report", "main"]

#: Dumps of one hang are written within seconds of each other (a timed-out
#: rank asks the others); a wider spread means files from another job.
STALE_SPREAD_S = 300.0


class DumpError(ValueError):
    """A dump directory or file that cannot be read; the message is the error line."""


def load_dumps(log_dir: str) -> dict[int, dict]:
    """Read every rank's dump in ``log_dir``.

    Args:
        log_dir (str): the directory the ranks dumped into.

    Returns:
        dict: rank -> the dump's data.

    Raises:
        DumpError: missing directory, no dumps, or an unreadable dump.
    """
    if not os.path.isdir(log_dir):
        raise DumpError(f"log dir {log_dir!r}: not a directory, pass the launcher's --log_dir "
                        "(or PADDLE_MUON_FLIGHT_DIR) of the hung job")
    paths = sorted(glob.glob(os.path.join(log_dir, f"{DUMP_PREFIX}*.json")))
    if not paths:
        raise DumpError(
            f"log dir {log_dir!r}: no {DUMP_PREFIX}<R>.json dumps; ranks dump when a collective "
            "raises and, once armed (launch with PADDLE_MUON_FLIGHT_RECORDER_ARM=1), on a "
            "collective timeout, an uncaught exception or SIGUSR1 (kill -USR1 <pid> on every rank)")
    dumps: dict[int, dict] = {}
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
            if data.get("format") != DUMP_FORMAT:
                raise ValueError(f"format {data.get('format')!r} is not {DUMP_FORMAT!r}")
            dumps[int(data["rank"])] = data
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise DumpError(f"dump {path!r}: unreadable ({exc}), remove it or re-dump "
                            "that rank with SIGUSR1") from exc
    return dumps


def report(dumps: dict[int, dict]) -> list[str]:
    """Per-rank lines followed by :func:`diagnose`'s verdict.

    Args:
        dumps (dict): rank -> dump data, as :func:`load_dumps` returns.

    Returns:
        list[str]: the report lines.
    """
    world = max([int(d.get("world_size") or 0) for d in dumps.values()] + [0])
    lines = [f"flight recorder dumps: {len(dumps)} rank(s)"
             + (f" of {world}" if world else "")]
    states = {}
    for rank, data in sorted(dumps.items()):
        state = RankState.from_dump(data)
        states[rank] = state
        where = (f"in {describe_collective(state.in_flight[0])}" if state.in_flight
                 else "outside any collective")
        lines.append(f"  rank {rank} (pid {data.get('pid')}, {data.get('host')}): "
                     f"phase {state.phase!r}, {where}; dumped on: {data.get('reason')}")
    times = [float(d.get("time") or 0.0) for d in dumps.values()]
    if max(times) - min(times) > STALE_SPREAD_S:
        lines.append(f"  note: the dumps were written {max(times) - min(times):.0f} s apart; "
                     "remove dumps left by an earlier job from the log dir")
    lines.extend(diagnose(states, world or None))
    return lines


def main(argv: Sequence[str] | None = None, prog: str = "paddle-muon-ext hangs") -> int:
    """Entry point of ``paddle-muon-ext hangs``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Name the rank(s) a hung job waits for, from the Muon optimizer's "
                    "flight-recorder dumps.")
    parser.add_argument("log_dir", metavar="LOG_DIR",
                        help="directory the ranks dumped into (the launcher's --log_dir)")
    args = parser.parse_args(argv)
    try:
        dumps = load_dumps(args.log_dir)
    except DumpError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(report(dumps)))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
