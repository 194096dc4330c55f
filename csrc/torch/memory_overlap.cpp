#include "torch/memory_overlap.h"

#include <algorithm>

namespace moeext::torch_glue {
namespace {

int64_t floor_div(int64_t x, int64_t d) { return x >= 0 ? x / d : -((-x + d - 1) / d); }

}  // namespace

RowBytes rows_of(const void* data, int64_t rows, int64_t row_stride, int64_t cols,
                 int64_t col_stride, int64_t element) {
  RowBytes r;
  r.begin = reinterpret_cast<uintptr_t>(data);
  r.stride = row_stride * element;
  r.width = rows == 0 || cols == 0 ? 0 : ((cols - 1) * col_stride + 1) * element;
  r.rows = rows;
  return r;
}

// Views into one workspace with one row stride s (the usual case) are solved directly: row i
// of a and row j of b overlap iff d - a.width < (i - j) * s < d + b.width, with
// d = b.begin - a.begin. Otherwise the rows are walked in address order on both sides,
// advancing whichever row ends first (a row that ends before the other's starts cannot meet
// any later one).
bool rows_overlap(RowBytes a, RowBytes b) {
  if (a.rows == 0 || b.rows == 0 || a.width == 0 || b.width == 0) return false;
  if (a.stride == 0) a.rows = 1;
  if (b.stride == 0) b.rows = 1;
  const uintptr_t a_end = a.begin + uintptr_t((a.rows - 1) * a.stride + a.width);
  const uintptr_t b_end = b.begin + uintptr_t((b.rows - 1) * b.stride + b.width);
  if (a_end <= b.begin || b_end <= a.begin) return false;
  if (a.stride == b.stride && a.rows > 1 && b.rows > 1) {
    const int64_t s = a.stride;
    const int64_t d = int64_t(b.begin - a.begin);
    const int64_t k_min = std::max(floor_div(d - a.width, s) + 1, 1 - b.rows);
    const int64_t k_max = std::min(-floor_div(-(d + b.width), s) - 1, a.rows - 1);
    return k_min <= k_max;
  }
  for (int64_t i = 0, j = 0; i < a.rows && j < b.rows;) {
    const uintptr_t a_lo = a.begin + uintptr_t(i * a.stride), a_hi = a_lo + uintptr_t(a.width);
    const uintptr_t b_lo = b.begin + uintptr_t(j * b.stride), b_hi = b_lo + uintptr_t(b.width);
    if (a_lo < b_hi && b_lo < a_hi) return true;
    if (a_hi <= b_hi) {
      ++i;
    } else {
      ++j;
    }
  }
  return false;
}

}  // namespace moeext::torch_glue
