"""Device lint: find tensors and models made on the CPU by default that reach a collective or a model.

Under NCCL every tensor in a collective must live on the rank's GPU ("No backend type associated
with device type cpu", even at world size 1), and a model on the CPU cannot take GPU inputs. gloo
on CPU hides both. This lint reads code (megalab/ and every `%%torchrun` cell) without running it:

    t = torch.zeros(4)            # a factory without device=      -> t is "on the CPU by default"
    u = t.float().view(2, 2)      # derived from t                  -> so is u
    dist.all_reduce(u)            # reaches a collective            -> finding
    m = nn.Linear(4, 4)           # a module built without device= and never .to(...)'d
    m(x)                          # called (forward)                -> finding

`*_like` factories inherit their input's device, `device=` or `.to(...)`/`.cuda()` clears a name.
The dataflow is per function (a cell is one scope; nested functions see their enclosing names),
in source order, through plain names only -- pragmatic, not a type checker. CPU-only data prep
that is meant to stay on the CPU goes in ALLOW_LIST with its reason.

    python -m megalab.lab.device_lint [PATH ...]     print findings (exit 1 if any)
"""

from __future__ import annotations

import ast
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FACTORIES = {"zeros", "ones", "empty", "full", "arange", "range", "randn", "rand", "randint", "randperm",
             "tensor", "as_tensor", "eye", "linspace", "logspace", "normal", "empty_strided", "from_numpy"}
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
               "broadcast", "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
               "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv",
               "P2POp", "gather", "scatter"}
COLLECTIVES -= {"all_gather_object"}  # pickles objects: any device
# calling these with a module hands its parameters to collectives
WRAPPERS = {"DistributedDataParallel", "DDP", "FullyShardedDataParallel", "fully_shard"}
CONTAINERS = {"ModuleList", "Sequential", "ModuleDict"}
# methods that return a tensor on the same device (taint flows through them)
SAME_DEVICE_METHODS = {"view", "reshape", "float", "double", "half", "bfloat16", "long", "int", "bool", "clone",
                       "contiguous", "flatten", "t", "unsqueeze", "squeeze", "transpose", "permute", "expand",
                       "repeat", "narrow", "chunk", "split", "detach", "requires_grad_", "cumsum", "sum", "mean",
                       "mul", "add", "div", "sub", "pow", "sqrt", "abs", "exp", "softmax", "type", "fill_", "zero_",
                       "normal_", "uniform_", "mul_", "add_", "div_", "copy_", "view_as", "reshape_as", "index_select",
                       "masked_fill", "unbind", "tensor_split"}
MOVES = {"to", "cuda"}
MODEL_NAME = re.compile(r"(^|_)(model|stage|stages|chunk|layer|block|net|ddp|module|mlp|attn|attention)s?(\d*|_.*)$")

# file::scope::name (or file::scope::* for a whole function) -> why CPU tensors are right there
# (scope: function name, "<module>" or "<cell>")
ALLOW_LIST: dict[str, str] = {
    "megalab/extras/tiny_gpt.py::train::*": "trains the shipped CPU checkpoint in one process (no collective); "
                                            "it must be reproducible on the CPU machines that check it",
}


@dataclass(frozen=True)
class Finding:
    path: str  # file (relative to the repository), a notebook with "#cell N" appended
    line: int
    scope: str
    name: str  # the variable (or the factory expression) that reaches the sink
    made: str  # what made it: "torch.zeros" / "nn.Linear" ...
    sink: str  # "dist.all_reduce" / "model call" / "DistributedDataParallel"

    @property
    def key(self) -> str:
        return f"{self.path.split('#')[0]}::{self.scope}::{self.name}"

    def __str__(self) -> str:
        return (f"{self.path}:{self.line} in {self.scope}: {self.name} ({self.made} without device=) reaches "
                f"{self.sink}; create it with device=dev (dev = mdist.device()) or move it with .to(dev)")


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else node.attr
    return ""


def module_classes(root: Path = ROOT) -> set[str]:
    """Names of the classes in megalab/ that are nn.Modules (directly or through another such class)."""
    bases: dict[str, set[str]] = {}
    for path in (root / "megalab").rglob("*.py"):
        try:
            tree = ast.parse(path.read_text())
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases.setdefault(node.name, set()).update(_dotted(b).split(".")[-1] for b in node.bases)
    found = {"Module"}
    changed = True
    while changed:
        changed = False
        for name, bs in bases.items():
            if name not in found and bs & found:
                found.add(name)
                changed = True
    found.discard("Module")
    return found


