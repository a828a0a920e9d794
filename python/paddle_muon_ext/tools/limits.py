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
"""Bounds on every tool input, checked before any work starts.

Each limit is the largest input the tools handle in < 60 s and < 2 GB on a
2-core box (measured; docs/DEVELOPING.md, "Tool input limits", lists the figures). Beyond
it, or for a value that makes no sense, the tool prints one line
``error: <what> <value>: <why>, <what to do>`` and exits 2.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import secrets
import stat
import sys
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

from .guard import printable

__all__ = [
    "LIMITS",
    "InputError",
    "Limits",
    "STDOUT",
    "check_float",
    "check_int",
    "check_local_size",
    "check_optimizer_accepts",
    "check_shape",
    "check_writable",
    "optimizer_refusal",
    "png_path",
    "read_model_file",
    "read_regular_file",
    "write_output",
]


class InputError(ValueError):
    """A bad tool input; ``str()`` is the ``<what> <value>: <why>, <fix>`` text."""

    def __init__(self, what: str, value: Any, why: str, fix: str) -> None:
        # a path or name from the user may hold a newline: the error stays one line
        super().__init__(printable(f"{what} {value}: {why}, {fix}"))
        self.why = why


@dataclass(frozen=True)
class Limits:
    """Largest accepted inputs (see the module docstring for how they were set).

    Attributes:
        plan_world: ranks ``plan`` models (pp x moe_sharding x ep).
        verify_world: ranks ``verify`` checks schedule-only.
        verify_data_world: ranks ``verify`` trains with data (``--data-max-ranks``).
        gpus_per_node: cards per node.
        verify_steps: ``verify --steps``.
        buffer_mb: ``--buffer-size-MB``.
        model_entries: parameters in a model file.
        model_file_bytes: size of a model file.
        dim: one dimension of a parameter shape.
        alpha_s: a latency per hop (``--alpha-*``), seconds.
        beta_s_per_byte: a link's seconds per byte (``--beta-*``; 1 = 1 B/s);
            with the largest model every time stays finite.
    """

    plan_world: int = 16384
    verify_world: int = 4096
    verify_data_world: int = 64
    gpus_per_node: int = 1024
    verify_steps: int = 10
    buffer_mb: float = 65536.0
    model_entries: int = 200000
    model_file_bytes: int = 64 << 20
    dim: int = 1 << 31
    alpha_s: float = 10.0
    beta_s_per_byte: float = 1.0


LIMITS = Limits()


def check_int(what: str, value: Any, low: int, high: int, fix: str) -> int:
    """``value`` as an int in ``[low, high]``, else :class:`InputError`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(what, value, "must be an integer", fix)
    if value < low:
        raise InputError(what, value, f"must be >= {low}", fix)
    if value > high:
        raise InputError(what, value, f"above the limit {high} this tool handles in "
                         "< 60 s and < 2 GB", fix)
    return value


def check_float(what: str, value: float, fix: str, positive: bool = True,
                high: float = math.inf) -> float:
    """A finite float, > 0 (``positive``) or >= 0, at most ``high``."""
    shown = f"{value:g}"
    if not math.isfinite(value):
        raise InputError(what, shown, "must be a finite number", fix)
    if positive and not value > 0:
        raise InputError(what, shown, "must be > 0 (a free link makes every ratio "
                         "divide by zero)", fix)
    if not value >= 0:
        raise InputError(what, shown, "must be >= 0", fix)
    if value > high:
        raise InputError(what, shown, f"above the limit {high:g}", fix)
    return value


#: ``-o -``: the output goes to standard output (where a tool allows it).
STDOUT = "-"


