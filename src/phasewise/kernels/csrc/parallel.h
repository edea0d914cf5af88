// parallel_for as torch's at::parallel_for does it with OpenMP (the same libgomp, so the same
// thread pool; without OpenMP the kernels' own, thread_pool.h): [0, n) in at most rt.threads
// contiguous chunks of at least `grain`; inline when one chunk or already inside a parallel region.
//
// A team call (rt.team: every thread of a running region calls the same op with the same
// arguments, as decoder.cpp runs a whole step) splits [0, n) among the region's threads and ends
// at a barrier, so the next op sees the results. An op's serial setup then runs on every thread:
// it must only compute, and anything the threads share comes from team_once.
#pragma once
#include "kernels.h"

#ifdef _OPENMP
#include <omp.h>
#else
#include "thread_pool.h"
#endif

#include <algorithm>
#include <cstdint>

namespace pw {

// The region a call runs in, under either build: OpenMP's team, or the kernels' own pool
// (thread_pool.h, builds without OpenMP), which splits and meets the same way.
#ifdef _OPENMP
inline int region_threads() { return omp_get_num_threads(); }
inline int region_thread() { return omp_get_thread_num(); }
inline bool in_region() { return omp_in_parallel(); }
inline void region_barrier() {
#pragma omp barrier
}
template <typename F>
void run_region(int threads, const F& f) {   // f() on `threads` threads
#pragma omp parallel num_threads(threads)
  f();
}
#else
inline int region_threads() { return ThreadPool::threads(); }
inline int region_thread() { return ThreadPool::thread(); }
inline bool in_region() { return ThreadPool::in_region(); }
inline void region_barrier() { ThreadPool::instance().barrier(); }
template <typename F>
void run_region(int threads, const F& f) { ThreadPool::instance().run(threads, f); }
#endif

template <typename F>
void parallel_for(const Runtime& rt, int64_t n, int64_t grain, const F& f) {
  if (n <= 0) return;
  const int64_t g = std::max<int64_t>(grain, 1);
  if (rt.team) {
    const int64_t used = std::min<int64_t>(region_threads(), (n + g - 1) / g), chunk = (n + used - 1) / used;
    const int64_t begin = region_thread() * chunk, end = std::min(n, begin + chunk);
    if (begin < end) f(begin, end);
    region_barrier();
    return;
  }
  const int64_t threads = std::min<int64_t>(std::max(rt.threads, 1), (n + g - 1) / g);
  if (threads <= 1 || in_region()) {
    f(int64_t{0}, n);
    return;
  }
  const int64_t chunk = (n + threads - 1) / threads;
  run_region(static_cast<int>(threads), [&] {
    const int64_t begin = region_thread() * chunk, end = std::min(n, begin + chunk);
    if (begin < end) f(begin, end);
  });
}

// make() run once, its pointer seen by every thread of a team (a buffer the team shares; it must
// outlive the op's last parallel_for); a plain call outside a team.
template <typename T, typename F>
T* team_once(const Runtime& rt, const F& make) {
  if (!rt.team) return make();
#ifdef _OPENMP
  T* p = nullptr;
#pragma omp single copyprivate(p)
  p = make();
  return p;
#else
  if (region_threads() == 1) return make();
  static T* shared = nullptr;             // thread 0 makes it; all read it between two barriers (one
  if (region_thread() == 0) shared = make();   // region of several threads runs at a time)
  region_barrier();
  T* p = shared;
  region_barrier();
  return p;
#endif
}

// f() on one thread of a team (the others wait at its end), or a plain call outside a team.
template <typename F>
void team_serial(const Runtime& rt, const F& f) {
  if (!rt.team) return f();
#ifdef _OPENMP
#pragma omp single
  f();
#else
  if (region_thread() == 0) f();
  region_barrier();
#endif
}

}  // namespace pw
