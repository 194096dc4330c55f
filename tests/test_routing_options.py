"""The routing options engines need (docs/SPEC.md section 6): fused shared experts, an expert
map, per-expert counts, a record of the routed ids, valid rows, and the replay op
routing_weights.

The options act on the routed choice, so each result is compared exactly with
moeext.reference.apply_routing_options applied to the same op's plain result (same device,
same CPU path): that tests the options bit for bit, free of the ulp-level near ties a
comparison with the reference's routing allows (tests/test_grouped_topk.py covers those).
"""

import pytest
import torch

import moeext
from conftest import GPU_DEVICES
from moeext import reference
from moeext.presets import PRESETS

PRESET_NAMES = ["deepseek-v3", "kimi-k2", "deepseek-v2", "deepseek-v4-flash", "nemotron-style"]


def make_inputs(num_tokens, preset, seed=0, device="cpu", logits_dtype=torch.bfloat16):
    p = PRESETS[preset]
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(num_tokens, p.num_experts, generator=g) * 2).to(logits_dtype)
    bias = 2.0 + 0.05 * torch.randn(p.num_experts, generator=g) if p.has_bias else None
    return logits.to(device), None if bias is None else bias.to(device)


def random_map(num_ids, seed, device):
    """A map of global ids to local ones, -1 for about a third of them (experts held elsewhere)."""
    g = torch.Generator().manual_seed(seed)
    local = torch.randperm(num_ids, generator=g).to(torch.int32)
    local[torch.rand(num_ids, generator=g) < 1 / 3] = -1
    return local.to(device)


def expected_options(plain_weights, plain_ids, num_experts, counts=None, routed=None, **options):
    """The reference's options on copies of the buffers; returns (weights, ids, counts, routed)."""
    counts = None if counts is None else counts.clone()
    routed = None if routed is None else routed.clone()
    weights, ids = reference.apply_routing_options(plain_weights, plain_ids, num_experts,
                                                   expert_counts=counts, routed_experts=routed,
                                                   **options)
    return weights, ids, counts, routed


def assert_same(got, expected):
    for g, e in zip(got, expected):
        if e is None:
            assert g is None
        else:
            assert g.dtype == e.dtype and g.shape == e.shape
            assert torch.equal(g.cpu(), e.cpu())


