// Host unit test of csrc/host_device/shuffle_maps.h, the index maps of the MXFP4 shuffle
// kernels (CPU and GPU), and of csrc/gpu/shuffle_threads.h: each map against SPEC.md section
// 3's formulas written out literally, each pair of maps as mutual inverses (bijections), and
// the decompositions the GPU kernels use (thread slots, 16-row halves, 16-byte pieces of a
// 256-byte block) replayed on random bytes against a literal SPEC reference.
#include <cstdint>
#include <cstdio>
#include <random>
#include <utility>
#include <vector>

#include "check.h"
#include "gpu/shuffle_threads.h"
#include "host_device/shuffle_maps.h"

namespace gpu = moeext::gpu;
namespace maps = moeext::host_device;
using moeext::host_device::gate_up_source_row;

namespace {

using ll = long long;

// SPEC: "rows g0..g15, u0..u15, g16..g31, u16..u31, ..." inside each group of 2N rows.
int64_t spec_interleaved_source(int64_t n, int64_t rows_per_group) {
  const int64_t group = n / rows_per_group, local = n % rows_per_group;
  const int64_t block = local / 16;
  const int64_t half = rows_per_group / 2;
  const int64_t in_half = (block / 2) * 16 + local % 16;
  return group * rows_per_group + (block % 2 == 0 ? in_half : half + in_half);
}

void test_gate_up_rows() {
  for (int64_t rows_per_group : {32, 64, 96, 256, 4096}) {
    for (int64_t groups : {1, 3}) {
      const int64_t total = groups * rows_per_group;
      std::vector<int> hit(size_t(total), 0);
      for (int64_t n = 0; n < total; ++n) {
        const int64_t source = gate_up_source_row(n, rows_per_group);
        CHECK(source == spec_interleaved_source(n, rows_per_group),
              "gate_up_source_row(%lld, %lld) = %lld, SPEC says %lld", ll(n), ll(rows_per_group),
              ll(source), ll(spec_interleaved_source(n, rows_per_group)));
        if (source < 0 || source >= total) continue;
        ++hit[size_t(source)];
        const int64_t back = maps::gate_up_interleaved_row(source, rows_per_group);
        CHECK(back == n, "gate_up_interleaved_row(%lld, %lld) = %lld, want %lld", ll(source),
              ll(rows_per_group), ll(back), ll(n));
        // The e8m0 kernel reads a 16-row block as one contiguous run of source rows.
        const int64_t block_start = n - n % 16;
        CHECK(gate_up_source_row(block_start, rows_per_group) + n % 16 == source,
              "row %lld of group %lld: its 16-row block is not contiguous", ll(n),
              ll(rows_per_group));
      }
      for (int64_t r = 0; r < total; ++r) {
        CHECK(hit[size_t(r)] == 1, "rows_per_group %lld: source row %lld hit %d times",
              ll(rows_per_group), ll(r), hit[size_t(r)]);
      }
    }
  }
}

// ----- shuffle_weight ------------------------------------------------------------------

// SPEC's element formula with 16-row bands, C = 16 / element_size elements per chunk:
//   out.flat[b][((n0 * (K / C) + kc) * 16 + n1) * C + j] = w[b][n0 * 16 + n1][kc * C + j]
// returned as the byte offset in the whole output of byte `byte` of element (n, k).
int64_t spec_weight_offset(int64_t b, int64_t n, int64_t k, int64_t byte, int64_t rows,
                           int64_t k_elements, int64_t element_size) {
  const int64_t c = 16 / element_size;
  const int64_t n0 = n / 16, n1 = n % 16, kc = k / c, j = k % c;
  const int64_t element = ((n0 * (k_elements / c) + kc) * 16 + n1) * c + j;
  return (b * rows * k_elements + element) * element_size + byte;
}

// The header's byte form with any band (mxfp4_shuffle.h):
//   shuffled[((n0 * (row_bytes / 16) + kc) * band + n1) * 16 + byte] = logical[n0*band + n1][kc*16 + byte]
int64_t header_weight_offset(int64_t b, int64_t n, int64_t x, int64_t rows, int64_t row_bytes,
                             int64_t band) {
  const int64_t n0 = n / band, n1 = n % band, kc = x / 16, byte = x % 16;
  return b * rows * row_bytes + ((n0 * (row_bytes / 16) + kc) * band + n1) * 16 + byte;
}

int64_t map_weight_offset(int64_t b, int64_t n, int64_t x, int64_t rows, int64_t row_bytes,
                          int64_t band) {
  return maps::shuffled_chunk_index(b, n / band, n % band, x / 16, rows, row_bytes / 16, band) *
             maps::kShuffleChunkBytes +
         x % 16;
}

void test_weight_spec_formula() {
  for (int64_t element_size : {1, 2}) {
    for (int64_t batch : {1, 2}) {
      for (int64_t rows : {16, 32, 48}) {
        for (int64_t k_elements : {32, 64, 96}) {
          const int64_t row_bytes = k_elements * element_size;
          for (int64_t b = 0; b < batch; ++b) {
            for (int64_t n = 0; n < rows; ++n) {
              for (int64_t k = 0; k < k_elements; ++k) {
                for (int64_t byte = 0; byte < element_size; ++byte) {
                  const int64_t x = k * element_size + byte;
                  const int64_t want =
                      spec_weight_offset(b, n, k, byte, rows, k_elements, element_size);
                  const int64_t got = map_weight_offset(b, n, x, rows, row_bytes, 16);
                  if (got != want) {
                    CHECK(got == want,
                          "element size %lld, [%lld, %lld, %lld]: element (%lld, %lld, %lld) "
                          "byte %lld at %lld, SPEC says %lld",
                          ll(element_size), ll(batch), ll(rows), ll(k_elements), ll(b), ll(n),
                          ll(k), ll(byte), ll(got), ll(want));
                    return;
                  }
                }
              }
            }
          }
        }
      }
    }
  }
}

// Any band: the map equals the header's formula and is a bijection whose inverse is
// logical_chunk_of.
void test_weight_bijection(int64_t batch, int64_t rows, int64_t row_bytes, int64_t band) {
  const int64_t chunks_per_row = row_bytes / 16;
  const int64_t total = batch * rows * chunks_per_row;
  std::vector<int> hit(size_t(total), 0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t n = 0; n < rows; ++n) {
      for (int64_t kc = 0; kc < chunks_per_row; ++kc) {
        const int64_t got = map_weight_offset(b, n, kc * 16, rows, row_bytes, band);
        const int64_t want = header_weight_offset(b, n, kc * 16, rows, row_bytes, band);
        if (got != want || got % 16 != 0 || got < 0 || got >= total * 16) {
          CHECK(false, "band %lld: chunk (%lld, %lld, %lld) at %lld, formula says %lld",
                ll(band), ll(b), ll(n), ll(kc), ll(got), ll(want));
          return;
        }
        const int64_t s = got / 16;
        ++hit[size_t(s)];
        const maps::LogicalChunk back = maps::logical_chunk_of(s, rows, chunks_per_row, band);
        CHECK(back.batch == b && back.row == n && back.chunk == kc,
              "band %lld: logical_chunk_of(%lld) = (%lld, %lld, %lld), want (%lld, %lld, %lld)",
              ll(band), ll(s), ll(back.batch), ll(back.row), ll(back.chunk), ll(b), ll(n),
              ll(kc));
      }
    }
  }
  for (int64_t s = 0; s < total; ++s) {
    if (hit[size_t(s)] != 1) {
      CHECK(false, "band %lld, [%lld, %lld, %lld]: shuffled chunk %lld hit %d times", ll(band),
            ll(batch), ll(rows), ll(row_bytes), ll(s), hit[size_t(s)]);
      return;
    }
  }
}

