// What dispatch.cpp needs to call the per-ISA copies of cpu/grouped_topk.cpp.
#pragma once

#include <cstdint>

#include "moeext/grouped_topk.h"

namespace moeext::cpu {

// Experts [begin, end) of one kept group.
struct ExpertRange {
  int64_t begin, end;
};

// Per-thread scratch, sized by grouped_topk_workspace_floats(); the kernel allocates nothing.
struct GroupedTopkWorkspace {
  float* scores;           // [num_experts] unbiased scores s of the current row
  float* biased;           // [num_experts] s + bias, NaN replaced by -inf
  float* row;              // [num_experts] the row widened to fp32, for column-strided logits
  float* bias;             // [num_experts] the bias widened to fp32, for a strided bias
  uint64_t* group_keys;    // [topk_group]
  uint64_t* expert_keys;   // [topk]
  ExpertRange* ranges;     // [topk_group]
};

#define MOEEXT_DECLARE_GROUPED_TOPK(isa)                                                  \
  namespace isa {                                                                         \
  void biased_grouped_topk(const BiasedGroupedTopkParams& p, int64_t row_begin,           \
                           int64_t row_end, const GroupedTopkWorkspace& ws);              \
  }
MOEEXT_DECLARE_GROUPED_TOPK(scalar)
MOEEXT_DECLARE_GROUPED_TOPK(avx512)
#undef MOEEXT_DECLARE_GROUPED_TOPK

}  // namespace moeext::cpu
