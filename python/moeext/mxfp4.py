"""MXFP4 (OCP Microscaling v1.0) quantization and dequantization in pure PyTorch.

Format (docs/SPEC.md §3): the last dimension is cut into blocks of 32 consecutive elements
that share one E8M0 scale. E8M0 is an unsigned 8-bit exponent with bias 127 (code ``c`` means
``2 ** (c - 127)``); 0xFF is NaN and there is no zero. Elements are E2M1 codes: codes 0..7 are
0, 0.5, 1, 1.5, 2, 3, 4, 6 and bit 3 is the sign. Two codes per byte, the **even** element in
the **low** nibble (the layout of ``torch.float4_e2m1fn_x2``). A tensor ``[..., K]`` becomes
bytes ``[..., K/2]`` and scales ``[..., K/32]``.

Quantization follows the OCP v1.0 conversion: the shared exponent of a block is
``X = floor(log2(amax)) - 2`` (2 is E2M1's emax), clamped to E8M0's range [-127, 127]; each
element becomes ``x / 2**X`` rounded to the nearest E2M1 value, ties to the even code
(0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), saturating at 6.

Policies the OCP text leaves open, as :func:`quantize` applies them:

* **All-zero blocks** get scale code 0 (2^-127) and zero codes. That is what the clamp rule
  gives (floor(log2(0)) = -inf clamps to -127), and what OCP's reference library
  (microsoft/microxcaling) and torchao produce, so bytes compare equal with them; any scale
  dequantizes the block to exact zeros.
* **NaN or +-inf anywhere in a block** gives scale 0xFF (NaN) and all-zero codes (bytes 0x00):
  E2M1 has no NaN/inf, so the block dequantizes to NaN everywhere, as OCP prescribes for a NaN
  scale. The non-finite value is not silently turned into a large finite one.
* **Denormal fp32 inputs** are ordinary values: their exponent is below -126, so a block whose
  largest magnitude is denormal (or below 2^-125) gets the clamped scale 2^-127, and its
  elements are rounded against that scale (those under 2^-129 in magnitude become zero).
  The exponent is read from the bits, never via ``log2``, so nothing depends on the CPU's
  denormal mode or on rounding in ``log2`` just below a power of two.
* **Signs, negative zero included, are kept**: ``-0.0`` and negative values that round to
  zero get code 8 (E2M1 negative zero), as an IEEE round-to-nearest conversion does;
  :func:`dequantize` turns code 8 back into ``-0.0``.
"""

from typing import Tuple

import torch

__all__ = [
    "BLOCK_SIZE",
    "E2M1_VALUES",
    "as_e8m0",
    "as_fp4x2",
    "dequantize",
    "quantize",
]

BLOCK_SIZE = 32

# E2M1 magnitudes of codes 0..7; codes 8..15 are their negatives (bit 3 = sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Midpoints between consecutive E2M1 magnitudes and whether a value exactly on one rounds up:
# round-to-nearest-even sends each tie to the neighbour with an even code (mantissa bit 0).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
              (3.5, True), (5.0, False))

_E8M0_NAN = 0xFF
_FP32_EXP_NAN_INF = 0xFF

_QUANTIZE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PACKED_DTYPES = (torch.uint8, torch.float4_e2m1fn_x2)
_SCALE_DTYPES = (torch.uint8, torch.float8_e8m0fnu)


