// parallel_for as torch's at::parallel_for does it with OpenMP (the same libgomp, so the same
// thread pool): [0, n) in at most rt.threads contiguous chunks of at least `grain`; inline when
// one chunk or already inside a parallel region.
//
// A team call (rt.team: every thread of a running region calls the same op with the same
// arguments, as decoder.cpp runs a whole step) splits [0, n) among the region's threads and ends
// at a barrier, so the next op sees the results. An op's serial setup then runs on every thread:
// it must only compute, and anything the threads share comes from team_once.
#pragma once
#include "kernels.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace pw {

template <typename F>
void parallel_for(const Runtime& rt, int64_t n, int64_t grain, const F& f) {
  if (n <= 0) return;
  const int64_t g = std::max<int64_t>(grain, 1);
  if (rt.team) {
    const int64_t used = std::min<int64_t>(omp_get_num_threads(), (n + g - 1) / g), chunk = (n + used - 1) / used;
    const int64_t begin = omp_get_thread_num() * chunk, end = std::min(n, begin + chunk);
    if (begin < end) f(begin, end);
#pragma omp barrier
    return;
  }
  const int64_t threads = std::min<int64_t>(std::max(rt.threads, 1), (n + g - 1) / g);
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

// make() run once, its pointer seen by every thread of a team (a buffer the team shares; it must
// outlive the op's last parallel_for); a plain call outside a team.
template <typename T, typename F>
T* team_once(const Runtime& rt, const F& make) {
  if (!rt.team) return make();
  T* p = nullptr;
#pragma omp single copyprivate(p)
  p = make();
  return p;
}

// f() on one thread of a team (the others wait at its end), or a plain call outside a team.
template <typename F>
void team_serial(const Runtime& rt, const F& f) {
  if (!rt.team) return f();
#pragma omp single
  f();
}

}  // namespace pw
