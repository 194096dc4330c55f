// Biased grouped top-k routing on the CPU (SPEC.md section 1). Compiled once per ISA; see
// cpu/vec.h. One token (row) at a time, everything in fp32, in four steps:
//   1. scores s and biased scores b of the row, into the workspace (NaN in b becomes -inf);
//   2. a score per expert group (top-2 sum with a bias, max without), W groups at a time;
//   3. the kept groups: the topk_group best group scores;
//   4. the topk best experts among the kept groups: a floor under the topk-th value, the
//      experts at or above it packed into a short candidate list, and the list ranked.
// Ties everywhere go to the lower index. Where candidates are compared by position (ranking),
// they are laid out in index order so position and index agree; where they are compared as
// keys (the insertion fallback), a key packs a value and an index into one integer, so that
// "larger value, then lower index" is a single unsigned compare.
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#include "cpu/grouped_topk_isa.h"
#include "cpu/vec.h"

namespace moeext::cpu::MOEEXT_CPU_ISA {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int W = Vec::kWidth;

// body(e, mask) for the vectors of experts [begin, end): the whole vectors first, with the
// full mask a constant (their loads, selects and stores then take no mask, and the loop
// computes none), then the partial last vector, if any.
template <typename Body>
MOEEXT_ALWAYS_INLINE void for_each_vector(int64_t begin, int64_t end, Body body) {
  int64_t e = begin;
  for (; e + W <= end; e += W) body(e, Vec::tail_mask(W));
  if (e < end) body(e, Vec::tail_mask(end - e));
}

// Value in the high word as an order-preserving unsigned integer (with -0 folded onto +0, so
// they tie as the float compare says), inverted index in the low word.
inline uint64_t make_key(float value, int64_t index) {
  const uint32_t bits = float_to_bits(value + 0.0f);
  const uint32_t ordered = bits ^ ((bits >> 31) ? 0xffffffffu : 0x80000000u);
  return (uint64_t(ordered) << 32) | uint32_t(~uint32_t(index));
}
inline int64_t key_index(uint64_t key) { return int64_t(~uint32_t(key)); }

// keys[0, count) holds the best keys seen so far, descending; capacity is k.
inline void topk_insert(uint64_t* keys, int64_t& count, int64_t k, uint64_t key) {
  int64_t pos;
  if (count == k) {
    if (key <= keys[k - 1]) return;
    pos = k - 1;
  } else {
    pos = count++;
  }
  while (pos > 0 && keys[pos - 1] < key) {
    keys[pos] = keys[pos - 1];
    --pos;
  }
  keys[pos] = key;
}

// sqrt(softplus(x)) = sqrt(max(x, 0) + log1p(exp(-|x|))): the log1p argument stays in
// (0, 1], where it needs no divide (vlog1p_unit). Above x = 20 (torch's threshold for
// returning x) the log1p term is below half an ulp of x, so the sum rounds to x as torch's
// does. In two steps, so that a path may run them as separate passes: exp(-|x|), then the rest.
// Forced inline on the portable path, where GCC called both out of line, a call per vector
// with the live vectors spilled around it (aarch64 and x86-64 alike). The x86 paths inline
// them unasked; forcing it there would only move their register allocation.
#if MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_portable
#define MOEEXT_PORTABLE_INLINE MOEEXT_ALWAYS_INLINE
#else
#define MOEEXT_PORTABLE_INLINE inline
#endif
MOEEXT_PORTABLE_INLINE Vec softplus_exp(Vec x) {
  return vexp(Vec::min(x, Vec::set1(0.0f) - x));  // NaN x: min returns its second operand
}
MOEEXT_PORTABLE_INLINE Vec sqrt_softplus(Vec x, Vec exp_neg_abs) {
  return Vec::sqrt(Vec::max(x, Vec::set1(0.0f)) + vlog1p_unit(exp_neg_abs));
}
#undef MOEEXT_PORTABLE_INLINE

// Forced inline: on the portable layer GCC called the sigmoid out of line from the scoring
// loop, a call per vector with the other live vectors spilled around it; inline, sigmoid rows
// took 0.85-0.93x the time there (x86-64-v3 at 128-bit vectors). AVX2 rows unchanged.
template <ScoringFunc kScore>
MOEEXT_ALWAYS_INLINE Vec score(Vec x) {
  if constexpr (kScore == ScoringFunc::kSigmoid) {
    return Vec::set1(1.0f) / (Vec::set1(1.0f) + vexp_neg(x));
  } else {
    static_assert(kScore == ScoringFunc::kSqrtSoftplus, "softmax is computed row-wide");
    return sqrt_softplus(x, softplus_exp(x));
  }
}

// Lane by lane, the two largest biased scores of the row, kept as it is scored when every
// group is kept (kTrack = 1: the largest only, 2: both), so that step 4a need not read b again.
struct LaneTop2 {
  Vec first = Vec::set1(kNegInf);
  Vec second = Vec::set1(kNegInf);
};

template <int kTrack>
inline void track_lanes(LaneTop2& top, Vec b) {
  if constexpr (kTrack >= 2) top.second = Vec::max(top.second, Vec::min(top.first, b));
  if constexpr (kTrack >= 1) top.first = Vec::max(top.first, b);
}

template <int kTrack, typename BiasT>
inline void store_biased(Vec s, const BiasT* bias, int64_t e, typename Vec::Mask m,
                         float* biased, LaneTop2& top) {
  Vec b = s;
  if constexpr (!std::is_same_v<BiasT, no_bias_t>) {
    b = s + Vec::load(bias + e, m, 0.0f);
  }
  // NaN becomes -inf in one instruction: max returns its second operand when either is NaN.
  b = Vec::max(b, Vec::set1(kNegInf));
  b.store(biased + e, m);
  if constexpr (kTrack > 0) {
    track_lanes<kTrack>(top, Vec::select(m, b, Vec::set1(kNegInf)));
  }
}

// Softmax of a row of kVecs vectors, held in registers from load to store (whole vectors to
// scores, whose rows are padded to them). A row is one chain of dependent steps (maximum,
// exps, sum, scaling) that the next row cannot overlap, so its length is the row's cost: the
// registers save it two store-and-reload passes, and one divide for the row followed by
// products (as torch's softmax computes it) saves it the vector divides, which queue on the
// divider. Together DeepSeek-V2 rows take 0.95x the time; either change alone measured none.
// Returns whether the row is free of NaN (no NaN logit, and a finite maximum: +inf - +inf and
// -inf - -inf are NaN). Vector i of the scores goes to scores + i * vector_stride.
template <int kVecs, typename LogitT>
bool softmax_in_registers(const LogitT* logits, int64_t num_experts, float* scores,
                          int64_t vector_stride) {
  // The last vector's lanes in the row, 1..W of them; a shift, not tail_mask's branches
  // (along which GCC copies the whole function).
  const auto last = typename Vec::Mask((uint32_t(1) << (num_experts - (kVecs - 1) * W)) - 1u);
  Vec x[kVecs];
  for (int i = 0; i < kVecs; ++i) {
    x[i] = Vec::load(logits + i * W, i + 1 < kVecs ? Vec::tail_mask(W) : last, kNegInf);
  }
  Vec row_max = x[0];
  for (int i = 1; i < kVecs; ++i) row_max = Vec::max(row_max, x[i]);
  // The maximum may miss a NaN (max returns its second operand), but the sum cannot: a NaN
  // logit's exp is NaN, and so is that of +inf - +inf or -inf - -inf. A NaN sum makes the
  // whole row NaN, as in the reference.
  const Vec shift = Vec::set1(Vec::reduce_max(row_max));
  Vec sum = Vec::set1(0.0f);
  for (int i = 0; i < kVecs; ++i) {
    x[i] = vexp_nonpositive(x[i] - shift);
    if (i + 1 == kVecs) x[i] = Vec::select(last, x[i], Vec::set1(0.0f));
    sum = sum + x[i];
  }
  const float total = Vec::reduce_add(sum);
  const Vec inverse = Vec::set1(1.0f / total);
  for (int i = 0; i < kVecs; ++i) (x[i] * inverse).store(scores + i * vector_stride);
  return !std::isnan(total);
}

// Rows of up to 16 vectors (256 experts on AVX-512) take softmax_in_registers; the row and
// the exps' temporaries still fit the 32 vector registers. AVX2 has 16: rows of up to 8
// vectors (64 experts).
constexpr int kMaxSoftmaxVecs = W == 16 ? 16 : W == 8 ? 8 : 0;

template <typename LogitT>
using SoftmaxFn = bool (*)(const LogitT*, int64_t, float*, int64_t);

template <typename LogitT, int... I>
constexpr std::array<SoftmaxFn<LogitT>, sizeof...(I)> softmax_table(
    std::integer_sequence<int, I...>) {
  return {&softmax_in_registers<I + 1, LogitT>...};
}

// kSoftmaxRows<LogitT>[n - 1] handles a row of n vectors.
template <typename LogitT>
inline constexpr auto kSoftmaxRows =
    softmax_table<LogitT>(std::make_integer_sequence<int, kMaxSoftmaxVecs>{});

// Step 1 for one row of contiguous logits. Returns the array that holds b for this row:
// biased, or scores itself where b = s (a softmax row without bias or NaN), which saves
// writing a copy.
template <ScoringFunc kScore, int kTrack, typename LogitT, typename BiasT>
const float* score_row(const LogitT* logits, const BiasT* bias, int64_t num_experts,
                       float* scores, float* biased, LaneTop2& top) {
  if constexpr (kScore == ScoringFunc::kSoftmax) {
    if constexpr (kMaxSoftmaxVecs > 0) {
      if (num_experts <= kMaxSoftmaxVecs * W) {
        const bool no_nan =
            kSoftmaxRows<LogitT>[(num_experts + W - 1) / W - 1](logits, num_experts, scores, W);
        if (std::is_same_v<BiasT, no_bias_t> && no_nan) {
          if constexpr (kTrack > 0) {
            for (int64_t e = 0; e < num_experts; e += W) {
              const auto m = Vec::tail_mask(num_experts - e);
              track_lanes<kTrack>(top, Vec::load(scores + e, m, kNegInf));
            }
          }
          return scores;
        }
        for (int64_t e = 0; e < num_experts; e += W) {
          const auto m = Vec::tail_mask(num_experts - e);
          store_biased<kTrack>(Vec::load(scores + e, m, 0.0f), bias, e, m, biased, top);
        }
        return biased;
      }
    }
    // Longer rows: the same steps in three passes over scores.
    // A NaN the maximum misses still makes the sum NaN (see softmax_in_registers).
    Vec row_max = Vec::set1(kNegInf);
    for (int64_t e = 0; e < num_experts; e += W) {
      const auto m = Vec::tail_mask(num_experts - e);
      const Vec x = Vec::load(logits + e, m, kNegInf);
      row_max = Vec::max(row_max, x);
      x.store(scores + e, m);
    }
    const Vec shift = Vec::set1(Vec::reduce_max(row_max));
    Vec sum = Vec::set1(0.0f);
    for (int64_t e = 0; e < num_experts; e += W) {
      const auto m = Vec::tail_mask(num_experts - e);
      const Vec x = Vec::load(scores + e, m, kNegInf);
      const Vec ex = Vec::select(m, vexp_nonpositive(x - shift), Vec::set1(0.0f));
      sum = sum + ex;
      ex.store(scores + e, m);
    }
    const Vec inverse = Vec::set1(1.0f / Vec::reduce_add(sum));
    for (int64_t e = 0; e < num_experts; e += W) {
      const auto m = Vec::tail_mask(num_experts - e);
      const Vec s = Vec::load(scores + e, m, 0.0f) * inverse;
      s.store(scores + e, m);
      store_biased<kTrack>(s, bias, e, m, biased, top);
    }
    return biased;
  } else {
    if constexpr (kScore == ScoringFunc::kSqrtSoftplus) {
      // In two passes, exp first, then log1p and sqrt: one vector's chain through all three
      // is longer than the out-of-order window can overlap, and in passes each chain is
      // short. Measured on Zen 3 (AVX2): 0.79x the scoring time of E = 256 and 384 rows
      // (unrolling 2, 4 or 8 vectors changed nothing; sigmoid gains nothing either). On Zen 5
      // (AVX-512): DeepSeek-V4-flash and -pro rows 0.92-0.93x the time, bit-identical.
      for (int64_t e = 0; e < num_experts; e += W) {
        const Vec x = Vec::load(logits + e, Vec::tail_mask(num_experts - e), 0.0f);
        softplus_exp(x).store(scores + e);  // whole vectors: the rows are padded to 16
      }
      for (int64_t e = 0; e < num_experts; e += W) {
        const auto m = Vec::tail_mask(num_experts - e);
        const Vec exp_neg_abs = Vec::load(scores + e, Vec::tail_mask(W), 0.0f);
        const Vec s = sqrt_softplus(Vec::load(logits + e, m, 0.0f), exp_neg_abs);
        s.store(scores + e, m);
        store_biased<kTrack>(s, bias, e, m, biased, top);
      }
      return biased;
    }
    // Four vectors per step: each score is a long dependency chain, and interleaving four
    // gives the out-of-order window independent work to overlap.
    constexpr int64_t kUnroll = 4;
    const auto all = Vec::tail_mask(W);
    int64_t e = 0;
    for (; e + kUnroll * W <= num_experts; e += kUnroll * W) {
      Vec s[kUnroll];
      for (int64_t u = 0; u < kUnroll; ++u) {
        s[u] = score<kScore>(Vec::load(logits + e + u * W, all, 0.0f));
      }
      for (int64_t u = 0; u < kUnroll; ++u) {
        s[u].store(scores + e + u * W, all);
        store_biased<kTrack>(s[u], bias, e + u * W, all, biased, top);
      }
    }
    for (; e < num_experts; e += W) {
      const auto m = Vec::tail_mask(num_experts - e);
      const Vec s = score<kScore>(Vec::load(logits + e, m, 0.0f));
      s.store(scores + e, m);
      store_biased<kTrack>(s, bias, e, m, biased, top);
    }
    return biased;
  }
}

// Ranking a few dozen values: rank[i] of values[0, n) (no NaN) is how many values beat
// values[i] -- are larger, or equal at a lower position -- so the ranks are a permutation of
// 0..n-1. All pairs are compared, branch-free and W lanes at a time: for the n <= 64 values
// ranked here that beats a sorting network (long dependency chains) and insertion
// (mispredicted branches). The ranks stay in registers, as lanes of kVecs vectors: read back
// from memory lane by lane they would stall on store forwarding.
static_assert(kMaxCandidates <= 64, "ranked lanes are tracked in 64-bit masks");
constexpr int64_t kMaxRankVecs = (kMaxCandidates + W - 1) / W;

// first, where given, holds values[0, W) with -inf past n, as the load would.
template <int64_t kVecs>
MOEEXT_ALWAYS_INLINE void rank_values(const float* values, int64_t n, Vec* rank,
                                      const Vec* first = nullptr) {
  Vec v[kVecs];
  for (int64_t q = 0; q < kVecs; ++q) {
    v[q] = q == 0 && first != nullptr
               ? *first
               : Vec::load(values + q * W, Vec::tail_mask(n - q * W), kNegInf);
    rank[q] = Vec::set1(0.0f);
  }
  // values[j] beats the values of the vectors before its own where larger, and those of the
  // vectors after it where larger or equal; only in its own vector does the position decide
  // an equal value (count_beaten). The loop over j's vector unrolls, so each comparison is
  // chosen at compile time: Nemotron-style rows (22 of 512 experts: two vectors of
  // candidates or more) took 0.95x the time on a Zen 4 against one positional test per
  // vector.
#pragma GCC unroll 4
  for (int64_t jq = 0; jq < kVecs; ++jq) {
    const int64_t j_end = n < (jq + 1) * W ? n : (jq + 1) * W;
    for (int64_t j = jq * W; j < j_end; ++j) {
      const Vec vj = Vec::set1(values[j]);
      const int64_t later_from = j - jq * W + 1;  // lanes of j's vector after j
      for (int64_t q = 0; q < kVecs; ++q) {
        if (q < jq) {
          rank[q] = Vec::count_gt(rank[q], vj, v[q]);
        } else if (q > jq) {
          rank[q] = Vec::count_ge(rank[q], vj, v[q]);
        } else {
          rank[q] = Vec::count_beaten(rank[q], vj, v[q],
                                      typename Vec::Mask(~uint64_t(0) << later_from),
                                      later_from);
        }
      }
    }
  }
}

// Bit i set where rank i == r: exactly one bit for 0 <= r < n.
template <int64_t kVecs>
MOEEXT_ALWAYS_INLINE uint64_t rank_position(const Vec* rank, int64_t r) {
  uint64_t bits = 0;
  for (int64_t q = 0; q < kVecs; ++q) {
    bits |= uint64_t(Vec::cmp_eq(rank[q], Vec::set1(float(r)))) << (q * W);
  }
  return bits;
}

// ws.chosen[0, k) = the candidate ids of ranks 0..k-1; first as for rank_values.
template <int64_t kVecs>
struct ChooseRanked {
  MOEEXT_ALWAYS_INLINE static void run(const GroupedTopkWorkspace& ws, int64_t count,
                                       int64_t k, const Vec* first) {
    Vec rank[kVecs];
    rank_values<kVecs>(ws.candidates, count, rank, first);
    for (int64_t j = 0; j < k; ++j) {
      ws.chosen[j] = ws.candidate_ids[__builtin_ctzll(rank_position<kVecs>(rank, j))];
    }
  }
};

// with_rank_vecs past three vectors: the least of kVecs..kMaxRankVecs vectors that covers n
// (4 to 8 on the 8-lane layers, 4 on AVX-512). Padded to 8 vectors, Nemotron-style rows (22
// of 512 experts, about 28 candidates) ranked twice the lanes they hold: AVX2 rows took 0.81x
// the time at their own count.
template <template <int64_t> class Op, int64_t kVecs, typename... Args>
MOEEXT_ALWAYS_INLINE auto with_rank_vecs_from(int64_t n, Args... args) {
  if constexpr (kVecs < kMaxRankVecs) {
    if (n > kVecs * W) return with_rank_vecs_from<Op, kVecs + 1>(n, args...);
  }
  return Op<kVecs>::run(args...);
}

// Op<kVecs>::run(args...) with kVecs the vector count that covers n ranked values, so that
// each use of the ranks is unrolled for it and keeps them in registers.
template <template <int64_t> class Op, typename... Args>
MOEEXT_ALWAYS_INLINE auto with_rank_vecs(int64_t n, Args... args) {
  switch ((n + W - 1) / W) {
    case 1: return Op<1>::run(args...);
    case 2: return Op<(2 < kMaxRankVecs ? 2 : kMaxRankVecs)>::run(args...);
    case 3: return Op<(3 < kMaxRankVecs ? 3 : kMaxRankVecs)>::run(args...);
    default: return with_rank_vecs_from<Op, (4 < kMaxRankVecs ? 4 : kMaxRankVecs)>(n, args...);
  }
}

// Step 2 for all groups: the running top-2 of each group lane by lane, then the horizontal
// reductions of kGroups groups done together. With a bias (kTop2) a group scores the sum of
// its two largest b (a repeated maximum counts twice); without, its maximum. The second
// largest is kept either way: it bounds step 4's floor. kGroups is a compile-time count, so
// the loops unroll and the 2 * kGroups running vectors stay in registers; groups
// n..kGroups-1 are padding.
// Lane g of score / second: group g's score and second largest b (-inf past n).
struct GroupTop2 {
  Vec score, second;
};

template <bool kTop2, int kGroups>
inline GroupTop2 score_group_chunk(const float* b, int64_t group_size, int n) {
  Vec first[kGroups], second[kGroups];
#pragma GCC unroll 16
  for (int i = 0; i < kGroups; ++i) {
    Vec f = Vec::set1(kNegInf), s = Vec::set1(kNegInf);
    if (i < n) {
      for (int64_t e = 0; e < group_size; e += W) {
        const Vec x =
            Vec::load(b + i * group_size + e, Vec::tail_mask(group_size - e), kNegInf);
        s = Vec::max(s, Vec::min(f, x));
        f = Vec::max(f, x);
      }
    }
    first[i] = f;
    second[i] = s;
  }
  Vec::reduce_groups_top2<kGroups>(first, second);
  Vec score = first[0];
  if (kTop2 && group_size > 1) {  // a group of one expert scores that expert's b
    // +inf + -inf is NaN: it ranks as -inf like NaN in b (max returns -inf for a NaN sum).
    score = Vec::max(first[0] + second[0], Vec::set1(kNegInf));
  }
  return {score, second[0]};
}

// With groups and k <= 2 * topk_group, the groups' top-2 give a floor without reading b again
// or sorting: the kept groups' largest and second largest b are 2 * topk_group distinct
// experts, all at or above the least of the seconds. On DeepSeek-V3 it is as tight as the
// lanes' floor (about 11 candidates either way).
inline float lowest_kept_second(const float* group_seconds, int64_t group_size,
                                const ExpertRange* ranges, int64_t num_ranges) {
  float lowest = std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < num_ranges; ++r) {
    for (int64_t e = ranges[r].begin; e < ranges[r].end; e += group_size) {
      const float second = group_seconds[e / group_size];
      lowest = second < lowest ? second : lowest;
    }
  }
  return lowest;
}

