// Decode-sized CPU outputs from malloc (cpu_memory.h says why).
#include "torch/cpu_memory.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/alignment.h>

#include <cstdint>
#include <cstdlib>
#include <new>

namespace moeext::torch_glue {
namespace {

// The alignment torch's CPU allocator gives, so that a result's data is aligned as a
// torch.empty one is.
constexpr size_t kAlignment = c10::gAlignment;

void free_block(void* block) { std::free(block); }

// Blocks up to kSmallOutputBytes from malloc, over-allocated by the alignment and aligned by
// hand; the DataPtr's context is malloc's pointer, freed from any thread. Everything else, and
// every block while a profiler counts memory or another CPU allocator is installed, from
// torch's CPU allocator. A storage resized later asks this allocator again, so any size goes.
class SmallOutputAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (!takes(n)) return c10::GetCPUAllocator()->allocate(n);
    void* block = std::malloc(n + kAlignment - 1);
    if (block == nullptr) throw std::bad_alloc();
    const uintptr_t aligned =
        (reinterpret_cast<uintptr_t>(block) + kAlignment - 1) & ~uintptr_t(kAlignment - 1);
    return {reinterpret_cast<void*>(aligned), block, &free_block, c10::Device(c10::kCPU)};
  }

  void copy_data(void* dest, const void* src, size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  static bool takes(size_t n) {
    return n > 0 && n <= kSmallOutputBytes &&
           c10::GetCPUAllocator() == c10::GetDefaultCPUAllocator() &&
           !c10::memoryProfilingEnabled();
  }
};

}  // namespace

at::Tensor empty_cpu_output(at::IntArrayRef sizes, at::ScalarType dtype) {
  static SmallOutputAllocator allocator;
  constexpr c10::DispatchKeySet kCpu(c10::DispatchKey::CPU);
  return at::detail::empty_generic(sizes, &allocator, kCpu, dtype, std::nullopt);
}

}  // namespace moeext::torch_glue
