// The torch side of the decoder stack: checks the weights once, the step's tensors every call, and
// hands raw pointers to the library's decoder_stack (decoder.cpp), which runs every layer.
#include "decoder_stack.h"

#include <ATen/Parallel.h>

namespace {

bool fp32_vector(const torch::Tensor& t, int64_t n) {
  return t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n && t.device().is_cpu();
}

pw::Linear linear_view(const QuantLinearArgs& a, int64_t K, std::vector<pw::PackedWeights>& parts) {
  const auto& [fmt, N, blocks, scale, bias, u5_tiles, rest] = a;
  int64_t first = N;
  for (const PartArgs& p : rest) first -= std::get<1>(p);
  pw::PackedWeights w = packed_weights(fmt, first, blocks, scale, u5_tiles);
  TORCH_CHECK(w.KB * pw::QK == K, "a weight's shape does not match the model");
  w.next = link_parts(rest, first, K, parts);
  TORCH_CHECK(!bias.has_value() || fp32_vector(*bias, N), "bias: fp32 [N]");
  return {w, bias.has_value() ? bias->data_ptr<float>() : nullptr};
}

size_t part_count(const LinearOpt& l) { return l.has_value() ? std::get<6>(*l).size() : 0; }

// A recurrent layer's mixer viewed (its z, b, a parts into `parts`): the layer's qkv rows and o's
// inputs it takes, and the floats a row of its scratch needs (decoder.cpp recurrent)
pw::RecurrentMixer mixer_view(const MixerArgs& a, int64_t H, std::vector<pw::PackedWeights>& parts, int64_t& qkv_rows,
                              int64_t& o_in, int64_t& wide) {
  const auto& [z, b, aa, conv, neg_A, dt_bias, norm, Hk, Hv, dk, dv, tiled, eps] = a;
  pw::RecurrentMixer m;
  TORCH_CHECK(conv.scalar_type() == at::kFloat && conv.dim() == 2 && conv.is_contiguous() &&
              conv.size(1) <= pw::DELTA_NET_MAX_TAPS, "conv taps: fp32 [C, K], K <= ", pw::DELTA_NET_MAX_TAPS);
  if (!z.has_value()) {                       // LFM2's short conv
    TORCH_CHECK(!b.has_value() && !aa.has_value() && conv.size(0) == H, "a short conv: taps [H, K] alone");
    m.taps = conv.data_ptr<float>(), m.K = conv.size(1);
    qkv_rows = 3 * H, o_in = H, wide = 4 * H;
    return m;
  }
  const int64_t C = 2 * Hk * dk + Hv * dv, V = Hv * dv;
  TORCH_CHECK(b.has_value() && aa.has_value() && Hk > 0 && Hv % Hk == 0 && conv.size(0) == C &&
              std::get<1>(*z) == V && std::get<1>(*b) == Hv && std::get<1>(*aa) == Hv,
              "a Gated DeltaNet: z [Hv dv], b, a [Hv] and taps [C, K] of C = 2 Hk dk + Hv dv");
  TORCH_CHECK(neg_A.has_value() && dt_bias.has_value() && norm.has_value() && fp32_vector(*neg_A, Hv) &&
              fp32_vector(*dt_bias, Hv) && fp32_vector(*norm, dv), "neg_A, dt_bias fp32 [Hv], norm fp32 [dv]");
  m.delta = {Hk, Hv, dk, dv, conv.size(1), conv.data_ptr<float>(), neg_A->data_ptr<float>(),
             dt_bias->data_ptr<float>(), norm->data_ptr<float>(), static_cast<float>(eps), tiled};
  m.z = linear_view(*z, H, parts), m.b = linear_view(*b, H, parts), m.a = linear_view(*aa, H, parts);
  qkv_rows = C, o_in = V, wide = 2 * C + 2 * V + 2 * Hv;
  return m;
}

}  // namespace

