// ARM NEON (AArch64): the int8 dot products and the fp16 conversion of the portable vector layer
// (vec/portable.h, W = 4: four 128-bit registers per 16 lanes). With the dot-product extension
// (ARMv8.2 +dotprod: Apple M1 on, Graviton 2 on) one sdot per register; without it, widening
// multiplies and pairwise adds. Both multiply signed bytes, so Q8's biased bytes are unbiased
// first (u ^ 0x80 = u - 128).
#pragma once
#include <arm_neon.h>

namespace pw {

#if defined(__ARM_FEATURE_DOTPROD)
constexpr const char* ISA = "neon-dotprod";
#else
constexpr const char* ISA = "neon";
#endif
constexpr bool Q8_BIASED = false;

inline Vf Vf::from_f16(const uint16_t* p) {
  Vf r;
  for (int i = 0; i < NP; ++i) {
    const float32x4_t f = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * i)));
    std::memcpy(&r.v[i], &f, 16);
  }
  return r;
}

inline Vf Vf::from_i8(const int8_t* p) {
  const int8x16_t b = vld1q_s8(p);
  const int16x8_t lo = vmovl_s8(vget_low_s8(b)), hi = vmovl_high_s8(b);
  const float32x4_t f[4] = {vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), vcvtq_f32_s32(vmovl_high_s16(lo)),
                            vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), vcvtq_f32_s32(vmovl_high_s16(hi))};
  Vf r;
  std::memcpy(&r.v, f, sizeof f);
  return r;
}

inline Vi round_to_i8(Vf x, int8_t* p) {
  Vi r;
  for (int i = 0; i < NP; ++i) r.v[i] = (i32n)vcvtnq_s32_f32((float32x4_t)x.v[i]);   // nearest, ties to even
  const int16x8_t lo = vcombine_s16(vqmovn_s32((int32x4_t)r.v[0]), vqmovn_s32((int32x4_t)r.v[1]));
  const int16x8_t hi = vcombine_s16(vqmovn_s32((int32x4_t)r.v[2]), vqmovn_s32((int32x4_t)r.v[3]));
  vst1q_s8(p, vcombine_s8(vqmovn_s16(lo), vqmovn_s16(hi)));
  return r;
}

inline int32x4_t dot4(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(acc, a, b);
#else
  const int16x8_t lo = vmull_s8(vget_low_s8(a), vget_low_s8(b)), hi = vmull_high_s8(a, b);
  return vaddq_s32(acc, vpaddlq_s16(vpaddq_s16(lo, hi)));   // |pair| <= 2 x 128 x 127 fits s16
#endif
}

inline Vi dot_u4(Vi acc, Vb w, Vb x) {
  for (int i = 0; i < NP; ++i)
    acc.v[i] = (i32n)dot4((int32x4_t)acc.v[i], vreinterpretq_s8_u8((uint8x16_t)w.v[i]),
                          vreinterpretq_s8_u8((uint8x16_t)x.v[i]));
  return acc;
}

inline Vi dot_q8(Vi acc, Vb u, Vb x) {
  for (int i = 0; i < NP; ++i) {
    const int8x16_t q = vreinterpretq_s8_u8(veorq_u8((uint8x16_t)u.v[i], vdupq_n_u8(0x80)));
    acc.v[i] = (i32n)dot4((int32x4_t)acc.v[i], q, vreinterpretq_s8_u8((uint8x16_t)x.v[i]));
  }
  return acc;
}

}  // namespace pw

#include "../vec/int32_sums.h"
