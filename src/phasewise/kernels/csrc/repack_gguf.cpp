// GGUF's Q4_K and Q6_K rows moved into the packed k4 and q6k layouts (kernels/quant.py: pack), byte
// for byte what kernels/gguf_blocks.py's numpy path makes, at memory speed: loading a Q4_K_M file
// packs its weights once (the packed-weight cache keeps them after), and in numpy that was most of
// a first load (Qwen2.5-Coder-1.5B: ~5 s on two threads).
//
// One call packs whole tiles of 16 rows on the calling thread (the loader runs two at once); rows
// past N are padding: value 0 (k4) or q = 0 (q6k: u = 32), scales and d 0, as quant.pack pads.
#include "core.h"

#include <cstring>

namespace pw {
namespace {

constexpr int64_t TILE_ROWS = 16, SUPER_K = 256;
constexpr int64_t Q4K_BYTES = 144, Q6K_BYTES = 210;      // a GGUF super-block of 256 values
constexpr int64_t K4_BLOCK = 256 + 32, Q6K_BLOCK = 384 + 32;   // a packed (tile, block of 32)

// Q4_K's 6-bit scale and min of sub-block j from its 12 packed bytes (llama.cpp's get_scale_min_k4).
inline void scale_min_k4(const uint8_t* q, int j, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63, *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One row's super-block S of Q4_K (B: its 144 bytes, or null for a padding row) into tile slot r.
void k4_super(const uint8_t* B, int64_t r, uint8_t* out /* the tile's block 8 S */, uint16_t* side) {
  for (int s = 0; s < 8; ++s, out += K4_BLOCK) {
    uint8_t q[32] = {}, sc = 0, m = 0;
    if (B) {
      const uint8_t* qs = B + 16 + 32 * (s / 2);
      for (int i = 0; i < 32; ++i) q[i] = (qs[i] >> (4 * (s % 2))) & 0xF;
      scale_min_k4(B + 4, s, &sc, &m);
    }
    for (int i = 0; i < 16; ++i) out[(i / 4) * 64 + r * 4 + i % 4] = static_cast<uint8_t>(q[i] | (q[i + 16] << 4));
    out[256 + r] = sc;
    out[272 + r] = m;
  }
  uint16_t d = 0, dmin = 0;
  if (B) std::memcpy(&d, B, 2), std::memcpy(&dmin, B + 2, 2);
  side[r] = d;
  side[16 + r] = dmin;
}

// The same for Q6_K (u = q + 32 in 0..63: low nibbles as k4's, then two planes of high bit pairs).
void q6k_super(const uint8_t* B, int64_t r, uint8_t* out, uint16_t* side) {
  for (int s = 0; s < 8; ++s, out += Q6K_BLOCK) {
    uint8_t u[32];
    for (int i = 0; i < 32; ++i) {
      u[i] = 32;
      if (!B) continue;
      const uint8_t low = (B[64 * (s / 4) + 32 * (s % 2) + i] >> (4 * ((s / 2) % 2))) & 0xF;
      const uint8_t high = (B[128 + 32 * (s / 4) + i] >> (2 * (s % 4))) & 3;
      u[i] = static_cast<uint8_t>(low | (high << 4));
    }
    for (int c = 0; c < 4; ++c)
      for (int p = 0; p < 4; ++p)
        out[c * 64 + r * 4 + p] = static_cast<uint8_t>((u[4 * c + p] & 0xF) | ((u[16 + 4 * c + p] & 0xF) << 4));
    for (int plane = 0; plane < 2; ++plane)
      for (int p = 0; p < 4; ++p) {
        uint8_t bits = 0;
        for (int j = 0; j < 4; ++j) bits |= static_cast<uint8_t>((u[4 * (4 * plane + j) + p] >> 4) << (2 * j));
        out[256 + plane * 64 + r * 4 + p] = bits;
      }
    out[384 + r] = B ? B[192 + 2 * s] : 0;
    out[400 + r] = B ? B[192 + 2 * s + 1] : 0;
  }
  uint16_t d = 0;
  if (B) std::memcpy(&d, B + 208, 2);
  side[r] = d;
}

}  // namespace

void repack_gguf(const Runtime&, int64_t type, const uint8_t* raw, int64_t N, int64_t K, uint8_t* blocks,
                 uint16_t* side) {
  const bool q6k = type == GGUF_Q6_K;
  const int64_t supers = K / SUPER_K, in_bytes = q6k ? Q6K_BYTES : Q4K_BYTES;
  const int64_t block = q6k ? Q6K_BLOCK : K4_BLOCK, side_n = q6k ? 16 : 32, KB = K / 32;
  const int64_t NT = (N + TILE_ROWS - 1) / TILE_ROWS;
  for (int64_t t = 0; t < NT; ++t)
    for (int64_t S = 0; S < supers; ++S)
      for (int64_t r = 0; r < TILE_ROWS; ++r) {
        const int64_t row = t * TILE_ROWS + r;
        const uint8_t* B = row < N ? raw + (row * supers + S) * in_bytes : nullptr;
        uint8_t* out = blocks + (t * KB + 8 * S) * block;
        uint16_t* sd = side + (t * supers + S) * side_n;
        if (q6k) q6k_super(B, r, out, sd);
        else k4_super(B, r, out, sd);
      }
}

}  // namespace pw
