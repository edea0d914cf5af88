// A layer's KV cache tensors as the kernels' views (kernels.h Cache, CacheOut), checked: the binding's
// and the decoder stack's (kernel_set.h declares them).
#include "kernel_set.h"

namespace {

// An int8 or int4 cache's K group scales, V scales and tails checked, into c (`group`: tokens per key group).
void check_quantized(const std::vector<torch::Tensor>& kv, int64_t Hkv, int64_t D, bool int4, pw::CacheOut& c) {
  TORCH_CHECK(kv.size() == 6, "a quantized cache is (k, v, k_groups, v_scale, tails, tail_groups)");
  const int64_t S = kv[0].size(0), G = int4 ? pw::KEY_GROUP4 : pw::KEY_GROUP;
  const auto &groups = kv[2], &vs = kv[3], &tails = kv[4], &held = kv[5];
  const auto scale_type = int4 ? at::kHalf : at::kFloat;
  TORCH_CHECK(S % G == 0 && D <= pw::MAX_HEAD_SIZE && (!int4 || D % 64 == 0),
              "a quantized cache: slots in whole key groups, head size <= 512 (int4: a multiple of 64)");
  TORCH_CHECK(groups.scalar_type() == scale_type && groups.dim() == 4 && groups.size(0) == S / G &&
              groups.size(1) == Hkv && groups.size(2) == 2 && groups.size(3) == D,
              "k_groups: [slots / group, Hkv, 2, D], fp32 (int8) or fp16 (int4)");
  TORCH_CHECK(vs.scalar_type() == scale_type && vs.size(0) == S && vs.size(1) == Hkv &&
                  (int4 ? vs.dim() == 3 && vs.size(2) == D / pw::V4_BLOCK : vs.dim() == 2),
              "v_scale: fp32 [slots, Hkv] (int8) or fp16 [slots, Hkv, D / 32] (int4)");
  TORCH_CHECK(held.scalar_type() == at::kLong && held.dim() == 2 && held.size(1) == 2, "tail_groups: int64 [S, 2]");
  const int64_t t = int4 ? 1 : 0;            // int4: [2 S, 2, 64, Hkv, D], keys then values
  TORCH_CHECK(tails.scalar_type() == at::kFloat && tails.dim() == 4 + t && tails.size(0) == 2 * held.size(0) &&
              (!int4 || tails.size(1) == 2) && tails.size(1 + t) == G && tails.size(2 + t) == Hkv &&
              tails.size(3 + t) == D, "tails: fp32 [2 S, 16, Hkv, D] (int8) or [2 S, 2, 64, Hkv, D] (int4)");
  if (int4) {
    c.k4 = kv[0].data_ptr<uint8_t>(), c.v4 = kv[1].data_ptr<uint8_t>();
    c.kg4 = reinterpret_cast<uint16_t*>(groups.data_ptr<at::Half>());
    c.vs4 = reinterpret_cast<uint16_t*>(vs.data_ptr<at::Half>());
  } else {
    c.kq = kv[0].data_ptr<int8_t>(), c.vq = kv[1].data_ptr<int8_t>(), c.kg = groups.data_ptr<float>();
    c.vs = vs.data_ptr<float>();
  }
  c.tails = tails.data_ptr<float>(), c.tail_groups = held.data_ptr<int64_t>();
}

}  // namespace

pw::CacheOut cache_tensors(const std::vector<torch::Tensor>& kv, int64_t Hkv, int64_t D, int64_t* tail_slots) {
  TORCH_CHECK(kv.size() == 2 || kv.size() == 6, "a cache is (k, v) or (k, v, k_groups, v_scale, tails, tail_groups)");
  const auto& k = kv[0];
  const bool int8 = k.scalar_type() == at::kChar, int4 = k.scalar_type() == at::kByte;
  for (const auto& t : kv) TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "a cache's tensors: contiguous, on the CPU");
  TORCH_CHECK(k.dim() == 3 && k.size(1) == Hkv && k.size(2) == (int4 ? D / 2 : D) && kv[1].sizes() == k.sizes() &&
              kv[1].scalar_type() == k.scalar_type() && (int8 || int4 || k.scalar_type() == at::kFloat),
              "k, v: fp32 or int8 [slots, Hkv, D], or int4 codes uint8 [slots, Hkv, D / 2]");
  pw::CacheOut c;
  if (!int8 && !int4) {
    TORCH_CHECK(kv.size() == 2, "an fp32 cache is (k, v)");
    c.k = k.data_ptr<float>(), c.v = kv[1].data_ptr<float>();
    return c;
  }
  check_quantized(kv, Hkv, D, int4, c);
  if (tail_slots != nullptr) *tail_slots = kv[5].size(0);
  return c;
}

int64_t cache_head_size(const std::vector<torch::Tensor>& kv) {
  TORCH_CHECK(!kv.empty() && kv[0].dim() == 3, "caches [slots, Hkv, D]");
  return kv[0].size(2) * (kv[0].scalar_type() == at::kByte ? 2 : 1);
}

pw::Cache cache_reader(const pw::CacheOut& c, int64_t Hkv, int64_t D, const float* fresh) {
  return {c.k, c.v, c.kq, c.vq, c.kg, c.vs, c.tails, c.tail_groups, fresh, Hkv, D, c.k4, c.v4, c.kg4, c.vs4};
}

void check_kv_seqs(const torch::Tensor& seqs, const torch::Tensor& tables, int64_t block_size, int64_t group,
                   int64_t tail_slots, int64_t fresh_rows, const int64_t* row_seq, const int64_t* row_len, int64_t T) {
  TORCH_CHECK(seqs.scalar_type() == at::kLong && seqs.dim() == 2 && seqs.size(1) == 4 && seqs.is_contiguous() &&
              seqs.size(0) == tables.size(0), "seqs: int64 [sequences, 4] (start, new tokens, first row, tail slot)");
  TORCH_CHECK(block_size % group == 0, "a quantized cache: blocks of whole key groups (int8: 16 tokens, int4: 64)");
  const int64_t* q = seqs.data_ptr<int64_t>();
  for (int64_t s = 0; s < seqs.size(0); ++s, q += 4)
    TORCH_CHECK(q[0] >= 0 && q[1] >= 1 && q[2] >= 0 && q[2] + q[1] <= fresh_rows && q[3] >= 0 && q[3] < tail_slots &&
                    (q[0] + q[1] + block_size - 1) / block_size <= tables.size(1),
                "seqs: a sequence's new tokens beyond the step's keys, its tables or the tail slots");
  q = seqs.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(row_seq[t] >= 0 && row_seq[t] < seqs.size(0) && row_len[t] <= q[4 * row_seq[t]] + q[4 * row_seq[t] + 1],
                "a row attends past its sequence's new tokens");
}
