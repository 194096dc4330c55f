// Names the instruction set a per-ISA copy of a kernel file is compiled for. CMake compiles
// those files once per ISA with MOEEXT_CPU_ISA set to the ISA's name, which is also the
// namespace the copy lives in, so the copies never clash at link time.
#pragma once

#ifndef MOEEXT_CPU_ISA
#error "MOEEXT_CPU_ISA must name the instruction set (portable, avx2, avx512 or avx512bf16)"
#endif

#define MOEEXT_ISA_portable 0
#define MOEEXT_ISA_avx512 1
#define MOEEXT_ISA_avx512bf16 2
#define MOEEXT_ISA_avx2 3
#define MOEEXT_ISA_ID_(name) MOEEXT_ISA_##name
#define MOEEXT_ISA_ID(name) MOEEXT_ISA_ID_(name)
