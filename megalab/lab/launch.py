"""Run a piece of Python on N ranks under real torchrun, and bring back what happened.

    run(code, nproc_per_node=4)
        │  writes RUN_DIR/cell.py
        ▼
    python -m torch.distributed.run ... -m megalab.lab.worker RUN_DIR/cell.py
        │  one process per rank (see megalab/lab/worker.py)
        ▼
    RUN_DIR/rank{k}.out .err .pid .stack .done .error.json, RUN_DIR/publish/*.pkl
        │  read back by this module
        ▼
    LaunchResult (output grouped by rank, published values)  or  RankFailedError / LaunchTimeoutError

This is what the `%%torchrun` cell magic calls (megalab/lab/magic.py), and what tests and
benchmarks call directly. Every process it starts is gone when `run` returns or raises.

Timeouts: a slow machine is not a deadlock. `timeout` is when the launcher starts asking whether
the run is stuck; the answer comes from the CPU time (user + system, read through
megalab/lab/procs.py: /proc on Linux, psutil elsewhere) that the ranks and their children use:

    all waiting    no rank (nor child of one) used IDLE_CPU_SHARE of a core over the last
                   `idle_window(timeout)` seconds (3 to 10 s), as ranks blocked in a recv or a
                   collective do: stopped at `timeout`, LaunchTimeoutError kind "deadlock",
                   with every rank's stack (a cell that sleeps past `timeout` counts as waiting);
    computing      the run goes on past `timeout` (the progress line says so, with the load
                   average) until `hard_timeout` (default HARD_TIMEOUT_FACTOR x timeout), then
                   kind "overloaded": still computing, not deadlocked, with the machine's load;
    not started    no rank is up yet: torchrun still starting them counts as computing (a
                   loaded machine is slow to import torch), one that waits is stuck at the
                   rendezvous (several nodes) or before starting them (one node): kind
                   "not started".

A deadlock is not called before `timeout`: a cell may sleep, wait for another node or for a
file, and CPU time cannot tell that from a deadlock. On NCCL a rank waiting for a stuck GPU
collective may spin on the CPU, so there a deadlock can look like "overloaded".

Slurm (`slurm=True`): the run dir lives under `cwd/.megalab/runs`, which every node must share; one
srun step per cell (`srun --export=ALL --job-name megalab-NAME`) starts one agent per node
(megalab.lab.worker.node_agent), which runs torchrun there with the variables of RUN_DIR/agent.json (so a
job submitted with --export=NONE still gives the ranks their run dir and PYTHONPATH). The launcher cannot
see other nodes' processes: each agent judges its own ranks' CPU time (_NodeMeter) and reports it in
RUN_DIR/node{N}.cpu; the run waits (a deadlock, once past `timeout`) only when every node says so, and
the stacks of a stopped run come from every node's agent (RUN_DIR/dump). To stop a run, the launcher
asks the agents (RUN_DIR/stop), then srun, then scancel: killing srun alone would leave the other nodes'
ranks running. After srun ends, the launcher waits (bounded) until every node's exit file and every
rank's results are visible on the shared filesystem. Run folders whose launcher is gone (a restarted
kernel) are removed by the next --slurm run.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megalab.lab import procs
from megalab.lab.tracebacks import short_path

DEFAULT_TIMEOUT = 300.0
HARD_TIMEOUT_FACTOR = 3.0  # ranks still computing are stopped at 3 x timeout unless told otherwise
IDLE_CPU_SHARE = 0.05  # a process using less than 5% of a core is waiting (a blocked gloo rank: ~0.5%)
SAMPLE_INTERVAL = 0.5  # seconds between CPU samples (and progress lines)
FAILURE_GRACE = 3.0  # seconds torchrun gets to stop the other ranks after one fails
# c10/glog-style native log lines ("[W1121 08:00:00.123 1234 file.cpp:12] ...", optionally
# prefixed "[rank0]:"): timestamped noise, kept in the run dir but not printed on success.
_NATIVE_LOG = re.compile(r"^(\[rank\d+\]:)?\[[IWE]\d{4} ")


class LaunchError(RuntimeError):
    """The launch itself cannot go ahead (bad arguments, missing GPUs, torchrun failed)."""

    def _render_traceback_(self) -> list[str]:  # the message says what to do; the launcher's frames don't help
        return [f"LaunchError: {self}"]


class _RankError(RuntimeError):
    """Base for errors that IPython shows as our own text instead of the launcher's frames."""

    def __init__(self, summary: str, details: str):
        super().__init__(summary)
        self.details = details

    def _render_traceback_(self) -> list[str]:  # IPython's hook for custom tracebacks
        from megalab.lab.exercises import needs_first

        needs = needs_first(self.details)
        if needs:  # a blank exercise region raised: its line and where it is taught, not the frames that reached it
            raised = [line for line in self.details.splitlines() if "NotImplementedError: exercise " in line][-1:]
            return [f"{type(self).__name__}: {self}", *raised, needs]
        return [f"{type(self).__name__}: {self}", *self.details.rstrip().splitlines()]


class RankFailedError(_RankError):
    """A rank raised (or died); `rank` is the first one to fail, `details` its traceback."""

    def __init__(self, rank: int, summary: str, details: str):
        super().__init__(summary, details)
        self.rank = rank


class LaunchTimeoutError(_RankError, TimeoutError):
    """The ranks ran past the timeout; `stacks` holds each rank's Python stack when stopped.

    `kind` says why (see the module docstring): "deadlock" (every rank waiting), "overloaded"
    (still computing at the hard timeout) or "not started" (no rank came up).
    """

    KINDS = ("deadlock", "overloaded", "not started")

    def __init__(self, summary: str, details: str, stacks: dict[int, str], kind: str = "deadlock"):
        super().__init__(summary, details)
        if kind not in self.KINDS:
            raise ValueError(f"kind must be one of {self.KINDS}, not {kind!r}")
        self.stacks = stacks
        self.kind = kind


