// The prepacked router weight (RouterGemmParams::weight_prepacked): its layout, documented
// here once, and the code that writes it. cpu/router_gemm_packed.h reads it.
//
// A bf16 weight [E, H] (a router gate's nn.Linear layout) becomes P * E * 2 contiguous
// elements, P = ceil(H / 2). The experts are cut into tiles of kRouterPackTile (64), the last
// one narrower when 64 does not divide E, and the tiles follow each other. Inside a tile of
// `width` experts from expert `first`, pair row k (k = 0 .. P - 1) holds the pair
// (h = 2k, 2k + 1) of each of its experts in order:
//
//   packed[first * P * 2 + (k * width + (e - first)) * 2 + j] = weight[e][2 * k + j]
//       first = e / 64 * 64, width = min(64, E - first), j = 0 or 1,
//
// an odd H's last pair being (weight[e][H - 1], 0). Seen as a tensor it is [P, E, 2]: the
// shape carries the sizes, though it is no view of the weight.
// Why this layout: a pair row of a tile is a few whole vectors of experts, which the kernel
// multiplies by one broadcast pair of each token, so its accumulators are the logits
// themselves (no horizontal sums) and a tile's weight is one sequential stream.
//
// ISA-neutral and header-only: the launcher (cpu/router_weight_pack.cpp) runs once at load
// time, and tests/cpp/test_router_weight_pack.cpp checks this very code.
#pragma once

#include <algorithm>
#include <cstdint>

#include "moeext/router_gemm.h"

namespace moeext::cpu {

// Writes the packed elements of experts [expert_begin, expert_end): any range, since each
// expert's elements are its own, so threads may split the experts anywhere. weight[e][h] is
// weight[e * row_stride + h * col_stride] (any view, transposed or sliced, packs without a
// copy); packed holds the whole layout, P * num_experts * 2 elements.
inline void pack_router_weight(const uint16_t* weight, int64_t num_experts, int64_t hidden_size,
                               int64_t row_stride, int64_t col_stride, uint16_t* packed,
                               int64_t expert_begin, int64_t expert_end) {
  const int64_t pairs = (hidden_size + 1) / 2;
  const int64_t whole_pairs = hidden_size / 2;
  for (int64_t e = expert_begin; e < expert_end;) {
    const int64_t first = e / kRouterPackTile * kRouterPackTile;
    const int64_t width = std::min(kRouterPackTile, num_experts - first);
    const int64_t end = std::min(first + width, expert_end);
    // Pair row by pair row: the writes stream, and each expert's line of weight serves the
    // pair rows it spans while the tile's lines stay in L1.
    for (int64_t k = 0; k < pairs; ++k) {
      uint16_t* out = packed + first * pairs * 2 + (k * width + (e - first)) * 2;
      const uint16_t* in = weight + e * row_stride + 2 * k * col_stride;
      const bool half_pair = k == whole_pairs;  // weight[e][H] is not there to read
      for (int64_t i = 0; i < end - e; ++i) {
        out[2 * i] = in[i * row_stride];
        out[2 * i + 1] = half_pair ? uint16_t(0) : in[i * row_stride + col_stride];
      }
    }
    e = end;
  }
}

}  // namespace moeext::cpu
