// CPU paged-attention prefill: causal varlen attention of each sequence's new tokens
// over its whole context (cached tokens, then the new ones), K/V read through the block
// table. Serves plain prefill, chunked prefill and prefix-cache hits; a query_len of 1
// is a decode row.
//
// Built at runtime by kernels/cpu_prefill.py (load_inline, -O3 -march=native and the
// OpenMP flags of cpu_extension.py) and registered as torch.ops.<PAGODA_OP_NS>.prefill;
// the Python wrapper validates shapes and dtypes, this file the index values.
//
// Work item = (sequence, kv head, tile of query positions): its rows are the tile's
// positions x the G query heads that share the kv head (position-major), ~96 rows, so
// every K/V row the item reads serves all of them (GQA). Flash-attention style: the item
// walks its keys, up to the causal limit of its last position, in chunks of kTk keys;
// each chunk is copied out of the cache once (K rows as they are, V rows interleaved by
// key pairs in bf16) and reused by every row block (48 rows) of the item, whose running
// max / sum / O^T accumulators live in per-thread scratch. Per row block and chunk:
// scores for only the keys its last row can see (so the causal triangle costs ~8 keys of
// waste per row, not half a tile), the mask only where a key passes a row's position,
// online softmax, then P.V with the rescale folded into the accumulator load. The
// register tiles and the data layout ("rows in lanes") are described in
// cpu_prefill_tiles.h. Items are ordered by cost, longest first, and handed out through
// an atomic counter, so ragged sequences balance on torch's intra-op pool.
//
// A sliding window (window > 0: a row at position p sees keys p - window < j <= p)
// starts an item's key walk at its first row's first visible key, skips the chunks a
// row block cannot see and masks the rest per row; a row that has seen no key yet keeps
// max -inf and its (zero) sums. A soft cap (softcap > 0) maps each scaled score to
// softcap * tanh(score / softcap) before the mask and the softmax.
//
// Without AVX-512, AVX2 + FMA machines run the same items row by row against each
// packed chunk with 256-bit registers (run_item_avx2; head_dim a multiple of 8). The
// portable build (-DPAGODA_PORTABLE, or neither) runs them with plain loops: correctness
// only.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_attention_types.h"
#include "cpu_prefill_tiles.h"
#include "cpu_scalar.h"
#include "cpu_softmax_avx2.h"

#ifndef PAGODA_OP_NS
#define PAGODA_OP_NS pagoda_cpu_prefill
#endif

namespace {

using namespace pagoda_cpu_prefill;
using namespace pagoda_cpu_scalar;  // to_f32, store, exp_f32
#ifdef PAGODA_PREFILL_AVX2
using pagoda_cpu_simd::exp_nonpos_avx2;
using pagoda_cpu_simd::hmax8;
using pagoda_cpu_simd::hsum8;
#endif

// Rows per item: two row blocks. Fewer rows re-pack each K/V chunk for less work; more
// rows coarsen the load balance and grow the per-thread scratch.
constexpr int64_t kTargetRows = 96;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Shape {
  int64_t batch, num_tokens, num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
  int64_t row_stride;  // elements from one cache row (token) to the next: kv_heads * D
  int64_t tile_q;      // query positions per item
  int64_t max_len;     // longest seq_len
  int64_t window;      // > 0: sliding window (keys p - window < j <= p)
  float softcap;       // > 0: scores -> softcap * tanh(scores / softcap)
};

struct Item {
  int64_t seq, kv_head, q0, nq;  // positions q0 .. q0 + nq of the sequence's new tokens
  int64_t cost;                  // ~ multiply-adds, for the longest-first order
};

// 64-byte aligned float storage (vector loads of a row never split a cache line).
class Buffer {
 public:
  explicit Buffer(int64_t n) : v_(static_cast<size_t>(n) + 16) {}
  float* data() {
    const auto a = reinterpret_cast<uintptr_t>(v_.data());
    return reinterpret_cast<float*>((a + 63) & ~uintptr_t{63});
  }

 private:
  std::vector<float> v_;
};

// The op's arguments (see the schema at the bottom), and the widened index arrays.
struct Args {
  const at::Tensor &out, &query, &k_cache, &v_cache, &query_start_loc, &seq_lens, &block_tables;
  double scale;
  int64_t window;
  double softcap;
};

// Q: query / output element, T: cache element (float or bf16 bits; bf16 under an fp32
// query where an fp32 model keeps a bf16 KV cache), I: block-table index
template <typename Q, typename T, typename I>
struct Prefill {
  const Shape s;
  const Q* query;  // [num_tokens, num_heads, D]
  const T* k_cache;
  const T* v_cache;  // [num_blocks, block_size, num_kv_heads, D]
  const I* block_tables;  // [batch, max_blocks]
  const int64_t* q_start;  // [batch + 1]
  const int64_t* seq_lens;  // [batch]
  float scale;
  Q* out;  // [num_tokens, num_heads, D]

