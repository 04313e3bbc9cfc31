// Block kernels of the CPU paged decode (cpu_decode.cpp): for one block of one
// sequence, the scores of every query head against the block's K rows, and the
// softmax-weighted sum of its V rows. An AVX-512 version (fp32 scores: 8 tokens' dot
// products of up to 3 query heads accumulated in registers and reduced together, bf16
// alike), an AVX2 one (the same in 8-lane vectors, 8
// tokens at a time; head_dim a multiple of 8, else the portable loops) and a portable
// one; AVX-512 and portable take any head_dim
// (AVX-512 masks the last 16-wide chunk) and fp32 or bf16 (as uint16_t bits) caches.
// Where the CPU has AVX512-BF16, bf16 caches take their own AVX-512 path: scores by
// vdpbf16ps straight from the bf16 query and K rows, V rows widened by a shift and a mask
// into even and odd lanes (accumulators in that order until the end of the pass).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu_reduce16.h"
#include "cpu_scalar.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    !defined(PAGODA_PORTABLE) && !defined(PAGODA_NO_AVX512)
#define PAGODA_AVX512 1
#include <immintrin.h>
#if defined(__AVX512BF16__)
#define PAGODA_DECODE_DPBF16 1
#endif
#elif defined(__AVX2__) && defined(__FMA__) && !defined(PAGODA_PORTABLE)
// no AVX-512 (or PAGODA_NO_AVX512: tests build this path anywhere): 256-bit tiles
#define PAGODA_DECODE_AVX2 1
#include <immintrin.h>
#endif

