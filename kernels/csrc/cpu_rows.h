// Row kernels of the decoder layer on raw pointers: RMSNorm (with the residual add), the
// rotary embedding (rotate-half) and the KV-cache write, and the input checks both of
// their callers make. cpu_fused.cpp wraps them as ops (checks, allocation, the
// dispatcher); cpu_decoder.cpp calls them directly, on buffers
// it allocates once a step, so a batch-1 layer pays no op dispatch, allocation or view
// for them. One source for both keeps the two paths bit-identical; both extensions are
// built with -ffp-contract=off (the rotary's products are rounded before the sum).
//
// Each reproduces the rounding of the torch code it replaces (services/worker/layers/):
// math in fp32, a bf16 value rounded (nearest even) wherever torch stores an
// intermediate tensor in the activation dtype. Rows are split over torch's thread pool
// only when there is enough work.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_scalar.h"

namespace pagoda_cpu_rows {

using namespace pagoda_cpu_scalar;

// ---------------------------------------------------------------- input checks (ValueError)

inline void check_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), what, " must be a CPU tensor, got ", t.device());
}

// The rotary's positions ([tokens] int64 or int32) and cos / sin caches ([max_position,
// dim / 2] fp32), their shapes and dtypes.
inline void check_rotary_tables(const at::Tensor& positions, const at::Tensor& cos,
                                const at::Tensor& sin, int64_t tokens, int64_t dim) {
  TORCH_CHECK_VALUE(positions.dim() == 1 && positions.size(0) == tokens, "positions must be [",
                    tokens, "], got ", positions.sizes());
  TORCH_CHECK_VALUE(
      positions.scalar_type() == at::kLong || positions.scalar_type() == at::kInt,
      "positions must be int64 or int32, got ", positions.scalar_type());
  TORCH_CHECK_VALUE(cos.dim() == 2 && cos.size(1) == dim / 2 && sin.sizes() == cos.sizes(),
                    "cos_cache and sin_cache must be [max_position, ", dim / 2, "], got ",
                    cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK_VALUE(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
                    "cos_cache and sin_cache must be float32");
}

// Every position inside the rotary cache's max_position rows.
template <typename P>
void check_positions(const P* pos, int64_t n, int64_t max_position) {
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK_VALUE(pos[t] >= 0 && pos[t] < max_position, "positions[", t, "] = ", pos[t],
                      " outside the rotary cache [0, ", max_position, ")");
}

inline void check_slot_mapping(const at::Tensor& slot_mapping, int64_t tokens) {
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens &&
                        slot_mapping.scalar_type() == at::kLong,
                    "slot_mapping must be [", tokens, "] int64, got ", slot_mapping.sizes(), " ",
                    slot_mapping.scalar_type());
}

// Every slot in [-1, num_slots), checked before any write so that a bad one leaves the
// caches as they were.
inline void check_slots(const int64_t* slots, int64_t tokens, int64_t num_slots) {
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK_VALUE(slots[t] >= -1 && slots[t] < num_slots, "slot_mapping[", t, "] = ",
                      slots[t], " outside [-1, ", num_slots, ")");
}

// ---------------------------------------------------------------- row kernels

// Elements per parallel chunk: below this the pool's wake-up costs more than the work
// (a [1, 576] norm takes well under a microsecond).
constexpr int64_t kGrainElems = 32768;

inline int64_t grain_rows(int64_t row_elems) {
  return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, row_elems));
}

// One row of norm.py: xf = float(h); y = xf * rsqrt(mean(xf^2) + eps); out = w * T(y),
// with h = T(x + residual) already stored in `h`. The sum runs in fp32 in another order
// than torch's reduction (a few fp32 ulps on the mean).
template <typename T>
inline void norm_row(T* out, const T* h, const T* w, int64_t n, float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_f32(h[i]);
    sum += v * v;
  }
  // torch: sum / n (CPU mean), + eps, then rsqrt as 1 / sqrt
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) store(to_f32(w[i]) * rounded<T>(to_f32(h[i]) * inv), out + i);
}

// Where the rows of an input sit: row r at base + (r / per_group) * group_stride +
// (r % per_group) * n; a plain [rows, n] tensor is per_group 1, group_stride its row
// stride, and the heads of q in the fused qkv rows are per_group = heads.
struct RowLayout {
  int64_t per_group, group_stride;
  int64_t offset(int64_t r, int64_t n) const {
    return (r / per_group) * group_stride + (r % per_group) * n;
  }
};

// out[r] = norm(x[r] (+ residual[r]), w) for rows r < rows of n elements; with a
// residual, res_out[r] = T(x[r] + residual[r]) first (res_out may be residual itself).
// out, residual and res_out are contiguous [rows, n]; x is laid out as `xl` says.
template <typename T>
void rms_norm_rows(T* out, T* res_out, const T* x, RowLayout xl, const T* residual,
                   const T* w, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* h = x + xl.offset(r, n);
      if (residual) {  // the new residual, rounded to T as torch's x + residual
        T* hr = res_out + r * n;
        const T* rr = residual + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) store(to_f32(h[i]) + to_f32(rr[i]), hr + i);
        h = hr;
      }
      norm_row(out + r * n, h, w, n, eps);
    }
  });
}