DecoderStack::DecoderStack(std::shared_ptr<KernelSet> kernels, std::vector<LayerArgs> layers,
                           torch::Tensor final_norm, torch::Tensor cos, torch::Tensor sin, int64_t Hq, int64_t Hkv,
                           int64_t D, double eps, std::vector<LayerExtras> extras, double scale, bool gelu,
                           std::vector<c10::optional<SparseArgs>> sparse, std::vector<MixerOpt> mixers,
                           std::vector<bool> gates)
    : k_(std::move(kernels)), layers_(std::move(layers)), extras_(std::move(extras)),
      sparse_args_(std::move(sparse)), mixer_args_(std::move(mixers)), final_norm_(std::move(final_norm)),
      cos_(std::move(cos)), sin_(std::move(sin)) {
  TORCH_CHECK(!layers_.empty(), "a decoder stack needs layers");
  const int64_t H = final_norm_.numel();
  TORCH_CHECK(fp32_vector(final_norm_, H) && cos_.scalar_type() == at::kFloat && sin_.scalar_type() == at::kFloat &&
              cos_.is_contiguous() && sin_.is_contiguous() && cos_.size(-1) <= D / 2 && sin_.sizes() == cos_.sizes(),
              "final norm fp32 [H], cos and sin fp32 [P, rot / 2] (rot <= D)");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0 && D % 2 == 0, "bad head counts");
  TORCH_CHECK(sparse_args_.empty() || sparse_args_.size() == layers_.size(), "sparse: none or one per layer");
  TORCH_CHECK((mixer_args_.empty() || mixer_args_.size() == layers_.size()) &&
              (gates.empty() || gates.size() == layers_.size()), "mixers and gates: none or one per layer");
  int64_t widest = 0, experts = 0, topk = 0, wide = 0;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const auto& [n1, n2, qkv, o, gate_up, down] = layers_[i];
    const c10::optional<SparseArgs> none;
    const c10::optional<SparseArgs>& sp = sparse_args_.empty() ? none : sparse_args_[i];
    const MixerOpt no_mixer;
    const MixerOpt& mx = mixer_args_.empty() ? no_mixer : mixer_args_[i];
    const bool gated = !gates.empty() && gates[i];
    TORCH_CHECK(fp32_vector(n1, H) && fp32_vector(n2, H), "norm weights: fp32 [H]");
    TORCH_CHECK(gate_up.has_value() == down.has_value() && (sp.has_value() || gate_up.has_value()),
                "a layer's MLP: gate_up and down (a sparse layer's shared expert: both or neither)");
    const int64_t I2 = gate_up.has_value() ? std::get<1>(*gate_up) : 0;
    auto& parts = *parts_.emplace_back(std::make_unique<std::vector<pw::PackedWeights>>());
    size_t rest = std::get<6>(qkv).size() + std::get<6>(o).size() + part_count(gate_up) + part_count(down);
    if (mx.has_value()) rest += part_count(std::get<0>(*mx)) + part_count(std::get<1>(*mx)) + part_count(std::get<2>(*mx));
    parts.reserve(rest);                      // the parts' addresses must not move
    int64_t qkv_rows = (Hq + 2 * Hkv) * D + (gated ? Hq * D : 0), o_in = Hq * D;
    if (gated) wide = std::max(wide, qkv_rows);
    pw::RecurrentMixer* mixer = nullptr;
    if (mx.has_value()) {
      TORCH_CHECK(!gated, "a recurrent layer has no attention gate");
      int64_t w = 0;
      mixer = mixers_.emplace_back(std::make_unique<pw::RecurrentMixer>(mixer_view(*mx, H, parts, qkv_rows, o_in, w))).get();
      wide = std::max(wide, w);
    }
    TORCH_CHECK(std::get<1>(qkv) == qkv_rows && std::get<1>(o) == H && I2 % 32 == 0 &&
                (!down.has_value() || std::get<1>(*down) == H), "a layer's linear shapes do not match the model");
    pw::DecoderLayer v{n1.data_ptr<float>(), n2.data_ptr<float>(), linear_view(qkv, H, parts),
                       linear_view(o, o_in, parts)};
    v.recurrent = mixer, v.attn_gate = gated;
    if (gate_up.has_value())
      v.gate_up = linear_view(*gate_up, H, parts), v.down = linear_view(*down, I2 / 2, parts), v.width = I2 / 2;
    if (sp.has_value()) {
      const auto& [router, g, u, d, k, renorm, topk_softmax, shared_gate] = *sp;
      TORCH_CHECK(router.scalar_type() == at::kFloat && router.dim() == 2 && router.size(1) == H &&
                  router.is_contiguous() && router.device().is_cpu(), "router: fp32 [E, H]");
      const int64_t E = router.size(0);
      TORCH_CHECK(k > 0 && k <= E, "0 < k <= experts");
      TORCH_CHECK(shared_gate.has_value() == gate_up.has_value(), "a shared expert and its gate go together");
      TORCH_CHECK(!shared_gate.has_value() || fp32_vector(*shared_gate, H), "shared expert gate: fp32 [1, H]");
      auto& mlp = *sparse_.emplace_back(std::make_unique<pw::SparseMlp>());
      mlp = {router.data_ptr<float>(), expert_weights(g, u, d, E, H, gelu), k, renorm, topk_softmax,
             shared_gate.has_value() ? shared_gate->data_ptr<float>() : nullptr};
      v.sparse = &mlp;
      experts = std::max(experts, E), topk = std::max(topk, k);
    }
    widest = std::max(widest, I2 / 2);
    views_.push_back(v);
  }
  TORCH_CHECK(extras_.empty() || extras_.size() == layers_.size(), "extras: none or one per layer");
  auto ptr = [](const Opt& t, int64_t n) -> const float* {
    if (!t.has_value()) return nullptr;
    TORCH_CHECK(n == 0 ? t->scalar_type() == at::kFloat && t->is_contiguous() : fp32_vector(*t, n),
                "extras: fp32, contiguous, of the model's sizes");
    return t->data_ptr<float>();
  };
  for (size_t i = 0; i < extras_.size(); ++i) {
    const auto& [qn, kn, pre, post, c, s, group, window] = extras_[i];
    pw::DecoderLayer& v = views_[i];
    TORCH_CHECK(qn.has_value() == kn.has_value() && pre.has_value() == post.has_value() &&
                c.has_value() == s.has_value() && group >= 0 && window >= 0, "extras: pairs given together");
    TORCH_CHECK(!c.has_value() || (c->sizes() == cos_.sizes() && s->sizes() == cos_.sizes()), "a layer's cos, sin");
    v.qk_whole = qn.has_value() && qn->numel() == Hq * D && Hq > 1;   // OLMoE's: all of q, all of k
    v.q_norm = ptr(qn, v.qk_whole ? Hq * D : D), v.k_norm = ptr(kn, v.qk_whole ? Hkv * D : D);
    v.pre_ffn_norm = ptr(pre, H), v.post_ffn_norm = ptr(post, H);
    v.cos = ptr(c, 0), v.sin = ptr(s, 0), v.group = group, v.window = window;
    groups_ = std::max(groups_, group + 1);
  }
  model_ = {views_.data(), static_cast<int64_t>(views_.size()), H, widest, Hq, Hkv, D, static_cast<float>(eps),
            final_norm_.data_ptr<float>(), cos_.data_ptr<float>(), sin_.data_ptr<float>(), static_cast<float>(scale),
            gelu, experts, topk, 2 * cos_.size(-1), wide};
}

