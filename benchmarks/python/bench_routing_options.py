"""The routing options (docs/SPEC.md section 6) against the post-processing engines run today.

For each preset and number of tokens, the median latency of ``moeext.biased_grouped_topk``
with each option (fused shared experts, an expert map, per-expert counts, a routed-ids record,
all of them with a valid-row count) against the plain call followed by what an engine does
in PyTorch for the same result (``torch.cat`` of the shared columns, an index through the map,
``bincount`` added to the counts, a copy into the record), measured in the same process. A row
"all options vs plain" gives the plain call as the baseline: its speed-up is the options'
overhead (docs/SPEC.md: at most 1.15x the plain time at T = 4096). Also ``routing_weights``
against the pure-PyTorch weights of given ids.

    python benchmarks/python/bench_routing_options.py [--quick] [--presets a,b] [--tokens 1,16]
"""

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from common import Row, machine_line, median_seconds  # noqa: E402
import moeext  # noqa: E402
from moeext import reference  # noqa: E402
from moeext.presets import PRESETS  # noqa: E402

TOKENS = [1, 16, 4096]
SHARED = 1


def _inputs(preset, num_tokens):
    p = PRESETS[preset]
    g = torch.Generator().manual_seed(num_tokens)
    logits = torch.randn(num_tokens, p.num_experts, generator=g).bfloat16()
    bias = (2 + 0.05 * torch.randn(p.num_experts, generator=g)) if p.has_bias else None
    maps = {shared: moeext.nn.expert_parallel_map(p.num_experts, 1, 4,
                                                  num_fused_shared_experts=shared)
            for shared in (0, SHARED)}
    return p, logits, bias, maps


def _torch_post_processing(p, weights, ids, option, buffers):
    """What an engine does after a plain routing call, for `option`."""
    num_tokens = ids.shape[0]
    if option in ("shared", "all"):
        shared_ids = torch.arange(p.num_experts, p.num_experts + SHARED, dtype=ids.dtype)
        ids = torch.cat([ids, shared_ids.expand(num_tokens, -1)], dim=1)
        weights = torch.cat([weights, weights.new_ones(num_tokens, SHARED)], dim=1)
    if option in ("counts", "all"):
        buffers["counts"] += torch.bincount(ids[:, :p.topk].reshape(-1), minlength=p.num_experts)
    if option in ("record", "all"):
        buffers["record"][:num_tokens].copy_(ids[:, :p.topk])
    if option in ("map", "all"):
        ids = buffers["maps"][SHARED if option == "all" else 0][ids.long()]
    return weights, ids


def _fused_kwargs(option, buffers, num_tokens):
    kw = {}
    if option in ("shared", "all"):
        kw["num_fused_shared_experts"] = SHARED
    if option in ("map", "all"):
        kw["expert_map"] = buffers["maps"][SHARED if option == "all" else 0]
    if option in ("counts", "all"):
        kw["expert_counts"] = buffers["counts"]
    if option in ("record", "all"):
        kw["routed_experts"] = buffers["record"]
    if option == "all":
        kw["num_valid_tokens"] = torch.tensor([num_tokens])
    return kw


def rows(quick=False, presets=None, tokens=None):
    presets = presets or (["deepseek-v3"] if quick else ["deepseek-v3", "kimi-k2"])
    tokens = tokens or ([1, 64] if quick else TOKENS)
    min_time = 0.05 if quick else 0.3
    for name in presets:
        for num_tokens in tokens:
            p, logits, bias, maps = _inputs(name, num_tokens)
            kw = p.op_kwargs()
            buffers = {"maps": maps,
                       "counts": torch.zeros(p.num_experts, dtype=torch.int64),
                       "record": torch.zeros(max(tokens), p.topk, dtype=torch.int32)}

            def plain():
                return moeext.biased_grouped_topk(logits, bias, **kw)

            t_plain = median_seconds(plain, min_time)
            for option in ("shared", "map", "counts", "record", "all"):
                fused = _fused_kwargs(option, buffers, num_tokens)
                got = moeext.biased_grouped_topk(logits, bias, **kw, **fused)
                expected = _torch_post_processing(p, *plain(), option, dict(buffers))
                assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
                t_fused = median_seconds(
                    lambda: moeext.biased_grouped_topk(logits, bias, **kw, **fused), min_time)
                t_post = median_seconds(
                    lambda: _torch_post_processing(p, *plain(), option, buffers), min_time)
                yield Row("routing options", f"{name} T={num_tokens} {option}", t_fused,
                          "plain + torch post-processing", t_post, x=num_tokens)
                if option == "all":
                    yield Row("routing options", f"{name} T={num_tokens} all vs plain", t_fused,
                              "moeext plain", t_plain, x=num_tokens)
            # Replay: the weights of recorded ids.
            _, ids = plain()
            args = (logits, ids, p.renormalize, p.routed_scaling_factor, p.scoring_func)
            t_replay = median_seconds(lambda: moeext.routing_weights(*args), min_time)
            t_torch = median_seconds(lambda: reference.routing_weights(*args), min_time)
            yield Row("routing_weights", f"{name} T={num_tokens}", t_replay,
                      "moeext.reference", t_torch, x=num_tokens)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one preset, small T (CI smoke)")
    parser.add_argument("--presets", default=None, help="comma-separated preset names")
    parser.add_argument("--tokens", default=None, help="comma-separated token counts")
    args = parser.parse_args(argv)
    presets = args.presets.split(",") if args.presets else None
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else None
    print(f"# routing options, bf16 logits, fp32 bias — {machine_line()}")
    for row in rows(args.quick, presets, tokens):
        print(row.line(), flush=True)


if __name__ == "__main__":
    main()
