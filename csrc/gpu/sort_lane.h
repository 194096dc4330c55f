// A lane's sort of its experts for the routing warp kernel's sorted lanes
// (grouped_topk_warp.h, sorts_lanes): values larger first, the lower expert first on a tie,
// and where each came from, packed; and the merge of two sorted lists of keys that routing
// variant 8 runs over a butterfly of lanes (merge_top_keys). No GPU runtime header here: the host unit test
// tests/cpp/test_sort_lane.cpp compiles these very functions.
#pragma once

#include <cstdint>
#include <type_traits>

#include "moeext/common.h"

namespace moeext::gpu::grouped_topk {

// Up to 16 experts a lane: a lane's order of its experts then packs into 64 bits.
constexpr int kMaxSortedExpertsPerLane = 16;

// A lane's order of its experts: 4 bits a slot, slot i the position in the lane of the value
// now i-th.
template <int V>
using SlotOrder = std::conditional_t<(V <= 8), uint32_t, uint64_t>;

// Puts the larger of positions kA < kB first, the lower slot first on a tie; nothing where kB
// is past the lane (the network's padding).
template <int kA, int kB, int V>
MOEEXT_HOST_DEVICE inline void order_pair(uint32_t (&value)[V], uint32_t (&slot)[V]) {
  if constexpr (kB < V) {
    const bool swap =
        value[kB] > value[kA] || (value[kB] == value[kA] && slot[kB] < slot[kA]);
    const uint32_t value_a = value[kA];
    const uint32_t slot_a = slot[kA];
    value[kA] = swap ? value[kB] : value_a;
    slot[kA] = swap ? slot[kB] : slot_a;
    value[kB] = swap ? value_a : value[kB];
    slot[kB] = swap ? slot_a : slot[kB];
  }
}

// order_pair(i, i + kR) for i = kI, kI + kStep, ... below kEnd.
template <int kI, int kEnd, int kStep, int kR, int V>
MOEEXT_HOST_DEVICE inline void order_pairs(uint32_t (&value)[V], uint32_t (&slot)[V]) {
  if constexpr (kI < kEnd) {
    order_pair<kI, kI + kR>(value, slot);
    order_pairs<kI + kStep, kEnd, kStep, kR>(value, slot);
  }
}

// Batcher's odd-even merge of the sorted halves of [kLo, kHi] (inclusive), comparing
// elements kR apart.
template <int kLo, int kHi, int kR, int V>
MOEEXT_HOST_DEVICE inline void odd_even_merge(uint32_t (&value)[V], uint32_t (&slot)[V]) {
  constexpr int kStep = 2 * kR;
  if constexpr (kStep < kHi - kLo) {
    odd_even_merge<kLo, kHi, kStep>(value, slot);
    odd_even_merge<kLo + kR, kHi, kStep>(value, slot);
    order_pairs<kLo + kR, kHi - kR, kStep, kR>(value, slot);
  } else {
    order_pair<kLo, kLo + kR>(value, slot);
  }
}

// Batcher's odd-even merge sort of [kLo, kHi] (inclusive).
template <int kLo, int kHi, int V>
MOEEXT_HOST_DEVICE inline void odd_even_merge_sort(uint32_t (&value)[V], uint32_t (&slot)[V]) {
  if constexpr (kHi > kLo) {
    constexpr int kMid = kLo + (kHi - kLo) / 2;
    odd_even_merge_sort<kLo, kMid>(value, slot);
    odd_even_merge_sort<kMid + 1, kHi>(value, slot);
    odd_even_merge<kLo, kHi, 1>(value, slot);
  }
}

MOEEXT_HOST_DEVICE constexpr int sort_network_width(int v) {
  return v <= 1 ? 1 : 2 * sort_network_width((v + 1) / 2);
}

// Sorts a lane's values in place, larger first and the lower position first on a tie, and
// returns where each came from. The network is the one for the next power of two with its
// pairs past V left out: the missing elements would be the least and never move, so what is
// left sorts V (19 pairs at 8 a lane, 42 at 12).
template <int V>
MOEEXT_HOST_DEVICE inline SlotOrder<V> sort_lane(uint32_t (&value)[V]) {
  static_assert(V >= 1 && V <= kMaxSortedExpertsPerLane, "4-bit slots, 64 bits in all");
  uint32_t slot[V];
  for (int i = 0; i < V; ++i) slot[i] = uint32_t(i);
  odd_even_merge_sort<0, sort_network_width(V) - 1>(value, slot);
  SlotOrder<V> order = 0;
  for (int i = 0; i < V; ++i) order |= SlotOrder<V>(slot[i]) << (4 * i);
  return order;
}

// The lane position of the first value.
template <typename Order>
MOEEXT_HOST_DEVICE inline uint32_t first_slot(Order order) {
  return uint32_t(order & 15u);
}

// Where `drops`, removes the first value: the rest move up one and 0 (out of play) comes in
// last.
template <int V>
MOEEXT_HOST_DEVICE inline void drop_first_if(bool drops, uint32_t (&value)[V],
                                             SlotOrder<V>& order) {
  for (int i = 0; i + 1 < V; ++i) value[i] = drops ? value[i + 1] : value[i];
  value[V - 1] = drops ? 0u : value[V - 1];
  order = drops ? SlotOrder<V>(order >> 4) : order;
}

// a and b as (larger, smaller). On CUDA one 64-bit compare feeds both selects: written in
// C++, nvcc compares twice (a maximum and a minimum), 24 instructions more a merge of 8 keys.
MOEEXT_HOST_DEVICE inline void order_keys(uint64_t a, uint64_t b, uint64_t& larger,
                                          uint64_t& smaller) {
#if defined(__CUDA_ARCH__)
  asm("{ .reg .pred p; setp.gt.u64 p, %2, %3; selp.b64 %0, %2, %3, p; selp.b64 %1, %3, %2, p; }"
      : "=l"(larger), "=l"(smaller)
      : "l"(b), "l"(a));
#else
  const bool swap = b > a;
  larger = swap ? b : a;
  smaller = swap ? a : b;
#endif
}

// Each pair (i, i + kSpan) whose i has bit kSpan clear put larger first, then the same at half
// the span: a bitonic sequence of K keys sorted larger first.
template <int kSpan, int K>
MOEEXT_HOST_DEVICE inline void bitonic_sort_keys(uint64_t (&key)[K]) {
  if constexpr (kSpan > 0) {
    for (int i = 0; i < K; ++i) {
      if ((i & kSpan) == 0) order_keys(key[i], key[i + kSpan], key[i], key[i + kSpan]);
    }
    bitonic_sort_keys<kSpan / 2>(key);
  }
}

// The K largest of two lists of K keys, each sorted larger first, into `mine`, sorted likewise.
// The larger of each pair taken from opposite ends is a bitonic sequence that holds them
// (Batcher), which a bitonic merge sorts. Keys equal across the lists are taken either way.
template <int K>
MOEEXT_HOST_DEVICE inline void merge_top_keys(uint64_t (&mine)[K], const uint64_t (&theirs)[K]) {
  static_assert(K >= 1 && (K & (K - 1)) == 0, "a bitonic merge of a power of two");
  for (int i = 0; i < K; ++i) {
    const uint64_t other = theirs[K - 1 - i];
    mine[i] = mine[i] > other ? mine[i] : other;
  }
  bitonic_sort_keys<K / 2>(mine);
}

}  // namespace moeext::gpu::grouped_topk
