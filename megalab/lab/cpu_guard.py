"""An endless loop in a learner's code becomes a verdict in seconds, with its line — on any machine load.

While grading, each test (and each rank a test starts) may burn at most `MEGALAB_CPU_LIMIT` seconds of CPU time
(this process's, all threads; a waiting rank burns none). Past it, `EndlessLoop` is raised wherever the code
is, so the traceback ends at the learner's line. CPU time, not wall time: a loaded machine only makes the same
CPU seconds take longer, it never turns a right answer into a timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

ENV = "MEGALAB_CPU_LIMIT"
CPU_LIMIT = 30.0  # seconds of CPU per test while grading: every exercise's checks need a fraction of it


class EndlessLoop(BaseException):  # not an Exception: a learner's `except Exception:` must not swallow it
    """The code ran past its CPU budget: an endless loop (or far too much work for the check's tiny inputs)."""


def _where(frame) -> str:
    """The innermost line of megalab's code (the learner's) that was running, else the innermost line."""
    first = frame
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/megalab/" in path:
            return f"{path[path.rindex('/megalab/') + 1:]}:{frame.f_lineno} (in {frame.f_code.co_name})"
        frame = frame.f_back
    return f"{first.f_code.co_filename}:{first.f_lineno}" if first is not None else "?"


@contextlib.contextmanager
def cpu_limit(seconds: float | None):
    """Raise EndlessLoop in this (main) thread once the process has used `seconds` more CPU (None/0: no limit)."""
    if not seconds or not hasattr(signal, "setitimer") or sys.platform == "win32":
        yield
        return

    def stop(signum, frame):
        raise EndlessLoop(f"still running after {seconds:g} s of CPU time at {_where(frame)}: an endless loop? "
                          "(a while loop whose condition never changes, or a counter never advanced)")

    previous = signal.signal(signal.SIGPROF, stop)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


def from_env() -> float | None:
    """The limit a grading run hands down to the ranks it launches."""
    value = os.environ.get(ENV)
    return float(value) if value else None
