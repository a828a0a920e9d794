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
"""Tests for tools/export_upstream_patch.py.

Three targets: a fake package exported against nothing (unit level); this
repository exported against a throw-away develop-like Paddle checkout (the
installed paddle's Python files plus develop's Muon files and registries at
their paths, placeholder text); and this repository applied to a copy of the
installed 3.3.1 package, with the mock-based suites run there in tree.
"""

import json
import os
import re
import subprocess
import time

import pytest
from tool_loader import load_tool

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ep = load_tool("export_upstream_patch.py", "_muon_export_tool")

MO = "python/paddle_muon_ext/distributed/fleet/meta_optimizers/"
PM = "python/paddle/distributed/fleet/meta_optimizers/"
FLEET = "test/collective/fleet/"
SHARDING_OPT = "paddle.distributed.fleet.meta_optimizers.muon_sharding_optimizer"

MUON_SRC = '''\
"""Fake Muon."""
import paddle_muon_ext
from paddle_muon_ext import optimizer as _opt
from paddle_muon_ext.distributed.fleet.meta_optimizers import newpkg

# paddle_muon_ext: compat-begin
from paddle_muon_ext.compat_paddle_3_3 import shim
shim.install()
# paddle_muon_ext: compat-end

my_paddle_muon_ext = 1
paddle_muon_ext_version = "0.1"
PATH = "python/paddle_muon_ext/optimizer"
TARGET = "paddle_muon_ext.optimizer.muon.Muon"


class Muon:
    NAME = "muon"

    def get(self):
        x = self.paddle_muon_ext_attr
        # paddle_muon_ext: compat-begin
        x = x + 0
        # paddle_muon_ext: compat-end
        return x + my_paddle_muon_ext
'''
MUON_EXPORTED = '''\
"""Fake Muon."""
import paddle
from paddle import optimizer as _opt
from paddle.distributed.fleet.meta_optimizers import newpkg


my_paddle_muon_ext = 1
paddle_muon_ext_version = "0.1"
PATH = "python/paddle_muon_ext/optimizer"
TARGET = "paddle.optimizer.muon.Muon"


class Muon:
    NAME = "muon"

    def get(self):
        x = self.paddle_muon_ext_attr
        return x + my_paddle_muon_ext
'''
FAKE_TEST = ("import unittest\n\nfrom mock.fake_group import FakeGroup\n"
             "from unittest import mock\n\n\nclass TestFake(unittest.TestCase):\n"
             "    def test_ranks(self):\n        self.assertEqual(FakeGroup.nranks, 2)\n")
FILES = {
    "python/paddle_muon_ext/__init__.py": "from .optimizer import Muon\n",
    "python/paddle_muon_ext/cli.py": "def main():\n    pass\n",
    "python/paddle_muon_ext/compat_paddle_3_3/__init__.py": "",
    "python/paddle_muon_ext/compat_paddle_3_3/shim.py": "def install():\n    pass\n",
    "python/paddle_muon_ext/tools/__init__.py": "",
    "python/paddle_muon_ext/optimizer/__init__.py":
        'from .muon import Muon\n\n__all__ = ["Muon"]\n',
    "python/paddle_muon_ext/optimizer/muon.py": MUON_SRC,
    MO + "__init__.py": "from .muon_probe import PROBE\n",
    MO + "muon_probe.py":
        "from paddle_muon_ext.optimizer.muon import Muon\n\nPROBE = Muon.NAME\n",
    MO + "compat_glue.py":
        "# Copyright\n# paddle_muon_ext: compat-only\nimport paddle_muon_ext\n",
    MO + "newpkg/__init__.py": "X = 1\n",
    MO + "blob.bin": None,  # binary
    FLEET + "test_muon_fake.py": FAKE_TEST,
    FLEET + "conftest.py": "import sys\n",
    "test/legacy_test/test_muon_single.py": "import unittest\n",
    # a test of a tool that stays here, and its worker
    FLEET + "test_muon_tool.py": "from paddle_muon_ext.tools import cluster\n"
                                 "WORKER = 'tool_worker.py'\n",
    FLEET + "tool_worker.py": "print(1)\n",
    "test/mock/__init__.py": "",
    "test/mock/fake_group.py": "class FakeGroup:\n    nranks = 2\n",
    "test/mock/test_mock_group.py": FAKE_TEST,
    "test/tools/test_tooling.py": "def test_x():\n    pass\n",
    "tools/bench/run.py": "print(1)\n",
    "CMakeLists.txt": ('muon_py_test(test_muon_fake FILES "test/collective/fleet/'
                       'test_muon_fake.py::TestFake" TIMEOUT 300 LABELS "CPU;DIST")\n'
                       "muon_py_test(test_mock FILES test/mock TIMEOUT 200 LABELS \"CPU\")\n"),
    "README.md": "readme\n",
}
EXPECTED = {
    "python/paddle/optimizer/muon.py",
    PM + "muon_probe.py",
    PM + "newpkg/__init__.py",
    FLEET + "test_muon_fake.py",
    FLEET + "test_muon_mock_group.py",
    FLEET + "muon_mock/__init__.py",
    FLEET + "muon_mock/fake_group.py",
    "test/legacy_test/test_muon_single.py",
}


def _git(cwd, *args, check=True):
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@e",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@e")
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=check,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)


def _write_tree(root, files):
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"\x00\x01binary" if text is None else text.encode())


@pytest.fixture(scope="module")
def fake_repo(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("export") / "ext")
    _write_tree(root, FILES)
    _git(root, "init", "-q", "-b", "main")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "fake package")
    return root


def _export(repo, out, capsys, *extra):
    rc = ep.main(["-o", out, "--repo-root", repo, *extra])
    captured = capsys.readouterr()
    text = None
    if os.path.exists(out):
        with open(out) as f:
            text = f.read()
    return rc, text, captured.out, captured.err


def _sections(patch):
    """{path: (is_new, [diff body lines])} of a git patch."""
    files, cur = {}, None
    for line in patch.splitlines():
        if line.startswith("diff --git a/"):
            cur = line.split(" b/", 1)[1]
            files[cur] = [False, []]
        elif cur and line == "new file mode 100644":
            files[cur][0] = True
        elif line == "-- ":
            cur = None
        elif cur:
            files[cur][1].append(line)
    return {k: (v[0], v[1]) for k, v in files.items()}


def _added_text(body):
    lines = [l[1:] for l in body if l.startswith("+") and not l.startswith("+++ ")]
    return "\n".join(lines) + ("\n" if lines else "")


# ------------------------------------------------------------- unit level
def test_rewrite_imports_unit():
    r = ep.rewrite_imports
    assert r("from paddle_muon_ext.a.b import c") == "from paddle.a.b import c"
    assert r("from paddle_muon_ext import a") == "from paddle import a"
    assert r("import paddle_muon_ext as p") == "import paddle as p"
    assert r("import paddle_muon_ext.x") == "import paddle.x"
    assert r("mock.patch('paddle_muon_ext.x.y')") == "mock.patch('paddle.x.y')"
    for same in ("my_paddle_muon_ext.x", "paddle_muon_ext_version.x",
                 "obj.paddle_muon_ext.x", "from paddle_muon_ext_x import y",
                 "'python/paddle_muon_ext/x'", "# paddle_muon_ext: compat-only",
                 "import paddle_muon_ext_v2"):
        assert r(same) == same


def test_harness_imports_unit():
    h = ep.rewrite_harness_imports
    assert h("from mock.fake_hcg import X\n") == "from muon_mock.fake_hcg import X\n"
    assert h("    from mock import fake_comm\n") == "    from muon_mock import fake_comm\n"
    assert h("import mock.patching as p\n") == "import muon_mock.patching as p\n"
    for same in ("from unittest import mock\n", "mock.patch.object(x, 'y')\n",
                 "import mock\n", "from mocking import x\n", "x = mock.fake\n"):
        assert h(same) == same


def test_strip_compat_blocks_unit():
    text = "a\n  # paddle_muon_ext: compat-begin\nb\n  # paddle_muon_ext: compat-end\nc\n"
    assert ep.strip_compat_blocks(text) == "a\nc\n"
    for bad in ("# paddle_muon_ext: compat-begin\nx\n",
                "x\n# paddle_muon_ext: compat-end\n",
                "# paddle_muon_ext: compat-begin\n# paddle_muon_ext: compat-begin\n"):
        with pytest.raises(ep.ExportError):
            ep.strip_compat_blocks(bad)


PROTO = """\
syntax = "proto2";
package paddle.distributed.fleet;

message DygraphShardingConfig {
  optional bool tensor_fusion = 1 [ default = false ];
  // optional int32 commented_out = 40;
  optional bool comm_group_call_opt = 12 [ default = false ];
  message Nested { optional int32 deep = 99; }
  reserved 13 to 15;
}

message DistributedStrategy {
  optional bool use_muon_sharding = 120 [ default = false ];
  optional DygraphShardingConfig sharding_configs = 121;
}
"""
OPTION = ep.StrategyOption("DygraphShardingConfig", "sharding_configs", "muon_x",
                           "string", '"a"', "what x does")


