#!/bin/sh
# The prepared GPU check for the lent machine (one `run` call; course/INSTRUCTORS.md §7 gives it): on that machine as
# it is -- its Python 3.12 with torch, triton and numpy, no network -- make a venv that keeps its torch, install the
# carried wheels (.device/wheels, from tools/device_wheels.sh) and megalab offline, then run `make gpu-test`'s check
# (python -m megalab.lab.gpu_check): the gpu-marked tests and every notebook on CUDA, compared with the CPU outputs.
# Writes device_check.log, gpu_check.md (the table, the failures, the INSTRUCTORS row) and gpu_check.json to $OUT.
#
#   sh tools/device_check.sh [gpu_check options]       on the lent machine (a usable CUDA GPU is required)
#   sh tools/device_check.sh --cpu-rehearsal [...]     the same steps on a CPU machine, claiming nothing about GPUs
# DEVICE_PYTHON (default python3), DEVICE_WHEELS (.device/wheels), DEVICE_VENV (a new temp folder), OUT (.device/out).
set -u
cd "$(dirname "$0")/.."
PY=${DEVICE_PYTHON:-python3}
WHEELS=${DEVICE_WHEELS:-.device/wheels}
OUT=${OUT:-.device/out}
WORK=$(mktemp -d)
VENV=${DEVICE_VENV:-$WORK/venv}
mkdir -p "$OUT"
LOG="$OUT/device_check.log"
say() { echo "device_check: $*" | tee -a "$LOG"; }
fail() { say "FAILED: $*"; exit 2; }
started=$(date +%s)

say "$(date -u '+%F %T') UTC on $(uname -m), $("$PY" --version 2>&1) at $(command -v "$PY")"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv,noheader 2>&1 | sed 's/^/  gpu: /' | tee -a "$LOG"
fi

# 1. The carried wheels: every pinned one there (a missing one is named, with what to do).
[ -f "$WHEELS/requirements.txt" ] || fail "no carried wheels ($WHEELS/requirements.txt is missing): run 'sh tools/device_wheels.sh' on your machine, then name .device/wheels in the run call's carry"
missing=$("$PY" - "$WHEELS" <<'EOF'
import re, sys
from pathlib import Path
dest = Path(sys.argv[1])
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
have = {(norm(w.name.split("-")[0]), w.name.split("-")[1]) for w in dest.glob("*.whl")}
wanted = [ln.split("==") for ln in (dest / "requirements.txt").read_text().split()]
print(" ".join(f"{n}=={v}" for n, v in wanted if (norm(n), v) not in have))
EOF
)
[ -z "$missing" ] || fail "carried wheel(s) missing: $missing: run 'sh tools/device_wheels.sh' on your machine and carry .device/wheels"

# 2. The machine's own torch, triton and numpy.
"$PY" -c "import torch, triton, numpy" 2>>"$LOG" || fail "$PY cannot import torch, triton and numpy (see $LOG): run this with the machine's PyTorch Python (DEVICE_PYTHON=...)"

# 3. A venv that sees them. Made from a venv (the machine's python3 is /opt/torch/.venv's), --system-site-packages
#    shows the base interpreter's packages, not that venv's: then a .pth file adds that venv's site-packages.
#    The machine Python's pip installs into it (pip --python): no pip of its own to set up.
"$PY" -m venv --without-pip --system-site-packages "$VENV" >>"$LOG" 2>&1 || fail "could not make a venv with $PY -m venv (see $LOG)"
VPY="$VENV/bin/python"
PIP="$PY -m pip --python $VPY"
if ! $PIP --version >/dev/null 2>&1; then  # a pip older than 22.3: the venv gets its own
    "$VPY" -m ensurepip -q >>"$LOG" 2>&1 || fail "could not set up pip in the venv (see $LOG)"
    PIP="$VPY -m pip"
fi
if ! "$VPY" -c "import torch" 2>/dev/null; then
    site=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    # every folder on the machine Python's path that the new venv's path lacks (its site-packages, its .pth folders)
    "$PY" -c "import os, sys; print('\n'.join(p for p in sys.path if p and os.path.isdir(p)))" >"$WORK/base_path"
    "$VPY" -c "import sys; print('\n'.join(sys.path))" >"$WORK/venv_path"
    grep -vxF -f "$WORK/venv_path" "$WORK/base_path" | grep -v "^$PWD\$" > "$site/_device_base.pth"
    "$VPY" -c "import torch" 2>>"$LOG" || fail "the venv cannot import the machine's torch (see $LOG)"
fi

# 4. Offline install, no dependency resolution (the carried list is a whole pinned closure; torch's own CUDA packages
#    stay as the machine has them): the carried wheels, the image's packages (by name), then megalab itself (editable, no
#    deps: its pyproject pins the course's torch, and the machine's own torch is the point).
grep -v '^#' tools/device_requirements.txt | grep '# image' | sed 's/==.*//' > "$WORK/image.txt"
if ! $PIP install -q --no-index --no-deps --no-compile --find-links "$WHEELS" --no-cache-dir --disable-pip-version-check \
        -r "$WHEELS/requirements.txt" -r "$WORK/image.txt" >"$WORK/pip.log" 2>&1; then
    cat "$WORK/pip.log" >>"$LOG"
    name=$(grep -o 'No matching distribution found for [^ ]*' "$WORK/pip.log" | head -1 | sed 's/.* //')
    if grep -qx "$name" "$WORK/image.txt" 2>/dev/null; then
        fail "this machine lacks $name, which is not carried (tools/device_requirements.txt marks it # image): remove the mark, run 'sh tools/device_wheels.sh' and carry .device/wheels"
    fi
    fail "pip could not install ${name:-the carried wheels} offline (see $LOG): run 'sh tools/device_wheels.sh' and carry .device/wheels"
fi
$PIP install -q --no-index --no-deps --no-compile --no-build-isolation --disable-pip-version-check -e . >>"$LOG" 2>&1 \
    || fail "pip could not install megalab from this tree offline (see $LOG)"
say "venv ready in $(( $(date +%s) - started )) s: torch $("$VPY" -c 'import torch; print(torch.__version__)'), $(ls "$WHEELS"/*.whl | wc -l) carried wheels"

# 5. The check itself.
case " $* " in
    *" --cpu-rehearsal "*) require= ;;
    *) require=--require-gpu ;;
esac
# The whole call stays within DEVICE_TOTAL_S (480 s: the run call's timeout_s is 540): the check gets what setup left
# (a --budget given here wins: the last one counts).
budget=$(( ${DEVICE_TOTAL_S:-480} - ($(date +%s) - started) - 20 ))
[ "$budget" -ge 60 ] || fail "setup took $(( $(date +%s) - started )) s: no time left for the check within ${DEVICE_TOTAL_S:-480} s"
{ PYTHONUNBUFFERED=1 "$VPY" -m megalab.lab.gpu_check $require --out "$OUT" --budget "$budget" "$@"; echo $? >"$WORK/status"; } 2>&1 | tee -a "$LOG"
code=$(cat "$WORK/status")
say "done in $(( $(date +%s) - started )) s (gpu_check exit $code); results in $OUT: gpu_check.md, gpu_check.json, device_check.log"
rm -rf "$WORK"
exit "$code"
