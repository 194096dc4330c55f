// Python entry points to the GPU launchers built for the host (tests/gpu_emulation/): CPU
// tensors in, the GPU kernels' results out, through the launcher API the torch bindings use.
// The caller (tests/test_gpu_emulation.py) passes contiguous outputs of the right shapes.
#include <torch/extension.h>

#include <map>
#include <optional>
#include <string>

#include "moeext/fused_router.h"
#include "moeext/grouped_topk.h"
#include "moeext/router_gemm.h"
#include "runtime.h"

extern int moeext_emu_multiprocessors;
#if defined(MOEEXT_EMU_CUDA)
extern long moeext_emu_programmatic_launches;  // host.cpp
#endif

namespace {

using at::Tensor;
using std::optional;

moeext::DType dtype_of(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return moeext::DType::kFloat32;
    case at::kBFloat16: return moeext::DType::kBFloat16;
    case at::kHalf: return moeext::DType::kFloat16;
    default: TORCH_CHECK(false, "emulation harness: unsupported dtype ", t.scalar_type());
  }
}

moeext::IntType int_type_of(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kShort: return moeext::IntType::kInt16;
    case at::kInt: return moeext::IntType::kInt32;
    case at::kLong: return moeext::IntType::kInt64;
    default: TORCH_CHECK(false, "emulation harness: unsupported index dtype ", t.scalar_type());
  }
}

void check(moeext::GpuError error, const char* what) {
  TORCH_CHECK(error == nullptr, what, ": ", error);
  const std::string late = moeext_emu::take_error();
  TORCH_CHECK(late.empty(), what, ": ", late);
}

void configure(int64_t order, int64_t seed, int64_t multiprocessors, int64_t routing_variant,
               int64_t gemm_variant, int64_t fused_variant, bool programmatic_launch) {
  moeext_emu::settings().order = moeext_emu::Order(order);
  moeext_emu::settings().seed = uint64_t(seed);
  moeext_emu_multiprocessors = int(multiprocessors);
  moeext::set_gpu_routing_variant(int(routing_variant));
  moeext::set_gpu_router_gemm_variant(int(gemm_variant));
  moeext::set_gpu_fused_router_variant(int(fused_variant));
  moeext::set_gpu_programmatic_dependent_launch(programmatic_launch);
}

// Launches made with programmatic dependent launch so far (CUDA); -1 for HIP, which has none.
int64_t programmatic_launches() {
#if defined(MOEEXT_EMU_CUDA)
  return moeext_emu_programmatic_launches;
#else
  return -1;
#endif
}

int64_t warp_size() { return moeext_emu::settings().warp_size; }

// The meetings the launches since the last call made (runtime.h's Counts), and a reset.
std::map<std::string, int64_t> take_counts() {
  const moeext_emu::Counts c = moeext_emu::counts();
  moeext_emu::reset_counts();
  return {{"block_barriers", int64_t(c.block_barriers)}, {"warp_syncs", int64_t(c.warp_syncs)},
          {"shuffles", int64_t(c.shuffles)},             {"ballots", int64_t(c.ballots)},
          {"gathers", int64_t(c.gathers)}};
}

moeext::BiasedGroupedTopkParams routing_params(
    const Tensor& logits, const optional<Tensor>& bias, Tensor& weights, Tensor& ids,
    int64_t groups, int64_t topk_group, int64_t topk, bool renormalize, double scale,
    int64_t scoring, int64_t shared, double shared_weight, const optional<Tensor>& expert_map,
    const optional<Tensor>& counts, const optional<Tensor>& routed,
    const optional<Tensor>& valid) {
  moeext::BiasedGroupedTopkParams p;
  p.gating_output = logits.data_ptr();
  p.gating_dtype = dtype_of(logits);
  p.gating_row_stride = logits.stride(0);
  p.gating_col_stride = logits.stride(1);
  if (bias) {
    p.correction_bias = bias->data_ptr();
    p.bias_dtype = dtype_of(*bias);
    p.bias_stride = bias->stride(0);
  }
  p.topk_weights = weights.data_ptr<float>();
  p.weights_row_stride = weights.stride(0);
  p.topk_ids = ids.data_ptr<int32_t>();
  p.ids_row_stride = ids.stride(0);
  p.num_tokens = logits.size(0);
  p.num_experts = logits.size(1);
  p.num_expert_group = groups;
  p.topk_group = topk_group;
  p.topk = topk;
  p.renormalize = renormalize;
  p.routed_scaling_factor = float(scale);
  p.scoring_func = moeext::ScoringFunc(scoring);
  moeext::RoutingOptions& o = p.options;
  o.num_shared_experts = shared;
  o.shared_expert_weight = float(shared_weight);
  if (expert_map) {
    o.expert_map = expert_map->data_ptr<int32_t>();
    o.map_stride = expert_map->stride(0);
  }
  if (counts) {
    o.expert_counts = counts->data_ptr();
    o.counts_dtype = int_type_of(*counts);
    o.counts_stride = counts->stride(0);
  }
  if (routed) {
    o.routed_experts = routed->data_ptr();
    o.routed_dtype = int_type_of(*routed);
    o.routed_row_stride = routed->stride(0);
  }
  if (valid) {
    o.num_valid_tokens = valid->data_ptr();
    o.valid_dtype = int_type_of(*valid);
  }
  return p;
}

