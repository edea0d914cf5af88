// KernelSet: tensor checks, then one call into the ISA level's library (see kernel_set.h).
#include "kernel_set.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

namespace {

pw::Runtime runtime() { return pw::Runtime{at::get_num_threads()}; }

template <typename T>
T* ptr(const c10::optional<torch::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

}  // namespace

pw::PackedWeights packed_weights(int64_t fmt, int64_t N, const torch::Tensor& blocks,
                                 const c10::optional<torch::Tensor>& scale, int64_t u5_tiles) {
  TORCH_CHECK(pw::known_format(fmt), "unknown format ", fmt);
  const auto f = static_cast<pw::QuantFormat>(fmt);
  TORCH_CHECK(blocks.dim() == 3 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.device().is_cpu(),
              "blocks: u8 [NT, KB, BB] on the CPU");
  TORCH_CHECK(blocks.size(2) == pw::block_bytes(f), "block bytes do not match the format");
  const int64_t NT = blocks.size(0), KB = blocks.size(1);
  TORCH_CHECK(N > (NT - 1) * 16 && N <= NT * 16, "N does not match the tiles");
  TORCH_CHECK(u5_tiles == 0 || (f == pw::Q8 && u5_tiles > 0 && u5_tiles <= NT), "u5_tiles: Q8 tiles 0..NT");
  pw::PackedWeights w{f, blocks.data_ptr<uint8_t>(), nullptr, N, NT, KB, u5_tiles};
  if (f == pw::I8) {
    TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kFloat && scale->is_contiguous() &&
                scale->numel() == NT * 16, "scale: fp32 [N]");
    w.scale = scale->data_ptr<float>();
  }
  if (const int64_t h = pw::super_halves(f)) {
    TORCH_CHECK(KB % pw::K4_SUPER == 0 && scale.has_value() && scale->scalar_type() == at::kHalf &&
                scale->is_contiguous() && scale->dim() == 3 && scale->size(0) == NT &&
                scale->size(1) == KB / pw::K4_SUPER && scale->size(2) == h, "scale: fp16 [NT, KB / 8, ", h, "]");
    w.super = reinterpret_cast<const uint16_t*>(scale->data_ptr<at::Half>());
  }
  return w;
}

const pw::PackedWeights* link_parts(const std::vector<PartArgs>& rest, int64_t first, int64_t K,
                                    std::vector<pw::PackedWeights>& parts) {
  if (rest.empty()) return nullptr;
  TORCH_CHECK(first > 0 && first % 16 == 0, "every part of a fused weight but the last fills whole tiles");
  parts.reserve(parts.size() + rest.size());
  const size_t start = parts.size();
  for (size_t i = 0; i < rest.size(); ++i) {
    const auto& [fmt, n, blocks, scale] = rest[i];
    TORCH_CHECK(i + 1 == rest.size() || n % 16 == 0, "every part of a fused weight but the last fills whole tiles");
    parts.push_back(packed_weights(fmt, n, blocks, scale, 0));
    TORCH_CHECK(parts.back().KB * pw::QK == K, "the parts of a fused weight share K");
  }
  for (size_t i = start; i + 1 < parts.size(); ++i) parts[i].next = &parts[i + 1];
  return &parts[start];
}

KernelSet::KernelSet(const std::string& library) {
  // RTLD_LOCAL: every level's library defines the same names; the table is the way in. Never closed.
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(handle != nullptr, "cannot load ", library, ": ", dlerror());
  auto get = reinterpret_cast<const pw::KernelTable* (*)()>(dlsym(handle, "pw_kernel_table"));
  TORCH_CHECK(get != nullptr, library, " has no kernel table");
  table_ = get();
  TORCH_CHECK(table_->abi == pw::ABI_VERSION, library, " was built for another version of the bindings");
}

