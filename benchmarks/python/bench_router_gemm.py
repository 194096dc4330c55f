"""Router GEMM: moeext.router_gemm against the ways engines get router logits on CPU today.

For a bf16 gate of DeepSeek-V3's hidden size (H = 7168) and E experts, per number of tokens T,
the median latency of, all measured in the same run:

  moeext fp32     torch.ops.moeext.router_gemm(x, w)              fp32 logits, exact-ish
  moeext packed   torch.ops.moeext.router_gemm(x, wp)             the same from the weight
                  moeext.prepack_router_weight(w) made once
  moeext bf16     torch.ops.moeext.router_gemm(x, w, bfloat16)    rounded once
  linear bf16     F.linear(x, w)                  oneDNN bf16 GEMM, bf16 out (~1.5e-2 off)
  linear fp32     F.linear(x.float(), w32)        weight upcast once, kept (2x the memory)
  upcast/call     F.linear(x.float(), w.float())  weight upcast on every call
  read bound      the time to read the weight's bytes once (a torch .sum() over an fp32
                  buffer of the same size): the read a T = 1 GEMM pays too, as .sum()
                  streams it (a yardstick: a kernel that streams better can dip below)

and the ratios of each baseline to moeext fp32, and of F.linear bf16 to moeext packed (>1:
moeext is faster). The machine's cores
may be shared: every function is timed in several rounds, interleaved with the others, and
the best round's median is kept, so a burst of foreign load hits one round, not a column.

    python benchmarks/python/bench_router_gemm.py [--quick] [--experts 256,384]
        [--tokens 1,4,16,64,256] [--isa portable|avx2|avx512|avx512bf16] [--markdown]

--isa forces moeext's CPU path ("portable" is the compiler's generic vectors); the default is the best one
this CPU runs.
"""

import argparse
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import moeext  # noqa: E402,F401
from common import Row, machine_line, median_seconds  # noqa: E402

HIDDEN_SIZE = 7168
EXPERTS = [256, 384]
TOKENS = [1, 4, 16, 64, 256]
OURS = ["moeext fp32", "moeext packed", "moeext bf16"]
BASELINE_COLUMNS = ["linear bf16", "linear fp32", "upcast/call"]
COLUMNS = OURS + BASELINE_COLUMNS


def check_logits(x, w, packed):
    """Asserts, before anything is timed, that moeext's logits are the product's: fp32 from
    both weight layouts within 1e-4 of the float64 product (their sums' rounding is about
    1e-5 here), bf16 the fp32 logits rounded once."""
    exact = (x.double() @ w.double().T).float()
    logits = moeext.router_gemm(x, w)
    for layout, got in (("nn.Linear", logits), ("prepacked", moeext.router_gemm(x, packed))):
        torch.testing.assert_close(got, exact, rtol=0, atol=1e-4,
                                   msg=lambda m: f"router_gemm, {layout} layout: {m}")
    assert torch.equal(moeext.router_gemm(x, w, torch.bfloat16), logits.bfloat16()), \
        "router_gemm: bf16 logits are not the fp32 ones rounded once"


def measure(num_experts, num_tokens, min_time, rounds):
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN_SIZE, generator=g).bfloat16()
    w = (0.02 * torch.randn(num_experts, HIDDEN_SIZE, generator=g)).bfloat16()
    w32 = w.float()
    packed = moeext.prepack_router_weight(w)
    check_logits(x, w, packed)
    same_bytes = torch.ones(w.numel() * w.element_size() // 4)
    op = torch.ops.moeext.router_gemm.default
    fns = {
        "moeext fp32": lambda: op(x, w),
        "moeext packed": lambda: op(x, packed),
        "moeext bf16": lambda: op(x, w, torch.bfloat16),
        "linear bf16": lambda: F.linear(x, w),
        "linear fp32": lambda: F.linear(x.float(), w32),
        "upcast/call": lambda: F.linear(x.float(), w.float()),
        "read bound": lambda: same_bytes.sum(),
    }
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], median_seconds(fn, min_time / rounds))
    return best


