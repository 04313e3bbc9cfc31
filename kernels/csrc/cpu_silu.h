// SiLU as torch computes F.silu, shared by the kernels that apply it (cpu_fused.cpp's
// silu_mul, cpu_gemm.cpp's gated epilogue) so both give the same bits. Include after
// cpu_scalar.h; build with -ffp-contract=off (a contracted exp rounds differently).
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX2__) && !defined(PAGODA_PORTABLE)
#include <immintrin.h>
#endif

#include "cpu_scalar.h"

namespace pagoda_cpu_silu {

using pagoda_cpu_scalar::exp_f32;
using pagoda_cpu_scalar::rounded;
using pagoda_cpu_scalar::to_f32;

// silu(g) as torch's F.silu computes it, g / (1 + exp(-g)) in fp32, stored as T.
template <typename T>
inline float silu_rounded(float g) {
  return rounded<T>(g / (1.0f + exp_f32(-g)));
}

#if defined(__AVX2__) && !defined(PAGODA_PORTABLE)
// silu_rounded<float> of 8 lanes: exp_f32 and the division op for op, no FMA (so, with
// -ffp-contract=off, the same bits as the scalar form). GCC leaves the scalar loop of
// the gemm's fp32 gated epilogue unvectorised ("control flow in loop"), a scalar exp an
// output element: 7 % of an fp32 run's worker time on an AVX2 box.
inline __m256 silu_f32x8(__m256 g) {
  const __m256 x = _mm256_xor_ps(g, _mm256_set1_ps(-0.0f));  // -g
  // std::min(std::max(x, -87), 88) with NaN kept: (max|min)_ps return the second operand
  // on NaN, as std::max(x, c) / std::min(v, c) return their first
  const __m256 xc = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  const __m256 n = _mm256_sub_ps(
      _mm256_add_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)), magic), magic);
  const __m256 r = _mm256_add_ps(_mm256_sub_ps(xc, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
  const __m256i two_n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
  e = _mm256_blendv_ps(e, _mm256_setzero_ps(),
                       _mm256_cmp_ps(x, _mm256_set1_ps(-87.33655f), _CMP_LT_OQ));
  e = _mm256_blendv_ps(e, _mm256_set1_ps(std::numeric_limits<float>::infinity()),
                       _mm256_cmp_ps(x, _mm256_set1_ps(88.72283f), _CMP_GT_OQ));
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}
#endif

// silu_rounded<bf16> of every bf16 value, as fp32, indexed by its bits. The exp already
// vectorises, but it still costs ~35 cycles per 16 lanes; a bf16 gate has only 2^16
// values, and one gather from this table (256 KiB; the values a model's gates take hit
// far fewer lines) is ~2.5x cheaper. Built once per library (~0.5 ms) by the same code,
// so the results are the same bits; read-only after.
inline const float* silu_bf16_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(1 << 16);
    float* tp = t.data();
#pragma omp simd
    for (int32_t b = 0; b < (1 << 16); ++b) tp[b] = silu_rounded<uint16_t>(to_f32(uint16_t(b)));
    return t;
  }();
  return table.data();
}

}  // namespace pagoda_cpu_silu
