// Host unit test of csrc/gpu/grouped_topk_logic.h, the logic the grouped top-k GPU kernels
// run: each function against a straightforward statement of SPEC.md section 1.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "check.h"
#include "gpu/grouped_topk_logic.h"

namespace gt = moeext::gpu::grouped_topk;
using moeext::gpu::bits_float;
using moeext::gpu::float_bits;

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
    CHECK(gt::is_nan(x) == std::isnan(x), "is_nan(%08x)", float_bits(x));
    const float y = gt::nan_to_neg_inf(x);
    CHECK(std::isnan(x) ? (y == -kInf) : (float_bits(y) == float_bits(x)),
          "nan_to_neg_inf(%08x) = %08x", float_bits(x), float_bits(y));
  }
  std::mt19937 rng(7);
  for (int n = 0; n < 1000000; ++n) {
    const float x = bits_float(rng());
    CHECK(gt::is_nan(x) == std::isnan(x), "is_nan(%08x)", float_bits(x));
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
          const bool got = gt::make_key(a, i) > gt::make_key(b, j);
          if (got != want) fail("key order (special)", a, i, b, j);
          // Through the 32-bit ordered value the ranking of groups compares.
          const bool got32 = gt::key_from_ordered(gt::ordered_bits(a), i) >
                             gt::key_from_ordered(gt::ordered_bits(b), j);
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
    if (beats(a, i, b, j) != (gt::make_key(a, i) > gt::make_key(b, j))) {
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
    for (int e = 0; e < n; ++e) keys[e] = gt::make_key(values[e], uint32_t(e));
    std::sort(keys.begin(), keys.end(), [](uint64_t x, uint64_t y) { return x > y; });
    for (int r = 0; r < n; ++r) {
      CHECK(gt::key_index(keys[r]) == want[r], "rank %d of %d: expert %u, expected %u", r, n,
            gt::key_index(keys[r]), want[r]);
    }
  }
}

void test_key_round_trip() {
  std::mt19937 rng(3);
  std::vector<float> values = special_values();
  for (int n = 0; n < 100000; ++n) values.push_back(random_float(rng));
  for (float v : values) {
    const uint32_t index = rng() % 5000;
    const uint64_t key = gt::make_key(v, index);
    CHECK(gt::key_index(key) == index, "key_index of (%08x, %u) = %u", float_bits(v), index,
          gt::key_index(key));
    // The value comes back as ranked: NaN as -inf, -0 as +0, everything else bit for bit.
    const float want = std::isnan(v) ? -kInf : (v == 0.0f ? 0.0f : v);
    CHECK(float_bits(gt::key_value(key)) == float_bits(want), "key_value of %08x = %08x",
          float_bits(v), float_bits(gt::key_value(key)));
    // Key 0 marks removed experts: below every real key, -inf and NaN at the top index too.
    CHECK(key > gt::kRemovedKey, "key of (%08x, %u) is not above the removed key",
          float_bits(v), index);
  }
  for (uint32_t index : {0u, 1u, 511u, 4095u, 0x7fffffffu, 0xfffffffeu, 0xffffffffu}) {
    CHECK(gt::key_index(gt::make_key(1.0f, index)) == index, "index %u", index);
    CHECK(gt::make_key(-kInf, index) > gt::kRemovedKey, "-inf at index %u", index);
    CHECK(gt::make_key(std::nanf(""), index) == gt::make_key(-kInf, index), "NaN at %u", index);
  }
  CHECK(gt::make_key(-0.0f, 5) == gt::make_key(0.0f, 5), "-0 and +0 differ");
}

// The two largest (a repeated maximum twice), by sorting.
gt::Top2 brute_top2(const std::vector<float>& v) {
  std::vector<float> sorted(v);
  std::sort(sorted.begin(), sorted.end(), [](float x, float y) { return x > y; });
  return gt::Top2{sorted.size() > 0 ? sorted[0] : -kInf, sorted.size() > 1 ? sorted[1] : -kInf};
}

bool same_value(float a, float b) { return a == b || (std::isnan(a) && std::isnan(b)); }

float nan_free_random(std::mt19937& rng) {
  const float x = random_float(rng);
  return std::isnan(x) ? -kInf : x;  // the kernels push b, NaN already -inf
}

