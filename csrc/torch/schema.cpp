// Every moeext operator schema, in one place. Each op's implementations register per
// dispatch key in its own file under ops/; fakes are registered from Python
// (python/moeext/_fake.py).
#include <torch/library.h>

TORCH_LIBRARY(moeext, m) {
  m.def(
      "biased_grouped_topk(Tensor gating_output, Tensor? correction_bias, "
      "int num_expert_group, int topk_group, int topk, bool renormalize=True, "
      "float routed_scaling_factor=1.0, str scoring_func=\"sigmoid\") "
      "-> (Tensor topk_weights, Tensor topk_ids)");
  m.def(
      "biased_grouped_topk_out(Tensor gating_output, Tensor? correction_bias, "
      "Tensor(a!) topk_weights, Tensor(b!) topk_ids, int num_expert_group, int topk_group, "
      "bool renormalize=True, float routed_scaling_factor=1.0, str scoring_func=\"sigmoid\") "
      "-> ()");
  m.def(
      "router_gemm(Tensor hidden_states, Tensor weight, ScalarType? out_dtype=None) -> Tensor");
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
