// fp32 <-> fp16 bits one value at a time, as torch converts (round to nearest even): an int4 cache's
// scales and minimums (kv_write.cpp, the readers). Finite values of magnitude at most 65504 only (the
// writer clamps to it).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace pw {

inline uint16_t f16_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7FFFFFFFu;
  if (a < 0x38800000u) {            // below 2^-14: a subnormal, its mantissa in units of 2^-24
    float m;
    std::memcpy(&m, &a, 4);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(m * 16777216.f)));
  }
  const uint32_t rounded = a + 0xFFFu + ((a >> 13) & 1u);   // to nearest even on the 13 dropped bits
  return static_cast<uint16_t>(sign | ((rounded >> 13) - (112u << 10)));
}

inline float f16_value(uint16_t h) {
  const uint32_t bits = (h & 0x7FFFu) << 13;
  float f;
  if (h & 0x7C00u) {
    std::memcpy(&f, &bits, 4);
    f *= 5.192296858534828e+33f;                                   // 2^112
  } else {
    f = static_cast<float>(h & 0x3FFu) * 5.9604644775390625e-08f;    // 2^-24
  }
  return (h & 0x8000u) ? -f : f;
}

}  // namespace pw