torch::Tensor DecoderStack::forward(torch::Tensor x, torch::Tensor positions, const std::vector<torch::Tensor>& slots,
                                    const std::vector<std::vector<torch::Tensor>>& kv,
                                    const std::vector<torch::Tensor>& tables, const std::vector<torch::Tensor>& row_seq,
                                    const std::vector<torch::Tensor>& row_len, int64_t block_size,
                                    const Opt& keep, const Opt& expert_counts, const Opt& sequences,
                                    const Opt& snapshots, const Opt& kv_seqs) const {
  const pw::DecoderModel& m = model_;
  TORCH_CHECK(kv.size() == static_cast<size_t>(m.L), "one KV cache per layer");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == m.H && x.scalar_type() == at::kFloat, "x: fp32 [T, hidden]");
  x = x.contiguous();
  const int64_t T = x.size(0);
  const size_t G = static_cast<size_t>(groups_);
  TORCH_CHECK(slots.size() >= G && tables.size() == slots.size() && row_seq.size() == slots.size() &&
              row_len.size() == slots.size(), "slots and rows for each KV group");
  std::vector<const int64_t*> group_slots;
  std::vector<pw::AttentionRows> rows;
  auto int64_rows = [&](const torch::Tensor& t) {
    TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.numel() == T, "positions, slots, rows: int64 [T]");
    return t.data_ptr<int64_t>();
  };
  int64_rows(positions);
  for (size_t g = 0; g < G; ++g) {
    TORCH_CHECK(tables[g].dim() == 2 && tables[g].scalar_type() == at::kLong && tables[g].is_contiguous(),
                "tables: int64 [S, B]");
    group_slots.push_back(int64_rows(slots[g]));
    rows.push_back({tables[g].data_ptr<int64_t>(), tables[g].size(1), int64_rows(row_seq[g]), int64_rows(row_len[g]),
                    block_size});
  }
  std::vector<pw::Cache> caches(m.L);
  std::vector<pw::CacheOut> outs(m.L);
  std::vector<pw::DeltaNetSeqs> recurrent = recurrent_states(kv, T, sequences, snapshots);
  for (int64_t i = 0; i < m.L; ++i) {
    if (m.layers[i].recurrent != nullptr) continue;
    int64_t tail_slots = 0;
    outs[i] = cache_tensors(kv[i], m.Hkv, m.D, &tail_slots);
    caches[i] = cache_reader(outs[i], m.Hkv, m.D, nullptr);   // fresh: the step's keys (decoder.cpp)
    if (!outs[i].quantized() || rows[0].seqs != nullptr) continue;
    TORCH_CHECK(kv_seqs.has_value(), "a quantized cache needs the step's sequences (kv_seqs)");
    for (size_t g = 0; g < G; ++g)                 // once: every layer's tail slots are as many
      check_kv_seqs(*kv_seqs, tables[g], block_size, outs[i].group(), tail_slots, T, rows[g].seq, rows[g].len, T);
    for (auto& r : rows) r.seqs = kv_seqs->data_ptr<int64_t>(), r.num_seqs = kv_seqs->size(0);
  }
  pw::DecoderStep step{T, positions.data_ptr<int64_t>(), group_slots.data(), caches.data(), outs.data(),
                       rows.data()};
  step.recurrent = recurrent.empty() ? nullptr : recurrent.data();
  std::vector<torch::Tensor> kept_index;        // the kept rows' seq and len of each group
  std::vector<pw::AttentionRows> kept;
  if (keep.has_value()) {
    TORCH_CHECK(keep->dim() == 1 && keep->scalar_type() == at::kLong && keep->is_contiguous(), "keep: int64 [R]");
    const int64_t R = keep->numel(), *k = keep->data_ptr<int64_t>();
    for (int64_t r = 0; r < R; ++r)
      TORCH_CHECK(k[r] >= 0 && k[r] < T && (r == 0 || k[r] > k[r - 1]), "keep: ascending rows of the step");
    for (size_t g = 0; g < G; ++g) {
      kept_index.push_back(row_seq[g].index_select(0, *keep));
      kept_index.push_back(row_len[g].index_select(0, *keep));
      kept.push_back(rows[g]);
      kept.back().seq = kept_index[2 * g].data_ptr<int64_t>();
      kept.back().len = kept_index[2 * g + 1].data_ptr<int64_t>();
    }
    step.R = R, step.keep = k, step.kept = kept.data();
  }
  if (expert_counts.has_value()) {
    TORCH_CHECK(expert_counts->scalar_type() == at::kLong && expert_counts->is_contiguous() &&
                expert_counts->device().is_cpu() && expert_counts->dim() == 2 && expert_counts->size(0) == m.L &&
                expert_counts->size(1) == m.E, "expert_counts: int64 [layers, experts]");
    expert_counts->zero_();
    step.expert_counts = expert_counts->data_ptr<int64_t>();
  }
  auto out = torch::empty({keep.has_value() ? step.R : T, m.H}, x.options());
  std::lock_guard<std::mutex> lock(*mu_);
  const int64_t need = pw::decoder_workspace(m, T);
  if (!ws_.defined() || ws_.numel() < need) ws_ = torch::empty({need}, x.options());
  k_->table().decoder_stack(pw::Runtime{at::get_num_threads()}, m, step, x.data_ptr<float>(), ws_.data_ptr<float>(),
                            out.data_ptr<float>());
  return out;
}

