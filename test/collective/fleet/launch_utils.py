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
"""Run a script under ``python -m paddle.distributed.launch`` from pytest.

``run_paddle_launch(script, nproc, env, timeout_s)`` starts a single-node
launch on a free master port, enforces a hard timeout, and returns a
:class:`LaunchResult` whose :meth:`LaunchResult.check` raises an
``AssertionError`` carrying the tail of *every* ``workerlog.N`` (a hang or a
crash in one rank usually shows up as a timeout in the others, so all of
them are needed to diagnose it).

Why the kill logic is elaborate: the launcher starts each worker with
``os.setsid`` (its own session), so killing the launcher's process group
leaves the workers running. Every process of a launch therefore carries a
unique token in its environment (``PADDLE_LAUNCH_UTILS_TOKEN``, inherited by
the workers) and the timeout path kills exactly the processes whose
``/proc/<pid>/environ`` holds that token (by pid / their own group), which
also finds workers already re-parented to init.

When the caller itself dies without a chance to clean up (SIGKILL, the OOM
killer's signal), the launcher gets SIGTERM from the kernel (it is started
with a parent-death signal, ``PR_SET_PDEATHSIG``, on Linux), and
:class:`OrphanWatchdog` - a small process of its own session that waits on a
pipe only the caller holds - kills every process of the launch by its token
and removes the caller's temporary directory.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass, field

#: Env var marking every process of one launch (see module docstring).
TOKEN_ENV = "PADDLE_LAUNCH_UTILS_TOKEN"
#: The launcher overwrites PADDLE_LOCAL_SIZE; gloo_compat re-applies this one.
EMULATED_LOCAL_SIZE_ENV = "GLOO_COMPAT_LOCAL_SIZE"


def free_port() -> int:
    """An OS-chosen free TCP port (racy by nature; good enough for a launch)."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(text: str, n: int) -> str:
    lines = text.splitlines()
    return "\n".join(lines[-n:])


@dataclass
class LaunchResult:
    """Outcome of one launch. ``worker_logs`` maps rank -> full log text."""

    cmd: list[str]
    returncode: int | None
    wall_s: float
    timed_out: bool
    log_dir: str
    launcher_output: str
    worker_logs: dict[int, str] = field(default_factory=dict)
    tail_lines: int = 40
    stopped: bool = False

    @property
    def ok(self) -> bool:
        return not self.timed_out and self.returncode == 0

    def failure_message(self) -> str:
        head = (
            f"paddle launch {'TIMED OUT' if self.timed_out else 'failed'}: "
            f"returncode={self.returncode} wall={self.wall_s:.1f}s\n"
            f"cmd: {' '.join(self.cmd)}\nlog_dir: {self.log_dir}\n"
        )
        # first in the message: a truncated CI log still shows which rank died how
        fatal = {r: _first_fatal_line(log) for r, log in self.worker_logs.items()}
        fatal = {r: line for r, line in fatal.items() if line}
        if fatal:
            head = head.replace("\n", f" fatal: {fatal}\n", 1)
        parts = [head, f"----- launcher (last {self.tail_lines} lines) -----",
                 _tail(self.launcher_output, self.tail_lines)]
        if not self.worker_logs:
            parts.append("(no workerlog.N files were written)")
        for rank in sorted(self.worker_logs):
            parts.append(f"----- workerlog.{rank} (last {self.tail_lines} lines) -----")
            parts.append(_tail(self.worker_logs[rank], self.tail_lines))
        return "\n".join(parts)

    def check(self) -> LaunchResult:
        """Raise AssertionError (with every worker's log tail) unless ok."""
        if not self.ok:
            raise AssertionError(self.failure_message())
        return self

    def workers_printing(self, marker: str) -> list[int]:
        """Ranks whose log contains ``marker``."""
        return sorted(r for r, log in self.worker_logs.items() if marker in log)


def _first_fatal_line(log: str) -> str:
    """The first line of a signal death or abort in a workerlog ("" if none)."""
    for line in log.splitlines():
        if line.startswith(("Fatal Python error", "terminate called")) or "Aborted" in line[:40]:
            return line.strip()[:160]
    return ""


def _pids_with_token(token: str) -> list[int]:
    needle = f"{TOKEN_ENV}={token}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:  # gone, or not ours
            continue
    return pids


def _signal_token(token: str, sig: int) -> None:
    for pid in _pids_with_token(token):
        try:
            os.killpg(os.getpgid(pid), sig)  # a worker's own setsid group
        except OSError:
            try:
                os.kill(pid, sig)
            except OSError:
                pass


#: Run by the launcher's wrapper: ask the kernel for SIGTERM once the caller
#: (argv[1], its pid) is gone, then become the launcher (the signal stays set
#: across exec). The launcher stops its workers on SIGTERM.
_PDEATHSIG_WRAPPER = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG\n"
    "except (AttributeError, OSError):\n"
    "    pass  # not Linux: the watchdog alone cleans up\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)  # the caller died before the signal was set\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


