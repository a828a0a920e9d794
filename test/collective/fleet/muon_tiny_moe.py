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
"""A tiny MoE-style model and its single-process Muon reference.

Shared by the simulated-world suites and the gloo worker
(``hybrid_parallel_sharding_muon_moe_model.py``). The model is written as pure
functions of parameter dicts so the reference can replay every rank's batch
shard with that rank's experts, then average gradients exactly the way the
sharded run must: dense gradients over the whole sharding group, an expert's
gradients over its moe_sharding group (the ranks holding that expert).

Parameters have explicit names: paddle's unique-name counter is process
global, so in a threaded world it would hand each rank different names.
"""

from __future__ import annotations

from collections import Counter
import numpy as np

import paddle
from muon_param_map import build_muon_param_info_map

from paddle_muon_ext.optimizer.muon import Muon

#: Muon's staged API, which the overlapped update asks of the inner optimizer
#: (spelled here, not imported: the exported suite runs on develop's tree).
STAGED_API = ("apply_grad_clip", "prepare_optimize", "update_params", "muon_group_key")

#: Which Muon the runs use (inner optimizer of the sharded run and the reference).
INNER_MUON = "paddle.optimizer.muon.Muon"
# paddle_muon_ext: compat-begin
PACKAGE_MUON = Muon
PACKAGE_INNER = INNER_MUON = "package (paddle_muon_ext.optimizer.muon.Muon)"


def _develop_muon(root: str):
    """The checkout's Muon where it imports and steps on this Paddle, else (None, why).

    "Steps" is what the runs ask of it: one step of a Muon matrix and of an
    AdamW vector (develop's two update paths), each parameter changed.
    """
    import os

    from paddle_muon_ext.compat_paddle_3_3 import develop_loader

    loaded = develop_loader.load_develop_muon(root)
    if loaded.module is None:
        return None, loaded.reason
    failed = f"{develop_loader.MUON_RELPATH} does not run on paddle {paddle.__version__}"
    try:
        cls = loaded.module.Muon
        matrix = paddle.create_parameter([4, 4], "float32")
        vector = paddle.create_parameter([4], "float32")
        before = [matrix.numpy().copy(), vector.numpy().copy()]
        opt = cls(learning_rate=0.01, parameters=[matrix, vector],
                  muon_param_info_map=build_muon_param_info_map([matrix, vector]))
        ((matrix * matrix).sum() + (vector * vector).sum()).backward()
        opt.step()
    except Exception as error:  # noqa: BLE001  (any failure: fall back, say why)
        return None, f"{failed}: {develop_loader.one_line(error)}"
    unchanged = [what for what, p, b in zip(("the Muon matrix", "the AdamW vector"),
                                              (matrix, vector), before)
                 if np.array_equal(p.numpy(), b)]
    if unchanged:
        return None, f"{failed}: its step left {' and '.join(unchanged)} unchanged"
    path = os.path.join(os.path.abspath(os.path.expanduser(root)), develop_loader.MUON_RELPATH)
    return cls, path + "".join(f"; with {s}" for s in loaded.shims)


def select_inner_muon(root: str | None) -> tuple[type, str]:
    """(the Muon class, how the report names it) for a checkout root or None.

    The checkout's ``python/paddle/optimizer/muon.py`` where it imports and
    steps on this Paddle ("develop (PATH)"), else this package's Muon, with
    the one-line reason when a checkout was given.
    """
    if not root:
        return PACKAGE_MUON, PACKAGE_INNER
    cls, info = _develop_muon(root)
    if cls is None:
        return PACKAGE_MUON, f"{PACKAGE_INNER}: {info}"
    return cls, f"develop ({info})"


def _select_muon() -> None:
    import json
    import os

    global Muon, INNER_MUON
    Muon, INNER_MUON = select_inner_muon(os.environ.get("PADDLE_ROOT"))
    report = os.environ.get("MUON_CONFORMANCE_INNER_FILE")
    if report:  # upstream_coverage.py reads it (the tests run in its child)
        with open(report, "w") as f:
            json.dump({"inner_optimizer": INNER_MUON}, f)


_select_muon()
# paddle_muon_ext: compat-end

H, INNER, LOCAL_EXPERTS, BATCH_PER_RANK = 16, 24, 2, 4
LR, CLIP_NORM = 0.02, 0.5  # the global grad norm is ~1: clipping is active
EXPERT_COLOUR = "moe_expert"


