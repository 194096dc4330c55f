"""Pure-PyTorch oracles: each function here *defines* the semantics of one moeext op.

They favour being obviously right over being fast: stable sorts spell the tie rules out,
every step is a separate tensor op. The tests compare every backend against them.
"""

from typing import Optional, Tuple

import torch

__all__ = ["biased_grouped_topk", "router_gemm", "routing_scores", "SCORING_FUNCS",
           "zero_tail_", "zero_tail_tracked_"]

SCORING_FUNCS = ("sigmoid", "sqrtsoftplus", "softmax")


def _score(x: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sigmoid":
        return torch.sigmoid(x)
    if scoring_func == "sqrtsoftplus":
        # torch's softplus: x itself above the threshold 20, log1p(exp(x)) below.
        return torch.sqrt(torch.nn.functional.softplus(x, beta=1.0, threshold=20.0))
    if scoring_func == "softmax":
        e = torch.exp(x - x.amax(dim=-1, keepdim=True))
        return e / e.sum(dim=-1, keepdim=True)
    raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {scoring_func!r}")


def _nan_to_neg_inf(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(x), torch.full_like(x, float("-inf")), x)


def routing_scores(
    gating_output: torch.Tensor,
    correction_bias: Optional[torch.Tensor],
    scoring_func: str = "sigmoid",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-2 of SPEC section 1: ``(s, b)`` in fp32, NaN in ``b`` replaced by -inf."""
    s = _score(gating_output.float(), scoring_func)
    b = s + correction_bias.float() if correction_bias is not None else s
    return s, _nan_to_neg_inf(b)


def biased_grouped_topk(
    gating_output: torch.Tensor,
    correction_bias: Optional[torch.Tensor],
    num_expert_group: int,
    topk_group: int,
    topk: int,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring_func: str = "sigmoid",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference for ``moeext.biased_grouped_topk`` (SPEC.md section 1)."""
    num_tokens, num_experts = gating_output.shape
    group_size = num_experts // num_expert_group
    s, b = routing_scores(gating_output, correction_bias, scoring_func)

    grouped = b.view(num_tokens, num_expert_group, group_size)
    if correction_bias is not None and group_size > 1:
        # topk(2).sum(): a duplicated maximum counts twice.
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.amax(dim=-1)
    group_scores = _nan_to_neg_inf(group_scores)  # +inf + -inf

    # Stable descending sorts put ties in ascending index order: the tie rule, spelled out.
    kept_groups = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices
    kept = torch.zeros_like(group_scores, dtype=torch.bool)
    kept.scatter_(1, kept_groups[:, :topk_group], True)
    kept = kept.repeat_interleave(group_size, dim=1)

    # Order experts by b (descending, stable), then move the kept ones first (stable), so
    # experts outside kept groups rank below every kept one, -inf candidates included.
    by_value = torch.sort(b, dim=-1, descending=True, stable=True).indices
    kept_first = torch.sort(kept.gather(1, by_value).to(torch.int8), dim=-1,
                            descending=True, stable=True).indices
    ids = by_value.gather(1, kept_first)[:, :topk]

    weights = s.gather(1, ids)
    weights = torch.where(torch.isnan(weights), torch.zeros_like(weights), weights)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * routed_scaling_factor
    return weights, ids.to(torch.int32)


def router_gemm(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Reference for ``moeext.router_gemm`` (SPEC.md section 2).

    The exact product, computed in fp64 and rounded once to ``out_dtype`` (float32 if None).
    A kernel accumulating in fp32 differs from it by its accumulation error only; the tests
    bound that by a tolerance that grows with ``hidden_size``.
    """
    exact = hidden_states.double() @ weight.double().T
    return exact.to(torch.float32 if out_dtype is None else out_dtype)


def zero_tail_(buf: torch.Tensor, new_extent: int, prev_extent: int) -> None:
    """Reference for ``moeext.zero_tail_`` (SPEC.md section 4)."""
    if new_extent < 0 or prev_extent < 0:
        raise RuntimeError("zero_tail_: extents must be >= 0")
    end = min(prev_extent, buf.shape[0])
    if new_extent < end:
        # Byte view: fp4/fp8 storage types have no fill kernel, and zero bytes are zero.
        target = buf.view(torch.uint8) if buf.element_size() == 1 else buf
        target[new_extent:end] = 0


def zero_tail_tracked_(buf: torch.Tensor, state: torch.Tensor, new_extent: int) -> None:
    """Reference for ``moeext.zero_tail_tracked_``: the previous extent lives in ``state``."""
    zero_tail_(buf, new_extent, max(0, int(state.item())))
    state.fill_(new_extent)
