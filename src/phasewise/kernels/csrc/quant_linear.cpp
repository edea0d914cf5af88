// phasewise's quantized linear layers on AVX-512 VNNI: y[M, N] = x[M, K] @ W^T (+ bias).
//
// Activations are quantized per block of 32 values (symmetric int8, own fp32 scale dx, and
// sx = dx * sum(xq) for the weight offsets); weight blocks of 32 along K are unsigned bytes, so
// `vpdpbusd` (u8 x s8 -> s32, 4 products per lane) takes them as they are:
//   Q4 (GGUF Q4_1, and Q4_0 with m = -8 d):  w = d q + m,        q in 0..15, d, m fp16 per block
//   Q8 (GGUF Q8_0):                          w = d (u - 128),    u = q + 128, d fp16 per block
//   I8 (our per-channel int8):               w = s_n (u - 128),  s_n fp32 per output row
// so a block contributes d (dx acc) + m sx, with acc = sum(u xq) and m = -128 d for the bytes.
//
// Layout (python: kernels/quant.py packs it): output rows in tiles of 16, one zmm lane per row.
// blocks [N/16, K/32, BB] u8, per (tile, block) one run of bytes (a tile streams in one sequence):
//   the quants as 64-byte chunks of 16 rows x 4 consecutive k,
//     Q4: 4 chunks, chunk j's low nibbles are k = 4j..4j+3, its high nibbles k = 16+4j..16+4j+3;
//     Q8, I8: 8 chunks, chunk g holds k = 4g..4g+3;
//   then the 16 rows' d as fp16 (Q4, Q8), then their m (Q4). BB = 320 (Q4), 544 (Q8), 512 (I8).
// scale [N/16 * 16] fp32 (I8).
#include "ops.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
bool has_vnni() { return true; }

namespace {

enum Fmt : int64_t { Q4 = 0, Q8 = 1, I8 = 2 };
constexpr int64_t QK = 32;  // values per block
#ifndef PW_MTB
#define PW_MTB 4
#endif
constexpr int MTB = PW_MTB;

struct Act {          // quantized activations
  const int8_t* xq;   // [M, K]
  const float* dx;    // [M, KB]
  const float* sx;    // [M, KB]
  int64_t K, KB;
};

constexpr int64_t quant_bytes(Fmt F) { return F == Q4 ? 256 : 512; }
constexpr int64_t block_bytes(Fmt F) { return F == Q4 ? 320 : F == Q8 ? 544 : 512; }

struct Weights {
  const uint8_t* qs;      // [NT, KB, BB]
  const float* scale;     // [NT * 16] (I8)
  int64_t KB, BB;
  int64_t N;              // output features (the last tile may be partly padding)
  int64_t NT;             // tiles of 16 rows
};

// One row of 32 floats -> 32 int8 (round to nearest even), dx and sx of the block.
inline void quantize_block(const float* x, int8_t* q, float* dx, float* sx) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  const __m512 vid = _mm512_set1_ps(id);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, vid));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, vid));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  *dx = amax / 127.f;
  *sx = *dx * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
}

