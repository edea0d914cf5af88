// Paged attention on the CPU: each query row attends over its sequence's cached keys and values,
// read in place from the paged KV cache (fp32, int8 or int4: kernels.h).
//
// Head sizes of 64, 128 and 256 go to the tiled kernel (tile_attention.cpp), every row of the
// step, in one order per row whatever rows share the call (attention.h); a decode row of few heads
// over an int8 or int4 cache takes attend_row here, the same arithmetic with keys in the lanes. Other head
// sizes take a scalar loop here, one key at a time: tasks (row, KV head, part of the context), each row's
// context cut into parts of PART_TOKENS from its first token, whose partial results (running max
// m, sum l, unnormalised output) are merged in order with their log-sum-exp. Every row of such a
// model takes this loop, so it too gives a row the same bits in any batch.
#include "attention.h"
#include "core.h"
#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace pw {
namespace {

// One decode row's G heads (lanes) over a quantized cache, parts [part0, part1), each folded into st:
// the tiled kernel's arithmetic step for step (the order in attention.h), with a pass's 16 keys in
// the vector lanes instead of 16 queries. A pass in a key group the row holds whole is read quantized:
// per head its query against the group's steps (group_query, once a group), then per key D / 64 integer
// dot products of whole rows and one transpose-reduction for the pass (the integer sums are exact in
// any order); the row's partial group is read as fp32 keys (float_dot). The pass's weights are summed in
// sum16's tree (reduce_add_pairs), as the tiled kernel sums its lanes. I4: an int4 cache (its codes
// unpacked a key at a time, values dequantized), else int8. GT > 0 fixes G at compile time (queries and
// outputs in registers); GT = 0 takes it from the tile.
template <int NV, int GT, bool I4>
void attend_row(const Cache& c, const AttentionRows& ar, int64_t h, const Tile& tile, const float* q, int64_t Hq,
                float sc, int64_t part0, int64_t part1, float* st) {
  constexpr int64_t D = 16 * NV, GMAX = GT > 0 ? GT : 16, KG = I4 ? KEY_GROUP4 : KEY_GROUP;
  const int64_t* table = ar.tables + tile.seq * ar.max_blocks;
  const int64_t block_size = ar.block_size, window = ar.window;
  const int64_t G = GT > 0 ? GT : tile.gn;
  const float* qh = q + (tile.t0 * Hq + h * (Hq / c.Hkv) + tile.g0) * D;
  alignas(64) float qs[GMAX][D];               // the queries, scaled
  alignas(64) uint8_t qi[GMAX][D];             // a group's int8 queries (int8 cache: + 128)
  alignas(64) uint8_t kc[I4 ? KEYS : 1][D];    // int4: a pass's key codes, a byte each
  float sy[GMAX], base[GMAX];                  // and their steps and midpoint terms
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) qs[g][d] = qh[g * D + d] * sc;
  const int64_t len = tile.len0, kmin = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  alignas(64) static const int8_t kzero[D] = {};
  alignas(64) float m[16], l[16], o[GMAX * D], probs[GMAX][KEYS];
  alignas(64) float vscale[KEYS], m_new[16], corr[16], fs[KEYS];
  std::fill(m_new, m_new + 16, NEG_INF);
  const int8_t* kq[KEYS];
  int64_t at[KEYS], queried = -1;              // queried: the key group qi holds queries for
  for (int64_t part = part0; part < part1; ++part) {
    Vf out[GMAX][NV];
    for (int64_t g = 0; g < G; ++g)
      for (int i = 0; i < NV; ++i) out[g][i] = Vf::zero();
    std::fill(m, m + 16, NEG_INF);
    std::fill(l, l + 16, 0.f);
    const int64_t pend = std::min(len, (part + 1) * PART_TOKENS);
    for (int64_t start = std::max(part * PART_TOKENS, kmin / KEYS * KEYS); start < pend; start += KEYS) {
      const int64_t j0 = std::max<int64_t>(0, kmin - start), n = std::min<int64_t>(KEYS, pend - start);
      const int64_t gstart = start / KG * KG;       // the pass's key group
      const bool whole = len >= gstart + KG;       // a group the row holds whole: quantized, else its fp32 keys
      for (int64_t j = 0, blk = start / block_size, off = start % block_size; j < KEYS; ++j) {
        const bool seen = j >= j0 && j < n;      // else not in the row's context: masked, never read
        at[j] = seen ? (table[blk] * block_size + off) * c.Hkv + h : -1;   // one division a pass
        if (++off == block_size) ++blk, off = 0;
        kq[j] = kzero;
        if (seen && whole && I4) unpack_row4(c.k4 + at[j] * D / 2, D, kc[j]), kq[j] = reinterpret_cast<const int8_t*>(kc[j]);
        else if (seen && whole) kq[j] = c.kq + at[j] * D;
        vscale[j] = !seen ? 0.f : I4 ? 1.f : c.vs[at[j]];
      }
      if (whole && gstart != queried) {
        const int64_t slot0 = table[gstart / block_size] * block_size + gstart % block_size;
        alignas(64) float p4[I4 ? 2 * D : 1];
        if constexpr (I4) group_params4(c, slot0, h, p4);
        const float* params = I4 ? p4 : group_params(c, slot0, h);
        for (int64_t g = 0; g < G; ++g) {
          int8_t x[D];
          sy[g] = group_query(qs[g], params, D, x, base + g);
          for (int64_t d = 0; d < D; ++d) qi[g][d] = static_cast<uint8_t>(I4 ? x[d] : x[d] + 128);
        }
        queried = gstart;
      }
      const Mask valid = first_n(n), below = first_n(j0);
      Vf ksum = Vf::zero();                     // int8 with Q8_BIASED: the keys' byte sums
      if (!I4 && Q8_BIASED && whole) ksum = row_sums_i8(kq, KEYS, D);
      Vf scores[GMAX];
      for (int64_t g = 0; g < G; ++g) {
        Vf s;
        if (whole) {
          Vf dots[KEYS];
          for (int64_t j = 0; j < KEYS; ++j) {    // 64 products a step, summed exactly
            Vi a = Vi::zero();
            for (int64_t i = 0; i < D; i += 64) {
              const Vb k = Vb::load(reinterpret_cast<const uint8_t*>(kq[j] + i));
              a = I4 ? dot_u4(a, k, Vb::load(qi[g] + i)) : dot_q8(a, Vb::load(qi[g] + i), k);
            }
            dots[j] = to_float(a);
          }
          s = reduce16(dots);                   // exact integers
          if (!I4 && Q8_BIASED) s = s - Vf::set1(128.f) * ksum;
          s = s * Vf::set1(sy[g]) + Vf::set1(base[g]);
        } else {
          for (int64_t j = 0; j < KEYS; ++j)
            fs[j] = j >= j0 && j < n ? float_dot(qs[g], float_key(c, ar, tile.seq, start + j, h), D) : 0.f;
          s = Vf::load(fs);
        }
        s = select(valid, select(below, Vf::set1(NEG_INF), s), Vf::set1(NEG_INF));
        scores[g] = s;
        m_new[g] = std::max(m[g], reduce_max(s));
      }
      for (int64_t g0 = 0; g0 < G; g0 += 16) {  // the tiled kernel's factor, 16 heads at a time
        const Vf mo = Vf::load(m + g0), mn = Vf::load(m_new + g0);
        const Vf base_ = select(mn > Vf::set1(NEG_INF), mn, Vf::zero());
        select(mn > mo, exp(mo - base_), Vf::set1(1.f)).store(corr + g0);
        base_.store(m + g0);                    // m holds the base until the max is stored below
      }
      for (int64_t g = 0; g < G; ++g) {
        const Vf p = exp(scores[g] - Vf::set1(m[g]));   // masked keys: 0
        l[g] = l[g] * corr[g] + reduce_add_pairs(p);     // the tiled kernel's sum16, in the lanes
        m[g] = m_new[g];
        (p * Vf::load(vscale)).store(probs[g]);
        const Vf cv = Vf::set1(corr[g]);
        for (int i = 0; i < NV; ++i) out[g][i] = out[g][i] * cv;
      }
      for (int64_t j = j0; j < n; ++j) {
        Vf vr[NV];
        if (I4 && whole) {
          load_int4_values<NV>(c, at[j], vr);
        } else if (I4) {                        // the row's own group: its fp32 values
          const float* x = float_value(c, ar, tile.seq, start + j, h);
          for (int i = 0; i < NV; ++i) vr[i] = Vf::load(x + 16 * i);
        } else {
          load_int8_row<NV>(c.vq + at[j] * D, vr);
        }
        for (int64_t g = 0; g < G; ++g) {
          const Vf w = Vf::set1(probs[g][j]);
          for (int i = 0; i < NV; ++i) out[g][i] = fma(w, vr[i], out[g][i]);
        }
      }
    }
    for (int64_t g = 0; g < G; ++g)
      for (int i = 0; i < NV; ++i) out[g][i].store(o + g * D + 16 * i);
    fold_part(st, m, l, o, G, D);
  }
}

