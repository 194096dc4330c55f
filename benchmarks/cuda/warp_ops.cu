// What the routing warp kernel's steps cost on the GPU it runs on (issue #51): the latency of
// each warp operation an argmax round is made of, in a dependent chain on one warp, and its
// throughput with every multiprocessor full, in warp operations per cycle per
// multiprocessor. The argmax rounds and the sigmoid are the kernel's own functions
// (csrc/gpu/grouped_topk_warp.h, grouped_topk_device.h): the current kernel's round over
// sorted lanes, and variant 1's over every expert a lane holds (kVariant). Cycles are the
// multiprocessor's own (clock64), so the figures do not depend on the clock the GPU runs at.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -Icsrc/include -Icsrc benchmarks/cuda/warp_ops.cu \
//        -o warp_ops && ./warp_ops
//
// A decode token runs topk rounds back to back (latency); a prefill batch keeps every
// multiprocessor busy with many tokens (throughput). The per-token figures of the kernel are
// the rounds' times topk, plus the scores' (experts a lane per sigmoid chain). Every round
// row refills its experts every 8 rounds (a token's top-8), that cost included. The last row
// is per thread, not per warp: a row routed by one thread pays it once per expert it ranks.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "gpu/compat.h"
#include "gpu/grouped_topk_warp.h"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "warp_ops times redux.sync, which needs sm_80 or newer: build it with -arch=sm_80 or above"
#endif

