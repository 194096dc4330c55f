// Zeroing a range of rows. memset is already the machine's fastest store loop (it picks
// non-temporal stores for large sizes), so there is no per-ISA copy of this file.
#include <cstring>

#include "moeext/zero_tail.h"

namespace moeext {

void zero_rows_cpu(const ZeroRowsParams& p, int64_t row_begin, int64_t row_end) {
  if (row_begin >= row_end || p.row_bytes == 0) return;
  unsigned char* base = static_cast<unsigned char*>(p.data);
  if (p.row_stride == p.row_bytes) {
    // Contiguous rows: one store stream for the whole range.
    std::memset(base + row_begin * p.row_stride, 0, size_t((row_end - row_begin) * p.row_bytes));
    return;
  }
  for (int64_t r = row_begin; r < row_end; ++r) {
    std::memset(base + r * p.row_stride, 0, size_t(p.row_bytes));
  }
}

}  // namespace moeext