// q: [T, Hq, D]; kv: the layer's cache (cache_tensors); block_tables: [num_seqs, max_blocks] int64; row_seq,
// row_len: [T] int64 (row t attends over the first row_len[t] tokens of sequence row_seq[t]); seqs: [num_seqs,
// 4] int64 and fresh [T', Hkv, D] fp32, a quantized cache's sequences and the step's keys (int4: fresh_v, its
// values, too). Returns [T, Hq, D].
// window > 0: each row sees only its last `window` tokens.
torch::Tensor KernelSet::paged_attention(torch::Tensor q, const std::vector<torch::Tensor>& kv,
                                         torch::Tensor block_tables, torch::Tensor row_seq, torch::Tensor row_len,
                                         torch::Tensor seqs, int64_t block_size, double scale,
                                         c10::optional<torch::Tensor> fresh, int64_t window,
                                         c10::optional<torch::Tensor> fresh_v) const {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.is_contiguous(), "q: fp32 [T, Hq, D]");
  TORCH_CHECK(!kv.empty() && kv[0].dim() == 3 && q.size(1) % kv[0].size(1) == 0, "caches [slots, Hkv, D]");
  const int64_t T = q.size(0), Hkv = kv[0].size(1), D = q.size(2);
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.is_contiguous() &&
              row_seq.scalar_type() == at::kLong && row_seq.is_contiguous() && row_seq.numel() == T &&
              row_len.scalar_type() == at::kLong && row_len.is_contiguous() && row_len.numel() == T,
              "tables: int64 [sequences, blocks]; row_seq, row_len: int64 [T]");
  int64_t tail_slots = 0;
  const pw::CacheOut out_view = cache_tensors(kv, Hkv, D, &tail_slots);
  pw::AttentionRows rows{block_tables.data_ptr<int64_t>(), block_tables.size(1), row_seq.data_ptr<int64_t>(),
                         row_len.data_ptr<int64_t>(), block_size, window};
  TORCH_CHECK(window >= 0, "window >= 0 (0: none)");
  const float* keys = nullptr;
  if (out_view.quantized()) {
    TORCH_CHECK(fresh.has_value() && fresh->scalar_type() == at::kFloat && fresh->is_contiguous() &&
                fresh->dim() == 3 && fresh->size(1) == Hkv && fresh->size(2) == D, "a quantized cache: fresh fp32 [T, Hkv, D]");
    check_kv_seqs(seqs, block_tables, block_size, out_view.group(), tail_slots, fresh->size(0), rows.seq, rows.len, T);
    keys = fresh->data_ptr<float>();
    rows.seqs = seqs.data_ptr<int64_t>(), rows.num_seqs = seqs.size(0);
  }
  pw::Cache reader = cache_reader(out_view, Hkv, D, keys);
  if (out_view.k4 != nullptr) {
    TORCH_CHECK(fresh_v.has_value() && fresh_v->scalar_type() == at::kFloat && fresh_v->is_contiguous() &&
                fresh_v->sizes() == fresh->sizes(), "an int4 cache: fresh_v fp32 [T, Hkv, D], the step's values");
    reader.fresh_v = fresh_v->data_ptr<float>(), reader.ldv = Hkv * D;
  }
  auto out = torch::empty_like(q);
  table_->paged_attention(runtime(), q.data_ptr<float>(), T, q.size(1), reader, rows, static_cast<float>(scale),
                          out.data_ptr<float>());
  return out;
}

// The step's keys k [T, Hkv, D] and values v into the cache at slots [T] (int64); a quantized cache's sequences
// as paged_attention takes them.
void KernelSet::write_kv(torch::Tensor k, torch::Tensor v, const std::vector<torch::Tensor>& kv, torch::Tensor slots,
                         torch::Tensor block_tables, torch::Tensor seqs, int64_t block_size) const {
  TORCH_CHECK(k.scalar_type() == at::kFloat && k.dim() == 3 && k.is_contiguous() && v.sizes() == k.sizes() &&
              v.scalar_type() == at::kFloat && v.is_contiguous(), "k, v: fp32 [T, Hkv, D]");
  const int64_t T = k.size(0), Hkv = k.size(1), D = k.size(2);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T, "slots: int64 [T]");
  int64_t tail_slots = 0;
  const pw::CacheOut c = cache_tensors(kv, Hkv, D, &tail_slots);
  const int64_t S = kv[0].size(0), *sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sl[t] >= 0 && sl[t] < S, "a slot outside the cache");
  pw::AttentionRows rows{block_tables.data_ptr<int64_t>(), block_tables.size(1), nullptr, nullptr, block_size};
  if (c.quantized()) {
    TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.is_contiguous(),
                "tables: int64 [sequences, blocks]");
    check_kv_seqs(seqs, block_tables, block_size, c.group(), tail_slots, T, nullptr, nullptr, 0);
    rows.seqs = seqs.data_ptr<int64_t>(), rows.num_seqs = seqs.size(0);
  }
  table_->write_kv(runtime(), k.data_ptr<float>(), v.data_ptr<float>(), Hkv * D, T, Hkv, D, sl, rows, c);
}