@pytest.mark.parametrize("num_tokens", [1, 7, 300])
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_every_option_on_the_routed_choice(device_isa, preset, num_tokens):
    device, _ = device_isa
    p = PRESETS[preset]
    logits, bias = make_inputs(num_tokens, preset, seed=num_tokens, device=device)
    plain = moeext.biased_grouped_topk(logits, bias, **p.op_kwargs())
    shared = 2
    expert_map = random_map(p.num_experts + shared, seed=num_tokens, device=device)
    counts = torch.arange(p.num_experts, dtype=torch.int64, device=device)  # accumulates
    routed = torch.full((num_tokens + 3, p.topk), -7, dtype=torch.int16, device=device)
    valid = torch.tensor([num_tokens - num_tokens // 3], dtype=torch.int32, device=device)
    options = dict(num_fused_shared_experts=shared, shared_expert_weight=0.4,
                   expert_map=expert_map, num_valid_tokens=valid)
    expected = expected_options(*plain, p.num_experts, counts, routed, **options)
    got = moeext.biased_grouped_topk(logits, bias, **p.op_kwargs(), expert_counts=counts,
                                     routed_experts=routed, **options)
    assert_same((*got, counts, routed), expected)


@pytest.mark.parametrize("option", ["shared", "map", "counts32", "counts64", "routed16",
                                    "routed32", "valid64"])
def test_each_option_alone(device_isa, option):
    device, _ = device_isa
    p = PRESETS["deepseek-v3"]
    num_tokens = 37
    logits, bias = make_inputs(num_tokens, "deepseek-v3", seed=3, device=device)
    plain = moeext.biased_grouped_topk(logits, bias, **p.op_kwargs())
    kw, counts, routed = {}, None, None
    if option == "shared":
        kw = dict(num_fused_shared_experts=1)
    elif option == "map":
        kw = dict(expert_map=random_map(p.num_experts, 4, device))
    elif option.startswith("counts"):
        counts = torch.zeros(p.num_experts, device=device,
                             dtype=torch.int32 if option == "counts32" else torch.int64)
    elif option.startswith("routed"):
        routed = torch.zeros(num_tokens, p.topk, device=device,
                             dtype=torch.int16 if option == "routed16" else torch.int32)
    else:  # a count alone changes nothing; with a record it limits the rows recorded
        routed = torch.full((num_tokens, p.topk), -1, dtype=torch.int32, device=device)
        kw = dict(num_valid_tokens=torch.tensor(20, device=device))
    expected = expected_options(*plain, p.num_experts, counts, routed, **kw)
    got = moeext.biased_grouped_topk(logits, bias, **p.op_kwargs(), expert_counts=counts,
                                     routed_experts=routed, **kw)
    assert_same((*got, counts, routed), expected)


@pytest.mark.parametrize("device", GPU_DEVICES or [pytest.param("cuda", marks=pytest.mark.skip(
    reason="needs a GPU and a moeext built for it"))])
@pytest.mark.parametrize("preset", ["deepseek-v3", "kimi-k2"])
def test_routing_variant_3_is_the_current_kernel_with_options(device, preset):
    """Routing variant 3 (moeext._C._set_gpu_routing_variant, kept for A/B timing) routes a call
    with options of a gate with its own warp kernel instance with that instance: the current
    kernel's ids, weights, counts and record, for every logits dtype with each bias dtype,
    rows of NaN, inf and ties, a column-strided view, each option alone and all together."""
    p = PRESETS[preset]
    num_tokens = 300
    inputs = []
    for logits_dtype in (torch.float32, torch.bfloat16, torch.float16):
        for bias_dtype in (torch.float32, torch.bfloat16):
            logits, bias = make_inputs(num_tokens, preset, seed=7, device=device,
                                       logits_dtype=logits_dtype)
            logits[0] = float("nan")
            logits[1, ::3] = float("inf")
            logits[2] = 0.0  # every expert ties
            inputs.append((logits, bias.to(bias_dtype)))
    wide = torch.zeros(num_tokens, 2 * p.num_experts, dtype=torch.bfloat16, device=device)
    wide[:, ::2] = inputs[1][0]
    inputs.append((wide[:, ::2], inputs[1][1]))
    shared_map = random_map(p.num_experts + 1, seed=5, device=device)
    valid = torch.tensor([num_tokens - 40], dtype=torch.int64, device=device)
    cases = [(dict(num_fused_shared_experts=1), None, None),
             (dict(expert_map=random_map(p.num_experts, seed=6, device=device)), None, None),
             ({}, torch.int32, None), ({}, None, torch.int16),
             (dict(num_fused_shared_experts=1, shared_expert_weight=0.3, expert_map=shared_map,
                   num_valid_tokens=valid), torch.int64, torch.int32)]

    def run(logits, bias, options, counts_dtype, record_dtype):
        counts = (None if counts_dtype is None
                  else torch.arange(p.num_experts, device=device).to(counts_dtype))
        routed = (None if record_dtype is None else
                  torch.full((num_tokens + 2, p.topk), -3, dtype=record_dtype, device=device))
        weights, ids = moeext.biased_grouped_topk(logits, bias, **p.op_kwargs(), **options,
                                                  expert_counts=counts, routed_experts=routed)
        return (weights.view(torch.int32), ids, counts, routed)

    previous = moeext._C._set_gpu_routing_variant(0)
    try:
        for logits, bias in inputs:
            for options, counts_dtype, record_dtype in cases:
                current = run(logits, bias, options, counts_dtype, record_dtype)
                moeext._C._set_gpu_routing_variant(3)
                other = run(logits, bias, options, counts_dtype, record_dtype)
                moeext._C._set_gpu_routing_variant(0)
                assert_same(other, current)
    finally:
        moeext._C._set_gpu_routing_variant(previous)


@pytest.mark.parametrize("valid", [-5, 0, 1, 50, 64, 1000])
@pytest.mark.parametrize("valid_dtype", [torch.int32, torch.int64])
def test_valid_rows_bound_what_is_counted_and_recorded(device, valid, valid_dtype):
    p = PRESETS["kimi-k2"]
    logits, bias = make_inputs(64, "kimi-k2", seed=valid, device=device)
    counts = torch.zeros(p.num_experts, dtype=torch.int32, device=device)
    routed = torch.full((70, p.topk), -3, dtype=torch.int32, device=device)
    weights, ids = moeext.biased_grouped_topk(
        logits, bias, **p.op_kwargs(), expert_counts=counts, routed_experts=routed,
        num_valid_tokens=torch.tensor([valid], dtype=valid_dtype, device=device))
    rows = min(max(valid, 0), 64)
    assert torch.equal(routed[:rows], ids[:rows])
    assert bool((routed[rows:] == -3).all())
    assert torch.equal(counts.cpu(), torch.bincount(ids[:rows].reshape(-1).long().cpu(),
                                                    minlength=p.num_experts).int())


def test_counts_accumulate_and_split_over_threads(device):
    """Many rows: the CPU counts chunks on several threads (atomically); the sum is the same."""
    p = PRESETS["deepseek-v3"]
    logits, bias = make_inputs(4099, "deepseek-v3", seed=9, device=device)
    counts = torch.full((p.num_experts,), 5, dtype=torch.int64, device=device)
    for _ in range(3):
        _, ids = moeext.biased_grouped_topk(logits, bias, **p.op_kwargs(), expert_counts=counts)
    expected = 5 + 3 * torch.bincount(ids.reshape(-1).long().cpu(), minlength=p.num_experts)
    assert torch.equal(counts.cpu(), expected)


def test_out_form_with_options_writes_only_its_views(device_isa):
    device, _ = device_isa
    p = PRESETS["deepseek-v3"]
    num_tokens, shared = 19, 1
    logits, bias = make_inputs(num_tokens, "deepseek-v3", seed=5, device=device)
    plain = moeext.biased_grouped_topk(logits, bias, **p.op_kwargs())
    weights_buf = torch.full((num_tokens, 12), -9.0, device=device)
    ids_buf = torch.full((num_tokens, 12), -9, dtype=torch.int32, device=device)
    expert_map = random_map(p.num_experts + shared, 6, device)
    counts = torch.zeros(p.num_experts, dtype=torch.int32, device=device)
    routed_buf = torch.full((num_tokens + 2, 11), -9, dtype=torch.int32, device=device)
    routed = routed_buf[:, 1:9]  # row-strided
    options = dict(num_fused_shared_experts=shared, shared_expert_weight=1.0 / 2.5,
                   expert_map=expert_map)
    expected = expected_options(*plain, p.num_experts, counts, routed, **options)
    moeext.biased_grouped_topk_out(
        logits, bias, weights_buf[:, 1:10], ids_buf[:, 1:10], p.num_expert_group, p.topk_group,
        p.renormalize, p.routed_scaling_factor, p.scoring_func, expert_counts=counts,
        routed_experts=routed, **options)
    assert_same((weights_buf[:, 1:10], ids_buf[:, 1:10], counts, routed), expected)
    for buf in (weights_buf, ids_buf):
        assert bool((buf[:, 0] == -9).all()) and bool((buf[:, 10:] == -9).all())
    assert bool((routed_buf[:, 0] == -9).all()) and bool((routed_buf[:, 9:] == -9).all())
    assert bool((routed_buf[num_tokens:] == -9).all())


def test_plain_calls_are_unchanged_by_the_options_defaults(device):
    p = PRESETS["glm-4.5"]
    logits, bias = make_inputs(11, "glm-4.5", device=device)
    plain = moeext.biased_grouped_topk(logits, bias, **p.op_kwargs())
    defaults = moeext.biased_grouped_topk(logits, bias, **p.op_kwargs(),
                                          num_fused_shared_experts=0, shared_expert_weight=3.0,
                                          expert_map=None, expert_counts=None,
                                          routed_experts=None, num_valid_tokens=None)
    assert_same(defaults, plain)


def _bad_option_calls(device):
    p = PRESETS["deepseek-v3"]
    E, T = p.num_experts, 5
    logits, bias = make_inputs(T, "deepseek-v3", device=device)
    i32 = dict(dtype=torch.int32, device=device)
    kw = p.op_kwargs()
    return [
        (dict(num_fused_shared_experts=-1), "num_fused_shared_experts must be >= 0, got -1"),
        (dict(expert_map=torch.zeros(E, **i32), num_fused_shared_experts=1),
         r"expert_map must be int32 of shape \[257\]"),
        (dict(expert_map=torch.zeros(E, dtype=torch.int64, device=device)),
         r"expert_map must be int32 of shape \[256\]"),
        (dict(expert_counts=torch.zeros(E, dtype=torch.float32, device=device)),
         r"expert_counts must be int32 or int64 of shape \[256\]"),
        (dict(expert_counts=torch.zeros(E - 1, **i32)),
         r"expert_counts must be int32 or int64 of shape \[256\]"),
        (dict(routed_experts=torch.zeros(T - 1, 8, **i32)),
         r"routed_experts must be int16 or int32 of shape \[R, 8\] with R >= 5"),
        (dict(routed_experts=torch.zeros(T, 9, **i32)),
         r"routed_experts must be int16 or int32 of shape \[R, 8\]"),
        (dict(routed_experts=torch.zeros(T, 8, dtype=torch.int64, device=device)),
         r"routed_experts must be int16 or int32"),
        (dict(routed_experts=torch.zeros(8, T, **i32).T), "routed_experts must have contiguous"),
        (dict(num_valid_tokens=torch.zeros(2, **i32)),
         "num_valid_tokens must hold one int32 or int64, got Int with 2 elements"),
        (dict(num_valid_tokens=torch.zeros(1, dtype=torch.float32, device=device)),
         "num_valid_tokens must hold one int32 or int64"),
        (dict(expert_counts=torch.zeros(1, **i32).expand(E)), "expert_counts has experts that share"),
    ], (logits, bias, kw)


def test_invalid_options_raise_naming_the_argument_and_write_nothing(device):
    cases, (logits, bias, kw) = _bad_option_calls(device)
    counts = torch.full((256,), 3, dtype=torch.int64, device=device)
    routed = torch.full((5, 8), -2, dtype=torch.int32, device=device)
    for options, message in cases:
        options = {"expert_counts": counts, "routed_experts": routed, **options}
        with pytest.raises(RuntimeError, match="biased_grouped_topk: " + message):
            moeext.biased_grouped_topk(logits, bias, **kw, **options)
        assert bool((counts == 3).all()) and bool((routed == -2).all())


def test_fakes_reject_the_invalid_options():
    cases, (logits, bias, kw) = _bad_option_calls("meta")
    for options, message in cases:
        if "share" in message or "contiguous" in message:
            continue  # memory layout: the kernels' to check
        with pytest.raises(RuntimeError, match="biased_grouped_topk: " + message.split(", got")[0]):
            moeext.biased_grouped_topk(logits, bias, **kw, **options)


def test_int16_record_needs_ids_that_fit():
    logits = torch.randn(2, 32768 * 2)
    routed = torch.zeros(2, 1, dtype=torch.int16)
    with pytest.raises(RuntimeError, match="routed_experts is int16, whose ids end at 32767, but "
                                           "there are 65536 experts"):
        moeext.biased_grouped_topk(logits, None, 1, 1, 1, routed_experts=routed)
    assert bool((routed == 0).all())


def test_written_buffers_must_not_overlap_what_is_read(device):
    p = PRESETS["deepseek-v3"]
    logits, bias = make_inputs(4, "deepseek-v3", device=device, logits_dtype=torch.float32)
    as_ints = logits.view(torch.int32)
    with pytest.raises(RuntimeError, match="routed_experts and gating_output share memory"):
        moeext.biased_grouped_topk(logits, bias, **p.op_kwargs(), routed_experts=as_ints[:, :8])
    counts = torch.zeros(p.num_experts + 8, dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="routed_experts and expert_counts share memory"):
        moeext.biased_grouped_topk(logits, bias, **p.op_kwargs(),
                                   expert_counts=counts[:p.num_experts],
                                   routed_experts=counts[8:40].view(4, 8))
    assert bool((counts == 0).all())


# ---- Gradients -------------------------------------------------------------------------------


@pytest.mark.parametrize("scoring_func", ["sigmoid", "sqrtsoftplus", "softmax"])
def test_gradient_flows_through_the_routed_columns_only(device, scoring_func):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 64, generator=g).to(device).requires_grad_()
    bias = (2 + 0.1 * torch.randn(64, generator=g)).to(device)
    expert_map = random_map(66, 2, device)
    counts = torch.zeros(64, dtype=torch.int32, device=device)
    weights, ids = moeext.biased_grouped_topk(
        logits, bias, 4, 2, 5, True, 2.5, scoring_func, num_fused_shared_experts=2,
        shared_expert_weight=0.5, expert_map=expert_map, expert_counts=counts)
    plain_w, plain_ids = moeext.biased_grouped_topk(logits.detach(), bias, 4, 2, 5, True, 2.5,
                                                    scoring_func)
    assert_same((weights.detach(), ids),
                reference.apply_routing_options(plain_w, plain_ids, 64, 2, 0.5, expert_map))
    assert int(counts.sum()) == 30
    upstream = torch.randn(6, 7, generator=g).to(device)
    (weights * upstream).sum().backward()
    expected = torch.autograd.grad(
        (reference.routing_weights(logits, plain_ids.long(), True, 2.5, scoring_func)
         * upstream[:, :5]).sum(), logits)[0]
    torch.testing.assert_close(logits.grad, expected, rtol=1e-4, atol=1e-6)


# ---- routing_weights -------------------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("ids_dtype", [torch.int16, torch.int32, torch.int64])
def test_replay_gives_routings_own_weights(device_isa, preset, ids_dtype):
    """The ids routing chose, in its order, weigh exactly what routing weighed them."""
    device, _ = device_isa
    p = PRESETS[preset]
    for num_tokens in (1, 33):
        logits, bias = make_inputs(num_tokens, preset, seed=num_tokens, device=device)
        weights, ids = moeext.biased_grouped_topk(logits, bias, **p.op_kwargs())
        replayed = moeext.routing_weights(logits, ids.to(ids_dtype), p.renormalize,
                                          p.routed_scaling_factor, p.scoring_func)
        assert replayed.dtype == torch.float32 and replayed.shape == ids.shape
        assert torch.equal(replayed, weights)


@pytest.mark.parametrize("num_experts,topk", [(96, 32), (96, 33), (300, 40), (1024, 64)])
def test_replay_of_a_softmax_row_gives_routings_own_weights_at_any_topk(device_isa, num_experts,
                                                                        topk):
    """A softmax row's sum follows the kernel that routed it: on a GPU the warp kernel up to
    top-32, the block kernel past it (found by a random sweep: the replay had followed the
    warp kernel's layout whatever the top-k)."""
    device, _ = device_isa
    g = torch.Generator().manual_seed(topk)
    logits = torch.randn(17, num_experts, generator=g).to(device)
    for renormalize in (True, False):
        weights, ids = moeext.biased_grouped_topk(logits, None, 1, 1, topk, renormalize, 2.5,
                                                  "softmax")
        replayed = moeext.routing_weights(logits, ids, renormalize, 2.5, "softmax")
        assert torch.equal(replayed, weights)


@pytest.mark.parametrize("scoring_func", ["sigmoid", "sqrtsoftplus", "softmax"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_replay_of_any_ids_matches_the_reference(device_isa, scoring_func, renormalize):
    device, _ = device_isa
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(23, 70, generator=g) * 3)
    logits[4] = float("nan")
    logits[5, 3] = float("inf")
    ids = torch.stack([torch.randperm(70, generator=g)[:9] for _ in range(23)])
    strided_ids = torch.zeros(9, 23, dtype=torch.int64)
    strided_ids.copy_(ids.T)
    for logits_dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = logits.to(logits_dtype)
        got = moeext.routing_weights(x.to(device), strided_ids.T.to(device), renormalize, 1.7,
                                     scoring_func)
        expected = reference.routing_weights(x, ids, renormalize, 1.7, scoring_func)
        torch.testing.assert_close(got.cpu(), expected, rtol=2e-5, atol=1e-6, equal_nan=True)


def test_replay_of_no_rows_and_no_columns(device):
    for shape in ((0, 4), (3, 0)):
        got = moeext.routing_weights(torch.randn(shape[0], 16, device=device),
                                     torch.zeros(shape, dtype=torch.int32, device=device))
        assert got.shape == shape and got.dtype == torch.float32


def test_replay_rejects_ids_out_of_range_or_repeated_on_the_cpu():
    logits = torch.randn(4, 16)
    ids = torch.tensor([[0, 1], [2, 3], [4, 16], [5, 6]])
    with pytest.raises(RuntimeError, match=r"routing_weights: topk_ids\[2\] holds 16, outside "
                                           r"\[0, 16\)"):
        moeext.routing_weights(logits, ids)
    ids = torch.tensor([[0, 1], [2, -1], [4, 5], [5, 6]], dtype=torch.int16)
    with pytest.raises(RuntimeError, match=r"topk_ids\[1\] holds -1"):
        moeext.routing_weights(logits, ids)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 6]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"routing_weights: topk_ids\[3\] holds 6 twice"):
        moeext.routing_weights(logits, ids)


