// Fused elementwise CPU kernels of the decoder layer: RMSNorm (with the residual add),
// rotary embedding (rotate-half) and SiLU-and-multiply, each one pass over its rows; and
// the KV-cache write (a row copy per token); the argmax of the LM head's rows and the
// screen of its columns that the screened greedy head runs.
//
// Built at runtime by kernels/cpu_fused.py (load_inline, -O3 -march=native, no FMA
// contraction, OpenMP flags as in cpu_decode.cpp) and registered as
// torch.ops.<PAGODA_OP_NS>.*. Each kernel reproduces the rounding of the torch code it
// replaces (services/worker/layers/): math in fp32, a bf16 value rounded (nearest even)
// wherever torch stores an intermediate tensor in the activation dtype. Inputs are
// checked here (ValueError), not in Python: the point of fusing is fewer Python-level
// calls. Rows are split over torch's thread pool only when there is enough work.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_rows.h"
#include "cpu_scalar.h"
#include "cpu_silu.h"

// The row scans' AVX-512 forms (load_scores and the loops on it): the 16-bit masked loads
// of bf16 rows need AVX512BW and VL beside F, as cpu_decode_blocks.h's kernels do.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    !defined(PAGODA_PORTABLE)
#define PAGODA_FUSED_AVX512 1
#include <immintrin.h>
#endif

#ifndef PAGODA_OP_NS
#define PAGODA_OP_NS pagoda_cpu_fused
#endif

namespace {

using namespace pagoda_cpu_scalar;
using pagoda_cpu_silu::silu_bf16_table;
using pagoda_cpu_silu::silu_rounded;
using pagoda_cpu_rows::check_cpu;
using pagoda_cpu_rows::check_positions;
using pagoda_cpu_rows::grain_rows;


template <typename Fn>
void dispatch_dtype(const at::Tensor& t, const char* what, Fn&& fn) {
  if (t.scalar_type() == at::kFloat) fn(float{});
  else if (t.scalar_type() == at::kBFloat16) fn(uint16_t{});
  else TORCH_CHECK_VALUE(false, what, " must be float32 or bfloat16, got ", t.scalar_type());
}

template <typename T>
const T* ptr(const at::Tensor& t) { return static_cast<const T*>(t.const_data_ptr()); }
template <typename T>
T* mut_ptr(const at::Tensor& t) { return static_cast<T*>(t.mutable_data_ptr()); }

// ---------------------------------------------------------------- RMSNorm

template <typename T>
void rms_norm_typed(const at::Tensor& out, const at::Tensor& res_out, const at::Tensor& x,
                    const at::Tensor* residual, const at::Tensor& weight, float eps) {
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  pagoda_cpu_rows::rms_norm_rows(mut_ptr<T>(out), residual ? mut_ptr<T>(res_out) : nullptr,
                                 ptr<T>(x), pagoda_cpu_rows::RowLayout{1, n},
                                 residual ? ptr<T>(*residual) : nullptr, ptr<T>(weight), rows, n,
                                 eps);
}

at::Tensor check_norm(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight) {
  check_cpu(x, "x");
  check_cpu(weight, "weight");
  TORCH_CHECK_VALUE(x.dim() >= 1, "x must have a hidden dimension");
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == x.size(-1), "weight must be [",
                    x.size(-1), "], got ", weight.sizes());
  TORCH_CHECK_VALUE(weight.scalar_type() == x.scalar_type(), "weight dtype ",
                    weight.scalar_type(), " != x dtype ", x.scalar_type());
  if (residual) {
    check_cpu(*residual, "residual");
    TORCH_CHECK_VALUE(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                      "residual must be like x ", x.sizes(), " ", x.scalar_type(), ", got ",
                      residual->sizes(), " ", residual->scalar_type());
  }
  return at::empty(x.sizes(), x.options());
}

// norm(x), with x its own residual (the caller keeps x).
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  const at::Tensor out = check_norm(x_in, nullptr, weight_in);
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  dispatch_dtype(x, "x", [&](auto t) {
    rms_norm_typed<decltype(t)>(out, out, x, nullptr, weight, static_cast<float>(eps));
  });
  return out;
}

