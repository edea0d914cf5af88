// Rows of a packed weight back to fp32: the embedding lookup of a table kept in its blocks (as
// llama.cpp's get_rows does), so a model never holds its vocabulary in fp32.
//
// Scalar on purpose: a step reads a few rows (T x K values), a prefill at most a few hundred. The
// products and sums are those of kernels/quant.py's `dequantize` in the same order, each rounded
// on its own (no fused multiply-add here, whatever -ffast-math allows elsewhere), so a row equals
// the reference bit for bit.
#pragma GCC optimize("fp-contract=off")
#include "core.h"
#include "parallel.h"

#include <cstring>

namespace pw {
namespace {

inline float f16(const uint8_t* p) {   // IEEE half -> float (subnormals included)
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {                              // subnormal: man * 2^-24, exact in fp32
    const float v = static_cast<float>(man) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &v, 4);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

template <typename T>
inline T scale_at(const uint8_t* blk, int64_t at, int lane) {   // a 16-row scale vector's lane
  T v;
  std::memcpy(&v, blk + at + static_cast<int64_t>(sizeof(T)) * lane, sizeof(T));
  return v;
}

// Byte k (0..31) of a row's block in the chunked layout: chunk k / 4 of 16 rows x 4 k.
inline int byte_at(const uint8_t* blk, int lane, int k) { return blk[64 * (k / 4) + 4 * lane + k % 4]; }

// The 32 weights of row `lane` of one (tile, block) of format F into out (sb: K4's super-block scales).
void block_row(QuantFormat F, const uint8_t* blk, const uint8_t* sb, int lane, float row_scale, float* out) {
  const int64_t Q = quant_bytes(F);
  int q[32];
  if (F == Q4 || F == K4) {             // byte i: k = i low nibble, k = i + 16 high
    for (int k = 0; k < 16; ++k) {
      const int b = byte_at(blk, lane, k);
      q[k] = b & 0x0F;
      q[k + 16] = b >> 4;
    }
  } else if (F == Q5) {                 // nibbles as Q4's; bit g of the plane's byte: chunk g's fifth bit
    for (int k = 0; k < 16; ++k) {
      const int b = byte_at(blk, lane, k), plane = blk[256 + 4 * lane + k % 4];
      q[k] = ((b & 0x0F) | (((plane >> (k / 4)) & 1) << 4)) - 16;
      q[k + 16] = ((b >> 4) | (((plane >> (4 + k / 4)) & 1) << 4)) - 16;
    }
  } else if (F == Q6K) {               // nibbles as Q4's; bits 2 (g % 4) of pair plane g / 4: chunk g's high pair
    for (int k = 0; k < 16; ++k) {
      const int b = byte_at(blk, lane, k), g = k / 4, p = 4 * lane + k % 4;
      q[k] = ((b & 0x0F) | (((blk[256 + p] >> (2 * g)) & 3) << 4)) - 32;
      q[k + 16] = ((b >> 4) | (((blk[320 + p] >> (2 * g)) & 3) << 4)) - 32;
    }
  } else {
    const int off = F == K6 ? 32 : 128;
    for (int k = 0; k < 32; ++k) q[k] = byte_at(blk, lane, k) - off;
  }
  switch (F) {
    case Q4: {
      const float d = f16(blk + Q + 2 * lane), m = f16(blk + Q + 32 + 2 * lane);
      for (int k = 0; k < 32; ++k) out[k] = static_cast<float>(q[k]) * d + m;
      break;
    }
    case Q8:
    case Q5: {
      const float d = f16(blk + Q + 2 * lane);
      for (int k = 0; k < 32; ++k) out[k] = static_cast<float>(q[k]) * d;
      break;
    }
    case I8:
      for (int k = 0; k < 32; ++k) out[k] = static_cast<float>(q[k]) * row_scale;
      break;
    case K4: {   // d sc and -(dmin m), as quant.py's block_scales
      const float d = f16(sb + 2 * lane) * static_cast<float>(blk[Q + lane]);
      const float m = -(f16(sb + 32 + 2 * lane) * static_cast<float>(blk[Q + 16 + lane]));
      for (int k = 0; k < 32; ++k) out[k] = static_cast<float>(q[k]) * d + m;
      break;
    }
    case K8:
    case K6: {
      float h0, h1;
      if (F == K8) {
        h0 = scale_at<float>(blk, Q, lane);
        h1 = scale_at<float>(blk, Q + 64, lane);
      } else {
        const float d = scale_at<float>(blk, Q, lane);
        h0 = d * static_cast<float>(scale_at<int16_t>(blk, Q + 64, lane));
        h1 = d * static_cast<float>(scale_at<int16_t>(blk, Q + 96, lane));
      }
      const float m = scale_at<float>(blk, Q + 128, lane);
      for (int k = 0; k < 32; ++k) out[k] = static_cast<float>(q[k]) * (k < 16 ? h0 : h1) + m;
      break;
    }
    case Q6K: {  // d sc_h q + 0, as quant.py's block_scales (k6's order, m = 0)
      const float d = f16(sb + 2 * lane);
      const float h0 = d * static_cast<float>(static_cast<int8_t>(blk[Q + lane]));
      const float h1 = d * static_cast<float>(static_cast<int8_t>(blk[Q + 16 + lane]));
      for (int k = 0; k < 32; ++k) out[k] = static_cast<float>(q[k]) * (k < 16 ? h0 : h1) + 0.f;
      break;
    }
    case U5: break;                     // not a packed format
  }
}

}  // namespace

// out [T, K] = rows ids [T] of the weight (u5_tiles none: a table, not a fused projection)
void dequantize_rows(const Runtime& rt, const PackedWeights& w, const int64_t* ids, int64_t T, float* out) {
  const int64_t BB = block_bytes(w.fmt), K = w.KB * QK;
  parallel_for(rt, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t tile = ids[t] / 16;
      const int lane = static_cast<int>(ids[t] % 16);
      const float row_scale = w.fmt == I8 ? w.scale[ids[t]] : 0.f;
      for (int64_t b = 0; b < w.KB; ++b) {
        const int64_t halves = super_halves(w.fmt);
        const uint8_t* sb = halves ? reinterpret_cast<const uint8_t*>(
            w.super + (tile * (w.KB / K4_SUPER) + b / K4_SUPER) * halves) : nullptr;
        block_row(w.fmt, w.blocks + (tile * w.KB + b) * BB, sb, lane, row_scale, out + t * K + b * QK);
      }
    }
  });
}

}  // namespace pw
