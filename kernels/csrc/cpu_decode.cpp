// CPU paged-attention decode: one new token per sequence, K/V read through the block table.
//
// Built at runtime by kernels/cpu_decode.py (load_inline, -O3 -march=native -fopenmp; the
// -fopenmp only lets ATen's header-inlined parallel_for open torch's own OpenMP pool).
// Registered as torch.ops.pagoda_cpu_decode.decode; the Python wrapper validates shapes.
//
// Work item = (sequence, kv head, partition). An item holds the G = num_heads / num_kv_heads
// query rows of its kv head, so each K/V row is read once for the whole group. It walks
// its token range block by block through the block table in two passes: scores q.k for
// all G rows (fp32, kept in a per-thread scratch), softmax, then the weighted V sum.
// Long contexts with few (sequence, kv head) pairs are split into partitions (split-K,
// as in flash decoding): each writes its normalised output and log-sum-exp, and a
// second pass merges them. Items are handed out through an atomic counter so ragged
// sequence lengths do not leave a thread idle.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// Below this many tokens per partition the merge costs more than the parallelism wins.
constexpr int64_t kMinPartitionTokens = 128;
// Aim for this many work items per thread before splitting stops paying.
constexpr int64_t kItemsPerThread = 4;

inline float bf16_to_f32(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// A row of head_dim elements as fp32: fp32 rows are used in place, bf16 rows are
// widened into buf (a zero-extend and shift per element; the loop vectorises).
inline const float* row_f32(const float* src, float* /*buf*/, int64_t /*n*/) { return src; }
inline const float* row_f32(const uint16_t* src, float* buf, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) buf[i] = bf16_to_f32(src[i]);
  return buf;
}

inline void store_row(float* dst, const float* src, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}
inline void store_row(uint16_t* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::BFloat16(src[i]).x;  // round to nearest even
}

