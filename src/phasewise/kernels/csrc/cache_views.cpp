// A layer's KV cache tensors as the kernels' views (kernels.h Cache, CacheOut), checked: the binding's
// and the decoder stack's (kernel_set.h declares them).
#include "kernel_set.h"

pw::CacheOut cache_tensors(const std::vector<torch::Tensor>& kv, int64_t Hkv, int64_t D, int64_t* tail_slots) {
  TORCH_CHECK(kv.size() == 2 || kv.size() == 6, "a cache is (k, v) or (k, v, k_groups, v_scale, tails, tail_groups)");
  const auto& k = kv[0];
  const bool int8 = k.scalar_type() == at::kChar;
  for (const auto& t : kv) TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "a cache's tensors: contiguous, on the CPU");
  TORCH_CHECK(k.dim() == 3 && k.size(1) == Hkv && k.size(2) == D && kv[1].sizes() == k.sizes() &&
              kv[1].scalar_type() == k.scalar_type() && (int8 || k.scalar_type() == at::kFloat),
              "k, v: fp32 or int8 [slots, Hkv, D]");
  pw::CacheOut c;
  if (!int8) {
    TORCH_CHECK(kv.size() == 2, "an fp32 cache is (k, v)");
    c.k = k.data_ptr<float>(), c.v = kv[1].data_ptr<float>();
    return c;
  }
  TORCH_CHECK(kv.size() == 6, "an int8 cache is (k, v, k_groups, v_scale, tails, tail_groups)");
  const int64_t S = k.size(0);
  const auto &groups = kv[2], &vs = kv[3], &tails = kv[4], &held = kv[5];
  TORCH_CHECK(S % pw::KEY_GROUP == 0 && D <= pw::MAX_HEAD_SIZE, "an int8 cache: slots in groups of 16, head size <= 512");
  TORCH_CHECK(groups.scalar_type() == at::kFloat && groups.dim() == 4 && groups.size(0) == S / pw::KEY_GROUP &&
              groups.size(1) == Hkv && groups.size(2) == 2 && groups.size(3) == D, "k_groups: fp32 [slots / 16, Hkv, 2, D]");
  TORCH_CHECK(vs.scalar_type() == at::kFloat && vs.dim() == 2 && vs.size(0) == S && vs.size(1) == Hkv,
              "v_scale: fp32 [slots, Hkv]");
  TORCH_CHECK(held.scalar_type() == at::kLong && held.dim() == 2 && held.size(1) == 2, "tail_groups: int64 [S, 2]");
  TORCH_CHECK(tails.scalar_type() == at::kFloat && tails.dim() == 4 && tails.size(0) == 2 * held.size(0) &&
              tails.size(1) == pw::KEY_GROUP && tails.size(2) == Hkv && tails.size(3) == D,
              "tails: fp32 [2 S, 16, Hkv, D]");
  c.kq = k.data_ptr<int8_t>(), c.vq = kv[1].data_ptr<int8_t>(), c.kg = groups.data_ptr<float>();
  c.vs = vs.data_ptr<float>(), c.tails = tails.data_ptr<float>(), c.tail_groups = held.data_ptr<int64_t>();
  if (tail_slots != nullptr) *tail_slots = held.size(0);
  return c;
}

pw::Cache cache_reader(const pw::CacheOut& c, int64_t Hkv, int64_t D, const float* fresh) {
  return {c.k, c.v, c.kq, c.vq, c.kg, c.vs, c.tails, c.tail_groups, fresh, Hkv, D};
}

void check_kv_seqs(const torch::Tensor& seqs, const torch::Tensor& tables, int64_t block_size, int64_t tail_slots,
                   int64_t fresh_rows, const int64_t* row_seq, const int64_t* row_len, int64_t T) {
  TORCH_CHECK(seqs.scalar_type() == at::kLong && seqs.dim() == 2 && seqs.size(1) == 4 && seqs.is_contiguous() &&
              seqs.size(0) == tables.size(0), "seqs: int64 [sequences, 4] (start, new tokens, first row, tail slot)");
  TORCH_CHECK(block_size % pw::KEY_GROUP == 0, "an int8 cache: blocks of a multiple of 16 tokens");
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
