"""Biased grouped top-k: moeext against the pure-PyTorch formulation engines run today.

For every SPEC preset and number of tokens: the median latency of
``torch.ops.moeext.biased_grouped_topk`` and of the vLLM/SGLang-style torch-native
``grouped_topk`` (fp32 math, as the contract requires) measured in the same process, and the
speed-up. bf16 logits and an fp32 bias, as DeepSeek-V3 checkpoints route.

    python benchmarks/python/bench_grouped_topk.py [--quick] [--presets a,b] [--tokens 1,16]
"""

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from baselines import torch_native_grouped_topk  # noqa: E402
from common import Row, machine_line, median_seconds  # noqa: E402
from moeext.presets import PRESETS  # noqa: E402

TOKENS = [1, 16, 64, 1024, 4096, 16384]


def rows(quick=False, presets=None, tokens=None):
    presets = presets or (["deepseek-v3", "kimi-k2"] if quick else list(PRESETS))
    tokens = tokens or ([1, 64] if quick else TOKENS)
    min_time = 0.05 if quick else 0.3
    op = torch.ops.moeext.biased_grouped_topk
    for name in presets:
        p = PRESETS[name]
        for num_tokens in tokens:
            g = torch.Generator().manual_seed(num_tokens)
            logits = torch.randn(num_tokens, p.num_experts, generator=g).bfloat16()
            bias = (2 + 0.05 * torch.randn(p.num_experts, generator=g)) if p.has_bias else None
            args = (logits, bias, p.num_expert_group, p.topk_group, p.topk, p.renormalize,
                    p.routed_scaling_factor, p.scoring_func)
            t_moeext = median_seconds(lambda: op(*args), min_time)
            t_base = median_seconds(lambda: torch_native_grouped_topk(*args), min_time)
            yield Row("biased_grouped_topk", f"{name} T={num_tokens}", t_moeext,
                      "torch-native grouped_topk", t_base, x=num_tokens)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two presets, small T (CI smoke)")
    parser.add_argument("--presets", default=None, help="comma-separated preset names")
    parser.add_argument("--tokens", default=None, help="comma-separated token counts")
    args = parser.parse_args(argv)
    presets = args.presets.split(",") if args.presets else None
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else None
    print(f"# biased_grouped_topk, bf16 logits, fp32 bias — {machine_line()}")
    for row in rows(args.quick, presets, tokens):
        print(row.line(), flush=True)


if __name__ == "__main__":
    main()