namespace pagoda_cpu_decode {

using namespace pagoda_cpu_scalar;  // to_f32

struct Shape {
  int64_t batch, num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
  int64_t row_stride;             // elements from one token's row to the next: kv_heads * D
  int64_t num_parts, part_tokens;  // partitions per sequence, tokens per partition
  int64_t window;                  // > 0: a sequence attends to its last `window` keys only
  float softcap;                   // > 0: scores -> softcap * tanh(scores / softcap)
  bool twin_l2;                    // see twin_prefetch_into_l2
};

// One block's share of an item: tokens [0, n) of a block whose rows ([block_size,
// num_kv_heads, D]) start at `rows`, at positions [pos, pos + n) of the partition.
struct BlockView {
  int64_t n, pos;
  // elements from this block to the next one the item reads (0: none): each row read
  // here prefetches its twin there, so the next block's loads are spread over this
  // block's compute instead of stalling in one burst
  int64_t next_delta;
  // elements from this block to the one after the next (0: none): the AVX2 kernels
  // prefetch each row's twin there into L2 as well
  int64_t far_delta;
};

// One sequence's query rows, [num_heads, D], as the block kernels take them.
struct Query {
  const float* scaled;    // fp32, times the softmax scale
  const uint16_t* bf16;   // a bf16 query only: its own bits, unscaled (else nullptr)
  float scale;
};

// The twin in the next block of the 64 elements at `row`, into L1 (prefetcht0). On the
// KV pool's huge pages (services/worker/cpu_memory.py), into L2 (prefetcht1) as
// prefetch_block does, a batch-32 step over randomly placed blocks read K/V 8-19 %
// slower (fp32-bf16, one A/B process); over adjacent blocks, from cache, or on small
// pages the two measured alike.
//
// far_delta (the AVX2 kernels, bf16 caches): the row's twin two blocks on as well, into
// L2 (prefetcht1), so a block's lines have been on their way for two blocks' compute when
// the twin prefetch into L1 asks for them. On the Zen 3 box (AVX2, one A/B process, 30
// layers of KV on huge pages) bf16 batch 54 x 200-400 keys read K/V 1.07-1.10x faster
// from randomly placed blocks and ~1.03x from adjacent ones (a whole batch-54 step
// 1.02x); prefetching into L1 or 3-4 blocks on gained less. fp32 caches prefetch the
// block two on whole instead (cpu_decode.cpp, kWholeFar).
//
// twin_l2 (the AVX-512 kernels, where twin_prefetch_into_l2 says so): the twins go into L2
// (prefetcht1) instead.
template <typename T>
inline void prefetch_twin(const T* row, int64_t next_delta, int64_t far_delta = 0,
                          bool twin_l2 = false) {
  if (far_delta != 0) {
    const char* far = reinterpret_cast<const char*>(row + far_delta);
    for (int64_t off = 0; off < 64 * static_cast<int64_t>(sizeof(T)); off += 64)
      prefetch_read<2>(far + off);
  }
  if (next_delta == 0) return;
  const char* p = reinterpret_cast<const char*>(row + next_delta);
  for (int64_t off = 0; off < 64 * static_cast<int64_t>(sizeof(T)); off += 64) {
    if (twin_l2) prefetch_read<2>(p + off);
    else prefetch_read<3>(p + off);  // a loop of prefetches only: see cpu_scalar.h
  }
}

// Whether the AVX-512 kernels prefetch the next block's rows into L2 rather than L1: on
// AMD (Zen 4), where into L1 the twins held K/V reads to half the bandwidth. One A/B
// process on a 2-core Zen 4 EPYC (30 layers of KV on huge pages, batch 45 x 400 keys):
// into L2 a step's decode attention took 15.9 instead of 23.9 ms in bf16 (1.50x) and
// 26.9 instead of 47.2 in fp32 (1.72x) over adjacent blocks, 1.64x and 1.41x over
// randomly placed ones; prefetcht2 gained a little less (1.48x, 1.51x), the block two on
// (into L2, twins or whole blocks) no more. Other CPUs keep L1, which measured 8-19 %
// faster than L2 over randomly placed blocks on the AVX512-BF16 box of commit 4f1b2e2
// (its vendor not recorded). PAGODA_TWIN_PREFETCH_L2=0 or 1 builds either choice
// anywhere, for the A/B on a new kind of CPU.
inline bool twin_prefetch_into_l2() {
#if defined(PAGODA_TWIN_PREFETCH_L2)
  return PAGODA_TWIN_PREFETCH_L2 != 0;
#elif defined(__x86_64__)
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
#else
  return false;
#endif
}

#if defined(PAGODA_AVX512) || defined(PAGODA_DECODE_AVX2)
// The query heads of one kv head are taken in tiles of up to kTile rows: a tile's
// accumulators stay in registers while each K/V row is loaded (and widened) once.
constexpr int kTile = 4;

// Calls tile<gt>(kv head, first head of the tile) over every tile of every kv head.
template <typename Fn>
void for_each_tile(const Shape& s, Fn&& tile) {
  for (int64_t kvh = 0; kvh < s.num_kv_heads; ++kvh)
    for (int64_t g0 = 0; g0 < s.group; g0 += kTile) {
      const int64_t h = kvh * s.group + g0;
      switch (std::min<int64_t>(kTile, s.group - g0)) {
        case 1: tile(std::integral_constant<int, 1>{}, kvh, h); break;
        case 2: tile(std::integral_constant<int, 2>{}, kvh, h); break;
        case 3: tile(std::integral_constant<int, 3>{}, kvh, h); break;
        default: tile(std::integral_constant<int, 4>{}, kvh, h); break;
      }
    }
}
#endif

#ifdef PAGODA_AVX512
inline __mmask16 chunk_mask(int64_t left) {  // lanes of a 16-wide chunk inside head_dim
  return left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
}
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) {  // bf16 is the top half of an fp32
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

using pagoda_cpu_simd::reduce8;  // cpu_reduce16.h

// Query tiles of up to this many heads keep the scores' accumulators of kScoreTokens
// tokens in registers (kScoreHeads x kScoreTokens zmm; the tiles of 4 heads run as two
// of 2). The old form kept 16 tokens' (48 zmm for 3 heads, past the 32 registers: GCC
// kept them on the stack): on a 2-core Zen 4 EPYC, 30 layers of K/V on huge pages from
// randomly placed blocks, one A/B process, the same bits, a step's decode attention ran
// in fp32 1.07-1.11x faster this way at batch 45 x 400 keys, 1.07x at 64 x 300, 1.06-1.11x
// at 20 x 300; in bf16 1.11x, 1.08x, 1.02x.
constexpr int kScoreHeads = 3;
constexpr int kScoreTokens = 8;

// Calls score(std::integral_constant<int, g>{}, first) for the score tiles of a query tile
// of G heads: itself, or (G > kScoreHeads) its two halves, `first` the half's first head.
template <int G, typename Fn>
inline void for_each_score_tile(Fn&& score) {
  if constexpr (G <= kScoreHeads) {
    score(std::integral_constant<int, G>{}, 0);
  } else {
    score(std::integral_constant<int, G / 2>{}, 0);
    score(std::integral_constant<int, G - G / 2>{}, G / 2);
  }
}

// scores[i, pos + t] = q[i] . k[t] for the GT query rows of a tile (q: [GT, D]; scores:
// rows part_tokens apart) and the block's tokens (k: the tile's kv head in the block), 8
// tokens at a time: per 64-wide slice of head_dim each token's K slice is loaded once
// and FMAs into the GT x 8 accumulators; the 8 tokens' lane partial sums are then
// reduced together. Rows past the block's n are not read (masked loads of nothing).
template <int GT, typename T>
void scores_tile(const Shape& s, const T* k, BlockView bv, const float* q, float* scores) {
  static_assert(GT <= kScoreHeads, "a tile's accumulators must fit in registers");
  const int64_t D = s.head_dim;
  for (int64_t t0 = 0; t0 < bv.n; t0 += kScoreTokens) {
    const int64_t nt = std::min<int64_t>(kScoreTokens, bv.n - t0);
    __m512 dots[GT][kScoreTokens];
    for (int i = 0; i < GT; ++i)
      for (int t = 0; t < kScoreTokens; ++t) dots[i][t] = _mm512_setzero_ps();
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      __mmask16 m[4];
      for (int c = 0; c < 4; ++c) m[c] = chunk_mask(D - d0 - 16 * c);
      const T* kt = k + t0 * s.row_stride + d0;
#pragma GCC unroll 8
      for (int t = 0; t < kScoreTokens; ++t, kt += s.row_stride) {
        const bool row = t < nt;
        if (row) prefetch_twin(kt, bv.next_delta, 0, s.twin_l2);
        __m512 kc[4];
        for (int c = 0; c < 4; ++c) kc[c] = load16(kt + 16 * c, row ? m[c] : __mmask16(0));
        // the query slices are loaded again for each token: hoisted, their 4 GT registers
        // would push the accumulators out to the stack
        const float* qd = q + d0;
        asm("" : "+r"(qd));
        for (int i = 0; i < GT; ++i)
          for (int c = 0; c < 4; ++c)
            dots[i][t] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m[c], qd + i * D + 16 * c),
                                         kc[c], dots[i][t]);
      }
    }
    for (int i = 0; i < GT; ++i)
      _mm256_mask_storeu_ps(scores + i * s.part_tokens + bv.pos + t0,
                            static_cast<__mmask8>(chunk_mask(nt)), reduce8(dots[i]));
  }
}

