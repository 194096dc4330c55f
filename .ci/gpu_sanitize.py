"""Every CUDA kernel of moeext once or a few times, on odd and strided shapes, each result
checked against moeext.reference: the program compute-sanitizer runs (memcheck, racecheck)
in .ci/gpu_device_check.sh. Small on purpose: under the sanitizer each launch is slow.
"""

import sys

import torch

import moeext
import moeext.reference as ref
from moeext.presets import PRESETS

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"  # "cpu" to try the script itself
g = torch.Generator(device=dev).manual_seed(0)


def check(name, ok):
    if not ok:
        raise SystemExit(f"MISMATCH: {name}")
    print(f"ok {name}", flush=True)


# Routing: every preset, an odd T, logits as a column slice of a wider buffer, the _out form
# into the first columns of a wider persistent buffer, and every logits/bias dtype pair once.
for name, p in PRESETS.items():
    T = 37
    wide = torch.randn(T, p.num_experts + 5, device=dev, generator=g).bfloat16()
    logits = wide[:, 3:3 + p.num_experts]
    bias = (torch.randn(p.num_experts, device=dev, generator=g) * 0.1) if p.has_bias else None
    args = (p.num_expert_group, p.topk_group, p.topk, p.renormalize, p.routed_scaling_factor,
            p.scoring_func)
    w, i = moeext.biased_grouped_topk(logits, bias, *args)
    rw, ri = ref.biased_grouped_topk(logits, bias, *args)
    check(f"routing {name}", torch.equal(i, ri) and torch.allclose(w, rw, rtol=2e-5, atol=1e-6))
    out_w = torch.full((T, p.topk + 3), -7.0, device=dev)
    out_i = torch.full((T, p.topk + 3), -7, dtype=torch.int32, device=dev)
    moeext.biased_grouped_topk_out(logits, bias, out_w[:, :p.topk], out_i[:, :p.topk],
                                   p.num_expert_group, p.topk_group, p.renormalize,
                                   p.routed_scaling_factor, p.scoring_func)
    check(f"routing _out {name}", torch.equal(out_i[:, :p.topk], ri)
          and bool((out_w[:, p.topk:] == -7).all()) and bool((out_i[:, p.topk:] == -7).all()))
for ldt in (torch.float32, torch.float16, torch.bfloat16):
    for bdt in (torch.float32, torch.float16, torch.bfloat16):
        logits = torch.randn(5, 256, device=dev, generator=g).to(ldt)
        bias = torch.randn(256, device=dev, generator=g).to(bdt)
        w, i = moeext.biased_grouped_topk(logits, bias, 8, 4, 8)
        rw, ri = ref.biased_grouped_topk(logits, bias, 8, 4, 8)
        check(f"routing {ldt} / {bdt}", torch.equal(i, ri))
big = torch.randn(3, 1024, device=dev, generator=g)
w, i = moeext.biased_grouped_topk(big, None, 1, 1, 32, scoring_func="softmax")
check("routing E=1024 topk=32", torch.equal(i, ref.biased_grouped_topk(
    big, None, 1, 1, 32, scoring_func="softmax")[1]))

# Router GEMM: odd T and H, a row-strided x, both output dtypes.
for T, H, E in ((1, 7168, 256), (5, 7168, 384), (33, 2880, 128), (130, 1000, 72)):
    xw = torch.randn(T, H + 8, device=dev, generator=g).bfloat16()
    x = xw[:, :H]
    wt = (0.05 * torch.randn(E, H, device=dev, generator=g)).bfloat16()
    for out_dtype in (torch.float32, torch.bfloat16):
        got = moeext.router_gemm(x, wt, out_dtype)
        want = ref.router_gemm(x, wt, out_dtype)
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        check(f"router_gemm T={T} H={H} E={E} {out_dtype} (rel err {err:.1e})",
              err < (1e-5 if out_dtype == torch.float32 else 1e-2))

# Tail zeroing: a shrinking tail, a growing one (nothing written), the tracked form.
buf = torch.arange(1, 10_001, dtype=torch.int32, device=dev).view(1000, 10)
moeext.zero_tail_(buf, 613, 997)
check("zero_tail_", bool((buf[613:997] == 0).all()) and bool((buf[:613] != 0).all())
      and bool((buf[997:] != 0).all()))
state = torch.tensor([1000], dtype=torch.int64, device=dev)
moeext.zero_tail_tracked_(buf, state, 17)
check("zero_tail_tracked_", bool((buf[17:] == 0).all()) and int(state) == 17)

# Shuffles: a batched, strided weight, gate_up, and the scales with padding.
wb = torch.randint(0, 256, (3, 64, 96 + 16), dtype=torch.uint8, device=dev,
                   generator=g)[:, :, :96]
for gate_up in (False, True):
    s = moeext.shuffle_weight(wb, gate_up=gate_up)
    check(f"shuffle_weight gate_up={gate_up}",
          torch.equal(s, ref.shuffle_weight(wb, gate_up=gate_up))
          and torch.equal(moeext.unshuffle_weight(s, gate_up=gate_up), wb))
sc = torch.randint(100, 140, (3 * 96, 13), dtype=torch.uint8, device=dev, generator=g)
for gate_up in (False, True):
    kw = dict(gate_up=gate_up, num_experts=3 if gate_up else None)
    s = moeext.e8m0_shuffle(sc, **kw)
    check(f"e8m0_shuffle gate_up={gate_up}",
          torch.equal(s, ref.e8m0_shuffle(sc, **kw))
          and torch.equal(moeext.e8m0_unshuffle(s, *sc.shape, **kw), sc))
if dev != "cpu":
    torch.cuda.synchronize()
print("all ok")
