"""Comparison of a routing result with moeext.reference, shared by the routing tests.

Ids are compared exactly, in order. The one allowance: two implementations of exp agree to
about 1 ulp, not bit for bit, so two experts whose biased scores lie within a few ulps can
swap. A row may differ from the reference only where the reference's biased scores of the
two choices are within ``near_tie`` of each other and *not* exactly equal (exact ties must
follow the tie rule), or where two group scores at the kept-groups threshold nearly tie and the
row is exactly the reference's choice with the other group kept; such rows must be rare. ``strict=True`` allows no difference at all.
"""

import torch

from moeext import reference


def _kept_experts(b, bias, num_expert_group, topk_group):
    """Experts of every group whose score is within reach of the kept groups' threshold."""
    num_tokens, num_experts = b.shape
    group_size = num_experts // num_expert_group
    grouped = b.view(num_tokens, num_expert_group, group_size)
    if bias is not None and group_size > 1:
        scores = grouped.topk(2, dim=-1).values.sum(-1)
    else:
        scores = grouped.amax(-1)
    scores = torch.where(torch.isnan(scores), torch.full_like(scores, float("-inf")), scores)
    threshold = scores.sort(dim=-1, descending=True).values[:, topk_group - 1 : topk_group]
    near = (scores >= threshold - 1e-5) | (scores == threshold)
    return near.repeat_interleave(group_size, dim=1)