// acc[i] += sum_t p[i, pos + t] * v[t] for the GT rows of a tile (acc: [GT, D]). A
// 64-wide slice of the tile's accumulators stays in registers across the block.
template <int GT, typename T>
void accumulate_tile(const Shape& s, const T* v, BlockView bv, const float* p, float* acc) {
  const int64_t D = s.head_dim;
  const float* pt = p + bv.pos;
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __mmask16 m[4];
    __m512 a[GT][4];
    for (int c = 0; c < 4; ++c) {
      m[c] = chunk_mask(D - d0 - 16 * c);
      for (int i = 0; i < GT; ++i) a[i][c] = load16(acc + i * D + d0 + 16 * c, m[c]);
    }
    for (int64_t t = 0; t < bv.n; ++t) {
      const T* vt = v + t * s.row_stride + d0;
      prefetch_twin(vt, bv.next_delta, 0, s.twin_l2);
      __m512 w[GT];
      for (int i = 0; i < GT; ++i) w[i] = _mm512_set1_ps(pt[i * s.part_tokens + t]);
      for (int c = 0; c < 4; ++c) {
        const __m512 vc = load16(vt + 16 * c, m[c]);
        for (int i = 0; i < GT; ++i) a[i][c] = _mm512_fmadd_ps(w[i], vc, a[i][c]);
      }
    }
    for (int c = 0; c < 4; ++c)
      for (int i = 0; i < GT; ++i) _mm512_mask_storeu_ps(acc + i * D + d0 + 16 * c, m[c], a[i][c]);
  }
}

