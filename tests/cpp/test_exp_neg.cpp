// Host unit test of vexp_neg in csrc/cpu/vec_math.h: the sigmoid's exp(-x), which folds the
// negation into the range reduction, must be vexp(0 - x) bit for bit, so that the sigmoid
// scores (and every routing choice made from them) are those of the plain formulation. Run on
// the portable vector layer, whose operations the AVX2 and AVX-512 layers repeat lane by lane:
// every bf16 value, every 257th fp32 bit pattern, and the special values.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <limits>

#define MOEEXT_CPU_ISA scalar
#include "cpu/vec_scalar.h"
#include "cpu/vec_math.h"
#include "check.h"

using moeext::cpu::scalar::Vec;
using moeext::cpu::scalar::vexp;
using moeext::cpu::scalar::vexp_neg;

namespace {

float from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

uint32_t to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

void check(float x) {
  const float got = vexp_neg(Vec::set1(x)).v;
  const float want = vexp(Vec::set1(0.0f) - Vec::set1(x)).v;
  if (std::isnan(want)) {
    CHECK(std::isnan(got), "x = %.9g (%08x): got %.9g, expected NaN", double(x), to_bits(x),
          double(got));
    return;
  }
  CHECK(to_bits(got) == to_bits(want), "x = %.9g (%08x): got %.9g (%08x), expected %.9g (%08x)",
        double(x), to_bits(x), double(got), to_bits(got), double(want), to_bits(want));
}

}  // namespace

int main() {
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {0.0f, -0.0f, inf, -inf, std::numeric_limits<float>::quiet_NaN(),
                  std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::denorm_min(), 88.0f, 89.0f, 104.0f, 105.0f,
                  -88.0f, -89.0f, -104.0f, -105.0f}) {
    check(x);
  }
  for (uint32_t hi = 0; hi < 0x10000u; ++hi) check(from_bits(hi << 16));
  for (uint64_t bits = 0; bits <= 0xffffffffu; bits += 257) check(from_bits(uint32_t(bits)));
  return moeext_test::finish("test_exp_neg");
}
