"""Processes, portably: what the launcher and its ranks need from the operating system, in one place.

    processes()          pid -> (parent pid, CPU seconds, command line) of every process on this machine
    cmdline(pid)         one process's command line (b"" when it is gone or not ours to read)
    descendants(pid)     every live descendant, from the parent links
    kill_tree(pid)       SIGKILL a process and all its descendants
    pid_exists(pid)      is that process still there?
    die_with_parent()    this process dies when its parent does
    available_cpus()     the cores this process may run on
    loopback_env()       environment that binds a one-machine gloo run to the loopback interface

Linux has a fast path for each (/proc, prctl(PR_SET_PDEATHSIG), os.sched_getaffinity): the deadlock judge
reads every process's CPU time twice a second, and a /proc scan costs a fraction of psutil's. Everywhere
else (macOS; WSL2 is Linux) psutil does it, and a rank watches its parent from a thread instead of asking
the kernel. MEGALAB_PORTABLE=1 switches the Linux fast paths off (in the launcher and, through the
environment, in its ranks), so the portable path runs, and is tested, on Linux too.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

PORTABLE_ENV = "MEGALAB_PORTABLE"
PARENT_POLL = 0.2  # seconds between a rank's looks at its parent when the kernel cannot watch it


def linux_fast_path() -> bool:
    """The Linux-only facilities may be used: Linux with /proc, and MEGALAB_PORTABLE unset (read at each call)."""
    return sys.platform.startswith("linux") and os.environ.get(PORTABLE_ENV, "") in ("", "0") and Path("/proc/self/stat").exists()


Processes = dict[int, tuple[int, float, bytes]]  # pid -> (parent pid, CPU seconds, command line)


def processes() -> Processes:
    """Every process on this machine: pid -> (parent pid, CPU seconds, command line, NUL-separated).

    CPU seconds are user + system time of the process and of the children it has reaped (on Linux
    fields 14-17 of /proc/PID/stat; psutil reports the children's part on Linux only)."""
    return _processes_proc() if linux_fast_path() else _processes_psutil()


def _processes_proc() -> Processes:
    ticks = os.sysconf("SC_CLK_TCK")
    table = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                # the command name may hold spaces and parentheses: the fields start after the last ')'
                stat = Path(entry.path, "stat").read_bytes().rpartition(b")")[2].split()
                line = Path(entry.path, "cmdline").read_bytes()
            except OSError:
                continue
            table[int(entry.name)] = (int(stat[1]), sum(int(v) for v in stat[11:15]) / ticks, line)
    return table


def _processes_psutil() -> Processes:
    import psutil

    table = {}
    for proc in psutil.process_iter(["ppid", "cpu_times", "cmdline"]):
        info = proc.info
        times = info["cpu_times"]
        if info["ppid"] is None or times is None:  # gone, or not ours to read
            continue
        cpu = times.user + times.system + getattr(times, "children_user", 0.0) + getattr(times, "children_system", 0.0)
        line = b"".join(arg.encode(errors="replace") + b"\0" for arg in info["cmdline"] or [])
        table[proc.pid] = (info["ppid"], cpu, line)
    return table


def cmdline(pid: int) -> bytes:
    """The command line of `pid`, arguments NUL-separated; b"" when it is gone or cannot be read."""
    if linux_fast_path():
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""
    import psutil

    try:
        return b"".join(arg.encode(errors="replace") + b"\0" for arg in psutil.Process(pid).cmdline())
    except (psutil.Error, OSError):
        return b""


def pid_exists(pid: int) -> bool:
    if linux_fast_path():
        return Path(f"/proc/{pid}").exists()
    import psutil

    return psutil.pid_exists(pid)


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` on this machine (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for child, (ppid, _, _) in processes().items():
        children.setdefault(ppid, []).append(child)
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo += children.get(child, [])
    return found


def kill_tree(pid: int, include_self: bool = True) -> None:
    """SIGKILL `pid` (unless include_self is False) and all its descendants, until none is left (5 s at most).

    Ranks have sessions of their own: a process group does not hold them, the parent links do."""
    for _ in range(100):
        alive = False
        for victim in [*descendants(pid), *([pid] if include_self else [])]:
            try:
                os.kill(victim, signal.SIGKILL)
                alive = True
            except (ProcessLookupError, PermissionError):
                pass
        if not alive:
            return
        time.sleep(0.05)


def die_with_parent() -> None:
    """This process (and what it started) dies when its parent dies, however the parent dies.

    Linux: the kernel sends SIGKILL (prctl PR_SET_PDEATHSIG), so it also works between fork and exec
    (subprocess's preexec_fn). Elsewhere: a daemon thread notices the parent is gone (the process is
    re-parented, so getppid changes), kills this process's descendants and exits; call it after exec."""
    parent = os.getppid()
    if linux_fast_path():
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)
        return
    if parent == 1:  # already orphaned
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL)
        kill_tree(os.getpid(), include_self=False)
        os._exit(1)

    threading.Thread(target=watch, name="megalab-parent-watch", daemon=True).start()


def available_cpus() -> int:
    """The cores this process may run on (its affinity: a Slurm task or a container gets fewer than cpu_count);
    where affinity cannot be read (macOS), every core."""
    if linux_fast_path() and hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def loopback_interface() -> str:
    """The name of the interface that holds 127.0.0.1: lo on Linux, lo0 on macOS."""
    try:
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addrs):
                return name
    except (ImportError, OSError):
        pass
    return "lo0" if sys.platform == "darwin" else "lo"


def loopback_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """What a run on this machine alone adds to its ranks' environment: gloo binds to the loopback interface.

    Unset, gloo binds to the address the machine's hostname resolves to, which on many Macs is a Wi-Fi address
    (or nothing): the rendezvous then hangs or fails. A value the user set is kept."""
    environ = os.environ if environ is None else environ
    return {} if "GLOO_SOCKET_IFNAME" in environ else {"GLOO_SOCKET_IFNAME": loopback_interface()}


def resolve(host: str, timeout: float = 3.0) -> str | None:
    """The IPv4 address `host` resolves to, or None if it does not resolve within `timeout` seconds
    (a Mac whose hostname is unknown to its DNS can take half a minute to say so)."""
    found: list[str | None] = []

    def look() -> None:
        try:
            found.append(socket.gethostbyname(host))
        except OSError:
            found.append(None)

    thread = threading.Thread(target=look, daemon=True)
    thread.start()
    thread.join(timeout)
    return found[0] if found else None


_LIBC = None  # the C library, loaded by the parent: between fork and exec the child must not import or lock


def _death_signal() -> None:  # subprocess's preexec_fn (Linux): SIGKILL when the parent dies
    _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def tied_to_parent(cmd: list[str]) -> tuple[list[str], object]:
    """(command, preexec_fn) that start a Python `cmd` ([python, -m, MODULE, ...]) so that it dies with this
    process: on Linux the kernel's death signal, set between fork and exec; elsewhere the command runs under
    `python -m megalab.lab.procs --die-with-parent -m MODULE ...`, whose watching thread does it."""
    if linux_fast_path():
        global _LIBC
        if _LIBC is None:
            import ctypes

            _LIBC = ctypes.CDLL(None, use_errno=True)
        return cmd, _death_signal
    if cmd[1:2] != ["-m"]:  # not Python (srun: Slurm stops its own steps, and Slurm clusters run Linux)
        return cmd, None
    return [cmd[0], "-m", "megalab.lab.procs", "--die-with-parent", *cmd[1:]], None


if __name__ == "__main__":  # python -m megalab.lab.procs --die-with-parent -m MODULE ARGS...
    import runpy

    if sys.argv[1:3] != ["--die-with-parent", "-m"] or len(sys.argv) < 4:
        sys.exit("usage: python -m megalab.lab.procs --die-with-parent -m MODULE [ARGS...]")
    die_with_parent()
    module = sys.argv[3]
    sys.argv = [module, *sys.argv[4:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
