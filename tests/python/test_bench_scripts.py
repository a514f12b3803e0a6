"""The CPU benchmark scripts that docs/performance.md cites still run against
the current binding (a smoke test with tiny settings: no timing is checked)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_cpu_peers_runs():
    pytest.importorskip("torch")
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "cpu_peers.py"), "--models", "Llama-3.1-8B",
         "--dtypes", "bf16", "f32", "--tokens", "1", "--threads", "1", "--impls", "ropekv",
         "torch", "memcpy", "--min-time", "0.01"],
        capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("Llama-3.1-8B")]
    assert len(rows) == 2 and all("-" not in row.split("|")[-1] for row in rows), out.stdout
    assert "the drop-in call with numpy arrays" in out.stdout
