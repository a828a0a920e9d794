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
Ranks that built other buffers would mix parameters silently or abort in the backend naming
nothing; :func:`check_ranks_agree` refuses it on every rank, naming the first difference.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable, Hashable, Optional, Sequence

import paddle
import paddle.distributed as dist
from paddle.nn.clip import GradientClipBase
from paddle.optimizer.lr import LRScheduler
from paddle.regularizer import WeightDecayRegularizer

__all__ = ["GroupDigest", "RankDisagreementError", "check_ranks_agree", "digest_words",
           "first_difference", "group_digests", "describe", "optimizer_options",
           "param_record", "param_settings", "route_of", "sharding_options"]

#: hash words per digest: 31 bits each, exact through any backend that reduces in float64
_WORDS = 4
_WORD_MASK = (1 << 31) - 1

#: Sharding settings that only change this rank's own work: ranks may differ on them.
_LOCAL_ONLY_OPTIONS = frozenset({"enable_optimizer_timer", "enable_fuse_optimizer_states"})

_FIX = ("build every rank's model, Muon(parameters=..., muon_param_info_map=...) and "
        "strategy identically (same parameters in the same order)")
_FIX_MUON = ("build Muon with the same arguments on every rank (learning rate or LR scheduler "
             "in the same state, grad_clip, hyper-parameters)")
_FIX_SETTINGS = ("give every rank the same Muon lr_ratio and apply_decay_param_fun and the same "
                 "ParamAttr (learning_rate, regularizer, need_clip) for each parameter")

#: Scheduler / clip attributes that never change numbers: printing, the static-graph name,
#: the key list the first ``state_dict()`` sets, HybridParallelClipGrad's group and timers.
_UNDESCRIBED = frozenset({"verbose", "_var_name", "keys", "_hcg", "_timers"})


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
        colour: the colour key (None: the sharding group).
        settings: one :func:`param_settings` tuple per parameter (empty: none compared).
    """

    label: str
    ranks: tuple
    fields: tuple = ()
    params: tuple = ()
    colour: Hashable = None
    settings: tuple = ()


def route_of(info: Any) -> str:
    """How the optimizer routes a parameter with ``MuonParamInfo`` ``info`` (None: no entry)."""
    if info is None:
        return "no muon_param_info_map entry"
    hyperball = bool(getattr(info, "use_hyperball", False))
    if getattr(info, "use_muon", False):
        return "muon+hyperball" if hyperball else "muon"
    return "hyperball" if hyperball else "adamw"


def param_record(param: Any, info: Any) -> tuple:
    """``(name, shape, dtype, route)`` of one parameter (its ``MuonParamInfo`` or None)."""
    dtype = str(param.dtype).replace("paddle.", "")
    return (str(param.name), tuple(int(d) for d in param.shape), dtype, route_of(info))


def sharding_options(settings: Any, **extra: Any) -> dict:
    """Option name -> value a sharding group's ranks share: non-local settings and ``extra``."""
    out = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)
           if f.name not in _LOCAL_ONLY_OPTIONS}
    out.update(extra)
    return out


_SCALARS = (bool, int, float, str, type(None))


def _describable(value: Any) -> bool:
    # objects whose attributes are their settings (HybridParallelClipGrad wraps a clip)
    return isinstance(value, (LRScheduler, GradientClipBase, WeightDecayRegularizer)) or (
        type(value).__name__ == "HybridParallelClipGrad" and hasattr(value, "_clip"))


def _describe_inner(value: Any, depth: int) -> Optional[str]:
    # None: nothing ranks can be compared on (a process group, a function).
    if isinstance(value, _SCALARS):
        return repr(value)
    if isinstance(value, (list, tuple)):
        items = [_describe_inner(v, depth) for v in value]
        return None if None in items else "[" + ", ".join(items) + "]"
    if depth > 0 and _describable(value):
        texts = {key: _describe_inner(attr, depth - 1)
                 for key, attr in sorted(vars(value).items()) if key not in _UNDESCRIBED}
        parts = [f"{key.lstrip('_')}={text}" for key, text in texts.items() if text is not None]
        return f"{type(value).__name__}({', '.join(parts)})"
    return None


def describe(value: Any) -> Any:
    """A setting as a plain value the ranks can compare: a scalar itself; an LR scheduler,
    grad clip or regulariser its class and comparable attributes, sorted by name
    (``"StepDecay(base_lr=0.1, gamma=0.1, ...)"``: parameters and state); else its type's name."""
    if isinstance(value, _SCALARS):
        return value
    return _describe_inner(value, depth=3) if _describable(value) else type(value).__name__


