// Tail-only zeroing on the GPU (SPEC.md section 4).
//
// Contiguous rows with a host-known extent are one memset. Strided rows, and the tracked
// form whose extent only the device knows, go through one kernel: a grid-stride loop over
// (row, unit) pairs, a unit being the widest store (16 bytes down to 1) that every row start
// and row length are aligned to. The tracked form sizes its grid for the largest tail the
// buffer allows and reads the previous extent on the device, so one captured graph stays
// right on every replay; the extent is updated by a second one-thread launch on the same
// stream, which starts only after every block of the first has read the old value.
#include "gpu/access_width.h"
#include "gpu/compat.h"
#include "gpu/vector_access.h"
#include "gpu/zero_rows_index.h"
#include "moeext/zero_tail.h"

namespace moeext {
namespace {

constexpr int kThreads = 256;
// Enough resident threads per SM to keep the store queues full; more blocks would only
// re-derive their (row, unit) start.
constexpr int kBlocksPerSm = 8;

// Zeroes rows [row_begin, end) with end = row_end, or tracked_row_end(*state, row_end) when
// state is given; each thread takes every grid-size-th (row, unit) pair (RowUnitWalk).
template <int kWidth>
__global__ void __launch_bounds__(kThreads)
    zero_rows_kernel(unsigned char* data, int64_t row_stride, int64_t units_per_row,
                     int64_t row_begin, int64_t row_end, const int64_t* state) {
  using Unit = gpu::AccessUnit<kWidth>;
  const int64_t end = state != nullptr ? gpu::tracked_row_end(*state, row_end) : row_end;
  const int64_t rows = end - row_begin;
  if (rows <= 0) return;
  gpu::RowUnitWalk walk(int64_t(blockIdx.x) * kThreads + threadIdx.x,
                        int64_t(gridDim.x) * kThreads, units_per_row);
  for (; walk.row < rows; walk.advance()) {
    *reinterpret_cast<typename Unit::Type*>(data + (row_begin + walk.row) * row_stride +
                                            walk.unit * kWidth) = Unit::zero();
  }
}

__global__ void store_extent_kernel(int64_t* state, int64_t new_extent) { *state = new_extent; }

// Launches zero_rows_kernel for rows [p.row_begin, p.row_end) (the most the tracked form
// can need); requires p.row_begin < p.row_end and p.row_bytes > 0.
GpuError launch_zero_rows(const ZeroRowsParams& p, const int64_t* state, gpu::Stream stream) {
  // A single row's stride is never used (torch gives size-1 dims arbitrary strides).
  const int64_t stride_used = p.row_end - p.row_begin > 1 ? p.row_stride : 0;
  const uint64_t alignment = uint64_t(reinterpret_cast<uintptr_t>(p.data)) |
                             uint64_t(stride_used) | uint64_t(p.row_bytes);
  const int width = gpu::widest_aligned_access(alignment);
  const int64_t units_per_row = p.row_bytes / width;
  const int64_t max_units = (p.row_end - p.row_begin) * units_per_row;
  const int64_t cap = int64_t(gpu::multiprocessor_count_of_current_device()) * kBlocksPerSm;
  const int64_t wanted = (max_units + kThreads - 1) / kThreads;
  const unsigned blocks = unsigned(wanted < cap ? wanted : cap);
  unsigned char* data = static_cast<unsigned char*>(p.data);
  switch (width) {
    case 16:
      zero_rows_kernel<16><<<blocks, kThreads, 0, stream>>>(data, p.row_stride, units_per_row,
                                                            p.row_begin, p.row_end, state);
      break;
    case 8:
      zero_rows_kernel<8><<<blocks, kThreads, 0, stream>>>(data, p.row_stride, units_per_row,
                                                           p.row_begin, p.row_end, state);
      break;
    case 4:
      zero_rows_kernel<4><<<blocks, kThreads, 0, stream>>>(data, p.row_stride, units_per_row,
                                                           p.row_begin, p.row_end, state);
      break;
    case 2:
      zero_rows_kernel<2><<<blocks, kThreads, 0, stream>>>(data, p.row_stride, units_per_row,
                                                           p.row_begin, p.row_end, state);
      break;
    default:
      zero_rows_kernel<1><<<blocks, kThreads, 0, stream>>>(data, p.row_stride, units_per_row,
                                                           p.row_begin, p.row_end, state);
      break;
  }
  return gpu::launch_status();
}

}  // namespace

GpuError zero_rows_gpu(const ZeroRowsParams& params, void* stream) {
  if (params.row_begin >= params.row_end || params.row_bytes <= 0) return nullptr;
  const gpu::Stream s = gpu::as_stream(stream);
  const int64_t rows = params.row_end - params.row_begin;
  if (params.row_stride == params.row_bytes || rows == 1) {
    unsigned char* first = static_cast<unsigned char*>(params.data) +
                           params.row_begin * params.row_stride;
    const gpu::Error e = gpu::memset_async(first, 0, size_t(rows * params.row_bytes), s);
    if (e != gpu::kSuccess) {
      (void)gpu::last_error();  // returned here; the next launch reports its own
      return gpu::error_string(e);
    }
    return nullptr;
  }
  return launch_zero_rows(params, nullptr, s);
}

GpuError zero_rows_tracked_gpu(const ZeroRowsParams& params, int64_t* state,
                                int64_t new_extent, void* stream) {
  if (state == nullptr) return "zero_rows_tracked_gpu: state is null";
  const gpu::Stream s = gpu::as_stream(stream);
  if (params.row_begin < params.row_end && params.row_bytes > 0) {
    const GpuError error = launch_zero_rows(params, state, s);
    if (error != nullptr) return error;
  }
  store_extent_kernel<<<1, 1, 0, s>>>(state, new_extent);
  return gpu::launch_status();
}

}  // namespace moeext