def test_replay_marks_invalid_rows_nan_on_a_gpu(device):
    if device == "cpu":
        pytest.skip("the CPU raises instead (test above)")
    logits = torch.randn(3, 16, device=device)
    ids = torch.tensor([[0, 1], [2, 2], [4, 99]], dtype=torch.int32, device=device)
    got = moeext.routing_weights(logits, ids).cpu()
    assert bool(torch.isfinite(got[0]).all())
    assert bool(torch.isnan(got[1:]).all())


@pytest.mark.parametrize("bad,message", [
    (lambda d: (torch.randn(3, device=d), torch.zeros(3, 1, dtype=torch.int32, device=d)),
     r"routing_weights: gating_output must be 2-D"),
    (lambda d: (torch.randn(3, 8, device=d).double(), torch.zeros(3, 1, dtype=torch.int32, device=d)),
     r"routing_weights: gating_output must be float32, bfloat16 or float16"),
    (lambda d: (torch.randn(3, 8, device=d), torch.zeros(3, 1, device=d)),
     r"routing_weights: topk_ids must be int16, int32 or int64 of shape \[3, k\]"),
    (lambda d: (torch.randn(3, 8, device=d), torch.zeros(2, 1, dtype=torch.int32, device=d)),
     r"routing_weights: topk_ids must be int16, int32 or int64 of shape \[3, k\]"),
    (lambda d: (torch.randn(3, 8, device=d), torch.zeros(3, 1, dtype=torch.int32, device="meta")),
     r"routing_weights: topk_ids is on meta but gating_output is on"),
])
def test_replay_errors_name_the_argument(device, bad, message):
    logits, ids = bad(device)
    with pytest.raises(RuntimeError, match=message):
        moeext.routing_weights(logits, ids)
    if "meta" not in message:  # the fake, on meta tensors, says the same
        with pytest.raises(RuntimeError, match=message.split(", got")[0].split(r" \[")[0]):
            moeext.routing_weights(logits.to("meta"), ids.to("meta"))


