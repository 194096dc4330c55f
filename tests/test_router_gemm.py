"""moeext.router_gemm against the fp64 reference (SPEC.md section 2)."""

import math

import pytest
import torch
import torch.nn.functional as F

import moeext
from conftest import GPU_DEVICES, switched
from moeext import reference

INPUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def make_inputs(num_tokens, hidden_size, num_experts, dtype=torch.bfloat16, seed=0,
                device="cpu"):
    """Hidden states of unit scale and a gate weight of DeepSeek-V3's init scale (~0.02)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=g).to(dtype)
    weight = (0.02 * torch.randn(num_experts, hidden_size, generator=g)).to(dtype)
    return hidden.to(device), weight.to(device)


def fp32_tolerance(hidden, weight):
    """Bound on the fp32 accumulation error of each logit, from H and the terms' magnitudes.

    Rounding errors of an fp32 sum of H terms behave like a random walk: about
    sqrt(H) * 2^-24 * sum|x_h * w_h| for any summation order (blocked or lane-wise orders
    do better). Four times that is far below the error of bf16 logits (~2^-9 relative),
    which test_fp32_logits_are_not_rounded_to_bf16 checks separately.
    """
    hidden_size = hidden.shape[1]
    magnitude = hidden.double().abs() @ weight.double().abs().T
    return 4 * math.sqrt(max(hidden_size, 1)) * 2.0**-24 * magnitude + 1e-30


def assert_close_to_reference(got, hidden, weight, out_dtype=None):
    """Checks got against the exact product, computed on the CPU whatever got's device."""
    expected_dtype = torch.float32 if out_dtype is None else out_dtype
    assert got.shape == (hidden.shape[0], weight.shape[0])
    assert got.dtype == expected_dtype and got.device == hidden.device
    got, hidden, weight = got.cpu(), hidden.cpu(), weight.cpu()
    exact = hidden.double() @ weight.double().T
    tolerance = fp32_tolerance(hidden, weight)
    if expected_dtype == torch.bfloat16:
        # Rounded once: within half a bf16 ulp of the fp32 sum, which is within tolerance.
        _, exponent = torch.frexp(exact.abs().clamp_min(2.0**-126).float())
        tolerance = tolerance + torch.ldexp(torch.ones_like(exact), exponent.double() - 9)
    error = (got.double() - exact).abs()
    worst = int(torch.argmax(error - tolerance)) if error.numel() else 0
    assert bool((error <= tolerance).all()), (
        f"max error {error.flatten()[worst]:.3g} > tolerance {tolerance.flatten()[worst]:.3g}")


# The sizes: the decode range and its edges (0, 1, 3, 16, 17; 8 and 9 are the two
# sides of the GPU kernel's 16-token instance, which at E = 384 hands over to cuBLAS) and a
# prefill chunk
# (100); hidden sizes of DeepSeek-V3/Kimi-K2 (7168), Qwen3-Coder-480B (6144), GLM-4.5-Air
# (4096) and an odd one; expert counts of DeepSeek-V3, Kimi-K2, GLM-4.5 and an odd one.
HIDDEN_SIZES = [7168, 6144, 4096, 1000]
NUM_EXPERTS = [256, 384, 160, 7]


@pytest.mark.parametrize("num_experts", NUM_EXPERTS)
@pytest.mark.parametrize("hidden_size", HIDDEN_SIZES)
@pytest.mark.parametrize("num_tokens", [0, 1, 3, 8, 9, 16, 17, 100])
def test_matches_fp64_reference(device, num_tokens, hidden_size, num_experts):
    hidden, weight = make_inputs(num_tokens, hidden_size, num_experts,
                                 seed=num_tokens + hidden_size + num_experts, device=device)
    assert_close_to_reference(moeext.router_gemm(hidden, weight), hidden, weight)


@pytest.mark.parametrize("hidden_size,num_experts", [(7168, 256), (6144, 384), (4096, 160),
                                                     (1000, 7)])
