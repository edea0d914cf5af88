// The register tiles of the quantized linear layers (quant_linear.cpp drives them over a weight):
// MT activation rows x NV tiles of 16 output rows, one block of 32 k at a time, in int8 dot
// products of the vector layer and a float epilogue per block.
//
// Activations are quantized per block of 32 values (activation_quant.cpp: symmetric int8, fp32 scale
// dx, one per block, or per super-block of 256 for K4 and Q6K (quant_linear.cpp), and sx = dx *
// sum(xq), sl = dx * sum of the first 16 xq, for the weight offsets); weight blocks of
// 32 along K are unsigned bytes, so VNNI's `vpdpbusd` (u8 x s8 -> s32, 4 products per lane) takes
// them as they are:
//   Q4 (GGUF Q4_1, and Q4_0 with m = -8 d):  w = d q + m,        q in 0..15, d, m fp16 per block
//   Q8 (GGUF Q8_0):                          w = d (u - 128),    u = q + 128, d fp16 per block
//   I8 (our per-channel int8):               w = s_n (u - 128),  s_n fp32 per output row
//   K4 (GGUF Q4_K):                          Q4 with d = d_K sc, m = -dmin_K m_K: sc, m as u8 per
//                                            block, d_K, dmin_K fp16 per super-block of 8 (w.super)
//   K8 (K-quant bytes, tests only):          w = d_h (u - 128) + m, u = q + 128, one fp32 d per
//                                            16-wide half h of the block, m fp32
//   Q5 (GGUF Q5_0):                          w = d (u - 16), u in 0..31 in 5.5 bits: Q4's nibbles
//                                            and a plane of fifth bits; U5 the same one byte a weight
//   K6 (GGUF Q5_K, Q6_K):                    w = d sc_h (u - 32) + m, u = q + 32, q in -32..31, d and
//                                            m fp32, an integer sc per half (|sc| <= 128, int16)
// (the K scales are fp16 x 6- or 8-bit integers in the file: exact in fp32; Q6_K's sub-blocks are
// 16 wide), so a block contributes d (dx acc) + m sx (Q4; K4 sums sc acc over the super-block in
// integers and adds d_K dx sum at its end) or d (dx acc - o sx) + m sx (the
// bytes, offset o = 128, 32 or 16), with acc = sum(u xq) (K8, K6: per half, with sl and sx - sl,
// and K6's d sc of each half). On AVX2 (int16 sums) K6 takes acc = sc0 sum_0(u xq) + sc1 sum_1(u xq)
// in integers instead, vpmaddwd by sc where the other formats widen by ones, and its offsets
// -32 d (sc0 sl + sc1 (sx - sl)): one epilogue a block, not two (k6 GEMMs 1.13-1.15x). Q6K in
// place does as the K6 it unpacks to, float for float, so a row's bits do not depend on the rows
// beside it (from UNPACK_ROWS rows Q6K runs unpacked).
// Where the ISA's dot product unbiases 8-bit bytes itself (Q8_BIASED false: no u8 x s8 product
// that holds 255 x 127), Q8, I8 and K8 get acc = sum((u - 128) xq) and the -128 sx term goes. Bytes
// below 64 every ISA multiplies as they are (AVX2's vpmaddubsw without saturating), so U5 and K6
// give the same sums, and outputs, at every level.
//
// Internal to quant_linear.cpp (everything in an anonymous namespace).
#pragma once
#include "core.h"
#include "vec/vec.h"

#include <cstdint>
#include <type_traits>
#include <utility>