// qkv: [T, (Hq + 2 Hkv) D]; positions: [T] int64; cos, sin: [P, D/2]; kv: the layer's cache; slots: [T]
// int64 (a quantized cache's tables and sequences as write_kv takes them). Returns rotated q [T, Hq, D] and k
// [T, Hkv, D]; k and v are written to the cache.
std::vector<torch::Tensor> KernelSet::rope_and_cache(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos,
                                                     torch::Tensor sin, const std::vector<torch::Tensor>& kv,
                                                     torch::Tensor slots, int64_t Hq, int64_t Hkv,
                                                     torch::Tensor block_tables, torch::Tensor seqs,
                                                     int64_t block_size) const {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && qkv.dim() == 2 && !kv.empty() && kv[0].dim() == 3, "fp32 qkv [T, width]");
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() && positions.is_contiguous() &&
              slots.is_contiguous(), "contiguous inputs");
  const int64_t T = qkv.size(0), D = cache_head_size(kv);
  TORCH_CHECK(qkv.size(1) == (Hq + 2 * Hkv) * D, "qkv width does not match the heads");
  int64_t tail_slots = 0;
  const pw::CacheOut c = cache_tensors(kv, Hkv, D, &tail_slots);
  pw::AttentionRows rows{block_tables.data_ptr<int64_t>(), block_tables.size(1), nullptr, nullptr, block_size};
  if (c.quantized()) {
    check_kv_seqs(seqs, block_tables, block_size, c.group(), tail_slots, T, nullptr, nullptr, 0);
    rows.seqs = seqs.data_ptr<int64_t>(), rows.num_seqs = seqs.size(0);
  }
  auto q = torch::empty({T, Hq, D}, qkv.options());
  auto k = torch::empty({T, Hkv, D}, qkv.options());
  table_->rope_and_cache(runtime(), qkv.data_ptr<float>(), T, positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
                         sin.data_ptr<float>(), Hq, Hkv, D, slots.data_ptr<int64_t>(), rows, c, q.data_ptr<float>(),
                         k.data_ptr<float>());
  return {q, k};
}

// x, residual (optional): [T, H]; weight: [H]. Returns (normed, x + residual) or (normed,).
std::vector<torch::Tensor> KernelSet::rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                               c10::optional<torch::Tensor> residual) const {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: fp32, contiguous [T, H]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == x.size(1),
              "weight: fp32 [H]");
  auto out = torch::empty_like(x);
  torch::Tensor sum;
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->is_contiguous() && residual->sizes() == x.sizes(),
                "residual like x");
    sum = torch::empty_like(x);
  }
  table_->rms_norm(runtime(), x.data_ptr<float>(), ptr<float>(residual), weight.data_ptr<float>(), x.size(0),
                   x.size(1), static_cast<float>(eps), out.data_ptr<float>(),
                   residual.has_value() ? sum.data_ptr<float>() : nullptr);
  if (residual.has_value()) return {out, sum};
  return {out};
}

// x: [T, 2I] (gate | up) -> [T, I] = silu(gate) * up, or gelu_tanh(gate) * up.
torch::Tensor KernelSet::silu_and_mul(torch::Tensor x, bool gelu) const {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "fp32, contiguous [T, 2I]");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto out = torch::empty({T, I}, x.options());
  (gelu ? table_->gelu_and_mul : table_->silu_and_mul)(runtime(), x.data_ptr<float>(), T, I, out.data_ptr<float>());
  return out;
}