inline __m512i bcast4(const int8_t* p) {  // 4 activation bytes to every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

inline __m512 load_half16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// MT activation rows from m0 x NV tiles of 16 output rows from tile t0: out[m0.., 16 t0..].
template <Fmt F, int MT, int NV>
inline void tile_kernel(const Act& a, int64_t m0, const Weights& w, int64_t t0, const float* bias,
                        float* out, int64_t ldo) {
  __m512 r[MT][NV];
  for (int i = 0; i < MT; ++i)
    for (int v = 0; v < NV; ++v) r[i][v] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  // The first row tile of a chunk fetches the next NV tiles' bytes into L2 as it goes, one block
  // of each per step: few rows make this a stream from DRAM, and the next tiles start elsewhere.
  const uint8_t* next = m0 == 0 ? w.qs + (t0 + NV) * w.KB * block_bytes(F) : nullptr;
  const uint8_t* next_end = w.qs + w.NT * w.KB * block_bytes(F);
  for (int64_t b = 0; b < w.KB; ++b) {
    if (next != nullptr)
      for (int64_t off = b * NV * block_bytes(F); off < (b + 1) * NV * block_bytes(F); off += 64)
        if (next + off < next_end) _mm_prefetch(reinterpret_cast<const char*>(next + off), _MM_HINT_T1);
    __m512i acc[MT][NV];
    for (int i = 0; i < MT; ++i)
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_si512();
    const int8_t* xb = a.xq + m0 * a.K + b * QK;
    if constexpr (F == Q4) {
      for (int j = 0; j < 4; ++j) {
        __m512i lo[NV], hi[NV];
        for (int v = 0; v < NV; ++v) {
          const __m512i raw = _mm512_loadu_si512(w.qs + ((t0 + v) * w.KB + b) * block_bytes(F) + j * 64);
          lo[v] = _mm512_and_si512(raw, low4);
          hi[v] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        }
        for (int i = 0; i < MT; ++i) {
          const __m512i xl = bcast4(xb + i * a.K + 4 * j), xh = bcast4(xb + i * a.K + 16 + 4 * j);
          for (int v = 0; v < NV; ++v) {
            acc[i][v] = _mm512_dpbusd_epi32(acc[i][v], lo[v], xl);
            acc[i][v] = _mm512_dpbusd_epi32(acc[i][v], hi[v], xh);
          }
        }
      }
    } else {
      for (int g = 0; g < 8; ++g) {
        __m512i u[NV];
        for (int v = 0; v < NV; ++v)
          u[v] = _mm512_loadu_si512(w.qs + ((t0 + v) * w.KB + b) * block_bytes(F) + g * 64);
        for (int i = 0; i < MT; ++i) {
          const __m512i x = bcast4(xb + i * a.K + 4 * g);
          for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbusd_epi32(acc[i][v], u[v], x);
        }
      }
    }
    // Block epilogue: r += d (dx acc) + m sx (Q4), d (dx acc - 128 sx) (Q8), dx acc (I8).
    for (int v = 0; v < NV; ++v) {
      const uint8_t* scales = w.qs + ((t0 + v) * w.KB + b) * block_bytes(F) + quant_bytes(F);
      __m512 dv, mv;
      if constexpr (F != I8) dv = load_half16(reinterpret_cast<const at::Half*>(scales));
      if constexpr (F == Q4) mv = load_half16(reinterpret_cast<const at::Half*>(scales + 32));
      for (int i = 0; i < MT; ++i) {
        const int64_t xi = (m0 + i) * a.KB + b;
        const __m512 accf = _mm512_cvtepi32_ps(acc[i][v]);
        const __m512 dx = _mm512_set1_ps(a.dx[xi]);
        if constexpr (F == Q4) {
          r[i][v] = _mm512_fmadd_ps(_mm512_mul_ps(accf, dx), dv, r[i][v]);
          r[i][v] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.sx[xi]), r[i][v]);
        } else if constexpr (F == Q8) {
          const __m512 t = _mm512_fmadd_ps(accf, dx, _mm512_set1_ps(-128.f * a.sx[xi]));
          r[i][v] = _mm512_fmadd_ps(t, dv, r[i][v]);
        } else {
          r[i][v] = _mm512_fmadd_ps(accf, dx, r[i][v]);
        }
      }
    }
  }
  for (int i = 0; i < MT; ++i) {
    float off = 0.f;  // I8: sum over blocks of -128 sx, then the row scale
    if constexpr (F == I8)
      for (int64_t b = 0; b < w.KB; ++b) off -= 128.f * a.sx[(m0 + i) * a.KB + b];
    for (int v = 0; v < NV; ++v) {
      const int64_t n0 = (t0 + v) * 16;
      const __mmask16 keep = n0 + 16 <= w.N ? 0xFFFF : static_cast<__mmask16>((1u << (w.N - n0)) - 1);
      __m512 y = r[i][v];
      if constexpr (F == I8)
        y = _mm512_mul_ps(_mm512_add_ps(y, _mm512_set1_ps(off)), _mm512_loadu_ps(w.scale + n0));
      if (bias) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(keep, bias + n0));
      _mm512_mask_storeu_ps(out + (m0 + i) * ldo + n0, keep, y);
    }
  }
}

