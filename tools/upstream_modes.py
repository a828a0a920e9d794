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
"""The exporter's three modes: the tree each needs, and what Paddle receives.

* ``tests-only``: a tree holding ``test/collective/fleet/testslist.csv``
  (Paddle's header, :data:`TESTSLIST_HEADER`); with ``python/paddle/`` too,
  every ``paddle`` import of the tests is checked against it.
* ``fixes``: develop's ``muon_sharding_optimizer.py`` and the testslist.
* ``full``: a Paddle checkout (``python/paddle/``, the strategy proto and
  docs, the testslist).

:func:`missing_for` names what a tree lacks for a mode (checked before any
slow work); :func:`scrub` rewrites the text Paddle receives so that it reads
as Paddle's own (copyright holder, no marker lines, no package name).
"""

from __future__ import annotations

import os
import re
import subprocess

import upstream_fixes

TESTSLIST = "test/collective/fleet/testslist.csv"
TESTSLIST_HEADER = ("name,os,arch,timeout,run_type,launcher,num_port,run_serial,"
                    "envs,conditions")
OPTIMIZER = upstream_fixes.OPTIMIZER_RELPATH
PROTO = "paddle/fluid/framework/distributed_strategy.proto"
STRATEGY_DOC = "python/paddle/distributed/fleet/base/distributed_strategy.py"

#: mode -> the paths its tree must hold (a trailing "/" is a directory).
NEEDS = {
    "tests-only": (TESTSLIST,),
    "fixes": (OPTIMIZER, TESTSLIST),
    "full": ("python/paddle/", PROTO, STRATEGY_DOC, TESTSLIST),
}
PACKAGE = "paddle_muon_ext"


def missing_for(mode: str, root: str) -> str | None:
    """One line naming what ``root`` lacks for ``mode``, or None when it is usable."""
    missing = [rel for rel in NEEDS[mode]
               if not (os.path.isdir(os.path.join(root, rel)) if rel.endswith("/")
                       else os.path.isfile(os.path.join(root, rel)))]
    if missing:
        header = f" (first line {TESTSLIST_HEADER!r})" if TESTSLIST in missing else ""
        return (f"--paddle-root {root!r} lacks {', '.join(missing)}{header}; the {mode} mode "
                f"needs a tree holding {', '.join(NEEDS[mode])}")
    with open(os.path.join(root, TESTSLIST), encoding="utf-8") as f:
        first = f.readline().strip()
    if first != TESTSLIST_HEADER:
        return (f"{os.path.join(root, TESTSLIST)} starts with {first!r}; Paddle's header is "
                f"{TESTSLIST_HEADER!r}")
    return None


def unchecked_imports_note(mode: str, root: str) -> str | None:
    """Tests-only on a tree without ``python/paddle/__init__.py`` (none, or a sparse
    copy of a few files): say the import checks do not run."""
    if mode == "tests-only" and not os.path.isfile(
            os.path.join(root, "python", "paddle", "__init__.py")):
        return (f"note: {root} has no python/paddle/__init__.py: the tests' paddle imports "
                "are not checked against develop (pass a full checkout to check them)")
    return None


_HEADER_RE = re.compile(r"(?m)^(#\s*Copyright \(c\) \d{4}) %s Authors" % PACKAGE)
_MARKER_RE = re.compile(r"(?m)^[ \t]*# %s: [\w-]+[^\n]*\n" % PACKAGE)
_POSSESSIVE_RE = re.compile(r"\b%s's\s+" % PACKAGE)
_NAME_RE = re.compile(r"(?<![\w/.])`{0,2}%s`{0,2}(?![\w/])" % PACKAGE)


def scrub(text: str) -> str:
    """Text as Paddle receives it: ``PaddlePaddle Authors`` in the copyright
    line, the package's marker lines (``# paddle_muon_ext: ...``) removed,
    and any remaining mention of the package in prose replaced by Paddle's."""
    text = _HEADER_RE.sub(r"\1 PaddlePaddle Authors", text)
    text = _MARKER_RE.sub("", text)
    text = _POSSESSIVE_RE.sub("", text)
    return _NAME_RE.sub("paddle", text)


def git_author(cwd: str) -> str | None:
    """``Name <email>`` from git's author identity in ``cwd``, None when unset."""
    try:
        ident = subprocess.run(["git", "var", "GIT_AUTHOR_IDENT"], cwd=cwd, check=True,
                               capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    m = re.match(r"(.+? <[^>]*>)", ident.strip())
    return m.group(1) if m else None
