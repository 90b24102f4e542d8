"""Every pointer into Megatron-LM resolves: the file paths, class/function names, config fields and
command-line flags the notebooks' markdown and megalab's docstrings cite as Megatron's are checked
against tests/data/megatron_index.json, built by tools/megatron_index.py from megatron/core of the
pinned megatron-core (the dev extra; see the README).

What is checked, and how:
- a path under megatron/core must be a file or folder there (a file named after a folder path, as in
  "megatron/core/transformer/moe/ — router.py", is looked up in that folder);
- a name cited after such a path (in the same table cell, sentence or docstring paragraph) must be a
  class, function, method, parameter, attribute or config field somewhere in megatron/core, and
  "Class.member" must name a member of that class;
- a config field or command-line flag that Megatron marks DEPRECATED must be called deprecated (or
  historical) in its sentence;
- a pointer that is deliberately historical (or names a later release) says so ("older releases",
  "in later releases", "formerly", "removed", "renamed", "deprecated") in its sentence (a path) or shortly
  before it (a name), and is not required to resolve.
Paths outside megatron/core (megatron/training, tools/, pretrain_gpt.py) are not in the wheel: they are
listed by test_pointers_outside_megatron_core_are_few_and_known.
"""

from __future__ import annotations

import ast
import json
import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INDEX = ROOT / "tests" / "data" / "megatron_index.json"
PATH = re.compile(r"(?<![\w/.])((?:megatron|tools|examples)/[\w/.\-]*[\w/]|pretrain_\w+\.py)")
TICKED = re.compile(r"`([^`\n]+)`")
IDENT = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")
HISTORICAL = re.compile(r"older release|historical|formerly|used to|removed|renamed|deprecated|until megatron|"
                        r"no longer|before megatron|earlier release|later release|newer release|later megatron", re.I)
OURS = re.compile(r"\bour\b|megalab", re.I)  # "plays the role of our `EngineLoop`": not a Megatron name
FILE_NAME = re.compile(r"\.(py|cpp|cu|h|pt|json|yaml|idx|bin)$")
NOT_MEGATRON = {"torch", "dist", "self", "param", "args", "nn", "F", "np", "math", "os", "model", "config",
                "te", "tex", "transformer_engine", "megalab", "ps", "state"}
OUTSIDE_CORE = {  # cited paths outside megatron/core, checked by hand against Megatron-LM's stored tree (report)
    "megatron/inference/endpoints", "megatron/inference/text_generation_server.py", "megatron/training",
    "megatron/training/arguments.py", "megatron/training/checkpointing.py",
    "megatron/training/datasets/data_samplers.py", "megatron/training/ft_integration.py",
    "megatron/training/initialize.py", "megatron/training/theoretical_memory_usage.py",
    "megatron/training/tokenizer", "megatron/training/tokenizer/tokenizer.py", "megatron/training/training.py",
    "megatron/training/utils", "pretrain_gpt.py", "tools/checkpoint/convert.py",
    "tools/checkpoint/loader_llama_mistral.py", "tools/checkpoint/loader_mixtral_hf.py",
    "tools/checkpoint/saver_mcore.py", "tools/preprocess_data.py", "tools/run_text_generation_server.py",
}


# megatron/training/arguments.py is not in the wheel: its deprecated flags, checked by hand against Megatron-LM's
# stored arguments.py ("--use-dist-ckpt is deprecated and has no effect. Use --ckpt-format ...")
DEPRECATED_TRAINING_FLAGS = {"--use-dist-ckpt": "use --ckpt-format", "--dist-ckpt-format": "use --ckpt-format"}


