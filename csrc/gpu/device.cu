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

#if !defined(MOEEXT_HIP)
namespace {

// Never launched: its attributes tell which of this build's code the current device runs.
// Every file of the GPU library is built for the same architectures, so the answer holds for
// the kernels of the other files too.
__global__ void code_version_probe() {}

// 0 = not asked yet, 1 = no, 2 = yes. Races only ever store the same value.
std::atomic<int> runs_sm90_code[kMaxDevices];

}  // namespace
#endif

}  // namespace moeext::gpu

namespace moeext {

// The device's compute capability is not enough: a device this build has no binary for (an
// sm_103 or sm_120 device, with the default "80;90a;100a") runs the compute_80 PTX, JIT-compiled,
// in which wait_for_prior_grids() is empty. Launched with the attribute, such a kernel could
// read the previous kernel's output before it is written; so the code it runs must come from
// sm_90+ PTX too.
bool gpu_programmatic_dependent_launch_supported() {
#if defined(MOEEXT_HIP)
  return false;
#else
  using namespace gpu;
  int device = 0;
  if (current_device(&device) != kSuccess || device < 0 || device >= kMaxDevices) {
    (void)last_error();
    return false;
  }
  int known = runs_sm90_code[device].load(std::memory_order_relaxed);
  if (known == 0) {
    int major = 0;
    cudaFuncAttributes attributes = {};
    if (device_attribute(&major, cudaDevAttrComputeCapabilityMajor, device) != kSuccess ||
        cudaFuncGetAttributes(&attributes, code_version_probe) != kSuccess) {
      (void)last_error();
      return false;  // asked again next time
    }
    known = major >= 9 && attributes.ptxVersion >= 90 ? 2 : 1;
    runs_sm90_code[device].store(known, std::memory_order_relaxed);
  }
  return known == 2;
#endif
}

}  // namespace moeext
