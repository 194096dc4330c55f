// Host unit test of csrc/gpu/router_gemm_tiling.h: the token tiles, the params the small-T
// kernel accepts, and the warp reduce-scatter's lane -> value map, checked by simulating the
// butterfly lane by lane with the same keep/send rule the kernel uses.
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "check.h"
#include "gpu/router_gemm_tiling.h"

namespace gpu = moeext::gpu;
using moeext::DType;
using moeext::RouterGemmParams;

namespace {


void test_token_tiles() {
  for (int64_t t = -2; t <= 40; ++t) {
    int want = 0;
    if (t >= 1 && t <= 16) {
      want = 1;
      while (want < t) want *= 2;
    }
    CHECK(gpu::router_gemm_token_tile(t) == want, "token_tile(%lld) = %d, want %d",
          static_cast<long long>(t), gpu::router_gemm_token_tile(t), want);
  }
  for (int shape : {0, 2, 3}) {
    for (int tile : {1, 2, 4, 8, 16}) {
      const int experts = gpu::router_gemm_experts_per_block(tile, shape);
      const int values = tile * experts;
      // The kernel's butterfly needs a power of two, one summing thread per value (256), and
      // keeps 4 weight chunks in flight per thread.
      CHECK(values >= 1 && (values & (values - 1)) == 0 && values <= 256,
            "tile %d shape %d: %d values", tile, shape, values);
      CHECK(gpu::router_gemm_unroll(tile, shape) * experts == 4,
            "tile %d shape %d: unroll %d x experts %d", tile, shape,
            gpu::router_gemm_unroll(tile, shape), experts);
      const int min_blocks = gpu::router_gemm_min_blocks_per_sm(tile, shape);
      CHECK(min_blocks >= 1 && min_blocks <= 3, "tile %d shape %d: min blocks %d", tile, shape,
            min_blocks);
      // Variants 2 and 3 change the 4-token tile only, each one thing of it.
      const bool changed = experts != gpu::router_gemm_experts_per_block(tile) ||
                           min_blocks != gpu::router_gemm_min_blocks_per_sm(tile);
      CHECK(changed == (shape != 0 && tile == 4), "tile %d shape %d changed: %d", tile, shape,
            int(changed));
    }
  }
  CHECK(gpu::router_gemm_min_blocks_per_sm(4, 2) == 3 &&
            gpu::router_gemm_experts_per_block(4, 2) == 1,
        "shape 2: one expert, three blocks a multiprocessor");
  CHECK(gpu::router_gemm_min_blocks_per_sm(4, 3) == 2 &&
            gpu::router_gemm_experts_per_block(4, 3) == 2,
        "shape 3: two experts, two blocks a multiprocessor");
}

void test_small_t_pays() {
  // Up to 8 tokens the kernel always pays; the 16-token instance (two experts a block, one
  // block an SM) only while its blocks fit one wave.
  for (int64_t t = 1; t <= 8; ++t) {
    CHECK(gpu::router_gemm_small_t_pays(t, 384, 132), "T %lld, E 384", static_cast<long long>(t));
    CHECK(gpu::router_gemm_small_t_pays(t, 4096, 8), "T %lld, E 4096", static_cast<long long>(t));
  }
  for (int64_t t = 9; t <= 16; ++t) {
    CHECK(gpu::router_gemm_small_t_pays(t, 256, 132), "T %lld, E 256", static_cast<long long>(t));
    CHECK(gpu::router_gemm_small_t_pays(t, 264, 132), "T %lld, E 264", static_cast<long long>(t));
    CHECK(!gpu::router_gemm_small_t_pays(t, 265, 132), "T %lld, E 265", static_cast<long long>(t));
    CHECK(!gpu::router_gemm_small_t_pays(t, 384, 132), "T %lld, E 384", static_cast<long long>(t));
    CHECK(!gpu::router_gemm_small_t_pays(t, 256, 108), "T %lld, E 256 on 108 SMs",
          static_cast<long long>(t));
  }
  CHECK(gpu::router_gemm_blocks(1, 7) == 7 && gpu::router_gemm_blocks(16, 7) == 4,
        "blocks of E = 7");
  CHECK(gpu::router_gemm_blocks(4, 385) == 385 && gpu::router_gemm_blocks(4, 385, 2) == 385 &&
            gpu::router_gemm_blocks(4, 385, 3) == 193 && gpu::router_gemm_blocks(2, 385, 3) == 385,
        "blocks of E = 385 at 4 tokens in each shape");
}

const void* fake_ptr(uintptr_t address) { return reinterpret_cast<const void*>(address); }

RouterGemmParams good_params() {
  RouterGemmParams p;
  p.hidden_states = fake_ptr(0x10000);
  p.hidden_row_stride = 7168;
  p.weight = fake_ptr(0x200000);
  p.weight_row_stride = 7168;
  p.input_dtype = DType::kBFloat16;
  p.logits = const_cast<void*>(fake_ptr(0x400000));
  p.logits_row_stride = 256;
  p.logits_dtype = DType::kFloat32;
  p.num_tokens = 4;
  p.hidden_size = 7168;
  p.num_experts = 256;
  return p;
}

void test_supported() {
  CHECK(gpu::router_gemm_small_t_supported(good_params()), "DeepSeek-V3 decode shape");
  {
    RouterGemmParams p = good_params();
    p.logits_dtype = DType::kBFloat16;
    CHECK(gpu::router_gemm_small_t_supported(p), "bf16 logits");
    p.logits_dtype = DType::kFloat16;
    CHECK(!gpu::router_gemm_small_t_supported(p), "fp16 logits are not an output dtype");
  }
  for (int64_t t : {0, 17, 100}) {
    RouterGemmParams p = good_params();
    p.num_tokens = t;
    CHECK(!gpu::router_gemm_small_t_supported(p), "num_tokens %lld", static_cast<long long>(t));
  }
  for (int64_t t = 1; t <= 16; ++t) {
    RouterGemmParams p = good_params();
    p.num_tokens = t;
    CHECK(gpu::router_gemm_small_t_supported(p), "num_tokens %lld", static_cast<long long>(t));
  }
  {
    RouterGemmParams p = good_params();
    p.hidden_size = p.hidden_row_stride = p.weight_row_stride = 7164;
    CHECK(!gpu::router_gemm_small_t_supported(p), "hidden_size not a multiple of 8");
  }
  {
    RouterGemmParams p = good_params();
    p.hidden_states = fake_ptr(0x10008);
    CHECK(!gpu::router_gemm_small_t_supported(p), "hidden_states 8-byte aligned only");
  }
  {
    RouterGemmParams p = good_params();
    p.weight = fake_ptr(0x200002);
    CHECK(!gpu::router_gemm_small_t_supported(p), "weight 2-byte aligned only");
  }
  {
    RouterGemmParams p = good_params();
    p.hidden_row_stride = 7172;  // 14344 bytes: rows after the first are 8-byte aligned
    CHECK(!gpu::router_gemm_small_t_supported(p), "hidden row stride not 16 bytes");
    p.num_tokens = 1;
    CHECK(gpu::router_gemm_small_t_supported(p), "the stride of a single row is unused");
  }
  {
    RouterGemmParams p = good_params();
    p.weight_row_stride = 7172;
    CHECK(!gpu::router_gemm_small_t_supported(p), "weight row stride not 16 bytes");
    p.num_experts = 1;
    CHECK(gpu::router_gemm_small_t_supported(p), "the stride of a single expert is unused");
  }
  {
    RouterGemmParams p = good_params();
    p.input_dtype = DType::kFloat32;
    p.hidden_size = 4104;
    p.hidden_row_stride = p.weight_row_stride = 4108;  // 16432 bytes
    CHECK(gpu::router_gemm_small_t_supported(p), "fp32 with 16-byte strides");
    p.hidden_row_stride = 4106;
    CHECK(!gpu::router_gemm_small_t_supported(p), "fp32 with an 8-byte stride");
  }
  {
    RouterGemmParams p = good_params();
    p.hidden_row_stride = int64_t(1) << 33;  // 32-bit chunk offsets would overflow
    CHECK(!gpu::router_gemm_small_t_supported(p), "hidden rows 16 GiB apart");
  }
  {
    RouterGemmParams p = good_params();
    p.hidden_size = 0;
    p.hidden_states = p.weight = nullptr;
    CHECK(gpu::router_gemm_small_t_supported(p), "hidden_size 0 gives zero logits");
  }
}

// Simulates warp_reduce_scatter of router_gemm.cu on `warp` lanes holding `values` values
// each, and checks that value j of lane l ends up as the sum, over lanes, of value
// reduced_value_index(l, j) — the map the kernel stores to shared memory by.
void test_reduce_scatter(int warp, int values, std::mt19937& rng) {
  std::uniform_int_distribution<int> small(-1000, 1000);
  std::vector<std::vector<double>> v(warp, std::vector<double>(values));
  for (auto& lane : v) {
    for (double& x : lane) x = small(rng);  // integers: every sum is exact
  }
  const std::vector<std::vector<double>> original = v;
  int held = values;
  for (int mask = warp / 2; mask >= 1; mask /= 2) {
    if (held == 1) {
      std::vector<std::vector<double>> next = v;
      for (int lane = 0; lane < warp; ++lane) next[lane][0] = v[lane][0] + v[lane ^ mask][0];
      v = next;
      continue;
    }
    const int half = held / 2;
    std::vector<std::vector<double>> next(warp, std::vector<double>(half));
    for (int lane = 0; lane < warp; ++lane) {
      const int partner = lane ^ mask;
      const bool upper = gpu::butterfly_keeps_upper(lane, mask);
      const bool partner_upper = gpu::butterfly_keeps_upper(partner, mask);
      for (int j = 0; j < half; ++j) {
        const double keep = upper ? v[lane][j + half] : v[lane][j];
        const double received = partner_upper ? v[partner][j] : v[partner][j + half];
        next[lane][j] = keep + received;
      }
    }
    v = next;
    held = half;
  }
  const int per_lane = gpu::reduced_values_per_lane(values, warp);
  CHECK(held == per_lane, "warp %d, %d values: %d left per lane, map says %d", warp, values,
        held, per_lane);
  std::vector<int> stored(values, 0);
  const int lanes_per_value = values >= warp ? 1 : warp / values;
  for (int lane = 0; lane < warp; ++lane) {
    for (int j = 0; j < held; ++j) {
      const int index = gpu::reduced_value_index(lane, j, values, warp);
      if (index < 0 || index >= values) {
        CHECK(false, "warp %d, %d values: lane %d value %d maps to %d", warp, values, lane, j,
              index);
        continue;
      }
      double want = 0;
      for (int l = 0; l < warp; ++l) want += original[l][index];
      CHECK(v[lane][j] == want, "warp %d, %d values: lane %d value %d (index %d) = %g, want %g",
            warp, values, lane, j, index, v[lane][j], want);
      if (lane % lanes_per_value == 0) ++stored[index];
    }
  }
  for (int index = 0; index < values; ++index) {
    CHECK(stored[index] == 1, "warp %d, %d values: index %d stored %d times", warp, values,
          index, stored[index]);
  }
}

}  // namespace

int main() {
  test_token_tiles();
  test_supported();
  test_small_t_pays();
  std::mt19937 rng(7);
  for (int warp : {32, 64}) {
    for (int values = 1; values <= 4 * warp; values *= 2) test_reduce_scatter(warp, values, rng);
  }
  return moeext_test::finish("router_gemm tiling");
}
