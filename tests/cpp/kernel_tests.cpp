// The kernel library's own tests, in plain C++: every function of the table against a scalar
// reference written here, for the ISA level the library was compiled for. They need no torch, so
// they run where torch cannot: ARM builds under qemu-user (make test-arm). The Python tests
// compare the same kernels with PyTorch's references on this machine's own levels.
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

int passed = 0, failed = 0;
std::mt19937 rng(1234);

float randn() { return std::normal_distribution<float>(0.f, 1.f)(rng); }
std::vector<float> randn(size_t n, float scale = 1.f) {
  std::vector<float> v(n);
  for (float& x : v) x = randn() * scale;
  return v;
}

// |got - want| <= atol + rtol |want| everywhere; one line per failing check.
void check_close(const std::string& name, const float* got, const float* want, size_t n, float rtol, float atol) {
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

void check(const std::string& name, bool ok) {
  ok ? ++passed : ++failed;
  if (!ok) std::printf("FAILED %s\n", name.c_str());
}

float half_to_float(uint16_t h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  const float v = e == 0 ? std::ldexp(static_cast<float>(m), -24) : std::ldexp(1.f + m / 1024.f, e - 15);
  return (h & 0x8000) ? -v : v;
}

uint16_t random_half(int min_exp, int max_exp) {   // a normal fp16 of either sign, 2^(min-15) .. 2^(max-14)
  const int e = std::uniform_int_distribution<int>(min_exp, max_exp)(rng);
  const int m = std::uniform_int_distribution<int>(0, 1023)(rng);
  return static_cast<uint16_t>(((rng() & 1) << 15) | (e << 10) | m);
}

const pw::Runtime RT{2};

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
  }
}

void test_rope_and_cache(const pw::KernelTable& k, bool int8) {
  const int64_t Hq = 6, Hkv = 2, D = 64, T = 5, P = 64, S = 32, half = D / 2;
  auto qkv = randn(T * (Hq + 2 * Hkv) * D, 3.f);
  std::vector<float> cs(P * half), sn(P * half);
  for (int64_t p = 0; p < P; ++p)
    for (int64_t i = 0; i < half; ++i) {
      const float a = p * std::pow(10000.f, -2.f * i / D);
      cs[p * half + i] = std::cos(a), sn[p * half + i] = std::sin(a);
    }
  const std::vector<int64_t> pos{0, 3, 9, 10, 63}, slots{4, 17, 2, 30, 8};
  std::vector<float> q(T * Hq * D), kk(T * Hkv * D), kc(S * Hkv * D), vc(S * Hkv * D), ks(S * Hkv), vs(S * Hkv);
  std::vector<int8_t> kq(S * Hkv * D), vq(S * Hkv * D);
  pw::CacheOut c;
  if (int8) c.kq = kq.data(), c.vq = vq.data(), c.ks = ks.data(), c.vs = vs.data();
  else c.k = kc.data(), c.v = vc.data();
  k.rope_and_cache(RT, qkv.data(), T, pos.data(), cs.data(), sn.data(), Hq, Hkv, D, slots.data(), c, q.data(),
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
  const std::string tag = int8 ? " (int8 cache)" : "";
  check_close("rope q" + tag, q.data(), want_q.data(), q.size(), 1e-5f, 1e-5f);
  check_close("rope k" + tag, kk.data(), want_k.data(), kk.size(), 1e-5f, 1e-5f);
  bool ok = true;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t at = slots[t] * Hkv + h;
      for (int which = 0; which < 2; ++which) {
        const float* x = which ? qkv.data() + (t * (Hq + 2 * Hkv) + Hq + Hkv + h) * D : want_k.data() + (t * Hkv + h) * D;
        for (int64_t d = 0; d < D; ++d) {
          if (!int8) {
            ok &= std::fabs((which ? vc : kc)[at * D + d] - x[d]) <= 1e-5f * (1.f + std::fabs(x[d]));
            continue;
          }
          const float s = (which ? vs : ks)[at];
          const int8_t v = (which ? vq : kq)[at * D + d];
          ok &= std::fabs(v * s - x[d]) <= 0.5f * s + 1e-5f;   // within half a step
        }
      }
    }
  check("rope cache writes" + tag, ok);
}

