// Every moeext operator schema, in one place. Each op's implementations register per
// dispatch key in its own file under ops/; fakes are registered from Python
// (python/moeext/_fake.py).
#include <torch/library.h>

TORCH_LIBRARY(moeext, m) {
  // The routing options of docs/SPEC.md section 6 follow scoring_func in both forms.
  m.def(
      "biased_grouped_topk(Tensor gating_output, Tensor? correction_bias, "
      "int num_expert_group, int topk_group, int topk, bool renormalize=True, "
      "float routed_scaling_factor=1.0, str scoring_func=\"sigmoid\", "
      "int num_fused_shared_experts=0, float shared_expert_weight=1.0, "
      "Tensor? expert_map=None, Tensor(c!)? expert_counts=None, "
      "Tensor(d!)? routed_experts=None, Tensor? num_valid_tokens=None) "
      "-> (Tensor topk_weights, Tensor topk_ids)");
  m.def(
      "biased_grouped_topk_out(Tensor gating_output, Tensor? correction_bias, "
      "Tensor(a!) topk_weights, Tensor(b!) topk_ids, int num_expert_group, int topk_group, "
      "bool renormalize=True, float routed_scaling_factor=1.0, str scoring_func=\"sigmoid\", "
      "int num_fused_shared_experts=0, float shared_expert_weight=1.0, "
      "Tensor? expert_map=None, Tensor(c!)? expert_counts=None, "
      "Tensor(d!)? routed_experts=None, Tensor? num_valid_tokens=None) -> ()");
  m.def(
      "routing_weights(Tensor gating_output, Tensor topk_ids, bool renormalize=True, "
      "float routed_scaling_factor=1.0, str scoring_func=\"sigmoid\") -> Tensor");
  m.def(
      "router_gemm(Tensor hidden_states, Tensor weight, ScalarType? out_dtype=None) -> Tensor");
  // The logits are returned only with return_logits; otherwise the third tensor is [0, E].
  m.def(
      "fused_router(Tensor hidden_states, Tensor weight, Tensor? correction_bias, "
      "int num_expert_group, int topk_group, int topk, bool renormalize=True, "
      "float routed_scaling_factor=1.0, str scoring_func=\"sigmoid\", "
      "int num_fused_shared_experts=0, float shared_expert_weight=1.0, "
      "Tensor? expert_map=None, Tensor(c!)? expert_counts=None, "
      "Tensor(d!)? routed_experts=None, Tensor? num_valid_tokens=None, "
      "bool return_logits=False) -> (Tensor topk_weights, Tensor topk_ids, Tensor logits)");
  m.def(
      "fused_router_out(Tensor hidden_states, Tensor weight, Tensor? correction_bias, "
      "Tensor(a!) topk_weights, Tensor(b!) topk_ids, int num_expert_group, int topk_group, "
      "bool renormalize=True, float routed_scaling_factor=1.0, str scoring_func=\"sigmoid\", "
      "int num_fused_shared_experts=0, float shared_expert_weight=1.0, "
      "Tensor? expert_map=None, Tensor(c!)? expert_counts=None, "
      "Tensor(d!)? routed_experts=None, Tensor? num_valid_tokens=None) -> ()");
  // SymInt: an extent is usually a batch size, which torch.compile keeps symbolic; an int
  // argument would specialise the graph to each one and recompile per batch size.
  m.def("zero_tail_(Tensor(a!) buf, SymInt new_extent, SymInt prev_extent) -> ()");
  m.def("zero_tail_tracked_(Tensor(a!) buf, Tensor(b!) state, SymInt new_extent) -> ()");
  m.def("shuffle_weight(Tensor w, int[2] layout=[16, 16], bool gate_up=False) -> Tensor");
  m.def("unshuffle_weight(Tensor w, int[2] layout=[16, 16], bool gate_up=False) -> Tensor");
  m.def("e8m0_shuffle(Tensor scale, bool gate_up=False, int? num_experts=None) -> Tensor");
  m.def(
      "e8m0_unshuffle(Tensor shuffled, int m, int n, bool gate_up=False, int? num_experts=None) "
      "-> Tensor");
}