#ifdef PAGODA_DECODE_DPBF16
inline __mmask32 chunk_mask32(int64_t left) {  // lanes of a 32-wide bf16 chunk inside head_dim
  return left >= 32 ? __mmask32(0xFFFFFFFFu) : left <= 0 ? __mmask32(0) : __mmask32((1u << left) - 1);
}

// scores_tile for bf16: per 64-wide slice of head_dim, two vdpbf16ps per query row and
// token on the raw bf16 rows (exact products, fp32 sums), the scale applied to each
// reduced score; 8 tokens at a time, as scores_tile, for the same reason.
template <int GT>
void scores_tile_bf16(const Shape& s, const uint16_t* k, BlockView bv, const uint16_t* q,
                      float scale, float* scores) {
  static_assert(GT <= kScoreHeads, "a tile's accumulators must fit in registers");
  const int64_t D = s.head_dim;
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t t0 = 0; t0 < bv.n; t0 += kScoreTokens) {
    const int64_t nt = std::min<int64_t>(kScoreTokens, bv.n - t0);
    __m512 dots[GT][kScoreTokens];
    for (int i = 0; i < GT; ++i)
      for (int t = 0; t < kScoreTokens; ++t) dots[i][t] = _mm512_setzero_ps();
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      const __mmask32 m0 = chunk_mask32(D - d0), m1 = chunk_mask32(D - d0 - 32);
      const uint16_t* kt = k + t0 * s.row_stride + d0;
#pragma GCC unroll 8
      for (int t = 0; t < kScoreTokens; ++t, kt += s.row_stride) {
        const bool row = t < nt;
        if (row) prefetch_twin(kt, bv.next_delta, 0, s.twin_l2);
        const __m512bh k0 = (__m512bh)_mm512_maskz_loadu_epi16(row ? m0 : __mmask32(0), kt);
        const __m512bh k1 = (__m512bh)_mm512_maskz_loadu_epi16(row ? m1 : __mmask32(0), kt + 32);
        const uint16_t* qd = q + d0;  // loaded again per token, as in scores_tile
        asm("" : "+r"(qd));
        for (int i = 0; i < GT; ++i)
          dots[i][t] = _mm512_dpbf16_ps(
              _mm512_dpbf16_ps(dots[i][t],
                               (__m512bh)_mm512_maskz_loadu_epi16(m0, qd + i * D), k0),
              (__m512bh)_mm512_maskz_loadu_epi16(m1, qd + i * D + 32), k1);
      }
    }
    for (int i = 0; i < GT; ++i)
      _mm256_mask_storeu_ps(scores + i * s.part_tokens + bv.pos + t0,
                            static_cast<__mmask8>(chunk_mask(nt)),
                            _mm256_mul_ps(reduce8(dots[i]), vscale));
  }
}

// Where the 32-wide chunk of head_dim at d0 keeps its widened lanes in an accumulator row:
// the even dims first, then the odd ones (a chunk of w dims: ceil(w / 2) even, w / 2 odd).
struct SplitChunk {
  __mmask16 even, odd;
  int64_t odd_at;  // offset of the odd lanes from the chunk's start
  explicit SplitChunk(int64_t w)
      : even(chunk_mask((std::min<int64_t>(w, 32) + 1) / 2)),
        odd(chunk_mask(std::min<int64_t>(w, 32) / 2)),
        odd_at((std::min<int64_t>(w, 32) + 1) / 2) {}
};

