"""tools/device_check.sh, the one prepared call for the lent GPU machine, rehearsed here without a GPU.

The cheap tests (missing wheels) run everywhere. The rehearsal needs what a fresh clone does not hold -- the carried
wheels (`sh tools/device_wheels.sh`, ~40 MB from PyPI) and a stand-in for the machine's Python with its torch 2.11
and triton 3.6 (`sh tools/device_rehearsal_image.sh`, ~530 MB) -- and is skipped without them: it proves, on the CPU,
that the offline install works with those wheels only, that megalab imports on torch 2.11, and that a notebook
runs through the executor and matches its committed outputs. Nothing about GPUs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGE_PY = ROOT / ".device" / "rehearsal" / "image" / "venv" / "bin" / "python"
WHEELS = ROOT / ".device" / "wheels"
AUTHORING_ONLY = {"nbformat", "nbclient", "nbval", "jupyterlab", "ipykernel", "playwright"}  # not carried


def _check(tmp_path, *args, **env):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "DEVICE_VENV": str(tmp_path / "venv"), **env}
    env.pop("PYTHONPATH", None)
    return subprocess.run(["sh", "tools/device_check.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1500)


def test_no_carried_wheels_is_one_line_saying_what_to_do(tmp_path):
    done = _check(tmp_path, DEVICE_PYTHON=sys.executable, DEVICE_WHEELS=str(tmp_path / "none"))
    assert done.returncode == 2
    [line] = [ln for ln in done.stdout.splitlines() if "FAILED" in ln]
    assert "no carried wheels" in line and "sh tools/device_wheels.sh" in line and ".device/wheels" in line


def test_a_missing_carried_wheel_is_named(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "requirements.txt").write_text("pytest==9.2.0\niniconfig==2.3.1\n")
    (wheels / "iniconfig-2.3.1-py3-none-any.whl").write_bytes(b"")
    done = _check(tmp_path, DEVICE_PYTHON=sys.executable, DEVICE_WHEELS=str(wheels))
    assert done.returncode == 2 and "carried wheel(s) missing: pytest==9.2.0:" in done.stdout
    assert "iniconfig" not in done.stdout.split("missing:")[1]


@pytest.mark.skipif(not (IMAGE_PY.exists() and (WHEELS / "requirements.txt").exists()),
                    reason="needs .device/wheels and .device/rehearsal (sh tools/device_wheels.sh; "
                           "sh tools/device_rehearsal_image.sh): not in a fresh clone")
def test_rehearsal_on_torch_2_11_with_the_carried_wheels_only(tmp_path):
    done = _check(tmp_path, "--cpu-rehearsal", "--notebook", "course/02_core_architecture/03_transformer_layer.ipynb",
                  DEVICE_PYTHON=str(IMAGE_PY), DEVICE_TOTAL_S="1500")  # setup here, under load, takes minutes
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "torch 2.11" in done.stdout and "venv ready" in done.stdout
    report = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "02_core_architecture/03_transformer_layer.ipynb | 1 | one process | passed (9 cells)" in report
    assert "not run: " in report and "skipped" in report  # the gpu tests: collected, skipped, not passed
    # every megalab module imports on the machine's torch, with the carried packages only
    # (but the authoring tools: `megalab notebooks`, grading and workspaces need nbformat/nbclient, not carried)
    imports = ("import importlib, pkgutil, megalab, torch; assert torch.__version__.startswith('2.11'), torch.__version__\n"
               "for m in pkgutil.walk_packages(megalab.__path__, 'megalab.'):\n"
               "    try: importlib.import_module(m.name)\n"
               f"    except ModuleNotFoundError as e:\n        if e.name not in {AUTHORING_ONLY}: raise\n"
               "print('imported', torch.__version__)")
    venv_py = tmp_path / "venv" / "bin" / "python"
    done = subprocess.run([str(venv_py), "-c", imports], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "imported 2.11" in done.stdout, done.stderr[-3000:]
    # and every torch / triton name megalab uses exists there (tools/device_api_check.py)
    done = subprocess.run([str(venv_py), "tools/device_api_check.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "torch 2.11" in done.stdout and " 0 missing" in done.stdout, done.stdout + done.stderr
