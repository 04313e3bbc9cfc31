// Small-batch bf16 linear on the CPU: y = x @ W.T (+ bias), x [M, K], W [N, K], y [M, N],
// all bf16, for the decode step's few rows (M = 1..8; more rows loop over tiles of 8).
//
// Built at runtime by kernels/cpu_gemv.py (load_inline, -O3 -march=native, the OpenMP
// flags that put at::parallel_for on torch's own pool) and registered as
// torch.ops.<PAGODA_OP_NS>.linear_bf16. Why not oneDNN: at batch 1 a linear does two
// flops per 2-byte weight it reads once, so it is bound by memory bandwidth, and
// oneDNN's bf16 linear on packed weights reads them well below what the AVX512-BF16 build
// machines deliver (its fp32 path does not; see kernels/bench_linear.py). Here the weights
// are read in their plain row-major layout (no packing), each cache line once, as one
// sequential stream per thread.
//
// Work: the N output rows are split into contiguous ranges over torch's pool (each
// thread streams its own part of W, prefetching kPrefetchBytes ahead). Per tile of MT <=
// 8 rows of x, a thread walks its W rows one (MT = 8: two) at a time, each 32-element
// chunk of a W row loaded once and multiplied into the MT x chunks (L1-resident) with
// vdpbf16ps (AVX512-BF16: two exact bf16 products added into each fp32 lane); the lane
// partial sums of 16 / MT rows are then reduced together (reduce16, a shuffle tree: ~3
// instructions per output). The K tail is a masked, zero-filled load. Why one W row at a
// time rather than several interleaved (which would share the x loads): the DRAM reads
// of a single sequential stream per core measured ~40 % faster (see streams()). For M >
// 8 a thread runs every x tile over an L2-sized block of its rows before moving on, so W
// crosses DRAM once whatever M is.
//
// Numerics (both paths): each output is an fp32 sum of exact bf16 products (vdpbf16ps
// flushes denormal inputs and results to zero), plus the bias in fp32, rounded once to
// bf16 (nearest even, bf16_bits). The summation order is not torch's, so an output may
// differ from F.linear on fp32 copies by one bf16 ulp where the sum sits near a tie.
//
// Without AVX512-BF16 (AVX2-only machines, or with PAGODA_PORTABLE, which tests use to
// build the fallback on any machine) portable fp32 loops run instead, in GCC / Clang
// vector types. Inputs are checked here (ValueError): the op is called from the model's
// forward, where a Python-side check would cost a good part of the call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "cpu_reduce16.h"
#include "cpu_scalar.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512BF16__) && !defined(PAGODA_PORTABLE)
#define PAGODA_GEMV_BF16 1
#include <immintrin.h>
#endif

#ifndef PAGODA_OP_NS
#define PAGODA_OP_NS pagoda_cpu_gemv
#endif

