// The kernel tests of the quantized linear layers (every packed format against the exact weights)
// and of decoder_stack (a team of threads against the ops called one by one).
#include "check.h"

#include <algorithm>
#include <cstring>

namespace kt {

// A random packed weight of `fmt` (quant_linear.cpp's layout) and its values W [N, K]; Q8's first
// u5_tiles tiles hold U5 bytes (w = d (u - 16), u in 0..31); K4's super-block d and dmin in `super`.
std::vector<uint8_t> random_weight(pw::QuantFormat fmt, int64_t N, int64_t K, std::vector<float>& W,
                                   std::vector<float>& scale, int64_t u5_tiles, std::vector<uint16_t>* super) {
  const int64_t NT = (N + 15) / 16, KB = K / 32, BB = pw::block_bytes(fmt), QB = pw::quant_bytes(fmt);
  const bool nibbles = fmt == pw::Q4 || fmt == pw::K4, f32 = fmt == pw::K8 || fmt == pw::K6;
  const bool six = fmt == pw::K6, halves = fmt == pw::K8 || fmt == pw::K6;
  std::vector<uint8_t> blocks(NT * KB * BB);
  for (uint8_t& b : blocks) b = static_cast<uint8_t>(rng());
  W.assign(NT * 16 * K, 0.f);
  scale.assign(NT * 16, 0.f);
  auto uniform = [](float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); };
  for (float& s : scale) s = 0.001f + 0.01f * uniform(0.f, 1.f);
  if (pw::super_halves(fmt)) {               // d of 2^-14 .. 2^-9 (and K4's dmin); K4's sc and m 0..63 (both ends)
    super->resize(NT * (KB / pw::K4_SUPER) * pw::super_halves(fmt));
    for (uint16_t& h : *super) h = random_half(1, 5) & 0x7FFF;
  }
  for (int64_t t = 0; t < NT; ++t)
    for (int64_t b = 0; b < KB; ++b) {
      uint8_t* blk = blocks.data() + (t * KB + b) * BB;
      uint16_t* dm = reinterpret_cast<uint16_t*>(blk + QB);   // fp16 d (and m) of Q4, Q8, Q5
      float* ds = reinterpret_cast<float*>(blk + QB);         // fp32 d (K8: of each half) and m
      int16_t* sc = reinterpret_cast<int16_t*>(blk + QB + 64);   // K6: 16 sc of half 0, then of half 1
      if (fmt == pw::Q4 || fmt == pw::Q8 || fmt == pw::Q5)
        for (int r = 0; r < (fmt == pw::Q4 ? 32 : 16); ++r) dm[r] = random_half(8, 12);
      if (f32)
        for (int r = 0; r < 48; ++r) ds[r] = r < 32 ? uniform(0.001f, 0.02f) : uniform(-0.1f, 0.1f);
      if (fmt == pw::K4)
        for (int r = 0; r < 32; ++r) blk[QB + r] = r == 5 ? 63 : r == 21 ? 0 : static_cast<uint8_t>(rng() % 64);
      if (six)                                                 // d by integer sc of -128..128 (both ends)
        for (int r = 0; r < 32; ++r) {
          if (r < 16) ds[r] = uniform(1e-5f, 2e-4f);
          sc[r] = static_cast<int16_t>(r == 3 ? 128 : r == 20 ? -128 : static_cast<int>(rng() % 257) - 128);
        }
      if (fmt == pw::Q6K) {                                    // int8 sc of each half, -128 and 127 included
        blk[QB + 2] = 0x80, blk[QB + 30] = 0x7F;
      }
      for (int r = 0; r < 16; ++r) {
        float* w = W.data() + (t * 16 + r) * K + b * 32;
        for (int kk = 0; kk < 32; ++kk) {
          if (fmt == pw::Q6K) {                                  // u = nibble | high pair << 4
            const int j = (kk % 16) / 4, p = r * 4 + kk % 4, g = kk < 16 ? j : j + 4;
            const uint8_t byte = blk[j * 64 + p];
            const int u = (kk < 16 ? byte & 15 : byte >> 4) | ((blk[256 + 64 * (g / 4) + p] >> (2 * (g % 4))) & 3) << 4;
            const uint16_t* sb = super->data() + (t * (KB / pw::K4_SUPER) + b / pw::K4_SUPER) * 16;
            w[kk] = half_to_float(sb[r]) * static_cast<int8_t>(blk[QB + (kk < 16 ? 0 : 16) + r]) * (u - 32);
          } else if (fmt == pw::Q5) {                                   // u = nibble | fifth bit << 4
            const int g = kk / 4, p = r * 4 + kk % 4;
            const uint8_t byte = blk[(g % 4) * 64 + p];
            const int u = (g < 4 ? byte & 15 : byte >> 4) | ((blk[256 + p] >> g) & 1) << 4;
            w[kk] = half_to_float(dm[r]) * (u - 16);
          } else if (nibbles) {
            const int j = (kk % 16) / 4, p = kk % 4;
            const uint8_t byte = blk[j * 64 + r * 4 + p];
            const int q = kk < 16 ? byte & 15 : byte >> 4;
            if (fmt == pw::Q4) {
              w[kk] = half_to_float(dm[r]) * q + half_to_float(dm[16 + r]);
            } else {
              const uint16_t* sb = super->data() + (t * (KB / pw::K4_SUPER) + b / pw::K4_SUPER) * 32;
              w[kk] = half_to_float(sb[r]) * blk[QB + r] * q - half_to_float(sb[16 + r]) * blk[QB + 16 + r];
            }
          } else {
            uint8_t& u = blk[(kk / 4) * 64 + r * 4 + kk % 4];
            const bool u5 = t < u5_tiles;
            if (six) u &= 63;                                    // K6: q + 32 in 0..63
            else if (u5) u &= 31;                                // U5: q + 16 in 0..31
            else if (u == 0) u = 1;                              // q = -128 is never stored
            const float d = fmt == pw::Q8 ? half_to_float(dm[r]) : fmt == pw::I8 ? scale[t * 16 + r] :
                            six ? ds[r] * sc[(kk < 16 ? 0 : 16) + r] : ds[(kk < 16 ? 0 : 16) + r];
            w[kk] = (u - (six ? 32 : u5 ? 16 : 128)) * d + (halves ? ds[32 + r] : 0.f);
          }
        }
      }
    }
  return blocks;
}