namespace {

using moeext::ScoringFunc;
using moeext::gpu::grouped_topk::elementwise_score;
using moeext::gpu::grouped_topk::round_winner;
using moeext::gpu::grouped_topk::SlotOrder;
using moeext::gpu::grouped_topk::sort_lane;
using moeext::gpu::grouped_topk::sorted_round_winner;

constexpr int kWarp = 32;
constexpr int kThreads = 256;
constexpr int kChains = 4;  // independent chains a warp interleaves in the throughput runs
constexpr int kLatencyIters = 4096;
constexpr int kThroughputIters = 2048;
constexpr unsigned kAll = 0xffffffffu;

__device__ __forceinline__ uint32_t lane_id() { return threadIdx.x % kWarp; }

__device__ __forceinline__ uint32_t smid() {
  uint32_t id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

// Each op maps a state to the next one; the chain's every step depends on the last.
struct ReduxMax {
  static constexpr const char* kName = "redux.sync max (u32)";
  __device__ static uint32_t step(uint32_t x) { return __reduce_max_sync(kAll, x) + lane_id(); }
};
struct ReduxMin {
  static constexpr const char* kName = "redux.sync min (u32)";
  __device__ static uint32_t step(uint32_t x) { return __reduce_min_sync(kAll, x) + lane_id(); }
};
struct ShflIdx {
  static constexpr const char* kName = "shfl.sync idx";
  __device__ static uint32_t step(uint32_t x) { return __shfl_sync(kAll, x, int(x % kWarp)) + 1; }
};
struct ShflXor {
  static constexpr const char* kName = "shfl.sync bfly";
  __device__ static uint32_t step(uint32_t x) { return __shfl_xor_sync(kAll, x, 1) + lane_id(); }
};
struct Ballot {
  static constexpr const char* kName = "vote.sync ballot";
  __device__ static uint32_t step(uint32_t x) {
    return __ballot_sync(kAll, (x >> lane_id()) & 1u) + lane_id();
  }
};
struct IntMad {
  static constexpr const char* kName = "integer multiply-add";
  __device__ static uint32_t step(uint32_t x) { return x * 3u + lane_id(); }
};
// The kernel's exact sigmoid (expf and an IEEE reciprocal), on values kept in [-4, 4).
struct Sigmoid {
  static constexpr const char* kName = "sigmoid, exact (one expert)";
  __device__ static uint32_t step(uint32_t x) {
    const float v = float(int(x % 8192u)) * (1.0f / 1024.0f) - 4.0f;
    return __float_as_uint(elementwise_score(ScoringFunc::kSigmoid, v));
  }
};

// A chain of one op: its state is the op's last value, never refilled.
template <typename Op>
struct OpChain {
  static constexpr int V = 1;
  static constexpr int kRefill = 0;
  uint32_t x;
  __device__ void fill(uint32_t seed) { x = seed * 2654435761u; }
  __device__ uint32_t step(int) {
    x = Op::step(x);
    return 0u;
  }
  __device__ uint32_t result() const { return x; }
};

// One argmax round of the warp kernel's variant 1 (and of the current kernel past 16 experts a
// lane): the winner of V experts a lane, then its removal, as route_tokens_per_warp does. The
// values are refilled from the winner every topk = 8 rounds, so each round has experts in play.
template <int kV>
struct Round {
  static constexpr int V = kV;
  static constexpr int kRefill = 8;
  uint32_t value[V];
  __device__ void fill(uint32_t seed) {
#pragma unroll
    for (int i = 0; i < V; ++i) value[i] = (seed * 2654435761u + uint32_t(i) * 40503u) | 1u;
  }
  __device__ uint32_t step(int first) {
    const uint32_t id = round_winner<kWarp, V>(value, first);
#pragma unroll
    for (int i = 0; i < V; ++i) value[i] = uint32_t(first + i) == id ? 0u : value[i];
    return id;
  }
  __device__ uint32_t result() const { return value[0]; }
};

// The current kernel's argmax round (sorted lanes): each lane sorts its V experts once a token
// (sort_lane, refill included), after which a round compares the lanes' first experts only
// (sorted_round_winner). The same winner as round_winner's.
template <int kV>
struct SortedRound {
  static constexpr int V = kV;
  static constexpr int kRefill = 8;
  uint32_t value[V];
  SlotOrder<V> order;
  __device__ void fill(uint32_t seed) {
#pragma unroll
    for (int i = 0; i < V; ++i) value[i] = (seed * 2654435761u + uint32_t(i) * 40503u) | 1u;
    order = sort_lane(value);
  }
  __device__ uint32_t step(int first) {
    return sorted_round_winner<kWarp>(value, order, first, int(lane_id()));
  }
  __device__ uint32_t result() const { return value[0]; }
};

// A thread's sorted top-8 (larger first, the earlier expert first on a tie) taking one more
// expert, branch-free: the cost per expert of routing a whole row in one thread, the other
// way to spend a prefill batch's instructions. One step inserts one value; every 32 the list
// restarts empty.
struct InsertTop8 {
  static constexpr int V = 8;
  static constexpr int kRefill = 32;
  uint32_t value[V];
  uint32_t expert[V];
  uint32_t count;
  __device__ void fill(uint32_t) {
#pragma unroll
    for (int i = 0; i < V; ++i) value[i] = expert[i] = 0u;
    count = 0;
  }
  __device__ uint32_t step(int) {
    const uint32_t x = (count * 2654435761u + lane_id() * 40503u + value[V - 1]) | 1u;
    // Strictly larger only: a tie keeps the earlier expert ahead.
    bool above[V];
#pragma unroll
    for (int i = 0; i < V; ++i) above[i] = x > value[i];
#pragma unroll
    for (int i = V - 1; i > 0; --i) {
      value[i] = above[i - 1] ? value[i - 1] : (above[i] ? x : value[i]);
      expert[i] = above[i - 1] ? expert[i - 1] : (above[i] ? count : expert[i]);
    }
    value[0] = above[0] ? x : value[0];
    expert[0] = above[0] ? count : expert[0];
    ++count;
    return expert[V - 1];
  }
  __device__ uint32_t result() const { return value[0]; }
};

// kChainsT chains of R side by side in every thread, each step's result accumulated (and used
// to refill a chain every R::kRefill steps, where R refills); the block's start and end clocks
// and its multiprocessor go to span.
template <typename R, int kChainsT>
__global__ void chain_kernel(int iters, uint32_t seed, uint32_t* sink, long long* span) {
  R r[kChainsT];
  const int first = int(lane_id()) * R::V;
#pragma unroll
  for (int c = 0; c < kChainsT; ++c) r[c].fill(threadIdx.x + seed + uint32_t(c));
  uint32_t acc[kChainsT] = {};
  __syncthreads();
  const long long start = clock64();
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int c = 0; c < kChainsT; ++c) acc[c] += r[c].step(first);
    if constexpr (R::kRefill > 0) {
      if (i % R::kRefill == R::kRefill - 1) {
#pragma unroll
        for (int c = 0; c < kChainsT; ++c) r[c].fill(acc[c]);
      }
    }
  }
  const long long end = clock64();
  uint32_t folded = 0;
#pragma unroll
  for (int c = 0; c < kChainsT; ++c) folded ^= acc[c] ^ r[c].result();
  sink[blockIdx.x * blockDim.x + threadIdx.x] = folded;
  if (threadIdx.x == 0) {
    span[3 * blockIdx.x] = start;
    span[3 * blockIdx.x + 1] = end;
    span[3 * blockIdx.x + 2] = smid();
  }
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "warp_ops: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

struct Result {
  double latency;     // cycles per step of one chain, one warp alone
  double throughput;  // warp steps per cycle per multiprocessor, all of them full
};

// Latency: one block of one warp running one chain, cycles per step. Throughput: every
// multiprocessor given `blocks_per_sm` blocks of kThreads, each warp running kChains chains
// side by side, its steps counted over the span its multiprocessor was busy.
template <typename LatencyLaunch, typename ThroughputLaunch>
Result measure(const LatencyLaunch& latency, const ThroughputLaunch& throughput, int sms,
               int blocks_per_sm) {
  uint32_t* sink;
  long long* span;
  const int max_blocks = sms * blocks_per_sm;
  check(cudaMalloc(&sink, sizeof(uint32_t) * max_blocks * kThreads), "cudaMalloc");
  check(cudaMalloc(&span, sizeof(long long) * 3 * max_blocks), "cudaMalloc");
  std::vector<long long> host(3 * max_blocks);
  Result r{};
  latency(64, sink, span);  // warm-up
  latency(kLatencyIters, sink, span);
  check(cudaDeviceSynchronize(), "latency run");
  check(cudaMemcpy(host.data(), span, sizeof(long long) * 3, cudaMemcpyDeviceToHost), "copy");
  r.latency = double(host[1] - host[0]) / kLatencyIters;

  throughput(max_blocks, sink, span);
  check(cudaDeviceSynchronize(), "throughput run");
  check(cudaMemcpy(host.data(), span, sizeof(long long) * 3 * max_blocks,
                   cudaMemcpyDeviceToHost), "copy");
  // Per multiprocessor: its blocks' steps over the span from its first start to its last end.
  constexpr int kMaxSms = 1024;
  std::vector<long long> lo(kMaxSms, -1), hi(kMaxSms, -1);
  std::vector<int> count(kMaxSms, 0);
  for (int b = 0; b < max_blocks; ++b) {
    const int sm = int(host[3 * b + 2]) % kMaxSms;
    if (lo[sm] < 0 || host[3 * b] < lo[sm]) lo[sm] = host[3 * b];
    if (host[3 * b + 1] > hi[sm]) hi[sm] = host[3 * b + 1];
    ++count[sm];
  }
  double sum = 0;
  int used = 0;
  for (int sm = 0; sm < kMaxSms; ++sm) {
    if (count[sm] == 0 || hi[sm] <= lo[sm]) continue;
    const double steps = double(count[sm]) * (kThreads / kWarp) * kThroughputIters * kChains;
    sum += steps / double(hi[sm] - lo[sm]);
    ++used;
  }
  r.throughput = used ? sum / used : 0;
  check(cudaFree(sink), "cudaFree");
  check(cudaFree(span), "cudaFree");
  return r;
}

void print_row(const char* name, const Result& r) {
  std::printf("| %-36s | %8.1f | %8.2f |\n", name, r.latency, r.throughput);
}

template <typename R>
void row(int sms, int blocks_per_sm, const char* name) {
  const Result r = measure(
      [name](int iters, uint32_t* sink, long long* span) {
        chain_kernel<R, 1><<<1, kWarp>>>(iters, 12345u, sink, span);
        check(cudaGetLastError(), name);
      },
      [name](int blocks, uint32_t* sink, long long* span) {
        chain_kernel<R, kChains><<<blocks, kThreads>>>(kThroughputIters, 12345u, sink, span);
        check(cudaGetLastError(), name);
      },
      sms, blocks_per_sm);
  print_row(name, r);
}

template <typename Op>
void op_row(int sms, int blocks_per_sm) {
  row<OpChain<Op>>(sms, blocks_per_sm, Op::kName);
}

}  // namespace

