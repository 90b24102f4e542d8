"""A private copy of another user's workspace, to grade it without writing a byte into theirs.

`megalab grade` run by an instructor in a learner's workspace (megalab/lab/grading.py) grades this copy: the
notebooks' graded copies, the overlays and the progress file then all live in a temporary folder of the grader's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from megalab.lab.workspace import STATE_DIR


@contextlib.contextmanager
def private_copy(root: Path):
    """A temporary copy of the workspace at `root` (its backups, runs and caches left out), removed afterwards. A file
    the grader cannot read is a RuntimeError naming it, except the learner's progress file (theirs alone)."""
    root = Path(root)
    with tempfile.TemporaryDirectory(prefix="megalab-grade-copy-") as tmp:
        copy = Path(tmp) / root.name

        def ignore(folder, names):
            out = {n for n in names if n in ("__pycache__", ".ipynb_checkpoints", ".git", ".venv")}
            if Path(folder).relative_to(root).as_posix() == STATE_DIR:
                out |= {n for n in names if n in ("backup", "runs")}
            return out

        try:
            shutil.copytree(root, copy, symlinks=True, ignore=ignore)
        except shutil.Error as exc:
            others = [src for src, _, _ in exc.args[0] if Path(src).name != "progress.json"]
            if others:
                raise RuntimeError(f"cannot read {len(others)} file(s) of {root} (first: {others[0]}): grade it as "
                                   "its owner, or make the workspace readable (`chmod -R a+rX WORKSPACE`)") from None
        for folder, _, _ in os.walk(copy):  # a read-only folder of theirs must not stay read-only in our copy
            os.chmod(folder, os.stat(folder).st_mode | 0o700)
        yield copy
