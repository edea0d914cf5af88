// phasewise's quantized linear layers: y[M, N] = x[M, K] @ W^T (+ bias), written once over the vector
// layer (vec/vec.h), whose int8 dot products are the per-ISA part (VNNI, AVX2, NEON, generic).
//
// Block math and register tiles: quant_tile.h.
//
// Layout (python: kernels/quant.py packs it): output rows in tiles of 16, one vector lane per row.
// blocks [N/16, K/32, BB] u8, per (tile, block) one run of bytes (a tile streams in one sequence):
//   the quants as 64-byte chunks of 16 rows x 4 consecutive k,
//     Q4, K4: 4 chunks, chunk j's low nibbles are k = 4j..4j+3, its high nibbles k = 16+4j..16+4j+3;
//     Q5: Q4's 4 chunks of the low 4 bits, then 64 bytes whose bit g is the fifth bit of k = 4g..4g+3
//       at the same byte of a chunk;
//     the bytes (and U5): 8 chunks, chunk g holds k = 4g..4g+3;
//   then the 16 rows' scales (kernels.h, block_bytes). scale [N/16 * 16] fp32 (I8).
// Q5 streams 5.5 bits a weight from memory: from UNPACK_ROWS rows a thread unpacks a tile's blocks
// to bytes (U5, in L1/L2) before its rows pass over them; fewer rows put each chunk's bytes together
// in registers (AVX2: 4 chunks of 5-bit bytes summed in int16 before a widening, 6-bit bytes 2).
#include "core.h"
#include "parallel.h"
#include "quant_tile.h"
#include "vec/vec.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace pw {
namespace {

// Q5 tiles t0 .. t0 + nv - 1 as U5 in buf [nv, KB, block_bytes(U5)]: each weight's nibble and fifth
// bit in one byte, the scales after them; the next nv tiles' bytes are fetched into L2 meanwhile.
inline void unpack_q5(const Weights& w, int64_t t0, int64_t nv, uint8_t* buf) {
  constexpr int64_t QB = quant_bytes(Q5), BB = block_bytes(Q5), UB = block_bytes(U5);
  const uint8_t* next = w.qs + (t0 + nv) * w.KB * BB;
  const uint8_t* end = w.qs + w.NT * w.KB * BB;
  for (int64_t i = 0; i < nv * w.KB; ++i) {          // block i of the run of tiles
    for (int64_t off = i * BB; off < (i + 1) * BB; off += 64)
      if (next + off < end) prefetch_l2(next + off);
    const uint8_t* src = w.qs + (t0 * w.KB + i) * BB;
    uint8_t* dst = buf + i * UB;
    const Vb fifth = Vb::load(src + Q5_FIFTH);
    for_each_j<4>([&](auto J) {
      constexpr int j = decltype(J)::value;
      Vb lo, hi;
      q5_chunk<j>(src, fifth, lo, hi);
      lo.store(dst + 64 * j);
      hi.store(dst + 64 * (j + 4));
    });
    std::memcpy(dst + 512, src + QB, UB - 512);
  }
}

// Q6K tiles t0 .. t0 + nv - 1 as K6 in buf [nv, KB, block_bytes(K6)]: bytes u = q + 32 from the
// nibbles and the high pairs, d from the super-block's fp16, sc as int16, m = 0 (w = d sc_h q).
// From UNPACK_ROWS rows K6's tiles run over it (from L1/L2); the next tiles stream into L2.
// Fewer rows (decode) take Q6K in place: unpacking through memory made its GEMV compute-bound
// (13-14 GB/s where k4 streams 25).
inline void unpack_q6k(const Weights& w, int64_t t0, int64_t nv, uint8_t* buf) {
  constexpr int64_t QB = quant_bytes(Q6K), BB = block_bytes(Q6K), UB = block_bytes(K6), KQ = quant_bytes(K6);
  const uint8_t* next = w.qs + (t0 + nv) * w.KB * BB;
  const uint8_t* end = w.qs + w.NT * w.KB * BB;
  for (int64_t i = 0; i < nv * w.KB; ++i) {          // block i of the run of tiles
    for (int64_t off = i * BB; off < (i + 1) * BB; off += 64)
      if (next + off < end) prefetch_l2(next + off);
    const int64_t t = t0 + i / w.KB, b = i % w.KB;
    const uint8_t* src = w.qs + (t * w.KB + b) * BB;
    uint8_t* dst = buf + i * UB;
    const Vb low = Vb::load(src + 256), high = Vb::load(src + 320);   // pairs of chunks 0..3, 4..7
    for_each_j<4>([&](auto J) {
      constexpr int j = decltype(J)::value;
      const Vb raw = Vb::load(src + 64 * j);
      with_high2<j>(lo4(raw), low).store(dst + 64 * j);
      with_high2<j>(hi4(raw), high).store(dst + 64 * (j + 4));
    });
    Vf::from_f16(w.super + (t * (w.KB / K4_SUPER) + b / K4_SUPER) * 16).store(reinterpret_cast<float*>(dst + KQ));
    int16_t sc[32];
    for (int r = 0; r < 32; ++r) sc[r] = static_cast<int8_t>(src[QB + r]);
    std::memcpy(dst + KQ + 64, sc, sizeof sc);
    std::memset(dst + KQ + 128, 0, 64);
  }
}

constexpr int64_t MCHUNK = 128;
constexpr int64_t UNPACK_ROWS = 8;        // from this many rows Q5 (Q6K) tiles are unpacked to U5 (K6) once

// Tiles t0 .. t0 + nv - 1 unpacked to format U in this thread's buffer, then rows_kernel<U> over them.
template <Fmt U, typename Unpack>
inline void run_unpacked(const Act& chunk, int64_t rows, const Weights& w, int64_t t0, int64_t nv, const float* bias,
                         float* o, int64_t ldo, const Unpack& unpack) {
  thread_local std::vector<uint8_t> buf;
  if (static_cast<int64_t>(buf.size()) < NVB * w.KB * block_bytes(U)) buf.resize(NVB * w.KB * block_bytes(U));
  unpack(w, t0, nv, buf.data());
  const Weights u{buf.data(), nullptr, w.KB, block_bytes(U), std::min<int64_t>(w.N - 16 * t0, 16 * nv), nv};
  const float* b = bias ? bias + 16 * t0 : nullptr;
  if (nv == NVB) rows_kernel<U, NVB>(chunk, rows, u, 0, b, o + 16 * t0, ldo);
  else for (int64_t t = 0; t < nv; ++t) rows_kernel<U, 1>(chunk, rows, u, t, b, o + 16 * t0, ldo);
}
// Tiles t0 .. t0 + nv - 1 (nv <= NVB) of w for `rows` rows of activations: Q5 and Q6K unpacked once
// from UNPACK_ROWS rows, every other case in place.
template <Fmt F>
inline void run_group(const Act& chunk, int64_t rows, const Weights& w, int64_t t0, int64_t nv, const float* bias,
                      float* o, int64_t ldo) {
  if constexpr (F == Q5 || F == Q6K) {
    if (rows >= UNPACK_ROWS) {      // the group's tiles unpacked once, then every row over them
      if constexpr (F == Q5) run_unpacked<U5>(chunk, rows, w, t0, nv, bias, o, ldo, unpack_q5);
      else run_unpacked<K6>(chunk, rows, w, t0, nv, bias, o, ldo, unpack_q6k);
      return;
    }                               // fewer: in place, each chunk put together in registers
  }
  if (nv == NVB) rows_kernel<F, NVB>(chunk, rows, w, t0, bias, o, ldo);
  else for (int64_t t = t0; t < t0 + nv; ++t) rows_kernel<F, 1>(chunk, rows, w, t, bias, o, ldo);
}

// Rows go in chunks of MCHUNK (activations and outputs of a chunk stay in L2 while every tile
// pair of the weight passes over them). Threads split the pairs of tiles once and each walks the
// chunks over its own pairs: chunks write disjoint rows, so no barrier between them (one per
// chunk cost a 512-token prefill a few percent in waits).
template <Fmt F>
void run(const Runtime& rt, const Act& a, int64_t M, const Weights& w, const float* bias, float* out, int64_t ldo) {
  const int64_t NT = w.NT, groups = (NT + NVB - 1) / NVB;  // NVB tiles, the last group maybe one
  parallel_for(rt, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += MCHUNK) {
      const int64_t rows = std::min<int64_t>(MCHUNK, M - m0);
      const Act chunk{a.xq + m0 * a.K, a.dx + m0 * a.KB, a.sx + m0 * a.KB, a.sl + m0 * a.KB, a.K, a.KB};
      for (int64_t g = begin; g < end; ++g)
        run_group<F>(chunk, rows, w, NVB * g, std::min<int64_t>(NVB, NT - NVB * g), bias, out + m0 * ldo, ldo);
    }
  });
}

