// Part of cpu/router_gemm.cpp: how the kernels multiply and add for the instruction set this
// copy is compiled for, one file per ISA picked here (as cpu/vec.h picks the vector layer).
// Each file holds
//   Dot<T>            kStep consecutive elements of one token and one nn.Linear weight row into
//                     an accumulator of per-lane partial sums (the register tiles);
//   packed::PairDot   one bf16 pair of a token, broadcast, times a vector of experts' pairs of
//                     the prepacked weight (cpu/router_weight_pack.h);
//   kVectorRegisters  and MOEEXT_TILE_UNROLL, which size and shape the register tiles.
// bf16 is widened by shifting except on avx512bf16: the even elements are the 32-bit lanes
// shifted left by 16, the odd ones the lanes with the low half cleared, and both operands
// split the same way, so two FMAs cover a vector of pairs with no permutation. fp16 and fp32
// widen to fp32 and use FMAs. Products of two bf16 or two fp16 values are exact in fp32; only
// the accumulation rounds.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu/isa_id.h"
#include "cpu/types.h"

namespace moeext::cpu::MOEEXT_CPU_ISA {
namespace {

// AVX2 and the portable path have no 16-bit masked loads: the last partial step reads a
// zero-padded copy of its n < N elements.
template <typename T, int N>
inline const T* zero_padded(const T* p, int64_t n, T (&buffer)[N]) {
  std::memset(buffer, 0, sizeof(buffer));
  std::memcpy(buffer, p, size_t(n) * sizeof(T));
  return buffer;
}

}  // namespace
}  // namespace moeext::cpu::MOEEXT_CPU_ISA

#if MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_avx512bf16
#include "cpu/router_gemm_dot_avx512bf16.h"
#elif MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_avx512
#include "cpu/router_gemm_dot_avx512.h"
#elif MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_avx2
#include "cpu/router_gemm_dot_avx2.h"
#elif MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_portable
#include "cpu/router_gemm_dot_portable.h"
#else
#error "no router GEMM dot products for this MOEEXT_CPU_ISA"
#endif
