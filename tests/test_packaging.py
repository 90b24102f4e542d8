"""The project installs from its own files: pyproject, environment.yml, Makefile and CI agree."""

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _name(spec: str) -> str:
    return re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0].lower()


def test_environment_yml_mirrors_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["dev"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert "conda-forge" in env["channels"]
    assert any(str(d).startswith("python") for d in env["dependencies"] if isinstance(d, str))
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    specs = [s for s in pip if not s.startswith("-e")]
    assert sorted(specs) == sorted(wanted), "environment.yml's pip list must equal pyproject's dependencies + dev extra"
    assert "-e ." in pip


def test_gpu_extra_is_optional_and_torch_is_pinned_in_setup():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "flash-attn" not in {_name(d) for d in project["dependencies"]}
    assert {_name(d) for d in project["optional-dependencies"]["gpu"]} == {"flash-attn"}
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"TORCH_VERSION \?= 2\.13\.0", makefile)
    assert '"torch==$(TORCH_VERSION)"' in makefile  # installed before the package, so pip keeps this build


def test_ci_runs_make_test():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make lab" in readme


# ------------------------------------------------------------------ make setup's Python (tools/find_python.sh)
FAKE_PYTHON = '#!/bin/sh\necho "{version} $0"\n'  # answers the version probe as a real interpreter would
BROKEN_SHIM = '#!/bin/sh\necho "pyenv: $(basename $0): command not found" >&2\nexit 127\n'


def _fake_bin(tmp_path, **programs):
    """A PATH of fake interpreters (name -> script) plus the tools the scripts use (sh, ls, rm, ...)."""
    import shutil
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "dirname", "ls", "rm", "touch", "cat"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    for name, script in programs.items():
        (bin_dir / name).write_text(script)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _run(tmp_path, bin_dir, *args, python=None):
    import subprocess
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path / "home"), "PYENV_ROOT": str(tmp_path / "pyenv")}
    if python:
        env["PYTHON"] = python
    return subprocess.run(["sh", *map(str, args)], capture_output=True, text=True, env=env, cwd=tmp_path,
                          executable=str(bin_dir / "sh"), timeout=60)


def test_find_python_skips_an_old_python3_and_a_broken_shim(tmp_path):
    bin_dir = _fake_bin(tmp_path, python3=FAKE_PYTHON.format(version="3.11.7"), **{
        "python3.12": BROKEN_SHIM, "python3.13": FAKE_PYTHON.format(version="3.13.0")})
    out = _run(tmp_path, bin_dir, ROOT / "tools" / "find_python.sh")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(bin_dir / "python3.13")
    assert "using Python 3.13.0" in out.stderr


def test_find_python_prefers_python3_when_new_enough_then_pyenv_versions(tmp_path):
    bin_dir = _fake_bin(tmp_path, python3=FAKE_PYTHON.format(version="3.12.4"),
                        **{"python3.12": FAKE_PYTHON.format(version="3.12.9")})
    assert _run(tmp_path, bin_dir, ROOT / "tools" / "find_python.sh").stdout.strip() == str(bin_dir / "python3")
    (bin_dir / "python3").write_text(FAKE_PYTHON.format(version="3.11.7"))
    (bin_dir / "python3.12").write_text(BROKEN_SHIM)  # pyenv's shim when 3.12 is installed but not the global one
    pyenv = tmp_path / "pyenv" / "versions" / "3.12.1" / "bin"
    pyenv.mkdir(parents=True)
    (pyenv / "python3").write_text(FAKE_PYTHON.format(version="3.12.1"))
    (pyenv / "python3").chmod(0o755)
    out = _run(tmp_path, bin_dir, ROOT / "tools" / "find_python.sh")
    assert out.returncode == 0 and out.stdout.strip() == str(pyenv / "python3"), out.stderr


def test_find_python_takes_only_the_python_given(tmp_path):
    bin_dir = _fake_bin(tmp_path, python3=FAKE_PYTHON.format(version="3.12.4"),
                        old=FAKE_PYTHON.format(version="3.11.7"))
    out = _run(tmp_path, bin_dir, ROOT / "tools" / "find_python.sh", python=str(bin_dir / "old"))
    assert out.returncode == 1 and out.stdout == ""
    assert "old: Python 3.11.7 (too old)" in out.stderr


def test_make_setup_on_windows_itself_says_to_use_wsl2_before_anything(tmp_path):
    bin_dir = _fake_bin(tmp_path, python3=FAKE_PYTHON.format(version="3.12.4"),
                        uname='#!/bin/sh\necho MINGW64_NT-10.0-19045\n')  # Git Bash
    out = _run(tmp_path, bin_dir, ROOT / "tools" / "make_venv.sh", tmp_path / ".venv")
    assert out.returncode == 1 and not (tmp_path / ".venv").exists()
    for line in ("this is Windows itself", "wsl --install", "not under /mnt/c", 'section "Windows (WSL2)"',
                 "Nothing was installed"):
        assert line in out.stderr, (line, out.stderr)


