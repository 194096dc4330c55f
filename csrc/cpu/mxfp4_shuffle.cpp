// The MXFP4 shuffles are pure data movement: 16-byte chunks (weights) and bytes (scales).
// 16-byte memcpy compiles to one unaligned vector load and store on every x86-64 and Arm,
// so there is no per-ISA copy of this file. The shuffles write their output sequentially; the
// unshuffles read sequentially and write a band's (or tile's) rows in turn.
#include <algorithm>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>  // SSE2; _mm_prefetch comes with it
#endif
#if defined(MOEEXT_HAVE_AVX2) && defined(__x86_64__)
#include <immintrin.h>
#define MOEEXT_E8M0_AVX2 1
#endif

#include "host_device/shuffle_maps.h"
#include "moeext/mxfp4_shuffle.h"

namespace moeext {
namespace {

using host_device::E8m0TilePosition;
using host_device::e8m0_block_offset;
using host_device::e8m0_tile_position;
using host_device::gate_up_source_row;
using host_device::kE8m0BlockBytes;
using host_device::kShuffleChunkBytes;
using host_device::shuffled_chunk_index;

constexpr uint8_t kPadScale = 0x7F;  // 2^0: AITER leaves pad scales uninitialised; 1.0 is never NaN

// One band of band rows: all its band x 16-byte tiles. kShuffle picks the copy direction.
template <bool kShuffle>
void move_band(const ShuffleWeightParams& p, int64_t band_index) {
  const int64_t bands_per_batch = p.rows / p.band;
  const int64_t b = band_index / bands_per_batch;
  const int64_t n0 = band_index % bands_per_batch;
  const int64_t chunks = p.row_bytes / kShuffleChunkBytes;
  unsigned char* const shuffled = static_cast<unsigned char*>(p.shuffled);
  // Pointers to the band's logical rows, resolved once (gate/up interleave included).
  unsigned char* rows[kMaxShuffleBand];
  for (int64_t n1 = 0; n1 < p.band; ++n1) {
    const int64_t n = n0 * p.band + n1;
    const int64_t src_row = p.gate_up ? gate_up_source_row(n, p.rows) : n;
    rows[n1] = const_cast<unsigned char*>(static_cast<const unsigned char*>(p.logical)) +
               b * p.logical_batch_stride + src_row * p.logical_row_stride;
  }
  // The sizes as locals: the copies may write anywhere, p included as far as the compiler
  // knows, and re-reading them each chunk kept the index from reducing to an increment.
  const int64_t band = p.band;
  const int64_t logical_rows = p.rows;
  for (int64_t kc = 0; kc < chunks; ++kc) {
    for (int64_t n1 = 0; n1 < band; ++n1) {
      unsigned char* tile =
          shuffled +
          shuffled_chunk_index(b, n0, n1, kc, logical_rows, chunks, band) * kShuffleChunkBytes;
      unsigned char* row = rows[n1] + kc * kShuffleChunkBytes;
      if constexpr (kShuffle) {
        std::memcpy(tile, row, kShuffleChunkBytes);
      } else {
        std::memcpy(row, tile, kShuffleChunkBytes);
      }
    }
  }
}

// Shuffled byte q of a block comes from byte row * 8 + col of its 32 x 8 tile (row-major),
// as a table: e8m0_tile_position's map, used where no vector permutation below applies.
// In SPEC's terms row i = h*16 + c4 and column j = e*4 + f, for q = f*64 + c4*4 + e*2 + h.
struct TileSource {
  uint8_t index[kE8m0BlockBytes];
};
constexpr TileSource make_tile_source() {
  TileSource t{};
  for (int q = 0; q < kE8m0BlockBytes; ++q) {
    const E8m0TilePosition position = e8m0_tile_position(q);
    t.index[q] = uint8_t(position.row * 8 + position.col);
  }
  return t;
}
constexpr TileSource kTileSource = make_tile_source();

// The 256-byte block of one tile (row i = h*16 + c4 is the 8 bytes at rows[i]). With SSE2 (every x86-64):
// interleaving row c4 with row 16 + c4 bytewise gives the pairs (h = 0, h = 1) of each column;
// pairing column f with column 4 + f makes the 4-byte word q_f that lands at f*64 + c4*4;
// a 4x4 transpose of those words over four rows c4 then yields 16 contiguous output bytes.
#if defined(__SSE2__)
// The words q_f of one row pair from its bytewise interleave (pairs p0..p7 in the low half).
inline __m128i pair_words(__m128i pairs) {
  return _mm_unpacklo_epi16(pairs, _mm_srli_si128(pairs, 8));  // q_f = (p_f, p_{4+f})
}

// Rows c4 = 4g..4g+3 (their words in q) -> the 16 bytes at out + f*64 + g*16 for each f.
inline void store_word_group(const __m128i* q, uint8_t* out, int g) {
  const __m128i t0 = _mm_unpacklo_epi32(q[0], q[1]), t1 = _mm_unpacklo_epi32(q[2], q[3]);
  const __m128i t2 = _mm_unpackhi_epi32(q[0], q[1]), t3 = _mm_unpackhi_epi32(q[2], q[3]);
  const __m128i by_f[4] = {_mm_unpacklo_epi64(t0, t1), _mm_unpackhi_epi64(t0, t1),
                           _mm_unpacklo_epi64(t2, t3), _mm_unpackhi_epi64(t2, t3)};
  for (int f = 0; f < 4; ++f) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + f * 64 + g * 16), by_f[f]);
  }
}
#endif