// Steps 2 and 3: ws.ranges gets the expert ranges of the kept groups, in group order (the
// ranking in step 4 relies on candidates arriving in index order); returns their number.
// With want_floor, lowest_second gets lowest_kept_second's floor.
//
// Up to W groups stay in one vector from their scores to the kept mask and the floor: ranked
// lane against lane through permutes, the floor a masked minimum. Stored and read back (the
// general path below) they put a store-to-load round trip, and the floor a loop with a
// divide, on every row's critical path (DeepSeek-V3 rows 0.95x the time in registers, V2
// unchanged). There, one range per kept group: the loops over the ranges run a fixed
// number of times with fixed trip counts, where merging neighbours made both depend on the
// row and mispredict (DeepSeek-V3 rows 0.95-0.97x the time, V2 unchanged). Past W groups,
// which may hold one expert each, neighbours are merged.
template <bool kTop2>
inline int64_t keep_groups(const float* b, int64_t num_groups, int64_t group_size,
                           int64_t topk_group, bool want_floor, const GroupedTopkWorkspace& ws,
                           float& lowest_second) {
  // Half a chunk when that is enough: the common 8 groups then cost half the merges.
  constexpr int kHalf = W > 1 ? W / 2 : 1;
  int64_t num_ranges = 0;
  if (num_groups <= W) {
    const int n = int(num_groups);
    const GroupTop2 top = n <= kHalf ? score_group_chunk<kTop2, kHalf>(b, group_size, n)
                                     : score_group_chunk<kTop2, W>(b, group_size, n);
    // rank_values' count, with the values broadcast from the register.
    Vec rank = Vec::set1(0.0f);
    for (int64_t j = 0; j < num_groups; ++j) {
      rank = Vec::count_beaten(rank, Vec::broadcast_lane(top.score, j), top.score,
                               typename Vec::Mask(~uint64_t(0) << (j + 1)), j + 1);
    }
    const auto kept =
        Vec::tail_mask(num_groups) & Vec::cmp_lt(rank, Vec::set1(float(topk_group)));
    if (want_floor) {
      const Vec inf = Vec::set1(std::numeric_limits<float>::infinity());
      lowest_second = Vec::reduce_min(Vec::select(kept, top.second, inf));
    }
    for (uint32_t bits = kept; bits != 0; bits &= bits - 1) {
      const int64_t g = __builtin_ctz(bits);
      ws.ranges[num_ranges++] = ExpertRange{g * group_size, (g + 1) * group_size};
    }
    return num_ranges;
  }
  for (int64_t g0 = 0; g0 < num_groups; g0 += W) {
    const int n = int(num_groups - g0 < W ? num_groups - g0 : W);
    const float* chunk = b + g0 * group_size;
    const GroupTop2 top = n <= kHalf ? score_group_chunk<kTop2, kHalf>(chunk, group_size, n)
                                     : score_group_chunk<kTop2, W>(chunk, group_size, n);
    top.score.store(ws.group_scores + g0);  // whole vectors: the arrays have slack
    top.second.store(ws.group_seconds + g0);
  }
  int64_t count = 0;
  for (int64_t g = 0; g < num_groups; ++g) {
    topk_insert(ws.group_keys, count, topk_group, make_key(ws.group_scores[g], g));
  }
  const uint64_t last_kept = ws.group_keys[topk_group - 1];
  for (int64_t g = 0; g < num_groups; ++g) {
    if (make_key(ws.group_scores[g], g) < last_kept) continue;
    if (num_ranges > 0 && ws.ranges[num_ranges - 1].end == g * group_size) {
      ws.ranges[num_ranges - 1].end += group_size;
    } else {
      ws.ranges[num_ranges++] = ExpertRange{g * group_size, (g + 1) * group_size};
    }
  }
  if (want_floor) {
    lowest_second = lowest_kept_second(ws.group_seconds, group_size, ws.ranges, num_ranges);
  }
  return num_ranges;
}

