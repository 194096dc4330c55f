// Router GEMM on the CPU (SPEC.md section 2), compiled once per ISA (see cpu/isa_id.h).
// One translation unit per ISA, its parts headers included in this order: the hot loops then
// compile as they did in one file, where moving code around made GCC 12 spill accumulators.
//   cpu/router_gemm_dot.h     the ISA's dot products (one file per ISA, picked there)
//   cpu/router_gemm_tiles.h   the nn.Linear weight in register tiles
//   cpu/router_gemm_lanes.h   avx512bf16 only: bf16 tokens in the vector lanes
//   cpu/router_gemm_packed.h  the prepacked weight (its layout: cpu/router_weight_pack.h)
// Here: the plan of a call (which of them runs, the scratch it needs), and the dtype switches.
//
// GCC 12's AVX-512 headers start shifts and extracts from a self-initialised "undefined"
// vector and then warn about it once inlined (GCC bug 105593, fixed in 12.3).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <type_traits>

#include "cpu/isa_id.h"
#include "cpu/router_gemm_dot.h"
#include "cpu/router_gemm_isa.h"
#include "cpu/router_gemm_tiles.h"
#include "cpu/types.h"
#include "moeext/router_gemm.h"
#if MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_avx512bf16
#include "cpu/router_gemm_lanes.h"
#endif
#include "cpu/router_gemm_packed.h"

namespace moeext::cpu::MOEEXT_CPU_ISA {

RouterGemmPlan plan_router_gemm(const RouterGemmParams& p) {
  RouterGemmPlan plan;
  plan.expert_block = p.weight_prepacked ? kRouterPackTile : kExpertBlock;
  if (p.input_dtype != DType::kBFloat16) return plan;
  if (p.weight_prepacked) {
    plan.path = RouterGemmPath::kPrepackedTiles;
    plan.scratch_words = packed::scratch_floats(p.num_tokens);
    return plan;
  }
#if MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_avx512bf16
  plan.lane_tokens = lanes::leading_tokens(p.num_tokens);
  if (plan.lane_tokens > 0) {
    plan.path = RouterGemmPath::kTokenLanes;
    plan.scratch_words = lanes::scratch_words(p.hidden_size);
  }
#endif
  return plan;
}

namespace {

// The calling thread's scratch, 64-byte aligned, of at least `words` dwords: grown, never
// shrunk, and shared by both output dtypes and both users (the token packing of namespace
// lanes, the partial sums of namespace packed).
inline uint32_t* thread_scratch(int64_t words) {
  thread_local std::unique_ptr<uint32_t, void (*)(void*)> scratch{nullptr, std::free};
  thread_local int64_t capacity = 0;
  if (capacity < words) {
    const size_t bytes = size_t(words) * sizeof(uint32_t);
    scratch.reset(static_cast<uint32_t*>(std::aligned_alloc(64, (bytes + 64) / 64 * 64)));
    if (scratch == nullptr) throw std::bad_alloc();
    capacity = words;
  }
  return scratch.get();
}

template <typename In, typename Out>
void run(const RouterGemmParams& p, int64_t expert_begin, int64_t expert_end) {
  const RouterGemmPlan plan = plan_router_gemm(p);
  uint32_t* const scratch = plan.scratch_words > 0 ? thread_scratch(plan.scratch_words) : nullptr;
  switch (plan.path) {
    case RouterGemmPath::kPrepackedTiles:
      if constexpr (std::is_same_v<In, bf16_t>) {
        packed::run<Out>(p, expert_begin, expert_end, reinterpret_cast<float*>(scratch));
      }
      return;
    case RouterGemmPath::kTokenLanes:
#if MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_avx512bf16
      if constexpr (std::is_same_v<In, bf16_t>) {
        RouterGemmParams leading = p;
        leading.num_tokens = plan.lane_tokens;
        lanes::run<Out>(leading, expert_begin, expert_end, scratch);
        if (plan.lane_tokens == p.num_tokens) return;
        RouterGemmParams rest = p;
        rest.hidden_states =
            static_cast<const In*>(p.hidden_states) + plan.lane_tokens * p.hidden_row_stride;
        rest.logits = static_cast<Out*>(p.logits) + plan.lane_tokens * p.logits_row_stride;
        rest.num_tokens = p.num_tokens - plan.lane_tokens;
        run_tiles<In, Out>(rest, expert_begin, expert_end);
      }
#endif
      return;
    case RouterGemmPath::kRegisterTiles:
      run_tiles<In, Out>(p, expert_begin, expert_end);
      return;
  }
}

template <typename In>
void run_for_output(const RouterGemmParams& p, int64_t expert_begin, int64_t expert_end) {
  switch (p.logits_dtype) {
    case DType::kBFloat16:
      run<In, bf16_t>(p, expert_begin, expert_end);
      return;
    case DType::kFloat32:
    case DType::kFloat16:  // rejected by the bindings
      run<In, float>(p, expert_begin, expert_end);
      return;
  }
}

}  // namespace

void router_gemm(const RouterGemmParams& p, int64_t expert_begin, int64_t expert_end) {
  switch (p.input_dtype) {
    case DType::kBFloat16:
      run_for_output<bf16_t>(p, expert_begin, expert_end);
      return;
    case DType::kFloat16:
      run_for_output<fp16_t>(p, expert_begin, expert_end);
      return;
    case DType::kFloat32:
      run_for_output<float>(p, expert_begin, expert_end);
      return;
  }
}

}  // namespace moeext::cpu::MOEEXT_CPU_ISA