  // The cache row of key `pos` of sequence b, at kv head h.
  const T* cache_row(const T* cache, int64_t b, int64_t pos, int64_t h) const {
    const int64_t block = static_cast<int64_t>(block_tables[b * s.max_blocks + pos / s.block_size]);
    return cache + (block * s.block_size + pos % s.block_size) * s.row_stride + h * s.head_dim;
  }
  // Row r of an item (position-major, G heads each): its query / output row.
  int64_t token_row(const Item& it, int64_t r) const {
    return (q_start[it.seq] + it.q0 + r / s.group) * s.num_heads + it.kv_head * s.group +
           r % s.group;
  }
  int64_t context(const Item& it) const {
    return seq_lens[it.seq] - (q_start[it.seq + 1] - q_start[it.seq]);
  }

  // Into L2, the K and V rows of the chunk after this one (the next blocks are anywhere).
  void prefetch_chunk(const Item& it, int64_t k0, int64_t n) const {
    const int64_t bytes = s.head_dim * static_cast<int64_t>(sizeof(T));
    for (int64_t t = 0; t < n; ++t) {
      const char* k = reinterpret_cast<const char*>(cache_row(k_cache, it.seq, k0 + t, it.kv_head));
      const char* v = reinterpret_cast<const char*>(cache_row(v_cache, it.seq, k0 + t, it.kv_head));
      for (int64_t off = 0; off < bytes; off += 64) {  // a loop of prefetches only: see
        prefetch_read<2>(k + off);                     // cpu_scalar.h's prefetch_read
        prefetch_read<2>(v + off);
      }
    }
  }

#ifdef PAGODA_PREFILL_AVX512
  struct Scratch {
    Buffer qt, ot, kp, vp, sc, pp, stats;
    std::vector<int32_t> pos, low;  // per row: its position, and the last key it cannot see
    explicit Scratch(const Shape& s, int64_t rows_pad)
        : qt(s.head_dim * rows_pad), ot(s.head_dim * rows_pad), kp(kTk * s.head_dim),
          vp(kTk * s.head_dim), sc(kTk * kRB), pp(kTk * kRB), stats(2 * rows_pad),
          pos(static_cast<size_t>(rows_pad)), low(static_cast<size_t>(rows_pad)) {}
  };

  template <class M, typename E>
  static typename M::Word word(const E* row, int64_t p) {  // word p of a cache / query row
    if constexpr (M::W == 1) {
      return to_f32(row[p]);
    } else {
      typename M::Word w;
      std::memcpy(&w, row + 2 * p, sizeof(w));
      return w;
    }
  }