// Each recurrent layer's view of the step (kernels.h DeltaNetSeqs): the sequences [3, B] (new tokens,
// tokens after the step, state slot) shared, its own states (kv[i]: conv [S, K - 1, C][, delta rule
// [S, Hv, dk, dv]]); empty for a model without recurrent layers.
std::vector<pw::DeltaNetSeqs> DecoderStack::recurrent_states(const std::vector<std::vector<torch::Tensor>>& kv,
                                                             int64_t T, const Opt& sequences,
                                                             const Opt& snapshots) const {
  if (mixers_.empty()) return {};
  TORCH_CHECK(sequences.has_value() && sequences->scalar_type() == at::kLong && sequences->dim() == 2 &&
              sequences->size(0) == 3 && sequences->is_contiguous(), "sequences: int64 [3, B] with recurrent layers");
  const int64_t B = sequences->size(1), *n = sequences->data_ptr<int64_t>(), *ctx = n + B, *slot = ctx + B;
  TORCH_CHECK(!snapshots.has_value() || (snapshots->scalar_type() == at::kLong && snapshots->is_contiguous() &&
                                         snapshots->numel() == T), "snapshots: int64 [T]");
  const int64_t* snap = snapshots.has_value() ? snapshots->data_ptr<int64_t>() : nullptr;
  std::vector<pw::DeltaNetSeqs> out(model_.L);
  int64_t slots = -1;                               // every recurrent layer's slot count (the same pool)
  for (int64_t i = 0; i < model_.L; ++i) {
    const pw::RecurrentMixer* r = model_.layers[i].recurrent;
    if (r == nullptr) continue;
    const auto& st = kv[i];
    const bool delta = r->taps == nullptr;
    const int64_t H = model_.H, C = delta ? 2 * r->delta.Hk * r->delta.dk + r->delta.Hv * r->delta.dv : H;
    const int64_t K = delta ? r->delta.K : r->K;
    TORCH_CHECK(st.size() == (delta ? 2u : 1u), "a recurrent layer's states: (conv, delta rule) or (conv,)");
    for (const auto& t : st) TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(),
                                         "states: contiguous fp32 on the CPU");
    const int64_t S = st[0].size(0);
    TORCH_CHECK(st[0].dim() == 3 && st[0].size(1) == K - 1 && st[0].size(2) == C, "conv state: [S, K - 1, C]");
    TORCH_CHECK(!delta || (st[1].dim() == 4 && st[1].size(0) == S && st[1].size(1) == r->delta.Hv &&
                           st[1].size(2) == r->delta.dk && st[1].size(3) == r->delta.dv), "state: [S, Hv, dk, dv]");
    TORCH_CHECK(slots < 0 || S == slots, "every recurrent layer's states: the same number of slots");
    slots = S;
    out[i] = {B, n, ctx, slot, st[0].data_ptr<float>(), delta ? st[1].data_ptr<float>() : nullptr, snap};
  }
  if (slots >= 0) check_sequences(B, n, ctx, slot, T, snap, slots);   // once: the layers share the step's sequences
  return out;
}

