// What dispatch.cpp needs to call the per-ISA copies of cpu/grouped_topk.cpp.
#pragma once

#include <cstdint>

#include "cpu/grouped_topk_plan.h"
#include "moeext/grouped_topk.h"

namespace moeext::cpu {

// Routes rows [row_begin, row_end) by the plan made for them on this ISA (plan_grouped_topk
// with its GroupedTopkIsa), in the plan's workspace.
#define MOEEXT_DECLARE_GROUPED_TOPK(isa)                                                  \
  namespace isa {                                                                         \
  void biased_grouped_topk(const BiasedGroupedTopkParams& p, int64_t row_begin,           \
                           int64_t row_end, const GroupedTopkPlan& plan,                  \
                           const GroupedTopkWorkspace& ws);                               \
  }
MOEEXT_DECLARE_GROUPED_TOPK(portable)
MOEEXT_DECLARE_GROUPED_TOPK(avx2)
MOEEXT_DECLARE_GROUPED_TOPK(avx512)
#undef MOEEXT_DECLARE_GROUPED_TOPK

}  // namespace moeext::cpu
