"""shuffle_weight / unshuffle_weight / e8m0_shuffle / e8m0_unshuffle (SPEC.md section 3)."""

import itertools
import math
import re

import pytest
import torch

import moeext
from moeext import reference

# conftest's device_isa: the shuffles are not wired into the GPU emulation (tests/gpu_emulation/).
GPU_EMULATION = False

WEIGHT_DTYPES = [torch.uint8, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2,
                 torch.float4_e2m1fn_x2, torch.bfloat16, torch.float16]
SCALE_DTYPES = [torch.uint8, torch.float8_e8m0fnu]


def random_bytes(shape, dtype, seed=0, device="cpu"):
    """Random storage bytes viewed as `dtype` (every bit pattern, NaN encodings included)."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), generator=g,
                        dtype=torch.uint8)
    if raw.numel() == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    return raw.to(device).view(dtype)  # moved as bytes: fp4/fp8 copies need no kernel then


def to_cpu(t):
    """t on the CPU, moved as bytes for 1-byte dtypes (fp4/fp8 copies need no kernel then)."""
    return t.view(torch.uint8).cpu().view(t.dtype) if t.element_size() == 1 else t.cpu()


def as_bytes(t):
    if t.element_size() == 1:
        return t.view(torch.uint8).contiguous()
    return t.contiguous().view(torch.uint8)


def assert_same_bytes(a, b):
    """Same shape, dtype and bytes; a and b may sit on different devices."""
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(as_bytes(a).cpu(), as_bytes(b).cpu())


# --- the references follow SPEC's index formulas literally ------------------------------

def spec_shuffle_weight(w):
    """SPEC's formula, element by element, on a small 2-D tensor (1-byte or 2-byte)."""
    x = w.view(torch.uint8) if w.element_size() == 1 else w.view(torch.int16)
    n_rows, k = x.shape
    c = 16 // w.element_size()
    out = torch.empty(n_rows * k, dtype=x.dtype)
    for n, kk in itertools.product(range(n_rows), range(k)):
        n0, n1, kc, j = n // 16, n % 16, kk // c, kk % c
        out[((n0 * (k // c) + kc) * 16 + n1) * c + j] = x[n, kk]
    return out.view(n_rows, k).view(w.dtype)


def spec_e8m0_shuffle(scale):
    m, n = scale.shape
    pm, pn = (m + 255) // 256 * 256, (n + 7) // 8 * 8
    out = torch.empty(pm * pn, dtype=torch.uint8)
    src = scale.view(torch.uint8)
    for r, c in itertools.product(range(pm), range(pn)):
        a, h, c4, d, e, f = r // 32, (r // 16) % 2, r % 16, c // 8, (c // 4) % 2, c % 4
        value = int(src[r, c]) if r < m and c < n else 0x7F
        out[a * 32 * pn + d * 256 + f * 64 + c4 * 4 + e * 2 + h] = value
    return out.view(pm, pn)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16], ids=str)
def test_weight_reference_is_the_spec_formula(dtype):
    w = random_bytes((32, 64), dtype, seed=1)
    assert_same_bytes(reference.shuffle_weight(w), spec_shuffle_weight(w))


def test_scale_reference_is_the_spec_formula():
    s = random_bytes((37, 11), torch.uint8, seed=2)
    assert_same_bytes(reference.e8m0_shuffle(s), spec_e8m0_shuffle(s))


def test_references_stay_on_the_input_device(device):
    """The references are what users compare with on their own device (and what the GPU
    benchmark captures in a CUDA graph): nothing of theirs may land on the CPU."""
    w = random_bytes((2, 32, 64), torch.uint8, seed=3).to(device)
    s = random_bytes((64, 11), torch.uint8, seed=4).to(device)
    shuffled = reference.e8m0_shuffle(s, gate_up=True, num_experts=2)
    for out in (reference.shuffle_weight(w, gate_up=True),
                reference.unshuffle_weight(w, gate_up=True), shuffled,
                reference.e8m0_unshuffle(shuffled, 64, 11, gate_up=True, num_experts=2)):
        assert out.device == s.device


def test_gate_up_interleave_order(device):
    """Rows g0..g15, u0..u15, g16..g31, u16..u31: checked on row ids, not via the reference."""
    e, half, k = 2, 32, 32
    rows = torch.arange(e * 2 * half, dtype=torch.int16).view(e, 2 * half, 1).expand(e, 2 * half, k)
    w = rows.contiguous().to(device).view(torch.bfloat16)  # 2-byte elements holding their row id
    shuffled = moeext.shuffle_weight(w, gate_up=True)
    unshuffled_plain = moeext.unshuffle_weight(shuffled)  # undo the tiling only
    order = unshuffled_plain.view(torch.int16)[0, :, 0].tolist()
    assert order == list(range(0, 16)) + list(range(32, 48)) + list(range(16, 32)) + \
        list(range(48, 64))


# --- kernels against the reference -------------------------------------------------------

@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(16, 32), (48, 96), (3, 32, 64), (2, 3, 16, 128), (0, 32),
                                   (16, 0)])