def test_add_proto_fields_unit():
    text, added, present = ep.add_proto_fields(PROTO, [OPTION])
    assert added == ["muon_x"] and present == []
    # after the highest number of the message itself (reserved 15), nested
    # messages and comments excluded; before the message's closing brace
    assert '  reserved 13 to 15;\n  optional string muon_x = 16 [ default = "a" ];\n}' in text
    assert text.count("muon_x") == 1
    again, added, present = ep.add_proto_fields(text, [OPTION])
    assert again == text and added == [] and present == ["muon_x"]
    other = OPTION.__class__(**dict(OPTION.__dict__, default='"b"'))
    with pytest.raises(ep.EditConflict, match='default "a", the export needs "b"'):
        ep.add_proto_fields(text, [other])
    with pytest.raises(ep.EditConflict, match="no `message DygraphShardingConfig"):
        ep.add_proto_fields(PROTO.replace("DygraphShardingConfig {", "Other {"), [OPTION])


STRATEGY_PY = '''\
class DistributedStrategy:
    @property
    def hybrid_configs(self):
        """
        Hybrid configuration.

        **Note**:
            **dp_degree(int)**: data parallel degree.

        Examples:
            .. code-block:: python

                >>> strategy.hybrid_configs = {}
        """
        return {}
'''


def test_add_strategy_docs_unit():
    text, added = ep.add_strategy_docs(STRATEGY_PY, [OPTION])
    assert added == ["muon_x"]
    assert ("            **dp_degree(int)**: data parallel degree.\n"
            "            **sharding_configs.muon_x(str)**: what x does\n"
            "\n        Examples:") in text
    compile(text, "s.py", "exec")
    assert ep.add_strategy_docs(text, [OPTION]) == (text, [])
    with pytest.raises(ep.EditConflict, match="no DistributedStrategy.hybrid_configs"):
        ep.add_strategy_docs(STRATEGY_PY.replace("hybrid_configs", "other"), [OPTION])


def test_add_testslist_rows_unit():
    text = ep.TESTSLIST_HEADER + "\ntest_a,,GPU,120,DIST,x,2,,envs,"  # no final newline
    row = ep.testslist_row("test_b", ep.TestMeta(300, frozenset({"CPU", "DIST"}), True))
    new, added, present = ep.add_testslist_rows(text, [row, ["test_a"] + row[1:]])
    assert added == ["test_b"] and present == ["test_a"]
    assert new == text + "\ntest_b,,,300,DIST,../../legacy_test/dist_test.sh,2,1," \
        "http_proxy=;https_proxy=;PYTHONPATH=../..,WITH_GLOO\n"
    with pytest.raises(ep.EditConflict, match="header is"):
        ep.add_testslist_rows("name,os\n", [row])
    single = ep.testslist_row("t", ep.TestMeta(60, frozenset({"CPU"}), True))
    assert single[2:8] == ["", "60", "", "test_runner.py", "", ""]
    gpu = ep.testslist_row("t", ep.TestMeta(600, frozenset({"GPU", "DIST"}), True))
    assert gpu[2] == "GPU" and gpu[-1] == "WITH_NCCL"


def test_modification_diff_applies_with_3way(tmp_path):
    """A diff against the target's text, including a file without final newline."""
    root = str(tmp_path)
    old = "".join("line %d\n" % i for i in range(40)) + "tail"
    new = old.replace("line 5\n", "line five\n").replace("tail", "tail\nmore\n")
    _write_tree(root, {"a.py": old})
    _git(root, "init", "-q")
    _git(root, "add", "a.py")
    _git(root, "commit", "-q", "-m", "base")
    ex = ep.Export(changes={"a.py": ep.Change("a.py", new, old)})
    with open(os.path.join(root, "p.patch"), "w") as f:
        f.write(ep.render_patch(ex))
    _git(root, "apply", "--check", "p.patch")
    # --3way finds the preimage blob by the id in the index line
    _git(root, "apply", "--3way", "p.patch")
    with open(os.path.join(root, "a.py")) as f:
        assert f.read() == new


# Fields develop's proto already has (UPSTREAM_API.md section 2, and #79763's
# machine_balanced_2d_partition).
DEVELOP_STRATEGY_FIELDS = {"use_muon_sharding", "comm_group_call_opt",
                           "machine_balanced_2d_partition"}


def test_strategy_options_are_the_package_options():
    """Each option the package adds becomes a field, with the package's default."""
    pytest.importorskip("paddle")
    import dataclasses

    from paddle_muon_ext.compat_paddle_3_3.strategy_options import MuonShardingOptions

    ours = {f.name: f.default for f in dataclasses.fields(MuonShardingOptions)}
    exported = {o.name: o for o in ep.STRATEGY_OPTIONS}
    assert set(ours) - DEVELOP_STRATEGY_FIELDS == set(exported)
    for name, opt in exported.items():
        assert json.loads(opt.default) == ours[name], name


# ------------------------------------------------ fake package, no target
def test_patch_content(fake_repo, tmp_path, capsys):
    out = str(tmp_path / "m.patch")
    rc, patch, stdout, err = _export(fake_repo, out, capsys)
    assert rc == 0, err
    files = _sections(patch)
    assert set(files) == EXPECTED
    assert all(is_new for is_new, _ in files.values())
    assert _added_text(files["python/paddle/optimizer/muon.py"][1]) == MUON_EXPORTED
    assert _added_text(files[PM + "muon_probe.py"][1]) == (
        "from paddle.optimizer.muon import Muon\n\nPROBE = Muon.NAME\n")
    harness_test = _added_text(files[FLEET + "test_muon_mock_group.py"][1])
    assert "from muon_mock.fake_group import FakeGroup" in harness_test
    assert "from unittest import mock" in harness_test
    # existing Paddle __init__.py files are not touched; missing exports noted
    with open(ep.notes_path_for(out)) as f:
        notes = f.read()
    assert "`python/paddle/optimizer/__init__.py`:" in notes
    assert "from .muon import Muon\n__all__ += ['Muon']" in notes
    # rows from CMakeLists.txt metadata; no registry edit without a checkout
    assert ("`test_muon_fake,,,300,DIST,../../legacy_test/dist_test.sh,2,1,"
            "http_proxy=;https_proxy=;PYTHONPATH=../..,WITH_GLOO`") in notes
    assert "`test_muon_mock_group,,,200,,test_runner.py," in notes
    assert "test/legacy_test/test_muon_single.py`: registered by the directory's" in notes
    assert ("`test/collective/fleet/test_muon_tool.py`: test of a tool that is not "
            "exported (imports paddle.tools)") in notes
    assert ("`test/collective/fleet/tool_worker.py`: helper used only by tests that "
            "are not exported") in notes
    assert "muon_partition_strategy` (string, default \"upstream_greedy\"): not added" in notes
    # the pytest-only module has no unittest tests: a warning, an error on request
    assert "test_muon_single.py: no unittest test methods" in err
    assert "test_muon_fake.py: no unittest" not in err
    os.remove(out)
    rc, patch, _, err = _export(fake_repo, out, capsys, "--require-unittest")
    assert rc == 1 and patch is None
    assert "NO UNITTEST TESTS: test/legacy_test/test_muon_single.py" in err


def test_git_apply_and_am_in_fresh_repo(fake_repo, tmp_path, capsys):
    patch_path = str(tmp_path / "m.patch")
    assert _export(fake_repo, patch_path, capsys)[0] == 0
    target = str(tmp_path / "paddle_checkout")
    os.makedirs(target)
    _git(target, "init", "-q")
    _git(target, "commit", "-q", "--allow-empty", "-m", "root")
    proc = _git(target, "apply", "--check", patch_path, check=False)
    assert proc.returncode == 0, proc.stdout
    proc = _git(target, "am", "-q", patch_path, check=False)
    assert proc.returncode == 0, proc.stdout
    with open(os.path.join(target, "python/paddle/optimizer/muon.py")) as f:
        assert f.read() == MUON_EXPORTED
    assert set(_git(target, "ls-files").stdout.split()) == EXPECTED


def test_leftover_reference_warning_strict(tmp_path, capsys):
    root = str(tmp_path / "ext")
    _write_tree(root, {"python/paddle_muon_ext/optimizer/bad.py":
                       "from paddle_muon_ext.compat_paddle_3_3 import x\n"
                       "import os, paddle_muon_ext\n"
                       "from paddle_muon_ext.tools import plan\n"})
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    rc, _, _, err = _export(root, str(tmp_path / "p.patch"), capsys)
    assert rc == 0
    assert "bad.py:1: imports a dropped package" in err
    assert "bad.py:3: imports a dropped package" in err
    assert "bad.py:2: leftover 'paddle_muon_ext'" in err
    os.remove(str(tmp_path / "p.patch"))
    rc, patch, _, err = _export(root, str(tmp_path / "p.patch"), capsys, "--strict")
    assert rc == 1 and patch is None and "no patch written" in err


