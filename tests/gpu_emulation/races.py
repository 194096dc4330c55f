"""The GPU kernels under ThreadSanitizer: ``python races.py BUILD_ROOT FLAVOUR``.

prepare.py's race build instruments every kernel, and the runtime tells ThreadSanitizer what a
GPU orders (runtime.cpp: launches, block barriers, warp syncs; not shuffles, ballots or relaxed
atomics). A read and a write of the same memory by two threads of a block that nothing of that
kind orders is then reported, whatever the values: the missing warp sync before a warp's lanes
overwrite shared data the others still read, which no result can show on the host. Races
between blocks are not looked for.

It runs each kernel the GPU binding launches (routing variants 0-2 and 4-8, with and without
the routing options, and variant 3 with them; the router GEMM's variants; the fused router's
GEMM and count variants; routing_weights) on shapes that take each of its paths, with
ThreadSanitizer's runtime preloaded (tests/test_gpu_emulation.py: LD_PRELOAD, halt_on_error).
It prints a line per kernel and exits 0 when nothing was reported. Names after FLAVOUR
(routing, router_gemm, fused_router, routing_weights) run those checks only.
"""

import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import prepare  # noqa: E402
from ops import SCORING, EmulatedOps  # noqa: E402

from moeext.presets import PRESETS  # noqa: E402

MULTIPROCESSORS = 132

# (experts, groups, groups kept, topk): beyond the presets, the paths they do not take: group
# scores from shared memory, the general kernel (more than 1024 experts, topk above 32).
TOPOLOGIES = [(120, 5, 2, 6), (96, 3, 1, 4), (2048, 16, 4, 8), (96, 1, 1, 40)]
PRESET_NAMES = ("deepseek-v3", "kimi-k2", "deepseek-v4-pro", "nemotron-style", "deepseek-v2")


def _configure(module, routing=0, gemm=0, fused=0, order=0, pdl=False):
    module.configure(order, 1, MULTIPROCESSORS, routing, gemm, fused, pdl)


def _routing_problems():
    for name in PRESET_NAMES:
        k = PRESETS[name].op_kwargs()
        yield name, PRESETS[name].num_experts, PRESETS[name].has_bias, k
    for experts, groups, kept, topk in TOPOLOGIES:
        k = dict(num_expert_group=groups, topk_group=kept, topk=topk, renormalize=True,
                 routed_scaling_factor=1.0, scoring_func="sigmoid")
        yield f"{experts}x{groups}/{kept}-top{topk}", experts, True, k


def _options(num_experts, num_tokens, topk, counts_dtype, record_dtype):
    """Every routing option (SPEC section 6): a shared expert, an expert-parallel map that keeps
    every other expert, counts, a record with spare rows, and one token left invalid."""
    expert_map = torch.full((num_experts + 1,), -1, dtype=torch.int32)
    expert_map[1::2] = torch.arange(expert_map[1::2].numel(), dtype=torch.int32)
    return dict(num_fused_shared_experts=1, shared_expert_weight=0.5, expert_map=expert_map,
                expert_counts=torch.zeros(num_experts, dtype=counts_dtype),
                routed_experts=torch.zeros(num_tokens + 3, topk, dtype=record_dtype),
                num_valid_tokens=torch.tensor([max(num_tokens - 1, 0)], dtype=torch.int32))


