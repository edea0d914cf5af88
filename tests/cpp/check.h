// What the kernel tests share: the pass and fail counts, a seeded generator, random data, the
// checks, and the test functions each file defines (main in kernel_tests.cpp runs them in order).
#pragma once
#include "kernels.h"

#include <cmath>
#include <cstdio>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace kt {

inline int passed = 0, failed = 0;
inline uint64_t digest = 14695981039346656037ull;   // FNV-1a of every checked result's bits (run.py compares builds)
inline std::mt19937 rng(1234);

inline float randn() { return std::normal_distribution<float>(0.f, 1.f)(rng); }
inline std::vector<float> randn(size_t n, float scale = 1.f) {
  std::vector<float> v(n);
  for (float& x : v) x = randn() * scale;
  return v;
}

// |got - want| <= atol + rtol |want| everywhere; one line per failing check.
inline void check_close(const std::string& name, const float* got, const float* want, size_t n, float rtol, float atol) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(got);
  for (size_t i = 0; i < n * sizeof(float); ++i) digest = (digest ^ bytes[i]) * 1099511628211ull;
  size_t bad = 0, worst = 0;
  float worst_err = 0.f;
  for (size_t i = 0; i < n; ++i) {
    const float err = std::fabs(got[i] - want[i]);
    if (!(err <= atol + rtol * std::fabs(want[i]))) {
      ++bad;
      if (!(err <= worst_err)) worst_err = err, worst = i;
    }
  }
  if (bad == 0) {
    ++passed;
    return;
  }
  ++failed;
  std::printf("FAILED %s: %zu of %zu differ; at %zu got %g, want %g\n", name.c_str(), bad, n, worst, got[worst],
              want[worst]);
}

inline void check(const std::string& name, bool ok) {
  ok ? ++passed : ++failed;
  if (!ok) std::printf("FAILED %s\n", name.c_str());
}

inline float half_to_float(uint16_t h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  const float v = e == 0 ? std::ldexp(static_cast<float>(m), -24) : std::ldexp(1.f + m / 1024.f, e - 15);
  return (h & 0x8000) ? -v : v;
}

// f to fp16 bits, rounded to nearest even (|f| <= 65504), as the layouts' fp16 scales are defined.
inline uint16_t float_to_half(float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(f));
  if (a == 0.0) return sign;
  int e;
  std::frexp(a, &e);                                   // a = m 2^e, m in [0.5, 1)
  int exp = std::max(e - 1, -14);                      // its binade's exponent (subnormals: -14's spacing)
  double units = std::nearbyint(a / std::ldexp(1.0, exp - 10));   // in fp16 steps of that binade, to even
  if (units >= 2048.0) units /= 2.0, exp += 1;         // rounded up into the next binade
  if (units < 1024.0) return static_cast<uint16_t>(sign | static_cast<uint32_t>(units));   // subnormal
  return static_cast<uint16_t>(sign | (static_cast<uint32_t>(exp + 15) << 10) | (static_cast<uint32_t>(units) - 1024));
}

inline uint16_t random_half(int min_exp, int max_exp) {   // a normal fp16 of either sign, 2^(min-15) .. 2^(max-14)
  const int e = std::uniform_int_distribution<int>(min_exp, max_exp)(rng);
  const int m = std::uniform_int_distribution<int>(0, 1023)(rng);
  return static_cast<uint16_t>(((rng() & 1) << 15) | (e << 10) | m);
}

inline const pw::Runtime RT{2};

// kv_quant_tests.cpp: a quantized cache (kernels.h) of `slots` slots and `tail_slots` tail slots, empty: bits 8
// an int8 cache, 4 an int4 one
struct QuantCache {
  QuantCache(int64_t slots, int64_t Hkv, int64_t D, int64_t tail_slots, int bits);
  pw::CacheOut out();
  pw::Cache reader(const float* fresh, const float* fresh_v = nullptr, int64_t ldv = 0) const;
  std::vector<int8_t> kq, vq;
  std::vector<float> kg, vs, tails;
  std::vector<int64_t> held;
  std::vector<uint8_t> k4, v4;
  std::vector<uint16_t> kg4, vs4;
  int64_t Hkv, D;
  int bits;
};
// Rows: query_lens[i] positions of sequence i ending at context_lens[i], its earlier tokens written in steps of
// 1 to 70 tokens; the writers' layout and every row's attention checked.
void test_kv_attention(const pw::KernelTable& k, int bits, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs,
                       const std::vector<int64_t>& query_lens, const std::vector<int64_t>& context_lens,
                       int64_t window = 0);
// A verify's drafts across a group's end, rejected, then again, beside a decoding sequence (blocks of a group).
void test_kv_verify(const pw::KernelTable& k, int bits, int64_t Hq, int64_t Hkv, int64_t D);
// quant_tests.cpp
std::vector<uint8_t> random_weight(pw::QuantFormat fmt, int64_t N, int64_t K, std::vector<float>& W,
                                   std::vector<float>& scale, int64_t u5_tiles, std::vector<uint16_t>* super);
void test_quant_linear(const pw::KernelTable& k, pw::QuantFormat fmt, int64_t M, int64_t N, int64_t K,
                       int64_t u5_tiles = 0);
void test_fused_parts(const pw::KernelTable& k, int64_t M, int64_t K);
// kv_bits: 0 an fp32 cache, 8 int8, 4 int4
void test_decoder_stack(const pw::KernelTable& k, int kv_bits, const std::vector<int64_t>& query_lens,
                        const std::vector<int64_t>& context_lens);
// expert_tests.cpp
void test_expert_mlp(const pw::KernelTable& k, pw::QuantFormat fmt, pw::QuantFormat down_fmt, int64_t T, int64_t kk);
void test_expert_mlp_exact(const pw::KernelTable& k, pw::QuantFormat fmt);
void test_float_linear(const pw::KernelTable& k);
void test_moe_route(const pw::KernelTable& k);
// delta_net_tests.cpp
void test_delta_net_mix(const pw::KernelTable& k, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t K, bool norm);
void test_short_conv(int64_t H, int64_t K);

}  // namespace kt
