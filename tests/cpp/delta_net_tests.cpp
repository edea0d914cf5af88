// The kernel tests of delta_net_mix (gated_delta.cpp): a step of starting and continuing sequences against
// a scalar reference in double written here (conv, SiLU, L2 norms, the gated delta rule, the gated norm),
// and each row's bits and the final states the same when the sequences run batched, alone, or in chunks.
#include "check.h"

#include "core.h"

#include <algorithm>
#include <cmath>

namespace kt {
namespace {

struct DeltaCase {          // one layer's weights, a pool of S state slots and a step's inputs
  int64_t Hk, Hv, dk, dv, K, C, S = 5;
  std::vector<float> conv_w, neg_A, dt_bias, norm_w, conv0, state0, qkv, a, b, z;

  DeltaCase(int64_t hk, int64_t hv, int64_t k_dim, int64_t v_dim, int64_t taps, int64_t T)
      : Hk(hk), Hv(hv), dk(k_dim), dv(v_dim), K(taps), C(2 * hk * k_dim + hv * v_dim) {
    conv_w = randn(C * K, 0.5f), dt_bias = randn(Hv), norm_w = randn(dv);
    for (int64_t h = 0; h < Hv; ++h) neg_A.push_back(-std::exp(std::fabs(randn())));
    conv0 = randn(S * (K - 1) * C), state0 = randn(S * Hv * dk * dv, 0.1f);
    qkv = randn(T * C, 2.f), a = randn(T * Hv, 2.f), b = randn(T * Hv, 2.f), z = randn(T * Hv * dv);
  }
  pw::DeltaNetLayer layer(bool norm) const {
    pw::DeltaNetLayer L{Hk, Hv, dk, dv, K, conv_w.data(), neg_A.data(), dt_bias.data()};
    if (norm) L.norm_w = norm_w.data(), L.eps = 1e-6f;
    return L;
  }
  // rows `rows` of the inputs (in that order) through the kernel as sequences of query_lens, context_lens, slots
  std::vector<float> run(const pw::KernelTable& k, bool norm, const std::vector<int64_t>& rows,
                         const std::vector<int64_t>& ql, const std::vector<int64_t>& cl, const std::vector<int64_t>& sl,
                         std::vector<float>& conv, std::vector<float>& state,
                         const std::vector<int64_t>& snapshots = {}) const {
    const int64_t T = rows.size();
    std::vector<float> q(T * C), ra(T * Hv), rb(T * Hv), rz(T * Hv * dv), mixed(T * C), out(T * Hv * dv);
    for (int64_t t = 0; t < T; ++t) {
      std::copy_n(qkv.data() + rows[t] * C, C, q.data() + t * C);
      std::copy_n(a.data() + rows[t] * Hv, Hv, ra.data() + t * Hv);
      std::copy_n(b.data() + rows[t] * Hv, Hv, rb.data() + t * Hv);
      std::copy_n(z.data() + rows[t] * Hv * dv, Hv * dv, rz.data() + t * Hv * dv);
    }
    const pw::DeltaNetRows in{q.data(), ra.data(), rb.data(), rz.data(), C, Hv, Hv, Hv * dv};
    const pw::DeltaNetSeqs seqs{static_cast<int64_t>(ql.size()), ql.data(), cl.data(), sl.data(), conv.data(), state.data(),
                                snapshots.empty() ? nullptr : snapshots.data()};
    k.delta_net_mix(RT, layer(norm), in, T, seqs, mixed.data(), out.data());
    return out;
  }
};

// One sequence's rows r0 .. r0 + n in double from its conv state cs [K - 1, C] and state st [Hv, dk, dv]
// (both advanced) -> out rows [n, Hv dv].
void reference(const DeltaCase& c, bool norm, int64_t r0, int64_t n, float* cs, float* st, float* out) {
  const int64_t C = c.C, P = c.K - 1;
  std::vector<double> mixed(n * C);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t ch = 0; ch < C; ++ch) {
      double acc = 0;
      for (int64_t j = 0; j < c.K; ++j)
        acc += (t + j < P ? cs[(t + j) * C + ch] : c.qkv[(r0 + t + j - P) * C + ch]) * double(c.conv_w[ch * c.K + j]);
      mixed[t * C + ch] = acc / (1 + std::exp(-acc));
    }
  std::vector<float> window(P * C);
  for (int64_t p = 0; p < P; ++p)
    for (int64_t ch = 0; ch < C; ++ch) window[p * C + ch] = n + p < P ? cs[(n + p) * C + ch] : c.qkv[(r0 + n + p - P) * C + ch];
  std::copy(window.begin(), window.end(), cs);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t u = 0; u < 2 * c.Hk; ++u) {          // q heads, then k heads: L2 norm (q over sqrt(dk) too)
      double* x = mixed.data() + t * C + u * c.dk, ss = 0;
      for (int64_t i = 0; i < c.dk; ++i) ss += x[i] * x[i];
      const double f = 1 / std::sqrt(ss + 1e-6) / (u < c.Hk ? std::sqrt(double(c.dk)) : 1.0);
      for (int64_t i = 0; i < c.dk; ++i) x[i] *= f;
    }
  std::vector<double> S(st, st + c.Hv * c.dk * c.dv), kv(c.dv);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < c.Hv; ++h) {
      const int64_t kh = h / (c.Hv / c.Hk), r = r0 + t;
      const double* q = mixed.data() + t * C + kh * c.dk;
      const double* k = q + c.Hk * c.dk;
      const double* v = mixed.data() + t * C + 2 * c.Hk * c.dk + h * c.dv;
      const double x = c.a[r * c.Hv + h] + double(c.dt_bias[h]);
      const double decay = std::exp(c.neg_A[h] * (x > 20 ? x : std::log1p(std::exp(x))));
      const double beta = 1 / (1 + std::exp(-double(c.b[r * c.Hv + h])));
      double* Sh = S.data() + h * c.dk * c.dv;
      std::fill(kv.begin(), kv.end(), 0.0);
      for (int64_t i = 0; i < c.dk; ++i)
        for (int64_t j = 0; j < c.dv; ++j) Sh[i * c.dv + j] *= decay, kv[j] += Sh[i * c.dv + j] * k[i];
      std::vector<double> o(c.dv, 0.0);
      for (int64_t i = 0; i < c.dk; ++i)
        for (int64_t j = 0; j < c.dv; ++j) Sh[i * c.dv + j] += k[i] * (v[j] - kv[j]) * beta, o[j] += Sh[i * c.dv + j] * q[i];
      double ss = 0;
      for (double y : o) ss += y * y;
      const double inv = 1 / std::sqrt(ss / c.dv + 1e-6);
      for (int64_t j = 0; j < c.dv; ++j) {
        const double g = c.z[r * c.Hv * c.dv + h * c.dv + j];
        out[(t * c.Hv + h) * c.dv + j] = norm ? float(c.norm_w[j] * o[j] * inv * g / (1 + std::exp(-g))) : float(o[j]);
      }
    }
  std::copy(S.begin(), S.end(), st);
}

}  // namespace

