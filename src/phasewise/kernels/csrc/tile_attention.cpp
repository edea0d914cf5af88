// Attention of prompt chunks over the paged KV cache: R consecutive query positions of one
// sequence × the G query heads of one KV head, R G <= 16 queries, one per zmm lane.
//
// Queries are transposed once per task (qt [D][16]), so a key's 16 scores are D FMAs of the
// broadcast key element with qt[d]: no horizontal sums. The softmax then runs lane-wise
// (per query) over keys, and the causal mask is one compare of the lanes' context lengths
// with the key's position. Values: each lane's output row += its weight × the value row.
// Used for chunks of two or more tokens (prefill, draft verification); single decode rows
// take the kernel in paged_attention.cpp.
#include "attention.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace pw_attention {
namespace {

template <int NV, bool INT8>
void attend_tile(const Cache& c, const int64_t* table, int64_t block_size, int64_t h, const Tile& tile,
                 const float* q, int64_t Hq, int64_t G, float sc, float* out) {
  constexpr int64_t D = 16 * NV;
  const int64_t lanes = tile.R * G;
  alignas(64) float qt[D * 16];               // [D][lane] queries, scaled
  alignas(64) float o[16 * D];                // [lane][D] unnormalised outputs
  alignas(64) float kt[KEYS * D];             // [key][D] the pass's keys (as floats)
  alignas(64) float vt[INT8 ? KEYS * D : 1];  // [key][D] its values (int8 cache)
  alignas(64) float pt[KEYS * 16];            // [key][lane] value weights
  alignas(64) float corr[16];
  alignas(64) int32_t lenv[16];
  std::memset(qt, 0, sizeof(qt));
  std::memset(o, 0, sizeof(o));
  for (int64_t lane = 0; lane < 16; ++lane) {   // spare lanes copy lane 0 (computed, never written)
    const int64_t r = lane < lanes ? lane / G : 0, g = lane < lanes ? lane % G : 0;
    lenv[lane] = static_cast<int32_t>(tile.len0 + r);
    if (lane < lanes) {
      const float* qr = q + ((tile.t0 + r) * Hq + h * G + g) * D;
      for (int64_t d = 0; d < D; ++d) qt[d * 16 + lane] = qr[d] * sc;
    }
  }
  const __m512i len = _mm512_load_si512(lenv);
  __m512 m = _mm512_set1_ps(NEG_INF), l = _mm512_setzero_ps();
  const int64_t kmax = tile.len0 + tile.R - 1;   // the last row's context
  const float* vrow[KEYS];
  float kscale[KEYS], vscale[KEYS];
  for (int64_t start = 0; start < kmax; start += KEYS) {
    const int64_t n = std::min<int64_t>(KEYS, kmax - start);
    for (int64_t j = 0; j < KEYS; ++j) {
      if (j >= n) {                                // past every lane's context: masked below
        std::memset(kt + j * D, 0, sizeof(float) * D);
        continue;
      }
      const int64_t at = row_of(table, block_size, c.Hkv, h, start + j);
      if (INT8) {
        __m512 x[NV];
        load_int8_row<NV>(c.kq + at * D, x);
        for (int i = 0; i < NV; ++i) _mm512_store_ps(kt + j * D + 16 * i, x[i]);
        load_int8_row<NV>(c.vq + at * D, x);
        for (int i = 0; i < NV; ++i) _mm512_store_ps(vt + j * D + 16 * i, x[i]);
        kscale[j] = c.ks[at];
        vscale[j] = c.vs[at];
        vrow[j] = vt + j * D;
      } else {
        std::memcpy(kt + j * D, c.k + at * D, sizeof(float) * D);
        vrow[j] = c.v + at * D;
      }
    }
    __m512 s[KEYS];
    for (int j = 0; j < KEYS; ++j) s[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m512 qd = _mm512_load_ps(qt + d * 16);
      for (int j = 0; j < KEYS; ++j) s[j] = _mm512_fmadd_ps(_mm512_set1_ps(kt[j * D + d]), qd, s[j]);
    }
    __m512 mx = m;
    for (int j = 0; j < KEYS; ++j) {
      if (INT8 && j < n) s[j] = _mm512_mul_ps(s[j], _mm512_set1_ps(kscale[j]));
      const __mmask16 ok = _mm512_cmpgt_epi32_mask(len, _mm512_set1_epi32(static_cast<int32_t>(start + j)));
      s[j] = _mm512_mask_blend_ps(ok, _mm512_set1_ps(NEG_INF), s[j]);
      mx = _mm512_max_ps(mx, s[j]);
    }
    const __m512 cr = exp512(_mm512_sub_ps(m, mx));   // 0 on the first pass (m = -inf)
    l = _mm512_mul_ps(l, cr);
    for (int j = 0; j < KEYS; ++j) {
      const __m512 p = exp512(_mm512_sub_ps(s[j], mx));  // masked keys: 0
      l = _mm512_add_ps(l, p);
      _mm512_store_ps(pt + j * 16, INT8 && j < n ? _mm512_mul_ps(p, _mm512_set1_ps(vscale[j])) : p);
    }
    m = mx;
    _mm512_store_ps(corr, cr);
    for (int64_t lane0 = 0; lane0 < lanes; lane0 += 4) {   // four lanes' output rows in registers
      constexpr int64_t nl = 4;                            // (spare lanes are computed, never written)
      __m512 acc[4][NV];
      for (int64_t a = 0; a < nl; ++a)
        for (int i = 0; i < NV; ++i)
          acc[a][i] = _mm512_mul_ps(_mm512_load_ps(o + (lane0 + a) * D + 16 * i), _mm512_set1_ps(corr[lane0 + a]));
      for (int64_t j = 0; j < n; ++j) {
        __m512 vr[NV];
        for (int i = 0; i < NV; ++i) vr[i] = _mm512_loadu_ps(vrow[j] + 16 * i);
        for (int64_t a = 0; a < nl; ++a) {
          const __m512 w = _mm512_set1_ps(pt[j * 16 + lane0 + a]);
          for (int i = 0; i < NV; ++i) acc[a][i] = _mm512_fmadd_ps(w, vr[i], acc[a][i]);
        }
      }
      for (int64_t a = 0; a < nl; ++a)
        for (int i = 0; i < NV; ++i) _mm512_store_ps(o + (lane0 + a) * D + 16 * i, acc[a][i]);
    }
  }
  alignas(64) float lsum[16];
  _mm512_store_ps(lsum, l);
  for (int64_t lane = 0; lane < lanes; ++lane) {
    const int64_t r = lane / G, g = lane % G;
    float* dst = out + ((tile.t0 + r) * Hq + h * G + g) * D;
    const float inv = lsum[lane] > 0.f ? 1.f / lsum[lane] : 0.f;
    for (int64_t d = 0; d < D; ++d) dst[d] = o[lane * D + d] * inv;
  }
}

}  // namespace