class _Scope:
    def __init__(self, linter: _Linter, name: str, tainted: dict, modules: set, makers: dict | None = None):
        self.linter, self.name = linter, name
        self.tainted = dict(tainted)  # name -> (kind "tensor"/"module", what made it)
        self.modules = set(modules)  # names bound to a module (on any device)
        self.makers = dict(makers or {})  # local functions that return a CPU-default tensor/module: name -> origin
        self.returned = None  # what this function returns, if CPU-default

    # -------------------------------------------------------------- what an expression is
    def _factory(self, call: ast.Call) -> str | None:
        """'torch.zeros' if call makes a CPU-default tensor (no device=), else None."""
        name = _dotted(call.func)
        parts = name.split(".")
        if len(parts) == 2 and parts[0] == "torch" and parts[1] in FACTORIES:
            if any(k.arg == "device" for k in call.keywords):
                return None
            return name
        return None

    def _module_ctor(self, call: ast.Call) -> str | None:
        name = _dotted(call.func)
        parts = name.split(".")
        is_nn = len(parts) >= 2 and parts[-2] == "nn" and parts[-1][:1].isupper()
        if is_nn or (parts[0] != "torch" and parts[-1] in self.linter.classes):
            return name
        return None

    def origin(self, node: ast.AST) -> tuple[str, str] | None:
        """(kind, what) if node's value is a CPU-default tensor/module, else None."""
        if isinstance(node, ast.Name):
            return self.tainted.get(node.id)
        if isinstance(node, ast.Call):
            made = self._factory(node)
            if made:
                return ("tensor", made)
            made = self._module_ctor(node)
            if made:  # a wrapper (DDP) is where its module is: the module is checked where it is made
                last = made.split(".")[-1]
                if last in CONTAINERS:  # nn.Sequential(...): where the modules inside are
                    inner = [self.origin(n) for a in node.args for n in ast.walk(a) if n is not a
                             and isinstance(n, (ast.Name, ast.Call))] + [self.origin(a) for a in node.args]
                    return ("module", made) if any(o and o[0] == "module" for o in inner) else None
                wrapper = last in WRAPPERS
                return None if wrapper or any(k.arg == "device" for k in node.keywords) else ("module", made)
            if isinstance(node.func, ast.Name) and node.func.id in self.makers:  # make() defined above
                return self.makers[node.func.id]
            if isinstance(node.func, ast.Attribute):
                if node.func.attr in MOVES:
                    return None
                if node.func.attr in SAME_DEVICE_METHODS:
                    return self.origin(node.func.value)
            name = _dotted(node.func)
            if name in ("torch.cat", "torch.stack", "torch.concat") and node.args:
                return self.origin(node.args[0])
            return None
        if isinstance(node, (ast.List, ast.Tuple)):
            for elt in node.elts:
                if (o := self.origin(elt)) and o[0] == "tensor":
                    return o
            return None
        if isinstance(node, (ast.ListComp, ast.GeneratorExp)):
            o = self.origin(node.elt)
            return o if o and o[0] == "tensor" else None
        if isinstance(node, ast.Subscript):
            return self.origin(node.value)
        if isinstance(node, ast.BinOp):
            return self.origin(node.left) or self.origin(node.right)
        if isinstance(node, ast.IfExp):
            return self.origin(node.body) or self.origin(node.orelse)
        if isinstance(node, ast.Starred):
            return self.origin(node.value)
        return None

    def _label(self, node: ast.AST) -> str:
        return node.id if isinstance(node, ast.Name) else ast.unparse(node)[:40]

    # -------------------------------------------------------------- sinks
    def check_calls(self, stmt: ast.AST) -> None:
        for node in ast.walk(stmt):
            if not isinstance(node, ast.Call):
                continue
            name = _dotted(node.func)
            last = name.split(".")[-1]
            args = list(node.args) + [k.value for k in node.keywords if k.arg not in ("group", "src", "dst", "op")]
            if last in COLLECTIVES and (name.startswith(("dist.", "torch.distributed.")) or name in COLLECTIVES):
                for arg in args:
                    if (o := self.origin(arg)) and o[0] == "tensor":
                        self.report(node, self._label(arg), o[1], name)
            elif last in WRAPPERS:
                for arg in node.args[:1]:
                    if (o := self.origin(arg)) and o[0] == "module":
                        self.report(node, self._label(arg), o[1], last)
            elif self._is_model(node.func):
                if isinstance(node.func, ast.Name) and (o := self.tainted.get(node.func.id)) and o[0] == "module":
                    self.report(node, node.func.id, o[1], "a forward call")
                for arg in args:
                    if (o := self.origin(arg)) and o[0] == "tensor":
                        self.report(node, self._label(arg), o[1], f"model {name}")

    def _is_model(self, func: ast.AST) -> bool:
        if isinstance(func, ast.Name):
            return func.id in self.modules or bool(MODEL_NAME.search(func.id))
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
            return func.attr in ("module",)
        return False

    def report(self, node: ast.AST, name: str, made: str, sink: str) -> None:
        self.linter.add(Finding(self.linter.path, self.linter.line0 + node.lineno, self.name, name, made, sink))

    # -------------------------------------------------------------- statements in order
    def bind(self, target: ast.AST, value: ast.AST | None) -> None:
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts):  # a, b = x[:1], x[1:]
                self.bind(t, v)
            return
        names = [target] if isinstance(target, ast.Name) else [
            e for e in getattr(target, "elts", []) if isinstance(e, ast.Name)]
        o = self.origin(value) if value is not None else None
        single = isinstance(target, ast.Name)
        for n in names:
            if single and o:
                self.tainted[n.id] = o
            else:
                self.tainted.pop(n.id, None)
            if single and isinstance(value, ast.Call) and (self._module_ctor(value) or (o and o[0] == "module")):
                self.modules.add(n.id)

    def run(self, body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = _Scope(self.linter, stmt.name, self.tainted, self.modules, self.makers)
                inner.run(stmt.body)
                if inner.returned:
                    self.makers[stmt.name] = inner.returned
                continue
            if isinstance(stmt, ast.ClassDef):
                for item in stmt.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        _Scope(self.linter, f"{stmt.name}.{item.name}", {}, set()).run(item.body)
                continue
            if isinstance(stmt, (ast.If, ast.While)):
                self.check_calls(stmt.test)
                self.run(stmt.body)
                self.run(stmt.orelse)
                continue
            if isinstance(stmt, (ast.For, ast.AsyncFor)):
                self.check_calls(stmt.iter)
                self.bind(stmt.target, None)
                self.run(stmt.body)
                self.run(stmt.orelse)
                continue
            if isinstance(stmt, (ast.With, ast.AsyncWith)):
                for item in stmt.items:
                    self.check_calls(item.context_expr)
                self.run(stmt.body)
                continue
            if isinstance(stmt, ast.Try):
                for part in (stmt.body, *[h.body for h in stmt.handlers], stmt.orelse, stmt.finalbody):
                    self.run(part)
                continue
            self.check_calls(stmt)
            if isinstance(stmt, ast.Return) and stmt.value is not None:
                self.returned = self.origin(stmt.value) or self.returned
            if isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    self.bind(target, stmt.value)
            elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
                self.bind(stmt.target, stmt.value)
            elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
                func = stmt.value.func  # model.to(dev) / model.cuda() move a module in place
                if isinstance(func, ast.Attribute) and func.attr in MOVES and isinstance(func.value, ast.Name):
                    if self.tainted.get(func.value.id, ("",))[0] == "module":
                        self.tainted.pop(func.value.id)


class _Linter:
    def __init__(self, classes: set[str]):
        self.classes = classes
        self.findings: list[Finding] = []
        self.path, self.line0 = "", 0

    def add(self, finding: Finding) -> None:
        if finding not in self.findings:
            self.findings.append(finding)

    def lint(self, source: str, path: str, line0: int = 0) -> None:
        self.path, self.line0 = path, line0
        _Scope(self, "<cell>" if "#cell" in path else "<module>", {}, set()).run(ast.parse(source).body)


def torchrun_cells(notebook: Path) -> list[tuple[int, str]]:
    """(index among the notebook's cells, Python body) of each `%%torchrun` cell; magics become `pass`."""
    cells = json.loads(notebook.read_text())["cells"]
    out = []
    for i, cell in enumerate(cells):
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell["cell_type"] != "code" or not source.startswith("%%torchrun"):
            continue
        lines = source.splitlines()[1:]
        body = "\n".join("pass" if ln.lstrip().startswith(("%", "!")) else ln for ln in lines)
        out.append((i, body))
    return out


def lint_source(source: str, path: str = "<snippet>", classes: set[str] | None = None) -> list[Finding]:
    """Findings in one piece of Python source (not filtered by the allow-list)."""
    linter = _Linter(module_classes() if classes is None else classes)
    linter.lint(source, path)
    return linter.findings


def lint_paths(paths: list[Path], root: Path = ROOT, allow: dict[str, str] | None = None) -> list[Finding]:
    """Findings in .py files and notebooks' %%torchrun cells, minus the allow-list."""
    allow = ALLOW_LIST if allow is None else allow
    linter = _Linter(module_classes(root))
    for path in paths:
        rel = str(path.resolve().relative_to(root)) if path.resolve().is_relative_to(root) else str(path)
        if path.suffix == ".ipynb":
            for index, body in torchrun_cells(path):
                linter.lint(body, f"{rel}#cell{index}", line0=1)  # +1: the %%torchrun line
        else:
            linter.lint(path.read_text(), rel)
    return [f for f in linter.findings if f.key not in allow and f.key.rsplit("::", 1)[0] + "::*" not in allow]


def default_paths(root: Path = ROOT) -> list[Path]:
    return sorted((root / "megalab").rglob("*.py")) + sorted((root / "course").rglob("*.ipynb"))


def main(argv: list[str] | None = None) -> int:
    args = [Path(p) for p in (argv if argv is not None else sys.argv[1:])]
    paths = [f for p in args for f in ((sorted(p.rglob("*.py")) + sorted(p.rglob("*.ipynb"))) if p.is_dir() else [p])]
    paths = paths or default_paths()
    findings = lint_paths(paths)
    for f in findings:
        print(f)
    print(f"{len(findings)} finding(s)")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
