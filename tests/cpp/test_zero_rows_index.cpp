// Host unit test of csrc/gpu/zero_rows_index.h: the tracked extent clamp (the CPU's
// semantics) and the grid-stride (row, unit) walk of the zeroing kernel.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <vector>

#include "check.h"
#include "gpu/zero_rows_index.h"

namespace gpu = moeext::gpu;

namespace {


void test_tracked_row_end() {
  const int64_t lo = std::numeric_limits<int64_t>::min(), hi = std::numeric_limits<int64_t>::max();
  for (int64_t row_end : {int64_t(0), int64_t(1), int64_t(7), int64_t(4096), hi}) {
    for (int64_t stored : {lo, int64_t(-5), int64_t(-1), int64_t(0), int64_t(1), int64_t(6),
                           int64_t(7), int64_t(8), int64_t(4096), int64_t(100000), hi}) {
      // zero_tail_tracked_cpu: prev = max(0, *stored), rows [.., min(prev, rows)).
      const int64_t want = std::min(std::max<int64_t>(0, stored), row_end);
      const int64_t got = gpu::tracked_row_end(stored, row_end);
      CHECK(got == want, "tracked_row_end(%lld, %lld) = %lld, want %lld",
            static_cast<long long>(stored), static_cast<long long>(row_end),
            static_cast<long long>(got), static_cast<long long>(want));
    }
  }
}

// Every thread of a grid of `threads` walks from its own index in steps of `threads`; every
// (row, unit) of [rows, units] must be visited exactly once.
void test_walk(int64_t rows, int64_t units, int64_t threads) {
  std::vector<int> visits(size_t(rows * units), 0);
  bool in_range = true;
  for (int64_t first = 0; first < threads; ++first) {
    for (gpu::RowUnitWalk walk(first, threads, units); walk.row < rows; walk.advance()) {
      if (walk.row < 0 || walk.unit < 0 || walk.unit >= units) {
        in_range = false;
        break;
      }
      ++visits[size_t(walk.row * units + walk.unit)];
    }
  }
  CHECK(in_range, "rows %lld, units %lld, threads %lld: a step left the grid",
        static_cast<long long>(rows), static_cast<long long>(units),
        static_cast<long long>(threads));
  const bool once = std::all_of(visits.begin(), visits.end(), [](int v) { return v == 1; });
  CHECK(once, "rows %lld, units %lld, threads %lld: not every pair visited once",
        static_cast<long long>(rows), static_cast<long long>(units),
        static_cast<long long>(threads));
}

}  // namespace

int main() {
  test_tracked_row_end();
  for (int64_t rows : {1, 2, 3, 17, 100}) {
    for (int64_t units : {1, 2, 3, 7, 16, 64, 250, 256, 257, 1000}) {
      for (int64_t threads : {1, 5, 64, 255, 256, 512, 768, 2048}) test_walk(rows, units, threads);
    }
  }
  return moeext_test::finish("zero_rows index");
}
