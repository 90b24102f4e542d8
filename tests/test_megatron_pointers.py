"""Every pointer into Megatron-LM resolves at the pinned commit: the file paths, class/function names, config
fields and command-line flags the course cites as Megatron's are checked against tests/data/megatron_index.json,
tools/megatron_index.py's index of Megatron-LM's whole tree at one commit (the index says which; rebuild it with
`python tools/megatron_index.py --git <a Megatron-LM clone>`).

Where pointers are read: the notebooks' markdown and their code cells' comments and strings, megalab/'s
docstrings and comments, README.md, README.zh.md, course/INSTRUCTORS.md, CONTRIBUTING.md and the Chinese
translations course/zh/**/*.md.

What is checked, and how:
- a path (megatron/..., tools/..., examples/..., docs/..., pretrain_gpt.py, ...) must be a file or folder of the
  tree (a file named after a folder path, as in "megatron/core/transformer/moe/ — router.py", is looked up in
  that folder); a tools/, examples/ or docs/ path that is megalab's own (it exists in this repository) is not
  Megatron's;
- a name cited after such a path (in the same table cell, sentence, comment or docstring paragraph) must be a
  class, function, method, parameter, attribute or config field of the tree; listed right after a .py file, of
  that file; "Class.member" and "`Class`: `member`" must name a method, field, attribute or __init__ parameter
  of that class (or of one of its bases);
- a code-like name right after "Megatron:" / "Megatron's" must be in the tree, and a path relative to megatron/
  or megatron/core/ in such a unit ("Megatron: X (inference/contexts/kv_block_allocator.py)") must be one;
- a dotted module (megatron.core.x.y, `from megatron.core.x import a` in a code cell) must be a module of the
  tree, and the name after it one of that module's;
- a command-line flag cited as Megatron's (in a "`... pretrain_gpt.py --flag`" command line, or "Megatron's
  --flag") must be one of the tree's flags; a flag or config field that Megatron deprecates must be called
  deprecated (or historical) in its sentence;
- a pointer that is deliberately historical (or names a later release) says so ("older releases", "formerly",
  "removed", "renamed", "deprecated", ...) in its sentence (a path) or shortly before it (a name), and is not
  required to resolve.
"""

from __future__ import annotations

import ast
import io
import json
import re
import tokenize
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INDEX = ROOT / "tests" / "data" / "megatron_index.json"
PINNED_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"  # Megatron-LM, 2026-08-22 (the course's pin)
PATH = re.compile(r"(?<![\w/.\-])((?:megatron|tools|examples|docs|tasks)/[\w/.\-]*[\w/]|"
                  r"(?:pretrain_\w+|train_rl|model_provider|\w+_builders)\.py)(?![\w/])")
TICKED = re.compile(r"`([^`\n]+)`")
IDENT = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")
FLAG = re.compile(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*[a-z0-9])(?![\w-])")
HISTORICAL = re.compile(r"older release|historical|formerly|used to|removed|renamed|deprecated|until megatron|"
                        r"no longer|before megatron|earlier release|later release|newer release|later megatron|"
                        r"旧版|早期版本|已移除|已删除|已弃用|改名|更名|曾经|以前|更新的版本|后来的版本", re.I)
OURS = re.compile(r"\bour\b|megalab|我们|\bTE's|TE 的|Transformer Engine's|torch's|PyTorch's", re.I)  # "plays the role of our
# `EngineLoop`", "TE's `attn_forward_func_with_cp`": not a Megatron name
MEGATRON_FLAG = re.compile(r"megatron(?:-lm)?(?:'s|’s| 的)?\s+(?:flag|option|argument|参数)?\s*`?$", re.I)
FILE_NAME = re.compile(r"\.(py|cpp|cu|h|pt|json|yaml|yml|idx|bin|md|rst|sh|txt)$")
PLACEHOLDER = re.compile(r"/[A-Z](?:\.py)?/?$")  # "megatron/core/X": any file, as in README's layout rule
NOT_MEGATRON = {"torch", "dist", "self", "param", "args", "nn", "F", "np", "math", "os", "model", "config",
                "te", "tex", "transformer_engine", "megalab", "ps", "state"}
ADJACENT = re.compile(r"^[\s,;:—–\-()`]*(?:(?:and|or|with|its|class|function)\b[\s,;:—–\-()`]*)?$")
DOTTED = re.compile(r"(?<![\w./])megatron\.(?:core|training|inference|post_training|rl|elastification|legacy)"
                    r"(?:\.\w+)+")  # a module, or a name in one: megatron.core.transformer.moe.moe_utils.z_loss_func