@pytest.mark.parametrize("scoring_func", ["sigmoid", "sqrtsoftplus", "softmax"])
def test_replay_gradient_matches_the_reference(device, scoring_func):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(9, 48, generator=g)
    ids = torch.stack([torch.randperm(48, generator=g)[:6] for _ in range(9)]).to(torch.int16)
    upstream = torch.randn(9, 6, generator=g)
    x = logits.clone().to(device).requires_grad_()
    (moeext.routing_weights(x, ids.to(device), True, 2.0, scoring_func) * upstream.to(device)).sum().backward()
    y = logits.clone().requires_grad_()
    (reference.routing_weights(y, ids, True, 2.0, scoring_func) * upstream).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), y.grad, rtol=1e-4, atol=1e-6)


def _sqrt_softplus_weights_f64(logits, ids, renormalize, scale):
    """Routing's weights at these ids in float64, sqrt(softplus(x)) taken as exp(x / 2) below
    -20 (where float64 agrees with it to 1e-9 and does not underflow before -1490)."""
    x = logits.double()
    far = x < -20
    s = torch.where(far, torch.exp(0.5 * torch.where(far, x, 0.0)),
                    torch.sqrt(torch.nn.functional.softplus(torch.where(far, 0.0, x))))
    w = s.gather(1, ids.long())
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale


