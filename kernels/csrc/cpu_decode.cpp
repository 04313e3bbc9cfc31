// CPU paged-attention decode: one new token per sequence, K/V read through the block table.
//
// Built at runtime by kernels/cpu_decode.py (load_inline, -O3 -march=native, and the
// OpenMP flags that let ATen's header-inlined parallel_for use torch's own pool) and
// registered as torch.ops.<PAGODA_OP_NS>.decode; the Python wrapper validates shapes.
//
// Work item = (sequence, partition of its tokens), all heads. Blocks are walked through
// the block table, the next one prefetched row by row while this one is computed; each
// K/V row is loaded once for the G = num_heads / num_kv_heads query rows that share it. Two passes per item: scores q.k
// (fp32, kept in per-thread scratch), softmax, then the weighted sum of V. Long contexts
// in small batches are split into partitions (split-K, after flash decoding): each
// writes its normalised output and log-sum-exp, and a second pass merges them. Items
// are handed out through an atomic counter so ragged sequence lengths balance.
// A sliding window (window > 0) starts a sequence's partitions at the block holding its
// first visible key and masks the keys of that block before it; a soft cap (softcap > 0)
// maps every score to softcap * tanh(score / softcap) before the softmax.
// The per-block kernels are in cpu_decode_blocks.h.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_attention_types.h"
#include "cpu_decode_blocks.h"
#include "cpu_softmax_avx2.h"

#ifndef PAGODA_OP_NS
#define PAGODA_OP_NS pagoda_cpu_decode
#endif

namespace {

using namespace pagoda_cpu_decode;

// Below this many tokens per partition the merge costs more than the parallelism wins.
constexpr int64_t kMinPartitionTokens = 128;
// Longer partitions are split anyway so the score scratch ([heads, tokens] fp32) stays
// in L2 whatever the context length.
constexpr int64_t kMaxPartitionTokens = 2048;
// Aim for this many work items per thread before splitting for parallelism stops paying.
constexpr int64_t kItemsPerThread = 4;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Per-thread buffers, sized once per parallel region.
struct Scratch {
  std::vector<float> q;       // [H, D] query rows, pre-scaled
  std::vector<float> scores;  // [H, part_tokens] scores, then softmax numerators
  std::vector<float> acc;     // [H, D] weighted V sums
  std::vector<float> stats;   // [2, H] softmax max and sum of each row
  explicit Scratch(const Shape& s)
      : q(s.num_heads * s.head_dim), scores(s.num_heads * s.part_tokens),
        acc(s.num_heads * s.head_dim), stats(2 * s.num_heads) {}
};

// x[i] = exp(x[i] - max), i < n: a row's softmax numerators, its max and their sum. The
// AVX2 form where the compiler targets it (AVX-512 builds too): GCC left this loop
// scalar (an exp_f32 a score), a quarter of a batch-64 fp32 step's attention time.
inline void softmax_numerators(float* x, int64_t n, float& max_out, float& sum_out) {
#ifdef PAGODA_SOFTMAX_AVX2
  pagoda_cpu_simd::softmax_numerators(x, n, max_out, sum_out);
#else
  float m = kNegInf, sum = 0.0f;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    x[i] = exp_f32(x[i] - m);
    sum += x[i];
  }
  max_out = m;
  sum_out = sum;
#endif
}

// x[i] = cap * tanh(x[i] / cap), i < n: the attention soft cap of a row of scores.
void soft_cap(float* x, int64_t n, float cap) {
  const float inv_cap = 1.0f / cap;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] = cap * tanh_f32(x[i] * inv_cap);
}

// Into L2 (prefetcht1): the first block of an item. The later ones are prefetched a row
// at a time by the block kernels: a whole block's prefetches issued at once filled the
// miss buffers and stalled the core until they drained (the loop of prefetches took half
// of the item's time); spread over the compute of the block before, the same lines
// arrive in its shadow. Batch 36 x context 370, bf16: 13.6 -> 20.7 GB/s. Into L1
// instead (prefetcht0) loses the gain: the lines evict the block in use.
template <typename T>
inline void prefetch_block(const T* rows, int64_t elems) {
  const char* p = reinterpret_cast<const char*>(rows);
  for (int64_t off = 0; off < elems * static_cast<int64_t>(sizeof(T)); off += 64)
    prefetch_read<2>(p + off);  // not __builtin_prefetch: see cpu_scalar.h
}

