"""Index Megatron-LM's whole tree at one commit: every file path, class and function name, config field and
command-line flag, with the deprecated ones marked. tests/test_megatron_pointers.py checks every pointer the
course makes ("this lives in megatron/core/X.py, class Y", "pretrain_gpt.py --flag") against the committed
index, tests/data/megatron_index.json.

    python tools/megatron_index.py --git /work/.mirror/NVIDIA+Megatron-LM/repo   # a clone (bare or not), at HEAD
    python tools/megatron_index.py --git ~/Megatron-LM --rev d98e8a64           # a clone, at a commit
    python tools/megatron_index.py --tree ~/Megatron-LM                        # a checkout's files as they are

What counts:
- files: every file and every folder of the tree (folders end in "/"); non-Python files (docs, shell
  scripts, yaml, json) are listed as paths only;
- names: per Python file, its module-level classes and functions and each class's methods ("Class.method");
- symbols: per Python file (and C++ helper), the other names a pointer may cite: function parameters,
  attributes, module-level variables, names imported from elsewhere (re-exports), identifier-like string
  constants (e.g. "p2p");
- attributes, bases: per Python file, per class: its fields, class variables, __init__ parameters and self.x
  assignments; its bases;
- config_fields: per class whose name ends in "Config", its annotated fields, True when the field's
  docstring (the string right after it) says deprecated;
- flags: every "--flag" of every add_argument call in the tree, and the flags Megatron's
  ArgumentGroupFactory derives from config dataclasses (megatron/training/arguments.py), True when
  deprecated (its help or its field's docstring says so, its dest says "deprecated", or a message says
  "--flag is deprecated");
  flag_files: the files each flag is defined in;
- commit, date: the commit indexed and its date (from git; --commit/--date for a tree outside git).
Only Python files under tests/ contribute nothing but their paths (the course cites Megatron's code, and the
index stays small).
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

DEPRECATED = re.compile(r"deprecated|no longer (?:used|supported|has any effect)|has no effect", re.I)
# a flag's help text that deprecates the flag itself (not one of its values: "'full' is deprecated")
HELP_DEPRECATED = re.compile(r"^\W*deprecated|(?-i:\bDEPRECATED\b)|deprecated:|(?:this|the) (?:flag|argument|option) is "
                             r"(?:deprecated|a no-op)", re.I)
FLAG_DEPRECATED_MESSAGE = re.compile(r"(--[a-z0-9][a-z0-9-]*)['\"`]?(?: flag)? (?:is|are) deprecated", re.I)
SYMBOLS_SKIPPED = ("tests/",)  # Python files under these folders: paths only


def _deprecated(text: str | None) -> bool:
    return bool(DEPRECATED.search(text or ""))


def _symbols(tree: ast.AST) -> set[str]:
    """Parameters, attributes, module-level variables and short identifier-like strings of a file."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.Attribute):  # self.x, and what it calls: torch.distributed.batch_isend_irecv
            out.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            out.add(node.value)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):  # nested ones too
            out.add(node.name)
        elif isinstance(node, ast.ImportFrom):  # re-exports: megatron/core/optimizer/__init__.py's DynamicGradScaler
            out.update(a.asname or a.name for a in node.names if a.name != "*")
    return out


def _string(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):  # f"...": its literal parts
        return "".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):  # "a" "b" split with +
        return (_string(node.left) or "") + (_string(node.right) or "")
    return None


def _field_doc(body: list[ast.stmt], i: int) -> str:
    doc = body[i + 1] if i + 1 < len(body) else None
    return (_string(doc.value) or "") if isinstance(doc, ast.Expr) else ""


def dataclass_fields(cls: ast.ClassDef) -> list[dict]:
    """The annotated fields of a class body: name, deprecated, init, bool default, argparse_meta arg_names."""
    out = []
    for i, item in enumerate(cls.body):
        if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
            continue
        if isinstance(item.annotation, ast.Subscript) and getattr(item.annotation.value, "id", "") == "ClassVar":
            continue
        field = {"name": item.target.id, "deprecated": _deprecated(_field_doc(cls.body, i).split(".")[0]),
                 "init": True, "default": None, "arg_names": None,
                 "bool": isinstance(item.annotation, ast.Name) and item.annotation.id == "bool"}
        value = item.value
        if isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "")) == "field":
            for kw in value.keywords:
                if kw.arg == "init" and isinstance(kw.value, ast.Constant):
                    field["init"] = bool(kw.value.value)
                elif kw.arg == "default" and isinstance(kw.value, ast.Constant):
                    field["default"] = kw.value.value
                elif kw.arg == "metadata" and isinstance(kw.value, ast.Dict):
                    for k, v in zip(kw.value.keys, kw.value.values):
                        if _string(k) == "argparse_meta" and isinstance(v, ast.Dict):
                            for k2, v2 in zip(v.keys, v.values):
                                if _string(k2) == "arg_names" and isinstance(v2, (ast.List, ast.Tuple)):
                                    field["arg_names"] = [_string(e) for e in v2.elts if _string(e)]
        elif isinstance(value, ast.Constant):
            field["default"] = value.value
        out.append(field)
    return out