  // K rows [k0, k0 + n) of the item's kv head as kp[t][p] (dw words each), zero rows up to
  // a whole register tile; V the same in F32 mode, and in Bf16 mode by key pairs:
  // vp[s][d] = (V[2s][d], V[2s + 1][d]).
  template <class M>
  void pack_kv(const Item& it, int64_t k0, int64_t n, typename M::Word* kp,
               typename M::Word* vp) const {
    using Word = typename M::Word;
    const int64_t D = s.head_dim, dw = D / M::W, padded = (n + kNT - 1) / kNT * kNT;
    for (int64_t t = 0; t < n; ++t) {
      const T* k = cache_row(k_cache, it.seq, k0 + t, it.kv_head);
      if constexpr (sizeof(T) * M::W == sizeof(Word)) {  // rows are words already
        std::memcpy(kp + t * dw, k, D * sizeof(T));
      } else {
        for (int64_t p = 0; p < dw; ++p) kp[t * dw + p] = word<M>(k, p);
      }
    }
    std::memset(kp + n * dw, 0, (padded - n) * dw * sizeof(Word));
    if constexpr (M::W == 1) {
      for (int64_t t = 0; t < n; ++t) {
        const T* v = cache_row(v_cache, it.seq, k0 + t, it.kv_head);
        for (int64_t d = 0; d < D; ++d) vp[t * D + d] = to_f32(v[d]);
      }
      std::memset(vp + n * D, 0, (padded - n) * D * sizeof(Word));
    } else {
      for (int64_t st = 0; st < padded / 2; ++st) {
        const int64_t t = 2 * st;
        const T* a = t < n ? cache_row(v_cache, it.seq, k0 + t, it.kv_head) : nullptr;
        const T* b = t + 1 < n ? cache_row(v_cache, it.seq, k0 + t + 1, it.kv_head) : nullptr;
        for (int64_t d = 0; d < D; d += kLanes) {
          const __mmask16 m = D - d >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (D - d)) - 1);
          const __m512i lo =
              a ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, a + d)) : _mm512_setzero_si512();
          const __m512i hi =
              b ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, b + d)) : _mm512_setzero_si512();
          _mm512_mask_storeu_epi32(vp + st * D + d, m, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
      }
    }
  }

  // One row block (NR row vectors, from row `row0` of the item) against keys [k0, k0 + nk)
  // of the packed chunk: scores, online-softmax update of its stats, P.V into its O^T.
  // first_pos: the position of its first row; last_low: the largest key some row of it
  // cannot see for the window (-1 without one).
  template <class M, int NR>
  void row_block(Scratch& w, int64_t rows_pad, int64_t row0, int64_t first_pos,
                 int64_t last_low, int64_t k0, int64_t nk) const {
    using Word = typename M::Word;
    const int64_t dw = s.head_dim / M::W, ntk = (nk + kNT - 1) / kNT * kNT;
    const Word* qt = reinterpret_cast<const Word*>(w.qt.data()) + row0;
    const Word* kp = reinterpret_cast<const Word*>(w.kp.data());
    float* sc = w.sc.data();
    float* m_row = w.stats.data() + row0;
    float* l_row = m_row + rows_pad;
    __m512i pos[NR], low[NR];
    __m512 mx[NR];
    const __m512 scale_v = _mm512_set1_ps(scale);
    const __m512 cap_v = _mm512_set1_ps(s.softcap), inv_cap_v = _mm512_set1_ps(1.0f / s.softcap);
    for (int r = 0; r < NR; ++r) {
      pos[r] = _mm512_loadu_si512(w.pos.data() + row0 + r * kLanes);
      low[r] = _mm512_loadu_si512(w.low.data() + row0 + r * kLanes);
      mx[r] = _mm512_set1_ps(kNegInf);
    }
    for (int64_t t0 = 0; t0 < ntk; t0 += kNT) {
      __m512 acc[kNT][NR];
      qk_tile<M, NR>(qt, rows_pad, kp + t0 * dw, dw, acc);
      // a key past some row's position, or (window) at or before some row's last hidden key
      const bool masked = k0 + t0 + kNT - 1 > first_pos || k0 + t0 <= last_low;
      for (int t = 0; t < kNT; ++t) {
        const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(k0 + t0 + t));
        for (int r = 0; r < NR; ++r) {
          __m512 v = _mm512_mul_ps(acc[t][r], scale_v);
          if (s.softcap > 0.0f) v = _mm512_mul_ps(cap_v, tanh_ps(_mm512_mul_ps(v, inv_cap_v)));
          if (masked)
            v = _mm512_mask_mov_ps(
                _mm512_set1_ps(kNegInf),
                _mm512_cmple_epi32_mask(key, pos[r]) & _mm512_cmpgt_epi32_mask(key, low[r]), v);
          mx[r] = _mm512_max_ps(mx[r], v);
          _mm512_storeu_ps(sc + (t0 + t) * kRB + r * kLanes, v);
        }
      }
    }
    __m512 m_new[NR], alpha[NR], sum[NR];
    for (int r = 0; r < NR; ++r) {
      const __m512 m_old = _mm512_loadu_ps(m_row + r * kLanes);
      const __m512 m = _mm512_max_ps(m_old, mx[r]);
      _mm512_storeu_ps(m_row + r * kLanes, m);
      // without a window every row sees key 0 in its first chunk, so m is finite; with
      // one a row may see no key yet (m = -inf): subtract 0 there, so its p stay 0, not
      // NaN. m_old = -inf -> alpha 0
      m_new[r] = _mm512_mask_mov_ps(m, _mm512_cmp_ps_mask(m, _mm512_set1_ps(kNegInf), _CMP_EQ_OQ),
                                    _mm512_setzero_ps());
      alpha[r] = exp_nonpos(_mm512_sub_ps(m_old, m_new[r]));
      sum[r] = _mm512_setzero_ps();
    }
    Word* pp = reinterpret_cast<Word*>(w.pp.data());
    if constexpr (M::W == 1) {
      for (int64_t t = 0; t < ntk; ++t)
        for (int r = 0; r < NR; ++r) {
          const __m512 p = exp_nonpos(_mm512_sub_ps(_mm512_loadu_ps(sc + t * kRB + r * kLanes), m_new[r]));
          sum[r] = _mm512_add_ps(sum[r], p);
          _mm512_storeu_ps(pp + t * kRB + r * kLanes, p);
        }
    } else {
      // word lane j of pair st = (P[2 st][j], P[2 st + 1][j]): interleave the two bf16 rows
      const __m512i interleave = _mm512_set_epi16(
          31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
          23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
      for (int64_t t = 0; t < ntk; t += 2)
        for (int r = 0; r < NR; ++r) {
          const __m512 p0 = exp_nonpos(_mm512_sub_ps(_mm512_loadu_ps(sc + t * kRB + r * kLanes), m_new[r]));
          const __m512 p1 = exp_nonpos(_mm512_sub_ps(_mm512_loadu_ps(sc + (t + 1) * kRB + r * kLanes), m_new[r]));
          sum[r] = _mm512_add_ps(sum[r], _mm512_add_ps(p0, p1));
          // low 16 words from p0, high 16 from p1, each rounded to nearest even
          const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
          _mm512_storeu_si512(pp + (t / 2) * kRB + r * kLanes, _mm512_permutexvar_epi16(interleave, both));
        }
    }
    for (int r = 0; r < NR; ++r) {
      const __m512 l = _mm512_loadu_ps(l_row + r * kLanes);
      _mm512_storeu_ps(l_row + r * kLanes, _mm512_fmadd_ps(l, alpha[r], sum[r]));
    }
    pv_tile<M, NR>(pp, ntk / M::W, reinterpret_cast<const Word*>(w.vp.data()), s.head_dim,
                   w.ot.data() + row0 * s.head_dim, alpha);
  }

  template <class M>
  void run_item(const Item& it, Scratch& w) const {
    using Word = typename M::Word;
    const int64_t D = s.head_dim, G = s.group, dw = D / M::W;
    const int64_t rows = it.nq * G, rows_pad = (rows + kRB - 1) / kRB * kRB;
    const int64_t pos0 = context(it) + it.q0;  // position of the item's first query
    const int64_t kend = pos0 + it.nq;          // keys the last position sees
    // the first key the first position sees (the window's start, or 0)
    const int64_t kstart = s.window > 0 ? std::max<int64_t>(0, pos0 - s.window + 1) : 0;
    Word* qt = reinterpret_cast<Word*>(w.qt.data());  // Q^T: [dw][rows_pad]
    // a query tile is `nq` runs of G * D contiguous elements (the group's heads)
    const Q* q = query + token_row(it, 0) * D;
    const int64_t token_stride = s.num_heads * D;
    if constexpr (sizeof(Q) * M::W == sizeof(Word)) {  // rows are words already: transpose
      for (int64_t r0 = 0; r0 < rows_pad; r0 += kLanes)
        for (int64_t p0 = 0; p0 < dw; p0 += kLanes) {
          const int64_t np = std::min<int64_t>(kLanes, dw - p0);
          const __mmask16 m = np == kLanes ? __mmask16(0xFFFF) : __mmask16((1u << np) - 1);
          __m512i v[kLanes];
          for (int i = 0; i < kLanes; ++i) {
            const int64_t r = r0 + i;
            v[i] = r < rows ? _mm512_maskz_loadu_epi32(
                                  m, q + (r / G) * token_stride + (r % G) * D + p0 * M::W)
                            : _mm512_setzero_si512();
          }
          transpose16(v);
          for (int i = 0; i < np; ++i) _mm512_storeu_si512(qt + (p0 + i) * rows_pad + r0, v[i]);
        }
    } else {  // bf16 widened to fp32 words
      for (int64_t p = 0; p < dw; ++p) {
        Word* dst = qt + p * rows_pad;
        for (int64_t i = 0; i < it.nq; ++i)
          for (int64_t j = 0; j < G; ++j) dst[i * G + j] = word<M>(q + i * token_stride + j * D, p);
        std::fill(dst + rows, dst + rows_pad, Word{});
      }
    }
    for (int64_t r = 0; r < rows_pad; ++r) {  // padding rows see every key (zero scores)
      w.pos[r] = r < rows ? static_cast<int32_t>(pos0 + r / G) : INT32_MAX;
      w.low[r] = r < rows && s.window > 0 ? static_cast<int32_t>(pos0 + r / G - s.window) : -1;
    }
    std::fill(w.ot.data(), w.ot.data() + rows_pad * D, 0.0f);  // O^T: [blocks][D][kRB]
    std::fill(w.stats.data(), w.stats.data() + rows_pad, kNegInf);
    std::fill(w.stats.data() + rows_pad, w.stats.data() + 2 * rows_pad, 0.0f);
    Word* kp = reinterpret_cast<Word*>(w.kp.data());
    Word* vp = reinterpret_cast<Word*>(w.vp.data());
    for (int64_t k0 = kstart; k0 < kend; k0 += kTk) {
      const int64_t n = std::min<int64_t>(kTk, kend - k0);
      pack_kv<M>(it, k0, n, kp, vp);
      if (k0 + kTk < kend) prefetch_chunk(it, k0 + kTk, std::min<int64_t>(kTk, kend - k0 - kTk));
      for (int64_t row0 = 0; row0 < rows; row0 += kRB) {
        const int64_t last = std::min(rows, row0 + kRB) - 1;
        const int64_t nk = std::min(n, pos0 + last / G + 1 - k0);  // keys its last row sees
        if (nk <= 0) continue;
        const int64_t first_pos = pos0 + row0 / G;
        // the window hides keys <= low from a row at position low + window
        const int64_t last_low = s.window > 0 ? pos0 + last / G - s.window : -1;
        if (s.window > 0 && k0 + n - 1 <= first_pos - s.window) continue;  // none visible
        switch ((last - row0) / kLanes) {
          case 0: row_block<M, 1>(w, rows_pad, row0, first_pos, last_low, k0, nk); break;
          case 1: row_block<M, 2>(w, rows_pad, row0, first_pos, last_low, k0, nk); break;
          default: row_block<M, 3>(w, rows_pad, row0, first_pos, last_low, k0, nk); break;
        }
      }
    }
    // out = O^T / l, transposed back 16 rows x 16 elements at a time
    const float* l_row = w.stats.data() + rows_pad;
    for (int64_t r0 = 0; r0 < rows; r0 += kLanes) {
      const float* o = w.ot.data() + (r0 / kRB) * kRB * D + r0 % kRB;
      const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_loadu_ps(l_row + r0));
      for (int64_t d0 = 0; d0 < D; d0 += kLanes) {
        const int64_t nd = std::min<int64_t>(kLanes, D - d0);
        __m512i v[kLanes];
        for (int i = 0; i < kLanes; ++i)
          v[i] = i < nd ? _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(o + (d0 + i) * kRB), inv))
                        : _mm512_setzero_si512();
        transpose16(v);
        for (int j = 0; j < std::min<int64_t>(kLanes, rows - r0); ++j)
          store_row(out + token_row(it, r0 + j) * D + d0, _mm512_castsi512_ps(v[j]), nd);
      }
    }
  }

  static void store_row(Q* dst, __m512 v, int64_t n) {  // the first n lanes, rounded to Q
    const __mmask16 m = n == kLanes ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    if constexpr (std::is_same_v<Q, float>) {
      _mm512_mask_storeu_ps(dst, m, v);
    } else {
#ifdef PAGODA_PREFILL_BF16
      _mm256_mask_storeu_epi16(dst, m, (__m256i)_mm512_cvtneps_pbh(v));  // nearest even
#else
      alignas(64) float f[kLanes];
      _mm512_store_ps(f, v);
      for (int64_t i = 0; i < n; ++i) store(f[i], dst + i);
#endif
    }
  }

  void run(const std::vector<Item>& items, int64_t max_rows_pad) const {
    for_each(items, [&] { return Scratch(s, max_rows_pad); },
             [&](const Item& it, Scratch& w) {
#ifdef PAGODA_PREFILL_BF16
               // bf16 words need a bf16 query (an fp32 one over a bf16 cache: fp32 words)
               if constexpr (std::is_same_v<Q, uint16_t>) return run_item<Bf16Mode>(it, w);
#endif
               run_item<F32Mode>(it, w);
             });
  }