// Scalar attention of one query row over the first len tokens of a paged cache.
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
      for (int64_t d = 0; d < D; ++d) dot += q[h * D + d] * (c.k ? c.k[at * D + d] : c.kq[at * D + d] * c.ks[at]);
      s[p] = dot * scale, mx = std::max(mx, s[p]);
    }
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = 0.f;
    for (int64_t p = first; p < len; ++p) {
      const int64_t at = (table[p / bs] * bs + p % bs) * c.Hkv + hk;
      const double w = std::exp(s[p] - mx);
      sum += w;
      for (int64_t d = 0; d < D; ++d) out[h * D + d] += w * (c.v ? c.v[at * D + d] : c.vq[at * D + d] * c.vs[at]);
    }
    for (int64_t d = 0; d < D; ++d) out[h * D + d] /= sum;
  }
}

// Rows: query_lens[i] consecutive positions of sequence i ending at context_lens[i].
void test_attention(const pw::KernelTable& k, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, bool int8,
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
  std::vector<int8_t> kq(kf.size()), vq(vf.size());
  std::vector<float> ks(slots * Hkv), vs(slots * Hkv);
  pw::Cache c;
  c.Hkv = Hkv, c.D = D;
  if (int8) {
    for (int64_t r = 0; r < slots * Hkv; ++r) {
      ks[r] = 2.f / 127, vs[r] = 3.f / 127;
      for (int64_t d = 0; d < D; ++d)
        kq[r * D + d] = static_cast<int8_t>(std::uniform_int_distribution<int>(-127, 127)(rng)),
        vq[r * D + d] = static_cast<int8_t>(std::uniform_int_distribution<int>(-127, 127)(rng));
    }
    c.kq = kq.data(), c.vq = vq.data(), c.ks = ks.data(), c.vs = vs.data();
  } else {
    c.k = kf.data(), c.v = vf.data();
  }
  const pw::AttentionRows rows{tables.data(), max_blocks, seq.data(), len.data(), bs, window};
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  std::vector<float> out(T * Hq * D), want(T * Hq * D);
  k.paged_attention(RT, q.data(), T, Hq, c, rows, scale, out.data());
  for (int64_t t = 0; t < T; ++t)
    attend_ref(c, tables.data() + seq[t] * max_blocks, bs, q.data() + t * Hq * D, Hq, len[t], scale,
               want.data() + t * Hq * D, window);
  char name[160];
  std::snprintf(name, sizeof name, "paged_attention Hq=%lld Hkv=%lld D=%lld bs=%lld %s rows=%lld window=%lld",
                (long long)Hq, (long long)Hkv, (long long)D, (long long)bs, int8 ? "int8" : "fp32", (long long)T,
                (long long)window);
  check_close(name, out.data(), want.data(), out.size(), 1e-4f, 5e-5f);
}

// A random packed weight of `fmt` (quant_linear.cpp's layout) and its values W [N, K].
std::vector<uint8_t> random_weight(pw::QuantFormat fmt, int64_t N, int64_t K, std::vector<float>& W,
                                   std::vector<float>& scale) {
  const int64_t NT = (N + 15) / 16, KB = K / 32, BB = pw::block_bytes(fmt), QB = pw::quant_bytes(fmt);
  const bool nibbles = fmt == pw::Q4 || fmt == pw::K4, f32 = fmt == pw::K4 || fmt == pw::K8 || fmt == pw::K6;
  const bool six = fmt == pw::K6, halves = fmt == pw::K8 || fmt == pw::K6;
  std::vector<uint8_t> blocks(NT * KB * BB);
  for (uint8_t& b : blocks) b = static_cast<uint8_t>(rng());
  W.assign(NT * 16 * K, 0.f);
  scale.assign(NT * 16, 0.f);
  auto uniform = [](float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); };
  for (float& s : scale) s = 0.001f + 0.01f * uniform(0.f, 1.f);
  for (int64_t t = 0; t < NT; ++t)
    for (int64_t b = 0; b < KB; ++b) {
      uint8_t* blk = blocks.data() + (t * KB + b) * BB;
      uint16_t* dm = reinterpret_cast<uint16_t*>(blk + QB);   // fp16 d (and m) of Q4, Q8, Q5
      float* ds = reinterpret_cast<float*>(blk + QB);         // fp32 d (K8, K6: of each half) and m
      if (fmt == pw::Q4 || fmt == pw::Q8 || fmt == pw::Q5)
        for (int r = 0; r < (fmt == pw::Q4 ? 32 : 16); ++r) dm[r] = random_half(8, 12);
      if (f32)
        for (int r = 0; r < (fmt == pw::K4 ? 32 : 48); ++r) ds[r] = r < (fmt == pw::K4 ? 16 : 32) ?
            uniform(0.001f, 0.02f) : uniform(-0.1f, 0.1f);
      for (int r = 0; r < 16; ++r) {
        float* w = W.data() + (t * 16 + r) * K + b * 32;
        for (int kk = 0; kk < 32; ++kk) {
          if (fmt == pw::Q5) {                                   // u = nibble | fifth bit << 4
            const int g = kk / 4, p = r * 4 + kk % 4;
            const uint8_t byte = blk[(g % 4) * 64 + p];
            const int u = (g < 4 ? byte & 15 : byte >> 4) | ((blk[256 + p] >> g) & 1) << 4;
            w[kk] = half_to_float(dm[r]) * (u - 16);
          } else if (nibbles) {
            const int j = (kk % 16) / 4, p = kk % 4;
            const uint8_t byte = blk[j * 64 + r * 4 + p];
            const int q = kk < 16 ? byte & 15 : byte >> 4;
            w[kk] = fmt == pw::Q4 ? half_to_float(dm[r]) * q + half_to_float(dm[16 + r]) : ds[r] * q + ds[16 + r];
          } else {
            uint8_t& u = blk[(kk / 4) * 64 + r * 4 + kk % 4];
            if (six) u &= 63;                                    // K6: q + 32 in 0..63
            else if (u == 0) u = 1;                              // q = -128 is never stored
            const float d = fmt == pw::Q8 ? half_to_float(dm[r]) :
                            fmt == pw::I8 ? scale[t * 16 + r] : ds[(kk < 16 ? 0 : 16) + r];
            w[kk] = (u - (six ? 32 : 128)) * d + (halves ? ds[32 + r] : 0.f);
          }
        }
      }
    }
  return blocks;
}

