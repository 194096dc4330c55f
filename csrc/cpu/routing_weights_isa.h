// What dispatch.cpp needs to call the per-ISA copies of cpu/routing_weights.cpp.
#pragma once

#include <cstdint>

#include "moeext/grouped_topk.h"

namespace moeext::cpu {

// Per-thread scratch, laid out by dispatch.cpp; float arrays padded to whole 16-lane vectors.
struct RoutingWeightsWorkspace {
  float* row;     // [num_experts] a column-strided row widened (softmax only)
  float* scores;  // [num_experts] the row's softmax scores
  float* biased;  // [num_experts] score_row's other output (unused here)
  float* given;   // [k] the given experts' logits, then scores
};

#define MOEEXT_DECLARE_ROUTING_WEIGHTS(isa)                                            \
  namespace isa {                                                                      \
  void routing_weights(const RoutingWeightsParams& p, int64_t row_begin, int64_t row_end, \
                       const RoutingWeightsWorkspace& ws);                             \
  }
MOEEXT_DECLARE_ROUTING_WEIGHTS(portable)
MOEEXT_DECLARE_ROUTING_WEIGHTS(avx2)
MOEEXT_DECLARE_ROUTING_WEIGHTS(avx512)
#undef MOEEXT_DECLARE_ROUTING_WEIGHTS

}  // namespace moeext::cpu
