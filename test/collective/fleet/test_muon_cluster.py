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
"""Multi-node runs on one box: one network namespace and one launcher per node.

Spec:

=====================  =====================================================
layout                 property
=====================  =====================================================
4 nodes x 2, ep=4,     every rank of every step of comm_group_call_opt off and
moe_sharding=2         on matches the single-process Muon reference (1e-5);
                       ``PADDLE_LOCAL_SIZE`` comes from each node's launcher;
                       each rank runs in namespace ``rank // 2``, which is the
                       node the optimizer's plan puts it on; node links carried
                       traffic; nothing is left behind
3 nodes x 2, ep=3,     same, on a layout only the generalised plan accepts
moe_sharding=2         (ep not a multiple of the cards per node)
SIGTERM mid-run        the tool exits 143 (128 + SIGTERM) and removes every
                       namespace, link, process and temp dir of the run
=====================  =====================================================

The real runs need root, ``ip netns`` and ``tbf``; without them they skip
with the reason. The byte measurement is a benchmark
(``tools/bench/bench_cluster.py``), not a test. The parsing / reporting
helpers are tested without any of that.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from unittest import mock

from paddle_muon_ext.tools import cluster, cluster_netns as netns, cluster_run as crun

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.abspath(os.path.join(_HERE, "..", "..", ".."))
_UNAVAILABLE = netns.probe_capability()


def _ours(pid: int) -> list[str]:
    prefix = f"pmc-{pid:x}-"
    return [ns for ns in netns.list_namespaces() if ns.startswith(prefix)]


def _processes_on(ifname_prefix: str) -> list[int]:
    """Pids whose environment names a link of the run (its workers, launchers)."""
    needle = f"GLOO_SOCKET_IFNAME={ifname_prefix}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if any(v.startswith(needle) for v in f.read().split(b"\0")):
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


@unittest.skipIf(_UNAVAILABLE is not None, f"cluster unavailable: {_UNAVAILABLE}")
class TestMuonClusterRuns(unittest.TestCase):
    """Real launchers in real namespaces (tiny model, unthrottled-ish links)."""

    def _run(self, nodes: int, gpn: int, ep: int, ms: int) -> cluster.ClusterResult:
        cfg = cluster.ClusterConfig(nodes=nodes, procs_per_node=gpn, ep=ep, moe_sharding=ms,
                                    steps=2, link_mbit=1000, hidden=16, inner=24,
                                    timeout_s=400)
        lines: list[str] = []
        result = cluster.run_cluster(cfg, emit=lines.append)
        log = "\n".join(lines)
        self.assertEqual(result.status, "PASS", f"{result.problems}\n{log}")
        self.assertEqual(result.leftovers, [])
        self.assertEqual(_ours(os.getpid()), [], "namespaces of this run survived it")
        # where each rank ran, observed through its namespace, vs rank // gpn
        self.assertEqual(result.node_of_rank, {r: r // gpn for r in range(nodes * gpn)})
        for r, rec in result.ranks.items():
            self.assertEqual(rec["plan_node"], result.node_of_rank[r],
                             f"rank {r}: plan node vs namespace")
            self.assertEqual(rec["paddle_local_size"], str(gpn), f"rank {r}")
            self.assertEqual(set(rec["max_abs_diff"]), {"0", "1"}, f"rank {r}: both passes")
        # a progress line per step and pass; every step moved bytes across nodes
        for g in (0, 1):
            for s in (1, 2):
                self.assertGreater(result.steps[(g, s)]["tx"], 0, f"group_call={g} step {s}")
        self.assertEqual(sum("step" in ln for ln in lines), 4, log)
        return result

    def test_4_nodes_x_2_ep4_ms2(self) -> None:
        self._run(4, 2, 4, 2)

    def test_3_nodes_x_2_ep3_ms2_generalised_plan(self) -> None:
        self._run(3, 2, 3, 2)

    def test_sigterm_mid_run_leaves_nothing(self) -> None:
        tmp = tempfile.mkdtemp(prefix="muon_cluster_sig_")
        self.addCleanup(shutil.rmtree, tmp, True)
        env = dict(os.environ, TMPDIR=tmp, PYTHONPATH=os.pathsep.join(
            [os.path.join(_REPO, "python"), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.Popen(
            [sys.executable, os.path.join(_REPO, "tools", "muon_comm.py"), "cluster",
             "--nodes", "2", "--procs-per-node", "2", "--ep", "2", "--moe-sharding", "2",
             "--steps", "50", "--hidden", "16", "--inner", "24"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            first = proc.stdout.readline()
            self.assertIn("namespaces", first)
            deadline = time.monotonic() + 60
            while not _processes_on(f"pmc{proc.pid:x}n") and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(3)  # the workers are importing paddle / rendezvousing
            self.assertTrue(_ours(proc.pid), "the run's namespaces should exist mid-run")
            self.assertTrue(_processes_on(f"pmc{proc.pid:x}n"), "workers should be running")
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        self.assertEqual(proc.returncode, 128 + signal.SIGTERM, out)
        self.assertIn("SIGTERM", out)
        self.assertEqual(os.listdir(tmp), [], "the run's log dir was left behind")
        self.assertEqual(_ours(proc.pid), [], "namespaces left behind")
        self.assertEqual(_processes_on(f"pmc{proc.pid:x}n"), [], "processes left behind")


_FAKE_LAUNCHER = r"""
import json, os, sys, time
k, nodes, gpn, steps, log_dir, mode = sys.argv[1:]
k, nodes, gpn, steps = int(k), int(nodes), int(gpn), int(steps)
if mode == "hang":
    time.sleep(600)
