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

void biased_grouped_topk_cpu(const BiasedGroupedTopkParams& p, int64_t row_begin,
                             int64_t row_end) {
  if (row_begin >= row_end) return;
  // Six float rows of num_experts (padded to whole 16-lane vectors), the groups' scores and
  // second largest values, the candidate buffers, the key arrays, the kept groups' expert
  // ranges, and for rows in lanes kLaneRows rows of scores. The float arrays are whole
  // multiples of 16 lanes, so each starts a cache line after the buffer's start.
  auto padded = [](int64_t n) { return (n + 15) / 16 * 16; };
  const int64_t row_floats = padded(p.num_experts);
  const int64_t group_floats = padded(p.num_expert_group + cpu::kCandidateSlack);
  const int64_t candidate_slots = padded(cpu::kMaxCandidates + cpu::kCandidateSlack);
  const int64_t chosen_slots = padded(p.topk);
  const bool lane_rows =
      p.num_experts <= cpu::kLaneMaxExperts ||
      (p.scoring_func == ScoringFunc::kSqrtSoftplus &&
       p.num_experts <= cpu::kApproxLaneMaxExperts && row_end - row_begin >= cpu::kLaneRows);
  const int64_t lane_floats = lane_rows ? cpu::kLaneRows * row_floats + 16 : 0;  // + alignment
  const int64_t words = 6 * row_floats + 2 * group_floats + 4 * candidate_slots +
                        chosen_slots + lane_floats;  // 4-byte words
  const int64_t keys = p.topk_group + p.topk;
  const int64_t bytes = words * 4 + keys * int64_t(sizeof(uint64_t)) +
                        p.topk_group * int64_t(sizeof(cpu::ExpertRange));
  // Routers up to E = 1024 in up to 128 groups stay on the stack: no allocation per call;
  // with rows in lanes, those of up to E = 512 (DeepSeek-V4's 256 and 384 experts need
  // 24 and 34 KiB).
  alignas(64) unsigned char stack_buffer[64 * 1024];
  std::unique_ptr<unsigned char[]> heap_buffer;
  unsigned char* buffer = stack_buffer;
  if (bytes > int64_t(sizeof(stack_buffer))) {
    heap_buffer.reset(new unsigned char[bytes]);
    buffer = heap_buffer.get();
  }
  float* f = reinterpret_cast<float*>(buffer);
  cpu::GroupedTopkWorkspace ws;
  ws.scores[0] = f;
  ws.scores[1] = f += row_floats;
  ws.biased[0] = f += row_floats;
  ws.biased[1] = f += row_floats;
  ws.row = f += row_floats;
  ws.bias = f += row_floats;
  ws.group_scores = f += row_floats;
  ws.group_seconds = f += group_floats;
  ws.candidates = f += group_floats;
  ws.candidate_ids = reinterpret_cast<int32_t*>(f += candidate_slots);
  ws.chosen = ws.candidate_ids + candidate_slots;
  ws.score_pieces = p.scoring_func == ScoringFunc::kSqrtSoftplus ? &cpu::sqrt_softplus_pieces()
                                                                 : nullptr;
  ws.group_keys = reinterpret_cast<uint64_t*>(ws.chosen + chosen_slots);
  ws.expert_keys = ws.group_keys + p.topk_group;
  ws.ranges = reinterpret_cast<cpu::ExpertRange*>(ws.expert_keys + p.topk);
  // Last, so the arrays every path uses keep their places.
  ws.candidate_scores = reinterpret_cast<float*>(ws.ranges + p.topk_group);
  ws.candidate_bias = ws.candidate_scores + candidate_slots;
  // Its rows start on cache lines: they are read and written back a whole vector at a time.
  ws.lane_rows = nullptr;
  if (lane_rows) {
    const auto end = reinterpret_cast<uintptr_t>(ws.candidate_bias + candidate_slots);
    ws.lane_rows = reinterpret_cast<float*>((end + 63) / 64 * 64);
  }

  switch (cpu_isa_active()) {
    case CpuIsa::kAvx512Bf16:  // routing has no bf16 dot products: the avx512 copy
    case CpuIsa::kAvx512:
#if defined(MOEEXT_HAVE_AVX512)
      cpu::avx512::biased_grouped_topk(p, row_begin, row_end, ws);
      return;
#endif
    case CpuIsa::kAvx2:
#if defined(MOEEXT_HAVE_AVX2)
      cpu::avx2::biased_grouped_topk(p, row_begin, row_end, ws);
      return;
#endif
    case CpuIsa::kAuto:
    case CpuIsa::kPortable:
      cpu::portable::biased_grouped_topk(p, row_begin, row_end, ws);
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
