"""megalab: learn how Megatron-LM trains and serves large language models by building it.

`%load_ext megalab` in a notebook registers the `%%torchrun` cell magic, `%grade`, `%hint` and `%progress`
(megalab/lab/magic.py, megalab/lab/progress.py)
and makes every saved edit to megalab take effect at the next cell (megalab/lab/reload.py). It
says which `megalab` the kernel runs: the one of the workspace the notebook lives in. If the
kernel imported another (the reference's, from its editable install), it switches to the notebook's
before anything else is imported, so the kernel and every rank run your code, never the solutions.
Importing the package is cheap: torch is imported only by the modules that need it.
"""

__version__ = "0.1.0"

MIN_PYTHON = (3, 12)


def unsupported(platform=None, version=None):
    """Why megalab cannot run here (None when it can): native Windows (no fork, no POSIX signals: use WSL2) or a
    Python older than MIN_PYTHON. Plain syntax, so that an old Python gets this message, not a SyntaxError."""
    import sys

    platform = sys.platform if platform is None else platform
    version = tuple(sys.version_info[:2]) if version is None else tuple(version[:2])
    if platform in ("win32", "cygwin", "msys"):
        return ("megalab does not run on Windows itself (its launcher needs POSIX processes and signals); it runs "
                "in WSL2, the Linux inside Windows: in PowerShell run `wsl --install`, restart, open Ubuntu and "
                "follow README's Windows (WSL2) steps there")
    if version < MIN_PYTHON:
        need = "{}.{}".format(*MIN_PYTHON)
        return (f"megalab needs Python >= {need}, and this is Python {version[0]}.{version[1]} ({sys.executable}): "
                f"run `make setup`, which finds or names a Python {need} (tools/find_python.sh), then use .venv/bin/python")
    return None


if unsupported() is not None:
    raise ImportError(unsupported())


def load_ipython_extension(ipython):
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent.parent
    root = _tree_of(Path.cwd())
    if root is not None and root != here:
        loaded = sorted(name for name in sys.modules if name.startswith("megalab."))
        if loaded:
            raise ImportError(f"this kernel already imported megalab from {here} ({', '.join(loaded[:3])}), but the "
                              f"notebook lives in {root}: restart the kernel (Kernel > Restart) and run this cell first")
        _switch_to(root)
        return sys.modules["megalab"].load_ipython_extension(ipython)

    from megalab.lab.dist import scratch_root
    from megalab.lab.magic import TorchrunMagics
    from megalab.lab.reload import install

    ipython.register_magics(TorchrunMagics)
    ipython.register_magic_function(grade_magic, "line", "grade")
    ipython.register_magic_function(hint_magic, "line", "hint")
    ipython.register_magic_function(progress_magic, "line", "progress")
    scratch_root()  # this kernel's own temp folder, which its %%torchrun ranks inherit
    install(ipython, here)  # saved edits to megalab take effect at the next cell, no restart
    ipython.set_custom_exc((NotImplementedError,), _show_needs)  # a blank exercise: which one, and where it is taught
    print(banner(here))


def _show_needs(shell, etype, value, tb, tb_offset=None):
    """A blank exercise's NotImplementedError: its line and which exercise to implement, where -- not the frames
    that reached it (a cell of one notebook can reach another chapter's blank region). Any other: the traceback."""
    from megalab.lab.exercises import needs_first

    needs = needs_first(f"NotImplementedError: {value}")
    if needs:
        shell._showtraceback(etype, value, [f"{etype.__name__}: {value}", needs])  # the cell's error output
    else:
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
    return None


def grade_magic(line: str) -> None:
    """`%grade ID`: grade one exercise of this notebook's workspace, in isolation (`megalab grade ID`)."""
    import subprocess
    import sys

    args = line.split()
    if not args:
        print("usage: %grade EXERCISE_ID (e.g. %grade dist.shard_bounds), or %grade CHAPTER (e.g. %grade 01); "
              "`megalab exercises` lists the ids")
        return
    proc = subprocess.run([sys.executable, "-m", "megalab.lab.cli", "grade", *args], capture_output=True, text=True)
    print(proc.stdout, end="")
    if proc.stderr:
        print(proc.stderr, end="", file=sys.stderr)


def hint_magic(line: str) -> None:
    """`%hint ID [LEVEL]`: the next hint for an exercise (the idea, then the approach), or hint LEVEL."""
    from megalab.lab.progress import HintError, format_hint, hint

    args = line.split()
    if not args or len(args) > 2 or (len(args) == 2 and not args[1].isdigit()):
        print("usage: %hint EXERCISE_ID [LEVEL] (e.g. %hint dist.shard_bounds, or %hint dist.shard_bounds 2)")
        return
    from megalab.lab.i18n import lang_of

    try:
        root = _course_root()
        level, levels, text = hint(root, args[0], int(args[1]) if len(args) == 2 else None)
    except (HintError, ValueError) as exc:
        print(f"%hint: {exc}")
        return
    print(format_hint(args[0], level, levels, text, lang_of(root)))


def progress_magic(line: str) -> None:
    """`%progress [CHAPTER]`: exercises done per chapter, hints used and last attempts, with a chart."""
    from megalab.lab.progress import show

    try:
        show(line.strip() or None, _course_root())
    except ValueError as exc:  # a damaged tree: say so, never stop a "Run All"
        print(f"%progress: {exc}")


def _course_root():
    """The tree of the notebook's folder (a workspace or the reference), else the one this megalab comes from
    (a notebook copied outside any tree)."""
    from pathlib import Path

    return _tree_of(Path.cwd()) or Path(__file__).resolve().parent.parent


def _tree_of(folder):
    """The nearest folder at or above `folder` that holds a megalab package (a workspace or the reference)."""
    for candidate in (folder, *folder.parents):
        if (candidate / "megalab" / "__init__.py").is_file():
            return candidate.resolve()
    return None


def _switch_to(root) -> None:
    """Import megalab from `root` from now on, here and in every process started from here."""
    import os
    import sys

    sys.path.insert(0, str(root))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    del sys.modules["megalab"]
    import megalab  # noqa: F401  (now the workspace's)


def banner(root) -> str:
    """`megalab 0.1.0 · <which tree> · <progress>`: the line `%load_ext megalab` prints."""
    from pathlib import Path

    from megalab.lab.workspace import open_workspace, progress

    done, total = progress(root)
    if open_workspace(root) is None and done == total:
        return f"megalab {__version__} · the reference implementation · every exercise solved"
    where = str(root).replace(str(Path.home()), "~", 1) if str(root).startswith(str(Path.home())) else str(root)
    ws = open_workspace(root)
    if ws is not None and ws.config.get("lang") == "zh":
        return (f"megalab {__version__} · 你的工作区 {where}/megalab · 已实现 {done} / {total} 个练习 · "
                "%grade ID 检查一个练习，%hint ID 给出提示，%progress 查看进度")
    return (f"megalab {__version__} · your workspace {where}/megalab · {done} of {total} exercises implemented · "
            "%grade ID checks one, %hint ID helps, %progress shows where you are")
