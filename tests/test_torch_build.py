"""make setup's torch build (megalab/lab/torch_build.py), decided on fake machines: a driver file, a fake
nvidia-smi, a CPU index that answers or not (a local port nothing listens on). No network."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megalab.lab import torch_build as tb

ROOT = Path(__file__).resolve().parents[1]
PROC = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  {}  Thu Feb 22 01:44:30 UTC 2024\nGCC version:  gcc 12\n"
OPEN_PROC = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {}  Release Build  (dvs-builder@U16)  2025\n"


def _closed_port_url() -> str:
    with socket.socket() as s:  # a port that was just free: nothing answers there
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/whl/cpu"


@pytest.mark.parametrize("driver, expected", [
    ("580.65.06", []),                                                          # PyPI's CUDA 13 build runs
    ("595.10", []),
    ("575.51.03", ["--index-url", "https://download.pytorch.org/whl/cu128"]),  # R570: CUDA 12.8
    ("550.54.14", ["--index-url", "https://download.pytorch.org/whl/cu126"]),  # R525+: CUDA 12.6
    ("470.256.02", ["--index-url", "https://download.pytorch.org/whl/cpu"]),   # no CUDA 12 build runs
])
def test_a_driver_gets_a_cuda_build_it_runs(driver, expected):
    options, why = tb.choose("Linux", driver, cpu_index_reachable=lambda: pytest.fail("no CPU index with a driver"))
    assert options == expected, why
    assert driver in why


def test_no_driver_gets_the_cpu_index_or_says_what_it_falls_back_to():
    options, why = tb.choose("Linux", None, cpu_index_reachable=lambda: True)
    assert options == ["--index-url", tb.CPU_INDEX] and "CPU build" in why
    options, why = tb.choose("Linux", None, cpu_index_reachable=lambda: False)
    assert options == [] and "not reachable" in why and "CUDA 13.0 build" in why and "TORCH_INDEX_URL" in why
    assert tb.choose("Darwin", None)[0] == [] and tb.choose("Windows", None)[0] == []
    assert tb.choose("Linux", "550.54.14", index_url="https://mirror.example/whl/cu126")[0] == \
        ["--index-url", "https://mirror.example/whl/cu126"]  # TORCH_INDEX_URL wins


def test_driver_version_from_the_module_file_or_nvidia_smi(tmp_path):
    proc = tmp_path / "version"
    proc.write_text(PROC.format("550.54.14"))
    assert tb.driver_version(str(proc), nvidia_smi=None) == "550.54.14"
    proc.write_text(OPEN_PROC.format("580.95.05"))
    assert tb.driver_version(str(proc), nvidia_smi=None) == "580.95.05"
    smi = tmp_path / "nvidia-smi"  # no module file (WSL, some containers): nvidia-smi
    smi.write_text("#!/bin/sh\necho 535.104.05\n")
    smi.chmod(0o755)
    assert tb.driver_version(str(tmp_path / "absent"), nvidia_smi=str(smi)) == "535.104.05"
    assert tb.driver_version(str(tmp_path / "absent"), nvidia_smi=str(tmp_path / "no-smi")) is None


def test_setup_script_on_a_machine_without_a_driver_and_no_cpu_index(tmp_path):
    """The command make setup runs: an unreachable CPU index falls back to PyPI's default, saying so."""
    if sys.platform != "linux":
        pytest.skip("decides for Linux")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_INDEX_URL"}
    run = subprocess.run([sys.executable, "-m", "megalab.lab.torch_build", "--torch", "2.13.0",
                          "--proc-version", str(tmp_path / "absent"), "--nvidia-smi", str(tmp_path / "absent-smi"),
                          "--cpu-index", _closed_port_url()], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "", run
    assert "not reachable" in run.stderr and "PyPI's default" in run.stderr
    makefile = (ROOT / "Makefile").read_text()
    assert "-m megalab.lab.torch_build --torch $(TORCH_VERSION)" in makefile and 'TORCH_INDEX_URL="$(TORCH_INDEX_URL)"' in makefile


def test_doctor_says_when_the_driver_is_too_old_for_the_cuda_build(monkeypatch):
    import torch

    from megalab.lab import doctor

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(tb, "driver_version", lambda *a, **kw: "550.54.14")
    line = doctor.cuda_driver_line()
    assert "550.54.14" in line and "R580" in line and "CUDA is unavailable" in line and "TORCH_INDEX_URL" in line
    monkeypatch.setattr(tb, "driver_version", lambda *a, **kw: None)
    assert "no NVIDIA driver" in doctor.cuda_driver_line()
    monkeypatch.setattr(tb, "driver_version", lambda *a, **kw: "580.65.06")
    assert "sees no GPU" in doctor.cuda_driver_line()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert doctor.cuda_driver_line() == "580.65.06 (runs CUDA 13.0: R580+)"
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "CPU build" in doctor.cuda_driver_line()
    assert any(line.startswith("CUDA driver") for line in doctor.report().splitlines())


def test_flash_attn_has_one_command_that_builds_without_isolation():
    import tomllib

    gpu = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\nflash-attn: setup\n")[1].split("\n\n")[0]
    assert f'--no-build-isolation "{gpu[0]}"' in recipe and "packaging" in recipe  # its build imports torch
    for doc in ("README.md", "course/INSTRUCTORS.md"):
        assert "make flash-attn" in (ROOT / doc).read_text(), doc
