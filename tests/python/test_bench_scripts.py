"""The CPU benchmark scripts that docs/performance.md cites still run against
the current binding (a smoke test with tiny settings: no timing is checked),
and the GPU step's Nsight Compute reader sums what it reads."""

from __future__ import annotations

import pathlib
import random
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


def test_ncu_source_stalls_sums_launches(tmp_path):
    # Two launches' source tables (ncu --page source --csv): samples are
    # summed per SASS line over both, shares are of the total.
    rng = random.Random()
    a, b, c = (rng.randint(1, 500) for _ in range(3))
    head = '"# Address","Source","Warp Stall Sampling (All Samples)","stall_wait","stall_long_sb"\n'
    text = ('"Kernel Name","rope_pool_small_kernel"\n' + head +
            f'"0x10","HADD2.F32 R1, -RZ, R2.H0_H0","{a}","{a}","0"\n'
            f'"0x20","STG.E.128 desc[UR4][R2.64], R4","{b}","0","{b}"\n\n' + head +
            f'"0x10","HADD2.F32 R1, -RZ, R2.H0_H0","{c}","0","{c}"\n')
    path = tmp_path / "src.csv"
    path.write_text(text)
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "ncu_source_stalls.py"), str(path)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    total = a + b + c
    assert f"2 table(s), {total} samples" in out, out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip().startswith("0x")}
    assert f"{100 * (a + c) / total:5.1f}%" in lines["0x10"], out
    assert f"{100 * b / total:5.1f}%" in lines["0x20"], out
    assert f"stall_long_sb {b}" in lines["0x20"], out
