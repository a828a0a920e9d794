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
"""Fixes for the bugs of develop's MuonShardingOptimizer (docs/UPSTREAM_BUGS.md).

``export_upstream_patch.py --fixes --paddle-root DIR -o FILE`` uses this module:
for every UB-n it finds the code to change in the checkout's own
``muon_sharding_optimizer.py`` at run time (by class, method and AST shape,
never by line number; no text of develop is stored here), applies the
smallest edit that fixes the bug, and adds a unittest module whose tests
fail on the unfixed file and pass on the fixed one. A bug whose code no longer
has the expected shape (fixed upstream, or moved) is left out with the
reason; the other bugs are still fixed.
"""

from __future__ import annotations

import ast
import dataclasses
import datetime
from typing import Callable

CLASS_NAME = "MuonShardingOptimizer"
OPTIMIZER_RELPATH = "python/paddle/distributed/fleet/meta_optimizers/muon_sharding_optimizer.py"
#: The module the fix tests import (Paddle's own, in its tree).
OPTIMIZER_MODULE = "paddle.distributed.fleet.meta_optimizers.muon_sharding_optimizer"
#: The unittest module the fixes patch adds (one class per fixed bug).
TEST_PATH = "test/collective/fleet/test_muon_sharding_clear_grad.py"
TEST_TIMEOUT = 60
#: Most lines the fixes may change in develop's file (the issue's budget).
MAX_PRODUCT_LINES = 40


class NotApplicable(Exception):
    """Develop's text no longer has the shape a fix edits (fixed upstream, or moved)."""


@dataclasses.dataclass(frozen=True)
class BugFix:
    """One UB-n of docs/UPSTREAM_BUGS.md: how to find it, fix it and test it.

    Attributes:
        bug: the id, e.g. "UB-1".
        title: one line, what goes wrong.
        apply: develop's text -> fixed text; raises NotApplicable(reason).
        test_class: the unittest class (text) that pins the fixed behaviour.
        notes: what / reproduce / expected / got / change, for the notes file.
    """

    bug: str
    title: str
    apply: Callable[[str], str]
    test_class: str
    notes: dict


@dataclasses.dataclass
class FixOutcome:
    """What :func:`apply_fixes` did to one checkout's file."""

    text: str
    applied: list = dataclasses.field(default_factory=list)  # [BugFix]
    skipped: list = dataclasses.field(default_factory=list)  # [(BugFix, reason)]


# ----------------------------------------------------------------- AST lookups
def _method(tree: ast.Module, name: str) -> ast.FunctionDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == CLASS_NAME:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
            raise NotApplicable(f"{CLASS_NAME}.{name} not found (moved or renamed)")
    raise NotApplicable(f"no class {CLASS_NAME} in the file (moved)")


def _is_self_attr(node: ast.AST, attr: str) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == attr
            and isinstance(node.value, ast.Name) and node.value.id == "self")


def _mentions(node: ast.AST, attr: str) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == attr for n in ast.walk(node))


def _calls(node: ast.AST, method: str) -> list:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute) and n.func.attr == method]


def _line_start(lines: list, lineno: int) -> int:
    return sum(len(line) for line in lines[:lineno - 1])


def _replace(text: str, node: ast.AST, new: str) -> str:
    """``text`` with the source of ``node`` replaced by ``new``."""
    lines = text.splitlines(keepends=True)
    # col offsets are UTF-8 byte offsets
    start_line = lines[node.lineno - 1].encode("utf-8")
    end_line = lines[node.end_lineno - 1].encode("utf-8")
    start = _line_start(lines, node.lineno) + len(start_line[:node.col_offset].decode("utf-8"))
    end = _line_start(lines, node.end_lineno) + len(end_line[:node.end_col_offset].decode("utf-8"))
    return text[:start] + new + text[end:]


def _insert_lines(text: str, before_lineno: int, block: list, indent: int) -> str:
    lines = text.splitlines(keepends=True)
    pad = " " * indent
    new = [(pad + line).rstrip() + "\n" for line in block]
    return "".join(lines[:before_lineno - 1] + new + lines[before_lineno - 1:])