def test_verify_against_installed_paddle(fake_repo, tmp_path, capsys):
    pytest.importorskip("paddle", reason="needs an installed paddle to copy")
    work = str(tmp_path / "verify")
    rc, _, out, err = _export(
        fake_repo, str(tmp_path / "m.patch"), capsys,
        "--verify-against-installed-paddle", work,
        "--verify-module", "paddle.distributed.fleet.meta_optimizers.muon_probe")
    assert rc == 0, err
    assert "VERIFY OK" in out
    probe = os.path.join(os.path.realpath(work), "python", PM[len("python/"):],
                         "muon_probe.py")
    assert probe in out


# ------------------------------------------ this repo vs a develop-like tree
# Develop's files at develop's paths.  Placeholder text, written here for the
# test (no Paddle source is stored): what matters is which paths exist, the
# names the sharding module defines, and the registry formats.
DEV_SHARDING = '''\
"""Stands in for develop's muon_sharding_optimizer.py."""

__all__ = []


class MuonShardingOptimizer:
    def __init__(self, optimizer, hcg=None):
        self._inner_opt = optimizer

    def reduce_gradients(self, parameter_list, hcg):
        pass

    def filter_parameters(self, parameter_list, hcg):
        return parameter_list

    def step(self):
        pass

    def minimize(self, loss):
        pass

    def clear_grad(self, set_to_zero=True):
        pass

    def state_dict(self):
        return {}

    def set_state_dict(self, state_dict):
        pass

    def _sharding_sync_parameters(self):
        pass
'''
DEV_TEST = '''\
import unittest

DEVELOP_CASE = "develop"


class TestMuonShardingDevelop(unittest.TestCase):
    def test_develop_case_is_kept(self):
        self.assertEqual(DEVELOP_CASE, "develop")


if __name__ == "__main__":
    unittest.main()
'''
DEV_WORKER = '"""Stands in for develop\'s worker script."""\nprint("develop worker")\n'
DEV_ROW = ("test_parallel_dygraph_muon,,GPU,300,DIST,../../legacy_test/dist_test.sh,2,,"
           "http_proxy=;https_proxy=;PYTHONPATH=../..,WITH_NCCL\n")
DEVELOP = {
    PM + "muon_sharding_optimizer.py": DEV_SHARDING,
    FLEET + "hybrid_parallel_sharding_muon_model.py": DEV_WORKER,
    FLEET + "test_parallel_dygraph_muon.py": DEV_TEST,
    FLEET + "testslist.csv": ep.TESTSLIST_HEADER + "\n" + DEV_ROW,
    ep.PROTO_PATH: PROTO,
    "test/legacy_test/CMakeLists.txt": "# registers test_*.py by glob\n",
}
def _our_muon_text():
    with open(os.path.join(REPO, "python/paddle_muon_ext/optimizer/muon.py")) as f:
        return ep.rewrite_imports(ep.strip_compat_blocks(f.read()))


def _develop_tree(root):
    """Installed paddle's Python tree + develop's Muon files; a git repo.

    develop's muon.py is our exported muon.py (they are the same by the
    parity tests), so the patched tree imports for real.
    """
    os.makedirs(os.path.join(root, "python"))
    ep.mirror_installed_paddle(os.path.join(root, "python"))
    files = dict(DEVELOP, **{"python/paddle/optimizer/muon.py": _our_muon_text()})
    _write_tree(root, files)
    _git(root, "init", "-q")
    _git(root, "add", *files, ep.STRATEGY_DOC_PATH)
    _git(root, "commit", "-q", "-m", "develop-like")
    return files


def _read(root, rel):
    with open(os.path.join(root, rel)) as f:
        return f.read()


def test_export_against_develop_like_tree(tmp_path, capsys):
    pytest.importorskip("paddle", reason="needs an installed paddle to copy")
    tree = str(tmp_path / "Paddle")
    develop = _develop_tree(tree)
    strategy_before = _read(tree, ep.STRATEGY_DOC_PATH)
    out = str(tmp_path / "muon.patch")
    rc, patch, stdout, err = _export(REPO, out, capsys, "--include-untracked",
                                     "--strict", "--require-unittest",
                                     "--paddle-root", tree)
    assert rc == 0, err
    files = _sections(patch)
    # left out / kept / modified / added
    assert "python/paddle/optimizer/muon.py" not in files
    for kept in (FLEET + "test_parallel_dygraph_muon.py",
                 FLEET + "hybrid_parallel_sharding_muon_model.py"):
        assert kept not in files
        assert files[kept[:-3] + "_extended.py"][0] is True
    for modified in (PM + "muon_sharding_optimizer.py", ep.PROTO_PATH,
                     ep.STRATEGY_DOC_PATH, FLEET + "testslist.csv"):
        assert files[modified][0] is False, modified
    assert not any(l.startswith("-") and not l.startswith("---")
                   for l in files[ep.PROTO_PATH][1] + files[FLEET + "testslist.csv"][1])
    # references follow the renamed worker
    ext = _added_text(files[FLEET + "test_parallel_dygraph_muon_extended.py"][1])
    assert "hybrid_parallel_sharding_muon_model_extended" in ext
    assert not re.search(r"hybrid_parallel_sharding_muon_model\b(?!_)", ext)
    with open(ep.notes_path_for(out)) as f:
        notes = f.read()
    assert "`python/paddle/optimizer/muon.py`: left out" in notes
    assert ("`%smuon_sharding_optimizer.py`: modified; keeps develop's" % PM) in notes
    assert "MuonShardingOptimizer._sharding_sync_parameters" in notes
    assert "develop's, kept as is; our cases are in" in notes
    # apply as a developer would: plain and three-way
    _git(tree, "apply", "--check", out)
    _git(tree, "apply", "--3way", out)
    assert _read(tree, "python/paddle/optimizer/muon.py") == develop[
        "python/paddle/optimizer/muon.py"]
    assert _read(tree, FLEET + "test_parallel_dygraph_muon.py") == DEV_TEST
    assert _read(tree, FLEET + "hybrid_parallel_sharding_muon_model.py") == DEV_WORKER
    assert "Stands in for develop" not in _read(tree, PM + "muon_sharding_optimizer.py")
    proto = _read(tree, ep.PROTO_PATH)
    assert ('  reserved 13 to 15;\n  optional string muon_partition_strategy = 16 '
            '[ default = "upstream_greedy" ];\n  optional bool overlap_sync_group_call = 17 '
            '[ default = false ];\n}') in proto
    strategy = _read(tree, ep.STRATEGY_DOC_PATH)
    assert "**sharding_configs.muon_partition_strategy(str)**:" in strategy
    assert "**sharding_configs.overlap_sync_group_call(bool)**:" in strategy
    added = [l + "\n" for l in strategy.splitlines()
             if "**sharding_configs.muon_partition_strategy" in l
             or "**sharding_configs.overlap_sync_group_call" in l]
    assert len(added) == 2
    assert strategy.replace(added[0], "").replace(added[1], "") == strategy_before
    rows = _read(tree, FLEET + "testslist.csv").splitlines()
    assert rows[:2] == [ep.TESTSLIST_HEADER, DEV_ROW.strip()]
    listed = {r.split(",")[0]: r.split(",") for r in rows[2:]}
    fleet_tests = {os.path.basename(p)[:-3] for p in files
                   if p.startswith(FLEET) and os.path.basename(p).startswith("test_")
                   and p.endswith(".py")}
    assert set(listed) == fleet_tests
    assert listed["test_parallel_dygraph_muon_extended"][5] == ep.DIST_LAUNCHER
    assert listed["test_muon_mock_world"][5] == ep.SINGLE_LAUNCHER
    assert not any(p.startswith("test/legacy_test/") and not p.endswith(".py")
                   for p in files)  # glob-registered: no CMake edits
    assert not [p for p in files if p.endswith(".cmake") or p.endswith("CMakeLists.txt")]
    # the patched tree imports, and every test module loads with unittest
    modules = ep.exported_modules(p for p in files if files[p][0] or p.endswith(".py"))
    ep.import_in_tree(tree, [m for m in modules if "distributed_strategy" not in m]
                      + ["paddle.distributed.fleet.base.distributed_strategy"])
    test_files = sorted(p for p in files if ep._is_test_module(p)) + [
        FLEET + "test_parallel_dygraph_muon.py"]
    res = ep.load_unittest_in_tree(tree, test_files, repo_root=REPO, timeout=300)
    counts = res["report"]["unittest_counts"]
    assert counts[FLEET + "test_parallel_dygraph_muon.py"] == 1  # develop's case
    errors = {p: c for p, c in counts.items() if not isinstance(c, int)}
    assert not errors, errors
    assert all(c > 0 for c in counts.values()), counts
    with capsys.disabled():
        print("\n[develop-like tree] unittest load %.1fs: %s"
              % (res["wall_s"], json.dumps(counts, sort_keys=True)))