IMPORT = re.compile(r"from (megatron\.[\w.]+) import \(?\s*(\w+(?:\s*,\s*\w+)*)")
# "Megatron: TopKRouter (core/transformer/moe/router.py)", "Megatron's `get_batch_on_this_cp_rank`": a code-like name
# right after "Megatron:" / "Megatron's" is Megatron's; a path relative to megatron/ or megatron/core/ near it too
MEGATRON_NAME = re.compile(r"\bMegatron(?:-LM|-Core|-core)?(?:'s|’s|:| 的|：)\s*`?([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
RELATIVE = re.compile(r"(?<![\w/.\-])((?:core|training|inference|post_training|legacy)/[\w/]*\w\.py|"
                      r"(?:core|training|inference|post_training)/[\w/]*\w/)(?![\w/])")
CLASS_MEMBERS = re.compile(r"`([A-Z]\w+)`\s*(?::|：|\(|（)\s*((?:`\w+`(?:\s*(?:,|、|/)\s*)?)+)")
SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z`(])|(?<=[。！？；])")


@lru_cache(maxsize=1)
def index() -> dict:
    data = json.loads(INDEX.read_text())
    files = set(data["files"])
    names = {n for ns in data["names"].values() for n in ns}
    members, bases = {}, {}
    for n in names:
        if "." in n:
            cls, member = n.split(".", 1)
            members.setdefault(cls, set()).add(member)
    for by_class in data["attributes"].values():
        for cls, attrs in by_class.items():
            members.setdefault(cls, set()).update(attrs)
    for by_class in data["bases"].values():
        for cls, bs in by_class.items():
            bases.setdefault(cls, set()).update(bs)
    for cls, fields in data["config_fields"].items():
        members.setdefault(cls, set()).update(fields)
    symbols = ({s for ss in data["symbols"].values() for s in ss} | {n.split(".")[-1] for n in names}
               | {Path(f).stem for f in data["files"] if f.endswith(".py")})  # a module's name: theoretical_memory_usage
    fields = {f for fs in data["config_fields"].values() for f in fs}
    deprecated = {f for fs in data["config_fields"].values() for f, dep in fs.items() if dep}
    per_file = {rel: set(data["names"].get(rel, [])) | {n.split(".")[-1] for n in data["names"].get(rel, [])}
                | set(data["symbols"].get(rel, [])) for rel in set(data["names"]) | set(data["symbols"])}
    return {"files": files, "names": names, "members": members, "bases": bases, "symbols": symbols | fields,
            "deprecated": deprecated, "classes": {n for n in names if "." not in n}, "per_file": per_file,
            "fields": fields, "flags": data["flags"], "source": data["source"], "commit": data["commit"], "date": data["date"]}


def _members(cls: str, seen: frozenset = frozenset()) -> set[str]:
    idx = index()
    out = set(idx["members"].get(cls, set()))
    for base in idx["bases"].get(cls, set()) - seen:
        out |= _members(base, seen | {cls})
    return out


def markdown_units(where: str, text: str) -> list[tuple[str, str]]:
    """A markdown text's pointer-bearing pieces: each table cell, each prose sentence (fenced code blocks: each
    line)."""
    out = []
    for fence in re.findall(r"```.*?```", text, flags=re.S):  # code in markdown: a line is a unit
        out.extend((where, line) for line in fence.splitlines() if PATH.search(line) or DOTTED.search(line))
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    for block in re.split(r"\n\s*\n", text):
        if block.lstrip().startswith("|"):
            for row in block.splitlines():
                out.extend((where, c.strip()) for c in row.strip().strip("|").split(" | ")
                           if PATH.search(c) or FLAG.search(c) or DOTTED.search(c) or "Megatron" in c)
        else:
            out.extend((where, s) for s in SENTENCE.split(block) if PATH.search(s) or FLAG.search(s) or DOTTED.search(s)
                       or "Megatron" in s)
    return out


def _statements(node: ast.AST):
    """The module and every statement under it (where docstrings live), not the expressions: a fast ast.walk."""
    yield node
    for field in ("body", "orelse", "finalbody", "handlers"):
        for child in getattr(node, field, None) or ():
            if isinstance(child, (ast.stmt, ast.excepthandler)):
                yield from _statements(child)


def python_units(where: str, source: str, strings: bool) -> list[tuple[str, str]]:
    """A Python source's pointer-bearing pieces: each docstring paragraph, each block of consecutive comment
    lines, and (strings=True) each string constant."""
    out = []
    if not re.search(r"megatron|pretrain_|examples/|tools/|docs/", source, re.I):  # cites nothing: not parsed
        return out
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a notebook cell with IPython magics: its lines, as comments
        return [(f"{where} comment", line) for line in source.splitlines() if PATH.search(line) or DOTTED.search(line)]
    docstrings = set()
    for node in ast.walk(tree) if strings else _statements(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                docstrings.add(doc)
                out.extend((f"{where} docstring", p) for p in doc.split("\n\n"))
        if strings and isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron."):
            out.append((f"{where} import", f"from {node.module} import {', '.join(a.name for a in node.names)}"))
        if strings and isinstance(node, ast.Import):
            out.extend((f"{where} import", a.name) for a in node.names if a.name.startswith("megatron."))
        if strings and isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value not in docstrings:
            out.append((f"{where} string", node.value))
    block, last = [], -2
    cited_in_comment = re.search(r"#.*(?:megatron|pretrain_|examples/|tools/|docs/)", source, re.I)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline) if cited_in_comment else ():
        if tok.type == tokenize.COMMENT:
            if tok.start[0] != last + 1 and block:
                out.append((f"{where} comment", " ".join(block)))
                block = []
            block.append(tok.string.lstrip("#").strip())
            last = tok.start[0]
    if block:
        out.append((f"{where} comment", " ".join(block)))
    return [(w, t) for w, t in out if PATH.search(t) or DOTTED.search(t) or re.search(r"\bMegatron", t)
            or (w.endswith("docstring") and FLAG.search(t))]


@lru_cache(maxsize=1)
def units() -> dict[str, list[tuple[str, str]]]:
    """The course's pieces that may cite Megatron, by source kind."""
    out = {"notebook markdown": [], "notebook code": [], "megalab docstring": [], "megalab comment": [],
           "README": [], "INSTRUCTORS/CONTRIBUTING": [], "zh": []}
    for nb_path in sorted((ROOT / "course").glob("*/*.ipynb")):
        for i, cell in enumerate(json.loads(nb_path.read_text())["cells"]):
            where = f"{nb_path.relative_to(ROOT)} cell {i}"
            if cell["cell_type"] == "markdown":
                out["notebook markdown"] += markdown_units(where, "".join(cell["source"]))
            elif cell["cell_type"] == "code":
                out["notebook code"] += python_units(where, "".join(cell["source"]), strings=True)
    for py in sorted((ROOT / "megalab").rglob("*.py")):
        for where, text in python_units(str(py.relative_to(ROOT)), py.read_text(), strings=False):
            out["megalab comment" if where.endswith("comment") else "megalab docstring"].append((where, text))
    for name, kind in [("README.md", "README"), ("README.zh.md", "README"), ("course/INSTRUCTORS.md",
                       "INSTRUCTORS/CONTRIBUTING"), ("CONTRIBUTING.md", "INSTRUCTORS/CONTRIBUTING")]:
        out[kind] += markdown_units(name, (ROOT / name).read_text())
    for md in sorted((ROOT / "course" / "zh").rglob("*.md")):
        out["zh"] += markdown_units(str(md.relative_to(ROOT)), md.read_text())
    return out


def _names_after(segment: str, is_dir: bool, prose: bool) -> list[str]:
    """The names cited after a path: `ticked` ones in prose; in docstrings and comments also "path (A, B.c, d)",
    or after a folder's files "folder/ — a.py (A), b.py (B, c)" (only code-like words: snake_case, CamelCase,
    calls)."""
    ticked = TICKED.findall(segment)
    if prose:
        return ticked
    groups = ([g for _, g in re.findall(r"(\w+\.py)\s*\(([^()]*)\)", segment)] if is_dir
              else re.findall(r"^`?\s*[:,]?\s*\(([^()]*)\)", segment))
    return ticked + [t.strip() for g in groups for t in g.split(",")
                     if re.search(r"_|[a-z][A-Z]|^[A-Z]\w*[a-z]\w*$|\(", t.strip())]


def _is_ours(path: str) -> bool:
    """A tools/, examples/ or docs/ path of this repository (tools/megatron_index.py), not Megatron's."""
    return not path.startswith(("megatron/", "pretrain_")) and (ROOT / path.rstrip("/")).exists()


def _resolve_dotted(dotted: str) -> str | None:
    """Why megatron.a.b(.name) does not resolve (None when it does): the longest module prefix must be a file or
    package of the tree, and the name after it one of that module's names (or a submodule)."""
    idx, parts = index(), dotted.split(".")
    for i in range(len(parts), 1, -1):
        base = "/".join(parts[:i])
        module = f"{base}.py" if f"{base}.py" in idx["files"] else f"{base}/__init__.py" if f"{base}/" in idx["files"] \
            else None
        if module is None:
            continue
        rest = parts[i:]
        if not rest or rest[0] in idx["per_file"].get(module, set()):
            return None
        return f"{'.'.join(parts[:i + 1])}: {module} has no {rest[0]!r}"
    return f"module {dotted} is not in the tree"


def check_unit(where: str, text: str) -> list[str]:
    """The unresolved pointers of one unit, each as a line saying where and what."""
    idx, problems = index(), []
    prose = not where.endswith(("docstring", "comment", "string", "import"))
    historical = bool(HISTORICAL.search(text))  # a path: its sentence (or cell) says it is historical / later
    matches = [m for m in PATH.finditer(text) if not _is_ours(m.group(1).rstrip(".")) and not PLACEHOLDER.search(m.group(1))]
    for k, m in enumerate(matches):
        path = m.group(1).rstrip(".")
        is_dir = path.endswith("/") or f"{path}/" in idx["files"]
        if path not in idx["files"] and f"{path.rstrip('/')}/" not in idx["files"]:
            if not historical:
                problems.append(f"{where}: path {path} is not in {idx['source']}")
            continue
        end = matches[k + 1].start() if k + 1 < len(matches) else len(text)
        segment = text[m.end() + (text[m.end():m.end() + 1] == "`"):end]  # after the path's closing backtick
        if is_dir:  # "megatron/core/x/ — file.py (...)": the file names it lists must be in the folder
            for f in re.findall(r"(?<![\w/.])([\w/]+\.py)\b", segment):
                if (f"{path.rstrip('/')}/{f}" not in idx["files"] and f not in idx["files"] and not _is_ours(f)
                        and not HISTORICAL.search(segment.split(f)[0][-100:])):
                    problems.append(f"{where}: {f} is not in {path}")
        in_file = idx["per_file"].get(path) if path.endswith(".py") else None
        adjacent_end = 0  # names listed right after a .py path ("`a.py` — `A`, `B.c`") must be in that file
        for token in _names_after(segment, is_dir, prose):
            name = re.sub(r"\(.*\)$", "", token.strip()).strip()
            if (FILE_NAME.search(name) or not IDENT.match(name) or name.split(".")[0] in NOT_MEGATRON
                    or re.fullmatch(r"[0-9a-f]{7,40}", name)):  # a commit
                continue
            pos = segment.find(f"`{token}`") + 1 or segment.find(token)  # `GroupedMLP`, not inside `TEGroupedMLP`
            adjacent = pos >= adjacent_end and bool(ADJACENT.match(segment[adjacent_end:pos]))
            adjacent_end = pos + len(token) + 1 if adjacent else len(segment) + 1
            if HISTORICAL.search(segment[max(0, pos - 100):pos]) or OURS.search(segment[max(0, pos - 40):pos]):
                continue
            if "." in name:
                cls, member = name.split(".", 1)[0], name.split(".")[-1]
                if cls in idx["classes"]:
                    if member not in _members(cls):
                        problems.append(f"{where}: {name} — {cls} has no member {member!r} ({idx['source']})")
                    continue
                name = member
            if name not in idx["names"] and name not in idx["symbols"]:
                problems.append(f"{where}: {name} (after {path}) is not in {idx['source']}")
            elif in_file is not None and adjacent and name not in in_file:
                problems.append(f"{where}: {name} is not in {path} ({idx['source']})")
            elif name in idx["deprecated"] and not HISTORICAL.search(segment):
                problems.append(f"{where}: {name} is DEPRECATED in {idx['source']}: say so in the sentence")
    if matches and prose:  # "`PackedSeqParams`: `cu_seqlens_q`", "`RotaryEmbedding` (`forward`)": members of that class
        for m in CLASS_MEMBERS.finditer(text):
            cls = m.group(1)
            if cls not in idx["classes"] or HISTORICAL.search(text[max(0, m.start() - 100):m.end()]):
                continue
            for member in re.findall(r"`([a-z_]\w*)`", m.group(2)):
                if member not in _members(cls) and member not in idx["names"] and member not in idx["fields"]:
                    problems.append(f"{where}: {cls} has no member {member!r} ({idx['source']})")
    dotted = [m.group(0) for m in DOTTED.finditer(text)]
    dotted += [f"{module}.{name.strip()}" for module, names in IMPORT.findall(text) for name in names.split(",")]
    for name in dict.fromkeys(dotted):
        problem = _resolve_dotted(name)
        if problem and not historical:
            problems.append(f"{where}: {problem} ({idx['source']})")
    if re.search(r"\bMegatron", text):
        for m in MEGATRON_NAME.finditer(text):
            name = m.group(1)
            code_like = re.search(r"_|[a-z]{2}[A-Z]|\(", name + text[m.end():m.end() + 1]) and name.split(".")[0] not in NOT_MEGATRON
            if code_like and not HISTORICAL.search(text[max(0, m.start() - 100):m.end()]):
                if "." in name and name.split(".")[0] in idx["classes"]:
                    if name.split(".")[-1] not in _members(name.split(".")[0]):
                        problems.append(f"{where}: {name} — {name.split('.')[0]} has no member ({idx['source']})")
                elif name.split(".")[-1] not in idx["names"] and name.split(".")[-1] not in idx["symbols"]:
                    problems.append(f"{where}: Megatron's {name} is not in {idx['source']}")
        for m in RELATIVE.finditer(text):
            rel = m.group(1)
            if (not any(p in idx["files"] for p in (f"megatron/core/{rel}", f"megatron/{rel}", rel))
                    and not (ROOT / "megalab" / rel).exists() and not historical):
                problems.append(f"{where}: {rel} is in neither megatron/ nor megatron/core/ of {idx['source']}")
    # a Megatron command line ("`torchrun ... pretrain_gpt.py --flag`", a code line running it): its flags are Megatron's
    launch_spans = [span for span in (TICKED.findall(text) if "`" in text else [text])
                    if re.search(r"pretrain_\w+\.py|train_rl\.py", span)]
    for m in FLAG.finditer(text):
        flag = m.group(1)
        field = flag[2:].replace("-", "_")
        if flag in idx["flags"]:
            if (idx["flags"][flag] or field in idx["deprecated"]) and not HISTORICAL.search(text):
                problems.append(f"{where}: {flag} is deprecated in {idx['source']}: say so in the sentence")
        elif (any(flag in span for span in launch_spans) or MEGATRON_FLAG.search(text[:m.start()])) \
                and not HISTORICAL.search(text):
            problems.append(f"{where}: {flag} is not a flag of {idx['source']}")
    return problems


def test_the_index_is_the_pinned_commit():
    data = json.loads(INDEX.read_text())
    print(f"pointers checked against {data['source']}: commit {data['commit']}, {data['date']}")
    assert data["commit"] == PINNED_COMMIT and data["date"].startswith("2026-08-22")
    assert {"megatron/core/transformer/moe/moe_utils.py", "megatron/training/arguments.py", "pretrain_gpt.py",
            "tools/preprocess_data.py", "examples/", "docs/"} <= set(data["files"])
    assert data["flags"]["--tensor-model-parallel-size"] is False and data["flags"]["--use-dist-ckpt"] is True


@pytest.mark.parametrize("kind", ["notebook markdown", "notebook code", "megalab docstring", "megalab comment",
                                  "README", "INSTRUCTORS/CONTRIBUTING", "zh"])
def test_every_pointer_resolves(kind):
    cited = units()[kind]
    paths = sum(len(PATH.findall(t)) for _, t in cited)
    print(f"{kind}: {len(cited)} units, {paths} paths checked against {index()['source']}")
    assert cited  # the extraction found this kind's pointers
    problems = [p for where, text in cited for p in check_unit(where, text)]
    assert not problems, f"{len(problems)} pointers into Megatron-LM do not resolve:\n" + "\n".join(problems)


@pytest.mark.parametrize("text, expected", [
    ("`megatron/core/transformer/moe/moe_utils.py` — `topk_routing_with_score_function`", None),
    ("`megatron/core/transformer/moe/moe_utils.py` — `no_such_function`", "no_such_function"),
    ("`megatron/core/transformer/moe/moe_utils.py` — (older releases: `no_such_function`)", None),
    ("`megatron/core/transformer/moe/moe_utils.py` — `MoEAuxLossAutoScaler.loss_scale_x`", "has no member"),
    ("`megatron/core/packed_seq_params.py` — `PackedSeqParams.cu_seqlens_q`", None),
    ("`megatron/core/packed_seq_params.py` — `PackedSeqParams.cu_seqlens`", "has no member"),
    ("`megatron/core/packed_seq_params.py` — `PackedSeqParams`: `cu_seqlens` for the kernels", "has no member"),
    ("`megatron/core/packed_seq_params.py` — `PackedSeqParams`: `cu_seqlens_q` for the kernels", None),
    ("`megatron/core/transformer/moe/router.py` — `sort_chunks_by_idxs`", "is not in megatron/core/transformer"),
    ("`megatron/core/training/utils.py` — `get_batch_on_this_cp_rank`", "path megatron/core/training/utils.py"),
    ("`megatron/training/tokenizer/tokenizer.py` builds the tokenizer.", "path megatron/training/tokenizer"),
    ("Older releases kept it in `megatron/training/tokenizer/tokenizer.py`.", None),
    ("`examples/sc21/run_figure_11.sh` reproduces the figure.", "path examples/sc21"),
    ("`tools/megatron_index.py` builds this course's index.", None),
    ("`megatron/core/transformer/transformer_config.py` — `fp8_interval`", "DEPRECATED"),
    ("`megatron/core/transformer/transformer_config.py` — `fp8_interval` (deprecated)", None),
    ("`megatron/core/dist_checkpointing/` — with `--use-dist-ckpt`", "--use-dist-ckpt is deprecated"),
    ("`pretrain_gpt.py --tensor-model-parallel-size 2`", None),
    ("`pretrain_gpt.py --tensor-parallel-degree 2`", "--tensor-parallel-degree is not a flag"),
    ("`pretrain_gpt.py` is Megatron's; `python tools/megatron_index.py --git DIR` is ours", None),
    ("Megatron's `--no-such-flag` does it.", "--no-such-flag is not a flag"),
    ("torchrun `--nproc-per-node 2` starts two ranks.", None),
])
def test_the_checker_catches_stale_pointers(text, expected):
    _one_problem_or_none(check_unit("example", text), expected)


def _one_problem_or_none(problems, expected):
    if expected is None:
        assert not problems, problems
    else:
        assert len(problems) == 1 and expected in problems[0], problems


@pytest.mark.parametrize("docstring, expected", [
    ("Megatron: megatron/core/transformer/moe/router.py (TopKRouter, no_such_function).", "no_such_function"),
    ("Megatron: megatron/core/transformer/moe/router.py (TopKRouter, TopKRouter.routing).", None),
    ("Megatron: megatron/core/transformer/moe/ — router.py (TopKRouter), moe_utils.py (no_such_function)",
     "no_such_function"),
    ("Megatron: megatron/core/transformer/moe/ — router.py (TopKRouter), grouped_mlp.py (TopKRouter)",
     "grouped_mlp.py is not in"),
    ("Megatron: megatron/core/transformer/moe/ — router.py (TopKRouter), experts.py (GroupedMLP)", "GroupedMLP"),
    ("A free list. Megatron: BlockAllocator (core/inference/contexts/kv_block_allocator.py).", "BlockAllocator"),
    ("A free list. Megatron: KVBlockAllocator (core/inference/contexts/kv_block_allocator.py).", None),
    ("A free list. Megatron: KVBlockAllocator (inference/contexts/dynamic_block_allocator.py).", "is in neither"),
    ("Megatron's get_current_device(): this rank's device.", "get_current_device"),
    ("As megatron.core.transformer.moe.moe_utils.z_loss_func does (Megatron).", None),
    ("As megatron.core.transformer.moe.moe_utils.no_such_loss does (Megatron).", "has no 'no_such_loss'"),
    ("As megatron.core.no_such_module.z_loss_func does (Megatron).", "has no 'no_such_module'"),
])
def test_the_checker_reads_docstring_conventions(docstring, expected):
    _one_problem_or_none(check_unit("example docstring", docstring), expected)


# One planted stale pointer per kind of source, through the same extraction the course's files go through.
STALE = "megatron/training/tokenizer/tokenizer.py"


def _notebook_cells(markdown: str, code: str) -> str:
    return json.dumps({"cells": [{"cell_type": "markdown", "source": [markdown]},
                                 {"cell_type": "code", "source": [code], "outputs": []}]})


@pytest.mark.parametrize("kind, build", [
    ("notebook markdown", lambda: [u for i, c in enumerate(json.loads(_notebook_cells(
        f"The tokenizer lives in `{STALE}`.", "x = 1"))["cells"]) if c["cell_type"] == "markdown"
        for u in markdown_units(f"nb cell {i}", "".join(c["source"]))]),
    ("notebook code", lambda: python_units("nb cell 1", f"tok = build()  # Megatron: {STALE}\n", strings=True)),
    ("notebook code string", lambda: python_units("nb cell 1", f'print("as in {STALE}")\n', strings=True)),
    ("megalab docstring", lambda: python_units("megalab/x.py", f'def f():\n    """Megatron: {STALE} (build_tokenizer)."""\n',
                                               strings=False)),
    ("megalab comment", lambda: python_units("megalab/x.py", f"x = 1  # as Megatron's {STALE}\n", strings=False)),
    ("README", lambda: markdown_units("README.md", f"| tokenizer | `{STALE}` |\n|---|---|\n")),
    ("zh", lambda: markdown_units("course/zh/x.md", f"## abc123\n\n分词器位于 `{STALE}`。下一句。")),
])
def test_a_planted_stale_pointer_fails_in_each_kind_of_source(kind, build):
    cited = build()
    problems = [p for where, text in cited for p in check_unit(where, text)]
    assert len(problems) == 1 and f"path {STALE}" in problems[0], (kind, cited, problems)
    fixed = [(w, t.replace(STALE, "megatron/core/tokenizers/text/")) for w, t in cited]
    assert not [p for w, t in fixed for p in check_unit(w, t)]


def _script():
    import sys
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import megatron_index
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return megatron_index


def test_the_index_script_reads_a_tree(tmp_path):
    """On a Megatron-LM tree it indexes every file (non-Python ones as paths), classes and methods, class
    attributes, config fields (DEPRECATED docstrings marked), add_argument flags and the flags
    ArgumentGroupFactory derives from config dataclasses (deprecated ones marked)."""
    megatron_index = _script()
    tree = tmp_path / "mlm"
    (tree / "megatron" / "core").mkdir(parents=True)
    (tree / "megatron" / "training").mkdir()
    (tree / "docs").mkdir()
    (tree / "docs" / "guide.md").write_text("# guide\n")
    (tree / "megatron" / "core" / "cfg.py").write_text(
        'from dataclasses import dataclass, field\n'
        '@dataclass\nclass FooConfig:\n    a: int = 1\n    """The a."""\n    old: bool = False\n'
        '    """DEPRECATED and replaced by a."""\n    fused: bool = True\n    """Fuse."""\n'
        '    eps: float = field(default=1e-5, metadata={"argparse_meta": {"arg_names": ["--norm-eps"]}})\n'
        'class Bar:\n    def go(self, depth):\n        self.k = depth\n')
    (tree / "megatron" / "training" / "arguments.py").write_text(
        'def _add(parser):\n    parser.add_argument("--use-dist-ckpt", action="store_true", dest="use_dist_ckpt_deprecated")\n'
        '    parser.add_argument("--num-layers", type=int, help="Number of layers.")\n'
        '    parser.add_argument("--log", action=argparse.BooleanOptionalAction, help="\'full\' is deprecated.")\n'
        '    ArgumentGroupFactory(FooConfig, exclude=["a"]).build_group(parser)\n')
    (tree / "pretrain_gpt.py").write_text("def loss_func(loss_mask, output_tensor):\n    pass\n")
    out = tmp_path / "index.json"
    megatron_index.main(["--tree", str(tree), "--commit", "abc", "--date", "2026-01-01", "--out", str(out)])
    data = json.loads(out.read_text())
    assert (data["commit"], data["date"]) == ("abc", "2026-01-01")
    assert {"megatron/core/cfg.py", "megatron/training/arguments.py", "pretrain_gpt.py", "megatron/core/",
            "docs/guide.md", "docs/"} <= set(data["files"])
    assert data["flags"] == {"--use-dist-ckpt": True, "--num-layers": False, "--log": False, "--no-log": False,
                             "--old": True, "--no-fused": False, "--disable-fused": False, "--norm-eps": False}
    assert data["config_fields"] == {"FooConfig": {"a": False, "old": True, "fused": False, "eps": False}}
    assert data["names"]["megatron/core/cfg.py"] == ["FooConfig", "Bar", "Bar.go"]
    assert data["attributes"]["megatron/core/cfg.py"]["Bar"] == ["k"]
    assert {"depth", "k"} <= set(data["symbols"]["megatron/core/cfg.py"])


def test_the_index_script_reads_a_git_repository(tmp_path):
    """--git indexes a commit of a clone (not its work tree) and records that commit and its date."""
    import subprocess
    repo = tmp_path / "repo"
    (repo / "megatron" / "core").mkdir(parents=True)
    (repo / "megatron" / "core" / "a.py").write_text("def committed():\n    pass\n")
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "GIT_COMMITTER_DATE": "2026-08-22T15:22:22+00:00", "PATH": "/usr/bin:/bin"}
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-qm", "x"]):
        subprocess.run(["git", "-C", str(repo), *cmd], check=True, env=env)
    (repo / "megatron" / "core" / "b.py").write_text("def uncommitted():\n    pass\n")
    out = tmp_path / "index.json"
    _script().main(["--git", str(repo), "--out", str(out)])
    data = json.loads(out.read_text())
    sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert data["commit"] == sha and data["date"] == "2026-08-22T15:22:22+00:00"
    assert "megatron/core/a.py" in data["files"] and "megatron/core/b.py" not in data["files"]