def init_dense(seed: int = 1) -> dict[str, np.ndarray]:
    """Dense (default-colour) parameters: two matrices, a bias and a norm weight."""
    rng = np.random.default_rng(seed)
    return {
        "w_in": rng.normal(0, 0.3, (H, H)).astype("float32"),
        "b_in": rng.normal(0, 0.1, (H,)).astype("float32"),
        "norm_w": (1 + rng.normal(0, 0.1, (H,))).astype("float32"),
        "w_out": rng.normal(0, 0.3, (H, 2 * H)).astype("float32"),
    }


def init_experts(expert_coord: int) -> dict[str, np.ndarray]:
    """The experts one EP rank holds: 2-D per expert, one fused 3-D weight, a bias."""
    rng = np.random.default_rng(100 + expert_coord)
    out = {}
    for e in range(LOCAL_EXPERTS):
        out[f"up{e}"] = rng.normal(0, 0.3, (H, INNER)).astype("float32")
        out[f"down{e}"] = rng.normal(0, 0.3, (INNER, H)).astype("float32")
    out["fused"] = rng.normal(0, 0.3, (LOCAL_EXPERTS, H, INNER)).astype("float32")
    out["bias"] = rng.normal(0, 0.1, (H,)).astype("float32")
    return out


def forward(dense: dict, experts: dict | None, x):
    """Scalar loss of one batch shard."""
    h = (paddle.matmul(x, dense["w_in"]) + dense["b_in"]) * dense["norm_w"]
    if experts is not None:
        y = experts["bias"]
        for e in range(LOCAL_EXPERTS):
            y = y + paddle.matmul(
                paddle.tanh(paddle.matmul(h, experts[f"up{e}"])), experts[f"down{e}"]
            )
        fused = paddle.tanh(paddle.matmul(h.unsqueeze(0), experts["fused"]))
        y = y + paddle.matmul(fused.mean(0), experts["down0"])
        h = h + y / LOCAL_EXPERTS
    out = paddle.matmul(paddle.tanh(h), dense["w_out"])
    return (out**2).mean()


def batch(step: int, rank: int) -> np.ndarray:
    """The batch shard of ``rank`` at ``step`` (the full batch is all shards)."""
    rng = np.random.default_rng(1000 * step + rank)
    return rng.normal(0, 1, (BATCH_PER_RANK, H)).astype("float32")


def make_muon(params, clip: bool = True, **kwargs) -> Muon:
    """The Muon configuration every run (sharded or reference) uses.

    Like develop's users, it passes a ``muon_param_info_map`` entry for
    every parameter (the sharding optimizer requires one); by default the
    shape rule with no exclusions.
    """
    if "muon_param_info_map" not in kwargs:
        kwargs["muon_param_info_map"] = build_muon_param_info_map(params)
    return Muon(
        learning_rate=LR,
        parameters=params,
        grad_clip=paddle.nn.ClipGradByGlobalNorm(CLIP_NORM) if clip else None,
        **kwargs,
    )


def _param(name: str, value: np.ndarray, dtype: str = "float32"):
    p = paddle.create_parameter(
        list(value.shape),
        dtype,
        default_initializer=paddle.nn.initializer.Assign(value.astype("float32")),
    )
    # Renamed after creation: dygraph refuses a ParamAttr name twice per
    # process, but every simulated rank (and every training pass) needs the
    # same names, exactly as separate processes would have.
    p.name = name
    return p


def _has_staged_api() -> bool:
    muon = make_muon([_param("probe.w", np.zeros((2, 2), "float32"))])
    return all(callable(getattr(muon, n, None)) for n in STAGED_API)


class TinyMoE(paddle.nn.Layer):
    """One rank's model: dense params plus the experts of its expert coordinate.

    Args:
        expert_coord (int|None): this rank's expert-parallel coordinate (None: no experts).
        moe_group (Group|None): the moe_sharding group (the experts' colour group).
        matrix_dtype (str): dtype of the dense matrices (bf16 exercises the
            mixed-dtype path; everything else stays fp32).
    """

    def __init__(self, expert_coord: int | None, moe_group, matrix_dtype: str = "float32"):
        super().__init__()
        self.dense = {}
        for k, v in init_dense().items():
            dtype = matrix_dtype if v.ndim == 2 and k == "w_in" else "float32"
            self.dense[k] = self._add(f"dense.{k}", v, dtype)
        self.experts = None
        if expert_coord is not None:
            self.experts = {
                k: self._add(f"expert.{k}", v) for k, v in init_experts(expert_coord).items()
            }
            for p in self.experts.values():
                p.color = {"color": EXPERT_COLOUR, "group": moe_group}
                p.no_sync = True  # experts differ across EP ranks: never broadcast at init

    def _add(self, name: str, value: np.ndarray, dtype: str = "float32"):
        p = _param(name, value, dtype)
        self.add_parameter(name.replace(".", "_"), p)
        return p

    def forward(self, x):
        dense = {k: (p.astype("float32") if p.dtype != paddle.float32 else p)
                 for k, p in self.dense.items()}
        return forward(dense, self.experts, x)

    def named_values(self) -> dict[str, np.ndarray]:
        """Parameter values as fp32 numpy, keyed like :meth:`Reference.values`."""
        out = {f"dense.{k}": p.astype("float32").numpy() for k, p in self.dense.items()}
        if self.experts is not None:
            out.update({f"expert.{k}": p.numpy() for k, p in self.experts.items()})
        return out