inline void permute_tile(const uint8_t* const* rows, uint8_t* out) {
#if defined(__SSE2__)
  for (int g = 0; g < 4; ++g) {
    __m128i q[4];
    for (int r = 0; r < 4; ++r) {
      const int c4 = g * 4 + r;
      const __m128i lo = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rows[c4]));
      const __m128i hi = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rows[16 + c4]));
      q[r] = pair_words(_mm_unpacklo_epi8(lo, hi));
    }
    store_word_group(q, out, g);
  }
#else
  for (int q = 0; q < kE8m0BlockBytes; ++q) {
    const int i = kTileSource.index[q] / 8, j = kTileSource.index[q] % 8;
    out[q] = rows[i][j];
  }
#endif
}

// Source of the block after the current one, when its halves are dense rows (half_bytes 0:
// nothing to prefetch).
struct NextBlock {
  const uint8_t* top = nullptr;
  const uint8_t* bottom = nullptr;
  int64_t half_bytes = 0;
};

#if defined(__SSE2__)
// The tiles read 32 rows side by side, a pattern the hardware prefetchers do not follow
// (docs/notes/bindings-and-shuffles.md). So while the current block's tiles are
// permuted, the next block's two halves are prefetched in even slices, one per tile done.
class BlockPrefetch {
 public:
  BlockPrefetch(const NextBlock& next, int64_t tiles)
      : next_(next), per_tile_((next.half_bytes + std::max<int64_t>(tiles, 1) - 1) /
                               std::max<int64_t>(tiles, 1)) {}
  // Called with the number of tiles done so far (counting the ones about to be permuted).
  void up_to(int64_t tiles_done) {
    const int64_t end = std::min(next_.half_bytes, tiles_done * per_tile_);
    for (; fetched_ < end; fetched_ += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(next_.top + fetched_), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(next_.bottom + fetched_), _MM_HINT_T0);
    }
  }

 private:
  const NextBlock& next_;
  int64_t per_tile_;
  int64_t fetched_ = 0;
};
#endif

#if MOEEXT_E8M0_AVX2
// Outputs from this size up are written with non-temporal stores. They leave the cache anyway,
// and a plain store first reads the line it writes; below it, streaming measured no faster
// (docs/notes/bindings-and-shuffles.md).
constexpr int64_t kStreamingStoreBytes = int64_t(8) << 20;