// accumulate_tile for bf16: each 32-wide chunk of a V row is one load, widened into its
// even dims (shifted up) and odd dims (masked), so acc holds the split layout.
template <int GT>
void accumulate_tile_bf16(const Shape& s, const uint16_t* v, BlockView bv, const float* p,
                          float* acc) {
  const int64_t D = s.head_dim;
  const float* pt = p + bv.pos;
  const __m512i odd_bits = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const __mmask32 m[2] = {chunk_mask32(D - d0), chunk_mask32(D - d0 - 32)};
    const SplitChunk c0(D - d0), c1(std::max<int64_t>(D - d0 - 32, 0));
    const SplitChunk* ch[2] = {&c0, &c1};
    __m512 a[GT][4];
    for (int i = 0; i < GT; ++i)
      for (int c = 0; c < 2; ++c) {
        const float* base = acc + i * D + d0 + 32 * c;
        a[i][2 * c] = _mm512_maskz_loadu_ps(ch[c]->even, base);
        a[i][2 * c + 1] = _mm512_maskz_loadu_ps(ch[c]->odd, base + ch[c]->odd_at);
      }
    for (int64_t t = 0; t < bv.n; ++t) {
      const uint16_t* vt = v + t * s.row_stride + d0;
      prefetch_twin(vt, bv.next_delta, 0, s.twin_l2);
      __m512 w[GT];
      for (int i = 0; i < GT; ++i) w[i] = _mm512_set1_ps(pt[i * s.part_tokens + t]);
      for (int c = 0; c < 2; ++c) {
        const __m512i x = _mm512_maskz_loadu_epi16(m[c], vt + 32 * c);
        const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(x, odd_bits));
        for (int i = 0; i < GT; ++i) {
          a[i][2 * c] = _mm512_fmadd_ps(w[i], even, a[i][2 * c]);
          a[i][2 * c + 1] = _mm512_fmadd_ps(w[i], odd, a[i][2 * c + 1]);
        }
      }
    }
    for (int i = 0; i < GT; ++i)
      for (int c = 0; c < 2; ++c) {
        float* base = acc + i * D + d0 + 32 * c;
        _mm512_mask_storeu_ps(base, ch[c]->even, a[i][2 * c]);
        _mm512_mask_storeu_ps(base + ch[c]->odd_at, ch[c]->odd, a[i][2 * c + 1]);
      }
  }
}
#endif

template <typename T>
void block_scores(const Shape& s, const T* rows, BlockView bv, const Query& q, float* scores) {
  for_each_tile(s, [&](auto gt, int64_t kvh, int64_t h) {
    constexpr int G = decltype(gt)::value;
#ifdef PAGODA_DECODE_DPBF16
    // a bf16 query: vdpbf16ps on both sides' bits; an fp32 one (bf16 cache under an fp32
    // model) keeps its precision and takes the widening tile
    if constexpr (std::is_same_v<T, uint16_t>) {
      if (q.bf16 != nullptr) {
        for_each_score_tile<G>([&](auto g, int64_t first) {
          scores_tile_bf16<decltype(g)::value>(s, rows + kvh * s.head_dim, bv,
                                               q.bf16 + (h + first) * s.head_dim, q.scale,
                                               scores + (h + first) * s.part_tokens);
        });
        return;
      }
    }
#endif
    for_each_score_tile<G>([&](auto g, int64_t first) {
      scores_tile<decltype(g)::value>(s, rows + kvh * s.head_dim, bv,
                                      q.scaled + (h + first) * s.head_dim,
                                      scores + (h + first) * s.part_tokens);
    });
  });
}

template <typename T>
void block_accumulate(const Shape& s, const T* rows, BlockView bv, const float* p, float* acc) {
  for_each_tile(s, [&](auto gt, int64_t kvh, int64_t h) {
    constexpr int G = decltype(gt)::value;
#ifdef PAGODA_DECODE_DPBF16
    if constexpr (std::is_same_v<T, uint16_t>) {
      accumulate_tile_bf16<G>(s, rows + kvh * s.head_dim, bv, p + h * s.part_tokens,
                              acc + h * s.head_dim);
      return;
    }
#endif
    accumulate_tile<G>(s, rows + kvh * s.head_dim, bv, p + h * s.part_tokens,
                       acc + h * s.head_dim);
  });
}

// Puts a head row of V sums (D floats) back in dim order after a pass that left it in
// the split layout (bf16 caches on the AVX512-BF16 path); a no-op otherwise.
template <typename T>
void unsplit_row(int64_t D, float* row) {
#ifdef PAGODA_DECODE_DPBF16
  if constexpr (std::is_same_v<T, uint16_t>) {
    float tmp[32];
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      const int64_t w = std::min<int64_t>(32, D - d0), odd_at = SplitChunk(w).odd_at;
      for (int64_t j = 0; j < w; ++j) tmp[j] = row[d0 + (j % 2 ? odd_at + j / 2 : j / 2)];
      std::copy(tmp, tmp + w, row + d0);
    }
  }