def test_importing_megalab_on_windows_or_an_old_python_says_what_to_do():
    import megalab

    assert "runs in WSL2" in megalab.unsupported("win32", (3, 12)) and "wsl --install" in megalab.unsupported("win32")
    assert "needs Python >= 3.12, and this is Python 3.11" in megalab.unsupported("linux", (3, 11))
    assert "make setup" in megalab.unsupported("darwin", (3, 9))
    assert megalab.unsupported("darwin", (3, 12)) is None and megalab.unsupported("linux", (3, 13)) is None


def test_make_venv_without_a_new_python_stops_before_creating_anything(tmp_path):
    bin_dir = _fake_bin(tmp_path, python3=FAKE_PYTHON.format(version="3.11.7"), **{"python3.12": BROKEN_SHIM})
    out = _run(tmp_path, bin_dir, ROOT / "tools" / "make_venv.sh", tmp_path / ".venv")
    assert out.returncode == 1
    assert not (tmp_path / ".venv").exists()
    for line in ("needs Python >= 3.12", "python3: Python 3.11.7 (too old)", "python3.12: does not run",
                 "pyenv install 3.12", "apt install python3.12", "brew install python@3.12",
                 "conda env create -f environment.yml", "python.org", "PYTHON=", "Nothing was installed"):
        assert line in out.stderr, (line, out.stderr)


def _old_venv(tmp_path, marker):
    venv = tmp_path / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(FAKE_PYTHON.format(version="3.11.7"))
    (venv / "bin" / "python").chmod(0o755)
    (venv / "lib-of-the-old-env").write_text("")
    if marker:
        (venv / ".megalab-setup").write_text("")
    return venv


def test_make_venv_leaves_an_old_venv_it_did_not_make_and_says_to_remove_it(tmp_path):
    venv = _old_venv(tmp_path, marker=False)
    bin_dir = _fake_bin(tmp_path, **{"python3.12": FAKE_PYTHON.format(version="3.12.1")})
    out = _run(tmp_path, bin_dir, ROOT / "tools" / "make_venv.sh", venv)
    assert out.returncode == 1
    assert "Python 3.11.7" in out.stderr and f"rm -rf {venv}" in out.stderr
    assert (venv / "lib-of-the-old-env").exists()


def test_make_venv_recreates_an_old_venv_that_make_setup_made(tmp_path):
    """make setup's own .venv on Python 3.11 is removed and built again on the Python found (here a fake whose
    `-m venv DIR` makes DIR/bin/python a 3.12)."""
    venv = _old_venv(tmp_path, marker=True)
    maker = ('#!/bin/sh\nif [ "$1" = -m ]; then mkdir -p "$3/bin"; printf \'#!/bin/sh\\necho 3.12.1\\n\' > "$3/bin/python"; '
             'chmod +x "$3/bin/python"; exit 0; fi\necho "3.12.1 $0"\n')
    bin_dir = _fake_bin(tmp_path, **{"python3.12": maker})
    for tool in ("mkdir", "chmod", "printf"):
        import shutil
        (bin_dir / tool).symlink_to(shutil.which(tool))
    out = _run(tmp_path, bin_dir, ROOT / "tools" / "make_venv.sh", venv)
    assert out.returncode == 0, out.stderr
    assert "built with Python 3.11.7" in out.stderr and "recreating" in out.stderr
    assert not (venv / "lib-of-the-old-env").exists()
    assert (venv / "bin" / "python").exists() and (venv / ".megalab-venv").exists()
    (bin_dir / "python3.12").unlink()  # a .venv on Python >= 3.12 is kept, without looking for a Python
    again = _run(tmp_path, bin_dir, ROOT / "tools" / "make_venv.sh", venv)
    assert again.returncode == 0 and again.stderr == "", again.stderr


def test_make_setup_builds_the_venv_with_make_venv():
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("$(STAMP): pyproject.toml\n", 1)[1]
    assert recipe.index("tools/make_venv.sh $(VENV)") < recipe.index("pip install")
    assert re.search(r"^PYTHON \?=\s*$", makefile, re.M)  # found, not assumed to be python3


def test_python_and_megatron_core_versions_agree_everywhere():
    """requires-python, environment.yml, find_python.sh and the READMEs name one Python; the dev extra,
    environment.yml, the parity oracle and the READMEs one megatron-core."""
    from tests.megatron_oracle import MEGATRON_CORE_VERSION
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    major, minor = re.fullmatch(r">=(\d+)\.(\d+)", project["requires-python"]).groups()
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert f"python={major}.{minor}" in env["dependencies"]
    finder = (ROOT / "tools" / "find_python.sh").read_text()
    assert f"MIN_MAJOR={major}\n" in finder and f"MIN_MINOR={minor}\n" in finder
    pin = f"megatron-core=={MEGATRON_CORE_VERSION}"
    assert pin in project["optional-dependencies"]["dev"]
    for doc in ("README.md", "README.zh.md"):
        text = (ROOT / doc).read_text()
        assert f"Python ≥ {major}.{minor}" in text and f"`{pin}`" in text, doc
        assert not re.search(r"Python ≥ 3\.(\d+)", text.replace(f"Python ≥ {major}.{minor}", "")), doc
