// x86 AVX2 + FMA + F16C (x86-64-v3): the int8 dot products and the fp16 conversion of the
// portable vector layer (vec/portable.h, W = 8: two ymm registers per 16 lanes).
// With AVX-VNNI (Alder Lake, Zen 5) one vpdpbusd per half; without it, vpmaddubsw (u8 x s8 ->
// pairs of s16) then vpmaddwd by ones (-> s32 sums of 4). vpmaddubsw saturates past 32767, so
// Q8's biased bytes (up to 255 x 127 x 2) go through the sign trick instead: |q| x (x with q's
// sign), at most 128 x 127 x 2.
#pragma once
#include <immintrin.h>

namespace pw {

#if defined(__AVXVNNI__)
constexpr const char* ISA = "avx2-vnni";
constexpr bool Q8_BIASED = true;
#else
constexpr const char* ISA = "avx2";
constexpr bool Q8_BIASED = false;
#endif

inline Vf Vf::from_f16(const uint16_t* p) {
  Vf r;
  for (int i = 0; i < NP; ++i) {
    const __m256 h = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * i)));
    std::memcpy(&r.v[i], &h, 32);
  }
  return r;
}

inline Vf Vf::from_i8(const int8_t* p) {
  Vf r;
  for (int i = 0; i < NP; ++i) {
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i))));
    std::memcpy(&r.v[i], &f, 32);
  }
  return r;
}

inline Vi round_to_i8(Vf x, int8_t* p) {
  Vi r;
  for (int i = 0; i < NP; ++i) r.v[i] = (i32n)_mm256_cvtps_epi32((__m256)x.v[i]);   // nearest, ties to even
  // int16 in 128-bit halves (0-3 8-11 | 4-7 12-15), put in order, then bytes
  const __m256i h = _mm256_permute4x64_epi64(_mm256_packs_epi32((__m256i)r.v[0], (__m256i)r.v[1]), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
  return r;
}

inline __m256i as_m256i(const u8n& v) { return reinterpret_cast<const __m256i&>(v); }

inline Vi dot_u4(Vi acc, Vb w, Vb x) {
  for (int i = 0; i < NP; ++i) {
#if defined(__AVXVNNI__)
    acc.v[i] = (i32n)_mm256_dpbusd_avx_epi32((__m256i)acc.v[i], as_m256i(w.v[i]), as_m256i(x.v[i]));
#else
    const __m256i pairs = _mm256_maddubs_epi16(as_m256i(w.v[i]), as_m256i(x.v[i]));
    acc.v[i] += (i32n)_mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
  }
  return acc;
}

inline Vi dot_q8(Vi acc, Vb u, Vb x) {
  for (int i = 0; i < NP; ++i) {
#if defined(__AVXVNNI__)
    acc.v[i] = (i32n)_mm256_dpbusd_avx_epi32((__m256i)acc.v[i], as_m256i(u.v[i]), as_m256i(x.v[i]));
#else
    const __m256i q = _mm256_xor_si256(as_m256i(u.v[i]), _mm256_set1_epi8(static_cast<char>(0x80)));
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(as_m256i(x.v[i]), q));
    acc.v[i] += (i32n)_mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
  }
  return acc;
}

#if !defined(__AVXVNNI__)
constexpr int VS_U6 = 2;   // int16 pairs of 6-bit bytes: 2 calls x 2 x 63 x 127 < 32768
constexpr int VS_U5 = 4;   // and of 5-bit bytes: 4 calls x 2 x 31 x 127 < 32768
struct Vs {              // int16 pair sums of vpmaddubsw, widened once per 8 calls
  __m256i v[NP];
  static Vs zero() { return {{_mm256_setzero_si256(), _mm256_setzero_si256()}}; }
};
inline Vs dot_u4s(Vs acc, Vb w, Vb x) {
  for (int i = 0; i < NP; ++i) acc.v[i] = _mm256_add_epi16(acc.v[i], _mm256_maddubs_epi16(as_m256i(w.v[i]), as_m256i(x.v[i])));
  return acc;
}
inline Vi widen(Vs acc) {
  Vi r;
  for (int i = 0; i < NP; ++i) r.v[i] = (i32n)_mm256_madd_epi16(acc.v[i], _mm256_set1_epi16(1));
  return r;
}
// widen_by's factor: sc (|sc| <= 128) in both int16 halves of each lane, for vpmaddwd
inline Vi pair_factor(Vi sc) {
  Vi r;
  for (int i = 0; i < NP; ++i) r.v[i] = (sc.v[i] & 0xFFFF) | (sc.v[i] << 16);
  return r;
}
inline Vi widen_by(Vs acc, Vi by) {   // the pair sums times sc, summed: the widening's own multiply
  Vi r;
  for (int i = 0; i < NP; ++i) r.v[i] = (i32n)_mm256_madd_epi16(acc.v[i], (__m256i)by.v[i]);
  return r;
}
#endif

}  // namespace pw

#if defined(__AVXVNNI__)
#include "../vec/int32_sums.h"
#endif