def test_conflicts_write_nothing(tmp_path, capsys):
    """Unresolvable target text: exit 1, every conflict named, no files written."""
    tree = str(tmp_path / "Paddle")
    _write_tree(tree, dict(DEVELOP, **{
        # develop's muon.py names less one (see DEV_MUON)
        "python/paddle/optimizer/muon.py": DEV_MUON.replace(
            "def _default_should_use_muon(", "def _renamed_rule("),
        ep.PROTO_PATH: PROTO.replace("message DygraphShardingConfig", "message Renamed"),
        PM + "muon_sharding_optimizer.py": DEV_SHARDING + "\n\ndef develop_only_helper():\n"
                                                          "    pass\n",
        ep.STRATEGY_DOC_PATH: STRATEGY_PY,
    }))
    out = str(tmp_path / "muon.patch")
    rc, patch, _, err = _export(REPO, out, capsys, "--include-untracked",
                                "--paddle-root", tree)
    assert rc == 1
    assert patch is None and not os.path.exists(ep.notes_path_for(out))
    assert ("CONFLICT: %s: no `message DygraphShardingConfig {` to add field "
            "muon_partition_strategy to" % ep.PROTO_PATH) in err
    assert ("CONFLICT: %smuon_sharding_optimizer.py: would remove develop's public "
            "name develop_only_helper" % PM) in err
    assert "no patch written" in err
    # this repository's exported files use develop's muon names only: the one
    # DEV_MUON lacks is the only muon conflict
    muon = [l for l in err.splitlines() if "develop's paddle/optimizer/muon.py" in l]
    assert muon and all(l.endswith(": " + MUON_CONFLICT % "_default_should_use_muon")
                        for l in muon), muon
    assert "CONFLICT: %smuon_param_map.py: %s" % (
        FLEET, MUON_CONFLICT % "_default_should_use_muon") in muon, muon


def test_sharding_optimizer_keeps_every_develop_name(tmp_path, capsys):
    """Cherry-pick keeps develop: a private name, class attribute or method of
    develop's muon_sharding_optimizer.py that ours lacks is a conflict."""
    develop_text = DEV_SHARDING + (
        "\n    _NO_HOOK_COLORS = frozenset()\n"
        "    _DEVELOP_ONLY_ATTR = 1\n\n"
        "    def _develop_only_method(self):\n        pass\n\n\n"
        "g_shard_bypass_dygraph_optimizer = 0\n"
        "_develop_private_table = {}\n\n\n"
        "def _develop_private_helper():\n    pass\n\n\n"
        "def _is_trainable(param):\n    pass\n")
    tree = str(tmp_path / "Paddle")
    _write_tree(tree, dict(DEVELOP, **{PM + "muon_sharding_optimizer.py": develop_text,
                                       ep.STRATEGY_DOC_PATH: STRATEGY_PY}))
    out = str(tmp_path / "muon.patch")
    rc, patch, _, err = _export(REPO, out, capsys, "--include-untracked",
                                "--paddle-root", tree)
    assert rc == 1, "a removed develop name must refuse the export"
    assert patch is None and not os.path.exists(ep.notes_path_for(out)), \
        "nothing may be written on a conflict"
    prefix = "CONFLICT: %smuon_sharding_optimizer.py: would remove develop's name " % PM
    removed = sorted(line[len(prefix):].split(" ")[0] for line in err.splitlines()
                     if line.startswith(prefix))
    assert removed == ["MuonShardingOptimizer._DEVELOP_ONLY_ATTR",
                       "MuonShardingOptimizer._develop_only_method",
                       "_develop_private_helper", "_develop_private_table"], err
    # ours defines _NO_HOOK_COLORS and the bypass flag, and imports _is_trainable
    for kept in ("_NO_HOOK_COLORS", "g_shard_bypass_dygraph_optimizer", "_is_trainable"):
        assert kept not in "\n".join(l for l in err.splitlines() if "CONFLICT" in l), kept


# develop's paddle/optimizer/muon.py, reduced to its module-level names
# (UPSTREAM_API_2026.md section 1.5) and the Muon static methods tests call
DEV_MUON = '''\
"""Stands in for develop's paddle/optimizer/muon.py."""
import logging
import os
from dataclasses import dataclass

from paddle.optimizer.optimizer import Optimizer

logger = logging.getLogger(__name__)
MUON_DEBUG = os.environ.get("MUON_DEBUG", "0") == "1"
g_shard_bypass_dygraph_optimizer = int(os.environ.get("FLAGS_shard_bypass_dygraph_optimizer", 0))
_NS_COEFFICIENT_SETS = {"simple": [(3.4445, -4.7750, 2.0315)]}
_SYRK_SUPPORTED_DTYPES = ()
try:
    from quack.gemm_interface import gemm_symmetric as _develop_try_name
except ImportError:
    _develop_try_name = None


@dataclass
class MuonParamInfo:
    use_muon: bool = True
    split_concat_func: object = None
    use_hyperball: bool = False


MuonParamInfoMap = dict


def _default_should_use_muon(name, shape, exclude_patterns):
    return len(shape) in (2, 3)


def _to_hashable(value):
    return value


def _load_symmetric_gemm():
    return None


def _symmetric_gemm_is_profitable(shape, dtype, min_short_edge, min_step_flops):
    return False


class Muon(Optimizer):
    @staticmethod
    def _zeropower_via_newtonschulz5(X, steps=5, eps=1e-9, ns_coeffs=None, ns_matmul_dtype=None):
        return X

    @staticmethod
    def _scaling_fn(orthogonal_update, version, extra_scale_factor=1.0):
        return orthogonal_update
'''
MUON_CONFLICT = "imports %s which develop's paddle/optimizer/muon.py does not define"


def test_module_names_used_unit():
    """Every way an exported file can rely on a name of develop's muon module."""
    text = ("import paddle.optimizer.muon\nimport paddle.optimizer.muon as m2\n"
            "from paddle.optimizer import muon as m1\nfrom paddle.optimizer.muon import A0\n"
            "from unittest import mock\n"
            "x = paddle.optimizer.muon.A1\ny = m2.A2\nz = m1.A3\n"
            "mock.patch.object(m1, 'A4', 1)\ngetattr(m2, 'A5')\n"
            "mock.patch('paddle.optimizer.muon.A6.attr')\nhasattr(m1, 'probe')\n"
            "m1.__file__\nother.A7\n'paddle.optimizer.muonic.A8'\n")
    used = ep.module_names_used(text, "test/x.py", "paddle.optimizer.muon")
    assert [n for _, n in used] == ["A0", "A1", "A2", "A3", "A4", "A5", "A6", "A6.attr"], used
    assert used[0] == (4, "A0")
    # members read on a name of the module: "Name.member"
    members = ("from paddle.optimizer.muon import Muon as M\nfrom paddle.optimizer import muon\n"
               "M._a\nmuon.Muon._b\nmock.patch.object(M, '_c')\nM.__init__\n")
    assert ep.module_names_used(members, "test/x.py", "paddle.optimizer.muon") == [
        (1, "Muon"), (3, "Muon._a"), (4, "Muon"), (4, "Muon._b"), (5, "Muon._c")]
    rel = ("from .muon import B1\nfrom . import muon\nmuon.B2\n"
           "from ..optimizer.muon import B3\nfrom ....too_far import x\n")
    for dst in ("python/paddle/optimizer/__init__.py", "python/paddle/optimizer/adam.py"):
        assert [n for _, n in ep.module_names_used(rel, dst, "paddle.optimizer.muon")] == \
            ["B1", "B2", "B3"], dst
    # relative imports of test files are not package imports
    assert ep.module_names_used(rel, "test/legacy_test/t.py", "paddle.optimizer.muon") == []
    assert ep.module_names_used("def broken(:\n", "test/x.py", "paddle.optimizer.muon") == []
    names = ep.module_defined_names(DEV_MUON)
    assert {"logger", "_develop_try_name", "MuonParamInfo", "Muon",
            "Muon._scaling_fn", "_NS_COEFFICIENT_SETS"} <= names
    assert not {"build_muon_param_info_map", "gemm_symmetric"} & names
    assert ep.module_defined_names("def broken(:\n") == set()


def test_class_member_names_follow_bases():
    class Target:  # the base's module in the target tree
        def read(self, rel):
            return {"python/pkg/base.py": "class Base(object):\n    def step(self):\n"
                                          "        pass\n"}.get(rel)

    text = ("from pkg.base import Base\nfrom pkg.gone import Gone\nimport pkg\n\n\n"
            "class Mid(Base):\n    X = 1\n\n\nclass Top(Mid):\n    def _own(self):\n"
            "        pass\n\n\nclass Lost(Gone):\n    pass\n\n\n"
            "class Dotted(pkg.Base):\n    pass\n")
    assert ep.class_member_names(text, "Top", Target()) == {"_own", "X", "step"}
    assert ep.class_member_names(text, "Top") is None, "imported base, no target: unknown"
    for unknown in ("Lost", "Dotted", "missing_class"):
        assert ep.class_member_names(text, unknown, Target()) is None, unknown
    assert ep.class_member_names("def broken(:\n", "Top") is None