// K4's and Q6K's activations: one scale per 256 values (xq, dx [M, K/32]: each block its group's dx)
void super_activations(const std::vector<float>& x, int64_t M, int64_t K, std::vector<int8_t>& xq,
                       std::vector<float>& dx) {
  for (int64_t g = 0; g < M * K / 256; ++g) {
    float amax = 0.f;
    for (int j = 0; j < 256; ++j) amax = std::max(amax, std::fabs(x[g * 256 + j]));
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    for (int j = 0; j < 256; ++j) xq[g * 256 + j] = static_cast<int8_t>(std::nearbyint(x[g * 256 + j] * id));
    for (int b = 0; b < 8; ++b) dx[g * 8 + b] = amax / 127.f;
  }
}

bool super_format(pw::QuantFormat f) { return f == pw::K4 || f == pw::Q6K; }

void test_quant_linear(const pw::KernelTable& k, pw::QuantFormat fmt, int64_t M, int64_t N, int64_t K,
                       int64_t u5_tiles) {
  std::vector<float> W, scale;
  std::vector<uint16_t> super;
  const auto blocks = random_weight(fmt, N, K, W, scale, u5_tiles, &super);
  const int64_t NT = (N + 15) / 16, KB = K / 32;
  auto x = randn(M * K), bias = randn(N);
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * KB), sx(M * KB);
  if (M * KB > 17) std::fill(x.begin() + 17 * 32, x.begin() + 18 * 32, 0.f);   // a block of zeros
  k.quantize_activations(RT, x.data(), M, K, xq.data(), dx.data(), sx.data());
  bool ok = true;                              // the activations: per block of 32, round to nearest even
  for (int64_t i = 0; i < M * KB; ++i) {
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[i * 32 + j]));
    ok &= dx[i] == amax / 127.f;
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
      const float want = amax > 0.f ? std::nearbyint(x[i * 32 + j] * (127.f / amax)) : 0.f;
      ok &= xq[i * 32 + j] == static_cast<int8_t>(want);
      sum += xq[i * 32 + j];
    }
    ok &= sx[i] == dx[i] * static_cast<float>(sum);
  }
  check("quantize_activations M=" + std::to_string(M), ok);
  std::vector<float> y(M * N), want(M * N);
  const pw::PackedWeights w{fmt, blocks.data(), scale.data(), N, NT, KB, u5_tiles, super.data()};
  k.quant_linear(RT, x.data(), M, K, w, bias.data(), y.data());
  if (super_format(fmt)) super_activations(x, M, K, xq, dx);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double acc = bias[n];
      for (int64_t kk = 0; kk < K; ++kk) acc += static_cast<double>(W[n * K + kk]) * xq[m * K + kk] * dx[m * KB + kk / 32];
      want[m * N + n] = static_cast<float>(acc);
    }
  float big = 0.f;
  for (float v : want) big = std::max(big, std::fabs(v));
  char name[96];
  std::snprintf(name, sizeof name, "quant_linear fmt=%d M=%lld N=%lld K=%lld u5_tiles=%lld", static_cast<int>(fmt),
                (long long)M, (long long)N, (long long)K, (long long)u5_tiles);
  check_close(name, y.data(), want.data(), y.size(), 1e-4f, 1e-5f * big);
  bool alone = true;                           // each row alone: the bits it got among the M
  std::vector<float> y1(N);
  for (int64_t m = 0; m < M && M > 1; ++m) {
    k.quant_linear(RT, x.data() + m * K, 1, K, w, bias.data(), y1.data());
    alone &= std::memcmp(y1.data(), y.data() + m * N, N * sizeof(float)) == 0;
  }
  check(std::string(name) + ": a row alone gets its bits", alone);
}