@dataclass
class LaunchResult:
    world_size: int
    stdout: dict[int, str]  # rank -> what it printed, progress redraws removed
    stderr: dict[int, str]
    results: dict[str, dict[int, Any]]  # name -> {rank: value} from megalab.lab.dist.publish
    elapsed: float
    run_dir: Path
    ranks_shown: list[int] = field(default_factory=list)

    @property
    def returns(self) -> dict[int, Any]:
        """What `run_function`'s function returned on each rank."""
        return self.results.get("returns", {})

    def text(self, stream: str = "stdout") -> str:
        """The output of the shown ranks, grouped in rank order, `[rank k] ` prefixed."""
        return format_rank_output(getattr(self, stream), self.ranks_shown)


# --------------------------------------------------------------------------- arguments


def resolve_backend(backend: str, nproc_per_node: int) -> str:
    """auto: NCCL when this node has a CUDA device for every local rank, else gloo (CPU)."""
    if backend not in ("auto", "gloo", "nccl"):
        raise LaunchError(f"unknown backend {backend!r}: use auto, gloo or nccl")
    if backend == "gloo":
        return backend
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= nproc_per_node else "gloo"
    if gpus == 0:
        raise LaunchError(
            "--backend nccl runs on GPUs, and this machine has none (torch.cuda.is_available() is False). "
            "Use --backend gloo (or auto) to run the cell on CPU here, or run it on a GPU node."
        )
    if gpus < nproc_per_node:
        raise LaunchError(
            f"--backend nccl needs {nproc_per_node} CUDA devices on this node (one per rank), "
            f"but {gpus} {'is' if gpus == 1 else 'are'} visible. Start at most {gpus} "
            f"rank{'s' if gpus != 1 else ''} per node (-n {gpus}), or use --backend gloo (or auto) to run "
            f"{nproc_per_node} ranks on CPU."
        )
    return backend


def parse_ranks(ranks: str | list[int], world_size: int) -> list[int]:
    """'all' | '0' | '0,2' -> sorted rank list, checked against the world size."""
    if isinstance(ranks, str):
        if ranks.strip() == "all":
            return list(range(world_size))
        try:
            ranks = [int(r) for r in ranks.split(",") if r.strip()]
        except ValueError:
            raise LaunchError(f"--ranks takes 'all' or rank numbers like '0' or '0,2', not {ranks!r}") from None
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad or not ranks:
        raise LaunchError(f"--ranks {ranks}: ranks must lie in 0..{world_size - 1}")
    return sorted(set(ranks))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def available_cpus() -> int:
    """The cores this process may run on (its affinity: a Slurm task or a container gets fewer than cpu_count)."""
    return procs.available_cpus()


def slurm_cpus_per_node() -> int:
    """Cores for the ranks of one node in a Slurm allocation: the job's --cpus-per-task, else the CPUs the job
    holds on this node (SLURM_CPUS_ON_NODE in a job, SLURM_JOB_CPUS_PER_NODE as salloc gives it: "4(x2)"),
    else what this process may use. Never more than the job holds: srun would refuse the step."""
    held = os.environ.get("SLURM_CPUS_PER_TASK") or os.environ.get("SLURM_CPUS_ON_NODE")
    if not held and (m := re.match(r"\d+", os.environ.get("SLURM_JOB_CPUS_PER_NODE", ""))):
        held = m.group(0)
    return int(held or available_cpus())


def slurm_rdzv_endpoint(nodes: list[str]) -> str:
    """Where the ranks meet: a free port on this node when it is part of the allocation (the notebook's
    kernel usually runs on the first node; Slurm names it in SLURMD_NODENAME), else on the first node a port
    derived from SLURM_JOB_ID (so two jobs sharing a node do not collide). The host must resolve on every node:
    a name that does not resolve here is a LaunchError at once, not a rendezvous that waits for the timeout."""
    here = socket.gethostname().split(".")[0]
    short = [n.split(".")[0] for n in nodes]
    if os.environ.get("SLURMD_NODENAME", here).split(".")[0] in short or here in short:
        return f"{here}:{free_port()}"
    host = nodes[0]
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        raise LaunchError(
            f"the first node of the allocation, {host!r}, does not resolve from {here} (the ranks meet there): "
            "run the notebook on a node of the allocation (sbatch course/slurm/jupyterlab.sbatch), or ask the "
            "cluster's admins why node names do not resolve on this machine (`megalab doctor --slurm` checks)"
        ) from None
    return f"{host}:{20000 + int(os.environ.get('SLURM_JOB_ID', '0')) % 20000}"


def slurm_step_name(name: str | None) -> str:
    """The Slurm step name of a cell (`sacct`, `squeue --steps`): megalab-<notebook/cell>, Slurm-safe characters."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", name or "cell").strip("-") or "cell"
    return f"megalab-{safe}"[:64]


def slurm_nodes() -> list[str]:
    """Hostnames of the current Slurm allocation, in Slurm's order."""
    if "SLURM_JOB_ID" not in os.environ:
        raise LaunchError("--slurm needs a Slurm allocation: run inside `salloc`/`sbatch` (SLURM_JOB_ID is unset)")
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"--slurm needs Slurm's scontrol to list the allocation's nodes: {exc}") from None
    if out.returncode != 0 or not out.stdout.split():
        raise LaunchError(f"`scontrol show hostnames {nodelist}` failed: {out.stderr.strip() or out.returncode}")
    return out.stdout.split()


