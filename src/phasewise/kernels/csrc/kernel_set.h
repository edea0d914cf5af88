// KernelSet: one ISA level's kernel library (kernels.h), loaded with dlopen, behind torch tensors.
// Each method checks its tensors, then calls the library's function with raw pointers and the
// caller's torch thread count. The only torch-aware code besides the decoder stack.
#pragma once
#include "kernels.h"

#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

// A packed weight's tensors checked against its format (quant_linear.cpp's layout): blocks u8
// [NT, KB, BB]; scale fp32 [NT * 16] (I8) or fp16 [NT, KB / 8, 32 or 16] (K4's, Q6K's super-blocks).
pw::PackedWeights packed_weights(int64_t fmt, int64_t N, const torch::Tensor& blocks,
                                 const c10::optional<torch::Tensor>& scale, int64_t u5_tiles);
// The further parts of a fused projection of mixed types: (format, rows, blocks, scale) each, after
// a first part of `first` rows (whole tiles); the parts go into `parts` (its addresses must not
// move), each linked to the next, and the first part's `next` is returned.
using PartArgs = std::tuple<int64_t, int64_t, torch::Tensor, c10::optional<torch::Tensor>>;
const pw::PackedWeights* link_parts(const std::vector<PartArgs>& rest, int64_t first, int64_t K,
                                    std::vector<pw::PackedWeights>& parts);

// Stacked expert weights (each all experts' rows: gate, up [E I, H], down [E H, I]) checked and viewed.
pw::ExpertWeights expert_weights(const PartArgs& gate, const PartArgs& up, const PartArgs& down, int64_t experts,
                                 int64_t H, bool gelu);

// A step's B sequences over a pool of S state slots: new tokens n, tokens after the step ctx (0 < n <=
// ctx) and distinct slots, their rows summing to T; snapshots (or nullptr): per row -1 or a free slot.
void check_sequences(int64_t B, const int64_t* n, const int64_t* ctx, const int64_t* slot, int64_t T,
                     const int64_t* snap, int64_t S);

// A layer's KV cache as the kernels take it (runner/kv_cache.py): (k, v) fp32 [slots, Hkv, D], or an int8
// cache's (k, v int8, k_groups fp32 [slots / 16, Hkv, 2, D], v_scale fp32 [slots, Hkv], tails fp32 [2 S, 16,
// Hkv, D], tail_groups int64 [S, 2]), or an int4 cache's (k, v uint8 [slots, Hkv, D / 2], k_groups fp16
// [slots / 64, Hkv, 2, D], v_scale fp16 [slots, Hkv, D / 32], tails fp32 [2 S, 2, 64, Hkv, D], tail_groups),
// checked; *tail_slots = S (0: fp32).
pw::CacheOut cache_tensors(const std::vector<torch::Tensor>& kv, int64_t Hkv, int64_t D, int64_t* tail_slots);
pw::Cache cache_reader(const pw::CacheOut& c, int64_t Hkv, int64_t D, const float* fresh);
// The head size of a layer's cache (an int4 cache holds two codes a byte).
int64_t cache_head_size(const std::vector<torch::Tensor>& kv);
// A quantized cache's sequences (seqs [N, 4]: start, new tokens, first row, tail slot; N the tables' rows)
// checked against the tables (blocks of whole key groups of `group` tokens), tail slots and the step's
// fresh_rows keys; with row_seq, row_len: that no row of T attends past its sequence's new tokens.
void check_kv_seqs(const torch::Tensor& seqs, const torch::Tensor& tables, int64_t block_size, int64_t group,
                   int64_t tail_slots, int64_t fresh_rows, const int64_t* row_seq, const int64_t* row_len, int64_t T);

class KernelSet {
 public:
  explicit KernelSet(const std::string& library);
  std::string isa() const { return table_->isa; }

  torch::Tensor paged_attention(torch::Tensor q, const std::vector<torch::Tensor>& kv, torch::Tensor block_tables,
                                torch::Tensor row_seq, torch::Tensor row_len, torch::Tensor seqs, int64_t block_size,
                                double scale, c10::optional<torch::Tensor> fresh, int64_t window,
                                c10::optional<torch::Tensor> fresh_v) const;
  std::vector<torch::Tensor> rope_and_cache(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos,
                                            torch::Tensor sin, const std::vector<torch::Tensor>& kv,
                                            torch::Tensor slots, int64_t Hq, int64_t Hkv, torch::Tensor block_tables,
                                            torch::Tensor seqs, int64_t block_size) const;
  void write_kv(torch::Tensor k, torch::Tensor v, const std::vector<torch::Tensor>& kv, torch::Tensor slots,
                torch::Tensor block_tables, torch::Tensor seqs, int64_t block_size) const;
  std::vector<torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                      c10::optional<torch::Tensor> residual) const;
  torch::Tensor silu_and_mul(torch::Tensor x, bool gelu) const;
  torch::Tensor argmax_rows(torch::Tensor x) const;
  torch::Tensor mask_rows(torch::Tensor x, torch::Tensor words) const;
  std::vector<torch::Tensor> quantize_activations(torch::Tensor x) const;
  torch::Tensor quant_linear(torch::Tensor x, int64_t fmt, int64_t N, torch::Tensor blocks,
                             c10::optional<torch::Tensor> scale, c10::optional<torch::Tensor> bias,
                             int64_t u5_tiles, const std::vector<PartArgs>& rest) const;
  std::vector<torch::Tensor> repack_gguf(int64_t type, torch::Tensor raw, int64_t N, int64_t K) const;
  torch::Tensor dequantize_rows(torch::Tensor ids, int64_t fmt, int64_t N, torch::Tensor blocks,
                                c10::optional<torch::Tensor> scale) const;
  torch::Tensor expert_mlp(torch::Tensor x, torch::Tensor ids, torch::Tensor weights, const PartArgs& gate,
                           const PartArgs& up, const PartArgs& down, int64_t experts, bool gelu) const;
  torch::Tensor float_linear(torch::Tensor x, torch::Tensor weight) const;
  std::vector<torch::Tensor> moe_route(torch::Tensor logits, int64_t k, bool renorm, bool topk_softmax) const;
  torch::Tensor delta_net_mix(torch::Tensor qkv, torch::Tensor a, torch::Tensor b, torch::Tensor conv_w,
                              torch::Tensor neg_A, torch::Tensor dt_bias, torch::Tensor conv_states,
                              torch::Tensor states, const std::vector<int64_t>& query_lens,
                              const std::vector<int64_t>& context_lens, const std::vector<int64_t>& slots,
                              c10::optional<torch::Tensor> z, c10::optional<torch::Tensor> norm_w, double eps,
                              bool tiled) const;
  double int8_peak_gops(int64_t iters) const;
  const pw::KernelTable& table() const { return *table_; }

 private:
  const pw::KernelTable* table_;
};