def test_shuffle_weight(device, dtype, shape):
    w = random_bytes(shape, dtype, seed=len(shape), device=device)
    out = moeext.shuffle_weight(w)
    assert out.is_contiguous() and out.device == w.device
    assert_same_bytes(out, reference.shuffle_weight(to_cpu(w)))
    assert_same_bytes(moeext.unshuffle_weight(out), w)
    assert_same_bytes(reference.unshuffle_weight(to_cpu(out)), w)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=str)
def test_shuffle_weight_gate_up(device, dtype):
    w = random_bytes((3, 64, 64), dtype, seed=4, device=device)
    out = moeext.shuffle_weight(w, (16, 16), gate_up=True)
    assert out.device == w.device
    assert_same_bytes(out, reference.shuffle_weight(to_cpu(w), gate_up=True))
    assert_same_bytes(moeext.unshuffle_weight(out, (16, 16), gate_up=True), w)
    assert_same_bytes(reference.unshuffle_weight(to_cpu(out), gate_up=True), w)


def test_shuffle_weight_of_an_output_asked_for_huge_pages(device):
    # The CPU op asks for transparent huge pages for outputs of 16 MiB and more.
    w = random_bytes((4, 1024, 4128), torch.uint8, seed=11, device=device)
    out = moeext.shuffle_weight(w, gate_up=True)
    assert out.numel() >= 16 << 20
    assert_same_bytes(out, reference.shuffle_weight(to_cpu(w), gate_up=True))
    assert_same_bytes(moeext.unshuffle_weight(out, gate_up=True), w)


@pytest.mark.parametrize("layout", [(16, 16), (32, 16), (16, 32), (8, 64)])
def test_shuffle_weight_layouts(device, layout):
    w = random_bytes((2, 64, 128), torch.uint8, seed=5, device=device)
    out = moeext.shuffle_weight(w, layout)
    assert_same_bytes(out, reference.shuffle_weight(w.cpu(), layout))
    assert_same_bytes(moeext.unshuffle_weight(out, layout), w)


def test_shuffle_weight_non_contiguous(device):
    base = random_bytes((4, 80, 160), torch.uint8, seed=6, device=device)
    unflattenable = random_bytes((3, 2, 32, 64), torch.uint8, 7, device).permute(1, 0, 2, 3)
    for w in (base[1:3, :64, :128],        # strided rows and experts
              base[::2, 16:48, 32:96],     # every other expert
              base[0, :64, :64:2],  # strided last dim: copied first
              unflattenable):  # leading dims that no single stride describes
        assert not w.is_contiguous()
        assert_same_bytes(moeext.shuffle_weight(w), reference.shuffle_weight(w.cpu().contiguous()))
    shuffled = moeext.shuffle_weight(base[:, :64, :128].contiguous())
    view = torch.cat([shuffled, shuffled], dim=-1)[..., :128]  # a non-contiguous input
    assert_same_bytes(moeext.unshuffle_weight(view), base[:, :64, :128])


