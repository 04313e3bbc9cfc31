// Packed-weight GEMM for the CPU linears: y = x @ W.T (+ bias), x [M, K], W [N, K], in
// bf16 (AVX512-BF16 vdpbf16ps, fp32 accumulators) or fp32 (AVX-512 FMA), and both on
// AVX2 + FMA machines with 256-bit tiles (below).
//
// Built at runtime by kernels/cpu_gemm.py (load_inline, -O3 -march=native, torch's
// OpenMP pool) and registered as torch.ops.<PAGODA_OP_NS>.{pack, linear, pack_gated,
// linear_silu, simd_dtypes}. Why not
// oneDNN: at the row counts of a decode step (16-128 rows) its packed linear runs
// SmolLM2's shapes at 44-71 % of the machine's bf16 peak (kernels/bench_linear.py). With so
// few rows a linear sits near the balance of weight reads and FMAs, so it needs both at
// once: the weight read exactly once, as one prefetched sequential stream per thread,
// while every FMA unit is busy.
//
// Layout (pack): W is cut into panels of kNR = 48 output columns (three zmm of 16 fp32
// lanes); a panel is Ks = ceil(K / D) steps, each step the D consecutive K elements of
// its 48 columns, column-major within the step (bf16: D = 2, the pair vdpbf16ps adds
// into one lane; fp32: D = 1). So a step is 192 bytes (three cache lines) in both dtypes
// and a panel is one contiguous run; columns past N and K elements past K are zero.
// The AVX2 tiles (split_panels()) store a panel instead as its three runs of kRunCols =
// 16 columns one after another, each over all Ks steps ([P, 3, Ks, 16 D], the same size):
// a 16-column pass of the 6-row fp32 tile then reads one sequential stream instead of
// every third line of the panel, which on a Zen 3 EPYC held the tiles at ~77 % of the FMA
// peak (~97 % on runs, a standalone tile at SmolLM2's shapes), and a 1-row tile's three
// streams read the weights ~20 % faster from DRAM than one.
//
// Work: the panels are split into contiguous ranges over torch's pool (the AVX2 tiles, up
// to kDealMaxRows rows: dealt in chunks through a counter, deal_chunks). A thread takes x
// in blocks of kMBlock rows (L2-resident) and, per panel, runs register tiles of kMR = 8
// rows x 48 columns (24 accumulators) over all of K: per step, three loads of the panel
// and one broadcast per x row (a bf16 pair or an fp32 element), 3 * MR FMAs. The panel
// is read from DRAM by the first tile and from L1/L2 by the rest. While tile t of a
// panel runs it prefetches its share of the next panel, so the next panel's DRAM read is
// spread over all the FMAs of this one.
//
// Numerics: each output is an fp32 sum of exact products (bf16: vdpbf16ps flushes
// denormal inputs and results to zero), plus the bias in fp32, rounded once to the
// output dtype (bf16: nearest even). The summation order is the K order within each
// lane; it is not torch's, so an output may differ from F.linear on fp32 copies by a
// bf16 ulp where the sum sits near a tie, or by fp32 rounding.
//
// Without AVX-512 (or bf16 without AVX512-BF16), AVX2 + FMA machines run tiles of ymm
// registers over the same panels, bf16 widened to fp32 in registers or, from 32 rows, a
// panel at a time (tile_avx2 and what precedes it). PAGODA_NO_AVX512 builds that path on
// an AVX-512 machine (tests). Without AVX2, or with PAGODA_PORTABLE (which tests use to
// build the fallback anywhere), plain loops over the same layout run instead: correct,
// slow, and the caller (services/worker/layers/linear.py) then keeps oneDNN
// (simd_dtypes() says which dtypes have a vector path, tile_paths() which). Inputs are
// checked here (ValueError).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_scalar.h"
#include "cpu_silu.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    !defined(PAGODA_PORTABLE) && !defined(PAGODA_NO_AVX512)
#define PAGODA_GEMM_AVX512 1
#include <immintrin.h>
#if defined(__AVX512BF16__)
#define PAGODA_GEMM_BF16 1
#else
// AVX-512 without BF16 (Ice Lake class; tests build it anywhere with -mno-avx512bf16):
// bf16 panels widened to fp32 in the tiles
#define PAGODA_GEMM_BF16_WIDEN 1
#endif
#endif
// 256-bit tiles: the whole kernel on AVX2 machines, and bf16 on AVX-512 without BF16
#if defined(__AVX2__) && defined(__FMA__) && !defined(PAGODA_PORTABLE)
#define PAGODA_GEMM_AVX2 1
#include <immintrin.h>
#endif

#ifndef PAGODA_OP_NS
#define PAGODA_OP_NS pagoda_cpu_gemm
#endif

