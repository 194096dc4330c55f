// Host unit test of csrc/gpu/access_width.h: the access width the launchers pick must
// divide every address, stride and length they OR together, and be the widest that does.
#include <cstdint>
#include <cstdio>

#include "gpu/access_width.h"

int main() {
  int failures = 0;
  for (uint64_t alignment = 0; alignment < 4096; ++alignment) {
    const int width = moeext::gpu::widest_aligned_access(alignment);
    const bool valid = width == 1 || width == 2 || width == 4 || width == 8 || width == 16;
    if (!valid || alignment % uint64_t(width) != 0 ||
        (width < 16 && alignment % uint64_t(2 * width) == 0)) {
      std::printf("widest_aligned_access(%llu) = %d\n",
                  static_cast<unsigned long long>(alignment), width);
      ++failures;
    }
  }
  if (failures != 0) {
    std::printf("%d failures\n", failures);
    return 1;
  }
  std::printf("access width: ok\n");
  return 0;
}
