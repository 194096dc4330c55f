// e8m0_shuffle and e8m0_unshuffle (docs/SPEC.md section 3): checks, launcher params, and the
// CPU and GPU implementations. E8M0 codes are exponents: like integers, the shuffled codes
// carry no gradient, whatever the input's requires_grad (autograd's fallback made them
// require grad, then warned and gave none when a backward reached them).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>

#include "moeext/mxfp4_shuffle.h"
#include "torch/autograd_kernels.h"
#include "torch/binding.h"
#include "torch/check_messages.h"
#include "torch/cpu_memory.h"
#include "torch/parallel.h"

namespace moeext::torch_glue {
namespace {

// ---- Checks ------------------------------------------------------------------------------

const CheckMessage kScaleRank{"e8m0_shuffle.scale_rank",
                              "{op}: scale must be 2-D [m, n], got shape {shape}"};
const CheckMessage kDtype{"e8m0_shuffle.dtype",
                          "{op}: {arg} must be uint8 or float8_e8m0fnu, got {dtype}"};
const CheckMessage kExpertsNeeded{"e8m0_shuffle.num_experts_needed",
                                  "{op}: gate_up=True needs num_experts (>= 1), got {num_experts}"};
const CheckMessage kExpertsSplit{
    "e8m0_shuffle.num_experts_split",
    "{op}: gate_up=True needs the scale rows ({m}) to split into num_experts ({num_experts}) "
    "groups of 2N rows with 2N a multiple of 32"};
const CheckMessage kSizes{"e8m0_shuffle.sizes", "{op}: m and n must be >= 0, got m={m}, n={n}"};
const CheckMessage kPaddedShape{
    "e8m0_shuffle.padded_shape",
    "{op}: shuffled must have the padded shape [{padded_m}, {padded_n}] of a [{m}, {n}] scale, "
    "got {shape}"};
const CheckMessages kMessages{&kScaleRank, &kDtype, &kExpertsNeeded,
                              &kExpertsSplit, &kSizes, &kPaddedShape};

void check_dtype(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.scalar_type() == at::kByte || t.scalar_type() == at::kFloat8_e8m0fnu,
              kDtype({{"op", op}, {"arg", arg}, {"dtype", t.scalar_type()}}));
}

// x >= 0 rounded up to a multiple of to; saturates where that would overflow (an m or n
// given to e8m0_unshuffle near 2^63), which no tensor's extent matches.
int64_t round_up(int64_t x, int64_t to) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  return x > kMax - (to - 1) ? kMax : (x + to - 1) / to * to;
}

// The padded shape and the gate/up grouping of an [m, n] scale.
E8m0ShuffleParams make_params(int64_t m, int64_t n, bool gate_up,
                              std::optional<int64_t> num_experts, const char* op) {
  E8m0ShuffleParams p;
  p.m = m;
  p.n = n;
  p.padded_m = round_up(m, 256);
  p.padded_n = round_up(n, 8);
  if (gate_up) {
    TORCH_CHECK(num_experts.has_value() && *num_experts >= 1,
                kExpertsNeeded({{"op", op}, {"num_experts", num_experts.has_value()
                                                                ? std::to_string(*num_experts)
                                                                : std::string("None")}}));
    TORCH_CHECK(m % *num_experts == 0 && (m / *num_experts) % 32 == 0,
                kExpertsSplit({{"op", op}, {"m", m}, {"num_experts", *num_experts}}));
    p.rows_per_expert = m / *num_experts;
  }
  return p;
}

// ---- Launch, per device ------------------------------------------------------------------

void launch(Cpu, const E8m0ShuffleParams& p, bool inverse, const at::Tensor& /*like*/,
            const char* /*op*/) {
  parallel_for(0, p.padded_m / 32, bytes_grain(32 * p.padded_n), [&](int64_t begin, int64_t end) {
    if (inverse) {
      e8m0_unshuffle_cpu(p, begin, end);
    } else {
      e8m0_shuffle_cpu(p, begin, end);
    }
  });
}

#if defined(MOEEXT_GPU_BACKEND)
void launch(Gpu, const E8m0ShuffleParams& p, bool inverse, const at::Tensor& like,
            const char* op) {
  const c10::DeviceGuard guard(like.device());
  Gpu::check_launch(inverse ? e8m0_unshuffle_gpu(p, Gpu::stream(like))
                            : e8m0_shuffle_gpu(p, Gpu::stream(like)),
                    op);
}
#endif

