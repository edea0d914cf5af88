// The decoder layers of a Llama-family model in one call per step (the paged-attention kernel
// serves every row: decodes and prompt chunks). The Python model calls it instead of looping
// over its layers: the same ops in the same order (RMSNorm + residual,
// quantized qkv, RoPE + cache write, paged attention, o, RMSNorm + residual, gate_up, SiLU·mul,
// down), without the per-op cost of Python (about 80 µs a layer on this project's machine).
#include "decoder_stack.h"

#include <cmath>

namespace {

torch::Tensor linear(const KernelSet& k, const torch::Tensor& x, const QuantLinearArgs& w) {
  return k.quant_linear(x, std::get<0>(w), std::get<1>(w), std::get<2>(w), std::get<3>(w), std::get<4>(w));
}

c10::optional<torch::Tensor> at_or_none(const std::vector<torch::Tensor>& v, size_t i) {
  return i < v.size() ? c10::optional<torch::Tensor>(v[i]) : c10::nullopt;
}

}  // namespace

DecoderStack::DecoderStack(std::shared_ptr<KernelSet> kernels, std::vector<LayerArgs> layers,
                           torch::Tensor final_norm, torch::Tensor cos, torch::Tensor sin, int64_t Hq, int64_t Hkv,
                           int64_t D, double eps)
    : k_(std::move(kernels)), layers_(std::move(layers)), final_norm_(std::move(final_norm)), cos_(std::move(cos)),
      sin_(std::move(sin)), Hq_(Hq), Hkv_(Hkv), D_(D), eps_(eps) {}

torch::Tensor DecoderStack::forward(torch::Tensor x, torch::Tensor positions, torch::Tensor slots,
                                    const std::vector<std::vector<torch::Tensor>>& kv, torch::Tensor tables,
                                    torch::Tensor row_seq, torch::Tensor row_len, int64_t block_size) const {
  TORCH_CHECK(kv.size() == layers_.size(), "one KV cache per layer");
  const int64_t T = x.size(0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D_));
  torch::Tensor residual;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const LayerArgs& L = layers_[i];
    const auto& cache = kv[i];
    const KernelSet& k = *k_;
    auto normed = k.rms_norm(x, std::get<0>(L), eps_, i ? c10::optional<torch::Tensor>(residual) : c10::nullopt);
    residual = i ? normed[1] : x;
    auto qk = k.rope_and_cache(linear(k, normed[0], std::get<2>(L)), positions, cos_, sin_, cache[0], cache[1],
                               slots, Hq_, Hkv_, at_or_none(cache, 2), at_or_none(cache, 3));
    auto attn = k.paged_attention(qk[0], cache[0], cache[1], tables, row_seq, row_len, block_size, scale,
                                  at_or_none(cache, 2), at_or_none(cache, 3));
    normed = k.rms_norm(linear(k, attn.view({T, Hq_ * D_}), std::get<3>(L)), std::get<1>(L), eps_, residual);
    residual = normed[1];
    x = linear(k, k.silu_and_mul(linear(k, normed[0], std::get<4>(L))), std::get<5>(L));
  }
  return k_->rms_norm(x, final_norm_, eps_, residual)[0];
}