for local in range(gpn):
    rank = k * gpn + local
    with open(os.path.join(log_dir, f"workerlog.{rank}"), "w") as log:
        for g in (0, 1):
            for s in range(1, steps + 1):
                rec = dict(rank=rank, group_call=g, step=s, steps=steps, seconds=0.5,
                           tx=100 * (2 - g) if local == 0 else 0, rx=7, leader=local == 0,
                           loss=0.25)
                log.write("CLUSTER_STEP " + json.dumps(rec) + "\n")
        if mode == "fail" and rank == 1:
            log.write("MUON_CHECK_FAILED rank 1 step 1: parameter dense.w_in differs\n")
            sys.exit(1)
        rec = dict(rank=rank, netns_inode=1000 + k, paddle_local_size=str(gpn), plan_node=k,
                   plan_gpus_per_node=gpn, max_abs_diff={"0": 0.0, "1": 0.0})
        log.write("CLUSTER_RANK " + json.dumps(rec) + "\n")
"""


class _FakeNet:
    """Stands in for NetnsCluster: no namespaces, node k has netns inode 1000 + k."""

    downs = 0

    def __init__(self, names, link_mbit) -> None:
        self.names = names

    def up(self) -> None:
        pass

    def down(self) -> None:
        _FakeNet.downs += 1

    def netns_inode(self, k: int) -> int:
        return 1000 + k

    def leftovers(self) -> list[str]:
        return []


class TestRunClusterOrchestration(unittest.TestCase):
    """run_cluster with the network faked and a fake launcher per node: log
    following, progress, failure / timeout handling and cleanup, without root."""

    def _run(self, mode: str, timeout_s: float = 120.0, net=None):
        cfg = cluster.ClusterConfig(nodes=2, procs_per_node=2, ep=2, moe_sharding=2,
                                    steps=2, timeout_s=timeout_s)

        def argv(cfg_, names, k, log_dir):
            return [sys.executable, "-c", _FAKE_LAUNCHER, str(k), str(cfg_.nodes),
                    str(cfg_.procs_per_node), str(cfg_.steps), log_dir, mode]

        lines: list[str] = []
        _FakeNet.downs = 0
        with mock.patch.object(crun, "probe_capability", return_value=None), \
                mock.patch.object(crun, "sweep_stale", return_value=[]), \
                mock.patch.object(crun, "NetnsCluster", net or _FakeNet), \
                mock.patch.object(crun, "_launch_argv", argv):
            result = cluster.run_cluster(cfg, emit=lines.append)
        self.addCleanup(shutil.rmtree, result.log_dir, True)
        self.assertEqual(_FakeNet.downs, 1, "the network must be torn down exactly once")
        return result, lines

    def test_clean_run_passes_and_reports_each_step(self) -> None:
        result, lines = self._run("ok")
        self.assertEqual(result.status, "PASS", result.problems)
        self.assertEqual(sum("step" in ln for ln in lines), 4, lines)
        self.assertEqual(result.node_of_rank, {0: 0, 1: 0, 2: 1, 3: 1})
        per = result.per_pass()
        self.assertEqual(per[0]["inter_node_bytes_per_step"], 400)  # 2 leaders x 200
        self.assertEqual(per[1]["inter_node_bytes_per_step"], 200)
        self.assertFalse(os.path.exists(result.log_dir), "logs of a passing run are removed")

    def test_failed_worker_fails_the_run_and_keeps_logs(self) -> None:
        result, lines = self._run("fail")
        self.assertEqual(result.status, "FAIL")
        text = "\n".join(result.problems)
        self.assertIn("node 0: 1", text)
        self.assertIn("MUON_CHECK_FAILED rank 1 step 1", text)
        self.assertTrue(any("logs kept in" in ln for ln in lines), lines)
        self.assertTrue(any("workerlog.1" in ln for ln in lines), lines)

    def test_failed_network_setup_is_torn_down_and_reported(self) -> None:
        class BrokenNet(_FakeNet):
            def up(self) -> None:
                raise RuntimeError("'ip link add' failed: Operation not permitted")

        result, _ = self._run("ok", net=BrokenNet)
        self.assertEqual(result.status, "FAIL")
        self.assertEqual(result.problems, ["building the network failed: 'ip link add' "
                                           "failed: Operation not permitted"])

    def test_hang_times_out_and_kills_the_launchers(self) -> None:
        t0 = time.monotonic()
        result, _ = self._run("hang", timeout_s=3)
        self.assertLess(time.monotonic() - t0, 60)
        self.assertEqual(result.status, "FAIL")
        self.assertIn("timed out after 3 s", "\n".join(result.problems))


class TestClusterHelpers(unittest.TestCase):
    """The launcher's bookkeeping, without namespaces."""

    def test_names_stay_in_limits(self) -> None:
        names = netns.ClusterNames("3fffff", 200)
        for k in (0, 199):
            self.assertLessEqual(len(names.node_if(k)), 15)  # IFNAMSIZ - 1
            self.assertLessEqual(len(names.bridge_if(k)), 15)
        self.assertEqual(names.ip(0), "198.18.0.10")
        self.assertEqual(names.ip(199), "198.18.0.209")
        self.assertEqual(len(set(names.namespaces())), 201)
        with self.assertRaisesRegex(ValueError, "--nodes"):
            netns.ClusterNames.for_this_process(201)

    def test_params_match_the_worker_model(self) -> None:
        import muon_tiny_moe

        saved = muon_tiny_moe.H, muon_tiny_moe.INNER
        muon_tiny_moe.H, muon_tiny_moe.INNER = 32, 8
        try:
            net = muon_tiny_moe.TinyMoE(0, None)
        finally:
            muon_tiny_moe.H, muon_tiny_moe.INNER = saved
        got = [(p["name"], tuple(p["shape"]), p["is_expert"])
               for p in crun.tiny_moe_params(32, 8)]
        want = [(p.name, tuple(p.shape), p.name.startswith("expert."))
                for p in net.parameters()]
        self.assertEqual(got, want)

    def test_config_errors_name_the_flag(self) -> None:
        bad = [({"ep": 3}, "--ep 3 x --moe-sharding 2"), ({"steps": 0}, "--steps"),
               ({"group_call": "2"}, "--group-call")]
        for change, message in bad:
            kwargs = {**dict(nodes=4, procs_per_node=2, ep=4, moe_sharding=2), **change}
            with self.assertRaisesRegex(ValueError, message):
                cluster.ClusterConfig(**kwargs).validate()
        with self.assertRaisesRegex(ValueError, "--link-mbit"):
            netns.NetnsCluster(netns.ClusterNames("1", 1), 0)

    def _records(self, cfg, node_of):
        """Worker records of a clean 2 x 2 run (2 steps, both passes)."""
        lines = []
        for g in (0, 1):
            for s in (1, 2):
                for r in range(cfg.world_size):
                    leader = r % cfg.procs_per_node == 0
                    rec = dict(rank=r, group_call=g, step=s, steps=2, seconds=0.1 * (r + 1),
                               tx=(1000 * (g + 1) + s) if leader else 0,
                               rx=(900 if leader else 0), leader=leader, loss=1.0)
                    lines.append("noise CLUSTER_STEP " + json.dumps(rec))
        for r in range(cfg.world_size):
            rec = dict(rank=r, netns_inode=100 + node_of[r], paddle_local_size="2",
                       plan_node=r // 2, plan_gpus_per_node=2,
                       max_abs_diff={"0": 1e-7, "1": 2e-7})
            lines.append("CLUSTER_RANK " + json.dumps(rec))
        return lines

    def test_progress_and_rank_checks(self) -> None:
        cfg = cluster.ClusterConfig(nodes=2, procs_per_node=2, ep=2, moe_sharding=2, steps=2)
        result = cluster.ClusterResult(cfg)
        emitted: list[str] = []
        progress = crun._Progress(cfg, result, emitted.append)
        for line in self._records(cfg, {0: 0, 1: 0, 2: 1, 3: 1}):
            progress.feed(line)
        progress.feed("a line without a record")
        self.assertEqual(len(emitted), 4)
        self.assertIn("option on  step 2/2", emitted[-1])
        self.assertEqual(result.steps[(1, 2)], {"seconds": 0.4, "tx": 2 * 2002, "rx": 1800,
                                                "loss": 1.0})
        per = result.per_pass()
        self.assertEqual(per[0]["inter_node_bytes_per_step"], 2 * 1002)  # step 1 left out
        self.assertEqual(per[1]["first_step_bytes"], 2 * 2001)
        crun._check_ranks(cfg, result, {100: 0, 101: 1})
        self.assertEqual(result.problems, [])
        self.assertEqual(result.node_of_rank, {0: 0, 1: 0, 2: 1, 3: 1})
        result.status = "PASS"
        result.prediction = {"off": {"inter_node_bytes": 2000.0, "dense_muon_bytes": 10.0},
                             "on": {"inter_node_bytes": 4000.0, "dense_muon_bytes": 5.0}}
        line = cluster.summary_line(result)
        self.assertTrue(line.startswith("PASS nodes=2 ranks=4 "), line)
        self.assertIn("off: inter_node_bytes/step=2004", line)
        self.assertIn("on_predicted=4000", line)
        table = "\n".join(cluster.comparison_lines(result))
        self.assertIn("1.002", table)  # 2004 / 2000
        self.assertRegex(table, r"dense saving off - on: measured +-2.00 kB  predicted 5 B")
        self.assertEqual(json.loads(json.dumps(result.to_json()))["measured"]["on"]["timed_steps"], 1)

    def test_rank_on_the_wrong_node_is_reported(self) -> None:
        cfg = cluster.ClusterConfig(nodes=2, procs_per_node=2, ep=2, moe_sharding=2, steps=2)
        result = cluster.ClusterResult(cfg)
        progress = crun._Progress(cfg, result, lambda _: None)
        for line in self._records(cfg, {0: 0, 1: 1, 2: 0, 3: 1}):
            progress.feed(line)
        del result.ranks[3]
        result.ranks[2]["netns_inode"] = 999
        result.ranks[0]["paddle_local_size"] = "1"
        result.ranks[0]["max_abs_diff"]["1"] = 0.5
        crun._check_ranks(cfg, result, {100: 0, 101: 1})
        text = "\n".join(result.problems)
        self.assertIn("ranks [3] reported no CLUSTER_RANK", text)
        self.assertIn("rank 1 runs on node 1 but the optimizer's plan says node 0", text)
        self.assertIn("rank 2 runs in no namespace", text)
        self.assertIn("rank 0: PADDLE_LOCAL_SIZE=1", text)
        self.assertIn("rank 0 group_call=1: max |param - reference| 5.000e-01", text)

    def test_unavailable_says_why_and_exits_2(self) -> None:
        import argparse

        parser = argparse.ArgumentParser()
        cluster.add_parser(parser.add_subparsers(dest="command"))
        args = parser.parse_args(["cluster", "--nodes", "2", "--procs-per-node", "2",
                                  "--ep", "2", "--moe-sharding", "2"])
        with mock.patch.object(crun, "probe_capability", return_value="needs root"), \
                mock.patch("builtins.print") as printed:
            self.assertEqual(cluster.main(args), cluster.EXIT_UNAVAILABLE)
        printed.assert_called_once_with("error: cluster unavailable: needs root", file=sys.stderr)
        bad = parser.parse_args(["cluster", "--nodes", "2", "--procs-per-node", "2",
                                 "--ep", "3", "--moe-sharding", "2"])
        with mock.patch("builtins.print"):
            self.assertEqual(cluster.main(bad), 2)

    def test_main_prints_comparison_json_and_summary(self) -> None:
        import argparse
        import contextlib
        import io

        parser = argparse.ArgumentParser()
        cluster.add_parser(parser.add_subparsers(dest="command"))
        args = parser.parse_args(["cluster", "--nodes", "2", "--procs-per-node", "2",
                                  "--ep", "2", "--moe-sharding", "2", "--steps", "2",
                                  "--json"])
        cfg = cluster.config_from_args(args)
        result = cluster.ClusterResult(cfg, status="PASS")
        result.steps = {(g, s): {"seconds": 0.5, "tx": 1000 * (2 - g), "rx": 0, "loss": 1.0}
                        for g in (0, 1) for s in (1, 2)}
        predicted = {t: {"inter_node_bytes": b, "dense_muon_bytes": b / 2}
                     for t, b in (("off", 2000.0), ("on", 1000.0))}
        out = io.StringIO()
        with mock.patch.object(cluster, "run_cluster", return_value=result), \
                contextlib.redirect_stdout(out):
            self.assertEqual(cluster.main(args, predict=lambda c: predicted), 0)
        text = out.getvalue()
        self.assertIn("dense saving off - on", text)
        self.assertIn('"status": "PASS"', text)
        self.assertTrue(text.rstrip().splitlines()[-1].startswith("PASS nodes=2 ranks=4"), text)
        result.status, result.problems = "FAIL", ["rank 3: boom"]
        with mock.patch.object(cluster, "run_cluster", return_value=result), \
                contextlib.redirect_stdout(io.StringIO()):
            self.assertEqual(cluster.main(args), 1)
        err = io.StringIO()
        with mock.patch.object(cluster, "run_cluster",
                               side_effect=cluster.ClusterInterrupted("interrupted by signal SIGINT")), \
                contextlib.redirect_stderr(err):
            self.assertEqual(cluster.main(args), 130)
        self.assertIn("namespaces, links and processes removed", err.getvalue())
        with mock.patch.object(cluster, "run_cluster", side_effect=cluster.ClusterInterrupted(
                "interrupted by signal SIGTERM", signal.SIGTERM)), \
                contextlib.redirect_stderr(io.StringIO()):
            self.assertEqual(cluster.main(args), 143, "128 + SIGTERM, as a shell reports")

    def test_a_bool_is_not_an_integer_flag(self) -> None:
        # True == 1 in Python; a config built by a script must not pass it as 1
        base = dict(nodes=2, procs_per_node=2, ep=2, moe_sharding=2, group_call="0")
        for name in ("nodes", "procs_per_node", "ep", "moe_sharding", "steps", "hidden",
                     "inner"):
            with self.subTest(field=name):
                cfg = cluster.ClusterConfig(**{**base, name: True})
                flag = "--" + name.replace("_", "-")
                with self.assertRaisesRegex(ValueError, f"^{flag} must be an integer, got True"):
                    cfg.validate_values()
        cluster.ClusterConfig(**base).validate_values()  # the same layout with ints passes

    def test_each_limit_is_the_largest_value_accepted(self) -> None:
        # the limits are inclusive: the limit passes, one above it is refused
        base = dict(nodes=2, procs_per_node=2, ep=2, moe_sharding=2, group_call="0")
        for name, limit, flag in (("steps", crun.MAX_STEPS, "--steps"),
                                  ("hidden", crun.MAX_DIM, "--hidden"),
                                  ("inner", crun.MAX_DIM, "--inner"),
                                  ("timeout_s", 86400.0, "--timeout"),
                                  ("link_mbit", 1e5, "--link-mbit")):
            with self.subTest(field=name):
                cluster.ClusterConfig(**{**base, name: limit}).validate_values()
                above = limit + 1 if isinstance(limit, int) else limit * 1.01
                with self.assertRaisesRegex(ValueError, f"^{flag} {above:g}: above the limit"):
                    cluster.ClusterConfig(**{**base, name: above}).validate_values()

    def test_not_root_is_a_reason(self) -> None:
        with mock.patch.object(os, "geteuid", return_value=1000):
            self.assertIn("root", netns.probe_capability())
        with mock.patch.object(os, "geteuid", return_value=0), \
                mock.patch.object(netns.shutil, "which", return_value=None):
            self.assertIn("iproute2", netns.probe_capability())

    def test_sweep_removes_only_runs_whose_process_is_gone(self) -> None:
        """A SIGKILLed run leaves its namespaces; the next run removes them, and
        never a live run's or a foreign namespace."""
        dead, alive = 0x3ffffe, os.getpid()
        present = [f"pmc-{dead:x}-br", f"pmc-{dead:x}-n0", f"pmc-{dead:x}p-n0",
                   f"pmc-{alive:x}-n0", "somebody-elses-ns"]
        with mock.patch.object(netns, "list_namespaces", return_value=present), \
                mock.patch.object(netns, "_pid_alive", side_effect=lambda p: p == alive), \
                mock.patch.object(netns, "remove_namespaces") as remove:
            swept = netns.sweep_stale()
        self.assertEqual(swept, present[:3])
        remove.assert_called_once_with(present[:3], grace_s=1.0)

    def _fake_ip(self, namespaces=(), pids=None, fail=None):
        """A stand-in for ``_run``: records argv, answers 'ip netns list/pids'."""
        calls: list[list[str]] = []
        pids = dict(pids or {})

        def run(argv, check=True):
            calls.append(list(argv))
            out, code = "", 0
            if argv[:3] == ["ip", "netns", "list"]:
                out = "".join(f"{ns} (id: {i})\n" for i, ns in enumerate(namespaces))
            elif argv[:3] == ["ip", "netns", "pids"]:
                out = "\n".join(str(p) for p in pids.pop(argv[3], []))
            elif argv[:2] == ["ip", "-j"]:
                out = json.dumps([{"stats64": {"tx": {"bytes": 7}, "rx": {"bytes": 9}}}])
            if fail and fail in " ".join(argv):
                code = 1
                if check:
                    raise RuntimeError(f"'{' '.join(argv)}' failed: denied")
            return subprocess.CompletedProcess(argv, code, out, "denied" if code else "")

        return calls, run

    def test_network_commands_and_teardown(self) -> None:
        names = netns.ClusterNames("ab", 2)
        calls, run = self._fake_ip(namespaces=names.namespaces(), pids={"pmc-ab-n1": [4242]})
        net = netns.NetnsCluster(names, 50)
        with mock.patch.object(netns, "_run", run), \
                mock.patch.object(netns.os, "kill") as kill:
            net.up()
            self.assertEqual(net.link_bytes(1), (7, 9))
            net.down()
        text = [" ".join(c) for c in calls]
        for ns in names.namespaces():
            self.assertIn(f"ip netns add {ns}", text)
            self.assertIn(f"ip netns del {ns}", text)
        self.assertIn("ip -n pmc-ab-n1 addr add 198.18.0.11/24 dev pmcabn1", text)
        tbf = [t for t in text if " tbf " in t]
        self.assertEqual(len(tbf), 4, "both ends of both node links are rate limited")
        self.assertTrue(all("rate 50mbit" in t for t in tbf), tbf)
        kill.assert_any_call(4242, signal.SIGTERM)
        self.assertEqual(net.created, [])

    def test_capability_probe_reports_each_missing_piece(self) -> None:
        with mock.patch.object(os, "geteuid", return_value=0), \
                mock.patch.object(netns.shutil, "which", return_value="/sbin/ip"):
            for fail, reason in (("netns add", "cannot create a network namespace"),
                                 ("tbf", "veth / tbf unavailable"),
                                 ("cat", "cannot show the namespace's sysfs"),
                                 (None, None)):
                calls, run = self._fake_ip(fail=fail)
                with mock.patch.object(netns, "_run", run):
                    got = netns.probe_capability()
                if reason is None:
                    self.assertIsNone(got)
                else:
                    self.assertIn(reason, got)
                if fail != "netns add":
                    self.assertEqual(calls[-1][:3], ["ip", "netns", "del"], "probe cleans up")

    def test_pid_alive(self) -> None:
        self.assertTrue(netns._pid_alive(os.getpid()))
        with mock.patch.object(netns.os, "kill", side_effect=ProcessLookupError):
            self.assertFalse(netns._pid_alive(1))
        with mock.patch.object(netns.os, "kill", side_effect=PermissionError):
            self.assertTrue(netns._pid_alive(1))

    def test_log_follower_reads_complete_lines_once(self) -> None:
        import tempfile

        with tempfile.TemporaryDirectory() as root:
            os.makedirs(os.path.join(root, "node0"))
            path = os.path.join(root, "node0", "workerlog.0")
            with open(path, "w") as f:
                f.write("one\ntw")
            follow = crun._LogFollower(root)
            self.assertEqual(list(follow.new_lines()), ["one"])
            with open(path, "a") as f:
                f.write("o\n")
            self.assertEqual(list(follow.new_lines()), ["two"])
            self.assertEqual(list(follow.new_lines()), [])


if __name__ == "__main__":
    unittest.main()
