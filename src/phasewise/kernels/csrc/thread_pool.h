// The kernels' own threads, for builds without OpenMP (clang without libomp, macOS without torch's
// libomp; PHASEWISE_OPENMP=0): the few things parallel.h asks of OpenMP, done the same way.
//   run(n, f): f() on the calling thread (thread 0) and n - 1 workers, back when all have returned;
//   barrier(): the threads of the running region meet (a sense-reversing counter);
//   thread(), threads(), in_region(): this thread's place in the region it runs.
// One pool per process, as OpenMP's: workers start on first use (as many as the most threads asked)
// and live to the process's end; idle, they spin briefly, then sleep. A second thread that calls run
// while a region runs gets its f() on one thread (threads() == 1), as a nested region would.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pw {

class ThreadPool {
 public:
  static ThreadPool& instance();
  void run(int n, const std::function<void()>& f);
  void barrier();
  static int thread();
  static int threads();
  static bool in_region();

 private:
  void work(int index);
  void spawn(int workers);

  std::mutex run_mutex_;                  // one region at a time
  std::mutex wake_mutex_;
  std::condition_variable wake_;
  std::vector<std::thread> workers_;
  std::atomic<const std::function<void()>*> job_{nullptr};
  std::atomic<int> active_{0};            // the running region's threads
  std::atomic<uint64_t> generation_{0};   // one more for each region
  std::atomic<int> pending_{0};           // workers of the region not yet done
  std::atomic<int> arrived_{0};           // at the barrier
  std::atomic<uint64_t> phase_{0};        // barriers passed
};

}  // namespace pw
