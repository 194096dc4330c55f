// Run-time choice of the CPU instruction set, and the launcher API entry points that route
// each call to the copy of a kernel compiled for that instruction set. Compiled with the
// baseline flags only: nothing here may execute an AVX-512 instruction.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

#include "cpu/grouped_topk_isa.h"
#include "cpu/routing_options.h"
#include "cpu/routing_weights_isa.h"
#include "cpu/router_gemm_isa.h"
#include "moeext/common.h"
#include "moeext/grouped_topk.h"
#include "moeext/router_gemm.h"

namespace moeext {
namespace {

#if (defined(MOEEXT_HAVE_AVX2) || defined(MOEEXT_HAVE_AVX512)) && \
    (defined(__x86_64__) || defined(_M_X64))
// CPUID leaf 1, ECX bit 29: clang 14's __builtin_cpu_supports has no "f16c" (a build error).
// Its registers are AVX's, whose OS support the avx2 and avx512f checks include.
bool cpu_has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}
#endif

bool cpu_has_avx512() {
#if defined(MOEEXT_HAVE_AVX512) && (defined(__x86_64__) || defined(_M_X64))
  // libgcc's checks include the OS's XSAVE support for the ZMM state.
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("fma") && cpu_has_f16c();
#else
  return false;
#endif
}

bool cpu_has_avx2() {
#if defined(MOEEXT_HAVE_AVX2) && (defined(__x86_64__) || defined(_M_X64))
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
#else
  return false;
#endif
}

bool cpu_has_avx512bf16() {
#if defined(MOEEXT_HAVE_AVX512BF16) && (defined(__x86_64__) || defined(_M_X64))
  __builtin_cpu_init();
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

bool isa_available(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAuto:
    case CpuIsa::kPortable:
      return true;
    case CpuIsa::kAvx2:
      return cpu_has_avx2();
    case CpuIsa::kAvx512:
      return cpu_has_avx512();
    case CpuIsa::kAvx512Bf16:
      return cpu_has_avx512bf16();
  }
  return false;
}

CpuIsa isa_from_environment() {
  const char* forced = std::getenv("MOEEXT_CPU_ISA");
  if (forced != nullptr) {
    // "scalar" is the portable path's name before 2026-11-28, still accepted.
    if (std::strcmp(forced, "portable") == 0 || std::strcmp(forced, "scalar") == 0) {
      return CpuIsa::kPortable;
    }
    if (std::strcmp(forced, "avx2") == 0 && cpu_has_avx2()) return CpuIsa::kAvx2;
    if (std::strcmp(forced, "avx512") == 0 && cpu_has_avx512()) return CpuIsa::kAvx512;
    if (std::strcmp(forced, "avx512bf16") == 0 && cpu_has_avx512bf16()) {
      return CpuIsa::kAvx512Bf16;
    }
  }
  return cpu_isa_best();
}

std::atomic<CpuIsa>& active_isa() {
  static std::atomic<CpuIsa> isa{isa_from_environment()};
  return isa;
}

}  // namespace

CpuIsa cpu_isa_best() {
  static const CpuIsa best = cpu_has_avx512bf16() ? CpuIsa::kAvx512Bf16
                             : cpu_has_avx512()   ? CpuIsa::kAvx512
                             : cpu_has_avx2()     ? CpuIsa::kAvx2
                                                  : CpuIsa::kPortable;
  return best;
}

bool cpu_isa_supported(CpuIsa isa) { return isa != CpuIsa::kAuto && isa_available(isa); }

CpuIsa cpu_isa_active() { return active_isa().load(std::memory_order_relaxed); }

bool set_cpu_isa(CpuIsa isa) {
  if (!isa_available(isa)) return false;
  active_isa().store(isa == CpuIsa::kAuto ? cpu_isa_best() : isa, std::memory_order_relaxed);
  return true;
}

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAuto:
      return "auto";
    case CpuIsa::kPortable:
      return "portable";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAvx512Bf16:
      return "avx512bf16";
  }
  return "unknown";
}

