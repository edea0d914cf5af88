// Shared pieces of the attention kernels (paged_attention.cpp, tile_attention.cpp).
#pragma once
#include "kernels.h"
#include "vec/vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace pw {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int64_t KEYS = 16;          // keys scored per pass (one vector of scores)

// The (slot, head) row of context position pos of a sequence with block table `table`.
inline int64_t row_of(const int64_t* table, int64_t block_size, int64_t Hkv, int64_t h, int64_t pos) {
  return (table[pos / block_size] * block_size + pos % block_size) * Hkv + h;
}

// v[0..NV) = the 16 NV values of one int8 row, as floats (its scale is applied by the caller).
template <int NV>
inline void load_int8_row(const int8_t* p, Vf* v) {
  for (int i = 0; i < NV; ++i) v[i] = Vf::from_i8(p + 16 * i);
}

// A query row read against an int8 cache: x = sc q (the scores' scale folded in) as int8 with its
// own scale max |x| / 127, returned; a score is then an exact integer dot product with the key's
// int8 row times the two scales. Every path that reads an int8 cache (tiles, rows, the scalar
// loop, and the PyTorch reference) rounds the query so, and a token scores the same whether it is
// computed in a prompt chunk or decoded.
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

// A tile: R consecutive rows t0.. of one sequence, row t0 + r attending over its first len0 + r tokens.
struct Tile {
  int64_t t0, R, seq, len0;
};

// tile_attention.cpp: every tile x KV head, its R G queries one per lane; writes out rows.
// Returns false (and does nothing) where the head size or group size has no tiled kernel.
bool attend_tiles(const Runtime& rt, const Cache& c, const std::vector<Tile>& tiles, const AttentionRows& rows,
                  const float* q, int64_t Hq, float sc, float* out);

// Rows per tile for G query heads per KV head (0: no tiled kernel).
inline int64_t tile_rows(int64_t G) { return G <= 8 ? 16 / G : 0; }

}  // namespace pw