// The block two on: on AVX2 an fp32 cache's is prefetched whole into L2 as each block
// starts (its rows' twins into L1 still come a block ahead), a bf16 one's row by row
// beside the next block's (BlockView::far_delta). Zen 3, one A/B process, 30 layers of
// KV on huge pages, batch 54 x 200-400 keys: fp32 K/V read 1.05-1.16x faster than with
// the next block's twins alone (a whole batch-54 step 1.03-1.05x, batch 24 x 800 keys
// 1.05x); the bf16 rows' far twins measured level for fp32, and whole blocks 0.94-0.97x
// for bf16.
template <typename T>
constexpr bool kWholeFar =
#ifdef PAGODA_DECODE_AVX2
    sizeof(T) == 4;
#else
    false;
#endif

// Q: query / output element, T: cache element (float or bf16 bits; bf16 under an fp32
// query where an fp32 model keeps a bf16 KV cache), I: table index
template <typename Q, typename T, typename I>
struct Decode {
  const Shape s;
  const Q* query;           // [batch, num_heads, D]
  const T* k_cache;         // [num_blocks, block_size, num_kv_heads, D]
  const T* v_cache;         // [num_blocks, block_size, num_kv_heads, D]
  const I* block_tables;    // [batch, max_blocks]
  const int64_t* seq_lens;  // [batch]
  float scale;
  Q* out;                   // [batch, num_heads, D]
  float* part_out;          // num_parts > 1: [batch, num_heads, num_parts, D]
  float* part_lse;          // num_parts > 1: [batch, num_heads, num_parts]

  // First key a decode token of sequence b sees, and where its partitions start (the
  // block boundary at or before it, as for_each_block wants).
  int64_t first_key(int64_t b) const {
    return s.window > 0 ? std::max<int64_t>(0, seq_lens[b] - s.window) : 0;
  }
  int64_t first_partition_key(int64_t b) const {
    return first_key(b) / s.block_size * s.block_size;
  }

  // Tokens [start, end) of an item's partition (start == end: an empty partition).
  void item_span(int64_t item, int64_t& b, int64_t& start, int64_t& end) const {
    b = item / s.num_parts;
    start = first_partition_key(b) + (item % s.num_parts) * s.part_tokens;
    end = std::min(seq_lens[b], start + s.part_tokens);
  }

  // The first block an item reads in `cache` (nullptr: none, or no such item).
  const T* first_block(const T* cache, int64_t item) const {
    if (item < 0) return nullptr;
    int64_t b, start, end;
    item_span(item, b, start, end);
    if (start >= end) return nullptr;
    const int64_t id = static_cast<int64_t>(block_tables[b * s.max_blocks + start / s.block_size]);
    return cache + id * s.block_size * s.row_stride;
  }

  // Calls fn(rows, view) for each block of tokens [start, end) of sequence b, rows
  // pointing at the block in `cache`. The first block is prefetched whole; the view of
  // each block carries the offsets of the next and the one after it, which the block
  // kernels prefetch row by row as they go (prefetch_twin); past the last block comes
  // `after` (nullptr: none), the block read next in another pass, so the prefetches run
  // on across passes.
  template <typename Fn>
  void for_each_block(const T* cache, int64_t b, int64_t start, int64_t end, const T* after,
                      Fn&& fn) const {
    const I* table = block_tables + b * s.max_blocks;
    const int64_t block_elems = s.block_size * s.row_stride;
    const int64_t last = (end - 1) / s.block_size;
    const int64_t first = start / s.block_size;
    prefetch_block(cache + static_cast<int64_t>(table[first]) * block_elems, block_elems);
    for (int64_t j = first; j <= last; ++j) {
      const int64_t here = static_cast<int64_t>(table[j]) * block_elems;
      const int64_t next = j < last ? static_cast<int64_t>(table[j + 1]) * block_elems - here
                           : after != nullptr ? after - (cache + here) : 0;
      int64_t far = 0;
      if constexpr (kWholeFar<T>) {
        if (j + 2 <= last)
          prefetch_block(cache + static_cast<int64_t>(table[j + 2]) * block_elems, block_elems);
      } else {
        far = j + 1 < last ? static_cast<int64_t>(table[j + 2]) * block_elems - here
              : j + 1 == last && after != nullptr ? after - (cache + here) : 0;
      }
      // start is a multiple of block_size, so the block's tokens sit at pos..pos + n
      fn(cache + here, BlockView{std::min(s.block_size, end - j * s.block_size),
                                 j * s.block_size - start, next, far});
    }
  }

