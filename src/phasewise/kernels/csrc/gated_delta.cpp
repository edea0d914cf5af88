// The Gated DeltaNet's token mixer over a whole step (kernels.h DeltaNetLayer; its PyTorch reference is
// layers/gated_delta.py, which GatedDeltaNet.forward runs without kernels). Two parallel passes:
//   1. per unit of channels (one q, k or v head), every sequence's tokens in order: the depthwise
//      causal conv from the slot's conv state (left holding the last K - 1 inputs), SiLU, and for q
//      and k each token's L2 norm (q also times 1 / sqrt(dk)) -> mixed [T, C];
//   2. per (sequence, v head), threads taking contiguous runs of equal cost (tokens): the gated delta
//      rule over the head's [dk, dv] state, COLS columns at a time with the tokens inside, so those
//      columns stay in L1 across the whole chunk (a column's update reads no other column); then, with
//      norm_w, each token's gated RMSNorm times silu(z).
// Per token and v head, g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b):
//   S = e^g S;  kv = Sᵀk;  S += k ⊗ beta (v - kv);  out = Sᵀq
// (here kv = e^g (Sᵀk) from the state before its decay, and S = e^g S + k ⊗ delta in one pass).
// A row's result depends only on the state before it and its own inputs, through the same operations
// wherever it sits (vectors of 16 channels or columns, masked at a head's end; sums in a fixed order,
// and build.py compiles this file without reassociation or contraction), so its bits are the same
// alone, batched with other sequences, or in chunks of any size.
#include "core.h"
#include "parallel.h"
#include "vec/vec.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace pw {
namespace {

constexpr int64_t COLS = 32;     // state columns (two vectors) a pass keeps in L1: dk x 32 floats, 16 KB at dk 128

struct Seq {                     // one sequence of the step
  int64_t row, n, slot;          // its first row, its tokens, its state slot
  bool start;                    // it starts here: its slot's states are zeroed first
};

std::vector<Seq> sequences(const DeltaNetSeqs& sq) {
  std::vector<Seq> out(sq.B);
  for (int64_t i = 0, row = 0; i < sq.B; row += sq.query_lens[i], ++i)
    out[i] = {row, sq.query_lens[i], sq.slots[i], sq.query_lens[i] == sq.context_lens[i]};
  return out;
}

inline Vf silu(Vf x) { return x / (Vf::set1(1.f) + exp(Vf::zero() - x)); }
inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }   // as torch (threshold 20)

// Channels [c, c + m) (m <= 16) of every sequence: conv from its state cs [K - 1, C], SiLU -> mixed.
void conv_block(const DeltaNetLayer& L, int64_t C, const DeltaNetRows& in, const DeltaNetSeqs& sq,
                const std::vector<Seq>& seqs, int64_t c, int64_t m, float* mixed) {
  const int64_t K = L.K, P = K - 1;
  Vf taps[DELTA_NET_MAX_TAPS];
  for (int64_t j = 0; j < K; ++j) {
    alignas(64) float w[16] = {};
    for (int64_t l = 0; l < m; ++l) w[l] = L.conv_w[(c + l) * K + j];
    taps[j] = Vf::load(w);
  }
  for (const Seq& s : seqs) {
    float* cs = sq.conv_states + s.slot * P * C + c;
    if (s.start)
      for (int64_t p = 0; p < P; ++p) Vf::zero().store_n(cs + p * C, m);
    // row i of the window: the state's K - 1 inputs, then the sequence's
    auto window = [&](int64_t i) { return i < P ? cs + i * C : in.qkv + (s.row + i - P) * in.qkv_ld + c; };
    for (int64_t t = 0; t < s.n; ++t) {
      Vf acc = Vf::load_n(window(t), m) * taps[0];
      for (int64_t j = 1; j < K; ++j) acc = fma(Vf::load_n(window(t + j), m), taps[j], acc);
      silu(acc).store_n(mixed + (s.row + t) * C + c, m);
      const int64_t snap = sq.snapshots != nullptr ? sq.snapshots[s.row + t] : -1;
      for (int64_t p = 0; p < P && snap >= 0; ++p)   // the conv state after row t: its last K - 1 inputs
        Vf::load_n(window(t + 1 + p), m).store_n(sq.conv_states + snap * P * C + c + p * C, m);
    }
    for (int64_t p = 0; p < P; ++p)      // the last K - 1 inputs; in place, as row n + p >= p is read first
      Vf::load_n(window(s.n + p), m).store_n(cs + p * C, m);
  }
}