namespace {

using namespace pagoda_cpu_scalar;

constexpr int kMaxM = 8;           // x rows per register tile; more rows loop over tiles
constexpr int64_t kTileRows = 16;  // the parallel split's unit of W rows
// Below this many weight bytes per thread the pool's wake-up (a few us) costs more than
// the second thread saves (measured: a 74 KB weight runs faster on one thread, 147 KB
// on two).
constexpr int64_t kMinBytesPerThread = 96 * 1024;
// For M > kMaxM, the rows of W a thread runs every tile of x rows over before moving
// on: ~128 KB of weights, L2-resident while the tiles re-read them.
constexpr int64_t kBlockBytes = 128 * 1024;

struct Args {
  const uint16_t* x;     // [M, K], rows ldx apart
  const uint16_t* w;     // [N, K] contiguous
  const uint16_t* bias;  // [N] or nullptr
  uint16_t* out;         // [M, N] contiguous
  int64_t M, N, K, ldx;
};

// out[m, n] = bf16(sum + bias[n]), the one rounding of an output.
inline void store_out(const Args& a, int64_t m, int64_t n, float sum) {
  if (a.bias) sum += to_f32(a.bias[n]);
  a.out[m * a.N + n] = bf16_bits(sum);
}

#ifdef PAGODA_GEMV_BF16
// How far ahead of its loads a thread prefetches its weights: a DRAM latency's worth at
// full speed is a few KB; 8-32 KB measured alike. The hardware prefetcher alone is ~5 %
// slower at M = 1, 1.5x at M = 4 and 4x at M = 8, where more compute per line leaves
// fewer misses in flight.
constexpr int64_t kPrefetchBytes = 16 * 1024;

// The register tile for MT rows of x (all compile-time):
//  streams: W rows whose chunks alternate in the inner loop. One row at a time (a single
//    sequential stream per thread) reads DRAM ~40 % faster than two or more rows
//    interleaved (measured cold, one thread: ~44 vs ~31 GB/s), whatever the prefetch;
//    but each chunk of W then meets all MT x chunks alone, so the x loads (from L1) grow
//    to MT per W line, and at MT = 8 two rows (sharing the x loads) outrun one.
//  ksplit: chunks of K per step, each into its own accumulators, which halves the
//    vdpbf16ps dependency chains of the small tiles (one W row x MT <= 4 rows of x).
//  rows_per_tile: W rows reduced together, MT * R <= 16 (reduce16's inputs).
constexpr int streams(int mt) { return mt >= 8 ? 2 : 1; }
constexpr int ksplit(int mt) { return mt <= 4 ? 2 : 1; }
constexpr int rows_per_tile(int mt) { return 16 / mt / streams(mt) * streams(mt); }

using pagoda_cpu_simd::reduce16;  // cpu_reduce16.h

inline __m512bh load_bh(const uint16_t* p, __mmask32 m) {  // all ones: a plain load
  return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}

// c[m][s] += the lane products of x row m and W row w[s] over the chunk [k, k + 32) of
// K (the lanes of `mask`, zero elsewhere).
template <int MT, int S>
__attribute__((always_inline)) inline void chunk(__m512 (&c)[MT][S], const uint16_t* x,
                                                 int64_t ldx, const uint16_t* const* w,
                                                 int64_t k, __mmask32 mask) {
  __m512bh xv[MT];
  for (int m = 0; m < MT; ++m) xv[m] = load_bh(x + m * ldx + k, mask);
  for (int s = 0; s < S; ++s) {
    const __m512bh wv = load_bh(w[s] + k, mask);
    for (int m = 0; m < MT; ++m) c[m][s] = _mm512_dpbf16_ps(c[m][s], xv[m], wv);
  }
}

// Rows [n0, n1) of the output for x rows [m0, m0 + MT).
template <int MT>
void tile_rows(const Args& a, int64_t m0, int64_t n0, int64_t n1, int64_t pf_end) {
  constexpr int S = streams(MT), KS = ksplit(MT), R = rows_per_tile(MT);
  static_assert(R > 0 && MT * R <= 16 && R % S == 0, "at most 16 accumulators");
  const int64_t K = a.K, k_full = K & ~int64_t{31};
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (K - k_full)) - 1);
  const uint16_t* x = a.x + m0 * a.ldx;
  // prefetch the same place pf_rows rows further on, while those stay in the thread's range
  const int64_t pf_rows = std::max<int64_t>(1, kPrefetchBytes / (std::max<int64_t>(K, 1) * 2));
  const int64_t pf_off = pf_rows * K;
  for (int64_t n = n0; n < n1; n += R) {
    const int64_t nr = std::min<int64_t>(R, n1 - n);
    const bool pf = n + pf_rows + R <= pf_end;
    __m512 acc[16];  // [m * R + r]; the lanes past MT * R stay zero
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int g = 0; g < R; g += S) {  // S rows at a time, their accumulators in registers
      const uint16_t* w[S];  // a short last tile repeats its last row (results dropped)
      for (int s = 0; s < S; ++s) w[s] = a.w + (n + std::min<int64_t>(g + s, nr - 1)) * K;
      __m512 c[KS][MT][S];
      for (int j = 0; j < KS; ++j)
        for (int m = 0; m < MT; ++m)
          for (int s = 0; s < S; ++s) c[j][m][s] = _mm512_setzero_ps();
      int64_t k = 0;
      for (; k + 32 * KS <= k_full; k += 32 * KS) {
#pragma GCC unroll 8
        for (int j = 0; j < KS; ++j) {
          if (pf)
            for (int s = 0; s < S; ++s) __builtin_prefetch(w[s] + pf_off + k + 32 * j, 0, 3);
          chunk<MT, S>(c[j], x, a.ldx, w, k + 32 * j, ~__mmask32{0});
        }
      }
      for (; k < k_full; k += 32) {  // fewer than KS chunks left
        if (pf)
          for (int s = 0; s < S; ++s) __builtin_prefetch(w[s] + pf_off + k, 0, 3);
        chunk<MT, S>(c[0], x, a.ldx, w, k, ~__mmask32{0});
      }
      if (tail) chunk<MT, S>(c[KS - 1], x, a.ldx, w, k_full, tail);
      for (int m = 0; m < MT; ++m)
        for (int s = 0; s < S; ++s) {
          __m512 sum = c[0][m][s];
          for (int j = 1; j < KS; ++j) sum = _mm512_add_ps(sum, c[j][m][s]);
          acc[m * R + g + s] = sum;
        }
    }
    alignas(64) float sums[16];
    _mm512_store_ps(sums, reduce16(acc));
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < nr; ++r) store_out(a, m0 + m, n + r, sums[m * R + r]);
  }
}
#else
// Portable: x widened to fp32 once; per W row, a vector of V fp32 lane sums for each of
// the MT x rows (U of them over successive chunks when MT is small, to hide the FMA
// latency), each V-element W chunk widened once for all MT rows. Written with GCC /
// Clang vector types, which any target lowers (V: one register's worth): as plain
// loops, the compiler's choice between vectorising along K and across the MT rows (with
// gathers) swung the speed by 10x from one tile size to the next.
#if defined(__AVX512F__)
constexpr int V = 16;
#elif defined(__AVX__)
constexpr int V = 8;
#else
constexpr int V = 4;  // SSE, NEON
#endif
typedef float f32xV __attribute__((vector_size(4 * V)));
typedef uint16_t u16xV __attribute__((vector_size(2 * V)));
typedef uint32_t u32xV __attribute__((vector_size(4 * V)));