namespace {

// The copy of the routing kernel an ISA runs, and what its plan needs to know of it.
struct GroupedTopkKernel {
  cpu::GroupedTopkIsa isa;
  void (*route)(const BiasedGroupedTopkParams&, int64_t, int64_t, const cpu::GroupedTopkPlan&,
                const cpu::GroupedTopkWorkspace&);
};

GroupedTopkKernel grouped_topk_kernel(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512Bf16:  // routing has no bf16 dot products: the avx512 copy
    case CpuIsa::kAvx512:
#if defined(MOEEXT_HAVE_AVX512)
      return {cpu::kGroupedTopkAvx512, &cpu::avx512::biased_grouped_topk};
#endif
    case CpuIsa::kAvx2:
#if defined(MOEEXT_HAVE_AVX2)
      return {cpu::kGroupedTopkAvx2, &cpu::avx2::biased_grouped_topk};
#endif
    case CpuIsa::kAuto:
    case CpuIsa::kPortable:
      break;
  }
  return {cpu::kGroupedTopkPortable, &cpu::portable::biased_grouped_topk};
}

}  // namespace

void biased_grouped_topk_cpu(const BiasedGroupedTopkParams& p, int64_t row_begin,
                             int64_t row_end) {
  if (row_begin >= row_end) return;
  const GroupedTopkKernel kernel = grouped_topk_kernel(cpu_isa_active());
  const cpu::GroupedTopkPlan plan = cpu::plan_grouped_topk(p, row_end - row_begin, kernel.isa);
  // Routers up to E = 1024 in up to 128 groups stay on the stack: no allocation per call;
  // with rows in lanes, those of up to E = 512 (DeepSeek-V4's 256 and 384 experts need
  // 24 and 34 KiB).
  alignas(64) unsigned char stack_buffer[64 * 1024];
  std::unique_ptr<unsigned char[]> heap_buffer;
  unsigned char* buffer = stack_buffer;
  if (plan.workspace_bytes > int64_t(sizeof(stack_buffer))) {
    heap_buffer.reset(new unsigned char[plan.workspace_bytes]);
    buffer = heap_buffer.get();
  }
  cpu::GroupedTopkWorkspace ws = cpu::lay_out_grouped_topk_workspace(plan, buffer);
  if (cpu::is_candidate_pass(plan.strategy)) ws.score_pieces = &cpu::sqrt_softplus_pieces();
  kernel.route(p, row_begin, row_end, plan, ws);
  // One test per chunk: a plain call runs nothing of the options.
  if (p.options.any()) cpu::apply_routing_options(p, row_begin, row_end);
}

int64_t routing_weights_cpu_invalid_row(const RoutingWeightsParams& p, int64_t row_begin,
                                        int64_t row_end) {
  auto id_at = [&](int64_t t, int64_t j) -> int64_t {
    const int64_t at = t * p.ids_row_stride + j * p.ids_col_stride;
    switch (p.ids_dtype) {
      case IntType::kInt16: return static_cast<const int16_t*>(p.topk_ids)[at];
      case IntType::kInt32: return static_cast<const int32_t*>(p.topk_ids)[at];
      case IntType::kInt64: return static_cast<const int64_t*>(p.topk_ids)[at];
    }
    return -1;
  };
  // Up to 32 ids a row compare pairwise; more mark a bit per expert (cleared after the row).
  std::unique_ptr<uint64_t[]> seen;
  if (p.k > 32) seen.reset(new uint64_t[(p.num_experts + 63) / 64]());
  for (int64_t t = row_begin; t < row_end; ++t) {
    bool bad = false;
    for (int64_t j = 0; j < p.k && !bad; ++j) {
      const int64_t id = id_at(t, j);
      if (id < 0 || id >= p.num_experts) {
        bad = true;
      } else if (seen) {
        const uint64_t bit = uint64_t(1) << (id % 64);
        bad = (seen[id / 64] & bit) != 0;
        seen[id / 64] |= bit;
      } else {
        for (int64_t i = 0; i < j && !bad; ++i) bad = id_at(t, i) == id;
      }
    }
    if (seen) {
      for (int64_t j = 0; j < p.k; ++j) {
        const int64_t id = id_at(t, j);
        if (id >= 0 && id < p.num_experts) seen[id / 64] = 0;
      }
    }
    if (bad) return t;
  }
  return -1;
}

