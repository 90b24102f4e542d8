"""Swap a named mistake into a live process: the code of the function around an exercise region, compiled
again with a wrong body, replaces that function's `__code__`, so every reference to the function sees it.

Used by the mutant runner (megalab/lab/mutants.py) in its own process, and by every rank that
megalab.lab.launch starts while MEGALAB_MUTANT names a mutant (megalab.lab.worker calls apply_from_env).
"""

from __future__ import annotations

import importlib
import inspect
import json
import linecache
import os
import textwrap
from pathlib import Path

ENV = "MEGALAB_MUTANT"


class CannotSwap(RuntimeError):
    """The function around a region cannot be swapped in a live process (run the mistake `fresh`)."""


def mutated_source(text: str, ex, code: str) -> str:
    """`text` (the module holding `ex`) with the region's body replaced by `code`, at the region's indent."""
    begin, end = ex.solution
    lines = text.splitlines(keepends=True)
    body = [ex.indent + line if line.strip() else "\n" for line in textwrap.dedent(code).strip("\n").splitlines(True)]
    body = [line if line.endswith("\n") else line + "\n" for line in body]
    return "".join(lines[:begin] + body + lines[end + 1 :])


def _module_name(rel: str) -> str:
    return rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _holder(module, qualname: str):
    """(function object, its qualname) of the outermost function on the path `qualname` inside `module`."""
    obj, parts = module, qualname.split(".")
    for i, part in enumerate(parts):
        owner = obj
        obj = inspect.getattr_static(owner, part, None)
        if obj is None:
            raise CannotSwap(f"{module.__name__}.{'.'.join(parts[: i + 1])} is not reachable")
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        while hasattr(obj, "__wrapped__") and not hasattr(obj, "__code__"):  # functools.lru_cache, wraps
            obj = obj.__wrapped__
        if inspect.isfunction(obj):
            while hasattr(obj, "__wrapped__") and inspect.isfunction(obj.__wrapped__):
                obj = obj.__wrapped__
            return obj, ".".join(parts[: i + 1])
        if not inspect.isclass(obj):
            raise CannotSwap(f"{module.__name__}.{'.'.join(parts[: i + 1])} is a {type(obj).__name__}, "
                             "not a plain function (mark the mistake fresh=True)")
    raise CannotSwap(f"no function at {qualname}")


def _find_code(code, qualname: str):
    if getattr(code, "co_qualname", None) == qualname:
        return code
    for const in code.co_consts:
        if inspect.iscode(const):
            found = _find_code(const, qualname)
            if found is not None:
                return found
    return None


def swap(root: Path, rel: str, line: int, source: str):
    """Swap the code of the function around 1-based `line` of module `rel` for its code in `source`;
    returns a callable that undoes it."""
    from megalab.lab.workspace import enclosing_function, parse_module

    qualname = enclosing_function(parse_module(source, rel), line)
    if qualname is None:
        raise CannotSwap(f"{rel}:{line} is not inside a function")
    module = importlib.import_module(_module_name(rel))
    func, outer = _holder(module, qualname)
    filename = func.__code__.co_filename
    new = _find_code(compile(source, filename, "exec"), func.__code__.co_qualname)
    if new is None or len(new.co_freevars) != len(func.__code__.co_freevars):
        raise CannotSwap(f"cannot rebuild {outer} of {rel} from the mutated source")
    old, old_lines = func.__code__, linecache.cache.get(filename)
    func.__code__ = new
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # tracebacks show the mutant
    clear = [o.cache_clear for o in vars(module).values() if callable(getattr(o, "cache_clear", None))]
    for c in clear:
        c()

    def undo():
        func.__code__ = old
        if old_lines is None:
            linecache.cache.pop(filename, None)
        else:
            linecache.cache[filename] = old_lines
        for c in clear:
            c()

    return undo


def apply_from_env() -> None:
    """In a rank: swap in the mutant that MEGALAB_MUTANT names (a JSON file), if any."""
    path = os.environ.get(ENV)
    if path:
        spec = json.loads(Path(path).read_text())
        swap(Path(spec["root"]), spec["path"], spec["line"], spec["source"])
