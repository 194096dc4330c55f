#!/usr/bin/env python3
"""moeext's decode-path kernels under Nsight Compute: where their device time goes (issue #51).

The peer harness says how long each kernel takes; this says why. Each case below is called a
few times to warm up, then once inside an NVTX range named ``moeext-profile``; run under
``ncu --nvtx --nvtx-include moeext-profile/``, only those calls' kernels are profiled, in the
order the cases are listed (the script prints each case's name before its call, so the
report's kernels line up with the names).

  route-*   biased_grouped_topk, sigmoid, fp32 bias, bf16 logits (the warp kernel, in the
            gate's own instance; *-v1: its routing variant 1, the kernel before the sorted
            lanes and those instances, set for the call: moeext::gpu_routing_variant; *-v4:
            variant 4, a token a thread; *-v5: variant 5, a token a block; *-v6: variant 6,
            the gate's instance scoring each lane's experts as a chunk; *-v7: variant 7, a
            token two threads; *-v8: variant 8, the topk by a butterfly of list merges)
  counts-*  the same with the expert_counts option (int32 counters): any one option cost about
            1 us at T = 1 on an H200 (2026-11-30), whichever it was; *-v3: routing variant 3,
            the gate's own instance with the options, where the current kernel runs the
            generic options instance
  gemm-*    router_gemm, H = 7168, bf16 -> fp32 (the small-T kernel)
  fused-*   fused_router, H = 7168, as its one-launch decode kernel (fused router variant 1;
            calls run the two kernels the gemm and route cases profile)

What to read in the report: per kernel, the instructions executed per warp
(``smsp__inst_executed``, divided by the tokens for the per-token cost at T = 16384), the
issue-slot use, the top warp stall reasons, the achieved occupancy and the registers.

    ncu --clock-control none --nvtx --nvtx-include moeext-profile/ \
        --section SpeedOfLight --section LaunchStats --section Occupancy \
        --section SchedulerStats --section WarpStateStats --section InstructionStats \
        python benchmarks/python/profile_cuda.py [--cases route-dsv3-bf16-t1,...]
    python benchmarks/python/profile_cuda.py --list

Without ncu the script still runs every case once (a smoke test of the cases themselves).
"""

import argparse
import sys

CASES = {
    # name: (op, preset, tokens, routing variant)
    "route-dsv3-bf16-t1": ("route", "deepseek-v3", 1, 0),
    "route-dsv3-bf16-t16384": ("route", "deepseek-v3", 16384, 0),
    "route-dsv3-bf16-t1-v1": ("route", "deepseek-v3", 1, 1),
    "route-dsv3-bf16-t16384-v1": ("route", "deepseek-v3", 16384, 1),
    "route-dsv3-bf16-t16384-v4": ("route", "deepseek-v3", 16384, 4),
    "route-dsv3-bf16-t1-v5": ("route", "deepseek-v3", 1, 5),
    "route-dsv3-bf16-t16384-v6": ("route", "deepseek-v3", 16384, 6),
    "route-dsv3-bf16-t16384-v7": ("route", "deepseek-v3", 16384, 7),
    "route-dsv3-bf16-t1-v8": ("route", "deepseek-v3", 1, 8),
    "counts-dsv3-bf16-t1": ("counts", "deepseek-v3", 1, 0),
    "counts-dsv3-bf16-t1-v3": ("counts", "deepseek-v3", 1, 3),
    "route-kimi-bf16-t1": ("route", "kimi-k2", 1, 0),
    "route-kimi-bf16-t1-v1": ("route", "kimi-k2", 1, 1),
    "gemm-e256-t1": ("gemm", "deepseek-v3", 1, 0),
    "gemm-e384-t4": ("gemm", "kimi-k2", 4, 0),
    "fused-dsv3-t1": ("fused", "deepseek-v3", 1, 0),
}
HIDDEN = 7168
WARMUP_CALLS = 3
RANGE = "moeext-profile"


def with_switch(setter, value, call):
    """call, launched while one of moeext._C's A/B switches (``setter``) is set to ``value``."""
    def launch():
        previous = setter(value)
        try:
            return call()
        finally:
            setter(previous)
    return launch


def case_call(torch, moeext, preset, op, num_tokens):
    """A no-argument callable that launches the case's kernel once on fixed inputs."""
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    bias = 2 + 0.05 * torch.randn(preset.num_experts, device="cuda", generator=g)
    rest = (preset.num_expert_group, preset.topk_group, preset.topk, preset.renormalize,
            preset.routed_scaling_factor, preset.scoring_func)
    if op in ("route", "counts"):
        logits = torch.randn(num_tokens, preset.num_experts, device="cuda",
                             generator=g).bfloat16()
        if op == "counts":
            counts = torch.zeros(preset.num_experts, device="cuda", dtype=torch.int32)
            return lambda: moeext.biased_grouped_topk(logits, bias, *rest, expert_counts=counts)
        return lambda: moeext.biased_grouped_topk(logits, bias, *rest)
    x = torch.randn(num_tokens, HIDDEN, device="cuda", generator=g).bfloat16()
    w = (0.02 * torch.randn(preset.num_experts, HIDDEN, device="cuda", generator=g)).bfloat16()
    if op == "gemm":
        return lambda: moeext.router_gemm(x, w)
    return with_switch(moeext._C._set_gpu_fused_router_variant, 1,
                       lambda: moeext.fused_router(x, w, bias, *rest))


def parse_cases(text):
    names = list(CASES) if text is None else [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown or not names:
        raise SystemExit(f"--cases: unknown case(s) {unknown or text!r}; "
                         f"known: {', '.join(CASES)}")
    return names


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    args = parser.parse_args(argv)
    names = parse_cases(args.cases)
    if args.list:
        for name in names:
            op, preset, tokens, variant = CASES[name]
            print(f"{name}: {op} {preset} T={tokens}" + (f" variant {variant}" if variant else ""))
        return 0

    import torch
    import moeext
    from moeext.presets import PRESETS

    if not torch.cuda.is_available() or "cuda" not in moeext.build_info()["backends"]:
        print("profile_cuda: needs a CUDA GPU and a moeext built with CUDA", file=sys.stderr)
        return 2
    for name in names:
        op, preset, tokens, variant = CASES[name]
        call = with_switch(moeext._C._set_gpu_routing_variant, variant,
                           case_call(torch, moeext, PRESETS[preset], op, tokens))
        for _ in range(WARMUP_CALLS):
            call()
        torch.cuda.synchronize()
        print(f"profiled: {name}", flush=True)
        torch.cuda.nvtx.range_push(RANGE)
        call()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