def test_shuffle_weight_ignores_the_strides_of_size_one_dims(device):
    # torch counts these views contiguous whatever their size-1 dims' strides say; read as
    # the batch stride, dim -3's stride of the first sent the second expert out of the storage.
    base = random_bytes((1, 2, 32, 64), torch.uint8, seed=8, device=device)
    for w in (base.transpose(0, 1),  # [2, 1, 32, 64] whose dim -3 strides 4096 bytes
              base.as_strided((2, 1, 1, 32, 64), (2048, 5, 0, 64, 1)),
              base.as_strided((1, 2, 32, 64), (7, 2048, 64, 1))):
        assert w.is_contiguous()
        out = moeext.shuffle_weight(w)
        assert_same_bytes(out, reference.shuffle_weight(to_cpu(w).clone()))
        assert_same_bytes(moeext.unshuffle_weight(out), w)
    # An empty view with a strided last dim reads nothing, as unshuffle_weight already took.
    empty = torch.empty(0, 32, dtype=torch.uint8, device=device).t()
    assert moeext.shuffle_weight(empty).shape == (32, 0)
    assert moeext.unshuffle_weight(empty).shape == (32, 0)


@pytest.mark.parametrize("dtype", SCALE_DTYPES, ids=str)
# Tiles per block (n / 8): 0-2 take the 16-byte path only, 5 and 7 the 32-byte path and a rest.
@pytest.mark.parametrize("shape", [(1, 1), (37, 11), (256, 8), (257, 9), (512, 224), (0, 5),
                                   (96, 40), (320, 56)])
def test_e8m0_shuffle(device_isa, dtype, shape):
    device, _ = device_isa
    s = random_bytes(shape, dtype, seed=shape[0], device=device)
    out = moeext.e8m0_shuffle(s)
    pm, pn = (shape[0] + 255) // 256 * 256, (shape[1] + 7) // 8 * 8
    assert out.shape == (pm, pn) and out.dtype == dtype and out.device == s.device
    assert_same_bytes(out, reference.e8m0_shuffle(to_cpu(s)))
    assert_same_bytes(moeext.e8m0_unshuffle(out, *shape), s)
    assert_same_bytes(reference.e8m0_unshuffle(to_cpu(out), *shape), s)
    # Padding is 0x7F (1.0), never NaN.
    padded = moeext.e8m0_unshuffle(out, pm, pn).view(torch.uint8)
    assert padded.device == s.device
    assert bool((padded[shape[0]:] == 0x7F).all()) and bool((padded[:, shape[1]:] == 0x7F).all())


@pytest.mark.parametrize("n", [20, 224])
def test_e8m0_shuffle_gate_up_and_strides(device_isa, n):
    device, _ = device_isa
    s = random_bytes((4 * 64, n), torch.uint8, seed=8, device=device)  # 4 experts x 2N=64 rows
    out = moeext.e8m0_shuffle(s, gate_up=True, num_experts=4)
    assert out.device == s.device
    assert_same_bytes(out, reference.e8m0_shuffle(s.cpu(), gate_up=True, num_experts=4))
    assert_same_bytes(moeext.e8m0_unshuffle(out, 256, n, gate_up=True, num_experts=4), s)
    wide = random_bytes((300, 2 * n), torch.float8_e8m0fnu, seed=9, device=device)
    for view in (wide[::2, 3:30:3],  # strided rows and columns
                 wide[:, 5:5 + n]):  # strided rows, contiguous columns
        expected = reference.e8m0_shuffle(to_cpu(view).contiguous())
        assert_same_bytes(moeext.e8m0_shuffle(view), expected)


