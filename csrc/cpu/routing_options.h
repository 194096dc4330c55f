// The routing options of docs/SPEC.md section 6 on the CPU: what engines do with a routed
// choice (shared experts' columns, an expert map, counts, a record), done by the routing call
// on the rows it has just routed, while their ids are in cache.
#pragma once

#include <cstdint>

#include "moeext/grouped_topk.h"

namespace moeext::cpu {

// Rows [row_begin, row_end), whose first p.topk columns hold the routed choice: records and
// counts the logical ids of the valid ones, maps every routed id through the expert map, and
// writes the shared experts' columns (their ids mapped too). Runs on the calling thread; the
// counts are added atomically, so chunks of one call may run on several threads.
void apply_routing_options(const BiasedGroupedTopkParams& p, int64_t row_begin, int64_t row_end);

}  // namespace moeext::cpu
