// The runtime's host calls csrc/gpu/ makes (include/cuda_runtime.h or include/hip/hip_runtime.h,
// whichever the build is: MOEEXT_EMU_CUDA), on the emulated device: device 0, the build's warp
// width, host memory, work done at once.
#include <cstdlib>
#include <cstring>
#include <string>

int moeext_emu_multiprocessors = 132;  // harness.cpp's configure() sets it

#if defined(MOEEXT_EMU_CUDA)
#include <cuda_runtime.h>
#define EMU_API(name) cuda##name
using Error = cudaError_t;
using Stream = cudaStream_t;
using Attribute = cudaDeviceAttr;
using CaptureStatus = cudaStreamCaptureStatus;
constexpr Error kSuccess = cudaSuccess, kFailure = cudaErrorLaunchFailure;
constexpr CaptureStatus kNotCapturing = cudaStreamCaptureStatusNone;
long moeext_emu_programmatic_launches = 0;
namespace {
int attribute_value(Attribute attribute) {
  switch (attribute) {
    case cudaDevAttrWarpSize: return moeext_emu::settings().warp_size;
    case cudaDevAttrComputeCapabilityMajor: return 9;
    default: return moeext_emu_multiprocessors;
  }
}
}  // namespace
#else
#include <hip/hip_runtime.h>
#define EMU_API(name) hip##name
using Error = hipError_t;
using Stream = hipStream_t;
using Attribute = hipDeviceAttribute_t;
using CaptureStatus = hipStreamCaptureStatus;
constexpr Error kSuccess = hipSuccess, kFailure = hipErrorLaunchFailure;
constexpr CaptureStatus kNotCapturing = hipStreamCaptureStatusNone;
namespace {
int attribute_value(Attribute attribute) {
  return attribute == hipDeviceAttributeWarpSize ? moeext_emu::settings().warp_size
                                                 : moeext_emu_multiprocessors;
}
}  // namespace
#endif

namespace {

std::string& last_message() {
  static std::string message;
  return message;
}

}  // namespace

Error EMU_API(GetLastError)() {
  const std::string error = moeext_emu::take_error();
  if (error.empty()) return kSuccess;
  last_message() = error;
  return kFailure;
}

const char* EMU_API(GetErrorString)(Error error) {
  return error == kSuccess ? "no error" : last_message().c_str();
}

Error EMU_API(GetDevice)(int* device) {
  *device = 0;
  return kSuccess;
}

Error EMU_API(DeviceGetAttribute)(int* value, Attribute attribute, int /*device*/) {
  *value = attribute_value(attribute);
  return kSuccess;
}

Error EMU_API(MemsetAsync)(void* dst, int value, size_t bytes, Stream /*stream*/) {
  std::memset(dst, value, bytes);
  return kSuccess;
}

Error EMU_API(Malloc)(void** ptr, size_t bytes) {
  *ptr = std::malloc(bytes);
  return *ptr ? kSuccess : kFailure;
}

Error EMU_API(StreamSynchronize)(Stream /*stream*/) { return kSuccess; }

Error EMU_API(StreamGetCaptureInfo)(Stream /*stream*/, CaptureStatus* status,
                                    unsigned long long* id) {
  *status = kNotCapturing;
  *id = 0;
  return kSuccess;
}
