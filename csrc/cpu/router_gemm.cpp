// Router GEMM on the CPU (SPEC.md section 2). Compiled once per ISA; see cpu/vec.h.
//
// The weight [E, H] is read in its nn.Linear layout, or in prepack_router_weight's tiles
// (namespace packed, below; what follows is the nn.Linear path). A register tile is
// kExperts weight rows x kTokens tokens whose fp32 accumulators stay in registers.
// The caller's expert range is walked one tile row at a time, and every token block reuses
// those weight rows while they are in L1/L2, so each weight row comes from memory once per
// call however many tokens there are. Each accumulator holds per-lane partial sums, reduced
// once at the end (a few instructions per logit against H/32 dot steps). Batches of 5 or
// more bf16 tokens on avx512bf16 take another layout, tokens in the vector lanes (namespace
// lanes).
//
// The per-ISA "Dot" types say how kStep consecutive elements of one token and one weight row
// enter an accumulator:
//   avx512bf16  vdpbf16ps: 32 bf16 pairs per instruction. It reads bf16 denormals as zero and
//               flushes denormal results, which moves a logit by < 2^-126.
//   avx512      bf16 widened by shifting: the even elements are the 32-bit lanes shifted left
//               by 16, the odd ones the lanes with the low half cleared; both operands split
//               the same way, so two FMAs cover 32 elements with no permutation.
//   avx2        the same at 16 elements per step, in 16 ymm registers (smaller tiles).
//   portable    the portable path (aarch64, x86-64 without AVX2): four fp32 lanes in the
//               compiler's generic vectors (cpu/vec_portable.h), bf16 split by shifting
//               as above, 8 elements per step.
// fp16 and fp32 inputs widen to fp32 (vcvtph2ps; fp16_to_f4 on the portable path) and use
// FMAs, which the portable path fuses where the target has them (madd4). Products of two bf16
// or two fp16 values are exact in fp32; only the accumulation rounds.
// GCC 12's AVX-512 headers start shifts and extracts from a self-initialised "undefined"
// vector and then warn about it once inlined (GCC bug 105593, fixed in 12.3).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>

#include "cpu/isa_id.h"
#include "cpu/router_gemm_isa.h"
#include "cpu/types.h"

#if MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_portable
#include "cpu/vec_portable.h"
#else
#include <immintrin.h>
#endif

