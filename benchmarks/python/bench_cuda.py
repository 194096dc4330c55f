"""Every moeext op on a CUDA GPU, against what engines run there today, in one process.

Two times per function, both medians:

  graph   device time per call: the calls captured back to back into one CUDA graph (so
          no launch gaps from the host), replayed, timed with CUDA events. Where one input
          set fits in L2, the graph cycles through several, so large cases read memory,
          not the cache.
  eager   wall time per call launched from Python one after another, the device synced
          once per batch: at small sizes this is the host's launch cost.

Launch modes, compared mode for mode: moeext's decode-path ops (routing, router GEMM, fused
router) are timed with programmatic dependent launch (PDL, moeext.set_programmatic_dependent_launch)
off and, where this GPU and build support it (sm_90+ code on a device of compute capability
9.0+), on; each row names the mode moeext ran in. A baseline launched plainly (torch, cuBLAS,
FlashInfer no-pdl, moeext's own two-call composition with PDL off) is compared with moeext
PDL off, one launched with PDL (FlashInfer pdl, the composition with PDL on) with moeext PDL
on; the vLLM and SGLang kernels launch as their engines decide (vLLM's with PDL on sm_90+ at
decode sizes in the sources read), which cannot be switched from their Python APIs, so they
get a row in each mode. A row "moeext no-pdl" shows what PDL alone changes. In the graph
times, calls are captured back to back, so PDL overlaps each call's launch with the previous
call's tail; a kernel of another library between two moeext calls would change that.
--pdl off (or on) times one mode only.

Baselines, measured in the same run on the same inputs:
  biased_grouped_topk  the pure-PyTorch grouped_topk (vLLM's CPU formulation, in
                       benchmarks/python/baselines.py), eager: the engines' fallback where
                       no fused kernel takes the shape, not their fused CUDA kernels
  routing +<option>    plain biased_grouped_topk: each option of docs/SPEC.md §6 alone, and all
                       of them (issue #52's overhead)
  routing variant N    the current routing warp kernel: each variant kept beside it for A/B
                       (moeext::gpu_routing_variant), checked bit for bit first, PDL off
  routing +<option> variant 3
                       the same call with the current kernel's generic options instance:
                       variant 3 runs the gate's own instance with the options, checked bit
                       for bit first, PDL off
  routing anatomy      the current kernel's full DeepSeek-V3 call at T=1, against the same
                       call with fewer rounds, no groups, no bias, fp32 logits, and an empty
                       launch: where a decode token's time goes
  <op> gemm variant N  router_gemm, and fused_router's one launch, with the current router
                       GEMM kernel: each variant (moeext::gpu_router_gemm_variant), checked bit
                       for bit first, in each launch mode
  fused_router variant N
                       fused_router as it runs now (the two kernels): the one launch, counting
                       its blocks with fences (1) or one acquire-release atomic (2), or as 2
                       with a gate's own routing, a single token by the whole last block (3)
                       (moeext::gpu_fused_router_variant), likewise
  router_gemm          F.linear in bf16 (cuBLAS, bf16 logits), F.linear on fp32 copies of
                       x and w (the upcast vLLM does for fp32 router logits), and
                       torch.mm(..., out_dtype=float32) where this torch has it
  fused_router         the two calls it fuses (router_gemm then biased_grouped_topk), and
                       router_gemm alone
  fused_router_out     router_gemm then biased_grouped_topk_out into the same kept buffers,
                       and router_gemm alone
  zero_tail_           the full fill_(0) it replaces
  shuffles             AITER's view/permute/contiguous formulations (baselines.py, one
                       copy each), and a clone() of the same bytes (the bandwidth bound)

The engines' own fused kernels, where their packages import (engine_kernels.py; the header
names each package that does not, and it gives no rows):
  biased_grouped_topk  vllm._custom_ops.grouped_topk, flashinfer's fused_topk_deepseek
                       (NoAuxTc) with and without PDL, sgl_kernel.moe_fused_gate
  router_gemm fp32     vllm._custom_ops.dsv3_router_gemm (1 to 16 tokens)
  fused_router         vLLM's router GEMM then FlashInfer's routing (else vLLM's), back to
                       back in one timed call
Each is called once on the case's first input set and checked against moeext (expert sets
per row, weights within a tolerance; logits within a tolerance) before it is timed: a
disagreement is printed and its row is marked MISMATCH. A kernel that does not take a case
is skipped, its reason printed once. FlashInfer may JIT-compile its kernel on first use.
--no-engines leaves them out.

    python benchmarks/python/bench_cuda.py [--quick] [--only grouped_topk,...] [--markdown]
                                           [--tokens 9,12,15] [--no-engines]
                                           [--pdl both|off|on]
"""

