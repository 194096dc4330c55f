// Host unit test of csrc/host_device/routing.h, the routing logic the grouped top-k GPU
// kernels run and the CPU kernel shares: each function against a straightforward statement
// of SPEC.md section 1, and its CPU vector instance against its float one, lane by lane.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#define MOEEXT_CPU_ISA portable  // the vector layer vec_portable.h is compiled for
#include "check.h"
#include "cpu/vec_portable.h"
#include "host_device/routing.h"

namespace rt = moeext::host_device;
using moeext::host_device::bits_float;
using moeext::host_device::float_bits;

namespace {

void fail(const char* what, float a, uint32_t i, float b, uint32_t j) {
  if (moeext_test::report_failure()) {
    std::printf("%s: (%08x, %u) vs (%08x, %u)\n", what, float_bits(a), i, float_bits(b), j);
  }
}

const float kInf = std::numeric_limits<float>::infinity();

// SPEC: NaN in b counts as -inf; -0 == +0 as floats compare.
float as_ranked(float x) { return std::isnan(x) ? -kInf : x; }

// "Larger value, then lower index", spelled out.
bool beats(float a, uint32_t i, float b, uint32_t j) {
  const float va = as_ranked(a), vb = as_ranked(b);
  if (va != vb) return va > vb;
  return i < j;
}

std::vector<float> special_values() {
  const float denorm = std::numeric_limits<float>::denorm_min();
  const float fmax = std::numeric_limits<float>::max();
  const float fmin = std::numeric_limits<float>::min();
  return {0.0f,      -0.0f,     1.0f,       -1.0f,      kInf,       -kInf,
          fmax,      -fmax,     fmin,       -fmin,      denorm,     -denorm,
          2 * denorm, -2 * denorm, 0.5f,    2.0f,       2.0000002f, 1.9999999f,
          std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
          bits_float(0x7f800001u), bits_float(0xffc00001u), bits_float(0x7fffffffu),
          bits_float(0xffffffffu)};
}

float random_float(std::mt19937& rng) {
  switch (rng() % 4) {
    case 0: return bits_float(rng());  // any bit pattern, NaN and denormals included
    case 1: return float(int(rng() % 7) - 3);  // small integers: many exact ties
    case 2: return std::ldexp(float(rng() % 1000) / 1000.0f, int(rng() % 20) - 10);
    default: {
      const std::vector<float> s = special_values();
      return s[rng() % s.size()];
    }
  }
}

void test_is_nan() {
  for (float x : special_values()) {
    CHECK(rt::is_nan(x) == std::isnan(x), "is_nan(%08x)", float_bits(x));
    const float y = rt::nan_to_neg_inf(x);
    CHECK(std::isnan(x) ? (y == -kInf) : (float_bits(y) == float_bits(x)),
          "nan_to_neg_inf(%08x) = %08x", float_bits(x), float_bits(y));
  }
  std::mt19937 rng(7);
  for (int n = 0; n < 1000000; ++n) {
    const float x = bits_float(rng());
    CHECK(rt::is_nan(x) == std::isnan(x), "is_nan(%08x)", float_bits(x));
  }
}

void test_key_order() {
  const std::vector<float> specials = special_values();
  const uint32_t indices[] = {0u, 1u, 2u, 7u, 255u, 4095u, 0x7fffffffu, 0xfffffffeu};
  for (float a : specials) {
    for (float b : specials) {
      for (uint32_t i : indices) {
        for (uint32_t j : indices) {
          if (i == j && float_bits(a) != float_bits(b)) continue;  // one expert, one value
          const bool want = beats(a, i, b, j);
          const bool got = rt::make_key(a, i) > rt::make_key(b, j);
          if (got != want) fail("key order (special)", a, i, b, j);
          // Through the 32-bit ordered value the ranking of groups compares.
          const bool got32 = rt::key_from_ordered(rt::ordered_bits(a), i) >
                             rt::key_from_ordered(rt::ordered_bits(b), j);
          if (got32 != want) fail("ordered_bits order", a, i, b, j);
        }
      }
    }
  }
  std::mt19937 rng(42);
  for (int n = 0; n < 2000000; ++n) {
    const float a = random_float(rng), b = random_float(rng);
    uint32_t i = rng() % 600, j = rng() % 600;
    if (i == j) j = i + 1;
    if (beats(a, i, b, j) != (rt::make_key(a, i) > rt::make_key(b, j))) {
      fail("key order (random)", a, i, b, j);
    }
  }
  // Sorting keys gives the order of a stable descending sort of the ranked values.
  for (int trial = 0; trial < 2000; ++trial) {
    const int n = 1 + int(rng() % 300);
    std::vector<float> values(n);
    for (float& v : values) v = random_float(rng);
    std::vector<uint32_t> want(n);
    for (int e = 0; e < n; ++e) want[e] = uint32_t(e);
    std::stable_sort(want.begin(), want.end(), [&](uint32_t x, uint32_t y) {
      return as_ranked(values[x]) > as_ranked(values[y]);
    });
    std::vector<uint64_t> keys(n);
    for (int e = 0; e < n; ++e) keys[e] = rt::make_key(values[e], uint32_t(e));
    std::sort(keys.begin(), keys.end(), [](uint64_t x, uint64_t y) { return x > y; });
    for (int r = 0; r < n; ++r) {
      CHECK(rt::key_index(keys[r]) == want[r], "rank %d of %d: expert %u, expected %u", r, n,
            rt::key_index(keys[r]), want[r]);
    }
  }
}

void test_key_round_trip() {
  std::mt19937 rng(3);
  std::vector<float> values = special_values();
  for (int n = 0; n < 100000; ++n) values.push_back(random_float(rng));
  for (float v : values) {
    const uint32_t index = rng() % 5000;
    const uint64_t key = rt::make_key(v, index);
    CHECK(rt::key_index(key) == index, "key_index of (%08x, %u) = %u", float_bits(v), index,
          rt::key_index(key));
    // The value comes back as ranked: NaN as -inf, -0 as +0, everything else bit for bit.
    const float want = std::isnan(v) ? -kInf : (v == 0.0f ? 0.0f : v);
    CHECK(float_bits(rt::key_value(key)) == float_bits(want), "key_value of %08x = %08x",
          float_bits(v), float_bits(rt::key_value(key)));
    // Key 0 marks removed experts: below every real key, -inf and NaN at the top index too.
    CHECK(key > rt::kRemovedKey, "key of (%08x, %u) is not above the removed key",
          float_bits(v), index);
  }
  for (uint32_t index : {0u, 1u, 511u, 4095u, 0x7fffffffu, 0xfffffffeu, 0xffffffffu}) {
    CHECK(rt::key_index(rt::make_key(1.0f, index)) == index, "index %u", index);
    CHECK(rt::make_key(-kInf, index) > rt::kRemovedKey, "-inf at index %u", index);
    CHECK(rt::make_key(std::nanf(""), index) == rt::make_key(-kInf, index), "NaN at %u", index);
  }
  CHECK(rt::make_key(-0.0f, 5) == rt::make_key(0.0f, 5), "-0 and +0 differ");
}

// The two largest (a repeated maximum twice), by sorting.
rt::Top2 brute_top2(const std::vector<float>& v) {
  std::vector<float> sorted(v);
  std::sort(sorted.begin(), sorted.end(), [](float x, float y) { return x > y; });
  return rt::Top2{sorted.size() > 0 ? sorted[0] : -kInf, sorted.size() > 1 ? sorted[1] : -kInf};
}

bool same_value(float a, float b) { return a == b || (std::isnan(a) && std::isnan(b)); }

float nan_free_random(std::mt19937& rng) {
  const float x = random_float(rng);
  return std::isnan(x) ? -kInf : x;  // the kernels push b, NaN already -inf
}

void test_top2() {
  std::mt19937 rng(11);
  const rt::Top2 empty = rt::top2_empty();
  CHECK(empty.first == -kInf && empty.second == -kInf, "top2_empty");
  for (int trial = 0; trial < 200000; ++trial) {
    const int na = int(rng() % 6), nb = int(rng() % 6);
    std::vector<float> a(na), b(nb);
    for (float& x : a) x = nan_free_random(rng);
    for (float& x : b) x = nan_free_random(rng);
    rt::Top2 ta = rt::top2_empty(), tb = rt::top2_empty();
    for (float x : a) ta = rt::top2_push(ta, x);
    for (float x : b) tb = rt::top2_push(tb, x);
    const rt::Top2 want_a = brute_top2(a);
    CHECK(same_value(ta.first, want_a.first) && same_value(ta.second, want_a.second),
          "top2_push of %d values: (%g, %g), expected (%g, %g)", na, ta.first, ta.second,
          want_a.first, want_a.second);
    std::vector<float> all(a);
    all.insert(all.end(), b.begin(), b.end());
    const rt::Top2 want = brute_top2(all);
    for (const rt::Top2 merged : {rt::top2_merge(ta, tb), rt::top2_merge(tb, ta)}) {
      CHECK(same_value(merged.first, want.first) && same_value(merged.second, want.second),
            "top2_merge: (%g, %g), expected (%g, %g)", merged.first, merged.second, want.first,
            want.second);
    }
  }
  // A duplicated maximum counts twice.
  rt::Top2 t = rt::top2_empty();
  for (float x : {5.0f, 1.0f, 5.0f, 0.0f}) t = rt::top2_push(t, x);
  CHECK(t.first == 5.0f && t.second == 5.0f, "duplicated maximum: (%g, %g)", t.first, t.second);
}

void test_group_score() {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 100000; ++trial) {
    const int64_t group_size = 1 + int64_t(rng() % 5);
    std::vector<float> v(static_cast<size_t>(group_size));
    for (float& x : v) x = nan_free_random(rng);
    rt::Top2 t = rt::top2_empty();
    for (float x : v) t = rt::top2_push(t, x);
    const rt::Top2 top = brute_top2(v);
    // Reference: topk(2).sum() with the NaN of +inf + -inf ranked as -inf; amax without bias.
    float want_biased = group_size == 1 ? top.first : top.first + top.second;
    if (std::isnan(want_biased)) want_biased = -kInf;
    const float got_biased = rt::group_score(t, true, group_size);
    const float got_plain = rt::group_score(t, false, group_size);
    CHECK(float_bits(got_biased) == float_bits(want_biased) ||
              (got_biased == 0.0f && want_biased == 0.0f),
          "biased group score of %lld: %g, expected %g", (long long)group_size, got_biased,
          want_biased);
    CHECK(same_value(got_plain, top.first), "group max: %g, expected %g", got_plain, top.first);
    CHECK(!std::isnan(got_biased), "group score NaN");
  }
  CHECK(rt::group_score(rt::Top2{kInf, -kInf}, true, 4) == -kInf, "+inf + -inf is not -inf");
  CHECK(rt::group_score(rt::Top2{3.0f, -kInf}, true, 1) == 3.0f, "one-expert group");
  CHECK(rt::group_score(rt::Top2{3.0f, 2.5f}, true, 2) == 5.5f, "top-2 sum");
  CHECK(rt::group_score(rt::Top2{3.0f, 2.5f}, false, 2) == 3.0f, "max without bias");
}