void test_weight_thread_slots() {
  for (int64_t band = 1; band <= 256; ++band) {
    const int threads = gpu::shuffle_block_threads(band);
    CHECK(threads >= 1 && threads <= 256 && threads % band == 0 && threads > 256 - band,
          "band %lld: %d threads", ll(band), threads);
    // The kernel: thread tid keeps row n1 and walks kc = slot.kc, + threads / band, ...;
    // its shuffled chunk must be the band's first + tid + k * threads (coalesced), and every
    // (n1, kc) of the band must be moved once.
    for (int64_t chunks_per_row : {1, 3, 16, 224}) {
      std::vector<int> hit(size_t(band * chunks_per_row), 0);
      const int64_t rows = 2 * band, b = 1, n0 = 1;  // band 1 of batch entry 1
      const int64_t band_first = maps::shuffled_chunk_index(b, n0, 0, 0, rows, chunks_per_row, band);
      for (int tid = 0; tid < threads; ++tid) {
        const gpu::ShuffleThreadSlot slot = gpu::shuffle_thread_slot(tid, int(band));
        int64_t k = 0;
        for (int64_t kc = slot.kc; kc < chunks_per_row; kc += threads / band, ++k) {
          const int64_t s =
              maps::shuffled_chunk_index(b, n0, slot.n1, kc, rows, chunks_per_row, band);
          CHECK(s == band_first + tid + k * threads,
                "band %lld, tid %d, step %lld: chunk %lld is not band start + tid + step",
                ll(band), tid, ll(k), ll(s));
          if (s >= band_first && s < band_first + band * chunks_per_row) {
            ++hit[size_t(s - band_first)];
          }
        }
      }
      for (size_t i = 0; i < hit.size(); ++i) {
        if (hit[i] != 1) {
          CHECK(false, "band %lld, %lld chunks per row: chunk %zu moved %d times", ll(band),
                ll(chunks_per_row), i, hit[i]);
          break;
        }
      }
    }
  }
}