# ----------------------------------------------------------------- UB-1
def _fix_clear_grad_in_place(text: str) -> str:
    """UB-1: zero a gradient that lives in a comm buffer in place.

    Finds, in ``MuonShardingOptimizer.clear_grad``, the ``if`` whose test is
    exactly ``self.tensor_fusion`` and whose ``else`` calls
    ``<param>.clear_gradient(...)``; widens its test so that parameters whose
    gradient is a view into a fused buffer (every element-wise parameter, the
    Muon ones when ``_use_fuse_gradients``) take the in-place branch too,
    unless the buffers are released each step (``sd_release_grads``: then the
    gradient is copied into a new buffer anyway).
    """
    tree = ast.parse(text)
    method = _method(tree, "clear_grad")
    for node in ast.walk(method):
        if not (isinstance(node, ast.If) and _is_self_attr(node.test, "tensor_fusion")):
            continue
        calls = _calls(ast.Module(body=node.orelse, type_ignores=[]), "clear_gradient")
        if not calls or not isinstance(calls[0].func.value, ast.Name):
            continue
        param = calls[0].func.value.id
        text = _replace(text, node.test, "self.tensor_fusion or (\n"
                        f"{' ' * (node.col_offset + 4)}in_buffer and {param}._grad_ivar() is not None\n"
                        f"{' ' * node.col_offset})")
        return _insert_lines(text, node.lineno, [
            "# A gradient held in a comm buffer is zeroed in place:",
            "# clear_gradient() would detach it from the buffer.",
            "in_buffer = not self.sd_release_grads and (",
            f"    self._use_fuse_gradients or {param}.name in self._slice_params",
            ")",
        ], node.col_offset)
    if any(isinstance(n, ast.If) and _mentions(n.test, "tensor_fusion")
           for n in ast.walk(method)):
        raise NotApplicable("clear_grad's `if self.tensor_fusion:` test has changed "
                            "(fixed upstream?)")
    raise NotApplicable("clear_grad has no `if self.tensor_fusion:` branch falling back "
                        "to clear_gradient() (moved or rewritten)")


UB1_TEST = '''\
class TestClearGradKeepsBufferGradients(unittest.TestCase):
    """clear_grad() zeroes a gradient that is a view into a fused comm
    buffer in place, so the next backward accumulates into the buffer that
    reduce_gradients() communicates (clear_gradient() would detach it)."""

    def test_next_backward_reaches_the_buffer(self):
        rows = (
            ("Muon parameter in a fused 2-D buffer", True, False),
            ("element-wise parameter in a 1-D buffer", False, True),
        )
        for label, fused, sliced in rows:
            with self.subTest(label):
                param = paddle.create_parameter([4], "float32")
                buffer = paddle.zeros([4])
                param._copy_gradient_from(buffer)  # as FusedCommBuffer does
                opt = _bare_optimizer(
                    _parameter_list=[param],
                    _use_fuse_gradients=fused,
                    _slice_params={param.name: None} if sliced else {},
                )
                (2 * param).sum().backward()
                opt.clear_grad()
                (3 * param).sum().backward()
                np.testing.assert_array_equal(buffer.numpy(), [3.0] * 4)
                self.assertTrue(param.grad._is_shared_buffer_with(buffer))
'''


# ----------------------------------------------------------------- UB-2
def _fix_release_drops_slice_grads(text: str) -> str:
    """UB-2: with released buffers, drop the slice parameters' stale gradients.

    Finds, in ``clear_grad``, the ``if`` whose test reads ``sd_release_grads``
    (where the grad storages are freed) and appends to its body a loop that
    clears the gradient of every slice parameter without ``main_grad``; the
    next step's ``assign_slice_grad`` then binds the new buffer instead of
    asserting that the freed one is shared.
    """
    tree = ast.parse(text)
    method = _method(tree, "clear_grad")
    assign = _method(tree, "_assign_slice_grad")
    if _calls(assign, "clear_gradient") or _mentions(assign, "grad"):
        raise NotApplicable("_assign_slice_grad already handles a stale slice gradient "
                            "(fixed upstream?)")
    for node in ast.walk(method):
        if isinstance(node, ast.If) and _mentions(node.test, "sd_release_grads") \
                and _calls(node, "_clear_grad_storage"):
            if _mentions(node, "_slice_params"):
                raise NotApplicable("clear_grad already drops the slice parameters' "
                                    "gradients when it frees the storages (fixed upstream?)")
            return _insert_lines(text, node.body[-1].end_lineno + 1, [
                "# slice params still hold a view of the freed grad storage;",
                "# drop it so that the next step binds the new buffer",
                "for slice_param in self._slice_params.values():",
                "    if not hasattr(slice_param, \"main_grad\"):",
                "        slice_param.clear_gradient(False)",
            ], node.body[-1].col_offset)
    raise NotApplicable("clear_grad has no `if self.sd_release_grads ...:` block freeing "
                        "the grad storages (moved or rewritten)")