// G query heads (q: [G, D]) of a row of length len of sequence s over its context tokens [from, to):
// leaves the running max m[G], sum l[G] and unnormalised output acc[G, D]. Over a quantized cache a key
// of a group below the row's own (len / group) is read quantized (each group's query prepared when its
// first key comes), the others as fp32 keys.
void attend_scalar(const Cache& c, const AttentionRows& ar, int64_t s, int64_t len, int64_t h, const float* q,
                   int64_t G, float sc, int64_t from, int64_t to, float* acc, float* m, float* l) {
  const int64_t D = c.D, block_size = ar.block_size, *table = ar.tables + s * ar.max_blocks, KG = c.group();
  std::vector<float> kr(D), vr(D), qs(G * D), sy(G), base(G), p4(c.k4 ? 2 * D : 0);
  std::vector<int8_t> qi(c.quantized() ? G * D : 0);
  std::vector<uint8_t> codes(c.k4 ? D : 0);
  for (int64_t i = 0; i < G * D; ++i) qs[i] = q[i] * sc;
  std::fill(acc, acc + G * D, 0.f);
  std::fill(m, m + G, NEG_INF);
  std::fill(l, l + G, 0.f);
  for (int64_t pos = from; pos < to; ++pos) {
    const int64_t slot = table[pos / block_size] * block_size + pos % block_size, at = slot * c.Hkv + h;
    const bool as_int = c.quantized() && pos < len / KG * KG;
    if (as_int && (pos == from || pos % KG == 0)) {   // a group's first key: the queries against it
      if (c.k4) group_params4(c, slot - pos % KG, h, p4.data());
      const float* params = c.k4 ? p4.data() : group_params(c, slot - pos % KG, h);
      for (int64_t g = 0; g < G; ++g)
        sy[g] = group_query(qs.data() + g * D, params, D, qi.data() + g * D, base.data() + g);
    }
    if (c.k4 && as_int) {
      unpack_row4(c.v4 + at * D / 2, D, codes.data());
      for (int64_t d = 0; d < D; ++d)
        vr[d] = (static_cast<float>(codes[d]) - 8.f) * f16_value(c.vs4[at * (D / V4_BLOCK) + d / V4_BLOCK]);
      unpack_row4(c.k4 + at * D / 2, D, codes.data());
    } else if (c.k4) {                           // the row's own group: its fp32 values
      const float* x = float_value(c, ar, s, pos, h);
      std::copy(x, x + D, vr.begin());
    }
    for (int64_t d = 0; d < D; ++d) {
      if (c.k) kr[d] = c.k[at * D + d];
      if (!c.k4) vr[d] = c.v ? c.v[at * D + d] : c.vq[at * D + d] * c.vs[at];
    }
    const float* key = c.k ? kr.data() : as_int ? nullptr : float_key(c, ar, s, pos, h);
    for (int64_t g = 0; g < G; ++g) {
      float sc_ = 0.f;
      if (as_int) {                              // the exact integer dot product, then the step and midpoint term
        int32_t dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += qi[g * D + d] * (c.k4 ? codes[d] : c.kq[at * D + d]);
        sc_ = static_cast<float>(dot) * sy[g] + base[g];
      } else if (c.quantized()) {
        sc_ = float_dot(qs.data() + g * D, key, D);
      } else {
        for (int64_t d = 0; d < D; ++d) sc_ += q[g * D + d] * kr[d];
        sc_ *= sc;
      }
      const float mx = std::max(m[g], sc_), corr = std::exp(m[g] - mx), p = std::exp(sc_ - mx);
      l[g] = l[g] * corr + p;
      m[g] = mx;
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] = acc[g * D + d] * corr + p * vr[d];
    }
  }
}