#else
  struct Scratch {
    std::vector<float> scores, acc;  // the scalar rows
#ifdef PAGODA_PREFILL_AVX2
    Buffer kt, vp, q, o, sc;  // see run_item_avx2
    std::vector<float> m, l;
    Scratch(const Shape& s, int64_t rows)
        : scores(s.max_len), acc(s.head_dim), kt(s.head_dim * kKeys2),
          vp(kKeys2 * s.head_dim), q(rows * s.head_dim), o(rows * s.head_dim), sc(kKeys2),
          m(static_cast<size_t>(rows)), l(static_cast<size_t>(rows)) {}
#else
    Scratch(const Shape& s, int64_t) : scores(s.max_len), acc(s.head_dim) {}
#endif
  };

#ifdef PAGODA_PREFILL_AVX2
  // AVX2 + FMA, head_dim a multiple of 8. The item's keys go by in chunks of kKeys2,
  // each copied out of the cache once as fp32, K transposed (kt: [D][kKeys2], zero past
  // the chunk's keys) and V as rows (vp: [kKeys2][D]), and used by every row of the item
  // (its positions x the G heads of its kv head). A row's kKeys2 scores build up in 8
  // ymm accumulators over its D query elements (one broadcast, 8 loads and 8 FMAs an
  // element); its online softmax runs on the keys it sees; its output accumulators take
  // the chunk's V rows 64 dims (8 ymm) at a time. Numerics as the scalar rows: fp32
  // products and sums (another order), P kept in fp32, out = O / l rounded once.
  static constexpr int64_t kKeys2 = 64;
  static constexpr int kKeyVecs = kKeys2 / 8;

  // The output slice of NV ymm (8 NV dims from orow) of a row: times alpha, plus the
  // weighted V rows of keys [lo, hi) of the chunk (p: their softmax numerators).
  template <int NV>
  static void pv_slice(const float* p, int64_t lo, int64_t hi, const float* v, int64_t D,
                       float* orow, float alpha) {
    __m256 a[NV];
    const __m256 va = _mm256_set1_ps(alpha);
    for (int j = 0; j < NV; ++j) a[j] = _mm256_mul_ps(_mm256_loadu_ps(orow + 8 * j), va);
    for (int64_t t = lo; t < hi; ++t) {
      const __m256 pt = _mm256_set1_ps(p[t]);
      const float* vr = v + t * D;
      for (int j = 0; j < NV; ++j) a[j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vr + 8 * j), a[j]);
    }
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(orow + 8 * j, a[j]);
  }

  // One row against keys [lo, hi) of the packed chunk: its scores, online-softmax update
  // of (m, l), and P.V into its output row.
  void row_chunk(Scratch& w, const float* qr, int64_t lo, int64_t hi, float* orow, float& m,
                 float& l) const {
    const int64_t D = s.head_dim;
    const float* kt = w.kt.data();
    float* sc = w.sc.data();
    __m256 acc[kKeyVecs];
    for (int j = 0; j < kKeyVecs; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m256 qd = _mm256_broadcast_ss(qr + d);
      const float* kr = kt + d * kKeys2;
      for (int j = 0; j < kKeyVecs; ++j) acc[j] = _mm256_fmadd_ps(qd, _mm256_load_ps(kr + 8 * j), acc[j]);
    }
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int j = 0; j < kKeyVecs; ++j) _mm256_store_ps(sc + 8 * j, _mm256_mul_ps(acc[j], vscale));
    if (s.softcap > 0.0f) {
      const float cap = s.softcap;
#pragma omp simd
      for (int64_t t = lo; t < hi; ++t) sc[t] = cap * tanh_f32(sc[t] / cap);
    }
    // the 8-key groups that hold [lo, hi); keys outside it are masked to -inf (exp 0)
    const int64_t g0 = lo / 8, g1 = (hi + 7) / 8;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 neg_inf = _mm256_set1_ps(kNegInf);
    __m256 vmax = neg_inf;
    for (int64_t g = g0; g < g1; ++g) {
      const __m256i t = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int>(8 * g)));
      const __m256 inside = _mm256_castsi256_ps(_mm256_and_si256(
          _mm256_cmpgt_epi32(t, _mm256_set1_epi32(static_cast<int>(lo) - 1)),
          _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(hi)), t)));
      const __m256 v = _mm256_blendv_ps(neg_inf, _mm256_load_ps(sc + 8 * g), inside);
      _mm256_store_ps(sc + 8 * g, v);
      vmax = _mm256_max_ps(vmax, v);
    }
    const float mx = std::max(m, hmax8(vmax));
    const float alpha = exp_f32(m - mx);  // m = -inf (no key seen yet): 0
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t g = g0; g < g1; ++g) {
      const __m256 e = exp_nonpos_avx2(_mm256_sub_ps(_mm256_load_ps(sc + 8 * g), vmx));
      _mm256_store_ps(sc + 8 * g, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    l = l * alpha + hsum8(vsum);
    m = mx;
    const float* vp = w.vp.data();
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      float* o = orow + d0;
      const float* v = vp + d0;
      switch (std::min<int64_t>(8, (D - d0) / 8)) {
        case 1: pv_slice<1>(sc, lo, hi, v, D, o, alpha); break;
        case 2: pv_slice<2>(sc, lo, hi, v, D, o, alpha); break;
        case 3: pv_slice<3>(sc, lo, hi, v, D, o, alpha); break;
        case 4: pv_slice<4>(sc, lo, hi, v, D, o, alpha); break;
        case 5: pv_slice<5>(sc, lo, hi, v, D, o, alpha); break;
        case 6: pv_slice<6>(sc, lo, hi, v, D, o, alpha); break;
        case 7: pv_slice<7>(sc, lo, hi, v, D, o, alpha); break;
        default: pv_slice<8>(sc, lo, hi, v, D, o, alpha); break;
      }
    }
  }

  void run_item_avx2(const Item& it, Scratch& w) const {
    const int64_t D = s.head_dim, G = s.group, rows = it.nq * G;
    const int64_t pos0 = context(it) + it.q0;  // position of the item's first query
    const int64_t kend = pos0 + it.nq;          // keys the last position sees
    const int64_t kstart = s.window > 0 ? std::max<int64_t>(0, pos0 - s.window + 1) : 0;
    float* q = w.q.data();
    float* o = w.o.data();
    float* kt = w.kt.data();
    float* vp = w.vp.data();
    for (int64_t r = 0; r < rows; ++r) {
      const Q* src = query + token_row(it, r) * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) q[r * D + d] = to_f32(src[d]);
    }
    std::fill(o, o + rows * D, 0.0f);
    std::fill(w.m.begin(), w.m.begin() + rows, kNegInf);
    std::fill(w.l.begin(), w.l.begin() + rows, 0.0f);
    for (int64_t k0 = kstart; k0 < kend; k0 += kKeys2) {
      const int64_t n = std::min<int64_t>(kKeys2, kend - k0);
      for (int64_t t = 0; t < n; ++t) {
        const T* k = cache_row(k_cache, it.seq, k0 + t, it.kv_head);
        const T* v = cache_row(v_cache, it.seq, k0 + t, it.kv_head);
        for (int64_t d = 0; d < D; ++d) kt[d * kKeys2 + t] = to_f32(k[d]);
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) vp[t * D + d] = to_f32(v[d]);
      }
      for (int64_t t = n; t < kKeys2; ++t)
        for (int64_t d = 0; d < D; ++d) kt[d * kKeys2 + t] = 0.0f;
      if (k0 + kKeys2 < kend)
        prefetch_chunk(it, k0 + kKeys2, std::min<int64_t>(kKeys2, kend - k0 - kKeys2));
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t pos = pos0 + r / G;
        const int64_t hi = std::min(n, pos - k0 + 1);  // keys k0 + t <= pos
        const int64_t lo = s.window > 0 ? std::max<int64_t>(0, pos - s.window + 1 - k0) : 0;
        if (hi > lo) row_chunk(w, q + r * D, lo, hi, o + r * D, w.m[r], w.l[r]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      Q* dst = out + token_row(it, r) * D;
      const float l = w.l[r];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) store(o[r * D + d] / l, dst + d);
    }
  }