// Step 4a: a floor under the k-th largest candidate. Lane by lane, the two largest values
// over the candidate ranges are distinct experts, so the k-th largest of those 2W values has
// k distinct experts at or above it (a -inf fill standing in for a missing expert only lowers
// the floor). With k <= kLaneMaxK the lane maxima alone give a floor almost as tight at a
// quarter of the ranking work: on 16 lanes up to k = 16. On 8 lanes the maxima leave
// too many candidates already at k = 6 and 8 (9.3 and 20 on average for routers of 160 to
// 384 experts, against 6.2 and 8.7 from the top-2), so there only up to k = 4.
// Returns -inf for k > 2W: every expert is a candidate.
constexpr int64_t kLaneMaxK = W >= 16 ? W : W / 2;
inline float floor_from_lanes(const LaneTop2& top, int64_t k) {
  if (k > 2 * W) return kNegInf;
  const Vec lanes[2] = {top.first, top.second};
  return Vec::kth_largest(lanes, k <= kLaneMaxK ? 1 : 2, k);
}

// The lanes' top-2 over the kept groups' ranges, read back from b (with groups, the kept
// ones are known only after the whole row is scored).
template <int kTrack>
inline LaneTop2 lanes_of_ranges(const float* b, const ExpertRange* ranges, int64_t num_ranges) {
  LaneTop2 top;
  for (int64_t r = 0; r < num_ranges; ++r) {
    for (int64_t e = ranges[r].begin; e < ranges[r].end; e += W) {
      track_lanes<kTrack>(top, Vec::load(b + e, Vec::tail_mask(ranges[r].end - e), kNegInf));
    }
  }
  return top;
}

// Largest k the floors below cover: 2W lanes' top-2, or where the vector layer ranks four
// vectors (AVX2), the top-2 of alternate vectors' lanes, 4W values.
constexpr int64_t kMaxFloorK = Vec::kMaxKthVecs >= 4 ? 4 * W : 2 * W;

// Step 4a for 2W < k <= 4W: lane by lane, the top-2 of the even-numbered and of the
// odd-numbered vectors over the ranges, read back from b. The vectors cover disjoint experts,
// so these 4W values are distinct experts, and their k-th largest is a floor as above. Without
// it, routers that choose more experts than twice the lanes (Nemotron-style topk 22 on AVX2's
// 8 lanes) made every expert a candidate: 7x the time per row.
[[maybe_unused]]
inline float floor_from_alternate_lanes(const float* b, const ExpertRange* ranges,
                                        int64_t num_ranges, int64_t k) {
  LaneTop2 even, odd;
  for (int64_t r = 0; r < num_ranges; ++r) {
    const int64_t end = ranges[r].end;
    int64_t e = ranges[r].begin;
    for (; e + 2 * W <= end; e += 2 * W) {
      track_lanes<2>(even, Vec::load(b + e, Vec::tail_mask(W), kNegInf));
      track_lanes<2>(odd, Vec::load(b + e + W, Vec::tail_mask(W), kNegInf));
    }
    for (; e < end; e += W) {
      track_lanes<2>(even, Vec::load(b + e, Vec::tail_mask(end - e), kNegInf));
    }
  }
  const Vec lanes[4] = {even.first, even.second, odd.first, odd.second};
  return Vec::kth_largest(lanes, 4, k);
}

inline float candidate_floor(const float* b, const ExpertRange* ranges, int64_t num_ranges,
                             int64_t k) {
  if (k > kMaxFloorK) return kNegInf;
  if constexpr (kMaxFloorK > 2 * W) {
    if (k > 2 * W) return floor_from_alternate_lanes(b, ranges, num_ranges, k);
  }
  return floor_from_lanes(k <= kLaneMaxK ? lanes_of_ranges<1>(b, ranges, num_ranges)
                                         : lanes_of_ranges<2>(b, ranges, num_ranges),
                          k);
}

// The values step 4b packs for the experts of b + e: b's own (x, as loaded).
struct PackB {
  Vec operator()(int64_t /*e*/, typename Vec::Mask /*in_range*/, Vec x) const { return x; }
};