def torchrun_command(
    script: Path,
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    slurm: bool = False,
    name: str | None = None,
) -> list[str]:
    """The command line: torchrun (single node, static multi-node, c10d multi-node or srun)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}", "--max-restarts=0"]
    if slurm:  # srun starts one agent per node (megalab.lab.worker.node_agent), which runs torchrun there
        nodes = slurm_nodes()
        nnodes = len(nodes)
        endpoint = rdzv_endpoint or slurm_rdzv_endpoint(nodes)
        job = os.environ["SLURM_JOB_ID"]
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id=megalab-{job}"]
        cmd += ["-m", "megalab.lab.worker", str(script)]
        agent = [sys.executable, "-m", "megalab.lab.worker", "--node-agent", str(script.parent), "--"]
        # --export=ALL: a job submitted with --export=NONE (batchspawner's default) passes that on to its sruns;
        # what the ranks need also travels in RUN_DIR/agent.json, which the agents read (see _write_agent_config)
        return ["srun", f"--nodes={nnodes}", f"--ntasks={nnodes}", "--ntasks-per-node=1",
                f"--cpus-per-task={slurm_cpus_per_node()}", "--overlap", "--kill-on-bad-exit=1", "--export=ALL",
                f"--job-name={slurm_step_name(name)}", *agent, *cmd]
    elif nnodes == 1 and rdzv_endpoint is None:
        # torchrun binds a free port itself (parallel launches never collide), on loopback: the rendezvous then
        # never depends on what the hostname resolves to (on many Macs a Wi-Fi address, or nothing)
        cmd += ["--standalone", f"--local-addr={os.environ.get('MASTER_ADDR', '127.0.0.1')}"]
    else:
        if rdzv_endpoint is None:
            raise LaunchError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the node that hosts the rendezvous)")
        if node_rank is not None:  # static rendezvous: each node says which one it is
            host, _, port = rdzv_endpoint.rpartition(":")
            cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={host}", f"--master-port={port}"]
        else:
            cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", "--rdzv-id=megalab"]
    return cmd + ["-m", "megalab.lab.worker", str(script)]


# --------------------------------------------------------------------------- output


def clean_progress(text: str) -> str:
    """Drop lines that redraw themselves with '\\r' (tqdm bars): live-only, never deterministic."""
    lines = text.split("\n")  # not splitlines(): that splits at '\r' too
    return "\n".join(line for line in lines if "\r" not in line.rstrip("\r"))


def format_rank_output(texts: dict[int, str], ranks: list[int]) -> str:
    """Group output in rank order; prefix each line with `[rank k] ` when several ranks show."""
    prefix = len(ranks) > 1
    out = []
    for r in ranks:
        for line in texts.get(r, "").splitlines():
            out.append(f"[rank {r}] {line}" if prefix else line)
    return "\n".join(out) + ("\n" if out else "")


def _last_line(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 4096))
            tail = f.read().decode(errors="replace")
    except OSError:
        return ""
    parts = [p.strip() for p in re.split(r"[\r\n]", tail) if p.strip()]
    return parts[-1] if parts else ""


# --------------------------------------------------------------------------- processes


def _rank_files(run_dir: Path, suffix: str) -> dict[int, Path]:
    files = {}
    for path in run_dir.glob(f"rank*.{suffix}"):
        m = re.fullmatch(rf"rank(\d+)\.{re.escape(suffix)}", path.name)
        if m:
            files[int(m.group(1))] = path
    return files


def _rank_pids(run_dir: Path) -> dict[int, int]:
    pids = {}
    for rank, path in _rank_files(run_dir, "pid").items():
        try:
            pids[rank] = int(path.read_text())
        except ValueError:
            continue
    return pids


def _is_our_worker(pid: int, run_dir: Path) -> bool:
    """Guard against PID reuse: the process must still be a worker of this run."""
    return str(run_dir).encode() in procs.cmdline(pid)


def _alive_workers(run_dir: Path) -> dict[int, int]:
    return {r: p for r, p in _rank_pids(run_dir).items() if _is_our_worker(p, run_dir)}


_Processes = procs.Processes  # pid -> (parent pid, CPU seconds, command line)


def _processes() -> _Processes:
    """Every process on this machine (megalab/lab/procs.py: /proc on Linux, psutil elsewhere)."""
    return procs.processes()


def _run_processes(run_dir: Path) -> list[int]:
    """Every live process of this run, found by the run dir in its command line.

    Pid files are not enough: a rank still starting up when we stop the run has not written one.
    """
    marker = str(run_dir).encode()
    return [pid for pid, (_, _, cmdline) in _processes().items() if marker in cmdline]


def _run_tree(table: _Processes, launcher: int, run_dir: Path, with_launchers: bool) -> set[int]:
    """The run's processes in `table`: the launcher (torchrun or srun), those with the run dir in
    their command line (torchrun, the ranks) and all their descendants (a rank's DataLoader
    workers, compile jobs). Without the launchers, unless asked: torchrun's monitoring loop uses
    a little CPU all the time, which is no progress of the cell."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    marker = str(run_dir).encode()
    todo = [launcher, *(pid for pid, (_, _, cmdline) in table.items() if marker in cmdline)]
    tree: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid in table and pid not in tree:
            tree.add(pid)
            todo += children.get(pid, [])
    if with_launchers:
        return tree
    return {pid for pid in tree if pid != launcher and b"torch.distributed.run" not in table[pid][2]}


