"""JupyterHub + batchspawner on a real Slurm (course/slurm/jupyterhub_config.py): the hub spawns a learner's server
as a two-node Slurm job, on a workspace of their own made by the hub, and a `%%torchrun --slurm` cell run through
that server's kernel all-reduces across both nodes; stopping the server leaves no job behind.

Needs the `hub` extra (jupyterhub, batchspawner), configurable-http-proxy (npm) and Slurm (tests/slurm_cluster.py);
without them it skips with the command that installs them (MEGALAB_REQUIRE_HUB=1: it fails instead, as in CI).
"""

import asyncio
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.slurm_cluster import slurm_cluster  # noqa: F401  (the fixture)

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "course" / "slurm" / "jupyterhub_config.py"
BIN = Path(sys.executable).parent
CELL = """%%torchrun --slurm -n 1 --timeout 120
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} on node {os.environ['SLURM_NODEID']}: sum {t.item():g}")
dist.destroy_process_group()
"""


def _missing() -> str | None:
    if not (BIN / "jupyterhub").exists() or not (BIN / "batchspawner-singleuser").exists():
        return f"JupyterHub is not installed in {sys.prefix}: pip install -e '.[hub]'"
    if shutil.which("configurable-http-proxy") is None:
        return "configurable-http-proxy is not on PATH: npm install -g configurable-http-proxy (Node.js: apt-get install nodejs npm)"
    return None