template <Fmt F, int NV>
inline void rows_kernel(const Act& a, int64_t M, const Weights& w, int64_t t0, const float* bias, float* out,
                        int64_t ldo) {
  int64_t m0 = 0;
  for (; m0 + MTB <= M; m0 += MTB) tile_kernel<F, MTB, NV>(a, m0, w, t0, bias, out, ldo);
  if (M - m0 >= 4) { tile_kernel<F, 4, NV>(a, m0, w, t0, bias, out, ldo); m0 += 4; }
  switch (M - m0) {
    case 3: tile_kernel<F, 3, NV>(a, m0, w, t0, bias, out, ldo); break;
    case 2: tile_kernel<F, 2, NV>(a, m0, w, t0, bias, out, ldo); break;
    case 1: tile_kernel<F, 1, NV>(a, m0, w, t0, bias, out, ldo); break;
    default: break;
  }
}

#ifndef PW_MCHUNK
#define PW_MCHUNK 128
#endif
// Rows go in chunks of MCHUNK (activations and outputs of a chunk stay in L2 while every tile
// pair of the weight passes over them); within a chunk, threads split the pairs of tiles.
template <Fmt F>
void run(const Act& a, int64_t M, const Weights& w, int64_t NT, const float* bias, float* out) {
  const int64_t ldo = w.N, groups = (NT + 1) / 2;  // pairs of tiles, the last one maybe single
  for (int64_t m0 = 0; m0 < M; m0 += PW_MCHUNK) {
    const int64_t rows = std::min<int64_t>(PW_MCHUNK, M - m0);
    const Act chunk{a.xq + m0 * a.K, a.dx + m0 * a.KB, a.sx + m0 * a.KB, a.K, a.KB};
    float* o = out + m0 * ldo;
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t t0 = 2 * g;
        if (t0 + 1 < NT) rows_kernel<F, 2>(chunk, rows, w, t0, bias, o, ldo);
        else rows_kernel<F, 1>(chunk, rows, w, t0, bias, o, ldo);
      }
    });
  }
}

}  // namespace

namespace {
void quantize_rows(const float* xp, int64_t M, int64_t KB, int8_t* qp, float* dp, float* sp) {
  at::parallel_for(0, M * KB, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) quantize_block(xp + i * QK, qp + i * QK, dp + i, sp + i);
  });
}

struct Scratch {  // the calling thread's quantized activations, reused from call to call
  std::vector<int8_t> xq;
  std::vector<float> dx, sx;
};
}  // namespace

// x: [M, K] fp32 -> (xq [M, K] int8, dx [M, K/32], sx [M, K/32]); K a multiple of 32.
std::vector<torch::Tensor> quantize_activations(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous fp32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), KB = K / QK;
  TORCH_CHECK(K % QK == 0, "K must be a multiple of 32");
  auto xq = torch::empty({M, K}, x.options().dtype(at::kChar));
  auto dx = torch::empty({M, KB}, x.options());
  auto sx = torch::empty({M, KB}, x.options());
  quantize_rows(x.data_ptr<float>(), M, KB, xq.data_ptr<int8_t>(), dx.data_ptr<float>(), sx.data_ptr<float>());
  return {xq, dx, sx};
}