# Outputs of 8 MiB and more leave the AVX2 path by non-temporal stores (cpu/mxfp4_shuffle.cpp),
# and the CPU ops ask for huge pages for outputs of 16 MiB and more: 17-18 MiB here, whole
# tiles in fours and a rest of two, then a padded tile of 6 columns.
@pytest.mark.parametrize("gate_up", [False, True])
def test_e8m0_shuffle_of_an_output_past_the_streaming_size(device_isa, gate_up):
    device, _ = device_isa
    m, n = (72 * 1024, 246) if gate_up else (70000, 246)
    kwargs = {"gate_up": True, "num_experts": 72} if gate_up else {}
    s = random_bytes((m, n), torch.uint8, seed=10, device=device)
    out = moeext.e8m0_shuffle(s, **kwargs)
    assert out.numel() >= 16 << 20
    assert_same_bytes(out, reference.e8m0_shuffle(s.cpu(), **kwargs))
    assert_same_bytes(moeext.e8m0_unshuffle(out, m, n, **kwargs), s)


# Each case takes the device the test runs on (d) and makes its argument there.
INVALID_CASES = [
    (lambda d: moeext.shuffle_weight(torch.zeros(32, dtype=torch.uint8, device=d)),
     "w must be at least 2-D"),
    (lambda d: moeext.shuffle_weight(torch.zeros(16, 32, device=d)),
     "w must have a 1- or 2-byte dtype"),
    (lambda d: moeext.shuffle_weight(torch.zeros(17, 32, dtype=torch.uint8, device=d)),
     "N (17) must be a multiple of layout[0] (16)"),
    (lambda d: moeext.shuffle_weight(torch.zeros(16, 48, dtype=torch.uint8, device=d)),
     "K (48) must be a multiple of 2 * layout[1] (2 x 16)"),
    # 2 * layout[1] would wrap to -16, a divisor of K, if it were ever formed.
    (lambda d: moeext.shuffle_weight(torch.zeros(16, 32, dtype=torch.uint8, device=d),
                                     (16, 2**63 - 8)),
     f"K (32) must be a multiple of 2 * layout[1] (2 x {2**63 - 8})"),
    (lambda d: moeext.unshuffle_weight(torch.zeros(16, 32, dtype=torch.bfloat16, device=d),
                                       (16, 2**63 - 16)),
     f"K (32) must be a multiple of 2 * layout[1] (2 x {2**63 - 16})"),
    (lambda d: moeext.shuffle_weight(torch.zeros(16, 32, dtype=torch.uint8, device=d), (0, 16)),
     "layout[0] (rows per band) must be in [1, 256], got 0"),
    (lambda d: moeext.shuffle_weight(torch.zeros(512, 32, dtype=torch.uint8, device=d),
                                     (512, 16)),
     "layout[0] (rows per band) must be in [1, 256], got 512"),
    # The wrapper passes any sequence on; the op takes exactly two numbers.
    (lambda d: moeext.shuffle_weight(torch.zeros(16, 32, dtype=torch.uint8, device=d),
                                     (16, 16, 16)),
     "shuffle_weight: layout must be (IN, IK), got [16, 16, 16]"),
    (lambda d: moeext.shuffle_weight(torch.zeros(16, 32, dtype=torch.uint8, device=d), (16, 0)),
     "layout[1] (0) must make 2 * layout[1] a multiple of 16 elements"),
    (lambda d: moeext.shuffle_weight(torch.zeros(16, 32, dtype=torch.uint8, device=d), (16, 4)),
     "2 * layout[1] a multiple of 16 elements"),
    (lambda d: moeext.shuffle_weight(torch.zeros(32, 32, dtype=torch.uint8, device=d),
                                     gate_up=True),
     "gate_up=True needs a 3-D fused weight"),
    (lambda d: moeext.shuffle_weight(torch.zeros(2, 48, 32, dtype=torch.uint8, device=d),
                                     gate_up=True),
     "gate_up=True needs 2N (48) to be a multiple of 32"),
    (lambda d: moeext.e8m0_shuffle(torch.zeros(4, 4, device=d)),
     "scale must be uint8 or float8_e8m0fnu"),
    (lambda d: moeext.e8m0_shuffle(torch.zeros(4, dtype=torch.uint8, device=d)),
     "scale must be 2-D"),
    (lambda d: moeext.e8m0_shuffle(torch.zeros(64, 4, dtype=torch.uint8, device=d),
                                   gate_up=True),
     "gate_up=True needs num_experts"),
    (lambda d: moeext.e8m0_shuffle(torch.zeros(64, 4, dtype=torch.uint8, device=d),
                                   gate_up=True, num_experts=0),
     "gate_up=True needs num_experts (>= 1), got 0"),
    (lambda d: moeext.e8m0_shuffle(torch.zeros(96, 4, dtype=torch.uint8, device=d), gate_up=True,
                                   num_experts=2), "groups of 2N rows with 2N a multiple of 32"),
    (lambda d: moeext.e8m0_shuffle(torch.zeros(64, 4, dtype=torch.uint8, device=d),
                                   gate_up=True, num_experts=3),
     "needs the scale rows (64) to split into num_experts (3) groups"),
    (lambda d: moeext.e8m0_unshuffle(torch.zeros(256, 8, dtype=torch.uint8, device=d), 300, 8),
     "shuffled must have the padded shape [512, 8]"),
    # Padding an m near 2^63 must not overflow into a shape that matches.
    (lambda d: moeext.e8m0_unshuffle(torch.zeros(256, 8, dtype=torch.uint8, device=d),
                                     2**63 - 1, 8), "shuffled must have the padded shape"),
    (lambda d: moeext.e8m0_unshuffle(torch.zeros(256, 8, dtype=torch.uint8, device=d), -1, 0),
     "m and n must be >= 0, got m=-1, n=0"),
    (lambda d: moeext.e8m0_unshuffle(torch.zeros(256, 8, dtype=torch.uint8, device=d), 4, -1),
     "m and n must be >= 0, got m=4, n=-1"),
    (lambda d: moeext.e8m0_unshuffle(torch.zeros(256, dtype=torch.uint8, device=d), 4, 4),
     "shuffled must have the padded shape [256, 8] of a [4, 4] scale, got [256]"),
    (lambda d: moeext.e8m0_unshuffle(torch.zeros(2, 256, 8, dtype=torch.uint8, device=d), 4, 4),
     "shuffled must have the padded shape [256, 8] of a [4, 4] scale, got [2, 256, 8]"),
    (lambda d: moeext.e8m0_unshuffle(torch.zeros(256, 8, dtype=torch.uint8, device=d), 64, 8,
                                     gate_up=True, num_experts=0),
     "gate_up=True needs num_experts (>= 1), got 0"),
    (lambda d: moeext.e8m0_unshuffle(torch.zeros(256, 8, dtype=torch.uint8, device=d), 64, 8,
                                     gate_up=True), "gate_up=True needs num_experts"),
    (lambda d: moeext.e8m0_unshuffle(torch.zeros(256, 8, dtype=torch.uint8, device=d), 96, 8,
                                     gate_up=True, num_experts=2),
     "groups of 2N rows with 2N a multiple of 32"),
    # torch.ops would pass None on as an undefined tensor and name nothing.
    (lambda d: moeext.shuffle_weight(None), "shuffle_weight: w must be a tensor, got None"),
    (lambda d: moeext.unshuffle_weight(None), "unshuffle_weight: w must be a tensor, got None"),
    (lambda d: moeext.e8m0_shuffle(None), "e8m0_shuffle: scale must be a tensor, got None"),
    (lambda d: moeext.e8m0_unshuffle(None, 2, 2),
     "e8m0_unshuffle: shuffled must be a tensor, got None"),
]


