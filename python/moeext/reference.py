"""Pure-PyTorch oracles: each function here *defines* the semantics of one moeext op.

They favour being obviously right over being fast: stable sorts spell the tie rules out,
every step is a separate tensor op. The tests compare every backend against them.
"""

import math
from typing import Optional, Tuple

import torch

__all__ = ["biased_grouped_topk", "apply_routing_options", "routing_weights", "router_gemm",
           "is_prepacked_router_weight",
           "unpack_router_weight", "routing_scores",
           "SCORING_FUNCS", "zero_tail_", "zero_tail_tracked_", "shuffle_weight",
           "unshuffle_weight", "e8m0_shuffle", "e8m0_unshuffle"]

SCORING_FUNCS = ("sigmoid", "sqrtsoftplus", "softmax")


def _exp(x: torch.Tensor) -> torch.Tensor:
    """exp of float32 values, computed in float64 and rounded once to float32: it overflows
    to inf and underflows through the subnormals to 0 where float32's exp does."""
    return torch.exp(x.double()).float()


def _rounded_score(x: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sigmoid":
        return 1 / (1 + _exp(-x))
    if scoring_func == "sqrtsoftplus":
        # torch's softplus: x itself above the threshold 20, log1p(exp(x)) below.
        softplus = torch.where(x > 20, x, torch.log1p(_exp(x).double()).float())
        return torch.sqrt(softplus.double()).float()
    e = _exp(x - x.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True)


def _torch_score(x: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sigmoid":
        return torch.sigmoid(x)
    if scoring_func == "sqrtsoftplus":
        # Below x = -20, sqrt(softplus(x)) is exp(x / 2) to float32 precision (within 1e-9),
        # whose derivative stays finite and exact where the composed one divides by a score
        # that float32's softplus lets underflow (from x = -104, -inf included, a NaN). Each
        # branch sees only its own logits, so the other's derivative cannot meet 0 x inf.
        far = x < -20
        near = torch.nn.functional.softplus(torch.where(far, 0.0, x), beta=1.0, threshold=20.0)
        return torch.where(far, torch.exp(0.5 * torch.where(far, x, 0.0)), torch.sqrt(near))
    e = torch.exp(x - x.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True)


def _score(x: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """Step 1 in float32, with each exp, log1p and square root rounded once from float64.

    Not the values of torch's float32 sigmoid and softplus: in a row that is a whole tensor
    they round the elements past the last full vector differently from the rest, so equal
    logits could score an ulp apart and the expected order would break step 5's tie rule.
    Nor torch's float32 square root: on x86-64 (torch 2.13) about a sixth of its results are
    an ulp off the correctly rounded root that the kernels' IEEE square roots give. A
    float64 result rounded to float32 is the same wherever it is computed, unless it lies
    within a float64 ulp of a rounding boundary. The derivative, where ``x`` requires grad,
    is autograd's through torch's functions, which the composed formulas would lose to
    0 x inf and to subnormal products at large ``|x|``.
    """
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {scoring_func!r}")
    with torch.no_grad():
        rounded = _rounded_score(x.detach(), scoring_func)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return rounded
    s = _torch_score(x, scoring_func)
    # The value is rounded's (s - s is 0 where s is finite; where the two are equal, inf
    # included, s itself), the derivative s's.
    return torch.where(s == rounded, s, rounded + (s - s.detach()))


def _nan_to_neg_inf(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(x), torch.full_like(x, float("-inf")), x)


def routing_scores(
    gating_output: torch.Tensor,
    correction_bias: Optional[torch.Tensor],
    scoring_func: str = "sigmoid",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-2 of docs/SPEC.md §1: ``(s, b)`` in fp32, NaN in ``b`` replaced by -inf."""
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
    num_fused_shared_experts: int = 0,
    shared_expert_weight: float = 1.0,
    expert_map: Optional[torch.Tensor] = None,
    expert_counts: Optional[torch.Tensor] = None,
    routed_experts: Optional[torch.Tensor] = None,
    num_valid_tokens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference for ``moeext.biased_grouped_topk`` (docs/SPEC.md §1, and §6 for the options
    after ``scoring_func``, which :func:`apply_routing_options` applies)."""
    weights, ids = _route(gating_output, correction_bias, num_expert_group, topk_group, topk,
                          renormalize, routed_scaling_factor, scoring_func)
    return apply_routing_options(weights, ids, gating_output.shape[1], num_fused_shared_experts,
                                 shared_expert_weight, expert_map, expert_counts,
                                 routed_experts, num_valid_tokens)


def apply_routing_options(
    weights: torch.Tensor,
    ids: torch.Tensor,
    num_experts: int,
    num_fused_shared_experts: int = 0,
    shared_expert_weight: float = 1.0,
    expert_map: Optional[torch.Tensor] = None,
    expert_counts: Optional[torch.Tensor] = None,
    routed_experts: Optional[torch.Tensor] = None,
    num_valid_tokens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """docs/SPEC.md §6 on a routed choice ``(weights, ids)`` ``[T, topk]``: records and counts
    the logical ids of the valid rows (``expert_counts`` and ``routed_experts`` are written in
    place), appends the shared experts' columns, then maps every id through ``expert_map``."""
    num_tokens = ids.shape[0]
    valid = num_tokens
    if num_valid_tokens is not None:  # a negative count counts no row, as a device reads it
        valid = min(max(int(num_valid_tokens.reshape(-1)[0]), 0), num_tokens)
    if routed_experts is not None:
        routed_experts[:valid] = ids[:valid].to(routed_experts.dtype)
    if expert_counts is not None:
        counted = torch.bincount(ids[:valid].reshape(-1).long(), minlength=num_experts)
        expert_counts += counted.to(expert_counts.device, expert_counts.dtype)
    if num_fused_shared_experts > 0:
        shared = torch.arange(num_experts, num_experts + num_fused_shared_experts,
                              dtype=ids.dtype, device=ids.device)
        ids = torch.cat([ids, shared.expand(num_tokens, -1)], dim=1)
        weights = torch.cat([weights, torch.full((num_tokens, num_fused_shared_experts),
                                                 shared_expert_weight, dtype=weights.dtype,
                                                 device=weights.device)], dim=1)
    if expert_map is not None:
        ids = expert_map.to(ids.device)[ids.long()].to(ids.dtype)
    return weights, ids


def _route(gating_output, correction_bias, num_expert_group, topk_group, topk, renormalize,
           routed_scaling_factor, scoring_func):
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

    return _weights_of(s, ids, renormalize, routed_scaling_factor), ids.to(torch.int32)


def _weights_of(s, ids, renormalize, routed_scaling_factor):
    """Steps 6 and 7 of docs/SPEC.md §1: the scores of the chosen ids, NaN as 0, renormalised
    and scaled."""
    weights = s.gather(1, ids.long())
    weights = torch.where(torch.isnan(weights), torch.zeros_like(weights), weights)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor


def routing_weights(
    gating_output: torch.Tensor,
    topk_ids: torch.Tensor,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring_func: str = "sigmoid",
) -> torch.Tensor:
    """Reference for ``moeext.routing_weights`` (docs/SPEC.md §6.6): the weights routing gives
    the experts ``topk_ids`` ``[T, k]`` from these logits, in the ids' column order, with
    autograd's derivative in the logits."""
    s = _score(gating_output.float(), scoring_func)
    return _weights_of(s, topk_ids, renormalize, routed_scaling_factor)


def router_gemm(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Reference for ``moeext.router_gemm`` (docs/SPEC.md §2).

    The exact product, computed in fp64 and rounded once to ``out_dtype`` (float32 if None).
    A kernel accumulating in fp32 differs from it by its accumulation error only; the tests
    bound that by a tolerance that grows with ``hidden_size``. A prepacked (3-D) weight is
    unpacked first.
    """
    if is_prepacked_router_weight(weight):
        weight = unpack_router_weight(weight, hidden_states.shape[1])
    exact = hidden_states.double() @ weight.double().T
    return exact.to(torch.float32 if out_dtype is None else out_dtype)


def fused_router(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    correction_bias: Optional[torch.Tensor],
    num_expert_group: int,
    topk_group: int,
    topk: int,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring_func: str = "sigmoid",
    num_fused_shared_experts: int = 0,
    shared_expert_weight: float = 1.0,
    expert_map: Optional[torch.Tensor] = None,
    expert_counts: Optional[torch.Tensor] = None,
    routed_experts: Optional[torch.Tensor] = None,
    num_valid_tokens: Optional[torch.Tensor] = None,
    return_logits: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Reference for ``moeext.fused_router`` (docs/SPEC.md §7): :func:`router_gemm`'s fp32
    logits routed by :func:`biased_grouped_topk`. The op's contract is equality with its own
    two ops, bit for bit; against this reference, with its exact product, it agrees as
    ``router_gemm`` does, to the accumulation error."""
    logits = router_gemm(hidden_states, weight)
    weights, ids = biased_grouped_topk(
        logits, correction_bias, num_expert_group, topk_group, topk, renormalize,
        routed_scaling_factor, scoring_func, num_fused_shared_experts, shared_expert_weight,
        expert_map, expert_counts, routed_experts, num_valid_tokens)
    return weights, ids, logits if return_logits else None


def is_prepacked_router_weight(weight: torch.Tensor) -> bool:
    """Whether a router weight is in ``moeext.prepack_router_weight``'s layout
    ``[ceil(H / 2), E, 2]`` (3-D) rather than ``nn.Linear``'s ``[E, H]`` (2-D)."""
    return weight.dim() == 3


def unpack_router_weight(packed: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """The ``[num_experts, hidden_size]`` weight a ``moeext.prepack_router_weight`` result holds.

    Read tile by tile as the layout is documented: experts in tiles of 64 (the last one
    narrower), tile ``[ceil(H / 2)][width][2]`` holding the pair ``(2k, 2k + 1)`` of each
    expert, the tiles one after the other.
    """
    pairs, num_experts, _ = packed.shape
    flat = packed.reshape(-1)
    rows = []
    for first in range(0, num_experts, 64):
        width = min(64, num_experts - first)
        tile = flat[first * pairs * 2:(first + width) * pairs * 2].view(pairs, width, 2)
        rows.append(tile.permute(1, 0, 2).reshape(width, 2 * pairs))
    weight = torch.cat(rows) if rows else packed.new_empty(0, 2 * pairs)
    return weight[:, :hidden_size]


def zero_tail_(buf: torch.Tensor, new_extent: int, prev_extent: int) -> None:
    """Reference for ``moeext.zero_tail_`` (docs/SPEC.md §4)."""
    for name, extent in (("new_extent", new_extent), ("prev_extent", prev_extent)):
        if extent < 0:
            raise RuntimeError(f"zero_tail_: {name} must be >= 0, got {extent}")
    end = min(prev_extent, buf.shape[0])
    if new_extent < end:
        # Byte view: fp4/fp8 storage types have no fill kernel, and zero bytes are zero.
        target = buf.view(torch.uint8) if buf.element_size() == 1 else buf
        target[new_extent:end] = 0


def zero_tail_tracked_(buf: torch.Tensor, state: torch.Tensor, new_extent: int) -> None:
    """Reference for ``moeext.zero_tail_tracked_``: the previous extent lives in ``state``."""
    zero_tail_(buf, new_extent, max(0, int(state.item())))
    state.fill_(new_extent)


# --- MXFP4 weight preparation (docs/SPEC.md §3) ------------------------------------------
# Written as views and permutes of the byte (or 16-bit) storage, the way AITER writes them:
# fp4/fp8 storage types have no copy kernels of their own in every torch.

def _as_storage_ints(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


def _gate_up_interleave(x: torch.Tensor, rows_per_group: int, inverse: bool = False):
    """[..., G * rows_per_group, K]: 16-row blocks alternate gate half / up half per group."""
    *lead, rows, k = x.shape
    groups, half = rows // rows_per_group, rows_per_group // 2
    if not inverse:
        split = x.reshape(*lead, groups, 2, half // 16, 16, k)  # (g, gate|up, block, row)
        return split.transpose(-4, -3).reshape(*lead, rows, k)
    split = x.reshape(*lead, groups, half // 16, 2, 16, k)  # (g, block, gate|up, row)
    return split.transpose(-4, -3).reshape(*lead, rows, k)


def shuffle_weight(w: torch.Tensor, layout=(16, 16), gate_up: bool = False) -> torch.Tensor:
    """Reference for ``moeext.shuffle_weight``."""
    band, _ = layout
    x = _as_storage_ints(w)
    if gate_up:
        x = _gate_up_interleave(x, x.shape[-2])
    *lead, rows, k = x.shape
    chunk = 16 // w.element_size()
    batch = math.prod(lead)
    tiles = x.reshape(batch, rows // band, band, k // chunk, chunk).permute(0, 1, 3, 2, 4)
    return tiles.contiguous().view(w.shape).view(w.dtype)


def unshuffle_weight(w: torch.Tensor, layout=(16, 16), gate_up: bool = False) -> torch.Tensor:
    """Reference for ``moeext.unshuffle_weight``."""
    band, _ = layout
    x = _as_storage_ints(w.contiguous())
    *lead, rows, k = x.shape
    chunk = 16 // w.element_size()
    batch = math.prod(lead)
    x = x.reshape(batch, rows // band, k // chunk, band, chunk).permute(0, 1, 3, 2, 4)
    x = x.contiguous().view(batch, rows, k)
    if gate_up:
        x = _gate_up_interleave(x, rows, inverse=True)
    return x.reshape(w.shape).view(w.dtype)


def e8m0_shuffle(scale: torch.Tensor, gate_up: bool = False, num_experts=None) -> torch.Tensor:
    """Reference for ``moeext.e8m0_shuffle``."""
    m, n = scale.shape
    bytes_ = scale.view(torch.uint8)
    if gate_up:
        bytes_ = _gate_up_interleave(bytes_, m // num_experts)
    pm, pn = (m + 255) // 256 * 256, (n + 7) // 8 * 8
    padded = torch.full((pm, pn), 0x7F, dtype=torch.uint8, device=scale.device)
    padded[:m, :n] = bytes_
    # padded[a*32 + h*16 + c4][d*8 + e*4 + f] -> (a, d, f, c4, e, h)
    blocks = padded.view(pm // 32, 2, 16, pn // 8, 2, 4).permute(0, 3, 5, 2, 4, 1)
    return blocks.contiguous().view(pm, pn).view(scale.dtype)


def e8m0_unshuffle(shuffled: torch.Tensor, m: int, n: int, gate_up: bool = False,
                   num_experts=None) -> torch.Tensor:
    """Reference for ``moeext.e8m0_unshuffle``."""
    pm, pn = shuffled.shape
    blocks = shuffled.contiguous().view(torch.uint8).view(pm // 32, pn // 8, 4, 16, 2, 2)
    padded = blocks.permute(0, 5, 3, 1, 4, 2).reshape(pm, pn)
    out = padded[:m, :n]
    if gate_up:
        out = _gate_up_interleave(out, m // num_experts, inverse=True)
    return out.contiguous().view(shuffled.dtype)
