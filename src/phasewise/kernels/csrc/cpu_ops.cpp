// phasewise's fused CPU ops for the model's non-matmul work, fp32, contiguous tensors:
//  - paged_attention (in paged_attention.cpp): query rows over the paged KV cache, read in place.
//  - rope_and_cache: split a fused qkv row, rotate q and k (NeoX halves), write k and v to their slots.
//  The KV cache is fp32, or int8 with one fp32 scale per (slot, KV head).
//  - rms_norm: optional residual add, then RMSNorm, in one pass.
//  - silu_and_mul: silu(gate) * up of a fused gate_up row.
//  - argmax_rows: each row's largest value's index (greedy sampling).
// Each has a pure-PyTorch reference in layers/; tests compare the two.
#include "ops.h"
#include "simd.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

// y = round(x / scale) with scale = max|x| / 127 (symmetric int8, one scale per row); returns scale.
inline float quant(const float* __restrict x, int8_t* __restrict y, int64_t D) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float scale = amax > 0.f ? amax / 127.f : 1.f;
  const float inv = 1.f / scale;
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) y[d] = static_cast<int8_t>(std::nearbyint(x[d] * inv));
  return scale;
}

}  // namespace

// qkv: [T, (Hq + 2 Hkv) D]; positions: [T] int64; cos, sin: [P, D/2]; caches: [S, Hkv, D];
// slots: [T] int64. Returns rotated q [T, Hq, D] and k [T, Hkv, D]; k and v are written to the cache.
// An int8 cache stores each (token, head) row quantized, its scale in k_scale / v_scale [S, Hkv].
std::vector<torch::Tensor> rope_and_cache(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos,
                                          torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                                          torch::Tensor slots, int64_t Hq, int64_t Hkv,
                                          c10::optional<torch::Tensor> k_scale,
                                          c10::optional<torch::Tensor> v_scale) {
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(!int8 || (k_scale.has_value() && v_scale.has_value()), "an int8 cache needs its scales");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && (int8 || k_cache.scalar_type() == at::kFloat),
              "fp32 qkv, fp32 or int8 cache");
  TORCH_CHECK(qkv.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              cos.is_contiguous() && sin.is_contiguous(), "contiguous inputs");
  const int64_t T = qkv.size(0), D = k_cache.size(2), half = D / 2, row = qkv.size(1);
  TORCH_CHECK(row == (Hq + 2 * Hkv) * D, "qkv width does not match the heads");
  auto q = torch::empty({T, Hq, D}, qkv.options());
  auto k = torch::empty({T, Hkv, D}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  float* kc = int8 ? nullptr : k_cache.data_ptr<float>();
  float* vc = int8 ? nullptr : v_cache.data_ptr<float>();
  int8_t* kq = int8 ? k_cache.data_ptr<int8_t>() : nullptr;
  int8_t* vq = int8 ? v_cache.data_ptr<int8_t>() : nullptr;
  float* ks = int8 ? k_scale->data_ptr<float>() : nullptr;
  float* vs = int8 ? v_scale->data_ptr<float>() : nullptr;
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pos[t] * half;
      const float* s = sp + pos[t] * half;
      const float* in = src + t * row;
      auto rotate = [&](const float* x, float* y, int64_t heads) {
        for (int64_t h = 0; h < heads; ++h) {
          const float* xh = x + h * D;
          float* yh = y + h * D;
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = xh[i], x2 = xh[i + half];
            yh[i] = x1 * c[i] - x2 * s[i];
            yh[i + half] = x2 * c[i] + x1 * s[i];
          }
        }
      };
      rotate(in, qp + t * Hq * D, Hq);
      float* kt = kp + t * Hkv * D;
      rotate(in + Hq * D, kt, Hkv);
      const float* vt = in + (Hq + Hkv) * D;
      if (int8) {
        for (int64_t h = 0; h < Hkv; ++h) {
          const int64_t at = slot[t] * Hkv + h;
          ks[at] = quant(kt + h * D, kq + at * D, D);
          vs[at] = quant(vt + h * D, vq + at * D, D);
        }
      } else {
        std::copy(kt, kt + Hkv * D, kc + slot[t] * Hkv * D);
        std::copy(vt, vt + Hkv * D, vc + slot[t] * Hkv * D);
      }
    }
  });
  return {q, k};
}

// x, residual (optional): [T, H]; weight: [H]. Returns (normed, x + residual) or (normed,).
std::vector<torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                    c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "fp32, contiguous");
  const int64_t T = x.size(0), H = x.size(1);
  auto out = torch::empty_like(x);
  torch::Tensor sum;
  const float* rp = nullptr;
  float* sp = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes(), "residual like x");
    sum = torch::empty_like(x);
    rp = residual->data_ptr<float>();
    sp = sum.data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* in = xp + t * H;
      if (sp) {
        float* st = sp + t * H;
        const float* rt = rp + t * H;
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) st[i] = in[i] + rt[i];
        in = st;
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += in[i] * in[i];
      const float inv = 1.f / std::sqrt(ss / H + e);
      float* ot = op + t * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) ot[i] = in[i] * inv * w[i];
    }
  });
  if (sp) return {out, sum};
  return {out};
}

// x: [T, 2I] (gate | up) → [T, I] = silu(gate) * up.
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "fp32, contiguous");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto out = torch::empty({T, I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = xp + t * 2 * I;
      const float* u = g + I;
      float* o = op + t * I;
      int64_t i = 0;
      for (; i + 16 <= I; i += 16) {              // silu(g) = g / (1 + e^-g), e^x vectorised
        const __m512 gv = _mm512_loadu_ps(g + i);
        const __m512 e = pw_simd::exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)),
                                              _mm512_loadu_ps(u + i)));
      }
      for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

// x: [B, V] fp32 → [B] int64, the index of each row's largest value (the first, on ties), as
// torch.argmax; torch's own CPU argmax reads under 1 GB/s, this one at memory speed.
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "fp32, contiguous [B, V]");
  const int64_t B = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0 && V < (int64_t{1} << 31), "0 < V < 2^31");
  auto out = torch::empty({B}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* row = xp + b * V;
      __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      __m512i where = _mm512_set1_epi32(0);
      __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512i step = _mm512_set1_epi32(16);
      for (int64_t i = 0; i < V; i += 16) {
        const __mmask16 valid = V - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (V - i)) - 1);
        const __m512 v = _mm512_maskz_loadu_ps(valid, row + i);
        const __mmask16 more = _mm512_mask_cmp_ps_mask(valid, v, best, _CMP_GT_OQ);   // strictly: first wins
        best = _mm512_mask_mov_ps(best, more, v);
        where = _mm512_mask_mov_epi32(where, more, lane);
        lane = _mm512_add_epi32(lane, step);
      }
      alignas(64) float bv[16];
      alignas(64) int32_t bi[16];
      _mm512_store_ps(bv, best);
      _mm512_store_si512(bi, where);
      int32_t arg = bi[0];
      float top = bv[0];
      for (int k = 1; k < 16; ++k)
        if (bv[k] > top || (bv[k] == top && bi[k] < arg)) top = bv[k], arg = bi[k];
      op[b] = arg;
    }
  });
  return out;
}
