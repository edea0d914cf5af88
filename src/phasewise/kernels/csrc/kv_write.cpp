// The KV cache's writer (write_kv, and rope_and_cache's after rotating): a step's keys and values into
// their slots. An fp32 cache takes them as they are. An int8 cache (kernels.h, docs/architecture.md
// "int8 KV cache") takes V per token (one symmetric scale per slot and KV head), and K per group of 16
// tokens: a group is quantized in the step that writes its last token, each channel's midpoint and step
// over its 16 keys; until then its keys stay fp32. Per sequence the writer keeps in its tail slot the
// groups a later step may still read as floats: the group of its first new token (its older keys are
// there already) and the group of its last (after a verify's rejected drafts the sequence may end in
// either). The arithmetic is layers/kv_int8.py's, value for value (built in order: build.py).
#include "core.h"
#include "parallel.h"

#include <algorithm>
#include <cmath>

namespace pw {
namespace {

// y = round(x / scale) with scale = max|x| / 127 (symmetric int8, one scale per row); returns scale.
inline float quant_row(const float* __restrict x, int8_t* __restrict y, int64_t D) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float scale = amax > 0.f ? amax / 127.f : 1.f;
  const float inv = 1.f / scale;
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) y[d] = static_cast<int8_t>(std::nearbyint(x[d] * inv));
  return scale;
}

// Where group g sits in the cache: the slot of its first token (its 16 slots follow).
inline int64_t group_slot(const AttentionRows& ar, int64_t s, int64_t g) {
  const int64_t pos = KEY_GROUP * g, bs = ar.block_size;
  return ar.tables[s * ar.max_blocks + pos / bs] * bs + pos % bs;
}

// The 16 keys x[j] ([Hkv, D] each) of a group into codes at slots slot0.. and its (mid, step) [Hkv, 2, D].
void quantize_group(const float* const* x, int64_t Hkv, int64_t D, int64_t slot0, const CacheOut& c) {
  float* params = c.kg + slot0 / KEY_GROUP * Hkv * 2 * D;
  for (int64_t i = 0; i < Hkv * D; ++i) {
    float lo = x[0][i], hi = x[0][i];
    for (int64_t j = 1; j < KEY_GROUP; ++j) lo = std::min(lo, x[j][i]), hi = std::max(hi, x[j][i]);
    const float mid = (lo + hi) * 0.5f, step = (hi - lo) * (1.f / 254.f), inv = step > 0.f ? 1.f / step : 0.f;
    const int64_t h = i / D, d = i % D;
    params[(h * 2) * D + d] = mid;
    params[(h * 2 + 1) * D + d] = step;
    for (int64_t j = 0; j < KEY_GROUP; ++j) {
      const float code = std::nearbyint((x[j][i] - mid) * inv);
      c.kq[(slot0 + j) * Hkv * D + i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, code)));
    }
  }
}

// One sequence's keys (s: its index in ar.seqs; k: the step's [T, Hkv, D]): its groups that fill
// quantized, then its first and last groups' new keys into its tail slot (tail_groups already says where).
void write_keys(const AttentionRows& ar, int64_t s, const float* k, int64_t Hkv, int64_t D, const CacheOut& c) {
  const int64_t* q = ar.seqs + 4 * s;
  const int64_t start = q[0], n = q[1], row0 = q[2], slot = q[3], ctx = start + n, width = Hkv * D;
  const int64_t g0 = start / KEY_GROUP, gl = (ctx - 1) / KEY_GROUP;
  const int64_t* held = c.tail_groups + 2 * slot;
  float* tail0 = c.tails + (2 * slot + (held[0] == g0 ? 0 : 1)) * KEY_GROUP * width;
  float* taill = c.tails + (2 * slot + (held[0] == gl ? 0 : 1)) * KEY_GROUP * width;
  auto key = [&](int64_t pos) -> const float* {   // a float key of the sequence, g0's group on
    return pos < start ? tail0 + (pos % KEY_GROUP) * width : k + (row0 + pos - start) * width;
  };
  for (int64_t g = g0; g < ctx / KEY_GROUP; ++g) {
    const float* x[KEY_GROUP];
    for (int64_t j = 0; j < KEY_GROUP; ++j) x[j] = key(KEY_GROUP * g + j);
    quantize_group(x, Hkv, D, group_slot(ar, s, g), c);
  }
  for (int64_t pos = start; pos < std::min(ctx, (g0 + 1) * KEY_GROUP); ++pos)
    std::copy(key(pos), key(pos) + width, tail0 + (pos % KEY_GROUP) * width);
  if (gl != g0)
    for (int64_t pos = gl * KEY_GROUP; pos < ctx; ++pos) std::copy(key(pos), key(pos) + width, taill + (pos % KEY_GROUP) * width);
}

// Which of a tail slot's two groups hold g0 and gl (layers/kv_int8.py tail_halves): g0 where it is held
// already, else in place of the older; gl in the other. Every layer of a step decides alike.
void hold_tail_groups(int64_t* held, int64_t g0, int64_t gl) {
  const int64_t h0 = held[0] == g0 ? 0 : held[1] == g0 ? 1 : held[0] <= held[1] ? 0 : 1;
  const int64_t hl = gl == g0 ? h0 : 1 - h0;
  held[h0] = g0;
  held[hl] = gl;
}

}  // namespace

// v: rows ldv floats apart (the v of a fused qkv row); k contiguous [T, Hkv, D]
void write_kv(const Runtime& rt, const float* k, const float* v, int64_t ldv, int64_t T, int64_t Hkv, int64_t D,
              const int64_t* slots, const AttentionRows& ar, const CacheOut& c) {
  const int64_t width = Hkv * D;
  if (c.kq == nullptr) {
    parallel_for(rt, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        std::copy(k + t * width, k + (t + 1) * width, c.k + slots[t] * width);
        std::copy(v + t * ldv, v + t * ldv + width, c.v + slots[t] * width);
      }
    });
    return;
  }
  parallel_for(rt, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t at = slots[t] * Hkv + h;
        c.vs[at] = quant_row(v + t * ldv + h * D, c.vq + at * D, D);
      }
  });
  team_serial(rt, [&] {
    for (int64_t s = 0; s < ar.num_seqs; ++s) {
      const int64_t* q = ar.seqs + 4 * s;
      hold_tail_groups(c.tail_groups + 2 * q[3], q[0] / KEY_GROUP, (q[0] + q[1] - 1) / KEY_GROUP);
    }
  });
  parallel_for(rt, ar.num_seqs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) write_keys(ar, s, k, Hkv, D, c);
  });
}

}  // namespace pw
