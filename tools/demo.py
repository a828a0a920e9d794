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
"""The demo: 8-process CPU training with MuonShardingOptimizer.

Launches ``test/collective/fleet/hybrid_parallel_sharding_muon_moe_model.py``
with ``paddle.distributed.launch`` on 8 CPU processes (gloo), emulating 4
nodes x 2 cards, ep=4, moe_sharding=2, and trains a tiny MoE model twice:
with ``comm_group_call_opt`` off and on. Every step each rank checks its
parameters against a single-process Muon reference. Rank 0's ``[demo]``
lines (loss and step time per step, then a summary) are streamed here; the
last line is the verdict. Exit status 0 when every rank passed.

    python tools/demo.py [--steps 5] [--timeout 170] [--json]

``--steps`` must be 1..200 and ``--timeout`` > 0 (``error: ...``, exit 2).
``--json`` prints only the verdict as JSON on stdout (the rest on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLEET_TESTS = os.path.join(REPO, "test", "collective", "fleet")
sys.path.insert(0, FLEET_TESTS)
if os.path.join(REPO, "python") not in sys.path:  # fallback when PYTHONPATH is unset
    sys.path.append(os.path.join(REPO, "python"))

from launch_utils import OrphanWatchdog, run_paddle_launch  # noqa: E402

from paddle_muon_ext.tools.guard import (  # noqa: E402
    ArgumentParser,
    Interrupted,
    emit_json,
    interrupts_raise,
)

WORKER = os.path.join(FLEET_TESTS, "hybrid_parallel_sharding_muon_moe_model.py")
NPROC, EP, MS, CARDS_PER_NODE = 8, 4, 2, 2


def follow(path: str, done: threading.Event, prefix: str = "[demo]") -> None:
    """Print lines of ``path`` starting with ``prefix`` as they appear."""
    pos, pending = 0, ""
    while True:
        finished = done.is_set()  # read before the file so the last lines are not lost
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                f.seek(pos)
                pending += f.read()
                pos = f.tell()
            *lines, pending = pending.split("\n")
            for line in lines:
                if line.startswith(prefix):
                    print(line, flush=True)
        if finished:
            if pending.startswith(prefix):
                print(pending, flush=True)
            return
        time.sleep(0.2)


#: Bounds of the arguments: a run that trains nothing proves nothing, and
#: the launch timeout must leave the 8 processes time to start.
MAX_STEPS = 200
MAX_TIMEOUT_S = 3600.0


def check_args(args: argparse.Namespace) -> str | None:
    """The first bad argument as an ``error: ...`` line, or None."""
    if not 1 <= args.steps <= MAX_STEPS:
        return (f"error: --steps {args.steps}: must be in 1..{MAX_STEPS} (a run that trains "
                f"no step checks nothing), pass e.g. --steps 5")
    if not 0 < args.timeout <= MAX_TIMEOUT_S:
        return (f"error: --timeout {args.timeout:g}: must be in (0, {MAX_TIMEOUT_S:g}] seconds, "
                f"pass e.g. --timeout 170")
    return None


def parse_ok_lines(worker_logs: dict) -> tuple[int, int]:
    """Steps and values every rank's ``MUON_OK`` line reports, summed over ranks.

    Returns:
        (steps per pass (the minimum over ranks), values compared in total).
    """
    steps, values = [], 0
    for log in worker_logs.values():
        for line in log.splitlines():
            if line.startswith("MUON_OK"):
                fields = dict(f.split("=", 1) for f in line.split()[1:] if "=" in f)
                steps.append(int(fields.get("steps", 0)))
                values += int(fields.get("values", 0))
    return (min(steps) if steps else 0), values


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run the demo; ``prog`` names the tool in ``--help`` and usage errors
    (default: this script's name, as typed; ``paddle-muon-ext demo`` passes its own)."""
    parser = ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5,
                        help=f"training steps per pass (1..{MAX_STEPS})")
    parser.add_argument("--timeout", type=float, default=170.0,
                        help="launch timeout in seconds (> 0)")
    parser.add_argument("--json", action="store_true",
                        help="print only the verdict as JSON on stdout (progress on stderr)")
    args = parser.parse_args(argv)
    error = check_args(args)
    if error is not None:
        print(error, file=sys.stderr)
        return 2
    # SIGINT / SIGTERM / SIGHUP: the launcher, its 8 workers and the log dir
    # are removed on the way out; exit 128 + signal (130, 143, 129)
    try:
        with interrupts_raise():
            if not args.json:
                return run(args)[0]
            with contextlib.redirect_stdout(sys.stderr):
                code, verdict = run(args)
    except Interrupted as exc:
        print(f"error: {exc}; the launcher, its workers and the log dir were removed",
              file=sys.stderr)
        return 128 + exc.signum
    emit_json(verdict)  # the real stdout, also under the console script
    return code


