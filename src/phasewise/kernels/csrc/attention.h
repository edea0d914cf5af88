// Shared pieces of the attention kernels (paged_attention.cpp, tile_attention.cpp).
#pragma once
#include "half.h"
#include "kernels.h"
#include "vec/vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace pw {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int64_t KEYS = 16;          // keys scored per pass (one vector of scores): an int8 cache's key group
static_assert(KEYS == KEY_GROUP, "a pass reads one key group");

// x[0] + ... + x[15] lane by lane as a pairwise tree ((x0 + x1) + (x2 + x3)) + ...: a pass's
// softmax sum for 16 queries (the row kernel takes one query's in the same tree: reduce_add_pairs).
inline Vf sum16(const Vf* x) {
  Vf a[8];
  for (int i = 0; i < 8; ++i) a[i] = x[2 * i] + x[2 * i + 1];
  for (int i = 0; i < 4; ++i) a[i] = a[2 * i] + a[2 * i + 1];
  for (int i = 0; i < 2; ++i) a[i] = a[2 * i] + a[2 * i + 1];
  return a[0] + a[1];
}

// v[0..NV) = the 16 NV values of one int8 row, as floats (its scale is applied by the caller).
template <int NV>
inline void load_int8_row(const int8_t* p, Vf* v) {
  for (int i = 0; i < NV; ++i) v[i] = Vf::from_i8(p + 16 * i);
}

// x = sc q as int8 with its own step max |x| / 127, returned (a query against an int8 key group:
// group_query). Every path that reads an int8 cache (tiles, rows, the scalar loop, and the PyTorch
// reference) rounds a query so, and a token scores the same whether it is computed in a prompt chunk
// or decoded.
inline float quantize_query(const float* q, int64_t D, float sc, int8_t* out) {
  if (D % 16 == 0) {          // the same steps 16 lanes at a time (every reader of a head size takes one path)
    Vf m = Vf::zero();
    for (int64_t d = 0; d < D; d += 16) m = max(m, abs(Vf::load(q + d) * Vf::set1(sc)));
    const float amax = reduce_max(m);
    const Vf id = Vf::set1(amax > 0.f ? 127.f / amax : 0.f);
    for (int64_t d = 0; d < D; d += 16) round_to_i8(Vf::load(q + d) * Vf::set1(sc) * id, out + d);
    return amax / 127.f;
  }
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(q[d] * sc));
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<int8_t>(std::nearbyint(q[d] * sc * id));
  return amax / 127.f;
}

