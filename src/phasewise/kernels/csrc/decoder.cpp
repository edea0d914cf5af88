// The decoder layers of a Llama-family model in one call per step, over the table's own kernels:
// the same ops in the same order as the Python layers (RMSNorm + residual, quantized qkv, RoPE +
// cache write, paged attention for every row (decodes and prompt chunks), o, RMSNorm + residual,
// gate_up, SiLU·mul, down), into a workspace the caller owns: no allocation, no per-op call cost.
#include "core.h"
#include "parallel.h"

#include <algorithm>
#include <cmath>

namespace pw {

namespace {

void layers(const Runtime& rt, const DecoderModel& m, const DecoderStep& s, const float* x, float* ws, float* out) {
  const int64_t T = s.T, H = m.H, I = m.I, D = m.D, Hq = m.Hq, Hkv = m.Hkv;
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
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  parallel_for(rt, T * H, 4096, [&](int64_t begin, int64_t end) { std::copy(x + begin, x + end, residual + begin); });
  for (int64_t i = 0; i < m.L; ++i) {
    const DecoderLayer& L = m.layers[i];
    if (i == 0) rms_norm(rt, residual, nullptr, L.input_norm, T, H, m.eps, normed, nullptr);
    else rms_norm(rt, hidden, residual, L.input_norm, T, H, m.eps, normed, residual);
    quant_linear(rt, normed, T, H, L.qkv.w, L.qkv.bias, qkv);
    rope_and_cache(rt, qkv, T, s.positions, m.cos, m.sin, Hq, Hkv, D, s.slots, s.cache_out[i], q, k);
    paged_attention(rt, q, T, Hq, s.caches[i], s.rows, scale, attn);
    quant_linear(rt, attn, T, Hq * D, L.o.w, L.o.bias, o);
    rms_norm(rt, o, residual, L.post_norm, T, H, m.eps, normed, residual);
    quant_linear(rt, normed, T, H, L.gate_up.w, L.gate_up.bias, gate_up);
    silu_and_mul(rt, gate_up, T, I, act);
    quant_linear(rt, act, T, I, L.down.w, L.down.bias, hidden);
  }
  rms_norm(rt, hidden, residual, m.final_norm, T, H, m.eps, out, residual);
}

}  // namespace

// Every op of every layer runs inside one parallel region: the threads meet at a barrier after
// each op (team calls, parallel.h) instead of starting a region per op, ~300 a decode step.
void decoder_stack(const Runtime& rt, const DecoderModel& m, const DecoderStep& s, const float* x, float* ws,
                   float* out) {
  if (rt.team || rt.threads <= 1 || omp_in_parallel()) return layers(rt, m, s, x, ws, out);
#pragma omp parallel num_threads(rt.threads)
  {
    const Runtime team{omp_get_num_threads(), true};
    layers(team, m, s, x, ws, out);
  }
}

}  // namespace pw
