#include "cpu/routing_options.h"

#include <algorithm>
#include <memory>

#include "host_device/routing_options.h"

namespace moeext::cpu {
namespace {

template <typename Count>
void add_counts(Count* counts, int64_t stride, const int32_t* ids, int64_t ids_row_stride,
                int64_t rows, int64_t topk, int64_t num_experts) {
  // Few ids: one atomic add each. Many: a histogram of the chunk first, then one atomic add
  // per expert it holds, so that threads rarely meet on a counter.
  if (rows * topk <= num_experts / 4) {
    for (int64_t t = 0; t < rows; ++t) {
      for (int64_t j = 0; j < topk; ++j) {
        __atomic_fetch_add(counts + ids[t * ids_row_stride + j] * stride, Count(1),
                           __ATOMIC_RELAXED);
      }
    }
    return;
  }
  constexpr int64_t kStackExperts = 4096;
  int32_t stack_histogram[kStackExperts];
  std::unique_ptr<int32_t[]> heap_histogram;
  int32_t* histogram = stack_histogram;
  if (num_experts > kStackExperts) {
    heap_histogram.reset(new int32_t[num_experts]);
    histogram = heap_histogram.get();
  }
  std::fill(histogram, histogram + num_experts, 0);
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t j = 0; j < topk; ++j) ++histogram[ids[t * ids_row_stride + j]];
  }
  for (int64_t e = 0; e < num_experts; ++e) {
    if (histogram[e] != 0) {
      __atomic_fetch_add(counts + e * stride, Count(histogram[e]), __ATOMIC_RELAXED);
    }
  }
}

template <typename Id>
void record(Id* routed, int64_t routed_row_stride, const int32_t* ids, int64_t ids_row_stride,
            int64_t rows, int64_t topk) {
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t j = 0; j < topk; ++j) {
      routed[t * routed_row_stride + j] = Id(ids[t * ids_row_stride + j]);
    }
  }
}

}  // namespace

void apply_routing_options(const BiasedGroupedTopkParams& p, int64_t row_begin,
                           int64_t row_end) {
  const RoutingOptions& o = p.options;
  const int64_t counted_end = std::min(row_end, host_device::counted_rows(o, p.num_tokens));
  const int32_t* first_ids = p.topk_ids + row_begin * p.ids_row_stride;
  if (counted_end > row_begin) {
    const int64_t rows = counted_end - row_begin;
    if (o.routed_experts != nullptr) {
      if (o.routed_dtype == IntType::kInt16) {
        record(static_cast<int16_t*>(o.routed_experts) + row_begin * o.routed_row_stride,
               o.routed_row_stride, first_ids, p.ids_row_stride, rows, p.topk);
      } else {
        record(static_cast<int32_t*>(o.routed_experts) + row_begin * o.routed_row_stride,
               o.routed_row_stride, first_ids, p.ids_row_stride, rows, p.topk);
      }
    }
    if (o.expert_counts != nullptr) {
      if (o.counts_dtype == IntType::kInt32) {
        add_counts(static_cast<int32_t*>(o.expert_counts), o.counts_stride, first_ids,
                   p.ids_row_stride, rows, p.topk, p.num_experts);
      } else {
        add_counts(static_cast<int64_t*>(o.expert_counts), o.counts_stride, first_ids,
                   p.ids_row_stride, rows, p.topk, p.num_experts);
      }
    }
  }
  if (o.num_shared_experts == 0 && o.expert_map == nullptr) return;
  for (int64_t t = row_begin; t < row_end; ++t) {
    int32_t* ids = p.topk_ids + t * p.ids_row_stride;
    if (o.expert_map != nullptr) {
      for (int64_t j = 0; j < p.topk; ++j) ids[j] = host_device::mapped_id(o, ids[j]);
    }
    for (int64_t j = 0; j < o.num_shared_experts; ++j) host_device::write_shared_expert(p, t, j);
  }
}

}  // namespace moeext::cpu