def test_prefill_2048_tokens(device, hidden_size, num_experts):
    hidden, weight = make_inputs(2048, hidden_size, num_experts, seed=hidden_size, device=device)
    assert_close_to_reference(moeext.router_gemm(hidden, weight), hidden, weight)


@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,hidden_size,num_experts", [
    (1, 1000, 7), (3, 7168, 9), (17, 33, 160), (5, 32, 4), (6, 31, 5), (2, 1, 3), (4, 0, 6),
    (9, 65, 0), (16, 2048, 13),
    # Batches where avx512bf16 puts tokens in the vector lanes: each layout (4-token vectors
    # by 2 and by 3, 8-token vectors by 2 and by 3, 16-token vectors by 2; the shapes above
    # with 5, 6 and 16 tokens take some too) with short last pair groups and expert
    # remainders, two layouts in one call, the register tiles for the last two tokens, H = 0
    # and 1.
    (8, 1001, 19), (10, 7168, 17), (11, 1003, 9), (14, 1001, 19), (12, 66, 9), (23, 64, 11),
    (47, 999, 21), (34, 7168, 17), (14, 0, 5), (7, 1, 3),
    # Token lanes whose last tile of 8 experts holds 6 (no shape above takes that tile).
    (13, 999, 22), (25, 64, 6), (9, 1001, 14),
    # The register tiles past one token block: H walked in passes of 8192 with the sums kept
    # in between (H = 8200: a pass of 8 after a whole one; 16500: three), and more token
    # blocks than the stack's scratch holds (heap scratch; with and without passes).
    (9, 8200, 13), (70, 16500, 5), (100, 300, 21),
])
def test_every_cpu_path(device_isa, dtype, out_dtype, num_tokens, hidden_size, num_experts):
    """Tile edges (tokens and experts not multiples of the tile), every K tail, H = 0 and 1:
    on every CPU path, and on each GPU."""
    device, _ = device_isa
    hidden, weight = make_inputs(num_tokens, hidden_size, num_experts, dtype, seed=hidden_size,
                                 device=device)
    got = moeext.router_gemm(hidden, weight, out_dtype)
    assert_close_to_reference(got, hidden, weight, out_dtype)
    if hidden_size == 0:
        assert bool((got == 0).all())


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
def test_bf16_logits_are_the_fp32_logits_rounded_once(device_isa, dtype):
    device, _ = device_isa
    hidden, weight = make_inputs(37, 2000, 50, dtype, device=device)
    fp32 = moeext.router_gemm(hidden, weight)
    bf16 = moeext.router_gemm(hidden, weight, torch.bfloat16)
    assert torch.equal(bf16, fp32.to(torch.bfloat16))


def test_fp32_logits_are_not_rounded_to_bf16(device):
    """What the op is for: fp32 logits much closer to exact than a bf16 GEMM's (on the same
    device)."""
    hidden, weight = make_inputs(16, 7168, 256, device=device)
    exact = reference.router_gemm(hidden.cpu(), weight.cpu()).double()
    ours = (moeext.router_gemm(hidden, weight).cpu().double() - exact).abs().max()
    bf16_gemm = (F.linear(hidden, weight).cpu().double() - exact).abs().max()
    assert ours < bf16_gemm / 50, (ours, bf16_gemm)


def test_paths_agree(device_isa):
    """Every path is within the same tolerance of the reference at DeepSeek-V3's shape."""
    device, _ = device_isa
    hidden, weight = make_inputs(4, 7168, 256, seed=3, device=device)
    assert_close_to_reference(moeext.router_gemm(hidden, weight), hidden, weight)


