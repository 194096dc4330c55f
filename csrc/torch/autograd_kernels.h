// Autograd and ADInplaceOrView kernels that several ops share, made from the op's signature.
// Registering them unboxed matters: autograd's boxed fallback packs every argument into an
// IValue (a string argument into a new string) on each call, only to redispatch.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>

#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>

namespace moeext::torch_glue {

// torch's in-place and out= ops bump the version counter of what they write, so a backward
// through a value saved before the write raises instead of silently using the new values.
// Inference tensors have no counter and are skipped, as torch.library.custom_op's mutating
// ops skip them: writing one outside inference mode stays allowed.
inline void bump_version_of_written(const at::Tensor& t) {
  if (!t.is_inference()) torch::autograd::impl::bump_version(t);
}
inline void bump_version_of_written(const std::optional<at::Tensor>& t) {
  if (t.has_value()) bump_version_of_written(*t);
}

template <typename Signature>
struct AutogradKernels;

template <typename Result, typename... Args>
struct AutogradKernels<Result(Args...)> {
  using Handle = c10::TypedOperatorHandle<Result(Args...)>;

  // An op whose outputs carry no gradient: straight on to the kernel below autograd.
  template <const Handle& (*kHandle)()>
  static Result without_gradient(c10::DispatchKeySet keys, Args... args) {
    return kHandle().redispatch(keys & c10::after_autograd_keyset, args...);
  }

  // ADInplaceOrView of an op that writes into its arguments number kWritten... (Tensor(a!)
  // in the schema, optional ones included): the call, then their version bumps.
  template <const Handle& (*kHandle)(), size_t... kWritten>
  static Result bump_written(c10::DispatchKeySet keys, Args... args) {
    const auto bump = [&] {
      const auto all = std::forward_as_tuple(args...);
      (bump_version_of_written(std::get<kWritten>(all)), ...);
    };
    if constexpr (std::is_void_v<Result>) {
      {
        at::AutoDispatchBelowADInplaceOrView guard;
        kHandle().redispatch(keys & c10::after_ADInplaceOrView_keyset, args...);
      }
      bump();
    } else {
      Result result;
      {
        at::AutoDispatchBelowADInplaceOrView guard;
        result = kHandle().redispatch(keys & c10::after_ADInplaceOrView_keyset, args...);
      }
      bump();
      return result;
    }
  }
};

}  // namespace moeext::torch_glue
