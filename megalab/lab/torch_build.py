"""Which torch build `make setup` installs: the CPU wheel where there is no NVIDIA driver, else a CUDA build the
driver can run. Standard library only: it runs before torch is installed.

    python -m megalab.lab.torch_build [--torch 2.13.0]
        stdout: pip's index options for torch (empty: PyPI's default); stderr: one line saying what and why

- TORCH_INDEX_URL set: that index, whatever the machine (a mirror, a cu12x build, the CPU index).
- Not Linux: PyPI's default (macOS: CPU and MPS; Windows: CPU).
- Linux, no NVIDIA driver (neither /proc/driver/nvidia/version nor nvidia-smi): PyTorch's CPU index when it
  answers (a CPU wheel, not PyPI's CUDA build of about 4.7 GB installed); when it does not, PyPI's default --
  the CUDA build, which also runs on the CPU -- and it says so.
- Linux with an NVIDIA driver: PyPI's default when the driver runs its CUDA (torch 2.13 on PyPI: CUDA 13.0,
  driver R580 or newer); an older driver gets the newest CUDA 12 build it runs (cu128 from R570, cu126 from
  R525) -- with PyPI's build, CUDA would be silently unavailable and every cell would fall back to the CPU;
  older still: the CPU build, and what to update.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

DOWNLOAD = "https://download.pytorch.org/whl"
CPU_INDEX = f"{DOWNLOAD}/cpu"
PROC_VERSION = "/proc/driver/nvidia/version"
PYPI_CUDA = ("13.0", 580)  # torch 2.13's Linux wheel on PyPI: its CUDA, and the oldest driver (R580) that runs it
CUDA12_BUILDS = ((570, "cu128"), (525, "cu126"))  # PyTorch's CUDA 12 indexes, by the oldest driver that runs them
MIN_DRIVER = {13: 580, 12: 525, 11: 450}  # CUDA major -> oldest driver (minor-version compatibility)


def driver_version(proc_version: str = PROC_VERSION, nvidia_smi: str | None = "nvidia-smi") -> str | None:
    """The NVIDIA driver's version ("580.65.06"), from the kernel module's file or nvidia-smi; None without one."""
    try:
        match = re.search(r"Kernel Module\b.*?\s(\d+\.\d+(?:\.\d+)?)\s", Path(proc_version).read_text())
        if match:
            return match.group(1)
    except OSError:
        pass
    smi = shutil.which(nvidia_smi) if nvidia_smi else None
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        match = re.search(r"\d+\.\d+(?:\.\d+)?", out)
        return match.group(0) if match else None
    return None


def driver_major(version: str) -> int:
    return int(version.split(".")[0])


def driver_needed(cuda: str) -> int | None:
    """The oldest driver branch that runs a CUDA `cuda` ("13.0") build, or None when unknown."""
    return MIN_DRIVER.get(int(cuda.split(".")[0]))


def reachable(url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout) as response:
            return response.status < 400
    except (OSError, ValueError):
        return False


def choose(system: str, driver: str | None, index_url: str | None = None,
           cpu_index_reachable=lambda: reachable(CPU_INDEX + "/torch/"), cpu_index: str = CPU_INDEX) -> tuple[list[str], str]:
    """(pip options for torch, why) for a machine: its OS, its NVIDIA driver version (None: none)."""
    cuda, needs = PYPI_CUDA
    if index_url:
        return ["--index-url", index_url], f"torch from TORCH_INDEX_URL={index_url}"
    if system != "Linux":
        return [], f"torch from PyPI ({system}: its wheel there is the CPU{' and MPS' if system == 'Darwin' else ''} build)"
    if driver is None:
        if cpu_index_reachable():
            return ["--index-url", cpu_index], f"no NVIDIA driver: torch's CPU build from {cpu_index}"
        return [], (f"no NVIDIA driver, but PyTorch's CPU index ({cpu_index}) is not reachable: installing PyPI's default "
                    f"torch instead, the CUDA {cuda} build (about 4.7 GB installed; it runs on the CPU too). For the CPU "
                    "wheel set TORCH_INDEX_URL to a reachable copy of that index, e.g. "
                    f"TORCH_INDEX_URL={CPU_INDEX} make setup")
    major = driver_major(driver)
    if major >= needs:
        return [], f"NVIDIA driver {driver}: torch from PyPI, its CUDA {cuda} build (needs R{needs}+)"
    for oldest, build in CUDA12_BUILDS:
        if major >= oldest:
            url = f"{DOWNLOAD}/{build}"
            return ["--index-url", url], (f"NVIDIA driver {driver} is older than PyPI's CUDA {cuda} torch needs "
                                          f"(R{needs}+): torch's {build} build from {url}")
    return ["--index-url", cpu_index], (f"NVIDIA driver {driver} is too old for any CUDA build of this torch (CUDA 12 "
                                        f"needs R{CUDA12_BUILDS[-1][0]}+): torch's CPU build; update the driver to "
                                        "use the GPUs, then make setup again")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--torch", default="", help="the torch version being installed (for the message)")
    parser.add_argument("--proc-version", default=PROC_VERSION, help=argparse.SUPPRESS)
    parser.add_argument("--nvidia-smi", default="nvidia-smi", help=argparse.SUPPRESS)
    parser.add_argument("--cpu-index", default=CPU_INDEX, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    driver = driver_version(args.proc_version, args.nvidia_smi) if platform.system() == "Linux" else None
    options, why = choose(platform.system(), driver, os.environ.get("TORCH_INDEX_URL") or None,
                          lambda: reachable(args.cpu_index.rstrip("/") + "/torch/"), args.cpu_index)
    print(f"make setup: {why}" + (f" (torch {args.torch})" if args.torch else ""), file=sys.stderr)
    print(" ".join(options))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
