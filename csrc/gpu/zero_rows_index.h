// Pure index logic of the zeroing kernel (zero_tail.cu), shared with its host unit test
// (tests/cpp/test_zero_rows_index.cpp). No GPU runtime header here.
#pragma once

#include <cstdint>

#include "moeext/common.h"

namespace moeext::gpu {

// End row of the tracked form: the stored previous extent clamped to [0, row_end] (a
// negative one reads as 0, as on the CPU, since the device cannot raise an error).
MOEEXT_HOST_DEVICE inline int64_t tracked_row_end(int64_t stored_extent, int64_t row_end) {
  return stored_extent <= 0 ? 0 : (stored_extent < row_end ? stored_extent : row_end);
}

// A grid-stride walk over a [rows, units_per_row] grid: the flattened indices first,
// first + step, ... as (row, unit) pairs. Only the start divides; each step adds the step's
// rows and units and carries once (step_units < units_per_row, so one carry suffices).
struct RowUnitWalk {
  int64_t row;
  int64_t unit;
  int64_t step_rows;
  int64_t step_units;
  int64_t units_per_row;

  MOEEXT_HOST_DEVICE RowUnitWalk(int64_t first, int64_t step, int64_t units)
      : row(first / units),
        unit(first % units),
        step_rows(step / units),
        step_units(step % units),
        units_per_row(units) {}

  MOEEXT_HOST_DEVICE void advance() {
    row += step_rows;
    unit += step_units;
    if (unit >= units_per_row) {
      unit -= units_per_row;
      ++row;
    }
  }
};

}  // namespace moeext::gpu
