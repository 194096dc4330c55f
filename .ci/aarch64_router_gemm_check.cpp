// Runs the portable CPU router GEMM (router_gemm_cpu with no x86 path compiled in) over the
// shapes the test suite uses for the tile edges, each input dtype, both output dtypes, strided
// rows and the prepacked weight, and checks every logit against an fp64 product with the
// tolerance of tests/test_router_gemm.py. .ci/aarch64_check.sh runs it on both machines:
// unlike the routing kernel, the GEMM's bits are not the same on both, since aarch64 fuses
// each multiply-add and x86-64 without FMA rounds the product first.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "check_values.h"
#include "cpu/types.h"
#include "moeext/router_gemm.h"

namespace {

using moeext::DType;
using moeext::kRouterPackTile;
using moeext::RouterGemmParams;

using ci_values::bits_to_float;
using ci_values::roughly_normal;
using ci_values::to_bf16;
using ci_values::to_fp16;

// Inputs are held as the fp32 values of the stored elements, and as the stored elements.
struct Matrix {
  int64_t rows, cols, row_stride;
  std::vector<float> value;     // [rows][row_stride]
  std::vector<uint16_t> half;   // the same, as bf16 or fp16 bits
};

Matrix make_matrix(int64_t rows, int64_t cols, int64_t pad, float scale, DType dtype) {
  Matrix m{rows, cols, cols + pad, {}, {}};
  m.value.assign(size_t(rows * m.row_stride), 0.0f);
  m.half.assign(m.value.size(), 0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < m.row_stride; ++c) {
      const size_t i = size_t(r * m.row_stride + c);
      // Padding holds a large value: reading it would show in the logits.
      const float v = c < cols ? scale * roughly_normal() : 1e30f;
      if (dtype == DType::kBFloat16) {
        m.half[i] = to_bf16(v);
        m.value[i] = bits_to_float(uint32_t(m.half[i]) << 16);
      } else if (dtype == DType::kFloat16) {
        m.half[i] = to_fp16(c < cols ? v : 60000.0f);
        m.value[i] = moeext::cpu::to_float(moeext::cpu::fp16_t{m.half[i]});
      } else {
        m.value[i] = v;
      }
    }
  }
  return m;
}

// The layout of moeext.prepack_router_weight (RouterGemmParams::weight_prepacked).
std::vector<uint16_t> prepack(const Matrix& w) {
  const int64_t pairs = (w.cols + 1) / 2;
  std::vector<uint16_t> packed(size_t(pairs * w.rows * 2), 0);
  for (int64_t first = 0; first < w.rows; first += kRouterPackTile) {
    const int64_t width = std::min(kRouterPackTile, w.rows - first);
    for (int64_t e = first; e < first + width; ++e) {
      for (int64_t h = 0; h < w.cols; ++h) {
        packed[size_t(first * pairs * 2 + (h / 2 * width + e - first) * 2 + h % 2)] =
            w.half[size_t(e * w.row_stride + h)];
      }
    }
  }
  return packed;
}

int failures = 0;