// (norm(x + residual), x + residual)
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& res_in,
                                                const at::Tensor& weight_in, double eps) {
  const at::Tensor out = check_norm(x_in, &res_in, weight_in);
  const at::Tensor res_out = at::empty(x_in.sizes(), x_in.options());
  const at::Tensor x = x_in.contiguous(), res = res_in.contiguous(),
                   weight = weight_in.contiguous();
  dispatch_dtype(x, "x", [&](auto t) {
    rms_norm_typed<decltype(t)>(out, res_out, x, &res, weight, static_cast<float>(eps));
  });
  return {out, res_out};
}

// ---------------------------------------------------------------- rotary

// A [T, heads, D] view whose heads x D sit contiguously in each token row (any row
// stride, as the q / k slices of the fused qkv projection); otherwise a copy.
at::Tensor rows_of_heads(const at::Tensor& t) {
  const bool ok = t.stride(2) == 1 && t.stride(1) == t.size(2);
  return ok ? t : t.contiguous();
}

template <typename T, typename P>
void rotary_typed(const at::Tensor& q_out, const at::Tensor& k_out, const at::Tensor& q,
                  const at::Tensor& k, const P* pos, const float* cos, const float* sin) {
  pagoda_cpu_rows::rotary_rows(mut_ptr<T>(q_out), mut_ptr<T>(k_out), ptr<T>(q), q.stride(0),
                               ptr<T>(k), k.stride(0), q.size(0), q.size(1), k.size(1),
                               q.size(2), pos, cos, sin);
}

void check_rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                  const at::Tensor& cos, const at::Tensor& sin) {
  for (const auto* t : {&q, &k, &positions, &cos, &sin}) check_cpu(*t, "every tensor");
  TORCH_CHECK_VALUE(q.dim() == 3 && k.dim() == 3, "query and key must be [T, heads, D], got ",
                    q.sizes(), " and ", k.sizes());
  const int64_t tokens = q.size(0), dim = q.size(2);
  TORCH_CHECK_VALUE(k.size(0) == tokens && k.size(2) == dim && dim % 2 == 0,
                    "query ", q.sizes(), " and key ", k.sizes(),
                    " must share T and an even head_dim");
  TORCH_CHECK_VALUE(k.scalar_type() == q.scalar_type(), "key dtype ", k.scalar_type(),
                    " != query dtype ", q.scalar_type());
  pagoda_cpu_rows::check_rotary_tables(positions, cos, sin, tokens, dim);
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q_in, const at::Tensor& k_in,
                                          const at::Tensor& pos_in, const at::Tensor& cos_in,
                                          const at::Tensor& sin_in) {
  check_rotary(q_in, k_in, pos_in, cos_in, sin_in);
  const at::Tensor q = rows_of_heads(q_in), k = rows_of_heads(k_in);
  const at::Tensor pos = pos_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const at::Tensor q_out = at::empty(q.sizes(), q.options());
  const at::Tensor k_out = at::empty(k.sizes(), k.options());
  const float* cp = ptr<float>(cos);
  const float* sp = ptr<float>(sin);
  dispatch_dtype(q, "query", [&](auto t) {
    using T = decltype(t);
    if (pos.scalar_type() == at::kLong) {
      check_positions(ptr<int64_t>(pos), pos.size(0), cos.size(0));
      rotary_typed<T>(q_out, k_out, q, k, ptr<int64_t>(pos), cp, sp);
    } else {
      check_positions(ptr<int32_t>(pos), pos.size(0), cos.size(0));
      rotary_typed<T>(q_out, k_out, q, k, ptr<int32_t>(pos), cp, sp);
    }
  });
  return {q_out, k_out};
}

// ---------------------------------------------------------------- SiLU and multiply

// silu(gate) * up as torch computes F.silu(gate) * up: silu stored as T, then the
// product in fp32, stored as T.
template <typename T>
void silu_mul_typed(const at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), n = x.size(1) / 2, stride = x.stride(0);
  const T* xp = ptr<T>(x);
  T* op = mut_ptr<T>(out);
  const float* table = std::is_same_v<T, float> ? nullptr : silu_bf16_table();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * stride;
      const T* up = gate + n;
      T* o = op + r * n;
      if constexpr (std::is_same_v<T, float>) {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) store(silu_rounded<T>(gate[i]) * up[i], o + i);
      } else {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) store(table[gate[i]] * to_f32(up[i]), o + i);
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& x_in) {
  check_cpu(x_in, "gate_up");
  TORCH_CHECK_VALUE(x_in.dim() == 2 && x_in.size(1) % 2 == 0,
                    "gate_up must be [T, 2 * intermediate], got ", x_in.sizes());
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  dispatch_dtype(x, "gate_up", [&](auto t) { silu_mul_typed<decltype(t)>(out, x); });
  return out;
}

