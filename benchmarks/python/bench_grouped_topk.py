"""Biased grouped top-k: moeext against the pure-PyTorch formulations routed with today.

For every SPEC preset and number of tokens: the median latency of ``moeext.biased_grouped_topk``
(the public wrapper, which calls the op directly) and, measured in the same process, of two
baselines, a row and a speed-up each: ``moeext.reference.biased_grouped_topk``, the pure-PyTorch
reference the foundation issue (#2) sets its 20x target against (the sort-based oracle of the
tests), and the torch-native ``grouped_topk`` vLLM's CPU backend routes with (fp32 math, as the
contract requires; baselines.py), the faster of the two. At T = 1 also the op called through
``torch.ops``, whose generic argument conversion costs 1.3-3 us more per call (by machine).
bf16 logits and an fp32 bias, as DeepSeek-V3 checkpoints route. ``--baseline`` keeps one.

    python benchmarks/python/bench_grouped_topk.py [--quick] [--presets a,b] [--tokens 1,16]
        [--baseline both|reference|torch-native]
"""

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from baselines import check_grouped_topk_baseline, torch_native_grouped_topk  # noqa: E402
from common import Row, machine_line, median_seconds  # noqa: E402
import moeext  # noqa: E402
import moeext.reference  # noqa: E402
from moeext.presets import PRESETS  # noqa: E402

TOKENS = [1, 16, 64, 1024, 4096, 16384]


BASELINES = {
    "torch-native": ("torch-native grouped_topk", torch_native_grouped_topk),
    "reference": ("moeext.reference", moeext.reference.biased_grouped_topk),
}


def check_against_reference(args):
    """Asserts, before the inputs are timed, that both ways of calling moeext route them as
    moeext.reference does: the same ids in the same order, and the same weights."""
    ref_weights, ref_ids = moeext.reference.biased_grouped_topk(*args)
    for name, route in (("moeext.biased_grouped_topk", moeext.biased_grouped_topk),
                        ("torch.ops", torch.ops.moeext.biased_grouped_topk)):
        weights, ids = route(*args)
        assert torch.equal(ids, ref_ids), f"{name}: ids differ from moeext.reference's"
        torch.testing.assert_close(weights, ref_weights, msg=lambda m: f"{name}: {m}")


def rows(quick=False, presets=None, tokens=None, baseline="both"):
    presets = presets or (["deepseek-v3", "kimi-k2"] if quick else list(PRESETS))
    tokens = tokens or ([1, 64] if quick else TOKENS)
    min_time = 0.05 if quick else 0.3
    baselines = list(BASELINES) if baseline == "both" else [baseline]
    for name in presets:
        p = PRESETS[name]
        if "torch-native" in baselines:
            check_grouped_topk_baseline(
                ((2 + 0.05 * torch.randn(p.num_experts)) if p.has_bias else None,
                 p.num_expert_group, p.topk_group, p.topk, p.renormalize,
                 p.routed_scaling_factor, p.scoring_func), p.num_experts)
        for num_tokens in tokens:
            g = torch.Generator().manual_seed(num_tokens)
            logits = torch.randn(num_tokens, p.num_experts, generator=g).bfloat16()
            bias = (2 + 0.05 * torch.randn(p.num_experts, generator=g)) if p.has_bias else None
            args = (logits, bias, p.num_expert_group, p.topk_group, p.topk, p.renormalize,
                    p.routed_scaling_factor, p.scoring_func)
            check_against_reference(args)
            t_moeext = median_seconds(lambda: moeext.biased_grouped_topk(*args), min_time)
            t_ops = (median_seconds(lambda: torch.ops.moeext.biased_grouped_topk(*args),
                                    min_time) if num_tokens == 1 else None)
            for key in baselines:
                baseline_name, baseline_fn = BASELINES[key]
                t_base = median_seconds(lambda: baseline_fn(*args), min_time)
                yield Row("biased_grouped_topk", f"{name} T={num_tokens}", t_moeext,
                          baseline_name, t_base, x=num_tokens)
                if t_ops is not None:
                    yield Row("biased_grouped_topk", f"{name} T=1 via torch.ops", t_ops,
                              baseline_name, t_base)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two presets, small T (CI smoke)")
    parser.add_argument("--presets", default=None, help="comma-separated preset names")
    parser.add_argument("--tokens", default=None, help="comma-separated token counts")
    parser.add_argument("--baseline", default="both", choices=["both", *BASELINES],
                        help="what moeext is compared with (default: each, in turn)")
    args = parser.parse_args(argv)
    presets = args.presets.split(",") if args.presets else None
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else None
    print(f"# biased_grouped_topk, bf16 logits, fp32 bias — {machine_line()}")
    for row in rows(args.quick, presets, tokens, args.baseline):
        print(row.line(), flush=True)


if __name__ == "__main__":
    main()