def test_package_only_muon_names_refuse_the_export(tmp_path, capsys):
    """A synthetic package whose exported files use names develop's muon.py
    lacks, in every form: one CONFLICT per file and name, nothing written."""
    repo = str(tmp_path / "ext")
    _write_tree(repo, {
        "python/paddle_muon_ext/optimizer/muon.py": DEV_MUON + "\ndef keep_whole(info):\n"
                                                               "    return True\n",
        "python/paddle_muon_ext/optimizer/adam_ext.py":
            "from .muon import Muon, keep_whole\nfrom . import muon\nX = muon.newton_schulz\n",
        "python/paddle_muon_ext/optimizer/helpers_ext.py":
            "# paddle_muon_ext: compat-only\nfrom .muon import keep_whole\n",
        FLEET + "test_muon_uses.py":
            "import unittest\nfrom unittest import mock\n\n"
            "from paddle_muon_ext.optimizer import muon as muon_module\n"
            "from paddle_muon_ext.optimizer.muon import MuonParamInfo, "
            "build_muon_param_info_map\n\n\nclass T(unittest.TestCase):\n"
            "    def test_x(self):\n"
            "        with mock.patch.object(muon_module, 'MUON_DEBUG', True), \\\n"
            "                mock.patch('paddle_muon_ext.optimizer.muon.NS_COEFFS_PRESETS', {}):\n"
            "            muon_module.muon_update_scale((2, 2))\n"
            "        muon_module.Muon._scaling_fn(1, 1)\n"
            "        muon_module.Muon.step(None)\n"
            "        muon_module.Muon._fro(1)\n",
    })
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "package")
    tree = str(tmp_path / "Paddle")
    _write_tree(tree, dict(DEVELOP, **{"python/paddle/optimizer/muon.py": DEV_MUON,
                                       # Muon's base: its members count as Muon's
                                       "python/paddle/optimizer/optimizer.py":
                                           "class Optimizer:\n    def step(self):\n"
                                           "        pass\n",
                                       ep.STRATEGY_DOC_PATH: STRATEGY_PY}))
    out = str(tmp_path / "muon.patch")
    rc, patch, _, err = _export(repo, out, capsys, "--paddle-root", tree)
    assert rc == 1, "a package-only muon name must refuse the export"
    assert patch is None and not os.path.exists(ep.notes_path_for(out)), \
        "nothing may be written on a conflict"
    got = sorted(l for l in err.splitlines() if "develop's paddle/optimizer/muon.py" in l)
    expect = sorted("CONFLICT: %s: %s" % (dst, MUON_CONFLICT % name) for dst, name in (
        ("python/paddle/optimizer/adam_ext.py", "keep_whole"),
        ("python/paddle/optimizer/adam_ext.py", "newton_schulz"),
        (FLEET + "test_muon_uses.py", "build_muon_param_info_map"),
        (FLEET + "test_muon_uses.py", "NS_COEFFS_PRESETS"),
        (FLEET + "test_muon_uses.py", "muon_update_scale")))
    expect.append("CONFLICT: %stest_muon_uses.py: uses Muon._fro which develop's "
                  "paddle/optimizer/muon.py does not define" % FLEET)
    assert got == sorted(expect), err
    # against a target without develop's muon.py, ours travels and nothing conflicts
    del_tree = str(tmp_path / "Paddle_no_muon")
    _write_tree(del_tree, dict(DEVELOP, **{ep.STRATEGY_DOC_PATH: STRATEGY_PY}))
    rc, patch, _, err = _export(repo, str(tmp_path / "b.patch"), capsys,
                                "--paddle-root", del_tree)
    assert "develop's paddle/optimizer/muon.py" not in err
    assert rc == 0 and "python/paddle/optimizer/muon.py" in _sections(patch), err


def test_module_namespace_counts_imports_and_same_module_bases():
    text = ("from x import helper\n\n\nclass Base:\n    LIMIT = 1\n\n"
            "    def _shared(self):\n        pass\n\n\nclass Opt(Base):\n"
            "    def step(self):\n        pass\n")
    names = ep.module_namespace(text)
    assert {"helper", "Opt.LIMIT", "Opt._shared", "Opt.step", "Base.LIMIT"} <= names
    assert "helper" not in ep.module_surface(text)
    assert "Opt.LIMIT" not in ep.module_surface(text)
    assert ep.module_namespace("def broken(:\n") == set()


# ------------------------------------------------ the real repo, in tree
# What only an in-tree run shows: the exported optimizer, plan, Muon and the
# harness they run on work from python/paddle/ with the compat layer gone.
# Suites of pure helpers that the export only re-imports (the other harness
# self-tests, the partition) run in CI already; test_export_against_develop_
# like_tree loads every exported test module in tree.
IN_TREE_SUITES = (
    FLEET + "test_muon_mock_world.py",
    FLEET + "test_muon_comm_plan.py",
    "test/legacy_test/test_muon_optimizer.py",
    FLEET + "test_muon_sharding_optimizer.py",
    # 6 of ~180 group-call tests: the option-off one must pass, the option-on
    # ones skip where comm_group_call_opt cannot be set (3.3.1 wheel copy)
    FLEET + "test_muon_group_call.py",
)
IN_TREE_K = (
    # The group-call grid takes minutes; in-tree it only needs to show the
    # option-off path and the 3.3.1 skip.
    "not (test_muon_group_call and not (option_off_never_resolves"
    " or owner_gradient_is_group_mean or tensor_parallel_with_group_call))"
)
# Skips allowed in the 3.3.1 copy: the wheel's proto lacks these fields, so
# the in-tree code (compat layer dropped) cannot switch them on.
ALLOWED_SKIPS = (
    "comm_group_call_opt: this Paddle build's sharding_configs has no such field",
    "partition_strategy: no such sharding_configs field",
    # develop's field (#79763): the patch adds none for it, the 3.3.1 proto lacks it
    "machine_balanced_2d_partition: this Paddle build's sharding_configs has no such field",
    # CPU wheel
    "bf16 matmul kernels exist only on accelerators",
)
# suites the in-tree run needs whatever else the export leaves out
CORE_SUITES = (
    FLEET + "test_muon_mock_world.py",
    FLEET + "test_muon_sharding_optimizer.py",
    "test/legacy_test/test_muon_optimizer.py",
)


def test_real_repo_suites_run_in_tree(tmp_path, capsys):
    """Export this repo, apply it to a copy of installed paddle, run the suites.

    The pytest subprocess sees only the copy; the editable install's path
    entry and finders are removed and ``paddle_muon_ext`` must not be
    importable, so every Muon module comes from ``<copy>/python/paddle/``.
    The 3.3.1 wheel lacks Muon, so our muon.py is exported here.
    """
    pytest.importorskip("paddle", reason="needs an installed paddle to copy")
    work = str(tmp_path / "paddle_tree")
    exported = ep.build_export(REPO, include_untracked=True).changes
    suites = [p for p in IN_TREE_SUITES if p in exported]
    assert set(CORE_SUITES) <= set(suites), sorted(set(CORE_SUITES) - set(suites))
    pytest_args = "-q -rs -p no:warnings %s -k %s" % (" ".join(suites), json.dumps(IN_TREE_K))
    t0 = time.time()
    rc, patch, out, err = _export(
        REPO, str(tmp_path / "muon.patch"), capsys, "--repo-root", REPO,
        "--include-untracked", "--strict",
        "--verify-against-installed-paddle", work, "--verify-pytest", pytest_args)
    elapsed = time.time() - t0
    assert rc == 0, "in-tree run failed:\n%s\n%s" % (out[-8000:], err[-4000:])
    assert "STRICT" not in err, err
    assert _sections(patch)["python/paddle/optimizer/muon.py"][0] is True
    probe = json.loads(out.split("IN-TREE PYTEST PROBE: ", 1)[1].splitlines()[0])
    root = os.path.realpath(work) + os.sep
    assert probe["paddle_muon_ext_importable"] is False
    assert probe["paddle_muon_ext_loaded"] == []
    for name in ("paddle", "paddle.optimizer.muon", SHARDING_OPT):
        assert os.path.realpath(probe["modules"][name]).startswith(root), (
            name, probe["modules"][name])
    summary = re.search(r"IN-TREE PYTEST OK \(([\d.]+)s\): (.*)", out)
    assert summary, out[-4000:]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|skipped|failed|error)",
                                                summary.group(2))}
    assert counts.get("failed", 0) == counts.get("error", 0) == 0
    # a floor that only says the suites ran (the counts move as suites grow)
    assert counts["passed"] >= 50, summary.group(2)
    skip_lines = [l for l in out.splitlines() if l.startswith("SKIPPED")]
    for line in skip_lines:
        assert any(reason in line for reason in ALLOWED_SKIPS), line
    assert sum(int(re.match(r"SKIPPED \[(\d+)\]", l).group(1))
               for l in skip_lines) == counts.get("skipped", 0)
    with capsys.disabled():
        print("\n[in-tree suites] pytest %.1fs (export+copy+apply+run %.1fs): %s"
              % (float(summary.group(1)), elapsed, summary.group(2)))
        for line in skip_lines:
            print("  " + line)