// ---------------------------------------------------------------- KV-cache write

// reference.write_kv_cache: row t of key / value to slot slot_mapping[t] of the caches
// (flat slot = block * block_size + offset), -1 skipped; one memcpy per row and cache,
// where torch's path takes two index_copy_ and a device-wide check for -1. key / value
// may be rows of the fused qkv projection (heads x D contiguous, any row stride).
void write_kv_cache(const at::Tensor& key_in, const at::Tensor& value_in, const at::Tensor& k_cache,
                    const at::Tensor& v_cache, const at::Tensor& slot_mapping_in) {
  for (const auto* t : {&key_in, &value_in, &k_cache, &v_cache, &slot_mapping_in})
    check_cpu(*t, "every tensor");
  TORCH_CHECK_VALUE(key_in.dim() == 3 && value_in.sizes() == key_in.sizes(),
                    "key and value must be [num_tokens, num_kv_heads, head_dim], got ",
                    key_in.sizes(), " and ", value_in.sizes());
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                        k_cache.size(2) == key_in.size(1) && k_cache.size(3) == key_in.size(2),
                    "k_cache and v_cache must be [num_blocks, block_size, ", key_in.size(1), ", ",
                    key_in.size(2), "], got ", k_cache.sizes(), " and ", v_cache.sizes());
  const auto dtype = key_in.scalar_type(), cache_dtype = k_cache.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16,
                    "key must be float32 or bfloat16, got ", dtype);
  // the caches in the rows' dtype, or bf16 caches under fp32 rows (rounded as written)
  TORCH_CHECK_VALUE(value_in.scalar_type() == dtype && v_cache.scalar_type() == cache_dtype &&
                        (cache_dtype == dtype || cache_dtype == at::kBFloat16),
                    "key and value must share a dtype, and k_cache and v_cache theirs or "
                    "bfloat16; got ", dtype, ", ", value_in.scalar_type(), ", ", cache_dtype,
                    ", ", v_cache.scalar_type());
  // a copy of a cache would take the writes and be dropped
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(),
                    "k_cache and v_cache must be contiguous");
  const int64_t tokens = key_in.size(0);
  pagoda_cpu_rows::check_slot_mapping(slot_mapping_in, tokens);
  const at::Tensor key = rows_of_heads(key_in), value = rows_of_heads(value_in);
  const at::Tensor slots = slot_mapping_in.contiguous();
  const int64_t* sp = ptr<int64_t>(slots);
  pagoda_cpu_rows::check_slots(sp, tokens, k_cache.size(0) * k_cache.size(1));
  dispatch_dtype(key, "key", [&](auto element) {
    using E = decltype(element);
    pagoda_cpu_rows::write_kv_rows_as(k_cache.mutable_data_ptr(), v_cache.mutable_data_ptr(),
                                      cache_dtype != dtype, ptr<E>(key), key.stride(0),
                                      ptr<E>(value), value.stride(0), sp, tokens,
                                      key.size(1) * key.size(2));
  });
}

#ifdef PAGODA_FUSED_AVX512
// The lanes of the 16 values from i that lie before n (i < n).
inline __mmask16 lanes_before(int64_t i, int64_t n) {
  return i + 16 <= n ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
}

// 16 values of a row from i as fp32 (bf16 widens exactly); lanes past n read -inf
inline __m512 load_scores(const float* row, int64_t i, int64_t n) {
  if (i + 16 <= n) return _mm512_loadu_ps(row + i);
  return _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                              lanes_before(i, n), row + i);
}
inline __m512 load_scores(const uint16_t* row, int64_t i, int64_t n) {
  const __mmask16 m = lanes_before(i, n);
  const __m256i h = _mm256_maskz_loadu_epi16(m, row + i);
  const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_mask_blend_ps(m, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), v);
}
#endif

