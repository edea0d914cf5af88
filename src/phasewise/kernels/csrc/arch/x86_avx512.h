// x86 AVX-512 with VNNI: the int8 dot products of the AVX-512 vector layer (vec/avx512.h), one
// vpdpbusd each (unsigned bytes times signed bytes, four products summed into each int32 lane).
#pragma once
#include <immintrin.h>

namespace pw {

constexpr const char* ISA = "avx512";
constexpr bool Q8_BIASED = true;   // vpdpbusd takes the biased bytes as they are

inline Vi dot_u4(Vi acc, Vb w, Vb x) { return {_mm512_dpbusd_epi32(acc.v, w.v, x.v)}; }
inline Vi dot_q8(Vi acc, Vb u, Vb x) { return {_mm512_dpbusd_epi32(acc.v, u.v, x.v)}; }

}  // namespace pw

#include "../vec/int32_sums.h"
