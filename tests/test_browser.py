"""The course in a real browser: JupyterLab from this repository, headless Chromium driven by
Playwright, every cell of real notebooks run through JupyterLab's own "Run All Cells".

Checks what nbval cannot: that `%%torchrun` output, a matplotlib figure and an ipywidgets widget
render in JupyterLab, that a cell meant to raise (tag `raises-exception`) shows its rank's
error without stopping the notebook, and that a Chinese workspace's notebook shows its text in real
glyphs (a machine without a CJK font draws every character as the same empty box: `.ci/run` installs one). Needs Debian's `chromium` and the `playwright` package
(`.ci/run` installs both); skipped without them unless MEGALAB_REQUIRE_BROWSER=1, as in CI.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import nbformat
import pytest

from megalab.lab.launch import free_port

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NOTEBOOKS = ["01_foundations/01_setup_and_torchrun.ipynb", "02_core_architecture/02_parallel_state.ipynb"]
RUN_TIMEOUT = int(os.environ.get("MEGALAB_BROWSER_TIMEOUT", 300))  # seconds for one notebook's cells (01/01 takes ~45 s on 2 idle cores: 20 s is a deadlock demo)
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install -e '.[dev]')"
    if CHROMIUM is None:
        return "chromium is not installed (Debian: apt-get install chromium)"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.browser]


def _need_browser() -> None:
    missing = _missing()
    if missing:
        if os.environ.get("MEGALAB_REQUIRE_BROWSER") == "1":
            pytest.fail(f"browser test required but {missing}")
        pytest.skip(missing)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab serving a copy of the notebooks (so nothing in the repository changes): (url, token)."""
    _need_browser()
    root = tmp_path_factory.mktemp("lab")
    for name in NOTEBOOKS:  # copies without outputs, so every prompt starts empty ("[ ]:")
        nb = nbformat.read(REPO / "course" / name, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, root / name)
    jupyter_path = _kernelspec(root)
    port, token = free_port(), "megalab-browser-test"
    command = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
               f"--ServerApp.root_dir={root}", f"--IdentityProvider.token={token}", "--ServerApp.open_browser=False"]
    if os.geteuid() == 0:
        command.append("--allow-root")
    settings = _lab_settings(root)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "JUPYTER_PATH": str(jupyter_path), "JUPYTERLAB_SETTINGS_DIR": str(settings),
           "JUPYTERLAB_WORKSPACES_DIR": str(root / "lab-workspaces")}
    url = f"http://127.0.0.1:{port}"
    with _serving(command, root, env, url, token):
        yield url, token, root


def _lab_settings(root: Path) -> Path:
    """JupyterLab settings for tests: render every cell (JupyterLab 4 only renders those near the
    viewport by default) and ask for no news."""
    settings = root / "lab-settings"
    for plugin, values in {"notebook-extension/tracker": {"windowingMode": "none"},
                           "apputils-extension/notification": {"fetchNews": "false"}}.items():
        path = settings / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    return settings


def _kernelspec(root: Path) -> Path:
    """A "python3" kernel that is this interpreter (not one a user-level kernelspec points elsewhere)."""
    spec = root / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3", "language": "python"}))
    return root / "jupyter"


@contextmanager
def _serving(command: list[str], cwd: Path, env: dict, url: str, token: str):
    """Run a JupyterLab server until the block ends (server, kernels and their ranks stopped after)."""
    log_path = Path(env["JUPYTER_PATH"]).parent / "jupyterlab.log"  # beside the test's kernelspec
    log = open(log_path, "w")
    server = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2) as reply:
                    json.load(reply)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("JupyterLab did not start:\n" + log_path.read_text()[-3000:]) from None
                time.sleep(0.5)
        yield
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server, its kernels and their torchrun ranks
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


