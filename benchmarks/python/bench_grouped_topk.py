"""Biased grouped top-k: moeext against the pure-PyTorch formulation engines run today.

Prints, for every SPEC preset and number of tokens, the median latency of
``torch.ops.moeext.biased_grouped_topk`` and of the vLLM/SGLang-style torch-native
``grouped_topk`` (fp32 math, as the contract requires) measured in the same process, and
the speed-up. bf16 logits and an fp32 bias, as DeepSeek-V3 checkpoints route.

    python benchmarks/python/bench_grouped_topk.py [--quick] [--presets a,b] [--tokens 1,16]
"""

import argparse
import pathlib
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import moeext  # noqa: E402
from baselines import torch_native_grouped_topk  # noqa: E402
from moeext.presets import PRESETS  # noqa: E402

TOKENS = [1, 16, 64, 1024, 4096, 16384]


def median_seconds(fn, min_time=0.3, max_iters=2000):
    """Median of individually timed calls after a warm-up; at least 5, about min_time total."""
    for _ in range(3):
        fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    iters = int(min(max_iters, max(5, min_time / once)))
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def machine_line():
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
            f"moeext CPU path {moeext.cpu_isa()}")


def run(presets, tokens, min_time):
    rows = []
    for name in presets:
        p = PRESETS[name]
        for num_tokens in tokens:
            g = torch.Generator().manual_seed(num_tokens)
            logits = torch.randn(num_tokens, p.num_experts, generator=g).bfloat16()
            bias = (2 + 0.05 * torch.randn(p.num_experts, generator=g)) if p.has_bias else None
            args = (logits, bias, p.num_expert_group, p.topk_group, p.topk, p.renormalize,
                    p.routed_scaling_factor, p.scoring_func)
            op = torch.ops.moeext.biased_grouped_topk
            t_moeext = median_seconds(lambda: op(*args), min_time)
            t_base = median_seconds(lambda: torch_native_grouped_topk(*args), min_time)
            rows.append((name, num_tokens, t_moeext, t_base))
            print(f"{name:18s} T={num_tokens:<6d} moeext {t_moeext * 1e6:10.1f} us   "
                  f"torch-native {t_base * 1e6:10.1f} us   x{t_base / t_moeext:6.1f}",
                  flush=True)
    return rows


def markdown(rows):
    lines = ["| preset | T | moeext (us) | torch-native (us) | speed-up |",
             "|---|---:|---:|---:|---:|"]
    for name, num_tokens, t_moeext, t_base in rows:
        lines.append(f"| {name} | {num_tokens} | {t_moeext * 1e6:.1f} | {t_base * 1e6:.1f} | "
                     f"{t_base / t_moeext:.1f}x |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two presets, small T (CI smoke)")
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--markdown", action="store_true", help="also print a markdown table")
    args = parser.parse_args(argv)
    presets = args.presets.split(",")
    tokens = [int(t) for t in args.tokens.split(",")]
    min_time = 0.3
    if args.quick:
        presets, tokens, min_time = ["deepseek-v3", "kimi-k2"], [1, 64], 0.05
    print(f"# biased_grouped_topk, bf16 logits, fp32 bias — {machine_line()}")
    rows = run(presets, tokens, min_time)
    if args.markdown:
        print()
        print(markdown(rows))


if __name__ == "__main__":
    main()
