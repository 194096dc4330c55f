"""Tail-only zeroing: moeext.zero_tail_ against the full fill_(0) it replaces.

A 64 MiB int32 buffer; zero_tail_ clears tails of 0%, 1%, 10% and 100% of it, each compared
with the full fill measured in the same run. The 0% row is the call overhead of a no-op. The
op is timed through ``torch.ops``, whose argument conversion costs about 1 us more a call than
the ``moeext.zero_tail_`` wrapper's direct call.

    python benchmarks/python/bench_zero_tail.py [--quick]
"""

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from common import Row, machine_line, median_seconds  # noqa: E402


def check_zeroing(n):
    """Asserts, before anything is timed, that both ops zero exactly the tail they are given
    (the timed buffer is zero already, where a no-op would look the same)."""
    buf = torch.ones(n, dtype=torch.int32)
    torch.ops.moeext.zero_tail_(buf, n // 2, n - 1)
    assert buf[:n // 2].all() and not buf[n // 2:n - 1].any() and buf[n - 1] == 1
    state = torch.tensor([n - 1], dtype=torch.int64)
    torch.ops.moeext.zero_tail_tracked_(buf.fill_(1), state, 3)
    assert buf[:3].all() and not buf[3:n - 1].any() and buf[n - 1] == 1 and int(state) == 3


def rows(quick=False):
    mib = 4 if quick else 64
    n = mib * (1 << 20) // 4
    check_zeroing(n)
    buf = torch.zeros(n, dtype=torch.int32)
    t_fill = median_seconds(lambda: buf.fill_(0))
    for tail in (0.0, 0.01, 0.10, 1.0):
        new_extent = n - int(n * tail)
        t = median_seconds(lambda: torch.ops.moeext.zero_tail_(buf, new_extent, n))
        yield Row("zero_tail_", f"{mib} MiB int32, {tail:.0%} tail via torch.ops", t,
                  "full fill_(0)", t_fill)
    state = torch.zeros(1, dtype=torch.int64)
    t = median_seconds(lambda: torch.ops.moeext.zero_tail_tracked_(buf, state, 0))
    yield Row("zero_tail_tracked_", f"{mib} MiB int32, no-op via torch.ops", t, "full fill_(0)",
              t_fill)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 MiB buffer (CI smoke)")
    args = parser.parse_args(argv)
    print(f"# zero_tail_ — {machine_line()}")
    for row in rows(args.quick):
        print(f"{row.line()}   ({row.moeext_s / row.baseline_s:.2%} of the fill)", flush=True)


if __name__ == "__main__":
    main()
