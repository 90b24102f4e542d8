#!/bin/sh
# Download the wheels the lent GPU machine lacks (tools/device_requirements.txt) into .device/wheels (ignored by
# git), for its offline install by tools/device_check.sh, and check that they and the working tree fit the 64 MiB
# a device call carries. Run it here, where pip reaches PyPI:   sh tools/device_wheels.sh
# PYTHON=... picks the Python whose pip downloads (default: .venv's, else python3); LIMIT_MIB=64 the carry limit.
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
DEST=.device/wheels
LIMIT_MIB=${LIMIT_MIB:-64}
mkdir -p "$DEST"
# The machine's Python is CPython 3.12 on x86-64 Linux (glibc >= 2.28): binary wheels for it, pure ones for any.
grep -v -e '^#' -e '# image' tools/device_requirements.txt | sed 's/ *#.*//' | grep . > "$DEST/requirements.txt"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 --platform any -d "$DEST" -r "$DEST/requirements.txt"
# Keep only the pinned versions (an older download of another version would make two).
"$PY" - "$DEST" <<'EOF'
import re, sys
from pathlib import Path
dest = Path(sys.argv[1])
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
wanted = {norm(n): v for n, v in (ln.split("==") for ln in (dest / "requirements.txt").read_text().split())}
have = {}
for wheel in dest.glob("*.whl"):
    name, version = wheel.name.split("-")[:2]
    if wanted.get(norm(name)) != version:
        wheel.unlink()
    else:
        have[norm(name)] = wheel.name
missing = sorted(set(wanted) - set(have))
if missing:
    sys.exit(f"device_wheels: no wheel for {', '.join(missing)}: see pip's messages above")
EOF
# What a device call carries: tracked and untracked-not-ignored files, plus the wheels.
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
wheels=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
total=$((tree + wheels))
echo "device_wheels: $(ls "$DEST"/*.whl | wc -l) wheels, $((wheels / 1048576)) MiB + working tree $((tree / 1048576)) MiB = $((total / 1048576)) MiB of the $LIMIT_MIB MiB a call carries"
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
    echo "device_wheels: over the limit: drop packages the machine has (see /work/.library/device/KINDS.md) from tools/device_requirements.txt" >&2
    exit 1
fi