#endif

  // Row by row: scores of every visible key, softmax, weighted sum of V.
  void run_item(const Item& it, Scratch& w) const {
    const int64_t D = s.head_dim, pos0 = context(it) + it.q0;
    float* sc = w.scores.data();
    float* acc = w.acc.data();
    for (int64_t r = 0; r < it.nq * s.group; ++r) {
      const int64_t n = pos0 + r / s.group + 1;
      const int64_t t0 = s.window > 0 ? std::max<int64_t>(0, n - s.window) : 0;
      const Q* q = query + token_row(it, r) * D;
      float m = kNegInf;
      for (int64_t t = t0; t < n; ++t) {
        const T* k = cache_row(k_cache, it.seq, t, it.kv_head);
        float dot = 0.0f;
        for (int64_t d = 0; d < D; ++d) dot += to_f32(q[d]) * to_f32(k[d]);
        sc[t] = dot * scale;
        if (s.softcap > 0.0f) sc[t] = s.softcap * tanh_f32(sc[t] / s.softcap);
        m = std::max(m, sc[t]);
      }
      float sum = 0.0f;
      std::fill(acc, acc + D, 0.0f);
      for (int64_t t = t0; t < n; ++t) {
        const float p = exp_f32(sc[t] - m);
        const T* v = cache_row(v_cache, it.seq, t, it.kv_head);
        sum += p;
        for (int64_t d = 0; d < D; ++d) acc[d] += p * to_f32(v[d]);
      }
      Q* dst = out + token_row(it, r) * D;
      for (int64_t d = 0; d < D; ++d) store(acc[d] / sum, dst + d);
    }
  }

  void run(const std::vector<Item>& items, int64_t max_rows) const {
    for_each(items, [&] { return Scratch(s, max_rows); },
             [&](const Item& it, Scratch& w) {
#ifdef PAGODA_PREFILL_AVX2
               if (s.head_dim % 8 == 0) return run_item_avx2(it, w);
#endif
               run_item(it, w);
             });
  }