  // `claim_next()`: claims the item this thread runs next (-1: none), whose first K
  // block the last V block prefetches; called once, as the V pass starts.
  template <typename Claim>
  void run_item(int64_t item, Claim&& claim_next, Scratch& w) const {
    const int64_t H = s.num_heads, D = s.head_dim;
    const int64_t part = item % s.num_parts;
    int64_t b, start, end;
    item_span(item, b, start, end);
    if (start >= end) {  // an empty partition of a short sequence: weight 0 in the merge
      for (int64_t h = 0; h < H; ++h) part_lse[(b * H + h) * s.num_parts + part] = kNegInf;
      return;
    }
    float* q = w.q.data();
    float* sc = w.scores.data();  // [H, n] with row stride part_tokens
    float* acc = w.acc.data();
    for (int64_t i = 0; i < H * D; ++i) q[i] = to_f32(query[b * H * D + i]) * scale;
    Query qv{q, nullptr, scale};
    if constexpr (std::is_same_v<Q, uint16_t>) qv.bf16 = query + b * H * D;
    for_each_block(k_cache, b, start, end, first_block(v_cache, item),
                   [&](const T* rows, BlockView bv) { block_scores(s, rows, bv, qv, sc); });
    float* row_max = w.stats.data();
    float* row_sum = row_max + H;
    const int64_t n = end - start;
    // keys before the window (in its first block only: partition 0 of the sequence)
    const int64_t hidden = std::min(n, first_key(b) - start);
    for (int64_t h = 0; s.softcap > 0.0f && h < H; ++h)
      soft_cap(sc + h * s.part_tokens, n, s.softcap);
    for (int64_t h = 0; h < H && hidden > 0; ++h)
      std::fill(sc + h * s.part_tokens, sc + h * s.part_tokens + hidden, kNegInf);
    for (int64_t h = 0; h < H; ++h)  // softmax numerators in place
      softmax_numerators(sc + h * s.part_tokens, n, row_max[h], row_sum[h]);
    std::fill(acc, acc + H * D, 0.0f);
    for_each_block(v_cache, b, start, end, first_block(k_cache, claim_next()),
                   [&](const T* rows, BlockView bv) { block_accumulate(s, rows, bv, sc, acc); });
    for (int64_t h = 0; h < H; ++h) {
      const float inv = 1.0f / row_sum[h];
      float* ah = acc + h * D;
      unsplit_row<T>(D, ah);
      const int64_t row = b * H + h;
      if (s.num_parts == 1) {
        for (int64_t d = 0; d < D; ++d) store(ah[d] * inv, out + row * D + d);
      } else {
        float* o = part_out + (row * s.num_parts + part) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = ah[d] * inv;
        part_lse[row * s.num_parts + part] = row_max[h] + std::log(row_sum[h]);
      }
    }
  }

  // out[row] = sum_p exp(lse_p - max lse) * part_out[row, p] / sum_p exp(lse_p - max lse)
  void merge_row(int64_t row, float* acc) const {
    const int64_t D = s.head_dim, P = s.num_parts;
    const float* lse = part_lse + row * P;
    const float m = *std::max_element(lse, lse + P);  // partition 0 is never empty
    std::fill(acc, acc + D, 0.0f);
    float total = 0.0f;
    for (int64_t p = 0; p < P; ++p) {
      if (lse[p] == kNegInf) continue;
      const float wgt = std::exp(lse[p] - m);
      const float* o = part_out + (row * P + p) * D;
      total += wgt;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[d] += wgt * o[d];
    }
    for (int64_t d = 0; d < D; ++d) store(acc[d] / total, out + row * D + d);
  }
};

