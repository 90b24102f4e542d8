"""Your edits take effect at once: before each notebook cell, the megalab modules you saved are reloaded.

`%load_ext megalab` registers a `Reloader` on the kernel. Before every cell it compares the files of the
megalab modules the kernel imported with what it loaded; each changed one is reloaded in place with
IPython's `superreload` (the machinery of `%autoreload`), so the functions and classes the notebook already
holds run the new code:

    megalab: reloaded megalab/lab/dist.py (saved 3 s ago)

What reloading cannot change, it says: an object built before the edit by a class whose `__init__` changed
(a model whose layers you edited keeps the parameters its old `__init__` made) is named, with what to
re-run. A file that no longer loads (a syntax error, a bad import) is named with its line, and the last
version that loaded stays in use until you fix it. `%%torchrun` ranks are fresh processes: they always
import what is on disk.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path

SKIP = {"megalab", "megalab.lab.reload"}  # the package face and this module hold the kernel's hooks


def _code_key(cls) -> str | None:
    """A fingerprint of what `cls.__init__` does (None: not defined in the class itself)."""
    init = cls.__dict__.get("__init__")
    code = getattr(init, "__code__", None)
    return None if code is None else hashlib.sha1(code.co_code + repr(code.co_consts).encode()).hexdigest()


class Reloader:
    """Reload the changed megalab modules of this kernel before each cell; say what stays old."""

    def __init__(self, root: Path, shell=None, out=None, package: str = "megalab"):
        self.root = Path(root).resolve()
        self.package = package
        self.shell = shell
        self.out = out  # a stream, or None for sys.stderr at the time of writing
        self.seen: dict[str, tuple[int, int]] = {}  # module name -> (mtime_ns, size) of the version loaded
        self.failed: dict[str, tuple[int, int]] = {}  # module -> the stamp of the file that did not load
        self.old_objects: dict = {}  # superreload's memory: every generation of a function or class gets updated
        self.note_new()

    # ------------------------------------------------------------------ which files
    def _modules(self):
        for name, module in list(sys.modules.items()):
            if name in SKIP or not (name == self.package or name.startswith(self.package + ".")):
                continue
            path = getattr(module, "__file__", None)
            if path and path.endswith(".py") and Path(path).resolve().is_relative_to(self.root):
                yield name, module, Path(path)

    @staticmethod
    def _stamp(path: Path) -> tuple[int, int] | None:
        try:
            st = path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def note_new(self) -> None:
        """Remember the files of modules imported since the last look (they were loaded as they are now)."""
        for name, _, path in self._modules():
            if name not in self.seen and (stamp := self._stamp(path)) is not None:
                self.seen[name] = stamp

    def changed(self) -> list[tuple[str, object, Path, tuple[int, int]]]:
        found = []
        for name, module, path in self._modules():
            stamp = self._stamp(path)
            if stamp is not None and name in self.seen and stamp != self.seen[name] and stamp != self.failed.get(name):
                found.append((name, module, path, stamp))
        return found

    # ------------------------------------------------------------------ the hook
    def pre_run_cell(self, *_args) -> None:
        try:
            self.reload_changed()
        except Exception:  # never stop a learner's cell because of this hook
            self._say("megalab: could not check your files for edits:\n" + traceback.format_exc(limit=2), err=True)

    def post_run_cell(self, *_args) -> None:
        self.note_new()

    def reload_changed(self) -> list[str]:
        from IPython.extensions.autoreload import superreload

        reloaded = []
        for name, module, path, stamp in self.changed():
            inits = self._inits(module)
            cached = Path(importlib.util.cache_from_source(str(path)))
            cached.unlink(missing_ok=True)  # a .pyc stamped with the same second and size would hide the edit
            try:
                superreload(module, old_objects=self.old_objects)
            except Exception as exc:
                self.failed[name] = stamp
                self._say(f"megalab: your edit to {self._rel(path)} does not load: {self._where(exc, path)}\n"
                          f"  The last version that loaded stays in use until you fix it and save.", err=True)
                continue
            self.seen[name] = stamp
            self.failed.pop(name, None)
            reloaded.append(name)
            self._say(f"megalab: reloaded {self._rel(path)}: your edit takes effect now")
            self._stale(module, inits)
        return reloaded

    # ------------------------------------------------------------------ what stays old
    @staticmethod
    def _inits(module) -> dict[type, str | None]:
        return {obj: _code_key(obj) for obj in vars(module).values()
                if isinstance(obj, type) and obj.__module__ == module.__name__}

    def _stale(self, module, before: dict[type, str | None]) -> None:
        """Name the notebook's objects built by a class whose __init__ just changed."""
        # superreload moves old instances onto the new class: compare by name
        changed = {cls.__qualname__ for cls, key in before.items() if _code_key(cls) != key}
        if not changed or self.shell is None:
            return
        for var, value in list(self.shell.user_ns.items()):
            if var.startswith("_"):
                continue
            parts = value.modules() if hasattr(value, "modules") and callable(value.modules) else [value]
            try:
                hit = next((type(p) for p in parts
                            if type(p).__module__ == module.__name__ and type(p).__qualname__ in changed), None)
            except Exception:
                continue
            if hit is not None:
                self._say(f"megalab: `{var}` was built before you changed {hit.__name__}.__init__; its methods run "
                          f"your new code, but what __init__ made is old: re-run the cell that builds `{var}`", err=True)

    # ------------------------------------------------------------------ words
    def _rel(self, path: Path) -> str:
        return os.path.relpath(path.resolve(), self.root)

    def _where(self, exc: BaseException, path: Path) -> str:
        if isinstance(exc, SyntaxError):
            return f"{type(exc).__name__}: {exc.msg} (line {exc.lineno})"
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve() == path.resolve()]
        line = f" (line {frames[-1].lineno})" if frames else ""
        return f"{type(exc).__name__}: {exc}{line}"

    def _say(self, text: str, err: bool = False) -> None:
        print(text, file=self.out or (sys.stderr if err else sys.stdout), flush=True)


def install(shell, root: Path) -> Reloader:
    """Register one Reloader on this kernel (again on %reload_ext: the old one is removed first)."""
    for event in ("pre_run_cell", "post_run_cell"):
        for hook in list(shell.events.callbacks[event]):
            if isinstance(getattr(hook, "__self__", None), Reloader):
                shell.events.unregister(event, hook)
    reloader = Reloader(root, shell)
    shell.events.register("pre_run_cell", reloader.pre_run_cell)
    shell.events.register("post_run_cell", reloader.post_run_cell)
    return reloader
