// The logic of biased grouped top-k routing (SPEC.md section 1) that the CPU and GPU kernels
// share: key packing, group scores, the weights and the NaN policy. Compiled for the host and
// the GPU alike (no GPU runtime header), so the GPU kernels, the CPU kernel
// (csrc/cpu/grouped_topk.cpp) and the host unit test tests/cpp/test_routing.cpp run these
// very functions. Where the CPU kernel spells a piece out instead, a comment there says why.
//
// Conventions:
//   * b is the biased score with NaN replaced by -inf before anything compares it.
//   * A key packs a value and an index so that "larger value, then lower index" is one
//     unsigned compare: the value as an order-preserving unsigned int (-0 folded onto +0,
//     NaN counted as -inf) in the high word, the inverted index in the low word.
//   * Key 0 is below the key of every real value (-inf included), so a kernel removes a
//     winner, or leaves out an expert, by setting its key to 0.
//
// Group scores and weights are templates over the value type T, so that one expression
// serves both backends: T is float (a GPU lane's value, or the CPU's scalar code) or a CPU
// vector type of csrc/cpu/vec.h (one value per lane). The operations whose best instruction
// differs between the two are the overloads under "Lane-wise operations"; each pair gives
// the same bits.
#pragma once

#include <cstdint>
#include <type_traits>

#include "host_device/float_bits.h"
#include "moeext/common.h"

namespace moeext::host_device {

// ---------------------------------------------------------------------------------------
// Lane-wise operations: float here, a CPU vector type V through its static members (set1,
// max, min, select, is_nan). max_of and min_of have x86's max and min semantics (the second
// operand where either is NaN), which the float ternaries share.
// ---------------------------------------------------------------------------------------

template <typename T>
MOEEXT_HOST_DEVICE inline T splat(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return T::set1(x);
  }
}

MOEEXT_HOST_DEVICE inline float max_of(float a, float b) { return a > b ? a : b; }
MOEEXT_HOST_DEVICE inline float min_of(float a, float b) { return a < b ? a : b; }
template <typename V>
inline V max_of(V a, V b) {
  return V::max(a, b);
}
template <typename V>
inline V min_of(V a, V b) {
  return V::min(a, b);
}

MOEEXT_HOST_DEVICE inline float nan_to_neg_inf(float x) { return is_nan(x) ? neg_inf() : x; }
// One instruction on vectors: max gives its second operand, -inf, in a NaN lane.
template <typename V>
inline V nan_to_neg_inf(V x) {
  return V::max(x, V::set1(neg_inf()));
}

MOEEXT_HOST_DEVICE inline float nan_to_zero(float x) { return is_nan(x) ? 0.0f : x; }
template <typename V>
inline V nan_to_zero(V x) {
  return V::select(V::is_nan(x), V::set1(0.0f), x);
}

// ---------------------------------------------------------------------------------------
// Keys.
// ---------------------------------------------------------------------------------------

constexpr uint64_t kRemovedKey = 0;

// ordered_bits for a value known not to be NaN (b after nan_to_neg_inf): the CPU kernel's
// hot loops hold only such values and skip the test.
MOEEXT_HOST_DEVICE inline uint32_t ordered_bits_nan_free(float value) {
  // + 0.0f turns -0 into +0 under round-to-nearest and leaves every other value alone.
  const uint32_t bits = float_bits(value + 0.0f);
  return bits ^ ((bits >> 31) ? 0xffffffffu : 0x80000000u);
}

// ordered(a) > ordered(b) exactly when a > b as floats, with -0 == +0 and NaN as -inf.
MOEEXT_HOST_DEVICE inline uint32_t ordered_bits(float value) {
  return ordered_bits_nan_free(nan_to_neg_inf(value));
}

// Inverse of ordered_bits for the values it produces (never -0, never NaN).
MOEEXT_HOST_DEVICE inline float ordered_value(uint32_t ordered) {
  return bits_float((ordered >> 31) ? (ordered ^ 0x80000000u) : ~ordered);
}