void test_weights() {
  CHECK(rt::weight_of_score(std::nanf("")) == 0.0f, "NaN weight");
  CHECK(rt::weight_of_score(-std::nanf("")) == 0.0f, "-NaN weight");
  for (float s : {0.0f, -0.0f, 0.25f, 1.0f, kInf, 3e-39f}) {
    CHECK(float_bits(rt::weight_of_score(s)) == float_bits(s), "weight of %g", s);
  }
  // The CPU kernel's arithmetic, step by step through volatiles so that nothing is fused or
  // reordered: the GPU result must equal it bit for bit.
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (int trial = 0; trial < 100000; ++trial) {
    const int topk = 1 + int(rng() % 32);
    std::vector<float> w(static_cast<size_t>(topk));
    volatile float sum = 0.0f;
    for (float& x : w) {
      x = trial % 7 == 0 ? 0.0f : unit(rng);
      sum = sum + x;
    }
    const float scale = trial % 3 == 0 ? 1.0f : 0.1f + 4.0f * unit(rng);
    for (float x : w) {
      volatile float denom = sum + 1e-20f;
      volatile float quotient = x / denom;
      volatile float want = quotient * scale;
      volatile float want_plain = x * scale;
      const float got = rt::finalize_weight(x, sum, true, scale);
      const float got_plain = rt::finalize_weight(x, sum, false, scale);
      CHECK(float_bits(got) == float_bits(want), "renormalised %a / %a * %a = %a, expected %a",
            x, float(sum), scale, got, float(want));
      CHECK(float_bits(got_plain) == float_bits(want_plain), "scaled %a * %a", x, scale);
    }
  }
  // All-zero weights (an all-NaN row): 0 / 1e-20 is 0, not NaN.
  CHECK(rt::finalize_weight(0.0f, 0.0f, true, 2.5f) == 0.0f, "zero row");
  CHECK(rt::finalize_weight(1.0f, 4.0f, true, 2.0f) == 0.5f, "1 / 4 * 2");
}

