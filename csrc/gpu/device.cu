// Per-device facts the launchers need on the host, asked once per device and cached.
#include <atomic>

#include "gpu/compat.h"

namespace moeext::gpu {
namespace {

constexpr int kMaxDevices = 64;

// 0 = not asked yet. Races only ever store the same value.
template <typename Attr>
int cached_attribute(std::atomic<int>* cache, Attr attr, int fallback) {
  int device = 0;
  if (current_device(&device) != kSuccess || device < 0 || device >= kMaxDevices) {
    (void)last_error();  // clear it so the next launch reports its own
    return fallback;
  }
  int value = cache[device].load(std::memory_order_relaxed);
  if (value == 0) {
    if (device_attribute(&value, attr, device) != kSuccess || value <= 0) {
      (void)last_error();
      return fallback;
    }
    cache[device].store(value, std::memory_order_relaxed);
  }
  return value;
}

std::atomic<int> warp_sizes[kMaxDevices];
std::atomic<int> multiprocessor_counts[kMaxDevices];

}  // namespace

// 0 where the device cannot be asked: a guessed 32 would launch, on a wave64 device, kernel
// instances compiled empty there, and leave the outputs unwritten.
int warp_size_of_current_device() { return cached_attribute(warp_sizes, kAttrWarpSize, 0); }

int multiprocessor_count_of_current_device() {
  return cached_attribute(multiprocessor_counts, kAttrMultiprocessorCount, 1);
}

}  // namespace moeext::gpu