def test_strided_rows_read_nothing_outside_the_view(device_isa):
    """Row-strided inputs (slices of wider buffers) whose padding is NaN: masked tails must
    not read it, and the logits land in a fresh contiguous tensor."""
    device, _ = device_isa
    hidden, weight = make_inputs(13, 1001, 9, device=device)
    hidden_buf = torch.full((26, 1040), float("nan"), dtype=torch.bfloat16, device=device)
    hidden_buf[::2, :1001] = hidden
    weight_buf = torch.full((9, 1100), float("nan"), dtype=torch.bfloat16, device=device)
    weight_buf[:, :1001] = weight
    strided_hidden, strided_weight = hidden_buf[::2, :1001], weight_buf[:, :1001]
    assert strided_hidden.stride() == (2080, 1) and strided_weight.stride() == (1100, 1)
    got = moeext.router_gemm(strided_hidden, strided_weight)
    assert got.is_contiguous()
    assert_close_to_reference(got, hidden, weight)


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
def test_any_strides_as_f_linear_takes_them(device_isa, dtype):
    """Column-strided hidden states and weights (transposed views, every other column), which
    F.linear takes: the same logits, bit for bit, as their contiguous copies give."""
    device, _ = device_isa
    hidden, weight = make_inputs(5, 300, 24, dtype, seed=7, device=device)
    expected = moeext.router_gemm(hidden, weight)
    transposed_hidden = hidden.T.contiguous().T
    every_other = torch.zeros(24, 600, dtype=dtype, device=device)
    every_other[:, ::2] = weight
    strided_weight = every_other[:, ::2]
    assert transposed_hidden.stride(1) != 1 and strided_weight.stride(1) == 2
    for h, w in ((transposed_hidden, weight), (hidden, strided_weight),
                 (transposed_hidden, strided_weight)):
        assert torch.equal(moeext.router_gemm(h, w), expected)
        assert torch.equal(torch.ops.moeext.router_gemm(h, w, None), expected)


def test_a_prepacked_weight_takes_column_strided_hidden_states():
    hidden, weight = make_inputs(3, 130, 70, seed=8)
    packed = moeext.prepack_router_weight(weight)
    assert torch.equal(moeext.router_gemm(hidden.T.contiguous().T, packed),
                       moeext.router_gemm(hidden, packed))


