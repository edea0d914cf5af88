// ThreadPool (thread_pool.h): used only by builds without OpenMP.
#ifndef _OPENMP
#include "thread_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace pw {
namespace {

thread_local int tl_thread = 0, tl_threads = 1;
thread_local bool tl_in_region = false;

constexpr int SPIN_BEFORE_YIELD = 2000;      // pause loops before giving the core away
constexpr int SPIN_BEFORE_SLEEP = 200000;    // an idle worker's spins (~ a few ms) before it sleeps

inline void relax(int spins) {
  if (spins >= SPIN_BEFORE_YIELD) {
    std::this_thread::yield();
    return;
  }
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

struct Place {                              // this thread's place in a region, restored on leaving
  int thread, threads;
  bool in_region;
  Place(int t, int n) : thread(tl_thread), threads(tl_threads), in_region(tl_in_region) {
    tl_thread = t, tl_threads = n, tl_in_region = true;
  }
  ~Place() { tl_thread = thread, tl_threads = threads, tl_in_region = in_region; }
};

}  // namespace

ThreadPool& ThreadPool::instance() {
  static ThreadPool* pool = new ThreadPool;  // never destroyed: its workers sleep until the process ends
  return *pool;
}

int ThreadPool::thread() { return tl_thread; }
int ThreadPool::threads() { return tl_threads; }
bool ThreadPool::in_region() { return tl_in_region; }

void ThreadPool::spawn(int workers) {
  while (static_cast<int>(workers_.size()) < workers) {
    const int index = static_cast<int>(workers_.size());
    workers_.emplace_back([this, index] { work(index); });
    workers_.back().detach();
  }
}

void ThreadPool::run(int n, const std::function<void()>& f) {
  std::unique_lock<std::mutex> region(run_mutex_, std::try_to_lock);
  if (n <= 1 || tl_in_region || !region.owns_lock()) {
    Place place(0, 1);
    f();
    return;
  }
  spawn(n - 1);
  job_.store(&f, std::memory_order_relaxed);
  active_.store(n, std::memory_order_relaxed);
  pending_.store(n - 1, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(wake_mutex_);
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  {
    Place place(0, n);
    f();
  }
  for (int spins = 0; pending_.load(std::memory_order_acquire) > 0; ++spins) relax(spins);
}

void ThreadPool::work(int index) {
  uint64_t seen = 0;
  for (;;) {
    uint64_t now;
    for (int spins = 0; (now = generation_.load(std::memory_order_acquire)) == seen; ++spins) {
      if (spins < SPIN_BEFORE_SLEEP) {
        relax(spins);
        continue;
      }
      std::unique_lock<std::mutex> lock(wake_mutex_);
      wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
    }
    seen = now;
    const int active = active_.load(std::memory_order_relaxed);
    if (index + 1 < active) {
      {
        Place place(index + 1, active);
        (*job_.load(std::memory_order_relaxed))();
      }
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }
}

void ThreadPool::barrier() {
  const int n = tl_threads;
  if (n <= 1) return;
  const uint64_t phase = phase_.load(std::memory_order_acquire);
  if (arrived_.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
    arrived_.store(0, std::memory_order_relaxed);
    phase_.fetch_add(1, std::memory_order_release);
    return;
  }
  for (int spins = 0; phase_.load(std::memory_order_acquire) == phase; ++spins) relax(spins);
}

}  // namespace pw
#endif
