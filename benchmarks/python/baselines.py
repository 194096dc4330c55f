"""What engines run today, written out in plain PyTorch, for the benchmarks to compare with.

``torch_native_grouped_topk`` is the formulation of vLLM's and SGLang's pure-PyTorch
``grouped_topk`` (the path their CPU backends route through): topk-based, unsorted, with the
biased scores masked to -inf outside the kept groups. It is computed in fp32, as the
contract requires, so the comparison is like for like.
"""

import torch


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
        biased = scores + correction_bias.float().unsqueeze(0)
        group_scores = (
            biased.view(num_tokens, num_expert_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        )
    else:
        biased = scores
        group_scores = biased.view(num_tokens, num_expert_group, -1).amax(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (
        group_mask.unsqueeze(-1)
        .expand(num_tokens, num_expert_group, num_experts // num_expert_group)
        .reshape(num_tokens, -1)
    )
    masked = biased.masked_fill(~score_mask.bool(), float("-inf"))
    topk_ids = torch.topk(masked, k=topk, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids.to(torch.int32)