// The kernel's walk (band 16, gate_up) on random bytes against the literal SPEC reference,
// then the inverse walk back.
void test_weight_replay(int64_t batch, int64_t rows, int64_t k_elements, int64_t element_size,
                        bool gate_up, std::mt19937& rng) {
  const int64_t row_bytes = k_elements * element_size;
  const int64_t band = 16;
  std::vector<uint8_t> w(size_t(batch * rows * row_bytes));
  for (uint8_t& v : w) v = uint8_t(rng());
  // SPEC: interleave (gate_up) first, then the element formula.
  std::vector<uint8_t> want(w.size());
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t n = 0; n < rows; ++n) {
      const int64_t source = gate_up ? spec_interleaved_source(n, rows) : n;
      for (int64_t k = 0; k < k_elements; ++k) {
        for (int64_t byte = 0; byte < element_size; ++byte) {
          want[size_t(spec_weight_offset(b, n, k, byte, rows, k_elements, element_size))] =
              w[size_t((b * rows + source) * row_bytes + k * element_size + byte)];
        }
      }
    }
  }
  std::vector<uint8_t> got(w.size(), 0);
  const int64_t chunks_per_row = row_bytes / 16;
  const int threads = gpu::shuffle_block_threads(band);
  for (int64_t g = 0; g < batch * rows / band; ++g) {
    const int64_t b = g / (rows / band), n0 = g % (rows / band);
    for (int tid = 0; tid < threads; ++tid) {
      const gpu::ShuffleThreadSlot slot = gpu::shuffle_thread_slot(tid, int(band));
      const int64_t n = n0 * band + slot.n1;
      const int64_t source = gate_up ? gate_up_source_row(n, rows) : n;
      for (int64_t kc = slot.kc; kc < chunks_per_row; kc += threads / band) {
        const int64_t s = maps::shuffled_chunk_index(b, n0, slot.n1, kc, rows, chunks_per_row, band);
        if (s < 0 || s >= batch * rows * chunks_per_row) {
          CHECK(false, "shuffled chunk %lld is outside the tensor", ll(s));
          return;
        }
        for (int byte = 0; byte < 16; ++byte) {
          got[size_t(s * 16 + byte)] = w[size_t((b * rows + source) * row_bytes + kc * 16 + byte)];
        }
      }
    }
  }
  CHECK(got == want, "shuffle replay [%lld, %lld, %lld] x %lld bytes, gate_up %d differs from SPEC",
        ll(batch), ll(rows), ll(k_elements), ll(element_size), int(gate_up));
  // unshuffle: every shuffled chunk back through logical_chunk_of.
  std::vector<uint8_t> back(w.size(), 0);
  for (int64_t s = 0; s < batch * rows * chunks_per_row; ++s) {
    const maps::LogicalChunk c = maps::logical_chunk_of(s, rows, chunks_per_row, band);
    if (c.batch < 0 || c.batch >= batch || c.row < 0 || c.row >= rows || c.chunk < 0 ||
        c.chunk >= chunks_per_row) {
      CHECK(false, "logical_chunk_of(%lld) = (%lld, %lld, %lld) is outside the tensor", ll(s),
            ll(c.batch), ll(c.row), ll(c.chunk));
      return;
    }
    const int64_t source = gate_up ? gate_up_source_row(c.row, rows) : c.row;
    for (int byte = 0; byte < 16; ++byte) {
      back[size_t((c.batch * rows + source) * row_bytes + c.chunk * 16 + byte)] =
          got[size_t(s * 16 + byte)];
    }
  }
  CHECK(back == w, "unshuffle replay [%lld, %lld, %lld], gate_up %d is not the input",
        ll(batch), ll(rows), ll(k_elements), int(gate_up));
}