// x [w] in place: x / sqrt(sum(x²) + 1e-6) * scale (transformers' l2norm, eps 1e-6)
void l2norm(float* x, int64_t w, float scale) {
  Vf ss = Vf::zero();
  for (int64_t i = 0; i < w; i += 16) {
    const Vf v = Vf::load_n(x + i, w - i);
    ss = fma(v, v, ss);
  }
  const Vf inv = Vf::set1(scale / std::sqrt(reduce_add(ss) + 1e-6f));
  for (int64_t i = 0; i < w; i += 16) (Vf::load_n(x + i, w - i) * inv).store_n(x + i, w - i);
}

// Pass 1's unit u: q head u (u < Hk), k head u - Hk (u < 2 Hk) or v head u - 2 Hk, every sequence.
void conv_unit(const DeltaNetLayer& L, int64_t C, const DeltaNetRows& in, const DeltaNetSeqs& sq,
               const std::vector<Seq>& seqs, int64_t T, int64_t u, float* mixed) {
  const int64_t qk = 2 * L.Hk, c0 = u < qk ? u * L.dk : qk * L.dk + (u - qk) * L.dv, w = u < qk ? L.dk : L.dv;
  for (int64_t c = c0; c < c0 + w; c += 16) conv_block(L, C, in, sq, seqs, c, std::min<int64_t>(16, c0 + w - c), mixed);
  if (u >= qk) return;
  const float scale = u < L.Hk ? 1.f / std::sqrt(static_cast<float>(L.dk)) : 1.f;
  for (int64_t t = 0; t < T; ++t) l2norm(mixed + t * C + c0, w, scale);
}

// NB vectors of columns j0 .. j0 + 16 NB of one head's state S [dk, dv] through a sequence's tokens
// (rows row .. row + n): out [T, Hv dv] gets those columns of the head's outputs. FULL: no column past dv.
// Sums over i run in two chains (even and odd i, added at the end) for the FMA's latency.
template <int NB, bool FULL>
void delta_columns(const DeltaNetLayer& L, int64_t C, const DeltaNetRows& in, const DeltaNetSeqs& sq,
                   const float* mixed, const Seq& s, int64_t h, float* S, int64_t j0, float* out) {
  const int64_t dk = L.dk, dv = L.dv, kh = L.tiled ? h % L.Hk : h / (L.Hv / L.Hk);
  int64_t m[NB];
  for (int u = 0; u < NB; ++u) m[u] = std::max<int64_t>(0, std::min<int64_t>(16, dv - j0 - 16 * u));
  auto load = [&](const float* p, int u) { return FULL ? Vf::load(p) : Vf::load_n(p, m[u]); };
  auto store = [&](Vf x, float* p, int u) { FULL ? x.store(p) : x.store_n(p, m[u]); };
  for (int64_t r = s.row; r < s.row + s.n; ++r) {
    const float* q = mixed + r * C + kh * dk;
    const float* k = q + L.Hk * dk;
    const float* v = mixed + r * C + 2 * L.Hk * dk + h * dv + j0;
    const Vf decay = Vf::set1(std::exp(L.neg_A[h] * softplus(in.a[r * in.a_ld + h] + L.dt_bias[h])));
    const Vf beta = Vf::set1(1.f / (1.f + std::exp(-in.b[r * in.b_ld + h])));
    Vf kv[2][NB], o[2][NB];
    for (int u = 0; u < NB; ++u) kv[0][u] = kv[1][u] = o[0][u] = o[1][u] = Vf::zero();
    for (int64_t i = 0; i < dk; ++i) {           // kv = e^g (Sᵀ k)
      const Vf ki = Vf::set1(k[i]);
      for (int u = 0; u < NB; ++u) kv[i & 1][u] = fma(load(S + i * dv + j0 + 16 * u, u), ki, kv[i & 1][u]);
    }
    Vf delta[NB];                                 // beta (v - kv)
    for (int u = 0; u < NB; ++u) delta[u] = (load(v + 16 * u, u) - (kv[0][u] + kv[1][u]) * decay) * beta;
    const int64_t snap = sq.snapshots != nullptr ? sq.snapshots[r] : -1;
    float* copy = snap >= 0 ? sq.states + (snap * L.Hv + h) * dk * dv : nullptr;   // the state after row r, too
    for (int64_t i = 0; i < dk; ++i) {           // S = e^g S + k ⊗ delta; out = Sᵀ q
      const Vf ki = Vf::set1(k[i]), qi = Vf::set1(q[i]);
      for (int u = 0; u < NB; ++u) {
        float* p = S + i * dv + j0 + 16 * u;
        const Vf sn = fma(load(p, u), decay, ki * delta[u]);
        store(sn, p, u);
        if (copy != nullptr) store(sn, copy + i * dv + j0 + 16 * u, u);
        o[i & 1][u] = fma(sn, qi, o[i & 1][u]);
      }
    }
    for (int u = 0; u < NB; ++u) store(o[0][u] + o[1][u], out + r * L.Hv * dv + h * dv + j0 + 16 * u, u);
  }
}

