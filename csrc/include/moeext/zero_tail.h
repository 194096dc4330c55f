// Tail-only zeroing of persistent buffers (SPEC.md section 4): launcher API.
#pragma once

#include <cstdint>

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

}  // namespace moeext
