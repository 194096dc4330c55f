"""moeext.mxfp4: OCP MXFP4 quantize / dequantize (SPEC.md section 3)."""

import math
import struct

import pytest
import torch

from moeext import mxfp4

E2M1 = mxfp4.E2M1_VALUES


def _f32(bits):
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _block(values, fill=0.0):
    """One 32-element fp32 block: ``values`` first, then ``fill``."""
    return torch.tensor(list(values) + [fill] * (32 - len(values)), dtype=torch.float32)


def _codes(packed):
    """Unpacks bytes into E2M1 codes, element 2i from the low nibble of byte i."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def _reference_block(block):
    """Independent oracle: OCP conversion of one block, element by element, in float64.

    Scale from frexp (exact), nearest E2M1 magnitude by exhaustive search with ties to the
    even code; the policies of the module docstring for non-finite and zero blocks.
    """
    if any(not math.isfinite(v) for v in block):
        return [0] * 32, 0xFF
    amax = max(abs(v) for v in block)
    if amax == 0.0:
        shared_exp = -127
    else:
        shared_exp = max(-127, min(127, math.frexp(amax)[1] - 1 - 2))
    codes = []
    for v in block:
        scaled = abs(v) / 2.0 ** shared_exp
        best = min(range(8), key=lambda c: (abs(scaled - E2M1[c]), c % 2))
        codes.append(best | (8 if math.copysign(1.0, v) < 0 else 0))
    return codes, shared_exp + 127


# ---------------------------------------------------------------- hand-made blocks


def test_all_zero_block_gets_scale_code_0():
    packed, scales = mxfp4.quantize(torch.zeros(2, 64))
    assert packed.dtype == torch.uint8 and scales.dtype == torch.uint8
    assert packed.shape == (2, 32) and scales.shape == (2, 2)
    assert int(packed.count_nonzero()) == 0
    assert int(scales.count_nonzero()) == 0
    out = mxfp4.dequantize(packed, scales)
    assert out.dtype == torch.float32 and torch.equal(out, torch.zeros(2, 64))
    assert not out.signbit().any()


def test_negative_zero_keeps_its_sign():
    x = _block([-0.0] * 32)
    packed, scales = mxfp4.quantize(x)
    assert packed.tolist() == [0x88] * 16 and scales.tolist() == [0]
    out = mxfp4.dequantize(packed, scales)
    assert torch.equal(out, x) and out.signbit().all()
    # Negative values too small for the block's scale round to -0, not +0.
    packed, scales = mxfp4.quantize(_block([6.0, -0.2, 0.2, -0.25]))
    assert _codes(packed)[:4].tolist() == [7, 8, 0, 8]
    assert mxfp4.dequantize(packed, scales)[1].signbit()


def test_plus_minus_six_is_scale_one():
    x = _block([6.0, -6.0, 3.0, -0.5, 1.5, 0.0, -4.0, 2.0])
    packed, scales = mxfp4.quantize(x)
    assert scales.tolist() == [127]  # floor(log2 6) - 2 = 0
    assert _codes(packed)[:8].tolist() == [7, 15, 5, 9, 3, 0, 14, 4]
    assert torch.equal(mxfp4.dequantize(packed, scales), x)


def test_plus_minus_half():
    x = _block([0.5, -0.5] * 16)
    packed, scales = mxfp4.quantize(x)
    assert scales.tolist() == [124]  # floor(log2 0.5) - 2 = -3: 0.5 becomes 4
    assert _codes(packed).tolist() == [6, 14] * 16
    assert torch.equal(mxfp4.dequantize(packed, scales), x)


@pytest.mark.parametrize("exponent", [-120, -10, -1, 0, 1, 7, 100, 127])
def test_power_of_two_max(exponent):
    amax = 2.0 ** exponent
    x = _block([amax, -amax / 2, amax / 8, 3 * amax / 4, 3 * amax / 8])
    packed, scales = mxfp4.quantize(x)
    assert scales.tolist() == [exponent - 2 + 127]
    assert _codes(packed)[:5].tolist() == [6, 12, 1, 5, 3]  # 4, -2, 0.5, 3, 1.5
    assert torch.equal(mxfp4.dequantize(packed, scales), x)


# Midpoint -> code it must round to (ties to the even code), with the block scaled to 1.
TIES = [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)]


def test_ties_round_to_even():
    mids = [m for m, _ in TIES]
    x = _block([4.0] + mids + [-m for m in mids])
    packed, scales = mxfp4.quantize(x)
    assert scales.tolist() == [127]
    expected = [6] + [c for _, c in TIES] + [c | 8 for _, c in TIES]
    assert _codes(packed)[:15].tolist() == expected


def test_just_off_each_midpoint_rounds_to_nearest():
    below = [torch.nextafter(torch.tensor(m), torch.tensor(0.0)).item() for m, _ in TIES]
    above = [torch.nextafter(torch.tensor(m), torch.tensor(8.0)).item() for m, _ in TIES]
    packed, scales = mxfp4.quantize(_block([4.0] + below + above))
    assert scales.tolist() == [127]
    assert _codes(packed)[1:8].tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert _codes(packed)[8:15].tolist() == [1, 2, 3, 4, 5, 6, 7]


def test_ties_hold_at_other_scales():
    for exponent in (-100, -3, 9, 90):
        s = 2.0 ** exponent
        packed, scales = mxfp4.quantize(_block([4.0 * s] + [m * s for m, _ in TIES]))
        assert scales.tolist() == [exponent + 127]
        assert _codes(packed)[1:8].tolist() == [c for _, c in TIES]


def test_saturation_at_six():
    # amax in [4, 8) * 2^X: values above 5 (the 4/6 midpoint) become 6, up to just below 8.
    top = torch.nextafter(torch.tensor(8.0), torch.tensor(0.0)).item()
    x = _block([top, -7.0, 6.5, 5.5, -5.01, 6.0])
    packed, scales = mxfp4.quantize(x)
    assert scales.tolist() == [127]
    assert _codes(packed)[:6].tolist() == [7, 15, 7, 7, 15, 7]
    assert mxfp4.dequantize(packed, scales)[:6].tolist() == [6.0, -6.0, 6.0, 6.0, -6.0, 6.0]


def test_largest_fp32_values():
    fmax = torch.finfo(torch.float32).max
    x = _block([fmax, -fmax, 2.0 ** 127])
    packed, scales = mxfp4.quantize(x)
    assert scales.tolist() == [127 - 2 + 127]
    assert _codes(packed)[:3].tolist() == [7, 15, 6]
    assert mxfp4.dequantize(packed, scales)[:3].tolist() == [1.5 * 2.0 ** 127,
                                                            -1.5 * 2.0 ** 127, 2.0 ** 127]


def test_denormal_inputs():
    assert not torch.get_default_dtype() == torch.float64
    largest_denormal = _f32(0x007FFFFF)  # 2^-126 * (1 - 2^-23)
    x = _block([largest_denormal, 2.0 ** -128, -(2.0 ** -129), 3 * 2.0 ** -129, 2.0 ** -130,
                _f32(1), 2.0 ** -149 * 5])
    assert x[0].item() == largest_denormal and x[5].item() > 0  # not flushed
    packed, scales = mxfp4.quantize(x)
    # amax < 2^-126: the exponent clamps to -127 (code 0); elements are x * 2^127.
    assert scales.tolist() == [0]
    #                                    ~2.0  0.5  -0.25 tie  0.75 tie  0.125  tiny  tiny
    assert _codes(packed)[:7].tolist() == [4, 1, 8, 2, 0, 0, 0]
    out = mxfp4.dequantize(packed, scales)
    assert out[:4].tolist() == [2.0 ** -126, 2.0 ** -128, -0.0, 2.0 ** -127]
    assert out[:4].abs().min() == 0 and out[1].item() == 2.0 ** -128  # denormal output exact


def test_smallest_scales_from_normal_inputs():
    # min normal 2^-126 has the clamped scale too; 2^-124 is the first block that does not.
    for amax, code in [(2.0 ** -126, 0), (2.0 ** -125, 0), (2.0 ** -124, 1), (2.0 ** -123, 2)]:
        packed, scales = mxfp4.quantize(_block([amax]))
        assert scales.tolist() == [code], amax
        assert mxfp4.dequantize(packed, scales)[0].item() == amax


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_non_finite_block_is_nan(bad, dtype):
    x = torch.ones(3, 64, dtype=dtype)
    x[1, 40] = bad
    packed, scales = mxfp4.quantize(x)
    assert scales.tolist() == [[127 - 2, 127 - 2], [127 - 2, 0xFF], [127 - 2, 127 - 2]]
    assert int(packed[1, 16:].count_nonzero()) == 0  # codes of the NaN block: all 0
    out = mxfp4.dequantize(packed, scales)
    assert out[1, 32:].isnan().all()
    assert torch.equal(out[:, :32], torch.ones(3, 32)) and torch.equal(out[0], torch.ones(64))


# ---------------------------------------------------------------- against the oracle


def _mixed_magnitudes(blocks, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(blocks, 32, generator=g)
    x *= torch.exp2(torch.randint(-140, 120, (blocks, 1), generator=g).float())
    x[::7, ::5] = 0.0
    x[::11, 3] = -0.0
    x[5] = 0.0
    # Exact E2M1 midpoints at random scales: the ties the rounding must get right.
    mids = torch.tensor([m for m, _ in TIES] * 4 + [4.0, 6.0, 7.5, 0.1])
    scale = torch.exp2(torch.randint(-120, 120, (blocks // 4, 1), generator=g).float())
    x[: blocks // 4] = mids[torch.randperm(32, generator=g)] * scale
    x[2::9, 7] *= -1
    return x


def test_matches_oracle_element_by_element():
    x = _mixed_magnitudes(256, seed=0)
    packed, scales = mxfp4.quantize(x)
    codes = _codes(packed)
    for b in range(x.size(0)):
        expected_codes, expected_scale = _reference_block(x[b].tolist())
        assert scales[b].item() == expected_scale, b
        assert codes[b].tolist() == expected_codes, b


def test_round_trip_error_bound(device):
    """|dequantize(quantize(x)) - x| <= half the E2M1 step at x's magnitude, times the scale.

    With block scale s = 2^X and v = |x| / s, E2M1 values are spaced 0.5 on [0, 2), 1 on
    [2, 4) and 2 on [4, 6], so rounding to the nearest one errs by at most s * (0.25, 0.5, 1)
    on those ranges. X = floor(log2 amax) - 2 puts v below 8; v in (6, 8) saturates to 6, an
    error of exactly (v - 6) * s, which the test checks separately.
    """
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4096, generator=g) * torch.exp2(
        torch.randint(-60, 60, (64, 1), generator=g).float())
    x = x.to(device)
    packed, scales = mxfp4.quantize(x)
    out = mxfp4.dequantize(packed, scales)
    s = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)
    v = x.abs() / s
    saturated = v > 6
    half_step = torch.where(v < 2, 0.25, torch.where(v < 4, 0.5, 1.0))
    err = (out - x).abs()
    assert (err[~saturated] <= (half_step * s)[~saturated]).all()
    assert torch.equal(out[saturated], 6 * s[saturated] * x[saturated].sign())
    assert saturated.any() and (v <= 8).all()
    # The bound is tight: some elements land almost exactly halfway.
    assert (err[~saturated] / (half_step * s)[~saturated]).max() > 0.99


def test_dequantize_then_quantize_is_identity(device):
    # Any bytes and scales, as long as each block holds a code of magnitude 4 or 6 (otherwise
    # a smaller scale represents the block), come back unchanged.
    g = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (40, 64), dtype=torch.uint8, generator=g)
    packed[:, ::16] = (packed[:, ::16] & 0xF0) | torch.tensor([6, 7, 14, 15])[
        torch.randint(0, 4, (40, 4), generator=g)].to(torch.uint8)
    scales = torch.randint(0, 253, (40, 4), dtype=torch.uint8, generator=g)
    scales[0] = torch.tensor([0, 1, 252, 127])
    packed, scales = packed.to(device), scales.to(device)
    again = mxfp4.quantize(mxfp4.dequantize(packed, scales))
    assert torch.equal(again[0], packed) and torch.equal(again[1], scales)


def test_dequantize_every_byte_and_scale():
    packed = torch.arange(256, dtype=torch.uint8).view(16, 16)
    for scale in (0, 1, 100, 127, 200, 252):
        out = mxfp4.dequantize(packed, torch.full((16, 1), scale, dtype=torch.uint8))
        for byte in range(256):
            for nibble, value in ((byte & 0xF, out.flatten()[2 * byte]),
                                  (byte >> 4, out.flatten()[2 * byte + 1])):
                expected = math.copysign(E2M1[nibble & 7], -1.0 if nibble & 8 else 1.0)
                expected = math.ldexp(expected, scale - 127)
                assert value.item() == expected and \
                    math.copysign(1, value.item()) == math.copysign(1, expected)
    out = mxfp4.dequantize(packed, torch.full((16, 1), 0xFF, dtype=torch.uint8))
    assert out.isnan().all()
    # Scales 253 and 254 exist in E8M0 but overflow fp32 for the largest codes.
    out = mxfp4.dequantize(torch.tensor([0x72] * 16, dtype=torch.uint8),
                           torch.tensor([254], dtype=torch.uint8))
    assert out[0].item() == 2.0 ** 127 and out[1].item() == math.inf


# ---------------------------------------------------------------- layout, dtypes, views


def test_nibble_order_even_element_low():
    # torch.float4_e2m1fn_x2 stores val0 in bits 3..0 and val1 in bits 7..4 (c10 header).
    x = _block([1.0, -4.0, 0.5, 6.0, 0.0, -0.5])
    packed, scales = mxfp4.quantize(x)
    assert packed[:3].tolist() == [0xE2, 0x71, 0x90]
    hand_built = torch.tensor([0x71] + [0] * 15, dtype=torch.uint8)  # 0.5 then 6
    out = mxfp4.dequantize(mxfp4.as_fp4x2(hand_built),
                           mxfp4.as_e8m0(torch.tensor([127], dtype=torch.uint8)))
    assert out[:2].tolist() == [0.5, 6.0]


def test_views_as_torch_mx_dtypes():
    x = torch.randn(4, 96)
    packed, scales = mxfp4.quantize(x)
    fp4, e8m0 = mxfp4.as_fp4x2(packed), mxfp4.as_e8m0(scales)
    assert fp4.dtype == torch.float4_e2m1fn_x2 and fp4.shape == packed.shape
    assert e8m0.dtype == torch.float8_e8m0fnu and e8m0.data_ptr() == scales.data_ptr()
    # torch's own E8M0 decoding agrees with the scale codes.
    assert torch.equal(e8m0.float(), torch.exp2(scales.float() - 127))
    expected = mxfp4.dequantize(packed, scales)
    assert torch.equal(mxfp4.dequantize(fp4, e8m0), expected)
    assert torch.equal(mxfp4.dequantize(fp4, scales), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_match_fp32_of_same_values(dtype):
    x = (torch.randn(8, 128) * 30).to(dtype)
    got = mxfp4.quantize(x)
    expected = mxfp4.quantize(x.float())
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_shapes_and_strides():
    x = torch.randn(3, 5, 64)
    packed, scales = mxfp4.quantize(x)
    assert packed.shape == (3, 5, 32) and scales.shape == (3, 5, 2)
    for view in (x.transpose(0, 1), x[:, ::2]):
        p, s = mxfp4.quantize(view)
        ep, es = mxfp4.quantize(view.contiguous())
        assert torch.equal(p, ep) and torch.equal(s, es)
    wide = torch.randn(4, 128)
    p, s = mxfp4.quantize(wide[:, 32:96])  # rows not adjacent
    assert torch.equal(mxfp4.dequantize(p, s), mxfp4.dequantize(*mxfp4.quantize(
        wide[:, 32:96].contiguous())))
    # Strided bytes and scales dequantize like contiguous ones.
    pw, sw = mxfp4.quantize(wide)
    assert torch.equal(mxfp4.dequantize(pw[:, 16:48], sw[:, 1:3]),
                       mxfp4.dequantize(pw[:, 16:48].contiguous(), sw[:, 1:3].contiguous()))
    p, s = mxfp4.quantize(torch.randn(32))
    assert p.shape == (16,) and s.shape == (1,)
    p, s = mxfp4.quantize(torch.randn(4, 0))
    assert p.shape == (4, 0) and s.shape == (4, 0)
    assert mxfp4.dequantize(p, s).shape == (4, 0)


# ---------------------------------------------------------------- invalid arguments


@pytest.mark.parametrize("x, match", [
    (torch.zeros(4, 48), "last dimension of x \\(48\\)"),
    (torch.zeros(4, 33), "multiple of 32"),
    (torch.zeros(4, 64, dtype=torch.int32), "x must be float32, bfloat16 or float16"),
    (torch.zeros(4, 64, dtype=torch.float64), "x must be float32"),
    (torch.tensor(1.0), "x must have at least one dimension"),
    ([1.0] * 32, "x must be a torch.Tensor"),
])
def test_quantize_rejects(x, match):
    with pytest.raises(ValueError, match=match):
        mxfp4.quantize(x)


@pytest.mark.parametrize("packed, scales, match", [
    (torch.zeros(4, 16, dtype=torch.int8), torch.zeros(4, 1, dtype=torch.uint8), "packed must"),
    (torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 1), "scales must"),
    (torch.zeros(4, 16, dtype=torch.uint8).view(torch.float8_e4m3fn),
     torch.zeros(4, 1, dtype=torch.uint8), "packed must"),
    (torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8), "agree"),
    (torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(3, 1, dtype=torch.uint8), "agree"),
    (torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8), "agree"),
    (torch.zeros(4, 16, dtype=torch.uint8), torch.tensor(1, dtype=torch.uint8), "scales must"),
    (torch.zeros(4, 16, dtype=torch.uint8), None, "scales must be a torch.Tensor"),
    (torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8, device="meta"),
     "packed is on cpu but scales is on meta"),
])
def test_dequantize_rejects(packed, scales, match):
    with pytest.raises(ValueError, match=match):
        mxfp4.dequantize(packed, scales)
