// parallel_for as torch's at::parallel_for does it with OpenMP (the same libgomp, so the same
// thread pool): [0, n) in at most rt.threads contiguous chunks of at least `grain`; inline when
// one chunk or already inside a parallel region.
#pragma once
#include "kernels.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace pw {

template <typename F>
void parallel_for(const Runtime& rt, int64_t n, int64_t grain, const F& f) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(std::max(rt.threads, 1), (n + grain - 1) / std::max<int64_t>(grain, 1));
  if (threads <= 1 || omp_in_parallel()) {
    f(int64_t{0}, n);
    return;
  }
  const int64_t chunk = (n + threads - 1) / threads;
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    const int64_t begin = omp_get_thread_num() * chunk, end = std::min(n, begin + chunk);
    if (begin < end) f(begin, end);
  }
}

}  // namespace pw
