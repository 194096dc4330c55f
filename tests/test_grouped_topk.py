"""moeext.biased_grouped_topk against moeext.reference (SPEC.md section 1)."""

import math
import random
import threading
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

import moeext
from conftest import DEVICES, GPU_DEVICES
from moeext.presets import PRESETS
from routing_check import assert_routing_matches, assert_same_bits, assert_valid_routing

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_inputs(num_tokens, num_experts, logits_dtype, bias_dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(num_tokens, num_experts, generator=g) * 2).to(logits_dtype)
    bias = None
    if bias_dtype is not None:
        # DeepSeek-V3's released biases sit around +2: the regime where rounding b to bf16
        # would change the choice, so it is the one worth testing.
        bias = (2.0 + 0.05 * torch.randn(num_experts, generator=g)).to(bias_dtype)
        bias = bias.to(device)
    return logits.to(device), bias


def run_and_check(logits, bias, strict=False, **kw):
    weights, ids = moeext.biased_grouped_topk(logits, bias, **kw)
    assert weights.device == logits.device and ids.device == logits.device
    assert_routing_matches(weights, ids, logits, bias, strict=strict, **kw)
    return weights, ids


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 64, 1031])
@pytest.mark.parametrize("logits_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets(device_isa, preset, logits_dtype, num_tokens):
    device, _ = device_isa
    p = PRESETS[preset]
    bias_dtypes = FLOAT_DTYPES if p.has_bias else [None]
    for i, bias_dtype in enumerate(bias_dtypes):
        logits, bias = make_inputs(num_tokens, p.num_experts, logits_dtype, bias_dtype,
                                   seed=num_tokens + i, device=device)
        run_and_check(logits, bias, **p.op_kwargs())


TOPOLOGIES = [
    # num_experts, num_expert_group, topk_group, topk
    (1, 1, 1, 1),
    (7, 7, 3, 2),  # groups of one expert
    (7, 1, 1, 7),  # every expert chosen
    (48, 4, 2, 5),
    (64, 16, 16, 16),  # every group kept
    (160, 8, 3, 6),
    (200, 20, 7, 33),  # topk beyond 2 vector widths: the general path
    (256, 8, 1, 32),  # topk == the kept group's size
    (1000, 8, 4, 17),
    (640, 8, 4, 8),  # the GPU warp kernel at 20 experts a lane, groups in registers
    (768, 8, 4, 8),  # 24 a lane
    (896, 1, 1, 16),  # Kimi-K3-style: 28 a lane
    (1024, 16, 4, 32),
    (1024, 1, 1, 32),
    (1024, 32, 8, 64),
    # More groups than one vector of group scores holds (16 on AVX-512, 8 elsewhere), some
    # dropped, and topk <= 2 * topk_group: the general path's kept ranges, and its floor from
    # their second largest.
    (40, 20, 4, 4),
    (64, 32, 4, 8),
    (1024, 64, 8, 16),
]


@pytest.mark.parametrize("scoring_func", moeext.reference.SCORING_FUNCS)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("topology", TOPOLOGIES, ids=lambda t: "x".join(map(str, t)))
def test_topologies(device_isa, topology, with_bias, scoring_func):
    device, _ = device_isa
    num_experts, num_expert_group, topk_group, topk = topology
    for renormalize in (True, False):
        logits, bias = make_inputs(97, num_experts, torch.float32,
                                   torch.float32 if with_bias else None, seed=num_experts,
                                   device=device)
        run_and_check(logits, bias, num_expert_group=num_expert_group, topk_group=topk_group,
                      topk=topk, renormalize=renormalize, routed_scaling_factor=1.7,
                      scoring_func=scoring_func)


# One kept range longer than the gather's short-range bound (12 vectors): whole vectors and
# the partial last one are packed apart, and must still arrive in index order. Ranges ending in
# a partial vector, one starting mid-vector (group 1 of 2 x 300), one of two 64-vector chunks.
LONG_RANGES = [(1000, 1, 1, 8), (1500, 1, 1, 8), (600, 2, 1, 8), (1000, 4, 1, 16),
               (1000, 4, 1, 3)]


@pytest.mark.parametrize("scoring_func", moeext.reference.SCORING_FUNCS)
@pytest.mark.parametrize("topology", LONG_RANGES, ids=lambda t: "x".join(map(str, t)))
def test_long_ranges_with_partial_vectors(device_isa, topology, scoring_func):
    device, _ = device_isa
    num_experts, num_expert_group, topk_group, topk = topology
    for logits_dtype, bias_dtype in ((torch.bfloat16, torch.float32), (torch.float32, None)):
        logits, bias = make_inputs(61, num_experts, logits_dtype, bias_dtype, seed=topk,
                                   device=device)
        # On some rows the best experts sit in the range's last, partial vector, tied with one
        # in its first: without a bias the tie must still go to the lower index.
        first = num_experts - num_experts // num_expert_group
        logits[::3, first + 2] = 6.0
        logits[::3, num_experts - 5:] = 6.0
        run_and_check(logits, bias, num_expert_group=num_expert_group, topk_group=topk_group,
                      topk=topk, routed_scaling_factor=2.5, scoring_func=scoring_func)


# Softmax rows of up to 16 vectors are held in registers, by an instance per vector count:
# every count from 1 to 16 on AVX-512 (16 lanes; 8 lanes elsewhere take 1 to 8), each with a
# partial last vector, and Qwen3-style routers (128 experts, softmax, top 8) on whole ones.
SOFTMAX_WIDTHS = [16 * n - 3 for n in range(1, 17)] + [128]


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("num_experts", SOFTMAX_WIDTHS)
def test_softmax_rows_of_every_width(device_isa, num_experts, with_bias):
    device, _ = device_isa
    logits, bias = make_inputs(33, num_experts, torch.bfloat16,
                               torch.float32 if with_bias else None, seed=num_experts,
                               device=device)
    run_and_check(logits, bias, num_expert_group=1, topk_group=1, topk=min(8, num_experts),
                  scoring_func="softmax")


@pytest.mark.parametrize("layout", ["column_stride_2", "transposed", "row_slice"])
@pytest.mark.parametrize("logits_dtype", FLOAT_DTYPES)
def test_non_contiguous(device_isa, layout, logits_dtype):
    device, _ = device_isa
    num_tokens, num_experts = 77, 256
    g = torch.Generator().manual_seed(3)
    base = torch.randn(2 * num_tokens, 2 * num_experts, generator=g).to(logits_dtype).to(device)
    if layout == "column_stride_2":
        logits = base[:num_tokens, ::2]
    elif layout == "transposed":
        logits = torch.randn(num_experts, num_tokens, generator=g).to(logits_dtype).to(device).t()
    else:
        logits = base[1::2, 3 : 3 + num_experts]
    assert not logits.is_contiguous()
    wide_bias = 2 + 0.05 * torch.randn(2 * num_experts, generator=g)
    for bias_dtype in FLOAT_DTYPES:  # the bias strided too, in each dtype the kernel reads
        bias = wide_bias.to(bias_dtype).to(device)[::2]
        run_and_check(logits, bias, num_expert_group=8, topk_group=4, topk=8,
                      routed_scaling_factor=2.5)


@pytest.mark.parametrize("num_tokens", [0, 5, 300])
def test_out_into_wider_buffer(device_isa, num_tokens):
    """The _out form writes the first topk columns of a persistent buffer, nothing else."""
    device, _ = device_isa
    topk, extra = 8, 3
    logits, bias = make_inputs(num_tokens, 256, torch.bfloat16, torch.float32, seed=11,
                               device=device)
    weights_buf = torch.full((num_tokens, topk + extra), -7.0, device=device)
    ids_buf = torch.full((num_tokens, topk + extra), -7, dtype=torch.int32, device=device)
    weights, ids = weights_buf[:, :topk], ids_buf[:, :topk]
    moeext.biased_grouped_topk_out(logits, bias, weights, ids, 8, 4, True, 2.5)
    assert bool((weights_buf[:, topk:] == -7.0).all())
    assert bool((ids_buf[:, topk:] == -7).all())
    expected_w, expected_ids = moeext.biased_grouped_topk(logits, bias, 8, 4, topk, True, 2.5)
    assert torch.equal(ids, expected_ids)
    assert torch.equal(weights, expected_w)
    assert_routing_matches(weights, ids, logits, bias, 8, 4, topk, True, 2.5)


def test_ties_follow_the_rule(device_isa):
    """Exact ties: lower group index, then lower expert index; output ties by lower id."""
    device, _ = device_isa
    num_tokens, num_experts = 16, 64
    # Every score equal: the first topk_group groups are kept and the first experts chosen.
    for bias in (None, torch.zeros(num_experts, device=device),
                 torch.full((num_experts,), 2.0, device=device).bfloat16()):
        logits = torch.zeros(num_tokens, num_experts, device=device)
        w, ids = moeext.biased_grouped_topk(logits, bias, 8, 3, 5)
        assert ids.tolist() == [[0, 1, 2, 3, 4]] * num_tokens
        torch.testing.assert_close(w, torch.full((num_tokens, 5), 0.2, device=device))
    # Values from a tiny set: ties everywhere, inside and across groups.
    g = torch.Generator().manual_seed(5)
    for dtype in FLOAT_DTYPES:
        logits = torch.randint(-2, 3, (500, num_experts), generator=g).to(dtype).to(device)
        bias = torch.randint(0, 2, (num_experts,), generator=g).float().to(device)
        for scoring_func in moeext.reference.SCORING_FUNCS:
            for b in (bias, None):
                # topk 6 = 2 x topk_group takes its floor from the kept groups' top-2; 9 from
                # the lanes.
                for topk in (6, 9):
                    run_and_check(logits, b, strict=True, num_expert_group=8, topk_group=3,
                                  topk=topk, scoring_func=scoring_func)


def test_floor_from_kept_groups_keeps_ties_at_the_floor(device_isa):
    # Groups of 4; groups 2 and 0 are kept. The floor, the least second largest of the kept
    # groups, is sigmoid(1): experts 1 and 2 both sit on it, and the lower id must win.
    device, _ = device_isa
    logits = torch.tensor([[3.0, 1, 1, -2, -1, -1, -1, -1, 2, 2, -3, -3, -2, -2, -2, -2]],
                          device=device)
    bias = torch.zeros(16, device=device)
    _, ids = moeext.biased_grouped_topk(logits, bias, 4, 2, 4)
    assert ids.tolist() == [[0, 8, 9, 1]]
    run_and_check(logits, bias, strict=True, num_expert_group=4, topk_group=2, topk=4)


@pytest.mark.parametrize("topology", [(255, 5, 2, 8), (255, 1, 1, 8), (33, 3, 2, 4)])
def test_ties_in_single_rows_of_odd_widths(device_isa, topology):
    """Exact ties, one row at a time, at widths no vector width divides: where torch's fp32
    sigmoid and softplus score equal logits an ulp apart (past the last full vector), which
    an oracle computing with them would turn into a wrong expected order."""
    device, _ = device_isa
    num_experts, num_expert_group, topk_group, topk = topology
    g = torch.Generator().manual_seed(num_experts + num_expert_group)
    # Three random values a row, each at many places.
    values = torch.randn(48, 3, generator=g) * 3
    logits = values.gather(1, torch.randint(0, 3, (48, num_experts), generator=g)).to(device)
    bias = torch.randint(0, 2, (num_experts,), generator=g).float().to(device)
    for scoring_func in moeext.reference.SCORING_FUNCS:
        for b in (bias, None):
            for row in logits.split(1):
                run_and_check(row, b, strict=True, num_expert_group=num_expert_group,
                              topk_group=topk_group, topk=topk, scoring_func=scoring_func)


def test_duplicated_group_maximum_counts_twice(device):
    # Group 0: [5, 5, 0, 0] scores 10; group 1: [9, 0, 0, 0] scores 9: group 0 is kept.
    bias = torch.tensor([5.0, 5, 0, 0, 9, 0, 0, 0], device=device)
    logits = torch.full((1, 8), -30.0, device=device)  # sigmoid ~ 0: b is the bias
    _, ids = moeext.biased_grouped_topk(logits, bias, 2, 1, 2)
    assert ids.tolist() == [[0, 1]]


def test_weights_come_from_unbiased_scores(device):
    logits = torch.tensor([[0.0, 1.0, -1.0, 2.0]], device=device)
    bias = torch.tensor([3.0, 0.0, 2.0, 0.0], device=device)
    w, ids = moeext.biased_grouped_topk(logits, bias, 1, 1, 2, renormalize=False)
    assert ids.tolist() == [[0, 2]]
    torch.testing.assert_close(w.cpu(), torch.sigmoid(torch.tensor([[0.0, -1.0]])))


def test_rows_worked_out_by_hand(device_isa):
    """Expectations written out, not taken from the reference, so the two cannot share a bug:
    a NaN logit ranks below every finite one (SPEC step 2), and renormalisation adds 1e-20
    (step 7). 17 rows: one block of rows in lanes and one row of its own."""
    device, _ = device_isa

    def sigmoid(x):
        return 1 / (1 + math.exp(-x))

    logits = torch.tensor([[0.0, float("nan"), 1.0, -1.0]] * 17, device=device)
    weights, ids = moeext.biased_grouped_topk(logits, None, 1, 1, 3)
    assert ids.tolist() == [[2, 0, 3]] * 17
    s = [sigmoid(1.0), sigmoid(0.0), sigmoid(-1.0)]
    torch.testing.assert_close(weights.cpu(), torch.tensor([[v / sum(s) for v in s]] * 17))
    # Scores near 1e-26: their sum is far below the 1e-20 added to it.
    logits = torch.tensor([[-60.0, -61.0]] * 17, device=device)
    weights, ids = moeext.biased_grouped_topk(logits, None, 1, 1, 2)
    s = [sigmoid(-60.0), sigmoid(-61.0)]
    expected = torch.tensor([[v / (sum(s) + 1e-20) for v in s]] * 17)
    torch.testing.assert_close(weights.cpu(), expected, rtol=1e-4, atol=0)


@pytest.mark.parametrize("scoring_func", moeext.reference.SCORING_FUNCS)
@pytest.mark.parametrize("logits_dtype", FLOAT_DTYPES)
def test_nan_and_inf_rows(device_isa, scoring_func, logits_dtype):
    device, _ = device_isa
    num_experts, num_expert_group, topk_group, topk = 256, 8, 4, 8
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(12, num_experts, generator=g)
    logits[0] = float("nan")
    logits[1, ::3] = float("nan")
    logits[2, 5] = float("inf")
    logits[3, 100:140] = float("inf")
    logits[4] = float("-inf")
    logits[5, 200:] = float("-inf")
    logits[6] = float("inf")
    logits[7, ::2] = float("nan")
    logits[7, 1::2] = float("-inf")
    logits[8, :250] = float("nan")  # six finite experts left, all in the last group
    logits_cpu = logits.to(logits_dtype)
    logits = logits_cpu.to(device)
    bias_cpu = 2.0 + 0.05 * torch.randn(num_experts, generator=g)
    for b, b_cpu in ((bias_cpu.to(device), bias_cpu), (None, None)):
        kw = dict(num_expert_group=num_expert_group, topk_group=topk_group, topk=topk,
                  routed_scaling_factor=2.5, scoring_func=scoring_func)
        w, ids = run_and_check(logits, b, **kw)
        if scoring_func != "sqrtsoftplus":  # sqrt(softplus(+inf)) is inf: inf/inf is NaN
            assert bool(torch.isfinite(w).all())
        # All-NaN (row 0) and all -inf (row 4): everything ties, so ids follow index order.
        ref_w, ref_ids = moeext.reference.biased_grouped_topk(logits_cpu, b_cpu, **kw)
        for row in (0, 4, 7):
            assert ids[row].tolist() == ref_ids[row].tolist()
        assert ids[0].tolist() == list(range(topk))


@pytest.mark.parametrize("topk", [5, 8, 9, 16, 17, 22, 31, 32])
def test_floor_with_the_best_experts_filling_the_lanes(device_isa, topk):
    """The 32 best experts are 0..31, the rest far below: each vector lane's top-2 (and on
    8 lanes, the top-2 of alternate vectors) are then exactly the best experts, so the
    candidate floor is exactly the k-th best, with no spare candidate to hide an off-by-one."""
    device, _ = device_isa
    g = torch.Generator().manual_seed(topk)
    logits = torch.rand(19, 512, generator=g) - 20.0
    for row in logits:
        row[:32] = torch.randperm(32, generator=g).float() / 4.0
    logits = logits.to(device)
    run_and_check(logits, None, strict=True, num_expert_group=1, topk_group=1, topk=topk)
    run_and_check(logits, torch.zeros(512, device=device), strict=True, num_expert_group=1,
                  topk_group=1, topk=topk)
    # Grouped, every group kept: the floor comes from re-reading the kept ranges.
    run_and_check(logits, None, strict=True, num_expert_group=8, topk_group=1, topk=topk)


@pytest.mark.parametrize("scoring_func", moeext.reference.SCORING_FUNCS)
def test_exp_overflow_and_underflow_ranges(device_isa, scoring_func):
    """Logits spread over +-150: exp overflows and lands in (and below) fp32's subnormals,
    where a path without a scaling instruction (AVX2) builds 2^n from two halves."""
    device, _ = device_isa
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(33, 61, generator=g) * 60
    logits[0] = torch.linspace(-150, 150, 61)
    logits[1] = -110 + torch.arange(61) * 0.25  # every score sits in exp's subnormal range
    subnormal_row = logits[1:2]
    # The reference rounds each exp and log1p correctly, the CPU paths as torch's vectorised
    # exp does, within an ulp of that. In row 1 sqrt-softplus scores are square roots of
    # subnormals, one ulp of which is 1e-3 of the value (2^-149 against ~900 x 2^-149). So
    # there row 1 is held to that spacing, the rest to 2e-6.
    spacing_check = scoring_func == "sqrtsoftplus"
    if spacing_check:
        logits = torch.cat([logits[:1], logits[2:]])
    weights, ids = run_and_check(logits.to(device), None, strict=True, num_expert_group=1,
                                 topk_group=1, topk=7, scoring_func=scoring_func)
    ref_weights, _ = moeext.reference.biased_grouped_topk(logits, None, 1, 1, 7,
                                                          scoring_func=scoring_func)
    torch.testing.assert_close(weights.cpu(), ref_weights, rtol=2e-6, atol=1e-44)
    if spacing_check:
        weights, ids = moeext.biased_grouped_topk(subnormal_row.to(device), None, 1, 1, 7,
                                                  scoring_func=scoring_func)
        ref_weights, ref_ids = moeext.reference.biased_grouped_topk(
            subnormal_row, None, 1, 1, 7, scoring_func=scoring_func)
        assert torch.equal(ids.cpu(), ref_ids)
        smallest_exp = torch.exp(subnormal_row[0, ref_ids[0].long()].double()).min().item()
        torch.testing.assert_close(weights.cpu(), ref_weights, atol=1e-44,
                                   rtol=2 * 2.0**-149 / smallest_exp)


@pytest.mark.parametrize("renormalize", [False, True])
def test_sqrtsoftplus_of_the_smallest_subnormals(device_isa, renormalize):
    """Logits whose exp is m x 2^-149 for m = 1..48, far from any rounding boundary, in an
    order unlike their values: each sqrt-softplus score is sqrt(m x 2^-149) exactly, so
    adjacent m stay apart (no tie for the index rule to break) and the smallest is not 0.
    A log1p that halved its argument first rounded odd m to even ones."""
    device, _ = device_isa
    m = torch.arange(1, 49, dtype=torch.float64)
    g = torch.Generator().manual_seed(11)
    logits = torch.stack([(m.log() - 149 * math.log(2))[torch.randperm(48, generator=g)]
                          for _ in range(5)]).float()
    assert torch.equal(torch.exp(logits.double()).float(),
                       torch.exp(logits.double()).div(2.0**-149).round().mul(2.0**-149).float())
    kw = dict(num_expert_group=1, topk_group=1, topk=12, renormalize=renormalize,
              scoring_func="sqrtsoftplus")
    weights, ids = run_and_check(logits.to(device), None, strict=True, **kw)
    ref_weights, ref_ids = moeext.reference.biased_grouped_topk(logits, None, **kw)
    assert torch.equal(ids.cpu(), ref_ids)
    if renormalize:  # the sum of twelve weights, in whatever order each adds them
        torch.testing.assert_close(weights.cpu(), ref_weights, rtol=2e-6, atol=0)
    else:
        assert torch.equal(weights.cpu(), ref_weights)


# ---------------------------------------------------------------------------------------
# The CPU candidate pass (sqrt-softplus, every group kept): rows are ranked on approximate
# scores to find the experts that can be chosen, and only those are scored exactly. Its
# result must be the exact path's bit for bit. Column-strided logits always take the exact
# path, so the same values in both layouts must route identically.
# ---------------------------------------------------------------------------------------


def _column_strided(logits):
    wide = torch.zeros(logits.shape[0], 2 * logits.shape[1], dtype=logits.dtype)
    wide[:, ::2] = logits
    return wide[:, ::2]


def _route_both_layouts(logits, bias, against_reference=True, **kw):
    if against_reference:
        got = run_and_check(logits, bias, **kw)
    else:
        got = moeext.biased_grouped_topk(logits, bias, **kw)
    exact = moeext.biased_grouped_topk(_column_strided(logits), bias, **kw)
    assert torch.equal(got[1], exact[1])
    # Equal to the bit; an inf logit's row renormalises to NaN on both paths.
    torch.testing.assert_close(got[0], exact[0], rtol=0, atol=0, equal_nan=True)
    return got


def _clustered_rows(num_tokens, bias, cluster, spread, dtype, seed):
    """Rows whose ``cluster`` best experts (random ones) have biased scores b within
    ``spread`` of 3.0 -- far closer than the approximate scores tell apart -- and every other
    expert's b below 2.3."""
    g = torch.Generator().manual_seed(seed)
    num_experts = bias.numel()
    # b = s + bias, s = sqrt(softplus(x)): x = log(expm1(s^2)) puts s where it is wanted.
    logits = torch.full((num_tokens, num_experts), -3.0, dtype=torch.float64)
    logits += torch.rand(num_tokens, num_experts, generator=g, dtype=torch.float64)
    for row in logits:
        members = torch.randperm(num_experts, generator=g)[:cluster]
        wanted = 3.0 - bias.double()[members]
        wanted += spread * torch.rand(cluster, generator=g, dtype=torch.float64)
        row[members] = torch.log(torch.expm1(wanted * wanted))
    return logits.to(dtype)


# (1000, 8) and (1500, 6): the candidates' long range ends in a partial vector, and 1500 spans
# two 64-vector chunks of the gather.
APPROX_SHAPES = [(256, 6), (384, 6), (512, 22), (160, 16), (300, 2), (7, 1), (1000, 8),
                 (1500, 6)]


@pytest.mark.parametrize("num_experts,topk", APPROX_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("bias_dtype", FLOAT_DTYPES + [None])
def test_candidate_pass_is_the_exact_path(cpu_isa, num_experts, topk, bias_dtype):
    kw = dict(num_expert_group=1, topk_group=1, topk=topk, scoring_func="sqrtsoftplus",
              routed_scaling_factor=2.5)
    for logits_dtype in FLOAT_DTYPES:
        logits, bias = make_inputs(97, num_experts, logits_dtype, bias_dtype, seed=topk)
        _route_both_layouts(logits, bias, **kw)


@pytest.mark.parametrize("cluster,spread", [(20, 1e-5), (40, 1e-6), (64, 0.0), (100, 1e-5)])
@pytest.mark.parametrize("num_experts,topk", [(256, 6), (384, 6), (512, 22)])
def test_candidate_pass_near_ties(cpu_isa, num_experts, topk, cluster, spread):
    """Clusters of experts whose exact biased scores differ by less than the approximation's
    error: the approximate order among them is arbitrary, and only the margin below the
    approximate floor keeps every expert the exact order chooses. 100 candidates are more
    than the pass ranks: those rows go to the exact path. (Against the reference these rows
    are near-ties by design, which a 1-ulp difference of exp may reorder: the exact path is
    the oracle here, and test_presets holds it to the reference.)"""
    cluster = max(cluster, topk + 2)  # the cluster holds the whole choice and then some
    g = torch.Generator().manual_seed(cluster)
    bias = 2.0 + 0.05 * torch.randn(num_experts, generator=g)
    kw = dict(num_expert_group=1, topk_group=1, topk=topk, scoring_func="sqrtsoftplus")
    logits = _clustered_rows(41, bias, cluster, spread, torch.float32, seed=num_experts)
    _route_both_layouts(logits, bias, against_reference=False, **kw)
    _route_both_layouts(logits.bfloat16(), bias.bfloat16(), against_reference=False, **kw)


@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_candidate_pass_rows_it_does_not_cover(cpu_isa, logits_dtype):
    """A logit outside the approximation's range [-16, 16), NaN or inf sends its row to the
    exact path; a bias that is not finite, or so large that its rounding swamps the scores,
    the whole call. The positions cover even and odd experts of both vectors of a pair
    (bf16 logits are scored two vectors at a time) and the partial last vector."""
    kw = dict(num_expert_group=1, topk_group=1, topk=6, scoring_func="sqrtsoftplus")
    logits, bias = make_inputs(40, 269, logits_dtype, torch.float32, seed=3)
    logits[1, 5] = 16.0
    logits[2, 7] = -16.125
    logits[3, 9] = 40.0
    logits[4, 0] = float("nan")
    logits[5, 200] = float("inf")
    logits[6, 17] = 15.875
    logits[7, 18] = -16.0
    logits[8, 266] = 16.0
    logits[9, 257] = float("-inf")
    logits[10, 30] = -200.0
    _route_both_layouts(logits, bias, **kw)
    infinite = bias.clone()
    infinite[11] = float("inf")
    _route_both_layouts(logits, infinite, **kw)
    _route_both_layouts(logits, bias * 1e6, **kw)
    _route_both_layouts(logits, bias - 2.0, **kw)


@pytest.mark.parametrize("num_tokens", [16, 17, 31, 48])
@pytest.mark.parametrize("num_experts,topk", [(384, 6), (256, 6), (100, 3), (7, 1)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16, None])
def test_candidate_pass_in_lanes_is_the_row_path(cpu_isa, num_tokens, num_experts, topk,
                                                 bias_dtype):
    """The candidate pass with 16 rows in lanes (AVX-512) against the row path, bit for bit:
    a block of identical rows (fewer marked experts than slots), a block with rows the
    approximation does not cover and near-tie rows among ordinary ones (both left to the row
    pass), a block of uncovered rows only, and rows after the last whole block."""
    kw = dict(num_expert_group=1, topk_group=1, topk=topk, scoring_func="sqrtsoftplus",
              routed_scaling_factor=2.5)
    logits, bias = make_inputs(num_tokens, num_experts, torch.float32, bias_dtype, seed=topk)
    logits[:16] = logits[0]  # one row, 16 times
    if num_tokens >= 32:
        logits[16, 3] = 16.0  # outside the pieces
        logits[18, 1] = float("nan")
        logits[19] = float("-inf")
        cluster_bias = torch.zeros(num_experts) if bias is None else bias.float()
        logits[20:23] = _clustered_rows(3, cluster_bias, min(num_experts, topk + 6), 1e-6,
                                        torch.float32, seed=num_tokens)
    if num_tokens >= 48:
        logits[32:48, num_experts // 2] = 20.0  # a block the approximation covers no row of
    for dtype in FLOAT_DTYPES:
        _route_both_layouts(logits.to(dtype), bias, against_reference=False, **kw)
    _route_both_layouts(logits[:16], bias, **kw)


# Rows in lanes (softmax or sigmoid, up to 256 experts, 16 groups and topk 8, a bias only
# where every group is kept; on AVX2 with every group kept only up to E x topk = 768): 16 rows
# at a time on AVX-512, 8 on AVX2, checked bit for bit against the row-at-a-time path that
# column-strided logits take. 53 rows: three blocks (six on AVX2) and five rows after them.
LANE_TOPOLOGIES = [
    # num_experts, num_expert_group, topk_group, topk
    (160, 8, 3, 6),  # DeepSeek-V2
    (160, 1, 1, 8),  # GLM-4.5
    (256, 16, 5, 8),
    (250, 10, 10, 7),  # every group kept, a partial last vector
    (256, 1, 1, 8),
    (64, 1, 1, 1),
    (48, 4, 2, 5),
    (7, 7, 3, 2),  # groups of one expert
    (16, 2, 1, 8),  # topk == the kept group's size
    (100, 4, 4, 6),  # every group kept, a partial last vector, in lanes on AVX2 too
    (132, 4, 2, 4),  # groups of 33: each group's last expert in its own vector
]
LANE_CASES = [
    (topology, scoring_func, bias_dtype)
    for topology in LANE_TOPOLOGIES
    for scoring_func in ("softmax", "sigmoid")
    for bias_dtype in [None] + (FLOAT_DTYPES if topology[1] == topology[2] else [])
]


@pytest.mark.parametrize(
    "topology,scoring_func,bias_dtype", LANE_CASES,
    ids=["x".join(map(str, t)) + f"-{f}-{str(b).replace('torch.', '')}" for t, f, b in LANE_CASES])
def test_rows_in_lanes_are_the_row_path(cpu_isa, topology, scoring_func, bias_dtype):
    num_experts, num_expert_group, topk_group, topk = topology
    kw = dict(num_expert_group=num_expert_group, topk_group=topk_group, topk=topk,
              scoring_func=scoring_func, routed_scaling_factor=2.5)
    g = torch.Generator().manual_seed(num_experts + topk)
    bias = None
    if bias_dtype is not None:
        bias = (2.0 + 0.05 * torch.randn(num_experts, generator=g)).to(bias_dtype)
    for dtype in FLOAT_DTYPES:
        logits = torch.randn(53, num_experts, generator=g) * 2
        logits[3] = float("nan")
        logits[17, ::3] = float("nan")
        logits[20, 1] = float("inf")
        logits[33] = float("-inf")
        logits[34, num_experts // 2 :] = float("-inf")
        logits[40] = 0.0
        logits[50, 0] = 100.0  # every other softmax score underflows to 0: ties
        logits = logits.to(dtype)
        # Values from a tiny set: ties inside and across groups, in every row.
        ties = torch.randint(-2, 3, (53, num_experts), generator=g).to(dtype)
        tie_bias = None if bias is None else torch.randint(0, 2, (num_experts,), generator=g)
        tie_bias = None if bias is None else tie_bias.to(bias_dtype)
        for renormalize in (True, False):
            _route_both_layouts(logits, bias, renormalize=renormalize, **kw)
            _route_both_layouts(ties, tie_bias, against_reference=False,
                                renormalize=renormalize, **kw)
            run_and_check(ties, tie_bias, strict=True, renormalize=renormalize, **kw)
    if bias is not None:
        # b = -inf and +inf from an infinite bias: -inf experts still fill the slots last.
        infinite = bias.float().clone()
        infinite[::5] = float("-inf")
        infinite[1] = float("inf")
        _route_both_layouts(logits.float(), infinite, against_reference=False, **kw)
    # Row-strided logits (still in lanes), and the _out form into a wider buffer.
    wide = (torch.randn(40, 2 * num_experts + 3, generator=g) * 2).bfloat16()
    logits = wide[:, 3 : 3 + num_experts]
    expected = _route_both_layouts(logits, bias, **kw)
    weights_buf = torch.full((40, topk + 2), -7.0)
    ids_buf = torch.full((40, topk + 2), -7, dtype=torch.int32)
    moeext.biased_grouped_topk_out(logits, bias, weights_buf[:, :topk], ids_buf[:, :topk],
                                   num_expert_group, topk_group, True, 2.5, scoring_func)
    assert bool((weights_buf[:, topk:] == -7.0).all()) and bool((ids_buf[:, topk:] == -7).all())
    assert torch.equal(ids_buf[:, :topk], expected[1])
    assert torch.equal(weights_buf[:, :topk], expected[0])


def test_bias_dtype_is_read_without_casting(cpu_isa):
    """No aten cast or copy runs for a bias or logits of another dtype (SPEC: no cast pass).

    CPU only: it forces each CPU path and reads the CPU profiler's op events."""
    logits, bias = make_inputs(64, 256, torch.bfloat16, torch.float16)
    moeext.biased_grouped_topk(logits, bias, 8, 4, 8)  # warm up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        moeext.biased_grouped_topk(logits, bias, 8, 4, 8)
    names = {e.name for e in prof.events()}
    assert "moeext::biased_grouped_topk" in names
    assert not names & {"aten::to", "aten::_to_copy", "aten::copy_", "aten::contiguous"}, names


def test_threaded_and_single_thread_agree():  # CPU only: torch's CPU thread pool
    logits, bias = make_inputs(4099, 256, torch.float32, torch.float32, seed=21)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = moeext.biased_grouped_topk(logits, bias, 8, 4, 8)
    finally:
        torch.set_num_threads(threads)
    multi = moeext.biased_grouped_topk(logits, bias, 8, 4, 8)
    assert torch.equal(single[1], multi[1]) and torch.equal(single[0], multi[0])


# ---------------------------------------------------------------------------------------
# Invalid arguments: a clear error naming the argument, and nothing written.
# ---------------------------------------------------------------------------------------

def _valid_args(device):
    logits, bias = make_inputs(4, 64, torch.float32, torch.float32, device=device)
    return dict(gating_output=logits, correction_bias=bias, num_expert_group=8, topk_group=4,
                topk=8, renormalize=True, routed_scaling_factor=1.0, scoring_func="sigmoid")


# Each change is a function of the device the test runs on, so the bad argument sits there too.
INVALID = [
    (lambda d: dict(gating_output=torch.zeros(64, device=d)), "gating_output must be 2-D"),
    (lambda d: dict(gating_output=torch.zeros(2, 4, 64, device=d)), "gating_output must be 2-D"),
    (lambda d: dict(gating_output=torch.zeros(4, 64, dtype=torch.float64, device=d)),
     "gating_output must be float32"),
    (lambda d: dict(gating_output=torch.zeros(4, 64, dtype=torch.int32, device=d)),
     "gating_output must be float32"),
    (lambda d: dict(num_expert_group=7),
     "num_expert_group (7) must divide the number of experts (64)"),
    (lambda d: dict(num_expert_group=0), "num_expert_group must be >= 1"),
    (lambda d: dict(topk_group=0), "topk_group must be in [1, num_expert_group = 8], got 0"),
    (lambda d: dict(topk_group=9), "topk_group must be in [1, num_expert_group = 8], got 9"),
    (lambda d: dict(topk=0), "topk must be >= 1"),
    (lambda d: dict(topk=33),
     "topk (33) exceeds the experts in the kept groups (topk_group 4 x 8 per group)"),
    (lambda d: dict(correction_bias=torch.zeros(63, device=d)),
     "correction_bias must have shape [64]"),
    (lambda d: dict(correction_bias=torch.zeros(65, device=d)),
     "correction_bias must have shape [64]"),
    (lambda d: dict(correction_bias=torch.zeros(1, 64, device=d)),
     "correction_bias must have shape [64]"),
    (lambda d: dict(correction_bias=torch.zeros(64, dtype=torch.float64, device=d)),
     "correction_bias must be float32"),
    (lambda d: dict(scoring_func="relu"),
     "scoring_func must be 'sigmoid', 'sqrtsoftplus' or 'softmax'"),
    (lambda d: dict(correction_bias=torch.zeros(64, device="meta")), "correction_bias is on meta"),
]


# The wrappers reach the op by their direct call; torch.ops by its own argument conversion.
CALLERS = {
    "wrapper": (moeext.biased_grouped_topk, moeext.biased_grouped_topk_out),
    "torch.ops": (torch.ops.moeext.biased_grouped_topk, torch.ops.moeext.biased_grouped_topk_out),
}


@pytest.mark.parametrize("caller", list(CALLERS))
@pytest.mark.parametrize("change,message", INVALID, ids=[m for _, m in INVALID])
def test_invalid_arguments(device, change, message, caller):
    route, route_out = CALLERS[caller]
    args = _valid_args(device)
    args.update(change(device))
    with pytest.raises(RuntimeError, match=_literal(message)):
        route(**args)
    # The _out form rejects the same inputs and leaves its outputs untouched.
    if args["gating_output"].dim() == 2 and args["topk"] >= 1:
        num_tokens = args["gating_output"].shape[0]
        weights = torch.full((num_tokens, args["topk"]), -3.0, device=device)
        ids = torch.full((num_tokens, args["topk"]), -3, dtype=torch.int32, device=device)
        out_args = {k: v for k, v in args.items() if k != "topk"}
        with pytest.raises(RuntimeError, match=_literal(message)):
            route_out(topk_weights=weights, topk_ids=ids, **out_args)
        assert bool((weights == -3.0).all()) and bool((ids == -3).all())


def test_none_for_a_tensor_is_named(device):
    # torch.ops passes None on as an undefined tensor, whose error names no argument; the
    # wrappers name it, and the _out form writes nothing.
    args = _valid_args(device)
    with pytest.raises(RuntimeError, match="biased_grouped_topk: gating_output must be a "
                                           "tensor, got None"):
        moeext.biased_grouped_topk(**{**args, "gating_output": None})
    del args["topk"]
    ids = torch.full((4, 8), -3, dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="biased_grouped_topk_out: topk_weights must be a "
                                           "tensor, got None"):
        moeext.biased_grouped_topk_out(**args, topk_weights=None, topk_ids=ids)
    assert bool((ids == -3).all())


INVALID_OUT = [
    (lambda d: dict(topk_weights=torch.zeros(4, 8, dtype=torch.float64, device=d)),
     "topk_weights must be Float"),
    (lambda d: dict(topk_ids=torch.zeros(4, 8, dtype=torch.int64, device=d)),
     "topk_ids must be Int"),
    (lambda d: dict(topk_weights=torch.zeros(5, 8, device=d)),
     "topk_weights must have shape [4, 8]"),
    (lambda d: dict(topk_weights=torch.zeros(4, 7, device=d)),
     "topk_weights must have shape [4, 8]"),
    (lambda d: dict(topk_ids=torch.zeros(8, dtype=torch.int32, device=d)), "topk_ids must be 2-D"),
    (lambda d: dict(topk_weights=torch.zeros(8, 4, device=d).t()),
     "topk_weights must have contiguous columns"),
    (lambda d: dict(topk_weights=torch.zeros(2, 4, device=d).t(),
                    topk_ids=torch.zeros(4, 2, dtype=torch.int32, device=d)),
     "topk_weights must have contiguous columns"),
    (lambda d: dict(topk_weights=torch.zeros(4, 33, device=d),
                    topk_ids=torch.zeros(4, 33, dtype=torch.int32, device=d)),
     "topk (33) exceeds the experts in the kept groups"),
]


@pytest.mark.parametrize("caller", list(CALLERS))
@pytest.mark.parametrize("change,message", INVALID_OUT, ids=[m for _, m in INVALID_OUT])
def test_invalid_out_arguments(device, change, message, caller):
    route_out = CALLERS[caller][1]
    args = _valid_args(device)
    del args["topk"]
    out = dict(topk_weights=torch.full((4, 8), -3.0, device=device),
               topk_ids=torch.full((4, 8), -3, dtype=torch.int32, device=device))
    out.update(change(device))
    with pytest.raises(RuntimeError, match=_literal(message)):
        route_out(**args, **out)
    for t in out.values():
        assert bool((t == -3).all()) or bool((t == 0).all())


# The fakes make the kernels' checks in the kernels' words (dtypes spelled as Python spells
# them), so a traced graph refuses the same arguments. Devices and strides only the kernels
# check: on meta every tensor is on one device.
FAKE_INVALID = [(change, message, False) for change, message in INVALID
                if message != "correction_bias is on meta"]
FAKE_INVALID += [(change, message.replace(" be Float", " be torch.float32")
                  .replace(" be Int", " be torch.int32"), True)
                 for change, message in INVALID_OUT if "contiguous columns" not in message]


@pytest.mark.parametrize("change,message,out_form", FAKE_INVALID,
                         ids=[m for _, m, _ in FAKE_INVALID])
def test_fakes_reject_the_invalid_arguments(change, message, out_form):
    args = _valid_args("meta")
    if out_form:
        del args["topk"]
        outputs = dict(topk_weights=torch.empty(4, 8, device="meta"),
                       topk_ids=torch.empty(4, 8, dtype=torch.int32, device="meta"))
        outputs.update(change("meta"))
        with pytest.raises(RuntimeError, match=_literal(message)):
            moeext.biased_grouped_topk_out(**args, **outputs)
    else:
        args.update(change("meta"))
        with pytest.raises(RuntimeError, match=_literal(message)):
            moeext.biased_grouped_topk(**args)


@pytest.mark.parametrize("caller", list(CALLERS))
def test_out_must_not_overlap_its_inputs_or_itself(device, caller):
    # As torch's out= ops: a write into memory a read or another write covers would make the
    # result depend on the order the kernel touches it in. Refused before anything is written.
    route_out = CALLERS[caller][1]
    args = _valid_args(device)
    del args["topk"]
    num_tokens, num_experts = args["gating_output"].shape
    # One workspace holding the logits and both outputs side by side in each row: no
    # element is shared, so it is accepted, and gives what separate buffers give.
    workspace = torch.zeros(num_tokens, num_experts + 16, device=device)
    workspace[:, :num_experts] = args["gating_output"].float()
    logits = workspace[:, :num_experts]
    bias = args["correction_bias"]
    expected = moeext.biased_grouped_topk(logits, bias, args["num_expert_group"],
                                          args["topk_group"], 8)
    weights = workspace[:, num_experts:num_experts + 8]
    ids = workspace[:, num_experts + 8:].view(torch.int32)
    call = {k: v for k, v in args.items() if k not in ("gating_output", "correction_bias")}
    route_out(gating_output=logits, correction_bias=bias, topk_weights=weights, topk_ids=ids,
              **call)
    assert torch.equal(weights, expected[0]) and torch.equal(ids, expected[1])

    def sentinel(*shape, dtype=torch.float32):
        return torch.full(shape, -3, dtype=dtype, device=device)

    logits_before = logits.clone()
    other_ids = sentinel(num_tokens, 8, dtype=torch.int32)
    other_weights = sentinel(num_tokens, 8)
    shared = sentinel(num_tokens, 8)
    bias_home = sentinel(num_tokens + 1, num_experts)  # row 0 the bias, rows 1.. weights
    bias_home[0] = bias
    cases = [
        (workspace[:, 2:10], other_ids, bias, "topk_weights and gating_output share memory"),
        (other_weights, workspace[:, 4:12].view(torch.int32), bias,
         "topk_ids and gating_output share memory"),
        (shared, shared.view(torch.int32), bias, "topk_weights and topk_ids share memory"),
        (bias_home[:num_tokens, :8], other_ids, bias_home[0],
         "topk_weights and correction_bias share memory"),
        (sentinel(1, 8).expand(num_tokens, 8), other_ids, bias,
         "topk_weights has rows that share memory (row stride 0 < topk 8)"),
        (other_weights, sentinel(40, dtype=torch.int32).as_strided((num_tokens, 8), (5, 1)),
         bias, "topk_ids has rows that share memory (row stride 5 < topk 8)"),
    ]
    for out_weights, out_ids, case_bias, message in cases:
        weights_before, ids_before = out_weights.clone(), out_ids.clone()
        bias_before = case_bias.clone()
        with pytest.raises(RuntimeError, match=_literal(message)):
            route_out(gating_output=logits, correction_bias=case_bias, topk_weights=out_weights,
                      topk_ids=out_ids, **call)
        assert torch.equal(out_weights, weights_before) and torch.equal(out_ids, ids_before)
        assert torch.equal(logits, logits_before) and torch.equal(case_bias, bias_before)


def test_out_overlap_check_is_exact_on_random_layouts(device):
    # Logits and both outputs as strided views of one storage, at random offsets and row
    # strides (often equal, as in a shared workspace): the op refuses exactly the layouts in
    # which an output shares an element with itself, the other output or the logits.
    rng = random.Random(7)
    num_experts, topk = 16, 4
    strides = [0, 3, 4, 8, 12, 16, 20, 37]
    refused = accepted = 0
    for _ in range(400):
        num_tokens = rng.randint(1, 6)
        layout = {}
        for name, width in (("logits", num_experts), ("weights", topk), ("ids", topk)):
            layout[name] = (rng.randrange(0, 160), rng.choice(strides), width)

        def elements(name):
            offset, stride, width = layout[name]
            return {offset + r * stride + c for r in range(num_tokens) for c in range(width)}

        def self_overlap(name):
            return num_tokens > 1 and layout[name][1] < layout[name][2]

        clash = (self_overlap("weights") or self_overlap("ids")
                 or bool(elements("weights") & elements("ids"))
                 or bool(elements("weights") & elements("logits"))
                 or bool(elements("ids") & elements("logits")))
        storage = torch.randn(400, device=device)
        views = {name: storage.as_strided((num_tokens, width), (stride, 1), offset)
                 for name, (offset, stride, width) in layout.items()}
        logits = views["logits"]
        ids = storage.view(torch.int32).as_strided(views["ids"].shape, views["ids"].stride(),
                                                   views["ids"].storage_offset())
        expected = moeext.biased_grouped_topk(logits.clone(), None, 1, 1, topk)
        before = storage.clone()
        if clash:
            refused += 1
            with pytest.raises(RuntimeError, match="share memory"):
                moeext.biased_grouped_topk_out(logits, None, views["weights"], ids, 1, 1)
            assert torch.equal(storage, before), layout
        else:
            accepted += 1
            moeext.biased_grouped_topk_out(logits, None, views["weights"], ids, 1, 1)
            assert torch.equal(ids, expected[1]), layout
            assert torch.equal(views["weights"], expected[0]), layout
    assert refused > 50 and accepted > 50


def _literal(message):
    import re

    return re.escape(message)


# ---------------------------------------------------------------------------------------
# The wrappers' direct call of the op (moeext._C.call_biased_grouped_topk[_out]).
# ---------------------------------------------------------------------------------------

def _positional(logits, bias, preset):
    p = PRESETS[preset]
    return (logits, bias, p.num_expert_group, p.topk_group, p.topk, p.renormalize,
            p.routed_scaling_factor, p.scoring_func)


@pytest.mark.parametrize("preset", ["deepseek-v3", "deepseek-v2", "deepseek-v4-pro"])
@pytest.mark.parametrize("num_tokens", [0, 1, 37])
def test_direct_call_is_the_op(device, preset, num_tokens):
    p = PRESETS[preset]
    logits, bias = make_inputs(num_tokens, p.num_experts, torch.bfloat16,
                               torch.float32 if p.has_bias else None, device=device)
    args = _positional(logits[:, :], bias, preset)
    direct = moeext._C.call_biased_grouped_topk(*args)
    assert isinstance(direct, tuple)  # taken, not declined
    expected = torch.ops.moeext.biased_grouped_topk(*args)
    for got, want in zip(direct, expected):
        assert got.dtype == want.dtype and got.device == want.device
        assert torch.equal(got, want)
    weights = torch.full((num_tokens, p.topk + 2), -3.0, device=device)
    ids = torch.full((num_tokens, p.topk + 2), -3, dtype=torch.int32, device=device)
    out_args = args[:2] + (weights[:, :p.topk], ids[:, :p.topk]) + args[2:4] + args[5:]
    assert moeext._C.call_biased_grouped_topk_out(*out_args) is None
    assert torch.equal(weights[:, :p.topk], expected[0])
    assert torch.equal(ids[:, :p.topk], expected[1])
    assert bool((weights[:, p.topk:] == -3.0).all()) and bool((ids[:, p.topk:] == -3).all())


def test_direct_call_takes_an_int_scaling_factor_as_torch_ops_does():
    # Config files write routed_scaling_factor: 1 or 16 as JSON ints.
    logits, _ = make_inputs(9, 160, torch.bfloat16, None)
    args = (logits, None, 8, 3, 6, False, 16, "softmax")
    direct = moeext._C.call_biased_grouped_topk(*args)
    assert isinstance(direct, tuple)  # taken, not declined
    expected = torch.ops.moeext.biased_grouped_topk(*args[:6], 16.0, args[7])
    assert torch.equal(direct[0], expected[0]) and torch.equal(direct[1], expected[1])
    weights, ids = torch.empty(9, 6), torch.empty(9, 6, dtype=torch.int32)
    moeext._C.call_biased_grouped_topk_out(logits, None, weights, ids, 8, 3, False, 16, "softmax")
    assert torch.equal(weights, expected[0]) and torch.equal(ids, expected[1])


class _Tagged(torch.Tensor):
    """A subclass whose __torch_function__ records the functions it sees."""

    seen = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


def _numpy_int(v):
    import numpy

    return numpy.int64(v)


# Arguments the direct call does not parse itself: it declines, and torch.ops decides.
DECLINED = [
    ("numpy int", lambda a: a[:2] + (_numpy_int(a[2]),) + a[3:]),
    ("int for bool", lambda a: a[:5] + (int(a[5]),) + a[6:]),
    ("bytes for str", lambda a: a[:7] + (a[7].encode(),)),
    ("float for int", lambda a: a[:4] + (float(a[4]),) + a[5:]),
    ("str for float", lambda a: a[:6] + ("2.5",) + a[7:]),
    ("tensor subclass", lambda a: (a[0].as_subclass(_Tagged),) + a[1:]),
    ("list for tensor", lambda a: (a[0].tolist(),) + a[1:]),
]


def test_direct_call_takes_the_schemas_defaults_and_declines_a_missing_argument():
    logits, bias = make_inputs(5, 256, torch.float32, torch.float32)
    direct = moeext._C.call_biased_grouped_topk(logits, bias, 8, 4, 8)  # trailing defaults
    expected = torch.ops.moeext.biased_grouped_topk(logits, bias, 8, 4, 8)
    assert all(torch.equal(g, e) for g, e in zip(direct, expected))
    assert moeext._C.call_biased_grouped_topk(logits, bias, 8, 4) is NotImplemented  # no topk
    too_many = _positional(logits, bias, "deepseek-v3") + (0, 1.0, None, None, None, None, None)
    assert moeext._C.call_biased_grouped_topk(*too_many) is NotImplemented


@pytest.mark.parametrize("change", [c for _, c in DECLINED], ids=[n for n, _ in DECLINED])
def test_direct_call_declines_what_torch_ops_decides(change):
    logits, bias = make_inputs(5, 256, torch.float32, torch.float32)
    args = change(_positional(logits, bias, "deepseek-v3"))
    assert moeext._C.call_biased_grouped_topk(*args) is NotImplemented
    try:
        expected = torch.ops.moeext.biased_grouped_topk(*args)
    except (RuntimeError, TypeError) as error:
        with pytest.raises(type(error)) as raised:
            moeext.biased_grouped_topk(*args)
        assert str(raised.value) == str(error)
    else:
        got = moeext.biased_grouped_topk(*args)
        assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_torch_function_sees_the_op():
    logits, bias = make_inputs(3, 256, torch.float32, torch.float32)
    _Tagged.seen.clear()
    moeext.biased_grouped_topk(logits.as_subclass(_Tagged), bias, 8, 4, 8)
    assert _Tagged.seen and "biased_grouped_topk" in str(_Tagged.seen[0])

    class Record(torch.overrides.TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.seen.append(func)
            return func(*args, **(kwargs or {}))

    weights = torch.empty(3, 8)
    ids = torch.empty(3, 8, dtype=torch.int32)
    with Record() as mode:
        assert moeext._C.call_biased_grouped_topk(logits, bias, 8, 4, 8, True, 2.5,
                                                  "sigmoid") is NotImplemented
        moeext.biased_grouped_topk(logits, bias, 8, 4, 8)
        moeext.biased_grouped_topk_out(logits, bias, weights, ids, 8, 4)
    names = [str(f) for f in mode.seen]
    assert any("biased_grouped_topk_out" in n for n in names)
    assert any("biased_grouped_topk" in n and "_out" not in n for n in names)


def test_torch_dispatch_mode_sees_the_direct_call():
    """Dispatch modes sit in the dispatcher, which the direct call goes through."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func)
            return func(*args, **(kwargs or {}))

    logits, bias = make_inputs(3, 256, torch.float32, torch.float32)
    expected = torch.ops.moeext.biased_grouped_topk(logits, bias, 8, 4, 8, True, 2.5, "sigmoid")
    with Record() as mode:
        got = moeext._C.call_biased_grouped_topk(logits, bias, 8, 4, 8, True, 2.5, "sigmoid")
    assert mode.seen == [torch.ops.moeext.biased_grouped_topk.default]
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_wrappers_under_fake_tensor_mode():
    """Fake tensors are a subclass: the direct call declines them, torch.ops takes them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        logits = mode.from_tensor(torch.randn(6, 256))
        bias = mode.from_tensor(torch.randn(256, dtype=torch.bfloat16))
        weights, ids = moeext.biased_grouped_topk(logits, bias, 8, 4, 8)
        assert weights.shape == (6, 8) and weights.dtype == torch.float32
        assert ids.shape == (6, 8) and ids.dtype == torch.int32
        with pytest.raises(RuntimeError, match=_literal("topk (129) exceeds the experts")):
            moeext.biased_grouped_topk(logits, bias, 8, 4, 129)


def test_direct_call_tracks_autograd_as_torch_ops_does():
    logits = torch.randn(4, 64, requires_grad=True)
    by_ops = torch.ops.moeext.biased_grouped_topk(logits, None, 8, 4, 8)
    direct = moeext._C.call_biased_grouped_topk(logits, None, 8, 4, 8, True, 1.0, "sigmoid")
    for got, want in zip(direct, by_ops):
        assert got.requires_grad == want.requires_grad
        assert type(got.grad_fn) is type(want.grad_fn)


def test_wrappers_still_script():
    """TorchScript skips the direct call (it cannot compile it) and scripts torch.ops."""
    logits, bias = make_inputs(5, 256, torch.float32, torch.float32)
    route = torch.jit.script(moeext.biased_grouped_topk)
    got = route(logits, bias, 8, 4, 8, True, 2.5, "sigmoid")
    expected = torch.ops.moeext.biased_grouped_topk(logits, bias, 8, 4, 8, True, 2.5, "sigmoid")
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    route_out = torch.jit.script(moeext.biased_grouped_topk_out)
    weights = torch.empty(5, 8)
    ids = torch.empty(5, 8, dtype=torch.int32)
    route_out(logits, bias, weights, ids, 8, 4, True, 2.5, "sigmoid")
    assert torch.equal(weights, expected[0]) and torch.equal(ids, expected[1])


def test_direct_call_releases_the_gil():
    """Another Python thread runs while a long call routes, as it does through torch.ops."""
    logits, bias = make_inputs(100_000, 256, torch.bfloat16, torch.float32)
    window, stamps = [], []

    def route():
        start = time.perf_counter()
        moeext.biased_grouped_topk(logits, bias, 8, 4, 8)
        window.extend([start, time.perf_counter()])

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        route()  # the call's duration with no other thread (about 15 ms)
        duration = window[1] - window[0]
        window.clear()
        worker = threading.Thread(target=route)
        worker.start()
        while worker.is_alive():
            stamps.append(time.perf_counter())
        worker.join()
    finally:
        torch.set_num_threads(previous)
    # Holding the GIL, the call would keep this thread waiting until it returns.
    after = [t for t in stamps if t > window[0]]
    assert after and after[0] < window[0] + 0.5 * duration


def test_direct_call_raises_memory_error_as_torch_ops_does():
    """A workspace the allocator refuses (std::bad_alloc) is a MemoryError through both paths,
    as pybind11 maps it for torch.ops; torch's own handler made it a RuntimeError. In a child
    process, whose address space is capped just above its size before each call."""
    import ctypes
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import resource, torch, moeext
        logits = torch.randn(8, 1 << 20, dtype=torch.bfloat16)  # a 25 MB heap workspace
        moeext.biased_grouped_topk(logits, None, 1, 1, 8)
        def address_space():
            with open("/proc/self/status") as status:
                return next(int(line.split()[1]) * 1024 for line in status
                            if line.startswith("VmSize"))
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        for call in (lambda: moeext.biased_grouped_topk(logits, None, 1, 1, 8),
                     lambda: torch.ops.moeext.biased_grouped_topk(logits, None, 1, 1, 8, True,
                                                                  1.0, "sigmoid")):
            resource.setrlimit(resource.RLIMIT_AS, (address_space() + (4 << 20), hard))
            try:
                call()
                print("no error")
            except Exception as e:
                print(type(e).__name__, e)
            finally:
                resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        print(torch.equal(moeext.biased_grouped_topk(logits, None, 1, 1, 8)[1],
                          moeext.reference.biased_grouped_topk(logits, None, 1, 1, 8)[1]))
    """)
    if hasattr(ctypes.CDLL(None), "__asan_init"):
        # .ci/cpu_sanitize.sh: ASan's operator new reports and exits where it cannot allocate.
        pytest.skip("under AddressSanitizer, which does not throw std::bad_alloc")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == 0, f"exit {child.returncode}: {child.stderr[-3000:]}"
    assert child.stdout.splitlines() == ["MemoryError std::bad_alloc"] * 2 + ["True"]


# ---------------------------------------------------------------------------------------
# Property-based: random topologies, dtypes, strides and values against the reference.
# ---------------------------------------------------------------------------------------

@st.composite
def routing_problems(draw):
    num_expert_group = draw(st.integers(1, 16))
    group_size = draw(st.integers(1, 40))
    num_experts = num_expert_group * group_size
    topk_group = draw(st.integers(1, num_expert_group))
    topk = draw(st.integers(1, min(40, topk_group * group_size)))
    num_tokens = draw(st.integers(0, 40))
    logits_dtype = draw(st.sampled_from(FLOAT_DTYPES))
    bias_dtype = draw(st.sampled_from(FLOAT_DTYPES + [None]))
    scoring_func = draw(st.sampled_from(moeext.reference.SCORING_FUNCS))
    renormalize = draw(st.booleans())
    scale = draw(st.sampled_from([1.0, 2.5, 0.3]))
    seed = draw(st.integers(0, 2**31 - 1))
    special = draw(st.sampled_from(["none", "nan", "inf", "ties"]))
    transpose = draw(st.booleans())
    return (num_tokens, num_experts, num_expert_group, topk_group, topk, logits_dtype,
            bias_dtype, scoring_func, renormalize, scale, seed, special, transpose)


def routing_problem_inputs(problem, device):
    """A routing_problems() draw as ``(logits, bias, args)``, args the op's positional ones."""
    (num_tokens, num_experts, num_expert_group, topk_group, topk, logits_dtype, bias_dtype,
     scoring_func, renormalize, scale, seed, special, transpose) = problem
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g) * 3
    if special == "nan":
        logits[torch.rand(logits.shape, generator=g) < 0.2] = float("nan")
    elif special == "inf":
        logits[torch.rand(logits.shape, generator=g) < 0.1] = float("inf")
        logits[torch.rand(logits.shape, generator=g) < 0.1] = float("-inf")
    elif special == "ties":
        logits = logits.round()
    logits = logits.to(logits_dtype).to(device)
    if transpose:
        logits = logits.t().contiguous().t()
    bias = None
    if bias_dtype is not None:
        bias = torch.randn(num_experts, generator=g)
        bias = (bias.round() if special == "ties" else bias).to(bias_dtype).to(device)
    return logits, bias, (num_expert_group, topk_group, topk, renormalize, scale, scoring_func)


def _decode_results():
    """A decode step's CPU results: routing's two, router_gemm's logits, fused_router's two."""
    p = PRESETS["deepseek-v3"]
    logits, bias = make_inputs(3, p.num_experts, torch.bfloat16, torch.float32)
    hidden = torch.randn(3, 64).bfloat16()
    gate = torch.randn(p.num_experts, 64).bfloat16()
    args = (p.num_expert_group, p.topk_group, p.topk)
    return {"biased_grouped_topk": moeext.biased_grouped_topk(logits, bias, *args),
            "router_gemm": (moeext.router_gemm(hidden, gate),),
            "fused_router": moeext.fused_router(hidden, gate, bias, *args)[:2]}


def test_decode_results_are_ordinary_tensors():
    """Small CPU results come from malloc (cpu_memory.h): aligned as torch.empty's, growable
    past the small size, and freed from any thread."""
    for op, results in _decode_results().items():
        for t in results:
            assert t.data_ptr() % 64 == 0, op
            first = t.clone()
            t.resize_(1 << 16)  # 256 KiB: the storage grows through its allocator
            assert torch.equal(t[:first.numel()], first.flatten()), op
            t.fill_(1)
            assert bool((t == 1).all()), op
    freed = _decode_results()
    worker = threading.Thread(target=freed.clear)
    worker.start()
    worker.join()
    assert not freed


def test_decode_results_are_counted_by_the_memory_profiler():
    """While a profiler counts memory, the results come from torch's CPU allocator, which
    reports them: each op's own allocations are in its row."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _decode_results()
    used = {e.key: e.self_cpu_memory_usage for e in prof.key_averages()}
    assert used["moeext::biased_grouped_topk"] >= 2 * 3 * 8 * 4
    assert used["moeext::router_gemm"] >= 3 * 256 * 4
    assert used["moeext::fused_router"] >= 2 * 3 * 8 * 4


# Parametrised rather than a fixture: hypothesis reruns the body, not function-scoped fixtures.
# The drawn CPU path only matters on the cpu.
@pytest.mark.parametrize("device", DEVICES)
@given(problem=routing_problems(), isa=st.sampled_from(moeext.build_info()["cpu_isas_compiled"]))
def test_property_matches_reference(device, problem, isa):
    if isa not in moeext.build_info()["cpu_isas_available"]:
        isa = "portable"
    logits, bias, args = routing_problem_inputs(problem, device)
    previous = moeext.cpu_isa()
    moeext.set_cpu_isa(isa)
    try:
        w, ids = moeext.biased_grouped_topk(logits, bias, *args)
    finally:
        moeext.set_cpu_isa(previous)
    assert w.device == logits.device and ids.device == logits.device
    assert_routing_matches(w, ids, logits, bias, *args)


@st.composite
def near_tie_problems(draw):
    """Rows whose best experts lie within 1e-7 to 1e-3 of each other (many within an ulp of
    b after scoring), some of them with identical inputs, on every path: groups or not, rows
    in lanes (16 rows and more), the candidate pass (sqrt-softplus, every group kept)."""
    num_expert_group = draw(st.sampled_from([1, 1, 2, 4, 8]))
    group_size = draw(st.sampled_from([8, 16, 20, 32, 48, 64]))
    num_experts = num_expert_group * group_size
    topk_group = draw(st.integers(1, num_expert_group))
    topk = draw(st.integers(1, min(24, topk_group * group_size)))
    num_tokens = draw(st.sampled_from([1, 5, 16, 23, 40]))
    logits_dtype = draw(st.sampled_from(FLOAT_DTYPES))
    bias_kind = draw(st.sampled_from([None, "v3", "rounded"]))
    scoring_func = draw(st.sampled_from(moeext.reference.SCORING_FUNCS))
    spread = draw(st.sampled_from([1e-7, 1e-5, 1e-3]))
    centre = draw(st.sampled_from([-2.0, 0.5, 3.0, 14.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    return (num_tokens, num_experts, num_expert_group, topk_group, topk, logits_dtype,
            bias_kind, scoring_func, spread, centre, seed)


def near_tie_problem_inputs(problem, device):
    """A near_tie_problems() draw as ``(logits, bias, kw)``, kw the op's keyword arguments."""
    (num_tokens, num_experts, num_expert_group, topk_group, topk, logits_dtype, bias_kind,
     scoring_func, spread, centre, seed) = problem
    g = torch.Generator().manual_seed(seed)
    logits = centre - 3.0 + torch.rand(num_tokens, num_experts, generator=g)
    for row in logits:
        members = torch.randperm(num_experts, generator=g)[: 2 * topk + 2]
        row[members] = centre + spread * torch.randn(members.numel(), generator=g)
        twins = members[: members.numel() // 3]
        row[twins] = row[twins[0]].item()  # identical inputs: the tie rule decides among them
    logits = logits.to(logits_dtype).to(device)
    bias = None
    if bias_kind == "v3":
        bias = (2.0 + 0.05 * torch.randn(num_experts, generator=g)).to(device)
    elif bias_kind == "rounded":
        bias = torch.randn(num_experts, generator=g).round().to(device)
    kw = dict(num_expert_group=num_expert_group, topk_group=topk_group, topk=topk,
              renormalize=True, routed_scaling_factor=2.5, scoring_func=scoring_func)
    return logits, bias, kw


@pytest.mark.parametrize("device", DEVICES)
@given(problem=near_tie_problems(), isa=st.sampled_from(moeext.build_info()["cpu_isas_compiled"]))
def test_property_near_ties_are_valid_choices(device, problem, isa):
    """Near ties the reference's own rounding cannot referee (assert_routing_matches allows a
    differing row only rarely): every choice must be one float64 scores allow within a few
    ulps, and identical experts must follow the tie rule."""
    if isa not in moeext.build_info()["cpu_isas_available"]:
        isa = "portable"
    logits, bias, kw = near_tie_problem_inputs(problem, device)
    previous = moeext.cpu_isa()
    moeext.set_cpu_isa(isa)
    try:
        weights, ids = moeext.biased_grouped_topk(logits, bias, **kw)
    finally:
        moeext.set_cpu_isa(previous)
    assert_valid_routing(weights, ids, logits, bias, **kw)


# Gradients: the weights are differentiable in the logits (SPEC section 1 steps 1, 6, 7 at the
# chosen ids). The oracle is torch's autograd through moeext.reference.


def _gradients(route, base, bias, grad_weights, columns, **kw):
    logits = base.detach().clone().requires_grad_()
    weights, ids = route(logits[:, columns], bias, **kw)
    assert weights.requires_grad and not ids.requires_grad
    (grad,) = torch.autograd.grad(weights, logits, grad_weights)
    return ids, grad


def _check_gradient(device, num_tokens, num_experts, logits_dtype, bias_dtype, strided, **kw):
    # Strided: the op reads every other column of a wider leaf, whose other columns get 0.
    width = 2 * num_experts if strided else num_experts
    base, _ = make_inputs(num_tokens, width, logits_dtype, None, device=device)
    _, bias = make_inputs(0, num_experts, logits_dtype, bias_dtype, seed=1, device=device)
    columns = slice(None, None, 2) if strided else slice(None)
    g = torch.Generator().manual_seed(num_tokens)
    grad_weights = torch.randn(num_tokens, kw["topk"], generator=g).to(device)
    ids, got = _gradients(moeext.biased_grouped_topk, base, bias, grad_weights, columns, **kw)
    ref_ids, expected = _gradients(moeext.reference.biased_grouped_topk, base, bias,
                                   grad_weights, columns, **kw)
    assert torch.equal(ids, ref_ids)
    assert got.dtype == logits_dtype and got.shape == base.shape
    torch.testing.assert_close(got, expected)
    if strided:
        assert bool((got[:, 1::2] == 0).all())


@pytest.mark.parametrize("scoring_func", moeext.reference.SCORING_FUNCS)
def test_reference_scores_under_autograd(scoring_func):
    """The oracle's scores keep their values where the logits require grad, and their
    derivative is that of torch's own functions, also where exp overflows float32; the
    sqrt-softplus score's below x = -20 is exp(x / 2) / 2, finite where softplus underflows."""
    x = torch.tensor([[-1e30, -150.0, -95.0, -50.0, -1.0, 0.0, 0.5, 19.5, 20.5, 95.0, 1e30],
                      [-3.0, float("-inf"), float("nan"), 2.0, 0.0, 1.0, -1.0, 3.0, 4.0, 5.0,
                       float("inf")]])
    plain, _ = moeext.reference.routing_scores(x, None, scoring_func)
    leaf = x.clone().requires_grad_()
    scores, _ = moeext.reference.routing_scores(leaf, None, scoring_func)
    torch.testing.assert_close(scores.detach(), plain, rtol=0, atol=0, equal_nan=True)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    scores.backward(grad)
    torch_leaf = x.clone().requires_grad_()
    if scoring_func == "sigmoid":
        expected = torch.sigmoid(torch_leaf)
    elif scoring_func == "sqrtsoftplus":
        expected = torch.sqrt(torch.nn.functional.softplus(torch_leaf))
    else:
        e = torch.exp(torch_leaf - torch_leaf.amax(dim=-1, keepdim=True))
        expected = e / e.sum(dim=-1, keepdim=True)
    expected.backward(grad)
    expected_grad = torch_leaf.grad
    if scoring_func == "sqrtsoftplus":
        far = x < -20
        expected_grad = torch.where(far, grad * torch.exp(0.5 * x) * 0.5, expected_grad)
        assert bool(torch.isfinite(expected_grad[far]).all())
    torch.testing.assert_close(leaf.grad, expected_grad, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("scoring_func", moeext.reference.SCORING_FUNCS)
@pytest.mark.parametrize("logits_dtype", FLOAT_DTYPES)
def test_gradient_matches_reference(device, logits_dtype, scoring_func, renormalize):
    for bias_dtype in (None, torch.bfloat16):
        _check_gradient(device, 37, 96, logits_dtype, bias_dtype, strided=True,
                        num_expert_group=8, topk_group=3, topk=7, renormalize=renormalize,
                        routed_scaling_factor=2.5, scoring_func=scoring_func)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_gradient_presets(device, preset):
    p = PRESETS[preset]
    _check_gradient(device, 9, p.num_experts, torch.float32,
                    torch.float32 if p.has_bias else None, strided=False, **p.op_kwargs())


def test_gradient_large_logits_take_softplus_linear_branch(device):
    # Above softplus's threshold 20 the score is sqrt(x): its own derivative, not sigmoid's.
    base = torch.linspace(-30, 30, 64, device=device).repeat(3, 1)
    grad_weights = torch.ones(3, 4, device=device)
    kw = dict(num_expert_group=1, topk_group=1, topk=4, renormalize=False,
              routed_scaling_factor=1.0, scoring_func="sqrtsoftplus")
    _, got = _gradients(moeext.biased_grouped_topk, base, None, grad_weights, slice(None), **kw)
    expected = 0.5 / base[:, -4:].sqrt()
    torch.testing.assert_close(got[:, -4:], expected)
    assert bool((got[:, :-4] == 0).all())


def test_gradient_reaches_neither_bias_nor_ids(device):
    logits, bias = make_inputs(5, 64, torch.float32, torch.float32, device=device)
    logits.requires_grad_()
    bias.requires_grad_()
    weights, ids = moeext.biased_grouped_topk(logits, bias, 8, 4, 8)
    assert weights.requires_grad and not ids.requires_grad
    # Not weights.sum(): renormalised weights sum to a constant, whose gradient is 0.
    grad_logits, grad_bias = torch.autograd.grad((weights * torch.rand_like(weights)).sum(),
                                                 [logits, bias], allow_unused=True)
    assert grad_bias is None
    assert grad_logits.shape == logits.shape and bool(grad_logits.abs().sum() > 0)
    # Only the bias requires grad: weights carry a node, and its gradient is still none.
    weights, _ = moeext.biased_grouped_topk(logits.detach(), bias, 8, 4, 8)
    assert torch.autograd.grad(weights.sum(), bias, allow_unused=True) == (None,)


def test_gradient_of_no_tokens(device):
    logits = torch.empty(0, 64, device=device, requires_grad=True)
    weights, _ = moeext.biased_grouped_topk(logits, None, 8, 4, 8)
    (grad,) = torch.autograd.grad(weights.sum(), logits, allow_unused=True,
                                  materialize_grads=True)
    assert grad.shape == (0, 64)


def test_no_graph_where_no_gradient_is_wanted(device):
    logits, bias = make_inputs(5, 64, torch.float32, torch.float32, device=device)
    expected = moeext.biased_grouped_topk(logits, bias, 8, 4, 8)
    logits.requires_grad_()
    with torch.no_grad():
        weights, ids = moeext.biased_grouped_topk(logits, bias, 8, 4, 8)
    assert weights.grad_fn is None and not weights.requires_grad
    with torch.inference_mode():
        weights, ids = moeext.biased_grouped_topk(logits, bias, 8, 4, 8)
    assert weights.is_inference() and torch.equal(ids, expected[1])
    # The out= form records no gradient: where one is wanted it raises before writing, as
    # torch's out= ops do; under no_grad it writes and records nothing.
    out_w = torch.zeros(5, 8, device=device)
    out_ids = torch.zeros(5, 8, dtype=torch.int32, device=device)
    for call in (moeext.biased_grouped_topk_out, torch.ops.moeext.biased_grouped_topk_out):
        with pytest.raises(RuntimeError, match="gating_output requires grad, but the out= form"):
            call(logits, bias, out_w, out_ids, 8, 4)
        assert not out_w.any() and not out_ids.any() and out_w._version == 0
    with torch.no_grad():
        moeext.biased_grouped_topk_out(logits, bias, out_w, out_ids, 8, 4)
    assert not out_w.requires_grad and out_w.grad_fn is None
    assert torch.equal(out_w, expected[0]) and torch.equal(out_ids, expected[1])
    # Writing into weights that require grad is refused the same way.
    grad_w = torch.zeros(5, 8, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="topk_weights requires grad, but the out= form"):
        moeext.biased_grouped_topk_out(logits.detach(), bias, grad_w, out_ids, 8, 4)
    assert not grad_w.any()
    # A bias that requires grad is let through, as in the functional form: the weights'
    # derivative in it is zero wherever it exists.
    moeext.biased_grouped_topk_out(logits.detach(), bias.requires_grad_(), out_w, out_ids, 8, 4)
    assert not out_w.requires_grad and torch.equal(out_ids, expected[1])


def test_out_form_bumps_the_versions_of_what_it_writes(device):
    # As torch's own out= ops: a backward through a value the out= form overwrote raises
    # instead of using the new values, and a failed call bumps nothing.
    logits, bias = make_inputs(5, 64, torch.float32, torch.float32, device=device)
    out_w = torch.zeros(5, 8, device=device)
    out_ids = torch.zeros(5, 8, dtype=torch.int32, device=device)
    before = (out_w._version, out_ids._version)
    moeext.biased_grouped_topk_out(logits, bias, out_w, out_ids, 8, 4)
    assert (out_w._version, out_ids._version) == (before[0] + 1, before[1] + 1)
    torch.ops.moeext.biased_grouped_topk_out(logits, bias, out_w, out_ids, 8, 4)
    assert (out_w._version, out_ids._version) == (before[0] + 2, before[1] + 2)
    with pytest.raises(RuntimeError, match="num_expert_group"):
        moeext.biased_grouped_topk_out(logits, bias, out_w, out_ids, 7, 4)
    assert (out_w._version, out_ids._version) == (before[0] + 2, before[1] + 2)

    x = torch.randn(5, 8, device=device, requires_grad=True)
    y = x.exp()  # saves its result for the backward
    moeext.biased_grouped_topk_out(logits, bias, y.detach(), out_ids, 8, 4)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()

    # Inference tensors have no version to bump: written inside inference mode or outside.
    with torch.inference_mode():
        inf_w, inf_ids = torch.zeros_like(out_w), torch.zeros_like(out_ids)
        moeext.biased_grouped_topk_out(logits, bias, inf_w, inf_ids, 8, 4)
    assert torch.equal(inf_w, out_w) and torch.equal(inf_ids, out_ids)
    with torch.inference_mode():
        inf_w.zero_()
    moeext.biased_grouped_topk_out(logits, bias, inf_w, inf_ids, 8, 4)
    assert torch.equal(inf_w, out_w)


@pytest.mark.parametrize("device", GPU_DEVICES or [pytest.param("cuda", marks=pytest.mark.skip(
    reason="needs a GPU and a moeext built for it"))])
@pytest.mark.parametrize("variant", [1, 2, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("scoring_func", moeext.reference.SCORING_FUNCS)
# And the model gates with instances of their own (FixedTopology): the current kernel's (which
# variants 4 to 8 route otherwise), then variant 2's.
@pytest.mark.parametrize("topology", TOPOLOGIES + [(256, 8, 4, 8), (384, 1, 1, 8), (256, 1, 1, 6),
                                                   (384, 1, 1, 6), (512, 1, 1, 22)],
                         ids=lambda t: "x".join(map(str, t)))
def test_routing_variant_is_the_current_kernel(device, topology, scoring_func, variant):
    """Each variant of the warp kernel (moeext._C._set_gpu_routing_variant, kept for A/B
    timing) gives the current kernel's bits (which the other tests hold to the reference): odd
    batches, every logits dtype with each bias dtype, rows of ties, NaN, inf and -inf (some
    winning by their bias) and of subnormal scores, and a column-strided view."""
    num_experts, num_expert_group, topk_group, topk = topology
    kw = dict(num_expert_group=num_expert_group, topk_group=topk_group, topk=topk,
              routed_scaling_factor=2.5, scoring_func=scoring_func)
    cases = []
    for logits_dtype in FLOAT_DTYPES:
        for bias_dtype in (None, torch.float32, torch.bfloat16):
            logits, bias = make_inputs(1031, num_experts, logits_dtype, bias_dtype,
                                       seed=num_experts + topk, device=device)
            logits[0] = float("nan")
            logits[1, ::3] = float("nan")
            logits[2, : num_experts // 2] = float("inf")
            logits[3] = 0.0  # every expert ties
            logits[4, ::2] = float("-inf")
            # -inf scores 0, so a bias ranks those experts; below about -87.3 the sigmoid is
            # subnormal (the reciprocal's slow path), ranked by its value without a bias.
            logits[5] = float("-inf")
            logits[5, [0, num_experts // 3, num_experts // 2]] = 1.0
            low = torch.rand(num_experts, generator=torch.Generator().manual_seed(6))
            logits[6] = (-88.0 - 14.0 * low).to(device)
            cases.append((logits, bias))
            wide = torch.zeros(97, 2 * num_experts, dtype=logits_dtype, device=device)
            wide[:, ::2] = logits[:97]
            cases.append((wide[:, ::2], bias))
    previous = moeext._C._set_gpu_routing_variant(0)
    try:
        for logits, bias in cases:
            current = moeext.biased_grouped_topk(logits, bias, **kw)
            moeext._C._set_gpu_routing_variant(variant)
            other = moeext.biased_grouped_topk(logits, bias, **kw)
            moeext._C._set_gpu_routing_variant(0)
            assert_same_bits(other[1], current[1], (logits.dtype, bias))
            assert_same_bits(other[0], current[0], (logits.dtype, bias))
    finally:
        moeext._C._set_gpu_routing_variant(previous)
