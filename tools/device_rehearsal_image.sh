#!/bin/sh
# A stand-in for the lent GPU machine's Python, here, for rehearsing tools/device_check.sh (tests/test_device_check.py):
# a venv on Python 3.12 (the machine's python3 is a venv too) that sees torch 2.11 and triton 3.6 -- the machine's
# versions, CUDA builds, downloaded once (~530 MB) -- numpy, torch's own dependencies, and the packages
# tools/device_requirements.txt marks `# image`, linked from the reference .venv; nothing else.
# Builds .device/rehearsal/image (ignored); prints its python. PYTHON312=... the base Python, REFERENCE=... the .venv.
set -eu
cd "$(dirname "$0")/.."
PY312=${PYTHON312:-/root/.pyenv/versions/3.12.1/bin/python3.12}
REF=${REFERENCE:-.venv}
REF_SITE=$("$REF/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
R=.device/rehearsal
mkdir -p "$R/dl"
if [ ! -d "$R/base/torch" ]; then
    "$REF/bin/python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 -d "$R/dl" torch==2.11.0 triton==3.6.0
    "$REF/bin/python" -m pip install -q --no-deps --no-compile --target "$R/base" "$R"/dl/*.whl
fi
rm -rf "$R/image"
mkdir -p "$R/image/site"
for entry in "$R"/base/*; do ln -s "$(realpath "$entry")" "$R/image/site/"; done
image=$(grep -v '^#' tools/device_requirements.txt | grep '# image' | sed 's/==.*//')
# numpy, torch's dependencies (its CUDA libraries included) and the image-only packages, by distribution name
"$REF/bin/python" - "$REF_SITE" "$R/image/site" numpy filelock typing-extensions sympy mpmath networkx jinja2 \
    markupsafe fsspec cuda-bindings cuda-pathfinder cuda-toolkit $image <<'EOF'
import importlib.metadata as md, os, sys
from pathlib import Path
site, dest, names = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
dists = [d for d in md.distributions(path=[str(site)])
         if d.metadata["Name"].lower().replace("_", "-") in names or d.metadata["Name"].lower().startswith("nvidia-")]
tops = set()
for d in dists:
    tops.add(Path(d._path).name)  # the .dist-info folder
    for f in d.files or []:
        top = f.parts[0]
        if not top.endswith(".dist-info") and top != ".." and top != "bin":
            tops.add(top)
for top in sorted(tops):
    if (site / top).exists() and not (dest / top).exists():
        os.symlink(site / top, dest / top)
EOF
"$PY312" -m venv "$R/image/venv"
echo "$(realpath "$R/image/site")" > "$("$R/image/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_image.pth"
"$R/image/venv/bin/python" -c "import torch, triton, numpy; print('image:', torch.__version__, triton.__version__, numpy.__version__)" >&2
echo "$PWD/$R/image/venv/bin/python"