namespace {

using namespace pagoda_cpu_scalar;
using pagoda_cpu_silu::silu_bf16_table;
using pagoda_cpu_silu::silu_rounded;
#if defined(__AVX2__) && !defined(PAGODA_PORTABLE)
using pagoda_cpu_silu::silu_f32x8;
#endif

constexpr int kNR = 48;              // output columns per panel (three 16-lane vectors)
constexpr int kVecs = kNR / 16;
constexpr int kMR = 8;               // x rows per register tile: 8 x 3 = 24 accumulators
constexpr int64_t kStepBytes = 192;  // one step of a panel, both dtypes
constexpr int kRunCols = 16;         // columns of a run of a split panel (see the layout)
constexpr int64_t kLine = 64;
// x rows a thread takes across all its panels before the next block: 256 rows of K =
// 1536 bf16 are 768 KB, within the 1-2 MB L2 of the build machines.
constexpr int64_t kMBlock = 256;

template <class T>
constexpr int depth() {  // K elements per step
  return sizeof(T) == 2 ? 2 : 1;
}

template <class T>
struct Args {
  const T* x;        // [M, Kp], rows ldx apart, zero past K
  const T* packed;   // [P, Ks, kNR * D]
  const T* bias;     // [N] (gated: [2 N], the gate's then the up's) or nullptr
  T* out;            // [M, N] contiguous
  int64_t M, N, Ks, ldx;
  // The panels come in (gate, up) pairs (pack_gated) and out = silu(gate) * up, N the
  // intermediate size; else out = x W^T + bias.
  bool gated;
  // The 256-bit bf16 tiles' x, widened to fp32 once per call ([M, 2 Ks], rows ldxf
  // apart); unused elsewhere.
  const float* xf = nullptr;
  int64_t ldxf = 0;
  // The panel group this thread reads after its range (-1: none, or the one past it):
  // the range's last group prefetches it.
  int64_t after = -1;
};

// Whether this build's tiles of T read x widened to fp32 (Args::xf): bf16 without a bf16
// dot product, on the AVX-512 widening tiles or the AVX2 ones
template <class T>
constexpr bool widened_x() {
#if defined(PAGODA_GEMM_BF16_WIDEN) || (defined(PAGODA_GEMM_AVX2) && !defined(PAGODA_GEMM_BF16))
  return sizeof(T) == 2;
#else
  return false;
#endif
}

// What a tile does with its sums: store them; or, of a gated pair, keep the gate's
// (rounded as torch stores gate_up) for the up tile, which stores silu(gate) * up.
enum class Epilogue { kStore, kGate, kSiluUp };

constexpr int group_panels(bool gated) { return gated ? 2 : 1; }

// The bias of the kNR columns from n0 (gated: of the gate or the up half), zero past N.
template <class T>
void bias_columns(const Args<T>& a, int64_t n0, Epilogue e, float (&out)[kNR]) {
  const T* bias = a.bias ? a.bias + (e == Epilogue::kSiluUp ? a.N : 0) : nullptr;
  for (int c = 0; c < kNR; ++c) out[c] = bias && n0 + c < a.N ? to_f32(bias[n0 + c]) : 0.0f;
}

// The gated epilogues on fp32 sums (bias not yet added) of rows [m0, m0 + rows) x the
// kNR columns from n0: kGate keeps rounded<T>(sum + bias) in gate; kSiluUp stores
// silu(gate) * rounded<T>(up + bias) as cpu_fused's silu_mul does (the same bits).
template <class T>
void gated_epilogue(const Args<T>& a, Epilogue e, int64_t m0, int rows, int64_t n0,
                    const float (*sums)[kNR], float (*gate)[kNR]) {
  float bias[kNR];
  bias_columns(a, n0, e, bias);
  const int64_t cols = std::min<int64_t>(kNR, a.N - n0);
  for (int m = 0; m < rows; ++m) {
    if (e == Epilogue::kGate) {
#pragma omp simd
      for (int c = 0; c < kNR; ++c) gate[m][c] = rounded<T>(sums[m][c] + bias[c]);
      continue;
    }
    T* out = a.out + (m0 + m) * a.N + n0;
    if constexpr (sizeof(T) == 4) {
      int64_t c = 0;
#if defined(__AVX2__) && !defined(PAGODA_PORTABLE)
      for (; c + 8 <= cols; c += 8)
        _mm256_storeu_ps(out + c, _mm256_mul_ps(silu_f32x8(_mm256_loadu_ps(&gate[m][c])),
                                                _mm256_add_ps(_mm256_loadu_ps(&sums[m][c]),
                                                              _mm256_loadu_ps(&bias[c]))));
#endif
      for (; c < cols; ++c)
        store(silu_rounded<T>(gate[m][c]) * (sums[m][c] + bias[c]), out + c);
    } else {
      const float* table = silu_bf16_table();
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) {
        const uint32_t bits = __builtin_bit_cast(uint32_t, gate[m][c]) >> 16;
        store(table[bits] * rounded<T>(sums[m][c] + bias[c]), out + c);
      }
    }
  }
}

// The plain epilogue on fp32 sums (bias not yet added) of rows [m0, m0 + rows) x the kNR
// columns from n0: out = rounded(sum + bias), the columns past N dropped.
template <class T>
void store_epilogue(const Args<T>& a, int64_t m0, int rows, int64_t n0,
                    const float (*sums)[kNR]) {
  float bias[kNR];
  bias_columns(a, n0, Epilogue::kStore, bias);
  const int64_t cols = std::min<int64_t>(kNR, a.N - n0);
  for (int m = 0; m < rows; ++m) {
    T* out = a.out + (m0 + m) * a.N + n0;
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) store(sums[m][c] + bias[c], out + c);
  }
}

#if defined(PAGODA_GEMM_AVX512) || defined(PAGODA_GEMM_AVX2)
// Up to this many tiles of a block of rows (the 6-row AVX2 tiles, fp32 and widened bf16:
// a decode step's 19-72 rows) spread the next group's prefetch over all of them. From the
// fourth tile on the old split (the first three tiles a line a step) left the rest none,
// and the burst of a line every 6-cycle step filled the miss buffers: the prefetch
// instruction and the panel's loads stalled (perf). One A/B process on the Zen 3 box,
// SmolLM2's linears at 54 rows, weights from DRAM, over three runs: fp32 qkv / o /
// gate_up / down 1.02-1.11 / 1.04-1.12 / 1.00-1.03 / 1.01-1.08x, bf16 1.04-1.06 /
// 1.02-1.05 / 0.99-1.03 / 1.02x; a whole batch-54 step bf16 1.016x, fp32 level. At 256
// rows (43 tiles) it measured 0.97-1.00x and the 2-row bf16 tiles (8-24 rows) 0.96-0.99x:
// those keep the old split.
// The AVX-512 fp32 tiles (8 rows) spread from 5 tiles (33-96 rows): on an Ice Lake class
// Xeon (AVX-512, one A/B process alternating per model step, SmolLM2's linears, weights
// from DRAM) the whole step's linears ran 1.07-1.10x faster at 48-64 rows, 1.02x at 40
// and 96, and 0.96-0.98x at 32 rows (4 tiles, which keep the old split); the widened
// bf16 tiles measured level (0.99-1.00x at 54 and 64 rows) and keep it.
constexpr int64_t kSpreadMaxTiles = 12;
constexpr int64_t kAvx512SpreadMinTiles = 5;