void test_top2() {
  std::mt19937 rng(11);
  const gt::Top2 empty = gt::top2_empty();
  CHECK(empty.first == -kInf && empty.second == -kInf, "top2_empty");
  for (int trial = 0; trial < 200000; ++trial) {
    const int na = int(rng() % 6), nb = int(rng() % 6);
    std::vector<float> a(na), b(nb);
    for (float& x : a) x = nan_free_random(rng);
    for (float& x : b) x = nan_free_random(rng);
    gt::Top2 ta = gt::top2_empty(), tb = gt::top2_empty();
    for (float x : a) ta = gt::top2_push(ta, x);
    for (float x : b) tb = gt::top2_push(tb, x);
    const gt::Top2 want_a = brute_top2(a);
    CHECK(same_value(ta.first, want_a.first) && same_value(ta.second, want_a.second),
          "top2_push of %d values: (%g, %g), expected (%g, %g)", na, ta.first, ta.second,
          want_a.first, want_a.second);
    std::vector<float> all(a);
    all.insert(all.end(), b.begin(), b.end());
    const gt::Top2 want = brute_top2(all);
    for (const gt::Top2 merged : {gt::top2_merge(ta, tb), gt::top2_merge(tb, ta)}) {
      CHECK(same_value(merged.first, want.first) && same_value(merged.second, want.second),
            "top2_merge: (%g, %g), expected (%g, %g)", merged.first, merged.second, want.first,
            want.second);
    }
  }
  // A duplicated maximum counts twice.
  gt::Top2 t = gt::top2_empty();
  for (float x : {5.0f, 1.0f, 5.0f, 0.0f}) t = gt::top2_push(t, x);
  CHECK(t.first == 5.0f && t.second == 5.0f, "duplicated maximum: (%g, %g)", t.first, t.second);
}

void test_group_score() {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 100000; ++trial) {
    const int64_t group_size = 1 + int64_t(rng() % 5);
    std::vector<float> v(static_cast<size_t>(group_size));
    for (float& x : v) x = nan_free_random(rng);
    gt::Top2 t = gt::top2_empty();
    for (float x : v) t = gt::top2_push(t, x);
    const gt::Top2 top = brute_top2(v);
    // Reference: topk(2).sum() with the NaN of +inf + -inf ranked as -inf; amax without bias.
    float want_biased = group_size == 1 ? top.first : top.first + top.second;
    if (std::isnan(want_biased)) want_biased = -kInf;
    const float got_biased = gt::group_score(t, true, group_size);
    const float got_plain = gt::group_score(t, false, group_size);
    CHECK(float_bits(got_biased) == float_bits(want_biased) ||
              (got_biased == 0.0f && want_biased == 0.0f),
          "biased group score of %lld: %g, expected %g", (long long)group_size, got_biased,
          want_biased);
    CHECK(same_value(got_plain, top.first), "group max: %g, expected %g", got_plain, top.first);
    CHECK(!std::isnan(got_biased), "group score NaN");
  }
  CHECK(gt::group_score(gt::Top2{kInf, -kInf}, true, 4) == -kInf, "+inf + -inf is not -inf");
  CHECK(gt::group_score(gt::Top2{3.0f, -kInf}, true, 1) == 3.0f, "one-expert group");
  CHECK(gt::group_score(gt::Top2{3.0f, 2.5f}, true, 2) == 5.5f, "top-2 sum");
  CHECK(gt::group_score(gt::Top2{3.0f, 2.5f}, false, 2) == 3.0f, "max without bias");
}

void test_weights() {
  CHECK(gt::weight_of_score(std::nanf("")) == 0.0f, "NaN weight");
  CHECK(gt::weight_of_score(-std::nanf("")) == 0.0f, "-NaN weight");
  for (float s : {0.0f, -0.0f, 0.25f, 1.0f, kInf, 3e-39f}) {
    CHECK(float_bits(gt::weight_of_score(s)) == float_bits(s), "weight of %g", s);
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
      const float got = gt::finalize_weight(x, sum, true, scale);
      const float got_plain = gt::finalize_weight(x, sum, false, scale);
      CHECK(float_bits(got) == float_bits(want), "renormalised %a / %a * %a = %a, expected %a",
            x, float(sum), scale, got, float(want));
      CHECK(float_bits(got_plain) == float_bits(want_plain), "scaled %a * %a", x, scale);
    }
  }
  // All-zero weights (an all-NaN row): 0 / 1e-20 is 0, not NaN.
  CHECK(gt::finalize_weight(0.0f, 0.0f, true, 2.5f) == 0.0f, "zero row");
  CHECK(gt::finalize_weight(1.0f, 4.0f, true, 2.0f) == 0.5f, "1 / 4 * 2");
}

