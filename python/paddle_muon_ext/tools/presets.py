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
"""Synthetic parameter lists of MoE models, for benchmarks and plan tools.

A preset is a list of :class:`ParamSpec` (name, shape, dtype, is_expert,
use_muon). ``use_muon`` follows the optimizer's rule: at least 2-D and not
matched by an exclude pattern (embeddings, lm head, norms, biases).

Presets:
* ``"ernie-moe-small"`` -- ERNIE-4.5-like small MoE: hidden 1024, 16 layers
  (layer 0 dense FFN, 15 MoE layers of 16 routed experts + 1 shared expert),
  GQA attention (q/o ``[1024, 1024]``, k/v ``[1024, 256]``), per-expert
  up/gate ``[1024, 1408]`` and down ``[1408, 1024]`` as 2-D matrices, fp32
  router gates ``[1024, 16]``, bf16 everywhere else. 847 Muon matrices.
* ``"ernie-moe-small-fused"`` -- the same model with each layer's routed
  experts fused into 3-D ``[16, H, I]`` / ``[16, I, H]`` weights.
* ``"dense-heavy"`` -- no experts: 24 layers of 4096-wide attention (q/k/v/o
  ``[4096, 4096]``) and MLP (gate/up ``[4096, 16384]``, down ``[16384, 4096]``),
  bf16; 168 Muon matrices, 12.9 GB of them.
* ``"ernie-moe-large"`` -- ERNIE-4.5-21B-A3B-like large MoE: hidden 2560,
  28 layers (layer 0 dense FFN ``[2560, 12288]``, 27 MoE layers of 64 routed
  experts ``[2560, 1536]`` / ``[1536, 2560]`` + 2 shared experts fused to
  ``[2560, 3072]``), GQA attention (20 heads, 4 KV heads), bf16; 5,407 Muon
  matrices, 5,184 of them experts.
* ``"tiny"`` -- a handful of matrices for unit tests.

:func:`load_json` reads a list of objects with the same fields (``dtype``,
``is_expert`` and ``use_muon`` optional).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

__all__ = [
    "ParamSpec",
    "DEFAULT_EXCLUDE_PATTERNS",
    "muon_applies",
    "get_preset",
    "list_presets",
    "load_json",
    "dump_json",
    "muon_specs",
    "ernie_moe",
]

DEFAULT_EXCLUDE_PATTERNS: Tuple[str, ...] = (
    r"embed",
    r"lm_head",
    r"norm",
    r"bias",
)


#: The default patterns as one expression (a 200,000-entry model is matched once per name).
_DEFAULT_EXCLUDE = re.compile("|".join(f"(?:{p})" for p in DEFAULT_EXCLUDE_PATTERNS))


def muon_applies(name: str, shape: Sequence[int], exclude=DEFAULT_EXCLUDE_PATTERNS) -> bool:
    """Muon applies to >= 2-D parameters not matched by an exclude pattern."""
    if len(shape) < 2:
        return False
    if exclude is DEFAULT_EXCLUDE_PATTERNS:
        return _DEFAULT_EXCLUDE.search(name) is None
    return not any(re.search(p, name) for p in exclude)


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: Tuple[int, ...]
    dtype: str = "float32"
    is_expert: bool = False
    use_muon: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_matrix_spec(self):
        """The partitioner's view."""
        from ..distributed.fleet.meta_optimizers.muon_sharding.owners import MatrixSpec

        return MatrixSpec(self.name, tuple(self.shape), self.dtype)

    def to_meta(self, expert_colour: str = "moe_expert"):
        """The layout's view: experts take ``expert_colour``, the rest the default group."""
        from ..distributed.fleet.meta_optimizers.muon_sharding.layout import ParamMeta

        return ParamMeta(self.name, tuple(self.shape), self.dtype,
                         expert_colour if self.is_expert else None, self.use_muon)


def _p(name, shape, dtype="bfloat16", is_expert=False) -> ParamSpec:
    shape = tuple(int(d) for d in shape)
    return ParamSpec(name, shape, dtype, bool(is_expert), muon_applies(name, shape))


