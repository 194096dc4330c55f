// A cheap stand-in for the sqrt-softplus score, for the candidate pass of the grouped top-k
// kernel (cpu/grouped_topk_approx.h): 16 cubic pieces over x in [-16, 16), within
// kScoreApproxError of the exact score everywhere there. The kernel ranks experts by these
// approximate scores only to find the few that can be chosen, then scores those exactly;
// tests/cpp/test_score_pieces.cpp checks the error bound against float64 on every bf16 and
// fp16 value of the range and on a fine fp32 grid.
//
// No ISA-specific code here: the tables are built once, in double, by the generic
// dispatch code, and each ISA's vector layer evaluates them (Vec::piecewise_cubic).
#pragma once

#include <cmath>


namespace moeext::cpu {

// Piece i covers x in [-16 + 2i, -14 + 2i); with t = x * kPieceScale + kPieceOffset it is
// floor(t), and u = t - i in [0, 1) the position inside it.
constexpr int kScorePieces = 16;
constexpr float kPieceScale = 0.5f;
constexpr float kPieceOffset = 8.0f;
// Bound on |approximate - exact score| over the pieces' range, exact meaning this library's
// fp32 score. The interpolation error is below 2e-4 (the test holds it to half the bound);
// the fp32 exact scores are within a few ulps of the true values.
constexpr float kScoreApproxError = 1.0f / 1024;

// coef[j][i]: the u^j coefficient of piece i, so that a vector layer looks each one up by
// the piece index with one permute.
struct ScorePieces {
  alignas(64) float coef[4][kScorePieces];
};

// The float64 score the pieces interpolate: sqrt(softplus(x)).
inline double exact_sqrt_softplus(double x) {
  return std::sqrt(std::fmax(x, 0.0) + std::log1p(std::exp(-std::fabs(x))));
}

// Each piece interpolates the score at the four Chebyshev nodes of its interval (within a
// small factor of the best cubic), expanded into powers of u.
inline ScorePieces build_sqrt_softplus_pieces() {
  ScorePieces pieces{};
  constexpr double kPi = 3.14159265358979323846;
  for (int i = 0; i < kScorePieces; ++i) {
    double node[4], value[4];
    for (int j = 0; j < 4; ++j) {
      node[j] = 0.5 + 0.5 * std::cos((2 * j + 1) * kPi / 8);
      value[j] = exact_sqrt_softplus((i + node[j] - kPieceOffset) / kPieceScale);
    }
    double poly[4] = {0, 0, 0, 0};  // poly[d]: coefficient of u^d
    for (int j = 0; j < 4; ++j) {
      // The Lagrange basis polynomial of node j, multiplied out.
      double basis[4] = {1, 0, 0, 0};
      double denominator = 1;
      for (int m = 0; m < 4; ++m) {
        if (m == j) continue;
        for (int d = 3; d > 0; --d) basis[d] = basis[d - 1] - node[m] * basis[d];
        basis[0] = -node[m] * basis[0];
        denominator *= node[j] - node[m];
      }
      for (int d = 0; d < 4; ++d) poly[d] += value[j] * basis[d] / denominator;
    }
    for (int d = 0; d < 4; ++d) pieces.coef[d][i] = float(poly[d]);
  }
  return pieces;
}

// The table, built on first use (defined in cpu/dispatch.cpp, compiled for no particular ISA).
const ScorePieces& sqrt_softplus_pieces();

}  // namespace moeext::cpu