// The loop of permute_strided_tiles below on AVX2, four tiles per 32-byte load: every unpack
// works within 128-bit lanes, so lane 0 carries tiles d and d+1 and lane 1 tiles d+2 and d+3
// through the same steps, and one vpshufb replaces the shift-and-unpack of pair_words.
// With stream (dst 32-byte aligned), the four tiles are put together in a buffer in L1 and
// then streamed out: their 16-byte pieces go to 16 cache lines at once, more lines than
// write combining holds open. Returns the tiles done.
__attribute__((target("avx2"))) int64_t permute_strided_tiles_avx2(
    const uint8_t* top, const uint8_t* bottom, int64_t row_stride, int64_t tiles, uint8_t* dst,
    BlockPrefetch& prefetch, bool stream) {
  const __m256i words = _mm256_broadcastsi128_si256(
      _mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15));
  alignas(32) uint8_t staged[1024];
  int64_t d = 0;
  for (; d + 4 <= tiles; d += 4, dst += 1024) {
    uint8_t* out = stream ? staged : dst;
    prefetch.up_to(d + 4);
    for (int g = 0; g < 4; ++g) {
      __m256i q[2][4];  // [tiles d, d+2 | tiles d+1, d+3][row c4 = 4g + r]
      for (int r = 0; r < 4; ++r) {
        const int64_t at = (g * 4 + r) * row_stride + d * 8;
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(top + at));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bottom + at));
        q[0][r] = _mm256_shuffle_epi8(_mm256_unpacklo_epi8(lo, hi), words);
        q[1][r] = _mm256_shuffle_epi8(_mm256_unpackhi_epi8(lo, hi), words);
      }
      for (int i = 0; i < 2; ++i) {
        const __m256i t0 = _mm256_unpacklo_epi32(q[i][0], q[i][1]);
        const __m256i t1 = _mm256_unpacklo_epi32(q[i][2], q[i][3]);
        const __m256i t2 = _mm256_unpackhi_epi32(q[i][0], q[i][1]);
        const __m256i t3 = _mm256_unpackhi_epi32(q[i][2], q[i][3]);
        const __m256i by_f[4] = {_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1),
                                 _mm256_unpacklo_epi64(t2, t3), _mm256_unpackhi_epi64(t2, t3)};
        uint8_t* tile = out + i * 256 + g * 16;
        for (int f = 0; f < 4; ++f) {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(tile + f * 64),
                           _mm256_castsi256_si128(by_f[f]));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(tile + 512 + f * 64),
                           _mm256_extracti128_si256(by_f[f], 1));
        }
      }
    }
    if (stream) {
      for (int i = 0; i < 1024; i += 32) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                            _mm256_load_si256(reinterpret_cast<const __m256i*>(staged + i)));
      }
    }
  }
  return d;
}
#endif

// The common block: rows 0..15 at top + c4 * row_stride, rows 16..31 at bottom + c4 *
// row_stride (gate/up interleaving keeps each 16-row half evenly strided), columns contiguous,
// tiles [0, tiles) all inside the row. Addresses come from two bases and one stride instead
// of a table of 32 row pointers per tile (which cost more than the permutation), and one
// 16-byte load per row feeds two tiles. stream: see permute_strided_tiles_avx2.
inline void permute_strided_tiles(const uint8_t* top, const uint8_t* bottom, int64_t row_stride,
                                  int64_t tiles, uint8_t* out, const NextBlock& next,
                                  bool stream) {
  int64_t d = 0;
#if defined(__SSE2__)
  BlockPrefetch prefetch(next, tiles);
#if MOEEXT_E8M0_AVX2
  if (cpu_isa_active() != CpuIsa::kPortable) {
    d = permute_strided_tiles_avx2(top, bottom, row_stride, tiles, out, prefetch, stream);
    out += d * kE8m0BlockBytes;
  }
#else
  (void)stream;
#endif
  for (; d + 2 <= tiles; d += 2, out += 512) {
    prefetch.up_to(d + 2);
    for (int g = 0; g < 4; ++g) {
      __m128i first[4], second[4];
      for (int r = 0; r < 4; ++r) {
        const int64_t at = (g * 4 + r) * row_stride + d * 8;
        const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(top + at));
        const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bottom + at));
        first[r] = pair_words(_mm_unpacklo_epi8(lo, hi));
        second[r] = pair_words(_mm_unpackhi_epi8(lo, hi));
      }
      store_word_group(first, out, g);
      store_word_group(second, out + 256, g);
    }
  }
#else
  (void)next;
  (void)stream;
#endif
  for (; d < tiles; ++d, out += kE8m0BlockBytes) {
    const uint8_t* rows[32];
    for (int64_t c4 = 0; c4 < 16; ++c4) {
      rows[c4] = top + c4 * row_stride + d * 8;
      rows[16 + c4] = bottom + c4 * row_stride + d * 8;
    }
    permute_tile(rows, out);
  }
}

// Padded row r of the (interleaved) scale matrix -> source row, or -1 for padding.
inline int64_t scale_source_row(const E8m0ShuffleParams& p, int64_t r) {
  if (r >= p.m) return -1;
  return p.rows_per_expert > 0 ? gate_up_source_row(r, p.rows_per_expert) : r;
}

}  // namespace

void shuffle_weight_cpu(const ShuffleWeightParams& p, int64_t band_begin, int64_t band_end) {
  for (int64_t i = band_begin; i < band_end; ++i) move_band<true>(p, i);
}