import argparse
import contextlib
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from baselines import aiter_e8m0_shuffle, aiter_shuffle_weight  # noqa: E402
from baselines import check_shuffle_baselines, torch_native_grouped_topk  # noqa: E402
from engine_kernels import Engines, logits_mismatch, routing_mismatch  # noqa: E402
import moeext  # noqa: E402
import moeext.reference  # noqa: E402
from moeext.presets import PRESETS  # noqa: E402

L2_SPAN = 256 << 20  # bytes of distinct inputs a graph cycles through, well over any L2
CALLS_PER_GRAPH = 64
# The launch modes moeext's decode-path ops are timed in (main() narrows it to what the GPU
# and build support and --pdl asks for).
MODES = ["no-pdl", "pdl"]


def graph_us(make_calls, reps=15, calls_per_graph=CALLS_PER_GRAPH):
    """Median device microseconds per call. ``make_calls()`` returns one zero-argument
    callable per input set; they are captured round-robin into one graph, about
    ``calls_per_graph`` calls in all."""
    calls = make_calls()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(side)
    rounds = max(1, calls_per_graph // len(calls))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for call in calls:
                call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (rounds * len(calls)))
    del graph
    return statistics.median(times)


def eager_us(make_calls, reps=15, batch=50):
    """Median wall microseconds per call launched eagerly, one sync per batch."""
    calls = make_calls()
    for call in calls:
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for i in range(batch):
            calls[i % len(calls)]()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6 / batch)
    return statistics.median(times)