int main() {
  int device = 0, sms = 0, major = 0, minor = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "attribute");
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "attribute");
  check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "attribute");
  cudaDeviceProp props;
  check(cudaGetDeviceProperties(&props, device), "cudaGetDeviceProperties");
  constexpr int kBlocksPerSm = 4;  // 32 warps a multiprocessor: as many as the kernel gets
  std::printf("# %s (sm_%d%d, %d SMs); cycles are the multiprocessor's (clock64)\n", props.name,
              major, minor, sms);
  std::printf("# latency: cycles per step of one chain on one warp; throughput: warp steps per\n"
              "# cycle per SM, %d blocks of %d threads on each, %d chains a warp\n",
              kBlocksPerSm, kThreads, kChains);
  std::printf("| op | latency (cycles) | throughput (warp ops / cycle / SM) |\n|---|---:|---:|\n");
  op_row<IntMad>(sms, kBlocksPerSm);
  op_row<ShflXor>(sms, kBlocksPerSm);
  op_row<ShflIdx>(sms, kBlocksPerSm);
  op_row<Ballot>(sms, kBlocksPerSm);
  op_row<ReduxMax>(sms, kBlocksPerSm);
  op_row<ReduxMin>(sms, kBlocksPerSm);
  op_row<Sigmoid>(sms, kBlocksPerSm);
  row<SortedRound<8>>(sms, kBlocksPerSm, "argmax round, 8 a lane, current (sorted)");
  row<Round<8>>(sms, kBlocksPerSm, "argmax round, 8 a lane, variant 1");
  row<SortedRound<12>>(sms, kBlocksPerSm, "argmax round, 12 a lane, current (sorted)");
  row<Round<12>>(sms, kBlocksPerSm, "argmax round, 12 a lane, variant 1");
  row<InsertTop8>(sms, kBlocksPerSm, "one thread: insert into a sorted top-8");
  return 0;
}