// x: [B, V] fp32 -> [B] int64, the index of each row's largest value (the first, on ties), as torch.argmax.
torch::Tensor KernelSet::argmax_rows(torch::Tensor x) const {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "fp32, contiguous [B, V]");
  TORCH_CHECK(x.size(1) > 0 && x.size(1) < (int64_t{1} << 31), "0 < V < 2^31");
  auto out = torch::empty({x.size(0)}, x.options().dtype(at::kLong));
  table_->argmax_rows(runtime(), x.data_ptr<float>(), x.size(0), x.size(1), out.data_ptr<int64_t>());
  return out;
}

// x: [B, V] fp32, words: [B, ceil(V / 32)] int32 -> [B, V]: x where bit t % 32 of word t / 32 is set, else -inf.
torch::Tensor KernelSet::mask_rows(torch::Tensor x, torch::Tensor words) const {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: fp32, contiguous [B, V]");
  TORCH_CHECK(words.dim() == 2 && words.scalar_type() == at::kInt && words.is_contiguous() &&
                  words.size(0) == x.size(0) && words.size(1) == (x.size(1) + 31) / 32,
              "words: contiguous int32 [B, ceil(V / 32)]");
  auto out = torch::empty_like(x);
  table_->mask_rows(runtime(), x.data_ptr<float>(), x.size(0), x.size(1), words.data_ptr<int32_t>(),
                    out.data_ptr<float>());
  return out;
}

// x: [M, K] fp32 -> (xq [M, K] int8, dx [M, K/32], sx [M, K/32]); K a multiple of 32.
std::vector<torch::Tensor> KernelSet::quantize_activations(torch::Tensor x) const {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous fp32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), KB = K / pw::QK;
  TORCH_CHECK(K % pw::QK == 0, "K must be a multiple of 32");
  auto xq = torch::empty({M, K}, x.options().dtype(at::kChar));
  auto dx = torch::empty({M, KB}, x.options());
  auto sx = torch::empty({M, KB}, x.options());
  table_->quantize_activations(runtime(), x.data_ptr<float>(), M, K, xq.data_ptr<int8_t>(), dx.data_ptr<float>(),
                               sx.data_ptr<float>());
  return {xq, dx, sx};
}

// y [M, N] = x [M, K] @ W^T + bias, W packed as quant_linear.cpp describes (N rows of NT * 16).
torch::Tensor KernelSet::quant_linear(torch::Tensor x, int64_t fmt, int64_t N, torch::Tensor blocks,
                                      c10::optional<torch::Tensor> scale, c10::optional<torch::Tensor> bias,
                                      int64_t u5_tiles, const std::vector<PartArgs>& rest) const {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: fp32 [M, K]");
  int64_t first = N;
  for (const PartArgs& p : rest) first -= std::get<1>(p);
  pw::PackedWeights w = packed_weights(fmt, first, blocks, scale, u5_tiles);
  std::vector<pw::PackedWeights> parts;
  w.next = link_parts(rest, first, w.KB * pw::QK, parts);
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K == w.KB * pw::QK, "x has ", K, " columns, the weights ", w.KB * pw::QK);
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "bias: fp32 [N]");
  auto out = torch::empty({M, N}, x.options());
  table_->quant_linear(runtime(), x.data_ptr<float>(), M, K, w, ptr<float>(bias), out.data_ptr<float>());
  return out;
}

// raw [N, K / 256 * type bytes] uint8 GGUF rows (Q4_K or Q6_K) -> [blocks, side]: the k4 / q6k packed
// layout (kernels/quant.py), side as fp16.
std::vector<torch::Tensor> KernelSet::repack_gguf(int64_t type, torch::Tensor raw, int64_t N, int64_t K) const {
  TORCH_CHECK(type == pw::GGUF_Q4_K || type == pw::GGUF_Q6_K, "repack_gguf: Q4_K (12) or Q6_K (14), got ", type);
  const bool q6k = type == pw::GGUF_Q6_K;
  TORCH_CHECK(K > 0 && K % 256 == 0 && N > 0, "repack_gguf: K a multiple of 256, N > 0");
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.numel() == N * (K / 256) * (q6k ? 210 : 144),
              "repack_gguf: raw uint8 [N, K / 256 * type bytes], contiguous");
  const int64_t NT = (N + 15) / 16;
  auto blocks = torch::empty({NT, K / 32, q6k ? 416 : 288}, torch::kByte);
  auto side = torch::empty({NT, K / 256, q6k ? 16 : 32}, torch::kHalf);
  table_->repack_gguf(runtime(), type, raw.data_ptr<uint8_t>(), N, K, blocks.data_ptr<uint8_t>(),
                      reinterpret_cast<uint16_t*>(side.data_ptr<at::Half>()));
  return {blocks, side};
}

