// SiLU as torch computes F.silu, shared by the kernels that apply it (cpu_fused.cpp's
// silu_mul, cpu_gemm.cpp's gated epilogue) so both give the same bits. Include after
// cpu_scalar.h; build with -ffp-contract=off (a contracted exp rounds differently).
#pragma once

#include <cstdint>
#include <vector>

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
