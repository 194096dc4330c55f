"""``python -m moeext``: route a DeepSeek-V3-shaped batch, check it, time it.

Routes batches of 1 and 4096 tokens of bf16 router logits with DeepSeek-V3's routing (256
experts in 8 groups, 4 groups kept, 8 experts per token, an fp32 correction bias around +2),
compares the results with the pure-PyTorch reference, and prints the latency of both. Exits
with status 1 if any row's ids differ from the reference's or a weight by more than 1e-5.
"""

import statistics
import time

import torch

import moeext
from moeext.presets import PRESETS


def _median_us(fn, iters):
    fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def main():
    info = moeext.build_info()
    print(f"moeext {moeext.__version__} | torch {info['torch_version']} | backends "
          f"{', '.join(info['backends'])} | CPU path {info['cpu_isa_active']} | built by "
          f"{info['compiler']}")
    p = PRESETS["deepseek-v3"]
    g = torch.Generator().manual_seed(0)
    failures = []
    for num_tokens in (1, 4096):
        logits = torch.randn(num_tokens, p.num_experts, generator=g).bfloat16()
        bias = 2 + 0.05 * torch.randn(p.num_experts, generator=g)
        weights, ids = moeext.biased_grouped_topk(logits, bias, **p.op_kwargs())
        ref_weights, ref_ids = moeext.reference.biased_grouped_topk(logits, bias,
                                                                    **p.op_kwargs())
        same_ids = (ids == ref_ids).all(dim=-1).float().mean().item()
        max_err = (weights - ref_weights).abs().max().item()
        if same_ids < 1 or not max_err <= 1e-5:
            failures.append(num_tokens)
        iters = 2000 if num_tokens == 1 else 20
        t_op = _median_us(lambda: moeext.biased_grouped_topk(logits, bias, **p.op_kwargs()),
                          iters)
        t_ref = _median_us(
            lambda: moeext.reference.biased_grouped_topk(logits, bias, **p.op_kwargs()), iters)
        print(f"deepseek-v3 routing, {num_tokens:5d} tokens: rows with reference ids "
              f"{same_ids:.2%}, max |weight diff| {max_err:.1e}, moeext {t_op:9.1f} us, "
              f"reference {t_ref:9.1f} us ({t_ref / t_op:.0f}x)")
    print("first token:", ids[0].tolist(), [round(w, 4) for w in weights[0].tolist()])
    if failures:
        raise SystemExit(f"FAILED: the batches of {failures} tokens differ from the reference")
    print("check: every row matches the reference")


if __name__ == "__main__":
    main()