// ids [T] int64 (each in 0..N-1) -> [T, K] fp32: those rows of a weight packed as quant_linear takes it.
torch::Tensor KernelSet::dequantize_rows(torch::Tensor ids, int64_t fmt, int64_t N, torch::Tensor blocks,
                                         c10::optional<torch::Tensor> scale) const {
  TORCH_CHECK(ids.scalar_type() == at::kLong, "ids: int64");
  const pw::PackedWeights w = packed_weights(fmt, N, blocks, scale, 0);
  auto flat = ids.reshape(-1).contiguous();
  const int64_t* idp = flat.data_ptr<int64_t>();
  for (int64_t t = 0; t < flat.numel(); ++t) TORCH_CHECK(idp[t] >= 0 && idp[t] < N, "id ", idp[t], " outside 0..", N - 1);
  auto out = torch::empty({flat.numel(), w.KB * pw::QK}, torch::kFloat);
  table_->dequantize_rows(runtime(), w, idp, flat.numel(), out.data_ptr<float>());
  auto shape = ids.sizes().vec();
  shape.push_back(w.KB * pw::QK);
  return out.view(shape);
}

pw::ExpertWeights expert_weights(const PartArgs& gate, const PartArgs& up, const PartArgs& down, int64_t experts,
                                 int64_t H, bool gelu) {
  TORCH_CHECK(experts > 0, "experts > 0");
  auto stacked = [&](const PartArgs& part, const char* name) {
    const auto& [fmt, n, blocks, scale] = part;
    const pw::PackedWeights w = packed_weights(fmt, n, blocks, scale, 0);
    TORCH_CHECK(n % experts == 0 && (n / experts) % 16 == 0, name, ": ", experts, " experts of whole tiles");
    return w;
  };
  pw::ExpertWeights ex{stacked(gate, "gate"), stacked(up, "up"), stacked(down, "down"), experts, 0, H, gelu};
  ex.I = ex.gate.N / experts;
  TORCH_CHECK(ex.up.N == ex.gate.N && ex.gate.KB * pw::QK == H && ex.up.KB * pw::QK == H, "gate, up: [E I, H]");
  TORCH_CHECK(ex.down.N == experts * H && ex.down.KB * pw::QK == ex.I, "down: [E H, I]");
  for (const pw::PackedWeights* w : {&ex.gate, &ex.up, &ex.down})
    TORCH_CHECK(!pw::super_activations(w->fmt) || w->KB % pw::K4_SUPER == 0, "a K-quant's width is whole super-blocks");
  return ex;
}

// x [T, H] fp32, ids [T, k] int64 (each in 0..experts-1), weights [T, k] fp32 -> [T, H]; gate, up
// (format, experts x I rows, blocks, scale) and down (experts x H rows) each all experts' rows stacked.
torch::Tensor KernelSet::expert_mlp(torch::Tensor x, torch::Tensor ids, torch::Tensor weights, const PartArgs& gate,
                                    const PartArgs& up, const PartArgs& down, int64_t experts, bool gelu) const {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.device().is_cpu(), "x: fp32 [T, H] on the CPU");
  TORCH_CHECK(ids.scalar_type() == at::kLong && weights.scalar_type() == at::kFloat && ids.dim() == 2 &&
              ids.sizes() == weights.sizes() && ids.size(0) == x.size(0) && ids.size(1) > 0,
              "ids int64, weights fp32, both [T, k]");
  x = x.contiguous(), ids = ids.contiguous(), weights = weights.contiguous();
  const int64_t T = x.size(0), H = x.size(1), k = ids.size(1);
  const pw::ExpertWeights ex = expert_weights(gate, up, down, experts, H, gelu);
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i)
    TORCH_CHECK(idp[i] >= 0 && idp[i] < experts, "expert id ", idp[i], " outside 0..", experts - 1);
  auto out = torch::empty({T, H}, x.options());
  table_->expert_mlp(runtime(), x.data_ptr<float>(), T, idp, weights.data_ptr<float>(), k, ex, out.data_ptr<float>());
  return out;
}

