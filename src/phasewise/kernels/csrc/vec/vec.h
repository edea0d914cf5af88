// The vector layer every kernel is written against: 16-lane float (Vf) and int32 (Vi) vectors,
// a 16-lane mask (Mask) and 64 int8 bytes as 16 lanes of 4 (Vb, for the int8 dot products).
// Kernels never name an intrinsic; each ISA level maps these types onto its registers:
//   avx512.h    one zmm per vector (AVX-512 F/BW/VL + VNNI);
//   portable.h  GCC vector extensions, W lanes per native vector: 8 on AVX2 (two ymm per
//               vector), 4 elsewhere (four 128-bit SSE2 or NEON registers, or what the
//               compiler makes of them on any other CPU).
// The int8 dot products, where ISAs differ most, come from arch/: x86_avx512.h, x86_avx2.h,
// arm_neon.h, generic.h (with vec/int32_sums.h, the Vs adapter of every level that sums in int32).
//
// API (namespace pw):
//   Vf::load(p) / load_n(p, n) (lanes >= n are 0) / set1(x) / zero() / from_i8(p) / from_f16(p),
//   v.store(p) / store_n(p, n); + - * /, fma(a, b, c) = a b + c, max, abs, exp,
//   reduce_add, reduce_max, reduce16(a[16]) (lane j = the sum of a[j]), reduce_add_pairs (the
//   lanes as the tree ((a0 + a1) + (a2 + a3)) + ..., the same bits at every level);
//   Mask: first_n(n), a > b (Vf or Vi), select(m, a, b) = m ? a : b;
//   Vi::zero() / set1(x) / iota() / from_i16(p) (16 int16, sign-extended) / store(p), +, *, to_float;
//   round_to_i8(x, p): x's lanes rounded to the nearest integer (ties to even) as Vi, and stored
//     at p as 16 int8 (saturated);
//   Vb::load(p) / bcast4(p) (4 bytes to every lane) / v.store(p), lo4, hi4 (the nibbles),
//   unpack_nibbles(p): 32 bytes (byte i: values i and i + 32 as its low and high nibble) as 64 bytes,
//   with_fifth<G>(nib, bits): nib | bit G of each byte of bits, moved to bit 4 (Q5's fifth bits),
//   dot_u4(acc, w, x): acc + the 4 products w x of each lane, w in 0..15 (or 0..63) unsigned, x signed;
//   dot_q8(acc, u, x): the same for bytes u = q + 128 (q signed); Q8_BIASED says whether the
//     result holds sum(u x) (the caller subtracts 128 sum(x)) or sum(q x) already;
//   Vs: dot_u4 sums in the narrowest accumulator the ISA has (AVX2: int16 pairs, which hold 8
//     calls: 8 x 2 x 15 x 127 < 32768; elsewhere Vi): Vs::zero(), dot_u4s(acc, w, x), widen(Vs) -> Vi;
//     it also takes bytes of 0..63 (K6), VS_U6 calls of them before widen (AVX2: 2, else 8), and of
//     0..31 (U5), VS_U5 calls (AVX2: 4, else 8); widen_by(acc, pair_factor(sc)) = widen(acc) sc
//     per lane for |sc| <= 128 (AVX2: vpmaddwd by sc instead of ones, else a multiply);
//   prefetch_l2(p); ISA (the level's name).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && !defined(PW_GENERIC)
#include "avx512.h"
#else
#include "portable.h"
#endif
