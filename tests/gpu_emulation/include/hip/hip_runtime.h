// What csrc/gpu/ uses of the HIP runtime header, on the host (tests/gpu_emulation/): the
// kernels build as HIP (compat.h's MOEEXT_HIP paths) with emulated_gpu.h's device side, the
// HIP names of its intrinsics and the host calls below (hip_host.cpp).
#pragma once

#include "../emulated_gpu.h"

#define __HIP_MEMORY_SCOPE_AGENT 3

#define __builtin_amdgcn_workitem_id_x() (threadIdx.x)
#define __builtin_amdgcn_workgroup_id_x() (blockIdx.x)
#define __builtin_amdgcn_fence(order, scope) ((void)0)
#define __builtin_amdgcn_wave_barrier() ::moeext_emu::sync_warp()

// HIP's warp functions take no lane mask: every lane of the wavefront takes part.
template <typename T>
T __shfl_xor(T value, int lane_mask) {
  return ::moeext_emu::shuffle_from(value, ::moeext_emu::lane_id() ^ lane_mask);
}

template <typename T>
T __shfl(T value, int source) {
  return ::moeext_emu::shuffle_from(value, source);
}

inline unsigned long long __ballot(int predicate) {
  return ::moeext_emu::warp_ballot(predicate != 0);
}

template <typename T, typename U>
T __hip_atomic_fetch_add(T* address, U value, int order, int /*scope*/) {
  if (order == __ATOMIC_ACQ_REL) return ::moeext_emu::fetch_add_acq_rel(address, value);
  if (order == __ATOMIC_RELAXED) return atomicAdd(address, value);
  ::moeext_emu::record_error("__hip_atomic_fetch_add: an order the emulation does not model");
  return atomicAdd(address, value);
}

// ---- host API -------------------------------------------------------------------------------

using hipStream_t = struct ihipStream_t*;
enum hipError_t { hipSuccess = 0, hipErrorLaunchFailure = 719 };
enum hipDeviceAttribute_t {
  hipDeviceAttributeWarpSize,
  hipDeviceAttributeMultiprocessorCount,
};
enum hipStreamCaptureStatus { hipStreamCaptureStatusNone = 0, hipStreamCaptureStatusActive };

hipError_t hipGetLastError();
const char* hipGetErrorString(hipError_t error);
hipError_t hipGetDevice(int* device);
hipError_t hipDeviceGetAttribute(int* value, hipDeviceAttribute_t attribute, int device);
hipError_t hipMemsetAsync(void* dst, int value, size_t bytes, hipStream_t stream);
hipError_t hipMalloc(void** ptr, size_t bytes);
hipError_t hipStreamSynchronize(hipStream_t stream);
hipError_t hipStreamGetCaptureInfo(hipStream_t stream, hipStreamCaptureStatus* status,
                                   unsigned long long* id);
