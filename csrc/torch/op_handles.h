// Typed dispatcher handles of moeext's ops, for the glue that calls an op through the
// dispatcher rather than through torch.ops (the Autograd kernels, the direct Python calls).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace moeext::torch_glue {

// The ops' C++ signatures as the dispatcher calls them (schema.cpp).
using BiasedGroupedTopkSignature = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const std::optional<at::Tensor>&, int64_t, int64_t, int64_t, bool, double,
    c10::string_view);
using BiasedGroupedTopkOutSignature = void(const at::Tensor&, const std::optional<at::Tensor>&,
                                           const at::Tensor&, const at::Tensor&, int64_t,
                                           int64_t, bool, double, c10::string_view);

using RouterGemmSignature = at::Tensor(const at::Tensor&, const at::Tensor&,
                                       std::optional<c10::ScalarType>);
using ShuffleWeightSignature = at::Tensor(const at::Tensor&, at::IntArrayRef, bool);
using E8m0ShuffleSignature = at::Tensor(const at::Tensor&, bool, std::optional<int64_t>);
using E8m0UnshuffleSignature = at::Tensor(const at::Tensor&, int64_t, int64_t, bool,
                                          std::optional<int64_t>);
using ZeroTailSignature = void(const at::Tensor&, c10::SymInt, c10::SymInt);
using ZeroTailTrackedSignature = void(const at::Tensor&, const at::Tensor&, c10::SymInt);

// Looked up once per op: the handles below are function-local statics of inline functions,
// one per program.
template <typename Signature>
inline c10::TypedOperatorHandle<Signature> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

inline const c10::TypedOperatorHandle<BiasedGroupedTopkSignature>& biased_grouped_topk_handle() {
  static const auto handle = typed_op<BiasedGroupedTopkSignature>("moeext::biased_grouped_topk");
  return handle;
}

inline const c10::TypedOperatorHandle<BiasedGroupedTopkOutSignature>&
biased_grouped_topk_out_handle() {
  static const auto handle =
      typed_op<BiasedGroupedTopkOutSignature>("moeext::biased_grouped_topk_out");
  return handle;
}

inline const c10::TypedOperatorHandle<RouterGemmSignature>& router_gemm_handle() {
  static const auto handle = typed_op<RouterGemmSignature>("moeext::router_gemm");
  return handle;
}

// shuffle_weight, or unshuffle_weight when `inverse`.
inline const c10::TypedOperatorHandle<ShuffleWeightSignature>& shuffle_weight_handle(bool inverse) {
  static const auto shuffle = typed_op<ShuffleWeightSignature>("moeext::shuffle_weight");
  static const auto unshuffle = typed_op<ShuffleWeightSignature>("moeext::unshuffle_weight");
  return inverse ? unshuffle : shuffle;
}

inline const c10::TypedOperatorHandle<E8m0ShuffleSignature>& e8m0_shuffle_handle() {
  static const auto handle = typed_op<E8m0ShuffleSignature>("moeext::e8m0_shuffle");
  return handle;
}

inline const c10::TypedOperatorHandle<E8m0UnshuffleSignature>& e8m0_unshuffle_handle() {
  static const auto handle = typed_op<E8m0UnshuffleSignature>("moeext::e8m0_unshuffle");
  return handle;
}

inline const c10::TypedOperatorHandle<ZeroTailSignature>& zero_tail_handle() {
  static const auto handle = typed_op<ZeroTailSignature>("moeext::zero_tail_");
  return handle;
}

inline const c10::TypedOperatorHandle<ZeroTailTrackedSignature>& zero_tail_tracked_handle() {
  static const auto handle = typed_op<ZeroTailTrackedSignature>("moeext::zero_tail_tracked_");
  return handle;
}

}  // namespace moeext::torch_glue
