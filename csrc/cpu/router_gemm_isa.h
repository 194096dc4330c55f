// What dispatch.cpp needs to call the per-ISA copies of cpu/router_gemm.cpp.
#pragma once

#include <cstdint>

#include "moeext/router_gemm.h"

namespace moeext::cpu {

// The ways a call runs, chosen by plan_router_gemm.
enum class RouterGemmPath : int8_t {
  kPrepackedTiles,  // a prepacked bf16 weight (cpu/router_weight_pack.h), register tiles of it
  kTokenLanes,      // avx512bf16, bf16, 5 or more tokens: tokens in the vector lanes, and any
                    // 1..4 left over in register tiles
  kRegisterTiles,   // the nn.Linear weight in register tiles
};

// How a per-ISA copy runs a call, decided from the params alone (not the expert range), so
// the path, the thread scratch it needs and the callers' split of the experts come from one
// place. The register tiles keep their partial sums on their own stack (the heap past 16
// token blocks), not in the thread scratch.
struct RouterGemmPlan {
  RouterGemmPath path = RouterGemmPath::kRegisterTiles;
  int64_t lane_tokens = 0;    // kTokenLanes: the leading tokens in lanes
  int64_t scratch_words = 0;  // 4-byte words of the calling thread's scratch the path uses
  int64_t expert_block = 1;   // router_gemm_expert_block(params)
};

#define MOEEXT_DECLARE_ROUTER_GEMM(isa)                                                     \
  namespace isa {                                                                           \
  RouterGemmPlan plan_router_gemm(const RouterGemmParams& p);                               \
  void router_gemm(const RouterGemmParams& p, int64_t expert_begin, int64_t expert_end);    \
  }
MOEEXT_DECLARE_ROUTER_GEMM(portable)
MOEEXT_DECLARE_ROUTER_GEMM(avx2)
MOEEXT_DECLARE_ROUTER_GEMM(avx512)
MOEEXT_DECLARE_ROUTER_GEMM(avx512bf16)
#undef MOEEXT_DECLARE_ROUTER_GEMM

}  // namespace moeext::cpu
