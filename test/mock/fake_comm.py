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
"""The fake collective layer: per-rank state, recording, and data movement.

``FakeComm`` implements every collective entry point the Muon sharding
optimizer uses. The patch layer (``patching.py``) routes Paddle's module
attributes to it; the rank issuing a call is the rank bound to the calling
thread (``bind``), so many simulated ranks can share one process.

Two modes:
  * ``"record"``: every call is logged and returns a completed task at once;
    no data moves and nothing waits (ranks may run one after another).
  * ``"data"``: ranks run concurrently in threads. A collective is matched
    across the group by ``(group id, per-group sequence number)``; once all
    members arrived, results are computed in float64 NumPy and each rank
    writes its own result into its own tensors when it waits the task (sync
    ops wait at once). Like real backends, non-root buffers of a reduce are
    poisoned (NaN by default) so code that reads them fails loudly.
    Instead of hanging, a wait fails fast when every live rank is blocked
    (a certain deadlock) or when nothing progressed for ``deadlock_timeout``.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
import paddle

from .comm_record import (
    OP_COALESCE_BEGIN,
    OP_COALESCE_END,
    OP_NEW_GROUP,
    CommRecord,
    PhaseProvider,
    default_phase_provider,
    describe_signature,
    format_ranks,
    reduce_op_name,
)
from .fake_groups import FIRST_GROUP_ID, GLOBAL_GROUP_ID, CompletedTask, FakeGroup

_DEFAULT = object()  # sentinel: "resolve the default phase provider"


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------
class FakeCommError(RuntimeError):
    """Base class of errors raised by the fake collective layer."""


class NonMemberCollectiveError(FakeCommError):
    """A rank issued a collective on a group it is not a member of."""


class GroupCreationMismatchError(FakeCommError):
    """Two ranks created different groups under the same group id."""


class CollectiveMismatchError(FakeCommError):
    """Members of a group issued different collectives at the same sequence."""


class DeadlockError(FakeCommError):
    """Ranks wait on collectives that can never complete."""


class RankAborted(FakeCommError):
    """Raised inside a rank because another rank failed or a deadlock was found."""


class InvalidCollectiveError(AssertionError):
    """Arguments Paddle would reject (root outside group, wrong sizes, ...)."""


# --------------------------------------------------------------------------
# Tensor helpers (float64 NumPy <-> Paddle, in place)
# --------------------------------------------------------------------------
_NP_DTYPES = {
    "float32": np.float32,
    "float64": np.float64,
    "float16": np.float16,
    "int32": np.int32,
    "int64": np.int64,
    "int8": np.int8,
    "uint8": np.uint8,
    "int16": np.int16,
    "bool": np.bool_,
}


_FLIGHT_MODULE = (
    "paddle_muon_ext.distributed.fleet.meta_optimizers.muon_flight.recorder"
)


def flight_recorder_module() -> Any:
    """The package's flight-recorder module (None when not importable)."""
    try:
        import importlib

        return importlib.import_module(_FLIGHT_MODULE)
    except ImportError:
        return None


def _flight_entry(rec: CommRecord) -> dict:
    """A record as a flight-recorder dump entry."""
    return {"seq": rec.rank_seq, "group_seq": rec.group_seq, "phase": rec.phase,
            "op": rec.op, "group_id": rec.group_id, "group_ranks": list(rec.group_ranks),
            "root": rec.root, "dtype": rec.dtype, "numel": rec.numel,
            "start": None, "finish": None}


def dtype_name(tensor: Any) -> str:
    """Returns: the Paddle dtype of ``tensor`` as a short name, e.g. "bfloat16"."""
    return str(tensor.dtype).rsplit(".", 1)[-1]


def numel(tensor: Any) -> int:
    """Returns: the element count of ``tensor``."""
    return int(math.prod(tensor.shape))


def to_float64(tensor: Any) -> np.ndarray:
    """Snapshot ``tensor`` as a flat float64 array (bf16 via paddle.cast).

    Args:
        tensor: any Paddle tensor, including ``_slice`` views.

    Returns:
        A new flat float64 array.
    """
    if dtype_name(tensor) == "bfloat16":
        arr = paddle.cast(tensor, "float32").numpy()
    else:
        arr = tensor.numpy()
    return np.asarray(arr, dtype=np.float64).reshape(-1)