// Panel groups [q0, q1) (a panel, or a gated pair) for every row of x, in register tiles
// of up to MaxRows rows: tile(m0, rows, panel, pf, pf_end, lines, gate, epilogue) runs
// one (epilogue: a std::integral_constant<Epilogue, E>) and prefetches its share of the
// next group, [pf, pf_end), `lines` lines a step. prepare(q) runs before the tiles of
// group q in each block of rows.
// lone_tile_lines: how many lines a step a lone tile (x of at most MaxRows rows)
// prefetches of the next group (kVecs: as many as reach its end; 0: none).
// spread_min_tiles (0: never): with at least that many and at most kSpreadMaxTiles tiles,
// every tile prefetches an equal share of the next group, spread evenly over its first
// pass (`lines` 0 says so), instead of the first tiles a line a step.
// quiet_max_tiles: with more than one and at most this many tiles, none prefetches the
// next group (the hardware prefetcher follows the stream, as for a lone tile).
template <class T, int MaxRows, class Tile, class Prepare>
void run_panel_tiles(const Args<T>& a, int64_t q0, int64_t q1, Tile tile, Prepare prepare,
                     int lone_tile_lines = kVecs, int64_t spread_min_tiles = 0,
                     int64_t quiet_max_tiles = 0) {
  const int G = group_panels(a.gated);
  const int64_t group_bytes = G * a.Ks * kStepBytes;
  const char* base = reinterpret_cast<const char*>(a.packed);
  alignas(64) float gate[MaxRows][kNR];
  for (int64_t mb = 0; mb < a.M; mb += kMBlock) {
    const int64_t rows = std::min(kMBlock, a.M - mb);
    const int64_t tiles = (rows + MaxRows - 1) / MaxRows;
    const bool spread_here =
        spread_min_tiles > 0 && tiles >= spread_min_tiles && tiles <= kSpreadMaxTiles;
    // the next group's G * 3 * Ks lines over G * tiles calls of Ks steps
    const int lines = tiles == 1    ? lone_tile_lines
                      : spread_here ? 0
                                    : static_cast<int>(std::max<int64_t>(1, (kVecs + tiles - 1) / tiles));
    const bool quiet = tiles > 1 && tiles <= quiet_max_tiles;
    const int64_t share = quiet         ? 0
                          : spread_here ? (kVecs * a.Ks + tiles - 1) / tiles * kLine
                                        : static_cast<int64_t>(lines) * a.Ks * kLine;  // bytes per call
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t nq = q + 1 < q1 ? q + 1 : a.after;  // the group read next, -1: none
      const char* next = base + std::max<int64_t>(nq, 0) * group_bytes;
      const char* next_end = nq >= 0 ? next + group_bytes : next;
      prepare(q);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t m0 = mb + t * MaxRows;
        const int mr = static_cast<int>(std::min<int64_t>(MaxRows, rows - t * MaxRows));
        for (int g = 0; g < G; ++g) {
          const char* pf = next + (t * G + g) * share;
          const char* pf_end = std::min(next_end, pf + share);
          if (!a.gated)
            tile(m0, mr, q, pf, pf_end, lines, gate,
                 std::integral_constant<Epilogue, Epilogue::kStore>{});
          else if (g == 0)
            tile(m0, mr, 2 * q, pf, pf_end, lines, gate,
                 std::integral_constant<Epilogue, Epilogue::kGate>{});
          else
            tile(m0, mr, 2 * q + 1, pf, pf_end, lines, gate,
                 std::integral_constant<Epilogue, Epilogue::kSiluUp>{});
        }
      }
    }
  }
}

// How many of a tile's Ks steps prefetch lines_per_step lines of [pf, pf_end).
inline int64_t prefetch_steps(int64_t Ks, const char* pf, const char* pf_end,
                              int lines_per_step) {
  if (pf >= pf_end) return 0;
  return std::min<int64_t>(Ks, (pf_end - pf + kLine * lines_per_step - 1) /
                                   (kLine * lines_per_step));
}

// Hint: _MM_HINT_T0 (into L1) for the AVX-512 tiles; the AVX2 tiles take _MM_HINT_T1
// (into L2): on a Zen 3 EPYC the lines prefetched into L1 a panel ahead evicted the
// panel in use, and T1 streamed 5-6 % more bytes a second at 1-4 rows.
template <int Hint = _MM_HINT_T0>
inline void prefetch_step(const char* pf, const char* pf_end, int64_t s, int lines_per_step) {
  for (int l = 0; l < lines_per_step; ++l) {
    const char* p = pf + (s * lines_per_step + l) * kLine;
    if (p < pf_end) _mm_prefetch(p, static_cast<_mm_hint>(Hint));
  }
}

// The spread prefetch (see kSpreadMaxTiles): the lines [pf, pf_end) into L2, one every
// `stride` of the tile's first steps, step(s) running the steps between; returns how
// many steps ran (the caller runs the rest).
template <class Step>
__attribute__((always_inline)) inline int64_t spread_prefetch(const char* pf,
                                                              const char* pf_end,
                                                              int64_t steps, Step step) {
  int64_t s = 0;
  if (pf >= pf_end) return s;
  const int64_t lines = (pf_end - pf + kLine - 1) / kLine;
  const int64_t stride = std::max<int64_t>(1, steps / lines);
  const char* p = pf;
  for (int64_t l = 0; l < lines && s + stride <= steps; ++l, p += kLine) {
    _mm_prefetch(p, _MM_HINT_T1);
    for (const int64_t e = s + stride; s < e; ++s) step(s);
  }
  return s;
}
#endif

#ifdef PAGODA_GEMM_AVX512
// acc[m][v] += x[m, step s] * panel[s][v] for the MR rows of a tile (bf16: a pair a lane)
template <int MR>
__attribute__((always_inline)) inline void step_f32(__m512 (&acc)[MR][kVecs], const float* x,
                                                    int64_t ldx, const float* b, int64_t s) {
  const float* bs = b + s * kNR;
  __m512 w[kVecs];
  for (int v = 0; v < kVecs; ++v) w[v] = _mm512_loadu_ps(bs + 16 * v);
  for (int m = 0; m < MR; ++m) {
    const __m512 xv = _mm512_set1_ps(x[m * ldx + s]);
    for (int v = 0; v < kVecs; ++v) acc[m][v] = _mm512_fmadd_ps(xv, w[v], acc[m][v]);
  }
}

#ifdef PAGODA_GEMM_BF16
template <int MR>
__attribute__((always_inline)) inline void step_bf16(__m512 (&acc)[MR][kVecs],
                                                     const uint16_t* x, int64_t ldx,
                                                     const uint16_t* b, int64_t s) {
  const uint16_t* bs = b + s * 2 * kNR;
  __m512bh w[kVecs];
  for (int v = 0; v < kVecs; ++v) w[v] = (__m512bh)_mm512_loadu_si512(bs + 32 * v);
  for (int m = 0; m < MR; ++m) {
    int32_t pair;
    std::memcpy(&pair, x + m * ldx + 2 * s, sizeof pair);
    const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
    for (int v = 0; v < kVecs; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xv, w[v]);
  }
}
#endif

#ifdef PAGODA_GEMM_BF16_WIDEN
// The same pair layout without a bf16 dot product: each 32-bit pair (k, k + 1) of a
// column is widened in registers (the low word shifted up is k's weight, the high word
// masked is k + 1's) and multiplied by x widened to fp32 once per call (Args::xf): every
// product exact in fp32, each lane summed in K order, as the 256-bit tiles do. A step's
// six widened weight vectors, a row's two broadcasts and 8 rows' 24 accumulators take
// the 32 zmm registers: against widening one weight vector at a time and broadcasting x
// per FMA (load-port bound), SmolLM2's linears ran 1.43-1.53x faster at 54 and 256 rows
// and 1.18-1.28x at 8 on an Ice Lake class Xeon (one A/B process); the whole model step
// 2.9-4.1x oneDNN's emulated bf16 from 8 rows. With the odd words masked by a vpandd of
// a zmm constant GCC spilled accumulators in the step loop (33 live zmm); a word-masked
// move takes a k register instead: 1.09x at 54 and 256 rows, 1.02x at 1-8.
template <int MR>
__attribute__((always_inline)) inline void step_bf16_widen(__m512 (&acc)[MR][kVecs],
                                                           const float* x, int64_t ldx,
                                                           const uint16_t* b, int64_t s) {
  const uint16_t* bs = b + s * 2 * kNR;
  __m512 w0[kVecs], w1[kVecs];
  for (int v = 0; v < kVecs; ++v) {
    const __m512i pairs = _mm512_loadu_si512(bs + 32 * v);
    w0[v] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    // the high words kept by a word mask (a k register, not a zmm constant: 32 zmm are taken)
    w1[v] = _mm512_castsi512_ps(_mm512_maskz_mov_epi16(0xAAAAAAAAu, pairs));
  }
  for (int m = 0; m < MR; ++m) {
    const float* xm = x + m * ldx + 2 * s;
    const __m512 x0 = _mm512_set1_ps(xm[0]), x1 = _mm512_set1_ps(xm[1]);
    for (int v = 0; v < kVecs; ++v) {
      acc[m][v] = _mm512_fmadd_ps(x0, w0[v], acc[m][v]);
      acc[m][v] = _mm512_fmadd_ps(x1, w1[v], acc[m][v]);
    }
  }
}
#endif

