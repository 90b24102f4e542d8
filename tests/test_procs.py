"""megalab/lab/procs.py, the portable layer under the launcher: its two paths agree, and the Linux-only calls live
nowhere else. (The launcher's own tests run on both paths: the `facilities` fixture, tests/conftest.py.)"""

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megalab.lab import procs

ROOT = Path(__file__).resolve().parents[1]


def test_linux_only_calls_live_in_the_procs_layer_only():
    for path in ("megalab/lab/launch.py", "megalab/lab/worker.py", "megalab/lab/dist.py"):
        text = (ROOT / path).read_text()
        found = re.findall(r"/proc/|\bprctl\b|sched_getaffinity|PR_SET_PDEATHSIG", text)
        assert not found, f"{path} uses {found}: go through megalab/lab/procs.py, which has a path without them"


def test_both_paths_see_the_same_processes_and_cpu_times(monkeypatch):
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                             "while time.process_time() - t < 0.3:\n    pass\ntime.sleep(60)\n"])
    try:
        time.sleep(0.1)
        while procs.processes()[busy.pid][1] < 0.3:
            time.sleep(0.05)
        fast = procs.processes()
        monkeypatch.setenv(procs.PORTABLE_ENV, "1")
        assert not procs.linux_fast_path()
        portable = procs.processes()
        for table in (fast, portable):
            ppid, cpu, line = table[busy.pid]
            assert ppid == os.getpid() and 0.3 <= cpu < 5 and b"process_time" in line
            assert table[os.getpid()][0] == os.getppid()
        assert abs(fast[busy.pid][1] - portable[busy.pid][1]) < 0.2
        assert procs.cmdline(busy.pid) == fast[busy.pid][2] and procs.pid_exists(busy.pid)
        assert busy.pid in procs.descendants(os.getpid())
        procs.kill_tree(busy.pid)
        busy.wait(timeout=10)
        assert procs.cmdline(busy.pid) == b""
    finally:
        busy.kill()


def test_cpu_count_without_sched_getaffinity(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 12)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert procs.available_cpus() == (3 if procs.linux_fast_path() else 12)
    monkeypatch.delattr(os, "sched_getaffinity")  # macOS has none
    assert procs.available_cpus() == 12


def test_a_process_tied_to_its_parent_dies_with_it_without_prctl(tmp_path):
    """The path macOS takes: `python -m megalab.lab.procs --die-with-parent -m MODULE` watches its parent from a
    thread; when the parent is SIGKILLed, it kills what it started and exits."""
    child = tmp_path / "child.pid"
    grandchild = tmp_path / "grandchild.pid"
    (tmp_path / "sleeper.py").write_text(
        "import os, subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(grandchild)!r}, 'w').write(str(p.pid))\n"
        f"open({str(child)!r}, 'w').write(str(os.getpid()))\n"
        "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "from megalab.lab import procs\n"
        "cmd, tie = procs.tied_to_parent([sys.executable, '-m', 'sleeper'])\n"
        "assert tie is None and cmd[2:4] == ['megalab.lab.procs', '--die-with-parent']\n"
        "subprocess.Popen(cmd, preexec_fn=tie)\n"
        "time.sleep(600)\n")], cwd=tmp_path, env={**os.environ, procs.PORTABLE_ENV: "1",
                                                   "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])})
    try:
        deadline = time.monotonic() + 60
        while not (child.exists() and grandchild.exists()) and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [int(child.read_text()), int(grandchild.read_text())]
        assert all(procs.pid_exists(p) for p in pids)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids)
    finally:
        parent.kill()
        for p in (child, grandchild):
            if p.exists():
                try:
                    os.kill(int(p.read_text()), 9)
                except ProcessLookupError:
                    pass


def _alive(pid: int) -> bool:
    """Alive and not a zombie (an orphan waits for init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_gloo_binds_to_loopback_unless_told_otherwise():
    assert procs.loopback_env({}) == {"GLOO_SOCKET_IFNAME": procs.loopback_interface()}
    assert procs.loopback_interface() == ("lo0" if sys.platform == "darwin" else "lo")
    assert procs.loopback_env({"GLOO_SOCKET_IFNAME": "eth1"}) == {}


def test_a_hostname_that_never_resolves_gives_up_in_time(monkeypatch):
    never = threading.Event()
    monkeypatch.setattr(procs.socket, "gethostbyname", lambda host: never.wait() and "")  # a DNS that never answers
    try:
        assert procs.resolve("my-macbook.local", timeout=0.2) is None
    finally:
        never.set()
    monkeypatch.setattr(procs.socket, "gethostbyname", lambda host: (_ for _ in ()).throw(OSError(8, "nodename nor servname")))
    assert procs.resolve("my-macbook.local") is None
    monkeypatch.setattr(procs.socket, "gethostbyname", lambda host: "192.168.1.20")
    assert procs.resolve("my-macbook.local") == "192.168.1.20"


@pytest.mark.parametrize("system, machine, release, environ, expected, missing", [
    ("Darwin", "arm64", "24.1.0", {}, ["macOS on Apple silicon", "Triton has no macOS wheels", "no CUDA on a Mac"], []),
    ("Darwin", "x86_64", "22.6.0", {}, ["macOS on Intel", "flash-attn, NCCL"], []),
    ("Linux", "x86_64", "5.15.167.4-microsoft-standard-WSL2", {}, ["Windows through WSL2", "not under /mnt/c"],
     ["not here"]),
    ("Linux", "x86_64", "6.1.0", {}, ["Linux (x86_64): the whole course runs"], ["WSL2", "not here"]),
    ("Windows", "AMD64", "10", {}, ["Windows itself: the course does not run here; use WSL2"], []),
])
def test_doctor_names_the_platform_and_what_will_not_run(monkeypatch, system, machine, release, environ, expected,
                                                         missing):
    from megalab.lab.doctor import platform_limits

    monkeypatch.setattr(procs, "resolve", lambda host, timeout: "127.0.1.1")
    text = "\n".join(f"{k}: {v}" for k, v in platform_limits(system, machine, release, environ, hostname="box"))
    for part in expected:
        assert part in text, (part, text)
    for part in missing:
        assert part not in text, (part, text)
    assert "box resolves to 127.0.1.1" in text


def test_doctor_says_what_an_unresolvable_hostname_means(monkeypatch):
    from megalab.lab.doctor import platform_limits

    monkeypatch.setattr(procs.socket, "gethostbyname", lambda host: (_ for _ in ()).throw(OSError("no such host")))
    rows = dict(platform_limits("Darwin", "arm64", "24.1.0", {}, hostname="my-macbook"))
    assert "my-macbook does not resolve" in rows["hostname"] and "127.0.0.1 my-macbook" in rows["hostname"]
    assert "ranks meet on 127.0.0.1" in rows["hostname"]


def test_doctor_without_triton_says_the_kernels_do_not_run():
    from megalab.lab.doctor import _course_parts

    facts = {"gpus": [], "fp8_tensor_cores": False, "triton": "not installed", "flash_attn_ok": False, "flash_attn": None}
    assert dict(_course_parts(facts))["FlashAttention in Triton"].startswith("does not run: no triton")
    assert "TRITON_INTERPRET=1" in dict(_course_parts({**facts, "triton": "3.7.1"}))["FlashAttention in Triton"]