MIRROR = Path("/work/.mirror/NVIDIA+Megatron-LM/repo")  # the course machines' clone of Megatron-LM
SPOT_CHECKED = ["megatron/core/transformer/moe/moe_utils.py", "megatron/core/packed_seq_params.py",
                "megatron/core/pipeline_parallel/schedules.py", "megatron/training/checkpointing.py",
                "megatron/core/tokenizers/utils/build_tokenizer.py"]


@pytest.mark.skipif(not MIRROR.exists(), reason="no Megatron-LM clone at the mirror path")
def test_the_committed_index_is_what_the_script_builds():
    """Against the pinned commit of a Megatron-LM clone: the same paths, and the same entries for a few files
    (a full rebuild takes a minute: `python tools/megatron_index.py --git <clone> --rev <commit>`)."""
    import subprocess
    script, data = _script(), json.loads(INDEX.read_text())

    def git(*args):
        return subprocess.run(["git", "-C", str(MIRROR), *args], check=True, capture_output=True, text=True).stdout

    stale = f"the committed index is stale: python tools/megatron_index.py --git {MIRROR} --rev {PINNED_COMMIT}"
    files = [f for f in git("ls-tree", "-r", "--name-only", PINNED_COMMIT).splitlines() if "__pycache__" not in f]
    folders = {p.as_posix() + "/" for f in files for p in Path(f).parents if p.as_posix() != "."}
    assert sorted(files + sorted(folders)) == data["files"], stale
    assert git("show", "-s", "--format=%cI", PINNED_COMMIT).strip() == data["date"], stale
    for rel in SPOT_CHECKED:
        entry = script.index_file(git("show", f"{PINNED_COMMIT}:{rel}"))
        for key in ("names", "symbols", "attributes", "bases"):
            assert data[key].get(rel, type(entry[key])()) == entry[key], (rel, key, stale)


