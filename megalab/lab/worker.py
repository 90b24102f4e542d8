"""What runs inside every rank that `megalab.lab.launch` starts.

torchrun starts `python -m megalab.lab.worker CELL.py` once per rank. The worker

    1. ties its life to torchrun's (PR_SET_PDEATHSIG), so no rank outlives its launcher;
    2. sends its stdout/stderr (file descriptors 1 and 2, so C++ output too) to files of its own:
       RUN_DIR/rank{k}.out and rank{k}.err, which the launcher prints grouped by rank;
    3. arms faulthandler: SIGUSR1 dumps every thread's Python stack to rank{k}.stack (how a
       timed-out, deadlocked cell shows where each rank was stuck), and so do fatal signals;
    4. runs the cell; an exception is written to rank{k}.error.json for the launcher to raise;
    5. marks rank{k}.done, then tears down in order (barrier, destroy_process_group) and leaves
       with os._exit, skipping the C++ destructors that sometimes abort a finished gloo rank.
"""

import ctypes
import faulthandler
import json
import linecache
import os
import signal
import sys
import time
import traceback
from pathlib import Path

CELL_FILENAME = "<torchrun cell>"


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when torchrun dies, however torchrun dies."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _redirect(fd: int, path: Path) -> None:
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(target, fd)
    os.close(target)


def _cell_frames(tb) -> list:
    """Frames from the cell onwards: the worker's own frames are noise to the reader."""
    frames = traceback.extract_tb(tb)
    for i, frame in enumerate(frames):
        if frame.filename == CELL_FILENAME:
            return frames[i:]
    return frames


def short_path(filename: str) -> str:
    """A frame's file as a reader needs it, without this machine's folders: `torch/distributed/...` for an
    installed package, `megalab/extras/comm.py` for the course's own code."""
    if "site-packages/" in filename:
        return filename.rsplit("site-packages/", 1)[1]
    package = str(Path(__file__).resolve().parents[2]) + os.sep
    return filename[len(package):] if filename.startswith(package) else filename


def _write_error(run_dir: Path, rank: int, exc: BaseException) -> None:
    frames = _cell_frames(exc.__traceback__)
    for frame in frames:
        frame.filename = short_path(frame.filename)
    lines = ["Traceback (most recent call last):\n"]
    lines += traceback.format_list(frames)
    lines += traceback.format_exception_only(type(exc), exc)
    report = {
        "rank": rank,
        "type": type(exc).__name__,
        "message": str(exc).strip().splitlines()[0] if str(exc).strip() else "",
        "traceback": "".join(lines),
        "time": time.time(),
    }
    tmp = run_dir / f"rank{rank}.error.json.tmp"
    tmp.write_text(json.dumps(report))
    tmp.rename(run_dir / f"rank{rank}.error.json")


def _teardown() -> None:
    """Orderly exit of the default process group, if the cell left one behind."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:  # the cell never imported it: no group, and importing torch now costs seconds
        return
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception:  # the cell's work is done: teardown trouble must not fail it
            pass


def main(cell_path: str) -> None:
    _die_with_parent()
    run_dir = Path(os.environ["MEGALAB_RUN_DIR"])
    rank = int(os.environ.get("RANK", "0"))
    (run_dir / f"rank{rank}.pid").write_text(str(os.getpid()))

    _redirect(1, run_dir / f"rank{rank}.out")
    _redirect(2, run_dir / f"rank{rank}.err")
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    stack_file = open(run_dir / f"rank{rank}.stack", "w")
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)

    source = Path(cell_path).read_text()
    linecache.cache[CELL_FILENAME] = (len(source), None, source.splitlines(True), CELL_FILENAME)
    sys.path.insert(0, os.environ.get("MEGALAB_CWD", os.getcwd()))
    namespace = {"__name__": "__main__", "__file__": cell_path, "__builtins__": __builtins__}
    sys.argv = [cell_path]
    try:
        exec(compile(source, CELL_FILENAME, "exec"), namespace)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _write_error(run_dir, rank, exc)
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(1)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the notebook
        _write_error(run_dir, rank, exc)
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(1)

    (run_dir / f"rank{rank}.done").touch()
    _teardown()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