// The keys of NaN-free values (b after nan_to_neg_inf) without the NaN test: the same keys.
void test_nan_free_keys() {
  std::mt19937 rng(13);
  std::vector<float> values = special_values();
  for (int n = 0; n < 1000000; ++n) values.push_back(random_float(rng));
  for (float v : values) {
    const float b = rt::nan_to_neg_inf(v);
    const uint32_t index = rng() % 5000;
    CHECK(rt::ordered_bits_nan_free(b) == rt::ordered_bits(v), "ordered_bits_nan_free(%08x)",
          float_bits(b));
    CHECK(rt::make_key_nan_free(b, index) == rt::make_key(v, index), "make_key_nan_free(%08x)",
          float_bits(b));
  }
}

// ---- the CPU's vector instances -----------------------------------------------------------

using Vec = moeext::cpu::portable::Vec;
constexpr int W = Vec::kWidth;

struct Lanes {
  float v[W];
};
Lanes lanes_of(Vec x) {
  Lanes l;
  x.store(l.v);
  return l;
}
Vec vec_of(const float* v) { return Vec::load(v); }

bool same_bits(Vec got, const float* want) {
  const Lanes l = lanes_of(got);
  for (int r = 0; r < W; ++r) {
    if (float_bits(l.v[r]) != float_bits(want[r])) return false;
  }
  return true;
}

