"""The cold-call cells of a `scripts/gpu-check.sh ab` log side by side.

Reads the log of the ab step (its "== DRIVER run I ENVS MODE" headers and the
driver's "... cold SHAPE OPTIONS | T=... US us ... GB/s | ..." lines, from
tests/gpu/sanitize_driver.cu --cold*) and prints one row per cell (the
driver's label and T) with the least time over the runs of each variant, and
each variant's ratio to the first. A variant is the driver and the case's
variables other than ROPEKV_DRIVER_* (those pick the cell, e.g.
ROPEKV_CUDA_ONE_WAVE=0 is a variant of the library).

    python3 bench/ab_summary.py LOG
"""

import collections
import re
import sys

HEADER = re.compile(r"^== (\S+) run \d+ (.*)$")
CELL = re.compile(r"T=(\d+) ([0-9.]+) us")
TUNING = re.compile(r"^U=\S+ S=\S+ small=\S+ ")


def read(path):
    """{(label, T): {variant: [us, ...]}} and the variants in order of first sight."""
    cells = collections.defaultdict(lambda: collections.defaultdict(list))
    variants, drivers, rows = [], set(), []
    variant = None
    with open(path, errors="replace") as f:
        for line in f:
            m = HEADER.match(line)
            if m:
                driver, rest = m.groups()
                envs = rest.split()[:-1]  # (the last word is the mode)
                knobs = [e for e in "+".join(envs).split("+")
                         if e and not e.startswith("ROPEKV_DRIVER_")]
                variant = (driver, " ".join(knobs))
                drivers.add(driver)
                if variant not in variants:
                    variants.append(variant)
                continue
            if variant is None or " cold" not in line or "|" not in line:
                continue
            head, *cols = line.rstrip("\n").split("|")
            label = TUNING.sub("", head).strip()
            for c in cols:
                mm = CELL.search(c)
                if mm:
                    key = (label, int(mm.group(1)))
                    if key not in cells:
                        rows.append(key)
                    cells[key][variant].append(float(mm.group(2)))
    names = [(d + " " + k if len(drivers) > 1 else k).strip() or "(none)" for d, k in variants]
    return rows, cells, variants, names


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    rows, cells, variants, names = read(sys.argv[1])
    if not rows:
        raise SystemExit(f"{sys.argv[1]}: no cold-call cells")
    print("least us over the runs of each variant, and the ratios")
    print(" | ".join(["cell", "T"] + names + [f"{n} / {names[0]}" for n in names[1:]]))
    for label, t in rows:
        got = cells[(label, t)]
        least = [min(got[v]) if got.get(v) else None for v in variants]
        out = [label, str(t)] + ["-" if x is None else f"{x:.2f}" for x in least]
        for x in least[1:]:
            out.append("-" if x is None or least[0] is None else f"{x / least[0]:.3f}")
        print(" | ".join(out))


if __name__ == "__main__":
    main()
