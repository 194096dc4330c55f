// MXFP4 weight and E8M0 scale shuffles for AITER's MoE kernels (SPEC.md section 3):
// launcher API. All strides are in bytes: the shuffles move bytes, whatever the dtype.
#pragma once

#include <cstdint>

#include "moeext/common.h"

namespace moeext {

// The CPU functions below take the preconditions the fields state as given (the torch glue
// checks them); the CUDA launchers check them and return an error.

// Most rows per band (layout[0]).
constexpr int64_t kMaxShuffleBand = 256;

// shuffle_weight / unshuffle_weight. The "logical" tensor is [batch, rows, row_bytes] with
// any batch and row strides (bytes within a row contiguous); the shuffled one is dense.
// Within each batch entry, row band n0 (band rows each) and 16-byte chunk column kc form one
// tile of band x 16 bytes, emitted row by row:
//   shuffled[((n0 * (row_bytes / 16) + kc) * band + n1) * 16 + byte]
//       = logical[n0 * band + n1][kc * 16 + byte]
// With gate_up, logical row n of that formula is the interleaved row: blocks of 16 rows
// alternate between the gate half (rows [0, rows/2)) and the up half.
struct ShuffleWeightParams {
  const void* logical = nullptr;   // read by shuffle, written by unshuffle
  int64_t logical_batch_stride = 0;
  int64_t logical_row_stride = 0;
  void* shuffled = nullptr;        // dense [batch, rows * row_bytes]
  int64_t batch = 0;
  int64_t rows = 0;                // a multiple of band (and of 32 with gate_up)
  int64_t row_bytes = 0;           // a multiple of 16
  int64_t band = 16;               // layout[0], in [1, kMaxShuffleBand]
  bool gate_up = false;
};

// Bands [band_begin, band_end) of batch * rows / band, in either direction, on this thread.
void shuffle_weight_cpu(const ShuffleWeightParams& p, int64_t band_begin, int64_t band_end);
void unshuffle_weight_cpu(const ShuffleWeightParams& p, int64_t band_begin, int64_t band_end);

// e8m0_shuffle / e8m0_unshuffle. The scale matrix [m, n] (any strides) is padded to
// [padded_m, padded_n] (multiples of 256 and 8) with 0x7F, then each 32-row x 8-column group
// becomes one dense 256-byte block:
//   shuffled[a*32*padded_n + d*256 + f*64 + c4*4 + e*2 + h] = padded[a*32 + h*16 + c4][d*8 + e*4 + f]
// With rows_per_expert > 0, padded rows are first gate/up-interleaved in 16-row blocks inside
// each expert's rows_per_expert rows (a multiple of 32 that divides m).
struct E8m0ShuffleParams {
  const uint8_t* scale = nullptr;  // [m, n]; read by shuffle
  uint8_t* unshuffled = nullptr;   // [m, n]; written by unshuffle (dense)
  int64_t row_stride = 0;          // of `scale`
  int64_t col_stride = 1;          // of `scale`
  int64_t m = 0, n = 0;
  int64_t padded_m = 0, padded_n = 0;
  int64_t rows_per_expert = 0;     // 0: no gate/up interleave; else divides m
  uint8_t* shuffled = nullptr;     // written by shuffle
  const uint8_t* shuffled_in = nullptr;  // read by unshuffle
};

// 32-row blocks [block_begin, block_end) of padded_m / 32, on this thread.
void e8m0_shuffle_cpu(const E8m0ShuffleParams& p, int64_t block_begin, int64_t block_end);
void e8m0_unshuffle_cpu(const E8m0ShuffleParams& p, int64_t block_begin, int64_t block_end);

// The same four transforms on the GPU, whole tensors at once.
GpuError shuffle_weight_gpu(const ShuffleWeightParams& p, void* stream);
GpuError unshuffle_weight_gpu(const ShuffleWeightParams& p, void* stream);
GpuError e8m0_shuffle_gpu(const E8m0ShuffleParams& p, void* stream);
GpuError e8m0_unshuffle_gpu(const E8m0ShuffleParams& p, void* stream);

}  // namespace moeext
