// Shared pieces of the attention kernels (paged_attention.cpp, tile_attention.cpp).
#pragma once
#include "kernels.h"
#include "vec/vec.h"

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