// ----- e8m0_shuffle --------------------------------------------------------------------

int64_t spec_e8m0_offset(int64_t r, int64_t c, int64_t sn) {
  const int64_t a = r / 32, h = (r / 16) % 2, c4 = r % 16, d = c / 8, e = (c / 4) % 2, f = c % 4;
  return a * 32 * sn + d * 256 + f * 64 + c4 * 4 + e * 2 + h;
}

void test_e8m0_maps(int64_t m, int64_t n) {
  const int64_t pm = (m + 255) / 256 * 256, pn = (n + 7) / 8 * 8;
  std::vector<int> hit(size_t(pm * pn), 0);
  for (int64_t r = 0; r < pm; ++r) {
    for (int64_t c = 0; c < pn; ++c) {
      const int64_t got = maps::e8m0_shuffled_offset(r, c, pn);
      const int64_t want = spec_e8m0_offset(r, c, pn);
      if (got != want || got < 0 || got >= pm * pn) {
        CHECK(false, "[%lld, %lld]: e8m0_shuffled_offset(%lld, %lld) = %lld, SPEC says %lld",
              ll(m), ll(n), ll(r), ll(c), ll(got), ll(want));
        return;
      }
      ++hit[size_t(got)];
      const maps::E8m0Position back = maps::e8m0_padded_position(got, pn);
      CHECK(back.row == r && back.col == c, "e8m0_padded_position(%lld) = (%lld, %lld), want (%lld, %lld)",
            ll(got), ll(back.row), ll(back.col), ll(r), ll(c));
    }
  }
  for (int64_t o = 0; o < pm * pn; ++o) {
    if (hit[size_t(o)] != 1) {
      CHECK(false, "[%lld, %lld]: shuffled byte %lld hit %d times", ll(m), ll(n), ll(o),
            hit[size_t(o)]);
      return;
    }
  }
  // The shuffle kernel's decomposition: byte o is byte (o % 16) of piece (o % 256) / 16 of
  // block o / 256 = a * (pn / 8) + d; e8m0_tile_position gives its row and column in the
  // 32 x 8 group.
  for (int64_t o = 0; o < pm * pn; ++o) {
    const int64_t block = o / 256;
    const int piece = int(o % 256) / 16, byte = int(o % 16);
    const maps::E8m0TilePosition t = maps::e8m0_tile_position(piece * 16 + byte);
    const int64_t r = (block / (pn / 8)) * 32 + t.row, c = (block % (pn / 8)) * 8 + t.col;
    if (t.row < 0 || t.row >= 32 || t.col < 0 || t.col >= 8 || spec_e8m0_offset(r, c, pn) != o) {
      CHECK(false, "[%lld, %lld]: kernel decomposition of byte %lld gives (%lld, %lld)", ll(m),
            ll(n), ll(o), ll(r), ll(c));
      return;
    }
  }
  // Block (a, d) starts where SPEC puts padded (32a, 8d), and the blocks of a 32-row band
  // follow each other in d (the CPU kernels write them in turn from the band's first).
  for (int64_t a = 0; a < pm / 32; ++a) {
    for (int64_t d = 0; d < pn / 8; ++d) {
      const int64_t got = maps::e8m0_block_offset(a, d, pn);
      CHECK(got == spec_e8m0_offset(a * 32, d * 8, pn) &&
                got == maps::e8m0_shuffled_offset(a * 32, d * 8, pn) &&
                got == maps::e8m0_block_offset(a, 0, pn) + d * maps::kE8m0BlockBytes,
            "[%lld, %lld]: e8m0_block_offset(%lld, %lld) = %lld", ll(m), ll(n), ll(a), ll(d),
            ll(got));
    }
  }
}

