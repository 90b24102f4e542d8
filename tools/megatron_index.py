"""Index a Megatron-LM tree: every file path, class and function name, config field and command-line
flag, with the deprecated ones marked. tests/test_megatron_pointers.py checks the course's pointers
("this lives in megatron/core/X.py, class Y") against the committed index, tests/data/megatron_index.json.

    python tools/megatron_index.py                       # megatron/core of the installed megatron-core
    python tools/megatron_index.py --tree ~/Megatron-LM  # a whole checkout (training, tools, pretrain_gpt.py)
    python tools/megatron_index.py --out tests/data/megatron_index.json

What counts:
- files: every file and every folder under the indexed roots (folders end in "/"), relative to the tree root;
- names: per file, its module-level classes and functions and each class's methods ("Class.method");
- symbols: per file, the other names a pointer may cite: function parameters, attributes set on self,
  module-level variables, string constants used as choices (e.g. "p2p");
- config_fields: per dataclass-like class whose name ends in "Config", its annotated fields, with
  deprecated=True when the field's docstring (the string right after it) says DEPRECATED;
- flags: every "--flag" given to an add_argument call, with deprecated=True when its help text says
  deprecated / no longer (megatron/training/arguments.py; none in megatron/core).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path


def _deprecated(text: str | None) -> bool:
    text = (text or "").lower()
    return "deprecated" in text or "no longer" in text


def _symbols(tree: ast.AST) -> set[str]:
    """Parameters, self attributes, module-level variables and short identifier-like strings of a file."""
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
    return out


def index_file(source: str) -> tuple[list[str], dict[str, dict[str, bool]], dict[str, bool], list[str]]:
    """(names, config fields by class, flags, symbols) of one Python file's source."""
    tree = ast.parse(source)
    names, configs, flags = [], {}, {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.append(node.name)
        elif isinstance(node, ast.ClassDef):
            names.append(node.name)
            body = node.body
            for item in body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.append(f"{node.name}.{item.name}")
            if node.name.endswith("Config"):
                fields = {}
                for i, item in enumerate(body):
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        doc = body[i + 1] if i + 1 < len(body) else None
                        text = doc.value.value if (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                                                   and isinstance(doc.value.value, str)) else ""
                        fields[item.target.id] = _deprecated(text.split(".")[0] if text else "")
                configs[node.name] = fields
    for node in ast.walk(tree):  # parser.add_argument("--flag", ..., help="...")
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            help_text = next((kw.value.value for kw in node.keywords if kw.arg == "help"
                              and isinstance(kw.value, ast.Constant)), "")
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("--"):
                    flags[arg.value] = _deprecated(help_text)
    return names, configs, flags, sorted(_symbols(tree) - set(names))


def build_index(tree_root: Path, roots: list[str], source: str) -> dict:
    """The index of every .py file under tree_root/<root> for each root."""
    index = {"source": source, "roots": roots, "files": [], "names": {}, "symbols": {}, "config_fields": {},
             "flags": {}}
    for root in roots:
        base = tree_root / root
        paths = [base] if base.is_file() else [base, *sorted(base.rglob("*"))]
        for path in paths:
            rel = path.relative_to(tree_root).as_posix()
            if "__pycache__" in rel:
                continue
            if path.is_dir():
                index["files"].append(rel + "/")
            elif path.suffix in (".cpp", ".cu", ".h"):  # C++ helpers (datasets/helpers.cpp): their identifiers
                index["files"].append(rel)
                index["symbols"][rel] = sorted(set(re.findall(r"\b[A-Za-z_]\w*\b", path.read_text(errors="replace"))))
            elif path.suffix == ".py":
                index["files"].append(rel)
                try:
                    names, configs, flags, symbols = index_file(path.read_text(encoding="utf-8"))
                except SyntaxError as e:  # a file this Python cannot parse: listed, not indexed
                    print(f"warning: {rel}: {e}", file=sys.stderr)
                    continue
                if names:
                    index["names"][rel] = names
                if symbols:
                    index["symbols"][rel] = symbols
                for cls, fields in configs.items():
                    index["config_fields"].setdefault(cls, {}).update(fields)
                index["flags"].update(flags)
    return index


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, help="a Megatron-LM checkout (default: the installed megatron-core)")
    parser.add_argument("--roots", nargs="*", help="paths under the tree to index (default: megatron/core, or "
                        "megatron, tools, pretrain_gpt.py for a checkout)")
    parser.add_argument("--source", help="what the index was built from, recorded in it")
    parser.add_argument("--out", type=Path, default=Path("tests/data/megatron_index.json"))
    args = parser.parse_args(argv)
    if args.tree is None:  # the installed wheel (megatron/core only), found without importing it
        import importlib.metadata
        import importlib.util

        spec = importlib.util.find_spec("megatron.core")
        if spec is None:
            raise SystemExit("megatron-core is not installed: `make setup` (or pip install -e .[dev]), or pass --tree")
        version = importlib.metadata.version("megatron-core")
        tree = Path(spec.origin).parents[2]
        roots = args.roots or ["megatron/core"]
        source = args.source or f"megatron-core {version} (Megatron-LM tag core_v{version}): megatron/core"
    else:
        tree = args.tree
        roots = args.roots or [r for r in ("megatron", "tools", "pretrain_gpt.py") if (tree / r).exists()]
        source = args.source or f"Megatron-LM checkout {tree}"
    index = build_index(tree, roots, source)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(index, separators=(",", ":"), sort_keys=True) + "\n")
    print(f"{args.out}: {len(index['files'])} files, {sum(map(len, index['names'].values()))} names, "
          f"{sum(map(len, index['config_fields'].values()))} config fields, {len(index['flags'])} flags")


if __name__ == "__main__":
    main()