// a · b over D values in one fixed order: 16 lanes of fmas along the rows, then reduce_add_pairs (D % 16
// == 0), else one running sum. A score against an fp32 key of an int8 cache, and a query's midpoint term
// for a key group, in every reader.
inline float float_dot(const float* a, const float* b, int64_t D) {
  if (D % 16 == 0) {
    Vf acc = Vf::zero();
    for (int64_t d = 0; d < D; d += 16) acc = fma(Vf::load(a + d), Vf::load(b + d), acc);
    return reduce_add_pairs(acc);
  }
  float s = 0.f;
  for (int64_t d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

// A scaled query qs [D] (scale q) against an int8 cache's key group (its midpoints and steps, mid [D] and
// step [D] = mid + D): x = qs∘step as int8 (quantize_query), its step returned, and base = qs · mid. A
// key's score is then base + step · (x · code), with x · code an exact integer dot product.
inline float group_query(const float* qs, const float* mid, int64_t D, int8_t* x, float* base) {
  const float* step = mid + D;
  if (D % 16 == 0) {          // quantize_query's steps on qs∘step, and float_dot's sum, in one pass
    Vf m = Vf::zero(), acc = Vf::zero();
    for (int64_t d = 0; d < D; d += 16) {
      const Vf q = Vf::load(qs + d);
      m = max(m, abs(q * Vf::load(step + d)));
      acc = fma(q, Vf::load(mid + d), acc);
    }
    *base = reduce_add_pairs(acc);
    const float amax = reduce_max(m);
    const Vf id = Vf::set1(amax > 0.f ? 127.f / amax : 0.f);
    for (int64_t d = 0; d < D; d += 16) round_to_i8(Vf::load(qs + d) * Vf::load(step + d) * id, x + d);
    return amax / 127.f;
  }
  alignas(64) float y[MAX_HEAD_SIZE];
  for (int64_t d = 0; d < D; ++d) y[d] = qs[d] * step[d];
  *base = float_dot(qs, mid, D);
  return quantize_query(y, D, 1.f, x);
}

// Where a quantized cache keeps the fp32 key of position pos of the rows' sequence s (pos in a row's partial
// group), KV head h: the step's own keys from the sequence's first new position, else its tail slot.
inline const float* float_key(const Cache& c, const AttentionRows& ar, int64_t s, int64_t pos, int64_t h) {
  const int64_t* q = ar.seqs + 4 * s;
  if (pos >= q[0]) return c.fresh + ((q[2] + pos - q[0]) * c.Hkv + h) * c.D;
  const int64_t* held = c.tail_groups + 2 * q[3];
  const int64_t G = c.group();
  return c.tails + c.tail_at(q[3], held[0] == pos / G ? 0 : 1, 0, pos % G, h);
}

// Where an int4 cache keeps the fp32 value of such a position: the step's own values, else the tail slot.
inline const float* float_value(const Cache& c, const AttentionRows& ar, int64_t s, int64_t pos, int64_t h) {
  const int64_t* q = ar.seqs + 4 * s;
  if (pos >= q[0]) return c.fresh_v + (q[2] + pos - q[0]) * c.ldv + h * c.D;
  const int64_t* held = c.tail_groups + 2 * q[3];
  return c.tails + c.tail_at(q[3], held[0] == pos / KEY_GROUP4 ? 0 : 1, 1, pos % KEY_GROUP4, h);
}

// The midpoints (then the steps) of KV head h's key group whose first token is at slot slot0.
inline const float* group_params(const Cache& c, int64_t slot0, int64_t h) {
  return c.kg + ((slot0 / KEY_GROUP) * c.Hkv + h) * 2 * c.D;
}

// An int4 cache's key group whose first token is at slot slot0, KV head h: its minimums, then its steps,
// as fp32 in out [2 D] (D % 16 == 0).
inline void group_params4(const Cache& c, int64_t slot0, int64_t h, float* out) {
  const uint16_t* p = c.kg4 + ((slot0 / KEY_GROUP4) * c.Hkv + h) * 2 * c.D;
  for (int64_t i = 0; i < 2 * c.D; i += 16) Vf::from_f16(p + i).store(out + i);
}

// The int4 codes of the D values (D % 64 == 0) at p, one byte each, into out [D].
inline void unpack_row4(const uint8_t* p, int64_t D, uint8_t* out) {
  for (int64_t i = 0; i < D; i += 64) unpack_nibbles(p + i / 2).store(out + i);
}

// An int4 cache's value row (slot, KV head) `at` as NV vectors of floats: d (code - 8) per block of 32.
template <int NV>
inline void load_int4_values(const Cache& c, int64_t at, Vf* v) {
  constexpr int64_t D = 16 * NV;
  alignas(64) uint8_t codes[D];
  unpack_row4(c.v4 + at * D / 2, D, codes);
  const uint16_t* sc = c.vs4 + at * (D / V4_BLOCK);
  for (int i = 0; i < NV; ++i)
    v[i] = (Vf::from_i8(reinterpret_cast<const int8_t*>(codes) + 16 * i) - Vf::set1(8.f)) * Vf::set1(f16_value(sc[i / 2]));
}

// Lane j: the exact sum of int8 row rows[j] of D values (D a multiple of 64), 0 from lane n on; with
// Q8_BIASED, dot_q8 of a query biased by 128 holds 128 times it too. One transpose-reduction for
// a pass's 16 keys.
inline Vf row_sums_i8(const int8_t* const* rows, int64_t n, int64_t D) {
  static const int8_t ones[4] = {1, 1, 1, 1};
  const Vb one = Vb::bcast4(ones);
  Vf sums[16];
  for (int64_t j = 0; j < 16; ++j) {
    Vi s = Vi::zero();
    for (int64_t i = 0; j < n && i < D; i += 64) s = dot_q8(s, one, Vb::load(reinterpret_cast<const uint8_t*>(rows[j] + i)));
    sums[j] = to_float(s);
  }
  return reduce16(sums);   // exact: integers below 2^24
}

// The order every vectorised read of the cache follows for a query row (tile_attention.cpp), so a
// row's output is the same bits whichever rows share its call (decode rows, a verify's run, a
// prompt chunk, a tail computed again after a prefix-cache hit): its context is cut into parts of
// PART_TOKENS at absolute positions [128 k, 128 k + 128), each part read in passes of KEYS keys at
// absolute positions [16 i, 16 i + 16) with a running max and sum of its own, and the parts are
// folded in order. Keys a row does not see are masked in a pass (weight 0; a pass with no key of
// the row changes nothing).
constexpr int64_t PART_TOKENS = 128;

// A tile: R consecutive rows t0.. of one sequence (row t0 + r attends over its first len0 + r
// tokens) x query heads g0 .. g0 + gn of a KV head; lane r gn + i is row r, head g0 + i (R gn <= 16).
struct Tile {
  int64_t t0, R, seq, len0, g0, gn;
};

// The state of a tile's lanes over some parts: running max m [16], sum l [16], then the
// unnormalised outputs o [lanes][D].
inline int64_t state_floats(int64_t lanes, int64_t D) { return 32 + lanes * D; }

// st (a fold of earlier parts) := st folded with a part's state (m, l [16], o [lanes][D]), lane by
// lane; an empty part changes nothing, and folding into a cleared state copies the part.
void fold_part(float* st, const float* m, const float* l, const float* o, int64_t lanes, int64_t D);

// A kernel for one tile's parts [part0, part1) of KV head h, each part folded into st (ar: the step's
// rows, for the tile's sequence's table, the window and an int8 cache's sequences).
using TileKernel = void (*)(const Cache& c, const AttentionRows& ar, int64_t h, const Tile& tile, const float* q,
                            int64_t Hq, float sc, int64_t part0, int64_t part1, float* st);

// paged_attention.cpp: the kernel for a one-row tile of `lanes` heads over a quantized cache that reads
// keys row by row (the same bits as the tiled kernel, fewer steps for few lanes), or nullptr where the
// tiled kernel is faster.
TileKernel row_kernel(const Cache& c, int64_t lanes);

// tile_attention.cpp: every row of a step (q [T, Hq, D]) into out [T, Hq, D]. Returns false (and
// does nothing) where the head size has no vector kernel.
bool attend_tiled(const Runtime& rt, const Cache& c, int64_t T, int64_t Hq, const AttentionRows& rows,
                  const float* q, float sc, float* out);

}  // namespace pw
