#!/bin/sh
# make setup's first step: the course's virtual environment VENV (default .venv) on a Python >= 3.12.
# - VENV already on Python >= 3.12: nothing to do.
# - No suitable Python (tools/find_python.sh): stop with what to install, before anything is created or removed.
# - VENV on an older (or no longer runnable) Python: if make setup made it (its marker files), it is
#   recreated: it holds only what make setup installs, and it could never run this course. A VENV that make
#   setup did not make may hold someone's own packages: stop and say how to remove it or choose another.
# - venv creation fails (e.g. Debian's python3.12 without python3.12-venv): the partial VENV is removed.
VENV=${1:-.venv}
HERE=$(dirname "$0")
old=$("$VENV/bin/python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null) || old=""
case $old in
    3.1[2-9].*|3.[2-9][0-9].*|[4-9].*) exit 0 ;;  # already on Python >= 3.12
    [0-9]*) old="Python $old" ;;
    *) old="a Python that does not run" ;;
esac
PY=$(sh "$HERE/find_python.sh") || exit 1
if [ -e "$VENV" ] && [ -n "$(ls -A "$VENV" 2>/dev/null)" ]; then
    if [ -e "$VENV/.megalab-setup" ] || [ -e "$VENV/.megalab-venv" ]; then
        echo "make setup: $VENV was built with $old (the course needs >= 3.12): recreating it with $PY" >&2
        rm -rf "$VENV"
    else
        cat >&2 <<MSG
make setup: $VENV exists with $old, and the course needs Python >= 3.12.
It was not made by make setup, so it is left alone: remove it (rm -rf $VENV) and run make setup again,
or keep it and use another one: make setup VENV=.venv312
MSG
        exit 1
    fi
fi
if ! "$PY" -m venv "$VENV"; then
    rm -rf "$VENV"
    echo "make setup: '$PY -m venv $VENV' failed (on Debian/Ubuntu: sudo apt install python3.12-venv); nothing was installed." >&2
    exit 1
fi
touch "$VENV/.megalab-venv"