// The CPU kernels build their tile table from e8m0_tile_position at compile time.
static_assert(maps::e8m0_tile_position(0).row == 0 && maps::e8m0_tile_position(1).row == 16 &&
                  maps::e8m0_tile_position(64).col == 1 &&
                  maps::e8m0_tile_position(255).row == 31 &&
                  maps::e8m0_tile_position(255).col == 7,
              "e8m0_tile_position is usable in constant expressions");

// Both kernels' walks on random scales (strided, gate_up or not) against SPEC literally.
void test_e8m0_replay(int64_t m, int64_t n, int64_t rows_per_expert, int64_t col_stride,
                      std::mt19937& rng) {
  const int64_t pm = (m + 255) / 256 * 256, pn = (n + 7) / 8 * 8;
  const int64_t row_stride = n * col_stride + 5;  // strided rows and columns
  std::vector<uint8_t> scale(size_t(m * row_stride + 1));
  for (uint8_t& v : scale) v = uint8_t(rng());
  auto at = [&](int64_t r, int64_t c) { return scale[size_t(r * row_stride + c * col_stride)]; };
  // SPEC: interleave per expert, pad with 0x7F, then the block formula.
  std::vector<uint8_t> want(size_t(pm * pn));
  for (int64_t r = 0; r < pm; ++r) {
    for (int64_t c = 0; c < pn; ++c) {
      uint8_t v = 0x7F;
      if (r < m && c < n) {
        v = at(rows_per_expert > 0 ? spec_interleaved_source(r, rows_per_expert) : r, c);
      }
      want[size_t(spec_e8m0_offset(r, c, pn))] = v;
    }
  }
  // e8m0_shuffle_kernel: piece by piece, rows from the two 16-row halves.
  std::vector<uint8_t> got(want.size(), 0);
  const int64_t col_blocks = pn / 8;
  for (int64_t i = 0; i < (pm / 32) * col_blocks * 16; ++i) {
    const int64_t block = i / 16;
    const int piece = int(i % 16);
    const int64_t a = block / col_blocks, d = block % col_blocks;
    int64_t source_half[2];
    for (int h = 0; h < 2; ++h) {
      const int64_t r = a * 32 + h * 16;
      source_half[h] = (rows_per_expert > 0 && r < m) ? gate_up_source_row(r, rows_per_expert) : r;
    }
    for (int byte = 0; byte < 16; ++byte) {
      const maps::E8m0TilePosition t = maps::e8m0_tile_position(piece * 16 + byte);
      const int64_t r = a * 32 + t.row, c = d * 8 + t.col;
      uint8_t v = 0x7F;
      if (t.row < 0 || t.row >= 32 || t.col < 0 || t.col >= 8) {
        CHECK(false, "e8m0_tile_position(%d) = (%d, %d)", piece * 16 + byte, t.row, t.col);
        return;
      }
      if (r < m && c < n) {
        const int64_t source = source_half[t.row / 16] + t.row % 16;
        if (source < 0 || source >= m) {
          CHECK(false, "padded row %lld reads scale row %lld", ll(r), ll(source));
          return;
        }
        v = at(source, c);
      }
      got[size_t(block * 256 + piece * 16 + byte)] = v;
    }
  }
  CHECK(got == want, "e8m0 shuffle replay [%lld, %lld], rows_per_expert %lld, col_stride %lld",
        ll(m), ll(n), ll(rows_per_expert), ll(col_stride));
  // e8m0_unshuffle_kernel: dense [m, n] rows, 8-byte segments.
  std::vector<uint8_t> back(size_t(m * n), 0);
  for (int64_t i = 0; i < m * col_blocks; ++i) {
    const int64_t row = i / col_blocks, d = i % col_blocks;
    const int64_t r = rows_per_expert > 0 ? maps::gate_up_interleaved_row(row, rows_per_expert) : row;
    const int64_t in = maps::e8m0_row_offset(r, pn);
    for (int j = 0; j < 8; ++j) {
      const int64_t c = d * 8 + j;
      const int64_t o = in + maps::e8m0_col_offset(c);
      if (r < 0 || r >= m || o < 0 || o >= pm * pn) {
        CHECK(false, "unshuffle of row %lld reads byte %lld of padded row %lld", ll(row), ll(o),
              ll(r));
        return;
      }
      if (c < n) back[size_t(row * n + c)] = got[size_t(o)];
    }
  }
  bool same = true;
  for (int64_t r = 0; r < m && same; ++r) {
    for (int64_t c = 0; c < n && same; ++c) same = back[size_t(r * n + c)] == at(r, c);
  }
  CHECK(same, "e8m0 unshuffle replay [%lld, %lld], rows_per_expert %lld is not the input", ll(m),
        ll(n), ll(rows_per_expert));
}

}  // namespace