#endif
  (void)D;
  (void)row;
}
#else
// scores[h, pos + t] = q[h] . k[t, h / G]
template <typename T>
void block_scores_scalar(const Shape& s, const T* rows, BlockView bv, const Query& q,
                         float* scores) {
  const int64_t D = s.head_dim;
  for (int64_t t = 0; t < bv.n; ++t) {
    for (int64_t h = 0; h < s.num_heads; ++h) {
      const float* qh = q.scaled + h * D;
      const T* k = rows + t * s.row_stride + (h / s.group) * D;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qh[d] * to_f32(k[d]);
      scores[h * s.part_tokens + bv.pos + t] = dot;
    }
  }
}

// acc[h] += sum_t p[h, pos + t] * v[t, h / G]
template <typename T>
void block_accumulate_scalar(const Shape& s, const T* rows, BlockView bv, const float* p,
                             float* acc) {
  const int64_t D = s.head_dim;
  for (int64_t t = 0; t < bv.n; ++t) {
    for (int64_t h = 0; h < s.num_heads; ++h) {
      const float w = p[h * s.part_tokens + bv.pos + t];
      const T* v = rows + t * s.row_stride + (h / s.group) * D;
      float* ah = acc + h * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ah[d] += w * to_f32(v[d]);
    }
  }
}

#ifdef PAGODA_DECODE_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // bf16 is the top half of an fp32
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Tokens a tile's scores take at a time: as many as keep the GT x NT accumulators, the
// GT query chunks and one K chunk within the 16 ymm registers (GT 3: 12 + 3 + 1).
template <int GT>
constexpr int kScoreTokens = GT == 1 ? 8 : GT == 4 ? 2 : 4;

// scores[i, t] = q[i] . k[t] for the GT query rows of a tile (q: [GT, D], pre-scaled)
// and NT consecutive tokens (k: the first one's row; scores: rows `stride` apart). Per
// 8-wide chunk of head_dim the tile's query chunks are loaded once for the NT tokens.
template <int GT, int NT, typename T>
__attribute__((always_inline)) inline void scores_tokens(const Shape& s, const T* k,
                                                         BlockView bv, const float* q,
                                                         float* scores, int64_t stride) {
  const int64_t D = s.head_dim;
  __m256 dots[GT][NT];
  for (int i = 0; i < GT; ++i)
    for (int t = 0; t < NT; ++t) dots[i][t] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m256 qr[GT];
    for (int i = 0; i < GT; ++i) qr[i] = _mm256_loadu_ps(q + i * D + d);
    for (int t = 0; t < NT; ++t) {
      const T* kt = k + t * s.row_stride + d;
      if (d % 64 == 0) prefetch_twin(kt, bv.next_delta, bv.far_delta);
      const __m256 kc = load8(kt);
      for (int i = 0; i < GT; ++i) dots[i][t] = _mm256_fmadd_ps(qr[i], kc, dots[i][t]);
    }
  }
  const __m256 zero = _mm256_setzero_ps();
  for (int i = 0; i < GT; ++i) {
    for (int t0 = 0; t0 < NT; t0 += 4) {
      auto at = [&](int t) { return t0 + t < NT ? dots[i][t0 + t] : zero; };
      const __m128 r = pagoda_cpu_simd::reduce4(at(0), at(1), at(2), at(3));
      float* out = scores + i * stride + t0;
      if constexpr (NT >= 4) _mm_storeu_ps(out, r);
      else {
        alignas(16) float tmp[4];
        _mm_store_ps(tmp, r);
        std::copy(tmp, tmp + std::min(NT - t0, 4), out);
      }
    }
  }
}

