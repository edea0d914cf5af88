// The model's fused non-matmul ops, fp32, contiguous rows (their PyTorch references live in
// layers/; tests compare the two):
//  - rope_and_cache: split a fused qkv row, rotate q and k (NeoX halves), write k and v to their
//    cache slots (kv_write.cpp);
//  - rms_norm: optional residual add, then RMSNorm, in one pass;
//  - silu_and_mul: silu(gate) * up of a fused gate_up row; gelu_and_mul: the same with GELU-tanh (Gemma);
//  - argmax_rows: each row's largest value's index (greedy sampling);
//  - mask_rows: -inf where a grammar's bitmask refuses the token (structured outputs);
//  - float_linear: x W^T in fp32, a row's bits independent of the other rows (a router's scores).
#include "core.h"

#include "parallel.h"
#include "vec/vec.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace pw {
void rope_and_cache(const Runtime& rt, const float* qkv, int64_t T, const int64_t* pos, const float* cos,
                    const float* sin, int64_t Hq, int64_t Hkv, int64_t D, const int64_t* slot,
                    const AttentionRows& rows, const CacheOut& c, float* qp, float* kp) {
  rope_partial_and_cache(rt, qkv, T, pos, cos, sin, Hq, Hkv, D, D, slot, rows, c, qp, kp);
}

void rope_partial_and_cache(const Runtime& rt, const float* qkv, int64_t T, const int64_t* pos, const float* cos,
                            const float* sin, int64_t Hq, int64_t Hkv, int64_t D, int64_t rot, const int64_t* slot,
                            const AttentionRows& rows, const CacheOut& c, float* qp, float* kp) {
  const int64_t half = rot / 2, row = (Hq + 2 * Hkv) * D;
  parallel_for(rt, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cs = cos + pos[t] * half;
      const float* sn = sin + pos[t] * half;
      const float* in = qkv + t * row;
      auto rotate = [&](const float* x, float* y, int64_t heads) {
        for (int64_t h = 0; h < heads; ++h) {
          const float* xh = x + h * D;
          float* yh = y + h * D;
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = xh[i], x2 = xh[i + half];
            yh[i] = x1 * cs[i] - x2 * sn[i];
            yh[i + half] = x2 * cs[i] + x1 * sn[i];
          }
          std::copy(xh + rot, xh + D, yh + rot);    // past rot: as they are
        }
      };
      rotate(in, qp + t * Hq * D, Hq);
      rotate(in + Hq * D, kp + t * Hkv * D, Hkv);
    }
  });
  write_kv(rt, kp, qkv + (Hq + Hkv) * D, row, T, Hkv, D, slot, rows, c);
}

void rms_norm(const Runtime& rt, const float* xp, const float* rp, const float* w, int64_t T, int64_t H, float eps,
              float* op, float* sp) {
  parallel_for(rt, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* in = xp + t * H;
      if (rp != nullptr) {
        float* st = sp + t * H;
        const float* rt_ = rp + t * H;
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) st[i] = in[i] + rt_[i];
        in = st;
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += in[i] * in[i];
      const float inv = 1.f / std::sqrt(ss / H + eps);
      float* ot = op + t * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) ot[i] = in[i] * inv * w[i];
    }
  });
}

namespace {

// x [T, 2I] (gate | up) -> out [T, I] = g / (1 + e^z(g)) * up: SiLU and GELU-tanh are both
// g sigmoid(-z); `z` and `zs` give z for a vector and for a float (e^x vectorised).
template <typename Z, typename Zs>
void gate_and_mul(const Runtime& rt, const float* xp, int64_t T, int64_t I, float* op, const Z& z, const Zs& zs) {
  parallel_for(rt, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = xp + t * 2 * I;
      const float* u = g + I;
      float* o = op + t * I;
      int64_t i = 0;
      for (; i + 16 <= I; i += 16) {
        const Vf gv = Vf::load(g + i);
        (gv / (Vf::set1(1.f) + exp(z(gv))) * Vf::load(u + i)).store(o + i);
      }
      for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(zs(g[i]))) * u[i];
    }
  });
}

constexpr float GELU_C = 0.7978845608028654f, GELU_A = 0.044715f;   // sqrt(2 / pi), the cubic's weight

}  // namespace

// silu(g) = g / (1 + e^-g)
void silu_and_mul(const Runtime& rt, const float* xp, int64_t T, int64_t I, float* op) {
  gate_and_mul(rt, xp, T, I, op, [](Vf g) { return Vf::zero() - g; }, [](float g) { return -g; });
}