// X: float for fp32 and for widened bf16 (x from Args::xf), else T
template <class T, int MR, class X>
__attribute__((always_inline)) inline void do_step(__m512 (&acc)[MR][kVecs], const X* x,
                                                   int64_t ldx, const T* b, int64_t s) {
  if constexpr (sizeof(T) == 4) {
    step_f32<MR>(acc, x, ldx, b, s);
  } else {
#ifdef PAGODA_GEMM_BF16
    step_bf16<MR>(acc, x, ldx, b, s);
#endif
#ifdef PAGODA_GEMM_BF16_WIDEN
    step_bf16_widen<MR>(acc, x, ldx, b, s);
#endif
  }
}

inline __m512 load_bias(const float* bias, int64_t n, __mmask16 mask) {
  return _mm512_maskz_loadu_ps(mask, bias + n);
}
inline void store_vec(float* out, __m512 v, __mmask16 mask) {
  _mm512_mask_storeu_ps(out, mask, v);
}
#ifdef PAGODA_GEMM_BF16  // bf16 tiles are built only with the bf16 vector path
inline __m512 load_bias(const uint16_t* bias, int64_t n, __mmask16 mask) {
  const __m256i h = _mm256_maskz_loadu_epi16(mask, bias + n);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store_vec(uint16_t* out, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(out, mask, (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

// Rows [m0, m0 + MR) x the 48 columns of one panel, over all Ks steps; prefetches the
// lines [pf, pf_end) of the next panel, lines_per_step of them a step (0: spread evenly
// over the steps, into L2 as the AVX2 tiles do; see kSpreadMaxTiles).
template <class T, int MR, Epilogue E>
void tile(const Args<T>& a, int64_t m0, int64_t panel, const char* pf, const char* pf_end,
          int lines_per_step, float (*gate)[kNR]) {
  const T* b = a.packed + panel * a.Ks * kNR * depth<T>();
  using X = std::conditional_t<widened_x<T>(), float, T>;
  const X* x;
  int64_t ldx;
  if constexpr (widened_x<T>()) {
    x = a.xf + m0 * a.ldxf;
    ldx = a.ldxf;
  } else {
    x = a.x + m0 * a.ldx;
    ldx = a.ldx;
  }
  __m512 acc[MR][kVecs];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVecs; ++v) acc[m][v] = _mm512_setzero_ps();
  int64_t s = 0;
  int64_t pf_steps = 0;
  if (lines_per_step == 0) {
    s = spread_prefetch(pf, pf_end, a.Ks, [&](int64_t k) __attribute__((always_inline)) {
      do_step<T, MR>(acc, x, ldx, b, k);
    });
  } else {
    pf_steps = prefetch_steps(a.Ks, pf, pf_end, lines_per_step);
  }
  // the prefetching part of the loop, then the rest without the bound check
  for (; s < pf_steps; ++s) {
    prefetch_step(pf, pf_end, s, lines_per_step);
    do_step<T, MR>(acc, x, ldx, b, s);
  }
#pragma GCC unroll 2
  for (; s < a.Ks; ++s) {
    do_step<T, MR>(acc, x, ldx, b, s);
  }
  // the widened bf16 tiles round through the scalar epilogue (no vcvtneps2bf16 here)
  if constexpr (E != Epilogue::kStore || widened_x<T>()) {
    alignas(64) float sums[MR][kNR];
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < kVecs; ++v) _mm512_store_ps(&sums[m][16 * v], acc[m][v]);
    if constexpr (E == Epilogue::kStore) store_epilogue(a, m0, MR, panel * kNR, sums);
    else gated_epilogue(a, E, m0, MR, panel / 2 * kNR, sums, gate);
  } else {
    const int64_t n0 = panel * kNR;
    for (int v = 0; v < kVecs; ++v) {
      const int64_t n = n0 + 16 * v, left = a.N - n;
      if (left <= 0) break;
      const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
      const __m512 bias = a.bias ? load_bias(a.bias, n, mask) : _mm512_setzero_ps();
      for (int m = 0; m < MR; ++m)
        store_vec(a.out + (m0 + m) * a.N + n, _mm512_add_ps(acc[m][v], bias), mask);
    }
  }
}

template <class T, Epilogue E>
void run_tile(const Args<T>& a, int64_t m0, int mr, int64_t panel, const char* pf,
              const char* pf_end, int lines, float (*gate)[kNR]) {
  switch (mr) {
    case 1: tile<T, 1, E>(a, m0, panel, pf, pf_end, lines, gate); break;
    case 2: tile<T, 2, E>(a, m0, panel, pf, pf_end, lines, gate); break;
    case 3: tile<T, 3, E>(a, m0, panel, pf, pf_end, lines, gate); break;
    case 4: tile<T, 4, E>(a, m0, panel, pf, pf_end, lines, gate); break;
    case 5: tile<T, 5, E>(a, m0, panel, pf, pf_end, lines, gate); break;
    case 6: tile<T, 6, E>(a, m0, panel, pf, pf_end, lines, gate); break;
    case 7: tile<T, 7, E>(a, m0, panel, pf, pf_end, lines, gate); break;
    default: tile<T, 8, E>(a, m0, panel, pf, pf_end, lines, gate); break;
  }
}

// How many lines a step a lone AVX-512 tile (x of at most kMR rows: a decode step of 1-8
// sequences) prefetches of the next group. On AMD none: Zen 4's hardware prefetcher
// follows the weight stream across the jump to the next panel, and prefetcht0 of three
// lines a step held the stream back (each occupies an L1 miss buffer until its line
// arrives). SmolLM2's linears, weights from DRAM, one A/B process per dtype and row
// count on a Zen 4 EPYC: bf16 1.02-1.15x at 1 row, 1.05x at 2, 1.10-1.11x at 4,
// 1.15-1.20x at 8; fp32 1.00-1.06x / 1.02x / 1.07-1.10x / 1.15-1.22x (as the AVX2 tiles
// found on Zen 3, kAvx2LoneTileLines). Elsewhere (Intel) all three lines, as before (not
// measured against none there); the tiles of more rows keep their prefetch on both
// (dropping it lost 6-7 % at 24 rows on the Zen 4).
inline int avx512_lone_tile_lines() {
  static const int lines = __builtin_cpu_is("amd") ? 0 : kVecs;
  return lines;
}

// Up to how many fp32 tiles (9-16 rows: two) prefetch nothing of the next group either,
// on AMD. The same Zen 4, one A/B process, SmolLM2's four linears a layer over 30 layers,
// weights from DRAM: fp32 1.15-1.19x at 9-10 rows, 1.25x at 12, 1.09x at 14, 1.07-1.13x
// at 16; three tiles without it lost (0.94x at 20 rows, 0.84x at 24), and bf16's two
// gained at 9-12 rows (1.07-1.10x) but lost at 16 (0.97x), so bf16 keeps its prefetch.
inline int64_t avx512_quiet_tiles(bool fp32) {
  static const bool amd = __builtin_cpu_is("amd");
  return amd && fp32 ? 2 : 0;
}

template <class T>
void run_panels_avx512(const Args<T>& a, int64_t q0, int64_t q1) {
  run_panel_tiles<T, kMR>(a, q0, q1, [&](int64_t m0, int mr, int64_t panel, const char* pf,
                                          const char* pf_end, int lines, float (*gate)[kNR],
                                          auto epilogue) {
    run_tile<T, decltype(epilogue)::value>(a, m0, mr, panel, pf, pf_end, lines, gate);
  }, [](int64_t) {}, avx512_lone_tile_lines(), sizeof(T) == 4 ? kAvx512SpreadMinTiles : 0,
     avx512_quiet_tiles(sizeof(T) == 4));
}
#endif

#ifdef PAGODA_GEMM_AVX2
// 256-bit tiles (AVX2 + FMA) over the same panels. Sixteen ymm registers hold an fp32
// tile of 5 or 6 rows x 16 columns (12 accumulators, the two weight vectors of a step
// and a broadcast), which covers its panel's 48 columns in three passes over K, the
// later ones reading the panel from L1/L2; or of 3 or 4 rows x 24 columns in two passes
// (three weight vectors). Per row the taller tile reads a third less of the panel from
// L2, which is what bounds these tiles: on a Zen 3 EPYC 6 x 16 ran SmolLM2's fp32
// linears 1-7 % and bf16's widened panels 0-6 % faster than 4 x 24 from 64 rows (A/B
// in one process). A tile of 1 or 2 rows takes all 48 columns in one pass
// (6 or 12 accumulators), since with so few FMAs a step the accumulators' dependency
// chains, not the FMA units, would set the pace of the weight stream. bf16 tiles are
// always of 1 or 2 rows in one pass: each weight vector is widened once per tile, and
// on a Zen 3 EPYC 2 x 48 tiles ran SmolLM2's bf16 linears 2-14 % faster than 4 x 24 at
// 4-64 rows (kernels/bench_linear.py), while in fp32 they ran at half the speed from
// 16 rows (the six weight vectors of a step no longer fit in registers). bf16 has no
// dot-product instruction here: each 32-bit pair (k, k + 1) of a column is widened in
// registers (the low word shifted up is k's weight, the high word masked is k + 1's), and
// x comes widened to fp32 once per call (Args::xf), so every product is exact in fp32
// and each lane sums in K order.
template <class T>
constexpr int avx2_max_rows() {
  return sizeof(T) == 2 ? 2 : 6;
}
constexpr int avx2_vectors(int rows) { return rows <= 2 ? kNR / 8 : rows <= 4 ? kNR / 16 : 2; }  // per pass

// The first element of each weight vector of pass h (8 columns from column 8 NV h + 8 v)
// at step 0 of a split panel of `steps` steps and depth D: in its run, kRunCols D elements
// a step.
template <int D, int NV, class E>
__attribute__((always_inline)) inline void run_pointers(const E* panel, int64_t steps, int h,
                                                        const E* (&out)[NV]) {
  for (int v = 0; v < NV; ++v) {
    const int c = h * 8 * NV + 8 * v;
    out[v] = panel + (c / kRunCols * steps * kRunCols + c % kRunCols) * D;
  }
}

// bp: run_pointers of the pass
template <int MR, int NV>
__attribute__((always_inline)) inline void step_f32_avx2(__m256 (&acc)[MR][NV], const float* x,
                                                         int64_t ldx, const float* const (&bp)[NV],
                                                         int64_t s) {
  __m256 w[NV];
  for (int v = 0; v < NV; ++v) w[v] = _mm256_loadu_ps(bp[v] + s * kRunCols);
  for (int m = 0; m < MR; ++m) {
    const __m256 xv = _mm256_broadcast_ss(x + m * ldx + s);
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_fmadd_ps(xv, w[v], acc[m][v]);
  }
}

// The 8 bf16 pairs (k, k + 1) of 8 columns widened to fp32 (exact): k's weights (the low
// words shifted up) and k + 1's (the high words, the low ones masked off).
__attribute__((always_inline)) inline void widen_pairs(__m256i pairs, __m256& k0, __m256& k1) {
  k0 = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
  k1 = _mm256_castsi256_ps(
      _mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

template <int MR, int NV>
__attribute__((always_inline)) inline void step_bf16_avx2(__m256 (&acc)[MR][NV], const float* x,
                                                          int64_t ldx,
                                                          const uint16_t* const (&bp)[NV],
                                                          int64_t s) {
  for (int v = 0; v < NV; ++v) {
    __m256 w0, w1;
    widen_pairs(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp[v] + s * 2 * kRunCols)),
                w0, w1);
    for (int m = 0; m < MR; ++m) {
      const float* xm = x + m * ldx + 2 * s;
      acc[m][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(xm), w0, acc[m][v]);
      acc[m][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(xm + 1), w1, acc[m][v]);
    }
  }
}

// Rows [m0, m0 + MR) x the 48 columns of one panel, in passes of 8 NV columns, the first
// prefetching the lines [pf, pf_end) of the next panel, lines_per_step a step (0: spread
// evenly over the pass; see kSpreadMaxTiles). Wide (bf16
// only): the panel was widened to fp32 first (`wide`: a split fp32 panel of 2 Ks steps),
// and fp32 tiles run on it.
template <class T, int MR, Epilogue E, bool Wide = false>
void tile_avx2(const Args<T>& a, int64_t m0, int64_t panel, const char* pf,
               const char* pf_end, int lines_per_step, float (*gate)[kNR],
               const float* wide = nullptr) {
  constexpr bool kF32 = sizeof(T) == 4 || Wide;
  constexpr int NV = avx2_vectors(MR), kPassCols = 8 * NV;
  const float* x;
  int64_t ldx;
  if constexpr (sizeof(T) == 4) {
    x = a.x + m0 * a.ldx;
    ldx = a.ldx;
  } else {
    x = a.xf + m0 * a.ldxf;
    ldx = a.ldxf;
  }
  const int64_t steps = Wide ? 2 * a.Ks : a.Ks;
  alignas(32) float sums[MR][kNR];
  for (int h = 0; h < kNR / kPassCols; ++h) {
    __m256 acc[MR][NV];
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_setzero_ps();
    // always_inline: GCC left the 6-row step an out-of-line call (its accumulators in
    // memory), at 40 % of the speed
    // the pass's weight pointers, computed once: inside the step GCC reloaded a.Ks and
    // rebuilt the address every iteration
    const float* bf[NV] = {};
    const uint16_t* bh[NV] = {};
    if constexpr (kF32)
      run_pointers<1>(Wide ? wide : reinterpret_cast<const float*>(a.packed) + panel * a.Ks * kNR,
                      steps, h, bf);
    else
      run_pointers<2>(a.packed + panel * a.Ks * kNR * 2, steps, h, bh);
    auto step = [&](int64_t s) __attribute__((always_inline)) {
      if constexpr (kF32) step_f32_avx2<MR, NV>(acc, x, ldx, bf, s);
      else step_bf16_avx2<MR, NV>(acc, x, ldx, bh, s);
    };
    int64_t s = 0;
    if (h == 0 && lines_per_step == 0) {
      s = spread_prefetch(pf, pf_end, steps, step);
    } else if (h == 0) {
      for (const int64_t n = prefetch_steps(steps, pf, pf_end, lines_per_step); s < n; ++s) {
        prefetch_step<_MM_HINT_T1>(pf, pf_end, s, lines_per_step);
        step(s);
      }
    }
#pragma GCC unroll 2
    for (; s < steps; ++s) step(s);
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < NV; ++v)
        _mm256_store_ps(&sums[m][h * kPassCols + 8 * v], acc[m][v]);
  }
  if constexpr (E == Epilogue::kStore) store_epilogue(a, m0, MR, panel * kNR, sums);
  else gated_epilogue(a, E, m0, MR, panel / 2 * kNR, sums, gate);
}

// The G split bf16 panels of group q widened into split fp32 panels of 2 Ks steps each,
// one after another: a step's pairs (k, k + 1) of 8 columns become 8 lanes of step 2 k and
// 8 of step 2 k + 1 in those columns' run. Both sides are read and written in order.
inline void widen_group(const Args<uint16_t>& a, int64_t q, float* wide) {
  const int G = group_panels(a.gated);
  const int64_t steps = 2 * a.Ks;
  const uint16_t* b = a.packed + q * G * a.Ks * kNR * 2;  // the group's panels are adjacent
  for (int64_t r = 0; r < G * kNR / kRunCols; ++r, b += a.Ks * 2 * kRunCols)  // runs
    for (int64_t s = 0; s < a.Ks; ++s)
      for (int v = 0; v < kRunCols / 8; ++v) {
        __m256 k0, k1;
        widen_pairs(_mm256_loadu_si256(
                        reinterpret_cast<const __m256i*>(b + s * 2 * kRunCols + 16 * v)),
                    k0, k1);
        float* out = wide + r * steps * kRunCols + 2 * s * kRunCols + 8 * v;
        _mm256_storeu_ps(out, k0);
        _mm256_storeu_ps(out + kRunCols, k1);
      }
}

// bf16 with at least this many rows widens each panel to fp32 once per block of rows and
// runs the fp32 tiles on it: widening in the tiles costs two ALU ops per weight vector per
// tile, a quarter of the tile's FMAs. On a Zen 3 EPYC (kernels/bench_linear.py) that ran
// SmolLM2's bf16 linears at 145-155 GFLOP/s from 64 rows (the 2 x 48 bf16 tiles: 115-124),
// level with them at 32 rows and slower below.
constexpr int64_t kWidenMinRows = 32;

// One AVX2 tile of mr rows (up to Wide ? 6 : avx2_max_rows<T>()), as tile_avx2.
template <class T, Epilogue E, bool Wide>
void run_tile_avx2(const Args<T>& a, int64_t m0, int mr, int64_t panel, const char* pf,
                   const char* pf_end, int lines, float (*gate)[kNR], const float* wide) {
  constexpr int max_rows = Wide ? 6 : avx2_max_rows<T>();
  if (mr == 1) return tile_avx2<T, 1, E, Wide>(a, m0, panel, pf, pf_end, lines, gate, wide);
  if (mr == 2 || max_rows == 2)
    return tile_avx2<T, 2, E, Wide>(a, m0, panel, pf, pf_end, lines, gate, wide);
  if constexpr (max_rows >= 4) {
    if (mr == 3) return tile_avx2<T, 3, E, Wide>(a, m0, panel, pf, pf_end, lines, gate, wide);
    if (mr == 4 || max_rows == 4) return tile_avx2<T, 4, E, Wide>(a, m0, panel, pf, pf_end, lines, gate, wide);
  }
  if constexpr (max_rows == 6) {
    if (mr == 5) return tile_avx2<T, 5, E, Wide>(a, m0, panel, pf, pf_end, lines, gate, wide);
    tile_avx2<T, 6, E, Wide>(a, m0, panel, pf, pf_end, lines, gate, wide);
  }
}

// A lone AVX2 tile (x of up to 2 rows in bf16, 6 in fp32) prefetches nothing of the next
// group: the hardware prefetcher follows the split panels' three streams across the jump,
// and on the Zen 3 EPYC one line a step of the next panel (what the interleaved layout
// needed) ran SmolLM2's fp32 linears at 1-2 rows 4-6 % slower, its bf16 ones level.
constexpr int kAvx2LoneTileLines = 0;

template <class T>
void run_panels_avx2(const Args<T>& a, int64_t q0, int64_t q1) {
  if constexpr (sizeof(T) == 2) {
    if (a.M >= kWidenMinRows) {
      // per thread, reused across calls: a panel group is ~100-600 KB, which malloc would
      // map and unmap (and fault in) on every call
      thread_local std::vector<float> wide;
      const int64_t panel_floats = 2 * a.Ks * kNR;
      const int64_t group_floats = group_panels(a.gated) * panel_floats;
      if (static_cast<int64_t>(wide.size()) < group_floats) wide.resize(group_floats);
      float* w = wide.data();
      run_panel_tiles<T, 6>(a, q0, q1, [&](int64_t m0, int mr, int64_t panel, const char* pf,
                                           const char* pf_end, int lines, float (*gate)[kNR],
                                           auto epilogue) {
        const float* pw = w + (a.gated ? panel % 2 : 0) * panel_floats;
        run_tile_avx2<T, decltype(epilogue)::value, true>(a, m0, mr, panel, pf, pf_end, lines,
                                                          gate, pw);
      }, [&](int64_t q) { widen_group(a, q, w); }, kVecs, true);
      return;
    }
  }
  run_panel_tiles<T, avx2_max_rows<T>()>(a, q0, q1, [&](int64_t m0, int mr, int64_t panel,
                                                        const char* pf, const char* pf_end,
                                                        int lines, float (*gate)[kNR],
                                                        auto epilogue) {
    run_tile_avx2<T, decltype(epilogue)::value, false>(a, m0, mr, panel, pf, pf_end, lines,
                                                       gate, nullptr);
  }, [](int64_t) {}, kAvx2LoneTileLines, avx2_max_rows<T>() == 6 ? kVecs + 1 : 0);
}
#endif

// Portable: the same packed layout and epilogues, plain loops (tests and machines without
// AVX-512).
template <class T>
void run_panels_portable(const Args<T>& a, int64_t q0, int64_t q1) {
  constexpr int D = depth<T>();
  const int G = group_panels(a.gated);
  float sums[1][kNR], gate[1][kNR];
  for (int64_t q = q0; q < q1; ++q)
    for (int64_t m = 0; m < a.M; ++m)
      for (int g = 0; g < G; ++g) {
        const int64_t panel = q * G + g;
        const T* b = a.packed + panel * a.Ks * kNR * D;
        const T* x = a.x + m * a.ldx;
        for (int c = 0; c < kNR; ++c) sums[0][c] = 0.0f;
        for (int64_t s = 0; s < a.Ks; ++s)
          for (int c = 0; c < kNR; ++c)
            for (int d = 0; d < D; ++d)
              sums[0][c] += to_f32(x[s * D + d]) * to_f32(b[(s * kNR + c) * D + d]);
        if (a.gated) {
          gated_epilogue(a, g == 0 ? Epilogue::kGate : Epilogue::kSiluUp, m, 1, q * kNR, sums,
                         gate);
          continue;
        }
        store_epilogue(a, m, 1, q * kNR, sums);
      }
}

// Which tiles run a dtype: AVX-512 (bf16: with AVX512-BF16), else AVX2, else portable.
enum class Path { kAvx512, kAvx2, kPortable };

template <class T>
constexpr Path path_for() {
#ifdef PAGODA_GEMM_AVX512
  if constexpr (sizeof(T) == 4) return Path::kAvx512;
#endif
#if defined(PAGODA_GEMM_BF16) || defined(PAGODA_GEMM_BF16_WIDEN)
  if constexpr (sizeof(T) == 2) return Path::kAvx512;
#endif
#ifdef PAGODA_GEMM_AVX2
  return Path::kAvx2;
#endif
  return Path::kPortable;
}

template <class T>
void run_panels(const Args<T>& a, int64_t q0, int64_t q1) {
  constexpr Path path = path_for<T>();
#ifdef PAGODA_GEMM_AVX512
  if constexpr (path == Path::kAvx512) return run_panels_avx512(a, q0, q1);
#endif
#ifdef PAGODA_GEMM_AVX2
  if constexpr (path == Path::kAvx2) return run_panels_avx2(a, q0, q1);
#endif
  if constexpr (path == Path::kPortable) run_panels_portable(a, q0, q1);
}

// Up to a decode step's rows the AVX2 tiles' panel groups are dealt in chunks through a
// counter instead of one contiguous half a thread: the thread that starts the region runs
// ahead of the one it wakes, the two cores' share of DRAM bandwidth differs from moment
// to moment, and under `pagoda serve` the frontends' and the scheduler's wake-ups take a
// core from one of the threads now and then; with fixed halves the other waited for it
// at the end of every linear, which at these rows lasts well under a millisecond. Each
// thread claims its next chunk before running this one, whose last group prefetches the
// next chunk's first. On the Zen 3 box (one-process A/B, weights from DRAM): SmolLM2's
// bf16 linears at 1 row +4 %; at 64-512 rows with another process taking ~1 ms every
// 8 ms (as a frontend does), fp32 and bf16 +3-5 %, and level (+-5 %) without it. A
// prefill chunk (2048 rows) keeps the halves: its linears are long enough that a
// stolen millisecond costs either way, and each chunk reads all of x again.
constexpr int64_t kDealMaxRows = 256;

template <class T>
void deal_chunks(const Args<T>& a, int64_t Q, int64_t threads) {
  const int64_t chunk = std::max<int64_t>(1, Q / (4 * threads));
  std::atomic<int64_t> counter{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Args<T> mine = a;
    for (int64_t c = counter.fetch_add(chunk); c < Q;) {
      const int64_t n = counter.fetch_add(chunk);
      mine.after = n < Q ? n : -1;
      run_panels(mine, c, std::min(Q, c + chunk));
      c = n;
    }
  });
}

