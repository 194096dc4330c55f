// The little harness every host unit test in tests/cpp/ shares: CHECK(cond, fmt, ...) counts
// a failure and prints where and why (the first 20 of them), and finish() turns the count
// into the exit status tests/test_gpu_logic.py reads.
#pragma once

#include <cstdio>

namespace moeext_test {

inline int failures = 0;

inline bool report_failure() { return ++failures <= 20; }

inline int finish(const char* name) {
  if (failures != 0) {
    std::printf("%s: %d failures\n", name, failures);
    return 1;
  }
  std::printf("%s: ok\n", name);
  return 0;
}

}  // namespace moeext_test

#define CHECK(cond, ...)                                        \
  do {                                                          \
    if (!(cond) && moeext_test::report_failure()) {             \
      std::printf("%s:%d: %s: ", __FILE__, __LINE__, #cond);    \
      std::printf(__VA_ARGS__);                                 \
      std::printf("\n");                                        \
    }                                                           \
  } while (0)