// x [T, K] fp32 @ weight [N, K]^T -> [T, N] fp32, a row's bits independent of the other rows.
torch::Tensor KernelSet::float_linear(torch::Tensor x, torch::Tensor weight) const {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.dim() == 2 &&
              weight.dim() == 2 && x.size(1) == weight.size(1) && x.device().is_cpu() && weight.device().is_cpu(),
              "x [T, K], weight [N, K]: fp32 on the CPU");
  x = x.contiguous(), weight = weight.contiguous();
  auto out = torch::empty({x.size(0), weight.size(0)}, x.options());
  table_->float_linear(runtime(), x.data_ptr<float>(), x.size(0), x.size(1), weight.data_ptr<float>(), weight.size(0),
                       out.data_ptr<float>());
  return out;
}

namespace {

// rows [T, width] of fp32 on the CPU, each contiguous (a column slice of a wider projection is fine): the row stride
int64_t row_stride(const torch::Tensor& x, int64_t T, int64_t width, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() == 2 && x.size(0) == T &&
              x.size(1) == width && (x.stride(1) == 1 || width == 1), name, ": fp32 [", T, ", ", width, "] on the CPU, ",
              "each row contiguous");
  return x.stride(0);
}

}  // namespace

void check_sequences(int64_t B, const int64_t* n, const int64_t* ctx, const int64_t* slot, int64_t T,
                     const int64_t* snap, int64_t S) {
  std::vector<bool> taken(S, false);
  int64_t rows = 0;
  for (int64_t i = 0; i < B; ++i) {
    TORCH_CHECK(n[i] > 0 && ctx[i] >= n[i], "sequence ", i, ": 0 < new tokens <= tokens after the step");
    TORCH_CHECK(slot[i] >= 0 && slot[i] < S && !taken[slot[i]], "state slot ", slot[i], " outside 0..", S - 1,
                " or taken twice");
    taken[slot[i]] = true;
    rows += n[i];
  }
  TORCH_CHECK(rows == T, "the sequences' new tokens sum to ", rows, ", the step has ", T, " rows");
  for (int64_t r = 0; snap != nullptr && r < T; ++r)
    TORCH_CHECK(snap[r] < S && (snap[r] < 0 || !taken[snap[r]]), "snapshot slot ", snap[r], " outside 0..", S - 1,
                " or a running sequence's");
}