def _kill_all(proc: subprocess.Popen, run_dir: Path) -> None:
    """SIGKILL torchrun's session, then every rank (each rank has a session of its own)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    deadline = time.monotonic() + 5
    while (pids := _run_processes(run_dir)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


SLURM_STOP_GRACE = 15.0  # seconds the node agents get to stop their ranks after RUN_DIR/stop appears
SHARED_FS_WAIT = 60.0  # seconds other nodes' files may take to show on a shared filesystem (NFS caches)


def _wait_exit(proc: subprocess.Popen, seconds: float) -> bool:
    try:
        proc.wait(timeout=seconds)
        return True
    except subprocess.TimeoutExpired:
        return False


def _stop_slurm_step(proc: subprocess.Popen, run_dir: Path) -> None:
    """Stop the ranks on every node before srun itself goes (SIGKILL to srun leaves remote ranks running):
    ask each node's agent through the shared run dir (RUN_DIR/stop), then srun (two SIGINTs within a
    second end the step), then scancel the step the agents reported."""
    if proc.poll() is not None:
        return
    (run_dir / "stop").touch()
    if _wait_exit(proc, SLURM_STOP_GRACE):
        return
    for _ in range(2):
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
    if _wait_exit(proc, 5.0):
        return
    steps = set()
    for path in run_dir.glob("node*.agent"):
        with contextlib.suppress(ValueError, OSError):
            steps.add(json.loads(path.read_text())["step"])
    if shutil.which("scancel"):
        for step in sorted(s for s in steps if s.strip(".")):
            subprocess.run(["scancel", step], capture_output=True, timeout=30)
    _wait_exit(proc, 5.0)


RANK_ENV = ("MEGALAB_RUN_DIR", "MEGALAB_BACKEND", "MEGALAB_CWD", "PYTHONPATH", "PYTHONUNBUFFERED", "MPLBACKEND",
            "OMP_NUM_THREADS")  # what the ranks need from the launcher, whatever the job's export setting
STALE_RUN_AGE = 24 * 3600.0  # seconds after which a run folder of another host counts as abandoned


def _write_agent_config(run_dir: Path, child_env: dict[str, str], extra: dict[str, str], window: float) -> None:
    """RUN_DIR/agent.json for the node agents: the variables the ranks need (passed explicitly, so a job whose
    srun exports nothing still runs) and the idle window each agent judges its ranks' CPU time by. Also
    RUN_DIR/launcher.json (host, pid), by which a later launch knows a run folder whose launcher is gone."""
    needed = {k: v for k, v in child_env.items() if k in RANK_ENV or k in extra or k.startswith("MEGALAB_")}
    (run_dir / "agent.json").write_text(json.dumps({"env": needed, "idle_window": window}))
    (run_dir / "launcher.json").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))


def _clean_stale_runs(base: Path) -> None:
    """Remove run folders their launcher left behind (a kernel restarted, killed, or cut off mid-cell): this
    host's whose launcher process is gone, other hosts' after STALE_RUN_AGE. Live runs, ours or another
    kernel's, are left alone."""
    here = socket.gethostname()
    for run_dir in base.glob("megalab-run-*"):
        try:
            owner = json.loads((run_dir / "launcher.json").read_text())
            age = time.time() - run_dir.stat().st_mtime
        except (OSError, ValueError):
            continue  # not ours to judge (or still being written)
        if owner.get("host") == here:
            if _pid_alive(int(owner.get("pid", 0))):  # a live kernel's run (a reused pid keeps a folder: harmless)
                continue
        elif age < STALE_RUN_AGE:
            continue
        shutil.rmtree(run_dir, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _missing_node_files(run_dir: Path, nnodes: int, world: int) -> list[str]:
    """What the run dir still lacks of a finished multi-node run: each node agent's exit file, each rank's
    .done (or .error.json), and the values each .done lists as published."""
    missing = [f"node{k}.exit" for k in range(nnodes) if not (run_dir / f"node{k}.exit").exists()]
    for r in range(world):
        done = run_dir / f"rank{r}.done"
        if (run_dir / f"rank{r}.error.json").exists():
            continue
        try:
            published = json.loads(done.read_text() or "[]")
        except (OSError, ValueError):  # not there yet, or not complete yet
            missing.append(done.name)
            continue
        missing += [f"publish/{n}" for n in published if not (run_dir / "publish" / n).exists()]
    return missing


def _await_nodes(run_dir: Path, nnodes: int, world: int, succeeded: bool) -> bool:
    """After srun: wait (bounded) until every node's files show in the shared run dir; True when they do.
    A failed step gets a short wait only (its agents may have been killed before writing)."""
    deadline = time.monotonic() + (SHARED_FS_WAIT if succeeded else 5.0)
    while _missing_node_files(run_dir, nnodes, world):
        if time.monotonic() > deadline:
            return not succeeded  # a failure is reported from what is there
        time.sleep(0.2)
    return True


# --------------------------------------------------------------------------- progress


def idle_window(timeout: float) -> float:
    """Seconds of (almost) no CPU after which a run counts as waiting: timeout / 10, within 3..10 s."""
    return min(10.0, max(3.0, timeout / 10))


def machine_load(ranks: int) -> str:
    """'4 ranks on 2 cores, load average 6.3': what a reader needs to judge an overloaded machine."""
    cores = os.cpu_count() or 1
    return f"{_count(ranks, 'rank')} on {_count(cores, 'core')}, load average {os.getloadavg()[0]:.1f}"


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}{'s' if n != 1 else ''}"


def _seconds(t: float) -> str:
    return f"{t:.0f}" if t >= 10 else f"{t:.1f}"


class _CpuMeter:
    """The CPU time of a run's processes, sampled over the last window: computing ranks or waiting ones.

    Judged per process: one rank computing while the others wait for it in a collective is
    progress, however many are waiting (each waiting one still wakes up now and then).
    """

    def __init__(self, launcher: int, run_dir: Path, window: float):
        self.launcher, self.run_dir, self.window = launcher, run_dir, window
        self.samples: list[tuple[float, dict[int, float]]] = []  # (elapsed, pid -> CPU seconds)
        self.with_launchers = True

    def sample(self, elapsed: float, with_launchers: bool) -> None:
        """Record each process's CPU time (torchrun's own only while no rank is up: importing torch
        is the startup's progress). Once a rank is up, the history starts afresh: a rank born a
        moment ago has used little CPU yet, while torchrun's CPU before it no longer counts."""
        if with_launchers != self.with_launchers:
            self.samples.clear()
            self.with_launchers = with_launchers
        table = _processes()
        tree = self.tree(table, with_launchers)
        self.samples.append((elapsed, {pid: table[pid][1] for pid in tree}))
        while len(self.samples) > 2 and self.samples[1][0] <= elapsed - self.window:
            del self.samples[0]  # keep one sample at or before the window's start

    def tree(self, table: _Processes, with_launchers: bool) -> set[int]:
        return _run_tree(table, self.launcher, self.run_dir, with_launchers)

    def used(self) -> tuple[float, float, float]:
        """(CPU seconds of all processes, of the busiest one, over how many seconds) in the last
        window, or in less history; a process that exited takes its CPU time along."""
        (first, before), (last, after) = self.samples[0], self.samples[-1]
        used = [max(0.0, cpu - before.get(pid, 0.0)) for pid, cpu in after.items()]
        return sum(used), max(used, default=0.0), last - first

    def busy(self) -> bool | None:
        """Did a process compute in the last window? None until there is a window of history."""
        _, busiest, span = self.used()
        if span < self.window:
            return None
        return busiest >= IDLE_CPU_SHARE * span


