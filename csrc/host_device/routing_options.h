// The routing options of docs/SPEC.md section 6 that the CPU and GPU kernels share: which rows
// count, the expert map, the record of a routed choice and the shared experts' columns.
// Compiled for the host and the GPU alike (no GPU runtime header), so the GPU kernels, the
// CPU's cpu/routing_options.cpp and the host unit test tests/cpp/test_routing_options.cpp
// run these very functions. Adding to the counts is each device's own atomic.
#pragma once

#include <cstdint>

#include "moeext/common.h"
#include "moeext/grouped_topk.h"

namespace moeext::host_device {

// The rows a call counts and records: num_valid_tokens clamped to [0, num_tokens], read
// where the kernel runs (so a captured graph reads the replay's count); every row without it.
MOEEXT_HOST_DEVICE inline int64_t counted_rows(const RoutingOptions& o, int64_t num_tokens) {
  if (o.num_valid_tokens == nullptr) return num_tokens;
  const int64_t valid = o.valid_dtype == IntType::kInt32
                            ? int64_t(*static_cast<const int32_t*>(o.num_valid_tokens))
                            : *static_cast<const int64_t*>(o.num_valid_tokens);
  return valid < 0 ? 0 : (valid > num_tokens ? num_tokens : valid);
}

// The id written to topk_ids for expert `id` (logical): expert_map[id] where there is a map.
MOEEXT_HOST_DEVICE inline int32_t mapped_id(const RoutingOptions& o, int64_t id) {
  return o.expert_map != nullptr ? o.expert_map[id * o.map_stride] : int32_t(id);
}

// Records logical expert `id` as routed expert j of row `token`.
MOEEXT_HOST_DEVICE inline void record_routed(const RoutingOptions& o, int64_t token, int64_t j,
                                             int64_t id) {
  const int64_t at = token * o.routed_row_stride + j;
  if (o.routed_dtype == IntType::kInt16) {
    static_cast<int16_t*>(o.routed_experts)[at] = int16_t(id);
  } else {
    static_cast<int32_t*>(o.routed_experts)[at] = int32_t(id);
  }
}

// Shared expert j of row `token`: column topk + j of both outputs, the id num_experts + j
// (through the map) and the weight shared_expert_weight.
MOEEXT_HOST_DEVICE inline void write_shared_expert(const BiasedGroupedTopkParams& p,
                                                   int64_t token, int64_t j) {
  const RoutingOptions& o = p.options;
  p.topk_ids[token * p.ids_row_stride + p.topk + j] = mapped_id(o, p.num_experts + j);
  p.topk_weights[token * p.weights_row_stride + p.topk + j] = o.shared_expert_weight;
}

}  // namespace moeext::host_device