// qkv [T, C] (before the conv), a, b [T, Hv], z [T, Hv dv] (with norm_w [dv]); conv_w [C, K], neg_A = -exp(A_log)
// and dt_bias [Hv]; conv_states [S, K - 1, C], states [S, Hv, dk, dv] advanced in place; per sequence its new
// tokens, its tokens after the step (equal: it starts here) and its slot; `tiled`: v head h reads q/k head
// h % Hk. Returns [T, Hv, dv].
torch::Tensor KernelSet::delta_net_mix(torch::Tensor qkv, torch::Tensor a, torch::Tensor b, torch::Tensor conv_w,
                                       torch::Tensor neg_A, torch::Tensor dt_bias, torch::Tensor conv_states,
                                       torch::Tensor states, const std::vector<int64_t>& query_lens,
                                       const std::vector<int64_t>& context_lens, const std::vector<int64_t>& slots,
                                       c10::optional<torch::Tensor> z, c10::optional<torch::Tensor> norm_w,
                                       double eps, bool tiled) const {
  for (const torch::Tensor* t : {&conv_w, &neg_A, &dt_bias, &conv_states, &states})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->is_contiguous(),
                "weights and states: contiguous fp32 on the CPU");
  TORCH_CHECK(states.dim() == 4 && conv_states.dim() == 3 && conv_w.dim() == 2 &&
              conv_states.size(0) == states.size(0), "states [S, Hv, dk, dv], conv_states [S, K - 1, C], conv_w [C, K]");
  const int64_t S = states.size(0), Hv = states.size(1), dk = states.size(2), dv = states.size(3);
  const int64_t C = conv_states.size(2), K = conv_states.size(1) + 1, qk = C - Hv * dv;
  TORCH_CHECK(conv_w.size(0) == C && conv_w.size(1) == K && K <= pw::DELTA_NET_MAX_TAPS, "conv_w [C, K], K <= ",
              pw::DELTA_NET_MAX_TAPS);
  TORCH_CHECK(qk > 0 && qk % (2 * dk) == 0 && Hv % (qk / (2 * dk)) == 0, "C = 2 Hk dk + Hv dv with Hk dividing Hv");
  TORCH_CHECK(neg_A.numel() == Hv && dt_bias.numel() == Hv, "neg_A, dt_bias: [Hv]");
  const int64_t B = query_lens.size(), T = qkv.size(0);
  TORCH_CHECK(context_lens.size() == static_cast<size_t>(B) && slots.size() == static_cast<size_t>(B),
              "one query length, context length and slot per sequence");
  check_sequences(B, query_lens.data(), context_lens.data(), slots.data(), T, nullptr, S);
  const int64_t qkv_ld = row_stride(qkv, T, C, "qkv"), a_ld = row_stride(a, T, Hv, "a"), b_ld = row_stride(b, T, Hv, "b");
  pw::DeltaNetRows in{qkv.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(), nullptr, qkv_ld, a_ld, b_ld};
  pw::DeltaNetLayer L{qk / (2 * dk), Hv, dk, dv, K, conv_w.data_ptr<float>(), neg_A.data_ptr<float>(),
                      dt_bias.data_ptr<float>()};
  L.tiled = tiled;
  TORCH_CHECK(z.has_value() == norm_w.has_value(), "z and norm_w together");
  if (z.has_value()) {
    TORCH_CHECK(norm_w->scalar_type() == at::kFloat && norm_w->is_contiguous() && norm_w->numel() == dv, "norm_w: fp32 [dv]");
    in.z = z->data_ptr<float>(), in.z_ld = row_stride(*z, T, Hv * dv, "z");
    L.norm_w = norm_w->data_ptr<float>(), L.eps = static_cast<float>(eps);
  }
  const pw::DeltaNetSeqs seqs{B, query_lens.data(), context_lens.data(), slots.data(), conv_states.data_ptr<float>(),
                              states.data_ptr<float>()};
  auto mixed = torch::empty({T, C}, qkv.options());
  auto out = torch::empty({T, Hv, dv}, qkv.options());
  table_->delta_net_mix(runtime(), L, in, T, seqs, mixed.data_ptr<float>(), out.data_ptr<float>());
  return out;
}

double KernelSet::int8_peak_gops(int64_t iters) const {
  TORCH_CHECK(iters > 0, "iters must be positive");
  return table_->int8_peak_gops(runtime(), iters);
}

// logits [T, E] fp32 -> (weights [T, k] fp32, ids [T, k] int64): each row's experts (kernels.h moe_route).
std::vector<torch::Tensor> KernelSet::moe_route(torch::Tensor logits, int64_t k, bool renorm, bool topk_softmax) const {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.device().is_cpu(),
              "logits: fp32 [T, E] on the CPU");
  TORCH_CHECK(k > 0 && k <= logits.size(1), "0 < k <= experts");
  logits = logits.contiguous();
  const int64_t T = logits.size(0);
  auto weights = torch::empty({T, k}, logits.options());
  auto ids = torch::empty({T, k}, logits.options().dtype(at::kLong));
  table_->moe_route(runtime(), logits.data_ptr<float>(), T, logits.size(1), k, renorm, topk_softmax,
                    weights.data_ptr<float>(), ids.data_ptr<int64_t>());
  return {weights, ids};
}
