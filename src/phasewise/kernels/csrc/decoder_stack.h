// DecoderStack: a Llama-family model's decoder layers with quantized weights, run in C++ by the
// kernel library's decoder_stack (decoder.cpp); this class holds the weights and checks the tensors.
#pragma once
#include "kernel_set.h"

#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

// A QuantLinear's kernel arguments: format id, output features (all parts'), packed blocks, scale,
// bias, the leading tiles that hold U5 bytes (PackedWeights::u5_tiles), and the further parts.
using QuantLinearArgs = std::tuple<int64_t, int64_t, torch::Tensor, c10::optional<torch::Tensor>,
                                   c10::optional<torch::Tensor>, int64_t, std::vector<PartArgs>>;
// One layer: input norm weight, post-attention norm weight, qkv, o, gate_up, down (the dense MLP; a
// sparse layer's shared expert, or none).
using LinearOpt = c10::optional<QuantLinearArgs>;
using LayerArgs = std::tuple<torch::Tensor, torch::Tensor, QuantLinearArgs, QuantLinearArgs, LinearOpt, LinearOpt>;
// What Qwen3 and Gemma 3 add to a layer (each optional): q_norm, k_norm [D], pre- and post-MLP norms
// [H], the layer's cos and sin [P, D/2], its KV group and its window (0: none).
using Opt = c10::optional<torch::Tensor>;
using LayerExtras = std::tuple<Opt, Opt, Opt, Opt, Opt, Opt, int64_t, int64_t>;
// A sparse layer's experts (kernels.h SparseMlp): router fp32 [E, H], the stacked gate, up and down,
// k, renorm, topk_softmax, and the shared expert's gate [1, H] (Qwen2-MoE) or none.
using SparseArgs = std::tuple<torch::Tensor, PartArgs, PartArgs, PartArgs, int64_t, bool, bool, Opt>;

// A recurrent layer's mixer (kernels.h RecurrentMixer; the layer's qkv is its input projection, o its
// out_proj): a Gated DeltaNet's z, b, a, conv taps [C, K], -exp(A_log), dt_bias [Hv], gated norm [dv],
// Hk, Hv, dk, dv, tiled v heads and the norm's eps; or LFM2's short conv: no z, b, a, taps [H, K].
using MixerArgs = std::tuple<LinearOpt, LinearOpt, LinearOpt, torch::Tensor, Opt, Opt, Opt, int64_t, int64_t, int64_t,
                             int64_t, bool, double>;
using MixerOpt = c10::optional<MixerArgs>;

// One decoder layer as the binding takes it: LayerArgs' fields, LayerExtras', the sparse MLP or none,
// the recurrent mixer or none, and a gated attention's flag. Python builds it as kernel_api.StackLayer
// (StackSparse for SparseArgs, StackMixer for MixerArgs): the same fields in the same order, which
// tests/test_decoder_stack.py checks against these names.
using LayerSpec = std::tuple<torch::Tensor, torch::Tensor, QuantLinearArgs, QuantLinearArgs, LinearOpt, LinearOpt, Opt,
                             Opt, Opt, Opt, Opt, Opt, int64_t, int64_t, c10::optional<SparseArgs>, MixerOpt, bool>;
inline const std::vector<std::string> LAYER_SPEC_FIELDS = {
    "input_norm", "post_attention_norm", "qkv", "o", "gate_up", "down", "q_norm", "k_norm",
    "pre_ffn_norm", "post_ffn_norm", "cos", "sin", "kv_group", "window", "sparse", "mixer", "attn_gate"};
inline const std::vector<std::string> SPARSE_FIELDS = {"router", "gate", "up", "down", "k", "renorm",
                                                       "topk_softmax", "shared_gate"};
inline const std::vector<std::string> MIXER_FIELDS = {"z", "b", "a", "conv", "neg_A", "dt_bias", "norm",
                                                      "Hk", "Hv", "dk", "dv", "tiled", "eps"};

