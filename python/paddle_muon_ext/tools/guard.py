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
"""What makes every subcommand behave like a command-line tool.

* :func:`guarded` runs a subcommand and turns every failure into one
  ``error: ...`` line on stderr and an exit status: a missing Paddle (naming
  ``pip install ".[cpu]"``), stdout that cannot be written (``> /dev/full``,
  a closed pipe), an interrupt, and - as a last resort - any unexpected
  exception (``PADDLE_MUON_EXT_TRACEBACK=1`` shows its traceback).
* With ``--json`` everything a subcommand prints goes to stderr while it
  works; only :func:`emit_result` writes to stdout, so stdout is the JSON.
* stdout never fails on text its encoding lacks (an ASCII locale): such
  characters are written escaped (``\\xe9``).
* :class:`ArgumentParser` reports a bad flag in one ``error:`` line (exit 2)
  instead of argparse's usage block.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import signal
import sys
import threading
import traceback
from typing import Any, Callable, Iterator, List, Optional

__all__ = ["ArgumentParser", "Interrupted", "TRACEBACK_ENV", "emit_json", "emit_result",
           "guarded", "interrupts_raise", "missing_package", "one_line", "printable"]

#: Set (to anything) to print the traceback of an unexpected error.
TRACEBACK_ENV = "PADDLE_MUON_EXT_TRACEBACK"
#: Exit status when the reader of stdout went away (128 + SIGPIPE, as a shell reports).
EXIT_BROKEN_PIPE = 141
#: Optional packages -> what installs them.
_INSTALL_HINTS = {
    "paddle": ("PaddlePaddle is not installed", 'pip install ".[cpu]" in the checkout '
               "(CPU wheel) or pip install paddlepaddle-gpu on a GPU node"),
    "matplotlib": ("matplotlib is not installed", 'pip install ".[plot]" (or pip install '
                   "matplotlib)"),
}

_RESULT: List[Any] = []  # the stdout of the innermost guarded call


class _StdoutFailed(Exception):
    """Writing the command's stdout failed (full device, closed pipe)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class _CheckedStream:
    """A stdout whose write errors are told apart from every other OSError."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            try:
                return self._stream.write(text)
            except UnicodeEncodeError:
                # an ASCII locale (LC_ALL=C without UTF-8 mode): text from a
                # dump or a file name is written with the characters the
                # stream cannot encode escaped (\xe9), not refused
                encoding = getattr(self._stream, "encoding", None) or "ascii"
                return self._stream.write(
                    text.encode(encoding, "backslashreplace").decode(encoding))
        except OSError as exc:
            raise _StdoutFailed(exc) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            raise _StdoutFailed(exc) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with a bad flag reported as one ``error:`` line (exit 2).

    Prefix abbreviations (``--jso`` for ``--json``) are off in every parser
    and subparser built from it: the ``--json`` guard decides where output
    goes before parsing, from the literal flag, so an abbreviation it does not
    see would put progress on stdout.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"error: {self.prog}: {message} (see {self.prog} --help)\n")
        sys.exit(2)


class Interrupted(KeyboardInterrupt):
    """SIGINT / SIGTERM / SIGHUP arrived while a tool ran (:func:`interrupts_raise`).

    A ``KeyboardInterrupt`` so that ``except Exception`` blocks let it pass
    and ``finally`` blocks (killing child processes, removing temporary
    directories) run on the way out.

    Attributes:
        signum: the signal; the tool exits with 128 + signum, as a shell reports.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by signal {signal.Signals(signum).name}")
        self.signum = int(signum)


#: The signals a tool ends on, cleaning up first.
INTERRUPT_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP")
                          if hasattr(signal, n))


@contextlib.contextmanager
def interrupts_raise() -> Iterator[None]:
    """While the block runs, SIGINT / SIGTERM / SIGHUP raise :class:`Interrupted`
    (once; a second signal during the cleanup is ignored) instead of killing
    the process outright, so its ``finally`` blocks clean up.

    Call it inside a tool's main only - and after importing Paddle, whose
    import takes over SIGINT at the C level - never at import time; the
    previous handlers are restored on exit. Off the main thread (where Python
    cannot set handlers) it does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in INTERRUPT_SIGNALS}
    fired = []

    def handler(signum: int, _frame: Any) -> None:
        if fired:
            return
        fired.append(signum)
        raise Interrupted(signum)

    for s in INTERRUPT_SIGNALS:
        signal.signal(s, handler)
    try:
        try:
            yield
        except BaseException:
            # code that wraps what it catches (a simulated rank's failure)
            # still ends as the interrupt it was
            if fired:
                raise Interrupted(fired[0]) from None
            raise
        if fired:  # swallowed by a broad except on the way: end all the same
            raise Interrupted(fired[0])
    finally:
        for s, h in saved.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def emit_result(text: str) -> None:
    """Write a subcommand's result (its JSON) to the real stdout."""
    stream = _RESULT[-1] if _RESULT else sys.stdout
    if stream is not None:  # stdout closed at start (``>&-``): nothing to write to
        stream.write(text + "\n")


