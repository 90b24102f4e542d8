"""What runs inside every rank that `megalab.lab.launch` starts.

torchrun starts `python -m megalab.lab.worker CELL.py` once per rank. The worker

    1. ties its life to torchrun's (PR_SET_PDEATHSIG), so no rank outlives its launcher;
    2. sends its stdout/stderr (file descriptors 1 and 2, so C++ output too) to files of its own:
       RUN_DIR/rank{k}.out and rank{k}.err, which the launcher prints grouped by rank;
    3. arms faulthandler: SIGUSR1 dumps every thread's Python stack to rank{k}.stack (how a
       timed-out, deadlocked cell shows where each rank was stuck), and so do fatal signals;
    4. runs the cell (with a named mistake swapped in first when MEGALAB_MUTANT says so: the course's
       own mutation tests, megalab/lab/mutate.py); an exception is written to rank{k}.error.json for the launcher to raise;
    5. marks rank{k}.done (listing the values it published, so a launcher on another node knows which
       files to wait for on a shared filesystem), then tears down in order (barrier,
       destroy_process_group) and leaves with os._exit, skipping the C++ destructors that sometimes
       abort a finished gloo rank.

Under Slurm, `python -m megalab.lab.worker --node-agent RUN_DIR -- TORCHRUN...` is what srun starts on
each node (`node_agent`): it runs that node's torchrun and stops it, ranks included, when the launcher
asks through the shared run dir (RUN_DIR/stop) or Slurm signals the step, so no rank outlives a timeout
on a node the launcher cannot reach. It also reports its ranks' CPU time (RUN_DIR/node{N}.cpu) and has them
dump their stacks when asked (RUN_DIR/dump): the launcher judges timeouts from every node.
"""

import ctypes
import faulthandler
import json
import linecache
import os
import signal
import socket
import subprocess
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
        "node": os.environ.get("SLURMD_NODENAME", ""),  # under Slurm, which node (the launcher names it)
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
    if os.environ.get("MEGALAB_MUTANT"):  # the course's own mutation tests (megalab/lab/mutate.py)
        from megalab.lab.mutate import apply_from_env

        apply_from_env()
    namespace = {"__name__": "__main__", "__file__": cell_path, "__builtins__": __builtins__}
    sys.argv = [cell_path]
    from megalab.lab.cpu_guard import cpu_limit, from_env

    try:
        with cpu_limit(from_env()):  # set while grading: an endless loop becomes an error at its line
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

    published = sorted(p.name for p in (run_dir / "publish").glob(f"*.rank{rank}.pkl"))
    (run_dir / f"rank{rank}.done").write_text(json.dumps(published))
    _teardown()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------- the per-node agent (Slurm)
AGENT_POLL = 0.2  # seconds between looks at RUN_DIR/stop


def _descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` on this node (from /proc parent links)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                ppid = int(Path(entry.path, "stat").read_bytes().rpartition(b")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo += children.get(child, [])
    return found


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid` and all its descendants (ranks have sessions of their own: walk the parent links)."""
    for _ in range(50):
        victims = [*_descendants(pid), pid]
        alive = False
        for victim in victims:
            try:
                os.kill(victim, signal.SIGKILL)
                alive = True
            except ProcessLookupError:
                pass
        if not alive:
            return
        time.sleep(0.05)


def _local_ranks(run_dir: Path, torchrun: int) -> dict[int, int]:
    """{rank: pid} of the ranks this node's torchrun started (pid files are shared by every node)."""
    mine = set(_descendants(torchrun))
    ranks = {}
    for path in run_dir.glob("rank*.pid"):
        try:
            pid = int(path.read_text())
        except (OSError, ValueError):
            continue
        if pid in mine:
            ranks[int(path.name[4:-4])] = pid
    return ranks