void routing(const Tensor& logits, const optional<Tensor>& bias, Tensor weights, Tensor ids,
             int64_t groups, int64_t topk_group, int64_t topk, bool renormalize, double scale,
             int64_t scoring, int64_t shared, double shared_weight,
             const optional<Tensor>& expert_map, const optional<Tensor>& counts,
             const optional<Tensor>& routed, const optional<Tensor>& valid) {
  const auto p = routing_params(logits, bias, weights, ids, groups, topk_group, topk,
                                renormalize, scale, scoring, shared, shared_weight, expert_map,
                                counts, routed, valid);
  const char* limit = moeext::biased_grouped_topk_gpu_limit(p);
  TORCH_CHECK(limit == nullptr, limit);
  check(moeext::biased_grouped_topk_gpu(p, nullptr), "biased_grouped_topk_gpu");
}

moeext::RouterGemmParams gemm_params(const Tensor& hidden, const Tensor& weight, Tensor& logits) {
  moeext::RouterGemmParams p;
  p.hidden_states = hidden.data_ptr();
  p.hidden_row_stride = hidden.stride(0);
  p.weight = weight.data_ptr();
  p.weight_row_stride = weight.stride(0);
  p.input_dtype = dtype_of(hidden);
  p.logits = logits.data_ptr();
  p.logits_row_stride = logits.stride(0);
  p.logits_dtype = dtype_of(logits);
  p.num_tokens = hidden.size(0);
  p.hidden_size = hidden.size(1);
  p.num_experts = weight.size(0);
  return p;
}

// False where the GPU library hands this GEMM to the platform's (cuBLAS, hipBLASLt).
bool router_gemm(const Tensor& hidden, const Tensor& weight, Tensor logits) {
  const auto p = gemm_params(hidden, weight, logits);
  if (!moeext::router_gemm_gpu_supported(p)) return false;
  check(moeext::router_gemm_gpu(p, nullptr), "router_gemm_gpu");
  return true;
}

// False where the call does not run as one launch (fused_router_gpu_takes: the variant set
// asks for it and the kernel takes these params); the op then runs the two kernels.
bool fused_router(const Tensor& hidden, const Tensor& weight, const optional<Tensor>& bias,
                  Tensor weights, Tensor ids, Tensor logits, Tensor counter, int64_t groups,
                  int64_t topk_group, int64_t topk, bool renormalize, double scale,
                  int64_t scoring, int64_t shared, double shared_weight,
                  const optional<Tensor>& expert_map, const optional<Tensor>& counts,
                  const optional<Tensor>& routed, const optional<Tensor>& valid) {
  moeext::FusedRouterParams p;
  p.gemm = gemm_params(hidden, weight, logits);
  p.routing = routing_params(logits, bias, weights, ids, groups, topk_group, topk, renormalize,
                             scale, scoring, shared, shared_weight, expert_map, counts, routed,
                             valid);
  if (!moeext::fused_router_gpu_takes(p)) return false;
  p.completion_counter = reinterpret_cast<unsigned*>(counter.data_ptr<int32_t>());
  check(moeext::fused_router_gpu(p, nullptr), "fused_router_gpu");
  return true;
}

void routing_weights(const Tensor& logits, const Tensor& ids,
                     Tensor weights, bool renormalize, double scale, int64_t scoring) {
  moeext::RoutingWeightsParams p;
  p.gating_output = logits.data_ptr();
  p.gating_dtype = dtype_of(logits);
  p.gating_row_stride = logits.stride(0);
  p.gating_col_stride = logits.stride(1);
  p.topk_ids = ids.data_ptr();
  p.ids_dtype = int_type_of(ids);
  p.ids_row_stride = ids.stride(0);
  p.ids_col_stride = ids.stride(1);
  p.topk_weights = weights.data_ptr<float>();
  p.weights_row_stride = weights.stride(0);
  p.num_tokens = logits.size(0);
  p.num_experts = logits.size(1);
  p.k = ids.size(1);
  p.renormalize = renormalize;
  p.routed_scaling_factor = float(scale);
  p.scoring_func = moeext::ScoringFunc(scoring);
  const char* limit = moeext::routing_weights_gpu_limit(p);
  TORCH_CHECK(limit == nullptr, limit);
  check(moeext::routing_weights_gpu(p, nullptr), "routing_weights_gpu");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("configure", &configure);
  m.def("warp_size", &warp_size);
  m.def("programmatic_launches", &programmatic_launches);
  m.def("take_counts", &take_counts);
  m.def("routing", &routing);
  m.def("router_gemm", &router_gemm);
  m.def("fused_router", &fused_router);
  m.def("routing_weights", &routing_weights);
}