namespace moeext::cpu::MOEEXT_CPU_ISA {
namespace {

// AVX2 and the portable path have no 16-bit masked loads: the last partial step reads a
// zero-padded copy of its n < N elements.
template <typename T, int N>
inline const T* zero_padded(const T* p, int64_t n, T (&buffer)[N]) {
  std::memset(buffer, 0, sizeof(buffer));
  std::memcpy(buffer, p, size_t(n) * sizeof(T));
  return buffer;
}

#if MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_portable

using portable_detail::F4;
using portable_detail::U4;

inline F4 load4(const float* p) {
  F4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
// The product is fused where the target has a fused multiply-add (aarch64: one fmla per
// vector). On x86-64 without FMA, std::fma would be a library call per lane, so the product
// rounds before the add there.
MOEEXT_ALWAYS_INLINE F4 madd4(F4 acc, F4 x, F4 w) {
#if defined(__FP_FAST_FMAF)
  return portable_detail::fma4(x, w, acc);
#else
  return acc + x * w;
#endif
}
inline float reduce4(F4 a) { return (a[0] + a[1]) + (a[2] + a[3]); }
template <typename T>
struct Dot;

template <>
struct Dot<float> {
  static constexpr int kStep = 4;
  using Acc = F4;
  using Operand = F4;
  static Acc zero() { return F4{}; }
  static Operand load(const float* p) { return load4(p); }
  static Operand load_tail(const float* p, int64_t n) {
    float buffer[kStep];
    return load(zero_padded(p, n, buffer));
  }
  static void madd(Acc& acc, Operand x, Operand w) { acc = madd4(acc, x, w); }
  static float reduce(Acc acc) { return reduce4(acc); }
};

template <>
struct Dot<fp16_t> : Dot<float> {
  static Operand load(const fp16_t* p) { return portable_detail::load_fp16_4(p); }
  static Operand load_tail(const fp16_t* p, int64_t n) {
    fp16_t buffer[kStep];
    return load(zero_padded(p, n, buffer));
  }
};

// bf16 widened by shifting, as on the x86 paths, 8 elements per step.
template <>
struct Dot<bf16_t> {
  static constexpr int kStep = 8;
  using Acc = F4;
  struct Operand {
    F4 even, odd;
  };
  static Acc zero() { return F4{}; }
  static Operand split(U4 words) {
    return {portable_detail::bf16_even(words), portable_detail::bf16_odd(words)};
  }
  static Operand load(const bf16_t* p) {
    U4 v;
    std::memcpy(&v, p, sizeof(v));
    return split(v);
  }
  static Operand load_tail(const bf16_t* p, int64_t n) {
    bf16_t buffer[kStep];
    return load(zero_padded(p, n, buffer));
  }
  static void madd(Acc& acc, const Operand& x, const Operand& w) {
    acc = madd4(madd4(acc, x.even, w.even), x.odd, w.odd);
  }
  static float reduce(Acc acc) { return reduce4(acc); }
};

#elif MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_avx2

inline float reduce256(__m256 a) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

template <typename T>
struct Dot;

template <>
struct Dot<float> {
  static constexpr int kStep = 8;
  using Acc = __m256;
  using Operand = __m256;
  static Acc zero() { return _mm256_setzero_ps(); }
  static Operand load(const float* p) { return _mm256_loadu_ps(p); }
  static Operand load_tail(const float* p, int64_t n) {
    float buffer[kStep];
    return load(zero_padded(p, n, buffer));
  }
  static void madd(Acc& acc, Operand x, Operand w) { acc = _mm256_fmadd_ps(x, w, acc); }
  static float reduce(Acc acc) { return reduce256(acc); }
};

template <>
struct Dot<fp16_t> : Dot<float> {
  static Operand load(const fp16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static Operand load_tail(const fp16_t* p, int64_t n) {
    fp16_t buffer[kStep];
    return load(zero_padded(p, n, buffer));
  }
};

// bf16 widened by shifting, as on the avx512 path, 16 elements per step.
template <>
struct Dot<bf16_t> {
  static constexpr int kStep = 16;
  using Acc = __m256;
  struct Operand {
    __m256 even, odd;
  };
  static Acc zero() { return _mm256_setzero_ps(); }
  static Operand load(const bf16_t* p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
            _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int32_t(0xffff0000u))))};
  }
  static Operand load_tail(const bf16_t* p, int64_t n) {
    bf16_t buffer[kStep];
    return load(zero_padded(p, n, buffer));
  }
  static void madd(Acc& acc, const Operand& x, const Operand& w) {
    acc = _mm256_fmadd_ps(x.odd, w.odd, _mm256_fmadd_ps(x.even, w.even, acc));
  }
  static float reduce(Acc acc) { return reduce256(acc); }
};

#else  // avx512, avx512bf16

inline __mmask16 mask16(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1u);
}
inline __mmask32 mask32(int64_t n) {
  return n >= 32 ? __mmask32(0xffffffffu) : __mmask32((uint32_t(1) << n) - 1u);
}

template <typename T>
struct Dot;

template <>
struct Dot<float> {
  static constexpr int kStep = 16;
  using Acc = __m512;
  using Operand = __m512;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Operand load(const float* p) { return _mm512_loadu_ps(p); }
  static Operand load_tail(const float* p, int64_t n) {
    return _mm512_maskz_loadu_ps(mask16(n), p);
  }
  static void madd(Acc& acc, Operand x, Operand w) { acc = _mm512_fmadd_ps(x, w, acc); }
  static float reduce(Acc acc) { return _mm512_reduce_add_ps(acc); }
};

template <>
struct Dot<fp16_t> : Dot<float> {
  static Operand load(const fp16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static Operand load_tail(const fp16_t* p, int64_t n) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask16(n), p));
  }
};

#if MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_avx512bf16

