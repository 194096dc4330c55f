// Host unit test of csrc/cpu/score_pieces.h, the approximate sqrt-softplus score the CPU
// grouped top-k kernel ranks candidates by. Its error bound is what makes the candidate pass
// exact (cpu/grouped_topk.cpp): the pieces, evaluated as the kernels evaluate them (the
// portable vector layer, whose operations the AVX2 and AVX-512 layers repeat lane by lane),
// must stay within half of kScoreApproxError of sqrt(softplus(x)) in float64 on every bf16
// and fp16 value of their range and on an fp32 grid 2^-12 apart, and must report every
// input outside the range, NaN and inf included.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>

#define MOEEXT_CPU_ISA portable
#include "cpu/score_pieces.h"
#include "cpu/vec_portable.h"
#include "check.h"

using moeext::cpu::bits_to_float;
using moeext::cpu::build_sqrt_softplus_pieces;
using moeext::cpu::exact_sqrt_softplus;
using moeext::cpu::kScoreApproxError;
using moeext::cpu::ScorePieces;
using moeext::cpu::portable::Vec;

namespace {

// Lane 0 of a vector: the checks broadcast one value to all lanes.
float lane0(Vec x) {
  float lanes[Vec::kWidth];
  x.store(lanes);
  return lanes[0];
}

double worst = 0.0;

// Outside [-16, 16), NaN or inf: reported as outside. Inside: within the bound, and reported
// as outside only where x * 0.5 + 8 rounds up to 16 (x within an ulp of 16), which is safe:
// the kernel scores such rows exactly.
void check(const ScorePieces& pieces, float x) {
  Vec::PiecesSeen seen = Vec::no_pieces_seen();
  const float approx = lane0(Vec::piecewise_cubic(Vec::set1(x), pieces, seen));
  const bool outside = !Vec::all_pieces_inside(seen);
  const bool inside = x >= -16.0f && x < 16.0f;
  if (!inside) {
    CHECK(outside, "x = %.9g: not reported outside", double(x));
    return;
  }
  if (outside) {
    CHECK(x > 15.999998f, "x = %.9g: reported outside", double(x));
    return;
  }
  const double error = std::fabs(double(approx) - exact_sqrt_softplus(double(x)));
  worst = error > worst ? error : worst;
  CHECK(error <= kScoreApproxError / 2, "x = %.9g: approx %.9g, exact %.9g", double(x),
        double(approx), exact_sqrt_softplus(double(x)));
}

}  // namespace

int main() {
  const ScorePieces pieces = build_sqrt_softplus_pieces();
  for (uint32_t bits = 0; bits < 0x10000u; ++bits) {
    check(pieces, bits_to_float(bits << 16));  // every bf16
    // every fp16, widened exactly
    const uint32_t sign = (bits & 0x8000u) << 16, exponent = (bits >> 10) & 0x1fu,
                   mantissa = bits & 0x3ffu;
    float half;
    if (exponent == 0) {
      half = float(mantissa) * 5.9604644775390625e-8f * (sign ? -1.0f : 1.0f);
    } else if (exponent == 31) {
      half = bits_to_float(sign | 0x7f800000u | (mantissa << 13));
    } else {
      half = bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
    }
    check(pieces, half);
  }
  for (int64_t i = -16 * 4096; i <= 16 * 4096; ++i) check(pieces, float(i) / 4096.0f);
  // Both sides of each piece boundary, and the range's ends.
  for (int i = -16; i <= 16; ++i) {
    check(pieces, std::nextafter(float(i), -100.0f));
    check(pieces, float(i));
    check(pieces, std::nextafter(float(i), 100.0f));
  }
  check(pieces, std::numeric_limits<float>::quiet_NaN());
  check(pieces, std::numeric_limits<float>::infinity());
  check(pieces, -std::numeric_limits<float>::infinity());
  check(pieces, 1e30f);
  check(pieces, -1e30f);
  std::printf("largest error %.3g (bound %.3g)\n", worst, double(kScoreApproxError));
  return moeext_test::finish("score pieces");
}