def quantize(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantizes ``x`` to MXFP4 along its last dimension (policies: module docstring).

    Args:
        x: ``[..., K]`` float32, bfloat16 or float16, at least 1-D, ``K % 32 == 0``; any
            strides, any device.

    Returns:
        ``(packed, scales)``: ``packed`` is uint8 ``[..., K/2]`` (element ``2i`` in the low
        nibble of byte ``i``, ``2i + 1`` in the high one), ``scales`` is uint8 ``[..., K/32]``
        of E8M0 codes; both contiguous, on ``x``'s device. :func:`as_fp4x2` and
        :func:`as_e8m0` view them as ``torch.float4_e2m1fn_x2`` / ``torch.float8_e8m0fnu``.

    Raises:
        ValueError: naming ``x``, if it is not a tensor of an accepted dtype, is 0-d, or its
            last dimension is not a multiple of 32.
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"mxfp4.quantize: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _QUANTIZE_DTYPES:
        raise ValueError(f"mxfp4.quantize: x must be float32, bfloat16 or float16, got "
                         f"{x.dtype}")
    if x.dim() == 0:
        raise ValueError("mxfp4.quantize: x must have at least one dimension, got a 0-d tensor")
    k = x.size(-1)
    if k % BLOCK_SIZE != 0:
        raise ValueError(f"mxfp4.quantize: the last dimension of x ({k}) must be a multiple of "
                         f"{BLOCK_SIZE}, got shape {tuple(x.shape)}")

    lead = tuple(x.shape[:-1])
    x32 = x.to(torch.float32).contiguous().view(*lead, k // BLOCK_SIZE, BLOCK_SIZE)
    bits = x32.view(torch.int32)

    # The largest biased fp32 exponent in a block is the exponent of its amax; 0xFF means the
    # block holds a NaN or an inf. Zeros and denormals have field 0, which the clamp below
    # maps to the smallest scale, exactly what floor(log2(amax)) - 2 clamped to -127 gives.
    exp_field = (bits >> 23) & 0xFF
    block_exp = exp_field.amax(dim=-1, keepdim=True)
    nonfinite = block_exp == _FP32_EXP_NAN_INF
    # E8M0 code = X + 127 = (field - 127 - 2) + 127; at most 252 for finite fp32 inputs.
    scale_code = (block_exp - 2).clamp(min=0)
    # 2**-X as fp32 bits: biased exponent 127 - X = 254 - scale_code, in [2, 254] (normal), so
    # the multiply below is exact whenever the product is representable.
    inv_scale = ((254 - scale_code.clamp(max=252)) << 23).view(torch.float32)
    scaled = (x32 * inv_scale).abs()

    codes = torch.zeros_like(bits, dtype=torch.uint8)
    for midpoint, tie_rounds_up in _MIDPOINTS:
        codes += (scaled >= midpoint) if tie_rounds_up else (scaled > midpoint)
    # Past 5 everything saturates to code 7 (6.0), which is where the midpoints stop.
    codes |= (bits < 0).to(torch.uint8) << 3
    codes.masked_fill_(nonfinite, 0)
    scale_code = torch.where(nonfinite, _E8M0_NAN, scale_code)

    pairs = codes.view(*lead, k // 2, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    scales = scale_code.view(*lead, k // BLOCK_SIZE).to(torch.uint8)
    return packed.contiguous(), scales


def dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Expands MXFP4 bytes and E8M0 scales back to float32.

    Args:
        packed: ``[..., K/2]`` uint8 or ``torch.float4_e2m1fn_x2`` (read as its bytes; even
            element in the low nibble), any strides.
        scales: ``[..., K/32]`` uint8 or ``torch.float8_e8m0fnu`` E8M0 codes with the same
            leading dimensions as ``packed``, on the same device.

    Returns:
        float32 ``[..., K]``: ``e2m1(code) * 2**(scale - 127)``, exact whenever it fits fp32
        (``-0.0`` for code 8; NaN for every element of a block with scale 0xFF; +-inf where
        the product exceeds fp32's range, which only scale codes above 252 can reach).

    Raises:
        ValueError: naming the argument, for a wrong dtype, mismatched shapes or devices.
    """
    for name, t, dtypes in (("packed", packed, _PACKED_DTYPES), ("scales", scales,
                                                                 _SCALE_DTYPES)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"mxfp4.dequantize: {name} must be a torch.Tensor, got "
                             f"{type(t).__name__}")
        if t.dtype not in dtypes:
            raise ValueError(f"mxfp4.dequantize: {name} must be one of "
                             f"{', '.join(map(str, dtypes))}, got {t.dtype}")
        if t.dim() == 0:
            raise ValueError(f"mxfp4.dequantize: {name} must have at least one dimension, got "
                             f"a 0-d tensor")
    if packed.shape[:-1] != scales.shape[:-1] or \
            packed.size(-1) != scales.size(-1) * (BLOCK_SIZE // 2):
        raise ValueError(f"mxfp4.dequantize: packed [..., K/2] and scales [..., K/32] must "
                         f"agree, got packed {tuple(packed.shape)} and scales "
                         f"{tuple(scales.shape)}")
    if packed.device != scales.device:
        raise ValueError(f"mxfp4.dequantize: packed is on {packed.device} but scales is on "
                         f"{scales.device}")

    device = packed.device
    lead = tuple(packed.shape[:-1])
    k = packed.size(-1) * 2
    packed_bytes = packed.view(torch.uint8)
    scale_codes = scales.view(torch.uint8)

    e2m1 = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32,
                        device=device)
    codes = torch.stack((packed_bytes & 0xF, packed_bytes >> 4), dim=-1)
    values = e2m1[codes.long()].view(*lead, k // BLOCK_SIZE, BLOCK_SIZE)

    # 2**(c - 127) exactly for every code (2**-127 is an fp32 denormal), NaN for 0xFF.
    e8m0 = torch.ldexp(torch.ones(256, dtype=torch.float64),
                       torch.arange(256, dtype=torch.float64) - 127).to(torch.float32)
    e8m0[_E8M0_NAN] = float("nan")
    block_scale = e8m0.to(device)[scale_codes.long()].unsqueeze(-1)
    return (values * block_scale).view(*lead, k)


def as_fp4x2(packed: torch.Tensor) -> torch.Tensor:
    """Views uint8 MXFP4 bytes as ``torch.float4_e2m1fn_x2`` (same storage, same shape)."""
    return packed.view(torch.float4_e2m1fn_x2)


def as_e8m0(scales: torch.Tensor) -> torch.Tensor:
    """Views uint8 E8M0 scale codes as ``torch.float8_e8m0fnu`` (same storage, same shape)."""
    return scales.view(torch.float8_e8m0fnu)