void check_cpu_float(const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), what, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK_VALUE(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat, what,
                    " must be bfloat16 or float32, got ", t.scalar_type());
}

int64_t depth_of(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 ? 2 : 1; }

// Whether this build packs a dtype's panels split into runs of kRunCols columns (the
// layout): those the AVX2 tiles run.
bool split_panels(at::ScalarType dtype) {
  return (dtype == at::kFloat ? path_for<float>() : path_for<uint16_t>()) == Path::kAvx2;
}

// [N, K] -> [P, Ks, kNR * D], zero-padded (see the layout above).
at::Tensor pack(const at::Tensor& weight) {
  check_cpu_float(weight, "weight");
  TORCH_CHECK_VALUE(weight.dim() == 2, "weight must be [N, K], got ", weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1), D = depth_of(weight);
  const int64_t P = (N + kNR - 1) / kNR, Ks = (K + D - 1) / D;
  at::Tensor padded = at::zeros({P * kNR, Ks * D}, weight.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  if (split_panels(weight.scalar_type()))  // [P, 3, 16, Ks, D] -> [P, 3, Ks, 16, D]
    return padded.view({P, kNR / kRunCols, kRunCols, Ks, D})
        .permute({0, 1, 3, 2, 4})
        .contiguous()
        .view({P, Ks, kNR * D});
  // [P, 48, Ks, D] -> [P, Ks, 48, D]
  return padded.view({P, kNR, Ks, D}).permute({0, 2, 1, 3}).contiguous().view({P, Ks, kNR * D});
}

// [2 I, K] gate_up -> the panels of gate rows [48 j, 48 j + 48) and of the same up rows
// in turn (each zero-padded to 48 rows), packed as pack() does.
at::Tensor pack_gated(const at::Tensor& weight) {
  check_cpu_float(weight, "weight");
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(0) % 2 == 0,
                    "gate_up weight must be [2 * intermediate, K], got ", weight.sizes());
  const int64_t I = weight.size(0) / 2, K = weight.size(1), Q = (I + kNR - 1) / kNR;
  at::Tensor halves[2];  // gate, up: [Q * 48, K], zero past I
  for (int64_t h = 0; h < 2; ++h) {
    halves[h] = at::zeros({Q * kNR, K}, weight.options());
    halves[h].narrow(0, 0, I).copy_(weight.narrow(0, h * I, I));
  }
  // [pair, gate/up, row, K]
  const at::Tensor pairs = at::stack({halves[0].view({Q, kNR, K}), halves[1].view({Q, kNR, K})}, 1);
  return pack(pairs.view({2 * Q * kNR, K}));
}