void test_quant_linear(const pw::KernelTable& k, pw::QuantFormat fmt, int64_t M, int64_t N, int64_t K) {
  std::vector<float> W, scale;
  const auto blocks = random_weight(fmt, N, K, W, scale);
  const int64_t NT = (N + 15) / 16, KB = K / 32;
  auto x = randn(M * K), bias = randn(N);
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * KB), sx(M * KB);
  k.quantize_activations(RT, x.data(), M, K, xq.data(), dx.data(), sx.data());
  bool ok = true;                              // the activations: per block of 32, round to nearest even
  for (int64_t i = 0; i < M * KB; ++i) {
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[i * 32 + j]));
    ok &= std::fabs(dx[i] - amax / 127.f) <= 1e-6f * amax;
    for (int j = 0; j < 32; ++j) ok &= xq[i * 32 + j] == static_cast<int8_t>(std::nearbyint(x[i * 32 + j] * (127.f / amax)));
  }
  check("quantize_activations M=" + std::to_string(M), ok);
  std::vector<float> y(M * N), want(M * N);
  const pw::PackedWeights w{fmt, blocks.data(), scale.data(), N, NT, KB};
  k.quant_linear(RT, x.data(), M, K, w, bias.data(), y.data());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double acc = bias[n];
      for (int64_t kk = 0; kk < K; ++kk) acc += static_cast<double>(W[n * K + kk]) * xq[m * K + kk] * dx[m * KB + kk / 32];
      want[m * N + n] = static_cast<float>(acc);
    }
  float big = 0.f;
  for (float v : want) big = std::max(big, std::fabs(v));
  char name[96];
  std::snprintf(name, sizeof name, "quant_linear fmt=%d M=%lld N=%lld K=%lld", static_cast<int>(fmt), (long long)M,
                (long long)N, (long long)K);
  check_close(name, y.data(), want.data(), y.size(), 1e-4f, 1e-5f * big);
}


