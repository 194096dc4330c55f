"""What engines run today, written out in plain PyTorch, for the benchmarks to compare with.

``torch_native_grouped_topk`` is vLLM's CPU ``grouped_topk`` (cpu_fused_moe.py), the route its
CPU backend takes, op for op: fp32 scores, topk-based and unsorted, the biased scores masked
to -inf outside the kept groups, a gather only where a bias is given, a plain division to
renormalise and a multiply only for a factor other than 1. sqrt-softplus scoring (DeepSeek-V4),
which vLLM's CPU path lacks, is the same chain with ``softplus().sqrt()`` as the score.

The shuffles are AITER's view/permute/contiguous formulations (``aiter.ops.shuffle``), one copy
each: ``shuffle_weight`` and, with ``gate_up``, ``shuffle_weight_a16w4``; ``e8m0_shuffle``
(after a first copy into a padded ``torch.empty``, so its pad bytes are whatever was there) and,
with ``gate_up``, ``shuffle_scale_a16w4``. Their valid bytes are moeext's (the benchmarks
check).
"""

import torch

import moeext
from moeext.reference import _as_storage_ints  # the tests' oracle views storage the same way


def torch_native_grouped_topk(
    gating_output,
    correction_bias,
    num_expert_group,
    topk_group,
    topk,
    renormalize=True,
    routed_scaling_factor=1.0,
    scoring_func="sigmoid",
):
    logits = gating_output.float()
    if scoring_func == "sigmoid":
        scores = logits.sigmoid()
    elif scoring_func == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring_func == "sqrtsoftplus":
        scores = torch.nn.functional.softplus(logits).sqrt()
    else:
        raise ValueError(scoring_func)
    num_tokens, num_experts = scores.shape
    if correction_bias is not None:
        biased = scores + correction_bias.unsqueeze(0)
        group_scores = (
            biased.view(num_tokens, num_expert_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        )
    else:
        biased = scores
        group_scores = biased.view(num_tokens, num_expert_group, -1).max(dim=-1).values
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (
        group_mask.unsqueeze(-1)
        .expand(num_tokens, num_expert_group, num_experts // num_expert_group)
        .reshape(num_tokens, -1)
    )
    masked = biased.masked_fill(~score_mask.bool(), float("-inf"))
    if correction_bias is not None:
        topk_ids = torch.topk(masked, k=topk, dim=-1, sorted=False)[1]
        topk_weights = scores.gather(1, topk_ids)
    else:
        topk_weights, topk_ids = torch.topk(masked, k=topk, dim=-1, sorted=False)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids.to(torch.int32)


def aiter_shuffle_weight(w, gate_up=False):
    """AITER's shuffle_weight (layout (16, 16)) or, with gate_up, shuffle_weight_a16w4(w, 16,
    True): 16-row bands, 16-byte chunks emitted column by column; gate_up interleaves the two
    halves' 16-row blocks in the same single permute."""
    x = _as_storage_ints(w)  # fp4/fp8 lack copy kernels in some torch builds; AITER views too
    chunk = 16 // x.element_size()
    *lead, rows, k = x.shape
    if gate_up:
        experts = lead[0]
        tiles = x.view(experts, 2, rows // 32, 16, k // chunk, chunk).permute(0, 2, 1, 4, 3, 5)
    else:
        tiles = x.view(-1, rows // 16, 16, k // chunk, chunk).permute(0, 1, 3, 2, 4)
    return tiles.contiguous().view(x.shape).view(w.dtype)


def aiter_e8m0_shuffle(scale, gate_up=False, num_experts=None):
    """AITER's e8m0_shuffle or, with gate_up, shuffle_scale_a16w4(scale, num_experts, True)
    (rows a multiple of 32 per expert, columns of 8: no padding there)."""
    m, n = scale.shape
    if gate_up:
        blocks = scale.view(num_experts, 2, m // num_experts // 32, 16, n // 8, 2, 4)
        return blocks.permute(0, 2, 4, 6, 3, 5, 1).contiguous().view(m, n)
    padded = torch.empty((m + 255) // 256 * 256, (n + 7) // 8 * 8, dtype=scale.dtype,
                         device=scale.device)
    padded[:m, :n] = scale
    pm, pn = padded.shape
    blocks = padded.view(pm // 32, 2, 16, pn // 8, 2, 4).permute(0, 3, 5, 2, 4, 1)
    return blocks.contiguous().view(pm, pn)


def check_shuffle_baselines(w, scales, experts):
    """Asserts, once before any timing, that the AITER formulations give moeext's bytes on
    the benchmark's own inputs (every valid position of the padded e8m0 output)."""
    for gate_up in (False, True):
        assert torch.equal(aiter_shuffle_weight(w, gate_up),
                           moeext.shuffle_weight(w, gate_up=gate_up)), gate_up
        kw = dict(gate_up=gate_up, num_experts=experts if gate_up else None)
        theirs, ours = aiter_e8m0_shuffle(scales, **kw), moeext.e8m0_shuffle(scales, **kw)
        m, n = scales.shape
        assert torch.equal(moeext.e8m0_unshuffle(theirs, m, n, **kw),
                           moeext.e8m0_unshuffle(ours, m, n, **kw)), gate_up


def check_grouped_topk_baseline(args_without_logits, num_experts):
    """Asserts, once before any timing, that the torch-native baseline routes as moeext does:
    the same expert set and weights per token, on fp32 logits (no ties to break differently;
    the baseline's topk is unsorted, so the sets are compared in id order)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, num_experts, generator=g)
    theirs_w, theirs_ids = torch_native_grouped_topk(logits, *args_without_logits)
    ours_w, ours_ids = moeext.biased_grouped_topk(logits, *args_without_logits)
    theirs_ids, order = theirs_ids.sort(dim=1)
    ours_ids, ours_order = ours_ids.sort(dim=1)
    assert torch.equal(theirs_ids, ours_ids)
    torch.testing.assert_close(theirs_w.gather(1, order), ours_w.gather(1, ours_order))
