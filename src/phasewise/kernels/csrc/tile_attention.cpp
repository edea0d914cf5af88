// Attention of query rows over the paged KV cache, in tiles: R consecutive query positions of one
// sequence x up to 16 of the query heads of one KV head, one query per vector lane. Every row of a
// step goes through here (decode rows as one-row tiles), so a row's output does not depend on the
// rows beside it (the order all readers share: attention.h).
//
// Queries are transposed once per task (qt [D][16]), so a key's 16 scores are D FMAs of the
// broadcast key element with qt[d]: no horizontal sums. Over an int8 or int4 cache the queries are
// int8 too (quantize_query), in groups of 4 per lane (qb [D/4][16][4]), and a key's 16 scores are D/4
// integer dot products of the broadcast 4 key bytes (int4: its codes unpacked a byte each) (VNNI: 64
// instructions at D = 256, not 256 FMAs). The softmax then runs lane-wise (per query) over keys, and the causal mask is one
// compare of the lanes' context lengths with the key's position (a sliding window adds one
// compare of its lower edge; no key below the first row's window is read: its block may be
// freed). Values: each lane's output row += its weight x the value row.
#include "attention.h"
#include "parallel.h"

#include <algorithm>
#include <cstring>

namespace pw {
namespace {

void clear_state(float* st, int64_t lanes, int64_t D) {
  std::fill(st, st + 16, NEG_INF);
  std::fill(st + 16, st + state_floats(lanes, D), 0.f);
}

// The tile's rows of out [T, Hq, D] (G query heads per KV head, this one h): o / l of each lane.
void write_rows(const float* st, const Tile& tile, int64_t Hq, int64_t G, int64_t h, int64_t D, float* out) {
  for (int64_t lane = 0; lane < tile.R * tile.gn; ++lane) {
    const int64_t r = lane / tile.gn, g = tile.g0 + lane % tile.gn;
    float* dst = out + ((tile.t0 + r) * Hq + h * G + g) * D;
    const float* src = st + 32 + lane * D;
    const float inv = st[16 + lane] > 0.f ? 1.f / st[16 + lane] : 0.f;
    for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * inv;
  }
}

// What stays in registers: AVX-512 (32 registers of 16 lanes) holds a pass's 16 scores, and
// four lanes' output rows in slices of up to 64 values (4 x 4 accumulators and 4 value vectors:
// a head of 128 or 256 in whole would spill on every FMA); with vectors of 8 or 4 lanes (AVX2 and
// SSE: 16 registers, a Vf is 2 or 4 of them) that would spill too, so there 4 scores and one
// 16-wide slice at a time (prefill attention on AVX2: see docs/benchmarks.md).
constexpr int KR = W >= 16 ? KEYS : 4;

// A quantized cache's queries for one pass (positions start..) of a tile: a lane whose row holds the pass's
// whole key group (of KG tokens, its first token at slot0) reads it quantized, its query against the group's
// steps in qb ([D/4][lane][4]; int8 cache: + 128) with its step sy and midpoint term base, set when the tile
// enters the group (`requery`); any other lane a query of 0 there and, for keys below its length, its
// scores against their fp32 keys in sf [key][lane].
template <int NV, bool I4>
void group_queries(const Cache& c, const AttentionRows& ar, int64_t h, const Tile& tile, const float* qs,
                   int64_t lanes, int64_t start, int64_t slot0, bool requery, uint8_t* qb, float* sy, float* base,
                   float* sf) {
  constexpr int64_t D = 16 * NV, KG = I4 ? KEY_GROUP4 : KEY_GROUP;
  const int64_t gstart = start / KG * KG;
  alignas(64) float p4[I4 ? 2 * D : 1];
  if constexpr (I4) if (requery) group_params4(c, slot0, h, p4);
  for (int64_t lane = 0; lane < lanes; ++lane) {
    const int64_t len = tile.len0 + lane / tile.gn;
    if (len >= gstart + KG) {
      if (!requery) continue;
      int8_t x[D];
      sy[lane] = group_query(qs + lane * D, I4 ? p4 : group_params(c, slot0, h), D, x, base + lane);
      for (int64_t d4 = 0; d4 < D / 4; ++d4) {   // 4 values a store (int8 cache: each + 128, the sign bit flipped)
        uint32_t four;
        std::memcpy(&four, x + 4 * d4, 4);
        if (!I4) four ^= 0x80808080u;
        std::memcpy(qb + 64 * d4 + 4 * lane, &four, 4);
      }
      continue;
    }
    if (requery) {
      sy[lane] = base[lane] = 0.f;
      for (int64_t d4 = 0; d4 < D / 4; ++d4) std::memset(qb + 64 * d4 + 4 * lane, I4 ? 0 : 128, 4);
    }
    for (int64_t j = 0; j < KEYS && start + j < len; ++j)
      sf[j * 16 + lane] = float_dot(qs + lane * D, float_key(c, ar, tile.seq, start + j, h), D);
  }
}

// The tile's parts [part0, part1) of KV head h, each folded into st (state_floats(R gn, D) floats). MODE:
// FP32, INT8 or INT4, the cache's.
enum Mode { FP32, INT8, INT4 };
template <int NV, int MODE>
void attend_tile(const Cache& c, const AttentionRows& ar, int64_t h, const Tile& tile, const float* q, int64_t Hq,
                 float sc, int64_t part0, int64_t part1, float* st) {
  constexpr bool QUANT = MODE != FP32, I4 = MODE == INT4;   // QUANT: int8 or int4
  constexpr int64_t D = 16 * NV, KG = I4 ? KEY_GROUP4 : KEY_GROUP;
  constexpr int SL = W >= 16 ? (NV < 4 ? NV : 4) : 1;
  const int64_t* table = ar.tables + tile.seq * ar.max_blocks;
  const int64_t block_size = ar.block_size, window = ar.window;
  const int64_t gn = tile.gn, lanes = tile.R * gn;
  alignas(64) float qt[QUANT ? 1 : D * 16];    // [D][lane] queries, scaled (fp32 cache)
  alignas(64) float qs[QUANT ? 16 * D : 1];    // [lane][D] queries, scaled (quantized cache)
  alignas(64) uint8_t qb[QUANT ? D * 16 : 1];  // [D/4][lane][4] a group's int8 queries (int8 cache: + 128)
  alignas(64) uint8_t kc[I4 ? KEYS * D : 1];  // [key][D] a pass's int4 key codes, a byte each
  alignas(64) float o[16 * D];                // [lane][D] the part's unnormalised outputs
  alignas(64) float kt[QUANT ? 1 : KEYS * D];  // [key][D] the pass's keys (fp32 cache)
  alignas(64) float vt[QUANT ? KEYS * D : 1];  // [key][D] its values (quantized cache)
  alignas(64) float pt[KEYS * 16];            // [key][lane] value weights
  alignas(64) float sf[QUANT ? KEYS * 16 : 1]; // [key][lane] scores against fp32 keys (quantized cache)
  alignas(64) float corr[16], mpart[16], lpart[16];
  alignas(64) int32_t lenv[16];
  alignas(64) float syv[16] = {}, basev[16] = {};   // a group's int8 query steps and midpoint terms
  if constexpr (!QUANT) std::memset(qt, 0, sizeof(qt));
  for (int64_t lane = 0; lane < 16; ++lane) {   // spare lanes copy lane 0 (computed, never written)
    const int64_t r = lane < lanes ? lane / gn : 0, g = tile.g0 + (lane < lanes ? lane % gn : 0);
    lenv[lane] = static_cast<int32_t>(tile.len0 + r);
    if (lane >= lanes) continue;
    const float* qr = q + ((tile.t0 + r) * Hq + h * (Hq / c.Hkv) + g) * D;
    if constexpr (QUANT) for (int64_t d = 0; d < D; ++d) qs[lane * D + d] = qr[d] * sc;
    else for (int64_t d = 0; d < D; ++d) qt[d * 16 + lane] = qr[d] * sc;
  }
  if constexpr (QUANT) {
    std::memset(qb, I4 ? 0 : 128, sizeof(qb));  // spare lanes: queries of 0
    std::memset(sf, 0, sizeof(sf));
  }
  int64_t queried = -1;                        // the key group qb holds queries for
  Vi len;
  std::memcpy(&len, lenv, sizeof len);
  // With a window W, lane r sees keys len - W .. len - 1: the pass's keys below that are masked.
  alignas(64) int32_t lov[16];
  for (int64_t lane = 0; lane < 16; ++lane) lov[lane] = window > 0 ? lenv[lane] - static_cast<int32_t>(window) : -1;
  Vi lo;
  std::memcpy(&lo, lov, sizeof lo);
  const int64_t kmin = window > 0 ? std::max<int64_t>(0, tile.len0 - window) : 0;   // no key below is read
  const int64_t kmax = tile.len0 + tile.R - 1;   // the last row's context
  const float* vrow[KEYS];
  const int8_t* krow[KEYS];                    // quantized cache: the pass's key rows (absent keys: zeros)
  alignas(64) const int8_t kzero[QUANT ? D : 1] = {};
  alignas(64) static const float vzero[D] = {};
  float vscale[KEYS];
  alignas(64) float ksum[KEYS];                // int8 cache with Q8_BIASED: each key's sum of bytes
  const Vf neg_inf = Vf::set1(NEG_INF), one = Vf::set1(1.f);
  const float* vflt[KEYS];                     // int4: the pass's fp32 values (absent: zeros)
  alignas(64) float pf[I4 ? KEYS * 16 : 1];   // int4: the fp32 values' weights where lanes differ
  alignas(64) static const float ones[16] = {1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f,
                                             1.f, 1.f};
  int64_t n = 0;                               // the pass's keys that may be read
  // o = o corr + the weights w [key][lane] times the value rows, the pass's n keys: four lanes' output rows,
  // SL 16-wide slices of each, in registers at a time (spare lanes are computed, never written).
  auto weigh_values = [&](const float* const* rows, const float* w, const float* cf) {
    for (int64_t lane0 = 0; lane0 < lanes; lane0 += 4) {
      constexpr int64_t nl = 4;
      for (int i0 = 0; i0 < NV; i0 += SL) {
        // every loop over acc unrolled: one left rolled keeps acc in memory, stored on every key
        Vf acc[4][SL];
        #pragma GCC unroll 4
        for (int64_t a = 0; a < nl; ++a)
          #pragma GCC unroll 4
          for (int i = 0; i < SL; ++i)
            acc[a][i] = Vf::load(o + (lane0 + a) * D + 16 * (i0 + i)) * Vf::set1(cf[lane0 + a]);
        for (int64_t j = 0; j < n; ++j) {
          Vf vr[SL];
          #pragma GCC unroll 4
          for (int i = 0; i < SL; ++i) vr[i] = Vf::load(rows[j] + 16 * (i0 + i));
          #pragma GCC unroll 4
          for (int64_t a = 0; a < nl; ++a) {
            const Vf wa = Vf::set1(w[j * 16 + lane0 + a]);
            #pragma GCC unroll 4
            for (int i = 0; i < SL; ++i) acc[a][i] = fma(wa, vr[i], acc[a][i]);
          }
        }
        #pragma GCC unroll 4
        for (int64_t a = 0; a < nl; ++a)
          #pragma GCC unroll 4
          for (int i = 0; i < SL; ++i) acc[a][i].store(o + (lane0 + a) * D + 16 * (i0 + i));
      }
    }
  };
  for (int64_t part = part0; part < part1; ++part) {
    Vf m = neg_inf, l = Vf::zero();
    std::memset(o, 0, sizeof(float) * D * ((lanes + 3) / 4 * 4));   // P.V runs four lanes at a time
    const int64_t pend = std::min(kmax, (part + 1) * PART_TOKENS);
    for (int64_t start = std::max(part * PART_TOKENS, kmin / KEYS * KEYS); start < pend; start += KEYS) {
      // quantized keys only where some row holds the whole group (the writer quantized it)
      const int64_t gstart = start / KG * KG;
      const bool whole = QUANT && kmax >= gstart + KG, every = tile.len0 >= gstart + KG;   // some lane, every lane
      for (int64_t j = 0, blk = start / block_size, off = start % block_size; j < KEYS; ++j) {
        const int64_t pos = start + j;             // its (slot, head) row: one division a pass, not two a key
        const int64_t at = pos < kmin || pos >= pend ? -1 : (table[blk] * block_size + off) * c.Hkv + h;
        if (++off == block_size) ++blk, off = 0;
        if (at < 0) {                              // outside every lane's context: masked below
          if constexpr (QUANT) krow[j] = kzero, vscale[j] = 0.f;
          else std::memset(kt + j * D, 0, sizeof(float) * D);
          vrow[j] = vflt[j] = vzero;
          continue;
        }
        if constexpr (I4) {                        // int4: values dequantized where a lane holds the group,
          krow[j] = kzero, vrow[j] = vzero;        // fp32 (vflt) where a lane reads its own group
          if (whole) {
            unpack_row4(c.k4 + at * D / 2, D, kc + j * D), krow[j] = reinterpret_cast<const int8_t*>(kc + j * D);
            Vf x[NV];
            load_int4_values<NV>(c, at, x);
            for (int i = 0; i < NV; ++i) x[i].store(vt + j * D + 16 * i);
            vrow[j] = vt + j * D;
          }
          vflt[j] = every ? vzero : float_value(c, ar, tile.seq, pos, h);
          vscale[j] = 1.f;
        } else if constexpr (QUANT) {
          krow[j] = whole ? c.kq + at * D : kzero;
          Vf x[NV];
          load_int8_row<NV>(c.vq + at * D, x);
          for (int i = 0; i < NV; ++i) x[i].store(vt + j * D + 16 * i);
          vscale[j] = c.vs[at];
          vrow[j] = vt + j * D;
        } else {
          std::memcpy(kt + j * D, c.k + at * D, sizeof(float) * D);
          vrow[j] = c.v + at * D;
        }
      }
      n = std::min<int64_t>(KEYS, pend - start);
      if constexpr (QUANT) {
        const int64_t slot0 = table[gstart / block_size] * block_size + gstart % block_size;
        const bool requery = whole && gstart != queried;
        group_queries<NV, I4>(c, ar, h, tile, qs, lanes, start, slot0, requery, qb, syv, basev, sf);
        if (requery) queried = gstart;
        if (!I4 && Q8_BIASED) row_sums_i8(krow, KEYS, D).store(ksum);
      }
      Vf s[KEYS];
      for (int j0 = 0; j0 < KEYS; j0 += KR) {           // KR keys' scores in registers at a time
        if constexpr (QUANT) {                          // 4 of each query's int8 values per lane and step
          Vi acc[KR];
          for (int j = 0; j < KR; ++j) acc[j] = Vi::zero();
          for (int64_t d4 = 0; whole && d4 < D / 4; ++d4) {
            const Vb qd = Vb::load(qb + 64 * d4);
            for (int j = 0; j < KR; ++j)
              acc[j] = I4 ? dot_u4(acc[j], Vb::bcast4(krow[j0 + j] + 4 * d4), qd)
                          : dot_q8(acc[j], qd, Vb::bcast4(krow[j0 + j] + 4 * d4));
          }
          const Mask as_int = len > Vi::set1(static_cast<int32_t>(gstart + KG - 1));
          for (int j = 0; j < KR; ++j) {
            Vf dot = to_float(acc[j]);                  // exact: |sum| < 2^24
            if (!I4 && Q8_BIASED) dot = dot - Vf::set1(128.f * ksum[j0 + j]);
            s[j0 + j] = select(as_int, dot * Vf::load(syv) + Vf::load(basev), Vf::load(sf + (j0 + j) * 16));
          }
        } else {
          Vf acc[KR];
          for (int j = 0; j < KR; ++j) acc[j] = Vf::zero();
          for (int64_t d = 0; d < D; ++d) {
            const Vf qd = Vf::load(qt + d * 16);
            for (int j = 0; j < KR; ++j) acc[j] = fma(Vf::set1(kt[(j0 + j) * D + d]), qd, acc[j]);
          }
          for (int j = 0; j < KR; ++j) s[j0 + j] = acc[j];
        }
      }
      Vf mx = m;
      for (int j = 0; j < KEYS; ++j) {
        const int32_t pos = static_cast<int32_t>(start + j);
        Mask ok = len > Vi::set1(pos);
        s[j] = select(ok, s[j], neg_inf);
        if (window > 0) s[j] = select(Vi::set1(pos + 1) > lo, s[j], neg_inf);
        mx = max(mx, s[j]);
      }
      // A lane whose max did not grow keeps l and o as they are (factor 1); one with no key yet
      // (max -inf) gets weights exp(-inf) = 0 against a base of 0, never exp(-inf + inf).
      const Vf base = select(mx > neg_inf, mx, Vf::zero());
      const Vf cr = select(mx > m, exp(m - base), one);
      Vf p[KEYS];
      for (int j = 0; j < KEYS; ++j) {
        p[j] = exp(s[j] - base);                        // masked keys: 0
        (QUANT ? p[j] * Vf::set1(vscale[j]) : p[j]).store(pt + j * 16);
      }
      l = l * cr + sum16(p);
      m = mx;
      cr.store(corr);
      if constexpr (I4) {
        if (every) {
          weigh_values(vrow, pt, corr);
        } else if (!whole) {
          weigh_values(vflt, pt, corr);
        } else {                                   // lanes that hold the group: int4 values; the others fp32
          const Mask as_int = len > Vi::set1(static_cast<int32_t>(gstart + KG - 1));
          for (int j = 0; j < KEYS; ++j) {
            const Vf w = Vf::load(pt + j * 16);
            select(as_int, w, Vf::zero()).store(pt + j * 16);
            select(as_int, Vf::zero(), w).store(pf + j * 16);
          }
          weigh_values(vrow, pt, corr);
          weigh_values(vflt, pf, ones);            // zero weights change nothing (+0 to every sum)
        }
      } else {
        weigh_values(vrow, pt, corr);
      }
    }
    m.store(mpart);
    l.store(lpart);
    fold_part(st, mpart, lpart, o, lanes, D);
  }
}

// Rows into tiles: a run of consecutive positions of one sequence in tiles of R rows (R gn <= 16
// lanes), every other row alone; G > 16 query heads per KV head in groups of 16.
std::vector<Tile> make_tiles(int64_t T, int64_t G, const AttentionRows& ar) {
  const int64_t gn = std::min<int64_t>(G, 16), R = 16 / gn;
  std::vector<Tile> tiles;
  for (int64_t t = 0; t < T;) {
    int64_t run = 1;
    while (t + run < T && ar.seq[t + run] == ar.seq[t] && ar.len[t + run] == ar.len[t] + run) ++run;
    for (int64_t r = 0; r < run; r += R)
      for (int64_t g0 = 0; g0 < G; g0 += gn)
        tiles.push_back({t + r, std::min(R, run - r), ar.seq[t], ar.len[t] + r, g0, std::min(gn, G - g0)});
    t += run;
  }
  return tiles;
}

// Parts of a tile: [first, last).
int64_t first_part(const Tile& tile, int64_t window) {
  return (window > 0 ? std::max<int64_t>(0, tile.len0 - window) : 0) / PART_TOKENS;
}
int64_t end_part(const Tile& tile) { return (tile.len0 + tile.R - 1 + PART_TOKENS - 1) / PART_TOKENS; }

}  // namespace

// Out of line: one body for every caller, so every caller rounds alike.
__attribute__((noinline)) void fold_part(float* st, const float* m, const float* l, const float* o, int64_t lanes,
                                         int64_t D) {
  const Vf mo = Vf::load(st), mp = Vf::load(m), lp = Vf::load(l), one = Vf::set1(1.f);
  const Vf m2 = max(mo, mp), base = select(m2 > Vf::set1(NEG_INF), m2, Vf::zero());
  const Vf a = select(m2 > mo, exp(mo - base), one), b = select(m2 > mp, exp(mp - base), one);
  const Mask some = lp > Vf::zero();
  const Vf la = Vf::load(st + 16) * a, lb = lp * b;
  select(some, la + lb, Vf::load(st + 16)).store(st + 16);
  select(some, m2, mo).store(st);
  alignas(64) float av[16], bv[16];
  a.store(av);
  b.store(bv);
  float* O = st + 32;
  for (int64_t lane = 0; lane < lanes; ++lane) {
    if (!(l[lane] > 0.f)) continue;
    const Vf al = Vf::set1(av[lane]), bl = Vf::set1(bv[lane]);
    for (int64_t d = 0; d < D; d += 16) {
      const Vf scaled = Vf::load(O + lane * D + d) * al;
      fma(Vf::load(o + lane * D + d), bl, scaled).store(O + lane * D + d);
    }
  }
}

bool attend_tiled(const Runtime& rt, const Cache& c, int64_t T, int64_t Hq, const AttentionRows& ar,
                  const float* q, float sc, float* out) {
  TileKernel fn = nullptr;
  switch (c.D * 4 + (c.k4 != nullptr ? INT4 : c.kq != nullptr ? INT8 : FP32)) {
    case 256: fn = attend_tile<4, FP32>; break;
    case 257: fn = attend_tile<4, INT8>; break;
    case 258: fn = attend_tile<4, INT4>; break;
    case 512: fn = attend_tile<8, FP32>; break;
    case 513: fn = attend_tile<8, INT8>; break;
    case 514: fn = attend_tile<8, INT4>; break;
    case 1024: fn = attend_tile<16, FP32>; break;
    case 1025: fn = attend_tile<16, INT8>; break;
    case 1026: fn = attend_tile<16, INT4>; break;
    default: return false;
  }
  const int64_t D = c.D, Hkv = c.Hkv, G = Hq / Hkv, window = ar.window;
  const int64_t S = state_floats(16, D), SP = state_floats(std::min<int64_t>(G, 16), D);   // a task's, a part's
  const std::vector<Tile> tiles = make_tiles(T, G, ar);
  // A one-row tile (a decode row) of several parts has a task per part, its state kept in `parts`
  // and folded after: a long context is then read by every thread. Any other tile: one task.
  struct Task {
    int64_t tile, part0, part1, slot;   // slot >= 0: the part's state goes to parts[slot]
  };
  std::vector<Task> split, whole, folded;   // folded: a split tile's parts, from its first slot on
  for (int64_t i = 0; i < static_cast<int64_t>(tiles.size()); ++i) {
    const int64_t p0 = first_part(tiles[i], window), p1 = end_part(tiles[i]);
    if (tiles[i].R == 1 && p1 - p0 > 1) {
      folded.push_back({i, p0, p1, static_cast<int64_t>(split.size())});
      for (int64_t k = p0; k < p1; ++k) split.push_back({i, k, k + 1, static_cast<int64_t>(split.size())});
    } else {
      whole.push_back({i, p0, p1, -1});
    }
  }
  const int64_t ns = static_cast<int64_t>(split.size()) * Hkv, nw = static_cast<int64_t>(whole.size()) * Hkv;
  std::vector<float> own_parts;
  float* parts = ns == 0 ? nullptr : team_once<float>(rt, [&] {
    own_parts.resize(ns * SP);
    return own_parts.data();
  });
  auto run = [&](const Task& task, int64_t h, float* st) {
    const Tile& tile = tiles[task.tile];
    clear_state(st, tile.R * tile.gn, D);
    const TileKernel row = tile.R == 1 ? row_kernel(c, tile.gn) : nullptr;
    (row ? row : fn)(c, ar, h, tile, q, Hq, sc, task.part0, task.part1, st);
    if (task.slot < 0) write_rows(st, tile, Hq, G, h, D, out);
  };
  // Whole tiles, later tiles of a chunk (more context) paired with earlier ones so each thread's
  // contiguous share of the range has about the same work; then the parts (the same work each).
  parallel_for(rt, nw, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> own(S);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t w = i % 2 ? nw - 1 - i / 2 : i / 2;
      run(whole[w / Hkv], w % Hkv, own.data());
    }
  });
  parallel_for(rt, ns, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) run(split[i / Hkv], i % Hkv, parts + (split[i / Hkv].slot * Hkv + i % Hkv) * SP);
  });
  if (folded.empty()) return true;
  parallel_for(rt, static_cast<int64_t>(folded.size()) * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> st(S);
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = folded[i / Hkv];
      const int64_t h = i % Hkv;
      const Tile& tile = tiles[task.tile];
      clear_state(st.data(), tile.gn, D);
      for (int64_t k = 0; k < task.part1 - task.part0; ++k) {
        const float* p = parts + ((task.slot + k) * Hkv + h) * SP;
        fold_part(st.data(), p, p + 16, p + 32, tile.gn, D);
      }
      write_rows(st.data(), tile, Hq, G, h, D, out);
    }
  });
  return true;
}

}  // namespace pw