class OrphanWatchdog:
    """Clean up after a caller that dies without a chance to (SIGKILL).

    A separate process (its own session, so a terminal's signals to the
    caller's group leave it alone) reads a pipe whose only writer is the
    caller. Should the pipe reach its end without :meth:`done` - the caller
    died - it sends SIGTERM, then SIGKILL, to every process carrying
    :attr:`token` (pass it to :func:`run_paddle_launch`) and removes
    ``remove`` (a directory the caller made), then exits.

    Use as a context manager: leaving it normally calls :meth:`done`.
    """

    def __init__(self, remove: str | None = None, grace_s: float = 3.0) -> None:
        self.token = uuid.uuid4().hex
        read_fd, self._write_fd = os.pipe()  # not inherited by other children
        env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                 "import launch_utils; launch_utils._watchdog_main(*sys.argv[2:])",
                 os.path.dirname(os.path.abspath(__file__)), self.token, remove or "",
                 str(grace_s)],
                stdin=read_fd, stdout=subprocess.DEVNULL, env=env, start_new_session=True)
        finally:
            os.close(read_fd)

    def done(self) -> None:
        """The caller finished: the watchdog exits and touches nothing."""
        if self._write_fd is not None:
            try:
                os.write(self._write_fd, b"done")
            finally:
                os.close(self._write_fd)
                self._write_fd = None
            self.proc.wait()

    def __enter__(self) -> OrphanWatchdog:
        return self

    def __exit__(self, *exc_info) -> None:
        self.done()