def emit_json(obj: Any) -> None:
    """Write ``obj`` as strict JSON (never ``Infinity`` / ``NaN``) to the real stdout.

    Args:
        obj: the result, JSON-serialisable.

    Raises:
        ValueError: ``obj`` holds a non-finite number; nothing is written (the
            tool turns it into one ``error:`` line).
    """
    try:
        text = json.dumps(obj, indent=1, allow_nan=False)
    except ValueError:
        raise ValueError("the result holds a non-finite number (inf or nan), which JSON "
                         "cannot carry; pass smaller model inputs (alpha, beta, sizes)") from None
    emit_result(text)


def one_line(value: Any) -> str:
    """``value`` quoted for an error line: newlines, ANSI escapes and other
    control characters shown escaped, so an error stays one line."""
    return repr(value)  # repr escapes every non-printable character


def printable(text: str) -> str:
    """``text`` with each non-printable character (newline, ESC, NUL, ...) written
    as its escape (``\\n``, ``\\x1b``): text from a file or a flag can neither
    split a line nor drive the terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def missing_package(exc: BaseException) -> Optional[str]:
    """``"paddle"`` / ``"matplotlib"`` when ``exc`` says that package is missing."""
    if not isinstance(exc, ImportError):
        return None
    name = (getattr(exc, "name", None) or "").split(".")[0]
    return name if name in _INSTALL_HINTS else None


def _silence(stream: Any) -> None:
    # Python flushes stdout again at exit; pointing the fd at /dev/null keeps
    # that flush from printing "Exception ignored ... BrokenPipeError".
    try:
        fd = stream.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass


def _error(text: str) -> None:
    try:
        print(f"error: {printable(text)}", file=sys.stderr, flush=True)
    except (OSError, AttributeError, ValueError):  # stderr gone too: nothing left to tell
        pass


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    _error(str(code))
    return 1


def guarded(call: Callable[[], int], json_mode: bool = False) -> int:
    """Run ``call`` (a subcommand) and return its exit status; never raises.

    Args:
        call: runs the subcommand, returns its exit status.
        json_mode: ``--json`` was given: while ``call`` runs, ``print`` goes to
            stderr; :func:`emit_result` writes to stdout.
    """
    if _RESULT:  # nested (the console script calls the tools' main): the outer one guards
        return call()
    out = sys.stdout
    checked = _CheckedStream(out) if out is not None else None
    _RESULT.append(checked)
    try:
        try:
            with contextlib.redirect_stdout(sys.stderr if json_mode else checked):
                code = _exit_code(call())
        except SystemExit as exc:  # argparse: --help (0) or a bad flag (2)
            code = _exit_code(exc.code)
        if checked is not None:  # here, not at exit, so a full stdout is reported
            checked.flush()
        return code
    except _StdoutFailed as exc:
        _silence(out)
        if exc.error.errno == errno.EPIPE:  # the reader left (``| head``): not an error
            return EXIT_BROKEN_PIPE
        _error(f"cannot write to stdout ({exc.error.strerror or exc.error}); "
               "write to a file or a device with space")
        return 2
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        _error(f"interrupted by signal {signal.Signals(signum).name}")
        return 128 + int(signum)
    except Exception as exc:  # noqa: BLE001 - the last resort: one line, never a traceback
        package = missing_package(exc)
        if package is not None:
            what, fix = _INSTALL_HINTS[package]
            _error(f"{what} ({exc}); install it: {fix}")
        elif isinstance(exc, RecursionError):
            _error("input nested too deeply to read (RecursionError); flatten it")
        elif isinstance(exc, MemoryError):
            _error("out of memory; model a smaller input")
        else:
            _error(f"unexpected {type(exc).__name__}: {exc}; this is a bug, rerun with "
                   f"{TRACEBACK_ENV}=1 and report the traceback")
        if os.environ.get(TRACEBACK_ENV):
            traceback.print_exc()
        return 2
    finally:
        _RESULT.pop()