void routing_weights_cpu(const RoutingWeightsParams& p, int64_t row_begin, int64_t row_end) {
  if (row_begin >= row_end || p.k == 0) return;
  auto padded = [](int64_t n) { return (n + 15) / 16 * 16; };
  const bool softmax = p.scoring_func == ScoringFunc::kSoftmax;
  const int64_t row_floats = softmax ? padded(p.num_experts) : 0;
  const int64_t floats = 3 * row_floats + padded(p.k);
  alignas(64) float stack_buffer[4096];
  std::unique_ptr<float[]> heap_buffer;
  float* buffer = stack_buffer;
  if (floats > int64_t(sizeof(stack_buffer) / sizeof(float))) {
    heap_buffer.reset(new float[floats]);
    buffer = heap_buffer.get();
  }
  const cpu::RoutingWeightsWorkspace ws{buffer, buffer + row_floats, buffer + 2 * row_floats,
                                        buffer + 3 * row_floats};
  switch (cpu_isa_active()) {
    case CpuIsa::kAvx512Bf16:  // the routing kernel's copy: avx512
    case CpuIsa::kAvx512:
#if defined(MOEEXT_HAVE_AVX512)
      cpu::avx512::routing_weights(p, row_begin, row_end, ws);
      return;
#endif
    case CpuIsa::kAvx2:
#if defined(MOEEXT_HAVE_AVX2)
      cpu::avx2::routing_weights(p, row_begin, row_end, ws);
      return;
#endif
    case CpuIsa::kAuto:
    case CpuIsa::kPortable:
      cpu::portable::routing_weights(p, row_begin, row_end, ws);
      return;
  }
}

void router_gemm_cpu(const RouterGemmParams& p, int64_t expert_begin, int64_t expert_end) {
  if (expert_begin >= expert_end || p.num_tokens == 0) return;
  switch (cpu_isa_active()) {
    case CpuIsa::kAvx512Bf16:
#if defined(MOEEXT_HAVE_AVX512BF16)
      cpu::avx512bf16::router_gemm(p, expert_begin, expert_end);
      return;
#endif
    case CpuIsa::kAvx512:
#if defined(MOEEXT_HAVE_AVX512)
      cpu::avx512::router_gemm(p, expert_begin, expert_end);
      return;
#endif
    case CpuIsa::kAvx2:
#if defined(MOEEXT_HAVE_AVX2)
      cpu::avx2::router_gemm(p, expert_begin, expert_end);
      return;
#endif
    case CpuIsa::kAuto:
    case CpuIsa::kPortable:
      cpu::portable::router_gemm(p, expert_begin, expert_end);
      return;
  }
}

int64_t router_gemm_expert_block(const RouterGemmParams& params) {
  switch (cpu_isa_active()) {
    case CpuIsa::kAvx512Bf16:
#if defined(MOEEXT_HAVE_AVX512BF16)
      return cpu::avx512bf16::plan_router_gemm(params).expert_block;
#endif
    case CpuIsa::kAvx512:
#if defined(MOEEXT_HAVE_AVX512)
      return cpu::avx512::plan_router_gemm(params).expert_block;
#endif
    case CpuIsa::kAvx2:
#if defined(MOEEXT_HAVE_AVX2)
      return cpu::avx2::plan_router_gemm(params).expert_block;
#endif
    case CpuIsa::kAuto:
    case CpuIsa::kPortable:
      return cpu::portable::plan_router_gemm(params).expert_block;
  }
  return 1;
}

namespace cpu {

const ScorePieces& sqrt_softplus_pieces() {
  // Built here, in code compiled for no particular ISA, once per process (a thread-safe
  // static): the per-ISA kernel copies only read it.
  static const ScorePieces pieces = build_sqrt_softplus_pieces();
  return pieces;
}

}  // namespace cpu
}  // namespace moeext