def _class_attributes(cls: ast.ClassDef) -> list[str]:
    """A class's annotated fields, class-level variables, __init__ parameters and the self.x its methods assign."""
    out = set()
    for item in cls.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            out.add(item.target.id)
        elif isinstance(item, ast.Assign):
            out.update(t.id for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if item.name == "__init__":  # its parameters: ColumnParallelLinear's stride
                out.update(a.arg for a in (*item.args.posonlyargs, *item.args.args, *item.args.kwonlyargs)
                           if a.arg != "self")
            for node in ast.walk(item):
                targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                           if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
                out.update(t.attr for t in targets if isinstance(t, ast.Attribute)
                           and isinstance(t.value, ast.Name) and t.value.id == "self")
    return sorted(out)


def index_file(source: str) -> dict:
    """One Python file's names, symbols, config fields by class, class attributes and bases, and the flags of
    its add_argument calls."""
    tree = ast.parse(source)
    names, configs, flags, attributes, bases = [], {}, {}, {}, {}
    body = []  # module level, including the definitions under `if HAVE_TE:` / `try:` (fp8_utils' get_fp8_context)
    for node in tree.body:
        if isinstance(node, (ast.If, ast.Try)):
            body += [n for block in (node.body, node.orelse, getattr(node, "finalbody", []),
                                     *[h.body for h in getattr(node, "handlers", [])]) for n in block]
        else:
            body.append(node)
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name in names:
                continue
            names.append(node.name)
        elif isinstance(node, ast.ClassDef) and node.name not in names:
            names.append(node.name)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.append(f"{node.name}.{item.name}")
            attributes[node.name] = _class_attributes(node)
            bases[node.name] = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                                if isinstance(b, (ast.Name, ast.Attribute))]
            if node.name.endswith("Config"):
                configs[node.name] = {f["name"]: f["deprecated"] for f in dataclass_fields(node)}
    for node in ast.walk(tree):  # parser.add_argument("--flag", ..., help="...", dest="..._deprecated")
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            kw = {k.arg: _string(k.value) for k in node.keywords}
            deprecated = bool(HELP_DEPRECATED.search(kw.get("help") or "")) or "deprecated" in (kw.get("dest") or "")
            negated = any(k.arg == "action" and getattr(k.value, "attr", getattr(k.value, "id", "")) ==
                          "BooleanOptionalAction" for k in node.keywords)  # --x and --no-x
            for arg in node.args:
                if (_string(arg) or "").startswith("--"):
                    for flag in [_string(arg)] + ([f"--no-{_string(arg)[2:]}"] if negated else []):
                        flags[flag] = flags.get(flag, False) or deprecated
    for node in ast.walk(tree):  # print('--use-dist-ckpt is deprecated and has no effect ...')
        for flag in FLAG_DEPRECATED_MESSAGE.findall(_string(node) or "") if isinstance(
                node, (ast.Constant, ast.JoinedStr)) else ():
            if flag in flags:
                flags[flag] = True
    return {"names": names, "symbols": sorted(_symbols(tree) - set(names)), "config_fields": configs,
            "attributes": {c: a for c, a in attributes.items() if a}, "bases": {c: b for c, b in bases.items() if b},
            "flags": flags}


def factory_flags(sources: dict[str, str]) -> dict[str, tuple[bool, str]]:
    """Flags that ArgumentGroupFactory(Config, exclude=[...]).build_group adds (megatron/training/argument_utils.py):
    "--field-name" per init field, "--no-x"/"--disable-x" for a bool defaulting to True, argparse_meta's
    arg_names where given; fields inherited from base classes included. {flag: (deprecated, file)}."""
    classes: dict[str, tuple[ast.ClassDef, str]] = {}
    calls = []
    for rel, source in sources.items():
        if not rel.startswith("megatron/"):
            continue
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, (node, rel))
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ArgumentGroupFactory"
                  and node.args and isinstance(node.args[0], ast.Name)):
                exclude = next((k.value for k in node.keywords if k.arg == "exclude"), None)
                excluded = set()
                if isinstance(exclude, (ast.List, ast.Tuple)):
                    excluded = {_string(e) for e in exclude.elts}
                elif isinstance(exclude, ast.Name):  # exclude = [...] assigned earlier in the same function
                    for assign in ast.walk(tree):
                        if (isinstance(assign, ast.Assign) and any(getattr(t, "id", None) == exclude.id
                                                                   for t in assign.targets)
                                and isinstance(assign.value, (ast.List, ast.Tuple))):
                            excluded |= {_string(e) for e in assign.value.elts}
                calls.append((node.args[0].id, excluded))

    def fields(name: str, seen: set[str]) -> list[dict]:
        if name not in classes or name in seen:
            return []
        cls, _ = classes[name]
        inherited = [f for base in cls.bases if isinstance(base, ast.Name) for f in fields(base.id, seen | {name})]
        own = dataclass_fields(cls)
        own_names = {f["name"] for f in own}
        return [f for f in inherited if f["name"] not in own_names] + own

    out = {}
    for name, excluded in calls:
        for f in fields(name, set()):
            if f["name"] in excluded or not f["init"]:
                continue
            dashed = f["name"].replace("_", "-")
            arg_names = f["arg_names"] or ([f"--no-{dashed}", f"--disable-{dashed}"] if f["bool"] and f["default"] is True
                                           else [f"--{dashed}"])
            for flag in arg_names:
                out[flag] = (f["deprecated"], classes[name][1])
    return out


