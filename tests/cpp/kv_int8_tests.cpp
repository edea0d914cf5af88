// The int8 and int4 KV caches (kernels.h): the writer (write_kv, rope_and_cache) and attention over
// histories written in steps of every size, against a scalar reference in double that reads the codes as
// the kernels take them (a query against each key group's steps rounded to int8) and a row's partial group
// from the true fp32 keys.
#include "check.h"

#include <algorithm>

namespace kt {

Int8Cache::Int8Cache(int64_t slots, int64_t Hkv_, int64_t D_, int64_t tail_slots, int bits_)
    : held(2 * tail_slots, -1), Hkv(Hkv_), D(D_), bits(bits_) {
  const int64_t n = slots * Hkv * D, G = bits == 4 ? 64 : 16;
  tails.resize(2 * tail_slots * G * Hkv * D * (bits == 4 ? 2 : 1));   // int4: keys, then values
  if (bits == 4) {
    k4.resize(n / 2), v4.resize(n / 2), kg4.resize(slots / G * Hkv * 2 * D), vs4.resize(slots * Hkv * D / 32);
  } else {
    kq.resize(n), vq.resize(n), kg.resize(slots / G * Hkv * 2 * D), vs.assign(slots * Hkv, 1.f);
  }
}

pw::CacheOut Int8Cache::out() {
  pw::CacheOut c;
  if (bits == 4) c.k4 = k4.data(), c.v4 = v4.data(), c.kg4 = kg4.data(), c.vs4 = vs4.data();
  else c.kq = kq.data(), c.vq = vq.data(), c.kg = kg.data(), c.vs = vs.data();
  c.tails = tails.data(), c.tail_groups = held.data();
  return c;
}

pw::Cache Int8Cache::reader(const float* fresh, const float* fresh_v, int64_t ldv) const {
  pw::Cache c{nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, tails.data(), held.data(), fresh, Hkv, D};
  c.fresh_v = fresh_v, c.ldv = ldv;
  if (bits == 4) c.k4 = k4.data(), c.v4 = v4.data(), c.kg4 = kg4.data(), c.vs4 = vs4.data();
  else c.kq = kq.data(), c.vq = vq.data(), c.kg = kg.data(), c.vs = vs.data();
  return c;
}

namespace {

struct World {                     // sequences over a shuffled pool of blocks, their true keys and values
  int64_t bs, max_blocks, Hkv, D;
  std::vector<int64_t> tables;
  std::vector<std::vector<float>> keys, values;   // per sequence [context, Hkv, D]
};

World make_world(int64_t bs, int64_t Hkv, int64_t D, const std::vector<int64_t>& context_lens) {
  World w{bs, 0, Hkv, D, {}, {}, {}};
  int64_t blocks = 0;
  for (int64_t c : context_lens) blocks += (c + bs - 1) / bs, w.max_blocks = std::max(w.max_blocks, (c + bs - 1) / bs);
  std::vector<int64_t> perm(blocks);
  for (int64_t i = 0; i < blocks; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  w.tables.assign(context_lens.size() * w.max_blocks, 0);
  for (size_t i = 0, used = 0; i < context_lens.size(); ++i) {
    for (int64_t b = 0; b < (context_lens[i] + bs - 1) / bs; ++b) w.tables[i * w.max_blocks + b] = perm[used++];
    auto k = randn(context_lens[i] * Hkv * D), v = randn(context_lens[i] * Hkv * D, 2.f);
    for (int64_t p = 0; p < context_lens[i]; ++p)        // three large, nearly constant channels a head (Qwen2's)
      for (int64_t h = 0; h < Hkv; ++h)
        for (int64_t d = 0; d < 3; ++d) k[(p * Hkv + h) * D + d] += 30.f + 10.f * d;
    w.keys.push_back(k), w.values.push_back(v);
  }
  return w;
}

int64_t slot_of(const World& w, int64_t s, int64_t p) {
  return w.tables[s * w.max_blocks + p / w.bs] * w.bs + p % w.bs;
}

// Sequence s's tokens [from, to) written as one step (tail slot s) through write_kv.
void write_step(const pw::KernelTable& k, const World& w, Int8Cache& c, int64_t s, int64_t from, int64_t to) {
  const int64_t n = to - from, width = w.Hkv * w.D;
  std::vector<int64_t> slots(n), seqs{from, n, 0, s};
  for (int64_t p = from; p < to; ++p) slots[p - from] = slot_of(w, s, p);
  pw::AttentionRows rows{w.tables.data() + s * w.max_blocks, w.max_blocks, nullptr, nullptr, w.bs};
  rows.seqs = seqs.data(), rows.num_seqs = 1;
  k.write_kv(RT, w.keys[s].data() + from * width, w.values[s].data() + from * width, width, n, w.Hkv, w.D,
             slots.data(), rows, c.out());
}

// The cache's code of (slot, KV head) row `at`, value d, of K (keys) or V.
int code_of(const Int8Cache& c, bool keys, int64_t at, int64_t d) {
  if (c.bits == 8) return (keys ? c.kq : c.vq)[at * c.D + d];
  const uint8_t b = (keys ? c.k4 : c.v4)[at * c.D / 2 + d / 64 * 32 + d % 32];
  return d % 64 < 32 ? b & 15 : b >> 4;
}

// A key group's midpoint (int4: minimum) and step of channel d, KV head h, the group's first slot slot0.
float group_param(const Int8Cache& c, int64_t slot0, int64_t h, int64_t which, int64_t d) {
  const int64_t G = c.bits == 4 ? 64 : 16, i = ((slot0 / G) * c.Hkv + h) * 2 * c.D + which * c.D + d;
  return c.bits == 4 ? half_to_float(c.kg4[i]) : c.kg[i];
}

// V of (slot, KV head) row `at`, value d.
float value_of(const Int8Cache& c, int64_t at, int64_t d) {
  if (c.bits == 8) return c.vq[at * c.D + d] * c.vs[at];
  return (code_of(c, false, at, d) - 8) * half_to_float(c.vs4[at * (c.D / 32) + d / 32]);
}

// Row of length len of sequence s, query q [Hq, D], as the kernels define it (double sums).
void attend_int8_ref(const World& w, const Int8Cache& c, int64_t s, const float* q, int64_t Hq, int64_t len,
                     float scale, int64_t window, float* out) {
  const int64_t D = w.D, G = Hq / w.Hkv, first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  const int64_t KG = c.bits == 4 ? 64 : 16, whole = len / KG * KG;
  std::vector<double> sc(len);
  std::vector<float> qs(D), y(D);
  for (int64_t h = 0; h < Hq; ++h) {
    const int64_t hk = h / G;
    for (int64_t d = 0; d < D; ++d) qs[d] = q[h * D + d] * scale;
    double mx = -INFINITY, sum = 0;
    float amax = 0.f, base = 0.f;
    std::vector<int> xi(D);
    for (int64_t p = first; p < len; ++p) {
      const int64_t at = slot_of(w, s, p);
      double dot = 0;
      if (p < whole) {
        if (p == first || p % KG == 0) {                 // the query against this group's steps
          double b = 0;
          amax = 0.f;
          for (int64_t d = 0; d < D; ++d) {
            y[d] = qs[d] * group_param(c, at - p % KG, hk, 1, d), amax = std::max(amax, std::fabs(y[d]));
            b += qs[d] * group_param(c, at - p % KG, hk, 0, d);
          }
          for (int64_t d = 0; d < D; ++d) xi[d] = amax > 0.f ? static_cast<int>(std::nearbyint(y[d] * (127.f / amax))) : 0;
          base = static_cast<float>(b);
        }
        int64_t isum = 0;
        for (int64_t d = 0; d < D; ++d) isum += xi[d] * code_of(c, true, at * w.Hkv + hk, d);
        dot = base + static_cast<double>(amax / 127.f) * isum;
      } else {
        for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(qs[d]) * w.keys[s][(p * w.Hkv + hk) * D + d];
      }
      sc[p] = dot, mx = std::max(mx, dot);
    }
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = 0.f;
    std::vector<double> acc(D, 0.0);
    for (int64_t p = first; p < len; ++p) {
      const int64_t at = slot_of(w, s, p) * w.Hkv + hk;
      const double e = std::exp(sc[p] - mx);
      const bool own = c.bits == 4 && p >= whole;      // int4: the row's own group's values, fp32
      sum += e;
      for (int64_t d = 0; d < D; ++d) acc[d] += e * (own ? w.values[s][(p * w.Hkv + hk) * D + d] : value_of(c, at, d));
    }
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = static_cast<float>(acc[d] / sum);
  }
}

// Every full group of every sequence within half a step of its keys, V within half its step.
bool cache_holds(const World& w, const Int8Cache& c, const std::vector<int64_t>& context_lens) {
  bool ok = true;
  const int64_t D = w.D, KG = c.bits == 4 ? 64 : 16;
  for (size_t s = 0; s < context_lens.size(); ++s)
    for (int64_t p = 0; p < context_lens[s]; ++p)
      for (int64_t h = 0; h < w.Hkv; ++h) {
        const int64_t at = slot_of(w, s, p), row = (p * w.Hkv + h) * D;
        if (c.bits == 4 && p >= context_lens[s] / KG * KG) continue;   // int4: a partial group's values in the tail
        for (int64_t d = 0; d < D; ++d) {
          const float vstep = std::fabs(c.bits == 8 ? c.vs[at * w.Hkv + h] : half_to_float(c.vs4[(at * w.Hkv + h) * (D / 32) + d / 32]));
          const float v = w.values[s][row + d], clip = c.bits == 4 ? std::max(0.f, std::fabs(v) - 7.f * vstep) : 0.f;
          ok &= std::fabs(value_of(c, at * w.Hkv + h, d) - v) <= 0.5f * vstep + clip + 1e-5f * (1.f + vstep);
          if (p >= context_lens[s] / KG * KG) continue;
          const float lo = group_param(c, at - p % KG, h, 0, d), step = group_param(c, at - p % KG, h, 1, d);
          const float got = lo + step * code_of(c, true, at * w.Hkv + h, d);
          ok &= std::fabs(got - w.keys[s][row + d]) <= 0.5f * step + 1e-3f * (1.f + std::fabs(lo));
        }
      }
  return ok;
}

}  // namespace

// Rows: query_lens[i] positions of sequence i ending at context_lens[i]; its earlier tokens written in
// steps of 1, 3, 16 and 40 tokens; the step's keys rotated and written by rope_and_cache.
void test_int8_attention(const pw::KernelTable& k, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs,
                         const std::vector<int64_t>& query_lens, const std::vector<int64_t>& context_lens,
                         int64_t window, int bits) {
  World w = make_world(bs, Hkv, D, context_lens);
  const int64_t nseq = query_lens.size(), width = Hkv * D, P = 1024, half = D / 2;
  Int8Cache c(static_cast<int64_t>(w.tables.size()) * bs, Hkv, D, nseq, bits);
  const int64_t chunks[5] = {1, 3, 16, 40, 70};
  for (int64_t s = 0; s < nseq; ++s)
    for (int64_t p = 0, i = s; p < context_lens[s] - query_lens[s]; ++i) {
      const int64_t n = std::min(chunks[i % 5], context_lens[s] - query_lens[s] - p);
      write_step(k, w, c, s, p, p + n);
      p += n;
    }
  std::vector<float> cs(P * half), sn(P * half);
  for (int64_t p = 0; p < P; ++p)
    for (int64_t i = 0; i < half; ++i) {
      const float a = p * std::pow(10000.f, -2.f * i / D);
      cs[p * half + i] = std::cos(a), sn[p * half + i] = std::sin(a);
    }
  std::vector<int64_t> seq, len, pos, slots, seqs;
  for (int64_t s = 0; s < nseq; ++s) {
    seqs.insert(seqs.end(), {context_lens[s] - query_lens[s], query_lens[s], static_cast<int64_t>(seq.size()), s});
    for (int64_t r = 0; r < query_lens[s]; ++r) {
      const int64_t p = context_lens[s] - query_lens[s] + r;
      seq.push_back(s), len.push_back(p + 1), pos.push_back(p), slots.push_back(slot_of(w, s, p));
    }
  }
  const int64_t T = seq.size();
  auto qkv = randn(T * (Hq + 2 * Hkv) * D);
  std::vector<float> q(T * Hq * D), fresh(T * width);
  pw::AttentionRows rows{w.tables.data(), w.max_blocks, seq.data(), len.data(), bs, window};
  rows.seqs = seqs.data(), rows.num_seqs = nseq;
  k.rope_and_cache(RT, qkv.data(), T, pos.data(), cs.data(), sn.data(), Hq, Hkv, D, slots.data(), rows, c.out(),
                   q.data(), fresh.data());
  for (int64_t t = 0; t < T; ++t)                        // the step's true keys and values: rotated k, v as given
    for (int64_t e = 0; e < width; ++e) {
      w.keys[seq[t]][pos[t] * width + e] = fresh[t * width + e];
      w.values[seq[t]][pos[t] * width + e] = qkv[(t * (Hq + 2 * Hkv) + Hq + Hkv) * D + e];
    }
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  std::vector<float> out(T * Hq * D), want(T * Hq * D);
  k.paged_attention(RT, q.data(), T, Hq, c.reader(fresh.data(), qkv.data() + (Hq + Hkv) * D, (Hq + 2 * Hkv) * D), rows,
                    scale, out.data());
  for (int64_t t = 0; t < T; ++t)
    attend_int8_ref(w, c, seq[t], q.data() + t * Hq * D, Hq, len[t], scale, window, want.data() + t * Hq * D);
  char name[160];
  std::snprintf(name, sizeof name, "int%d cache attention Hq=%lld Hkv=%lld D=%lld bs=%lld rows=%lld window=%lld",
                bits, (long long)Hq, (long long)Hkv, (long long)D, (long long)bs, (long long)T, (long long)window);
  check_close(name, out.data(), want.data(), out.size(), 1e-4f, 5e-5f);
  check(std::string(name) + ": the cache holds its keys and values", cache_holds(w, c, context_lens));
}

}  // namespace kt
