// The vector layer in GCC vector extensions (GCC and Clang): a 16-lane vector is 16 / W native
// vectors of W lanes, W = 8 where the compiler targets AVX2 (ymm), else 4 (SSE2, NEON, or
// whatever 128-bit or scalar code the compiler makes for another CPU). The int8 dot products
// and the fp16 conversion come from arch/. See vec.h for the API.
#pragma once
#include <cstdint>
#include <cstring>
#include <initializer_list>
#if defined(__AVX2__) && defined(__FMA__) && !defined(PW_GENERIC)
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON) && !defined(PW_GENERIC)
#include <arm_neon.h>
#endif

namespace pw {

#if defined(__AVX2__) && defined(__FMA__) && !defined(PW_GENERIC)
#define PW_W 8
#else
#define PW_W 4
#endif
constexpr int W = PW_W;
constexpr int NP = 16 / W;   // native vectors per 16 lanes

typedef float f32n __attribute__((vector_size(4 * W)));
typedef int32_t i32n __attribute__((vector_size(4 * W)));
typedef int8_t i8n __attribute__((vector_size(4 * W)));      // 4 W signed bytes: W lanes of 4
typedef uint8_t u8n __attribute__((vector_size(4 * W)));
typedef uint16_t u16n __attribute__((vector_size(4 * W)));
// The same vectors at any address (unaligned loads and stores of native width).
typedef f32n f32n_u __attribute__((aligned(1), may_alias));
typedef i32n i32n_u __attribute__((aligned(1), may_alias));
typedef u8n u8n_u __attribute__((aligned(1), may_alias));
typedef int16_t i16n __attribute__((vector_size(2 * W)));
typedef i16n i16n_u __attribute__((aligned(1), may_alias));
typedef uint8_t u8w __attribute__((vector_size(W)));         // W bytes: one per lane
typedef u8w u8w_u __attribute__((aligned(1), may_alias));
typedef int8_t i8w __attribute__((vector_size(W)));
typedef i8w i8w_u __attribute__((aligned(1), may_alias));

struct Mask {
  i32n m[NP];   // -1 or 0 per lane
};

inline Mask first_n(int64_t n) {
  Mask r;
  for (int i = 0; i < NP; ++i)
    for (int k = 0; k < W; ++k) r.m[i][k] = i * W + k < n ? -1 : 0;
  return r;
}

struct Vf {
  f32n v[NP];
  static Vf load(const float* p) {
    Vf r;
    for (int i = 0; i < NP; ++i) r.v[i] = *reinterpret_cast<const f32n_u*>(p + i * W);
    return r;
  }
  static Vf load_n(const float* p, int64_t n) {
    if (n >= 16) return load(p);
    alignas(64) float t[16] = {};
    std::memcpy(t, p, 4 * (n > 0 ? n : 0));
    return load(t);
  }
  static Vf set1(float x) {
    Vf r;
    for (int i = 0; i < NP; ++i) r.v[i] = f32n{} + x;
    return r;
  }
  static Vf zero() { return set1(0.f); }
  // arch/: GCC 12 turns __builtin_convertvector from int8 to float into 16 scalar conversions on
  // every target (AVX2, SSE2, NEON), which made prefill attention over an int8 cache on AVX2
  // spend half its time here.
  static Vf from_i8(const int8_t* p);
  static Vf from_f16(const uint16_t* p);   // arch/
  void store(float* p) const {
    for (int i = 0; i < NP; ++i) *reinterpret_cast<f32n_u*>(p + i * W) = v[i];
  }
  void store_n(float* p, int64_t n) const {
    if (n >= 16) return store(p);
    alignas(64) float t[16];
    store(t);
    std::memcpy(p, t, 4 * (n > 0 ? n : 0));
  }
};

#define PW_LANEWISE(expr)             \
  Vf r;                               \
  for (int i = 0; i < NP; ++i) r.v[i] = expr; \
  return r

inline Vf operator+(Vf a, Vf b) { PW_LANEWISE(a.v[i] + b.v[i]); }
inline Vf operator-(Vf a, Vf b) { PW_LANEWISE(a.v[i] - b.v[i]); }
inline Vf operator*(Vf a, Vf b) { PW_LANEWISE(a.v[i] * b.v[i]); }
inline Vf operator/(Vf a, Vf b) { PW_LANEWISE(a.v[i] / b.v[i]); }
// fma as the ISA's own instruction where it has one: written a * b + c, -ffast-math's reassociation
// may split a chain of them into multiplies and adds (AVX2's P.V loop in tile_attention.cpp had
// one multiply and one add for every other FMA)
#if PW_W == 8
inline Vf fma(Vf a, Vf b, Vf c) { PW_LANEWISE((f32n)_mm256_fmadd_ps((__m256)a.v[i], (__m256)b.v[i], (__m256)c.v[i])); }
#elif defined(__aarch64__) && defined(__ARM_NEON) && !defined(PW_GENERIC)
inline Vf fma(Vf a, Vf b, Vf c) { PW_LANEWISE((f32n)vfmaq_f32((float32x4_t)c.v[i], (float32x4_t)a.v[i], (float32x4_t)b.v[i])); }
#else
inline Vf fma(Vf a, Vf b, Vf c) { PW_LANEWISE(a.v[i] * b.v[i] + c.v[i]); }
#endif
inline Vf max(Vf a, Vf b) { PW_LANEWISE(a.v[i] > b.v[i] ? a.v[i] : b.v[i]); }
inline Vf abs(Vf a) { PW_LANEWISE(a.v[i] < 0 ? -a.v[i] : a.v[i]); }
inline Vf select(Mask m, Vf a, Vf b) { PW_LANEWISE(m.m[i] ? a.v[i] : b.v[i]); }
#undef PW_LANEWISE

inline Mask operator>(Vf a, Vf b) {
  Mask r;
  for (int i = 0; i < NP; ++i) r.m[i] = a.v[i] > b.v[i];
  return r;
}

inline f32n fold(Vf a) {   // the NP native vectors added lane-wise
  f32n s = a.v[0];
  for (int i = 1; i < NP; ++i) s += a.v[i];
  return s;
}
// The lanes of s with lane k swapped for lane k ^ J (J < W, a constant).
#if PW_W == 8
#define PW_SWAP(s, J) __builtin_shufflevector(s, s, 0 ^ J, 1 ^ J, 2 ^ J, 3 ^ J, 4 ^ J, 5 ^ J, 6 ^ J, 7 ^ J)
#else
#define PW_SWAP(s, J) __builtin_shufflevector(s, s, 0 ^ J, 1 ^ J, 2 ^ J, 3 ^ J)
#endif
// A shuffle tree, as reduce_max: summed lane by lane (s[0] + s[1] + ...), GCC at AVX2 moved the
// lanes through the stack and general registers, a store-forwarding stall per call (two thirds
// of activation quantization's time).
inline float reduce_add(Vf a) {
  f32n s = fold(a);
#if PW_W == 8
  s += PW_SWAP(s, 4);
#endif
  s += PW_SWAP(s, 2);
  s += PW_SWAP(s, 1);
  return s[0];
}
// The 16 lanes summed as the pairwise tree ((a0 + a1) + (a2 + a3)) + ... (sum16 in attention.h):
// swaps of 1, 2 (and 4) lanes inside each native vector, then the native vectors pairwise.
inline float reduce_add_pairs(Vf a) {
  f32n v[NP];
  for (int i = 0; i < NP; ++i) {
    f32n s = a.v[i];
    s += PW_SWAP(s, 1);
    s += PW_SWAP(s, 2);
#if PW_W == 8
    s += PW_SWAP(s, 4);
#endif
    v[i] = s;
  }
  for (int n = NP; n > 1; n /= 2)
    for (int i = 0; i < n / 2; ++i) v[i] = v[2 * i] + v[2 * i + 1];
  return v[0][0];
}
inline float reduce_max(Vf a) {   // a shuffle tree: every lane ends as the maximum
  f32n s = a.v[0];
  for (int i = 1; i < NP; ++i) s = s > a.v[i] ? s : a.v[i];
  f32n t;
#if PW_W == 8
  t = PW_SWAP(s, 4), s = s > t ? s : t;
#endif
  t = PW_SWAP(s, 2), s = s > t ? s : t;
  t = PW_SWAP(s, 1), s = s > t ? s : t;
  return s[0];
}
#undef PW_SWAP

// e^x per lane, as avx512.h: x log2(e) = n + f with |f| <= 1/2, 2^f by its Taylor series, times
// 2^n built in the exponent bits. Lanes below -87 (and -inf) give 0, above 88.7 infinity (n = 128
// is the exponent field of infinity).
inline Vf exp(Vf x) {
  Vf r;
  for (int i = 0; i < NP; ++i) {
    f32n t = x.v[i] * 1.44269504088896341f;
    t = t > -126.f ? t : f32n{} - 126.f;
    t = t < 128.f ? t : f32n{} + 128.f;
    const i32n n = __builtin_convertvector(t + (t < 0 ? f32n{} - 0.5f : f32n{} + 0.5f), i32n);  // nearest
    const f32n f = t - __builtin_convertvector(n, f32n);
    f32n p = f32n{} + 1.525273380405984e-05f;
    for (float c : {1.5403530393381606e-04f, 1.3333558146428443e-03f, 9.618129107628477e-03f,
                    5.550410866482158e-02f, 2.402265069591007e-01f, 6.931471805599453e-01f, 1.f})
      p = p * f + c;
    f32n scale;
    const i32n bits = (n + 127) << 23;
    std::memcpy(&scale, &bits, sizeof scale);
    r.v[i] = x.v[i] > -87.f ? p * scale : f32n{};
  }
  return r;
}

// a[0..16) -> r with r[j] = the sum of a[j]'s lanes: each a[j] folded to one native vector, then
// pairs of vectors (x, y) -> even lanes of x y + odd lanes of x y, which halves the vectors and
// keeps their order, until each lane holds one whole sum.
inline f32n pair_sum(f32n x, f32n y) {
#if PW_W == 8
  return __builtin_shufflevector(x, y, 0, 2, 4, 6, 8, 10, 12, 14) + __builtin_shufflevector(x, y, 1, 3, 5, 7, 9, 11, 13, 15);
#else
  return __builtin_shufflevector(x, y, 0, 2, 4, 6) + __builtin_shufflevector(x, y, 1, 3, 5, 7);
#endif
}
inline Vf reduce16(Vf* a) {
  f32n s[16];
  for (int j = 0; j < 16; ++j) s[j] = fold(a[j]);
  for (int n = 16; n > NP; n /= 2)
    for (int i = 0; i < n / 2; ++i) s[i] = pair_sum(s[2 * i], s[2 * i + 1]);
  Vf r;
  for (int i = 0; i < NP; ++i) r.v[i] = s[i];
  return r;
}

struct Vi {
  i32n v[NP];
  static Vi zero() { return set1(0); }
  static Vi set1(int32_t x) {
    Vi r;
    for (int i = 0; i < NP; ++i) r.v[i] = i32n{} + x;
    return r;
  }
  static Vi iota() {
    Vi r;
    for (int i = 0; i < NP; ++i)
      for (int k = 0; k < W; ++k) r.v[i][k] = i * W + k;
    return r;
  }
  static Vi from_i16(const int16_t* p) {   // 16 int16, sign-extended
    Vi r;
    for (int i = 0; i < NP; ++i) r.v[i] = __builtin_convertvector(*reinterpret_cast<const i16n_u*>(p + i * W), i32n);
    return r;
  }
  static Vi from_i8(const uint8_t* p) {    // 16 bytes as int8, sign-extended
    Vi r;
    for (int i = 0; i < NP; ++i) r.v[i] = __builtin_convertvector(*reinterpret_cast<const i8w_u*>(p + i * W), i32n);
    return r;
  }
  static Vi from_u8(const uint8_t* p) {    // 16 bytes, zero-extended
    Vi r;
    for (int i = 0; i < NP; ++i) r.v[i] = __builtin_convertvector(*reinterpret_cast<const u8w_u*>(p + i * W), i32n);
    return r;
  }
  void store(int32_t* p) const {
    for (int i = 0; i < NP; ++i) *reinterpret_cast<i32n_u*>(p + i * W) = v[i];
  }
};
inline Vi operator+(Vi a, Vi b) {
  Vi r;
  for (int i = 0; i < NP; ++i) r.v[i] = a.v[i] + b.v[i];
  return r;
}
inline Vi operator*(Vi a, Vi b) {
  Vi r;
  for (int i = 0; i < NP; ++i) r.v[i] = a.v[i] * b.v[i];
  return r;
}
inline Mask operator>(Vi a, Vi b) {
  Mask r;
  for (int i = 0; i < NP; ++i) r.m[i] = a.v[i] > b.v[i];
  return r;
}
inline Vi select(Mask m, Vi a, Vi b) {
  Vi r;
  for (int i = 0; i < NP; ++i) r.v[i] = m.m[i] ? a.v[i] : b.v[i];
  return r;
}
inline Vf to_float(Vi a) {
  Vf r;
  for (int i = 0; i < NP; ++i) r.v[i] = __builtin_convertvector(a.v[i], f32n);
  return r;
}

struct Vb {
  u8n v[NP];   // native vector i: lanes i W .. i W + W - 1, 4 bytes each
  static Vb load(const uint8_t* p) {
    Vb r;
    for (int i = 0; i < NP; ++i) r.v[i] = *reinterpret_cast<const u8n_u*>(p + i * 4 * W);
    return r;
  }
  static Vb bcast4(const int8_t* p) {
    int32_t x;
    std::memcpy(&x, p, 4);
    const u8n b = (u8n)(i32n{} + x);
    Vb r;
    for (int i = 0; i < NP; ++i) r.v[i] = b;
    return r;
  }
  void store(uint8_t* p) const {
    for (int i = 0; i < NP; ++i) *reinterpret_cast<u8n_u*>(p + i * 4 * W) = v[i];
  }
};
inline Vb lo4(Vb a) {
  for (int i = 0; i < NP; ++i) a.v[i] &= 0x0F;
  return a;
}
inline Vb hi4(Vb a) {
  for (int i = 0; i < NP; ++i) a.v[i] >>= 4;
  return a;
}
// 32 bytes of an int4 cache (byte i: code i low, code i + 32 high) -> its 64 codes in order
inline Vb unpack_nibbles(const uint8_t* p) {
  constexpr int half = NP / 2;
  Vb r;
  for (int i = 0; i < NP; ++i) {
    const u8n x = *reinterpret_cast<const u8n_u*>(p + (i % half) * 4 * W);
    r.v[i] = i < half ? x & 0x0F : x >> 4;
  }
  return r;
}
template <int J>            // nib with bits 2J, 2J + 1 of each byte of `pairs` as its bits 4, 5 (16-bit shifts)
inline Vb with_high2(Vb nib, Vb pairs) {
  for (int i = 0; i < NP; ++i) {
    const u16n b = (u16n)pairs.v[i];
    nib.v[i] |= (u8n)((J <= 2 ? b << (4 - 2 * J) : b >> (2 * J - 4)) & 0x3030);
  }
  return nib;
}
template <int G>            // nib with bit G of each byte of `bits` as its bit 4 (shifts of 16-bit lanes)
inline Vb with_fifth(Vb nib, Vb bits) {
  for (int i = 0; i < NP; ++i) {
    const u16n b = (u16n)bits.v[i];
    nib.v[i] |= (u8n)((G <= 4 ? b << (4 - G) : b >> (G - 4)) & 0x1010);
  }
  return nib;
}

inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

}  // namespace pw

#if defined(PW_GENERIC)
#include "../arch/generic.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "../arch/x86_avx2.h"
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include "../arch/arm_neon.h"
#else
#include "../arch/generic.h"
#endif