template <>
struct Dot<bf16_t> {
  static constexpr int kStep = 32;
  using Acc = __m512;
  using Operand = __m512bh;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Operand load(const bf16_t* p) {
    __m512i v = _mm512_loadu_si512(p);
    // Without this GCC 12 reloads each weight vector for every token of the tile (as a
    // memory operand of vdpbf16ps): one load per dot product, and the loads become the
    // bottleneck (~140 instead of ~180 GMAC/s per core at T = 16..64, -35% time at T = 256).
    asm("" : "+v"(v));
    return Operand(v);
  }
  static Operand load_tail(const bf16_t* p, int64_t n) {
    return Operand(_mm512_maskz_loadu_epi16(mask32(n), p));
  }
  static void madd(Acc& acc, Operand x, Operand w) { acc = _mm512_dpbf16_ps(acc, x, w); }
  static float reduce(Acc acc) { return _mm512_reduce_add_ps(acc); }
};

#else

template <>
struct Dot<bf16_t> {
  static constexpr int kStep = 32;
  using Acc = __m512;
  struct Operand {
    __m512 even, odd;
  };
  static Acc zero() { return _mm512_setzero_ps(); }
  static Operand split(__m512i v) {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
            _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int32_t(0xffff0000u))))};
  }
  static Operand load(const bf16_t* p) { return split(_mm512_loadu_si512(p)); }
  static Operand load_tail(const bf16_t* p, int64_t n) {
    return split(_mm512_maskz_loadu_epi16(mask32(n), p));
  }
  static void madd(Acc& acc, const Operand& x, const Operand& w) {
    acc = _mm512_fmadd_ps(x.odd, w.odd, _mm512_fmadd_ps(x.even, w.even, acc));
  }
  static float reduce(Acc acc) { return _mm512_reduce_add_ps(acc); }
};

#endif
#endif

// Tile shape and pass length, tuned with bf16 at H = 7168 on an AMD EPYC (Zen 5, family 26).
// A tile is kExperts weight rows x kTokens tokens whose accumulators, weight operands and
// token operand all sit in the vector registers. With 32 registers: 6 x 4 where an operand
// is one register, 4 x 4 on the shifting path where a bf16 operand is two (6 x 4 would
// spill). 6 rows beat 4 by ~20% at T = 4..256 (fewer loads per dot product); 7 x 3 and
// 4 x 6 were slower.
// With more than one token block, H is walked in passes of kChunk elements; the unreduced
// accumulators wait in a scratch array between passes. Re-measured at H = 7168 (one thread,
// fresh weights per call): whole rows in one pass are fastest, 12-17% ahead of 2048-element
// passes at T = 16..256 (the tile's weight rows, 86 KiB, stay in L2 for every token block
// either way, and fewer passes save the scratch traffic); 1024 was slower still. So passes
// only start past 8192, where a tile's rows would outgrow a 1 MiB L2 share.
template <typename In>
struct TileShape {
  static constexpr int kOperandRegisters =
      sizeof(typename Dot<In>::Operand) / sizeof(typename Dot<In>::Acc);
#if MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_avx2 || \
    (MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_portable && defined(__x86_64__))
  // 16 ymm (or, on the portable path, xmm) registers: 4 x 2 (3 x 2 with two-register bf16
  // operands). The portable path has 32 on aarch64.
  static constexpr int kRegisters = 16;
  static constexpr int kExperts = kOperandRegisters == 1 ? 4 : 3;
  static constexpr int kTokens = 2;
#else
  static constexpr int kRegisters = 32;
  static constexpr int kExperts = kOperandRegisters == 1 ? 6 : 4;
  static constexpr int kTokens = 4;
#endif
  static constexpr int64_t kChunk = 8192;
  static_assert(kExperts * kTokens + kOperandRegisters * (kExperts + 1) <= kRegisters,
                "the tile's accumulators and operands must fit the vector registers");
  static_assert(kChunk % 32 == 0, "passes must end on whole vector steps");
};
// Threads split the experts at multiples of this. Whole tiles (12) left one thread of two
// 132 of 256 experts; an even split with a narrower tile at the end of each range is 2-4%
// faster at E = 256, T = 1..64 (measured 2 = 1 > 6 > 12), and the same at E = 384.
constexpr int kExpertBlock = 2;

inline void store_logit(float v, float* out) { *out = v; }
inline void store_logit(float v, bf16_t* out) { out->bits = float_to_bf16_bits(v); }