def write_float64(tensor: Any, values: np.ndarray) -> None:
    """Write ``values`` into ``tensor``'s storage in place, casting to its dtype.

    Uses ``set_value`` because it writes through ``_slice``/view storage and,
    unlike ``copy_``, attaches no autograd node to parameters.

    Args:
        tensor: destination (keeps its identity and dtype).
        values: float64 data with ``numel(tensor)`` elements.
    """
    shape = tuple(tensor.shape)
    name = dtype_name(tensor)
    if name == "bfloat16":
        src = paddle.cast(paddle.to_tensor(values.astype(np.float32).reshape(shape)), "bfloat16")
        tensor.set_value(src)
        return
    np_dtype = _NP_DTYPES.get(name)
    if np_dtype is None:
        raise InvalidCollectiveError(f"fake collectives do not support dtype {name}")
    if np.issubdtype(np_dtype, np.integer):
        values = np.rint(values)
    tensor.set_value(values.astype(np_dtype).reshape(shape))


def poison(tensor: Any, value: float) -> None:
    """Overwrite ``tensor`` with ``value`` (ints: dtype min; bool untouched).

    Args:
        tensor: the buffer whose content is undefined after the collective.
        value: fill value for floating dtypes (NaN by default).
    """
    name = dtype_name(tensor)
    if name == "bool":
        return
    np_dtype = _NP_DTYPES.get(name)
    if np_dtype is not None and np.issubdtype(np_dtype, np.integer):
        fill = float(np.iinfo(np_dtype).min)
    else:
        fill = value
    write_float64(tensor, np.full(numel(tensor), fill, dtype=np.float64))