def _group_scores(b, bias, num_expert_group):
    num_tokens, num_experts = b.shape
    grouped = b.view(num_tokens, num_expert_group, num_experts // num_expert_group)
    if bias is not None and grouped.shape[-1] > 1:
        scores = grouped.topk(2, dim=-1).values.sum(-1)
    else:
        scores = grouped.amax(-1)
    return torch.where(torch.isnan(scores), torch.full_like(scores, float("-inf")), scores)


def _is_group_near_tie(b_row, got_ids, ref_ids, bias, num_expert_group, topk_group, tolerance):
    """Whether got_ids are the reference's choice once kept groups that tie the threshold
    within ``tolerance`` (but not exactly) are swapped: a 1-ulp exp difference can flip which of
    two nearly equal group scores is kept, and then the experts differ wholesale. The groups
    of got_ids, with every group clearly above the threshold, must yield exactly got_ids."""
    scores = _group_scores(b_row[None], bias, num_expert_group)[0]
    group_size = b_row.numel() // num_expert_group
    threshold = scores.sort(descending=True).values[topk_group - 1]
    got_groups = torch.unique(got_ids.long() // group_size)
    ref_groups = torch.unique(ref_ids.long() // group_size)
    only_got = [g for g in got_groups.tolist() if g not in ref_groups.tolist()]
    only_ref = [g for g in ref_groups.tolist() if g not in got_groups.tolist()]
    grouped = b_row.view(num_expert_group, group_size)
    top = grouped.topk(min(2, group_size), dim=-1).values
    # Groups whose deciding values are the same are a real tie: the rule decides, no allowance.
    # Equal sums of different values are a coincidence of rounding that 1 ulp undoes.
    if any(torch.equal(top[g], top[h]) for g in only_got for h in only_ref):
        return False
    if not bool((scores[got_groups] >= threshold - tolerance).all()):
        return False
    kept = (scores > threshold + tolerance)
    kept[got_groups] = True
    if int(kept.sum()) > topk_group:
        return False
    masked = torch.where(kept.repeat_interleave(group_size), b_row, torch.full_like(b_row, -2.0**127))
    masked = torch.where(torch.isnan(masked), torch.full_like(masked, float("-inf")), masked)
    order = sorted(range(b_row.numel()), key=lambda e: (-masked[e].item(), e))
    return order[: got_ids.numel()] == got_ids.long().tolist()


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_same_bits(got, expected, message=""):
    """``got`` holds ``expected``'s values bit for bit: the same dtype, shape and bits, with NaN
    exactly where ``expected`` has NaN (whatever its payload; NaN never equals itself, so
    torch.equal alone would fail every row with one, such as a weight of inf / inf)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape, message
    got, expected = got.cpu(), expected.cpu()
    if got.is_floating_point():
        nan = torch.isnan(expected)
        assert torch.equal(torch.isnan(got), nan), message
        bits = _BITS[got.element_size()]
        got = got.masked_fill(nan, 0).view(bits)
        expected = expected.masked_fill(nan, 0).view(bits)
    assert torch.equal(got, expected), message


def assert_routing_matches(
    weights,
    ids,
    gating_output,
    correction_bias,
    num_expert_group,
    topk_group,
    topk,
    renormalize=True,
    routed_scaling_factor=1.0,
    scoring_func="sigmoid",
    strict=False,
    near_tie=2e-6,
):
    num_tokens, num_experts = gating_output.shape
    assert weights.shape == (num_tokens, topk) and weights.dtype == torch.float32
    assert ids.shape == (num_tokens, topk) and ids.dtype == torch.int32
    weights, ids = weights.cpu(), ids.cpu()
    gating_output = gating_output.cpu()
    correction_bias = None if correction_bias is None else correction_bias.cpu()

    ref_w, ref_ids = reference.biased_grouped_topk(
        gating_output, correction_bias, num_expert_group, topk_group, topk, renormalize,
        routed_scaling_factor, scoring_func,
    )
    # Always true, whatever the scores: distinct ids, in range, inside groups that can be kept.
    ids64 = ids.long()
    assert bool(((ids64 >= 0) & (ids64 < num_experts)).all()), "expert id out of range"
    if topk > 1:
        sorted_ids = ids64.sort(dim=-1).values
        assert bool((sorted_ids[:, 1:] != sorted_ids[:, :-1]).all()), "duplicate expert id"

    differing = (ids != ref_ids).any(dim=-1)
    if strict:
        bad = differing.nonzero().flatten()[:5].tolist()
        assert not bool(differing.any()), (
            f"ids differ from the reference in rows {bad}: got {ids[bad].tolist()}, "
            f"expected {ref_ids[bad].tolist()}"
        )
    elif bool(differing.any()):
        s, b = reference.routing_scores(gating_output, correction_bias, scoring_func)
        kept = _kept_experts(b, correction_bias, num_expert_group, topk_group)
        rows = differing.nonzero().flatten()
        assert len(rows) <= 2 + num_tokens // 100, f"{len(rows)} of {num_tokens} rows differ"
        for r in rows.tolist():
            got_b, ref_b = b[r, ids64[r]], b[r, ref_ids[r].long()]
            swapped = ids[r] != ref_ids[r]
            assert bool(kept[r, ids64[r]].all()), f"row {r}: an id outside the kept groups"
            if _is_group_near_tie(b[r], ids[r], ref_ids[r], correction_bias, num_expert_group, topk_group,
                                  1e-5 * max(1.0, got_b.abs().max().item())):
                continue
            assert torch.allclose(got_b, ref_b, rtol=0, atol=near_tie * max(1.0, ref_b.abs().max().item())), (
                f"row {r}: ids {ids[r].tolist()} vs reference {ref_ids[r].tolist()} "
                f"are not a near tie (b {got_b.tolist()} vs {ref_b.tolist()})"
            )
            assert not bool((got_b[swapped] == ref_b[swapped]).all()), (
                f"row {r}: exact tie broken against the rule: {ids[r].tolist()} vs "
                f"{ref_ids[r].tolist()}"
            )
        # Weights of differing rows are checked against the reference for the ids chosen.
        ref_w = ref_w.clone()
        for r in rows.tolist():
            w = s[r, ids64[r]]
            w = torch.where(torch.isnan(w), torch.zeros_like(w), w)
            if renormalize:
                w = w / (w.sum() + 1e-20)
            ref_w[r] = w * routed_scaling_factor
    torch.testing.assert_close(weights, ref_w, rtol=2e-5, atol=1e-6, equal_nan=True)


def _scores_float64(gating_output, correction_bias, scoring_func):
    """s and b = s + bias in float64: the values the fp32 kernels approximate to a few ulps."""
    x = gating_output.double()
    if scoring_func == "sigmoid":
        s = torch.sigmoid(x)
    elif scoring_func == "sqrtsoftplus":
        s = torch.sqrt(torch.nn.functional.softplus(x))
    else:
        s = torch.softmax(x, dim=-1)
    b = s if correction_bias is None else s + correction_bias.double()
    return s, b


def assert_valid_routing(weights, ids, gating_output, correction_bias, num_expert_group,
                         topk_group, topk, renormalize=True, routed_scaling_factor=1.0,
                         scoring_func="sigmoid", ulps=8):
    """The oracle for inputs full of near ties, where assert_routing_matches cannot tell a
    1-ulp difference of exp from a wrong choice: against float64 scores, every comparison may
    go either way within ``ulps`` fp32 ulps of the row's largest |b|, except between experts
    (or groups) whose inputs are identical, where the tie rule decides. Checked row by row:
    the groups of the chosen experts are among the topk_group best, the ids are in
    descending b, no expert of those groups left out is better than the worst chosen, and the
    weights are the chosen experts' scores (renormalised, scaled)."""
    num_tokens, num_experts = gating_output.shape
    group_size = num_experts // num_expert_group
    weights, ids = weights.cpu(), ids.cpu().long()
    gating_output = gating_output.cpu()
    bias = (torch.zeros(num_experts) if correction_bias is None else correction_bias.cpu()).float()
    s, b = _scores_float64(gating_output, None if correction_bias is None else bias,
                           scoring_func)
    b = torch.where(torch.isnan(b), torch.full_like(b, float("-inf")), b)
    logits = gating_output.float()

    def identical(r, e, f):
        x, y = logits[r, e].item(), logits[r, f].item()
        return (x == y or (x != x and y != y)) and bias[e].item() == bias[f].item()

    for r in range(num_tokens):
        got = ids[r].tolist()
        assert len(set(got)) == topk and all(0 <= e < num_experts for e in got), (
            f"row {r}: ids {got} not distinct and in range")
        finite = b[r][torch.isfinite(b[r])]
        if finite.numel() == 0:
            continue  # all NaN or -inf: any distinct ids in kept groups
        tol = ulps * 2.0**-23 * max(1.0, finite.abs().max().item())
        group_scores = _group_scores(b[r][None], correction_bias, num_expert_group)[0]
        groups = sorted({e // group_size for e in got})
        assert len(groups) <= topk_group, f"row {r}: ids {got} span {len(groups)} groups"
        for g in groups:
            better = int((group_scores > group_scores[g] + 2 * tol).sum())
            assert better < topk_group, (
                f"row {r}: group {g} chosen with {better} groups clearly better")
        for j in range(topk - 1):
            e, f = got[j], got[j + 1]
            assert b[r, e] >= b[r, f] - tol, (
                f"row {r}: id {e} (b {b[r, e].item()}) ranked above {f} (b {b[r, f].item()})")
            assert not (identical(r, e, f) and e > f), (
                f"row {r}: identical experts {e} and {f} out of index order")
        worst = min(got, key=lambda e: (b[r, e].item(), -e))
        for g in groups:
            for e in range(g * group_size, (g + 1) * group_size):
                if e in got:
                    continue
                assert b[r, e] <= b[r, worst] + tol, (
                    f"row {r}: expert {e} (b {b[r, e].item()}) left out, better than chosen "
                    f"{worst} (b {b[r, worst].item()})")
                assert not (e < worst and identical(r, e, worst)
                            and torch.isfinite(b[r, e]).item()), (
                    f"row {r}: expert {e} left out for the identical, higher-numbered {worst}")
        chosen = s[r, ids[r]]
        chosen = torch.where(torch.isnan(chosen), torch.zeros_like(chosen), chosen)
        if renormalize:
            chosen = chosen / (chosen.sum() + 1e-20)
        torch.testing.assert_close(weights[r], (chosen * routed_scaling_factor).float(),
                                   rtol=1e-4, atol=1e-6, equal_nan=True)