// Step 4b: the experts at or above the floor, in index order, into ws.candidates /
// ws.candidate_ids, and with kPackFirst the first W of their values into first (-inf past
// the count). Returns their number, or -1 once there are more than kMaxCandidates. The
// values packed are values(e, in_range, x) for the vector x of b at e (b itself by default).
template <bool kPackFirst, typename Values = PackB>
MOEEXT_ALWAYS_INLINE int64_t gather_candidates(const float* b, const ExpertRange* ranges,
                                               int64_t num_ranges, float floor,
                                               const GroupedTopkWorkspace& ws, Vec& first,
                                               Values values = Values()) {
  const Vec f = Vec::set1(floor);
  int64_t count = 0;
  first = Vec::set1(kNegInf);
  // In locals: the vector stores may alias anything, so members of ws would be read again
  // after every store.
  float* const candidates = ws.candidates;
  int32_t* const candidate_ids = ws.candidate_ids;
  auto pack = [&](Vec x, typename Vec::Mask in_range, typename Vec::Mask m, int64_t e) {
    const Vec v = values(e, in_range, x);
    if (kPackFirst && count < W) first = Vec::append_compressed(first, v, m, int(count));
    count += Vec::compress_store(v, m, int32_t(e), candidates + count, candidate_ids + count);
  };
  // A range of up to kShortRange vectors counts as short: for GLM-4.5's 10 vectors the
  // marking pass below costs more than it saves (rows 0.96-0.97x the time without it), for 16
  // (DeepSeek-V4-flash) it saves (1.035-1.04x without it).
  constexpr int64_t kShortRange = 12 * W;
  if (num_ranges > 1 || ranges[0].end - ranges[0].begin <= kShortRange) {
    // The kept groups' ranges are short: a compress per vector, no branch on the data.
    // Whole vectors, then the range's tail: no mask to compute in the loop. (The load, pack
    // and count check are written out at each of their four places: through one lambda,
    // GLM-4.5 rows took 1.2-1.3x the time and DeepSeek-V3, Kimi-K2 and V2 rows 1.03-1.16x.)
    for (int64_t r = 0; r < num_ranges; ++r) {
      const int64_t end = ranges[r].end;
      int64_t e = ranges[r].begin;
      for (; e + W <= end; e += W) {
        const auto all = Vec::tail_mask(W);
        const Vec x = Vec::load(b + e, all, kNegInf);
        // >= : a value equal to the floor may still win on a lower index.
        pack(x, all, Vec::cmp_ge(x, f), e);
        if (count > kMaxCandidates) return -1;
      }
      if (e < end) {
        const auto in_range = Vec::tail_mask(end - e);
        const Vec x = Vec::load(b + e, in_range, kNegInf);
        pack(x, in_range, in_range & Vec::cmp_ge(x, f), e);
        if (count > kMaxCandidates) return -1;
      }
    }
    return count;
  }
  // One long range: only about k of its experts pass the floor, so most vectors hold none.
  // A branch-free pass marks the vectors that hold one (64 to a bit set), and the compresses
  // and stores visit only those, at the cost of one mispredict where that loop ends. (A
  // branch per vector mispredicts at random on fresh rows; with several short ranges the
  // extra pass and loop exits cost more than they save.)
  constexpr int64_t kChunk = 64 * W;
  const int64_t end = ranges[0].end;
  for (int64_t begin = ranges[0].begin; begin < end; begin += kChunk) {
    const int64_t stop = end - begin < kChunk ? end : begin + kChunk;
    // Whole vectors in both loops, and the chunk's partial last vector (if any) on its own,
    // after them: the candidates stay in index order, and no mask is computed per vector.
    const int64_t whole = (stop - begin) / W;
    const int64_t tail_begin = begin + whole * W;
    const auto all = Vec::tail_mask(W);
    uint64_t holds = 0;
    for (int64_t i = 0; i < whole; ++i) {
      holds |= uint64_t(Vec::cmp_ge(Vec::load(b + begin + i * W, all, kNegInf), f) != 0) << i;
    }
    for (; holds != 0; holds &= holds - 1) {
      const int64_t e = begin + __builtin_ctzll(holds) * W;
      const Vec x = Vec::load(b + e, all, kNegInf);
      pack(x, all, Vec::cmp_ge(x, f), e);
      if (count > kMaxCandidates) return -1;
    }
    if (tail_begin < stop) {
      const auto in_range = Vec::tail_mask(stop - tail_begin);
      const Vec x = Vec::load(b + tail_begin, in_range, kNegInf);
      pack(x, in_range, in_range & Vec::cmp_ge(x, f), tail_begin);
      if (count > kMaxCandidates) return -1;
    }
  }
  return count;
}

// Step 4 entry: ws.chosen[0, k) gets the k best experts, best first.
inline void select_experts(const float* b, const ExpertRange* ranges, int64_t num_ranges,
                           int64_t k, float floor, const GroupedTopkWorkspace& ws) {
  // With k > W there are more than W candidates: no use packing the first W in a register
  // (Nemotron-style rows 0.97x the time without it).
  Vec first;
  const int64_t count = k <= W ? gather_candidates<true>(b, ranges, num_ranges, floor, ws, first)
                               : gather_candidates<false>(b, ranges, num_ranges, floor, ws, first);
  if (count >= 0) {
    with_rank_vecs<ChooseRanked>(count, ws, count, k, k <= W && count <= W ? &first : nullptr);
    return;
  }
  // Too many candidates (a row of ties, or k > kMaxFloorK: no floor): insertion, offering
  // only lanes at or above the floor and, once k keys are held, at or above the current k-th.
  uint64_t* keys = ws.expert_keys;
  int64_t held = 0;
  for (int64_t r = 0; r < num_ranges; ++r) {
    for (int64_t e = ranges[r].begin; e < ranges[r].end; e += W) {
      const Vec x = Vec::load(b + e, Vec::tail_mask(ranges[r].end - e), kNegInf);
      float bound = floor;
      if (held == k) {
        const float kth = b[key_index(keys[k - 1])];
        bound = kth > bound ? kth : bound;
      }
      auto m = Vec::tail_mask(ranges[r].end - e) & Vec::cmp_ge(x, Vec::set1(bound));
      for (uint32_t bits = m; bits != 0; bits &= bits - 1) {
        const int64_t expert = e + __builtin_ctz(bits);
        topk_insert(keys, held, k, make_key(b[expert], expert));
      }
    }
  }
  for (int64_t j = 0; j < k; ++j) ws.chosen[j] = int32_t(key_index(keys[j]));
}

// The candidate pass: sqrt-softplus rows (DeepSeek-V4) with every group kept.
//
// An exact sqrt-softplus score (exp, log1p and sqrt) costs about 20 cycles per vector of 16
// experts on Zen 5, and all but the few chosen experts' are thrown away. The cubic pieces of
// cpu/score_pieces.h cost 7 and are within eps = kScoreApproxError of the exact score s. So
// the row is first ranked on b~ = s~ + bias: with |s~ - s| <= eps, |b~ - b| <= delta = eps +
// the rounding of the two bias additions. The floor F of b~ (k distinct experts at or above
// it, from the lanes as in step 4a) has k experts with b >= F - delta, so every expert the
// exact algorithm chooses has b >= F - delta and b~ >= F - 2 delta. The experts with
// b~ >= F - 2 delta are scored exactly, with the very operations of the exact path, and
// ranked as step 4 ranks: the result is the exact path's bit for bit. Rows the pieces do not
// cover (a logit outside [-16, 16), NaN or inf) and rows with more than kMaxCandidates
// candidates (near-ties) take the exact path. Sigmoid rows stay exact: their exact score
// costs 14 cycles a vector, and with the pass Kimi-K2, GLM-4.5 and Nemotron-style rows
// measured 0.94-1.16x their time, no clear gain.

// Step 1 on the pieces: b~ into approx_b, the lanes tracked as score_row tracks them.
// Returns false when a logit lies outside the pieces.
// Vector i of b~ goes to approx_b + i * kVectorStride (W: a contiguous row).
template <int kTrack, int64_t kVectorStride = W, typename LogitT, typename BiasT>
MOEEXT_ALWAYS_INLINE bool approx_score_row(const LogitT* logits, const BiasT* bias,
                                           int64_t num_experts, const ScorePieces& pieces,
                                           float* approx_b, LaneTop2& top) {
  typename Vec::PiecesSeen pieces_seen = Vec::no_pieces_seen();
  // b~ of the experts e.. (the lanes of m) from their approximate scores s~.
  auto store_biased_approx = [&](int64_t e, typename Vec::Mask m, Vec b) {
    if constexpr (!std::is_same_v<BiasT, no_bias_t>) b = b + Vec::load(bias + e, m, 0.0f);
    b.store(approx_b + e / W * kVectorStride);  // whole vectors: the rows are padded to 16
    track_lanes<kTrack>(top, Vec::select(m, b, Vec::set1(kNegInf)));
  };
  int64_t paired_end = 0;
  // bf16 logits two vectors at a time, widened by shifts and scored in even / odd order, the
  // approximations put back in index order by two permutes (Vec::load_pair): DeepSeek-V4-pro
  // rows 0.96-0.99x the time on AVX-512, 0.95x on AVX2.
  if constexpr (std::is_same_v<LogitT, bf16_t> && Vec::kHasBf16Pairs) {
    const auto all = Vec::tail_mask(W);
    for (int64_t e = 0; e + 2 * W <= num_experts; e += 2 * W, paired_end = e) {
      Vec even, odd, low, high;
      Vec::load_pair(logits + e, even, odd);
      Vec::interleave_pair(Vec::piecewise_cubic(even, pieces, pieces_seen),
                           Vec::piecewise_cubic(odd, pieces, pieces_seen), low, high);
      store_biased_approx(e, all, low);
      store_biased_approx(e + W, all, high);
    }
  }
  for_each_vector(paired_end, num_experts, [&](int64_t e, typename Vec::Mask m) {
    // The lanes past the row's end load 0, inside the pieces.
    store_biased_approx(e, m, Vec::piecewise_cubic(Vec::load(logits + e, m, 0.0f), pieces,
                                                   pieces_seen));
  });
  return Vec::all_pieces_inside(pieces_seen);
}

inline float bias_at(const no_bias_t* /*bias*/, int64_t /*e*/) { return 0.0f; }
template <typename BiasT>
inline float bias_at(const BiasT* bias, int64_t e) { return to_float(bias[e]); }

// Steps 4b and 4c on the candidates of approx_b at or above floor - margin (margin = 2 delta):
// ws.chosen[0, k) gets the k best experts, best first, and scores[e] the exact score of each
// candidate e. Returns false, having chosen nothing, when there are too many candidates.
template <ScoringFunc kScore, typename LogitT, typename BiasT>
bool select_by_approx(const LogitT* logits, const BiasT* bias, int64_t num_experts, int64_t k,
                      const float* approx_b, float floor, float margin, float* scores,
                      const GroupedTopkWorkspace& ws) {
  const ExpertRange all{0, num_experts};
  Vec packed;  // the first W of them
  // The candidates' logits, widened, in index order.
  const int64_t count = gather_candidates<true>(
      approx_b, &all, 1, floor - margin, ws, packed,
      [logits](int64_t e, typename Vec::Mask in_range, Vec /*b*/) {
        return Vec::load(logits + e, in_range, 0.0f);
      });
  if (count < 0) return false;
  for (int64_t i = 0; i < count; ++i) ws.candidate_bias[i] = bias_at(bias, ws.candidate_ids[i]);
  Vec first = Vec::set1(kNegInf);
  for (int64_t i = 0; i < count; i += W) {
    const auto m = Vec::tail_mask(count - i);
    // score() and the bias sum as score_row and store_biased compute them, lane by lane.
    // The first W from the register: loaded back, they would span several of the packing's
    // stores and wait for them to reach the cache (DeepSeek-V4 rows 0.96-0.97x the time).
    const Vec x = i == 0 ? Vec::select(m, packed, Vec::set1(0.0f))
                         : Vec::load(ws.candidates + i, m, 0.0f);
    const Vec s = score<kScore>(x);
    Vec b = s;
    if constexpr (!std::is_same_v<BiasT, no_bias_t>) {
      b = s + Vec::load(ws.candidate_bias + i, m, 0.0f);
    }
    b = Vec::max(b, Vec::set1(kNegInf));
    s.store(ws.candidate_scores + i);  // whole vectors: the arrays have slack
    b.store(ws.candidates + i);
    if (i == 0) first = Vec::select(m, b, Vec::set1(kNegInf));
  }
  for (int64_t i = 0; i < count; ++i) scores[ws.candidate_ids[i]] = ws.candidate_scores[i];
  with_rank_vecs<ChooseRanked>(count, ws, count, k, count <= W ? &first : nullptr);
  return true;
}