def combine(reduce_op: str, arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Reduce per-rank float64 arrays elementwise.

    Args:
        reduce_op: "SUM", "AVG", "MAX", "MIN" or "PROD".
        arrays: one flat array per rank, same length.

    Returns:
        The reduced float64 array.
    """
    stack = np.stack(arrays)
    if reduce_op == "SUM":
        return stack.sum(axis=0)
    if reduce_op == "AVG":
        return stack.mean(axis=0)
    if reduce_op == "MAX":
        return stack.max(axis=0)
    if reduce_op == "MIN":
        return stack.min(axis=0)
    if reduce_op == "PROD":
        return stack.prod(axis=0)
    raise InvalidCollectiveError(f"unsupported reduce op {reduce_op}")


# --------------------------------------------------------------------------
# Per-rank state
# --------------------------------------------------------------------------
class RankContext:
    """Everything the fake layer keeps for one simulated rank.

    Attributes:
        rank: global rank.
        trace: the rank's ``CommRecord`` list, in issue order.
        group_seq: per group id, the number of collectives issued on it.
        next_gid: next id ``new_group`` hands out (a per-process counter in
            Paddle, so ids agree only if all ranks create groups in order).
        block_stack: open coalescing blocks, innermost last.
        block_counts: per coalescing group id, blocks opened so far.
        hcg: this rank's hybrid communicate group (or None).
        default_group: the global group as seen by this rank.
        pending: data-mode tasks issued but not yet waited.
    """

    def __init__(self, comm: "FakeComm", rank: int) -> None:
        self.rank = rank
        self.trace: list[CommRecord] = []
        self.group_seq: dict[int, int] = {}
        self.next_gid = FIRST_GROUP_ID
        self.block_stack: list[tuple] = []
        self.block_counts: dict[int, int] = {}
        self.hcg: Any = None
        self.pending: list[_DataTask] = []
        self.thread_ident: Optional[int] = None
        ranks = comm.global_ranks
        self.default_group = FakeGroup(rank, GLOBAL_GROUP_ID, ranks, comm, rank)
        comm._intern_group(GLOBAL_GROUP_ID, ranks, rank)


class _Exchange:
    """One collective instance matched across a group: key (gid, group seq)."""

    __slots__ = ("key", "ranks", "arrivals", "done", "error", "outputs")

    def __init__(self, key: tuple, ranks: tuple) -> None:
        self.key = key
        self.ranks = ranks
        self.arrivals: dict[int, tuple[CommRecord, Any]] = {}
        self.done = False
        self.error: Optional[BaseException] = None
        self.outputs: dict[int, Any] = {}

    def first_record(self) -> CommRecord:
        return next(iter(self.arrivals.values()))[0]


_POISON = object()  # output marker: "this rank's buffer is undefined now"


class _DataTask:
    """Task of a data-mode collective: ``wait`` blocks until all members
    arrived, then writes this rank's result into its tensors."""

    __slots__ = ("_comm", "_exchange", "_rank", "_apply", "_applied", "_sync")

    def __init__(self, comm: "FakeComm", exchange: _Exchange, rank: int,
                 apply: Callable[[Any], None], sync: bool) -> None:
        self._comm = comm
        self._exchange = exchange
        self._rank = rank
        self._apply = apply
        self._applied = False
        self._sync = sync

    def wait(self, timeout: Any = None) -> bool:
        """Block until the collective completes, then write the result.

        Args:
            timeout: ignored; the layer's deadlock detector bounds the wait.

        Returns:
            True.
        """
        if not self._applied:
            self._comm._wait_exchange(self._exchange, self._rank)
            self._applied = True
            self._apply(self._exchange.outputs.get(self._rank))
        return True

    def is_completed(self) -> bool:
        """Returns: whether all members arrived (the result is then written)."""
        if self._applied:
            return True
        with self._comm._cv:
            done = self._exchange.done
        if done:
            self.wait()
        return done

    def is_sync(self) -> bool:
        """Returns: whether the op was issued with ``sync_op=True``."""
        return self._sync

    def synchronize(self) -> None:
        """Same as ``wait``."""
        self.wait()


# --------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------
class FakeComm:
    """Fake process-group world shared by all simulated ranks of one run.

    Args:
        world_size: number of global ranks.
        mode: "record" (log only, return completed tasks) or "data" (threads
            rendezvous and move real data).
        hcg_factory: ``hcg_factory(rank)`` builds a rank's hybrid
            communicate group when the rank is bound (inside the rank's
            context, so its group creations are recorded).
        phase_provider: callable returning the current phase label; default
            is the optimizer's ``phase_of_thread`` when importable.
        poison_value: value written into non-root buffers after a reduce in
            data mode; None disables poisoning.
        strict_membership: in data mode, raise at once when a rank issues a
            collective on a group it is not in (Paddle silently skips it).
        deadlock_timeout: seconds without any progress after which waiting
            ranks fail with ``DeadlockError``.
    """

    def __init__(
        self,
        world_size: int,
        mode: str = "record",
        *,
        hcg_factory: Optional[Callable[[int], Any]] = None,
        phase_provider: Any = _DEFAULT,
        poison_value: Optional[float] = float("nan"),
        strict_membership: bool = True,
        deadlock_timeout: float = 10.0,
    ) -> None:
        if mode not in ("record", "data"):
            raise ValueError(f"mode must be 'record' or 'data', got {mode!r}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.mode = mode
        self.hcg_factory = hcg_factory
        self.phase_provider: Optional[PhaseProvider] = (
            default_phase_provider() if phase_provider is _DEFAULT else phase_provider
        )
        self.poison_value = poison_value
        self.strict_membership = strict_membership
        self.deadlock_timeout = deadlock_timeout
        self.global_ranks = tuple(range(world_size))

        self._tls = threading.local()
        self._default_ctx: Optional[RankContext] = None
        self.contexts: dict[int, RankContext] = {}
        # One condition guards all shared state below (registry, exchanges,
        # liveness); contention is low at tens of ops per rank.
        self._cv = threading.Condition(threading.Lock())
        self._group_registry: dict[int, tuple[tuple, int]] = {}
        self._exchanges: dict[tuple, _Exchange] = {}
        self._live: set[int] = set()
        self._blocked: dict[int, _Exchange] = {}
        self._finished: set[int] = set()
        self._last_progress = time.monotonic()
        self.abort: Optional[tuple[str, str]] = None  # (kind, message)
        self.failures: list[tuple[int, BaseException, str]] = []

    # ---------------------------------------------------------------- ranks
    def bind(self, rank: int, *, default: bool = False) -> RankContext:
        """Make ``rank`` the rank of the calling thread and build its hcg.

        Args:
            rank: global rank.
            default: also use it for threads that bound no rank.

        Returns:
            The rank's context.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        ctx = self.contexts.get(rank)
        if ctx is None:
            ctx = RankContext(self, rank)
            self.contexts[rank] = ctx
        self._tls.ctx = ctx
        ctx.thread_ident = threading.get_ident()
        if default:
            self._default_ctx = ctx
        with self._cv:
            self._live.add(rank)
            self._finished.discard(rank)
        if self.hcg_factory is not None and ctx.hcg is None:
            ctx.hcg = self.hcg_factory(rank)
        return ctx

    def expect_ranks(self, ranks: Sequence[int]) -> None:
        """Declare ranks as running before their threads start.

        Without this, the first rank to block could look like the only live
        rank and be reported as deadlocked while its peers are still starting.

        Args:
            ranks: global ranks that will run.
        """
        with self._cv:
            self._live.update(ranks)

    def unbind(self) -> None:
        """Detach the calling thread from its rank."""
        self._tls.ctx = None

    def current(self) -> RankContext:
        """Returns: the context of the rank bound to the calling thread."""
        ctx = getattr(self._tls, "ctx", None) or self._default_ctx
        if ctx is None:
            raise FakeCommError(
                "no simulated rank is bound to this thread; use SimulatedWorld.run "
                "or fake_distributed(rank=...)"
            )
        return ctx

    def current_rank(self) -> int:
        """Returns: the global rank of the calling thread."""
        return self.current().rank

    @property
    def traces(self) -> list[list[CommRecord]]:
        """Per-rank traces indexed by global rank (empty for unbound ranks)."""
        return [self.contexts[r].trace if r in self.contexts else [] for r in range(self.world_size)]

    # ---------------------------------------------------------------- groups
    def _intern_group(self, gid: int, ranks: tuple, rank: int) -> tuple:
        """Register ``gid -> ranks``; return the shared tuple or flag a clash."""
        with self._cv:
            prev = self._group_registry.get(gid)
            if prev is None:
                self._group_registry[gid] = (ranks, rank)
                return ranks
            if prev[0] == ranks:
                return prev[0]
        if self.mode == "data":
            raise GroupCreationMismatchError(
                f"rank {rank} created group id {gid} with ranks {format_ranks(ranks)}, but rank "
                f"{prev[1]} created group id {gid} with ranks {format_ranks(prev[0])}: ranks do "
                f"not call new_group for the same groups in the same order"
            )
        return ranks

    def new_group(self, ranks: Optional[Sequence[int]] = None, *args: Any, **kwargs: Any) -> FakeGroup:
        """Fake ``paddle.distributed.new_group`` (extra args accepted, ignored).

        Args:
            ranks: global ranks; None means all ranks.

        Returns:
            A ``FakeGroup``; rank -1 and no process group for non-members and
            single-rank groups, as in Paddle.
        """
        ctx = self.current()
        gid = ctx.next_gid
        ctx.next_gid = gid + 1
        members = self.global_ranks if ranks is None else tuple(sorted(ranks))
        # Hot path (a 512-rank hcg creates ~1M groups in total): a lock-free
        # hit on the registry; only first creations and clashes take the lock.
        known = self._group_registry.get(gid)
        if known is not None and known[0] == members:
            members = known[0]
        else:
            members = self._intern_group(gid, members, ctx.rank)
        is_in = ctx.rank in members
        rank_in_group = members.index(ctx.rank) if (is_in and len(members) > 1) else -1
        group = FakeGroup(rank_in_group, gid, members, self, ctx.rank)
        ctx.trace.append(CommRecord(len(ctx.trace), None, ctx.rank, OP_NEW_GROUP, gid, members,
                                    numel=len(members), api="dist.new_group", member=is_in))
        return group

    def default_group(self) -> FakeGroup:
        """Returns: the global group as seen by the calling rank."""
        return self.current().default_group

    def get_rank(self, group: Any = None) -> int:
        """Fake ``paddle.distributed.get_rank``: group rank if a group is given."""
        if group is not None:
            return group.rank
        return self.current().rank

    def get_world_size(self, group: Any = None) -> int:
        """Fake ``paddle.distributed.get_world_size``."""
        if group is not None:
            return group.world_size
        return self.world_size

    # ---------------------------------------------------------- coalescing
    def start_coalescing(self, group: FakeGroup) -> None:
        """Open a coalescing block on ``group`` for the calling rank."""
        ctx = self.current()
        k = ctx.block_counts.get(group.id, 0)
        ctx.block_counts[group.id] = k + 1
        block = (group.id, k)
        ctx.block_stack.append(block)
        ctx.trace.append(CommRecord(len(ctx.trace), None, ctx.rank, OP_COALESCE_BEGIN, group.id,
                                    group.ranks_tuple, block=block, phase=self._phase(),
                                    api="pg._start_coalescing", member=True))

    def end_coalescing(self, group: FakeGroup, tasks: Optional[list] = None) -> None:
        """Close the innermost coalescing block, which must belong to ``group``."""
        ctx = self.current()
        if not ctx.block_stack or ctx.block_stack[-1][0] != group.id:
            raise FakeCommError(
                f"rank {ctx.rank}: _end_coalescing on group {group.id} but the open "
                f"coalescing blocks are {ctx.block_stack}"
            )
        block = ctx.block_stack.pop()
        ctx.trace.append(CommRecord(len(ctx.trace), None, ctx.rank, OP_COALESCE_END, group.id,
                                    group.ranks_tuple, block=block, phase=self._phase(),
                                    api="pg._end_coalescing", member=True))

    def _phase(self) -> Optional[str]:
        provider = self.phase_provider
        return provider() if provider is not None else None

    # ---------------------------------------------------------- collectives
    def reduce(self, tensor: Any, dst: int, op: Any = 0, group: Any = None,
               sync_op: bool = True, use_calc_stream: bool = False, api: str = "dist.reduce") -> Any:
        """Reduce ``tensor`` of all members onto GLOBAL rank ``dst``.

        Returns:
            A task (None on a group this rank is not a member of, as Paddle).
        """
        group = group if group is not None else self.default_group()
        self._check_root(dst, group, "reduce", "dst")
        name = reduce_op_name(op)
        apply = self._make_apply_single(tensor, root=dst)
        return self._issue("reduce", api, group, tensor, numel(tensor), dst, name, sync_op,
                           use_calc_stream, lambda: to_float64(tensor), apply)

    def broadcast(self, tensor: Any, src: int, group: Any = None, sync_op: bool = True,
                  use_calc_stream: bool = False, api: str = "dist.broadcast") -> Any:
        """Copy ``tensor`` of GLOBAL rank ``src`` to every member.

        Returns:
            A task (None on a group this rank is not a member of, as Paddle).
        """
        group = group if group is not None else self.default_group()
        self._check_root(src, group, "broadcast", "src")
        apply = self._make_apply_single(tensor)
        return self._issue("broadcast", api, group, tensor, numel(tensor), src, None, sync_op,
                           use_calc_stream, lambda: to_float64(tensor), apply)

    def all_reduce(self, tensor: Any, op: Any = 0, group: Any = None, sync_op: bool = True,
                   use_calc_stream: bool = False, api: str = "dist.all_reduce") -> Any:
        """Reduce ``tensor`` over members; every member gets the result.

        Returns:
            A task (None on a group this rank is not a member of, as Paddle).
        """
        group = group if group is not None else self.default_group()
        apply = self._make_apply_single(tensor)
        return self._issue("all_reduce", api, group, tensor, numel(tensor), None,
                           reduce_op_name(op), sync_op, use_calc_stream,
                           lambda: to_float64(tensor), apply)

    def all_gather(self, tensor_or_tensor_list: Any, tensor: Any, group: Any = None,
                   sync_op: bool = True, use_calc_stream: bool = False,
                   api: str = "dist.all_gather") -> Any:
        """Gather ``tensor`` of every member, in group-rank order.

        Args:
            tensor_or_tensor_list: an empty list (filled with nranks new
                tensors, as Paddle does), a list of nranks tensors, or one
                tensor receiving nranks x numel(tensor) elements.
            tensor: this rank's contribution.

        Returns:
            A task (None on a group this rank is not a member of, as Paddle).
        """
        group = group if group is not None else self.default_group()
        if not isinstance(tensor_or_tensor_list, (list, tuple)):
            return self.all_gather_into_tensor(tensor_or_tensor_list, tensor, group, sync_op,
                                               use_calc_stream, api=api)
        out_list = tensor_or_tensor_list
        if group.is_member() and len(out_list) == 0:
            # Paddle fills an empty list before issuing; callers keep refs.
            maker = paddle.zeros_like if self.mode == "record" else paddle.empty_like
            out_list += [maker(tensor) for _ in range(group.nranks)]
        if group.is_member() and len(out_list) != group.nranks:
            raise InvalidCollectiveError(
                f"all_gather on group {group.id}: got {len(out_list)} output tensors for "
                f"{group.nranks} ranks"
            )

        def apply(parts: Any) -> None:
            for out, part in zip(out_list, parts):
                write_float64(out, part)

        return self._issue("all_gather", api, group, tensor, numel(tensor), None, None, sync_op,
                           use_calc_stream, lambda: to_float64(tensor), apply)

    def all_gather_into_tensor(self, out_tensor: Any, in_tensor: Any, group: Any = None,
                               sync_op: bool = True, use_calc_stream: bool = False,
                               api: str = "stream.all_gather") -> Any:
        """All-gather into one flat tensor (``process_group.all_gather(in, out)``).

        Returns:
            A task (None on a group this rank is not a member of, as Paddle).
        """
        group = group if group is not None else self.default_group()
        n_in = numel(in_tensor)
        if group.is_member() and numel(out_tensor) != n_in * group.nranks:
            raise InvalidCollectiveError(
                f"all_gather on group {group.id}: output has {numel(out_tensor)} elements, "
                f"expected {group.nranks} x {n_in}"
            )

        def apply(parts: Any) -> None:
            write_float64(out_tensor, np.concatenate(parts))

        return self._issue("all_gather", api, group, in_tensor, n_in, None, None, sync_op,
                           use_calc_stream, lambda: to_float64(in_tensor), apply)

    def reduce_scatter(self, tensor: Any, tensor_or_tensor_list: Any, op: Any = 0,
                       group: Any = None, sync_op: bool = True, use_calc_stream: bool = False,
                       api: str = "dist.reduce_scatter") -> Any:
        """Reduce the full input over members; member i gets chunk i.

        Args:
            tensor: output shard (may alias the input, e.g. a ``_slice``).
            tensor_or_tensor_list: flat input of nranks x numel(tensor)
                elements, or a list of nranks tensors.

        Returns:
            A task (None on a group this rank is not a member of, as Paddle).
        """
        group = group if group is not None else self.default_group()
        n_out = numel(tensor)
        src = tensor_or_tensor_list
        if group.is_member():
            if isinstance(src, (list, tuple)):
                bad = [numel(t) for t in src if numel(t) != n_out]
                if len(src) != group.nranks or bad:
                    raise InvalidCollectiveError(
                        f"reduce_scatter on group {group.id}: input list needs {group.nranks} "
                        f"tensors of {n_out} elements, got {[numel(t) for t in src]}"
                    )
            elif numel(src) != n_out * group.nranks:
                raise InvalidCollectiveError(
                    f"reduce_scatter on group {group.id}: input has {numel(src)} elements, "
                    f"expected {group.nranks} x {n_out}"
                )

        def snapshot() -> np.ndarray:
            if isinstance(src, (list, tuple)):
                return np.concatenate([to_float64(t) for t in src])
            return to_float64(src)

        apply = self._make_apply_single(tensor)
        return self._issue("reduce_scatter", api, group, tensor, n_out, None, reduce_op_name(op),
                           sync_op, use_calc_stream, snapshot, apply)

    # ------------------------------------------------------------ internals
    def _check_root(self, root: int, group: Any, op: str, arg: str) -> None:
        if group.is_member() and root not in group.ranks_tuple:
            raise InvalidCollectiveError(
                f"{op} on group {group.id} {format_ranks(group.ranks_tuple)}: {arg}={root} is not "
                f"a member (Paddle takes a GLOBAL rank here)"
            )

    def _make_apply_single(self, tensor: Any, root: Optional[int] = None) -> Callable[[Any], None]:
        poison_value = self.poison_value

        def apply(out: Any) -> None:
            if out is None:
                return
            if out is _POISON:
                if poison_value is not None:
                    poison(tensor, poison_value)
                return
            write_float64(tensor, out)

        return apply

    def _issue(self, op: str, api: str, group: Any, tensor: Any, count: int, root: Optional[int],
               reduce_op: Optional[str], sync_op: bool, use_calc_stream: bool,
               snapshot: Callable[[], Any], apply: Callable[[Any], None]) -> Any:
        if not sync_op and use_calc_stream:
            raise RuntimeError("use_calc_stream can only be true in sync op behavior.")
        ctx = self.current()
        if self.abort is not None:
            self._raise_abort(ctx.rank)
        members = group.ranks_tuple
        is_in = ctx.rank in members
        seq = ctx.group_seq.get(group.id, 0)
        ctx.group_seq[group.id] = seq + 1
        block = ctx.block_stack[-1] if ctx.block_stack else None
        rec = CommRecord(len(ctx.trace), seq, ctx.rank, op, group.id, members, root, reduce_op,
                         dtype_name(tensor), count, block, self._phase(), sync_op, api, is_in)
        ctx.trace.append(rec)
        if not is_in:
            if self.mode == "data" and self.strict_membership:
                raise NonMemberCollectiveError(
                    f"rank {ctx.rank} issued {rec.describe()} on group {group.id} "
                    f"{format_ranks(members)}, which it is not a member of"
                )
            return None
        if not group.is_member():
            # Single-rank group: Paddle returns None without communicating.
            return None
        if self.mode == "record":
            return CompletedTask(sync_op)
        task = self._arrive(ctx, rec, snapshot(), apply, sync_op)
        if sync_op or use_calc_stream:
            task.wait()
        else:
            ctx.pending.append(task)
        return task

    def _arrive(self, ctx: RankContext, rec: CommRecord, payload: Any,
                apply: Callable[[Any], None], sync_op: bool) -> _DataTask:
        key = (rec.group_id, rec.group_seq)
        with self._cv:
            ex = self._exchanges.get(key)
            if ex is None:
                ex = _Exchange(key, rec.group_ranks)
                self._exchanges[key] = ex
            ex.arrivals[ctx.rank] = (rec, payload)
            self._last_progress = time.monotonic()
            if len(ex.arrivals) == len(ex.ranks):
                del self._exchanges[key]
                self._complete(ex)
                self._cv.notify_all()
        return _DataTask(self, ex, ctx.rank, apply, sync_op)

    def _complete(self, ex: _Exchange) -> None:
        """Compute every member's output (called by the last arriver, locked)."""
        ex.done = True
        recs = [ex.arrivals[r][0] for r in ex.ranks]
        sigs = {rec.signature()[:5] for rec in recs}
        if len(sigs) > 1 or any(rec.group_ranks != ex.ranks for rec in recs):
            lines = [f"  rank {rec.rank}: {rec.describe()}" for rec in recs]
            ex.error = CollectiveMismatchError(
                f"group {ex.key[0]} {format_ranks(ex.ranks)}, per-group seq {ex.key[1]}: members "
                f"issued different collectives:\n" + "\n".join(lines)
            )
            return
        rec = recs[0]
        inputs = [ex.arrivals[r][1] for r in ex.ranks]
        try:
            if rec.op == "reduce":
                total = combine(rec.reduce_op, inputs)
                for r in ex.ranks:
                    ex.outputs[r] = total if r == rec.root else _POISON
            elif rec.op == "broadcast":
                value = inputs[ex.ranks.index(rec.root)]
                for r in ex.ranks:
                    ex.outputs[r] = None if r == rec.root else value
            elif rec.op == "all_reduce":
                total = combine(rec.reduce_op, inputs)
                for r in ex.ranks:
                    ex.outputs[r] = total
            elif rec.op == "all_gather":
                for r in ex.ranks:
                    ex.outputs[r] = inputs
            elif rec.op == "reduce_scatter":
                total = combine(rec.reduce_op, inputs)
                n = rec.numel
                for i, r in enumerate(ex.ranks):
                    ex.outputs[r] = total[i * n:(i + 1) * n]
            else:  # pragma: no cover - op names are internal
                raise InvalidCollectiveError(f"unknown op {rec.op}")
        except Exception as exc:  # surfaced in every member's wait
            ex.error = exc

    def _wait_exchange(self, ex: _Exchange, rank: int) -> None:
        with self._cv:
            if not ex.done:
                self._blocked[rank] = ex
                try:
                    self._check_deadlock_locked()
                    while not ex.done and self.abort is None:
                        self._cv.wait(timeout=0.25)
                        if not ex.done and self.abort is None:
                            self._check_stall_locked()
                finally:
                    self._blocked.pop(rank, None)
            if not ex.done:
                self._raise_abort(rank)
            self._last_progress = time.monotonic()
        if ex.error is not None:
            raise ex.error

    def _raise_abort(self, rank: int) -> None:
        kind, message = self.abort
        if kind == "deadlock":
            raise DeadlockError(message)
        raise RankAborted(f"rank {rank} aborted: {message}")

    # ------------------------------------------------------ liveness / abort
    def finish(self, rank: int) -> None:
        """Mark ``rank`` as done (it will issue nothing more)."""
        with self._cv:
            self._live.discard(rank)
            self._finished.add(rank)
            self._last_progress = time.monotonic()
            self._check_deadlock_locked()
            self._cv.notify_all()

    def flush(self, rank: int) -> int:
        """Wait every task ``rank`` issued asynchronously and never waited.

        Returns:
            How many tasks had not been waited.
        """
        ctx = self.contexts[rank]
        left = [t for t in ctx.pending if not t._applied]
        ctx.pending.clear()
        for task in left:
            task.wait()
        return len(left)

    def fail(self, rank: int, exc: BaseException, tb: str) -> None:
        """Record that ``rank`` raised, and abort every other rank."""
        with self._cv:
            self.failures.append((rank, exc, tb))
            if self.abort is None:
                self.abort = ("failure", f"rank {rank} raised {type(exc).__name__}: {exc}")
            self._cv.notify_all()

    def _check_deadlock_locked(self) -> None:
        """Every live rank blocked on an unfinished collective: nothing can move."""
        if self.abort is not None or self.mode != "data" or not self._blocked:
            return
        blocked = self._blocked
        if self._live and all(r in blocked and not blocked[r].done for r in self._live):
            self.abort = ("deadlock", self._deadlock_report("every running rank is waiting"))
            self._cv.notify_all()

    def _check_stall_locked(self) -> None:
        """No progress for ``deadlock_timeout`` seconds: report instead of hanging."""
        idle = time.monotonic() - self._last_progress
        if self.abort is None and idle > self.deadlock_timeout:
            self.abort = ("deadlock", self._deadlock_report(
                f"no collective progressed for {idle:.1f} s (deadlock_timeout="
                f"{self.deadlock_timeout} s)"))
            self._cv.notify_all()

    def check_stall(self) -> None:
        """Run the no-progress check (called periodically by the world)."""
        with self._cv:
            if self.mode == "data":
                self._check_stall_locked()

    def _deadlock_report(self, reason: str) -> str:
        by_exchange: dict[tuple, list[int]] = {}
        exchanges: dict[tuple, _Exchange] = {}
        for r, ex in sorted(self._blocked.items()):
            by_exchange.setdefault(ex.key, []).append(r)
            exchanges[ex.key] = ex
        lines = [f"Deadlock: {reason}."]
        for key, waiting in by_exchange.items():
            ex = exchanges[key]
            rec = ex.first_record()
            arrived = sorted(ex.arrivals)
            missing = [r for r in ex.ranks if r not in ex.arrivals]
            lines.append(
                f"- group {key[0]} {format_ranks(ex.ranks)}, per-group seq {key[1]}, "
                f"{describe_signature(rec.signature())}: ranks {format_ranks(waiting)} are "
                f"waiting; arrived: {format_ranks(arrived)}; never arrived: "
                f"{', '.join(self._whereabouts(m) for m in missing) or 'none'}"
            )
        running = sorted(self._live - set(self._blocked))
        if running:
            lines.append(f"- ranks {format_ranks(running)} are running outside any collective")
        lines.extend(self._flight_diagnosis())
        return "\n".join(lines)

    def _flight_diagnosis(self) -> list[str]:
        """The flight recorder's verdict on this state, in the words of ``hangs``.

        Each rank's state is what its flight-recorder dump would hold: the
        collective it is blocked in, its per-group issue counts, its phase.
        """
        recorder = flight_recorder_module()
        if recorder is None:
            return []
        states = {}
        for rank, ctx in self.contexts.items():
            issued, last = {}, None
            for rec in ctx.trace:
                if rec.group_seq is not None and rec.member:
                    issued[(rec.group_id, rec.group_ranks)] = rec.group_seq + 1
                    last = rec
            blocked = self._blocked.get(rank)
            in_flight = []
            if blocked is not None:
                mine = blocked.arrivals.get(rank)
                if mine is not None:
                    in_flight.append(_flight_entry(mine[0]))
            if in_flight and last is not None and last.group_seq == in_flight[0]["group_seq"] \
                    and last.group_id == in_flight[0]["group_id"]:
                last = next((r for r in reversed(ctx.trace[:last.rank_seq])
                             if r.group_seq is not None and r.member), None)
            note = "already returned" if rank in self._finished else ""
            states[rank] = recorder.RankState(
                rank=rank, phase=recorder.phase_of_thread(ctx.thread_ident or -1),
                in_flight=in_flight, issued=issued,
                last_finished=_flight_entry(last) if last is not None else None, note=note)
        return ["Flight recorder view:"] + recorder.diagnose(states, self.world_size)

    def _whereabouts(self, rank: int) -> str:
        if rank in self._finished:
            return f"rank {rank} (already returned)"
        ex = self._blocked.get(rank)
        if ex is not None:
            return f"rank {rank} (waiting in group {ex.key[0]} seq {ex.key[1]})"
        if rank in self._live:
            return f"rank {rank} (running)"
        return f"rank {rank} (not started)"