BASELINES = {"linear bf16": "F.linear bf16 (bf16 out)", "linear fp32": "F.linear fp32, w pre-upcast",
             "upcast/call": "F.linear, upcast per call", "read bound": "read the weight once"}


def rows(quick=False):
    """Rows for run_all.py: moeext fp32 logits against each baseline, E in EXPERTS."""
    experts, tokens = ([256], [1, 16]) if quick else (EXPERTS, TOKENS)
    min_time, rounds = (0.05, 1) if quick else (0.6, 3)
    for num_experts in experts:
        for num_tokens in tokens:
            t = measure(num_experts, num_tokens, min_time, rounds)
            shape = f"E={num_experts} H={HIDDEN_SIZE} T={num_tokens}"
            for name, label in BASELINES.items():
                yield Row("router_gemm", shape, t["moeext fp32"], label, t[name], x=num_tokens)
            for name in ("linear bf16", "read bound"):
                yield Row("router_gemm prepacked", shape, t["moeext packed"], BASELINES[name],
                          t[name], x=num_tokens)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="E=256, T in {1, 16} (CI smoke)")
    parser.add_argument("--experts", default=",".join(map(str, EXPERTS)))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--markdown", action="store_true", help="also print a markdown table")
    parser.add_argument("--isa", default=None, help="force moeext's CPU path (default: best)")
    args = parser.parse_args(argv)
    if args.isa is not None:
        moeext.set_cpu_isa(args.isa)
    experts = [int(e) for e in args.experts.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    min_time, rounds = 0.6, 3
    if args.quick:
        experts, tokens, min_time, rounds = [256], [1, 16], 0.05, 1

    print(f"# router_gemm, bf16 inputs, H = {HIDDEN_SIZE} — {machine_line()}")
    print(f"# median us (best of {rounds} interleaved rounds); xN = baseline / moeext fp32 "
          f"(packed: F.linear bf16 / moeext packed); bound = moeext fp32, packed / time to read "
          f"the weight's bytes once")
    rows = []
    for num_experts in experts:
        print(f"E={num_experts} (weight {num_experts * HIDDEN_SIZE * 2 / 2**20:.2f} MiB)")
        for num_tokens in tokens:
            t = measure(num_experts, num_tokens, min_time, rounds)
            bound = t["read bound"]
            rows.append((num_experts, num_tokens, t, bound))
            ours, packed = t["moeext fp32"], t["moeext packed"]
            cells = "  ".join(f"{name} {t[name] * 1e6:8.1f}" for name in COLUMNS + ["read bound"])
            ratios = "  ".join(f"x{t[name] / ours:4.1f}" for name in BASELINE_COLUMNS)
            print(f"  T={num_tokens:<4d} {cells}   vs linear bf16/fp32/upcast {ratios}   "
                  f"packed x{t['linear bf16'] / packed:4.1f}   bound x{ours / bound:4.2f}, "
                  f"packed x{packed / bound:4.2f}", flush=True)
    if args.markdown:
        print()
        print("| E | T | moeext fp32 | moeext packed | moeext bf16 | F.linear bf16 | "
              "F.linear fp32 (w pre-upcast) | upcast every call | read bound | vs F.linear bf16 "
              "| vs fp32 pre-upcast | vs upcast/call | packed vs F.linear bf16 | "
              "moeext / read bound | packed / read bound |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for num_experts, num_tokens, t, bound in rows:
            ours, packed = t["moeext fp32"], t["moeext packed"]
            us = " | ".join(f"{t[name] * 1e6:.1f}" for name in COLUMNS + ["read bound"])
            ratios = " | ".join(f"{t[name] / ours:.1f}x" for name in BASELINE_COLUMNS)
            print(f"| {num_experts} | {num_tokens} | {us} | {ratios} | "
                  f"{t['linear bf16'] / packed:.1f}x | {ours / bound:.2f}x | "
                  f"{packed / bound:.2f}x |")


if __name__ == "__main__":
    main()
