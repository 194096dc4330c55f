"""moeext.fused_router (docs/SPEC.md section 7): the router GEMM and the routing in one call.

Its contract is the two-call composition ``biased_grouped_topk(router_gemm(...))`` on the same
device and CPU path, bit for bit, so every result here is compared with torch.equal against
those two ops run on the same inputs; test_matches_the_reference ties both to the fp64
reference as tests/test_router_gemm.py and tests/test_grouped_topk.py do.
"""

import contextlib

import pytest
import torch

import moeext
from conftest import GPU_DEVICES, switched
from moeext import reference
from moeext.presets import PRESETS
from routing_check import assert_routing_matches
from test_router_gemm import assert_close_to_reference

PRESET_NAMES = ["deepseek-v3", "kimi-k2", "glm-4.5", "deepseek-v4-flash", "nemotron-style",
                "deepseek-v2"]


def make_inputs(num_tokens, hidden_size, preset, seed=0, device="cpu", dtype=torch.bfloat16,
                bias_dtype=torch.float32):
    p = PRESETS[preset]
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=g).to(dtype)
    # A gate at DeepSeek-V3's init scale, whose logits are still spread out enough to route.
    weight = (0.05 * torch.randn(p.num_experts, hidden_size, generator=g)).to(dtype)
    bias = None
    if p.has_bias and bias_dtype is not None:
        bias = (2.0 + 0.05 * torch.randn(p.num_experts, generator=g)).to(bias_dtype)
    return hidden.to(device), weight.to(device), None if bias is None else bias.to(device)


def two_calls(hidden, weight, bias, p, **options):
    logits = moeext.router_gemm(hidden, weight)
    weights, ids = moeext.biased_grouped_topk(logits, bias, **p.op_kwargs(), **options)
    return weights, ids, logits


def assert_equal(got, expected):
    """Bit for bit (NaN included)."""
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape and g.device == e.device
        if g.dtype == torch.float32:
            g, e = g.view(torch.int32), e.view(torch.int32)
        assert torch.equal(g, e)


# ---- The composition, bit for bit ----------------------------------------------------------