namespace pw {
namespace {

using Fmt = QuantFormat;
// A register tile: MTB activation rows x NVB tiles of 16 output rows, what the registers hold.
// AVX-512 4 x 2; NEON and SSE2 2 x 2 (4 registers a vector); AVX2 4 x 1 (2 ymm a vector, 16
// registers: at 4 x 2 the int16 and int32 sums spilled on every chunk, 1.1-1.4x slower).
#ifndef PW_MTB
#define PW_MTB (W == 4 ? 2 : 4)
#endif
#ifndef PW_NVB
#define PW_NVB (W == 8 ? 1 : 2)
#endif
constexpr int MTB = PW_MTB, NVB = PW_NVB;

struct Act {          // quantized activations
  const int8_t* xq;   // [M, K]
  const float* dx;    // [M, KB]
  const float* sx;    // [M, KB]
  const float* sl;    // [M, KB] dx * the sum of a block's first 16 xq
  int64_t K, KB;
};


struct Weights {
  const uint8_t* qs;      // [NT, KB, BB]
  const float* scale;     // [NT * 16] (I8)
  int64_t KB, BB;
  int64_t N;              // output features (the last tile may be partly padding)
  int64_t NT;             // tiles of 16 rows
  const uint16_t* super = nullptr;   // K4: its super-blocks' fp16 d and dmin (kernels.h)
};

constexpr bool nibbles(Fmt F) { return F == Q4 || F == K4; }
constexpr bool narrow(Fmt F) { return F == Q5 || F == U5 || F == K6 || F == Q6K; }   // values below 64, multiplied unbiased
// K6 in one integer sum a block where the widening multiplies anyway (AVX2's int16 sums); with
// int32 sums (VNNI, NEON) a multiply by sc costs more than the second epilogue (k6 1.07x slower)
// (Q6K in place too: the bits of the K6 its tiles unpack to, whatever the rows)
constexpr bool k6_one_sum = VS_U6 < 4;
constexpr bool k6_like(Fmt F) { return F == K6 || F == Q6K; }
constexpr bool halves(Fmt F) { return F == K8 || (k6_like(F) && !k6_one_sum); }   // an epilogue per 16-wide half
constexpr bool biased(Fmt F) { return narrow(F) || Q8_BIASED; }     // acc = sum(u xq) of the bytes
constexpr bool five_bits(Fmt F) { return F == Q5 || F == U5; }
constexpr float offset(Fmt F) { return five_bits(F) ? 16.f : F == K6 || F == Q6K ? 32.f : 128.f; }
// dot_u4s calls before widen: Q5's in-register path sums 4 on AVX2; U5 sums 2 as K6 does (at 4 the
// bytes of 4 chunks and the sums of 4 rows outgrow AVX2's 16 registers: 1.1-1.2x slower)
constexpr int narrow_calls(Fmt F) { return F == Q5 ? VS_U5 : VS_U6; }

// f(std::integral_constant<int, j>) for j = 0 .. N - 1 (a shift count that must be a constant)
template <typename Fn, int... J>
inline void for_each_j(const Fn& f, std::integer_sequence<int, J...>) {
  (f(std::integral_constant<int, J>{}), ...);
}
template <int N, typename Fn>
inline void for_each_j(const Fn& f) { for_each_j(f, std::make_integer_sequence<int, N>{}); }

// Chunk J of the Q5 block at blk as bytes: its low nibbles (k = 4J..) and high ones (k = 16 + 4J..),
// each with its fifth bit from the plane after the nibbles (`fifth`, loaded once per block).
constexpr int64_t Q5_FIFTH = 256;
template <int J>
inline void q5_chunk(const uint8_t* blk, Vb fifth, Vb& lo, Vb& hi) {
  const Vb raw = Vb::load(blk + 64 * J);
  lo = with_fifth<J>(lo4(raw), fifth);
  hi = with_fifth<J + 4>(hi4(raw), fifth);
}

// Chunk g (k = 4g..4g + 3 of 16 rows) of a block as bytes: as stored, or Q6K's nibble with its high
// pair (few rows run Q6K in place: unpacked in registers, not through a buffer as prefill does)
template <Fmt F>
inline Vb chunk_bytes(const uint8_t* blk, int g) {
  if constexpr (F != Q6K) {
    return Vb::load(blk + 64 * g);
  } else {
    const Vb raw = Vb::load(blk + 64 * (g & 3)), pairs = Vb::load(blk + (g < 4 ? 256 : 320));
    const Vb nib = g < 4 ? lo4(raw) : hi4(raw);
    switch (g & 3) {
      case 0: return with_high2<0>(nib, pairs);
      case 1: return with_high2<1>(nib, pairs);
      case 2: return with_high2<2>(nib, pairs);
      default: return with_high2<3>(nib, pairs);
    }
  }
}

// r[i][v] += one block's (or K8's half block's) contribution: acc [MT][NV], the block's scales at
// `scales` for tile t0 + v (K8: half h's d at scales + 64 h, m at scales + 128; K6: d, sc0 and sc1
// as int16 at scales + 64 and + 96, m at scales + 128).
template <Fmt F, int MT, int NV>
inline void block_epilogue(const Act& a, int64_t m0, const Weights& w, int64_t t0, int64_t b, int h,
                           Vi (&acc)[MT][NV], Vf (&r)[MT][NV]) {
  for (int v = 0; v < NV; ++v) {
    const uint8_t* scales = w.qs + ((t0 + v) * w.KB + b) * block_bytes(F) + quant_bytes(F);
    Vf dv, mv;
    if constexpr (F == Q4 || F == Q8 || five_bits(F)) dv = Vf::from_f16(reinterpret_cast<const uint16_t*>(scales));
    if constexpr (F == Q4) mv = Vf::from_f16(reinterpret_cast<const uint16_t*>(scales + 32));
    if constexpr (F == K8) dv = Vf::load(reinterpret_cast<const float*>(scales + 64 * h));
    if constexpr (F == Q6K && halves(F))    // half h's d sc (m = 0)
      dv = Vf::from_f16(w.super + ((t0 + v) * (w.KB / K4_SUPER) + b / K4_SUPER) * 16) *
           to_float(Vi::from_i8(scales + 16 * h));
    if constexpr (F == K6 && halves(F))   // half h's d sc
      dv = Vf::load(reinterpret_cast<const float*>(scales)) *
           to_float(Vi::from_i16(reinterpret_cast<const int16_t*>(scales + 64 + 32 * h)));
    if constexpr ((halves(F) || F == K6) && F != Q6K) mv = Vf::load(reinterpret_cast<const float*>(scales + 128));
    if constexpr (k6_like(F) && k6_one_sum) {   // r += d dx acc + a sl + b sx: a = -32 d (sc0 - sc1), b = m - 32 d sc1
      Vf s0, s1;
      if constexpr (F == K6) {
        dv = Vf::load(reinterpret_cast<const float*>(scales));
        s0 = to_float(Vi::from_i16(reinterpret_cast<const int16_t*>(scales + 64)));
        s1 = to_float(Vi::from_i16(reinterpret_cast<const int16_t*>(scales + 96)));
      } else {                               // Q6K: the values its K6 tiles hold (m = 0)
        dv = Vf::from_f16(w.super + ((t0 + v) * (w.KB / K4_SUPER) + b / K4_SUPER) * 16);
        s0 = to_float(Vi::from_i8(scales));
        s1 = to_float(Vi::from_i8(scales + 16));
        mv = Vf::zero();
      }
      const Vf d32 = dv * Vf::set1(-32.f), av = (s0 - s1) * d32, bv = fma(s1, d32, mv);
      for (int i = 0; i < MT; ++i) {
        const int64_t xi = (m0 + i) * a.KB + b;
        r[i][v] = fma(to_float(acc[i][v]), dv * Vf::set1(a.dx[xi]), r[i][v]);
        r[i][v] = fma(av, Vf::set1(a.sl[xi]), r[i][v]);
        r[i][v] = fma(bv, Vf::set1(a.sx[xi]), r[i][v]);
      }
      continue;
    }
    for (int i = 0; i < MT; ++i) {
      const int64_t xi = (m0 + i) * a.KB + b;
      const Vf accf = to_float(acc[i][v]);
      const Vf dx = Vf::set1(a.dx[xi]);
      float xs = a.sx[xi];                 // the activations' sum the offsets multiply
      if constexpr (halves(F) && biased(F)) xs = h == 0 ? a.sl[xi] : a.sx[xi] - a.sl[xi];
      if constexpr (nibbles(F)) {
        r[i][v] = fma(accf * dx, dv, r[i][v]);
        r[i][v] = fma(mv, Vf::set1(xs), r[i][v]);
      } else if constexpr (F == I8) {
        r[i][v] = fma(accf, dx, r[i][v]);
      } else {
        const Vf t = biased(F) ? fma(accf, dx, Vf::set1(-offset(F) * xs)) : accf * dx;
        r[i][v] = fma(t, dv, r[i][v]);
        if constexpr (halves(F) && F != Q6K) {
          if (h == 1) r[i][v] = fma(mv, Vf::set1(a.sx[xi]), r[i][v]);
        }
      }
    }
  }
}

// part[i][v] = block b's 8 nibble dot products of activation row i with tile t0 + v (narrow sums)
template <Fmt F, int MT, int NV>
inline void nibble_dots(const Act& a, const Weights& w, int64_t t0, int64_t b, const int8_t* xb, Vs (&part)[MT][NV]) {
  for (int i = 0; i < MT; ++i)
    for (int v = 0; v < NV; ++v) part[i][v] = Vs::zero();
  for (int j = 0; j < 4; ++j) {
    Vb lo[NV], hi[NV];
    for (int v = 0; v < NV; ++v) {
      const Vb raw = Vb::load(w.qs + ((t0 + v) * w.KB + b) * block_bytes(F) + j * 64);
      lo[v] = lo4(raw);
      hi[v] = hi4(raw);
    }
    for (int i = 0; i < MT; ++i) {
      const Vb xl = Vb::bcast4(xb + i * a.K + 4 * j), xh = Vb::bcast4(xb + i * a.K + 16 + 4 * j);
      for (int v = 0; v < NV; ++v) {
        part[i][v] = dot_u4s(part[i][v], lo[v], xl);
        part[i][v] = dot_u4s(part[i][v], hi[v], xh);
      }
    }
  }
}

// MT activation rows from m0 x NV tiles of 16 output rows from tile t0: out[m0.., 16 t0..].
template <Fmt F, int MT, int NV>
inline void tile_kernel(const Act& a, int64_t m0, const Weights& w, int64_t t0, const float* bias,
                        float* out, int64_t ldo) {
  Vf r[MT][NV];
  for (int i = 0; i < MT; ++i)
    for (int v = 0; v < NV; ++v) r[i][v] = Vf::zero();
  // The first row tile of a chunk fetches the next NV tiles' bytes into L2 as it goes, one block
  // of each per step: few rows make this a stream from DRAM, and the next tiles start elsewhere.
  const uint8_t* next = m0 == 0 ? w.qs + (t0 + NV) * w.KB * block_bytes(F) : nullptr;
  const uint8_t* next_end = w.qs + w.NT * w.KB * block_bytes(F);
  Vi sup[F == K4 ? MT : 1][F == K4 ? NV : 1];   // K4: the super-block's integer sums
  for (int64_t b = 0; b < w.KB; ++b) {
    if (next != nullptr)
      for (int64_t off = b * NV * block_bytes(F); off < (b + 1) * NV * block_bytes(F); off += 64)
        if (next + off < next_end) prefetch_l2(next + off);
    Vi acc[MT][NV];
    const int8_t* xb = a.xq + m0 * a.K + b * QK;
    if constexpr (F == Q5) {       // few rows: each chunk's bytes put together in registers
      constexpr int per = narrow_calls(F) / 2 < 4 ? narrow_calls(F) / 2 : 4;   // chunks j per widen
      Vb fifth[NV];
      for (int v = 0; v < NV; ++v) fifth[v] = Vb::load(w.qs + ((t0 + v) * w.KB + b) * block_bytes(F) + Q5_FIFTH);
      for (int i = 0; i < MT; ++i)
        for (int v = 0; v < NV; ++v) acc[i][v] = Vi::zero();
      Vs part[MT][NV];
      for_each_j<4>([&](auto J) {
        constexpr int j = decltype(J)::value;
        if constexpr (j % per == 0)
          for (int i = 0; i < MT; ++i)
            for (int v = 0; v < NV; ++v) part[i][v] = Vs::zero();
        Vb lo[NV], hi[NV];
        for (int v = 0; v < NV; ++v) q5_chunk<j>(w.qs + ((t0 + v) * w.KB + b) * block_bytes(F), fifth[v], lo[v], hi[v]);
        for (int i = 0; i < MT; ++i) {
          const Vb xl = Vb::bcast4(xb + i * a.K + 4 * j), xh = Vb::bcast4(xb + i * a.K + 16 + 4 * j);
          for (int v = 0; v < NV; ++v) {
            part[i][v] = dot_u4s(part[i][v], lo[v], xl);
            part[i][v] = dot_u4s(part[i][v], hi[v], xh);
          }
        }
        if constexpr (j % per == per - 1)
          for (int i = 0; i < MT; ++i)
            for (int v = 0; v < NV; ++v) acc[i][v] = acc[i][v] + widen(part[i][v]);
      });
      block_epilogue<F, MT, NV>(a, m0, w, t0, b, 0, acc, r);
    } else if constexpr (F == K4) {   // a super-block's sum of sc_b sum_b(q xq) in integers, one scale at its end
      if (b % K4_SUPER == 0)
        for (int i = 0; i < MT; ++i)
          for (int v = 0; v < NV; ++v) sup[i][v] = Vi::zero();
      Vs part[MT][NV];
      nibble_dots<F, MT, NV>(a, w, t0, b, xb, part);
      for (int v = 0; v < NV; ++v) {
        const uint8_t* scales = w.qs + ((t0 + v) * w.KB + b) * block_bytes(F) + quant_bytes(F);
        const uint16_t* sb = w.super + ((t0 + v) * (w.KB / K4_SUPER) + b / K4_SUPER) * 32;
        const Vi by = pair_factor(Vi::from_u8(scales));
        const Vf mv = Vf::zero() - Vf::from_f16(sb + 16) * to_float(Vi::from_u8(scales + 16));   // -dmin m
        for (int i = 0; i < MT; ++i) {
          sup[i][v] = sup[i][v] + widen_by(part[i][v], by);
          r[i][v] = fma(mv, Vf::set1(a.sx[(m0 + i) * a.KB + b]), r[i][v]);
        }
      }
      if (b % K4_SUPER == K4_SUPER - 1)   // r += d dx sum (dx: the super-block's, the same in each block)
        for (int v = 0; v < NV; ++v) {
          const Vf d = Vf::from_f16(w.super + ((t0 + v) * (w.KB / K4_SUPER) + b / K4_SUPER) * 32);
          for (int i = 0; i < MT; ++i)
            r[i][v] = fma(to_float(sup[i][v]), d * Vf::set1(a.dx[(m0 + i) * a.KB + b]), r[i][v]);
        }
    } else if constexpr (nibbles(F)) {    // 8 nibble dot products per (row, tile): one narrow accumulator
      Vs part[MT][NV];
      nibble_dots<F, MT, NV>(a, w, t0, b, xb, part);
      for (int i = 0; i < MT; ++i)
        for (int v = 0; v < NV; ++v) acc[i][v] = widen(part[i][v]);
      block_epilogue<F, MT, NV>(a, m0, w, t0, b, 0, acc, r);
    } else if constexpr (k6_like(F) && k6_one_sum) {   // both halves in one integer sum, each widened by its sc
      // (the bytes' loop below with widen_by: its own branch because this one must unroll over both
      // halves; merged into the shared loop, left rolled, k6 ran about 1.08x slower)
      constexpr int span = VS_U6;                     // chunks summed narrow before a widening
      Vi by[2][NV];
      for (int v = 0; v < NV; ++v) {
        const uint8_t* scales = w.qs + ((t0 + v) * w.KB + b) * block_bytes(F) + quant_bytes(F);
        if constexpr (F == K6) {
          const auto* sc = reinterpret_cast<const int16_t*>(scales + 64);
          by[0][v] = pair_factor(Vi::from_i16(sc));
          by[1][v] = pair_factor(Vi::from_i16(sc + 16));
        } else {
          by[0][v] = pair_factor(Vi::from_i8(scales));
          by[1][v] = pair_factor(Vi::from_i8(scales + 16));
        }
      }
      for (int i = 0; i < MT; ++i)
        for (int v = 0; v < NV; ++v) acc[i][v] = Vi::zero();
      #pragma GCC unroll 8
      for (int g0 = 0; g0 < 8; g0 += span) {   // unrolled: by[g0 / 4] and acc stay in registers
        Vb u[span][NV];
        for (int s = 0; s < span; ++s)
          for (int v = 0; v < NV; ++v) u[s][v] = chunk_bytes<F>(w.qs + ((t0 + v) * w.KB + b) * block_bytes(F), g0 + s);
        for (int i = 0; i < MT; ++i) {
          Vb x[span];
          for (int s = 0; s < span; ++s) x[s] = Vb::bcast4(xb + i * a.K + 4 * (g0 + s));
          for (int v = 0; v < NV; ++v) {
            Vs part = Vs::zero();
            for (int s = 0; s < span; ++s) part = dot_u4s(part, u[s][v], x[s]);
            acc[i][v] = acc[i][v] + widen_by(part, by[g0 / 4][v]);
          }
        }
      }
      block_epilogue<F, MT, NV>(a, m0, w, t0, b, 0, acc, r);
    } else {                       // the bytes; K8 (K6 with int32 sums) close each 16-wide half with its scale
      constexpr int parts = halves(F) ? 2 : 1, chunks = 8 / parts;
      // narrow bytes where the int16 sums fill before a half does (AVX2: every 2 chunks): each
      // row sums `span` chunks narrow, one row at a time, so acc and the weights stay in registers
      constexpr int span = narrow(F) && narrow_calls(F) < chunks ? narrow_calls(F) : 1;
      for (int h = 0; h < parts; ++h) {
        for (int i = 0; i < MT; ++i)
          for (int v = 0; v < NV; ++v) acc[i][v] = Vi::zero();
        for (int g0 = h * chunks; g0 < (h + 1) * chunks; g0 += span) {
          Vb u[span][NV];
          for (int s = 0; s < span; ++s)
            for (int v = 0; v < NV; ++v) u[s][v] = chunk_bytes<F>(w.qs + ((t0 + v) * w.KB + b) * block_bytes(F), g0 + s);
          for (int i = 0; i < MT; ++i) {
            Vb x[span];
            for (int s = 0; s < span; ++s) x[s] = Vb::bcast4(xb + i * a.K + 4 * (g0 + s));
            for (int v = 0; v < NV; ++v) {
              if constexpr (span > 1) {
                Vs part = Vs::zero();
                for (int s = 0; s < span; ++s) part = dot_u4s(part, u[s][v], x[s]);
                acc[i][v] = acc[i][v] + widen(part);
              } else if constexpr (narrow(F)) {
                acc[i][v] = dot_u4(acc[i][v], u[0][v], x[0]);
              } else {
                acc[i][v] = dot_q8(acc[i][v], u[0][v], x[0]);
              }
            }
          }
        }
        block_epilogue<F, MT, NV>(a, m0, w, t0, b, h, acc, r);
      }
    }
  }
  // unrolled, as every loop over r before it: a loop over r left rolled keeps r in memory, and GCC
  // then stores the whole register tile to the stack after every block (AVX-512: 8 zmm stores)
  #pragma GCC unroll 16
  for (int i = 0; i < MT; ++i) {
    float off = 0.f;  // I8 with biased bytes: the sum over blocks of -128 sx, then the row scale
    if constexpr (F == I8 && Q8_BIASED)
      for (int64_t b = 0; b < w.KB; ++b) off -= 128.f * a.sx[(m0 + i) * a.KB + b];
    #pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      const int64_t n0 = (t0 + v) * 16, keep = w.N - n0;   // keep: 16 but in the last tile
      // one explicit fma for I8's scale and the bias: a compiler that contracts across intrinsics
      // (clang) would otherwise fuse them in some tile heights and not others
      const Vf b = bias ? Vf::load_n(bias + n0, keep) : Vf::zero();
      const Vf y = F == I8 ? fma(r[i][v] + Vf::set1(off), Vf::load(w.scale + n0), b) : r[i][v] + b;
      y.store_n(out + (m0 + i) * ldo + n0, keep);
    }
  }
}

template <Fmt F, int NV>
inline void rows_kernel(const Act& a, int64_t M, const Weights& w, int64_t t0, const float* bias, float* out,
                        int64_t ldo) {
  int64_t m0 = 0;
  for (; m0 + MTB <= M; m0 += MTB) tile_kernel<F, MTB, NV>(a, m0, w, t0, bias, out, ldo);
  switch (M - m0) {
    case 3: tile_kernel<F, 3, NV>(a, m0, w, t0, bias, out, ldo); break;
    case 2: tile_kernel<F, 2, NV>(a, m0, w, t0, bias, out, ldo); break;
    case 1: tile_kernel<F, 1, NV>(a, m0, w, t0, bias, out, ldo); break;
    default: break;
  }
}

}  // namespace
}  // namespace pw
