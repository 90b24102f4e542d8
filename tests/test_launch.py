"""The launcher under real torchrun: output, results, crashes, deadlocks, interrupts, multi-node."""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from megalab.lab import launch
from megalab.lab.launch import LaunchError, LaunchTimeoutError, RankFailedError

HELLO = """
import torch, torch.distributed as dist
from megalab.lab import dist as mdist
rank, world = mdist.init()
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
print(f"hello from rank {rank} of {world}")
print(f"sum {t.item():.0f}")
mdist.publish("square", rank * rank)
"""


# Every rank started from this test session inherits this tag, so leftover checks see only ours.
SESSION_TAG = f"MEGALAB_TEST_SESSION={os.getpid()}-{time.time_ns()}"
os.environ["MEGALAB_TEST_SESSION"] = SESSION_TAG.partition("=")[2]


def _workers_alive() -> list[int]:
    """PIDs of live megalab ranks started by this test session (tests must leave none behind)."""
    alive = []
    for proc in Path("/proc").iterdir():
        try:
            if b"megalab.lab.worker" in (proc / "cmdline").read_bytes() and SESSION_TAG.encode() in (proc / "environ").read_bytes():
                alive.append(int(proc.name))
        except (OSError, ValueError):
            continue
    return alive


def test_hello_output_grouped_in_rank_order_and_results_come_back():
    res = launch.run(HELLO, 4, timeout=120)
    expected = "".join(f"[rank {r}] hello from rank {r} of 4\n[rank {r}] sum 10\n" for r in range(4))
    assert res.text() == expected
    assert res.results == {"square": {0: 0, 1: 1, 2: 4, 3: 9}}
    assert res.world_size == 4
    assert not res.run_dir.exists()  # cleaned up
    assert not _workers_alive()


def test_ranks_filter_and_progress_lines():
    code = HELLO + "import sys\nfor i in range(3):\n    sys.stderr.write(f'\\rstep {i}/3')\nsys.stderr.write('\\n')\n"
    res = launch.run(code, 3, ranks="0,2", timeout=120)
    assert res.text() == "[rank 0] hello from rank 0 of 3\n[rank 0] sum 6\n[rank 2] hello from rank 2 of 3\n[rank 2] sum 6\n"
    assert res.text("stderr") == ""  # tqdm-style '\r' redraws are live-only
    single = launch.run(HELLO, 2, ranks="1", timeout=120)
    assert single.text() == "hello from rank 1 of 2\nsum 3\n"  # one rank shown: no prefix


def test_crash_names_rank_and_exception_quickly(facilities):
    code = textwrap.dedent("""
        import torch.distributed as dist
        from megalab.lab import dist as mdist
        rank, world = mdist.init()
        if rank == 2:
            raise ValueError("bad shard size")
        dist.barrier()
    """)
    with pytest.raises(RankFailedError) as info:  # not a LaunchTimeoutError: the crash ends the run, no timeout
        launch.run(code, 4, timeout=120)
    err = info.value
    assert err.rank == 2
    assert str(err) == "rank 2 failed: ValueError: bad shard size"
    assert 'raise ValueError("bad shard size")' in err.details  # the rank's own traceback, with the source line
    assert "line 6" in err.details
    assert "ChildFailedError" not in err.details
    rendered = "\n".join(err._render_traceback_())
    assert "launch.py" not in rendered  # IPython shows the rank's traceback, not the launcher's frames
    assert not _workers_alive()


def test_rank_killed_by_signal_is_reported():
    code = "import os, signal\nfrom megalab.lab import dist as mdist\nrank, _ = mdist.init()\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\nimport time; time.sleep(30)\n"
    with pytest.raises(RankFailedError, match="rank 1 died"):
        launch.run(code, 2, timeout=60)
    assert not _workers_alive()