MOEEXT_HOST_DEVICE inline uint64_t key_from_ordered(uint32_t ordered, uint32_t index) {
  return (uint64_t(ordered) << 32) | uint32_t(~index);
}

MOEEXT_HOST_DEVICE inline uint64_t make_key(float value, uint32_t index) {
  return key_from_ordered(ordered_bits(value), index);
}

MOEEXT_HOST_DEVICE inline uint64_t make_key_nan_free(float value, uint32_t index) {
  return key_from_ordered(ordered_bits_nan_free(value), index);
}

MOEEXT_HOST_DEVICE inline uint32_t key_index(uint64_t key) { return ~uint32_t(key); }

MOEEXT_HOST_DEVICE inline float key_value(uint64_t key) { return ordered_value(uint32_t(key >> 32)); }

// ---------------------------------------------------------------------------------------
// Group scores (SPEC steps 2-3).
// ---------------------------------------------------------------------------------------

// The two largest of a set of NaN-free values, a repeated maximum counted twice (as
// topk(2) counts it). Empty: both -inf.
template <typename T>
struct Top2Of {
  T first;
  T second;
};
using Top2 = Top2Of<float>;

template <typename T = float>
MOEEXT_HOST_DEVICE inline Top2Of<T> top2_empty() {
  return Top2Of<T>{splat<T>(neg_inf()), splat<T>(neg_inf())};
}

template <typename T>
MOEEXT_HOST_DEVICE inline Top2Of<T> top2_push(Top2Of<T> t, T x) {
  const T low = min_of(x, t.first);
  return Top2Of<T>{max_of(x, t.first), max_of(low, t.second)};
}

// The top-2 of the union of two sets: the larger first, and the larger of the smaller first
// and the two seconds.
template <typename T>
MOEEXT_HOST_DEVICE inline Top2Of<T> top2_merge(Top2Of<T> a, Top2Of<T> b) {
  const T high = max_of(a.first, b.first);
  const T low = min_of(b.first, a.first);  // the other one: on a tie high is b's, low a's
  const T seconds = max_of(a.second, b.second);
  return Top2Of<T>{high, max_of(low, seconds)};
}

// SPEC step 3: with a bias the sum of the top two (a group of one expert scores that
// expert), without a bias the maximum. +inf + -inf is NaN: it ranks as -inf, like NaN in b.
template <typename T>
MOEEXT_HOST_DEVICE inline T group_score(Top2Of<T> t, bool has_bias, int64_t group_size) {
  if (!has_bias || group_size == 1) return t.first;
  return nan_to_neg_inf(t.first + t.second);
}

// ---------------------------------------------------------------------------------------
// Weights (SPEC steps 6-7).
// ---------------------------------------------------------------------------------------

// SPEC step 6: the weight of a chosen expert is its unbiased score, 0 where that is NaN.
template <typename T>
MOEEXT_HOST_DEVICE inline T weight_of_score(T s) {
  return nan_to_zero(s);
}

// SPEC step 7's denominator: `sum` is the fp32 sum of the topk weights added in order
// j = 0, 1, ..., topk - 1 (that order is part of the result).
constexpr float kRenormalizeEpsilon = 1e-20f;

template <typename T>
MOEEXT_HOST_DEVICE inline T renormalize_denominator(T sum) {
  return sum + splat<T>(kRenormalizeEpsilon);
}

// SPEC step 7: divided, then scaled (never w * (scale / denominator)). The denominator is
// formed only where it is used: hoisted above the branch, it changed the HIP code.
template <typename T>
MOEEXT_HOST_DEVICE inline T finalize_weight(T w, T sum, bool renormalize,
                                            T routed_scaling_factor) {
  if (renormalize) return w / renormalize_denominator(sum) * routed_scaling_factor;
  return w * routed_scaling_factor;
}

}  // namespace moeext::host_device