class _NodeMeter(_CpuMeter):
    """One Slurm node's CPU meter, run by its agent (megalab.lab.worker.node_agent): the node's torchrun
    (`launcher`) and its descendants only, whatever else runs there. The agent writes `report()` to
    RUN_DIR/node{N}.cpu for the launcher, which cannot see other nodes' processes."""

    def tree(self, table: _Processes, with_launchers: bool) -> set[int]:
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        tree, todo = set(), list(children.get(self.launcher, []))
        while todo:
            pid = todo.pop()
            if pid not in tree:
                tree.add(pid)
                todo += children.get(pid, [])
        return tree | {self.launcher} if with_launchers and self.launcher in table else tree

    def report(self) -> dict:
        cpu, busiest, span = self.used() if self.samples else (0.0, 0.0, 0.0)
        return {"busy": self.busy() if self.samples else None, "cpu": cpu, "busiest": busiest, "span": span,
                "starting": self.with_launchers}


class _NodesMeter:
    """The launcher's meter under Slurm: every node's agent judges its own ranks (_NodeMeter) and reports in
    RUN_DIR/node{N}.cpu; the run computes when any node does, and waits only when every node says so."""

    def __init__(self, run_dir: Path, nnodes: int, window: float):
        self.run_dir, self.nnodes, self.window = run_dir, nnodes, window
        self.reports: dict[int, dict] = {}

    def sample(self, elapsed: float, with_launchers: bool) -> None:
        for node in range(self.nnodes):
            with contextlib.suppress(OSError, ValueError):
                self.reports[node] = json.loads((self.run_dir / f"node{node}.cpu").read_text())

    def used(self) -> tuple[float, float, float]:
        reports = list(self.reports.values())
        return (sum(r["cpu"] for r in reports), max((r["busiest"] for r in reports), default=0.0),
                min((r["span"] for r in reports), default=0.0))

    def busy(self) -> bool | None:
        answers = [self.reports.get(node, {}).get("busy") for node in range(self.nnodes)]
        if any(a is True for a in answers):
            return True
        return False if answers and all(a is False for a in answers) else None


@dataclass
class _Watch:
    """When a run past its timeout stops, and what it says meanwhile (see the module docstring)."""

    timeout: float
    hard_timeout: float
    local_ranks: int
    world: int
    multi_node: bool
    meter: _CpuMeter | _NodesMeter

    def verdict(self, elapsed: float, started: bool) -> str | None:
        """None while the run may go on, else the LaunchTimeoutError kind to stop it with."""
        busy = self.meter.busy()
        if elapsed < self.timeout or (busy is not False and elapsed < self.hard_timeout):
            return None
        if not started:
            return "not started"
        return "deadlock" if busy is False else "overloaded"

    def note(self, elapsed: float, started: bool) -> str:
        """Past the timeout (the run computes, or it would have stopped): say so on the progress line."""
        if elapsed < self.timeout:
            return ""
        doing = "still computing" if started else "still starting the ranks"
        return (f"{doing} past the {self.timeout:g} s timeout, machine overloaded? "
                f"({machine_load(self.local_ranks)}); stops at {self.hard_timeout:g} s")

    def reason(self, kind: str, elapsed: float) -> str:
        """The start of the LaunchTimeoutError's summary: what happened, in the reader's terms."""
        cpu, _, span = self.meter.used()
        load = machine_load(self.local_ranks)
        if kind == "deadlock":
            return (f"cell timed out after {self.timeout:g} s on {_count(self.world, 'rank')}, every rank waiting "
                    f"(almost no CPU used in the last {span:.0f} s): a deadlock")
        if kind == "overloaded":
            return (f"cell still computing after {_seconds(elapsed)} s on {_count(self.world, 'rank')} "
                    f"(timeout {self.timeout:g} s, "
                    f"hard timeout {self.hard_timeout:g} s), not deadlocked: the ranks used {cpu:.1f} s of CPU in "
                    f"the last {span:.0f} s; the machine is overloaded? ({load})")
        if self.meter.busy() is not False:
            return (f"no rank started within {_seconds(elapsed)} s: torchrun was still starting them, the machine is "
                    f"overloaded ({load}); rerun with fewer ranks, on a quieter machine or with a larger hard timeout")
        if self.multi_node:
            return (f"no rank started within {self.timeout:g} s: torchrun is still waiting at the rendezvous. Are all "
                    "nodes started (--nnodes, --node-rank), and can every node reach --rdzv-endpoint?")
        return (f"no rank started within {self.timeout:g} s, and torchrun has stopped using CPU before starting "
                f"them ({load}); its output is below")


# --------------------------------------------------------------------------- diagnosis


def _stack_of(text: str, source_lines: list[str]) -> str:
    """The main thread's frames from a faulthandler dump, cell lines shown with their source."""
    threads = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text.strip())
    main = next((t for t in threads if "<torchrun cell>" in t), threads[0] if threads else "")
    out = []
    for line in main.splitlines():
        m = re.match(r'\s+File "(.*)", line (\d+) in (.*)', line)
        if not m:
            continue
        filename, lineno, func = m.group(1), int(m.group(2)), m.group(3)
        if filename.endswith(("megalab/lab/worker.py", "<frozen runpy>")):
            continue
        if filename == "<torchrun cell>":
            code = source_lines[lineno - 1].strip() if 0 < lineno <= len(source_lines) else ""
            out.append(f"  cell line {lineno}, in {func}:  {code}")
        else:
            out.append(f'  File "{short_path(filename)}", line {lineno}, in {func}')
    return "\n".join(out)