// The portable copy unrolls the loops over a tile's tokens and experts by pragma: left to
// GCC 12, the aarch64 build kept its accumulators in memory, loaded and stored around every
// token's dot products. The x86 copies keep the code their tuning measured (the pragma
// would change it: GCC leaves some of those loops rolled there).
#if MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_portable
#define MOEEXT_TILE_UNROLL _Pragma("GCC unroll 16")
#else
#define MOEEXT_TILE_UNROLL
#endif

// One pass over h in [h_begin, h_end) of one tile. partial holds the tile's accumulators
// between passes ([kTokens][kExperts], unused when the pass is the only one); the first pass
// starts from zero, the last one reduces and writes the logits.
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

// The calling thread's scratch, 64-byte aligned, of at least `words` dwords: grown, never
// shrunk, and shared by both output dtypes and both users (the token packing of namespace
// lanes, the partial sums of namespace packed).
inline uint32_t* thread_scratch(int64_t words) {
  thread_local std::unique_ptr<uint32_t, void (*)(void*)> scratch{nullptr, std::free};
  thread_local int64_t capacity = 0;
  if (capacity < words) {
    const size_t bytes = size_t(words) * sizeof(uint32_t);
    scratch.reset(static_cast<uint32_t*>(std::aligned_alloc(64, (bytes + 64) / 64 * 64)));
    if (scratch == nullptr) throw std::bad_alloc();
    capacity = words;
  }
  return scratch.get();
}

#if MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_avx512bf16
// Batches of 5 or more bf16 tokens on avx512bf16: tokens in the vector lanes. The register
// tiles reload their 4 token rows for every 6 weight rows; with several token blocks both
// operands stream into L1 from L2 (10 lines per 24 dot products) and the tiles ran at 55-65%
// of the vdpbf16ps peak (two per cycle on Zen 5). Here the activations are packed per call
// into the thread's scratch (the weight is read as it is) so that a vector holds kPairs
// consecutive bf16 pairs of each of 16 / kPairs tokens, and each weight's kPairs pairs are
// broadcast from its nn.Linear row: one broadcast feeds every vector of tokens in the tile,
// one vector of tokens feeds 8 experts, and each weight line serves 16 / kPairs steps. A lane
// sums its pairs in order and a token's kPairs lanes are added at the end, so a token's
// logits depend on the call only through the layout its batch size picks.
namespace lanes {

// The layouts, by how many tokens are left to route (measured at E = 256 and 384, H = 7168,
// two threads, against the register tiles and each other):
//   >= 25 tokens: 2 vectors of 16 tokens (1 pair per lane): 32 tokens per tile;
//   17..24:       3 vectors of 8 tokens (2 pairs): T = 24 0.77x the time of two 16-token
//                 vectors, whose second vector is mostly empty there;
//   13..16:       2 vectors of 8 tokens: T = 16 0.63-0.68x the register tiles' time (a
//                 single 16-token vector: 0.71-0.78x, one broadcast per dot product);
//   9..12:        3 vectors of 4 tokens (4 pairs): T = 9..12 0.81-0.85x the tiles;
//   5..8:         2 vectors of 4 tokens: T = 5 0.93x, T = 6..8 0.85-0.87x;
//   fewer:        the register tiles (2 vectors of 2 tokens, 8 pairs each, were 1.02-1.18x
//                 their time at T = 2..4).
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
// Vector slots packed at a time (16, 3.6 MiB at H = 7168), so the weight is read from memory
// once per call up to 224 tokens (256 for most sizes: a last group of 17..24 tokens takes
// three slots). With the weight in the LLC, as in the Python benchmark, packing 2 at a time
// is 5-8% faster at T = 64..256; with a gate from DRAM, as in a model, that would read it 8
// times at T = 256.
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

// Packs up to kPackedVectors vectors of tokens at a time and returns how many leading tokens
// it did; the fewer than kLaneMinTokens left after them are the register tiles' work. Each
// tile of weight rows serves every packed token while it is in L1/L2.
template <typename Out>
int64_t run(const RouterGemmParams& p, int64_t expert_begin, int64_t expert_end) {
  if (p.num_tokens < kLaneMinTokens) return 0;
  // A vector slot holds any layout: one pair per lane spans the most groups.
  const int64_t stride = pair_groups(p.hidden_size, 1) * 16;
  uint32_t* const scratch = thread_scratch(kPackedVectors * stride);
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
  return token;
}

}  // namespace lanes
#endif

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