// 2 delta for a call, or -1 where the bias is not finite: |b~ - b| <= eps plus half an ulp
// of each rounded sum, at most 2^-23 * (largest |bias| + largest score) for the two.
template <typename BiasT>
float approx_margin(const BiasT* bias, int64_t num_experts) {
  float largest = 0.0f;
  if constexpr (!std::is_same_v<BiasT, no_bias_t>) {
    Vec magnitude = Vec::set1(0.0f);
    typename Vec::Mask not_finite = 0;
    for (int64_t e = 0; e < num_experts; e += W) {
      const Vec x = Vec::load(bias + e, Vec::tail_mask(num_experts - e), 0.0f);
      not_finite |= Vec::is_nan(x - x);  // inf - inf and NaN - NaN are NaN
      magnitude = Vec::max(magnitude, Vec::max(x, Vec::set1(0.0f) - x));
    }
    if (not_finite) return -1.0f;
    largest = Vec::reduce_max(magnitude);
  }
  // sqrt-softplus over the pieces' range stays below sqrt(16 + 1).
  const float delta = kScoreApproxError + (largest + 4.125f) * 0x1p-22f;
  return 2.0f * delta;
}

// Rows of a large T come from L3 or DRAM. The exact path's rows are long enough for the
// hardware prefetcher to keep up; the candidate pass's are not (DeepSeek-V4-pro rows from
// DRAM took 1.6x their time from L2). A software prefetch kPrefetchRows rows ahead of the
// row being scored hides it: they then run as from L2. (The exact path measured the same
// with it and without.)
constexpr int64_t kPrefetchRows = 4;
template <typename LogitT>
MOEEXT_ALWAYS_INLINE void prefetch_row(const LogitT* row, int64_t num_experts) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t at = 0; at < num_experts * int64_t(sizeof(LogitT)); at += 64) {
    __builtin_prefetch(bytes + at);
  }
}

// score_row with the lane tracking picked per call (the same for every row, so the branch
// predicts); track is 0, 1 or 2 as for kTrack.
template <ScoringFunc kScore, typename LogitT, typename BiasT>
inline const float* score_row_tracked(const LogitT* logits, const BiasT* bias,
                                      int64_t num_experts, int track, float* scores,
                                      float* biased, LaneTop2& top) {
  switch (track) {
    case 1:
      return score_row<kScore, 1>(logits, bias, num_experts, scores, biased, top);
    case 2:
      return score_row<kScore, 2>(logits, bias, num_experts, scores, biased, top);
    default:
      return score_row<kScore, 0>(logits, bias, num_experts, scores, biased, top);
  }
}

// A scored row: its scores s, its biased scores b (s itself where b = s) and, with every
// group kept, its lanes' top-2 of b.
struct ScoredRow {
  const float* s;
  const float* b;
  LaneTop2 top;
};

// The outputs of row t from its chosen experts (ws.chosen) and their scores s.
MOEEXT_ALWAYS_INLINE void write_row_outputs(const BiasedGroupedTopkParams& p, int64_t t,
                                            const float* s, const GroupedTopkWorkspace& ws) {
  float* weights = p.topk_weights + t * p.weights_row_stride;
  int32_t* ids = p.topk_ids + t * p.ids_row_stride;
  float sum = 0.0f;
  for (int64_t j = 0; j < p.topk; ++j) {
    const int64_t expert = ws.chosen[j];
    const float w = s[expert];
    weights[j] = std::isnan(w) ? 0.0f : w;  // weights come from s, never from b - bias
    ids[j] = int32_t(expert);
    sum += weights[j];
  }
  // The sum above stays sequential (its rounding is part of the result); the divides and
  // scalings are lane-wise, so a vector does them with the scalar loop's exact results.
  const Vec scale = Vec::set1(p.routed_scaling_factor);
  const Vec denom = Vec::set1(sum + 1e-20f);
  for (int64_t j = 0; j < p.topk; j += W) {
    const auto m = Vec::tail_mask(p.topk - j);
    Vec w = Vec::load(weights + j, m, 0.0f);
    if (p.renormalize) w = w / denom;
    (w * scale).store(weights + j, m);
  }
}

// Rows [row_begin, row_end), software-pipelined: row t + 1 is scored before row t is
// selected. Scoring is long independent vector work; selection is a chain of short dependent
// steps ending in data-dependent branches. In this order the next row's scoring is older
// than the selection in the out-of-order window, so it runs underneath the selection's chain
// and survives its mispredicts (which flush only younger work).
template <typename ScoreToken, typename SelectToken>
MOEEXT_ALWAYS_INLINE void pipeline_rows(int64_t row_begin, int64_t row_end,
                                        ScoreToken& score_token, SelectToken& select_token) {
  auto current = score_token(row_begin);
  for (int64_t t = row_begin; t < row_end; ++t) {
    decltype(current) next;
    if (t + 1 < row_end) next = score_token(t + 1);
    select_token(t, current);
    current = next;
  }
}

// Rows [row_begin, row_end) with exact scores throughout.
template <ScoringFunc kScore, typename LogitT, typename BiasT>
void route_rows(const BiasedGroupedTopkParams& p, const BiasT* bias, int64_t row_begin,
                int64_t row_end, const GroupedTopkWorkspace& ws) {
  const int64_t num_experts = p.num_experts;
  const int64_t num_groups = p.num_expert_group;
  const int64_t group_size = num_experts / num_groups;
  const int64_t topk = p.topk;
  const bool all_groups_kept = p.topk_group == num_groups;
  constexpr bool has_bias = !std::is_same_v<BiasT, no_bias_t>;
  const LogitT* logits_base = static_cast<const LogitT*>(p.gating_output);

  // With every group kept the floor comes from lanes tracked while scoring.
  const int track = !all_groups_kept || topk > 2 * W ? 0 : topk <= kLaneMaxK ? 1 : 2;

  // Step 1 of row t, into workspace slot t % 2.
  auto score_token = [&](int64_t t) {
    const int slot = int(t & 1);
    ScoredRow r;
    r.s = ws.scores[slot];
    const LogitT* row = logits_base + t * p.gating_row_stride;
    if (p.gating_col_stride != 1) {
      // Column-strided logits: widen this row into the workspace, then read it contiguously.
      for (int64_t e = 0; e < num_experts; ++e) {
        ws.row[e] = to_float(row[e * p.gating_col_stride]);
      }
      r.b = score_row_tracked<kScore, float, BiasT>(ws.row, bias, num_experts, track,
                                                    ws.scores[slot], ws.biased[slot], r.top);
    } else {
      r.b = score_row_tracked<kScore, LogitT, BiasT>(row, bias, num_experts, track,
                                                     ws.scores[slot], ws.biased[slot], r.top);
    }
    return r;
  };

  // Steps 2 to 4 and the outputs of row t.
  auto select_token = [&](int64_t t, const ScoredRow& r) {
    const float* b = r.b;
    const ExpertRange all{0, num_experts};
    const ExpertRange* ranges = &all;
    int64_t num_ranges = 1;
    float floor;
    if (!all_groups_kept) {
      const bool second_floor = topk <= 2 * p.topk_group;
      num_ranges = keep_groups<has_bias>(b, num_groups, group_size, p.topk_group, second_floor,
                                         ws, floor);
      ranges = ws.ranges;
      if (!second_floor) floor = candidate_floor(b, ranges, num_ranges, topk);
    } else if (topk <= 2 * W) {
      floor = floor_from_lanes(r.top, topk);
    } else {
      floor = candidate_floor(b, ranges, num_ranges, topk);
    }
    select_experts(b, ranges, num_ranges, topk, floor, ws);
    write_row_outputs(p, t, r.s, ws);
  };

  pipeline_rows(row_begin, row_end, score_token, select_token);
}

// Rows [row_begin, row_end) by the candidate pass (see select_by_approx), pipelined as
// route_rows is; a row the pass cannot take is routed by route_rows alone. Kept out of
// route_rows, which compiles as before: with the pass inlined into it, exact rows measured
// 4-16% slower even where the pass never ran.
template <ScoringFunc kScore, typename LogitT, typename BiasT>
[[gnu::noinline]] void route_rows_by_approx(const BiasedGroupedTopkParams& p, const BiasT* bias,
                                            int64_t row_begin, int64_t row_end, float margin,
                                            const GroupedTopkWorkspace& ws) {
  const int64_t num_experts = p.num_experts;
  const int64_t topk = p.topk;
  const ScorePieces& pieces = *ws.score_pieces;
  const LogitT* logits_base = static_cast<const LogitT*>(p.gating_output);

  struct ApproxRow {
    LaneTop2 top;
    bool covered = false;
  };
  auto score_token = [&](int64_t t) {
    const LogitT* row = logits_base + t * p.gating_row_stride;
    if (t + kPrefetchRows < row_end) {
      prefetch_row(row + kPrefetchRows * p.gating_row_stride, num_experts);
    }
    float* approx_b = ws.biased[t & 1];
    ApproxRow r;
    r.covered = topk <= kLaneMaxK
                    ? approx_score_row<1>(row, bias, num_experts, pieces, approx_b, r.top)
                    : approx_score_row<2>(row, bias, num_experts, pieces, approx_b, r.top);
    return r;
  };
  auto select_token = [&](int64_t t, const ApproxRow& r) {
    float* scores = ws.scores[t & 1];
    if (r.covered &&
        select_by_approx<kScore>(logits_base + t * p.gating_row_stride, bias, num_experts,
                                 topk, ws.biased[t & 1], floor_from_lanes(r.top, topk),
                                 margin, scores, ws)) {
      write_row_outputs(p, t, scores, ws);
      return;
    }
    route_rows<kScore, LogitT, BiasT>(p, bias, t, t + 1, ws);
  };

  pipeline_rows(row_begin, row_end, score_token, select_token);
}