// o [dv] in place: rmsnorm(o) w silu(z) (layers/gated_delta.py gated_rms_norm)
void gated_norm(float* o, const float* z, const float* w, int64_t dv, float eps) {
  Vf ss = Vf::zero();
  for (int64_t i = 0; i < dv; i += 16) {
    const Vf x = Vf::load_n(o + i, dv - i);
    ss = fma(x, x, ss);
  }
  const Vf inv = Vf::set1(1.f / std::sqrt(reduce_add(ss) / static_cast<float>(dv) + eps));
  for (int64_t i = 0; i < dv; i += 16) {
    const int64_t n = dv - i;
    (Vf::load_n(w + i, n) * (Vf::load_n(o + i, n) * inv) * silu(Vf::load_n(z + i, n))).store_n(o + i, n);
  }
}

// Pass 2's job: v head h of sequence s.
void delta_head(const DeltaNetLayer& L, int64_t C, const DeltaNetRows& in, const DeltaNetSeqs& sq,
                const float* mixed, const Seq& s, int64_t h, float* out) {
  float* S = sq.states + (s.slot * L.Hv + h) * L.dk * L.dv;
  if (s.start) std::fill(S, S + L.dk * L.dv, 0.f);
  for (int64_t j0 = 0; j0 < L.dv; j0 += COLS) {
    const int64_t left = L.dv - j0;
    if (left >= 32)
      delta_columns<2, true>(L, C, in, sq, mixed, s, h, S, j0, out);
    else if (left > 16)
      delta_columns<2, false>(L, C, in, sq, mixed, s, h, S, j0, out);
    else
      delta_columns<1, false>(L, C, in, sq, mixed, s, h, S, j0, out);
  }
  if (L.norm_w == nullptr) return;
  for (int64_t r = s.row; r < s.row + s.n; ++r)
    gated_norm(out + (r * L.Hv + h) * L.dv, in.z + r * in.z_ld + h * L.dv, L.norm_w, L.dv, L.eps);
}

}  // namespace

void delta_net_mix(const Runtime& rt, const DeltaNetLayer& L, const DeltaNetRows& in, int64_t T,
                   const DeltaNetSeqs& sq, float* mixed, float* out) {
  const int64_t C = 2 * L.Hk * L.dk + L.Hv * L.dv, units = 2 * L.Hk + L.Hv;
  const std::vector<Seq> seqs = sequences(sq);
  parallel_for(rt, units, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) conv_unit(L, C, in, sq, seqs, T, u, mixed);
  });
  // jobs (sequence, v head) in that order, each costing its tokens and one more for its state's load;
  // thread p takes the jobs whose cost starts in its p-th share of the total
  const int64_t jobs = sq.B * L.Hv;
  std::vector<int64_t> start(jobs + 1, 0);
  for (int64_t j = 0; j < jobs; ++j) start[j + 1] = start[j] + seqs[j / L.Hv].n + 1;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(rt.threads, jobs)), total = start[jobs];
  parallel_for(rt, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t lo = total * p / parts, hi = total * (p + 1) / parts;
      for (int64_t j = std::lower_bound(start.begin(), start.begin() + jobs, lo) - start.begin(); j < jobs && start[j] < hi; ++j)
        delta_head(L, C, in, sq, mixed, seqs[j / L.Hv], j % L.Hv, out);
    }
  });
}

}  // namespace pw
