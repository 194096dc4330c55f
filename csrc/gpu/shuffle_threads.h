// How the shuffle_weight kernel (mxfp4_shuffle.cu) spreads a band over a block's threads,
// shared with its host unit test (tests/cpp/test_shuffle_maps.cpp). The index maps
// themselves are host_device/shuffle_maps.h. No GPU runtime header here.
#pragma once

#include <cstdint>

#include "moeext/common.h"

namespace moeext::gpu {

// Threads of a shuffle_weight block: a multiple of band (so each thread keeps one row of the
// band for the whole block) and at most 256.
MOEEXT_HOST_DEVICE inline int shuffle_block_threads(int64_t band) {
  return int(band * (256 / band));
}

// The fixed row of the band (n1) and the first chunk column (kc) of thread `tid` of a
// shuffle_weight block; the thread then steps kc by threads / band.
struct ShuffleThreadSlot {
  int n1;
  int kc;
};
MOEEXT_HOST_DEVICE inline ShuffleThreadSlot shuffle_thread_slot(int tid, int band) {
  return {tid % band, tid / band};
}

}  // namespace moeext::gpu