// ---- The ops -----------------------------------------------------------------------------

template <typename Device>
at::Tensor e8m0_shuffle(const at::Tensor& scale, bool gate_up,
                        std::optional<int64_t> num_experts) {
  constexpr const char* op = "e8m0_shuffle";
  Device::check_device(scale, op, "scale");
  TORCH_CHECK(scale.dim() == 2, kScaleRank({{"op", op}, {"shape", scale.sizes()}}));
  check_dtype(scale, op, "scale");
  E8m0ShuffleParams p = make_params(scale.size(0), scale.size(1), gate_up, num_experts, op);
  p.scale = static_cast<const uint8_t*>(scale.data_ptr());
  p.row_stride = scale.stride(0);
  p.col_stride = scale.stride(1);
  at::Tensor out = Device::empty({p.padded_m, p.padded_n}, scale.scalar_type(), scale);
  if (out.numel() == 0) return out;
  if constexpr (std::is_same_v<Device, Cpu>) advise_huge_pages(out);
  p.shuffled = static_cast<uint8_t*>(out.data_ptr());
  launch(Device{}, p, false, scale, op);
  return out;
}

template <typename Device>
at::Tensor e8m0_unshuffle(const at::Tensor& shuffled, int64_t m, int64_t n, bool gate_up,
                          std::optional<int64_t> num_experts) {
  constexpr const char* op = "e8m0_unshuffle";
  Device::check_device(shuffled, op, "shuffled");
  check_dtype(shuffled, op, "shuffled");
  TORCH_CHECK(m >= 0 && n >= 0, kSizes({{"op", op}, {"m", m}, {"n", n}}));
  E8m0ShuffleParams p = make_params(m, n, gate_up, num_experts, op);
  TORCH_CHECK(shuffled.dim() == 2 && shuffled.size(0) == p.padded_m &&
                  shuffled.size(1) == p.padded_n,
              kPaddedShape({{"op", op}, {"padded_m", p.padded_m}, {"padded_n", p.padded_n},
                            {"m", m}, {"n", n}, {"shape", shuffled.sizes()}}));
  at::Tensor out = Device::empty({m, n}, shuffled.scalar_type(), shuffled);
  if (out.numel() == 0) return out;
  const at::Tensor src = shuffled.contiguous();
  p.shuffled_in = static_cast<const uint8_t*>(src.data_ptr());
  p.unshuffled = static_cast<uint8_t*>(out.data_ptr());
  launch(Device{}, p, true, shuffled, op);
  return out;
}

using ShuffleSignature = decltype(e8m0_shuffle<Cpu>);
using UnshuffleSignature = decltype(e8m0_unshuffle<Cpu>);

const c10::TypedOperatorHandle<ShuffleSignature>& shuffle_handle() {
  static const auto h = typed_op<ShuffleSignature>("moeext::e8m0_shuffle");
  return h;
}

const c10::TypedOperatorHandle<UnshuffleSignature>& unshuffle_handle() {
  static const auto h = typed_op<UnshuffleSignature>("moeext::e8m0_unshuffle");
  return h;
}

}  // namespace

TORCH_LIBRARY_IMPL(moeext, CPU, m) {
  m.impl("e8m0_shuffle", &e8m0_shuffle<Cpu>);
  m.impl("e8m0_unshuffle", &e8m0_unshuffle<Cpu>);
}

#if defined(MOEEXT_GPU_BACKEND)
TORCH_LIBRARY_IMPL(moeext, CUDA, m) {
  m.impl("e8m0_shuffle", &e8m0_shuffle<Gpu>);
  m.impl("e8m0_unshuffle", &e8m0_unshuffle<Gpu>);
}
#endif

TORCH_LIBRARY_IMPL(moeext, Autograd, m) {
  m.impl("e8m0_shuffle", &AutogradKernels<ShuffleSignature>::without_gradient<&shuffle_handle>);
  m.impl("e8m0_unshuffle",
         &AutogradKernels<UnshuffleSignature>::without_gradient<&unshuffle_handle>);
}

}  // namespace moeext::torch_glue
