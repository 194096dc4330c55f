"""Tail-only zeroing: moeext.zero_tail_ against the full fill_(0) it replaces.

A 64 MiB int32 buffer; zero_tail_ clears tails of 0%, 1%, 10% and 100% of it. The full fill
is measured in the same run; the 0% row is the pure call overhead of a no-op.

    python benchmarks/python/bench_zero_tail.py [--quick]
"""

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import moeext  # noqa: E402
from bench_grouped_topk import machine_line, median_seconds  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 MiB buffer (CI smoke)")
    args = parser.parse_args(argv)
    mib = 4 if args.quick else 64
    rows = mib * (1 << 20) // 4
    buf = torch.zeros(rows, dtype=torch.int32)
    op = torch.ops.moeext.zero_tail_
    print(f"# zero_tail_, {mib} MiB int32 buffer — {machine_line()}")
    t_fill = median_seconds(lambda: buf.fill_(0))
    print(f"{'full fill_(0)':24s} {t_fill * 1e6:10.1f} us   {mib / 1024 / t_fill:6.1f} GiB/s")
    for tail in (0.0, 0.01, 0.10, 1.0):
        new_extent = rows - int(rows * tail)
        t = median_seconds(lambda: op(buf, new_extent, rows))
        print(f"zero_tail_ {tail:6.0%} tail     {t * 1e6:10.1f} us   "
              f"{t / t_fill:7.2%} of the full fill")
    state = torch.zeros(1, dtype=torch.int64)
    t = median_seconds(lambda: torch.ops.moeext.zero_tail_tracked_(buf, state, 0))
    print(f"{'zero_tail_tracked_ no-op':24s} {t * 1e6:10.1f} us   (state already 0)")


if __name__ == "__main__":
    main()
