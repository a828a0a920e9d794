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

from .muon import Muon, MuonParamInfo, MuonParamInfoMap  # noqa: F401

__all__ = [
    "Muon",
    "MuonParamInfo",
    "MuonParamInfoMap",
]

# Package-only helpers (develop's paddle.optimizer has none of them): not
# exported, so an exported tree's paddle.optimizer stays as develop has it.
# paddle_muon_ext: compat-begin
from .muon_helpers import (  # noqa: E402, F401
    NS_COEFFS_PRESETS,
    build_muon_param_info_map,
    keep_whole,
    muon_update_scale,
    newton_schulz,
    resolve_ns_coeffs,
)

from .muon_helpers import __all__ as _helper_names  # noqa: E402

__all__ += _helper_names
# paddle_muon_ext: compat-end
