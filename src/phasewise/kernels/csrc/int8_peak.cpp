// The machine's int8 dot-product peak (compare_peers' roof for the quantized kernels), measured on
// the same vector layer the kernels use.
#include "core.h"
#include "parallel.h"
#include "vec/vec.h"

#include <algorithm>
#include <chrono>
#include <vector>

namespace pw {

// The machine's int8 dot-product peak in GOP/s (2 per multiply-add): every thread runs `iters`
// rounds of 12 independent dot-product chains (64 multiply-adds each), the roof of quant_linear.cpp.
double int8_peak_gops(const Runtime& rt, int64_t iters) {
  const int64_t threads = std::max(rt.threads, 1);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<int32_t> sink(threads * 16);
  parallel_for(rt, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      Vi acc[12];
      for (int c = 0; c < 12; ++c) acc[c] = Vi::set1(c);
      int8_t ones[4] = {1, 1, 1, 1}, mine[4];
      std::fill(mine, mine + 4, static_cast<int8_t>(t + 1));
      Vb a = Vb::bcast4(ones), b = Vb::bcast4(mine);
      for (int64_t n = 0; n < iters; ++n) {
        for (int c = 0; c < 12; ++c) acc[c] = dot_u4(acc[c], a, b);
        __asm__ volatile("" : : "r"(&a), "r"(&b) : "memory");   // keeps the chains from being folded
      }
      for (int c = 1; c < 12; ++c) acc[0] = acc[0] + acc[c];
      acc[0].store(sink.data() + t * 16);
    }
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(threads) * iters * 12 * 64 * 2 / s / 1e9;
}

}  // namespace pw
