// Paged attention on the CPU: each query row attends over its sequence's cached keys and values,
// read in place from the paged KV cache (fp32, or int8 with one fp32 scale per (slot, KV head)).
//
// Head sizes of 64, 128 and 256 go to the tiled kernel (tile_attention.cpp), every row of the
// step, in one order per row whatever rows share the call (attention.h); a decode row of few heads
// over an int8 cache takes attend_row here, the same arithmetic with keys in the lanes. Other head
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

// One decode row's G heads (lanes) over an int8 cache, parts [part0, part1), each folded into st:
// the tiled kernel's arithmetic step for step (the order in attention.h), with a pass's 16 keys in
// the vector lanes instead of 16 queries. Per key and head: D / 64 int8 dot products of whole
// rows, one transpose-reduction for the pass (the integer sums are exact in any order); the
// pass's weights are summed in sum16's tree (reduce_add_pairs), as the tiled kernel sums its
// lanes. GT > 0 fixes G at compile time (queries and outputs in registers); GT = 0 takes it from
// the tile.
template <int NV, int GT>
void attend_row(const Cache& c, const int64_t* table, int64_t block_size, int64_t window, int64_t h,
                const Tile& tile, const float* q, int64_t Hq, float sc, int64_t part0, int64_t part1, float* st) {
  constexpr int64_t D = 16 * NV, GMAX = GT > 0 ? GT : 16;
  const int64_t G = GT > 0 ? GT : tile.gn;
  const float* qh = q + (tile.t0 * Hq + h * (Hq / c.Hkv) + tile.g0) * D;
  alignas(64) uint8_t qi[GMAX][D];             // the queries as int8 (quantize_query) + 128
  float qs[GMAX];                              // and their scales
  for (int64_t g = 0; g < G; ++g) {
    int8_t x[D];
    qs[g] = quantize_query(qh + g * D, D, sc, x);
    for (int64_t d = 0; d < D; ++d) qi[g][d] = static_cast<uint8_t>(x[d] + 128);
  }
  const int64_t len = tile.len0, kmin = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  alignas(64) static const int8_t kzero[D] = {};
  alignas(64) float m[16], l[16], o[GMAX * D], probs[GMAX][KEYS];
  alignas(64) float kscale[KEYS], vscale[KEYS], m_new[16], corr[16];
  std::fill(m_new, m_new + 16, NEG_INF);
  const int8_t* kq[KEYS];
  int64_t at[KEYS];
  for (int64_t part = part0; part < part1; ++part) {
    Vf out[GMAX][NV];
    for (int64_t g = 0; g < G; ++g)
      for (int i = 0; i < NV; ++i) out[g][i] = Vf::zero();
    std::fill(m, m + 16, NEG_INF);
    std::fill(l, l + 16, 0.f);
    const int64_t pend = std::min(len, (part + 1) * PART_TOKENS);
    for (int64_t start = std::max(part * PART_TOKENS, kmin / KEYS * KEYS); start < pend; start += KEYS) {
      const int64_t j0 = std::max<int64_t>(0, kmin - start), n = std::min<int64_t>(KEYS, pend - start);
      for (int64_t j = 0, blk = start / block_size, off = start % block_size; j < KEYS; ++j) {
        const bool seen = j >= j0 && j < n;      // else not in the row's context: masked, never read
        at[j] = seen ? (table[blk] * block_size + off) * c.Hkv + h : -1;   // one division a pass
        if (++off == block_size) ++blk, off = 0;
        if (!seen) {
          kq[j] = kzero, kscale[j] = vscale[j] = 0.f;
          continue;
        }
        kq[j] = c.kq + at[j] * D;
        kscale[j] = c.ks[at[j]];
        vscale[j] = c.vs[at[j]];
      }
      const Mask valid = first_n(n), below = first_n(j0);
      Vf ksum = Vf::zero();                     // with Q8_BIASED: the keys' byte sums
      if constexpr (Q8_BIASED) ksum = row_sums_i8(kq, KEYS, D);
      Vf scores[GMAX];
      for (int64_t g = 0; g < G; ++g) {
        Vf dots[KEYS];
        for (int64_t j = 0; j < KEYS; ++j) {    // 64 products a step, summed exactly
          Vi a = Vi::zero();
          for (int64_t i = 0; i < D; i += 64)
            a = dot_q8(a, Vb::load(qi[g] + i), Vb::load(reinterpret_cast<const uint8_t*>(kq[j] + i)));
          dots[j] = to_float(a);
        }
        Vf s = reduce16(dots);                  // exact integers
        if (Q8_BIASED) s = s - Vf::set1(128.f) * ksum;
        s = s * Vf::set1(qs[g]) * Vf::load(kscale);
        s = select(valid, select(below, Vf::set1(NEG_INF), s), Vf::set1(NEG_INF));
        scores[g] = s;
        m_new[g] = std::max(m[g], reduce_max(s));
      }
      for (int64_t g0 = 0; g0 < G; g0 += 16) {  // the tiled kernel's factor, 16 heads at a time
        const Vf mo = Vf::load(m + g0), mn = Vf::load(m_new + g0);
        const Vf base = select(mn > Vf::set1(NEG_INF), mn, Vf::zero());
        select(mn > mo, exp(mo - base), Vf::set1(1.f)).store(corr + g0);
        base.store(m + g0);                     // m holds the base until the max is stored below
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
        load_int8_row<NV>(c.vq + at[j] * D, vr);
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

// G query heads (q: [G, D]) over context tokens [from, to) of one sequence: leaves the running
// max m[G], sum l[G] and unnormalised output acc[G, D].
void attend_scalar(const Cache& c, const int64_t* table, int64_t block_size, int64_t h, const float* q,
                   int64_t G, float sc, int64_t from, int64_t to, float* acc, float* m, float* l) {
  const int64_t D = c.D;
  std::vector<float> kr(D), vr(D), qs(G);
  std::vector<int8_t> qi(c.kq ? G * D : 0);
  for (int64_t g = 0; g < G && c.kq; ++g) qs[g] = quantize_query(q + g * D, D, sc, qi.data() + g * D);
  std::fill(acc, acc + G * D, 0.f);
  std::fill(m, m + G, NEG_INF);
  std::fill(l, l + G, 0.f);
  for (int64_t pos = from; pos < to; ++pos) {
    const int64_t at = (table[pos / block_size] * block_size + pos % block_size) * c.Hkv + h;
    for (int64_t d = 0; d < D; ++d) {
      if (c.k) kr[d] = c.k[at * D + d];
      vr[d] = c.v ? c.v[at * D + d] : c.vq[at * D + d] * c.vs[at];
    }
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      if (c.kq) {                                // the exact integer dot product, then the scales
        int32_t dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += qi[g * D + d] * c.kq[at * D + d];
        s = static_cast<float>(dot) * qs[g] * c.ks[at];
      } else {
        for (int64_t d = 0; d < D; ++d) s += q[g * D + d] * kr[d];
        s *= sc;
      }
      const float mx = std::max(m[g], s), corr = std::exp(m[g] - mx), p = std::exp(s - mx);
      l[g] = l[g] * corr + p;
      m[g] = mx;
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] = acc[g * D + d] * corr + p * vr[d];
    }
  }
}

}  // namespace

TileKernel row_kernel(int64_t D, int64_t lanes) {
  if (lanes > 8) return nullptr;
  switch (D) {
    case 64:
      switch (lanes) {
        case 1: return attend_row<4, 1>;
        case 2: return attend_row<4, 2>;
        case 3: return attend_row<4, 3>;
        case 4: return attend_row<4, 4>;
        case 6: return attend_row<4, 6>;
        case 7: return attend_row<4, 7>;
        default: return attend_row<4, 0>;
      }
    case 128: return lanes <= 2 ? (lanes == 1 ? attend_row<8, 1> : attend_row<8, 2>) : attend_row<8, 0>;
    case 256: return attend_row<16, 0>;
    default: return nullptr;
  }
}

// q: [T, Hq, D]; the cache [num_slots, Hkv, D] (slot = block * block_size + offset); row t attends
// over the first rows.len[t] tokens of sequence rows.seq[t] (with rows.window > 0: only the last
// `window` of them). Writes out [T, Hq, D].
void paged_attention(const Runtime& rt, const float* qp, int64_t T, int64_t Hq, const Cache& c,
                     const AttentionRows& ar, float sc, float* op) {
  const int64_t D = c.D, Hkv = c.Hkv, G = Hq / Hkv, max_blocks = ar.max_blocks, block_size = ar.block_size;
  const int64_t* tables = ar.tables;
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
      attend_scalar(c, tables + seqs[t] * max_blocks, block_size, h, qp + (t * Hq + h * G) * D, G, sc, from, to,
                    acc, acc + G * D, acc + G * D + G);
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