def _refuse_kind(what: str, path: str, st: os.stat_result, stdout_ok: bool) -> None:
    """Refuse anything at an output path that is not a plain file of its own:
    writing would replace a link, fill a device, block on a FIFO or, for a
    directory, fail after the work is done."""
    fix = "pass a file name" + (" (or - for standard output)" if stdout_ok else "")
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        # a rename would replace the link, not the file it points to
        # (/dev/stdout is a link too)
        raise InputError(what, path, "is a symbolic link", fix + ", or the file it points to")
    if stat.S_ISDIR(mode):
        raise InputError(what, path, "is a directory", fix)
    if not stat.S_ISREG(mode):
        kind = ("a character device" if stat.S_ISCHR(mode) else "a block device"
                if stat.S_ISBLK(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a socket"
                if stat.S_ISSOCK(mode) else "not a regular file")
        raise InputError(what, path, f"is {kind}, not a regular file", fix)


def check_writable(what: str, path: str, stdout_ok: bool = False,
                   suffix: Optional[str] = None) -> str:
    """Check up front that ``path`` can take a tool's output; returns its
    absolute path (``"-"`` for standard output when ``stdout_ok``).

    The one home of every output-path rule of the tools (``plan --png``,
    ``export_upstream_patch.py -o`` / ``--notes``, ``upstream_coverage.py
    --log``), so bad paths fail before any work:

    * an empty name, a NUL byte, a name longer than the directory's file
      system allows;
    * ``-`` unless ``stdout_ok``;
    * an existing symbolic link, directory, device (``/dev/null``,
      ``/dev/full``, ``/dev/stdout``), FIFO or socket;
    * an existing read-only file (no write bit, checked also for root, who
      could write it anyway): the tool refuses it rather than replace it;
    * a missing directory, or one the tool cannot create a file in (a
      read-only file system, no permission): a file is created and removed
      there;
    * with ``suffix``, a name ending otherwise (case-insensitive).

    Raises:
        InputError: the first problem, in one line.
    """
    if not path.strip():
        raise InputError(what, repr(path), "is an empty file name", "pass a file name")
    if path == STDOUT:
        if stdout_ok:
            return STDOUT
        raise InputError(what, path, "standard output is not supported here",
                         "pass a file name")
    if "\0" in path:
        raise InputError(what, repr(path), "holds a NUL byte", "pass a file name")
    full = os.path.abspath(path)
    parent, name = os.path.split(full)
    try:
        name_max = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    if len(os.fsencode(name)) > name_max:
        raise InputError(what, path, f"has a {len(os.fsencode(name))}-byte file name, above "
                         f"the {name_max} bytes its file system allows", "pick a shorter name")
    try:
        _refuse_kind(what, path, os.lstat(full), stdout_ok)
        exists = True
    except FileNotFoundError:
        exists = False
    except NotADirectoryError:
        raise InputError(what, path, "a part of its directory is a file",
                         "pick another path") from None
    except OSError as exc:  # a name or path too long, a loop, no permission
        raise InputError(what, path, f"cannot be used ({exc.strerror})",
                         "pick another path") from None
    if exists:
        st = os.stat(full)
        if not st.st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH) \
                or not os.access(full, os.W_OK):
            raise InputError(what, path, f"is read-only (mode {stat.S_IMODE(st.st_mode):04o})",
                             "make it writable (chmod u+w) or pick another path")
    elif not os.path.isdir(parent):
        raise InputError(what, path, f"directory {parent} does not exist",
                         "create it or pick another path")
    if suffix is not None and os.path.splitext(name)[1].lower() != suffix:
        raise InputError(what, path, f"does not end in {suffix}",
                         f"name the file *{suffix}")
    try:
        fd, probe = _create_beside(parent)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise InputError(what, path, f"cannot write in {parent} ({exc.strerror})",
                         "pick a writable path") from None
    return full


def _create_beside(parent: str) -> "tuple[int, str]":
    """A new empty file in ``parent`` with a short name (well inside every
    file system's name limit, whatever the output's name) and the mode a new
    file gets from the umask; returns (descriptor, path)."""
    for _ in range(100):
        tmp = os.path.join(parent, f".muon-{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                           | getattr(os, "O_CLOEXEC", 0), 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", parent)


def write_output(what: str, path: str, data: bytes) -> None:
    """Write a tool's output whole or not at all (``"-"``: standard output).

    The data goes to a temporary file beside ``path`` that is then renamed
    over it: a full disk or an interrupt leaves neither a truncated file nor
    the temporary one. An existing file keeps its mode (and, where the tool
    runs as root, its owner); a new one gets the umask's usual mode. The path
    is checked again (:func:`check_writable`'s rules) right before the rename.

    Raises:
        InputError: the path became unusable or the write failed, in one line.
    """
    if path == STDOUT:
        binary = getattr(sys.stdout, "buffer", None)
        if binary is None:  # a text-only stream (a redirect in-process)
            sys.stdout.write(data.decode("utf-8", "replace"))
            return
        sys.stdout.flush()
        binary.write(data)
        binary.flush()
        return
    full = os.path.abspath(path)
    fix = "free space or pick another path"
    try:
        old: Optional[os.stat_result] = os.lstat(full)
    except FileNotFoundError:
        old = None
    except OSError as exc:
        raise InputError(what, path, f"cannot be written ({exc.strerror})", fix) from None
    if old is not None:
        _refuse_kind(what, path, old, stdout_ok=False)
    tmp = None
    try:
        fd, tmp = _create_beside(os.path.dirname(full))
        with open(fd, "wb") as f:
            if old is not None:
                os.chmod(tmp, stat.S_IMODE(old.st_mode))
                if hasattr(os, "geteuid") and os.geteuid() == 0:
                    os.chown(tmp, old.st_uid, old.st_gid)
            f.write(data)
        os.replace(tmp, full)
        tmp = None
    except OSError as exc:
        raise InputError(what, path, f"cannot be written ({exc.strerror or exc})",
                         fix) from None
    finally:
        if tmp is not None:  # failed or interrupted: no partial file stays behind
            with contextlib.suppress(OSError):
                os.remove(tmp)


