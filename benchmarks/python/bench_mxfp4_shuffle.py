"""MXFP4 weight preparation: moeext's shuffles against the pure-PyTorch formulation.

A DeepSeek-V3-sized w13 slice (32 experts x [4096, 3584] packed fp4 bytes, i.e. K = 7168
values) and its E8M0 scales ([32 * 4096, 224]). Each op is compared, in the same run, with
AITER's view/permute/contiguous formulation (one copy; baselines.py, checked against moeext's
bytes first) and with a same-size clone() (both allocate their output, as the op does, but
through torch's allocator: where moeext's output gets huge pages they pay 4 KiB page faults,
so the clone is a yardstick, not a bound).

    python benchmarks/python/bench_mxfp4_shuffle.py [--quick]
"""

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import moeext  # noqa: E402
from baselines import aiter_e8m0_shuffle, aiter_shuffle_weight  # noqa: E402
from baselines import check_shuffle_baselines  # noqa: E402
from common import Row, machine_line, median_seconds  # noqa: E402


def rows(quick=False):
    experts = 4 if quick else 32
    n, k_bytes = 4096, 3584
    min_time = 0.2 if quick else 1.0
    w = torch.randint(0, 256, (experts, n, k_bytes), dtype=torch.uint8)
    scales = torch.randint(100, 140, (experts * n, k_bytes * 2 // 32), dtype=torch.uint8)
    shape = f"{experts}x[{n},{k_bytes}] B"
    check_shuffle_baselines(w, scales, experts)
    t_clone = median_seconds(lambda: w.clone(), min_time)
    for gate_up in (False, True):
        case = shape + (" gate_up" if gate_up else "")
        t_op = median_seconds(lambda: moeext.shuffle_weight(w, gate_up=gate_up), min_time)
        t_torch = median_seconds(lambda: aiter_shuffle_weight(w, gate_up), min_time)
        yield Row("shuffle_weight", case, t_op, "AITER view/permute/contiguous", t_torch)
        yield Row("shuffle_weight", case, t_op, "clone() of the weight", t_clone)
    t_clone = median_seconds(lambda: scales.clone(), min_time)
    for gate_up in (False, True):
        kw = dict(gate_up=gate_up, num_experts=experts if gate_up else None)
        case = f"[{experts * n},224]" + (" gate_up" if gate_up else "")
        t_op = median_seconds(lambda: moeext.e8m0_shuffle(scales, **kw), min_time)
        t_torch = median_seconds(lambda: aiter_e8m0_shuffle(scales, **kw), min_time)
        yield Row("e8m0_shuffle", case, t_op, "AITER view/permute/contiguous", t_torch)
        yield Row("e8m0_shuffle", case, t_op, "clone() of the scales", t_clone)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 experts (CI smoke)")
    args = parser.parse_args(argv)
    print(f"# MXFP4 shuffles — {machine_line()}")
    for row in rows(args.quick):
        print(row.line(), flush=True)


if __name__ == "__main__":
    main()
