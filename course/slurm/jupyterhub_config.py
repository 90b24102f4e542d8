"""JupyterHub for a megalab class on a Slurm cluster: each learner logs in, gets JupyterLab in a Slurm job of
their own (batchspawner), on their own workspace, with the course's kernel. Tested on a real two-node Slurm
(tests/test_jupyterhub.py). Recipe: course/INSTRUCTORS.md, "JupyterHub".

    pip install -e '.[hub]'                     # jupyterhub and batchspawner, in the course's environment
    npm install -g configurable-http-proxy      # JupyterHub's proxy (needs Node.js)
    MEGALAB_COURSE=/shared/megalab/course jupyterhub -f course/slurm/jupyterhub_config.py

Edit the values below (or set the MEGALAB_* variables before starting the hub). The hub runs on a login node,
as root (it starts each learner's job as that learner, with `sudo -u LEARNER sbatch`) or as a service account
allowed to do so; the compute nodes must reach it at HUB_CONNECT_IP.
"""

import os
import pwd
import shlex
import socket
import subprocess
from pathlib import Path

c = get_config()  # noqa: F821  (JupyterHub provides it)

# ---------------------------------------------------------------------------------- what a site edits

COURSE = os.environ.get("MEGALAB_COURSE", "/shared/megalab/course")  # the course repository (`make setup` done)
VENV = os.environ.get("MEGALAB_VENV", f"{COURSE}/.venv")  # its environment: the course's kernel
STUDENTS = os.environ.get("MEGALAB_STUDENTS", "/shared/megalab/students")  # one workspace per learner, by login
LEARNERS = [n for n in os.environ.get("MEGALAB_LEARNERS", "").split(",") if n]  # who may log in (empty: any user)
PARTITION = os.environ.get("MEGALAB_PARTITION", "")  # empty: the cluster's default partition
NODES = int(os.environ.get("MEGALAB_NODES", "1"))  # per learner; 2+ for `%%torchrun --slurm` across nodes
CPUS = int(os.environ.get("MEGALAB_CPUS", "4"))  # per node: the exercises run 2-8 CPU ranks
GPUS = int(os.environ.get("MEGALAB_GPUS", "0"))  # per node: 0 for a CPU workshop (see INSTRUCTORS.md on sharing)
MEMORY = os.environ.get("MEGALAB_MEMORY", "16G")  # per node
RUNTIME = os.environ.get("MEGALAB_RUNTIME", "04:00:00")  # a session's wall time
HUB_CONNECT_IP = os.environ.get("MEGALAB_HUB_CONNECT_IP", socket.gethostname())  # the login node, as nodes see it
FIRST_NOTEBOOK = "course/01_foundations/01_setup_and_torchrun.ipynb"

# ---------------------------------------------------------------------------------- the hub

c.JupyterHub.hub_ip = os.environ.get("MEGALAB_HUB_IP", "0.0.0.0")  # the servers on compute nodes call back here
c.JupyterHub.hub_connect_ip = HUB_CONNECT_IP
if LEARNERS:
    c.Authenticator.allowed_users = set(LEARNERS)
else:
    c.Authenticator.allow_all = True  # any user the login node's PAM accepts (the default authenticator)

# ---------------------------------------------------------------------------------- one Slurm job per learner

c.JupyterHub.spawner_class = "batchspawner.SlurmSpawner"
c.Spawner.cmd = [f"{VENV}/bin/jupyterhub-singleuser"]  # the course's Python: its kernel is the course's kernel
c.SlurmSpawner.batchspawner_singleuser_cmd = f"{VENV}/bin/batchspawner-singleuser"
c.Spawner.notebook_dir = f"{STUDENTS}/{{username}}"
c.Spawner.default_url = f"/lab/tree/{FIRST_NOTEBOOK}"
c.Spawner.env_keep = ["PATH", "LANG", "LC_ALL", "SLURM_CONF"]
c.Spawner.environment = {
    "PYTHONPATH": lambda spawner: workspace(spawner.user.name),  # the kernel and every rank import *their* megalab
    "MEGALAB_WORKSPACE": lambda spawner: workspace(spawner.user.name),
}
c.Spawner.start_timeout = 300  # queue wait + start; a busy partition needs more
c.Spawner.http_timeout = 120
c.SlurmSpawner.req_nprocs = str(CPUS)
c.SlurmSpawner.req_memory = MEMORY
c.SlurmSpawner.req_runtime = RUNTIME
c.SlurmSpawner.req_partition = PARTITION
c.SlurmSpawner.req_gres = f"gpu:{GPUS}" if GPUS else ""
# batchspawner's template, with two changes: the job holds NODES nodes (one task each), and its srun steps export
# the whole environment. batchspawner submits with `--export=<a list>`, which Slurm hands down to every srun in the
# job; megalab's own srun passes --export=ALL, and SLURM_EXPORT_ENV=ALL gives the learner's own srun (a terminal)
# their environment too.
c.SlurmSpawner.batch_script = f"""#!/bin/bash
#SBATCH --job-name=megalab-{{{{username}}}}
#SBATCH --output={STUDENTS}/{{{{username}}}}/.megalab/jupyterhub-%j.log
#SBATCH --chdir={STUDENTS}/{{{{username}}}}
#SBATCH --export={{{{keepvars}}}}
#SBATCH --nodes={NODES}
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task={{{{nprocs}}}}
{{% if partition %}}#SBATCH --partition={{{{partition}}}}
{{% endif %}}{{% if runtime %}}#SBATCH --time={{{{runtime}}}}
{{% endif %}}{{% if memory %}}#SBATCH --mem={{{{memory}}}}
{{% endif %}}{{% if gres %}}#SBATCH --gres={{{{gres}}}}
{{% endif %}}
set -euo pipefail
export SLURM_EXPORT_ENV=ALL
trap 'echo SIGTERM received' TERM
{{{{prologue}}}}
srun --nodes=1 --ntasks=1 --overlap {{{{cmd}}}}
echo "jupyterhub-singleuser ended gracefully"
{{{{epilogue}}}}
"""


def workspace(name: str) -> str:
    return f"{STUDENTS}/{name}"


def make_workspace(spawner) -> None:
    """Before a learner's first server: their workspace (`megalab workspace`), made as them so that it is theirs."""
    name = spawner.user.name
    path = Path(workspace(name))
    if (path / ".megalab" / "workspace.json").is_file():
        return
    as_them = [] if pwd.getpwnam(name).pw_uid == os.getuid() else ["sudo", "-u", name]
    cmd = [*as_them, f"{VENV}/bin/python", "-m", "megalab.lab.cli", "workspace", str(path)]
    done = subprocess.run(cmd, cwd=COURSE, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": COURSE})
    if done.returncode != 0:
        raise RuntimeError(f"could not make the workspace of {name} ({shlex.join(cmd)}):\n{done.stderr[-2000:]}")


c.Spawner.pre_spawn_hook = make_workspace
