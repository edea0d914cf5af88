// The core's functions, one per entry of the KernelTable (kernels.h), declared for table.cpp, and
// quantize_rows, which quant_linear.cpp takes from activation_quant.cpp.
#pragma once
#include "kernels.h"

namespace pw {

void paged_attention(const Runtime& rt, const float* q, int64_t T, int64_t Hq, const Cache& c,
                     const AttentionRows& rows, float scale, float* out);
void rope_and_cache(const Runtime& rt, const float* qkv, int64_t T, const int64_t* positions, const float* cos,
                    const float* sin, int64_t Hq, int64_t Hkv, int64_t D, const int64_t* slots,
                    const AttentionRows& rows, const CacheOut& c, float* q, float* k);
void write_kv(const Runtime& rt, const float* k, const float* v, int64_t ldv, int64_t T, int64_t Hkv, int64_t D,
              const int64_t* slots, const AttentionRows& rows, const CacheOut& c);
void rms_norm(const Runtime& rt, const float* x, const float* residual, const float* w, int64_t T, int64_t H,
              float eps, float* out, float* sum);
void silu_and_mul(const Runtime& rt, const float* x, int64_t T, int64_t I, float* out);
void gelu_and_mul(const Runtime& rt, const float* x, int64_t T, int64_t I, float* out);
void argmax_rows(const Runtime& rt, const float* x, int64_t B, int64_t V, int64_t* out);
void mask_rows(const Runtime& rt, const float* x, int64_t B, int64_t V, const int32_t* words, float* out);
void float_linear(const Runtime& rt, const float* x, int64_t T, int64_t K, const float* w, int64_t N, float* out);
void moe_route(const Runtime& rt, const float* logits, int64_t T, int64_t E, int64_t k, bool renorm, bool topk_softmax,
               float* weights, int64_t* ids);
void quantize_activations(const Runtime& rt, const float* x, int64_t M, int64_t K, int8_t* xq, float* dx,
                          float* sx);
// quantize_activations, and with sl each block's first-half sum; with super one scale per 256 values
// (K % 256 == 0); threads split the M K / 32 blocks in shares of at least QUANT_GRAIN
constexpr int64_t QUANT_GRAIN = 256;
void quantize_rows(const Runtime& rt, const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* sx,
                   float* sl, bool super);
void quant_linear(const Runtime& rt, const float* x, int64_t M, int64_t K, const PackedWeights& w,
                  const float* bias, float* y);

struct QuantizedRows {      // rows of activations as quantize_rows leaves them (sl always filled)
  const int8_t* xq;         // [rows, K]
  const float* dx;          // [rows, K / 32]
  const float* sx;
  const float* sl;
  int64_t K;
};
// Tiles of 16 output rows a register tile covers: a weight's tiles go in groups of this many.
int64_t linear_tile_group();
// out[r, 16 t0 .. 16 (t0 + nv)) (row stride ldo) = rows 0 .. rows - 1 of x through tiles t0 .. t0 + nv - 1
// (nv <= linear_tile_group()) of one part `w` (no U5 tiles, no bias), quantized as its format takes them;
// each output row the same bits whatever the other rows (quant_linear.cpp).
void linear_tiles(const QuantizedRows& x, int64_t rows, const PackedWeights& w, int64_t t0, int64_t nv, float* out,
                  int64_t ldo);
void expert_mlp(const Runtime& rt, const float* x, int64_t T, const int64_t* ids, const float* weights, int64_t k,
                const ExpertWeights& ex, float* out);
double int8_peak_gops(const Runtime& rt, int64_t iters);
void dequantize_rows(const Runtime& rt, const PackedWeights& w, const int64_t* ids, int64_t T, float* out);
void repack_gguf(const Runtime& rt, int64_t type, const uint8_t* raw, int64_t N, int64_t K, uint8_t* blocks,
                 uint16_t* side);
void delta_net_mix(const Runtime& rt, const DeltaNetLayer& L, const DeltaNetRows& in, int64_t T, const DeltaNetSeqs& seqs,
                   float* mixed, float* out);
// out [T, H] = LFM2's short conv of in [T, 3 H] (B | C | x, row stride ld): C conv(B x) over each sequence's
// conv state (sq.conv_states [S, K - 1, H], advanced; sq.snapshots as delta_net_mix's), taps [H, K]
void short_conv_mix(const Runtime& rt, const float* in, int64_t ld, int64_t T, int64_t H, const float* taps,
                    int64_t K, const DeltaNetSeqs& sq, float* out);
// rope_and_cache rotating only the first rot dimensions of each head (cos, sin [P, rot / 2])
void rope_partial_and_cache(const Runtime& rt, const float* qkv, int64_t T, const int64_t* positions, const float* cos,
                            const float* sin, int64_t Hq, int64_t Hkv, int64_t D, int64_t rot, const int64_t* slots,
                            const AttentionRows& rows, const CacheOut& c, float* q, float* k);
void decoder_stack(const Runtime& rt, const DecoderModel& m, const DecoderStep& s, const float* x, float* workspace,
                   float* out);

}  // namespace pw
