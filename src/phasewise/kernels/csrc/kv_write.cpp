// The KV cache's writer (write_kv, and rope_and_cache's after rotating): a step's keys and values into
// their slots. An fp32 cache takes them as they are. An int8 cache (kernels.h, docs/architecture.md
// "int8 KV cache") takes V per token (one symmetric scale per slot and KV head), and K per group of 16
// tokens: a group is quantized in the step that writes its last token, each channel's midpoint and step
// over its 16 keys; until then its keys stay fp32. Per sequence the writer keeps in its tail slot the
// groups a later step may still read as floats: the group of its first new token (its older keys are
// there already) and the group of its last (after a verify's rejected drafts the sequence may end in
// either). An int4 cache (kernels.h) is written alike with 4-bit codes: K per group of 64 tokens with fp16
// minimums and steps, V per token in blocks of 32 values, quantized with its group's keys and kept in
// the tail until then. The arithmetic is layers/kv_int8.py's and layers/kv_int4.py's, value for value
// (built in order: build.py).
#include "core.h"
#include "half.h"
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

// x [D] as int4 codes y [D / 2] (two a byte, kernels.h) in blocks of 32 values, each with its fp16 scale in
// scales [D / 32]: d = m / -8 for m the block's value of largest magnitude (its first), code = round(x / d) + 8
// in 0..15 (q4_0's rounding: m is code 0 exactly, and 16 levels are used).
inline void quant_row4(const float* __restrict x, uint8_t* __restrict y, uint16_t* __restrict scales, int64_t D) {
  uint8_t codes[MAX_HEAD_SIZE];
  for (int64_t b = 0; b < D; b += V4_BLOCK) {
    float amax = 0.f, m = 0.f;
    for (int64_t d = b; d < b + V4_BLOCK; ++d)
      if (std::fabs(x[d]) > amax) amax = std::fabs(x[d]), m = x[d];
    const uint16_t h = f16_bits(std::min(65504.f, std::max(-65504.f, m * -0.125f)));
    const float step = f16_value(h), inv = step != 0.f ? 1.f / step : 0.f;
    scales[b / V4_BLOCK] = h;
    for (int64_t d = b; d < b + V4_BLOCK; ++d)
      codes[d] = static_cast<uint8_t>(std::min(15.f, std::max(0.f, std::nearbyint(x[d] * inv) + 8.f)));
  }
  for (int64_t d = 0; d < D; d += 64)
    for (int64_t i = 0; i < 32; ++i) y[d / 2 + i] = static_cast<uint8_t>(codes[d + i] | codes[d + 32 + i] << 4);
}

// Where group g (of `group` tokens) sits in the cache: the slot of its first token (its slots follow).
inline int64_t group_slot(const AttentionRows& ar, int64_t s, int64_t g, int64_t group) {
  const int64_t pos = group * g, bs = ar.block_size;
  return ar.tables[s * ar.max_blocks + pos / bs] * bs + pos % bs;
}

// Channel i of an int4 key group of 64 keys x[j] [Hkv D]: its fp16 minimum and step at params (min) and
// params[D] (step), its codes (code = round((x - min) / step), 0..15) returned in codes[64].
void quantize_channel4(const float* const* x, int64_t i, uint16_t* params, int64_t D, uint8_t* codes) {
  float lo = x[0][i], hi = x[0][i];
  for (int64_t j = 1; j < KEY_GROUP4; ++j) lo = std::min(lo, x[j][i]), hi = std::max(hi, x[j][i]);
  const uint16_t lh = f16_bits(std::min(65504.f, std::max(-65504.f, lo)));
  const float l = f16_value(lh);
  const uint16_t sh = f16_bits(std::min(65504.f, (hi - l) * (1.f / 15.f)));
  const float step = f16_value(sh), inv = step > 0.f ? 1.f / step : 0.f;
  params[0] = lh;
  params[D] = sh;
  for (int64_t j = 0; j < KEY_GROUP4; ++j)
    codes[j] = static_cast<uint8_t>(std::min(15.f, std::max(0.f, std::nearbyint((x[j][i] - l) * inv))));
}

