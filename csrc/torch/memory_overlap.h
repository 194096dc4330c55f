// Whether views share memory, for the ops that write into their arguments: a write into
// memory that a read or another write also covers would make the result depend on the order
// the kernel touches it in, so such calls are refused, as torch's out= ops refuse them.
#pragma once

#include <cstdint>

namespace moeext::torch_glue {

// The bytes a view covers, as rows along its dim 0: row r is the range
// [begin + r * stride, begin + r * stride + width), stride in bytes (torch strides are never
// negative). A row with strided columns is described by its first to last byte.
struct RowBytes {
  uintptr_t begin = 0;
  int64_t stride = 0;
  int64_t width = 0;
  int64_t rows = 0;
};

// `rows` rows of `cols` elements of `element` bytes, strides in elements.
RowBytes rows_of(const void* data, int64_t rows, int64_t row_stride, int64_t cols,
                 int64_t col_stride, int64_t element);

// Whether two rows of one view share bytes.
inline bool rows_overlap_each_other(const RowBytes& a) {
  return a.rows > 1 && a.width > 0 && a.stride < a.width;
}

// Whether any row of a shares bytes with any row of b. Exact; separate buffers end at the
// first test.
bool rows_overlap(RowBytes a, RowBytes b);

}  // namespace moeext::torch_glue