// A fused weight of mixed parts (pw.next): K4 (32 rows), Q6K (16), Q8 (20: the last tile partly
// padding), each part's rows into its columns of one output, against the parts' exact weights.
void test_fused_parts(const pw::KernelTable& k, int64_t M, int64_t K) {
  const pw::QuantFormat fmts[3] = {pw::K4, pw::Q6K, pw::Q8};
  const int64_t rows[3] = {32, 16, 20};
  std::vector<std::vector<uint8_t>> blocks(3);
  std::vector<std::vector<float>> Ws(3), scales(3);
  std::vector<std::vector<uint16_t>> supers(3);
  std::vector<pw::PackedWeights> parts;
  for (int i = 0; i < 3; ++i) {
    blocks[i] = random_weight(fmts[i], rows[i], K, Ws[i], scales[i], 0, &supers[i]);
    parts.push_back({fmts[i], blocks[i].data(), nullptr, rows[i], (rows[i] + 15) / 16, K / 32, 0, supers[i].data()});
  }
  parts[0].next = &parts[1], parts[1].next = &parts[2];
  const int64_t N = 68, KB = K / 32;
  auto x = randn(M * K), bias = randn(N);
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * KB), sx(M * KB), y(M * N), want(M * N);
  std::vector<int8_t> xs(M * K);
  std::vector<float> ds(M * KB);
  k.quantize_activations(RT, x.data(), M, K, xq.data(), dx.data(), sx.data());
  super_activations(x, M, K, xs, ds);
  k.quant_linear(RT, x.data(), M, K, parts[0], bias.data(), y.data());
  float big = 0.f;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0, i = 0, r = 0; n < N; ++n, ++r) {
      if (r == rows[i]) ++i, r = 0;
      double acc = bias[n];
      const bool sup = super_format(fmts[i]);   // each part over its own activations
      for (int64_t kk = 0; kk < K; ++kk)
        acc += static_cast<double>(Ws[i][r * K + kk]) * (sup ? xs : xq)[m * K + kk] * (sup ? ds : dx)[m * KB + kk / 32];
      want[m * N + n] = static_cast<float>(acc);
      big = std::max(big, std::fabs(want[m * N + n]));
    }
  check_close("quant_linear of fused parts K4+Q6K+Q8 M=" + std::to_string(M), y.data(), want.data(), y.size(), 1e-4f,
              1e-5f * big);
}

