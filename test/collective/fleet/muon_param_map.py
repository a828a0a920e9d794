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
"""A ``muon_param_info_map`` for the Muon tests, from develop's names only.

``MuonShardingOptimizer`` needs an entry for every trainable parameter.
Develop's ``paddle.optimizer.muon`` has no helper that builds one (the
package's ``paddle_muon_ext.optimizer.build_muon_param_info_map`` is not
exported), so the tests use this one: it needs only develop's
``_default_should_use_muon`` and ``MuonParamInfo`` and so also runs in a
Paddle tree that keeps develop's ``muon.py``.
"""

from __future__ import annotations

from typing import Any, Sequence

from paddle_muon_ext.optimizer.muon import MuonParamInfo, _default_should_use_muon

__all__ = ["build_muon_param_info_map"]


def build_muon_param_info_map(
    parameters: Sequence[Any], exclude_patterns: Sequence[str] = ()
) -> dict:
    """``{name: MuonParamInfo(use_muon=...)}`` for every parameter, by develop's rule.

    Args:
        parameters: The parameters.
        exclude_patterns: As ``Muon(muon_exclude_patterns=...)``; ``()``
            routes every 2-D/3-D parameter to Muon.

    Returns:
        dict: parameter name -> ``MuonParamInfo``.
    """
    patterns = list(exclude_patterns)
    info = {}
    for p in parameters:
        # expert stacks may be stored 2-D; the rule sees the shape they had
        shape = list(getattr(p, "original_shape", None) or p.shape)
        info[p.name] = MuonParamInfo(use_muon=_default_should_use_muon(p.name, shape, patterns))
    return info