@pytest.mark.parametrize("num_tokens", [1, 2, 3, 5, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_equals_the_two_calls(device_isa, preset, num_tokens):
    device, _ = device_isa
    p = PRESETS[preset]
    hidden, weight, bias = make_inputs(num_tokens, 512, preset, seed=num_tokens, device=device)
    expected = two_calls(hidden, weight, bias, p)
    got = moeext.fused_router(hidden, weight, bias, **p.op_kwargs(), return_logits=True)
    assert_equal(got, expected)
    weights, ids, logits = moeext.fused_router(hidden, weight, bias, **p.op_kwargs())
    assert logits is None
    assert_equal((weights, ids), expected[:2])


@pytest.mark.parametrize("num_tokens", [1, 4, 16])
@pytest.mark.parametrize("preset", ["deepseek-v3", "kimi-k2"])
def test_equals_the_two_calls_at_the_models_gate(device_isa, preset, num_tokens):
    device, _ = device_isa
    p = PRESETS[preset]
    hidden, weight, bias = make_inputs(num_tokens, 7168, preset, seed=7, device=device)
    weight = weight * 0.4  # ~0.02, the init scale, at H = 7168
    expected = two_calls(hidden, weight, bias, p)
    assert_equal(moeext.fused_router(hidden, weight, bias, **p.op_kwargs(), return_logits=True),
                 expected)


@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_dtype_pair(device_isa, dtype, bias_dtype):
    device, _ = device_isa
    p = PRESETS["deepseek-v3"]
    for num_tokens in (1, 6):
        hidden, weight, bias = make_inputs(num_tokens, 264, "deepseek-v3", seed=num_tokens,
                                           device=device, dtype=dtype, bias_dtype=bias_dtype)
        expected = two_calls(hidden, weight, bias, p)
        assert_equal(moeext.fused_router(hidden, weight, bias, **p.op_kwargs(),
                                         return_logits=True), expected)


@pytest.mark.parametrize("hidden_size", [1, 7, 33, 130])
def test_odd_hidden_sizes(device_isa, hidden_size):
    device, _ = device_isa
    p = PRESETS["deepseek-v3"]
    hidden, weight, bias = make_inputs(5, hidden_size, "deepseek-v3", device=device)
    weight = weight * 10  # logits of unit scale whatever H
    assert_equal(moeext.fused_router(hidden, weight, bias, **p.op_kwargs(), return_logits=True),
                 two_calls(hidden, weight, bias, p))


def test_non_contiguous_inputs(device_isa):
    device, _ = device_isa
    p = PRESETS["kimi-k2"]
    hidden, weight, bias = make_inputs(9, 256, "kimi-k2", device=device)
    wide = torch.zeros(9, 320, dtype=hidden.dtype, device=device)
    wide[:, 32:288] = hidden
    strided_hidden = wide[:, 32:288]  # rows 320 apart
    column_strided_weight = weight.T.contiguous().T  # stride(1) != 1: copied by the op
    strided_bias = torch.stack([bias, bias], dim=1)[:, 0]
    expected = two_calls(hidden, weight, bias, p)
    got = moeext.fused_router(strided_hidden, column_strided_weight, strided_bias,
                              **p.op_kwargs(), return_logits=True)
    assert_equal(got, expected)


def test_non_finite_rows(device_isa):
    device, _ = device_isa
    p = PRESETS["deepseek-v3"]
    hidden, weight, _ = make_inputs(6, 256, "deepseek-v3", device=device)
    hidden[1] = float("nan")
    hidden[2, 5] = float("inf")
    hidden[3, :] = float("-inf")
    hidden[4] = 0.0  # every logit 0, and no bias: all ties, broken by the lower id
    expected = two_calls(hidden, weight, None, p)
    got = moeext.fused_router(hidden, weight, None, **p.op_kwargs(), return_logits=True)
    assert_equal(got, expected)
    assert bool(torch.isnan(got[2][1]).all())
    # Groups 0-3 kept, and in them the first 8 ids.
    assert torch.equal(got[1][4].cpu(), torch.arange(8, dtype=torch.int32))


def test_no_tokens_and_the_empty_logits(device):
    p = PRESETS["deepseek-v3"]
    hidden, weight, bias = make_inputs(0, 64, "deepseek-v3", device=device)
    weights, ids, logits = moeext.fused_router(hidden, weight, bias, **p.op_kwargs(),
                                               return_logits=True)
    assert weights.shape == ids.shape == (0, 8) and logits.shape == (0, 256)
    _, _, not_asked = torch.ops.moeext.fused_router(hidden, weight, bias, 8, 4, 8)
    assert not_asked.shape == (0, 256) and not_asked.dtype == torch.float32


def test_the_empty_logits_of_one_call_are_not_changed_by_the_next(device):
    # A CPU thread returns the [0, E] tensor it made last while nothing else holds it: one the
    # caller keeps, or changed and dropped, is never returned again; inference mode gets its own.
    def not_asked():
        return torch.ops.moeext.fused_router(hidden, weight, bias, 8, 4, 8)[2]

    hidden, weight, bias = make_inputs(2, 64, "deepseek-v3", device=device)
    kept = not_asked()
    again = not_asked()
    assert again is not kept and kept.shape == again.shape == (0, 256)
    kept.resize_(3, 5)
    assert not_asked().shape == (0, 256)
    del kept, again
    assert not_asked().shape == (0, 256)
    changed = not_asked()
    changed.requires_grad_()
    del changed
    assert not not_asked().requires_grad
    with torch.inference_mode():
        inner = not_asked()
        assert inner.is_inference() and inner.shape == (0, 256)
    del inner
    outer = not_asked()
    assert not outer.is_inference() and outer.shape == (0, 256) and outer.dtype == torch.float32


def test_prepacked_weight():
    p = PRESETS["deepseek-v3"]
    for num_tokens in (1, 3, 12):
        hidden, weight, bias = make_inputs(num_tokens, 200, "deepseek-v3", seed=num_tokens)
        packed = moeext.prepack_router_weight(weight)
        expected = two_calls(hidden, packed, bias, p)
        assert_equal(moeext.fused_router(hidden, packed, bias, **p.op_kwargs(),
                                         return_logits=True), expected)


def test_matches_the_reference(device):
    p = PRESETS["deepseek-v3"]
    hidden, weight, bias = make_inputs(33, 384, "deepseek-v3", device=device)
    weights, ids, logits = moeext.fused_router(hidden, weight, bias, **p.op_kwargs(),
                                               return_logits=True)
    assert_close_to_reference(logits.cpu(), hidden.cpu(), weight.cpu())
    assert_routing_matches(weights.cpu(), ids.cpu(), logits.cpu(), bias.cpu(), **p.op_kwargs())
    ref = reference.fused_router(hidden.cpu(), weight.cpu(), bias.cpu(), **p.op_kwargs())
    assert ref[2] is None and ref[0].shape == weights.shape


# ---- The routing options ---------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens", [1, 5, 16, 37])
@pytest.mark.parametrize("preset", ["deepseek-v3", "kimi-k2", "deepseek-v2"])
def test_every_option(device_isa, preset, num_tokens):
    device, _ = device_isa
    p = PRESETS[preset]
    hidden, weight, bias = make_inputs(num_tokens, 256, preset, seed=num_tokens, device=device)
    shared = 1
    g = torch.Generator().manual_seed(num_tokens)
    expert_map = torch.randperm(p.num_experts + shared, generator=g).to(torch.int32).to(device)
    valid = torch.tensor([num_tokens - num_tokens // 3], dtype=torch.int64, device=device)

    def buffers():
        return (torch.arange(p.num_experts, dtype=torch.int32, device=device),
                torch.full((num_tokens + 2, p.topk), -1, dtype=torch.int16, device=device))

    expected_counts, expected_record = buffers()
    options = dict(num_fused_shared_experts=shared, shared_expert_weight=0.25,
                   expert_map=expert_map, num_valid_tokens=valid)
    expected = two_calls(hidden, weight, bias, p, expert_counts=expected_counts,
                         routed_experts=expected_record, **options)
    counts, record = buffers()
    got = moeext.fused_router(hidden, weight, bias, **p.op_kwargs(), expert_counts=counts,
                              routed_experts=record, **options, return_logits=True)
    assert_equal((*got, counts, record), (*expected, expected_counts, expected_record))


# ---- Bad input: a clear error naming the argument, and nothing written -----------------------

def _error_cases():
    p = PRESETS["deepseek-v3"]
    kw = p.op_kwargs()

    def call(hidden=None, weight=None, bias="default", **changes):
        def run(device, counts):
            h, w, b = make_inputs(3, 64, "deepseek-v3", device=device)
            args = dict(kw, expert_counts=counts)
            args.update(changes)
            for name in ("expert_map", "routed_experts", "num_valid_tokens"):
                if callable(args.get(name)):
                    args[name] = args[name](device)
            return moeext.fused_router(
                h if hidden is None else hidden(device), w if weight is None else weight(device),
                b if bias == "default" else (bias(device) if callable(bias) else bias), **args)
        return run

    return [
        (call(hidden=lambda d: torch.randn(3, 64, 1, device=d)),
         r"fused_router: hidden_states must be 2-D \[num_tokens, hidden_size\]"),
        (call(weight=lambda d: torch.randn(256, 64, device=d)),
         r"fused_router: weight must have the dtype of hidden_states \(BFloat16\), got Float"),
        (call(weight=lambda d: torch.randn(256, 65, device=d).bfloat16()),
         r"fused_router: weight must have shape \[num_experts, 64\]"),
        (call(bias=lambda d: torch.zeros(255, device=d)),
         r"fused_router: correction_bias must have shape \[256\]"),
        (call(num_expert_group=7), r"fused_router: num_expert_group \(7\) must divide"),
        (call(topk=0), r"fused_router: topk must be >= 1"),
        (call(scoring_func="tanh"), r"fused_router: scoring_func must be"),
        (call(expert_map=lambda d: torch.zeros(255, dtype=torch.int32, device=d)),
         r"fused_router: expert_map must be int32 of shape \[256\]"),
        (call(routed_experts=lambda d: torch.zeros(2, 8, dtype=torch.int32, device=d)),
         r"fused_router: routed_experts"),
        (call(num_fused_shared_experts=-1), r"fused_router: num_fused_shared_experts must be >= 0"),
    ]


@pytest.mark.parametrize("case", range(len(_error_cases())))
def test_errors_name_the_argument_and_write_nothing(device, case):
    run, message = _error_cases()[case]
    counts = torch.full((256,), 5, dtype=torch.int64, device=device)
    with pytest.raises(RuntimeError, match=message):
        run(device, counts)
    assert bool((counts == 5).all())


def test_none_for_a_tensor_is_named(device):
    with pytest.raises(RuntimeError, match="fused_router: hidden_states must be a tensor, got None"):
        moeext.fused_router(None, torch.randn(8, 4, device=device), None, 1, 1, 2)
    with pytest.raises(RuntimeError, match="fused_router: weight must be a tensor, got None"):
        moeext.fused_router(torch.randn(2, 4, device=device), None, None, 1, 1, 2)


def test_a_bias_on_another_device_is_named():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        hidden, weight = torch.empty(2, 16), torch.empty(8, 16)
        with pytest.raises(RuntimeError, match="fused_router: correction_bias is on cuda:0 but "
                                               "hidden_states is on cpu"):
            torch.ops.moeext.fused_router(hidden, weight, torch.empty(8, device="cuda"), 1, 1, 2)


@pytest.mark.parametrize("device_of_call", ["cpu", "meta"])  # the kernel, then the fake
def test_fake_and_kernel_reject_alike(device_of_call):
    hidden = torch.zeros(3, 16, device=device_of_call)
    weight = torch.zeros(12, 16, device=device_of_call)
    with pytest.raises(RuntimeError, match=r"fused_router: num_expert_group \(5\) must divide"):
        moeext.fused_router(hidden, weight, None, 5, 1, 2)
    with pytest.raises(RuntimeError, match=r"fused_router: weight must have shape"):
        moeext.fused_router(hidden, weight[:, :15], None, 1, 1, 2)
    weights, ids, logits = moeext.fused_router(hidden, weight, None, 3, 2, 4, return_logits=True)
    assert weights.shape == (3, 4) and ids.dtype == torch.int32 and logits.shape == (3, 12)


# ---- Gradients -------------------------------------------------------------------------------

def test_gradients_are_the_two_ops(device):
    p = PRESETS["deepseek-v3"]
    hidden, weight, bias = make_inputs(5, 128, "deepseek-v3", device=device,
                                       dtype=torch.float32)
    results = []
    for fused in (True, False):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        if fused:
            weights, ids, _ = moeext.fused_router(h, w, bias, **p.op_kwargs())
        else:
            weights, ids, _ = two_calls(h, w, bias, p)
        (weights * torch.arange(1.0, 9.0, device=device)).sum().backward()
        results.append((weights.detach(), ids, h.grad, w.grad))
    assert_equal(results[0], results[1])


# ---- torch.library and torch.compile ---------------------------------------------------------

@pytest.mark.parametrize("num_tokens", [0, 1, 19])
def test_opcheck(device, num_tokens):
    hidden, weight, bias = make_inputs(num_tokens, 96, "deepseek-v3", device=device)
    op = torch.ops.moeext.fused_router.default
    torch.library.opcheck(op, (hidden, weight, bias, 8, 4, 8, True, 2.5, "sigmoid"))
    torch.library.opcheck(op, (hidden, weight, None, 8, 4, 8, False, 1.0, "softmax", 0, 1.0,
                               None, None, None, None, True))
    counts = torch.zeros(256, dtype=torch.int32, device=device)
    record = torch.zeros(num_tokens + 1, 8, dtype=torch.int16, device=device)
    expert_map = torch.arange(257, dtype=torch.int32, device=device)
    torch.library.opcheck(op, (hidden, weight, bias, 8, 4, 8, True, 2.5, "sigmoid", 1, 0.5,
                               expert_map, counts, record, None, True))


def test_opcheck_with_gradient(device):
    hidden, weight, bias = make_inputs(7, 64, "deepseek-v3", device=device, dtype=torch.float32)
    torch.library.opcheck(torch.ops.moeext.fused_router.default,
                          (hidden.requires_grad_(), weight.requires_grad_(), bias, 8, 4, 8,
                           True, 2.5, "sigmoid"))


@pytest.mark.parametrize("return_logits", [False, True])
def test_compile_fullgraph_dynamic_tokens(device, return_logits):
    torch._dynamo.reset()
    p = PRESETS["kimi-k2"]
    counts = torch.zeros(p.num_experts, dtype=torch.int64, device=device)

    def route(hidden, weight, bias):
        weights, ids, logits = moeext.fused_router(hidden * 1.0, weight, bias, **p.op_kwargs(),
                                                   expert_counts=counts,
                                                   return_logits=return_logits)
        return (weights * 2, ids) + ((logits,) if return_logits else ())

    compiled = torch.compile(route, fullgraph=True, dynamic=True)
    for num_tokens in (3, 17, 1):
        hidden, weight, bias = make_inputs(num_tokens, 128, "kimi-k2", seed=num_tokens,
                                           device=device)
        before = counts.clone()
        expected = route(hidden, weight, bias)
        after_eager = counts.clone()
        got = compiled(hidden, weight, bias)
        assert_equal(got, expected)
        assert torch.equal(counts - after_eager, after_eager - before)


# ---- The wrapper's direct call ---------------------------------------------------------------

def test_direct_call_is_the_op(device):
    hidden, weight, bias = make_inputs(4, 64, "deepseek-v3", device=device)
    args = (hidden, weight, bias, 8, 4, 8, True, 2.5, "sigmoid", 0, 1.0, None, None, None, None,
            True)
    direct = moeext._C.call_fused_router(*args)
    assert isinstance(direct, tuple)  # taken, not declined
    assert_equal(direct, torch.ops.moeext.fused_router(*args))
    assert moeext._C.call_fused_router(*args[:6]) is not NotImplemented  # the defaults
    assert moeext._C.call_fused_router(*args[:5]) is NotImplemented  # topk missing
    assert moeext._C.call_fused_router(*args[:8], "sigmoid".encode()) is NotImplemented


# ---- The GPU's one launch: its completion counter --------------------------------------------

@pytest.mark.parametrize("fused_variant", [0, 1, 2])
@pytest.mark.skipif(not GPU_DEVICES, reason="needs a GPU")
def test_repeated_calls_on_two_cuda_streams(fused_variant):
    # The one launch (fused router variants 1 and 2): each call resets its counter; calls on
    # two streams at once use a counter each.
    p = PRESETS["deepseek-v3"]
    inputs = [make_inputs(t, 7168, "deepseek-v3", seed=t, device="cuda") for t in (1, 3, 16)]
    expected = [two_calls(h, w, b, p)[:2] for h, w, b in inputs]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    results = []
    torch.cuda.synchronize()
    with plain_variants(0, fused_variant):
        for round in range(20):
            for i, (h, w, b) in enumerate(inputs):
                with torch.cuda.stream(streams[(round + i) % 2]):
                    results.append((i, moeext.fused_router(h, w, b, **p.op_kwargs())[:2]))
        torch.cuda.synchronize()
    for i, got in results:
        assert_equal(got, expected[i])


# ---- The out= form ---------------------------------------------------------------------------

def out_buffers(num_tokens, columns, device, extra=3):
    """topk_weights and topk_ids as the first columns of wider buffers filled with sentinels,
    so that rows are strided and a write outside the view shows."""
    weights = torch.full((num_tokens, columns + extra), -7.0, device=device)
    ids = torch.full((num_tokens, columns + extra), -7, dtype=torch.int32, device=device)
    return weights, ids


def assert_untouched_beyond(buffers, columns):
    for buf in buffers:
        assert bool((buf[:, columns:] == -7).all())


@pytest.mark.parametrize("num_tokens", [1, 3, 16, 17])
@pytest.mark.parametrize("preset", ["deepseek-v3", "kimi-k2", "deepseek-v2", "nemotron-style"])
def test_out_form_equals_the_functional_form(device_isa, preset, num_tokens):
    device, _ = device_isa
    p = PRESETS[preset]
    hidden, weight, bias = make_inputs(num_tokens, 192, preset, seed=num_tokens, device=device)
    expected = moeext.fused_router(hidden, weight, bias, **p.op_kwargs())[:2]
    weights_buf, ids_buf = out_buffers(num_tokens, p.topk, device)
    kw = p.op_kwargs()
    del kw["topk"]
    assert moeext.fused_router_out(hidden, weight, bias, weights_buf[:, :p.topk],
                                   ids_buf[:, :p.topk], **kw) is None
    assert_equal((weights_buf[:, :p.topk], ids_buf[:, :p.topk]), expected)
    assert_untouched_beyond((weights_buf, ids_buf), p.topk)


def test_out_form_with_a_prepacked_weight_and_non_contiguous_hidden_states(device_isa):
    device, _ = device_isa
    p = PRESETS["deepseek-v3"]
    hidden, weight, bias = make_inputs(5, 256, "deepseek-v3", device=device)
    wide = torch.zeros(5, 512, dtype=hidden.dtype, device=device)
    wide[:, ::2] = hidden
    strided_hidden = wide[:, ::2]
    weights, ids = torch.empty(5, 8, device=device), torch.empty(5, 8, dtype=torch.int32,
                                                                 device=device)
    gates = [weight] + ([moeext.prepack_router_weight(weight)] if device == "cpu" else [])
    for gate in gates:  # a prepacked gate sums in its own order: compared with its own call
        expected = moeext.fused_router(hidden, gate, bias, **p.op_kwargs())[:2]
        weights.fill_(-1)
        ids.fill_(-1)
        moeext.fused_router_out(strided_hidden, gate, bias, weights, ids, 8, 4, True, 2.5)
        assert_equal((weights, ids), expected)


@pytest.mark.parametrize("num_tokens", [1, 6])
def test_out_form_with_every_option(device_isa, num_tokens):
    device, _ = device_isa
    p = PRESETS["deepseek-v3"]
    hidden, weight, bias = make_inputs(num_tokens, 128, "deepseek-v3", seed=num_tokens,
                                       device=device)
    expert_map = torch.randperm(p.num_experts + 2, generator=torch.Generator().manual_seed(3))
    expert_map = expert_map.to(torch.int32).to(device)
    valid = torch.tensor([max(1, num_tokens - 2)], dtype=torch.int32, device=device)

    def buffers():
        return (torch.full((p.num_experts,), 4, dtype=torch.int64, device=device),
                torch.full((num_tokens + 1, p.topk), -1, dtype=torch.int32, device=device))

    options = dict(num_fused_shared_experts=2, shared_expert_weight=0.5, expert_map=expert_map,
                   num_valid_tokens=valid)
    expected_counts, expected_record = buffers()
    expected = moeext.fused_router(hidden, weight, bias, **p.op_kwargs(), **options,
                                   expert_counts=expected_counts,
                                   routed_experts=expected_record)[:2]
    counts, record = buffers()
    weights_buf, ids_buf = out_buffers(num_tokens, p.topk + 2, device)
    moeext.fused_router_out(hidden, weight, bias, weights_buf[:, :p.topk + 2],
                            ids_buf[:, :p.topk + 2], 8, 4, True, 2.5, "sigmoid", **options,
                            expert_counts=counts, routed_experts=record)
    assert_equal((weights_buf[:, :p.topk + 2], ids_buf[:, :p.topk + 2], counts, record),
                 (*expected, expected_counts, expected_record))
    assert_untouched_beyond((weights_buf, ids_buf), p.topk + 2)


def _out_error_cases():
    def call(weights=None, ids=None, hidden=None, **changes):
        def run(device, counts, made):
            h, w, b = make_inputs(3, 64, "deepseek-v3", device=device)
            h = h if hidden is None else hidden(h)
            tw = torch.full((3, 8), -7.0, device=device) if weights is None else weights(h, device)
            ti = (torch.full((3, 8), -7, dtype=torch.int32, device=device) if ids is None
                  else ids(tw, device))
            made.extend((t, t.clone()) for t in (h, tw, ti))
            args = dict(num_expert_group=8, topk_group=4, expert_counts=counts)
            args.update(changes)
            moeext.fused_router_out(h, w, b, tw, ti, **args)
        return run

    f32 = torch.float32
    return [
        (call(weights=lambda h, d: torch.zeros(3, 8, dtype=torch.float16, device=d)),
         r"fused_router_out: topk_weights must be Float, got Half"),
        (call(ids=lambda tw, d: torch.zeros(3, 8, dtype=torch.int64, device=d)),
         r"fused_router_out: topk_ids must be Int, got Long"),
        (call(weights=lambda h, d: torch.zeros(2, 8, device=d)),
         r"fused_router_out: topk_weights must have shape \[3, 8\], got \[2, 8\]"),
        (call(ids=lambda tw, d: torch.zeros(3, 8, 1, dtype=torch.int32, device=d)),
         r"fused_router_out: topk_ids must be 2-D \[num_tokens, topk\], got 3-D"),
        (call(weights=lambda h, d: torch.zeros(8, 3, device=d).t()),
         r"fused_router_out: topk_weights must have contiguous columns"),
        (call(ids=lambda tw, d: tw.view(torch.int32)),
         r"fused_router_out: topk_weights and topk_ids share memory|"
         r"fused_router_out: .*topk_ids.*share"),
        (call(weights=lambda h, d: h.view(f32)[:, :8]),
         r"fused_router_out: topk_weights and hidden_states share memory"),
        (call(ids=lambda tw, d: torch.zeros(3, 1, dtype=torch.int32, device=d),
              num_fused_shared_experts=1),
         r"fused_router_out: topk_ids has 1 columns, which leaves no routed expert"),
        (call(num_expert_group=7), r"fused_router_out: num_expert_group \(7\) must divide"),
        (call(scoring_func="tanh"), r"fused_router_out: scoring_func must be"),
        (call(expert_map=torch.zeros(255, dtype=torch.int32)),
         r"fused_router_out: expert_map must be int32 of shape \[256\]"),
        (call(hidden=lambda h: h.float()),
         r"fused_router_out: weight must have the dtype of hidden_states \(Float\)"),
    ]


@pytest.mark.parametrize("case", range(len(_out_error_cases())))
def test_out_form_errors_name_the_argument_and_write_nothing(case):
    run, message = _out_error_cases()[case]
    counts = torch.full((256,), 5, dtype=torch.int64)
    made = []
    with pytest.raises(RuntimeError, match=message):
        run("cpu", counts, made)
    assert bool((counts == 5).all())
    for tensor, before in made:
        assert_equal((tensor,), (before,))


def test_out_form_writes_nothing_on_error_into_its_outputs(device):
    hidden, weight, bias = make_inputs(3, 64, "deepseek-v3", device=device)
    weights = torch.full((3, 8), -7.0, device=device)
    ids = torch.full((3, 8), -7, dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match=r"fused_router_out: num_expert_group \(7\)"):
        moeext.fused_router_out(hidden, weight, bias, weights, ids, 7, 4)
    with pytest.raises(RuntimeError, match="fused_router_out: topk_ids and weight share"):
        moeext.fused_router_out(hidden, weight, bias, weights, weight.view(torch.int32)[:3, :8],
                                8, 4)
    assert bool((weights == -7).all()) and bool((ids == -7).all())


def test_out_form_refuses_a_gradient_and_bumps_versions(device):
    hidden, weight, bias = make_inputs(2, 64, "deepseek-v3", device=device, dtype=torch.float32)
    weights = torch.full((2, 8), -7.0, device=device)
    ids = torch.full((2, 8), -7, dtype=torch.int32, device=device)
    for name, args in (("hidden_states", (hidden.clone().requires_grad_(), weight)),
                       ("weight", (hidden, weight.clone().requires_grad_()))):
        with pytest.raises(RuntimeError, match=f"fused_router_out: {name} requires grad"):
            moeext.fused_router_out(*args, bias, weights, ids, 8, 4)
    assert bool((weights == -7).all()) and bool((ids == -7).all())
    before = (weights._version, ids._version)
    moeext.fused_router_out(hidden, weight, bias, weights, ids, 8, 4)
    assert weights._version > before[0] and ids._version > before[1]
    with torch.no_grad():
        moeext.fused_router_out(hidden.clone().requires_grad_(), weight, bias, weights, ids, 8, 4)


@pytest.mark.parametrize("num_tokens", [0, 1, 9])
def test_out_form_opcheck(device, num_tokens):
    hidden, weight, bias = make_inputs(num_tokens, 96, "deepseek-v3", device=device)
    op = torch.ops.moeext.fused_router_out.default
    weights = torch.empty(num_tokens, 8, device=device)
    ids = torch.empty(num_tokens, 8, dtype=torch.int32, device=device)
    torch.library.opcheck(op, (hidden, weight, bias, weights, ids, 8, 4, True, 2.5, "sigmoid"))
    counts = torch.zeros(256, dtype=torch.int32, device=device)
    record = torch.zeros(num_tokens + 1, 8, dtype=torch.int16, device=device)
    expert_map = torch.arange(257, dtype=torch.int32, device=device)
    shared_weights = torch.empty(num_tokens, 9, device=device)
    shared_ids = torch.empty(num_tokens, 9, dtype=torch.int32, device=device)
    torch.library.opcheck(op, (hidden, weight, None, shared_weights, shared_ids, 8, 4, False,
                               1.0, "softmax", 1, 0.5, expert_map, counts, record, None))


def test_out_form_compiles_fullgraph(device):
    torch._dynamo.reset()
    p = PRESETS["deepseek-v3"]
    weights_buf, ids_buf = out_buffers(17, 8, device)

    def route(hidden, weight, bias):
        n = hidden.shape[0]
        moeext.fused_router_out(hidden * 1.0, weight, bias, weights_buf[:n, :8],
                                ids_buf[:n, :8], 8, 4, True, 2.5)
        return weights_buf[:n, :8] * 2, ids_buf[:n, :8] + 0

    compiled = torch.compile(route, fullgraph=True, dynamic=True)
    for num_tokens in (3, 17, 1):
        hidden, weight, bias = make_inputs(num_tokens, 128, "deepseek-v3", seed=num_tokens,
                                           device=device)
        expected = moeext.fused_router(hidden, weight, bias, **p.op_kwargs())[:2]
        got = compiled(hidden, weight, bias)
        assert_equal(got, (expected[0] * 2, expected[1]))
    assert_untouched_beyond((weights_buf, ids_buf), 8)


def test_out_form_direct_call_is_the_op(device):
    hidden, weight, bias = make_inputs(4, 64, "deepseek-v3", device=device)
    weights, ids = torch.empty(4, 8, device=device), torch.empty(4, 8, dtype=torch.int32,
                                                                 device=device)
    args = (hidden, weight, bias, weights, ids, 8, 4, True, 2.5, "sigmoid", 0, 1.0, None, None,
            None, None)
    assert moeext._C.call_fused_router_out(*args) is None  # taken, not declined
    expected = (weights.clone(), ids.clone())
    weights.zero_()
    ids.zero_()
    torch.ops.moeext.fused_router_out(*args)
    assert_equal((weights, ids), expected)
    assert moeext._C.call_fused_router_out(*args[:6]) is NotImplemented  # topk_group missing
    assert moeext._C.call_fused_router_out(*args[:9], b"sigmoid") is NotImplemented


@pytest.mark.parametrize("fused_variant", [0, 1])
@pytest.mark.skipif(not GPU_DEVICES, reason="needs a GPU")
def test_out_form_in_a_cuda_graph(fused_variant):
    # Persistent buffers, as a decode step captures them: the graph's replays route whatever
    # the input buffer holds, and the counts accumulate over replays. The graph keeps the way
    # of running (two kernels, or the one launch) set while it was captured.
    p = PRESETS["deepseek-v3"]
    inputs = [make_inputs(4, 7168, "deepseek-v3", seed=s, device="cuda") for s in range(3)]
    hidden = inputs[0][0].clone()
    weight, bias = inputs[0][1], inputs[0][2]
    weights = torch.empty(4, 8, device="cuda")
    ids = torch.empty(4, 8, dtype=torch.int32, device="cuda")
    counts = torch.zeros(p.num_experts, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with plain_variants(0, fused_variant):
        with torch.cuda.stream(stream):  # warm-up outside the capture
            moeext.fused_router_out(hidden, weight, bias, weights, ids, 8, 4, True, 2.5,
                                    expert_counts=counts)
        torch.cuda.synchronize()
        counts.zero_()
        with torch.cuda.graph(graph):
            moeext.fused_router_out(hidden, weight, bias, weights, ids, 8, 4, True, 2.5,
                                    expert_counts=counts)
    expected_counts = torch.zeros_like(counts)
    for h, _, _ in inputs:
        hidden.copy_(h)
        graph.replay()
        expected_weights, expected_ids = moeext.fused_router(h, weight, bias, **p.op_kwargs(),
                                                             expert_counts=expected_counts)[:2]
        torch.cuda.synchronize()
        assert_equal((weights, ids), (expected_weights, expected_ids))
    assert torch.equal(counts, expected_counts)


# ---- The variants: the router GEMM's, and the one launch with either count --------------------

@contextlib.contextmanager
def plain_variants(gemm, fused):
    """moeext._C's A/B switches of the router GEMM and of how fused_router runs (0: the two
    kernels; 1-3: the one launch), set for the block."""
    with (switched(moeext._C._set_gpu_router_gemm_variant, gemm),
          switched(moeext._C._set_gpu_fused_router_variant, fused)):
        yield


@pytest.mark.parametrize("pdl", [False, True], ids=["no-pdl", "pdl"])
@pytest.mark.parametrize("variants", [(1, 0), (2, 0), (3, 0), (0, 1), (1, 1), (0, 2), (1, 2),
                                      (0, 3), (1, 3)],
                         ids=["gemm1", "gemm2", "gemm3", "one-launch", "one-launch-gemm1",
                              "one-launch-acq-rel", "one-launch-acq-rel-gemm1",
                              "one-launch-gate-block", "one-launch-gate-block-gemm1"])
@pytest.mark.parametrize("preset", PRESET_NAMES)
@pytest.mark.skipif(not GPU_DEVICES, reason="needs a GPU")
def test_variants_give_the_same_fused_router_on_cuda(preset, variants, pdl):
    """The router GEMM's variant 1 (never the weight asked of L2 before the grid wait, which
    the current kernel does under programmatic dependent launch), its variants 2 and 3 (the
    4-token tile's other shapes, in the two kernels' GEMM), and the one launch counting
    its blocks either way (every thread fencing, or thread 0 with one acquire-release atomic),
    and routing with the gate's own code, a single token by the whole last block (variant 3):
    the bits of the two kernels for every token tile, with and without programmatic dependent
    launch, back to back on a stream and replayed in a CUDA graph (the counter must be back at
    zero after each launch)."""
    p = PRESETS[preset]
    inputs = [make_inputs(t, 7168, preset, seed=t, device="cuda") for t in (1, 2, 3, 8, 13, 16)]
    inputs.append(make_inputs(5, 7168, preset, seed=5, device="cuda", bias_dtype=None))
    previous_pdl = moeext.set_programmatic_dependent_launch(pdl)

    def route_all():
        return [moeext.fused_router(h, w, b, **p.op_kwargs(), return_logits=True)
                for h, w, b in inputs]

    try:
        with plain_variants(0, 0):
            current = route_all()
        with plain_variants(*variants):
            other = route_all()
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):  # warm-up outside the capture
                route_all()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = route_all()
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
    finally:
        moeext.set_programmatic_dependent_launch(previous_pdl)
    for got, again, expected in zip(other, replayed, current):
        assert_equal(got, expected)
        assert_equal(again, expected)