// Runs body(item, claim_next, scratch) for items [0, num_items) on torch's intra-op
// pool; each thread pulls items from a shared counter, the next one claimed while the
// current one runs: `claim_next()` (the first call claims, later ones return the same;
// -1: none left) returns the item this thread runs after this one, whose first blocks
// this one's last can prefetch. A body that does not call it has its next item claimed
// when it returns. Claiming as an item starts instead held two items per thread from the
// outset: at 2 threads a batch of 2 sequences (or one in 2 partitions) ran on one core
// while the other found none left (Zen 4, bf16, batch 2 x 128 keys over 30 layers: 1.54x
// faster claimed this way; batch 45 x 400 level).
template <typename Body>
void for_each_item(int64_t num_items, const Shape& s, const Body& body) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch w(s);
    for (int64_t i = next.fetch_add(1); i < num_items;) {
      int64_t j = -1;  // the claimed item; the counter never hands out a negative one
      const auto claim_next = [&]() -> int64_t {
        if (j < 0) j = next.fetch_add(1);
        return j < num_items ? j : -1;
      };
      body(i, claim_next, w);
      if (j < 0) claim_next();
      i = j;
    }
  });
}

// Checks every sequence's length and referenced block ids (an id out of range would
// read outside the cache) and returns the longest span of keys a sequence reads (from
// its first partition key on: its length, without a window).
template <typename I>
int64_t check_tables(const I* tables, const std::vector<int64_t>& lens, const Shape& s,
                     int64_t num_blocks) {
  int64_t max_len = 0;
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t len = lens[b];
    TORCH_CHECK_VALUE(len >= 1 && len <= s.max_blocks * s.block_size, "seq_lens[", b,
                      "] = ", len, " is outside [1, ", s.max_blocks * s.block_size, "]");
    const int64_t first =
        s.window > 0 ? std::max<int64_t>(0, len - s.window) / s.block_size : 0;
    for (int64_t j = first; j < (len + s.block_size - 1) / s.block_size; ++j) {
      const int64_t id = static_cast<int64_t>(tables[b * s.max_blocks + j]);
      TORCH_CHECK_VALUE(id >= 0 && id < num_blocks, "block_tables[", b, ", ", j, "] = ", id,
                        " is outside [0, ", num_blocks, ")");
    }
    max_len = std::max(max_len, len - first * s.block_size);
  }
  return max_len;
}

// Partitions per sequence: one unless there are too few sequences to keep every
// thread busy and the context is long enough to split, or it exceeds the scratch cap.
void choose_partitions(Shape& s, int64_t max_len, int64_t partition_size) {
  int64_t tokens = partition_size;
  if (tokens <= 0) {
    const int64_t want = kItemsPerThread * at::get_num_threads();
    int64_t parts = 1;
    if (s.batch < want)
      parts = std::min((want + s.batch - 1) / s.batch, max_len / kMinPartitionTokens);
    parts = std::max<int64_t>(parts, 1);
    tokens = std::min((max_len + parts - 1) / parts, kMaxPartitionTokens);
  }
  s.part_tokens = (tokens + s.block_size - 1) / s.block_size * s.block_size;
  s.num_parts = (max_len + s.part_tokens - 1) / s.part_tokens;
}

// The op's arguments (see the schema at the bottom).
struct Args {
  const at::Tensor &out, &query, &k_cache, &v_cache, &block_tables, &seq_lens;
  double scale;
  int64_t partition_size, window;
  double softcap;
};