@pytest.fixture
def hub_tools():
    why = _missing()
    if why:
        if os.environ.get("MEGALAB_REQUIRE_HUB") == "1":
            pytest.fail(why)
        pytest.skip(why)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Hub:
    """A JupyterHub started from the course's configuration, with a test service token and local ports."""

    def __init__(self, root: Path, cluster):
        self.root, self.cluster = root, cluster
        self.port, self.token = _free_port(), uuid.uuid4().hex
        self.user = pwd.getpwuid(os.getuid()).pw_name
        self.students = root / "students"
        self.students.mkdir()
        (root / "test_config.py").write_text(f"""
c = get_config()  # noqa
load_subconfig({str(CONFIG)!r})
# only for the test: one machine, this user, no sudo, a service token for the API
c.JupyterHub.bind_url = "http://127.0.0.1:{self.port}"
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = {_free_port()}
c.JupyterHub.hub_connect_ip = "127.0.0.1"
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{_free_port()}"
c.ConfigurableHTTPProxy.pid_file = {str(root / "proxy.pid")!r}
c.JupyterHub.db_url = "sqlite:///{root / 'hub.sqlite'}"
c.JupyterHub.cookie_secret_file = {str(root / "cookie_secret")!r}
c.JupyterHub.cleanup_servers = True
c.SlurmSpawner.exec_prefix = ""
c.SlurmSpawner.req_memory = ""
c.Spawner.args = {["--allow-root"] if os.getuid() == 0 else []!r}
c.Spawner.start_timeout = 240
c.JupyterHub.services = [{{"name": "megalab-test", "api_token": {self.token!r}}}]
c.JupyterHub.load_roles = [{{"name": "megalab-test", "services": ["megalab-test"],
                            "scopes": ["admin:users", "admin:servers", "access:servers"]}}]
""")
        env = {**cluster.env, "MEGALAB_COURSE": str(REPO), "MEGALAB_VENV": sys.prefix,
               "MEGALAB_STUDENTS": str(self.students), "MEGALAB_NODES": "2", "MEGALAB_CPUS": "2",
               "MEGALAB_RUNTIME": "00:20:00", "PATH": os.pathsep.join([str(BIN), cluster.env["PATH"]])}
        env.pop("PYTHONPATH", None)  # the learner's server gets its workspace on it, from the configuration
        self.log = open(root / "hub.log", "wb")
        self.proc = subprocess.Popen([str(BIN / "jupyterhub"), "-f", str(root / "test_config.py")], cwd=root, env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def api(self, method: str, path: str, timeout: float = 30, **kwargs):
        import httpx

        return httpx.request(method, f"http://127.0.0.1:{self.port}{path}", timeout=timeout,
                             headers={"Authorization": f"token {self.token}"}, **kwargs)

    def jobs(self) -> list[str]:
        """The Slurm jobs of the learner's servers (named megalab-USER by the configuration)."""
        out = self.cluster.run(["squeue", "-h", "-n", f"megalab-{self.user}", "-o", "%i"], check=False)
        return out.stdout.split()

    def logs(self) -> str:
        text = (self.root / "hub.log").read_text(errors="replace")[-6000:]
        jobs = sorted(self.students.glob("*/.megalab/jupyterhub-*.log"))
        return text + "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in jobs)

    def wait(self, what: str, ready, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the hub exited ({self.proc.returncode}) while waiting for {what}\n{self.logs()}")
            try:
                value = ready()
            except Exception:  # noqa: BLE001  (not up yet)
                value = None
            if value:
                return value
            time.sleep(0.5)
        raise AssertionError(f"{what}: not within {timeout:g} s\n{self.logs()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        pid = self.root / "proxy.pid"
        if pid.exists():  # the proxy outlives a killed hub
            try:
                os.kill(int(pid.read_text()), 15)
            except (ValueError, ProcessLookupError):
                pass
        self.log.close()
        deadline = time.monotonic() + 30  # the proxy and the learner's server end shortly after the hub
        while _left_running(self.root) and time.monotonic() < deadline:
            time.sleep(0.5)


def _left_running(root: Path) -> list[str]:
    """Processes whose working folder or command line is under `root` (the hub, its proxy, a learner's server)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if cwd.startswith(str(root)) or str(root) in cmd:
            found.append(f"{entry.name}: {cmd[:200]}")
    return found


async def _execute(url: str, token: str, code: str, timeout: float) -> tuple[str, list[dict]]:
    """Run `code` in a kernel over its websocket: (its stdout + stderr, its error messages)."""
    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    ws = await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {token}"}))
    msg_id, session = uuid.uuid4().hex, uuid.uuid4().hex
    ws.write_message(json.dumps({
        "header": {"msg_id": msg_id, "username": "test", "session": session, "msg_type": "execute_request",
                   "version": "5.3"},
        "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
        "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {}, "allow_stdin": False,
                    "stop_on_error": True}}))
    text, errors = [], []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        raw = await asyncio.wait_for(ws.read_message(), timeout=max(deadline - time.monotonic(), 1))
        if raw is None:
            break
        msg = json.loads(raw)
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind = msg["msg_type"]
        if kind == "stream":
            text.append(msg["content"]["text"])
        elif kind == "error":
            errors.append(msg["content"])
        elif kind == "status" and msg["content"]["execution_state"] == "idle":
            break
    ws.close()
    return "".join(text), errors


def test_a_learner_server_spawned_by_jupyterhub_on_slurm_runs_a_torchrun_slurm_cell(hub_tools, slurm_cluster, tmp_path):  # noqa: F811
    start = time.monotonic()
    hub = Hub(tmp_path, slurm_cluster)

    def phase(what: str) -> None:  # where the time goes (pytest -s shows it)
        print(f"{time.monotonic() - start:6.1f} s  {what}")

    try:
        hub.wait("the hub's API", lambda: hub.api("GET", "/hub/api/").status_code == 200, 90)
        phase("hub up")
        user = hub.user
        assert hub.api("POST", f"/hub/api/users/{user}").status_code in (201, 409)
        assert hub.api("POST", f"/hub/api/users/{user}/server", timeout=120).status_code in (201, 202), hub.logs()
        hub.wait("the learner's server", lambda: hub.api("GET", f"/hub/api/users/{user}").json()["servers"][""]["ready"],
                 240)
        phase("the learner's server is up in its Slurm job")
        jobs = hub.jobs()  # the learner's job, by its name
        assert len(jobs) == 1 and slurm_cluster.job_field(jobs[0], "NumNodes") == "2"
        workspace = hub.students / user
        assert (workspace / ".megalab" / "workspace.json").is_file()  # made by the hub's pre-spawn hook

        kernel = hub.api("POST", f"/user/{user}/api/kernels", json={"name": "python3"}, timeout=60)
        assert kernel.status_code == 201, kernel.text
        url = f"ws://127.0.0.1:{hub.port}/user/{user}/api/kernels/{kernel.json()['id']}/channels"
        where, _ = asyncio.run(_execute(url, hub.token, "import megalab, os; print(megalab.__file__); "
                                        "print(os.environ['SLURM_JOB_ID'])", 60))
        assert where.split() == [str(workspace / "megalab" / "__init__.py"), jobs[0]]  # their megalab, in the job
        out, errors = asyncio.run(_execute(url, hub.token, "%load_ext megalab", 120))
        assert not errors, errors
        phase("kernel up, megalab loaded")
        out, errors = asyncio.run(_execute(url, hub.token, CELL, 300))
        assert not errors, (errors, out, hub.logs())
        said = re.findall(r"^\[rank (\d)\] rank \1 of 2 on node (\d): sum 3$", out, re.M)
        assert sorted(rank for rank, _ in said) == ["0", "1"] and sorted(node for _, node in said) == ["0", "1"], out
        phase("the %%torchrun --slurm cell ran on both nodes")

        assert hub.api("DELETE", f"/hub/api/users/{user}/server", timeout=120).status_code in (202, 204)
        hub.wait("the learner's job to end", lambda: not hub.jobs(), 120)
        phase("server stopped, job gone")
        hub.stop()
        assert not _left_running(tmp_path), "still running after the hub stopped"
    finally:
        hub.stop()
        for job in hub.jobs():
            slurm_cluster.cancel(job)