# ------------------------------------------------- small trees, no paddle copy
def _mini(tmp_path, ours, theirs, checkout=True, **kw):
    """build_export of ``ours`` (files of a fake package) against ``theirs``
    (a fake Paddle checkout; ``checkout=False``: the installed package)."""
    repo, tree = str(tmp_path / "ext"), str(tmp_path / "Paddle")
    _write_tree(repo, ours)
    _write_tree(tree, theirs)
    target = ep.PaddleTree(tree if checkout else None)
    return ep.build_export(repo, files=sorted(ours), paddle_tree=target, **kw)


def test_test_module_outside_registered_dirs_is_a_conflict_for_a_checkout(tmp_path):
    ours = {"test/custom/test_muon_x.py": FAKE_TEST.replace("from mock.fake_group import "
                                                            "FakeGroup\n", "")}
    ex = _mini(tmp_path / "a", ours, {"README": "x\n"})
    reasons = [r for d, r in ex.conflicts if d == "test/custom/test_muon_x.py"]
    assert len(reasons) == 1 and "Paddle registers tests only in" in reasons[0]
    # against the installed package (no testslist to edit) it is only a warning
    ex = _mini(tmp_path / "b", ours, {}, checkout=False)
    assert not [d for d, _ in ex.conflicts if d == "test/custom/test_muon_x.py"]
    assert any(w.startswith("test/custom/test_muon_x.py: test module in test/custom")
               for w in ex.warnings), ex.warnings


def test_cpu_and_gpu_test_runs_on_paddles_cpu_ci():
    both = ep.testslist_row("t", ep.TestMeta(300, frozenset({"CPU", "GPU", "DIST"}), True))
    # arch empty = every arch; WITH_GLOO: its gloo cases run on the CPU CI
    assert both[2] == "" and both[-1] == "WITH_GLOO"
    assert both[5] == ep.DIST_LAUNCHER


def test_a_file_registered_twice_keeps_the_larger_timeout(tmp_path):
    for first, second in ((60, 300), (300, 60)):
        root = str(tmp_path / ("r%d" % first))
        _write_tree(root, {"CMakeLists.txt": (
            "muon_py_test(a FILES test/x/test_a.py TIMEOUT %d LABELS \"CPU\")\n"
            "muon_py_test(b FILES \"test/x/test_a.py::TestB\" TIMEOUT %d LABELS \"GPU\")\n"
            % (first, second))})
        meta = ep.read_test_registry(root)["test/x/test_a.py"]
        assert meta.timeout == 300, (first, second, meta)
        assert meta.labels == {"CPU", "GPU"}


def test_blob_ids_are_gits_for_non_ascii_text(tmp_path):
    root = str(tmp_path)
    old = "# owner rule \u2014 develop\u2019s\nx = '\u00e9\u4e2d'\n"
    new = old + "y = 1\n"
    _write_tree(root, {"a.py": old, "b.py": new})
    _git(root, "init", "-q")
    for name, text in (("a.py", old), ("b.py", new)):
        want = _git(root, "hash-object", name).stdout.strip()
        assert ep._blob_sha(text) == want, name
    # so --3way finds the preimage of a modification of a non-ASCII file
    _git(root, "add", "a.py")
    _git(root, "commit", "-q", "-m", "base")
    ex = ep.Export(changes={"a.py": ep.Change("a.py", new, old)})
    with open(os.path.join(root, "p.patch"), "w", encoding="utf-8") as f:
        f.write(ep.render_patch(ex))
    assert "index %s..%s" % (_git(root, "hash-object", "a.py").stdout.strip(),
                             _git(root, "hash-object", "b.py").stdout.strip()) \
        in open(os.path.join(root, "p.patch"), encoding="utf-8").read()


def test_imports_follow_a_renamed_test_module(tmp_path):
    worker = "print('ours')\n"
    launcher = ("import unittest\n\nimport muon_shared_model\n"
                "from muon_shared_model import build\n"
                "WORKER = 'muon_shared_model.py'\n\n\n"
                "class TestA(unittest.TestCase):\n    def test_a(self):\n"
                "        self.assertTrue(build)\n")
    ex = _mini(tmp_path, {FLEET + "muon_shared_model.py": worker,
                          FLEET + "test_muon_a.py": launcher},
               {FLEET + "muon_shared_model.py": "print('develop')\n"})
    assert ex.renamed == {FLEET + "muon_shared_model.py":
                          FLEET + "muon_shared_model_extended.py"}
    text = ex.changes[FLEET + "test_muon_a.py"].new
    assert "import muon_shared_model_extended\n" in text
    assert "from muon_shared_model_extended import build\n" in text
    assert "WORKER = 'muon_shared_model_extended.py'" in text
    assert FLEET + "muon_shared_model.py" not in ex.changes


def test_removing_a_public_member_of_any_develop_module_is_a_conflict(tmp_path):
    rel = "distributed/fleet/utils/muon_helper.py"
    theirs = {"python/paddle/" + rel: "class Helper:\n    def keep(self):\n        pass\n\n"
                                       "    def develop_only(self):\n        pass\n\n\n"
                                       "def _private():\n    pass\n"}
    ours = {"python/paddle_muon_ext/" + rel: "class Helper:\n    def keep(self):\n"
                                             "        return 1\n"}
    ex = _mini(tmp_path, ours, theirs)
    assert ("python/paddle/" + rel,
            "would remove develop's public name Helper.develop_only") in ex.conflicts
    # a private name of a module outside KEEP_EVERY_NAME is only a warning
    assert not any("_private" in r for _, r in ex.conflicts)
    assert any("develop's private name _private is gone" in w for w in ex.warnings)


def _declared_ranges(body):
    """This test's own reading of a message's field numbers and reservations."""
    ranges = [(int(n), int(n)) for n in re.findall(r"= (\d+)", body)]
    for lo, hi in re.findall(r"reserved (\d+) to (\w+)", body):
        ranges.append((int(lo), 2**29 - 1 if hi == "max" else int(hi)))
    return ranges


def test_new_fields_never_land_in_a_reserved_range():
    opts = [OPTION, OPTION.__class__(**dict(OPTION.__dict__, name="muon_y",
                                            proto_type="bool", default="false"))]
    open_ended = PROTO.replace("reserved 13 to 15;", "reserved 13 to max;")
    text, added, _ = ep.add_proto_fields(open_ended, opts)
    assert added == ["muon_x", "muon_y"]
    # nothing is free above 12, so the highest free numbers below the range
    assert '  optional string muon_x = 11 [ default = "a" ];\n' in text
    assert "  optional bool muon_y = 10 [ default = false ];\n" in text
    body = text.split("message DygraphShardingConfig {", 1)[1].split("\n}\n", 1)[0]
    numbers = [int(n) for n in re.findall(r"muon_\w+ = (\d+)", body)]
    old = _declared_ranges(open_ended.split("message DygraphShardingConfig {", 1)[1]
                           .split("message Nested", 1)[0])
    assert not [n for n in numbers for lo, hi in old if lo <= n <= hi]
    # a closed reservation is skipped, protobuf's own 19000-19999 too
    assert ep.next_field_number("optional int32 a = 1;\nreserved 2 to 4, 6;") == 7
    assert ep.next_field_number("optional int32 a = 5;\nreserved 6 to 8;") == 9
    assert ep.next_field_number('optional int32 a = 5;\nreserved "f9", 6;') == 7
    assert ep.next_field_number("optional int32 a = 18999;") == 20000
    with pytest.raises(ep.EditConflict, match="no free field number"):
        ep.next_field_number("optional bool a = 1;\nreserved 2 to max;")


# ------------------------------------------------------------- --tests-only
CONF_TEST = '''\
# paddle_muon_ext: upstream-tests
import os
import unittest

import muon_conf_helper
from mock.fake_group import FakeGroup
from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_optimizer import (
    MuonShardingOptimizer,
)

try:  # optional: ours only
    from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_layout_only import X
except ImportError:
    X = None

WORKER = os.path.join(os.path.dirname(__file__), "muon_conf_worker.py")


class TestConformance(unittest.TestCase):
    def test_owner_surface(self):
        self.assertTrue(hasattr(MuonShardingOptimizer, "reduce_gradients"))
        self.assertEqual(FakeGroup.nranks, muon_conf_helper.NRANKS)

    def test_worker_beside(self):
        self.assertTrue(os.path.isfile(WORKER))
'''
STANDIN_OPT = ("class MuonShardingOptimizer:\n    def reduce_gradients(self, params, hcg):\n"
               "        pass\n")
