// The kernel library's own tests, in plain C++: every function of the table against a scalar
// reference written here, for the ISA level the library was compiled for. They need no torch, so
// they run where torch cannot: ARM builds under qemu-user (make test-arm). The Python tests
// compare the same kernels with PyTorch's references on this machine's own levels.
// Here: the elementwise ops, RoPE and the cache writes, attention; kv_quant_tests.cpp: the int8 and int4
// caches' writers and attention over them; quant_tests.cpp: the quantized linear layers and the decoder
// stack; expert_tests.cpp: the experts; delta_net_tests.cpp: the Gated DeltaNet's mix. An argument runs one
// part alone (ops, kv, quant, stack, experts, delta: `kernel_tests kv` the quantized caches' tests, their
// decoder stacks included).
#include "check.h"

#include <algorithm>
#include <cstring>

namespace kt {

void test_elementwise(const pw::KernelTable& k) {
  const int64_t T = 5, I = 72, H = 96;
  auto x = randn(T * 2 * I, 4.f);
  for (int64_t i = 0; i < 16; ++i) x[i] = -200.f + 25.f * i;    // gates far past e^x's range both ways
  std::vector<float> out(T * I), want(T * I);
  k.silu_and_mul(RT, x.data(), T, I, out.data());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < I; ++i) {
      const float g = x[t * 2 * I + i], u = x[t * 2 * I + I + i];
      want[t * I + i] = g / (1.f + std::exp(-g)) * u;
    }
  check_close("silu_and_mul", out.data(), want.data(), out.size(), 1e-5f, 1e-6f);

  auto a = randn(T * H), r = randn(T * H), w = randn(H);
  std::vector<float> normed(T * H), sum(T * H), want_n(T * H), want_s(T * H);
  k.rms_norm(RT, a.data(), r.data(), w.data(), T, H, 1e-5f, normed.data(), sum.data());
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int64_t i = 0; i < H; ++i) want_s[t * H + i] = a[t * H + i] + r[t * H + i], ss += want_s[t * H + i] * want_s[t * H + i];
    const float inv = 1.f / std::sqrt(static_cast<float>(ss / H) + 1e-5f);
    for (int64_t i = 0; i < H; ++i) want_n[t * H + i] = want_s[t * H + i] * inv * w[i];
  }
  check_close("rms_norm residual sum", sum.data(), want_s.data(), sum.size(), 0.f, 0.f);
  check_close("rms_norm", normed.data(), want_n.data(), normed.size(), 1e-5f, 1e-6f);

  for (int64_t V : {1, 15, 16, 17, 1000}) {
    std::vector<float> logits(4 * V);
    for (float& v : logits) v = std::round(randn() * 2.f);   // many ties: the first index wins
    std::fill(logits.begin() + V, logits.begin() + V + V / 2, -INFINITY);
    logits[3 * V + V - 1] = 1e30f;                            // the last (maybe partial) vector
    std::vector<int64_t> got(4), alone(4);
    k.argmax_rows(RT, logits.data(), 4, V, got.data());
    bool ok = true;
    for (int64_t b = 0; b < 4; ++b) {
      const float* row = logits.data() + b * V;
      k.argmax_rows(RT, row, 1, V, &alone[b]);            // one row: in a piece per thread
      ok &= got[b] == std::max_element(row, row + V) - row && alone[b] == got[b];
    }
    check("argmax_rows V=" + std::to_string(V), ok);

    const int64_t W = (V + 31) / 32;                      // mask_rows: -inf where the bit is clear
    std::vector<int32_t> words(4 * W);
    for (int64_t u = 0; u < 4 * W; ++u) words[u] = u % 3 == 0 ? -1 : u % 3 == 1 ? 0 : int32_t(randn() * 1e9f);
    std::vector<float> masked(4 * V);
    k.mask_rows(RT, logits.data(), 4, V, words.data(), masked.data());
    bool mask_ok = true;
    for (int64_t b = 0; b < 4; ++b)
      for (int64_t t = 0; t < V; ++t) {
        const bool allowed = (static_cast<uint32_t>(words[b * W + t / 32]) >> (t % 32)) & 1u;
        const float x = logits[b * V + t], m = masked[b * V + t];
        mask_ok &= allowed ? (m == x || (std::isnan(m) && std::isnan(x))) : m == -INFINITY;
      }
    check("mask_rows V=" + std::to_string(V), mask_ok);
  }
}