// exp(x) for x <= 0 (scores minus their max), Cephes expf: ~1 ulp, and unlike std::exp it
// vectorises without -ffast-math. Clamped at -87 so 2^n stays a normal float; the
// weights it rounds up from 0 (< 2e-38) are negligible.
inline float exp_nonpos(float x) {
  x = std::max(x, -87.0f);
  const float round_magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  float n = (x * 1.44269504088896341f + round_magic) - round_magic;
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // x - n ln2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

struct Shape {
  int64_t batch, num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
  int64_t num_parts, part_tokens;  // partitions per sequence, tokens per partition
};

// Per-thread buffers, sized once per parallel region.
struct Scratch {
  std::vector<float> q;       // [G, D] query rows, pre-scaled
  std::vector<float> scores;  // [G, part_tokens] scores, then softmax weights
  std::vector<float> acc;     // [G, D] weighted V sums
  std::vector<float> row;     // [D] one widened K or V row
  std::vector<float> stats;   // [2, G] softmax max and sum of each row
  explicit Scratch(const Shape& s)
      : q(s.group * s.head_dim), scores(s.group * s.part_tokens),
        acc(s.group * s.head_dim), row(s.head_dim), stats(2 * s.group) {}
};

template <typename T, typename I>  // T: cache element (float or bf16 bits), I: table index
struct Decode {
  const Shape s;
  const T* query;        // [batch, num_heads, D]
  const T* k_cache;      // [num_blocks, block_size, num_kv_heads, D]
  const T* v_cache;      // [num_blocks, block_size, num_kv_heads, D]
  const I* block_tables; // [batch, max_blocks]
  const int64_t* seq_lens;  // [batch]
  float scale;
  T* out;                // [batch, num_heads, D]
  float* part_out;       // num_parts > 1: [batch, num_heads, num_parts, D]
  float* part_lse;       // num_parts > 1: [batch, num_heads, num_parts]

  // Address of token `pos`'s row of kv head `kvh` in a cache.
  const T* kv_row(const T* cache, int64_t b, int64_t pos, int64_t kvh) const {
    int64_t block = static_cast<int64_t>(block_tables[b * s.max_blocks + pos / s.block_size]);
    int64_t slot = block * s.block_size + pos % s.block_size;
    return cache + (slot * s.num_kv_heads + kvh) * s.head_dim;
  }

  void run_item(int64_t item, Scratch& w) const {
    const int64_t G = s.group, D = s.head_dim;
    const int64_t part = item % s.num_parts;
    const int64_t kvh = (item / s.num_parts) % s.num_kv_heads;
    const int64_t b = item / (s.num_parts * s.num_kv_heads);
    const int64_t seq_len = seq_lens[b];
    const int64_t start = part * s.part_tokens;
    const int64_t end = std::min(seq_len, start + s.part_tokens);
    const int64_t head0 = kvh * G;  // first query head of this kv head
    if (start >= end) {  // an empty partition of a short sequence: weight 0 in the merge
      for (int64_t g = 0; g < G; ++g)
        part_lse[((b * s.num_heads) + head0 + g) * s.num_parts + part] =
            -std::numeric_limits<float>::infinity();
      return;
    }
    const int64_t n = end - start;
    float* q = w.q.data();
    float* sc = w.scores.data();  // [G, n] (row stride part_tokens)
    float* acc = w.acc.data();
    for (int64_t g = 0; g < G; ++g) {
      const float* qr = row_f32(query + (b * s.num_heads + head0 + g) * D, w.row.data(), D);
      for (int64_t d = 0; d < D; ++d) q[g * D + d] = qr[d] * scale;
    }
    // pass 1: scores of every token of the partition for the G rows
    for (int64_t i = 0; i < n; ++i) {
      const float* k = row_f32(kv_row(k_cache, b, start + i, kvh), w.row.data(), D);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * D;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
        sc[g * s.part_tokens + i] = dot;
      }
    }
    // softmax numerators in place; sums and maxima kept per row
    float* row_max = w.stats.data();
    float* row_sum = row_max + G;
    for (int64_t g = 0; g < G; ++g) {
      float* sg = sc + g * s.part_tokens;
      float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
      for (int64_t i = 0; i < n; ++i) m = std::max(m, sg[i]);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) {
        sg[i] = exp_nonpos(sg[i] - m);
        sum += sg[i];
      }
      row_max[g] = m;
      row_sum[g] = sum;
    }
    // pass 2: acc[g] = sum_i p[g, i] * v_i
    std::fill(acc, acc + G * D, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      const float* v = row_f32(kv_row(v_cache, b, start + i, kvh), w.row.data(), D);
      for (int64_t g = 0; g < G; ++g) {
        const float p = sc[g * s.part_tokens + i];
        float* ag = acc + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] += p * v[d];
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const float inv = 1.0f / row_sum[g];
      float* ag = acc + g * D;
      for (int64_t d = 0; d < D; ++d) ag[d] *= inv;
      const int64_t h = b * s.num_heads + head0 + g;
      if (s.num_parts == 1) {
        store_row(out + h * D, ag, D);
      } else {
        std::memcpy(part_out + (h * s.num_parts + part) * D, ag, D * sizeof(float));
        part_lse[h * s.num_parts + part] = row_max[g] + std::log(row_sum[g]);
      }
    }
  }

  // out[h] = sum_p exp(lse_p - max lse) * part_out[h, p] / sum_p exp(lse_p - max lse)
  void merge_head(int64_t h, float* acc) const {
    const int64_t D = s.head_dim, P = s.num_parts;
    const float* lse = part_lse + h * P;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < P; ++p) m = std::max(m, lse[p]);  // part 0 is never empty
    std::fill(acc, acc + D, 0.0f);
    float total = 0.0f;
    for (int64_t p = 0; p < P; ++p) {
      if (lse[p] == -std::numeric_limits<float>::infinity()) continue;
      const float wgt = std::exp(lse[p] - m);
      const float* o = part_out + (h * P + p) * D;
      total += wgt;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[d] += wgt * o[d];
    }
    for (int64_t d = 0; d < D; ++d) acc[d] /= total;
    store_row(out + h * D, acc, D);
  }
};

// Runs body(item, scratch) for items [0, num_items) on torch's intra-op pool; each
// thread pulls the next item from a shared counter.
template <typename Body>
void for_each_item(int64_t num_items, const Shape& s, const Body& body) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch w(s);
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) body(i, w);
  });
}

// Checks every sequence's length and referenced block ids (an id out of range would
// read outside the cache) and returns the longest length.
template <typename I>
int64_t check_tables(const I* tables, const std::vector<int64_t>& lens, const Shape& s,
                     int64_t num_blocks) {
  int64_t max_len = 0;
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t len = lens[b];
    TORCH_CHECK_VALUE(len >= 1 && len <= s.max_blocks * s.block_size, "seq_lens[", b,
                      "] = ", len, " is outside [1, ", s.max_blocks * s.block_size, "]");
    for (int64_t j = 0; j < (len + s.block_size - 1) / s.block_size; ++j) {
      const int64_t id = static_cast<int64_t>(tables[b * s.max_blocks + j]);
      TORCH_CHECK_VALUE(id >= 0 && id < num_blocks, "block_tables[", b, ", ", j, "] = ", id,
                        " is outside [0, ", num_blocks, ")");
    }
    max_len = std::max(max_len, len);
  }
  return max_len;
}

