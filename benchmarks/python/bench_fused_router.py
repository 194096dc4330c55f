"""fused_router on the CPU against the two calls it fuses and against router_gemm alone.

For each model gate (H = 7168) and number of tokens, the median latency of
``moeext.fused_router`` against ``router_gemm`` then ``biased_grouped_topk`` (two calls, the
logits handed back to Python in between) and against ``router_gemm`` alone, with the weight
as loaded and prepacked; and the same for the out= forms, ``fused_router_out`` against
``router_gemm`` then ``biased_grouped_topk_out``, into buffers kept across calls as a decode
loop keeps them. All are timed in turns, several rounds, each time the median of its
rounds, so that a drift of the machine's speed during the run falls on all alike. Each
ratio is the median of the rounds' own ratios (a call against its baseline timed next to
it), printed with the rounds' quartiles: on a shared machine the spread between rounds can
be larger than the few percent the targets allow. The routing arguments are passed
positionally, bound once, as engines' call sites pass them (a ``**kwargs`` dict unpacked
per call costs ~0.1-0.2 us of Python on its own). Targets (issue #53): at T = 1, at most
1.05x router_gemm alone and faster than the two calls.

By default every call reads the same gate weight, which stays in the caches where it fits
(on two cores of 2 MiB of L2 each, the DeepSeek-V3 gate's two halves fit in them).
``--layers N`` gives each call the next of N gates of the same shape, as a decode step reads
one gate per MoE layer (DeepSeek-V3 has 58), so that the weight comes from wherever a model's
gates would.

    python benchmarks/python/bench_fused_router.py [--quick] [--presets a,b] [--tokens 1,4]
                                                   [--rounds N] [--seconds S] [--layers N]
"""

import argparse
import itertools
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


def _inputs(preset, num_tokens, layers=1):
    p = PRESETS[preset]
    g = torch.Generator().manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, HIDDEN, generator=g).bfloat16()
    gates = [(0.02 * torch.randn(p.num_experts, HIDDEN, generator=g)).bfloat16()
             for _ in range(layers)]
    bias = (2 + 0.05 * torch.randn(p.num_experts, generator=g)) if p.has_bias else None
    return p, hidden, gates, bias


def in_turns(fns, min_time, rounds=ROUNDS):
    """Seconds per call of each function in each round, the functions timed in turns."""
    samples = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            samples[i].append(median_seconds(fn, min_time / rounds))
    return samples


def paired_ratio(times, baseline_times):
    """Median and quartiles of the per-round ratios of two functions timed in turns."""
    ratios = sorted(t / b for t, b in zip(times, baseline_times))
    if len(ratios) < 2:
        return (ratios[0],) * 3
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return median, q1, q3


def rows(quick=False, presets=None, tokens=None, rounds=ROUNDS, min_time=None, layers=1):
    presets = presets or (["deepseek-v3"] if quick else ["deepseek-v3", "kimi-k2"])
    tokens = tokens or ([1] if quick else TOKENS)
    min_time = min_time or (0.1 if quick else 1.0)
    for name in presets:
        for num_tokens in tokens:
            p, hidden, gates, bias = _inputs(name, num_tokens, layers)
            args = (p.num_expert_group, p.topk_group, p.topk, p.renormalize,
                    p.routed_scaling_factor, p.scoring_func)
            out_args = args[:2] + args[3:]  # the out= forms take topk from topk_ids
            weights = torch.empty(num_tokens, p.topk)
            ids = torch.empty(num_tokens, p.topk, dtype=torch.int32)
            for layout in ("weight", "prepacked"):
                ws = ([moeext.prepack_router_weight(w) for w in gates] if layout == "prepacked"
                      else gates)
                gate = itertools.cycle(ws).__next__  # each call the next layer's gate

                def fused():
                    return moeext.fused_router(hidden, gate(), bias, *args)

                def two_calls():
                    return moeext.biased_grouped_topk(moeext.router_gemm(hidden, gate()), bias,
                                                      *args)

                def fused_out():
                    moeext.fused_router_out(hidden, gate(), bias, weights, ids, *out_args)

                def two_calls_out():
                    moeext.biased_grouped_topk_out(moeext.router_gemm(hidden, gate()), bias,
                                                   weights, ids, *out_args)

                def gemm():
                    return moeext.router_gemm(hidden, gate())

                expected = moeext.biased_grouped_topk(moeext.router_gemm(hidden, ws[0]), bias,
                                                      *args)
                got = moeext.fused_router(hidden, ws[0], bias, *args)
                assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
                moeext.fused_router_out(hidden, ws[0], bias, weights, ids, *out_args)
                assert torch.equal(weights, expected[0]) and torch.equal(ids, expected[1])
                fused_s, two_s, out_s, two_out_s, gemm_s = in_turns(
                    [fused, two_calls, fused_out, two_calls_out, gemm], min_time, rounds)
                case = f"{name} T={num_tokens} {layout}"
                if layers > 1:
                    case += f" {layers} gates"
                for op, times, baseline, baseline_times in (
                        ("fused_router", fused_s, "router_gemm + routing", two_s),
                        ("fused_router", fused_s, "router_gemm alone", gemm_s),
                        ("fused_router_out", out_s, "router_gemm + routing_out", two_out_s),
                        ("fused_router_out", out_s, "router_gemm alone", gemm_s)):
                    yield Row(op, case, statistics.median(times), baseline,
                              statistics.median(baseline_times), x=num_tokens,
                              ratio_in_rounds=paired_ratio(times, baseline_times))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one preset, T = 1 (CI smoke)")
    parser.add_argument("--presets", default=None, help="comma-separated preset names")
    parser.add_argument("--tokens", default=None, help="comma-separated token counts")
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help=f"rounds of turns per case (default {ROUNDS})")
    parser.add_argument("--layers", type=int, default=1,
                        help="distinct gates of each shape, one a call in turn, as a decode "
                             "step reads one a MoE layer (default 1: the same gate every call)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="timing per function and case, all rounds together "
                             "(default 1.0, --quick 0.1)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.layers < 1:
        parser.error(f"--layers must be at least 1, got {args.layers}")
    if args.seconds is not None and not args.seconds > 0:
        parser.error(f"--seconds must be above 0, got {args.seconds}")
    presets = args.presets.split(",") if args.presets else None
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else None
    gates = "the same gate every call" if args.layers == 1 else f"{args.layers} gates in turn"
    print(f"# fused_router, bf16 hidden states and gate (H = {HIDDEN}), fp32 bias, {gates}, "
          f"{args.rounds} rounds — {machine_line()}")
    for row in rows(args.quick, presets, tokens, args.rounds, args.seconds, args.layers):
        # The targets are a few percent: the ratio to three places beside the speed-up.
        median, q1, q3 = row.ratio_in_rounds
        print(f"{row.line()}   {median:.3f}x the time (rounds {q1:.3f}-{q3:.3f})", flush=True)


if __name__ == "__main__":
    main()