void test_rope_and_cache(const pw::KernelTable& k) {
  const int64_t Hq = 6, Hkv = 2, D = 64, T = 5, P = 64, S = 32, half = D / 2;
  auto qkv = randn(T * (Hq + 2 * Hkv) * D, 3.f);
  std::vector<float> cs(P * half), sn(P * half);
  for (int64_t p = 0; p < P; ++p)
    for (int64_t i = 0; i < half; ++i) {
      const float a = p * std::pow(10000.f, -2.f * i / D);
      cs[p * half + i] = std::cos(a), sn[p * half + i] = std::sin(a);
    }
  const std::vector<int64_t> pos{0, 3, 9, 10, 63}, slots{4, 17, 2, 30, 8};
  std::vector<float> q(T * Hq * D), kk(T * Hkv * D), kc(S * Hkv * D), vc(S * Hkv * D);
  pw::CacheOut c;
  c.k = kc.data(), c.v = vc.data();
  const pw::AttentionRows none{nullptr, 0, nullptr, nullptr, 16};
  k.rope_and_cache(RT, qkv.data(), T, pos.data(), cs.data(), sn.data(), Hq, Hkv, D, slots.data(), none, c, q.data(),
                   kk.data());
  std::vector<float> want_q(q.size()), want_k(kk.size());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < Hq + Hkv; ++h) {
      const float* x = qkv.data() + (t * (Hq + 2 * Hkv) + h) * D;
      float* y = h < Hq ? want_q.data() + (t * Hq + h) * D : want_k.data() + (t * Hkv + h - Hq) * D;
      for (int64_t i = 0; i < half; ++i) {
        const float c0 = cs[pos[t] * half + i], s0 = sn[pos[t] * half + i];
        y[i] = x[i] * c0 - x[i + half] * s0;
        y[i + half] = x[i + half] * c0 + x[i] * s0;
      }
    }
  check_close("rope q", q.data(), want_q.data(), q.size(), 1e-5f, 1e-5f);
  check_close("rope k", kk.data(), want_k.data(), kk.size(), 1e-5f, 1e-5f);
  bool ok = true;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t at = slots[t] * Hkv + h;
      for (int which = 0; which < 2; ++which) {
        const float* x = which ? qkv.data() + (t * (Hq + 2 * Hkv) + Hq + Hkv + h) * D : want_k.data() + (t * Hkv + h) * D;
        for (int64_t d = 0; d < D; ++d)
          ok &= std::fabs((which ? vc : kc)[at * D + d] - x[d]) <= 1e-5f * (1.f + std::fabs(x[d]));
      }
    }
  check("rope cache writes", ok);
}

// Scalar attention of one query row over the first len tokens of an fp32 paged cache.
void attend_ref(const pw::Cache& c, const int64_t* table, int64_t bs, const float* q, int64_t Hq, int64_t len,
                float scale, float* out, int64_t window = 0) {
  const int64_t D = c.D, G = Hq / c.Hkv, first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  std::vector<double> s(len);
  for (int64_t h = 0; h < Hq; ++h) {
    const int64_t hk = h / G;
    double mx = -INFINITY, sum = 0;
    for (int64_t p = first; p < len; ++p) {
      const int64_t at = (table[p / bs] * bs + p % bs) * c.Hkv + hk;
      double dot = 0;
      for (int64_t d = 0; d < D; ++d) dot += q[h * D + d] * c.k[at * D + d];
      s[p] = dot * scale, mx = std::max(mx, s[p]);
    }
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = 0.f;
    for (int64_t p = first; p < len; ++p) {
      const int64_t at = (table[p / bs] * bs + p % bs) * c.Hkv + hk;
      const double w = std::exp(s[p] - mx);
      sum += w;
      for (int64_t d = 0; d < D; ++d) out[h * D + d] += w * c.v[at * D + d];
    }
    for (int64_t d = 0; d < D; ++d) out[h * D + d] /= sum;
  }
}