// decoder_stack on a team of threads against the same ops called one by one on one thread, in
// decoder.cpp's order: the team's barriers and shared buffers must change nothing but rounding.
void test_decoder_stack(const pw::KernelTable& k, bool int8, const std::vector<int64_t>& query_lens,
                        const std::vector<int64_t>& context_lens) {
  const int64_t L = 3, H = 128, I = 96, Hq = 2, Hkv = 1, D = 64, bs = 16, P = 512, half = D / 2;
  std::vector<std::vector<uint8_t>> blocks;
  std::vector<std::vector<float>> norms, biases;
  std::vector<pw::DecoderLayer> layers(L);
  auto linear = [&](int64_t N, int64_t K) {
    std::vector<float> W, scale;
    blocks.push_back(random_weight(pw::Q4, N, K, W, scale));
    biases.push_back(randn(N, 0.1f));
    return pw::Linear{{pw::Q4, blocks.back().data(), nullptr, N, (N + 15) / 16, K / 32}, biases.back().data()};
  };
  blocks.reserve(4 * L), biases.reserve(4 * L), norms.reserve(2 * L + 1);
  for (auto& layer : layers) {
    norms.push_back(randn(H, 0.5f)), layer.input_norm = norms.back().data();
    norms.push_back(randn(H, 0.5f)), layer.post_norm = norms.back().data();
    layer.qkv = linear((Hq + 2 * Hkv) * D, H), layer.o = linear(H, Hq * D);
    layer.gate_up = linear(2 * I, H), layer.down = linear(H, I);
  }
  norms.push_back(randn(H, 0.5f));
  std::vector<float> cs(P * half), sn(P * half);
  for (int64_t p = 0; p < P; ++p)
    for (int64_t i = 0; i < half; ++i) {
      const float a = p * std::pow(10000.f, -2.f * i / D);
      cs[p * half + i] = std::cos(a), sn[p * half + i] = std::sin(a);
    }
  const pw::DecoderModel m{layers.data(), L, H, I, Hq, Hkv, D, 1e-5f, norms.back().data(), cs.data(), sn.data()};
  // Rows: query_lens[i] positions of sequence i ending at context_lens[i]; blocks in order.
  const int64_t nseq = query_lens.size();
  int64_t max_blocks = 0;
  for (int64_t c : context_lens) max_blocks = std::max(max_blocks, (c + bs - 1) / bs);
  std::vector<int64_t> tables(nseq * max_blocks), seq, len, pos, slot;
  for (int64_t i = 0; i < nseq; ++i) {
    for (int64_t b = 0; b < max_blocks; ++b) tables[i * max_blocks + b] = i * max_blocks + b;
    for (int64_t r = 0; r < query_lens[i]; ++r) {
      const int64_t n = context_lens[i] - query_lens[i] + r + 1;
      seq.push_back(i), len.push_back(n), pos.push_back(n - 1);
      slot.push_back(tables[i * max_blocks + (n - 1) / bs] * bs + (n - 1) % bs);
    }
  }
  const int64_t T = seq.size(), slots = nseq * max_blocks * bs;
  // Two copies of every layer's cache, with the same earlier context.
  std::vector<std::vector<float>> f(4 * L);
  std::vector<std::vector<int8_t>> q8(4 * L);
  std::vector<pw::Cache> caches[2];
  std::vector<pw::CacheOut> outs[2];
  for (int64_t i = 0; i < L; ++i) {
    const auto kf = randn(slots * Hkv * D), vf = randn(slots * Hkv * D);
    std::vector<int8_t> kq(kf.size()), vq(vf.size());
    for (size_t j = 0; j < kf.size(); ++j)
      kq[j] = static_cast<int8_t>(std::lround(kf[j] * 40)), vq[j] = static_cast<int8_t>(std::lround(vf[j] * 40));
    for (int copy = 0; copy < 2; ++copy) {
      auto& kbuf = f[4 * i + 2 * copy];
      auto& vbuf = f[4 * i + 2 * copy + 1];
      auto& kqb = q8[4 * i + 2 * copy];
      auto& vqb = q8[4 * i + 2 * copy + 1];
      pw::Cache c;
      pw::CacheOut o;
      c.Hkv = Hkv, c.D = D;
      if (int8) {
        kqb = kq, vqb = vq;
        kbuf.assign(slots * Hkv, 1.f / 40), vbuf.assign(slots * Hkv, 1.f / 40);   // the scales
        c.kq = o.kq = kqb.data(), c.vq = o.vq = vqb.data(), c.ks = o.ks = kbuf.data(), c.vs = o.vs = vbuf.data();
      } else {
        kbuf = kf, vbuf = vf;
        c.k = o.k = kbuf.data(), c.v = o.v = vbuf.data();
      }
      caches[copy].push_back(c), outs[copy].push_back(o);
    }
  }
  const pw::AttentionRows rows{tables.data(), max_blocks, seq.data(), len.data(), bs};
  const auto x = randn(T * H);
  std::vector<float> ws(pw::decoder_workspace(m, T)), out(T * H);
  const int64_t* group_slots[1] = {slot.data()};
  const pw::DecoderStep step{T, pos.data(), group_slots, caches[0].data(), outs[0].data(), &rows};
  k.decoder_stack(RT, m, step, x.data(), ws.data(), out.data());

  const pw::Runtime one{1};
  std::vector<float> residual(x), normed(T * H), hidden(T * H), o(T * H), qkv(T * (Hq + 2 * Hkv) * D), qr(T * Hq * D),
      kr(T * Hkv * D), attn(T * Hq * D), gate_up(T * 2 * I), act(T * I), want(T * H);
  for (int64_t i = 0; i < L; ++i) {
    const pw::DecoderLayer& ly = layers[i];
    if (i == 0) k.rms_norm(one, residual.data(), nullptr, ly.input_norm, T, H, m.eps, normed.data(), nullptr);
    else k.rms_norm(one, hidden.data(), residual.data(), ly.input_norm, T, H, m.eps, normed.data(), residual.data());
    k.quant_linear(one, normed.data(), T, H, ly.qkv.w, ly.qkv.bias, qkv.data());
    k.rope_and_cache(one, qkv.data(), T, pos.data(), cs.data(), sn.data(), Hq, Hkv, D, slot.data(), outs[1][i],
                     qr.data(), kr.data());
    k.paged_attention(one, qr.data(), T, Hq, caches[1][i], rows, 1.f / std::sqrt(static_cast<float>(D)), attn.data());
    k.quant_linear(one, attn.data(), T, Hq * D, ly.o.w, ly.o.bias, o.data());
    k.rms_norm(one, o.data(), residual.data(), ly.post_norm, T, H, m.eps, normed.data(), residual.data());
    k.quant_linear(one, normed.data(), T, H, ly.gate_up.w, ly.gate_up.bias, gate_up.data());
    k.silu_and_mul(one, gate_up.data(), T, I, act.data());
    k.quant_linear(one, act.data(), T, I, ly.down.w, ly.down.bias, hidden.data());
  }
  k.rms_norm(one, hidden.data(), residual.data(), m.final_norm, T, H, m.eps, want.data(), residual.data());
  char name[96];
  std::snprintf(name, sizeof name, "decoder_stack %s rows=%lld", int8 ? "int8" : "fp32", (long long)T);
  check_close(name, out.data(), want.data(), out.size(), 1e-3f, 1e-3f);
  bool same = true;                            // the caches hold the same new keys and values (int8: within a step)
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = 0; j < 2; ++j) {
      const auto &a = f[4 * i + j], &b = f[4 * i + 2 + j];
      for (size_t e = 0; e < a.size(); ++e) same &= std::fabs(a[e] - b[e]) <= 1e-3f * (1.f + std::fabs(b[e]));
      if (int8)
        for (size_t e = 0; e < q8[4 * i + j].size(); ++e) same &= std::abs(q8[4 * i + j][e] - q8[4 * i + 2 + j][e]) <= 1;
    }
  check(std::string(name) + " caches", same);
}
}  // namespace

