// Host unit test of csrc/gpu/sort_lane.h, the lane sort of the routing warp kernel's
// sorted-lanes variant: the sort against a stable sort at every width it takes, on every 0-1
// input and on inputs full of ties; and the rounds the kernel builds on it (the largest first
// value over the lanes, the lowest lane holding it drops it) against plain argmax with the
// lowest expert winning a tie, on warps of 32 lanes; and the butterfly of list merges routing
// variant 8 runs in their place (merge_top_keys), against the same argmax. The warp reductions
// and shuffles are written out here; the per-lane steps are the kernel's own functions.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <utility>
#include <vector>

#include "check.h"
#include "gpu/sort_lane.h"
#include "host_device/routing.h"

namespace gt = moeext::gpu::grouped_topk;

namespace {

constexpr int kLanes = 32;

// sort_lane's results against std::stable_sort by value, larger first.
template <int V>
void check_sorted(const uint32_t (&input)[V]) {
  uint32_t value[V];
  for (int i = 0; i < V; ++i) value[i] = input[i];
  const gt::SlotOrder<V> order = gt::sort_lane(value);
  std::vector<std::pair<uint32_t, uint32_t>> expected;
  for (int i = 0; i < V; ++i) expected.emplace_back(input[i], uint32_t(i));
  std::stable_sort(expected.begin(), expected.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  for (int i = 0; i < V; ++i) {
    const uint32_t slot = uint32_t((order >> (4 * i)) & 15u);
    CHECK(value[i] == expected[i].first && slot == expected[i].second,
          "V=%d position %d: (%u, slot %u), expected (%u, slot %u)", V, i, value[i], slot,
          expected[i].first, expected[i].second);
  }
  if (V * 4 < int(sizeof(gt::SlotOrder<V>)) * 8) {
    CHECK((order >> (4 * V)) == 0, "V=%d: bits past the last slot", V);
  }
}

template <int V>
void test_sort(std::mt19937& rng) {
  uint32_t input[V];
  // Every 0-1 input (the 0-1 principle: a network that sorts these sorts everything), where
  // the ties are as dense as they get.
  for (uint32_t bits = 0; bits < (1u << V); ++bits) {
    for (int i = 0; i < V; ++i) input[i] = (bits >> i) & 1u;
    check_sorted<V>(input);
  }
  // Few distinct values (the ties the tie rule decides), and any 32-bit values.
  for (int trial = 0; trial < 20000; ++trial) {
    const uint32_t range = trial % 2 == 0 ? 4u : 0xffffffffu;
    for (int i = 0; i < V; ++i) input[i] = rng() % range;
    check_sorted<V>(input);
  }
}

template <int... Vs>
void test_sort_widths(std::mt19937& rng, std::integer_sequence<int, Vs...>) {
  (test_sort<Vs + 1>(rng), ...);
}

// topk rounds over kLanes sorted lanes of V experts (lane l holds experts l * V + i) against
// argmax over the row, the lowest expert winning a tie and 0 out of play.
template <int V>
void check_rounds(const std::vector<uint32_t>& row, int topk) {
  uint32_t value[kLanes][V];
  gt::SlotOrder<V> order[kLanes];
  for (int lane = 0; lane < kLanes; ++lane) {
    for (int i = 0; i < V; ++i) value[lane][i] = row[size_t(lane * V + i)];
    order[lane] = gt::sort_lane(value[lane]);
  }
  std::vector<uint32_t> left = row;
  for (int j = 0; j < topk; ++j) {
    uint32_t best = 0;
    for (int lane = 0; lane < kLanes; ++lane) best = std::max(best, value[lane][0]);
    int winner = -1;
    for (int lane = 0; lane < kLanes && winner < 0; ++lane) {
      if (value[lane][0] == best) winner = lane;
    }
    const uint32_t id = uint32_t(winner * V) + gt::first_slot(order[winner]);
    for (int lane = 0; lane < kLanes; ++lane) {
      gt::drop_first_if(lane == winner, value[lane], order[lane]);
    }
    const size_t expected = size_t(std::max_element(left.begin(), left.end()) - left.begin());
    CHECK(id == expected && best == left[expected] && best != 0,
          "V=%d round %d: expert %u (%u), expected %zu (%u)", V, j, id, best, expected,
          left[expected]);
    left[expected] = 0;
  }
}

template <int V>
void test_rounds(std::mt19937& rng) {
  std::vector<uint32_t> row(size_t(kLanes * V));
  for (int trial = 0; trial < 3000; ++trial) {
    // A few distinct values (many ties), a share out of play (0: groups not kept, experts
    // past the row), and at least topk in play.
    const uint32_t range = trial % 3 == 0 ? 3u : (trial % 3 == 1 ? 50u : 0xfffffffeu);
    const int topk = 1 + int(rng() % 32);
    int in_play = 0;
    for (auto& v : row) {
      v = rng() % 4 == 0 ? 0u : 1u + rng() % range;
      in_play += v != 0;
    }
    for (size_t e = 0; in_play < topk; ++e) {
      if (row[e] == 0) row[e] = 1, ++in_play;
    }
    check_rounds<V>(row, topk);
  }
}

// The best K keys of every lane's sorted experts (0 past V), merged over a butterfly of kLanes
// lanes as variant 8 does, against topk rounds of argmax over the row: each lane must end with
// the same list, whose first topk are the argmax winners in order.
template <int V, int K>
void check_merges(const std::vector<uint32_t>& row, int topk) {
  uint64_t top[kLanes][K];
  for (int lane = 0; lane < kLanes; ++lane) {
    uint32_t value[V];
    for (int i = 0; i < V; ++i) value[i] = row[size_t(lane * V + i)];
    const gt::SlotOrder<V> order = gt::sort_lane(value);
    for (int i = 0; i < K; ++i) {
      const uint32_t slot = i < V ? uint32_t((order >> (4 * i)) & 15u) : 0u;
      top[lane][i] = i < V ? moeext::host_device::key_from_ordered(value[i],
                                                                    uint32_t(lane * V) + slot)
                           : 0u;
    }
  }
  for (int step = kLanes / 2; step > 0; step /= 2) {
    uint64_t before[kLanes][K];
    std::copy(&top[0][0], &top[0][0] + kLanes * K, &before[0][0]);
    for (int lane = 0; lane < kLanes; ++lane) gt::merge_top_keys(top[lane], before[lane ^ step]);
  }
  std::vector<uint32_t> left = row;
  for (int j = 0; j < topk; ++j) {
    const size_t expected = size_t(std::max_element(left.begin(), left.end()) - left.begin());
    for (int lane = 0; lane < kLanes; ++lane) {
      const uint32_t id = moeext::host_device::key_index(top[lane][j]);
      const uint32_t value = uint32_t(top[lane][j] >> 32);
      CHECK(id == expected && value == left[expected] && value != 0,
            "V=%d K=%d lane %d place %d: expert %u (%u), expected %zu (%u)", V, K, lane, j, id,
            value, expected, left[expected]);
    }
    left[expected] = 0;
  }
}

template <int V, int K>
void test_merges(std::mt19937& rng) {
  std::vector<uint32_t> row(size_t(kLanes * V));
  for (int trial = 0; trial < 2000; ++trial) {
    // As test_rounds: many ties, a share out of play, at least topk in play; topk up to K.
    const uint32_t range = trial % 3 == 0 ? 3u : (trial % 3 == 1 ? 50u : 0xfffffffeu);
    const int topk = K / 2 + 1 + int(rng() % uint32_t(K - K / 2));
    int in_play = 0;
    for (auto& v : row) {
      v = rng() % (trial % 5 == 0 ? 16 : 4) != 0 ? 0u : 1u + rng() % range;
      in_play += v != 0;
    }
    for (size_t e = 0; in_play < topk; e += 7) {
      if (row[e % row.size()] == 0) row[e % row.size()] = 1, ++in_play;
    }
    check_merges<V, K>(row, topk);
  }
}

}  // namespace

int main() {
  std::mt19937 rng(20261129);
  test_sort_widths(rng, std::make_integer_sequence<int, gt::kMaxSortedExpertsPerLane>{});
  test_rounds<4>(rng);
  test_rounds<8>(rng);
  test_rounds<12>(rng);
  test_rounds<16>(rng);
  test_merges<4, 8>(rng);  // fewer experts a lane than the list holds
  test_merges<8, 8>(rng);
  test_merges<12, 8>(rng);
  test_merges<16, 4>(rng);
  test_merges<8, 1>(rng);
  test_merges<8, 2>(rng);
  return moeext_test::finish("test_sort_lane");
}
