// The kernel tests of expert_mlp: each expert's rows get what quant_linear, silu_and_mul and
// quant_linear give those rows through that expert's tiles, bit for bit; a row's k terms are summed
// with the router's weights in its order; and float_linear against a double dot product.
#include "check.h"

#include <algorithm>
#include <cmath>

namespace kt {
namespace {

struct Stacked {            // E experts' weights stacked along N (rows per expert a multiple of 16)
  std::vector<uint8_t> blocks;
  std::vector<float> W, scale;
  std::vector<uint16_t> super;
  pw::PackedWeights all;
  int64_t rows;

  Stacked(pw::QuantFormat fmt, int64_t E, int64_t rows_, int64_t K) : rows(rows_) {
    blocks = random_weight(fmt, E * rows, K, W, scale, 0, &super);
    all = {fmt, blocks.data(), scale.data(), E * rows, E * rows / 16, K / 32, 0, super.data()};
  }
  pw::PackedWeights expert(int64_t e) const {   // expert e's own run of tiles
    pw::PackedWeights p = all;
    const int64_t nt = rows / 16;
    p.blocks += e * nt * all.KB * pw::block_bytes(all.fmt);
    p.scale += e * nt * 16;
    if (pw::super_halves(all.fmt)) p.super += e * nt * (all.KB / pw::K4_SUPER) * pw::super_halves(all.fmt);
    p.N = rows, p.NT = nt;
    return p;
  }
};

// ye [n, H] = rows xe [n, H] through expert e on the dense ops (quant_linear, silu_and_mul, quant_linear)
std::vector<float> through_expert(const pw::KernelTable& k, const Stacked& gate, const Stacked& up, const Stacked& down,
                                  int64_t e, const std::vector<float>& xe, int64_t n, int64_t I, int64_t H) {
  std::vector<float> g(n * I), u(n * I), gu(n * 2 * I), act(n * I), ye(n * H);
  k.quant_linear(RT, xe.data(), n, H, gate.expert(e), nullptr, g.data());
  k.quant_linear(RT, xe.data(), n, H, up.expert(e), nullptr, u.data());
  for (int64_t r = 0; r < n; ++r) {
    std::copy_n(g.data() + r * I, I, gu.data() + r * 2 * I);
    std::copy_n(u.data() + r * I, I, gu.data() + r * 2 * I + I);
  }
  k.silu_and_mul(RT, gu.data(), n, I, act.data());
  k.quant_linear(RT, act.data(), n, I, down.expert(e), nullptr, ye.data());
  return ye;
}

}  // namespace

void test_expert_mlp(const pw::KernelTable& k, pw::QuantFormat fmt, pw::QuantFormat down_fmt, int64_t T, int64_t kk) {
  const int64_t E = 5, H = 256, I = pw::super_activations(down_fmt) ? 256 : 64;
  const Stacked gate(fmt, E, I, H), up(fmt, E, I, H), down(down_fmt, E, H, I);
  const auto x = randn(T * H);
  std::vector<int64_t> ids(T * kk);
  std::vector<float> weights(T * kk);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < kk; ++j) {       // distinct experts a row; expert 0 for most rows
      ids[t * kk + j] = (t % 3 == 0 ? 0 : t % E + j) % E;
      if (j > 0) ids[t * kk + j] = (ids[t * kk] + j) % E;
      weights[t * kk + j] = 0.25f + 0.5f * static_cast<float>(rng() % 100) / 100.f;
    }
  const pw::ExpertWeights ex{gate.all, up.all, down.all, E, I, H, false};
  std::vector<float> out(T * H);
  k.expert_mlp(RT, x.data(), T, ids.data(), weights.data(), kk, ex, out.data());
  // each expert's (row, choice) pairs in row order through the dense ops: y [T, kk, H]
  std::vector<float> y(T * kk * H);
  for (int64_t e = 0; e < E; ++e) {
    std::vector<int64_t> pairs;
    for (int64_t i = 0; i < T * kk; ++i)
      if (ids[i] == e) pairs.push_back(i);
    const int64_t n = pairs.size();
    if (!n) continue;
    std::vector<float> xe(n * H);
    for (int64_t r = 0; r < n; ++r) std::copy_n(x.data() + pairs[r] / kk * H, H, xe.data() + r * H);
    const auto ye = through_expert(k, gate, up, down, e, xe, n, I, H);
    for (int64_t r = 0; r < n; ++r) std::copy_n(ye.data() + r * H, H, y.data() + pairs[r] * H);
  }
  std::vector<float> want(T * H, 0.f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < kk; ++j)
      for (int64_t c = 0; c < H; ++c) want[t * H + c] += weights[t * kk + j] * y[(t * kk + j) * H + c];
  float big = 0.f;
  for (float v : want) big = std::max(big, std::fabs(v));
  char name[96];
  std::snprintf(name, sizeof name, "expert_mlp fmt=%d down=%d T=%lld k=%lld", static_cast<int>(fmt),
                static_cast<int>(down_fmt), (long long)T, (long long)kk);
  if (kk == 1 && std::all_of(weights.begin(), weights.end(), [](float w) { return w == 1.f; }))
    check(name, std::equal(out.begin(), out.end(), want.begin()));
  else
    check_close(name, out.data(), want.data(), out.size(), 1e-5f, 1e-6f * big);
}

