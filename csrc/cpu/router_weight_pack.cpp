// The launcher of the router weight packing (cpu/router_weight_pack.h). One ISA-neutral copy:
// it runs once per weight at load time, a copy with nothing to vectorise by hand.
#include <cstdint>

#include "cpu/router_weight_pack.h"
#include "moeext/router_gemm.h"

namespace moeext {

void prepack_router_weight_cpu(const RouterWeightPackParams& p, int64_t expert_begin,
                               int64_t expert_end) {
  if (expert_begin >= expert_end) return;
  cpu::pack_router_weight(static_cast<const uint16_t*>(p.weight), p.num_experts, p.hidden_size,
                          p.weight_row_stride, p.weight_col_stride,
                          static_cast<uint16_t*>(p.packed), expert_begin, expert_end);
}

}  // namespace moeext
