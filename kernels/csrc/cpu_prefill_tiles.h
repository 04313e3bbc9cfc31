// Register tiles of the CPU paged prefill (cpu_prefill.cpp), AVX-512 only (the AVX2 path
// is in cpu_prefill.cpp itself).
//
// The layout is "rows in lanes": the rows of a work item (query positions x the G query
// heads of one kv head) run along the 16 lanes of a vector, 48 rows (kNR vectors) to a
// row block, and keys / head_dim elements are broadcast from memory (an embedded
// broadcast operand, free next to the FMA). So
//   scores^T[key][row]  = sum_d   Q^T[d][row]   * K[key][d]      (qk_tile)
//   O^T[d][row]        += sum_key P^T[key][row] * V[key][d]      (pv_tile)
// and the online softmax works lane-wise (the row max and sum are plain vector max/add
// over keys, no horizontal reductions), as does the causal mask (a compare of the key
// index with the rows' positions). K and V stay in their natural [key][d] layout, so
// packing a chunk of the cache is a copy; only Q (in) and O (out) are transposed, once
// per item.
//
// Two modes share the tiles through a `Word`: F32 (fp32 words, one FMA per product) and
// Bf16 (AVX512-BF16: a word holds two bf16 along the reduced dimension, d for QK^T and
// key for P.V, and vdpbf16ps does two products per lane with fp32 accumulation; half the
// instructions). In Bf16 mode the softmax numerators P are rounded to bf16 before P.V,
// as torch's own CPU flash attention does for reduced precision; the row sums stay fp32.
#pragma once

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    !defined(PAGODA_PORTABLE) && !defined(PAGODA_NO_AVX512)
#define PAGODA_PREFILL_AVX512 1
#include <immintrin.h>
#if defined(__AVX512BF16__)
#define PAGODA_PREFILL_BF16 1
#endif
#elif defined(__AVX2__) && defined(__FMA__) && !defined(PAGODA_PORTABLE)
// no AVX-512 (or PAGODA_NO_AVX512, which tests use to build this path anywhere): 256-bit
// row-by-row blocks in cpu_prefill.cpp (run_item_avx2)
#define PAGODA_PREFILL_AVX2 1
#include <immintrin.h>
#endif

namespace pagoda_cpu_prefill {

#ifdef PAGODA_PREFILL_AVX512
constexpr int kLanes = 16;
constexpr int kNR = 3;               // row vectors per row block: 48 rows
constexpr int kRB = kNR * kLanes;    // rows per row block (the stride of every [.][row] buffer)
constexpr int kNT = 8;               // keys per QK^T register tile (kNT x kNR accumulators)
constexpr int kND = 8;               // head_dim elements per P.V register tile (kND x kNR)
constexpr int kTk = 64;              // keys per packed K/V chunk (a multiple of kNT)

struct F32Mode {
  using Word = float;
  static constexpr int W = 1;  // reduced-dimension elements per word
  static inline __m512 load(const Word* p) { return _mm512_loadu_ps(p); }
  static inline __m512 madd(__m512 acc, __m512 a, const Word* b) {
    return _mm512_fmadd_ps(a, _mm512_set1_ps(*b), acc);
  }
};

#ifdef PAGODA_PREFILL_BF16
struct Bf16Mode {
  using Word = uint32_t;  // two bf16: the low half is the even element
  static constexpr int W = 2;
  static inline __m512 load(const Word* p) { return _mm512_castsi512_ps(_mm512_loadu_si512(p)); }
  static inline __m512 madd(__m512 acc, __m512 a, const Word* b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_castps_si512(a),
                            (__m512bh)_mm512_set1_epi32(static_cast<int>(*b)));
  }
};
#endif

