// MXFP4 weight and E8M0 scale shuffles on the GPU (SPEC.md section 3). Pure data movement;
// the index maps are the CPU kernels' too (host_device/shuffle_maps.h), where the host test
// checks them against SPEC.
//
// shuffle_weight / unshuffle_weight: a block moves one band (band rows x row_bytes) at a
// time; its band * (256 / band) threads each keep one row of the band (n1 = tid % band) and
// step through that row's 16-byte chunks, so consecutive threads touch consecutive 16-byte
// slots of the dense shuffled side (the band's tiles are contiguous there, (kc, n1) order),
// and each warp reads or writes whole 32-byte sectors of 16 rows on the logical side. The
// logical row pointer (gate/up interleave included) is resolved once per band. When either
// side is not 16-byte aligned the chunks move in the widest accesses that are.
//
// e8m0_shuffle: a thread writes 16 consecutive bytes of one 256-byte block (coalesced
// 16-byte stores), gathering them from 8 rows x 2 columns of the scale; e8m0_unshuffle: a
// thread writes up to 8 consecutive bytes of one output row, gathered from one 256-byte
// block.
#include "gpu/access_width.h"
#include "gpu/compat.h"
#include "gpu/shuffle_threads.h"
#include "gpu/vector_access.h"
#include "host_device/shuffle_maps.h"
#include "moeext/mxfp4_shuffle.h"