CONF_OURS = {
    FLEET + "test_muon_conf.py": CONF_TEST,
    FLEET + "muon_conf_helper.py": "NRANKS = 2\n",
    FLEET + "muon_conf_worker.py": "print('worker')\n",
    FLEET + "muon_unused_helper.py": "print('not imported by the marked test')\n",
    FLEET + "test_muon_unmarked.py": FAKE_TEST,
    "test/mock/__init__.py": "",
    "test/mock/fake_group.py": "from .records import RECORDS\n\n\nclass FakeGroup:\n"
                               "    nranks = 2\n",
    "test/mock/records.py": "RECORDS = []\n",  # reached by a relative import only
    "test/mock/recorder_only.py": "print('not imported')\n",
    MO + "muon_sharding_optimizer.py": STANDIN_OPT + "    def extra(self):\n        pass\n",
    MO + "muon_layout_only.py": "X = 1\n",
    "CMakeLists.txt": ('muon_py_test(test_muon_conf FILES test/collective/fleet/'
                       'test_muon_conf.py TIMEOUT 200 LABELS "CPU;DIST")\n'),
}
DEV_CMAKE = "# generated from testslist.csv by tools/gen_ut_cmakelists.py\n"
CONF_DEVELOP = {
    "python/paddle/__init__.py": "",
    "python/paddle/distributed/__init__.py": "",
    "python/paddle/distributed/fleet/__init__.py": "",
    "python/paddle/distributed/fleet/meta_optimizers/__init__.py": "",
    PM + "muon_sharding_optimizer.py": STANDIN_OPT,
    ep.PROTO_PATH: PROTO,
    FLEET + "testslist.csv": ep.TESTSLIST_HEADER + "\n" + DEV_ROW,
    FLEET + "CMakeLists.txt": DEV_CMAKE,
}


def _git_tree(root, files):
    _write_tree(root, files)
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "develop-shaped")


def test_tests_only_patch_changes_no_product_file(tmp_path, capsys):
    repo, tree = str(tmp_path / "ext"), str(tmp_path / "Paddle")
    _git_tree(repo, CONF_OURS)
    _git_tree(tree, CONF_DEVELOP)
    out = str(tmp_path / "tests.patch")
    rc, patch, stdout, err = _export(repo, out, capsys, "--tests-only", "--strict",
                                     "--require-unittest", "--paddle-root", tree)
    assert rc == 0, err
    files = _sections(patch)
    want_new = {FLEET + "test_muon_conf.py", FLEET + "muon_conf_helper.py",
                FLEET + "muon_conf_worker.py", FLEET + "muon_mock/__init__.py",
                FLEET + "muon_mock/fake_group.py", FLEET + "muon_mock/records.py"}
    assert set(files) == want_new | {FLEET + "testslist.csv"}, sorted(files)
    assert all(files[p][0] for p in want_new) and not files[FLEET + "testslist.csv"][0]
    # testslist.csv: one row added, nothing removed
    rows = files[FLEET + "testslist.csv"][1]
    assert [l for l in rows if l.startswith("+") and not l.startswith("+++")] == [
        "+test_muon_conf,,,200,DIST,../../legacy_test/dist_test.sh,2,1,"
        "http_proxy=;https_proxy=;PYTHONPATH=../..,WITH_GLOO"]
    assert not [l for l in rows if l.startswith("-") and not l.startswith("---")]
    # the sizes printed: our own count of each file's lines
    size = {p: t.count("\n") for p, t in (
        (FLEET + "test_muon_conf.py", ep.upstream_modes.scrub(ep.rewrite_harness_imports(
            ep.rewrite_imports(CONF_TEST)))),  # the marker line does not travel
        (FLEET + "muon_conf_helper.py", "NRANKS = 2\n"),
        (FLEET + "muon_conf_worker.py", "print('worker')\n"),
        (FLEET + "muon_mock/__init__.py", ""),
        (FLEET + "muon_mock/fake_group.py", CONF_OURS["test/mock/fake_group.py"]),
        (FLEET + "muon_mock/records.py", "RECORDS = []\n"))}
    size[FLEET + "testslist.csv"] = 1
    assert "Patch size: 7 files, +%d / -0 lines" % sum(size.values()) in stdout, stdout
    for path, n in size.items():
        assert re.search(r"^  [AM] +\+%d +-0  %s$" % (n, re.escape(path)), stdout, re.M), \
            (path, n, stdout)
    with open(ep.notes_path_for(out)) as f:
        notes = f.read()
    assert "This patch changes no product file" in notes
    assert "not added: tests-only patch" in notes
    # applies to the develop tree as it is; product files, proto, CMakeLists untouched
    _git(tree, "apply", "--check", out)
    _git(tree, "apply", out)
    status = _git(tree, "status", "--porcelain", "--untracked-files=all").stdout
    touched = sorted(l[3:] for l in status.splitlines())
    assert touched == sorted(want_new | {FLEET + "testslist.csv"}), touched
    assert _read(tree, PM + "muon_sharding_optimizer.py") == STANDIN_OPT
    assert _read(tree, FLEET + "CMakeLists.txt") == DEV_CMAKE
    # the module loads under unittest in the tree and tests develop's stand-in
    res = ep.run_unittest_in_tree(tree, [FLEET + "test_muon_conf.py"], repo_root=repo,
                                  timeout=120)
    assert res["problems"] == [], res["output_tail"][-3000:]
    assert res["report"]["unittest_counts"] == {FLEET + "test_muon_conf.py": 2}
    assert res["report"]["unittest_results"][FLEET + "test_muon_conf.py"]["run"] == 2
    assert os.path.realpath(res["report"]["modules"][SHARDING_OPT]).startswith(
        os.path.realpath(tree) + os.sep)


def test_tests_only_refuses_imports_develop_cannot_satisfy(tmp_path, capsys):
    ours = dict(CONF_OURS)
    ours[FLEET + "test_muon_conf.py"] = CONF_TEST.replace(
        "import muon_conf_helper\n",
        "import muon_conf_helper\nfrom paddle_muon_ext.distributed.fleet.meta_optimizers"
        ".muon_layout_only import X as Y\nfrom paddle_muon_ext.distributed.fleet."
        "meta_optimizers.muon_sub.runtime import Z\nfrom paddle_muon_ext.distributed.fleet."
        "meta_optimizers.muon_sharding_optimizer import extra_helper\n")
    # a marked test of a tool that stays here cannot travel: refused, not dropped
    ours[FLEET + "test_muon_toolish.py"] = (ep.UPSTREAM_TESTS_MARKER + "\n"
                                            "from paddle_muon_ext.tools import cluster\n")
    repo, tree = str(tmp_path / "ext"), str(tmp_path / "Paddle")
    _git_tree(repo, ours)
    _git_tree(tree, CONF_DEVELOP)
    out = str(tmp_path / "tests.patch")
    rc, patch, _, err = _export(repo, out, capsys, "--tests-only", "--paddle-root", tree)
    assert rc == 1 and patch is None
    conflicts = [l for l in err.splitlines() if l.startswith("CONFLICT: ")]
    assert conflicts == [
        "CONFLICT: %stest_muon_toolish.py: marked `%s` but left out: test of a tool that "
        "is not exported (imports paddle.tools)" % (FLEET, ep.UPSTREAM_TESTS_MARKER),
        "CONFLICT: %stest_muon_conf.py: imports %s, which the target lacks (a tests-only "
        "patch adds no product file)" % (FLEET, "paddle.distributed.fleet.meta_optimizers"
                                          ".muon_layout_only"),
        # a module inside a subpackage the target lacks altogether
        "CONFLICT: %stest_muon_conf.py: imports %s, which the target lacks (a tests-only "
        "patch adds no product file)" % (FLEET, "paddle.distributed.fleet.meta_optimizers"
                                          ".muon_sub.runtime"),
        "CONFLICT: %stest_muon_conf.py: imports extra_helper from %s, which the target's "
        "%s does not define (a tests-only patch adds no product file)"
        % (FLEET, SHARDING_OPT, SHARDING_OPT)], conflicts
    # usage: the rows need a checkout
    with pytest.raises(SystemExit) as exc:
        ep.main(["-o", out, "--repo-root", repo, "--tests-only"])
    assert exc.value.code == 2
    assert "--tests-only needs --paddle-root" in capsys.readouterr().err
    # bad paths are refused before any work, exit 2
    for extra, message in ((["--paddle-root", str(tmp_path / "absent")], "is not a directory"),
                           (["--paddle-root", tree, "--verify-in-copy", repo],
                            "exists and is not an empty directory")):
        with pytest.raises(SystemExit) as exc:
            ep.main(["-o", out, "--repo-root", repo, "--tests-only", *extra])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not os.path.exists(out)
    # nothing marked: an error, not an empty patch
    bare = str(tmp_path / "bare")
    _git_tree(bare, {p: t.replace(ep.UPSTREAM_TESTS_MARKER + "\n", "")
                     for p, t in CONF_OURS.items()})
    rc, patch, _, err = _export(bare, out, capsys, "--tests-only", "--paddle-root", tree)
    assert rc == 2 and patch is None
    assert "no file carries the `%s` line" % ep.UPSTREAM_TESTS_MARKER in err