// acc[t][r] = sum_p qt[p][16 r + lane] . kp[t][p] over p < dw words, for kNT keys.
// qt: the row block's Q^T, rows `q_stride` words apart; kp: kNT packed key rows of dw
// words. Each step loads NR query vectors and broadcasts one word per key.
template <class M, int NR>
inline void qk_tile(const typename M::Word* qt, int64_t q_stride, const typename M::Word* kp,
                    int64_t dw, __m512 (&acc)[kNT][NR]) {
  for (int t = 0; t < kNT; ++t)
    for (int r = 0; r < NR; ++r) acc[t][r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < dw; ++p) {
    __m512 q[NR];
    for (int r = 0; r < NR; ++r) q[r] = M::load(qt + p * q_stride + r * kLanes);
    for (int t = 0; t < kNT; ++t)
      for (int r = 0; r < NR; ++r) acc[t][r] = M::madd(acc[t][r], q[r], kp + t * dw + p);
  }
}

// ot[d][16 r + lane] = ot[d][..] * alpha[r] + sum_s pp[s][16 r + lane] . vp[s][d] over the
// steps (keys, or key pairs in Bf16 mode) and every d < head_dim, kND at a time.
// pp: P^T, rows kRB words apart; vp: packed V, rows head_dim words apart; ot: O^T, rows
// kRB floats apart.
template <class M, int NR>
inline void pv_tile(const typename M::Word* pp, int64_t steps, const typename M::Word* vp,
                    int64_t head_dim, float* ot, const __m512 (&alpha)[NR]) {
  for (int64_t d0 = 0; d0 < head_dim; d0 += kND) {
    __m512 acc[kND][NR];
    for (int d = 0; d < kND; ++d)
      for (int r = 0; r < NR; ++r)
        acc[d][r] = _mm512_mul_ps(_mm512_loadu_ps(ot + (d0 + d) * kRB + r * kLanes), alpha[r]);
    for (int64_t s = 0; s < steps; ++s) {
      __m512 p[NR];
      for (int r = 0; r < NR; ++r) p[r] = M::load(pp + s * kRB + r * kLanes);
      const typename M::Word* v = vp + s * head_dim + d0;
      for (int d = 0; d < kND; ++d)
        for (int r = 0; r < NR; ++r) acc[d][r] = M::madd(acc[d][r], p[r], v + d);
    }
    for (int d = 0; d < kND; ++d)
      for (int r = 0; r < NR; ++r) _mm512_storeu_ps(ot + (d0 + d) * kRB + r * kLanes, acc[d][r]);
  }
}

// Transposes the 16 x 16 matrix of 32-bit elements whose rows are r[0..15], in place.
inline void transpose16(__m512i (&r)[16]) {
  __m512i a[16];
  for (int i = 0; i < 16; i += 2) {  // 2x2 blocks of elements
    a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // 4x4 blocks within each 128-bit lane
    r[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes: rows i, i + 4 then i + 8, i + 12
    a[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    a[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
    a[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    a[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(a[i], a[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(a[i], a[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_i32x4(a[i + 4], a[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(a[i + 4], a[i + 12], 0xDD);
  }
}

// exp(x) for x <= 0 or -inf (a masked score), the Cephes polynomial of cpu_scalar.h's
// exp_f32 with the power of two applied by scalef. Inputs below -120 (-inf included)
// give exactly 0; NaN stays NaN (max_ps returns its second operand when either is NaN).
inline __m512 exp_nonpos(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-120.0f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
// tanh(x) as cpu_scalar.h's tanh_f32 (the same series and formula), 16 lanes at once.
inline __m512 tanh_ps(__m512 x) {
  const __m512i sign_bit = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  const __m512 a = _mm512_abs_ps(x), a2 = _mm512_mul_ps(a, a);
  __m512 p = _mm512_set1_ps(0.0218694885f);
  p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(-0.0539682540f));
  p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(0.133333333f));
  p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(-0.333333333f));
  p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(1.0f));
  const __m512 small = _mm512_mul_ps(a, p);
  const __m512 e = exp_nonpos(_mm512_mul_ps(a, _mm512_set1_ps(-2.0f)));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 big = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512 r = _mm512_mask_mov_ps(big, _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.25f), _CMP_LT_OQ),
                                      small);
  return _mm512_castsi512_ps(_mm512_or_si512(
      _mm512_castps_si512(r), _mm512_and_si512(_mm512_castps_si512(x), sign_bit)));
}
#endif  // PAGODA_PREFILL_AVX512

}  // namespace pagoda_cpu_prefill
