"""CI smoke for benchmarks/: each one runs with --quick, prints its table and writes its JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_benchmark_quick_smoke(script, tmp_path):
    env = {**os.environ, "MEGALAB_BENCH_RESULTS": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(script), "--quick"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    written = list(tmp_path.glob("*.json"))
    assert written, f"{script.name} wrote no JSON"
    payload = json.loads(written[0].read_text())
    assert payload["rows"], f"{script.name} reported no rows"
    assert "----" in proc.stdout  # the printed table