namespace moeext {
namespace {

using host_device::E8m0TilePosition;
using host_device::e8m0_col_offset;
using host_device::e8m0_row_offset;
using host_device::e8m0_tile_position;
using host_device::gate_up_interleaved_row;
using host_device::gate_up_source_row;
using host_device::kE8m0BlockBytes;
using host_device::kShuffleChunkBytes;
using host_device::shuffled_chunk_index;

constexpr int kMaxThreads = 256;
// Resident blocks per SM the grid-stride launches are capped at.
constexpr int kBlocksPerSm = 8;
constexpr uint8_t kPadScale = 0x7F;  // 2^0: never NaN (AITER leaves pad scales uninitialised)

int64_t grid_cap() { return int64_t(gpu::multiprocessor_count_of_current_device()) * kBlocksPerSm; }

unsigned grid_for(int64_t items, int64_t items_per_block) {
  const int64_t wanted = (items + items_per_block - 1) / items_per_block;
  const int64_t cap = grid_cap();
  return unsigned(wanted < cap ? wanted : cap);
}

// ---------------------------------------------------------------------------------------
// shuffle_weight / unshuffle_weight
// ---------------------------------------------------------------------------------------

template <bool kShuffle, int kWidth>
__global__ void __launch_bounds__(kMaxThreads) shuffle_weight_kernel(ShuffleWeightParams p) {
  const int band = int(p.band);
  const int64_t chunks_per_row = p.row_bytes / kShuffleChunkBytes;
  const int64_t bands_per_batch = p.rows / p.band;
  const int64_t total_bands = p.batch * bands_per_batch;
  const gpu::ShuffleThreadSlot slot = gpu::shuffle_thread_slot(int(threadIdx.x), band);
  const int kc_step = int(blockDim.x) / band;
  unsigned char* shuffled = static_cast<unsigned char*>(p.shuffled);
  unsigned char* logical =
      const_cast<unsigned char*>(static_cast<const unsigned char*>(p.logical));
  for (int64_t g = blockIdx.x; g < total_bands; g += gridDim.x) {
    const int64_t b = g / bands_per_batch;
    const int64_t n0 = g - b * bands_per_batch;
    const int64_t n = n0 * p.band + slot.n1;
    const int64_t source_row = p.gate_up ? gate_up_source_row(n, p.rows) : n;
    unsigned char* row =
        logical + b * p.logical_batch_stride + source_row * p.logical_row_stride;
    for (int64_t kc = slot.kc; kc < chunks_per_row; kc += kc_step) {
      unsigned char* tile =
          shuffled +
          shuffled_chunk_index(b, n0, slot.n1, kc, p.rows, chunks_per_row, p.band) *
              kShuffleChunkBytes;
      unsigned char* chunk = row + kc * kShuffleChunkBytes;
      if constexpr (kShuffle) {
        gpu::copy_bytes<kWidth, 16>(tile, chunk);
      } else {
        gpu::copy_bytes<kWidth, 16>(chunk, tile);
      }
    }
  }
}

const char* check_weight_params(const ShuffleWeightParams& p) {
  static_assert(kMaxShuffleBand <= kMaxThreads, "a block holds a thread per row of a band");
  if (p.band < 1 || p.band > kMaxShuffleBand) {
    return "shuffle_weight_gpu: band must be in [1, kMaxShuffleBand]";
  }
  if (p.batch < 0 || p.rows < 0 || p.row_bytes < 0) {
    return "shuffle_weight_gpu: negative size";
  }
  if (p.rows % p.band != 0) return "shuffle_weight_gpu: rows must be a multiple of band";
  if (p.row_bytes % kShuffleChunkBytes != 0) {
    return "shuffle_weight_gpu: row_bytes must be a multiple of 16";
  }
  if (p.gate_up && p.rows % 32 != 0) {
    return "shuffle_weight_gpu: gate_up needs rows to be a multiple of 32";
  }
  return nullptr;
}

template <bool kShuffle>
GpuError launch_shuffle_weight(const ShuffleWeightParams& p, gpu::Stream stream) {
  if (const char* error = check_weight_params(p)) return error;
  if (p.batch == 0 || p.rows == 0 || p.row_bytes == 0) return nullptr;
  // Strides of size-1 dimensions are never used (torch gives those arbitrary strides).
  const uint64_t alignment =
      uint64_t(reinterpret_cast<uintptr_t>(p.logical)) |
      uint64_t(reinterpret_cast<uintptr_t>(p.shuffled)) |
      uint64_t(p.batch > 1 ? p.logical_batch_stride : 0) |
      uint64_t(p.rows > 1 ? p.logical_row_stride : 0);
  const int width = gpu::widest_aligned_access(alignment);
  const int threads = gpu::shuffle_block_threads(p.band);
  const unsigned blocks = grid_for(p.batch * (p.rows / p.band), 1);
  switch (width) {
    case 16:
      shuffle_weight_kernel<kShuffle, 16><<<blocks, threads, 0, stream>>>(p);
      break;
    case 8:
      shuffle_weight_kernel<kShuffle, 8><<<blocks, threads, 0, stream>>>(p);
      break;
    case 4:
      shuffle_weight_kernel<kShuffle, 4><<<blocks, threads, 0, stream>>>(p);
      break;
    case 2:
      shuffle_weight_kernel<kShuffle, 2><<<blocks, threads, 0, stream>>>(p);
      break;
    default:
      shuffle_weight_kernel<kShuffle, 1><<<blocks, threads, 0, stream>>>(p);
      break;
  }
  return gpu::launch_status();
}

// ---------------------------------------------------------------------------------------
// e8m0_shuffle / e8m0_unshuffle
// ---------------------------------------------------------------------------------------

// Pieces of 16 shuffled bytes: 16 per 256-byte block, one per thread and step.
constexpr int kPieceBytes = 16;
constexpr int kPiecesPerBlock = kE8m0BlockBytes / kPieceBytes;

template <bool kVectorStore>
__global__ void __launch_bounds__(kMaxThreads) e8m0_shuffle_kernel(E8m0ShuffleParams p) {
  const int64_t col_blocks = p.padded_n / 8;
  const int64_t pieces = (p.padded_m / 32) * col_blocks * kPiecesPerBlock;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < pieces; i += step) {
    const int64_t block = i / kPiecesPerBlock;
    const int piece = int(i % kPiecesPerBlock);
    const int64_t a = block / col_blocks;
    const int64_t d = block - a * col_blocks;
    // Source rows of the group's two 16-row halves: a 16-row block stays contiguous through
    // the gate/up interleave (rows_per_expert is a multiple of 32, so both halves lie in one
    // expert), so row h*16 + c4 of the group is source_half[h] + c4.
    int64_t source_half[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t r = a * 32 + h * 16;
      source_half[h] =
          (p.rows_per_expert > 0 && r < p.m) ? gate_up_source_row(r, p.rows_per_expert) : r;
    }
    uint32_t words[kPieceBytes / 4];
#pragma unroll
    for (int w = 0; w < kPieceBytes / 4; ++w) words[w] = 0;
#pragma unroll
    for (int byte = 0; byte < kPieceBytes; ++byte) {
      const E8m0TilePosition t = e8m0_tile_position(piece * kPieceBytes + byte);
      const int64_t r = a * 32 + t.row;
      const int64_t c = d * 8 + t.col;
      uint32_t value = kPadScale;
      if (r < p.m && c < p.n) {
        value = p.scale[(source_half[t.row / 16] + t.row % 16) * p.row_stride + c * p.col_stride];
      }
      words[byte / 4] |= value << (8 * (byte % 4));
    }
    uint8_t* out = p.shuffled + block * kE8m0BlockBytes + piece * kPieceBytes;
    if constexpr (kVectorStore) {
      *reinterpret_cast<uint4*>(out) = make_uint4(words[0], words[1], words[2], words[3]);
    } else {
#pragma unroll
      for (int byte = 0; byte < kPieceBytes; ++byte) {
        out[byte] = uint8_t(words[byte / 4] >> (8 * (byte % 4)));
      }
    }
  }
}

// Output segments: the up-to-8 bytes of one row that one 256-byte block holds.
constexpr int kSegmentBytes = 8;

template <bool kVectorStore>
__global__ void __launch_bounds__(kMaxThreads) e8m0_unshuffle_kernel(E8m0ShuffleParams p) {
  const int64_t col_blocks = p.padded_n / 8;
  const int64_t segments = p.m * col_blocks;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < segments; i += step) {
    const int64_t row = i / col_blocks;
    const int64_t d = i - row * col_blocks;
    // Output row `row` is padded row r of the interleaved matrix.
    const int64_t r = p.rows_per_expert > 0 ? gate_up_interleaved_row(row, p.rows_per_expert) : row;
    const uint8_t* in = p.shuffled_in + e8m0_row_offset(r, p.padded_n);
    const int64_t c0 = d * kSegmentBytes;
    uint8_t* out = p.unshuffled + row * p.n + c0;
    if constexpr (kVectorStore) {
      // n % 8 == 0: every segment is whole and 8-byte aligned.
      uint32_t lo = 0, hi = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        lo |= uint32_t(in[e8m0_col_offset(c0 + j)]) << (8 * j);
        hi |= uint32_t(in[e8m0_col_offset(c0 + 4 + j)]) << (8 * j);
      }
      *reinterpret_cast<uint2*>(out) = make_uint2(lo, hi);
    } else {
#pragma unroll
      for (int j = 0; j < kSegmentBytes; ++j) {
        if (c0 + j < p.n) out[j] = in[e8m0_col_offset(c0 + j)];
      }
    }
  }
}

