// phasewise's CPU kernels: plain C++ over raw pointers (no torch types), built once per ISA level
// into a shared library of its own (kernels/build.py) that exports one table of functions. The
// torch binding (bindings.cpp) checks tensors and calls through the table; the C++ tests
// (tests/kernel_tests.cpp) call the same table, natively or under qemu-user for ARM.
#pragma once
#include <cstdint>

namespace pw {

constexpr int ABI_VERSION = 19;

struct Runtime {            // how a call may run: threads of the caller's pool (torch's, through OpenMP)
  int threads = 1;
  bool team = false;        // every thread of a running parallel region makes this call (decoder.cpp)
};

// An int8 cache (docs/architecture.md, "int8 KV cache"): V int8 per token and KV head with one scale; K
// per group of KEY_GROUP tokens (positions [16 i, 16 i + 16), slots [16 j, 16 j + 16)) and KV head, each
// channel's midpoint and step (k = mid + step code, code in -127..127), quantized when a step fills the
// group. A row of length len reads the groups wholly below len as int8, and the keys of its own partial
// group in fp32: the step's own (fresh) or an earlier step's, kept in its sequence's tail slot (two
// groups of KEY_GROUP keys, tail_groups naming the group each holds).
constexpr int64_t KEY_GROUP = 16;
constexpr int64_t MAX_HEAD_SIZE = 512;   // a quantized cache's largest head size
// An int4 cache (docs/architecture.md, "int4 KV cache") is an int8 cache's shape with 4-bit codes: K per
// group of KEY_GROUP4 tokens (positions [64 i, 64 i + 64)) and KV head, each channel's minimum and step in
// fp16 (k = min + step code, code 0..15); V per token and KV head in blocks of V4_BLOCK values, each with
// one fp16 scale d (v = d (code - 8), code 0..15, d = -m / 8 for m the value of largest magnitude), quantized
// with its group's keys. Codes two to a byte: in
// each 64 values of a row, byte i holds value i (low nibble) and value i + 32 (high). Head sizes are
// multiples of 64. Its tails hold groups of 64 keys and their values: a row reads its own group's values
// as fp32 too (the step's own, fresh_v, or its tail's).
constexpr int64_t KEY_GROUP4 = 64;
constexpr int64_t V4_BLOCK = 32;

struct Cache {              // one layer's KV cache [slots, Hkv, D], fp32, int8 or int4
  const float* k = nullptr;
  const float* v = nullptr;
  const int8_t* kq = nullptr;
  const int8_t* vq = nullptr;
  const float* kg = nullptr;   // [slots / 16, Hkv, 2, D] each key group's midpoints, then steps
  const float* vs = nullptr;   // [slots, Hkv] the values' scales
  // [2 S, group, Hkv, D] fp32 keys (int4: [2 S, 2, 64, Hkv, D] keys, then values): tail slot s's groups 2 s, 2 s + 1
  const float* tails = nullptr;
  const int64_t* tail_groups = nullptr;  // [S, 2] the group (position / group) each holds
  const float* fresh = nullptr;        // [T, Hkv, D] the step's keys (rotated), as the writer wrote them
  int64_t Hkv = 0, D = 0;
  const uint8_t* k4 = nullptr;         // int4: [slots, Hkv, D / 2] key codes
  const uint8_t* v4 = nullptr;         // [slots, Hkv, D / 2] value codes
  const uint16_t* kg4 = nullptr;       // [slots / 64, Hkv, 2, D] fp16 each key group's minimums, then steps
  const uint16_t* vs4 = nullptr;       // [slots, Hkv, D / 32] fp16 the values' scales
  const float* fresh_v = nullptr;      // int4: the step's values [T, Hkv, D], rows ldv floats apart
  int64_t ldv = 0;
  bool quantized() const { return kq != nullptr || k4 != nullptr; }
  int64_t group() const { return k4 != nullptr ? KEY_GROUP4 : KEY_GROUP; }   // tokens per key group
  // where tails holds token `off` of half `half` (0, 1) of tail slot `slot`, KV head h: its key (part 0) or
  // value (part 1, int4)
  int64_t tail_at(int64_t slot, int64_t half, int64_t part, int64_t off, int64_t h) const {
    return ((((2 * slot + half) * (k4 != nullptr ? 2 : 1) + part) * group() + off) * Hkv + h) * D;
  }
};

struct CacheOut {           // the same cache, written
  float* k = nullptr;
  float* v = nullptr;
  int8_t* kq = nullptr;
  int8_t* vq = nullptr;
  float* kg = nullptr;
  float* vs = nullptr;
  float* tails = nullptr;
  int64_t* tail_groups = nullptr;
  uint8_t* k4 = nullptr;
  uint8_t* v4 = nullptr;
  uint16_t* kg4 = nullptr;
  uint16_t* vs4 = nullptr;
  bool quantized() const { return kq != nullptr || k4 != nullptr; }
  int64_t group() const { return k4 != nullptr ? KEY_GROUP4 : KEY_GROUP; }
};

struct AttentionRows {      // every query row of a step: row t attends over the first len[t] tokens of seq[t]
  const int64_t* tables;    // [num_seqs, max_blocks] block ids
  int64_t max_blocks;
  const int64_t* seq;       // [T]
  const int64_t* len;       // [T]
  int64_t block_size;
  int64_t window = 0;       // > 0: row t sees only its last `window` tokens (a sliding-window layer)
  // an int8 cache's: per sequence its first new position, new tokens, the row of its first new token (in
  // the step's fresh keys) and its tail slot [num_seqs, 4]
  const int64_t* seqs = nullptr;
  int64_t num_seqs = 0;
};

// Q4, Q8: GGUF's legacy blocks; I8: int8 per output channel; K4: GGUF's Q4_K at its own width (the
// sub-blocks' 6-bit sc and m as bytes, the super-blocks' fp16 d and dmin beside), K8: K-quant blocks
// of bytes, their scales resolved to fp32 (no load path makes it, tests do; a mixed fused projection keeps
// each part's own format, chained through `next`);
// Q5: GGUF's Q5_0 in 5.5 bits a weight: u = q + 16 (0..31) as Q4's nibbles and a plane of fifth
// bits; K6: values of at most 6 bits (GGUF's Q5_K, Q6_K), stored as u = q + 32, w = d sc_h q + m.
// Q6K: GGUF's Q6_K at its own width: u = q + 32 as nibbles (Q4's layout) and two planes of high
// bit pairs, each 16-wide half's int8 sc, the super-blocks' fp16 d beside (w = d sc_h q).
// U5 is no packed format: Q5's tiles unpacked to one byte a weight (quant_linear.cpp).
enum QuantFormat : int64_t { Q4 = 0, Q8 = 1, I8 = 2, K4 = 3, K8 = 4, Q5 = 5, K6 = 6, U5 = 7, Q6K = 8 };
constexpr bool known_format(int64_t f) { return (f >= Q4 && f <= K6) || f == Q6K; }
constexpr int64_t QK = 32;                    // weights per block along K
// Bytes per (tile of 16 rows, block): the quants (nibbles for Q4, K4; nibbles and 64 bytes of fifth
// bits for Q5), then 16 rows' scales: d, m as fp16 (Q4), d as fp16 (Q8, Q5, U5), sc, m as u8 (K4),
// d of each 16-wide half and m as fp32 (K8), d as fp32, each half's integer sc as int16 (16 of sc0,
// then 16 of sc1) and m as fp32 (K6).
// Q6K: nibbles, 128 bytes of high pairs, then sc0 and sc1 as int8.
constexpr int64_t quant_bytes(QuantFormat f) {
  return f == Q4 || f == K4 ? 256 : f == Q5 ? 320 : f == Q6K ? 384 : 512;
}
constexpr int64_t block_bytes(QuantFormat f) {
  return f == Q4 ? 320 : f == Q5 ? 352 : f == Q8 || f == U5 ? 544 : f == I8 ? 512 : f == K4 ? 288 : f == Q6K ? 416 : 704;
}
constexpr int64_t K4_SUPER = 8;               // K4's and Q6K's blocks per super-block (GGUF's 256 weights)
constexpr int64_t super_halves(QuantFormat f) { return f == K4 ? 32 : f == Q6K ? 16 : 0; }  // fp16 per (tile, super)
// K4's and Q6K's activations: one scale per super-block of 256 (llama.cpp's Q8_K), so their integer
// sub-block scales sum in integers across it (quant_tile.h); every other format one per block of 32
constexpr bool super_activations(QuantFormat f) { return f == K4 || f == Q6K; }

struct PackedWeights {      // a quantized linear layer's weight, packed (kernels/quant.py, quant_linear.cpp)
  QuantFormat fmt;
  const uint8_t* blocks;    // [NT, KB, block bytes]
  const float* scale;       // [NT * 16] (I8)
  int64_t N, NT, KB;
  // Q8 only: its first u5_tiles tiles hold Q5_0 values as U5 bytes (u = q + 16, the same block
  // bytes as Q8's), a projection fused from Q5_0 and Q8_0 parts: they take U5's cheaper products
  int64_t u5_tiles = 0;
  // K4: [NT, KB / 8, 32] fp16, each (tile, super-block)'s 16 d, then 16 dmin; Q6K: [NT, KB / 8, 16] its d
  const uint16_t* super = nullptr;
  // the rows that follow, in another format (a projection fused from parts of mixed GGUF types,
  // each kept at its own width); every part but the last fills whole tiles
  const PackedWeights* next = nullptr;
};

struct Linear {             // a quantized linear layer: packed weight and optional bias [N]
  PackedWeights w;
  const float* bias;
};

struct ExpertWeights {       // E SwiGLU (GELU: Gemma-style) experts, each weight all experts' rows stacked
  PackedWeights gate, up;   // N = E I: expert e's rows e I .. (e + 1) I - 1, whole tiles (I % 16 == 0)
  PackedWeights down;       // N = E H
  int64_t E, I, H;
  bool gelu = false;
};

struct SparseMlp {          // a decoder layer's mixture of experts (models/moe.py)
  const float* router;      // [E, H] fp32: the experts' scores, float_linear
  ExpertWeights experts;
  int64_t k;                // experts a row takes
  bool renorm = false;      // the k softmax weights renormalised to sum to 1
  bool topk_softmax = false;  // top-k of the logits, softmax over those k (else softmax, then top-k)
  const float* shared_gate = nullptr;  // [H] Qwen2-MoE: the shared expert's (the layer's gate_up, down) sigmoid gate
};

struct RecurrentMixer;
struct DeltaNetSeqs;

struct DecoderLayer {       // one Llama-family decoder layer (and what Qwen3, Gemma 3 and MoE models add)
  const float* input_norm;  // [H]
  const float* post_norm;   // [H] before the MLP; with pre_ffn_norm (Gemma 3): after attention
  Linear qkv, o, gate_up, down;   // gate_up, down: the dense MLP (with sparse: the shared expert, or none)
  int64_t width = 0;        // the dense MLP's intermediate size (gate_up's rows / 2; 0: none)
  const SparseMlp* sparse = nullptr;    // the layer's experts in place of a dense MLP, or none
  const float* q_norm = nullptr;        // [D] each q head's RMSNorm before RoPE (QK-norm), or none;
  const float* k_norm = nullptr;        // [D]  with qk_whole (OLMoE) [Hq D] and [Hkv D]: all of q, all of k
  bool qk_whole = false;
  const float* pre_ffn_norm = nullptr;  // [H] Gemma 3: the norm before the MLP
  const float* post_ffn_norm = nullptr; // [H] Gemma 3: the norm after the MLP
  const float* cos = nullptr;           // [P, D/2] this layer's RoPE tables (none: the model's)
  const float* sin = nullptr;
  int64_t group = 0;                    // its KV group: the step's slots and rows of that group
  int64_t window = 0;                   // > 0: a sliding-window layer
  // Qwen3.5's gated attention: qkv gives each q head followed by its gate [2 Hq D | k | v]; the
  // attention's output is multiplied by sigmoid(gate) before o
  bool attn_gate = false;
  const RecurrentMixer* recurrent = nullptr;   // a recurrent layer (no attention, no KV), or none
};

struct DecoderModel {       // the decoder layers of a model, and what every layer shares
  const DecoderLayer* layers;
  int64_t L, H, I, Hq, Hkv, D;   // I: the widest dense MLP
  float eps;
  const float* final_norm;  // [H]
  const float* cos;         // [P, D/2]
  const float* sin;
  float scale = 0.f;        // attention's score scale (0: 1/sqrt(D))
  bool gelu = false;        // the MLP's gate: GELU-tanh (Gemma) instead of SiLU
  int64_t E = 0, k = 0;     // the most experts and experts a row takes of any sparse layer
  int64_t rot = 0;          // RoPE on the first rot dimensions of each head (cos, sin [P, rot / 2]; 0: D)
  int64_t W = 0;            // floats a row the widest recurrent or gated-attention layer needs (decoder.cpp)
};

struct DecoderStep {        // one step's rows, and the caches of every layer
  int64_t T;
  const int64_t* positions; // [T]
  const int64_t* const* slots;  // [groups][T] each KV group's slots for the step's tokens
  const Cache* caches;      // [L]
  const CacheOut* cache_out;// [L]
  const AttentionRows* rows;    // [groups] each group's tables (window 0: a layer sets its own)
  // The rows whose hidden states the caller wants (a prefill chunk: its last; R < 0: all T). The last
  // layer attends, projects and runs its MLP for these R rows only (its keys and values for all T).
  int64_t R = -1;
  const int64_t* keep = nullptr;      // [R] ascending
  const AttentionRows* kept = nullptr;  // [groups] rows with seq and len of the kept rows
  // [L, E] zeroed by the caller, or none: each sparse layer's (row, choice) pairs per expert this step
  // (the last layer's: of the kept rows, the only ones its experts run for)
  int64_t* expert_counts = nullptr;
  // [L]: a recurrent layer's sequences and state slots (query_lens, context_lens and slots shared by
  // every layer, each its own states); attention layers' entries unused; none without recurrent layers
  const DeltaNetSeqs* recurrent = nullptr;
};

struct DeltaNetLayer {      // one Gated DeltaNet layer's token mixer (gated_delta.cpp, layers/gated_delta.py)
  int64_t Hk, Hv, dk, dv;   // q/k heads and v heads (each q/k head serves Hv / Hk consecutive v heads), their sizes
  int64_t K;                // the causal conv's taps (at most DELTA_NET_MAX_TAPS); channels C = 2 Hk dk + Hv dv
  const float* conv_w;      // [C, K]
  const float* neg_A;       // [Hv] -exp(A_log)
  const float* dt_bias;     // [Hv]
  const float* norm_w = nullptr;  // [dv] the gated RMSNorm's weight, or none (out: the delta rule's output)
  float eps = 0.f;          // that norm's epsilon
  bool tiled = false;       // v head h reads q/k head h % Hk (llama.cpp's Qwen3.5 files), else h / (Hv / Hk)
};
constexpr int64_t DELTA_NET_MAX_TAPS = 8;

struct DeltaNetRows {       // a step's projections, rows of T tokens each with its own row stride (ld)
  const float* qkv;         // [T, C] (q | k | v, before the conv)
  const float* a;           // [T, Hv] the decay's input
  const float* b;           // [T, Hv] the write strength's input
  const float* z = nullptr; // [T, Hv dv] the output gate (with norm_w)
  int64_t qkv_ld, a_ld, b_ld, z_ld = 0;
};

struct DeltaNetSeqs {       // a step's sequences (sequence i's rows follow sequence i - 1's) and their states
  int64_t B;
  const int64_t* query_lens;    // [B] new tokens (> 0)
  const int64_t* context_lens;  // [B] tokens after this step: equal to query_lens where the sequence starts
  const int64_t* slots;         // [B] distinct state slots (a starting sequence's slot is zeroed first)
  float* conv_states;           // [S, K - 1, C] each slot's last K - 1 conv inputs
  float* states;                // [S, Hv, dk, dv] each slot's delta-rule state (a short conv: none)
  // [T] or none: row r's states (after it) also copied to slot snapshots[r] where >= 0 (a verify step's
  // drafts: the states after each draft row, for the runner to roll back to)
  const int64_t* snapshots = nullptr;
};

struct RecurrentMixer {     // a decoder layer's recurrent token mixer, in place of attention (decoder.cpp)
  // Gated DeltaNet (Qwen3.5, Qwen3-Next): the layer's qkv is in_proj_qkv [C rows], its o out_proj;
  // z [Hv dv], b and a [Hv] the other input projections
  DeltaNetLayer delta;
  Linear z, b, a;
  // LFM2's short conv (taps != nullptr): qkv is in_proj [3 H rows: B, C, x], o out_proj;
  // y = C conv(B x), a depthwise causal conv of K taps [H, K], no activation
  const float* taps = nullptr;
  int64_t K = 0;
};

// The floats of scratch decoder_stack needs for T rows (the caller owns it; reuse is fine).
inline int64_t decoder_workspace(const DecoderModel& m, int64_t T) {
  const int64_t qkv = (m.Hq + 2 * m.Hkv) * m.D;
  return T * (4 * m.H + qkv + (2 * m.Hq + m.Hkv) * m.D + 3 * m.I + (m.E ? m.E + 3 * m.k + 2 : 0) + m.W);
}

struct KernelTable {
  int abi;
  const char* isa;
  // q [T, Hq, D] -> out [T, Hq, D], over the cache, scaled dot products by `scale`
  void (*paged_attention)(const Runtime&, const float* q, int64_t T, int64_t Hq, const Cache&, const AttentionRows&,
                          float scale, float* out);
  // qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k [T, Hkv, D] rotated (NeoX halves; cos, sin [P, D/2]);
  // k and v written to the cache at slots [T] (an int8 cache: as write_kv)
  void (*rope_and_cache)(const Runtime&, const float* qkv, int64_t T, const int64_t* positions, const float* cos,
                         const float* sin, int64_t Hq, int64_t Hkv, int64_t D, const int64_t* slots,
                         const AttentionRows& rows, const CacheOut&, float* q, float* k);
  // k [T, Hkv, D], v (rows ldv floats apart) written to the cache at slots [T]; an int8 cache's key groups
  // that fill quantized and each sequence's partial groups kept in its tail slot (rows: tables, block_size,
  // seqs, num_seqs)
  void (*write_kv)(const Runtime&, const float* k, const float* v, int64_t ldv, int64_t T, int64_t Hkv, int64_t D,
                   const int64_t* slots, const AttentionRows& rows, const CacheOut&);
  // out = rmsnorm(x (+ residual)) * w, x [T, H]; sum = x + residual when residual is given
  void (*rms_norm)(const Runtime&, const float* x, const float* residual, const float* w, int64_t T, int64_t H,
                   float eps, float* out, float* sum);
  // x [T, 2I] (gate | up) -> out [T, I] = silu(gate) up
  void (*silu_and_mul)(const Runtime&, const float* x, int64_t T, int64_t I, float* out);
  // x [B, V] -> out [B], the first index of each row's largest value
  void (*argmax_rows)(const Runtime&, const float* x, int64_t B, int64_t V, int64_t* out);
  // out [B, V] = x where bit t % 32 of words[b, t / 32] is set, else -inf (a grammar's allowed tokens)
  void (*mask_rows)(const Runtime&, const float* x, int64_t B, int64_t V, const int32_t* words, float* out);
  // x [M, K] -> xq [M, K] int8, dx, sx [M, K / 32]: per block of 32, dx = max|x| / 127, sx = dx sum(xq)
  void (*quantize_activations)(const Runtime&, const float* x, int64_t M, int64_t K, int8_t* xq, float* dx,
                               float* sx);
  // y [M, N] = x [M, K] W^T (+ bias [N])
  void (*quant_linear)(const Runtime&, const float* x, int64_t M, int64_t K, const PackedWeights&,
                       const float* bias, float* y);
  // the int8 dot-product peak of rt.threads threads, GOP/s (2 per multiply-add)
  double (*int8_peak_gops)(const Runtime&, int64_t iters);
  // out [T, H] (with step.keep: [R, H]) = the final-normed hidden states after every decoder layer,
  // from x [T, H]; writes the step's keys and values to every layer's cache; workspace:
  // decoder_workspace(m, T) floats
  void (*decoder_stack)(const Runtime&, const DecoderModel&, const DecoderStep&, const float* x, float* workspace,
                        float* out);
  // x [T, 2I] (gate | up) -> out [T, I] = gelu_tanh(gate) up
  void (*gelu_and_mul)(const Runtime&, const float* x, int64_t T, int64_t I, float* out);
  // out [T, K] = rows ids [T] of a packed weight in fp32 (an embedding kept in its blocks)
  void (*dequantize_rows)(const Runtime&, const PackedWeights& w, const int64_t* ids, int64_t T, float* out);
  // GGUF rows raw [N, K / 256 super-blocks] of type GGUF_Q4_K or GGUF_Q6_K -> the k4 or q6k layout:
  // blocks [ceil(N / 16), K / 32, 288 or 416] bytes, side [ceil(N / 16), K / 256, 32 or 16] fp16 bits
  void (*repack_gguf)(const Runtime&, int64_t type, const uint8_t* raw, int64_t N, int64_t K, uint8_t* blocks,
                      uint16_t* side);
  // out [T, H] = sum over j of weights[t, j] expert_{ids[t, j]}(x[t]) in the order j = 0 .. k - 1,
  // x [T, H], ids [T, k] int64 in 0 .. E - 1, weights [T, k]; rows grouped by expert, only the chosen
  // experts' weights read; each row's bits do not depend on the other rows (expert_mlp.cpp)
  void (*expert_mlp)(const Runtime&, const float* x, int64_t T, const int64_t* ids, const float* weights, int64_t k,
                     const ExpertWeights& ex, float* out);
  // out [T, N] = x [T, K] w [N, K]^T in fp32, each row's bits independent of the other rows
  void (*float_linear)(const Runtime&, const float* x, int64_t T, int64_t K, const float* w, int64_t N, float* out);
  // a router's logits [T, E] -> each row's k experts ids [T, k] and weights [T, k], as transformers
  // routes: softmax over E, then the k largest (ties: the lower id first), renormalised with renorm;
  // with topk_softmax the k largest logits, then a softmax over them
  void (*moe_route)(const Runtime&, const float* logits, int64_t T, int64_t E, int64_t k, bool renorm,
                    bool topk_softmax, float* weights, int64_t* ids);
  // out [T, Hv, dv] = the Gated DeltaNet's mix of a step's rows (causal conv from each slot's conv state,
  // SiLU, L2-normed q and k, the gated delta rule, then with norm_w the gated RMSNorm times silu(z));
  // both states advanced past the rows; mixed: [T, C] floats of scratch
  void (*delta_net_mix)(const Runtime&, const DeltaNetLayer&, const DeltaNetRows&, int64_t T, const DeltaNetSeqs&,
                        float* mixed, float* out);
};

constexpr int64_t GGUF_Q4_K = 12, GGUF_Q6_K = 14;   // ggml's type ids

}  // namespace pw

extern "C" const pw::KernelTable* pw_kernel_table();
