// Part of cpu/router_gemm.cpp: the prepacked bf16 weight, every ISA. Its layout is documented,
// and written, in cpu/router_weight_pack.h: experts in tiles of kRouterPackTile, a tile stored
// pair row by pair row, row k holding the bf16 pair (h = 2k, 2k + 1) of each of its experts.
// One pair row of a tile is a few consecutive vectors of experts, so a register tile
// multiplies kVectors of them by a broadcast pair of each of kTokens tokens, and the
// accumulators are the logits themselves: no horizontal sums, and a tile's weight is one
// sequential stream. The broadcast token pairs stay in L1, where the nn.Linear layout's row
// tiles re-read four token rows from L2 for every six experts: faster than them for decode
// batches with the weight in the LLC, but slower at 16..64 tokens with the weight coming from
// DRAM, where the first token block of each pass waits on memory. Software prefetch of the
// next pass won that back from DRAM but cost more from the LLC, so there is none. (The
// figures: docs/notes/cpu-router-gemm.md.)
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "cpu/router_gemm_dot.h"
#include "cpu/types.h"
#include "moeext/router_gemm.h"

namespace moeext::cpu::MOEEXT_CPU_ISA {
namespace {
namespace packed {

constexpr int64_t kTile = kRouterPackTile;
static_assert(kTile % (PairDot::kLanes * PairDot::kVectors) == 0,
              "a tile of experts must split into whole register tiles");
static_assert(PairDot::kAccumulators >= PairDot::kTokens, "a register tile of kTokens tokens");

// Vectors of experts per register tile for blocks of `tokens` tokens (at most kTokens): as
// many as the accumulators allow, a power of two up to kVectors.
constexpr int64_t tile_vectors(int64_t tokens) {
  int64_t v = PairDot::kVectors;
  while (v > 1 && v * tokens > PairDot::kAccumulators) v /= 2;
  return v;
}
// Past kTokens tokens, k is walked in passes of kChunkPairs pairs (the tile's 64 KiB of
// weight for them stays in L2 while every token block uses it), the partial logits waiting
// in the thread's scratch: 128 to 512 pairs were as fast, fewer or whole rows slower.
constexpr int64_t kChunkPairs = 256;
// Tokens per sweep over the weight: bounds the scratch at kSweepTokens x kTile floats.
constexpr int64_t kSweepTokens = 256;

// The thread scratch run keeps its partial logits in (plan_router_gemm sizes it): a sweep's
// tokens x kTile floats, none where the first sweep (the largest) is a single pass.
constexpr int64_t scratch_floats(int64_t num_tokens) {
  const int64_t tokens = std::min(kSweepTokens, num_tokens);
  return tokens <= PairDot::kTokens ? 0 : tokens * kTile;
}

// The part of one tile's work a register tile does: vectors [0, V) of experts (the last with
// `lanes` experts) for tokens [0, TB), pairs [k_begin, k_end).
struct TileWork {
  const bf16_t* weight;    // the tile's pair row 0, at this register tile's first expert
  int64_t weight_row;      // elements per pair row: 2 x the tile's width
  const bf16_t* x;         // the first token's row
  int64_t x_row;           // hidden_row_stride
  int64_t hidden_size;
  int64_t k_begin, k_end;  // pairs; k_end may be the odd hidden_size's half pair
  int lanes;               // experts in the last vector
  float* partial;          // [TB][kTile] partial logits between passes (nullptr: one pass)
  bool first, last;
  void* out;               // logits of token 0, at this register tile's first expert
  int64_t out_row;         // logits_row_stride
};

inline void store_logits(const float* v, int n, float* out) {
  std::memcpy(out, v, size_t(n) * sizeof(float));
}
inline void store_logits(const float* v, int n, bf16_t* out) {
  for (int i = 0; i < n; ++i) out[i].bits = float_to_bf16_bits(v[i]);
}

// Every loop over the tile's tokens and vectors is unrolled by pragma: left to GCC 12's
// heuristics, acc stayed an array in memory, stored back after every pair.
template <typename Out, int V, int TB>
void tile(const TileWork& a) {
  using D = PairDot;
  typename D::Acc acc[TB][V];
#pragma GCC unroll 16
  for (int t = 0; t < TB; ++t) {
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) {
      acc[t][v] = a.first ? D::zero() : D::load_acc(a.partial + t * kTile + v * D::kLanes);
    }
  }
  const bf16_t* x[TB];
#pragma GCC unroll 16
  for (int t = 0; t < TB; ++t) x[t] = a.x + t * a.x_row;
  const typename D::Lanes last_lanes = D::lanes_mask(a.lanes);
  const auto load_weight = [&](const bf16_t* p, bool last) {
    return last ? D::load_weight(p, last_lanes) : D::load_weight(p);
  };
  constexpr int64_t step = 2 * D::kLanes;  // elements from one vector of experts to the next
  // Whole pairs, then an odd hidden_size's half pair (x[H - 1], 0), read without touching
  // x[H]: the same step, written twice so the accumulators never leave the registers.
  const int64_t full_end = std::min(a.k_end, a.hidden_size / 2);
  // Each pair's V weight vectors are held across the tokens, or its TB token pairs across the
  // vectors: the first, unless the accumulators and the weights would outgrow the registers
  // and fewer token pairs would not. AVX2's 8 x 1 and 4 x 2 tiles hold the token pairs (8
  // accumulators, the pairs and one weight vector: 12 and 14 registers of 16), which ran
  // T = 1 and 2 faster than holding the weights.
  constexpr bool kTokensFirst = TB < V && V * TB + (V + 1) * D::kPairRegisters > D::kRegisters;
  for (int64_t k = a.k_begin; k < full_end; ++k) {
    if constexpr (kTokensFirst) {
      typename D::Pair xp[TB];
#pragma GCC unroll 16
      for (int t = 0; t < TB; ++t) xp[t] = D::broadcast(x[t] + 2 * k);
#pragma GCC unroll 16
      for (int v = 0; v < V; ++v) {
        const typename D::Pair w = load_weight(a.weight + k * a.weight_row + v * step, v + 1 == V);
#pragma GCC unroll 16
        for (int t = 0; t < TB; ++t) D::madd(acc[t][v], xp[t], w);
      }
    } else {
      typename D::Pair w[V];
#pragma GCC unroll 16
      for (int v = 0; v < V; ++v) {
        w[v] = load_weight(a.weight + k * a.weight_row + v * step, v + 1 == V);
      }
#pragma GCC unroll 16
      for (int t = 0; t < TB; ++t) {
        const typename D::Pair xp = D::broadcast(x[t] + 2 * k);
#pragma GCC unroll 16
        for (int v = 0; v < V; ++v) D::madd(acc[t][v], xp, w[v]);
      }
    }
  }
  if (full_end < a.k_end) {
    const int64_t k = full_end;
    typename D::Pair w[V];
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) {
      w[v] = D::load_weight(a.weight + k * a.weight_row + v * step,
                            v + 1 < V ? D::lanes_mask(D::kLanes) : last_lanes);
    }
#pragma GCC unroll 16
    for (int t = 0; t < TB; ++t) {
      const bf16_t pair[2] = {x[t][a.hidden_size - 1], bf16_t{0}};
      const typename D::Pair xp = D::broadcast(pair);
#pragma GCC unroll 16
      for (int v = 0; v < V; ++v) D::madd(acc[t][v], xp, w[v]);
    }
  }
  if (!a.last) {
#pragma GCC unroll 16
    for (int t = 0; t < TB; ++t) {
#pragma GCC unroll 16
      for (int v = 0; v < V; ++v) D::store_acc(acc[t][v], a.partial + t * kTile + v * D::kLanes);
    }
    return;
  }
  // Every accumulator stored before the first copy out: one that lived across a copy's
  // library call was kept in memory all along, spilled in the pair loop too.
  float logits[TB][V * D::kLanes];
#pragma GCC unroll 16
  for (int t = 0; t < TB; ++t) {
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) D::store_acc(acc[t][v], logits[t] + v * D::kLanes);
  }
  const int width = (V - 1) * D::kLanes + a.lanes;
  for (int t = 0; t < TB; ++t) {
    store_logits(logits[t], width, static_cast<Out*>(a.out) + t * a.out_row);
  }
}

