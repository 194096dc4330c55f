// Steps 2 to 4 of the CPU routing kernel on a scored row: the group scores and the kept
// groups, a floor under the topk-th value, the candidates at or above it, and their ranking.
// Part of cpu/grouped_topk.cpp's translation unit, compiled once per ISA (see there).
#pragma once

#include <cstdint>
#include <limits>

#include "cpu/grouped_topk_score.h"
#include "host_device/routing.h"

namespace moeext::cpu::MOEEXT_CPU_ISA {
namespace {

// Keys and group scores as the GPU kernels form them. Every value keyed here (b, group
// scores) is NaN-free, so the keys skip the NaN test.
using host_device::group_score;
using host_device::key_index;
using host_device::make_key_nan_free;
using host_device::Top2Of;

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
  // chosen at compile time, not by a positional test per vector.
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
// (4 to 8 on the 8-lane layers, 4 on AVX-512): padded to the most, rows of a few dozen
// candidates would rank up to twice the lanes they hold.
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
        // Not top2_push: x must be min's and max's second operand, the one x86 reads from memory.
        s = Vec::max(s, Vec::min(f, x));
        f = Vec::max(f, x);
      }
    }
    first[i] = f;
    second[i] = s;
  }
  Vec::reduce_groups_top2<kGroups>(first, second);
  return {group_score(Top2Of<Vec>{first[0], second[0]}, kTop2, group_size), second[0]};
}

// With groups and k <= 2 * topk_group, the groups' top-2 give a floor without reading b again
// or sorting: the kept groups' largest and second largest b are 2 * topk_group distinct
// experts, all at or above the least of the seconds. On DeepSeek-V3 it is as tight as the
// lanes' floor.
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
// divide, on every row's critical path. There, one range per kept group: the loops over the
// ranges run a fixed number of times with fixed trip counts, where merging neighbours made
// both depend on the row and mispredict. Past W groups, which may hold one expert each,
// neighbours are merged.
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
    topk_insert(ws.group_keys, count, topk_group,
                make_key_nan_free(ws.group_scores[g], uint32_t(g)));
  }
  const uint64_t last_kept = ws.group_keys[topk_group - 1];
  for (int64_t g = 0; g < num_groups; ++g) {
    if (make_key_nan_free(ws.group_scores[g], uint32_t(g)) < last_kept) continue;
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
// too many candidates already at k = 6 and 8, so there only up to k = 4.
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
// it, routers that choose more experts than twice the lanes (Nemotron-style topk 22 on 8
// lanes) make every expert a candidate.
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
  // marking pass below costs more than it saves, for DeepSeek-V4-flash's 16 it saves more.
  constexpr int64_t kShortRange = 12 * W;
  if (num_ranges > 1 || ranges[0].end - ranges[0].begin <= kShortRange) {
    // The kept groups' ranges are short: a compress per vector, no branch on the data.
    // Whole vectors, then the range's tail: no mask to compute in the loop. (The load, pack
    // and count check are written out at each of their four places: through one lambda, GCC
    // compiled these loops slower.)
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
  // With k > W there are more than W candidates: no use packing the first W in a register.
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
        const float kth = b[int64_t(key_index(keys[k - 1]))];
        bound = kth > bound ? kth : bound;
      }
      auto m = Vec::tail_mask(ranges[r].end - e) & Vec::cmp_ge(x, Vec::set1(bound));
      for (uint32_t bits = m; bits != 0; bits &= bits - 1) {
        const int64_t expert = e + __builtin_ctz(bits);
        topk_insert(keys, held, k, make_key_nan_free(b[expert], uint32_t(expert)));
      }
    }
  }
  for (int64_t j = 0; j < k; ++j) ws.chosen[j] = int32_t(key_index(keys[j]));
}

}  // namespace
}  // namespace moeext::cpu::MOEEXT_CPU_ISA