void test_plan() {
  CHECK(gt::is_pow2(1) && gt::is_pow2(2) && gt::is_pow2(64) && !gt::is_pow2(0) &&
            !gt::is_pow2(3) && !gt::is_pow2(12),
        "is_pow2");
  for (int64_t x = 1; x < 300; ++x) {
    const int64_t p = gt::pow2_floor(x);
    CHECK(gt::is_pow2(p) && p <= x && 2 * p > x, "pow2_floor(%lld) = %lld", (long long)x,
          (long long)p);
  }
  CHECK(gt::chunk_load_bytes(4, 4) == 16 && gt::chunk_load_bytes(12, 4) == 16 &&
            gt::chunk_load_bytes(4, 2) == 8 && gt::chunk_load_bytes(8, 2) == 16 &&
            gt::chunk_load_bytes(12, 2) == 8 && gt::chunk_load_bytes(2, 2) == 4,
        "chunk_load_bytes");

  // DeepSeek-V3: 8 groups of 32, kept in registers (4 lanes of 8 on a 32-wide warp, 8 lanes
  // of 4 on a 64-wide one).
  gt::FastPathPlan plan = gt::plan_fast_path(32, 256, 8, 4, 8);
  CHECK(plan.experts_per_lane == 8 && plan.lanes_per_group == 4 && plan.group_scores_in_registers,
        "deepseek-v3 / 32: %d %d %d", plan.experts_per_lane, plan.lanes_per_group,
        int(plan.group_scores_in_registers));
  plan = gt::plan_fast_path(64, 256, 8, 4, 8);
  CHECK(plan.experts_per_lane == 4 && plan.lanes_per_group == 8 && plan.group_scores_in_registers,
        "deepseek-v3 / 64: %d %d %d", plan.experts_per_lane, plan.lanes_per_group,
        int(plan.group_scores_in_registers));
  plan = gt::plan_fast_path(32, 384, 1, 1, 8);  // kimi-k2
  CHECK(plan.experts_per_lane == 12, "kimi-k2 / 32: %d", plan.experts_per_lane);
  plan = gt::plan_fast_path(32, 160, 8, 3, 6);  // deepseek-v2: groups of 20 straddle lanes of 8
  CHECK(plan.experts_per_lane == 8 && !plan.group_scores_in_registers && plan.lanes_per_group == 4,
        "deepseek-v2 / 32: %d %d %d", plan.experts_per_lane, plan.lanes_per_group,
        int(plan.group_scores_in_registers));
  CHECK(gt::plan_fast_path(32, 513, 1, 1, 8).experts_per_lane == 0, "E = 513 is not fast");
  CHECK(gt::plan_fast_path(32, 256, 8, 4, 33).experts_per_lane == 0, "topk 33 is not fast");
  CHECK(gt::plan_fast_path(32, 512, 64, 4, 8).experts_per_lane == 0, "64 groups are not fast");
  CHECK(gt::plan_fast_path(48, 256, 8, 4, 8).experts_per_lane == 0, "warp of 48");

  // Every valid topology: the plan's invariants, which the warp kernel's indexing relies on.
  for (int warp_size : {32, 64}) {
    for (int64_t num_experts = 1; num_experts <= 600; ++num_experts) {
      for (int64_t num_groups = 1; num_groups <= std::min<int64_t>(num_experts, 40); ++num_groups) {
        if (num_experts % num_groups != 0) continue;
        const int64_t group_size = num_experts / num_groups;
        for (int64_t topk_group : {int64_t(1), (num_groups + 1) / 2, num_groups}) {
          for (int64_t topk : {int64_t(1), int64_t(8), int64_t(32), int64_t(33)}) {
            if (topk > topk_group * group_size) continue;
            const gt::FastPathPlan pl =
                gt::plan_fast_path(warp_size, num_experts, num_groups, topk_group, topk);
            const bool fast = num_experts <= 512 && topk <= 32 && num_groups <= 32;
            CHECK((pl.experts_per_lane != 0) == fast, "eligibility of %lld/%lld/%lld/%lld",
                  (long long)num_experts, (long long)num_groups, (long long)topk_group,
                  (long long)topk);
            if (!fast) continue;
            const int v = pl.experts_per_lane;
            CHECK(v % 4 == 0 && v >= 4 && v <= 16 && gt::fast_instance_exists(warp_size, v) &&
                      int64_t(warp_size) * v >= num_experts,
                  "experts_per_lane %d for %lld experts on %d lanes", v, (long long)num_experts,
                  warp_size);
            if (topk_group == num_groups) continue;
            const int64_t lpg = pl.lanes_per_group;
            CHECK(gt::is_pow2(lpg) && lpg * num_groups <= warp_size,
                  "lanes_per_group %lld for %lld groups", (long long)lpg, (long long)num_groups);
            if (pl.group_scores_in_registers) {
              CHECK(group_size % v == 0 && group_size / v == lpg,
                    "registers: group of %lld, %d per lane, %lld lanes", (long long)group_size,
                    v, (long long)lpg);
            } else {
              CHECK(lpg == gt::pow2_floor(warp_size / num_groups), "shared: lanes_per_group");
            }
          }
        }
      }
    }
  }
}

void test_general_layout() {
  for (int warps : {4, 8}) {
    for (int64_t num_experts : {int64_t(1), int64_t(7), int64_t(1000), int64_t(1024),
                                gt::kMaxExperts}) {
      for (int64_t num_groups : {int64_t(1), int64_t(2), int64_t(8), num_experts}) {
        if (num_experts % num_groups != 0) continue;
        const gt::GeneralSmemLayout l = gt::general_smem_layout(num_experts, num_groups, warps);
        CHECK(l.group_offset >= num_experts && l.slots_offset >= l.group_offset + num_groups &&
                  l.slots_offset % 2 == 0 && l.reduce_offset >= l.slots_offset + 4 * warps &&
                  l.total_words >= l.reduce_offset + 3 * warps,
              "layout of %lld experts, %lld groups", (long long)num_experts,
              (long long)num_groups);
        // Within the default 48 KiB of shared memory, so no opt-in is needed.
        CHECK(l.total_words * 4 <= 48 * 1024, "layout of %lld experts takes %lld bytes",
              (long long)num_experts, (long long)(l.total_words * 4));
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
  test_plan();
  test_general_layout();
  return moeext_test::finish("grouped_topk_logic");
}
