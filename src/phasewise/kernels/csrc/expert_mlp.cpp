// A mixture-of-experts MLP over packed weights (kernels.h ExpertWeights): each row's k chosen experts,
// SwiGLU each, summed with the router's weights; and the router's choice (moe_route, at the end).
//
// The step's (row, choice) pairs are sorted by expert (a counting sort: by expert, then row, then
// choice), so each chosen expert's rows sit together: its weight tiles are read once for all of them
// and an expert no row chose is never read. The phases, each one parallel pass:
//   1. x quantized once per row (per grouping the gate and up formats need), gathered into that order;
//   2. gate and up: jobs of (expert, part, group of tiles) over the expert's rows -> h [S, 2 I];
//   3. act = silu(gate) up -> [S, I], quantized for down; 4. down -> y [S, H];
//   5. out[t] = sum over j = 0 .. k - 1 of weights[t, j] y[slot(t, j)], in that order.
// Threads take jobs in contiguous runs of equal cost (rows + a weight pass), not equal counts: in a
// prefill the experts' row counts differ many times over. Every output row is computed by the same
// operations whatever the other rows (linear_tiles' guarantee, row-wise quantization, a fixed order
// of the k terms), so results are bit-identical alone, batched or chunked.
#include "core.h"
#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace pw {
namespace {

struct Quantized {          // rows quantized for one grouping, in buffers reused from call to call
  std::vector<int8_t> xq;
  std::vector<float> dx, sx, sl;
  int64_t K = 0;

  void reserve(int64_t M, int64_t k) {      // serial: before any pass that fills these rows
    K = k;
    if (static_cast<int64_t>(xq.size()) < M * K) xq.resize(M * K);
    if (static_cast<int64_t>(dx.size()) < M * K / QK) dx.resize(M * K / QK), sx.resize(M * K / QK), sl.resize(M * K / QK);
  }
  void quantize(const Runtime& rt, const float* x, int64_t M, bool super) {
    quantize_rows(rt, x, M, K, xq.data(), dx.data(), sx.data(), sl.data(), super);
  }
  // row i of this = row rows[i] of src, i < n
  void gather(const Runtime& rt, const Quantized& src, const int64_t* rows, int64_t n) {
    const int64_t KB = K / QK;
    parallel_for(rt, n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = rows[i];
        std::memcpy(xq.data() + i * K, src.xq.data() + r * K, K);
        std::memcpy(dx.data() + i * KB, src.dx.data() + r * KB, KB * sizeof(float));
        std::memcpy(sx.data() + i * KB, src.sx.data() + r * KB, KB * sizeof(float));
        std::memcpy(sl.data() + i * KB, src.sl.data() + r * KB, KB * sizeof(float));
      }
    });
  }
  QuantizedRows at(int64_t row) const {
    const int64_t KB = K / QK;
    return {xq.data() + row * K, dx.data() + row * KB, sx.data() + row * KB, sl.data() + row * KB, K};
  }
};

// Expert e's `rows` rows of a stacked weight: its own run of whole tiles.
PackedWeights expert_part(const PackedWeights& w, int64_t e, int64_t rows) {
  const int64_t nt = rows / 16;
  PackedWeights p = w;
  p.blocks = w.blocks + e * nt * w.KB * block_bytes(w.fmt);
  if (w.scale) p.scale = w.scale + e * nt * 16;
  if (w.super) p.super = w.super + e * nt * (w.KB / K4_SUPER) * super_halves(w.fmt);
  p.N = rows, p.NT = nt, p.u5_tiles = 0, p.next = nullptr;
  return p;
}

// out[0..n) = softmax(x[0..n)) in fp32 (out may be x)
void softmax(const float* x, int64_t n, float* out) {
  float mx = x[0];
  for (int64_t i = 1; i < n; ++i) mx = std::max(mx, x[i]);
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += (out[i] = std::exp(x[i] - mx));
  for (int64_t i = 0; i < n; ++i) out[i] /= sum;
}

