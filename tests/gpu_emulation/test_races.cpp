// The race build's own check (tests/test_gpu_emulation.py builds this with ThreadSanitizer and
// runs one case per process): each case is a small kernel, and ThreadSanitizer must report a
// data race exactly for the cases whose name says "race". The orderings the runtime gives it
// are a GPU's: barriers and warp syncs order memory; shuffles and relaxed atomics do not.
#include <cuda_runtime.h>

#include <cstdio>
#include <functional>
#include <map>
#include <string>

namespace {

constexpr int kWarp = 32;

void run(unsigned blocks, unsigned threads, const std::function<void()>& body) {
  const std::string error = moeext_emu::launch({blocks, 1, 1}, {threads, 1, 1}, 0, body);
  if (!error.empty()) moeext_emu::record_error(error);
}

int out[2 * kWarp];  // a thread's result, read by the host after the launch

// Each lane writes its slot, then reads its neighbour's: after a warp sync, and after a shuffle
// only, which lets no lane run ahead of the others yet orders no memory.
void neighbour_after(bool warp_sync) {
  run(1, kWarp, [=] {
    static int shared[kWarp];
    const int lane = int(threadIdx.x);
    shared[lane] = lane;
    if (warp_sync) {
      __syncwarp();
    } else {
      (void)__shfl_sync(0xffffffffu, lane, 0);
    }
    out[lane] = shared[(lane + 1) % kWarp];
  });
}

// The write after a read (grouped_topk_warp.h's second warp sync): lanes read their
// neighbour's slot, meet at shuffles, and overwrite their own slot for the next round.
void overwrite_after_read(bool warp_sync) {
  run(1, kWarp, [=] {
    static int shared[kWarp];
    const int lane = int(threadIdx.x);
    int v = lane;
    for (int round = 0; round < 2; ++round) {
      shared[lane] = v;
      __syncwarp();
      v += shared[(lane + 1) % kWarp];
      if (warp_sync) __syncwarp();
      v += __shfl_xor_sync(0xffffffffu, v, 1);
    }
    out[lane] = v;
  });
}

// Across warps: a block barrier orders them, a warp sync does not.
void other_warp_after(bool block_barrier) {
  run(1, 2 * kWarp, [=] {
    static int shared[2 * kWarp];
    const int t = int(threadIdx.x);
    shared[t] = t;
    if (block_barrier) {
      __syncthreads();
    } else {
      __syncwarp();
    }
    out[t] = shared[(t + kWarp) % (2 * kWarp)];
  });
}

// Every thread counts into one word: atomically, or with a plain increment.
void count(bool atomic) {
  static unsigned counter = 0;
  run(2, 2 * kWarp, [=] {
    if (atomic) {
      atomicAdd(&counter, 1u);
    } else {
      counter = counter + 1;
    }
  });
}

// What the host wrote before a launch, the kernel reads; what the kernel wrote, the host reads
// after it.
void host_and_launch() {
  static int data[2 * kWarp];
  for (int i = 0; i < 2 * kWarp; ++i) data[i] = i;
  run(1, 2 * kWarp, [] { data[threadIdx.x] += 1; });
  for (int i = 0; i < 2 * kWarp; ++i) out[i] = data[i];
}

}  // namespace

int main(int argc, char** argv) {
  const std::map<std::string, std::function<void()>> cases = {
      {"warp-sync", [] { neighbour_after(true); }},
      {"race-shuffle-only", [] { neighbour_after(false); }},
      {"overwrite-after-warp-sync", [] { overwrite_after_read(true); }},
      {"race-overwrite-after-shuffles", [] { overwrite_after_read(false); }},
      {"block-barrier", [] { other_warp_after(true); }},
      {"race-other-warp-after-warp-sync", [] { other_warp_after(false); }},
      {"atomic-count", [] { count(true); }},
      {"race-plain-count", [] { count(false); }},
      {"host-and-launch", host_and_launch},
  };
  const auto found = cases.find(argc > 1 ? argv[1] : "");
  if (found == cases.end()) {
    std::fprintf(stderr, "unknown case\n");
    return 2;
  }
  found->second();
  const std::string error = moeext_emu::take_error();
  if (!error.empty()) {
    std::fprintf(stderr, "launch failed: %s\n", error.c_str());
    return 3;
  }
  int total = 0;
  for (int v : out) total += v;
  std::printf("ok %d\n", total);
  return 0;
}