def input_sets(nbytes):
    return max(1, min(16, L2_SPAN // max(nbytes, 1)))


class Table:
    def __init__(self):
        self.rows = []

    def add(self, op, case, ours, baseline, theirs, mode="no-pdl"):
        """ours: {mode: (graph_us, eager_us)}, moeext in each mode it was timed in; theirs:
        (graph_us, eager_us) of the baseline, launched in ``mode`` ("no-pdl", "pdl", or None
        where the baseline's engine decides: then a row for each of moeext's modes). No row
        where moeext was not timed in the baseline's mode."""
        for m in ours:
            if mode not in (None, m):
                continue
            mine = ours[m]
            self.rows.append((op, case, m, mine, baseline, theirs))
            print(f"{op:20s} {case:30s} moeext {m:6s} {mine[0]:9.2f} / {mine[1]:8.2f} us   "
                  f"{baseline:28s} {theirs[0]:9.2f} / {theirs[1]:8.2f} us   "
                  f"x{theirs[0] / mine[0]:6.2f} graph  x{theirs[1] / mine[1]:6.2f} eager",
                  flush=True)

    def markdown(self):
        lines = ["| op | case | moeext mode | moeext graph (us) | moeext eager (us) | baseline | "
                 "baseline graph (us) | baseline eager (us) | speed-up graph | speed-up eager |",
                 "|---|---|---|---:|---:|---|---:|---:|---:|---:|"]
        for op, case, mode, ours, baseline, theirs in self.rows:
            lines.append(f"| {op} | {case} | {mode} | {ours[0]:.2f} | {ours[1]:.2f} | "
                         f"{baseline} | {theirs[0]:.2f} | {theirs[1]:.2f} | "
                         f"{theirs[0] / ours[0]:.1f}x | {theirs[1] / ours[1]:.1f}x |")
        return "\n".join(lines)


def both(make_calls, calls_per_graph=CALLS_PER_GRAPH, batch=50):
    return (graph_us(make_calls, calls_per_graph=calls_per_graph),
            eager_us(make_calls, batch=batch))


@contextlib.contextmanager
def launch_mode(mode):
    previous = moeext.set_programmatic_dependent_launch(mode == "pdl")
    try:
        yield
    finally:
        moeext.set_programmatic_dependent_launch(previous)


def per_mode(make_calls, **kwargs):
    """moeext's calls timed in each of MODES: {mode: (graph_us, eager_us)}. The mode is set
    while the graph is captured (it keeps it) and while the eager calls launch."""
    times = {}
    for mode in MODES:
        with launch_mode(mode):
            times[mode] = both(make_calls, **kwargs)
    return times


def pdl_alone(table, op, case, ours):
    """A row of moeext with PDL on against moeext with it off."""
    if "pdl" in ours and "no-pdl" in ours:
        table.add(op, case, ours, "moeext no-pdl", ours["no-pdl"], mode="pdl")


_skips_printed = set()


def engine_rows(table, op, case, ours, kernels, inputs, reference, mismatch):
    """Rows for the engines' kernels (engine_kernels.Kernel) on this case's input sets
    (tuples of arguments). Each is checked once against moeext's ``reference`` result on the
    first set before it is timed."""
    for kernel in kernels:
        if kernel.fn is None:
            if (kernel.label, kernel.skip) not in _skips_printed:
                _skips_printed.add((kernel.label, kernel.skip))
                print(f"# {kernel.label}: skipped, {kernel.skip}", flush=True)
            continue

        def calls(fn=kernel.fn):
            return [lambda args=args: fn(*args) for args in inputs]
        label = kernel.label
        try:
            differs = mismatch(reference, calls()[0]())
            if differs:
                print(f"# {label} on {case}: MISMATCH with moeext, {differs}", flush=True)
                label += " MISMATCH"
            times = both(calls)
        except Exception as exc:  # noqa: BLE001 -- one engine's failure must not end the run
            print(f"# {kernel.label} on {case}: not timed, {type(exc).__name__}: {exc}",
                  flush=True)
            continue
        mode = None if kernel.pdl is None else "pdl" if kernel.pdl else "no-pdl"
        table.add(op, case, ours, label, times, mode=mode)


def routing_args(p):
    """A preset's routing arguments after the logits and bias, positionally, as engines pass
    them."""
    return (p.num_expert_group, p.topk_group, p.topk, p.renormalize, p.routed_scaling_factor,
            p.scoring_func)


def mm_has_out_dtype():
    """Whether this torch's torch.mm takes out_dtype (cuBLAS bf16 x bf16 -> fp32)."""
    try:
        probe = torch.ones(2, 8, device="cuda", dtype=torch.bfloat16)
        torch.mm(probe, probe.t(), out_dtype=torch.float32)
    except (TypeError, RuntimeError):
        return False
    return True


def grouped_topk(table, quick, tokens=None, engines=None):
    presets = ["deepseek-v3", "kimi-k2"] if quick else list(PRESETS)
    tokens = tokens or ([1, 64] if quick else [1, 16, 64, 1024, 4096, 16384])
    for name in presets:
        p = PRESETS[name]
        for num_tokens in tokens:
            g = torch.Generator(device="cuda").manual_seed(num_tokens)
            sets = input_sets(num_tokens * p.num_experts * 2)
            logits = [torch.randn(num_tokens, p.num_experts, device="cuda", generator=g)
                      .bfloat16() for _ in range(sets)]
            bias = ((2 + 0.05 * torch.randn(p.num_experts, device="cuda", generator=g))
                    if p.has_bias else None)
            rest = routing_args(p)

            def calls(fn):
                return lambda: [lambda x=x: fn(x, bias, *rest) for x in logits]

            ours = per_mode(calls(moeext.biased_grouped_topk))
            case = f"{name} T={num_tokens}"
            pdl_alone(table, "biased_grouped_topk", case, ours)
            table.add("biased_grouped_topk", case, ours, "torch-native grouped_topk",
                      both(calls(torch_native_grouped_topk)))
            if engines is not None:
                engine_rows(table, "biased_grouped_topk", case, ours,
                            engines.routing(p, bias, logits[0].dtype), [(x,) for x in logits],
                            moeext.biased_grouped_topk(logits[0], bias, *rest), routing_mismatch)


def preset_cases(presets, tokens):
    """(name, preset, its routing arguments, a bias, num_tokens, a generator) for each preset
    and token count: the bias, and what the caller draws from the generator, are the same in
    every run."""
    for name in presets:
        p = PRESETS[name]
        rest = routing_args(p)
        g = torch.Generator(device="cuda").manual_seed(p.num_experts)
        bias = 2 + 0.05 * torch.randn(p.num_experts, device="cuda", generator=g)
        for num_tokens in tokens:
            yield name, p, rest, bias, num_tokens, g


def option_logits(p, num_tokens, g):
    sets = input_sets(num_tokens * p.num_experts * 2)
    return [torch.randn(num_tokens, p.num_experts, device="cuda", generator=g).bfloat16()
            for _ in range(sets)]


def option_sets(p, num_tokens):
    """{label: the keyword arguments of docs/SPEC.md §6's options}: each alone, then all."""
    counts = torch.zeros(p.num_experts, dtype=torch.int32, device="cuda")
    record = torch.empty(num_tokens, p.topk, dtype=torch.int16, device="cuda")
    valid = torch.tensor([num_tokens], dtype=torch.int32, device="cuda")
    return {
        "shared expert": dict(num_fused_shared_experts=1, shared_expert_weight=1.0),
        "expert map": dict(expert_map=moeext.nn.expert_parallel_map(p.num_experts, 0, 8).cuda()),
        "counts": dict(expert_counts=counts),
        "record": dict(routed_experts=record),
        "valid tokens": dict(num_valid_tokens=valid),
        "all options": dict(num_fused_shared_experts=1, shared_expert_weight=1.0,
                            expert_map=moeext.nn.expert_parallel_map(
                                p.num_experts, 0, 8, num_fused_shared_experts=1).cuda(),
                            expert_counts=counts, routed_experts=record, num_valid_tokens=valid),
    }


def routing_options(table, quick, tokens=None):
    """docs/SPEC.md §6's options on the GPU (issue #52): each one alone and all together,
    against plain routing in the same mode. Counts accumulate over the timed calls; the
    record has a row per token."""
    presets = ["deepseek-v3"] if quick else ["deepseek-v3", "kimi-k2"]
    tokens = tokens or ([1, 4096] if quick else [1, 64, 4096])
    for name, p, rest, bias, num_tokens, g in preset_cases(presets, tokens):
        logits = option_logits(p, num_tokens, g)
        options = option_sets(p, num_tokens)

        def calls(**kw):
            return lambda: [lambda x=x: moeext.biased_grouped_topk(x, bias, *rest, **kw)
                            for x in logits]

        case = f"{name} T={num_tokens}"
        plain = per_mode(calls())
        for label, kw in options.items():
            ours = per_mode(calls(**kw))
            for mode in MODES:
                table.add(f"routing +{label}", case, ours, "plain routing", plain[mode],
                          mode=mode)


# moeext::gpu_routing_variant's for plain calls, besides 0 (the current kernel), and the gates
# each differs on (None: every gate); 3 differs on calls with options only
# (routing_options_variant_ab).
ROUTING_VARIANTS = {1: None, 2: {"deepseek-v4-pro", "nemotron-style"},
                    4: {"deepseek-v3", "kimi-k2"}, 5: {"deepseek-v3", "kimi-k2"},
                    6: None, 7: {"deepseek-v3", "kimi-k2"}, 8: {"deepseek-v3", "kimi-k2"}}
ROUTER_GEMM_VARIANTS = [1, 2, 3]  # moeext::gpu_router_gemm_variant's, besides 0
# Those that change the fused router's one launch too (2 and 3 shape router_gemm's kernel only).
FUSED_GEMM_VARIANTS = [1]
FUSED_ROUTER_VARIANTS = [1, 2, 3]  # moeext::gpu_fused_router_variant's, besides 0


@contextlib.contextmanager
def kernel_variant(setter, variant):
    """One of the developers' A/B switches (moeext._C._set_gpu_*_variant) set to ``variant``."""
    previous = setter(variant)
    try:
        yield
    finally:
        setter(previous)


def routing_variant(variant):
    return kernel_variant(moeext._C._set_gpu_routing_variant, variant)


def router_gemm_variant(variant):
    return kernel_variant(moeext._C._set_gpu_router_gemm_variant, variant)


def fused_router_variant(variant):
    return kernel_variant(moeext._C._set_gpu_fused_router_variant, variant)


def same_results(a, b):
    """Bit for bit: a tensor, or the tensors of a tuple (None where both are None)."""
    if a is None or b is None:
        return a is b
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return len(a) == len(b) and all(same_results(x, y) for x, y in zip(a, b))


def variants_same(switch, variants, fn, inputs):
    """{variant: whether it gave variant 0's results on every input}."""
    same = {v: True for v in variants}
    for x in inputs:
        with switch(0):
            current = fn(x)
        for v in variants:
            with switch(v):
                same[v] &= same_results(current, fn(x))
    return same


def variants_timed(switch, variants, calls, mode):
    """{variant: (graph_us, eager_us)} in launch mode ``mode``, 0 included: graph times taken in
    alternation, three of each (medians), so a drift of the GPU's clock falls on all alike."""
    graphs = {v: [] for v in [0] + variants}
    times = {}
    with launch_mode(mode):
        for _ in range(3):
            for v in graphs:
                with switch(v):
                    graphs[v].append(graph_us(calls))
        for v in graphs:
            with switch(v):
                times[v] = (statistics.median(graphs[v]), eager_us(calls))
    return times


def variant_rows(table, label, case, same, times, mode, baseline):
    for v in same:
        table.add(f"{label} {v}" + ("" if same[v] else " MISMATCH"), case, {mode: times[v]},
                  baseline, times[0], mode=mode)


def routing_variant_ab(table, quick, tokens=None):
    """The routing warp kernel's variants (moeext::gpu_routing_variant) against the current
    kernel, PDL off, in the same process: each variant's results compared bit for bit with the
    current kernel's on every input set (and on rows of ties and NaN) before timing, then
    graph times taken in alternation, three of each, medians reported. A MISMATCH row means
    that variant must not land."""
    tokens = tokens or ([1, 4096, 16384] if quick else [1, 16, 64, 256, 1024, 4096, 16384])
    # The gates with an instance of their own in the kernel, then in variant 2 only. Each is
    # timed in the variants that route it otherwise than the current kernel.
    for name in ["deepseek-v3", "kimi-k2", "deepseek-v4-pro", "nemotron-style"]:
        p = PRESETS[name]
        rest = routing_args(p)
        variants = [v for v, gates in ROUTING_VARIANTS.items() if gates is None or name in gates]
        for dtype in [torch.bfloat16, torch.float32]:
            for num_tokens in tokens:
                g = torch.Generator(device="cuda").manual_seed(num_tokens)
                sets = input_sets(num_tokens * p.num_experts * dtype.itemsize)
                logits = [torch.randn(num_tokens, p.num_experts, device="cuda", generator=g)
                          .to(dtype) for _ in range(sets)]
                bias = 2 + 0.05 * torch.randn(p.num_experts, device="cuda", generator=g)
                odd = torch.zeros(3, p.num_experts, device="cuda", dtype=dtype)
                odd[1, ::3] = float("nan")
                odd[2, 5] = float("inf")

                def route(x):
                    return moeext.biased_grouped_topk(x, bias, *rest)

                same = variants_same(routing_variant, variants, route, logits + [odd])

                def calls():
                    return [lambda x=x: route(x) for x in logits]

                times = variants_timed(routing_variant, variants, calls, "no-pdl")
                dtype_name = str(dtype).replace("torch.", "")
                variant_rows(table, "routing variant", f"{name} {dtype_name} T={num_tokens}",
                             same, times, "no-pdl", "current warp kernel")


def routing_options_variant_ab(table, quick, tokens=None):
    """Routing variant 3 (a call with options of a gate with its own warp kernel instance runs
    that instance) against the current kernel's generic options instance, PDL off, as
    routing_variant_ab times the plain variants: the ids and weights compared bit for bit
    first (the counts and record accumulate; the tests compare those), each option alone and
    all together."""
    tokens = tokens or ([1, 4096] if quick else [1, 64, 4096, 16384])
    variants = [3]
    for name, p, rest, bias, num_tokens, g in preset_cases(["deepseek-v3", "kimi-k2"], tokens):
        logits = option_logits(p, num_tokens, g)
        odd = torch.zeros(3, p.num_experts, device="cuda", dtype=torch.bfloat16)
        odd[1, ::3] = float("nan")
        odd[2, 5] = float("inf")
        for label, kw in option_sets(p, num_tokens).items():
            if label == "valid tokens":
                continue  # alone it runs the plain instance, in every variant

            def route(x, kw=kw):
                return moeext.biased_grouped_topk(x, bias, *rest, **kw)

            same = variants_same(routing_variant, variants, route, logits[:1] + [odd])

            def calls(route=route):
                return [lambda x=x: route(x) for x in logits]

            times = variants_timed(routing_variant, variants, calls, "no-pdl")
            variant_rows(table, f"routing +{label} variant", f"{name} T={num_tokens}", same,
                         times, "no-pdl", "current options instance")


def routing_anatomy(table, quick, tokens=None):
    """Where a decode token's routing time goes: the current kernel at DeepSeek-V3's 256
    experts, T=1 unless --tokens says otherwise, PDL off, with fewer argmax rounds (topk), with
    and without the group stage, without the bias, with fp32 logits, and beside a kernel that
    does nothing but launch (a one-element fill). Each row against the full DeepSeek-V3 call
    timed in the same alternation; the slope over topk is one round's cost."""
    del quick
    p = PRESETS["deepseek-v3"]
    g = torch.Generator(device="cuda").manual_seed(7)
    bias = 2 + 0.05 * torch.randn(p.num_experts, device="cuda", generator=g)
    shapes = {"deepseek-v3": (8, 4, 8, bias)}
    for k in (1, 2, 4):
        shapes[f"topk {k}"] = (8, 4, k, bias)
    for k in (1, 8):
        shapes[f"no groups, topk {k}"] = (1, 1, k, bias)
    shapes["no bias"] = (8, 4, 8, None)
    for num_tokens in tokens or [1]:
        logits = torch.randn(num_tokens, p.num_experts, device="cuda", generator=g).bfloat16()
        wide = logits.float()
        one = torch.empty(1, device="cuda")
        calls = {name: (lambda x=logits, s=shape: [lambda: moeext.biased_grouped_topk(
                     x, s[3], s[0], s[1], s[2], True, p.routed_scaling_factor)])
                 for name, shape in shapes.items()}
        calls["fp32 logits"] = lambda: [lambda: moeext.biased_grouped_topk(
            wide, bias, 8, 4, 8, True, p.routed_scaling_factor)]
        calls["empty launch"] = lambda: [lambda: one.fill_(0.0)]
        graphs = {name: [] for name in calls}
        with launch_mode("no-pdl"):
            for _ in range(3):
                for name, make in calls.items():
                    graphs[name].append(graph_us(make))
            times = {name: (statistics.median(graphs[name]), eager_us(make))
                     for name, make in calls.items()}
        for name in calls:
            table.add(f"routing anatomy {name}", f"E=256 T={num_tokens}",
                      {"no-pdl": times[name]}, "deepseek-v3 8/4/8", times["deepseek-v3"])


def gate_cases(presets, tokens, hidden):
    """(name, preset, its routing arguments, a bias, num_tokens, input sets) for each preset's
    gate and token count; each input set is bf16 hidden states and a weight of its own (see
    router_gemm)."""
    for name, p, rest, bias, num_tokens, g in preset_cases(presets, tokens):
        sets = input_sets(num_tokens * hidden * 2 + p.num_experts * hidden * 2)
        xws = [(torch.randn(num_tokens, hidden, device="cuda", generator=g).bfloat16(),
                (0.02 * torch.randn(p.num_experts, hidden, device="cuda", generator=g))
                .bfloat16()) for _ in range(sets)]
        yield name, p, rest, bias, num_tokens, xws


def gate_variant_ab(table, quick, tokens, switch, variants, ops, label):
    """One A/B switch's variants against variant 0 in the ops ``ops(bias, rest)`` names, at
    DeepSeek-V3's and Kimi-K2's gates, in each launch mode: results compared bit for bit first
    on every input set, then graph times in alternation as for the routing variants. Each input
    set has its own weight (see router_gemm). A MISMATCH row means that variant must not land."""
    hidden = 7168
    tokens = tokens or ([1, 4, 16] if quick else [1, 2, 4, 8, 16])
    for name, _, rest, bias, num_tokens, xws in gate_cases(["deepseek-v3", "kimi-k2"], tokens,
                                                             hidden):
        for op, fn in ops(bias, rest).items():
            same = variants_same(switch, variants, fn, xws)

            def calls(fn=fn, xws=xws):
                return [lambda xw=xw: fn(xw) for xw in xws]

            for mode in MODES:
                times = variants_timed(switch, variants, calls, mode)
                variant_rows(table, f"{op} {label}", f"{name} H={hidden} T={num_tokens}",
                             same, times, mode, "current kernel")


def fused_router_call(bias, rest):
    return lambda xw: moeext.fused_router(*xw, bias, *rest)


def one_launch_call(bias, rest):
    """fused_router as its one launch (fused router variant 1), whatever the switch says."""
    def call(xw):
        with fused_router_variant(1):
            return moeext.fused_router(*xw, bias, *rest)
    return call


def router_gemm_variant_ab(table, quick, tokens=None):
    """The router GEMM's variants (moeext::gpu_router_gemm_variant) against the current kernel,
    in router_gemm, and those that change it in fused_router's one launch (the current kernel
    asks L2 for the weight before the grid wait where it launches with PDL, which lets that
    overlap the grid before; variant 1 never does, so the two differ with PDL only)."""
    gate_variant_ab(table, quick, tokens, router_gemm_variant, ROUTER_GEMM_VARIANTS,
                    lambda bias, rest: {"router_gemm": lambda xw: moeext.router_gemm(*xw)},
                    "gemm variant")
    gate_variant_ab(table, quick, tokens, router_gemm_variant, FUSED_GEMM_VARIANTS,
                    lambda bias, rest: {"fused_router": one_launch_call(bias, rest)},
                    "gemm variant")


def fused_router_variant_ab(table, quick, tokens=None):
    """The fused router's one launch (moeext::gpu_fused_router_variant 1: every thread fences
    before its block counts itself done; 2: thread 0 counts the block with one acquire-release
    atomic; 3: as 2, with the gate's own routing, a single token by the whole last block)
    against the two kernels plain calls run now."""
    gate_variant_ab(table, quick, tokens, fused_router_variant, FUSED_ROUTER_VARIANTS,
                    lambda bias, rest: {"fused_router": fused_router_call(bias, rest)},
                    "variant")


def router_gemm(table, quick, tokens=None, engines=None):
    """Each input set has its own weight too: in a model, the layers between two router GEMMs
    evict the gate from L2, so a call reads it from memory."""
    hidden = 7168
    experts = [256] if quick else [256, 384]
    tokens = tokens or ([1, 16] if quick else [1, 4, 8, 16, 64, 256, 1024, 4096])
    has_out_dtype = mm_has_out_dtype()
    for num_experts in experts:
        g = torch.Generator(device="cuda").manual_seed(num_experts)
        for num_tokens in tokens:
            sets = input_sets(num_tokens * hidden * 2 + num_experts * hidden * 6)
            xws = []
            for _ in range(sets):
                w = (0.02 * torch.randn(num_experts, hidden, device="cuda", generator=g))
                x = torch.randn(num_tokens, hidden, device="cuda", generator=g).bfloat16()
                xws.append((x, w.bfloat16(), w))

            def calls(fn):
                return lambda: [lambda xw=xw: fn(*xw) for xw in xws]

            case = f"E={num_experts} H={hidden} T={num_tokens}"
            ours = per_mode(calls(lambda x, w, w32: moeext.router_gemm(x, w)))
            pdl_alone(table, "router_gemm fp32", case, ours)
            linear_bf16 = both(calls(lambda x, w, w32: F.linear(x, w)))
            table.add("router_gemm fp32", case, ours, "F.linear bf16 (bf16 out)", linear_bf16)
            table.add("router_gemm fp32", case, ours, "F.linear fp32, w pre-upcast",
                      both(calls(lambda x, w, w32: F.linear(x.float(), w32))))
            if has_out_dtype:
                table.add("router_gemm fp32", case, ours, "torch.mm out_dtype=fp32",
                          both(calls(lambda x, w, w32: torch.mm(x, w.t(),
                                                                out_dtype=torch.float32))))
            if engines is not None:
                engine_rows(table, "router_gemm fp32", case, ours,
                            engines.router_gemm(num_experts, hidden, num_tokens),
                            [(x, w) for x, w, _ in xws], moeext.router_gemm(*xws[0][:2]),
                            logits_mismatch)
            table.add("router_gemm bf16", case,
                      per_mode(calls(lambda x, w, w32: moeext.router_gemm(x, w, torch.bfloat16))),
                      "F.linear bf16 (bf16 out)", linear_bf16)


def fused_router(table, quick, tokens=None, engines=None):
    """fused_router against the two calls it fuses (router_gemm then biased_grouped_topk) and
    router_gemm alone, at the gates of DeepSeek-V3 and Kimi-K2; each input set has its own
    weight (see router_gemm)."""
    hidden = 7168
    presets = ["deepseek-v3"] if quick else ["deepseek-v3", "kimi-k2"]
    tokens = tokens or ([1, 16] if quick else [1, 2, 4, 8, 16, 64])
    for name, p, rest, bias, num_tokens, xws in gate_cases(presets, tokens, hidden):
        for x, w in xws:
            fused = moeext.fused_router(x, w, bias, *rest)
            logits = moeext.router_gemm(x, w)
            pair = moeext.biased_grouped_topk(logits, bias, *rest)
            assert torch.equal(fused[0], pair[0]) and torch.equal(fused[1], pair[1])

        def calls(fn):
            return lambda: [lambda xw=xw: fn(*xw) for xw in xws]

        case = f"{name} H={hidden} T={num_tokens}"
        ours = per_mode(calls(lambda x, w: moeext.fused_router(x, w, bias, *rest)))
        pdl_alone(table, "fused_router", case, ours)
        # moeext's own calls, in the same mode as the fused one.
        pair = per_mode(calls(lambda x, w: moeext.biased_grouped_topk(
            moeext.router_gemm(x, w), bias, *rest)))
        gemm = per_mode(calls(lambda x, w: moeext.router_gemm(x, w)))
        for mode in MODES:
            table.add("fused_router", case, ours, "router_gemm + biased_grouped_topk",
                      pair[mode], mode=mode)
            table.add("fused_router", case, ours, "router_gemm alone", gemm[mode],
                      mode=mode)
        if engines is not None:
            engine_rows(table, "fused_router", case, ours,
                        engines.fused_pair(p, bias, hidden, num_tokens), xws,
                        moeext.fused_router(*xws[0], bias, *rest)[:2], routing_mismatch)
        # The out= forms into buffers kept across calls, as a decode step keeps them: no
        # allocation in either (eager time), the same kernels (graph time).
        weights = torch.empty(num_tokens, p.topk, device="cuda")
        ids = torch.empty(num_tokens, p.topk, dtype=torch.int32, device="cuda")
        out_rest = rest[:2] + rest[3:]
        moeext.fused_router_out(*xws[0], bias, weights, ids, *out_rest)
        expected = moeext.fused_router(*xws[0], bias, *rest)
        assert torch.equal(weights, expected[0]) and torch.equal(ids, expected[1])
        ours_out = per_mode(calls(lambda x, w: moeext.fused_router_out(
            x, w, bias, weights, ids, *out_rest)))
        pair_out = per_mode(calls(lambda x, w: moeext.biased_grouped_topk_out(
            moeext.router_gemm(x, w), bias, weights, ids, *out_rest)))
        for mode in MODES:
            table.add("fused_router_out", case, ours_out,
                      "router_gemm + biased_grouped_topk_out", pair_out[mode], mode=mode)
            table.add("fused_router_out", case, ours_out, "router_gemm alone", gemm[mode],
                      mode=mode)


def zero_tail(table, quick):
    mib = 16 if quick else 256
    n = mib * (1 << 20) // 4
    buf = torch.zeros(n, dtype=torch.int32, device="cuda")
    fill = both(lambda: [lambda: buf.fill_(0)])
    for tail in (0.0, 0.01, 0.10, 1.0):
        new_extent = n - int(n * tail)
        ours = {"no-pdl": both(lambda: [lambda: moeext.zero_tail_(buf, new_extent, n)])}
        table.add("zero_tail_", f"{mib} MiB int32, {tail:.0%} tail", ours, "full fill_(0)", fill)
    state = torch.zeros(1, dtype=torch.int64, device="cuda")
    ours = {"no-pdl": both(lambda: [lambda: moeext.zero_tail_tracked_(buf, state, 0)])}
    table.add("zero_tail_tracked_", f"{mib} MiB int32, no-op", ours, "full fill_(0)", fill)


# The shuffles allocate their output (up to 0.5 GB a call), as their baselines do.
BIG = dict(calls_per_graph=4, batch=8)


def shuffles(table, quick):
    experts = 4 if quick else 32
    n, k_bytes = 4096, 3584
    w = torch.randint(0, 256, (experts, n, k_bytes), dtype=torch.uint8, device="cuda")
    scales = torch.randint(100, 140, (experts * n, k_bytes * 2 // 32), dtype=torch.uint8,
                           device="cuda")
    check_shuffle_baselines(w, scales, experts)
    clone = both(lambda: [lambda: w.clone()], **BIG)
    for gate_up in (False, True):
        case = f"{experts}x[{n},{k_bytes}] B" + (" gate_up" if gate_up else "")
        ours = {"no-pdl": both(lambda: [lambda: moeext.shuffle_weight(w, gate_up=gate_up)],
                               **BIG)}
        table.add("shuffle_weight", case, ours, "AITER view/permute/contiguous",
                  both(lambda: [lambda: aiter_shuffle_weight(w, gate_up)], **BIG))
        table.add("shuffle_weight", case, ours, "clone() of the weight", clone)
    clone = both(lambda: [lambda: scales.clone()], **BIG)
    for gate_up in (False, True):
        kw = dict(gate_up=gate_up, num_experts=experts if gate_up else None)
        case = f"[{experts * n},224]" + (" gate_up" if gate_up else "")
        ours = {"no-pdl": both(lambda: [lambda: moeext.e8m0_shuffle(scales, **kw)], **BIG)}
        table.add("e8m0_shuffle", case, ours, "AITER view/permute/contiguous",
                  both(lambda: [lambda: aiter_e8m0_shuffle(scales, **kw)], **BIG))
        table.add("e8m0_shuffle", case, ours, "clone() of the scales", clone)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few, small cases")
    parser.add_argument("--only", default=None,
                        help="comma-separated: grouped_topk,routing_options,routing_variant,"
                             "routing_options_variant,routing_anatomy,"
                             "router_gemm_variant,fused_router_variant,router_gemm,"
                             "fused_router,zero_tail,shuffles")
    parser.add_argument("--markdown", action="store_true", help="also print a markdown table")
    parser.add_argument("--tokens", default=None, type=lambda s: [int(t) for t in s.split(",")],
                        help="comma-separated token counts for grouped_topk and router_gemm, "
                             "in place of their defaults (e.g. 9,12,15)")
    parser.add_argument("--no-engines", action="store_true",
                        help="leave out the engines' kernels (vllm, flashinfer, sgl_kernel)")
    parser.add_argument("--pdl", choices=("both", "off", "on"), default="both",
                        help="time moeext's decode-path ops with programmatic dependent launch "
                             "off, on, or both (default; on needs sm_90+)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or "cuda" not in moeext.build_info()["backends"]:
        raise SystemExit("bench_cuda.py needs a CUDA GPU and a moeext built with CUDA")
    torch.backends.cuda.matmul.allow_tf32 = False
    props = torch.cuda.get_device_properties(0)
    print(f"# moeext on {props.name} ({props.multi_processor_count} SMs), torch "
          f"{torch.__version__}, CUDA {torch.version.cuda}; graph / eager us per call")
    MODES[:] = {"both": ["no-pdl", "pdl"], "off": ["no-pdl"], "on": ["pdl"]}[args.pdl]
    if "pdl" in MODES and not moeext._C.programmatic_dependent_launch_supported():
        print("# pdl: this GPU or build runs no sm_90+ code, moeext is timed without PDL only")
        MODES[:] = ["no-pdl"]
    print(f"# moeext launch modes timed: {', '.join(MODES)}")
    only = set(args.only.split(",")) if args.only else None
    engines = None
    if not args.no_engines and (only is None
                                or only & {"grouped_topk", "router_gemm", "fused_router"}):
        engines = Engines()
        for line in engines.header_lines():
            print(line, flush=True)
        if not engines.modules:
            engines = None
    table = Table()
    suites = {"grouped_topk": lambda: grouped_topk(table, args.quick, args.tokens, engines),
              "routing_options": lambda: routing_options(table, args.quick, args.tokens),
              "routing_variant": lambda: routing_variant_ab(table, args.quick, args.tokens),
              "routing_options_variant": lambda: routing_options_variant_ab(
                  table, args.quick, args.tokens),
              "routing_anatomy": lambda: routing_anatomy(table, args.quick, args.tokens),
              "router_gemm_variant": lambda: router_gemm_variant_ab(table, args.quick,
                                                                    args.tokens),
              "fused_router_variant": lambda: fused_router_variant_ab(table, args.quick,
                                                                      args.tokens),
              "router_gemm": lambda: router_gemm(table, args.quick, args.tokens, engines),
              "fused_router": lambda: fused_router(table, args.quick, args.tokens, engines),
              "zero_tail": lambda: zero_tail(table, args.quick),
              "shuffles": lambda: shuffles(table, args.quick)}
    for name, run in suites.items():
        if only is None or name in only:
            run()
    if args.markdown:
        print()
        print(table.markdown())


if __name__ == "__main__":
    main()