def _stuck_line(stack: str) -> str:
    """'cell line N: code' for the most recent cell frame (faulthandler lists it first)."""
    for line in stack.splitlines():
        m = re.match(r"\s*cell line (\d+), in [^:]*:\s*(.*)", line)
        if m:
            code = re.sub(r"\s+#.*$", "", m.group(2))  # trailing comment
            return f"cell line {m.group(1)}: {code}"
    return "a line outside the cell"


def _rank_stacks(run_dir: Path, workers: dict[int, int], source: str) -> dict[int, str]:
    """Each live rank's stack, dumped by faulthandler on SIGUSR1 (see megalab/lab/worker.py)."""
    stacks_files = _rank_files(run_dir, "stack")
    sizes = {r: stacks_files[r].stat().st_size if r in stacks_files else 0 for r in workers}
    for pid in workers.values():
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:  # faulthandler writes from its signal handler: fast
        if all(stacks_files[r].stat().st_size > sizes[r] for r in workers if r in stacks_files):
            break
        time.sleep(0.05)
    lines = source.splitlines()
    stacks = {}
    for rank in sorted(workers):
        text = stacks_files[rank].read_text(errors="replace")[sizes[rank]:] if rank in stacks_files else ""
        stacks[rank] = _stack_of(text, lines)
    return stacks


STACKS_WAIT = 15.0  # seconds the node agents get to have their ranks' stacks dumped (they poll every AGENT_POLL)


def _node_stacks(run_dir: Path, nnodes: int, source: str) -> tuple[dict[int, str], dict[int, str]]:
    """Under Slurm: ({rank: stack}, {rank: node}) of the live ranks of every node. The launcher cannot signal
    other nodes' processes: it asks every node's agent (RUN_DIR/dump), which has its own ranks dump their
    stacks (SIGUSR1) and answers in RUN_DIR/node{N}.dumped which ranks and where their dump starts."""
    token = str(time.time_ns())
    tmp = run_dir / "dump.tmp"
    tmp.write_text(token)
    tmp.rename(run_dir / "dump")
    answers: dict[int, dict] = {}
    deadline = time.monotonic() + STACKS_WAIT
    while len(answers) < nnodes and time.monotonic() < deadline:
        for node in range(nnodes):
            with contextlib.suppress(OSError, ValueError):
                answer = json.loads((run_dir / f"node{node}.dumped").read_text())
                if answer["token"] == token:
                    answers[node] = answer
        time.sleep(0.1)
    lines, stacks, hosts = source.splitlines(), {}, {}
    for answer in answers.values():
        for rank, offset in answer["ranks"].items():
            path = run_dir / f"rank{rank}.stack"
            text = path.read_text(errors="replace")[offset:] if path.exists() else ""
            stacks[int(rank)] = _stack_of(text, lines)
            hosts[int(rank)] = answer["host"]
    silent = sorted(set(range(nnodes)) - set(answers))
    if silent:
        hosts[-1] = f"nodes {silent} did not answer within {STACKS_WAIT:g} s"
    return dict(sorted(stacks.items())), hosts


def _timeout_error(run_dir: Path, source: str, kind: str, reason: str, nnodes: int = 0) -> LaunchTimeoutError:
    """The error for a run stopped by the watch: `reason` says why, the ranks' stacks say where (under Slurm,
    `nnodes` > 0, from every node's agent)."""
    if kind == "not started":
        log = (run_dir / "torchrun.log").read_text(errors="replace")[-2000:]
        return LaunchTimeoutError(reason, log or "(torchrun printed nothing)", {}, kind)
    if nnodes:
        stacks, hosts = _node_stacks(run_dir, nnodes, source)
    else:
        stacks, hosts = _rank_stacks(run_dir, _alive_workers(run_dir), source), {}
    where = "stuck" if kind == "deadlock" else "busy"
    on = {r: f" (node {hosts[r]})" if r in hosts else "" for r in stacks}
    summary = f"{reason}; " + "; ".join(f"rank {r}{on[r]} {where} at {_stuck_line(s)}" for r, s in stacks.items())
    if -1 in hosts:
        summary += f" ({hosts[-1]})"
    done = sorted(_rank_files(run_dir, "done"))
    if done:
        summary += f" (ranks {done} had finished)"
    details = "\n".join(f"[rank {r}]{on[r]} stack when stopped (most recent call first):\n{s}" for r, s in stacks.items())
    return LaunchTimeoutError(summary, details, stacks, kind)


def _killed_ranks(torchrun_log: str) -> dict[int, int]:
    """{rank: exit code} of the ranks torchrun's failure report lists as dead by a signal it did not send
    itself (it stops the survivors with SIGTERM): SIGKILL (the OOM killer, kill -9), SIGSEGV, SIGABRT..."""
    killed = {}
    for m in re.finditer(r"^\s+rank\s*:\s*(\d+)[^\n]*\n\s+exitcode\s*:\s*(-?\d+)", torchrun_log, re.M):
        rank, code = int(m.group(1)), int(m.group(2))
        if code < 0 and -code not in (signal.SIGTERM, signal.SIGINT):
            killed.setdefault(rank, code)
    return killed