struct Scratch {  // a thread's quantized activations, reused from call to call
  std::vector<int8_t> xq;
  std::vector<float> dx, sx, sl;
};


// One part's rows: y[:, :pw.N] (row stride ldo) of x W^T + bias.
void run_part(const Runtime& rt, const Act& a, int64_t M, const PackedWeights& pw, const float* bias, float* y,
              int64_t ldo) {
  const int64_t KB = a.KB, N = pw.N;
  const Weights w{pw.blocks, pw.scale, KB, block_bytes(pw.fmt), pw.N, pw.NT, pw.super};
  switch (pw.fmt) {
    case Q4: run<Q4>(rt, a, M, w, bias, y, ldo); break;
    case Q8:
      if (pw.u5_tiles > 0) {          // the U5 tiles, then the Q8 ones from tile u5 on: two regions
        const int64_t u5 = pw.u5_tiles, n5 = std::min(N, 16 * u5);
        run<U5>(rt, a, M, Weights{w.qs, nullptr, KB, w.BB, n5, u5}, bias, y, ldo);
        if (u5 < pw.NT)
          run<Q8>(rt, a, M, Weights{w.qs + u5 * KB * w.BB, nullptr, KB, w.BB, N - n5, pw.NT - u5},
                  bias ? bias + n5 : nullptr, y + n5, ldo);
      } else {
        run<Q8>(rt, a, M, w, bias, y, ldo);
      }
      break;
    case I8: run<I8>(rt, a, M, w, bias, y, ldo); break;
    case K4: run<K4>(rt, a, M, w, bias, y, ldo); break;
    case K8: run<K8>(rt, a, M, w, bias, y, ldo); break;
    case Q5: run<Q5>(rt, a, M, w, bias, y, ldo); break;
    case K6: run<K6>(rt, a, M, w, bias, y, ldo); break;
    case Q6K: run<Q6K>(rt, a, M, w, bias, y, ldo); break;
    case U5: break;                   // not a packed format (kernels.h)
  }
}

}  // namespace