template <typename Q, typename T, typename I>
void decode_typed(const Args& a, const std::vector<int64_t>& lens) {
  Shape s{};
  s.batch = a.query.size(0);
  s.num_heads = a.query.size(1);
  s.head_dim = a.query.size(2);
  s.block_size = a.k_cache.size(1);
  s.num_kv_heads = a.k_cache.size(2);
  s.group = s.num_heads / s.num_kv_heads;
  s.row_stride = s.num_kv_heads * s.head_dim;
  s.max_blocks = a.block_tables.size(1);
  s.window = a.window;
  s.softcap = static_cast<float>(a.softcap);
  s.twin_l2 = twin_prefetch_into_l2();
  const I* tables = a.block_tables.data_ptr<I>();
  choose_partitions(s, check_tables(tables, lens, s, a.k_cache.size(0)), a.partition_size);

  at::Tensor part_out, part_lse;
  if (s.num_parts > 1) {
    const auto f32 = a.query.options().dtype(at::kFloat);
    part_out = at::empty({s.batch, s.num_heads, s.num_parts, s.head_dim}, f32);
    part_lse = at::empty({s.batch, s.num_heads, s.num_parts}, f32);
  }
  const Decode<Q, T, I> dec{s,
                         reinterpret_cast<const Q*>(a.query.data_ptr()),
                         reinterpret_cast<const T*>(a.k_cache.data_ptr()),
                         reinterpret_cast<const T*>(a.v_cache.data_ptr()),
                         tables,
                         lens.data(),
                         static_cast<float>(a.scale),
                         reinterpret_cast<Q*>(a.out.data_ptr()),
                         s.num_parts > 1 ? part_out.data_ptr<float>() : nullptr,
                         s.num_parts > 1 ? part_lse.data_ptr<float>() : nullptr};
  for_each_item(s.batch * s.num_parts, s,
                [&](int64_t item, const auto& claim_next, Scratch& w) {
                  dec.run_item(item, claim_next, w);
                });
  if (s.num_parts > 1) {
    for_each_item(s.batch * s.num_heads, s,
                  [&](int64_t row, const auto&, Scratch& w) { dec.merge_row(row, w.acc.data()); });
  }
}

// Shapes, dtypes and contiguity are checked by the Python wrapper: fp32 or bf16 query and
// caches alike, or an fp32 query over bf16 caches; int32 or int64 block_tables and
// seq_lens (each its own).
void decode(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
            const at::Tensor& v_cache, const at::Tensor& block_tables,
            const at::Tensor& seq_lens, double scale, int64_t partition_size, int64_t window,
            double softcap) {
  const int64_t batch = query.size(0);
  if (batch == 0) return;
  std::vector<int64_t> lens(batch);  // widened here so its dtype need not match the table's
  for (int64_t b = 0; b < batch; ++b)
    lens[b] = seq_lens.scalar_type() == at::kInt ? seq_lens.data_ptr<int32_t>()[b]
                                                 : seq_lens.data_ptr<int64_t>()[b];
  const Args a{out, query, k_cache, v_cache, block_tables, seq_lens,
               scale, partition_size, window, softcap};
  pagoda_cpu_attention::with_attention_types(query, k_cache, block_tables,
                                             [&](auto q, auto t, auto i) {
    decode_typed<decltype(q), decltype(t), decltype(i)>(a, lens);
  });
}

bool uses_avx512() {
#ifdef PAGODA_AVX512
  return true;
#else
  return false;
#endif
}

bool uses_avx2() {
#ifdef PAGODA_DECODE_AVX2
  return true;
#else
  return false;
#endif
}

// Whether the AVX-512 kernels put the next block's rows into L2 (twin_prefetch_into_l2).
bool twin_prefetch_l2() { return twin_prefetch_into_l2(); }

}  // namespace

// The namespace is a macro so a variant build (tests of the portable path) registers apart.
#define PAGODA_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
PAGODA_LIBRARY(PAGODA_OP_NS, m) {
  m.def("decode(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, int partition_size, "
        "int window=0, float softcap=0.0) -> ()",
        &decode);
  m.def("uses_avx512() -> bool", &uses_avx512);
  m.def("uses_avx2() -> bool", &uses_avx2);
  m.def("twin_prefetch_l2() -> bool", &twin_prefetch_l2);
}
