// Attention of prompt chunks over the paged KV cache: R consecutive query positions of one
// sequence × the G query heads of one KV head, R G <= 16 queries, one per vector lane.
//
// Queries are transposed once per task (qt [D][16]), so a key's 16 scores are D FMAs of the
// broadcast key element with qt[d]: no horizontal sums. Over an int8 cache the queries are int8
// too (quantize_query), in groups of 4 per lane (qb [D/4][16][4]), and a key's 16 scores are D/4
// int8 dot products of the broadcast 4 key bytes (VNNI: 64 instructions at D = 256, not 256
// FMAs). The softmax then runs lane-wise (per query) over keys, and the causal mask is one
// compare of the lanes' context lengths with the key's position (a sliding window adds one
// compare of its lower edge, and keys start at the first row's window). Values: each lane's
// output row += its weight × the value row.
// Used for chunks of two or more tokens (prefill, draft verification); single decode rows
// take the kernel in paged_attention.cpp.
#include "attention.h"
#include "parallel.h"

#include <algorithm>
#include <cstring>

namespace pw {
namespace {

// What stays in registers: AVX-512 (32 registers of 16 lanes) holds a pass's 16 scores, and
// four lanes' output rows in slices of up to 64 values (4 x 4 accumulators and 4 value vectors:
// a head of 128 or 256 in whole would spill on every FMA); with vectors of 8 or 4 lanes (AVX2 and
// SSE: 16 registers, a Vf is 2 or 4 of them) that would spill too, so there 4 scores and one
// 16-wide slice at a time (prefill attention on AVX2: see docs/benchmarks.md).
constexpr int KG = W >= 16 ? KEYS : 4;

template <int NV, bool INT8>
void attend_tile(const Cache& c, const int64_t* table, int64_t block_size, int64_t window, int64_t h,
                 const Tile& tile, const float* q, int64_t Hq, int64_t G, float sc, float* out) {
  constexpr int64_t D = 16 * NV;
  constexpr int SL = W >= 16 ? (NV < 4 ? NV : 4) : 1;
  const int64_t lanes = tile.R * G;
  alignas(64) float qt[INT8 ? 1 : D * 16];    // [D][lane] queries, scaled (fp32 cache)
  alignas(64) uint8_t qb[INT8 ? D * 16 : 1];  // [D/4][lane][4] queries as int8 + 128 (int8 cache)
  alignas(64) float o[16 * D];                // [lane][D] unnormalised outputs
  alignas(64) float kt[INT8 ? 1 : KEYS * D];  // [key][D] the pass's keys (fp32 cache)
  alignas(64) float vt[INT8 ? KEYS * D : 1];  // [key][D] its values (int8 cache)
  alignas(64) float pt[KEYS * 16];            // [key][lane] value weights
  alignas(64) float corr[16];
  alignas(64) int32_t lenv[16];
  alignas(64) float qsv[16] = {};             // the int8 queries' scales (spare lanes: 0)
  if constexpr (INT8) std::memset(qb, 128, sizeof(qb));   // spare lanes: queries of 0
  else std::memset(qt, 0, sizeof(qt));
  std::memset(o, 0, sizeof(o));
  for (int64_t lane = 0; lane < 16; ++lane) {   // spare lanes copy lane 0 (computed, never written)
    const int64_t r = lane < lanes ? lane / G : 0, g = lane < lanes ? lane % G : 0;
    lenv[lane] = static_cast<int32_t>(tile.len0 + r);
    if (lane >= lanes) continue;
    const float* qr = q + ((tile.t0 + r) * Hq + h * G + g) * D;
    if constexpr (INT8) {
      int8_t qi[D];
      qsv[lane] = quantize_query(qr, D, sc, qi);
      for (int64_t d4 = 0; d4 < D / 4; ++d4) {   // 4 values a store, each + 128 (the sign bit flipped)
        uint32_t four;
        std::memcpy(&four, qi + 4 * d4, 4);
        four ^= 0x80808080u;
        std::memcpy(qb + 64 * d4 + 4 * lane, &four, 4);
      }
    } else {
      for (int64_t d = 0; d < D; ++d) qt[d * 16 + lane] = qr[d] * sc;
    }
  }
  const Vf qscale = Vf::load(qsv);
  Vi len;
  std::memcpy(&len, lenv, sizeof len);
  // With a window W, lane r sees keys len - W .. len - 1: the pass's keys below that are masked. The
  // first pass starts at the first row's lower edge, so every lane has a key in it (R <= 16) and
  // no lane's running max stays -inf (exp(-inf + inf) would be NaN).
  alignas(64) int32_t lov[16];
  for (int64_t lane = 0; lane < 16; ++lane) lov[lane] = window > 0 ? lenv[lane] - static_cast<int32_t>(window) : -1;
  Vi lo;
  std::memcpy(&lo, lov, sizeof lo);
  const int64_t kmin = window > 0 ? std::max<int64_t>(0, tile.len0 - window) : 0;
  Vf m = Vf::set1(NEG_INF), l = Vf::zero();
  const int64_t kmax = tile.len0 + tile.R - 1;   // the last row's context
  const float* vrow[KEYS];
  const int8_t* krow[KEYS];                    // int8 cache: the pass's key rows (absent keys: zeros)
  alignas(64) const int8_t kzero[INT8 ? D : 1] = {};
  float kscale[KEYS], vscale[KEYS];
  alignas(64) float ksum[KEYS];                // int8 cache with Q8_BIASED: each key's sum of bytes
  for (int64_t start = kmin; start < kmax; start += KEYS) {
    const int64_t n = std::min<int64_t>(KEYS, kmax - start);
    for (int64_t j = 0; j < KEYS; ++j) {
      if (j >= n) {                                // past every lane's context: masked below
        if constexpr (INT8) krow[j] = kzero;
        else std::memset(kt + j * D, 0, sizeof(float) * D);
        continue;
      }
      const int64_t at = row_of(table, block_size, c.Hkv, h, start + j);
      if constexpr (INT8) {
        krow[j] = c.kq + at * D;
        Vf x[NV];
        load_int8_row<NV>(c.vq + at * D, x);
        for (int i = 0; i < NV; ++i) x[i].store(vt + j * D + 16 * i);
        kscale[j] = c.ks[at];
        vscale[j] = c.vs[at];
        vrow[j] = vt + j * D;
      } else {
        std::memcpy(kt + j * D, c.k + at * D, sizeof(float) * D);
        vrow[j] = c.v + at * D;
      }
    }
    if constexpr (INT8 && Q8_BIASED) row_sums_i8(krow, n, D).store(ksum);
    Vf s[KEYS];
    for (int j0 = 0; j0 < KEYS; j0 += KG) {           // KG keys' scores in registers at a time
      if constexpr (INT8) {                           // 4 of each query's int8 values per lane and step
        Vi acc[KG];
        for (int j = 0; j < KG; ++j) acc[j] = Vi::zero();
        for (int64_t d4 = 0; d4 < D / 4; ++d4) {
          const Vb qd = Vb::load(qb + 64 * d4);
          for (int j = 0; j < KG; ++j) acc[j] = dot_q8(acc[j], qd, Vb::bcast4(krow[j0 + j] + 4 * d4));
        }
        for (int j = 0; j < KG; ++j) {
          Vf dot = to_float(acc[j]);                  // exact: |sum| < 2^24
          if (Q8_BIASED) dot = dot - Vf::set1(128.f * ksum[j0 + j]);
          s[j0 + j] = dot * qscale;
        }
      } else {
        Vf acc[KG];
        for (int j = 0; j < KG; ++j) acc[j] = Vf::zero();
        for (int64_t d = 0; d < D; ++d) {
          const Vf qd = Vf::load(qt + d * 16);
          for (int j = 0; j < KG; ++j) acc[j] = fma(Vf::set1(kt[(j0 + j) * D + d]), qd, acc[j]);
        }
        for (int j = 0; j < KG; ++j) s[j0 + j] = acc[j];
      }
    }
    Vf mx = m;
    for (int j = 0; j < KEYS; ++j) {
      if (INT8 && j < n) s[j] = s[j] * Vf::set1(kscale[j]);
      const Mask ok = len > Vi::set1(static_cast<int32_t>(start + j));
      s[j] = select(ok, s[j], Vf::set1(NEG_INF));
      if (window > 0) s[j] = select(Vi::set1(static_cast<int32_t>(start + j + 1)) > lo, s[j], Vf::set1(NEG_INF));
      mx = max(mx, s[j]);
    }
    const Vf cr = exp(m - mx);                        // 0 on the first pass (m = -inf)
    l = l * cr;
    for (int j = 0; j < KEYS; ++j) {
      const Vf p = exp(s[j] - mx);                    // masked keys: 0
      l = l + p;
      (INT8 && j < n ? p * Vf::set1(vscale[j]) : p).store(pt + j * 16);
    }
    m = mx;
    cr.store(corr);
    // Four lanes' output rows, SL 16-wide slices of each, in registers at a time (spare lanes are
    // computed, never written).
    for (int64_t lane0 = 0; lane0 < lanes; lane0 += 4) {
      constexpr int64_t nl = 4;
      for (int i0 = 0; i0 < NV; i0 += SL) {
        // every loop over acc unrolled: one left rolled keeps acc in memory, stored on every key
        Vf acc[4][SL];
        #pragma GCC unroll 4
        for (int64_t a = 0; a < nl; ++a)
          #pragma GCC unroll 4
          for (int i = 0; i < SL; ++i)
            acc[a][i] = Vf::load(o + (lane0 + a) * D + 16 * (i0 + i)) * Vf::set1(corr[lane0 + a]);
        for (int64_t j = 0; j < n; ++j) {
          Vf vr[SL];
          #pragma GCC unroll 4
          for (int i = 0; i < SL; ++i) vr[i] = Vf::load(vrow[j] + 16 * (i0 + i));
          #pragma GCC unroll 4
          for (int64_t a = 0; a < nl; ++a) {
            const Vf w = Vf::set1(pt[j * 16 + lane0 + a]);
            #pragma GCC unroll 4
            for (int i = 0; i < SL; ++i) acc[a][i] = fma(w, vr[i], acc[a][i]);
          }
        }
        #pragma GCC unroll 4
        for (int64_t a = 0; a < nl; ++a)
          #pragma GCC unroll 4
          for (int i = 0; i < SL; ++i) acc[a][i].store(o + (lane0 + a) * D + 16 * (i0 + i));
      }
    }
  }
  alignas(64) float lsum[16];
  l.store(lsum);
  for (int64_t lane = 0; lane < lanes; ++lane) {
    const int64_t r = lane / G, g = lane % G;
    float* dst = out + ((tile.t0 + r) * Hq + h * G + g) * D;
    const float inv = lsum[lane] > 0.f ? 1.f / lsum[lane] : 0.f;
    for (int64_t d = 0; d < D; ++d) dst[d] = o[lane * D + d] * inv;
  }
}

}  // namespace

bool attend_tiles(const Runtime& rt, const Cache& c, const std::vector<Tile>& tiles, const AttentionRows& rows,
                  const float* q, int64_t Hq, float sc, float* out) {
  const int64_t G = Hq / c.Hkv, n = static_cast<int64_t>(tiles.size()) * c.Hkv;
  auto run = [&](auto fn) {
    // Later tiles of a chunk see more context: pair task i with task n - 1 - i so each thread's
    // contiguous share of the range has about the same work.
    parallel_for(rt, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t task = i % 2 ? n - 1 - i / 2 : i / 2;
        const Tile& tile = tiles[task / c.Hkv];
        fn(c, rows.tables + tile.seq * rows.max_blocks, rows.block_size, rows.window, task % c.Hkv, tile, q, Hq, G,
           sc, out);
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

}  // namespace pw