inline f32xV load_v(const float* p) {
  f32xV v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline f32xV widen_v(const uint16_t* p) {  // V bf16 -> fp32: the top halves of the words
  u16xV h;
  std::memcpy(&h, p, sizeof h);
  return (f32xV)(__builtin_convertvector(h, u32xV) << 16);
}

template <int MT>
void tile_rows(const Args& a, int64_t m0, int64_t n0, int64_t n1, int64_t) {
  constexpr int U = MT <= 2 ? 4 : MT <= 4 ? 2 : 1;  // U * MT <= 8 vector sums
  const int64_t K = a.K, k_full = K / (V * U) * (V * U);
  std::vector<float> xf(MT * K);
  for (int m = 0; m < MT; ++m)
    for (int64_t k = 0; k < K; ++k) xf[m * K + k] = to_f32(a.x[(m0 + m) * a.ldx + k]);
  const float* x = xf.data();
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* w = a.w + n * K;
    f32xV acc[U][MT] = {};
    for (int64_t k = 0; k < k_full; k += V * U)
      for (int u = 0; u < U; ++u) {
        const f32xV wv = widen_v(w + k + V * u);
        for (int m = 0; m < MT; ++m) acc[u][m] += load_v(x + m * K + k + V * u) * wv;
      }
    for (int m = 0; m < MT; ++m) {
      f32xV v = acc[0][m];
      for (int u = 1; u < U; ++u) v += acc[u][m];
      float t[V];  // the lanes summed in a tree: vector adds while the halves are wide
      std::memcpy(t, &v, sizeof t);
      for (int half = V / 2; half >= 1; half /= 2)
        for (int l = 0; l < half; ++l) t[l] += t[l + half];
      float sum = t[0];
      for (int64_t k = k_full; k < K; ++k) sum += x[m * K + k] * to_f32(w[k]);
      store_out(a, m0 + m, n, sum);
    }
  }
}
#endif