void check_case(int64_t tokens, int64_t hidden, int64_t experts, DType dtype, bool bf16_out,
                bool packed) {
  const Matrix x = make_matrix(tokens, hidden, packed ? 0 : tokens % 3, 1.0f, dtype);
  const Matrix w = make_matrix(experts, hidden, packed ? 0 : experts % 2, 0.02f, dtype);
  const std::vector<uint16_t> packed_w = packed ? prepack(w) : std::vector<uint16_t>{};
  const int64_t out_stride = experts + 3;
  const float sentinel = -12345.0f;
  std::vector<float> out_f(size_t(std::max<int64_t>(tokens, 1) * out_stride), sentinel);
  std::vector<uint16_t> out_h(out_f.size(), 0xabcd);

  RouterGemmParams p;
  p.hidden_states = dtype == DType::kFloat32 ? static_cast<const void*>(x.value.data())
                                             : x.half.data();
  p.hidden_row_stride = x.row_stride;
  p.weight = packed                     ? static_cast<const void*>(packed_w.data())
             : dtype == DType::kFloat32 ? static_cast<const void*>(w.value.data())
                                        : w.half.data();
  p.weight_row_stride = packed ? 0 : w.row_stride;
  p.weight_prepacked = packed;
  p.input_dtype = dtype;
  p.logits = bf16_out ? static_cast<void*>(out_h.data()) : out_f.data();
  p.logits_row_stride = out_stride;
  p.logits_dtype = bf16_out ? DType::kBFloat16 : DType::kFloat32;
  p.num_tokens = tokens;
  p.hidden_size = hidden;
  p.num_experts = experts;
  // Two callers' ranges, split where the bindings may split.
  const int64_t block = moeext::router_gemm_expert_block(p);
  const int64_t split = std::min(experts, (experts / 2 + block - 1) / block * block);
  moeext::router_gemm_cpu(p, 0, split);
  moeext::router_gemm_cpu(p, split, experts);

  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c = 0; c < out_stride; ++c) {
      const size_t at = size_t(t * out_stride + c);
      const double got = bf16_out ? double(bits_to_float(uint32_t(out_h[at]) << 16)) : out_f[at];
      if (c >= experts) {
        const bool untouched = bf16_out ? out_h[at] == 0xabcd : out_f[at] == sentinel;
        if (!untouched && ++failures <= 20) {
          std::printf("T %lld H %lld E %lld: column %lld past the experts was written\n",
                      static_cast<long long>(tokens), static_cast<long long>(hidden),
                      static_cast<long long>(experts), static_cast<long long>(c));
        }
        continue;
      }
      double exact = 0.0, magnitude = 0.0;
      for (int64_t h = 0; h < hidden; ++h) {
        const double term = double(x.value[size_t(t * x.row_stride + h)]) *
                            double(w.value[size_t(c * w.row_stride + h)]);
        exact += term;
        magnitude += std::fabs(term);
      }
      double tolerance =
          4 * std::sqrt(double(std::max<int64_t>(hidden, 1))) * std::ldexp(magnitude, -24) +
          1e-30;
      if (bf16_out) {
        int exponent = 0;
        std::frexp(std::max(std::fabs(exact), std::ldexp(1.0, -126)), &exponent);
        tolerance += std::ldexp(1.0, exponent - 9);
      }
      if (!(std::fabs(got - exact) <= tolerance) && ++failures <= 20) {
        std::printf("T %lld H %lld E %lld dtype %d%s%s: logit [%lld][%lld] %.9g, exact %.9g, "
                    "tolerance %.3g\n",
                    static_cast<long long>(tokens), static_cast<long long>(hidden),
                    static_cast<long long>(experts), int(dtype), bf16_out ? " bf16 out" : "",
                    packed ? " prepacked" : "", static_cast<long long>(t),
                    static_cast<long long>(c), got, exact, tolerance);
      }
    }
  }
}

}  // namespace

int main() {
  // (T, H, E) of test_every_cpu_path: tile edges in tokens and experts, every K tail, H = 0
  // and 1; and DeepSeek-V3's gate at decode and past one register tile of tokens.
  const int64_t shapes[][3] = {{1, 1000, 7},  {3, 7168, 9},  {17, 33, 160}, {5, 32, 4},
                               {6, 31, 5},    {2, 1, 3},     {4, 0, 6},     {9, 65, 0},
                               {16, 2048, 13}, {8, 1001, 19}, {47, 999, 21}, {1, 7168, 256},
                               {9, 7168, 40}};
  const DType dtypes[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};
  int cases = 0;
  for (const auto& s : shapes) {
    for (const DType dtype : dtypes) {
      for (const bool bf16_out : {false, true}) {
        check_case(s[0], s[1], s[2], dtype, bf16_out, false);
        ++cases;
      }
    }
  }
  // The prepacked layout (bf16 only): tiles of 64 experts with a narrow last one, an odd H's
  // half pair, passes of 256 pairs past one register tile of tokens, two sweeps of 256 tokens.
  const int64_t packed_shapes[][3] = {{1, 7168, 256}, {4, 7168, 70},  {3, 1000, 160},
                                      {17, 4096, 7},  {5, 1001, 65},  {100, 513, 64},
                                      {9, 1, 3},      {4, 0, 6},      {2, 31, 129},
                                      {300, 66, 70}};
  for (const auto& s : packed_shapes) {
    for (const bool bf16_out : {false, true}) {
      check_case(s[0], s[1], s[2], DType::kBFloat16, bf16_out, true);
      ++cases;
    }
  }
  if (failures != 0) {
    std::printf("portable router_gemm: %d failures\n", failures);
    return 1;
  }
  std::printf("portable router_gemm: %d cases within the fp64 tolerance\n", cases);
  return 0;
}
