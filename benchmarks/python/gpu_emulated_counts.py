"""The warp collectives the GPU routing kernel spends per token, per variant, counted on the
host: tests/gpu_emulation/'s CUDA sm_90 build (the code an H200 runs) routes the same tokens
with each variant of moeext/common.h (gpu_routing_variant) and counts, per warp, the shuffles,
the whole-warp reductions (redux.sync), the ballots and the warp barriers it made.

These are counts, not time: on a GPU a shuffle's latency, and how many are in flight at once,
decide what they cost. They say which variant does fewer of the argmax rounds' dependent warp
operations, and that its bits are the same; only a GPU run (bench_cuda.py --only
routing_variant) can say which is faster.

    python benchmarks/python/gpu_emulated_counts.py [--tokens 64] [--build DIR]
"""

import argparse
import pathlib
import sys
import tempfile

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gpu_emulation"))

import prepare  # noqa: E402 (tests/gpu_emulation/prepare.py)
from ops import route  # noqa: E402 (tests/gpu_emulation/ops.py)
from moeext.presets import PRESETS  # noqa: E402

PRESET_NAMES = ["deepseek-v3", "kimi-k2", "glm-4.5", "deepseek-v4-pro", "nemotron-style"]
VARIANTS = 3
KINDS = ["shuffles", "gathers", "ballots", "warp_syncs"]


def rows(emu, num_tokens):
    for name in PRESET_NAMES:
        p = PRESETS[name]
        g = torch.Generator().manual_seed(0)
        logits = (2 * torch.randn(num_tokens, p.num_experts, generator=g)).bfloat16()
        bias = (2 + 0.05 * torch.randn(p.num_experts, generator=g)) if p.has_bias else None
        first = None
        for variant in range(VARIANTS):
            emu.configure(0, 1, 132, variant, 0, 0, False)
            emu.take_counts()
            out = route(emu, logits, bias, p.op_kwargs())
            counts = emu.take_counts()
            if first is None:
                first = out
            same = all(torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                                   b.view(torch.int32) if b.dtype == torch.float32 else b)
                       for a, b in zip(out, first))
            yield name, variant, {k: counts[k] / num_tokens for k in KINDS}, same
    emu.configure(0, 1, 132, 0, 0, 0, False)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--build", default=str(pathlib.Path(tempfile.gettempdir())
                                               / "moeext-gpu-emulation"))
    args = parser.parse_args()
    emu = prepare.load(args.build, "cuda")
    print(f"Warp collectives per token, routing kernel, emulated CUDA sm_90 build, "
          f"{args.tokens} tokens of bf16 logits, fp32 bias\n")
    print("| preset | variant | shuffles | redux | ballots | warp syncs | all | bits as 0 |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, variant, per_token, same in rows(emu, args.tokens):
        total = sum(per_token.values())
        cells = " | ".join(f"{per_token[k]:.1f}" for k in KINDS)
        print(f"| {name} | {variant} | {cells} | {total:.1f} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