UB2_TEST = '''\
class TestReleasedGradientsRebindSliceGradients(unittest.TestCase):
    """With release_gradients, clear_grad() frees the grad storages; the
    slice parameters must not keep a gradient pointing at the freed storage
    (FusedCommBuffer.assign_slice_grad asserts that an existing slice
    gradient shares the new buffer, so the second step would fail)."""

    def test_slice_gradient_is_dropped(self):
        param = paddle.create_parameter([4], "float32")
        slice_param = paddle.create_parameter([1], "float32")
        slice_param._copy_gradient_from(paddle.ones([2]))  # last step's view
        opt = _bare_optimizer(
            sd_release_grads=True,
            _slice_params={param.name: slice_param},
        )
        opt.clear_grad()
        self.assertIsNone(slice_param.grad)
'''

FIXES = (
    BugFix(
        "UB-1", "clear_grad() detaches parameter gradients from the fused comm buffers",
        _fix_clear_grad_in_place, UB1_TEST,
        {"what": "`clear_grad(set_to_zero=True)` calls `p.clear_gradient(True)` for every "
                 "parameter without `main_grad` unless `tensor_fusion` is on. The gradients "
                 "of those parameters are views into a `FusedCommBuffer` (every element-wise "
                 "parameter; the Muon ones with `comm_buffer_size_MB > 0`, the default 256). "
                 "`clear_gradient(True)` marks the gradient fake-empty, so the next backward "
                 "replaces it by a fresh tensor: from the second step on the buffers hold "
                 "zeros, the Muon owner steps with its own unreduced gradient and every "
                 "AdamW slice with zero. Training silently diverges.",
         "reproduce": "python -c \"import paddle; p = paddle.create_parameter([4], "
                      "'float32'); buf = paddle.zeros([4]); p._copy_gradient_from(buf); "
                      "(2 * p).sum().backward(); p.clear_gradient(True); "
                      "(3 * p).sum().backward(); print('buffer', buf.numpy())\"",
         "expected": "`buffer [3. 3. 3. 3.]` (what `p.grad.zero_()` gives)",
         "got": "`buffer [0. 0. 0. 0.]`",
         "change": "`clear_grad` zeroes a gradient held in a comm buffer in place, as its "
                   "`tensor_fusion` branch already does (not with `release_gradients`, "
                   "where the buffers are rebuilt every step)."}),
    BugFix(
        "UB-2", "release_gradients without main_grad fails on the second step",
        _fix_release_drops_slice_grads, UB2_TEST,
        {"what": "With `release_gradients` and fp32 gradients, `clear_grad` frees each comm "
                 "buffer's grad storage but leaves every slice parameter's `grad` pointing "
                 "at it; on the next step `FusedCommBuffer.assign_slice_grad` asserts "
                 "`slice_param.grad._is_shared_buffer_with(slice_grad)`.",
         "reproduce": "train two steps with `hybrid_configs['sharding_configs']."
                      "release_gradients = True` and a model without `main_grad`",
         "expected": "the second step runs (as the first does)",
         "got": "`AssertionError` in `assign_slice_grad` at step 2 on every rank",
         "change": "`clear_grad` clears the gradient of every slice parameter without "
                   "`main_grad` when it frees the grad storages."}),
)


def apply_fixes(text: str, fixes=FIXES) -> FixOutcome:
    """Apply every fix that finds its code; the others are skipped with the reason."""
    out = FixOutcome(text)
    for fix in fixes:
        try:
            new = fix.apply(out.text)
            ast.parse(new)  # an edit must leave valid Python
        except NotApplicable as why:
            out.skipped.append((fix, str(why)))
            continue
        out.text = new
        out.applied.append(fix)
    return out


# ----------------------------------------------------------------- the tests
TEST_HEADER = '''\
# Copyright (c) {year} PaddlePaddle Authors. All Rights Reserved.
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
"""MuonShardingOptimizer.clear_grad() keeps gradients usable by the next step.

Single process: the optimizer is built without its constructor (no process
group needed) and given only the attributes clear_grad() reads.
"""

import unittest

import numpy as np

import paddle
from {module} import (
    MuonShardingOptimizer,
)


def _bare_optimizer(**attrs):
    """A MuonShardingOptimizer with the state clear_grad() reads, no groups."""
    opt = MuonShardingOptimizer.__new__(MuonShardingOptimizer)
    state = {{
        "_inner_opt": object(),
        "_parameter_list": [],
        "tensor_fusion": False,
        "sd_release_grads": False,
        "pp_overlap": False,
        "_use_fuse_gradients": True,
        "_slice_params": {{}},
        "_comm_buffer_list": [],
        "comm_buffer_2d": [],
    }}
    state.update(attrs)
    opt.__dict__.update(state)
    return opt

'''


def render_tests(fixes, year: int | None = None) -> str:
    """The unittest module for ``fixes`` (one class each), Paddle's header."""
    year = year or datetime.date.today().year
    body = "\n\n".join(f.test_class for f in fixes)
    return (TEST_HEADER.format(year=year, module=OPTIMIZER_MODULE) + "\n" + body
            + '\n\nif __name__ == "__main__":\n    unittest.main()\n')


