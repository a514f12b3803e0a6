"""The CPU benchmark scripts that docs/performance.md cites still run against
the current binding (a smoke test with tiny settings: no timing is checked),
the GPU step's Nsight Compute reader sums what it reads, the SASS
load-order check finds data loads issued behind an index's widening, the
A/B step's summary takes each variant's least time, and bench/ab_settings.sh
times one driver under each setting it is given."""

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
    # summed per SASS line over the launches, shares are of the total.
    rng = random.Random()
    a, b, c = (rng.randint(1, 500) for _ in range(3))
    head = '"# Address","Source","Warp Stall Sampling (All Samples)","stall_wait","stall_long_sb"\n'
    first = (head + f'"0x10","HADD2.F32 R1, -RZ, R2.H0_H0","{a}","{a}","0"\n'
             f'"0x20","STG.E.128 desc[UR4][R2.64], R4","{b}","0","{b}"\n\n')
    second = head + f'"0x10","HADD2.F32 R1, -RZ, R2.H0_H0","{c}","0","{c}"\n\n'
    # (ncu prints each launch's table twice, one after the other.)
    text = '"Kernel Name","rope_pool_small_kernel"\n' + first + first + second + second
    path = tmp_path / "src.csv"
    path.write_text(text)
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "ncu_source_stalls.py"), str(path)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    total = a + b + c
    assert f"2 launch(es), {total} samples" in out, out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip().startswith("0x")}
    assert f"{100 * (a + c) / total:5.1f}%" in lines["0x10"], out
    assert f"{100 * b / total:5.1f}%" in lines["0x20"], out
    assert f"stall_long_sb {b}" in lines["0x20"], out


def _sass(order):
    # A listing in nvdisasm -c's form of one build, its body in `order`.
    head = [".text._ZN6ropekv4cuda6detail22rope_pool_small_kernelI13__nv_bfloat16Lb0ELb0ELb0ELi4ELi4ENS1_9OptParamsEEEvT5_:"]
    body = {
        # A load before the index loads whose address register a data load
        # reuses later: not an index load.
        "early": ["@!P0 LDG.E.CONSTANT R3, desc[UR10][R6.64]",
                  "IADD3 R9, R3, 0x1, RZ", "IMAD.MOV.U32 R6, RZ, RZ, R30",
                  "IMAD.MOV.U32 R7, RZ, RZ, R31"],
        "idx": ["@!P4 LDG.E.CONSTANT R19, desc[UR10][R8.64]",
                "@P4 LDG.E.64.CONSTANT R16, desc[UR10][R8.64]"],
        "data": ["@P0 LDG.E.64.CONSTANT R20, desc[UR10][R6.64]",
                 "LDG.E.64.CONSTANT R14, desc[UR10][R14.64]"],
        # The other form: the low word always, an int64's high word beside it.
        "idx_lohi": ["LDG.E.CONSTANT R19, desc[UR10][R8.64]",
                     "@P4 LDG.E.CONSTANT R17, desc[UR10][R8.64+0x4]"],
        "widen": ["@!P4 SHF.R.S32.HI R17, RZ, 0x1f, R19"],
    }
    lines = [t for part in order for t in body[part]] + ["BAR.SYNC.DEFER_BLOCKING 0x0"]
    return "\n".join(head + [f"        /*{16 * i:04x}*/                   {t} ;"
                             for i, t in enumerate(lines)]) + "\n"


@pytest.mark.parametrize("order,late", [(("idx", "data", "widen"), 0),
                                        (("idx", "widen", "data"), 2),
                                        (("data", "idx", "widen"), 0),
                                        (("early", "idx", "data", "widen"), 0),
                                        (("early", "idx", "widen", "data"), 2),
                                        (("idx_lohi", "data", "widen"), 0),
                                        (("idx_lohi", "widen", "data"), 2)])
def test_sass_load_order_finds_late_data_loads(tmp_path, order, late):
    path = tmp_path / "k.sass"
    path.write_text(_sass(order))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "sass_load_order.py"), str(path)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == (1 if late else 0), out.stdout + out.stderr
    assert out.stdout.split()[:2] == ["LATE" if late else "ok", f"{late}/2"], out.stdout