def test_megalab_transformer_config_fields_are_megatrons():
    """megalab's TransformerConfig says its field names are Megatron's: each is a field of Megatron's
    TransformerConfig (or its base ModelParallelConfig) at the pin, or one its docstring names as GPTModel's
    argument (position_embedding_type is not a TransformerConfig field)."""
    import dataclasses

    from megalab.core.transformer import transformer_config
    data = json.loads(INDEX.read_text())
    megatron_fields = set(data["config_fields"]["TransformerConfig"]) | set(data["config_fields"]["ModelParallelConfig"])
    gpt_model_args = set(data["symbols"]["megatron/core/models/gpt/gpt_model.py"]) | {"seq_length"}
    doc = transformer_config.__doc__
    for f in dataclasses.fields(transformer_config.TransformerConfig):
        if f.name not in megatron_fields:
            assert f.name in gpt_model_args and f.name in doc, f"{f.name} is not a field of Megatron's TransformerConfig"


def test_a_code_cell_import_from_megatron_is_checked():
    cited = python_units("nb cell 3", "from megatron.core.transformer.moe.moe_utils import z_loss_func, topk_softmax\n",
                         strings=True)
    problems = [p for where, text in cited for p in check_unit(where, text)]
    assert len(problems) == 1 and "has no 'topk_softmax'" in problems[0], problems
