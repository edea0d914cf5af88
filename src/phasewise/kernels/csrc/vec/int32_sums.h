// The Vs adapter (vec.h) where dot_u4 sums straight into int32 lanes: every level but AVX2
// without VNNI, whose int16 pair sums are arch/x86_avx2.h's own Vs. Included by the arch/ file
// after its dot_u4.
#pragma once

namespace pw {

using Vs = Vi;
constexpr int VS_U6 = 8, VS_U5 = 8;   // int32 lanes hold any number of calls the kernels make
inline Vi dot_u4s(Vs acc, Vb w, Vb x) { return dot_u4(acc, w, x); }
inline Vi widen(Vs acc) { return acc; }
inline Vi pair_factor(Vi sc) { return sc; }
inline Vi widen_by(Vs acc, Vi by) { return acc * by; }

}  // namespace pw