def test_killed_rank_is_blamed_not_the_peers_it_broke():
    # rank 2 vanishes mid-all_reduce: its peers then raise "Connection reset by peer" first,
    # but the report must name rank 2 and list the others as fallout.
    code = (
        "import os, signal, time, torch, torch.distributed as dist\nfrom megalab.lab import dist as mdist\n"
        "rank, _ = mdist.init()\nfor i in range(100):\n    if rank == 2 and i == 3:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n    dist.all_reduce(torch.ones(4)); time.sleep(0.02)\n"
    )
    with pytest.raises(RankFailedError, match=r"rank 2 died before finishing \(killed by SIGKILL\)") as info:
        launch.run(code, 4, backend="gloo", timeout=60)
    assert info.value.rank == 2
    # Peers that raised before torchrun stopped them are listed as fallout; under load torchrun may stop
    # them first (then there is no fallout to list). Either way no peer is blamed.
    assert "failed after it" not in info.value.details or "because rank 2 had stopped" in info.value.details
    assert "[rank 0]" not in info.value.details.split("failed after it")[0]
    assert not _workers_alive()


def test_exit_codes():
    assert launch.run("import sys\nprint('bye')\nsys.exit(0)\n", 2).text() == "[rank 0] bye\n[rank 1] bye\n"
    with pytest.raises(RankFailedError, match="SystemExit: 3"):
        launch.run("import sys\nsys.exit(3)\n", 1)


def test_deadlock_timeout_shows_each_ranks_stuck_line(facilities):
    code = textwrap.dedent("""
        import torch, torch.distributed as dist
        from megalab.lab import dist as mdist
        rank, world = mdist.init()
        x = torch.zeros(1)
        if rank == 0:
            dist.recv(x, src=1)  # both ranks wait to receive: a deadlock
        else:
            dist.recv(x, src=0)
    """)
    with pytest.raises(LaunchTimeoutError) as info:
        # ranks that all wait are stopped at the timeout, never at the hard timeout (a long one: on a loaded machine
        # the ranks may still be importing torch 12 s in, which is no deadlock)
        launch.run(code, 2, timeout=4, hard_timeout=120)
    err = info.value
    assert err.kind == "deadlock"  # (the hard timeout would say "overloaded")
    assert "every rank waiting" in str(err) and "a deadlock" in str(err)
    assert set(err.stacks) == {0, 1}
    assert "cell line 7, in <module>:  dist.recv(x, src=1)" in err.stacks[0]
    assert "cell line 9, in <module>:  dist.recv(x, src=0)" in err.stacks[1]
    assert "rank 0 stuck at cell line 7: dist.recv(x, src=1);" in str(err)
    assert not _workers_alive()


def test_two_launches_at_once_do_not_collide():
    results, errors = [], []

    def go():
        try:
            results.append(launch.run(HELLO, 2, timeout=120).text())
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=go) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results == [results[0]] * 2 and "sum 3" in results[0]


