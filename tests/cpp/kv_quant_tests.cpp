// The int8 and int4 KV caches (kernels.h). The writers (write_kv, rope_and_cache) against the layout's
// reference: every whole key group, every value row and the tails as the layout defines them from the
// true keys and values, and every stored value back within half its step. Every reader (decode rows,
// prompt tiles, a verify's run, the scalar loop of other head sizes, sliding windows) against attention
// in double over what the cache holds, read as the layout says: the groups below a row's length
// quantized (its query against each group's steps rounded to int8), its own group's keys (int4: and
// values) as the true floats. Histories are written in steps of every size; verifies fill a group with
// drafts that are then rejected; rows sit before, at and past group ends.
#include "check.h"

#include <algorithm>

namespace kt {

namespace {
int64_t group_of(int bits) { return bits == 4 ? pw::KEY_GROUP4 : pw::KEY_GROUP; }
}  // namespace

QuantCache::QuantCache(int64_t slots, int64_t Hkv_, int64_t D_, int64_t tail_slots, int bits_)
    : held(2 * tail_slots, -1), Hkv(Hkv_), D(D_), bits(bits_) {
  const int64_t n = slots * Hkv * D, G = group_of(bits);
  tails.resize(2 * tail_slots * G * Hkv * D * (bits == 4 ? 2 : 1));   // int4: keys, then values
  if (bits == 4) {
    k4.resize(n / 2), v4.resize(n / 2), kg4.resize(slots / G * Hkv * 2 * D), vs4.resize(slots * Hkv * D / 32);
  } else {
    kq.resize(n), vq.resize(n), kg.resize(slots / G * Hkv * 2 * D), vs.assign(slots * Hkv, 1.f);
  }
}

pw::CacheOut QuantCache::out() {
  pw::CacheOut c;
  if (bits == 4) c.k4 = k4.data(), c.v4 = v4.data(), c.kg4 = kg4.data(), c.vs4 = vs4.data();
  else c.kq = kq.data(), c.vq = vq.data(), c.kg = kg.data(), c.vs = vs.data();
  c.tails = tails.data(), c.tail_groups = held.data();
  return c;
}

pw::Cache QuantCache::reader(const float* fresh, const float* fresh_v, int64_t ldv) const {
  pw::Cache c{nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, tails.data(), held.data(), fresh, Hkv, D};
  c.fresh_v = fresh_v, c.ldv = ldv;
  if (bits == 4) c.k4 = k4.data(), c.v4 = v4.data(), c.kg4 = kg4.data(), c.vs4 = vs4.data();
  else c.kq = kq.data(), c.vq = vq.data(), c.kg = kg.data(), c.vs = vs.data();
  return c;
}

namespace {

struct World {                     // sequences over a shuffled pool of blocks, and the keys and values they hold
  int64_t bs, max_blocks, Hkv, D;
  std::vector<int64_t> tables;
  std::vector<std::vector<float>> keys, values;   // per sequence [capacity, Hkv, D]: what each position holds now
  std::vector<int64_t> len, start;                // per sequence: its length, its last step's first position
};

// Keys with three large, nearly constant channels a head (Qwen2's), values wider than keys.
World make_world(int64_t bs, int64_t Hkv, int64_t D, const std::vector<int64_t>& capacity) {
  const int64_t n = capacity.size();
  World w{bs, 0, Hkv, D, {}, {}, {}, std::vector<int64_t>(n, 0), std::vector<int64_t>(n, 0)};
  int64_t blocks = 0;
  for (int64_t c : capacity) blocks += (c + bs - 1) / bs, w.max_blocks = std::max(w.max_blocks, (c + bs - 1) / bs);
  std::vector<int64_t> perm(blocks);
  for (int64_t i = 0; i < blocks; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  w.tables.assign(n * w.max_blocks, 0);
  for (int64_t i = 0, used = 0; i < n; ++i) {
    for (int64_t b = 0; b < (capacity[i] + bs - 1) / bs; ++b) w.tables[i * w.max_blocks + b] = perm[used++];
    auto k = randn(capacity[i] * Hkv * D), v = randn(capacity[i] * Hkv * D, 2.f);
    for (int64_t p = 0; p < capacity[i]; ++p)
      for (int64_t h = 0; h < Hkv; ++h)
        for (int64_t d = 0; d < 3; ++d) k[(p * Hkv + h) * D + d] += 30.f + 10.f * d;
    w.keys.push_back(k), w.values.push_back(v);
  }
  return w;
}

int64_t slot_of(const World& w, int64_t s, int64_t p) {
  return w.tables[s * w.max_blocks + p / w.bs] * w.bs + p % w.bs;
}

// Sequence s's tokens [from, to) (the world's keys and values there) written as one step through write_kv.
void write_step(const pw::KernelTable& k, World& w, QuantCache& c, int64_t s, int64_t from, int64_t to) {
  const int64_t n = to - from, width = w.Hkv * w.D;
  std::vector<int64_t> slots(n), seqs{from, n, 0, s};
  for (int64_t p = from; p < to; ++p) slots[p - from] = slot_of(w, s, p);
  pw::AttentionRows rows{w.tables.data() + s * w.max_blocks, w.max_blocks, nullptr, nullptr, w.bs};
  rows.seqs = seqs.data(), rows.num_seqs = 1;
  k.write_kv(RT, w.keys[s].data() + from * width, w.values[s].data() + from * width, width, n, w.Hkv, w.D,
             slots.data(), rows, c.out());
  w.start[s] = from, w.len[s] = to;
}

// Sequence s's first n tokens in steps of 1, 3, 16, 40 and 70 tokens, in turn from the s-th.
void write_history(const pw::KernelTable& k, World& w, QuantCache& c, int64_t s, int64_t n) {
  const int64_t sizes[5] = {1, 3, 16, 40, 70};
  for (int64_t p = 0, i = s; p < n; ++i) {
    const int64_t m = std::min(sizes[i % 5], n - p);
    write_step(k, w, c, s, p, p + m);
    p += m;
  }
}

// The cache's code of (slot, KV head) row `at`, value d, of K (keys) or V.
int code_of(const QuantCache& c, bool keys, int64_t at, int64_t d) {
  if (c.bits == 8) return (keys ? c.kq : c.vq)[at * c.D + d];
  const uint8_t b = (keys ? c.k4 : c.v4)[at * c.D / 2 + d / 64 * 32 + d % 32];
  return d % 64 < 32 ? b & 15 : b >> 4;
}

// A key group's midpoint (int4: minimum; which 0) or step (which 1) of channel d, KV head h, its first slot slot0.
float group_param(const QuantCache& c, int64_t slot0, int64_t h, int64_t which, int64_t d) {
  const int64_t i = ((slot0 / group_of(c.bits)) * c.Hkv + h) * 2 * c.D + which * c.D + d;
  return c.bits == 4 ? half_to_float(c.kg4[i]) : c.kg[i];
}

// V's step at (slot, KV head) row `at`, value d, and its value there.
float value_step(const QuantCache& c, int64_t at, int64_t d) {
  return c.bits == 8 ? c.vs[at] : half_to_float(c.vs4[at * (c.D / 32) + d / 32]);
}
float value_of(const QuantCache& c, int64_t at, int64_t d) {
  return (code_of(c, false, at, d) - (c.bits == 4 ? 8 : 0)) * value_step(c, at, d);
}

// What the layout asks of a code: the rounding of pre clamped to [lo, hi]; one off where pre is a tie
// within float error (the kernels' fast-math may take the other side of it).
bool code_ok(int code, float pre, int lo, int hi) {
  const int want = static_cast<int>(std::min<float>(hi, std::max<float>(lo, std::nearbyint(pre))));
  const float frac = std::fabs(pre - std::floor(pre) - 0.5f);
  return code == want || (frac < 1e-3f && std::abs(code - want) == 1);
}
bool float_ok(float got, float want) { return std::fabs(got - want) <= 1e-6f * std::fabs(want) + 1e-30f; }
// fp16 bits equal, or one step apart (a scale computed from values a rounding apart)
bool half_ok(uint16_t got, uint16_t want) { return got == want || std::abs(int(got) - int(want)) == 1; }

// Counts of what differs from the layout, by part.
struct Faults {
  int64_t key_params = 0, key_codes = 0, value_scales = 0, value_codes = 0, tails = 0, held = 0, bounds = 0;
  int64_t total() const { return key_params + key_codes + value_scales + value_codes + tails + held + bounds; }
};

// Key group g of sequence s (whole: below its length): each channel's (midpoint, step) (int8, fp32) or
// (minimum, step) (int4, fp16) over the group's keys, and each key's code under the stored ones.
void check_key_group(const World& w, const QuantCache& c, int64_t s, int64_t g, Faults& f) {
  const int64_t G = group_of(c.bits), D = w.D, slot0 = slot_of(w, s, g * G);
  for (int64_t h = 0; h < w.Hkv; ++h)
    for (int64_t d = 0; d < D; ++d) {
      auto key = [&](int64_t j) { return w.keys[s][((g * G + j) * w.Hkv + h) * D + d]; };
      float lo = key(0), hi = key(0);
      for (int64_t j = 1; j < G; ++j) lo = std::min(lo, key(j)), hi = std::max(hi, key(j));
      const int64_t p = ((slot0 / G) * w.Hkv + h) * 2 * D + d;
      if (c.bits == 8) {
        f.key_params += !float_ok(c.kg[p], (lo + hi) * 0.5f) + !float_ok(c.kg[p + D], (hi - lo) * (1.f / 254.f));
      } else {
        const uint16_t min16 = float_to_half(lo);
        const uint16_t step16 = float_to_half(std::min(65504.f, (hi - half_to_float(min16)) * (1.f / 15.f)));
        f.key_params += !half_ok(c.kg4[p], min16) + !half_ok(c.kg4[p + D], step16);
      }
      const float base = group_param(c, slot0, h, 0, d), step = group_param(c, slot0, h, 1, d);
      const float inv = step > 0.f ? 1.f / step : 0.f;
      for (int64_t j = 0; j < G; ++j) {
        const int code = code_of(c, true, (slot0 + j) * w.Hkv + h, d);
        f.key_codes += c.bits == 8 ? !code_ok(code, (key(j) - base) * inv, -127, 127)
                                   : !code_ok(code, (key(j) - base) * inv, 0, 15);
        f.bounds += !(std::fabs(base + step * code - key(j)) <= 0.5f * step + 1e-3f * (1.f + std::fabs(base)));
      }
    }
}

// The value row of sequence s at position p, KV head h: int8 one symmetric scale amax / 127; int4 per block
// of 32 a scale d = -m / 8 (fp16, m its first value of largest magnitude), codes round(v / d) + 8. Each value
// back within half its step (int4: and what lies past 7 steps opposite m).
void check_value_row(const World& w, const QuantCache& c, int64_t s, int64_t p, int64_t h, Faults& f) {
  const int64_t D = w.D, at = slot_of(w, s, p) * w.Hkv + h;
  const float* v = w.values[s].data() + (p * w.Hkv + h) * D;
  for (int64_t b = 0; b < D; b += c.bits == 4 ? 32 : D) {
    const int64_t e = c.bits == 4 ? b + 32 : D;
    float amax = 0.f, m = 0.f;
    for (int64_t d = b; d < e; ++d)
      if (std::fabs(v[d]) > amax) amax = std::fabs(v[d]), m = v[d];
    if (c.bits == 8) f.value_scales += !float_ok(c.vs[at], amax > 0.f ? amax / 127.f : 1.f);
    else f.value_scales += !half_ok(c.vs4[at * (D / 32) + b / 32], float_to_half(m * -0.125f));
    const float step = value_step(c, at, b), inv = step != 0.f ? 1.f / step : 0.f;
    for (int64_t d = b; d < e; ++d) {
      const int code = code_of(c, false, at, d);
      f.value_codes += c.bits == 8 ? !code_ok(code, v[d] * inv, -127, 127) : !code_ok(code, v[d] * inv + 8.f, 0, 15);
      const float clip = c.bits == 4 ? std::max(0.f, std::fabs(v[d]) - 7.f * std::fabs(step)) : 0.f;
      f.bounds += !(std::fabs(value_of(c, at, d) - v[d]) <= 0.5f * std::fabs(step) + clip + 1e-5f * (1.f + std::fabs(step)));
    }
    if (c.bits == 4 && m != 0.f)                       // m itself is code 0 (its block's -8 steps) exactly
      f.value_codes += code_of(c, false, at, std::find(v + b, v + e, m) - v) != 0;
  }
}

// The whole cache against the layout: each sequence's groups below its length, its values (int8 every
// token, int4 its whole groups'), and in its tail the groups its next step may read as floats (those of
// its last step's first and last tokens) holding the true keys (int4: and values) of the tokens written.
Faults check_layout(const World& w, const QuantCache& c) {
  Faults f;
  const int64_t G = group_of(c.bits), width = w.Hkv * w.D;
  for (size_t s = 0; s < w.len.size(); ++s) {
    const int64_t L = w.len[s];
    for (int64_t g = 0; g < L / G; ++g) check_key_group(w, c, s, g, f);
    for (int64_t p = 0; p < (c.bits == 4 ? L / G * G : L); ++p)
      for (int64_t h = 0; h < w.Hkv; ++h) check_value_row(w, c, s, p, h, f);
    if (L == 0) continue;
    for (int64_t g : {w.start[s] / G, (L - 1) / G}) {
      const int64_t half = c.held[2 * s] == g ? 0 : c.held[2 * s + 1] == g ? 1 : -1;
      if (half < 0) {
        ++f.held;
        continue;
      }
      for (int64_t part = 0; part < (c.bits == 4 ? 2 : 1); ++part) {
        const float* tail = c.tails.data() + ((2 * s + half) * (c.bits == 4 ? 2 : 1) + part) * G * width;
        const float* truth = (part ? w.values : w.keys)[s].data();
        for (int64_t p = g * G; p < std::min(L, g * G + G); ++p)
          f.tails += !std::equal(truth + p * width, truth + (p + 1) * width, tail + (p % G) * width);
      }
    }
  }
  return f;
}

// Row of length len of sequence s, query q [Hq, D], as the kernels define it (double sums) over what the
// cache holds: a group below len in its codes (the query against the group's steps rounded to int8), the
// row's own group's keys (int4: and values) as the world's floats; int8 values always as stored.
void attend_ref(const World& w, const QuantCache& c, int64_t s, const float* q, int64_t Hq, int64_t len, float scale,
                int64_t window, float* out) {
  const int64_t D = w.D, G = Hq / w.Hkv, first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  const int64_t KG = group_of(c.bits), whole = len / KG * KG;
  std::vector<double> sc(len), acc(D);
  std::vector<float> qs(D), y(D);
  std::vector<int> xi(D);
  for (int64_t h = 0; h < Hq; ++h) {
    const int64_t hk = h / G;
    for (int64_t d = 0; d < D; ++d) qs[d] = q[h * D + d] * scale;
    double mx = -INFINITY, sum = 0;
    float amax = 0.f, base = 0.f;
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
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t p = first; p < len; ++p) {
      const int64_t at = slot_of(w, s, p) * w.Hkv + hk;
      const double e = std::exp(sc[p] - mx);
      const bool own = c.bits == 4 && p >= whole;
      sum += e;
      for (int64_t d = 0; d < D; ++d) acc[d] += e * (own ? w.values[s][(p * w.Hkv + hk) * D + d] : value_of(c, at, d));
    }
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = static_cast<float>(acc[d] / sum);
  }
}

struct Run {                       // a step's rows of sequence s: positions from .. from + n - 1
  int64_t s, from, n;
};

// One step: the runs' q, k, v rotated and written by rope_and_cache (the world now holds those keys and
// values there; a run from before a sequence's length rewrites it, as after rejected drafts), every row's
// attention against attend_ref, then the whole cache against the layout.
void attend_step(const pw::KernelTable& k, World& w, QuantCache& c, int64_t Hq, const std::vector<Run>& runs,
                 int64_t window, const std::string& name) {
  const int64_t Hkv = w.Hkv, D = w.D, width = Hkv * D, half = D / 2, ld = (Hq + 2 * Hkv) * D;
  int64_t P = 1;
  for (const Run& r : runs) P = std::max(P, r.from + r.n);
  std::vector<float> cs(P * half), sn(P * half);
  for (int64_t p = 0; p < P; ++p)
    for (int64_t i = 0; i < half; ++i) {
      const float a = p * std::pow(10000.f, -2.f * i / D);
      cs[p * half + i] = std::cos(a), sn[p * half + i] = std::sin(a);
    }
  std::vector<int64_t> seq, len, pos, slots, seqs;
  for (const Run& r : runs) {
    seqs.insert(seqs.end(), {r.from, r.n, static_cast<int64_t>(seq.size()), r.s});
    for (int64_t p = r.from; p < r.from + r.n; ++p)
      seq.push_back(r.s), len.push_back(p + 1), pos.push_back(p), slots.push_back(slot_of(w, r.s, p));
  }
  const int64_t T = seq.size();
  auto qkv = randn(T * ld);
  std::vector<float> q(T * Hq * D), fresh(T * width);
  pw::AttentionRows rows{w.tables.data(), w.max_blocks, seq.data(), len.data(), w.bs, window};
  rows.seqs = seqs.data(), rows.num_seqs = static_cast<int64_t>(runs.size());
  k.rope_and_cache(RT, qkv.data(), T, pos.data(), cs.data(), sn.data(), Hq, Hkv, D, slots.data(), rows, c.out(),
                   q.data(), fresh.data());
  for (int64_t t = 0; t < T; ++t) {                     // the step's keys and values: rotated k, v as given
    std::copy(fresh.data() + t * width, fresh.data() + (t + 1) * width, w.keys[seq[t]].data() + pos[t] * width);
    std::copy(qkv.data() + t * ld + (Hq + Hkv) * D, qkv.data() + (t + 1) * ld, w.values[seq[t]].data() + pos[t] * width);
  }
  for (const Run& r : runs) w.start[r.s] = r.from, w.len[r.s] = r.from + r.n;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  std::vector<float> out(T * Hq * D), want(T * Hq * D);
  k.paged_attention(RT, q.data(), T, Hq, c.reader(fresh.data(), qkv.data() + (Hq + Hkv) * D, ld), rows, scale,
                    out.data());
  for (int64_t t = 0; t < T; ++t)
    attend_ref(w, c, seq[t], q.data() + t * Hq * D, Hq, len[t], scale, window, want.data() + t * Hq * D);
  // int4: a query value on a tie of its int8 rounding against a group's steps may round either way in the
  // kernel and here (one code: an output ~1e-3 off; a wrong group or scale is off by tenths)
  check_close(name + ": attention", out.data(), want.data(), out.size(), 1e-4f, c.bits == 4 ? 2e-3f : 5e-5f);
  const Faults f = check_layout(w, c);
  check(name + ": the writer's layout", f.total() == 0);
  if (f.total())
    std::printf("  faults: key params %lld, key codes %lld, value scales %lld, value codes %lld, tails %lld, held %lld, "
                "out of bounds %lld\n", (long long)f.key_params, (long long)f.key_codes, (long long)f.value_scales,
                (long long)f.value_codes, (long long)f.tails, (long long)f.held, (long long)f.bounds);
}

std::string label(int bits, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs) {
  char name[96];
  std::snprintf(name, sizeof name, "int%d cache Hq=%lld Hkv=%lld D=%lld bs=%lld", bits, (long long)Hq,
                (long long)Hkv, (long long)D, (long long)bs);
  return name;
}

}  // namespace

void test_kv_attention(const pw::KernelTable& k, int bits, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs,
                       const std::vector<int64_t>& query_lens, const std::vector<int64_t>& context_lens,
                       int64_t window) {
  World w = make_world(bs, Hkv, D, context_lens);
  const int64_t nseq = query_lens.size();
  QuantCache c(static_cast<int64_t>(w.tables.size()) * bs, Hkv, D, nseq, bits);
  std::vector<Run> runs;
  for (int64_t s = 0; s < nseq; ++s) {
    write_history(k, w, c, s, context_lens[s] - query_lens[s]);
    runs.push_back({s, context_lens[s] - query_lens[s], query_lens[s]});
  }
  std::string name = label(bits, Hq, Hkv, D, bs) + " rows";
  for (int64_t s = 0; s < nseq; ++s) name += " " + std::to_string(query_lens[s]) + "@" + std::to_string(context_lens[s]);
  attend_step(k, w, c, Hq, runs, window, name + (window ? " window=" + std::to_string(window) : ""));
}

void test_kv_verify(const pw::KernelTable& k, int bits, int64_t Hq, int64_t Hkv, int64_t D) {
  const int64_t G = group_of(bits), a = G - 3, b = 2 * G + 5;
  World w = make_world(G, Hkv, D, {3 * G, 3 * G});     // sequence 0 speculates, 1 decodes beside it
  QuantCache c(static_cast<int64_t>(w.tables.size()) * G, Hkv, D, 2, bits);
  write_history(k, w, c, 0, a);
  write_history(k, w, c, 1, b);
  const std::string name = label(bits, Hq, Hkv, D, G) + " verify: ";
  // 5 drafts from 3 before a group's end: its later rows read the group filled with drafts, quantized
  attend_step(k, w, c, Hq, {{0, a, 6}, {1, b, 1}}, 0, name + "drafts across a group's end");
  // all rejected: back inside the group, read as floats from the tail again
  attend_step(k, w, c, Hq, {{0, a + 1, 1}, {1, b + 1, 1}}, 0, name + "after every draft was rejected");
  // drafts again: the group filled anew with other keys
  attend_step(k, w, c, Hq, {{0, a + 2, 5}, {1, b + 2, 1}}, 0, name + "a second verify refills the group");
  // two accepted: past the group's end
  attend_step(k, w, c, Hq, {{0, a + 5, 1}, {1, b + 3, 1}}, 0, name + "two accepted");
}

}  // namespace kt
