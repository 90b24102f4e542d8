"""A real Slurm on this machine, for tests: munged, slurmctld and two slurmd "nodes" in a private folder.

    from tests.slurm_cluster import slurm_cluster  # noqa: F401  (the pytest fixture, session scope)

    def test_x(slurm_cluster):
        out = slurm_cluster.run(["srun", "-N2", "hostname"])
        job = slurm_cluster.allocate(nodes=2)          # an allocation, as `salloc --no-shell` gives
        launch.run(code, 1, slurm=True, env=..., cwd=...) under job.env

Debian's packages (`apt-get install slurmctld slurmd slurm-client munge`, 22.05 in bookworm) give two nodes on
one host: `slurmd -N NAME` with a `Port=` of its own per node. The nodes are named after names that resolve
to this machine (its host name and `localhost`), so a rendezvous on "the first node" works as on a cluster.
Nothing in /etc is read or changed: the daemons get their own slurm.conf, munge key and socket, state and
log folders, and free ports, all under one temporary folder; every process is stopped by PID at the end,
and every wait is bounded. Without the packages the tests skip with the command that installs them; with
MEGALAB_REQUIRE_SLURM=1 (CI, .ci/run) they fail instead.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

INSTALL = "sudo apt-get install slurmctld slurmd slurm-client munge"
DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("srun", "sbatch", "salloc", "squeue", "scancel", "scontrol", "sinfo")
START_TIMEOUT = 60.0  # seconds for munged + slurmctld + the nodes to come up (a loaded CI machine)
CPUS_PER_NODE = 4  # what each node offers (more than this machine has: config_overrides), so two learners fit


def _find(name: str) -> str | None:
    return shutil.which(name) or next((p for d in ("/usr/sbin", "/sbin") if os.access(p := f"{d}/{name}", os.X_OK)), None)


def missing() -> list[str]:
    """The Slurm/munge programs this machine lacks."""
    return [n for n in (*DAEMONS, *COMMANDS) if not _find(n)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_names() -> list[str]:
    """Two names that resolve to this machine: its host name and localhost (then /etc/hosts' other aliases)."""
    candidates = [socket.gethostname().split(".")[0], "localhost", "ip6-localhost", "localhost.localdomain"]
    names: list[str] = []
    for name in candidates:
        try:
            socket.getaddrinfo(name, None)
        except OSError:
            continue
        if name not in names:
            names.append(name)
    return names[:2]


@dataclass
class Allocation:
    """A Slurm job holding nodes (what `salloc` gives a shell): `env` is what a process in it sees."""

    cluster: SlurmCluster
    job_id: str
    nodes: list[str]
    env: dict[str, str]

    def release(self) -> None:
        self.cluster.cancel(self.job_id)


@dataclass
class SlurmCluster:
    """A running private Slurm: `env` (SLURM_CONF, PATH) for every Slurm command, `nodes` its node names,
    `root` the private folder (logs in root/log), `run(cmd)` a Slurm command with that env."""

    root: Path
    env: dict[str, str]
    nodes: list[str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def run(self, cmd: list[str] | str, timeout: float = 60, check: bool = True, env: dict[str, str] | None = None,
            **kwargs) -> subprocess.CompletedProcess:
        """Run a command (a list, or a shell line) with the cluster's environment; text output captured."""
        full_env = {**self.env, **(env or {})}
        out = subprocess.run(cmd, shell=isinstance(cmd, str), env=full_env, capture_output=True, text=True,
                             timeout=timeout, **kwargs)
        if check and out.returncode != 0:
            raise RuntimeError(f"{cmd} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}\n{self.logs()}")
        return out

    def logs(self, chars: int = 3000) -> str:
        """The daemons' latest log lines (for a failing test's message)."""
        parts = []
        for path in sorted((self.root / "log").glob("*.log")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)

    def allocate(self, nodes: int = 2, cpus_per_task: int = 1, name: str = "megalab-test",
                 extra: list[str] | None = None) -> Allocation:
        """`salloc --no-shell`: a job holding `nodes` nodes until `release()`; its env as salloc's shell sees it."""
        out = self.run(["salloc", "--no-shell", f"--nodes={nodes}", "--ntasks-per-node=1",
                        f"--cpus-per-task={cpus_per_task}", f"--job-name={name}", "--immediate=30", *(extra or [])],
                       timeout=60)
        job_id = next(w for w in (out.stdout + out.stderr).split() if w.isdigit())
        nodelist = self.job_field(job_id, "NodeList")
        hosts = self.run(["scontrol", "show", "hostnames", nodelist]).stdout.split()
        env = {**self.env, "SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id, "SLURM_JOB_NODELIST": nodelist,
               "SLURM_NODELIST": nodelist, "SLURM_JOB_NUM_NODES": str(len(hosts)),
               "SLURM_CPUS_PER_TASK": str(cpus_per_task), "SLURM_CLUSTER_NAME": "megalab"}
        return Allocation(self, job_id, hosts, env)

    def job_field(self, job_id: str, key: str) -> str:
        out = self.run(["scontrol", "show", "job", job_id]).stdout
        for word in out.split():
            if word.startswith(f"{key}="):
                return word.split("=", 1)[1]
        raise KeyError(f"{key} not in job {job_id}: {out}")

    def sbatch(self, script: str, *options: str, cwd: Path | None = None) -> str:
        """Submit a batch script (its text); returns the job id."""
        path = Path(tempfile.mkstemp(suffix=".sbatch", dir=self.root)[1])
        path.write_text(script)
        out = self.run(["sbatch", "--parsable", *options, str(path)], cwd=cwd)
        return out.stdout.strip().split(";")[0]

    def wait_job(self, job_id: str, timeout: float = 120) -> str:
        """Wait (bounded) until the job has left the queue; its final state from scontrol (while Slurm keeps it)."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            out = self.run(["scontrol", "-o", "show", "job", job_id], check=False)
            state = next((w.split("=", 1)[1] for w in out.stdout.split() if w.startswith("JobState=")), "GONE")
            if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
                return state
            time.sleep(0.3)
        raise TimeoutError(f"job {job_id} still {state} after {timeout:g} s\n{self.logs()}")

    def steps(self) -> list[str]:
        """Job steps running now (`squeue --steps`), batch/extern steps left out."""
        out = self.run(["squeue", "--steps", "-h", "-o", "%i %j"], check=False).stdout.split("\n")
        return [line for line in out if line.strip() and not line.split()[0].endswith((".batch", ".extern"))]

    def jobs(self) -> list[str]:
        return self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()

    def cancel(self, job_id: str, timeout: float = 30) -> None:
        """scancel the job and wait (bounded) until Slurm no longer lists it as running."""
        self.run(["scancel", job_id], check=False)
        deadline = time.monotonic() + timeout
        while job_id in self.jobs() and time.monotonic() < deadline:
            time.sleep(0.2)

    # ------------------------------------------------------------------ lifecycle

    def _start(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")
        self.procs[name] = subprocess.Popen(cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def start(self) -> None:
        root, user = self.root, pwd.getpwuid(os.getuid()).pw_name
        for sub in ("log", "state", "spool", "munge"):
            (root / sub).mkdir(mode=0o700)
        key = root / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o600)
        socket_path = root / "munge" / "munge.sock"
        self._start("munged", [_find("munged"), "--foreground", "--force", f"--key-file={key}",
                               f"--socket={socket_path}", f"--pid-file={root / 'munge' / 'munged.pid'}",
                               f"--log-file={root / 'log' / 'munged.log'}", f"--seed-file={root / 'munge' / 'seed'}"])
        ctld_port = _free_port()
        here = socket.gethostname().split(".")[0]
        lines = [
            "ClusterName=megalab",
            f"SlurmctldHost={here}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmUser={user}",
            f"SlurmdUser={user}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={socket_path}",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}/%n",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'spool'}/%n.pid",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log'}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "SchedulerType=sched/builtin",
            "KillWait=3",
            "MinJobAge=60",
            "InactiveLimit=0",
            "SlurmdTimeout=60",
            "MessageTimeout=20",
            "PrologFlags=NoHold",
        ]
        for name in self.nodes:
            lines.append(f"NodeName={name} NodeHostname={here} NodeAddr=127.0.0.1 Port={_free_port()} "
                         f"CPUs={CPUS_PER_NODE} RealMemory=1000 State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        for name in self.nodes:
            (root / "spool" / name).mkdir()

        deadline = time.monotonic() + START_TIMEOUT
        while not socket_path.exists():
            self._check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start within {START_TIMEOUT:g} s\n{self.logs()}")
            time.sleep(0.1)
        self._start("slurmctld", [_find("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for name in self.nodes:
            self._start(f"slurmd-{name}", [_find("slurmd"), "-D", "-f", str(self.conf), "-N", name])
        while True:
            self._check_alive()
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False, timeout=30)
            states = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
            if all(states.get(n) == "idle" for n in self.nodes):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Slurm nodes are not idle after {START_TIMEOUT:g} s: {states}\n{self.logs()}")
            time.sleep(0.3)

    def _check_alive(self) -> None:
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
        if dead:
            raise RuntimeError(f"Slurm daemons exited: {dead}\n{self.logs()}")

    def _leftovers(self) -> list[int]:
        """Processes the daemons started and left behind (slurmstepd detaches from slurmd): found by the
        marker in their environment, which slurmd passes on to slurmstepd."""
        marker = f"MEGALAB_SLURM_FIXTURE={self.root}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    if marker in (entry / "environ").read_bytes():
                        pids.append(int(entry.name))
                except OSError:
                    continue
        return pids

    def stop(self) -> None:
        """scancel every job, then stop the daemons and what they left, by PID; bounded."""
        try:
            if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
                for job in self.jobs():
                    self.cancel(job, timeout=10)
        except (OSError, subprocess.SubprocessError):
            pass
        for name in [n for n in self.procs if n.startswith("slurmd")] + ["slurmctld", "munged"]:
            proc = self.procs.get(name)
            if proc and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while (pids := self._leftovers()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)


def start_cluster() -> SlurmCluster:
    """Start a private two-node Slurm (the caller must `stop()` it)."""
    root = Path(tempfile.mkdtemp(prefix="megalab-slurm-"))
    os.chmod(root, 0o700)
    names = node_names()
    if len(names) < 2:
        raise RuntimeError(f"need two names that resolve to this machine for the two nodes, found {names}")
    bins = {str(Path(p).parent) for p in map(_find, COMMANDS) if p}
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf"), "MEGALAB_SLURM_FIXTURE": str(root),
           "PATH": os.pathsep.join([*bins, os.environ.get("PATH", "")])}
    for key in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_")) and k != "SLURM_CONF"]:
        del env[key]  # a developer's own allocation must not leak into the private cluster
    cluster = SlurmCluster(root, env, names)
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="session")
def slurm_cluster():
    """The private two-node Slurm, shared by every test of the session; skipped without the packages
    (failed instead with MEGALAB_REQUIRE_SLURM=1)."""
    lacking = missing()
    if lacking:
        message = f"Slurm is not installed ({', '.join(lacking)} missing): {INSTALL}"
        if os.environ.get("MEGALAB_REQUIRE_SLURM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)
