// Part of cpu/router_gemm.cpp, the avx512bf16 copy only (it needs vdpbf16ps): bf16 tokens in the
// vector lanes against the nn.Linear weight.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "cpu/router_gemm_dot.h"
#include "cpu/router_gemm_tiles.h"
#include "cpu/types.h"
#include "moeext/router_gemm.h"

namespace moeext::cpu::MOEEXT_CPU_ISA {
namespace {

// Batches of 5 or more bf16 tokens on avx512bf16: tokens in the vector lanes. The register
// tiles reload their 4 token rows for every 6 weight rows; with several token blocks both
// operands stream into L1 from L2 (10 lines per 24 dot products) and the tiles ran well below
// the vdpbf16ps peak (docs/notes/cpu-router-gemm.md). Here the activations are packed per call
// into the thread's scratch (the weight is read as it is) so that a vector holds kPairs
// consecutive bf16 pairs of each of 16 / kPairs tokens, and each weight's kPairs pairs are
// broadcast from its nn.Linear row: one broadcast feeds every vector of tokens in the tile,
// one vector of tokens feeds 8 experts, and each weight line serves 16 / kPairs steps. A lane
// sums its pairs in order and a token's kPairs lanes are added at the end, so a token's
// logits depend on the call only through the layout its batch size picks.
namespace lanes {

// The layouts, by how many tokens are left to route, each the fastest tried for its range
// against the register tiles and the other layouts (the figures: docs/notes/cpu-router-gemm.md):
//   >= 25 tokens: 2 vectors of 16 tokens (1 pair per lane): 32 tokens per tile;
//   17..24:       3 vectors of 8 tokens (2 pairs): two 16-token vectors would leave the
//                 second mostly empty;
//   13..16:       2 vectors of 8 tokens (a single 16-token vector takes a broadcast per dot
//                 product);
//   9..12:        3 vectors of 4 tokens (4 pairs);
//   5..8:         2 vectors of 4 tokens;
//   fewer:        the register tiles (2 vectors of 2 tokens, 8 pairs each, were slower).
// 8 experts per tile in every layout: 12 x 2, 6 x 4 and 16 x 1 tiles were slower.
struct Layout {
  int pairs;    // consecutive bf16 pairs of a token in one vector: 1, 2 or 4
  int vectors;  // vectors of tokens per tile
  constexpr int tokens_per_vector() const { return 16 / pairs; }
  constexpr int tokens() const { return vectors * tokens_per_vector(); }
};
constexpr int kNumLayouts = 5;
constexpr Layout kLayouts[kNumLayouts] = {{1, 2}, {2, 3}, {2, 2}, {4, 3}, {4, 2}};
constexpr int64_t kLayoutMinTokens[kNumLayouts] = {25, 17, 13, 9, 5};
constexpr int64_t kLaneMinTokens = kLayoutMinTokens[kNumLayouts - 1];
constexpr int kLaneExperts = 8;
// Vector slots packed at a time (3.6 MiB at H = 7168), so the weight is read from memory once
// per call up to 224 tokens (256 for most sizes: a last group of 17..24 tokens takes three
// slots). Fewer slots were faster with the weight in the LLC, as in the Python benchmark, but
// would read a gate from DRAM, as in a model, several times per call.
constexpr int kPackedVectors = 16;

// The 128-bit-lane half of a transpose: 4 * S vectors in which vector g * S + c holds, in
// 128-bit lane l, column l * S + c of row block g, become vector j holding column j of
// every row block in order. S = 1 is the 4 x 4 transpose of 128-bit lanes.
template <int S>
inline void transpose_lane_blocks(__m512i (&v)[16]) {
  __m512i t[4 * S];
  for (int c = 0; c < S; ++c) {
    t[c] = _mm512_shuffle_i32x4(v[c], v[S + c], 0x88);
    t[S + c] = _mm512_shuffle_i32x4(v[c], v[S + c], 0xdd);
    t[2 * S + c] = _mm512_shuffle_i32x4(v[2 * S + c], v[3 * S + c], 0x88);
    t[3 * S + c] = _mm512_shuffle_i32x4(v[2 * S + c], v[3 * S + c], 0xdd);
  }
  for (int c = 0; c < 2 * S; ++c) {
    v[c] = _mm512_shuffle_i32x4(t[c], t[2 * S + c], 0x88);
    v[2 * S + c] = _mm512_shuffle_i32x4(t[c], t[2 * S + c], 0xdd);
  }
}

// 16 rows of 16 dwords, transposed in place: v[j] gets dword j of every row.
inline void transpose_dwords(__m512i (&v)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // v[4q + c] now holds, in 128-bit lane l, dword 4l + c of rows 4q..4q+3.
  transpose_lane_blocks<4>(v);
}

// 8 rows of 8 qwords (v[0..7]), transposed in place: v[j] gets qword j of every row.
inline void transpose_qwords(__m512i (&v)[16]) {
  for (int i = 0; i < 8; i += 2) {
    const __m512i low = _mm512_unpacklo_epi64(v[i], v[i + 1]);
    v[i + 1] = _mm512_unpackhi_epi64(v[i], v[i + 1]);
    v[i] = low;
  }
  // v[2a + c] now holds, in 128-bit lane l, qword 2l + c of rows 2a and 2a + 1.
  transpose_lane_blocks<2>(v);
}

// The number of pair groups (kPairs consecutive pairs) a row of hidden_size elements spans.
inline int64_t pair_groups(int64_t hidden_size, int pairs) {
  return (hidden_size + 2 * pairs - 1) / (2 * pairs);
}

// The thread scratch run packs tokens into (plan_router_gemm sizes it): kPackedVectors
// slots, each holding any layout (one pair per lane spans the most groups).
inline int64_t slot_words(int64_t hidden_size) { return pair_groups(hidden_size, 1) * 16; }
inline int64_t scratch_words(int64_t hidden_size) {
  return kPackedVectors * slot_words(hidden_size);
}

// What leading_tokens assumes of run's loop: the first layout takes whole 32-token tiles,
// and every other one all the tokens it is chosen for.
constexpr bool layouts_take_whole_batches() {
  if (kLayoutMinTokens[0] > kLayouts[0].tokens()) return false;
  for (int i = 1; i < kNumLayouts; ++i) {
    if (kLayouts[i].tokens() < kLayoutMinTokens[i - 1] - 1) return false;
  }
  return true;
}
static_assert(layouts_take_whole_batches(), "leading_tokens must match run's choice of layouts");

// The leading tokens of a call the lanes take (plan_router_gemm): all of them from
// kLaneMinTokens on, but for 1..4 left over whole 32-token tiles, the register tiles' work.
constexpr int64_t leading_tokens(int64_t num_tokens) {
  if (num_tokens < kLaneMinTokens) return 0;
  const int64_t rest = num_tokens % kLayouts[0].tokens();
  return rest < kLaneMinTokens ? num_tokens - rest : num_tokens;
}

// One vector of tokens: packed[g * 16 + lane], lane = token * kPairs + j, holds elements
// 2 * (g * kPairs + j) and the one after of that token (n <= 16 / kPairs rows of x). Lanes of
// tokens past n, and elements past hidden_size, are zero.
template <int kPairs>
void pack_tokens(const bf16_t* x, int64_t row_stride, int64_t n, int64_t hidden_size,
                 uint32_t* packed) {
  constexpr int kRows = 16 / kPairs;
  const int64_t groups = pair_groups(hidden_size, kPairs);
  for (int64_t h = 0; h < hidden_size; h += 32) {
    const __mmask32 m = mask32(hidden_size - h);
    __m512i v[16];
    for (int l = 0; l < kRows; ++l) {
      v[l] = l < n ? _mm512_maskz_loadu_epi16(m, x + l * row_stride + h)
                   : _mm512_setzero_si512();
    }
    if constexpr (kPairs == 1) {
      transpose_dwords(v);
    } else if constexpr (kPairs == 2) {
      transpose_qwords(v);
    } else {
      static_assert(kPairs == 4, "a lane group is 1, 2 or 4 pairs");
      transpose_lane_blocks<1>(v);
    }
    const int64_t group = h / (2 * kPairs);
    const int count = int(std::min<int64_t>(kRows, groups - group));
    for (int j = 0; j < count; ++j) _mm512_store_si512(packed + (group + j) * 16, v[j]);
  }
}

// R experts from `expert` by V vectors of packed tokens (vector v at packed + v * stride)
// that hold tokens [token, token + tokens).
template <typename Out, int kPairs, int V, int R>
void tile(const RouterGemmParams& p, int64_t expert, const uint32_t* packed, int64_t stride,
          int64_t token, int64_t tokens) {
  constexpr int kRows = 16 / kPairs;
  const int64_t H = p.hidden_size;
  const bf16_t* w = static_cast<const bf16_t*>(p.weight) + expert * p.weight_row_stride;
  __m512 acc[V][R];
  for (int v = 0; v < V; ++v) {
    for (int r = 0; r < R; ++r) acc[v][r] = _mm512_setzero_ps();
  }
  const auto step = [&](int64_t group, int64_t elements) {
    __m512bh xv[V];
    for (int v = 0; v < V; ++v) {
      xv[v] = __m512bh(_mm512_load_si512(packed + v * stride + group * 16));
    }
    for (int r = 0; r < R; ++r) {
      const bf16_t* src = w + r * p.weight_row_stride + group * 2 * kPairs;
      // A short last group reads only its elements; the rest stay zero.
      alignas(16) bf16_t bits[2 * kPairs] = {};
      std::memcpy(bits, src, size_t(elements) * sizeof(bf16_t));
      __m512bh wv;
      if constexpr (kPairs == 1) {
        int32_t b;
        std::memcpy(&b, bits, sizeof(b));
        wv = __m512bh(_mm512_set1_epi32(b));
      } else if constexpr (kPairs == 2) {
        long long b;
        std::memcpy(&b, bits, sizeof(b));
        wv = __m512bh(_mm512_set1_epi64(b));
      } else {
        wv = __m512bh(_mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<__m128i*>(bits))));
      }
      for (int v = 0; v < V; ++v) acc[v][r] = _mm512_dpbf16_ps(acc[v][r], xv[v], wv);
    }
  };
  const int64_t full_groups = H / (2 * kPairs);
  for (int64_t g = 0; g < full_groups; ++g) step(g, 2 * kPairs);
  if (H % (2 * kPairs) != 0) step(full_groups, H % (2 * kPairs));
  alignas(64) float lane_sums[R][16];
  for (int v = 0; v < V; ++v) {
    for (int r = 0; r < R; ++r) _mm512_store_ps(lane_sums[r], acc[v][r]);
    const int64_t first = token + v * kRows;
    const int64_t count = std::min<int64_t>(kRows, token + tokens - first);
    for (int64_t l = 0; l < count; ++l) {
      Out* out = static_cast<Out*>(p.logits) + (first + l) * p.logits_row_stride + expert;
      for (int r = 0; r < R; ++r) {
        float sum = lane_sums[r][l * kPairs];
        for (int j = 1; j < kPairs; ++j) sum += lane_sums[r][l * kPairs + j];
        store_logit(sum, out + r);
      }
    }
  }
}

template <typename Out>
using TileFn = void (*)(const RouterGemmParams&, int64_t, const uint32_t*, int64_t, int64_t,
                        int64_t);

// fn[r - 1] is the tile of r experts in layout L: the end of an expert range gets an
// exact-size tile.
template <typename Out, int L>
struct TileTable {
  TileFn<Out> fn[kLaneExperts];
  template <int... I>
  constexpr explicit TileTable(std::integer_sequence<int, I...>)
      : fn{&tile<Out, kLayouts[L].pairs, kLayouts[L].vectors, I + 1>...} {}
};
template <typename Out, int L>
inline constexpr TileTable<Out, L> kTiles{std::make_integer_sequence<int, kLaneExperts>{}};

template <typename Out, int... L>
TileFn<Out> tile_fn(int layout, int rows, std::integer_sequence<int, L...>) {
  TileFn<Out> fn = nullptr;
  ((fn = layout == L ? kTiles<Out, L>.fn[rows - 1] : fn), ...);
  return fn;
}
template <typename Out>
TileFn<Out> tile_fn(int layout, int rows) {
  return tile_fn<Out>(layout, rows, std::make_integer_sequence<int, kNumLayouts>{});
}

// Packs up to kPackedVectors vectors of tokens at a time into scratch (scratch_words) and
// runs every token of p, whose num_tokens the plan has cut to leading_tokens. Each tile of
// weight rows serves every packed token while it is in L1/L2.
template <typename Out>
void run(const RouterGemmParams& p, int64_t expert_begin, int64_t expert_end,
         uint32_t* scratch) {
  const int64_t stride = slot_words(p.hidden_size);
  const bf16_t* x = static_cast<const bf16_t*>(p.hidden_states);
  int64_t token = 0;
  while (p.num_tokens - token >= kLaneMinTokens) {
    struct Packed {
      int layout;
      int64_t token, tokens;
      const uint32_t* vectors;
    } packed[kPackedVectors];
    int num_packed = 0, slots = 0;
    for (;;) {
      const int64_t left = p.num_tokens - token;
      int layout = 0;
      while (layout < kNumLayouts && left < kLayoutMinTokens[layout]) ++layout;
      if (layout == kNumLayouts || slots + kLayouts[layout].vectors > kPackedVectors) break;
      const Layout& l = kLayouts[layout];
      const int64_t tokens = std::min<int64_t>(l.tokens(), left);
      uint32_t* vectors = scratch + slots * stride;
      for (int v = 0; v < l.vectors; ++v) {
        const int64_t first = token + v * l.tokens_per_vector();
        const int64_t n = std::clamp<int64_t>(p.num_tokens - first, 0, l.tokens_per_vector());
        const bf16_t* rows = x + first * p.hidden_row_stride;
        uint32_t* const out = vectors + v * stride;
        switch (l.pairs) {
          case 1:
            pack_tokens<1>(rows, p.hidden_row_stride, n, p.hidden_size, out);
            break;
          case 2:
            pack_tokens<2>(rows, p.hidden_row_stride, n, p.hidden_size, out);
            break;
          default:
            pack_tokens<4>(rows, p.hidden_row_stride, n, p.hidden_size, out);
            break;
        }
      }
      packed[num_packed++] = {layout, token, tokens, vectors};
      slots += l.vectors;
      token += tokens;
    }
    for (int64_t e = expert_begin; e < expert_end; e += kLaneExperts) {
      const int rows = int(std::min<int64_t>(kLaneExperts, expert_end - e));
      for (int i = 0; i < num_packed; ++i) {
        const Packed& b = packed[i];
        tile_fn<Out>(b.layout, rows)(p, e, b.vectors, stride, b.token, b.tokens);
      }
    }
  }
}

}  // namespace lanes

}  // namespace
}  // namespace moeext::cpu::MOEEXT_CPU_ISA