@lru_cache(maxsize=1)
def index() -> dict:
    data = json.loads(INDEX.read_text())
    files = set(data["files"])
    names = {n for ns in data["names"].values() for n in ns}
    members = {}
    for n in names:
        if "." in n:
            cls, member = n.split(".", 1)
            members.setdefault(cls, set()).add(member)
    for cls, fields in data["config_fields"].items():
        members.setdefault(cls, set()).update(fields)
    symbols = {s for ss in data["symbols"].values() for s in ss} | {n.split(".")[-1] for n in names}
    fields = {f: dep for fs in data["config_fields"].values() for f, dep in fs.items()}
    deprecated = {f for fs in data["config_fields"].values() for f, dep in fs.items() if dep}
    return {"files": files, "names": names, "members": members, "symbols": symbols | set(fields),
            "deprecated": deprecated, "classes": {n for n in names if "." not in n}, "source": data["source"]}


@lru_cache(maxsize=1)
def units() -> list[tuple[str, str]]:
    """(where, text) pieces that cite Megatron: a table row's Megatron column, a prose sentence, a docstring."""
    out = []
    for nb_path in sorted((ROOT / "course").glob("*/*.ipynb")):
        for i, cell in enumerate(json.loads(nb_path.read_text())["cells"]):
            if cell["cell_type"] != "markdown":
                continue
            where = f"{nb_path.relative_to(ROOT)} cell {i}"
            text = re.sub(r"```.*?```", "", "".join(cell["source"]), flags=re.S)  # diagrams: not pointers
            for block in text.split("\n\n"):
                if block.lstrip().startswith("|"):
                    for row in block.splitlines():
                        cols = [c.strip() for c in row.strip().strip("|").split(" | ")]
                        if len(cols) >= 2 and "megatron/" in cols[-1]:
                            out.append((where, cols[-1]))
                else:
                    out.extend((where, s) for s in re.split(r"(?<=[.!?])\s+(?=[A-Z`(])", block) if "megatron/" in s)
    for py in sorted((ROOT / "megalab").rglob("*.py")):
        tree = ast.parse(py.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc and "megatron/" in doc:
                    for para in doc.split("\n\n"):
                        if "megatron/" in para:
                            out.append((f"{py.relative_to(ROOT)} docstring", para))
    return out


def _docstring_names(segment: str, is_dir: bool) -> list[str]:
    """Names a docstring cites right after a path, "path (A, B.c, d)", or after a folder's files,
    "folder/ — a.py (A), b.py (B, c)"; only code-like words (snake_case, CamelCase, calls)."""
    groups = ([g for _, g in re.findall(r"(\w+\.py)\s*\(([^()]*)\)", segment)] if is_dir
              else re.findall(r"^\s*\(([^()]*)\)", segment))
    return [t.strip() for g in groups for t in g.split(",")
            if re.search(r"_|[a-z][A-Z]|^[A-Z]\w*[a-z]\w*$|\(", t.strip())]


def check_unit(where: str, text: str) -> list[str]:
    """The unresolved pointers of one unit, each as a line saying where and what."""
    idx, problems = index(), []
    matches = list(PATH.finditer(text))
    for k, m in enumerate(matches):
        path = m.group(1).rstrip(".")
        if not path.startswith("megatron/core"):
            continue
        historical = bool(HISTORICAL.search(text))  # a path: its sentence (or cell) says it is historical / later
        is_dir = path.endswith("/") or f"{path}/" in idx["files"]
        if path not in idx["files"] and f"{path}/" not in idx["files"] and path.rstrip("/") + "/" not in idx["files"]:
            if not historical:
                problems.append(f"{where}: path {path} is not in {idx['source']}")
            continue
        end = matches[k + 1].start() if k + 1 < len(matches) else len(text)
        segment = text[m.end() + (text[m.end():m.end() + 1] == "`"):end]  # after the path's closing backtick
        tokens = _docstring_names(segment, is_dir) if where.endswith("docstring") else TICKED.findall(segment)
        if is_dir:  # "megatron/core/x/ — file.py (...)": the file names it lists must be in the folder
            for f in re.findall(r"([\w/]+\.py)\b", segment):
                if f"{path.rstrip('/')}/{f}" not in idx["files"] and not HISTORICAL.search(segment.split(f)[0][-100:]):
                    problems.append(f"{where}: {f} is not in {path}")
        for token in tokens:
            name = re.sub(r"\(.*\)$", "", token.strip()).strip()
            if FILE_NAME.search(name) or not IDENT.match(name) or name.split(".")[0] in NOT_MEGATRON:
                continue
            pos = segment.find(token)
            context = segment[max(0, pos - 100):pos]
            if HISTORICAL.search(context) or OURS.search(segment[max(0, pos - 40):pos]):
                continue
            sentence = segment
            if "." in name:
                cls, member = name.split(".", 1)[0], name.split(".")[-1]
                if cls in idx["classes"]:
                    if member not in idx["members"].get(cls, set()):
                        problems.append(f"{where}: {name} — {cls} has no member {member!r} ({idx['source']})")
                    continue
                name = member
            if name not in idx["names"] and name not in idx["symbols"]:
                problems.append(f"{where}: {name} (after {path}) is not in {idx['source']}")
            elif name in idx["deprecated"] and not HISTORICAL.search(sentence):
                problems.append(f"{where}: {name} is DEPRECATED in {idx['source']}: say so in the sentence")
    for flag in re.findall(r"(?<![\w-])--([a-z0-9][a-z0-9-]*[a-z0-9])", text):  # flags Megatron deprecated
        field = flag.replace("-", "_")
        if field in idx["deprecated"] and not HISTORICAL.search(text):
            problems.append(f"{where}: --{flag} sets {field}, DEPRECATED in {idx['source']}: say so in the sentence")
        elif f"--{flag}" in DEPRECATED_TRAINING_FLAGS and not HISTORICAL.search(text):
            problems.append(f"{where}: --{flag} is deprecated in megatron/training/arguments.py "
                            f"({DEPRECATED_TRAINING_FLAGS[f'--{flag}']}): say so in the sentence")
    return problems


def test_the_index_is_the_pinned_megatron_core():
    from tests.megatron_oracle import MEGATRON_CORE_VERSION
    data = json.loads(INDEX.read_text())
    assert data["source"].startswith(f"megatron-core {MEGATRON_CORE_VERSION} ") and data["roots"] == ["megatron/core"]
    assert "megatron/core/transformer/moe/moe_utils.py" in data["files"]


def test_every_megatron_core_pointer_resolves():
    cited = units()
    assert len(cited) > 100  # the extraction found the course's pointers
    problems = [p for where, text in cited for p in check_unit(where, text)]
    assert not problems, f"{len(problems)} pointers into Megatron-LM do not resolve:\n" + "\n".join(problems)


def test_pointers_outside_megatron_core_are_few_and_known():
    """Paths outside megatron/core are not in the wheel; each one cited must be in OUTSIDE_CORE (checked by hand)."""
    outside = {m.group(1).rstrip("./") for _, text in units() for m in PATH.finditer(text)
               if not m.group(1).startswith("megatron/core")}
    assert outside <= OUTSIDE_CORE, f"new paths outside megatron/core, check them by hand: {sorted(outside - OUTSIDE_CORE)}"


@pytest.mark.parametrize("text, expected", [
    ("`megatron/core/transformer/moe/moe_utils.py` — `topk_softmax_with_capacity`", "topk_softmax_with_capacity"),
    ("`megatron/core/transformer/moe/moe_utils.py` — (older releases: `topk_softmax_with_capacity`)", None),
    ("`megatron/core/transformer/moe/moe_utils.py` — `MoEAuxLossAutoScaler.loss_scale_x`", "has no member"),
    ("`megatron/core/training/utils.py` — `get_batch_on_this_cp_rank`", "path megatron/core/training/utils.py"),
    ("`megatron/core/transformer/transformer_config.py` — `enable_cuda_graph`", "DEPRECATED"),
    ("`megatron/core/transformer/transformer_config.py` — `enable_cuda_graph` (deprecated)", None),
    ("`megatron/core/dist_checkpointing/` — with `--use-dist-ckpt`", "--use-dist-ckpt is deprecated"),
    ("Megatron: megatron/core/transformer/moe/router.py (TopKRouter, no_such_function).", "no_such_function"),
    ("Megatron: megatron/core/transformer/moe/router.py (TopKRouter, TopKRouter.routing).", None),
    ("Megatron: megatron/core/transformer/moe/ — router.py (TopKRouter), moe_utils.py (topk_softmax_with_capacity)",
     "topk_softmax_with_capacity"),
])
def test_the_checker_catches_stale_pointers(text, expected):
    problems = check_unit("example docstring" if text.startswith("Megatron:") else "example", text)
    if expected is None:
        assert not problems, problems
    else:
        assert len(problems) == 1 and expected in problems[0], problems


def _script():
    import sys
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import megatron_index
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return megatron_index


SPOT_CHECKED = ["megatron/core/transformer/moe/moe_utils.py", "megatron/core/transformer/moe/router.py",
                "megatron/core/parallel_state.py", "megatron/core/pipeline_parallel/schedules.py",
                "megatron/core/transformer/transformer_config.py"]


def test_the_committed_index_is_what_the_script_builds(mcore_installed):
    """tests/data/megatron_index.json matches tools/megatron_index.py on the installed (pinned) megatron-core:
    the same files, and the same entries for a few files (a full rebuild takes seconds; run the script)."""
    import importlib.util
    script, data = _script(), json.loads(INDEX.read_text())
    tree = Path(importlib.util.find_spec("megatron.core").origin).parents[2]
    files = {p.relative_to(tree).as_posix() + ("/" if p.is_dir() else "") for p in [tree / "megatron/core",
             *(tree / "megatron/core").rglob("*")] if "__pycache__" not in p.as_posix() and (p.is_dir() or p.suffix in
                                                                                           (".py", ".cpp", ".cu", ".h"))}
    stale = "the committed index is stale: run `python tools/megatron_index.py` and commit tests/data/megatron_index.json"
    assert files == set(data["files"]), stale
    for rel in SPOT_CHECKED:
        names, _, _, symbols = script.index_file((tree / rel).read_text())
        assert data["names"][rel] == names and data["symbols"][rel] == symbols, (rel, stale)


def test_the_index_script_reads_a_checkout(tmp_path):
    """On a Megatron-LM checkout it also indexes training and tools: flags (deprecated ones marked), config
    fields (DEPRECATED docstrings marked), classes and methods."""
    megatron_index = _script()
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    (tmp_path / "megatron" / "training").mkdir()
    (tmp_path / "megatron" / "core" / "cfg.py").write_text(
        'class FooConfig:\n    a: int = 1\n    """The a."""\n    old: bool = False\n    """DEPRECATED and replaced by a."""\n'
        'class Bar:\n    def go(self, depth):\n        self.k = depth\n')
    (tmp_path / "megatron" / "training" / "arguments.py").write_text(
        'def _add(parser):\n    parser.add_argument("--use-dist-ckpt", action="store_true", help="Deprecated: use --ckpt-format.")\n'
        '    parser.add_argument("--num-layers", type=int, help="Number of layers.")\n')
    (tmp_path / "pretrain_gpt.py").write_text("def loss_func(loss_mask, output_tensor):\n    pass\n")
    out = tmp_path / "index.json"
    megatron_index.main(["--tree", str(tmp_path), "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["roots"] == ["megatron", "pretrain_gpt.py"]
    assert {"megatron/core/cfg.py", "megatron/training/arguments.py", "pretrain_gpt.py", "megatron/core/"} <= set(data["files"])
    assert data["flags"] == {"--use-dist-ckpt": True, "--num-layers": False}
    assert data["config_fields"] == {"FooConfig": {"a": False, "old": True}}
    assert data["names"]["megatron/core/cfg.py"] == ["FooConfig", "Bar", "Bar.go"]
    assert {"depth", "k"} <= set(data["symbols"]["megatron/core/cfg.py"])
