// CPU implementations of the moeext ops: validate, fill the launcher params, split the rows
// over torch's intra-op thread pool.
#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#include <tuple>

#include "moeext/grouped_topk.h"
#include "moeext/mxfp4_shuffle.h"
#include "moeext/router_gemm.h"
#include "moeext/zero_tail.h"
#include "torch/parallel.h"
#include "torch/params.h"

namespace moeext::torch_glue {
namespace {

void check_cpu(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", arg, " must be a CPU tensor here, got ", t.device());
}

// A contiguous output straight from the CPU allocator. at::empty's trip through the
// dispatcher cost ~0.15 us per tensor here: 8% of a decode-sized routing call, which
// allocates two.
at::Tensor empty_output(at::IntArrayRef sizes, at::ScalarType dtype) {
  return at::detail::empty_cpu(sizes, dtype, /*pin_memory=*/false,
                               /*memory_format_opt=*/std::nullopt);
}

void run_grouped_topk_cpu(const BiasedGroupedTopkParams& p) {
  const int64_t grain = biased_grouped_topk_cpu_grain(p.num_experts);
  // One chunk runs here: parallel_for's set-up and thread-state guards cost 25-35 ns of a
  // one-token call.
  if (p.num_tokens <= grain) {
    biased_grouped_topk_cpu(p, 0, p.num_tokens);
    return;
  }
  parallel_for(0, p.num_tokens, grain, [&](int64_t begin, int64_t end) {
    biased_grouped_topk_cpu(p, begin, end);
  });
}

void biased_grouped_topk_out_cpu(const at::Tensor& gating_output,
                                 const std::optional<at::Tensor>& correction_bias,
                                 const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                                 int64_t num_expert_group, int64_t topk_group, bool renormalize,
                                 double routed_scaling_factor, c10::string_view scoring_func) {
  constexpr const char* op = "biased_grouped_topk_out";
  check_cpu(gating_output, op, "gating_output");
  run_grouped_topk_cpu(make_grouped_topk_params(
      gating_output, correction_bias, topk_weights, topk_ids, num_expert_group, topk_group,
      renormalize, routed_scaling_factor,
      std::string_view(scoring_func.data(), scoring_func.size()), op));
}

std::tuple<at::Tensor, at::Tensor> biased_grouped_topk_impl_cpu(
    const at::Tensor& gating_output, const std::optional<at::Tensor>& correction_bias,
    int64_t num_expert_group, int64_t topk_group, int64_t topk, bool renormalize,
    double routed_scaling_factor, c10::string_view scoring_func) {
  constexpr const char* op = "biased_grouped_topk";
  check_cpu(gating_output, op, "gating_output");
  const ScoringFunc scoring = check_grouped_topk_inputs(
      gating_output, correction_bias, num_expert_group, topk_group, topk,
      std::string_view(scoring_func.data(), scoring_func.size()), op);
  const int64_t num_tokens = gating_output.size(0);
  at::Tensor topk_weights = empty_output({num_tokens, topk}, at::kFloat);
  at::Tensor topk_ids = empty_output({num_tokens, topk}, at::kInt);
  // The outputs are ours and the inputs checked once above: no second validation.
  run_grouped_topk_cpu(fill_grouped_topk_params(gating_output, correction_bias, topk_weights,
                                                topk_ids, num_expert_group, topk_group,
                                                renormalize, routed_scaling_factor, scoring));
  return {topk_weights, topk_ids};
}

at::Tensor router_gemm_cpu_impl(const at::Tensor& hidden_states, const at::Tensor& weight,
                                std::optional<at::ScalarType> out_dtype) {
  constexpr const char* op = "router_gemm";
  check_cpu(hidden_states, op, "hidden_states");
  const at::ScalarType logits_dtype =
      check_router_gemm_inputs(hidden_states, weight, out_dtype, op);
  at::Tensor logits =
      empty_output({hidden_states.size(0), router_gemm_num_experts(weight)}, logits_dtype);
  const RouterGemmParams p = make_router_gemm_params(hidden_states, weight, logits);
  if (p.num_tokens == 0 || p.num_experts == 0) return logits;
  // Threads split the experts, so each streams its own slice of the weight once and computes
  // every token for it (a prepacked weight at its tiles).
  const int64_t block = router_gemm_expert_block(p);
  const int64_t num_blocks = (p.num_experts + block - 1) / block;
  const int64_t grain = router_gemm_cpu_grain(p, block);
  parallel_for(0, num_blocks, grain, [&](int64_t begin, int64_t end) {
    router_gemm_cpu(p, begin * block, std::min(end * block, p.num_experts));
  });
  return logits;
}

// Zeroing streams at memory speed: below ~1 MiB a second thread costs more than it saves.
void zero_rows_parallel(const ZeroRowsParams& p) {
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 20) / std::max<int64_t>(1, p.row_bytes));
  parallel_for(p.row_begin, p.row_end, grain, [&](int64_t begin, int64_t end) {
    zero_rows_cpu(p, begin, end);
  });
}

void zero_tail_cpu(const at::Tensor& buf, int64_t new_extent, int64_t prev_extent) {
  constexpr const char* op = "zero_tail_";
  check_cpu(buf, op, "buf");
  zero_rows_parallel(make_zero_tail_params(buf, new_extent, prev_extent, op));
}