bool attend_tiles(const Cache& c, const std::vector<Tile>& tiles, const int64_t* tables, int64_t max_blocks,
                  int64_t block_size, const float* q, int64_t Hq, float sc, float* out) {
  const int64_t G = Hq / c.Hkv, n = static_cast<int64_t>(tiles.size()) * c.Hkv;
  auto run = [&](auto fn) {
    // Later tiles of a chunk see more context: pair task i with task n - 1 - i so each thread's
    // contiguous share of the range has about the same work.
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t task = i % 2 ? n - 1 - i / 2 : i / 2;
        const Tile& tile = tiles[task / c.Hkv];
        fn(c, tables + tile.seq * max_blocks, block_size, task % c.Hkv, tile, q, Hq, G, sc, out);
      }
    });
  };
  if (tile_rows(G) < 2) return false;
  const bool int8 = c.kq != nullptr;
  switch (c.D * 2 + int8) {
    case 128: run(attend_tile<4, false>); return true;
    case 129: run(attend_tile<4, true>); return true;
    case 256: run(attend_tile<8, false>); return true;
    case 257: run(attend_tile<8, true>); return true;
    case 512: run(attend_tile<16, false>); return true;
    case 513: run(attend_tile<16, true>); return true;
    default: return false;
  }
}

}  // namespace pw_attention