void test_delta_net_mix(const pw::KernelTable& k, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t K, bool norm) {
  // sequences: a start of 6 tokens (slot 3), a decode step (slot 0, 9 before), a chunk of 5 (slot 4, 20 before)
  const std::vector<int64_t> ql{6, 1, 5}, cl{6, 10, 25}, sl{3, 0, 4};
  const int64_t T = 12, D = Hv * dv;
  const DeltaCase c(Hk, Hv, dk, dv, K, T);
  std::vector<int64_t> all(T);
  for (int64_t t = 0; t < T; ++t) all[t] = t;
  std::vector<float> conv = c.conv0, state = c.state0, rconv = c.conv0, rstate = c.state0, want(T * D);
  const auto got = c.run(k, norm, all, ql, cl, sl, conv, state);
  const int64_t P = (K - 1) * c.C, SS = Hv * dk * dv;
  std::fill_n(rconv.begin() + 3 * P, P, 0.f), std::fill_n(rstate.begin() + 3 * SS, SS, 0.f);   // slot 3 starts
  for (int64_t i = 0, r0 = 0; i < 3; r0 += ql[i], ++i)
    reference(c, norm, r0, ql[i], rconv.data() + sl[i] * P, rstate.data() + sl[i] * SS, want.data() + r0 * D);
  char name[96];
  std::snprintf(name, sizeof name, "delta_net_mix Hk=%lld Hv=%lld dk=%lld dv=%lld K=%lld norm=%d", (long long)Hk,
                (long long)Hv, (long long)dk, (long long)dv, (long long)K, int(norm));
  check_close(name, got.data(), want.data(), got.size(), 1e-4f, 2e-5f);
  check_close(std::string(name) + " states", state.data(), rstate.data(), state.size(), 1e-4f, 2e-6f);
  check(std::string(name) + " conv states", conv == rconv);
  // the same rows in steps of 1 and 3 tokens per sequence, batched together, and the decode row alone
  std::vector<float> after_conv, after_state;   // the last sequence's states after each of its first two rows
  for (int64_t chunk : {1, 3}) {
    std::vector<float> cc = c.conv0, cs = c.state0, out(T * D);
    std::vector<int64_t> done(3, 0);
    while (done != ql) {
      if (chunk == 1 && (done[2] == 1 || done[2] == 2)) {
        after_conv.insert(after_conv.end(), cc.begin() + 4 * P, cc.begin() + 5 * P);
        after_state.insert(after_state.end(), cs.begin() + 4 * SS, cs.begin() + 5 * SS);
      }
      std::vector<int64_t> rows, q, ctx, slots;
      for (int64_t i = 0, r0 = 0; i < 3; r0 += ql[i], ++i) {
        const int64_t n = std::min(chunk, ql[i] - done[i]);
        if (n <= 0) continue;
        for (int64_t t = 0; t < n; ++t) rows.push_back(r0 + done[i] + t);
        q.push_back(n), ctx.push_back(cl[i] - ql[i] + done[i] + n), slots.push_back(sl[i]);
        done[i] += n;
      }
      const auto step = c.run(k, norm, rows, q, ctx, slots, cc, cs);
      for (size_t t = 0; t < rows.size(); ++t) std::copy_n(step.data() + t * D, D, out.data() + rows[t] * D);
    }
    check(std::string(name) + " chunks of " + std::to_string(chunk), out == got && cc == conv && cs == state);
  }
  std::vector<float> cc = c.conv0, cs = c.state0;
  const auto alone = c.run(k, norm, {6}, {1}, {10}, {0}, cc, cs);
  check(std::string(name) + " alone", std::equal(alone.begin(), alone.end(), got.begin() + 6 * D));
  // a verify step: the last sequence's states after its first two rows also copied to slots 1 and 2
  std::vector<int64_t> snaps(T, -1);
  snaps[7] = 1, snaps[8] = 2;
  cc = c.conv0, cs = c.state0;
  const auto snapped = c.run(k, norm, all, ql, cl, sl, cc, cs, snaps);
  bool same = snapped == got;
  for (int64_t j = 0; j < 2; ++j)
    same = same && std::equal(cc.begin() + (1 + j) * P, cc.begin() + (2 + j) * P, after_conv.begin() + j * P) &&
           std::equal(cs.begin() + (1 + j) * SS, cs.begin() + (2 + j) * SS, after_state.begin() + j * SS);
  for (int64_t slot : {0, 3, 4})
    same = same && std::equal(cs.begin() + slot * SS, cs.begin() + (slot + 1) * SS, state.begin() + slot * SS);
  check(std::string(name) + " snapshots", same);
}