int main() {
  std::mt19937 rng(2024);
  test_gate_up_rows();
  test_weight_spec_formula();
  for (int64_t band : {1, 3, 16, 32, 48, 256}) {
    for (int64_t batch : {1, 3}) {
      for (int64_t row_bytes : {16, 48, 256}) test_weight_bijection(batch, 2 * band, row_bytes, band);
    }
  }
  test_weight_thread_slots();
  for (bool gate_up : {false, true}) {
    for (int64_t element_size : {1, 2}) {
      test_weight_replay(1, 32, 32, element_size, gate_up, rng);
      test_weight_replay(3, 64, 96, element_size, gate_up, rng);
      test_weight_replay(2, 96, 448, element_size, gate_up, rng);
    }
  }
  for (auto [m, n] : {std::pair<int64_t, int64_t>{1, 1}, {37, 11}, {256, 8}, {300, 17},
                      {512, 224}, {64, 3}}) {
    test_e8m0_maps(m, n);
    test_e8m0_replay(m, n, 0, 1, rng);
    test_e8m0_replay(m, n, 0, 3, rng);
  }
  // gate_up: m = experts * rows_per_expert.
  for (auto [experts, rows_per_expert] : {std::pair<int64_t, int64_t>{1, 32}, {3, 64},
                                          {2, 96}, {5, 128}, {1, 512}}) {
    for (int64_t n : {1, 8, 13}) {
      test_e8m0_replay(experts * rows_per_expert, n, rows_per_expert, 1, rng);
      test_e8m0_replay(experts * rows_per_expert, n, rows_per_expert, 2, rng);
    }
  }
  return moeext_test::finish("shuffle maps");
}