// decoder_stack on a team of threads against the same ops called one by one on one thread, in
// decoder.cpp's order: the team's barriers and shared buffers must change nothing but rounding.
void test_decoder_stack(const pw::KernelTable& k, int kv_bits, const std::vector<int64_t>& query_lens,
                        const std::vector<int64_t>& context_lens) {
  const bool int8 = kv_bits != 0;              // a quantized cache (int8 or int4)
  const int64_t L = 3, H = 128, I = 96, Hq = 2, Hkv = 1, D = 64, bs = kv_bits == 4 ? 64 : 16, P = 512, half = D / 2;
  std::vector<std::vector<uint8_t>> blocks;
  std::vector<std::vector<float>> norms, biases;
  std::vector<pw::DecoderLayer> layers(L);
  auto linear = [&](int64_t N, int64_t K) {
    std::vector<float> W, scale;
    blocks.push_back(random_weight(pw::Q4, N, K, W, scale, 0, nullptr));
    biases.push_back(randn(N, 0.1f));
    return pw::Linear{{pw::Q4, blocks.back().data(), nullptr, N, (N + 15) / 16, K / 32}, biases.back().data()};
  };
  // Layer 1 and 2 are sparse (E experts of width EI, k a row; layer 2 keeps its dense MLP as a shared expert)
  const int64_t E = 4, EI = 32, topk = 2;
  auto stacked = [&](int64_t N, int64_t K) {
    std::vector<float> W, scale;
    blocks.push_back(random_weight(pw::Q4, N, K, W, scale, 0, nullptr));
    return pw::PackedWeights{pw::Q4, blocks.back().data(), nullptr, N, N / 16, K / 32};
  };
  std::vector<pw::SparseMlp> sparse(2);
  blocks.reserve(4 * L + 6), biases.reserve(4 * L), norms.reserve(2 * L + 5);
  for (int64_t i = 0; i < L; ++i) {
    pw::DecoderLayer& layer = layers[i];
    norms.push_back(randn(H, 0.5f)), layer.input_norm = norms.back().data();
    norms.push_back(randn(H, 0.5f)), layer.post_norm = norms.back().data();
    layer.qkv = linear((Hq + 2 * Hkv) * D, H), layer.o = linear(H, Hq * D);
    if (i != 1) layer.gate_up = linear(2 * I, H), layer.down = linear(H, I), layer.width = I;
    if (i == 0) continue;
    pw::SparseMlp& sp = sparse[i - 1];
    norms.push_back(randn(E * H, 0.3f)), sp.router = norms.back().data();
    sp.experts = {stacked(E * EI, H), stacked(E * EI, H), stacked(E * H, EI), E, EI, H, false};
    sp.k = topk, sp.renorm = i == 1;
    if (i == 2) norms.push_back(randn(H, 0.2f)), sp.shared_gate = norms.back().data();
    layer.sparse = &sp;
  }
  norms.push_back(randn(H, 0.5f));
  std::vector<float> cs(P * half), sn(P * half);
  for (int64_t p = 0; p < P; ++p)
    for (int64_t i = 0; i < half; ++i) {
      const float a = p * std::pow(10000.f, -2.f * i / D);
      cs[p * half + i] = std::cos(a), sn[p * half + i] = std::sin(a);
    }
  const pw::DecoderModel m{layers.data(), L, H, I, Hq, Hkv, D, 1e-5f, norms.back().data(), cs.data(), sn.data(),
                           0.f, false, E, topk};
  // Rows: query_lens[i] positions of sequence i ending at context_lens[i]; blocks in order.
  const int64_t nseq = query_lens.size();
  int64_t max_blocks = 0;
  for (int64_t c : context_lens) max_blocks = std::max(max_blocks, (c + bs - 1) / bs);
  std::vector<int64_t> tables(nseq * max_blocks), seq, len, pos, slot;
  for (int64_t i = 0; i < nseq; ++i) {
    for (int64_t b = 0; b < max_blocks; ++b) tables[i * max_blocks + b] = i * max_blocks + b;
    for (int64_t r = 0; r < query_lens[i]; ++r) {
      const int64_t n = context_lens[i] - query_lens[i] + r + 1;
      seq.push_back(i), len.push_back(n), pos.push_back(n - 1);
      slot.push_back(tables[i * max_blocks + (n - 1) / bs] * bs + (n - 1) % bs);
    }
  }
  const int64_t T = seq.size(), slots = nseq * max_blocks * bs;
  std::vector<int64_t> seqs;                  // an int8 cache's sequences: start, new tokens, first row, tail slot
  for (int64_t i = 0, row = 0; i < nseq; row += query_lens[i], ++i)
    seqs.insert(seqs.end(), {context_lens[i] - query_lens[i], query_lens[i], row, i});
  pw::AttentionRows rows{tables.data(), max_blocks, seq.data(), len.data(), bs};
  if (int8) rows.seqs = seqs.data(), rows.num_seqs = nseq;
  // Two copies of every layer's cache, with the same earlier context (int8: written by write_kv)
  std::vector<std::vector<float>> f(4 * L);
  std::vector<QuantCache> q8;
  q8.reserve(2 * L);
  std::vector<pw::Cache> caches[2];
  std::vector<pw::CacheOut> outs[2];
  for (int64_t i = 0; i < L; ++i) {
    const auto kf = randn(slots * Hkv * D), vf = randn(slots * Hkv * D);
    if (int8) {
      q8.emplace_back(slots, Hkv, D, nseq, kv_bits);
      for (int64_t s = 0; s < nseq; ++s) {      // the context before the step, as one step a sequence
        const int64_t n = context_lens[s] - query_lens[s];
        if (n == 0) continue;
        std::vector<int64_t> sl(n), one_seq{0, n, 0, s};
        for (int64_t p = 0; p < n; ++p) sl[p] = tables[s * max_blocks + p / bs] * bs + p % bs;
        pw::AttentionRows r{tables.data() + s * max_blocks, max_blocks, nullptr, nullptr, bs};
        r.seqs = one_seq.data(), r.num_seqs = 1;
        const int64_t own = s * max_blocks * bs * Hkv * D;   // random keys and values of its own
        k.write_kv(RT, kf.data() + own, vf.data() + own, Hkv * D, n, Hkv, D, sl.data(), r, q8.back().out());
      }
      q8.push_back(q8.back());
    }
    for (int copy = 0; copy < 2; ++copy) {
      auto& kbuf = f[4 * i + 2 * copy];
      auto& vbuf = f[4 * i + 2 * copy + 1];
      pw::CacheOut o;
      if (int8) {
        o = q8[2 * i + copy].out();
      } else {
        kbuf = kf, vbuf = vf;
        o.k = kbuf.data(), o.v = vbuf.data();
      }
      pw::Cache c{o.k, o.v, o.kq, o.vq, o.kg, o.vs, o.tails, o.tail_groups, nullptr, Hkv, D, o.k4, o.v4, o.kg4, o.vs4};
      caches[copy].push_back(c), outs[copy].push_back(o);
    }
  }
  const auto x = randn(T * H);
  std::vector<float> ws(pw::decoder_workspace(m, T)), out(T * H);
  const int64_t* group_slots[1] = {slot.data()};
  pw::DecoderStep step{T, pos.data(), group_slots, caches[0].data(), outs[0].data(), &rows};
  std::vector<int64_t> counts(L * E, 0);
  step.expert_counts = counts.data();
  k.decoder_stack(RT, m, step, x.data(), ws.data(), out.data());

  const pw::Runtime one{1};
  std::vector<float> residual(x), normed(T * H), hidden(T * H), o(T * H), qkv(T * (Hq + 2 * Hkv) * D), qr(T * Hq * D),
      kr(T * Hkv * D), attn(T * Hq * D), gate_up(T * 2 * I), act(T * I), want(T * H);
  for (int64_t i = 0; i < L; ++i) {
    const pw::DecoderLayer& ly = layers[i];
    if (i == 0) k.rms_norm(one, residual.data(), nullptr, ly.input_norm, T, H, m.eps, normed.data(), nullptr);
    else k.rms_norm(one, hidden.data(), residual.data(), ly.input_norm, T, H, m.eps, normed.data(), residual.data());
    k.quant_linear(one, normed.data(), T, H, ly.qkv.w, ly.qkv.bias, qkv.data());
    k.rope_and_cache(one, qkv.data(), T, pos.data(), cs.data(), sn.data(), Hq, Hkv, D, slot.data(), rows, outs[1][i],
                     qr.data(), kr.data());
    pw::Cache c = caches[1][i];
    c.fresh = kr.data();                       // a quantized cache's partial key groups (int4: their values too)
    c.fresh_v = qkv.data() + (Hq + Hkv) * D, c.ldv = (Hq + 2 * Hkv) * D;
    k.paged_attention(one, qr.data(), T, Hq, c, rows, 1.f / std::sqrt(static_cast<float>(D)), attn.data());
    k.quant_linear(one, attn.data(), T, Hq * D, ly.o.w, ly.o.bias, o.data());
    k.rms_norm(one, o.data(), residual.data(), ly.post_norm, T, H, m.eps, normed.data(), residual.data());
    if (ly.sparse == nullptr || ly.sparse->shared_gate != nullptr) {
      k.quant_linear(one, normed.data(), T, H, ly.gate_up.w, ly.gate_up.bias, gate_up.data());
      k.silu_and_mul(one, gate_up.data(), T, I, act.data());
      k.quant_linear(one, act.data(), T, I, ly.down.w, ly.down.bias, hidden.data());
    }
    if (ly.sparse != nullptr) {                // the experts, then the shared expert behind its gate
      const pw::SparseMlp& sp = *ly.sparse;
      std::vector<float> logits(T * E), w(T * topk), gate(T), shared(hidden);
      std::vector<int64_t> ids(T * topk);
      k.float_linear(one, normed.data(), T, H, sp.router, E, logits.data());
      k.moe_route(one, logits.data(), T, E, topk, sp.renorm, false, w.data(), ids.data());
      k.expert_mlp(one, normed.data(), T, ids.data(), w.data(), topk, sp.experts, hidden.data());
      if (sp.shared_gate != nullptr) {
        k.float_linear(one, normed.data(), T, H, sp.shared_gate, 1, gate.data());
        for (int64_t t = 0; t < T; ++t)
          for (int64_t c = 0; c < H; ++c) hidden[t * H + c] += shared[t * H + c] / (1.f + std::exp(-gate[t]));
      }
    }
  }
  k.rms_norm(one, hidden.data(), residual.data(), m.final_norm, T, H, m.eps, want.data(), residual.data());
  char name[96];
  std::snprintf(name, sizeof name, "decoder_stack %s rows=%lld", kv_bits == 4 ? "int4" : int8 ? "int8" : "fp32",
                (long long)T);
  check_close(name, out.data(), want.data(), out.size(), 1e-3f, 1e-3f);
  bool same = true;                            // the caches hold the same new keys and values (int8: within a step)
  auto close = [&](const std::vector<float>& a, const std::vector<float>& b) {
    for (size_t e = 0; e < a.size(); ++e) same &= std::fabs(a[e] - b[e]) <= 1e-3f * (1.f + std::fabs(b[e]));
  };
  auto near = [&](const std::vector<int8_t>& a, const std::vector<int8_t>& b) {
    for (size_t e = 0; e < a.size(); ++e) same &= std::abs(a[e] - b[e]) <= 1;
  };
  auto near4 = [&](const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {   // each nibble within one
    for (size_t e = 0; e < a.size(); ++e) same &= std::abs((a[e] & 15) - (b[e] & 15)) <= 1 && std::abs((a[e] >> 4) - (b[e] >> 4)) <= 1;
  };
  auto close16 = [&](const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
    for (size_t e = 0; e < a.size(); ++e) {
      const float x = half_to_float(a[e]), y = half_to_float(b[e]);
      same &= std::fabs(x - y) <= 1e-3f * (1.f + std::fabs(y));
    }
  };
  for (int64_t i = 0; i < L; ++i) {
    if (!int8) {
      for (int64_t j = 0; j < 2; ++j) close(f[4 * i + j], f[4 * i + 2 + j]);
      continue;
    }
    const QuantCache &a = q8[2 * i], &b = q8[2 * i + 1];
    near(a.kq, b.kq), near(a.vq, b.vq), close(a.kg, b.kg), close(a.vs, b.vs), close(a.tails, b.tails);
    near4(a.k4, b.k4), near4(a.v4, b.v4), close16(a.kg4, b.kg4), close16(a.vs4, b.vs4);
    same &= a.held == b.held;
  }
  check(std::string(name) + " caches", same);
  int64_t layer_choices[3] = {0, 0, 0};       // the sparse layers' choices: k a row
  for (int64_t i = 0; i < L * E; ++i) layer_choices[i / E] += counts[i];
  check(std::string(name) + " expert counts",
        layer_choices[0] == 0 && layer_choices[1] == T * topk && layer_choices[2] == T * topk);
}

}  // namespace kt
