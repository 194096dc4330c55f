// The emulation's own checks (tests/test_gpu_emulation.py builds and runs this with
// runtime.cpp): barriers and warp collectives give what the GPU gives, and the faults the
// emulation exists to find are reported: a barrier some thread never reaches, lanes at
// different collectives, and a shared-memory read that is missing its barrier (stale in one of
// the run orders).
#include <hip/hip_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

int failures = 0;

void expect(bool ok, const char* what) {
  if (!ok) {
    std::printf("FAILED: %s\n", what);
    ++failures;
  }
}

std::string run(unsigned blocks, unsigned threads, const std::function<void()>& body) {
  return moeext_emu::launch({blocks, 1, 1}, {threads, 1, 1}, 0, body);
}

// Each thread writes its index, a barrier, then reads its neighbour's: right in every order.
void barrier_orders_the_block() {
  for (int order = 0; order < 3; ++order) {
    moeext_emu::settings().order = moeext_emu::Order(order);
    std::vector<int> out(256, -1);
    const std::string error = run(2, 128, [&] {
      static int shared[128];
      const int t = int(threadIdx.x);
      shared[t] = t + 1000 * int(blockIdx.x);
      __syncthreads();
      out[size_t(blockIdx.x) * 128 + size_t(t)] = shared[(t + 1) % 128];
      __syncthreads();
    });
    expect(error.empty(), "a barrier every thread reaches");
    bool ok = true;
    for (int b = 0; b < 2; ++b) {
      for (int t = 0; t < 128; ++t) ok &= out[size_t(b * 128 + t)] == (t + 1) % 128 + 1000 * b;
    }
    expect(ok, "reads after the barrier see every thread's write");
  }
}

// The same without the barrier: some order must read a value not yet written.
void missing_barrier_reads_stale_data() {
  bool stale = false;
  for (int order = 0; order < 3; ++order) {
    moeext_emu::settings().order = moeext_emu::Order(order);
    std::vector<int> out(64, -1);
    run(1, 64, [&] {
      static int shared[64];
      const int t = int(threadIdx.x);
      shared[t] = -1;
      __syncthreads();
      shared[t] = t;
      out[size_t(t)] = shared[(t + 1) % 64];  // no barrier between the write and the read
    });
    for (int t = 0; t < 64; ++t) stale |= out[size_t(t)] != (t + 1) % 64;
  }
  expect(stale, "a read missing its barrier is stale in one of the orders");
}

void warp_collectives() {
  moeext_emu::settings().order = moeext_emu::Order::kShuffled;
  const int width = moeext_emu::settings().warp_size;
  std::vector<int> xor1(128), from3(128), sum(128);
  std::vector<unsigned long long> ballot(128);
  moeext_emu::reset_counts();
  const std::string error = run(1, 128, [&] {
    const int t = int(threadIdx.x);
    xor1[size_t(t)] = __shfl_xor(t, 1);
    from3[size_t(t)] = __shfl(t * 10, 3);
    int s = t % width;
    for (int m = width / 2; m > 0; m /= 2) s += __shfl_xor(s, m);
    sum[size_t(t)] = s;
    ballot[size_t(t)] = __ballot(t % 3 == 0);
  });
  expect(error.empty(), "warp collectives every lane reaches");
  bool ok = true;
  for (int t = 0; t < 128; ++t) {
    const int warp_base = t / width * width;
    unsigned long long expected_ballot = 0;
    for (int l = 0; l < width; ++l) {
      if ((warp_base + l) % 3 == 0) expected_ballot |= 1ull << l;
    }
    ok &= xor1[size_t(t)] == (t ^ 1);
    ok &= from3[size_t(t)] == (warp_base + 3) * 10;
    ok &= sum[size_t(t)] == width * (width - 1) / 2;
    ok &= ballot[size_t(t)] == expected_ballot;
  }
  expect(ok, "shuffles, a butterfly sum and a ballot, per warp");
  const int warps = 128 / width;
  int rounds = 0;
  for (int m = width / 2; m > 0; m /= 2) ++rounds;
  const moeext_emu::Counts& c = moeext_emu::counts();
  expect(c.shuffles == uint64_t(warps * (2 + rounds)) && c.ballots == uint64_t(warps) &&
             c.block_barriers == 0 && c.gathers == 0,
         "each warp's collectives counted once");
}

void faults_are_reported() {
  moeext_emu::settings().order = moeext_emu::Order::kForward;
  std::string error = run(1, 64, [] {
    if (threadIdx.x == 0) return;
    __syncthreads();  // thread 0 has exited: the others still meet
  });
  expect(error.empty(), "a barrier counts the threads still running");

  error = run(1, 64, [] {
    if (threadIdx.x == 32) {
      moeext_emu::sync_warp();  // waits for its warp, which waits at the barrier for it
    } else {
      __syncthreads();
    }
  });
  expect(error.find("deadlock") != std::string::npos, "a barrier half the block never reaches");

  error = run(1, 32, [] {
    if (threadIdx.x % 2 == 0) {
      (void)__shfl_xor(1, 1);
    } else {
      (void)__ballot(true);
    }
  });
  expect(error.find("different warp collectives") != std::string::npos,
         "lanes at different collectives");

  error = run(1, 32, [] {
    if (threadIdx.x == 5) return;
    (void)__shfl_xor(1, 1);
  });
  expect(!error.empty(), "a warp collective with a lane gone");
}

}  // namespace

int main() {
  barrier_orders_the_block();
  missing_barrier_reads_stale_data();
  warp_collectives();
  faults_are_reported();
  if (failures == 0) std::printf("ok\n");
  return failures == 0 ? 0 : 1;
}