// Partitions per sequence: one unless there are too few (sequence, kv head) items to
// keep every thread busy and the context is long enough to split.
void choose_partitions(Shape& s, int64_t max_len, int64_t partition_size) {
  int64_t tokens = partition_size;
  if (tokens <= 0) {
    const int64_t items = s.batch * s.num_kv_heads;
    const int64_t want = kItemsPerThread * at::get_num_threads();
    int64_t parts = 1;
    if (items < want) parts = std::min((want + items - 1) / items, max_len / kMinPartitionTokens);
    parts = std::max<int64_t>(parts, 1);
    tokens = (max_len + parts - 1) / parts;
  }
  s.part_tokens = (tokens + s.block_size - 1) / s.block_size * s.block_size;
  s.num_parts = (max_len + s.part_tokens - 1) / s.part_tokens;
}

template <typename T, typename I>
void decode_typed(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, double scale, int64_t partition_size) {
  Shape s{};
  s.batch = query.size(0);
  s.num_heads = query.size(1);
  s.head_dim = query.size(2);
  s.block_size = k_cache.size(1);
  s.num_kv_heads = k_cache.size(2);
  s.group = s.num_heads / s.num_kv_heads;
  s.max_blocks = block_tables.size(1);
  const I* tables = block_tables.data_ptr<I>();
  // seq_lens widened once (batch values), so its dtype need not match the table's
  const at::Tensor lens_long = seq_lens.to(at::kLong);
  const std::vector<int64_t> lens(lens_long.data_ptr<int64_t>(),
                                  lens_long.data_ptr<int64_t>() + s.batch);
  const int64_t max_len = check_tables(tables, lens, s, k_cache.size(0));
  choose_partitions(s, max_len, partition_size);

  at::Tensor part_out, part_lse;
  if (s.num_parts > 1) {
    part_out = at::empty({s.batch, s.num_heads, s.num_parts, s.head_dim}, query.options().dtype(at::kFloat));
    part_lse = at::empty({s.batch, s.num_heads, s.num_parts}, query.options().dtype(at::kFloat));
  }
  const Decode<T, I> dec{s,
                         reinterpret_cast<const T*>(query.data_ptr()),
                         reinterpret_cast<const T*>(k_cache.data_ptr()),
                         reinterpret_cast<const T*>(v_cache.data_ptr()),
                         tables,
                         lens.data(),
                         static_cast<float>(scale),
                         reinterpret_cast<T*>(out.data_ptr()),
                         s.num_parts > 1 ? part_out.data_ptr<float>() : nullptr,
                         s.num_parts > 1 ? part_lse.data_ptr<float>() : nullptr};
  for_each_item(s.batch * s.num_kv_heads * s.num_parts, s,
                [&](int64_t item, Scratch& w) { dec.run_item(item, w); });
  if (s.num_parts > 1) {
    for_each_item(s.batch * s.num_heads, s,
                  [&](int64_t h, Scratch& w) { dec.merge_head(h, w.acc.data()); });
  }
}

template <typename T>
void decode_index(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, double scale, int64_t partition_size) {
  if (block_tables.scalar_type() == at::kInt)
    decode_typed<T, int32_t>(out, query, k_cache, v_cache, block_tables, seq_lens, scale, partition_size);
  else
    decode_typed<T, int64_t>(out, query, k_cache, v_cache, block_tables, seq_lens, scale, partition_size);
}

// Shapes, dtypes and contiguity are checked by the Python wrapper.
void decode(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
            const at::Tensor& v_cache, const at::Tensor& block_tables,
            const at::Tensor& seq_lens, double scale, int64_t partition_size) {
  if (query.scalar_type() == at::kFloat)
    decode_index<float>(out, query, k_cache, v_cache, block_tables, seq_lens, scale, partition_size);
  else
    decode_index<uint16_t>(out, query, k_cache, v_cache, block_tables, seq_lens, scale, partition_size);
}

}  // namespace

TORCH_LIBRARY(pagoda_cpu_decode, m) {
  m.def("decode(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, int partition_size) -> ()",
        &decode);
}