void zero_tail_tracked_cpu(const at::Tensor& buf, const at::Tensor& state, int64_t new_extent) {
  constexpr const char* op = "zero_tail_tracked_";
  check_cpu(buf, op, "buf");
  check_zero_tail_state(buf, state, op);
  TORCH_CHECK(new_extent >= 0, op, ": new_extent must be >= 0, got ", new_extent);
  int64_t* stored = state.data_ptr<int64_t>();
  // A negative stored extent cannot be rejected on a device without a host sync, so every
  // backend reads it as 0.
  const int64_t prev_extent = std::max<int64_t>(0, *stored);
  zero_rows_parallel(make_zero_tail_params(buf, new_extent, prev_extent, op, &state));
  *stored = new_extent;
}

// A fresh multi-hundred-MiB output spends more time in 4 KiB page faults than in the
// shuffle itself (measured: 215 ms to first-touch 470 MB, 60 ms to copy into touched
// memory). Asking for transparent huge pages before the first touch removes most of them;
// where THP is off or unsupported the hint is ignored.
void advise_huge_pages(const at::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t end = begin + t.nbytes();
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t last = end & ~(kHuge - 1);
  if (t.nbytes() >= (size_t(16) << 20) && last > first) {
    madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
  }
#else
  (void)t;
#endif
}

// The shuffles stream at memory speed; ~1 MiB per task amortises a thread wake-up.
int64_t grain_for(int64_t bytes_per_item) {
  return std::max<int64_t>(1, (int64_t(1) << 20) / std::max<int64_t>(1, bytes_per_item));
}

at::Tensor shuffle_weight_impl(const at::Tensor& w, at::IntArrayRef layout, bool gate_up,
                               bool inverse) {
  const char* op = inverse ? "unshuffle_weight" : "shuffle_weight";
  check_cpu(w, op, "w");
  at::Tensor out = empty_output(w.sizes(), w.scalar_type());
  advise_huge_pages(out);
  if (!inverse) {
    const at::Tensor src = shuffle_weight_source(w);
    const ShuffleWeightParams p =
        make_shuffle_weight_params(src, out.data_ptr(), layout, gate_up, op);
    parallel_for(0, p.batch * p.rows / p.band, grain_for(p.band * p.row_bytes),
                 [&](int64_t begin, int64_t end) { shuffle_weight_cpu(p, begin, end); });
  } else {
    // The shuffled layout is defined on dense memory: read a dense copy if w is a view.
    const at::Tensor src = w.contiguous();
    ShuffleWeightParams p =
        make_shuffle_weight_params(out, const_cast<void*>(src.data_ptr()), layout, gate_up, op);
    parallel_for(0, p.batch * p.rows / p.band, grain_for(p.band * p.row_bytes),
                 [&](int64_t begin, int64_t end) { unshuffle_weight_cpu(p, begin, end); });
  }
  return out;
}

at::Tensor shuffle_weight_cpu_op(const at::Tensor& w, at::IntArrayRef layout, bool gate_up) {
  return shuffle_weight_impl(w, layout, gate_up, /*inverse=*/false);
}

at::Tensor unshuffle_weight_cpu_op(const at::Tensor& w, at::IntArrayRef layout, bool gate_up) {
  return shuffle_weight_impl(w, layout, gate_up, /*inverse=*/true);
}

at::Tensor e8m0_shuffle_cpu_op(const at::Tensor& scale, bool gate_up,
                               std::optional<int64_t> num_experts) {
  constexpr const char* op = "e8m0_shuffle";
  check_cpu(scale, op, "scale");
  E8m0ShuffleParams p = make_e8m0_shuffle_params(scale, gate_up, num_experts, op);
  at::Tensor out = empty_output({p.padded_m, p.padded_n}, scale.scalar_type());
  advise_huge_pages(out);
  p.shuffled = static_cast<uint8_t*>(out.data_ptr());
  parallel_for(0, p.padded_m / 32, grain_for(32 * p.padded_n),
               [&](int64_t begin, int64_t end) { e8m0_shuffle_cpu(p, begin, end); });
  return out;
}

at::Tensor e8m0_unshuffle_cpu_op(const at::Tensor& shuffled, int64_t m, int64_t n, bool gate_up,
                                 std::optional<int64_t> num_experts) {
  constexpr const char* op = "e8m0_unshuffle";
  check_cpu(shuffled, op, "shuffled");
  E8m0ShuffleParams p = make_e8m0_unshuffle_params(shuffled, m, n, gate_up, num_experts, op);
  const at::Tensor src = shuffled.contiguous();
  at::Tensor out = empty_output({m, n}, shuffled.scalar_type());
  p.shuffled_in = static_cast<const uint8_t*>(src.data_ptr());
  p.unshuffled = static_cast<uint8_t*>(out.data_ptr());
  parallel_for(0, p.padded_m / 32, grain_for(32 * p.padded_n),
               [&](int64_t begin, int64_t end) { e8m0_unshuffle_cpu(p, begin, end); });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(moeext, CPU, m) {
  m.impl("biased_grouped_topk", &biased_grouped_topk_impl_cpu);
  m.impl("biased_grouped_topk_out", &biased_grouped_topk_out_cpu);
  m.impl("router_gemm", &router_gemm_cpu_impl);
  m.impl("zero_tail_", &zero_tail_cpu);
  m.impl("zero_tail_tracked_", &zero_tail_tracked_cpu);
  m.impl("shuffle_weight", &shuffle_weight_cpu_op);
  m.impl("unshuffle_weight", &unshuffle_weight_cpu_op);
  m.impl("e8m0_shuffle", &e8m0_shuffle_cpu_op);
  m.impl("e8m0_unshuffle", &e8m0_unshuffle_cpu_op);
}

}  // namespace moeext::torch_glue