// Every x row over W rows [n0, n1), in tiles of up to kMaxM x rows.
void run_rows(const Args& a, int64_t n0, int64_t n1, int64_t pf_end) {
  for (int64_t m0 = 0; m0 < a.M; m0 += kMaxM) {
    switch (std::min<int64_t>(kMaxM, a.M - m0)) {
      case 1: tile_rows<1>(a, m0, n0, n1, pf_end); break;
      case 2: tile_rows<2>(a, m0, n0, n1, pf_end); break;
      case 3: tile_rows<3>(a, m0, n0, n1, pf_end); break;
      case 4: tile_rows<4>(a, m0, n0, n1, pf_end); break;
      case 5: tile_rows<5>(a, m0, n0, n1, pf_end); break;
      case 6: tile_rows<6>(a, m0, n0, n1, pf_end); break;
      case 7: tile_rows<7>(a, m0, n0, n1, pf_end); break;
      default: tile_rows<8>(a, m0, n0, n1, pf_end); break;
    }
  }
}

void check_cpu_bf16(const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), what, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK_VALUE(t.scalar_type() == at::kBFloat16, what, " must be bfloat16, got ",
                    t.scalar_type());
}

at::Tensor linear_bf16(const at::Tensor& x_in, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias_in) {
  check_cpu_bf16(x_in, "x");
  check_cpu_bf16(weight, "weight");
  TORCH_CHECK_VALUE(x_in.dim() == 2, "x must be [M, K], got ", x_in.sizes());
  TORCH_CHECK_VALUE(weight.dim() == 2, "weight must be [N, K], got ", weight.sizes());
  TORCH_CHECK_VALUE(weight.size(1) == x_in.size(1), "weight ", weight.sizes(),
                    " does not match x ", x_in.sizes(), " (K)");
  TORCH_CHECK_VALUE(weight.is_contiguous(), "weight must be contiguous, got strides ",
                    weight.strides());
  const int64_t M = x_in.size(0), K = x_in.size(1), N = weight.size(0);
  at::Tensor bias;
  if (bias_in.has_value()) {
    check_cpu_bf16(*bias_in, "bias");
    TORCH_CHECK_VALUE(bias_in->dim() == 1 && bias_in->size(0) == N, "bias must be [", N,
                      "], got ", bias_in->sizes());
    bias = bias_in->contiguous();
  }
  // rows of x may be any distance apart (a slice); the elements of a row are adjacent
  const at::Tensor x = x_in.stride(1) == 1 || K <= 1 ? x_in : x_in.contiguous();
  at::Tensor out = at::empty({M, N}, x_in.options());
  if (M == 0 || N == 0) return out;
  const Args a{static_cast<const uint16_t*>(x.const_data_ptr()),
               static_cast<const uint16_t*>(weight.const_data_ptr()),
               bias.defined() ? static_cast<const uint16_t*>(bias.const_data_ptr()) : nullptr,
               static_cast<uint16_t*>(out.mutable_data_ptr()), M, N, K, x.stride(0)};
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  const int64_t tile_bytes = kTileRows * std::max<int64_t>(K, 1) * 2;
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerThread / tile_bytes);
  const int64_t block = M > kMaxM ? std::max<int64_t>(1, kBlockBytes / tile_bytes) : tiles;
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t += block) {
      const int64_t n0 = t * kTileRows, n1 = std::min(N, std::min(end, t + block) * kTileRows);
      run_rows(a, n0, n1, std::min(N, end * kTileRows));
    }
  });
  return out;
}

bool uses_avx512_bf16() {
#ifdef PAGODA_GEMV_BF16
  return true;
#else
  return false;
#endif
}

}  // namespace

// The namespace is a macro so a variant build (tests of the portable path) registers apart.
#define PAGODA_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
PAGODA_LIBRARY(PAGODA_OP_NS, m) {
  m.def("linear_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &linear_bf16);
  m.def("uses_avx512_bf16() -> bool", &uses_avx512_bf16);
}
