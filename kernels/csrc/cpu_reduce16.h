// The horizontal sums of 16 (or 8) AVX-512 vectors at once, shared by the CPU kernels
// that accumulate lane partial sums per output (cpu_decode_blocks.h: scores, 8 at a
// time; cpu_gemv.cpp: linear outputs), defined only where the compiler targets AVX-512F;
// and of 4 AVX2 vectors (cpu_decode_blocks.h's AVX2 scores), where it targets AVX2.
#pragma once

#ifdef __AVX512F__
#include <immintrin.h>

namespace pagoda_cpu_simd {

// The tree's first levels on 8 vectors v[0..7]: 128-bit lanes 0 and 1 of the result
// each hold half of the sums of v[0..3] (in that order), lanes 2 and 3 half of v[4..7]'s.
__attribute__((always_inline)) inline __m512 fold8(const __m512* v) {
  __m512 a[4], b[2];
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i) {  // per 128-bit lane: the 4 rows' partial sums
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88),  // fold 128-bit lanes pairwise
                       _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
}

// r[i] = sum of the lanes of v[i], i < 16: a pairwise tree of unpacks and lane shuffles
// (fold8 on each half, then the 128-bit lanes folded pairwise), ~3 instructions per
// result instead of a full horizontal sum each.
__attribute__((always_inline)) inline __m512 reduce16(const __m512* v) {
  const __m512 c0 = fold8(v), c1 = fold8(v + 8);
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88),
                       _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

// The sums of v[0..7] in lanes 0..7: the same tree on 8 vectors (each sum adds its
// lanes in the same order as reduce16 would, so the same bits).
__attribute__((always_inline)) inline __m256 reduce8(const __m512* v) {
  const __m512 c = fold8(v);
  return _mm512_castps512_ps256(_mm512_add_ps(_mm512_shuffle_f32x4(c, c, 0x88),
                                              _mm512_shuffle_f32x4(c, c, 0xDD)));
}

}  // namespace pagoda_cpu_simd
#endif

#ifdef __AVX2__
#include <immintrin.h>

namespace pagoda_cpu_simd {

// The sums of the 8 lanes of a, b, c and d, in that order (AVX2): pairwise hadd within
// 128-bit lanes twice, then the two halves folded, so each sum is
// ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)).
__attribute__((always_inline)) inline __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

}  // namespace pagoda_cpu_simd
#endif
