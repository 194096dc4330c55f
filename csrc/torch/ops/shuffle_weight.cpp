// shuffle_weight and unshuffle_weight (docs/SPEC.md section 3): checks, launcher params, the
// CPU and GPU implementations, and autograd.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "moeext/mxfp4_shuffle.h"
#include "torch/binding.h"
#include "torch/check_messages.h"
#include "torch/cpu_memory.h"
#include "torch/parallel.h"

namespace moeext::torch_glue {
namespace {

// ---- Checks ------------------------------------------------------------------------------

static_assert(kMaxShuffleBand == 256, "kBandRange says 256");
const CheckMessage kRank{"shuffle_weight.rank",
                         "{op}: w must be at least 2-D [..., N, K], got shape {shape}"};
const CheckMessage kDtype{
    "shuffle_weight.dtype",
    "{op}: w must have a 1- or 2-byte dtype (uint8, int8, fp8, float4_e2m1fn_x2, bfloat16, "
    "float16), got {dtype}"};
const CheckMessage kLayoutPair{"shuffle_weight.layout_pair",
                               "{op}: layout must be (IN, IK), got {layout}"};
const CheckMessage kBandRange{"shuffle_weight.band_range",
                              "{op}: layout[0] (rows per band) must be in [1, 256], got {band}"};
const CheckMessage kChunkMultiple{
    "shuffle_weight.chunk_multiple",
    "{op}: layout[1] ({ik}) must make 2 * layout[1] a multiple of {chunk} elements (16 bytes "
    "of {dtype})"};
const CheckMessage kRowsMultiple{"shuffle_weight.rows_multiple",
                                 "{op}: N ({rows}) must be a multiple of layout[0] ({band})"};
const CheckMessage kColumnsMultiple{"shuffle_weight.columns_multiple",
                                    "{op}: K ({k}) must be a multiple of 2 * layout[1] (2 x {ik})"};
const CheckMessage kGateUpRank{
    "shuffle_weight.gate_up_rank",
    "{op}: gate_up=True needs a 3-D fused weight [E, 2N, K], got shape {shape}"};
const CheckMessage kGateUpRows{
    "shuffle_weight.gate_up_rows",
    "{op}: gate_up=True needs 2N ({rows}) to be a multiple of 32 (16-row gate/up blocks)"};
const CheckMessages kMessages{&kRank,          &kDtype,           &kLayoutPair,
                              &kBandRange,     &kChunkMultiple,   &kRowsMultiple,
                              &kColumnsMultiple, &kGateUpRank,    &kGateUpRows};

// The one stride, in elements, that steps through t's leading dims [..., N, K] flattened to
// [B, N, K], or none where no single stride does. Dims of size 1 are passed over: torch leaves
// their strides arbitrary and counts a tensor contiguous whatever they are, so its contiguous()
// returns such a view as it is, and reading the batch stride off dim -3 stepped out of the
// tensor's memory for [2, 1, N, K] views of a [1, 2, N, K] tensor.
std::optional<int64_t> flat_batch_stride(const at::Tensor& t) {
  std::optional<int64_t> stride;  // of the innermost leading dim of size > 1
  int64_t outer = 0;              // the stride the next such dim out must have
  for (int64_t d = t.dim() - 3; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (stride && t.stride(d) != outer) return std::nullopt;
    if (!stride) stride = t.stride(d);
    outer = t.stride(d) * t.size(d);
  }
  return stride.value_or(0);  // one batch at most: its stride is never used
}

// Checks w and describes it as [batch, rows, row_bytes] with `logical` as the logical side
// (its strides) and `shuffled` as the dense side.
ShuffleWeightParams make_params(const at::Tensor& logical, void* shuffled,
                                at::IntArrayRef layout, bool gate_up, const char* op) {
  TORCH_CHECK(logical.dim() >= 2, kRank({{"op", op}, {"shape", logical.sizes()}}));
  const int64_t element = logical.element_size();
  TORCH_CHECK((element == 1 || element == 2) && !logical.is_complex(),
              kDtype({{"op", op}, {"dtype", logical.scalar_type()}}));
  TORCH_CHECK(layout.size() == 2, kLayoutPair({{"op", op}, {"layout", layout}}));
  const int64_t band = layout[0], ik = layout[1];
  const int64_t chunk = 16 / element;  // elements in a 16-byte chunk
  TORCH_CHECK(band >= 1 && band <= kMaxShuffleBand, kBandRange({{"op", op}, {"band", band}}));
  // 2 * ik is never formed: a layout[1] near 2^63 would wrap it into a divisor of K.
  TORCH_CHECK(ik >= 1 && ik % (chunk / 2) == 0,
              kChunkMultiple({{"op", op}, {"ik", ik}, {"chunk", chunk},
                              {"dtype", logical.scalar_type()}}));
  const int64_t rows = logical.size(-2), k = logical.size(-1);
  TORCH_CHECK(rows % band == 0, kRowsMultiple({{"op", op}, {"rows", rows}, {"band", band}}));
  TORCH_CHECK(k % ik == 0 && (k / ik) % 2 == 0,
              kColumnsMultiple({{"op", op}, {"k", k}, {"ik", ik}}));
  if (gate_up) {
    TORCH_CHECK(logical.dim() == 3, kGateUpRank({{"op", op}, {"shape", logical.sizes()}}));
    TORCH_CHECK(rows % 32 == 0, kGateUpRows({{"op", op}, {"rows", rows}}));
  }
  // An empty w reads nothing, and torch's contiguous() returns empty views as they are.
  TORCH_CHECK(logical.stride(-1) == 1 || logical.numel() == 0, op,
              ": w must have a contiguous last dimension (stride 1), got strides ",
              logical.strides());
  // source()'s tensor or a new one: one batch stride, unless w is empty.
  const std::optional<int64_t> batch_stride = flat_batch_stride(logical);
  TORCH_INTERNAL_ASSERT(batch_stride.has_value() || logical.numel() == 0);
  ShuffleWeightParams p;
  p.logical = logical.data_ptr();
  p.shuffled = shuffled;
  p.rows = rows;
  p.row_bytes = k * element;
  p.band = band;
  p.gate_up = gate_up;
  p.logical_row_stride = logical.stride(-2) * element;
  p.batch = 1;
  for (int64_t d = 0; d + 2 < logical.dim(); ++d) p.batch *= logical.size(d);
  p.logical_batch_stride = batch_stride.value_or(0) * element;
  return p;
}

// The tensor shuffle_weight reads: w itself when the kernels take its strides (rows dense,
// leading dims flattening into one batch stride), else a dense copy.
at::Tensor source(const at::Tensor& w) {
  return w.dim() >= 2 && w.stride(-1) == 1 && flat_batch_stride(w) ? w : w.contiguous();
}

// ---- Launch, per device ------------------------------------------------------------------

// The shuffles stream at memory speed; ~1 MiB per task amortises a thread wake-up.
void launch(Cpu, const ShuffleWeightParams& p, bool inverse, const at::Tensor& /*w*/,
            const char* /*op*/) {
  const int64_t grain = bytes_grain(p.band * p.row_bytes);
  parallel_for(0, p.batch * p.rows / p.band, grain, [&](int64_t begin, int64_t end) {
    if (inverse) {
      unshuffle_weight_cpu(p, begin, end);
    } else {
      shuffle_weight_cpu(p, begin, end);
    }
  });
}

#if defined(MOEEXT_GPU_BACKEND)
void launch(Gpu, const ShuffleWeightParams& p, bool inverse, const at::Tensor& w,
            const char* op) {
  if (p.batch * p.rows * p.row_bytes == 0) return;
  const c10::DeviceGuard guard(w.device());
  Gpu::check_launch(inverse ? unshuffle_weight_gpu(p, Gpu::stream(w))
                            : shuffle_weight_gpu(p, Gpu::stream(w)),
                    op);
}
#endif

// ---- The ops -----------------------------------------------------------------------------

template <typename Device, bool kInverse>
at::Tensor shuffle(const at::Tensor& w, at::IntArrayRef layout, bool gate_up) {
  const char* op = kInverse ? "unshuffle_weight" : "shuffle_weight";
  Device::check_device(w, op, "w");
  at::Tensor out = Device::empty(w.sizes(), w.scalar_type(), w);
  if constexpr (std::is_same_v<Device, Cpu>) advise_huge_pages(out);
  if (!kInverse) {
    const at::Tensor src = source(w);
    launch(Device{}, make_params(src, out.data_ptr(), layout, gate_up, op), false, w, op);
  } else {
    // The shuffled layout is defined on dense memory: read a dense copy if w is a view.
    const at::Tensor src = w.contiguous();
    launch(Device{}, make_params(out, const_cast<void*>(src.data_ptr()), layout, gate_up, op),
           true, w, op);
  }
  return out;
}

using Signature = decltype(shuffle<Cpu, false>);

// shuffle_weight, or unshuffle_weight when `inverse`.
const c10::TypedOperatorHandle<Signature>& handle(bool inverse) {
  static const auto shuffle = typed_op<Signature>("moeext::shuffle_weight");
  static const auto unshuffle = typed_op<Signature>("moeext::unshuffle_weight");
  return inverse ? unshuffle : shuffle;
}

// ---- Autograd ----------------------------------------------------------------------------
// A shuffle moves elements and nothing else, so its gradient is the inverse move of the
// incoming one: unshuffle_weight for shuffle_weight and the other way round.

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct ShuffleFunction : public torch::autograd::Function<ShuffleFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& w,
                               const std::vector<int64_t>& layout, bool gate_up, bool inverse) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->saved_data["layout"] = layout;
    ctx->saved_data["gate_up"] = gate_up;
    ctx->saved_data["inverse"] = inverse;
    return {handle(inverse).call(w, layout, gate_up)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor& grad = grad_outputs[0];
    at::Tensor grad_w;
    if (grad.defined()) {
      const std::vector<int64_t> layout = ctx->saved_data["layout"].toIntVector();
      grad_w = handle(!ctx->saved_data["inverse"].toBool())
                   .call(grad, layout, ctx->saved_data["gate_up"].toBool());
    }
    return {grad_w, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

template <bool kInverse>
at::Tensor shuffle_autograd(c10::DispatchKeySet keys, const at::Tensor& w,
                            at::IntArrayRef layout, bool gate_up) {
  if (!at::GradMode::is_enabled() || !w.requires_grad()) {
    return handle(kInverse).redispatch(keys & c10::after_autograd_keyset, w, layout, gate_up);
  }
  return ShuffleFunction::apply(w, layout.vec(), gate_up, kInverse)[0];
}

}  // namespace

TORCH_LIBRARY_IMPL(moeext, CPU, m) {
  m.impl("shuffle_weight", &shuffle<Cpu, false>);
  m.impl("unshuffle_weight", &shuffle<Cpu, true>);
}

#if defined(MOEEXT_GPU_BACKEND)
TORCH_LIBRARY_IMPL(moeext, CUDA, m) {
  m.impl("shuffle_weight", &shuffle<Gpu, false>);
  m.impl("unshuffle_weight", &shuffle<Gpu, true>);
}
#endif

TORCH_LIBRARY_IMPL(moeext, Autograd, m) {
  m.impl("shuffle_weight", &shuffle_autograd<false>);
  m.impl("unshuffle_weight", &shuffle_autograd<true>);
}

}  // namespace moeext::torch_glue