DecoderStack DecoderStack::from_specs(std::shared_ptr<KernelSet> kernels, const std::vector<LayerSpec>& layers,
                                      torch::Tensor final_norm, torch::Tensor cos, torch::Tensor sin, int64_t Hq,
                                      int64_t Hkv, int64_t D, double eps, double scale, bool gelu) {
  std::vector<LayerArgs> args;
  std::vector<LayerExtras> extras;
  std::vector<c10::optional<SparseArgs>> sparse;
  std::vector<MixerOpt> mixers;
  std::vector<bool> gates;
  bool any_sparse = false, any_mixer = false;
  for (const LayerSpec& l : layers) {
    const auto& [in_norm, post_norm, qkv, o, gate_up, down, qn, kn, pre, post, c, s, group, window, sp, mx, gate] = l;
    args.emplace_back(in_norm, post_norm, qkv, o, gate_up, down);
    extras.emplace_back(qn, kn, pre, post, c, s, group, window);
    sparse.push_back(sp);
    mixers.push_back(mx);
    gates.push_back(gate);
    any_sparse |= sp.has_value();
    any_mixer |= mx.has_value();
  }
  if (!any_sparse) sparse.clear();
  if (!any_mixer) mixers.clear();
  return DecoderStack(std::move(kernels), std::move(args), std::move(final_norm), std::move(cos), std::move(sin), Hq,
                      Hkv, D, eps, std::move(extras), scale, gelu, std::move(sparse), std::move(mixers),
                      std::move(gates));
}
