"""Every torch and triton name megalab's code uses (torch.X.Y, dist.X, F.X, nn.X, tl.X, `from torch... import X`),
looked up in the torch and triton of the Python running this: megalab must run on the lent GPU machine's torch 2.11
as on the course's 2.13. Run it with that Python (tests/test_device_check.py does, on the rehearsal's torch 2.11):

    python tools/device_api_check.py        exit 1 and the missing names (with the files using them), else 0

megalab.lab.dist is imported first: the names it gives an older torch (alias_new_collectives) count as there.
A name only used behind a version check is listed too: read the file before changing anything.
"""

import ast
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALIASES = {"dist": "torch.distributed", "F": "torch.nn.functional", "nn": "torch.nn", "torch": "torch",
           "triton": "triton", "tl": "triton.language"}


def _dotted(node):
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        owner = _dotted(node.value)
        return owner and f"{owner}.{node.attr}"
    return None


def used_names(root: Path = ROOT) -> dict[str, set[str]]:
    """'torch.distributed.all_gather_single' -> the files that use it."""
    names: dict[str, set[str]] = {}
    for path in sorted((root / "megalab").rglob("*.py")):
        tree = ast.parse(path.read_text())
        local = dict(ALIASES)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith(("torch", "triton")):
                        local[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("torch", "triton")):
                for a in node.names:
                    names.setdefault(f"{node.module}.{a.name}", set()).add(str(path.relative_to(root)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store):
                dotted = _dotted(node)
                head = dotted.split(".")[0] if dotted else None
                if head in local and local[head].startswith(("torch", "triton")):
                    names.setdefault(local[head] + dotted[len(head):], set()).add(str(path.relative_to(root)))
    return names


def missing(names: dict[str, set[str]]) -> list[str]:
    out = []
    for name in sorted(names):
        parts = name.split(".")
        for i in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:i]))
                break
            except Exception:  # noqa: BLE001  (not a module: an attribute)
                continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                out.append(f"{name}  (used in {', '.join(sorted(names[name])[:3])})")
                break
            obj = getattr(obj, attr)
    return out


def main() -> int:
    sys.path.insert(0, str(ROOT))
    import torch
    import triton

    import megalab.lab.dist  # noqa: F401  (its aliases for an older torch)

    names = used_names()
    gone = missing(names)
    print(f"torch {torch.__version__}, triton {triton.__version__}: {len(names)} names megalab uses, "
          f"{len(gone)} missing" + "".join(f"\n  {g}" for g in gone))
    return 1 if gone else 0


if __name__ == "__main__":
    sys.exit(main())
