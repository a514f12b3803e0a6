#!/usr/bin/env python3
"""Warp-stall samples per SASS instruction from Nsight Compute's source page.

Reads the CSV that `ncu -i REPORT --page source --print-source sass --csv`
prints (each profiled launch's table, printed twice), sums each SASS line's samples over
the launches and prints the instructions that hold the most, with their
share of the kernel's samples and their largest stall reasons: where a
kernel's cycles go, instruction by instruction (scripts/gpu-check.sh's
`ncusrc` step).

Usage: ncu_source_stalls.py SOURCE.csv [--top 30]
"""

import argparse
import collections
import csv
import sys


def tables(path):
    """Yields (header, rows) for each table in the file, a table the same as
    the one before it skipped (ncu's CSV prints each launch's table twice)."""
    header, rows, last = None, None, None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if any(c.strip() == "Source" for c in row) and any("Address" in c for c in row):
                if rows is not None and (header, rows) != last:
                    last = (header, rows)
                    yield last
                header, rows = [c.strip() for c in row], []
            elif header is not None and len(row) == len(header):
                rows.append(row)
    if rows is not None and (header, rows) != last:
        yield header, rows


def number(s):
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    total = collections.Counter()    # samples per (address, source)
    reasons = collections.defaultdict(collections.Counter)
    launches = 0
    for header, rows in tables(args.csv):
        launches += 1
        all_col = next((i for i, c in enumerate(header)
                        if c.startswith("Warp Stall Sampling (All")), None)
        if all_col is None:
            print("no 'Warp Stall Sampling (All ...)' column; columns:", header)
            return 1
        addr_col = next(i for i, c in enumerate(header) if "Address" in c)
        src_col = header.index("Source")
        stall_cols = [(i, c) for i, c in enumerate(header)
                      if c.startswith("stall_") and "(Not Issued)" not in c]
        for row in rows:
            key = (row[addr_col].strip(), row[src_col].strip())
            total[key] += number(row[all_col])
            for i, c in stall_cols:
                v = number(row[i])
                if v:
                    reasons[key][c] += v
    if not total:
        print("no rows read from", args.csv)
        return 1
    s = sum(total.values())
    print(f"{launches} launch(es), {s:.0f} samples; the {args.top} lines with the most:")
    print(f"{'address':>8} {'share':>6}  {'instruction':<48} largest stall reasons")
    for key, v in total.most_common(args.top):
        top = ", ".join(f"{c} {n:.0f}" for c, n in reasons[key].most_common(3))
        print(f"{key[0]:>8} {100 * v / s:5.1f}%  {key[1][:48]:<48} {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
