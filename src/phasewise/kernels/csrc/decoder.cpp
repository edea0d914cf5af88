// The decoder layers of a Llama-family model in one call per step, over the table's own kernels:
// the same ops in the same order as the Python layers (RMSNorm + residual, quantized qkv, RoPE +
// cache write, paged attention for every row (decodes and prompt chunks), o, RMSNorm + residual,
// gate_up, SiLU·mul, down), into a workspace the caller owns: no allocation, no per-op call cost.
// What Qwen3 and Gemma 3 add: QK-norm on each head of the fused qkv before RoPE; per-layer RoPE
// tables, KV group and window; Gemma's norms after attention and after the MLP; a GELU-tanh gate.
// What MoE models add: a sparse MLP (router, top-k, experts, a shared expert) in place of the dense
// one, and OLMoE's QK-norm over all of q and all of k. What hybrids add: a recurrent token mixer (a
// Gated DeltaNet, LFM2's short conv) in place of attention over the step's state slots, and Qwen3.5's
// gated attention with RoPE on part of each head.
#include "core.h"
#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <utility>

namespace pw {

namespace {

// In place: each q and k head of every row of qkv [T, (Hq + 2 Hkv) D] RMS-normed and scaled by qw / kw;
// whole (OLMoE): all of q and all of k, as if one head each.
void head_norms(const Runtime& rt, float* qkv, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const float* qw,
                const float* kw, float eps, bool whole) {
  const int64_t width = (Hq + 2 * Hkv) * D;
  const int64_t qn = whole ? 1 : Hq, kn = whole ? 1 : Hkv;      // a row's pieces: qn of q, then kn of k
  const int64_t qd = whole ? Hq * D : D, kd = whole ? Hkv * D : D, pieces = qn + kn;
  parallel_for(rt, T * pieces, whole ? 4 : 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t p = r % pieces, n = p < qn ? qd : kd;
      float* x = qkv + (r / pieces) * width + (p < qn ? p * qd : Hq * D + (p - qn) * kd);
      const float* w = p < qn ? qw : kw;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t d = 0; d < n; ++d) ss += x[d] * x[d];
      const float inv = 1.f / std::sqrt(ss / n + eps);
#pragma omp simd
      for (int64_t d = 0; d < n; ++d) x[d] = x[d] * inv * w[d];
    }
  });
}

// out [T, H] = the layer's dense MLP (gate_up, SiLU or GELU-tanh gate, down) of normed [T, H]
void dense_mlp(const Runtime& rt, const DecoderModel& m, const DecoderLayer& L, const float* normed, int64_t T,
               float* gate_up, float* act, float* out) {
  quant_linear(rt, normed, T, m.H, L.gate_up.w, L.gate_up.bias, gate_up);
  (m.gelu ? gelu_and_mul : silu_and_mul)(rt, gate_up, T, L.width, act);
  quant_linear(rt, act, T, L.width, L.down.w, L.down.bias, out);
}

// hidden [T, H] = the layer's mixture of experts of normed [T, H] (router, top-k, experts; Qwen2-MoE's
// shared expert behind its sigmoid gate added), as models/moe.py's SparseMoeBlock computes it.
void sparse_mlp(const Runtime& rt, const DecoderModel& m, const DecoderLayer& L, const float* normed, int64_t T,
                float* scratch, float* gate_up, float* act, float* shared, float* hidden, int64_t* counts) {
  const SparseMlp& sp = *L.sparse;
  const int64_t H = m.H, E = sp.experts.E, k = sp.k;
  int64_t* ids = reinterpret_cast<int64_t*>(scratch);   // [T, k] (scratch: an even offset, 8-byte aligned)
  float* weights = scratch + 2 * T * k;                  // [T, k]
  float* logits = weights + T * k;                       // [T, E]
  float* gate = logits + T * E;                          // [T]
  float_linear(rt, normed, T, H, sp.router, E, logits);
  moe_route(rt, logits, T, E, k, sp.renorm, sp.topk_softmax, weights, ids);
  if (counts != nullptr) team_serial(rt, [&] {
      for (int64_t i = 0; i < T * k; ++i) ++counts[ids[i]];
    });
  expert_mlp(rt, normed, T, ids, weights, k, sp.experts, hidden);
  if (sp.shared_gate == nullptr) return;
  dense_mlp(rt, m, L, normed, T, gate_up, act, shared);
  float_linear(rt, normed, T, H, sp.shared_gate, 1, gate);
  parallel_for(rt, T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float g = 1.f / (1.f + std::exp(-gate[t]));
      for (int64_t c = 0; c < H; ++c) hidden[t * H + c] += g * shared[t * H + c];
    }
  });
}

// Rows keep[0..R) of x [., width] moved to rows 0..R, in order (keep ascending: a row is read before
// it is written over).
void keep_rows(const Runtime& rt, float* x, int64_t width, const int64_t* keep, int64_t R) {
  team_serial(rt, [&] {
    for (int64_t r = 0; r < R; ++r)
      if (keep[r] != r) std::copy(x + keep[r] * width, x + (keep[r] + 1) * width, x + r * width);
  });
}

