// moeext_bench: the kernels alone, through the launcher API of csrc/include/moeext/ (no
// torch, no Python). Prints one row per case:
//   op, backend, shape, samples, median_us, noise_%, bytes, GB/s, %peak
// where bytes is an explicit model of the bytes each call must read and write, and peak is a
// streaming copy measured by this binary in the same run (a case whose bytes stay in the cache
// between calls, such as a small zero_tail tail, can pass 100%).
// Before a case is timed, one call's outputs are checked against values this file computes on
// its own (routing and GEMM in double, the shuffles and the zeroing from SPEC.md's formulas);
// a case that fails is reported on stderr and not timed, and the binary exits 1.
//
//   moeext_bench [--quick] [--csv] [--filter REGEX] [--isa portable|avx2|avx512|avx512bf16]
//                [--threads N]
#include <omp.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "moeext/common.h"
#include "moeext/grouped_topk.h"
#include "moeext/mxfp4_shuffle.h"
#include "moeext/router_gemm.h"
#include "moeext/zero_tail.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  bool quick = false;
  bool csv = false;
  std::regex filter{".*"};

  // Whether the case "op shape" runs. Cases are built only when selected: generating every
  // case's inputs took 25-30 of the 41 s a run of one filtered case took.
  bool selects(const std::string& op, const std::string& shape) const {
    return std::regex_search(op + " " + shape, filter);
  }
};

struct Case {
  std::string op;
  std::string shape;
  double bytes;                    // modelled bytes read + written by one call
  int rotations;                   // distinct input sets the calls cycle through
  std::function<void(int)> call;   // runs one call on input set i
  std::function<std::string()> check;  // one call, then "" if its outputs are right, or why not
};

struct Result {
  int samples;
  double median_us;
  double noise_pct;
};

// Last-level cache from sysfs (the highest index present), 32 MiB if unknown.
double last_level_cache_bytes() {
  double best = 0;
  for (int index = 0; index < 8; ++index) {
    std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/size");
    std::string text;
    if (!(f >> text)) continue;
    double value = std::atof(text.c_str());
    if (text.back() == 'K') value *= 1024;
    if (text.back() == 'M') value *= 1024 * 1024;
    best = std::max(best, value);
  }
  return best > 0 ? best : 32.0 * 1024 * 1024;
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown CPU";
}

// Enough input sets that cycling through them touches more than twice the LLC, so large
// cases measure memory, not a warm cache (capped: tiny cases would need thousands).
int rotations_for(double input_bytes) {
  const double need = 2.5 * last_level_cache_bytes() / std::max(1.0, input_bytes);
  return std::clamp(int(need) + 1, 1, 64);
}

// Warm-up, then samples of batched calls (each sample >= ~200 us so the clock's resolution
// is irrelevant); median and noise = (p90 - p10) / median.
Result measure(const Case& c, const Options& opt) {
  int next = 0;
  auto run = [&](int n) {
    for (int i = 0; i < n; ++i) {
      c.call(next);
      next = (next + 1) % c.rotations;
    }
  };
  const auto warm_end = Clock::now() + std::chrono::milliseconds(opt.quick ? 20 : 100);
  int calls = 0;
  while (Clock::now() < warm_end || calls < 3) {
    run(1);
    ++calls;
  }
  const auto t0 = Clock::now();
  run(3);
  const double per_call = std::chrono::duration<double>(Clock::now() - t0).count() / 3;
  const int batch = std::max(1, int(200e-6 / std::max(per_call, 1e-9)));
  const int samples = opt.quick ? 5 : std::clamp(int(1.0 / (per_call * batch)), 11, 51);
  std::vector<double> us;
  for (int s = 0; s < samples; ++s) {
    const auto start = Clock::now();
    run(batch);
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count() / batch);
  }
  std::sort(us.begin(), us.end());
  const double median = us[us.size() / 2];
  const double p10 = us[us.size() / 10], p90 = us[us.size() * 9 / 10];
  return {samples, median, 100.0 * (p90 - p10) / median};
}

// Streaming copy over 8x the LLC on all threads: the bandwidth every row is compared with.
double measure_peak_gbs(const Options& opt) {
  const size_t bytes = size_t(8 * last_level_cache_bytes());
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  double best = 0;
  for (int rep = 0; rep < (opt.quick ? 3 : 8); ++rep) {
    const auto start = Clock::now();
#pragma omp parallel
    {
      const size_t parts = size_t(omp_get_num_threads());
      const size_t part = bytes / parts, t = size_t(omp_get_thread_num());
      std::memcpy(dst.data() + t * part, src.data() + t * part, part);
    }
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    best = std::max(best, 2.0 * bytes / s / 1e9);
  }
  return best;
}