def png_path(path: str) -> str:
    """The file a PNG is written to: ``out`` -> ``out.png`` (what matplotlib
    does) unless something already has the name given (``/dev/stdout``,
    a directory): that name is then checked as it is, and refused."""
    if not path.strip() or os.path.splitext(path)[1] or path == STDOUT \
            or os.path.lexists(path):
        return path
    return path + ".png"


def optimizer_refusal(pp: int, comm_overlap: bool, buffer_size_MB: float,
                      partition_strategy: Optional[str] = None,
                      group_call: Optional[bool] = None) -> Optional[str]:
    """Why MuonShardingOptimizer would refuse these settings at construction
    (None: it accepts them), by asking its own rule
    (``ShardingSettings.check_layout``), so a tool never plans, verifies or
    recommends what would not run.

    Args:
        pp: ``pp_degree``.
        comm_overlap: ``sharding_configs.comm_overlap``.
        buffer_size_MB: ``sharding_configs.comm_buffer_size_MB`` (<= 0: unfused).
        partition_strategy: ``sharding_configs.muon_partition_strategy``
            (None: the optimizer's default).
        group_call: ``sharding_configs.comm_group_call_opt`` (None: its default).
    """
    from ..distributed.fleet.meta_optimizers.muon_sharding.settings import ShardingSettings

    settings = ShardingSettings(comm_overlap=comm_overlap, comm_buffer_size_MB=buffer_size_MB)
    if partition_strategy is not None:
        settings.muon_partition_strategy = partition_strategy
    if group_call is not None:
        settings.comm_group_call_opt = group_call
    try:
        settings.check_layout(pp)
    except ValueError as exc:  # ShardingAssertionError is a ValueError too
        return str(exc)
    return None


def check_optimizer_accepts(pp: int, comm_overlap: bool, buffer_size_MB: float,
                            partition_strategy: Optional[str] = None,
                            unfused_flag: Optional[str] = None) -> None:
    """:func:`optimizer_refusal` as a tool input error naming the tool's flags.

    Args:
        unfused_flag: the flag that turns fused buffers off (``verify
            --unfused``; default ``--buffer-size-MB <value>``).

    Raises:
        InputError: the optimizer refuses them, with its reason.
    """
    why = optimizer_refusal(pp, comm_overlap, buffer_size_MB, partition_strategy)
    if why is None:
        return
    flags = [f for f in ("--comm-overlap" if comm_overlap else "",
                         f"--pp {pp}" if pp > 1 else "",
                         "" if buffer_size_MB > 0 else unfused_flag
                         or f"--buffer-size-MB {buffer_size_MB:g}") if f]
    raise InputError(" ".join(flags) or "these flags", "(as sharding settings)",
                     f"refused by MuonShardingOptimizer: {why.rstrip('.')}",
                     "change the flag that sets the option it names")


def _short(value: Any, limit: int = 80) -> str:
    """``value`` as JSON text cut at ``limit`` characters; safe for hostile nesting."""
    try:
        text = json.dumps(value)
    except (RecursionError, TypeError, ValueError):
        return "<nested too deeply to show>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_shape(where: str, shape: Any, use_muon: Optional[bool]) -> tuple:
    """A parameter shape: 1 to 3 positive integer dims, 2 or 3 for a Muon matrix.

    Args:
        where: e.g. ``"model file m.json entry 3 ('w')"``.
        shape: the raw JSON value.
        use_muon: the entry's flag (None: decided later by the shape).
    """
    fix = "give a list of 1 to 3 positive integers, e.g. [1024, 4096]"
    if not isinstance(shape, (list, tuple)):
        raise InputError(f"{where} shape", _short(shape), "is not a list", fix)
    if not 1 <= len(shape) <= 3:
        raise InputError(f"{where} shape", _short(shape), f"has {len(shape)} dims", fix)
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, int):
            raise InputError(f"{where} shape", _short(shape),
                             f"dimension {_short(d, 40) if isinstance(d, (list, dict)) else repr(d)[:40]} "
                             "is not an integer", fix)
        if not 1 <= d <= LIMITS.dim:
            raise InputError(f"{where} shape", _short(shape), f"dimension {d} is outside "
                             f"1..{LIMITS.dim}", fix)
    if use_muon and len(shape) == 1:
        raise InputError(f"{where} shape", _short(shape), "is 1-D but use_muon is true "
                         "(Muon needs a 2-D or 3-D matrix)", "drop use_muon or fix the shape")
    return tuple(shape)


