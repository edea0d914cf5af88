// The decoder layers of a Llama-family model in one call per step, over the table's own kernels:
// the same ops in the same order as the Python layers (RMSNorm + residual, quantized qkv, RoPE +
// cache write, paged attention for every row (decodes and prompt chunks), o, RMSNorm + residual,
// gate_up, SiLU·mul, down), into a workspace the caller owns: no allocation, no per-op call cost.
// What Qwen3 and Gemma 3 add: QK-norm on each head of the fused qkv before RoPE; per-layer RoPE
// tables, KV group and window; Gemma's norms after attention and after the MLP; a GELU-tanh gate.
// What MoE models add: a sparse MLP (router, top-k, experts, a shared expert) in place of the dense
// one, and OLMoE's QK-norm over all of q and all of k.
#include "core.h"
#include "parallel.h"

#include <algorithm>
#include <cmath>

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

void layers(const Runtime& rt, const DecoderModel& m, const DecoderStep& s, const float* x, float* ws, float* out) {
  int64_t T = s.T;                            // the rows still computed (the last layer: R)
  const int64_t H = m.H, I = m.I, D = m.D, Hq = m.Hq, Hkv = m.Hkv;
  if (T == 0) return;
  float* residual = ws;                       // [T, H]
  float* normed = residual + T * H;           // [T, H]
  float* hidden = normed + T * H;             // [T, H] a layer's output
  float* o = hidden + T * H;                  // [T, H]
  float* qkv = o + T * H;                     // [T, (Hq + 2 Hkv) D]
  float* q = qkv + T * (Hq + 2 * Hkv) * D;    // [T, Hq, D]
  float* k = q + T * Hq * D;                  // [T, Hkv, D]
  float* attn = k + T * Hkv * D;              // [T, Hq, D]
  float* gate_up = attn + T * Hq * D;         // [T, 2I]
  float* act = gate_up + T * 2 * I;           // [T, I]
  float* moe = act + T * I;                   // [T, 3 k + E + 2]: a sparse layer's routing (sparse_mlp)
  const float scale = m.scale > 0.f ? m.scale : 1.f / std::sqrt(static_cast<float>(D));
  parallel_for(rt, T * H, 4096, [&](int64_t begin, int64_t end) { std::copy(x + begin, x + end, residual + begin); });
  for (int64_t i = 0; i < m.L; ++i) {
    const DecoderLayer& L = m.layers[i];
    if (i == 0) rms_norm(rt, residual, nullptr, L.input_norm, T, H, m.eps, normed, nullptr);
    else rms_norm(rt, hidden, residual, L.input_norm, T, H, m.eps, normed, residual);
    quant_linear(rt, normed, T, H, L.qkv.w, L.qkv.bias, qkv);
    if (L.q_norm != nullptr) head_norms(rt, qkv, T, Hq, Hkv, D, L.q_norm, L.k_norm, m.eps, L.qk_whole);
    rope_and_cache(rt, qkv, T, s.positions, L.cos ? L.cos : m.cos, L.sin ? L.sin : m.sin, Hq, Hkv, D,
                   s.slots[L.group], s.cache_out[i], q, k);
    AttentionRows rows = s.rows[L.group];
    if (s.R >= 0 && i == m.L - 1) {   // the rest of the last layer: only the kept rows
      keep_rows(rt, q, Hq * D, s.keep, s.R);
      keep_rows(rt, residual, H, s.keep, s.R);
      rows = s.kept[L.group];
      T = s.R;
    }
    rows.window = L.window;
    paged_attention(rt, q, T, Hq, s.caches[i], rows, scale, attn);
    quant_linear(rt, attn, T, Hq * D, L.o.w, L.o.bias, o);
    if (L.pre_ffn_norm != nullptr) {           // Gemma: norm the attention's output, add, norm again
      rms_norm(rt, o, nullptr, L.post_norm, T, H, m.eps, o, nullptr);
      rms_norm(rt, o, residual, L.pre_ffn_norm, T, H, m.eps, normed, residual);
    } else {
      rms_norm(rt, o, residual, L.post_norm, T, H, m.eps, normed, residual);
    }
    if (L.sparse != nullptr)
      sparse_mlp(rt, m, L, normed, T, moe, gate_up, act, o, hidden,
                 s.expert_counts != nullptr ? s.expert_counts + i * m.E : nullptr);
    else
      dense_mlp(rt, m, L, normed, T, gate_up, act, hidden);
    if (L.post_ffn_norm != nullptr) rms_norm(rt, hidden, nullptr, L.post_ffn_norm, T, H, m.eps, hidden, nullptr);
  }
  rms_norm(rt, hidden, residual, m.final_norm, T, H, m.eps, out, residual);
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
