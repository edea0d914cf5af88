// Vector math the kernels share (AVX-512).
#pragma once
#include <immintrin.h>

#include <initializer_list>

namespace pw_simd {

// e^x per lane: x log2(e) = n + f with |f| <= 1/2, 2^f by its Taylor series (|error| < 2e-7
// relative), then scaled by 2^n. Lanes below -103 (and -inf) give 0.
inline __m512 exp512(__m512 x) {
  const __m512 t = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(-160.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.525273380405984e-05f);
  for (float c : {1.5403530393381606e-04f, 1.3333558146428443e-03f, 9.618129107628477e-03f,
                  5.550410866482158e-02f, 2.402265069591007e-01f, 6.931471805599453e-01f, 1.f})
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

}  // namespace pw_simd