def read_regular_file(what: str, path: str, max_bytes: int, fix: str) -> bytes:
    """The bytes of ``path``, refused before any blocking read unless it is a
    non-empty regular file of at most ``max_bytes``.

    The file is opened non-blocking and checked on the open descriptor (so a
    symlink swapped after a check is still caught): a FIFO, a device, a
    directory and a size-0 "regular" file - what ``/proc/kmsg`` and other
    kernel pseudo-files look like; reading one can block forever - are
    refused; a file growing while it is read is cut at ``max_bytes`` + 1 and
    refused.

    Args:
        what: the input, named in the error (``"model file"``).
        path: the path given.
        max_bytes: the largest size accepted.
        fix: what to pass instead.

    Returns:
        bytes: the whole file.

    Raises:
        InputError: naming the path and why.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except ValueError as exc:  # e.g. an embedded NUL byte
        raise InputError(what, repr(path), f"is not a usable path ({exc})", fix) from None
    except OSError as exc:
        raise InputError(what, path, (exc.strerror or str(exc)).lower(), fix) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise InputError(what, path, "is a directory", fix)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(what, path, "is not a regular file (a pipe or a device)", fix)
        if st.st_size == 0:
            raise InputError(what, path, "is empty (or a kernel file such as /proc/..., "
                             "whose reads can block)", fix)
        if st.st_size > max_bytes:
            raise InputError(what, path, f"is {st.st_size} bytes, above the limit "
                             f"{max_bytes}", fix)
        chunks, left = [], max_bytes + 1
        while left > 0:
            try:
                chunk = os.read(fd, min(left, 1 << 20))
            except OSError as exc:  # an I/O error, a file that refuses reads
                raise InputError(what, path, f"cannot be read ({exc.strerror or exc})",
                                 fix) from None
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > max_bytes:
            raise InputError(what, path, f"grew above the limit {max_bytes} bytes while "
                             "being read", fix)
        return data
    finally:
        os.close(fd)


def read_model_file(path: str) -> List[dict]:
    """Read a model JSON file and validate every entry.

    Returns:
        list[dict]: entries with ``name`` (str), ``shape`` (tuple), ``dtype``,
        ``is_expert``, ``use_muon`` (None when absent).

    Raises:
        InputError: naming the file and, for a bad entry, its index and name.
    """
    what = "model file"
    raw = read_regular_file(what, path, LIMITS.model_file_bytes,
                            "pass a JSON parameter list or a preset name")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise InputError(what, path, "is not UTF-8 text", "pass a JSON file") from None
    except json.JSONDecodeError as exc:
        raise InputError(what, path, f"is not valid JSON (line {exc.lineno}: {exc.msg})",
                         "fix the file") from None
    except RecursionError:
        raise InputError(what, path, "is nested too deeply to read",
                         'give a flat list [{"name": ..., "shape": [...]}, ...]') from None
    except ValueError as exc:
        # Python refuses to convert an integer of more than
        # sys.get_int_max_str_digits() digits (4300) and does not say where
        place = _long_integer(raw.decode("utf-8"))
        if place is None:
            raise InputError(what, path, f"cannot be read ({exc})", "fix the file") from None
        digits, line, column = place
        raise InputError(what, path, f"holds an integer of {digits} digits at line {line}, "
                         f"column {column} (Python reads at most {_int_digits()})",
                         f"write each dimension as an integer of at most {LIMITS.dim}") from None
    if isinstance(data, dict):
        data = data.get("params")
    if not isinstance(data, list) or not data:
        raise InputError(what, path, "holds no parameter list",
                         'give [{"name": ..., "shape": [...]}, ...] or {"params": [...]}')
    if len(data) > LIMITS.model_entries:
        raise InputError(what, path, f"has {len(data)} parameters, above the limit "
                         f"{LIMITS.model_entries}", "trim the parameter list")
    return [_entry(path, i, obj) for i, obj in enumerate(data)]


# A JSON string (skipped) or number, to find an integer token in the text.
_JSON_STRING_OR_NUMBER = re.compile(r'"(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?')


def _int_digits() -> int:
    """The most digits Python converts to an int (no limit before 3.11: 0)."""
    return sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 0


def _long_integer(text: str) -> Optional[tuple]:
    """(digits, line, column) of the first JSON integer longer than Python
    converts, or None."""
    limit = _int_digits()
    if not limit:
        return None
    for m in _JSON_STRING_OR_NUMBER.finditer(text):
        token = m.group().lstrip("-")
        if token.isdigit() and len(token) > limit:
            start = m.start()
            return len(token), text.count("\n", 0, start) + 1, start - text.rfind("\n", 0, start)
    return None


def _entry(path: str, index: int, obj: Any) -> dict:
    if type(obj) is dict:
        # the common case, a valid entry, checked without building the message
        # text (200,000 entries): any doubt goes to the checks below
        name, shape = obj.get("name"), obj.get("shape")
        dtype = obj.get("dtype", "float32")
        is_expert, use_muon = obj.get("is_expert"), obj.get("use_muon")
        dim = LIMITS.dim
        if (type(name) is str and name and type(shape) is list and 1 <= len(shape) <= 3
                and all(type(d) is int and 1 <= d <= dim for d in shape)
                and (use_muon is None or type(use_muon) is bool)
                and (is_expert is None or type(is_expert) is bool)
                and type(dtype) is str and dtype in _DTYPES
                and not (use_muon and len(shape) == 1)):
            return {"name": name, "shape": tuple(shape), "dtype": dtype,
                    "is_expert": bool(is_expert), "use_muon": use_muon}
    return _entry_checked(path, index, obj)


def _entry_checked(path: str, index: int, obj: Any) -> dict:
    """:func:`_entry` naming the first problem of ``obj``."""
    where = f"model file {path} entry {index}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise InputError(where, _short(obj), "needs a non-empty string 'name' "
                         "and a 'shape'", 'write {"name": "w", "shape": [1024, 1024]}')
    name = obj["name"] if len(obj["name"]) <= 60 else obj["name"][:57] + "..."
    where = f"{where} ({name!r})"
    if "shape" not in obj:
        raise InputError(where, "", "has no 'shape'", "add one, e.g. [1024, 1024]")
    use_muon = obj.get("use_muon")
    for key in ("is_expert", "use_muon"):
        if obj.get(key) is not None and not isinstance(obj[key], bool):
            raise InputError(f"{where} {key}", _short(obj[key]), "is not true/false",
                             "write true or false")
    dtype = obj.get("dtype", "float32")
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise InputError(f"{where} dtype", repr(dtype) if isinstance(dtype, str) and
                         len(dtype) <= 40 else _short(dtype), "is not a known dtype",
                         f"use one of {', '.join(_DTYPES)}")
    return {"name": obj["name"], "shape": check_shape(where, obj["shape"], use_muon),
            "dtype": dtype, "is_expert": bool(obj.get("is_expert", False)),
            "use_muon": use_muon}


#: The parameter dtypes a model file may name.
DTYPES = ("float32", "bfloat16", "float16", "float64")
_DTYPES = DTYPES


def check_local_size(gpus_per_node: int, environ: Optional[dict] = None) -> Optional[str]:
    """One line when ``PADDLE_LOCAL_SIZE`` disagrees with ``--gpus-per-node``.

    Returns:
        ``"note: ..."`` or None when they agree or the variable is unset.
    """
    env = os.environ if environ is None else environ
    raw = env.get("PADDLE_LOCAL_SIZE")
    if raw is None or raw.strip() == "" or raw.strip() == str(gpus_per_node):
        return None
    return (f"note: PADDLE_LOCAL_SIZE={raw} (set by a launcher in this environment) "
            f"disagrees with --gpus-per-node {gpus_per_node}; the tool uses "
            f"--gpus-per-node, the optimizer in a job would use PADDLE_LOCAL_SIZE")


def format_limits(names: Sequence[str] = ()) -> str:
    """``name=value`` pairs of :data:`LIMITS` (for ``--help`` epilogs)."""
    fields = names or [f for f in LIMITS.__dataclass_fields__]
    return ", ".join(f"{f}={getattr(LIMITS, f):g}" if isinstance(getattr(LIMITS, f), float)
                     else f"{f}={getattr(LIMITS, f)}" for f in fields)
