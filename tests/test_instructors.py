"""The instructor kit: the Slurm template for JupyterLab (course/slurm/jupyterlab.sbatch) runs as
sbatch would run it, prints the tunnel and starts JupyterLab on the node; without a venv it says what to do."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "course" / "slurm" / "jupyterlab.sbatch"


def _fake_venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    jupyter = venv / "bin" / "jupyter"
    jupyter.write_text(f'#!/bin/sh\necho "jupyter $@" > {tmp_path}/jupyter.args\necho "$PYTHONPATH" > {tmp_path}/pythonpath\n')
    jupyter.chmod(0o755)
    return venv


def test_sbatch_template_prints_the_tunnel_and_starts_jupyterlab(tmp_path):
    env = {**os.environ, "MEGALAB_VENV": str(_fake_venv(tmp_path)), "SLURM_JOB_ID": "77",
           "SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_NODELIST": "gpu[1-2]", "SLURM_GPUS_PER_NODE": "8"}
    out = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "job 77, nodes: gpu[1-2]" in out.stdout and "ssh -N -L 8888:" in out.stdout
    assert "http://127.0.0.1:8888/?token=" in out.stdout and "%%torchrun --slurm -n 8   (one rank per GPU" in out.stdout
    args = (tmp_path / "jupyter.args").read_text().split()
    assert args[:3] == ["jupyter", "lab", "--no-browser"] and "--ServerApp.root_dir=." in args
    assert "--LabApp.default_url=/lab/tree/course/01_foundations/01_setup_and_torchrun.ipynb" in args
    assert (tmp_path / "pythonpath").read_text().split(":")[0].strip() == str(REPO)  # this tree's megalab
    token = out.stdout.split("token=")[1].split()[0]
    assert f"--IdentityProvider.token={token}" in args and len(token) == 32


def test_sbatch_template_without_a_venv_says_what_to_do(tmp_path):
    env = {**os.environ, "MEGALAB_VENV": str(tmp_path / "none"), "SLURM_SUBMIT_DIR": str(REPO)}
    out = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "run 'make setup' on a login node first" in out.stderr


def test_sbatch_template_in_a_workspace_uses_the_shared_environment(tmp_path):
    """A learner's workspace has no .venv of its own: the script takes the one its env.mk names."""
    ws = tmp_path / "ws"
    (ws / ".megalab").mkdir(parents=True)
    venv = _fake_venv(tmp_path)
    (ws / ".megalab" / "env.mk").write_text(f"WORKSPACE := 1\nVENV := {venv}\nREFERENCE := {REPO}\n")
    env = {k: v for k, v in os.environ.items() if k != "MEGALAB_VENV"}
    env.update(SLURM_JOB_ID="78", SLURM_SUBMIT_DIR=str(ws))
    out = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "pythonpath").read_text().split(":")[0].strip() == str(ws)


def test_sbatch_template_on_a_cpu_partition_suggests_cpu_ranks(tmp_path):
    """No GPUs in the job (--gpus-per-node=0, or a CPU partition): the banner suggests CPU ranks, never `-n 0`."""
    for gpus in ("0", None):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        env.update(MEGALAB_VENV=str(_fake_venv(tmp_path / f"g{gpus}")), SLURM_JOB_ID="79", SLURM_SUBMIT_DIR=str(REPO),
                   SLURM_CPUS_PER_TASK="4", **({"SLURM_GPUS_PER_NODE": gpus} if gpus else {}))
        out = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "%%torchrun --slurm -n 2   (no GPUs in this job: CPU ranks on gloo)" in out.stdout, out.stdout
