// Tail-only zeroing of persistent buffers (SPEC.md section 4): launcher API.
#pragma once

#include <cstdint>

#include "moeext/common.h"

namespace moeext {

// Rows [row_begin, row_end) of a buffer whose rows are contiguous byte ranges. Strides are
// in bytes here (not elements): the op works on any dtype, packed ones included.
struct ZeroRowsParams {
  void* data = nullptr;        // row 0
  int64_t row_stride = 0;      // bytes from one row to the next
  int64_t row_bytes = 0;       // bytes in one row
  int64_t row_begin = 0;
  int64_t row_end = 0;         // exclusive; the caller clamps it to the buffer
};

// Zeroes the rows on the calling thread; callers split large ranges over their own pool.
void zero_rows_cpu(const ZeroRowsParams& params, int64_t row_begin, int64_t row_end);

// Zeroes params' rows [row_begin, row_end) on the GPU.
GpuError zero_rows_gpu(const ZeroRowsParams& params, void* stream);

// The tracked form, with the previous extent kept in device memory so CUDA-graph replays
// stay right: zeroes rows [params.row_begin, min(max(*state, 0), params.row_end)), then
// stores new_extent into *state, all on the stream. params.row_begin is new_extent clamped to
// the buffer and params.row_end is the buffer's row count.
GpuError zero_rows_tracked_gpu(const ZeroRowsParams& params, int64_t* state,
                                int64_t new_extent, void* stream);

}  // namespace moeext
