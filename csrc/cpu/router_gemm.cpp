// Router GEMM on the CPU (SPEC.md section 2). Compiled once per ISA; see cpu/vec.h.
//
// The weight [E, H] is read in its nn.Linear layout: no packing step (a packed layout would
// not cut the loads per dot product, which is what bounds this kernel, see TileShape). A
// tile is kExperts weight rows x kTokens tokens whose fp32 accumulators stay in registers.
// The caller's expert range is walked one tile row at a time, and every token block reuses
// those weight rows while they are in L1/L2, so each weight row comes from memory once per
// call however many tokens there are. Each accumulator holds per-lane partial sums, reduced
// once at the end (a few instructions per logit against H/32 dot steps).
//
// The per-ISA "Dot" types say how kStep consecutive elements of one token and one weight row
// enter an accumulator:
//   avx512bf16  vdpbf16ps: 32 bf16 pairs per instruction. It reads bf16 denormals as zero and
//               flushes denormal results, which moves a logit by < 2^-126.
//   avx512      bf16 widened by shifting: the even elements are the 32-bit lanes shifted left
//               by 16, the odd ones the lanes with the low half cleared; both operands split
//               the same way, so two FMAs cover 32 elements with no permutation.
//   avx2        the same at 16 elements per step, in 16 ymm registers (smaller tiles).
//   scalar      one element at a time.
// fp16 and fp32 inputs widen to fp32 (vcvtph2ps) and use FMAs on the vector paths. Products of
// two bf16 or two fp16 values are exact in fp32; only the accumulation rounds.
// GCC 12's AVX-512 headers start shifts and extracts from a self-initialised "undefined"
// vector and then warn about it once inlined (GCC bug 105593, fixed in 12.3).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>

#include "cpu/isa_id.h"
#include "cpu/router_gemm_isa.h"
#include "cpu/types.h"

#if MOEEXT_ISA_ID(MOEEXT_CPU_ISA) != MOEEXT_ISA_scalar
#include <immintrin.h>
#endif

namespace moeext::cpu::MOEEXT_CPU_ISA {
namespace {

#if MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_scalar

template <typename T>
struct Dot {
  static constexpr int kStep = 1;
  using Acc = float;
  using Operand = float;
  static Acc zero() { return 0.0f; }
  static Operand load(const T* p) { return to_float(*p); }
  static Operand load_tail(const T* p, int64_t /*n >= 1*/) { return to_float(*p); }
  static void madd(Acc& acc, Operand x, Operand w) { acc += x * w; }
  static float reduce(Acc acc) { return acc; }
};

#elif MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_avx2

// AVX2 has no 16-bit masked loads: the last partial step reads a zero-padded copy.
template <typename T, int N>
inline const T* zero_padded(const T* p, int64_t n, T (&buffer)[N]) {
  std::memset(buffer, 0, sizeof(buffer));
  std::memcpy(buffer, p, size_t(n) * sizeof(T));
  return buffer;
}

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
#if MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_avx2
  // 16 ymm registers: 4 x 2 (3 x 2 with two-register bf16 operands).
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
  for (int t = 0; t < TB; ++t) {
    x[t] = static_cast<const In*>(p.hidden_states) + (token + t) * p.hidden_row_stride;
  }
  for (int r = 0; r < R; ++r) {
    w[r] = static_cast<const In*>(p.weight) + (expert + r) * p.weight_row_stride;
  }
  typename D::Acc acc[TB][R];
  for (int t = 0; t < TB; ++t) {
    for (int r = 0; r < R; ++r) {
      acc[t][r] = first ? D::zero() : partial[t * Shape::kExperts + r];
    }
  }
  int64_t h = h_begin;
  for (; h + D::kStep <= h_end; h += D::kStep) {
    typename D::Operand wv[R];
    for (int r = 0; r < R; ++r) wv[r] = D::load(w[r] + h);
    for (int t = 0; t < TB; ++t) {
      const typename D::Operand xv = D::load(x[t] + h);
      for (int r = 0; r < R; ++r) D::madd(acc[t][r], xv, wv[r]);
    }
  }
  if (h < h_end) {
    // Only the last pass has a tail. Both operands load zeros past H: exact zeros added.
    typename D::Operand wv[R];
    for (int r = 0; r < R; ++r) wv[r] = D::load_tail(w[r] + h, h_end - h);
    for (int t = 0; t < TB; ++t) {
      const typename D::Operand xv = D::load_tail(x[t] + h, h_end - h);
      for (int r = 0; r < R; ++r) D::madd(acc[t][r], xv, wv[r]);
    }
  }
  if (!last) {
    for (int t = 0; t < TB; ++t) {
      for (int r = 0; r < R; ++r) partial[t * Shape::kExperts + r] = acc[t][r];
    }
    return;
  }
  for (int t = 0; t < TB; ++t) {
    Out* out = static_cast<Out*>(p.logits) + (token + t) * p.logits_row_stride + expert;
    for (int r = 0; r < R; ++r) store_logit(D::reduce(acc[t][r]), out + r);
  }
}

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
void run(const RouterGemmParams& p, int64_t expert_begin, int64_t expert_end) {
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
