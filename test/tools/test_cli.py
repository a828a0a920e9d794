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
"""``paddle-muon-ext`` behaves like a command-line tool.

Run as a user would, in a fresh process: help anywhere (no checkout, no
Paddle), one ``error:`` line for a missing Paddle or matplotlib, ``--json``
that parses, stdout that cannot be written, ``plan --no-group-call`` on any
layout, and a plan picture that explains itself.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from contextlib import redirect_stderr, redirect_stdout
from unittest import mock

from tool_loader import REPO_ROOT

from paddle_muon_ext import cli
from paddle_muon_ext.tools import cluster, cluster_run, guard

PACKAGE = os.path.join(REPO_ROOT, "python")
LAYOUT = ["--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "2", "--model", "tiny"]
# Starts the console script with some modules made unimportable (as when
# they are not installed): ``python -c BOOT "paddle,matplotlib" ARGS...``.
BOOT = ("import sys\n"
        "for name in sys.argv[1].split(','):\n"
        "    if name:\n"
        "        sys.modules[name] = None\n"
        "from paddle_muon_ext.cli import main\n"
        "sys.exit(main(sys.argv[2:]))\n")


def console(*argv: str, blocked: str = "", path: str = PACKAGE, stdout=subprocess.PIPE,
            cwd: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PADDLE_LOCAL_SIZE"}
    env["PYTHONPATH"] = path
    return subprocess.run([sys.executable, "-c", BOOT, blocked, *argv], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=300, env=env, cwd=cwd)


def error_lines(stderr: str) -> list:
    return [ln for ln in stderr.splitlines() if ln.startswith("error:")]


class TestHelpAnywhere(unittest.TestCase):
    def test_top_level_help_lists_every_command_once(self) -> None:
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            self.assertEqual(cli.main(["--help"]), 0)
        lines = out.getvalue().splitlines()
        for name in ("plan", "verify", "cluster", "hangs", "demo"):
            rows = [ln for ln in lines if ln.split()[:1] == [name]]
            self.assertEqual(len(rows), 1, f"{name} must have one line in --help:\n{out.getvalue()}")
            self.assertGreater(len(rows[0].split()), 3, f"{name} has no description")
        with redirect_stdout(io.StringIO()), redirect_stderr(err):
            self.assertEqual(cli.main([]), 2, "no command is a usage error")
        self.assertIn("commands:", err.getvalue())
        err = io.StringIO()
        with redirect_stderr(err):
            self.assertEqual(cli.main(["plam"]), 2)
        self.assertEqual(error_lines(err.getvalue()), [
            "error: unknown command 'plam'; use one of plan, verify, cluster, hangs, demo "
            "(paddle-muon-ext --help)"])
        out = io.StringIO()
        with redirect_stdout(out):
            self.assertEqual(cli.main(["--version"]), 0)
        self.assertTrue(out.getvalue().startswith("paddle-muon-ext "), out.getvalue())

    def test_every_subcommand_help_without_checkout_or_paddle(self) -> None:
        # The package alone, outside the checkout (as a wheel installs it),
        # with Paddle not importable.
        site = tempfile.mkdtemp(prefix="muon_cli_site_")
        self.addCleanup(shutil.rmtree, site, True)
        shutil.copytree(os.path.join(PACKAGE, "paddle_muon_ext"),
                        os.path.join(site, "paddle_muon_ext"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        for command in ("plan", "verify", "cluster", "hangs", "demo"):
            with self.subTest(command=command):
                proc = console(command, "--help", blocked="paddle", path=site, cwd=site)
                self.assertEqual(proc.returncode, 0, f"{command} --help: {proc.stderr}")
                self.assertIn("usage:", proc.stdout, command)
                self.assertNotIn("Traceback", proc.stderr, command)
        proc = console("verify", "--ep", "2", path=site, cwd=site)
        self.assertEqual(proc.returncode, 2)
        self.assertIn("needs a source checkout", proc.stderr)


    def test_every_help_names_the_tool_as_typed(self) -> None:
        # the usage line repeats what the user typed: the console script and
        # its subcommand, or the checkout script's file name (demo said "usage: demo")
        for command in ("plan", "verify", "cluster", "hangs", "demo"):
            with self.subTest(typed=f"paddle-muon-ext {command}"):
                proc = console(command, "--help")
                self.assertEqual(proc.returncode, 0, proc.stderr)
                self.assertTrue(proc.stdout.startswith(f"usage: paddle-muon-ext {command} "),
                                proc.stdout[:200])
        env = dict(os.environ, PYTHONPATH=PACKAGE)
        scripts = [(["tools/muon_comm.py", c], f"muon_comm.py {c}")
                   for c in ("plan", "verify", "cluster", "hangs")]
        scripts.append((["tools/demo.py"], "demo.py"))
        for argv, typed in scripts:
            with self.subTest(typed=typed):
                proc = subprocess.run([sys.executable, *argv, "--help"], cwd=REPO_ROOT, env=env,
                                      capture_output=True, text=True, timeout=300)
                self.assertEqual(proc.returncode, 0, proc.stderr)
                self.assertTrue(proc.stdout.startswith(f"usage: {typed} "), proc.stdout[:200])
        # a usage error names the tool the same way
        proc = console("demo", "--bogus")
        self.assertEqual(proc.returncode, 2)
        self.assertIn("paddle-muon-ext demo: unrecognized arguments: --bogus",
                      error_lines(proc.stderr)[0])


class TestMissingPackages(unittest.TestCase):
    def test_missing_paddle_is_one_line_naming_the_extra(self) -> None:
        # verify trains with Paddle (plan does not import it: test_plan_without_paddle)
        proc = console("verify", "--ep", "4", "--moe-sharding", "2", "--gpus-per-node", "2",
                       blocked="paddle")
        self.assertEqual(proc.returncode, 2, proc.stderr)
        self.assertEqual(proc.stdout, "")
        self.assertNotIn("Traceback", proc.stderr)
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        self.assertEqual(len(lines), 1, proc.stderr)
        self.assertTrue(lines[0].startswith("error: PaddlePaddle is not installed"), lines)
        self.assertIn('pip install ".[cpu]"', lines[0])

    def test_png_without_matplotlib_is_refused_before_any_work(self) -> None:
        d = tempfile.mkdtemp(prefix="muon_cli_png_")
        self.addCleanup(shutil.rmtree, d, True)
        proc = console("plan", *LAYOUT, "--png", os.path.join(d, "p.png"), blocked="matplotlib")
        self.assertEqual(proc.returncode, 2, proc.stderr)
        self.assertEqual(proc.stdout, "", "no table: the refusal comes before the work")
        self.assertEqual(len(error_lines(proc.stderr)), 1, proc.stderr)
        self.assertIn('pip install ".[plot]"', proc.stderr)
        self.assertEqual(os.listdir(d), [], "nothing written")

    def test_setup_declares_the_plot_extra(self) -> None:
        with open(os.path.join(REPO_ROOT, "setup.py")) as f:
            text = f.read()
        self.assertRegex(text, r'"plot":\s*\["matplotlib"\]')


class TestJsonIsPure(unittest.TestCase):
    def test_plan_json_parses_from_a_fresh_process(self) -> None:
        for argv in (["plan", *LAYOUT, "--json"],
                     ["plan", *LAYOUT, "--no-group-call", "--json"]):
            with self.subTest(argv=argv):
                proc = console(*argv)
                self.assertEqual(proc.returncode, 0, proc.stderr)
                res = json.loads(proc.stdout)
                self.assertEqual(res["world_size"], 8)

    def test_verify_json_is_the_only_stdout(self) -> None:
        proc = console("verify", "--ep", "2", "--moe-sharding", "2", "--gpus-per-node", "2",
                       "--steps", "1", "--json")
        self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
        summary = json.loads(proc.stdout)
        self.assertEqual(summary["status"], "PASS")
        self.assertIn("[verify] schedule", proc.stderr, "progress goes to stderr")
        self.assertIn("PASS ranks=4", proc.stderr, "the verdict line goes to stderr")

    def test_demo_json_through_the_console_script(self) -> None:
        def fake_demo(path, run_name):
            demo = {"__name__": "demo", "__file__": path}
            with open(path) as f:
                exec(compile(f.read(), path, "exec"), demo)  # noqa: S102 - the checkout's script
            logs = {r: "MUON_OK rank=0 steps=1 values=10\n" for r in range(demo["NPROC"])}
            launched = mock.MagicMock(ok=True, worker_logs=logs, wall_s=1.0,
                                      workers_printing=lambda m: sorted(logs))
            demo["run_paddle_launch"] = lambda *a, **k: launched
            demo["follow"] = lambda *a, **k: None
            raise SystemExit(demo["main"](sys.argv[1:]))

        out, err = io.StringIO(), io.StringIO()
        with mock.patch.object(cli.runpy, "run_path", fake_demo), \
                redirect_stdout(out), redirect_stderr(err):
            self.assertEqual(cli.main(["demo", "--steps", "1", "--json"]), 0, err.getvalue())
        self.assertEqual(json.loads(out.getvalue())["status"], "PASS")
        self.assertIn("VERDICT: PASS", err.getvalue())

    def test_cluster_json_when_unavailable_or_refused(self) -> None:
        argv = ["cluster", "--nodes", "2", "--procs-per-node", "2", "--ep", "2",
                "--moe-sharding", "2", "--json"]
        out, err = io.StringIO(), io.StringIO()
        with mock.patch.object(cluster_run, "probe_capability", return_value="needs root"), \
                redirect_stdout(out), redirect_stderr(err):
            self.assertEqual(cli.main(argv), cluster.EXIT_UNAVAILABLE)
        self.assertEqual(json.loads(out.getvalue())["status"], "UNAVAILABLE")
        self.assertEqual(error_lines(err.getvalue()), ["error: cluster unavailable: needs root"])

    def test_cluster_json_of_a_run_is_the_only_stdout(self) -> None:
        argv = ["cluster", "--nodes", "2", "--procs-per-node", "2", "--ep", "2",
                "--moe-sharding", "2", "--steps", "2", "--json"]

        def fake_run(cfg, keep_logs=False):
            print("[cluster] progress line")
            result = cluster.ClusterResult(cfg, status="PASS")
            result.steps = {(g, s): {"seconds": 0.5, "tx": 100, "rx": 0, "loss": 1.0}
                            for g in (0, 1) for s in (1, 2)}
            return result

        out, err = io.StringIO(), io.StringIO()
        with mock.patch.object(cluster, "run_cluster", fake_run), \
                redirect_stdout(out), redirect_stderr(err):
            self.assertEqual(cli.main(argv), 0)
        res = json.loads(out.getvalue())
        self.assertEqual((res["status"], res["prediction"]["on"]["inter_node_bytes"] > 0),
                         ("PASS", True))
        self.assertIn("[cluster] progress line", err.getvalue())
        self.assertTrue(err.getvalue().rstrip().endswith(
            "on_predicted=" + str(round(res["prediction"]["on"]["inter_node_bytes"]))),
            err.getvalue()[-300:])


class TestClusterLayouts(unittest.TestCase):
    def _args(self, *extra: str):
        parser = guard.ArgumentParser(prog="t")
        cluster.add_parser(parser.add_subparsers(dest="command"))
        return parser.parse_args(["cluster", "--ep", "2", "--moe-sharding", "2", *extra])

    def test_a_layout_the_option_cannot_run_trains_the_flat_pass(self) -> None:
        from paddle_muon_ext.tools.plan import predict_cluster

        for nodes, procs in (("4", "1"), ("1", "4")):
            err = io.StringIO()
            with redirect_stderr(err):
                cfg = cluster.config_from_args(self._args("--nodes", nodes,
                                                          "--procs-per-node", procs))
            self.assertEqual((cfg.group_call, cfg.passes()), ("0", [0]))
            self.assertIn("training the flat path alone (--group-call 0)", err.getvalue())
            pred = predict_cluster(cfg)
            self.assertEqual(set(pred), {"off"}, "no prediction for a pass that does not run")
            if nodes == "1":
                self.assertEqual(pred["off"]["inter_node_bytes"], 0, "one node: nothing crosses")
            else:
                self.assertGreater(pred["off"]["inter_node_bytes"], 0)
            with self.assertRaisesRegex(ValueError, "pass --group-call 0"):
                cluster.config_from_args(self._args("--nodes", nodes, "--procs-per-node", procs,
                                                    "--group-call", "both"))
        cfg = cluster.config_from_args(self._args("--nodes", "2", "--procs-per-node", "2"))
        self.assertEqual(cfg.group_call, "both")
        self.assertEqual(set(predict_cluster(cfg)), {"off", "on"})

    def test_the_plan_comparison_follows_a_passed_run_only(self) -> None:
        """A failed run prints no prediction and no measured-vs-predicted table."""
        args = self._args("--nodes", "2", "--procs-per-node", "2")
        for status, code, compared in (("PASS", 0, True), ("FAIL", 1, False)):
            result = cluster.ClusterResult(cluster.config_from_args(args), status=status)
            result.steps = {(g, 1): {"seconds": 0.5, "tx": 100, "rx": 0, "loss": 1.0}
                            for g in (0, 1)}
            from paddle_muon_ext.tools.plan import predict_cluster

            predict = mock.Mock(wraps=predict_cluster)
            out, err = io.StringIO(), io.StringIO()
            with mock.patch.object(cluster, "run_cluster", return_value=result), \
                    redirect_stdout(out), redirect_stderr(err):
                self.assertEqual(cluster.main(args, predict=predict), code)
            with self.subTest(status=status):
                self.assertEqual(predict.called, compared)
                self.assertEqual("measured inter-node bytes/step" in out.getvalue(), compared,
                                 out.getvalue())
                self.assertTrue(out.getvalue().rstrip().splitlines()[-1].startswith(status))

    def test_prediction_failure_does_not_fail_a_passed_run(self) -> None:
        args = self._args("--nodes", "2", "--procs-per-node", "2")
        result = cluster.ClusterResult(cluster.config_from_args(args), status="PASS")

        def no_prediction(cfg):
            raise ValueError("no model")

        out, err = io.StringIO(), io.StringIO()
        with mock.patch.object(cluster, "run_cluster", return_value=result), \
                redirect_stdout(out), redirect_stderr(err):
            self.assertEqual(cluster.main(args, predict=no_prediction), 0)
        self.assertIn("note: no plan-tool prediction for this layout (no model)", err.getvalue())
        self.assertTrue(out.getvalue().rstrip().splitlines()[-1].startswith("PASS"))


class TestStdoutThatCannotBeWritten(unittest.TestCase):
    def test_full_device_is_one_error_line(self) -> None:
        for argv in (["plan", *LAYOUT], ["plan", *LAYOUT, "--json"], ["--help"],
                     ["plan", "--help"], ["hangs", "--help"]):
            with self.subTest(argv=argv), open("/dev/full", "w") as full:
                proc = console(*argv, stdout=full)
                self.assertEqual(proc.returncode, 2, proc.stderr)
                self.assertNotIn("Traceback", proc.stderr)
                self.assertNotIn("Exception ignored", proc.stderr)
                self.assertEqual(error_lines(proc.stderr), [
                    "error: cannot write to stdout (No space left on device); write to a "
                    "file or a device with space"])

    def test_closed_stdout_and_broken_pipe_raise_nothing(self) -> None:
        env = {**os.environ, "PYTHONPATH": PACKAGE}
        closed = subprocess.run(
            [sys.executable, "-c", BOOT, "", "plan", *LAYOUT, "--json"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300,
            env=env, preexec_fn=lambda: os.close(1))
        self.assertNotIn("Traceback", closed.stderr)
        self.assertEqual(closed.returncode, 0, closed.stderr)
        reader = subprocess.Popen([sys.executable, "-c", BOOT, "", "plan", *LAYOUT],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        reader.stdout.close()  # the reader leaves at once, like `| head -0`
        err = reader.stderr.read().decode()
        reader.stderr.close()
        self.assertEqual(reader.wait(timeout=300), guard.EXIT_BROKEN_PIPE, err)
        self.assertNotIn("Traceback", err)
        self.assertNotIn("Exception ignored", err)

    def test_unexpected_exception_is_one_line(self) -> None:
        def boom() -> int:
            raise KeyError("x")

        err = io.StringIO()
        with redirect_stderr(err):
            self.assertEqual(guard.guarded(boom), 2)
        lines = err.getvalue().splitlines()
        self.assertEqual(len(lines), 1, lines)
        self.assertTrue(lines[0].startswith("error: unexpected KeyError: 'x'; this is a bug"))
        for exc, text in ((RecursionError(), "nested too deeply"),
                          (MemoryError(), "out of memory"),
                          (KeyboardInterrupt(), "interrupted")):
            err = io.StringIO()

            def raise_it(exc=exc) -> int:
                raise exc

            with redirect_stderr(err):
                code = guard.guarded(raise_it)
            self.assertEqual(code, 130 if isinstance(exc, KeyboardInterrupt) else 2)
            self.assertIn(text, err.getvalue())
        err = io.StringIO()
        with redirect_stderr(err), mock.patch.dict(os.environ, {guard.TRACEBACK_ENV: "1"}):
            guard.guarded(boom)
        self.assertIn("Traceback", err.getvalue(), "the opt-in traceback for a bug report")
        with redirect_stderr(io.StringIO()):
            self.assertEqual(guard.guarded(lambda: "failed"), 1, "sys.exit('text') is 1")


class _Full:
    """A stdout whose writes (or flushes) fail with ``errno``."""

    def __init__(self, errno_: int, on: str = "write") -> None:
        self.errno, self.on = errno_, on

    def write(self, text: str) -> int:
        if self.on == "write":
            raise OSError(self.errno, os.strerror(self.errno))
        return len(text)

    def flush(self) -> None:
        if self.on == "flush":
            raise OSError(self.errno, os.strerror(self.errno))


class TestGuardInProcess(unittest.TestCase):
    def _guarded(self, stdout, call, json_mode: bool = False):
        err = io.StringIO()
        with mock.patch("sys.stdout", stdout), redirect_stderr(err):
            code = guard.guarded(call, json_mode=json_mode)
        return code, err.getvalue()

    def test_stdout_errors(self) -> None:
        import errno

        def talk() -> int:
            print("table")
            return 0

        for on in ("write", "flush"):
            code, err = self._guarded(_Full(errno.ENOSPC, on), talk)
            self.assertEqual(code, 2, on)
            self.assertEqual(err, "error: cannot write to stdout (No space left on device); "
                             "write to a file or a device with space\n")
        code, err = self._guarded(_Full(errno.EPIPE), talk)
        self.assertEqual((code, err), (guard.EXIT_BROKEN_PIPE, ""), "a reader that left is quiet")
        code, err = self._guarded(_Full(errno.ENOSPC),
                                  lambda: guard.emit_result("{}") or 0, json_mode=True)
        self.assertEqual(code, 2)
        self.assertIn("cannot write to stdout", err)

    def test_broken_pipe_on_a_real_descriptor_is_silenced(self) -> None:
        read_fd, write_fd = os.pipe()
        os.close(read_fd)
        stream = os.fdopen(write_fd, "w")
        self.addCleanup(stream.close)
        code, err = self._guarded(stream, lambda: print("x" * 100000) or 0)
        self.assertEqual((code, err), (guard.EXIT_BROKEN_PIPE, ""))
        stream.write("late")
        stream.flush()  # the fd now points at /dev/null: the exit-time flush cannot fail

    def test_closed_stdout_and_missing_packages(self) -> None:
        code, err = self._guarded(None, lambda: guard.emit_result("{}") or print("x") or 0,
                                  json_mode=True)
        self.assertEqual((code, err), (0, "x\n"), "print goes to stderr with --json")
        for name, fix in (("paddle", 'pip install ".[cpu]"'), ("matplotlib", 'pip install ".[plot]"')):
            def missing(name=name) -> int:
                raise ModuleNotFoundError(f"No module named {name!r}", name=f"{name}.sub")

            code, err = self._guarded(io.StringIO(), missing)
            self.assertEqual(code, 2)
            self.assertEqual(len(err.splitlines()), 1, err)
            self.assertIn(fix, err)
        self.assertIsNone(guard.missing_package(ImportError("other", name="numpy")))
        self.assertIsNone(guard.missing_package(ValueError("paddle")))

    def test_package_imports_without_paddle(self) -> None:
        import paddle_muon_ext

        with mock.patch("importlib.util.find_spec", side_effect=ValueError("blocked")):
            self.assertTrue(paddle_muon_ext._paddle_missing())
        with mock.patch.object(paddle_muon_ext, "_paddle_missing", return_value=True), \
                self.assertRaisesRegex(ImportError, "needs PaddlePaddle 3.3.x") as caught:
            paddle_muon_ext.__getattr__("Muon")
        self.assertEqual(caught.exception.name, "paddle", "the guard names the install line")


class TestPlanAnyLayout(unittest.TestCase):
    def _plan(self, *argv: str) -> dict:
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            code = cli.main(["plan", *argv, "--json"])
        self.assertEqual(code, 0, err.getvalue())
        return json.loads(out.getvalue())

    def test_flat_path_of_single_node_and_one_card_layouts(self) -> None:
        base = ["--ep", "4", "--moe-sharding", "2", "--model", "tiny"]
        spread = self._plan(*base, "--gpus-per-node", "2")  # 4 nodes: both paths
        one_node = self._plan(*base, "--gpus-per-node", "8", "--no-group-call")
        one_card = self._plan(*base, "--gpus-per-node", "1", "--no-group-call")
        for res, nodes in ((one_node, 1), (one_card, 8)):
            self.assertEqual(res["num_nodes"], nodes)
            self.assertIsNone(res["hierarchical"])
            self.assertFalse(res["config"]["group_call"])
            # The flat path ignores the node layout: same collectives, same bytes.
            for key in ("collectives_per_step", "collectives_total"):
                self.assertEqual(res["flat"][key], spread["flat"][key], (nodes, key))
        total = spread["flat"]["inter_node_bytes_all"] + spread["flat"]["intra_node_bytes_all"]
        self.assertGreater(total, 0)
        # One node: no byte leaves it. One card per node: every byte does.
        self.assertEqual(one_node["flat"]["inter_node_bytes_all"], 0)
        self.assertEqual(one_node["flat"]["intra_node_bytes_all"], total)
        self.assertEqual(one_card["flat"]["intra_node_bytes_all"], 0)
        self.assertEqual(one_card["flat"]["inter_node_bytes_all"], total)

    def test_flat_path_of_stages_sharing_a_node(self) -> None:
        # pp=2 on one node of 4 cards: both stages' sharding groups on node 0.
        base = ["--ep", "2", "--moe-sharding", "1", "--pp", "2", "--model", "tiny",
                "--no-group-call"]
        one_node = self._plan(*base, "--gpus-per-node", "4")
        one_card = self._plan(*base, "--gpus-per-node", "1")
        self.assertEqual(one_node["flat"]["collectives_per_step"],
                         one_card["flat"]["collectives_per_step"])
        self.assertGreater(one_node["flat"]["collectives_total"], 0)
        self.assertEqual(one_node["flat"]["inter_node_bytes_all"], 0)
        self.assertEqual(one_card["flat"]["intra_node_bytes_all"], 0)
        self.assertEqual(one_node["flat"]["intra_node_bytes_all"],
                         one_card["flat"]["inter_node_bytes_all"])

    def test_table_of_the_flat_path_and_the_refusal_names_the_flag(self) -> None:
        out = io.StringIO()
        with redirect_stdout(out):
            self.assertEqual(cli.main(["plan", "--ep", "4", "--moe-sharding", "2",
                                       "--gpus-per-node", "1", "--model", "tiny",
                                       "--no-group-call"]), 0)
        text = out.getvalue()
        self.assertIn("flat path only (--no-group-call", text)
        self.assertNotIn("hierarchical", text.split("flat path only")[1].split("\n", 1)[1])
        self.assertIn("partition rule upstream_greedy", text)
        err = io.StringIO()
        with redirect_stderr(err):
            self.assertEqual(cli.main(["plan", "--ep", "4", "--moe-sharding", "2",
                                       "--gpus-per-node", "8", "--model", "tiny"]), 2)
        self.assertIn("plan --no-group-call shows the flat path", err.getvalue())


class TestPlanPicture(unittest.TestCase):
    def setUp(self) -> None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:  # pragma: no cover - the [test] extra installs it
            self.skipTest("matplotlib not installed")
        from paddle_muon_ext.tools.args import MuonCommConfig
        from paddle_muon_ext.tools.plan import compute_plan

        self.res = compute_plan(MuonCommConfig(ep=8, moe_sharding=2, pp=2, gpus_per_node=4,
                                               order=("pipe", "moe_sharding", "expert"),
                                               model="tiny"))

    def _figure(self, res):
        import matplotlib.pyplot as plt

        from paddle_muon_ext.tools.report import plan_figure

        fig = plan_figure(res)
        self.addCleanup(plt.close, fig)
        return fig

    @staticmethod
    def _panels(fig):
        """The axes that hold a nodes x cards picture (not the colour bar)."""
        return [ax for ax in fig.axes if ax.images]

    @staticmethod
    def _png_size(data: bytes):
        # IHDR: width and height, big-endian, right after the 8-byte signature + chunk head
        return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")

    def test_legend_shared_scale_outlines_and_rail_bytes(self) -> None:
        from matplotlib.patches import Rectangle

        fig = self._figure(self.res)
        flat_ax, hier_ax = self._panels(fig)
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        self.assertTrue(any("D<n> dense / E<n> expert" in t for t in legend), legend)
        self.assertTrue(any("pipeline stage" in t for t in legend), legend)
        self.assertTrue(any("same-card group" in t for t in legend), legend)
        owned = (self.res["owned_by_colour"]["hierarchical"]["dense_param_bytes"]
                 + self.res["owned_by_colour"]["flat"]["dense_param_bytes"])
        scale = 2**10 if max(owned) < 2**20 else 2**20
        for ax in (flat_ax, hier_ax):  # one scale over both paths, so colours compare
            low, high = ax.images[0].get_clim()
            self.assertAlmostEqual(low, min(owned) / scale, places=9)
            self.assertAlmostEqual(high, max(owned) / scale, places=9)
        for ax in (flat_ax, hier_ax):
            outlines = [p for p in ax.patches if isinstance(p, Rectangle) and not p.get_fill()]
            self.assertEqual(len(outlines), 2, "one outline per pipeline stage")
            for p in outlines:  # inside the axes, so the frame does not hide it
                self.assertGreater(p.get_x(), -0.5)
                self.assertGreaterEqual(p.get_linewidth(), 2)
        for ax, path in ((flat_ax, "flat"), (hier_ax, "hierarchical")):
            ticks = [t.get_text() for t in ax.get_xticklabels()]
            rails = self.res[path]["rail_bytes"]
            self.assertEqual(ticks, [f"card {c}\n{rails[c] / 1024:.2f} KiB" for c in range(4)],
                             f"rail bytes under each card ({path})")
        cells = [t.get_text() for t in hier_ax.texts if t.get_text().startswith("r")]
        detail = self.res["owned_by_colour"]["hierarchical"]
        self.assertIn(f"r5\nD{detail['dense'][5]} E{detail['moe'][5]}", cells)

    def test_interleaved_stages_get_one_outline_per_run_of_nodes(self) -> None:
        from matplotlib.patches import Rectangle

        from paddle_muon_ext.tools.args import MuonCommConfig
        from paddle_muon_ext.tools.plan import compute_plan

        # order moe_sharding,pipe,expert with ep=gpn=4: stage 0 on nodes 0,1,4,5
        res = compute_plan(MuonCommConfig(ep=4, moe_sharding=2, pp=2, gpus_per_node=4,
                                          order=("moe_sharding", "pipe", "expert"),
                                          model="tiny"))
        stage0 = res["_plan"].nodes_of_stage(0)
        ax = self._panels(self._figure(res))[0]
        spans = sorted((round(p.get_y() + 0.46), round(p.get_height() + 0.08))
                       for p in ax.patches if isinstance(p, Rectangle) and not p.get_fill())
        covered = [n for first, count in spans for n in range(first, first + count)]
        self.assertEqual(sorted(covered), list(range(res["num_nodes"])),
                         "every node outlined once")
        for first, count in spans:  # no outline covers a node of another stage
            nodes = set(range(first, first + count))
            self.assertTrue(nodes <= set(stage0) or not nodes & set(stage0), (spans, stage0))

    def test_two_panels_titled_with_step_time_and_ratio_to_default(self) -> None:
        from paddle_muon_ext.tools import recommend
        from paddle_muon_ext.tools.cost_model import AlphaBeta
        from paddle_muon_ext.tools.report import _fmt_time, render_png

        recommend.annotate(self.res, AlphaBeta())
        t0 = self.res["vs_default"]["default"]["estimated_time_s"]
        panels = self._panels(self._figure(self.res))
        self.assertEqual(len(panels), 2)
        for ax, path, on in zip(panels, ("flat", "hierarchical"), ("off", "on")):
            t = self.res[path]["estimated_time_s"]
            title = ax.get_title()
            self.assertIn(f"{path} path (comm_group_call_opt {on})", title)
            self.assertIn(f"est. step comm {_fmt_time(t)} = {t / t0:.3f}x default", title)
        # the hierarchical path is faster here, so its panel shows a ratio below 1
        self.assertLess(self.res["hierarchical"]["estimated_time_s"], t0)
        one = self._figure(self.res)
        self.assertEqual([ax.get_lines() != [] for ax in self._panels(one)], [False, True],
                         "same-card lines only on the hierarchical panel")
        from paddle_muon_ext.tools.args import MuonCommConfig
        from paddle_muon_ext.tools.plan import compute_plan

        flat = compute_plan(MuonCommConfig(ep=8, moe_sharding=2, pp=2, gpus_per_node=4,
                                           order=("pipe", "moe_sharding", "expert"),
                                           model="tiny"), group_call=False)
        (w2, h2), (w1, h1) = self._png_size(render_png(self.res)), self._png_size(
            render_png(flat))
        self.assertEqual(h2, h1)
        self.assertGreater(w2 / w1, 1.6, "two panels: about twice as wide as one")
        self.assertLess(w2 / w1, 2.2)

    def test_recommend_draws_the_pick_beside_the_default(self) -> None:
        from paddle_muon_ext.tools import recommend
        from paddle_muon_ext.tools.args import MuonCommConfig
        from paddle_muon_ext.tools.cost_model import AlphaBeta
        from paddle_muon_ext.tools.plan import compute_plan

        cfg = MuonCommConfig(ep=4, moe_sharding=2, pp=1, gpus_per_node=2)  # ernie-moe-small
        res = compute_plan(cfg)
        est = recommend.annotate(res, AlphaBeta())
        best = recommend.recommend(res, est)["best"]["config"]
        self.assertNotEqual(best, recommend.DEFAULT_CONFIG, "the pick must differ to show it")
        default_ax, pick_ax = self._panels(self._figure(recommend.figure_input(res, est)))
        self.assertTrue(default_ax.get_title().startswith(
            "default: comm_group_call_opt off, upstream_greedy owners, 256 MB buffers\n"))
        on = "on" if best["comm_group_call_opt"] else "off"
        self.assertTrue(pick_ax.get_title().startswith(
            f"recommended: comm_group_call_opt {on}, {best['muon_partition_strategy']} owners, "
            f"{best['comm_buffer_size_MB']:g} MB buffers\n"), pick_ax.get_title())
        # each panel's owners are those of a plan run with that panel's options
        for ax, config in ((default_ax, recommend.DEFAULT_CONFIG), (pick_ax, best)):
            alone = compute_plan(cfg, buffer_size_MB=config["comm_buffer_size_MB"],
                                 partition_strategy=config["muon_partition_strategy"],
                                 group_call=config["comm_group_call_opt"])
            path = "hierarchical" if config["comm_group_call_opt"] else "flat"
            detail = alone["owned_by_colour"][path]
            cells = sorted(t.get_text() for t in ax.texts if t.get_text().startswith("r"))
            self.assertEqual(cells, sorted(f"r{r}\nD{detail['dense'][r]} E{detail['moe'][r]}"
                                           for r in range(8)))
            self.assertEqual(ax.get_lines() != [], config["comm_group_call_opt"],
                             "same-card lines where the option is on")

    def test_label_colour_follows_the_cell_luminance(self) -> None:
        from paddle_muon_ext.tools.report import label_colour, luminance

        self.assertAlmostEqual(luminance((1.0, 1.0, 1.0, 1.0)), 1.0, places=9)
        self.assertAlmostEqual(luminance((0.0, 0.0, 0.0)), 0.0, places=9)
        dark, light = (0.03, 0.19, 0.42), (0.97, 0.98, 1.0)  # ends of the Blues map
        self.assertEqual(label_colour(luminance(dark)), "white")
        self.assertEqual(label_colour(luminance(light)), "black")
        self.assertEqual(label_colour(luminance((1.0, 1.0, 0.0))), "black", "yellow is light")
        # in the picture: the darkest cell's label is white, the lightest's black
        ax = self._panels(self._figure(self.res))[1]
        owned = self.res["owned_by_colour"]["hierarchical"]["dense_param_bytes"]
        texts = {t.get_text().split("\n")[0]: t.get_color() for t in ax.texts
                 if t.get_text().startswith("r")}
        self.assertEqual(texts[f"r{owned.index(max(owned))}"], "white")
        self.assertEqual(texts[f"r{owned.index(min(owned))}"], "black")
        rotated = [t.get_text() for t in ax.texts if t.get_rotation() != 0]
        self.assertEqual(rotated, [], "no rotated labels over the cells")

    def test_flat_only_results_get_one_panel_and_a_note(self) -> None:
        from paddle_muon_ext.tools.args import MuonCommConfig
        from paddle_muon_ext.tools.plan import compute_plan
        from paddle_muon_ext.tools.report import render_png

        for cfg, note in (
                (MuonCommConfig(ep=4, moe_sharding=2, pp=1, gpus_per_node=4, model="tiny"),
                 "flat path only (--no-group-call"),
                (MuonCommConfig(ep=4, moe_sharding=2, pp=1, gpus_per_node=8, model="tiny"),
                 "one node: nothing crosses nodes")):
            res = compute_plan(cfg, group_call=False)
            fig = self._figure(res)
            panels = self._panels(fig)
            self.assertEqual(len(panels), 1)
            self.assertEqual(panels[0].get_lines(), [], "no same-card lines on the flat path")
            self.assertIn("flat path (comm_group_call_opt off)", panels[0].get_title())
            self.assertIn(note, fig._suptitle.get_text())
            legend = [t.get_text() for t in fig.legends[0].get_texts()]
            self.assertFalse(any("same-card" in t for t in legend), legend)
        self.assertEqual(render_png(res)[:8], b"\x89PNG\r\n\x1a\n")

    def test_large_pictures_leave_labels_out_and_thin_ticks(self) -> None:
        from paddle_muon_ext.tools import report

        with mock.patch.object(report, "MAX_LABELLED_CELLS", 31), \
                mock.patch.object(report, "MAX_TICKS", 2):
            fig = self._figure(self.res)  # 8 nodes x 4 cards = 32 cells
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        self.assertIn("cell: one rank (32 ranks: labels left out above 31)", legend)
        for ax in self._panels(fig):
            self.assertEqual([t for t in ax.texts if t.get_text().startswith("r")], [])
            self.assertEqual(list(ax.get_xticks()), [0, 2])
            self.assertEqual(list(ax.get_yticks()), [0, 4])


if __name__ == "__main__":
    unittest.main()