// LFM2's short conv (short_conv.cpp, not a table entry: this build's own) against a scalar reference
// in double: B, C, x rows of a starting and a continuing sequence, y = C conv(B x), the states after,
// a row's bits the same in chunks of one, and the snapshots of a verify step
void test_short_conv(int64_t H, int64_t K) {
  const int64_t T = 7, S = 4, P = K - 1;
  const std::vector<float> in = randn(T * 3 * H), taps = randn(H * K, 0.5f), conv0 = randn(S * P * H);
  const std::vector<int64_t> ql{4, 3}, cl{4, 9}, sl{2, 0};
  auto run = [&](const std::vector<int64_t>& rows, const std::vector<int64_t>& q, const std::vector<int64_t>& ctx,
                 const std::vector<int64_t>& slots, std::vector<float>& conv, const int64_t* snaps) {
    std::vector<float> x(rows.size() * 3 * H), out(rows.size() * H);
    for (size_t t = 0; t < rows.size(); ++t) std::copy_n(in.data() + rows[t] * 3 * H, 3 * H, x.data() + t * 3 * H);
    const pw::DeltaNetSeqs seqs{static_cast<int64_t>(q.size()), q.data(), ctx.data(), slots.data(), conv.data(), nullptr,
                                snaps};
    pw::short_conv_mix(RT, x.data(), 3 * H, static_cast<int64_t>(rows.size()), H, taps.data(), K, seqs, out.data());
    return out;
  };
  std::vector<float> conv = conv0, want(T * H), ref = conv0;
  const auto got = run({0, 1, 2, 3, 4, 5, 6}, ql, cl, sl, conv, nullptr);
  std::fill_n(ref.begin() + 2 * P * H, P * H, 0.f);                 // slot 2 starts
  for (int64_t i = 0, r0 = 0; i < 2; r0 += ql[i], ++i)
    for (int64_t ch = 0; ch < H; ++ch) {
      float* st = ref.data() + sl[i] * P * H + ch;
      std::vector<double> w(P + ql[i]);
      for (int64_t p = 0; p < P; ++p) w[p] = st[p * H];
      for (int64_t t = 0; t < ql[i]; ++t)
        w[P + t] = double(in[(r0 + t) * 3 * H + ch]) * in[(r0 + t) * 3 * H + 2 * H + ch];
      for (int64_t t = 0; t < ql[i]; ++t) {
        double acc = 0;
        for (int64_t j = 0; j < K; ++j) acc += w[t + j] * taps[ch * K + j];
        want[(r0 + t) * H + ch] = static_cast<float>(in[(r0 + t) * 3 * H + H + ch] * acc);
      }
      for (int64_t p = 0; p < P; ++p) st[p * H] = static_cast<float>(w[ql[i] + p]);
    }
  const std::string name = "short_conv_mix H=" + std::to_string(H) + " K=" + std::to_string(K);
  check_close(name, got.data(), want.data(), got.size(), 1e-4f, 1e-5f);
  check_close(name + " states", conv.data(), ref.data(), conv.size(), 1e-5f, 1e-6f);
  std::vector<float> one = conv0, out(T * H);                       // row by row, the two sequences batched
  std::vector<float> after_first;
  for (int64_t t = 0; t < 4; ++t) {
    std::vector<int64_t> rows{t}, q{1}, ctx{t + 1}, slots{2};
    if (t < 3) rows.push_back(4 + t), q.push_back(1), ctx.push_back(7 + t), slots.push_back(0);
    const auto step = run(rows, q, ctx, slots, one, nullptr);
    for (size_t r = 0; r < rows.size(); ++r) std::copy_n(step.data() + r * H, H, out.data() + rows[r] * H);
    if (t == 0) after_first.assign(one.begin(), one.begin() + P * H);   // slot 0 after sequence 1's first row
  }
  check(name + " chunks of 1", out == got && one == conv);
  std::vector<float> snapped = conv0;
  const std::vector<int64_t> snaps{-1, -1, -1, -1, 3, -1, -1};       // sequence 1's first row's state to slot 3
  const auto again = run({0, 1, 2, 3, 4, 5, 6}, ql, cl, sl, snapped, snaps.data());
  check(name + " snapshots", again == got && std::equal(after_first.begin(), after_first.end(),
                                                          snapped.begin() + 3 * P * H));
}

}  // namespace kt