def build_index(tree_root: Path, commit: str, date: str, source: str) -> dict:
    """The index of every file under tree_root (a Megatron-LM tree at `commit`)."""
    index = {"source": source, "commit": commit, "date": date, "files": [], "names": {}, "symbols": {},
             "attributes": {}, "bases": {}, "config_fields": {}, "flags": {}, "flag_files": {}}
    files, folders, sources = [], set(), {}
    for path in sorted(tree_root.rglob("*")):
        rel = path.relative_to(tree_root).as_posix()
        if rel.startswith(".git/") or rel == ".git" or "__pycache__" in rel:
            continue
        if path.is_symlink():  # a link (CLAUDE.md, .claude/skills): a path, not followed
            files.append(rel)
            folders.update(p.as_posix() + "/" for p in Path(rel).parents if p.as_posix() != ".")
            continue
        if not path.is_file():
            continue
        files.append(rel)
        folders.update(p.as_posix() + "/" for p in Path(rel).parents if p.as_posix() != ".")
        skipped = rel.startswith(SYMBOLS_SKIPPED)
        if path.suffix in (".cpp", ".cu", ".h") and not skipped:  # C++ helpers (datasets/helpers.cpp): identifiers
            index["symbols"][rel] = sorted(set(re.findall(r"\b[A-Za-z_]\w*\b", path.read_text(errors="replace"))))
        elif path.suffix == ".py" and not skipped:
            sources[rel] = path.read_text(encoding="utf-8", errors="replace")
    index["files"] = sorted(files + sorted(folders))
    for rel, text in sources.items():
        try:
            entry = index_file(text)
        except SyntaxError as e:  # a file this Python cannot parse: listed, not indexed
            print(f"warning: {rel}: {e}", file=sys.stderr)
            continue
        for key in ("names", "symbols", "attributes", "bases"):
            if entry[key]:
                index[key][rel] = entry[key]
        for cls, fields in entry["config_fields"].items():
            index["config_fields"].setdefault(cls, {}).update(fields)
        for flag, deprecated in entry["flags"].items():
            index["flags"][flag] = index["flags"].get(flag, False) or deprecated
            index["flag_files"].setdefault(flag, []).append(rel)
    for flag, (deprecated, _) in factory_flags(
            {r: s for r, s in sources.items() if "ArgumentGroupFactory" in s or "Config" in s}).items():
        index["flags"][flag] = index["flags"].get(flag, False) or deprecated
        if "megatron/training/arguments.py" not in index["flag_files"].setdefault(flag, []):
            index["flag_files"][flag].append("megatron/training/arguments.py")
    for flag in index["flag_files"]:
        index["flag_files"][flag] = sorted(set(index["flag_files"][flag]))
    return index


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--git", type=Path, help="a Megatron-LM git repository (bare or not): index --rev's tree")
    where.add_argument("--tree", type=Path, help="a Megatron-LM checkout: index its files as they are")
    parser.add_argument("--rev", default="HEAD", help="with --git: the commit to index (default HEAD)")
    parser.add_argument("--commit", help="with --tree outside git: the commit it is (default: git rev-parse HEAD)")
    parser.add_argument("--date", help="with --tree outside git: the commit's date (default: from git)")
    parser.add_argument("--out", type=Path, default=Path("tests/data/megatron_index.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.git is not None:
            commit = _git(args.git, "rev-parse", f"{args.rev}^{{commit}}")
            date = _git(args.git, "show", "-s", "--format=%cI", commit)
            archive = subprocess.run(["git", "-C", str(args.git), "archive", commit], check=True,
                                     capture_output=True).stdout
            with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
                tar.extractall(tmp, filter="data")
            tree = Path(tmp)
        else:
            tree = args.tree
            commit, date = args.commit, args.date
            if commit is None or date is None:
                try:
                    commit = commit or _git(tree, "rev-parse", "HEAD")
                    date = date or _git(tree, "show", "-s", "--format=%cI", commit)
                except (subprocess.CalledProcessError, FileNotFoundError):
                    raise SystemExit(f"{tree} is not a git checkout: pass --commit and --date") from None
        index = build_index(tree, commit, date, f"Megatron-LM {commit[:8]} ({date[:10]})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(index, separators=(",", ":"), sort_keys=True) + "\n")
    print(f"{args.out}: {index['source']}: {len(index['files'])} paths, {sum(map(len, index['names'].values()))} "
          f"names, {sum(map(len, index['config_fields'].values()))} config fields, {len(index['flags'])} flags "
          f"({sum(index['flags'].values())} deprecated)")


if __name__ == "__main__":
    main()