// Every template over the value type gives, in each lane of a CPU vector, the bits its float
// instance gives: the CPU kernel may adopt the vector instances without changing a result.
void test_vector_instances() {
  std::mt19937 rng(17);
  const rt::Top2Of<Vec> empty = rt::top2_empty<Vec>();
  const float neg[W] = {-kInf, -kInf, -kInf, -kInf, -kInf, -kInf, -kInf, -kInf};
  CHECK(same_bits(empty.first, neg) && same_bits(empty.second, neg), "top2_empty<Vec>");
  for (int trial = 0; trial < 50000; ++trial) {
    float a1[W], a2[W], b1[W], b2[W], x[W], any[W], w[W], sum[W], scale[W];
    for (int r = 0; r < W; ++r) {
      // Top-2 pairs as the kernels hold them: NaN-free, first >= second.
      a1[r] = nan_free_random(rng), a2[r] = nan_free_random(rng);
      b1[r] = nan_free_random(rng), b2[r] = nan_free_random(rng);
      if (a2[r] > a1[r]) std::swap(a1[r], a2[r]);
      if (b2[r] > b1[r]) std::swap(b1[r], b2[r]);
      x[r] = nan_free_random(rng);
      any[r] = random_float(rng);  // NaN included
      w[r] = random_float(rng);
      sum[r] = random_float(rng);
      scale[r] = random_float(rng);
    }
    const rt::Top2Of<Vec> va{vec_of(a1), vec_of(a2)}, vb{vec_of(b1), vec_of(b2)};
    const rt::Top2Of<Vec> pushed = rt::top2_push(va, vec_of(x));
    const rt::Top2Of<Vec> merged = rt::top2_merge(va, vb);
    const int64_t group_size = 1 + int64_t(rng() % 3);
    const Vec biased = rt::group_score(va, true, group_size);
    const Vec plain = rt::group_score(va, false, group_size);
    const Vec no_nan = rt::nan_to_neg_inf(vec_of(any));
    const Vec weight = rt::weight_of_score(vec_of(any));
    const Vec denominator = rt::renormalize_denominator(vec_of(sum));
    const Vec renormalised = rt::finalize_weight(vec_of(w), vec_of(sum), true, vec_of(scale));
    const Vec scaled = rt::finalize_weight(vec_of(w), vec_of(sum), false, vec_of(scale));
    float want[11][W];
    for (int r = 0; r < W; ++r) {
      const rt::Top2 a{a1[r], a2[r]}, b{b1[r], b2[r]};
      const rt::Top2 p = rt::top2_push(a, x[r]), m = rt::top2_merge(a, b);
      want[0][r] = p.first;
      want[1][r] = p.second;
      want[2][r] = m.first;
      want[3][r] = m.second;
      want[4][r] = rt::group_score(a, true, group_size);
      want[5][r] = rt::group_score(a, false, group_size);
      want[6][r] = rt::nan_to_neg_inf(any[r]);
      want[7][r] = rt::weight_of_score(any[r]);
      want[8][r] = rt::renormalize_denominator(sum[r]);
      want[9][r] = rt::finalize_weight(w[r], sum[r], true, scale[r]);
      want[10][r] = rt::finalize_weight(w[r], sum[r], false, scale[r]);
    }
    const Vec got[11] = {pushed.first, pushed.second, merged.first, merged.second, biased, plain,
                         no_nan, weight, denominator, renormalised, scaled};
    const char* names[11] = {"top2_push first", "top2_push second", "top2_merge first",
                             "top2_merge second", "group_score (bias)", "group_score (no bias)",
                             "nan_to_neg_inf", "weight_of_score", "renormalize_denominator",
                             "finalize_weight (renormalize)", "finalize_weight (scale only)"};
    for (int i = 0; i < 11; ++i) {
      // NaN lanes (from NaN weights or sums) must be NaN in both; any other lane, the same bits.
      const Lanes l = lanes_of(got[i]);
      for (int r = 0; r < W; ++r) {
        const bool both_nan = std::isnan(l.v[r]) && std::isnan(want[i][r]);
        CHECK(both_nan || float_bits(l.v[r]) == float_bits(want[i][r]),
              "%s<Vec> lane %d: %08x, float gives %08x", names[i], r, float_bits(l.v[r]),
              float_bits(want[i][r]));
      }
    }
  }
}

}  // namespace

int main() {
  test_is_nan();
  test_key_order();
  test_key_round_trip();
  test_top2();
  test_group_score();
  test_weights();
  test_nan_free_keys();
  test_vector_instances();
  return moeext_test::finish("routing");
}