template <bool I4>
TileKernel row_kernel_of(int64_t D, int64_t lanes) {
  switch (D) {
    case 64:
      switch (lanes) {
        case 1: return attend_row<4, 1, I4>;
        case 2: return attend_row<4, 2, I4>;
        case 3: return attend_row<4, 3, I4>;
        case 4: return attend_row<4, 4, I4>;
        case 6: return attend_row<4, 6, I4>;
        case 7: return attend_row<4, 7, I4>;
        default: return attend_row<4, 0, I4>;
      }
    case 128: return lanes <= 2 ? (lanes == 1 ? attend_row<8, 1, I4> : attend_row<8, 2, I4>) : attend_row<8, 0, I4>;
    case 256: return attend_row<16, 0, I4>;
    default: return nullptr;
  }
}

}  // namespace

TileKernel row_kernel(const Cache& c, int64_t lanes) {
  if (lanes > 8 || !c.quantized()) return nullptr;
  return c.k4 ? row_kernel_of<true>(c.D, lanes) : row_kernel_of<false>(c.D, lanes);
}

// q: [T, Hq, D]; the cache [num_slots, Hkv, D] (slot = block * block_size + offset); row t attends
// over the first rows.len[t] tokens of sequence rows.seq[t] (with rows.window > 0: only the last
// `window` of them). Writes out [T, Hq, D].
void paged_attention(const Runtime& rt, const float* qp, int64_t T, int64_t Hq, const Cache& c,
                     const AttentionRows& ar, float sc, float* op) {
  const int64_t D = c.D, Hkv = c.Hkv, G = Hq / Hkv;
  const int64_t* seqs = ar.seq;
  const int64_t* lens = ar.len;
  if (T == 0 || attend_tiled(rt, c, T, Hq, ar, qp, sc, op)) return;
  const int64_t window = ar.window;
  auto first = [&](int64_t t) { return window > 0 ? std::max<int64_t>(0, lens[t] - window) : int64_t{0}; };
  int64_t max_len = 0;
  for (int64_t t = 0; t < T; ++t) max_len = std::max(max_len, lens[t] - first(t));
  const int64_t P = std::max<int64_t>(1, (max_len + PART_TOKENS - 1) / PART_TOKENS);   // parts of the longest row
  // Partial results per task (row, head, part): acc [G, D], then m [G] and l [G].
  const int64_t stride = G * D + 2 * G;
  std::vector<float> own_part;
  float* part = P == 1 ? nullptr : team_once<float>(rt, [&] {
    own_part.resize(T * Hkv * P * stride);
    return own_part.data();
  });
  parallel_for(rt, T * Hkv * P, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> own(P > 1 ? 0 : stride);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / (Hkv * P), h = (task / P) % Hkv, k = task % P;
      const int64_t L = lens[t], L0 = first(t);
      const int64_t from = std::min(L, L0 + k * PART_TOKENS), to = std::min(L, from + PART_TOKENS);
      float* acc = P > 1 ? part + task * stride : own.data();
      attend_scalar(c, ar, seqs[t], L, h, qp + (t * Hq + h * G) * D, G, sc, from, to, acc, acc + G * D,
                    acc + G * D + G);
      if (P == 1) {
        float* ot = op + (t * Hq + h * G) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float inv = acc[G * D + G + g] > 0.f ? 1.f / acc[G * D + G + g] : 0.f;
          for (int64_t d = 0; d < D; ++d) ot[g * D + d] = acc[g * D + d] * inv;
        }
      }
    }
  });
  if (P > 1) {                          // merge the parts of each (row, head) by their log-sum-exp
    parallel_for(rt, T * Hkv, 1, [&](int64_t begin, int64_t end) {
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t t = pair / Hkv, h = pair % Hkv;
        const float* base = part + pair * P * stride;
        float* ot = op + (t * Hq + h * G) * D;
        for (int64_t g = 0; g < G; ++g) {
          float mx = NEG_INF;
          for (int64_t k = 0; k < P; ++k) mx = std::max(mx, base[k * stride + G * D + g]);
          float l = 0.f;
          std::fill(ot + g * D, ot + (g + 1) * D, 0.f);
          for (int64_t k = 0; k < P; ++k) {
            const float* pk = base + k * stride;
            if (pk[G * D + G + g] == 0.f) continue;            // an empty part
            const float w = std::exp(pk[G * D + g] - mx);
            l += w * pk[G * D + G + g];
            for (int64_t d = 0; d < D; ++d) ot[g * D + d] += w * pk[g * D + d];
          }
          const float inv = l > 0.f ? 1.f / l : 0.f;
          for (int64_t d = 0; d < D; ++d) ot[g * D + d] *= inv;
        }
      }
    });
  }
}

}  // namespace pw