// Rows in lanes: kLaneRows rows at a time, row r in lane r of every vector, so that steps 2
// to 4 are lane-wise: a group score is a running maximum, the kept groups come from comparing
// group scores pairwise, and the topk experts from an insertion into topk sorted slots that
// each row's experts pass through in index order, all without a horizontal step, a gather of
// candidates or a branch on the data. For softmax and sigmoid rows, without a bias
// (DeepSeek-V2) or with every group kept (GLM-4.5); with a bias and groups to drop, the group
// scores are top-2 sums, left to route_rows. Each row is scored by the functions route_rows
// uses, b and the weights are computed with store_biased's and write_row_outputs' operations
// in their order, so the outputs are route_rows' bit for bit.
// On AVX-512 (16 rows a block) and AVX2 (8; its insertion holds its masks as whole lanes, see
// Vec::LaneMask). Not on the portable layer, which serves aarch64: untimed there.
constexpr bool kRowsInLanes = W == kLaneRows || MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_avx2;
// The candidate pass in lanes marks experts in 64-bit words of four 16-lane vectors.
constexpr bool kApproxRowsInLanes = W == kLaneRows;
constexpr int64_t kLaneMaxTopk = 8;
constexpr int64_t kLaneMaxGroups = 16;
// Where every group is kept, every expert is offered to the topk slots. A block of 8 rows
// shares each offer between half the rows a block of 16 does, and AVX2's 16 registers barely
// hold 8 slots and their ids: on Zen 3 the row pass was faster past about 768 offers x slots
// per row (E = 160 rows took 1.27x the row pass's time at topk = 8, the same at 6; E = 64 at
// topk = 8 0.78x, E = 128 at topk = 6 0.91x). Groups dropped (the insertion offered only the
// kept groups' experts) measured faster everywhere: DeepSeek-V2's shape 0.62-0.69x at topk
// <= 6, E = 256 in 8 groups at topk = 8 0.97x.
constexpr int64_t kLaneMaxOffersAllKept = 768;

// The lanes' best K values v so far, best first, and their experts' ids (as floats, exact far
// past kLaneMaxExperts); slots filled..K-1 are empty. x, of expert x_id, goes after every
// filled slot it does not beat: experts arrive in index order, so a slot holding an equal
// value holds a lower index, which wins. (Empty slots rather than -inf ones: b may be -inf.)
template <int K>
MOEEXT_ALWAYS_INLINE void insert_in_lanes(Vec* v, Vec* id, Vec x, Vec x_id, int filled = K) {
  typename Vec::LaneMask beats[K];
  for (int j = 0; j < K; ++j) {
    beats[j] = j < filled ? Vec::lanes_gt(x, v[j]) : Vec::lane_mask(Vec::tail_mask(W));
  }
  // The slots are sorted, so a lane where x beats slot j - 1 beats slot j too: there slot
  // j takes slot j - 1's value, where x beats slot j only, x.
  for (int j = K - 1; j > 0; --j) {
    v[j] = Vec::blend(beats[j - 1], v[j - 1], Vec::blend(beats[j], x, v[j]));
    id[j] = Vec::blend(beats[j - 1], id[j - 1], Vec::blend(beats[j], x_id, id[j]));
  }
  v[0] = Vec::blend(beats[0], x, v[0]);
  id[0] = Vec::blend(beats[0], x_id, id[0]);
}

// The experts offered to the slots, counted so that the first K fill them.
template <int K>
struct LaneSlots {
  Vec v[K], id[K];
  int offered = 0;
  // The first offers blend x over the empty slots, and the blends read them (a blendv even by
  // a constant mask): zeros there, not uninitialised registers.
  LaneSlots() {
    for (int j = 0; j < K; ++j) v[j] = id[j] = Vec::set1(0.0f);
  }
  MOEEXT_ALWAYS_INLINE void offer(Vec x, Vec x_id) {
    if (offered < K) {
      insert_in_lanes<K>(v, id, x, x_id, offered++);
    } else {
      insert_in_lanes<K>(v, id, x, x_id);
    }
  }
};

// Step 7 and the outputs of rows t0 + r for the lanes r of `rows`, in write_row_outputs'
// order: w[j] and id[j] hold each lane's j-th weight (before renormalising) and expert id
// (as a float), for j < k <= kMaxK.
template <int kMaxK>
MOEEXT_ALWAYS_INLINE void write_lane_outputs(const BiasedGroupedTopkParams& p, int64_t t0,
                                             int64_t k, Vec* w, const Vec* id,
                                             typename Vec::Mask rows) {
  Vec sum = Vec::set1(0.0f);
  for (int64_t j = 0; j < k; ++j) sum = sum + w[j];
  const Vec denom = sum + Vec::set1(1e-20f);
  const Vec scale = Vec::set1(p.routed_scaling_factor);
  alignas(64) float out_weights[kMaxK][W];
  alignas(64) float out_ids[kMaxK][W];
  for (int64_t j = 0; j < k; ++j) {
    if (p.renormalize) w[j] = w[j] / denom;
    (w[j] * scale).store(out_weights[j]);
    id[j].store(out_ids[j]);
  }
  for (int64_t r = 0; r < W; ++r) {
    if (!((rows >> r) & 1)) continue;
    float* weights = p.topk_weights + (t0 + r) * p.weights_row_stride;
    int32_t* ids = p.topk_ids + (t0 + r) * p.ids_row_stride;
    for (int64_t j = 0; j < k; ++j) {
      weights[j] = out_weights[j][r];
      ids[j] = int32_t(out_ids[j][r]);
    }
  }
}

// Step 4 where not every group is kept (no bias): lane by lane, expert i of the q-th kept
// group (in group order) is picked from the groups' expert i by selects, for q and then i in
// order, so that each lane meets its kept experts in index order. (A gather per expert
// instead cost 16 cycles on Zen 5: DeepSeek-V2 rows 1.1x the time.) kGroups is num_groups
// where it is a compile-time count, else 0.
template <int kGroups, int K>
MOEEXT_ALWAYS_INLINE void offer_kept_groups(
    const float* b, int64_t num_groups_at_run_time, int64_t group_size, int64_t topk_group,
    const typename Vec::LaneMask (*keeps)[kLaneMaxGroups], LaneSlots<K>& slots) {
  const int64_t num_groups = kGroups > 0 ? kGroups : num_groups_at_run_time;
  for (int64_t q = 0; q < topk_group; ++q) {
    Vec x_id = Vec::set1(0.0f);  // the group's first expert
    for (int64_t g = 1; g < num_groups; ++g) {
      x_id = Vec::blend(keeps[q][g], Vec::set1(float(g * group_size)), x_id);
    }
    for (int64_t i = 0; i < group_size; ++i) {
      Vec x = Vec::load(b + i * W);
      for (int64_t g = 1; g < num_groups; ++g) {
        x = Vec::blend(keeps[q][g], Vec::load(b + (g * group_size + i) * W), x);
      }
      slots.offer(x, x_id);
      x_id = x_id + Vec::set1(1.0f);
    }
  }
}

// Step 1 for the rows in lanes: a row's scores as score_row computes them, vector i to
// scores + i * vector_stride.
template <ScoringFunc kScore, typename LogitT>
MOEEXT_ALWAYS_INLINE void score_row_strided(const LogitT* logits, int64_t num_experts,
                                            float* scores, int64_t vector_stride) {
  if constexpr (kScore == ScoringFunc::kSoftmax) {
    // AVX-512's registers hold rows of all kLaneMaxExperts; AVX2 scores softmax rows in lanes.
    static_assert(kScore != ScoringFunc::kSoftmax || kMaxSoftmaxVecs * W >= kLaneMaxExperts,
                  "see kSoftmaxInLanes");
    kSoftmaxRows<LogitT>[(num_experts + W - 1) / W - 1](logits, num_experts, scores,
                                                         vector_stride);
  } else {
    for_each_vector(0, num_experts, [&](int64_t e, typename Vec::Mask m) {
      score<kScore>(Vec::load(logits + e, m, 0.0f)).store(scores + e / W * vector_stride);
    });
  }
}

// Softmax rows are scored in lanes on AVX2, the W rows side by side after the tiles'
// transpose. Row by row, each row was one chain of passes joined by horizontal steps (its
// maximum; its sum and one divide), which the next row could not overlap; in lanes the W
// chains run as one. On Zen 3, one thread: DeepSeek-V2 rows 0.86-0.90x the time, E = 60 topk
// 4 0.65x, E = 8 topk 2 0.74x, E = 64 topk 6 0.96x (softmax_lanewise says why the outputs
// stay the row path's). AVX-512, untimed since, keeps the row functions.
template <ScoringFunc kScore>
constexpr bool kSoftmaxInLanes = kRowsInLanes && W < kLaneRows && kScore == ScoringFunc::kSoftmax;

// The softmax of each lane's row, over the logits x at lanes + e * W for e < num_experts, in
// place: s, or b = max(s, -inf) without a bias, as route_lane_block stores them. The
// operations are softmax_in_registers' and score_row's, in their order: lane j of the
// row pass's vector sum adds the exps of experts e = j mod W in index order, as sum[j] does
// here, and reduce_add_lanewise adds those W sums as reduce_add adds a vector's lanes. Only
// the maximum may come out differently, where the row holds a NaN that makes its sum, and
// so every score, NaN on either path. V is Vec, a parameter as in route_lane_block: only the
// layer this runs on (AVX2) has reduce_add_lanewise.
template <typename V, bool kHasBias>
MOEEXT_ALWAYS_INLINE void softmax_lanewise(float* lanes, int64_t num_experts) {
  Vec row_max = Vec::set1(kNegInf);
  for (int64_t e = 0; e < num_experts; ++e) {
    row_max = Vec::max(row_max, Vec::load(lanes + e * W));
  }
  Vec sum[W];
  for (int j = 0; j < W; ++j) sum[j] = Vec::set1(0.0f);
  // Expert e's exp, added to sum[j] (j = e mod W, a constant in the unrolled loops below).
  // Forced inline: as a plain lambda it moved GCC's inlining elsewhere in the AVX2 copy.
  auto add_exp = [&](int64_t e, int j) __attribute__((always_inline)) {
    const Vec ex = vexp_nonpositive(Vec::load(lanes + e * W) - row_max);
    sum[j] = sum[j] + ex;
    ex.store(lanes + e * W);
  };
  int64_t e = 0;
  for (; e + W <= num_experts; e += W) {
#pragma GCC unroll 16
    for (int j = 0; j < W; ++j) add_exp(e + j, j);
  }
#pragma GCC unroll 16
  for (int j = 0; j < W; ++j) {
    if (e + j < num_experts) add_exp(e + j, j);
  }
  const Vec inverse = Vec::set1(1.0f) / V::reduce_add_lanewise(sum);
  for (int64_t e = 0; e < num_experts; ++e) {
    Vec s = Vec::load(lanes + e * W) * inverse;
    if constexpr (!kHasBias) s = Vec::max(s, Vec::set1(kNegInf));  // NaN gives -inf
    s.store(lanes + e * W);
  }
}

