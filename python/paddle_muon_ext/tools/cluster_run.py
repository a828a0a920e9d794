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
"""Running the namespace cluster: configuration, the launchers, progress, result.

Part of the ``cluster`` tool (see ``cluster`` for the whole picture):
:func:`run_cluster` builds the network (``cluster_netns``), starts one
``paddle.distributed.launch`` per node inside its namespace, follows the
workers' ``CLUSTER_*`` records in their logs, checks that every rank runs on
the node the optimizer's plan puts it on, and returns the per-pass bytes and
step times as a :class:`ClusterResult`. The network is removed whatever
happens.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from .cluster_netns import (
    MAX_NODES,
    ClusterNames,
    ClusterUnavailable,
    NetnsCluster,
    probe_capability,
    sweep_stale,
)

__all__ = [
    "ClusterConfig",
    "ClusterInterrupted",
    "ClusterResult",
    "fmt_bytes",
    "run_cluster",
    "tiny_moe_params",
]

#: The bytes of a step are mostly Muon messages of the resized tiny model;
#: 100 Mbit/s makes the link, not the 2-core CPU, the bottleneck of a step.
DEFAULT_LINK_MBIT = 100.0
DEFAULT_HIDDEN = 256
DEFAULT_INNER = 64
#: comm_buffer_size_MB of the worker's strategy (fused gradient buffers).
WORKER_BUFFER_MB = 1.0
MASTER_PORT = 36170
#: Pass names of ``cluster --recommended`` (``ClusterConfig.pass_configs`` order).
PASS_NAMES = ("default", "recommended")
#: Largest inputs besides ``MAX_NODES``: a run on one box stays within minutes.
MAX_PROCS = 64
MAX_STEPS = 1000
MAX_DIM = 8192

_THIS = os.path.abspath(__file__)


def checkout_root() -> str:
    """The source checkout this module runs from (editable install)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(_THIS))))


def worker_script() -> str:
    return os.path.join(checkout_root(), "test", "collective", "fleet", "cluster_muon_worker.py")


def tiny_moe_params(hidden: int, inner: int, local_experts: int = 2) -> List[Dict[str, Any]]:
    """The worker model's parameters in model order (``muon_tiny_moe.TinyMoE``
    resized): name, shape, is_expert; matrices are Muon parameters."""
    h, i = hidden, inner
    out = [("dense.w_in", (h, h), False), ("dense.b_in", (h,), False),
           ("dense.norm_w", (h,), False), ("dense.w_out", (h, 2 * h), False)]
    for e in range(local_experts):
        out += [(f"expert.up{e}", (h, i), True), (f"expert.down{e}", (i, h), True)]
    out += [("expert.fused", (local_experts, h, i), True), ("expert.bias", (h,), True)]
    return [{"name": n, "shape": s, "is_expert": x, "use_muon": len(s) >= 2}
            for n, s, x in out]


