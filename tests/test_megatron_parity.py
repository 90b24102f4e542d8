"""megalab vs Megatron-Core's own code (megatron-core, pinned in the dev extra) on the same inputs.

Every test takes the `mcore` fixture: without the pinned megatron-core it FAILS with the line that
installs it (tests/megatron_oracle.py). Megatron classes that allocate CUDA buffers in __init__ (e.g.
TopKRouter) are composed here from their own functions, in their forward's order.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.megatron_oracle import INSTALL_HINT, MEGATRON_CORE_VERSION, import_mcore, mcore  # noqa: F401


# ------------------------------------------------------------------ the oracle itself
def test_missing_or_wrong_megatron_core_fails_with_the_install_line(tmp_path):
    """A run whose megatron-core is missing (or another version) fails the parity tests, saying how to install it."""
    fake = tmp_path / "megatron" / "core"
    fake.mkdir(parents=True)
    (fake.parent / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("__version__ = '0.0.1'\n")
    test = tmp_path / "test_uses_oracle.py"
    test.write_text("from tests.megatron_oracle import mcore\n\ndef test_x(mcore):\n    pass\n")
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for label, path in (("wrong version", f"{tmp_path}{os.pathsep}{root}"), ("missing", f"{root}")):
        code = ("import sys; sys.modules['megatron'] = None\n" if label == "missing" else "") + (
            f"import pytest; sys.exit(pytest.main([{str(test)!r}, '-q', '-p', 'no:cacheprovider', '-o', 'addopts=', "
            f"'-p', 'no:nbval', '-p', 'no:xdist', '--rootdir', {str(tmp_path)!r}]))")
        code = "import sys\n" + code
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": path}, cwd=tmp_path)
        text = out.stdout + out.stderr
        assert out.returncode == 1, (label, text)  # failed, not skipped (a skip exits 0)
        assert ("1 failed" in text or "1 error" in text) and "make setup" in text and f"megatron-core=={MEGATRON_CORE_VERSION}" in text, text


def test_the_pinned_megatron_core_is_installed(mcore):
    assert mcore.__version__ == MEGATRON_CORE_VERSION