#ifdef PAGODA_GEMM_AVX2
// The bf16 rows [M, K] (row stride ldx) widened to fp32 (exact) in the calling thread's
// buffer, which the call's tiles read: one ATen to() per linear cost a few microseconds
// of dispatch and allocation, 121 times a SmolLM2 step, a tenth of a batch-1 step's
// non-GEMM time. Large inputs are widened on the pool.
const float* widen_rows(const uint16_t* x, int64_t M, int64_t K, int64_t ldx) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < M * K) buffer.resize(M * K);
  float* out = buffer.data();
  auto rows = [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const uint16_t* src = x + m * ldx;
      float* dst = out + m * K;
      int64_t k = 0;
      for (; k + 8 <= K; k += 8) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k));
        _mm256_storeu_ps(dst + k, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
      }
      for (; k < K; ++k) dst[k] = to_f32(src[k]);
    }
  };
  constexpr int64_t kSerialElems = 1 << 16;  // below this a parallel region costs more
  if (M * K <= kSerialElems) rows(0, M);
  else at::parallel_for(0, M, std::max<int64_t>(1, kSerialElems / K), rows);
  return out;
}
#endif

at::Tensor run_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t n,
                      const std::optional<at::Tensor>& bias_in, bool gated) {
  check_cpu_float(x_in, "x");
  check_cpu_float(packed, "packed");
  TORCH_CHECK_VALUE(x_in.scalar_type() == packed.scalar_type(), "x is ", x_in.scalar_type(),
                    " but the packed weight is ", packed.scalar_type());
  TORCH_CHECK_VALUE(x_in.dim() == 2, "x must be [M, K], got ", x_in.sizes());
  const int64_t M = x_in.size(0), K = x_in.size(1), D = depth_of(x_in);
  const int64_t G = group_panels(gated), Q = (n + kNR - 1) / kNR, Ks = (K + D - 1) / D;
  const int64_t bias_len = G * n;
  TORCH_CHECK_VALUE(n >= 0 && packed.dim() == 3 && packed.is_contiguous() &&
                        packed.size(0) == G * Q && packed.size(1) == Ks &&
                        packed.size(2) == kNR * D,
                    "packed weight ", packed.sizes(), " is not ", gated ? "pack_gated" : "pack",
                    "() of a [", bias_len, ", ", K, "] weight");
  at::Tensor bias;
  if (bias_in.has_value()) {
    TORCH_CHECK_VALUE(bias_in->scalar_type() == x_in.scalar_type() && bias_in->dim() == 1 &&
                          bias_in->size(0) == bias_len && bias_in->device().is_cpu(),
                      "bias must be a CPU [", bias_len, "] ", x_in.scalar_type(),
                      " tensor, got ", bias_in->sizes(), " ", bias_in->scalar_type());
    bias = bias_in->contiguous();
  }
  at::Tensor out = at::empty({M, n}, x_in.options());
  if (M == 0 || n == 0) return out;
  // rows may be any distance apart; a row must be adjacent elements, padded to Ks * D
  at::Tensor x = x_in;
  if (x.stride(1) != 1 || K % D != 0 || K == 0) {
    x = at::zeros({M, std::max<int64_t>(Ks, 1) * D}, x_in.options());
    x.narrow(1, 0, K).copy_(x_in);
  }
  auto run = [&](auto element) {  // float, or uint16_t for bf16 bits (checked above)
    using T = decltype(element);
    Args<T> a{static_cast<const T*>(x.const_data_ptr()),
              static_cast<const T*>(packed.const_data_ptr()),
              bias.defined() ? static_cast<const T*>(bias.const_data_ptr()) : nullptr,
              static_cast<T*>(out.mutable_data_ptr()), M, n, Ks, x.stride(0), gated};
#ifdef PAGODA_GEMM_AVX2
    if constexpr (widened_x<T>()) {
      a.xf = widen_rows(a.x, M, Ks * 2, a.ldx);
      a.ldxf = Ks * 2;
    }
#endif
    const int64_t threads = at::get_num_threads();
    if (path_for<T>() == Path::kAvx2 && M <= kDealMaxRows && Q >= 4 * threads && threads > 1) {
      deal_chunks(a, Q, threads);
    } else {
      at::parallel_for(0, Q, 1, [&](int64_t q0, int64_t q1) { run_panels(a, q0, q1); });
    }
  };
  if (x.scalar_type() == at::kFloat) run(float{});
  else run(uint16_t{});
  return out;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                  const std::optional<at::Tensor>& bias) {
  return run_linear(x, packed, n, bias, false);
}