int main() {
  const pw::KernelTable& k = *pw_kernel_table();
  std::printf("kernel tests, ISA level %s\n", k.isa);
  check("abi", k.abi == pw::ABI_VERSION);
  test_elementwise(k);
  test_rope_and_cache(k, false);
  test_rope_and_cache(k, true);
  for (bool int8 : {false, true}) {
    for (const auto& h : std::vector<std::vector<int64_t>>{{4, 4}, {8, 4}, {12, 3}, {9, 3}, {14, 2}, {8, 1}})
      test_attention(k, h[0], h[1], 64, 16, int8, {1, 1, 1}, {300, 17, 64});    // decode rows
    for (int64_t D : {64, 128, 256, 32, 80})                                      // vector and scalar head sizes
      test_attention(k, 8, 2, D, 16, int8, {1, 1}, {70, 1000});                   // a long context in parts
    test_attention(k, 9, 3, 64, 16, int8, {1, 5, 12, 1}, {40, 5, 30, 16});         // prompt chunks in tiles
    test_attention(k, 8, 2, 128, 32, int8, {4, 20, 40}, {9, 50, 40});
    test_attention(k, 4, 1, 256, 16, int8, {37, 1, 1}, {100, 700, 30}, 40);    // sliding window: tiles and rows
  }
  for (pw::QuantFormat fmt : {pw::Q4, pw::Q8, pw::I8, pw::K4, pw::K8, pw::Q5, pw::K6})
    for (const auto& mnk : std::vector<std::vector<int64_t>>{{1, 576, 576}, {3, 40, 64}, {5, 960, 128}, {130, 48, 96}})
      test_quant_linear(k, fmt, mnk[0], mnk[1], mnk[2]);
  for (bool int8 : {false, true}) {
    test_decoder_stack(k, int8, {1}, {1});                                      // the first decode step
    test_decoder_stack(k, int8, {1, 12, 1}, {40, 12, 300});                     // decodes, a prompt chunk
  }
  check("int8_peak_gops", k.int8_peak_gops(RT, 2000) > 0.0);
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