@pytest.mark.parametrize("drivers", [1, 2])
def test_ab_summary_takes_each_variants_least_time(tmp_path, drivers):
    # The ab step's log: two runs of two variants (a library variable with one
    # driver, or two drivers), each timing two cells; a cell's row has each
    # variant's least time over the runs and the ratio to the first variant.
    rng = random.Random()
    us = {(v, r, t): round(rng.uniform(1.0, 20.0), 2) for v in (0, 1) for r in (1, 2)
          for t in (448, 496)}
    cell = ("ROPEKV_DRIVER_SHAPES=Gemma-4-full+ROPEKV_DRIVER_OPTIONS=norm"
            "+ROPEKV_DRIVER_TOKENS=448,496")
    lines = []
    for r in (1, 2):
        for v in (0, 1):
            driver, envs = (f"build/ab/v{v}/driver", cell) if drivers == 2 else \
                ("build/ab/ow/driver", ("ROPEKV_CUDA_ONE_WAVE=0+" if v else "") + cell)
            lines.append(f"== {driver} run {r} {envs} --cold-options")
            lines.append("U=auto S=auto/auto small=auto/auto cold Gemma-4-full QK-norm" +
                         "".join(f" | T={t} {us[(v, r, t)]:.2f} us 1000 GB/s" for t in (448, 496)))
    path = tmp_path / "ab_runs.txt"
    path.write_text("\n".join(lines) + "\n")
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "ab_summary.py"), str(path)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    head = out.splitlines()[1].split(" | ")
    want = ["build/ab/v0/driver", "build/ab/v1/driver"] if drivers == 2 else \
        ["(none)", "ROPEKV_CUDA_ONE_WAVE=0"]
    assert head[2:4] == want, out
    rows = [line.split(" | ") for line in out.splitlines()[2:]]
    assert [row[:2] for row in rows] == [["cold Gemma-4-full QK-norm", "448"],
                                          ["cold Gemma-4-full QK-norm", "496"]], out
    for row, t in zip(rows, (448, 496)):
        a, b = (min(us[(v, 1, t)], us[(v, 2, t)]) for v in (0, 1))
        assert row[2:] == [f"{a:.2f}", f"{b:.2f}", f"{b / a:.3f}"], out


def test_ab_settings_times_each_setting_of_one_driver(tmp_path):
    # bench/ab_settings.sh through the GPU check's ab step, with a stand-in
    # driver that prints a cell per T whose time is drawn per setting of
    # ROPEKV_CUDA_ONE_WAVE ("-": unset): each setting's case carries the
    # cell's ROPEKV_DRIVER_* variables and the mode, alternated AB_RUNS times.
    rng = random.Random()
    us = {s: round(rng.uniform(1.0, 20.0), 2) for s in ("unset", "0", "1")}
    driver = tmp_path / "driver"
    driver.write_text(
        "#!/usr/bin/env bash\n"
        '[ "$1" = --cold-options ] || exit 3\n'
        f"case ${{ROPEKV_CUDA_ONE_WAVE:-unset}} in unset) u={us['unset']};; 0) u={us['0']};; "
        f"1) u={us['1']};; esac\n"
        'line="U=auto S=auto/auto small=auto/auto cold $ROPEKV_DRIVER_SHAPES QK-norm"\n'
        'for t in ${ROPEKV_DRIVER_TOKENS//,/ }; do line="$line | T=$t $u us 1000 GB/s"; done\n'
        'echo "$line"\n')
    driver.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "AB_DRIVER": str(driver),
           "AB_RUNS": "2", "PYTHON": sys.executable}
    out = subprocess.run(
        ["bash", str(ROOT / "bench" / "ab_settings.sh"), "onewave", "--cold-options",
         "ROPEKV_DRIVER_SHAPES=Llama-3.1-8B+ROPEKV_DRIVER_TOKENS=562,594", "-",
         "ROPEKV_CUDA_ONE_WAVE=0", "ROPEKV_CUDA_ONE_WAVE=1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.splitlines()[0] == "onewave rc=0", out
    runs = (tmp_path / "out" / "onewave" / "ab_runs.txt").read_text()
    assert runs.count("== ") == 6 and runs.count(" run 2 ROPEKV_CUDA_ONE_WAVE=1+") == 1, runs
    rows = [line.split(" | ") for line in out.splitlines()[3:]]
    assert [row[:2] for row in rows] == [["cold Llama-3.1-8B QK-norm", "562"],
                                          ["cold Llama-3.1-8B QK-norm", "594"]], out
    for row in rows:
        assert row[2:5] == [f"{us[s]:.2f}" for s in ("unset", "0", "1")], out