#if defined(MOEEXT_HAVE_AVX512BF16) && defined(__x86_64__)
// 16 independent vdpbf16ps chains per thread: the multiply-add rate no bf16 GEMM on this CPU
// can beat, for reading router_gemm's compute-bound rows (a row of T x E x H multiply-adds).
__attribute__((target("avx512f,avx512bf16"))) double dot_gmacs_one_thread(long steps) {
  __m512 acc[16];
  for (__m512& a : acc) a = _mm512_setzero_ps();
  __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80);  // 1.0
  const __m512bh y = (__m512bh)_mm512_set1_epi16(0x0001);  // a denormal: the sums stay 0
  const auto start = Clock::now();
  for (long s = 0; s < steps; ++s) {
#pragma GCC unroll 16
    for (__m512& a : acc) a = _mm512_dpbf16_ps(a, x, y);
    asm volatile("" : "+v"(x));
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  for (__m512& a : acc) asm volatile("" : : "v"(a));  // keep the chains live
  return 16.0 * 32.0 * double(steps) / seconds / 1e9;
}
#endif

// The bf16 multiply-add peak of all threads (GMAC/s), or 0 where vdpbf16ps is missing.
double measure_peak_bf16_gmacs(const Options& opt) {
#if defined(MOEEXT_HAVE_AVX512BF16) && defined(__x86_64__)
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512bf16")) return 0;
  const long steps = opt.quick ? 2'000'000 : 20'000'000;
  double total = 0;
#pragma omp parallel reduction(+ : total)
  {
    double best = 0;
    for (int rep = 0; rep < 3; ++rep) best = std::max(best, dot_gmacs_one_thread(steps));
    total += best;
  }
  return total;
#else
  (void)opt;
  return 0;
#endif
}

uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return uint16_t((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

double from_bf16(uint16_t x) {
  const uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

std::string at_row(int64_t row, const std::string& what) {
  return "row " + std::to_string(row) + ": " + what;
}

// Items [0, items) split as the torch bindings split them (csrc/torch/parallel.h, which keeps
// at::parallel_for's split): one contiguous chunk per thread, as many threads as whole grains
// (at most all), and below two threads the calling thread alone, with no parallel region.
// run(begin, end) does one chunk.
template <typename Run>
void split_as_the_binding_does(int64_t items, int64_t grain, Run run) {
  const int64_t threads = std::min<int64_t>(omp_get_max_threads(), (items + grain - 1) / grain);
  if (threads <= 1) {
    run(int64_t(0), items);
    return;
  }
  const int64_t chunk = (items + threads - 1) / threads;
#pragma omp parallel for schedule(static) num_threads(int(threads))
  for (int64_t c = 0; c < threads; ++c) {
    const int64_t begin = std::min(items, c * chunk), end = std::min(items, (c + 1) * chunk);
    if (begin < end) run(begin, end);
  }
}

struct Preset {
  const char* name;
  int64_t experts, groups, topk_group, topk;
  float scale;
  moeext::ScoringFunc scoring;
  bool renormalize, bias;
};

const Preset kPresets[] = {
    {"deepseek-v3", 256, 8, 4, 8, 2.5f, moeext::ScoringFunc::kSigmoid, true, true},
    {"kimi-k2", 384, 1, 1, 8, 2.827f, moeext::ScoringFunc::kSigmoid, true, true},
    {"glm-4.5", 160, 1, 1, 8, 2.5f, moeext::ScoringFunc::kSigmoid, true, true},
    {"deepseek-v4-flash", 256, 1, 1, 6, 1.5f, moeext::ScoringFunc::kSqrtSoftplus, true, true},
    {"deepseek-v4-pro", 384, 1, 1, 6, 2.5f, moeext::ScoringFunc::kSqrtSoftplus, true, true},
    {"nemotron-style", 512, 1, 1, 22, 1.0f, moeext::ScoringFunc::kSigmoid, true, true},
    {"deepseek-v2", 160, 8, 3, 6, 16.0f, moeext::ScoringFunc::kSoftmax, false, false},
};

// Inputs of one grouped top-k case, kept alive by the closure that uses them.
struct TopkData {
  std::vector<std::vector<uint16_t>> logits;  // bf16, one set per rotation
  std::vector<float> bias;
  std::vector<float> weights;
  std::vector<int32_t> ids;
};

// A preset's routing of `tokens` bf16 rows into outputs `columns` wide; the caller points
// gating_output at its input set.
moeext::BiasedGroupedTopkParams routing_params(const Preset& preset, int64_t tokens,
                                               const float* bias, float* weights,
                                               int32_t* ids, int64_t columns) {
  moeext::BiasedGroupedTopkParams p;
  p.gating_dtype = moeext::DType::kBFloat16;
  p.gating_row_stride = preset.experts;
  p.correction_bias = bias;
  p.topk_weights = weights;
  p.weights_row_stride = columns;
  p.topk_ids = ids;
  p.ids_row_stride = columns;
  p.num_tokens = tokens;
  p.num_experts = preset.experts;
  p.num_expert_group = preset.groups;
  p.topk_group = preset.topk_group;
  p.topk = preset.topk;
  p.renormalize = preset.renormalize;
  p.routed_scaling_factor = preset.scale;
  p.scoring_func = preset.scoring;
  return p;
}

// The routed rows of input set 0 against scores computed here in double. The kernel's exp is
// within an ulp of the rounded one, so its fp32 scores may differ from these by a few ulps:
// experts, or groups, closer than kRoutingTolerance may rank either way.
constexpr double kRoutingTolerance = 1e-5;

std::string check_routed_rows(const Preset& preset, const TopkData& data, int64_t tokens) {
  const int64_t experts = preset.experts, k = preset.topk, groups = preset.groups;
  const int64_t group_size = experts / groups;
  std::vector<double> s(static_cast<size_t>(experts)), b(s.size());
  std::vector<double> group_score(static_cast<size_t>(groups));
  std::vector<char> chosen(s.size());
  for (int64_t t = 0; t < tokens; ++t) {
    const uint16_t* logits = data.logits[0].data() + t * experts;
    double max_logit = -INFINITY, sum = 0;
    for (int64_t e = 0; e < experts; ++e) max_logit = std::max(max_logit, from_bf16(logits[e]));
    for (int64_t e = 0; e < experts; ++e) {
      const double x = from_bf16(logits[e]);
      switch (preset.scoring) {
        case moeext::ScoringFunc::kSigmoid:
          s[e] = 1 / (1 + std::exp(-x));
          break;
        case moeext::ScoringFunc::kSqrtSoftplus:
          s[e] = std::sqrt(x > 20 ? x : std::log1p(std::exp(x)));
          break;
        case moeext::ScoringFunc::kSoftmax:
          s[e] = std::exp(x - max_logit);
          sum += s[e];
          break;
      }
    }
    for (int64_t e = 0; e < experts; ++e) {
      if (preset.scoring == moeext::ScoringFunc::kSoftmax) s[e] /= sum;
      b[e] = s[e] + (preset.bias ? double(data.bias[e]) : 0.0);
    }
    for (int64_t g = 0; g < groups; ++g) {
      double first = -INFINITY, second = -INFINITY;
      for (int64_t e = g * group_size; e < (g + 1) * group_size; ++e) {
        second = std::max(second, std::min(first, b[e]));
        first = std::max(first, b[e]);
      }
      group_score[g] = preset.bias && group_size > 1 ? first + second : first;
    }
    // Dropped: topk_group groups score clearly above it. Kept: fewer than topk_group come near.
    auto groups_above = [&](int64_t g, double margin) {
      int64_t n = 0;
      for (int64_t h = 0; h < groups; ++h) n += h != g && group_score[h] > group_score[g] + margin;
      return n;
    };
    auto dropped = [&](int64_t g) {
      return groups_above(g, kRoutingTolerance) >= preset.topk_group;
    };
    auto kept = [&](int64_t g) {
      return groups_above(g, -kRoutingTolerance) < preset.topk_group;
    };

    const float* weights = data.weights.data() + t * k;
    const int32_t* ids = data.ids.data() + t * k;
    std::fill(chosen.begin(), chosen.end(), 0);
    double weight_sum = 0;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t id = ids[j];
      const std::string name = "id " + std::to_string(id);
      if (id < 0 || id >= experts) return at_row(t, name + " out of range");
      if (chosen[id]) return at_row(t, name + " chosen twice");
      chosen[id] = 1;
      if (dropped(id / group_size)) return at_row(t, name + " in a dropped group");
      if (j > 0 && b[id] > b[ids[j - 1]] + kRoutingTolerance) {
        return at_row(t, name + " ranked below a smaller score");
      }
      weight_sum += s[id];
    }
    const double last = b[ids[k - 1]];
    for (int64_t e = 0; e < experts; ++e) {
      if (!chosen[e] && kept(e / group_size) && b[e] > last + kRoutingTolerance) {
        return at_row(t, "expert " + std::to_string(e) + " left out above the last chosen");
      }
    }
    for (int64_t j = 0; j < k; ++j) {
      const double norm = preset.renormalize ? weight_sum + 1e-20 : 1.0;
      const double want = s[ids[j]] / norm * preset.scale;
      if (std::abs(weights[j] - want) > 1e-5 * std::max(1.0, std::abs(want))) {
        return at_row(t, "weight " + std::to_string(weights[j]) + ", expected " +
                             std::to_string(want));
      }
    }
  }
  return "";
}

void add_grouped_topk(std::vector<Case>& cases, const Options& opt) {
  const std::vector<int64_t> tokens = opt.quick ? std::vector<int64_t>{1, 64}
                                                : std::vector<int64_t>{1, 16, 64, 256, 1024,
                                                                       4096, 16384};
  for (const Preset& preset : kPresets) {
    for (int64_t t : tokens) {
      const std::string shape = std::string(preset.name) + " T=" + std::to_string(t);
      if (!opt.selects("grouped_topk", shape)) continue;
      auto data = std::make_shared<TopkData>();
      const double in_bytes = double(t) * preset.experts * 2;
      const int rot = rotations_for(in_bytes);
      std::mt19937 gen(uint32_t(t * 7 + preset.experts));
      std::normal_distribution<float> normal;
      data->logits.resize(rot);
      for (auto& set : data->logits) {
        set.resize(size_t(t * preset.experts));
        for (auto& v : set) v = to_bf16(normal(gen));
      }
      data->bias.resize(size_t(preset.experts));
      for (auto& v : data->bias) v = 2.0f + 0.05f * normal(gen);
      data->weights.resize(size_t(t * preset.topk));
      data->ids.resize(size_t(t * preset.topk));

      moeext::BiasedGroupedTopkParams p =
          routing_params(preset, t, preset.bias ? data->bias.data() : nullptr,
                         data->weights.data(), data->ids.data(), preset.topk);
      const int64_t grain = moeext::biased_grouped_topk_cpu_grain(preset.experts);
      const double bytes = in_bytes + (preset.bias ? preset.experts * 4.0 : 0.0) +
                           double(t) * preset.topk * 8;
      auto call = [data, p, grain](int i) mutable {
        p.gating_output = data->logits[size_t(i)].data();
        split_as_the_binding_does(p.num_tokens, grain, [&](int64_t begin, int64_t end) {
          moeext::biased_grouped_topk_cpu(p, begin, end);
        });
      };
      auto check = [call, data, preset, t]() mutable {
        call(0);
        return check_routed_rows(preset, *data, t);
      };
      cases.push_back({"grouped_topk", shape, bytes, rot, call, check});
    }
  }
}

// The routing options of docs/SPEC.md section 6 on two presets: a case per option, one with
// all of them, and the plain call of the same inputs in the same run. Checked against the
// plain call's result with the options applied here.
struct OptionsData {
  TopkData topk;
  std::vector<float> plain_weights;
  std::vector<int32_t> plain_ids;
  std::vector<int32_t> expert_map;
  std::vector<int64_t> counts;
  std::vector<int16_t> routed;
  int64_t valid = 0;
};

constexpr int64_t kSharedExperts = 1;

std::string check_options(const moeext::BiasedGroupedTopkParams& p, const OptionsData& d) {
  const moeext::RoutingOptions& o = p.options;
  const int64_t columns = p.topk + o.num_shared_experts;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    for (int64_t j = 0; j < columns; ++j) {
      const bool shared = j >= p.topk;
      const int64_t logical = shared ? p.num_experts + (j - p.topk) : d.plain_ids[t * p.topk + j];
      const float weight = shared ? o.shared_expert_weight : d.plain_weights[t * p.topk + j];
      const int32_t id = o.expert_map != nullptr ? o.expert_map[logical] : int32_t(logical);
      if (p.topk_ids[t * p.ids_row_stride + j] != id) return at_row(t, "id differs");
      if (p.topk_weights[t * p.weights_row_stride + j] != weight) return at_row(t, "weight differs");
      if (o.routed_experts != nullptr && !shared && t < d.valid &&
          static_cast<const int16_t*>(o.routed_experts)[t * o.routed_row_stride + j] != logical) {
        return at_row(t, "record differs");
      }
    }
  }
  if (o.expert_counts != nullptr) {
    std::vector<int64_t> want(size_t(p.num_experts), 0);
    for (int64_t i = 0; i < d.valid * p.topk; ++i) ++want[size_t(d.plain_ids[size_t(i)])];
    if (want != d.counts) return "expert counts differ";
  }
  return "";
}

void add_routing_options(std::vector<Case>& cases, const Options& opt) {
  const std::vector<int64_t> tokens =
      opt.quick ? std::vector<int64_t>{1, 64} : std::vector<int64_t>{1, 16, 4096};
  const char* variants[] = {"plain", "shared", "map", "counts", "record", "all"};
  for (const Preset& preset : kPresets) {
    if (std::string(preset.name) != "deepseek-v3" && std::string(preset.name) != "kimi-k2") continue;
    for (int64_t t : tokens) {
      for (const char* variant : variants) {
        const std::string v = variant;
        const std::string shape = std::string(preset.name) + " T=" + std::to_string(t) + " " + v;
        if (!opt.selects("routing_options", shape)) continue;
        auto data = std::make_shared<OptionsData>();
        std::mt19937 gen(uint32_t(t * 7 + preset.experts));
        std::normal_distribution<float> normal;
        data->topk.logits.resize(1);
        data->topk.logits[0].resize(size_t(t * preset.experts));
        for (auto& x : data->topk.logits[0]) x = to_bf16(normal(gen));
        data->topk.bias.resize(size_t(preset.experts));
        for (auto& x : data->topk.bias) x = 2.0f + 0.05f * normal(gen);
        const int64_t shared = v == "shared" || v == "all" ? kSharedExperts : 0;
        const int64_t columns = preset.topk + shared;
        data->topk.weights.resize(size_t(t * columns));
        data->topk.ids.resize(size_t(t * columns));
        data->expert_map.resize(size_t(preset.experts + shared));
        for (size_t e = 0; e < data->expert_map.size(); ++e) {
          data->expert_map[e] = e % 4 == 1 ? int32_t(e / 4) : -1;  // rank 1 of 4, round robin
        }
        data->counts.assign(size_t(preset.experts), 0);
        data->routed.assign(size_t(t * preset.topk), 0);
        data->valid = v == "all" ? t - t / 4 : t;

        moeext::BiasedGroupedTopkParams p =
            routing_params(preset, t, data->topk.bias.data(), data->topk.weights.data(),
                           data->topk.ids.data(), columns);
        p.gating_output = data->topk.logits[0].data();
        const int64_t grain = moeext::biased_grouped_topk_cpu_grain(preset.experts);
        // The plain result, for the check.
        {
          moeext::BiasedGroupedTopkParams plain = p;
          data->plain_weights.resize(size_t(t * preset.topk));
          data->plain_ids.resize(size_t(t * preset.topk));
          plain.topk_weights = data->plain_weights.data();
          plain.topk_ids = data->plain_ids.data();
          plain.weights_row_stride = plain.ids_row_stride = preset.topk;
          moeext::biased_grouped_topk_cpu(plain, 0, t);
        }
        moeext::RoutingOptions& o = p.options;
        o.num_shared_experts = shared;
        if (v == "map" || v == "all") o.expert_map = data->expert_map.data();
        if (v == "counts" || v == "all") {
          o.expert_counts = data->counts.data();
          o.counts_dtype = moeext::IntType::kInt64;
        }
        if (v == "record" || v == "all") {
          o.routed_experts = data->routed.data();
          o.routed_dtype = moeext::IntType::kInt16;
          o.routed_row_stride = preset.topk;
        }
        if (v == "all") {
          o.num_valid_tokens = &data->valid;
          o.valid_dtype = moeext::IntType::kInt64;
        }
        auto call = [p, grain](int) {
          split_as_the_binding_does(p.num_tokens, grain, [&](int64_t begin, int64_t end) {
            moeext::biased_grouped_topk_cpu(p, begin, end);
          });
        };
        auto check = [call, data, p]() mutable {
          std::fill(data->counts.begin(), data->counts.end(), 0);
          call(0);
          return check_options(p, *data);
        };
        const double bytes = double(t) * preset.experts * 2 + preset.experts * 4.0 +
                             double(t) * columns * 8;
        cases.push_back({"routing_options", shape, bytes, 1, call, check});
      }
    }
  }
}

struct GemmData {
  std::vector<std::vector<uint16_t>> weights;  // bf16 [E, H], one set per rotation
  std::vector<uint16_t> first_weight;          // set 0 in the [E, H] layout, for the check
  std::vector<uint16_t> hidden;                // bf16 [T, H]
  std::vector<float> logits;
};

// Rows 0, T / 2 and T - 1 of the logits from weight set 0 against products in double, within
// the test suite's bound for an fp32 sum of H terms: 4 sqrt(H) 2^-24 sum |x_h w_h|.
std::string check_logits(const GemmData& data, int64_t tokens, int64_t experts, int64_t hidden) {
  for (const int64_t t : {int64_t(0), tokens / 2, tokens - 1}) {
    const uint16_t* x = data.hidden.data() + t * hidden;
    for (int64_t e = 0; e < experts; ++e) {
      const uint16_t* w = data.first_weight.data() + e * hidden;
      double exact = 0, magnitude = 0;
      for (int64_t h = 0; h < hidden; ++h) {
        const double term = from_bf16(x[h]) * from_bf16(w[h]);
        exact += term;
        magnitude += std::abs(term);
      }
      const double got = data.logits[size_t(t * experts + e)];
      if (std::abs(got - exact) > 4 * std::sqrt(double(hidden)) * 0x1p-24 * magnitude) {
        return at_row(t, "logit " + std::to_string(e) + " is " + std::to_string(got) +
                             ", expected " + std::to_string(exact));
      }
    }
  }
  return "";
}

// The prepacked layout of moeext.prepack_router_weight (see RouterGemmParams): experts in
// tiles of kRouterPackTile, each tile [H / 2][width][2] (H even here).
std::vector<uint16_t> prepack(const std::vector<uint16_t>& w, int64_t experts, int64_t hidden) {
  std::vector<uint16_t> packed(w.size());
  const int64_t pairs = hidden / 2;
  for (int64_t first = 0; first < experts; first += moeext::kRouterPackTile) {
    const int64_t width = std::min(moeext::kRouterPackTile, experts - first);
    uint16_t* tile = packed.data() + first * hidden;
    for (int64_t k = 0; k < pairs; ++k) {
      for (int64_t e = 0; e < width; ++e) {
        tile[(k * width + e) * 2] = w[size_t((first + e) * hidden + 2 * k)];
        tile[(k * width + e) * 2 + 1] = w[size_t((first + e) * hidden + 2 * k + 1)];
      }
    }
  }
  return packed;
}

void add_router_gemm(std::vector<Case>& cases, const Options& opt) {
  const int64_t hidden = 7168;
  const std::vector<int64_t> tokens =
      opt.quick ? std::vector<int64_t>{1, 16} : std::vector<int64_t>{1, 4, 16, 64, 256};
  for (const bool prepacked : {false, true}) {
    for (int64_t experts : {int64_t(256), int64_t(384)}) {
      for (int64_t t : tokens) {
        const std::string op = prepacked ? "router_gemm prepacked" : "router_gemm";
        const std::string shape =
            "E=" + std::to_string(experts) + " H=7168 T=" + std::to_string(t);
        if (!opt.selects(op, shape)) continue;
        auto data = std::make_shared<GemmData>();
        const double weight_bytes = double(experts * hidden * 2);
        // The weight is what streams from memory; rotate it so T = 1 reads DRAM, not the LLC.
        const int rot = rotations_for(weight_bytes);
        std::mt19937 gen(uint32_t(experts + t));
        std::normal_distribution<float> normal;
        data->weights.resize(size_t(rot));
        for (auto& w : data->weights) {
          w.resize(size_t(experts * hidden));
          for (auto& v : w) v = to_bf16(0.02f * normal(gen));
          if (data->first_weight.empty()) data->first_weight = w;
          if (prepacked) w = prepack(w, experts, hidden);
        }
        data->hidden.resize(size_t(t * hidden));
        for (auto& v : data->hidden) v = to_bf16(normal(gen));
        data->logits.resize(size_t(t * experts));
        moeext::RouterGemmParams p;
        p.hidden_states = data->hidden.data();
        p.hidden_row_stride = hidden;
        p.weight_row_stride = prepacked ? 0 : hidden;
        p.weight_prepacked = prepacked;
        p.logits = data->logits.data();
        p.logits_row_stride = experts;
        p.num_tokens = t;
        p.hidden_size = hidden;
        p.num_experts = experts;
        const double bytes = weight_bytes + double(t * hidden * 2) + double(t * experts * 4);
        auto call = [data, p](int i) mutable {
          p.weight = data->weights[size_t(i)].data();
          // The binding splits whole blocks of experts.
          const int64_t block = moeext::router_gemm_expert_block(p);
          const int64_t blocks = (p.num_experts + block - 1) / block;
          split_as_the_binding_does(blocks, moeext::router_gemm_cpu_grain(p, block),
                                    [&](int64_t begin, int64_t end) {
                                      moeext::router_gemm_cpu(p, begin * block,
                                                              std::min(end * block, p.num_experts));
                                    });
        };
        auto check = [call, data, t, experts]() mutable {
          call(0);
          return check_logits(*data, t, experts, hidden);
        };
        cases.push_back({op, shape, bytes, rot, call, check});
      }
    }
  }
}

// Bytes that tell every position apart within a few KiB, so that a chunk or a row put in the
// wrong place shows (the copies take the same time on any bytes).
void fill_pattern(std::vector<uint8_t>& bytes) {
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = uint8_t(i * 37 + (i >> 8) * 11 + (i >> 16));
}

// SPEC.md section 3: each 16-row band of an expert, its K cut into 16-byte chunks, emitted
// chunk column by chunk column as 16 x 16-byte tiles. With gate_up the rows are first
// interleaved in 16-row blocks, gate (first half) and up (second half) in turn.
std::string check_shuffled_weight(const moeext::ShuffleWeightParams& p) {
  const auto* in = static_cast<const uint8_t*>(p.logical);
  const auto* out = static_cast<const uint8_t*>(p.shuffled);
  const int64_t chunks = p.row_bytes / 16;
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t n = 0; n < p.rows; ++n) {
      const int64_t source = p.gate_up ? (n / 16) % 2 * (p.rows / 2) + n / 32 * 16 + n % 16 : n;
      const uint8_t* row = in + b * p.logical_batch_stride + source * p.logical_row_stride;
      for (int64_t kc = 0; kc < chunks; ++kc) {
        const int64_t at = b * p.rows * p.row_bytes + ((n / 16 * chunks + kc) * 16 + n % 16) * 16;
        if (std::memcmp(out + at, row + kc * 16, 16) != 0) {
          return "expert " + std::to_string(b) + ", row " + std::to_string(n) + ", chunk " +
                 std::to_string(kc) + " is not where SPEC.md puts it";
        }
      }
    }
  }
  return "";
}