def optimizer_options(optimizer: Any) -> dict:
    """Muon's hyper-parameters (each owner updates with its own copy): ``"muon <name>"`` ->
    :func:`describe` of the learning rate, each ``_default_dict`` value and ``_grad_clip``."""
    out = {"muon learning_rate": describe(getattr(optimizer, "_learning_rate", None))}
    for key, value in sorted(dict(getattr(optimizer, "_default_dict", None) or {}).items()):
        out[f"muon {key}"] = describe(value)
    if hasattr(optimizer, "_grad_clip"):
        # what is applied: a wrapper may have swapped it since _default_dict
        out["muon grad_clip"] = describe(optimizer._grad_clip)
    return out


def _evaluated(fn: Callable, arg: Any, convert: Callable) -> Any:
    # the error text is the value: a rank whose function raised still joins the comparison
    try:
        return convert(fn(arg))
    except Exception as error:  # noqa: BLE001 - reported as the setting's value
        return f"raised {type(error).__name__}: {error}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(value: Any) -> Any:
    # 256 and 256.0 configure the same buffers: hash and compare them alike.
    return float(value) if _is_number(value) else value


def param_settings(param: Any, optimizer: Any) -> tuple:
    """What the update reads per parameter, as ``(setting, value)`` pairs: Muon's
    ``lr_ratio`` and ``apply_decay_param_fun`` evaluated on ``param``, and the parameter's
    ``optimize_attr`` learning rate, ``regularizer`` and ``need_clip``."""
    lr_ratio = getattr(optimizer, "_lr_ratio", None)
    decay_fun = getattr(optimizer, "_apply_decay_param_fun", None)
    attr = getattr(param, "optimize_attr", None)
    attr_lr = attr.get("learning_rate", 1.0) if isinstance(attr, dict) else 1.0
    ratio = (lambda v: float(v) if _is_number(v) else repr(v))
    return (
        ("lr_ratio", 1.0 if lr_ratio is None else _evaluated(lr_ratio, param, ratio)),
        ("apply_decay_param_fun",
         True if decay_fun is None else _evaluated(decay_fun, param.name, bool)),
        ("optimize_attr learning_rate", _number(describe(attr_lr))),
        ("regularizer", describe(getattr(param, "regularizer", None))),
        ("need_clip", describe(getattr(param, "need_clip", True))),
    )


def group_digests(params: Sequence[tuple], colour_ranks: dict, options: dict) -> list:
    """The digests one rank sends: the sharding group's (options, colour order, default
    colour's parameters), then each other colour's parameters in first-seen order (an expert
    is compared over its own colour group only: EP ranks never share an expert's group).

    Args:
        params: ``(colour key, param_record[, param_settings])`` per trainable parameter.
        colour_ranks: colour key -> global ranks of its group (None: the sharding group).
        options: option name -> value, compared over the sharding group.
    """
    by_colour: dict = {None: ([], [])}
    for colour, record, *settings in params:
        records, setting_rows = by_colour.setdefault(colour, ([], []))
        records.append(record)
        if settings:
            setting_rows.append(tuple(settings[0]))
    fields = tuple(sorted((f"option {k}", _number(v)) for k, v in options.items()))
    fields += (("colour order", tuple(repr(c) for c in by_colour if c is not None)),)
    return [GroupDigest("the sharding group" if colour is None else f"colour {colour!r}",
                        tuple(colour_ranks[colour]), fields if colour is None else (),
                        tuple(records), colour, tuple(setting_rows))
            for colour, (records, setting_rows) in by_colour.items()]


def _content(digest: GroupDigest) -> str:
    # What is hashed and compared: by repr, so True and 1.0 differ as they hash.
    return repr((digest.fields, digest.params, digest.settings))


def digest_words(digest: GroupDigest) -> list:
    """The hash of the digest's content (not label or ranks) as ``_WORDS`` ints below ``2**31``."""
    raw = hashlib.sha256(_content(digest).encode()).digest()
    return [int.from_bytes(raw[4 * i:4 * i + 4], "little") & _WORD_MASK for i in range(_WORDS)]


def _show_param(record: Optional[tuple]) -> str:
    if record is None:
        return "no parameter"
    name, shape, dtype, route = record
    return f"{name} {list(shape)} {dtype} {route}"


def _at(rows: tuple, i: int) -> Any:
    return rows[i] if i < len(rows) else None


def _first_index_difference(a: tuple, b: tuple) -> Optional[int]:
    common = min(len(a), len(b))
    return next((i for i in range(common) if a[i] != b[i]),
                None if len(a) == len(b) else common)