def render_notes(outcome: FixOutcome, sizes: str) -> str:
    """Per bug: what, reproduction, expected vs got, the change, the test."""
    out = ["# MuonShardingOptimizer fixes", "",
           "Each fix below is the smallest change to develop's "
           "`python/paddle/distributed/fleet/meta_optimizers/muon_sharding_optimizer.py` "
           f"that fixes the bug; `{TEST_PATH}` holds a test per bug that fails "
           "without the change and passes with it.", "", "```", sizes, "```", ""]
    for fix in outcome.applied:
        n = fix.notes
        cls = fix.test_class.split("(", 1)[0].split()[-1]
        out += [f"## {fix.bug}: {fix.title}", "", f"**What.** {n['what']}", "",
                "**Reproduce.**", "", f"    {n['reproduce']}", "",
                f"**Expected vs got.** Expected {n['expected']}; got {n['got']}.", "",
                f"**Change.** {n['change']}", "",
                f"**Test.** `{TEST_PATH}::{cls}`.", ""]
    for fix, reason in outcome.skipped:
        out += [f"## {fix.bug}: left out", "", f"{fix.title}: develop's text no longer "
                f"matches: {reason}.", ""]
    return "\n".join(out)


# ----------------------------------------------------------------- the export
def build_fixes_export(ep, paddle_root: str):
    """The fixes patch for the checkout at ``paddle_root`` (data only).

    Args:
        ep: the exporter module (its Export / Change / testslist helpers).
        paddle_root: a tree holding develop's optimizer and the testslist.

    Returns:
        (ep.Export, FixOutcome).

    Raises:
        ep.ExportError: no fix applies, the tree already has the test
            module, or the fixes change more than MAX_PRODUCT_LINES lines.
    """
    target = ep.PaddleTree(paddle_root)
    rel = OPTIMIZER_RELPATH
    old = target.read(rel)
    outcome = apply_fixes(old)
    if not outcome.applied:
        raise ep.ExportError("no fix applies to %s: %s" % (rel, "; ".join(
            "%s: %s" % (f.bug, why) for f, why in outcome.skipped)))
    if target.exists(TEST_PATH):
        raise ep.ExportError("%s already exists in the tree; the fixes patch adds it" % TEST_PATH)
    ex = ep.Export(target=target.describe())
    ex.changes[rel] = ep.Change(rel, outcome.text, old, None, target.mode(rel))
    ex.changes[TEST_PATH] = ep.Change(TEST_PATH, render_tests(outcome.applied))
    name = TEST_PATH.rsplit("/", 1)[1][:-3]
    row = ep.testslist_row(name, ep.TestMeta(TEST_TIMEOUT, frozenset({"CPU"}), True))
    ex.test_rows.append((TEST_PATH.rsplit("/", 1)[0], row))
    listed = ep.TESTSLIST_DIRS[0] + "/" + ep.TESTSLIST_NAME
    text, _added, _present = ep.add_testslist_rows(target.read(listed), [row])
    ex.changes[listed] = ep.Change(listed, text, target.read(listed), None, target.mode(listed))
    changed = sum(a + r for path, _st, a, r in ep.patch_stats(ex) if path == rel)
    if changed > MAX_PRODUCT_LINES:
        raise ep.ExportError("the fixes change %d lines of %s (at most %d)"
                             % (changed, rel, MAX_PRODUCT_LINES))
    return ex, outcome


def render_fixes_patch(ep, ex, outcome: FixOutcome, author: str) -> str:
    """A ``git am``-able patch: subject and body as a Paddle PR would word them."""
    now = datetime.datetime.now(datetime.timezone.utc)
    bugs = outcome.applied
    subject = ("Fix MuonShardingOptimizer.clear_grad: "
               + "; ".join(f.title for f in bugs))
    if len(subject) > 100:
        subject = "Fix %d bugs of MuonShardingOptimizer.clear_grad" % len(bugs)
    out = ["From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001",
           "From: %s" % author, "Date: %s" % now.strftime("%a, %d %b %Y %H:%M:%S +0000"),
           "Subject: [PATCH] %s" % subject, ""]
    for fix in bugs:
        out += ["* %s: %s" % (fix.title, fix.notes["change"]), ""]
    out += ["Tests: %s (one class per bug; each fails without the change)." % TEST_PATH,
            "", "---"]
    out += [" %s" % path for path in sorted(ex.changes)]
    out += [" %d files changed" % len(ex.changes), ""]
    for path in sorted(ex.changes):
        out += ep.render_file_diff(ex.changes[path])
    out += ["-- ", "2.39.0", ""]
    return "\n".join(out)