@pytest.mark.parametrize("renormalize", [False, True])
def test_sqrt_softplus_gradient_is_finite_far_below_zero(device, renormalize):
    """Chosen experts whose logits lie where float32's softplus underflows (from -104, -inf
    included) get the derivative exp(x / 2) / 2, not a NaN; and where a chosen score is
    comparable to the renormalisation's 1e-20, the derivative is taken at the scores the
    weights were made of. Ten columns: the vectorised lanes and the tail of torch's kernels."""
    far = [float("-inf"), -300.0, -150.0, -110.0, -103.9, -103.3125, -95.0, -85.0, -30.0, -21.0]
    logits = torch.tensor([far + [1.0, 0.5], [-85.0, -103.3125] + [-90.0] * 10])
    ids = torch.tensor([list(range(10)), [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]], dtype=torch.int32)
    upstream = torch.linspace(-1.0, 2.0, 20).reshape(2, 10)
    # Routing chooses these ids through a bias that favours them, in this order.
    bias = torch.tensor([10.0 - e for e in range(10)] + [-50.0, -50.0])
    x = logits.clone().to(device).requires_grad_()
    weights, chosen = moeext.biased_grouped_topk(x, bias.to(device), 1, 1, 10, renormalize, 2.5,
                                                 "sqrtsoftplus")
    assert chosen.cpu().tolist() == ids.tolist()
    (weights * upstream.to(device)).sum().backward()
    y = logits.clone().to(device).requires_grad_()
    (moeext.routing_weights(y, ids.to(device), renormalize, 2.5, "sqrtsoftplus")
     * upstream.to(device)).sum().backward()
    z = logits.clone().requires_grad_()
    (reference.routing_weights(z, ids, renormalize, 2.5, "sqrtsoftplus")
     * upstream).sum().backward()
    exact_input = logits.double().requires_grad_()
    (_sqrt_softplus_weights_f64(exact_input, ids, renormalize, 2.5)
     * upstream.double()).sum().backward()
    exact = exact_input.grad
    for got in (x.grad.cpu(), y.grad.cpu(), z.grad):
        assert bool(torch.isfinite(got).all()), got
        assert got[0, 0] == 0  # the -inf logit
        torch.testing.assert_close(got[0].double(), exact[0], rtol=2e-5, atol=1e-44)
        # The second row's scores are the forward's (exp rounded to float32's subnormals, as
        # section 1 has it), a few in 1e4 off the exact ones: the reference is the measure.
        torch.testing.assert_close(got[1], z.grad[1], rtol=1e-5, atol=0)


