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
"""The namespace cluster's network: names, the capability probe, set-up and clean-up.

Part of the ``cluster`` tool (see ``cluster``): a bridge in its own network
namespace, one namespace per node with a veth into the bridge, an address
from 198.18.0.0/15 and a ``tbf`` rate limit on both ends of the link. Every
name carries a per-run prefix (``pmc-<pid>-``), so :func:`sweep_stale` can
remove what a killed run left once its pid is gone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

__all__ = [
    "MAX_NODES",
    "ClusterNames",
    "ClusterUnavailable",
    "NetnsCluster",
    "list_namespaces",
    "probe_capability",
    "remove_namespaces",
    "sweep_stale",
]

#: Largest inputs: nodes fit one /24 of 198.18.0.0/15.
MAX_NODES = 200
_SUBNET_PREFIX = "198.18.0."
_FIRST_HOST = 10
_NS_RE = re.compile(r"^pmc-([0-9a-f]+)p?-(br|n\d+)$")


class ClusterUnavailable(RuntimeError):
    """This box cannot build namespaces / veths / tbf (the reason is the message)."""


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise RuntimeError(f"'{' '.join(argv)}' failed: {done.stderr.strip() or done.returncode}")
    return done


@dataclass(frozen=True)
class ClusterNames:
    """Every name and address one run creates; ``run_id`` is its pid in hex."""

    run_id: str
    nodes: int

    @property
    def bridge_ns(self) -> str:
        return f"pmc-{self.run_id}-br"

    @property
    def bridge(self) -> str:
        return f"pmc{self.run_id}br"

    def node_ns(self, k: int) -> str:
        return f"pmc-{self.run_id}-n{k}"

    def node_if(self, k: int) -> str:
        return f"pmc{self.run_id}n{k}"

    def bridge_if(self, k: int) -> str:
        return f"pmc{self.run_id}b{k}"

    def ip(self, k: int) -> str:
        return f"{_SUBNET_PREFIX}{_FIRST_HOST + k}"

    def namespaces(self) -> List[str]:
        return [self.bridge_ns] + [self.node_ns(k) for k in range(self.nodes)]

    @classmethod
    def for_this_process(cls, nodes: int) -> ClusterNames:
        if not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"--nodes must be in 1..{MAX_NODES} (one /24 of 198.18.0.0/15), got {nodes}")
        return cls(f"{os.getpid():x}", nodes)


def _tbf(link_mbit: float) -> List[str]:
    # burst holds a 64 KiB GSO packet whole, so counters see what TCP sent
    burst = max(96 * 1024, int(link_mbit * 1e6 / 8 / 100))
    return ["tbf", "rate", f"{link_mbit}mbit", "burst", str(burst), "latency", "400ms"]


def probe_capability() -> Optional[str]:
    """None when this box can build a cluster, else the one-line reason."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root or skip the cluster)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found: install iproute2"
    names = ClusterNames(f"{os.getpid():x}p", 1)
    ns = names.node_ns(0)
    try:
        _run(["ip", "netns", "add", ns])
    except RuntimeError as exc:
        return f"cannot create a network namespace: {exc}"
    try:
        _run(["ip", "-n", ns, "link", "add", names.node_if(0), "type", "veth",
              "peer", "name", names.bridge_if(0)])
        _run(["tc", "-n", ns, "qdisc", "add", "dev", names.node_if(0), "root", *_tbf(100)])
    except RuntimeError as exc:
        return f"veth / tbf unavailable: {exc}"
    else:
        # workers read their link's counters from a sysfs that 'ip netns exec' remounts
        seen = _run(["ip", "netns", "exec", ns, "cat",
                     f"/sys/class/net/{names.node_if(0)}/statistics/tx_bytes"], check=False)
        if seen.returncode != 0:
            return f"'ip netns exec' cannot show the namespace's sysfs: {seen.stderr.strip()}"
    finally:
        _run(["ip", "netns", "del", ns], check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces() -> List[str]:
    done = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _ns_pids(ns: str) -> List[int]:
    done = _run(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in done.stdout.split() if x.isdigit()]


def remove_namespaces(namespaces: Sequence[str], grace_s: float = 3.0) -> None:
    """Kill every process inside ``namespaces``, then delete them (and their links)."""
    present = set(list_namespaces())
    namespaces = [ns for ns in namespaces if ns in present]
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        pids = [p for ns in namespaces for p in _ns_pids(ns)]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait_s
        while pids and time.monotonic() < deadline:
            pids = [p for ns in namespaces for p in _ns_pids(ns)]
            time.sleep(0.1)
    for ns in namespaces:
        _run(["ip", "netns", "del", ns], check=False)


def sweep_stale() -> List[str]:
    """Remove namespaces of earlier runs whose process is gone; returns their names."""
    stale = []
    for ns in list_namespaces():
        m = _NS_RE.match(ns)
        if m and not _pid_alive(int(m.group(1), 16)):
            stale.append(ns)
    remove_namespaces(stale, grace_s=1.0)
    return stale


class NetnsCluster:
    """The namespaces, bridge and rate-limited veths of one run.

    ``up()`` records each namespace before creating it, so ``down()`` (always
    called, also after a failed or interrupted ``up``) removes whatever exists;
    links and qdiscs live inside the namespaces and go with them.
    """

    def __init__(self, names: ClusterNames, link_mbit: float) -> None:
        if not link_mbit > 0:
            raise ValueError(f"--link-mbit must be > 0, got {link_mbit}")
        self.names = names
        self.link_mbit = link_mbit
        self.created: List[str] = []

    def _add_ns(self, ns: str) -> None:
        # recorded first: a signal between the two lines must not leak it
        self.created.append(ns)
        _run(["ip", "netns", "add", ns])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def up(self) -> None:
        n = self.names
        self._add_ns(n.bridge_ns)
        _run(["ip", "-n", n.bridge_ns, "link", "add", n.bridge, "type", "bridge"])
        _run(["ip", "-n", n.bridge_ns, "link", "set", n.bridge, "up"])
        for k in range(n.nodes):
            ns = n.node_ns(k)
            self._add_ns(ns)
            _run(["ip", "-n", ns, "link", "add", n.node_if(k), "type", "veth",
                  "peer", "name", n.bridge_if(k), "netns", n.bridge_ns])
            _run(["ip", "-n", n.bridge_ns, "link", "set", n.bridge_if(k), "master", n.bridge])
            _run(["ip", "-n", n.bridge_ns, "link", "set", n.bridge_if(k), "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{n.ip(k)}/24", "dev", n.node_if(k)])
            _run(["ip", "-n", ns, "link", "set", n.node_if(k), "up"])
            for where, dev in ((ns, n.node_if(k)), (n.bridge_ns, n.bridge_if(k))):
                _run(["tc", "-n", where, "qdisc", "add", "dev", dev, "root",
                      *_tbf(self.link_mbit)])

    def down(self) -> None:
        remove_namespaces(list(reversed(self.created)))
        self.created = []

    def netns_inode(self, k: int) -> int:
        return os.stat(os.path.join("/run/netns", self.names.node_ns(k))).st_ino

    def link_bytes(self, k: int) -> Tuple[int, int]:
        """(tx, rx) of node ``k``'s veth, read through netlink."""
        done = _run(["ip", "-j", "-s", "-n", self.names.node_ns(k), "link", "show", "dev",
                     self.names.node_if(k)])
        stats = json.loads(done.stdout)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def leftovers(self) -> List[str]:
        """Namespaces of this run that still exist (empty after ``down``)."""
        present = set(list_namespaces())
        return [ns for ns in self.names.namespaces() if ns in present]