def _dump_stacks(run_dir: Path, node: str, host: str, torchrun: int, token: str) -> None:
    """Have this node's ranks dump their stacks (SIGUSR1, faulthandler) and answer in RUN_DIR/node{N}.dumped:
    the ranks and where their new dump starts in rank{k}.stack."""
    ranks = _local_ranks(run_dir, torchrun)
    offsets = {}
    for rank, pid in ranks.items():
        path = run_dir / f"rank{rank}.stack"
        offsets[rank] = path.stat().st_size if path.exists() else 0
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            offsets.pop(rank)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:  # faulthandler writes from its signal handler: fast
        if all((run_dir / f"rank{r}.stack").stat().st_size > o for r, o in offsets.items()):
            break
        time.sleep(0.05)
    _write_json(run_dir / f"node{node}.dumped", {"token": token, "host": host, "ranks": offsets})


def _write_json(path: Path, value) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    tmp.rename(path)


def node_agent(run_dir: Path, cmd: list[str]) -> int:
    """Run this node's torchrun (`cmd`); stop it and its ranks when RUN_DIR/stop appears or on SIGTERM/
    SIGINT/SIGHUP (srun forwards them; scancel sends them). Writes RUN_DIR/node{N}.agent (host, pid, Slurm
    step) when started and RUN_DIR/node{N}.exit (torchrun's exit code) when done.

    Meanwhile it judges its own ranks' CPU time (megalab.lab.launch._NodeMeter) and reports to the launcher,
    which cannot see this node's processes, in RUN_DIR/node{N}.cpu; when the launcher asks for stacks
    (RUN_DIR/dump), it has its ranks dump theirs. The variables the ranks need come from RUN_DIR/agent.json,
    whatever srun passed on."""
    from megalab.lab.launch import SAMPLE_INTERVAL, _NodeMeter

    node = os.environ.get("SLURM_NODEID", "0")
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    stop_requested = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: stop_requested.append(signum))
    env, window = dict(os.environ), 3.0
    try:
        config = json.loads((run_dir / "agent.json").read_text())
        env.update(config["env"])
        window = config["idle_window"]
    except (OSError, ValueError, KeyError):
        pass
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env, preexec_fn=_die_with_parent)
    step = f"{os.environ.get('SLURM_JOB_ID', '')}.{os.environ.get('SLURM_STEP_ID', '')}"
    (run_dir / f"node{node}.agent").write_text(json.dumps({"host": host, "pid": os.getpid(), "step": step}))
    meter = _NodeMeter(proc.pid, run_dir, window)
    start = next_sample = time.monotonic()
    dumped, started = "", False
    while proc.poll() is None:
        if stop_requested or (run_dir / "stop").exists():
            _kill_tree(proc.pid)
            break
        now = time.monotonic()
        if now >= next_sample:
            started = started or bool(_local_ranks(run_dir, proc.pid))  # rank processes are up here
            meter.sample(now - start, with_launchers=not started)
            _write_json(run_dir / f"node{node}.cpu", {**meter.report(), "host": host})
            next_sample = now + SAMPLE_INTERVAL
        try:
            token = (run_dir / "dump").read_text()
        except OSError:
            token = dumped
        if token != dumped:
            _dump_stacks(run_dir, node, host, proc.pid, token)
            dumped = token
        time.sleep(AGENT_POLL)
    code = proc.wait()
    # this node's ranks are gone: they use no CPU, whatever the last report said (other nodes may still run)
    _write_json(run_dir / f"node{node}.cpu", {"busy": False, "cpu": 0.0, "busiest": 0.0, "span": window,
                                               "starting": False, "host": host})
    tmp = run_dir / f"node{node}.exit.tmp"
    tmp.write_text(str(code))
    tmp.rename(run_dir / f"node{node}.exit")
    return code


if __name__ == "__main__":
    if sys.argv[1] == "--node-agent":  # python -m megalab.lab.worker --node-agent RUN_DIR -- CMD...
        sys.exit(min(255, abs(node_agent(Path(sys.argv[2]), sys.argv[4:]))))
    main(sys.argv[1])
