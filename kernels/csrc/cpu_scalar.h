// Scalar helpers the CPU kernels share (cpu_decode.cpp, cpu_decode_blocks.h,
// cpu_prefill.cpp, cpu_fused.cpp): bf16 <-> fp32 conversion, a vectorisable exp and tanh,
// a cache-line prefetch. bf16 travels as its uint16_t bits, the top half of an fp32.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace pagoda_cpu_scalar {

// Prefetch for reading the cache line at p; Locality as __builtin_prefetch's (3: into L1,
// prefetcht0; 2: L2, prefetcht1; 1: prefetcht2; 0: prefetchnta). Inline asm on x86:
// GCC 12 at -O3 deletes a loop whose body is only __builtin_prefetch calls (they have no
// side effects), so a loop that does nothing but prefetch must use this.
template <int Locality>
inline void prefetch_read(const void* p) {
  static_assert(Locality >= 0 && Locality <= 3, "locality 0..3");
#if defined(__x86_64__)
  const char& line = *static_cast<const char*>(p);
  if constexpr (Locality == 3) asm volatile("prefetcht0 %0" : : "m"(line));
  else if constexpr (Locality == 2) asm volatile("prefetcht1 %0" : : "m"(line));
  else if constexpr (Locality == 1) asm volatile("prefetcht2 %0" : : "m"(line));
  else asm volatile("prefetchnta %0" : : "m"(line));
#else
  __builtin_prefetch(p, 0, Locality);
#endif
}

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t b) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(b) << 16);
}

inline uint16_t bf16_bits(float x) {  // round to nearest even, NaN -> 0x7FC0, as c10::BFloat16
  const uint32_t u = __builtin_bit_cast(uint32_t, x);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0} : static_cast<uint16_t>(r);
}
inline void store(float x, float* dst) { *dst = x; }
inline void store(float x, uint16_t* dst) { *dst = bf16_bits(x); }
// x as torch holds it in a tensor of element type T (float, or bf16 bits), read back as fp32.
template <typename T>
inline float rounded(float x) {
  if constexpr (sizeof(T) == 4) return x;
  else return to_f32(bf16_bits(x));
}

// exp(x), Cephes expf (~1 ulp; torch's Sleef expf_u10 is also ~1 ulp): vectorises
// without -ffast-math, unlike std::exp. Overflow to inf and underflow to 0 as expf.
inline float exp_f32(float x) {
  const float xc = std::min(std::max(x, -87.0f), 88.0f);
  const float round_magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (xc * 1.44269504088896341f + round_magic) - round_magic;
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;  // x - n ln2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float two_n = __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
  const float e = p * two_n;
  return x > 88.72283f ? std::numeric_limits<float>::infinity() : x < -87.33655f ? 0.0f : e;
}

// tanh(x) to ~2e-7 relative, branch-free so loops over it vectorise: the odd Taylor
// series to x^9 below |x| = 0.25 (truncation < 1e-8 relative there), (1 - e) / (1 + e)
// with e = exp(-2|x|) above. For the attention soft cap, cap * tanh(score / cap).
inline float tanh_f32(float x) {
  const float a = std::fabs(x), a2 = a * a;
  const float small =
      a * (1.0f + a2 * (-0.333333333f + a2 * (0.133333333f + a2 * (-0.0539682540f +
                                                                   a2 * 0.0218694885f))));
  const float e = exp_f32(-2.0f * a);
  const float r = a < 0.25f ? small : (1.0f - e) / (1.0f + e);
  return std::copysign(r, x);
}

}  // namespace pagoda_cpu_scalar