struct Job {                // a group of tiles of one part of one expert, over all that expert's rows
  int64_t e, part, t0, nv;
};

// Jobs for the chosen experts (rows[e] > 0) through `parts` parts of NT tiles each; each job's cost
// start[] (rows + WEIGHT_COST, a weight pass counted as that many rows) for the threads' split.
constexpr int64_t WEIGHT_COST = 8;
void make_jobs(const std::vector<int64_t>& rows, int64_t parts, int64_t NT, std::vector<Job>& jobs,
               std::vector<int64_t>& start) {
  const int64_t G = linear_tile_group();
  jobs.clear(), start.clear();
  int64_t cost = 0;
  for (int64_t e = 0; e < static_cast<int64_t>(rows.size()); ++e) {
    if (!rows[e]) continue;
    for (int64_t p = 0; p < parts; ++p)
      for (int64_t t0 = 0; t0 < NT; t0 += G) {
        jobs.push_back({e, p, t0, std::min(G, NT - t0)});
        start.push_back(cost);
        cost += rows[e] + WEIGHT_COST;
      }
  }
  start.push_back(cost);
}

// f(job) for every job, thread i taking the jobs whose cost starts in its i-th share of the total.
template <typename F>
void run_jobs(const Runtime& rt, const std::vector<Job>& jobs, const std::vector<int64_t>& start, const F& f) {
  const int64_t n = jobs.size(), total = start.back();
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(rt.threads, n));
  parallel_for(rt, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t th = begin; th < end; ++th) {
      const int64_t lo = total * th / threads, hi = total * (th + 1) / threads;
      int64_t j = std::lower_bound(start.begin(), start.begin() + n, lo) - start.begin();
      for (; j < n && start[j] < hi; ++j) f(jobs[j]);
    }
  });
}

struct Scratch {            // one call's buffers, reused from call to call
  Quantized x[2], gathered[2], act;
  std::vector<int64_t> count, first, next, slot, row;
  std::vector<float> h, a, y;
  std::vector<Job> jobs;
  std::vector<int64_t> start;
  bool used[2] = {false, false};   // which activation groupings gate and up take (super-blocks or not)

  // Serial: the (row, choice) pairs by expert (slot[t k + j] is pair (t, j)'s place in that order,
  // row[place] its row t), every buffer sized, gate and up's jobs.
  void plan(int64_t T, const int64_t* ids, int64_t k, const ExpertWeights& ex) {
    const int64_t E = ex.E, I = ex.I, H = ex.H, S = T * k;
    count.assign(E, 0);
    for (int64_t i = 0; i < S; ++i) ++count[ids[i]];
    first.assign(E + 1, 0);
    for (int64_t e = 0; e < E; ++e) first[e + 1] = first[e] + count[e];
    slot.resize(S), row.resize(S);
    next.assign(first.begin(), first.end() - 1);
    for (int64_t i = 0; i < S; ++i) {
      const int64_t place = next[ids[i]]++;
      slot[i] = place, row[place] = i / k;
    }
    used[0] = used[1] = false;
    for (const PackedWeights* p : {&ex.gate, &ex.up}) used[super_activations(p->fmt)] = true;
    for (int g = 0; g < 2; ++g)
      if (used[g]) x[g].reserve(T, H), gathered[g].reserve(S, H);
    act.reserve(S, I);
    if (static_cast<int64_t>(h.size()) < S * 2 * I) h.resize(S * 2 * I);
    if (static_cast<int64_t>(a.size()) < S * I) a.resize(S * I);
    if (static_cast<int64_t>(y.size()) < S * H) y.resize(S * H);
    make_jobs(count, 2, I / 16, jobs, start);
  }
};

}  // namespace

