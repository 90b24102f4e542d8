"""Edits take effect at once (megalab/lab/reload.py): a saved module is reloaded before the next cell, the
objects the notebook holds run the new code, a file that does not load is named with its line and the old
version stays, and an object built by a changed __init__ is named."""

import io
import sys
import textwrap

import pytest
from IPython.core.interactiveshell import InteractiveShell

from megalab.lab.reload import Reloader, install

PKG = "reload_probe_pkg"


@pytest.fixture
def tree(tmp_path, monkeypatch):
    pkg = tmp_path / PKG
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [n for n in sys.modules if n == PKG or n.startswith(PKG + ".")]:
        del sys.modules[name]


def _write(tree, body):
    path = tree / PKG / "mod.py"
    old = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(textwrap.dedent(body))
    import os
    os.utime(path, ns=(old + 10**9, old + 10**9))  # a save one second later, whatever the clock's resolution


class Shell:
    def __init__(self):
        self.user_ns = {}


def test_a_saved_edit_reaches_the_functions_and_objects_the_notebook_holds(tree):
    _write(tree, """
        def shard_bounds(n):
            raise NotImplementedError("exercise dist.shard_bounds")

        class Norm:
            def __init__(self):
                self.eps = 1.0
            def __call__(self, x):
                return x
    """)
    import importlib
    mod = importlib.import_module(f"{PKG}.mod")
    shell, out = Shell(), io.StringIO()
    reloader = Reloader(tree, shell, out=out, package=PKG)
    shard_bounds = mod.shard_bounds  # `from megalab.lab.dist import shard_bounds`, held by the notebook
    shell.user_ns["norm"] = norm = mod.Norm()
    assert reloader.reload_changed() == []  # nothing saved yet: nothing reloaded

    _write(tree, """
        def shard_bounds(n):
            return (0, n)

        class Norm:
            def __init__(self):
                self.eps = 1.0
            def __call__(self, x):
                return 2 * x
    """)
    assert reloader.reload_changed() == [f"{PKG}.mod"]
    assert shard_bounds(4) == (0, 4)  # the old function object runs the new code
    assert norm(3) == 6  # and so does an object built before the edit
    assert "reloaded reload_probe_pkg/mod.py" in out.getvalue()
    assert "built before" not in out.getvalue()  # __init__ unchanged: nothing is stale

    _write(tree, """
        def shard_bounds(n):
            return (0, n
    """)
    assert reloader.reload_changed() == []
    said = out.getvalue()
    assert "does not load: SyntaxError" in said and "line 3" in said and "stays in use" in said, said
    assert shard_bounds(4) == (0, 4)  # the last version that loaded
    assert reloader.reload_changed() == []  # said once per save, not before every cell

    _write(tree, """
        def shard_bounds(n):
            return (1, n)

        class Norm:
            def __init__(self):
                self.eps = 1e-6
            def __call__(self, x):
                return 2 * x
    """)
    assert reloader.reload_changed() == [f"{PKG}.mod"]
    assert shard_bounds(4) == (1, 4)
    assert "`norm` was built before you changed Norm.__init__" in out.getvalue()


def test_the_extension_installs_one_hook_per_kernel_that_runs_before_each_cell(tree):
    shell = InteractiveShell.instance()
    try:
        install(shell, tree)
        install(shell, tree)  # %reload_ext megalab: still one hook
        hooks = [h for h in shell.events.callbacks["pre_run_cell"] if isinstance(getattr(h, "__self__", None), Reloader)]
        assert len(hooks) == 1
    finally:
        for event in ("pre_run_cell", "post_run_cell"):
            for h in list(shell.events.callbacks[event]):
                if isinstance(getattr(h, "__self__", None), Reloader):
                    shell.events.unregister(event, h)
        InteractiveShell.clear_instance()
