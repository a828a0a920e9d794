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
"""Ranks agree at construction: one digest per group, compared before any collective.

Every rank of a group must build the same buffers in the same order, or the
first reduce-scatter mixes different parameters (silent divergence) or the
collectives' sizes differ (a backend abort naming nothing). So
:class:`MuonShardingOptimizer` compares, per group, what must be identical
among the ranks that share it:

* the sharding group: the sharding options, the inner optimizer's type and
  hyper-parameters, the order of colours, and the default-colour parameters
  (name, shape, dtype, Muon routing, in order);
* each colour group (e.g. an expert's moe_sharding group): the parameters of
  that colour. Experts differ across EP ranks legitimately, and EP ranks
  never share an expert's colour group, so they are never compared.

Cheap first: one ``all_reduce(MAX)`` of ``[hash, -hash]`` (eight int64 words)
per group; every member sees ``max == min`` exactly when all hashes are
equal. Only on a mismatch do the members gather their full digests and raise
one error naming the first differing field or parameter and the ranks. A
reduce rather than a gather of hashes: every member learns the verdict from
the same result, and a log-only collective layer (which moves no data)
reads as agreement instead of an exchange it cannot do.

Then every rank of the job learns the verdict: one ``all_reduce(MAX)`` over
the whole job of a flag per rank (``world_size`` int64 words). When any rank
found a disagreement, the ranks gather their messages and every rank
raises: the members of the group that disagrees with the first difference,
the others (another pipeline stage, another expert's group) naming the
disagreeing ranks and that difference - none goes on into a collective a
refusing rank never joins. After a disagreement in the sharding group its
members skip the colour groups (their colour orders may differ, so those
checks would not line up); the job-wide verdict is the next collective of
every rank either way.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable, Hashable, Optional, Sequence

import paddle
import paddle.distributed as dist

__all__ = [
    "GroupDigest",
    "RankDisagreementError",
    "check_ranks_agree",
    "digest_words",
    "first_difference",
    "group_digests",
    "optimizer_options",
    "param_record",
    "route_of",
    "sharding_options",
]

#: hash words per digest: 31 bits each, so they stay exact through any
#: backend or fake that reduces in float64
_WORDS = 4
_WORD_BITS = 31

#: Sharding settings that only change what this rank does locally (timers,
#: its own state buffers): ranks may differ on them.
_LOCAL_ONLY_OPTIONS = frozenset({"enable_optimizer_timer", "enable_fuse_optimizer_states"})

_FIX = ("build every rank's model, Muon(parameters=..., muon_param_info_map=...) and "
        "strategy identically (same parameters in the same order)")


class RankDisagreementError(ValueError):
    """Ranks of one group built different parameters or options."""


@dataclasses.dataclass(frozen=True)
class GroupDigest:
    """What the members of one group must agree on.

    Attributes:
        label: the group in words ("the sharding group", "colour 'moe_expert'").
        ranks: global ranks of the group, in group order.
        fields: ``(name, value)`` pairs compared by name (options, colour order).
        params: one :func:`param_record` per parameter, in the optimizer's order.
        colour: the colour key (None: the sharding group), to find the group by.
    """

    label: str
    ranks: tuple
    fields: tuple = ()
    params: tuple = ()
    colour: Hashable = None


def route_of(info: Any) -> str:
    """How the optimizer routes a parameter, from its ``MuonParamInfo``.

    Args:
        info: the parameter's ``MuonParamInfo`` (None: no map entry).

    Returns:
        str: "muon", "muon+hyperball", "hyperball" (owned whole), "adamw"
        (element-wise slices) or "no muon_param_info_map entry".
    """
    if info is None:
        return "no muon_param_info_map entry"
    muon = bool(getattr(info, "use_muon", False))
    hyperball = bool(getattr(info, "use_hyperball", False))
    if muon:
        return "muon+hyperball" if hyperball else "muon"
    return "hyperball" if hyperball else "adamw"


def param_record(param: Any, info: Any) -> tuple:
    """``(name, shape, dtype, route)`` of one parameter, as plain values.

    Args:
        param: the parameter (``.name``, ``.shape``, ``.dtype``).
        info: its ``MuonParamInfo`` or None.

    Returns:
        tuple: ``(str, tuple[int, ...], str, str)``.
    """
    dtype = str(param.dtype).replace("paddle.", "")
    return (str(param.name), tuple(int(d) for d in param.shape), dtype, route_of(info))


def sharding_options(settings: Any, **extra: Any) -> dict:
    """The options the ranks of a sharding group must share, by name.

    Args:
        settings: the optimizer's ``ShardingSettings`` (a dataclass).
        **extra: further values that shape the schedule (read per rank).

    Returns:
        dict: option name -> value (local-only options left out).
    """
    out = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)
           if f.name not in _LOCAL_ONLY_OPTIONS}
    out.update(extra)
    return out


def _plain(value: Any) -> Any:
    # Scalars compare by value; anything else (a scheduler, a regulariser)
    # by its type, which is what ranks can be expected to share.
    return value if isinstance(value, (bool, int, float, str, type(None))) else type(value).__name__


def optimizer_options(optimizer: Any) -> dict:
    """The inner optimizer's hyper-parameters, by name.

    Every rank updates the matrices it owns and its own slices with its own
    copy: a learning rate that differs per rank would train each parameter
    with whichever rank owns it.

    Args:
        optimizer: the innermost optimizer (Muon): ``_learning_rate`` and
            the ``_default_dict`` Paddle's optimizers keep.

    Returns:
        dict: ``"muon <name>"`` -> scalar (or type name).
    """
    out = {"muon learning_rate": _plain(getattr(optimizer, "_learning_rate", None))}
    for key, value in sorted(dict(getattr(optimizer, "_default_dict", None) or {}).items()):
        out[f"muon {key}"] = _plain(value)
    return out


def _number(value: Any) -> Any:
    # 256 and 256.0 configure the same buffers: hash and compare them alike.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value


def _colour_label(colour: Hashable) -> str:
    return "the sharding group" if colour is None else f"colour {colour!r}"


def group_digests(params: Sequence[tuple], colour_ranks: dict, options: dict) -> list:
    """The digests one rank sends, the sharding group's first.

    Args:
        params: ``(colour key, param_record)`` per trainable parameter, in order.
        colour_ranks: colour key -> global ranks of its group (None: the
            sharding group; always present).
        options: option name -> value, compared over the sharding group.

    Returns:
        list[GroupDigest]: the sharding group's, then one per other colour
        in first-seen order.
    """
    by_colour: dict = {None: []}
    for colour, record in params:
        by_colour.setdefault(colour, []).append(record)
    order = [c for c in by_colour if c is not None]
    fields = tuple(sorted((f"option {k}", _number(v)) for k, v in options.items()))
    fields += (("colour order", tuple(repr(c) for c in order)),)
    out = [GroupDigest(_colour_label(None), tuple(colour_ranks[None]), fields,
                       tuple(by_colour[None]))]
    for colour in order:
        out.append(GroupDigest(_colour_label(colour), tuple(colour_ranks[colour]), (),
                               tuple(by_colour[colour]), colour))
    return out


def _content(digest: GroupDigest) -> str:
    # What is hashed and compared: by repr, so True and 1.0 differ as they hash.
    return repr((digest.fields, digest.params))


def digest_words(digest: GroupDigest) -> list:
    """The digest's hash as ``_WORDS`` non-negative ints below ``2**31``.

    The label and ranks are left out: members may name their group alike
    or not, what they must share is the content.
    """
    blob = _content(digest).encode()
    raw = hashlib.sha256(blob).digest()
    mask = (1 << _WORD_BITS) - 1
    return [int.from_bytes(raw[4 * i:4 * i + 4], "little") & mask for i in range(_WORDS)]


def _show_param(record: Optional[tuple]) -> str:
    if record is None:
        return "no parameter"
    name, shape, dtype, route = record
    return f"{name} {list(shape)} {dtype} {route}"


def _first_param_difference(a: tuple, b: tuple) -> Optional[int]:
    for i in range(max(len(a), len(b))):
        if i >= len(a) or i >= len(b) or a[i] != b[i]:
            return i
    return None


def first_difference(digests: Sequence[GroupDigest]) -> Optional[str]:
    """The first disagreement among one group's digests, as one line.

    Args:
        digests: one digest per member, in group order (``digests[i]`` from
            ``digests[0].ranks[i]``).

    Returns:
        str|None: names the group, the first differing option/field or
        parameter (index and name), each side's value and the ranks that
        differ from the first; None when all agree.
    """
    ref = digests[0]
    ranks = list(ref.ranks)
    base, other = ranks[0], None
    differing = [ranks[i] for i, d in enumerate(digests) if _content(d) != _content(ref)]
    if not differing:
        return None
    other = differing[0]
    mine = digests[ranks.index(other)]
    head = (f"MuonShardingOptimizer: the ranks of {ref.label} {ranks} disagree "
            f"(ranks {differing} differ from rank {base})")
    ref_fields, my_fields = dict(ref.fields), dict(mine.fields)
    for name in list(ref_fields) + [n for n in my_fields if n not in ref_fields]:
        a, b = ref_fields.get(name, "<unset>"), my_fields.get(name, "<unset>")
        if repr(a) != repr(b):
            return f"{head}: {name} is {a!r} on rank {base} but {b!r} on rank {other}; {_FIX}."
    i = _first_param_difference(ref.params, mine.params)
    a = ref.params[i] if i < len(ref.params) else None
    b = mine.params[i] if i < len(mine.params) else None
    name = (a or b)[0]
    return (f"{head}: parameter #{i} ({name}) is {_show_param(a)} on rank {base} but "
            f"{_show_param(b)} on rank {other} ({len(ref.params)} vs {len(mine.params)} "
            f"parameters); {_FIX}.")


def _group_disagreement(digest: GroupDigest, group: Any) -> Optional[str]:
    """Compare one digest over its group: None when every member agrees."""
    words = digest_words(digest)
    probe = paddle.to_tensor(words + [-w for w in words], dtype="int64")
    dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)
    got = [int(v) for v in probe.numpy().tolist()]
    if got[:_WORDS] == [-v for v in got[_WORDS:]]:
        return None
    gathered: list = []
    dist.all_gather_object(gathered, digest, group=group)
    # the hashes differed, so the records do: never fall through silently
    return first_difference(gathered) or (
        f"MuonShardingOptimizer: the ranks of {digest.label} {list(digest.ranks)} "
        f"hashed their parameters differently; {_FIX}.")


def _refuse_on_every_rank(message: Optional[str]) -> None:
    """The job-wide verdict: raise on every rank when any rank disagreed.

    Collective over the whole job (the default group): a flag per rank,
    reduced with MAX; only when a flag is set are the messages gathered.
    """
    world = int(dist.get_world_size())
    if world <= 1:
        if message is not None:
            raise RankDisagreementError(message)
        return
    rank = int(dist.get_rank())
    flags = paddle.to_tensor([int(r == rank and message is not None) for r in range(world)],
                             dtype="int64")
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    refusing = [r for r, v in enumerate(flags.numpy().tolist()) if v]
    if not refusing:
        return
    messages: list = []  # every rank saw the same flags: every rank gathers
    dist.all_gather_object(messages, message)
    if message is not None:
        raise RankDisagreementError(message)
    first = next((m for m in messages if m), "(their message did not arrive)")
    raise RankDisagreementError(
        f"MuonShardingOptimizer: rank {rank} refuses too: rank(s) {refusing} found their "
        f"group disagreeing, and every rank of the job stops at construction so that none "
        f"waits in a collective the others never join. First of their errors: {first}")


def check_ranks_agree(digests: Sequence[GroupDigest],
                      group_of: Callable[[GroupDigest], Any]) -> None:
    """Compare each digest with the other members of its group; every rank
    of the job raises when any group disagrees.

    Collective: every member of every group must call it with its digests in
    the same order (the sharding group's first; its "colour order" field makes
    the later ones line up before they run), and every rank of the job calls
    it (the verdict is exchanged over the whole job).

    Args:
        digests: this rank's digests (:func:`group_digests`).
        group_of: digest -> the process group to exchange it on.

    Raises:
        RankDisagreementError: on every rank, one line: a member of the group
            that disagrees names the first difference and the ranks; another
            rank names the disagreeing ranks and that difference.
    """
    message = None
    for index, digest in enumerate(digests):
        if len(digest.ranks) <= 1:
            continue  # nobody to disagree with
        found = _group_disagreement(digest, group_of(digest))
        message = message or found
        if index == 0 and message is not None:
            break  # the colour orders may differ: the later checks would not line up
    _refuse_on_every_rank(message)