def ernie_moe(
    hidden: int = 1024,
    layers: int = 16,
    dense_layers: int = 1,
    num_experts: int = 16,
    moe_intermediate: int = 1408,
    shared_experts: int = 1,
    dense_intermediate: int = 4096,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    vocab: int = 103424,
    dtype: str = "bfloat16",
    gate_dtype: str = "float32",
    fused_experts: bool = False,
) -> List[ParamSpec]:
    """Parameter list of an ERNIE-4.5-like decoder MoE (model order)."""
    H = hidden
    head_dim = H // num_heads
    kv = num_kv_heads * head_dim
    out: List[ParamSpec] = [_p("ernie.embed_tokens.weight", (vocab, H), dtype)]
    for i in range(layers):
        pre = f"ernie.layers.{i}"
        out.append(_p(f"{pre}.input_layernorm.weight", (H,), dtype))
        out.append(_p(f"{pre}.self_attn.q_proj.weight", (H, H), dtype))
        out.append(_p(f"{pre}.self_attn.k_proj.weight", (H, kv), dtype))
        out.append(_p(f"{pre}.self_attn.v_proj.weight", (H, kv), dtype))
        out.append(_p(f"{pre}.self_attn.o_proj.weight", (H, H), dtype))
        out.append(_p(f"{pre}.post_attention_layernorm.weight", (H,), dtype))
        if i < dense_layers:
            I = dense_intermediate
            out.append(_p(f"{pre}.mlp.gate_proj.weight", (H, I), dtype))
            out.append(_p(f"{pre}.mlp.up_proj.weight", (H, I), dtype))
            out.append(_p(f"{pre}.mlp.down_proj.weight", (I, H), dtype))
            continue
        I = moe_intermediate
        out.append(_p(f"{pre}.mlp.gate.weight", (H, num_experts), gate_dtype))
        out.append(
            _p(f"{pre}.mlp.moe_statics.e_score_correction_bias", (1, num_experts), "float32")
        )
        if fused_experts:
            E = num_experts
            out.append(_p(f"{pre}.mlp.experts.gate_proj.weight", (E, H, I), dtype, True))
            out.append(_p(f"{pre}.mlp.experts.up_proj.weight", (E, H, I), dtype, True))
            out.append(_p(f"{pre}.mlp.experts.down_proj.weight", (E, I, H), dtype, True))
        else:
            for e in range(num_experts):
                ep = f"{pre}.mlp.experts.{e}"
                out.append(_p(f"{ep}.gate_proj.weight", (H, I), dtype, True))
                out.append(_p(f"{ep}.up_proj.weight", (H, I), dtype, True))
                out.append(_p(f"{ep}.down_proj.weight", (I, H), dtype, True))
        if shared_experts:
            Is = I * shared_experts
            out.append(_p(f"{pre}.mlp.shared_experts.gate_proj.weight", (H, Is), dtype))
            out.append(_p(f"{pre}.mlp.shared_experts.up_proj.weight", (H, Is), dtype))
            out.append(_p(f"{pre}.mlp.shared_experts.down_proj.weight", (Is, H), dtype))
    out.append(_p("ernie.norm.weight", (H,), dtype))
    out.append(_p("lm_head.weight", (H, vocab), dtype))
    return out


def _tiny() -> List[ParamSpec]:
    return [
        _p("embed.weight", (64, 16), "float32"),
        _p("layer0.q.weight", (16, 16), "float32"),
        _p("layer0.k.weight", (16, 8), "float32"),
        _p("layer0.norm.weight", (16,), "float32"),
        _p("layer0.up.weight", (16, 32), "float32"),
        _p("layer0.down.weight", (32, 16), "float32"),
        _p("layer0.down.bias", (16,), "float32"),
        _p("layer0.experts.0.up.weight", (16, 24), "float32", True),
        _p("layer0.experts.1.up.weight", (16, 24), "float32", True),
        _p("layer0.experts.fused.weight", (2, 24, 16), "float32", True),
    ]


_PRESETS: Dict[str, Callable[[], List[ParamSpec]]] = {
    "ernie-moe-small": lambda: ernie_moe(),
    "ernie-moe-small-fused": lambda: ernie_moe(fused_experts=True),
    # no experts: every Muon matrix is dense, the traffic comm_group_call_opt routes
    "dense-heavy": lambda: ernie_moe(hidden=4096, layers=24, dense_layers=24, num_heads=32,
                                     num_kv_heads=32, dense_intermediate=16384),
    # ERNIE-4.5-21B-A3B's shape: most Muon bytes are experts, as on real large MoEs
    "ernie-moe-large": lambda: ernie_moe(hidden=2560, layers=28, dense_layers=1,
                                         num_experts=64, moe_intermediate=1536,
                                         shared_experts=2, dense_intermediate=12288,
                                         num_heads=20, num_kv_heads=4),
    "tiny": _tiny,
}


def list_presets() -> List[str]:
    return sorted(_PRESETS)


def get_preset(name: str) -> List[ParamSpec]:
    """Parameter list of preset ``name`` (model order)."""
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {list_presets()}")
    return _PRESETS[name]()


def muon_specs(params: Sequence[ParamSpec], expert: Optional[bool] = None):
    """MatrixSpecs of the Muon params (optionally only expert / non-expert)."""
    return [
        p.to_matrix_spec()
        for p in params
        if p.use_muon and (expert is None or p.is_expert == expert)
    ]


def load_json(path: str) -> List[ParamSpec]:
    """Read ``[{"name", "shape", "dtype"?, "is_expert"?, "use_muon"?}, ...]``
    (or ``{"params": [...]}``); ``use_muon`` defaults to :func:`muon_applies`."""
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict):
        data = data.get("params")
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of parameter objects")
    out = []
    for i, obj in enumerate(data):
        if not isinstance(obj, dict) or "name" not in obj or "shape" not in obj:
            raise ValueError(f"{path}: entry {i} needs 'name' and 'shape'")
        shape = tuple(int(d) for d in obj["shape"])
        name = str(obj["name"])
        use = obj.get("use_muon")
        out.append(
            ParamSpec(
                name,
                shape,
                str(obj.get("dtype", "float32")),
                bool(obj.get("is_expert", False)),
                muon_applies(name, shape) if use is None else bool(use),
            )
        )
    return out


def dump_json(params: Sequence[ParamSpec], path: str) -> None:
    with open(path, "w") as f:
        json.dump([dict(asdict(p), shape=list(p.shape)) for p in params], f, indent=1)
