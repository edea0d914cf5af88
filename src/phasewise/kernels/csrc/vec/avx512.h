// The vector layer on AVX-512 (F, BW, VL, VNNI): one zmm register per vector. See vec.h; the int8
// dot products are arch/x86_avx512.h's.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>

namespace pw {

constexpr int W = 16;       // lanes per native vector

struct Mask {
  __mmask16 m;
};
inline Mask first_n(int64_t n) { return {static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1)}; }

struct Vf {
  __m512 v;
  static Vf load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vf load_n(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(first_n(n).m, p)}; }
  static Vf set1(float x) { return {_mm512_set1_ps(x)}; }
  static Vf zero() { return {_mm512_setzero_ps()}; }
  static Vf from_i8(const int8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  static Vf from_f16(const uint16_t* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store_n(float* p, int64_t n) const { _mm512_mask_storeu_ps(p, first_n(n).m, v); }
};

inline Vf operator+(Vf a, Vf b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vf operator-(Vf a, Vf b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vf operator*(Vf a, Vf b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vf operator/(Vf a, Vf b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vf fma(Vf a, Vf b, Vf c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vf max(Vf a, Vf b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Vf abs(Vf a) { return {_mm512_abs_ps(a.v)}; }
inline float reduce_add(Vf a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_max(Vf a) { return _mm512_reduce_max_ps(a.v); }
// The lanes summed as the pairwise tree ((a0 + a1) + (a2 + a3)) + ... (sum16 in attention.h).
inline float reduce_add_pairs(Vf a) {
  __m512 s = _mm512_add_ps(a.v, _mm512_permute_ps(a.v, 0xB1));    // lanes 2i, 2i + 1: a2i + a2i+1
  s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4E));               // lane 4i: the four's sum
  s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, 0xB1));         // lane 0: lanes 0..7
  s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, 0x4E));         // lane 0: 0..7 + 8..15
  return _mm512_cvtss_f32(s);
}
inline Mask operator>(Vf a, Vf b) { return {_mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ)}; }
inline Vf select(Mask m, Vf a, Vf b) { return {_mm512_mask_blend_ps(m.m, b.v, a.v)}; }

// e^x per lane: x log2(e) = n + f with |f| <= 1/2, 2^f by its Taylor series (|error| < 2e-7
// relative), then scaled by 2^n. Lanes below -103 (and -inf) give 0.
inline Vf exp(Vf x) {
  const __m512 t = _mm512_max_ps(_mm512_mul_ps(x.v, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(-160.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.525273380405984e-05f);
  for (float c : {1.5403530393381606e-04f, 1.3333558146428443e-03f, 9.618129107628477e-03f,
                  5.550410866482158e-02f, 2.402265069591007e-01f, 6.931471805599453e-01f, 1.f})
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return {_mm512_scalef_ps(p, n)};
}

// a[0..16) -> r with r[j] = the sum of a[j]'s lanes (a is overwritten).
inline Vf reduce16(Vf* a) {
  __m512 x[16];
  for (int i = 0; i < 16; ++i) x[i] = a[i].v;
  for (int i = 0; i < 8; ++i)          // pairs: each 128-bit lane k holds x[2i], x[2i+1] partials
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]), _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {        // quads: lane k holds partials of x[4i..4i+4)
    const __m512d p = _mm512_castps_pd(x[2 * i]), q = _mm512_castps_pd(x[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p, q)), _mm512_castpd_ps(_mm512_unpackhi_pd(p, q)));
  }
  for (int i = 0; i < 2; ++i)          // fold the four 128-bit lanes
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD))};
}

struct Vi {
  __m512i v;
  static Vi zero() { return {_mm512_setzero_si512()}; }
  static Vi set1(int32_t x) { return {_mm512_set1_epi32(x)}; }
  static Vi iota() { return {_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)}; }
  static Vi from_i16(const int16_t* p) { return {_mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
  static Vi from_i8(const uint8_t* p) { return {_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
  static Vi from_u8(const uint8_t* p) { return {_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
  void store(int32_t* p) const { _mm512_storeu_si512(p, v); }
};
inline Vi operator+(Vi a, Vi b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline Vi operator*(Vi a, Vi b) { return {_mm512_mullo_epi32(a.v, b.v)}; }
inline Mask operator>(Vi a, Vi b) { return {_mm512_cmpgt_epi32_mask(a.v, b.v)}; }
inline Vi select(Mask m, Vi a, Vi b) { return {_mm512_mask_blend_epi32(m.m, b.v, a.v)}; }
inline Vf to_float(Vi a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline Vi round_to_i8(Vf x, int8_t* p) {
  const __m512i q = _mm512_cvtps_epi32(x.v);   // MXCSR's rounding: nearest, ties to even
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(q));
  return {q};
}

struct Vb {
  __m512i v;
  static Vb load(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
  void store(uint8_t* p) const { _mm512_storeu_si512(p, v); }
  static Vb bcast4(const int8_t* p) {
    int32_t x;
    std::memcpy(&x, p, 4);
    return {_mm512_set1_epi32(x)};
  }
};
inline Vb lo4(Vb a) { return {_mm512_and_si512(a.v, _mm512_set1_epi8(0x0F))}; }
// 32 bytes of an int4 cache (byte i: code i low, code i + 32 high) -> its 64 codes in order
inline Vb unpack_nibbles(const uint8_t* p) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), m = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(x, m), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), m);
  return {_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)};
}
inline Vb hi4(Vb a) { return {_mm512_and_si512(_mm512_srli_epi16(a.v, 4), _mm512_set1_epi8(0x0F))}; }
template <int G>
inline Vb with_fifth(Vb nib, Vb bits) {
  const __m512i b = G <= 4 ? _mm512_slli_epi16(bits.v, 4 - G) : _mm512_srli_epi16(bits.v, G - 4);
  return {_mm512_or_si512(nib.v, _mm512_and_si512(b, _mm512_set1_epi8(0x10)))};
}
template <int J>           // nib with bits 2J, 2J + 1 of each byte of `pairs` as its bits 4, 5
inline Vb with_high2(Vb nib, Vb pairs) {
  const __m512i b = J <= 2 ? _mm512_slli_epi16(pairs.v, 4 - 2 * J) : _mm512_srli_epi16(pairs.v, 2 * J - 4);
  return {_mm512_or_si512(nib.v, _mm512_and_si512(b, _mm512_set1_epi8(0x30)))};
}
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

}  // namespace pw

#include "../arch/x86_avx512.h"