// Rows [t0, t0 + W), K = topk. V is Vec, a parameter so that the layer this path does not
// run on (scalar) needs no transpose.
template <ScoringFunc kScore, int K, typename LogitT, typename BiasT, typename V = Vec>
void route_lane_block(const BiasedGroupedTopkParams& p, const BiasT* bias, int64_t t0,
                      const GroupedTopkWorkspace& ws) {
  constexpr bool has_bias = !std::is_same_v<BiasT, no_bias_t>;
  const int64_t num_experts = p.num_experts;
  const int64_t num_groups = p.num_expert_group;
  const int64_t topk_group = p.topk_group;
  const int64_t group_size = num_experts / num_groups;
  const int64_t num_vecs = (num_experts + W - 1) / W;
  const LogitT* logits = static_cast<const LogitT*>(p.gating_output) + t0 * p.gating_row_stride;
  float* const lanes = ws.lane_rows;

  // Step 1: vector i of row r's scores to lanes + (i * W + r) * W, so that each W x W tile,
  // transposed in place, leaves expert e's scores of the W rows at lanes + e * W. Without a
  // bias, b (s with NaN as -inf) takes their place: only the weights need s, and there a NaN
  // score (b = -inf) weighs 0.
  // Softmax rows on AVX2 are scored after the transpose, in lanes.
  constexpr bool scored = !kSoftmaxInLanes<kScore>;
  if constexpr (!scored) {
    for (int64_t r = 0; r < W; ++r) {
      for_each_vector(0, num_experts, [&](int64_t e, typename Vec::Mask m) {
        Vec::load(logits + r * p.gating_row_stride + e, m, kNegInf).store(lanes + (e + r) * W);
      });
    }
  } else {
    for (int64_t r = 0; r < W; ++r) {
      score_row_strided<kScore>(logits + r * p.gating_row_stride, num_experts, lanes + r * W,
                                W * W);
    }
  }
  for (int64_t i = 0; i < num_vecs; ++i) {
    float* const tile = lanes + i * W * W;
    Vec rows[W];
    for (int64_t r = 0; r < W; ++r) rows[r] = Vec::load(tile + r * W);
    V::transpose(rows);
    for (int64_t l = 0; l < W; ++l) {
      if (!has_bias && scored) rows[l] = Vec::max(rows[l], Vec::set1(kNegInf));  // NaN: -inf
      rows[l].store(tile + l * W);
    }
  }
  if constexpr (!scored) softmax_lanewise<V, has_bias>(lanes, num_experts);

  LaneSlots<K> slots;
  if (topk_group == num_groups) {
    // Step 4 over every expert, b = s + bias as store_biased computes it.
    Vec x_id = Vec::set1(0.0f);
    for (int64_t e = 0; e < num_experts; ++e) {
      Vec x = Vec::load(lanes + e * W);
      if constexpr (has_bias) {
        x = Vec::max(x + Vec::set1(bias_at(bias, e)), Vec::set1(kNegInf));
      }
      slots.offer(x, x_id);
      x_id = x_id + Vec::set1(1.0f);
    }
  } else {
    // Steps 2 and 3 (no bias): group maxima; a group is kept where fewer than topk_group
    // groups beat it (ties to the lower group index).
    Vec group_score[kLaneMaxGroups];
    for (int64_t g = 0; g < num_groups; ++g) {
      const float* x = lanes + g * group_size * W;
      Vec m = Vec::load(x);
#pragma GCC unroll 4
      for (int64_t i = 1; i < group_size; ++i) m = Vec::max(m, Vec::load(x + i * W));
      group_score[g] = m;
    }
    // keeps[q][g]: the lanes whose q-th kept group (in group order) is g.
    typename Vec::LaneMask keeps[kLaneMaxGroups][kLaneMaxGroups];
    Vec kept_before = Vec::set1(0.0f);
    for (int64_t g = 0; g < num_groups; ++g) {
      Vec beaten_by = Vec::set1(0.0f);
      for (int64_t h = 0; h < num_groups; ++h) {
        if (h == g) continue;
        beaten_by = Vec::count_true(
            beaten_by, h < g ? Vec::cmp_ge(group_score[h], group_score[g])
                             : Vec::cmp_gt(group_score[h], group_score[g]));
      }
      const auto kept = Vec::cmp_lt(beaten_by, Vec::set1(float(topk_group)));
      for (int64_t q = 0; q < topk_group; ++q) {
        keeps[q][g] = Vec::lane_mask(kept & Vec::cmp_eq(kept_before, Vec::set1(float(q))));
      }
      kept_before = Vec::count_true(kept_before, kept);
    }
    // Step 4: the kept groups hold at least K experts, so every slot fills.
    if (num_groups == 8) {  // DeepSeek-V2 and V3's count: the selects unrolled
      offer_kept_groups<8, K>(lanes, num_groups, group_size, topk_group, keeps, slots);
    } else {
      offer_kept_groups<0, K>(lanes, num_groups, group_size, topk_group, keeps, slots);
    }
  }

  // Steps 6 and 7.
  Vec w[K];
  for (int j = 0; j < K; ++j) {
    if constexpr (has_bias) {
      // Each lane's chosen expert's s, from where step 1 left it.
      alignas(64) float ids[W];
      slots.id[j].store(ids);
      alignas(64) float s[W];
      for (int64_t r = 0; r < W; ++r) s[r] = lanes[int64_t(ids[r]) * W + r];
      w[j] = Vec::load(s);
      w[j] = Vec::select(Vec::is_nan(w[j]), Vec::set1(0.0f), w[j]);
    } else {
      w[j] = Vec::max(slots.v[j], Vec::set1(0.0f));  // b = -inf (a NaN score) weighs 0
    }
  }
  write_lane_outputs<K>(p, t0, K, w, slots.id, Vec::tail_mask(W));
}

template <ScoringFunc kScore, int K, typename LogitT, typename BiasT>
void route_lane_blocks(const BiasedGroupedTopkParams& p, const BiasT* bias, int64_t row_begin,
                       int64_t row_end, const GroupedTopkWorkspace& ws) {
  for (int64_t t = row_begin; t < row_end; t += W) {
    route_lane_block<kScore, K, LogitT, BiasT>(p, bias, t, ws);
  }
}

// The candidate pass with rows in lanes (sqrt-softplus, every group kept, topk <=
// kApproxLaneMaxTopk): W rows at a time. Each row is ranked on b~ as the row pass ranks it
// (approx_score_row, the floor F from its lanes), into lane_rows in the tiled layout of
// route_lane_block, and the experts of b~ >= F - margin in any row are marked. After the
// transpose, only the marked experts are offered to kApproxLaneSlots sorted slots per lane,
// in index order. A lane's slots then hold its candidates whenever the last slot is below
// its topk-th slot by more than the margin: every expert outside the slots is either
// unmarked (b~ < F - margin) or not above the last slot. The slots' experts are scored
// exactly, ranked lane by lane, and the best topk written as write_row_outputs writes them:
// the outputs are the row pass's bit for bit. A row the lanes cannot settle (not covered by
// the pieces, or too close to call within the slots) is routed by the row pass.
// Two slots more than topk: a row then fails to settle only where its topk-th and
// (topk + 2)-th b~ lie within the margin (0.3% of DeepSeek-V4-pro's rows in the benchmark).
constexpr int kApproxLaneSlots = 8;
constexpr int64_t kApproxLaneMaxTopk = kApproxLaneSlots - 2;
static_assert(!kApproxRowsInLanes || kApproxLaneMaxTopk <= kLaneMaxK,
              "the floor comes from the lane maxima");