template <typename Out>
using TileFn = void (*)(const TileWork&);

// fn[v - 1][t - 1]: v vectors of experts x t tokens, for the edges of a tile and of the tokens;
// null past the accumulators (run never asks for those).
template <typename Out, int V, int TB>
constexpr TileFn<Out> tile_fn() {
  if constexpr (V * TB <= PairDot::kAccumulators) {
    return &tile<Out, V, TB>;
  } else {
    return nullptr;
  }
}
template <typename Out>
struct TileTable {
  TileFn<Out> fn[PairDot::kVectors][PairDot::kTokens];
  template <int... I>
  constexpr explicit TileTable(std::integer_sequence<int, I...>) : fn{} {
    ((fn[I / PairDot::kTokens][I % PairDot::kTokens] =
          tile_fn<Out, I / PairDot::kTokens + 1, I % PairDot::kTokens + 1>()),
     ...);
  }
};
template <typename Out>
inline constexpr TileTable<Out> kTiles{
    std::make_integer_sequence<int, PairDot::kVectors * PairDot::kTokens>{}};

// expert_begin is a multiple of kTile (the callers split there). Tiles outermost within a
// sweep of tokens, so each tile's weight comes from memory once per sweep. scratch holds
// scratch_floats(p.num_tokens) floats.
template <typename Out>
void run(const RouterGemmParams& p, int64_t expert_begin, int64_t expert_end, float* scratch) {
  using D = PairDot;
  const int64_t pairs = (p.hidden_size + 1) / 2;
  const bf16_t* weight = static_cast<const bf16_t*>(p.weight);
  const bf16_t* hidden = static_cast<const bf16_t*>(p.hidden_states);
  for (int64_t t0 = 0; t0 < p.num_tokens; t0 += kSweepTokens) {
    const int64_t tokens = std::min(kSweepTokens, p.num_tokens - t0);
    const bool one_pass = tokens <= D::kTokens;  // the accumulators never leave registers
    const int64_t per_tile = tile_vectors(std::min<int64_t>(tokens, D::kTokens));
    const int64_t chunk = one_pass ? std::max<int64_t>(pairs, 1) : kChunkPairs;
    float* partial = one_pass ? nullptr : scratch;
    for (int64_t e0 = expert_begin; e0 < expert_end; e0 += kTile) {
      const int64_t width = std::min(kTile, p.num_experts - e0);
      const int64_t vectors = (width + D::kLanes - 1) / D::kLanes;
      // Every tile before this one is kTile wide.
      const bf16_t* tile_weight = weight + e0 * pairs * 2;
      for (int64_t k = 0;; k += chunk) {
        const int64_t k_end = std::min(pairs, k + chunk);
        for (int64_t v0 = 0; v0 < vectors; v0 += per_tile) {
          const int64_t nv = std::min(per_tile, vectors - v0);
          const int64_t e = e0 + v0 * D::kLanes;
          for (int64_t t = 0; t < tokens; t += D::kTokens) {
            const int64_t nt = std::min<int64_t>(D::kTokens, tokens - t);
            const int64_t last_vector = e + (nv - 1) * D::kLanes;
            const TileWork work{
                tile_weight + v0 * D::kLanes * 2, width * 2,
                hidden + (t0 + t) * p.hidden_row_stride, p.hidden_row_stride, p.hidden_size,
                k, k_end, int(std::min<int64_t>(D::kLanes, e0 + width - last_vector)),
                one_pass ? nullptr : partial + t * kTile + v0 * D::kLanes, k == 0, k_end == pairs,
                static_cast<Out*>(p.logits) + (t0 + t) * p.logits_row_stride + e,
                p.logits_row_stride};
            kTiles<Out>.fn[nv - 1][nt - 1](work);
          }
        }
        if (k_end == pairs) break;
      }
    }
  }
}

}  // namespace packed
}  // namespace
}  // namespace moeext::cpu::MOEEXT_CPU_ISA
