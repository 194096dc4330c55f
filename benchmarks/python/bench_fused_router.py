"""fused_router on the CPU against the two calls it fuses and against router_gemm alone.

For each model gate (H = 7168) and number of tokens, the median latency of
``moeext.fused_router`` against ``router_gemm`` then ``biased_grouped_topk`` (two calls, the
logits handed back to Python in between) and against ``router_gemm`` alone, with the weight
as loaded and prepacked; and the same for the out= forms, ``fused_router_out`` against
``router_gemm`` then ``biased_grouped_topk_out``, into buffers kept across calls as a decode
loop keeps them. All are timed in turns, several rounds, each figure the median of its
rounds, so that a drift of the machine's speed during the run falls on all alike. The
routing arguments are passed positionally, bound once, as engines' call sites pass them (a
``**kwargs`` dict unpacked per call costs ~0.1-0.2 us of Python on its own). Targets (issue
#53): at T = 1, at most 1.05x router_gemm alone and faster than the two calls.

    python benchmarks/python/bench_fused_router.py [--quick] [--presets a,b] [--tokens 1,4]
"""

import argparse
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from common import Row, machine_line, median_seconds  # noqa: E402
import moeext  # noqa: E402
from moeext.presets import PRESETS  # noqa: E402

HIDDEN = 7168
TOKENS = [1, 4, 16, 256]
ROUNDS = 5


def _inputs(preset, num_tokens):
    p = PRESETS[preset]
    g = torch.Generator().manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, HIDDEN, generator=g).bfloat16()
    weight = (0.02 * torch.randn(p.num_experts, HIDDEN, generator=g)).bfloat16()
    bias = (2 + 0.05 * torch.randn(p.num_experts, generator=g)) if p.has_bias else None
    return p, hidden, weight, bias


def in_turns(fns, min_time, rounds=ROUNDS):
    """Median seconds per call of each function, timed in turns over `rounds` rounds."""
    samples = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            samples[i].append(median_seconds(fn, min_time / rounds))
    return [statistics.median(s) for s in samples]


def rows(quick=False, presets=None, tokens=None):
    presets = presets or (["deepseek-v3"] if quick else ["deepseek-v3", "kimi-k2"])
    tokens = tokens or ([1] if quick else TOKENS)
    min_time = 0.1 if quick else 1.0
    for name in presets:
        for num_tokens in tokens:
            p, hidden, weight, bias = _inputs(name, num_tokens)
            args = (p.num_expert_group, p.topk_group, p.topk, p.renormalize,
                    p.routed_scaling_factor, p.scoring_func)
            out_args = args[:2] + args[3:]  # the out= forms take topk from topk_ids
            weights = torch.empty(num_tokens, p.topk)
            ids = torch.empty(num_tokens, p.topk, dtype=torch.int32)
            for layout in ("weight", "prepacked"):
                w = moeext.prepack_router_weight(weight) if layout == "prepacked" else weight

                def fused():
                    return moeext.fused_router(hidden, w, bias, *args)

                def two_calls():
                    return moeext.biased_grouped_topk(moeext.router_gemm(hidden, w), bias, *args)

                def fused_out():
                    moeext.fused_router_out(hidden, w, bias, weights, ids, *out_args)

                def two_calls_out():
                    moeext.biased_grouped_topk_out(moeext.router_gemm(hidden, w), bias, weights,
                                                   ids, *out_args)

                def gemm():
                    return moeext.router_gemm(hidden, w)

                got, expected = fused(), two_calls()
                assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
                fused_out()
                assert torch.equal(weights, expected[0]) and torch.equal(ids, expected[1])
                t_fused, t_two, t_out, t_two_out, t_gemm = in_turns(
                    [fused, two_calls, fused_out, two_calls_out, gemm], min_time)
                case = f"{name} T={num_tokens} {layout}"
                yield Row("fused_router", case, t_fused, "router_gemm + routing", t_two,
                          x=num_tokens)
                yield Row("fused_router", case, t_fused, "router_gemm alone", t_gemm,
                          x=num_tokens)
                yield Row("fused_router_out", case, t_out, "router_gemm + routing_out",
                          t_two_out, x=num_tokens)
                yield Row("fused_router_out", case, t_out, "router_gemm alone", t_gemm,
                          x=num_tokens)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one preset, T = 1 (CI smoke)")
    parser.add_argument("--presets", default=None, help="comma-separated preset names")
    parser.add_argument("--tokens", default=None, help="comma-separated token counts")
    args = parser.parse_args(argv)
    presets = args.presets.split(",") if args.presets else None
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else None
    print(f"# fused_router, bf16 hidden states and gate (H = {HIDDEN}), fp32 bias — "
          f"{machine_line()}")
    for row in rows(args.quick, presets, tokens):
        # The targets are a few percent: the ratio to three places beside the speed-up.
        print(f"{row.line()}   {row.moeext_s / row.baseline_s:.3f}x the time", flush=True)


if __name__ == "__main__":
    main()
