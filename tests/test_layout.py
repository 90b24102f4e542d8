"""The package's shape: Megatron's tree under megalab/core, no import circle, core imports no course machinery.

The import graph is read from the source (ast), every `import`/`from ... import` of a megalab module,
at any depth of a file (a function-level import is still a dependency). An edge to a package also
counts for its __init__; importing a submodule of your own package does not pull in the package's
__init__ as an edge (Python runs it, but it is the parent's re-export, not a dependency of yours).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "megalab"
MACHINERY = ("megalab.lab", "megalab.extras", "megalab.training", "megalab.tools")


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: the megalab modules it imports} for every .py file under root."""
    modules = {_module(p): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = ".".join(anchor[: len(anchor) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and target.startswith("megalab"):
                    deps.add(target)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _graph_without_package_inits(graph):
    """Edges from a module to the package that contains it are Python's import order, not a dependency."""
    return {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}


def test_no_import_circle_anywhere_in_megalab():
    found = cycles(_graph_without_package_inits(import_graph()))
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_core_imports_no_course_machinery():
    graph = import_graph()
    bad = sorted(f"{m} imports {d}" for m, deps in graph.items() if m.startswith("megalab.core")
                 for d in deps if d.startswith(MACHINERY))
    assert not bad, "megalab.core must not import lab/, extras/, training/ or tools/:\n" + "\n".join(bad)


def test_cycle_finder_finds_a_circle(tmp_path):
    pkg = tmp_path / "megalab"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("from megalab.core.b import x\n")
    (pkg / "core" / "b.py").write_text("def f():\n    from megalab.core import a\n")
    (pkg / "lab.py").write_text("import megalab.core.a\n")
    import tests.test_layout as layout

    old = layout.REPO
    layout.REPO = tmp_path
    try:
        graph = import_graph(pkg)
    finally:
        layout.REPO = old
    assert graph["megalab.core.a"] == {"megalab.core.b"} and graph["megalab.core.b"] == {"megalab.core.a"}
    assert cycles(_graph_without_package_inits(graph)) == [["megalab.core.a", "megalab.core.b"]]


def test_import_megalab_stays_torch_free():
    code = "import sys, megalab; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


# ---------------------------------------------------------------- "Where this lives in Megatron-LM" tables
WHERE = "## Where this lives in Megatron-LM"


def where_tables(course: Path = REPO / "course") -> dict[str, list[tuple[str, str]]]:
    """{notebook: [(megalab cell, Megatron-LM cell)]}: the rows of the table under each notebook's
    "Where this lives in Megatron-LM" heading (header `| megalab | Megatron-LM |`)."""
    import json

    tables = {}
    for path in sorted(course.glob("*/*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        if WHERE not in text:
            tables[str(path.relative_to(REPO))] = []
            continue
        section = text.split(WHERE, 1)[1].split("\n## ", 1)[0]
        lines = [line.strip() for line in section.splitlines() if line.strip().startswith("|")]
        rows = []
        if lines and [c.strip() for c in lines[0].strip("|").split("|")] == ["megalab", "Megatron-LM"]:
            for line in lines[2:]:
                cells = [c.strip() for c in line.strip("|").split("|")]
                rows.append((cells[0], cells[1] if len(cells) > 1 else ""))
        tables[str(path.relative_to(REPO))] = rows
    return tables


def _paths(cell: str, prefix: str) -> list[str]:
    import re

    return [p for p in re.findall(r"`([^`]+)`", cell) if p.startswith(prefix)]


def test_every_notebook_maps_its_megalab_files_to_megatron_in_a_table():
    tables = where_tables()
    missing = [nb for nb, rows in tables.items() if not rows]
    assert not missing, f"no `| megalab | Megatron-LM |` table under {WHERE!r} in: {missing}"
    problems = []
    for nb, rows in tables.items():
        for ours, theirs in rows:
            for path in _paths(ours, "megalab/"):
                if not (REPO / path.split("::")[0]).exists():
                    problems.append(f"{nb}: {path} does not exist")
            mine, megatron = _paths(ours, "megalab/core/"), _paths(theirs, "megatron/")
            if mine and megatron and megatron[0] != "megatron/" + mine[0].removeprefix("megalab/"):
                problems.append(f"{nb}: {mine[0]} and {megatron[0]} are not one swap (megalab -> megatron) apart")
    assert not problems, "\n".join(problems)