def _first_key_difference(a: Any, b: Any) -> Optional[tuple]:
    # (key, a's value, b's value) of the first differing key of two (key, value) sequences
    a, b = dict(a or ()), dict(b or ())
    for key in list(a) + [k for k in b if k not in a]:
        va, vb = a.get(key, "<unset>"), b.get(key, "<unset>")
        if repr(va) != repr(vb):
            return key, va, vb
    return None


def first_difference(digests: Sequence[GroupDigest]) -> Optional[str]:
    """The first disagreement among one group's digests (one per member, in group order) in
    one line: the field, parameter or setting, each side's value, the ranks; None: all agree."""
    ref = digests[0]
    ranks = list(ref.ranks)
    differing = [ranks[i] for i, d in enumerate(digests) if _content(d) != _content(ref)]
    if not differing:
        return None
    base, other = ranks[0], differing[0]
    mine = digests[ranks.index(other)]
    head = (f"MuonShardingOptimizer: the ranks of {ref.label} {ranks} disagree "
            f"(ranks {differing} differ from rank {base})")
    found = _first_key_difference(ref.fields, mine.fields)
    if found is not None:
        name, a, b = found
        fix = _FIX_MUON if name.startswith("option muon ") else _FIX
        return f"{head}: {name} is {a!r} on rank {base} but {b!r} on rank {other}; {fix}."
    i = _first_index_difference(ref.params, mine.params)
    if i is not None:
        a, b = _at(ref.params, i), _at(mine.params, i)
        return (f"{head}: parameter #{i} ({(a or b)[0]}) is {_show_param(a)} on rank {base} "
                f"but {_show_param(b)} on rank {other} ({len(ref.params)} vs "
                f"{len(mine.params)} parameters); {_FIX}.")
    # Same parameters in the same order: a per-parameter setting differs.
    i = _first_index_difference(ref.settings, mine.settings)
    found = None if i is None else _first_key_difference(_at(ref.settings, i),
                                                         _at(mine.settings, i))
    if found is not None:
        key, a, b = found
        name = ref.params[i][0] if i < len(ref.params) else "?"
        return (f"{head}: parameter #{i} ({name}) has {key} {a!r} on rank {base} but "
                f"{b!r} on rank {other}; {_FIX_SETTINGS}.")
    return f"{head}: the parameter settings differ; {_FIX_SETTINGS}."


def _group_disagreement(digest: GroupDigest, group: Any) -> Optional[str]:
    """The disagreement message of one digest's group (None: every member agrees)."""
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


def check_ranks_agree(digests: Sequence[GroupDigest],
                      group_of: Callable[[GroupDigest], Any]) -> None:
    """Compare each digest over its group; every rank of the job raises when any group
    disagrees (none goes on into a collective the others never join).

    Per group one ``all_reduce(MAX)`` of ``[hash, -hash]`` (``max == min`` exactly when all
    hashes are equal; every member reads one result, and a log-only collective layer reads as
    agreement); digests are gathered only on a mismatch. Collective on every rank of the job.

    Args:
        digests: this rank's digests (:func:`group_digests`), in the same order on every rank.
        group_of: digest -> the process group to exchange it on.

    Raises:
        RankDisagreementError: on every rank; the members of a disagreeing group name
            the first difference, the other ranks name those ranks and their error.
    """
    message = None
    for index, digest in enumerate(digests):
        if len(digest.ranks) <= 1:
            continue  # nobody to disagree with
        found = _group_disagreement(digest, group_of(digest))  # collective: always run
        message = message or found
        if index == 0 and message is not None:
            break  # the colour orders may differ: the later checks would not line up
    # job-wide verdict: a flag per rank reduced with MAX; messages gathered only if one is set
    world, refusing, messages = int(dist.get_world_size()), [], []
    if world > 1:
        rank = int(dist.get_rank())
        flags = paddle.to_tensor([int(r == rank and message is not None) for r in range(world)],
                                 dtype="int64")
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        refusing = [r for r, v in enumerate(flags.numpy().tolist()) if v]
    if refusing:  # every rank saw the same flags: every rank gathers
        dist.all_gather_object(messages, message)
    if message is not None:
        raise RankDisagreementError(message)
    if refusing:
        first = next((m for m in messages if m), "(their message did not arrive)")
        raise RankDisagreementError(
            f"MuonShardingOptimizer: rank {rank} refuses too: rank(s) {refusing} found their "
            f"group disagreeing, and every rank of the job stops at construction so that "
            f"none waits in a collective the others never join. First of their errors: {first}")
