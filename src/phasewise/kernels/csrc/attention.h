// Shared pieces of the attention kernels (paged_attention.cpp, tile_attention.cpp).
#pragma once
#include "simd.h"

#include <immintrin.h>

#include <cstdint>
#include <limits>
#include <vector>

namespace pw_attention {

using pw_simd::exp512;

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int64_t KEYS = 16;          // keys scored per pass (one zmm of scores)

struct Cache {                         // one layer's cache, fp32 or int8
  const float* k = nullptr;
  const float* v = nullptr;
  const int8_t* kq = nullptr;
  const int8_t* vq = nullptr;
  const float* ks = nullptr;
  const float* vs = nullptr;
  int64_t Hkv, D;
};

// The (slot, head) row of context position pos of a sequence with block table `table`.
inline int64_t row_of(const int64_t* table, int64_t block_size, int64_t Hkv, int64_t h, int64_t pos) {
  return (table[pos / block_size] * block_size + pos % block_size) * Hkv + h;
}

// v[0..NV) = the 16 NV values of one int8 row, as floats (its scale is applied by the caller).
template <int NV>
inline void load_int8_row(const int8_t* p, __m512* v) {
  for (int i = 0; i < NV; ++i)
    v[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i))));
}

// A tile: R consecutive rows t0.. of one sequence, row t0 + r attending over its first len0 + r tokens.
struct Tile {
  int64_t t0, R, seq, len0;
};

// tile_attention.cpp: every tile × KV head, its R G queries one per zmm lane; writes out rows.
// Returns false (and does nothing) where the head size or group size has no tiled kernel.
bool attend_tiles(const Cache& c, const std::vector<Tile>& tiles, const int64_t* tables, int64_t max_blocks,
                  int64_t block_size, const float* q, int64_t Hq, float sc, float* out);

// Rows per tile for G query heads per KV head (0: no tiled kernel).
inline int64_t tile_rows(int64_t G) { return G <= 8 ? 16 / G : 0; }

}  // namespace pw_attention
