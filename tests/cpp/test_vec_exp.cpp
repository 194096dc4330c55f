// Host unit test of the exp in csrc/cpu/vec_math.h, run on the portable vector layer, whose
// operations the AVX2 and AVX-512 layers repeat lane by lane, on every bf16 value, every
// 257th fp32 bit pattern and the special values:
// - vexp is within 1 ulp of exp rounded to float wherever that is a normal float, overflows
//   to inf, underflows to 0 below -104, and passes NaN through;
// - vexp_neg, the sigmoid's exp(-x) with the negation folded into the range reduction, is
//   vexp(0 - x) bit for bit, so the sigmoid scores are those of the plain formulation;
// - vexp_nonpositive, softmax's exp without the upper clamp, is vexp bit for bit wherever
//   x <= 0 or x is NaN;
// - vexp is vexp_clamped of the clamped x bit for bit: where |x| <= 87 the layers without a
//   scalef instruction form 2^n as one power of two, and must give scalef's bits. (The
//   other two follow, being vexp's bits.)
// And the log1p of sqrt-softplus, vlog1p_unit on t in [0, 1]: within 2 ulps of log1p rounded
// to float on every 257th bit pattern, and t itself for every subnormal t and every t below
// 2^-24 (where log1p(t) rounds to t), the exp of a logit below -87.3 included.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <limits>

#define MOEEXT_CPU_ISA portable
#include "cpu/types.h"
#include "cpu/vec_portable.h"
#include "cpu/vec_math.h"
#include "check.h"

using moeext::cpu::bits_to_float;
using moeext::cpu::float_to_bits;
using moeext::cpu::portable::Vec;
using moeext::cpu::portable::vexp;
using moeext::cpu::portable::vexp_clamped;
using moeext::cpu::portable::vexp_neg;
using moeext::cpu::portable::vexp_nonpositive;
using moeext::cpu::portable::vlog1p_unit;

namespace {

// Lane 0 of a vector: the checks broadcast one value to all lanes.
float lane0(Vec x) {
  float lanes[Vec::kWidth];
  x.store(lanes);
  return lanes[0];
}

void check_exp(float x) {
  const float got = lane0(vexp(Vec::set1(x)));
  if (std::isnan(x)) {
    CHECK(std::isnan(got), "vexp(NaN) = %.9g", double(got));
    return;
  }
  const double exact = std::exp(double(x));
  const float rounded = float(exact);
  if (rounded == std::numeric_limits<float>::infinity()) {
    CHECK(got == rounded, "vexp(%.9g) = %.9g, expected inf", double(x), double(got));
  } else if (x < -104.0f) {
    CHECK(got == 0.0f, "vexp(%.9g) = %.9g, expected 0", double(x), double(got));
  } else if (rounded >= std::numeric_limits<float>::min()) {
    // Both positive, so their bit patterns count ulps.
    const int64_t ulps = int64_t(float_to_bits(got)) - int64_t(float_to_bits(rounded));
    CHECK(ulps >= -1 && ulps <= 1, "vexp(%.9g) = %.9g, exp rounds to %.9g (%lld ulps)",
          double(x), double(got), double(rounded), static_cast<long long>(ulps));
  }
}

void check_exp_scaling(float x) {
  const Vec clamped = Vec::min(Vec::set1(89.0f), Vec::max(Vec::set1(-104.0f), Vec::set1(x)));
  const float got = lane0(vexp(Vec::set1(x)));
  const float want = lane0(vexp_clamped(clamped));
  CHECK(float_to_bits(got) == float_to_bits(want),
        "vexp(%.9g) (%08x) = %.9g (%08x), through scalef %.9g (%08x)", double(x),
        float_to_bits(x), double(got), float_to_bits(got), double(want), float_to_bits(want));
}

void check_exp_neg(float x) {
  const float got = lane0(vexp_neg(Vec::set1(x)));
  const float want = lane0(vexp(Vec::set1(0.0f) - Vec::set1(x)));
  if (std::isnan(want)) {
    CHECK(std::isnan(got), "vexp_neg(%.9g) = %.9g, expected NaN", double(x), double(got));
    return;
  }
  CHECK(float_to_bits(got) == float_to_bits(want),
        "vexp_neg(%.9g) (%08x) = %.9g (%08x), expected %.9g (%08x)", double(x),
        float_to_bits(x), double(got), float_to_bits(got), double(want), float_to_bits(want));
}

void check_exp_nonpositive(float x) {
  if (!(x <= 0.0f) && !std::isnan(x)) return;
  const float got = lane0(vexp_nonpositive(Vec::set1(x)));
  const float want = lane0(vexp(Vec::set1(x)));
  if (std::isnan(want)) {
    CHECK(std::isnan(got), "vexp_nonpositive(%.9g) = %.9g, expected NaN", double(x),
          double(got));
    return;
  }
  CHECK(float_to_bits(got) == float_to_bits(want),
        "vexp_nonpositive(%.9g) (%08x) = %.9g (%08x), expected %.9g (%08x)", double(x),
        float_to_bits(x), double(got), float_to_bits(got), double(want), float_to_bits(want));
}

void check_log1p(float t) {
  const float got = lane0(vlog1p_unit(Vec::set1(t)));
  const float rounded = float(std::log1p(double(t)));
  if (t < 0x1p-24f) {
    CHECK(float_to_bits(got) == float_to_bits(t), "vlog1p_unit(%.9g) (%08x) = %.9g (%08x)",
          double(t), float_to_bits(t), double(got), float_to_bits(got));
    return;
  }
  const int64_t ulps = int64_t(float_to_bits(got)) - int64_t(float_to_bits(rounded));
  CHECK(ulps >= -2 && ulps <= 2, "vlog1p_unit(%.9g) = %.9g, log1p rounds to %.9g (%lld ulps)",
        double(t), double(got), double(rounded), static_cast<long long>(ulps));
}

void check(float x) {
  check_exp(x);
  check_exp_scaling(x);
  check_exp_neg(x);
  check_exp_nonpositive(x);
}

}  // namespace

int main() {
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {0.0f, -0.0f, inf, -inf, std::numeric_limits<float>::quiet_NaN(),
                  std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::denorm_min(), 88.0f, 88.7f, 88.8f, 89.0f, 104.0f,
                  105.0f, 87.0f, 87.00001f, -87.0f, -87.00001f, -88.0f, -89.0f, -104.0f,
                  -105.0f}) {
    check(x);
  }
  for (uint32_t hi = 0; hi < 0x10000u; ++hi) check(bits_to_float(hi << 16));
  for (uint64_t bits = 0; bits <= 0xffffffffu; bits += 257) check(bits_to_float(uint32_t(bits)));
  const uint32_t one = float_to_bits(1.0f);
  for (uint32_t bits = 0; bits < float_to_bits(0x1p-120f); ++bits) check_log1p(bits_to_float(bits));
  for (uint32_t bits = 0; bits <= one; bits += 257) check_log1p(bits_to_float(bits));
  check_log1p(1.0f);
  return moeext_test::finish("test_vec_exp");
}