int64_t linear_tile_group() { return NVB; }

void linear_tiles(const QuantizedRows& x, int64_t rows, const PackedWeights& pw, int64_t t0, int64_t nv, float* out,
                  int64_t ldo) {
  const int64_t KB = x.K / QK;
  const Weights w{pw.blocks, pw.scale, KB, block_bytes(pw.fmt), pw.N, pw.NT, pw.super};
  for (int64_t m0 = 0; m0 < rows; m0 += MCHUNK) {
    const Act a{x.xq + m0 * x.K, x.dx + m0 * KB, x.sx + m0 * KB, x.sl + m0 * KB, x.K, KB};
    const int64_t n = std::min<int64_t>(MCHUNK, rows - m0);
    float* o = out + m0 * ldo;
    switch (pw.fmt) {
      case Q4: run_group<Q4>(a, n, w, t0, nv, nullptr, o, ldo); break;
      case Q8: run_group<Q8>(a, n, w, t0, nv, nullptr, o, ldo); break;
      case I8: run_group<I8>(a, n, w, t0, nv, nullptr, o, ldo); break;
      case K4: run_group<K4>(a, n, w, t0, nv, nullptr, o, ldo); break;
      case K8: run_group<K8>(a, n, w, t0, nv, nullptr, o, ldo); break;
      case Q5: run_group<Q5>(a, n, w, t0, nv, nullptr, o, ldo); break;
      case K6: run_group<K6>(a, n, w, t0, nv, nullptr, o, ldo); break;
      case Q6K: run_group<Q6K>(a, n, w, t0, nv, nullptr, o, ldo); break;
      case U5: break;
    }
  }
}

// y [M, N] = x [M, K] @ W^T + bias, W packed as described at the top (N rows of NT * 16), its rows
// continued by pw.next's in another format (a fused projection of mixed parts): N the sum. The
// activations are quantized once for the parts of each grouping (per 32, per 256) they need.
void quant_linear(const Runtime& rt, const float* x, int64_t M, int64_t K, const PackedWeights& pw,
                  const float* bias, float* y) {
  if (M == 0) return;
  const int64_t KB = K / QK;
  int64_t N = 0;
  bool need[2] = {false, false}, half_sums[2] = {false, false};   // [super]: quantized that way; biased halves' sums
  for (const PackedWeights* p = &pw; p != nullptr; p = p->next) {
    const bool sup = super_activations(p->fmt);
    N += p->N;
    need[sup] = true;
    half_sums[sup] |= p->fmt == K6 || p->fmt == Q6K || (p->fmt == K8 && Q8_BIASED);
  }
  thread_local Scratch own[2];
  Act acts[2] = {};
  for (int sup = 0; sup < 2; ++sup) {
    if (!need[sup]) continue;
    auto reserve = [&] {
      Scratch& o = own[sup];
      if (static_cast<int64_t>(o.xq.size()) < M * K) o.xq.resize(M * K);
      if (static_cast<int64_t>(o.dx.size()) < M * KB) o.dx.resize(M * KB), o.sx.resize(M * KB), o.sl.resize(M * KB);
      return &o;
    };
    // each thread of a team quantizes a few rows itself (no barrier); otherwise a team shares one thread's buffers
    const bool alone = rt.team && M * KB <= QUANT_GRAIN;
    Scratch* scratch = alone ? reserve() : team_once<Scratch>(rt, reserve);
    quantize_rows(alone ? Runtime{1} : rt, x, M, K, scratch->xq.data(), scratch->dx.data(), scratch->sx.data(),
                  half_sums[sup] ? scratch->sl.data() : nullptr, sup);
    acts[sup] = Act{scratch->xq.data(), scratch->dx.data(), scratch->sx.data(), scratch->sl.data(), K, KB};
  }
  int64_t n0 = 0;
  for (const PackedWeights* p = &pw; p != nullptr; n0 += p->N, p = p->next)
    run_part(rt, acts[super_activations(p->fmt)], M, *p, bias ? bias + n0 : nullptr, y + n0, N);
}

}  // namespace pw