def test_interrupt_kills_every_rank(tmp_path, facilities):
    marker = tmp_path / "started"
    script = textwrap.dedent(f"""
        import signal
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a kernel, even if started with SIGINT ignored
        from megalab.lab import launch
        code = "import time, pathlib\\npathlib.Path({str(marker)!r}).touch()\\ntime.sleep(600)\\n"
        try:
            launch.run(code, 3, timeout=600)
        except KeyboardInterrupt:
            print("interrupted")
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), "ranks never started"
    assert _workers_alive()
    proc.send_signal(signal.SIGINT)  # what Jupyter's "interrupt kernel" does
    try:
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert "interrupted" in out
    assert not _workers_alive()


def test_a_killed_launcher_leaves_no_rank_behind(tmp_path, facilities):
    """SIGKILL the launcher (a crashed kernel: no cleanup runs): torchrun and every rank die with it, through the
    kernel's death signal on Linux, through threads watching their parent where there is none (macOS)."""
    script = textwrap.dedent(f"""
        from megalab.lab import launch
        code = (
            "import os, pathlib, threading, time\\n"
            "watching = any(t.name == 'megalab-parent-watch' for t in threading.enumerate())\\n"
            "pathlib.Path({str(tmp_path)!r}, os.environ['RANK']).write_text(str(watching))\\n"
            "time.sleep(600)\\n"
        )
        launch.run(code, 2, timeout=600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / r).exists() for r in "01") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all((tmp_path / r).exists() for r in "01"), "ranks never started"
        # the rank watches its parent itself exactly where the kernel cannot be asked to (portable)
        assert {(tmp_path / r).read_text() for r in "01"} == {str(facilities == "portable")}
        assert _workers_alive()
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30
        while _workers_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _workers_alive()
    finally:
        proc.kill()
        for pid in _workers_alive():
            os.kill(pid, signal.SIGKILL)


def _can_rename_host() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-u", "hostname", "megalab-probe"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_rename_host(), reason="needs `unshare -u` (root) to give the machine a hostname that does not resolve")
def test_a_hostname_that_does_not_resolve_does_not_stop_a_run_on_one_machine():
    """Many Macs have a hostname their DNS does not know. A one-machine run must not depend on it: its ranks meet
    on 127.0.0.1 (gloo and torchrun's rendezvous bound to loopback). Without that, torchrun waits forever."""
    script = "from megalab.lab import launch\nprint(launch.run(HELLO, 2, timeout=60).text(), end='')\n"
    host = f"megalab-nowhere-{os.getpid()}"
    out = subprocess.run(["unshare", "-u", "sh", "-c", f'hostname {host} && exec "$0" -c "$1"', sys.executable,
                          f"HELLO = {HELLO!r}\n" + script], capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == "".join(f"[rank {r}] hello from rank {r} of 2\n[rank {r}] sum 3\n" for r in range(2))


def test_bad_requests_are_clear_errors(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(LaunchError, match="this machine has none.*--backend gloo \\(or auto\\) to run the cell on CPU"):
        launch.run("pass", 2, backend="nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(LaunchError, match="needs 4 CUDA devices.*1 is visible. Start at most 1 rank per node \\(-n 1\\), "
                                          "or use --backend gloo"):
        launch.run("pass", 4, backend="nccl")
    assert launch.resolve_backend("auto", 4) == "gloo" and launch.resolve_backend("auto", 1) == "nccl"
    with pytest.raises(LaunchError, match="ranks must lie in 0..1"):
        launch.run("pass", 2, ranks="0,5")
    with pytest.raises(LaunchError, match="--rdzv-endpoint"):
        launch.run("pass", 1, nnodes=2)



def test_slurm_outside_an_allocation_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(LaunchError, match="needs a Slurm allocation"):
        launch.run("pass", 1, slurm=True)


def test_two_nodes_on_one_machine_static_rendezvous():
    endpoint = f"127.0.0.1:{launch.free_port()}"
    results = {}

    def node(rank):
        results[rank] = launch.run(HELLO, 2, nnodes=2, node_rank=rank, rdzv_endpoint=endpoint, timeout=120)

    threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0].text() == "[rank 0] hello from rank 0 of 4\n[rank 0] sum 10\n[rank 1] hello from rank 1 of 4\n[rank 1] sum 10\n"
    assert results[1].results == {"square": {2: 4, 3: 9}}


# srun as Slurm runs it, on one machine: its command once per "node", each in a session of its own (a remote
# node's processes are not in the launcher's process group); SIGINT/SIGTERM are forwarded to the tasks.
# Nodes from FAKE_SRUN_FIRST_REMOTE on (default: all but the first) carry MEGALAB_FAKE_REMOTE=1:
# `_hide_remote_nodes` keeps the launcher from seeing them.
FAKE_SRUN = """\
#!/usr/bin/env python3
import os, signal, subprocess, sys
args = sys.argv[1:]
first = next(i for i, a in enumerate(args) if not a.startswith("--"))
options, cmd = args[:first], args[first:]
nodes = int(next(a.split("=")[1] for a in options if a.startswith("--nodes=")))
with open(os.environ["FAKE_SRUN_LOG"], "a") as log:
    log.write(" ".join(options) + "\\n")
remote = int(os.environ.get("FAKE_SRUN_FIRST_REMOTE", "1"))
procs = [subprocess.Popen(cmd, start_new_session=True, env={**os.environ, "SLURM_NODEID": str(i), "SLURM_STEP_ID": "0",
                                                           **({"MEGALAB_FAKE_REMOTE": "1"} if i >= remote else {})})
         for i in range(nodes)]
def forward(signum, frame):
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
signal.signal(signal.SIGINT, forward)
signal.signal(signal.SIGTERM, forward)
sys.exit(max(abs(p.wait()) for p in procs))
"""


def _fake_slurm(tmp_path, monkeypatch, nodes=2):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\n" + "echo localhost\n" * nodes)
    (bin_dir / "srun").write_text(FAKE_SRUN)
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NODELIST", f"node[1-{nodes}]")
    monkeypatch.setenv("FAKE_SRUN_LOG", str(tmp_path / "srun.log"))


def _hide_remote_nodes(monkeypatch):
    """The launcher sees only its own node's processes, as on a real cluster."""
    real = launch._processes

    def local_only():
        table = real()
        remote = set()
        for pid in table:
            try:
                if b"MEGALAB_FAKE_REMOTE=1" in Path(f"/proc/{pid}/environ").read_bytes():
                    remote.add(pid)
            except OSError:
                continue
        return {pid: row for pid, row in table.items() if pid not in remote}

    monkeypatch.setattr(launch, "_processes", local_only)


def test_slurm_allocation_runs_torchrun_on_every_node(tmp_path, monkeypatch):
    """A fake srun/scontrol pair: srun starts its command once per node, as Slurm would."""
    _fake_slurm(tmp_path, monkeypatch)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "6")
    cmd = launch.torchrun_command(Path("cell.py"), 2, slurm=True, rdzv_endpoint="localhost:1234")
    assert cmd[:2] == ["srun", "--nodes=2"] and "--rdzv-backend=c10d" in cmd and "--rdzv-id=megalab-4242" in cmd
    assert "--cpus-per-task=6" in cmd and "--overlap" in cmd and "--node-agent" in cmd
    res = launch.run_function(_rank_and_arg, 2, 5, launch=dict(slurm=True, cwd=tmp_path, timeout=120, keep_run_dir=True))
    assert res.world_size == 4
    assert res.returns == {0: (0, 4, 5), 1: (1, 4, 5), 2: (2, 4, 5), 3: (3, 4, 5)}
    assert "--cpus-per-task=" in (tmp_path / "srun.log").read_text()
    # everything the ranks read lives in the run dir on the shared filesystem, nothing in a node's own /tmp
    assert res.run_dir.parent == tmp_path / ".megalab" / "runs"
    cell = (res.run_dir / "cell.py").read_text()
    assert "b64decode" in cell and "megalab-args" not in cell  # the arguments are in the script, not in a file


def test_slurm_rendezvous_port_is_never_fixed(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "123456")
    monkeypatch.delenv("SLURMD_NODENAME", raising=False)
    monkeypatch.setattr(launch.socket, "getaddrinfo", lambda host, port: [])  # the cluster's names resolve there
    assert launch.slurm_rdzv_endpoint(["gpu-a17", "gpu-a18"]) == "gpu-a17:23456"  # from the job id: not ours
    here = socket.gethostname().split(".")[0]
    host, _, port = launch.slurm_rdzv_endpoint([here, "gpu-b2"]).rpartition(":")
    assert host == here and port != "29500" and 1024 < int(port) < 65536  # a free port on this node


def test_slurm_timeout_leaves_no_rank_behind_on_any_node(tmp_path, monkeypatch):
    """A deadlocked multi-node cell, launched from a node outside the allocation (a login node): the launcher
    sees none of the ranks' processes, so killing srun is not enough; the node agents stop their ranks."""
    _fake_slurm(tmp_path, monkeypatch)
    monkeypatch.setenv("FAKE_SRUN_FIRST_REMOTE", "0")
    _hide_remote_nodes(monkeypatch)
    code = "from megalab.lab import dist as mdist\nimport time\nmdist.init()\ntime.sleep(600)\n"
    with pytest.raises(LaunchTimeoutError):
        launch.run(code, 1, slurm=True, cwd=tmp_path, timeout=6, hard_timeout=8)

    def left():  # this run's processes on any "node": torchrun, ranks, agents (the run dir is under tmp_path)
        marker = str(tmp_path).encode()
        return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p).find(marker) >= 0]

    deadline = time.monotonic() + 3
    while left() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left() and not _workers_alive(), "processes left running after a Slurm timeout"


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def test_shared_filesystem_results_are_awaited(tmp_path, monkeypatch):
    """Another node's files show late on NFS: the launcher waits for each node's exit file, each rank's .done
    and the values it lists, within SHARED_FS_WAIT."""
    run_dir = tmp_path
    (run_dir / "publish").mkdir()
    (run_dir / "node0.exit").write_text("0")
    (run_dir / "rank0.done").write_text('["returns.rank0.pkl"]')
    assert sorted(launch._missing_node_files(run_dir, 2, 2)) == ["node1.exit", "publish/returns.rank0.pkl", "rank1.done"]

    def late():
        time.sleep(0.6)
        for name in ("node1.exit", "rank1.done", "publish/returns.rank0.pkl"):
            (run_dir / name).write_text("[]")

    threading.Thread(target=late).start()
    start = time.monotonic()
    assert launch._await_nodes(run_dir, 2, 2, succeeded=True) and time.monotonic() - start >= 0.5
    monkeypatch.setattr(launch, "SHARED_FS_WAIT", 0.3)
    (run_dir / "node1.exit").unlink()
    assert not launch._await_nodes(run_dir, 2, 2, succeeded=True)


def test_omp_threads_come_from_the_cores_this_process_may_use(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    res = launch.run("import os\nprint(os.environ['OMP_NUM_THREADS'])", 2, timeout=120)
    assert res.stdout == {0: "3\n", 1: "3\n"}


def test_run_function_returns_per_rank():
    res = launch.run_function(_rank_and_arg, 3, 5, launch=dict(timeout=120))
    assert res.returns == {0: (0, 3, 5), 1: (1, 3, 5), 2: (2, 3, 5)}
    with pytest.raises(LaunchError, match="module-level"):
        launch.run_function(lambda: None, 1)


def _rank_and_arg(x):
    from megalab.lab import dist as mdist

    rank, world = mdist.init()
    return rank, world, x


def test_abort_after_the_cell_finished_does_not_fail_it():
    """The gloo teardown crash: a rank aborts (SIGABRT) after finishing the cell's code."""
    code = textwrap.dedent("""
        import os, threading, time, pathlib
        from megalab.lab import dist as mdist
        rank, world = mdist.init()
        done = pathlib.Path(os.environ["MEGALAB_RUN_DIR"]) / f"rank{rank}.done"
        def abort_after_done():
            while not done.exists():
                time.sleep(0.001)
            os.abort()                       # what "terminate called without an active exception" does
        if rank == 1:
            threading.Thread(target=abort_after_done, daemon=True).start()
            import torch.distributed as dist
            dist.barrier = lambda *a, **k: time.sleep(5)   # hold the teardown until the abort hits
        print("finished")
    """)
    res = launch.run(code, 2, timeout=60, keep_run_dir=True)
    assert res.text() == "[rank 0] finished\n[rank 1] finished\n"
    assert "SIGABRT" in (res.run_dir / "torchrun.log").read_text()  # the crash really happened
    shutil.rmtree(res.run_dir)
    assert not _workers_alive()


def test_progress_callback_sees_the_latest_line():
    seen = []
    code = "import time\nfor i in range(8):\n    print(f'step {i}', flush=True)\n    time.sleep(0.25)\n"
    launch.run(code, 1, on_progress=lambda elapsed, line: seen.append((elapsed, line)), timeout=60)
    assert seen and all(e >= 0 for e, _ in seen)
    assert any(line.startswith("step ") for _, line in seen)


def test_missing_node_times_out_with_a_rendezvous_diagnosis():
    endpoint = f"127.0.0.1:{launch.free_port()}"
    with pytest.raises(LaunchTimeoutError, match="no rank started within 8 s.*rendezvous") as info:
        launch.run(HELLO, 1, nnodes=2, node_rank=0, rdzv_endpoint=endpoint, timeout=8)
    assert info.value.stacks == {}
    assert info.value.kind == "not started"
    assert not _workers_alive()


def test_launch_errors_render_as_their_message_in_ipython():
    with pytest.raises(LaunchError) as info:
        launch.run("pass", 2, ranks="7")
    assert info.value._render_traceback_() == ["LaunchError: --ranks [7]: ranks must lie in 0..1"]


def test_interrupt_while_ranks_are_still_starting_leaves_none_behind():
    """Interrupt as soon as the first rank process exists: the others have not written pid files yet."""
    script = textwrap.dedent("""
        import signal
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from megalab.lab import launch
        try:
            launch.run("import time\\ntime.sleep(600)\\n", 4, timeout=600)
        except KeyboardInterrupt:
            print("interrupted")
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _workers_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert _workers_alive(), "no rank ever started"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert "interrupted" in out
    time.sleep(0.5)  # a rank caught between fork and exec shows up by now, if one escaped
    assert not _workers_alive()


@contextlib.contextmanager
def _loaded_machine(hogs: int):
    """`hogs` busy-loop processes for the duration of the block: a machine others are using too."""
    procs = []
    try:
        for _ in range(hogs):
            procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_computing_cell_on_a_loaded_machine_outlives_its_timeout():
    """Ranks still computing at the timeout go on (and say so) instead of failing like a deadlock."""
    code = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:\n    pass\nprint('done')\n"
    seen = []
    with _loaded_machine(3):
        start = time.monotonic()
        res = launch.run(code, 2, timeout=2, hard_timeout=120, on_progress=lambda elapsed, line: seen.append(line))
        elapsed = time.monotonic() - start
    assert elapsed > 2  # it needed more than its timeout
    assert res.text() == "[rank 0] done\n[rank 1] done\n"
    assert any("still computing past the 2 s timeout, machine overloaded?" in line and "load average" in line for line in seen)
    assert not _workers_alive()


def test_busy_loop_stops_at_the_hard_timeout_as_overloaded_not_deadlock(facilities):
    code = "x = 0\nwhile True:\n    x += 1\n"
    start = time.monotonic()
    with pytest.raises(LaunchTimeoutError) as info:  # 15 s: the rank must have started, even beside other tests
        launch.run(code, 1, timeout=1, hard_timeout=15)
    assert time.monotonic() - start >= 15  # not before the hard timeout (an upper bound would depend on the load)
    err = info.value
    assert err.kind == "overloaded"
    assert "cell still computing after" in str(err) and "not deadlocked" in str(err)
    assert "deadlock:" not in str(err) and "a deadlock" not in str(err)
    assert f"on {os.cpu_count()} cores, load average" in str(err)
    assert "rank 0 busy at cell line" in str(err)
    assert set(err.stacks) == {0} and "cell line" in err.stacks[0]
    assert not _workers_alive()


def test_ranks_not_started_on_one_node_never_suggest_multi_node_flags(tmp_path):
    # still starting at the hard timeout: overloaded, said with the ranks, cores and load
    with pytest.raises(LaunchTimeoutError) as info:
        launch.run("pass", 2, timeout=0.1, hard_timeout=0.5)
    err = info.value
    assert err.kind == "not started" and err.stacks == {}
    assert "torchrun was still starting them, the machine is overloaded (2 ranks on" in str(err)
    assert "load average" in str(err)
    # torchrun hangs without using CPU (here: asleep before it starts anything): stopped soon after the timeout
    (tmp_path / "sitecustomize.py").write_text(
        "import time\nif b'torch.distributed.run' in open('/proc/self/cmdline', 'rb').read():\n    time.sleep(60)\n"
    )
    with pytest.raises(LaunchTimeoutError) as info:
        launch.run("pass", 2, timeout=1, env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    idle = info.value
    assert idle.kind == "not started"
    assert "no rank started within 1 s, and torchrun has stopped using CPU" in str(idle)
    for message in (str(err), str(idle)):
        assert "--nnodes" not in message and "--rdzv-endpoint" not in message and "rendezvous" not in message
    assert not _workers_alive()