// scores[i, pos + t] = q[i] . k[t] for the GT query rows of a tile (q: [GT, D], pre-
// scaled) and the block's tokens, kScoreTokens<GT> at a time, the rest one by one.
template <int GT, typename T>
void scores_tile_avx2(const Shape& s, const T* k, BlockView bv, const float* q, float* scores) {
  constexpr int NT = kScoreTokens<GT>;
  float* row = scores + bv.pos;
  int64_t t = 0;
  for (; t + NT <= bv.n; t += NT)
    scores_tokens<GT, NT>(s, k + t * s.row_stride, bv, q, row + t, s.part_tokens);
  for (; t < bv.n; ++t)
    scores_tokens<GT, 1>(s, k + t * s.row_stride, bv, q, row + t, s.part_tokens);
}

// acc[i] += sum_t p[i, pos + t] * v[t] over the NC ymm of head_dim from d0, for the GT
// rows of a tile: that slice of their accumulators stays in registers across the block.
template <int GT, int NC, typename T>
__attribute__((always_inline)) inline void accumulate_slice(const Shape& s, const T* v,
                                                            BlockView bv, const float* pt,
                                                            int64_t d0, float* acc) {
  const int64_t D = s.head_dim;
  __m256 a[GT][NC];
  for (int i = 0; i < GT; ++i)
    for (int c = 0; c < NC; ++c) a[i][c] = _mm256_loadu_ps(acc + i * D + d0 + 8 * c);
  for (int64_t t = 0; t < bv.n; ++t) {
    const T* vt = v + t * s.row_stride + d0;
    prefetch_twin(vt, bv.next_delta, bv.far_delta);
    __m256 w[GT];
    for (int i = 0; i < GT; ++i) w[i] = _mm256_set1_ps(pt[i * s.part_tokens + t]);
    for (int c = 0; c < NC; ++c) {
      const __m256 vc = load8(vt + 8 * c);
      for (int i = 0; i < GT; ++i) a[i][c] = _mm256_fmadd_ps(w[i], vc, a[i][c]);
    }
  }
  for (int i = 0; i < GT; ++i)
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(acc + i * D + d0 + 8 * c, a[i][c]);
}

template <int GT, typename T>
void accumulate_tile_avx2(const Shape& s, const T* v, BlockView bv, const float* p, float* acc) {
  const float* pt = p + bv.pos;
  for (int64_t d0 = 0; d0 < s.head_dim; d0 += 32) {
    switch (std::min<int64_t>(4, (s.head_dim - d0) / 8)) {
      case 1: accumulate_slice<GT, 1>(s, v, bv, pt, d0, acc); break;
      case 2: accumulate_slice<GT, 2>(s, v, bv, pt, d0, acc); break;
      case 3: accumulate_slice<GT, 3>(s, v, bv, pt, d0, acc); break;
      default: accumulate_slice<GT, 4>(s, v, bv, pt, d0, acc); break;
    }
  }
}

template <typename T>
void block_scores(const Shape& s, const T* rows, BlockView bv, const Query& q, float* scores) {
  if (s.head_dim % 8 != 0) return block_scores_scalar(s, rows, bv, q, scores);
  for_each_tile(s, [&](auto gt, int64_t kvh, int64_t h) {
    scores_tile_avx2<decltype(gt)::value>(s, rows + kvh * s.head_dim, bv,
                                          q.scaled + h * s.head_dim, scores + h * s.part_tokens);
  });
}

template <typename T>
void block_accumulate(const Shape& s, const T* rows, BlockView bv, const float* p, float* acc) {
  if (s.head_dim % 8 != 0) return block_accumulate_scalar(s, rows, bv, p, acc);
  for_each_tile(s, [&](auto gt, int64_t kvh, int64_t h) {
    accumulate_tile_avx2<decltype(gt)::value>(s, rows + kvh * s.head_dim, bv,
                                              p + h * s.part_tokens, acc + h * s.head_dim);
  });
}
#else
template <typename T>
void block_scores(const Shape& s, const T* rows, BlockView bv, const Query& q, float* scores) {
  block_scores_scalar(s, rows, bv, q, scores);
}

template <typename T>
void block_accumulate(const Shape& s, const T* rows, BlockView bv, const float* p, float* acc) {
  block_accumulate_scalar(s, rows, bv, p, acc);
}
#endif

template <typename T>
void unsplit_row(int64_t, float*) {}  // the AVX2 and portable passes keep dim order
#endif

}  // namespace pagoda_cpu_decode