class DecoderStack {
 public:
  // extras: empty, or one per layer; scale: attention's (0: 1/sqrt(D)); gelu: a GELU-tanh gate;
  // sparse: empty, or one per layer (none: a dense layer). A q_norm of Hq D values norms all of q.
  DecoderStack(std::shared_ptr<KernelSet> kernels, std::vector<LayerArgs> layers, torch::Tensor final_norm,
               torch::Tensor cos, torch::Tensor sin, int64_t Hq, int64_t Hkv, int64_t D, double eps,
               std::vector<LayerExtras> extras, double scale, bool gelu,
               std::vector<c10::optional<SparseArgs>> sparse = {}, std::vector<MixerOpt> mixers = {},
               std::vector<bool> gates = {});
  // The same from one LayerSpec per layer.
  static DecoderStack from_specs(std::shared_ptr<KernelSet> kernels, const std::vector<LayerSpec>& layers,
                                 torch::Tensor final_norm, torch::Tensor cos, torch::Tensor sin, int64_t Hq,
                                 int64_t Hkv, int64_t D, double eps, double scale, bool gelu);

  // x: [T, hidden] embedded tokens; positions: [T] int64; kv: per layer its cache (cache_tensors), a
  // recurrent layer's its states (conv [S, K - 1, C], delta rule [S, Hv, dk, dv]; a short conv: conv only);
  // per KV group: slots [T] int64 and the paged-attention kernel's rows (tables, row_seq, row_len).
  // Returns the final-normed hidden states [T, hidden], or with keep (int64 [R], ascending) those of
  // its rows [R, hidden] (the last layer computes only them past its keys and values). expert_counts
  // (int64 [L, E], a model with experts): each sparse layer's choices per expert, written. With
  // recurrent layers, sequences: int64 [3, B] each sequence's new tokens, tokens after the step and
  // state slot; snapshots: int64 [T] or none, the slot each row's states are also copied to (-1: none).
  // An int8 cache (kv[i]: k, v, k_groups, v_scale, tails, tail_groups) needs kv_seqs: int64 [B, 4] each
  // sequence's first new position, new tokens, first row and tail slot.
  torch::Tensor forward(torch::Tensor x, torch::Tensor positions, const std::vector<torch::Tensor>& slots,
                        const std::vector<std::vector<torch::Tensor>>& kv, const std::vector<torch::Tensor>& tables,
                        const std::vector<torch::Tensor>& row_seq, const std::vector<torch::Tensor>& row_len,
                        int64_t block_size, const Opt& keep, const Opt& expert_counts, const Opt& sequences,
                        const Opt& snapshots, const Opt& kv_seqs) const;

 private:
  std::vector<pw::DeltaNetSeqs> recurrent_states(const std::vector<std::vector<torch::Tensor>>& kv, int64_t T,
                                                 const Opt& sequences, const Opt& snapshots) const;

  std::shared_ptr<KernelSet> k_;
  std::vector<LayerArgs> layers_;             // keeps the tensors behind model_'s pointers alive
  std::vector<LayerExtras> extras_;
  std::vector<c10::optional<SparseArgs>> sparse_args_;
  std::vector<std::unique_ptr<pw::SparseMlp>> sparse_;
  std::vector<MixerOpt> mixer_args_;
  std::vector<std::unique_ptr<pw::RecurrentMixer>> mixers_;
  int64_t groups_ = 1;
  torch::Tensor final_norm_, cos_, sin_;
  std::vector<pw::DecoderLayer> views_;
  std::vector<std::unique_ptr<std::vector<pw::PackedWeights>>> parts_;   // the fused weights' further parts
  pw::DecoderModel model_;
  // Scratch kept from step to step (25.7 MB for a 512-token Gemma 3 step): a fresh tensor each
  // step was fresh pages, and zeroing them in the kernel was 3% of a prefill. One step at a time.
  std::unique_ptr<std::mutex> mu_ = std::make_unique<std::mutex>();
  mutable torch::Tensor ws_;
};