class Reference:
    """Single-process Muon on the full batch: every rank's shard, all experts.

    Args:
        expert_of_rank (dict[int, int|None]): global rank -> its expert
            coordinate (None: no experts), for the ranks of one sharding group.
        matrix_dtype (str): as :class:`TinyMoE`.
        clip (bool): global-norm clip on.
    """

    def __init__(self, expert_of_rank: dict, matrix_dtype: str = "float32",
                 clip: bool = True, micro: int = 1, **muon_kwargs) -> None:
        self.expert_of_rank = dict(expert_of_rank)
        self.micro = micro
        self.world = len(self.expert_of_rank)
        self.dense = {}
        for k, v in init_dense().items():
            dtype = matrix_dtype if v.ndim == 2 and k == "w_in" else "float32"
            self.dense[k] = _param(f"ref.dense.{k}", v, dtype)
        coords = sorted({c for c in self.expert_of_rank.values() if c is not None})
        self.experts = {
            c: {k: _param(f"ref.e{c}.{k}", v) for k, v in init_experts(c).items()}
            for c in coords
        }
        params = list(self.dense.values()) + [
            p for d in self.experts.values() for p in d.values()
        ]
        self.opt = make_muon(params, clip=clip, **muon_kwargs)

    def rank_grads(self, step: int, rank: int) -> dict[str, np.ndarray]:
        """Gradients of ``rank``'s own shard (fp32 numpy), keyed like :meth:`values`.

        With ``micro`` > 1 they are summed over the step's micro-batches, as
        gradient accumulation does.
        """
        c = self.expert_of_rank[rank]
        experts = self.experts.get(c)
        dense = {k: (p.astype("float32") if p.dtype != paddle.float32 else p)
                 for k, p in self.dense.items()}
        for m in range(self.micro):
            loss = forward(dense, experts, paddle.to_tensor(batch(step * self.micro + m, rank)))
            loss.backward()
        grads = {}
        for k, p in self.dense.items():
            grads[f"dense.{k}"] = p.grad.astype("float32").numpy()
            p.clear_gradient()
        for k, p in (experts or {}).items():
            grads[f"expert.{k}"] = p.grad.numpy()
            p.clear_gradient()
        return grads

    def mean_grads(self, step: int) -> dict[tuple, np.ndarray]:
        """Reduced gradients: (coord or None, key) -> mean over the right ranks."""
        members = Counter(self.expert_of_rank.values())
        out: dict[tuple, np.ndarray] = {}
        for r in sorted(self.expert_of_rank):
            c = self.expert_of_rank[r]
            for key, g in self.rank_grads(step, r).items():
                if key.startswith("dense."):
                    slot, n = (None, key), self.world
                else:
                    slot, n = (c, key), members[c]
                out[slot] = out.get(slot, 0) + g.astype("float64") / n
        return out

    def step(self, step: int) -> None:
        """One optimizer step on the full batch."""
        grads = self.mean_grads(step)
        for (c, key), g in grads.items():
            p = self.dense[key[6:]] if c is None else self.experts[c][key[7:]]
            p._copy_gradient_from(paddle.to_tensor(g.astype("float32")).astype(p.dtype))
        self.opt.step()
        self.opt.clear_grad()

    def values(self, expert_coord: int | None) -> dict[str, np.ndarray]:
        """What a rank with ``expert_coord`` should hold, fp32 numpy."""
        out = {f"dense.{k}": p.astype("float32").numpy() for k, p in self.dense.items()}
        for k, p in self.experts.get(expert_coord, {}).items():
            out[f"expert.{k}"] = p.numpy()
        return out