// A row's largest value (NaNs aside) and whether it holds a NaN.
template <typename T>
float row_max(const T* row, int64_t n, bool& nan) {
#ifdef PAGODA_FUSED_AVX512
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 unordered = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = load_scores(row, i, n);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_max_ps(v, best);  // a NaN in v gives best back
  }
  nan = unordered != 0;
  return _mm512_reduce_max_ps(best);
#else
  float m = -std::numeric_limits<float>::infinity();
  int any_nan = 0;
#pragma omp simd reduction(max : m) reduction(| : any_nan)
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_f32(row[i]);
    any_nan |= v != v;
    m = v > m ? v : m;
  }
  nan = any_nan != 0;
  return m;
#endif
}

// Appends the indices i < n with row[i] >= thr, ascending.
template <typename T>
void append_at_least(const T* row, int64_t n, float thr, std::vector<int64_t>& out) {
#ifdef PAGODA_FUSED_AVX512
  const __m512 t = _mm512_set1_ps(thr);
  for (int64_t i = 0; i < n; i += 16) {
    // lanes past n read -inf, below any finite threshold
    for (uint32_t hit = _mm512_cmp_ps_mask(load_scores(row, i, n), t, _CMP_GE_OQ); hit != 0;
         hit &= hit - 1)
      out.push_back(i + __builtin_ctz(hit));
  }
#else
  for (int64_t i = 0; i < n; ++i)
    if (to_f32(row[i]) >= thr) out.push_back(i);
#endif
}

// The first index of a row's largest value, a NaN counting as larger than everything (the
// first NaN wins), as torch.argmax. AVX-512: each lane keeps its largest value and where
// it first saw it (a strictly greater one replaces it), then the lanes holding the top
// value give their smallest index; NaNs (never greater) are flagged and, if any, found by
// a scan. The scan to the top value's first index that the portable loop needs ran
// scalar, half a row on average: ~25 us a 49,152-logit row.
template <typename T>
int64_t row_argmax(const T* row, int64_t n) {
#ifdef PAGODA_FUSED_AVX512
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i idx = at;
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16, idx = _mm512_add_epi32(idx, step)) {
    const __m512 v = load_scores(row, i, n);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_blend_ps(gt, best, v);
    at = _mm512_mask_blend_epi32(gt, at, idx);
  }
  if (!nan) {
    const float top = _mm512_reduce_max_ps(best);
    const __mmask16 holders = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
    return _mm512_mask_reduce_min_epi32(holders, at);
  }
#else
  bool nan = false;
  const float m = row_max(row, n, nan);
  if (!nan) {
    int64_t i = 0;
    while (to_f32(row[i]) != m) ++i;  // m is one of the row's values (or -inf: all are)
    return i;
  }
#endif
  int64_t i = 0;  // the first NaN
  while (to_f32(row[i]) == to_f32(row[i])) ++i;
  return i;
}

// out[r] = torch.argmax(x[r]) for a [R, V] fp32 or bf16 tensor with unit stride along V
// (row_argmax). bf16 widens exactly, so its argmax is its fp32 copy's: a greedy step
// reads the LM head's bf16 logits without writing an fp32 copy first (at batch 64 that
// copy was 0.4 ms of a 38 ms SmolLM2 step). torch's CPU argmax ran at ~2 G elements/s,
// 1.4 ms of a batch-36 decode step over SmolLM2's 49,152 logits.
template <typename T>
void argmax_rows_typed(const at::Tensor& x, int64_t* o) {
  const int64_t rows = x.size(0), vocab = x.size(1), ld = x.stride(0);
  const T* base = static_cast<const T*>(x.const_data_ptr());
  at::parallel_for(0, rows, grain_rows(vocab), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = row_argmax(base + r * ld, vocab);
  });
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.device().is_cpu() &&
                        (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                    "argmax_rows takes a 2-D float32 or bfloat16 CPU tensor, got ", x.sizes(),
                    " ", x.scalar_type());
  const int64_t rows = x.size(0), vocab = x.size(1);
  TORCH_CHECK_VALUE(vocab > 0 && (x.stride(1) == 1 || vocab == 1),
                    "argmax_rows needs a non-empty last dim of stride 1");
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kFloat) argmax_rows_typed<float>(x, out.data_ptr<int64_t>());
  else argmax_rows_typed<uint16_t>(x, out.data_ptr<int64_t>());
  return out;
}

