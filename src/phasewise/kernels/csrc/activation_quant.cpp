// Activations quantized per block of 32 for the int8 linear layers (quant_linear.cpp): symmetric
// int8 with round to nearest even, the block's scale dx = max|x| / 127, sx = dx * sum(xq) and, when
// asked, sl = dx * the sum of its first 16 xq (the offsets of formats with a scale per half).
#include "core.h"
#include "parallel.h"
#include "vec/vec.h"

namespace pw {
namespace {

// One block of 32 floats -> 32 int8 (round to nearest even), dx, sx (and sl, when asked) of the block.
inline void quantize_block(const float* x, int8_t* q, float* dx, float* sx, float* sl) {
  const Vf a = Vf::load(x), b = Vf::load(x + 16);
  const float amax = reduce_max(max(abs(a), abs(b)));
  const Vf id = Vf::set1(amax > 0.f ? 127.f / amax : 0.f);
  const Vf lo = to_float(round_to_i8(a * id, q)), hi = to_float(round_to_i8(b * id, q + 16));   // sums exact
  *dx = amax / 127.f;
  *sx = *dx * reduce_add(lo + hi);
  if (sl) *sl = *dx * reduce_add(lo);
}

}  // namespace

void quantize_rows(const Runtime& rt, const float* xp, int64_t M, int64_t K, int8_t* qp, float* dp, float* sp,
                   float* lp) {
  const int64_t KB = K / QK;
  parallel_for(rt, M * KB, QUANT_GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {   // the block 16 ahead fetched into L2 (the rows come from L2, L3)
      if (i + 16 < end) prefetch_l2(xp + (i + 16) * QK), prefetch_l2(xp + (i + 16) * QK + 16);
      quantize_block(xp + i * QK, qp + i * QK, dp + i, sp + i, lp ? lp + i : nullptr);
    }
  });
}

void quantize_activations(const Runtime& rt, const float* xp, int64_t M, int64_t K, int8_t* qp, float* dp,
                          float* sp) {
  quantize_rows(rt, xp, M, K, qp, dp, sp, nullptr);
}

}  // namespace pw
