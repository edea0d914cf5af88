// Any other CPU: the int8 dot products and the fp16 conversion of the portable vector layer in
// plain C++ (the compiler vectorises what it can).
#pragma once
#include <cmath>

namespace pw {

constexpr const char* ISA = "generic";
constexpr bool Q8_BIASED = false;

// A loop the compiler vectorises (sign extensions, then one conversion per native vector).
inline Vf Vf::from_i8(const int8_t* p) {
  alignas(64) float out[16];
  for (int k = 0; k < 16; ++k) out[k] = static_cast<float>(p[k]);
  return load(out);
}

inline Vi round_to_i8(Vf x, int8_t* p) {
  alignas(64) float f[16];
  alignas(64) int32_t q[16];
  x.store(f);
  for (int k = 0; k < 16; ++k) {
    q[k] = static_cast<int32_t>(std::nearbyint(f[k]));   // the current rounding: nearest, ties to even
    p[k] = static_cast<int8_t>(q[k] < -128 ? -128 : q[k] > 127 ? 127 : q[k]);
  }
  Vi r;
  std::memcpy(&r.v, q, sizeof q);
  return r;
}

// fp16 bits -> fp32: a normal number's exponent and mantissa moved into place, then one multiply
// by 2^112 rescales the exponent bias; a subnormal is its mantissa times 2^-24 (no fp32
// subnormal on the way, which flush-to-zero would lose). Infinities and NaNs are not expected.
inline Vf Vf::from_f16(const uint16_t* p) {
  alignas(64) float out[16];
  for (int k = 0; k < 16; ++k) {
    const uint32_t h = p[k], bits = (h & 0x7FFFu) << 13;
    float f;
    if (h & 0x7C00u) {
      std::memcpy(&f, &bits, 4);
      f *= 5.192296858534828e+33f;                                 // 2^112
    } else {
      f = static_cast<float>(h & 0x3FFu) * 5.9604644775390625e-08f;  // 2^-24
    }
    out[k] = (h & 0x8000u) ? -f : f;
  }
  return load(out);
}

// acc + per lane the sum of its 4 byte products, in vectors of W lanes: bytes widened to int16,
// multiplied (|product| <= 128 x 127), pairs added in int16 (<= 32512), then pairs of pairs in int32.
typedef int16_t i16b __attribute__((vector_size(8 * W)));   // 4 W int16: one per byte
typedef int16_t i16h __attribute__((vector_size(4 * W)));   // 2 W int16: one per pair
typedef int32_t i32h __attribute__((vector_size(8 * W)));
inline Vi dot_bytes(Vi acc, const Vb& a, const Vb& b, bool a_biased) {
  for (int i = 0; i < NP; ++i) {
    i16b x = __builtin_convertvector(a.v[i], i16b);
    if (a_biased) x -= 128;
    const i16b p = x * __builtin_convertvector((i8n)b.v[i], i16b);
#if PW_W == 8
    const i16h pairs = __builtin_shufflevector(p, p, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
                       __builtin_shufflevector(p, p, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const i32h wide = __builtin_convertvector(pairs, i32h);
    acc.v[i] += __builtin_shufflevector(wide, wide, 0, 2, 4, 6, 8, 10, 12, 14) +
                __builtin_shufflevector(wide, wide, 1, 3, 5, 7, 9, 11, 13, 15);
#else
    const i16h pairs = __builtin_shufflevector(p, p, 0, 2, 4, 6, 8, 10, 12, 14) +
                       __builtin_shufflevector(p, p, 1, 3, 5, 7, 9, 11, 13, 15);
    const i32h wide = __builtin_convertvector(pairs, i32h);
    acc.v[i] += __builtin_shufflevector(wide, wide, 0, 2, 4, 6) + __builtin_shufflevector(wide, wide, 1, 3, 5, 7);
#endif
  }
  return acc;
}
inline Vi dot_u4(Vi acc, Vb w, Vb x) { return dot_bytes(acc, w, x, false); }
inline Vi dot_q8(Vi acc, Vb u, Vb x) { return dot_bytes(acc, u, x, true); }

}  // namespace pw

#include "../vec/int32_sums.h"