// The columns of a [R, V] fp32 or bf16 tensor of approximate scores that may hold a row's
// largest true value, ascending: column v is kept when, for some row r, its largest
// possible true value reaches the smallest possible true value of the row's top score m,
// each score s being within bound[r] + rel * |s| of its true value. Both limits grow
// with s, so that is one threshold a row, solved in double and rounded down to fp32:
// s_v + b + rel |s_v| >= m - b - rel |m|. A row holding a NaN keeps every column (its
// caller then computes them all). Used by the screened greedy LM head
// (services/worker/layers/screened_argmax.py); rows run on the pool, each collecting its
// own columns, merged here through a flag a column.
template <typename T>
std::vector<std::vector<int64_t>> screen_rows(const at::Tensor& x, const double* bound,
                                              double rel) {
  const int64_t rows = x.size(0), vocab = x.size(1), ld = x.stride(0);
  const T* base = static_cast<const T*>(x.const_data_ptr());
  std::vector<std::vector<int64_t>> kept(rows);
  at::parallel_for(0, rows, grain_rows(vocab), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = base + r * ld;
      bool nan = false;
      const float m = row_max(row, vocab, nan);
      std::vector<int64_t>& out = kept[r];
      if (nan) {
        out.resize(vocab);
        for (int64_t i = 0; i < vocab; ++i) out[i] = i;
        continue;
      }
      const double low = static_cast<double>(m) - bound[r] - rel * std::fabs(static_cast<double>(m));
      const double need = low - bound[r];  // s + rel |s| >= need
      const double t = need >= 0.0 ? need / (1.0 + rel) : need / (1.0 - rel);
      float thr = static_cast<float>(t);
      if (static_cast<double>(thr) > t) thr = std::nextafter(thr, -std::numeric_limits<float>::infinity());
      append_at_least(row, vocab, thr, out);
    }
  });
  return kept;
}

at::Tensor screen_columns(const at::Tensor& x, const at::Tensor& bounds, double rel) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.device().is_cpu() &&
                        (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                    "screen_columns takes a 2-D float32 or bfloat16 CPU tensor, got ", x.sizes(),
                    " ", x.scalar_type());
  const int64_t rows = x.size(0), vocab = x.size(1);
  TORCH_CHECK_VALUE(vocab == 0 || x.stride(1) == 1 || vocab == 1,
                    "screen_columns needs a last dim of stride 1");
  TORCH_CHECK_VALUE(bounds.dim() == 1 && bounds.size(0) == rows && bounds.device().is_cpu() &&
                        bounds.scalar_type() == at::kDouble,
                    "bounds must be a [", rows, "] float64 CPU tensor, got ", bounds.sizes(), " ",
                    bounds.scalar_type());
  TORCH_CHECK_VALUE(rel >= 0.0 && rel < 1.0, "rel must be in [0, 1), got ", rel);
  const at::Tensor b = bounds.contiguous();
  const double* bp = b.const_data_ptr<double>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK_VALUE(std::isfinite(bp[r]) && bp[r] >= 0.0, "bounds[", r, "] = ", bp[r],
                      " is not a finite non-negative number");
  std::vector<std::vector<int64_t>> kept;
  if (vocab > 0) {
    kept = x.scalar_type() == at::kFloat ? screen_rows<float>(x, bp, rel)
                                         : screen_rows<uint16_t>(x, bp, rel);
  }
  std::vector<uint8_t> flag(vocab, 0);
  int64_t count = 0;
  for (const auto& k : kept)
    for (const int64_t v : k) count += flag[v] == 0, flag[v] = 1;
  at::Tensor out = at::empty({count}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t v = 0; v < vocab; ++v)
    if (flag[v]) *o++ = v;
  return out;
}

}  // namespace

// The namespace is a macro so a variant build could register apart (as cpu_decode).
#define PAGODA_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
PAGODA_LIBRARY(PAGODA_OP_NS, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
        &add_rms_norm);
  m.def("rotary(Tensor query, Tensor key, Tensor positions, Tensor cos_cache, "
        "Tensor sin_cache) -> (Tensor, Tensor)",
        &rotary);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
  m.def("argmax_rows(Tensor x) -> Tensor", &argmax_rows);
  m.def("screen_columns(Tensor x, Tensor bounds, float rel) -> Tensor", &screen_columns);
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping) -> ()",
        &write_kv_cache);
}