template <ScoringFunc kScore, typename LogitT, typename BiasT, typename V = Vec>
void route_approx_lane_block(const BiasedGroupedTopkParams& p, const BiasT* bias, int64_t t0,
                             int64_t row_end, float margin, const GroupedTopkWorkspace& ws) {
  constexpr int K = kApproxLaneSlots;
  constexpr bool has_bias = !std::is_same_v<BiasT, no_bias_t>;
  const int64_t num_experts = p.num_experts;
  const int64_t topk = p.topk;
  const int64_t num_vecs = (num_experts + W - 1) / W;
  const ScorePieces& pieces = *ws.score_pieces;
  const LogitT* logits = static_cast<const LogitT*>(p.gating_output) + t0 * p.gating_row_stride;
  float* const lanes = ws.lane_rows;

  // marked[e / 64] bit e % 64: expert e is a candidate of some row.
  uint64_t marked[kApproxLaneMaxExperts / 64] = {};
  static_assert(V::kWidth == 16, "four vectors of 16 lanes to a 64-bit word");
  const int64_t whole_words = num_experts / 64;
  typename Vec::Mask covered = 0;
  for (int64_t r = 0; r < W; ++r) {
    const LogitT* row = logits + r * p.gating_row_stride;
    if (t0 + r + kPrefetchRows < row_end) {
      prefetch_row(row + kPrefetchRows * p.gating_row_stride, num_experts);
    }
    float* approx_b = lanes + r * W;
    LaneTop2 top;
    if (!approx_score_row<1, W * W>(row, bias, num_experts, pieces, approx_b, top)) continue;
    covered |= typename Vec::Mask(1u << r);
    const Vec lower = Vec::set1(floor_from_lanes(top, topk) - margin);
    for (int64_t word = 0; word < whole_words; ++word) {
      marked[word] |= V::cmp_ge_four(approx_b + word * 4 * W * W, W * W, lower);
    }
    for (int64_t i = whole_words * 4; i < num_vecs; ++i) {
      const auto in_range = Vec::tail_mask(num_experts - i * W);
      const auto m = in_range & Vec::cmp_ge(Vec::load(approx_b + i * W * W), lower);
      marked[i / 4] |= uint64_t(m) << (i % 4 * W);
    }
  }
  for (int64_t i = 0; i < num_vecs; ++i) {
    float* const tile = lanes + i * W * W;
    Vec rows[W];
    for (int64_t r = 0; r < W; ++r) rows[r] = Vec::load(tile + r * W);
    V::transpose(rows);
    for (int64_t l = 0; l < W; ++l) rows[l].store(tile + l * W);
  }

  LaneSlots<K> slots;
  for (int64_t word = 0; word * 64 < num_experts; ++word) {
    for (uint64_t bits = marked[word]; bits != 0; bits &= bits - 1) {
      const int64_t e = word * 64 + __builtin_ctzll(bits);
      slots.offer(Vec::load(lanes + e * W), Vec::set1(float(e)));
    }
  }
  const int filled = slots.offered < K ? slots.offered : K;
  // A covered row's topk lane maxima are at or above its floor: marked, so filled >= topk.
  typename Vec::Mask settled = covered;
  if (filled == K) {
    settled &= Vec::cmp_lt(slots.v[K - 1], slots.v[topk - 1] - Vec::set1(margin));
  }

  // The slots' exact scores s and biased scores b, as select_by_approx computes them.
  Vec s[K], b[K];
  {
    alignas(64) float ids[K][W];
    alignas(64) float x[K][W];
    alignas(64) float bias_of[K][W];
    for (int j = 0; j < filled; ++j) {
      slots.id[j].store(ids[j]);
      for (int64_t r = 0; r < W; ++r) {
        const int64_t e = int64_t(ids[j][r]);
        x[j][r] = to_float(logits[r * p.gating_row_stride + e]);
        bias_of[j][r] = bias_at(bias, e);
      }
    }
    for (int j = 0; j < K; ++j) {
      if (j < filled) {
        s[j] = score<kScore>(Vec::load(x[j]));
        b[j] = s[j];
        if constexpr (has_bias) b[j] = s[j] + Vec::load(bias_of[j]);
        b[j] = Vec::max(b[j], Vec::set1(kNegInf));
      } else {
        s[j] = Vec::set1(0.0f);
        b[j] = Vec::set1(kNegInf);
        slots.id[j] = Vec::set1(float(kApproxLaneMaxExperts + j));  // ranks after every expert
      }
    }
  }
  // rank[j]: how many slots beat slot j on b, ties to the lower expert index.
  Vec rank[K];
  for (int j = 0; j < K; ++j) rank[j] = Vec::set1(0.0f);
  for (int i = 0; i < K; ++i) {
    for (int j = i + 1; j < K; ++j) {
      const auto i_beats_j =
          Vec::cmp_gt(b[i], b[j]) |
          (Vec::cmp_eq(b[i], b[j]) & Vec::cmp_lt(slots.id[i], slots.id[j]));
      rank[j] = Vec::count_true(rank[j], i_beats_j);
      rank[i] = Vec::count_true(rank[i], typename Vec::Mask(~i_beats_j));
    }
  }
  // Steps 6 and 7 (the scores of covered rows are finite).
  Vec w[kApproxLaneMaxTopk], id[kApproxLaneMaxTopk];
  for (int64_t j = 0; j < topk; ++j) {
    w[j] = Vec::set1(0.0f);
    id[j] = Vec::set1(0.0f);
    for (int i = 0; i < K; ++i) {
      const auto at = Vec::cmp_eq(rank[i], Vec::set1(float(j)));
      w[j] = Vec::select(at, s[i], w[j]);
      id[j] = Vec::select(at, slots.id[i], id[j]);
    }
  }
  write_lane_outputs<kApproxLaneMaxTopk>(p, t0, topk, w, id, settled);
  for (int64_t r = 0; r < W; ++r) {
    if (!((settled >> r) & 1)) {
      route_rows_by_approx<kScore, LogitT, BiasT>(p, bias, t0 + r, t0 + r + 1, margin, ws);
    }
  }
}

// Whole blocks of rows [row_begin, row_end) in lanes, where the call allows it; returns the
// first row left to route_rows.
template <ScoringFunc kScore, typename LogitT, typename BiasT>
int64_t route_in_lanes(const BiasedGroupedTopkParams& p, const BiasT* bias, int64_t row_begin,
                       int64_t row_end, const GroupedTopkWorkspace& ws) {
  if constexpr (kRowsInLanes && kScore != ScoringFunc::kSqrtSoftplus) {
    constexpr bool has_bias = !std::is_same_v<BiasT, no_bias_t>;
    const bool fits = p.num_experts <= kLaneMaxExperts;
    if (ws.lane_rows == nullptr || !fits || p.gating_col_stride != 1 ||
        p.topk > kLaneMaxTopk || p.num_expert_group > kLaneMaxGroups ||
        (has_bias && p.topk_group != p.num_expert_group)) {
      return row_begin;
    }
    if constexpr (W < kLaneRows) {
      if (p.topk_group == p.num_expert_group &&
          p.num_experts * p.topk > kLaneMaxOffersAllKept) {
        return row_begin;
      }
    }
    const int64_t end = row_begin + (row_end - row_begin) / W * W;
    switch (p.topk) {
      case 1: route_lane_blocks<kScore, 1, LogitT>(p, bias, row_begin, end, ws); break;
      case 2: route_lane_blocks<kScore, 2, LogitT>(p, bias, row_begin, end, ws); break;
      case 3: route_lane_blocks<kScore, 3, LogitT>(p, bias, row_begin, end, ws); break;
      case 4: route_lane_blocks<kScore, 4, LogitT>(p, bias, row_begin, end, ws); break;
      case 5: route_lane_blocks<kScore, 5, LogitT>(p, bias, row_begin, end, ws); break;
      case 6: route_lane_blocks<kScore, 6, LogitT>(p, bias, row_begin, end, ws); break;
      case 7: route_lane_blocks<kScore, 7, LogitT>(p, bias, row_begin, end, ws); break;
      default: route_lane_blocks<kScore, 8, LogitT>(p, bias, row_begin, end, ws); break;
    }
    return end;
  } else {
    return row_begin;
  }
}

// One call's rows: by the candidate pass where it applies (sqrt-softplus, every group kept,
// a floor from the lanes, contiguous logits to read the candidates' from, a finite bias),
// else exactly.
template <ScoringFunc kScore, typename LogitT, typename BiasT>
void route(const BiasedGroupedTopkParams& p, const BiasT* bias, int64_t row_begin,
           int64_t row_end, const GroupedTopkWorkspace& ws) {
  if constexpr (kScore == ScoringFunc::kSqrtSoftplus) {
    if (p.topk_group == p.num_expert_group && p.topk <= 2 * W && p.gating_col_stride == 1 &&
        ws.score_pieces != nullptr) {
      const float margin = approx_margin(bias, p.num_experts);
      if (margin > 0.0f) {
        if constexpr (kApproxRowsInLanes) {
          if (ws.lane_rows != nullptr && p.topk <= kApproxLaneMaxTopk &&
              p.num_experts <= kApproxLaneMaxExperts) {
            for (; row_begin + W <= row_end; row_begin += W) {
              route_approx_lane_block<kScore, LogitT, BiasT>(p, bias, row_begin, row_end, margin,
                                                             ws);
            }
          }
        }
        if (row_begin < row_end) {
          route_rows_by_approx<kScore, LogitT, BiasT>(p, bias, row_begin, row_end, margin, ws);
        }
        return;
      }
    }
  }
  row_begin = route_in_lanes<kScore, LogitT, BiasT>(p, bias, row_begin, row_end, ws);
  if (row_begin < row_end) route_rows<kScore, LogitT, BiasT>(p, bias, row_begin, row_end, ws);
}

template <ScoringFunc kScore, typename LogitT>
void route_rows_for_bias(const BiasedGroupedTopkParams& p, int64_t row_begin, int64_t row_end,
                         const GroupedTopkWorkspace& ws) {
  if (p.correction_bias == nullptr) {
    route<kScore, LogitT, no_bias_t>(p, nullptr, row_begin, row_end, ws);
    return;
  }
  if (p.bias_stride != 1) {
    // A strided bias is widened once per call into the workspace; the rows then read it as
    // contiguous fp32. Contiguous biases are read in their own dtype, row by row.
    for (int64_t e = 0; e < p.num_experts; ++e) {
      const int64_t at = e * p.bias_stride;
      switch (p.bias_dtype) {
        case DType::kFloat32: ws.bias[e] = static_cast<const float*>(p.correction_bias)[at]; break;
        case DType::kBFloat16: ws.bias[e] = to_float(static_cast<const bf16_t*>(p.correction_bias)[at]); break;
        case DType::kFloat16: ws.bias[e] = to_float(static_cast<const fp16_t*>(p.correction_bias)[at]); break;
      }
    }
    route<kScore, LogitT, float>(p, ws.bias, row_begin, row_end, ws);
    return;
  }
  switch (p.bias_dtype) {
    case DType::kFloat32:
      route<kScore, LogitT, float>(p, static_cast<const float*>(p.correction_bias), row_begin,
                                   row_end, ws);
      break;
    case DType::kBFloat16:
      route<kScore, LogitT, bf16_t>(p, static_cast<const bf16_t*>(p.correction_bias),
                                    row_begin, row_end, ws);
      break;
    case DType::kFloat16:
      route<kScore, LogitT, fp16_t>(p, static_cast<const fp16_t*>(p.correction_bias),
                                    row_begin, row_end, ws);
      break;
  }
}

template <ScoringFunc kScore>
void route_rows_for_logits(const BiasedGroupedTopkParams& p, int64_t row_begin,
                           int64_t row_end, const GroupedTopkWorkspace& ws) {
  switch (p.gating_dtype) {
    case DType::kFloat32:
      route_rows_for_bias<kScore, float>(p, row_begin, row_end, ws);
      break;
    case DType::kBFloat16:
      route_rows_for_bias<kScore, bf16_t>(p, row_begin, row_end, ws);
      break;
    case DType::kFloat16:
      route_rows_for_bias<kScore, fp16_t>(p, row_begin, row_end, ws);
      break;
  }
}

}  // namespace

void biased_grouped_topk(const BiasedGroupedTopkParams& p, int64_t row_begin, int64_t row_end,
                         const GroupedTopkWorkspace& ws) {
  switch (p.scoring_func) {
    case ScoringFunc::kSigmoid:
      route_rows_for_logits<ScoringFunc::kSigmoid>(p, row_begin, row_end, ws);
      break;
    case ScoringFunc::kSqrtSoftplus:
      route_rows_for_logits<ScoringFunc::kSqrtSoftplus>(p, row_begin, row_end, ws);
      break;
    case ScoringFunc::kSoftmax:
      route_rows_for_logits<ScoringFunc::kSoftmax>(p, row_begin, row_end, ws);
      break;
  }
}

}  // namespace moeext::cpu::MOEEXT_CPU_ISA