# ---- torch.library and torch.compile ---------------------------------------------------------


def test_opcheck_with_options(device):
    p = PRESETS["deepseek-v3"]
    logits, bias = make_inputs(13, "deepseek-v3", device=device)
    options = (2, 0.5, random_map(p.num_experts + 2, 1, device),
               torch.zeros(p.num_experts, dtype=torch.int64, device=device),
               torch.zeros(16, p.topk, dtype=torch.int32, device=device),
               torch.tensor([9], device=device))
    torch.library.opcheck(torch.ops.moeext.biased_grouped_topk.default,
                          (logits, bias, 8, 4, 8, True, 2.5, "sigmoid", *options))
    weights = torch.empty(13, 12, device=device)[:, :10]
    ids = torch.empty(13, 12, dtype=torch.int32, device=device)[:, :10]
    torch.library.opcheck(torch.ops.moeext.biased_grouped_topk_out.default,
                          (logits, bias, weights, ids, 8, 4, True, 2.5, "sigmoid", *options))
    logits32 = logits.float().requires_grad_()
    torch.library.opcheck(torch.ops.moeext.biased_grouped_topk.default,
                          (logits32, bias, 8, 4, 8, True, 2.5, "sigmoid", *options))


def test_opcheck_routing_weights(device):
    logits = torch.randn(11, 40, device=device)
    ids = torch.stack([torch.randperm(40)[:5] for _ in range(11)]).to(device)
    torch.library.opcheck(torch.ops.moeext.routing_weights.default,
                          (logits, ids, True, 2.5, "sqrtsoftplus"))
    torch.library.opcheck(torch.ops.moeext.routing_weights.default,
                          (logits.requires_grad_(), ids.int(), False, 1.0, "softmax"))