def test_non_finite_inputs_propagate(device_isa):
    device, _ = device_isa
    hidden, weight = make_inputs(6, 100, 10, torch.float32)
    hidden[1, 50] = float("nan")
    hidden[3, 99] = float("inf")  # in the K tail of every vector width
    weight[7, 0] = float("inf")
    on_device = hidden.to(device)
    got = moeext.router_gemm(on_device, weight.to(device))
    assert got.device == on_device.device
    got = got.cpu()
    exact = reference.router_gemm(hidden, weight)
    assert torch.equal(torch.isnan(got), torch.isnan(exact))
    assert torch.equal(torch.isinf(got), torch.isinf(exact))
    finite = torch.isfinite(exact)
    torch.testing.assert_close(got[finite], exact[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prepacked", [False, True], ids=["nn_linear", "prepacked"])
def test_result_does_not_depend_on_the_thread_count(prepacked):
    """Threads split the experts, never H: each logit is summed in one fixed order.

    CPU only: it is about torch's CPU thread pool."""
    hidden, weight = make_inputs(9 if prepacked else 5, 7168, 384 if prepacked else 256)
    if prepacked:
        weight = moeext.prepack_router_weight(weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = moeext.router_gemm(hidden, weight)
        torch.set_num_threads(max(2, threads))
        multi = moeext.router_gemm(hidden, weight)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, multi)


def test_reference_is_the_exact_product_rounded_once():
    # An fp32 left-to-right sum gives (1 + 2^-30) - 1 = 0; the reference keeps 2^-30.
    hidden = torch.tensor([[1.0, 2.0**-30, -1.0]], dtype=torch.float32)
    weight = torch.ones(1, 3)
    assert float(reference.router_gemm(hidden, weight)) == 2.0**-30
    assert reference.router_gemm(hidden, weight, torch.bfloat16).dtype == torch.bfloat16


# Each case makes its arguments on the device the test runs on; "{device}" in a message is
# the device of hidden_states.
ERROR_CASES = [
    (lambda d: (torch.randn(4, device=d), torch.randn(3, 4, device=d), None),
     r"router_gemm: hidden_states must be 2-D \[num_tokens, hidden_size\], got shape \[4\]"),
    (lambda d: (torch.randn(2, 4, device=d), torch.randn(3, 4, 1, 1, device=d), None),
     r"router_gemm: weight must be 2-D \[num_experts, hidden_size\] \(or prepacked, 3-D "
     r"\[ceil\(hidden_size / 2\), num_experts, 2\]\), got shape \[3, 4, 1, 1\]"),
    (lambda d: (torch.randn(2, 4, device=d).double(), torch.randn(3, 4, device=d).double(), None),
     r"router_gemm: hidden_states must be float32, bfloat16 or float16, got Double"),
    (lambda d: (torch.randn(2, 4, device=d).bfloat16(), torch.randn(3, 4, device=d), None),
     r"router_gemm: weight must have the dtype of hidden_states \(BFloat16\), got Float"),
    (lambda d: (torch.randn(2, 4, device=d), torch.randn(3, 5, device=d), None),
     r"router_gemm: weight must have shape \[num_experts, 4\] \(hidden_size of hidden_states\), "
     r"got \[3, 5\]"),
    (lambda d: (torch.randn(2, 4, device=d), torch.randn(3, 4, device=d), torch.float16),
     r"router_gemm: out_dtype must be float32 or bfloat16 \(or None for float32\), got Half"),
    (lambda d: (torch.randn(2, 4, device=d), torch.randn(3, 4, device="meta"), None),
     r"router_gemm: weight is on meta but hidden_states is on {device}"),
]


@pytest.mark.parametrize("make_args,message", ERROR_CASES)
def test_errors_name_the_argument(device, make_args, message):
    args = make_args(device)
    with pytest.raises(RuntimeError, match=message.replace("{device}", str(args[0].device))):
        moeext.router_gemm(*args)


def test_none_for_a_tensor_is_named(device):
    # torch.ops passes None on as an undefined tensor, whose error names no argument.
    with pytest.raises(RuntimeError, match="router_gemm: hidden_states must be a tensor, got None"):
        moeext.router_gemm(None, torch.randn(3, 4, device=device))
    with pytest.raises(RuntimeError, match="router_gemm: weight must be a tensor, got None"):
        moeext.router_gemm(torch.randn(2, 4, device=device), None)


# The device case needs one real device.
FAKE_ERROR_CASES = ERROR_CASES[:-1]


@pytest.mark.parametrize("make_args,message", FAKE_ERROR_CASES)
def test_fake_rejects_what_the_kernel_rejects(make_args, message):
    hidden, weight, out_dtype = make_args("cpu")
    # Up to the dtype names, which Python and C++ spell differently.
    prefix = message.split(", got")[0].split(r" \(")[0]
    with pytest.raises(RuntimeError, match=prefix):
        moeext.router_gemm(hidden.to("meta"), weight.to("meta"), out_dtype)


# Prepacked weights (moeext.prepack_router_weight): a CPU layout.
# (T, H, E): decode sizes in one pass; more tokens than a register tile, so that k is walked
# in passes of 256 pairs (H > 512) with partial logits in between, the last pass sometimes
# only an odd H's half pair (H = 513); 300 tokens, two sweeps of 256; tiles of 64 experts
# with a narrow last one (65, 70, 129, 160, 7) and partial vectors; H = 0, 1 and odd.
PACKED_SHAPES = [
    (1, 7168, 256), (4, 7168, 384), (3, 1000, 160), (17, 4096, 7), (5, 1001, 65),
    (100, 513, 64), (9, 1, 3), (4, 0, 6), (0, 64, 5), (2, 31, 129), (300, 66, 70),
    # A last tile of 33-48 experts: three 16-lane vectors.
    (7, 257, 40), (40, 257, 112),
    # One or two tokens take register tiles as wide as a whole tile of 64 experts (8 vectors
    # on AVX2): narrow last tiles under them, and a second tile.
    (1, 513, 70), (2, 257, 100), (1, 1001, 200),
]


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,hidden_size,num_experts", PACKED_SHAPES)
def test_prepacked_weight_on_every_cpu_path(cpu_isa, out_dtype, num_tokens, hidden_size,
                                            num_experts):
    hidden, weight = make_inputs(num_tokens, hidden_size, num_experts,
                                 seed=num_tokens + hidden_size)
    packed = moeext.prepack_router_weight(weight)
    got = moeext.router_gemm(hidden, packed, out_dtype)
    assert_close_to_reference(got, hidden, weight, out_dtype)
    assert torch.equal(reference.router_gemm(hidden, packed, out_dtype),
                       reference.router_gemm(hidden, weight, out_dtype))
    if out_dtype is None:
        bf16 = moeext.router_gemm(hidden, packed, torch.bfloat16)
        assert torch.equal(bf16, got.to(torch.bfloat16))


@pytest.mark.parametrize("hidden_size,num_experts", [(3, 65), (4, 64), (1, 1), (0, 3), (7, 130),
                                                     (5, 0)])
def test_prepacked_layout_is_the_documented_one(hidden_size, num_experts):
    """Element (k, e, j) of expert e's pair k, in its tile of 64, at the documented place."""
    weight = torch.arange(num_experts * hidden_size, dtype=torch.float32)
    weight = weight.reshape(num_experts, hidden_size).bfloat16()
    packed = moeext.prepack_router_weight(weight)
    pairs = (hidden_size + 1) // 2
    assert packed.shape == (pairs, num_experts, 2) and packed.dtype == torch.bfloat16
    assert packed.is_contiguous()
    flat = packed.reshape(-1)
    for e in range(num_experts):
        first = e // 64 * 64
        width = min(64, num_experts - first)
        for h in range(2 * pairs):
            at = first * pairs * 2 + (h // 2 * width + e - first) * 2 + h % 2
            expected = weight[e, h] if h < hidden_size else 0.0
            assert float(flat[at]) == float(expected), (e, h)
    assert torch.equal(reference.unpack_router_weight(packed, hidden_size), weight)


def test_prepack_reads_any_strides():
    _, weight = make_inputs(1, 1001, 70)
    wide = torch.full((70, 1100), float("nan"), dtype=torch.bfloat16)
    wide[:, :1001] = weight
    assert torch.equal(moeext.prepack_router_weight(wide[:, :1001]),
                       moeext.prepack_router_weight(weight))
    assert torch.equal(moeext.prepack_router_weight(weight.T.contiguous().T),
                       moeext.prepack_router_weight(weight))


def test_prepacked_strided_rows_read_nothing_outside_the_view(cpu_isa):
    """An odd H's half pair must not read the element past the row (NaN here)."""
    hidden, weight = make_inputs(13, 1001, 9)
    hidden_buf = torch.full((26, 1040), float("nan"), dtype=torch.bfloat16)
    hidden_buf[::2, :1001] = hidden
    got = moeext.router_gemm(hidden_buf[::2, :1001], moeext.prepack_router_weight(weight))
    assert_close_to_reference(got, hidden, weight)


def test_prepacked_non_finite_inputs_propagate(cpu_isa):
    """Infinities and NaN reach exactly the logits they reach in the exact product; the
    zero lanes past the last expert of a tile meet them too, and are never written."""
    hidden, weight = make_inputs(6, 101, 10)
    hidden[1, 50] = float("nan")
    hidden[3, 100] = float("inf")  # the odd H's half pair
    weight[7, 0] = float("inf")
    got = moeext.router_gemm(hidden, moeext.prepack_router_weight(weight))
    exact = reference.router_gemm(hidden, weight)
    assert torch.equal(torch.isnan(got), torch.isnan(exact))
    assert torch.equal(torch.isinf(got), torch.isinf(exact))
    finite = torch.isfinite(exact)
    torch.testing.assert_close(got[finite], exact[finite], rtol=1e-5, atol=1e-5)


def _packed(num_experts, hidden_size):
    return moeext.prepack_router_weight(torch.randn(num_experts, hidden_size).bfloat16())


PACKED_ERROR_CASES = [
    (lambda: (torch.randn(2, 4), torch.randn(2, 3, 2), None),
     r"router_gemm: a prepacked weight and hidden_states must both be bfloat16, got weight "
     r"Float and hidden_states Float"),
    (lambda: (torch.randn(2, 4).bfloat16(), torch.randn(2, 3, 2), None),
     r"router_gemm: a prepacked weight and hidden_states must both be bfloat16, got weight "
     r"Float and hidden_states BFloat16"),
    (lambda: (torch.randn(2, 4).half(), _packed(3, 4), None),
     r"router_gemm: a prepacked weight and hidden_states must both be bfloat16, got weight "
     r"BFloat16 and hidden_states Half"),
    (lambda: (torch.randn(2, 5).bfloat16(), _packed(3, 4), None),
     r"router_gemm: a prepacked weight must have shape \[3, num_experts, 2\] "
     r"\(ceil\(hidden_size / 2\) for the hidden_size 5 of hidden_states\), got \[2, 3, 2\]"),
    (lambda: (torch.randn(2, 4).bfloat16(), torch.randn(2, 3, 1).bfloat16(), None),
     r"router_gemm: a prepacked weight must have shape \[2, num_experts, 2\]"),
    (lambda: (torch.randn(2, 4).bfloat16(), _packed(6, 4)[:, ::2], None),
     r"router_gemm: a prepacked weight must be contiguous, as moeext.prepack_router_weight "
     r"returns it"),
    (lambda: (torch.randn(2, 4).bfloat16(), _packed(3, 4), torch.float16),
     r"router_gemm: out_dtype must be float32 or bfloat16"),
]


@pytest.mark.parametrize("make_args,message", PACKED_ERROR_CASES)
def test_prepacked_errors_name_the_argument(make_args, message):
    with pytest.raises(RuntimeError, match=message):
        moeext.router_gemm(*make_args())


@pytest.mark.parametrize("make_args,message",
                         [c for c in PACKED_ERROR_CASES if "contiguous" not in c[1]])
def test_fake_rejects_the_prepacked_weights_the_kernel_rejects(make_args, message):
    hidden, weight, out_dtype = make_args()
    prefix = message.split(", got")[0].split(r" \(")[0]
    with pytest.raises(RuntimeError, match=prefix):
        moeext.router_gemm(hidden.to("meta"), weight.to("meta"), out_dtype)


@pytest.mark.parametrize("weight,message", [
    (torch.randn(3, 4), r"prepack_router_weight: weight must be bfloat16 \(the layout feeds "
     r"bf16 dot products\), got torch.float32"),
    (torch.randn(3, 4, 2).bfloat16(),
     r"prepack_router_weight: weight must be 2-D \[num_experts, hidden_size\], got shape "
     r"\[3, 4, 2\]"),
    (torch.randn(3, 4).bfloat16().to("meta"),
     r"prepack_router_weight: the prepacked layout is read by the CPU kernels only; weight is "
     r"on meta"),
    ([[1.0]], r"prepack_router_weight: weight must be a torch.Tensor, got list"),
])
def test_prepack_errors_name_the_argument(weight, message):
    with pytest.raises(ValueError, match=message):
        moeext.prepack_router_weight(weight)


@pytest.mark.parametrize("device", GPU_DEVICES)
def test_gpu_rejects_a_prepacked_weight(device):
    hidden = torch.randn(2, 4, device=device).bfloat16()
    packed = _packed(3, 4).to(device)
    with pytest.raises(RuntimeError, match=r"router_gemm: a prepacked weight "
                       r"\(moeext.prepack_router_weight\) is a CPU layout"):
        moeext.router_gemm(hidden, packed)


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", [0, 1, 17])
def test_gradient_matches_the_reference(device, dtype, out_dtype, num_tokens):
    # The reference's gradient is torch's through the fp64 product; moeext's is computed in
    # fp32, and each is rounded once to its input's dtype. Hidden states are strided rows.
    wide, _ = make_inputs(num_tokens, 2 * 333, 13, dtype=dtype, seed=num_tokens, device=device)
    _, weight = make_inputs(num_tokens, 333, 13, dtype=dtype, seed=num_tokens, device=device)
    hidden = wide[:, :333]
    grad_logits = torch.randn(num_tokens, 13, device=device).to(out_dtype or torch.float32)
    grads = []
    for impl in (moeext, reference):
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_()
        impl.router_gemm(h, w, out_dtype).backward(grad_logits)
        assert h.grad.dtype == dtype and w.grad.dtype == dtype
        grads.append((h.grad, w.grad))
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    for got, expected in zip(grads[0], grads[1]):
        scale = expected.abs().max().item() if expected.numel() else 0.0
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol * scale)


def test_gradient_only_where_asked(device):
    hidden, weight = make_inputs(5, 64, 9, device=device)
    h = hidden.clone().requires_grad_()
    moeext.router_gemm(h, weight).sum().backward()
    torch.testing.assert_close(h.grad.float(), weight.float().sum(0).expand(5, 64),
                               rtol=1e-2, atol=1e-3)
    w = weight.clone().requires_grad_()
    moeext.router_gemm(hidden, w).sum().backward()
    torch.testing.assert_close(w.grad.float(), hidden.float().sum(0).expand(9, 64),
                               rtol=1e-2, atol=1e-2)
    with torch.no_grad():
        assert not moeext.router_gemm(h, w).requires_grad


def test_prepacked_weight_refuses_a_gradient():
    hidden, weight = make_inputs(3, 64, 9)
    packed = moeext.prepack_router_weight(weight)
    expected = moeext.router_gemm(hidden, packed)
    for h, w, name in [(hidden.clone().requires_grad_(), packed, "hidden_states"),
                       (hidden, packed.clone().requires_grad_(), "weight")]:
        with pytest.raises(RuntimeError, match=f"router_gemm: {name} requires grad, but a "
                                               "prepacked weight has no gradient"):
            moeext.router_gemm(h, w)
        with torch.no_grad():
            assert torch.equal(moeext.router_gemm(h, w), expected)


# The wrapper's direct call of the op (moeext._C.call_router_gemm), as the routing op's.

@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [0, 1, 5])
def test_direct_call_is_the_op(device, num_tokens, out_dtype):
    hidden, weight = make_inputs(num_tokens, 96, 13, device=device)
    direct = moeext._C.call_router_gemm(hidden, torch.nn.Parameter(weight, requires_grad=False),
                                        out_dtype)
    assert isinstance(direct, torch.Tensor)  # taken, not declined
    expected = torch.ops.moeext.router_gemm(hidden, weight, out_dtype)
    assert direct.dtype == expected.dtype and torch.equal(direct, expected)


class _Tagged(torch.Tensor):
    pass


@pytest.mark.parametrize("change", [
    lambda a: (a[0].as_subclass(_Tagged),) + a[1:],
    lambda a: a[:2] + ("float32",),
    lambda a: (a[0].tolist(),) + a[1:],
], ids=["tensor subclass", "str for dtype", "list for tensor"])
def test_direct_call_declines_what_torch_ops_decides(change):
    hidden, weight = make_inputs(3, 64, 9)
    args = change((hidden, weight, None))
    assert moeext._C.call_router_gemm(*args) is NotImplemented
    try:
        expected = torch.ops.moeext.router_gemm(*args)
    except (RuntimeError, TypeError) as error:
        with pytest.raises(type(error)) as raised:
            moeext.router_gemm(*args)
        assert str(raised.value) == str(error)
    else:
        assert torch.equal(moeext.router_gemm(*args), expected)


def test_direct_call_takes_the_schemas_defaults_and_declines_a_missing_argument():
    hidden, weight = make_inputs(3, 64, 9)
    assert torch.equal(moeext._C.call_router_gemm(hidden, weight),
                       torch.ops.moeext.router_gemm(hidden, weight))
    assert moeext._C.call_router_gemm(hidden) is NotImplemented
    assert moeext._C.call_router_gemm(hidden, weight, None, None) is NotImplemented


def test_direct_call_errors_are_the_ops():
    hidden, weight = make_inputs(3, 64, 9)
    for args in [(hidden, weight[:, :32], None), (hidden, weight, torch.float16)]:
        with pytest.raises(RuntimeError) as expected:
            torch.ops.moeext.router_gemm(*args)
        with pytest.raises(RuntimeError) as got:
            moeext._C.call_router_gemm(*args)
        assert str(got.value) == str(expected.value)


# ---- The router GEMM's variants (moeext._C._set_gpu_router_gemm_variant) ---------------------

def router_gemm_variant(variant):
    return switched(moeext._C._set_gpu_router_gemm_variant, variant)


@pytest.mark.parametrize("device", GPU_DEVICES or [pytest.param("cuda", marks=pytest.mark.skip(
    reason="needs a GPU and a moeext built for it"))])
@pytest.mark.parametrize("variant", [1, 2, 3])
@pytest.mark.parametrize("pdl", [False, True], ids=["no-pdl", "pdl"])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
def test_router_gemm_variant_is_the_current_kernel(device, dtype, out_dtype, pdl, variant):
    """Each variant gives the current kernel's bits: 1, never the weight asked of L2 before
    the grid wait (which the current kernel does under programmatic dependent launch); 2 and 3,
    the 4-token tile at three blocks a multiprocessor or two experts a block. Every token
    tile, odd gates and hidden sizes, strided rows, a hidden size of 0, with and without
    programmatic dependent launch, calls back to back on the stream."""
    cases = [(t, 7168, 256) for t in (1, 2, 3, 5, 8, 9, 16)]
    cases += [(4, 6144, 384), (1, 1000, 7), (11, 8, 160), (3, 0, 5), (2, 32776, 3)]
    cases += [(4, 7168, 384), (3, 1000, 7), (4, 2056, 385)]
    inputs = []
    for num_tokens, hidden_size, num_experts in cases:
        hidden, weight = make_inputs(num_tokens, hidden_size, num_experts, dtype,
                                     seed=num_tokens + hidden_size, device=device)
        inputs.append((hidden, weight))
    wide, weight = make_inputs(6, 2 * 7168, 256, dtype, seed=1, device=device)
    inputs.append((wide[:, 7168:], weight[:, :7168]))
    previous = moeext.set_programmatic_dependent_launch(pdl)
    try:
        with router_gemm_variant(0):
            current = [moeext.router_gemm(h, w, out_dtype) for h, w in inputs]
        with router_gemm_variant(variant):
            other = [moeext.router_gemm(h, w, out_dtype) for h, w in inputs]
    finally:
        moeext.set_programmatic_dependent_launch(previous)
    for (h, w), a, b in zip(inputs, current, other):
        assert torch.equal(a.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32),
                           b.view(torch.int16 if b.dtype == torch.bfloat16 else torch.int32)), \
            (tuple(h.shape), tuple(w.shape))
