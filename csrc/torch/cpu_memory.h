// How the CPU implementations allocate their outputs and treat large outputs and streaming
// work (the shuffles).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <algorithm>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace moeext::torch_glue {

// A contiguous output, uninitialised. Up to kSmallOutputBytes (a decode step's routing
// results and logits) the block comes from malloc: torch's CPU allocator asks posix_memalign,
// whose splitting and consolidation cost about as much as a one-token routing kernel, twice a
// call for the two routing results. Larger ones come from torch's CPU allocator.
constexpr size_t kSmallOutputBytes = size_t(64) << 10;
at::Tensor empty_cpu_output(at::IntArrayRef sizes, at::ScalarType dtype);

// A fresh multi-hundred-MiB output spends more time in 4 KiB page faults than in the shuffle
// itself. Asking for transparent huge pages before the first touch removes most of them; where
// THP is off or unsupported the hint is ignored.
inline void advise_huge_pages(const at::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t end = begin + t.nbytes();
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t last = end & ~(kHuge - 1);
  if (t.nbytes() >= (size_t(16) << 20) && last > first) {
    madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
  }
#else
  (void)t;
#endif
}

// Work that streams at memory speed: ~1 MiB per task amortises a thread's wake-up.
inline int64_t bytes_grain(int64_t bytes_per_item) {
  return std::max<int64_t>(1, (int64_t(1) << 20) / std::max<int64_t>(1, bytes_per_item));
}

}  // namespace moeext::torch_glue
