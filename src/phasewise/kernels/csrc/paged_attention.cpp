// Paged attention on the CPU: each query row attends over its sequence's cached keys and values,
// read in place from the paged KV cache (fp32, or int8 with one fp32 scale per (slot, KV head)).
//
// Work is split into tasks (row, KV head, part of the context): each row's context is cut into
// parts of PART_TOKENS from its first token (flash-decoding), whose partial results (running
// max m, sum l, unnormalised output) are merged in order with their log-sum-exp. The parts
// depend on the row alone, never on the batch or the thread count, so a decode row's output is
// the same bits in any batch. (A run of rows of one sequence goes to the tiled kernel, whose
// sums are in another order: a speculative verify's rows are not yet its decode steps' bits.) Within a task, keys go 16 at a time: 16 dot products, one
// transpose-reduction into a vector of 16 scores, one vectorised exp, then the 16 value rows
// times their weights. The G query heads that share a KV head are done together, so each
// K/V row is read once per task. Head sizes that are not 64, 128 or 256 take a scalar loop. Written once over the
// vector layer (vec/vec.h): 16 keys per pass whatever the ISA.
#include "attention.h"
#include "core.h"
#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace pw {
namespace {

constexpr int64_t PART_TOKENS = 128;  // context tokens of one task (the last part of a row: fewer)
// Runs of more than this many consecutive positions of one sequence go to the tiled kernel. At 8
// a verify of up to 7 drafts equalled its decode steps, but a prompt's last few tokens computed
// again after a prefix-cache hit then differed from the first prefill's (tiled) bits: until the
// two kernels sum in one order, every run goes to tiles.
constexpr int64_t ROW_RUN = 1;

// One task: G query heads (q: [G, D]) over context tokens [from, to) of one sequence.
// Leaves the running max m[G], sum l[G] and unnormalised output acc[G, D].
// Over an int8 cache the queries are int8 too (quantize_query, once per task): a score is an
// int8 dot product of the query with the key's row, times the query's and the key's scale; the
// value scales multiply the 16 value weights instead of every element.
// GT > 0 fixes G at compile time, so the queries and outputs stay in registers (GT NV <= 16);
// GT = 0 takes G from the call (at most MAX_G), its state in arrays on the stack.
constexpr int64_t MAX_G = 32;

template <int NV, bool INT8, int GT>
void attend(const Cache& c, const int64_t* table, int64_t block_size, int64_t h, const float* q, int64_t G_call,
            float sc, int64_t from, int64_t to, float* acc, float* m, float* l) {
  constexpr int64_t D = 16 * NV, GMAX = GT > 0 ? GT : MAX_G;
  const int64_t G = GT > 0 ? GT : G_call;
  Vf qv[INT8 ? 1 : GMAX][NV], out[GMAX][NV];
  alignas(64) int8_t qi[INT8 ? GMAX : 1][D];   // int8 cache: the queries as int8 (quantize_query) + 128
  float qs[INT8 ? GMAX : 1];                   // and their scales
  for (int64_t g = 0; g < G; ++g) {
    for (int i = 0; i < NV; ++i) out[g][i] = Vf::zero();
    if constexpr (INT8) {
      qs[g] = quantize_query(q + g * D, D, sc, qi[g]);
      for (int64_t d = 0; d < D; ++d) qi[g][d] = static_cast<int8_t>(static_cast<uint8_t>(qi[g][d] + 128));
    } else {
      for (int i = 0; i < NV; ++i) qv[g][i] = Vf::load(q + g * D + 16 * i) * Vf::set1(sc);
    }
    m[g] = NEG_INF;
    l[g] = 0.f;
  }
  alignas(64) float probs[GMAX][KEYS];
  alignas(64) float kscale[KEYS], vscale[KEYS];
  const int8_t* kq[KEYS];
  for (int64_t start = from; start < to; start += KEYS) {
    const int64_t n = std::min<int64_t>(KEYS, to - start);
    int64_t at[KEYS];                                          // (slot, head) row of each key
    const float* krow[KEYS];
    for (int64_t j = 0, blk = start / block_size, off = start % block_size; j < n; ++j) {
      at[j] = (table[blk] * block_size + off) * c.Hkv + h;
      if (++off == block_size) ++blk, off = 0;
      if constexpr (INT8) {
        kq[j] = c.kq + at[j] * D;
        kscale[j] = c.ks[at[j]];
        vscale[j] = c.vs[at[j]];
      } else {
        krow[j] = c.k + at[j] * D;
      }
    }
    const Mask valid = first_n(n);
    Vf ksum = Vf::zero();                                        // int8 with Q8_BIASED: the keys' byte sums
    if constexpr (INT8 && Q8_BIASED) ksum = row_sums_i8(kq, n, D);
    Vf scores[GMAX];
    alignas(64) float m_old[GMAX], m_new[GMAX], corr[GMAX];
    for (int64_t g = 0; g < G; ++g) {
      Vf dots[KEYS];
      for (int64_t j = 0; j < KEYS; ++j) {
        if (j >= n) { dots[j] = Vf::zero(); continue; }
        if constexpr (INT8) {                                    // 64 products a step, summed exactly
          Vi a = Vi::zero();
          for (int64_t i = 0; i < D; i += 64)
            a = dot_q8(a, Vb::load(reinterpret_cast<const uint8_t*>(qi[g] + i)),
                       Vb::load(reinterpret_cast<const uint8_t*>(kq[j] + i)));
          dots[j] = to_float(a);
        } else {
          Vf s = qv[g][0] * Vf::load(krow[j]);
          for (int i = 1; i < NV; ++i) s = fma(qv[g][i], Vf::load(krow[j] + 16 * i), s);
          dots[j] = s;
        }
      }
      Vf s = reduce16(dots);                                     // int8: exact integers
      if constexpr (INT8) {
        if (Q8_BIASED) s = s - Vf::set1(128.f) * ksum;
        s = s * Vf::set1(qs[g]) * Vf::load_n(kscale, n);
      }
      scores[g] = select(valid, s, Vf::set1(NEG_INF));
      m_old[g] = m[g];
      m_new[g] = std::max(m[g], reduce_max(scores[g]));
    }
    for (int64_t g0 = 0; g0 < G; g0 += 16) {                   // e^(old max - new max), 16 heads a time
      exp(Vf::load_n(m_old + g0, G - g0) - Vf::load_n(m_new + g0, G - g0)).store_n(corr + g0, G - g0);
    }
    for (int64_t g = 0; g < G; ++g) {                          // corr is 0 on the first pass (m = -inf)
      const Vf e = select(valid, exp(scores[g] - Vf::set1(m_new[g])), Vf::zero());
      l[g] = l[g] * corr[g] + reduce_add(e);
      m[g] = m_new[g];
      (INT8 ? e * Vf::load_n(vscale, n) : e).store(probs[g]);
      const Vf cv = Vf::set1(corr[g]);
      for (int i = 0; i < NV; ++i) out[g][i] = out[g][i] * cv;
    }
    for (int64_t j = 0; j < n; ++j) {
      Vf vr[NV];
      if constexpr (INT8) {
        load_int8_row<NV>(c.vq + at[j] * D, vr);
      } else {
        for (int i = 0; i < NV; ++i) vr[i] = Vf::load(c.v + at[j] * D + 16 * i);
      }
      for (int64_t g = 0; g < G; ++g) {
        const Vf w = Vf::set1(probs[g][j]);
        for (int i = 0; i < NV; ++i) out[g][i] = fma(w, vr[i], out[g][i]);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) out[g][i].store(acc + g * D + 16 * i);
}

// The attend for head size 16 NV and group size G: fixed-G kernels where the state fits registers.
template <int NV, bool INT8, typename Run>
void run_for_group(int64_t G, Run&& run) {
  if constexpr (NV == 4) {
    switch (G) {
      case 1: return run(attend<NV, INT8, 1>);
      case 2: return run(attend<NV, INT8, 2>);
      case 3: return run(attend<NV, INT8, 3>);
      case 4: return run(attend<NV, INT8, 4>);
      default: break;
    }
  } else if constexpr (NV == 8) {
    switch (G) {
      case 1: return run(attend<NV, INT8, 1>);
      case 2: return run(attend<NV, INT8, 2>);
      default: break;
    }
  }
  run(attend<NV, INT8, 0>);
}

// The same for any head size, one key at a time.
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

// q: [T, Hq, D]; the cache [num_slots, Hkv, D] (slot = block * block_size + offset); row t attends
// over the first rows.len[t] tokens of sequence rows.seq[t] (with rows.window > 0: only the last
// `window` of them). Writes out [T, Hq, D].
void paged_attention(const Runtime& rt, const float* qp, int64_t T, int64_t Hq, const Cache& c,
                     const AttentionRows& ar, float sc, float* op) {
  const int64_t D = c.D, Hkv = c.Hkv, G = Hq / Hkv, max_blocks = ar.max_blocks, block_size = ar.block_size;
  const int64_t* tables = ar.tables;
  const int64_t* seqs = ar.seq;
  const int64_t* lens = ar.len;
  const bool int8 = c.kq != nullptr;
  // Runs of more than ROW_RUN consecutive positions of one sequence (prompt chunks) go in tiles to
  // the tiled kernel; the other rows (decodes, verifies) one by one here.
  std::vector<Tile> tiles;
  std::vector<int64_t> rows;
  const int64_t R = tile_rows(G);
  for (int64_t t = 0; t < T;) {
    int64_t run = 1;                    // the run of consecutive positions of one sequence from row t
    while (t + run < T && seqs[t + run] == seqs[t] && lens[t + run] == lens[t] + run) ++run;
    if (run <= ROW_RUN)
      for (int64_t r = 0; r < run; ++r) rows.push_back(t + r);
    else
      for (int64_t r = 0; r < run; r += R) {
        if (run - r > 1) tiles.push_back({t + r, std::min(R, run - r), seqs[t], lens[t] + r});
        else rows.push_back(t + r);
      }
    t += run;
  }
  if (!tiles.empty() && !attend_tiles(rt, c, tiles, ar, qp, Hq, sc, op)) {
    for (const Tile& tile : tiles)                 // no tiled kernel for this shape
      for (int64_t r = 0; r < tile.R; ++r) rows.push_back(tile.t0 + r);
  }
  const int64_t N = static_cast<int64_t>(rows.size());
  if (N == 0) return;
  const int64_t window = ar.window;
  auto first = [&](int64_t t) { return window > 0 ? std::max<int64_t>(0, lens[t] - window) : int64_t{0}; };
  int64_t max_len = 0;
  for (int64_t t : rows) max_len = std::max(max_len, lens[t] - first(t));
  const int64_t P = std::max<int64_t>(1, (max_len + PART_TOKENS - 1) / PART_TOKENS);   // parts of the longest row
  // Partial results per task (row, head, part): acc [G, D], then m [G] and l [G].
  const int64_t stride = G * D + 2 * G;
  std::vector<float> own_part;
  float* part = P == 1 ? nullptr : team_once<float>(rt, [&] {
    own_part.resize(N * Hkv * P * stride);
    return own_part.data();
  });
  auto run = [&](auto attend_fn) {
    parallel_for(rt, N * Hkv * P, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> own(P > 1 ? 0 : stride);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t t = rows[task / (Hkv * P)], h = (task / P) % Hkv, k = task % P;
        const int64_t L = lens[t], L0 = first(t);
        const int64_t from = std::min(L, L0 + k * PART_TOKENS), to = std::min(L, from + PART_TOKENS);
        float* acc = P > 1 ? part + task * stride : own.data();
        attend_fn(c, tables + seqs[t] * max_blocks, block_size, h, qp + (t * Hq + h * G) * D, G, sc, from, to,
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
  };
  switch (G <= MAX_G ? D * 2 + int8 : 0) {
    case 128: run_for_group<4, false>(G, run); break;
    case 129: run_for_group<4, true>(G, run); break;
    case 256: run_for_group<8, false>(G, run); break;
    case 257: run_for_group<8, true>(G, run); break;
    case 512: run_for_group<16, false>(G, run); break;
    case 513: run_for_group<16, true>(G, run); break;
    default: run(attend_scalar);
  }
  if (P > 1) {                          // merge the parts of each (row, head) by their log-sum-exp
    parallel_for(rt, N * Hkv, 1, [&](int64_t begin, int64_t end) {
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t t = rows[pair / Hkv], h = pair % Hkv;
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