// SPEC.md section 3: padded[a*32 + h*16 + c4][d*8 + e*4 + f], 0x7F in the padding, goes to
// out[a*32*sn + d*256 + f*64 + c4*4 + e*2 + h] (sn the padded column count).
std::string check_shuffled_scales(const moeext::E8m0ShuffleParams& p) {
  for (int64_t r = 0; r < p.padded_m; ++r) {
    for (int64_t c = 0; c < p.padded_n; ++c) {
      const uint8_t want = r < p.m && c < p.n ? p.scale[r * p.row_stride + c * p.col_stride] : 0x7f;
      const int64_t at = r / 32 * 32 * p.padded_n + c / 8 * 256 + c % 4 * 64 + r % 16 * 4 +
                         (c / 4) % 2 * 2 + (r / 16) % 2;
      if (p.shuffled[at] != want) {
        return "scale [" + std::to_string(r) + ", " + std::to_string(c) +
               "] is not where SPEC.md puts it";
      }
    }
  }
  return "";
}

void add_shuffles(std::vector<Case>& cases, const Options& opt) {
  // A DeepSeek-V3-sized w13 slice: experts x [4096, 3584] packed fp4 bytes (K = 7168).
  const int64_t experts = opt.quick ? 2 : 8, rows = 4096, row_bytes = 3584;
  const size_t weight_bytes = size_t(experts * rows * row_bytes);
  std::shared_ptr<std::vector<uint8_t>> src, dst;  // shared by both cases, made for the first
  for (bool gate_up : {false, true}) {
    const std::string shape =
        std::to_string(experts) + "x[4096,3584]B" + (gate_up ? " gate_up" : "");
    if (!opt.selects("shuffle_weight", shape)) continue;
    if (!src) {
      src = std::make_shared<std::vector<uint8_t>>(weight_bytes);
      fill_pattern(*src);
      dst = std::make_shared<std::vector<uint8_t>>(weight_bytes, 0);
    }
    moeext::ShuffleWeightParams p;
    p.logical = src->data();
    p.logical_row_stride = row_bytes;
    p.logical_batch_stride = rows * row_bytes;
    p.shuffled = dst->data();
    p.batch = experts;
    p.rows = rows;
    p.row_bytes = row_bytes;
    p.gate_up = gate_up;
    const int64_t bands = experts * rows / 16;
    auto call = [src, dst, p, bands](int) {
#pragma omp parallel for schedule(static)
      for (int64_t b = 0; b < bands; ++b) moeext::shuffle_weight_cpu(p, b, b + 1);
    };
    // The output cleared first: the two cases share it, and their first bands agree.
    auto check = [call, dst, p]() {
      std::fill(dst->begin(), dst->end(), 0);
      call(0);
      return check_shuffled_weight(p);
    };
    cases.push_back({"shuffle_weight", shape, 2.0 * double(weight_bytes), 1, call, check});
  }
  const int64_t m = experts * rows, n = 224;  // one E8M0 scale per 32 fp4 values
  const std::string shape = "[" + std::to_string(m) + ",224]";
  if (!opt.selects("e8m0_shuffle", shape)) return;
  const int64_t padded_m = (m + 255) / 256 * 256, padded_n = (n + 7) / 8 * 8;
  auto scales = std::make_shared<std::vector<uint8_t>>(size_t(m * n));
  fill_pattern(*scales);
  auto shuffled = std::make_shared<std::vector<uint8_t>>(size_t(padded_m * padded_n), 0);
  moeext::E8m0ShuffleParams sp;
  sp.scale = scales->data();
  sp.row_stride = n;
  sp.m = m;
  sp.n = n;
  sp.padded_m = padded_m;
  sp.padded_n = padded_n;
  sp.shuffled = shuffled->data();
  auto call = [scales, shuffled, sp](int) {
    const int64_t blocks = sp.padded_m / 32;
#pragma omp parallel for schedule(static)
    for (int64_t a = 0; a < blocks; ++a) moeext::e8m0_shuffle_cpu(sp, a, a + 1);
  };
  auto check = [call, sp]() {
    call(0);
    return check_shuffled_scales(sp);
  };
  cases.push_back({"e8m0_shuffle", shape, double(m * n + padded_m * padded_n), 1, call, check});
}