def _how(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else f"exit code {code}"


def _first_traceback(log: str) -> str | None:
    """The first Python traceback in a log, up to its exception line: the root cause (later ones, and the
    launcher's own reports, are fallout); None without one."""
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("Traceback (most recent call last):"):
            out = [line.strip()]
            for following in lines[i + 1:i + 200]:
                out.append(following)
                if following.strip() and not following[0].isspace():  # the exception line ends it
                    break
            return "\n".join(out)
    return None


def _failure_error(run_dir: Path, world: int, torchrun_log: str, slurm: bool = False) -> Exception:
    errors = {e["rank"]: e for e in (json.loads(p.read_text()) for p in _rank_files(run_dir, "error.json").values())}
    # A rank that vanished without a Python error is the root cause: its peers' collectives then fail
    # ("Connection reset by peer"), and those errors are fallout, however early they were written.
    killed = {r: c for r, c in _killed_ranks(torchrun_log).items() if r not in errors}
    if errors and not killed:
        first = min(errors.values(), key=lambda e: e["time"])  # the root cause; later ones are fallout
        others = sorted(r for r in errors if r != first["rank"])
        where = f" on node {first['node']}" if first.get("node") else ""  # under Slurm
        summary = f"rank {first['rank']}{where} failed: {first['type']}"
        if first["message"]:
            summary += f": {first['message']}"
        details = f"[rank {first['rank']}] {first['traceback']}"
        if others:
            details += f"\n(ranks {others} failed after it, most likely because rank {first['rank']} had stopped)"
        return RankFailedError(first["rank"], summary, details)
    started = _rank_files(run_dir, "pid")
    if not started:
        first = _first_traceback(torchrun_log)
        srun_errors = [ln for ln in torchrun_log.splitlines() if ln.startswith("srun: error:")]
        if slurm and srun_errors and first is None:
            return LaunchError("srun could not start the ranks:\n" + "\n".join(srun_errors[:5]) +
                               "\n(`megalab doctor --slurm` checks the allocation)")
        if first is None:
            return LaunchError(f"torchrun could not start the ranks:\n{torchrun_log[-3000:]}")
        hint = ("\n(under Slurm, `megalab doctor --slurm` checks what the ranks need: the export setting, "
                "node names, a shared run folder)" if slurm else "")
        return LaunchError(f"torchrun could not start the ranks; the first error in its output:\n{first}{hint}")
    # No Python exception from the culprit: a rank died (signal, os._exit).
    cause = None
    if killed:
        rank, code = next(iter(killed.items()))
        how = _how(code)
    elif cause := re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", torchrun_log, re.S):
        rank, code = int(cause.group(1)), int(cause.group(2))
        how = _how(code)
    else:
        done = _rank_files(run_dir, "done")
        rank = min((r for r in range(world) if r not in done), default=0)
        how = "killed by a signal or exited early"
    tails = []
    for kind in ("err", "stack"):
        path = run_dir / f"rank{rank}.{kind}"
        if path.exists() and path.stat().st_size:
            tails.append(path.read_text(errors="replace")[-2000:])
    details = "\n".join(tails) or (torchrun_log[-2000:] if not (killed or cause) else "(the rank printed nothing to stderr)")
    if errors:
        fallout = "; ".join(f"rank {r}: {e['type']}" for r, e in sorted(errors.items()))
        details += f"\n(ranks {sorted(errors)} failed after it, most likely because rank {rank} had stopped: {fallout})"
    return RankFailedError(rank, f"rank {rank} died before finishing ({how})", details)


# --------------------------------------------------------------------------- run


def _finished(run_dir: Path, local_ranks: int) -> bool:
    """Has every rank of this node finished the cell? Success: a rank that aborts in teardown after
    that (the gloo destructor crash) does not fail it. Other nodes' ranks report on their nodes."""
    started = set(_rank_files(run_dir, "pid"))
    return len(started) >= local_ranks and started <= set(_rank_files(run_dir, "done"))


def _wait(
    proc: subprocess.Popen, run_dir: Path, code: str, watch: _Watch, start: float,
    on_progress: Callable[[float, str], None] | None, shown: int,
) -> LaunchTimeoutError | None:
    """Wait for torchrun to end, or for the watch to stop the run; None when torchrun ended by itself
    (or a rank failed and torchrun was slow to stop the others)."""
    failed_at = None
    next_sample = start
    while proc.poll() is None:
        now = time.monotonic()
        if failed_at is None and _rank_files(run_dir, "error.json"):
            failed_at = now
        if failed_at is not None and now - failed_at > FAILURE_GRACE:
            return None  # torchrun is slow to stop the others: we do it
        if now >= next_sample:
            elapsed, started = now - start, bool(_rank_files(run_dir, "pid"))
            watch.meter.sample(elapsed, with_launchers=not started)
            if _finished(run_dir, watch.world if isinstance(watch.meter, _NodesMeter) else watch.local_ranks):
                # torchrun is winding down, the ranks use no CPU
                if elapsed >= watch.hard_timeout:
                    return None  # the cell is done everywhere: only torchrun lingers
            elif kind := watch.verdict(elapsed, started):
                nodes = watch.meter.nnodes if isinstance(watch.meter, _NodesMeter) else 0
                return _timeout_error(run_dir, code, kind, watch.reason(kind, elapsed), nodes)
            if on_progress:
                last = _last_line(run_dir / f"rank{shown}.err") or _last_line(run_dir / f"rank{shown}.out")
                on_progress(elapsed, " · ".join(filter(None, [watch.note(elapsed, started), last])))
            next_sample = now + SAMPLE_INTERVAL
        time.sleep(0.05)
    return None


def run(
    code: str,
    nproc_per_node: int = 1,
    *,
    backend: str = "auto",
    timeout: float = DEFAULT_TIMEOUT,
    hard_timeout: float | None = None,
    ranks: str | list[int] = "all",
    nnodes: int = 1,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    slurm: bool = False,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    on_progress: Callable[[float, str], None] | None = None,
    keep_run_dir: bool = False,
    name: str | None = None,
) -> LaunchResult:
    """Run `code` (a Python script as text) on `nproc_per_node` ranks per node under torchrun.

    Returns a LaunchResult once every rank has finished the code; raises RankFailedError with
    the first failing rank's traceback, LaunchError for impossible requests, and
    LaunchTimeoutError (with every rank's stack and a `kind`): at `timeout` seconds if every
    rank is waiting (a deadlock), at `hard_timeout` (default HARD_TIMEOUT_FACTOR x timeout, never
    less than timeout) if they are still computing. KeyboardInterrupt stops all ranks. `name` names the
    Slurm step (megalab-NAME).
    """
    if nproc_per_node < 1 or nnodes < 1:
        raise LaunchError("need at least one rank per node and one node")
    if slurm:
        nnodes = len(slurm_nodes())
    world = nproc_per_node * nnodes
    shown = parse_ranks(ranks, world)
    chosen = resolve_backend(backend, nproc_per_node)
    cwd = Path(cwd or os.getcwd()).resolve()
    base = cwd / ".megalab" / "runs" if slurm else None  # ranks on other nodes need a shared path
    if base:
        base.mkdir(parents=True, exist_ok=True)
        _clean_stale_runs(base)
    run_dir = Path(tempfile.mkdtemp(prefix="megalab-run-", dir=base))
    script = run_dir / "cell.py"
    script.write_text(code)
    (run_dir / "publish").mkdir()

    package_root = str(Path(__file__).resolve().parents[2])
    child_env = dict(os.environ)
    child_env.update(
        MEGALAB_RUN_DIR=str(run_dir),
        MEGALAB_BACKEND=chosen,
        MEGALAB_CWD=str(cwd),
        PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
        MPLBACKEND="Agg",  # ranks draw to files; the notebook plots what they publish
    )
    # An explicit OMP_NUM_THREADS silences torchrun's banner; split the cores this process (or, under Slurm,
    # each node's task) may use between the node's ranks.
    cpus = slurm_cpus_per_node() if slurm else available_cpus()
    child_env.setdefault("OMP_NUM_THREADS", str(max(1, cpus // nproc_per_node)))
    child_env.update(env or {})
    if nnodes == 1 and not slurm:  # one machine: gloo on loopback, whatever the hostname resolves to (or not)
        child_env.update(procs.loopback_env(child_env))
    if slurm:
        _write_agent_config(run_dir, child_env, env or {}, idle_window(timeout))

    cmd, tie = procs.tied_to_parent(
        torchrun_command(script, nproc_per_node, nnodes, node_rank, rdzv_endpoint, slurm, name))
    log_path = run_dir / "torchrun.log"
    start = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=child_env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=tie,
        )
    cap = max(timeout, HARD_TIMEOUT_FACTOR * timeout if hard_timeout is None else hard_timeout)
    meter = _NodesMeter(run_dir, nnodes, idle_window(timeout)) if slurm else _CpuMeter(proc.pid, run_dir, idle_window(timeout))
    watch = _Watch(timeout, cap, nproc_per_node, world, nnodes > 1, meter)
    error: BaseException | None
    try:
        error = _wait(proc, run_dir, code, watch, start, on_progress, shown[0])
    except BaseException as exc:  # KeyboardInterrupt from the notebook: stop every rank
        error = exc
    finally:
        if slurm:
            _stop_slurm_step(proc, run_dir)
        _kill_all(proc, run_dir)
    elapsed = time.monotonic() - start

    torchrun_log = log_path.read_text(errors="replace")
    if error is None and slurm and not _await_nodes(run_dir, nnodes, world, proc.returncode == 0):
        error = LaunchError(
            f"srun finished, but not every node's files appeared in {run_dir} within {SHARED_FS_WAIT:g} s "
            f"({', '.join(_missing_node_files(run_dir, nnodes, world)[:4])} ...): the run folder (.megalab/runs "
            "under the notebook's folder) must be on a filesystem every node of the allocation shares")
    local_ranks = set(_rank_files(run_dir, "pid"))
    if error is None and not _finished(run_dir, world if slurm else nproc_per_node):
        error = _failure_error(run_dir, world, torchrun_log, slurm)
    if error is not None:
        if not keep_run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise error

    def read(rank: int, kind: str) -> str:
        path = run_dir / f"rank{rank}.{kind}"
        return clean_progress(path.read_bytes().decode(errors="replace")) if path.exists() else ""

    stdout = {r: read(r, "out") for r in sorted(local_ranks)}
    stderr = {r: "".join(ln for ln in read(r, "err").splitlines(True) if not _NATIVE_LOG.match(ln)) for r in sorted(local_ranks)}
    results: dict[str, dict[int, Any]] = {}
    for path in sorted((run_dir / "publish").glob("*.pkl")):
        name, _, rank = path.stem.rpartition(".rank")
        with open(path, "rb") as f:
            results.setdefault(name, {})[int(rank)] = pickle.load(f)
    results = {name: dict(sorted(values.items())) for name, values in results.items()}
    if not keep_run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)
    return LaunchResult(world, stdout, stderr, results, elapsed, run_dir, [r for r in shown if r in local_ranks])



def run_function(fn: Callable, nproc_per_node: int, *args, **kwargs) -> LaunchResult:
    """Call a module-level `fn(*args, **kwargs)` on every rank; `result.returns` maps rank -> value.

    Launch options go in `launch=dict(...)` (e.g. `launch=dict(timeout=30)`). The function is
    imported by name in each rank, so it must live in an importable module (not `__main__`).
    """
    options = kwargs.pop("launch", {})
    module, name = fn.__module__, fn.__qualname__
    if module == "__main__" or "<locals>" in name:
        raise LaunchError(f"run_function needs a module-level function of an importable module, not {module}.{name}")
    # The arguments travel inside the script (run dir: shared under Slurm), never in a node-local file.
    payload = base64.b64encode(pickle.dumps((args, kwargs))).decode()
    code = (
        "import base64, importlib, pickle\n"
        "from megalab.lab.dist import publish\n"
        f"args, kwargs = pickle.loads(base64.b64decode({payload!r}))\n"
        f"fn = importlib.import_module({module!r})\n"
        f"for part in {name!r}.split('.'):\n"
        "    fn = getattr(fn, part)\n"
        "publish('returns', fn(*args, **kwargs))\n"
    )
    return run(code, nproc_per_node, **options)
