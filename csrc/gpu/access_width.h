// The widest aligned access a kernel may use, shared by the GPU launchers and their host
// unit test (tests/cpp/test_access_width.cpp). No GPU runtime header here.
#pragma once

#include <cstdint>

#include "moeext/common.h"

namespace moeext::gpu {

// Widest access (16, 8, 4, 2 or 1 bytes) that `alignment` allows: the OR of every base
// address, stride and length the accesses must respect.
MOEEXT_HOST_DEVICE inline int widest_aligned_access(uint64_t alignment) {
  return (alignment & 15) == 0  ? 16
         : (alignment & 7) == 0 ? 8
         : (alignment & 3) == 0 ? 4
         : (alignment & 1) == 0 ? 2
                                : 1;
}

}  // namespace moeext::gpu