#endif

  // Runs body(item, scratch) over the items on torch's intra-op pool; each thread pulls
  // the next item (longest first) from a shared counter and owns one scratch.
  template <typename MakeScratch, typename Body>
  static void for_each(const std::vector<Item>& items, const MakeScratch& make, const Body& body) {
    std::atomic<int64_t> next{0};
    const int64_t num_items = static_cast<int64_t>(items.size());
    const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      auto w = make();
      for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) body(items[i], w);
    });
  }
};

std::vector<int64_t> widen(const at::Tensor& t) {  // int32 or int64 -> int64
  std::vector<int64_t> v(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i)
    v[i] = t.scalar_type() == at::kInt ? t.data_ptr<int32_t>()[i] : t.data_ptr<int64_t>()[i];
  return v;
}

// Checks the index values (a bad one would read or write outside a tensor) and returns
// the items, longest first.
template <typename I>
std::vector<Item> plan_items(Shape& s, const I* tables, const std::vector<int64_t>& starts,
                             const std::vector<int64_t>& lens, int64_t num_blocks) {
  TORCH_CHECK_VALUE(starts[0] >= 0 && starts[s.batch] <= s.num_tokens,
                    "query_start_loc must lie in [0, ", s.num_tokens, "]");
  s.tile_q = std::max<int64_t>(1, kTargetRows / s.group);
  std::vector<Item> items;
  s.max_len = 0;
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t q_len = starts[b + 1] - starts[b], len = lens[b];
    TORCH_CHECK_VALUE(q_len >= 0, "query_start_loc must be non-decreasing (at ", b, ")");
    TORCH_CHECK_VALUE(len >= q_len && len <= s.max_blocks * s.block_size, "seq_lens[", b,
                      "] = ", len, " is outside [query_len ", q_len, ", ",
                      s.max_blocks * s.block_size, "]");
    if (q_len == 0) continue;
    for (int64_t j = 0; j < (len + s.block_size - 1) / s.block_size; ++j) {
      const int64_t id = static_cast<int64_t>(tables[b * s.max_blocks + j]);
      TORCH_CHECK_VALUE(id >= 0 && id < num_blocks, "block_tables[", b, ", ", j, "] = ", id,
                        " is outside [0, ", num_blocks, ")");
    }
    s.max_len = std::max(s.max_len, len);
    const int64_t context = len - q_len;
    for (int64_t q0 = 0; q0 < q_len; q0 += s.tile_q) {
      const int64_t nq = std::min(s.tile_q, q_len - q0);
      int64_t keys = context + q0 + nq / 2;  // ~ keys a row reads
      if (s.window > 0) keys = std::min(keys, s.window + nq / 2);
      const int64_t cost = nq * s.group * (keys + 16);
      for (int64_t h = 0; h < s.num_kv_heads; ++h) items.push_back({b, h, q0, nq, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  return items;
}

template <typename Q, typename T, typename I>
void prefill_typed(const Args& a) {
  Shape s{};
  s.batch = a.seq_lens.size(0);
  s.num_tokens = a.query.size(0);
  s.num_heads = a.query.size(1);
  s.head_dim = a.query.size(2);
  s.block_size = a.k_cache.size(1);
  s.num_kv_heads = a.k_cache.size(2);
  s.group = s.num_heads / s.num_kv_heads;
  s.row_stride = s.num_kv_heads * s.head_dim;
  s.max_blocks = a.block_tables.size(1);
  s.window = a.window;
  s.softcap = static_cast<float>(a.softcap);
  const std::vector<int64_t> starts = widen(a.query_start_loc), lens = widen(a.seq_lens);
  const I* tables = a.block_tables.data_ptr<I>();
  const std::vector<Item> items = plan_items(s, tables, starts, lens, a.k_cache.size(0));
  if (items.empty()) return;
  const Prefill<Q, T, I> pf{s,
                         reinterpret_cast<const Q*>(a.query.data_ptr()),
                         reinterpret_cast<const T*>(a.k_cache.data_ptr()),
                         reinterpret_cast<const T*>(a.v_cache.data_ptr()),
                         tables,
                         starts.data(),
                         lens.data(),
                         static_cast<float>(a.scale),
                         reinterpret_cast<Q*>(a.out.data_ptr())};
  const int64_t rows = s.tile_q * s.group;
#ifdef PAGODA_PREFILL_AVX512
  pf.run(items, (rows + kRB - 1) / kRB * kRB);
#else
  pf.run(items, rows);
#endif
}

// Shapes, dtypes and contiguity are checked by the Python wrapper: fp32 or bf16 query,
// caches and out alike, or fp32 query and out over bf16 caches; int32 or int64
// query_start_loc, seq_lens, block_tables (each its own).
void prefill(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
             const at::Tensor& v_cache, const at::Tensor& query_start_loc,
             const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale,
             int64_t window, double softcap) {
  if (seq_lens.size(0) == 0 || query.size(0) == 0) return;
  const Args a{out, query, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
               scale, window, softcap};
  pagoda_cpu_attention::with_attention_types(query, k_cache, block_tables,
                                             [&](auto q, auto t, auto i) {
    prefill_typed<decltype(q), decltype(t), decltype(i)>(a);
  });
}

bool uses_avx512() {
#ifdef PAGODA_PREFILL_AVX512
  return true;
#else
  return false;
#endif
}

bool uses_avx2() {
#ifdef PAGODA_PREFILL_AVX2
  return true;
#else
  return false;
#endif
}

bool uses_avx512_bf16() {
#ifdef PAGODA_PREFILL_BF16
  return true;
#else
  return false;
#endif
}

}  // namespace

// The namespace is a macro so a variant build (tests of the portable path) registers apart.
#define PAGODA_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
PAGODA_LIBRARY(PAGODA_OP_NS, m) {
  m.def("prefill(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
        "Tensor query_start_loc, Tensor seq_lens, Tensor block_tables, float scale, "
        "int window=0, float softcap=0.0) -> ()",
        &prefill);
  m.def("uses_avx512() -> bool", &uses_avx512);
  m.def("uses_avx512_bf16() -> bool", &uses_avx512_bf16);
  m.def("uses_avx2() -> bool", &uses_avx2);
}
