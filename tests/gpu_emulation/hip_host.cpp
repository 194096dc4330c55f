// The HIP host calls csrc/gpu/ makes (include/hip/hip_runtime.h), on the emulated device:
// device 0, the warp width of the emulation's settings, host memory, work done at once.
#include <hip/hip_runtime.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace {

std::string& last_message() {
  static std::string message;
  return message;
}

}  // namespace

int moeext_emu_multiprocessors = 4;

hipError_t hipGetLastError() {
  const std::string error = moeext_emu::take_error();
  if (error.empty()) return hipSuccess;
  last_message() = error;
  return hipErrorLaunchFailure;
}

const char* hipGetErrorString(hipError_t error) {
  return error == hipSuccess ? "no error" : last_message().c_str();
}

hipError_t hipGetDevice(int* device) {
  *device = 0;
  return hipSuccess;
}

hipError_t hipDeviceGetAttribute(int* value, hipDeviceAttribute_t attribute, int /*device*/) {
  *value = attribute == hipDeviceAttributeWarpSize ? moeext_emu::settings().warp_size
                                                    : moeext_emu_multiprocessors;
  return hipSuccess;
}

hipError_t hipMemsetAsync(void* dst, int value, size_t bytes, hipStream_t /*stream*/) {
  std::memset(dst, value, bytes);
  return hipSuccess;
}

hipError_t hipMalloc(void** ptr, size_t bytes) {
  *ptr = std::malloc(bytes);
  return *ptr ? hipSuccess : hipErrorLaunchFailure;
}

hipError_t hipStreamSynchronize(hipStream_t /*stream*/) { return hipSuccess; }

hipError_t hipStreamGetCaptureInfo(hipStream_t /*stream*/, hipStreamCaptureStatus* status,
                                   unsigned long long* id) {
  *status = hipStreamCaptureStatusNone;
  *id = 0;
  return hipSuccess;
}