def run(args: argparse.Namespace) -> tuple[int, dict]:
    """Launch the demo; returns (exit status, the verdict as a dict)."""

    print(f"Running {NPROC} CPU processes (gloo) as {NPROC // CARDS_PER_NODE} emulated nodes x "
          f"{CARDS_PER_NODE} cards, ep={EP}, moe_sharding={MS}: {args.steps} Muon steps with "
          "comm_group_call_opt off, then on, each checked against a single-process reference.",
          flush=True)
    env = {
        "MUON_DEMO": "1", "MUON_GROUP_CALL": "both", "MUON_EP": str(EP), "MUON_MS": str(MS),
        "MUON_STEPS": str(args.steps), "PADDLE_LOCAL_SIZE": str(CARDS_PER_NODE),
        "PYTHONPATH": os.pathsep.join(
            p for p in (os.path.join(REPO, "python"), FLEET_TESTS, os.environ.get("PYTHONPATH"))
            if p),
    }
    log_dir = tempfile.mkdtemp(prefix="muon_demo_")
    # killed outright (SIGKILL, the OOM killer): the watchdog stops the
    # launcher and its workers and removes log_dir; interrupted, this process does
    with OrphanWatchdog(remove=log_dir) as watchdog:
        done = threading.Event()
        tail = threading.Thread(target=follow, args=(os.path.join(log_dir, "workerlog.0"),
                                                     done))
        tail.start()
        try:
            result = run_paddle_launch(WORKER, NPROC, env, timeout_s=args.timeout,
                                       log_dir=log_dir, token=watchdog.token)
        except BaseException:  # interrupted: the launch killed its processes; the logs go too
            shutil.rmtree(log_dir, ignore_errors=True)
            raise
        finally:
            done.set()
            tail.join()

    ok_ranks = result.workers_printing("MUON_OK")
    steps, values = parse_ok_lines(result.worker_logs)
    if result.ok and ok_ranks == list(range(NPROC)) and steps >= args.steps and values > 0:
        print(f"VERDICT: PASS - all {NPROC} ranks matched the reference with "
              f"comm_group_call_opt off and on: {steps} steps x 2 passes, {NPROC} ranks, "
              f"{values} parameter values compared ({result.wall_s:.1f}s)")
        shutil.rmtree(log_dir, ignore_errors=True)
        return 0, {"status": "PASS", "ranks": NPROC, "steps": steps, "passes": 2,
                   "values_compared": values, "wall_s": result.wall_s}
    print(result.failure_message(), file=sys.stderr)
    why = "timed out" if result.timed_out else f"returncode {result.returncode}"
    if result.ok and ok_ranks == list(range(NPROC)):
        why = f"only {steps} steps / {values} values were checked"
    print(f"VERDICT: FAIL - {why}; ranks with MUON_OK: {ok_ranks} "
          f"({result.wall_s:.1f}s, logs in {log_dir})")
    return 1, {"status": "FAIL", "why": why, "ranks_ok": ok_ranks, "steps": steps,
               "values_compared": values, "wall_s": result.wall_s, "log_dir": log_dir}


if __name__ == "__main__":
    sys.exit(main())
