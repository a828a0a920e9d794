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
"""Flight recorder: each rank's recent collectives, dumped when a step stalls.

A rank whose collective stays in flight past ``PADDLE_MUON_FLIGHT_TIMEOUT``
writes a dump naming its in-flight and last finished collectives and its
thread stacks, and asks its peers to dump too; ``paddle-muon-ext hangs``
reads the dumps of all ranks and names the rank the others wait on.
"""

from .recorder import (
    FlightRecorder,
    RankState,
    arm,
    diagnose,
    disarm,
    dump_path,
    get_flight_recorder,
    phase_of_thread,
    thread_stacks,
)

__all__ = [
    "FlightRecorder",
    "RankState",
    "arm",
    "diagnose",
    "disarm",
    "dump_path",
    "get_flight_recorder",
    "phase_of_thread",
    "thread_stacks",
]
