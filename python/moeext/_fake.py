"""Fake (meta) implementations of every moeext op, in one place.

They give output shapes and dtypes without computing anything, so ``torch.compile`` and
``torch.export`` can trace the ops with symbolic sizes.
"""

import torch


@torch.library.register_fake("moeext::biased_grouped_topk")
def _biased_grouped_topk_fake(
    gating_output,
    correction_bias,
    num_expert_group,
    topk_group,
    topk,
    renormalize=True,
    routed_scaling_factor=1.0,
    scoring_func="sigmoid",
):
    torch._check(gating_output.dim() == 2, lambda: "gating_output must be 2-D")
    num_tokens = gating_output.shape[0]
    weights = gating_output.new_empty((num_tokens, topk), dtype=torch.float32)
    ids = gating_output.new_empty((num_tokens, topk), dtype=torch.int32)
    return weights, ids


@torch.library.register_fake("moeext::biased_grouped_topk_out")
def _biased_grouped_topk_out_fake(
    gating_output,
    correction_bias,
    topk_weights,
    topk_ids,
    num_expert_group,
    topk_group,
    renormalize=True,
    routed_scaling_factor=1.0,
    scoring_func="sigmoid",
):
    return None
