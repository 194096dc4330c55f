// Host unit test of csrc/host_device/routing_options.h, the routing options' logic the CPU and
// GPU kernels share: the rows that count, the expert map, the record and the shared experts'
// columns.
#include <cstdint>
#include <cstdio>
#include <vector>

#include "check.h"
#include "host_device/routing_options.h"

namespace hd = moeext::host_device;
using moeext::BiasedGroupedTopkParams;
using moeext::IntType;
using moeext::RoutingOptions;

namespace {

void test_counted_rows() {
  RoutingOptions o;
  CHECK(hd::counted_rows(o, 7) == 7, "no count: every row");
  for (const int64_t valid : {int64_t(-3), int64_t(0), int64_t(4), int64_t(7), int64_t(9),
                              int64_t(1) << 40}) {
    const int64_t expected = valid < 0 ? 0 : (valid > 7 ? 7 : valid);
    const int64_t as_int64 = valid;
    o.num_valid_tokens = &as_int64;
    o.valid_dtype = IntType::kInt64;
    CHECK(hd::counted_rows(o, 7) == expected, "int64 %lld: %lld", (long long)valid,
          (long long)hd::counted_rows(o, 7));
    if (valid < (int64_t(1) << 31)) {
      const int32_t as_int32 = int32_t(valid);
      o.num_valid_tokens = &as_int32;
      o.valid_dtype = IntType::kInt32;
      CHECK(hd::counted_rows(o, 7) == expected, "int32 %lld: %lld", (long long)valid,
            (long long)hd::counted_rows(o, 7));
    }
  }
}

void test_map_and_record() {
  RoutingOptions o;
  CHECK(hd::mapped_id(o, 5) == 5, "no map");
  // Every other element of a strided map: expert e -> 100 - e, or -1 for experts off this rank.
  std::vector<int32_t> map(2 * 12, 777);
  for (int e = 0; e < 12; ++e) map[size_t(2 * e)] = e % 3 == 0 ? -1 : 100 - e;
  o.expert_map = map.data();
  o.map_stride = 2;
  for (int e = 0; e < 12; ++e) {
    CHECK(hd::mapped_id(o, e) == (e % 3 == 0 ? -1 : 100 - e), "map of %d: %d", e,
          hd::mapped_id(o, e));
  }
  // Rows of 5 in a record of row stride 6: row 2's columns, int16 and int32.
  std::vector<int16_t> routed16(3 * 6, -9);
  std::vector<int32_t> routed32(3 * 6, -9);
  o.routed_row_stride = 6;
  for (int j = 0; j < 5; ++j) {
    o.routed_experts = routed16.data();
    o.routed_dtype = IntType::kInt16;
    hd::record_routed(o, 2, j, 300 + j);
    o.routed_experts = routed32.data();
    o.routed_dtype = IntType::kInt32;
    hd::record_routed(o, 2, j, 70000 + j);
  }
  for (int i = 0; i < 18; ++i) {
    const bool written = i >= 12 && i < 17;
    CHECK(routed16[size_t(i)] == (written ? 300 + i - 12 : -9), "int16 record at %d: %d", i,
          routed16[size_t(i)]);
    CHECK(routed32[size_t(i)] == (written ? 70000 + i - 12 : -9), "int32 record at %d: %d", i,
          routed32[size_t(i)]);
  }
}

void test_shared_experts() {
  // 2 rows of topk 3 + 2 shared experts in rows of stride 7 (ids) and 6 (weights), 10 experts.
  std::vector<int32_t> ids(2 * 7, -5);
  std::vector<float> weights(2 * 6, -5.0f);
  BiasedGroupedTopkParams p;
  p.topk_ids = ids.data();
  p.ids_row_stride = 7;
  p.topk_weights = weights.data();
  p.weights_row_stride = 6;
  p.num_experts = 10;
  p.topk = 3;
  p.options.num_shared_experts = 2;
  p.options.shared_expert_weight = 0.25f;
  for (int j = 0; j < 2; ++j) hd::write_shared_expert(p, 1, j);
  for (int i = 0; i < 14; ++i) {
    const bool written = i == 10 || i == 11;
    CHECK(ids[size_t(i)] == (written ? 10 + i - 10 : -5), "shared id at %d: %d", i,
          ids[size_t(i)]);
  }
  for (int i = 0; i < 12; ++i) {
    const bool written = i == 9 || i == 10;
    CHECK(weights[size_t(i)] == (written ? 0.25f : -5.0f), "shared weight at %d: %g", i,
          double(weights[size_t(i)]));
  }
  // Through a map that covers the shared experts too ([num_experts + S]).
  std::vector<int32_t> map(12);
  for (int e = 0; e < 12; ++e) map[size_t(e)] = e < 10 ? -1 : 40 + e;
  p.options.expert_map = map.data();
  hd::write_shared_expert(p, 0, 1);
  CHECK(ids[4] == 51 && ids[3] == -5, "mapped shared id: %d %d", ids[3], ids[4]);
}

}  // namespace

int main() {
  test_counted_rows();
  test_map_and_record();
  test_shared_experts();
  return moeext_test::finish("routing_options");
}