def test_full_export_prints_its_size_too(tmp_path, capsys):
    repo, tree = str(tmp_path / "ext"), str(tmp_path / "Paddle")
    _git_tree(repo, CONF_OURS)
    _git_tree(tree, CONF_DEVELOP)
    _git_tree(tree, {ep.STRATEGY_DOC_PATH: STRATEGY_PY})
    out = str(tmp_path / "full.patch")
    rc, patch, stdout, err = _export(repo, out, capsys, "--paddle-root", tree)
    assert rc == 0, err
    stats = {p: (a, r) for p, _, a, r in ep.patch_stats(ep.build_export(
        repo, paddle_tree=ep.PaddleTree(tree)))}
    assert PM + "muon_sharding_optimizer.py" in stats and ep.PROTO_PATH in stats
    assert stats[PM + "muon_sharding_optimizer.py"] == (2, 0)  # `def extra` added
    total_a = sum(a for a, _ in stats.values())
    assert "Patch size: %d files, +%d / -0 lines" % (len(stats), total_a) in stdout


def test_tests_only_on_a_sparse_develop_tree(tmp_path, capsys):
    """A tree with develop's optimizer and the test registries only: imports
    of packages the tree does not hold are not judged; names taken from the
    optimizer still are."""
    ours = dict(CONF_OURS)
    ours[FLEET + "test_muon_conf.py"] = CONF_TEST.replace(
        "import muon_conf_helper\n",
        "import muon_conf_helper\nimport paddle\nfrom paddle.distributed import fleet\n"
        "from paddle.distributed.fleet.utils import mix_precision_utils\n")
    sparse = {k: v for k, v in CONF_DEVELOP.items() if not k.endswith("__init__.py")}
    repo, tree = str(tmp_path / "ext"), str(tmp_path / "Paddle")
    _git_tree(repo, ours)
    _git_tree(tree, sparse)
    rc, patch, _, err = _export(repo, str(tmp_path / "t.patch"), capsys, "--tests-only",
                                "--paddle-root", tree)
    assert rc == 0, err
    assert set(_sections(patch)) >= {FLEET + "test_muon_conf.py", FLEET + "testslist.csv"}
    _git(tree, "apply", "--check", str(tmp_path / "t.patch"))
    ours[FLEET + "test_muon_conf.py"] += (
        "\nfrom paddle_muon_ext.distributed.fleet.meta_optimizers.muon_sharding_optimizer "
        "import not_in_develop\n")
    repo2 = str(tmp_path / "ext2")
    _git_tree(repo2, ours)
    rc, _, _, err = _export(repo2, str(tmp_path / "t2.patch"), capsys, "--tests-only",
                            "--paddle-root", tree)
    assert rc == 1 and "imports not_in_develop from %s" % SHARDING_OPT in err, err


# ------------------------------------------- rules no other test pins
def test_nested_compat_block_is_refused():
    text = ("a = 1\n%s\nb = 2\n%s\nc = 3\n%s\n%s\n"
            % (ep.COMPAT_BEGIN, ep.COMPAT_BEGIN, ep.COMPAT_END, ep.COMPAT_END))
    with pytest.raises(ep.ExportError, match=r"x\.py:4: nested .* \(open at line 2\)"):
        ep.strip_compat_blocks(text, "x.py")


def test_a_map_option_wins_over_the_default_path_map():
    assert ep.map_path("test/mock/fake.py") == FLEET + "muon_mock/fake.py"
    assert ep.map_path("test/mock/fake.py", [("test/mock/", "test/other/")]) == \
        "test/other/fake.py"
    assert ep.map_path("docs/x.md") is None


def test_registry_directory_entries_match_whole_path_components():
    registry = {"test/mock": ep.TestMeta(200, frozenset({"CPU"}), True)}
    assert ep.test_meta(registry, "test/mock/test_mock_x.py").timeout == 200
    # a sibling whose name only starts like the directory is not in it
    assert ep.test_meta(registry, "test/mockery/test_y.py") == ep.TestMeta()


def test_only_classes_with_a_base_count_as_unittest_tests():
    text = ("import unittest\n\n\nclass Plain:\n    def test_a(self):\n        pass\n\n\n"
            "class T(unittest.TestCase):\n    def test_b(self):\n        pass\n\n"
            "    def helper(self):\n        pass\n")
    assert ep.unittest_method_count(text) == 1
    assert ep.unittest_method_count("class Plain:\n    def test_a(self):\n        pass\n") == 0


def test_removing_a_dunder_method_is_removing_a_public_name(tmp_path):
    rel = "distributed/fleet/utils/muon_helper.py"
    theirs = {"python/paddle/" + rel: "class Helper:\n    def __call__(self):\n        pass\n"}
    ours = {"python/paddle_muon_ext/" + rel: "class Helper:\n    X = 1\n"}
    ex = _mini(tmp_path, ours, theirs)
    assert ("python/paddle/" + rel,
            "would remove develop's public name Helper.__call__") in ex.conflicts


def test_conftest_binaries_and_late_compat_markers(tmp_path):
    late = "x = 1\n" * ep.MARKER_SCAN_LINES + ep.COMPAT_ONLY_MARKER + "\n"
    ours = {FLEET + "conftest.py": "import sys\n",
            MO + "late_marker.py": late,
            MO + "early_marker.py": ep.COMPAT_ONLY_MARKER + "\nx = 1\n",
            MO + "data.py": "\0binary\0"}
    ex = _mini(tmp_path, ours, {}, checkout=False)
    dropped = dict(ex.dropped)
    assert dropped[FLEET + "conftest.py"] == "pytest-only (Paddle runs unittest)"
    assert dropped[MO + "early_marker.py"] == "compat-only marker"
    assert dropped[MO + "data.py"] == "binary"
    # the marker counts in the first MARKER_SCAN_LINES lines only
    assert set(ex.changes) == {PM + "late_marker.py"}


def test_a_new_file_without_final_newline_applies(tmp_path):
    root = str(tmp_path)
    _git(root, "init", "-q")
    ex = ep.Export(changes={"n.py": ep.Change("n.py", "a = 1\nb = 2")})
    with open(os.path.join(root, "p.patch"), "w") as f:
        f.write(ep.render_patch(ex))
    _git(root, "apply", "p.patch")
    with open(os.path.join(root, "n.py")) as f:
        assert f.read() == "a = 1\nb = 2"


def test_a_file_the_target_already_has_verbatim_is_not_in_the_patch(tmp_path):
    text = "X = 1\n"
    ex = _mini(tmp_path, {MO + "same.py": text, MO + "other.py": "Y = 2\n"},
               {PM + "same.py": text})
    assert ex.unchanged == [PM + "same.py"]
    assert PM + "same.py" not in ex.changes and PM + "other.py" in ex.changes


def test_tests_only_import_rules(tmp_path, capsys):
    """Helpers found from another test directory; package members and names
    behind a star import resolve; ``try``/``finally`` is not optional."""
    legacy = (ep.UPSTREAM_TESTS_MARKER + "\nimport unittest\n\nimport muon_only_for_legacy\n"
              "from paddle_muon_ext.distributed.fleet.meta_optimizers import "
              "muon_sharding_optimizer as dev\n"
              "from paddle_muon_ext.distributed.fleet.utils import starred_name\n"
              "try:\n    from paddle_muon_ext.distributed.fleet.meta_optimizers.muon_absent "
              "import Z\nfinally:\n    pass\n\n\n"
              "class TestLegacy(unittest.TestCase):\n    def test_x(self):\n"
              "        self.assertTrue(dev and muon_only_for_legacy.OK and starred_name)\n")
    ours = dict(CONF_OURS, **{"test/legacy_test/test_muon_legacy_conf.py": legacy,
                              FLEET + "muon_only_for_legacy.py": "OK = True\n"})
    develop = dict(CONF_DEVELOP, **{
        "python/paddle/distributed/fleet/utils/__init__.py": "from .impl import *  # noqa\n",
        "python/paddle/distributed/fleet/utils/impl.py": "starred_name = 1\n"})
    repo, tree = str(tmp_path / "ext"), str(tmp_path / "Paddle")
    _git_tree(repo, ours)
    _git_tree(tree, develop)
    out = str(tmp_path / "t.patch")
    rc, _, _, err = _export(repo, out, capsys, "--tests-only", "--paddle-root", tree)
    assert rc == 1
    assert [l for l in err.splitlines() if l.startswith("CONFLICT")] == [
        "CONFLICT: test/legacy_test/test_muon_legacy_conf.py: imports %s, which the target "
        "lacks (a tests-only patch adds no product file)"
        % "paddle.distributed.fleet.meta_optimizers.muon_absent"]
    ours["test/legacy_test/test_muon_legacy_conf.py"] = legacy.replace(
        "finally:\n    pass\n", "except ImportError:\n    Z = None\n")
    repo2 = str(tmp_path / "ext2")
    _git_tree(repo2, ours)
    rc, patch, _, err = _export(repo2, out, capsys, "--tests-only", "--paddle-root", tree)
    assert rc == 0, err
    files = _sections(patch)
    assert {"test/legacy_test/test_muon_legacy_conf.py",
            FLEET + "muon_only_for_legacy.py"} <= set(files)
    # glob-registered directory: no row for it
    assert "test_muon_legacy_conf" not in _added_text(files[FLEET + "testslist.csv"][1])