// A prepacked bf16 weight (moeext.prepack_router_weight), every ISA. The packed tensor
// [ceil(H/2), E, 2] holds the experts in tiles of kRouterPackTile (64; the last one
// narrower): tile i is [ceil(H/2)][width][2], the bf16 pair (h = 2k, 2k + 1) of each of its
// experts for k = 0, 1, ... (an odd H's last pair padded with zero), and the tiles follow
// each other. One pair row of a tile is a few consecutive vectors of experts, so a register
// tile multiplies kVectors of them by a broadcast pair of each of kTokens tokens, and the
// accumulators are the logits themselves: no horizontal sums, and a tile's weight is one
// sequential stream. The broadcast token pairs stay in L1, where the nn.Linear layout's row
// tiles re-read four token rows from L2 for every six experts: through torch.ops at H = 7168,
// E = 256 and 384, two threads, weight in the LLC, T = 1 takes 0.91-0.93x their time, T = 2..4
// 0.73-0.86x, T = 8..256 0.87-1.02x. With the weight coming from DRAM (the C++ benchmark's
// rotated copies) T = 16..64 took 1.1-1.5x their time: the first token block of each pass
// waits on memory. Software prefetch of the next pass during the other token blocks (one line
// per pair step, the blocks taking turns) won that back from DRAM (T = 16 level with the row
// tiles) but cost 17% at T = 16 from the LLC (25% with a line per vector), so there is none.
namespace packed {

#if MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_portable

// Four experts a vector, widened and multiplied as Dot<bf16_t> does. 32 vector registers on
// aarch64: 16 accumulators, 4 + 2 operands; 16 on x86-64: 8, 2 + 2. As on AVX2 (below), the
// register tile is as wide as the accumulators allow for the tokens it takes (x86-64's SSE2
// code at T = 1: 8 x 1 instead of 2 x 1).
struct PairDot {
  using Bf16 = Dot<bf16_t>;
  static constexpr int kLanes = 4;
#if defined(__x86_64__)
  static constexpr int kVectors = 8, kTokens = 4, kAccumulators = 8, kRegisters = 16;
#else
  static constexpr int kVectors = 16, kTokens = 4, kAccumulators = 16, kRegisters = 32;
#endif
  static constexpr int kPairRegisters = 2;
  using Acc = Bf16::Acc;
  using Pair = Bf16::Operand;
  static Acc zero() { return Bf16::zero(); }
  static Acc load_acc(const float* p) { return load4(p); }
  static void store_acc(Acc a, float* p) { std::memcpy(p, &a, sizeof(a)); }
  using Lanes = int;  // the experts to load, 1..4
  static Lanes lanes_mask(int n) { return n; }
  static Pair load_weight(const bf16_t* p) { return Bf16::load(p); }
  // Called for the last vector of every pair row. A copy of `lanes` pairs is a library call
  // (every live vector register saved around it), so a whole vector takes a plain load; only
  // a narrow tile's partial last vector pays for the call.
  static Pair load_weight(const bf16_t* p, Lanes lanes) {
    if (lanes == kLanes) return Bf16::load(p);
    U4 v{};
    std::memcpy(&v, p, size_t(lanes) * 2 * sizeof(bf16_t));
    return Bf16::split(v);
  }
  // The pair's 32 bits in every lane, split like a weight vector: one load-and-replicate and
  // two lane operations instead of widening each element and replicating it.
  static Pair broadcast(const bf16_t* pair) {
    uint32_t bits;
    std::memcpy(&bits, pair, sizeof(bits));
    return Bf16::split(U4{} + bits);
  }
  static void madd(Acc& acc, const Pair& x, const Pair& w) { Bf16::madd(acc, x, w); }
};

#elif MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_avx2

// Pairs widened by shifting, as Dot<bf16_t> does: the even element of a 32-bit pair is its
// low half shifted up, the odd one the pair with the low half cleared.
struct PairDot {
  static constexpr int kLanes = 8;
  // 16 ymm registers: 8 accumulators, a widened weight vector, a widened token pair. Each
  // accumulator takes a chain of two dependent FMAs per pair (8 cycles on Zen 3), so a tile
  // needs all 8 to keep both FMA pipes busy: 8 vectors x 1 token, 4 x 2, 2 x 4. With the
  // 2 x 1 tile that one token got before, T = 1 took 3x the nn.Linear layout's time there.
  static constexpr int kVectors = 8, kTokens = 4, kAccumulators = 8;
  static constexpr int kRegisters = 16, kPairRegisters = 2;
  using Acc = __m256;
  struct Pair {
    __m256 even, odd;
  };
  static Acc zero() { return _mm256_setzero_ps(); }
  static Acc load_acc(const float* p) { return _mm256_loadu_ps(p); }
  static void store_acc(Acc a, float* p) { _mm256_storeu_ps(p, a); }
  static Pair split(__m256i v) {
    return {_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
            _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int32_t(0xffff0000u))))};
  }
  using Lanes = __m256i;  // all ones in the lanes to load
  static Lanes lanes_mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static Pair load_weight(const bf16_t* p) {
    return split(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static Pair load_weight(const bf16_t* p, Lanes lanes) {
    return split(_mm256_maskload_epi32(reinterpret_cast<const int*>(p), lanes));
  }
  // The pair's 32 bits in every lane, split like a weight vector: one load-and-replicate and
  // two lane operations, where a scalar widening of each element took four.
  static Pair broadcast(const bf16_t* pair) {
    int32_t bits;
    std::memcpy(&bits, pair, sizeof(bits));
    return split(_mm256_set1_epi32(bits));
  }
  static void madd(Acc& acc, const Pair& x, const Pair& w) {
    acc = _mm256_fmadd_ps(x.odd, w.odd, _mm256_fmadd_ps(x.even, w.even, acc));
  }
};

#else  // avx512, avx512bf16

struct PairDotAvx512 {
  static constexpr int kLanes = 16;
  using Acc = __m512;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc load_acc(const float* p) { return _mm512_loadu_ps(p); }
  static void store_acc(Acc a, float* p) { _mm512_storeu_ps(p, a); }
  using Lanes = __mmask16;
  static Lanes lanes_mask(int n) { return mask16(n); }
  static __m512i load_pairs(const bf16_t* p) { return _mm512_loadu_si512(p); }
  static __m512i load_pairs(const bf16_t* p, Lanes lanes) {
    return _mm512_maskz_loadu_epi32(lanes, p);
  }
};

#if MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_avx512bf16

// One vdpbf16ps per vector of experts and token: 4 x 4 accumulators. With the weight in the
// LLC, 4 x 6 and 2 x 8 were within 3% of it at T = 16..256; from DRAM 2 x 8 took 1.4x its
// time (each register tile streams half of every pair row), and 1 x 16 (16 token row
// pointers: more than the general registers) 6x.
struct PairDot : PairDotAvx512 {
  static constexpr int kVectors = 4, kTokens = 4, kAccumulators = 16;
  static constexpr int kRegisters = 32, kPairRegisters = 1;
  using Pair = __m512bh;
  template <typename... Lanes>
  static Pair load_weight(const bf16_t* p, Lanes... lanes) {
    __m512i v = load_pairs(p, lanes...);
    asm("" : "+v"(v));  // kept in a register across the tokens (see Dot<bf16_t>::load)
    return Pair(v);
  }
  static Pair broadcast(const bf16_t* pair) {
    int32_t bits;
    std::memcpy(&bits, pair, sizeof(bits));
    return Pair(_mm512_set1_epi32(bits));
  }
  static void madd(Acc& acc, Pair x, Pair w) { acc = _mm512_dpbf16_ps(acc, x, w); }
};

#else

// Widened by shifting; a weight vector is two registers: 4 x 4 accumulators, 8 + 2 operands.
struct PairDot : PairDotAvx512 {
  static constexpr int kVectors = 4, kTokens = 4, kAccumulators = 16;
  static constexpr int kRegisters = 32, kPairRegisters = 2;
  struct Pair {
    __m512 even, odd;
  };
  template <typename... Lanes>
  static Pair load_weight(const bf16_t* p, Lanes... lanes) {
    const __m512i v = load_pairs(p, lanes...);
    return {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
            _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int32_t(0xffff0000u))))};
  }
  static Pair broadcast(const bf16_t* pair) {
    return {_mm512_set1_ps(to_float(pair[0])), _mm512_set1_ps(to_float(pair[1]))};
  }
  static void madd(Acc& acc, const Pair& x, const Pair& w) {
    acc = _mm512_fmadd_ps(x.odd, w.odd, _mm512_fmadd_ps(x.even, w.even, acc));
  }
};