def _watchdog_main(token: str, remove: str, grace_s: str) -> None:
    if sys.stdin.buffer.read().startswith(b"done"):
        return
    _signal_token(token, signal.SIGTERM)
    deadline = time.monotonic() + float(grace_s)
    while _pids_with_token(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    _signal_token(token, signal.SIGKILL)
    if remove:
        shutil.rmtree(remove, ignore_errors=True)


def _kill_launch(proc: subprocess.Popen, token: str, grace_s: float = 3.0) -> None:
    """SIGTERM then SIGKILL the launcher and every worker of this launch."""

    def signal_all(sig: int) -> None:
        targets = set(_pids_with_token(token))
        if proc.poll() is None:
            targets.add(proc.pid)
        for pid in targets:
            try:
                os.killpg(os.getpgid(pid), sig)  # worker's own setsid group
            except OSError:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass

    signal_all(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc.poll() is not None and not _pids_with_token(token):
            break
        time.sleep(0.1)
    signal_all(signal.SIGKILL)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _read_worker_logs(log_dir: str) -> dict[int, str]:
    logs: dict[int, str] = {}
    if not os.path.isdir(log_dir):
        return logs
    for name in os.listdir(log_dir):
        prefix, _, suffix = name.partition("workerlog.")
        if prefix == "" and suffix.isdigit():
            with open(os.path.join(log_dir, name), errors="replace") as f:
                logs[int(suffix)] = f.read()
    return logs


def run_paddle_launch(
    script: str,
    nproc: int,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 240.0,
    args: Sequence[str] = (),
    log_dir: str | None = None,
    tail_lines: int = 40,
    keep_log_dir: bool = False,
    stop_when: Callable[[str], bool] | None = None,
    token: str | None = None,
) -> LaunchResult:
    """Run ``python -m paddle.distributed.launch`` for ``script`` on this host.

    Args:
        script: path of the worker script.
        nproc: ``--nproc_per_node`` (single node).
        env: extra env for the launcher (inherited by every worker). If it
            sets ``PADDLE_LOCAL_SIZE`` it is also exported as
            ``GLOO_COMPAT_LOCAL_SIZE`` because the launcher overwrites
            ``PADDLE_LOCAL_SIZE`` with ``nproc`` (gloo_compat restores it).
        stop_when: polled with the log dir while the launch runs; once it
            returns True the launch is killed (``stopped=True`` in the
            result), e.g. when a deliberately hung job left what a test needs.
        timeout_s: hard wall-clock limit; on expiry the launcher and all
            workers are killed and the result has ``timed_out=True``.
        args: arguments passed to the script.
        log_dir: ``--log_dir``; a fresh temp dir when None (removed after a
            successful run unless ``keep_log_dir``; logs are kept in memory
            in ``LaunchResult.worker_logs`` either way).
        token: the token marking the launch's processes (a fresh one when
            None), e.g. an :class:`OrphanWatchdog`'s.

    A launch whose rank 0 could not bind the TCPStore port (taken by a
    concurrent launch on this host) is run once more.
    """
    def launch() -> LaunchResult:
        return _launch_once(script, nproc, env, timeout_s, args, log_dir, tail_lines,
                            keep_log_dir, stop_when, token)

    result = launch()
    if not result.ok and _store_port_taken(result):
        sys.stderr.write(f"run_paddle_launch: the TCPStore port was taken before rank 0 "
                         f"bound it (another launch on this host); launching {script} again\n")
        result = launch()
    return result


# What a worker prints when paddle's TCPStore server cannot bind the port the
# launcher picked: the launcher chooses a free port, releases it, and rank 0
# binds it later, so a concurrent launch (two CI lanes) can take it between.
# The job never started; running it again is safe.
_STORE_PORT_SIGNS = ("TCPServer::create", "Address already in use")


def _store_port_taken(result: LaunchResult) -> bool:
    return any(sign in log for log in result.worker_logs.values() for sign in _STORE_PORT_SIGNS)


def _launch_once(
    script: str,
    nproc: int,
    env: Mapping[str, str] | None,
    timeout_s: float,
    args: Sequence[str],
    log_dir: str | None,
    tail_lines: int,
    keep_log_dir: bool,
    stop_when: Callable[[str], bool] | None,
    token: str | None = None,
) -> LaunchResult:
    own_dir = log_dir is None
    if own_dir:
        log_dir = tempfile.mkdtemp(prefix="paddle_launch_")
    else:
        os.makedirs(log_dir, exist_ok=True)
    token = token or uuid.uuid4().hex
    full_env = dict(os.environ)
    full_env.update({k: str(v) for k, v in (env or {}).items()})
    if "PADDLE_LOCAL_SIZE" in (env or {}):
        full_env.setdefault(EMULATED_LOCAL_SIZE_ENV, str(env["PADDLE_LOCAL_SIZE"]))  # type: ignore[index]
    full_env[TOKEN_ENV] = token
    # a worker that dies on a signal (paddle 3.3.1's gloo teardown has
    # segfaulted under load) leaves its Python stack in the workerlog
    full_env.setdefault("PYTHONFAULTHANDLER", "1")
    # Launcher settings that would otherwise leak in from the caller's env
    # and change the run (e.g. a multi-node PADDLE_MASTER / PADDLE_NNODES).
    for k in ("PADDLE_MASTER", "PADDLE_NNODES", "PADDLE_RANK", "PADDLE_TRAINER_ENDPOINTS",
              "PADDLE_CURRENT_ENDPOINT", "PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM"):
        if k not in (env or {}):
            full_env.pop(k, None)
    # paddle 3.3.1's launcher treats a set-but-empty CUDA_VISIBLE_DEVICES as
    # "GPU with one device labelled ''" and dies with IndexError in
    # _build_pod_with_master for nproc > 1. Unset, a CPU wheel detects CPU and
    # gives every worker PADDLE_DISTRI_BACKEND=gloo - what "" meant to say.
    if full_env.get("CUDA_VISIBLE_DEVICES", None) == "":
        del full_env["CUDA_VISIBLE_DEVICES"]
    full_env.setdefault("PYTHONUNBUFFERED", "1")

    cmd = [
        sys.executable, "-m", "paddle.distributed.launch",
        "--master", f"127.0.0.1:{free_port()}",
        "--nnodes", "1",
        "--nproc_per_node", str(int(nproc)),
        "--log_dir", log_dir,
        "--log_overwrite", "true",
        script, *[str(a) for a in args],
    ]
    start = time.monotonic()
    timed_out = False
    with tempfile.TemporaryFile(mode="w+", errors="replace") as out:
        # the launcher gets SIGTERM should this process die (see the module docstring)
        proc = subprocess.Popen(
            [sys.executable, "-c", _PDEATHSIG_WRAPPER, str(os.getpid()), *cmd],
            env=full_env, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        stopped = False
        try:
            if stop_when is None:
                proc.wait(timeout=timeout_s)
            else:
                while proc.poll() is None:
                    if stop_when(log_dir):
                        stopped = True
                        _kill_launch(proc, token, grace_s=1.0)
                        break
                    if time.monotonic() - start > timeout_s:
                        raise subprocess.TimeoutExpired(cmd, timeout_s)
                    time.sleep(0.2)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_launch(proc, token)
        except BaseException:
            # interrupted (KeyboardInterrupt, a tool's SIGTERM handler): no
            # launcher or worker may outlive the caller, nor a log dir it made
            _kill_launch(proc, token, grace_s=1.0)
            if own_dir:
                shutil.rmtree(log_dir, ignore_errors=True)
            raise
        else:
            # Launcher exited; make sure no orphaned worker survives it.
            if _pids_with_token(token):
                _kill_launch(proc, token, grace_s=1.0)
        wall = time.monotonic() - start
        out.seek(0)
        launcher_output = out.read()
    result = LaunchResult(
        cmd=cmd, returncode=proc.returncode, wall_s=wall, timed_out=timed_out,
        log_dir=log_dir, launcher_output=launcher_output,
        worker_logs=_read_worker_logs(log_dir), tail_lines=tail_lines, stopped=stopped,
    )
    if own_dir and result.ok and not keep_log_dir:
        shutil.rmtree(log_dir, ignore_errors=True)
    return result


__all__ = ["LaunchResult", "OrphanWatchdog", "free_port", "run_paddle_launch"]