// silu(x W_gate^T + b_gate) * (x W_up^T + b_up) for packed = pack_gated([W_gate; W_up]), n
// the intermediate size, bias [2 n] or none: the rounding of linear() then silu_mul.
at::Tensor linear_silu(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                       const std::optional<at::Tensor>& bias) {
  return run_linear(x, packed, n, bias, true);
}

// Which dtypes run the vector kernels (else the portable loops): "float32", "bfloat16"
std::vector<std::string> simd_dtypes() {
  std::vector<std::string> out;
  if (path_for<float>() != Path::kPortable) out.emplace_back("float32");
  if (path_for<uint16_t>() != Path::kPortable) out.emplace_back("bfloat16");
  return out;
}

// Which tiles each dtype runs: {"float32": "avx512" | "avx2" | "portable", "bfloat16": the
// same or "avx512_widen" (AVX-512 tiles without a bf16 dot product)}
std::vector<std::string> tile_paths() {
  auto name = [](Path p) {
    return p == Path::kAvx512 ? "avx512" : p == Path::kAvx2 ? "avx2" : "portable";
  };
  return {name(path_for<float>()),
          path_for<uint16_t>() == Path::kAvx512 && widened_x<uint16_t>()
              ? "avx512_widen"
              : name(path_for<uint16_t>())};
}

}  // namespace

#define PAGODA_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
PAGODA_LIBRARY(PAGODA_OP_NS, m) {
  m.def("pack(Tensor weight) -> Tensor", &pack);
  m.def("pack_gated(Tensor weight) -> Tensor", &pack_gated);
  m.def("linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor", &linear);
  m.def("linear_silu(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor", &linear_silu);
  m.def("simd_dtypes() -> str[]", &simd_dtypes);
  m.def("tile_paths() -> str[]", &tile_paths);
}
