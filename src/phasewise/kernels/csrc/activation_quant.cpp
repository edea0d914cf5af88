// Activations quantized for the int8 linear layers (quant_linear.cpp): symmetric int8 with round to
// nearest even and one scale dx = max|x| / 127 per group of 32 values, or of 256 (a K-quant's
// super-block, llama.cpp's Q8_K: `super`); per block of 32 its dx (the group's), sx = dx * sum(xq)
// and, when asked, sl = dx * the sum of its first 16 xq (the offsets of formats with a scale per half).
#include "core.h"
#include "parallel.h"
#include "vec/vec.h"

#include <algorithm>

namespace pw {
namespace {

// One block of 32 floats -> 32 int8 (round to nearest even) at the group's max |x| (amax), dx, sx
// (and sl, when asked) of the block.
inline void quantize_block(const float* x, float amax, int8_t* q, float* dx, float* sx, float* sl) {
  const Vf a = Vf::load(x), b = Vf::load(x + 16);
  const Vf id = Vf::set1(amax > 0.f ? 127.f / amax : 0.f);
  const Vf lo = to_float(round_to_i8(a * id, q)), hi = to_float(round_to_i8(b * id, q + 16));   // sums exact
  *dx = amax / 127.f;
  *sx = *dx * reduce_add(lo + hi);
  if (sl) *sl = *dx * reduce_add(lo);
}

inline float block_amax(const float* x) { return reduce_max(max(abs(Vf::load(x)), abs(Vf::load(x + 16)))); }

}  // namespace

void quantize_rows(const Runtime& rt, const float* xp, int64_t M, int64_t K, int8_t* qp, float* dp, float* sp,
                   float* lp, bool super) {
  const int64_t G = super ? 8 : 1, groups = M * K / QK / G;   // blocks of 32 per group, groups
  parallel_for(rt, groups, (QUANT_GRAIN + G - 1) / G, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {   // the group 16 blocks ahead fetched into L2 (rows come from L2, L3)
      const int64_t i0 = g * G;
      if (g + 16 / G < end)
        for (int64_t c = 0; c < G; ++c) prefetch_l2(xp + (i0 + 16 + c) * QK), prefetch_l2(xp + (i0 + 16 + c) * QK + 16);
      float amax = block_amax(xp + i0 * QK);
      for (int64_t c = 1; c < G; ++c) amax = std::max(amax, block_amax(xp + (i0 + c) * QK));
      for (int64_t i = i0; i < i0 + G; ++i)
        quantize_block(xp + i * QK, amax, qp + i * QK, dp + i, sp + i, lp ? lp + i : nullptr);
    }
  });
}

void quantize_activations(const Runtime& rt, const float* xp, int64_t M, int64_t K, int8_t* qp, float* dp,
                          float* sp) {
  quantize_rows(rt, xp, M, K, qp, dp, sp, nullptr, false);
}

}  // namespace pw
