// DecoderStack: a Llama-family model's decoder layers with quantized weights, run in C++ by the
// kernel library's decoder_stack (decoder.cpp); this class holds the weights and checks the tensors.
#pragma once
#include "kernel_set.h"

#include <memory>

#include <tuple>
#include <vector>

// A QuantLinear's kernel arguments: format id, output features, packed blocks, scale, bias.
using QuantLinearArgs = std::tuple<int64_t, int64_t, torch::Tensor, c10::optional<torch::Tensor>,
                                   c10::optional<torch::Tensor>>;
// One layer: input norm weight, post-attention norm weight, qkv, o, gate_up, down.
using LayerArgs = std::tuple<torch::Tensor, torch::Tensor, QuantLinearArgs, QuantLinearArgs, QuantLinearArgs,
                             QuantLinearArgs>;

class DecoderStack {
 public:
  DecoderStack(std::shared_ptr<KernelSet> kernels, std::vector<LayerArgs> layers, torch::Tensor final_norm,
               torch::Tensor cos, torch::Tensor sin, int64_t Hq, int64_t Hkv, int64_t D, double eps);

  // x: [T, hidden] embedded tokens; positions, slots: [T] int64; kv: per layer (k, v[, k_scale, v_scale]);
  // tables, row_seq, row_len: the paged-attention kernel's rows (every row of the batch).
  // Returns the final-normed hidden states [T, hidden].
  torch::Tensor forward(torch::Tensor x, torch::Tensor positions, torch::Tensor slots,
                        const std::vector<std::vector<torch::Tensor>>& kv, torch::Tensor tables,
                        torch::Tensor row_seq, torch::Tensor row_len, int64_t block_size) const;

 private:
  std::shared_ptr<KernelSet> k_;
  std::vector<LayerArgs> layers_;             // keeps the tensors behind model_'s pointers alive
  torch::Tensor final_norm_, cos_, sin_;
  std::vector<pw::DecoderLayer> views_;
  pw::DecoderModel model_;
};
