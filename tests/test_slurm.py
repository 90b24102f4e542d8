"""The `--slurm` path on a real Slurm (tests/slurm_cluster.py: two slurmd "nodes" on this machine).

One cluster and one two-node allocation serve the whole file; each launch is one rank per node. In most tests
the launcher sees only the first node's processes, as a notebook on a cluster does (`_other_node_hidden`): what
it knows of the other node comes through the node agents and the shared run folder.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megalab.lab import launch
from megalab.lab.launch import LaunchError, LaunchTimeoutError, RankFailedError
from tests.slurm_cluster import slurm_cluster  # noqa: F401  (the session fixture)

REPO = Path(__file__).resolve().parent.parent

ALLREDUCE = """\
import os, torch, torch.distributed as dist
from megalab.lab import dist as mdist
rank, world = mdist.init()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(f"rank {rank} of {world} on {os.environ['SLURMD_NODENAME']}: sum {t.item():g}")
mdist.publish("node", os.environ["SLURMD_NODENAME"])
mdist.publish("total", t.item())
"""


@pytest.fixture(scope="module")
def job(slurm_cluster):  # noqa: F811
    """A two-node allocation held for the module (as `salloc -N2` gives a learner)."""
    alloc = slurm_cluster.allocate(nodes=2, name="megalab-tests")
    yield alloc
    alloc.release()


@pytest.fixture
def in_job(job, monkeypatch, tmp_path):
    """This process inside the allocation (salloc's environment); tmp_path is the notebook's folder."""
    for key in [k for k in os.environ if k.startswith("SLURM")]:
        monkeypatch.delenv(key)
    for key, value in job.env.items():
        if key.startswith("SLURM") or key == "PATH":
            monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    return job


def _other_node_hidden(monkeypatch) -> None:
    """The launcher sees no process of the allocation's other node (SLURM_NODEID 1), as on a real cluster."""
    real_processes, real_is_ours = launch._processes, launch._is_our_worker

    def remote(pid: int) -> bool:
        try:
            return b"\0SLURM_NODEID=1\0" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            return False

    monkeypatch.setattr(launch, "_processes", lambda: {p: row for p, row in real_processes().items() if not remote(p)})
    monkeypatch.setattr(launch, "_is_our_worker", lambda pid, run_dir: not remote(pid) and real_is_ours(pid, run_dir))


def _left_running(cluster, folder: Path) -> list[str]:
    """Slurm steps still running, and processes whose command line names `folder` (agents, torchrun, ranks)."""
    marker = str(folder).encode()
    procs = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes():
                    procs.append(entry.name)
            except OSError:
                continue
    return cluster.steps() + procs


def _assert_nothing_left(cluster, folder: Path, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while (left := _left_running(cluster, folder)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"still running after the cell: {left}"
    runs = folder / ".megalab" / "runs"
    assert not runs.exists() or not list(runs.iterdir()), f"run folders left: {list(runs.iterdir())}"


CRASH = """\
import os
from megalab.lab import dist as mdist
mdist.init()
if os.environ["SLURM_NODEID"] == "1":
    raise ValueError("bad shard on the second node")
import torch.distributed as dist
dist.barrier()
"""


def _run_folder(runs: Path, pid: int) -> Path:
    """A run folder as a launcher with process `pid` on this host leaves it."""
    folder = runs / f"megalab-run-{pid}"
    folder.mkdir(parents=True)
    (folder / "launcher.json").write_text(json.dumps({"host": socket.gethostname(), "pid": pid}))
    return folder


def test_a_crash_on_the_other_node_is_named(in_job, slurm_cluster, monkeypatch, tmp_path):  # noqa: F811
    """Also: the cell is one Slurm step named after it, and the folder a restarted kernel left is cleaned."""
    _other_node_hidden(monkeypatch)
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale, live = _run_folder(tmp_path / ".megalab" / "runs", gone.pid), _run_folder(tmp_path / ".megalab" / "runs", os.getpid())
    steps: list[str] = []

    def on_progress(elapsed, last):
        if not steps:
            steps.extend(slurm_cluster.steps())

    with pytest.raises(RankFailedError) as err:
        launch.run(CRASH, 1, slurm=True, timeout=120, name="ch01 cell7", on_progress=on_progress)
    other = in_job.nodes[1]
    assert "ValueError: bad shard on the second node" in str(err.value)
    assert f"on node {other}" in str(err.value), str(err.value)
    assert 'raise ValueError("bad shard on the second node")' in err.value.details
    assert steps and all(s.split()[1] == "megalab-ch01-cell7" for s in steps), steps  # one step, named after the cell
    assert not stale.exists() and live.exists()  # a live kernel's run is not touched
    live.joinpath("launcher.json").unlink()
    live.rmdir()
    _assert_nothing_left(slurm_cluster, tmp_path)


def test_the_first_traceback_is_shown_when_the_ranks_cannot_start(tmp_path):
    """The cause is at the top of torchrun's log; its last lines are the launcher's own report of the failure."""
    log = ("Traceback (most recent call last):\n  File \"worker.py\", line 9, in main\n"
           "    run_dir = Path(os.environ[\"MEGALAB_RUN_DIR\"])\nKeyError: 'MEGALAB_RUN_DIR'\n"
           + "torch.distributed.elastic: worker group failed, restarting nothing\n" * 100)
    err = launch._failure_error(tmp_path, 2, log, slurm=True)
    assert isinstance(err, LaunchError) and "KeyError: 'MEGALAB_RUN_DIR'" in str(err), str(err)
    assert "megalab doctor --slurm" in str(err)


DEADLOCK = """\
import os, time, torch, torch.distributed as dist
from megalab.lab import dist as mdist
rank, world = mdist.init()
if os.environ["SLURM_NODEID"] == "1":
    dist.recv(torch.zeros(1), src=1 - rank)  # waits for a send that never comes
else:
    dist.barrier()  # waits for the other node
"""


def test_a_deadlock_report_shows_every_nodes_ranks(in_job, slurm_cluster, monkeypatch, tmp_path):  # noqa: F811
    _other_node_hidden(monkeypatch)
    with pytest.raises(LaunchTimeoutError) as err:
        launch.run(DEADLOCK, 1, slurm=True, timeout=6, hard_timeout=300)  # importing torch may take long
    e = err.value
    assert e.kind == "deadlock" and sorted(e.stacks) == [0, 1], (e.kind, str(e))
    text = str(e)
    assert "dist.recv(torch.zeros(1), src=1 - rank)" in text and "dist.barrier()" in text, text
    assert all(f"(node {n})" in text for n in in_job.nodes), text
    _assert_nothing_left(slurm_cluster, tmp_path)


SLOW_ON_THE_OTHER_NODE = """\
import os, time, torch.distributed as dist
from megalab.lab import dist as mdist
rank, world = mdist.init()
if os.environ["SLURM_NODEID"] == "1":
    used = time.process_time()
    while time.process_time() - used < float(os.environ["BUSY_SECONDS"]):  # CPU work, past the timeout
        sum(range(10_000))
dist.barrier()
print("done")
"""


def test_a_slow_cell_on_the_other_node_is_not_a_deadlock(in_job, slurm_cluster, monkeypatch, tmp_path):  # noqa: F811
    """The busy rank is on the node the launcher cannot see; the waiting one is on its own node."""
    _other_node_hidden(monkeypatch)
    res = launch.run(SLOW_ON_THE_OTHER_NODE, 1, slurm=True, timeout=5, hard_timeout=300,
                     env={"BUSY_SECONDS": "6"})
    assert res.text() == "[rank 0] done\n[rank 1] done\n"
    _assert_nothing_left(slurm_cluster, tmp_path)


SLEEPER = """\
import time
from megalab.lab import dist as mdist
mdist.init()
print("ready", flush=True)
time.sleep(600)
"""


def _when_both_ranks_run(folder: Path) -> bool:
    return any(len(list(run.glob("rank*.out"))) == 2 and all(p.stat().st_size for p in run.glob("rank*.out"))
               for run in (folder / ".megalab" / "runs").glob("megalab-run-*"))


def test_the_stop_button_stops_every_node(in_job, slurm_cluster, monkeypatch, tmp_path):  # noqa: F811
    _other_node_hidden(monkeypatch)

    def stop_button(elapsed, last):
        if _when_both_ranks_run(tmp_path):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        launch.run(SLEEPER, 1, slurm=True, timeout=300, on_progress=stop_button)
    _assert_nothing_left(slurm_cluster, tmp_path)


def test_scancel_of_the_step_ends_the_cell(in_job, slurm_cluster, tmp_path):  # noqa: F811
    """An instructor's `scancel JOB.STEP`: the cell fails at once, saying so, and nothing is left."""
    def cancel():
        deadline = time.monotonic() + 120
        while not _when_both_ranks_run(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.2)
        for step in slurm_cluster.steps():
            slurm_cluster.run(["scancel", step.split()[0]], check=False)

    canceller = threading.Thread(target=cancel)
    canceller.start()
    try:
        with pytest.raises((RankFailedError, LaunchError)) as err:
            launch.run(SLEEPER, 1, slurm=True, timeout=300)
    finally:
        canceller.join()
    assert "cancel" in str(err.value).lower() or "killed" in str(err.value).lower(), str(err.value)
    _assert_nothing_left(slurm_cluster, tmp_path)


DRIVER = """\
import json, sys
from megalab.lab import launch
res = launch.run(sys.stdin.read(), 1, slurm=True, timeout=120)
print(json.dumps({"total": res.results["total"], "node": res.results["node"]}))
"""


def _driver_env(env: dict[str, str]) -> dict[str, str]:
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def test_two_learners_at_once(slurm_cluster, tmp_path):  # noqa: F811
    """Two learners, each with an allocation of their own on the same two nodes, run a cell at the same time."""
    jobs = [slurm_cluster.allocate(nodes=2, name=f"learner{i}") for i in (1, 2)]
    try:
        folders = [tmp_path / f"learner{i}" for i in (1, 2)]
        procs = []
        for alloc, folder in zip(jobs, folders):
            folder.mkdir()
            procs.append(subprocess.Popen([sys.executable, "-c", DRIVER], cwd=folder, env=_driver_env(alloc.env),
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
        outs = [p.communicate(ALLREDUCE, timeout=300) for p in procs]
        for proc, (out, err) in zip(procs, outs):
            assert proc.returncode == 0, err
            assert json.loads(out.strip().splitlines()[-1])["total"] == {"0": 3.0, "1": 3.0}
        for folder in folders:
            _assert_nothing_left(slurm_cluster, folder)
    finally:
        for alloc in jobs:
            alloc.release()


def test_a_job_submitted_with_export_none(slurm_cluster, tmp_path):  # noqa: F811
    """JupyterLab's job as batchspawner submits it (`--export=NONE`): megalab's srun still gives the ranks
    their run folder and the learner's PYTHONPATH."""
    (tmp_path / "cell.py").write_text(ALLREDUCE)
    (tmp_path / "driver.py").write_text(DRIVER)
    script = (f"#!/bin/bash\nexport PYTHONPATH={REPO}\ncd {tmp_path}\n"
              f"env | grep -c ^SLURM_EXPORT_ENV=NONE > export.txt || true\n"
              f"{sys.executable} driver.py < cell.py > result.json 2> error.txt\n")
    job_id = slurm_cluster.sbatch(script, "--export=NONE", "--nodes=2", "--ntasks-per-node=1",
                                  f"--output={tmp_path / 'job.out'}", cwd=tmp_path)
    state = slurm_cluster.wait_job(job_id, timeout=300)
    assert (tmp_path / "export.txt").read_text().strip() == "1"  # the job's srun would inherit NONE
    error = (tmp_path / "error.txt").read_text()
    assert state == "COMPLETED", f"{state}: {error}"
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["total"] == {"0": 3.0, "1": 3.0}  # an all-reduce across the two nodes
    assert sorted(result["node"].values()) == sorted(slurm_cluster.nodes)  # one rank on each
    _assert_nothing_left(slurm_cluster, tmp_path)


def test_an_unresolvable_node_name_fails_fast(slurm_cluster, monkeypatch, tmp_path):  # noqa: F811
    """Launched from outside the allocation (a login node), the rendezvous is on the first node, whose name must
    resolve: a clear error at once, not a wait for the timeout."""
    monkeypatch.setenv("PATH", slurm_cluster.env["PATH"])
    monkeypatch.setenv("SLURM_CONF", slurm_cluster.env["SLURM_CONF"])
    monkeypatch.setenv("SLURM_JOB_ID", "999")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "megalab-no-such-node[1-2]")
    monkeypatch.delenv("SLURMD_NODENAME", raising=False)
    with pytest.raises(LaunchError, match="megalab-no-such-node1.*does not resolve"):
        launch.run("pass", 1, slurm=True, cwd=tmp_path, timeout=300)


def test_the_sbatch_template_fits_a_cpu_partition(slurm_cluster, tmp_path):  # noqa: F811
    """course/slurm/jupyterlab.sbatch as it is: Slurm would start it on CPU-only nodes."""
    out = slurm_cluster.run(["sbatch", "--test-only", str(REPO / "course" / "slurm" / "jupyterlab.sbatch")],
                            check=False, cwd=tmp_path)
    assert out.returncode == 0 and "to start at" in out.stderr, out.stderr


def test_doctor_slurm_in_an_allocation(job, slurm_cluster, tmp_path):  # noqa: F811
    out = subprocess.run([sys.executable, "-m", "megalab.lab.cli", "doctor", "--slurm"], cwd=tmp_path,
                         env=_driver_env(job.env), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert re.search(r"srun +slurm\S* +\d+\.\d+", text), text
    assert re.search(r"shared run folder +ok", text) and re.search(r"node names resolve +ok", text), text
    assert re.search(r"GPUs per node +0 ", text) and "All checks passed." in text, text
    bad = subprocess.run([sys.executable, "-m", "megalab.lab.cli", "doctor", "--slurm"], cwd=tmp_path,
                         env=_driver_env({**job.env, "SLURM_EXPORT_ENV": "NONE"}), capture_output=True, text=True,
                         timeout=180)
    assert bad.returncode == 1 and "SLURM_EXPORT_ENV=NONE" in bad.stdout, bad.stdout + bad.stderr
    _assert_nothing_left(slurm_cluster, tmp_path)
