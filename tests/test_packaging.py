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
