// Host unit test of the portable vector layer's fp16 widening (csrc/cpu/vec_portable.h), which
// the portable routing and router GEMM kernels use on aarch64 and on x86-64 without AVX2:
// every one of the 65536 fp16 bit patterns must widen to the bits of to_float(fp16_t), which
// the lanes of a partial load still use. That covers signed zeros, every subnormal, the
// infinities and every NaN payload, signalling ones included (kept, where the x86 paths'
// vcvtph2ps quiets them). .ci/aarch64_check.sh runs it under qemu as well.
#include <cstdint>
#include <cstdio>
#include <cstring>

#define MOEEXT_CPU_ISA portable
#include "cpu/types.h"
#include "cpu/vec_portable.h"
#include "check.h"

using moeext::cpu::float_to_bits;
using moeext::cpu::fp16_t;
using moeext::cpu::to_float;
using moeext::cpu::portable::Vec;

int main() {
  for (uint32_t first = 0; first < 0x10000u; first += Vec::kWidth) {
    fp16_t h[Vec::kWidth];
    for (int i = 0; i < Vec::kWidth; ++i) h[i].bits = uint16_t(first + uint32_t(i));
    float lanes[Vec::kWidth];
    // A full mask takes the vector widening; a partial one widens lane by lane.
    Vec::load(h, Vec::tail_mask(Vec::kWidth), 0.0f).store(lanes);
    float partial[Vec::kWidth];
    Vec::load(h, Vec::tail_mask(Vec::kWidth - 1), 0.0f).store(partial);
    for (int i = 0; i < Vec::kWidth; ++i) {
      const uint32_t want = float_to_bits(to_float(h[i]));
      CHECK(float_to_bits(lanes[i]) == want, "fp16 0x%04x: 0x%08x, want 0x%08x",
            unsigned(h[i].bits), unsigned(float_to_bits(lanes[i])), unsigned(want));
      if (i + 1 < Vec::kWidth) {
        CHECK(float_to_bits(partial[i]) == want, "fp16 0x%04x (partial): 0x%08x, want 0x%08x",
              unsigned(h[i].bits), unsigned(float_to_bits(partial[i])), unsigned(want));
      }
    }
  }
  return moeext_test::finish("test_portable_fp16");
}