struct Scratch {              // the step's workspace (decoder_workspace), T rows each
  float *residual, *normed, *hidden, *o, *qkv, *q, *k, *attn, *gate_up, *act, *moe, *wide;
};

Scratch scratch(const DecoderModel& m, int64_t T, float* ws) {
  Scratch w;
  w.residual = ws;                                  // [T, H]
  w.normed = w.residual + T * m.H;                  // [T, H]
  w.hidden = w.normed + T * m.H;                    // [T, H] a layer's output
  w.o = w.hidden + T * m.H;                         // [T, H] its token mixer's
  w.qkv = w.o + T * m.H;                            // [T, (Hq + 2 Hkv) D]
  w.q = w.qkv + T * (m.Hq + 2 * m.Hkv) * m.D;       // [T, Hq, D]
  w.k = w.q + T * m.Hq * m.D;                       // [T, Hkv, D]
  w.attn = w.k + T * m.Hkv * m.D;                   // [T, Hq, D]
  w.gate_up = w.attn + T * m.Hq * m.D;              // [T, 2I]
  w.act = w.gate_up + T * 2 * m.I;                  // [T, I]
  w.moe = w.act + T * m.I;                          // [T, 3 k + E + 2]: a sparse layer's routing (sparse_mlp)
  w.wide = w.moe + (m.E ? T * (m.E + 3 * m.k + 2) : 0);   // [T, W]: a recurrent or gated attention layer's
  return w;
}

// The last layer with keep: rows keep[] of the row-wise buffers given (x [., width] pairs) and of the
// residual moved up; returns the rows left (R, or T elsewhere).
int64_t keep_last(const Runtime& rt, const DecoderModel& m, const DecoderStep& s, int64_t i, const Scratch& w,
                  int64_t T, std::initializer_list<std::pair<float*, int64_t>> rows) {
  if (s.R < 0 || i != m.L - 1) return T;
  for (const auto& [x, width] : rows) keep_rows(rt, x, width, s.keep, s.R);
  keep_rows(rt, w.residual, m.H, s.keep, s.R);
  return s.R;
}

// o [T', H] = layer i's attention of normed [T, H] (every row's keys and values written to its cache);
// with Qwen3.5's gate, qkv gives each q head followed by its gate, then k and v, and the attention's
// output is gated. Returns T' (the kept rows at the last layer).
int64_t attention(const Runtime& rt, const DecoderModel& m, const DecoderStep& s, int64_t i, const Scratch& w,
                  int64_t T) {
  const DecoderLayer& L = m.layers[i];
  const int64_t H = m.H, D = m.D, Hq = m.Hq, Hkv = m.Hkv, width = (Hq + 2 * Hkv) * D, gated = width + Hq * D;
  if (L.attn_gate) {       // fused rows [2 Hq D | k | v] into qkv [q | k | v], the gates left in wide
    quant_linear(rt, w.normed, T, H, L.qkv.w, L.qkv.bias, w.wide);
    parallel_for(rt, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* in = w.wide + t * gated;
        float* out = w.qkv + t * width;
        for (int64_t h = 0; h < Hq; ++h) std::copy(in + 2 * h * D, in + (2 * h + 1) * D, out + h * D);
        std::copy(in + 2 * Hq * D, in + gated, out + Hq * D);
      }
    });
  } else {
    quant_linear(rt, w.normed, T, H, L.qkv.w, L.qkv.bias, w.qkv);
  }
  if (L.q_norm != nullptr) head_norms(rt, w.qkv, T, Hq, Hkv, D, L.q_norm, L.k_norm, m.eps, L.qk_whole);
  rope_partial_and_cache(rt, w.qkv, T, s.positions, L.cos ? L.cos : m.cos, L.sin ? L.sin : m.sin, Hq, Hkv, D,
                         m.rot > 0 ? m.rot : D, s.slots[L.group], s.rows[L.group], s.cache_out[i], w.q, w.k);
  AttentionRows rows = s.R >= 0 && i == m.L - 1 ? s.kept[L.group] : s.rows[L.group];
  Cache cache = s.caches[i];
  cache.fresh = w.k;                         // a quantized cache's partial key groups: the step's keys (all T rows)
  cache.fresh_v = w.qkv + (Hq + Hkv) * D, cache.ldv = width;   // and an int4 cache's values
  if (L.attn_gate) T = keep_last(rt, m, s, i, w, T, {{w.q, Hq * D}, {w.wide, gated}});
  else T = keep_last(rt, m, s, i, w, T, {{w.q, Hq * D}});
  rows.window = L.window;
  const float scale = m.scale > 0.f ? m.scale : 1.f / std::sqrt(static_cast<float>(D));
  paged_attention(rt, w.q, T, Hq, cache, rows, scale, w.attn);
  if (L.attn_gate)
    parallel_for(rt, T * Hq, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {            // r: (row, head)
        const float* g = w.wide + (r / Hq) * gated + (2 * (r % Hq) + 1) * D;
        float* a = w.attn + r * D;
        for (int64_t d = 0; d < D; ++d) a[d] *= 1.f / (1.f + std::exp(-g[d]));
      }
    });
  quant_linear(rt, w.attn, T, Hq * D, L.o.w, L.o.bias, w.o);
  return T;
}

