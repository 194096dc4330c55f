// zero_tail_ and zero_tail_tracked_ (docs/SPEC.md section 4): checks, launcher params, the CPU
// and GPU implementations, autograd, and the direct calls of the Python wrappers.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "moeext/zero_tail.h"
#include "torch/autograd_kernels.h"
#include "torch/binding.h"
#include "torch/check_messages.h"
#include "torch/cpu_memory.h"
#include "torch/direct_call.h"
#include "torch/memory_overlap.h"
#include "torch/parallel.h"

namespace moeext::torch_glue {
namespace {

// ---- Checks ------------------------------------------------------------------------------

const CheckMessage kExtent{"zero_tail.extent", "{op}: {arg} must be >= 0, got {value}"};
const CheckMessage kBufRank{"zero_tail.buf_rank",
                            "{op}: buf must have at least one dimension, got a 0-d tensor"};
const CheckMessage kState{
    "zero_tail.state",
    "{op}: state must hold one int64 (the previous extent), got {dtype} with {numel} elements"};
const CheckMessages kMessages{&kExtent, &kBufRank, &kState};

void check_extent(int64_t value, const char* arg, const char* op) {
  TORCH_CHECK(value >= 0, kExtent({{"op", op}, {"arg", arg}, {"value", value}}));
}

// Checks buf (rows along dim 0 must each be one contiguous byte range, no two sharing memory),
// the extents and, for the tracked form, that state lies outside buf; describes rows
// [new_extent, min(prev_extent, buf.size(0))) for zeroing.
ZeroRowsParams make_params(const at::Tensor& buf, int64_t new_extent, int64_t prev_extent,
                           const char* op, const at::Tensor* state = nullptr) {
  check_extent(new_extent, "new_extent", op);
  check_extent(prev_extent, "prev_extent", op);
  TORCH_CHECK(buf.dim() >= 1, kBufRank({{"op", op}}));
  // Rows (everything past dim 0) must be dense so a row is one byte range.
  int64_t expected = 1;
  for (int64_t d = buf.dim() - 1; d >= 1; --d) {
    TORCH_CHECK(buf.size(d) == 1 || buf.stride(d) == expected, op,
                ": buf must have contiguous rows (any stride along dim 0), got sizes ",
                buf.sizes(), " and strides ", buf.strides());
    expected *= buf.size(d);
  }
  const int64_t rows = buf.size(0);
  const int64_t row_bytes = expected * int64_t(buf.element_size());
  const RowBytes buf_rows = rows_of(buf.data_ptr(), rows, buf.stride(0) * buf.element_size(),
                                    row_bytes, 1, 1);
  TORCH_CHECK(!rows_overlap_each_other(buf_rows), op,
              ": buf has rows that share memory (stride(0) ", buf.stride(0), " < ", expected,
              " elements per row); zeroing one row would zero others");
  if (state != nullptr) {
    TORCH_CHECK(!rows_overlap(buf_rows, rows_of(state->data_ptr(), 1, 1, 1, 1, 8)), op,
                ": state shares memory with buf; it must be a tensor of its own");
  }
  ZeroRowsParams p;
  p.data = buf.data_ptr();
  p.row_bytes = row_bytes;
  p.row_stride = buf.stride(0) * int64_t(buf.element_size());
  p.row_begin = std::min(new_extent, rows);
  p.row_end = std::min(prev_extent, rows);
  return p;
}

// The tracked form's state: one int64 element on buf's device.
void check_state(const at::Tensor& buf, const at::Tensor& state, const char* op) {
  TORCH_CHECK(state.scalar_type() == at::kLong && state.numel() == 1,
              kState({{"op", op}, {"dtype", state.scalar_type()}, {"numel", state.numel()}}));
  check_same_device(state, "state", buf, "buf", op);
}

// ---- Launch, per device ------------------------------------------------------------------

void zero_rows(Cpu, const ZeroRowsParams& p, const at::Tensor& /*buf*/, const char* /*op*/) {
  parallel_for(p.row_begin, p.row_end, bytes_grain(p.row_bytes),
               [&](int64_t begin, int64_t end) { zero_rows_cpu(p, begin, end); });
}

// The previous extent is read on the host, where the state lives.
void zero_tracked(Cpu, const at::Tensor& buf, const at::Tensor& state, int64_t new_extent,
                  const char* op) {
  int64_t* stored = state.data_ptr<int64_t>();
  // A negative stored extent cannot be rejected on a device without a host sync, so every
  // backend reads it as 0.
  const int64_t prev_extent = std::max<int64_t>(0, *stored);
  zero_rows(Cpu{}, make_params(buf, new_extent, prev_extent, op, &state), buf, op);
  *stored = new_extent;
}

#if defined(MOEEXT_GPU_BACKEND)
void zero_rows(Gpu, const ZeroRowsParams& p, const at::Tensor& buf, const char* op) {
  if (p.row_end <= p.row_begin || p.row_bytes == 0) return;
  const c10::DeviceGuard guard(buf.device());
  Gpu::check_launch(zero_rows_gpu(p, Gpu::stream(buf)), op);
}

// The previous extent lives on the device and the kernel reads it, so the host describes the
// largest tail it could be: [new_extent, rows).
void zero_tracked(Gpu, const at::Tensor& buf, const at::Tensor& state, int64_t new_extent,
                  const char* op) {
  const ZeroRowsParams p = make_params(buf, new_extent, buf.size(0), op, &state);
  const c10::DeviceGuard guard(buf.device());
  Gpu::check_launch(
      zero_rows_tracked_gpu(p, state.data_ptr<int64_t>(), new_extent, Gpu::stream(buf)), op);
}
#endif

// ---- The ops -----------------------------------------------------------------------------

// SymInt extents: an extent is usually a batch size, which torch.compile keeps symbolic.
template <typename Device>
void zero_tail(const at::Tensor& buf, c10::SymInt new_extent, c10::SymInt prev_extent) {
  constexpr const char* op = "zero_tail_";
  Device::check_device(buf, op, "buf");
  zero_rows(Device{}, make_params(buf, new_extent.expect_int(), prev_extent.expect_int(), op),
            buf, op);
}

template <typename Device>
void zero_tail_tracked(const at::Tensor& buf, const at::Tensor& state, c10::SymInt new_extent) {
  constexpr const char* op = "zero_tail_tracked_";
  Device::check_device(buf, op, "buf");
  check_state(buf, state, op);
  const int64_t extent = new_extent.expect_int();
  check_extent(extent, "new_extent", op);
  zero_tracked(Device{}, buf, state, extent, op);
}

using Signature = decltype(zero_tail<Cpu>);
using TrackedSignature = decltype(zero_tail_tracked<Cpu>);

const c10::TypedOperatorHandle<Signature>& handle() {
  static const auto h = typed_op<Signature>("moeext::zero_tail_");
  return h;
}

const c10::TypedOperatorHandle<TrackedSignature>& tracked_handle() {
  static const auto h = typed_op<TrackedSignature>("moeext::zero_tail_tracked_");
  return h;
}

// ---- Autograd ----------------------------------------------------------------------------
// As for torch's zero_: where buf requires grad, zero_tail_ records the write as torch records
// an in-place op (the zeroed rows pass no gradient back), and refuses a leaf (or a view of
// one) that requires grad before writing. Without this kernel autograd's fallback wrote the
// zeros and left the history alone, so a backward passed the gradient through them.

// torch's in-place ops make this check before writing (check_inplace); here the messages name
// the op and the argument. Views that autograd cannot rewrite (made under no_grad, or by a
// multi-output op such as unbind) get torch's own explanation.
void check_writable_with_grad(const at::Tensor& t, const char* op, const char* name) {
  using torch::autograd::can_mutate_inplace_result;
  switch (torch::autograd::can_mutate_inplace(t, /*requires_grad=*/true)) {
    case can_mutate_inplace_result::success:
      return;
    case can_mutate_inplace_result::non_default_backward_view:
      torch::autograd::handle_view_on_rebase(torch::autograd::impl::get_view_autograd_meta(t));
      return;
    case can_mutate_inplace_result::view_of_leaf:
      TORCH_CHECK(false, op, ": ", name,
                  " is a view of a leaf tensor that requires grad, which cannot be written in "
                  "place while grad mode is on (write it under torch.no_grad())");
    case can_mutate_inplace_result::is_leaf:
      TORCH_CHECK(false, op, ": ", name,
                  " is a leaf tensor that requires grad, which cannot be written in place "
                  "while grad mode is on (write it under torch.no_grad())");
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled can_mutate_inplace result");
}

// The gradient of buf after zeroing is the gradient before it, with the zeroed rows cleared.
// Symbolic under torch.compile: no comparison here may become a guard on the extents.
at::Tensor clear_zeroed_rows(const at::Tensor& grad, const c10::SymInt& new_extent,
                             const c10::SymInt& prev_extent) {
  const c10::SymInt rows = grad.sym_size(0);
  const c10::SymInt begin = new_extent.min(rows);
  const c10::SymInt length = (prev_extent.min(rows) - begin).max(0);
  at::Tensor out = grad.clone();
  out.narrow_symint(0, begin, length).zero_();
  return out;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct ZeroTailFunction : public torch::autograd::Function<ZeroTailFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& buf,
                               const c10::SymInt& new_extent, const c10::SymInt& prev_extent) {
    handle().call(buf, new_extent, prev_extent);
    ctx->mark_dirty({buf});
    ctx->saved_data["new_extent"] = new_extent;
    ctx->saved_data["prev_extent"] = prev_extent;
    return {buf};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor& grad = grad_outputs[0];
    if (!grad.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    return {clear_zeroed_rows(grad, ctx->saved_data["new_extent"].toSymInt(),
                              ctx->saved_data["prev_extent"].toSymInt()),
            at::Tensor(), at::Tensor()};
  }
};

void zero_tail_autograd(c10::DispatchKeySet keys, const at::Tensor& buf, c10::SymInt new_extent,
                        c10::SymInt prev_extent) {
  if (!at::GradMode::is_enabled() || !buf.requires_grad()) {
    handle().redispatch(keys & c10::after_autograd_keyset, buf, new_extent, prev_extent);
    return;
  }
  check_writable_with_grad(buf, "zero_tail_", "buf");
  ZeroTailFunction::apply(buf, new_extent, prev_extent);
}

void zero_tail_tracked_autograd(c10::DispatchKeySet keys, const at::Tensor& buf,
                                const at::Tensor& state, c10::SymInt new_extent) {
  if (!at::GradMode::is_enabled() || !buf.requires_grad()) {
    tracked_handle().redispatch(keys & c10::after_autograd_keyset, buf, state, new_extent);
    return;
  }
  // The rows zeroed depend on the extent the state held, which a backward could only keep as
  // a tensor saved from before the write; torch.compile (2.13) may hand the backward the state
  // input itself instead, after the new extent is stored in it (pure-PyTorch code that saves
  // a clone of an input it then mutates gets the same wrong gradient). Refused rather than
  // differentiable in eager mode alone.
  TORCH_CHECK(false, "zero_tail_tracked_: buf requires grad, but the tracked form records no "
              "gradient (use zero_tail_, whose extents are arguments rather than device "
              "values, or call this under torch.no_grad())");
}

// ---- Direct calls ------------------------------------------------------------------------

// Whether zeroing rows [new_extent, prev_extent) of buf writes enough (64 KiB: a few
// microseconds) to let another Python thread run meanwhile.
bool zeroes_much(const at::Tensor& buf, int64_t new_extent, int64_t prev_extent) {
  // Negative extents are the op's error to raise (and would overflow the difference).
  if (buf.dim() == 0 || buf.size(0) == 0 || new_extent < 0 || prev_extent < 0) return false;
  const int64_t rows = buf.size(0);
  const int64_t zeroed = std::min(prev_extent, rows) - std::min(new_extent, rows);
  return zeroed > 0 && zeroed * (buf.numel() / rows) * int64_t(buf.element_size()) >= 65536;
}

struct ZeroesMuch {
  static bool test(const at::Tensor& buf, const c10::SymInt& new_extent,
                   const c10::SymInt& prev_extent) {
    return zeroes_much(buf, new_extent.as_int_unchecked(), prev_extent.as_int_unchecked());
  }
  // The previous extent is on the device: any buf that could hold a long tail.
  static bool test(const at::Tensor& buf, const at::Tensor& /*state*/,
                   const c10::SymInt& new_extent) {
    return zeroes_much(buf, new_extent.as_int_unchecked(), buf.dim() > 0 ? buf.size(0) : 0);
  }
};

const DirectCallRegistration kDirectCall{
    "call_zero_tail", &DirectCall<Signature>::call<&handle, ZeroesMuch>,
    "moeext.zero_tail_'s direct call of the op: all three arguments positionally, of the "
    "plain Python types; returns NotImplemented for anything else."};
const DirectCallRegistration kDirectTrackedCall{
    "call_zero_tail_tracked", &DirectCall<TrackedSignature>::call<&tracked_handle, ZeroesMuch>,
    "moeext.zero_tail_tracked_'s direct call of the op: all three arguments positionally, of "
    "the plain Python types; returns NotImplemented for anything else."};

}  // namespace

TORCH_LIBRARY_IMPL(moeext, CPU, m) {
  m.impl("zero_tail_", &zero_tail<Cpu>);
  m.impl("zero_tail_tracked_", &zero_tail_tracked<Cpu>);
}

#if defined(MOEEXT_GPU_BACKEND)
TORCH_LIBRARY_IMPL(moeext, CUDA, m) {
  m.impl("zero_tail_", &zero_tail<Gpu>);
  m.impl("zero_tail_tracked_", &zero_tail_tracked<Gpu>);
}
#endif

TORCH_LIBRARY_IMPL(moeext, Autograd, m) {
  m.impl("zero_tail_", &zero_tail_autograd);
  m.impl("zero_tail_tracked_", &zero_tail_tracked_autograd);
}

TORCH_LIBRARY_IMPL(moeext, ADInplaceOrView, m) {
  m.impl("zero_tail_", &AutogradKernels<Signature>::bump_written<&handle, 0>);
  m.impl("zero_tail_tracked_", &AutogradKernels<TrackedSignature>::bump_written<&tracked_handle, 0, 1>);
}

}  // namespace moeext::torch_glue