// y [M, N] = x [M, K] @ W^T + bias, W packed as described at the top (N rows of NT * 16).
torch::Tensor quant_linear(torch::Tensor x, int64_t fmt, int64_t N, torch::Tensor blocks,
                           c10::optional<torch::Tensor> scale, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: fp32 [M, K]");
  TORCH_CHECK(fmt == Q4 || fmt == Q8 || fmt == I8, "unknown format ", fmt);
  TORCH_CHECK(blocks.dim() == 3 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "blocks: u8 [NT, KB, BB]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), NT = blocks.size(0), KB = blocks.size(1), BB = blocks.size(2);
  TORCH_CHECK(K == KB * QK, "x has ", K, " columns, the weights ", KB * QK);
  TORCH_CHECK(BB == block_bytes(static_cast<Fmt>(fmt)), "block bytes do not match the format");
  TORCH_CHECK(N > (NT - 1) * 16 && N <= NT * 16, "N does not match the tiles");
  Weights w{blocks.data_ptr<uint8_t>(), nullptr, KB, BB, N, NT};
  if (fmt == I8) {
    TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kFloat && scale->is_contiguous() &&
                scale->numel() == NT * 16, "scale: fp32 [N]");
    w.scale = scale->data_ptr<float>();
  }
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "bias: fp32 [N]");
    bp = bias->data_ptr<float>();
  }
  thread_local Scratch scratch;
  if (static_cast<int64_t>(scratch.xq.size()) < M * K) scratch.xq.resize(M * K);
  if (static_cast<int64_t>(scratch.dx.size()) < M * KB) scratch.dx.resize(M * KB), scratch.sx.resize(M * KB);
  quantize_rows(x.data_ptr<float>(), M, KB, scratch.xq.data(), scratch.dx.data(), scratch.sx.data());
  Act a{scratch.xq.data(), scratch.dx.data(), scratch.sx.data(), K, KB};
  auto out = torch::empty({M, N}, x.options());
  float* op = out.data_ptr<float>();
  if (M == 0) return out;
  switch (fmt) {
    case Q4: run<Q4>(a, M, w, NT, bp, op); break;
    case Q8: run<Q8>(a, M, w, NT, bp, op); break;
    case I8: run<I8>(a, M, w, NT, bp, op); break;
    default: TORCH_CHECK(false, "unknown format ", fmt);
  }
  return out;
}

// The machine's int8 dot-product peak in GOP/s (2 per multiply-add): every thread runs `iters`
// rounds of 12 independent vpdpbusd chains (64 multiply-adds each), the roof of the kernels above.
double int8_peak_gops(int64_t iters) {
  TORCH_CHECK(iters > 0, "iters must be positive");
  const int64_t threads = at::get_num_threads();
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<int32_t> sink(threads * 16);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      __m512i acc[12];
      for (int c = 0; c < 12; ++c) acc[c] = _mm512_set1_epi32(c);
      __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(static_cast<char>(t + 1));
      for (int64_t n = 0; n < iters; ++n) {
        for (int c = 0; c < 12; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
        __asm__ volatile("" : "+v"(a));  // keeps the chains from being folded
      }
      for (int c = 1; c < 12; ++c) acc[0] = _mm512_add_epi32(acc[0], acc[c]);
      _mm512_storeu_si512(sink.data() + t * 16, acc[0]);
    }
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(threads) * iters * 12 * 64 * 2 / s / 1e9;
}

#else  // no VNNI: the module still loads; QuantLinear keeps its reference path (quant.load() is None)
bool has_vnni() { return false; }
double int8_peak_gops(int64_t) { TORCH_CHECK(false, "needs AVX-512 VNNI"); }
std::vector<torch::Tensor> quantize_activations(torch::Tensor) { TORCH_CHECK(false, "needs AVX-512 VNNI"); }
torch::Tensor quant_linear(torch::Tensor, int64_t, int64_t, torch::Tensor, c10::optional<torch::Tensor>,
                           c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "needs AVX-512 VNNI");
}
#endif
