// Host unit test of csrc/gpu/numeric.h, the bf16 rounding and widening the GPU kernels use
// (with the fp32 bit helpers of csrc/host_device/float_bits.h).
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <limits>
#include <random>

#include "gpu/numeric.h"

using moeext::host_device::bits_float;
using moeext::host_device::float_bits;

namespace {

int failures = 0;

// bf16 by exact arithmetic: the two neighbours of x, and whichever is nearer (the even one
// on a tie). Independent of the bit trick under test.
uint16_t reference_bf16(float x) {
  if (std::isnan(x)) return 0;  // checked separately
  const uint32_t u = float_bits(x);
  const uint32_t below = u & 0xffff0000u;
  const double lo = bits_float(below);
  const double hi_d = (below & 0x7fffffffu) == 0x7f7f0000u
                          ? std::ldexp(1.0, 128) * (std::signbit(x) ? -1 : 1)
                          : double(bits_float(below + 0x10000u));
  const double dx = x;
  const double d_lo = std::fabs(dx - lo), d_hi = std::fabs(hi_d - dx);
  uint32_t chosen;
  if (d_lo < d_hi) {
    chosen = below;
  } else if (d_hi < d_lo) {
    chosen = below + 0x10000u;
  } else {
    chosen = ((below >> 16) & 1u) ? below + 0x10000u : below;
  }
  return uint16_t(chosen >> 16);
}

void check(float x) {
  const uint16_t got = moeext::gpu::to_bf16(x).bits;
  if (std::isnan(x)) {
    if ((got & 0x7f80u) != 0x7f80u || (got & 0x7fu) == 0) {
      std::printf("to_bf16(NaN %08x) = %04x is not NaN\n", float_bits(x), got);
      ++failures;
    }
    return;
  }
  const uint16_t want = reference_bf16(x);
  if (got != want) {
    std::printf("to_bf16(%08x) = %04x, expected %04x\n", float_bits(x), got, want);
    ++failures;
  }
  const float back = moeext::gpu::to_float(moeext::gpu::bf16{got});
  if (float_bits(back) != uint32_t(got) << 16) {
    std::printf("to_float(bf16 %04x) = %08x\n", got, float_bits(back));
    ++failures;
  }
}

}  // namespace

int main() {
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {0.0f, -0.0f, 1.0f, -1.0f, inf, -inf, std::numeric_limits<float>::max(),
                  -std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min(),
                  std::numeric_limits<float>::quiet_NaN(), bits_float(0x7f800001u),
                  bits_float(0xffc00001u)}) {
    check(x);
  }
  // Every bf16 value, and the ties and near-ties around each.
  for (uint32_t hi = 0; hi < 0x10000u; ++hi) {
    for (uint32_t lo : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      check(bits_float((hi << 16) | lo));
    }
  }
  std::mt19937 rng(1234);
  for (int i = 0; i < 1000000; ++i) check(bits_float(rng()));
  if (failures != 0) {
    std::printf("%d failures\n", failures);
    return 1;
  }
  std::printf("numeric: ok\n");
  return 0;
}
