"""Tracebacks as a reader needs them: the launcher (megalab.lab.launch) and each rank (megalab.lab.worker)
print frames with this machine's folders left out."""

import os
from pathlib import Path


def short_path(filename: str) -> str:
    """A frame's file as a reader needs it, without this machine's folders: `torch/distributed/...` for an
    installed package, `megalab/extras/comm.py` for the course's own code."""
    if "site-packages/" in filename:
        return filename.rsplit("site-packages/", 1)[1]
    package = str(Path(__file__).resolve().parents[2]) + os.sep
    return filename[len(package):] if filename.startswith(package) else filename