// In a team (the decoder stack's region) every thread makes this call: they share one thread's
// scratch, the serial steps run on one thread and each pass ends at the team's barrier.
void expert_mlp(const Runtime& rt, const float* x, int64_t T, const int64_t* ids, const float* weights, int64_t k,
                const ExpertWeights& ex, float* out) {
  if (T == 0) return;
  const int64_t I = ex.I, H = ex.H, S = T * k;
  Scratch& s = *team_once<Scratch>(rt, [] {
    thread_local Scratch own;
    return &own;
  });
  team_serial(rt, [&] { s.plan(T, ids, k, ex); });
  // 1. x quantized once per grouping, gathered into the pairs' order
  for (int g = 0; g < 2; ++g)
    if (s.used[g]) s.x[g].quantize(rt, x, T, g), s.gathered[g].gather(rt, s.x[g], s.row.data(), S);
  // 2. gate | up -> h [S, 2 I]
  const PackedWeights* gate_up[2] = {&ex.gate, &ex.up};
  run_jobs(rt, s.jobs, s.start, [&](const Job& j) {
    const PackedWeights& w = *gate_up[j.part];
    const QuantizedRows rows = s.gathered[super_activations(w.fmt)].at(s.first[j.e]);
    linear_tiles(rows, s.count[j.e], expert_part(w, j.e, I), j.t0, j.nv, s.h.data() + s.first[j.e] * 2 * I + j.part * I,
                 2 * I);
  });
  // 3. the gated activations, quantized for down
  (ex.gelu ? gelu_and_mul : silu_and_mul)(rt, s.h.data(), S, I, s.a.data());
  s.act.quantize(rt, s.a.data(), S, super_activations(ex.down.fmt));
  // 4. down -> y [S, H]
  team_serial(rt, [&] { make_jobs(s.count, 1, H / 16, s.jobs, s.start); });
  run_jobs(rt, s.jobs, s.start, [&](const Job& j) {
    linear_tiles(s.act.at(s.first[j.e]), s.count[j.e], expert_part(ex.down, j.e, H), j.t0, j.nv,
                 s.y.data() + s.first[j.e] * H, H);
  });
  // 5. each row's k terms in the router's order
  parallel_for(rt, T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* o = out + t * H;
      for (int64_t j = 0; j < k; ++j) {
        const float wj = weights[t * k + j];
        const float* yj = s.y.data() + s.slot[t * k + j] * H;
        if (j == 0) {
#pragma omp simd
          for (int64_t c = 0; c < H; ++c) o[c] = wj * yj[c];
        } else {
#pragma omp simd
          for (int64_t c = 0; c < H; ++c) o[c] += wj * yj[c];
        }
      }
    }
  });
}

// Each row alone: a softmax in fp32 (max first, exp, the sum in index order), then the k largest by
// insertion (a value enters before the first smaller one, so ties keep the lower id first).
void moe_route(const Runtime& rt, const float* logits, int64_t T, int64_t E, int64_t k, bool renorm, bool topk_softmax,
               float* weights, int64_t* ids) {
  parallel_for(rt, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> p(E);
    for (int64_t t = begin; t < end; ++t) {
      const float* l = logits + t * E;
      float* w = weights + t * k;
      int64_t* id = ids + t * k;
      if (!topk_softmax) softmax(l, E, p.data());
      const float* score = topk_softmax ? l : p.data();
      int64_t n = 0;
      for (int64_t e = 0; e < E; ++e) {
        if (n == k && !(score[e] > w[k - 1])) continue;
        int64_t i = n < k ? n++ : k - 1;
        for (; i > 0 && score[e] > w[i - 1]; --i) w[i] = w[i - 1], id[i] = id[i - 1];
        w[i] = score[e], id[i] = e;
      }
      if (topk_softmax) {
        softmax(w, k, w);
      } else if (renorm) {
        float sum = 0.f;
        for (int64_t j = 0; j < k; ++j) sum += w[j];
        for (int64_t j = 0; j < k; ++j) w[j] /= sum;
      }
    }
  });
}

}  // namespace pw