void test_expert_mlp_exact(const pw::KernelTable& k, pw::QuantFormat fmt) {
  // k = 1, weight 1: every output the dense ops' bits (the per-expert row groups as the kernel makes them)
  const int64_t E = 4, H = 256, I = 64, T = 13;
  const Stacked gate(fmt, E, I, H), up(fmt, E, I, H), down(fmt == pw::K4 || fmt == pw::Q6K ? pw::Q8 : fmt, E, H, I);
  const auto x = randn(T * H);
  std::vector<int64_t> ids(T);
  for (int64_t t = 0; t < T; ++t) ids[t] = t < 9 ? 1 : t % E;   // 9 + rows on expert 1: batched tile paths
  const std::vector<float> ones(T, 1.f);
  std::vector<float> out(T * H), want(T * H);
  k.expert_mlp(RT, x.data(), T, ids.data(), ones.data(), 1, {gate.all, up.all, down.all, E, I, H, false}, out.data());
  for (int64_t e = 0; e < E; ++e) {
    std::vector<int64_t> rows;
    for (int64_t t = 0; t < T; ++t)
      if (ids[t] == e) rows.push_back(t);
    const int64_t n = rows.size();
    if (!n) continue;
    std::vector<float> xe(n * H);
    for (int64_t r = 0; r < n; ++r) std::copy_n(x.data() + rows[r] * H, H, xe.data() + r * H);
    const auto ye = through_expert(k, gate, up, down, e, xe, n, I, H);
    for (int64_t r = 0; r < n; ++r) std::copy_n(ye.data() + r * H, H, want.data() + rows[r] * H);
  }
  check("expert_mlp exact fmt=" + std::to_string(static_cast<int>(fmt)), out == want);
}

void test_float_linear(const pw::KernelTable& k) {
  for (int64_t K : {256, 70, 5}) {
    const int64_t T = 6, N = 9;
    const auto x = randn(T * K), w = randn(N * K);
    std::vector<float> out(T * N), one(N), want(T * N);
    k.float_linear(RT, x.data(), T, K, w.data(), N, out.data());
    for (int64_t i = 0; i < T * N; ++i) {
      double acc = 0;
      for (int64_t c = 0; c < K; ++c) acc += static_cast<double>(x[i / N * K + c]) * w[i % N * K + c];
      want[i] = static_cast<float>(acc);
    }
    check_close("float_linear K=" + std::to_string(K), out.data(), want.data(), out.size(), 1e-5f, 1e-5f);
    k.float_linear(RT, x.data() + 4 * K, 1, K, w.data(), N, one.data());   // a row alone: the same bits
    check("float_linear row alone K=" + std::to_string(K), std::equal(one.begin(), one.end(), out.begin() + 4 * N));
  }
}

// moe_route against a sort by (score descending, id ascending) in double: both orders of softmax and
// top-k, renormalised or not, ties among the logits.
void test_moe_route(const pw::KernelTable& k) {
  const int64_t T = 5, E = 10, kk = 3;
  auto logits = randn(T * E);
  for (int64_t e = 0; e < E; ++e) logits[e] = std::min(logits[e], 2.f);   // whatever was drawn before
  logits[3] = logits[7] = logits[1] = 2.5f;        // row 0: a three-way tie at the top: ids 1, 3, 7
  for (int mode = 0; mode < 3; ++mode) {           // softmax then top-k; renormalised; top-k then softmax
    const bool renorm = mode == 1, topk_softmax = mode == 2;
    std::vector<float> w(T * kk);
    std::vector<int64_t> ids(T * kk);
    k.moe_route(RT, logits.data(), T, E, kk, renorm, topk_softmax, w.data(), ids.data());
    bool ok = true;
    for (int64_t t = 0; t < T; ++t) {
      const float* l = logits.data() + t * E;
      std::vector<int64_t> order(E);
      for (int64_t e = 0; e < E; ++e) order[e] = e;
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return l[a] > l[b]; });
      double mx = l[order[0]], all = 0, top = 0;
      for (int64_t e = 0; e < E; ++e) all += std::exp(l[e] - mx);
      for (int64_t j = 0; j < kk; ++j) top += std::exp(l[order[j]] - mx);
      for (int64_t j = 0; j < kk; ++j) {
        const double p = std::exp(l[order[j]] - mx) / (renorm || topk_softmax ? top : all);
        ok &= ids[t * kk + j] == order[j] && std::fabs(w[t * kk + j] - p) <= 1e-6 * (1 + p);
      }
    }
    ok &= ids[0] == 1 && ids[1] == 3 && ids[2] == 7;
    check("moe_route mode=" + std::to_string(mode), ok);
  }
}

}  // namespace kt
