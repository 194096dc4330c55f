// moeext's at::parallel_for: the same split of [begin, end) over torch's intra-op threads,
// on the OpenMP runtime torch itself runs, whichever compiler built moeext.
//
// at::parallel_for is header-inline: its `#pragma omp parallel` is compiled into the
// extension, against the compiler's own runtime. GCC's is libgomp, the one torch's Linux
// wheels ship, but clang's is libomp: a clang build needed libomp's headers, and where they
// were installed it ran every kernel on a second thread pool that torch.set_num_threads
// does not size. So the region is opened here through GOMP_parallel, the entry point GCC
// emits for that pragma: libgomp, LLVM's libomp and Intel's libiomp5 all export it, and it
// binds at load time to the runtime libtorch_cpu already loaded. No OpenMP flag or header
// is needed to build this.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/ParallelGuard.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>

#if AT_PARALLEL_OPENMP
extern "C" {
void GOMP_parallel(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags);
int omp_get_num_threads();
int omp_get_thread_num();
}
#endif

namespace moeext::torch_glue {

#if AT_PARALLEL_OPENMP
namespace detail {

template <class F>
struct ParallelRange {
  int64_t begin;
  int64_t end;
  int64_t grain;
  const F* f;
  std::atomic_flag failed = ATOMIC_FLAG_INIT;
  std::exception_ptr error;
};

// Each thread of the team runs one contiguous chunk, as at::internal::invoke_parallel
// splits it: at most ceil(size / grain) chunks, the first exception kept for the caller.
template <class F>
void run_chunk(void* data) {
  auto& range = *static_cast<ParallelRange<F>*>(data);
  const int64_t size = range.end - range.begin;
  int64_t chunks = omp_get_num_threads();
  if (range.grain > 0) chunks = std::min(chunks, at::divup(size, range.grain));
  const int64_t tid = omp_get_thread_num();
  const int64_t chunk = at::divup(size, chunks);
  const int64_t begin = range.begin + tid * chunk;
  if (begin >= range.end) return;
  try {
    at::internal::ThreadIdGuard tid_guard(static_cast<int>(tid));
    c10::ParallelGuard guard(true);
    (*range.f)(begin, std::min(range.end, begin + chunk));
  } catch (...) {
    if (!range.failed.test_and_set()) range.error = std::current_exception();
  }
}

}  // namespace detail
#endif

// at::parallel_for's contract: f(chunk_begin, chunk_end) over [begin, end), chunks of at
// least `grain` items, serial inside a parallel region or with one thread.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
#if AT_PARALLEL_OPENMP
  at::internal::lazy_init_num_threads();
  const int64_t size = end - begin;
  if (size <= grain || size == 1 || at::in_parallel_region() || at::get_num_threads() <= 1) {
    at::internal::ThreadIdGuard tid_guard(0);
    c10::ParallelGuard guard(true);
    f(begin, end);
    return;
  }
  detail::ParallelRange<F> range{begin, end, grain, &f};
  GOMP_parallel(&detail::run_chunk<F>, &range, /*num_threads=*/0, /*flags=*/0);
  if (range.error) std::rethrow_exception(range.error);
#else
  at::parallel_for(begin, end, grain, f);  // torch's own pool, compiled into torch
#endif
}

}  // namespace moeext::torch_glue
