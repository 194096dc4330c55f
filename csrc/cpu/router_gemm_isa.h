// What dispatch.cpp needs to call the per-ISA copies of cpu/router_gemm.cpp.
#pragma once

#include <cstdint>

#include "moeext/router_gemm.h"

namespace moeext::cpu {

#define MOEEXT_DECLARE_ROUTER_GEMM(isa)                                                     \
  namespace isa {                                                                           \
  void router_gemm(const RouterGemmParams& p, int64_t expert_begin, int64_t expert_end);    \
  int router_gemm_expert_block();                                                           \
  }
MOEEXT_DECLARE_ROUTER_GEMM(portable)
MOEEXT_DECLARE_ROUTER_GEMM(avx2)
MOEEXT_DECLARE_ROUTER_GEMM(avx512)
MOEEXT_DECLARE_ROUTER_GEMM(avx512bf16)
#undef MOEEXT_DECLARE_ROUTER_GEMM

}  // namespace moeext::cpu