// The 64 keys x[j] ([Hkv, D] each) of an int4 group into codes at slots slot0.. and its (min, step) [Hkv, 2, D].
void quantize_group4(const float* const* x, int64_t Hkv, int64_t D, int64_t slot0, const CacheOut& c) {
  uint16_t* params = c.kg4 + slot0 / KEY_GROUP4 * Hkv * 2 * D;
  uint8_t lo[KEY_GROUP4], hi[KEY_GROUP4];
  for (int64_t h = 0; h < Hkv; ++h)
    for (int64_t d = 0; d < D; d += 64)
      for (int64_t r = 0; r < 32; ++r) {         // channels d + r and d + 32 + r share their bytes
        const int64_t i = h * D + d + r;
        quantize_channel4(x, i, params + h * 2 * D + d + r, D, lo);
        quantize_channel4(x, i + 32, params + h * 2 * D + d + 32 + r, D, hi);
        for (int64_t j = 0; j < KEY_GROUP4; ++j)
          c.k4[((slot0 + j) * Hkv + h) * D / 2 + d / 2 + r] = static_cast<uint8_t>(lo[j] | hi[j] << 4);
      }
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

// One sequence's keys, and an int4 cache's values (s: its index in ar.seqs; k: the step's [T, Hkv, D], v
// its rows ldv apart): its groups that fill quantized, then its first and last groups' new keys (values)
// into its tail slot (tail_groups already says where).
void write_groups(const AttentionRows& ar, int64_t s, const float* k, const float* v, int64_t ldv, int64_t Hkv,
                  int64_t D, const CacheOut& c) {
  const int64_t* q = ar.seqs + 4 * s;
  const int64_t start = q[0], n = q[1], row0 = q[2], slot = q[3], ctx = start + n, width = Hkv * D;
  const int64_t G = c.group(), g0 = start / G, gl = (ctx - 1) / G, parts = c.k4 != nullptr ? 2 : 1;
  const int64_t* held = c.tail_groups + 2 * slot;
  // the tail's rows of g0's and gl's group, keys (part 0) or values (part 1): [G, Hkv, D] each
  auto tail = [&](int64_t g, int64_t part) { return c.tails + ((2 * slot + (held[0] == g ? 0 : 1)) * parts + part) * G * width; };
  auto key = [&](int64_t pos) -> const float* {   // a float key of the sequence, g0's group on
    return pos < start ? tail(g0, 0) + (pos % G) * width : k + (row0 + pos - start) * width;
  };
  auto value = [&](int64_t pos) -> const float* {   // and (int4) its value, a row of Hkv D
    return pos < start ? tail(g0, 1) + (pos % G) * width : v + (row0 + pos - start) * ldv;
  };
  for (int64_t g = g0; g < ctx / G; ++g) {
    const float* x[KEY_GROUP4];
    for (int64_t j = 0; j < G; ++j) x[j] = key(G * g + j);
    const int64_t slot0 = group_slot(ar, s, g, G);
    if (c.k4 == nullptr) {
      quantize_group(x, Hkv, D, slot0, c);
      continue;
    }
    quantize_group4(x, Hkv, D, slot0, c);
    for (int64_t j = 0; j < G; ++j)
      for (int64_t h = 0, at = (slot0 + j) * Hkv; h < Hkv; ++h, ++at)
        quant_row4(value(G * g + j) + h * D, c.v4 + at * D / 2, c.vs4 + at * D / V4_BLOCK, D);
  }
  for (int64_t part = 0; part < parts; ++part) {
    auto row = [&](int64_t pos) { return part == 0 ? key(pos) : value(pos); };
    for (int64_t pos = start; pos < std::min(ctx, (g0 + 1) * G); ++pos)
      std::copy(row(pos), row(pos) + width, tail(g0, part) + (pos % G) * width);
    if (gl != g0)
      for (int64_t pos = gl * G; pos < ctx; ++pos) std::copy(row(pos), row(pos) + width, tail(gl, part) + (pos % G) * width);
  }
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
  if (!c.quantized()) {
    parallel_for(rt, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        std::copy(k + t * width, k + (t + 1) * width, c.k + slots[t] * width);
        std::copy(v + t * ldv, v + t * ldv + width, c.v + slots[t] * width);
      }
    });
    return;
  }
  if (c.k4 == nullptr)                 // int8: V per token now (int4: with its key group)
    parallel_for(rt, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < Hkv; ++h) {
          const int64_t at = slots[t] * Hkv + h;
          c.vs[at] = quant_row(v + t * ldv + h * D, c.vq + at * D, D);
        }
    });
  const int64_t G = c.group();
  team_serial(rt, [&] {
    for (int64_t s = 0; s < ar.num_seqs; ++s) {
      const int64_t* q = ar.seqs + 4 * s;
      hold_tail_groups(c.tail_groups + 2 * q[3], q[0] / G, (q[0] + q[1] - 1) / G);
    }
  });
  parallel_for(rt, ar.num_seqs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) write_groups(ar, s, k, v, ldv, Hkv, D, c);
  });
}

}  // namespace pw
