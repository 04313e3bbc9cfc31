// 8-lane softmax pieces (AVX2 + FMA) shared by the CPU attention kernels: the exp of
// non-positive arguments (scores less their max), horizontal max and sum, and a row's
// softmax numerators in place (cpu_decode.cpp; cpu_prefill.cpp runs its own online
// softmax over the same exp). Defined wherever the compiler targets AVX2 and FMA, so
// AVX-512 builds use them too. GCC leaves loops over cpu_scalar.h's exp_f32 scalar
// whenever their trip count or ranges are ragged (a call or a branchy inline body per
// element); these are written out in intrinsics instead.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !defined(PAGODA_PORTABLE)
#define PAGODA_SOFTMAX_AVX2 1
#include <immintrin.h>

#include <cstdint>
#include <limits>

namespace pagoda_cpu_simd {

// exp(x) of 8 lanes, x <= 0 or -inf, the Cephes polynomial of cpu_scalar.h's exp_f32
// with the power of two built in the exponent bits. Inputs below -87.33 (-inf included)
// give exactly 0, as exp_f32; NaN stays NaN (max_ps returns its second operand when
// either is NaN).
inline __m256 exp_nonpos_avx2(__m256 x) {
  const __m256 xc = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i two_n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33655f), _CMP_LT_OQ);
  return _mm256_andnot_ps(tiny, e);
}

inline float hmax8(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

inline float hsum8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// All ones in the lanes below `left` (0..8) of an 8-lane vector.
inline __m256i lanes_below(int64_t left) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// x[i] = exp(x[i] - max), i < n (n >= 1), returning the row's max and the sum of the
// numerators; the elements from n on are neither read nor written.
inline void softmax_numerators(float* x, int64_t n, float& max_out, float& sum_out) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t whole = n / 8 * 8;
  const __m256i tail = lanes_below(n - whole);
  const __m256 tail_ps = _mm256_castsi256_ps(tail);
  __m256 vmax = ninf;
  for (int64_t i = 0; i < whole; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(x + i));
  if (whole < n)
    vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(ninf, _mm256_maskload_ps(x + whole, tail), tail_ps));
  const float m = hmax8(vmax);
  const __m256 vm = _mm256_set1_ps(m);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t i = 0; i < whole; i += 8) {
    const __m256 e = exp_nonpos_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
    _mm256_storeu_ps(x + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  if (whole < n) {
    const __m256 e = _mm256_and_ps(
        exp_nonpos_avx2(_mm256_sub_ps(_mm256_maskload_ps(x + whole, tail), vm)), tail_ps);
    _mm256_maskstore_ps(x + whole, tail, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  max_out = m;
  sum_out = hsum8(vsum);
}

}  // namespace pagoda_cpu_simd
#endif