// o [T', H] = layer i's recurrent token mixer of normed [T, H] (its sequences' states advanced): a Gated
// DeltaNet's or LFM2's short conv. Returns T'.
int64_t recurrent(const Runtime& rt, const DecoderModel& m, const DecoderStep& s, int64_t i, const Scratch& w,
                  int64_t T) {
  const DecoderLayer& L = m.layers[i];
  const RecurrentMixer& R = *L.recurrent;
  const int64_t H = m.H;
  if (R.taps != nullptr) {                   // LFM2: B, C, x = in_proj; y = C conv(B x)
    float* bcx = w.wide;                     // [T, 3H]
    float* y = bcx + T * 3 * H;              // [T, H]
    quant_linear(rt, w.normed, T, H, L.qkv.w, L.qkv.bias, bcx);
    short_conv_mix(rt, bcx, 3 * H, T, H, R.taps, R.K, s.recurrent[i], y);
    T = keep_last(rt, m, s, i, w, T, {{y, H}});
    quant_linear(rt, y, T, H, L.o.w, L.o.bias, w.o);
    return T;
  }
  const DeltaNetLayer& D = R.delta;
  const int64_t C = 2 * D.Hk * D.dk + D.Hv * D.dv, V = D.Hv * D.dv;
  float* qkv = w.wide;                       // [T, C]
  float* z = qkv + T * C;                    // [T, V]
  float* b = z + T * V;                      // [T, Hv]
  float* a = b + T * D.Hv;                   // [T, Hv]
  float* mixed = a + T * D.Hv;               // [T, C]
  float* y = mixed + T * C;                  // [T, V]
  quant_linear(rt, w.normed, T, H, L.qkv.w, L.qkv.bias, qkv);
  quant_linear(rt, w.normed, T, H, R.z.w, R.z.bias, z);
  quant_linear(rt, w.normed, T, H, R.b.w, R.b.bias, b);
  quant_linear(rt, w.normed, T, H, R.a.w, R.a.bias, a);
  const DeltaNetRows in{qkv, a, b, z, C, D.Hv, D.Hv, V};
  delta_net_mix(rt, D, in, T, s.recurrent[i], mixed, y);
  T = keep_last(rt, m, s, i, w, T, {{y, V}});
  quant_linear(rt, y, T, V, L.o.w, L.o.bias, w.o);
  return T;
}

void layers(const Runtime& rt, const DecoderModel& m, const DecoderStep& s, const float* x, float* ws, float* out) {
  int64_t T = s.T;                            // the rows still computed (the last layer: R)
  const int64_t H = m.H;
  if (T == 0) return;
  const Scratch w = scratch(m, T, ws);
  parallel_for(rt, T * H, 4096, [&](int64_t begin, int64_t end) { std::copy(x + begin, x + end, w.residual + begin); });
  for (int64_t i = 0; i < m.L; ++i) {
    const DecoderLayer& L = m.layers[i];
    if (i == 0) rms_norm(rt, w.residual, nullptr, L.input_norm, T, H, m.eps, w.normed, nullptr);
    else rms_norm(rt, w.hidden, w.residual, L.input_norm, T, H, m.eps, w.normed, w.residual);
    T = L.recurrent != nullptr ? recurrent(rt, m, s, i, w, T) : attention(rt, m, s, i, w, T);
    if (L.pre_ffn_norm != nullptr) {           // Gemma: norm the attention's output, add, norm again
      rms_norm(rt, w.o, nullptr, L.post_norm, T, H, m.eps, w.o, nullptr);
      rms_norm(rt, w.o, w.residual, L.pre_ffn_norm, T, H, m.eps, w.normed, w.residual);
    } else {
      rms_norm(rt, w.o, w.residual, L.post_norm, T, H, m.eps, w.normed, w.residual);
    }
    if (L.sparse != nullptr)
      sparse_mlp(rt, m, L, w.normed, T, w.moe, w.gate_up, w.act, w.o, w.hidden,
                 s.expert_counts != nullptr ? s.expert_counts + i * m.E : nullptr);
    else
      dense_mlp(rt, m, L, w.normed, T, w.gate_up, w.act, w.hidden);
    if (L.post_ffn_norm != nullptr) rms_norm(rt, w.hidden, nullptr, L.post_ffn_norm, T, H, m.eps, w.hidden, nullptr);
  }
  rms_norm(rt, w.hidden, w.residual, m.final_norm, T, H, m.eps, out, w.residual);
}

}  // namespace

// Every op of every layer runs inside one parallel region: the threads meet at a barrier after
// each op (team calls, parallel.h) instead of starting a region per op, ~300 a decode step.
void decoder_stack(const Runtime& rt, const DecoderModel& m, const DecoderStep& s, const float* x, float* ws,
                   float* out) {
  if (rt.team || rt.threads <= 1 || in_region()) return layers(rt, m, s, x, ws, out);
  run_region(rt.threads, [&] {
    const Runtime team{region_threads(), true};
    layers(team, m, s, x, ws, out);
  });
}

}  // namespace pw