#endif
#endif

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
// in the thread's scratch. Measured with a prototype of this kernel at H = 7168, E = 256,
// T = 16..256, weight in the LLC: 128, 256 and 512 pairs within 3% of each other, 64 pairs
// 3-5% slower, whole rows 1.4-1.6x the time.
constexpr int64_t kChunkPairs = 256;
// Tokens per sweep over the weight: bounds the scratch at kSweepTokens x kTile floats.
constexpr int64_t kSweepTokens = 256;

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
// heuristics, acc stayed an array in memory, stored back after every pair (2x the time).
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
  // accumulators, the pairs and one weight vector: 12 and 14 registers of 16): on Zen 3 T = 1
  // and 2 took 0.85x and 0.7x the time of holding the weights (E = 256 and 384, H = 7168).
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
  // library call was kept in memory all along (GCC 12 spilled 6 of AVX2's 8 in the pair loop).
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
// sweep of tokens, so each tile's weight comes from memory once per sweep.
template <typename Out>
void run(const RouterGemmParams& p, int64_t expert_begin, int64_t expert_end) {
  using D = PairDot;
  const int64_t pairs = (p.hidden_size + 1) / 2;
  const bf16_t* weight = static_cast<const bf16_t*>(p.weight);
  const bf16_t* hidden = static_cast<const bf16_t*>(p.hidden_states);
  for (int64_t t0 = 0; t0 < p.num_tokens; t0 += kSweepTokens) {
    const int64_t tokens = std::min(kSweepTokens, p.num_tokens - t0);
    const bool one_pass = tokens <= D::kTokens;  // the accumulators never leave registers
    const int64_t per_tile = tile_vectors(std::min<int64_t>(tokens, D::kTokens));
    const int64_t chunk = one_pass ? std::max<int64_t>(pairs, 1) : kChunkPairs;
    float* partial =
        one_pass ? nullptr : reinterpret_cast<float*>(thread_scratch(tokens * kTile));
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

template <typename In, typename Out>
void run(const RouterGemmParams& p, int64_t expert_begin, int64_t expert_end) {
  if constexpr (std::is_same_v<In, bf16_t>) {
    if (p.weight_prepacked) {
      packed::run<Out>(p, expert_begin, expert_end);
      return;
    }
  }
#if MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_avx512bf16
  if constexpr (std::is_same_v<In, bf16_t>) {
    const int64_t done = lanes::run<Out>(p, expert_begin, expert_end);
    if (done == p.num_tokens) return;
    RouterGemmParams rest = p;
    rest.hidden_states = static_cast<const In*>(p.hidden_states) + done * p.hidden_row_stride;
    rest.logits = static_cast<Out*>(p.logits) + done * p.logits_row_stride;
    rest.num_tokens = p.num_tokens - done;
    run_tiles<In, Out>(rest, expert_begin, expert_end);
    return;
  }
#endif
  run_tiles<In, Out>(p, expert_begin, expert_end);
}

template <typename In>
void run_for_output(const RouterGemmParams& p, int64_t expert_begin, int64_t expert_end) {
  switch (p.logits_dtype) {
    case DType::kBFloat16:
      run<In, bf16_t>(p, expert_begin, expert_end);
      return;
    case DType::kFloat32:
    case DType::kFloat16:  // rejected by the bindings
      run<In, float>(p, expert_begin, expert_end);
      return;
  }
}

}  // namespace

void router_gemm(const RouterGemmParams& p, int64_t expert_begin, int64_t expert_end) {
  switch (p.input_dtype) {
    case DType::kBFloat16:
      run_for_output<bf16_t>(p, expert_begin, expert_end);
      return;
    case DType::kFloat16:
      run_for_output<fp16_t>(p, expert_begin, expert_end);
      return;
    case DType::kFloat32:
      run_for_output<float>(p, expert_begin, expert_end);
      return;
  }
}

int router_gemm_expert_block() { return kExpertBlock; }

}  // namespace moeext::cpu::MOEEXT_CPU_ISA