def test_compile_with_options_and_a_symbolic_batch(device):
    torch._dynamo.reset()
    p = PRESETS["deepseek-v3"]
    counts = torch.zeros(p.num_experts, dtype=torch.int64, device=device)
    routed = torch.zeros(64, p.topk, dtype=torch.int16, device=device)
    expert_map = random_map(p.num_experts + 1, 3, device)

    def step(logits, bias, valid):
        weights, ids = moeext.biased_grouped_topk(
            logits * 1.0, bias, **p.op_kwargs(), num_fused_shared_experts=1,
            expert_map=expert_map, expert_counts=counts, routed_experts=routed,
            num_valid_tokens=valid)
        replayed = moeext.routing_weights(logits, routed[:logits.shape[0]], p.renormalize,
                                          p.routed_scaling_factor, p.scoring_func)
        return weights * 2, ids, replayed

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    eager_counts = torch.zeros_like(counts)
    for num_tokens in (5, 17, 3):
        logits, bias = make_inputs(num_tokens, "deepseek-v3", seed=num_tokens, device=device)
        valid = torch.tensor([num_tokens], device=device)
        weights, ids, replayed = compiled(logits, bias, valid)
        expected_w, expected_ids = moeext.biased_grouped_topk(
            logits, bias, **p.op_kwargs(), num_fused_shared_experts=1, expert_map=expert_map,
            expert_counts=eager_counts)
        assert torch.equal(ids, expected_ids) and torch.equal(weights, expected_w * 2)
        assert torch.equal(counts, eager_counts)
        assert torch.equal(replayed, expected_w[:, :p.topk])