void unshuffle_weight_cpu(const ShuffleWeightParams& p, int64_t band_begin, int64_t band_end) {
  for (int64_t i = band_begin; i < band_end; ++i) move_band<false>(p, i);
}

void e8m0_shuffle_cpu(const E8m0ShuffleParams& p, int64_t block_begin, int64_t block_end) {
#if MOEEXT_E8M0_AVX2
  const bool stream = p.padded_m * p.padded_n >= kStreamingStoreBytes &&
                      reinterpret_cast<uintptr_t>(p.shuffled) % 32 == 0;
#else
  constexpr bool stream = false;
#endif
  for (int64_t a = block_begin; a < block_end; ++a) {
    const uint8_t* src_rows[32];
    for (int64_t i = 0; i < 32; ++i) {
      const int64_t src = scale_source_row(p, a * 32 + i);
      src_rows[i] = src < 0 ? nullptr : p.scale + src * p.row_stride;
    }
    // Blocks (a, 0), (a, 1), ... follow each other.
    uint8_t* out = p.shuffled + e8m0_block_offset(a, 0, p.padded_n);
    bool all_rows = true;
    bool strided_halves = p.col_stride == 1;
    for (int64_t i = 0; i < 32; ++i) {
      all_rows = all_rows && src_rows[i] != nullptr;
      strided_halves = strided_halves && all_rows &&
                       src_rows[i] == src_rows[i & 16] + (i & 15) * p.row_stride;
    }
    int64_t d = 0;
    if (strided_halves) {
      d = p.n / 8;  // the tiles whose 8 columns all exist
      NextBlock next;
      const int64_t next_top = scale_source_row(p, a * 32 + 32);
      const int64_t next_bottom = scale_source_row(p, a * 32 + 48);
      if (a + 1 < block_end && p.row_stride == p.n && next_top >= 0 && next_bottom >= 0) {
        next = {p.scale + next_top * p.row_stride, p.scale + next_bottom * p.row_stride,
                16 * p.row_stride};
      }
      permute_strided_tiles(src_rows[0], src_rows[16], p.row_stride, d, out, next, stream);
      out += d * kE8m0BlockBytes;
    }
    for (; d < p.padded_n / 8; ++d, out += kE8m0BlockBytes) {
      const int64_t c0 = d * 8;
      const uint8_t* rows[32];
      uint8_t tile[kE8m0BlockBytes];  // padded copy, only for edge tiles and strided columns
      if (all_rows && c0 + 8 <= p.n && p.col_stride == 1) {
        for (int64_t i = 0; i < 32; ++i) rows[i] = src_rows[i] + c0;
      } else {
        for (int64_t i = 0; i < 32; ++i) {
          for (int64_t j = 0; j < 8; ++j) {
            const int64_t c = c0 + j;
            tile[i * 8 + j] = (src_rows[i] != nullptr && c < p.n)
                                  ? src_rows[i][c * p.col_stride]
                                  : kPadScale;
          }
          rows[i] = tile + i * 8;
        }
      }
      permute_tile(rows, out);
    }
  }
#if MOEEXT_E8M0_AVX2
  // Non-temporal stores are weakly ordered: make them visible before the caller's join.
  if (stream) _mm_sfence();
#endif
}

void e8m0_unshuffle_cpu(const E8m0ShuffleParams& p, int64_t block_begin, int64_t block_end) {
  for (int64_t a = block_begin; a < block_end; ++a) {
    // Blocks (a, 0), (a, 1), ... follow each other.
    const uint8_t* in = p.shuffled_in + e8m0_block_offset(a, 0, p.padded_n);
    uint8_t* dst_rows[32];
    for (int64_t i = 0; i < 32; ++i) {
      const int64_t dst = scale_source_row(p, a * 32 + i);
      dst_rows[i] = dst < 0 ? nullptr : p.unshuffled + dst * p.n;
    }
    for (int64_t d = 0; d < p.padded_n / 8; ++d, in += kE8m0BlockBytes) {
      uint8_t tile[kE8m0BlockBytes];
      for (int q = 0; q < kE8m0BlockBytes; ++q) tile[kTileSource.index[q]] = in[q];
      const int64_t c0 = d * 8;
      const int64_t width = p.n - c0 < 8 ? p.n - c0 : 8;
      for (int64_t i = 0; i < 32; ++i) {
        if (dst_rows[i] != nullptr) std::memcpy(dst_rows[i] + c0, tile + i * 8, size_t(width));
      }
    }
  }
}

}  // namespace moeext