def _run_all(page, url: str, token: str, name: str, shots: Path):
    """Open `name`, wait for its kernel, Run All Cells from the Run menu, wait until no cell is queued."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.goto(f"{url}/lab/tree/{name}?token={token}")
    page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
    try:  # JupyterLab may ask which kernel to start: take the notebook's own ("Python 3")
        page.locator(".jp-Dialog .jp-mod-accept").click(timeout=10_000)
    except PlaywrightTimeout:
        pass
    panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")  # the notebook just opened
    panel.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for(timeout=60_000)
    page.get_by_text("Python 3 | Idle").wait_for(timeout=60_000)
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    shot = shots / (Path(name).stem + ".png")
    try:
        page.wait_for_function(  # every code cell executed: a numbered prompt, none empty or queued ("[*]")
            """() => {
                const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
                const prompts = [...panel.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')].map(p => p.textContent);
                return prompts.length > 0 && prompts.every(t => /\\[\\d+\\]/.test(t));
            }""",
            timeout=RUN_TIMEOUT * 1000,
        )
    finally:
        page.screenshot(path=str(shot), full_page=True)
        prompts = panel.locator(".jp-CodeCell .jp-InputArea-prompt").all_inner_texts()
        print(f"{name}: prompts {prompts}; screenshot {shot}")
    return panel


def _outputs(panel) -> str:
    return "\n".join(panel.locator(".jp-OutputArea-output").all_inner_texts())


def test_notebooks_run_in_jupyterlab_in_chromium(lab):
    from playwright.sync_api import sync_playwright

    url, token, root = lab
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            panel = _run_all(page, url, token, NOTEBOOKS[0], root)
            text = _outputs(panel)
            # %%torchrun output, grouped by rank
            assert "[rank 0] RANK=0 LOCAL_RANK=0 WORLD_SIZE=4" in text
            assert "[rank 3] RANK=3 LOCAL_RANK=3 WORLD_SIZE=4" in text
            # the deliberate crash shows the failing rank's error, and Run All went on past it
            assert "RankFailedError" in text or "rank 2 failed" in text
            assert "every rank got the right sum: True" in text
            # matplotlib figures render as images
            assert panel.locator(".jp-RenderedImage img").count() >= 2
            assert not any(e in text for e in ("ModuleNotFoundError", "ImportError", "NameError", "LaunchError"))

            panel = _run_all(page, url, token, NOTEBOOKS[1], root)
            # the ipywidgets explorer renders live sliders and a dropdown, and draws its figure
            panel.locator(".widget-slider").first.wait_for(timeout=30_000)
            assert panel.locator(".widget-slider").count() >= 5  # tp, pp, cp, dp, ep
            assert panel.locator(".widget-dropdown").count() >= 1
            assert panel.locator(".jupyter-widgets .jp-RenderedImage img, .widget-output img").count() >= 1
            assert panel.locator(".jp-RenderedImage img").count() >= 2
        finally:
            browser.close()


# Draws each distinct CJK character of an element's text in the element's own font on a canvas: with a font
# that has them, every character is a different shape; without one, every one is the same missing-glyph box.
GLYPHS = """(el) => {
    const chars = [...new Set([...el.innerText].filter(ch => /[\u4e00-\u9fff]/.test(ch)))].slice(0, 12);
    const canvas = document.createElement('canvas');
    canvas.width = canvas.height = 48;
    const g = canvas.getContext('2d', {willReadFrequently: true});
    g.font = `32px ${getComputedStyle(el).fontFamily}`;
    g.textBaseline = 'top';
    const shape = ch => { g.clearRect(0, 0, 48, 48); g.fillText(ch, 4, 4);
                          return g.getImageData(0, 0, 48, 48).data.join(','); };
    return {chars: chars.join(''), shapes: new Set(chars.map(shape)).size, font: g.font};
}"""


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_make_lab_in_a_workspace_opens_it_on_the_first_notebook(tmp_path, lang):
    """A learner's `make workspace` then `make lab`: JupyterLab at the workspace root (course/ and megalab/
    both in the file browser), on the first notebook, with a kernel that imports the workspace's megalab.
    In Chinese (`make workspace LANG=zh`): the notebook's text is Chinese and renders in real glyphs."""
    from playwright.sync_api import sync_playwright

    from megalab.lab.exercises import load
    from megalab.lab.workspace import FIRST_NOTEBOOK, create

    _need_browser()
    ws = create(REPO, tmp_path / "megalab-workspace", lang=None if lang == "en" else lang).dest
    port, token = free_port(), "megalab-browser-test"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MAKEFLAGS", "MAKELEVEL")}
    env.update(JUPYTER_TOKEN=token, BROWSER="true", JUPYTER_PATH=str(_kernelspec(tmp_path)),
               JUPYTERLAB_SETTINGS_DIR=str(_lab_settings(tmp_path)),  # and the layout JupyterLab saves: not the
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "lab-workspaces"))  # user's, nor another run's
    url = f"http://127.0.0.1:{port}"
    with _serving(["make", "lab", f"PORT={port}"], ws, env, url, token), sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{url}/?token={token}")  # the address `make lab` opens the browser on
            page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell").first.wait_for(timeout=60_000)
            assert "/lab/tree/" + FIRST_NOTEBOOK in page.url
            assert page.locator(".lm-TabBar-tab.jp-mod-current", has_text=Path(FIRST_NOTEBOOK).name).count() >= 1
            if lang == "zh":
                heading = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-RenderedMarkdown").first
                heading.wait_for(timeout=30_000)
                for _ in range(60):  # the cell is attached before JupyterLab has rendered its text: wait for the text
                    glyphs = heading.evaluate(GLYPHS)
                    if len(glyphs["chars"]) >= 8:
                        break
                    page.wait_for_timeout(500)
                assert len(glyphs["chars"]) >= 8, f"the first notebook's text is not Chinese: {heading.inner_text()!r}"
                assert glyphs["shapes"] == len(glyphs["chars"]), (
                    f"{glyphs['chars']} drawn as {glyphs['shapes']} distinct shape(s) in {glyphs['font']}: no CJK "
                    "font (Debian: apt-get install fonts-wqy-microhei)")
            page.locator(".jp-BreadCrumbs-home").first.click()  # the file browser at the server's root
            listing = page.locator(".jp-DirListing-itemText")
            listing.filter(has_text="megalab").first.wait_for(timeout=30_000)
            names = set(listing.all_inner_texts())
            assert {"course", "megalab"} <= names, names
            try:  # JupyterLab may ask which kernel to start
                page.locator(".jp-Dialog .jp-mod-accept").click(timeout=10_000)
            except Exception:  # noqa: BLE001 - no dialog
                pass
            page.get_by_text("Python 3 | Idle").wait_for(timeout=60_000)
            first_code = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell").first
            first_code.locator(".jp-InputArea-editor").click()
            page.keyboard.press("Shift+Enter")
            banner = first_code.locator(".jp-OutputArea-output", has_text="/megalab · ")
            banner.first.wait_for(timeout=60_000)
            exercises = len(load(REPO).exercises)
            expected = {"en": f"your workspace {ws}/megalab · 0 of {exercises} exercises implemented",
                        "zh": f"你的工作区 {ws}/megalab · 已实现 0 / {exercises} 个练习"}[lang]
            assert expected in banner.first.inner_text()
        finally:
            page.screenshot(path=str(tmp_path / f"workspace-{lang}.png"), full_page=True)
            print(f"screenshot {tmp_path / f'workspace-{lang}.png'}")
            browser.close()