def routing(module, ops):
    for name, experts, has_bias, k in _routing_problems():
        for num_tokens in (1, 140):  # 140: two warps a block
            g = torch.Generator().manual_seed(num_tokens)
            logits = (2 * torch.randn(num_tokens, experts, generator=g)).to(torch.bfloat16)
            logits[num_tokens // 2, : experts // 2] = 0.5  # a row of ties
            bias = (2 + 0.05 * torch.randn(experts, generator=g)) if has_bias else None
            for variant in (0, 1, 2, 4, 5, 6, 7, 8):
                _configure(module, routing=variant, order=variant % 3, pdl=variant == 1)
                ops.biased_grouped_topk(logits, bias, **k)
            # Options: the current kernel, and variant 3 (the gate's own instance with them).
            for variant in (0, 3):
                options = _options(experts, num_tokens, k["topk"],
                                   torch.int64 if num_tokens > 1 else torch.int32, torch.int16)
                _configure(module, routing=variant, order=variant % 3)
                ops.biased_grouped_topk(logits.float(), bias, **k, **options)
        print(f"routing {name}: variants 0-2 and 4-8, options in variants 0 and 3",
              flush=True)


def router_gemm(module, ops):
    for num_tokens, experts, hidden in ((1, 256, 7168), (4, 384, 2056), (16, 72, 264)):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            g = torch.Generator().manual_seed(num_tokens)
            x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
            w = (0.05 * torch.randn(experts, hidden, generator=g)).to(dtype)
            for variant in (0, 1, 2, 3):
                _configure(module, gemm=variant, order=variant % 3)
                out = torch.empty(num_tokens, experts)
                assert module.router_gemm(x, w, out), "the small-T kernel takes this GEMM"
        print(f"router GEMM T={num_tokens} E={experts} H={hidden}: variants 0-3", flush=True)


def fused_router(module, ops):
    for name in ("deepseek-v3", "kimi-k2", "deepseek-v2"):
        p = PRESETS[name]
        k = p.op_kwargs()
        # At 16 tokens the last block's 8 warps route two each (Kimi-K2's 384 experts take
        # the two kernels there, more blocks than a wave).
        for num_tokens in (1, 8) if name == "kimi-k2" else (1, 16):
            g = torch.Generator().manual_seed(num_tokens)
            x = torch.randn(num_tokens, 1032, generator=g).bfloat16()
            w = (0.05 * torch.randn(p.num_experts, 1032, generator=g)).bfloat16()
            bias = (2 + 0.05 * torch.randn(p.num_experts, generator=g)) if p.has_bias else None
            # Fused router variants 1-3: the one launch, counting either way, and the gate's own
            # routing, one token by the whole last block (0 runs the two kernels, which the
            # checks above cover).
            for gemm in (0, 1):
                for count in (1, 2, 3):
                    _configure(module, gemm=gemm, fused=count, order=gemm + count - 1,
                               pdl=count == 2)
                    before = ops.launches
                    ops.fused_router(x, w, bias, **k)
                    assert ops.launches == before + 1
            options = _options(p.num_experts, num_tokens, k["topk"], torch.int32, torch.int32)
            _configure(module, fused=1)
            before = ops.launches
            ops.fused_router(x, w, bias, **k, **options, return_logits=True)
            assert ops.launches == before + 1
        print(f"fused router {name}: the one launch, GEMM and fused variants, options",
              flush=True)


def routing_weights(module, ops):
    logits = torch.randn(37, 256)
    ids = torch.stack([torch.randperm(256)[:8] for _ in range(37)]).int()
    for scoring in SCORING:
        ops.routing_weights(logits, ids, True, 2.5, scoring)
    ids[3, 1] = ids[3, 0]  # a repeated id: the kernel flags it for the binding's error
    try:
        module.routing_weights(logits, ids, torch.empty(37, 8), True, 1.0, 0)
    except RuntimeError:
        pass
    print("routing_weights", flush=True)


def main(build_root, flavour, checks):
    # ThreadSanitizer is already in this process; the compiler and ninja run without it.
    os.environ.pop("LD_PRELOAD", None)
    torch.set_num_threads(1)  # torch's own threads are not instrumented
    module = prepare.load(build_root, flavour, races=True)
    ops = EmulatedOps(module)
    for check in checks or (routing, router_gemm, fused_router, routing_weights):
        start = time.perf_counter()
        check(module, ops)
        print(f"  {time.perf_counter() - start:.0f} s", flush=True)
    print(f"no data race in {ops.launches} launches")


if __name__ == "__main__":
    # Optionally the names of the checks to run (routing, router_gemm, ...): all by default.
    main(sys.argv[1], sys.argv[2], [globals()[name] for name in sys.argv[3:]])
