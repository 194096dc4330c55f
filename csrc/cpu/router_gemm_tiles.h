// Part of cpu/router_gemm.cpp: the nn.Linear weight [E, H] in register tiles. A register tile
// is kExperts weight rows x kTokens tokens whose fp32 accumulators stay in registers. The
// caller's expert range is walked one tile row at a time, and every token block reuses those
// weight rows while they are in L1/L2, so each weight row comes from memory once per call
// however many tokens there are. Each accumulator holds per-lane partial sums, reduced once
// at the end (a few instructions per logit against H / kStep dot steps).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>

#include "cpu/router_gemm_dot.h"
#include "cpu/types.h"
#include "moeext/router_gemm.h"

namespace moeext::cpu::MOEEXT_CPU_ISA {
namespace {

// A tile's accumulators, weight operands and token operand all sit in the vector registers.
// With 32 registers: 6 x 4 where an operand is one register (fewer loads per dot product
// than 4 x 4; 7 x 3 and 4 x 6 were slower), 4 x 4 on the shifting path where a bf16
// operand is two (6 x 4 would spill). With 16: 4 x 2, or 3 x 2.
// With more than one token block, H is walked in passes of kChunk elements; the unreduced
// accumulators wait in a scratch array between passes. Whole rows in one pass were fastest
// while a tile's rows stay in L2 for every token block (fewer passes, less scratch traffic),
// so passes only start past 8192, where a tile's rows would outgrow a 1 MiB L2 share.
// (The measurements: docs/notes/cpu-router-gemm.md.)
template <typename In>
struct TileShape {
  static_assert(kVectorRegisters == 16 || kVectorRegisters == 32, "tiles for 16 or 32 registers");
  static constexpr int kOperandRegisters =
      sizeof(typename Dot<In>::Operand) / sizeof(typename Dot<In>::Acc);
  static constexpr int kRegisters = kVectorRegisters;
  static constexpr int kExperts = kRegisters == 32 ? (kOperandRegisters == 1 ? 6 : 4)
                                                   : (kOperandRegisters == 1 ? 4 : 3);
  static constexpr int kTokens = kRegisters == 32 ? 4 : 2;
  static constexpr int64_t kChunk = 8192;
  static_assert(kExperts * kTokens + kOperandRegisters * (kExperts + 1) <= kRegisters,
                "the tile's accumulators and operands must fit the vector registers");
  static_assert(kChunk % 32 == 0, "passes must end on whole vector steps");
};
// Threads split the experts at multiples of this: an even split, each range ending in a
// narrower tile, beat whole tiles (12 left one thread of two 132 of 256 experts).
constexpr int kExpertBlock = 2;

inline void store_logit(float v, float* out) { *out = v; }
inline void store_logit(float v, bf16_t* out) { out->bits = float_to_bf16_bits(v); }

// One pass over h in [h_begin, h_end) of one tile. partial holds the tile's accumulators
// between passes ([kTokens][kExperts], unused when the pass is the only one); the first pass
// starts from zero, the last one reduces and writes the logits. MOEEXT_TILE_UNROLL comes
// with the ISA's dot products.
template <typename In, typename Out, int R, int TB>
void tile(const RouterGemmParams& p, int64_t expert, int64_t token, int64_t h_begin,
          int64_t h_end, typename Dot<In>::Acc* partial, bool first, bool last) {
  using D = Dot<In>;
  using Shape = TileShape<In>;
  const In* x[TB];
  const In* w[R];
  MOEEXT_TILE_UNROLL
  for (int t = 0; t < TB; ++t) {
    x[t] = static_cast<const In*>(p.hidden_states) + (token + t) * p.hidden_row_stride;
  }
  MOEEXT_TILE_UNROLL
  for (int r = 0; r < R; ++r) {
    w[r] = static_cast<const In*>(p.weight) + (expert + r) * p.weight_row_stride;
  }
  typename D::Acc acc[TB][R];
  MOEEXT_TILE_UNROLL
  for (int t = 0; t < TB; ++t) {
    MOEEXT_TILE_UNROLL
    for (int r = 0; r < R; ++r) {
      acc[t][r] = first ? D::zero() : partial[t * Shape::kExperts + r];
    }
  }
  int64_t h = h_begin;
  for (; h + D::kStep <= h_end; h += D::kStep) {
    typename D::Operand wv[R];
    MOEEXT_TILE_UNROLL
    for (int r = 0; r < R; ++r) wv[r] = D::load(w[r] + h);
    MOEEXT_TILE_UNROLL
    for (int t = 0; t < TB; ++t) {
      const typename D::Operand xv = D::load(x[t] + h);
      MOEEXT_TILE_UNROLL
      for (int r = 0; r < R; ++r) D::madd(acc[t][r], xv, wv[r]);
    }
  }
  if (h < h_end) {
    // Only the last pass has a tail. Both operands load zeros past H: exact zeros added.
    typename D::Operand wv[R];
    MOEEXT_TILE_UNROLL
    for (int r = 0; r < R; ++r) wv[r] = D::load_tail(w[r] + h, h_end - h);
    MOEEXT_TILE_UNROLL
    for (int t = 0; t < TB; ++t) {
      const typename D::Operand xv = D::load_tail(x[t] + h, h_end - h);
      MOEEXT_TILE_UNROLL
      for (int r = 0; r < R; ++r) D::madd(acc[t][r], xv, wv[r]);
    }
  }
  if (!last) {
    MOEEXT_TILE_UNROLL
    for (int t = 0; t < TB; ++t) {
      MOEEXT_TILE_UNROLL
      for (int r = 0; r < R; ++r) partial[t * Shape::kExperts + r] = acc[t][r];
    }
    return;
  }
  MOEEXT_TILE_UNROLL
  for (int t = 0; t < TB; ++t) {
    Out* out = static_cast<Out*>(p.logits) + (token + t) * p.logits_row_stride + expert;
    MOEEXT_TILE_UNROLL
    for (int r = 0; r < R; ++r) store_logit(D::reduce(acc[t][r]), out + r);
  }
}
#undef MOEEXT_TILE_UNROLL

template <typename In>
using TileFn = void (*)(const RouterGemmParams&, int64_t, int64_t, int64_t, int64_t,
                        typename Dot<In>::Acc*, bool, bool);

// fn[r - 1][t - 1] is the tile of r experts x t tokens: the edges of the expert range and
// of the token count get exact-size tiles instead of branches in the inner loop.
template <typename In, typename Out, typename Shape = TileShape<In>>
struct TileTable {
  TileFn<In> fn[Shape::kExperts][Shape::kTokens];
  template <int... I>
  constexpr explicit TileTable(std::integer_sequence<int, I...>)
      : fn{} {
    ((fn[I / Shape::kTokens][I % Shape::kTokens] =
          &tile<In, Out, I / Shape::kTokens + 1, I % Shape::kTokens + 1>),
     ...);
  }
};
template <typename In, typename Out>
inline constexpr TileTable<In, Out> kTiles{std::make_integer_sequence<
    int, TileShape<In>::kExperts * TileShape<In>::kTokens>{}};

// Weight rows outermost: each tile row of kExperts rows is read from memory once and then
// served from L1/L2 to every token block.
template <typename In, typename Out>
void run_tiles(const RouterGemmParams& p, int64_t expert_begin, int64_t expert_end) {
  using Acc = typename Dot<In>::Acc;
  using Shape = TileShape<In>;
  constexpr int kTileAccs = Shape::kExperts * Shape::kTokens;
  const auto& tiles = kTiles<In, Out>;
  const int64_t H = p.hidden_size;
  const int64_t token_blocks = (p.num_tokens + Shape::kTokens - 1) / Shape::kTokens;
  const bool one_pass = token_blocks == 1;  // decode: the accumulators never leave registers
  // Decode and small prefill batches keep the scratch on the stack.
  constexpr int64_t kStackBlocks = 16;
  Acc stack_partial[kStackBlocks * kTileAccs];
  std::unique_ptr<unsigned char[]> heap_bytes;
  Acc* partial = stack_partial;
  if (!one_pass && token_blocks > kStackBlocks) {
    const size_t bytes = size_t(token_blocks * kTileAccs) * sizeof(Acc);
    heap_bytes.reset(new unsigned char[bytes + alignof(Acc)]);
    const uintptr_t base = reinterpret_cast<uintptr_t>(heap_bytes.get());
    partial = reinterpret_cast<Acc*>((base + alignof(Acc) - 1) & ~uintptr_t(alignof(Acc) - 1));
  }
  const int64_t chunk = one_pass ? std::max<int64_t>(H, 1) : Shape::kChunk;
  for (int64_t e = expert_begin; e < expert_end; e += Shape::kExperts) {
    const int64_t rows = std::min<int64_t>(Shape::kExperts, expert_end - e);
    for (int64_t h = 0;; h += chunk) {
      const int64_t h_end = std::min(H, h + chunk);
      const bool first = h == 0, last = h_end == H;
      for (int64_t b = 0; b < token_blocks; ++b) {
        const int64_t t = b * Shape::kTokens;
        const int64_t tokens = std::min<int64_t>(Shape::kTokens, p.num_tokens - t);
        tiles.fn[rows - 1][tokens - 1](p, e, t, h, h_end, partial + b * kTileAccs, first, last);
      }
      if (last) break;
    }
  }
}

}  // namespace
}  // namespace moeext::cpu::MOEEXT_CPU_ISA