// Rows: query_lens[i] consecutive positions of sequence i ending at context_lens[i] (an fp32 cache;
// kv_quant_tests.cpp the quantized ones).
void test_attention(const pw::KernelTable& k, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs,
                    const std::vector<int64_t>& query_lens, const std::vector<int64_t>& context_lens,
                    int64_t window = 0) {
  const int64_t nseq = query_lens.size();
  int64_t blocks = 2, max_blocks = 0;
  for (int64_t c : context_lens) blocks += (c + bs - 1) / bs, max_blocks = std::max(max_blocks, (c + bs - 1) / bs);
  std::vector<int64_t> perm(blocks);
  for (int64_t i = 0; i < blocks; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int64_t> tables(nseq * max_blocks, 0), seq, len;
  for (int64_t i = 0, used = 0; i < nseq; ++i) {
    for (int64_t b = 0; b < (context_lens[i] + bs - 1) / bs; ++b) tables[i * max_blocks + b] = perm[used++];
    for (int64_t r = 0; r < query_lens[i]; ++r) seq.push_back(i), len.push_back(context_lens[i] - query_lens[i] + r + 1);
  }
  const int64_t T = seq.size(), slots = blocks * bs;
  auto kf = randn(slots * Hkv * D, 2.f), vf = randn(slots * Hkv * D, 2.f), q = randn(T * Hq * D);
  pw::Cache c;
  c.Hkv = Hkv, c.D = D, c.k = kf.data(), c.v = vf.data();
  const pw::AttentionRows rows{tables.data(), max_blocks, seq.data(), len.data(), bs, window};
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  std::vector<float> out(T * Hq * D), want(T * Hq * D);
  k.paged_attention(RT, q.data(), T, Hq, c, rows, scale, out.data());
  for (int64_t t = 0; t < T; ++t)
    attend_ref(c, tables.data() + seq[t] * max_blocks, bs, q.data() + t * Hq * D, Hq, len[t], scale,
               want.data() + t * Hq * D, window);
  char name[160];
  std::snprintf(name, sizeof name, "paged_attention Hq=%lld Hkv=%lld D=%lld bs=%lld fp32 rows=%lld window=%lld",
                (long long)Hq, (long long)Hkv, (long long)D, (long long)bs, (long long)T, (long long)window);
  check_close(name, out.data(), want.data(), out.size(), 1e-4f, 5e-5f);
}

// The quantized caches (kv_quant_tests.cpp), int8 and int4 alike, the shapes placed on each's key group G:
// decode rows of every lane count (the row kernel; 9+ query heads a KV head: tiles of one row), rows past, at
// and before a group's end; head sizes of the vector kernels and of the scalar loop; prompt chunks in tiles
// from inside a group across its end, ending at one, a whole prompt; sliding windows; verifies.
void test_kv_caches(const pw::KernelTable& k) {
  for (int bits : {8, 4}) {
    const int64_t G = bits == 4 ? pw::KEY_GROUP4 : pw::KEY_GROUP;
    for (const auto& h : std::vector<std::vector<int64_t>>{{4, 4}, {8, 4}, {12, 3}, {9, 3}, {14, 2}, {8, 1}, {7, 1}, {18, 3}})
      test_kv_attention(k, bits, h[0], h[1], 64, G, {1, 1, 1, 1}, {300, G + 1, G, 3});
    for (int64_t D : bits == 4 ? std::vector<int64_t>{64, 128, 256, 192} : std::vector<int64_t>{64, 128, 256, 32, 80})
      test_kv_attention(k, bits, 8, 2, D, G, {1, 1, 5}, {70, 1000, G + 2});   // a long context in parts; a run
    test_kv_attention(k, bits, 9, 3, 64, 2 * G, {1, 5, 12, G + 1, 2 * G + 4}, {2 * G + 12, 5, G + 6, 2 * G, 2 * G + 4});
    test_kv_attention(k, bits, 8, 2, 128, G, {4, 20, G + 1}, {9, G + 10, 2 * G + 1});
    test_kv_attention(k, bits, 4, 1, 256, G, {37, 1, 1}, {100, 700, 30}, 40);
    test_kv_attention(k, bits, 6, 2, 64, 2 * G, {1, 1, G + 3}, {G + 30, 3 * G, 2 * G + 3}, G / 2 + 3);
    for (const auto& h : std::vector<std::vector<int64_t>>{{8, 2}, {4, 4}, {16, 1}})
      test_kv_verify(k, bits, h[0], h[1], 64);
    test_kv_verify(k, bits, 6, 2, bits == 4 ? 192 : 80);                      // the scalar loop
  }
  for (int kv_bits : {8, 4}) {
    test_decoder_stack(k, kv_bits, {1}, {1});                                   // the first decode step
    test_decoder_stack(k, kv_bits, {1, 12, 1}, {40, 12, 300});                  // decodes, a prompt chunk
    // a row that fills a group, a verify's run and a chunk across a group's end, a row just past two groups
    test_decoder_stack(k, kv_bits, {1, 6, 20, 1}, {64, 67, 80, 129});
  }
}

}  // namespace kt

