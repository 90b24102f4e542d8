#!/bin/sh
# Prints the path of a Python >= 3.12 for the course's .venv (make setup), or says what to install and exits 1.
# Tried in order: $PYTHON if set (then only it), python3, python3.12, python3.13, python3.14, then pyenv's
# $PYENV_ROOT/versions/3.1[2-9]*/bin/python3 (a pyenv shim for a version that is not active errors: skipped).
# The chosen interpreter and its version go to stderr; stdout is the path alone.
# Windows itself (Git Bash, MSYS2, Cygwin) cannot run the course: say what to do before looking for a Python.
case "$(uname -s 2>/dev/null)" in
    MINGW*|MSYS*|CYGWIN*|Windows*)
        cat >&2 <<'EOF'
make setup: this is Windows itself (Git Bash, MSYS2 or Cygwin), where the course cannot run: its launcher needs
Linux or macOS processes and signals. Run it in WSL2, the Linux inside Windows:
  1. in PowerShell (as administrator): wsl --install     then restart Windows
  2. open "Ubuntu" from the Start menu, make your Linux user
  3. in Ubuntu: sudo apt update && sudo apt install -y git make python3.12-venv   (or: python3-venv)
  4. clone the course inside Ubuntu's home (~/), not under /mnt/c, and run make setup there
README.md, section "Windows (WSL2)", has the details. Nothing was installed.
EOF
        exit 1 ;;
esac
MIN_MAJOR=3
MIN_MINOR=12
tried=""

# "X.Y.Z /path/to/python" when $1 runs, else nothing
probe() {
    "$1" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3], sys.executable)' 2>/dev/null
}

# try CANDIDATE: succeed (printing the interpreter's path) if it runs and is new enough
try() {
    out=$(probe "$1") || out=""
    version=${out%% *}
    path=${out#* }
    case $version in
        [0-9]*.[0-9]*.*) ;;
        *) tried="$tried
  $1: does not run"; return 1 ;;
    esac
    major=${version%%.*}
    minor=${version#*.}
    minor=${minor%%.*}
    if [ "$major" -gt "$MIN_MAJOR" ] || { [ "$major" -eq "$MIN_MAJOR" ] && [ "$minor" -ge "$MIN_MINOR" ]; }; then
        echo "make setup: using Python $version ($path)" >&2
        echo "$path"
        return 0
    fi
    tried="$tried
  $1: Python $version (too old)"
    return 1
}

if [ -n "${PYTHON:-}" ]; then
    try "$PYTHON" && exit 0
else
    for name in python3 python3.12 python3.13 python3.14; do
        command -v "$name" >/dev/null 2>&1 && try "$name" && exit 0
    done
    for cand in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3; do
        [ -x "$cand" ] && try "$cand" && exit 0
    done
fi

cat >&2 <<EOF
make setup needs Python >= $MIN_MAJOR.$MIN_MINOR (megatron-core and the course's pins require it); none was found.${tried:+
Tried:$tried}
Install one, then run \`make setup\` again (it finds python3.12 on PATH or under ~/.pyenv/versions/):
  pyenv:          pyenv install 3.12
  Debian/Ubuntu:  sudo apt install python3.12 python3.12-venv
  macOS:          brew install python@3.12
  conda:          conda env create -f environment.yml && conda activate megalab
  or python.org/downloads
Or name one: make setup PYTHON=/path/to/python3.12
Nothing was installed.
EOF
exit 1
