// LFM2's gated short convolution over a step's sequences (layers/short_conv.py is its PyTorch form):
// in_proj's rows give B, C and x per channel; y = C conv(B x), conv a depthwise causal convolution of
// K taps (no activation) whose last K - 1 inputs (B x) are each sequence's state. Threads split the
// channels, 16 at a time; each walks every sequence's tokens in order. A row's result depends only on
// its own inputs and the K - 1 before it, so its bits are the same alone, batched or in any chunk.
#include "core.h"
#include "parallel.h"
#include "vec/vec.h"

namespace pw {

void short_conv_mix(const Runtime& rt, const float* in, int64_t ld, int64_t T, int64_t H, const float* taps_w,
                    int64_t K, const DeltaNetSeqs& sq, float* out) {
  const int64_t P = K - 1, blocks = (H + 15) / 16;
  parallel_for(rt, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t c = blk * 16, m = std::min<int64_t>(16, H - c);
      Vf taps[DELTA_NET_MAX_TAPS];
      for (int64_t j = 0; j < K; ++j) {
        alignas(64) float w[16] = {};
        for (int64_t l = 0; l < m; ++l) w[l] = taps_w[(c + l) * K + j];
        taps[j] = Vf::load(w);
      }
      for (int64_t i = 0, row = 0; i < sq.B; row += sq.query_lens[i], ++i) {
        const int64_t n = sq.query_lens[i];
        float* cs = sq.conv_states + sq.slots[i] * P * H + c;
        if (n == sq.context_lens[i])             // the sequence starts here: no inputs before it
          for (int64_t p = 0; p < P; ++p) Vf::zero().store_n(cs + p * H, m);
        auto input = [&](int64_t w) {            // window row w: the state's K - 1 inputs, then B x of the rows
          if (w < P) return Vf::load_n(cs + w * H, m);
          const float* r = in + (row + w - P) * ld + c;
          return Vf::load_n(r, m) * Vf::load_n(r + 2 * H, m);
        };
        for (int64_t t = 0; t < n; ++t) {
          Vf acc = input(t) * taps[0];
          for (int64_t j = 1; j < K; ++j) acc = fma(input(t + j), taps[j], acc);
          (Vf::load_n(in + (row + t) * ld + H + c, m) * acc).store_n(out + (row + t) * H + c, m);
          const int64_t snap = sq.snapshots != nullptr ? sq.snapshots[row + t] : -1;
          for (int64_t p = 0; p < P && snap >= 0; ++p) input(t + 1 + p).store_n(sq.conv_states + snap * P * H + c + p * H, m);
        }
        for (int64_t p = 0; p < P; ++p) input(n + p).store_n(cs + p * H, m);   // row n + p >= p: read before written
      }
    }
  });
}

}  // namespace pw
