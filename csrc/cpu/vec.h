// Picks the vector layer of the instruction set this copy of a kernel file is compiled for.
// CMake compiles every kernel file once per ISA with MOEEXT_CPU_ISA set to that ISA's name,
// which is also the namespace the copy lives in, so the copies never clash at link time.
#pragma once

#ifndef MOEEXT_CPU_ISA
#error "MOEEXT_CPU_ISA must name the instruction set (scalar, avx512 or avx512bf16)"
#endif

#define MOEEXT_ISA_scalar 0
#define MOEEXT_ISA_avx512 1
#define MOEEXT_ISA_avx512bf16 2
#define MOEEXT_ISA_ID_(name) MOEEXT_ISA_##name
#define MOEEXT_ISA_ID(name) MOEEXT_ISA_ID_(name)

// avx512bf16 is avx512 plus the bf16 dot-product instruction, which only router_gemm uses.
#if MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_avx512 || \
    MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_avx512bf16
#include "cpu/vec_avx512.h"
#elif MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_scalar
#include "cpu/vec_scalar.h"
#else
#error "unknown MOEEXT_CPU_ISA"
#endif

#include "cpu/vec_math.h"