const char* check_e8m0_params(const E8m0ShuffleParams& p) {
  if (p.m < 0 || p.n < 0) return "e8m0_(un)shuffle_gpu: m and n must be >= 0";
  if (p.padded_m != (p.m + 255) / 256 * 256 || p.padded_n != (p.n + 7) / 8 * 8) {
    return "e8m0_(un)shuffle_gpu: padded_m and padded_n must be m and n rounded up to 256 "
           "and 8";
  }
  if (p.rows_per_expert < 0 ||
      (p.rows_per_expert > 0 && (p.rows_per_expert % 32 != 0 || p.m % p.rows_per_expert != 0))) {
    return "e8m0_(un)shuffle_gpu: rows_per_expert must be a multiple of 32 that divides m";
  }
  return nullptr;
}

}  // namespace

GpuError shuffle_weight_gpu(const ShuffleWeightParams& p, void* stream) {
  return launch_shuffle_weight<true>(p, gpu::as_stream(stream));
}

GpuError unshuffle_weight_gpu(const ShuffleWeightParams& p, void* stream) {
  return launch_shuffle_weight<false>(p, gpu::as_stream(stream));
}

GpuError e8m0_shuffle_gpu(const E8m0ShuffleParams& p, void* stream) {
  if (const char* error = check_e8m0_params(p)) return error;
  if (p.padded_m == 0 || p.padded_n == 0) return nullptr;
  const gpu::Stream s = gpu::as_stream(stream);
  const int64_t pieces = (p.padded_m / 32) * (p.padded_n / 8) * kPiecesPerBlock;
  const unsigned blocks = grid_for(pieces, kMaxThreads);
  if ((reinterpret_cast<uintptr_t>(p.shuffled) & 15) == 0) {
    e8m0_shuffle_kernel<true><<<blocks, kMaxThreads, 0, s>>>(p);
  } else {
    e8m0_shuffle_kernel<false><<<blocks, kMaxThreads, 0, s>>>(p);
  }
  return gpu::launch_status();
}

GpuError e8m0_unshuffle_gpu(const E8m0ShuffleParams& p, void* stream) {
  if (const char* error = check_e8m0_params(p)) return error;
  if (p.m == 0 || p.n == 0) return nullptr;
  const gpu::Stream s = gpu::as_stream(stream);
  const int64_t segments = p.m * (p.padded_n / 8);
  const unsigned blocks = grid_for(segments, kMaxThreads);
  if (p.n % kSegmentBytes == 0 && (reinterpret_cast<uintptr_t>(p.unshuffled) & 7) == 0) {
    e8m0_unshuffle_kernel<true><<<blocks, kMaxThreads, 0, s>>>(p);
  } else {
    e8m0_unshuffle_kernel<false><<<blocks, kMaxThreads, 0, s>>>(p);
  }
  return gpu::launch_status();
}

}  // namespace moeext