@pytest.mark.parametrize("call,message", INVALID_CASES)
def test_invalid_arguments(device, call, message):
    with pytest.raises(RuntimeError, match=re.escape(message)):
        call(device)


# The fakes trace these ops: what the kernels refuse must fail at trace time too, in the same
# words, or a compiled graph fails only when it runs.
@pytest.mark.parametrize("call,message", INVALID_CASES)
def test_fake_rejects_what_the_kernel_rejects(call, message):
    prefix = message.split(", got")[0]  # dtype names: Python and C++ spell them differently
    with pytest.raises(RuntimeError, match=re.escape(prefix)):
        call("meta")


@pytest.mark.parametrize("layout", [16, None])
def test_layout_must_be_a_pair(layout):
    w = torch.zeros(16, 32, dtype=torch.uint8)
    for op in (moeext.shuffle_weight, moeext.unshuffle_weight):
        with pytest.raises(TypeError, match=rf"{op.__name__}: layout must be a pair of ints"):
            op(w, layout)


@pytest.mark.parametrize("gate_up", [False, True])
def test_quantized_weights_survive_the_round_trip(device, gate_up):
    """dequantize(unshuffle(shuffle(q))) == dequantize(q), for weights and scales."""
    from moeext import mxfp4

    g = torch.Generator().manual_seed(12)
    experts, rows, k = 3, 64, 256
    w = torch.randn(experts, rows, k, generator=g) * torch.logspace(-3, 3, k)
    packed, scales = mxfp4.quantize(w)  # [E, rows, k/2], [E, rows, k/32], on the CPU
    fp4 = mxfp4.as_fp4x2(packed.to(device))
    shuffled = moeext.shuffle_weight(fp4, gate_up=gate_up)
    assert shuffled.dtype == torch.float4_e2m1fn_x2
    assert not torch.equal(as_bytes(shuffled), as_bytes(fp4))
    restored = moeext.unshuffle_weight(shuffled, gate_up=gate_up)

    flat_scales = mxfp4.as_e8m0(scales.reshape(experts * rows, k // 32).to(device))
    shuffled_scales = moeext.e8m0_shuffle(flat_scales, gate_up=gate_up,
                                          num_experts=experts if gate_up else None)
    restored_scales = moeext.e8m0_unshuffle(shuffled_scales, experts * rows, k // 32,
                                            gate_up=gate_up,
                                            num_experts=experts if gate_up else None)
    assert restored.device == fp4.device and restored_scales.device == fp4.device
    restored_scales = to_cpu(restored_scales).reshape(experts, rows, k // 32)
    torch.testing.assert_close(mxfp4.dequantize(to_cpu(restored), restored_scales),
                               mxfp4.dequantize(packed, scales), rtol=0, atol=0)


@pytest.mark.parametrize("gate_up", [False, True])
@pytest.mark.parametrize("inverse", [False, True], ids=["shuffle", "unshuffle"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_weight_shuffles_pass_the_gradient_back_through_the_same_move(device, dtype, inverse,
                                                                      gate_up):
    # The element each output position reads, from a shuffle of indices stored in the same
    # 2-byte dtype's bits; the gradient must land exactly there.
    op = moeext.unshuffle_weight if inverse else moeext.shuffle_weight
    shape = (2, 64, 96)
    index = torch.arange(math.prod(shape), dtype=torch.int16, device=device).view(shape)
    source = op(index.view(dtype), (16, 16), gate_up).view(torch.int16).long().flatten()
    w = torch.randn(shape, device=device).to(dtype).requires_grad_()
    out = op(w, (16, 16), gate_up)
    assert torch.equal(out.detach().flatten(), w.detach().flatten()[source])
    grad_out = torch.randn(shape, device=device).to(dtype)
    (out * grad_out).sum().backward()
    expected = torch.zeros(math.prod(shape), dtype=dtype, device=device)
    expected[source] = grad_out.flatten()
    assert torch.equal(w.grad.flatten(), expected)
    with torch.no_grad():
        assert not op(w, (16, 16), gate_up).requires_grad


def test_scale_codes_carry_no_gradient(device, recwarn):
    # E8M0 codes are exponents: like integers, their shuffles are not differentiable, and
    # (unlike autograd's fallback, which warned at the backward) say so by not requiring grad.
    scale = torch.randint(0, 255, (64, 8), dtype=torch.uint8, device=device)
    codes = scale.view(torch.float8_e8m0fnu).clone().requires_grad_()
    shuffled = moeext.e8m0_shuffle(codes)
    assert not shuffled.requires_grad and shuffled.grad_fn is None
    back = moeext.e8m0_unshuffle(shuffled.clone().requires_grad_(), 64, 8)
    assert not back.requires_grad and torch.equal(back.view(torch.uint8), scale)
    assert not [w for w in recwarn if "autograd" in str(w.message)]