// The heads of one token: in [heads, D] (row-contiguous), out [heads, D] contiguous.
// rotary.py::_rotate: (x1 * cos - x2 * sin, x2 * cos + x1 * sin), each product rounded
// to fp32 before the sum (no FMA: built with -ffp-contract=off), then cast to T.
template <typename T>
inline void rotate_token(T* out, const T* in, int64_t heads, int64_t dim, const float* cs,
                         const float* sn) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const T* x = in + h * dim;
    T* y = out + h * dim;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = to_f32(x[i]), x2 = to_f32(x[i + half]);
      store(x1 * cs[i] - x2 * sn[i], y + i);
      store(x2 * cs[i] + x1 * sn[i], y + i + half);
    }
  }
}

// The query and key heads of `tokens` tokens rotated by their positions: q (hq heads of
// dim, tokens qs elements apart) into qo [tokens, hq, dim], k likewise into ko; cos / sin
// [max_position, dim / 2] fp32, every position already checked to be inside.
template <typename T, typename P>
void rotary_rows(T* qo, T* ko, const T* q, int64_t qs, const T* k, int64_t ks, int64_t tokens,
                 int64_t hq, int64_t hk, int64_t dim, const P* pos, const float* cos,
                 const float* sin) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, grain_rows((hq + hk) * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cs = cos + static_cast<int64_t>(pos[t]) * half;
      const float* sn = sin + static_cast<int64_t>(pos[t]) * half;
      rotate_token(qo + t * hq * dim, q + t * qs, hq, dim, cs, sn);
      rotate_token(ko + t * hk * dim, k + t * ks, hk, dim, cs, sn);
    }
  });
}

// Rows per parallel chunk of the cache write: a row copy is a memcpy of a few hundred
// bytes, so a chunk needs many more of them than the arithmetic kernels' grain.
constexpr int64_t kCopyGrainBytes = 1 << 18;

// Row t of key / value (row_bytes each, ks / vs bytes apart) to slot slots[t] of the
// caches (flat slot = block * block_size + offset), -1 skipped; every slot already
// checked to be inside the caches.
inline void write_kv_rows(char* k_cache, char* v_cache, const char* key, int64_t ks,
                          const char* value, int64_t vs, const int64_t* slots, int64_t tokens,
                          int64_t row_bytes) {
  if (tokens == 0 || row_bytes == 0) return;
  at::parallel_for(0, tokens, std::max<int64_t>(1, kCopyGrainBytes / (2 * row_bytes)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      std::memcpy(k_cache + slots[t] * row_bytes, key + t * ks, row_bytes);
      std::memcpy(v_cache + slots[t] * row_bytes, value + t * vs, row_bytes);
    }
  });
}

// write_kv_rows for fp32 rows into bf16 caches (an fp32 model's opt-in bf16 KV cache):
// row t of key / value (row_elems fp32 each, ks / vs elements apart) rounded to nearest
// even, as key.to(torch.bfloat16), into slot slots[t]; -1 skipped.
inline void write_kv_rows_bf16(uint16_t* k_cache, uint16_t* v_cache, const float* key,
                               int64_t ks, const float* value, int64_t vs,
                               const int64_t* slots, int64_t tokens, int64_t row_elems) {
  if (tokens == 0 || row_elems == 0) return;
  at::parallel_for(0, tokens, std::max<int64_t>(1, kCopyGrainBytes / (6 * row_elems)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      uint16_t* kd = k_cache + slots[t] * row_elems;
      uint16_t* vd = v_cache + slots[t] * row_elems;
      const float* kr = key + t * ks;
      const float* vr = value + t * vs;
      for (int64_t i = 0; i < row_elems; ++i) kd[i] = bf16_bits(kr[i]);
      for (int64_t i = 0; i < row_elems; ++i) vd[i] = bf16_bits(vr[i]);
    }
  });
}

// The cache write of both callers (cpu_fused's write_kv_cache, the one-call decoder's
// layer loop): rows of E (float, or uint16_t bf16 bits), row_elems each, ks / vs elements
// apart, copied into caches of E, or, for fp32 rows with bf16_cache, rounded into bf16
// caches (write_kv_rows_bf16).
template <typename E>
inline void write_kv_rows_as(void* k_cache, void* v_cache, bool bf16_cache, const E* key,
                             int64_t ks, const E* value, int64_t vs, const int64_t* slots,
                             int64_t tokens, int64_t row_elems) {
  if constexpr (sizeof(E) == 4) {
    if (bf16_cache) {
      write_kv_rows_bf16(static_cast<uint16_t*>(k_cache), static_cast<uint16_t*>(v_cache),
                         reinterpret_cast<const float*>(key), ks,
                         reinterpret_cast<const float*>(value), vs, slots, tokens, row_elems);
      return;
    }
  }
  constexpr int64_t kBytes = sizeof(E);
  write_kv_rows(static_cast<char*>(k_cache), static_cast<char*>(v_cache),
                reinterpret_cast<const char*>(key), ks * kBytes,
                reinterpret_cast<const char*>(value), vs * kBytes, slots, tokens,
                row_elems * kBytes);
}

}  // namespace pagoda_cpu_rows
