// Picks the vector layer of the instruction set this copy of a kernel file is compiled for
// (see cpu/isa_id.h).
#pragma once

#include "cpu/isa_id.h"

// avx512bf16 is avx512 plus the bf16 dot-product instruction, which only router_gemm uses.
#if MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_avx512 || \
    MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_avx512bf16
#include "cpu/vec_avx512.h"
#elif MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_avx2
#include "cpu/vec_avx2.h"
#elif MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_portable
#include "cpu/vec_portable.h"
#else
#error "no vector layer for this MOEEXT_CPU_ISA"
#endif

#include "cpu/vec_math.h"
