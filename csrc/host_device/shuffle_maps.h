// Index maps of the MXFP4 shuffles (SPEC.md section 3), shared by the CPU kernels
// (csrc/cpu/mxfp4_shuffle.cpp), the GPU kernels (csrc/gpu/mxfp4_shuffle.cu) and their host
// unit test (tests/cpp/test_shuffle_maps.cpp, which checks them against SPEC's formulas).
// Compiled for the host and the GPU alike: no GPU runtime header here.
#pragma once

#include <cstdint>

#include "moeext/common.h"

namespace moeext::host_device {

// ---------------------------------------------------------------------------------------
// Gate/up interleave: 16-row blocks alternate gate (the first half of each group of
// rows_per_group rows) and up (the second half).
// ---------------------------------------------------------------------------------------

// Row of the un-interleaved tensor that interleaved row `row` comes from. A 16-row block
// stays one contiguous run of source rows.
MOEEXT_HOST_DEVICE inline int64_t gate_up_source_row(int64_t row, int64_t rows_per_group) {
  const int64_t group = row / rows_per_group;
  const int64_t local = row % rows_per_group;
  const int64_t block = local / 16;
  const int64_t half = (block % 2) * (rows_per_group / 2);
  return group * rows_per_group + half + (block / 2) * 16 + local % 16;
}

// Inverse of gate_up_source_row: the interleaved row that memory row `source_row` lands on.
// rows_per_group must be a multiple of 32 (whole 16-row blocks in each half).
MOEEXT_HOST_DEVICE inline int64_t gate_up_interleaved_row(int64_t source_row,
                                                          int64_t rows_per_group) {
  const int64_t group = source_row / rows_per_group;
  const int64_t local = source_row % rows_per_group;
  const int64_t half_rows = rows_per_group / 2;
  const int64_t is_up = local >= half_rows ? 1 : 0;
  const int64_t in_half = local - is_up * half_rows;
  return group * rows_per_group + ((in_half / 16) * 2 + is_up) * 16 + in_half % 16;
}

// ---------------------------------------------------------------------------------------
// shuffle_weight. Positions are in 16-byte chunks: chunk kc of a logical row holds bytes
// [kc * 16, kc * 16 + 16), and shuffled chunk s holds shuffled bytes [s * 16, s * 16 + 16).
// Logical rows are those of the gate/up-interleaved matrix when gate_up is set
// (gate_up_source_row gives the row of the tensor in memory).
// ---------------------------------------------------------------------------------------

constexpr int64_t kShuffleChunkBytes = 16;

// Shuffled chunk of logical chunk kc of row n0 * band + n1 in batch entry b: the band's
// tiles are contiguous, chunk column by chunk column, each band x 16 bytes row by row.
MOEEXT_HOST_DEVICE inline int64_t shuffled_chunk_index(int64_t b, int64_t n0, int64_t n1,
                                                       int64_t kc, int64_t rows,
                                                       int64_t chunks_per_row, int64_t band) {
  return b * rows * chunks_per_row + (n0 * chunks_per_row + kc) * band + n1;
}

struct LogicalChunk {
  int64_t batch;
  int64_t row;    // of the (interleaved) logical matrix
  int64_t chunk;  // 16-byte chunk column
};

// Inverse of shuffled_chunk_index.
MOEEXT_HOST_DEVICE inline LogicalChunk logical_chunk_of(int64_t s, int64_t rows,
                                                        int64_t chunks_per_row, int64_t band) {
  const int64_t per_batch = rows * chunks_per_row;
  const int64_t b = s / per_batch;
  const int64_t in_batch = s % per_batch;
  const int64_t n1 = in_batch % band;
  const int64_t tile = in_batch / band;  // n0 * chunks_per_row + kc
  return {b, (tile / chunks_per_row) * band + n1, tile % chunks_per_row};
}

// ---------------------------------------------------------------------------------------
// e8m0_shuffle. r and c index the padded [padded_m, padded_n] scale matrix (after the
// gate/up interleave). Each 32-row x 8-column group is one dense 256-byte block; the blocks
// of one 32-row band follow each other, column group by column group.
// ---------------------------------------------------------------------------------------

constexpr int kE8m0BlockBytes = 256;

// The shuffled offset splits into a part of the row and a part of the column:
//   a*32*padded_n + (r%16)*4 + (r/16)%2   and   (c/8)*256 + (c%4)*64 + ((c/4)%2)*2.
MOEEXT_HOST_DEVICE inline int64_t e8m0_row_offset(int64_t r, int64_t padded_n) {
  return (r / 32) * 32 * padded_n + (r % 16) * 4 + (r / 16) % 2;
}
MOEEXT_HOST_DEVICE inline int64_t e8m0_col_offset(int64_t c) {
  return (c / 8) * kE8m0BlockBytes + (c % 4) * 64 + ((c / 4) % 2) * 2;
}
MOEEXT_HOST_DEVICE inline int64_t e8m0_shuffled_offset(int64_t r, int64_t c, int64_t padded_n) {
  return e8m0_row_offset(r, padded_n) + e8m0_col_offset(c);
}

// First byte of the block of rows [32a, 32a + 32) and columns [8d, 8d + 8), which is
// e8m0_shuffled_offset(32a, 8d) with the parts that vanish there left out.
MOEEXT_HOST_DEVICE inline int64_t e8m0_block_offset(int64_t a, int64_t d, int64_t padded_n) {
  return a * 32 * padded_n + d * kE8m0BlockBytes;
}

// Byte q of a 256-byte block comes from row `row` (0..31) and column `col` (0..7) of its
// 32 x 8 group.
struct E8m0TilePosition {
  int row;
  int col;
};
MOEEXT_HOST_DEVICE constexpr E8m0TilePosition e8m0_tile_position(int q) {
  const int f = q / 64, c4 = (q / 4) % 16, e = (q / 2) % 2, h = q % 2;
  return {h * 16 + c4, e * 4 + f};
}

struct E8m0Position {
  int64_t row;
  int64_t col;
};

// Inverse of e8m0_shuffled_offset: the padded position of shuffled byte `offset`.
MOEEXT_HOST_DEVICE inline E8m0Position e8m0_padded_position(int64_t offset, int64_t padded_n) {
  const int64_t block = offset / kE8m0BlockBytes;
  const int64_t col_blocks = padded_n / 8;
  const E8m0TilePosition t = e8m0_tile_position(int(offset % kE8m0BlockBytes));
  return {(block / col_blocks) * 32 + t.row, (block % col_blocks) * 8 + t.col};
}

}  // namespace moeext::host_device
