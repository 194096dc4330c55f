"""MXFP4 weight preparation: moeext's shuffles against the pure-PyTorch formulation.

A DeepSeek-V3-sized w13 slice (32 experts x [4096, 3584] packed fp4 bytes, i.e. K = 7168
values) and its E8M0 scales ([32 * 4096, 224]). Each op is compared, in the same run, with
the view/permute/contiguous formulation AITER and the engines use (moeext.reference) and
with a same-size clone(), the bandwidth bound.

    python benchmarks/python/bench_mxfp4_shuffle.py [--quick]
"""

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import moeext  # noqa: E402
from bench_grouped_topk import machine_line, median_seconds  # noqa: E402


def report(name, nbytes, t_op, t_torch, t_clone):
    gbs = 2 * nbytes / t_op / 1e9  # read + write
    print(f"{name:34s} moeext {t_op * 1e3:8.2f} ms ({gbs:5.1f} GB/s)   torch {t_torch * 1e3:8.2f} ms"
          f"   clone {t_clone * 1e3:8.2f} ms   x{t_torch / t_op:5.1f} vs torch, "
          f"{t_clone / t_op:5.0%} of clone speed")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 experts (CI smoke)")
    args = parser.parse_args(argv)
    experts = 4 if args.quick else 32
    n, k_bytes = 4096, 3584
    min_time = 0.2 if args.quick else 1.0
    w = torch.randint(0, 256, (experts, n, k_bytes), dtype=torch.uint8)
    scales = torch.randint(100, 140, (experts * n, k_bytes * 2 // 32), dtype=torch.uint8)
    print(f"# MXFP4 shuffles, {experts} experts x [{n}, {k_bytes}] bytes — {machine_line()}")
    t_clone = median_seconds(lambda: w.clone(), min_time)
    for gate_up in (False, True):
        t_op = median_seconds(lambda: moeext.shuffle_weight(w, gate_up=gate_up), min_time)
        t_torch = median_seconds(lambda: moeext.reference.shuffle_weight(w, gate_up=gate_up),
                                 min_time)
        report(f"shuffle_weight gate_up={gate_up}", w.numel(), t_op, t_torch, t_clone)
    t_clone = median_seconds(lambda: scales.clone(), min_time)
    for gate_up in (False, True):
        kw = dict(gate_up=gate_up, num_experts=experts if gate_up else None)
        t_op = median_seconds(lambda: moeext.e8m0_shuffle(scales, **kw), min_time)
        t_torch = median_seconds(lambda: moeext.reference.e8m0_shuffle(scales, **kw), min_time)
        report(f"e8m0_shuffle gate_up={gate_up}", scales.numel(), t_op, t_torch, t_clone)


if __name__ == "__main__":
    main()