// gelu_tanh(g) = 0.5 g (1 + tanh(y)) = g / (1 + e^-2y), y = c (g + 0.044715 g^3)
void gelu_and_mul(const Runtime& rt, const float* xp, int64_t T, int64_t I, float* op) {
  gate_and_mul(
      rt, xp, T, I, op,
      [](Vf g) { return Vf::set1(-2.f * GELU_C) * (g + Vf::set1(GELU_A) * g * g * g); },
      [](float g) { return -2.f * GELU_C * (g + GELU_A * g * g * g); });
}

namespace {

struct Best {
  float value;
  int64_t index;
};

// The first largest value of row[begin, end) and its index (NaN never wins; all -inf: begin).
Best argmax_span(const float* row, int64_t begin, int64_t end) {
  const Vf neg_inf = Vf::set1(-std::numeric_limits<float>::infinity());
  const Vi step = Vi::set1(16);
  Vf best = neg_inf;
  Vi where = Vi::zero(), lane = Vi::iota();       // counted from begin
  auto take = [&](const Vf& v) {
    const Mask more = v > best;                   // strictly: the first wins
    best = select(more, v, best);
    where = select(more, lane, where);
    lane = lane + step;
  };
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) take(Vf::load(row + i));
  if (i < end) take(select(first_n(end - i), Vf::load_n(row + i, end - i), neg_inf));
  alignas(64) float bv[16];
  alignas(64) int32_t bi[16];
  best.store(bv);
  where.store(bi);
  Best r{bv[0], bi[0]};
  for (int k = 1; k < 16; ++k)
    if (bv[k] > r.value || (bv[k] == r.value && bi[k] < r.index)) r = {bv[k], bi[k]};
  r.index += begin;
  return r;
}

}  // namespace

// torch's own CPU argmax reads under 1 GB/s; this one at memory speed, a row in as many pieces as
// there are threads when the rows are fewer (greedy decode of one sequence). Ties: the first index.
void argmax_rows(const Runtime& rt, const float* xp, int64_t B, int64_t V, int64_t* op) {
  const int64_t threads = std::max(rt.threads, 1);
  const int64_t S = B >= threads ? 1 : (threads + B - 1) / B, piece = (V + S - 1) / S;
  std::vector<Best> best(B * S);
  parallel_for(rt, B * S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t lo = std::min(V, (u % S) * piece), hi = std::min(V, lo + piece);
      best[u] = argmax_span(xp + (u / S) * V, lo, hi);
    }
  });
  for (int64_t b = 0; b < B; ++b) {
    Best r = best[b * S];
    for (int64_t s = 1; s < S; ++s)
      if (best[b * S + s].value > r.value) r = best[b * S + s];
    op[b] = r.index;
  }
}

// One pass over the logits: torch's masked_fill over the unpacked [B, V] bools takes ~10x as long
// (5 ms a step at batch 32 over 49k tokens). Grammar masks are mostly whole words of 0 or -1.
void mask_rows(const Runtime& rt, const float* xp, int64_t B, int64_t V, const int32_t* words, float* op) {
  const int64_t W = (V + 31) / 32;
  const float neg = -std::numeric_limits<float>::infinity();
  parallel_for(rt, B * W, 256, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u / W, j = u % W, lo = j * 32, n = std::min<int64_t>(32, V - lo);
      const uint32_t w = static_cast<uint32_t>(words[u]);
      const float* x = xp + b * V + lo;
      float* o = op + b * V + lo;
      if (w == 0xFFFFFFFFu) {
        std::copy(x, x + n, o);
      } else if (w == 0) {
        std::fill(o, o + n, neg);
      } else {
        for (int64_t i = 0; i < n; ++i) o[i] = (w >> i) & 1u ? x[i] : neg;
      }
    }
  });
}

// Each output by one dot product of 16-lane vectors in a fixed order (two accumulators, the tail, then
// the lanes as one tree at every level), so a row's scores do not depend on how many rows share the
// call (torch's GEMM rounds a lone row, a GEMV, apart).
void float_linear(const Runtime& rt, const float* x, int64_t T, int64_t K, const float* w, int64_t N, float* out) {
  parallel_for(rt, T * N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* xr = x + (i / N) * K;
      const float* wr = w + (i % N) * K;
      Vf a0 = Vf::zero(), a1 = Vf::zero();
      int64_t c = 0;
      for (; c + 32 <= K; c += 32) {
        a0 = fma(Vf::load(xr + c), Vf::load(wr + c), a0);
        a1 = fma(Vf::load(xr + c + 16), Vf::load(wr + c + 16), a1);
      }
      for (; c < K; c += 16) {
        const int64_t n = std::min<int64_t>(16, K - c);
        a0 = fma(Vf::load_n(xr + c, n), Vf::load_n(wr + c, n), a0);
      }
      out[i] = reduce_add_pairs(a0 + a1);
    }
  });
}

}  // namespace pw
