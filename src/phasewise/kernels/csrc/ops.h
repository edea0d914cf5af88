// phasewise's C++ CPU kernels, compiled into one torch extension (see kernels/build.py).
// Each op has a pure-PyTorch reference in the Python package; tests compare the two.
#pragma once
#include <torch/extension.h>

#include <vector>

// paged_attention.cpp: query rows over the paged KV cache, read in place.
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor row_seq, torch::Tensor row_len,
                              int64_t block_size, double scale, c10::optional<torch::Tensor> k_scale,
                              c10::optional<torch::Tensor> v_scale);

// cpu_ops.cpp: the model's fused non-matmul ops.
std::vector<torch::Tensor> rope_and_cache(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos,
                                          torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                                          torch::Tensor slots, int64_t Hq, int64_t Hkv,
                                          c10::optional<torch::Tensor> k_scale,
                                          c10::optional<torch::Tensor> v_scale);
std::vector<torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                    c10::optional<torch::Tensor> residual);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor argmax_rows(torch::Tensor x);

// quant_linear.cpp: linear layers on quantized weights (AVX-512 VNNI; has_vnni() says if built in).
bool has_vnni();
double int8_peak_gops(int64_t iters);
std::vector<torch::Tensor> quantize_activations(torch::Tensor x);
torch::Tensor quant_linear(torch::Tensor x, int64_t fmt, int64_t N, torch::Tensor blocks,
                           c10::optional<torch::Tensor> scale, c10::optional<torch::Tensor> bias);