int main(int argc, char** argv) {
  using namespace kt;
  const pw::KernelTable& k = *pw_kernel_table();
  const std::string only = argc > 1 ? argv[1] : "";
  auto part = [&](const char* name) { return only.empty() || only == name; };
  std::printf("kernel tests, ISA level %s%s%s\n", k.isa, only.empty() ? "" : ", part ", only.c_str());
  check("abi", k.abi == pw::ABI_VERSION);
  if (part("ops")) {
    test_elementwise(k);
    test_rope_and_cache(k);
    for (const auto& h : std::vector<std::vector<int64_t>>{{4, 4}, {8, 4}, {12, 3}, {9, 3}, {14, 2}, {8, 1}})
      test_attention(k, h[0], h[1], 64, 16, {1, 1, 1}, {300, 17, 64});          // decode rows
    for (int64_t D : {64, 128, 256, 32, 80})                                      // vector and scalar head sizes
      test_attention(k, 8, 2, D, 16, {1, 1}, {70, 1000});                       // a long context in parts
    test_attention(k, 9, 3, 64, 16, {1, 5, 12, 1}, {40, 5, 30, 16});             // prompt chunks in tiles
    test_attention(k, 8, 2, 128, 32, {4, 20, 40}, {9, 50, 40});
    test_attention(k, 4, 1, 256, 16, {37, 1, 1}, {100, 700, 30}, 40);        // sliding window: tiles and rows
  }
  if (part("kv")) test_kv_caches(k);
  if (part("quant")) {
    for (pw::QuantFormat fmt : {pw::Q4, pw::Q8, pw::I8, pw::K8, pw::Q5, pw::K6})
      for (const auto& mnk : std::vector<std::vector<int64_t>>{{1, 576, 576}, {3, 40, 64}, {5, 960, 128}, {130, 48, 96}})
        test_quant_linear(k, fmt, mnk[0], mnk[1], mnk[2]);
    for (const auto& mnk : std::vector<std::vector<int64_t>>{{1, 576, 256}, {3, 40, 512}, {5, 960, 256}, {130, 48, 768}})
      for (pw::QuantFormat fmt : {pw::K4, pw::Q6K})
        test_quant_linear(k, fmt, mnk[0], mnk[1], mnk[2]);      // whole super-blocks of 256
    for (int64_t M : {1, 5, 130}) test_fused_parts(k, M, 512);
    for (const auto& mnk : std::vector<std::vector<int64_t>>{{1, 40, 64}, {130, 48, 96}, {5, 64, 128}, {3, 32, 64}})
      test_quant_linear(k, pw::Q8, mnk[0], mnk[1], mnk[2], 2);  // 2 U5 tiles, then Q8 (partly padding; none)
  }
  if (part("stack")) {                                          // over an fp32 cache (quantized ones: kv)
    test_decoder_stack(k, 0, {1}, {1});                                         // the first decode step
    test_decoder_stack(k, 0, {1, 12, 1}, {40, 12, 300});                        // decodes, a prompt chunk
  }
  if (part("experts")) {
    for (pw::QuantFormat fmt : {pw::Q4, pw::Q8, pw::I8, pw::K4, pw::K8, pw::Q5, pw::K6, pw::Q6K})
      test_expert_mlp_exact(k, fmt);
    for (const auto& f : std::vector<std::vector<pw::QuantFormat>>{{pw::K4, pw::Q6K}, {pw::Q4, pw::Q8}, {pw::Q5, pw::K4}})
      for (int64_t T : {1, 7, 40}) test_expert_mlp(k, f[0], f[1], T, 3);
    test_float_linear(k);
    test_moe_route(k);
  }
  if (part("delta")) {
    for (bool norm : {false, true}) {
      test_delta_net_mix(k, 2, 2, 16, 16, 4, norm);      // one v head per k head
      test_delta_net_mix(k, 2, 4, 16, 40, 4, norm);      // two; a partial vector of columns after a pair
      test_delta_net_mix(k, 1, 2, 8, 8, 3, norm);        // heads narrower than a vector
      test_delta_net_mix(k, 1, 2, 128, 128, 4, norm);    // Qwen3.5's head sizes
    }
    test_short_conv(40, 3);                               // LFM2's taps; a partial vector of channels
    test_short_conv(64, 4);
  }
  if (part("ops")) check("int8_peak_gops", k.int8_peak_gops(RT, 2000) > 0.0);
  std::printf("results digest %016llx\n%d passed, %d failed\n", static_cast<unsigned long long>(digest), passed, failed);
  return failed == 0 ? 0 : 1;
}