void add_zero_tail(std::vector<Case>& cases, const Options& opt) {
  const int64_t rows = (opt.quick ? 4 : 64) * (int64_t(1) << 20) / 4;  // int32 elements
  std::shared_ptr<std::vector<int32_t>> buf;  // shared by the cases, made for the first
  for (double tail : {0.0, 0.01, 0.10, 1.0}) {
    char shape[64];
    std::snprintf(shape, sizeof(shape), "%lldMiB int32 tail=%g%%", (long long)(rows * 4 >> 20),
                  tail * 100);
    if (!opt.selects("zero_tail", shape)) continue;
    if (!buf) buf = std::make_shared<std::vector<int32_t>>(size_t(rows), 0);
    moeext::ZeroRowsParams p;
    p.data = buf->data();
    p.row_stride = 4;
    p.row_bytes = 4;
    p.row_begin = rows - int64_t(double(rows) * tail);
    p.row_end = rows;
    const int64_t chunk = int64_t(1) << 18;  // 1 MiB of int32 per task, as in the binding
    auto call = [buf, p, chunk](int) {
      const int64_t chunks = (p.row_end - p.row_begin + chunk - 1) / chunk;
      if (chunks <= 1) {
        moeext::zero_rows_cpu(p, p.row_begin, p.row_end);
        return;
      }
#pragma omp parallel for schedule(static)
      for (int64_t c = 0; c < chunks; ++c) {
        moeext::zero_rows_cpu(p, p.row_begin + c * chunk,
                              std::min(p.row_end, p.row_begin + (c + 1) * chunk));
      }
    };
    // Every row set first, so that both a row left alone and a row not zeroed show.
    auto check = [call, buf, p]() {
      std::fill(buf->begin(), buf->end(), 0x5a5a5a5a);
      call(0);
      for (int64_t r = 0; r < int64_t(buf->size()); ++r) {
        const bool tail = r >= p.row_begin && r < p.row_end;
        if ((*buf)[size_t(r)] != (tail ? 0 : 0x5a5a5a5a)) {
          return at_row(r, tail ? "not zeroed" : "zeroed outside the tail");
        }
      }
      return std::string();
    };
    cases.push_back({"zero_tail", shape, 4.0 * double(p.row_end - p.row_begin), 1, call, check});
  }
}

int usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--quick] [--csv] [--filter REGEX] "
               "[--isa portable|avx2|avx512|avx512bf16|auto] [--threads N]\n",
               argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      opt.quick = true;
    } else if (arg == "--csv") {
      opt.csv = true;
    } else if (arg == "--filter" && i + 1 < argc) {
      opt.filter = std::regex(argv[++i]);
    } else if (arg == "--isa" && i + 1 < argc) {
      const std::string isa = argv[++i];
      const auto want = isa == "portable" || isa == "scalar" ? moeext::CpuIsa::kPortable
                        : isa == "avx2"       ? moeext::CpuIsa::kAvx2
                        : isa == "avx512"     ? moeext::CpuIsa::kAvx512
                        : isa == "avx512bf16" ? moeext::CpuIsa::kAvx512Bf16
                        : isa == "auto"       ? moeext::CpuIsa::kAuto
                                              : std::optional<moeext::CpuIsa>();
      if (!want) {
        std::fprintf(stderr, "--isa %s: not a path (portable, avx2, avx512, avx512bf16, auto)\n",
                     isa.c_str());
        return 2;
      }
      if (!moeext::set_cpu_isa(*want)) {
        std::fprintf(stderr, "--isa %s: not available on this CPU or build\n", isa.c_str());
        return 2;
      }
    } else if (arg == "--threads" && i + 1 < argc) {
      const char* text = argv[++i];
      char* end = nullptr;
      const long threads = std::strtol(text, &end, 10);
      if (end == text || *end != '\0' || threads < 1 || threads > 4096) {
        std::fprintf(stderr, "--threads %s: not a thread count (1 or more)\n", text);
        return 2;
      }
      omp_set_num_threads(int(threads));
    } else {
      return usage(argv[0]);
    }
  }

  std::vector<Case> all;
  add_grouped_topk(all, opt);
  add_routing_options(all, opt);
  add_router_gemm(all, opt);
  add_shuffles(all, opt);
  add_zero_tail(all, opt);
  if (all.empty()) {
    std::fprintf(stderr, "--filter matches no case\n");
    return 2;
  }

  const double peak = measure_peak_gbs(opt);
  const double dot_peak = measure_peak_bf16_gmacs(opt);
  const char* sep = opt.csv ? "," : " ";
  std::printf("# moeext_bench | %s | CPU path %s | %d threads | LLC %.0f MiB | peak %.1f GB/s "
              "(streaming copy, read + write) | bf16 dot peak %.0f GMAC/s (vdpbf16ps on all "
              "threads)\n",
              cpu_model().c_str(), moeext::cpu_isa_name(moeext::cpu_isa_active()),
              omp_get_max_threads(), last_level_cache_bytes() / (1 << 20), peak, dot_peak);
  if (opt.csv) {
    std::printf("op,backend,shape,samples,median_us,noise_pct,bytes,GB_s,pct_peak\n");
  } else {
    std::printf("%-15s %-7s %-32s %7s %12s %7s %12s %8s %6s\n", "op", "backend", "shape",
                "samples", "median_us", "noise_%", "bytes", "GB/s", "%peak");
  }
  bool all_right = true;
  for (const Case& c : all) {
    const std::string wrong = c.check();
    if (!wrong.empty()) {
      std::fprintf(stderr, "moeext_bench: %s %s: wrong output (%s); not timed\n", c.op.c_str(),
                   c.shape.c_str(), wrong.c_str());
      all_right = false;
      continue;
    }
    const Result r = measure(c, opt);
    const double gbs = c.bytes / (r.median_us * 1e-6) / 1e9;
    if (opt.csv) {
      std::printf("%s%scpu%s\"%s\"%s%d%s%.3f%s%.1f%s%.0f%s%.2f%s%.1f\n", c.op.c_str(), sep, sep,
                  c.shape.c_str(), sep, r.samples, sep, r.median_us, sep, r.noise_pct, sep,
                  c.bytes, sep, gbs, sep, 100 * gbs / peak);
    } else {
      std::printf("%-15s %-7s %-32s %7d %12.2f %7.1f %12.0f %8.2f %6.1f\n", c.op.c_str(), "cpu",
                  c.shape.c_str(), r.samples, r.median_us, r.noise_pct, c.bytes, gbs,
                  100 * gbs / peak);
    }
    std::fflush(stdout);
  }
  return all_right ? 0 : 1;
}
