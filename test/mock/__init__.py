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
"""Test harness for paddle_muon_ext's distributed code (no GPU, one process).

Modules (import what you need; nothing is imported eagerly here):
  * ``comm_record``      - ``CommRecord``: one logged collective / group creation.
  * ``fake_groups``      - ``FakeGroup`` (a Paddle ``Group``), process group, tasks.
  * ``fake_comm``        - ``FakeComm``: the fake collectives (record / data modes).
  * ``patching``         - ``fake_distributed(...)`` context manager, ``fake_dist``
                           fixture, ``patch_points()``.
  * ``fake_hcg``         - ``make_hcg_factory(ep, moe_sharding, pp, mp, order)``:
                           Paddle's own EPHybridCommunicateGroup per simulated rank.
  * ``schedule_checker`` - ``check_schedule(traces)`` / ``find_divergences``.
  * ``simulated_world``  - ``SimulatedWorld(world_size, ...).run(fn)``.

Example::

    from mock.fake_hcg import make_hcg_factory
    from mock.simulated_world import SimulatedWorld

    def step(rank):
        hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
        group = hcg.get_sharding_parallel_group()
        grad = paddle.full([64, 64], float(rank))
        paddle.distributed.reduce(grad, dst=group.ranks[0], op=paddle.distributed.ReduceOp.AVG,
                                 group=group)
        return grad.numpy()

    world = SimulatedWorld(16, hcg_factory=make_hcg_factory(ep=4, moe_sharding=2, pp=2))
    results = world.run(step)      # data mode: threads, real data, NaN on non-roots
    world.check_schedule()         # raises ScheduleMismatchError on the first divergence
"""