class ClusterInterrupted(RuntimeError):
    """A signal arrived; the run is cleaned up and abandoned.

    Attributes:
        signum: the signal (the exit status is 128 + signum, as a shell reports).
    """

    def __init__(self, message: str, signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.signum = int(signum)


@dataclass(frozen=True)
class ClusterConfig:
    """One cluster run, as given on the command line."""

    nodes: int
    procs_per_node: int
    ep: int
    moe_sharding: int
    steps: int = 3
    link_mbit: float = DEFAULT_LINK_MBIT
    hidden: int = DEFAULT_HIDDEN
    inner: int = DEFAULT_INNER
    group_call: str = "both"
    timeout_s: float = 900.0
    mode: str = "train"
    #: ``cluster --recommended``: one (comm_group_call_opt, muon_partition_strategy,
    #: comm_buffer_size_MB) per pass, named by :data:`PASS_NAMES`; empty: the
    #: ``group_call`` passes (option off / on, 1 MB buffers, the default rule).
    pass_configs: Tuple[Tuple[bool, str, float], ...] = ()

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    def validate(self) -> None:
        """Every value checked before anything is built (ValueError naming the flag).

        A layout the ``comm_group_call_opt`` pass cannot run (one node, one
        process per node, ...) is refused here, with ``--group-call 0`` as
        the way to train it, rather than after the flat pass has trained.
        """
        self.validate_values()
        why = self.group_call_refusal() if self.uses_group_call() else None
        if why:
            raise ValueError(
                f"--nodes {self.nodes} --procs-per-node {self.procs_per_node}: the "
                f"comm_group_call_opt pass cannot run on this layout ({why}); pass "
                "--group-call 0 to train the flat path alone")

    def validate_values(self) -> None:
        """The checks that need no Paddle (types, ranges, the world size): run
        first, so a bad flag is refused in well under a second, before the
        layout check imports Paddle."""
        for flag, value, high in (("--nodes", self.nodes, MAX_NODES),
                                  ("--procs-per-node", self.procs_per_node, MAX_PROCS),
                                  ("--ep", self.ep, MAX_PROCS * MAX_NODES),
                                  ("--moe-sharding", self.moe_sharding, MAX_PROCS * MAX_NODES),
                                  ("--steps", self.steps, MAX_STEPS),
                                  ("--hidden", self.hidden, MAX_DIM),
                                  ("--inner", self.inner, MAX_DIM)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{flag} must be an integer, got {value!r}")
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
            if value > high:
                raise ValueError(f"{flag} {value}: above the limit {high} of this tool")
        for flag, value, high in (("--link-mbit", self.link_mbit, 1e5),
                                  ("--timeout", self.timeout_s, 86400.0)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{flag} must be a finite number > 0, got {value!r}")
            if value > high:
                raise ValueError(f"{flag} {value:g}: above the limit {high:g}")
        if self.ep * self.moe_sharding != self.world_size:
            raise ValueError(
                f"--ep {self.ep} x --moe-sharding {self.moe_sharding} = "
                f"{self.ep * self.moe_sharding} ranks, but --nodes {self.nodes} x "
                f"--procs-per-node {self.procs_per_node} = {self.world_size}")
        if self.group_call not in ("0", "1", "both"):
            raise ValueError(f"--group-call must be 0, 1 or both, got {self.group_call!r}")
        if self.mode == "train" and self.ep < 2:
            # Paddle builds the expert-parallel topology (hcg._moe_topo) only
            # for ep_degree > 1; the workers train the tiny MoE over it.
            raise ValueError(
                f"--ep {self.ep}: the cluster trains a MoE model and needs an expert-parallel "
                "group; pass --ep 2 or more (--moe-sharding = ranks / ep)")

    def group_call_refusal(self) -> Optional[str]:
        """Why the optimizer would refuse ``comm_group_call_opt`` here, or None."""
        if self.mode != "train":
            return None
        from .args import MuonCommConfig

        try:
            MuonCommConfig(ep=self.ep, moe_sharding=self.moe_sharding, pp=1,
                           gpus_per_node=self.procs_per_node).build_plan()
        except ValueError as exc:
            return str(exc)
        return None

    def passes(self) -> List[int]:
        """The pass labels, in order: the option's value (0 / 1), or the index
        into ``pass_configs``."""
        if self.pass_configs:
            return list(range(len(self.pass_configs)))
        return {"0": [0], "1": [1], "both": [0, 1]}[self.group_call]

    def pass_name(self, label: int) -> str:
        """``off`` / ``on``, or ``default`` / ``recommended`` (``--recommended``)."""
        if self.pass_configs:
            return PASS_NAMES[label] if label < len(PASS_NAMES) else f"pass{label}"
        return "on" if label else "off"

    def pass_group_call(self, label: int) -> bool:
        """Whether pass ``label`` trains with ``comm_group_call_opt`` on."""
        return bool(self.pass_configs[label][0]) if self.pass_configs else bool(label)

    def uses_group_call(self) -> bool:
        return any(self.pass_group_call(g) for g in self.passes())

    def worker_pass_configs(self) -> Optional[str]:
        """``MUON_PASS_CONFIGS`` for the workers (None: the ``group_call`` passes)."""
        if not self.pass_configs:
            return None
        return json.dumps([{"comm_group_call_opt": bool(g), "muon_partition_strategy": rule,
                            "comm_buffer_size_MB": float(mb)}
                           for g, rule, mb in self.pass_configs])


@dataclass
class ClusterResult:
    """What a run observed; ``status`` is PASS / FAIL."""

    config: ClusterConfig
    status: str = "FAIL"
    problems: List[str] = field(default_factory=list)
    ranks: Dict[int, Dict[str, Any]] = field(default_factory=dict)
    steps: Dict[Tuple[int, int], Dict[str, float]] = field(default_factory=dict)
    probes: List[Dict[str, Any]] = field(default_factory=list)
    node_of_rank: Dict[int, int] = field(default_factory=dict)
    prediction: Optional[Dict[str, Any]] = None
    wall_s: float = 0.0
    log_dir: str = ""
    leftovers: List[str] = field(default_factory=list)

    def per_pass(self) -> Dict[int, Dict[str, float]]:
        """group_call -> measured bytes / step time, averaged over the timed steps.

        Step 1 is left out when there are more (it builds fused buffers and the
        first messages open connections); its bytes are reported separately.
        """
        out: Dict[int, Dict[str, float]] = {}
        for g in self.config.passes():
            rows = [(s, v) for (gc, s), v in sorted(self.steps.items()) if gc == g]
            if not rows:
                continue
            timed = [v for s, v in rows if s > 1] or [v for _, v in rows]
            n = len(timed)
            out[g] = {
                "timed_steps": n,
                "inter_node_bytes_per_step": sum(v["tx"] for v in timed) / n,
                "inter_node_rx_bytes_per_step": sum(v["rx"] for v in timed) / n,
                "step_time_s": sum(v["seconds"] for v in timed) / n,
                # the slowest rank's forward + backward and single-process
                # reference step (compute alone), where the workers report them
                **{k: sum(v[k] for v in timed) / n for k in ("fwd_bwd_s", "reference_step_s")
                   if all(k in v for v in timed)},
                "first_step_bytes": rows[0][1]["tx"],
            }
        return out

    def to_json(self) -> Dict[str, Any]:
        return {
            "status": self.status,
            "problems": self.problems,
            "config": self.config.__dict__,
            "node_of_rank": {str(r): n for r, n in sorted(self.node_of_rank.items())},
            "measured": {self.config.pass_name(g): v for g, v in self.per_pass().items()},
            "steps": [{"pass": self.config.pass_name(g),
                       "group_call": int(self.config.pass_group_call(g)), "step": s, **v}
                      for (g, s), v in sorted(self.steps.items())],
            "probes": self.probes,
            "prediction": self.prediction,
            "wall_s": self.wall_s,
            "log_dir": self.log_dir,
            "leftovers": self.leftovers,
        }


_RECORD_RE = re.compile(r"CLUSTER_(RANK|STEP|PROBE) (\{.*\})\s*$")


class _LogFollower:
    """Reads new complete lines of the workers' logs as they grow."""

    def __init__(self, log_root: str) -> None:
        self.log_root = log_root
        self.offsets: Dict[str, int] = {}

    def files(self) -> List[str]:
        out = []
        for dirpath, _, names in os.walk(self.log_root):
            out += [os.path.join(dirpath, n) for n in sorted(names) if n.startswith("workerlog.")]
        return sorted(out)

    def new_lines(self) -> Iterator[str]:
        for path in self.files():
            with open(path, "rb") as f:
                f.seek(self.offsets.get(path, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1
            self.offsets[path] = self.offsets.get(path, 0) + end
            for line in data[:end].decode(errors="replace").splitlines():
                yield line


def _worker_env(cfg: ClusterConfig, names: ClusterNames, k: int) -> Dict[str, str]:
    env = {k_: v for k_, v in os.environ.items()
           if not k_.startswith(("PADDLE_", "GLOO_", "FLAGS_selected"))}
    # paddle 3.3.1's launcher dies on a set-but-empty CUDA_VISIBLE_DEVICES
    env.pop("CUDA_VISIBLE_DEVICES", None)
    root = checkout_root()
    paths = [os.path.join(root, "python"), os.path.join(root, "test", "collective", "fleet"),
             os.path.join(root, "test")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env.update({
        "PYTHONPATH": os.pathsep.join(paths),
        "PYTHONUNBUFFERED": "1",
        "GLOO_SOCKET_IFNAME": names.node_if(k),
        "MUON_EP": str(cfg.ep), "MUON_MS": str(cfg.moe_sharding),
        "MUON_STEPS": str(cfg.steps), "MUON_GROUP_CALL": cfg.group_call,
        "MUON_HIDDEN": str(cfg.hidden), "MUON_INNER": str(cfg.inner),
        "MUON_CLUSTER_MODE": cfg.mode,
    })
    if cfg.worker_pass_configs():
        env["MUON_PASS_CONFIGS"] = cfg.worker_pass_configs()
    return env


def _launch_argv(cfg: ClusterConfig, names: ClusterNames, k: int, log_dir: str) -> List[str]:
    return ["ip", "netns", "exec", names.node_ns(k), sys.executable, "-m",
            "paddle.distributed.launch",
            "--master", f"{names.ip(0)}:{MASTER_PORT}", "--nnodes", str(cfg.nodes),
            "--rank", str(k), "--nproc_per_node", str(cfg.procs_per_node),
            "--host", names.ip(k), "--log_dir", log_dir, "--log_overwrite", "true",
            worker_script()]


class _Progress:
    """Collects the workers' records; prints one line per finished step."""

    def __init__(self, cfg: ClusterConfig, result: ClusterResult,
                 emit: Callable[[str], None]) -> None:
        self.cfg, self.result, self.emit = cfg, result, emit
        self.pending: Dict[Tuple[int, int], List[Dict[str, Any]]] = defaultdict(list)

    def feed(self, line: str) -> None:
        m = _RECORD_RE.search(line)
        if not m:
            return
        kind, rec = m.group(1), json.loads(m.group(2))
        if kind == "RANK":
            self.result.ranks[int(rec["rank"])] = rec
        elif kind == "PROBE":
            self.result.probes.append(rec)
        else:
            key = (int(rec.get("pass_label", rec["group_call"])), int(rec["step"]))
            self.pending[key].append(rec)
            if len(self.pending[key]) == self.cfg.world_size:
                recs = self.pending.pop(key)
                self._check_applied(key, recs)
                row = {"seconds": max(r["seconds"] for r in recs),
                       "tx": sum(r["tx"] for r in recs if r["leader"]),
                       "rx": sum(r["rx"] for r in recs if r["leader"]),
                       "loss": recs[0]["loss"]}
                for extra in ("fwd_bwd_s", "reference_step_s"):
                    if all(extra in r for r in recs):
                        row[extra] = max(r[extra] for r in recs)
                self.result.steps[key] = row
                what = (f"{self.cfg.pass_name(key[0]):<11}" if self.cfg.pass_configs
                        else f"option {'on ' if key[0] else 'off'}")
                self.emit(f"[cluster] {what} step "
                          f"{key[1]}/{rec['steps']}: step time {row['seconds']:.3f} s, "
                          f"inter-node {fmt_bytes(row['tx'])} sent "
                          f"({fmt_bytes(row['rx'])} received)")


    def _check_applied(self, key: Tuple[int, int], recs: List[Dict[str, Any]]) -> None:
        """With ``pass_configs``, every rank's optimizer must have read the
        pass's configuration (checked on each pass's first step)."""
        if not self.cfg.pass_configs or key[1] != 1:
            return
        g, rule, mb = self.cfg.pass_configs[key[0]]
        want = {"comm_group_call_opt": bool(g), "muon_partition_strategy": rule,
                "comm_buffer_size_MB": float(mb)}
        for r in recs:
            if r.get("applied") != want:
                self.result.problems.append(
                    f"rank {r['rank']} pass {self.cfg.pass_name(key[0])}: the optimizer "
                    f"read {r.get('applied')}, the pass asked for {want}")


def fmt_bytes(n: float) -> str:
    for unit, scale in (("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _check_ranks(cfg: ClusterConfig, result: ClusterResult, inode_to_node: Dict[int, int]) -> None:
    """Each rank's namespace must be the node the optimizer's plan puts it on."""
    problems = result.problems
    missing = sorted(set(range(cfg.world_size)) - set(result.ranks))
    if missing:
        problems.append(f"ranks {missing} reported no CLUSTER_RANK record")
    for r, rec in sorted(result.ranks.items()):
        node = inode_to_node.get(int(rec["netns_inode"]))
        if node is None:
            problems.append(f"rank {r} runs in no namespace of this cluster")
            continue
        result.node_of_rank[r] = node
        if rec.get("paddle_local_size") != str(cfg.procs_per_node):
            problems.append(f"rank {r}: PADDLE_LOCAL_SIZE={rec.get('paddle_local_size')} from "
                            f"the launcher, expected {cfg.procs_per_node}")
        if cfg.mode != "train":
            continue
        for g, diff in rec.get("max_abs_diff", {}).items():
            if not diff <= 1e-5:
                what = f"pass {cfg.pass_name(int(g))}" if cfg.pass_configs else f"group_call={g}"
                problems.append(f"rank {r} {what}: max |param - reference| {diff:.3e}")
        if not cfg.uses_group_call():
            continue
        if rec.get("plan_node") != node or rec.get("plan_gpus_per_node") != cfg.procs_per_node:
            problems.append(f"rank {r} runs on node {node} but the optimizer's plan says node "
                            f"{rec.get('plan_node')} (gpus_per_node "
                            f"{rec.get('plan_gpus_per_node')})")


def _drive(cfg: ClusterConfig, names: ClusterNames, net: NetnsCluster, result: ClusterResult,
           log_root: str, procs: List[subprocess.Popen], emit: Callable[[str], None],
           start: float) -> None:
    """Start one launcher per node, follow the logs until all exit (or one
    fails, or the timeout), then check what the ranks reported."""
    emit(f"[cluster] {cfg.nodes} nodes x {cfg.procs_per_node} procs: namespaces "
         f"{names.node_ns(0)}..{cfg.nodes - 1}, bridge {names.bridge_ns}, links "
         f"{cfg.link_mbit:g} Mbit/s (tbf), node 0 at {names.ip(0)}")
    inode_to_node = {net.netns_inode(k): k for k in range(cfg.nodes)}
    for k in range(cfg.nodes):
        node_dir = os.path.join(log_root, f"node{k}")
        os.makedirs(node_dir)
        out = open(os.path.join(node_dir, "launcher.log"), "w")
        try:
            procs.append(subprocess.Popen(
                _launch_argv(cfg, names, k, node_dir), env=_worker_env(cfg, names, k),
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=node_dir, start_new_session=True))
        finally:
            out.close()
    follower = _LogFollower(log_root)
    progress = _Progress(cfg, result, emit)
    deadline = start + cfg.timeout_s
    while True:
        for line in follower.new_lines():
            progress.feed(line)
        codes = [p.poll() for p in procs]
        # one failed node leaves the others waiting on it: stop at once
        if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
            break
        if time.monotonic() > deadline:
            result.problems.append(f"timed out after {cfg.timeout_s:.0f} s")
            break
        time.sleep(0.2)
    for line in follower.new_lines():
        progress.feed(line)
    codes = [p.poll() for p in procs]
    if any(c != 0 for c in codes) and not result.problems:
        result.problems.append("launcher exit codes " + ", ".join(
            f"node {k}: {'running' if c is None else c}" for k, c in enumerate(codes)))
    for path in follower.files():
        with open(path, errors="replace") as f:
            for line in f:
                if "MUON_CHECK_FAILED" in line:
                    result.problems.append(line.strip())
    _check_ranks(cfg, result, inode_to_node)
    if cfg.mode == "train":
        missing = [(g, s) for g in cfg.passes() for s in range(1, cfg.steps + 1)
                   if (g, s) not in result.steps]
        if missing and not result.problems:
            result.problems.append(f"steps without records from every rank: {missing}")


def run_cluster(cfg: ClusterConfig, emit: Callable[[str], None] = print,
                keep_logs: bool = False) -> ClusterResult:
    """Build the cluster, run the workers, tear everything down; never raises
    for a failed run (see ``result.problems``).

    Raises:
        ClusterUnavailable: the box cannot build namespaces (nothing was created).
        ClusterInterrupted: a signal arrived (everything was cleaned up first).
        ValueError: an invalid configuration.
    """
    cfg.validate()
    reason = probe_capability()
    if reason:
        raise ClusterUnavailable(reason)
    if not os.path.isfile(worker_script()):
        raise ClusterUnavailable(f"worker {worker_script()} not found: the cluster runs from a "
                                 "source checkout (pip install -e .)")
    sweep_stale()
    names = ClusterNames.for_this_process(cfg.nodes)
    net = NetnsCluster(names, cfg.link_mbit)
    result = ClusterResult(cfg)
    log_root = tempfile.mkdtemp(prefix="muon_cluster_")
    result.log_dir = log_root
    procs: List[subprocess.Popen] = []
    start = time.monotonic()
    interrupted: Optional[ClusterInterrupted] = None
    try:
        try:
            net.up()
        except RuntimeError as exc:
            result.problems.append(f"building the network failed: {exc}")
        else:
            _drive(cfg, names, net, result, log_root, procs, emit, start)
    except ClusterInterrupted as exc:
        interrupted = exc
    finally:
        net.down()
        for p in procs:
            # Normally gone with its namespace; a launcher that is not (it left
            # the namespace, or down() failed) dies with its session here.
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
            p.wait()
        result.leftovers = net.leftovers()
        result.wall_s = time.monotonic() - start
    if interrupted is not None:
        # only now: until the launchers were killed above they still wrote
        # worker logs into it, and a removal under them left the directory
        if not keep_logs:
            shutil.rmtree(log_root, ignore_errors=True)
        raise interrupted
    if result.leftovers:
        result.problems.append(f"namespaces left behind: {result.leftovers}")
    result.status = "FAIL" if result.problems else "PASS"
    if result.status == "FAIL":
        _report_logs(log_root, emit)
    elif not keep_logs:
        shutil.rmtree(log_root, ignore_errors=True)
    return result


def _report_logs(log_root: str, emit: Callable[[str], None], tail: int = 15) -> None:
    emit(f"[cluster] logs kept in {log_root}")
    for path in _LogFollower(log_root).files() + sorted(
            os.path.join(log_root, d, "launcher.log") for d in os.listdir(log_root)):
        if not os.path.isfile(path):
            continue
        with open(path, errors="replace") as f:
            lines = [ln for ln in f.read().splitlines() if "CLUSTER_" not in ln]
        emit(f"----- {os.path.relpath(path, log_root)} (last {tail} lines) -----")
        for ln in lines[-tail:]:
            emit(ln)
