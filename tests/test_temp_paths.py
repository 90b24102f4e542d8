"""No fixed paths in the temp dir: two learners on one node, two runs at once, or make test's workers must
never share (and delete) each other's files. A scan of the library, tests, benchmarks and every notebook
cell, and the behaviour of the two places files may go: this run's own scratch folder, and the cache that
only whole, renamed-into-place results enter."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megalab.lab import dist as mdist

ROOT = Path(__file__).resolve().parent.parent
TEMP_PREFIXES = ("/tmp", "/var/tmp", "/dev/shm")
ALLOWED_GETTEMPDIR = {"megalab/lab/dist.py"}  # the one place that names the temp dir: per user, tree and run


def _sources():
    """(name, Python source) of every library/test/benchmark file and every notebook code cell."""
    for folder in ("megalab", "tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path != Path(__file__).resolve():  # this scan names the prefixes it looks for
                yield str(path.relative_to(ROOT)), path.read_text()
    for path in sorted((ROOT / "course").rglob("*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "code":
                lines = "".join(cell["source"]).splitlines()
                code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in lines)
                yield f"{path.relative_to(ROOT)} cell {i}", code


def fixed_temp_paths(name: str, source: str) -> list[str]:
    """What in `source` names a place in the temp dir that every run would share."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(TEMP_PREFIXES):
            found.append(f"{name}:{node.lineno}: the fixed path {node.value!r}")
        if isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func == "gettempdir" and name not in ALLOWED_GETTEMPDIR:
                found.append(f"{name}:{node.lineno}: a path under tempfile.gettempdir() (shared by every run)")
            if func == "mktemp" and getattr(node.func, "value", None) is not None and \
                    getattr(node.func.value, "id", "") == "tempfile":
                found.append(f"{name}:{node.lineno}: tempfile.mktemp (a name, not a folder of one's own)")
    return found


def test_the_scan_finds_fixed_temp_paths():
    assert fixed_temp_paths("x", 'save = "/tmp/megalab-05-crash"')
    assert fixed_temp_paths("x", 'import tempfile, os\nroot = os.path.join(tempfile.gettempdir(), "ckpt")')
    assert fixed_temp_paths("x", 'from tempfile import gettempdir\nroot = Path(gettempdir()) / "ckpt"')
    assert not fixed_temp_paths("x", 'root = tempfile.mkdtemp(prefix="ckpt-")\nsave = mdist.scratch_dir("ckpt")')


def test_no_fixed_temp_path_in_library_tests_benchmarks_or_notebooks():
    found = [hit for name, source in _sources() for hit in fixed_temp_paths(name, source)]
    assert not found, "use mdist.scratch_dir(name) (this run's own folder), tempfile.mkdtemp or pytest's tmp_path:\n" \
        + "\n".join(found)


@pytest.fixture
def fresh_run(monkeypatch):
    """This test process as a run that has not made its scratch folder yet (restored afterwards)."""
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != mdist.SCRATCH_ENV})


def test_every_run_has_its_own_scratch_folder_removed_at_exit(fresh_run):
    code = "from megalab.lab import dist; p = dist.scratch_dir('x'); print(p, p.is_dir())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={k: v for k, v in os.environ.items() if k != mdist.SCRATCH_ENV}).stdout.split()
    other_run, made = Path(out[0]), out[1] == "True"
    mine = mdist.scratch_dir("x")
    assert made and mine != other_run and mine.name == other_run.name == "x"
    assert not other_run.exists()  # that run removed its own folder when it ended
    assert os.environ[mdist.SCRATCH_ENV] == str(mine.parent)  # what this run's ranks inherit
    assert mdist.scratch_dir("x") == mine  # and every later cell of the run gets


def test_a_killed_run_leaves_nothing_behind_for_long(fresh_run):
    base = mdist._user_temp_root()
    base.mkdir(parents=True, exist_ok=True)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    abandoned = base / f"run-{gone}-abcdefgh"
    (abandoned / "ckpt").mkdir(parents=True)
    mdist.scratch_root()  # the next run sweeps folders whose process is gone
    assert not abandoned.exists()


def test_publish_dir_replaces_a_folder_whole(tmp_path):
    final = tmp_path / "cache" / "trained"
    for version in ("old", "new"):
        built = tmp_path / f"built-{version}"
        built.mkdir()
        (built / "weights").write_text(version)
        assert mdist.publish_dir(built, final) == final
        assert (final / "weights").read_text() == version and not built.exists()
    assert sorted(p.name for p in final.parent.iterdir()) == ["trained"]  # the old one is gone, nothing left over


@pytest.mark.timeout(120)
def test_ranks_preparing_the_corpus_at_once_never_read_half_a_file(tmp_path):
    """Three processes build the same cached dataset at the same moment: each reads a whole, identical file."""
    code = ("import sys; from megalab.tools.preprocess_data import prepare_corpus; "
            "from megalab.core.datasets.indexed_dataset import IndexedDataset; "
            "d = IndexedDataset(prepare_corpus(('milton',), out_dir=sys.argv[1])[0]); print(len(d), d[len(d) - 1][-1])")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
             for _ in range(3)]
    outputs = {p.communicate(timeout=100)[0] for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(outputs) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["milton_text_document.bin", "milton_text_document.idx"]


def test_a_failed_corpus_build_leaves_nothing_in_the_cache(tmp_path, monkeypatch):
    from megalab.tools import preprocess_data

    def half_written(source, prefix, tokenizer, **kw):
        Path(f"{prefix}_text_document.bin").write_bytes(b"half")
        raise KeyboardInterrupt  # the build is stopped mid-way

    monkeypatch.setattr(preprocess_data, "preprocess", half_written)
    with pytest.raises(KeyboardInterrupt):
        preprocess_data.prepare_corpus(("milton",), out_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []
